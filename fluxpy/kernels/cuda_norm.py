"""Batch normalisation on the GPU: the glue from :mod:`fluxpy.ops.batchnorm` to a kernel, chosen per problem.

Two implementations: fluxpy's own kernels (:mod:`fluxpy.kernels.cuda_bn`, float16/bfloat16/float32/float64, two
launches each way) and cuDNN's calls (:mod:`fluxpy.kernels.cudnn.batchnorm`, float16/float32/float64). For the
halves both keep the statistics and parameters in float32; bfloat16 runs fluxpy's kernels only. Where both take a
problem (shape, dtype, device), the first call times each direction of both on the call's own arrays (the running
statistics left out), by GPU time and back to back, and keeps one (:func:`fluxpy.kernels.compiler.timed_choice`:
the faster back to back of those near the fastest GPU time, cuDNN's path with its activation's own kernel; in an
eager step it also pays the copies a step's journal keeps, which the timing leaves out); :func:`choices` shows what
was kept and the times.
The ``supports`` predicates accept what either takes; other calls run the op's composite. Which implementations
take a problem is answered once per problem (shape, strides, dtype, device, the parameters' kinds, the activation):
a repeated call pays a key and a lookup.

An activation (``act``, None for none) is fused into fluxpy's kernels (its formula compiled in,
:mod:`fluxpy.kernels.cuda_bn`); cuDNN's calls fuse none, so around them it is one elementwise kernel each way (the
traced ``act``, and ``dy`` times its derivative from the output ``y``: cuDNN's backward needs the op to have kept
``y`` and to pass that derivative, ``y_derivative``). A residual joined before the activation (``residual``,
None for none) runs fluxpy's kernels only (:mod:`fluxpy.kernels.cuda_bn`: it is read in their passes).

>>> sorted(KERNELS)
['batchnorm_backward', 'batchnorm_forward']
"""
from __future__ import annotations

import numpy as np

from ..backend import cupy
from ..journal import keep_copies
from ..layout import like_layout
from . import compiler, cuda_bn
from .answers import answered, kind
from .cudnn import batchnorm as bn
from .elementwise import bias_act_backward, bias_act_forward, fuses

__all__ = ["batchnorm_forward", "batchnorm_backward", "KERNELS", "choices"]

_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_choices: dict = {}   # (direction, shape, dtype, device, act) -> compiler.Timed


def choices() -> dict:
    """``{(direction, shape, dtype[, activation]): compiler.Timed}`` for the problems timed so far: the
    implementation kept and the milliseconds of each, by GPU time and back to back.

    >>> isinstance(choices(), dict)
    True
    """
    return {k[:3] + (() if k[4] is None else (k[4],)): v for k, v in _choices.items()}


def _cudnn_fits(x, *params):
    """Whether cuDNN's calls take the problem: C-order data (channels-last runs fluxpy's kernels)."""
    if type(x) is not cupy.ndarray or x.dtype not in _DTYPES or not bn.supported_ndim(x.ndim) or not x._c_contiguous:
        return False
    pdt = bn.param_dtype(x.dtype)
    return all(p is None or (type(p) is cupy.ndarray and p.dtype == pdt) for p in params) and bn.available()


_answers: dict = {}   # problem -> (fluxpy's kernels take it, cuDNN's calls take it)


def _takers(direction, x, params, act, y=None, y_derivative=None, residual=None) -> tuple:
    """``(ours, cudnn)``: whether fluxpy's kernels and cuDNN's calls take the problem (answered once per problem)."""
    if type(x) is not cupy.ndarray:
        return False, False
    key = (direction, x.shape, x.strides, x.dtype, x.device.id, act, y_derivative, type(y),
           tuple(kind(p) for p in params), None if residual is None else (kind(residual), residual.strides))

    def check():
        ours = cuda_bn.supports(x, *params, act=act, residual=residual)
        if residual is not None:
            return ours, False
        if direction == "forward":
            return ours, _cudnn_fits(x, *params) and (act is None or fuses(act))
        return ours, _cudnn_backward_fits(x, y, *params, act, y_derivative)
    return answered(_answers, key, check)


def forward_supports(x, gamma, beta, running_mean, running_var, momentum=None, eps=None, act=None, residual=None):
    """The calls one of the implementations takes (an activation the elementwise tracer compiles, or None; a
    residual of ``x``'s shape, dtype and strides, or None)."""
    return any(_takers("forward", x, (gamma, beta, running_mean, running_var), act, residual=residual))


def backward_supports(dy, x, y, gamma, beta, mean, invstd, eps=None, act=None, y_derivative=None, residual=None):
    """The calls one of the implementations takes: ``dy`` like ``x``, the statistics saved by the forward."""
    if type(dy) is not cupy.ndarray or dy.dtype != x.dtype or dy.shape != x.shape:
        return False
    return any(_takers("backward", x, (gamma, beta, mean, invstd), act, y, y_derivative, residual))


def _cudnn_backward_fits(x, y, gamma, beta, mean, invstd, act, y_derivative):
    """cuDNN's backward takes an activation only through its derivative from the kept output ``y``."""
    if act is not None and (type(y) is not cupy.ndarray or y_derivative is None or not fuses(y_derivative, False)):
        return False
    return _cudnn_fits(x, gamma, beta, mean, invstd)


def _pick(direction, act, x, ours_ok, cudnn_ok, candidates):
    """The implementation to run: the only one that fits, or the one kept on first use (per activation)."""
    if not cudnn_ok:
        return "fluxpy"
    if not ours_ok:
        return "cudnn"
    return answered(_choices, (direction, x.shape, x.dtype, x.device.id, act),
                    lambda: compiler.timed_choice(candidates()), kept=None).kept


def _cudnn_forward(x, gamma, beta, running_mean, running_var, momentum, eps, act):
    keep_copies(running_mean, running_var)   # cuDNN's call keeps no old values for a step's journal: copies
    y, mean, invstd = bn.forward_training(x, gamma, beta, running_mean, running_var, momentum, eps)
    if act is not None:   # cuDNN's legacy batch norm fuses no activation on NCHW data
        y = bias_act_forward(y, None, act)
    return y, mean, invstd


def _cudnn_backward(dy, x, y, gamma, mean, invstd, eps, y_derivative):
    if y_derivative is not None:
        dy, _ = bias_act_backward(y_derivative, y, dy, None, True, False)
    return bn.backward(dy, x, gamma, mean, invstd, eps)


def batchnorm_forward(x, gamma, beta, running_mean, running_var, momentum, eps, act, residual=None):
    """``(y, mean, invstd)`` (``y`` through the activation ``act``, None for none, after the ``residual`` is
    added, None for none), the running statistics updated in place, by the kernel kept for this problem."""
    if residual is not None:
        return cuda_bn.forward_training(x, gamma, beta, running_mean, running_var, momentum, eps, act, residual)
    ours, cudnn = _takers("forward", x, (gamma, beta, running_mean, running_var), act)
    name = _pick("forward", act, x, ours, cudnn, lambda: {
        "fluxpy": lambda: cuda_bn.forward_training(x, gamma, beta, None, None, momentum, eps, act),
        "cudnn": lambda: _cudnn_forward(x, gamma, beta, None, None, momentum, eps, act)})
    impl = cuda_bn.forward_training if name == "fluxpy" else _cudnn_forward
    return impl(x, gamma, beta, running_mean, running_var, momentum, eps, act)


def batchnorm_backward(dy, x, y, gamma, beta, mean, invstd, eps, act, y_derivative, residual=None):
    """``(dx, dgamma, dbeta)`` by the kernel kept for this problem: ``dy`` first multiplied by the derivative of
    the activation ``act`` (fluxpy's kernels recompute it from ``x`` and the ``residual``; cuDNN's path takes
    ``y_derivative`` of the kept output ``y``). With a residual, ``(dx, dgamma, dbeta, dresidual)``."""
    dy = like_layout(dy, x)
    if residual is not None:
        return cuda_bn.backward(dy, x, gamma, beta, mean, invstd, eps, act, residual)
    ours, cudnn = _takers("backward", x, (gamma, beta, mean, invstd), act, y, y_derivative)
    name = _pick("backward", act, x, ours, cudnn, lambda: {
        "fluxpy": lambda: cuda_bn.backward(dy, x, gamma, beta, mean, invstd, eps, act),
        "cudnn": lambda: _cudnn_backward(dy, x, y, gamma, mean, invstd, eps, y_derivative)})
    if name == "fluxpy":
        return cuda_bn.backward(dy, x, gamma, beta, mean, invstd, eps, act)
    return _cudnn_backward(dy, x, y, gamma, mean, invstd, eps, y_derivative)


KERNELS = {
    "batchnorm_forward": (batchnorm_forward, forward_supports),
    "batchnorm_backward": (batchnorm_backward, backward_supports),
}
