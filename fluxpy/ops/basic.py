"""Elementwise primitives: arithmetic with broadcasting, unary maths, maximum/minimum/where.

Every broadcasting rule sends its gradients through :func:`fluxpy.ops.shape.unbroadcast`.
Pullbacks use these same ops, so they differentiate twice.

>>> import numpy as np
>>> from fluxpy import gradient
>>> gradient(lambda a, b: (a * b).sum(), np.ones((2, 3)), np.arange(3.0))
(array([[0., 1., 2.],
       [0., 1., 2.]]), array([2., 2., 2.]))
"""
from __future__ import annotations

import math
import operator

import numpy as np

from ..autodiff import Primitive, Tracked, value_of
from ..backend import Array, get_array_module
from ..kernels import find
from ..kernels.halfs import BFLOAT16
from ..layout import keep_layout, keeping_layout
from .shape import unbroadcast

__all__ = ["add", "subtract", "multiply", "divide", "power", "negative", "exp", "log", "sqrt", "tanh", "abs",
           "sin", "cos", "log1p", "expm1", "square", "maximum", "minimum", "where", "sign"]


def _shape(x):
    return tuple(getattr(x, "shape", ()))


_NUMBERS = (int, float)


def _number_with_bfloat16(a, b):
    """True where one operand is a Python number and the other a bfloat16 array."""
    return ((isinstance(a, _NUMBERS) and getattr(b, "dtype", None) == BFLOAT16) or
            (isinstance(b, _NUMBERS) and getattr(a, "dtype", None) == BFLOAT16))


def _checked(name, fn):
    """``fn`` with NumPy's broadcasting error re-raised naming the op and both shapes, and NumPy's dtype where a
    Python number meets a bfloat16 array: CuPy, which has no weak-number rule for ml_dtypes' bfloat16, computes
    ``bfloat16 + 1e-7`` in float32 and returns float32 (NumPy keeps bfloat16), which the next layer refuses."""
    def impl(a, b):
        try:
            y = fn(a, b)
            if _number_with_bfloat16(a, b) and y.dtype == np.float32:
                return y.astype(BFLOAT16)
            return y
        except TypeError:
            get_array_module(a, b)  # NumPy with CuPy: raises an error naming both
            raise
        except ValueError as err:
            if _shape(a) and _shape(b) and "broadcast" in str(err):
                raise ValueError(f"{name}: shapes {_shape(a)} and {_shape(b)} cannot be broadcast together") from None
            raise
    impl.__name__ = f"{name}_impl"
    return impl


def _binary(name, fn, grads, saves="aby"):
    """A broadcasting binary primitive; ``grads(a, b, y, dy, needs)`` gives the unreduced cotangents.

    ``saves`` names what ``grads`` reads (of ``a``, ``b``, ``y``); the others reach it as ``None``, so the
    pullback does not keep them alive until the backward pass."""
    prim = None
    keep_a, keep_b, keep_y = ("a" in saves), ("b" in saves), ("y" in saves)

    def rule(needs, a, b):
        y = prim(a, b) if type(a) is Tracked or type(b) is Tracked else prim.impl(a, b)   # impl: what prim would call
        sa, sb = _shape(a), _shape(b)
        ka, kb, ky = (a if keep_a else None), (b if keep_b else None), (y if keep_y else None)

        def pullback(dy):
            da, db = keeping_layout(grads, ka, kb, ky, dy, needs)
            return (unbroadcast(da, sa) if needs[0] else None, unbroadcast(db, sb) if needs[1] else None)
        pullback.__name__ = f"{name}_pullback"
        return y, pullback
    prim = Primitive(name, rule, impl=keep_layout(_checked(name, fn)), needs_mask=True)
    return prim


def _log_of(x):
    # math.log keeps a Python number weak, so it does not promote float32 gradients to float64.
    return math.log(x) if isinstance(x, (int, float)) else log(x)


def _pow_grads(a, b, y, dy, needs):
    da = db = None
    if needs[0]:
        if isinstance(b, (int, float)):
            da = dy * (2 * a) if b == 2 else dy * (b * a ** (b - 1))
        else:
            da = dy * (b * a ** (b - 1))
    if needs[1]:
        db = dy * (y * _log_of(a))
    return da, db


def _add(a, b):
    kernel = find("add", a, b)   # the GPU's halves and float32: CuPy adds them an item at a time
    return operator.add(a, b) if kernel is None else kernel(a, b)


add = _binary("add", _add, lambda a, b, y, dy, n: (dy, dy), saves="")
subtract = _binary("subtract", operator.sub, lambda a, b, y, dy, n: (dy, -dy if n[1] else None), saves="")
multiply = _binary("multiply", operator.mul,
                   lambda a, b, y, dy, n: (dy * b if n[0] else None, dy * a if n[1] else None), saves="ab")
divide = _binary("divide", operator.truediv,
                 lambda a, b, y, dy, n: (dy / b if n[0] else None, -(dy * y) / b if n[1] else None), saves="by")
power = _binary("power", operator.pow, _pow_grads)


def _unary(name, ufunc, deriv, saves="xy"):
    """A unary elementwise primitive; ``deriv(x, y, dy)`` is the input cotangent; ``saves`` names what it reads
    (of ``x`` and ``y``: the other reaches it as ``None``, not kept alive until the backward pass)."""
    prim = None
    keep_x, keep_y = ("x" in saves), ("y" in saves)

    def rule(x):
        y = prim(x) if type(x) is Tracked else prim.impl(x)   # impl: what prim would call on a plain value
        kx, ky = (x if keep_x else None), (y if keep_y else None)

        def pullback(dy):
            return (keeping_layout(deriv, kx, ky, dy),)
        pullback.__name__ = f"{name}_pullback"
        return y, pullback
    prim = Primitive(name, rule, impl=keep_layout(ufunc))
    return prim


def sign(x: Array) -> Array:
    """The sign of ``x``, -1, 0 or 1 elementwise; not differentiable (a plain array).

    >>> import numpy as np
    >>> sign(np.array([-2.0, 0.0, 3.0]))
    array([-1.,  0.,  1.])
    """
    return np.sign(value_of(x))


negative = _unary("negative", np.negative, lambda x, y, dy: -dy, saves="")
exp = _unary("exp", np.exp, lambda x, y, dy: dy * y, saves="y")
log = _unary("log", np.log, lambda x, y, dy: dy / x, saves="x")
sqrt = _unary("sqrt", np.sqrt, lambda x, y, dy: dy * 0.5 / y, saves="y")
tanh = _unary("tanh", np.tanh, lambda x, y, dy: dy * (1 - y * y), saves="y")
abs = _unary("abs", np.absolute, lambda x, y, dy: dy * sign(x), saves="x")
sin = _unary("sin", np.sin, lambda x, y, dy: dy * cos(x), saves="x")
cos = _unary("cos", np.cos, lambda x, y, dy: -(dy * sin(x)), saves="x")
log1p = _unary("log1p", np.log1p, lambda x, y, dy: dy / (1 + x), saves="x")
expm1 = _unary("expm1", np.expm1, lambda x, y, dy: dy * (y + 1), saves="y")
square = _unary("square", np.square, lambda x, y, dy: dy * (2 * x), saves="x")


def _select_weights(a, b, y, wins):
    """Weight of ``a`` in max/min: 1 where it wins, 1/2 at ties (as PyTorch), in y's dtype."""
    av, bv = value_of(a), value_of(b)
    return (wins(av, bv) + 0.5 * (av == bv)).astype(value_of(y).dtype)


def _extremum_grads(wins):
    def grads(a, b, y, dy, needs):
        w = _select_weights(a, b, y, wins)
        return (dy * w if needs[0] else None, dy * (1 - w) if needs[1] else None)
    return grads


maximum = _binary("maximum", np.maximum, _extremum_grads(np.greater))
minimum = _binary("minimum", np.minimum, _extremum_grads(np.less))


def _where_impl(cond, a, b):
    try:
        y = np.where(cond, a, b)
    except ValueError:
        raise ValueError(f"where: shapes {_shape(cond)}, {_shape(a)} and {_shape(b)} "
                         "cannot be broadcast together") from None
    if y.dtype != np.float32 or not any(getattr(v, "dtype", None) == BFLOAT16 for v in (a, b)):
        return y
    # CuPy's where has no bfloat16 loop and computes it in float32: the result is rounded back to NumPy's type
    want = np.result_type(*(v.dtype if hasattr(v, "dtype") else v for v in (a, b)))
    return y if y.dtype == want else y.astype(want)


def _where_rule(needs, cond, a, b):
    y = _where(cond, a, b)
    sa, sb = _shape(a), _shape(b)

    def where_pullback(dy):
        da = unbroadcast(_where(cond, dy, 0), sa) if needs[1] else None
        db = unbroadcast(_where(cond, 0, dy), sb) if needs[2] else None
        return None, da, db
    return y, where_pullback


_where = Primitive("where", _where_rule, impl=keep_layout(_where_impl), needs_mask=True)


def where(cond: Array, a: Array | float, b: Array | float) -> Array:
    """``a`` where ``cond`` holds, else ``b``; differentiable in ``a`` and ``b``.

    >>> import numpy as np
    >>> where(np.array([True, False]), np.ones(2), 0.0)
    array([1., 0.])
    """
    return _where(value_of(cond), a, b)
