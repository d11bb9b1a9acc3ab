// Whether a list of arrays is all finite, in one launch per CAP arrays of a dtype (the divergence check of
// fluxpy.train and the guard of a checked captured step): *out becomes NaN where an entry is not finite.
#include "halfs.cuh"

struct Arrays { long long p[CAP]; long long n[CAP]; };

extern "C" __global__ void fx_nonfinite(const Arrays t, double* out) {
  const T* a = (const T*)t.p[blockIdx.y];
  const long long n = t.n[blockIdx.y];
  bool bad = false;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    bad |= !isfinite(LOAD(a[i]));
  if (__syncthreads_or(bad) && threadIdx.x == 0) *out = __longlong_as_double(0x7ff8000000000000LL);   // NaN
}
