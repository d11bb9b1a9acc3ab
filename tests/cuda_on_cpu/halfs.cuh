// fluxpy/kernels/cuda/halfs.cuh for the CPU (tests/test_*_cpu_run.py find this copy first): the same names, the
// same conversions in plain C++ (float16 through GCC's _Float16, rounding to nearest even; bfloat16 by its bits as
// halfs.cuh does before sm_80), so that a kernel source that includes "halfs.cuh" compiles with g++ and shim.h.
#include <cstring>

inline float fx_load_f16(unsigned short h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
inline unsigned short fx_store_f16(float f) {
  const _Float16 v = (_Float16)f;
  unsigned short h;
  std::memcpy(&h, &v, 2);
  return h;
}
inline float fx_load_bf16(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
inline unsigned short fx_store_bf16(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);   // a NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                                   // round to nearest even
  return (unsigned short)(u >> 16);
}

#if defined(FX_DTYPE)
#if FX_DTYPE == 1
#define T unsigned short
#define C float
#define LOAD(v) fx_load_f16(v)
#define STORE(v) fx_store_f16(v)
#elif FX_DTYPE == 2
#define T unsigned short
#define C float
#define LOAD(v) fx_load_bf16(v)
#define STORE(v) fx_store_bf16(v)
#elif FX_DTYPE == 3
#define T float
#define C float
#define LOAD(v) ((C)(v))
#define STORE(v) ((T)(v))
#elif FX_DTYPE == 4
#define T double
#define C double
#define LOAD(v) ((C)(v))
#define STORE(v) ((T)(v))
#else
#error "FX_DTYPE must be 1 (float16), 2 (bfloat16), 3 (float32) or 4 (float64)"
#endif
#endif
