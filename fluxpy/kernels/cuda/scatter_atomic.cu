// scatter's atomic implementation: one thread per source element, an atomic update each, into an accumulator of
// type A (FX_ACC: 32 or 64 bits, the atomics CUDA has) (fluxpy/kernels/cuda_scatter.py).
#include "scatter_types.cuh"
#include "scatter_index.cuh"
#define A FX_ACC
#define OP_ADD (FX_OP == 1)
#define OP_MAX (FX_OP == 2)
#if FX_OP == 1
#define ATOMIC_INT atomicAdd
#elif FX_OP == 2
#define ATOMIC_INT atomicMax
#else
#define ATOMIC_INT atomicMin
#endif
// A float max (min) in one integer atomic, no compare-and-swap loop: floats of sign 0 order as their bits read as
// signed integers, floats of sign 1 in reverse as unsigned ones, and every positive float's bits are below every
// negative one's as unsigned and above them as signed. A NaN wins (NumPy's), stored as the one NaN that no later
// update displaces: the largest signed integer for a max, the largest unsigned one for a min.
__device__ __forceinline__ void fx_update(float* a, float v) {
#if OP_ADD
  atomicAdd(a, v);
#elif OP_MAX
  if (v != v) atomicMax((int*)a, 0x7fffffff);
  else if (__float_as_int(v) >= 0) atomicMax((int*)a, __float_as_int(v));
  else atomicMin((unsigned int*)a, __float_as_uint(v));
#else
  if (v != v) atomicMax((unsigned int*)a, 0xffffffffu);
  else if (__float_as_int(v) >= 0) atomicMin((int*)a, __float_as_int(v));
  else atomicMax((unsigned int*)a, __float_as_uint(v));
#endif
}
__device__ __forceinline__ void fx_update(double* a, double v) {
  const long long bits = __double_as_longlong(v);
#if OP_ADD
  atomicAdd(a, v);
#elif OP_MAX
  if (v != v) atomicMax((long long*)a, 0x7fffffffffffffffLL);
  else if (bits >= 0) atomicMax((long long*)a, bits);
  else atomicMin((unsigned long long*)a, (unsigned long long)bits);
#else
  if (v != v) atomicMax((unsigned long long*)a, 0xffffffffffffffffULL);
  else if (bits >= 0) atomicMin((long long*)a, bits);
  else atomicMax((unsigned long long*)a, (unsigned long long)bits);
#endif
}
__device__ __forceinline__ void fx_update(int* a, long long v) { ATOMIC_INT(a, (int)v); }
__device__ __forceinline__ void fx_update(unsigned int* a, unsigned long long v) { ATOMIC_INT(a, (unsigned int)v); }
__device__ __forceinline__ void fx_update(long long* a, long long v) {
#if OP_ADD
  atomicAdd((unsigned long long*)a, (unsigned long long)v);
#else
  ATOMIC_INT(a, v);
#endif
}
__device__ __forceinline__ void fx_update(unsigned long long* a, unsigned long long v) { ATOMIC_INT(a, v); }

extern "C" __global__ void FX_BOUNDS scatter_atomic(
    const T* __restrict__ src, A* __restrict__ acc, K_T K, K_T F, IDX_PARAMS, volatile int* bad, int call) {
  FOR_ROW_GROUPS(k0, K) {
    GROUP_ROWS(r, k0, K)
    FOR_COLUMNS(c, F) {
      C v[FX_UNROLL];
      _Pragma("unroll") for (int j = 0; j < FX_UNROLL; ++j)
        v[j] = r[j] >= 0 ? LOAD(src[(long long)(k0 + j * blockDim.y) * F + c]) : (C)0;
      _Pragma("unroll") for (int j = 0; j < FX_UNROLL; ++j)
        if (r[j] >= 0) fx_update(acc + r[j] * F + c, v[j]);
    }
  }
}
