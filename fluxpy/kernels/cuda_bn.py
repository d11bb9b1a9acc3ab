"""fluxpy's own batch-norm kernels for NCHW and channels-last CuPy arrays: two launches each way, deterministic.

Training forward:

1. ``bn_stats``: a grid of ``(S, C)`` blocks; block ``(s, c)`` sums ``d = x - K`` and ``d * d`` over its
   rows ``n`` of channel ``c``, with 16-byte vectors where rows allow (``K`` = the channel's first element,
   so the shifted sums keep the variance accurate when the mean is large), reduces them in the block, and
   writes one partial. The last block
   of a channel to finish (an integer counter, reset by that block) adds the ``S`` partials in a fixed
   order, so the result does not depend on timing (no float atomics), and writes ``mean``, ``invstd``,
   the per-channel ``scale = gamma * invstd`` and ``bias = beta``, and moves the running statistics (the
   variance unbiased).
2. ``bn_apply``: ``y = (x - mean[c]) * scale[c] + bias[c]``, a block per (row, chunk): no division per element;
   written as PyTorch's is, so a value equal to its channel's mean (a constant channel) gives exactly ``beta``.

Backward: ``bn_bwd_stats`` sums ``dy`` and ``dy * (x - mean)`` the same way and its last block writes
``dbeta``, ``dgamma = invstd * sum(dy (x - mean))`` and the coefficients of ``dx = a[c] dy + b[c] x + k[c]``;
``bn_bwd_apply`` writes ``dx``.

A residual ``r`` (x's shape, dtype and layout; a residual block's shortcut) joins the normalised value before the
activation, ``y = act(PRE(x) + r)``: the apply kernel reads it, and the backward reads it again to recompute the
pre-activation, and its apply kernel writes ``dr = dy act'`` beside ``dx`` (the define ``FX_RES``).

An activation ``act`` (any scalar function the elementwise tracer compiles, None for none) is fused into both
directions: the apply kernel writes ``act((x - mean) * scale + bias)``, and the backward multiplies ``dy`` by
``act'`` at that pre-activation, recomputed from ``x`` (so neither it nor ``y`` is kept). Its formula and derivative
reach the source as the defines ``FX_ACT(v)`` and ``FX_ACT_GRAD(v)`` (:func:`fluxpy.kernels.trace.activation_c`): one
compiled variant per (dtype, activation). Accumulation is in float32 for float32 data, float64 for float64. float16 and
bfloat16 data are read and written in their own 16 bits (eight to a 16-byte vector) and computed in float32; their
statistics, ``gamma``, ``beta``, the running statistics and ``dgamma``/``dbeta`` are float32, as cuDNN's.

Channels-last data (:mod:`fluxpy.layout`) is an ``(M, C)`` matrix (``M = N * spatial``): ``bn_stats_cl`` and
``bn_bwd_stats_cl`` sum columns, each thread a 16-byte vector of adjacent channels of a row (a block per (row
split, chunk of about 32 channels), four rows in flight a thread, the lanes' sums and then the chunk's
partials added by trees in a fixed order); ``bn_apply_cl`` and ``bn_bwd_apply_cl`` run a grid-stride loop whose
stride is a whole number of rows, so each thread keeps its channels' coefficients in registers. ``y`` and ``dx``
keep ``x``'s layout.

>>> sorted(n for n in _NAMES if not n.endswith("_cl"))
['bn_apply', 'bn_bwd_apply', 'bn_bwd_stats', 'bn_stats']
>>> sorted(n for n in _NAMES if n.endswith("_cl"))
['bn_apply_cl', 'bn_bwd_apply_cl', 'bn_bwd_stats_cl', 'bn_stats_cl']
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import cupy
from ..journal import awaits, kept
from ..layout import is_channels_last, like_layout
from . import compiler
from .cuda_arrays import row_addresses
from .halfs import KERNEL_DTYPES, VECTORS, compute_dtype, dtype_defines
from .answers import answered
from .elementwise import fuses
from .trace import activation_c

__all__ = ["supports", "param_dtype", "forward_training", "backward", "SOURCE_VARIANTS"]

_NAMES = ("bn_stats", "bn_apply", "bn_bwd_stats", "bn_bwd_apply", "bn_stats_cl", "bn_apply_cl", "bn_bwd_stats_cl",
          "bn_bwd_apply_cl")
_THREADS = 256


def _identity(v):
    return v


_variants: dict = {}


def _defines(dtype, act=None, residual=False):
    """``cuda/batchnorm.cu``'s defines: the dtype's (halfs.cuh), its 16-byte vector (``VT`` of ``VW`` elements),
    the activation's formula and derivative (``act`` None: the identity) and whether a residual joins
    (``FX_RES``), kept per (dtype, activation, residual)."""
    def make():
        vt, vw = VECTORS[np.dtype(dtype)]
        f = _identity if act is None else act
        return {**dtype_defines(dtype), "VT": vt, "VW": vw, "FX_ACT(v)": activation_c(f, dtype, "v"),
                "FX_ACT_GRAD(v)": activation_c(f, dtype, "v", derivative=True), "FX_RES": int(residual)}
    return answered(_variants, (np.dtype(dtype), act, residual), make, kept=None)


def SOURCE_VARIANTS(activations=()):
    """``(source, defines)`` of the variants the kernels launch: every dtype without an activation and with the
    first of ``activations`` (the exported ones, which the kernel-source test gives), each with and without a
    residual; the other activations in float32 and float64 (the halves compute in float32), without one.

    >>> [(d["VW"], d["FX_RES"]) for _, d in SOURCE_VARIANTS()]
    [(8, 0), (8, 1), (8, 0), (8, 1), (4, 0), (4, 1), (2, 0), (2, 1)]
    """
    for dtype in KERNEL_DTYPES:
        yield "batchnorm.cu", _defines(dtype)
        yield "batchnorm.cu", _defines(dtype, None, True)
    for i, act in enumerate(activations):
        for dtype in KERNEL_DTYPES if i == 0 else (np.dtype(np.float32), np.dtype(np.float64)):
            yield "batchnorm.cu", _defines(dtype, act)
            if i == 0:
                yield "batchnorm.cu", _defines(dtype, act, True)


def _fn(name, dtype, act, residual):
    return compiler.function("batchnorm.cu", name, _defines(dtype, act, residual))


def supports(x, *params, act=None, residual=None) -> bool:
    """CuPy float16/bfloat16/float32/float64 arrays of 2 to 5 axes, C-contiguous or channels-last (then fewer than
    2**32 elements), with parameters (or None) in :func:`param_dtype` of ``x.dtype``, an activation (or None)
    that the elementwise tracer compiles, and a residual (or None) of ``x``'s shape, dtype and strides."""
    if act is not None and not fuses(act):
        return False
    if type(x) is not cupy.ndarray or x.dtype not in VECTORS or not 2 <= x.ndim <= 5:
        return False
    if not x._c_contiguous and not (is_channels_last(x) and x.size < 2**32):
        return False
    if residual is not None and (type(residual) is not cupy.ndarray or residual.dtype != x.dtype
                                 or residual.shape != x.shape or residual.strides != x.strides):
        return False
    pdt = param_dtype(x.dtype)
    return all(p is None or (type(p) is cupy.ndarray and p.dtype == pdt) for p in params)


def param_dtype(dtype) -> np.dtype:
    """The dtype of the scale, bias, running and saved statistics for data of ``dtype``: float32 for the halves
    (cuDNN's rule), the data's own otherwise.

    >>> param_dtype(np.float16), param_dtype(np.float64)
    (dtype('float32'), dtype('float64'))
    """
    return compute_dtype(dtype)


def _geometry(x):
    n, c = x.shape[0], x.shape[1]
    return n, c, x.size // (n * c)


def _sm_count(dev):
    return compiler.device(dev).processors


def _vec(hw, dtype, *arrays):
    """Whether rows can be read as vectors: whole vectors per row, 16-byte aligned inputs (CuPy allocates
    outputs aligned)."""
    return int(hw % VECTORS[dtype][1] == 0 and all(a.data.ptr % 16 == 0 for a in arrays))


def _reduce_launch(n, c, hw, vec, dtype, dev):
    """``(S, threads, vec)``: row splits per channel (about four blocks per SM in all), the block size, and
    whether rows are read as vectors (rows of at least 64 vectors; shorter rows are read flat)."""
    s = int(max(1, min(n, -(-4 * _sm_count(dev) // c), 1024)))
    s = -(-n // -(-n // s))   # every block gets at least one row
    width = hw // VECTORS[dtype][1]
    if not vec or width < 64:
        return s, 256, 0
    return s, (256 if width >= 256 else 1 << (width - 1).bit_length()), 1


def _apply_launch(n, c, hw, vec, dtype, dev):
    """``(grid, block, flat, total)``: a block per row chunk for rows of 256 vectors or more, else a flat
    grid-stride loop (32-bit indices, so only below 2**32 items)."""
    vw = VECTORS[dtype][1]
    width = hw // vw if vec else hw
    total = n * c * hw // vw if vec else n * c * hw
    if width < 256 and total < 2**32:
        return (min(-(-total // 256), 32 * _sm_count(dev)),), (256,), 1, total
    chunks = max(1, min(-(-width // 1024), 65535))
    return (n * c, chunks), (256,), 0, 0


def _column_launch(m, c, vw, dev):
    """``(grid, block, CV, S)`` of the channels-last statistics kernels: each thread sums ``vw`` adjacent channels,
    CV (a power of two) such columns a block, chunks of ``CV * vw`` channels (about 32: narrow chunks mean more
    blocks of fewer rows each, so the last block of a chunk has few partials to add), S row splits per chunk
    (about two blocks per SM in all, each lane with eight rows or more: a block's fixed cost, its reductions and
    its partial, is then spread over enough loads, and more, shorter blocks measured slower; each split whole
    passes of four rows a lane, as the kernel rounds it)."""
    groups = -(-c // vw)
    cv = min(max(1, 32 // vw), 1 << (groups - 1).bit_length())
    chunks = -(-groups // cv)
    lanes = _THREADS // cv
    per_block = max(-(-m * chunks // (2 * _sm_count(dev))), 8 * lanes)
    per_block = -(-per_block // (4 * lanes)) * (4 * lanes)
    s = max(1, min(-(-m // per_block), 1024))
    return (s, chunks), (_THREADS,), cv, s


def _apply_grid(total, c, width, dev):
    """Blocks of the channels-last apply kernels: about 32 a SM (fewer for small arrays: each thread four items or
    more, so that loading its channels' coefficients, up to five arrays' worth, is paid over several), a multiple
    of ``c / gcd(c, threads * width)`` so the grid's stride is a whole number of rows (each thread meets the same
    channels at every step)."""
    unit = c // math.gcd(c, _THREADS * width)
    want = max(1, min(-(-total // (_THREADS * 4)), 32 * _sm_count(dev)))
    return unit * max(1, want // unit)


class _ChannelsLastPlan:
    """:class:`_Plan` for channels-last data: the statistics kernels read ``x`` as an ``(M, C)`` matrix."""
    __slots__ = ("stats", "apply", "bwd_stats", "bwd_apply", "red", "app", "scalars", "app_scalars", "part",
                 "counter", "c", "pdt")

    def __init__(self, shape, dtype, vec, dev, act, res):
        c = shape[1]
        self.pdt = param_dtype(dtype)
        m = int(np.prod(shape, dtype=np.int64)) // c
        vw = VECTORS[dtype][1]
        grid, block, cv, s = _column_launch(m, c, vw, dev)
        self.stats, self.apply = _fn("bn_stats_cl", dtype, act, False), _fn("bn_apply_cl", dtype, act, res)
        self.bwd_stats = _fn("bn_bwd_stats_cl", dtype, act, res)
        self.bwd_apply = _fn("bn_bwd_apply_cl", dtype, act, res)
        self.red = (grid, block)
        width = vw if vec else 1
        total = m * c // width
        self.app = ((_apply_grid(total, c, width, dev),), (_THREADS,))
        self.c = c
        self.scalars = (np.int64(m), np.int64(c), np.int32(s), np.int32(cv), np.int32(vec))
        self.app_scalars = (np.int64(c), np.int32(vec), np.int64(total))
        part = cupy.empty((2, grid[1] * cv * vw * s), param_dtype(dtype))
        self.part = (part[0], part[1])
        self.counter = cupy.zeros(grid[1], dtype=cupy.int32)   # left at zero by the kernels


class _Plan:
    """Everything about one problem that does not change from call to call: the kernels, the launch shapes,
    the scalar arguments, the scratch buffers (partials, counters) and the statistics' dtype, kept per (shape,
    dtype, alignment, device, stream, layout, activation, residual) so a call only allocates its outputs and
    launches."""
    __slots__ = ("stats", "apply", "bwd_stats", "bwd_apply", "red", "app", "scalars", "app_scalars", "part",
                 "counter", "c", "pdt")

    def __init__(self, shape, dtype, vec, dev, act, res):
        n, c = shape[0], shape[1]
        self.pdt = param_dtype(dtype)
        hw = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
        s, threads, row_vec = _reduce_launch(n, c, hw, vec, dtype, dev)
        self.stats, self.apply = _fn("bn_stats", dtype, act, False), _fn("bn_apply", dtype, act, res)
        self.bwd_stats, self.bwd_apply = _fn("bn_bwd_stats", dtype, act, res), _fn("bn_bwd_apply", dtype, act, res)
        self.red = ((s, c), (threads,))
        grid, block, flat, total = _apply_launch(n, c, hw, vec, dtype, dev)
        self.app = (grid, block)
        self.c = c
        self.scalars = (np.int64(n), np.int64(c), np.int64(hw), np.int32(s), np.int32(row_vec))
        self.app_scalars = (np.int64(c), np.int64(hw), np.int32(vec), np.int32(flat), np.uint32(total))
        part = cupy.empty((2, c * s), param_dtype(dtype))
        self.part = (part[0], part[1])
        self.counter = cupy.zeros(c, dtype=cupy.int32)   # left at zero by the kernels


_plans: dict = {}


def _plan(act, res, x, *others):
    n, c, hw = _geometry(x)
    cl = not x._c_contiguous
    # channels-last data is read a row (C values) at a time: whole vectors a row, aligned
    vec = _vec(c if cl else hw, x.dtype, x, *others)
    dev = x.device.id
    key = (x.shape, x.dtype, vec, dev, cupy.cuda.get_current_stream().ptr, cl, act, res)
    return answered(_plans, key, lambda: (_ChannelsLastPlan if cl else _Plan)(x.shape, x.dtype, vec, dev, act, res),
                    kept=None)


_NULL = np.uint64(0)


def _p(a):
    return _NULL if a is None else a


def _output_like(x):
    """A new array of ``x``'s shape, dtype and layout (``empty`` for C order: the same array, less host time)."""
    return cupy.empty(x.shape, x.dtype) if x._c_contiguous else cupy.empty_like(x)


def forward_training(x, gamma, beta, running_mean, running_var, momentum: float, eps: float, act=None,
                     residual=None):
    """``(y, mean, invstd)`` in two launches (``y = act(bn(x) + residual)``, the activation ``act`` and the
    ``residual`` None for none); the running statistics (or None) are moved in place, their old values kept for a
    step's journal where it waits for them (:func:`fluxpy.journal.awaits`)."""
    res = residual is not None
    p = _plan(act, res, x, *((residual,) if res else ()))
    y = _output_like(x)
    keep = awaits(running_mean, running_var)
    # mean, invstd, scale, bias and, for the journal, the running mean and variance before this call
    stats = cupy.empty((6 if keep else 4, p.c), p.pdt)
    mean, invstd, scale, bias, *old = row_addresses(stats)
    p.stats(*p.red, (x, *p.scalars, *p.part, p.counter, _p(gamma), _p(beta), mean, invstd, scale, bias,
                     _p(running_mean), _p(running_var), old[0] if keep else _NULL, np.float64(momentum),
                     np.float64(eps)))
    p.apply(*p.app, (x, y, mean, scale, bias, *p.app_scalars, _p(residual)))
    if keep:
        kept(stats[4:], running_mean, running_var)
    return y, stats[0], stats[1]


def backward(dy, x, gamma, beta, mean, invstd, eps: float, act=None, residual=None):
    """``(dx, dgamma, dbeta)`` in two launches; with an activation ``act``, ``dy`` is first multiplied by its
    derivative at the forward's pre-activation (recomputed from ``x`` and the ``residual``, so ``y`` is not
    needed). With a residual, ``(dx, dgamma, dbeta, dresidual)``, ``dresidual = dy act'``."""
    dy = like_layout(dy, x)
    res = residual is not None
    p = _plan(act, res, x, dy, *((residual,) if res else ()))
    dx = _output_like(x)
    dr = _output_like(x) if res else None
    # dgamma, dbeta, the coefficients a, b, k of dx, the forward's scale, bias
    out = cupy.empty((7, p.c), p.pdt)
    dgamma, dbeta, a, b, k, sc, sf = row_addresses(out)
    p.bwd_stats(*p.red, (dy, x, mean, invstd, _p(gamma), _p(beta), *p.scalars, *p.part, p.counter, dgamma, dbeta,
                         a, b, k, sc, sf, _p(residual)))
    p.bwd_apply(*p.app, (dy, x, dx, a, b, k, *p.app_scalars, sc, sf, mean, _p(residual), _p(dr)))
    return (dx, out[0], out[1]) if dr is None else (dx, out[0], out[1], dr)
