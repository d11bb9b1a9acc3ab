// Layer norm backward in one sweep a row: a group of TPR threads holds its row's vectors of x and dy in registers
// (read once), sums g = dy * gamma and g * xhat over the row (row_sum2), writes dx = rstd (g - mean(g) - xhat
// mean(g xhat)) from the registers, and adds dy * xhat and dy to its columns' sums. Rows are visited block by
// block, grid-stride (the same trip count block-wide); with a residual/bias, x's vector is summed as it is taken.
// One kernel a module, by SUMS and HOLD (layernorm_columns.cuh):
//   ln_bwd1  SUMS 1: the column sums in registers, RPB rows a block
//   ln_bwds  SUMS 2, HOLD 1: the column sums in dynamic shared memory (2 L values), one row a block, gamma held
//   ln_bwdr  SUMS 2, HOLD 0: the same reading gamma twice a row (where its copy does not fit beside the row)
//   ln_dx1   SUMS 0: dx alone (the split backward; ln_cols sums the columns apart)
// PREFETCH: the loads of the group's next row are issued before this row's sums, barriers and stores (a second
// buffer of raw vectors). BLOCKS: blocks an SM ptxas is held to (one is enough: without the bound, ptxas traded
// registers for a second block and spilled; 2 for ln_bwd1's two-block forms, kept only where ptxas fits them).
#include "layernorm_columns.cuh"

#define ROW_BOUNDS __launch_bounds__(TPR * RPB, BLOCKS)

// The raw vectors of x and dy this thread holds of a row, and the row's statistics (zeros past the rows or the row).
__device__ __forceinline__ void fetch(const T* x, const T* dy, const C* mean, const C* rstd, long long row,
                                      long long R, int tid, VT* bx, VT* bd, C& mu, C& rs) {
    const bool valid = row < R;
    mu = valid ? mean[row] : (C)0;
    rs = valid ? rstd[row] : (C)0;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (valid && j < LV) {
            bx[i] = ((const VT*)(x + row * (long long)L))[j];
            bd[i] = ((const VT*)(dy + row * (long long)L))[j];
        } else {
            bx[i] = vec_t{};
            bd[i] = vec_t{};
        }
    }
}

// The row sums' scratch (two values a warp of each row of the block), declared before write_partials' arrays so that
// it comes first in shared memory: the layout the planner's register estimates were fitted to.
__shared__ C row_scratch[2 * RPB * NW];

__device__ __forceinline__ void one_sweep(const T* dy, const T* x, const C* gamma, const C* mean, const C* rstd,
                                          T* dx, C* pg, C* pb, long long R, int want_params, const T* res,
                                          const C* bias) {
    C* const sh = row_scratch;
    const int tid = threadIdx.x % TPR, grp = threadIdx.x / TPR;
    const long long stride = (long long)gridDim.x * RPB;
    extern __shared__ __align__(16) unsigned char cols_bytes[];
    C* const cg = (C*)cols_bytes;   // SUMS 2: the column sums of dy xhat, then (cb) of dy
    C* const cb = cg + L;
    C ag[SUMS == 1 ? ITEMS * VW : 1], ab[SUMS == 1 ? ITEMS * VW : 1];   // SUMS 1: the same in registers
    if constexpr (SUMS == 2) {
        zero_cols(cg, cb, tid, LV);
    } else if constexpr (SUMS == 1) {
        #pragma unroll
        for (int k = 0; k < ITEMS * VW; ++k) { ag[k] = 0; ab[k] = 0; }
    }
    C gh[HOLD ? ITEMS * VW : 1], bh[HOLD && FUSED ? ITEMS * VW : 1];
    if constexpr (HOLD) {
        hold_cols(gamma, tid, LV, gh);
        if constexpr (FUSED) hold_cols(bias, tid, LV, bh);
    }
    VT bx[ITEMS], bd[ITEMS];
    C bmu, brs;
    long long row = (long long)blockIdx.x * RPB + grp;
    fetch(x, dy, mean, rstd, row, R, tid, bx, bd, bmu, brs);
    for (long long base = blockIdx.x; base * RPB < R; base += gridDim.x, row += stride) {
        const bool valid = row < R;
        const C mu = bmu, rs = brs;
        C xh[ITEMS * VW];
        VT dv[ITEMS];
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            const T* e = (const T*)&bx[i];
            #pragma unroll
            for (int u = 0; u < VW; ++u) xh[i * VW + u] = LOAD(e[u]);
            if constexpr (FUSED) {
                if (valid && j < LV) {
                    if (res) {
                        VT q = ((const VT*)(res + row * (long long)L))[j];
                        const T* f = (const T*)&q;
                        #pragma unroll
                        for (int u = 0; u < VW; ++u) xh[i * VW + u] += LOAD(f[u]);
                    }
                    if (bias) {
                        C c[VW];
                        cols_of(bias, bh, i, j, c);
                        #pragma unroll
                        for (int u = 0; u < VW; ++u) xh[i * VW + u] += c[u];
                    }
                }
            }
            #pragma unroll
            for (int u = 0; u < VW; ++u) xh[i * VW + u] = (xh[i * VW + u] - mu) * rs;
            dv[i] = bd[i];
        }
        if constexpr (PREFETCH) fetch(x, dy, mean, rstd, row + stride, R, tid, bx, bd, bmu, brs);
        C s1 = 0, s2 = 0;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (j < LV) {
                const T* e = (const T*)&dv[i];
                C gm[VW];
                if (gamma) cols_of(gamma, gh, i, j, gm);
                C th[VW], td[VW];
                #pragma unroll
                for (int u = 0; u < VW; ++u) {
                    const C d = LOAD(e[u]), h = xh[i * VW + u], g = gamma ? d * gm[u] : d;
                    s1 += g;
                    s2 += g * h;
                    if constexpr (SUMS == 2) {
                        th[u] = d * h;
                        td[u] = d;
                    } else if constexpr (SUMS == 1) {
                        ag[i * VW + u] += d * h;
                        ab[i * VW + u] += d;
                    }
                }
                if constexpr (SUMS == 2) {
                    add_cols(cg, j, th);
                    add_cols(cb, j, td);
                }
            }
        }
        row_sum2(s1, s2, sh);
        const C m1 = s1 / (C)L, m2 = s2 / (C)L;
        if (valid) {
            #pragma unroll
            for (int i = 0; i < ITEMS; ++i) {
                const int j = i * TPR + tid;
                if (j < LV) {
                    const T* e = (const T*)&dv[i];
                    C gm[VW];
                    if (gamma) cols_of(gamma, gh, i, j, gm);
                    VT w;
                    T* o = (T*)&w;
                    #pragma unroll
                    for (int u = 0; u < VW; ++u) {
                        const C d = LOAD(e[u]), g = gamma ? d * gm[u] : d;
                        o[u] = STORE(rs * (g - m1 - xh[i * VW + u] * m2));
                    }
                    ((VT*)(dx + row * (long long)L))[j] = w;
                }
            }
        }
        if constexpr (!PREFETCH) fetch(x, dy, mean, rstd, row + stride, R, tid, bx, bd, bmu, brs);
    }
    if constexpr (SUMS == 2) {
        if (want_params)   // each thread its own columns: the block's partial row blockIdx.x
            write_cols(cg, cb, pg + (long long)blockIdx.x * L, pb + (long long)blockIdx.x * L, tid, LV);
    } else if constexpr (SUMS == 1) {
        if (want_params) write_partials(ag, ab, pg, pb, tid, grp);
    }
}

#define BACKWARD_ARGS const T* dy, const T* x, const C* gamma, const C* mean, const C* rstd, T* dx, C* pg, C* pb, \
                      long long R, int want_params, const T* res, const C* bias
#define BACKWARD_CALL one_sweep(dy, x, gamma, mean, rstd, dx, pg, pb, R, want_params, res, bias)

#if SUMS == 1
extern "C" __global__ void ROW_BOUNDS ln_bwd1(BACKWARD_ARGS) { BACKWARD_CALL; }
#elif SUMS == 2 && HOLD
extern "C" __global__ void ROW_BOUNDS ln_bwds(BACKWARD_ARGS) { BACKWARD_CALL; }
#elif SUMS == 2
extern "C" __global__ void ROW_BOUNDS ln_bwdr(BACKWARD_ARGS) { BACKWARD_CALL; }
#else
extern "C" __global__ void ROW_BOUNDS ln_dx1(BACKWARD_ARGS) { BACKWARD_CALL; }
#endif
