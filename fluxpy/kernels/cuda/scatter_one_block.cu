// scatter's one_block implementation: one block, its threads owning the columns (fluxpy/kernels/cuda_scatter.py).
#include "scatter_types.cuh"
#include "scatter_index.cuh"
extern "C" __global__ void FX_BOUNDS scatter_one_block(
    const T* __restrict__ src, T* __restrict__ dst, C* __restrict__ work, K_T K, K_T F, K_T R,
    IDX_PARAMS, volatile int* bad, int call) {
  // thread t owns columns t, t + blockDim.x, ...: it walks the source rows in order (deterministic, no atomics)
  for (K_T c = threadIdx.x; c < F; c += blockDim.x) {
    for (K_T r = 0; r < R; ++r) work[r * F + c] = EMPTY;
    for (K_T k = 0; k < K; ++k) {
      long long r = fx_row(k, IDX_ARGS, bad, call);
      if (r >= 0) work[r * F + c] = COMBINE(work[r * F + c], LOAD(src[(long long)k * F + c]));
    }
    for (K_T r = 0; r < R; ++r) dst[(long long)r * F + c] = STORE(work[(long long)r * F + c]);
  }
}
