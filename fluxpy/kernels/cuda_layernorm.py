"""Layer norm on the GPU: one read and one write of ``x`` forward, one pass for ``dx`` backward, deterministic.

The rows of ``x`` (``(R, L)``: the normalised trailing axes flattened into ``L``, C-contiguous) are normalised
one row per group of ``TPR`` threads (a warp for short rows, up to 1,024 threads for long ones), each thread
holding its ``ITEMS`` 16-byte vectors of the row in registers: the row is read from global memory once, the mean
and then the variance are summed from the registers (two exact passes, no ``E[x^2] - E[x]^2``), and ``y`` is
written once. ``TPR`` is the smallest power of two from 32 that keeps ``ITEMS`` at 8 vectors or fewer, so a row
of 20,480 bfloat16 values takes 1,024 threads of 3 vectors (no spills: :func:`kernel_attributes` reports the
compiled kernels' local memory). Rows are summed by warp shuffles, then across warps in a fixed order.

Backward: ``ln_bwd`` sweeps each row twice (the row sums, then ``dx = rstd (g - mean(g) - xhat mean(g xhat))``,
``g = dy gamma``; the second sweep rereads ``x`` and ``dy``, from L2 as a rule) and keeps, per thread, the column
sums of ``dy xhat`` and ``dy`` over the rows its group visits; a block's groups add theirs in shared memory in a
fixed order and the block writes one row of partials; ``ln_params`` adds the partial rows per column in a fixed
order (``dgamma``, ``dbeta``): the result does not depend on timing. Rows whose column sums do not fit in a
thread's registers (:func:`backward_fits`: 20,480 values a row) take the composite backward. Statistics
(``mean``, ``rstd``) are float32 (float64 for float64 data); ``gamma``/``beta`` are in the compute type (float32
for the halves, as fluxpy's LayerNorm keeps them). Kernels are compiled per (dtype, L) and cached.

>>> sorted(KERNELS)
['layernorm_backward', 'layernorm_forward']
"""
from __future__ import annotations

import numpy as np

from ..backend import cupy
from .halfs import KERNEL_DTYPES, compute_dtype, prelude

__all__ = ["layernorm_forward", "layernorm_backward", "supports", "backward_supports", "launch_shape",
           "kernel_attributes", "KERNELS"]

MAX_VECTORS = 8        # vectors of a row a thread holds in the forward, at most (128 bytes in flight a thread)
MAX_VALUES = 32        # row values a thread sums per column in the backward, at most (16 for float64)
MAX_THREADS = 1024     # threads per row, at most (longer rows are turned down)

_SOURCE = r"""
// T/C/LOAD/STORE: halfs.prelude; L: the row length; VW: elements per vector; VT: the vector type;
// TPR: threads per row; RPB: rows per block; ITEMS: vectors per thread.
#define LV (L / VW)
#define NW (TPR / 32 > 0 ? TPR / 32 : 1)

// The sum of a over the TPR threads of this thread's row, in a fixed order (every thread of the block calls it).
__device__ __forceinline__ C row_sum(C a, C* sh) {
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffff, a, o);
#if TPR > 32
    const int grp = threadIdx.x / TPR, warp = (threadIdx.x % TPR) / 32;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[grp * NW + warp] = a;
    __syncthreads();
    a = 0;
    for (int w = 0; w < NW; ++w) a += sh[grp * NW + w];
#endif
    return a;
}

// Vector j of a row of p, plus the same of res and bias where given (the fused x + residual + bias).
__device__ __forceinline__ void load_vec(const T* p, const T* res, const C* bias, long long row, int j, C* v) {
    VT w = ((const VT*)(p + row * (long long)L))[j];
    const T* e = (const T*)&w;
    #pragma unroll
    for (int u = 0; u < VW; ++u) v[u] = LOAD(e[u]);
    if (res) {
        VT q = ((const VT*)(res + row * (long long)L))[j];
        const T* f = (const T*)&q;
        #pragma unroll
        for (int u = 0; u < VW; ++u) v[u] += LOAD(f[u]);
    }
    if (bias) {
        #pragma unroll
        for (int u = 0; u < VW; ++u) v[u] += bias[j * VW + u];
    }
}

__device__ __forceinline__ void load_row(const T* p, const T* res, const C* bias, long long row, bool valid, int tid,
                                         C* v) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;   // vector index in the row
        if (valid && j < LV) {
            load_vec(p, res, bias, row, j, v + i * VW);
        } else {
            #pragma unroll
            for (int u = 0; u < VW; ++u) v[i * VW + u] = 0;
        }
    }
}

extern "C" __global__ void __launch_bounds__(TPR * RPB) ln_fwd(const T* x, const C* gamma, const C* beta, T* y,
                                                               C* mean_out, C* rstd_out, long long R, double eps,
                                                               const T* res, const C* bias) {
    __shared__ C sh[RPB * NW];
    const int tid = threadIdx.x % TPR, grp = threadIdx.x / TPR;
    const long long row = (long long)blockIdx.x * RPB + grp;
    const bool valid = row < R;
    C v[ITEMS * VW];
    load_row(x, res, bias, row, valid, tid, v);
    C s = 0;
    #pragma unroll
    for (int k = 0; k < ITEMS * VW; ++k) s += v[k];
    const C mu = row_sum(s, sh) / (C)L;
    C q = 0;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const bool in = (i * TPR + tid) < LV;
        #pragma unroll
        for (int u = 0; u < VW; ++u) { const C d = in ? v[i * VW + u] - mu : (C)0; q += d * d; }
    }
    const C rs = (C)1 / sqrt(row_sum(q, sh) / (C)L + (C)eps);
    if (!valid) return;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < LV) {
            VT w;
            T* e = (T*)&w;
            #pragma unroll
            for (int u = 0; u < VW; ++u) {
                const int col = j * VW + u;
                C o = (v[i * VW + u] - mu) * rs;
                if (gamma) o *= gamma[col];
                if (beta) o += beta[col];
                e[u] = STORE(o);
            }
            ((VT*)(y + row * (long long)L))[j] = w;
        }
    }
    if (tid == 0) { mean_out[row] = mu; rstd_out[row] = rs; }
}

// dx per row, in two sweeps over the row (the second rereads x and dy, from L2 as a rule) so that a thread holds
// only its column sums of dy * xhat (ag) and dy (ab) over the rows its group visits. The RPB groups of a block add
// theirs in shared memory in a fixed order; the block writes them as row blockIdx.x of the partials.
// Of vector j of a row: xh = (x [+ res + bias] - mu) * rs, d = dy and g = dy * gamma.
__device__ __forceinline__ void xhat_and_g(const T* x, const T* res, const C* bias, const T* dy, const C* gamma,
                                           long long row, int j, C mu, C rs, C* xh, C* g, C* d) {
    load_vec(x, res, bias, row, j, xh);
    load_vec(dy, nullptr, nullptr, row, j, d);
    #pragma unroll
    for (int u = 0; u < VW; ++u) {
        xh[u] = (xh[u] - mu) * rs;
        g[u] = gamma ? d[u] * gamma[j * VW + u] : d[u];
    }
}

extern "C" __global__ void __launch_bounds__(TPR * RPB) ln_bwd(const T* dy, const T* x, const C* gamma,
                                                               const C* mean, const C* rstd, T* dx, C* pg, C* pb,
                                                               long long R, int want_params, const T* res,
                                                               const C* bias) {
    __shared__ C sh[RPB * NW];
#if RPB > 1
    __shared__ C colg[L], colb[L];
#endif
    const int tid = threadIdx.x % TPR, grp = threadIdx.x / TPR;
    C ag[ITEMS * VW], ab[ITEMS * VW];
    #pragma unroll
    for (int k = 0; k < ITEMS * VW; ++k) { ag[k] = 0; ab[k] = 0; }
    for (long long base = blockIdx.x; base * RPB < R; base += gridDim.x) {   // the same trip count block-wide
        const long long row = base * RPB + grp;
        const bool valid = row < R;
        const C mu = valid ? mean[row] : (C)0, rs = valid ? rstd[row] : (C)0;
        C s1 = 0, s2 = 0;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (valid && j < LV) {
                C xh[VW], g[VW], d[VW];
                xhat_and_g(x, res, bias, dy, gamma, row, j, mu, rs, xh, g, d);
                #pragma unroll
                for (int u = 0; u < VW; ++u) {
                    s1 += g[u]; s2 += g[u] * xh[u];
                    ag[i * VW + u] += d[u] * xh[u]; ab[i * VW + u] += d[u];
                }
            }
        }
        const C m1 = row_sum(s1, sh) / (C)L, m2 = row_sum(s2, sh) / (C)L;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (valid && j < LV) {
                C xh[VW], g[VW], d[VW];
                xhat_and_g(x, res, bias, dy, gamma, row, j, mu, rs, xh, g, d);
                VT w;
                T* e = (T*)&w;
                #pragma unroll
                for (int u = 0; u < VW; ++u) e[u] = STORE(rs * (g[u] - m1 - xh[u] * m2));
                ((VT*)(dx + row * (long long)L))[j] = w;
            }
        }
    }
    if (!want_params) return;
#if RPB > 1
    for (int q = 0; q < RPB; ++q) {      // group q adds its column sums, in order
        if (grp == q) {
            #pragma unroll
            for (int i = 0; i < ITEMS; ++i) {
                const int j = i * TPR + tid;
                if (j < LV) {
                    #pragma unroll
                    for (int u = 0; u < VW; ++u) {
                        const int col = j * VW + u;
                        colg[col] = (q == 0 ? (C)0 : colg[col]) + ag[i * VW + u];
                        colb[col] = (q == 0 ? (C)0 : colb[col]) + ab[i * VW + u];
                    }
                }
            }
        }
        __syncthreads();
    }
    for (int col = threadIdx.x; col < L; col += blockDim.x) {
        pg[(long long)blockIdx.x * L + col] = colg[col];
        pb[(long long)blockIdx.x * L + col] = colb[col];
    }
#else
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < LV) {
            #pragma unroll
            for (int u = 0; u < VW; ++u) {
                pg[(long long)blockIdx.x * L + j * VW + u] = ag[i * VW + u];
                pb[(long long)blockIdx.x * L + j * VW + u] = ab[i * VW + u];
            }
        }
    }
#endif
}

// dgamma, dbeta: the P partial rows added per column in a fixed order; a block of 32 columns x 8 row lanes.
extern "C" __global__ void ln_params(const C* pg, const C* pb, long long P, C* dgamma, C* dbeta) {
    __shared__ C s1[8][33], s2[8][33];
    const int cx = threadIdx.x % 32, ry = threadIdx.x / 32;
    const long long col = (long long)blockIdx.x * 32 + cx;
    C a = 0, b = 0;
    if (col < L)
        for (long long p = ry; p < P; p += 8) { a += pg[p * L + col]; b += pb[p * L + col]; }
    s1[ry][cx] = a; s2[ry][cx] = b;
    __syncthreads();
    if (ry == 0 && col < L) {
        C ta = 0, tb = 0;
        for (int k = 0; k < 8; ++k) { ta += s1[k][cx]; tb += s2[k][cx]; }
        dgamma[col] = ta; dbeta[col] = tb;
    }
}
"""

# (vector type, elements), preferred first; a row takes the first its length divides. The halves load 8 bytes
# (4 values): with 16-byte uint4 loads, splitting the vector into 16-bit values cost the forward a third of its
# bandwidth on an H100 (56% of copy against 84%, measured).
_VECTORS = {"half": (("uint2", 4), ("unsigned int", 2)), np.dtype(np.float32): (("float4", 4), ("float2", 2)),
            np.dtype(np.float64): (("double2", 2),)}
_modules: dict = {}
_sm: dict = {}


def _vector(dtype, length):
    """``(vector type, elements)`` for rows of ``length`` values of ``dtype``, or ``("T", 1)``."""
    dtype = np.dtype(dtype)
    for vt, vw in _VECTORS["half" if dtype.itemsize == 2 else dtype]:
        if length % vw == 0:
            return vt, vw
    return "T", 1


def launch_shape(length: int, dtype, direction: str = "forward") -> tuple[int, int, int, int] | None:
    """``(VW, TPR, RPB, ITEMS)`` for rows of ``length`` values of ``dtype``: elements per vector (16 bytes where
    the length allows, else 8 or 4 bytes, else 1), threads per row (the fewest, from a warp, that hold the row in at
    most :data:`MAX_VECTORS` vectors a thread forward, :data:`MAX_VALUES` values backward, where a thread also keeps
    its columns' sums), rows per block (256 threads a block at least) and vectors per thread;
    None where a row needs more than ``MAX_THREADS`` threads.

    >>> launch_shape(768, np.float32), launch_shape(20480, np.float32), launch_shape(5140, np.float32)
    ((4, 32, 8, 6), (4, 1024, 1, 5), (4, 256, 1, 6))
    """
    dtype = np.dtype(dtype)
    vw = _vector(dtype, length)[1]
    vectors = length // vw
    max_items = MAX_VECTORS if direction == "forward" else max(1, (16 if dtype == np.float64 else MAX_VALUES) // vw)
    tpr = 32
    while -(-vectors // tpr) > max_items:
        tpr *= 2
        if tpr > MAX_THREADS:
            return None
    return vw, tpr, max(1, 256 // tpr), -(-vectors // tpr)


def _module(dtype, length, direction="forward"):
    key = (dtype, length, direction)
    mod = _modules.get(key)
    if mod is None:
        vw, tpr, rpb, items = launch_shape(length, dtype, direction)
        vt = _vector(dtype, length)[0]
        head = (prelude(dtype) + f"#define L {length}\n#define VW {vw}\n#define VT {vt}\n#define TPR {tpr}\n"
                f"#define RPB {rpb}\n#define ITEMS {items}\n")
        mod = _modules[key] = cupy.RawModule(code=head + _SOURCE, options=("--std=c++14",))
    return mod


def kernel_attributes(dtype, length: int) -> dict:
    """``{kernel: (registers, local bytes)}`` of the compiled kernels for rows of ``length`` values of ``dtype``
    (local bytes above 0 would mean register spills).

    >>> kernel_attributes.__name__
    'kernel_attributes'
    """
    out = {}
    for name, direction in (("ln_fwd", "forward"), ("ln_bwd", "backward"), ("ln_params", "backward")):
        if launch_shape(int(length), dtype, direction) is None:
            continue
        f = _module(np.dtype(dtype), int(length), direction).get_function(name)
        out[name] = (f.num_regs, f.local_size_bytes)
    return out


def _sm_count(dev):
    sm = _sm.get(dev)
    if sm is None:
        sm = _sm[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
    return sm


def _rows(x, k):
    length = int(np.prod(x.shape[x.ndim - k:], dtype=np.int64))
    return x.size // max(length, 1), length


def supports(x, gamma, beta, k, eps, residual=None, bias=None) -> bool:
    """CuPy float16/bfloat16/float32/float64 ``x`` (C-contiguous, 16-byte aligned) normalised over its last ``k``
    axes, ``gamma``/``beta``/``bias`` None or C-contiguous arrays of those axes' shape in the compute type,
    ``residual`` None or like ``x``, rows short enough for :func:`launch_shape`."""
    if cupy is None or type(x) is not cupy.ndarray or x.dtype not in KERNEL_DTYPES or not x._c_contiguous:
        return False
    if not 1 <= k <= x.ndim or x.size == 0 or x.data.ptr % 16:
        return False
    if residual is not None and (type(residual) is not cupy.ndarray or residual.dtype != x.dtype
                                 or residual.shape != x.shape or not residual._c_contiguous
                                 or residual.data.ptr % 16):
        return False
    shape, cdt = x.shape[x.ndim - k:], compute_dtype(x.dtype)
    for p in (gamma, beta, bias):
        if p is not None and (type(p) is not cupy.ndarray or p.shape != shape or p.dtype != cdt
                              or not p._c_contiguous):
            return False
    rows, length = _rows(x, k)
    return length >= 2 and rows < 2**31 and launch_shape(length, x.dtype) is not None


def backward_fits(length: int, dtype) -> bool:
    """Whether the backward's per-thread column sums (two arrays of the row values a thread holds) fit in the
    registers a thread has at the block size (64K registers an SM, at most 255 a thread): else the composite runs.

    >>> backward_fits(768, np.float32), backward_fits(20480, np.float32)
    (True, False)
    """
    shape = launch_shape(length, dtype, "backward")
    if shape is None:
        return False
    vw, tpr, rpb, items = shape
    words = 2 if np.dtype(dtype) == np.float64 else 1
    return 2 * items * vw * words + 40 <= min(255, 65536 // (tpr * rpb))


def backward_supports(dy, x, gamma, mean, rstd, k, need_params=True, residual=None, bias=None):
    """The calls :func:`layernorm_backward` takes: ``dy`` like ``x`` (C-contiguous, aligned), as the forward, rows
    whose column sums fit in registers (:func:`backward_fits`)."""
    return (type(dy) is cupy.ndarray and dy.dtype == x.dtype and dy.shape == x.shape and dy._c_contiguous
            and dy.data.ptr % 16 == 0 and supports(x, gamma, None, k, 0.0, residual, bias)
            and backward_fits(_rows(x, k)[1], x.dtype))


def layernorm_forward(x, gamma, beta, k: int, eps: float, residual=None, bias=None):
    """``(y, mean, rstd)``: ``y`` of ``x``'s shape and dtype; ``mean``, ``rstd`` one per row in the compute type.
    With ``residual`` (like ``x``) and/or ``bias`` (the normalised shape, compute type) the rows normalised are
    those of ``x + residual + bias``, summed on the fly (the sum is never stored)."""
    rows, length = _rows(x, k)
    vw, tpr, rpb, items = launch_shape(length, x.dtype)
    cdt = compute_dtype(x.dtype)
    y = cupy.empty_like(x)
    stats = cupy.empty((2, rows), cdt)
    fn = _module(x.dtype, length).get_function("ln_fwd")
    null = np.uint64(0)
    fn((-(-rows // rpb),), (tpr * rpb,), (x, null if gamma is None else gamma, null if beta is None else beta, y,
                                          stats[0], stats[1], np.int64(rows), np.float64(eps),
                                          null if residual is None else residual, null if bias is None else bias))
    return y, stats[0], stats[1]


def layernorm_backward(dy, x, gamma, mean, rstd, k: int, need_params: bool = True, residual=None, bias=None):
    """``(dx, dgamma, dbeta)`` (the last two None without ``need_params``), from the forward's ``mean``/``rstd``;
    with ``residual``/``bias``, ``dx`` is the cotangent of the sum ``x + residual + bias`` (recomputed, not read)."""
    rows, length = _rows(x, k)
    vw, tpr, rpb, items = launch_shape(length, x.dtype, "backward")
    cdt = compute_dtype(x.dtype)
    mod = _module(x.dtype, length, "backward")
    groups = int(min(-(-rows // rpb), 2 * _sm_count(x.device.id)))
    dx = cupy.empty_like(x)
    partial_rows = groups
    parts = cupy.empty((2, partial_rows, length), cdt) if need_params else None
    null = np.uint64(0)
    mod.get_function("ln_bwd")((groups,), (tpr * rpb,), (
        dy, x, null if gamma is None else gamma, mean, rstd, dx, null if parts is None else parts[0],
        null if parts is None else parts[1], np.int64(rows), np.int32(need_params),
        null if residual is None else residual, null if bias is None else bias))
    if not need_params:
        return dx, None, None
    out = cupy.empty((2, length), cdt)
    mod.get_function("ln_params")((-(-length // 32),), (256,), (parts[0], parts[1], np.int64(partial_rows), out[0],
                                                                out[1]))
    shape = x.shape[x.ndim - k:]
    return dx, out[0].reshape(shape), out[1].reshape(shape)


KERNELS = {"layernorm_forward": (layernorm_forward, supports),
           "layernorm_backward": (layernorm_backward, backward_supports)}
