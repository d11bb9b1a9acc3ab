"""Constants that ops build on the host from shapes alone, kept on the device: :func:`device_constant`.

Adaptive mean pooling's averaging matrices, linear upsampling's interpolation weights and a half-precision factor
are small arrays computed with NumPy from a shape. Copied to the device at every call, they would be a
host-to-device transfer inside every training step, which a CUDA-graph capture cannot record (a captured step
replays without the host). So each is built and copied once per (what, dtype, array module, device) and kept here:
a captured step reads the same device array at every replay, and the graph holds it
(:func:`fluxpy.backend.hold_in_capture`), so an entry dropped from the cache is not freed under the graph. The
cache is bounded: past :data:`LIMIT` entries the least recently used goes. A constant first asked for inside a
capture is refused (:func:`fluxpy.capturing.refuse`): the eager warm-up steps of a :class:`fluxpy.TrainStep` build
them before it captures.

>>> import numpy as np
>>> a = device_constant(("ramp", 3), lambda: np.arange(3.0), np.ones(2, np.float32))
>>> a, a is device_constant(("ramp", 3), lambda: np.arange(3.0), np.ones(5, np.float32))
(array([0., 1., 2.], dtype=float32), True)
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from ..autodiff import value_of
from ..backend import Array, get_array_module, gpu_device, hold_in_capture
from ..capturing import refuse

__all__ = ["device_constant", "clear_constants", "constants_held", "LIMIT"]

LIMIT = 256   # entries kept (each a few small matrices' worth: a (P, H) matrix per pooled or upsampled axis)

_cache: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def device_constant(key: Hashable, build: Callable[[], np.ndarray], like: Any, dtype: Any = None) -> Array:
    """The host array ``build()`` as an array of ``like``'s module and device in ``dtype`` (default ``like``'s),
    built and copied once per ``(key, dtype, module, device)``. ``key`` must name everything ``build`` depends on.
    The array is shared: never write into it (NumPy's is read-only).

    >>> import numpy as np
    >>> device_constant(("half", 0.5), lambda: np.asarray(0.5), np.ones(1, np.float16)).dtype
    dtype('float16')
    """
    v = value_of(like)
    xp = get_array_module(v)
    dtype = np.dtype(v.dtype if dtype is None else dtype)
    full = (key, dtype, xp.__name__, gpu_device(v))
    with _lock:
        found = _cache.get(full)
        if found is not None:
            _cache.move_to_end(full)
    if found is None:
        refuse(f"{key[0] if isinstance(key, tuple) else key}: a constant built on the host is not on the device yet "
               f"(it is copied once, by an eager step, before a step is captured)")
        found = xp.asarray(np.asarray(build()).astype(dtype))
        if isinstance(found, np.ndarray):
            found.flags.writeable = False
        with _lock:
            found = _cache.setdefault(full, found)
            while len(_cache) > LIMIT:
                _cache.popitem(last=False)
    hold_in_capture(found)
    return found


def clear_constants() -> None:
    """Forget every cached constant (the arrays live on where something still holds them).

    >>> clear_constants(); constants_held()
    0
    """
    with _lock:
        _cache.clear()


def constants_held() -> int:
    """How many constants the cache holds now (at most :data:`LIMIT`).

    >>> constants_held() <= LIMIT
    True
    """
    with _lock:
        return len(_cache)
