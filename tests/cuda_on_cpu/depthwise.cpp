// fluxpy/kernels/cuda/depthwise.cu on the CPU (shim.h, and this folder's halfs.cuh): emu_launch runs the kernels
// its defines compile (depthwise.cu's header says which) by name.
#include "shim.h"
#include DEPTHWISE_SOURCE
extern "C" int emu_launch(const char* name, int gx, int gy, int gz, int bx, int by, void** a) {
    const std::string n(name);
    const dim3 grid{(unsigned)gx, (unsigned)gy, (unsigned)gz}, block{(unsigned)bx, (unsigned)by, 1};
#if !defined(WB)
    if (n == "dw_backward_data") return run(dw_backward_data, grid, block, a), 0;
#elif !defined(KHB)
    if (n == "dw_forward") return run(dw_forward, grid, block, a), 0;
#else
    if (n == "dw_backward_filter") return run(dw_backward_filter, grid, block, a), 0;
    if (n == "dw_filter_total") return run(dw_filter_total, grid, block, a), 0;
#endif
    return 1;
}
