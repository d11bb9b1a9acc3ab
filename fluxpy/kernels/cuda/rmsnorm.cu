// RMS norm of rows of D values (C-contiguous data; the rows are the leading axes): y = x * rstd * gamma,
// rstd = 1 / sqrt(mean(x * x) + eps). T/C/LOAD/STORE: halfs.cuh (C, the compute type: float32 for the halves and
// float32, float64 for float64); gamma (D values of the compute type) or null (no affine); rstd per row.
//
// rms_forward: a block per row (grid-stride), the sum of squares by warp shuffles and then across the warps in a
//   fixed order, then y (the row read again, from the cache).
// rms_backward: a block per row, as the forward: dx = rstd * (g - xhat * mean(g * xhat)), g = dy * gamma; each block
//   keeps its rows' sums of dy * xhat per column (each column one thread's) and writes them to its row of
//   `partial`, where gamma is given.
// rms_gamma: a thread per column sums the blocks' partials in order (deterministic).
#include "halfs.cuh"
#include "block_sum.cuh"

constexpr int THREADS = 256;

extern "C" __global__ void __launch_bounds__(THREADS) rms_forward(const T* x, const C* gamma, T* y, C* rstd,
                                                                   long long rows, long long d, C eps) {
    __shared__ C shared[THREADS / 32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* px = x + r * d;
        C ss = 0;
        for (long long j = threadIdx.x; j < d; j += blockDim.x) {
            const C v = LOAD(px[j]);
            ss += v * v;
        }
        const C rs = (C)1 / sqrt(block_sum(ss, shared) / (C)d + eps);
        T* py = y + r * d;
        for (long long j = threadIdx.x; j < d; j += blockDim.x)
            py[j] = STORE(LOAD(px[j]) * rs * (gamma ? gamma[j] : (C)1));
        if (threadIdx.x == 0) rstd[r] = rs;
    }
}

// partial: gridDim.x rows of d sums of dy * xhat (where gamma is given; null otherwise). Each thread adds to the
// columns j = threadIdx.x + k * blockDim.x of its block's row, so no two threads share a sum.
extern "C" __global__ void __launch_bounds__(THREADS) rms_backward(const T* dy, const T* x, const C* gamma,
                                                                    const C* rstd, T* dx, C* partial,
                                                                    long long rows, long long d) {
    __shared__ C shared[THREADS / 32];
    C* mine = partial ? partial + blockIdx.x * d : nullptr;
    if (mine)
        for (long long j = threadIdx.x; j < d; j += blockDim.x) mine[j] = 0;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* px = x + r * d;
        const T* pdy = dy + r * d;
        const C rs = rstd[r];
        C s = 0;
        for (long long j = threadIdx.x; j < d; j += blockDim.x) {
            const C xhat = LOAD(px[j]) * rs, g = LOAD(pdy[j]) * (gamma ? gamma[j] : (C)1);
            s += g * xhat;
        }
        const C m = block_sum(s, shared) / (C)d;
        T* pdx = dx + r * d;
        for (long long j = threadIdx.x; j < d; j += blockDim.x) {
            const C xhat = LOAD(px[j]) * rs, dyv = LOAD(pdy[j]);
            pdx[j] = STORE(rs * (dyv * (gamma ? gamma[j] : (C)1) - xhat * m));
            if (mine) mine[j] += dyv * xhat;
        }
    }
}

extern "C" __global__ void rms_gamma(const C* partial, C* dgamma, long long blocks, long long d) {
    const long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= d) return;
    C s = 0;
    for (long long b = 0; b < blocks; ++b) s += partial[b * d + j];
    dgamma[j] = s;
}
