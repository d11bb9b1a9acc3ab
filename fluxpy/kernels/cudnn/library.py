"""Finding, loading and binding ``libcudnn.so.9`` with ctypes.

The library is looked for, in order, at the ``cudnn_library`` option (:mod:`fluxpy.options`), in the
``nvidia-cudnn-cu13`` wheel (``site-packages/nvidia/cudnn/lib``, whose sub-libraries ``libcudnn_graph``,
``libcudnn_ops``, ``libcudnn_cnn``, ``libcudnn_engines_*`` are preloaded with ``RTLD_GLOBAL`` so that the shim's
``dlopen`` finds them) and on the system (``ctypes.util.find_library("cudnn")``). It is loaded once,
on first use, and every function of :data:`SIGNATURES` (the legacy calls and the backend API) is
bound on :data:`fn` with its argument and result types.

The module imports without CuPy or cuDNN; :func:`available` says whether cuDNN can run and why not.

>>> ok, why = available()
>>> isinstance(ok, bool) and isinstance(why, str)
True
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

from ...backend import cupy
from ...options import options

__all__ = ["fn", "SIGNATURES", "OPTIONAL_SIGNATURES", "has", "load", "loaded", "load_error", "library_path",
           "available", "version", "require", "wheel_dirs", "candidates"]

_lib = None
_load_error = None
_lib_path = None
_lock = threading.RLock()

# Sub-libraries of cuDNN 9, in dependency order; the shim dlopens them by soname.
SUBLIBS = ("libcudnn_graph.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_engines_runtime_compiled.so.9",
           "libcudnn_heuristic.so.9", "libcudnn_ops.so.9", "libcudnn_cnn.so.9", "libcudnn_adv.so.9")

_P, _I, _S, _D = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_double
_I64 = ctypes.c_int64
_I32, _U32 = ctypes.c_int32, ctypes.c_uint32
_PI = ctypes.POINTER(ctypes.c_int)
_PS = ctypes.POINTER(ctypes.c_size_t)

SIGNATURES = {
    # general
    "cudnnGetVersion": ([], ctypes.c_size_t),
    "cudnnGetErrorString": ([_I], ctypes.c_char_p),
    "cudnnCreate": ([_P], _I),
    "cudnnSetStream": ([_P, _P], _I),
    # legacy descriptors
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
    # legacy convolutions
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
    # the backend (graph) API
    "cudnnBackendCreateDescriptor": ([_I, _P], _I),
    "cudnnBackendDestroyDescriptor": ([_P], _I),
    "cudnnBackendFinalize": ([_P], _I),
    "cudnnBackendSetAttribute": ([_P, _I, _I, _I64, _P], _I),
    "cudnnBackendGetAttribute": ([_P, _I, _I, _I64, _P, _P], _I),
    "cudnnBackendExecute": ([_P, _P, _P], _I),
}
"""``{name: (argtypes, restype)}`` of every cuDNN function fluxpy calls."""

OPTIONAL_SIGNATURES = {
    # legacy batch normalisation (deprecated in cuDNN 9, still shipped): bound where the library has them
    "cudnnDeriveBNTensorDescriptor": ([_P, _P, _I], _I),
    "cudnnBatchNormalizationForwardTraining": ([_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _D, _P, _P, _D, _P, _P],
                                               _I),
    "cudnnBatchNormalizationForwardInference": ([_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _D], _I),
    "cudnnBatchNormalizationBackward": ([_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _D, _P,
                                         _P], _I),
    # the RNN API (libcudnn_adv; fluxpy.kernels.cudnn.rnn), and reading back a tensor descriptor cuDNN filled in
    "cudnnGetTensorNdDescriptor": ([_P, _I, _PI, _PI, _PI, _PI], _I),
    "cudnnCreateDropoutDescriptor": ([_P], _I),
    "cudnnSetDropoutDescriptor": ([_P, _P, ctypes.c_float, _P, _S, ctypes.c_ulonglong], _I),
    "cudnnCreateRNNDescriptor": ([_P], _I),
    "cudnnDestroyRNNDescriptor": ([_P], _I),
    "cudnnSetRNNDescriptor_v8": ([_P, _I, _I, _I, _I, _I, _I, _I, _I, _I32, _I32, _I32, _I32, _P, _U32], _I),
    "cudnnCreateRNNDataDescriptor": ([_P], _I),
    "cudnnDestroyRNNDataDescriptor": ([_P], _I),
    "cudnnSetRNNDataDescriptor": ([_P, _I, _I, _I, _I, _I, _PI, _P], _I),
    "cudnnGetRNNWeightSpaceSize": ([_P, _P, _PS], _I),
    "cudnnGetRNNTempSpaceSizes": ([_P, _P, _I, _P, _PS, _PS], _I),
    "cudnnGetRNNWeightParams": ([_P, _P, _I32, _S, _P, _I32, _P, _P, _P, _P], _I),
    "cudnnRNNForward": ([_P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _S, _P, _S, _P, _S, _P], _I),
    "cudnnRNNBackwardData_v8": ([_P] * 16 + [_S, _P, _S, _P, _S, _P], _I),
    "cudnnRNNBackwardWeights_v8": ([_P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _S, _P, _S, _P, _S, _P], _I),
}
"""Functions bound only where the loaded library exports them (``has(name)`` says which)."""


class Functions:
    """The bound functions of :data:`SIGNATURES`, as attributes (set when the library loads)."""


fn = Functions()
"""``fn.cudnnConvolutionForward(...)`` and so on, once :func:`load` has succeeded."""


def wheel_dirs() -> list[str]:
    """The ``nvidia/cudnn/lib`` folders of installed ``nvidia-cudnn-cu*`` wheels that hold ``libcudnn.so.9``.

    >>> all(d.endswith("lib") for d in wheel_dirs())
    True
    """
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


def candidates() -> list[str]:
    """The paths (or sonames) tried, in order: the ``cudnn_library`` option alone where it is set, else the wheels',
    the system's, then plain ``libcudnn.so.9``.

    >>> with options(cudnn_library="/opt/cudnn/libcudnn.so.9"):
    ...     candidates()
    ['/opt/cudnn/libcudnn.so.9']
    >>> with options(cudnn_library=None):
    ...     candidates()[-1]
    'libcudnn.so.9'
    """
    if options.cudnn_library:
        return [options.cudnn_library]
    out = [os.path.join(d, "libcudnn.so.9") for d in wheel_dirs()]
    found = ctypes.util.find_library("cudnn")
    if found:
        out.append(found)
    out.append("libcudnn.so.9")
    return out


def _preload(folder):
    for name in SUBLIBS:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass   # e.g. engines_runtime_compiled without NVRTC: cuDNN reports what it misses


def _bind(lib):
    for name, (args, res) in SIGNATURES.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
        setattr(fn, name, f)
    for name, (args, res) in OPTIONAL_SIGNATURES.items():
        f = getattr(lib, name, None)
        if f is not None:
            f.argtypes, f.restype = args, res
            setattr(fn, name, f)


def has(name: str) -> bool:
    """Whether the loaded library has the function ``name`` (False before it is loaded).

    >>> has("cudnnNoSuchFunction")
    False
    """
    return hasattr(fn, name)


def load() -> ctypes.CDLL | None:
    """Load and bind libcudnn once; the ``CDLL``, or None (then :func:`load_error` says why)."""
    global _lib, _load_error, _lib_path
    if _lib is not None or _load_error is not None:
        return _lib
    with _lock:
        if _lib is not None or _load_error is not None:
            return _lib
        errors = []
        for path in candidates():
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
            "); install nvidia-cudnn-cu13 (fluxpy[cuda]) or set the cudnn_library option " \
            "(fluxpy.options, or $FLUXPY_CUDNN_LIBRARY)"
        return None


def loaded() -> bool:
    """Whether the library has been loaded and bound (without trying to load it).

    >>> loaded() in (True, False)
    True
    """
    return _lib is not None


def load_error() -> str | None:
    """Why the library could not be loaded, or None (not tried yet, or loaded)."""
    return _load_error


def library_path() -> str | None:
    """The path the library was loaded from, or None."""
    return _lib_path


def available() -> tuple[bool, str]:
    """``(ok, reason)``: whether cuDNN can run here (CuPy, a GPU and libcudnn.so.9), and if not, why.

    >>> ok, why = available()
    >>> ok or "unavailable" in why or "could not" in why or "CuPy" in why or "CUDA" in why
    True
    """
    if cupy is None:
        return False, "fluxpy.kernels.cudnn is unavailable: CuPy could not be imported"
    from ...backend import gpu_available
    ok, why = gpu_available()
    if not ok:
        return False, f"fluxpy.kernels.cudnn is unavailable: {why}"
    if load() is None:
        return False, f"fluxpy.kernels.cudnn is unavailable: {_load_error}"
    return True, f"cuDNN {version()} from {_lib_path}"


def version() -> int | None:
    """cuDNN's version number (e.g. 91900), or None when it cannot be loaded.

    >>> v = version()
    >>> v is None or v >= 90000
    True
    """
    if load() is None:
        return None
    return int(fn.cudnnGetVersion())


def require() -> None:
    """Raise ``RuntimeError`` saying why where cuDNN cannot run (see :func:`available`)."""
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
