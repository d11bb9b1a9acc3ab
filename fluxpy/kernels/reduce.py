"""A deterministic mapreducedim CUDA kernel for CuPy arrays: :func:`mapreduce`.

``mapreduce(x, axes, op="sum", map=None, y=None)`` computes ``op`` over ``axes`` of
``map(x, y)`` (``map`` a small C expression, applied on the fly) in one pass over memory. It is
the kernel behind :func:`fluxpy.unbroadcast` on CuPy arrays (see :mod:`fluxpy.kernels.gpu`).

**Canonical form.** Adjacent axes of the same kind (reduced / kept) are merged and size-1 axes
dropped, so the input becomes ``(R_outer, K, R_inner)``: kept axes ``K`` contiguous in the
middle. This covers full reductions (``K = 1``), leading-axis (column) reductions such as
``(8192, 4096)`` over 0 (``R_inner = 1``), trailing (row) reductions (``R_outer = 1``) and NCHW
bias gradients over ``(0, 2, 3)``. Two kernels cover it:

- ``R_inner == 1`` (*column* kernel): a block is ``TX x TY`` threads; ``TX`` threads read
  ``TX * V`` adjacent columns with ``V``-wide (up to 16-byte) vector loads, the ``TY`` thread rows
  walk rows, ``UNROLL`` (4) rows in flight per thread; the ``R_outer`` rows are split over ``S`` blocks.
- ``R_inner > 1`` (*segment* kernel): each kept index ``k`` owns ``R_outer`` runs of ``R_inner``
  contiguous elements; a group of ``G`` threads (1 to 256) reads them with vector loads, ``UNROLL``
  loads in flight per thread, and is split over ``S`` blocks when there are few ``k`` (a bias
  gradient over 16 channels still fills every multiprocessor).

Within a block, partial results combine in a fixed tree (warp shuffles, then shared memory).
When ``S > 1`` each block writes its partial to a workspace and bumps an integer counter; the
last block of a column group (last-block-done) combines the ``S`` partials **in a fixed order**.
There are no floating-point atomics, so a given GPU gives the same bits on every run (the split
``S`` depends on the multiprocessor count, so a different GPU model may round differently).

Patterns with kept axes on both sides of a reduced one (``(A, B, C)`` over axis 1) are brought to
the column form by a transposed contiguous copy (``cuda_arrays.c_contiguous``), which costs one
extra read and write; non-contiguous inputs are copied to C order first.

Accumulation is in float32 for float16/bfloat16/float32 input and float64 for float64 input, or as
``acc_dtype`` says; the result has ``x.dtype``, rounded once from the accumulator. Both halves are loaded
and stored through :func:`fluxpy.kernels.halfs.prelude` (no CUDA headers are needed at run time), and read
with the same 16-byte vectors as float32 (eight halves a load).

The module imports without CuPy; :data:`AVAILABLE` says whether the kernel can run.

>>> canonical_form((128, 16, 28, 28), (0, 2, 3))
(128, 16, 784)
>>> canonical_form((8192, 4096), (0,))
(8192, 4096, 1)
>>> canonical_form((4, 5, 6), (0, 1, 2))
(1, 1, 120)
>>> import numpy as np
>>> x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
>>> expect = x.sum(axis=(0, 2))
>>> got = expect
>>> if unavailable_reason() is None:   # only where a GPU is usable
...     import cupy
...     got = mapreduce(cupy.asarray(x), (0, 2)).get()
>>> np.array_equal(got, expect)
True
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import Array, cupy
from ..layout import is_channels_last, like_layout
from .cuda_arrays import c_contiguous
from .halfs import KERNEL_DTYPES, prelude

__all__ = ["mapreduce", "unbroadcast_sum", "canonical_form", "plan", "AVAILABLE", "unavailable_reason", "KERNELS"]

AVAILABLE = cupy is not None
"""True when CuPy imported (a GPU may still be missing; see :func:`fluxpy.gpu_available`)."""


def unavailable_reason() -> str | None:
    """Why :func:`mapreduce` cannot run here, or ``None`` if it can.

    >>> r = unavailable_reason()
    >>> r is None or isinstance(r, str)
    True
    """
    from ..backend import gpu_available
    ok, why = gpu_available()
    return None if ok else f"fluxpy.kernels.reduce is unavailable: {why}"


_OPS = ("sum", "mean", "max")
THREADS = 256                 # threads per block, both kernels
BLOCKS_PER_SM = 4             # blocks per multiprocessor in the one wave a split reduction launches
MIN_BLOCK_BYTES = 16384       # do not split the work below this many input bytes per block
UNROLL = 4                    # independent vector loads in flight per thread
CACHE = 0                     # load flavour: 0 plain, 1 streaming (__ldcs), 2 read-only (__ldg)

# ---------------------------------------------------------------------------------------------
# CUDA source. One module per (storage type, accumulator, op, map, has_y); each holds both
# kernels for every vector width V (1, 2, 4, 8 elements), so a module compiles once.

_SOURCE = r"""
#define T_STORE T
#define ACC %(ACC)s
#define OP_MAX %(OP_MAX)d
#define OP_MEAN %(OP_MEAN)d
#define HAS_Y %(HAS_Y)d
#define HAS_OUTM %(HAS_OUTM)d
#define MAP(x, y) (%(MAP)s)
#define UNROLL %(UNROLL)d
#define CACHE %(CACHE)d

__device__ __forceinline__ ACC to_acc(T_STORE v) { return (ACC)LOAD(v); }
__device__ __forceinline__ T_STORE from_acc(ACC a) { return STORE((C)a); }

#if OP_MAX
#define IDENT ((ACC)__int_as_float(0xff800000))
/* NaN-propagating max: a NaN in either operand wins. */
__device__ __forceinline__ ACC combine(ACC a, ACC b) { return (a > b || a != a) ? a : b; }
#else
#define IDENT ((ACC)0)
__device__ __forceinline__ ACC combine(ACC a, ACC b) { return a + b; }
#endif

__device__ __forceinline__ ACC finalize(ACC a, long long count) {
#if OP_MEAN
    return a / (ACC)count;
#else
    return a;
#endif
}

__device__ __forceinline__ ACC mapped(T_STORE xv, T_STORE yv) {
    ACC x = to_acc(xv);
#if HAS_Y
    ACC y = to_acc(yv);
#else
    ACC y = x;
#endif
    (void)y;
    return (ACC)MAP(x, y);
}

__device__ __forceinline__ long long lmin(long long a, long long b) { return a < b ? a : b; }

template <int V> struct alignas(sizeof(T_STORE) * V) Vec { T_STORE v[V]; };

/* Vector load; CACHE 1 = streaming (__ldcs, evict-first), 2 = read-only path (__ldg), 0 = plain. */
template <int B> struct Raw;
template <> struct Raw<2> { typedef unsigned short Bits; };
template <> struct Raw<4> { typedef unsigned int Bits; };
template <> struct Raw<8> { typedef uint2 Bits; };
template <> struct Raw<16> { typedef uint4 Bits; };
template <int V>
__device__ __forceinline__ Vec<V> loadv(const Vec<V>* p) {
#if CACHE == 0
    return *p;
#else
    typedef typename Raw<sizeof(Vec<V>)>::Bits R;
#if CACHE == 1
    R r = __ldcs((const R*)p);
#else
    R r = __ldg((const R*)p);
#endif
    Vec<V> v;
    memcpy(&v, &r, sizeof(v));
    return v;
#endif
}

/* Combine a value over the G threads of a group (G a power of two, 1..256); the result is valid in
   the group's first thread. Called by every thread of the block. Fixed tree: deterministic. */
__device__ __forceinline__ ACC group_reduce(ACC a, int G, ACC* sm) {
    int tid = threadIdx.x;
    int w = G < 32 ? G : 32;
    for (int off = w >> 1; off > 0; off >>= 1) a = combine(a, __shfl_down_sync(0xffffffffu, a, off, w));
    if (G > 32) {
        __syncthreads();
        if ((tid & 31) == 0) sm[tid >> 5] = a;
        __syncthreads();
        if ((tid & (G - 1)) == 0) {
            int w0 = tid >> 5;
            a = sm[w0];
            for (int i = 1; i < (G >> 5); ++i) a = combine(a, sm[w0 + i]);
        }
    }
    return a;
}

/* (R_outer, K, R_inner) with R_inner > 1. Group of G threads per kept index k; blockIdx.y = split s of
   the P = R_outer * I4 vector items of k into chunks of `chunk` items. I4 = R_inner / V. */
template <int V>
__device__ __forceinline__ void segments(const T_STORE* __restrict__ x, const T_STORE* __restrict__ y,
        T_STORE* __restrict__ out, T_STORE* __restrict__ outm, ACC* partials, unsigned int* counters,
        long long K, long long I4, long long KI4, long long P, long long chunk, int S, int G, long long count) {
    typedef Vec<V> VT;
    __shared__ ACC sm[%(THREADS)d / 32];
    __shared__ int amlast;
    const int tid = threadIdx.x;
    const int g = tid & (G - 1);
    const long long k = (long long)blockIdx.x * (%(THREADS)d / G) + tid / G;
    const bool active = k < K;
    const int s = blockIdx.y;
    ACC acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = IDENT;
    if (active) {
        long long j0 = (long long)s * chunk + g;
        long long j1 = lmin((long long)s * chunk + chunk, P);
        if (j0 < j1) {
            long long n = (j1 - j0 + G - 1) / G;
            long long o = j0 / I4, v = j0 - o * I4;
            const long long dq = G / I4, dr = G - dq * I4;
            const VT* xb = (const VT*)x + k * I4;
            const VT* yb = (const VT*)y + k * I4;
            VT* mb = (VT*)outm + k * I4;
            (void)mb;
            long long t = 0;
            for (; t + UNROLL <= n; t += UNROLL) {
                long long off[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    off[u] = o * KI4 + v;
                    v += dr; o += dq;
                    if (v >= I4) { v -= I4; ++o; }
                }
                VT a[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) a[u] = loadv<V>(xb + off[u]);
#if HAS_Y
                VT b[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) b[u] = loadv<V>(yb + off[u]);
#else
                VT* b = a;
#endif
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    VT m;
#pragma unroll
                    for (int e = 0; e < V; ++e) {
                        ACC mv = mapped(a[u].v[e], b[u].v[e]);
                        m.v[e] = from_acc(mv);
                        acc[e] = combine(acc[e], mv);
                    }
#if HAS_OUTM
                    mb[off[u]] = m;
#endif
                }
            }
            for (; t < n; ++t) {
                long long off = o * KI4 + v;
                v += dr; o += dq;
                if (v >= I4) { v -= I4; ++o; }
                VT a = loadv<V>(xb + off);
#if HAS_Y
                VT b = loadv<V>(yb + off);
#else
                VT b = a;
#endif
                VT m;
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    ACC mv = mapped(a.v[e], b.v[e]);
                    m.v[e] = from_acc(mv);
                    acc[e] = combine(acc[e], mv);
                }
#if HAS_OUTM
                mb[off] = m;
#endif
            }
        }
    }
    ACC r = acc[0];
#pragma unroll
    for (int e = 1; e < V; ++e) r = combine(r, acc[e]);
    r = group_reduce(r, G, sm);
    if (S == 1) {
        if (g == 0 && active) out[k] = from_acc(finalize(r, count));
        return;
    }
    if (g == 0 && active) { partials[k * S + s] = r; __threadfence(); }
    __syncthreads();
    if (tid == 0) amlast = (atomicAdd(&counters[blockIdx.x], 1u) == (unsigned int)(S - 1));
    __syncthreads();
    if (!amlast) return;
    __threadfence();
    r = IDENT;
    if (active) {
        const volatile ACC* p = partials + k * S;
        for (int i = g; i < S; i += G) r = combine(r, p[i]);
    }
    r = group_reduce(r, G, sm);
    if (g == 0 && active) out[k] = from_acc(finalize(r, count));
    if (tid == 0) counters[blockIdx.x] = 0u;
}

/* (R_outer, K) column reduction (R_inner == 1). Block = TX x TY threads, TX*V columns per block,
   blockIdx.y = split s of the rows into chunks of R rows. KV = K / V. */
template <int V>
__device__ __forceinline__ void columns(const T_STORE* __restrict__ x, const T_STORE* __restrict__ y,
        T_STORE* __restrict__ out, T_STORE* __restrict__ outm, ACC* partials, unsigned int* counters,
        long long O, long long K, long long R, int S, int TX, long long count) {
    typedef Vec<V> VT;
    __shared__ ACC sm[%(THREADS)d * V];
    __shared__ int amlast;
    const int tid = threadIdx.x;
    const int TY = %(THREADS)d / TX;
    const int tx = tid & (TX - 1), ty = tid / TX;
    const long long KV = K / V;
    const long long cv = (long long)blockIdx.x * TX + tx;
    const bool active = cv < KV;
    const int s = blockIdx.y;
    ACC acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = IDENT;
    if (active) {
        const VT* xv = (const VT*)x + cv;
        const VT* yv = (const VT*)y + cv;
        VT* mv_ = (VT*)outm + cv;
        (void)mv_;
        long long r = (long long)s * R + ty;
        const long long r1 = lmin((long long)s * R + R, O);
        for (; r + (UNROLL - 1) * TY < r1; r += UNROLL * TY) {
            VT a[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) a[u] = loadv<V>(xv + (r + u * TY) * KV);
#if HAS_Y
            VT b[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) b[u] = loadv<V>(yv + (r + u * TY) * KV);
#else
            VT* b = a;
#endif
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                VT m;
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    ACC mv = mapped(a[u].v[e], b[u].v[e]);
                    m.v[e] = from_acc(mv);
                    acc[e] = combine(acc[e], mv);
                }
#if HAS_OUTM
                mv_[(r + u * TY) * KV] = m;
#endif
            }
        }
        for (; r < r1; r += TY) {
            VT a = loadv<V>(xv + r * KV);
#if HAS_Y
            VT b = loadv<V>(yv + r * KV);
#else
            VT b = a;
#endif
            VT m;
#pragma unroll
            for (int e = 0; e < V; ++e) {
                ACC mv = mapped(a.v[e], b.v[e]);
                m.v[e] = from_acc(mv);
                acc[e] = combine(acc[e], mv);
            }
#if HAS_OUTM
            mv_[r * KV] = m;
#endif
        }
    }
    const int W = TX * V;   /* columns of this block */
    for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
        for (int e = 0; e < V; ++e) sm[ty * W + tx * V + e] = acc[e];
        __syncthreads();
        for (int st = TY >> 1; st > 0; st >>= 1) {
            if (ty < st) {
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    int i = ty * W + tx * V + e;
                    sm[i] = combine(sm[i], sm[i + st * W]);
                }
            }
            __syncthreads();
        }
        if (pass == 1 || S == 1) {
            if (ty == 0 && active) {
#pragma unroll
                for (int e = 0; e < V; ++e) out[cv * V + e] = from_acc(finalize(sm[tx * V + e], count));
            }
            if (pass == 1 && tid == 0) counters[blockIdx.x] = 0u;
            return;
        }
        if (ty == 0 && active) {
#pragma unroll
            for (int e = 0; e < V; ++e) partials[(long long)s * K + cv * V + e] = sm[tx * V + e];
            __threadfence();
        }
        __syncthreads();
        if (tid == 0) amlast = (atomicAdd(&counters[blockIdx.x], 1u) == (unsigned int)(S - 1));
        __syncthreads();
        if (!amlast) return;
        __threadfence();
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = IDENT;
        if (active) {
            const volatile ACC* p = partials + cv * V;
            for (int i = ty; i < S; i += TY) {
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] = combine(acc[e], p[(long long)i * K + e]);
            }
        }
    }
}

#define INSTANCE(V) \
extern "C" __global__ void __launch_bounds__(%(THREADS)d) segments_v##V( \
        const T_STORE* x, const T_STORE* y, T_STORE* out, T_STORE* outm, ACC* partials, unsigned int* counters, \
        long long K, long long I4, long long KI4, long long P, long long chunk, int S, int G, long long count) { \
    segments<V>(x, y, out, outm, partials, counters, K, I4, KI4, P, chunk, S, G, count); } \
extern "C" __global__ void __launch_bounds__(%(THREADS)d) columns_v##V( \
        const T_STORE* x, const T_STORE* y, T_STORE* out, T_STORE* outm, ACC* partials, unsigned int* counters, \
        long long O, long long K, long long R, int S, int TX, long long count) { \
    columns<V>(x, y, out, outm, partials, counters, O, K, R, S, TX, count); }

%(INSTANCES)s
"""

_STORAGE = frozenset(KERNEL_DTYPES)   # what the kernels store (halfs.prelude defines T, C, LOAD, STORE)
_ACC = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_modules = {}


def _vec_widths(dtype):
    return [v for v in (1, 2, 4, 8) if v * dtype.itemsize <= 16]


def _module(dtype, acc, op, map_expr, has_y, has_outm=False):
    key = (dtype, acc, op, map_expr, has_y, has_outm, UNROLL, CACHE)
    mod = _modules.get(key)
    if mod is None:
        src = prelude(dtype) + _SOURCE % dict(ACC=_ACC[acc],
                             OP_MAX=int(op == "max"), OP_MEAN=int(op == "mean"), HAS_Y=int(has_y),
                             HAS_OUTM=int(has_outm),
                             MAP=map_expr or "x", THREADS=THREADS, UNROLL=UNROLL, CACHE=CACHE,
                             INSTANCES="\n".join(f"INSTANCE({v})" for v in _vec_widths(dtype)))
        mod = cupy.RawModule(code=src)
        _modules[key] = mod
    return mod


# ---------------------------------------------------------------------------------------------
# Shapes


def _normalize_axes(axes, ndim):
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, (int, np.integer)):
        axes = (axes,)
    out = set()
    for a in axes:
        a = int(a)
        if not -ndim <= a < ndim:
            raise ValueError(f"mapreduce: axis {a} is out of range for an array of {ndim} dimensions")
        out.add(a % ndim)
    return tuple(sorted(out))


def _runs(shape, axes):
    """Merge adjacent axes of one kind, dropping size-1 axes: a list of ``[reduced?, size]``."""
    runs = []
    red = set(axes)
    for i, n in enumerate(shape):
        if n == 1:
            continue
        r = i in red
        if runs and runs[-1][0] == r:
            runs[-1][1] *= n
        else:
            runs.append([r, n])
    return runs


def canonical_form(shape: tuple[int, ...], axes: int | tuple[int, ...] | None) -> tuple[int, int, int] | None:
    """``(R_outer, K, R_inner)`` for reducing ``shape`` over ``axes``, or ``None`` if kept axes are split.

    Size-1 axes are dropped and adjacent axes of one kind merged. A full reduction is
    ``(1, 1, N)``; a reduction over nothing is ``(1, N, 1)``.

    >>> canonical_form((256, 64, 56, 56), (0, 2, 3))
    (256, 64, 3136)
    >>> canonical_form((4096, 8192), (1,))
    (1, 4096, 8192)
    >>> canonical_form((3, 1, 5), (1,))
    (1, 15, 1)
    >>> canonical_form((2, 3, 4), (1,)) is None
    True
    """
    runs = _runs(tuple(shape), _normalize_axes(axes, len(shape)))
    kept = [i for i, (r, _) in enumerate(runs) if not r]
    if len(kept) > 1:
        return None
    if not kept:
        return (1, 1, math.prod(n for _, n in runs))
    i = kept[0]
    outer = math.prod(n for _, n in runs[:i])
    inner = math.prod(n for _, n in runs[i + 1:])
    return (outer, runs[i][1], inner)


def _pick_vec(dtype, length, arrays):
    for v in reversed(_vec_widths(dtype)):
        if length % v == 0 and all(a.data.ptr % (v * dtype.itemsize) == 0 for a in arrays):
            return v
    return 1


_sm_counts = {}


def _sm_count(dev):
    n = _sm_counts.get(dev)
    if n is None:
        n = _sm_counts[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
    return n


def _pow2_floor(n):
    return 1 << (max(1, int(n)).bit_length() - 1)


def plan(shape: tuple[int, ...], axes: int | tuple[int, ...] | None, dtype: Any = np.float32, vec: int | None = None,
         sm_count: int = 132) -> dict:
    """The launch a reduction of ``shape`` over ``axes`` gets: a dict (kernel, grid, block, split...).

    Pure Python (no GPU needed); :func:`mapreduce` uses it with the real vector width and
    multiprocessor count. ``vec`` defaults to the widest 16-byte vector the contiguous length allows.

    >>> p = plan((128, 16, 28, 28), (0, 2, 3))
    >>> p["kernel"], p["V"], p["G"], p["grid"]
    ('segments', 4, 256, (16, 24))
    >>> p = plan((8192, 4096), 0)
    >>> p["kernel"], p["V"], p["TX"], p["grid"]
    ('columns', 4, 32, (32, 16))
    >>> plan((2, 3, 4), 1)["transpose"]
    (1, 0, 2)
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    axes = _normalize_axes(axes, len(shape))
    canon = canonical_form(shape, axes)
    transpose = None
    if canon is None:   # kept axes on both sides of a reduced one: reduced axes first, then kept
        kept = tuple(i for i in range(len(shape)) if i not in axes)
        transpose = axes + kept
        canon = (math.prod(shape[i] for i in axes), math.prod(shape[i] for i in kept), 1)
    O, K, I = canon
    target = BLOCKS_PER_SM * sm_count
    nbytes = O * K * I * dtype.itemsize
    if I == 1:
        return _columns_plan(O, K, I, vec or _pick_vec_len(dtype, K), target, nbytes, transpose)
    return _segments_plan(O, K, I, vec or _pick_vec_len(dtype, I), target, nbytes, transpose)


def _columns_plan(O, K, I, V, target, nbytes, transpose):
    """The launch of the ``columns`` kernel (``R_inner == 1``): ``TX`` threads across ``K / V`` vector
    columns, the ``O`` rows split over ``S`` blocks of ``R`` rows."""
    KV = K // V
    TX = min(32, 1 << max(0, (KV - 1).bit_length()))
    TY = THREADS // TX
    bx = -(-KV // TX)
    S = min(target // bx, nbytes // bx // MIN_BLOCK_BYTES, -(-O // TY))
    S = max(1, S)
    R = -(-O // S)
    S = -(-O // R)
    return dict(kernel="columns", V=V, TX=TX, grid=(bx, S), S=S, R=R, O=O, K=K, I=I, transpose=transpose,
                count=O, partials=S * K if S > 1 else 0, counters=bx if S > 1 else 0)


def _segments_plan(O, K, I, V, target, nbytes, transpose):
    """The launch of the ``segments`` kernel (``R_inner > 1``): ``G`` threads per kept index, its
    ``O * I / V`` vector items split over ``S`` blocks in chunks."""
    I4 = I // V
    P = O * I4
    # threads per kept index: at most a quarter of its vector items, and no more than one wave of
    # BLOCKS_PER_SM blocks per SM needs for all K at once (many rows: a warp per row, one wave)
    g_work = min(THREADS, _pow2_floor(max(1, P // 4)))
    g_par = _pow2_floor(max(1, target * THREADS // K))
    G = min(g_work, max(g_par, 8))
    bx = -(-K // (THREADS // G))
    S = min(target // bx, nbytes // bx // MIN_BLOCK_BYTES, -(-P // G))
    S = max(1, S)
    chunk = -(-P // S)
    S = -(-P // chunk)
    return dict(kernel="segments", V=V, G=G, grid=(bx, S), S=S, chunk=chunk, O=O, K=K, I=I, I4=I4, P=P,
                transpose=transpose, count=O * I, partials=S * K if S > 1 else 0, counters=bx if S > 1 else 0)


def _pick_vec_len(dtype, length):
    for v in reversed(_vec_widths(dtype)):
        if length % v == 0:
            return v
    return 1


# ---------------------------------------------------------------------------------------------
# Workspace: partial results and last-block-done counters, per (device, stream). Counters are
# zeroed once and every last block resets its own, so they are zero between launches.

_workspaces = {}


def _workspace(dev, partial_bytes, n_counters):
    stream = cupy.cuda.get_current_stream().ptr
    key = (dev, stream)
    ws = _workspaces.get(key)
    if ws is None or ws[0].nbytes < partial_bytes or ws[1].size < n_counters:
        old_p, old_c = (ws[0].nbytes, ws[1].size) if ws is not None else (0, 0)
        p = cupy.empty(max(partial_bytes, old_p, 1 << 16), dtype=np.uint8)
        c = cupy.zeros(max(n_counters, old_c, 1024), dtype=np.uint32)
        ws = _workspaces[key] = (p, c)
    return ws


def mapreduce(x: Array, axes: int | tuple[int, ...] | None = None, op: str = "sum", map: str | None = None,
              y: Array | None = None, acc_dtype: Any = None, keepdims: bool = False, out: Array | None = None,
              out_mapped: Array | None = None) -> Array:
    """``op`` (a sum, mean or max) over ``axes`` of ``map(x, y)``, in one deterministic pass over memory.

    ``out[k] = op_{i in axes} map(x[i, k], y[i, k])``, with ``map`` computed elementwise on the fly.

    - ``x``: a CuPy array of float16, bfloat16, float32 or float64 (any shape, any strides; non-contiguous
      input is copied to C order first).
    - ``axes``: an int, a tuple of ints (negative allowed) or ``None`` for all axes.
    - ``op``: ``"sum"``, ``"mean"`` or ``"max"`` (max propagates NaN, as NumPy's does).
    - ``map``: a C expression over ``x`` and ``y``, both in the accumulator type, e.g.
      ``"x * x"`` or ``"x * (y > 0)"`` (ReLU backward from ``dy = x`` and the output ``y``). It is
      compiled into the kernel: pass trusted code only. ``None`` means ``"x"``.
    - ``y``: an optional second array of ``x``'s shape (cast to ``x.dtype`` if it differs).
    - ``acc_dtype``: float32 (default for the halves and float32) or float64 (default for float64).
    - ``keepdims``: keep reduced axes as size 1. ``out``: write into this C-contiguous array of
      the result's shape and ``x.dtype`` (each element is written exactly once).
    - ``out_mapped``: also write ``map(x, y)`` (rounded to ``x.dtype``) into this C-contiguous array
      of ``x``'s shape and dtype, in the same pass (e.g. the ReLU ``dx`` while summing the bias
      gradient). Not available for reductions that need a transposed copy (kept axes on both
      sides of a reduced one: ``canonical_form`` is None); that is a ``ValueError``.

    Returns an array of ``x.dtype``. The same inputs give the same bits on every run.

    >>> import numpy as np
    >>> a = np.random.default_rng(0).standard_normal((64, 3, 5, 5)).astype(np.float32)
    >>> dy, expect = a, (a * (a > 0)).sum(axis=(0, 2, 3), dtype=np.float64)
    >>> got = expect
    >>> if unavailable_reason() is None:   # only where a GPU is usable
    ...     import cupy
    ...     ga = cupy.asarray(a)
    ...     got = mapreduce(ga, (0, 2, 3), map="x * (y > 0)", y=ga).get()
    >>> bool(np.allclose(got, expect, rtol=1e-5))
    True
    """
    if cupy is None:
        raise RuntimeError("fluxpy.kernels.reduce.mapreduce needs CuPy, which could not be imported")
    if x.size and is_channels_last(x):
        return _channels_last_mapreduce(x, axes, op, map, y, acc_dtype, keepdims, out, out_mapped)
    has_y = y is not None
    has_m = out_mapped is not None
    _check_operands(x, y, out_mapped)
    if x.size == 0:
        ax = _normalize_axes(axes, x.ndim)
        return _empty_case(x, ax, op, _out_shape(x.shape, ax, keepdims), out)
    dev = x.device.id
    dtype, oshape, launch, shape, ax, acc = _call_entry(x, axes, op, map, has_y, acc_dtype, keepdims, dev, has_m)
    fn, grid, scalars, transpose, V, ws = launch
    x, y = _kernel_inputs(x, y, dtype, transpose, has_m, axes)
    if V > 1 and _misaligned(V * dtype.itemsize, x, y, out_mapped):
        fn, grid, scalars, transpose, V, ws = _make_launch(shape, ax, dtype, acc, op, map, has_y, dev,
                                                           [a for a in (x, y, out_mapped) if a is not None], has_m)
    res = _result_array(out, oshape, dtype)
    if ws is not None:
        part, cnt = _workspace(dev, *ws)
    else:
        part = cnt = res   # not touched by the kernel when the reduction is not split
    fn(grid, (THREADS,), (x, x if y is None else y, res, out_mapped if has_m else res, part, cnt) + scalars)
    return res


def _channels_last_mapreduce(x, axes, op, map_expr, y, acc_dtype, keepdims, out, out_mapped):
    """:func:`mapreduce` of a channels-last ``x`` on its ``(N, *spatial, C)`` view, which is C-contiguous: no copy.
    ``y`` is read in ``x``'s layout; ``out_mapped`` must be channels-last too."""
    nd = x.ndim
    order = (0, *range(2, nd), 1)
    back = (0, nd - 1, *range(1, nd - 1))
    ax = _normalize_axes(axes, nd)
    if out_mapped is not None and not is_channels_last(out_mapped):
        raise ValueError(f"mapreduce: out_mapped must be channels-last like x (shape {x.shape}), got strides "
                         f"{out_mapped.strides}")
    res = mapreduce(x.transpose(order), tuple(sorted(order.index(a) for a in ax)), op, map_expr,
                    None if y is None else like_layout(y, x).transpose(order), acc_dtype, keepdims=True,
                    out_mapped=None if out_mapped is None else out_mapped.transpose(order))
    res = res.transpose(back).reshape(_out_shape(x.shape, ax, keepdims))
    if out is None:
        return res
    _result_array(out, res.shape, res.dtype)[...] = res
    return out


def _check_operands(x, y, out_mapped):
    """Raise unless ``y`` (if given) has ``x``'s shape and ``out_mapped`` (if given) is C-contiguous like ``x``."""
    if y is not None and y.shape != x.shape:
        raise ValueError(f"mapreduce: y must have x's shape {x.shape}, got {y.shape}")
    if out_mapped is not None and (out_mapped.shape != x.shape or out_mapped.dtype != x.dtype
                                   or not out_mapped.flags.c_contiguous):
        raise ValueError(f"mapreduce: out_mapped must be a C-contiguous {x.dtype} array of shape {x.shape}, "
                         f"got {out_mapped.dtype} {out_mapped.shape}")


def _call_entry(x, axes, op, map_expr, has_y, acc_dtype, keepdims, dev, has_m):
    """The prepared launch of this call signature: everything but the pointers, cached in ``_calls``."""
    try:
        key = (x.shape, axes, x.dtype, op, map_expr, has_y, acc_dtype, keepdims, dev, UNROLL, CACHE, BLOCKS_PER_SM,
               MIN_BLOCK_BYTES, has_m)
        entry = _calls.get(key)
    except TypeError:   # unhashable axes (a list)
        key, entry = None, None
    if entry is None:
        entry = _prepare(x.shape, x.dtype, axes, op, map_expr, has_y, acc_dtype, keepdims, dev, has_m)
        if key is not None:
            _calls[key] = entry
    return entry


def _kernel_inputs(x, y, dtype, transpose, has_m, axes):
    """``x`` and ``y`` as the kernels read them: ``y`` in ``x``'s dtype, both C-contiguous, transposed
    (reduced axes first) where the launch says so."""
    if y is not None and y.dtype != dtype:
        y = y.astype(dtype)
    if transpose is not None:
        if has_m:
            raise ValueError(f"mapreduce: out_mapped is not supported for reducing shape {x.shape} over {axes} "
                             "(kept axes on both sides of a reduced one)")
        x = c_contiguous(x.transpose(transpose))
        y = None if y is None else c_contiguous(y.transpose(transpose))
    else:
        x = c_contiguous(x)
        y = None if y is None else c_contiguous(y)
    return x, y


def _misaligned(vec_bytes, x, y, out_mapped):
    """True when the data of ``x``, ``y`` or ``out_mapped`` (where given) does not start on a ``vec_bytes``
    boundary, which the vector loads need."""
    return bool(x.data.ptr % vec_bytes or (y is not None and y.data.ptr % vec_bytes)
                or (out_mapped is not None and out_mapped.data.ptr % vec_bytes))


def _result_array(out, oshape, dtype):
    """A new result array, or ``out`` once checked to fit."""
    if out is None:
        return cupy.empty(oshape, dtype=dtype)
    if out.shape != oshape or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"mapreduce: out must be a C-contiguous {dtype} array of shape {oshape}, "
                         f"got {out.dtype} {out.shape}")
    return out

_calls = {}


def _out_shape(shape, ax, keepdims):
    if keepdims:
        return tuple(1 if i in ax else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in ax)


def _prepare(shape, dtype, axes, op, map_expr, has_y, acc_dtype, keepdims, dev, has_m=False):
    """Validate one call signature and build its launch (cached by :func:`mapreduce`)."""
    if op not in _OPS:
        raise ValueError(f"mapreduce: op must be one of {_OPS}, got {op!r}")
    dtype = np.dtype(dtype)
    if dtype not in _STORAGE:
        raise TypeError(f"mapreduce: x must be float16, bfloat16, float32 or float64, got {dtype}")
    acc = np.dtype(acc_dtype) if acc_dtype is not None else (np.dtype(np.float64) if dtype == np.float64
                                                             else np.dtype(np.float32))
    if acc not in _ACC:
        raise TypeError(f"mapreduce: acc_dtype must be float32 or float64, got {acc}")
    ax = _normalize_axes(axes, len(shape))
    launch = _make_launch(shape, ax, dtype, acc, op, map_expr, has_y, dev, None, has_m)
    return dtype, _out_shape(shape, ax, keepdims), launch, shape, ax, acc


def _make_launch(shape, ax, dtype, acc, op, map_expr, has_y, dev, arrays=None, has_m=False):
    """(function, grid, scalar arguments, transpose, V, workspace sizes) for one reduction."""
    sm = _sm_count(dev)
    p = plan(shape, ax, dtype, sm_count=sm)
    if arrays is not None:   # misaligned pointers: the widest vector they allow
        p = plan(shape, ax, dtype, vec=_pick_vec(dtype, p["K"] if p["kernel"] == "columns" else p["I"], arrays),
                 sm_count=sm)
    fn = _module(dtype, acc, op, map_expr, has_y, has_m).get_function(f"{p['kernel']}_v{p['V']}")
    i64, i32 = np.int64, np.int32
    if p["kernel"] == "columns":
        scalars = (i64(p["O"]), i64(p["K"]), i64(p["R"]), i32(p["S"]), i32(p["TX"]), i64(p["count"]))
    else:
        scalars = (i64(p["K"]), i64(p["I4"]), i64(p["K"] * p["I4"]), i64(p["P"]), i64(p["chunk"]), i32(p["S"]),
                   i32(p["G"]), i64(p["count"]))
    ws = (p["partials"] * acc.itemsize, p["counters"]) if p["S"] > 1 else None
    return fn, p["grid"], scalars, p["transpose"], p["V"], ws


def _empty_case(x, ax, op, oshape, out):
    """NumPy's answers for empty input: sum 0, mean NaN, max an error if a reduced axis is empty."""
    if op == "max" and any(x.shape[i] == 0 for i in ax):
        raise ValueError("mapreduce: max over a zero-size axis has no identity")
    val = 0.0 if op == "sum" else float("nan")
    res = out if out is not None else cupy.empty(oshape, dtype=x.dtype)
    res.fill(val)
    return res


def unbroadcast_sum(grad: Array, axes: tuple[int, ...], shape: tuple[int, ...]) -> Array:
    """``grad`` summed over ``axes``, as ``shape``: the ``sum`` kernel for CuPy arrays, behind
    :func:`fluxpy.unbroadcast` and :func:`fluxpy.sum`.

    >>> import numpy as np
    >>> g = np.ones((4, 3, 2), dtype=np.float32)
    >>> got = g.sum(axis=(0, 2)).reshape(3, 1)
    >>> if unavailable_reason() is None:
    ...     import cupy
    ...     got = unbroadcast_sum(cupy.asarray(g), (0, 2), (3, 1)).get()
    >>> got.ravel().tolist()
    [8.0, 8.0, 8.0]
    """
    return mapreduce(grad, axes, "sum").reshape(shape)


def sum_supports(x: Any, *_: Any) -> bool:
    """The arrays the ``sum`` kernel takes: CuPy, floating, at least 1-d."""
    return type(x) is cupy.ndarray and x.ndim > 0 and x.dtype in _STORAGE


# name -> (kernel, supports): what fluxpy.kernels.gpu registers for CuPy arrays
KERNELS = {"sum": (unbroadcast_sum, sum_supports)}
