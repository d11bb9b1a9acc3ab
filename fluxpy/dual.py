"""Dual numbers: the derivative of an elementwise function in forward mode (as Flux uses ForwardDiff).

``Dual(v, d)`` carries a value and its partial derivatives through arithmetic and the NumPy
ufuncs that activations use. :func:`partials` differentiates a scalar function of several
arguments at once; :func:`fluxpy.broadcast` and :func:`fluxpy.ops.bias_act` differentiate with it,
and the GPU's kernel compiler traces it symbolically. Values and partials may be arrays, Tracked
values (so duals differentiate again) or the compiler's symbols.

>>> import numpy as np
>>> partials(lambda x, y: x * np.exp(y), (np.array([2.0]), np.array([0.0])), [0, 1])
[array([1.]), array([2.])]
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .autodiff import is_tracked, value_of
from .backend import Array

__all__ = ["Dual", "partials", "derivative", "cotangents"]




def _power(v, o):
    """``v ** o``, by products for the small whole exponents (NumPy's ``power`` calls ``pow`` per element for them)."""
    if isinstance(o, numbers.Integral) and 0 <= o <= 4:
        if o == 0:
            return v * 0 + 1
        y = v
        for _ in range(int(o) - 1):
            y = y * v
        return y
    return v ** o


class Dual:
    """A value ``v`` with its partial derivatives ``d`` (a tuple, one per seed).

    Arithmetic and the NumPy ufuncs used by activations propagate the partials. Values and
    partials are arrays or Tracked values, so duals can be differentiated again.

    >>> d = Dual(3.0, (1.0,)) ** 2
    >>> d.v, d.d
    (9.0, (6.0,))
    """
    __slots__ = ("v", "d")
    __array_priority__ = 2000.0

    def __init__(self, v: Any, d: tuple) -> None:
        self.v = v
        self.d = d

    def _lift(self, other):
        return other if type(other) is Dual else Dual(other, (0,) * len(self.d))

    def __add__(self, o):
        o = self._lift(o)
        return Dual(self.v + o.v, tuple(a + b for a, b in zip(self.d, o.d)))

    __radd__ = __add__

    def __sub__(self, o):
        o = self._lift(o)
        return Dual(self.v - o.v, tuple(a - b for a, b in zip(self.d, o.d)))

    def __rsub__(self, o):
        return self._lift(o) - self

    def __mul__(self, o):
        o = self._lift(o)
        return Dual(self.v * o.v, tuple(a * o.v + self.v * b for a, b in zip(self.d, o.d)))

    __rmul__ = __mul__

    def __truediv__(self, o):
        o = self._lift(o)
        y = self.v / o.v
        return Dual(y, tuple((a - y * b) / o.v for a, b in zip(self.d, o.d)))

    def __rtruediv__(self, o):
        return self._lift(o) / self

    def __pow__(self, o):
        if type(o) is not Dual:
            y = _power(self.v, o)
            dy = o * _power(self.v, o - 1)
            return Dual(y, tuple(a * dy for a in self.d))
        return _dual_exp(o * _dual_log(self))

    def __rpow__(self, o):
        return _dual_exp(self * (math.log(o) if isinstance(o, (int, float)) else _dual_log(self._lift(o))))

    def __neg__(self):
        return Dual(-self.v, tuple(-a for a in self.d))

    def __pos__(self):
        return self

    def __abs__(self):
        return _dual_chain(abs(self.v), self, np.sign(value_of(self.v)))

    def _cmp(self, o, op):
        return op(value_of(self.v), value_of(o.v if type(o) is Dual else o))

    __gt__ = lambda s, o: s._cmp(o, np.greater)
    __ge__ = lambda s, o: s._cmp(o, np.greater_equal)
    __lt__ = lambda s, o: s._cmp(o, np.less)
    __le__ = lambda s, o: s._cmp(o, np.less_equal)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        rule = _DUAL_UFUNCS.get(ufunc)
        if method != "__call__" or kwargs or rule is None:
            return NotImplemented
        return rule(*inputs)

    def __array_function__(self, func, types, args, kwargs):
        if func is np.where and len(args) == 3 and not kwargs:
            return _dual_select(_value(args[0]), args[1], args[2])
        return NotImplemented


def _dual_chain(y, x, dydx):
    return Dual(y, tuple(a * dydx for a in x.d))


def _dual_exp(x):
    y = np.exp(x.v)
    return _dual_chain(y, x, y)


def _dual_log(x):
    return _dual_chain(np.log(x.v), x, 1 / x.v)


def _dual_sqrt(x):
    y = np.sqrt(x.v)
    return _dual_chain(y, x, 0.5 / y)


def _dual_tanh(x):
    y = np.tanh(x.v)
    return _dual_chain(y, x, 1 - y * y)


def _where(mask, a, b):
    """``a`` where ``mask`` holds, else ``b``, on arrays, Tracked values or the GPU tracer's symbols.

    A Tracked operand goes to fluxpy's ``where`` through its ``__array_function__`` directly: through
    ``np.where`` a CuPy mask would claim the call first and reject the Tracked value.
    """
    for v in (a, b):
        if is_tracked(v):
            return v.__array_function__(np.where, (type(v),), (mask, a, b), {})
    return np.where(mask, a, b)


def _dual_select(mask, a, b):
    """Elementwise ``where(mask, a, b)`` for duals or plain values (mask is a plain array)."""
    where = _where
    if type(a) is not Dual and type(b) is not Dual:
        return where(mask, a, b)
    k = len((a if type(a) is Dual else b).d)
    a = a if type(a) is Dual else Dual(a, (0,) * k)
    b = b if type(b) is Dual else Dual(b, (0,) * k)
    return Dual(where(mask, a.v, b.v), tuple(where(mask, da, db) for da, db in zip(a.d, b.d)))


def _value(x):
    return value_of(x.v if type(x) is Dual else x)


_DUAL_UFUNCS = {
    np.add: lambda a, b: Dual.__add__(a, b) if type(a) is Dual else Dual.__radd__(b, a),
    np.subtract: lambda a, b: Dual.__sub__(a, b) if type(a) is Dual else Dual.__rsub__(b, a),
    np.multiply: lambda a, b: Dual.__mul__(a, b) if type(a) is Dual else Dual.__rmul__(b, a),
    np.true_divide: lambda a, b: Dual.__truediv__(a, b) if type(a) is Dual else Dual.__rtruediv__(b, a),
    np.power: lambda a, b: Dual.__pow__(a, b) if type(a) is Dual else Dual.__rpow__(b, a),
    np.negative: Dual.__neg__,
    np.positive: Dual.__pos__,
    np.absolute: Dual.__abs__,
    np.exp: _dual_exp,
    np.log: _dual_log,
    np.sqrt: _dual_sqrt,
    np.tanh: _dual_tanh,
    np.sin: lambda x: _dual_chain(np.sin(x.v), x, np.cos(x.v)),
    np.cos: lambda x: _dual_chain(np.cos(x.v), x, -np.sin(x.v)),
    np.log1p: lambda x: _dual_chain(np.log1p(x.v), x, 1 / (1 + x.v)),
    np.expm1: lambda x: _dual_chain(np.expm1(x.v), x, np.exp(x.v)),
    np.square: lambda x: x * x,
    # At a tie the derivative follows the second argument: relu = max(x, 0) has relu'(0) = 0, as NNlib.
    np.maximum: lambda a, b: _dual_select(_value(a) > _value(b), a, b),
    np.minimum: lambda a, b: _dual_select(_value(a) < _value(b), a, b),
    np.greater: lambda a, b: np.greater(_value(a), _value(b)),
    np.greater_equal: lambda a, b: np.greater_equal(_value(a), _value(b)),
    np.less: lambda a, b: np.less(_value(a), _value(b)),
    np.less_equal: lambda a, b: np.less_equal(_value(a), _value(b)),
    np.sign: lambda x: np.sign(_value(x)),
}


def partials(f: Callable, xs: Sequence, wanted: Sequence[int]) -> list:
    """The elementwise partial derivatives of ``f(*xs)`` with respect to the arguments ``wanted`` (indices):
    a list aligned with ``wanted``, ``None`` for each where ``f`` ignores all its arguments.

    >>> import numpy as np
    >>> partials(lambda x, y: x * 3.0, (np.ones(2), np.ones(2)), [0])
    [array([3., 3.])]
    """
    k = len(wanted)
    duals = list(xs)
    for j, i in enumerate(wanted):
        duals[i] = Dual(xs[i], tuple(1 if m == j else 0 for m in range(k)))
    out = f(*duals)
    if type(out) is not Dual:  # f ignored its arguments
        return [None] * k
    return [None if _is_literal_zero(p) else p for p in out.d]


def cotangents(f: Callable, xs: Sequence, wanted: Sequence[int], dy: Array) -> list:
    """The cotangents ``[dy * ∂f/∂x_i for i in wanted]`` in ``dy``'s dtype, unreduced; ``None`` where ``f``
    ignores ``x_i``.

    >>> import numpy as np
    >>> cotangents(lambda x, y: x * y, (np.array([2.0, 3.0]), np.array(4.0)), (0, 1), np.ones(2))
    [array([4., 4.]), array([2., 3.])]
    """
    dtype = value_of(dy).dtype
    out = []
    for p in partials(f, xs, wanted):
        if p is not None and getattr(p, "dtype", dtype) != dtype:  # integer seeds through np.where
            p = p.astype(dtype)
        out.append(None if p is None else dy * p)
    return out


def derivative(act: Callable, z: Array) -> Array | None:
    """The derivative ``act'(z)`` elementwise, in ``z``'s dtype; None when ``act`` ignores its argument.

    >>> import numpy as np
    >>> derivative(np.tanh, np.zeros(2))
    array([1., 1.])
    """
    d = partials(act, (z,), [0])[0]
    if d is None:
        return None
    dtype = value_of(z).dtype
    if hasattr(d, "dtype") and d.dtype != dtype:
        d = d.astype(dtype)  # piecewise activations give integer partials (np.where(mask, 1, 0))
    return d


def _is_literal_zero(p):
    """A partial still equal to its Python seed ``0``: ``f`` never used that argument."""
    return isinstance(p, int) and p == 0
