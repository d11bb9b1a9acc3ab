// scatter's sorted implementation: each source row's destination row (scatter_rows), the segments of the rows once
// sorted (scatter_segments), and one thread per destination element reducing its segment in order (scatter_sorted)
// (fluxpy/kernels/cuda_scatter.py). KEY: the rows' type, 32 bits where the problem allows.
#include "scatter_types.cuh"
#include "scatter_index.cuh"
#define KEY K_T
extern "C" __global__ void FX_BOUNDS scatter_rows(K_T K, IDX_PARAMS, KEY* __restrict__ rows,
                                                               long long R, volatile int* bad, int call) {
  // each source row's destination row, R (sorted past every segment) where an index is bad
  for (K_T k = blockIdx.x * (K_T)blockDim.x + threadIdx.x; k < K; k += (K_T)gridDim.x * blockDim.x) {
    long long r = fx_row(k, IDX_ARGS, bad, call);
    rows[k] = (KEY)(r < 0 ? R : r);
  }
}

extern "C" __global__ void FX_BOUNDS scatter_segments(const KEY* __restrict__ sorted_rows, K_T K,
                                                                   long long R, K_T* __restrict__ starts) {
  // starts[r] = the first sorted position whose row is >= r (a lower bound by binary search), r = 0..R
  for (long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x; r <= R; r += (long long)gridDim.x * blockDim.x) {
    K_T lo = 0, hi = K;
    while (lo < hi) {
      K_T mid = (lo + hi) >> 1;
      if ((long long)sorted_rows[mid] < r) lo = mid + 1; else hi = mid;
    }
    starts[r] = lo;
  }
}

extern "C" __global__ void FX_BOUNDS scatter_sorted(const T* __restrict__ src, T* __restrict__ dst,
    const long long* __restrict__ order, const K_T* __restrict__ starts, K_T R, K_T F) {
  FOR_ROWS(r, R) {
    const K_T begin = starts[r], end = starts[r + 1];
    T* out = dst + (long long)r * F;
    FOR_COLUMNS(c, F) {
      C acc = EMPTY;
      for (K_T p = begin; p < end; ++p) acc = COMBINE(acc, LOAD(src[order[p] * F + c]));
      out[c] = STORE(acc);
    }
  }
}
