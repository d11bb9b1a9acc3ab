// The classifier loss of (N, C) logits, a warp per row: logit_crossentropy_rows forward and backward
// (fluxpy/kernels/cuda_softmax.py). T, C, LOAD, STORE: halfs.cuh, selected by FX_DTYPE.
#include "halfs.cuh"
#define ACC C
__device__ ACC warp_max(ACC v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}
__device__ ACC warp_sum(ACC v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
// Per row: m = max(a), s = sum(exp(a - m)), ty = sum(t), tya = sum(t * a). The whole warp shares a row.
__device__ void row_stats(const T* a, const T* t, long long c, int lane, ACC* m, ACC* s, ACC* ty, ACC* tya) {
    ACC mx = LOAD(a[lane < c ? lane : 0]);
    for (long long j = lane; j < c; j += 32) mx = max(mx, LOAD(a[j]));
    mx = warp_max(mx);
    ACC se = 0, sy = 0, sya = 0;
    for (long long j = lane; j < c; j += 32) {
        ACC v = LOAD(a[j]), w = LOAD(t[j]);
        se += exp(v - mx); sy += w;
        if (w != 0) sya += w * v;   // a class with no target mass adds nothing, even a masked (-inf) logit
    }
    *m = mx; *s = warp_sum(se); *ty = warp_sum(sy); *tya = warp_sum(sya);
}
extern "C" __global__ void ce_rows_forward(const T* yhat, const T* y, T* out, long long n, long long c) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    ACC m, s, ty, tya;
    row_stats(yhat + row * c, y + row * c, c, lane, &m, &s, &ty, &tya);
    if (lane == 0) out[row] = STORE((log(s) + m) * ty - tya);
}
// dl may be a broadcast view (the pullback of a mean): its stride in elements is dl_stride, often 0.
extern "C" __global__ void ce_rows_backward(const T* dl, long long dl_stride, const T* yhat, const T* y, T* dx,
                                            long long n, long long c) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const T* a = yhat + row * c;
    const T* t = y + row * c;
    ACC m, s, ty, tya;
    row_stats(a, t, c, lane, &m, &s, &ty, &tya);
    ACC lse = log(s) + m, g = LOAD(dl[row * dl_stride]);
    for (long long j = lane; j < c; j += 32) dx[row * c + j] = STORE(g * (exp(LOAD(a[j]) - lse) * ty - LOAD(t[j])));
}
