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

// Class-index targets (logit_crossentropy_labels, fluxpy/ops/crossentropy.py): row n's targets are
// y[j] = h * [j == t] + u * w[j], never stored. labels holds int32 (label_bytes 4) or int64 (8) indices; weight is
// null without class weights (w = 1); hard = 1 - a and uniform = a / C for the label smoothing a. A row whose label is
// ignore (when has_ignore) has no target (h = u = 0, t = -1); a label outside [0, c) makes its row NaN (no host check
// reads the labels) and reads no logit (t = -1).
__device__ void label_target(const void* labels, int label_bytes, long long row, long long c, const T* weight,
                             ACC hard, ACC uniform, long long ignore, int has_ignore, long long* t, ACC* h, ACC* u) {
    long long k = label_bytes == 8 ? ((const long long*)labels)[row] : (long long)((const int*)labels)[row];
    *t = -1; *h = 0; *u = 0;
    if (has_ignore && k == ignore) return;
    if (k < 0 || k >= c) { *h = *u = (ACC)nan(""); return; }
    *t = k; *h = hard * (weight ? LOAD(weight[k]) : (ACC)1); *u = uniform;
}
// A row read as 16-byte vectors (VT, VW items) where vec (its items a whole number of vectors, the rows aligned).
#if FX_DTYPE == 4
#define VT double2
#define VW 2
#elif FX_DTYPE == 3
#define VT float4
#define VW 4
#else
#define VT uint4
#define VW 8
#endif
// EACH(a, j, v, BODY): BODY for every item v = LOAD(a[j]) of the row this lane reads (lane, lane + 32, ... in
// items, or in whole vectors with vec).
#define EACH(a, j, v, BODY)                                                                                     \
    if (vec) {                                                                                                  \
        for (long long jv = lane; jv < c / VW; jv += 32) {                                                     \
            const VT q_ = ((const VT*)(a))[jv];                                                                 \
            const T* p_ = (const T*)&q_;                                                                        \
            _Pragma("unroll") for (int u_ = 0; u_ < VW; ++u_) { const long long j = jv * VW + u_;              \
                                                                const ACC v = LOAD(p_[u_]); BODY } }            \
    } else {                                                                                                    \
        for (long long j = lane; j < c; j += 32) { const ACC v = LOAD((a)[j]); BODY }                          \
    }
// Per row: m = max(a), s = sum(exp(a - m)); with smoothing (spread) also sw = sum(w) and swa = sum(w * a). The whole
// warp shares a row, so spread is the same on every lane.
__device__ void label_row_stats(const T* a, const T* weight, long long c, int lane, bool spread, int vec, ACC* m,
                                ACC* s, ACC* sw, ACC* swa) {
    ACC mx = LOAD(a[lane < c ? lane : 0]);
    EACH(a, j, v, mx = max(mx, v);)
    mx = warp_max(mx);
    ACC se = 0, sumw = 0, sumwa = 0;
    EACH(a, j, v, {
        se += exp(v - mx);
        if (spread) {
            ACC w = weight ? LOAD(weight[j]) : (ACC)1;
            sumw += w;
            if (w != 0) sumwa += w * v;   // a class of weight 0 adds nothing, even a masked (-inf) logit
        }
    })
    *m = mx; *s = warp_sum(se); *sw = warp_sum(sumw); *swa = warp_sum(sumwa);
}
// l = h * (lse - a[t]) + u * (sum(w) * lse - sum(w * a)): a term with no target mass adds nothing (an ignored row: 0).
extern "C" __global__ void ce_labels_forward(const T* yhat, const void* labels, int label_bytes, const T* weight,
                                             ACC hard, ACC uniform, long long ignore, int has_ignore, T* out,
                                             long long n, long long c, int vec) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const T* a = yhat + row * c;
    long long t;
    ACC h, u, m, s, sw, swa;
    label_target(labels, label_bytes, row, c, weight, hard, uniform, ignore, has_ignore, &t, &h, &u);
    label_row_stats(a, weight, c, lane, u != 0, vec, &m, &s, &sw, &swa);
    if (lane != 0) return;
    ACC lse = log(s) + m, l = 0;
    if (h != 0) l += h * (lse - (t >= 0 ? LOAD(a[t]) : (ACC)0));
    if (u != 0) l += u * (sw * lse - swa);
    out[row] = STORE(l);
}
// dx[j] = dl * (softmax(a)[j] * (h + u * sum(w)) - h * [j == t] - u * w[j]); dl as in ce_rows_backward.
__device__ __forceinline__ ACC label_grad(long long j, ACC v, long long t, ACC h, ACC u, const T* weight, ACC g,
                                          ACC lse, ACC mass) {   // dx[j] of the logit v = a[j]
    ACC y = j == t ? h : (ACC)0;
    if (u != 0) y += u * (weight ? LOAD(weight[j]) : (ACC)1);
    return g * (exp(v - lse) * mass - y);
}
extern "C" __global__ void ce_labels_backward(const T* dl, long long dl_stride, const T* yhat, const void* labels,
                                              int label_bytes, const T* weight, ACC hard, ACC uniform,
                                              long long ignore, int has_ignore, T* dx, long long n, long long c,
                                              int vec) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const T* a = yhat + row * c;
    long long t;
    ACC h, u, m, s, sw, swa;
    label_target(labels, label_bytes, row, c, weight, hard, uniform, ignore, has_ignore, &t, &h, &u);
    label_row_stats(a, weight, c, lane, u != 0, vec, &m, &s, &sw, &swa);
    ACC lse = log(s) + m, g = LOAD(dl[row * dl_stride]), mass = h + (u != 0 ? u * sw : (ACC)0);
    T* d = dx + row * c;
    if (vec) {
        for (long long jv = lane; jv < c / VW; jv += 32) {
            const VT q = ((const VT*)a)[jv];
            const T* p = (const T*)&q;
            VT o;
            T* po = (T*)&o;
            _Pragma("unroll") for (int u_ = 0; u_ < VW; ++u_)
                po[u_] = STORE(label_grad(jv * VW + u_, LOAD(p[u_]), t, h, u, weight, g, lse, mass));
            ((VT*)d)[jv] = o;
        }
    } else {
        for (long long j = lane; j < c; j += 32)
            d[j] = STORE(label_grad(j, LOAD(a[j]), t, h, u, weight, g, lse, mass));
    }
}
