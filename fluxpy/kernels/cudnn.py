"""A ctypes binding of cuDNN 9's legacy convolution API, on CuPy pointers.

CuPy 14 has no cuDNN module, so fluxpy binds ``libcudnn.so.9`` itself. The library is found, in
order, at ``$FLUXPY_CUDNN_LIBRARY``, in the ``nvidia-cudnn-cu13`` wheel
(``site-packages/nvidia/cudnn/lib``, whose sub-libraries ``libcudnn_graph``, ``libcudnn_ops``,
``libcudnn_cnn``, ``libcudnn_engines_*`` are preloaded with ``RTLD_GLOBAL`` so that the shim's
``dlopen`` finds them) and on the system (``ctypes.util.find_library("cudnn")``).

What it offers (every function takes C-contiguous CuPy arrays and a :class:`fluxpy.ops.dims.ConvDims`):

- :func:`conv_forward` (``cudnnConvolutionForward``), :func:`conv_bias_act_forward`
  (``cudnnConvolutionBiasActivationForward``, relu or identity), :func:`conv_backward_data`,
  :func:`conv_backward_filter`, :func:`conv_backward_bias`.
- One handle per device, bound to CuPy's current stream (``cudnnSetStream`` when it changes).
- Tensor, filter, convolution and activation descriptors built once per ``(ConvDims, dtype)``
  (a :class:`Plan`) and reused. ``flipped=False`` (true convolution) is ``CUDNN_CONVOLUTION``,
  ``flipped=True`` ``CUDNN_CROSS_CORRELATION``. Symmetric padding goes to cuDNN; asymmetric
  padding pads the input by the difference (and crops ``dx`` back).
- Algorithms: on a problem's first use ``cudnnFind*AlgorithmEx`` times them; the ranked list is
  kept in memory and in a JSON file per GPU model and cuDNN version under
  ``$FLUXPY_CACHE/cudnn`` (default ``~/.cache/fluxpy/cudnn``). Workspaces come from CuPy's memory
  pool, up to ``workspace_limit``; when an allocation fails the next algorithm needing less is used.
- Options (:func:`set_options`): ``allow_tf32`` (False: float32 convolutions use FMA math only),
  ``deterministic`` (only algorithms whose perf result says ``CUDNN_DETERMINISTIC``),
  ``workspace_limit`` (bytes), ``disk_cache`` (on/off).
- float16 (computed in float32: ``PSEUDO_HALF_CONFIG``), float32 and float64.
- Every status is checked: a failure raises :class:`CudnnError`, naming the call, the status
  and the shapes.

The module imports without CuPy or cuDNN; :func:`available` says whether it can run and why not.

>>> ok, why = available()
>>> isinstance(ok, bool) and isinstance(why, str)
True
>>> sorted(get_options())
['allow_tf32', 'deterministic', 'disk_cache', 'workspace_limit']
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
import threading

import numpy as np

from ..backend import cupy

__all__ = ["CudnnError", "available", "version", "set_options", "get_options", "Plan", "plan",
           "conv_forward", "conv_bias_act_forward", "conv_backward_data", "conv_backward_filter",
           "conv_backward_bias", "clear_cache", "cache_file", "stats", "STATUS_NAMES"]


# ---------------------------------------------------------------------------------------------
# Enums (cudnn_graph.h, cudnn_ops.h, cudnn_cnn.h of cuDNN 9)

STATUS_NAMES = {
    0: "CUDNN_STATUS_SUCCESS", 1001: "CUDNN_STATUS_NOT_INITIALIZED", 1002: "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH",
    1003: "CUDNN_STATUS_SERIALIZATION_VERSION_MISMATCH", 1004: "CUDNN_STATUS_DEPRECATED",
    1005: "CUDNN_STATUS_LICENSE_ERROR", 1006: "CUDNN_STATUS_RUNTIME_IN_PROGRESS",
    1007: "CUDNN_STATUS_RUNTIME_FP_OVERFLOW", 2000: "CUDNN_STATUS_BAD_PARAM",
    2002: "CUDNN_STATUS_BAD_PARAM_NULL_POINTER", 2003: "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER",
    2004: "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED", 2005: "CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND",
    2006: "CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT", 2007: "CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH",
    2008: "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH", 2009: "CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES",
    2010: "CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE", 3000: "CUDNN_STATUS_NOT_SUPPORTED",
    3001: "CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN", 3002: "CUDNN_STATUS_NOT_SUPPORTED_SHAPE",
    3003: "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE", 3004: "CUDNN_STATUS_NOT_SUPPORTED_LAYOUT",
    3005: "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER",
    3006: "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART", 3007: "CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH",
    3008: "CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING",
    3009: "CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE", 3010: "CUDNN_STATUS_NOT_SUPPORTED_SHARED_MEMORY_INSUFFICIENT",
    3011: "CUDNN_STATUS_NOT_SUPPORTED_PADDING", 3012: "CUDNN_STATUS_NOT_SUPPORTED_BAD_LAUNCH_PARAM",
    3013: "CUDNN_STATUS_NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API", 4000: "CUDNN_STATUS_INTERNAL_ERROR",
    4001: "CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED", 4002: "CUDNN_STATUS_INTERNAL_ERROR_UNEXPECTED_VALUE",
    4003: "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    4004: "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED", 4005: "CUDNN_STATUS_INTERNAL_ERROR_BAD_LAUNCH_PARAM",
    4006: "CUDNN_STATUS_INTERNAL_ERROR_TEXTURE_CREATION_FAILED", 5000: "CUDNN_STATUS_EXECUTION_FAILED",
    5001: "CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER", 5002: "CUDNN_STATUS_EXECUTION_FAILED_CUBLAS",
    5003: "CUDNN_STATUS_EXECUTION_FAILED_CUDART", 5004: "CUDNN_STATUS_EXECUTION_FAILED_CURAND",
}

DATA_FLOAT, DATA_DOUBLE, DATA_HALF = 0, 1, 2                # cudnnDataType_t
TENSOR_NCHW = 0                                             # cudnnTensorFormat_t
CONVOLUTION, CROSS_CORRELATION = 0, 1                       # cudnnConvolutionMode_t
DEFAULT_MATH, TENSOR_OP_MATH, TENSOR_OP_MATH_ALLOW_CONVERSION, FMA_MATH = 0, 1, 2, 3   # cudnnMathType_t
ACTIVATION_RELU, ACTIVATION_IDENTITY = 1, 5                 # cudnnActivationMode_t
NOT_PROPAGATE_NAN, PROPAGATE_NAN = 0, 1                     # cudnnNanPropagation_t
FWD_IMPLICIT_PRECOMP_GEMM = 1                               # cudnnConvolutionFwdAlgo_t
FWD_ALGOS = ("IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT", "FFT", "FFT_TILING", "WINOGRAD",
             "WINOGRAD_NONFUSED")
BWD_DATA_ALGOS = ("ALGO_0", "ALGO_1", "FFT", "FFT_TILING", "WINOGRAD", "WINOGRAD_NONFUSED")
BWD_FILTER_ALGOS = ("ALGO_0", "ALGO_1", "FFT", "ALGO_3", "WINOGRAD", "WINOGRAD_NONFUSED", "FFT_TILING")
_ALGO_NAMES = {"fwd": FWD_ALGOS, "bwd_data": BWD_DATA_ALGOS, "bwd_filter": BWD_FILTER_ALGOS}

_DTYPES = {np.dtype(np.float32): DATA_FLOAT, np.dtype(np.float64): DATA_DOUBLE, np.dtype(np.float16): DATA_HALF}


class _Perf(ctypes.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t (the three share one layout)."""
    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int), ("mathType", ctypes.c_int),
                ("reserved", ctypes.c_int * 3)]


class CudnnError(RuntimeError):
    """A cuDNN call failed: ``call``, ``status`` (int), ``status_name`` and ``shapes`` say which and why.

    >>> err = CudnnError("cudnnConvolutionForward", 2000, "x (1, 1, 4, 4) float32")
    >>> err.status_name
    'CUDNN_STATUS_BAD_PARAM'
    >>> str(err)
    'cudnnConvolutionForward failed with CUDNN_STATUS_BAD_PARAM (2000) for x (1, 1, 4, 4) float32'
    """

    def __init__(self, call, status, shapes="", detail=None):
        self.call, self.status, self.shapes = call, int(status), shapes
        self.status_name = STATUS_NAMES.get(self.status) or _error_string(self.status)
        msg = f"{call} failed with {self.status_name} ({self.status})"
        if shapes:
            msg += f" for {shapes}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


# ---------------------------------------------------------------------------------------------
# Loading the library

_lib = None
_load_error = None
_lib_path = None
_lock = threading.RLock()

# Sub-libraries of cuDNN 9, in dependency order; the shim dlopens them by soname.
_SUBLIBS = ("libcudnn_graph.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_engines_runtime_compiled.so.9",
            "libcudnn_heuristic.so.9", "libcudnn_ops.so.9", "libcudnn_cnn.so.9", "libcudnn_adv.so.9")


def _wheel_dirs():
    """``nvidia/cudnn/lib`` folders of installed ``nvidia-cudnn-cu*`` wheels."""
    seen = []
    try:
        import nvidia.cudnn as _nv   # a namespace package in the wheel
        for p in getattr(_nv, "__path__", []):
            seen.append(os.path.join(p, "lib"))
    except Exception:
        pass
    try:
        import site
        bases = list(site.getsitepackages()) + [site.getusersitepackages()]
    except Exception:
        bases = []
    for base in bases + sys.path:
        if base:
            seen.append(os.path.join(base, "nvidia", "cudnn", "lib"))
    out = []
    for d in seen:
        d = os.path.abspath(d)
        if d not in out and os.path.isfile(os.path.join(d, "libcudnn.so.9")):
            out.append(d)
    return out


def _candidates():
    env = os.environ.get("FLUXPY_CUDNN_LIBRARY")
    if env:
        return [env]
    out = [os.path.join(d, "libcudnn.so.9") for d in _wheel_dirs()]
    found = ctypes.util.find_library("cudnn")
    if found:
        out.append(found)
    out.append("libcudnn.so.9")
    return out


def _preload(folder):
    for name in _SUBLIBS:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass   # e.g. engines_runtime_compiled without NVRTC: cuDNN reports what it misses


def _load():
    """Load and bind libcudnn once; returns the CDLL or None (``_load_error`` says why)."""
    global _lib, _load_error, _lib_path
    if _lib is not None or _load_error is not None:
        return _lib
    with _lock:
        if _lib is not None or _load_error is not None:
            return _lib
        errors = []
        for path in _candidates():
            try:
                folder = os.path.dirname(path)
                if folder:
                    _preload(folder)
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                _bind(lib)
            except (OSError, AttributeError) as err:
                errors.append(f"{path}: {err}")
                continue
            _lib, _lib_path = lib, path
            return lib
        _load_error = "libcudnn.so.9 could not be loaded (" + "; ".join(errors) + \
            "); install nvidia-cudnn-cu13 (fluxpy[cuda]) or set FLUXPY_CUDNN_LIBRARY"
        return None


_P, _I, _S, _D = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_double
_PI = ctypes.POINTER(ctypes.c_int)
_PS = ctypes.POINTER(ctypes.c_size_t)

_SIGNATURES = {
    "cudnnGetVersion": ([], ctypes.c_size_t),
    "cudnnGetErrorString": ([_I], ctypes.c_char_p),
    "cudnnCreate": ([_P], _I),
    "cudnnSetStream": ([_P, _P], _I),
    "cudnnCreateTensorDescriptor": ([_P], _I),
    "cudnnSetTensor4dDescriptor": ([_P, _I, _I, _I, _I, _I, _I], _I),
    "cudnnDestroyTensorDescriptor": ([_P], _I),
    "cudnnCreateFilterDescriptor": ([_P], _I),
    "cudnnSetFilter4dDescriptor": ([_P, _I, _I, _I, _I, _I, _I], _I),
    "cudnnDestroyFilterDescriptor": ([_P], _I),
    "cudnnCreateConvolutionDescriptor": ([_P], _I),
    "cudnnSetConvolution2dDescriptor": ([_P, _I, _I, _I, _I, _I, _I, _I, _I], _I),
    "cudnnSetConvolutionGroupCount": ([_P, _I], _I),
    "cudnnSetConvolutionMathType": ([_P, _I], _I),
    "cudnnGetConvolution2dForwardOutputDim": ([_P, _P, _P, _PI, _PI, _PI, _PI], _I),
    "cudnnDestroyConvolutionDescriptor": ([_P], _I),
    "cudnnCreateActivationDescriptor": ([_P], _I),
    "cudnnSetActivationDescriptor": ([_P, _I, _I, _D], _I),
    "cudnnDestroyActivationDescriptor": ([_P], _I),
    "cudnnGetConvolutionForwardWorkspaceSize": ([_P, _P, _P, _P, _P, _I, _PS], _I),
    "cudnnGetConvolutionBackwardDataWorkspaceSize": ([_P, _P, _P, _P, _P, _I, _PS], _I),
    "cudnnGetConvolutionBackwardFilterWorkspaceSize": ([_P, _P, _P, _P, _P, _I, _PS], _I),
    "cudnnFindConvolutionForwardAlgorithmEx": ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _PI, _P, _P, _S], _I),
    "cudnnFindConvolutionBackwardDataAlgorithmEx": ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _PI, _P, _P, _S], _I),
    "cudnnFindConvolutionBackwardFilterAlgorithmEx": ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _PI, _P, _P, _S], _I),
    "cudnnConvolutionForward": ([_P, _P, _P, _P, _P, _P, _P, _I, _P, _S, _P, _P, _P], _I),
    "cudnnConvolutionBiasActivationForward": ([_P, _P, _P, _P, _P, _P, _P, _I, _P, _S, _P, _P, _P, _P, _P, _P,
                                               _P, _P], _I),
    "cudnnConvolutionBackwardData": ([_P, _P, _P, _P, _P, _P, _P, _I, _P, _S, _P, _P, _P], _I),
    "cudnnConvolutionBackwardFilter": ([_P, _P, _P, _P, _P, _P, _P, _I, _P, _S, _P, _P, _P], _I),
    "cudnnConvolutionBackwardBias": ([_P, _P, _P, _P, _P, _P, _P], _I),
}


class _Fns:
    """The bound functions, as attributes (filled by :func:`_bind`)."""


_fn = _Fns()


def _bind(lib):
    for name, (args, res) in _SIGNATURES.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
        setattr(_fn, name, f)


def _error_string(status):
    if _lib is None:
        return f"CUDNN_STATUS_{status}"
    try:
        return _fn.cudnnGetErrorString(int(status)).decode()
    except Exception:
        return f"CUDNN_STATUS_{status}"


def available():
    """``(ok, reason)``: whether cuDNN can run here (CuPy, a GPU and libcudnn.so.9), and if not, why.

    >>> ok, why = available()
    >>> ok or "unavailable" in why or "could not" in why or "CuPy" in why or "CUDA" in why
    True
    """
    if cupy is None:
        return False, "fluxpy.kernels.cudnn is unavailable: CuPy could not be imported"
    from ..backend import gpu_available
    ok, why = gpu_available()
    if not ok:
        return False, f"fluxpy.kernels.cudnn is unavailable: {why}"
    if _load() is None:
        return False, f"fluxpy.kernels.cudnn is unavailable: {_load_error}"
    return True, f"cuDNN {version()} from {_lib_path}"


def version():
    """cuDNN's version number (e.g. 91900), or None when it is not loaded.

    >>> v = version()
    >>> v is None or v >= 90000
    True
    """
    if _load() is None:
        return None
    return int(_fn.cudnnGetVersion())


def _require():
    ok, why = available()
    if not ok:
        raise RuntimeError(why)


# ---------------------------------------------------------------------------------------------
# Options

_OPTIONS = {"allow_tf32": False, "deterministic": False, "workspace_limit": 4 << 30, "disk_cache": True}
_options_key = (False, False, 4 << 30)


def set_options(**options):
    """``set_options(allow_tf32=None, deterministic=None, workspace_limit=None, disk_cache=None)``.

    - ``allow_tf32`` (default False): float32 convolutions may use TF32 tensor cores (about 3e-4
      relative error). Off, they run with ``CUDNN_FMA_MATH``. float16 always may use tensor cores;
      float64 never does.
    - ``deterministic`` (default False): only algorithms that cuDNN marks deterministic.
    - ``workspace_limit`` (default 4 GiB): the most workspace, in bytes, an algorithm may take.
    - ``disk_cache`` (default True): read and write the algorithm choices on disk.

    Returns the previous options (a dict), so ``set_options(**old)`` restores them. Changing
    the first three selects algorithms afresh (they are part of the cache key).

    >>> old = set_options(deterministic=True)
    >>> get_options()["deterministic"]
    True
    >>> _ = set_options(**old)
    """
    global _options_key
    old = dict(_OPTIONS)
    for k, v in options.items():
        if k not in _OPTIONS:
            raise TypeError(f"set_options: unknown option {k!r}; expected one of {sorted(_OPTIONS)}")
        if v is None:
            continue
        _OPTIONS[k] = int(v) if k == "workspace_limit" else bool(v)
    _options_key = (_OPTIONS["allow_tf32"], _OPTIONS["deterministic"], _OPTIONS["workspace_limit"])
    return old


def get_options():
    """The current options (a copy).

    >>> get_options()["allow_tf32"] in (True, False)
    True
    """
    return dict(_OPTIONS)


# ---------------------------------------------------------------------------------------------
# Handles, one per device, bound to the current stream

class _Handle:
    __slots__ = ("ptr", "stream")

    def __init__(self, ptr):
        self.ptr, self.stream = ptr, -1


_handles = {}


def _handle():
    dev = cupy.cuda.runtime.getDevice()
    h = _handles.get(dev)
    if h is None:
        p = ctypes.c_void_p()
        _check(_fn.cudnnCreate(ctypes.byref(p)), "cudnnCreate", f"device {dev}")
        h = _handles[dev] = _Handle(p.value)
    s = cupy.cuda.get_current_stream().ptr
    if s != h.stream:
        _check(_fn.cudnnSetStream(h.ptr, s), "cudnnSetStream", f"stream {s:#x}")
        h.stream = s
    return h.ptr


def _check(status, call, shapes=""):
    if status:
        raise CudnnError(call, status, shapes() if callable(shapes) else shapes)


# ---------------------------------------------------------------------------------------------
# Descriptors

def _new(kind):
    p = ctypes.c_void_p()
    _check(getattr(_fn, f"cudnnCreate{kind}Descriptor")(ctypes.byref(p)), f"cudnnCreate{kind}Descriptor")
    return p.value


def tensor_descriptor(shape, dtype):
    """A new NCHW ``cudnnTensorDescriptor_t`` (an int) of ``shape`` (4 ints) and ``dtype``."""
    d = _new("Tensor")
    _check(_fn.cudnnSetTensor4dDescriptor(d, TENSOR_NCHW, _DTYPES[np.dtype(dtype)], *shape),
           "cudnnSetTensor4dDescriptor", lambda: f"shape {tuple(shape)} {np.dtype(dtype)}")
    return d


def filter_descriptor(shape, dtype):
    """A new NCHW (KCRS) ``cudnnFilterDescriptor_t`` of ``shape`` and ``dtype``."""
    d = _new("Filter")
    _check(_fn.cudnnSetFilter4dDescriptor(d, _DTYPES[np.dtype(dtype)], TENSOR_NCHW, *shape),
           "cudnnSetFilter4dDescriptor", lambda: f"w of shape {tuple(shape)} {np.dtype(dtype)}")
    return d


def _math_type(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return DEFAULT_MATH
    if dtype == np.float16:
        return TENSOR_OP_MATH
    return DEFAULT_MATH if _OPTIONS["allow_tf32"] else FMA_MATH


def _key_str(kind, plan):
    c = plan.cdims
    return (f"{kind}|x{plan.x_shape}|w{c.w_shape}|s{c.stride}|p{plan.sym_pad}|d{c.dilation}|g{c.groups}|"
            f"{'xcorr' if c.flipped else 'conv'}|{plan.dtype.name}|tf32={int(_OPTIONS['allow_tf32'])}|"
            f"det={int(_OPTIONS['deterministic'])}|ws={_OPTIONS['workspace_limit']}").replace(" ", "")


class Plan:
    """The cuDNN descriptors and algorithm choices of one ``(ConvDims, dtype)``, built once.

    Fields: ``cdims``, ``dtype``, ``x_shape`` (the input as cuDNN sees it: padded by
    ``extra_pad`` where the padding is asymmetric), ``sym_pad`` ``(ph, pw)``, ``extra_pad``
    ``(top, bottom, left, right)`` or None, descriptors ``xd, wd, yd, bd, convd`` (ints), the
    activation descriptors ``act[kind]``, and ``algos[kind]``: the ranked usable
    ``(algo, math_type, memory)`` triples, found on first use.
    """
    __slots__ = ("cdims", "dtype", "x_shape", "sym_pad", "extra_pad", "xd", "wd", "yd", "bd", "convd", "act",
                 "math", "cur_math", "algos", "one", "zero", "one_p", "zero_p", "fused_ok", "__weakref__")

    def __init__(self, cdims, dtype):
        self.cdims, self.dtype = cdims, np.dtype(dtype)
        t, b, l, r = cdims.pad
        ph, pw = min(t, b), min(l, r)
        self.sym_pad = (ph, pw)
        extra = (t - ph, b - ph, l - pw, r - pw)
        self.extra_pad = extra if any(extra) else None
        n, c, h, w = cdims.x_shape
        self.x_shape = (n, c, h + extra[0] + extra[1], w + extra[2] + extra[3])
        self.xd = tensor_descriptor(self.x_shape, dtype)
        self.wd = filter_descriptor(cdims.w_shape, dtype)
        self.yd = tensor_descriptor(cdims.y_shape, dtype)
        self.bd = tensor_descriptor((1, cdims.w_shape[0], 1, 1), dtype)
        self.convd = _new("Convolution")
        compute = DATA_DOUBLE if self.dtype == np.float64 else DATA_FLOAT
        mode = CROSS_CORRELATION if cdims.flipped else CONVOLUTION
        _check(_fn.cudnnSetConvolution2dDescriptor(self.convd, ph, pw, *cdims.stride, *cdims.dilation, mode, compute),
               "cudnnSetConvolution2dDescriptor", self.describe)
        if cdims.groups > 1:
            _check(_fn.cudnnSetConvolutionGroupCount(self.convd, cdims.groups), "cudnnSetConvolutionGroupCount",
                   self.describe)
        self.math = _math_type(dtype)
        _check(_fn.cudnnSetConvolutionMathType(self.convd, self.math), "cudnnSetConvolutionMathType", self.describe)
        self.cur_math = self.math
        dims = [ctypes.c_int() for _ in range(4)]
        _check(_fn.cudnnGetConvolution2dForwardOutputDim(self.convd, self.xd, self.wd, *map(ctypes.byref, dims)),
               "cudnnGetConvolution2dForwardOutputDim", self.describe)
        got = tuple(d.value for d in dims)
        if got != tuple(cdims.y_shape):   # a disagreement between ConvDims and cuDNN: never silently wrong
            raise CudnnError("cudnnGetConvolution2dForwardOutputDim", 2000, self.describe(),
                             f"cuDNN's output shape {got} differs from ConvDims' {cdims.y_shape}")
        self.act = {}
        for kind, mode_ in (("relu", ACTIVATION_RELU), ("identity", ACTIVATION_IDENTITY)):
            a = _new("Activation")
            _check(_fn.cudnnSetActivationDescriptor(a, mode_, PROPAGATE_NAN, 0.0), "cudnnSetActivationDescriptor")
            self.act[kind] = a
        scalar = ctypes.c_double if self.dtype == np.float64 else ctypes.c_float
        self.one, self.zero = scalar(1.0), scalar(0.0)   # kept alive: their addresses go to cuDNN
        self.one_p, self.zero_p = ctypes.addressof(self.one), ctypes.addressof(self.zero)
        self.algos = {}
        self.fused_ok = {"relu": True, "identity": True}

    def describe(self):
        c = self.cdims
        return (f"x {c.x_shape}, w {c.w_shape}, y {c.y_shape} {self.dtype}, stride {c.stride}, pad {c.pad}, "
                f"dilation {c.dilation}, groups {c.groups}, {'cross-correlation' if c.flipped else 'convolution'}")

    def set_math(self, math):
        if math != self.cur_math:
            _check(_fn.cudnnSetConvolutionMathType(self.convd, math), "cudnnSetConvolutionMathType", self.describe)
            self.cur_math = math

    def destroy(self):
        for d in (self.xd, self.yd, self.bd):
            _fn.cudnnDestroyTensorDescriptor(d)
        _fn.cudnnDestroyFilterDescriptor(self.wd)
        _fn.cudnnDestroyConvolutionDescriptor(self.convd)
        for a in self.act.values():
            _fn.cudnnDestroyActivationDescriptor(a)


_plans = {}
_stats = {"find": 0, "disk_hits": 0, "plans": 0, "oom_fallbacks": 0}


def stats():
    """Counters: ``find`` (cudnnFind* runs), ``disk_hits``, ``plans`` built, ``oom_fallbacks``.

    >>> sorted(stats())
    ['disk_hits', 'find', 'oom_fallbacks', 'plans']
    """
    return dict(_stats)


def plan(cdims, dtype):
    """The :class:`Plan` of ``(cdims, dtype)`` on the current device under the current options (built once)."""
    key = (cdims, dtype, _options_key, cupy.cuda.runtime.getDevice())
    p = _plans.get(key)
    if p is None:
        _require()
        p = _plans[key] = Plan(cdims, dtype)
        _stats["plans"] += 1
    return p


def clear_cache(memory=True, disk=False):
    """Forget the plans and algorithm choices in memory, and with ``disk=True`` delete the cache file.

    >>> clear_cache()
    """
    global _disk
    if memory:
        plans = list(_plans.values())
        _plans.clear()
        _workspaces.clear()
        _disk = None
        if _lib is not None:
            for p in plans:
                p.destroy()
    if disk:
        path = cache_file()
        if path and os.path.exists(path):
            os.remove(path)


# ---------------------------------------------------------------------------------------------
# The algorithm cache on disk: {key: [[algo, math, memory, determinism, time_ms], ...]}

_disk = None          # (path, dict) once loaded


def _cache_dir():
    root = os.environ.get("FLUXPY_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "fluxpy")
    return os.path.join(root, "cudnn")


def cache_file():
    """The JSON file of algorithm choices for this GPU model and cuDNN version (None without cuDNN)."""
    if cupy is None or _load() is None:
        return None
    try:
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        name = "gpu"
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    return os.path.join(_cache_dir(), f"{safe}-cudnn{version()}.json")


def _disk_table():
    global _disk
    path = cache_file()
    if _disk is None or _disk[0] != path:
        table = {}
        if path and os.path.exists(path):
            try:
                with open(path) as f:
                    table = json.load(f)
            except (OSError, ValueError):
                table = {}
        _disk = (path, table)
    return _disk


def _disk_store(key, rows):
    path, table = _disk_table()
    table[key] = rows
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:   # merge what other processes wrote meanwhile
            with open(path) as f:
                on_disk = json.load(f)
            on_disk.update(table)
            table.update(on_disk)
        except (OSError, ValueError):
            pass
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass   # a read-only home: the in-memory cache still works


# ---------------------------------------------------------------------------------------------
# Finding algorithms

def _alloc(nbytes):
    """A workspace of ``nbytes`` from CuPy's pool (None for 0); raises cupy's OutOfMemoryError."""
    if not nbytes:
        return None
    return cupy.cuda.alloc(nbytes)


def _ptr(mem):
    return 0 if mem is None else mem.ptr


_OOM = ()


def _oom_types():
    global _OOM
    if not _OOM:
        _OOM = (cupy.cuda.memory.OutOfMemoryError,)
    return _OOM


def _max_workspace(kind, p, h):
    get = {"fwd": _fn.cudnnGetConvolutionForwardWorkspaceSize,
           "bwd_data": _fn.cudnnGetConvolutionBackwardDataWorkspaceSize,
           "bwd_filter": _fn.cudnnGetConvolutionBackwardFilterWorkspaceSize}[kind]
    descs = {"fwd": (p.xd, p.wd, p.convd, p.yd), "bwd_data": (p.wd, p.yd, p.convd, p.xd),
             "bwd_filter": (p.xd, p.yd, p.convd, p.wd)}[kind]
    most = 0
    size = ctypes.c_size_t()
    for algo in range(len(_ALGO_NAMES[kind])):
        if get(h, *descs, algo, ctypes.byref(size)) == 0:
            most = max(most, size.value)
    return most


def _find(kind, p, h, a, b, out):
    """Run cudnnFind*AlgorithmEx for ``kind`` on real buffers; the ranked usable rows."""
    limit = _OPTIONS["workspace_limit"]
    want = min(_max_workspace(kind, p, h), limit)
    ws = None
    while True:
        try:
            ws = _alloc(want)
            break
        except _oom_types():
            _stats["oom_fallbacks"] += 1
            if want == 0:
                raise
            want //= 4
            if want < (1 << 20):
                want = 0
    n = len(_ALGO_NAMES[kind])
    perf = (_Perf * n)()
    got = ctypes.c_int()
    if kind == "fwd":
        call = "cudnnFindConvolutionForwardAlgorithmEx"
        status = _fn.cudnnFindConvolutionForwardAlgorithmEx(h, p.xd, a, p.wd, b, p.convd, p.yd, out, n,
                                                             ctypes.byref(got), perf, _ptr(ws), want)
    elif kind == "bwd_data":
        call = "cudnnFindConvolutionBackwardDataAlgorithmEx"
        status = _fn.cudnnFindConvolutionBackwardDataAlgorithmEx(h, p.wd, a, p.yd, b, p.convd, p.xd, out, n,
                                                                  ctypes.byref(got), perf, _ptr(ws), want)
    else:
        call = "cudnnFindConvolutionBackwardFilterAlgorithmEx"
        status = _fn.cudnnFindConvolutionBackwardFilterAlgorithmEx(h, p.xd, a, p.yd, b, p.convd, p.wd, out, n,
                                                                    ctypes.byref(got), perf, _ptr(ws), want)
    _check(status, call, p.describe)
    _stats["find"] += 1
    det = _OPTIONS["deterministic"]
    rows = []
    for r in perf[:got.value]:
        if r.status != 0 or r.memory > want or (det and r.determinism != 1):
            continue
        rows.append([int(r.algo), int(r.mathType), int(r.memory), int(r.determinism), float(r.time)])
    if not rows:
        raise CudnnError(call, 3000, p.describe(),
                         "no usable algorithm" + (" among the deterministic ones" if det else "")
                         + f" within a workspace of {want} bytes")
    return rows


def _algos(kind, p, h, a, b, out):
    """The ranked ``(algo, math, memory)`` rows of ``kind`` for plan ``p``: memory, disk, else Find."""
    rows = p.algos.get(kind)
    if rows is not None:
        return rows
    key = _key_str(kind, p)
    table = _disk_table()[1] if _OPTIONS["disk_cache"] else {}
    found = table.get(key)
    if found:
        _stats["disk_hits"] += 1
    else:
        found = _find(kind, p, h, a, b, out)
        if _OPTIONS["disk_cache"]:
            _disk_store(key, found)
    rows = p.algos[kind] = [(int(r[0]), int(r[1]), int(r[2])) for r in found]
    return rows


_workspaces = {}      # (device, stream) -> MemoryPointer, grown on demand and reused call after call


def _workspace(nbytes):
    """A workspace pointer of at least ``nbytes`` for the current device and stream (0 for 0 bytes).

    One buffer per (device, stream), kept between calls: work on one stream runs in order, so the
    next call may reuse it. Raises CuPy's OutOfMemoryError when it cannot grow."""
    if not nbytes:
        return 0
    key = (cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr)
    mem = _workspaces.get(key)
    if mem is None or mem.mem.size < nbytes:
        _workspaces.pop(key, None)
        mem = None
        _workspaces[key] = mem = cupy.cuda.alloc(max(nbytes, 1 << 20))
    return mem.ptr


def _run(kind, p, h, a, b, out, f, call, pre, post):
    """``f(*pre, algo, ws, wsize, *post)`` with the best algorithm whose workspace can be had."""
    rows = p.algos.get(kind)
    if rows is None:
        rows = _algos(kind, p, h, a, b, out)
    last = None
    for algo, math, memory in rows:
        try:
            ws = _workspace(memory)
        except _oom_types() as err:
            _stats["oom_fallbacks"] += 1
            last = err
            continue
        if math != p.cur_math:
            p.set_math(math)
        status = f(*pre, algo, ws, memory, *post)
        if status == 0:
            return
        last = CudnnError(call, status, p.describe(), f"algorithm {_ALGO_NAMES.get(kind, FWD_ALGOS)[algo]}")
        if status not in (2000, 3000) and status // 1000 != 3:
            raise last
    if last is None:
        last = CudnnError(call, 3000, p.describe(), "no algorithm")
    raise last


# ---------------------------------------------------------------------------------------------
# The operations

def _prepare_x(p, x):
    if p.extra_pad is not None:
        t, b, l, r = p.extra_pad
        x = cupy.pad(x, ((0, 0), (0, 0), (t, b), (l, r)))
    elif not x.flags.c_contiguous:
        x = cupy.ascontiguousarray(x)
    return x


def _contig(a, dtype):
    if a.dtype != dtype:
        a = a.astype(dtype)
    if not a.flags.c_contiguous:
        a = cupy.ascontiguousarray(a)
    return a


def conv_forward(x, w, cdims):
    """``conv_forward(x, w, cdims)``: ``cudnnConvolutionForward``, the fluxpy ``conv`` kernel for CuPy."""
    dtype = x.dtype
    p = plan(cdims, dtype)
    h = _handle()
    x = _prepare_x(p, x)
    w = _contig(w, dtype)
    y = cupy.empty(cdims.y_shape, dtype=dtype)
    xp_, wp_, yp_ = x.data.ptr, w.data.ptr, y.data.ptr
    _run("fwd", p, h, xp_, wp_, yp_, _fn.cudnnConvolutionForward, "cudnnConvolutionForward",
         (h, p.one_p, p.xd, xp_, p.wd, wp_, p.convd), (p.zero_p, p.yd, yp_))
    return y


def conv_bias_act_forward(x, w, b, kind, cdims):
    """``conv_bias_act_forward(x, w, b, kind, cdims)``: ``act(conv(x, w) + b)`` in one
    ``cudnnConvolutionBiasActivationForward`` for ``kind`` ``"relu"`` or ``"identity"``.

    ``b`` is ``(K,)`` or None (a zero bias). Identity runs only with ``IMPLICIT_PRECOMP_GEMM``
    (cuDNN's rule). Where cuDNN refuses the fused call (``NOT_SUPPORTED``) it returns None and
    the caller composes conv and bias_act.
    """
    dtype = x.dtype
    p = plan(cdims, dtype)
    if not p.fused_ok[kind]:
        return None
    h = _handle()
    x = _prepare_x(p, x)
    w = _contig(w, dtype)
    b = cupy.zeros(cdims.w_shape[0], dtype=dtype) if b is None else _contig(b, dtype)
    y = cupy.empty(cdims.y_shape, dtype=dtype)
    xp_, wp_, yp_ = x.data.ptr, w.data.ptr, y.data.ptr
    f, call = _fn.cudnnConvolutionBiasActivationForward, "cudnnConvolutionBiasActivationForward"
    pre = (h, p.one_p, p.xd, xp_, p.wd, wp_, p.convd)
    post = (p.zero_p, p.yd, yp_, p.bd, b.data.ptr, p.act[kind], p.yd, yp_)
    try:
        if kind == "identity":
            rows = p.algos.get("fwd_identity")
            if rows is None:
                size = ctypes.c_size_t()
                p.set_math(p.math)
                _check(_fn.cudnnGetConvolutionForwardWorkspaceSize(h, p.xd, p.wd, p.convd, p.yd,
                                                                   FWD_IMPLICIT_PRECOMP_GEMM, ctypes.byref(size)),
                       "cudnnGetConvolutionForwardWorkspaceSize", p.describe)
                rows = p.algos["fwd_identity"] = [(FWD_IMPLICIT_PRECOMP_GEMM, p.math, size.value)]
            _run("fwd_identity", p, h, xp_, wp_, yp_, f, call, pre, post)
        else:
            _run("fwd", p, h, xp_, wp_, yp_, f, call, pre, post)
    except CudnnError as err:
        if err.status // 1000 == 3:   # NOT_SUPPORTED*: remember, and let the caller compose
            p.fused_ok[kind] = False
            return None
        raise
    return y


def conv_backward_data(dy, w, cdims):
    """``conv_backward_data(dy, w, cdims)``: ``cudnnConvolutionBackwardData``; ``dx`` of shape ``cdims.x_shape``."""
    dtype = w.dtype
    p = plan(cdims, dtype)
    h = _handle()
    dy = _contig(dy, dtype)
    w = _contig(w, dtype)
    dx = cupy.empty(p.x_shape, dtype=dtype)
    dyp, wp_, dxp = dy.data.ptr, w.data.ptr, dx.data.ptr
    _run("bwd_data", p, h, wp_, dyp, dxp, _fn.cudnnConvolutionBackwardData, "cudnnConvolutionBackwardData",
         (h, p.one_p, p.wd, wp_, p.yd, dyp, p.convd), (p.zero_p, p.xd, dxp))
    if p.extra_pad is not None:
        t, b, l, r = p.extra_pad
        dx = cupy.ascontiguousarray(dx[:, :, t:p.x_shape[2] - b, l:p.x_shape[3] - r])
    return dx


def conv_backward_filter(x, dy, cdims):
    """``conv_backward_filter(x, dy, cdims)``: ``cudnnConvolutionBackwardFilter``; ``dw`` of shape ``cdims.w_shape``."""
    dtype = x.dtype
    p = plan(cdims, dtype)
    h = _handle()
    x = _prepare_x(p, x)
    dy = _contig(dy, dtype)
    dw = cupy.empty(cdims.w_shape, dtype=dtype)
    xp_, dyp, dwp = x.data.ptr, dy.data.ptr, dw.data.ptr
    _run("bwd_filter", p, h, xp_, dyp, dwp, _fn.cudnnConvolutionBackwardFilter, "cudnnConvolutionBackwardFilter",
         (h, p.one_p, p.xd, xp_, p.yd, dyp, p.convd), (p.zero_p, p.wd, dwp))
    return dw


def conv_backward_bias(dy, cdims):
    """``conv_backward_bias(dy, cdims)``: ``cudnnConvolutionBackwardBias``, ``dy`` summed over ``(0, 2, 3)`` -> ``(K,)``."""
    dtype = dy.dtype
    p = plan(cdims, dtype)
    h = _handle()
    dy = _contig(dy, dtype)
    db = cupy.empty(cdims.w_shape[0], dtype=dtype)
    _check(_fn.cudnnConvolutionBackwardBias(h, p.one_p, p.yd, dy.data.ptr, p.zero_p,
                                            p.bd, db.data.ptr), "cudnnConvolutionBackwardBias", p.describe)
    return db
