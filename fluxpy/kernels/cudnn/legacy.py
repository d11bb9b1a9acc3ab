"""cuDNN's legacy convolution calls (``cudnnConvolution*``) on CuPy arrays, with algorithms found once per
problem and kept on disk.

Every function takes C-contiguous-able CuPy arrays and a :class:`fluxpy.ops.dims.ConvDims`:

- :func:`conv_forward` (``cudnnConvolutionForward``), :func:`conv_bias_act_forward`
  (``cudnnConvolutionBiasActivationForward``, relu or identity), :func:`conv_backward_data`,
  :func:`conv_backward_filter`.
- A :class:`Plan` holds the tensor, filter, convolution and activation descriptors of one
  ``(ConvDims, dtype)`` under the current options on the current device, built once (:func:`plan`).
  ``flipped=False`` (true convolution) is ``CUDNN_CONVOLUTION``, ``flipped=True``
  ``CUDNN_CROSS_CORRELATION``; asymmetric padding is split by :mod:`fluxpy.kernels.cudnn.geometry`.
  1-d problems run as 2-d ones with a unit axis, 3-d ones with 5-d (``Nd``) descriptors (see that module).
- Algorithms: on a problem's first use ``cudnnFind*AlgorithmEx`` times them; the ranked list is
  kept in memory and (with the ``disk_cache`` option) in a JSON file per GPU model and cuDNN version under
  the ``cache_dir`` option's ``cudnn/`` (:func:`cache_file`). The workspace
  (:class:`fluxpy.kernels.cudnn.handle.Workspace`, taken per call) is limited by the ``workspace_limit``
  option; when it cannot be had, the next algorithm needing less is used.
- float16 and bfloat16 (stored in 16 bits, computed in float32 on tensor cores: ``PSEUDO_HALF_CONFIG`` and
  ``PSEUDO_BFLOAT16_CONFIG``), float32 and float64. Plans and algorithm choices are keyed by dtype.

The module imports without CuPy or cuDNN.

>>> sorted(stats())
['disk_hits', 'find', 'oom_fallbacks', 'plans']
"""
from __future__ import annotations

import ctypes

import numpy as np

from ...backend import cupy
from ...options import options
from ..cuda_arrays import c_contiguous
from ..halfs import BFLOAT16, is_half
from . import library
from .diskcache import DiskTable
from .descriptors import (activation_descriptor, convolution_descriptor, describe, destroy, filter_descriptor, ints,
                          nd_function, scalars, tensor_descriptor)
from .errors import BAD_PARAM, NOT_SUPPORTED, CudnnError, check
from .geometry import (ConvDimsLike, contiguous, crop_dx, descriptor_geometry, descriptor_shape, pad_input,
                       split_pad)
from .handle import Workspace, get_handle, options_key
from .library import fn

__all__ = ["Plan", "plan", "stats", "clear_cache", "cache_file", "conv_forward", "conv_bias_act_forward",
           "half_to_float32", "float32_to_half",
           "compose_bias_act", "conv_backward_data", "conv_backward_filter"]

# ---------------------------------------------------------------------------------------------
# Enums of the legacy API (cudnn_ops.h, cudnn_cnn.h of cuDNN 9)

DEFAULT_MATH, TENSOR_OP_MATH, TENSOR_OP_MATH_ALLOW_CONVERSION, FMA_MATH = 0, 1, 2, 3   # cudnnMathType_t
ACTIVATION_RELU, ACTIVATION_IDENTITY = 1, 5                 # cudnnActivationMode_t
FWD_IMPLICIT_PRECOMP_GEMM = 1                               # cudnnConvolutionFwdAlgo_t
FWD_ALGOS = ("IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT", "FFT", "FFT_TILING", "WINOGRAD",
             "WINOGRAD_NONFUSED")
BWD_DATA_ALGOS = ("ALGO_0", "ALGO_1", "FFT", "FFT_TILING", "WINOGRAD", "WINOGRAD_NONFUSED")
BWD_FILTER_ALGOS = ("ALGO_0", "ALGO_1", "FFT", "ALGO_3", "WINOGRAD", "WINOGRAD_NONFUSED", "FFT_TILING")
ALGO_NAMES = {"fwd": FWD_ALGOS, "bwd_data": BWD_DATA_ALGOS, "bwd_filter": BWD_FILTER_ALGOS}
ACTIVATIONS = {"relu": ACTIVATION_RELU, "identity": ACTIVATION_IDENTITY}


class Perf(ctypes.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t (the three share one layout)."""
    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int), ("mathType", ctypes.c_int),
                ("reserved", ctypes.c_int * 3)]


def math_type(dtype) -> int:
    """The ``cudnnMathType_t`` for ``dtype`` under the options: tensor ops for float16 and bfloat16, the default
    for float64, and for float32 ``CUDNN_FMA_MATH`` unless ``allow_tf32``.

    >>> from fluxpy.kernels.halfs import BFLOAT16
    >>> math_type(np.float16) == math_type(BFLOAT16) == TENSOR_OP_MATH
    True
    """
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return DEFAULT_MATH
    if is_half(dtype):
        return TENSOR_OP_MATH
    return DEFAULT_MATH if options.allow_tf32 else FMA_MATH


# ---------------------------------------------------------------------------------------------
# Plans

class Plan:
    """The cuDNN descriptors and algorithm choices of one ``(ConvDims, dtype)``, built once.

    Fields: ``cdims``, ``dtype``, ``x_shape`` (the input as cuDNN sees it: padded by
    ``extra_pad`` where the padding is asymmetric), ``sym_pad`` ``(ph, pw)``, ``extra_pad``
    ``(top, bottom, left, right)`` or None (one or a pair per spatial axis), descriptors ``xd, wd, yd, bd, convd``
    (ints, of :func:`~fluxpy.kernels.cudnn.geometry.descriptor_shape`: a 1-d problem's with a unit axis), the
    activation descriptors ``act[kind]``, and ``algos[kind]``: the ranked usable
    ``(algo, math_type, memory)`` triples, found on first use.
    """
    __slots__ = ("cdims", "dtype", "x_shape", "sym_pad", "extra_pad", "xd", "wd", "yd", "bd", "convd", "act",
                 "math", "cur_math", "algos", "one", "zero", "one_p", "zero_p", "fused_ok", "__weakref__")

    def __init__(self, cdims, dtype):
        self.cdims, self.dtype = cdims, np.dtype(dtype)
        self.sym_pad, self.extra_pad, self.x_shape = split_pad(cdims)
        y_shape = descriptor_shape(cdims.y_shape)
        self.xd = tensor_descriptor(descriptor_shape(self.x_shape), dtype)
        self.wd = filter_descriptor(descriptor_shape(cdims.w_shape), dtype)
        self.yd = tensor_descriptor(y_shape, dtype)
        self.bd = tensor_descriptor((1, cdims.w_shape[0]) + (1,) * (len(y_shape) - 2), dtype)
        self.math = self.cur_math = math_type(dtype)
        self.convd = convolution_descriptor(cdims, descriptor_geometry(cdims, self.sym_pad), self.dtype, self.math,
                                            self.describe)
        self._check_output_shape()
        self.act = {kind: activation_descriptor(mode) for kind, mode in ACTIVATIONS.items()}
        self.one, self.zero = scalars(self.dtype)   # kept alive: their addresses go to cuDNN
        self.one_p, self.zero_p = ctypes.addressof(self.one), ctypes.addressof(self.zero)
        self.algos = {}
        self.fused_ok = {"relu": True, "identity": True}

    def _check_output_shape(self):
        """Raise where cuDNN's output shape differs from ConvDims' (never silently wrong)."""
        want = descriptor_shape(self.cdims.y_shape)
        if len(want) == 4:
            call = "cudnnGetConvolution2dForwardOutputDim"
            dims = [ctypes.c_int() for _ in range(4)]
            check(fn.cudnnGetConvolution2dForwardOutputDim(self.convd, self.xd, self.wd, *map(ctypes.byref, dims)),
                  call, self.describe)
            got = tuple(d.value for d in dims)
        else:
            call = "cudnnGetConvolutionNdForwardOutputDim"
            dims = ints(*want)
            check(nd_function(call)(self.convd, self.xd, self.wd, len(want), dims), call, self.describe)
            got = tuple(dims)
        if got != want:
            raise CudnnError(call, BAD_PARAM, self.describe(),
                             f"cuDNN's output shape {got} differs from ConvDims' {want}")

    def describe(self) -> str:
        """The problem in words (for errors)."""
        return describe(self.cdims, self.dtype, self.x_shape)

    def set_math(self, math: int) -> None:
        """Set the convolution descriptor's math type (where it differs from the current one)."""
        if math != self.cur_math:
            check(fn.cudnnSetConvolutionMathType(self.convd, math), "cudnnSetConvolutionMathType", self.describe)
            self.cur_math = math

    def destroy(self) -> None:
        """Free the descriptors."""
        for d in (self.xd, self.yd, self.bd):
            destroy("Tensor", d)
        destroy("Filter", self.wd)
        destroy("Convolution", self.convd)
        for a in self.act.values():
            destroy("Activation", a)


_plans = {}
_stats = {"find": 0, "disk_hits": 0, "plans": 0, "oom_fallbacks": 0}


def stats() -> dict:
    """Counters: ``find`` (cudnnFind* runs), ``disk_hits``, ``plans`` built, ``oom_fallbacks``.

    >>> sorted(stats())
    ['disk_hits', 'find', 'oom_fallbacks', 'plans']
    """
    return dict(_stats)


def plan(cdims: ConvDimsLike, dtype) -> Plan:
    """The :class:`Plan` of ``(cdims, dtype)`` on the current device under the current options (built once)."""
    key = (cdims, dtype, options_key(), cupy.cuda.runtime.getDevice())
    p = _plans.get(key)
    if p is None:
        library.require()
        p = _plans[key] = Plan(cdims, dtype)
        _stats["plans"] += 1
    return p


def clear_cache(memory: bool = True, disk: bool = False) -> None:
    """Forget the plans and algorithm choices in memory, and with ``disk=True`` delete the cache file.

    >>> clear_cache()
    """
    if memory:
        plans = list(_plans.values())
        _plans.clear()
        if library.loaded():
            for p in plans:
                p.destroy()
    _DISK.forget(disk=disk)


# ---------------------------------------------------------------------------------------------
# The algorithm cache on disk: {key: [[algo, math, memory, determinism, time_ms], ...]}

_DISK = DiskTable("")


def cache_file() -> str | None:
    """The JSON file of algorithm choices for this GPU model and cuDNN version (None without cuDNN)."""
    return _DISK.path()


def _key_str(kind, p):
    c = p.cdims
    return (f"{kind}|x{p.x_shape}|w{c.w_shape}|s{c.stride}|p{p.sym_pad}|d{c.dilation}|g{c.groups}|"
            f"{'xcorr' if c.flipped else 'conv'}|{p.dtype.name}|tf32={int(options.allow_tf32)}|"
            f"det={int(options.deterministic)}|ws={options.workspace_limit}").replace(" ", "")


# ---------------------------------------------------------------------------------------------
# Finding and running algorithms

_OOM = ()


def _oom_types():
    global _OOM
    if not _OOM:
        _OOM = (cupy.cuda.memory.OutOfMemoryError,)
    return _OOM


def _max_workspace(kind, p, h):
    get = {"fwd": fn.cudnnGetConvolutionForwardWorkspaceSize,
           "bwd_data": fn.cudnnGetConvolutionBackwardDataWorkspaceSize,
           "bwd_filter": fn.cudnnGetConvolutionBackwardFilterWorkspaceSize}[kind]
    descs = {"fwd": (p.xd, p.wd, p.convd, p.yd), "bwd_data": (p.wd, p.yd, p.convd, p.xd),
             "bwd_filter": (p.xd, p.yd, p.convd, p.wd)}[kind]
    most = 0
    size = ctypes.c_size_t()
    for algo in range(len(ALGO_NAMES[kind])):
        if get(h, *descs, algo, ctypes.byref(size)) == 0:
            most = max(most, size.value)
    return most


def _find_workspace(kind, p, h):
    """``(memory or None, nbytes)``: the largest workspace an algorithm of ``kind`` asks for, within the
    ``workspace_limit`` option, quartered while it cannot be had."""
    want = min(_max_workspace(kind, p, h), options.workspace_limit)
    while True:
        try:
            return (cupy.cuda.alloc(want) if want else None), want
        except _oom_types():
            _stats["oom_fallbacks"] += 1
            if want == 0:
                raise
            want //= 4
            if want < (1 << 20):
                want = 0


_FIND = {"fwd": "cudnnFindConvolutionForwardAlgorithmEx", "bwd_data": "cudnnFindConvolutionBackwardDataAlgorithmEx",
         "bwd_filter": "cudnnFindConvolutionBackwardFilterAlgorithmEx"}


def _find(kind, p, h, a, b, out):
    """Run cudnnFind*AlgorithmEx for ``kind`` on real buffers; the ranked usable rows."""
    ws, want = _find_workspace(kind, p, h)
    n = len(ALGO_NAMES[kind])
    perf = (Perf * n)()
    got = ctypes.c_int()
    descs = {"fwd": (p.xd, p.wd, p.yd), "bwd_data": (p.wd, p.yd, p.xd), "bwd_filter": (p.xd, p.yd, p.wd)}[kind]
    call = _FIND[kind]
    status = getattr(fn, call)(h, descs[0], a, descs[1], b, p.convd, descs[2], out, n, ctypes.byref(got), perf,
                               0 if ws is None else ws.ptr, want)
    check(status, call, p.describe)
    _stats["find"] += 1
    det = options.deterministic
    rows = []
    for r in perf[:got.value]:
        if r.status != 0 or r.memory > want or (det and r.determinism != 1):
            continue
        rows.append([int(r.algo), int(r.mathType), int(r.memory), int(r.determinism), float(r.time)])
    if not rows:
        raise CudnnError(call, NOT_SUPPORTED, p.describe(),
                         "no usable algorithm" + (" among the deterministic ones" if det else "")
                         + f" within a workspace of {want} bytes")
    return rows


def _algos(kind, p, h, a, b, out):
    """The ranked ``(algo, math, memory)`` rows of ``kind`` for plan ``p``: memory, disk, else Find."""
    rows = p.algos.get(kind)
    if rows is not None:
        return rows
    key = _key_str(kind, p)
    found = _DISK.get(key) if options.disk_cache else None
    if found:
        _stats["disk_hits"] += 1
    else:
        found = _find(kind, p, h, a, b, out)
        if options.disk_cache:
            _DISK.put(key, found)
    rows = p.algos[kind] = [(int(r[0]), int(r[1]), int(r[2])) for r in found]
    return rows


def _run(kind, p, h, a, b, out, f, call, pre, post):
    """``f(*pre, algo, ws, wsize, *post)`` with the best algorithm whose workspace can be had."""
    rows = p.algos.get(kind)
    if rows is None:
        rows = _algos(kind, p, h, a, b, out)
    last = None
    for algo, math, memory in rows:
        try:
            ws = Workspace(memory)
        except _oom_types() as err:
            _stats["oom_fallbacks"] += 1
            last = err
            continue
        if math != p.cur_math:
            p.set_math(math)
        status = f(*pre, algo, ws.ptr, memory, *post)
        if status == 0:
            return
        last = CudnnError(call, status, p.describe(), f"algorithm {ALGO_NAMES.get(kind, FWD_ALGOS)[algo]}")
        if status not in (BAD_PARAM, NOT_SUPPORTED) and status // 1000 != 3:
            raise last
    if last is None:
        last = CudnnError(call, NOT_SUPPORTED, p.describe(), "no algorithm")
    raise last


# ---------------------------------------------------------------------------------------------
# The operations

def conv_forward(x: cupy.ndarray, w: cupy.ndarray, cdims: ConvDimsLike) -> cupy.ndarray:
    """``cudnnConvolutionForward``: ``conv(x, w)`` of shape ``cdims.y_shape``."""
    dtype = x.dtype
    p = plan(cdims, dtype)
    h = get_handle()
    x = pad_input(x, p.extra_pad)
    w = contiguous(w, dtype)
    y = cupy.empty(cdims.y_shape, dtype=dtype)
    xp_, wp_, yp_ = x.data.ptr, w.data.ptr, y.data.ptr
    _run("fwd", p, h, xp_, wp_, yp_, fn.cudnnConvolutionForward, "cudnnConvolutionForward",
         (h, p.one_p, p.xd, xp_, p.wd, wp_, p.convd), (p.zero_p, p.yd, yp_))
    return y


def half_to_float32(a: cupy.ndarray) -> cupy.ndarray:
    """A float16 or bfloat16 CuPy array as float32 (bfloat16 by its bits: the top half of a float32).

    >>> import ml_dtypes
    >>> from fluxpy.backend import gpu_available
    >>> out = None   # stays None without a GPU
    >>> if gpu_available()[0]:
    ...     out = half_to_float32(cupy.asarray(np.array([1.5, -2.0], ml_dtypes.bfloat16))).tolist()
    >>> out in (None, [1.5, -2.0])
    True
    """
    if a.dtype == BFLOAT16:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def float32_to_half(a: cupy.ndarray, dtype) -> cupy.ndarray:
    """A float32 CuPy array rounded to nearest even in ``dtype`` (float16 or bfloat16; NaN stays NaN).

    >>> import ml_dtypes
    >>> from fluxpy.backend import gpu_available
    >>> out = None   # stays None without a GPU
    >>> if gpu_available()[0]:
    ...     out = half_to_float32(float32_to_half(cupy.asarray([1.0, 3.0], np.float32), ml_dtypes.bfloat16)).tolist()
    >>> out in (None, [1.0, 3.0])
    True
    """
    if np.dtype(dtype) != BFLOAT16:
        return a.astype(dtype)
    u = c_contiguous(a).view(np.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return cupy.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16).view(BFLOAT16)


def compose_bias_act(y: cupy.ndarray, b: cupy.ndarray | None, kind: str) -> cupy.ndarray:
    """``act(y + b)`` in place on ``y`` (``b`` of shape ``(K,)`` or None; ``kind`` ``"relu"`` or ``"identity"``):
    what the fused call computes, for where cuDNN refuses it. The halves add in float32 and round once."""
    if is_half(y.dtype):
        y32 = compose_bias_act(half_to_float32(y), None if b is None else half_to_float32(b), kind)
        y.view(np.uint16)[...] = float32_to_half(y32, y.dtype).view(np.uint16)   # a bit copy: no half kernel
        return y
    if b is not None:
        y += b.reshape((1, -1) + (1,) * (y.ndim - 2))
    if kind == "relu":
        cupy.maximum(y, 0, out=y)
    return y


def conv_bias_act_forward(x: cupy.ndarray, w: cupy.ndarray, b: cupy.ndarray | None, kind: str,
                          cdims: ConvDimsLike) -> cupy.ndarray:
    """``act(conv(x, w) + b)`` in one ``cudnnConvolutionBiasActivationForward`` for ``kind`` ``"relu"`` or
    ``"identity"``; ``b`` is ``(K,)`` or None (no bias).

    Identity runs only with ``IMPLICIT_PRECOMP_GEMM`` (cuDNN's rule). Where cuDNN refuses the fused
    call (``NOT_SUPPORTED``) the plan remembers it, and this (and every later call of the problem)
    runs :func:`conv_forward` and :func:`compose_bias_act` instead: there is always a result.
    """
    if kind not in ACTIVATIONS:
        raise ValueError(f"conv_bias_act_forward: kind must be 'relu' or 'identity', got {kind!r}")
    dtype = x.dtype
    p = plan(cdims, dtype)
    if not p.fused_ok[kind]:
        return compose_bias_act(conv_forward(x, w, cdims), b, kind)
    h = get_handle()
    xc = pad_input(x, p.extra_pad)
    wc = contiguous(w, dtype)
    bc = cupy.zeros(cdims.w_shape[0], dtype=dtype) if b is None else contiguous(b, dtype)
    y = cupy.empty(cdims.y_shape, dtype=dtype)
    xp_, wp_, yp_ = xc.data.ptr, wc.data.ptr, y.data.ptr
    f, call = fn.cudnnConvolutionBiasActivationForward, "cudnnConvolutionBiasActivationForward"
    pre = (h, p.one_p, p.xd, xp_, p.wd, wp_, p.convd)
    post = (p.zero_p, p.yd, yp_, p.bd, bc.data.ptr, p.act[kind], p.yd, yp_)
    try:
        if kind == "identity":
            _identity_algos(p, h)
            _run("fwd_identity", p, h, xp_, wp_, yp_, f, call, pre, post)
        else:
            _run("fwd", p, h, xp_, wp_, yp_, f, call, pre, post)
    except CudnnError as err:
        refused = err.status // 1000 == 3 or (is_half(dtype) and err.status == BAD_PARAM)
        if not refused:
            raise
        p.fused_ok[kind] = False   # NOT_SUPPORTED* (BAD_PARAM for a half config it lacks): remember, and compose
        return compose_bias_act(conv_forward(x, w, cdims), b, kind)
    return y


def _identity_algos(p, h):
    """The one algorithm the fused identity call may use (``IMPLICIT_PRECOMP_GEMM``), with its workspace."""
    if p.algos.get("fwd_identity") is None:
        size = ctypes.c_size_t()
        p.set_math(p.math)
        check(fn.cudnnGetConvolutionForwardWorkspaceSize(h, p.xd, p.wd, p.convd, p.yd, FWD_IMPLICIT_PRECOMP_GEMM,
                                                         ctypes.byref(size)),
              "cudnnGetConvolutionForwardWorkspaceSize", p.describe)
        p.algos["fwd_identity"] = [(FWD_IMPLICIT_PRECOMP_GEMM, p.math, size.value)]


def conv_backward_data(dy: cupy.ndarray, w: cupy.ndarray, cdims: ConvDimsLike) -> cupy.ndarray:
    """``cudnnConvolutionBackwardData``: ``dx`` of shape ``cdims.x_shape``."""
    dtype = w.dtype
    p = plan(cdims, dtype)
    h = get_handle()
    dy = contiguous(dy, dtype)
    w = contiguous(w, dtype)
    dx = cupy.empty(p.x_shape, dtype=dtype)
    dyp, wp_, dxp = dy.data.ptr, w.data.ptr, dx.data.ptr
    _run("bwd_data", p, h, wp_, dyp, dxp, fn.cudnnConvolutionBackwardData, "cudnnConvolutionBackwardData",
         (h, p.one_p, p.wd, wp_, p.yd, dyp, p.convd), (p.zero_p, p.xd, dxp))
    return crop_dx(dx, p.extra_pad)


def conv_backward_filter(x: cupy.ndarray, dy: cupy.ndarray, cdims: ConvDimsLike) -> cupy.ndarray:
    """``cudnnConvolutionBackwardFilter``: ``dw`` of shape ``cdims.w_shape``."""
    dtype = x.dtype
    p = plan(cdims, dtype)
    h = get_handle()
    x = pad_input(x, p.extra_pad)
    dy = contiguous(dy, dtype)
    dw = cupy.empty(cdims.w_shape, dtype=dtype)
    xp_, dyp, dwp = x.data.ptr, dy.data.ptr, dw.data.ptr
    _run("bwd_filter", p, h, xp_, dyp, dwp, fn.cudnnConvolutionBackwardFilter, "cudnnConvolutionBackwardFilter",
         (h, p.one_p, p.xd, xp_, p.yd, dyp, p.convd), (p.zero_p, p.wd, dwp))
    return dw
