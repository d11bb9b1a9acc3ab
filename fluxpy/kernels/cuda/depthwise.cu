// Depthwise 2-d convolution on channels-last data (fluxpy/kernels/cuda_depthwise.py): x (N, H, W, C) in memory,
// the weight (C, KH, KW) (the (C, 1, KH, KW) weight is the same memory in either layout), y (N, OH, OW, C).
// Cross-correlation at taps (kh, kw); true convolution reads the weight flipped, which the kernels do when they
// copy it to shared memory or write its gradient (flip), so the loops below are the same for both.
//
// Defines: the dtype's (halfs.cuh: T storage, C compute, LOAD, STORE), KH and KW (the kernel's size, so the tap
// loops unroll), VW (channels a thread owns: 8, one 16-byte vector of a pixel, where C is a multiple of 8; else 1).
// The row kernels, dw_forward and the weight's gradient, are compiled where WB is given, with SW and DLW: a thread
// computes WB adjacent outputs of a row (a segment), and SW (the stride along W) and DLW (the dilation along W) are
// compile-time so that each input column of the segment's window is loaded once into registers and used for every
// tap and output that reads it. KHB given too (rows of the weight a block sums) selects the weight's gradient
// (dw_backward_filter, dw_filter_total); WB given alone, dw_forward; neither, dw_backward_data.
// Block (CT, PT): CT threads along channel vectors, PT along pixels or segments; block column j owns channels
// (blockIdx.y * CT + j) * VW ... + VW - 1. Accumulation in float32 (C), rounded once.
#include "halfs.cuh"

#define TAPS (KH * KW)
#define THREADS 256   // CT x PT (cuda_depthwise._THREADS)

// The VW values of channels c0 .. c0 + VW - 1 at pixel offset `at` (in elements, a multiple of C).
__device__ __forceinline__ void load_px(const T* __restrict__ a, long long at, int c0, int CH, C* out) {
#if VW == 8
    uint4 v = *(const uint4*)(a + at + c0);
    const T* p = (const T*)&v;
    _Pragma("unroll") for (int u = 0; u < 8; ++u) out[u] = LOAD(p[u]);
#else
    out[0] = c0 < CH ? LOAD(a[at + c0]) : (C)0;
#endif
}

__device__ __forceinline__ void store_px(T* __restrict__ a, long long at, int c0, int CH, const C* v) {
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
__device__ __forceinline__ void load_weights(const T* __restrict__ w, C* ws, int CH, int flip) {
    const int width = blockDim.x * VW;
    const int c_first = blockIdx.y * width;
    for (int i = threadIdx.y * blockDim.x + threadIdx.x; i < TAPS * width; i += blockDim.x * blockDim.y) {
        const int t = i / width, j = i - t * width, c = c_first + j;
        ws[i] = c < CH ? LOAD(w[(long long)c * TAPS + tap_index(t, flip)]) : (C)0;
    }
    __syncthreads();
}

#if !defined(WB)
// dx[n, ih, iw, c] = sum over the taps and outputs with ih = oh * sh - ph + kh * dh (and the same along w) of
// dy[n, oh, ow, c] * w[c, tap]: a thread per (input pixel, VW channels), gathering dy at every (oh, ow) that reads
// the pixel.
extern "C" __global__ void dw_backward_data(const T* __restrict__ dy, const T* __restrict__ w, T* __restrict__ dx,
                                            int H, int W, int CH, int OH, int OW, int sh, int sw, int ph, int pw,
                                            int dh, int dw, int flip, long long pixels) {
    extern __shared__ float4 shared4[];
    C* ws = (C*)shared4;
    load_weights(w, ws, CH, flip);
    const int j = threadIdx.x * VW, c0 = blockIdx.y * blockDim.x * VW + j;
    if (c0 >= CH) return;
    const int width = blockDim.x * VW;
    for (long long p = (long long)blockIdx.x * blockDim.y + threadIdx.y; p < pixels;
         p += (long long)gridDim.x * blockDim.y) {
        const int b = (int)(p % W);
        const long long q = p / W;
        const int a = (int)(q % H);
        const long long n = q / H;
        C acc[VW], v[VW];
        _Pragma("unroll") for (int u = 0; u < VW; ++u) acc[u] = 0;
        _Pragma("unroll") for (int kh = 0; kh < KH; ++kh) {
            const int th = a + ph - kh * dh;
            if (th < 0 || th % sh != 0) continue;
            const int i = th / sh;
            if (i >= OH) continue;
            _Pragma("unroll") for (int kw = 0; kw < KW; ++kw) {
                const int tw = b + pw - kw * dw;
                if (tw < 0 || tw % sw != 0) continue;
                const int m = tw / sw;
                if (m >= OW) continue;
                load_px(dy, ((n * OH + i) * OW + m) * CH, c0, CH, v);
                const C* wt = ws + (kh * KW + kw) * width + j;
                _Pragma("unroll") for (int u = 0; u < VW; ++u) acc[u] += v[u] * wt[u];
            }
        }
        store_px(dx, p * CH, c0, CH, acc);
    }
}
#else
// The row kernels' geometry, as plain ints (CH: the channels; flip: true convolution); W's stride and dilation are
// the defines SW and DLW.
#define ROWS int H, int W, int CH, int OH, int OW, int sh, int ph, int pw, int dh, int flip

// Output o (0 <= o < WB) of a segment reads, at tap kw, column o * SW + kw * DLW of the segment's window of SPAN
// input columns, which starts at column ow0 * SW - pw (ow0: the segment's first output column).
#define SPAN ((WB - 1) * SW + (KW - 1) * DLW + 1)

// Whether some output of a segment reads window column m (not so in the gaps a stride wider than the kernel leaves).
__device__ __forceinline__ constexpr bool window_read(int m) {
    for (int o = 0; o < WB; ++o)
        for (int kw = 0; kw < KW; ++kw)
            if (o * SW + kw * DLW == m) return true;
    return false;
}

// Segment s of the output (N * OH rows of ceil(OW / WB) segments, row-major): its image, row and first column.
struct Segment { int n, oh, ow0; };

__device__ __forceinline__ Segment segment_of(int s, int OH, int OW) {
    const int per_row = (OW + WB - 1) / WB, q = s / per_row;
    return {q / OH, q % OH, (s - q * per_row) * WB};
}

#if !defined(KHB)
// y[n, oh, ow, c] = sum over taps of x[n, oh * sh - ph + kh * dh, ow * SW - pw + kw * DLW, c] * w[c, tap], each
// output's taps added in (kh, kw) order. A thread per (segment, VW channels): each window column of a row of taps
// read once; the block's weights in shared memory (read there, not held: fewer registers for wide kernels).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
dw_forward(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, ROWS, int segments) {
    extern __shared__ float4 shared4[];
    C* ws = (C*)shared4;
    load_weights(w, ws, CH, flip);
    const int width = blockDim.x * VW, j = threadIdx.x * VW, c0 = blockIdx.y * width + j;
    if (c0 >= CH) return;
    for (long long s = (long long)blockIdx.x * blockDim.y + threadIdx.y; s < segments;
         s += (long long)gridDim.x * blockDim.y) {
        const Segment g = segment_of((int)s, OH, OW);
        const int iw0 = g.ow0 * SW - pw;
        C acc[WB][VW];
        _Pragma("unroll") for (int o = 0; o < WB; ++o)
            _Pragma("unroll") for (int u = 0; u < VW; ++u) acc[o][u] = 0;
        _Pragma("unroll") for (int kh = 0; kh < KH; ++kh) {
            const int ih = g.oh * sh - ph + kh * dh;
            if (ih < 0 || ih >= H) continue;
            const C* wr = ws + kh * KW * width + j;   // the row's weights: tap kw at wr[kw * width + u]
            const long long row = ((long long)g.n * H + ih) * W;
            _Pragma("unroll") for (int m = 0; m < SPAN; ++m) {
                const int iw = iw0 + m;
                if (!window_read(m) || iw < 0 || iw >= W) continue;
                C v[VW];
                load_px(x, (row + iw) * CH, c0, CH, v);
                // an output's taps of this row come in kw order as m grows: the same sum order as a tap loop
                _Pragma("unroll") for (int o = 0; o < WB; ++o)
                    _Pragma("unroll") for (int kw = 0; kw < KW; ++kw)
                        if (o * SW + kw * DLW == m)
                            _Pragma("unroll") for (int u = 0; u < VW; ++u) acc[o][u] += v[u] * wr[kw * width + u];
            }
        }
        const long long at = (((long long)g.n * OH + g.oh) * OW + g.ow0) * CH;
        _Pragma("unroll") for (int o = 0; o < WB; ++o)
            if (g.ow0 + o < OW) store_px(y, at + (long long)o * CH, c0, CH, acc[o]);
    }
}
#else
// v (a thread's VW values) added over the block's PT pixel lanes in a fixed order: a butterfly over the lanes one
// warp holds (its threadIdx.y's), then the warps' sums in warp order through `buf` (warps x CT * VW floats). True
// in the threads of row 0, whose v is then the total.
__device__ __forceinline__ bool block_sum(C* v, C* buf) {
    const int width = blockDim.x * VW, j = threadIdx.x * VW, lanes = 32 / blockDim.x;
    for (int o = 16; o >= (int)blockDim.x; o >>= 1)
        _Pragma("unroll") for (int u = 0; u < VW; ++u) v[u] += __shfl_xor_sync(0xffffffffu, v[u], o);
    if (threadIdx.y % lanes == 0)
        _Pragma("unroll") for (int u = 0; u < VW; ++u) buf[threadIdx.y / lanes * width + j + u] = v[u];
    __syncthreads();
    if (threadIdx.y != 0) return false;
    for (int k = 1; k < (int)blockDim.y / lanes; ++k)
        _Pragma("unroll") for (int u = 0; u < VW; ++u) v[u] += buf[k * width + j + u];
    return true;
}

// The weight's gradient, first pass: block (s, chunk, z) sums dy * x over its share of the segments (contiguous;
// thread row ty takes every PT-th of them, in order) for the taps of rows z * KHB ... z * KHB + KHB - 1 (below KH)
// of its channels, then over its pixel lanes (block_sum), into part[(s * TAPS + t) * CH + c] (float32).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
dw_backward_filter(const T* __restrict__ x, const T* __restrict__ dy, float* __restrict__ part, ROWS,
                   int segments) {
    extern __shared__ float4 shared4[];
    C* buf = (C*)shared4;   // two of block_sum's buffers, taps alternating: one barrier a tap
    const int width = blockDim.x * VW, j = threadIdx.x * VW, c0 = blockIdx.y * width + j;
    const int kh0 = blockIdx.z * KHB;
    C acc[KHB * KW][VW];
    _Pragma("unroll") for (int i = 0; i < KHB * KW; ++i)
        _Pragma("unroll") for (int u = 0; u < VW; ++u) acc[i][u] = 0;
    const long long share = (segments + gridDim.x - 1) / gridDim.x;
    const long long lo = blockIdx.x * share, hi = min((long long)segments, lo + share);
    for (long long s = lo + threadIdx.y; c0 < CH && s < hi; s += blockDim.y) {
        const Segment g = segment_of((int)s, OH, OW);
        const int iw0 = g.ow0 * SW - pw;
        const long long at = (((long long)g.n * OH + g.oh) * OW + g.ow0) * CH;
        C d[WB][VW];
        _Pragma("unroll") for (int o = 0; o < WB; ++o) {
            if (g.ow0 + o < OW) {
                load_px(dy, at + (long long)o * CH, c0, CH, d[o]);
            } else {
                _Pragma("unroll") for (int u = 0; u < VW; ++u) d[o][u] = 0;
            }
        }
        _Pragma("unroll") for (int r = 0; r < KHB; ++r) {
            const int ih = g.oh * sh - ph + (kh0 + r) * dh;
            if (kh0 + r >= KH || ih < 0 || ih >= H) continue;
            const long long row = ((long long)g.n * H + ih) * W;
            _Pragma("unroll") for (int m = 0; m < SPAN; ++m) {
                const int iw = iw0 + m;
                if (!window_read(m) || iw < 0 || iw >= W) continue;
                C v[VW];
                load_px(x, (row + iw) * CH, c0, CH, v);
                // outputs past the row's end add nothing (not even 0 * inf)
                _Pragma("unroll") for (int o = 0; o < WB; ++o)
                    _Pragma("unroll") for (int kw = 0; kw < KW; ++kw)
                        if (o * SW + kw * DLW == m && g.ow0 + o < OW)
                            _Pragma("unroll") for (int u = 0; u < VW; ++u) acc[r * KW + kw][u] += d[o][u] * v[u];
            }
        }
    }
    const int warps = blockDim.x * blockDim.y / 32;
    _Pragma("unroll") for (int i = 0; i < KHB * KW; ++i) {
        const int t = kh0 * KW + i;
        if (t >= TAPS) break;   // the same for the whole block
        if (block_sum(acc[i], buf + (i & 1) * warps * width) && c0 < CH)
            _Pragma("unroll") for (int u = 0; u < VW; ++u)
                if (c0 + u < CH) part[((long long)blockIdx.x * TAPS + t) * CH + c0 + u] = acc[i][u];
    }
}

// Second pass: dw[c, tap] = the S partials of (tap, c) added in a fixed order, rounded once. Block (32, R):
// column i = blockIdx.x * 32 + threadIdx.x of a partial's TAPS * CH values; thread row ty adds partials ty,
// ty + R, ... in order (a few at a time in flight), then row 0 adds the rows' sums in order.
extern "C" __global__ void __launch_bounds__(1024)
dw_filter_total(const float* __restrict__ part, T* __restrict__ dwt, int S, int CH, int flip) {
    extern __shared__ float4 shared4[];
    float* rows = (float*)shared4;   // blockDim.y x blockDim.x
    const int i = blockIdx.x * blockDim.x + threadIdx.x, n = TAPS * CH;
    float s = 0;
    if (i < n)
        _Pragma("unroll 4") for (int k = threadIdx.y; k < S; k += blockDim.y) s += part[(long long)k * n + i];
    rows[threadIdx.y * blockDim.x + threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y != 0 || i >= n) return;
    for (int k = 1; k < (int)blockDim.y; ++k) s += rows[k * blockDim.x + threadIdx.x];
    const int t = i / CH, c = i - t * CH;
    dwt[(long long)c * TAPS + tap_index(t, flip)] = STORE(s);
}
#endif
#endif
