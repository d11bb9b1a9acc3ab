// What every layer-norm kernel shares: a row's vectors, its sums over the threads that hold it, the column sums'
// vectors, and cp.async copies. The defines (passed as -D options by fluxpy/kernels/cuda_layernorm.py):
//   FX_DTYPE        the storage type (halfs.cuh: T, C, LOAD, STORE)
//   L               the row length; VW values a vector of type VT (CVT: VW compute values as one vector, if any)
//   TPR, RPB, ITEMS threads a row, rows a block, vectors a thread
//   FUSED           the x + residual + bias form is compiled in (kept out of the plain kernels: its branches cost
//                   the plain forward's loads their overlap)
#include "halfs.cuh"

#define LV (L / VW)                          // vectors a row
#define NW (TPR / 32 > 0 ? TPR / 32 : 1)     // warps a row
typedef VT vec_t;   // VT may be two words ("unsigned int")

// The sum of a over the TPR threads of this thread's row, in a fixed order (every thread of the block calls it).
__device__ __forceinline__ C row_sum(C a, C* sh) {
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffff, a, o);
    if constexpr (TPR > 32) {
        const int grp = threadIdx.x / TPR, warp = (threadIdx.x % TPR) / 32;
        __syncthreads();
        if ((threadIdx.x & 31) == 0) sh[grp * NW + warp] = a;
        __syncthreads();
        a = 0;
        for (int w = 0; w < NW; ++w) a += sh[grp * NW + w];
    }
    return a;
}

// The barrier of the TPR threads of row group grp: a named barrier a group (ids 1 to RPB; 0 is __syncthreads'), so
// that a row's warps wait for each other and not for the block's other rows; the block's barrier where RPB is 1 or
// past the 15 ids there are.
__device__ __forceinline__ void row_barrier(int grp) {
    if constexpr (RPB > 1 && RPB < 16) {
        asm volatile("bar.sync %0, %1;" :: "r"(grp + 1), "r"(TPR) : "memory");
    } else {
        __syncthreads();
    }
}

// The sums of a and of b over the TPR threads of this thread's row, in a fixed order, with one pair of barriers of
// the row's threads (every thread of the block calls it).
__device__ __forceinline__ void row_sum2(C& a, C& b, C* sh) {
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffff, a, o);
        b += __shfl_xor_sync(0xffffffff, b, o);
    }
    if constexpr (TPR > 32) {
        const int grp = threadIdx.x / TPR, warp = (threadIdx.x % TPR) / 32;
        row_barrier(grp);
        if ((threadIdx.x & 31) == 0) { sh[2 * (grp * NW + warp)] = a; sh[2 * (grp * NW + warp) + 1] = b; }
        row_barrier(grp);
        a = 0;
        b = 0;
        for (int w = 0; w < NW; ++w) { a += sh[2 * (grp * NW + w)]; b += sh[2 * (grp * NW + w) + 1]; }
    }
}

// Vector j of a row of p, plus the same of res and bias where given (the fused x + residual + bias).
__device__ __forceinline__ void load_vec(const T* p, const T* res, const C* bias, long long row, int j, C* v) {
    VT w = ((const VT*)(p + row * (long long)L))[j];
    const T* e = (const T*)&w;
    #pragma unroll
    for (int u = 0; u < VW; ++u) v[u] = LOAD(e[u]);
    if constexpr (FUSED) {
        if (res) {
            VT q = ((const VT*)(res + row * (long long)L))[j];
            const T* f = (const T*)&q;
            #pragma unroll
            for (int u = 0; u < VW; ++u) v[u] += LOAD(f[u]);
        }
        if (bias) {
            #pragma unroll
            for (int u = 0; u < VW; ++u) v[u] += bias[j * VW + u];
        }
    }
}

// VW compute values (gamma, bias, column sums) of vector j, as one load where VW allows (CVT).
__device__ __forceinline__ void load_cvec(const C* p, int j, C* v) {
#ifdef CVT
    CVT w = ((const CVT*)p)[j];
    const C* e = (const C*)&w;
    #pragma unroll
    for (int u = 0; u < VW; ++u) v[u] = e[u];
#else
    #pragma unroll
    for (int u = 0; u < VW; ++u) v[u] = p[j * VW + u];
#endif
}

// The same, stored.
__device__ __forceinline__ void store_cvec(C* p, int j, const C* v) {
#ifdef CVT
    CVT w;
    C* e = (C*)&w;
    #pragma unroll
    for (int u = 0; u < VW; ++u) e[u] = v[u];
    ((CVT*)p)[j] = w;
#else
    #pragma unroll
    for (int u = 0; u < VW; ++u) p[j * VW + u] = v[u];
#endif
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (unsigned)a;
}

// A staged copy (the forward's staged rows, ln_bwdc's next row): each thread copies its own vectors of a row into
// shared memory with cp.async (sm_80 and later), holding no registers while they fly, and later reads back only
// what it copied itself, so no barrier orders them. A copy of no bytes (in false) fills its slot with zeros.
__device__ __forceinline__ void copy_async(VT* dst, const VT* src, bool in) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" :: "r"(shared_address(dst)), "l"(src),
                 "n"((int)sizeof(VT)), "r"(in ? (int)sizeof(VT) : 0) : "memory");
}
