"""cuDNN's fused scaled dot-product attention (flash-style, forward and backward) for float16 and bfloat16, built
with NVIDIA's ``nvidia-cudnn-frontend``.

Only the frontend builds cuDNN's attention graphs (an SDPA node is dozens of backend descriptors and the engines'
rules about them), so this module is the one place fluxpy uses it; the convolution and normalisation graphs stay on
fluxpy's own binding (``docs/cudnn_frontend.md`` has the measurements). Both load the same ``libcudnn.so.9``, and a
graph built here runs on fluxpy's handle (:func:`fluxpy.kernels.cudnn.handle.get_handle`, bound to CuPy's current
stream), with its workspace from CuPy's pool for the call: it runs inside a CUDA-graph capture.

A problem (:class:`Problem`: sizes, heads, dtype, the inputs' strides, causal or not, the bias's shape and whether
it needs a gradient, deterministic or not) builds its forward graph, and for training its backward graph, once;
later calls are a dictionary lookup and one ``execute`` each. A problem cuDNN declines (a head size over its
limit, an architecture before Ampere, a bias whose gradient no engine computes) is remembered with the reason, and
the op runs its composite: :func:`problem_of` says why from shapes, dtypes and strides alone, before any work,
:func:`declined` what cuDNN said.

Layouts: ``q`` ``(N, Lq, heads * dqk)``, ``k`` ``(N, Lk, heads * dqk)``, ``v`` ``(N, Lk, heads * dv)``, each with
unit stride on the feature axis, are read in place as cuDNN's ``(N, heads, L, d)`` tensors (a head is a stride,
not a copy); ``o`` and the gradients are written ``(N, L, heads * d)`` C-ordered; the softmax statistics (the
log-sum-exp per query, float32) are kept for the backward pass. ``bias`` is ``(Nb, Hb, Lq, Lk)``, ``Nb`` in ``{1,
N}`` and ``Hb`` in ``{1, heads}``, of the inputs' dtype.

>>> Problem(2, 3, 4, 4, 8, 8, "float16", (96, 24), (96, 24), (96, 24), True, None, False, False).heads
3
"""
from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

import numpy as np

from ...backend import cupy
from ...options import options
from .descriptors import _c_strides

__all__ = ["Problem", "frontend", "problem_of", "declined", "forward", "backward", "stats", "clear_cache"]

_lock = threading.RLock()
_frontend: list = []          # [module or None, why not]
_plans: dict = {}             # (problem, "forward" | "inference" | "backward", device) -> _Plan
_declined: dict = {}          # problem key -> the reason cuDNN gave
_capability: dict = {}        # device -> (major, minor)
_calls = {"built": 0, "executed": 0}


class Problem(NamedTuple):
    """What a fused attention call's graphs depend on (a cache key). ``q_strides``, ``k_strides``, ``v_strides``:
    the inputs' element strides of their batch and sequence axes; ``bias``: the bias's 4-D shape or None;
    ``bias_grad``: whether the backward writes its gradient; ``deterministic``: the backward's algorithm;
    ``dropout``: the probability of dropping a score (cuDNN's Philox dropout, from a seed and an offset on the
    device), 0 for none."""
    n: int
    heads: int
    lq: int
    lk: int
    dqk: int
    dv: int
    dtype: str
    q_strides: tuple
    k_strides: tuple
    v_strides: tuple
    causal: bool
    bias: tuple | None
    bias_grad: bool
    deterministic: bool
    dropout: float = 0.0


def frontend() -> Any:
    """The ``cudnn`` module of ``nvidia-cudnn-frontend``, or None where it cannot be imported (the reason is in
    :func:`problem_of`). Imported once, on first use.

    >>> frontend() is None or hasattr(frontend(), "pygraph")
    True
    """
    with _lock:
        if not _frontend:
            try:
                import cudnn as module
                module.pygraph   # noqa: B018 (another package named cudnn would not have it)
                _frontend[:] = [module, ""]
            except Exception as err:   # not installed, or its library would not load
                _frontend[:] = [None, f"nvidia-cudnn-frontend could not be imported ({type(err).__name__}: {err}); "
                                      "install fluxpy's cuda extra"]
        return _frontend[0]


def _frontend_reason() -> str:
    frontend()
    return _frontend[1]


def _device_capability() -> tuple:
    dev = cupy.cuda.runtime.getDevice()
    cap = _capability.get(dev)
    if cap is None:
        props = cupy.cuda.runtime.getDeviceProperties(dev)
        cap = _capability[dev] = (int(props["major"]), int(props["minor"]))
    return cap


def _row_strides(a: Any, who: str) -> tuple | str:
    """``(batch stride, sequence stride)`` in elements of an ``(N, L, F)`` array read as ``(N, heads, L, d)``, or
    why it cannot be."""
    item = a.dtype.itemsize
    sn, sl, sf = (s // item for s in a.strides)
    if sf != 1 and a.shape[2] > 1:
        return f"{who}'s feature axis is not contiguous (strides {a.strides})"
    if a.data.ptr % 16 or sn % 8 or sl % 8:
        return f"{who} is not 16-byte aligned in its rows (pointer {a.data.ptr:#x}, strides {a.strides})"
    return sn, sl


def problem_of(q: Any, k: Any, v: Any, heads: int, causal: bool, bias_shape: tuple | None,
               bias_grad: bool, dropout: float = 0.0) -> Problem | str:
    """The :class:`Problem` of a call, or a string saying why cuDNN's fused attention cannot take it (from the
    shapes, dtypes and strides alone: nothing runs).

    >>> problem_of(np.ones((1, 2, 8)), np.ones((1, 2, 8)), np.ones((1, 2, 8)), 1, False, None, False)
    'fused attention takes CuPy arrays, got numpy arrays'
    """
    if cupy is None or not all(isinstance(a, cupy.ndarray) for a in (q, k, v)):
        return f"fused attention takes CuPy arrays, got {type(q).__module__} arrays"
    dtype = q.dtype
    if dtype.name not in ("float16", "bfloat16") or k.dtype != dtype or v.dtype != dtype:
        return f"fused attention takes float16 or bfloat16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    n, lq, fq = q.shape
    lk, fv = k.shape[1], v.shape[2]
    dqk, dv = fq // heads, fv // heads
    if dqk % 8 or dv % 8 or dqk > 256 or dv > 256 or (dqk != dv and (dqk, dv) != (192, 128)):
        return f"cuDNN's fused attention takes head sizes that are multiples of 8 up to 256, got {dqk} and {dv}"
    if min(n, lq, lk) < 1:
        return f"fused attention needs at least one query and one key, got q {q.shape}, k {k.shape}"
    if _device_capability() < (8, 0):
        return f"cuDNN's fused attention needs compute capability 8.0 or later, got {_device_capability()}"
    strides = [_row_strides(a, name) for a, name in ((q, "q"), (k, "k"), (v, "v"))]
    for s in strides:
        if isinstance(s, str):
            return s
    if frontend() is None:
        return _frontend_reason()
    problem = Problem(n, heads, lq, lk, dqk, dv, dtype.name, *strides, bool(causal), bias_shape, bool(bias_grad),
                      bool(options.deterministic), float(dropout))
    return _declined.get(problem, problem)


def declined(p: Problem, training: bool) -> str | None:
    """Why cuDNN will not run problem ``p`` (None where it will): the reason it gave when asked to build the forward
    graph (and, for ``training``, the backward one), asked once per problem and remembered.

    >>> declined.__name__   # needs a GPU: tests/gpu/test_attention_gpu.py runs it
    'declined'
    """
    try:
        _plan(p, "forward" if training else "inference")
        if training:
            _plan(p, "backward")
    except _Declined as err:
        return str(err)
    return None


class _Declined(RuntimeError):
    pass


class _Plan(NamedTuple):
    graph: Any
    uids: tuple
    workspace: int


def _dtype(cudnn, name):
    return {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16}[name]


def _head_tensor(g, name, io, n, heads, length, d, strides):
    sn, sl = strides
    return g.tensor(name=name, dim=[n, heads, length, d], stride=[sn, d, sl, 1], data_type=io)


def _out_dims(n, heads, length, d):
    return [n, heads, length, d], [length * heads * d, d, heads * d, 1]


def _mask_args(cudnn, p: Problem) -> dict:
    if not p.causal:
        return {}
    return {"diagonal_band_right_bound": 0, "diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT}


def _dropout_args(cudnn, g, p: Problem, ins: list) -> dict:
    """The ``dropout`` argument (probability, seed, offset), the seed and offset tensors appended to ``ins``."""
    if not p.dropout:
        return {}
    one = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64)
    seed, offset = g.tensor(name="seed", **one), g.tensor(name="offset", **one)
    ins += [seed, offset]
    return {"dropout": (p.dropout, seed, offset)}


def _bias_tensor(g, io, p: Problem, name="bias"):
    shape = list(p.bias)
    return g.tensor(name=name, dim=shape, stride=list(_c_strides(shape)), data_type=io)


_wrapped: dict = {}    # (device, stream, handle) -> the frontend's Handle around fluxpy's cuDNN handle


def _handle() -> Any:
    """fluxpy's cuDNN handle of the current device, bound to CuPy's current stream, as the frontend's ``Handle``
    (one wrapper per device and stream, made once)."""
    from .handle import get_handle
    ptr = get_handle()
    dev, stream = cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr
    h = _wrapped.get((dev, stream, ptr))
    if h is None:
        h = _wrapped[(dev, stream, ptr)] = frontend().Handle(ptr, dev, stream)
    return h


def _graph(cudnn, io):
    f32 = cudnn.data_type.FLOAT
    return cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=_handle())


def _start(p: Problem):
    """``(cudnn, io dtype, graph, q, k, v)``: a new graph and its three inputs, read in place (see the module)."""
    cudnn = frontend()
    io = _dtype(cudnn, p.dtype)
    g = _graph(cudnn, io)
    q = _head_tensor(g, "q", io, p.n, p.heads, p.lq, p.dqk, p.q_strides)
    k = _head_tensor(g, "k", io, p.n, p.heads, p.lk, p.dqk, p.k_strides)
    v = _head_tensor(g, "v", io, p.n, p.heads, p.lk, p.dv, p.v_strides)
    return cudnn, io, g, q, k, v


def _build_forward(p: Problem, training: bool) -> _Plan:
    cudnn, io, g, q, k, v = _start(p)
    ins = [q, k, v]
    extra = _mask_args(cudnn, p)
    if p.bias is not None:
        extra["bias"] = _bias_tensor(g, io, p)
        ins.append(extra["bias"])
    extra.update(_dropout_args(cudnn, g, p, ins))
    o, lse = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=1.0 / math.sqrt(p.dqk), generate_stats=training,
                    **extra)
    dims, strides = _out_dims(p.n, p.heads, p.lq, p.dv)
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(io)
    outs = [o]
    if training:
        lse.set_output(True).set_dim([p.n, p.heads, p.lq, 1]).set_stride([p.heads * p.lq, p.lq, 1, 1]) \
            .set_data_type(cudnn.data_type.FLOAT)
        outs.append(lse)
    return _finish(cudnn, g, ins + outs)


def _build_backward(p: Problem) -> _Plan:
    cudnn, io, g, q, k, v = _start(p)
    dims, strides = _out_dims(p.n, p.heads, p.lq, p.dv)
    o = g.tensor(name="o", dim=dims, stride=strides, data_type=io)
    do = g.tensor(name="do", dim=dims, stride=strides, data_type=io)
    lse = g.tensor(name="stats", dim=[p.n, p.heads, p.lq, 1], stride=[p.heads * p.lq, p.lq, 1, 1],
                   data_type=cudnn.data_type.FLOAT)
    ins = [q, k, v, o, do, lse]
    extra = _mask_args(cudnn, p)
    outs_extra = []
    if p.bias is not None:
        extra["bias"] = _bias_tensor(g, io, p)
        ins.append(extra["bias"])
        if p.bias_grad:
            extra["dBias"] = _bias_tensor(g, io, p, "dbias")
            extra["dBias"].set_output(True)
            outs_extra.append(extra["dBias"])
    extra.update(_dropout_args(cudnn, g, p, ins))
    dq, dk, dvv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do, stats=lse,
                                  attn_scale=1.0 / math.sqrt(p.dqk), use_deterministic_algorithm=p.deterministic,
                                  **extra)
    for t, length, d in ((dq, p.lq, p.dqk), (dk, p.lk, p.dqk), (dvv, p.lk, p.dv)):
        dims, strides = _out_dims(p.n, p.heads, length, d)
        t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(io)
    return _finish(cudnn, g, ins + [dq, dk, dvv] + outs_extra)


def _finish(cudnn, g, tensors) -> _Plan:
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    _calls["built"] += 1
    return _Plan(g, tuple(t.get_uid() if hasattr(t, "get_uid") else t.uid for t in tensors), g.get_workspace_size())


def _plan(p: Problem, kind: str) -> _Plan:
    key = (p, kind, cupy.cuda.runtime.getDevice())
    plan = _plans.get(key)
    if plan is not None:
        return plan
    with _lock:
        if p in _declined:
            raise _Declined(_declined[p])
        try:
            plan = _build_backward(p) if kind == "backward" else _build_forward(p, kind == "forward")
        except Exception as err:   # cuDNN (through the frontend) declines the problem: the op runs its composite
            _declined[p] = (f"cuDNN's fused attention declined {p} ({kind}): {type(err).__name__}: "
                            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}")
            raise _Declined(_declined[p]) from None
        _plans[key] = plan
        return plan


def _execute(plan: _Plan, pointers: list) -> None:
    from .handle import Workspace
    ws = Workspace(plan.workspace)
    plan.graph.execute(pointers, ws.ptr, handle=_handle(), tensor_uids=plan.uids)
    _calls["executed"] += 1


def forward(p: Problem, q: Any, k: Any, v: Any, bias: Any = None, training: bool = True,
            rng: tuple | None = None) -> tuple[Any, Any]:
    """``(o, stats)``: the attention output ``(N, Lq, heads * dv)`` and, for ``training``, the softmax statistics
    ``(N, heads, Lq, 1)`` float32 that :func:`backward` reads (None otherwise). ``bias``: ``p.bias``'s shape,
    C-ordered, of the inputs' dtype; ``rng``: with ``p.dropout``, the ``(seed, offset)`` int64 device arrays of
    :meth:`fluxpy.kernels.philox.PhiloxGenerator.reserve` (the backward takes the same pair).

    >>> forward.__name__   # needs a GPU: tests/gpu/test_attention_gpu.py runs it
    'forward'
    """
    plan = _plan(p, "forward" if training else "inference")
    o = cupy.empty((p.n, p.lq, p.heads * p.dv), dtype=q.dtype)
    pointers = [q.data.ptr, k.data.ptr, v.data.ptr] + ([bias.data.ptr] if p.bias is not None else [])
    pointers += [rng[0].data.ptr, rng[1].data.ptr] if p.dropout else []
    pointers.append(o.data.ptr)
    lse = None
    if training:
        lse = cupy.empty((p.n, p.heads, p.lq, 1), dtype=np.float32)
        pointers.append(lse.data.ptr)
    _execute(plan, pointers)
    return o, lse


def backward(p: Problem, q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, bias: Any = None,
             rng: tuple | None = None) -> tuple:
    """``(dq, dk, dv, dbias)`` of :func:`forward`'s call given the output's cotangent ``do`` (any strides: made
    C-ordered here); ``dbias`` is None unless ``p.bias_grad``.

    >>> backward.__name__   # needs a GPU: tests/gpu/test_attention_gpu.py runs it
    'backward'
    """
    plan = _plan(p, "backward")
    do = cupy.ascontiguousarray(do)
    dq = cupy.empty((p.n, p.lq, p.heads * p.dqk), dtype=q.dtype)
    dk = cupy.empty((p.n, p.lk, p.heads * p.dqk), dtype=q.dtype)
    dv = cupy.empty((p.n, p.lk, p.heads * p.dv), dtype=q.dtype)
    pointers = [q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, do.data.ptr, lse.data.ptr]
    dbias = None
    if p.bias is not None:
        pointers.append(bias.data.ptr)
    pointers += [rng[0].data.ptr, rng[1].data.ptr] if p.dropout else []
    pointers += [dq.data.ptr, dk.data.ptr, dv.data.ptr]
    if p.bias_grad:
        dbias = cupy.empty(p.bias, dtype=q.dtype)
        pointers.append(dbias.data.ptr)
    _execute(plan, pointers)
    return dq, dk, dv, dbias


def stats() -> dict:
    """``{"built": graphs built, "executed": calls run, "cached": graphs held, "declined": problems declined}``.

    >>> sorted(stats())
    ['built', 'cached', 'declined', 'executed']
    """
    return dict(_calls, cached=len(_plans), declined=len(_declined))


def clear_cache() -> None:
    """Forget every built graph and every declined problem.

    >>> clear_cache(); stats()["cached"]
    0
    """
    with _lock:
        _plans.clear()
        _declined.clear()
