// The gate kernels of LSTM and GRU cells, forward and backward (fluxpy/kernels/cuda_recurrent.py).
#include "halfs.cuh"
// T/C/LOAD/STORE: halfs.cuh. Row strides (in elements) of 0 broadcast one row to all M rows.
__device__ __forceinline__ float fx_exp(float x) { return expf(x); }
__device__ __forceinline__ double fx_exp(double x) { return exp(x); }
__device__ __forceinline__ float fx_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double fx_tanh(double x) { return tanh(x); }
// exp(-x) overflowing to inf gives the exact 0
__device__ __forceinline__ C fx_sigmoid(C x) { return (C)1 / ((C)1 + fx_exp(-x)); }

extern "C" __global__ void lstm_fwd(const T* gx, long long sgx, const T* gh, long long sgh, const T* cp,
                                    long long scp, T* y, T* act, long long M, int H) {
    const long long total = M * (long long)H;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (long long)gridDim.x * blockDim.x) {
        const long long m = k / H;
        const int j = (int)(k - m * H);
        const T* a = gx + m * sgx + j;
        C zi = LOAD(a[0]), zf = LOAD(a[H]), zg = LOAD(a[2 * H]), zo = LOAD(a[3 * H]);
        if (gh) {
            const T* b = gh + m * sgh + j;
            zi += LOAD(b[0]); zf += LOAD(b[H]); zg += LOAD(b[2 * H]); zo += LOAD(b[3 * H]);
        }
        const C i = fx_sigmoid(zi), f = fx_sigmoid(zf), g = fx_tanh(zg), o = fx_sigmoid(zo);
        const C c = f * LOAD(cp[m * scp + j]) + i * g;
        y[k] = STORE(o * fx_tanh(c));
        y[total + k] = STORE(c);
        if (act) {
            T* q = act + m * 4 * (long long)H + j;
            q[0] = STORE(i); q[H] = STORE(f); q[2 * H] = STORE(g); q[3 * H] = STORE(o);
        }
    }
}

// The cotangents dh, dc (and the GRU's dh) also take an element stride (edh, edc): a broadcast one reads as it lies.
extern "C" __global__ void lstm_bwd(const T* dh, long long sdh, long long edh, const T* dc, long long sdc,
                                    long long edc, const T* act, const T* c, const T* cp, long long scp, T* dz,
                                    T* dcp, long long M, int H) {
    const long long total = M * (long long)H;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (long long)gridDim.x * blockDim.x) {
        const long long m = k / H;
        const int j = (int)(k - m * H);
        const T* q = act + m * 4 * (long long)H + j;
        const C i = LOAD(q[0]), f = LOAD(q[H]), g = LOAD(q[2 * H]), o = LOAD(q[3 * H]);
        const C tc = fx_tanh(LOAD(c[k]));
        const C gh = LOAD(dh[m * sdh + j * edh]);
        const C dct = LOAD(dc[m * sdc + j * edc]) + gh * o * ((C)1 - tc * tc);
        T* d = dz + m * 4 * (long long)H + j;
        d[0] = STORE(dct * g * (i * ((C)1 - i)));
        d[H] = STORE(dct * LOAD(cp[m * scp + j]) * (f * ((C)1 - f)));
        d[2 * H] = STORE(dct * (i * ((C)1 - g * g)));
        d[3 * H] = STORE(gh * tc * (o * ((C)1 - o)));
        dcp[k] = STORE(dct * f);
    }
}

extern "C" __global__ void gru_fwd(const T* gi, long long sgi, const T* gh, long long sgh, const T* hp,
                                   long long shp, T* h, T* act, long long M, int H) {
    const long long total = M * (long long)H;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (long long)gridDim.x * blockDim.x) {
        const long long m = k / H;
        const int j = (int)(k - m * H);
        const T* a = gi + m * sgi + j;
        const T* b = gh + m * sgh + j;
        const C r = fx_sigmoid(LOAD(a[0]) + LOAD(b[0]));
        const C z = fx_sigmoid(LOAD(a[H]) + LOAD(b[H]));
        const C ghn = LOAD(b[2 * H]);
        const C n = fx_tanh(LOAD(a[2 * H]) + r * ghn);
        h[k] = STORE(((C)1 - z) * n + z * LOAD(hp[m * shp + j]));
        if (act) {
            T* q = act + m * 4 * (long long)H + j;
            q[0] = STORE(r); q[H] = STORE(z); q[2 * H] = STORE(n); q[3 * H] = STORE(ghn);
        }
    }
}

extern "C" __global__ void gru_bwd(const T* dh, long long sdh, long long edh, const T* act, const T* hp,
                                   long long shp, T* dgi, T* dgh, T* dhp, long long M, int H) {
    const long long total = M * (long long)H;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (long long)gridDim.x * blockDim.x) {
        const long long m = k / H;
        const int j = (int)(k - m * H);
        const T* q = act + m * 4 * (long long)H + j;
        const C r = LOAD(q[0]), z = LOAD(q[H]), n = LOAD(q[2 * H]), ghn = LOAD(q[3 * H]);
        const C g = LOAD(dh[m * sdh + j * edh]);
        const C dpn = g * ((C)1 - z) * ((C)1 - n * n);
        const C dpz = g * (LOAD(hp[m * shp + j]) - n) * (z * ((C)1 - z));
        const C dpr = dpn * ghn * (r * ((C)1 - r));
        T* di = dgi + m * 3 * (long long)H + j;
        T* dg = dgh + m * 3 * (long long)H + j;
        di[0] = STORE(dpr); di[H] = STORE(dpz); di[2 * H] = STORE(dpn);
        dg[0] = STORE(dpr); dg[H] = STORE(dpz); dg[2 * H] = STORE(dpn * r);
        dhp[k] = STORE(g * z);
    }
}
