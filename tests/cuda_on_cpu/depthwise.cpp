// fluxpy/kernels/cuda/depthwise.cu on the CPU (shim.h; the source from tests/kernel_on_cpu.py): emu_launch runs the kernels
// its defines compile (depthwise.cu's header says which) by name, its arguments `a` (`sizes`: the bytes of each of
// `n`) checked against the kernel's parameters; 2 where they do not fit, 1 where no kernel has the name.
#include "shim.h"
#include KERNEL_SOURCE
template <typename K>
int launch(K k, dim3 grid, dim3 block, void** a, const int* sizes, int n) {
    if (!arguments_fit(k, sizes, n)) return 2;
    run(k, grid, block, a);
    return 0;
}
extern "C" int emu_launch(const char* name, int gx, int gy, int gz, int bx, int by, void** a, const int* sizes,
                          int n) {
    const std::string k(name);
    const dim3 grid{(unsigned)gx, (unsigned)gy, (unsigned)gz}, block{(unsigned)bx, (unsigned)by, 1};
#if !defined(WB)
    if (k == "dw_backward_data") return launch(dw_backward_data, grid, block, a, sizes, n);
#elif !defined(KHB)
    if (k == "dw_forward") return launch(dw_forward, grid, block, a, sizes, n);
#else
    if (k == "dw_backward_filter") return launch(dw_backward_filter, grid, block, a, sizes, n);
    if (k == "dw_filter_total") return launch(dw_filter_total, grid, block, a, sizes, n);
#endif
    return 1;
}
