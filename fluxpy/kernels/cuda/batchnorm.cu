// fluxpy's batch-norm kernels, NCHW and channels-last, forward and backward (fluxpy/kernels/cuda_bn.py).
#include "halfs.cuh"
// T: data (LOAD/STORE from halfs.cuh), ACC = C: accumulation, statistics and parameters (float32 for the
// halves, as cuDNN), VT/VW: the 16-byte vector type and its width in T for aligned rows, FX_ACT(v) and
// FX_ACT_GRAD(v): the activation applied to the normalised value and its derivative, expressions in ACC (the
// activation's formula traced from its Python definition, fluxpy/kernels/trace.py: activation_c).
#define ACC C
// FX_RES (1 or 0): whether a residual r (x's shape, dtype and layout) joins the normalised value before the
// activation, y = act(PRE(x) + r) (a residual block's add and relu in the batch norm's own passes); the backward
// then reads r again to recompute the pre-activation and writes dr = dy act' beside dx.
#if FX_RES
#define WITH_R(v, rv) ((v) + (rv))
#else
#define WITH_R(v, rv) (v)
#endif
// Element i of the residual r as ACC, 0 without one (not read then).
#define R_AT(rp, i) (FX_RES ? LOAD((rp)[i]) : (ACC)0)
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
// other blocks' partials: after a fence, and through L2 (__ldcg: sum_partials, column_totals). Plain loads may be
// served from this SM's L1, which can hold a stale copy of the line: the partials of neighbouring channels share
// it, and an earlier last block on this SM read them (or a previous layer of the same shape, which shares the
// buffers, wrote them). Volatile loads would do too, but they are issued one after another, where __ldcg loads
// overlap.
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
__device__ __forceinline__ void sum_partials(const ACC* p1, const ACC* p2, int S, ACC& s1,
                                             ACC& s2) {
    s1 = 0; s2 = 0;
    for (int i = threadIdx.x; i < S; i += 32) { s1 += __ldcg(p1 + i); s2 += __ldcg(p2 + i); }
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

// Sums of f(a[k], b[k], r[k]) over rows [rlo, rhi) of channel c: f = (a - K, (a - K)^2) or (a, a (b - K)); the
// residual rr is read only where RS (a compile-time constant of the kernel) says so, else R_ is 0.
#define ROW_SUMS(EXPR1, EXPR2)                                                                          \
    if (vec) {                                                                                          \
        const int hv = (int)(HW / VW);                                                                  \
        for (long long n = rlo; n < rhi; ++n) {                                                        \
            const long long base = (n * NC + c) * HW;                                                    \
            const VT* av = (const VT*)(a + base);                                                       \
            const VT* bv = (const VT*)(b + base);                                                       \
            const VT* rv_ = (const VT*)(rr + base);                                                     \
            for (int j = threadIdx.x; j < hv; j += blockDim.x) {                                        \
                VT va = av[j], vb = bv[j], vr = va;                                                     \
                if (RS) vr = rv_[j];                                                                    \
                const T* pa = (const T*)&va; const T* pb = (const T*)&vb; const T* pr = (const T*)&vr;  \
                _Pragma("unroll") for (int u = 0; u < VW; ++u) {                                        \
                    ACC A_ = LOAD(pa[u]), B_ = LOAD(pb[u]), R_ = RS ? LOAD(pr[u]) : (ACC)0;              \
                    s1 += EXPR1; s2 += EXPR2;                                                           \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    } else {                                                                                            \
        const unsigned hw = (unsigned)HW;                                                               \
        const unsigned total = (unsigned)((rhi - rlo) * HW);                                            \
        for (unsigned i = threadIdx.x; i < total; i += blockDim.x) {                                    \
            unsigned n = i / hw, j = i - n * hw;                                                        \
            long long k = ((rlo + n) * NC + c) * HW + j;                                                 \
            ACC A_ = LOAD(a[k]), B_ = LOAD(b[k]), R_ = RS ? LOAD(rr[k]) : (ACC)0;                         \
            s1 += EXPR1; s2 += EXPR2;                                                                   \
        }                                                                                               \
    }

// From a channel's totals t1 = sum(x - K), t2 = sum((x - K)^2) over its M values: the statistics, the scale and
// bias of the apply kernel (PRE), and the running statistics moved (the variance unbiased), their old values first
// written to old_running (mean, then var, NC values each) where it is given (a training step's journal).
#define STATS_FINISH(M_)                                                                                    \
    {                                                                                                       \
        /* every load before any store: the compiler cannot tell the outputs from the inputs, so a load after */ \
        /* a store would wait for it */                                                                     \
        const ACC g = gamma ? gamma[c] : (ACC)1, bb = beta ? beta[c] : (ACC)0;                              \
        const ACC rm0 = running_mean ? running_mean[c] : (ACC)0, rv0 = running_mean ? running_var[c] : (ACC)0; \
        const long long count = (M_);                                                                       \
        ACC m = (ACC)count;                                                                                 \
        ACC dm = t1 / m;                                                                                    \
        ACC var = t2 / m - dm * dm;                                                                         \
        if (var < (ACC)0) var = 0;                                                                          \
        ACC mu = K + dm;                                                                                    \
        ACC inv = (ACC)1 / sqrt(var + (ACC)eps);                                                            \
        mean_out[c] = mu; invstd_out[c] = inv;                                                              \
        scale[c] = g * inv; bias[c] = bb;                                                                   \
        if (running_mean) {                                                                                 \
            if (old_running) { old_running[c] = rm0; old_running[NC + c] = rv0; }                           \
            double unbiased = (double)var * (double)count / (double)(count - 1);                            \
            running_mean[c] = (ACC)((1 - momentum) * (double)rm0 + momentum * (double)mu);                  \
            running_var[c] = (ACC)((1 - momentum) * (double)rv0 + momentum * unbiased);                     \
        }                                                                                                   \
    }

extern "C" __global__ void bn_stats(const T* x, long long N, long long NC, long long HW, int S, int vec,
                                     ACC* part1, ACC* part2, int* counters, const ACC* gamma, const ACC* beta,
                                     ACC* mean_out, ACC* invstd_out, ACC* scale, ACC* bias,
                                     ACC* running_mean, ACC* running_var, ACC* old_running, double momentum,
                                     double eps) {
    __shared__ ACC sh[64];
    const long long c = blockIdx.y;
    const int s = blockIdx.x;
    const long long rc = (N + S - 1) / S, rlo = s * rc, rhi = min(N, rlo + rc);
    const T* a = x; const T* b = x;
    constexpr bool RS = false; const T* rr = x;
    const ACC K = LOAD(x[c * HW]);
    ACC s1 = 0, s2 = 0;
    ROW_SUMS((A_ - K), (A_ - K) * (A_ - K))
    ACC t1, t2;
    if (channel_totals(s1, s2, sh, part1 + c * S, part2 + c * S, counters + c, s, S, t1, t2))
        STATS_FINISH(N * HW)
}

// The normalised value before the activation, (x - mean) * scale + bias (scale = gamma * invstd, bias = beta), from
// the channel's mu, sc and sf in scope: written as PyTorch's is, so that a value equal to its channel's mean (a
// constant channel) gives exactly beta, and the activation's derivative is taken there, as the exact value's is.
#define PRE(xv) (((xv) - mu) * sc + sf)
#define ACT(v) FX_ACT(v)

// y = act(PRE(x)): a block per (row, chunk), row = n * NC + c; or, for short rows (flat), a grid-stride loop over
// the whole tensor with 32-bit index arithmetic.

extern "C" __global__ void bn_apply(const T* x, T* y, const ACC* mean, const ACC* scale, const ACC* bias, long long NC,
                                     long long HW, int vec, int flat, unsigned total, const T* r) {
    if (flat) {
        const unsigned hv = vec ? (unsigned)(HW / VW) : (unsigned)HW, cc = (unsigned)NC;
        for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
            const unsigned c = (i / hv) % cc;
            const ACC mu = mean[c], sc = scale[c], sf = bias[c];
            if (vec) {
                VT v = ((const VT*)x)[i], vr = v;
                if (FX_RES) vr = ((const VT*)r)[i];
                T* p = (T*)&v; const T* pr = (const T*)&vr;
                _Pragma("unroll") for (int u = 0; u < VW; ++u) p[u] = STORE(ACT(WITH_R(PRE(LOAD(p[u])), R_AT(pr, u))));
                ((VT*)y)[i] = v;
            } else {
                y[i] = STORE(ACT(WITH_R(PRE(LOAD(x[i])), R_AT(r, i))));
            }
        }
        return;
    }
    const long long row = blockIdx.x;
    const long long c = row % NC;
    const ACC mu = mean[c], sc = scale[c], sf = bias[c];
    const long long base = row * HW;
    const T* rb = FX_RES ? r + base : x;
    if (vec) {
        const VT* xv = (const VT*)(x + base);
        VT* yv = (VT*)(y + base);
        for (long long j = (long long)blockIdx.y * blockDim.x + threadIdx.x; j < HW / VW;
             j += (long long)gridDim.y * blockDim.x) {
            VT v = xv[j], vr = v;
            if (FX_RES) vr = ((const VT*)rb)[j];
            T* p = (T*)&v; const T* pr = (const T*)&vr;
            _Pragma("unroll") for (int u = 0; u < VW; ++u) p[u] = STORE(ACT(WITH_R(PRE(LOAD(p[u])), R_AT(pr, u))));
            yv[j] = v;
        }
    } else {
        const long long step = (long long)gridDim.y * blockDim.x;
        for (long long j = (long long)blockIdx.y * blockDim.x + threadIdx.x; j < HW; j += step)
            y[base + j] = STORE(ACT(WITH_R(PRE(LOAD(x[base + j])), R_AT(rb, j))));
    }
}

// The forward's coefficients of channel c as the backward recomputes them (PRE's mu, sc, sf): the same
// expressions as the forward's, so the same rounding.
__device__ __forceinline__ void forward_coefs(const ACC* mean, const ACC* invstd, const ACC* gamma,
                                              const ACC* beta, long long c, ACC& mu, ACC& sc, ACC& sf) {
    const ACC g0 = gamma ? gamma[c] : (ACC)1, b0 = beta ? beta[c] : (ACC)0, inv0 = invstd[c];
    mu = mean[c];
    sc = g0 * inv0; sf = b0;
}

// dy times the activation's derivative at the forward's pre-activation, recomputed from x (PRE) and the residual's
// value rv (FX_RES).
#define MASKED(g, xv, rv) ((g) * FX_ACT_GRAD(WITH_R(PRE(xv), rv)))

// From a channel's totals t1 = sum(dy'), t2 = sum(dy' (x - mean)) over its M values (dy' = dy act'):
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
                                         ACC* dbeta, ACC* ca, ACC* cb, ACC* ck, ACC* csc, ACC* csf, const T* r) {
    __shared__ ACC sh[64];
    const long long c = blockIdx.y;
    const int s = blockIdx.x;
    const long long rc = (N + S - 1) / S, rlo = s * rc, rhi = min(N, rlo + rc);
    const T* a = dy; const T* b = x;
    constexpr bool RS = FX_RES; const T* rr = RS ? r : x;
    ACC mu, sc, sf;
    forward_coefs(mean, invstd, gamma, beta, c, mu, sc, sf);
    const ACC K = mu;
    ACC s1 = 0, s2 = 0;
    ROW_SUMS(MASKED(A_, B_, R_), MASKED(A_, B_, R_) * (B_ - K))
    ACC t1, t2;
    if (channel_totals(s1, s2, sh, part1 + c * S, part2 + c * S, counters + c, s, S, t1, t2))
        BWD_FINISH(N * HW)
}

// dx = a[c] dy' + b[c] x + k[c] (dy' = dy act', written to dr too where FX_RES), laid out as bn_apply.
extern "C" __global__ void bn_bwd_apply(const T* dy, const T* x, T* dx, const ACC* ca, const ACC* cb, const ACC* ck,
                                         long long NC, long long HW, int vec, int flat, unsigned total,
                                         const ACC* csc, const ACC* csf, const ACC* mean, const T* r, T* dr) {
    if (flat) {
        const unsigned hv = vec ? (unsigned)(HW / VW) : (unsigned)HW, cc = (unsigned)NC;
        for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
            const unsigned c = (i / hv) % cc;
            const ACC a = ca[c], b = cb[c], k = ck[c], mu = mean[c], sc = csc[c], sf = csf[c];
            if (vec) {
                VT g = ((const VT*)dy)[i], v = ((const VT*)x)[i], vr = v, o, od;
                if (FX_RES) vr = ((const VT*)r)[i];
                const T* pg = (const T*)&g; const T* pv = (const T*)&v; const T* pr = (const T*)&vr;
                T* po = (T*)&o; T* pd = (T*)&od;
                _Pragma("unroll") for (int u = 0; u < VW; ++u) {
                    ACC xv = LOAD(pv[u]), gz = MASKED(LOAD(pg[u]), xv, R_AT(pr, u));
                    po[u] = STORE(a * gz + b * xv + k);
                    if (FX_RES) pd[u] = STORE(gz);
                }
                ((VT*)dx)[i] = o;
                if (FX_RES) ((VT*)dr)[i] = od;
            } else {
                ACC xv = LOAD(x[i]), gz = MASKED(LOAD(dy[i]), xv, R_AT(r, i));
                dx[i] = STORE(a * gz + b * xv + k);
                if (FX_RES) dr[i] = STORE(gz);
            }
        }
        return;
    }
    const long long row = blockIdx.x;
    const long long c = row % NC;
    const ACC a = ca[c], b = cb[c], k = ck[c], mu = mean[c], sc = csc[c], sf = csf[c];
    const long long base = row * HW;
    const T* rb = FX_RES ? r + base : x;
    T* drb = FX_RES ? dr + base : dx;
    if (vec) {
        const VT* gv = (const VT*)(dy + base);
        const VT* xvp = (const VT*)(x + base);
        VT* ov = (VT*)(dx + base);
        for (long long j = (long long)blockIdx.y * blockDim.x + threadIdx.x; j < HW / VW;
             j += (long long)gridDim.y * blockDim.x) {
            VT g = gv[j], v = xvp[j], vr = v, o, od;
            if (FX_RES) vr = ((const VT*)rb)[j];
            const T* pg = (const T*)&g; const T* pv = (const T*)&v; const T* pr = (const T*)&vr;
            T* po = (T*)&o; T* pd = (T*)&od;
            _Pragma("unroll") for (int u = 0; u < VW; ++u) {
                ACC xv = LOAD(pv[u]), gz = MASKED(LOAD(pg[u]), xv, R_AT(pr, u));
                po[u] = STORE(a * gz + b * xv + k);
                if (FX_RES) pd[u] = STORE(gz);
            }
            ov[j] = o;
            if (FX_RES) ((VT*)drb)[j] = od;
        }
    } else {
        const long long step = (long long)gridDim.y * blockDim.x;
        for (long long j = (long long)blockIdx.y * blockDim.x + threadIdx.x; j < HW; j += step) {
            ACC xv = LOAD(x[base + j]), gz = MASKED(LOAD(dy[base + j]), xv, R_AT(rb, j));
            dx[base + j] = STORE(a * gz + b * xv + k);
            if (FX_RES) drb[j] = STORE(gz);
        }
    }
}

// ---- Channels-last (x is an (M, C) row-major matrix, M = N * spatial) ----------------------------------------
// Each thread owns VW adjacent channels (one 16-byte vector of a row where C is a multiple of VW and the arrays
// are aligned, VW scalar loads otherwise): thread t is vector column k = t % CV of its chunk (CV, a power of two,
// columns of VW channels: the chunk's CH = CV * VW channels) and row lane r = t / CV (RL = blockDim.x / CV lanes,
// also a power of two). Block (s, chunk) sums rows [rlo, rhi), four rows in flight per lane; the lanes' sums are
// added by shuffles within each warp and then warp by warp (a fixed order), the block's sums go to partial s of
// the chunk, and the chunk's last block adds the S partials the same way (lane r takes s = r, r + RL, ...), so
// results do not depend on timing.
#define CL_SETUP                                                                                            \
    __shared__ ACC sh1[8 * 32];                                                                             \
    __shared__ ACC sh2[8 * 32];                                                                             \
    const int RL = blockDim.x / CV;                                                                         \
    const int k = threadIdx.x % CV, r = threadIdx.x / CV;                                                   \
    const long long c0 = ((long long)blockIdx.y * CV + k) * VW;                                             \
    const int s = blockIdx.x;                                                                               \
    const long long q4 = 4LL * RL;   /* a split's rows: whole passes of four rows a lane (no row-at-a-time tail) */ \
    const long long rc = ((M + S - 1) / S + q4 - 1) / q4 * q4, rlo = s * rc, rhi = min(M, rlo + rc);

// The VW values of channels c0 .. c0 + VW - 1 in row `row` of a (channels beyond C read as 0).
__device__ __forceinline__ void load_row(const T* a, long long row, long long NC, long long c0, int vec, ACC* out) {
    const T* p = a + row * NC + c0;
    if (vec) {
        VT v = *(const VT*)p;
        const T* pv = (const T*)&v;
        _Pragma("unroll") for (int u = 0; u < VW; ++u) out[u] = LOAD(pv[u]);
    } else {
        _Pragma("unroll") for (int u = 0; u < VW; ++u) out[u] = c0 + u < NC ? LOAD(p[u]) : (ACC)0;
    }
}

// Rows [rlo + r, rhi) step RL of channels c0 .. c0 + VW - 1: s1[U] += EXPR1, s2[U] += EXPR2 over (A_, B_, R_),
// the values of a and (TWO = 1) b or (TWO = 0) a again, and of the residual rr where RS (a compile-time constant
// of the kernel; else R_ is 0), U the channel's slot; four rows loaded before any is added.
#define COL_SUMS(TWO, EXPR1, EXPR2)                                                                              \
    {                                                                                                       \
        long long row = rlo + r;                                                                            \
        ACC va[4][VW], vb[TWO ? 4 : 1][VW], vr[RS ? 4 : 1][VW];                                             \
        for (; row + 3 * RL < rhi; row += 4 * RL) {                                                         \
            _Pragma("unroll") for (int q = 0; q < 4; ++q) {                                                 \
                load_row(a, row + q * RL, NC, c0, vec, va[q]);                                              \
                if (TWO) load_row(b, row + q * RL, NC, c0, vec, vb[q]);                                  \
                if (RS) load_row(rr, row + q * RL, NC, c0, vec, vr[RS ? q : 0]);                            \
            }                                                                                               \
            _Pragma("unroll") for (int q = 0; q < 4; ++q)                                                   \
                _Pragma("unroll") for (int U = 0; U < VW; ++U) {                                            \
                    const ACC A_ = va[q][U], B_ = TWO ? vb[q][U] : va[q][U];                             \
                    const ACC R_ = RS ? vr[RS ? q : 0][U] : (ACC)0;                                         \
                    s1[U] += EXPR1; s2[U] += EXPR2;                                                         \
                }                                                                                           \
        }                                                                                                   \
        for (; row < rhi; row += RL) {                                                                      \
            load_row(a, row, NC, c0, vec, va[0]);                                                           \
            if (TWO) load_row(b, row, NC, c0, vec, vb[0]);                                               \
            if (RS) load_row(rr, row, NC, c0, vec, vr[0]);                                                  \
            _Pragma("unroll") for (int U = 0; U < VW; ++U) {                                                \
                const ACC A_ = va[0][U], B_ = TWO ? vb[0][U] : va[0][U];                                 \
                const ACC R_ = RS ? vr[0][U] : (ACC)0;                                                      \
                s1[U] += EXPR1; s2[U] += EXPR2;                                                             \
            }                                                                                               \
        }                                                                                                   \
    }

// The RL lanes' sums (a[u], b[u] of channels c0 + u) added in a fixed order: within each warp by shuffles (the
// lanes of one column sit CV threads apart), then the warps' sums in order through shared memory (sh1, sh2: a
// warp's CH = CV * VW values each). On return the threads of row lane 0 hold the block's totals in a and b.
__device__ __forceinline__ void lane_sums(ACC* a, ACC* b, ACC* sh1, ACC* sh2, int CV, int k, int r) {
    _Pragma("unroll") for (int u = 0; u < VW; ++u)
        for (int o = 16; o >= CV; o >>= 1) {
            a[u] += __shfl_down_sync(0xffffffff, a[u], o);
            b[u] += __shfl_down_sync(0xffffffff, b[u], o);
        }
    const int CH = CV * VW, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();   // the shared arrays' last readers are done
    if ((threadIdx.x & 31) < CV)
        _Pragma("unroll") for (int u = 0; u < VW; ++u) {
            sh1[warp * CH + k * VW + u] = a[u]; sh2[warp * CH + k * VW + u] = b[u];
        }
    __syncthreads();
    if (r == 0)
        _Pragma("unroll") for (int u = 0; u < VW; ++u) {
            a[u] = 0; b[u] = 0;
            for (int w = 0; w < warps; ++w) { a[u] += sh1[w * CH + k * VW + u]; b[u] += sh2[w * CH + k * VW + u]; }
        }
}

// True in every thread of the chunk's last block, whose row lane 0 then holds totals t1[u], t2[u] of channels
// c0 + u. part1/part2:
// every chunk's S partials of CH channels each (chunk blockIdx.y's partial s of channel j at (y * S + s) * CH + j);
// counters: one per chunk.
__device__ __forceinline__ bool column_totals(const ACC* s1, const ACC* s2, ACC* sh1, ACC* sh2, ACC* part1,
                                              ACC* part2, int* counters, int s, int S, int CV, int RL, int k, int r,
                                              ACC* t1, ACC* t2) {
    const int CH = CV * VW;
    const long long slot = (long long)blockIdx.y * CH * S;
    part1 += slot; part2 += slot;
    int* counter = counters + blockIdx.y;
    _Pragma("unroll") for (int u = 0; u < VW; ++u) { t1[u] = s1[u]; t2[u] = s2[u]; }
    lane_sums(t1, t2, sh1, sh2, CV, k, r);
    if (r == 0)
        _Pragma("unroll") for (int u = 0; u < VW; ++u) {
            part1[(long long)s * CH + k * VW + u] = t1[u];
            part2[(long long)s * CH + k * VW + u] = t2[u];
        }
    if (!last_block(counter, S)) return false;
    _Pragma("unroll") for (int u = 0; u < VW; ++u) { t1[u] = 0; t2[u] = 0; }
    for (int i = r; i < S; i += RL)
        _Pragma("unroll") for (int u = 0; u < VW; ++u) {
            t1[u] += __ldcg(part1 + (long long)i * CH + k * VW + u);
            t2[u] += __ldcg(part2 + (long long)i * CH + k * VW + u);
        }
    lane_sums(t1, t2, sh1, sh2, CV, k, r);
    return true;
}

// In the chunk's last block: row lane 0's totals (t1s, t2s of channels c0 + u) handed out one channel a thread
// through shared memory, so that the channels' finishes (loads, a division, stores) run side by side rather than
// VW after another in one thread. True in thread j < CH (a chunk has CH = CV * VW <= 32 channels, as the launch
// makes it) where its channel c = chunk * CH + j exists; t1, t2 are then that channel's totals.
__device__ __forceinline__ bool one_channel_a_thread(const ACC* t1s, const ACC* t2s, int CV, int k, int r,
                                                     long long NC, ACC& t1, ACC& t2, long long& c) {
    __shared__ ACC fin1[32], fin2[32];
    if (r == 0)
        _Pragma("unroll") for (int u = 0; u < VW; ++u) { fin1[k * VW + u] = t1s[u]; fin2[k * VW + u] = t2s[u]; }
    __syncthreads();
    const int CH = CV * VW;
    c = (long long)blockIdx.y * CH + threadIdx.x;
    if ((int)threadIdx.x >= CH || c >= NC) return false;
    t1 = fin1[threadIdx.x]; t2 = fin2[threadIdx.x];
    return true;
}

extern "C" __global__ void bn_stats_cl(const T* x, long long M, long long NC, int S, int CV, int vec,
                                        ACC* part1, ACC* part2, int* counters, const ACC* gamma, const ACC* beta,
                                        ACC* mean_out, ACC* invstd_out, ACC* scale, ACC* bias,
                                        ACC* running_mean, ACC* running_var, ACC* old_running, double momentum,
                                        double eps) {
    CL_SETUP
    const T* a = x; const T* b = x;
    constexpr bool RS = false; const T* rr = x;
    ACC Ks[VW], s1[VW], s2[VW];
    load_row(x, 0, NC, c0, vec && c0 < NC, Ks);   // the shift: each channel's first value
    _Pragma("unroll") for (int u = 0; u < VW; ++u) { s1[u] = 0; s2[u] = 0; }
    if (c0 < NC) COL_SUMS(0, (A_ - Ks[U]), (A_ - Ks[U]) * (A_ - Ks[U]))
    ACC t1s[VW], t2s[VW], t1, t2;
    long long c;
    if (!column_totals(s1, s2, sh1, sh2, part1, part2, counters, s, S, CV, RL, k, r, t1s, t2s)) return;
    if (!one_channel_a_thread(t1s, t2s, CV, k, r, NC, t1, t2, c)) return;
    const ACC K = LOAD(x[c]);   // the shift, as the sums took it: the channel's first value
    STATS_FINISH(M)
}

extern "C" __global__ void bn_bwd_stats_cl(const T* dy, const T* x, const ACC* mean, const ACC* invstd,
                                            const ACC* gamma, const ACC* beta, long long M, long long NC, int S,
                                            int CV, int vec, ACC* part1, ACC* part2, int* counters, ACC* dgamma,
                                            ACC* dbeta, ACC* ca, ACC* cb, ACC* ck, ACC* csc, ACC* csf,
                                            const T* res) {
    CL_SETUP
    const T* a = dy; const T* b = x;
    constexpr bool RS = FX_RES; const T* rr = RS ? res : x;
    ACC Ks[VW], scs[VW], sfs[VW], s1[VW], s2[VW];
    _Pragma("unroll") for (int u = 0; u < VW; ++u) {
        Ks[u] = 0; scs[u] = 0; sfs[u] = 0; s1[u] = 0; s2[u] = 0;
        if (c0 + u < NC) forward_coefs(mean, invstd, gamma, beta, c0 + u, Ks[u], scs[u], sfs[u]);
    }
#define mu Ks[U]
#define sc scs[U]
#define sf sfs[U]
    if (c0 < NC) COL_SUMS(1, MASKED(A_, B_, R_), MASKED(A_, B_, R_) * (B_ - mu))
#undef mu
#undef sc
#undef sf
    ACC t1s[VW], t2s[VW], t1, t2, mu, sc, sf;
    long long c;
    if (!column_totals(s1, s2, sh1, sh2, part1, part2, counters, s, S, CV, RL, k, r, t1s, t2s)) return;
    if (!one_channel_a_thread(t1s, t2s, CV, k, r, NC, t1, t2, c)) return;
    forward_coefs(mean, invstd, gamma, beta, c, mu, sc, sf);
    const ACC K = mu;
    BWD_FINISH(M)
}

// The apply kernels on channels-last data: a grid-stride loop whose stride is a whole number of rows (the launch
// makes gridDim.x * blockDim.x * W a multiple of C, W = VW with vectors, else 1), so each thread meets the same
// W channels at every step and keeps their coefficients in registers.
#define APPLY_SETUP(W)                                                                                      \
    const long long step = (long long)gridDim.x * blockDim.x;                                               \
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;                               \
    const long long cbase = (first * (W)) % NC;

extern "C" __global__ void bn_apply_cl(const T* x, T* y, const ACC* mean, const ACC* scale, const ACC* bias,
                                        long long NC, int vec, long long total, const T* r) {
    if (vec) {
        APPLY_SETUP(VW)
        ACC mus[VW], scs[VW], sfs[VW];
        _Pragma("unroll") for (int u = 0; u < VW; ++u) {
            mus[u] = mean[cbase + u]; scs[u] = scale[cbase + u]; sfs[u] = bias[cbase + u];
        }
        for (long long i = first; i < total; i += step) {
            VT v = ((const VT*)x)[i], vr = v;
            if (FX_RES) vr = ((const VT*)r)[i];
            T* p = (T*)&v; const T* pr = (const T*)&vr;
            _Pragma("unroll") for (int u = 0; u < VW; ++u) {
                const ACC mu = mus[u], sc = scs[u], sf = sfs[u];
                p[u] = STORE(ACT(WITH_R(PRE(LOAD(p[u])), R_AT(pr, u))));
            }
            ((VT*)y)[i] = v;
        }
    } else {
        APPLY_SETUP(1)
        const ACC mu = mean[cbase], sc = scale[cbase], sf = bias[cbase];
        for (long long i = first; i < total; i += step) y[i] = STORE(ACT(WITH_R(PRE(LOAD(x[i])), R_AT(r, i))));
    }
}

extern "C" __global__ void bn_bwd_apply_cl(const T* dy, const T* x, T* dx, const ACC* ca, const ACC* cb,
                                            const ACC* ck, long long NC, int vec, long long total, const ACC* csc,
                                            const ACC* csf, const ACC* mean, const T* r, T* dr) {
    if (vec) {
        APPLY_SETUP(VW)
        ACC a[VW], b[VW], kk[VW], mus[VW], scs[VW], sfs[VW];
        _Pragma("unroll") for (int u = 0; u < VW; ++u) {
            a[u] = ca[cbase + u]; b[u] = cb[cbase + u]; kk[u] = ck[cbase + u];
            mus[u] = mean[cbase + u]; scs[u] = csc[cbase + u]; sfs[u] = csf[cbase + u];
        }
        for (long long i = first; i < total; i += step) {
            VT g = ((const VT*)dy)[i], v = ((const VT*)x)[i], vr = v, o, od;
            if (FX_RES) vr = ((const VT*)r)[i];
            const T* pg = (const T*)&g; const T* pv = (const T*)&v; const T* pr = (const T*)&vr;
            T* po = (T*)&o; T* pd = (T*)&od;
            _Pragma("unroll") for (int u = 0; u < VW; ++u) {
                const ACC mu = mus[u], sc = scs[u], sf = sfs[u], xv = LOAD(pv[u]);
                const ACC gz = MASKED(LOAD(pg[u]), xv, R_AT(pr, u));
                po[u] = STORE(a[u] * gz + b[u] * xv + kk[u]);
                if (FX_RES) pd[u] = STORE(gz);
            }
            ((VT*)dx)[i] = o;
            if (FX_RES) ((VT*)dr)[i] = od;
        }
    } else {
        APPLY_SETUP(1)
        const ACC a = ca[cbase], b = cb[cbase], kk = ck[cbase], mu = mean[cbase], sc = csc[cbase],
                  sf = csf[cbase];
        for (long long i = first; i < total; i += step) {
            const ACC xv = LOAD(x[i]), gz = MASKED(LOAD(dy[i]), xv, R_AT(r, i));
            dx[i] = STORE(a * gz + b * xv + kk);
            if (FX_RES) dr[i] = STORE(gz);
        }
    }
}
