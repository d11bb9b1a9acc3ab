"""Batch normalisation on the GPU: the glue from :mod:`fluxpy.ops.batchnorm` to a kernel, chosen per problem.

Two implementations: fluxpy's own kernels (:mod:`fluxpy.kernels.cuda_bn`, float16/bfloat16/float32/float64, two
launches each way) and cuDNN's calls (:mod:`fluxpy.kernels.cudnn.batchnorm`, float16/float32/float64). For the
halves both keep the statistics and parameters in float32; bfloat16 runs fluxpy's kernels only. Where both take a
problem (shape, dtype, device), the first call times the GPU time of each direction of both on the call's own arrays
(the running statistics left out) and keeps the faster; :func:`choices` shows what was kept and the times.
The ``supports`` predicates accept what either takes; other calls run the op's composite.

>>> sorted(KERNELS)
['batchnorm_backward', 'batchnorm_forward']
"""
from __future__ import annotations

import numpy as np

from ..backend import cupy
from ..layout import like_layout
from . import compiler, cuda_bn
from .cudnn import batchnorm as bn

__all__ = ["batchnorm_forward", "batchnorm_backward", "KERNELS", "choices"]

_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_choices: dict = {}   # (direction, shape, dtype, device) -> (name, {name: us})


def choices() -> dict:
    """``{(direction, shape, dtype): (kept, {implementation: microseconds})}`` for the problems timed so far.

    >>> isinstance(choices(), dict)
    True
    """
    return {k[:3]: v for k, v in _choices.items()}


def _cudnn_fits(x, *params):
    """Whether cuDNN's calls take the problem: C-order data (channels-last runs fluxpy's kernels)."""
    if type(x) is not cupy.ndarray or x.dtype not in _DTYPES or not bn.supported_ndim(x.ndim) or not x._c_contiguous:
        return False
    pdt = bn.param_dtype(x.dtype)
    return all(p is None or (type(p) is cupy.ndarray and p.dtype == pdt) for p in params) and bn.available()


def forward_supports(x, gamma, beta, running_mean, running_var, *_):
    """The calls one of the implementations takes."""
    params = (gamma, beta, running_mean, running_var)
    return cuda_bn.supports(x, *params) or _cudnn_fits(x, *params)


def backward_supports(dy, x, y, gamma, beta, mean, invstd, *_):
    """The calls one of the implementations takes: ``dy`` like ``x``, the statistics saved by the forward."""
    if type(dy) is not cupy.ndarray or dy.dtype != x.dtype or dy.shape != x.shape:
        return False
    return cuda_bn.supports(x, gamma, beta, mean, invstd) or _cudnn_fits(x, gamma, beta, mean, invstd)


def _pick(direction, x, ours_ok, cudnn_ok, candidates):
    """The implementation to run: the only one that fits, or the faster one timed on first use."""
    if not cudnn_ok:
        return "fluxpy"
    if not ours_ok:
        return "cudnn"
    key = (direction, x.shape, x.dtype, x.device.id)
    hit = _choices.get(key)
    if hit is None:
        times = {name: compiler.time_ms(run, hide_host=True) * 1000.0 for name, run in candidates().items()}
        hit = _choices[key] = (min(times, key=times.get), times)
    return hit[0]


def _cudnn_forward(x, gamma, beta, running_mean, running_var, momentum, eps, relu):
    y, mean, invstd = bn.forward_training(x, gamma, beta, running_mean, running_var, momentum, eps)
    if relu:   # cuDNN's legacy batch norm fuses no activation on NCHW data
        cupy.maximum(y, 0, out=y)
    return y, mean, invstd


def _cudnn_backward(dy, x, y, gamma, mean, invstd, eps, relu):
    if relu:
        dy = dy * (y > 0)
    return bn.backward(dy, x, gamma, mean, invstd, eps)


def batchnorm_forward(x, gamma, beta, running_mean, running_var, momentum, eps, kind):
    """``(y, mean, invstd)`` (``y`` through relu for ``kind="relu"``), the running statistics updated in place,
    by the kernel kept for this problem."""
    params = (gamma, beta, running_mean, running_var)
    relu = kind == "relu"
    name = _pick("forward", x, cuda_bn.supports(x, *params), _cudnn_fits(x, *params), lambda: {
        "fluxpy": lambda: cuda_bn.forward_training(x, gamma, beta, None, None, momentum, eps, relu),
        "cudnn": lambda: _cudnn_forward(x, gamma, beta, None, None, momentum, eps, relu)})
    impl = cuda_bn.forward_training if name == "fluxpy" else _cudnn_forward
    return impl(x, gamma, beta, running_mean, running_var, momentum, eps, relu)


def batchnorm_backward(dy, x, y, gamma, beta, mean, invstd, eps, kind):
    """``(dx, dgamma, dbeta)`` by the kernel kept for this problem (``dy`` masked by ``y > 0`` for relu)."""
    params = (gamma, beta, mean, invstd)
    relu = kind == "relu"
    dy = like_layout(dy, x)
    name = _pick("backward", x, cuda_bn.supports(x, *params), _cudnn_fits(x, *params), lambda: {
        "fluxpy": lambda: cuda_bn.backward(dy, x, gamma, beta, mean, invstd, eps, relu),
        "cudnn": lambda: _cudnn_backward(dy, x, y, gamma, mean, invstd, eps, relu)})
    if name == "fluxpy":
        return cuda_bn.backward(dy, x, gamma, beta, mean, invstd, eps, relu)
    return _cudnn_backward(dy, x, y, gamma, mean, invstd, eps, relu)


KERNELS = {
    "batchnorm_forward": (batchnorm_forward, forward_supports),
    "batchnorm_backward": (batchnorm_backward, backward_supports),
}
