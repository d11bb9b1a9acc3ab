// Inverted dropout in one pass (fluxpy/kernels/philox.py, PhiloxGenerator.dropout): y = x * m and, where `mask` is
// given, the mask m itself, m = (u >= p ? scale : 0) in x's dtype, u the generator's uniform numbers from its
// position on the device, the same ones its `random` draws (float32 numbers for the halves and float32, float64
// ones for float64), item i of x's memory taking number i. So the values equal the composite
// `x * ((u >= p) * scale)` item for item: the mask rounded to x's dtype first, the product computed in the compute
// type and rounded once. The position is advanced by a second launch after this one (philox.cu's advance).
#include "halfs.cuh"
#include "philox.cuh"

#if FX_DTYPE == 4
#define R double
#define PER 2
#else
#define R float
#define PER 4
#endif

extern "C" __global__ void fluxpy_dropout(const T* __restrict__ x, T* __restrict__ y, T* __restrict__ mask,
                                          const long long n, const unsigned long long* offset, const unsigned int k0,
                                          const unsigned int k1, const R p, const R scale) {
  const unsigned long long base = *offset;
  const long long counters = (n + PER - 1) / PER;
  for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < counters;
       j += (long long)gridDim.x * blockDim.x) {
    unsigned int w[4];
    counter_words(base + (unsigned long long)j, k0, k1, w);
#pragma unroll
    for (int q = 0; q < PER; ++q) {
      const long long i = j * PER + q;
      if (i < n) {
        const T m = STORE(to_uniform(w, q, (R)0) >= p ? scale : (R)0);
        y[i] = STORE(LOAD(x[i]) * LOAD(m));
        if (mask) mask[i] = m;
      }
    }
  }
}
