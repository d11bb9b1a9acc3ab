"""Batch normalisation on the GPU: the glue from :mod:`fluxpy.ops.batchnorm` to cuDNN's calls.

``batchnorm_forward`` and ``batchnorm_backward`` take the op's arguments and run one cuDNN call each
(:mod:`fluxpy.kernels.cudnn.batchnorm`). Their ``supports`` predicates accept what cuDNN takes: CuPy
arrays of 2 to 4 axes in float16, float32 or float64, with parameters and statistics in cuDNN's
parameter dtype (float32, float64 for float64 inputs); other calls run the op's composite.

>>> sorted(KERNELS)
['batchnorm_backward', 'batchnorm_forward']
"""
from __future__ import annotations

import numpy as np

from ..backend import cupy
from .cudnn import batchnorm as bn

__all__ = ["batchnorm_forward", "batchnorm_backward", "KERNELS"]

_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _fits(x, *params):
    if type(x) is not cupy.ndarray or x.dtype not in _DTYPES or not bn.supported_ndim(x.ndim):
        return False
    pdt = bn.param_dtype(x.dtype)
    return all(p is None or (type(p) is cupy.ndarray and p.dtype == pdt) for p in params) and bn.available()


def forward_supports(x, gamma, beta, running_mean, running_var, *_):
    """The calls cuDNN's training forward takes."""
    return _fits(x, gamma, beta, running_mean, running_var)


def backward_supports(dy, x, gamma, mean, invstd, *_):
    """The calls cuDNN's backward takes: ``dy`` like ``x``, the statistics saved by the forward."""
    return type(dy) is cupy.ndarray and dy.dtype == x.dtype and dy.shape == x.shape and _fits(x, gamma, mean,
                                                                                                  invstd)


def batchnorm_forward(x, gamma, beta, running_mean, running_var, momentum, eps):
    """``(y, mean, invstd)`` in one ``cudnnBatchNormalizationForwardTraining``; running statistics updated."""
    return bn.forward_training(x, gamma, beta, running_mean, running_var, momentum, eps)


def batchnorm_backward(dy, x, gamma, mean, invstd, eps):
    """``(dx, dgamma, dbeta)`` in one ``cudnnBatchNormalizationBackward``."""
    return bn.backward(dy, x, gamma, mean, invstd, eps)


KERNELS = {
    "batchnorm_forward": (batchnorm_forward, forward_supports),
    "batchnorm_backward": (batchnorm_backward, backward_supports),
}
