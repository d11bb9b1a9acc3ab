"""Nearest upsampling by whole scales on the GPU (``cuda/upsample.cu``): one launch each way, for CuPy arrays of one
to three spatial axes in C order, or 4-d channels-last, of every kernel dtype.

The composite (a broadcast of the input to ``(N, C, H, sh, W, sw)`` made contiguous, and its gradient, the sums over
the scale's axes through a transposing reduction) copies and permutes the data several times, and moves halves an item
at a time. Here the forward is a gather, each output value reading its input value's bits, and the backward gives each
input value the sum of its ``sh * sw`` output cotangents, added in a fixed order in the compute type and rounded once.

>>> sorted(KERNELS)
['upsample_nearest', 'upsample_nearest_backward']
"""
from __future__ import annotations

import numpy as np

from ..backend import cupy
from ..layout import is_channels_last
from . import compiler
from .halfs import KERNEL_DTYPES, dtype_defines

__all__ = ["supports", "forward", "backward", "SOURCE_VARIANTS", "KERNELS"]

_THREADS = 256


def SOURCE_VARIANTS():
    """``(source, defines)`` of every variant launched: one a kernel dtype.

    >>> len(list(SOURCE_VARIANTS()))
    4
    """
    for dtype in KERNEL_DTYPES:
        yield "upsample.cu", dtype_defines(dtype)


def _layout(x):
    """``"C"`` or ``"CL"`` (4-d channels-last) where the kernels read ``x`` as it is, else None."""
    if x._c_contiguous:
        return "C"
    return "CL" if x.ndim == 4 and is_channels_last(x) else None


def supports(x, scales) -> bool:
    """A CuPy array of a kernel dtype, ``(N, C)`` and one to three spatial axes, C order or 4-d channels-last, and a
    whole scale of at least 1 for each spatial axis."""
    if type(x) is not cupy.ndarray or x.dtype not in KERNEL_DTYPES or not 3 <= x.ndim <= 5 or x.size == 0:
        return False
    if len(scales) != x.ndim - 2 or any(not isinstance(s, (int, np.integer)) or s < 1 for s in scales):
        return False
    return _layout(x) is not None


def _geometry(out_shape, scales, cl):
    """The kernels' geometry arguments: output (D, H, W), channels, the scales (D, H, W), channels-last."""
    spatial = (1,) * (5 - len(out_shape)) + tuple(out_shape[2:])
    padded = (1,) * (3 - len(scales)) + tuple(scales)
    return (*(np.int64(v) for v in spatial), np.int64(out_shape[1]), *(np.int32(s) for s in padded), np.int32(cl))


def _blocks(total, dev):
    return (int(max(1, min(-(-total // _THREADS), 32 * compiler.device(dev).processors))),)


def forward(x, scales):
    """``x`` repeated ``scales[i]`` times along spatial axis ``i``, in ``x``'s layout."""
    cl = _layout(x) == "CL"
    out_shape = tuple(x.shape[:2]) + tuple(n * s for n, s in zip(x.shape[2:], scales))
    y = cupy.empty(out_shape, x.dtype) if not cl else \
        cupy.empty((out_shape[0], *out_shape[2:], out_shape[1]), x.dtype).transpose(0, 3, 1, 2)
    fn = compiler.function("upsample.cu", "nearest_forward", dtype_defines(x.dtype))
    fn(_blocks(y.size, x.device.id), (_THREADS,), (x, y, np.int64(y.size), *_geometry(out_shape, scales, cl)))
    return y


def backward(dy, x_shape, scales, layout_of):
    """The gradient of :func:`forward`: ``(N, C, *x_shape[2:])`` sums of ``dy``'s blocks, in the layout of
    ``layout_of`` (the forward's input)."""
    cl = _layout(layout_of) == "CL"
    if (_layout(dy) == "CL") != cl:
        dy = cupy.ascontiguousarray(dy) if not cl else \
            cupy.ascontiguousarray(dy.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    dx = cupy.empty(x_shape, dy.dtype) if not cl else \
        cupy.empty((x_shape[0], *x_shape[2:], x_shape[1]), dy.dtype).transpose(0, 3, 1, 2)
    fn = compiler.function("upsample.cu", "nearest_backward", dtype_defines(dy.dtype))
    fn(_blocks(dx.size, dy.device.id), (_THREADS,), (dy, dx, np.int64(dx.size), *_geometry(dy.shape, scales, cl)))
    return dx


def backward_supports(dy, x_shape, scales, layout_of) -> bool:
    """``dy`` a CuPy array :func:`supports` takes, of the forward's output shape."""
    return supports(dy, scales) and tuple(dy.shape) == tuple(x_shape[:2]) + tuple(
        n * s for n, s in zip(x_shape[2:], scales)) and _layout(layout_of) is not None


KERNELS = {"upsample_nearest": (forward, supports), "upsample_nearest_backward": (backward, backward_supports)}
