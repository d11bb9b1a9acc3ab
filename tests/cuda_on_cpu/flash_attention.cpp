// fluxpy/kernels/cuda/flash_attention.cu on the CPU (shim.h): emu_launch runs one of its kernels by name.
#include "shim.h"
#include KERNEL_SOURCE
extern "C" int emu_launch(const char* name, int gx, int gy, int gz, int threads, void** a) {
    const std::string n(name);
    if (n == "flash_forward") run(flash_forward, gx, gy, gz, threads, a);
    else if (n == "flash_row_dot") run(flash_row_dot, gx, gy, gz, threads, a);
    else if (n == "flash_backward_kv") run(flash_backward_kv, gx, gy, gz, threads, a);
    else if (n == "flash_backward_q") run(flash_backward_q, gx, gy, gz, threads, a);
    else if (n == "flash_backward_kvq") run(flash_backward_kvq, gx, gy, gz, threads, a);
    else return 1;
    return 0;
}
