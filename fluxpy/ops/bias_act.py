"""Fused bias and activation, ``act(x + b)`` as one op: :func:`bias_act` (NNlib ``src/bias_act.jl``).

One primitive. For ``identity``, ``relu``, ``tanh`` and ``sigmoid`` the pullback needs only
the output ``y`` (``relu' = y > 0``, ``tanh' = 1 - y^2``, ``sigmoid' = y (1 - y)``): it is
:func:`bias_act_backward`, one pass on the GPU. Any other activation is differentiated
elementwise with dual numbers (as :func:`fluxpy.broadcast` does) by :func:`bias_act_derivative`.
The bias gradient is ``unbroadcast(dz, b.shape)``.

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

from collections.abc import Callable

import numpy as np

from ..autodiff import Primitive, value_of
from ..backend import Array
from ..dual import derivative
from ..kernels import find
from . import basic
from .activations import identity, relu, sigmoid, tanh
from .fused import fused_op
from .shape import unbroadcast

__all__ = ["bias_act", "bias_act_backward", "bias_act_derivative"]


def _relu_dz(y, dy):
    return dy * (value_of(y) > 0)  # a mask product: cheaper than NumPy's where


def _tanh_dz(y, dy):
    return dy * (1 - y * y)


def _sigmoid_dz(y, dy):
    return dy * (y * (1 - y))


# Activations whose derivative is a function of their output, by name (the name is what kernels see).
_OUTPUT_KIND = {identity: "identity", relu: "relu", tanh: "tanh", np.tanh: "tanh", basic.tanh: "tanh",
                sigmoid: "sigmoid"}
_DZ_FROM_OUTPUT = {"identity": lambda y, dy: dy, "relu": _relu_dz, "tanh": _tanh_dz, "sigmoid": _sigmoid_dz}


def _shape(a):
    return tuple(getattr(a, "shape", ()))


def _add_bias(x, b):
    return x if b is None else x + b


def _bias_act_impl(x, b, act):
    kernel = find("bias_act", x, b, act)
    return kernel(x, b, act) if kernel is not None else act(_add_bias(x, b))


def _from_output_backward(kind, y, dy, bshape, need_x, need_b):
    dz = _DZ_FROM_OUTPUT[kind](y, dy)
    return (dz if need_x else None), (unbroadcast(dz, bshape) if need_b and bshape is not None else None)


bias_act_backward = fused_op("bias_act_backward", _from_output_backward, doc="""
    The cotangents ``(dx, db)`` of ``bias_act`` for an activation ``kind`` ("identity", "relu", "tanh",
    "sigmoid") whose derivative is a function of the output ``y``: ``dx = dy * act'(y)``,
    ``db = unbroadcast(dx, bshape)``; ``None`` for what is not needed. One pass on the GPU (``dx``
    written while ``db`` sums).

    >>> import numpy as np
    >>> bias_act_backward("relu", np.array([[0.0, 2.0]]), np.array([[5.0, 5.0]]), (2,), True, True)
    (array([[0., 5.]]), array([0., 5.]))
    """)


def _derivative_backward(x, b, act, dy):
    d = derivative(act, _add_bias(x, b))
    return None if d is None else dy * d


bias_act_derivative = fused_op("bias_act_derivative", _derivative_backward, doc="""
    The cotangent ``dz = dy * act'(x + b)`` for any elementwise ``act`` (dual numbers; one kernel on
    the GPU); ``None`` where ``act`` ignores its input.

    >>> import numpy as np
    >>> bias_act_derivative(np.zeros(2), None, np.tanh, np.array([1.0, 2.0]))
    array([1., 2.])
    """)


def _output_kind(act):
    try:
        return _OUTPUT_KIND.get(act)
    except TypeError:  # an unhashable callable
        return None


def _bias_act_rule(needs, x, b, act):
    y = _bias_act(x, b, act)
    xshape = _shape(x)
    bshape = None if b is None else _shape(b)
    need_b = needs[1] and bshape is not None
    kind = _output_kind(act)
    if kind is not None:

        def bias_act_pullback(dy):
            dx, db = bias_act_backward(kind, y, dy, bshape, needs[0], need_b)
            return dx, db, None
        return y, bias_act_pullback

    def bias_act_generic_pullback(dy):
        dz = bias_act_derivative(x, b, act, dy)
        if dz is None:
            return None, None, None
        return (unbroadcast(dz, xshape) if needs[0] else None), (unbroadcast(dz, bshape) if need_b else None), None
    return y, bias_act_generic_pullback


_bias_act = Primitive("bias_act", _bias_act_rule, impl=_bias_act_impl, needs_mask=True)


def bias_act(x: Array, b: Array | bool | None = None, act: Callable | None = identity) -> Array:
    """Bias and activation, ``act(x + b)``, as one differentiable op.

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
    if getattr(act, "draws_random", False):   # rrelu: the pullback's dual numbers would draw other slopes
        return act(x if b is None else x + b)
    return _bias_act(x, b, act)
