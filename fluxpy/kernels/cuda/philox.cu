// Philox4x32-10 uniform draws from a counter kept on the device (fluxpy/kernels/philox.py). FX_REAL: float or
// double (a -D name of its own: a -D T would rename the template parameters of NVRTC's built-in header).
// The helpers above the kernels compile for the host too (tests/test_philox.py checks them against NumPy).
#define T FX_REAL
#define PER (sizeof(T) == 4 ? 4 : 2)

__host__ __device__ __forceinline__ unsigned int mulhi32(unsigned int a, unsigned int b) {
#ifdef __CUDA_ARCH__
  return __umulhi(a, b);
#else
  return (unsigned int)(((unsigned long long)a * b) >> 32);   // the same function on the host (for tests)
#endif
}

__host__ __device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
  for (int r = 0; r < 10; ++r) {
    const unsigned int hi0 = mulhi32(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const unsigned int hi1 = mulhi32(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    k.x += 0x9E3779B9u;
    k.y += 0xBB67AE85u;
  }
  return c;
}

__host__ __device__ __forceinline__ float to_uniform(const unsigned int* w, int q, float) {
  return (float)(w[q] >> 8) * 5.9604644775390625e-08f;   // 2^-24
}

__host__ __device__ __forceinline__ double to_uniform(const unsigned int* w, int q, double) {
  const unsigned long long a = w[2 * q] >> 5, b = w[2 * q + 1] >> 6;
  return (double)(a * 67108864ULL + b) * (1.0 / 9007199254740992.0);   // 2^-53
}

extern "C" __global__ void fluxpy_philox_uniform(T* out, const long long n, const unsigned long long* offset,
                                                  const unsigned int k0, const unsigned int k1) {
  const unsigned long long base = *offset;
  const long long counters = (n + PER - 1) / PER;
  for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < counters;
       j += (long long)gridDim.x * blockDim.x) {
    const unsigned long long c = base + (unsigned long long)j;
    const uint4 r = philox4x32_10(make_uint4((unsigned int)c, (unsigned int)(c >> 32), 0u, 0u), make_uint2(k0, k1));
    const unsigned int w[4] = {r.x, r.y, r.z, r.w};
    for (int q = 0; q < PER; ++q) {
      const long long i = j * PER + q;
      if (i < n) out[i] = to_uniform(w, q, (T)0);
    }
  }
}

extern "C" __global__ void fluxpy_philox_advance(unsigned long long* offset, const unsigned long long by) {
  *offset += by;   // after the draw has read it (the same stream), so that the next draw continues from here
}
