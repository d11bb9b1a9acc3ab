// Layer norm forward, ln_fwd: y = (x - mean) * rstd * gamma + beta over rows of L values, one row a group of TPR
// threads, each holding its ITEMS vectors of the row in registers: x is read once, the mean and then the variance
// summed from the registers (two exact passes), y written once. Defines besides layernorm.cuh's:
//   PREFETCH  the grid visits the rows grid-stride, each block loading its next row into registers before this
//             row's sums (the barriers of a row's sums would leave the SM's loads idle between rows)
//   STAGES    (RPB 1) the same with the next rows staged in shared memory instead, a ring of STAGES slots
//   BLOCKS    the blocks an SM is to hold at once, so that ptxas keeps the registers to that share
#include "layernorm.cuh"

__device__ __forceinline__ void load_row(const T* p, const T* res, const C* bias, long long row, bool valid, int tid,
                                         C* v) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;   // vector index in the row
        if (valid && j < LV) {
            load_vec(p, res, bias, row, j, v + i * VW);
        } else {
            #pragma unroll
            for (int u = 0; u < VW; ++u) v[i * VW + u] = 0;
        }
    }
}

// The prefetching forward's loads: the raw vectors this thread holds of row `row` of x (and of the residual,
// fused), zeros past the rows or the row; unpack_x converts them once the previous row is written.
__device__ __forceinline__ void fetch_x(const T* x, const T* res, long long row, long long R, int tid, VT* bx,
                                        VT* br) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        const bool in = row < R && j < LV;
        bx[i] = in ? ((const VT*)(x + row * (long long)L))[j] : vec_t{};
        if constexpr (FUSED) br[i] = in && res ? ((const VT*)(res + row * (long long)L))[j] : vec_t{};
    }
}

// The row values those raw vectors hold, in the compute type: x [+ residual + bias] (as load_row gives them).
__device__ __forceinline__ void unpack_x(const VT* bx, const VT* br, const C* bias, int tid, C* v) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const T* e = (const T*)&bx[i];
        #pragma unroll
        for (int u = 0; u < VW; ++u) v[i * VW + u] = LOAD(e[u]);
        if constexpr (FUSED) {
            const T* f = (const T*)&br[i];
            #pragma unroll
            for (int u = 0; u < VW; ++u) v[i * VW + u] += LOAD(f[u]);
            const int j = i * TPR + tid;
            if (bias && j < LV) {
                #pragma unroll
                for (int u = 0; u < VW; ++u) v[i * VW + u] += bias[j * VW + u];
            }
        }
    }
}

// Stage this thread's vectors of row `row` of x (and of the residual, fused) into slots sx, sr; zeros past the rows.
__device__ __forceinline__ void stage_row(const T* x, const T* res, long long row, long long R, int tid, VT* sx,
                                          VT* sr) {
    const bool valid = row < R;
    const long long r = valid ? row : 0;   // a copy of no bytes reads nothing, but keep its address in bounds
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < LV) {
            copy_async(sx + j, (const VT*)(x + r * (long long)L) + j, valid);
            if constexpr (FUSED) {
                if (res) copy_async(sr + j, (const VT*)(res + r * (long long)L) + j, valid);
            }
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// The raw vectors this thread holds of the row staged STAGES - 1 commits ago (zeros past the row), once it landed.
__device__ __forceinline__ void unstage(const VT* sx, const VT* sr, int tid, VT* bx, VT* br) {
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES > 0 ? STAGES - 1 : 0) : "memory");
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        bx[i] = j < LV ? sx[j] : vec_t{};
        if constexpr (FUSED) br[i] = j < LV ? sr[j] : vec_t{};
    }
}

// y of one row from its values v (every thread of the block calls it): the mean, then the variance from the
// registers, gamma and beta read as vectors (a scalar load a value cost the halves a quarter of their bandwidth).
__device__ __forceinline__ void normalise_row(const C* v, const C* gamma, const C* beta, T* y, C* mean_out,
                                              C* rstd_out, long long row, long long R, double eps, int tid, C* sh) {
    C s = 0;
    #pragma unroll
    for (int k = 0; k < ITEMS * VW; ++k) s += v[k];
    const C mu = row_sum(s, sh) / (C)L;
    C q = 0;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const bool in = (i * TPR + tid) < LV;
        #pragma unroll
        for (int u = 0; u < VW; ++u) { const C d = in ? v[i * VW + u] - mu : (C)0; q += d * d; }
    }
    const C rs = (C)1 / sqrt(row_sum(q, sh) / (C)L + (C)eps);
    if (row >= R) return;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < LV) {
            C g[VW], b[VW];
            if (gamma) load_cvec(gamma, j, g); else for (int u = 0; u < VW; ++u) g[u] = 1;
            if (beta) load_cvec(beta, j, b); else for (int u = 0; u < VW; ++u) b[u] = 0;
            VT w;
            T* e = (T*)&w;
            #pragma unroll
            for (int u = 0; u < VW; ++u) e[u] = STORE((v[i * VW + u] - mu) * rs * g[u] + b[u]);
            ((VT*)(y + row * (long long)L))[j] = w;
        }
    }
    if (tid == 0) { mean_out[row] = mu; rstd_out[row] = rs; }
}

// One row a group of TPR threads: a row a group per block (the plain form), or, prefetching or staging, the rows
// grid-stride, the same trip count block-wide.
extern "C" __global__ void __launch_bounds__(TPR * RPB, BLOCKS) ln_fwd(const T* x, const C* gamma, const C* beta,
                                                                        T* y, C* mean_out, C* rstd_out, long long R,
                                                                        double eps, const T* res, const C* bias) {
    __shared__ C sh[RPB * NW];
    const int tid = threadIdx.x % TPR, grp = threadIdx.x / TPR;
    C v[ITEMS * VW];
    if constexpr (PREFETCH) {
        VT bx[ITEMS], br[FUSED ? ITEMS : 1];
        fetch_x(x, res, (long long)blockIdx.x * RPB + grp, R, tid, bx, br);
        for (long long base = blockIdx.x; base * RPB < R; base += gridDim.x) {
            const long long row = base * RPB + grp;
            unpack_x(bx, br, bias, tid, v);
            fetch_x(x, res, row + (long long)gridDim.x * RPB, R, tid, bx, br);
            normalise_row(v, gamma, beta, y, mean_out, rstd_out, row, R, eps, tid, sh);
        }
    } else if constexpr (STAGES > 0) {   // RPB is 1
        extern __shared__ __align__(16) unsigned char stage_bytes[];
        VT* const sx = (VT*)stage_bytes;       // STAGES slots of a row
        VT* const sr = sx + STAGES * LV;       // and of the residual's row (fused)
        for (int k = 0; k < STAGES; ++k)
            stage_row(x, res, blockIdx.x + (long long)k * gridDim.x, R, tid, sx + k * LV, sr + k * LV);
        int slot = 0;
        for (long long row = blockIdx.x; row < R; row += gridDim.x) {
            VT bx[ITEMS], br[FUSED ? ITEMS : 1];
            unstage(sx + slot * LV, sr + slot * LV, tid, bx, br);
            unpack_x(bx, br, bias, tid, v);
            stage_row(x, res, row + (long long)STAGES * gridDim.x, R, tid, sx + slot * LV, sr + slot * LV);
            slot = slot + 1 == STAGES ? 0 : slot + 1;
            normalise_row(v, gamma, beta, y, mean_out, rstd_out, row, R, eps, tid, sh);
        }
        asm volatile("cp.async.wait_all;" ::: "memory");   // the last (empty) copies land before the block's memory goes
    } else {
        const long long row = (long long)blockIdx.x * RPB + grp;
        load_row(x, res, bias, row, row < R, tid, v);
        normalise_row(v, gamma, beta, y, mean_out, rstd_out, row, R, eps, tid, sh);
    }
}
