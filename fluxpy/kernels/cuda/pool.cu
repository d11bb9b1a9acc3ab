// Max and mean pooling, forward and backward, a thread per element (fluxpy/kernels/cuda_pool.py).
#include "halfs.cuh"
// T: storage, C: compute type (halfs.cuh); every value is loaded with LOAD and stored once with STORE.
// CL 0: NCHW data, a thread per output (or input) element in C order; CL 1: channels-last data (NHWC memory),
// a thread per element in that memory order, so adjacent threads read adjacent channels. Either way xoff/yoff are
// the offsets of the thread's image and channel in x and y, and PS the distance between adjacent pixels.
#define IDX long long
#if CL
#define OUT_POS                                                                                              \
    const int c = (int)(i % CC); IDX t = i / CC; const int q = (int)(t % Q); t /= Q;                         \
    const int p = (int)(t % P); const IDX n = t / P;                                                         \
    const IDX xoff = n * H * W * CC + c, yoff = n * P * Q * CC + c; const int PS = CC;
#define IN_POS                                                                                               \
    const int c = (int)(i % CC); IDX t = i / CC; const int w = (int)(t % W); t /= W;                         \
    const int h = (int)(t % H); const IDX n = t / H;                                                         \
    const IDX xoff = n * H * W * CC + c, yoff = n * P * Q * CC + c; const int PS = CC;
#else
#define OUT_POS                                                                                              \
    const int q = (int)(i % Q); IDX t = i / Q; const int p = (int)(t % P); const IDX nc = t / P;             \
    const IDX xoff = nc * H * W, yoff = nc * P * Q; const int PS = 1;
#define IN_POS                                                                                               \
    const int w = (int)(i % W); IDX t = i / W; const int h = (int)(t % H); const IDX nc = t / H;             \
    const IDX xoff = nc * H * W, yoff = nc * P * Q; const int PS = 1;
#endif

// A window of padding only (a pad as large as the kernel) gives `empty`, NNlib's lowest finite value of x's dtype.
extern "C" __global__ void maxpool_fwd(const T* x, T* y, IDX total, int H, int W, int P, int Q,
                                       const int* hs, const int* he, const int* ws, const int* we, C empty, int CC) {
    IDX i = blockIdx.x * (IDX)blockDim.x + threadIdx.x;
    if (i >= total) return;
    OUT_POS
    const T* xc = x + xoff;
    int h0 = max(hs[p], 0), h1 = min(he[p], H), w0 = max(ws[q], 0), w1 = min(we[q], W);
    if (h0 >= h1 || w0 >= w1) {
        y[i] = STORE(empty);
        return;
    }
    C m = LOAD(xc[(h0 * W + w0) * PS]);
    for (int h = h0; h < h1; ++h)
        for (int w = w0; w < w1; ++w) {
            C v = LOAD(xc[(h * W + w) * PS]);
            if (v > m || (v != v && m == m)) m = v;
        }
    y[i] = STORE(m);
}

// The max was stored in T: compared in C, where storing and loading a T is exact, it equals its element. A NaN
// maximum (maxpool_fwd lets NaN win) is the window's first NaN, which takes the gradient, as on the CPU and in
// PyTorch.
__device__ __forceinline__ int first_max(const T* xc, C yv, int h0, int h1, int w0, int w1, int W, int PS) {
    const bool nan = yv != yv;
    for (int h = h0; h < h1; ++h)
        for (int w = w0; w < w1; ++w) {
            C v = LOAD(xc[(h * W + w) * PS]);
            if (v == yv || (nan && v != v)) return h * W + w;
        }
    return -1;
}

extern "C" __global__ void maxpool_bwd(const T* dy, const T* x, const T* y, T* dx, IDX total, int H, int W,
                                       int P, int Q, const int* hs, const int* he, const int* ws, const int* we,
                                       const int* plo, const int* phi, const int* qlo, const int* qhi, int CC) {
    IDX i = blockIdx.x * (IDX)blockDim.x + threadIdx.x;
    if (i >= total) return;
    IN_POS
    const T* xc = x + xoff;
    const T* yc = y + yoff;
    const T* dyc = dy + yoff;
    int me = h * W + w;
    C acc = 0;
    for (int p = plo[h]; p <= phi[h]; ++p) {
        int h0 = max(hs[p], 0), h1 = min(he[p], H);
        for (int q = qlo[w]; q <= qhi[w]; ++q) {
            int w0 = max(ws[q], 0), w1 = min(we[q], W);
            if (first_max(xc, LOAD(yc[(p * Q + q) * PS]), h0, h1, w0, w1, W, PS) == me)
                acc += LOAD(dyc[(p * Q + q) * PS]);
        }
    }
    dx[i] = STORE(acc);
}

// Windows that do not overlap (stride >= kernel on both axes): a thread per output element writes its whole window
// of dx, its dy at the window's first maximum and 0 elsewhere, so each x is read once (maxpool_bwd, a thread per
// input element, finds the maximum of the window again for each of its elements). Pixels no window covers are zeroed
// before (cuda_pool.py).
extern "C" __global__ void maxpool_bwd_tiles(const T* dy, const T* x, const T* y, T* dx, IDX total, int H, int W,
                                             int P, int Q, const int* hs, const int* he, const int* ws, const int* we,
                                             int CC) {
    IDX i = blockIdx.x * (IDX)blockDim.x + threadIdx.x;
    if (i >= total) return;
    OUT_POS
    int h0 = max(hs[p], 0), h1 = min(he[p], H), w0 = max(ws[q], 0), w1 = min(we[q], W);
    int at = first_max(x + xoff, LOAD(y[i]), h0, h1, w0, w1, W, PS);
    const T g = STORE(LOAD(dy[i]) + (C)0), zero = STORE((C)0);   // + 0: a -0 gradient is +0, as maxpool_bwd's sum
    T* dxc = dx + xoff;
    for (int h = h0; h < h1; ++h)
        for (int w = w0; w < w1; ++w) dxc[(h * W + w) * PS] = (h * W + w == at) ? g : zero;
}

#if defined(VW)
// Channels-last data whose pixels are whole 16-byte vectors (VT of VW channels; cuda_pool._vector_width): a thread
// per (window, VW adjacent channels), CC counting vectors, so every load and store is one vector (the scalar forms
// above move two bytes a thread in the halves, and pay their index arithmetic per channel). The same comparisons,
// channel by channel.
union Vec { VT vt; T v[VW]; };

extern "C" __global__ void maxpool_fwd_vec(const VT* x, VT* y, IDX total, int H, int W, int P, int Q,
                                           const int* hs, const int* he, const int* ws, const int* we, C empty,
                                           int CC) {
    IDX i = blockIdx.x * (IDX)blockDim.x + threadIdx.x;
    if (i >= total) return;
    OUT_POS
    const VT* xc = x + xoff;
    int h0 = max(hs[p], 0), h1 = min(he[p], H), w0 = max(ws[q], 0), w1 = min(we[q], W);
    Vec out;
    if (h0 >= h1 || w0 >= w1) {
        _Pragma("unroll") for (int u = 0; u < VW; ++u) out.v[u] = STORE(empty);
        y[i] = out.vt;
        return;
    }
    Vec a;
    a.vt = xc[(h0 * W + w0) * PS];
    C m[VW];
    _Pragma("unroll") for (int u = 0; u < VW; ++u) m[u] = LOAD(a.v[u]);
    for (int h = h0; h < h1; ++h)
        for (int w = w0; w < w1; ++w) {
            a.vt = xc[(h * W + w) * PS];
            _Pragma("unroll") for (int u = 0; u < VW; ++u) {
                const C v = LOAD(a.v[u]);
                if (v > m[u] || (v != v && m[u] == m[u])) m[u] = v;
            }
        }
    _Pragma("unroll") for (int u = 0; u < VW; ++u) out.v[u] = STORE(m[u]);
    y[i] = out.vt;
}

// maxpool_bwd_tiles by vectors: each channel's first maximum found in one pass over the window (first_max's test,
// channel by channel), then the window written a vector a pixel.
extern "C" __global__ void maxpool_bwd_tiles_vec(const VT* dy, const VT* x, const VT* y, VT* dx, IDX total, int H,
                                                 int W, int P, int Q, const int* hs, const int* he, const int* ws,
                                                 const int* we, int CC) {
    IDX i = blockIdx.x * (IDX)blockDim.x + threadIdx.x;
    if (i >= total) return;
    OUT_POS
    int h0 = max(hs[p], 0), h1 = min(he[p], H), w0 = max(ws[q], 0), w1 = min(we[q], W);
    const VT* xc = x + xoff;
    Vec yv, gv, a;
    yv.vt = y[i];
    gv.vt = dy[i];
    int at[VW];
    _Pragma("unroll") for (int u = 0; u < VW; ++u) at[u] = -1;
    for (int h = h0; h < h1; ++h)
        for (int w = w0; w < w1; ++w) {
            a.vt = xc[(h * W + w) * PS];
            _Pragma("unroll") for (int u = 0; u < VW; ++u) {
                const C v = LOAD(a.v[u]), m = LOAD(yv.v[u]);
                if (at[u] < 0 && (v == m || (m != m && v != v))) at[u] = h * W + w;
            }
        }
    T g[VW];
    const T zero = STORE((C)0);
    _Pragma("unroll") for (int u = 0; u < VW; ++u) g[u] = STORE(LOAD(gv.v[u]) + (C)0);   // -0 as +0 (see above)
    VT* dxc = dx + xoff;
    for (int h = h0; h < h1; ++h)
        for (int w = w0; w < w1; ++w) {
            _Pragma("unroll") for (int u = 0; u < VW; ++u) a.v[u] = (h * W + w == at[u]) ? g[u] : zero;
            dxc[(h * W + w) * PS] = a.vt;
        }
}
#endif

extern "C" __global__ void maxpool_gather(const T* dx, const T* x, const T* y, T* out, IDX total, int H, int W,
                                          int P, int Q, const int* hs, const int* he, const int* ws, const int* we,
                                          int CC) {
    IDX i = blockIdx.x * (IDX)blockDim.x + threadIdx.x;
    if (i >= total) return;
    OUT_POS
    int h0 = max(hs[p], 0), h1 = min(he[p], H), w0 = max(ws[q], 0), w1 = min(we[q], W);
    int at = first_max(x + xoff, LOAD(y[i]), h0, h1, w0, w1, W, PS);
    out[i] = at < 0 ? STORE((C)0) : dx[xoff + (IDX)at * PS];
}

extern "C" __global__ void meanpool_fwd(const T* x, T* y, IDX total, int H, int W, int P, int Q,
                                        const int* hs, const int* he, const int* ws, const int* we, C inv, int CC) {
    IDX i = blockIdx.x * (IDX)blockDim.x + threadIdx.x;
    if (i >= total) return;
    OUT_POS
    const T* xc = x + xoff;
    int h0 = max(hs[p], 0), h1 = min(he[p], H), w0 = max(ws[q], 0), w1 = min(we[q], W);
    C acc = 0;
    for (int h = h0; h < h1; ++h)
        for (int w = w0; w < w1; ++w) acc += LOAD(xc[(h * W + w) * PS]);
    y[i] = STORE(acc * inv);
}

extern "C" __global__ void meanpool_bwd(const T* dy, T* dx, IDX total, int H, int W, int P, int Q,
                                        const int* plo, const int* phi, const int* qlo, const int* qhi, C inv,
                                        int CC) {
    IDX i = blockIdx.x * (IDX)blockDim.x + threadIdx.x;
    if (i >= total) return;
    IN_POS
    const T* dyc = dy + yoff;
    C acc = 0;
    for (int p = plo[h]; p <= phi[h]; ++p)
        for (int q = qlo[w]; q <= qhi[w]; ++q) acc += LOAD(dyc[(p * Q + q) * PS]);
    dx[i] = STORE(acc * inv);
}
