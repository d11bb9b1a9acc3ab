// Layer norm backward of rows whose column sums or values do not fit one block, ln_bwdc (sm_90): a cluster of
// CLUSTER blocks takes a row, block `rank` its LC columns from rank * LC, holding its vectors of x and dy in
// registers and its columns' sums in shared memory (ln_bwds over its share; TPR, ITEMS are a block's, RPB 1, HOLD 1).
// The row sums are the blocks' partial sums exchanged through distributed shared memory: each block writes its
// pair, one cluster barrier, every block adds the CLUSTER pairs in rank order, so all get the same bits. The pairs
// alternate between two slots by row, so a block rewrites a slot only after the next barrier, once every peer has
// read it. Clusters visit the rows cluster-stride, and each thread stages its vectors of the cluster's next row
// (x, dy, and the residual fused) in shared memory with cp.async as soon as it has taken this row's, so the next
// row's loads fly while this row's sums, barriers and stores run. BLOCKS: the blocks an SM is to hold.
#include "layernorm_columns.cuh"

#define LC (L / CLUSTER)    // columns a block
#define LCV (LC / VW)       // vectors a block

__device__ __forceinline__ unsigned cluster_reg(int which) {
    unsigned r;
    if (which == 0) asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    else if (which == 1) asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    else asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ float peer_load(const float* p, unsigned rank) {
    unsigned a;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(shared_address(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}

// This thread's vectors of the block's share of row `row` of x, dy (and the residual), staged; zeros past the rows.
__device__ __forceinline__ void stage_share(const T* x, const T* dy, const T* res, long long row, long long R,
                                            long long off, int tid, VT* sx, VT* sd, VT* sr) {
    const bool valid = row < R;
    const long long base = (valid ? row : 0) * (long long)L + off;   // in bounds even for a copy of no bytes
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < LCV) {
            copy_async(sx + j, (const VT*)(x + base) + j, valid);
            copy_async(sd + j, (const VT*)(dy + base) + j, valid);
            if constexpr (FUSED) {
                if (res) copy_async(sr + j, (const VT*)(res + base) + j, valid);
            }
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(TPR, BLOCKS) ln_bwdc(
        const T* dy, const T* x, const C* gamma, const C* mean, const C* rstd, T* dx, C* pg, C* pb, long long R,
        int want_params, const T* res, const C* bias) {
    __shared__ C sh[2 * NW];
    __shared__ float pair[2][2];    // this block's (sum g, sum g xhat) of a row, by the row's parity
    extern __shared__ __align__(16) unsigned char cols_bytes[];
    C* const cg = (C*)cols_bytes;   // this block's columns' sums of dy xhat, then (cb) of dy
    C* const cb = cg + LC;
    VT* const sx = (VT*)(cb + LC);  // the next row's staged vectors of x, dy (and the residual)
    VT* const sd = sx + LCV;
    VT* const sr = sd + LCV;
    const int tid = threadIdx.x;
    const unsigned rank = cluster_reg(0);
    const long long off = (long long)rank * LC;   // this block's first column
    const long long stride = cluster_reg(2);
    const C* const gm_ = gamma ? gamma + off : nullptr;
    zero_cols(cg, cb, tid, LCV);
    C gh[ITEMS * VW], bh[FUSED ? ITEMS * VW : 1];
    hold_cols(gm_, tid, LCV, gh);
    if constexpr (FUSED) hold_cols(bias ? bias + off : nullptr, tid, LCV, bh);
    long long row = cluster_reg(1);
    stage_share(x, dy, res, row, R, off, tid, sx, sd, sr);
    C mu_next = row < R ? mean[row] : (C)0, rs_next = row < R ? rstd[row] : (C)0;
    int parity = 0;
    for (; row < R; row += stride, parity ^= 1) {
        const C mu = mu_next, rs = rs_next;
        const long long base = row * (long long)L + off;
        C xh[ITEMS * VW];
        VT dv[ITEMS];
        asm volatile("cp.async.wait_all;" ::: "memory");
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            const VT w = j < LCV ? sx[j] : vec_t{};
            dv[i] = j < LCV ? sd[j] : vec_t{};
            const T* e = (const T*)&w;
            #pragma unroll
            for (int u = 0; u < VW; ++u) xh[i * VW + u] = LOAD(e[u]);
            if constexpr (FUSED) {
                if (res && j < LCV) {
                    const VT q = sr[j];
                    const T* f = (const T*)&q;
                    #pragma unroll
                    for (int u = 0; u < VW; ++u) xh[i * VW + u] += LOAD(f[u]);
                }
            }
        }
        stage_share(x, dy, res, row + stride, R, off, tid, sx, sd, sr);   // this thread's slots are read: refill
        if (row + stride < R) { mu_next = mean[row + stride]; rs_next = rstd[row + stride]; }
        C s1 = 0, s2 = 0;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (j < LCV) {
                if constexpr (FUSED) {
                    if (bias) {
                        C c[VW];
                        cols_of(bias + off, bh, i, j, c);
                        #pragma unroll
                        for (int u = 0; u < VW; ++u) xh[i * VW + u] += c[u];
                    }
                }
                C gv[VW], th[VW], td[VW];
                if (gm_) cols_of(gm_, gh, i, j, gv);
                const T* ed = (const T*)&dv[i];
                #pragma unroll
                for (int u = 0; u < VW; ++u) {
                    const C h = (xh[i * VW + u] - mu) * rs, d = LOAD(ed[u]), g = gm_ ? d * gv[u] : d;
                    xh[i * VW + u] = h;
                    s1 += g;
                    s2 += g * h;
                    th[u] = d * h;
                    td[u] = d;
                }
                add_cols(cg, j, th);
                add_cols(cb, j, td);
            }
        }
        row_sum2(s1, s2, sh);
        if (tid == 0) { pair[parity][0] = s1; pair[parity][1] = s2; }
        cluster_barrier();
        s1 = 0;
        s2 = 0;
        for (unsigned q = 0; q < CLUSTER; ++q) {
            s1 += peer_load(&pair[parity][0], q);
            s2 += peer_load(&pair[parity][1], q);
        }
        const C m1 = s1 / (C)L, m2 = s2 / (C)L;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (j < LCV) {
                C gv[VW];
                if (gm_) cols_of(gm_, gh, i, j, gv);
                const T* ed = (const T*)&dv[i];
                VT w;
                T* o = (T*)&w;
                #pragma unroll
                for (int u = 0; u < VW; ++u) {
                    const C d = LOAD(ed[u]), g = gm_ ? d * gv[u] : d;
                    o[u] = STORE(rs * (g - m1 - xh[i * VW + u] * m2));
                }
                ((VT*)(dx + base))[j] = w;
            }
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");   // the last (empty) copies land before the block's memory goes
    if (want_params) {   // each thread its own columns: the cluster's partial row
        const long long prow = (long long)cluster_reg(1) * L + off;
        write_cols(cg, cb, pg + prow, pb + prow, tid, LCV);
    }
    cluster_barrier();   // no block leaves while a peer may still read its pairs
}
