"""Fused bias and activation, ``act(x + b)`` as one op: :func:`bias_act` (NNlib ``src/bias_act.jl``).

One primitive for any elementwise activation. Its pullback is :func:`bias_act_backward`,
``dx = dy * D(saved)`` and ``db = unbroadcast(dx, b.shape)``, one pass on the GPU, where ``D`` is the
activation's derivative written as a function of what the forward kept (:func:`derivative_from_saved`):

- the output ``y`` for the activations of :data:`fluxpy.ops.activations.DERIVATIVES_FROM_OUTPUT`
  (``relu' = y > 0``, ``tanh' = 1 - y^2``, ``sigmoid' = y (1 - y)``, elu, softplus, ...), which the next layer
  holds anyway;
- the pre-activation ``z = x + b`` for every other one (gelu, swish, mish, ...), its derivative from the dual
  numbers :func:`fluxpy.broadcast` uses; the forward writes ``y`` and ``z`` in one pass
  (:func:`bias_act_preactivation`).

On the GPU every activation the elementwise tracer compiles (:func:`fluxpy.kernels.trace.activation_c`) runs
these kernels, built from the activation's one Python definition; :func:`why_not_fused` says why another does
not (it then runs op by op, correct and slower).

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

import functools
from collections.abc import Callable

import numpy as np

from ..autodiff import Primitive, Tracked
from ..backend import Array
from ..dual import Dual
from ..kernels import find
from ..kernels.elementwise import why_not_compiled
from . import activations, basic
from .activations import DERIVATIVES_FROM_INPUT, DERIVATIVES_FROM_OUTPUT, identity, relu, tanh  # noqa: F401 (relu: the examples)
from .fused import fused_op
from .shape import unbroadcast

__all__ = ["bias_act", "bias_act_backward", "bias_act_preactivation", "derivative_from_saved", "why_not_fused"]

_ALIASES = {basic.tanh: tanh}   # the same function under another name


def _shape(a):
    return tuple(getattr(a, "shape", ()))


def _broadcasts_to(shape, target):
    """Whether an array of ``shape`` broadcasts to ``target`` unchanged (``np.broadcast_shapes(target, shape) ==
    target``, without NumPy's machinery: asked at every call).

    >>> _broadcasts_to((3, 1), (2, 3, 4)), _broadcasts_to((4,), (2, 1)), _broadcasts_to((2, 3, 4), (3, 4))
    (True, False, False)
    """
    return len(shape) <= len(target) and all(d == 1 or d == t for d, t in zip(reversed(shape), reversed(target)))


def _add_bias(x, b):
    return x if b is None else x + b


def _draws_random(act) -> bool:
    """Whether ``act`` draws random numbers at every call (rrelu): its derivative cannot be recomputed by a new draw,
    so it is applied op by op on the tape, never in a fused node."""
    return getattr(_split(act)[0], "draws_random", False)


def _bias_act_impl(x, b, act):
    kernel = find("bias_act", x, b, act)
    return kernel(x, b, act) if kernel is not None else act(_add_bias(x, b))


def _split(act):
    """``(function, keywords)`` of an activation given as itself or as a ``functools.partial`` of keywords."""
    if type(act) is functools.partial and not act.args:
        return act.func, act.keywords
    return act, {}


@functools.lru_cache(maxsize=256)
def _derivative(act):
    func, params = _split(act)
    func = _ALIASES.get(func, func)
    if func is identity:
        return None, True
    rule = DERIVATIVES_FROM_OUTPUT.get(func)
    if rule is not None and rule.valid(**params):
        return (functools.partial(rule.formula, **params) if params else rule.formula), True
    formula = None if params else DERIVATIVES_FROM_INPUT.get(func)
    if formula is not None:
        return formula, False

    def input_derivative(z):
        d = act(Dual(z, (1,)))
        return d.d[0] if type(d) is Dual else 0
    input_derivative.__qualname__ = f"derivative of {getattr(act, '__qualname__', act)}"
    return input_derivative, False


def derivative_from_saved(act: Callable) -> tuple[Callable | None, bool]:
    """``(D, from_output)``: the derivative of ``act`` as a scalar function ``D`` of what :func:`bias_act` keeps,
    the output when ``from_output`` (:data:`fluxpy.ops.activations.DERIVATIVES_FROM_OUTPUT`), else the
    pre-activation; ``D`` is None for ``identity`` (``dx = dy``).

    >>> import numpy as np
    >>> from fluxpy.ops.activations import sigmoid, swish
    >>> d, from_output = derivative_from_saved(sigmoid)
    >>> d(np.array([0.5])), from_output
    (array([0.25]), True)
    >>> d, from_output = derivative_from_saved(swish)
    >>> d(np.array([0.0])), from_output
    (array([0.5]), False)
    """
    try:
        return _derivative(act)
    except TypeError:   # an unhashable callable
        return _derivative.__wrapped__(act)


def why_not_fused(act: Callable) -> str | None:
    """None where ``act`` runs in fluxpy's fused GPU kernels (``bias_act``, ``batchnorm``, conv + bias +
    activation), forward and backward; else why not, and it runs op by op there (the elementwise tracer's reason:
    a Python ``if`` on a value, an unknown ufunc, random draws, ...).

    >>> from fluxpy.ops.activations import gelu, rrelu
    >>> why_not_fused(gelu) is None
    True
    >>> why_not_fused(rrelu)
    'it draws random numbers at every call'
    """
    try:
        return _why_not_fused(act)
    except TypeError:   # an unhashable callable
        return _why_not_fused.__wrapped__(act)


@functools.lru_cache(maxsize=256)
def _why_not_fused(act):
    if _draws_random(act):
        return "it draws random numbers at every call"
    reason = why_not_compiled(act)
    if reason is None:
        d, from_output = derivative_from_saved(act)
        if from_output and d is not None:
            reason = why_not_compiled(d, derivative=False)
    return reason


def _bias_act_preactivation(x, b, act):
    z = x + b
    return act(z), z


bias_act_preactivation = fused_op("bias_act_preactivation", _bias_act_preactivation, doc="""
    ``(act(x + b), x + b)``: the output and the pre-activation that :func:`bias_act`'s pullback reads for an
    activation differentiated from its input; one pass on the GPU.

    >>> import numpy as np
    >>> bias_act_preactivation(np.array([1.0, -2.0]), np.array([1.0]), np.negative)
    (array([-2.,  1.]), array([ 2., -1.]))
    """)


def _times(dy, d):
    """``dy * d`` in ``dy``'s dtype (``d`` may be a bool mask, a number or an array of a wider dtype)."""
    dtype = getattr(d, "dtype", None)
    if dtype is not None and dtype != np.bool_ and dtype != dy.dtype:
        d = d.astype(dy.dtype)
    return dy * d


def _backward(derivative, saved, dy, bshape, need_x, need_b):
    dz = dy if derivative is None else _times(dy, derivative(saved))
    return (dz if need_x else None), (unbroadcast(dz, bshape) if need_b and bshape is not None else None)


bias_act_backward = fused_op("bias_act_backward", _backward, doc="""
    The cotangents ``(dx, db)`` of :func:`bias_act`: ``dx = dy * derivative(saved)`` (``saved`` the output or the
    pre-activation, ``derivative`` from :func:`derivative_from_saved`; None for the identity, ``dx = dy``),
    ``db = unbroadcast(dx, bshape)``; ``None`` for what is not needed. One pass on the GPU (``dx`` written while
    ``db`` sums).

    >>> import numpy as np
    >>> d, _ = derivative_from_saved(relu)
    >>> bias_act_backward(d, np.array([[0.0, 2.0]]), np.array([[5.0, 5.0]]), (2,), True, True)
    (array([[0., 5.]]), array([0., 5.]))
    """)


def _bias_act_rule(needs, x, b, act):
    bshape = None if b is None else _shape(b)
    need_b = needs[1] and bshape is not None
    derivative, from_output = derivative_from_saved(act)
    if from_output or b is None:
        # the op itself where the values are tracked (a derivative of a derivative), else its forward straight away
        y = _bias_act(x, b, act) if type(x) is Tracked or type(b) is Tracked else _bias_act_impl(x, b, act)
        saved = y if from_output else x
    else:
        y, saved = bias_act_preactivation(x, b, act)

    def bias_act_pullback(dy):
        dx, db = bias_act_backward(derivative, saved, dy, bshape, needs[0], need_b)
        return dx, db, None
    return y, bias_act_pullback


_bias_act = Primitive("bias_act", _bias_act_rule, impl=_bias_act_impl, needs_mask=True)
activations._one_op_primitive = _bias_act   # an activation called alone on a tracked array is this one node


def bias_act(x: Array, b: Array | bool | None = None, act: Callable | None = identity) -> Array:
    """Bias and activation, ``act(x + b)``, as one differentiable op.

    ``b`` must broadcast to ``x``'s shape (Dense passes ``(out,)`` for ``x @ W.T`` of shape
    ``(batch, out)``; Conv passes ``reshape(b, (1, K, 1, 1))``); ``None`` or ``False`` means no
    bias. ``act`` is any elementwise function written with NumPy ufuncs (see
    :mod:`fluxpy.ops.activations`; ``functools.partial`` fixes its keywords). Forward and pullback are one
    kernel each on the GPU for every activation :func:`why_not_fused` passes (see the module docstring).

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
    if b is not None and not _broadcasts_to(_shape(b), _shape(x)):
        raise ValueError(f"bias_act: the bias of shape {_shape(b)} must broadcast to x of shape {_shape(x)}")
    if _draws_random(act):
        return act(x if b is None else x + b)
    return _bias_act(x, b, act)
