"""The glue from fluxpy's convolution ops to cuDNN (:mod:`fluxpy.kernels.cudnn`) for CuPy arrays.

:data:`KERNELS` maps op names to the functions the kernel table holds under ``"cupy"``
(:func:`fluxpy.kernels.register`), with the signatures of :mod:`fluxpy.kernels.cpu`'s:

==============================  ===============================================================
``conv_forward``                the graph API's convolution (:mod:`fluxpy.kernels.cudnn.graph`)
``conv_backward_data``          its backward data (also ``conv_transpose``)
``conv_backward_filter``        its backward filter
``conv_bias_act_forward``       ``act(conv(x, w) + b)`` in one graph, relu or identity, ``b`` or None
``conv_bias_act_backward``      ``(dz, db)`` from the output: ``dz = dy * (y > 0)`` for relu, ``db``
                                by :func:`fluxpy.kernels.reduce.mapreduce` (one pass that also writes
                                ``dz``); float16/bfloat16 without ``db``: a mask on the bits
==============================  ===============================================================

float16 and bfloat16 run as float32 and float64 do (the same calls, half storage, float32 compute
on tensor cores); x, w and b must share the dtype (the ops check that before any kernel runs).

Convolutions of 1, 2 or 3 spatial axes take the same kernels: the binding tells cuDNN of a 1-d problem as a 2-d
one with a unit axis and of a 3-d one with 5-d descriptors (:mod:`fluxpy.kernels.cudnn.geometry`); the bias
gradient sums every axis but the channels'.

The convolution kernels are the graph module's own functions (``conv_bias_act_forward`` registered as it is,
no extra Python frame per call), the other three through :mod:`fluxpy.kernels.cuda_depthwise`, which keeps
fluxpy's own kernels for the half-precision channels-last depthwise problems where they measure faster and
passes every other call on. The graph path falls back per problem to the legacy call of
:mod:`fluxpy.kernels.cudnn.legacy`, and ``conv_bias_act_forward`` composes conv, bias and relu
itself where cuDNN refuses the fusion, so every kernel returns a result.

The module imports without CuPy; cuDNN is loaded on the first convolution, and where it cannot run
that call raises a ``RuntimeError`` saying why (see :func:`fluxpy.kernels.cudnn.available`).

>>> sorted(KERNELS)
['conv_backward_data', 'conv_backward_filter', 'conv_bias_act_backward', 'conv_bias_act_forward', 'conv_forward']
"""
from __future__ import annotations


import numpy as np

from ..backend import cupy
from ..layout import keeping_layout, like_layout
from . import cuda_depthwise
from .cudnn import graph
from .cudnn.geometry import ConvDimsLike
from .halfs import BFLOAT16, is_half
from .reduce import mapreduce


__all__ = ["KERNELS", "conv_bias_act_backward"]

_relu_mask = None


def _mask(dy, y):
    global _relu_mask
    if _relu_mask is None:
        _relu_mask = cupy.ElementwiseKernel("T dy, T y", "T dz", "dz = (y > (T)0) ? dy : (T)0", "fluxpy_relu_mask")
    return _relu_mask(dy, y)


# The bits of +inf: a float16 or bfloat16 is positive (not NaN, not zero) where its bits lie in [1, limit].
_POSITIVE_LIMIT = {np.dtype(np.float16): 0x7C00, BFLOAT16: 0x7F80}
_half_mask_kernel = None


def _half_mask(dy, y):
    """``dy * (y > 0)`` for float16 or bfloat16 arrays, on their bits (no half arithmetic needed)."""
    global _half_mask_kernel
    if _half_mask_kernel is None:
        _half_mask_kernel = cupy.ElementwiseKernel(
            "uint16 dy, uint16 y, uint16 limit", "uint16 dz",
            "dz = ((unsigned short)(y - 1) < limit) ? dy : (unsigned short)0", "fluxpy_half_relu_mask")
    limit = np.uint16(_POSITIVE_LIMIT[y.dtype])
    return _half_mask_kernel(dy.view(np.uint16), y.view(np.uint16), limit).view(y.dtype)


_RELU_MAP = "x * (y > 0)"   # relu's derivative from its output, as mapreduce's map of x = dy and y


def SOURCE_VARIANTS():
    """``(source, defines)`` of the ``cuda/`` kernels this module launches: the map+reduce of relu's bias gradient.

    >>> len(list(SOURCE_VARIANTS()))
    8
    """
    from .reduce import variants
    yield from variants(_RELU_MAP, True)


def _bias_axes(ndim):
    """``(0, 2, 3)`` in 2-d: every axis but the channels'."""
    return (0, 2, 3) if ndim == 4 else (0,) + tuple(range(2, ndim))


def conv_bias_act_backward(dy: cupy.ndarray, y: cupy.ndarray, kind: str, cdims: ConvDimsLike,
                           need_b: bool) -> tuple[cupy.ndarray, cupy.ndarray | None]:
    """``(dz, db)``: ``dz`` the cotangent before the activation (from the output ``y``: ``dy * (y > 0)`` for
    ``kind="relu"``, ``dy`` for ``"identity"``), ``db`` its sum over ``(0, 2, 3)`` (every axis but the channels')
    when ``need_b`` (else None).
    float16 and bfloat16 sum ``db`` in float32 (fluxpy's mapreduce accumulates halves in float32, one pass that
    also writes ``dz``)."""
    if y.dtype != dy.dtype:
        dy = dy.astype(y.dtype)
    dy = like_layout(dy, y)   # channels-last where the forward's output is
    if not need_b:
        mask = _half_mask if is_half(y.dtype) else _mask
        return (keeping_layout(mask, dy, y) if kind == "relu" else dy), None
    axes = _bias_axes(dy.ndim)
    if kind == "relu":
        dz = cupy.empty_like(dy)
        db = mapreduce(dy, axes, map=_RELU_MAP, y=y, out_mapped=dz)
        return dz, db
    return dy, mapreduce(dy, axes)


KERNELS = {
    "conv_forward": cuda_depthwise.conv_forward,
    "conv_backward_data": cuda_depthwise.conv_backward_data,
    "conv_backward_filter": cuda_depthwise.conv_backward_filter,
    "conv_bias_act_forward": graph.conv_bias_act_forward,
    "conv_bias_act_backward": conv_bias_act_backward,
}
"""Op name -> CuPy convolution kernel, for :func:`fluxpy.kernels.register` (what fluxpy uses by default)."""
