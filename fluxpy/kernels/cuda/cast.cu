// A dense array converted between float32 and the halves (fluxpy/kernels/cuda_halves.py): eight items a thread,
// read and written as whole vectors (16 bytes of halves, 32 of float32), a grid-stride loop; the last n % 8 items
// one a thread. SRC_DTYPE and DST_DTYPE: halfs.cuh's codes (1 float16, 2 bfloat16, 3 float32).
#include "cast.cuh"

struct __align__(8 * sizeof(ST)) SrcVec { ST v[8]; };
struct __align__(8 * sizeof(DT)) DstVec { DT v[8]; };

extern "C" __global__ void cast_vec8(const ST* __restrict__ x, DT* __restrict__ y, long long n) {
    const long long groups = n >> 3;
    const long long step = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long g = first; g < groups; g += step) {
        const SrcVec in = ((const SrcVec*)x)[g];
        DstVec out;
        _Pragma("unroll") for (int u = 0; u < 8; ++u) out.v[u] = DSTORE(SLOAD(in.v[u]));
        ((DstVec*)y)[g] = out;
    }
    for (long long i = (groups << 3) + first; i < n; i += step) y[i] = DSTORE(SLOAD(x[i]));
}
