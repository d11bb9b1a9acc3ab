// Nearest upsampling by whole scales of (N, C, D, H, W) data (fewer spatial axes given as ones), in C order or
// channels-last (CL = 1: (N, D, H, W, C) memory). T/C/LOAD/STORE: halfs.cuh.
//
// nearest_forward: a thread per output value (grid-stride), reading its input value: y[.., d, h, w] =
//   x[.., d / SD, h / SH, w / SW].
// nearest_backward: a thread per input value, the sum of the SD * SH * SW output cotangents it was copied to, in a
//   fixed order, in the compute type and rounded once.
#include "halfs.cuh"

// The sizes of one side: output (od, oh, ow) and scales; channels: C, read where cl (channels-last).
#define GEOMETRY long long od, long long oh, long long ow, long long channels, int sd, int sh, int sw, int cl

// Input offset of output value i, or (inverse = true) the first output offset of input value i.
__device__ __forceinline__ long long map(long long i, bool inverse, GEOMETRY) {
    const long long id = od / sd, ih = oh / sh, iw = ow / sw;
    // the sizes of the side i indexes, and those of the side it maps to
    const long long fd = inverse ? id : od, fh = inverse ? ih : oh, fw = inverse ? iw : ow;
    const long long td = inverse ? od : id, th = inverse ? oh : ih, tw = inverse ? ow : iw;
    long long c = 0;
    if (cl) { c = i % channels; i /= channels; }
    const long long w = i % fw; i /= fw;
    const long long h = i % fh; i /= fh;
    const long long d = i % fd;
    const long long lead = i / fd;   // N * C + c in C order, N channels-last
    const long long md = inverse ? d * sd : d / sd, mh = inverse ? h * sh : h / sh, mw = inverse ? w * sw : w / sw;
    const long long o = ((lead * td + md) * th + mh) * tw + mw;
    return cl ? o * channels + c : o;
}

extern "C" __global__ void nearest_forward(const T* x, T* y, long long total, GEOMETRY) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = x[map(i, false, od, oh, ow, channels, sd, sh, sw, cl)];
}

extern "C" __global__ void nearest_backward(const T* dy, T* dx, long long total, GEOMETRY) {
    const long long step_w = cl ? channels : 1, step_h = ow * step_w, step_d = oh * step_h;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long first = map(i, true, od, oh, ow, channels, sd, sh, sw, cl);
        C sum = 0;
        for (int a = 0; a < sd; ++a)
            for (int b = 0; b < sh; ++b)
                for (int e = 0; e < sw; ++e) sum += LOAD(dy[first + a * step_d + b * step_h + e * step_w]);
        dx[i] = STORE(sum);
    }
}
