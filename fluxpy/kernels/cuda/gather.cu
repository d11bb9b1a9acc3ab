// gather: out[k, c] = src[row(k), c] in units U of FX_UNIT bytes, F of them a row (fluxpy/kernels/cuda_scatter.py).
#include "scatter_index.cuh"
#if FX_UNIT == 16
#define U uint4
#define ZERO make_uint4(0, 0, 0, 0)
#elif FX_UNIT == 8
#define U uint2
#define ZERO make_uint2(0, 0)
#elif FX_UNIT == 4
#define U unsigned int
#define ZERO 0u
#elif FX_UNIT == 2
#define U unsigned short
#define ZERO (unsigned short)0
#else
#define U unsigned char
#define ZERO (unsigned char)0
#endif
extern "C" __global__ void FX_BOUNDS gather_rows(const U* __restrict__ src, U* __restrict__ out,
    K_T K, K_T F, IDX_PARAMS, volatile int* bad, int call) {
  // out[k, c] = src[row(k), c] in units U of F per row; a bad index gives zeros
  FOR_ROW_GROUPS(k0, K) {
    GROUP_ROWS(r, k0, K)
    FOR_COLUMNS(c, F) {
      U v[FX_UNROLL];
      _Pragma("unroll") for (int j = 0; j < FX_UNROLL; ++j) v[j] = r[j] >= 0 ? src[r[j] * F + c] : ZERO;
      _Pragma("unroll") for (int j = 0; j < FX_UNROLL; ++j)
        if (r[j] != -2) out[(long long)(k0 + j * blockDim.y) * F + c] = v[j];
    }
  }
}
