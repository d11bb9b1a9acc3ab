"""Fused bias and activation, ``bias_act(x, b, act) = act(x + b)`` (NNlib ``src/bias_act.jl``).

One primitive. For ``identity``, ``relu``, ``tanh`` and ``sigmoid`` the pullback needs only
the output ``y`` (``relu' = y > 0``, ``tanh' = 1 - y^2``, ``sigmoid' = y (1 - y)``), so
neither ``x`` nor ``x + b`` is kept for the backward pass. Any other activation is
differentiated elementwise with dual numbers (as :func:`fluxpy.broadcast` does), from the
saved ``x + b``. The bias gradient is ``unbroadcast(dz, b.shape)``.

>>> import numpy as np
>>> from fluxpy import gradient
>>> x, b = np.array([[-1.0, 2.0], [3.0, -4.0]]), np.array([0.5, 0.5])
>>> bias_act(x, b, relu)
array([[0. , 2.5],
       [3.5, 0. ]])
>>> gradient(lambda b: bias_act(x, b, relu).sum(), b)
(array([1., 1.]),)
"""
from __future__ import annotations

import numpy as np

from ..autodiff import Primitive, value_of
from ..backend import is_array
from ..broadcast import Dual, unbroadcast
from . import basic
from .activations import identity, relu, sigmoid, tanh

__all__ = ["bias_act", "register_impl"]

# Array-type-specific implementations (the GPU backend registers CuPy's): array type -> object with
# forward(x, b, act) -> y, output_backward(kind, y, dy, bshape, need_x, need_b) -> (dx, db) and
# generic_backward(x, b, act, dy) -> dz; each may return None to take the generic path.
_IMPLS = {}


def register_impl(array_type, impl):
    """Use ``impl`` (see ``_IMPLS`` above) for ``bias_act`` on arrays of ``array_type``; None removes it.

    The rule does not change; only the kernels that compute it do.

    >>> import numpy as np
    >>> register_impl(np.ndarray, None)   # NumPy uses the generic path: a no-op
    """
    if impl is None:
        _IMPLS.pop(array_type, None)
    else:
        _IMPLS[array_type] = impl


def _impl_for(x, b):
    impl = _IMPLS.get(type(x))
    if impl is not None and b is not None and type(b) is not type(x):
        from ..backend import get_array_module
        get_array_module(x, b)   # mixed CPU/GPU arrays: an error naming both
        return None              # e.g. a Tracked bias of an outer tape: the generic path
    return impl


def _relu_dz(y, dy):
    return dy * (value_of(y) > 0)  # a mask product: NumPy's where is ~12x slower on float32


def _tanh_dz(y, dy):
    return dy * (1 - y * y)


def _sigmoid_dz(y, dy):
    return dy * (y * (1 - y))


# The same activations by name, for the array-type-specific kernels.
_OUTPUT_KIND = {identity: "identity", relu: "relu", tanh: "tanh", np.tanh: "tanh", basic.tanh: "tanh",
                sigmoid: "sigmoid"}

# Activations whose derivative is a function of their output: act -> dz(y, dy), with z = x + b.
_FROM_OUTPUT = {
    identity: lambda y, dy: dy,
    relu: _relu_dz,
    tanh: _tanh_dz,
    np.tanh: _tanh_dz,
    basic.tanh: _tanh_dz,
    sigmoid: _sigmoid_dz,
}


def _shape(a):
    return tuple(getattr(a, "shape", ()))


def _add_bias(x, b):
    return x if b is None else x + b


def _bias_act_impl(x, b, act):
    if _IMPLS:
        impl = _impl_for(x, b)
        if impl is not None:
            y = impl.forward(x, b, act)
            if y is not None:
                return y
    return act(_add_bias(x, b))


def _derivative(act, z):
    """``act'(z)`` elementwise, in forward mode; None when ``act`` ignores its argument."""
    out = act(Dual(z, (1,)))
    if type(out) is not Dual:
        return None
    d = out.d[0]
    if isinstance(d, int) and d == 0:
        return None
    dtype = value_of(z).dtype
    if is_array(d) and d.dtype != dtype:
        d = d.astype(dtype)  # piecewise activations give integer partials (np.where(mask, 1, 0))
    return d


def _output_rule(act):
    try:
        return _FROM_OUTPUT.get(act)
    except TypeError:  # an unhashable callable
        return None


def _bias_act_rule(needs, x, b, act):
    xshape = _shape(x)
    bshape = None if b is None else _shape(b)

    def split(dz):
        dx = unbroadcast(dz, xshape) if needs[0] else None
        db = unbroadcast(dz, bshape) if needs[1] and bshape is not None else None
        return dx, db, None

    from_output = _output_rule(act)
    impl = _impl_for(x, b) if _IMPLS else None
    if from_output is not None:
        y = _bias_act(x, b, act)

        def bias_act_pullback(dy):
            if impl is not None:
                got = impl.output_backward(_OUTPUT_KIND[act], y, dy, bshape, needs[0], needs[1])
                if got is not None:
                    return got[0], got[1], None
            return split(from_output(y, dy))
        return y, bias_act_pullback
    y = impl.forward(x, b, act) if impl is not None else None
    if y is not None:   # one kernel; x and b are kept instead of x + b

        def bias_act_pullback(dy):
            dz = impl.generic_backward(x, b, act, dy)
            if dz is None:
                d = _derivative(act, _add_bias(x, b))
                return (None, None, None) if d is None else split(dy * d)
            return split(dz)
        return y, bias_act_pullback
    z = _add_bias(x, b)
    y = act(z)

    def bias_act_pullback(dy):
        d = _derivative(act, z)
        return (None, None, None) if d is None else split(dy * d)
    return y, bias_act_pullback


_bias_act = Primitive("bias_act", _bias_act_rule, impl=_bias_act_impl, needs_mask=True)


def bias_act(x, b=None, act=identity):
    """``bias_act(x, b=None, act=identity) = act(x + b)``, one differentiable op.

    ``b`` must broadcast to ``x``'s shape (Dense passes ``(out,)`` for ``x @ W.T`` of shape
    ``(batch, out)``; Conv passes ``reshape(b, (1, K, 1, 1))``); ``None`` or ``False`` means no
    bias. ``act`` is any elementwise function written with NumPy ufuncs (see
    :mod:`fluxpy.ops.activations`); ``relu``, ``tanh``, ``sigmoid`` and ``identity`` take the
    fast pullback that uses only the output.

    >>> import numpy as np
    >>> bias_act(np.zeros((2, 3)), np.array([-1.0, 0.0, 1.0]), relu)
    array([[0., 0., 1.],
           [0., 0., 1.]])
    >>> from fluxpy.ops.activations import softplus
    >>> bias_act(np.zeros(1), None, softplus).round(4)
    array([0.6931])
    """
    if b is False:
        b = None
    if act is None:
        act = identity
    if b is not None:
        try:
            full = np.broadcast_shapes(_shape(x), _shape(b))
        except ValueError:
            full = None
        if full != _shape(x):
            raise ValueError(f"bias_act: the bias of shape {_shape(b)} must broadcast to x of shape {_shape(x)}")
    return _bias_act(x, b, act)
