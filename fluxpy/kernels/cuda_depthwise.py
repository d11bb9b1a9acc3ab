"""fluxpy's own depthwise convolution kernels for channels-last float16 and bfloat16 CuPy arrays.

A depthwise convolution (``groups`` = input channels = output channels, one filter a channel) is a few
multiply-adds per value: memory-bound. cuDNN has fast engines for it in float16 but none in bfloat16 (its
bfloat16 plans are several times slower than its float16 ones on the same problem: BENCHMARKS.md, depthwise), and
its float16 backward data at stride 2 is slow too. These kernels read 16-byte vectors of eight adjacent channels
of a pixel (``cuda/depthwise.cu``):

- ``dw_forward`` and ``dw_backward_data``: a thread per (pixel, eight channels), the block's weights in shared
  memory (flipped there for true convolution), the taps unrolled (the kernel size is a compile-time define);
- ``dw_backward_filter`` then ``dw_filter_total``: each block sums ``dy * x`` over its share of the output pixels
  for every tap, the pixel lanes added by a tree, and the shares added in a fixed order by the second kernel
  (deterministic, float32 accumulation, rounded once).

:func:`conv_forward`, :func:`conv_backward_data` and :func:`conv_backward_filter` run them where
:func:`supports` holds and, per problem, where they measured faster than cuDNN's plan on the first call (timed on
the GPU alone); cuDNN's graph path otherwise (:mod:`fluxpy.kernels.cudnn.graph`).

>>> sorted(KERNEL_NAMES)
['dw_backward_data', 'dw_backward_filter', 'dw_filter_total', 'dw_forward']
"""
from __future__ import annotations

import numpy as np

from ..backend import cupy
from ..layout import is_channels_last
from . import compiler
from .cudnn import graph
from .elementwise import _cached
from .halfs import HALVES, dtype_defines

__all__ = ["supports", "forward", "backward_data", "backward_filter", "conv_forward", "conv_backward_data",
           "conv_backward_filter", "SOURCE_VARIANTS", "KERNEL_NAMES"]

KERNEL_NAMES = ("dw_forward", "dw_backward_data", "dw_backward_filter", "dw_filter_total")
_THREADS = 256
_SHARED_LIMIT = 48 * 1024   # the weights of a block's channels, float32, for every tap


def _vw(c: int) -> int:
    return 8 if c % 8 == 0 else 1


def _defines(dtype, kh, kw, vw):
    return {**dtype_defines(dtype), "KH": kh, "KW": kw, "VW": vw}


def SOURCE_VARIANTS():
    """``(source, defines)`` of representative variants: 3x3 in both halves, vectors and single channels.

    >>> len(list(SOURCE_VARIANTS()))
    4
    """
    for dtype in HALVES:
        for vw in (8, 1):
            yield "depthwise.cu", _defines(dtype, 3, 3, vw)


def supports(a, w, cdims) -> bool:
    """Whether the kernels take the problem: a 2-d depthwise convolution (multiplier 1) of float16 or bfloat16 CuPy
    arrays, ``a`` (the input or the output's cotangent) channels-last, the weight (None in the filter's direction,
    where it is the result) of ``a``'s dtype and dense, and the block's weights within shared memory."""
    if type(a) is not cupy.ndarray or a.dtype not in HALVES or not is_channels_last(a):
        return False
    if w is not None and (type(w) is not cupy.ndarray or w.dtype != a.dtype or
                          not (w._c_contiguous or is_channels_last(w))):
        return False
    x_shape, w_shape = cdims.x_shape, cdims.w_shape
    if len(x_shape) != 4 or not cdims.groups == x_shape[1] == w_shape[0] > 1 or w_shape[1] != 1:
        return False
    c = x_shape[1]
    return w_shape[2] * w_shape[3] * _block(c)[0] * _vw(c) * 4 <= _SHARED_LIMIT


def _block(c):
    """``(CT, PT)``: threads along channel vectors (a power of two, at most 32) and along pixels (256 in all)."""
    groups = -(-c // _vw(c))
    ct = min(32, 1 << (groups - 1).bit_length())
    return ct, _THREADS // ct


def _grid(cdims, pixels, filter_pass):
    """``(blocks along pixels, channel chunks)``: eight blocks a SM in all for the elementwise passes (each a pixel
    a lane at least), two for the filter's sums (each four pixels a lane at least, 1,024 shares at most)."""
    c = cdims.x_shape[1]
    ct, pt = _block(c)
    chunks = -(-c // (ct * _vw(c)))
    sms = compiler.device(cupy.cuda.runtime.getDevice()).processors
    if filter_pass:
        return int(max(1, min(-(-2 * sms // chunks), -(-pixels // (4 * pt)), 1024))), chunks
    return int(max(1, min(-(-pixels // pt), -(-8 * sms // chunks)))), chunks


def _geometry(cdims):
    (_, c, h, w), (oh, ow) = cdims.x_shape, cdims.y_shape[2:]
    top, _, left, _ = cdims.pad
    return tuple(np.int32(v) for v in (h, w, c, oh, ow, *cdims.stride, top, left, *cdims.dilation,
                                       not cdims.flipped))


def _function(name, dtype, cdims):
    c = cdims.x_shape[1]
    return compiler.function("depthwise.cu", name, _defines(dtype, *cdims.w_shape[2:], _vw(c)))


def _launch(name, dtype, cdims, pixels, args, filter_pass=False):
    c = cdims.x_shape[1]
    ct, pt = _block(c)
    taps = cdims.w_shape[2] * cdims.w_shape[3]
    shared = (pt if filter_pass else taps) * ct * _vw(c) * 4
    compiler.launch(_function(name, dtype, cdims), _grid(cdims, pixels, filter_pass), (ct, pt),
                    (*args, *_geometry(cdims), np.int64(pixels)), shared)


def _nhwc(shape, dtype):
    """An empty channels-last array of NCHW ``shape``."""
    n, c, h, w = shape
    return cupy.empty((n, h, w, c), dtype).transpose(0, 3, 1, 2)


def forward(x, w, cdims):
    """``conv(x, w)`` of a depthwise problem (:func:`supports`), channels-last."""
    n, _, oh, ow = cdims.y_shape
    y = _nhwc(cdims.y_shape, x.dtype)
    _launch("dw_forward", x.dtype, cdims, n * oh * ow, (x, w, y))
    return y


def backward_data(dy, w, cdims):
    """The input's cotangent of :func:`forward`, channels-last."""
    n, _, h, wd = cdims.x_shape
    dx = _nhwc(cdims.x_shape, dy.dtype)
    _launch("dw_backward_data", dy.dtype, cdims, n * h * wd, (dy, w, dx))
    return dx


def backward_filter(x, dy, cdims):
    """The weight's cotangent of :func:`forward`, ``(C, 1, KH, KW)``: per-block sums, then their total."""
    n, c, oh, ow = cdims.y_shape
    taps = cdims.w_shape[2] * cdims.w_shape[3]
    pixels = n * oh * ow
    shares = _grid(cdims, pixels, True)[0]
    part = cupy.empty((shares, taps, c), np.float32)
    _launch("dw_backward_filter", x.dtype, cdims, pixels, (x, dy, part), filter_pass=True)
    dw = cupy.empty(cdims.w_shape, x.dtype)
    compiler.launch(_function("dw_filter_total", x.dtype, cdims), -(-c * taps // _THREADS), _THREADS,
                    (part, dw, np.int32(shares), np.int32(c), np.int32(not cdims.flipped)))
    return dw


_choices: dict = {}


def _ours(direction, a, w, cdims, ours, theirs) -> bool:
    """Whether this problem runs on fluxpy's kernels: they take it, and (timed on the first call, GPU time
    alone) they were faster than cuDNN's path."""
    if not supports(a, w, cdims):
        return False

    def timed():
        return compiler.time_ms(ours, hide_host=True) < compiler.time_ms(theirs, hide_host=True)
    return _cached(_choices, (direction, cdims, a.dtype, a.device.id), timed)


def conv_forward(x, w, cdims):
    """The kernel table's ``conv_forward`` for CuPy arrays: :func:`forward` where it is kept, cuDNN's otherwise."""
    if _ours("forward", x, w, cdims, lambda: forward(x, w, cdims), lambda: graph.conv_forward(x, w, cdims)):
        return forward(x, w, cdims)
    return graph.conv_forward(x, w, cdims)


def conv_backward_data(dy, w, cdims):
    """The kernel table's ``conv_backward_data``: :func:`backward_data` where it is kept, cuDNN's otherwise."""
    if _ours("data", dy, w, cdims, lambda: backward_data(dy, w, cdims),
             lambda: graph.conv_backward_data(dy, w, cdims)):
        return backward_data(dy, w, cdims)
    return graph.conv_backward_data(dy, w, cdims)


def conv_backward_filter(x, dy, cdims):
    """The kernel table's ``conv_backward_filter``: :func:`backward_filter` where it is kept (both arrays
    channels-last), cuDNN's otherwise."""
    both = dy.dtype == x.dtype and supports(dy, None, cdims)
    if both and _ours("filter", x, None, cdims, lambda: backward_filter(x, dy, cdims),
                      lambda: graph.conv_backward_filter(x, dy, cdims)):
        return backward_filter(x, dy, cdims)
    return graph.conv_backward_filter(x, dy, cdims)
