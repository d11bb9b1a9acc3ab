"""The options of the binding, one cuDNN handle per device bound to CuPy's current stream, and the
workspace of a call (:class:`Workspace`, from CuPy's pool for that call only).

Options (:func:`set_options`): ``allow_tf32``, ``deterministic``, ``workspace_limit``, ``disk_cache``,
``index_checks``; :data:`OPTIONS` is the live table (read it; change it with :func:`set_options`), and
:func:`options_key` the part of it that selects algorithms and plans (a cache key).

>>> sorted(get_options())
['allow_tf32', 'deterministic', 'disk_cache', 'index_checks', 'workspace_limit']
"""
from __future__ import annotations

import ctypes

from ...backend import cupy
from .errors import check
from .library import fn, require

__all__ = ["set_options", "get_options", "options_key", "OPTIONS", "INDEX_CHECKS", "get_handle", "Workspace"]

OPTIONS = {"allow_tf32": False, "deterministic": False, "workspace_limit": 4 << 30, "disk_cache": True,
           "index_checks": "wait"}
_options_key = (False, False, 4 << 30)

INDEX_CHECKS = ("wait", "deferred")
"""The values of the ``index_checks`` option."""


def set_options(**options) -> dict:
    """Set any of ``allow_tf32``, ``deterministic``, ``workspace_limit``, ``disk_cache``, ``index_checks``
    (None: unchanged). They are kernel options: one switch for every kernel, cuDNN's and fluxpy's own.

    - ``allow_tf32`` (default False): float32 convolutions may use TF32 tensor cores (about 3e-4
      relative error). Off, they run with ``CUDNN_FMA_MATH``. float16 always may use tensor cores;
      float64 never does.
    - ``deterministic`` (default False): only algorithms that cuDNN marks deterministic (and only the
      deterministic scatter implementations).
    - ``workspace_limit`` (default 4 GiB): the most workspace, in bytes, an algorithm may take.
    - ``disk_cache`` (default True): read and write the algorithm choices on disk.
    - ``index_checks`` (default ``"wait"``): how ``scatter``/``gather`` report a GPU index out of range,
      which their kernels find (and skip) as they read it. ``"wait"``: the call waits for its kernel and
      raises ``IndexError``. ``"deferred"``: the call does not wait (PyTorch's device-side asserts, CUDA.jl's
      kernel errors at the next synchronization); the error is raised for it by the next checked call, or by
      ``fluxpy.check_indices()``, which waits. Indices on the host are checked before any work either way.

    Returns the previous options (a dict), so ``set_options(**old)`` restores them. Changing
    the first three selects algorithms afresh (they are part of the cache key).

    >>> old = set_options(deterministic=True)
    >>> get_options()["deterministic"]
    True
    >>> _ = set_options(index_checks="deferred"); get_options()["index_checks"]
    'deferred'
    >>> set_options(index_checks="later")
    Traceback (most recent call last):
    ...
    ValueError: set_options: index_checks must be one of ('wait', 'deferred'), got 'later'
    >>> _ = set_options(**old)
    """
    global _options_key
    for k in options:   # every name and value checked before any option changes
        if k not in OPTIONS:
            raise TypeError(f"set_options: unknown option {k!r}; expected one of {sorted(OPTIONS)}")
    new = {k: _checked_option(k, v) for k, v in options.items() if v is not None}
    old = dict(OPTIONS)
    OPTIONS.update(new)
    _options_key = (OPTIONS["allow_tf32"], OPTIONS["deterministic"], OPTIONS["workspace_limit"])
    return old


def _checked_option(name, value):
    """``value`` as the option ``name`` holds it (a bool, an int or one of :data:`INDEX_CHECKS`)."""
    if name == "index_checks":
        if not (isinstance(value, str) and value in INDEX_CHECKS):
            raise ValueError(f"set_options: index_checks must be one of {INDEX_CHECKS}, got {value!r}")
        return value
    return int(value) if name == "workspace_limit" else bool(value)


def get_options() -> dict:
    """The current options (a copy).

    >>> get_options()["allow_tf32"] in (True, False)
    True
    """
    return dict(OPTIONS)


def options_key() -> tuple:
    """``(allow_tf32, deterministic, workspace_limit)``: the options that plans and algorithm choices depend on.

    >>> options_key() == tuple(get_options()[k] for k in ("allow_tf32", "deterministic", "workspace_limit"))
    True
    """
    return _options_key


class _Handle:
    __slots__ = ("ptr", "stream")

    def __init__(self, ptr):
        self.ptr, self.stream = ptr, -1


_handles = {}         # device -> _Handle


def get_handle() -> int:
    """The ``cudnnHandle_t`` (an int) of the current device, bound to CuPy's current stream.

    Created on a device's first use (raising ``RuntimeError`` saying why where cuDNN cannot run);
    ``cudnnSetStream`` whenever the current stream has changed since the last call."""
    dev = cupy.cuda.runtime.getDevice()
    h = _handles.get(dev)
    if h is None:
        require()
        p = ctypes.c_void_p()
        check(fn.cudnnCreate(ctypes.byref(p)), "cudnnCreate", f"device {dev}")
        h = _handles[dev] = _Handle(p.value)
    s = cupy.cuda.get_current_stream().ptr
    if s != h.stream:
        check(fn.cudnnSetStream(h.ptr, s), "cudnnSetStream", f"stream {s:#x}")
        h.stream = s
    return h.ptr


class Workspace:
    """Workspace memory for one cuDNN call: ``ptr`` (0 for none); hold the object until the call is queued.

    Taken from CuPy's memory pool per call and given back right after, as PyTorch does: the pool keeps
    freed blocks per stream, so work already queued on this stream finishes before a later allocation
    can reuse the block, and the workspace is in use only while a call runs (a buffer kept between calls
    holds the largest workspace for the whole run: 142 MB of a 460 MB ResNet-20 step, measured).

    >>> Workspace(0).ptr
    0
    """
    __slots__ = ("mem", "ptr")

    def __init__(self, nbytes: int) -> None:
        self.mem = cupy.cuda.alloc(nbytes) if nbytes else None
        self.ptr = self.mem.ptr if nbytes else 0


