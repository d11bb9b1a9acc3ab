"""One cuDNN handle per device bound to CuPy's current stream, the workspace of a call (:class:`Workspace`, from
CuPy's pool for that call only), and :func:`options_key`: the options (:mod:`fluxpy.options`) that plans and
algorithm choices depend on.

>>> options_key() == (False, False, 4 << 30)   # the defaults
True
"""
from __future__ import annotations

import ctypes

from ...backend import cupy
from ...options import options
from .errors import check
from .library import fn, require

__all__ = ["options_key", "get_handle", "Workspace"]


def options_key() -> tuple:
    """``(allow_tf32, deterministic, workspace_limit)``: the options that plans and algorithm choices depend on
    (part of their cache keys).

    >>> with options(deterministic=True):
    ...     options_key()[1]
    True
    """
    return options.allow_tf32, options.deterministic, options.workspace_limit


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
    would hold the largest workspace for the whole run, a large share of a training step's memory).

    >>> Workspace(0).ptr
    0
    """
    __slots__ = ("mem", "ptr")

    def __init__(self, nbytes: int) -> None:
        self.mem = cupy.cuda.alloc(nbytes) if nbytes else None
        self.ptr = self.mem.ptr if nbytes else 0


