// Philox4x32-10 uniform draws from a counter kept on the device (fluxpy/kernels/philox.py). FX_REAL: float or
// double (a -D name of its own: a -D T would rename the template parameters of NVRTC's built-in header).
// The helpers (philox.cuh) compile for the host too (tests/test_philox.py checks them against NumPy).
#define T FX_REAL
#define PER (sizeof(T) == 4 ? 4 : 2)

#include "philox.cuh"

extern "C" __global__ void fluxpy_philox_uniform(T* out, const long long n, const unsigned long long* offset,
                                                  const unsigned int k0, const unsigned int k1) {
  const unsigned long long base = *offset;
  const long long counters = (n + PER - 1) / PER;
  for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < counters;
       j += (long long)gridDim.x * blockDim.x) {
    unsigned int w[4];
    counter_words(base + (unsigned long long)j, k0, k1, w);
    for (int q = 0; q < PER; ++q) {
      const long long i = j * PER + q;
      if (i < n) out[i] = to_uniform(w, q, (T)0);
    }
  }
}

extern "C" __global__ void fluxpy_philox_advance(unsigned long long* offset, const unsigned long long by) {
  *offset += by;   // after the draw has read it (the same stream), so that the next draw continues from here
}
