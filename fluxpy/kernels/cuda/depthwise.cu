// Depthwise 2-d convolution on channels-last data (fluxpy/kernels/cuda_depthwise.py): x (N, H, W, C) in memory,
// the weight (C, KH, KW) (the (C, 1, KH, KW) weight is the same memory in either layout), y (N, OH, OW, C).
// Cross-correlation at taps (kh, kw); true convolution reads the weight flipped, which the kernels do when they
// copy it to shared memory (FLIP), so the loops below are the same for both.
//
// Defines: the dtype's (halfs.cuh: T storage, C compute, LOAD, STORE), KH and KW (the kernel's size, so the tap
// loops unroll), VW (channels a thread owns: 8, one 16-byte vector of a pixel, where C is a multiple of 8; else 1).
// Block (CT, PT): CT threads along channel vectors, PT along pixels; block column j owns channels
// (blockIdx.y * CT + j) * VW ... + VW - 1. Accumulation in float32 (C).
#include "halfs.cuh"

#define TAPS (KH * KW)

// The problem's geometry, passed as plain ints (CH: the channels; flip: true convolution).
#define GEOMETRY int H, int W, int CH, int OH, int OW, int sh, int sw, int ph, int pw, int dh, int dw, int flip

// The VW values of channels c0 .. c0 + VW - 1 at pixel offset `at` (in elements, a multiple of C).
__device__ __forceinline__ void load_px(const T* a, long long at, int c0, int CH, C* out) {
#if VW == 8
    uint4 v = *(const uint4*)(a + at + c0);
    const T* p = (const T*)&v;
    _Pragma("unroll") for (int u = 0; u < 8; ++u) out[u] = LOAD(p[u]);
#else
    out[0] = c0 < CH ? LOAD(a[at + c0]) : (C)0;
#endif
}

__device__ __forceinline__ void store_px(T* a, long long at, int c0, int CH, const C* v) {
#if VW == 8
    uint4 o;
    T* p = (T*)&o;
    _Pragma("unroll") for (int u = 0; u < 8; ++u) p[u] = STORE(v[u]);
    *(uint4*)(a + at + c0) = o;
#else
    if (c0 < CH) a[at + c0] = STORE(v[0]);
#endif
}

// The weight index of tap t (cross-correlation order) in the (C, KH, KW) weight: flipped for true convolution.
__device__ __forceinline__ int tap_index(int t, int flip) {
    return flip ? TAPS - 1 - t : t;
}

// The block's channels' weights, ws[t * CT * VW + j]: tap t of channel (blockIdx.y * CT * VW + j), as float.
__device__ __forceinline__ void load_weights(const T* w, C* ws, int CH, int flip) {
    const int width = blockDim.x * VW;
    const int c_first = blockIdx.y * width;
    for (int i = threadIdx.y * blockDim.x + threadIdx.x; i < TAPS * width; i += blockDim.x * blockDim.y) {
        const int t = i / width, j = i - t * width, c = c_first + j;
        ws[i] = c < CH ? LOAD(w[(long long)c * TAPS + tap_index(t, flip)]) : (C)0;
    }
    __syncthreads();
}

// The loop of the two elementwise passes, a thread per (pixel of `out`, VW channels): DATA false, dw_forward,
// out = y at the output pixels, reading in = x at oh * sh - ph + kh * dh (and the same along w); DATA true,
// dw_backward_data, out = dx at the input pixels, gathering in = dy at every oh with ih = oh * sh - ph + kh * dh.
template <bool DATA>
__device__ __forceinline__ void taps_pass(const T* in, const T* w, T* out, GEOMETRY, long long pixels) {
    extern __shared__ unsigned char smem[];
    C* ws = (C*)smem;
    load_weights(w, ws, CH, flip);
    const int j = threadIdx.x * VW, c0 = blockIdx.y * blockDim.x * VW + j;
    if (c0 >= CH) return;
    const int width = blockDim.x * VW;
    const int rows = DATA ? H : OH, cols = DATA ? W : OW;      // the grid of `out`
    const int in_rows = DATA ? OH : H, in_cols = DATA ? OW : W;  // the grid of `in`
    for (long long p = (long long)blockIdx.x * blockDim.y + threadIdx.y; p < pixels;
         p += (long long)gridDim.x * blockDim.y) {
        const int b = (int)(p % cols);
        const long long q = p / cols;
        const int a = (int)(q % rows);
        const long long n = q / rows;
        C acc[VW], v[VW];
        _Pragma("unroll") for (int u = 0; u < VW; ++u) acc[u] = 0;
        _Pragma("unroll") for (int kh = 0; kh < KH; ++kh) {
            int i;
            if (DATA) {
                const int t = a + ph - kh * dh;
                if (t < 0 || t % sh != 0) continue;
                i = t / sh;
            } else {
                i = a * sh - ph + kh * dh;
            }
            if (i < 0 || i >= in_rows) continue;
            _Pragma("unroll") for (int kw = 0; kw < KW; ++kw) {
                int m;
                if (DATA) {
                    const int t = b + pw - kw * dw;
                    if (t < 0 || t % sw != 0) continue;
                    m = t / sw;
                } else {
                    m = b * sw - pw + kw * dw;
                }
                if (m < 0 || m >= in_cols) continue;
                load_px(in, ((n * in_rows + i) * in_cols + m) * CH, c0, CH, v);
                const C* wt = ws + (kh * KW + kw) * width + j;
                _Pragma("unroll") for (int u = 0; u < VW; ++u) acc[u] += v[u] * wt[u];
            }
        }
        store_px(out, p * CH, c0, CH, acc);
    }
}

// y[n, oh, ow, c] = sum over taps of x[n, oh * sh - ph + kh * dh, ow * sw - pw + kw * dw, c] * w[c, tap].
extern "C" __global__ void dw_forward(const T* x, const T* w, T* y, GEOMETRY, long long pixels) {
    taps_pass<false>(x, w, y, H, W, CH, OH, OW, sh, sw, ph, pw, dh, dw, flip, pixels);
}

// dx[n, ih, iw, c] = sum over the taps and outputs with ih = oh * sh - ph + kh * dh (and the same along w) of
// dy[n, oh, ow, c] * w[c, tap].
extern "C" __global__ void dw_backward_data(const T* dy, const T* w, T* dx, GEOMETRY, long long pixels) {
    taps_pass<true>(dy, w, dx, H, W, CH, OH, OW, sh, sw, ph, pw, dh, dw, flip, pixels);
}

// The weight's gradient, first pass: block (s, chunk) sums dy * x over its share of the output pixels for every
// tap of its channels, the PT pixel lanes added by a tree in shared memory (a fixed order), into
// part[(s * TAPS + t) * CH + c] (float32).
extern "C" __global__ void dw_backward_filter(const T* x, const T* dy, float* part, GEOMETRY, long long pixels) {
    extern __shared__ unsigned char smem[];
    C* lanes = (C*)smem;   // PT x CT * VW
    const int j = threadIdx.x * VW, c0 = blockIdx.y * blockDim.x * VW + j;
    const bool live = c0 < CH;
    C acc[TAPS][VW];
    _Pragma("unroll") for (int t = 0; t < TAPS; ++t)
        _Pragma("unroll") for (int u = 0; u < VW; ++u) acc[t][u] = 0;
    const long long share = (pixels + gridDim.x - 1) / gridDim.x;
    const long long lo = blockIdx.x * share, hi = min(pixels, lo + share);
    if (live) {
        for (long long p = lo + threadIdx.y; p < hi; p += blockDim.y) {
            const int ow = (int)(p % OW);
            const long long q = p / OW;
            const int oh = (int)(q % OH);
            const long long n = q / OH;
            C d[VW], v[VW];
            load_px(dy, p * CH, c0, CH, d);
            _Pragma("unroll") for (int kh = 0; kh < KH; ++kh) {
                const int ih = oh * sh - ph + kh * dh;
                if (ih < 0 || ih >= H) continue;
                _Pragma("unroll") for (int kw = 0; kw < KW; ++kw) {
                    const int iw = ow * sw - pw + kw * dw;
                    if (iw < 0 || iw >= W) continue;
                    load_px(x, ((n * H + ih) * W + iw) * CH, c0, CH, v);
                    _Pragma("unroll") for (int u = 0; u < VW; ++u) acc[kh * KW + kw][u] += d[u] * v[u];
                }
            }
        }
    }
    const int width = blockDim.x * VW;
    _Pragma("unroll") for (int t = 0; t < TAPS; ++t) {
        _Pragma("unroll") for (int u = 0; u < VW; ++u) lanes[threadIdx.y * width + j + u] = acc[t][u];
        for (int h = blockDim.y >> 1; h > 0; h >>= 1) {
            __syncthreads();
            if (threadIdx.y < h)
                _Pragma("unroll") for (int u = 0; u < VW; ++u)
                    lanes[threadIdx.y * width + j + u] += lanes[(threadIdx.y + h) * width + j + u];
        }
        __syncthreads();
        if (threadIdx.y == 0 && live)
            _Pragma("unroll") for (int u = 0; u < VW; ++u)
                if (c0 + u < CH) part[((long long)blockIdx.x * TAPS + t) * CH + c0 + u] = lanes[j + u];
        __syncthreads();
    }
}

// Second pass: dw[c, tap] = the S partials of (tap, c) added in order, rounded once; a thread per (c, tap).
extern "C" __global__ void dw_filter_total(const float* part, T* dwt, int S, int CH, int flip) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= CH * TAPS) return;
    const int c = i / TAPS, t = i - c * TAPS;
    float s = 0;
    for (int k = 0; k < S; ++k) s += part[((long long)k * TAPS + t) * CH + c];
    dwt[(long long)c * TAPS + tap_index(t, flip)] = STORE(s);
}
