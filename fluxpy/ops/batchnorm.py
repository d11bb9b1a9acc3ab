"""Batch normalisation in training as one primitive each way, with the running statistics updated on the device.

``batchnorm(x, gamma, beta, running_mean, running_var; momentum, eps)`` normalises ``x`` (``(N, C, ...)``)
with the batch's per-channel statistics over every axis but 1:

    y = (x - mean) / sqrt(var + eps) * gamma + beta

and moves the running statistics towards the batch's, in place: ``running = (1 - momentum) * running +
momentum * batch``, the variance unbiased (``var * m / (m - 1)``, ``m = x.size // C``), as Flux and PyTorch.
The forward saves only the mean and ``invstd = 1 / sqrt(var + eps)``; the pullback is
:func:`batchnorm_backward`, with ``xhat = (x - mean) * invstd`` and ``m`` values per channel:

    dbeta = sum(dy),  dgamma = sum(dy * xhat),  dx = gamma * invstd * (dy - dbeta / m - xhat * dgamma / m)

A ``residual`` (``x``'s shape and dtype; a residual block's shortcut) is added before the activation,
``act(y + residual)``, and its gradient is ``dy`` times the activation's derivative: a residual block's join and
relu then run in the batch norm's own apply pass on the GPU. Backward, where the activation's derivative reads the
output (relu), that derivative is one elementwise pass before the batch norm's backward; otherwise the backward
kernels read the residual to recompute the pre-activation and write its gradient beside ``dx``.

An activation ``act`` applied to ``y`` is fused into both directions (on the GPU compiled into the batch-norm
kernels from its one Python definition, for every activation :func:`fluxpy.ops.bias_act.why_not_fused` passes):
the pullback multiplies ``dy`` by ``act'``, from the output where the activation's derivative is a function of it
(:data:`fluxpy.ops.activations.DERIVATIVES_FROM_OUTPUT`), else at the pre-activation, recomputed from ``x``.

Both directions go through the kernel table (``batchnorm_forward``, ``batchnorm_backward``: on the GPU fluxpy's
kernels or cuDNN's calls); the CPU runs the same formulas with NumPy. Differentiated again (a nested ``gradient``),
the statistics are recomputed with fluxpy ops so the outer tape sees how they depend on ``x``.

float16 and bfloat16 ``x`` (and ``dy``) are computed in float32 and ``y``/``dx`` rounded once to ``x``'s dtype;
their ``gamma``, ``beta``, running statistics and saved statistics are float32 (cuDNN's rule), and so are
``dgamma``/``dbeta``.

>>> import numpy as np
>>> x = np.array([[0.0, 1.0], [2.0, 5.0]])
>>> rm, rv = np.zeros(2), np.ones(2)
>>> batchnorm(x, np.ones(2), np.zeros(2), rm, rv, momentum=0.5, eps=0.0)
array([[-1., -1.],
       [ 1.,  1.]])
>>> rm, rv
(array([0.5, 1.5]), array([1.5, 4.5]))
"""
from __future__ import annotations

from collections.abc import Callable

import math
import numbers
from typing import Any

import numpy as np

from ..autodiff import Primitive, is_tracked, value_of
from ..backend import Array, get_array_module
from ..kernels import find
from ..kernels.cpu_norm import update_running as _update_running
from ..kernels.halfs import is_half
from ..journal import changing
from .activations import identity
from .basic import sqrt
from .bias_act import _times, bias_act_backward, derivative_from_saved
from .fused import fused_op
from .reduce import mean as _mean
from .reduce import sum as _sum
from .shape import astype, reshape

__all__ = ["batchnorm", "batchnorm_backward", "check_eps"]


def check_eps(op: str, eps: Any) -> None:
    """Raise unless ``eps`` is a finite real number >= 0, naming the normalisation ``op``: a negative one makes
    ``var + eps`` negative, and so the result NaN, wherever the variance is smaller; an infinite one makes it 0.

    >>> check_eps("layernorm", 1e-5)
    >>> check_eps("layernorm", -1e-5)
    Traceback (most recent call last):
    ...
    ValueError: layernorm expects eps to be a finite number >= 0, got -1e-05
    """
    if type(eps) is float and 0 <= eps < math.inf:   # the common case, decided without the checks below
        return
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < math.inf:
        raise ValueError(f"{op} expects eps to be a finite number >= 0, got {eps!r}")


def _axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _channel_shape(x):
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _count(x):
    return x.size // x.shape[1]


def _channel_mean(x, axes, m):
    """``x.mean(axes)`` (``m`` values each): for NumPy, its sum divided by ``m``, the same numbers without the
    Python layer of ``ndarray.mean``."""
    return x.sum(axis=axes) / m if type(x) is np.ndarray else x.mean(axis=axes)


def _forward_arrays(x, gamma, beta, running_mean, running_var, momentum, eps, act, residual=None):
    """The forward on plain arrays of any module: ``(y, mean, invstd)``, the running statistics updated."""
    if is_half(x.dtype):   # computed in float32; y rounded once to x's dtype, the statistics stay float32
        r32 = None if residual is None else residual.astype(np.float32)
        y, mean, invstd = _forward_arrays(x.astype(np.float32), gamma, beta, running_mean, running_var, momentum,
                                          eps, act, r32)
        return y.astype(x.dtype), mean, invstd
    xp = get_array_module(x)
    shape, axes, m = _channel_shape(x), _axes(x), _count(x)
    mean = _channel_mean(x, axes, m)
    xc = x - mean.reshape(shape)
    var = _channel_mean(xc * xc, axes, m)
    invstd = 1 / xp.sqrt(var + eps)
    y = xc * invstd.reshape(shape)
    if gamma is not None:
        y *= gamma.reshape(shape)
    if beta is not None:
        y += beta.reshape(shape)
    if residual is not None:
        y += residual
    if act is not None:
        y = act(y)
    _update_running(running_mean, running_var, mean, var, momentum, m)
    return y, mean, invstd


def _forward_ops(x, gamma, beta, running_mean, running_var, momentum, eps, act, residual=None):
    """The forward with fluxpy ops, for values an outer tape tracks."""
    if is_half(x.dtype):
        r32 = None if residual is None else astype(residual, np.float32)
        y, mean, invstd = _forward_ops(astype(x, np.float32), gamma, beta, running_mean, running_var, momentum, eps,
                                       act, r32)
        return astype(y, x.dtype), mean, invstd
    shape = _channel_shape(x)
    mean = _mean(x, _axes(x))
    xc = x - reshape(mean, shape)
    var = _mean(xc * xc, _axes(x))
    invstd = 1 / sqrt(var + eps)
    y = xc * reshape(invstd, shape)
    if gamma is not None:
        y = y * reshape(gamma, shape)
    if beta is not None:
        y = y + reshape(beta, shape)
    if residual is not None:
        y = y + residual
    if act is not None:
        y = act(y)
    _update_running(running_mean, running_var, value_of(mean), value_of(var), momentum, _count(x))
    return y, mean, invstd


def _forward(x, gamma, beta, running_mean, running_var, momentum, eps, act, residual=None):
    args = (x, gamma, beta, running_mean, running_var, momentum, eps, act) + (() if residual is None else (residual,))
    kernel = find("batchnorm_forward", *args)
    return _forward_arrays(*args) if kernel is None else kernel(*args)


def _backward_ops(dy, x, y, gamma, beta, mean, invstd, eps, act, y_derivative, residual=None):
    if is_half(x.dtype):   # in float32, as the statistics; dx (and dresidual) rounded once to x's dtype
        y32 = None if y is None else astype(y, np.float32)
        r32 = None if residual is None else astype(residual, np.float32)
        grads = _backward_ops(astype(dy, np.float32), astype(x, np.float32), y32, gamma, beta, mean, invstd, eps,
                              act, y_derivative, r32)
        return (astype(grads[0], x.dtype),) + grads[1:3] + tuple(astype(g, x.dtype) for g in grads[3:])
    shape = _channel_shape(x)
    axes = _axes(x)
    m = _count(x)
    xhat = (x - reshape(mean, shape)) * reshape(invstd, shape)
    if act is not None:
        if y is not None and y_derivative is not None:
            dy = _times(dy, y_derivative(y))
        else:   # the derivative at the pre-activation, recomputed from x (and the residual)
            z = xhat if gamma is None else xhat * reshape(gamma, shape)
            z = z if beta is None else z + reshape(beta, shape)
            dy = _times(dy, derivative_from_saved(act)[0](z if residual is None else z + residual))
    dbeta = _sum(dy, axes)
    dgamma = _sum(dy * xhat, axes)
    scale = invstd if gamma is None else gamma * invstd
    dx = reshape(scale, shape) * (dy - reshape(dbeta / m, shape) - xhat * reshape(dgamma / m, shape))
    return (dx, dgamma, dbeta) if residual is None else (dx, dgamma, dbeta, dy)


batchnorm_backward = fused_op("batchnorm_backward", _backward_ops, doc="""
    ``(dx, dgamma, dbeta)`` of :func:`batchnorm` from the saved ``mean`` and ``invstd``, ``dy`` first multiplied
    by the derivative of the activation ``act`` (None for none): ``y_derivative(y)`` where the output ``y`` was kept
    (``y_derivative`` the activation's derivative as a function of its output), else ``act'`` at the
    pre-activation recomputed from ``x`` (and the ``residual`` added before the activation, when one was: then
    ``(dx, dgamma, dbeta, dresidual)``, ``dresidual`` that product). Two launches (or cuDNN's call) on the GPU, the
    formulas of the module docstring otherwise.

    >>> import numpy as np
    >>> x = np.array([[0.0], [2.0]])
    >>> m, s = np.array([1.0]), np.array([1.0])
    >>> dx, dgamma, dbeta = batchnorm_backward(np.array([[1.0], [3.0]]), x, None, None, None, m, s, 0.0, None, None)
    >>> dx.ravel(), dgamma, dbeta
    (array([0., 0.]), array([2.]), array([4.]))
    """)


def _batchnorm_rule(needs, x, gamma, beta, running_mean, running_var, momentum, eps, act, residual):
    if is_tracked(x) or is_tracked(gamma) or is_tracked(beta) or is_tracked(residual):
        y, mean, invstd = _forward_ops(x, gamma, beta, running_mean, running_var, momentum, eps, act, residual)
    else:
        y, mean, invstd = _forward(x, gamma, beta, running_mean, running_var, momentum, eps, act, residual)
    # the output is kept only where the activation's derivative reads it (the next layer holds it anyway)
    y_derivative, from_output = derivative_from_saved(act) if act is not None else (None, False)
    y_saved = y if from_output else None
    y_derivative = y_derivative if from_output else None
    # With a residual and an activation whose derivative reads the output, the pullback first takes dz = dy act'(y),
    # the residual's gradient, in one elementwise pass and then the batch norm's backward of dz: on the GPU that
    # measured faster than the backward kernels reading the residual again (BENCHMARKS.md, batch norm). Other
    # activations need the pre-activation, which only the residual recomputes.
    split = residual is not None and act is not None and from_output
    joined = residual if act is not None and not from_output else None

    def batchnorm_pullback(dy):
        if split:
            dy = bias_act_backward(y_derivative, y_saved, dy, None, True, False)[0]
            dx, dgamma, dbeta = batchnorm_backward(dy, x, None, gamma, beta, mean, invstd, eps, None, None)
            dresidual = dy
        elif joined is None:
            dx, dgamma, dbeta = batchnorm_backward(dy, x, y_saved, gamma, beta, mean, invstd, eps, act, y_derivative)
            dresidual = dy
        else:
            dx, dgamma, dbeta, dresidual = batchnorm_backward(dy, x, y_saved, gamma, beta, mean, invstd, eps, act,
                                                              y_derivative, joined)
        return ((dx if needs[0] else None), (dgamma if needs[1] else None), (dbeta if needs[2] else None),
                None, None, None, None, None, (dresidual if needs[8] and residual is not None else None))
    return y, batchnorm_pullback


_batchnorm = Primitive("batchnorm", _batchnorm_rule, needs_mask=True,
                       impl=lambda *args: _forward(*args)[0])


def _check_residual(x, residual):
    """The residual must match ``x`` in shape and dtype (it is added to the normalised ``x`` item for item)."""
    if residual is None:
        return
    shape, dtype = tuple(getattr(residual, "shape", ())), getattr(residual, "dtype", None)
    if shape != tuple(x.shape) or dtype != x.dtype:
        raise ValueError(f"batchnorm expects a residual of x's shape and dtype, {tuple(x.shape)} "
                         f"{np.dtype(x.dtype).name}, got {shape} {dtype if dtype is None else np.dtype(dtype).name}")


def _check(x, **params):
    if not hasattr(x, "ndim") or x.ndim < 2:
        raise ValueError(f"batchnorm expects x of shape (N, C, ...) with the channels on axis 1, got "
                         f"{tuple(getattr(x, 'shape', ()))}")
    c = x.shape[1]
    for name, p in params.items():
        if p is not None and tuple(p.shape) != (c,):
            raise ValueError(f"batchnorm expects {name} of shape ({c},) for x of shape {tuple(x.shape)}, "
                             f"got {tuple(p.shape)}")
    if _count(x) < 2:
        raise ValueError(f"batchnorm expects more than one value per channel in training, got x of shape "
                         f"{tuple(x.shape)}")
    if is_half(x.dtype):
        for name, p in params.items():
            if p is not None and p.dtype != np.float32:
                raise TypeError(f"batchnorm expects {name} of dtype float32 for x of dtype {np.dtype(x.dtype).name} "
                                f"(half inputs keep parameters and statistics in float32), got {p.dtype}")


def batchnorm(x: Array, gamma: Array | None = None, beta: Array | None = None, running_mean: Array | None = None,
              running_var: Array | None = None, *, momentum: float = 0.1, eps: float = 1e-5,
              act: Callable | None = None, residual: Array | None = None) -> Array:
    """Batch normalisation with the batch's statistics (training), updating the running statistics in place.

    ``x`` is ``(N, C, ...)``; ``gamma``, ``beta``, ``running_mean``, ``running_var`` are ``(C,)`` arrays or None
    (no scale, no shift, no running statistics). ``act``: an elementwise activation applied to the result, fused
    into both directions (see the module docstring; one that draws random numbers, as ``rrelu``, is an error: apply
    it to the output); None or ``identity`` is none. ``residual``: an array of ``x``'s shape and dtype added before
    the activation (a residual block's shortcut), or None. See the module docstring for the formulas.

    >>> import numpy as np
    >>> batchnorm(np.array([[1.0, 2.0], [3.0, 4.0]]), eps=0.0)
    array([[-1., -1.],
           [ 1.,  1.]])
    >>> from fluxpy.ops.activations import gelu
    >>> batchnorm(np.array([[1.0, 2.0], [3.0, 4.0]]), eps=0.0, act=gelu).round(4)
    array([[-0.1588, -0.1588],
           [ 0.8412,  0.8412]])
    >>> from fluxpy.ops.activations import relu
    >>> batchnorm(np.array([[1.0, 2.0], [3.0, 4.0]]), eps=0.0, act=relu, residual=np.array([[0.5, 2.0], [-3.0, 0.0]]))
    array([[0., 1.],
           [0., 1.]])
    """
    if act is identity:
        act = None
    if act is not None and (not callable(act) or getattr(getattr(act, "func", act), "draws_random", False)):
        raise ValueError(f"batchnorm expects act to be an elementwise function that draws no random numbers (or "
                         f"None), got {act!r}; apply it to the output")
    running_mean, running_var = value_of(running_mean), value_of(running_var)
    _check(x, gamma=gamma, beta=beta, running_mean=running_mean, running_var=running_var)
    _check_residual(x, residual)
    check_eps("batchnorm", eps)
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0 <= momentum <= 1:
        raise ValueError(f"batchnorm expects momentum to be a number in [0, 1], got {momentum!r}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("batchnorm expects both running_mean and running_var, or neither")
    # the running statistics, in place; their writer (the kernel, or update_running) keeps the old values for the
    # step's journal, a GPU kernel in its own output
    with changing(running_mean, running_var, writer_keeps=True):
        return _batchnorm(x, gamma, beta, running_mean, running_var, momentum, eps, act, residual)
