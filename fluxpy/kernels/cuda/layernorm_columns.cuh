// The backward's column sums (of dy * xhat for dgamma, of dy for dbeta) and the copies of gamma and the bias a
// thread may hold. SUMS says where a kernel keeps its column sums: 0 none (dx alone; ln_cols sums them apart),
// 1 in registers (ln_bwd1, ln_bwd), 2 in shared memory (ln_bwds, ln_bwdr, ln_bwdc); HOLD: the thread holds its
// columns of gamma (and of the bias, fused) in registers, read once, rather than reading them twice a row (where
// the column sums take the shared memory, L1 keeps little).
#include "layernorm.cuh"

// The RPB groups of a block add their column sums (ag, ab) in a fixed order (group 0, 1, ...): the first RPB - 1 in
// shared memory, a round and a barrier each, the last adding its own as it writes the block's partial row blockIdx.x
// of pg, pb. A vector of VW columns is one access (scalar ones, VW apart, met in the same banks).
__device__ __forceinline__ void write_partials(const C* ag, const C* ab, C* pg, C* pb, int tid, int grp) {
    C* const rg = pg + (long long)blockIdx.x * L;
    C* const rb = pb + (long long)blockIdx.x * L;
    if constexpr (RPB > 1) {
        __shared__ __align__(16) C colg[L];
        __shared__ __align__(16) C colb[L];
        for (int q = 0; q < RPB; ++q) {
            if (grp == q) {
                #pragma unroll
                for (int i = 0; i < ITEMS; ++i) {
                    const int j = i * TPR + tid;
                    if (j < LV) {
                        C g[VW], b[VW];
                        if (q == 0) {
                            #pragma unroll
                            for (int u = 0; u < VW; ++u) { g[u] = 0; b[u] = 0; }
                        } else {
                            load_cvec(colg, j, g);
                            load_cvec(colb, j, b);
                        }
                        #pragma unroll
                        for (int u = 0; u < VW; ++u) { g[u] += ag[i * VW + u]; b[u] += ab[i * VW + u]; }
                        store_cvec(q + 1 < RPB ? colg : rg, j, g);
                        store_cvec(q + 1 < RPB ? colb : rb, j, b);
                    }
                }
            }
            if (q + 1 < RPB) __syncthreads();
        }
    } else {
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (j < LV) {
                store_cvec(rg, j, ag + i * VW);
                store_cvec(rb, j, ab + i * VW);
            }
        }
    }
}

// This thread's vectors j = i * TPR + tid below nv of p, held in h (zeros past the row or where p is null).
__device__ __forceinline__ void hold_cols(const C* p, int tid, int nv, C* h) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (p && j < nv) {
            load_cvec(p, j, h + i * VW);
        } else {
            #pragma unroll
            for (int u = 0; u < VW; ++u) h[i * VW + u] = 0;
        }
    }
}

// Vector j (this thread's i-th) of p: from the held copy h where HOLD, else read (p is not null).
__device__ __forceinline__ void cols_of(const C* p, const C* h, int i, int j, C* v) {
    if constexpr (HOLD) {
        #pragma unroll
        for (int u = 0; u < VW; ++u) v[u] = h[i * VW + u];
    } else {
        load_cvec(p, j, v);
    }
}

// Column sums in shared memory: each column belongs to one thread, so no barrier guards them; a vector of VW
// columns is one 16-byte access (scalar ones cost 4 wavefronts each).
__device__ __forceinline__ void add_cols(C* s, int j, const C* a) {
#ifdef CVT
    CVT w = ((CVT*)s)[j];
    C* e = (C*)&w;
    #pragma unroll
    for (int u = 0; u < VW; ++u) e[u] += a[u];
    ((CVT*)s)[j] = w;
#else
    #pragma unroll
    for (int u = 0; u < VW; ++u) s[j * VW + u] += a[u];
#endif
}

__device__ __forceinline__ void copy_cols(const C* s, C* p, int j) {
#ifdef CVT
    ((CVT*)p)[j] = ((const CVT*)s)[j];
#else
    #pragma unroll
    for (int u = 0; u < VW; ++u) p[j * VW + u] = s[j * VW + u];
#endif
}

// This thread's columns (vectors j = i * TPR + tid below nv) of the two column sums cg, cb: zeroed, or written as a
// partial row pg, pb (ln_bwds: the block's; ln_bwdc: the block's share of its cluster's).
__device__ __forceinline__ void zero_cols(C* cg, C* cb, int tid, int nv) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < nv) {
            #pragma unroll
            for (int u = 0; u < VW; ++u) { cg[j * VW + u] = 0; cb[j * VW + u] = 0; }
        }
    }
}

__device__ __forceinline__ void write_cols(const C* cg, const C* cb, C* pg, C* pb, int tid, int nv) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < nv) {
            copy_cols(cg, pg, j);
            copy_cols(cb, pb, j);
        }
    }
}
