"""Channels-last memory: arrays whose shape stays ``(N, C, *spatial)`` but whose channels are the fastest axis in
memory (PyTorch's ``torch.channels_last``), so cuDNN's tensor-core convolutions read and write them without
transposing.

An array is *channels-last* when its strides are those of the ``(N, *spatial, C)`` array it views and it is not
also C-contiguous (one channel, or one pixel, is both: it counts as the usual layout). The ops keep the layout:

- a convolution computes in channels-last memory when its input or its weight is channels-last, and then gives its
  output and its gradients channels-last (``fluxpy.kernels.cudnn.graph``);
- batch norm, pooling, the reductions behind ``unbroadcast`` and every elementwise primitive take it and return
  their full-size results in it (:func:`keep_layout`); results that NumPy defines by element order (``reshape``,
  ``flatten``) are computed as ever.

NumPy's own ufuncs keep a layout already (``order="K"``); CuPy's write C order, which :func:`keep_layout` undoes
for CuPy by running them on the ``(N, *spatial, C)`` views. So the layout is kept by fluxpy's ops (and by
arithmetic on Tracked values, inside a gradient or a TrainStep, which goes through them); CuPy's own operators on
plain CuPy arrays (``a + b`` outside a gradient) write C order, as CuPy does (correct, one transposition).

>>> import numpy as np
>>> x = to_channels_last(np.arange(24.0).reshape(1, 2, 3, 4))
>>> x.shape, is_channels_last(x), x.strides
((1, 2, 3, 4), True, (192, 8, 64, 16))
>>> bool((x == np.arange(24.0).reshape(1, 2, 3, 4)).all())
True
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .backend import DeviceArray, get_array_module

__all__ = ["is_channels_last", "made_channels_last", "to_channels_last", "to_contiguous", "empty_channels_last",
           "channels_last_strides", "like_layout", "keep_layout", "keeping_layout", "to_memory_format",
           "MEMORY_FORMATS"]

MEMORY_FORMATS = ("contiguous", "channels_last")
"""The memory formats :func:`fluxpy.gpu` and :func:`fluxpy.layout.to_memory_format` take."""


def channels_last_strides(shape: tuple, itemsize: int) -> tuple:
    """The byte strides of a dense channels-last array of ``shape`` ``(N, C, *spatial)``.

    >>> channels_last_strides((2, 3, 4, 5), 4)
    (240, 4, 60, 12)
    """
    c = shape[1]
    strides = [0] * len(shape)
    step = itemsize * c
    for axis in range(len(shape) - 1, 1, -1):
        strides[axis] = step
        step *= shape[axis]
    strides[1] = itemsize
    strides[0] = step
    return tuple(strides)


def is_channels_last(a: Any) -> bool:
    """Whether ``a`` (NumPy or CuPy, 3 or more axes) is channels-last and not also C-contiguous.

    >>> import numpy as np
    >>> is_channels_last(np.ones((2, 3, 4, 5))), is_channels_last(to_channels_last(np.ones((2, 3, 4, 5))))
    (False, True)
    """
    if type(a) is DeviceArray:
        if a._c_contiguous:
            return False
    elif not isinstance(a, np.ndarray) or a.flags.c_contiguous:
        return False
    key = (a.shape, a.strides, a.itemsize)
    hit = _LAYOUTS.get(key)
    if hit is None:
        if len(_LAYOUTS) > 4096:
            _LAYOUTS.clear()
        want = channels_last_strides(a.shape, a.itemsize) if a.ndim >= 3 else ()
        hit = _LAYOUTS[key] = a.ndim >= 3 and all(s == w or n == 1 for s, w, n in zip(a.strides, want, a.shape))
    return hit


_LAYOUTS: dict = {}   # (shape, strides, itemsize) -> channels-last (a few microseconds saved per call)


def _last(ndim):
    """The axis order of the ``(N, *spatial, C)`` view."""
    return (0, *range(2, ndim), 1)


def _first(ndim):
    """The inverse of :func:`_last`."""
    return (0, ndim - 1, *range(1, ndim - 1))


def to_channels_last(a: Any) -> Any:
    """``a`` (``(N, C, *spatial)``, NumPy or CuPy) in channels-last memory: itself where it already is, else a copy.

    >>> import numpy as np
    >>> to_channels_last(np.ones((2, 3, 4))).strides
    (96, 8, 24)
    >>> one_channel = np.ones((2, 1, 3, 4))
    >>> to_channels_last(one_channel).strides, np.shares_memory(to_channels_last(one_channel), one_channel)
    ((96, 8, 32, 8), True)
    """
    if a.ndim < 3:
        raise ValueError(f"to_channels_last expects an array of 3 or more axes (N, C, *spatial), got shape "
                         f"{tuple(a.shape)}")
    if is_channels_last(a):
        return a
    order = _last(a.ndim)
    if _c_order(a) and (a.shape[1] == 1 or a.size == a.shape[0] * a.shape[1]):
        # one channel or one pixel: C order is already channels-last memory; a view with channels-last strides
        return a.reshape(tuple(a.shape[i] for i in order)).transpose(_first(a.ndim))
    return get_array_module(a).ascontiguousarray(a.transpose(order)).transpose(_first(a.ndim))


def _c_order(a) -> bool:
    return a._c_contiguous if type(a) is DeviceArray else a.flags.c_contiguous


def made_channels_last(a: Any) -> bool:
    """Whether ``a`` is channels-last (:func:`is_channels_last`), or is one of the arrays that are both layouts (one
    channel, or one pixel) and carries exactly the channels-last strides, as :func:`to_channels_last` gives them,
    rather than C order's: what a convolution asks of its operands to pick its memory layout, so that a one-channel
    image with its one-channel weights, both moved to channels-last, gives a channels-last output.

    >>> import numpy as np
    >>> image = np.ones((2, 1, 3, 4))
    >>> moved = to_channels_last(image)
    >>> made_channels_last(image), made_channels_last(moved), is_channels_last(moved)
    (False, True, False)
    """
    if is_channels_last(a):
        return True
    shape = getattr(a, "shape", ())
    if len(shape) < 3 or not (shape[1] == 1 or a.size == shape[0] * shape[1]):
        return False
    want = channels_last_strides(shape, a.itemsize)
    return a.strides == want and want != _c_strides(shape, a.itemsize)


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def to_contiguous(a: Any) -> Any:
    """``a`` in C order: itself where it is, else a copy.

    >>> import numpy as np
    >>> to_contiguous(to_channels_last(np.ones((2, 3, 4)))).flags.c_contiguous
    True
    """
    return get_array_module(a).ascontiguousarray(a)


def empty_channels_last(shape: tuple, dtype: Any, xp: Any = np) -> Any:
    """A new uninitialised channels-last array of ``shape`` ``(N, C, *spatial)`` (``xp``: ``numpy`` or ``cupy``).

    >>> empty_channels_last((2, 3, 4, 5), np.float32).strides
    (240, 4, 60, 12)
    """
    ndim = len(shape)
    return xp.empty(tuple(shape[i] for i in _last(ndim)), dtype=dtype).transpose(_first(ndim))


def like_layout(a: Any, ref: Any) -> Any:
    """``a`` in ``ref``'s layout (channels-last where ``ref`` is, else C order), copied only where needed.

    >>> import numpy as np
    >>> ref = to_channels_last(np.ones((1, 2, 3, 3)))
    >>> is_channels_last(like_layout(np.ones((1, 2, 3, 3)), ref))
    True
    """
    if is_channels_last(ref):
        return a if is_channels_last(a) else to_channels_last(a)
    if type(a) is DeviceArray and a._c_contiguous and a.ndim:   # what ascontiguousarray gives back as it is
        return a
    return to_contiguous(a)


def _views(args, ndim):
    """The arguments as their channels-last views: arrays of ``ndim`` axes transposed, shorter ones padded with
    unit axes first (broadcasting as before), scalars as they are."""
    order = _last(ndim)
    out = []
    for a in args:
        if type(a) is DeviceArray and a.ndim:
            if a.ndim < ndim:
                a = a.reshape((1,) * (ndim - a.ndim) + a.shape)
            a = a.transpose(order)
        out.append(a)
    return out


def _back(y, ndim):
    if type(y) is DeviceArray and y.ndim == ndim:
        return y.transpose(_first(ndim))
    if isinstance(y, tuple):
        return tuple(_back(v, ndim) for v in y)
    return y


def keeping_layout(fn: Callable, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` for an elementwise ``fn`` on GPU arrays, its full-size results channels-last where an
    argument of the full rank is (CuPy's kernels write C order; NumPy's keep the layout themselves). Arguments
    that are not plain arrays (Tracked values, lists) are passed as they are.

    >>> import numpy as np
    >>> keeping_layout(np.add, np.ones(2), 1.0)
    array([2., 2.])
    """
    if not any([type(a) is DeviceArray for a in args]):   # no GPU array: nothing to keep (the common CPU call)
        return fn(*args, **kw)
    ndim = 0
    for a in args:
        if type(a) is DeviceArray:
            if a.ndim > ndim:
                ndim = a.ndim
        elif hasattr(a, "shape") and not isinstance(a, np.ndarray | np.generic):
            return fn(*args, **kw)          # a Tracked value: its primitive keeps the layout
    if ndim < 3 or not any(type(a) is DeviceArray and a.ndim == ndim and is_channels_last(a) for a in args):
        return fn(*args, **kw)
    try:
        np.broadcast_shapes(*(a.shape for a in args if type(a) is DeviceArray))
    except ValueError:
        return fn(*args, **kw)   # shapes that do not broadcast: fn's own error names them as given
    return _back(fn(*_views(args, ndim), **kw), ndim)


def keep_layout(fn: Callable) -> Callable:
    """``fn`` (an elementwise implementation) made to keep the channels-last layout: see :func:`keeping_layout`.

    >>> import numpy as np
    >>> keep_layout(np.multiply)(np.ones(2), 3.0)
    array([3., 3.])
    """
    def call(*args, **kw):
        return keeping_layout(fn, *args, **kw)
    call.__name__ = getattr(fn, "__name__", "elementwise")
    call.__doc__ = fn.__doc__
    call.__wrapped__ = fn
    return call


def to_memory_format(a: Any, memory: str) -> Any:
    """``a`` in ``memory`` format: ``"channels_last"`` moves arrays of 4 axes (convolution weights ``(K, C, R, S)``,
    images ``(N, C, H, W)``) to channels-last memory; ``"contiguous"`` gives C order. Other arrays are returned
    as they are.

    >>> import numpy as np
    >>> is_channels_last(to_memory_format(np.ones((4, 3, 3, 3)), "channels_last"))
    True
    """
    if memory not in MEMORY_FORMATS:
        raise ValueError(f"memory must be one of {MEMORY_FORMATS}, got {memory!r}")
    if getattr(a, "ndim", 0) != 4:
        return a
    return to_channels_last(a) if memory == "channels_last" else to_contiguous(a)
