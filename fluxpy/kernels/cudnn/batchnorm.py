"""cuDNN's batch normalisation over the channel axis 1 (legacy API, ``CUDNN_BATCHNORM_SPATIAL``).

Three calls, on NCHW CuPy arrays (2-d ``(N, C)`` and 3-d ``(N, C, L)`` inputs are viewed as 4-d with unit
axes):

- :func:`forward_training`: ``y = (x - mean) / sqrt(var + eps) * gamma + beta`` with the batch's
  statistics, the running statistics moved towards them on the device (``running = (1 - momentum) *
  running + momentum * batch``, the variance unbiased, as PyTorch and Flux), and the batch mean and
  ``1 / sqrt(var + eps)`` saved for the backward pass;
- :func:`forward_inference`: the same with given statistics;
- :func:`backward`: ``dx``, ``dgamma``, ``dbeta`` from the saved statistics, in one call.

Parameters and statistics are float32 for float32 and float16 inputs, float64 for float64 (cuDNN's rule).
The descriptors are made once per (shape, dtype, device) and cached. :func:`available` says whether the
loaded library has these calls (deprecated in cuDNN 9 but still shipped).

>>> supported_ndim(4), supported_ndim(5)
(True, False)
"""
from __future__ import annotations

import ctypes

import numpy as np

from ...backend import cupy
from ..cuda_arrays import c_contiguous
from .descriptors import data_type, scalars, tensor_descriptor
from .errors import check
from .handle import get_handle
from .library import fn, has, load, load_error

__all__ = ["available", "supported_ndim", "param_dtype", "forward_training", "forward_inference", "backward"]

BN_SPATIAL = 1                                             # cudnnBatchNormMode_t
_CALLS = ("cudnnDeriveBNTensorDescriptor", "cudnnBatchNormalizationForwardTraining",
          "cudnnBatchNormalizationForwardInference", "cudnnBatchNormalizationBackward")


def available() -> bool:
    """Whether cuDNN loads and has the batch-norm calls.

    >>> available() in (True, False)
    True
    """
    if not _available:
        _available.append(cupy is not None and load() is not None and all(has(c) for c in _CALLS))
    return _available[0]


_available: list = []   # the answer, once asked (the library does not change in a process)


def supported_ndim(ndim: int) -> bool:
    """Whether an input of ``ndim`` axes is handled (2, 3 or 4: viewed as NCHW)."""
    return 2 <= ndim <= 4


def param_dtype(dtype) -> np.dtype:
    """The dtype cuDNN wants for gamma, beta and the statistics of an input of ``dtype``.

    >>> param_dtype(np.float16), param_dtype(np.float64)
    (dtype('float32'), dtype('float64'))
    """
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


class _Descriptors:
    """The x/y descriptor and the derived (1, C, 1, 1) parameter descriptor of one problem."""
    __slots__ = ("x", "bn", "one", "zero", "one_p", "zero_p")

    def __init__(self, shape4, dtype):
        self.x = tensor_descriptor(shape4, dtype)
        bn = ctypes.c_void_p()
        check(fn.cudnnCreateTensorDescriptor(ctypes.byref(bn)), "cudnnCreateTensorDescriptor")
        self.bn = bn.value
        check(fn.cudnnDeriveBNTensorDescriptor(self.bn, self.x, BN_SPATIAL), "cudnnDeriveBNTensorDescriptor",
              lambda: f"x of shape {shape4} {np.dtype(dtype)}")
        self.one, self.zero = scalars(dtype)
        self.one_p, self.zero_p = ctypes.addressof(self.one), ctypes.addressof(self.zero)


_descriptors: dict = {}
_unit: dict = {}    # (C, dtype, device) -> (ones, zeros) for affine=False


def _shape4(shape):
    return tuple(shape) + (1,) * (4 - len(shape))


def _desc(x):
    key = (x.shape, x.dtype, x.device.id)
    d = _descriptors.get(key)
    if d is None:
        if not available():
            raise RuntimeError(f"cuDNN batch norm: needs cuDNN with the calls {', '.join(_CALLS)}; "
                               f"{load_error() or 'the loaded library lacks one of them'}")
        data_type(x.dtype)   # a clear error for a dtype cuDNN lacks
        d = _descriptors[key] = _Descriptors(_shape4(x.shape), x.dtype)
    return d


def _params(x, gamma, beta):
    if gamma is not None and beta is not None:
        return gamma, beta
    key = (x.shape[1], param_dtype(x.dtype), x.device.id)
    unit = _unit.get(key)
    if unit is None:
        unit = _unit[key] = (cupy.ones(key[0], key[1]), cupy.zeros(key[0], key[1]))
    return (unit[0] if gamma is None else gamma), (unit[1] if beta is None else beta)


def _ptr(a):
    return 0 if a is None else a.data.ptr


def _what(x):
    return lambda: f"x of shape {tuple(x.shape)} {x.dtype}"


def forward_training(x, gamma, beta, running_mean, running_var, momentum: float, eps: float):
    """``(y, saved_mean, saved_invstd)``; ``running_mean``/``running_var`` (or None) are updated in place."""
    x = c_contiguous(x)
    d = _desc(x)
    g, b = _params(x, gamma, beta)
    y = cupy.empty_like(x)
    pdt = param_dtype(x.dtype)
    mean = cupy.empty(x.shape[1], pdt)
    invstd = cupy.empty(x.shape[1], pdt)
    check(fn.cudnnBatchNormalizationForwardTraining(
        get_handle(), BN_SPATIAL, d.one_p, d.zero_p, d.x, x.data.ptr, d.x, y.data.ptr, d.bn, g.data.ptr, b.data.ptr,
        float(momentum), _ptr(running_mean), _ptr(running_var), float(eps), mean.data.ptr, invstd.data.ptr),
        "cudnnBatchNormalizationForwardTraining", _what(x))
    return y, mean, invstd


def forward_inference(x, gamma, beta, mean, var, eps: float):
    """``y = (x - mean) / sqrt(var + eps) * gamma + beta`` with the given statistics."""
    x = c_contiguous(x)
    d = _desc(x)
    g, b = _params(x, gamma, beta)
    y = cupy.empty_like(x)
    check(fn.cudnnBatchNormalizationForwardInference(
        get_handle(), BN_SPATIAL, d.one_p, d.zero_p, d.x, x.data.ptr, d.x, y.data.ptr, d.bn, g.data.ptr, b.data.ptr,
        mean.data.ptr, var.data.ptr, float(eps)), "cudnnBatchNormalizationForwardInference", _what(x))
    return y


def backward(dy, x, gamma, saved_mean, saved_invstd, eps: float):
    """``(dx, dgamma, dbeta)`` from the statistics that :func:`forward_training` saved."""
    x = c_contiguous(x)
    dy = c_contiguous(dy)
    d = _desc(x)
    g, _ = _params(x, gamma, None)
    dx = cupy.empty_like(x)
    pdt = param_dtype(x.dtype)
    dgamma = cupy.empty(x.shape[1], pdt)
    dbeta = cupy.empty(x.shape[1], pdt)
    check(fn.cudnnBatchNormalizationBackward(
        get_handle(), BN_SPATIAL, d.one_p, d.zero_p, d.one_p, d.zero_p, d.x, x.data.ptr, d.x, dy.data.ptr, d.x,
        dx.data.ptr, d.bn, g.data.ptr, dgamma.data.ptr, dbeta.data.ptr, float(eps), saved_mean.data.ptr,
        saved_invstd.data.ptr), "cudnnBatchNormalizationBackward", _what(x))
    return dx, dgamma, dbeta


def clear_cache() -> None:
    """Forget the cached descriptors and unit parameters.

    >>> clear_cache()
    """
    _descriptors.clear()
    _unit.clear()
