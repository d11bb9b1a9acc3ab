// The last level of layer norm's dgamma and dbeta, ln_params: the P partial rows (one a block of ln_bwd1, ln_bwd,
// ln_bwds, ln_bwdr; one a cluster of ln_bwdc; one a chunk of rows of ln_cols) added per column in a fixed order.
// A block of 32 columns x PL row lanes, each lane summing every PL-th partial row from its own, then lane 0 the
// PL lanes' sums in order. Defines: FX_DTYPE (halfs.cuh) and L, the row length.
#include "halfs.cuh"

#define PL 16
extern "C" __global__ void __launch_bounds__(32 * PL) ln_params(const C* pg, const C* pb, long long P, C* dgamma,
                                                                C* dbeta) {
    __shared__ C s1[PL][33], s2[PL][33];
    const int cx = threadIdx.x % 32, ry = threadIdx.x / 32;
    const long long col = (long long)blockIdx.x * 32 + cx;
    C a = 0, b = 0;
    if (col < L) {
        #pragma unroll 4
        for (long long p = ry; p < P; p += PL) { a += pg[p * L + col]; b += pb[p * L + col]; }
    }
    s1[ry][cx] = a;
    s2[ry][cx] = b;
    __syncthreads();
    if (ry == 0 && col < L) {
        C ta = 0, tb = 0;
        for (int k = 0; k < PL; ++k) { ta += s1[k][cx]; tb += s2[k][cx]; }
        dgamma[col] = ta;
        dbeta[col] = tb;
    }
}

// The split backward's column sums (the first level of dgamma, dbeta), apart from dx, ln_cols (defines besides:
// KVW values a vector of type KVT, 16 bytes where L allows; CW warps a block; FUSED): block (bx, by) owns the 32
// vectors of columns from 32 bx (a warp's 16-byte loads side by side along the row) and the rows [by rc, by rc + rc).
// Warp w of the block sums its lane's columns of dy * xhat and dy over the rows by rc + w, + CW, + 2 CW, ... in that
// order (xhat recomputed from x [+ res + bias], mean and rstd); the CW warps' sums are added in shared memory in a
// fixed order (warp 0, 1, ...) and written as partial row by; ln_params adds the partial rows. The order of every
// sum depends on (R, L, rc) alone.
#if defined(KVW)
#define KLV (L / KVW)
extern "C" __global__ void __launch_bounds__(32 * CW) ln_cols(const T* dy, const T* x, const C* mean, const C* rstd,
                                                             C* pg, C* pb, long long R, long long rc, const T* res,
                                                             const C* bias) {
    __shared__ C sg[CW][32 * KVW + 1], sb[CW][32 * KVW + 1];
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int j = blockIdx.x * 32 + lane;                     // vector index in the row
    const long long r0 = (long long)blockIdx.y * rc;
    const long long r1 = r0 + rc < R ? r0 + rc : R;
    C ag[KVW], ab[KVW];
    #pragma unroll
    for (int u = 0; u < KVW; ++u) { ag[u] = 0; ab[u] = 0; }
    if (j < KLV) {
        C cb[KVW];
        if constexpr (FUSED) {
            #pragma unroll
            for (int u = 0; u < KVW; ++u) cb[u] = bias ? bias[j * KVW + u] : (C)0;
        }
        #pragma unroll 4
        for (long long r = r0 + w; r < r1; r += CW) {
            const C mu = mean[r], rs = rstd[r];
            const KVT a = ((const KVT*)(x + r * (long long)L))[j];
            const KVT b = ((const KVT*)(dy + r * (long long)L))[j];
            const T* ea = (const T*)&a;
            const T* eb = (const T*)&b;
            C v[KVW];
            #pragma unroll
            for (int u = 0; u < KVW; ++u) v[u] = LOAD(ea[u]);
            if constexpr (FUSED) {
                if (res) {
                    const KVT q = ((const KVT*)(res + r * (long long)L))[j];
                    const T* eq = (const T*)&q;
                    #pragma unroll
                    for (int u = 0; u < KVW; ++u) v[u] += LOAD(eq[u]);
                }
                #pragma unroll
                for (int u = 0; u < KVW; ++u) v[u] += cb[u];
            }
            #pragma unroll
            for (int u = 0; u < KVW; ++u) {
                const C d = LOAD(eb[u]);
                ag[u] += d * ((v[u] - mu) * rs);
                ab[u] += d;
            }
        }
    }
    #pragma unroll
    for (int u = 0; u < KVW; ++u) { sg[w][lane * KVW + u] = ag[u]; sb[w][lane * KVW + u] = ab[u]; }
    __syncthreads();
    for (int c = threadIdx.x; c < 32 * KVW; c += 32 * CW) {
        const long long col = (long long)blockIdx.x * 32 * KVW + c;
        if (col < L) {
            C ta = 0, tb = 0;
            for (int q = 0; q < CW; ++q) { ta += sg[q][c]; tb += sb[q][c]; }
            pg[(long long)blockIdx.y * L + col] = ta;
            pb[(long long)blockIdx.y * L + col] = tb;
        }
    }
}
#endif
