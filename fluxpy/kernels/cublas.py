"""Matrix products through our own ctypes binding of cuBLAS: the ``matmul`` kernel for CuPy arrays.

CuPy refuses every cuBLAS call while a stream is being captured into a CUDA graph ("calling cuBLAS API during
stream capture is currently unsupported"), so a training step with a Dense layer could not be captured. This
binding calls ``cublasSgemm_v2``/``cublasDgemm_v2`` (and ``cublasGemmEx`` for the halves) itself, on one
handle per device bound to CuPy's current stream, with a workspace of its own per stream
(``cublasSetWorkspace_v2``: cuBLAS then allocates nothing during a call, as capture requires).

The library is the one CuPy loaded (found in the process's memory map after CuPy's cuBLAS module is imported),
else the ``cublas_library`` option (:mod:`fluxpy.options`), else ``ctypes.util.find_library("cublas")``. Float32
uses TF32 tensor cores only with the ``allow_tf32`` option (the one TF32 switch, shared with cuDNN).

float16 and bfloat16 run through ``cublasGemmEx`` with ``CUBLAS_COMPUTE_32F``: half storage, float32
accumulation on tensor cores, and (``CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION``) no split-K reduction
in the half type either.

What it takes (:func:`matmul_supports`): float16, bfloat16, float32 or float64 CuPy arrays of one dtype, ``a``
of 2 or more axes whose leading axes are flattened (C-contiguous), ``b`` a matrix, each row- or column-major
(a transposed view such as ``W.T`` costs no copy), no empty axis, sizes within cuBLAS's 32-bit ints. Any other
product runs as ``a @ b`` (CuPy's own cuBLAS call), a half one in float32 and rounded back (CuPy has no
bfloat16 matmul).

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

from ..backend import cupy
from ..options import options
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
_OP_N, _OP_T = 0, 1
_DEFAULT_MATH, _TF32_MATH, _DISALLOW_REDUCED_REDUCTION = 0, 3, 16   # cublasMath_t
_R_32F, _R_16F, _R_16BF = 0, 2, 14                                    # cudaDataType_t
_COMPUTE_32F, _GEMM_DEFAULT = 68, -1                                  # cublasComputeType_t, cublasGemmAlgo_t
_INT_MAX = 2**31 - 1

_P, _I = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "cublasCreate_v2": [_P],
    "cublasDestroy_v2": [_P],
    "cublasSetStream_v2": [_P, _P],
    "cublasSetWorkspace_v2": [_P, _P, ctypes.c_size_t],
    "cublasSetMathMode": [_P, _I],
    "cublasSgemm_v2": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, _I],
    "cublasDgemm_v2": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, _I],
    "cublasGemmEx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I],
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
            lib = ctypes.CDLL(path)
            for name, args in _SIGNATURES.items():
                f = getattr(lib, name)
                f.argtypes, f.restype = args, ctypes.c_int
            _lib[0], _lib[1] = lib, path
            return lib
        raise OSError("cuBLAS was not found: CuPy has not loaded libcublas, the cublas_library option "
                      "(fluxpy.options, or $FLUXPY_CUBLAS_LIBRARY) is unset and ctypes.util.find_library('cublas') "
                      "found nothing")


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

_GEMM = {np.dtype(np.float32): ("cublasSgemm_v2", lambda lib: lib.cublasSgemm_v2),
         np.dtype(np.float64): ("cublasDgemm_v2", lambda lib: lib.cublasDgemm_v2)}
_GEMM_EX_TYPES = {np.dtype(np.float16): _R_16F, BFLOAT16: _R_16BF}
_SCALARS = {np.dtype(np.float32): (ctypes.c_float(1.0), ctypes.c_float(0.0)),
            np.dtype(np.float64): (ctypes.c_double(1.0), ctypes.c_double(0.0)),
            np.dtype(np.float16): (ctypes.c_float(1.0), ctypes.c_float(0.0)),   # CUBLAS_COMPUTE_32F's scalars
            BFLOAT16: (ctypes.c_float(1.0), ctypes.c_float(0.0))}


def _layout(m):
    """``(transposed, ld)`` of a matrix as cuBLAS (column-major) reads its buffer, or None where it is neither
    row- nor column-major. A row-major ``(r, c)`` buffer is the column-major ``(c, r)`` matrix ``m.T``."""
    r, c = m.shape
    s0, s1 = m.strides
    item = m.itemsize
    if s1 == item and s0 % item == 0 and s0 // item >= max(c, 1):
        return False, s0 // item          # row-major: cuBLAS sees m.T, with leading dimension s0
    if s0 == item and s1 % item == 0 and s1 // item >= max(r, 1):
        return True, s1 // item           # column-major: cuBLAS sees m itself
    return None


def _as_matrix(a):
    """``a`` with its leading axes flattened into the rows (a view where ``a`` is C-contiguous), else None."""
    if a.ndim == 2:
        return a
    return a.reshape(-1, a.shape[-1]) if a.flags.c_contiguous else None


def matmul_supports(a, b) -> bool:
    """The products :func:`matmul` computes (see the module docstring); others run as ``a @ b``.

    >>> import numpy as np
    >>> matmul_supports(np.ones((2, 3)), np.ones((3, 4)))   # NumPy arrays: NumPy's own product
    False
    """
    return _gemm_supports(a, b) or _is_half_pair(a, b)


def _is_half_pair(a, b) -> bool:
    return (cupy is not None and type(a) is cupy.ndarray and type(b) is cupy.ndarray and a.dtype == b.dtype
            and is_half(a.dtype))


def _gemm_supports(a, b) -> bool:
    """Whether one gemm call computes ``a @ b`` (see the module docstring)."""
    if cupy is None or type(a) is not cupy.ndarray or type(b) is not cupy.ndarray:
        return False
    if a.dtype != b.dtype or a.dtype not in _SCALARS:
        return False
    if a.ndim < 2 or b.ndim != 2 or a.shape[-1] != b.shape[0] or 0 in a.shape or 0 in b.shape:
        return False
    a2 = _as_matrix(a)
    if a2 is None or a2.shape[0] > _INT_MAX or b.shape[0] > _INT_MAX or b.shape[1] > _INT_MAX:
        return False
    la, lb = _layout(a2), _layout(b)
    return la is not None and lb is not None and la[1] <= _INT_MAX and lb[1] <= _INT_MAX


def matmul(a, b):
    """``a @ b`` by one cuBLAS gemm call (the ``matmul`` kernel for CuPy; see :func:`matmul_supports`).

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
    if is_half(a.dtype) and not _gemm_supports(a, b):
        # Batched or broadcast half products: CuPy's matmul has no bfloat16 kernel, so compute in float32.
        return (a.astype(cupy.float32) @ b.astype(cupy.float32)).astype(a.dtype)
    lib = _load()
    a2 = _as_matrix(a)
    m, k = a2.shape
    n = b.shape[1]
    (ta, lda), (tb, ldb) = _layout(a2), _layout(b)
    c = cupy.empty((m, n), dtype=a.dtype)
    one, zero = _SCALARS[a.dtype]
    h = _handle(lib, a.dtype)
    op_b, op_a = _OP_T if tb else _OP_N, _OP_T if ta else _OP_N
    if a.dtype in _GEMM_EX_TYPES:
        name, t = "cublasGemmEx", _GEMM_EX_TYPES[a.dtype]
        status = lib.cublasGemmEx(h, op_b, op_a, n, m, k, ctypes.byref(one), b.data.ptr, t, ldb, a2.data.ptr, t,
                                  lda, ctypes.byref(zero), c.data.ptr, t, n, _COMPUTE_32F, _GEMM_DEFAULT)
    else:
        name, gemm = _GEMM[a.dtype]
        status = gemm(lib)(h, op_b, op_a, n, m, k, ctypes.byref(one), b.data.ptr, ldb, a2.data.ptr, lda,
                           ctypes.byref(zero), c.data.ptr, n)
    _check(status, name, lambda: f"{tuple(a.shape)} @ {tuple(b.shape)} {a.dtype}")
    return c.reshape(*a.shape[:-1], n)


KERNELS = {"matmul": (matmul, matmul_supports)}
