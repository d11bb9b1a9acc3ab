// Group norm of (N, C, S...) data, S = the spatial size, G groups of CG = C / G consecutive channels, in C order
// (each (sample, group) one contiguous run of L = CG * S values) or channels-last (CL = 1: (N, S, C) memory, a
// group's CG channels adjacent in each of its S rows). T/C/LOAD/STORE: halfs.cuh (C, the compute type: float32 for
// the halves and float32, float64 for float64); FX_ACT(v) and FX_ACT_GRAD(v): the activation applied to the affine
// value and its derivative at it (the identity: v and 1). gamma and beta (C values, the compute type, or null: 1 and
// 0) are per channel; mean and rstd per (sample, group), in the compute type.
//
// gn_stats: a block per (sample, group): shifted sums of d = x - K and d * d (K the group's first value, which keeps
//   the variance accurate where the mean is large), reduced by warp shuffles then across the warps in a fixed order.
// gn_apply: y = act((x - mean) * rstd * gamma + beta), a grid-stride loop.
// gn_bwd_channels (C order): a block per (sample, channel): dz = dy * act'(pre), the pre-activation recomputed from
//   x; sum(dz) and sum(dz * xhat) over the channel's S values, written per (sample, channel).
// gn_bwd_groups_cl (channels-last, CG dividing the block): a block per (sample, group), each thread on one channel
//   of the group at every step; the threads' sums of a channel added in a fixed order: the same per (sample,
//   channel) sums.
// gn_bwd_finish: a thread per (sample, group) makes the group's coefficients of dx from its channels' sums; a
//   thread per channel sums dgamma and dbeta over the samples in order (no atomics: deterministic).
// gn_bwd_apply: dx = rstd * (dz * gamma - a - xhat * b), a = mean over the group of dz * gamma, b of dz * gamma * xhat.
#include "halfs.cuh"
#include "block_sum.cuh"

#define ACT(v) FX_ACT(v)
#define ACT_GRAD(v) FX_ACT_GRAD(v)

constexpr int THREADS = 256;

__device__ __forceinline__ C gamma_of(const C* gamma, long long c) { return gamma ? gamma[c] : (C)1; }
__device__ __forceinline__ C beta_of(const C* beta, long long c) { return beta ? beta[c] : (C)0; }

// The offset of value i of (sample, group) r's L values.
__device__ __forceinline__ long long group_offset(long long r, long long i, long long s, long long channels,
                                                  long long cg, int cl) {
    if (!cl) return r * cg * s + i;
    const long long groups = channels / cg, n = r / groups, g = r % groups;
    return (n * s + i / cg) * channels + g * cg + i % cg;
}

// (sample, group) and channel of the value at offset i.
__device__ __forceinline__ void locate(long long i, long long s, long long channels, long long cg, int cl,
                                       long long& r, long long& c) {
    if (cl) {
        c = i % channels;
        r = (i / (channels * s) * channels + c) / cg;
    } else {
        const long long nc = i / s;
        c = nc % channels;
        r = nc / cg;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) gn_stats(const T* x, long long runs, long long s,
                                                                long long channels, long long cg, int cl, C eps,
                                                                C* mean, C* rstd) {
    __shared__ C shared[THREADS / 32];
    const long long run = cg * s;
    for (long long r = blockIdx.x; r < runs; r += gridDim.x) {
        const C k = LOAD(x[group_offset(r, 0, s, channels, cg, cl)]);
        C sum = 0, ss = 0;
        for (long long i = threadIdx.x; i < run; i += blockDim.x) {
            const C d = LOAD(x[group_offset(r, i, s, channels, cg, cl)]) - k;
            sum += d;
            ss += d * d;
        }
        sum = block_sum(sum, shared);
        ss = block_sum(ss, shared);
        if (threadIdx.x == 0) {
            const C m = sum / (C)run;
            C var = ss / (C)run - m * m;
            var = var > (C)0 ? var : (C)0;
            mean[r] = k + m;
            rstd[r] = (C)1 / sqrt(var + eps);
        }
    }
}

extern "C" __global__ void gn_apply(const T* x, const C* gamma, const C* beta, const C* mean, const C* rstd, T* y,
                                    long long total, long long s, long long channels, long long cg, int cl) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r, c;
        locate(i, s, channels, cg, cl, r, c);
        const C xhat = (LOAD(x[i]) - mean[r]) * rstd[r];
        y[i] = STORE(ACT(xhat * gamma_of(gamma, c) + beta_of(beta, c)));
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) gn_bwd_channels(
        const T* dy, const T* x, const C* gamma, const C* beta, const C* mean, const C* rstd, C* dbeta_part,
        C* dgamma_part, long long rows, long long s, long long channels, long long cg) {
    __shared__ C shared[THREADS / 32];
    for (long long nc = blockIdx.x; nc < rows; nc += gridDim.x) {
        const long long c = nc % channels, r = nc / cg;
        const C m = mean[r], rs = rstd[r], g = gamma_of(gamma, c), b = beta_of(beta, c);
        const T* px = x + nc * s;
        const T* pdy = dy + nc * s;
        C sd = 0, sdx = 0;
        for (long long i = threadIdx.x; i < s; i += blockDim.x) {
            const C xhat = (LOAD(px[i]) - m) * rs;
            const C dz = LOAD(pdy[i]) * ACT_GRAD(xhat * g + b);
            sd += dz;
            sdx += dz * xhat;
        }
        sd = block_sum(sd, shared);
        sdx = block_sum(sdx, shared);
        if (threadIdx.x == 0) {
            dbeta_part[nc] = sd;
            dgamma_part[nc] = sdx;
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) gn_bwd_groups_cl(
        const T* dy, const T* x, const C* gamma, const C* beta, const C* mean, const C* rstd, C* dbeta_part,
        C* dgamma_part, long long runs, long long s, long long channels, long long cg) {
    __shared__ C sums[2][THREADS];
    const long long groups = channels / cg, run = cg * s;
    for (long long r = blockIdx.x; r < runs; r += gridDim.x) {
        const long long c = r % groups * cg + threadIdx.x % cg;   // this thread's channel at every step
        const C m = mean[r], rs = rstd[r], g = gamma_of(gamma, c), b = beta_of(beta, c);
        C sd = 0, sdx = 0;
        for (long long i = threadIdx.x; i < run; i += blockDim.x) {
            const long long o = group_offset(r, i, s, channels, cg, 1);
            const C xhat = (LOAD(x[o]) - m) * rs;
            const C dz = LOAD(dy[o]) * ACT_GRAD(xhat * g + b);
            sd += dz;
            sdx += dz * xhat;
        }
        __syncthreads();   // the previous group's sums are read
        sums[0][threadIdx.x] = sd;
        sums[1][threadIdx.x] = sdx;
        __syncthreads();
        if (threadIdx.x < cg) {
            C td = 0, tdx = 0;
            for (int t = threadIdx.x; t < THREADS; t += cg) {
                td += sums[0][t];
                tdx += sums[1][t];
            }
            const long long nc = r / groups * channels + c;
            dbeta_part[nc] = td;
            dgamma_part[nc] = tdx;
        }
    }
}

extern "C" __global__ void gn_bwd_finish(const C* gamma, const C* dbeta_part, const C* dgamma_part, C* a, C* b,
                                         C* dgamma, C* dbeta, long long n, long long channels, long long cg,
                                         long long run) {
    const long long groups = channels / cg;
    const long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (t < n * groups) {   // the group's coefficients of dx
        C sa = 0, sb = 0;
        for (long long j = 0; j < cg; ++j) {
            const long long c = (t % groups) * cg + j, nc = (t / groups) * channels + c;
            const C g = gamma_of(gamma, c);
            sa += g * dbeta_part[nc];
            sb += g * dgamma_part[nc];
        }
        a[t] = sa / (C)run;
        b[t] = sb / (C)run;
    } else if (t < n * groups + channels && dgamma) {   // a channel's parameter gradients, the samples in order
        const long long c = t - n * groups;
        C sg = 0, sbeta = 0;
        for (long long i = 0; i < n; ++i) {
            sg += dgamma_part[i * channels + c];
            sbeta += dbeta_part[i * channels + c];
        }
        dgamma[c] = sg;
        dbeta[c] = sbeta;
    }
}

extern "C" __global__ void gn_bwd_apply(const T* dy, const T* x, const C* gamma, const C* beta, const C* mean,
                                        const C* rstd, const C* a, const C* b, T* dx, long long total, long long s,
                                        long long channels, long long cg, int cl) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r, c;
        locate(i, s, channels, cg, cl, r, c);
        const C rs = rstd[r], g = gamma_of(gamma, c);
        const C xhat = (LOAD(x[i]) - mean[r]) * rs;
        const C dz = LOAD(dy[i]) * ACT_GRAD(xhat * g + beta_of(beta, c));
        dx[i] = STORE(rs * (dz * g - a[r] - xhat * b[r]));
    }
}
