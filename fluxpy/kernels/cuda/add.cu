// The sum of two dense arrays of one half type and one layout (fluxpy/kernels/cuda_halves.py): eight items a
// thread, read and written as 16-byte vectors, added in float32 and rounded once (the exact sum rounded to
// nearest even, as CuPy's item-at-a-time kernel gives); the last n % 8 items one a thread.
#include "halfs.cuh"

struct __align__(16) Vec8 { T v[8]; };

extern "C" __global__ void add_vec8(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y,
                                    long long n) {
    const long long groups = n >> 3;
    const long long step = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long g = first; g < groups; g += step) {
        const Vec8 va = ((const Vec8*)a)[g], vb = ((const Vec8*)b)[g];
        Vec8 out;
        _Pragma("unroll") for (int u = 0; u < 8; ++u) out.v[u] = STORE(LOAD(va.v[u]) + LOAD(vb.v[u]));
        ((Vec8*)y)[g] = out;
    }
    for (long long i = (groups << 3) + first; i < n; i += step) y[i] = STORE(LOAD(a[i]) + LOAD(b[i]));
}
