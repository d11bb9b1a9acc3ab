// The deterministic mapreducedim kernels, segments_vV and columns_vV for each vector width V (fluxpy/kernels/reduce.py).
// Defines: FX_DTYPE (halfs.cuh: T, C, LOAD, STORE), ACC (float or double), OP_MAX, OP_MEAN, HAS_Y, HAS_OUTM
// (0 or 1), MAP(x, y) (the map applied to each element, in ACC), THREADS (threads per block), MIN_BLOCKS (the
// blocks an SM must hold: the plan's one wave; without that bound ptxas aims at full occupancy and spills).
#include "halfs.cuh"
#define T_STORE T
#define UNROLL 4   // independent vector loads in flight per thread: enough to cover the memory's latency

__device__ __forceinline__ ACC to_acc(T_STORE v) { return (ACC)LOAD(v); }
__device__ __forceinline__ T_STORE from_acc(ACC a) { return STORE((C)a); }

#if OP_MAX
#define IDENT ((ACC)__int_as_float(0xff800000))
/* NaN-propagating max: a NaN in either operand wins. */
__device__ __forceinline__ ACC combine(ACC a, ACC b) { return (a > b || a != a) ? a : b; }
#else
#define IDENT ((ACC)0)
__device__ __forceinline__ ACC combine(ACC a, ACC b) { return a + b; }
#endif

__device__ __forceinline__ ACC finalize(ACC a, long long count) {
#if OP_MEAN
    return a / (ACC)count;
#else
    return a;
#endif
}

__device__ __forceinline__ ACC mapped(T_STORE xv, T_STORE yv) {
    ACC x = to_acc(xv);
#if HAS_Y
    ACC y = to_acc(yv);
#else
    ACC y = x;
#endif
    (void)y;
    return (ACC)MAP(x, y);
}

__device__ __forceinline__ long long lmin(long long a, long long b) { return a < b ? a : b; }

template <int V> struct alignas(sizeof(T_STORE) * V) Vec { T_STORE v[V]; };

/* Vector load (plain: streaming or read-only loads gave nothing more). */
template <int V>
__device__ __forceinline__ Vec<V> loadv(const Vec<V>* p) { return *p; }

/* Combine a value over the G threads of a group (G a power of two, 1..256); the result is valid in
   the group's first thread. Called by every thread of the block. Fixed tree: deterministic. */
__device__ __forceinline__ ACC group_reduce(ACC a, int G, ACC* sm) {
    int tid = threadIdx.x;
    int w = G < 32 ? G : 32;
    for (int off = w >> 1; off > 0; off >>= 1) a = combine(a, __shfl_down_sync(0xffffffffu, a, off, w));
    if (G > 32) {
        __syncthreads();
        if ((tid & 31) == 0) sm[tid >> 5] = a;
        __syncthreads();
        if ((tid & (G - 1)) == 0) {
            int w0 = tid >> 5;
            a = sm[w0];
            for (int i = 1; i < (G >> 5); ++i) a = combine(a, sm[w0 + i]);
        }
    }
    return a;
}

/* (R_outer, K, R_inner) with R_inner > 1. Group of G threads per kept index k; blockIdx.y = split s of
   the P = R_outer * I4 vector items of k into chunks of `chunk` items. I4 = R_inner / V. */
template <int V>
__device__ __forceinline__ void segments(const T_STORE* __restrict__ x, const T_STORE* __restrict__ y,
        T_STORE* __restrict__ out, T_STORE* __restrict__ outm, ACC* partials, unsigned int* counters,
        long long K, long long I4, long long KI4, long long P, long long chunk, int S, int G, long long count) {
    typedef Vec<V> VT;
    __shared__ ACC sm[THREADS / 32];
    __shared__ int amlast;
    const int tid = threadIdx.x;
    const int g = tid & (G - 1);
    const long long k = (long long)blockIdx.x * (THREADS / G) + tid / G;
    const bool active = k < K;
    const int s = blockIdx.y;
    ACC acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = IDENT;
    if (active) {
        long long j0 = (long long)s * chunk + g;
        long long j1 = lmin((long long)s * chunk + chunk, P);
        if (j0 < j1) {
            long long n = (j1 - j0 + G - 1) / G;
            long long o = j0 / I4, v = j0 - o * I4;
            const long long dq = G / I4, dr = G - dq * I4;
            const VT* xb = (const VT*)x + k * I4;
            const VT* yb = (const VT*)y + k * I4;
            VT* mb = (VT*)outm + k * I4;
            (void)mb;
            long long t = 0;
            for (; t + UNROLL <= n; t += UNROLL) {
                long long off[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    off[u] = o * KI4 + v;
                    v += dr; o += dq;
                    if (v >= I4) { v -= I4; ++o; }
                }
                VT a[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) a[u] = loadv<V>(xb + off[u]);
#if HAS_Y
                VT b[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) b[u] = loadv<V>(yb + off[u]);
#else
                VT* b = a;
#endif
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    VT m;
#pragma unroll
                    for (int e = 0; e < V; ++e) {
                        ACC mv = mapped(a[u].v[e], b[u].v[e]);
                        m.v[e] = from_acc(mv);
                        acc[e] = combine(acc[e], mv);
                    }
#if HAS_OUTM
                    mb[off[u]] = m;
#endif
                }
            }
            for (; t < n; ++t) {
                long long off = o * KI4 + v;
                v += dr; o += dq;
                if (v >= I4) { v -= I4; ++o; }
                VT a = loadv<V>(xb + off);
#if HAS_Y
                VT b = loadv<V>(yb + off);
#else
                VT b = a;
#endif
                VT m;
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    ACC mv = mapped(a.v[e], b.v[e]);
                    m.v[e] = from_acc(mv);
                    acc[e] = combine(acc[e], mv);
                }
#if HAS_OUTM
                mb[off] = m;
#endif
            }
        }
    }
    ACC r = acc[0];
#pragma unroll
    for (int e = 1; e < V; ++e) r = combine(r, acc[e]);
    r = group_reduce(r, G, sm);
    if (S == 1) {
        if (g == 0 && active) out[k] = from_acc(finalize(r, count));
        return;
    }
    if (g == 0 && active) { partials[k * S + s] = r; __threadfence(); }
    __syncthreads();
    if (tid == 0) amlast = (atomicAdd(&counters[blockIdx.x], 1u) == (unsigned int)(S - 1));
    __syncthreads();
    if (!amlast) return;
    __threadfence();
    r = IDENT;
    if (active) {
        const volatile ACC* p = partials + k * S;
        for (int i = g; i < S; i += G) r = combine(r, p[i]);
    }
    r = group_reduce(r, G, sm);
    if (g == 0 && active) out[k] = from_acc(finalize(r, count));
    if (tid == 0) counters[blockIdx.x] = 0u;
}

/* (R_outer, K) column reduction (R_inner == 1). Block = TX x TY threads, TX*V columns per block,
   blockIdx.y = split s of the rows into chunks of R rows. KV = K / V. */
template <int V>
__device__ __forceinline__ void columns(const T_STORE* __restrict__ x, const T_STORE* __restrict__ y,
        T_STORE* __restrict__ out, T_STORE* __restrict__ outm, ACC* partials, unsigned int* counters,
        long long O, long long K, long long R, int S, int TX, long long count) {
    typedef Vec<V> VT;
    __shared__ ACC sm[THREADS * V];
    __shared__ int amlast;
    const int tid = threadIdx.x;
    const int TY = THREADS / TX;
    const int tx = tid & (TX - 1), ty = tid / TX;
    const long long KV = K / V;
    const long long cv = (long long)blockIdx.x * TX + tx;
    const bool active = cv < KV;
    const int s = blockIdx.y;
    ACC acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = IDENT;
    if (active) {
        const VT* xv = (const VT*)x + cv;
        const VT* yv = (const VT*)y + cv;
        VT* mv_ = (VT*)outm + cv;
        (void)mv_;
        long long r = (long long)s * R + ty;
        const long long r1 = lmin((long long)s * R + R, O);
        for (; r + (UNROLL - 1) * TY < r1; r += UNROLL * TY) {
            VT a[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) a[u] = loadv<V>(xv + (r + u * TY) * KV);
#if HAS_Y
            VT b[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) b[u] = loadv<V>(yv + (r + u * TY) * KV);
#else
            VT* b = a;
#endif
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                VT m;
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    ACC mv = mapped(a[u].v[e], b[u].v[e]);
                    m.v[e] = from_acc(mv);
                    acc[e] = combine(acc[e], mv);
                }
#if HAS_OUTM
                mv_[(r + u * TY) * KV] = m;
#endif
            }
        }
        for (; r < r1; r += TY) {
            VT a = loadv<V>(xv + r * KV);
#if HAS_Y
            VT b = loadv<V>(yv + r * KV);
#else
            VT b = a;
#endif
            VT m;
#pragma unroll
            for (int e = 0; e < V; ++e) {
                ACC mv = mapped(a.v[e], b.v[e]);
                m.v[e] = from_acc(mv);
                acc[e] = combine(acc[e], mv);
            }
#if HAS_OUTM
            mv_[r * KV] = m;
#endif
        }
    }
    const int W = TX * V;   /* columns of this block */
    for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
        for (int e = 0; e < V; ++e) sm[ty * W + tx * V + e] = acc[e];
        __syncthreads();
        for (int st = TY >> 1; st > 0; st >>= 1) {
            if (ty < st) {
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    int i = ty * W + tx * V + e;
                    sm[i] = combine(sm[i], sm[i + st * W]);
                }
            }
            __syncthreads();
        }
        if (pass == 1 || S == 1) {
            if (ty == 0 && active) {
#pragma unroll
                for (int e = 0; e < V; ++e) out[cv * V + e] = from_acc(finalize(sm[tx * V + e], count));
            }
            if (pass == 1 && tid == 0) counters[blockIdx.x] = 0u;
            return;
        }
        if (ty == 0 && active) {
#pragma unroll
            for (int e = 0; e < V; ++e) partials[(long long)s * K + cv * V + e] = sm[tx * V + e];
            __threadfence();
        }
        __syncthreads();
        if (tid == 0) amlast = (atomicAdd(&counters[blockIdx.x], 1u) == (unsigned int)(S - 1));
        __syncthreads();
        if (!amlast) return;
        __threadfence();
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = IDENT;
        if (active) {
            const volatile ACC* p = partials + cv * V;
            for (int i = ty; i < S; i += TY) {
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] = combine(acc[e], p[(long long)i * K + e]);
            }
        }
    }
}

#define INSTANCE(V) \
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) segments_v##V( \
        const T_STORE* x, const T_STORE* y, T_STORE* out, T_STORE* outm, ACC* partials, unsigned int* counters, \
        long long K, long long I4, long long KI4, long long P, long long chunk, int S, int G, long long count) { \
    segments<V>(x, y, out, outm, partials, counters, K, I4, KI4, P, chunk, S, G, count); } \
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) columns_v##V( \
        const T_STORE* x, const T_STORE* y, T_STORE* out, T_STORE* outm, ACC* partials, unsigned int* counters, \
        long long O, long long K, long long R, int S, int TX, long long count) { \
    columns<V>(x, y, out, outm, partials, counters, O, K, R, S, TX, count); }

// the vector widths of 16 bytes or less for the element size (reduce._vec_widths)
INSTANCE(1)
INSTANCE(2)
#if FX_DTYPE != 4
INSTANCE(4)
#endif
#if FX_DTYPE == 1 || FX_DTYPE == 2
INSTANCE(8)
#endif
