// Float32 flash attention (the FlashAttention-2 algorithm in exact float32 FMAs, no tensor cores): the forward, the
// backward's row dot products D = rowsum(dy * y), dK with dV, and dQ; for a problem with one key block (lk <= 64)
// the whole backward in one launch (fluxpy/kernels/cuda_flash.py plans and launches them).
//
// q (N, Lq, heads * dqk), k (N, Lk, heads * dqk), v (N, Lk, heads * dv) and dy (N, Lq, heads * dv) are read in
// place: head h of row i of batch n starts at n * s_n + i * s_l + h * d (element strides), features contiguous.
// y, dq, dk, dv are written C-ordered in the same layouts; the log-sum-exp per query row, lse, and D are
// (N, heads, Lq). bias (null for none) is float32 broadcasting to (N, heads, Lq, Lk) by its four element strides
// (0 along a broadcast axis); a boolean mask arrives as such a bias (0 or -inf). causal: key j is seen by query i
// when j <= i (aligned at the top left). A query whose every key is masked gets y = NaN and lse = NaN; its masked
// logits pass no gradient (as the composite's where), so its NaN reaches dv only, as the composite's (all of dv of
// its batch and head; under causal only the keys of the blocks up to its diagonal, which the kernels visit).
//
// Tiles: BR = 64 queries by BC = 64 keys per step, 256 threads as a 16 x 16 grid (ty, tx); a thread owns the score
// micro-tile of rows ty + 16a and columns tx + 16b (a, b < 4), and of an output accumulator the rows ty + 16a and
// the columns col(tx, c). Tiles lie in shared memory row-major with padded rows (LDK, LDV: +4 floats keep the float4
// reads of 16 rows conflict-free; LDP = 80: the two rows a warp writes fall in different banks).
// DQK, DV: the head sizes padded to 32, 64 or 128 (the columns beyond the real ones are zeros).
#ifndef DQK
#define DQK 64
#endif
#ifndef DV
#define DV 64
#endif

constexpr int BR = 64, BC = 64, THREADS = 256;
constexpr int LDK = DQK + 4, LDV = DV + 4, LDP = BC + 16;
constexpr int CQ = DQK / 16, CV = DV / 16;   // accumulator columns per thread
// Blocks per SM the register allocation aims at (ptxas: up to 128 registers a thread for two), two only where no
// release of ptxas 13 spills (tests/test_kernel_sources.py checks; at the edge of 128 registers releases differ).
constexpr int FWD_BLOCKS = (DQK + DV <= 128 && DQK <= DV) || (DQK == 128 && DV == 128) ? 2 : 1;   // flash_forward
constexpr int Q_BLOCKS = DQK + DV <= 128 && DQK >= DV ? 2 : 1;     // flash_backward_q
constexpr int KV_BLOCKS = DQK + DV <= 128 ? 2 : 1;                 // flash_backward_kv
constexpr int KVQ_BLOCKS = DQK == DV && DQK <= 64 ? 2 : 1;            // flash_backward_kvq (dq's work too)

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float not_a_number() { return __int_as_float(0x7fffffff); }

// The column of accumulator entry c of thread tx, for a head of P padded columns (P / 16 per thread): pairs for
// P = 32, else runs of four 64 columns apart (each a float4 read of 16 threads side by side).
template <int P>
__device__ __forceinline__ int col(int tx, int c) {
    return P == 32 ? tx * 2 + c : (c / 4) * 64 + tx * 4 + c % 4;
}

template <int P>
__device__ __forceinline__ void load_cols(const float* row, int tx, float* x) {
    if (P == 32) {
        float2 t = *reinterpret_cast<const float2*>(row + tx * 2);
        x[0] = t.x; x[1] = t.y;
    } else {
#pragma unroll
        for (int c4 = 0; c4 < P / 64; c4++) {
            float4 t = *reinterpret_cast<const float4*>(row + c4 * 64 + tx * 4);
            x[c4 * 4] = t.x; x[c4 * 4 + 1] = t.y; x[c4 * 4 + 2] = t.z; x[c4 * 4 + 3] = t.w;
        }
    }
}

// Rows [0, rows) and columns [0, cols) of a head's matrix at src (row stride `stride` elements) into the 64 x P
// tile dst (row stride LD), zeros elsewhere. vec: float4 reads (cols, stride and src's alignment allow them).
template <int P, int LD>
__device__ void load_tile(float* dst, const float* src, long long stride, int rows, int cols, int vec) {
    if (vec) {
        constexpr int C4 = P / 4;
        for (int e = threadIdx.x; e < 64 * C4; e += THREADS) {
            int r = e / C4, c = (e % C4) * 4;
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (r < rows && c < cols) x = *reinterpret_cast<const float4*>(src + r * stride + c);
            *reinterpret_cast<float4*>(dst + r * LD + c) = x;
        }
    } else {
        for (int e = threadIdx.x; e < 64 * P; e += THREADS) {
            int r = e / P, c = e % P;
            dst[r * LD + c] = (r < rows && c < cols) ? src[r * stride + c] : 0.f;
        }
    }
}

// acc[a][b] = sum over k < K of A[(ty + 16a) * LDA + k] * B[(tx + 16b) * LDB + k], k in order.
template <int K, int LDA, int LDB>
__device__ __forceinline__ void tile_dot(const float* A, const float* B, float acc[4][4], int ty, int tx) {
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) acc[a][b] = 0.f;
#pragma unroll 8
    for (int k = 0; k < K; k += 4) {
        float4 x[4], y[4];
#pragma unroll
        for (int a = 0; a < 4; a++) x[a] = *reinterpret_cast<const float4*>(A + (ty + 16 * a) * LDA + k);
#pragma unroll
        for (int b = 0; b < 4; b++) y[b] = *reinterpret_cast<const float4*>(B + (tx + 16 * b) * LDB + k);
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) {
                acc[a][b] = fmaf(x[a].x, y[b].x, acc[a][b]);
                acc[a][b] = fmaf(x[a].y, y[b].y, acc[a][b]);
                acc[a][b] = fmaf(x[a].z, y[b].z, acc[a][b]);
                acc[a][b] = fmaf(x[a].w, y[b].w, acc[a][b]);
            }
    }
}

// acc[a][c] += sum over j < 64 of S[(ty + 16a) * LDP + j] * X[j * LDX + col(tx, c)], j in order.
template <int P, int LDX>
__device__ __forceinline__ void tile_mma(const float* S, const float* X, float acc[4][P / 16], int ty, int tx) {
#pragma unroll 2
    for (int j = 0; j < BC; j += 4) {
        float s[4][4];
#pragma unroll
        for (int a = 0; a < 4; a++) {
            float4 t = *reinterpret_cast<const float4*>(S + (ty + 16 * a) * LDP + j);
            s[a][0] = t.x; s[a][1] = t.y; s[a][2] = t.z; s[a][3] = t.w;
        }
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
            float x[P / 16];
            load_cols<P>(X + (j + jj) * LDX, tx, x);
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int c = 0; c < P / 16; c++) acc[a][c] = fmaf(s[a][jj], x[c], acc[a][c]);
        }
    }
}

__device__ __forceinline__ float row_max16(float x) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    return x;
}

__device__ __forceinline__ float row_sum16(float x) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}

// The scaled logit of query i and key j (the dot product `dot`) plus the bias, or -inf where the pair is masked:
// outside the problem (a tile's tail) or above the diagonal.
__device__ __forceinline__ float logit(float dot, int i, int j, int lq, int lk, int causal, float scale,
                                       const float* bias, long long bias_base, long long sbq, long long sbk) {
    if (i >= lq || j >= lk || (causal && j > i)) return neg_inf();
    float x = dot * scale;
    if (bias) x += bias[bias_base + i * sbq + j * sbk];
    return x;
}

// One block per (query block, head, batch): y and lse of BR queries, over the key blocks in order. The query blocks
// run last first (under a causal mask they have the most keys).
extern "C" __global__ void __launch_bounds__(THREADS, FWD_BLOCKS) flash_forward(
        const float* q, long long sqn, long long sql, const float* k, long long skn, long long skl,
        const float* v, long long svn, long long svl, const float* bias, long long sbn, long long sbh,
        long long sbq, long long sbk, float* y, float* lse, int lq, int lk, int heads, int dqk, int dv,
        float scale, int causal, int vec) {
    extern __shared__ float4 shared4[];
    // Ps may share Ks's memory when it fits: Ks is read for the scores before Ps is written (a barrier between)
    constexpr bool ALIAS = LDK >= LDP;
    float* Qs = reinterpret_cast<float*>(shared4);
    float* Ks = Qs + BR * LDK;
    float* Vs = Ks + BC * LDK;
    float* Ps = ALIAS ? Ks : Vs + BC * LDV;
    const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, n = blockIdx.z;
    const int q0 = qb * BR, tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const long long bias_base = n * sbn + h * sbh;
    load_tile<DQK, LDK>(Qs, q + n * sqn + q0 * sql + (long long)h * dqk, sql, min(BR, lq - q0), dqk, vec);
    float m[4], l[4], o[4][CV];
#pragma unroll
    for (int a = 0; a < 4; a++) {
        m[a] = neg_inf(); l[a] = 0.f;
#pragma unroll
        for (int c = 0; c < CV; c++) o[a][c] = 0.f;
    }
    const int kend = causal ? min(lk, q0 + BR) : lk;
    for (int k0 = 0; k0 < kend; k0 += BC) {
        const int rows = min(BC, lk - k0);
        load_tile<DQK, LDK>(Ks, k + n * skn + k0 * skl + (long long)h * dqk, skl, rows, dqk, vec);
        load_tile<DV, LDV>(Vs, v + n * svn + k0 * svl + (long long)h * dv, svl, rows, dv, vec);
        __syncthreads();
        float s[4][4];
        tile_dot<DQK, LDK, LDK>(Qs, Ks, s, ty, tx);
#pragma unroll
        for (int a = 0; a < 4; a++) {
            const int i = q0 + ty + 16 * a;
            float top = neg_inf();
#pragma unroll
            for (int b = 0; b < 4; b++) {
                s[a][b] = logit(s[a][b], i, k0 + tx + 16 * b, lq, lk, causal, scale, bias, bias_base, sbq, sbk);
                top = fmaxf(top, s[a][b]);
            }
            const float m_new = fmaxf(m[a], row_max16(top));
            const float ref = m_new == neg_inf() ? 0.f : m_new;   // all masked so far: exp(-inf - 0) = 0
            const float alpha = expf(m[a] - ref);
            float sum = 0.f;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                s[a][b] = expf(s[a][b] - ref);
                sum += s[a][b];
            }
            l[a] = l[a] * alpha + row_sum16(sum);
            m[a] = m_new;
#pragma unroll
            for (int c = 0; c < CV; c++) o[a][c] *= alpha;
        }
        if (ALIAS) __syncthreads();
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) Ps[(ty + 16 * a) * LDP + tx + 16 * b] = s[a][b];
        __syncthreads();
        tile_mma<DV, LDV>(Ps, Vs, o, ty, tx);
        __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < 4; a++) {
        const int i = q0 + ty + 16 * a;
        if (i >= lq) continue;
        float* yrow = y + ((long long)n * lq + i) * heads * dv + (long long)h * dv;
#pragma unroll
        for (int c = 0; c < CV; c++) {
            const int cc = col<DV>(tx, c);
            if (cc < dv) yrow[cc] = o[a][c] / l[a];   // no key: 0 / 0 = NaN
        }
        if (tx == 0) lse[((long long)n * heads + h) * lq + i] = l[a] == 0.f ? not_a_number() : m[a] + logf(l[a]);
    }
}

// delta[n, h, i] = sum over c < dv of dy[n, i, h * dv + c] * y[n, i, h * dv + c]: a warp per (n, i, h), rows in
// the order of y's memory. y is C-ordered, dy has the strides sdn, sdl.
extern "C" __global__ void flash_row_dot(const float* dy, long long sdn, long long sdl, const float* y, float* delta,
                                         long long rows, int lq, int heads, int dv) {
    const long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    const int h = (int)(r % heads);
    const long long ni = r / heads;
    const int i = (int)(ni % lq);
    const long long n = ni / lq;
    const float* g = dy + n * sdn + i * sdl + (long long)h * dv;
    const float* x = y + r * dv;
    float sum = 0.f;
    for (int c = lane; c < dv; c += 32) sum = fmaf(g[c], x[c], sum);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (lane == 0) delta[(n * heads + h) * lq + i] = sum;
}

// dS = P * (dP - D) with P = exp(logit - lse), dP the dot product of dy and v; a masked logit (-inf) passes none.
__device__ __forceinline__ float score_gradient(float x, float p, float dp, float d) {
    return x == neg_inf() ? 0.f : p * (dp - d);
}

// acc[a][c] = sum over j < 64 of St[j * LDP + ty + 16a] * X[j * LDX + col(tx, c)], j in order: tile_mma with the
// scores read transposed (St holds keys as rows), so dq = dS @ K from the dSt that the dk, dv kernel forms.
template <int P, int LDX>
__device__ __forceinline__ void tile_mma_t(const float* St, const float* X, float acc[4][P / 16], int ty, int tx) {
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int c = 0; c < P / 16; c++) acc[a][c] = 0.f;
#pragma unroll 4
    for (int j = 0; j < BC; j++) {
        float x[P / 16];
        load_cols<P>(X + j * LDX, tx, x);
#pragma unroll
        for (int a = 0; a < 4; a++) {
            const float s = St[j * LDP + ty + 16 * a];
#pragma unroll
            for (int c = 0; c < P / 16; c++) acc[a][c] = fmaf(s, x[c], acc[a][c]);
        }
    }
}

// dk and dv of BC keys (and, WITH_Q, the dq and D of every query: the one-launch backward of a problem with one key
// block, where this block is the only one to add to a query's dq), over the query blocks that see them, in order
// (no atomics: deterministic). The transposed scores (keys as rows) go through shared memory, Pt and dSt.
template <bool WITH_Q>
__device__ __forceinline__ void backward_kv(
        const float* q, long long sqn, long long sql, const float* k, long long skn, long long skl,
        const float* v, long long svn, long long svl, const float* bias, long long sbn, long long sbh,
        long long sbq, long long sbk, const float* dy, long long sdn, long long sdl, const float* lse,
        const float* delta, const float* y, float* dq, float* dk, float* dv_out, int lq, int lk, int heads, int dqk,
        int dv, float scale, int causal, int vec) {
    extern __shared__ float4 shared4[];
    float* Ks = reinterpret_cast<float*>(shared4);
    float* Vs = Ks + BC * LDK;
    float* Qs = Vs + BC * LDV;
    float* dYs = Qs + BR * LDK;
    float* Pt = dYs + BR * LDV;
    float* dSt = Pt + BC * LDP;
    float* Ls = dSt + BC * LDP;
    float* Ds = Ls + BR;
    const int h = blockIdx.y, n = blockIdx.z, k0 = blockIdx.x * BC;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const long long bias_base = n * sbn + h * sbh;
    const int keys = min(BC, lk - k0);
    load_tile<DQK, LDK>(Ks, k + n * skn + k0 * skl + (long long)h * dqk, skl, keys, dqk, vec);
    load_tile<DV, LDV>(Vs, v + n * svn + k0 * svl + (long long)h * dv, svl, keys, dv, vec);
    float gk[4][CQ], gv[4][CV];
#pragma unroll
    for (int a = 0; a < 4; a++) {
#pragma unroll
        for (int c = 0; c < CQ; c++) gk[a][c] = 0.f;
#pragma unroll
        for (int c = 0; c < CV; c++) gv[a][c] = 0.f;
    }
    const int qstart = causal ? (k0 / BR) * BR : 0;   // queries before k0 see no key of this block
    for (int q0 = qstart; q0 < lq; q0 += BR) {
        const int rows = min(BR, lq - q0);
        load_tile<DQK, LDK>(Qs, q + n * sqn + q0 * sql + (long long)h * dqk, sql, rows, dqk, vec);
        load_tile<DV, LDV>(dYs, dy + n * sdn + q0 * sdl + (long long)h * dv, sdl, rows, dv, vec);
        if (threadIdx.x < BR) {   // rows past the end: lse 0, so their -inf logits give P = 0
            const long long at = ((long long)n * heads + h) * lq + q0 + threadIdx.x;
            Ls[threadIdx.x] = (int)threadIdx.x < rows ? lse[at] : 0.f;
            if (!WITH_Q) Ds[threadIdx.x] = (int)threadIdx.x < rows ? delta[at] : 0.f;
        }
        __syncthreads();
        if (WITH_Q) {   // D of the block's rows from dYs and y, a warp a row in flash_row_dot's order
            const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
            for (int r = warp; r < BR; r += THREADS / 32) {
                float sum = 0.f;
                if (r < rows) {
                    const float* yrow = y + ((long long)n * lq + q0 + r) * heads * dv + (long long)h * dv;
                    for (int c = lane; c < dv; c += 32) sum = fmaf(dYs[r * LDV + c], yrow[c], sum);
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
                }
                if (lane == 0) Ds[r] = sum;
            }
            __syncthreads();
        }
        float st[4][4], dpt[4][4];
        tile_dot<DQK, LDK, LDK>(Ks, Qs, st, ty, tx);
        tile_dot<DV, LDV, LDV>(Vs, dYs, dpt, ty, tx);
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const int r = tx + 16 * b;
                const float x = logit(st[a][b], q0 + r, k0 + ty + 16 * a, lq, lk, causal, scale, bias, bias_base,
                                      sbq, sbk);
                const float p = expf(x - Ls[r]);
                Pt[(ty + 16 * a) * LDP + r] = p;
                dSt[(ty + 16 * a) * LDP + r] = score_gradient(x, p, dpt[a][b], Ds[r]);
            }
        __syncthreads();
        tile_mma<DV, LDV>(Pt, dYs, gv, ty, tx);
        tile_mma<DQK, LDK>(dSt, Qs, gk, ty, tx);
        if (WITH_Q) {
            float gq[4][CQ];
            tile_mma_t<DQK, LDK>(dSt, Ks, gq, ty, tx);
#pragma unroll
            for (int a = 0; a < 4; a++) {
                const int i = q0 + ty + 16 * a;
                if (i >= lq) continue;
                float* qrow = dq + ((long long)n * lq + i) * heads * dqk + (long long)h * dqk;
#pragma unroll
                for (int c = 0; c < CQ; c++) {
                    const int cc = col<DQK>(tx, c);
                    if (cc < dqk) qrow[cc] = gq[a][c] * scale;
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < 4; a++) {
        const int j = k0 + ty + 16 * a;
        if (j >= lk) continue;
        float* krow = dk + ((long long)n * lk + j) * heads * dqk + (long long)h * dqk;
        float* vrow = dv_out + ((long long)n * lk + j) * heads * dv + (long long)h * dv;
#pragma unroll
        for (int c = 0; c < CQ; c++) {
            const int cc = col<DQK>(tx, c);
            if (cc < dqk) krow[cc] = gk[a][c] * scale;
        }
#pragma unroll
        for (int c = 0; c < CV; c++) {
            const int cc = col<DV>(tx, c);
            if (cc < dv) vrow[cc] = gv[a][c];
        }
    }
}

// One block per (key block, head, batch): dk and dv of BC keys, D read from flash_row_dot's delta.
extern "C" __global__ void __launch_bounds__(THREADS, KV_BLOCKS) flash_backward_kv(
        const float* q, long long sqn, long long sql, const float* k, long long skn, long long skl,
        const float* v, long long svn, long long svl, const float* bias, long long sbn, long long sbh,
        long long sbq, long long sbk, const float* dy, long long sdn, long long sdl, const float* lse,
        const float* delta, float* dk, float* dv_out, int lq, int lk, int heads, int dqk, int dv, float scale,
        int causal, int vec) {
    backward_kv<false>(q, sqn, sql, k, skn, skl, v, svn, svl, bias, sbn, sbh, sbq, sbk, dy, sdn, sdl, lse, delta,
                       nullptr, nullptr, dk, dv_out, lq, lk, heads, dqk, dv, scale, causal, vec);
}

// The whole backward of a problem with one key block (lk <= BC) in one launch, a block per (head, batch): D, dq, dk
// and dv, the same numbers as flash_row_dot, flash_backward_kv and flash_backward_q give (the same sums in the same
// order).
extern "C" __global__ void __launch_bounds__(THREADS, KVQ_BLOCKS) flash_backward_kvq(
        const float* q, long long sqn, long long sql, const float* k, long long skn, long long skl,
        const float* v, long long svn, long long svl, const float* bias, long long sbn, long long sbh,
        long long sbq, long long sbk, const float* dy, long long sdn, long long sdl, const float* lse,
        const float* y, float* dq, float* dk, float* dv_out, int lq, int lk, int heads, int dqk, int dv, float scale,
        int causal, int vec) {
    backward_kv<true>(q, sqn, sql, k, skn, skl, v, svn, svl, bias, sbn, sbh, sbq, sbk, dy, sdn, sdl, lse, nullptr,
                      y, dq, dk, dv_out, lq, lk, heads, dqk, dv, scale, causal, vec);
}

// One block per (query block, head, batch): dq of BR queries, over the key blocks they see, in order.
extern "C" __global__ void __launch_bounds__(THREADS, Q_BLOCKS) flash_backward_q(
        const float* q, long long sqn, long long sql, const float* k, long long skn, long long skl,
        const float* v, long long svn, long long svl, const float* bias, long long sbn, long long sbh,
        long long sbq, long long sbk, const float* dy, long long sdn, long long sdl, const float* lse,
        const float* delta, float* dq, int lq, int lk, int heads, int dqk, int dv, float scale, int causal,
        int vec) {
    extern __shared__ float4 shared4[];
    float* Qs = reinterpret_cast<float*>(shared4);
    float* dYs = Qs + BR * LDK;
    float* Ks = dYs + BR * LDV;
    float* Vs = Ks + BC * LDK;
    float* dS = Vs + BC * LDV;
    const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, n = blockIdx.z;
    const int q0 = qb * BR, tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const long long bias_base = n * sbn + h * sbh;
    const int rows = min(BR, lq - q0);
    load_tile<DQK, LDK>(Qs, q + n * sqn + q0 * sql + (long long)h * dqk, sql, rows, dqk, vec);
    load_tile<DV, LDV>(dYs, dy + n * sdn + q0 * sdl + (long long)h * dv, sdl, rows, dv, vec);
    float lr[4], dr[4], gq[4][CQ];
#pragma unroll
    for (int a = 0; a < 4; a++) {
        const int r = ty + 16 * a;
        const long long at = ((long long)n * heads + h) * lq + q0 + r;
        lr[a] = r < rows ? lse[at] : 0.f;
        dr[a] = r < rows ? delta[at] : 0.f;
#pragma unroll
        for (int c = 0; c < CQ; c++) gq[a][c] = 0.f;
    }
    const int kend = causal ? min(lk, q0 + BR) : lk;
    for (int k0 = 0; k0 < kend; k0 += BC) {
        const int keys = min(BC, lk - k0);
        load_tile<DQK, LDK>(Ks, k + n * skn + k0 * skl + (long long)h * dqk, skl, keys, dqk, vec);
        load_tile<DV, LDV>(Vs, v + n * svn + k0 * svl + (long long)h * dv, svl, keys, dv, vec);
        __syncthreads();
        float s[4][4], dp[4][4];
        tile_dot<DQK, LDK, LDK>(Qs, Ks, s, ty, tx);
        tile_dot<DV, LDV, LDV>(dYs, Vs, dp, ty, tx);
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const float x = logit(s[a][b], q0 + ty + 16 * a, k0 + tx + 16 * b, lq, lk, causal, scale, bias,
                                      bias_base, sbq, sbk);
                dS[(ty + 16 * a) * LDP + tx + 16 * b] = score_gradient(x, expf(x - lr[a]), dp[a][b], dr[a]);
            }
        __syncthreads();
        tile_mma<DQK, LDK>(dS, Ks, gq, ty, tx);
        __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < 4; a++) {
        const int i = q0 + ty + 16 * a;
        if (i >= lq) continue;
        float* qrow = dq + ((long long)n * lq + i) * heads * dqk + (long long)h * dqk;
#pragma unroll
        for (int c = 0; c < CQ; c++) {
            const int cc = col<DQK>(tx, c);
            if (cc < dqk) qrow[cc] = gq[a][c] * scale;
        }
    }
}
