"""fluxpy's own RMS-norm kernels for C-contiguous CuPy arrays (``cuda/rmsnorm.cu``): one launch forward, two backward,
deterministic.

The composite (the square, a mean, the square root, a division, the scale, and casts around them for the halves) runs
half a dozen kernels forward and more backward. Here a block normalises a row (``rms_forward``: the sum of squares,
then ``y = x * rstd * gamma``); backward, a block per row writes ``dx`` and adds ``dy * xhat`` into its own row of
per-column partial sums (each column one thread's), which ``rms_gamma`` adds in a fixed order for ``dgamma``.
float16 and bfloat16 compute in float32 with a float32 ``gamma``, ``rstd`` and ``dgamma``.

>>> sorted(KERNELS)
['rmsnorm_backward', 'rmsnorm_forward']
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import cupy
from . import compiler
from .halfs import KERNEL_DTYPES, compute_dtype, dtype_defines

__all__ = ["supports", "forward", "backward", "SOURCE_VARIANTS", "KERNELS"]

_THREADS = 256
_NULL = np.uint64(0)


def SOURCE_VARIANTS():
    """``(source, defines)`` of every variant launched: one a kernel dtype.

    >>> len(list(SOURCE_VARIANTS()))
    4
    """
    for dtype in KERNEL_DTYPES:
        yield "rmsnorm.cu", dtype_defines(dtype)


def supports(x, gamma, k, eps) -> bool:
    """A C-contiguous CuPy array of a kernel dtype normalised over its last ``k`` axes (at least one row of at least
    one value), ``gamma`` None or a CuPy array of the compute dtype and of those axes' shape."""
    if type(x) is not cupy.ndarray or x.dtype not in KERNEL_DTYPES or not x._c_contiguous or x.size == 0:
        return False
    if not 1 <= k <= x.ndim:
        return False
    return gamma is None or (type(gamma) is cupy.ndarray and gamma.dtype == compute_dtype(x.dtype)
                             and tuple(gamma.shape) == tuple(x.shape[x.ndim - k:]))


def _rows(x, k):
    d = math.prod(x.shape[x.ndim - k:])
    return x.size // d, d


def _blocks(rows, dev):
    return int(max(1, min(rows, 2 * compiler.device(dev).processors)))


def _fn(name, dtype):
    return compiler.function("rmsnorm.cu", name, dtype_defines(dtype))


def forward(x, gamma, k, eps):
    """``(y, rstd)``: ``y = x * rstd * gamma`` over the last ``k`` axes, ``rstd`` a value a row (compute dtype)."""
    rows, d = _rows(x, k)
    pdt = compute_dtype(x.dtype)
    y = cupy.empty_like(x)
    rstd = cupy.empty(rows, pdt)
    _fn("rms_forward", x.dtype)((_blocks(rows, x.device.id),), (_THREADS,),
                                (x, _NULL if gamma is None else gamma, y, rstd, np.int64(rows), np.int64(d),
                                 pdt.type(eps)))
    return y, rstd


def backward(dy, x, gamma, rstd, k, need_gamma=True):
    """``(dx, dgamma)`` of :func:`forward` (``dgamma`` None without ``gamma`` or ``need_gamma``)."""
    rows, d = _rows(x, k)
    pdt = compute_dtype(x.dtype)
    blocks = _blocks(rows, x.device.id)
    with_gamma = gamma is not None and need_gamma
    partial = cupy.empty((blocks, d), pdt) if with_gamma else None
    dx = cupy.empty_like(x)
    _fn("rms_backward", x.dtype)((blocks,), (_THREADS,),
                                 (dy, x, _NULL if gamma is None else gamma, rstd, dx,
                                  _NULL if partial is None else partial, np.int64(rows), np.int64(d)))
    if not with_gamma:
        return dx, None
    dgamma = cupy.empty(gamma.shape, pdt)
    _fn("rms_gamma", x.dtype)((-(-d // _THREADS),), (_THREADS,), (partial, dgamma, np.int64(blocks), np.int64(d)))
    return dx, dgamma


def backward_supports(dy, x, gamma, rstd, k, need_gamma=True) -> bool:
    """``dy`` a C-contiguous CuPy array of ``x``'s shape and dtype, and :func:`supports` of the forward's."""
    return type(dy) is cupy.ndarray and dy._c_contiguous and dy.shape == x.shape and dy.dtype == x.dtype and \
        supports(x, gamma, k, 0.0)


KERNELS = {"rmsnorm_forward": (forward, supports), "rmsnorm_backward": (backward, backward_supports)}
