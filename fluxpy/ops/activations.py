"""Activation functions (NNlib's ``src/activations.jl``).

Each is written with NumPy ufuncs and ``np.where`` on its argument, so one definition serves
NumPy and CuPy arrays, Tracked values (differentiated through the elementwise primitives) and
the dual numbers of :func:`fluxpy.broadcast` (``broadcast(act, x)`` is one node on the tape).
Derivatives at kinks follow NNlib: ``relu'(0) = 0``, ``hardtanh'(±1) = 0``.

Parameters are keywords; fix them with ``functools.partial`` (``partial(leakyrelu, a=0.2)``).

>>> import numpy as np
>>> from fluxpy import gradient
>>> relu(np.array([-1.0, 2.0]))
array([0., 2.])
>>> gradient(lambda x: sigmoid(x).sum(), np.zeros(2))
(array([0.25, 0.25]),)
"""
from __future__ import annotations

import math

import numpy as np

from ..autodiff import Primitive, value_of

__all__ = ["identity", "relu", "leakyrelu", "relu6", "elu", "gelu", "swish", "sigmoid", "tanh", "softplus",
           "hardtanh"]

_GELU_LAMBDA = math.sqrt(2 / math.pi)
_GELU_ALPHA = 0.044715


def identity(x):
    """``identity(x) = x``: no activation.

    >>> import numpy as np
    >>> identity(np.array([-1.0, 2.0]))
    array([-1.,  2.])
    """
    return x


def _relu_rule(x):
    y = relu(x)

    def relu_pullback(dy):
        return (dy * (value_of(y) > 0),)
    return y, relu_pullback


# A primitive rather than np.where(x > 0, x, 0): NumPy's where is ~12x slower than maximum on
# float32 conv activations, and the rule needs only the output.
relu = Primitive("relu", _relu_rule, impl=lambda x: np.maximum(x, 0), doc="""``relu(x) = max(x, 0)``; its derivative at 0 is 0.

    >>> import numpy as np
    >>> relu(np.array([-1.0, 0.0, 2.0]))
    array([0., 0., 2.])
    """)


def leakyrelu(x, a=0.01):
    """``leakyrelu(x, a=0.01) = x if x > 0 else a * x``.

    >>> import numpy as np
    >>> leakyrelu(np.array([-2.0, 3.0]), a=0.1)
    array([-0.2,  3. ])
    """
    return np.where(x > 0, x, a * x)


def relu6(x):
    """``relu6(x) = min(max(x, 0), 6)``.

    >>> import numpy as np
    >>> relu6(np.array([-1.0, 3.0, 9.0]))
    array([0., 3., 6.])
    """
    return np.where(x < 6, relu(x), 6)


def _neg_abs(x):
    """``-|x|`` with slope 1 at 0 (so ``exp(_neg_abs(x))`` gives the true derivative there)."""
    return np.where(x > 0, -x, x)


def elu(x, a=1.0):
    """``elu(x, a=1.0) = x if x > 0 else a * (exp(x) - 1)``.

    >>> import numpy as np
    >>> elu(np.array([-1.0, 2.0])).round(4)
    array([-0.6321,  2.    ])
    """
    # exp only sees non-positive numbers: np.where evaluates both branches, and exp(big) would overflow.
    return np.where(x > 0, x, a * np.expm1(np.where(x > 0, 0, x)))


def gelu(x):
    """``gelu(x) = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``.

    This is the tanh approximation of ``x * Phi(x)``, as Flux/NNlib's ``gelu`` (PyTorch's
    ``gelu(x, approximate="tanh")``), not the exact erf form.

    >>> import numpy as np
    >>> gelu(np.array([-1.0, 0.0, 1.0])).round(4)
    array([-0.1588,  0.    ,  0.8412])
    """
    return 0.5 * x * (1 + np.tanh(_GELU_LAMBDA * (x + _GELU_ALPHA * x ** 3)))


def sigmoid(x):
    """``sigmoid(x) = 1 / (1 + exp(-x))``, computed without overflow for any ``x``.

    >>> import numpy as np
    >>> sigmoid(np.array([-1000.0, 0.0, 1000.0]))
    array([0. , 0.5, 1. ])
    """
    # NNlib's form: with t = exp(-|x|) <= 1, sigmoid = 1/(1+t) for x > 0 and t/(1+t) otherwise.
    t = np.exp(_neg_abs(x))
    return np.where(x > 0, 1, t) / (1 + t)


def swish(x):
    """``swish(x) = x * sigmoid(x)`` (also called SiLU).

    >>> import numpy as np
    >>> swish(np.array([0.0, 1.0])).round(4)
    array([0.    , 0.7311])
    """
    return x * sigmoid(x)


def tanh(x):
    """``tanh(x)``: the hyperbolic tangent.

    >>> import numpy as np
    >>> tanh(np.array([0.0, 100.0]))
    array([0., 1.])
    """
    return np.tanh(x)


def softplus(x):
    """``softplus(x) = log(1 + exp(x))``, computed without overflow as ``log1p(exp(-|x|)) + relu(x)``.

    >>> import numpy as np
    >>> softplus(np.array([-100.0, 0.0, 100.0])).round(4)
    array([  0.    ,   0.6931, 100.    ])
    """
    return np.log1p(np.exp(_neg_abs(x))) + relu(x)


def hardtanh(x):
    """``hardtanh(x) = min(max(x, -1), 1)``.

    >>> import numpy as np
    >>> hardtanh(np.array([-3.0, 0.5, 2.0]))
    array([-1. ,  0.5,  1. ])
    """
    return np.where(x > 1, 1, np.where(x < -1, -1, x))
