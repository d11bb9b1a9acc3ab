"""CUDA kernels for the classifier loss: ``logit_crossentropy_rows`` and ``logit_crossentropy_labels``, forward and
backward, a warp per row.

The loss of an ``(N, C)`` batch of logits against one-hot or soft targets is ``l[n] = sum(y[n]) * logsumexp(ŷ[n]) -
<y[n], ŷ[n]>`` and its gradient ``dl[n] * (softmax(ŷ[n]) * sum(y[n]) - y[n])``. Each is one launch here, where the
composition takes a dozen CuPy calls (max, subtract, exp, sum, log, multiply, ...), each with its own host launch
cost. Against ``(N,)`` class indices (int32 or int64) the targets ``y[n] = h onehot(t) + u w`` are never stored:
the kernels read the label, its class weight and the smoothing's two coefficients instead (see
:mod:`fluxpy.ops.crossentropy`). Accumulation is in float32 for float16, bfloat16 and float32 inputs (the halves
stored in their own 16 bits, each result rounded once), float64 for float64; other dtypes and non-contiguous inputs
are turned down (their ``supports`` is false), so the op's own code runs for them.

>>> sorted(KERNELS)
['logit_crossentropy_labels', 'logit_crossentropy_labels_backward', 'logit_crossentropy_rows', \
'logit_crossentropy_rows_backward']
"""
from __future__ import annotations

import numpy as np

from ..backend import Array, cupy
from . import compiler
from .halfs import KERNEL_DTYPES, dtype_defines

__all__ = ["logit_crossentropy_rows", "logit_crossentropy_rows_backward", "logit_crossentropy_labels",
           "logit_crossentropy_labels_backward", "KERNELS", "SOURCE_VARIANTS"]


_THREADS = 256   # 8 rows per block
_TYPES = frozenset(KERNEL_DTYPES)
_LABEL_TYPES = frozenset((np.dtype(np.int32), np.dtype(np.int64)))
_NULL = np.uint64(0)
_INT64 = (-2**63, 2**63)


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


def _vec(yhat):
    """Whether the label kernels read ``yhat``'s rows as 16-byte vectors: whole vectors a row, aligned (the
    gradient they write is a new, aligned array)."""
    return np.int32(yhat.shape[1] % (16 // yhat.itemsize) == 0 and yhat.data.ptr % 16 == 0)


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


def _targets(yhat, labels, weight, smoothing, ignore):
    """The kernels' target arguments, from ``labels`` to ``has_ignore``: the smoothing's two coefficients in the
    compute type (as the op's array code forms them), and the ignored label (none where it is None or outside
    int64, which no int32 or int64 label can equal)."""
    acc = np.float64 if yhat.dtype == np.float64 else np.float32
    ignored = ignore is not None and _INT64[0] <= ignore < _INT64[1]
    return (labels, np.int32(labels.itemsize), _NULL if weight is None else weight, acc(1 - smoothing),
            acc(smoothing / yhat.shape[1]), np.int64(ignore if ignored else 0), np.int32(ignored))


def logit_crossentropy_labels(yhat: Array, labels: Array, weight: Array | None, smoothing: float,
                              ignore: int | None) -> Array:
    """The row cross-entropies of CuPy ``(N, C)`` logits against ``(N,)`` class indices, one kernel (the arguments
    of :func:`fluxpy.ops.crossentropy.logit_crossentropy_labels`, checked there)."""
    n, c = yhat.shape
    out = cupy.empty(n, dtype=yhat.dtype)
    if n:
        _function("ce_labels_forward", yhat.dtype)(
            _blocks(n), (_THREADS,), (yhat, *_targets(yhat, labels, weight, smoothing, ignore), out, np.int64(n),
                                      np.int64(c), _vec(yhat)))
    return out


def logit_crossentropy_labels_backward(dl: Array, yhat: Array, labels: Array, weight: Array | None, smoothing: float,
                                       ignore: int | None) -> Array:
    """The cotangent of the logits of :func:`logit_crossentropy_labels`, ``dl[:, None] * (softmax(ŷ) * sum(y) - y)``
    with the targets ``y`` never stored, one kernel."""
    n, c = yhat.shape
    dx = cupy.empty_like(yhat)
    if n:
        dl_stride = np.int64(dl.strides[0] // dl.itemsize)
        _function("ce_labels_backward", yhat.dtype)(
            _blocks(n), (_THREADS,), (dl, dl_stride, yhat, *_targets(yhat, labels, weight, smoothing, ignore), dx,
                                      np.int64(n), np.int64(c), _vec(yhat)))
    return dx


def _labels_fit(yhat, labels, weight, smoothing, ignore):
    return (_fits(yhat) and type(labels) is cupy.ndarray and labels.dtype in _LABEL_TYPES and labels.ndim == 1
            and labels.flags.c_contiguous and (weight is None or _fits(yhat, weight)))


def _labels_backward_fit(dl, yhat, labels, weight, smoothing, ignore):
    return (_labels_fit(yhat, labels, weight, smoothing, ignore) and type(dl) is cupy.ndarray
            and dl.dtype == yhat.dtype and dl.ndim == 1)


# name -> (kernel, supports): what fluxpy.kernels.gpu registers for CuPy arrays
KERNELS = {
    "logit_crossentropy_rows": (logit_crossentropy_rows, _fits),
    "logit_crossentropy_rows_backward": (logit_crossentropy_rows_backward, _backward_fits),
    "logit_crossentropy_labels": (logit_crossentropy_labels, _labels_fit),
    "logit_crossentropy_labels_backward": (logit_crossentropy_labels_backward, _labels_backward_fit),
}
