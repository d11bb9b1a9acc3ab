"""``softmax`` and ``logsoftmax`` along an axis, stable for any input, with hand-written rules.

The default axis is the last one: the class axis of ``(batch, classes)`` scores.

>>> import numpy as np
>>> from fluxpy import gradient
>>> softmax(np.array([[1000.0, 1000.0]]))
array([[0.5, 0.5]])
>>> gradient(lambda x: logsoftmax(x)[0, 0], np.array([[0.0, 0.0]]))
(array([[ 0.5, -0.5]]),)
"""
from __future__ import annotations

from ..autodiff import Primitive
from ..backend import get_array_module
from .basic import exp
from .reduce import normalize_axis
from .reduce import sum as _sum

__all__ = ["softmax", "logsoftmax"]


def _shifted(x, axes):
    """``x - max(x)`` along ``axes``: exp of it cannot overflow."""
    return x - x.max(axis=axes, keepdims=True)


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


def softmax(x, axis=-1):
    """``softmax(x, axis=-1) = exp(x) / sum(exp(x), axis)``, computed as ``exp(x - max(x))``.

    ``axis`` is an int or a tuple of ints. The pullback is ``y * (dy - sum(dy * y, axis))``.

    >>> import numpy as np
    >>> softmax(np.log(np.array([[1.0, 3.0], [2.0, 2.0]])))
    array([[0.25, 0.75],
           [0.5 , 0.5 ]])
    >>> softmax(np.zeros((2, 2)), axis=0)
    array([[0.5, 0.5],
           [0.5, 0.5]])
    """
    return _softmax(x, normalize_axis(axis, x.ndim, "softmax"))


def logsoftmax(x, axis=-1):
    """``logsoftmax(x, axis=-1) = x - log(sum(exp(x), axis))``, stable for large ``|x|``.

    ``axis`` is an int or a tuple of ints. The pullback is ``dy - exp(y) * sum(dy, axis)``.

    >>> import numpy as np
    >>> logsoftmax(np.array([0.0, 1000.0]))
    array([-1000.,     0.])
    """
    return _logsoftmax(x, normalize_axis(axis, x.ndim, "logsoftmax"))
