"""Activation functions (NNlib's ``src/activations.jl``).

Each is written with NumPy ufuncs and ``np.where`` on its argument, so one definition serves
NumPy and CuPy arrays, the dual numbers of :func:`fluxpy.broadcast` and the GPU's kernel tracer. On a Tracked value
each is one node on the tape (:func:`fluxpy.ops.bias_act` without a bias: the derivative from the saved output or
input, one kernel each way on the GPU), not one per ufunc of its definition.
Derivatives at kinks follow NNlib: ``relu'(0) = 0``, ``hardtanh'(±1) = 0``.

Parameters are keywords; fix them with ``functools.partial`` (``partial(leakyrelu, a=0.2)``).

Every activation pickles, so a model holding one does (``pickle.dumps(Dense(2, 3, relu))``): the
plain functions by name, as Python does, and the primitives (``relu`` here, ``fluxpy.tanh`` and
the other elementwise ops) by the module-level name they are reachable at (``Primitive.__reduce__``);
unpickling gives back the same object, so ``act is relu`` still holds.

>>> import numpy as np
>>> from fluxpy import gradient
>>> relu(np.array([-1.0, 2.0]))
array([0., 2.])
>>> gradient(lambda x: sigmoid(x).sum(), np.zeros(2))
(array([0.25, 0.25]),)
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..autodiff import Primitive, Tracked, value_of
from ..backend import Array
from ..dual import Dual
from ..kernels import find
from ..layout import keep_layout, keeping_layout
from .dropout import _uniform
from .reduce import normalize_axis
from .softmax import softmax
from .special import erf

__all__ = ["identity", "relu", "leakyrelu", "relu6", "elu", "gelu", "swish", "sigmoid", "tanh", "softplus",
           "hardtanh", "gelu_tanh", "gelu_sigmoid", "gelu_erf", "hardsigmoid", "hardswish", "lisht", "softsign", "selu",
           "celu", "trelu", "logcosh", "mish", "tanhshrink", "softshrink", "logsigmoid", "rrelu", "hardshrink"]
# __all__ is the elementwise activations, each of which the fused kernels take (bias_act, batchnorm). softmin and
# glu act along an axis, so they are not among them: fluxpy.ops exports them.

def _one_op(act):
    """``act`` as one tape node where it is called on a tracked array alone (no keywords): ``bias_act`` without a
    bias, whose pullback computes the derivative from the saved output or input (one kernel each way on the GPU),
    instead of a node per ufunc of its definition. Everywhere else (plain arrays, dual numbers, the GPU tracer's
    symbols, a call with keywords) the definition runs as written."""
    @functools.wraps(act)
    def activation(x, *args, **kwargs):
        if type(x) is Tracked and not args and not kwargs and _one_op_primitive is not None:
            return _one_op_primitive(x, None, activation)
        return act(x, *args, **kwargs)
    return activation


_one_op_primitive = None   # bias_act's primitive, set by fluxpy.ops.bias_act when it is imported (it imports this)


_GELU_LAMBDA = math.sqrt(2 / math.pi)
_GELU_ALPHA = 0.044715


def identity(x: Array) -> Array:
    """No activation: ``x`` itself.

    >>> import numpy as np
    >>> identity(np.array([-1.0, 2.0]))
    array([-1.,  2.])
    """
    return x


def _relu_rule(x):
    y = relu(x)

    def relu_pullback(dy):
        return (keeping_layout(_masked, dy, value_of(y)),)
    return y, relu_pullback


def _masked(dy, y):
    kernel = find("relu_backward", dy, y)   # the CPU's large float32 arrays: one pass on oneDNN's threads
    return dy * (y > 0) if kernel is None else kernel(dy, y)


def _relu_values(x):
    kernel = find("relu_forward", x)
    return np.maximum(x, 0) if kernel is None else kernel(x)


# A primitive rather than np.where(x > 0, x, 0): NumPy's where costs several times maximum on float32
# activations, and the rule needs only the output.
relu = Primitive("relu", _relu_rule, impl=keep_layout(_relu_values), doc="""
    The rectified linear unit, ``max(x, 0)``; its derivative at 0 is 0.

    >>> import numpy as np
    >>> relu(np.array([-1.0, 0.0, 2.0]))
    array([0., 0., 2.])
    """)


@_one_op
def leakyrelu(x: Array, a: float = 0.01) -> Array:
    """The leaky ReLU: ``x if x > 0 else a * x``.

    >>> import numpy as np
    >>> leakyrelu(np.array([-2.0, 3.0]), a=0.1)
    array([-0.2,  3. ])
    """
    return np.where(x > 0, x, a * x)


@_one_op
def relu6(x: Array) -> Array:
    """ReLU capped at 6: ``min(max(x, 0), 6)``.

    >>> import numpy as np
    >>> relu6(np.array([-1.0, 3.0, 9.0]))
    array([0., 3., 6.])
    """
    # not np.where(x < 6, ...): NaN < 6 is false, and NaN must give NaN (NNlib test/activations.jl)
    return np.where(x > 6, 6, relu(x))


def _neg_abs(x):
    """``-|x|`` with slope 1 at 0 (so ``exp(_neg_abs(x))`` gives the true derivative there)."""
    return np.where(x > 0, -x, x)


@_one_op
def elu(x: Array, a: float = 1.0) -> Array:
    """The exponential linear unit: ``x if x >= 0 else a * (exp(x) - 1)``; its derivative at 0 is 1 (NNlib's;
    PyTorch's is ``a`` there).

    >>> import numpy as np
    >>> elu(np.array([-1.0, 2.0])).round(4)
    array([-0.6321,  2.    ])
    """
    # exp only sees non-positive numbers: np.where evaluates both branches, and exp(big) would overflow.
    return np.where(x >= 0, x, a * np.expm1(np.where(x >= 0, 0, x)))


@_one_op
def gelu(x: Array) -> Array:
    """The Gaussian error linear unit: ``x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``.

    This is the tanh approximation of ``x * Phi(x)``, as Flux/NNlib's ``gelu`` (PyTorch's
    ``gelu(x, approximate="tanh")``), not the exact erf form.

    >>> import numpy as np
    >>> gelu(np.array([-1.0, 0.0, 1.0])).round(4)
    array([-0.1588,  0.    ,  0.8412])
    """
    return 0.5 * x * (1 + np.tanh(_GELU_LAMBDA * (x + _GELU_ALPHA * (x * x * x))))   # x * x * x: no per-element pow


@_one_op
def sigmoid(x: Array) -> Array:
    """The logistic sigmoid, ``1 / (1 + exp(-x))``, computed without overflow for any ``x``.

    >>> import numpy as np
    >>> sigmoid(np.array([-1000.0, 0.0, 1000.0]))
    array([0. , 0.5, 1. ])
    """
    # NNlib's form: with t = exp(-|x|) <= 1, sigmoid = 1/(1+t) for x > 0 and t/(1+t) otherwise.
    t = np.exp(_neg_abs(x))
    return np.where(x > 0, 1, t) / (1 + t)


@_one_op
def swish(x: Array) -> Array:
    """Swish, also called SiLU: ``x * sigmoid(x)``.

    >>> import numpy as np
    >>> swish(np.array([0.0, 1.0])).round(4)
    array([0.    , 0.7311])
    """
    return x * sigmoid(x)


def tanh(x: Array) -> Array:
    """The hyperbolic tangent.

    >>> import numpy as np
    >>> tanh(np.array([0.0, 100.0]))
    array([0., 1.])
    """
    return np.tanh(x)


@_one_op
def softplus(x: Array) -> Array:
    """The softplus ``log(1 + exp(x))``, computed without overflow as ``log1p(exp(-|x|)) + relu(x)``.

    >>> import numpy as np
    >>> softplus(np.array([-100.0, 0.0, 100.0])).round(4)
    array([  0.    ,   0.6931, 100.    ])
    """
    return np.log1p(np.exp(_neg_abs(x))) + relu(x)


@_one_op
def hardtanh(x: Array) -> Array:
    """``x`` clamped to ``[-1, 1]``: ``min(max(x, -1), 1)``.

    >>> import numpy as np
    >>> hardtanh(np.array([-3.0, 0.5, 2.0]))
    array([-1. ,  0.5,  1. ])
    """
    return np.where(x > 1, 1, np.where(x < -1, -1, x))


gelu_tanh = gelu   # NNlib's name for the tanh approximation (NNlib's gelu is gelu_tanh)

_GELU_2LAMBDA = math.sqrt(8 / math.pi)


@_one_op
def gelu_sigmoid(x: Array) -> Array:
    """GELU through the sigmoid: ``x * sigmoid(sqrt(8/pi) * (x + 0.044715 x^3))``, equal to :func:`gelu` (NNlib's
    ``gelu_sigmoid``).

    >>> import numpy as np
    >>> gelu_sigmoid(np.array([-1.0, 1.0])).round(4)
    array([-0.1588,  0.8412])
    """
    return x * sigmoid(_GELU_2LAMBDA * (x + _GELU_ALPHA * (x * x * x)))


_SQRT_HALF = math.sqrt(0.5)


@_one_op
def gelu_erf(x: Array) -> Array:
    """The exact Gaussian error linear unit, ``x * Phi(x) = x/2 * (1 + erf(x / sqrt(2)))`` (NNlib's ``gelu_erf``,
    PyTorch's default ``gelu``, ``approximate="none"``). fluxpy's :func:`gelu` is the tanh approximation, as NNlib's
    ``gelu``; the two differ by up to about 5e-4.

    Differentiable to any order (:func:`fluxpy.ops.special.erf`); fused on the GPU as every traceable activation
    (``Dense(..., gelu_erf)``'s ``bias_act``, ``BatchNorm(C, gelu_erf)``), with CUDA's ``erf``.

    >>> import numpy as np
    >>> gelu_erf(np.array([-1.0, 0.0, 1.0])).round(4)
    array([-0.1587,  0.    ,  0.8413])
    """
    return 0.5 * x * (1 + erf(x * _SQRT_HALF))


def rrelu(x: Array, lo: float = 1 / 8, hi: float = 1 / 3, *, rng=None) -> Array:
    """The randomized leaky ReLU (NNlib's ``rrelu``): ``x if x > 0 else a * x`` with a slope ``a`` drawn from
    ``U[lo, hi)`` for every element at every call (``lo = hi`` makes it :func:`leakyrelu` with ``a = lo``).

    As NNlib, it is random at every call, in training and testing alike; PyTorch's ``rrelu(training=False)`` uses the
    fixed slope ``(lo + hi) / 2`` instead (``leakyrelu(x, a=(lo + hi) / 2)`` here). The gradient is 1 where
    ``x > 0`` and the drawn slope elsewhere. ``rng``: a generator or a seed; by default the array module's global
    generator (:func:`fluxpy.seed`), on the array's device.

    >>> import numpy as np
    >>> rrelu(np.array([-8.0, 2.0]), 0.25, 0.25)
    array([-2.,  2.])
    >>> y = rrelu(-np.ones(1000), rng=0)
    >>> bool((y >= -1 / 3).all() and (y <= -1 / 8).all())
    True
    """
    for name, v in (("lo", lo), ("hi", hi)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
            raise ValueError(f"rrelu expects {name} to be a finite number, got {v!r}")
    if lo > hi:
        raise ValueError(f"rrelu expects lo <= hi, got lo={lo!r} and hi={hi!r}")
    if type(x) is Dual:
        raise TypeError("rrelu draws new slopes at every call, so dual numbers cannot differentiate it (fluxpy."
                        "broadcast(rrelu, x)): call rrelu(x) itself")
    u = _uniform(value_of(x), rng, None, "rrelu")
    a = (u * (hi - lo) + lo).astype(value_of(x).dtype, copy=False)
    return np.where(x > 0, x, a * x)


rrelu.draws_random = True   # bias_act applies it on the tape (its derivative cannot be recomputed by a new draw)


@_one_op
def hardsigmoid(x: Array) -> Array:
    """The piecewise-linear sigmoid ``clamp((x + 3) / 6, 0, 1)`` (NNlib's ``hardσ``, PyTorch's ``hardsigmoid``).

    >>> import numpy as np
    >>> hardsigmoid(np.array([-4.0, 0.0, 1.5, 4.0]))
    array([0.  , 0.5 , 0.75, 1.  ])
    """
    return np.where(x > 3, 1, np.where(x < -3, 0, (x + 3) / 6))


@_one_op
def hardswish(x: Array) -> Array:
    """``x * hardsigmoid(x)`` (NNlib's and PyTorch's ``hardswish``).

    >>> import numpy as np
    >>> hardswish(np.array([-4.0, 1.5, 4.0]))
    array([-0.   ,  1.125,  4.   ])
    """
    return x * hardsigmoid(x)


@_one_op
def lisht(x: Array) -> Array:
    """LiSHT, ``x * tanh(x)``.

    >>> import numpy as np
    >>> lisht(np.array([-1.0, 2.0])).round(4)
    array([0.7616, 1.9281])
    """
    return x * np.tanh(x)


@_one_op
def softsign(x: Array) -> Array:
    """``x / (1 + |x|)``.

    >>> import numpy as np
    >>> softsign(np.array([-1.0, 3.0]))
    array([-0.5 ,  0.75])
    """
    return x / (1 + np.abs(x))


_SELU_LAMBDA = 1.0507009873554804934193349852946
_SELU_ALPHA = 1.6732632423543772848170429916717


@_one_op
def selu(x: Array) -> Array:
    """The scaled ELU ``lambda * (x if x > 0 else alpha * (exp(x) - 1))``, ``lambda ~ 1.0507``, ``alpha ~ 1.6733``
    (Klambauer et al. 2017).

    >>> import numpy as np
    >>> selu(np.array([-1.0, 1.0])).round(4)
    array([-1.1113,  1.0507])
    """
    return _SELU_LAMBDA * np.where(x > 0, x, _SELU_ALPHA * np.expm1(np.where(x > 0, 0, x)))


@_one_op
def celu(x: Array, a: float = 1.0) -> Array:
    """The continuously differentiable ELU: ``x if x >= 0 else a * (exp(x / a) - 1)``.

    >>> import numpy as np
    >>> celu(np.array([-4.0, 2.0]), a=0.5).round(4)
    array([-0.4998,  2.    ])
    """
    return np.where(x >= 0, x, a * np.expm1(np.where(x >= 0, 0, x) / a))


@_one_op
def trelu(x: Array, theta: float = 1.0) -> Array:
    """The thresholded ReLU: ``x if x > theta else 0``.

    >>> import numpy as np
    >>> trelu(np.array([0.5, 1.0, 1.1]))
    array([0. , 0. , 1.1])
    """
    return np.where(x <= theta, 0, x)


@_one_op
def logcosh(x: Array) -> Array:
    """``log(cosh(x))``, computed without overflow as ``x + softplus(-2x) - log(2)``.

    >>> import numpy as np
    >>> logcosh(np.array([0.0, 1000.0])).round(4)
    array([  0.    , 999.3069])
    """
    return x + softplus(-2 * x) - math.log(2)


@_one_op
def mish(x: Array) -> Array:
    """Mish, ``x * tanh(softplus(x))``.

    >>> import numpy as np
    >>> mish(np.array([-5.0, 1.0])).round(4)
    array([-0.0336,  0.8651])
    """
    return x * np.tanh(softplus(x))


@_one_op
def tanhshrink(x: Array) -> Array:
    """``x - tanh(x)``.

    >>> import numpy as np
    >>> tanhshrink(np.array([1.0])).round(4)
    array([0.2384])
    """
    return x - np.tanh(x)


@_one_op
def softshrink(x: Array, lam: float = 0.5) -> Array:
    """Soft shrinkage: ``x - lam`` above ``lam``, ``x + lam`` below ``-lam``, 0 between (NaN stays NaN).

    >>> import numpy as np
    >>> softshrink(np.array([-15.0, 4.0, 15.0]), lam=5.0)
    array([-10.,   0.,  10.])
    """
    lo, hi = x - lam, x + lam
    return np.where(hi > 0, np.where(lo < 0, 0, lo), hi)


@_one_op
def logsigmoid(x: Array) -> Array:
    """``log(sigmoid(x))``, computed as ``-softplus(-x)`` (NNlib's ``logσ``).

    >>> import numpy as np
    >>> logsigmoid(np.array([-1000.0, 0.0, 1000.0])).round(4).tolist()
    [-1000.0, -0.6931, -0.0]
    """
    return -softplus(-x)


@_one_op
def hardshrink(x: Array, lam: float = 0.5) -> Array:
    """Hard shrinkage: ``x`` where ``|x| > lam``, else 0 (PyTorch's ``hardshrink(x, lambd)``; NaN stays NaN). Its
    derivative is 1 outside ``[-lam, lam]`` and 0 inside.

    >>> import numpy as np
    >>> hardshrink(np.array([-1.0, 0.2, 0.5, 3.0]))
    array([-1.,  0.,  0.,  3.])
    """
    # written so that NaN fails both comparisons and falls through to x
    return np.where(x >= -lam, np.where(x <= lam, 0, x), x)


def softmin(x: Array, axis: int | tuple[int, ...] = -1) -> Array:
    """``softmax(-x, axis)``: weights summing to 1 along ``axis``, largest where ``x`` is smallest (PyTorch's
    ``softmin``; through :func:`fluxpy.softmax`'s kernels and rule).

    >>> import numpy as np
    >>> softmin(np.array([0.0, np.log(3.0)])).round(4)
    array([0.75, 0.25])
    """
    return softmax(-x, axis)


def glu(x: Array, axis: int = -1) -> Array:
    """The gated linear unit: ``x`` split in halves ``a, b`` along ``axis``, then ``a * sigmoid(b)`` (Dauphin et
    al. 2017; PyTorch's ``glu(x, dim=-1)``). ``x.shape[axis]`` must be even; the output has half of it.

    >>> import numpy as np
    >>> glu(np.array([[2.0, 4.0, 0.0, 1000.0]]))
    array([[1., 4.]])
    """
    ax, = normalize_axis(axis, len(x.shape), "glu")
    n = x.shape[ax]
    if n % 2:
        raise ValueError(f"glu expects an even size along axis {axis}, got shape {tuple(x.shape)}")
    before = (slice(None),) * ax
    return x[before + (slice(0, n // 2),)] * sigmoid(x[before + (slice(n // 2, n),)])


def threshold(x: Array, threshold: float, value: float) -> Array:
    """``x`` where ``x > threshold``, else ``value`` (PyTorch's ``F.threshold``; NaN stays NaN, as there).

    >>> import numpy as np
    >>> threshold(np.array([-1.0, 0.5, 2.0]), 0.5, -9.0)
    array([-9., -9.,  2.])
    """
    return np.where(x <= threshold, value, x)


class OutputDerivative:
    """An activation's derivative written as a function of its output ``y = act(x)`` (NNlib's
    ``derivatives_given_output``): ``formula(y, **params)``, with NumPy ufuncs (so it runs on arrays, Tracked values
    and the GPU tracer's symbols), true where ``valid(**params)`` (the activation's keywords) says so. A fused
    pullback that has it keeps only the output, which the next layer holds anyway.

    >>> import numpy as np
    >>> DERIVATIVES_FROM_OUTPUT[tanh].formula(np.array([0.5]))
    array([0.75])
    """
    __slots__ = ("formula", "valid")

    def __init__(self, formula, valid=lambda **params: True):
        self.formula, self.valid = formula, valid


_SELU_LA = _SELU_LAMBDA * _SELU_ALPHA

DERIVATIVES_FROM_OUTPUT = {
    relu: OutputDerivative(lambda y: y > 0),
    leakyrelu: OutputDerivative(lambda y, a=0.01: np.where(y > 0, 1.0, a), lambda a=0.01: a >= 0),
    relu6: OutputDerivative(lambda y: (y > 0) & (y < 6)),
    elu: OutputDerivative(lambda y, a=1.0: np.where(y >= 0, 1.0, y + a), lambda a=1.0: a > 0),
    celu: OutputDerivative(lambda y, a=1.0: np.where(y >= 0, 1.0, y / a + 1), lambda a=1.0: a > 0),
    selu: OutputDerivative(lambda y: np.where(y > 0, _SELU_LAMBDA, y + _SELU_LA)),
    sigmoid: OutputDerivative(lambda y: y * (1 - y)),
    tanh: OutputDerivative(lambda y: 1 - y * y),
    np.tanh: OutputDerivative(lambda y: 1 - y * y),
    softplus: OutputDerivative(lambda y: -np.expm1(-y)),
    logsigmoid: OutputDerivative(lambda y: -np.expm1(y)),
    softsign: OutputDerivative(lambda y: np.square(1 - np.abs(y))),
    hardtanh: OutputDerivative(lambda y: (y > -1) & (y < 1)),
    hardsigmoid: OutputDerivative(lambda y: np.where((y > 0) & (y < 1), 1 / 6, 0.0)),
}
"""Activation -> :class:`OutputDerivative`, for the activations whose derivative is a function of their output.
Every other traceable activation is differentiated from its input: by its formula in
:data:`DERIVATIVES_FROM_INPUT`, else by dual numbers."""


def _gelu_derivative(x):
    # d/dx x/2 (1 + t), t = tanh(l (x + a x^3)): (1 + t)/2 + (1 - t^2) x (l/2) (1 + 3 a x^2)
    x2 = x * x
    t = np.tanh(_GELU_LAMBDA * (x + _GELU_ALPHA * (x2 * x)))
    return 0.5 + 0.5 * t + (1 - t * t) * (x * (0.5 * _GELU_LAMBDA + 1.5 * _GELU_LAMBDA * _GELU_ALPHA * x2))


def _swish_derivative(x):
    # d/dx x s(x) = s + x s (1 - s)
    s = sigmoid(x)
    return s * (1 + x * (1 - s))


DERIVATIVES_FROM_INPUT = {gelu: _gelu_derivative, swish: _swish_derivative}
"""Activation (without keywords) -> its derivative as a function of its input, with NumPy ufuncs (arrays, Tracked
values, the GPU tracer's symbols), for the activations differentiated from their input that a model uses most: the
same value as the dual numbers give, in a few array operations instead of the dual numbers' dozens.

>>> import numpy as np
>>> DERIVATIVES_FROM_INPUT[swish](np.array([0.0]))
array([0.5])
"""
