"""GEMMs with fused epilogues through our own ctypes binding of cuBLASLt: the kernels of :func:`fluxpy.ops.dense`.

Two kernels, each one ``cublasLtMatmul`` (row-major arrays, as :mod:`fluxpy.kernels.gemm_plan` explains: cuBLASLt is
column-major, so the row-major ``y = x @ w.T`` is the column-major ``y^T = w x^T``):

- ``dense_forward(x, w, b, act, save)``: ``(act(x @ w.T + b), aux)`` for ``x`` ``(..., k)`` (leading axes flattened
  to ``m`` rows), ``w`` ``(n, k)``, ``b`` ``(n,)`` or None, ``act`` one of :data:`ACTIVATIONS`. cuBLASLt adds the
  bias and applies the activation as the product is stored (``CUBLASLT_EPILOGUE_BIAS``, ``RELU_BIAS``,
  ``GELU_BIAS``; without ``_BIAS`` where ``b`` is None). With ``save`` (gelu only) the same call also writes the
  pre-activation ``x @ w.T + b`` to ``aux`` (``GELU_AUX_BIAS``), which gelu's derivative reads in the backward pass;
  relu's derivative reads the output, so it saves nothing. Not in float32 without TF32: there cuBLASLt's gelu runs
  as a pass of its own after the SIMT product and the saved pre-activation is a second write, so the plan declines
  and the op takes the bias epilogue and fluxpy's gelu (the product kept as the pre-activation), which measured
  faster (BENCHMARKS.md, dense). cuBLASLt's GELU is the tanh approximation, fluxpy's
  ``gelu``; there is no epilogue for the exact ``gelu_erf`` or for swish, which run as ``bias_act``.
- ``dense_backward_weight(dz, x, need_db)``: ``(dz.T @ x, dz.sum(0))``, the weight and bias gradients, the bias
  gradient reduced by the same call (``CUBLASLT_EPILOGUE_BGRADB``: the sum over the product's ``k``, the rows).

Not used: ``DRELU``/``DGELU`` (``_BGRAD``) apply an activation's derivative to a product's *output*: that fits the
data gradient of the layer *after* the activation (``dh = dy @ w2`` times ``gelu'(z1)``), a fusion across two
layers, which a pullback of one ``dense`` cannot make. A layer's own ``dz = dy * act'(z)`` is one elementwise pass
(``bias_act_backward``) before its two products.

Planning is plain Python over shapes, strides, dtypes and addresses (NumPy arrays too, for the tests):
:func:`forward_plan` and :func:`weight_plan` give an :class:`LtGemm` or the reason the call is declined (the op then
runs its composite): float32, float16 or bfloat16 only, one dtype for all operands (the bias in the output's type,
as cuBLASLt reads it), C-contiguous operands, sizes within 32-bit ints, every pointer and every leading dimension a
multiple of 16 bytes, and for a saved pre-activation a leading dimension divisible by 8 (``cublasLt.h``,
``CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD``). float32 computes in float32 (``CUBLAS_COMPUTE_32F``) unless the
``allow_tf32`` option is on; the halves accumulate in float32, split-K reductions included (no reduction in the
half type).

Per problem (the plan, which holds the shapes, dtype, epilogue, transposes, alignments and the TF32 switch) the
matmul descriptor, the three layouts and the algorithm of ``cublasLtMatmulAlgoGetHeuristic`` are built once and
cached per device; a call sets the bias and aux pointers on the cached descriptor and runs. One handle per device;
the workspace is a buffer per stream, allocated once by ``cudaMalloc`` outside CuPy's pools (so it outlives a
captured graph's private pool) and passed to each call, so cuBLASLt allocates nothing during a call and a CUDA-graph
capture takes it. :func:`stats` counts the calls made and the plans built.

The library: the libcublasLt this process has loaded (CuPy's libcublas loads it), else the one beside the
``cublas_library`` option's libcublas, else an ``nvidia`` wheel's (``nvidia/cu13/lib``, ``nvidia/cublas/lib``),
else ``ctypes.util.find_library("cublasLt")``.

>>> import numpy as np
>>> x, w, b = np.zeros((64, 32), np.float32), np.zeros((16, 32), np.float32), np.zeros(16, np.float32)
>>> h = [a.astype(np.float16) for a in (x, w, b)]
>>> forward_plan(*h, "gelu", True).epilogue == EPILOGUES["GELU_AUX_BIAS"]
True
>>> forward_plan(x[:, :30], w[:, :30], b, "gelu", False)
'dense: x must be C-contiguous (its rows one after another), got strides (128, 4)'
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import glob
import os
import sys
import threading
from dataclasses import dataclass, replace

import numpy as np

from ..backend import cupy
from ..options import options
from .cublas import STATUS_NAMES, CublasError, bind
from .gemm_plan import INT_MAX
from .halfs import BFLOAT16, is_half

__all__ = ["ACTIVATIONS", "EPILOGUES", "LtGemm", "forward_plan", "weight_plan", "forward_epilogue", "dense_forward",
           "dense_backward_weight", "dense_forward_supports", "dense_backward_weight_supports", "stats", "declined",
           "clear_cache", "library_path", "KERNELS", "WORKSPACE_BYTES"]

# cublasLtEpilogue_t (cublasLt.h)
EPILOGUES = {"DEFAULT": 1, "RELU": 2, "RELU_AUX": 2 | 128, "BIAS": 4, "RELU_BIAS": 2 | 4, "RELU_AUX_BIAS": 2 | 128 | 4,
             "DRELU": 8 | 128, "DRELU_BGRAD": 8 | 128 | 16, "GELU": 32, "GELU_AUX": 32 | 128, "GELU_BIAS": 32 | 4,
             "GELU_AUX_BIAS": 32 | 128 | 4, "DGELU": 64 | 128, "DGELU_BGRAD": 64 | 128 | 16, "BGRADA": 256,
             "BGRADB": 512}
ACTIVATIONS = ("identity", "relu", "gelu")
"""The activations an epilogue computes: the op's names for fluxpy's ``identity``, ``relu`` and ``gelu``."""

WORKSPACE_BYTES = 32 << 20   # per stream, as cublas.py's (NVIDIA's advice for its recent GPUs)

# cublasLtMatmulDescAttributes_t, cublasLtMatrixLayoutAttribute_t, cublasLtMatmulPreferenceAttributes_t
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_AUX_POINTER, _DESC_AUX_LD = 11, 12
_PREF_MAX_WORKSPACE_BYTES, _PREF_REDUCTION_SCHEME_MASK = 1, 3
_PREF_MIN_ALIGNMENT = {"a": 5, "b": 6, "c": 7, "d": 8}
_REDUCTION_IN_COMPUTE_TYPE = 2                     # cublasLtReductionScheme_t: COMPUTE_TYPE (| NONE, which is 0)
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77      # cublasComputeType_t
_R_32F = 0                                         # cudaDataType_t of the scalars (alpha, beta)
_DATA_TYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 2, BFLOAT16: 14}   # cudaDataType_t
_OP_N, _OP_T = 0, 1                                # cublasOperation_t
_ALIGN = 16         # bytes: what every pointer and leading dimension must be a multiple of here
_MAX_ALIGN = 256    # the largest alignment told to the heuristic (CuPy's allocations are 512-byte aligned)


class _Heuristic(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t``: the algorithm (``cublasLtMatmulAlgo_t``, 8 uint64) and its needs."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_P, _I, _U64, _I64, _S = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
_SIGNATURES = {
    "cublasLtCreate": [_P],
    "cublasLtMatmulDescCreate": [_P, _I, _I],
    "cublasLtMatmulDescSetAttribute": [_P, _I, _P, _S],
    "cublasLtMatmulDescDestroy": [_P],
    "cublasLtMatrixLayoutCreate": [_P, _I, _U64, _U64, _I64],
    "cublasLtMatrixLayoutDestroy": [_P],
    "cublasLtMatmulPreferenceCreate": [_P],
    "cublasLtMatmulPreferenceSetAttribute": [_P, _I, _P, _S],
    "cublasLtMatmulPreferenceDestroy": [_P],
    "cublasLtMatmulAlgoGetHeuristic": [_P, _P, _P, _P, _P, _P, _P, _I, _P, _P],
    "cublasLtMatmul": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _S, _P],
}


def _check(status, call, what=""):
    if status != 0:
        raise CublasError(status, call, what() if callable(what) else what)


# ---------------------------------------------------------------------------------------------
# Planning: plain Python, no CuPy


@dataclass(frozen=True)
class LtGemm:
    """One ``cublasLtMatmul`` in cuBLAS's column-major terms: ``D (m x n, ld ldd) = op(A) op(B)``, then the epilogue.

    ``transa``/``transb``: ``cublasOperation_t`` of ``A`` (``m x k`` after the op) and ``B`` (``k x n``); ``lda``,
    ``ldb``: their leading dimensions as stored; ``epilogue``: a value of :data:`EPILOGUES`; ``aux_ld``: the saved
    pre-activation's leading dimension (0: none); ``align``: the alignment in bytes of the pointers ``(a, b, d,
    bias, aux)`` (0 for an absent one), which the heuristic's choice depends on; ``tf32``: float32 on TF32 cores.
    """
    dtype: np.dtype
    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldd: int
    epilogue: int
    aux_ld: int
    align: tuple
    tf32: bool

    def layouts(self) -> tuple:
        """``(rows, cols, ld)`` of ``A``, ``B`` and ``D`` as stored (column-major), what the layouts describe.

        >>> LtGemm(np.dtype(np.float32), 1, 0, 16, 64, 32, 32, 32, 16, 4, 0, (256,) * 4 + (0,), False).layouts()
        ((32, 16, 32), (32, 64, 32), (16, 64, 16))
        """
        a = (self.k, self.m) if self.transa == _OP_T else (self.m, self.k)
        b = (self.n, self.k) if self.transb == _OP_T else (self.k, self.n)
        return a + (self.lda,), b + (self.ldb,), (self.m, self.n, self.ldd)


def _address(x) -> int:
    """The address of ``x``'s first element: a CuPy array's device pointer, a NumPy array's host one."""
    if cupy is not None and type(x) is cupy.ndarray:
        return x.data.ptr
    return x.ctypes.data


def _alignment(ptr: int) -> int:
    """The alignment of ``ptr`` told to the heuristic: :data:`_MAX_ALIGN` where it divides ``ptr`` (any fresh CuPy
    array), else 16 where that does (a view), else the largest power of two that does. Two classes, not every power
    of two, so that views at different offsets share their plans.

    >>> _alignment(0x7f0000001000), _alignment(0x7f0000001030), _alignment(0x7f0000001004)
    (256, 16, 4)
    """
    if ptr % _MAX_ALIGN == 0:
        return _MAX_ALIGN
    return _ALIGN if ptr % _ALIGN == 0 else ptr & -ptr


def _contiguous(name, a):
    """None where ``a`` is C-contiguous, else the reason."""
    if a.flags.c_contiguous:
        return None
    return f"dense: {name} must be C-contiguous (its rows one after another), got strides {tuple(a.strides)}"


def _aligned(named):
    """None where every ``(name, address)`` is 16-byte aligned, else the reason."""
    for name, ptr in named:
        if ptr % _ALIGN:
            return f"dense: {name} lies at an address that is not a multiple of {_ALIGN} bytes ({ptr:#x})"
    return None


def _dtype_reason(first, dtype, others):
    """None where ``dtype`` (``first``'s) is one cuBLASLt's epilogues run here and ``others`` share it."""
    if dtype not in _DATA_TYPES:
        return f"dense: cuBLASLt's epilogues run float32, float16 and bfloat16 here, got {first} of {dtype}"
    for name, other in others:
        if other is not None and other.dtype != dtype:
            return (f"dense: {name} must have {first}'s dtype {dtype} (cuBLASLt reads all in one type), got "
                    f"{other.dtype}")
    return None


def _ld_reason(dtype, named):
    """None where each ``(name, leading dimension)`` is a multiple of 16 bytes, else the reason."""
    for name, ld in named:
        if ld * dtype.itemsize % _ALIGN:
            return (f"dense: {name} = {ld} elements of {dtype} is {ld * dtype.itemsize} bytes, not a multiple of "
                    f"{_ALIGN}: a leading dimension cuBLASLt's fused kernels do not take")
    return None


def _size_reason(m, n, k):
    if min(m, n, k) < 1:
        return f"dense: an empty product (rows {m}, out {n}, in {k}) needs no cuBLASLt call"
    if max(m, n, k) > INT_MAX:
        return f"dense: sizes (rows {m}, out {n}, in {k}) beyond cuBLAS's 32-bit ints"
    return None


def forward_epilogue(act: str, bias: bool, save: bool) -> int | str:
    """The ``cublasLtEpilogue_t`` computing ``act`` (see :data:`ACTIVATIONS`) with or without a bias, writing the
    pre-activation too where ``save``; or the reason there is none.

    >>> forward_epilogue("relu", True, False) == EPILOGUES["RELU_BIAS"], forward_epilogue("gelu", False, True) == 160
    (True, True)
    >>> forward_epilogue("swish", True, False)
    "dense: no cuBLASLt epilogue computes 'swish' (only 'identity', 'relu', 'gelu')"
    """
    if act not in ACTIVATIONS:
        return f"dense: no cuBLASLt epilogue computes {act!r} (only {', '.join(map(repr, ACTIVATIONS))})"
    if save and act != "gelu":
        return (f"dense: cuBLASLt saves no pre-activation for {act!r}: the derivatives of identity and relu read "
                "the output (relu's aux is a bit-mask)")
    name = {"identity": "DEFAULT", "relu": "RELU", "gelu": "GELU_AUX" if save else "GELU"}[act]
    if bias:
        name = "BIAS" if name == "DEFAULT" else name + "_BIAS"
    return EPILOGUES[name]


def _slower_than_ours(act: str, save: bool, dtype) -> str | None:
    """Why an epilogue that cuBLASLt runs is declined as slower than the bias epilogue and fluxpy's own activation
    kernel (``benchmarks/dense_epilogues.py``), or None: float32 gelu saving its pre-activation, without TF32.

    >>> _slower_than_ours("gelu", True, np.dtype(np.float16)) is None
    True
    """
    if save and act == "gelu" and dtype == np.float32 and not _tf32(dtype):
        return ("dense: cuBLASLt's float32 gelu runs as a pass of its own after the product, and saving the "
                "pre-activation writes it once more: the bias epilogue and fluxpy's gelu, the product kept as the "
                "pre-activation, measure faster (BENCHMARKS.md, dense)")
    return None


def forward_plan(x, w, b, act: str, save: bool) -> LtGemm | str:
    """The :class:`LtGemm` of ``act(x @ w.T + b)`` (the pre-activation saved where ``save``), or why it is declined.

    Column-major, ``D = y^T`` (``n x m``, ld ``n``) is ``op(A) op(B)`` with ``A`` the weight stored as ``k x n``
    (ld ``k``), transposed, and ``B`` the rows of ``x`` stored as ``k x m`` (ld ``k``); the bias has one value per
    row of ``D``, as cuBLASLt's bias epilogues take it.

    >>> import numpy as np
    >>> p = forward_plan(np.zeros((2, 8, 32), np.float32), np.zeros((16, 32), np.float32), None, "relu", False)
    >>> (p.m, p.n, p.k, p.transa, p.transb, p.epilogue == EPILOGUES["RELU"])
    (16, 16, 32, 1, 0, True)
    >>> forward_plan(np.zeros((4, 5), np.float16), np.zeros((8, 5), np.float16), None, "identity", False)
    "dense: in features (ld of x and w) = 5 elements of float16 is 10 bytes, not a multiple of 16: a leading \
dimension cuBLASLt's fused kernels do not take"
    """
    epilogue = forward_epilogue(act, b is not None, save)
    if isinstance(epilogue, str):
        return epilogue
    dtype = x.dtype
    reason = _dtype_reason("x", dtype, (("the weight", w), ("the bias", b)))
    if reason:
        return reason
    if len(w.shape) != 2 or len(x.shape) < 1 or x.shape[-1] != w.shape[1] or \
            (b is not None and tuple(b.shape) != (w.shape[0],)):
        return (f"dense: shapes x {tuple(x.shape)}, weight {tuple(w.shape)}, bias "
                f"{None if b is None else tuple(b.shape)} do not fit (x (..., in), weight (out, in), bias (out,))")
    n, k = w.shape
    m = x.size // k if k else 0
    reason = _size_reason(m, n, k) or _contiguous("x", x) or _contiguous("the weight", w) or \
        (b is not None and _contiguous("the bias", b)) or \
        _ld_reason(dtype, (("in features (ld of x and w)", k), ("out features (ld of y)", n)))
    if reason:
        return reason
    pointers = [("x", _address(x)), ("the weight", _address(w))]
    reason = _aligned(pointers + ([("the bias", _address(b))] if b is not None else []))
    if reason:
        return reason
    if save and n % 8:
        return (f"dense: the saved pre-activation's leading dimension (out features {n}) must be divisible by 8 "
                "(cublasLt.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD)")
    reason = _slower_than_ours(act, save, dtype)
    if reason:
        return reason
    align = (_alignment(_address(w)), _alignment(_address(x)), _MAX_ALIGN,
             _alignment(_address(b)) if b is not None else 0, _MAX_ALIGN if save else 0)
    return LtGemm(dtype, _OP_T, _OP_N, n, m, k, k, k, n, epilogue, n if save else 0, align, _tf32(dtype))


def weight_plan(dz, x, need_db: bool) -> LtGemm | str:
    """The :class:`LtGemm` of ``dz.T @ x`` (``dz`` ``(m, n)``, ``x`` ``(m, k)``), with ``dz.sum(0)`` where
    ``need_db``, or why it is declined.

    Column-major, ``D = dW^T`` (``k x n``, ld ``k``) is ``A B^T``: ``A`` the rows of ``x`` stored as ``k x m``
    (ld ``k``), ``B^T`` the rows of ``dz`` stored as ``n x m`` (ld ``n``), transposed. The product's ``k`` is the
    ``m`` rows, the dimension ``BGRADB`` sums ``B`` over, giving one value per column of ``D``: ``db``.

    >>> import numpy as np
    >>> p = weight_plan(np.zeros((64, 16), np.float32), np.zeros((64, 32), np.float32), True)
    >>> (p.m, p.n, p.k, p.transa, p.transb, p.lda, p.ldb, p.ldd, p.epilogue == EPILOGUES["BGRADB"])
    (32, 16, 64, 0, 1, 32, 16, 32, True)
    """
    dtype = dz.dtype
    reason = _dtype_reason("dz", dtype, (("x", x),))
    if reason:
        return reason
    if len(dz.shape) != 2 or len(x.shape) != 2 or dz.shape[0] != x.shape[0]:
        return f"dense: the weight gradient needs dz (rows, out) and x (rows, in), got {tuple(dz.shape)} and " \
               f"{tuple(x.shape)}"
    (m, n), k = dz.shape, x.shape[1]
    reason = _size_reason(m, n, k) or _contiguous("dz", dz) or _contiguous("x", x) or \
        _ld_reason(dtype, (("in features (ld of x and dW)", k), ("out features (ld of dz)", n))) or \
        _aligned((("dz", _address(dz)), ("x", _address(x))))
    if reason:
        return reason
    epilogue = EPILOGUES["BGRADB"] if need_db else EPILOGUES["DEFAULT"]
    align = (_alignment(_address(x)), _alignment(_address(dz)), _MAX_ALIGN, _MAX_ALIGN if need_db else 0, 0)
    return LtGemm(dtype, _OP_N, _OP_T, k, n, m, k, n, k, epilogue, 0, align, _tf32(dtype))


def _tf32(dtype) -> bool:
    return dtype == np.float32 and bool(options.allow_tf32)


# ---------------------------------------------------------------------------------------------
# The library


_lib: list = [None, None]   # the bound library and its path, once loaded
_lock = threading.Lock()


def _mapped(prefix):
    """The path of a library whose name starts with ``prefix`` that this process has loaded, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ")[-1]
                if os.path.basename(path).startswith(prefix):
                    return path
    except OSError:
        pass
    return None


def _candidates():
    """Where libcublasLt may be, in the order tried (see the module docstring)."""
    yield _mapped("libcublasLt.so")
    if options.cublas_library:
        yield from sorted(glob.glob(os.path.join(os.path.dirname(options.cublas_library), "libcublasLt.so*")))
    for site in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cublas/lib"):
            yield from sorted(glob.glob(os.path.join(site, sub, "libcublasLt.so*")))
    yield ctypes.util.find_library("cublasLt")


def _load():
    if _lib[0] is not None:   # loaded: no lock needed to read it
        return _lib[0]
    with _lock:
        if _lib[0] is not None:
            return _lib[0]
        if cupy is not None:
            try:
                from cupy_backends.cuda.libs import cublas as _cupy_cublas  # noqa: F401  (loads libcublasLt)
            except ImportError:
                pass
        for path in _candidates():
            if not path:
                continue
            lib = bind(path, _SIGNATURES)
            _lib[0], _lib[1] = lib, path
            return lib
        raise OSError("cuBLASLt was not found: CuPy has not loaded libcublasLt, none lies beside the cublas_library "
                      "option's libcublas or in an nvidia wheel (nvidia/cu13/lib, nvidia/cublas/lib), and "
                      "ctypes.util.find_library('cublasLt') found nothing")


def library_path() -> str | None:
    """The cuBLASLt library this module binds (loading it on first call), or None where none is found.

    >>> library_path() is None or "cublasLt" in library_path()
    True
    """
    try:
        _load()
    except OSError:
        return None
    return _lib[1]


# ---------------------------------------------------------------------------------------------
# Descriptors, plans and the per-device state


def _set(lib, setter, obj, attr, value, what):
    """Set one attribute (``value`` a ctypes scalar) of a descriptor or preference."""
    _check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), setter.__name__, what)


class _Described:
    """The matmul descriptor, the ``A``/``B``/``D`` layouts and the preference of one :class:`LtGemm` (no handle
    needed: this much runs without a GPU). ``close()`` destroys them."""

    def __init__(self, lib, plan: LtGemm):
        self.lib, self.plan = lib, plan
        self.desc = self.pref = None
        self.layouts = []
        what = lambda: repr(plan)   # noqa: E731
        try:
            d = ctypes.c_void_p()
            compute = _COMPUTE_32F_FAST_TF32 if plan.tf32 else _COMPUTE_32F
            _check(lib.cublasLtMatmulDescCreate(ctypes.byref(d), compute, _R_32F), "cublasLtMatmulDescCreate", what)
            self.desc = d.value
            setter = lib.cublasLtMatmulDescSetAttribute
            _set(lib, setter, self.desc, _DESC_TRANSA, ctypes.c_int32(plan.transa), what)
            _set(lib, setter, self.desc, _DESC_TRANSB, ctypes.c_int32(plan.transb), what)
            _set(lib, setter, self.desc, _DESC_EPILOGUE, ctypes.c_uint32(plan.epilogue), what)
            if plan.aux_ld:
                _set(lib, setter, self.desc, _DESC_AUX_LD, ctypes.c_int64(plan.aux_ld), what)
            for rows, cols, ld in plan.layouts():
                lay = ctypes.c_void_p()
                _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), _DATA_TYPES[plan.dtype], rows, cols, ld),
                       "cublasLtMatrixLayoutCreate", what)
                self.layouts.append(lay.value)
            p = ctypes.c_void_p()
            _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(p)), "cublasLtMatmulPreferenceCreate", what)
            self.pref = p.value
            setter = lib.cublasLtMatmulPreferenceSetAttribute
            _set(lib, setter, self.pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE_BYTES), what)
            if is_half(plan.dtype):
                _set(lib, setter, self.pref, _PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(_REDUCTION_IN_COMPUTE_TYPE),
                     what)
            a, b, d_align, bias, aux = plan.align
            for key, value in (("a", a), ("b", b), ("c", d_align), ("d", d_align)):
                _set(lib, setter, self.pref, _PREF_MIN_ALIGNMENT[key], ctypes.c_uint32(value), what)
            # The heuristic reads the alignment of the bias and aux pointers from their values (it never dereferences
            # them): stand-in addresses of the planned alignment until a call sets the real ones.
            if bias:
                self.point(_DESC_BIAS_POINTER, bias)
            if aux:
                self.point(_DESC_AUX_POINTER, aux)
        except BaseException:
            self.close()
            raise

    def point(self, attr, ptr):
        """Set the bias (``_DESC_BIAS_POINTER``) or aux pointer of the descriptor."""
        _set(self.lib, self.lib.cublasLtMatmulDescSetAttribute, self.desc, attr, ctypes.c_void_p(ptr),
             lambda: f"pointer {ptr:#x} of {self.plan!r}")

    def close(self):
        lib = self.lib
        if self.pref is not None:
            lib.cublasLtMatmulPreferenceDestroy(self.pref)
        for lay in self.layouts:
            lib.cublasLtMatrixLayoutDestroy(lay)
        if self.desc is not None:
            lib.cublasLtMatmulDescDestroy(self.desc)
        self.desc, self.pref, self.layouts = None, None, []


class _Built:
    """A plan ready to run: its descriptors, the heuristic's algorithm, and a lock (a call sets the descriptor's
    pointers, then runs it)."""
    __slots__ = ("described", "algo", "lock")

    def __init__(self, described, algo):
        self.described, self.algo, self.lock = described, algo, threading.Lock()


class _Device:
    __slots__ = ("handle", "workspaces", "plans")

    def __init__(self, handle):
        self.handle, self.workspaces, self.plans = handle, {}, {}


_devices: dict = {}                       # device id -> _Device
_counts: collections.Counter = collections.Counter()
_declined: dict = {}                      # LtGemm -> why the heuristic gave no algorithm


def declined() -> dict:
    """``{plan: why}`` for the plans cuBLASLt's heuristic had no algorithm for since the last :func:`clear_cache`
    (the op ran its composite for them).

    >>> isinstance(declined(), dict)
    True
    """
    return dict(_declined)


def stats() -> dict:
    """Counts since the last :func:`clear_cache`: ``"dense_forward"`` and ``"dense_backward_weight"`` (the
    ``cublasLtMatmul`` calls each kernel made), ``"built"`` (plans built: descriptors and a heuristic query) and
    ``"no_algorithm"`` (plans the heuristic had no algorithm for, run as the composite).

    >>> set(stats()) <= {"dense_forward", "dense_backward_weight", "built", "no_algorithm"}
    True
    """
    return dict(_counts)


def clear_cache() -> None:
    """Destroy every cached plan (handles and workspaces stay) and zero :func:`stats`.

    >>> clear_cache(); stats()
    {}
    """
    _problems.clear()
    with _lock:
        for dev in _devices.values():
            for built in dev.plans.values():
                if built is not None:
                    built.described.close()
            dev.plans.clear()
        _counts.clear()
        _declined.clear()


def _device(lib) -> _Device:
    """The current device's handle, workspaces and plans (the handle created on first use)."""
    dev_id = cupy.cuda.runtime.getDevice()
    dev = _devices.get(dev_id)
    if dev is None:
        with _lock:
            dev = _devices.get(dev_id)
            if dev is None:
                h = ctypes.c_void_p()
                _check(lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate", f"device {dev_id}")
                dev = _devices[dev_id] = _Device(h.value)
    return dev


def _workspace(dev, stream) -> int:
    """The workspace of ``stream`` (allocated the first time: a ``cudaMalloc`` outside CuPy's pools)."""
    ws = dev.workspaces.get(stream)
    if ws is None:
        ws = dev.workspaces[stream] = cupy.cuda.Memory(WORKSPACE_BYTES)
    return ws.ptr


def _built(plan: LtGemm) -> _Built | None:
    """The cached :class:`_Built` of ``plan`` on the current device (built on first use), or None where the
    heuristic has no algorithm for it."""
    lib = _load()
    dev = _device(lib)
    try:
        return dev.plans[plan]
    except KeyError:
        pass
    with _lock:
        if plan in dev.plans:
            return dev.plans[plan]
        described = _Described(lib, plan)
        found, count = _Heuristic(), ctypes.c_int(0)
        a, b, d = described.layouts
        status = lib.cublasLtMatmulAlgoGetHeuristic(dev.handle, described.desc, a, b, d, d, described.pref, 1,
                                                    ctypes.byref(found), ctypes.byref(count))
        _counts["built"] += 1
        if status == 0 and count.value >= 1 and found.state == 0:
            built = dev.plans[plan] = _Built(described, found)
            return built
        # NOT_SUPPORTED (no heuristic for this configuration) or INVALID_VALUE (a combination of types and epilogue
        # this library refuses): the op runs its composite; declined() keeps why
        described.close()
        _counts["no_algorithm"] += 1
        _declined[plan] = (f"cublasLtMatmulAlgoGetHeuristic gave {STATUS_NAMES.get(status, status)}" if status else
                           f"cublasLtMatmulAlgoGetHeuristic found no algorithm (state {found.state})")
        dev.plans[plan] = None
        return None


def _run(built: _Built, a, b, d, bias=0, aux=0):
    """Queue the planned ``cublasLtMatmul`` on CuPy's current stream: ``A``, ``B``, ``D`` (also its ``C``, read
    with beta 0) and the bias and aux pointers (0: none)."""
    lib, dev = _load(), _devices[cupy.cuda.runtime.getDevice()]
    stream = cupy.cuda.get_current_stream().ptr
    workspace = _workspace(dev, stream)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    described, plan = built.described, built.described.plan
    la, lb, ld = described.layouts
    with built.lock:
        if bias:
            described.point(_DESC_BIAS_POINTER, bias)
        if aux:
            described.point(_DESC_AUX_POINTER, aux)
        status = lib.cublasLtMatmul(dev.handle, described.desc, ctypes.byref(one), a, la, b, lb, ctypes.byref(zero),
                                    d, ld, d, ld, ctypes.byref(built.algo.algo), workspace, WORKSPACE_BYTES, stream)
    _check(status, "cublasLtMatmul", lambda: repr(plan))


# ---------------------------------------------------------------------------------------------
# The kernels


_problems: dict = {}   # (kind, device, TF32, what the planner reads of its arguments) -> (plan or reason, built)
_PROBLEMS_KEPT = 4096  # past this many, the table starts again (a model has a few dozen)


def _forward_key(x, w, b, act, save):
    """What :func:`forward_plan` reads of its arguments: shapes, strides, dtypes, the addresses' alignment classes
    (:func:`_alignment`), the activation and ``save``."""
    bias = None if b is None else (b.shape, b.strides, b.dtype, _alignment(_address(b)))
    return (x.shape, x.strides, x.dtype, _alignment(_address(x)), w.shape, w.strides, w.dtype,
            _alignment(_address(w)), bias, act, save)


def _weight_key(dz, x, need_db):
    """What :func:`weight_plan` reads of its arguments (see :func:`_forward_key`)."""
    return (dz.shape, dz.strides, dz.dtype, _alignment(_address(dz)), x.shape, x.strides, x.dtype,
            _alignment(_address(x)), need_db)


_KEYS = {"forward": _forward_key, "weight": _weight_key}


def _decided(kind, planner, args):
    """``(plan or reason, built or None)`` of ``planner(*args)``, planned once per problem: a repeated call (the
    ``supports`` call and the kernel's, each step's) costs a key and a lookup."""
    key = (kind, cupy.cuda.runtime.getDevice(), bool(options.allow_tf32)) + _KEYS[kind](*args)
    found = _problems.get(key)
    if found is None:
        plan = planner(*args)
        if len(_problems) >= _PROBLEMS_KEPT:
            _problems.clear()
        found = _problems[key] = (plan, None if isinstance(plan, str) else _built(plan))
    return found


def _taken(kind, planner, args):
    """The decision for a kernel call (see :func:`_decided`)."""
    plan, built = _decided(kind, planner, args)
    if isinstance(plan, str):
        raise ValueError(f"{plan} (a call its supports function declines)")
    return plan, built


def _is_cupy(*arrays):
    return cupy is not None and all(a is None or type(a) is cupy.ndarray for a in arrays)


def dense_forward_supports(x, w, b, act, save) -> bool:
    """Whether :func:`dense_forward` takes this call: CuPy arrays that :func:`forward_plan` plans and for which
    cuBLASLt's heuristic has an algorithm.

    >>> import numpy as np
    >>> dense_forward_supports(np.ones((8, 8), np.float32), np.ones((8, 8), np.float32), None, "relu", False)
    False
    """
    return _is_cupy(x, w, b) and _decided("forward", forward_plan, (x, w, b, act, save))[1] is not None


def dense_forward(x, w, b, act, save):
    """``(act(x @ w.T + b), aux)`` by one ``cublasLtMatmul`` (see the module docstring): ``aux`` is the
    pre-activation where ``save`` (gelu), else None. Only for calls :func:`dense_forward_supports` takes.

    >>> from fluxpy.backend import gpu_available
    >>> y = None   # stays None without a GPU
    >>> if gpu_available()[0]:
    ...     x, w = cupy.ones((8, 16), cupy.float32), cupy.ones((8, 16), cupy.float32)
    ...     y, _ = dense_forward(x, w, cupy.full(8, -20.0, cupy.float32), "relu", False)
    ...     y = float(y.sum())
    >>> y in (None, 0.0)
    True
    """
    plan, built = _taken("forward", forward_plan, (x, w, b, act, save))
    y = cupy.empty(tuple(x.shape[:-1]) + (w.shape[0],), dtype=x.dtype)
    aux = cupy.empty_like(y) if save else None
    built = _for_outputs(plan, built, ((2, y), (4, aux)))
    _run(built, _address(w), _address(x), _address(y), _address(b) if b is not None else 0,
         _address(aux) if save else 0)
    _counts["dense_forward"] += 1
    return y, aux


def _for_outputs(plan, built, outputs):
    """``built``, or the plan built for the outputs just allocated where one of them (``(slot in align, array)``)
    is less aligned than planning assumed."""
    align = list(plan.align)
    for slot, array in outputs:
        if array is not None:
            align[slot] = min(align[slot], _alignment(_address(array)))
    if tuple(align) == plan.align and built is not None:
        return built
    plan = replace(plan, align=tuple(align))
    built = _built(plan)
    if built is None:
        raise CublasError(15, "cublasLtMatmulAlgoGetHeuristic", f"no algorithm for {plan!r}, a call planned for "
                          f"outputs {_MAX_ALIGN}-byte aligned whose outputs are less aligned")
    return built


def dense_backward_weight_supports(dz, x, need_db) -> bool:
    """Whether :func:`dense_backward_weight` takes this call (see :func:`weight_plan`).

    >>> import numpy as np
    >>> dense_backward_weight_supports(np.ones((8, 8), np.float32), np.ones((8, 8), np.float32), True)
    False
    """
    return _is_cupy(dz, x) and _decided("weight", weight_plan, (dz, x, need_db))[1] is not None


def dense_backward_weight(dz, x, need_db):
    """``(dz.T @ x, dz.sum(0) or None)`` for ``dz`` ``(m, n)`` and ``x`` ``(m, k)`` by one ``cublasLtMatmul``, the
    sum computed by its ``BGRADB`` epilogue where ``need_db``. Only for calls
    :func:`dense_backward_weight_supports` takes.

    >>> callable(dense_backward_weight)
    True
    """
    plan, built = _taken("weight", weight_plan, (dz, x, need_db))
    dw = cupy.empty((dz.shape[1], x.shape[1]), dtype=dz.dtype)
    db = cupy.empty(dz.shape[1], dtype=dz.dtype) if need_db else None
    built = _for_outputs(plan, built, ((2, dw), (3, db)))
    _run(built, _address(x), _address(dz), _address(dw), _address(db) if need_db else 0)
    _counts["dense_backward_weight"] += 1
    return dw, db


KERNELS = {"dense_forward": (dense_forward, dense_forward_supports),
           "dense_backward_weight": (dense_backward_weight, dense_backward_weight_supports)}
