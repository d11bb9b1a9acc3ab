// Activations, eight items a thread as 16-byte vectors of halves (two of float32: the sum of two float32 arrays and
// the derivative's product take this path too; fluxpy/kernels/cuda_halves.py), computed in float32 from the loaded
// values and rounded once, as fluxpy's traced elementwise kernels do:
// bias_act_vec8: y = act(x + b), and z = x + b (the pre-activation) where z is given; b none (null), of x's shape
//   (period 0), or a vector repeated every `period` items (a bias along the last axis of C-order data or the
//   channels of channels-last data; period a multiple of 8). FX_ACT(v): the activation, an expression in C; the
//   identity with a same-shape b is the sum of two arrays (the sum in float32, exact for two halves, rounded once).
// act_grad_vec8: dz = dy * d(s), FX_DERIV(v) the derivative as a function of the saved s (output or
//   pre-activation).
// The last n % 8 items go one a thread.
#include "halfs.cuh"

struct __align__(16) Vec8 { T v[8]; };

#define GRID_STRIDE                                                                                          \
    const long long groups = n >> 3;                                                                        \
    const long long step = (long long)gridDim.x * blockDim.x;                                               \
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;

#ifdef FX_ACT
extern "C" __global__ void bias_act_vec8(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ y,
                                         T* __restrict__ z, long long n, long long period) {
    GRID_STRIDE
    const long long pv = period >> 3;
    for (long long g = first; g < groups; g += step) {
        const Vec8 vx = ((const Vec8*)x)[g];
        Vec8 vb, oy, oz;
        if (b) vb = ((const Vec8*)b)[pv ? g % pv : g];
        _Pragma("unroll") for (int u = 0; u < 8; ++u) {
            C s = LOAD(vx.v[u]);
            if (b) s += LOAD(vb.v[u]);
            oy.v[u] = STORE(FX_ACT(s));
            oz.v[u] = STORE(s);
        }
        ((Vec8*)y)[g] = oy;
        if (z) ((Vec8*)z)[g] = oz;
    }
    for (long long i = (groups << 3) + first; i < n; i += step) {
        C s = LOAD(x[i]);
        if (b) s += LOAD(b[period ? i % period : i]);
        y[i] = STORE(FX_ACT(s));
        if (z) z[i] = STORE(s);
    }
}
#endif

#ifdef FX_DERIV
extern "C" __global__ void act_grad_vec8(const T* __restrict__ dy, const T* __restrict__ s, T* __restrict__ dz,
                                         long long n) {
    GRID_STRIDE
    for (long long g = first; g < groups; g += step) {
        const Vec8 vg = ((const Vec8*)dy)[g], vs = ((const Vec8*)s)[g];
        Vec8 out;
        _Pragma("unroll") for (int u = 0; u < 8; ++u) out.v[u] = STORE(LOAD(vg.v[u]) * FX_DERIV(LOAD(vs.v[u])));
        ((Vec8*)dz)[g] = out;
    }
    for (long long i = (groups << 3) + first; i < n; i += step) dz[i] = STORE(LOAD(dy[i]) * FX_DERIV(LOAD(s[i])));
}
#endif
