// fluxpy/kernels/cuda/pool.cu on the CPU (shim.h; the source from tests/kernel_on_cpu.py): emu_launch runs the
// kernel named, its arguments `a` (`sizes`: the bytes of each of `n`) checked against the kernel's parameters; 2
// where they do not fit, 1 where no kernel has the name.
#include "shim.h"
#include KERNEL_SOURCE
template <typename K>
int launch(K k, int gx, int bx, void** a, const int* sizes, int n) {
    if (!arguments_fit(k, sizes, n)) return 2;
    run(k, dim3{(unsigned)gx, 1, 1}, dim3{(unsigned)bx, 1, 1}, a);
    return 0;
}
extern "C" int emu_launch(const char* name, int gx, int bx, void** a, const int* sizes, int n) {
    const std::string k(name);
#if defined(VW)
    if (k == "maxpool_fwd_vec") return launch(maxpool_fwd_vec, gx, bx, a, sizes, n);
    if (k == "maxpool_bwd_tiles_vec") return launch(maxpool_bwd_tiles_vec, gx, bx, a, sizes, n);
#endif
    if (k == "maxpool_fwd") return launch(maxpool_fwd, gx, bx, a, sizes, n);
    if (k == "maxpool_bwd") return launch(maxpool_bwd, gx, bx, a, sizes, n);
    if (k == "maxpool_bwd_tiles") return launch(maxpool_bwd_tiles, gx, bx, a, sizes, n);
    if (k == "maxpool_gather") return launch(maxpool_gather, gx, bx, a, sizes, n);
    if (k == "meanpool_fwd") return launch(meanpool_fwd, gx, bx, a, sizes, n);
    if (k == "meanpool_bwd") return launch(meanpool_bwd, gx, bx, a, sizes, n);
    return 1;
}
