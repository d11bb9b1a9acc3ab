// Layer norm backward in two sweeps a row (the second rereads x and dy, from L2 as a rule), so that a thread holds
// only its column sums of dy * xhat (ag) and dy (ab) over the rows its group visits; the RPB groups of a block add
// theirs in shared memory in a fixed order and the block writes them as row blockIdx.x of the partials.
// One kernel a module, by SUMS (layernorm_columns.cuh):
//   ln_bwd  SUMS 1: dx and the column sums
//   ln_dx2  SUMS 0: dx alone, a vector's worth of values a thread at a time (the split backward's longest rows)
#include "layernorm_columns.cuh"

// Of vector j of a row: xh = (x [+ res + bias] - mu) * rs, d = dy and g = dy * gamma.
__device__ __forceinline__ void xhat_and_g(const T* x, const T* res, const C* bias, const T* dy, const C* gamma,
                                           long long row, int j, C mu, C rs, C* xh, C* g, C* d) {
    load_vec(x, res, bias, row, j, xh);
    load_vec(dy, nullptr, nullptr, row, j, d);
    #pragma unroll
    for (int u = 0; u < VW; ++u) {
        xh[u] = (xh[u] - mu) * rs;
        g[u] = gamma ? d[u] * gamma[j * VW + u] : d[u];
    }
}

// The row sums' scratch (a value a warp of each row of the block), declared before write_partials' arrays so that it
// comes first in shared memory: the layout the planner's register estimates were fitted to.
__shared__ C row_scratch[RPB * NW];

__device__ __forceinline__ void two_sweeps(const T* dy, const T* x, const C* gamma, const C* mean, const C* rstd,
                                           T* dx, C* pg, C* pb, long long R, int want_params, const T* res,
                                           const C* bias) {
    C* const sh = row_scratch;
    const int tid = threadIdx.x % TPR, grp = threadIdx.x / TPR;
    C ag[SUMS ? ITEMS * VW : 1], ab[SUMS ? ITEMS * VW : 1];
    if constexpr (SUMS) {
        #pragma unroll
        for (int k = 0; k < ITEMS * VW; ++k) { ag[k] = 0; ab[k] = 0; }
    }
    for (long long base = blockIdx.x; base * RPB < R; base += gridDim.x) {   // the same trip count block-wide
        const long long row = base * RPB + grp;
        const bool valid = row < R;
        const C mu = valid ? mean[row] : (C)0, rs = valid ? rstd[row] : (C)0;
        C s1 = 0, s2 = 0;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (valid && j < LV) {
                C xh[VW], g[VW], d[VW];
                xhat_and_g(x, res, bias, dy, gamma, row, j, mu, rs, xh, g, d);
                #pragma unroll
                for (int u = 0; u < VW; ++u) {
                    s1 += g[u]; s2 += g[u] * xh[u];
                    if constexpr (SUMS) { ag[i * VW + u] += d[u] * xh[u]; ab[i * VW + u] += d[u]; }
                }
            }
        }
        const C m1 = row_sum(s1, sh) / (C)L, m2 = row_sum(s2, sh) / (C)L;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (valid && j < LV) {
                C xh[VW], g[VW], d[VW];
                xhat_and_g(x, res, bias, dy, gamma, row, j, mu, rs, xh, g, d);
                VT w;
                T* e = (T*)&w;
                #pragma unroll
                for (int u = 0; u < VW; ++u) e[u] = STORE(rs * (g[u] - m1 - xh[u] * m2));
                ((VT*)(dx + row * (long long)L))[j] = w;
            }
        }
    }
    if constexpr (SUMS) {
        if (want_params) write_partials(ag, ab, pg, pb, tid, grp);
    }
}

#define BACKWARD_ARGS const T* dy, const T* x, const C* gamma, const C* mean, const C* rstd, T* dx, C* pg, C* pb, \
                      long long R, int want_params, const T* res, const C* bias
#define BACKWARD_CALL two_sweeps(dy, x, gamma, mean, rstd, dx, pg, pb, R, want_params, res, bias)

#if SUMS
extern "C" __global__ void __launch_bounds__(TPR * RPB, BLOCKS) ln_bwd(BACKWARD_ARGS) { BACKWARD_CALL; }
#else
extern "C" __global__ void __launch_bounds__(TPR * RPB, BLOCKS) ln_dx2(BACKWARD_ARGS) { BACKWARD_CALL; }
#endif
