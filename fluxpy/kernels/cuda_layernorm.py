"""Layer norm on the GPU: one read and one write of ``x`` forward, one pass for ``dx`` backward, deterministic.

The rows of ``x`` (``(R, L)``: the normalised trailing axes flattened into ``L``; a strided or offset ``x``, ``dy``
or residual is copied C-contiguous first, :func:`_readable`) are normalised one row per group of threads that hold
the row in registers: ``x`` is read once, the mean and then the variance summed from the registers (two exact
passes), ``y`` written once. The backward sweeps each row once where its values fit the registers, keeping the
column sums of ``dgamma``/``dbeta`` in registers, in shared memory, or across a cluster of blocks a row; the
longest rows take the split backward (``dx`` alone, then the column sums apart). Every sum runs in a fixed order,
so results depend on the shape (and for the backward's partial rows the GPU's SM count), never on timing.

The CUDA is in ``cuda/layernorm*.cu`` (one kernel family a file); which kernel runs, in what shape, is
:mod:`fluxpy.kernels.layernorm_plan`'s choice (plain Python). This module turns a plan into a source and its
defines (:func:`forward_source`, :func:`backward_source`, :func:`params_source`), compiles them through
:mod:`fluxpy.kernels.compiler` (where ptxas decides between forms, the first it does not spill) and launches.
:func:`SOURCE_VARIANTS` lists every variant that can launch, for the CI's NVRTC compile.

Statistics (``mean``, ``rstd``) are float32 (float64 for float64 data); ``gamma``/``beta`` are in the compute type.

>>> sorted(KERNELS)
['layernorm_backward', 'layernorm_forward']
>>> name, defines = forward_source(layernorm_plan.forward_plan(768, np.float16), 768, np.float16)
>>> name, defines["TPR"], defines["ITEMS"], defines["PREFETCH"]
('layernorm_forward.cu', 64, 3, 1)
"""
from __future__ import annotations

import ctypes
import math

import numpy as np

from ..backend import cupy
from . import compiler, layernorm_plan
from .answers import answered, kind
from .cuda_arrays import c_contiguous, row_addresses
from .halfs import BFLOAT16, KERNEL_DTYPES, compute_dtype, dtype_defines
from .layernorm_plan import (SM90, BackwardPlan, ForwardPlan, Limits, backward_plan, backward_shared_bytes,
                             blocks_an_sm, column_plan, column_vector, forward_forms, forward_plan, fused_fits,
                             staged_bytes, two_block_forms, vector)

__all__ = ["layernorm_forward", "layernorm_backward", "supports", "backward_supports", "backward_shape",
           "backward_fits", "kernel_attributes", "forward_source", "backward_source", "params_source",
           "SOURCE_VARIANTS", "KERNELS"]

_SOURCES = {"ln_bwd1": "layernorm_backward.cu", "ln_bwds": "layernorm_backward.cu",
            "ln_bwdr": "layernorm_backward.cu", "ln_dx1": "layernorm_backward.cu",
            "ln_bwd": "layernorm_two_sweep.cu", "ln_dx2": "layernorm_two_sweep.cu", "ln_bwdc": "layernorm_cluster.cu"}
# Where a kernel keeps its column sums (layernorm_columns.cuh): 0 none, 1 registers, 2 shared memory.
_SUMS = {"ln_bwd1": 1, "ln_bwd": 1, "ln_bwds": 2, "ln_bwdr": 2, "ln_bwdc": 2, "ln_dx1": 0, "ln_dx2": 0}
_COMPUTE_VECTORS = {(4, 4): "float4", (4, 2): "float2", (8, 2): "double2"}   # (compute item size, VW): CVT


def _row_defines(length, dtype, plan, fused) -> dict:
    """The defines layernorm.cuh reads: the dtype, the row, its vectors and how threads hold it."""
    defines = dict(dtype_defines(dtype), L=int(length), VW=plan.vw, VT=vector(dtype, length)[0], TPR=plan.tpr,
                   RPB=plan.rpb, ITEMS=plan.items, FUSED=int(bool(fused)), BLOCKS=plan.blocks)
    cvt = _COMPUTE_VECTORS.get((compute_dtype(dtype).itemsize, plan.vw))
    if cvt:
        defines["CVT"] = cvt
    return defines


def forward_source(plan: ForwardPlan, length: int, dtype, fused: bool = False) -> tuple[str, dict]:
    """``(source name, defines)`` of ``ln_fwd`` in ``plan``'s form.

    >>> forward_source(layernorm_plan.forward_plan(32768, np.float16), 32768, np.float16)[1]["STAGES"]
    1
    """
    return "layernorm_forward.cu", dict(_row_defines(length, dtype, plan, fused), PREFETCH=int(plan.prefetch),
                                        STAGES=plan.stages)


def backward_source(plan: BackwardPlan, length: int, dtype, fused: bool = False) -> tuple[str, dict]:
    """``(source name, defines)`` of ``plan``'s backward kernel.

    >>> backward_source(layernorm_plan.backward_plan(32768, np.float16), 32768, np.float16)[1]["CLUSTER"]
    4
    """
    defines = dict(_row_defines(length, dtype, plan, fused), SUMS=_SUMS[plan.kernel],
                   HOLD=int(plan.kernel in ("ln_bwds", "ln_bwdc")))
    if plan.kernel == "ln_bwdc":
        defines["CLUSTER"] = plan.cluster
    elif plan.kernel in ("ln_bwd1", "ln_bwds", "ln_bwdr", "ln_dx1"):
        defines["PREFETCH"] = int(plan.prefetch)
    return _SOURCES[plan.kernel], defines


def params_source(length: int, dtype, fused: bool = False, split: bool = False) -> tuple[str, dict]:
    """``(source name, defines)`` of ``ln_params`` (and with ``split``, of ``ln_cols`` too).

    >>> sorted(params_source(20484, np.float16, split=True)[1])
    ['CW', 'FUSED', 'FX_DTYPE', 'KVT', 'KVW', 'L']
    """
    defines = dict(dtype_defines(dtype), L=int(length))
    if split:
        kvt, kvw = column_vector(dtype, length)
        defines.update(KVW=kvw, KVT=kvt, CW=layernorm_plan.COLUMN_WARPS, FUSED=int(bool(fused)))
    return "layernorm_params.cu", defines


def _first_unspilled_forward(plan, length, dtype, fused, limits, attributes) -> ForwardPlan:
    """The first of :func:`~fluxpy.kernels.layernorm_plan.forward_forms` that ptxas compiles without spilling
    (``attributes(name, defines, kernel)`` gives ``(registers, local bytes, static shared bytes)``); the last form
    whatever ptxas did."""
    forms = forward_forms(plan, length, dtype, fused, limits)
    for form in forms[:-1]:
        if attributes(*forward_source(form, length, dtype, fused), "ln_fwd")[1] == 0:
            return form
    return forms[-1]


def _two_block_backward(plan, length, dtype, fused, attributes) -> BackwardPlan:
    """``plan``, or where it is ``ln_bwd1`` holding fewer than two rows an SM as compiled and
    :data:`~fluxpy.kernels.layernorm_plan.BACKWARD_TWO_BLOCKS` allows it, the first of its two-block forms that
    ptxas compiles without spilling and an SM holds two of (the register estimate turns these down: ptxas decides)."""
    if (plan is None or plan.kernel != "ln_bwd1"
            or not layernorm_plan.BACKWARD_TWO_BLOCKS[np.dtype(dtype).itemsize]):
        return plan
    regs, _, shared = attributes(*backward_source(plan, length, dtype, fused), plan.kernel)
    if plan.rpb * blocks_an_sm(plan.threads, regs, shared) >= 2:
        return plan
    for form in two_block_forms(plan, length):
        regs, local, shared = attributes(*backward_source(form, length, dtype, fused), form.kernel)
        if local == 0 and blocks_an_sm(form.tpr, regs, shared) >= 2:
            return form
    return plan


# The row lengths SOURCE_VARIANTS samples, by dtype: every vector width, each kernel family and the boundaries
# between them, and the lengths where ptxas once spilled (bfloat16 shares float16's shapes: fewer of its own).
_SAMPLED_LENGTHS = {
    np.dtype(np.float16): (2, 3, 768, 1280, 5140, 8448, 12288, 16388, 18432, 20480, 20484, 24576, 28672, 32768),
    BFLOAT16: (770, 5140, 16896, 26624, 32764),
    np.dtype(np.float32): (7, 640, 1000, 4096, 5140, 9728, 10236, 12288, 16380, 20480, 20484, 24576, 32768),
    np.dtype(np.float64): (7, 768, 5140, 10236, 12288, 12800, 16384)}


def SOURCE_VARIANTS(attributes=None):
    """``(source name, defines)`` of every layer-norm kernel variant that can launch on sm_90, over a sample of the
    row lengths, dtypes and fused forms the ops take (:func:`_lengths_to_compile`), each pair once.

    Where ptxas decides between forms (the forward's, ``ln_bwd1``'s two-block forms), ``attributes(name, defines,
    kernel) -> (registers, local bytes, static shared bytes)`` (from a compile) resolves them as the GPU does, so a
    form the GPU skips for spilling is not yielded; a spill check must pass it. Without it, each plan's first form
    (some of which spill and never launch: the staged forward of the longest rows, for one).

    >>> variants = list(SOURCE_VARIANTS())
    >>> len(variants) == len({(n, tuple(sorted(d.items()))) for n, d in variants})
    True
    >>> sorted({name for name, _ in variants})[:2]
    ['layernorm_backward.cu', 'layernorm_cluster.cu']
    """
    seen = set()
    for dtype, lengths in _SAMPLED_LENGTHS.items():
        for length in lengths:
            for fused in (False, True):
                if forward_plan(length, dtype) is None or (fused and not fused_fits(length, dtype)):
                    continue
                for pair in _variants_of(length, dtype, fused, attributes):
                    key = (pair[0], tuple(sorted(pair[1].items())))
                    if key not in seen:
                        seen.add(key)
                        yield pair


def _variants_of(length, dtype, fused, attributes):
    """The sources that run for rows of ``length`` values of ``dtype`` on sm_90 (:func:`SOURCE_VARIANTS`)."""
    fwd = forward_plan(length, dtype, fused, SM90)
    if attributes is not None:
        fwd = _first_unspilled_forward(fwd, length, dtype, fused, SM90, attributes)
    yield forward_source(fwd, length, dtype, fused)
    plan = backward_plan(length, dtype, fused, SM90)
    if plan is not None:
        if attributes is not None:
            plan = _two_block_backward(plan, length, dtype, fused, attributes)
        yield backward_source(plan, length, dtype, fused)
        yield params_source(length, dtype, fused, plan.splits)


# ---- the GPU: limits, compiled kernels, launches ----

_state: dict = {}
_forward_kernels: dict = {}
_backward_kernels: dict = {}
_occupancy: dict = {}


def _on_gpu() -> bool:
    """Whether a GPU is there to compile for (asked once a process; without one plans are still asked for)."""
    found = _state.get("on_gpu")
    if found is None:
        try:
            found = cupy is not None and cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            found = False
        _state["on_gpu"] = found
    return found


def limits() -> Limits:
    """The current GPU's :class:`~fluxpy.kernels.layernorm_plan.Limits` (sm_90's where there is none).

    >>> limits().shared_per_block >= 48 * 1024
    True
    """
    if not _on_gpu():
        return SM90
    dev = compiler.device()
    found = _state.get(("limits", dev.id))
    if found is None:
        found = _state[("limits", dev.id)] = Limits(dev.shared_per_block, dev.compute_capability >= 90)
    return found


def _function(name, defines, kernel):
    return compiler.module(name, defines).get_function(kernel)


def _compiled_attributes(name, defines, kernel):
    """``(registers, local bytes, static shared bytes)`` of ``kernel`` compiled for the current GPU."""
    fn = _function(name, defines, kernel)
    return fn.num_regs, fn.local_size_bytes, fn.shared_size_bytes


def _kernel_key(dtype, length, fused):
    """What a compiled plan is cached under: the rows, the GPU and the planner's switches."""
    dtype = np.dtype(dtype)
    return dtype, int(length), bool(fused), cupy.cuda.runtime.getDevice(), layernorm_plan.tuning(dtype)


def _forward_kernel(dtype, length, fused=False):
    """``(ln_fwd, plan)``: the forward compiled in the first of its forms ptxas does not spill (cached)."""
    key = _kernel_key(dtype, length, fused)
    got = _forward_kernels.get(key)
    if got is None:
        dtype, lim = np.dtype(dtype), limits()
        plan = _first_unspilled_forward(forward_plan(length, dtype, fused, lim), length, dtype, fused, lim,
                                        _compiled_attributes)
        got = _forward_kernels[key] = (_function(*forward_source(plan, length, dtype, fused), "ln_fwd"), plan)
    return got


def _backward_kernels_of(dtype, length, fused=False):
    """``(plan, dx kernel, ln_cols or None, ln_params)``: the backward that runs on this GPU (cached)."""
    key = _kernel_key(dtype, length, fused)
    got = _backward_kernels.get(key)
    if got is None:
        dtype = np.dtype(dtype)
        plan = _two_block_backward(backward_plan(length, dtype, fused, limits()), length, dtype, fused,
                                   _compiled_attributes)
        if plan is None:
            return None
        params = params_source(length, dtype, fused, plan.splits)
        got = _backward_kernels[key] = (plan, _function(*backward_source(plan, length, dtype, fused), plan.kernel),
                                        _function(*params, "ln_cols") if plan.splits else None,
                                        _function(*params, "ln_params"))
    return got


def backward_shape(length: int, dtype, fused: bool = False) -> BackwardPlan | None:
    """The :class:`~fluxpy.kernels.layernorm_plan.BackwardPlan` :func:`layernorm_backward` runs for rows of
    ``length`` values of ``dtype`` on this GPU: the planner's, or on a GPU one of ``ln_bwd1``'s two-block forms where
    ptxas fits one; None where the composite runs.

    >>> backward_shape(768, np.float16).kernel, backward_shape(32768, np.float32).kernel
    ('ln_bwd1', 'ln_bwdc')
    """
    if not _on_gpu():
        return backward_plan(length, dtype, fused, SM90)
    got = _backward_kernels_of(dtype, length, fused)
    return None if got is None else got[0]


def backward_fits(length: int, dtype) -> bool:
    """Whether a backward kernel takes rows of ``length`` values of ``dtype`` on this GPU (else the composite).

    >>> backward_fits(32768, np.float16), backward_fits(20480, np.float64)
    (True, False)
    """
    dtype, lim = np.dtype(dtype), limits()
    key = ("fits", dtype, int(length), lim, layernorm_plan.tuning(dtype))   # asked on every backward call: cached
    found = _state.get(key)
    if found is None:
        found = _state[key] = backward_plan(length, dtype, False, lim) is not None
    return found


def kernel_attributes(dtype, length: int, fused: bool = False) -> dict:
    """``{kernel: (registers, local bytes)}`` of the compiled kernels that run for rows of ``length`` values of
    ``dtype`` (``ln_fwd``; the backward's kernel, ``ln_cols`` for the split backward, ``ln_params``); local bytes
    above 0 are register spills. Empty where the kernels turn the rows down. Needs a GPU."""
    dtype, length = np.dtype(dtype), int(length)
    if fused and not fused_fits(length, dtype):
        return {}
    if layernorm_plan.row_shape(length, dtype) is None:   # the composite runs these rows
        return {}
    kernels = [("ln_fwd", _forward_kernel(dtype, length, fused)[0])]
    got = _backward_kernels_of(dtype, length, fused)
    if got is not None:
        plan, fn, cols, params = got
        kernels += [(plan.kernel, fn)] + ([("ln_cols", cols)] if cols is not None else []) + [("ln_params", params)]
    return {name: (f.num_regs, f.local_size_bytes) for name, f in kernels}


def _blocks_per_sm(key, fn, threads, dynamic_shared=0):
    """Blocks of ``threads`` threads of ``fn`` an SM holds at once (cached under ``key``)."""
    n = _occupancy.get(key)
    if n is None:
        shared = int(getattr(fn, "shared_size_bytes", 0) or 0) + dynamic_shared
        n = _occupancy[key] = blocks_an_sm(threads, fn.num_regs, shared)
    return n


CLUSTER_QUERY: dict = {}
"""The last ``cuOccupancyMaxActiveClusters`` call's outcome (``"status"``: its CUresult, or the error that kept it
from being made): the GPU tests read it."""


def _active_clusters(fn, cs, threads, shared, key):
    """Clusters of ``cs`` blocks of ``fn`` the GPU runs at once (cached under ``key``): ``ln_bwdc`` gives each
    cluster a fixed share of the rows, so a cluster left to a second wave would double the time; where the driver
    cannot say, half the SMs' worth (one wave whatever the GPCs' sizes)."""
    n = _occupancy.get(("clusters",) + key)
    if n is None:
        n = _driver_active_clusters(fn, cs, threads, shared)
        if n is None or n < 1:
            n = max(1, compiler.device().processors // (2 * cs))
        _occupancy[("clusters",) + key] = n
    return n


class _LaunchConfig(ctypes.Structure):   # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


def _driver_active_clusters(fn, cs, threads, shared):
    """``cuOccupancyMaxActiveClusters`` for ``fn`` (the compiler module has no cluster query: asked here)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int(0)
        config = _LaunchConfig((ctypes.c_uint * 3)(cs, 1, 1), (ctypes.c_uint * 3)(threads, 1, 1), shared, None,
                               None, 0)
        function = ctypes.c_void_p(fn.kernel.ptr)   # RawKernel.kernel: its cupy.cuda.Function (the CUfunction)
        status = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), function, ctypes.byref(config))
    except (OSError, AttributeError) as e:
        CLUSTER_QUERY["status"] = repr(e)
        return None
    CLUSTER_QUERY["status"] = int(status)   # a CUresult: 0 is success
    return n.value if status == 0 else None


def _rows(x, k):
    length = math.prod(x.shape[x.ndim - k:])
    return x.size // max(length, 1), length


# What the checks of shapes, dtypes and array types answer, kept per problem (a repeated call pays a key and a
# lookup)
_forward_answers: dict = {}
_backward_answers: dict = {}


def supports(x, gamma, beta, k, eps, residual=None, bias=None) -> bool:
    """CuPy float16/bfloat16/float32/float64 ``x`` normalised over its last ``k`` axes, ``gamma``/``beta``/``bias``
    None or arrays of those axes' shape in the compute type, ``residual`` None or like ``x``, rows the forward takes
    (:func:`~fluxpy.kernels.layernorm_plan.fused_fits` with a residual or bias). Any strides: an array that is not
    C-contiguous and 16-byte aligned is copied so first (:func:`_readable`). Answered once per problem."""
    if cupy is None or type(x) is not cupy.ndarray:
        return False
    key = (x.shape, x.dtype, k, kind(gamma), kind(beta), kind(residual), kind(bias),
           layernorm_plan.tuning(x.dtype))
    return answered(_forward_answers, key, lambda: _supports(x, gamma, beta, k, residual, bias))


def _supports(x, gamma, beta, k, residual, bias) -> bool:
    if x.dtype not in KERNEL_DTYPES:
        return False
    if not 1 <= k <= x.ndim or x.size == 0:
        return False
    if residual is not None and (type(residual) is not cupy.ndarray or residual.dtype != x.dtype
                                 or residual.shape != x.shape):
        return False
    shape, cdt = x.shape[x.ndim - k:], compute_dtype(x.dtype)
    for p in (gamma, beta, bias):
        if p is not None and (type(p) is not cupy.ndarray or p.shape != shape or p.dtype != cdt):
            return False
    rows, length = _rows(x, k)
    fused = residual is not None or bias is not None
    return (length >= 2 and rows < 2**31 and layernorm_plan.row_shape(length, x.dtype) is not None
            and (not fused or fused_fits(length, x.dtype)))


def backward_supports(dy, x, gamma, mean, rstd, k, need_params=True, residual=None, bias=None):
    """The calls :func:`layernorm_backward` takes: ``x``, ``gamma``, ``residual`` and ``bias`` as the forward takes
    them, ``dy`` like ``x`` (any strides), ``mean`` and ``rstd`` one value a row in the compute type, rows a
    backward kernel takes (:func:`backward_fits`). Answered once per problem."""
    if not (type(dy) is cupy.ndarray and dy.dtype == x.dtype and dy.shape == x.shape):
        return False
    key = (x.shape, x.dtype, k, kind(x), kind(gamma), kind(mean), kind(rstd), kind(residual), kind(bias),
           layernorm_plan.tuning(x.dtype), x.device.id)   # backward_fits asks the GPU's limits
    return answered(_backward_answers, key, lambda: _backward_supports(x, gamma, mean, rstd, k, residual, bias))


def _backward_supports(x, gamma, mean, rstd, k, residual, bias) -> bool:
    if not supports(x, gamma, None, k, 0.0, residual, bias):
        return False
    rows, length = _rows(x, k)
    return all(type(s) is cupy.ndarray and s.dtype == compute_dtype(x.dtype) and s.size == rows
               for s in (mean, rstd)) and backward_fits(length, x.dtype)


def _allow_shared(fn, nbytes):
    """Let ``fn`` take ``nbytes`` of dynamic shared memory a block (past the 48 KB a block gets without asking)."""
    if nbytes and fn.max_dynamic_shared_size_bytes < nbytes:
        fn.max_dynamic_shared_size_bytes = nbytes


def _readable(a):
    """``a`` as the kernels read it, C-contiguous and starting on 16 bytes (they load 16-byte vectors along a row):
    ``a`` itself, or a copy where it is a strided view or a view into a larger array (None stays None)."""
    if a is None or (a._c_contiguous and a.data.ptr % 16 == 0):
        return a
    if not a._c_contiguous:
        return c_contiguous(a)   # a new allocation, aligned as every allocation is
    bits = np.dtype(f"u{a.itemsize}")   # copied as unsigned words: the bits alike, for bfloat16 too
    return a.view(bits).copy().view(a.dtype)


def _pointer(a):
    return np.uint64(0) if a is None else a


def _call_key(direction, x, rows, length, fused):
    """What one problem's launches are kept under: the rows, the dtype, the device, the planner's switches."""
    return (direction, rows, length, x.dtype, fused, cupy.cuda.runtime.getDevice(), x.device.id,
            layernorm_plan.tuning(x.dtype))


class _ForwardCall:
    """The forward's launch for one problem, all but its arrays and ``eps``: the kernel, the grid, the block, the
    dynamic shared memory, the rows as the kernel takes them, the statistics' dtype."""
    __slots__ = ("fn", "blocks", "threads", "shared", "rows", "cdt")

    def __init__(self, x, rows, length, fused):
        fn, plan = _forward_kernel(x.dtype, length, fused)
        blocks = -(-rows // plan.rpb)
        shared = plan.stages * staged_bytes(length, x.dtype, fused)
        _allow_shared(fn, shared)
        if shared or plan.prefetch:   # as many blocks as the GPU holds at once, each visiting rows grid-stride
            key = (x.dtype, length, x.device.id, fused, "forward", plan)
            processors = compiler.device(x.device.id).processors
            blocks = min(blocks, _blocks_per_sm(key, fn, plan.threads, shared) * processors)
        self.fn, self.blocks, self.threads, self.shared = fn, blocks, plan.threads, shared
        self.rows, self.cdt = np.int64(rows), compute_dtype(x.dtype)


def layernorm_forward(x, gamma, beta, k: int, eps: float, residual=None, bias=None):
    """``(y, mean, rstd)``: ``y`` of ``x``'s shape and dtype; ``mean``, ``rstd`` one per row in the compute type.
    With ``residual`` (like ``x``) and/or ``bias`` (the normalised shape, compute type) the rows normalised are
    those of ``x + residual + bias``, summed on the fly (the sum is never stored)."""
    rows, length = _rows(x, k)
    fused = residual is not None or bias is not None
    x, gamma, beta = _readable(x), _readable(gamma), _readable(beta)
    if fused:
        residual, bias = _readable(residual), _readable(bias)
    call = answered(_forward_kernels, _call_key("forward", x, rows, length, fused),
                    lambda: _ForwardCall(x, rows, length, fused), kept=None)
    y = cupy.empty(x.shape, x.dtype)   # x is C-contiguous here (_readable)
    mean, rstd = cupy.empty((2, rows), call.cdt)
    compiler.launch(call.fn, call.blocks, call.threads, (x, _pointer(gamma), _pointer(beta), y, mean, rstd, call.rows,
                                                         np.float64(eps), _pointer(residual), _pointer(bias)),
                    call.shared)
    return y, mean, rstd


class _BackwardCall:
    """The backward's launches for one problem, all but their arrays: the plan and kernels, the dx kernel's grid
    and shared memory, the columns' plan of the split backward, the scalars."""
    __slots__ = ("plan", "fn", "cols", "params", "cdt", "shared", "grid", "blocks", "rows", "columns", "chunk",
                 "param_blocks", "param_grid")

    def __init__(self, x, rows, length, fused):
        plan, fn, cols, params = _backward_kernels_of(x.dtype, length, fused)
        shared = backward_shared_bytes(plan, length, x.dtype, fused)
        _allow_shared(fn, shared)
        if plan.kernel == "ln_bwdc":   # partial rows: one a cluster, as many clusters as the GPU holds at once
            blocks = int(min(rows, _active_clusters(fn, plan.cluster, plan.tpr, shared,
                                                    (x.dtype, length, x.device.id, fused))))
            grid = blocks * plan.cluster
        else:   # as many blocks as the GPU holds at once, each visiting rows grid-stride
            per_sm = (_blocks_per_sm((x.dtype, length, x.device.id, fused, plan), fn, plan.threads, shared)
                      if plan.kernel in ("ln_bwd1", "ln_dx1", "ln_bwds", "ln_bwdr") else 2)
            blocks = grid = int(min(-(-rows // plan.rpb), per_sm * compiler.device(x.device.id).processors))
        self.plan, self.fn, self.cols, self.params = plan, fn, cols, params
        self.cdt, self.shared, self.grid, self.blocks, self.rows = compute_dtype(x.dtype), shared, grid, blocks, \
            np.int64(rows)
        self.columns = column_plan(length, x.dtype, rows) if plan.splits else None   # the column sums apart
        self.chunk = None if self.columns is None else np.int64(self.columns.chunk)
        # ln_params adds one partial row a block of the dx kernel, or a chunk of rows of the split backward's
        self.param_blocks = np.int64(blocks if self.columns is None else self.columns.chunks)
        self.param_grid = -(-length // 32)


def layernorm_backward(dy, x, gamma, mean, rstd, k: int, need_params: bool = True, residual=None, bias=None):
    """``(dx, dgamma, dbeta)`` (the last two None without ``need_params``), from the forward's ``mean``/``rstd``;
    with ``residual``/``bias``, ``dx`` is the cotangent of the sum ``x + residual + bias`` (recomputed, not read)."""
    rows, length = _rows(x, k)
    fused = residual is not None or bias is not None
    dy, x, gamma = _readable(dy), _readable(x), _readable(gamma)
    if fused:
        residual, bias = _readable(residual), _readable(bias)
    mean, rstd = c_contiguous(mean), c_contiguous(rstd)   # read a value at a time: any start will do
    call = answered(_backward_kernels, _call_key("backward", x, rows, length, fused),
                    lambda: _BackwardCall(x, rows, length, fused), kept=None)
    plan, cdt = call.plan, call.cdt
    dx = cupy.empty(x.shape, x.dtype)   # x is C-contiguous here (_readable)
    # the partial sums of dgamma and dbeta (one allocation, its two halves passed by address), then dgamma, dbeta
    partials = pg = pb = None
    if need_params and not plan.splits:
        partials = cupy.empty((2, call.blocks, length), cdt)
        pg, pb = row_addresses(partials)
    res_arg, bias_arg = _pointer(residual), _pointer(bias)
    compiler.launch(call.fn, call.grid, plan.threads, (dy, x, _pointer(gamma), mean, rstd, dx, _pointer(pg),
                                                       _pointer(pb), call.rows, np.int32(pg is not None), res_arg,
                                                       bias_arg), call.shared)
    if not need_params:
        return dx, None, None
    columns = call.columns
    if columns is not None:   # the column sums apart: one partial row a chunk of rows
        partials = cupy.empty((2, columns.chunks, length), cdt)
        pg, pb = row_addresses(partials)
        compiler.launch(call.cols, (columns.tiles, columns.chunks), 32 * layernorm_plan.COLUMN_WARPS,
                        (dy, x, mean, rstd, pg, pb, call.rows, call.chunk, res_arg, bias_arg))
    shape = x.shape[x.ndim - k:]
    params = cupy.empty((2, *shape), cdt)   # dgamma, dbeta
    compiler.launch(call.params, call.param_grid, 512, (pg, pb, call.param_blocks, *row_addresses(params)))
    return dx, params[0], params[1]


KERNELS = {"layernorm_forward": (layernorm_forward, supports),
           "layernorm_backward": (layernorm_backward, backward_supports)}
