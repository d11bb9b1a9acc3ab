"""Array backends: NumPy on the CPU, CuPy on an NVIDIA GPU.

Every op in fluxpy is written once against an array module ``xp`` found by
:func:`get_array_module`; only ``fluxpy/kernels`` knows about CUDA.

>>> import numpy as np
>>> get_array_module(np.ones(3)) is np
True
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

try:  # CuPy is optional (the ``cuda`` extra); any failure just means "no GPU backend".
    import cupy as _cupy
    _CUPY_IMPORT_ERROR: BaseException | None = None
except Exception as err:  # pragma: no cover - depends on the machine
    _cupy = None
    _CUPY_IMPORT_ERROR = err

cupy = _cupy

__all__ = ["get_array_module", "is_array", "to_gpu", "to_cpu", "copy_into", "gpu_available", "GPUUnavailableError",
           "default_float", "is_float_array", "reduced_axes", "record_event", "event_seconds", "Array"]

default_float = np.float32

Array = Any  # a NumPy or CuPy ndarray, or a Tracked value (fluxpy.autodiff) wrapping one


class GPUUnavailableError(RuntimeError):
    """Raised by :func:`gpu` when CuPy or a CUDA device cannot be used; the message says why."""


def _unwrap(x):
    # Tracked values (fluxpy.autodiff) carry their array in ``.value``, possibly nested.
    while getattr(x, "__fluxpy_tracked__", False):
        x = x.value
    return x


def get_array_module(*xs: Any) -> ModuleType:
    """The array module, ``numpy`` or ``cupy``, that owns the arrays among ``xs``.

    Tracked values are looked through. Mixing NumPy and CuPy arrays is an error
    that names both.

    >>> import numpy as np
    >>> get_array_module(np.zeros(2), 3.0).__name__
    'numpy'
    """
    found = None
    for x in xs:
        x = _unwrap(x)
        if isinstance(x, np.ndarray):
            if found == "gpu":
                raise TypeError(_mixed_message(xs))
            found = "cpu"
        elif cupy is not None and isinstance(x, cupy.ndarray):
            if found == "cpu":
                raise TypeError(_mixed_message(xs))
            found = "gpu"
    return cupy if found == "gpu" else np


def _mixed_message(xs):
    parts = [f"{type(_unwrap(x)).__module__}.{type(_unwrap(x)).__name__} {getattr(x, 'shape', '')}" for x in xs]
    return "cannot mix CPU (numpy) and GPU (cupy) arrays in one op; got " + ", ".join(parts) + \
        ": move them with fluxpy.gpu(...) or fluxpy.cpu(...)"


def is_array(x: Any) -> bool:
    """True for a NumPy or CuPy ndarray (not for Python numbers or Tracked values).

    >>> import numpy as np
    >>> is_array(np.ones(2)), is_array(1.0)
    (True, False)
    """
    return isinstance(x, np.ndarray) or (cupy is not None and isinstance(x, cupy.ndarray))


def is_float_array(x: Any) -> bool:
    """True for a NumPy/CuPy array of a floating dtype: the arrays that gradients flow to.

    >>> import numpy as np
    >>> is_float_array(np.ones(2)), is_float_array(np.arange(2))
    (True, False)
    """
    return is_array(x) and np.issubdtype(x.dtype, np.floating)


def reduced_axes(gshape: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The axes of a broadcast result ``gshape`` to sum so it collapses to ``shape``.

    >>> reduced_axes((4, 2, 3), (2, 1))
    (0, 2)
    """
    gshape, shape = tuple(gshape), tuple(shape)
    extra = len(gshape) - len(shape)
    if extra < 0 or any(s != 1 and s != g for s, g in zip(shape, gshape[extra:])):
        raise ValueError(f"unbroadcast: a gradient of shape {gshape} cannot come from broadcasting shape {shape}")
    return tuple(range(extra)) + tuple(extra + i for i, s in enumerate(shape) if s == 1 and gshape[extra + i] != 1)


def gpu_available() -> tuple[bool, str]:
    """Whether a CUDA GPU can be used through CuPy, and if not, why: ``(usable, reason)``.

    >>> ok, why = gpu_available()
    >>> isinstance(ok, bool) and isinstance(why, str)
    True
    """
    if cupy is None:
        return False, f"CuPy could not be imported ({_CUPY_IMPORT_ERROR!r}); install fluxpy[cuda]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CUDA driver missing, no device, ...
        return False, f"CuPy is installed but CUDA is not usable: {err}"
    if count == 0:
        return False, "CuPy is installed but no CUDA device was found"
    return True, f"{count} CUDA device(s)"


def to_gpu(a: Array) -> Array:
    """A CuPy copy of a NumPy array (a CuPy array as it is); raises :class:`GPUUnavailableError`, saying why,
    when no GPU is usable. :func:`fluxpy.gpu` moves whole model trees with it.

    >>> import numpy as np
    >>> try:
    ...     y = to_gpu(np.ones(3))
    ... except GPUUnavailableError:
    ...     y = None   # no GPU on this machine
    """
    ok, why = gpu_available()
    if not ok:
        raise GPUUnavailableError(f"fluxpy.gpu: no usable GPU: {why}")
    return cupy.asarray(a)


def to_cpu(a: Any) -> Any:
    """A NumPy copy of a CuPy array; anything else as it is. :func:`fluxpy.cpu` moves whole trees with it.

    >>> import numpy as np
    >>> to_cpu(np.ones(2))
    array([1., 1.])
    """
    if cupy is not None and isinstance(a, cupy.ndarray):
        return cupy.asnumpy(a)
    return a


def copy_into(dst: Array, src: Array) -> None:
    """Copy ``src`` into ``dst`` in place (``dst[...] = src``), across devices: ``src`` is moved to ``dst``'s
    device first.

    >>> import numpy as np
    >>> dst = np.zeros(2); copy_into(dst, np.ones(2)); dst
    array([1., 1.])
    """
    dst[...] = get_array_module(dst).asarray(to_cpu(src) if isinstance(dst, np.ndarray) else src)


def record_event() -> Any:
    """A CUDA event recorded now on the current stream, for timing GPU work (:func:`fluxpy.profile`).

    >>> callable(record_event)
    True
    """
    event = cupy.cuda.Event()
    event.record()
    return event


def event_seconds(start: Any, end: Any) -> float:
    """Seconds of GPU time between two :func:`record_event` events (waits for ``end``).

    >>> callable(event_seconds)
    True
    """
    return cupy.cuda.get_elapsed_time(start, end) / 1e3
