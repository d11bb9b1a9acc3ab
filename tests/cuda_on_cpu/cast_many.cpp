// fluxpy/kernels/cuda/cast_many.cu on the CPU (shim.h): emu_launch runs its kernel. halfs.cuh's two PTX conversions
// between float16 and float32 are replaced by the test (tests/test_cast_many_cpu_run.py) with the calls below, the
// host compiler's _Float16 (IEEE, round to nearest even); bfloat16 runs halfs.cuh's own bit form (no __CUDA_ARCH__).
#include "shim.h"   // __float_as_uint and __uint_as_float too
inline float fx_cpu_f16_to_f32(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
inline unsigned short fx_cpu_f32_to_f16(float f) {
    const _Float16 v = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}
#include CAST_SOURCE
extern "C" int emu_launch(const char* name, int gx, int gy, int gz, int threads, void** a) {
    if (std::string(name) != "cast_many") return 1;
    run(cast_many, gx, gy, gz, threads, a);
    return 0;
}
