"""fluxpy's own batch-norm kernels for NCHW CuPy arrays: two launches each way, deterministic.

Training forward:

1. ``bn_stats``: a grid of ``(S, C)`` blocks; block ``(s, c)`` sums ``d = x - K`` and ``d * d`` over its
   slice of channel ``c`` (``K`` = the channel's first element, so the shifted sums keep the variance
   accurate when the mean is large), reduces them in the block, and writes one partial. The last block
   of a channel to finish (an integer counter, reset by that block) adds the ``S`` partials in a fixed
   order, so the result does not depend on timing (no float atomics), and writes ``mean``, ``invstd``,
   the per-channel ``scale = gamma * invstd`` and ``shift = beta - mean * scale``, and moves the running
   statistics (the variance unbiased).
2. ``bn_apply``: ``y = x * scale[c] + shift[c]``.

Backward: ``bn_bwd_stats`` sums ``dy`` and ``dy * (x - mean)`` the same way and its last block writes
``dbeta``, ``dgamma = invstd * sum(dy (x - mean))`` and the coefficients of ``dx = a[c] dy + b[c] x + k[c]``;
``bn_bwd_apply`` writes ``dx``. Accumulation is in float32 for float32 data, float64 for float64.

>>> sorted(n for n in _NAMES)
['bn_apply', 'bn_bwd_apply', 'bn_bwd_stats', 'bn_stats']
"""
from __future__ import annotations

import numpy as np

from ..backend import cupy

__all__ = ["supports", "forward_training", "backward"]

_NAMES = ("bn_stats", "bn_apply", "bn_bwd_stats", "bn_bwd_apply")
_THREADS = 256

_SOURCE = r"""
__device__ __forceinline__ void block_sum2(ACC& a, ACC& b, ACC* sh) {
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_down_sync(0xffffffff, a, o);
        b += __shfl_down_sync(0xffffffff, b, o);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { sh[warp] = a; sh[32 + warp] = b; }
    __syncthreads();
    if (warp == 0) {
        a = lane < nw ? sh[lane] : (ACC)0;
        b = lane < nw ? sh[32 + lane] : (ACC)0;
        for (int o = 16; o > 0; o >>= 1) {
            a += __shfl_down_sync(0xffffffff, a, o);
            b += __shfl_down_sync(0xffffffff, b, o);
        }
    }
}

// The last block of channel c to arrive adds the S partials of that channel in a fixed order (warp 0).
__device__ __forceinline__ bool last_block(int* counter, int S) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int done = atomicAdd(counter, 1);
        last = (done == S - 1);
        if (last) *counter = 0;
    }
    __syncthreads();
    return last;
}

__device__ __forceinline__ void sum_partials(const ACC* p1, const ACC* p2, int S, ACC& s1, ACC& s2) {
    s1 = 0; s2 = 0;
    for (int i = threadIdx.x; i < S; i += 32) { s1 += p1[i]; s2 += p2[i]; }
    for (int o = 16; o > 0; o >>= 1) {
        s1 += __shfl_down_sync(0xffffffff, s1, o);
        s2 += __shfl_down_sync(0xffffffff, s2, o);
    }
}

extern "C" __global__ void bn_stats(const T* x, long long HW, long long C, long long M, int S,
                                     ACC* part1, ACC* part2, int* counters, const PAR* gamma, const PAR* beta,
                                     PAR* mean_out, PAR* invstd_out, ACC* scale, ACC* shift,
                                     PAR* running_mean, PAR* running_var, double momentum, double eps) {
    __shared__ ACC sh[64];
    const long long c = blockIdx.y;
    const int s = blockIdx.x;
    const long long chunk = (M + S - 1) / S;
    const long long lo = s * chunk, hi = min(M, lo + chunk);
    const ACC K = (ACC)x[c * HW];
    ACC s1 = 0, s2 = 0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        long long n = i / HW, j = i - n * HW;
        ACC d = (ACC)x[(n * C + c) * HW + j] - K;
        s1 += d; s2 += d * d;
    }
    block_sum2(s1, s2, sh);
    if (threadIdx.x == 0) { part1[c * S + s] = s1; part2[c * S + s] = s2; }
    if (!last_block(counters + c, S)) return;
    if (threadIdx.x >= 32) return;
    ACC t1, t2;
    sum_partials(part1 + c * S, part2 + c * S, S, t1, t2);
    if (threadIdx.x == 0) {
        ACC m = (ACC)M;
        ACC dm = t1 / m;
        ACC var = t2 / m - dm * dm;
        if (var < (ACC)0) var = 0;
        ACC mu = K + dm;
        ACC inv = (ACC)1 / sqrt(var + (ACC)eps);
        ACC g = gamma ? (ACC)gamma[c] : (ACC)1, b = beta ? (ACC)beta[c] : (ACC)0;
        mean_out[c] = (PAR)mu; invstd_out[c] = (PAR)inv;
        scale[c] = g * inv; shift[c] = b - mu * g * inv;
        if (running_mean) {
            running_mean[c] = (PAR)((1 - momentum) * (double)running_mean[c] + momentum * (double)mu);
            double unbiased = (double)var * (double)m / (double)(m - 1);
            running_var[c] = (PAR)((1 - momentum) * (double)running_var[c] + momentum * unbiased);
        }
    }
}

extern "C" __global__ void bn_apply(const T* x, T* y, const ACC* scale, const ACC* shift, long long HW, long long C,
                                     long long total) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long c = (i / HW) % C;
        y[i] = (T)((ACC)x[i] * scale[c] + shift[c]);
    }
}

extern "C" __global__ void bn_bwd_stats(const T* dy, const T* x, const PAR* mean, const PAR* invstd, const PAR* gamma,
                                         long long HW, long long C, long long M, int S, ACC* part1, ACC* part2,
                                         int* counters, PAR* dgamma, PAR* dbeta, ACC* ca, ACC* cb, ACC* ck) {
    __shared__ ACC sh[64];
    const long long c = blockIdx.y;
    const int s = blockIdx.x;
    const long long chunk = (M + S - 1) / S;
    const long long lo = s * chunk, hi = min(M, lo + chunk);
    const ACC mu = (ACC)mean[c];
    ACC s1 = 0, s2 = 0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        long long n = i / HW, j = i - n * HW;
        long long k = (n * C + c) * HW + j;
        ACC g = (ACC)dy[k];
        s1 += g; s2 += g * ((ACC)x[k] - mu);
    }
    block_sum2(s1, s2, sh);
    if (threadIdx.x == 0) { part1[c * S + s] = s1; part2[c * S + s] = s2; }
    if (!last_block(counters + c, S)) return;
    if (threadIdx.x >= 32) return;
    ACC t1, t2;
    sum_partials(part1 + c * S, part2 + c * S, S, t1, t2);
    if (threadIdx.x == 0) {
        ACC inv = (ACC)invstd[c], m = (ACC)M;
        ACC g = gamma ? (ACC)gamma[c] : (ACC)1;
        ACC dg = inv * t2;
        dbeta[c] = (PAR)t1; dgamma[c] = (PAR)dg;
        ACC a = g * inv;
        ACC b = -a * inv * dg / m;
        ca[c] = a; cb[c] = b; ck[c] = -a * t1 / m - b * mu;
    }
}

extern "C" __global__ void bn_bwd_apply(const T* dy, const T* x, T* dx, const ACC* ca, const ACC* cb, const ACC* ck,
                                         long long HW, long long C, long long total) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long c = (i / HW) % C;
        dx[i] = (T)(ca[c] * (ACC)dy[i] + cb[c] * (ACC)x[i] + ck[c]);
    }
}
"""

_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_modules: dict = {}
_counters: dict = {}   # (device, stream) -> int32 counters, left at zero by the kernels
_sm: dict = {}


def _fn(name, dtype):
    mod = _modules.get(dtype)
    if mod is None:
        t = _TYPES[dtype]
        mod = _modules[dtype] = cupy.RawModule(code=f"#define T {t}\n#define ACC {t}\n#define PAR {t}\n" + _SOURCE,
                                               options=("--std=c++14",))
    return mod.get_function(name)


def supports(x, *params) -> bool:
    """CuPy float32/float64 arrays of 2 to 5 axes, C-contiguous, with parameters of the same dtype (or None)."""
    return type(x) is cupy.ndarray and x.dtype in _TYPES and 2 <= x.ndim <= 5 and x.flags.c_contiguous and all(
        p is None or (type(p) is cupy.ndarray and p.dtype == x.dtype) for p in params)


def _geometry(x):
    n, c = x.shape[0], x.shape[1]
    hw = x.size // (n * c)
    return c, hw, n * hw


def _splits(c, m, dev):
    sm = _sm.get(dev)
    if sm is None:
        sm = _sm[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
    want = max(1, -(-4 * sm // c))
    return int(max(1, min(want, -(-m // (_THREADS * 4)), 1024)))


def _counter(c):
    key = (cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr)
    buf = _counters.get(key)
    if buf is None or buf.size < c:
        buf = _counters[key] = cupy.zeros(max(c, 1024), dtype=cupy.int32)
    return buf


def _grid(total):
    return (min(-(-total // _THREADS), 65535),)


_NULL = np.uint64(0)


def _p(a):
    return _NULL if a is None else a


def forward_training(x, gamma, beta, running_mean, running_var, momentum: float, eps: float):
    """``(y, mean, invstd)`` in two launches; the running statistics (or None) are moved in place."""
    c, hw, m = _geometry(x)
    s = _splits(c, m, x.device.id)
    dt = x.dtype
    part = cupy.empty((2, c * s), dt)
    mean, invstd = cupy.empty(c, dt), cupy.empty(c, dt)
    coef = cupy.empty((2, c), dt)
    _fn("bn_stats", dt)((s, c), (_THREADS,), (
        x, np.int64(hw), np.int64(c), np.int64(m), np.int32(s), part[0], part[1], _counter(c), _p(gamma), _p(beta),
        mean, invstd, coef[0], coef[1], _p(running_mean), _p(running_var), np.float64(momentum), np.float64(eps)))
    y = cupy.empty_like(x)
    _fn("bn_apply", dt)(_grid(x.size), (_THREADS,), (x, y, coef[0], coef[1], np.int64(hw), np.int64(c),
                                                      np.int64(x.size)))
    return y, mean, invstd


def backward(dy, x, gamma, mean, invstd, eps: float):
    """``(dx, dgamma, dbeta)`` in two launches."""
    c, hw, m = _geometry(x)
    s = _splits(c, m, x.device.id)
    dt = x.dtype
    dy = cupy.ascontiguousarray(dy)
    part = cupy.empty((2, c * s), dt)
    grads = cupy.empty((2, c), dt)
    coef = cupy.empty((3, c), dt)
    _fn("bn_bwd_stats", dt)((s, c), (_THREADS,), (
        dy, x, mean, invstd, _p(gamma), np.int64(hw), np.int64(c), np.int64(m), np.int32(s), part[0], part[1],
        _counter(c), grads[0], grads[1], coef[0], coef[1], coef[2]))
    dx = cupy.empty_like(x)
    _fn("bn_bwd_apply", dt)(_grid(x.size), (_THREADS,), (dy, x, dx, coef[0], coef[1], coef[2], np.int64(hw),
                                                          np.int64(c), np.int64(x.size)))
    return dx, grads[0], grads[1]
