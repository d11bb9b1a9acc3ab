"""Matrix products through our own ctypes binding of cuBLAS: the ``matmul`` kernel for CuPy arrays.

CuPy refuses every cuBLAS call while a stream is being captured into a CUDA graph ("calling cuBLAS API during
stream capture is currently unsupported"), so a training step with a Dense layer or attention could not be
captured. This binding calls cuBLAS itself, on one handle per device bound to CuPy's current stream, with a
workspace of its own per stream (``cublasSetWorkspace_v2``: cuBLAS then allocates nothing during a call, as
capture requires): ``cublasSgemm_v2``/``cublasDgemm_v2`` (``cublasGemmEx`` for the halves) for one product, and
``cublasSgemmStridedBatched``/``cublasDgemmStridedBatched`` (``cublasGemmStridedBatchedEx``) for a batch.

The library is the one CuPy loaded (found in the process's memory map after CuPy's cuBLAS module is imported),
else the ``cublas_library`` option (:mod:`fluxpy.options`), else ``ctypes.util.find_library("cublas")``. Float32
uses TF32 tensor cores only with the ``allow_tf32`` option (the one TF32 switch, shared with cuDNN).

float16 and bfloat16 run with ``CUBLAS_COMPUTE_32F``: half storage, float32 accumulation on tensor cores, and
(``CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION``) no split-K reduction in the half type either.

What it takes (:func:`matmul_supports`): every product of float16, bfloat16, float32 or float64 CuPy arrays of one
dtype (float32 with float64 is promoted) by NumPy's rules: 1-d operands, batch axes on either side, broadcast batch
axes, any strides. :mod:`fluxpy.kernels.gemm_plan` plans the one call: operands are read where they lie when their
matrices are row- or column-major (a transposed view such as ``W.T`` costs no copy) and their batch axes flatten to
one stride (0 for a broadcast operand), else copied C-ordered first; an empty result or ``k == 0`` needs no call.
Declined, and run as ``a @ b`` (CuPy's own cuBLAS call, which a capture refuses): sizes beyond cuBLAS's 32-bit ints
(a half product of those in float32 and rounded back: CuPy has no bfloat16 matmul), other dtypes.

The module imports without CuPy:

>>> sorted(STATUS_NAMES.values())[:2]
['CUBLAS_STATUS_ALLOC_FAILED', 'CUBLAS_STATUS_ARCH_MISMATCH']
>>> sorted(KERNELS)
['matmul']
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import numpy as np

from ..backend import cupy, get_array_module
from ..capturing import refuse
from ..options import options
from .gemm_plan import matmul_shape, plan_matmul
from .halfs import BFLOAT16, is_half

__all__ = ["matmul", "matmul_supports", "CublasError", "STATUS_NAMES", "library_path", "KERNELS",
           "WORKSPACE_BYTES"]

STATUS_NAMES = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
                7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
                13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
                15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR"}
# Per stream: what cuBLAS may use instead of allocating during a call. 32 MiB is NVIDIA's advice for its recent
# GPUs; with less, cuBLAS picks slower kernels for small products than the ones CuPy's calls get.
WORKSPACE_BYTES = 32 << 20
_DEFAULT_MATH, _TF32_MATH, _DISALLOW_REDUCED_REDUCTION = 0, 3, 16   # cublasMath_t
_R_32F, _R_16F, _R_16BF = 0, 2, 14                                    # cudaDataType_t
_COMPUTE_32F, _GEMM_DEFAULT = 68, -1                                  # cublasComputeType_t, cublasGemmAlgo_t

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
_SIGNATURES = {
    "cublasCreate_v2": [_P],
    "cublasDestroy_v2": [_P],
    "cublasSetStream_v2": [_P, _P],
    "cublasSetWorkspace_v2": [_P, _P, ctypes.c_size_t],
    "cublasSetMathMode": [_P, _I],
    "cublasSgemm_v2": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, _I],
    "cublasDgemm_v2": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, _I],
    "cublasGemmEx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I],
    "cublasSgemmStridedBatched": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _L, _P, _I, _L, _P, _P, _I, _L, _I],
    "cublasDgemmStridedBatched": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _L, _P, _I, _L, _P, _P, _I, _L, _I],
    "cublasGemmStridedBatchedEx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _L, _P, _I, _I, _L, _P, _P, _I, _I, _L,
                                   _I, _I, _I],
}


class CublasError(RuntimeError):
    """A cuBLAS call that failed: ``status`` (the code), ``status_name`` and ``call`` are in the message.

    >>> str(CublasError(7, "cublasSgemm_v2", "(2, 3) @ (3, 4) float32"))
    'cublasSgemm_v2 failed with CUBLAS_STATUS_INVALID_VALUE (7) on (2, 3) @ (3, 4) float32'
    """

    def __init__(self, status: int, call: str, what: str = "") -> None:
        self.status, self.call = status, call
        self.status_name = STATUS_NAMES.get(status, "CUBLAS_STATUS_UNKNOWN")
        super().__init__(f"{call} failed with {self.status_name} ({status})" + (f" on {what}" if what else ""))


def _check(status, call, what=""):
    if status != 0:
        raise CublasError(status, call, what() if callable(what) else what)


# ---------------------------------------------------------------------------------------------
# Finding and loading the library

_lib: list = [None, None]   # the bound library and its path, once loaded
_lock = threading.Lock()


def _mapped_cublas():
    """The path of the libcublas that this process has loaded already (CuPy's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ")[-1]
                name = os.path.basename(path)
                if name.startswith("libcublas.so"):
                    return path
    except OSError:
        pass
    return None


def library_path() -> str | None:
    """The cuBLAS library this module binds (loading it on first call), or None where none is found.

    >>> library_path() is None or "cublas" in library_path()
    True
    """
    if cupy is None:
        return None
    try:
        _load()
    except OSError:
        return None
    return _lib[1]


def _load():
    with _lock:
        if _lib[0] is not None:
            return _lib[0]
        try:
            from cupy_backends.cuda.libs import cublas as _cupy_cublas  # noqa: F401  (loads CuPy's libcublas)
        except ImportError:
            pass
        for path in (_mapped_cublas(), options.cublas_library, ctypes.util.find_library("cublas")):
            if not path:
                continue
            lib = bind(path, _SIGNATURES)
            _lib[0], _lib[1] = lib, path
            return lib
        raise OSError("cuBLAS was not found: CuPy has not loaded libcublas, the cublas_library option "
                      "(fluxpy.options, or $FLUXPY_CUBLAS_LIBRARY) is unset and ctypes.util.find_library('cublas') "
                      "found nothing")


def bind(path: str, signatures: dict) -> ctypes.CDLL:
    """The library at ``path`` with each function of ``signatures`` (name -> argument types) typed, returning a
    status ``int`` (cuBLAS's and cuBLASLt's functions all do).

    >>> bind.__name__   # needs libcublas: tests/gpu/test_cublas_gpu.py loads it
    'bind'
    """
    lib = ctypes.CDLL(path)
    for name, args in signatures.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, ctypes.c_int
    return lib


# ---------------------------------------------------------------------------------------------
# Handles and workspaces


class _Handle:
    __slots__ = ("ptr", "stream", "math", "workspaces")

    def __init__(self, ptr):
        self.ptr, self.stream, self.math, self.workspaces = ptr, None, None, {}


_handles: dict = {}   # device -> _Handle


def _math_mode(dtype) -> int:
    """The ``cublasMath_t`` for ``dtype``: the halves accumulate (split-K included) in float32; float32 uses TF32
    only with ``allow_tf32``."""
    if is_half(dtype):
        return _DEFAULT_MATH | _DISALLOW_REDUCED_REDUCTION
    return _TF32_MATH if options.allow_tf32 else _DEFAULT_MATH


def _handle(lib, dtype) -> int:
    """The device's handle, bound to CuPy's current stream (with that stream's workspace) and to the math mode
    of ``dtype`` (:func:`_math_mode`)."""
    dev = cupy.cuda.runtime.getDevice()
    h = _handles.get(dev)
    if h is None:
        p = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(p)), "cublasCreate_v2", f"device {dev}")
        h = _handles[dev] = _Handle(p.value)
    stream = cupy.cuda.get_current_stream().ptr
    if stream != h.stream:
        ws = h.workspaces.get(stream)
        if ws is None:
            ws = h.workspaces[stream] = cupy.cuda.alloc(WORKSPACE_BYTES)
        _check(lib.cublasSetStream_v2(h.ptr, stream), "cublasSetStream_v2", f"stream {stream:#x}")
        _check(lib.cublasSetWorkspace_v2(h.ptr, ws.ptr, WORKSPACE_BYTES), "cublasSetWorkspace_v2")
        h.stream = stream
    math = _math_mode(dtype)
    if math != h.math:
        _check(lib.cublasSetMathMode(h.ptr, math), "cublasSetMathMode", f"mode {math}")
        h.math = math
    return h.ptr


# ---------------------------------------------------------------------------------------------
# The kernel

_GEMM = {np.dtype(np.float32): ("cublasSgemm_v2", "cublasSgemmStridedBatched"),
         np.dtype(np.float64): ("cublasDgemm_v2", "cublasDgemmStridedBatched")}
_GEMM_EX_TYPES = {np.dtype(np.float16): _R_16F, BFLOAT16: _R_16BF}
_SCALARS = {np.dtype(np.float32): (ctypes.c_float(1.0), ctypes.c_float(0.0)),
            np.dtype(np.float64): (ctypes.c_double(1.0), ctypes.c_double(0.0)),
            np.dtype(np.float16): (ctypes.c_float(1.0), ctypes.c_float(0.0)),   # CUBLAS_COMPUTE_32F's scalars
            BFLOAT16: (ctypes.c_float(1.0), ctypes.c_float(0.0))}


def _matrix_view(x, side):
    """``(shape, strides)`` of ``x`` in elements, a 1-d ``x`` promoted as ``matmul`` does (``a`` to a row,
    ``b`` to a column; the new axis has length 1, so its stride is never read), or None where a stride is not a
    whole number of elements (an ``as_strided`` view: such a product runs as ``a @ b``)."""
    item = x.itemsize
    if any(s % item for s in x.strides):
        return None
    shape, strides = tuple(x.shape), tuple(s // item for s in x.strides)
    if x.ndim == 1:
        return ((1,) + shape, (0,) + strides) if side == "a" else (shape + (1,), strides + (0,))
    return shape, strides


def _plan(a, b):
    """The :class:`~fluxpy.kernels.gemm_plan.GemmPlan` of ``a @ b`` (operands of one dtype), or None."""
    va, vb = _matrix_view(a, "a"), _matrix_view(b, "b")
    return None if va is None or vb is None else plan_matmul(va[0], va[1], vb[0], vb[1])


class _Problem:
    """One product as planned once for its operands' shapes, strides and dtypes: the result's ``shape``, the
    ``plan`` (None: cuBLAS cannot take it), whether an operand must be copied first (``laid_out``) and, from the
    first call on, ``run(handle, pa, pb, pc)``, the cuBLAS call with every argument but the pointers bound."""
    __slots__ = ("shape", "plan", "laid_out", "run")

    def __init__(self, a, b):
        self.shape = matmul_shape(a.shape, b.shape)
        self.plan = None if self.shape is None else _plan(a, b)
        self.laid_out = self.plan is not None and self.plan.kind in ("gemm", "strided") and (
            self.plan.a.copy is not None or self.plan.b.copy is not None)
        self.run = None


_problems: dict = {}   # (shapes, strides, dtypes of a and b) -> _Problem
_PROBLEMS_KEPT = 4096  # past this many, the table starts again (a model has a few dozen)


def _problem(a, b) -> _Problem:
    """The :class:`_Problem` of ``a @ b``: a repeated product costs this lookup, not a new plan."""
    key = (a.shape, a.strides, a.dtype, b.shape, b.strides, b.dtype)
    found = _problems.get(key)
    if found is None:
        if len(_problems) >= _PROBLEMS_KEPT:
            _problems.clear()
        found = _problems[key] = _Problem(a, b)
    return found


def matmul_supports(a, b) -> bool:
    """The products :func:`matmul` computes (see the module docstring); others run as ``a @ b``.

    >>> import numpy as np
    >>> matmul_supports(np.ones((2, 3)), np.ones((3, 4)))   # NumPy arrays: NumPy's own product
    False
    """
    if cupy is None or type(a) is not cupy.ndarray or type(b) is not cupy.ndarray:
        return False
    if a.dtype not in _SCALARS or b.dtype not in _SCALARS:
        return False
    problem = _problem(a, b)
    if problem.shape is None:
        return False
    if a.dtype != b.dtype:   # float32 with float64 (the op refuses a half with another dtype)
        return not (is_half(a.dtype) or is_half(b.dtype))
    return is_half(a.dtype) or problem.plan is not None


def _laid_out(x, side, operand, batch_shape):
    """``x`` (1-d promoted for ``side``) as ``operand`` says cuBLAS reads it: itself, or the copy it names (NumPy
    arrays too, for the tests)."""
    xp = get_array_module(x)
    if x.ndim == 1:
        x = x[None, :] if side == "a" else x[:, None]
    if operand.copy is None:
        return x
    if operand.copy == "broadcast":
        x = xp.broadcast_to(x, tuple(batch_shape) + tuple(x.shape[-2:]))
    if operand.transposed:   # column-major matrices stay column-major: the copy reads and writes in one order
        return _c_ordered(xp, x.swapaxes(-1, -2)).swapaxes(-1, -2)
    return _c_ordered(xp, x)


def _c_ordered(xp, x):
    """A C-ordered copy of ``x``; a half one copied as its 16-bit patterns (a copy needs no bfloat16 arithmetic)."""
    if is_half(x.dtype):
        return xp.ascontiguousarray(x.view(np.uint16)).view(x.dtype)
    return xp.ascontiguousarray(x)


def matmul(a, b):
    """``a @ b`` by one cuBLAS call (the ``matmul`` kernel for CuPy; see :func:`matmul_supports`): a gemm, or a
    strided-batched gemm for a batch, as :func:`~fluxpy.kernels.gemm_plan.plan_matmul` plans it.

    Row-major ``C = A B`` is column-major ``C.T = B.T A.T``: cuBLAS gets ``B`` first, ``A`` second, each
    with the transpose flag its layout needs, and writes ``C`` row-major.

    >>> from fluxpy.backend import gpu_available
    >>> product = None   # stays None without a GPU
    >>> if gpu_available()[0]:
    ...     a, w = cupy.arange(6, dtype=cupy.float32).reshape(2, 3), cupy.ones((4, 3), cupy.float32)
    ...     product = matmul(a, w.T).tolist()   # w.T is column-major: no copy
    >>> product in (None, [[3.0, 3.0, 3.0, 3.0], [12.0, 12.0, 12.0, 12.0]])
    True
    """
    if a.dtype != b.dtype:   # float32 with float64: NumPy's promotion
        dtype = np.result_type(a.dtype, b.dtype)
        a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    problem = _problem(a, b)
    shape, plan = problem.shape, problem.plan
    if plan is None:   # sizes beyond cuBLAS's 32-bit ints: CuPy's own call, which a capture refuses
        refuse(f"matmul: {tuple(a.shape)} @ {tuple(b.shape)} {a.dtype} exceeds cuBLAS's 32-bit sizes: it runs as "
               f"CuPy's own product")
        if is_half(a.dtype):   # CuPy's matmul has no bfloat16 kernel: in float32, rounded once
            return (a.astype(cupy.float32) @ b.astype(cupy.float32)).astype(a.dtype)
        return a @ b
    if plan.kind == "empty":
        return cupy.empty(shape, dtype=a.dtype)
    if plan.kind == "zeros":
        return cupy.zeros(shape, dtype=a.dtype)
    c = cupy.empty(plan.shape, dtype=a.dtype)
    if problem.laid_out:
        a, b = _laid_out(a, "a", plan.a, plan.batch_shape), _laid_out(b, "b", plan.b, plan.batch_shape)
    _gemm(problem, a, b, c)   # an operand read where it lies needs only its address (a 1-d one too)
    return c if plan.shape == shape else c.reshape(shape)


def _pointer(x) -> int:
    """The device address of ``x``'s first element."""
    return x.data.ptr


def _gemm(problem, a, b, c):
    """Run ``problem``'s plan on the laid-out operands, writing ``c``: cuBLAS's first operand is ``b`` (see the
    module). ``a``, ``b``, ``c`` stay referenced until the call is queued."""
    if problem.run is None:
        problem.run = _bound_call(problem.plan, c.dtype)
    run, name = problem.run
    status = run(_handle(_load(), c.dtype), _pointer(a), _pointer(b), _pointer(c))
    _check(status, name, lambda: f"{problem.plan.shape} {c.dtype} ({problem.plan.kind}, {problem.plan.call()})")


def _bound_call(plan, dtype):
    """``(run, name)``: ``run(handle, pa, pb, pc)`` makes ``plan``'s cuBLAS call (named ``name``) on those
    pointers, every other argument bound once."""
    lib, g = _load(), plan.call()
    one, zero = (ctypes.byref(s) for s in _SCALARS[dtype])   # the scalars live as long as the module
    head = (g.transa, g.transb, g.m, g.n, g.k, one)
    if dtype in _GEMM_EX_TYPES:
        t = _GEMM_EX_TYPES[dtype]
        if plan.kind == "gemm":
            fn = lib.cublasGemmEx
            return (lambda h, pa, pb, pc: fn(h, *head, pb, t, g.lda, pa, t, g.ldb, zero, pc, t, g.ldc, _COMPUTE_32F,
                                             _GEMM_DEFAULT)), "cublasGemmEx"
        fn = lib.cublasGemmStridedBatchedEx
        return (lambda h, pa, pb, pc: fn(h, *head, pb, t, g.lda, g.stride_a, pa, t, g.ldb, g.stride_b, zero, pc, t,
                                         g.ldc, g.stride_c, g.batch, _COMPUTE_32F, _GEMM_DEFAULT)), \
            "cublasGemmStridedBatchedEx"
    if plan.kind == "gemm":
        name = _GEMM[dtype][0]
        fn = getattr(lib, name)
        return (lambda h, pa, pb, pc: fn(h, *head, pb, g.lda, pa, g.ldb, zero, pc, g.ldc)), name
    name = _GEMM[dtype][1]
    fn = getattr(lib, name)
    return (lambda h, pa, pb, pc: fn(h, *head, pb, g.lda, g.stride_a, pa, g.ldb, g.stride_b, zero, pc, g.ldc,
                                     g.stride_c, g.batch)), name


KERNELS = {"matmul": (matmul, matmul_supports)}
