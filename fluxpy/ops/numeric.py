"""More of NumPy, differentiable: the inverse and hyperbolic trigonometric functions and ``tan``; ``var`` and ``std``
(PyTorch's ``correction``), ``prod`` and ``cumsum``; ``flip``, ``triu``/``tril``, ``pad`` (constant) and ``sort``.

Each runs on NumPy and CuPy arrays alike (NumPy's functions dispatch to CuPy's). The pullbacks of the
trigonometric functions, ``var``, ``std``, ``cumsum``, ``flip``, ``triu``, ``tril`` and ``pad`` are made of fluxpy
ops, so they differentiate twice; ``prod``'s and ``sort``'s are computed on the arrays (once differentiable).

>>> import numpy as np
>>> from fluxpy import gradient
>>> gradient(lambda x: cumsum(x).sum(), np.ones(3))
(array([3., 2., 1.]),)
>>> gradient(lambda x: prod(x), np.array([2.0, 0.0, 5.0]))
(array([ 0., 10.,  0.]),)
"""
from __future__ import annotations

import numbers

import numpy as np

from ..autodiff import Primitive, value_of
from ..backend import Array, get_array_module
from .basic import _unary, sqrt
from .reduce import _scalar_like, mean, normalize_axis
from .reduce import sum as sum_
from .shape import getitem, reshape

__all__ = ["tan", "arcsin", "arccos", "arctan", "sinh", "cosh", "arcsinh", "arctanh", "var", "std", "prod", "cumsum",
           "flip", "triu", "tril", "pad", "sort"]

tan = _unary("tan", np.tan, lambda x, y, dy: dy * (1 + y * y), saves="y")
arcsin = _unary("arcsin", np.arcsin, lambda x, y, dy: dy / sqrt(1 - x * x), saves="x")
arccos = _unary("arccos", np.arccos, lambda x, y, dy: -(dy / sqrt(1 - x * x)), saves="x")
arctan = _unary("arctan", np.arctan, lambda x, y, dy: dy / (1 + x * x), saves="x")
sinh = _unary("sinh", np.sinh, lambda x, y, dy: dy * cosh(x), saves="x")
cosh = _unary("cosh", np.cosh, lambda x, y, dy: dy * sinh(x), saves="x")
arcsinh = _unary("arcsinh", np.arcsinh, lambda x, y, dy: dy / sqrt(x * x + 1), saves="x")
arctanh = _unary("arctanh", np.arctanh, lambda x, y, dy: dy / (1 - x * x), saves="x")


def _count(x, axes):
    return int(np.prod([x.shape[a] for a in axes])) if axes is not None else int(np.prod(x.shape))


def var(x: Array, axis: int | tuple[int, ...] | None = None, keepdims: bool = False, correction: int = 0) -> Array:
    """The variance over ``axis`` (all axes by default): the mean squared deviation, divided by ``n - correction``
    (PyTorch's ``correction``; NumPy's ``ddof``; ``correction=1`` is the unbiased estimate).

    >>> import numpy as np
    >>> x = np.array([1.0, 2.0, 3.0, 4.0])
    >>> float(var(x)), round(float(var(x, correction=1)), 12)
    (1.25, 1.666666666667)
    """
    axes = normalize_axis(axis, x.ndim, "var")
    n = _count(x, axes)
    if isinstance(correction, bool) or not isinstance(correction, numbers.Integral) or not 0 <= correction < n:
        raise ValueError(f"var expects correction, an int in [0, {n}) ({n} values per result), got {correction!r}")
    d = x - mean(x, axis=axes, keepdims=True)
    return sum_(d * d, axis=axes, keepdims=keepdims) * _scalar_like(x, 1.0 / (n - correction))


def std(x: Array, axis: int | tuple[int, ...] | None = None, keepdims: bool = False, correction: int = 0) -> Array:
    """The standard deviation, ``sqrt(var(x, axis, keepdims, correction))``.

    >>> import numpy as np
    >>> float(std(np.array([1.0, 3.0])))
    1.0
    """
    return sqrt(var(x, axis, keepdims, correction))


def _moved_last(a, axis):
    """``a`` with ``axis`` moved last and the rest flattened: ``(rows, n)``, and how to put it back."""
    xp = get_array_module(a)
    moved = xp.moveaxis(a, axis, -1)
    return moved.reshape(-1, moved.shape[-1]), (lambda r: xp.moveaxis(r.reshape(moved.shape), -1, axis))


def _products_of_the_others(x, axis):
    """Per entry, the product of the other entries along ``axis`` (exclusive products from both sides: exact where
    ``x`` holds zeros, unlike ``prod / x``)."""
    xp = get_array_module(x)
    rows, back = _moved_last(x, axis)
    ones = xp.ones((rows.shape[0], 1), rows.dtype)
    left = xp.cumprod(xp.concatenate([ones, rows[:, :-1]], axis=1), axis=1)
    right = xp.cumprod(xp.concatenate([ones, rows[:, :0:-1]], axis=1), axis=1)[:, ::-1]
    return back(left * right)


def _prod_rule(x, axis, keepdims):
    y = _prod(x, axis, keepdims)

    def prod_pullback(dy):
        xv, g = value_of(x), value_of(dy)
        if axis is None:
            others = _products_of_the_others(xv.reshape(-1), 0).reshape(xv.shape)
            return (others * g,)
        g = g if keepdims else get_array_module(g).expand_dims(g, axis)
        return (_products_of_the_others(xv, axis) * g,)
    return y, prod_pullback


_prod = Primitive("prod", _prod_rule, impl=lambda x, axis, keepdims: get_array_module(x).prod(x, axis=axis,
                                                                                                keepdims=keepdims))


def prod(x: Array, axis: int | None = None, keepdims: bool = False) -> Array:
    """The product over ``axis`` (one int, or all axes); its gradient is exact where ``x`` holds zeros.

    >>> import numpy as np
    >>> prod(np.array([[1.0, 2.0], [3.0, 4.0]]), axis=1)
    array([ 2., 12.])
    """
    return _prod(x, _one_axis(x, axis, "prod"), bool(keepdims))


def _one_axis(x, axis, who):
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{who} expects axis, one int in [-{x.ndim}, {x.ndim}) or None, got {axis!r} for an array "
                         f"of shape {tuple(x.shape)}")
    return int(axis) % x.ndim


def _flip_rule(x, axis):
    return _flip(x, axis), lambda dy: (_flip(dy, axis),)


_flip = Primitive("flip", _flip_rule, impl=lambda x, axis: get_array_module(x).flip(x, axis))


def flip(x: Array, axis: int | None = None) -> Array:
    """``x`` reversed along ``axis`` (all axes by default), as ``numpy.flip``.

    >>> import numpy as np
    >>> flip(np.arange(3))
    array([2, 1, 0])
    """
    return _flip(x, _one_axis(x, axis, "flip"))


def _cumsum_rule(x, axis):
    return _cumsum(x, axis), lambda dy: (_flip(_cumsum(_flip(dy, axis), axis), axis),)


_cumsum = Primitive("cumsum", _cumsum_rule, impl=lambda x, axis: get_array_module(x).cumsum(x, axis=axis))


def cumsum(x: Array, axis: int | None = None) -> Array:
    """The running sum along ``axis`` (of the flattened array by default), as ``numpy.cumsum``.

    >>> import numpy as np
    >>> cumsum(np.array([[1, 2], [3, 4]]), axis=0)
    array([[1, 2],
           [4, 6]])
    """
    if axis is None:
        return _cumsum(reshape(x, (-1,)), 0)
    return _cumsum(x, _one_axis(x, axis, "cumsum"))


def _triangle(name, keep):
    def rule(x, k):
        return prim(x, k), lambda dy: (prim(dy, k),)
    prim = Primitive(name, rule, impl=lambda x, k: keep(get_array_module(x), x, k))
    return prim


_triu = _triangle("triu", lambda xp, x, k: xp.triu(x, k))
_tril = _triangle("tril", lambda xp, x, k: xp.tril(x, k))


def _check_matrix(x, k, who):
    if x.ndim < 2 or isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise ValueError(f"{who} expects an array of 2 or more axes and an int diagonal k, got shape "
                         f"{tuple(x.shape)} and k={k!r}")
    return int(k)


def triu(x: Array, k: int = 0) -> Array:
    """The upper triangle of the last two axes: zero below diagonal ``k``, as ``numpy.triu``.

    >>> import numpy as np
    >>> triu(np.ones((2, 2)))
    array([[1., 1.],
           [0., 1.]])
    """
    return _triu(x, _check_matrix(x, k, "triu"))


def tril(x: Array, k: int = 0) -> Array:
    """The lower triangle of the last two axes: zero above diagonal ``k``, as ``numpy.tril``.

    >>> import numpy as np
    >>> tril(np.ones((2, 2)))
    array([[1., 0.],
           [1., 1.]])
    """
    return _tril(x, _check_matrix(x, k, "tril"))


def _pad_rule(x, widths, value):
    inner = tuple(slice(a, a + n) for (a, _), n in zip(widths, x.shape))
    return _pad(x, widths, value), lambda dy: (getitem(dy, inner),)


_pad = Primitive("pad", _pad_rule, impl=lambda x, widths, value: get_array_module(x).pad(
    x, widths, mode="constant", constant_values=value))


def pad(x: Array, pad_width: int | tuple, value: float = 0.0) -> Array:
    """``x`` padded with the constant ``value`` (``numpy.pad``'s ``constant`` mode): ``pad_width`` an int (every
    side of every axis), a pair ``(before, after)`` (every axis), or one pair per axis.

    >>> import numpy as np
    >>> pad(np.ones((1, 2)), ((0, 1), (1, 0)))
    array([[0., 1., 1.],
           [0., 0., 0.]])
    """
    widths = np.broadcast_to(np.asarray(pad_width), (x.ndim, 2)) if np.ndim(pad_width) <= 2 else None
    if widths is None or np.asarray(pad_width).dtype.kind not in "iu" or (widths < 0).any():
        raise ValueError(f"pad expects pad_width, an int >= 0, a pair of them or one pair per axis of the array of "
                         f"shape {tuple(x.shape)}, got {pad_width!r}")
    return _pad(x, tuple((int(a), int(b)) for a, b in widths), value)


def _sort_rule(x, axis):
    xp = get_array_module(value_of(x))
    order = xp.argsort(value_of(x), axis=axis)
    back = xp.argsort(order, axis=axis)   # where each sorted entry came from, inverted

    def sort_pullback(dy):
        return (get_array_module(value_of(dy)).take_along_axis(value_of(dy), back, axis=axis),)
    return _sort(x, axis), sort_pullback


def _sort_impl(x, axis):
    xp = get_array_module(x)
    return xp.take_along_axis(x, xp.argsort(x, axis=axis), axis=axis)   # the order the pullback inverts


_sort = Primitive("sort", _sort_rule, impl=_sort_impl)


def sort(x: Array, axis: int = -1) -> Array:
    """``x`` sorted along ``axis`` (the last by default), ascending and stable; the gradient goes back to where
    each value came from.

    >>> import numpy as np
    >>> sort(np.array([3.0, 1.0, 2.0]))
    array([1., 2., 3.])
    """
    return _sort(x, _one_axis(x, axis, "sort"))
