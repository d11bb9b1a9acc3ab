"""Convolutions through cuDNN's backend (graph) API, with execution plans cached per problem.

cuDNN 9 implements the legacy per-call API (:mod:`fluxpy.kernels.cudnn`) on top of its graph
engine and redoes much of that work on every call (25-57 us of host time per call, measured).
This module builds the operation graph, asks the heuristics for engine configurations, finalizes
an execution plan **once per problem** (shapes, dtype, mode, options, device) and caches it; a call
is then only a variant pack (data pointers + workspace, itself cached per pointer set) and one
``cudnnBackendExecute``.

Graphs:

- ``fwd_relu`` / ``fwd_identity``: ``CONVOLUTION_FORWARD -> POINTWISE ADD (bias (1,K,1,1)) ->
  POINTWISE RELU_FWD`` (identity: no relu); without a bias the add is left out; ``fwd``: the
  convolution alone.
- ``bwd_data``: ``CONVOLUTION_BACKWARD_DATA``; ``bwd_filter``: ``CONVOLUTION_BACKWARD_FILTER``.

Engine choice: ``CUDNN_HEUR_MODE_A`` (then ``FALLBACK``) configurations in order, filtered as
PyTorch filters them: never ``DOWN_CONVERT_INPUTS``; float32 without ``allow_tf32`` never
``TENSOR_CORE``; ``deterministic`` never ``NONDETERMINISTIC``; plans whose workspace exceeds
``workspace_limit`` are dropped (the options are :func:`fluxpy.kernels.cudnn.set_options`'s).
Runtime-compiled engines are only tried when no precompiled one finalizes. With autotuning on
(:func:`set_autotune`, default 8) up to that many finalized plans (those of ``HEUR_MODE_A``, then of
``FALLBACK``) are timed once on the call's own buffers (one warm run, then 5 under events) and the fastest kept (as ``torch.backends.cudnn.benchmark``).

What the graph path does not plan (float16, groups > 1 unless enabled, or any problem where no
engine configuration finalizes) runs through the legacy functions unchanged: each public function
here has the legacy signature and falls back per problem. With autotuning, the legacy call on the
same buffers is timed too and keeps the problem where it takes under :data:`LEGACY_MARGIN` of the
plan's time (seen once: a 512-channel 3x3 layer at 7x7, batch 256, where the legacy search found a
kernel the TF32-free graph engines do not offer). Asymmetric padding pads the input like
the legacy path (its ``_prepare_x``) and crops ``dx``.

:func:`register` puts the graph versions of ``conv_forward``, ``conv_bias_act_forward``,
``conv_backward_data`` and ``conv_backward_filter`` in the kernel table for CuPy arrays;
:func:`unregister` restores the legacy ones. :func:`fluxpy.kernels.gpu.register` (run when fluxpy is
imported) registers it.

The module imports without CuPy or cuDNN:

>>> sorted(stats())
['builds', 'executes', 'fallbacks', 'hits', 'legacy_faster', 'vpack_builds', 'vpack_hits']
>>> get_autotune() >= 0
True
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..backend import cupy
from . import cudnn as _legacy
from .cudnn import CudnnError

__all__ = ["register", "unregister", "conv_forward", "conv_bias_act_forward", "conv_backward_data",
           "conv_backward_filter", "stats", "clear_cache", "set_autotune", "get_autotune", "plan_info",
           "fallback_reasons", "GraphPlan"]

# ---------------------------------------------------------------------------------------------
# Enums of cuDNN 9's cudnn_graph.h

# cudnnBackendDescriptorType_t
D_POINTWISE, D_CONVOLUTION, D_ENGINE, D_ENGINECFG, D_ENGINEHEUR, D_EXECUTION_PLAN = 0, 1, 2, 3, 4, 5
D_OP_CONV_FWD, D_OP_CONV_BWD_FILTER, D_OP_CONV_BWD_DATA, D_OP_POINTWISE = 10, 11, 12, 13
D_OPERATIONGRAPH, D_VARIANT_PACK, D_TENSOR = 15, 16, 17

# cudnnBackendAttributeType_t
T_HANDLE, T_DATA_TYPE, T_BOOLEAN, T_INT64, T_FLOAT, T_DOUBLE, T_VOID_PTR, T_CONVOLUTION_MODE, T_HEUR_MODE = range(9)
T_NUMERICAL_NOTE, T_POINTWISE_MODE, T_BACKEND_DESCRIPTOR, T_BEHAVIOR_NOTE = 11, 14, 15, 19

# cudnnBackendAttributeName_t
A_POINTWISE_MODE, A_POINTWISE_MATH_PREC = 0, 1
A_CONV_COMP_TYPE, A_CONV_MODE, A_CONV_DILATIONS, A_CONV_STRIDES, A_CONV_POST_PAD, A_CONV_PRE_PAD, A_CONV_DIMS = \
    100, 101, 102, 103, 104, 105, 106
A_HEUR_MODE, A_HEUR_GRAPH, A_HEUR_RESULTS = 200, 201, 202
A_CFG_ENGINE = 300
A_PLAN_HANDLE, A_PLAN_CONFIG, A_PLAN_WORKSPACE = 400, 401, 402
A_FWD_ALPHA, A_FWD_BETA, A_FWD_CONV, A_FWD_W, A_FWD_X, A_FWD_Y = 700, 701, 702, 703, 704, 705
A_BD_ALPHA, A_BD_BETA, A_BD_CONV, A_BD_W, A_BD_DX, A_BD_DY = 706, 707, 708, 709, 710, 711
A_BF_ALPHA, A_BF_BETA, A_BF_CONV, A_BF_DW, A_BF_X, A_BF_DY = 712, 713, 714, 715, 716, 717
A_PW_DESC, A_PW_X, A_PW_B, A_PW_Y = 750, 751, 752, 753
A_GRAPH_HANDLE, A_GRAPH_OPS = 800, 801
A_T_ALIGN, A_T_DTYPE, A_T_DIMS, A_T_STRIDES, A_T_UID, A_T_VIRTUAL = 900, 901, 902, 903, 906, 907
A_VP_UIDS, A_VP_PTRS, A_VP_WORKSPACE = 1000, 1001, 1003
A_ENGINE_INDEX, A_ENGINE_NUMERICAL_NOTE, A_ENGINE_BEHAVIOR_NOTE = 1301, 1303, 1305

PW_ADD, PW_RELU_FWD = 0, 100                                   # cudnnPointwiseMode_t
HEUR_MODE_INSTANT, HEUR_MODE_B, HEUR_MODE_FALLBACK, HEUR_MODE_A = 0, 1, 2, 3   # cudnnBackendHeurMode_t
NOTE_TENSOR_CORE, NOTE_DOWN_CONVERT_INPUTS, NOTE_NONDETERMINISTIC = 0, 1, 4    # cudnnBackendNumericalNote_t
BEHAVIOR_RUNTIME_COMPILATION = 0                               # cudnnBackendBehaviorNote_t
DATA_FLOAT, DATA_DOUBLE = 0, 1
CONVOLUTION, CROSS_CORRELATION = 0, 1

_DTYPES = {np.dtype(np.float32): DATA_FLOAT, np.dtype(np.float64): DATA_DOUBLE}
_UID_X, _UID_W, _UID_Y, _UID_B, _UID_V1, _UID_V2 = 1, 2, 3, 4, 5, 6
_ALIGN = 16
_VPACK_LIMIT = 64

_i64 = ctypes.c_int64
_P = ctypes.c_void_p


# ---------------------------------------------------------------------------------------------
# Binding (on the library the legacy module loaded)

class _Fns:
    pass


_fn = _Fns()
_bound = [False]

_SIGS = {
    "cudnnBackendCreateDescriptor": ([ctypes.c_int, _P], ctypes.c_int),
    "cudnnBackendDestroyDescriptor": ([_P], ctypes.c_int),
    "cudnnBackendFinalize": ([_P], ctypes.c_int),
    "cudnnBackendSetAttribute": ([_P, ctypes.c_int, ctypes.c_int, _i64, _P], ctypes.c_int),
    "cudnnBackendGetAttribute": ([_P, ctypes.c_int, ctypes.c_int, _i64, _P, _P], ctypes.c_int),
    "cudnnBackendExecute": ([_P, _P, _P], ctypes.c_int),
}


def _bind():
    if _bound[0]:
        return
    _legacy._require()
    lib = _legacy._lib
    for name, (args, res) in _SIGS.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
        setattr(_fn, name, f)
    _bound[0] = True


def _check(status, call, what=""):
    if status:
        raise CudnnError(call, status, what() if callable(what) else what)


def _create(kind):
    d = _P()
    _check(_fn.cudnnBackendCreateDescriptor(kind, ctypes.byref(d)), "cudnnBackendCreateDescriptor", f"type {kind}")
    return d.value


def _set(desc, attr, atype, values, what=""):
    """Set ``attr`` of ``desc`` to ``values`` (a ctypes array or a single ctypes scalar)."""
    n = len(values) if isinstance(values, ctypes.Array) else 1
    _check(_fn.cudnnBackendSetAttribute(desc, attr, atype, n, ctypes.byref(values)),
           f"cudnnBackendSetAttribute(attr {attr})", what)


def _ints(*vals):
    return (_i64 * len(vals))(*vals)


def _descs(*ds):
    return (_P * len(ds))(*ds)


def _finalize(desc, call, what=""):
    _check(_fn.cudnnBackendFinalize(desc), call, what)


# ---------------------------------------------------------------------------------------------
# Options, statistics, caches

_AUTOTUNE = [8]
_stats = {"builds": 0, "hits": 0, "fallbacks": 0, "executes": 0, "vpack_builds": 0, "vpack_hits": 0,
          "legacy_faster": 0}
_plans = {}            # key -> GraphPlan, or None where the legacy path runs
_why = {}              # key -> why the graph path could not plan it


def set_autotune(n):
    """``set_autotune(n)``: time up to ``n`` finalized plans per problem once and keep the fastest (0: the first
    that finalizes, heuristics' order). Returns the previous value; plans built already are kept.

    >>> old = set_autotune(0); _ = set_autotune(old); old >= 0
    True
    """
    old, _AUTOTUNE[0] = _AUTOTUNE[0], int(n)
    return old


def get_autotune():
    """The autotune width (see :func:`set_autotune`)."""
    return _AUTOTUNE[0]


def stats():
    """Counters: ``builds`` (plans built), ``hits`` (calls served by a cached plan), ``fallbacks`` (calls that ran
    the legacy path), ``executes``, ``vpack_builds``, ``vpack_hits``."""
    return dict(_stats)


def fallback_reasons():
    """``{problem: reason}`` for the problems the graph path sent to the legacy path."""
    return {str(k): v for k, v in _why.items()}


def plan_info():
    """One dict per cached plan: kind, shapes, engine global index, workspace, candidates timed (ms)."""
    out = []
    for k, p in _plans.items():
        if p is not None:
            out.append({"kind": p.kind, "x": p.x_shape, "w": p.cdims.w_shape, "dtype": str(p.dtype),
                        "engine": p.engine, "workspace": p.ws_size, "tuned": p.tuned})
    return out


def clear_cache():
    """Forget (and destroy) every cached plan.

    >>> clear_cache()
    """
    plans = [p for p in _plans.values() if p is not None]
    _plans.clear()
    _why.clear()
    if _bound[0]:
        for p in plans:
            p.destroy()


# ---------------------------------------------------------------------------------------------
# Plans

def _packed(shape):
    n, c, h, w = shape
    return (c * h * w, h * w, w, 1)


class GraphPlan:
    """The operation graph and the finalized execution plan of one problem.

    ``kind`` is ``"fwd"``, ``"fwd_relu"``, ``"fwd_identity"`` (conv + bias [+ relu]), ``"fwd_relu_nob"``
    (conv + relu, no bias), ``"bwd_data"`` or ``"bwd_filter"``. ``x_shape`` is the input as cuDNN sees it
    (padded by ``extra_pad`` where the padding is asymmetric, as the legacy ``Plan``).
    """

    def __init__(self, kind, cdims, dtype):
        self.kind, self.cdims, self.dtype = kind, cdims, np.dtype(dtype)
        t, b, l, r = cdims.pad
        ph, pw = min(t, b), min(l, r)
        self.sym_pad = (ph, pw)
        extra = (t - ph, b - ph, l - pw, r - pw)
        self.extra_pad = extra if any(extra) else None
        n, c, h, w = cdims.x_shape
        self.x_shape = (n, c, h + extra[0] + extra[1], w + extra[2] + extra[3])
        self._keep = []          # every descriptor (destroyed with the plan) and every ctypes buffer
        self.plan = None
        self.engine = None
        self.ws_size = 0
        self.tuned = []
        self.vpacks = {}
        self.uids = None
        self.n_ptrs = 0

    def describe(self):
        c = self.cdims
        return (f"{self.kind}: x {self.x_shape}, w {c.w_shape}, y {c.y_shape} {self.dtype}, stride {c.stride}, "
                f"pad {c.pad}, dilation {c.dilation}, groups {c.groups}, "
                f"{'cross-correlation' if c.flipped else 'convolution'}")

    # -- building ------------------------------------------------------------------------------
    def _desc(self, kind):
        d = _create(kind)
        self._keep.append(d)
        return d

    def _tensor(self, uid, shape, dtype_enum, virtual=False):
        d = self._desc(D_TENSOR)
        what = self.describe
        _set(d, A_T_DTYPE, T_DATA_TYPE, ctypes.c_int(dtype_enum), what)
        _set(d, A_T_DIMS, T_INT64, _ints(*shape), what)
        _set(d, A_T_STRIDES, T_INT64, _ints(*_packed(shape)), what)
        _set(d, A_T_UID, T_INT64, _i64(uid), what)
        _set(d, A_T_ALIGN, T_INT64, _i64(_ALIGN), what)
        if virtual:
            _set(d, A_T_VIRTUAL, T_BOOLEAN, ctypes.c_bool(True), what)
        _finalize(d, "cudnnBackendFinalize(tensor)", what)
        return d

    def _pointwise(self, mode, xd, yd, bd=None):
        what = self.describe
        pw = self._desc(D_POINTWISE)
        _set(pw, A_POINTWISE_MODE, T_POINTWISE_MODE, ctypes.c_int(mode), what)
        _set(pw, A_POINTWISE_MATH_PREC, T_DATA_TYPE, ctypes.c_int(self.compute), what)
        _finalize(pw, "cudnnBackendFinalize(pointwise)", what)
        op = self._desc(D_OP_POINTWISE)
        _set(op, A_PW_DESC, T_BACKEND_DESCRIPTOR, _P(pw), what)
        _set(op, A_PW_X, T_BACKEND_DESCRIPTOR, _P(xd), what)
        if bd is not None:
            _set(op, A_PW_B, T_BACKEND_DESCRIPTOR, _P(bd), what)
        _set(op, A_PW_Y, T_BACKEND_DESCRIPTOR, _P(yd), what)
        _finalize(op, "cudnnBackendFinalize(pointwise op)", what)
        return op

    def build(self, handle):
        what = self.describe
        c = self.cdims
        dt = _DTYPES[self.dtype]
        self.compute = DATA_DOUBLE if self.dtype == np.float64 else DATA_FLOAT
        conv = self._desc(D_CONVOLUTION)
        _set(conv, A_CONV_COMP_TYPE, T_DATA_TYPE, ctypes.c_int(self.compute), what)
        _set(conv, A_CONV_MODE, T_CONVOLUTION_MODE, ctypes.c_int(CROSS_CORRELATION if c.flipped else CONVOLUTION),
             what)
        _set(conv, A_CONV_DIMS, T_INT64, _i64(2), what)
        _set(conv, A_CONV_DILATIONS, T_INT64, _ints(*c.dilation), what)
        _set(conv, A_CONV_STRIDES, T_INT64, _ints(*c.stride), what)
        _set(conv, A_CONV_PRE_PAD, T_INT64, _ints(*self.sym_pad), what)
        _set(conv, A_CONV_POST_PAD, T_INT64, _ints(*self.sym_pad), what)
        _finalize(conv, "cudnnBackendFinalize(convolution)", what)
        scal = ctypes.c_double if self.compute == DATA_DOUBLE else ctypes.c_float
        stype = T_DOUBLE if self.compute == DATA_DOUBLE else T_FLOAT
        one, zero = scal(1.0), scal(0.0)
        self._keep_buffers = [one, zero]
        K = c.w_shape[0]
        xd = self._tensor(_UID_X, self.x_shape, dt)
        wd = self._tensor(_UID_W, c.w_shape, dt)
        kind = self.kind
        ops = []
        if kind.startswith("fwd"):
            fused = kind != "fwd"
            with_bias = kind in ("fwd_relu", "fwd_identity")
            with_relu = kind in ("fwd_relu", "fwd_relu_nob")
            yd = self._tensor(_UID_Y, c.y_shape, dt)
            conv_out = self._tensor(_UID_V1, c.y_shape, self.compute, virtual=True) if fused else yd
            op = self._desc(D_OP_CONV_FWD)
            _set(op, A_FWD_X, T_BACKEND_DESCRIPTOR, _P(xd), what)
            _set(op, A_FWD_W, T_BACKEND_DESCRIPTOR, _P(wd), what)
            _set(op, A_FWD_Y, T_BACKEND_DESCRIPTOR, _P(conv_out), what)
            _set(op, A_FWD_CONV, T_BACKEND_DESCRIPTOR, _P(conv), what)
            _set(op, A_FWD_ALPHA, stype, one, what)
            _set(op, A_FWD_BETA, stype, zero, what)
            _finalize(op, "cudnnBackendFinalize(convolution forward op)", what)
            ops.append(op)
            uids = [_UID_X, _UID_W, _UID_Y]
            cur = conv_out
            if with_bias:
                bd = self._tensor(_UID_B, (1, K, 1, 1), dt)
                out = self._tensor(_UID_V2, c.y_shape, self.compute, virtual=True) if with_relu else yd
                ops.append(self._pointwise(PW_ADD, cur, out, bd))
                cur = out
                uids.append(_UID_B)
            if with_relu:
                ops.append(self._pointwise(PW_RELU_FWD, cur, yd))
        elif kind == "bwd_data":
            dyd = self._tensor(_UID_Y, c.y_shape, dt)
            op = self._desc(D_OP_CONV_BWD_DATA)
            _set(op, A_BD_DX, T_BACKEND_DESCRIPTOR, _P(xd), what)
            _set(op, A_BD_W, T_BACKEND_DESCRIPTOR, _P(wd), what)
            _set(op, A_BD_DY, T_BACKEND_DESCRIPTOR, _P(dyd), what)
            _set(op, A_BD_CONV, T_BACKEND_DESCRIPTOR, _P(conv), what)
            _set(op, A_BD_ALPHA, stype, one, what)
            _set(op, A_BD_BETA, stype, zero, what)
            _finalize(op, "cudnnBackendFinalize(convolution backward data op)", what)
            ops.append(op)
            uids = [_UID_X, _UID_W, _UID_Y]
        elif kind == "bwd_filter":
            dyd = self._tensor(_UID_Y, c.y_shape, dt)
            op = self._desc(D_OP_CONV_BWD_FILTER)
            _set(op, A_BF_X, T_BACKEND_DESCRIPTOR, _P(xd), what)
            _set(op, A_BF_DW, T_BACKEND_DESCRIPTOR, _P(wd), what)
            _set(op, A_BF_DY, T_BACKEND_DESCRIPTOR, _P(dyd), what)
            _set(op, A_BF_CONV, T_BACKEND_DESCRIPTOR, _P(conv), what)
            _set(op, A_BF_ALPHA, stype, one, what)
            _set(op, A_BF_BETA, stype, zero, what)
            _finalize(op, "cudnnBackendFinalize(convolution backward filter op)", what)
            ops.append(op)
            uids = [_UID_X, _UID_W, _UID_Y]
        else:
            raise ValueError(f"unknown graph kind {kind!r}")
        self.uids = _ints(*uids)
        self.n_ptrs = len(uids)
        graph = self._desc(D_OPERATIONGRAPH)
        _set(graph, A_GRAPH_HANDLE, T_HANDLE, _P(handle), what)
        _set(graph, A_GRAPH_OPS, T_BACKEND_DESCRIPTOR, _descs(*ops), what)
        _finalize(graph, "cudnnBackendFinalize(operation graph)", what)
        self.graph = graph
        self.handle = handle

    def configs(self, mode):
        """The engine configurations the heuristics of ``mode`` propose, in order (descriptors)."""
        what = self.describe
        heur = self._desc(D_ENGINEHEUR)
        _set(heur, A_HEUR_GRAPH, T_BACKEND_DESCRIPTOR, _P(self.graph), what)
        _set(heur, A_HEUR_MODE, T_HEUR_MODE, ctypes.c_int(mode), what)
        _finalize(heur, "cudnnBackendFinalize(engine heuristics)", what)
        count = _i64()
        _check(_fn.cudnnBackendGetAttribute(heur, A_HEUR_RESULTS, T_BACKEND_DESCRIPTOR, 0, ctypes.byref(count), None),
               "cudnnBackendGetAttribute(ENGINEHEUR_RESULTS count)", what)
        n = count.value
        if n <= 0:
            return []
        cfgs = _descs(*[self._desc(D_ENGINECFG) for _ in range(n)])
        got = _i64()
        _check(_fn.cudnnBackendGetAttribute(heur, A_HEUR_RESULTS, T_BACKEND_DESCRIPTOR, n, ctypes.byref(got), cfgs),
               "cudnnBackendGetAttribute(ENGINEHEUR_RESULTS)", what)
        return list(cfgs[:got.value])

    def notes(self, cfg):
        """``(engine global index, numerical notes, behavior notes)`` of an engine configuration."""
        eng = self._desc(D_ENGINE)
        got = _i64()
        _check(_fn.cudnnBackendGetAttribute(cfg, A_CFG_ENGINE, T_BACKEND_DESCRIPTOR, 1, ctypes.byref(got),
                                            _descs(eng)),
               "cudnnBackendGetAttribute(ENGINECFG_ENGINE)", self.describe)
        idx = _i64(-1)
        _fn.cudnnBackendGetAttribute(eng, A_ENGINE_INDEX, T_INT64, 1, ctypes.byref(got), ctypes.byref(idx))
        num = (ctypes.c_int * 16)()
        n_num = _i64(0)
        if _fn.cudnnBackendGetAttribute(eng, A_ENGINE_NUMERICAL_NOTE, T_NUMERICAL_NOTE, 16, ctypes.byref(n_num), num):
            n_num.value = 0
        beh = (ctypes.c_int * 16)()
        n_beh = _i64(0)
        if _fn.cudnnBackendGetAttribute(eng, A_ENGINE_BEHAVIOR_NOTE, T_BEHAVIOR_NOTE, 16, ctypes.byref(n_beh), beh):
            n_beh.value = 0
        return int(idx.value), set(num[:n_num.value]), set(beh[:n_beh.value])

    def try_plan(self, cfg):
        """A finalized execution plan of ``cfg`` and its workspace size, or None."""
        plan = _create(D_EXECUTION_PLAN)
        ok = False
        try:
            if _fn.cudnnBackendSetAttribute(plan, A_PLAN_HANDLE, T_HANDLE, 1, ctypes.byref(_P(self.handle))):
                return None
            if _fn.cudnnBackendSetAttribute(plan, A_PLAN_CONFIG, T_BACKEND_DESCRIPTOR, 1, ctypes.byref(_P(cfg))):
                return None
            if _fn.cudnnBackendFinalize(plan):
                return None
            ws = _i64(0)
            got = _i64()
            _check(_fn.cudnnBackendGetAttribute(plan, A_PLAN_WORKSPACE, T_INT64, 1, ctypes.byref(got),
                                                ctypes.byref(ws)),
                   "cudnnBackendGetAttribute(EXECUTION_PLAN_WORKSPACE_SIZE)", self.describe)
            ok = True
            return plan, int(ws.value)
        finally:
            if not ok:
                _fn.cudnnBackendDestroyDescriptor(plan)

    def destroy(self):
        for vp in self.vpacks.values():
            _fn.cudnnBackendDestroyDescriptor(vp[0])
        self.vpacks.clear()
        for p in [self.plan] + [t[0] for t in getattr(self, "_spare", [])]:
            if p:
                _fn.cudnnBackendDestroyDescriptor(p)
        self.plan = None
        for d in reversed(self._keep):
            _fn.cudnnBackendDestroyDescriptor(d)
        self._keep = []

    # -- running -------------------------------------------------------------------------------
    def vpack(self, ptrs, ws):
        """The finalized variant pack for data pointers ``ptrs`` (a tuple) and workspace ``ws`` (cached)."""
        key = ptrs + (ws,)
        vp = self.vpacks.get(key)
        if vp is not None:
            _stats["vpack_hits"] += 1
            return vp[0]
        d = _create(D_VARIANT_PACK)
        arr = (_P * self.n_ptrs)(*ptrs)
        wsp = _P(ws)
        try:
            _check(_fn.cudnnBackendSetAttribute(d, A_VP_PTRS, T_VOID_PTR, self.n_ptrs, arr),
                   "cudnnBackendSetAttribute(VARIANT_PACK_DATA_POINTERS)", self.describe)
            _check(_fn.cudnnBackendSetAttribute(d, A_VP_UIDS, T_INT64, self.n_ptrs, self.uids),
                   "cudnnBackendSetAttribute(VARIANT_PACK_UNIQUE_IDS)", self.describe)
            _check(_fn.cudnnBackendSetAttribute(d, A_VP_WORKSPACE, T_VOID_PTR, 1, ctypes.byref(wsp)),
                   "cudnnBackendSetAttribute(VARIANT_PACK_WORKSPACE)", self.describe)
            _check(_fn.cudnnBackendFinalize(d), "cudnnBackendFinalize(variant pack)", self.describe)
        except CudnnError:
            _fn.cudnnBackendDestroyDescriptor(d)
            raise
        if len(self.vpacks) >= _VPACK_LIMIT:
            old = self.vpacks.pop(next(iter(self.vpacks)))
            _fn.cudnnBackendDestroyDescriptor(old[0])
        self.vpacks[key] = (d, arr, wsp)
        _stats["vpack_builds"] += 1
        return d

    def execute(self, handle, ptrs, plan=None, ws_size=None):
        plan = self.plan if plan is None else plan
        ws_size = self.ws_size if ws_size is None else ws_size
        ws = _legacy._workspace(ws_size)
        vp = self.vpack(ptrs, ws)
        _check(_fn.cudnnBackendExecute(handle, plan, vp), "cudnnBackendExecute", self.describe)
        _stats["executes"] += 1


def _choose(p, handle, ptrs):
    """Finalize execution plans in heuristics order (filtered by the options) and keep one (timed if asked)."""
    opts = _legacy._OPTIONS
    fp32 = p.dtype == np.float32
    limit = opts["workspace_limit"]
    want = max(1, _AUTOTUNE[0])
    found, later, seen = [], [], set()
    for mode in (HEUR_MODE_A, HEUR_MODE_FALLBACK):
        try:
            cfgs = p.configs(mode)
        except CudnnError:
            continue
        for cfg in cfgs:
            try:
                idx, num, beh = p.notes(cfg)
            except CudnnError:
                continue
            if NOTE_DOWN_CONVERT_INPUTS in num:
                continue
            if fp32 and not opts["allow_tf32"] and NOTE_TENSOR_CORE in num:
                continue
            if opts["deterministic"] and NOTE_NONDETERMINISTIC in num:
                continue
            if BEHAVIOR_RUNTIME_COMPILATION in beh:
                later.append((idx, cfg))
                continue
            if (mode, idx) in seen:
                continue
            seen.add((mode, idx))
            got = p.try_plan(cfg)
            if got is None:
                continue
            if got[1] > limit:
                _fn.cudnnBackendDestroyDescriptor(got[0])
                continue
            found.append((got[0], got[1], idx))
            if len(found) >= want:
                break
        if len(found) >= want or (found and want == 1):
            break   # with autotuning, the FALLBACK heuristics' configurations join the pool
    if not found:
        for idx, cfg in later:
            got = p.try_plan(cfg)
            if got is not None and got[1] <= limit:
                found.append((got[0], got[1], idx))
                break
            if got is not None:
                _fn.cudnnBackendDestroyDescriptor(got[0])
    if not found:
        return False
    best = 0
    if len(found) > 1:
        best = _time(p, handle, ptrs, found)
    p.plan, p.ws_size, p.engine = found[best]
    for i, f in enumerate(found):
        if i != best:
            _fn.cudnnBackendDestroyDescriptor(f[0])
    return True


def _events_ms(run, n=5):
    """Milliseconds per call of ``run()``: once to warm up, then ``n`` back-to-back calls under CUDA events
    from an idle stream, so that host time between launches counts as it does in a training step (work
    already queued would otherwise hide it); inf if it fails."""
    try:
        run()
        cupy.cuda.get_current_stream().synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(n):
            run()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / n
    except (CudnnError, cupy.cuda.memory.OutOfMemoryError):
        return float("inf")


def _time(p, handle, ptrs, found):
    """Index of the fastest of the ``found`` plans, each timed by :func:`_events_ms`."""
    times = []
    for plan, ws, idx in found:
        t = _events_ms(lambda: p.execute(handle, ptrs, plan, ws))
        # the variant packs were made for this plan's workspace pointer: they are valid for any plan
        times.append(t)
        p.tuned.append((idx, round(t, 4)))
    return int(np.argmin(times))


_MISSING = object()


LEGACY_MARGIN = 0.8   # with autotuning, the legacy call keeps a problem where it takes under 80% of the plan's time


def _get(kind, cdims, dtype, handle, bufs, args, legacy=None):
    """``(plan, buffers)``: the cached :class:`GraphPlan` of the problem (built on first use, on the call's own
    buffers ``bufs(plan, *args)``) or ``(None, None)`` where the legacy path must run: no plan finalizes, or
    (with autotuning) ``legacy()``, the legacy call on the same arguments, is clearly faster."""
    key = (kind, cdims, dtype, _legacy._options_key, _AUTOTUNE[0], cupy.cuda.runtime.getDevice())
    p = _plans.get(key, _MISSING)
    if p is not _MISSING:
        if p is None:
            return None, None
        _stats["hits"] += 1
        return p, bufs(p, *args)
    _stats["builds"] += 1
    if cdims.groups > 1 and not _GROUPS[0]:
        _why[key] = "groups > 1 run on the legacy path"
        _plans[key] = None
        return None, None
    _bind()
    p = GraphPlan(kind, cdims, dtype)
    got = None
    try:
        p.build(handle)
        got = bufs(p, *args)
        ok = _choose(p, handle, got[0])
    except CudnnError as err:
        ok = False
        _why[key] = str(err)
    if ok and legacy is not None and _AUTOTUNE[0]:
        t_graph = _events_ms(lambda: p.execute(handle, got[0]))
        t_legacy = _events_ms(legacy)
        p.tuned.append(("legacy", round(t_legacy, 4)))
        if t_legacy < LEGACY_MARGIN * t_graph:
            _why[key] = f"the legacy call was faster ({t_legacy:.4f} ms against {t_graph:.4f} ms)"
            _stats["legacy_faster"] += 1
            ok = False
    if not ok:
        _why.setdefault(key, f"no engine configuration finalized for {p.describe()}")
        p.destroy()
        _plans[key] = None
        return None, None
    _plans[key] = p
    return p, got


_GROUPS = [True]


# ---------------------------------------------------------------------------------------------
# The operations (the legacy signatures)

def _aligned(a):
    if a.data.ptr % _ALIGN:
        a = a.copy()
    return a


def _contig(a, dtype):
    return _aligned(_legacy._contig(a, dtype))


def _fwd_bufs(p, x, w, b, dtype):
    x = _aligned(_legacy._prepare_x(p, x))
    w = _contig(w, dtype)
    y = cupy.empty(p.cdims.y_shape, dtype=dtype)
    if b is None:
        return (x.data.ptr, w.data.ptr, y.data.ptr), y, (x, w)
    b = _contig(b, dtype)
    return (x.data.ptr, w.data.ptr, y.data.ptr, b.data.ptr), y, (x, w, b)


def _bwd_data_bufs(p, dy, w, dtype):
    dy = _contig(dy, dtype)
    w = _contig(w, dtype)
    dx = cupy.empty(p.x_shape, dtype=dtype)
    return (dx.data.ptr, w.data.ptr, dy.data.ptr), dx, (dy, w)


def _bwd_filter_bufs(p, x, dy, dtype):
    x = _aligned(_legacy._prepare_x(p, x))
    dy = _contig(dy, dtype)
    dw = cupy.empty(p.cdims.w_shape, dtype=dtype)
    return (x.data.ptr, dw.data.ptr, dy.data.ptr), dw, (x, dy)


def conv_forward(x, w, cdims):
    """``conv_forward(x, w, cdims)``: the convolution through a cached execution plan (legacy fallback)."""
    return _forward("fwd", x, w, None, cdims)


def conv_bias_act_forward(x, w, b, kind, cdims):
    """``conv_bias_act_forward(x, w, b, kind, cdims)``: ``act(conv(x, w) + b)`` for ``kind`` ``"relu"`` or
    ``"identity"`` in one graph (conv -> add bias -> relu). ``b`` None: no bias. Falls back to the legacy
    fused call (which may return None: the caller composes)."""
    if kind == "relu":
        gkind = "fwd_relu" if b is not None else "fwd_relu_nob"
    elif kind == "identity":
        gkind = "fwd_identity" if b is not None else "fwd"
    else:
        return _legacy.conv_bias_act_forward(x, w, b, kind, cdims)
    return _forward(gkind, x, w, b, cdims)


def _forward(gkind, x, w, b, cdims):
    dtype = x.dtype
    if dtype in _DTYPES:
        if not _bound[0]:
            _bind()
        handle = _legacy._handle()
        p, got = _get(gkind, cdims, dtype, handle, _fwd_bufs, (x, w, b, dtype),
                      legacy=lambda: _legacy_forward(gkind, x, w, b, cdims))
        if p is not None:
            p.execute(handle, got[0])
            return got[1]
    _stats["fallbacks"] += 1
    return _legacy_forward(gkind, x, w, b, cdims)


def _legacy_forward(gkind, x, w, b, cdims):
    if gkind == "fwd":
        return _legacy.conv_forward(x, w, cdims)
    kind = "relu" if gkind.startswith("fwd_relu") else "identity"
    return _legacy.conv_bias_act_forward(x, w, b, kind, cdims)


def conv_backward_data(dy, w, cdims):
    """``conv_backward_data(dy, w, cdims)``: ``dx`` of shape ``cdims.x_shape`` through a cached plan."""
    dtype = w.dtype
    if dtype in _DTYPES:
        if not _bound[0]:
            _bind()
        handle = _legacy._handle()
        p, got = _get("bwd_data", cdims, dtype, handle, _bwd_data_bufs, (dy, w, dtype),
                      legacy=lambda: _legacy.conv_backward_data(dy, w, cdims))
        if p is not None:
            p.execute(handle, got[0])
            dx = got[1]
            if p.extra_pad is not None:
                t, b, l, r = p.extra_pad
                dx = cupy.ascontiguousarray(dx[:, :, t:p.x_shape[2] - b, l:p.x_shape[3] - r])
            return dx
    _stats["fallbacks"] += 1
    return _legacy.conv_backward_data(dy, w, cdims)


def conv_backward_filter(x, dy, cdims):
    """``conv_backward_filter(x, dy, cdims)``: ``dw`` of shape ``cdims.w_shape`` through a cached plan."""
    dtype = x.dtype
    if dtype in _DTYPES:
        if not _bound[0]:
            _bind()
        handle = _legacy._handle()
        p, got = _get("bwd_filter", cdims, dtype, handle, _bwd_filter_bufs, (x, dy, dtype),
                      legacy=lambda: _legacy.conv_backward_filter(x, dy, cdims))
        if p is not None:
            p.execute(handle, got[0])
            return got[1]
    _stats["fallbacks"] += 1
    return _legacy.conv_backward_filter(x, dy, cdims)


# ---------------------------------------------------------------------------------------------
# Registration

_NAMES = ("conv_forward", "conv_bias_act_forward", "conv_backward_data", "conv_backward_filter")


def register():
    """Use the graph versions of the four convolution kernels for CuPy arrays; False without CuPy.

    >>> register() == (cupy is not None) and (unregister() or True)
    True
    """
    if cupy is None:
        return False
    from . import cuda_conv, register as _register
    cuda_conv.register()
    for name in _NAMES:
        _register(name, "cupy", globals()[name])
    return True


def unregister():
    """Restore the legacy kernels (:func:`fluxpy.kernels.cuda_conv.register`); False without CuPy."""
    if cupy is None:
        return False
    from . import cuda_conv
    return cuda_conv.register()
