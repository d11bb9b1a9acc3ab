"""fluxpy's own batch-norm kernels for NCHW and channels-last CuPy arrays: two launches each way, deterministic.

Training forward:

1. ``bn_stats``: a grid of ``(S, C)`` blocks; block ``(s, c)`` sums ``d = x - K`` and ``d * d`` over its
   rows ``n`` of channel ``c``, with 16-byte vectors where rows allow (``K`` = the channel's first element,
   so the shifted sums keep the variance accurate when the mean is large), reduces them in the block, and
   writes one partial. The last block
   of a channel to finish (an integer counter, reset by that block) adds the ``S`` partials in a fixed
   order, so the result does not depend on timing (no float atomics), and writes ``mean``, ``invstd``,
   the per-channel ``scale = gamma * invstd`` and ``shift = beta - mean * scale``, and moves the running
   statistics (the variance unbiased).
2. ``bn_apply``: ``y = x * scale[c] + shift[c]``, a block per (row, chunk): no division per element.

Backward: ``bn_bwd_stats`` sums ``dy`` and ``dy * (x - mean)`` the same way and its last block writes
``dbeta``, ``dgamma = invstd * sum(dy (x - mean))`` and the coefficients of ``dx = a[c] dy + b[c] x + k[c]``;
``bn_bwd_apply`` writes ``dx``. Accumulation is in float32 for float32 data, float64 for float64. float16 and
bfloat16 data are read and written in their own 16 bits (eight to a 16-byte vector) and computed in float32; their
statistics, ``gamma``, ``beta``, the running statistics and ``dgamma``/``dbeta`` are float32, as cuDNN's.

Channels-last data (:mod:`fluxpy.layout`) is an ``(M, C)`` matrix (``M = N * spatial``): ``bn_stats_cl`` and
``bn_bwd_stats_cl`` sum columns (a block per (row split, chunk of up to 32 channels), a warp reading runs of
adjacent channels; the chunk's last block adds the partials in a fixed order), ``bn_apply_cl`` and
``bn_bwd_apply_cl`` run flat over the data, each element's channel its index modulo ``C``. ``y`` and ``dx`` keep
``x``'s layout.

>>> sorted(n for n in _NAMES if not n.endswith("_cl"))
['bn_apply', 'bn_bwd_apply', 'bn_bwd_stats', 'bn_stats']
>>> sorted(n for n in _NAMES if n.endswith("_cl"))
['bn_apply_cl', 'bn_bwd_apply_cl', 'bn_bwd_stats_cl', 'bn_stats_cl']
"""
from __future__ import annotations

import numpy as np

from ..backend import cupy
from ..layout import is_channels_last, like_layout
from .halfs import HALVES, compute_dtype, prelude

__all__ = ["supports", "param_dtype", "forward_training", "backward"]

_NAMES = ("bn_stats", "bn_apply", "bn_bwd_stats", "bn_bwd_apply", "bn_stats_cl", "bn_apply_cl", "bn_bwd_stats_cl",
          "bn_bwd_apply_cl")
_THREADS = 256

_SOURCE = r"""
// T: data (LOAD/STORE from halfs.prelude), ACC = C: accumulation, statistics and parameters (float32 for the
// halves, as cuDNN), VT/VW: the 16-byte vector type and its width in T for aligned rows.
#define ACC C
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

// True in the last block of a channel to arrive (an integer counter, reset by that block). That block then reads the
// other blocks' partials: after a fence, and through volatile pointers (sum_partials, column_totals), as reduce.py
// does. Plain loads may be served from this SM's L1, which can hold a stale copy of the line: the partials of
// neighbouring channels share it, and an earlier last block on this SM read them (or a previous layer of the same
// shape, which shares the buffers, wrote them).
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
    if (last) __threadfence();
    return last;
}

// The S partials of a channel added in a fixed order by warp 0.
__device__ __forceinline__ void sum_partials(const volatile ACC* p1, const volatile ACC* p2, int S, ACC& s1,
                                             ACC& s2) {
    s1 = 0; s2 = 0;
    for (int i = threadIdx.x; i < S; i += 32) { s1 += p1[i]; s2 += p2[i]; }
    for (int o = 16; o > 0; o >>= 1) {
        s1 += __shfl_down_sync(0xffffffff, s1, o);
        s2 += __shfl_down_sync(0xffffffff, s2, o);
    }
}

// The block's sums (s1, s2) written as partial s of its channel; true in one thread, thread 0 of the channel's
// last block to arrive, which then holds the channel's totals (t1, t2), added in a fixed order.
__device__ __forceinline__ bool channel_totals(ACC s1, ACC s2, ACC* sh, ACC* part1, ACC* part2, int* counter,
                                               int s, int S, ACC& t1, ACC& t2) {
    block_sum2(s1, s2, sh);
    if (threadIdx.x == 0) { part1[s] = s1; part2[s] = s2; }
    if (!last_block(counter, S)) return false;
    if (threadIdx.x >= 32) return false;
    sum_partials(part1, part2, S, t1, t2);
    return threadIdx.x == 0;
}

// Sums of f(a[k], b[k]) over rows [rlo, rhi) of channel c: f = (a - K, (a - K)^2) or (a, a (b - K)).
#define ROW_SUMS(EXPR1, EXPR2)                                                                          \
    if (vec) {                                                                                          \
        const int hv = (int)(HW / VW);                                                                  \
        for (long long n = rlo; n < rhi; ++n) {                                                        \
            const long long base = (n * NC + c) * HW;                                                    \
            const VT* av = (const VT*)(a + base);                                                       \
            const VT* bv = (const VT*)(b + base);                                                       \
            for (int j = threadIdx.x; j < hv; j += blockDim.x) {                                        \
                VT va = av[j], vb = bv[j];                                                              \
                const T* pa = (const T*)&va; const T* pb = (const T*)&vb;                               \
                _Pragma("unroll") for (int u = 0; u < VW; ++u) {                                        \
                    ACC A_ = LOAD(pa[u]), B_ = LOAD(pb[u]); s1 += EXPR1; s2 += EXPR2;                     \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    } else {                                                                                            \
        const unsigned hw = (unsigned)HW;                                                               \
        const unsigned total = (unsigned)((rhi - rlo) * HW);                                            \
        for (unsigned i = threadIdx.x; i < total; i += blockDim.x) {                                    \
            unsigned n = i / hw, j = i - n * hw;                                                        \
            long long k = ((rlo + n) * NC + c) * HW + j;                                                 \
            ACC A_ = LOAD(a[k]), B_ = LOAD(b[k]); s1 += EXPR1; s2 += EXPR2;                               \
        }                                                                                               \
    }

// From a channel's totals t1 = sum(x - K), t2 = sum((x - K)^2) over its M values: the statistics, the scale and
// shift of the apply kernel, and the running statistics moved (the variance unbiased).
#define STATS_FINISH(M_)                                                                                    \
    {                                                                                                       \
        const long long count = (M_);                                                                       \
        ACC m = (ACC)count;                                                                                 \
        ACC dm = t1 / m;                                                                                    \
        ACC var = t2 / m - dm * dm;                                                                         \
        if (var < (ACC)0) var = 0;                                                                          \
        ACC mu = K + dm;                                                                                    \
        ACC inv = (ACC)1 / sqrt(var + (ACC)eps);                                                            \
        ACC g = gamma ? gamma[c] : (ACC)1, bb = beta ? beta[c] : (ACC)0;                                    \
        mean_out[c] = mu; invstd_out[c] = inv;                                                              \
        scale[c] = g * inv; shift[c] = bb - mu * g * inv;                                                   \
        if (running_mean) {                                                                                 \
            double unbiased = (double)var * (double)count / (double)(count - 1);                            \
            running_mean[c] = (ACC)((1 - momentum) * (double)running_mean[c] + momentum * (double)mu);     \
            running_var[c] = (ACC)((1 - momentum) * (double)running_var[c] + momentum * unbiased);          \
        }                                                                                                   \
    }

extern "C" __global__ void bn_stats(const T* x, long long N, long long NC, long long HW, int S, int vec,
                                     ACC* part1, ACC* part2, int* counters, const ACC* gamma, const ACC* beta,
                                     ACC* mean_out, ACC* invstd_out, ACC* scale, ACC* shift,
                                     ACC* running_mean, ACC* running_var, double momentum, double eps) {
    __shared__ ACC sh[64];
    const long long c = blockIdx.y;
    const int s = blockIdx.x;
    const long long rc = (N + S - 1) / S, rlo = s * rc, rhi = min(N, rlo + rc);
    const T* a = x; const T* b = x;
    const ACC K = LOAD(x[c * HW]);
    ACC s1 = 0, s2 = 0;
    ROW_SUMS((A_ - K), (A_ - K) * (A_ - K))
    ACC t1, t2;
    if (channel_totals(s1, s2, sh, part1 + c * S, part2 + c * S, counters + c, s, S, t1, t2))
        STATS_FINISH(N * HW)
}

// y = x * scale[c] + shift[c]: a block per (row, chunk), row = n * NC + c; or, for short rows (flat), a
// grid-stride loop over the whole tensor with 32-bit index arithmetic.
#define ACT(v) (relu && (v) < (ACC)0 ? (ACC)0 : (v))

extern "C" __global__ void bn_apply(const T* x, T* y, const ACC* scale, const ACC* shift, long long NC, long long HW,
                                     int vec, int flat, unsigned total, int relu) {
    if (flat) {
        const unsigned hv = vec ? (unsigned)(HW / VW) : (unsigned)HW, cc = (unsigned)NC;
        for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
            const unsigned c = (i / hv) % cc;
            const ACC sc = scale[c], sf = shift[c];
            if (vec) {
                VT v = ((const VT*)x)[i];
                T* p = (T*)&v;
                _Pragma("unroll") for (int u = 0; u < VW; ++u) p[u] = STORE(ACT(LOAD(p[u]) * sc + sf));
                ((VT*)y)[i] = v;
            } else {
                y[i] = STORE(ACT(LOAD(x[i]) * sc + sf));
            }
        }
        return;
    }
    const long long row = blockIdx.x;
    const long long c = row % NC;
    const ACC sc = scale[c], sf = shift[c];
    const long long base = row * HW;
    if (vec) {
        const VT* xv = (const VT*)(x + base);
        VT* yv = (VT*)(y + base);
        for (long long j = (long long)blockIdx.y * blockDim.x + threadIdx.x; j < HW / VW;
             j += (long long)gridDim.y * blockDim.x) {
            VT v = xv[j];
            T* p = (T*)&v;
            _Pragma("unroll") for (int u = 0; u < VW; ++u) p[u] = STORE(ACT(LOAD(p[u]) * sc + sf));
            yv[j] = v;
        }
    } else {
        const long long step = (long long)gridDim.y * blockDim.x;
        for (long long j = (long long)blockIdx.y * blockDim.x + threadIdx.x; j < HW; j += step)
            y[base + j] = STORE(ACT(LOAD(x[base + j]) * sc + sf));
    }
}

// With relu, dy is masked where the forward's output was not positive: that output, x * scale + shift, is
// recomputed from x with the forward's own scale and shift (the same expressions, so the same rounding).
#define MASKED(g, xv) ((relu && (xv) * sc + sf <= (ACC)0) ? (ACC)0 : (g))

// From a channel's totals t1 = sum(dy'), t2 = sum(dy' (x - mean)) over its M values (dy' masked for relu):
// dbeta, dgamma and the coefficients of dx = a dy' + b x + k.
#define BWD_FINISH(M_)                                                                                      \
    {                                                                                                       \
        ACC inv = invstd[c], m = (ACC)(M_);                                                                 \
        ACC g = gamma ? gamma[c] : (ACC)1;                                                                  \
        ACC dg = inv * t2;                                                                                  \
        dbeta[c] = t1; dgamma[c] = dg;                                                                      \
        ACC aa = g * inv;                                                                                   \
        ACC bb = -aa * inv * dg / m;                                                                        \
        ca[c] = aa; cb[c] = bb; ck[c] = -aa * t1 / m - bb * K;                                              \
        csc[c] = sc; csf[c] = sf;                                                                           \
    }

extern "C" __global__ void bn_bwd_stats(const T* dy, const T* x, const ACC* mean, const ACC* invstd,
                                         const ACC* gamma, const ACC* beta, long long N, long long NC, long long HW,
                                         int S, int vec, ACC* part1, ACC* part2, int* counters, ACC* dgamma,
                                         ACC* dbeta, ACC* ca, ACC* cb, ACC* ck, ACC* csc, ACC* csf, int relu) {
    __shared__ ACC sh[64];
    const long long c = blockIdx.y;
    const int s = blockIdx.x;
    const long long rc = (N + S - 1) / S, rlo = s * rc, rhi = min(N, rlo + rc);
    const T* a = dy; const T* b = x;
    const ACC K = mean[c];
    const ACC g0 = gamma ? gamma[c] : (ACC)1, b0 = beta ? beta[c] : (ACC)0, inv0 = invstd[c];
    const ACC sc = g0 * inv0, sf = b0 - K * g0 * inv0;
    ACC s1 = 0, s2 = 0;
    ROW_SUMS(MASKED(A_, B_), MASKED(A_, B_) * (B_ - K))
    ACC t1, t2;
    if (channel_totals(s1, s2, sh, part1 + c * S, part2 + c * S, counters + c, s, S, t1, t2))
        BWD_FINISH(N * HW)
}

// dx = a[c] dy + b[c] x + k[c], laid out as bn_apply.
extern "C" __global__ void bn_bwd_apply(const T* dy, const T* x, T* dx, const ACC* ca, const ACC* cb, const ACC* ck,
                                         long long NC, long long HW, int vec, int flat, unsigned total,
                                         const ACC* csc, const ACC* csf, int relu) {
    if (flat) {
        const unsigned hv = vec ? (unsigned)(HW / VW) : (unsigned)HW, cc = (unsigned)NC;
        for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
            const unsigned c = (i / hv) % cc;
            const ACC a = ca[c], b = cb[c], k = ck[c], sc = csc[c], sf = csf[c];
            if (vec) {
                VT g = ((const VT*)dy)[i], v = ((const VT*)x)[i], o;
                const T* pg = (const T*)&g; const T* pv = (const T*)&v; T* po = (T*)&o;
                _Pragma("unroll") for (int u = 0; u < VW; ++u) {
                    ACC xv = LOAD(pv[u]);
                    po[u] = STORE(a * MASKED(LOAD(pg[u]), xv) + b * xv + k);
                }
                ((VT*)dx)[i] = o;
            } else {
                ACC xv = LOAD(x[i]);
                dx[i] = STORE(a * MASKED(LOAD(dy[i]), xv) + b * xv + k);
            }
        }
        return;
    }
    const long long row = blockIdx.x;
    const long long c = row % NC;
    const ACC a = ca[c], b = cb[c], k = ck[c], sc = csc[c], sf = csf[c];
    const long long base = row * HW;
    if (vec) {
        const VT* gv = (const VT*)(dy + base);
        const VT* xvp = (const VT*)(x + base);
        VT* ov = (VT*)(dx + base);
        for (long long j = (long long)blockIdx.y * blockDim.x + threadIdx.x; j < HW / VW;
             j += (long long)gridDim.y * blockDim.x) {
            VT g = gv[j], v = xvp[j], o;
            const T* pg = (const T*)&g; const T* pv = (const T*)&v; T* po = (T*)&o;
            _Pragma("unroll") for (int u = 0; u < VW; ++u) {
                ACC xv = LOAD(pv[u]);
                po[u] = STORE(a * MASKED(LOAD(pg[u]), xv) + b * xv + k);
            }
            ov[j] = o;
        }
    } else {
        const long long step = (long long)gridDim.y * blockDim.x;
        for (long long j = (long long)blockIdx.y * blockDim.x + threadIdx.x; j < HW; j += step) {
            ACC xv = LOAD(x[base + j]);
            dx[base + j] = STORE(a * MASKED(LOAD(dy[base + j]), xv) + b * xv + k);
        }
    }
}

// ---- Channels-last (x is an (M, C) row-major matrix, M = N * spatial) ----------------------------------------
// Block (s, chunk) sums rows [rlo, rhi) of channels [chunk * CW, chunk * CW + CW): thread t is row lane
// r = t / CW (RL = blockDim.x / CW lanes) of channel lane k = t % CW, so a warp reads whole runs of adjacent
// channels. The block's per-channel sums go to partial s of the chunk; the chunk's last block adds the S
// partials in a fixed order (lane r takes s = r, r + RL, ..., then lane 0 adds the lanes in order).
#define COL_SUMS(EXPR1, EXPR2)                                                                              \
    if (valid)                                                                                              \
        for (long long row = rlo + r; row < rhi; row += RL) {                                               \
            const long long at = row * NC + c;                                                              \
            ACC A_ = LOAD(a[at]), B_ = LOAD(b[at]); s1 += EXPR1; s2 += EXPR2;                                 \
        }

#define CL_SETUP                                                                                            \
    __shared__ ACC sh[512];                                                                                 \
    const int RL = blockDim.x / CW;                                                                         \
    const int k = threadIdx.x % CW, r = threadIdx.x / CW;                                                   \
    const long long c = (long long)blockIdx.y * CW + k;                                                     \
    const int s = blockIdx.x;                                                                               \
    const long long rc = (M + S - 1) / S, rlo = s * rc, rhi = min(M, rlo + rc);                             \
    const bool valid = c < NC && r < RL;

// True in lane 0 of each channel of the chunk's last block, which then holds the channel's totals (t1, t2).
__device__ __forceinline__ bool column_totals(ACC s1, ACC s2, ACC* sh, ACC* part1, ACC* part2, int* counter,
                                              int s, int S, int CW, int RL, int k, int r, ACC& t1, ACC& t2) {
    const bool lane = r < RL;
    if (lane) { sh[threadIdx.x] = s1; sh[256 + threadIdx.x] = s2; }
    __syncthreads();
    if (r == 0) {
        ACC a = 0, b = 0;
        for (int i = 0; i < RL; ++i) { a += sh[i * CW + k]; b += sh[256 + i * CW + k]; }
        part1[k * S + s] = a; part2[k * S + s] = b;
    }
    if (!last_block(counter, S)) return false;
    ACC a = 0, b = 0;
    const volatile ACC* q1 = part1 + k * S;
    const volatile ACC* q2 = part2 + k * S;
    if (lane) for (int i = r; i < S; i += RL) { a += q1[i]; b += q2[i]; }
    __syncthreads();
    if (lane) { sh[threadIdx.x] = a; sh[256 + threadIdx.x] = b; }
    __syncthreads();
    if (r != 0) return false;
    t1 = 0; t2 = 0;
    for (int i = 0; i < RL; ++i) { t1 += sh[i * CW + k]; t2 += sh[256 + i * CW + k]; }
    return true;
}

extern "C" __global__ void bn_stats_cl(const T* x, long long M, long long NC, int S, int CW,
                                        ACC* part1, ACC* part2, int* counters, const ACC* gamma, const ACC* beta,
                                        ACC* mean_out, ACC* invstd_out, ACC* scale, ACC* shift,
                                        ACC* running_mean, ACC* running_var, double momentum, double eps) {
    CL_SETUP
    const T* a = x; const T* b = x;
    const ACC K = c < NC ? LOAD(x[c]) : (ACC)0;
    ACC s1 = 0, s2 = 0;
    COL_SUMS((A_ - K), (A_ - K) * (A_ - K))
    ACC t1, t2;
    const long long slot = (long long)blockIdx.y * CW * S;
    if (column_totals(s1, s2, sh, part1 + slot, part2 + slot, counters + blockIdx.y, s, S, CW, RL, k, r, t1, t2)
        && c < NC)
        STATS_FINISH(M)
}

extern "C" __global__ void bn_bwd_stats_cl(const T* dy, const T* x, const ACC* mean, const ACC* invstd,
                                            const ACC* gamma, const ACC* beta, long long M, long long NC, int S,
                                            int CW, ACC* part1, ACC* part2, int* counters, ACC* dgamma,
                                            ACC* dbeta, ACC* ca, ACC* cb, ACC* ck, ACC* csc, ACC* csf, int relu) {
    CL_SETUP
    const T* a = dy; const T* b = x;
    const ACC K = c < NC ? mean[c] : (ACC)0;
    const ACC g0 = (gamma && c < NC) ? gamma[c] : (ACC)1, b0 = (beta && c < NC) ? beta[c] : (ACC)0;
    const ACC inv0 = c < NC ? invstd[c] : (ACC)0;
    const ACC sc = g0 * inv0, sf = b0 - K * g0 * inv0;
    ACC s1 = 0, s2 = 0;
    COL_SUMS(MASKED(A_, B_), MASKED(A_, B_) * (B_ - K))
    ACC t1, t2;
    const long long slot = (long long)blockIdx.y * CW * S;
    if (column_totals(s1, s2, sh, part1 + slot, part2 + slot, counters + blockIdx.y, s, S, CW, RL, k, r, t1, t2)
        && c < NC)
        BWD_FINISH(M)
}

// The apply kernels on channels-last data: a grid-stride loop over vectors (or elements), each element's channel
// its index modulo C.
extern "C" __global__ void bn_apply_cl(const T* x, T* y, const ACC* scale, const ACC* shift, unsigned NC, int vec,
                                        unsigned total, int relu) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        if (vec) {
            VT v = ((const VT*)x)[i];
            T* p = (T*)&v;
            _Pragma("unroll") for (int u = 0; u < VW; ++u) {
                const unsigned c = (i * VW + u) % NC;
                p[u] = STORE(ACT(LOAD(p[u]) * scale[c] + shift[c]));
            }
            ((VT*)y)[i] = v;
        } else {
            const unsigned c = i % NC;
            y[i] = STORE(ACT(LOAD(x[i]) * scale[c] + shift[c]));
        }
    }
}

extern "C" __global__ void bn_bwd_apply_cl(const T* dy, const T* x, T* dx, const ACC* ca, const ACC* cb,
                                            const ACC* ck, unsigned NC, int vec, unsigned total, const ACC* csc,
                                            const ACC* csf, int relu) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        if (vec) {
            VT g = ((const VT*)dy)[i], v = ((const VT*)x)[i], o;
            const T* pg = (const T*)&g; const T* pv = (const T*)&v; T* po = (T*)&o;
            _Pragma("unroll") for (int u = 0; u < VW; ++u) {
                const unsigned c = (i * VW + u) % NC;
                const ACC sc = csc[c], sf = csf[c], xv = LOAD(pv[u]);
                po[u] = STORE(ca[c] * MASKED(LOAD(pg[u]), xv) + cb[c] * xv + ck[c]);
            }
            ((VT*)dx)[i] = o;
        } else {
            const unsigned c = i % NC;
            const ACC sc = csc[c], sf = csf[c], xv = LOAD(x[i]);
            dx[i] = STORE(ca[c] * MASKED(LOAD(dy[i]), xv) + cb[c] * xv + ck[c]);
        }
    }
}
"""

_VECTORS = {dt: ("uint4", 16 // dt.itemsize) for dt in HALVES}   # 16-byte vectors: VT, VW (in elements)
_VECTORS.update({np.dtype(np.float32): ("float4", 4), np.dtype(np.float64): ("double2", 2)})
_modules: dict = {}
_sm: dict = {}


def _fn(name, dtype):
    mod = _modules.get(dtype)
    if mod is None:
        vt, vw = _VECTORS[dtype]
        head = prelude(dtype) + f"#define VT {vt}\n#define VW {vw}\n"
        mod = _modules[dtype] = cupy.RawModule(code=head + _SOURCE, options=("--std=c++14",))
    return mod.get_function(name)


def supports(x, *params) -> bool:
    """CuPy float16/bfloat16/float32/float64 arrays of 2 to 5 axes, C-contiguous or channels-last (then fewer than
    2**32 elements), with parameters (or None) in :func:`param_dtype` of ``x.dtype``."""
    if type(x) is not cupy.ndarray or x.dtype not in _VECTORS or not 2 <= x.ndim <= 5:
        return False
    if not x._c_contiguous and not (is_channels_last(x) and x.size < 2**32):
        return False
    pdt = param_dtype(x.dtype)
    return all(p is None or (type(p) is cupy.ndarray and p.dtype == pdt) for p in params)


def param_dtype(dtype) -> np.dtype:
    """The dtype of the scale, shift, running and saved statistics for data of ``dtype``: float32 for the halves
    (cuDNN's rule), the data's own otherwise.

    >>> param_dtype(np.float16), param_dtype(np.float64)
    (dtype('float32'), dtype('float64'))
    """
    return compute_dtype(dtype)


def _geometry(x):
    n, c = x.shape[0], x.shape[1]
    return n, c, x.size // (n * c)


def _sm_count(dev):
    sm = _sm.get(dev)
    if sm is None:
        sm = _sm[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
    return sm


def _vec(hw, dtype, *arrays):
    """Whether rows can be read as vectors: whole vectors per row, 16-byte aligned inputs (CuPy allocates
    outputs aligned)."""
    return int(hw % _VECTORS[dtype][1] == 0 and all(a.data.ptr % 16 == 0 for a in arrays))


def _reduce_launch(n, c, hw, vec, dtype, dev):
    """``(S, threads, vec)``: row splits per channel (about four blocks per SM in all), the block size, and
    whether rows are read as vectors (rows of at least 64 vectors; shorter rows are read flat)."""
    s = int(max(1, min(n, -(-4 * _sm_count(dev) // c), 1024)))
    s = -(-n // -(-n // s))   # every block gets at least one row
    width = hw // _VECTORS[dtype][1]
    if not vec or width < 64:
        return s, 256, 0
    return s, (256 if width >= 256 else 1 << (width - 1).bit_length()), 1


def _apply_launch(n, c, hw, vec, dtype, dev):
    """``(grid, block, flat, total)``: a block per row chunk for rows of 256 vectors or more, else a flat
    grid-stride loop (32-bit indices, so only below 2**32 items)."""
    vw = _VECTORS[dtype][1]
    width = hw // vw if vec else hw
    total = n * c * hw // vw if vec else n * c * hw
    if width < 256 and total < 2**32:
        return (min(-(-total // 256), 32 * _sm_count(dev)),), (256,), 1, total
    chunks = max(1, min(-(-width // 1024), 65535))
    return (n * c, chunks), (256,), 0, 0


def _column_launch(m, c, dev):
    """``(grid, block, CW, S)`` of the channels-last statistics kernels: CW channel lanes (at most 32) per block,
    chunks of CW channels, S row splits per chunk (about four blocks per SM in all, each with a row at least)."""
    cw = min(c, 32)
    chunks = -(-c // cw)
    s = int(max(1, min(m, -(-4 * _sm_count(dev) // chunks), 1024)))
    s = -(-m // -(-m // s))
    return (s, chunks), (_THREADS,), cw, s


class _ChannelsLastPlan:
    """:class:`_Plan` for channels-last data: the statistics kernels read ``x`` as an ``(M, C)`` matrix."""
    __slots__ = ("stats", "apply", "bwd_stats", "bwd_apply", "red", "app", "scalars", "app_scalars", "part",
                 "counter", "c")

    def __init__(self, shape, dtype, vec, dev):
        c = shape[1]
        m = int(np.prod(shape, dtype=np.int64)) // c
        grid, block, cw, s = _column_launch(m, c, dev)
        self.stats, self.apply = _fn("bn_stats_cl", dtype), _fn("bn_apply_cl", dtype)
        self.bwd_stats, self.bwd_apply = _fn("bn_bwd_stats_cl", dtype), _fn("bn_bwd_apply_cl", dtype)
        self.red = (grid, block)
        total = m * c // _VECTORS[dtype][1] if vec else m * c
        self.app = ((max(1, min(-(-total // _THREADS), 32 * _sm_count(dev))),), (_THREADS,))
        self.c = c
        self.scalars = (np.int64(m), np.int64(c), np.int32(s), np.int32(cw))
        self.app_scalars = (np.uint32(c), np.int32(vec), np.uint32(total))
        part = cupy.empty((2, grid[1] * cw * s), param_dtype(dtype))
        self.part = (part[0], part[1])
        self.counter = cupy.zeros(grid[1], dtype=cupy.int32)   # left at zero by the kernels


class _Plan:
    """Everything about one problem that does not change from call to call: the kernels, the launch shapes,
    the scalar arguments, and the scratch buffers (partials, counters), kept per (shape, dtype, alignment,
    device, stream) so a call only allocates its outputs and launches."""
    __slots__ = ("stats", "apply", "bwd_stats", "bwd_apply", "red", "app", "scalars", "app_scalars", "part",
                 "counter", "c")

    def __init__(self, shape, dtype, vec, dev):
        n, c = shape[0], shape[1]
        hw = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
        s, threads, row_vec = _reduce_launch(n, c, hw, vec, dtype, dev)
        self.stats, self.apply = _fn("bn_stats", dtype), _fn("bn_apply", dtype)
        self.bwd_stats, self.bwd_apply = _fn("bn_bwd_stats", dtype), _fn("bn_bwd_apply", dtype)
        self.red = ((s, c), (threads,))
        grid, block, flat, total = _apply_launch(n, c, hw, vec, dtype, dev)
        self.app = (grid, block)
        self.c = c
        self.scalars = (np.int64(n), np.int64(c), np.int64(hw), np.int32(s), np.int32(row_vec))
        self.app_scalars = (np.int64(c), np.int64(hw), np.int32(vec), np.int32(flat), np.uint32(total))
        part = cupy.empty((2, c * s), param_dtype(dtype))
        self.part = (part[0], part[1])
        self.counter = cupy.zeros(c, dtype=cupy.int32)   # left at zero by the kernels


_plans: dict = {}


def _plan(x, *others):
    n, c, hw = _geometry(x)
    cl = not x._c_contiguous
    # channels-last data is read as one flat run of vectors: whole vectors in all, aligned
    vec = _vec(x.size if cl else hw, x.dtype, x, *others)
    dev = x.device.id
    key = (x.shape, x.dtype, vec, dev, cupy.cuda.get_current_stream().ptr, cl)
    p = _plans.get(key)
    if p is None:
        p = _plans[key] = (_ChannelsLastPlan if cl else _Plan)(x.shape, x.dtype, vec, dev)
    return p


_NULL = np.uint64(0)


def _p(a):
    return _NULL if a is None else a


def forward_training(x, gamma, beta, running_mean, running_var, momentum: float, eps: float, relu: bool = False):
    """``(y, mean, invstd)`` in two launches (``y`` through relu when ``relu``); the running statistics (or None)
    are moved in place."""
    p = _plan(x)
    y = cupy.empty_like(x)   # in x's layout
    stats = cupy.empty((4, p.c), param_dtype(x.dtype))   # mean, invstd, scale, shift
    mean, invstd, scale, shift = stats
    p.stats(*p.red, (x, *p.scalars, *p.part, p.counter, _p(gamma), _p(beta), mean, invstd, scale, shift,
                     _p(running_mean), _p(running_var), np.float64(momentum), np.float64(eps)))
    p.apply(*p.app, (x, y, scale, shift, *p.app_scalars, np.int32(relu)))
    return y, mean, invstd


def backward(dy, x, gamma, beta, mean, invstd, eps: float, relu: bool = False):
    """``(dx, dgamma, dbeta)`` in two launches; with ``relu``, ``dy`` is first masked where the forward's output
    was not positive (recomputed from ``x``, so ``y`` is not needed)."""
    dy = like_layout(dy, x)
    p = _plan(x, dy)
    dx = cupy.empty_like(x)
    # dgamma, dbeta, the coefficients a, b, k of dx, the forward's scale, shift
    out = cupy.empty((7, p.c), param_dtype(x.dtype))
    dgamma, dbeta, a, b, k, sc, sf = out
    r = np.int32(relu)
    p.bwd_stats(*p.red, (dy, x, mean, invstd, _p(gamma), _p(beta), *p.scalars, *p.part, p.counter, dgamma, dbeta,
                         a, b, k, sc, sf, r))
    p.bwd_apply(*p.app, (dy, x, dx, a, b, k, *p.app_scalars, sc, sf, r))
    return dx, dgamma, dbeta
