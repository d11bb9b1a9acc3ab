"""Convolutions through cuDNN's backend (graph) API, with execution plans built once per problem and
autotuned, falling back per problem to the legacy calls (:mod:`fluxpy.kernels.cudnn.legacy`).

cuDNN 9 implements the legacy per-call API on top of its graph engine and redoes much of that work
on every call, at a host cost comparable to a small convolution's GPU time. This module builds the operation graph,
asks the heuristics for engine configurations, finalizes an execution plan **once per problem**
(kind, shapes, dtype, mode, options, autotune width, device) and caches it (:class:`GraphPlan`); a
call is then only a variant pack (data pointers + workspace, itself cached per pointer set) and one
``cudnnBackendExecute``.

Graphs (``GraphPlan.kind``):

- ``fwd_relu`` / ``fwd_identity``: ``CONVOLUTION_FORWARD -> POINTWISE ADD (bias (1,K,1,1)) ->
  POINTWISE RELU_FWD`` (identity: no relu); ``fwd_relu_nob``: conv -> relu; ``fwd``: the convolution
  alone.
- ``bwd_data``: ``CONVOLUTION_BACKWARD_DATA``; ``bwd_filter``: ``CONVOLUTION_BACKWARD_FILTER``.

Engine choice (:mod:`fluxpy.kernels.cudnn.choice`): the heuristics' configurations filtered by the options, with
autotuning (the ``autotune`` option) up to that many finalized plans timed once on the call's own buffers and the
fastest kept (as ``torch.backends.cudnn.benchmark``); within the ``search_budget_ms`` option's budget, the search
past the heuristics (:mod:`fluxpy.kernels.cudnn.search`: every other engine, then the knobs of the fastest).

:func:`plan_info` says per problem which configuration won and where it came from (``source``: the heuristics'
rank, ``engine search``, ``... + SPLIT_K_SLC=4`` for a knob change), and the heuristics' best time beside it.
The choice (or that the legacy call won) is kept on disk per GPU model and cuDNN version (:func:`cache_file`,
beside the legacy path's file; ``disk_cache`` option): a later run rebuilds it without timing anything.

float16 and bfloat16 graphs store x, w, y and the bias in the half type and compute in float32
(the convolution's compute type and the virtual tensors between the fused operations); their engines
may use tensor cores. What the graph path does not plan (any problem where no engine configuration
finalizes) runs through the legacy functions unchanged: :func:`conv_forward`, :func:`conv_bias_act_forward`,
:func:`conv_backward_data` and :func:`conv_backward_filter` have the legacy signatures and fall back
per problem. With autotuning, the legacy call on the same buffers is timed too and keeps the problem
where it takes under :data:`LEGACY_MARGIN` of the plan's time (its own search can find a kernel that no engine of
the graph API offers under the same options).
Asymmetric padding is handled by :mod:`fluxpy.kernels.cudnn.geometry`, as on the legacy path.

The module imports without CuPy or cuDNN:

>>> sorted(stats())
['builds', 'disk_hits', 'executes', 'fallbacks', 'hits', 'legacy_faster', 'vpack_builds', 'vpack_hits']
"""
from __future__ import annotations

import ctypes

import numpy as np

from ...backend import cupy
from ...layout import channels_last_strides, empty_channels_last, made_channels_last, to_channels_last
from ...options import options
from ..halfs import HALVES
from . import legacy, library, search
from .choice import SAME_SPEED, _choose, _events_ms, _within_limit
from .descriptors import (A_BD_ALPHA, A_BD_BETA, A_BD_CONV, A_BD_DX, A_BD_DY, A_BD_W, A_BF_ALPHA, A_BF_BETA,
                          A_BF_CONV, A_BF_DW, A_BF_DY, A_BF_X, A_CFG_ENGINE, A_CONV_COMP_TYPE, A_CONV_DILATIONS,
                          A_CONV_DIMS, A_CONV_MODE, A_CONV_POST_PAD, A_CONV_PRE_PAD, A_CONV_STRIDES, A_FWD_ALPHA,
                          A_FWD_BETA, A_FWD_CONV, A_FWD_W, A_FWD_X, A_FWD_Y, A_GRAPH_HANDLE, A_GRAPH_OPS,
                          A_HEUR_GRAPH, A_HEUR_MODE, A_HEUR_RESULTS, A_PLAN_CONFIG, A_PLAN_HANDLE, A_PLAN_WORKSPACE,
                          A_POINTWISE_MATH_PREC, A_POINTWISE_MODE, A_PW_B, A_PW_DESC, A_PW_X, A_PW_Y, A_T_ALIGN,
                          A_T_DIMS, A_T_DTYPE, A_T_STRIDES, A_T_UID, A_T_VIRTUAL, A_VP_PTRS, A_VP_UIDS,
                          A_VP_WORKSPACE, D_CONVOLUTION, D_ENGINE, D_ENGINECFG, D_ENGINEHEUR, D_EXECUTION_PLAN,
                          D_OP_CONV_BWD_DATA, D_OP_CONV_BWD_FILTER, D_OP_CONV_FWD, D_OP_POINTWISE, D_OPERATIONGRAPH,
                          D_POINTWISE, D_TENSOR, D_VARIANT_PACK, DATA_DOUBLE, PW_ADD, PW_RELU_FWD,
                          T_BACKEND_DESCRIPTOR, T_BOOLEAN, T_CONVOLUTION_MODE, T_DATA_TYPE, T_DOUBLE, T_FLOAT,
                          T_HANDLE, T_HEUR_MODE, T_INT64, T_POINTWISE_MODE, T_VOID_PTR, backend_create,
                          backend_destroy, backend_finalize, backend_set, compute_type, conv_mode, data_type,
                          describe, int64s, pointers, scalars)
from .errors import CudnnError, check
from .geometry import (ALIGN, ConvDimsLike, aligned, contiguous, crop_dx, descriptor_geometry, descriptor_shape,
                       pad_input, split_pad)
from .diskcache import DiskTable
from .handle import Workspace, get_handle, options_key
from .library import fn
from .search import Candidate, Config

__all__ = ["conv_forward", "conv_bias_act_forward", "conv_backward_data", "conv_backward_filter", "stats",
           "clear_cache", "plan_info", "fallback_reasons", "GraphPlan",
           "LEGACY_MARGIN", "SAME_SPEED"]

GRAPH_DTYPES = {np.dtype(np.float32), np.dtype(np.float64), *HALVES}   # halves: tensor-core engines, fp32 compute
UID_X, UID_W, UID_Y, UID_B, UID_V1, UID_V2 = 1, 2, 3, 4, 5, 6   # tensor uids (dx is UID_X, dy UID_Y, dw UID_W)
VPACK_LIMIT = 64                                                # variant packs kept per plan

LEGACY_MARGIN = 0.8
"""With autotuning, the legacy call keeps a problem where it takes under this fraction of the plan's time."""

_i64 = ctypes.c_int64
_P = ctypes.c_void_p


# ---------------------------------------------------------------------------------------------
# Statistics, caches

_stats = {"builds": 0, "hits": 0, "fallbacks": 0, "executes": 0, "vpack_builds": 0, "vpack_hits": 0,
          "legacy_faster": 0, "disk_hits": 0}
_plans = {}            # key -> GraphPlan, or None where the legacy path runs
_why = {}              # key -> why the graph path could not plan it
_DISK = DiskTable("graph")   # problem -> {"config": Config.to_json(), "source", "ms"} or {"legacy": ms}


def stats() -> dict:
    """Counters: ``builds`` (problems planned), ``hits`` (calls served by a cached plan), ``fallbacks`` (calls
    that ran the legacy path), ``executes``, ``vpack_builds``, ``vpack_hits``, ``legacy_faster`` (problems the
    timed legacy call kept), ``disk_hits`` (problems whose choice came from the disk cache)."""
    return dict(_stats)


def fallback_reasons() -> dict:
    """``{problem: reason}`` for the problems the graph path sent to the legacy path."""
    return {str(k): v for k, v in _why.items()}


def plan_info() -> list:
    """One dict per cached plan: kind, shapes, stride, the chosen engine global index and configuration (knobs
    included), where it came from (``source``: heuristics rank, engine search, the knobs changed, or ``"disk"``),
    its time and the heuristics' best time (ms; inf where not timed), the seconds spent choosing (``choose_s``),
    workspace, every candidate timed ``(configuration, source, ms)``."""
    out = []
    for p in _plans.values():
        if p is not None:
            ms = p.chosen.ms if p.chosen is not None else float("inf")
            out.append({"kind": p.kind, "x": p.x_shape, "w": p.cdims.w_shape, "stride": p.cdims.stride,
                        "dtype": str(p.dtype), "engine": p.engine, "config": str(p.config), "source": p.source,
                        "ms": ms, "heuristics_ms": p.heuristics_ms, "choose_s": p.choose_s, "workspace": p.ws_size,
                        "tuned": p.tuned})
    return out


def clear_cache(memory: bool = True, disk: bool = False) -> None:
    """Forget (and destroy) every cached plan; with ``disk=True`` also delete the file of choices
    (:func:`cache_file`).

    >>> clear_cache()
    """
    if memory:
        plans = [p for p in _plans.values() if p is not None]
        _plans.clear()
        _why.clear()
        if library.loaded():
            for p in plans:
                p.destroy()
    _DISK.forget(disk=disk)


# ---------------------------------------------------------------------------------------------
# Plans

def _packed(shape, channels_last=False):
    """The element strides of a dense ``shape`` (4 or 5 dimensions) in C order, or channels-last (NHWC / NDHWC
    memory)."""
    if channels_last:
        return channels_last_strides(shape, 1)
    if len(shape) == 4:
        n, c, h, w = shape
        return (c * h * w, h * w, w, 1)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


# kind -> (operation type, attributes of its x, w, y tensors, of the convolution, alpha, beta; name in errors)
_CONV_OPS = {
    "fwd": (D_OP_CONV_FWD, (A_FWD_X, A_FWD_W, A_FWD_Y), A_FWD_CONV, A_FWD_ALPHA, A_FWD_BETA,
            "convolution forward op"),
    "bwd_data": (D_OP_CONV_BWD_DATA, (A_BD_DX, A_BD_W, A_BD_DY), A_BD_CONV, A_BD_ALPHA, A_BD_BETA,
                 "convolution backward data op"),
    "bwd_filter": (D_OP_CONV_BWD_FILTER, (A_BF_X, A_BF_DW, A_BF_DY), A_BF_CONV, A_BF_ALPHA, A_BF_BETA,
                   "convolution backward filter op"),
}
FORWARD_KINDS = ("fwd", "fwd_relu", "fwd_identity", "fwd_relu_nob")


class GraphPlan:
    """The operation graph and the finalized execution plan of one problem.

    ``kind`` is ``"fwd"``, ``"fwd_relu"``, ``"fwd_identity"`` (conv + bias [+ relu]), ``"fwd_relu_nob"``
    (conv + relu, no bias), ``"bwd_data"`` or ``"bwd_filter"``. ``x_shape`` is the input as cuDNN sees it
    (padded by ``extra_pad`` where the padding is asymmetric, as the legacy ``Plan``). ``channels_last``: every
    tensor (x, w, y, the bias) in channels-last memory (NHWC, filters KRSC), else in C order. Problems of 1, 2 or 3
    spatial axes: the descriptors are 4-d for 1-d problems (a unit axis first) and 2-d ones, 5-d for 3-d ones
    (:func:`~fluxpy.kernels.cudnn.geometry.descriptor_shape`); the arrays keep their own shapes (the same bytes).
    """

    def __init__(self, kind, cdims, dtype, channels_last=False):
        if kind not in FORWARD_KINDS and kind not in _CONV_OPS:
            raise ValueError(f"unknown graph kind {kind!r}")
        self.kind, self.cdims, self.dtype = kind, cdims, np.dtype(dtype)
        self.channels_last = bool(channels_last)
        self.sym_pad, self.extra_pad, self.x_shape = split_pad(cdims)
        self.compute = compute_type(self.dtype)
        self.one, self.zero = scalars(self.dtype)   # kept alive: the ops hold their addresses
        self._keep = []          # every descriptor, destroyed with the plan
        self.handle = None
        self.graph = None
        self.plan = None
        self.engine = None
        self.config = None       # the chosen search.Config, its source, its candidate; heuristics' best time
        self.source = ""
        self.chosen = None
        self.heuristics_ms = float("inf")
        self.choose_s = 0.0      # seconds spent choosing (heuristics, timing, search)
        self.ws_size = 0
        self.tuned = []
        self.vpacks = {}
        self.uids = None
        self.n_ptrs = 0

    def describe(self) -> str:
        """The problem in words (for errors)."""
        layout = ", channels-last" if self.channels_last else ""
        return f"{self.kind}{layout}: {describe(self.cdims, self.dtype, self.x_shape)}"

    # -- building ------------------------------------------------------------------------------
    def _desc(self, kind):
        d = backend_create(kind)
        self._keep.append(d)
        return d

    def _set(self, desc, attr, atype, values):
        backend_set(desc, attr, atype, values, self.describe)

    def _tensor(self, uid, shape, dtype_enum, virtual=False):
        if uid == UID_B:   # the bias, (1, K, 1, ...): as many dimensions as y's descriptor
            shape = (1, shape[1]) + (1,) * (len(self.cdims.y_shape) - 2)
        shape = descriptor_shape(shape)
        d = self._desc(D_TENSOR)
        self._set(d, A_T_DTYPE, T_DATA_TYPE, ctypes.c_int(dtype_enum))
        self._set(d, A_T_DIMS, T_INT64, int64s(*shape))
        self._set(d, A_T_STRIDES, T_INT64, int64s(*_packed(shape, self.channels_last)))
        self._set(d, A_T_UID, T_INT64, _i64(uid))
        self._set(d, A_T_ALIGN, T_INT64, _i64(ALIGN))
        if virtual:
            self._set(d, A_T_VIRTUAL, T_BOOLEAN, ctypes.c_bool(True))
        backend_finalize(d, "cudnnBackendFinalize(tensor)", self.describe)
        return d

    def _convolution(self):
        c = self.cdims
        stride, dilation, pad = descriptor_geometry(c, self.sym_pad)
        conv = self._desc(D_CONVOLUTION)
        self._set(conv, A_CONV_COMP_TYPE, T_DATA_TYPE, ctypes.c_int(self.compute))
        self._set(conv, A_CONV_MODE, T_CONVOLUTION_MODE, ctypes.c_int(conv_mode(c)))
        self._set(conv, A_CONV_DIMS, T_INT64, _i64(len(stride)))
        self._set(conv, A_CONV_DILATIONS, T_INT64, int64s(*dilation))
        self._set(conv, A_CONV_STRIDES, T_INT64, int64s(*stride))
        self._set(conv, A_CONV_PRE_PAD, T_INT64, int64s(*pad))
        self._set(conv, A_CONV_POST_PAD, T_INT64, int64s(*pad))
        backend_finalize(conv, "cudnnBackendFinalize(convolution)", self.describe)
        return conv

    def _conv_op(self, which, xd, wd, yd, conv):
        """The convolution operation ``which`` (a key of ``_CONV_OPS``) on tensors ``xd``, ``wd``, ``yd``."""
        op_type, (ax, aw, ay), aconv, aalpha, abeta, name = _CONV_OPS[which]
        stype = T_DOUBLE if self.compute == DATA_DOUBLE else T_FLOAT
        op = self._desc(op_type)
        self._set(op, ax, T_BACKEND_DESCRIPTOR, _P(xd))
        self._set(op, aw, T_BACKEND_DESCRIPTOR, _P(wd))
        self._set(op, ay, T_BACKEND_DESCRIPTOR, _P(yd))
        self._set(op, aconv, T_BACKEND_DESCRIPTOR, _P(conv))
        self._set(op, aalpha, stype, self.one)
        self._set(op, abeta, stype, self.zero)
        backend_finalize(op, f"cudnnBackendFinalize({name})", self.describe)
        return op

    def _pointwise(self, mode, xd, yd, bd=None):
        pw = self._desc(D_POINTWISE)
        self._set(pw, A_POINTWISE_MODE, T_POINTWISE_MODE, ctypes.c_int(mode))
        self._set(pw, A_POINTWISE_MATH_PREC, T_DATA_TYPE, ctypes.c_int(self.compute))
        backend_finalize(pw, "cudnnBackendFinalize(pointwise)", self.describe)
        op = self._desc(D_OP_POINTWISE)
        self._set(op, A_PW_DESC, T_BACKEND_DESCRIPTOR, _P(pw))
        self._set(op, A_PW_X, T_BACKEND_DESCRIPTOR, _P(xd))
        if bd is not None:
            self._set(op, A_PW_B, T_BACKEND_DESCRIPTOR, _P(bd))
        self._set(op, A_PW_Y, T_BACKEND_DESCRIPTOR, _P(yd))
        backend_finalize(op, "cudnnBackendFinalize(pointwise op)", self.describe)
        return op

    def _forward_ops(self, conv, xd, wd, dt):
        """The operations and tensor uids of a forward kind: conv [-> add bias] [-> relu]."""
        kind, c = self.kind, self.cdims
        fused = kind != "fwd"
        with_bias = kind in ("fwd_relu", "fwd_identity")
        with_relu = kind in ("fwd_relu", "fwd_relu_nob")
        yd = self._tensor(UID_Y, c.y_shape, dt)
        cur = self._tensor(UID_V1, c.y_shape, self.compute, virtual=True) if fused else yd
        ops = [self._conv_op("fwd", xd, wd, cur, conv)]
        uids = [UID_X, UID_W, UID_Y]
        if with_bias:
            bd = self._tensor(UID_B, (1, c.w_shape[0], 1, 1), dt)
            out = self._tensor(UID_V2, c.y_shape, self.compute, virtual=True) if with_relu else yd
            ops.append(self._pointwise(PW_ADD, cur, out, bd))
            cur = out
            uids.append(UID_B)
        if with_relu:
            ops.append(self._pointwise(PW_RELU_FWD, cur, yd))
        return ops, uids

    def build(self, handle: int) -> None:
        """Build and finalize the operation graph on ``handle`` (raises :class:`CudnnError`)."""
        c = self.cdims
        dt = data_type(self.dtype)
        conv = self._convolution()
        xd = self._tensor(UID_X, self.x_shape, dt)
        wd = self._tensor(UID_W, c.w_shape, dt)
        if self.kind in FORWARD_KINDS:
            ops, uids = self._forward_ops(conv, xd, wd, dt)
        else:
            dyd = self._tensor(UID_Y, c.y_shape, dt)
            ops, uids = [self._conv_op(self.kind, xd, wd, dyd, conv)], [UID_X, UID_W, UID_Y]
        self.uids = int64s(*uids)
        self.n_ptrs = len(uids)
        graph = self._desc(D_OPERATIONGRAPH)
        self._set(graph, A_GRAPH_HANDLE, T_HANDLE, _P(handle))
        self._set(graph, A_GRAPH_OPS, T_BACKEND_DESCRIPTOR, pointers(*ops))
        backend_finalize(graph, "cudnnBackendFinalize(operation graph)", self.describe)
        self.graph = graph
        self.handle = handle

    def configs(self, mode: int) -> list:
        """The engine configurations the heuristics of ``mode`` propose, in order (descriptors)."""
        what = self.describe
        heur = self._desc(D_ENGINEHEUR)
        self._set(heur, A_HEUR_GRAPH, T_BACKEND_DESCRIPTOR, _P(self.graph))
        self._set(heur, A_HEUR_MODE, T_HEUR_MODE, ctypes.c_int(mode))
        backend_finalize(heur, "cudnnBackendFinalize(engine heuristics)", what)
        count = _i64()
        check(fn.cudnnBackendGetAttribute(heur, A_HEUR_RESULTS, T_BACKEND_DESCRIPTOR, 0, ctypes.byref(count), None),
              "cudnnBackendGetAttribute(ENGINEHEUR_RESULTS count)", what)
        n = count.value
        if n <= 0:
            return []
        cfgs = pointers(*[self._desc(D_ENGINECFG) for _ in range(n)])
        got = _i64()
        check(fn.cudnnBackendGetAttribute(heur, A_HEUR_RESULTS, T_BACKEND_DESCRIPTOR, n, ctypes.byref(got), cfgs),
              "cudnnBackendGetAttribute(ENGINEHEUR_RESULTS)", what)
        return list(cfgs[:got.value])

    def notes(self, cfg: int) -> tuple:
        """``(engine global index, numerical notes, behavior notes)`` of an engine configuration."""
        eng = self._desc(D_ENGINE)
        got = _i64()
        check(fn.cudnnBackendGetAttribute(cfg, A_CFG_ENGINE, T_BACKEND_DESCRIPTOR, 1, ctypes.byref(got),
                                          pointers(eng)),
              "cudnnBackendGetAttribute(ENGINECFG_ENGINE)", self.describe)
        return search.engine_info(eng)

    def try_plan(self, cfg: int):
        """A finalized execution plan of ``cfg`` and its workspace size, or None."""
        plan = backend_create(D_EXECUTION_PLAN)
        ok = False
        try:
            if fn.cudnnBackendSetAttribute(plan, A_PLAN_HANDLE, T_HANDLE, 1, ctypes.byref(_P(self.handle))):
                return None
            if fn.cudnnBackendSetAttribute(plan, A_PLAN_CONFIG, T_BACKEND_DESCRIPTOR, 1, ctypes.byref(_P(cfg))):
                return None
            if fn.cudnnBackendFinalize(plan):
                return None
            ws = _i64(0)
            got = _i64()
            check(fn.cudnnBackendGetAttribute(plan, A_PLAN_WORKSPACE, T_INT64, 1, ctypes.byref(got),
                                              ctypes.byref(ws)),
                  "cudnnBackendGetAttribute(EXECUTION_PLAN_WORKSPACE_SIZE)", self.describe)
            ok = True
            return plan, int(ws.value)
        finally:
            if not ok:
                backend_destroy(plan)

    def adopt(self, c: Candidate) -> None:
        """Run candidate ``c`` from now on (its plan, workspace, configuration; destroyed with this plan)."""
        self.chosen = c
        self.plan, self.ws_size, self.engine, self.config, self.source = c.plan, c.ws, c.config.engine, c.config, \
            c.source

    def destroy(self) -> None:
        """Free the variant packs, the execution plan and every descriptor."""
        for vp in self.vpacks.values():
            backend_destroy(vp[0])
        self.vpacks.clear()
        if self.chosen is not None:
            self.chosen.destroy()
        elif self.plan:
            backend_destroy(self.plan)
        self.plan, self.chosen = None, None
        for d in reversed(self._keep):
            backend_destroy(d)
        self._keep = []

    # -- running -------------------------------------------------------------------------------
    def vpack(self, ptrs: tuple, ws: int) -> int:
        """The finalized variant pack for data pointers ``ptrs`` (a tuple) and workspace ``ws`` (cached)."""
        key = ptrs + (ws,)
        vp = self.vpacks.get(key)
        if vp is not None:
            _stats["vpack_hits"] += 1
            return vp[0]
        d = backend_create(D_VARIANT_PACK)
        arr = (_P * self.n_ptrs)(*ptrs)
        wsp = _P(ws)
        try:
            check(fn.cudnnBackendSetAttribute(d, A_VP_PTRS, T_VOID_PTR, self.n_ptrs, arr),
                  "cudnnBackendSetAttribute(VARIANT_PACK_DATA_POINTERS)", self.describe)
            check(fn.cudnnBackendSetAttribute(d, A_VP_UIDS, T_INT64, self.n_ptrs, self.uids),
                  "cudnnBackendSetAttribute(VARIANT_PACK_UNIQUE_IDS)", self.describe)
            check(fn.cudnnBackendSetAttribute(d, A_VP_WORKSPACE, T_VOID_PTR, 1, ctypes.byref(wsp)),
                  "cudnnBackendSetAttribute(VARIANT_PACK_WORKSPACE)", self.describe)
            check(fn.cudnnBackendFinalize(d), "cudnnBackendFinalize(variant pack)", self.describe)
        except CudnnError:
            backend_destroy(d)
            raise
        if len(self.vpacks) >= VPACK_LIMIT:
            old = self.vpacks.pop(next(iter(self.vpacks)))
            backend_destroy(old[0])
        self.vpacks[key] = (d, arr, wsp)
        _stats["vpack_builds"] += 1
        return d

    def execute(self, handle: int, ptrs: tuple, plan=None, ws_size=None) -> None:
        """``cudnnBackendExecute`` of this plan (or of ``plan``, a candidate, with its ``ws_size``) on ``ptrs``."""
        plan = self.plan if plan is None else plan
        ws_size = self.ws_size if ws_size is None else ws_size
        ws = Workspace(ws_size)
        vp = self.vpack(ptrs, ws.ptr)
        check(fn.cudnnBackendExecute(handle, plan, vp), "cudnnBackendExecute", self.describe)
        _stats["executes"] += 1


# ---------------------------------------------------------------------------------------------
# The plan cache

_MISSING = object()


def _get(kind, cdims, dtype, handle, bufs, args, legacy_call=None, channels_last=False):
    """``(plan, buffers)``: the cached :class:`GraphPlan` of the problem (built on first use, on the call's own
    buffers ``bufs(plan, *args)``) or ``(None, None)`` where the legacy path must run: no plan finalizes, or
    (with autotuning) ``legacy_call()``, the legacy call on the same arguments, is clearly faster."""
    key = (kind, cdims, dtype, options_key(), options.autotune, options.search_budget_ms,
           cupy.cuda.runtime.getDevice(), channels_last)
    p = _plans.get(key, _MISSING)
    if p is not _MISSING:
        if p is None:
            return None, None
        _stats["hits"] += 1
        return p, bufs(p, *args)
    _stats["builds"] += 1
    p, got = _build(key, kind, cdims, dtype, handle, bufs, args, legacy_call, channels_last)
    _plans[key] = p
    return p, got


def cache_file() -> str | None:
    """The JSON file of the graph path's choices for this GPU model and cuDNN version (None without cuDNN)."""
    return _DISK.path()


def _disk_key(p) -> str:
    """The problem and the settings its choice depends on, as the disk cache's key."""
    return (f"{legacy._key_str(p.kind, p)}|cl={int(p.channels_last)}|tune={options.autotune}|"
            f"search={options.search_budget_ms:g}")


def _build(key, kind, cdims, dtype, handle, bufs, args, legacy_call, channels_last):
    """A new plan and the call's buffers, or ``(None, None)`` with the reason in ``_why[key]``: the choice kept on
    disk where there is one that still builds, else the heuristics' candidates (and the search past them), then
    the legacy call timed against the winner. A fresh choice goes to disk."""
    p = GraphPlan(kind, cdims, dtype, channels_last)
    use_disk = options.disk_cache and options.autotune > 0
    stored = _DISK.get(_disk_key(p)) if use_disk else None
    if not isinstance(stored, dict):
        stored = None        # nothing, or a row this version does not understand: search afresh
    got, fresh = None, False
    try:
        p.build(handle)
        got = bufs(p, *args)
        if stored is not None and "legacy" in stored:
            _stats["disk_hits"] += 1
            _why[key] = f"the legacy call was faster ({stored['legacy']} ms, disk cache)"
            ok = False
        else:
            ok = stored is not None and _from_disk(p, stored)
            fresh = not ok
            if fresh:
                ok = _choose(p, handle, got[0])
                if ok and legacy_call is not None and options.autotune:
                    ok = _graph_beats_legacy(p, key, handle, got[0], legacy_call)
    except CudnnError as err:
        ok = fresh = False
        _why[key] = str(err)
    if fresh and use_disk:
        _store(p, ok)
    if not ok:
        _why.setdefault(key, f"no engine configuration finalized for {p.describe()}")
        p.destroy()
        return None, None
    return p, got


def _store(p, ok) -> None:
    """Keep ``p``'s fresh choice on disk: its configuration, or that the legacy call won."""
    if ok:
        ms = p.chosen.ms
        _DISK.put(_disk_key(p), {"config": p.config.to_json(), "source": p.source,
                                 "ms": None if ms == float("inf") else round(ms, 4)})
    elif p.tuned and p.tuned[-1][0] == "legacy":
        _DISK.put(_disk_key(p), {"legacy": p.tuned[-1][2]})


def _from_disk(p, stored) -> bool:
    """Build the configuration kept on disk for ``p``; False where it no longer builds (another cuDNN build, a
    smaller workspace limit): the search runs again."""
    try:
        config = Config.from_json(stored["config"])
    except (KeyError, TypeError, ValueError, IndexError):
        return False
    built = search.build_config(p.graph, config)
    if built is None:
        return False
    cfg, descs = built
    got = _within_limit(p.try_plan(cfg))
    if got is None:
        search.destroy_all([cfg] + descs)
        return False
    c = Candidate(got[0], got[1], config, f"disk ({stored.get('source', '?')})", [cfg] + descs)
    c.ms = float("inf") if stored.get("ms") is None else float(stored["ms"])
    p.adopt(c)
    p.tuned.append((str(config), c.source, c.ms))
    _stats["disk_hits"] += 1
    return True


def _graph_beats_legacy(p, key, handle, ptrs, legacy_call) -> bool:
    """Time the legacy call on the plan's buffers (the plan's own time is known where it was timed); False (the
    legacy path keeps the problem) where the legacy call takes under :data:`LEGACY_MARGIN` of the plan's time."""
    t_graph = p.chosen.ms if p.chosen.ms < float("inf") else _events_ms(lambda: p.execute(handle, ptrs))
    t_legacy = _events_ms(legacy_call)
    p.tuned.append(("legacy", "legacy call", round(t_legacy, 4)))
    if t_legacy < LEGACY_MARGIN * t_graph:
        _why[key] = f"the legacy call was faster ({t_legacy:.4f} ms against {t_graph:.4f} ms)"
        _stats["legacy_faster"] += 1
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The operations (the legacy signatures)

def _graph_array(a, dtype, channels_last=False):
    """``a`` as the plan reads it: ``dtype``, aligned, in C order or (``channels_last``) in channels-last memory."""
    a = aligned(contiguous(a, dtype)) if not channels_last else aligned(a if a.dtype == dtype else a.astype(dtype))
    return to_channels_last(a) if channels_last and a.ndim >= 3 else a


def _graph_input(p, x):
    """The convolution's input as the plan reads it: padded by ``extra_pad``, in the plan's layout."""
    if not p.channels_last:
        return aligned(pad_input(x, p.extra_pad))
    return _graph_array(pad_input(x, p.extra_pad) if p.extra_pad is not None else x, p.dtype, True)


def _new(p, shape):
    return empty_channels_last(shape, p.dtype, cupy) if p.channels_last else cupy.empty(shape, dtype=p.dtype)


def _fwd_bufs(p, x, w, b, dtype):
    x = _graph_input(p, x)
    w = _graph_array(w, dtype, p.channels_last)
    y = _new(p, p.cdims.y_shape)
    if b is None:
        return (x.data.ptr, w.data.ptr, y.data.ptr), y, (x, w)
    b = _graph_array(b, dtype)
    return (x.data.ptr, w.data.ptr, y.data.ptr, b.data.ptr), y, (x, w, b)


def _bwd_data_bufs(p, dy, w, dtype):
    dy = _graph_array(dy, dtype, p.channels_last)
    w = _graph_array(w, dtype, p.channels_last)
    dx = _new(p, p.x_shape)
    return (dx.data.ptr, w.data.ptr, dy.data.ptr), dx, (dy, w)


def _bwd_filter_bufs(p, x, dy, dtype):
    x = _graph_input(p, x)
    dy = _graph_array(dy, dtype, p.channels_last)
    dw = _new(p, p.cdims.w_shape)
    return (x.data.ptr, dw.data.ptr, dy.data.ptr), dw, (x, dy)


def _in_c_order(legacy_fn, channels_last):
    """``legacy_fn`` (a legacy call, which takes C-order arrays) giving its result channels-last where the problem
    is (the legacy path has no channels-last form: its inputs are copied to C order and its result back)."""
    if not channels_last:
        return legacy_fn
    return lambda *args: to_channels_last(legacy_fn(*args))


def conv_forward(x: cupy.ndarray, w: cupy.ndarray, cdims: ConvDimsLike) -> cupy.ndarray:
    """The convolution through a cached execution plan (the legacy call where the problem has none)."""
    return _forward("fwd", x, w, None, cdims)


def conv_bias_act_forward(x: cupy.ndarray, w: cupy.ndarray, b: cupy.ndarray | None, kind: str,
                          cdims: ConvDimsLike) -> cupy.ndarray:
    """``act(conv(x, w) + b)`` for ``kind`` ``"relu"`` or ``"identity"`` in one graph (conv -> add bias -> relu);
    ``b`` None: no bias. Where the problem has no plan, the legacy fused call (which composes where cuDNN
    refuses the fusion): there is always a result."""
    if kind == "relu":
        gkind = "fwd_relu" if b is not None else "fwd_relu_nob"
    elif kind == "identity":
        gkind = "fwd_identity" if b is not None else "fwd"
    else:
        cl = made_channels_last(x) or made_channels_last(w)
        return _in_c_order(legacy.conv_bias_act_forward, cl)(x, w, b, kind, cdims)
    return _forward(gkind, x, w, b, cdims)


def _forward(gkind, x, w, b, cdims):
    dtype = x.dtype
    cl = made_channels_last(x) or made_channels_last(w)
    legacy_fn = _in_c_order(_legacy_forward, cl)
    if dtype in GRAPH_DTYPES:
        handle = get_handle()
        p, got = _get(gkind, cdims, dtype, handle, _fwd_bufs, (x, w, b, dtype),
                      lambda: legacy_fn(gkind, x, w, b, cdims), cl)
        if p is not None:
            p.execute(handle, got[0])
            return got[1]
    _stats["fallbacks"] += 1
    return legacy_fn(gkind, x, w, b, cdims)


def _legacy_forward(gkind, x, w, b, cdims):
    if gkind == "fwd":
        return legacy.conv_forward(x, w, cdims)
    kind = "relu" if gkind.startswith("fwd_relu") else "identity"
    return legacy.conv_bias_act_forward(x, w, b, kind, cdims)


def conv_backward_data(dy: cupy.ndarray, w: cupy.ndarray, cdims: ConvDimsLike) -> cupy.ndarray:
    """``dx`` of shape ``cdims.x_shape`` through a cached execution plan (the legacy call where there is none)."""
    dtype = w.dtype
    cl = made_channels_last(dy) or made_channels_last(w)
    legacy_fn = _in_c_order(legacy.conv_backward_data, cl)
    if dtype in GRAPH_DTYPES:
        handle = get_handle()
        p, got = _get("bwd_data", cdims, dtype, handle, _bwd_data_bufs, (dy, w, dtype),
                      lambda: legacy_fn(dy, w, cdims), cl)
        if p is not None:
            p.execute(handle, got[0])
            dx = crop_dx(got[1], p.extra_pad)
            return to_channels_last(dx) if cl and p.extra_pad is not None else dx
    _stats["fallbacks"] += 1
    return legacy_fn(dy, w, cdims)


def conv_backward_filter(x: cupy.ndarray, dy: cupy.ndarray, cdims: ConvDimsLike) -> cupy.ndarray:
    """``dw`` of shape ``cdims.w_shape`` through a cached execution plan (the legacy call where there is none)."""
    dtype = x.dtype
    cl = made_channels_last(x) or made_channels_last(dy)
    legacy_fn = _in_c_order(legacy.conv_backward_filter, cl)
    if dtype in GRAPH_DTYPES:
        handle = get_handle()
        p, got = _get("bwd_filter", cdims, dtype, handle, _bwd_filter_bufs, (x, dy, dtype),
                      lambda: legacy_fn(x, dy, cdims), cl)
        if p is not None:
            p.execute(handle, got[0])
            return got[1]
    _stats["fallbacks"] += 1
    return legacy_fn(x, dy, cdims)
