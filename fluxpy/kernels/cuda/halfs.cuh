// Half-precision storage for fluxpy's CUDA kernels: float16 and bfloat16 held as unsigned short, computed in
// float32, converted without cuda_fp16.h / cuda_bf16.h (NVRTC, as CuPy runs it, need not find them).
//
// With FX_DTYPE defined (halfs.dtype_defines in Python: 1 float16, 2 bfloat16, 3 float32, 4 float64) it also
// defines the names a kernel is written against: T (storage), C (compute), LOAD(v) (a T as a C) and STORE(v)
// (a C rounded to a T, to nearest even, a NaN staying a NaN).

__device__ __forceinline__ float fx_load_f16(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short fx_store_f16(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float fx_load_bf16(unsigned short h) {
  return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short fx_store_bf16(float f) {
#if __CUDA_ARCH__ >= 800   // one instruction (round to nearest even, a NaN a NaN), much faster than the bit form
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);   // a NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                                   // round to nearest even
  return (unsigned short)(u >> 16);
#endif
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
