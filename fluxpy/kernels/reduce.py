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
and stored through ``cuda/halfs.cuh`` (no CUDA headers are needed at run time), and read
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
import re
from typing import Any

import numpy as np

from ..backend import Array, cupy
from ..layout import is_channels_last, like_layout
from .cuda_arrays import c_contiguous
from . import compiler
from .halfs import KERNEL_DTYPES, compute_dtype, dtype_defines, is_half

__all__ = ["mapreduce", "unbroadcast_sum", "canonical_form", "plan", "AVAILABLE", "unavailable_reason", "KERNELS",
           "SOURCE_VARIANTS", "variants"]

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

# ---------------------------------------------------------------------------------------------
# CUDA source: cuda/reduce.cu. One module per (storage type, accumulator, op, map, has_y, has_outm); each holds both
# kernels for every vector width V (1, 2, 4, 8 elements), so a module compiles once.


_STORAGE = frozenset(KERNEL_DTYPES)   # what the kernels store (halfs.cuh defines T, C, LOAD, STORE)
_ACC = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def _vec_widths(dtype):
    return [v for v in (1, 2, 4, 8) if v * dtype.itemsize <= 16]


_CALL = re.compile(r"\b[A-Za-z_]\w*\(|/")   # a maths function or a division (a subroutine) in a map expression
_LONG_MAP = 8   # statements (";") beyond which a map is taken to need more registers


def _min_blocks(dtype, acc, has_y, has_outm, map_expr=None):
    """The blocks an SM must hold (``__launch_bounds__``): the plan's :data:`BLOCKS_PER_SM`, fewer where a block's
    threads need more registers than that leaves them (an accumulator other than the dtype's own; a map that calls
    a maths function or divides, or is long, as some activations' derivatives; halves read with ``y`` and written to the
    mapped output, sixteen bytes at a time), so that none spills (``tests/test_kernel_sources.py`` checks)."""
    calls = map_expr is not None and (_CALL.search(map_expr) is not None or map_expr.count(";") > _LONG_MAP)
    if calls and acc == np.float64:   # double maths (erf, expm1) holds many registers
        return 1
    if acc != compute_dtype(dtype) or calls:
        return min(BLOCKS_PER_SM, 2)
    if is_half(dtype) and has_y and has_outm:
        return min(BLOCKS_PER_SM, 3)
    return BLOCKS_PER_SM


def _defines(dtype, acc, op, map_expr, has_y, has_outm=False):
    """``cuda/reduce.cu``'s defines for one storage dtype, accumulator, op, map expression (in ``x`` and ``y``;
    None: ``x``) and whether ``y`` and the mapped output are given."""
    return {**dtype_defines(dtype), "ACC": _ACC[acc], "OP_MAX": op == "max", "OP_MEAN": op == "mean",
            "HAS_Y": bool(has_y), "HAS_OUTM": bool(has_outm), "MAP(x, y)": f"({map_expr or 'x'})",
            "THREADS": THREADS, "MIN_BLOCKS": _min_blocks(dtype, acc, has_y, has_outm, map_expr)}


def variants(map_expr: str | None = None, has_y: bool = False, ops: tuple = ("sum",), accs: tuple | None = None):
    """``(source, defines)`` of :func:`mapreduce`'s variants for one map expression: each storage dtype, op of
    ``ops`` and accumulator of ``accs`` (default: the dtype's own, as ``acc_dtype=None`` gives), with and without
    the mapped output. A module that passes a ``map`` yields these from its own ``SOURCE_VARIANTS``.

    >>> len(list(variants("x * (y > 0)", True)))
    8
    """
    for dtype in KERNEL_DTYPES:
        for acc in accs or (np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32),):
            for op in ops:
                for has_outm in (False, True):
                    yield "reduce.cu", _defines(dtype, acc, op, map_expr, has_y, has_outm)


def SOURCE_VARIANTS():
    """``(source, defines)`` of :func:`mapreduce`'s variants without a map (the sums behind ``unbroadcast``): every
    storage dtype, op and accumulator (the maps are yielded by the modules that pass them: :func:`variants`).

    >>> len(list(SOURCE_VARIANTS()))
    48
    """
    yield from variants(None, False, _OPS, tuple(_ACC))


def _function(dtype, acc, op, map_expr, has_y, has_outm, kernel):
    return compiler.function("reduce.cu", kernel, _defines(dtype, acc, op, map_expr, has_y, has_outm))


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


def _sm_count(dev):
    return compiler.device(dev).processors


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
        key = (x.shape, axes, x.dtype, op, map_expr, has_y, acc_dtype, keepdims, dev, BLOCKS_PER_SM, MIN_BLOCK_BYTES,
               has_m)
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
    fn = _function(dtype, acc, op, map_expr, has_y, has_m, f"{p['kernel']}_v{p['V']}")
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
