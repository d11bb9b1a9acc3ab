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
from .halfs import KERNEL_DTYPES, prelude

__all__ = ["logit_crossentropy_rows", "logit_crossentropy_rows_backward", "KERNELS"]

_SOURCE = r"""
#define ACC C
__device__ ACC warp_max(ACC v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}
__device__ ACC warp_sum(ACC v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
// Per row: m = max(a), s = sum(exp(a - m)), ty = sum(t), tya = sum(t * a). The whole warp shares a row.
__device__ void row_stats(const T* a, const T* t, long long c, int lane, ACC* m, ACC* s, ACC* ty, ACC* tya) {
    ACC mx = LOAD(a[lane < c ? lane : 0]);
    for (long long j = lane; j < c; j += 32) mx = max(mx, LOAD(a[j]));
    mx = warp_max(mx);
    ACC se = 0, sy = 0, sya = 0;
    for (long long j = lane; j < c; j += 32) {
        ACC v = LOAD(a[j]), w = LOAD(t[j]);
        se += exp(v - mx); sy += w; sya += w * v;
    }
    *m = mx; *s = warp_sum(se); *ty = warp_sum(sy); *tya = warp_sum(sya);
}
extern "C" __global__ void ce_rows_forward(const T* yhat, const T* y, T* out, long long n, long long c) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    ACC m, s, ty, tya;
    row_stats(yhat + row * c, y + row * c, c, lane, &m, &s, &ty, &tya);
    if (lane == 0) out[row] = STORE((log(s) + m) * ty - tya);
}
// dl may be a broadcast view (the pullback of a mean): its stride in elements is dl_stride, often 0.
extern "C" __global__ void ce_rows_backward(const T* dl, long long dl_stride, const T* yhat, const T* y, T* dx,
                                            long long n, long long c) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const T* a = yhat + row * c;
    const T* t = y + row * c;
    ACC m, s, ty, tya;
    row_stats(a, t, c, lane, &m, &s, &ty, &tya);
    ACC lse = log(s) + m, g = LOAD(dl[row * dl_stride]);
    for (long long j = lane; j < c; j += 32) dx[row * c + j] = STORE(g * (exp(LOAD(a[j]) - lse) * ty - LOAD(t[j])));
}
"""

_THREADS = 256   # 8 rows per block
_TYPES = frozenset(KERNEL_DTYPES)
_modules = {}


def _function(name, dtype):
    mod = _modules.get(dtype)
    if mod is None:
        mod = _modules[dtype] = cupy.RawModule(code=prelude(dtype) + _SOURCE, options=("--std=c++11",))
    return mod.get_function(name)


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
