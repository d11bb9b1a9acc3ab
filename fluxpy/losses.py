"""Loss functions, as Flux's ``Flux.Losses``.

Every loss takes the prediction ``ŷ`` first and the target ``y`` second, requires them to have
the same shape, and reduces with ``agg`` (default: the mean; pass ``sum``, ``np.sum`` or
``lambda l: l`` for the unreduced losses). Classification losses treat the LAST axis as the
class axis of ``(batch, classes)``: they sum over classes, then ``agg`` runs over the rest
(so the default is the mean over the batch, as Flux's). Targets may be one-hot arrays of any
dtype; integer and boolean ones are cast to ``ŷ``'s dtype.

>>> import numpy as np
>>> from fluxpy import gradient
>>> logits, y = np.zeros((2, 3)), np.eye(3)[[0, 2]]
>>> round(float(logitcrossentropy(logits, y)), 4)   # log(3)
1.0986
>>> gradient(lambda l: logitcrossentropy(l, y), logits)[0].round(3)
array([[-0.333,  0.167,  0.167],
       [ 0.167,  0.167, -0.333]])
"""
from __future__ import annotations

import builtins
from collections.abc import Callable

import numpy as np

from .autodiff import value_of
from .backend import Array, is_array
from .ops import basic
from .ops.activations import softplus
from .ops.reduce import mean
from .ops.reduce import sum as _sum
from .ops.shape import reshape
from .ops.softmax import logit_crossentropy_rows, logsoftmax

__all__ = ["mse", "mae", "huber_loss", "crossentropy", "logitcrossentropy", "binarycrossentropy",
           "logitbinarycrossentropy", "kldivergence", "label_smoothing"]


def _aggregate(agg, losses):
    # Python's builtin sum would iterate over the rows; treat it as the array sum it stands for.
    if agg is builtins.sum:
        return _sum(losses)
    return agg(losses)


def _shape(a):
    return tuple(getattr(a, "shape", ()))


def _check(name, yhat, y):
    """Check shapes (naming the loss) and cast integer/boolean targets to ``ŷ``'s dtype."""
    if _shape(yhat) != _shape(y):
        hint = ""
        if len(_shape(y)) == len(_shape(yhat)) - 1 and np.issubdtype(getattr(value_of(y), "dtype", float), np.integer):
            hint = "; y looks like class indices: one-hot encode it along the last axis"
        raise ValueError(f"{name} expects ŷ and y of the same shape, got {_shape(yhat)} and {_shape(y)}{hint}")
    if is_array(y) and y.dtype.kind in "biu":
        y = y.astype(value_of(yhat).dtype)
    return y


def _eps(yhat, eps):
    """Flux's ``epseltype(ŷ)``: the machine epsilon of ``ŷ``'s float type, unless given."""
    if eps is not None:
        return eps
    dtype = getattr(value_of(yhat), "dtype", np.float64)
    return float(np.finfo(dtype if np.issubdtype(dtype, np.floating) else np.float64).eps)


def _xlogy(x, y):
    """``x * log(y)``, 0 where ``x == 0`` even if ``y == 0`` (Flux's ``xlogy``); gradients stay finite there."""
    return x * basic.log(basic.where(value_of(x) == 0, 1, y))


def mse(yhat: Array, y: Array, *, agg: Callable = mean) -> Array:
    """The mean squared error, ``agg((ŷ - y)^2)`` (``agg=mean`` by default).

    >>> import numpy as np
    >>> float(mse(np.array([1.0, 2.0]), np.array([1.0, 4.0])))
    2.0
    """
    y = _check("mse", yhat, y)
    d = yhat - y
    return _aggregate(agg, d * d)


def mae(yhat: Array, y: Array, *, agg: Callable = mean) -> Array:
    """The mean absolute error, ``agg(|ŷ - y|)`` (``agg=mean`` by default).

    >>> import numpy as np
    >>> float(mae(np.array([1.0, 2.0]), np.array([0.0, 4.0])))
    1.5
    """
    y = _check("mae", yhat, y)
    return _aggregate(agg, basic.abs(yhat - y))


def huber_loss(yhat: Array, y: Array, *, agg: Callable = mean, delta: float = 1.0) -> Array:
    """The Huber loss: ``0.5 d^2`` where ``|d| < delta``, else ``delta (|d| - delta/2)``, reduced by ``agg``.

    ``d = ŷ - y``; quadratic near zero, linear (robust to outliers) beyond ``delta`` (default 1);
    ``agg=mean`` by default.

    >>> import numpy as np
    >>> huber_loss(np.array([0.5, 3.0]), np.zeros(2), agg=lambda l: l)
    array([0.125, 2.5  ])
    """
    y = _check("huber_loss", yhat, y)
    err = basic.abs(yhat - y)
    small = value_of(err) < delta
    return _aggregate(agg, basic.where(small, 0.5 * err * err, delta * (err - 0.5 * delta)))


def crossentropy(yhat: Array, y: Array, *, agg: Callable = mean, eps: float | None = None) -> Array:
    """The cross-entropy of probabilities ``ŷ`` against targets ``y``.

    ``agg(-sum(xlogy(y, ŷ + eps), axis=-1))`` with ``xlogy(y, p) = y log(p)``, and 0 where ``y == 0``.
    ``agg=mean`` by default; ``eps`` defaults to the machine epsilon of ``ŷ``'s dtype.

    ``ŷ`` are probabilities (e.g. a softmax output) with classes on the last axis; ``y`` are
    one-hot or soft targets. Prefer :func:`logitcrossentropy` on logits: it is more stable.

    >>> import numpy as np
    >>> round(float(crossentropy(np.array([[0.25, 0.75]]), np.array([[0.0, 1.0]]))), 4)
    0.2877
    """
    y = _check("crossentropy", yhat, y)
    return _aggregate(agg, -_sum(_xlogy(y, yhat + _eps(yhat, eps)), axis=-1))


def logitcrossentropy(yhat: Array, y: Array, *, agg: Callable = mean) -> Array:
    """The cross-entropy computed from logits: ``agg(-sum(y * logsoftmax(ŷ), axis=-1))``.

    ``agg=mean`` by default. ``crossentropy(softmax(ŷ), y)`` computed stably from logits ``ŷ`` of shape
    ``(batch, classes)``; ``y`` one-hot or soft targets of the same shape (see
    :func:`label_smoothing`). PyTorch's ``cross_entropy`` with probability targets.

    >>> import numpy as np
    >>> round(float(logitcrossentropy(np.array([[0.0, np.log(3.0)]]), np.array([[0, 1]]))), 4)
    0.2877
    """
    y = _check("logitcrossentropy", yhat, y)
    shape = _shape(yhat)
    if len(shape) == 2:
        return _aggregate(agg, logit_crossentropy_rows(yhat, y))
    if len(shape) > 2:   # (..., C): one row per leading index
        rows = logit_crossentropy_rows(reshape(yhat, (-1, shape[-1])), reshape(y, (-1, shape[-1])))
        return _aggregate(agg, reshape(rows, shape[:-1]))
    return _aggregate(agg, -_sum(y * logsoftmax(yhat, axis=-1), axis=-1))


def binarycrossentropy(yhat: Array, y: Array, *, agg: Callable = mean, eps: float | None = None) -> Array:
    """The binary cross-entropy: ``agg(-xlogy(y, ŷ + eps) - xlogy(1 - y, 1 - ŷ + eps))``.

    ``ŷ`` are probabilities (e.g. a sigmoid output), ``y`` targets in [0, 1]; elementwise, no
    class axis. ``agg=mean`` and ``eps`` (machine epsilon) by default, as :func:`crossentropy`.
    Prefer :func:`logitbinarycrossentropy` on logits.

    >>> import numpy as np
    >>> round(float(binarycrossentropy(np.array([0.75]), np.array([1.0]))), 4)
    0.2877
    """
    y = _check("binarycrossentropy", yhat, y)
    e = _eps(yhat, eps)
    return _aggregate(agg, -_xlogy(y, yhat + e) - _xlogy(1 - y, 1 - yhat + e))


def logitbinarycrossentropy(yhat: Array, y: Array, *, agg: Callable = mean) -> Array:
    """The binary cross-entropy computed from logits: ``agg((1 - y) ŷ + softplus(-ŷ))``.

    ``agg=mean`` by default. ``binarycrossentropy(sigmoid(ŷ), y)`` computed stably from logits
    (``-log sigmoid(ŷ) = softplus(-ŷ)``); PyTorch's ``binary_cross_entropy_with_logits``.

    >>> import numpy as np
    >>> round(float(logitbinarycrossentropy(np.array([0.0]), np.array([1.0]))), 4)
    0.6931
    """
    y = _check("logitbinarycrossentropy", yhat, y)
    return _aggregate(agg, (1 - y) * yhat + softplus(-yhat))


def kldivergence(yhat: Array, y: Array, *, agg: Callable = mean, eps: float | None = None) -> Array:
    """The Kullback-Leibler divergence of the distribution ``ŷ`` from the target ``y``.

    ``agg(sum(xlogy(y, y), axis=-1)) + crossentropy(ŷ, y; agg, eps)``, classes on the last axis, with
    ``agg`` and ``eps`` as :func:`crossentropy`; 0 when the two agree (up to ``eps``).

    >>> import numpy as np
    >>> p = np.array([[0.25, 0.75]])
    >>> abs(float(kldivergence(p, p, eps=0.0))) < 1e-15
    True
    """
    y = _check("kldivergence", yhat, y)
    entropy = _aggregate(agg, _sum(_xlogy(y, y), axis=-1))
    return entropy + crossentropy(yhat, y, agg=agg, eps=eps)


def label_smoothing(y: Array, alpha: float, axis: int | None = -1) -> Array:
    """Targets smoothed towards the uniform distribution: ``y (1 - alpha) + alpha / size(y, axis)``.

    Smooths one-hot targets with classes on ``axis`` (the last by default); ``axis=None`` smooths
    binary targets (``y (1 - alpha) + alpha / 2``). ``alpha`` must lie in (0, 1). Flux's
    ``label_smoothing`` (``dims=1`` and ``dims=0``).

    >>> import numpy as np
    >>> label_smoothing(np.array([[0.0, 1.0, 0.0, 0.0]]), 0.2)
    array([[0.05, 0.85, 0.05, 0.05]])
    >>> label_smoothing(np.array([0.0, 1.0]), 0.2, axis=None)
    array([0.1, 0.9])
    """
    if not 0 < alpha < 1:
        raise ValueError(f"label_smoothing: alpha must lie in (0, 1), got {alpha!r}")
    n = 2 if axis is None else _shape(y)[axis]
    return y * (1 - alpha) + alpha / n
