"""Softmax and log-softmax along an axis, stable for any input, with hand-written rules.

The default axis is the last one: the class axis of ``(batch, classes)`` scores. float16 and bfloat16 are computed
in float32 and rounded once to their own dtype (on the GPU the cross-entropy rows are one kernel each way).

>>> import numpy as np
>>> from fluxpy import gradient
>>> softmax(np.array([[1000.0, 1000.0]]))
array([[0.5, 0.5]])
>>> gradient(lambda x: logsoftmax(x)[0, 0], np.array([[0.0, 0.0]]))
(array([[ 0.5, -0.5]]),)
"""
from __future__ import annotations

import functools

import numpy as np

from ..autodiff import Primitive, value_of
from ..backend import Array, get_array_module
from ..kernels import find
from ..kernels.halfs import is_half
from .basic import exp, log
from .fused import fused_op
from .reduce import check_half_mix, normalize_axis
from .reduce import sum as _sum
from .shape import reshape

__all__ = ["softmax", "logsoftmax", "logsumexp", "logit_crossentropy_rows", "logit_crossentropy_rows_backward"]


def _shifted(x, axes):
    """``x - max(x)`` along ``axes``: exp of it cannot overflow. Where the max is +Inf, NNlib's rule: the +Inf
    entries get 0 (not Inf - Inf = NaN) and the others -Inf, so the +Inf entries share the whole mass."""
    with np.errstate(invalid="ignore"):
        z = x - x.max(axis=axes, keepdims=True)
    # Only a +Inf entry can be NaN here: its slice's max is +Inf, the rest already -Inf. copyto with a mask is one
    # elementwise kernel, where boolean indexing would copy the count to the host (a sync a CUDA graph forbids).
    get_array_module(x).copyto(z, 0, where=x == np.inf)
    return z


def _in_float32(impl):
    """``impl`` computing float16/bfloat16 input in float32, its result rounded once to the input's dtype (the
    exponentials and their sums would otherwise round at every step; CuPy's bfloat16 ufuncs are experimental)."""
    @functools.wraps(impl)
    def call(x, *args):
        if not is_half(x.dtype):
            return impl(x, *args)
        return impl(x.astype(np.float32), *args).astype(x.dtype)
    return call


@_in_float32
def _softmax_impl(x, axes):
    xp = get_array_module(x)
    e = xp.exp(_shifted(x, axes))
    e /= e.sum(axis=axes, keepdims=True)
    return e


def _softmax_rule(x, axes):
    y = _softmax(x, axes)

    def softmax_pullback(dy):
        return (y * (dy - _sum(dy * y, axes, keepdims=True)),)
    return y, softmax_pullback


_softmax = Primitive("softmax", _softmax_rule, impl=_softmax_impl)


@_in_float32
def _logsoftmax_impl(x, axes):
    xp = get_array_module(x)
    z = _shifted(x, axes)
    z -= xp.log(xp.exp(z).sum(axis=axes, keepdims=True))
    return z


def _logsoftmax_rule(x, axes):
    y = _logsoftmax(x, axes)

    def logsoftmax_pullback(dy):
        return (dy - exp(y) * _sum(dy, axes, keepdims=True),)
    return y, logsoftmax_pullback


_logsoftmax = Primitive("logsoftmax", _logsoftmax_rule, impl=_logsoftmax_impl)


def softmax(x: Array, axis: int | tuple[int, ...] = -1) -> Array:
    """The softmax ``exp(x) / sum(exp(x), axis)``, computed as ``exp(x - max(x))``.

    ``axis`` is an int (the last by default) or a tuple of ints. The pullback is ``y * (dy - sum(dy * y, axis))``.
    Infinities follow NNlib, not PyTorch (which gives NaN): where a slice holds +Inf, its +Inf entries share the
    whole mass equally and the rest get 0; -Inf entries get 0; a NaN makes its slice NaN.

    >>> import numpy as np
    >>> softmax(np.log(np.array([[1.0, 3.0], [2.0, 2.0]])))
    array([[0.25, 0.75],
           [0.5 , 0.5 ]])
    >>> softmax(np.zeros((2, 2)), axis=0)
    array([[0.5, 0.5],
           [0.5, 0.5]])
    >>> softmax(np.array([1.0, np.inf, np.inf, -np.inf]))
    array([0. , 0.5, 0.5, 0. ])
    """
    return _softmax(x, normalize_axis(axis, x.ndim, "softmax"))


def logsoftmax(x: Array, axis: int | tuple[int, ...] = -1) -> Array:
    """The log-softmax ``x - log(sum(exp(x), axis))``, stable for large ``|x|``.

    ``axis`` is an int (the last by default) or a tuple of ints. The pullback is ``dy - exp(y) * sum(dy, axis)``.
    ``exp(logsoftmax(x)) == softmax(x)`` with infinities too (NNlib's rule, see :func:`softmax`).

    >>> import numpy as np
    >>> logsoftmax(np.array([0.0, 1000.0]))
    array([-1000.,     0.])
    >>> logsoftmax(np.array([2.0, np.inf]))
    array([-inf,   0.])
    """
    return _logsoftmax(x, normalize_axis(axis, x.ndim, "logsoftmax"))


def logsumexp(x: Array, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """``log(sum(exp(x), axis))``, stable for large ``|x|`` (NNlib's ``logsumexp``; SciPy's and PyTorch's too).

    ``axis``: an int, a tuple of ints, or ``None`` (the default, every axis: a 0-d result, as NNlib's ``dims=:``).
    ``keepdims=True`` keeps the reduced axes with size 1, which is what NNlib's ``logsumexp(x; dims)`` returns
    (fluxpy drops them by default, as NumPy's reductions and ``torch.logsumexp``). Computed as
    ``m + log(sum(exp(x - m)))`` with ``m`` the maximum along ``axis`` held constant, so the gradient is
    ``softmax(x, axis)`` and differentiates again; an all ``-inf`` slice gives ``-inf`` and a ``+inf`` gives ``+inf``
    (PyTorch's rule), NaN gives NaN.

    >>> import numpy as np
    >>> logsumexp(np.array([1000.0, 1000.0]))          # 1000 + log(2), no overflow
    array(1000.69314718)
    >>> logsumexp(np.log(np.array([[1.0, 3.0], [2.0, 2.0]])), axis=1)
    array([1.38629436, 1.38629436])
    >>> logsumexp(np.array([[-np.inf, -np.inf]]), axis=1, keepdims=True)
    array([[-inf]])
    """
    axes = normalize_axis(axis, x.ndim, "logsumexp")
    if axes is not None and not axes:
        return x
    if any(x.shape[a] == 0 for a in (range(x.ndim) if axes is None else axes)):
        raise ValueError(f"logsumexp expects no empty axis among those it reduces, got x of shape {tuple(x.shape)}")
    v = value_of(x)
    xp = get_array_module(v)
    m = v.max(axis=axes, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0).astype(v.dtype, copy=False)   # a constant: the gradient is softmax either way
    with np.errstate(divide="ignore"):   # log(0) = -inf for an all -inf slice
        y = log(_sum(exp(x - m), axes, True)) + m
    if keepdims:
        return y
    return reshape(y, tuple(n for i, n in enumerate(x.shape) if axes is not None and i not in axes))


# ---------------------------------------------------------------------------------------------
# Cross-entropy from logits, one row per example: the loss of a classifier as one op


def _crossentropy_rows_impl(yhat, y):
    fused = find("logit_crossentropy_rows", yhat, y)
    if fused is not None:
        return fused(yhat, y)
    if is_half(yhat.dtype) and yhat.dtype == y.dtype:
        return _target_log_mass(y.astype(np.float32), yhat.astype(np.float32)).astype(y.dtype)
    return _target_log_mass(y, yhat)


def _target_log_mass(y, yhat):
    """``-sum(y * logsoftmax(ŷ), axis=1)`` where a class with ``y == 0`` adds nothing, even a masked ``-inf`` logit
    (whose log-probability is ``-inf``): PyTorch's ``cross_entropy`` of masked logits."""
    xp = get_array_module(y)
    with np.errstate(invalid="ignore"):
        terms = y * _logsoftmax_impl(yhat, (1,))
    return -xp.where(y == 0, 0, terms).sum(axis=1)


def _crossentropy_rows_dyhat(dl, yhat, y):
    # d/dŷ of sum(y) * logsumexp(ŷ) - <y, ŷ>, with fluxpy ops so it differentiates again
    return reshape(dl, (-1, 1)) * (_softmax(yhat, (1,)) * _sum(y, (1,), True) - y)


logit_crossentropy_rows_backward = fused_op("logit_crossentropy_rows_backward", _crossentropy_rows_dyhat, doc="""
    The cotangent of the logits of :func:`logit_crossentropy_rows`: ``dl * (softmax(ŷ) * sum(y) - y)``
    (one kernel on the GPU, a warp per row).

    >>> import numpy as np
    >>> logit_crossentropy_rows_backward(np.ones(1), np.zeros((1, 2)), np.array([[0.0, 1.0]]))
    array([[ 0.5, -0.5]])
    """)


def _crossentropy_rows_rule(needs, yhat, y):
    loss = _crossentropy_rows(yhat, y)

    def logit_crossentropy_rows_pullback(dl):
        dyhat = logit_crossentropy_rows_backward(dl, yhat, y) if needs[0] else None
        dy = -(reshape(dl, (-1, 1)) * _logsoftmax(yhat, (1,))) if needs[1] else None
        return dyhat, dy
    return loss, logit_crossentropy_rows_pullback


_crossentropy_rows = Primitive("logit_crossentropy_rows", _crossentropy_rows_rule, impl=_crossentropy_rows_impl,
                               needs_mask=True)


def logit_crossentropy_rows(yhat: Array, y: Array) -> Array:
    """The cross-entropy of each row of ``(N, C)`` logits, ``-sum(y * logsoftmax(ŷ), axis=1)``, as one op.

    ``y`` are one-hot or soft targets of the same shape. The pullback is
    ``dl * (softmax(ŷ) * sum(y) - y)``; on the GPU each direction is one kernel (a warp per row).

    >>> import numpy as np
    >>> logit_crossentropy_rows(np.array([[0.0, np.log(3.0)]]), np.array([[0.0, 1.0]])).round(4)
    array([0.2877])
    """
    if yhat.ndim != 2 or tuple(y.shape) != tuple(yhat.shape):
        raise ValueError(f"logit_crossentropy_rows expects ŷ of shape (N, C) and y of the same shape, got "
                         f"{tuple(yhat.shape)} and {tuple(y.shape)}")
    check_half_mix("logit_crossentropy_rows", yhat=yhat, y=y)
    return _crossentropy_rows(yhat, y)
