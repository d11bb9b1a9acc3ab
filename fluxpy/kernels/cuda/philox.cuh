// Philox4x32-10 and its uniform values (fluxpy/kernels/philox.py): the generator's draws (philox.cu) and the
// kernels that draw their own numbers from its position (dropout.cu). Compiled for the host too (tests/test_philox.py
// checks them against NumPy).

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

// The four words of draw position (counter) c under the key (k0, k1), which to_uniform turns into numbers.
__host__ __device__ __forceinline__ void counter_words(unsigned long long c, unsigned int k0, unsigned int k1,
                                                       unsigned int* w) {
  const uint4 r = philox4x32_10(make_uint4((unsigned int)c, (unsigned int)(c >> 32), 0u, 0u), make_uint2(k0, k1));
  w[0] = r.x;
  w[1] = r.y;
  w[2] = r.z;
  w[3] = r.w;
}
