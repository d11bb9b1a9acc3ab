"""CUDA kernels for the classifier loss: ``logit_crossentropy_rows`` forward and backward, a warp per row.

The loss of an ``(N, C)`` batch of logits against one-hot or soft targets is ``l[n] = sum(y[n]) * logsumexp(ŷ[n]) -
<y[n], ŷ[n]>`` and its gradient ``dl[n] * (softmax(ŷ[n]) * sum(y[n]) - y[n])``. Each is one launch here, where the
composition takes a dozen CuPy calls (max, subtract, exp, sum, log, multiply, ...), each with its own host launch
cost. Accumulation is in float32 for float16, bfloat16 and float32 inputs (the halves stored in their own 16 bits,
each result rounded once), float64 for float64; other dtypes and non-contiguous inputs are turned down (their
``supports`` is false), so the op's composite runs for them.

>>> sorted(KERNELS)
['logit_crossentropy_rows', 'logit_crossentropy_rows_backward']
"""
from __future__ import annotations

import numpy as np

from ..backend import Array, cupy
from . import compiler
from .halfs import KERNEL_DTYPES, dtype_defines

__all__ = ["logit_crossentropy_rows", "logit_crossentropy_rows_backward", "KERNELS", "SOURCE_VARIANTS"]


_THREADS = 256   # 8 rows per block
_TYPES = frozenset(KERNEL_DTYPES)


def SOURCE_VARIANTS():
    """``(source, defines)`` of every variant the kernels launch: ``cuda/softmax.cu`` for each dtype.

    >>> len(list(SOURCE_VARIANTS()))
    4
    """
    for dtype in KERNEL_DTYPES:
        yield "softmax.cu", dtype_defines(dtype)


def _function(name, dtype):
    return compiler.function("softmax.cu", name, dtype_defines(dtype))


def _fits(*arrays):
    first = arrays[0]
    return first.dtype in _TYPES and all(
        type(a) is cupy.ndarray and a.dtype == first.dtype and a.flags.c_contiguous for a in arrays)


def _blocks(n):
    rows_per_block = _THREADS // 32
    return ((n + rows_per_block - 1) // rows_per_block,)


def logit_crossentropy_rows(yhat: Array, y: Array) -> Array:
    """The row cross-entropies ``-sum(y * logsoftmax(ŷ), axis=1)`` of CuPy ``(N, C)`` arrays, one kernel."""
    n, c = yhat.shape
    out = cupy.empty(n, dtype=yhat.dtype)
    if n:
        _function("ce_rows_forward", yhat.dtype)(_blocks(n), (_THREADS,), (yhat, y, out, np.int64(n), np.int64(c)))
    return out


def logit_crossentropy_rows_backward(dl: Array, yhat: Array, y: Array) -> Array:
    """The cotangent of the logits, ``dl[:, None] * (softmax(ŷ) * sum(y, axis=1) - y)``, for CuPy arrays,
    one kernel."""
    n, c = yhat.shape
    dx = cupy.empty_like(yhat)
    if n:
        dl_stride = np.int64(dl.strides[0] // dl.itemsize)
        _function("ce_rows_backward", yhat.dtype)(_blocks(n), (_THREADS,),
                                                   (dl, dl_stride, yhat, y, dx, np.int64(n), np.int64(c)))
    return dx


def _backward_fits(dl, yhat, y):
    return _fits(yhat, y) and type(dl) is cupy.ndarray and dl.dtype == yhat.dtype and dl.ndim == 1


# name -> (kernel, supports): what fluxpy.kernels.gpu registers for CuPy arrays
KERNELS = {
    "logit_crossentropy_rows": (logit_crossentropy_rows, _fits),
    "logit_crossentropy_rows_backward": (logit_crossentropy_rows_backward, _backward_fits),
}
