"""Broadcasting: ``broadcast(f, *xs)`` and the one reduction behind every broadcast gradient, ``unbroadcast``.

``unbroadcast(grad, shape)`` collapses a gradient back to an operand's shape: it sums the
leading axes the operand lacked and the axes where the operand had size 1 (Zygote's
``unbroadcast``). Every broadcasting rule in fluxpy calls it; a GPU kernel plugs in behind it
through :func:`register_reducer`.

``broadcast(f, *xs)`` applies a scalar function elementwise and differentiates it as one op,
forward-mode inside (dual numbers, as Flux does with ForwardDiff), so the tape holds one node
however long ``f`` is.

>>> import numpy as np
>>> unbroadcast(np.ones((4, 2, 3)), (2, 1))
array([[12.],
       [12.]])
"""
from __future__ import annotations

import math

import numpy as np

from .autodiff import Primitive, value_of
from .backend import get_array_module
from .ops.shape import astype, broadcast_to

__all__ = ["unbroadcast", "broadcast", "register_reducer", "register_fused", "Dual", "reduced_axes"]

_REDUCERS = {}
_FUSED = {}


def register_fused(array_type, forward, pullback):
    """Route ``broadcast(f, ...)`` on arrays of ``array_type`` to fused kernels.

    ``forward(f, *xs)`` returns ``f`` applied elementwise (one kernel), and
    ``pullback(f, xs, wanted, dy)`` the unreduced cotangents ``dy * df/dx_i`` for the indices
    ``wanted`` (a list, ``None`` where ``f`` ignores an argument); either returns ``None`` to
    fall back to the generic rule. The rule itself does not change: its results still go through
    :func:`unbroadcast`. ``forward=None`` removes the registration. The GPU backend registers
    its compiled kernels here (:mod:`fluxpy.kernels.elementwise`).

    >>> import numpy as np
    >>> register_fused(np.ndarray, None, None)   # nothing is registered for NumPy: a no-op
    """
    if forward is None:
        _FUSED.pop(array_type, None)
    else:
        _FUSED[array_type] = (forward, pullback)


def _fused_for(xs):
    """The fused implementation for the array type among ``xs``, or None (always None on NumPy only).

    Mixing array types (a NumPy and a CuPy array) is an error naming both.
    """
    for x in xs:
        impl = _FUSED.get(type(x))
        if impl is not None:
            get_array_module(*xs)   # raises, naming both, on mixed CPU/GPU arrays
            return impl
    return None


def register_reducer(array_type, fn):
    """Route ``unbroadcast`` on arrays of ``array_type`` to ``fn(grad, axes, shape)``.

    ``fn`` sums ``grad`` over ``axes`` and returns an array of ``shape``. The GPU backend
    registers its mapreducedim kernel here.

    >>> import numpy as np
    >>> register_reducer(np.ndarray, None)  # None restores the default (NumPy's sum)
    """
    if fn is None:
        _REDUCERS.pop(array_type, None)
    else:
        _REDUCERS[array_type] = fn


def reduced_axes(gshape, shape):
    """The axes of a broadcast result ``gshape`` to sum so it collapses to ``shape``.

    >>> reduced_axes((4, 2, 3), (2, 1))
    (0, 2)
    """
    gshape, shape = tuple(gshape), tuple(shape)
    extra = len(gshape) - len(shape)
    if extra < 0 or any(s != 1 and s != g for s, g in zip(shape, gshape[extra:])):
        raise ValueError(f"unbroadcast: a gradient of shape {gshape} cannot come from broadcasting shape {shape}")
    return tuple(range(extra)) + tuple(extra + i for i, s in enumerate(shape) if s == 1 and gshape[extra + i] != 1)


def _unbroadcast_impl(g, shape):
    if g.shape == shape:
        return g
    axes = reduced_axes(g.shape, shape)
    reducer = _REDUCERS.get(type(g))
    if reducer is not None:
        return reducer(g, axes, shape)
    return g.sum(axis=axes).reshape(shape)


def _unbroadcast_rule(g, shape):
    gshape = g.shape

    def unbroadcast_pullback(dz):
        return (broadcast_to(dz, gshape),)
    return _unbroadcast(g, shape), unbroadcast_pullback


_unbroadcast = Primitive("unbroadcast", _unbroadcast_rule, impl=_unbroadcast_impl)


def unbroadcast(grad, shape):
    """``unbroadcast(grad, shape)``: ``grad`` summed down to ``shape``; ``grad`` itself when shapes match.

    >>> import numpy as np
    >>> unbroadcast(np.ones((2, 3)), (3,))
    array([2., 2., 2.])
    """
    shape = tuple(shape)
    if tuple(grad.shape) == shape:
        return grad
    return _unbroadcast(grad, shape)


# ---------------------------------------------------------------------------------------------
# Dual numbers for the derivative of an elementwise function


class Dual:
    """``Dual(v, d)``: a value ``v`` with partial derivatives ``d`` (a tuple, one per seed).

    Arithmetic and the NumPy ufuncs used by activations propagate the partials. Values and
    partials are arrays or Tracked values, so duals can be differentiated again.

    >>> d = Dual(3.0, (1.0,)) ** 2
    >>> d.v, d.d
    (9.0, (6.0,))
    """
    __slots__ = ("v", "d")
    __array_priority__ = 2000.0

    def __init__(self, v, d):
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
            y = self.v ** o
            dy = 2 * self.v if isinstance(o, (int, float)) and o == 2 else o * self.v ** (o - 1)
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


def _dual_select(mask, a, b):
    """Elementwise ``where(mask, a, b)`` for duals or plain values (mask is a plain array)."""
    from .ops.basic import where
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


# ---------------------------------------------------------------------------------------------
# broadcast(f, *xs) as one primitive


def _broadcast_shape(op, xs):
    shapes = [tuple(getattr(x, "shape", ())) for x in xs]
    try:
        return np.broadcast_shapes(*shapes)
    except ValueError:
        raise ValueError(f"{op}: shapes {' and '.join(map(str, shapes))} cannot be broadcast together") from None


def _broadcast_impl(f, *xs):
    shape = _broadcast_shape("broadcast", xs)
    if _FUSED:
        fused = _fused_for(xs)
        if fused is not None:
            y = fused[0](f, *xs)
            if y is not None:
                return y
    y = f(*xs)
    if tuple(getattr(y, "shape", ())) != shape:
        if not hasattr(y, "shape"):   # f ignored its arguments: a constant, filled on the arrays' device
            xp = get_array_module(*xs)
            return xp.full(shape, y, dtype=np.asarray(y).dtype)
        y = broadcast_to(y, shape)
    return y


def _broadcast_rule(needs, f, *xs):
    y = _broadcast(f, *xs)
    shapes = [tuple(getattr(x, "shape", ())) for x in xs]
    wanted = [i for i, n in enumerate(needs[1:]) if n]

    def broadcast_pullback(dy):
        grads = [None] * len(xs)
        if _FUSED:
            fused = _fused_for((dy,) + xs)
            cotangents = None if fused is None else fused[1](f, xs, wanted, dy)
            if cotangents is not None:
                for i, g in zip(wanted, cotangents):
                    if g is not None:
                        grads[i] = unbroadcast(g, shapes[i])
                return (None, *grads)
        partials = _partials(f, xs, wanted)
        dtype = value_of(dy).dtype
        for i, p in zip(wanted, partials):
            if p is None:
                continue
            if getattr(p, "dtype", dtype) != dtype:  # integer seeds through np.where give int64 partials
                p = astype(p, dtype)
            grads[i] = unbroadcast(dy * p, shapes[i])
        return (None, *grads)
    return y, broadcast_pullback


def _partials(f, xs, wanted):
    """Elementwise partial derivatives of ``f`` with respect to the arguments ``wanted``."""
    k = len(wanted)
    duals = list(xs)
    for j, i in enumerate(wanted):
        duals[i] = Dual(xs[i], tuple(1 if m == j else 0 for m in range(k)))
    out = f(*duals)
    if type(out) is not Dual:  # f ignored its arguments
        return [None] * k
    return [None if _is_literal_zero(p) else p for p in out.d]


def _is_literal_zero(p):
    """A partial still equal to its Python seed ``0``: ``f`` never used that argument."""
    return isinstance(p, int) and p == 0


_broadcast = Primitive("broadcast", _broadcast_rule, impl=_broadcast_impl, needs_mask=True)


def broadcast(f, *xs):
    """``broadcast(f, *xs)``: ``f`` applied elementwise with NumPy broadcasting, as one differentiable op.

    ``f`` is a scalar function written with arithmetic and NumPy elementwise functions
    (``np.exp``, ``np.tanh``, ``np.maximum``, ``np.where`` on comparisons, ...). Its derivative
    is taken in forward mode (dual numbers) inside the pullback. Shapes that cannot broadcast
    raise an error naming them.

    >>> import numpy as np
    >>> from fluxpy import gradient
    >>> x, b = np.array([[-1.0, 2.0]]), np.array([0.5])
    >>> broadcast(lambda x, b: np.maximum(x + b, 0.0), x, b)
    array([[0. , 2.5]])
    >>> gradient(lambda b: broadcast(lambda x, b: np.tanh(x * b), x, b).sum(), b)[0].shape
    (1,)
    """
    _broadcast_shape("broadcast", xs)
    return _broadcast(f, *xs)
