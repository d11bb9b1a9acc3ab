// fluxpy/kernels/cuda/cast_many.cu on the CPU (shim.h): emu_launch runs its kernel. The source comes from
// tests/kernel_on_cpu.py (halfs.cuh's float16 PTX as shim.h's _Float16 stand-ins).
#include "shim.h"
#include KERNEL_SOURCE
extern "C" int emu_launch(const char* name, int gx, int gy, int gz, int threads, void** a) {
    if (std::string(name) != "cast_many") return 1;
    run(cast_many, gx, gy, gz, threads, a);
    return 0;
}
