"""Loss functions, as Flux's ``Flux.Losses``, with their inputs checked before anything is computed.

Every loss takes the prediction ``ŷ`` first and the target ``y`` second, requires them to have
the same shape, and reduces with ``agg`` (default: the mean; pass ``sum``, ``np.sum`` or
``lambda l: l`` for the unreduced losses). Classification losses treat the LAST axis as the
class axis of ``(batch, classes)``: they sum over classes, then ``agg`` runs over the rest
(so the default is the mean over the batch, as Flux's). Targets may be one-hot arrays of any
dtype; integer and boolean ones are cast to ``ŷ``'s dtype. :func:`logitcrossentropy` also takes
integer class indices of shape ``ŷ.shape[:-1]`` (PyTorch's ``cross_entropy(logits, target)``). ``ctc_loss`` and
PyTorch's ``smooth_l1_loss``, ``nll_loss``, ``margin_ranking_loss``, ``triplet_margin_loss``, ``cosine_embedding_loss``
and ``gaussian_nll_loss`` live in :mod:`fluxpy.losses_more` and are re-exported here.

**Checks.** A wrong input is an error that names the loss, says what it expected and what it got.
Shape checks are always on and cost nothing: ``ŷ`` and ``y`` of different shapes, an empty batch, a
0-d input to a classification loss, ``agg`` that is not a function. *Value* checks read the data:
probabilities ``ŷ`` outside [0, 1] for :func:`crossentropy`, :func:`binarycrossentropy` and
:func:`kldivergence` (logits passed by mistake), targets ``y`` outside [0, 1] for those and for the
logit losses, class indices outside ``[0, C)``. Reading a CuPy array's values makes the host wait
for the GPU, so the policy, the ``value_checks`` option (:mod:`fluxpy.options`; the environment
variable ``FLUXPY_CHECKS`` sets it at import), is:

- ``"auto"`` (the default): values are checked on NumPy arrays, not on CuPy arrays (no host sync
  is ever added on the GPU). There, class indices out of range still cannot pass silently: their
  rows of the loss are NaN (which :func:`fluxpy.train` reports as a divergence).
- ``True`` (``FLUXPY_CHECKS=1``): values are checked on every device, a host sync per check on the
  GPU: for debugging (``with fluxpy.options(value_checks=True): ...``).
- ``False`` (``FLUXPY_CHECKS=0``): no value checks anywhere.

Tracked values (inside :func:`fluxpy.gradient`) are checked on their values; a check never goes
on the tape. NaN is not a domain error: a NaN loss is left to report itself (as
:class:`fluxpy.TrainingDiverged` does).

>>> import numpy as np
>>> from fluxpy import gradient
>>> logits, y = np.zeros((2, 3)), np.eye(3)[[0, 2]]
>>> round(float(logitcrossentropy(logits, y)), 4)   # log(3)
1.0986
>>> gradient(lambda l: logitcrossentropy(l, y), logits)[0].round(3)
array([[-0.333,  0.167,  0.167],
       [ 0.167,  0.167, -0.333]])
>>> round(float(logitcrossentropy(logits, np.array([0, 2]))), 4)   # the same, from class indices
1.0986
>>> crossentropy(np.array([[2.0, -1.0]]), np.array([[1.0, 0.0]]))
Traceback (most recent call last):
...
ValueError: crossentropy expects ŷ in [0, 1] (probabilities), got values from -1 to 2 in ŷ of shape (1, 2) float64; \
for logits use logitcrossentropy(ŷ, y), or apply softmax first
"""
from __future__ import annotations

import builtins
import math
import numbers
from collections.abc import Callable

import ml_dtypes
import numpy as np

from .autodiff import is_tracked, value_of
from .backend import Array, get_array_module, is_array, is_float_dtype
from .options import options
from .ops import basic
from .ops.activations import softplus
from .ops.reduce import mean
from .ops.reduce import sum as _sum
from .ops.shape import reshape, transpose
from .ops.crossentropy import logit_crossentropy_labels
from .ops.softmax import logit_crossentropy_rows
from .losses_more import (cosine_embedding_loss, ctc_loss, gaussian_nll_loss, hinge_embedding_loss,
                          margin_ranking_loss, multi_margin_loss, multilabel_soft_margin_loss, nll_loss,
                          smooth_l1_loss, soft_margin_loss, triplet_margin_loss)

__all__ = ["mse", "mae", "huber_loss", "crossentropy", "logitcrossentropy", "binarycrossentropy",
           "logitbinarycrossentropy", "kldivergence", "label_smoothing", "msle", "poisson_loss",
           "hinge_loss", "squared_hinge_loss", "dice_coeff_loss", "tversky_loss", "binary_focal_loss", "focal_loss",
           "siamese_contrastive_loss", "xlogx", "xlogy", "ctc_loss", "smooth_l1_loss", "nll_loss",
           "margin_ranking_loss", "triplet_margin_loss", "cosine_embedding_loss", "gaussian_nll_loss",
           "soft_margin_loss", "hinge_embedding_loss", "multilabel_soft_margin_loss", "multi_margin_loss"]


# ---------------------------------------------------------------------------------------------
# The value-check policy (the value_checks option)


def _values_checked(v):
    """Whether to read the values of the plain array ``v`` under the current policy."""
    policy = options.value_checks
    if policy == "auto":
        return isinstance(v, np.ndarray)
    return policy and is_array(v)


def _describe(name, a):
    v = value_of(a)
    if not hasattr(v, "shape"):
        return f"{name} a {type(v).__name__}"
    return f"{name} of shape {tuple(v.shape)} {v.dtype}"


def _extremes(v):
    """``(min, max)`` ignoring NaN, as text (only on the error path)."""
    xp = get_array_module(v)
    finite = v[~xp.isnan(v)] if is_float_dtype(v.dtype) or v.dtype.kind == "c" else v
    return f"{float(finite.min()):.4g}", f"{float(finite.max()):.4g}"


def _require_unit_interval(name, what, label, a, hint=""):
    """Raise unless every value of ``a`` lies in [0, 1] (NaN passes), under the check policy."""
    v = value_of(a)
    if not is_array(v) or v.dtype.kind == "b" or not _values_checked(v):
        return
    if bool(((v < 0) | (v > 1)).any()):
        lo, hi = _extremes(v)
        raise ValueError(f"{name} expects {label} in [0, 1] ({what}), got values from {lo} to {hi} in "
                         f"{_describe(label, a)}{hint}")


# ---------------------------------------------------------------------------------------------
# Shape checks: always on


def _aggregate(agg, losses):
    # Python's builtin sum would iterate over the rows; treat it as the array sum it stands for.
    if agg is builtins.sum:
        return _sum(losses)
    return agg(losses)


def _shape(a):
    return tuple(getattr(a, "shape", ()))


def _is_labels(yhat, y):
    """True when ``y`` holds integer class indices for ``ŷ``: integer dtype, shape ``ŷ.shape[:-1]``."""
    shape = _shape(yhat)
    dtype = getattr(value_of(y), "dtype", None)
    return (len(shape) >= 1 and dtype is not None and np.dtype(dtype).kind in "iu"
            and _shape(y) == shape[:-1])


def _check_options(name, agg, eps=None):
    if not callable(agg):
        raise TypeError(f"{name} expects agg to be a function such as fluxpy.mean, sum or lambda l: l, got {agg!r}")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0):
        raise ValueError(f"{name} expects eps to be None or a number >= 0, got {eps!r}")


def _check(name, yhat, y, *, classes=False, labels_hint="", probabilities="", targets=""):
    """Check shapes (naming the loss), then values under the policy, and cast integer/boolean targets to ``ŷ``'s dtype.

    ``probabilities``: ŷ must lie in [0, 1] (the text is the hint for logits); ``targets``: y must lie in [0, 1]
    (the text says what y is).
    """
    if isinstance(y, numbers.Real) and not isinstance(y, bool) and is_array(value_of(yhat)):
        # one target for every entry (Flux's `binarycrossentropy(ŷ, 1)`): the full array, so the checks below apply
        v = value_of(yhat)
        y = get_array_module(v).full(v.shape, y, v.dtype)
    if _shape(yhat) != _shape(y):
        hint = ""
        if classes and _is_labels(yhat, y):
            hint = labels_hint or "; y looks like class indices: one-hot encode it along the last axis"
        raise ValueError(f"{name} expects ŷ and y of the same shape, got {_shape(yhat)} and {_shape(y)}{hint}")
    _check_not_empty(name, yhat, classes)
    if probabilities:
        _require_unit_interval(name, _PROBABILITIES, "ŷ", yhat, probabilities)
    if targets:
        _require_unit_interval(name, targets, "y", y)
    if is_array(y) and y.dtype.kind in "biu":
        y = y.astype(value_of(yhat).dtype)
    return y


def _check_not_empty(name, yhat, classes):
    shape = _shape(yhat)
    if classes and len(shape) == 0:
        raise ValueError(f"{name} expects ŷ with the classes on its last axis, got a 0-d {_describe('ŷ', yhat)}")
    if math.prod(shape) == 0:
        raise ValueError(f"{name} expects a non-empty batch, got {_describe('ŷ', yhat)}")


def _eps(yhat, eps):
    """Flux's ``epseltype(ŷ)``: the machine epsilon of ``ŷ``'s float type, unless given."""
    if eps is not None:
        return eps
    dtype = getattr(value_of(yhat), "dtype", np.float64)
    return float(ml_dtypes.finfo(dtype if is_float_dtype(dtype) else np.float64).eps)   # ml_dtypes' finfo: bfloat16 too


def _xlogy(x, y):
    """``x * log(y)``, 0 where ``x == 0`` even if ``y == 0`` (Flux's ``xlogy``); gradients stay finite there."""
    return x * basic.log(basic.where(value_of(x) == 0, 1, y))


_PROBABILITIES = "probabilities"
_TARGETS = "one-hot or soft targets"


# ---------------------------------------------------------------------------------------------
# Regression


def mse(yhat: Array, y: Array, *, agg: Callable = mean) -> Array:
    """The mean squared error, ``agg((ŷ - y)^2)`` (``agg=mean`` by default).

    >>> import numpy as np
    >>> float(mse(np.array([1.0, 2.0]), np.array([1.0, 4.0])))
    2.0
    """
    _check_options("mse", agg)
    y = _check("mse", yhat, y)
    d = yhat - y
    return _aggregate(agg, d * d)


def mae(yhat: Array, y: Array, *, agg: Callable = mean) -> Array:
    """The mean absolute error, ``agg(|ŷ - y|)`` (``agg=mean`` by default).

    >>> import numpy as np
    >>> float(mae(np.array([1.0, 2.0]), np.array([0.0, 4.0])))
    1.5
    """
    _check_options("mae", agg)
    y = _check("mae", yhat, y)
    return _aggregate(agg, basic.abs(yhat - y))


def huber_loss(yhat: Array, y: Array, *, agg: Callable = mean, delta: float = 1.0) -> Array:
    """The Huber loss: ``0.5 d^2`` where ``|d| < delta``, else ``delta (|d| - delta/2)``, reduced by ``agg``.

    ``d = ŷ - y``; quadratic near zero, linear (robust to outliers) beyond ``delta`` (default 1,
    must be > 0); ``agg=mean`` by default.

    >>> import numpy as np
    >>> huber_loss(np.array([0.5, 3.0]), np.zeros(2), agg=lambda l: l)
    array([0.125, 2.5  ])
    """
    _check_options("huber_loss", agg)
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not delta > 0:
        raise ValueError(f"huber_loss expects delta to be a number > 0, got {delta!r}")
    y = _check("huber_loss", yhat, y)
    err = basic.abs(yhat - y)
    small = value_of(err) < delta
    return _aggregate(agg, basic.where(small, 0.5 * err * err, delta * (err - 0.5 * delta)))


# ---------------------------------------------------------------------------------------------
# Classification

_INDEX_HINT = ("; y looks like class indices: one-hot encode it along the last axis (fluxpy.onehotbatch), or pass "
               "logits to logitcrossentropy(ŷ, y), which takes class indices")


def crossentropy(yhat: Array, y: Array, *, agg: Callable = mean, eps: float | None = None) -> Array:
    """The cross-entropy of probabilities ``ŷ`` against targets ``y``.

    ``agg(-sum(xlogy(y, ŷ + eps), axis=-1))`` with ``xlogy(y, p) = y log(p)``, and 0 where ``y == 0``.
    ``agg=mean`` by default; ``eps`` defaults to the machine epsilon of ``ŷ``'s dtype.

    ``ŷ`` are probabilities in [0, 1] (e.g. a softmax output) with classes on the last axis; ``y``
    are one-hot or soft targets in [0, 1] (values checked as the module docstring says). Prefer
    :func:`logitcrossentropy` on logits: it is more stable.

    >>> import numpy as np
    >>> round(float(crossentropy(np.array([[0.25, 0.75]]), np.array([[0.0, 1.0]]))), 4)
    0.2877
    """
    _check_options("crossentropy", agg, eps)
    y = _check("crossentropy", yhat, y, classes=True, labels_hint=_INDEX_HINT, targets=_TARGETS,
               probabilities="; for logits use logitcrossentropy(ŷ, y), or apply softmax first")
    return _crossentropy(yhat, y, agg, eps)


def _crossentropy(yhat, y, agg, eps):
    return _aggregate(agg, -_sum(_xlogy(y, yhat + _eps(yhat, eps)), axis=-1))


def _check_labels(yhat, labels):
    """Raise unless the class indices ``labels`` lie in ``[0, classes)``, under the value-check policy (unchecked, a
    bad index makes its row of the loss NaN)."""
    classes = _shape(yhat)[-1]
    _check_not_empty("logitcrossentropy", yhat, True)
    if _values_checked(labels) and labels.size:
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= classes:
            raise ValueError(f"logitcrossentropy expects class indices in [0, {classes}) (ŷ has {classes} classes on "
                             f"its last axis), got values from {lo} to {hi} in {_describe('y', labels)}")


def _label_loss(yhat, labels, agg, alpha, weight, ignore_index):
    """The loss against class indices, one fused op that never builds the one-hot targets; ``agg=mean`` with weights
    or ignored examples is PyTorch's weighted mean."""
    xp = get_array_module(labels)
    kept = kept_labels = None
    if ignore_index is not None:
        ignore_index = _index("logitcrossentropy", "ignore_index", ignore_index)
        kept = labels != ignore_index
        kept_labels = xp.where(kept, labels, 0)   # the ignored examples' (any class: their rows are 0)
    _check_labels(yhat, labels if kept is None else kept_labels)
    shape = _shape(yhat)
    if len(shape) == 2:
        rows = logit_crossentropy_labels(yhat, labels, smoothing=alpha, weight=weight, ignore_index=ignore_index)
    else:   # (..., C), or one example: one row per leading index
        rows = logit_crossentropy_labels(reshape(yhat, (-1, shape[-1])), labels.reshape(-1), smoothing=alpha,
                                         weight=weight, ignore_index=ignore_index)
        rows = reshape(rows, shape[:-1])
    if agg is mean and (weight is not None or kept is not None):
        dtype = value_of(yhat).dtype
        counted = weight[labels if kept is None else kept_labels] if weight is not None else dtype.type(1)
        if kept is not None:
            counted = counted * kept.astype(dtype)
        return _sum(rows) / xp.broadcast_to(counted, labels.shape).sum()
    return _aggregate(agg, rows)


def _smoothed(y, alpha, classes):
    return y if alpha == 0 else y * (1 - alpha) + alpha / classes


def logitcrossentropy(yhat: Array, y: Array, *, agg: Callable = mean, label_smoothing: float = 0.0,
                      weight: Array | None = None, ignore_index: int | None = None, axis: int = -1) -> Array:
    """The cross-entropy computed from logits: ``agg(-sum(y * logsoftmax(ŷ), axis=-1))``.

    ``crossentropy(softmax(ŷ), y)`` computed stably from logits ``ŷ`` of shape ``(..., classes)``.
    ``y`` is either one-hot or soft targets of the same shape, in [0, 1] (PyTorch's
    ``cross_entropy`` with probability targets), or integer class indices of shape ``ŷ.shape[:-1]``
    with values in ``[0, classes)`` (PyTorch's ``cross_entropy(logits, target)``: one fused op,
    :func:`fluxpy.ops.crossentropy.logit_crossentropy_labels`, that never builds one-hot targets). ``agg=mean`` by
    default.
    ``label_smoothing=alpha`` in [0, 1) smooths the targets towards the uniform distribution first,
    ``y (1 - alpha) + alpha / classes``, as :func:`label_smoothing` and PyTorch's keyword.

    PyTorch's ``weight`` and ``ignore_index``: ``weight``, a ``(classes,)`` array, weighs each class's term
    (``-sum(weight * y * logsoftmax(ŷ))`` per example); ``ignore_index``, with class-index targets only, drops the
    examples of that label. With class indices and ``agg=mean`` the mean is PyTorch's weighted one: the sum of the
    examples' losses over the sum of their classes' weights (the count of examples kept, without ``weight``; NaN
    where every example is ignored). With probability targets ``mean`` divides by the number of examples.

    ``axis`` is the class axis (Flux's ``dims``): ``axis=1`` takes PyTorch's ``(N, C, H, W)`` segmentation logits with
    ``(N, H, W)`` class indices or ``(N, C, H, W)`` probability targets.

    >>> import numpy as np
    >>> l = logitcrossentropy(np.array([[0.0, np.log(3.0)], [5.0, 0.0]]), np.array([1, -100]), ignore_index=-100)
    >>> round(float(l), 4)
    0.2877
    >>> round(float(logitcrossentropy(np.array([[0.0, np.log(3.0)]]), np.array([[0, 1]]))), 4)
    0.2877
    >>> round(float(logitcrossentropy(np.array([[0.0, np.log(3.0)]]), np.array([1]))), 4)
    0.2877
    >>> logitcrossentropy(np.zeros((2, 3)), np.array([0, 3]))
    Traceback (most recent call last):
    ...
    ValueError: logitcrossentropy expects class indices in [0, 3) (ŷ has 3 classes on its last axis), \
got values from 0 to 3 in y of shape (2,) int64
    """
    _check_options("logitcrossentropy", agg)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real) or \
            not 0 <= label_smoothing < 1:
        raise ValueError(f"logitcrossentropy expects label_smoothing in [0, 1), got {label_smoothing!r}")
    yhat, y = _classes_last(yhat, y, axis)
    shape = _shape(yhat)
    weight = _class_weights(yhat, weight)
    if _is_labels(yhat, y):
        return _label_loss(yhat, value_of(y), agg, label_smoothing, weight, ignore_index)
    if ignore_index is not None:
        raise ValueError("logitcrossentropy: ignore_index applies to class-index targets, got targets of ŷ's shape "
                         f"{shape} (zero the rows to drop instead)")
    y = _check("logitcrossentropy", yhat, y, classes=True, targets=_TARGETS)
    y = _smoothed(y, label_smoothing, shape[-1])
    if weight is not None:
        y = y * weight
    return _aggregate(agg, _rows(yhat, y, shape))


def _classes_last(yhat, y, axis):
    """``ŷ`` (and probability targets of its shape) with the class ``axis`` moved last; class indices unchanged."""
    ndim = len(_shape(yhat))
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not -max(ndim, 1) <= axis < max(ndim, 1):
        raise ValueError(f"logitcrossentropy expects axis, the class axis of ŷ, in [-{ndim}, {ndim}), got {axis!r} "
                         f"for {_describe('ŷ', yhat)}")
    axis = int(axis) % max(ndim, 1)
    if axis == ndim - 1 or ndim == 0:
        return yhat, y
    order = [a for a in range(ndim) if a != axis] + [axis]
    same = _shape(y) == _shape(yhat)
    return transpose(yhat, order), (transpose(y, order) if same else y)


def _rows(yhat, y, shape):
    """The cross-entropy of each example (``shape[:-1]``) from logits ``yhat`` and targets ``y`` of ``shape``."""
    if len(shape) == 2:
        return logit_crossentropy_rows(yhat, y)
    if len(shape) > 2:   # (..., C): one row per leading index
        rows = logit_crossentropy_rows(reshape(yhat, (-1, shape[-1])), reshape(y, (-1, shape[-1])))
        return reshape(rows, shape[:-1])
    rows = logit_crossentropy_rows(reshape(yhat, (1, -1)), reshape(y, (1, -1)))   # one example: one row
    return reshape(rows, ())


def _class_weights(yhat, weight):
    """``weight`` as a ``(classes,)`` array of ŷ's dtype on its device, checked; None stays None."""
    if weight is None:
        return None
    v, classes = value_of(yhat), _shape(yhat)[-1]
    w = value_of(weight)
    if not hasattr(w, "shape"):
        w = np.asarray(w)
    if tuple(w.shape) != (classes,) or not (is_float_dtype(w.dtype) or np.dtype(w.dtype).kind in "iu"):
        raise ValueError(f"logitcrossentropy expects weight, a ({classes},) array of class weights (ŷ has {classes} "
                         f"classes on its last axis), got {_describe('weight', w)}")
    return get_array_module(v).asarray(w, dtype=v.dtype)


def _index(who, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{who} expects {name} to be an int (a class index), got {value!r}")
    return int(value)


def binarycrossentropy(yhat: Array, y: Array, *, agg: Callable = mean, eps: float | None = None,
                       weight: Array | None = None) -> Array:
    """The binary cross-entropy: ``agg(weight * (-xlogy(y, ŷ + eps) - xlogy(1 - y, 1 - ŷ + eps)))``.

    ``ŷ`` are probabilities in [0, 1] (e.g. a sigmoid output), ``y`` targets in [0, 1]; elementwise,
    no class axis. ``agg=mean`` and ``eps`` (machine epsilon) by default, as :func:`crossentropy`. ``weight``
    (PyTorch's): an array that broadcasts to ``ŷ``'s shape, multiplying each entry's loss (the mean stays over the
    entries, as PyTorch's). Prefer :func:`logitbinarycrossentropy` on logits.

    >>> import numpy as np
    >>> round(float(binarycrossentropy(np.array([0.75]), np.array([1.0]))), 4)
    0.2877
    """
    _check_options("binarycrossentropy", agg, eps)
    y = _check("binarycrossentropy", yhat, y, targets="binary targets",
               probabilities="; for logits use logitbinarycrossentropy(ŷ, y), or apply sigmoid first")
    weight = _entry_weights("binarycrossentropy", "weight", yhat, weight)
    e = _eps(yhat, eps)
    losses = -_xlogy(y, yhat + e) - _xlogy(1 - y, 1 - yhat + e)
    return _aggregate(agg, losses if weight is None else weight * losses)


def logitbinarycrossentropy(yhat: Array, y: Array, *, agg: Callable = mean, weight: Array | None = None,
                            pos_weight: Array | None = None) -> Array:
    """The binary cross-entropy computed from logits: ``agg((1 - y) ŷ + softplus(-ŷ))``.

    ``agg=mean`` by default. ``binarycrossentropy(sigmoid(ŷ), y)`` computed stably from logits
    (``-log sigmoid(ŷ) = softplus(-ŷ)``), targets ``y`` in [0, 1]; PyTorch's
    ``binary_cross_entropy_with_logits``, with its ``weight`` (broadcast to ``ŷ``'s shape, multiplying each entry's
    loss) and ``pos_weight`` (broadcast likewise, usually one per class on the last axis: the positive term's weight,
    ``pos_weight * y * softplus(-ŷ) + (1 - y) * softplus(ŷ)``, to weigh rare positives up).

    >>> import numpy as np
    >>> round(float(logitbinarycrossentropy(np.array([0.0]), np.array([1.0]))), 4)
    0.6931
    >>> round(float(logitbinarycrossentropy(np.array([0.0]), np.array([1.0]), pos_weight=np.array([3.0]))), 4)
    2.0794
    """
    _check_options("logitbinarycrossentropy", agg)
    y = _check("logitbinarycrossentropy", yhat, y, targets="binary targets")
    weight = _entry_weights("logitbinarycrossentropy", "weight", yhat, weight)
    pos_weight = _entry_weights("logitbinarycrossentropy", "pos_weight", yhat, pos_weight)
    if pos_weight is None:
        losses = (1 - y) * yhat + softplus(-yhat)
    else:   # -log sigmoid(ŷ) = softplus(-ŷ), -log(1 - sigmoid(ŷ)) = ŷ + softplus(-ŷ)
        losses = (pos_weight * y + (1 - y)) * softplus(-yhat) + (1 - y) * yhat
    return _aggregate(agg, losses if weight is None else weight * losses)


def _entry_weights(who, name, yhat, weight):
    """``weight`` as an array of ŷ's dtype on its device that broadcasts to ŷ's shape, checked; None stays None."""
    if weight is None:
        return None
    v, w = value_of(yhat), value_of(weight)
    if not hasattr(w, "shape"):
        w = np.asarray(w)
    shape = _shape(yhat)
    try:
        fits = np.broadcast_shapes(tuple(w.shape), shape) == shape
    except ValueError:
        fits = False
    if not fits or np.dtype(w.dtype).kind not in "fiu":
        raise ValueError(f"{who} expects {name}, a real array that broadcasts to ŷ's shape {shape}, got "
                         f"{_describe(name, w)}")
    if is_tracked(weight):
        return weight
    return get_array_module(v).asarray(w, dtype=v.dtype)


def kldivergence(yhat: Array, y: Array, *, agg: Callable = mean, eps: float | None = None) -> Array:
    """The Kullback-Leibler divergence of the distribution ``ŷ`` from the target ``y``.

    ``agg(sum(xlogy(y, y), axis=-1)) + crossentropy(ŷ, y; agg, eps)``, classes on the last axis, with
    ``agg`` and ``eps`` as :func:`crossentropy`; 0 when the two agree (up to ``eps``). Both are
    probabilities, in [0, 1].

    >>> import numpy as np
    >>> p = np.array([[0.25, 0.75]])
    >>> abs(float(kldivergence(p, p, eps=0.0))) < 1e-15
    True
    """
    _check_options("kldivergence", agg, eps)
    y = _check("kldivergence", yhat, y, classes=True, labels_hint=_INDEX_HINT, targets=_PROBABILITIES,
               probabilities="; apply softmax to logits first")
    entropy = _aggregate(agg, _sum(_xlogy(y, y), axis=-1))
    return entropy + _crossentropy(yhat, y, agg, eps)


def label_smoothing(y: Array, alpha: float, axis: int | None = -1) -> Array:
    """Targets smoothed towards the uniform distribution: ``y (1 - alpha) + alpha / size(y, axis)``.

    Smooths one-hot targets with classes on ``axis`` (the last by default); ``axis=None`` smooths
    binary targets (``y (1 - alpha) + alpha / 2``). ``alpha`` must lie in (0, 1). Flux's
    ``label_smoothing`` (``dims=1`` and ``dims=0``). For class indices, use
    ``logitcrossentropy(ŷ, labels, label_smoothing=alpha)``.

    >>> import numpy as np
    >>> label_smoothing(np.array([[0.0, 1.0, 0.0, 0.0]]), 0.2)
    array([[0.05, 0.85, 0.05, 0.05]])
    >>> label_smoothing(np.array([0.0, 1.0]), 0.2, axis=None)
    array([0.1, 0.9])
    """
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha < 1:
        raise ValueError(f"label_smoothing: alpha must lie in (0, 1), got {alpha!r}")
    shape = _shape(y)
    if axis is not None and not (isinstance(axis, (int, np.integer)) and -len(shape) <= axis < len(shape)):
        raise ValueError(f"label_smoothing: axis must be None or an axis of y, got {axis!r} for {_describe('y', y)}")
    n = 2 if axis is None else shape[axis]
    return y * (1 - alpha) + alpha / n


# ---------------------------------------------------------------------------------------------
# Flux's other losses (Flux src/losses/functions.jl), and xlogx / xlogy


def xlogx(x: Array) -> Array:
    """``x * log(x)``, and 0 where ``x == 0`` (Flux's ``xlogx``); NaN stays NaN.

    >>> import numpy as np
    >>> xlogx(np.array([0.0, 2.0])).round(4)
    array([0.    , 1.3863])
    """
    return _xlogy(x, x)


def xlogy(x: Array, y: Array) -> Array:
    """``x * log(y)``, and 0 where ``x == 0`` even if ``y == 0`` (Flux's ``xlogy``); a NaN in either gives NaN.

    >>> import numpy as np
    >>> xlogy(np.array([0.0, 2.0]), np.array([0.0, 3.0])).round(4)
    array([0.    , 2.1972])
    """
    return _xlogy(x, y)


def msle(yhat: Array, y: Array, *, agg: Callable = mean, eps: float | None = None) -> Array:
    """The mean squared logarithmic error, ``agg(log((ŷ + eps) / (y + eps))^2)``; ``eps`` the machine epsilon of
    ``ŷ``'s dtype by default. For positive targets.

    >>> import numpy as np
    >>> round(float(msle(np.array([345.0, 332.0, 789.0]), np.array([123.0, 456.0, 789.0]))), 6)
    0.38814
    """
    _check_options("msle", agg, eps)
    y = _check("msle", yhat, y)
    e = _eps(yhat, eps)
    r = basic.log((yhat + e) / (y + e))
    return _aggregate(agg, r * r)


def poisson_loss(yhat: Array, y: Array, *, agg: Callable = mean) -> Array:
    """The Poisson loss ``agg(ŷ - xlogy(y, ŷ))``: ``ŷ`` the predicted rate, ``y`` the observed counts.

    >>> import numpy as np
    >>> round(float(poisson_loss(np.array([0.4, 0.5, 0.6]), np.array([0.1, 0.2, 0.3]))), 6)
    0.627835
    """
    _check_options("poisson_loss", agg)
    y = _check("poisson_loss", yhat, y)
    return _aggregate(agg, yhat - _xlogy(y, yhat))


def hinge_loss(yhat: Array, y: Array, *, agg: Callable = mean) -> Array:
    """The hinge loss ``agg(max(0, 1 - ŷ y))``, targets ``y`` in {-1, 1}.

    >>> import numpy as np
    >>> float(hinge_loss(np.array([0.5, 2.0]), np.array([1.0, 1.0])))
    0.25
    """
    _check_options("hinge_loss", agg)
    y = _check("hinge_loss", yhat, y)
    return _aggregate(agg, basic.maximum(1 - yhat * y, 0))


def squared_hinge_loss(yhat: Array, y: Array, *, agg: Callable = mean) -> Array:
    """The squared hinge loss ``agg(max(0, 1 - ŷ y)^2)``, targets ``y`` in {-1, 1}.

    >>> import numpy as np
    >>> float(squared_hinge_loss(np.array([0.5, 2.0]), np.array([1.0, 1.0])))
    0.125
    """
    _check_options("squared_hinge_loss", agg)
    y = _check("squared_hinge_loss", yhat, y)
    h = basic.maximum(1 - yhat * y, 0)
    return _aggregate(agg, h * h)


def _smooth_number(name, what, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name} expects {what} to be a number, got {v!r}")
    return v


def dice_coeff_loss(yhat: Array, y: Array, *, smooth: float = 1.0) -> Array:
    """The Dice loss for segmentation, ``1 - (2 sum(y ŷ) + smooth) / (sum(y^2) + sum(ŷ^2) + smooth)`` over the
    whole arrays (no ``agg``: one number per call, as Flux's).

    >>> import numpy as np
    >>> round(float(dice_coeff_loss(np.array([0.0, 1.4, 0.5, 1.2]), np.array([1.0, 0.5, 0.3, 2.4]))), 4)
    0.28
    """
    _smooth_number("dice_coeff_loss", "smooth", smooth)
    y = _check("dice_coeff_loss", yhat, y)
    return 1 - (2 * _sum(y * yhat) + smooth) / (_sum(y * y) + _sum(yhat * yhat) + smooth)


def tversky_loss(yhat: Array, y: Array, *, beta: float = 0.7) -> Array:
    """The Tversky loss, ``1 - (sum(y ŷ) + 1) / (sum(y ŷ + beta (1 - y) ŷ + (1 - beta) y (1 - ŷ)) + 1)`` over the
    whole arrays; ``beta`` weighs false positives against false negatives (0.5: the Dice loss without squares).

    >>> import numpy as np
    >>> round(float(tversky_loss(np.array([0.0, 1.4, 0.5, 1.2]), np.array([1.0, 0.5, 0.3, 2.4]))), 6)
    -0.06772
    """
    _smooth_number("tversky_loss", "beta", beta)
    y = _check("tversky_loss", yhat, y)
    num = _sum(y * yhat) + 1
    den = _sum(y * yhat + beta * (1 - y) * yhat + (1 - beta) * y * (1 - yhat)) + 1
    return 1 - num / den


def binary_focal_loss(yhat: Array, y: Array, *, agg: Callable = mean, gamma: float = 2,
                      eps: float | None = None) -> Array:
    """The binary focal loss (Lin et al. 2017): ``agg(-(1 - p_t)^gamma log(p_t))`` with
    ``p_t = y (ŷ + eps) + (1 - y) (1 - ŷ - eps)``; ``gamma = 0`` gives the binary cross-entropy. ``ŷ``
    probabilities, ``y`` binary targets, elementwise.

    >>> import numpy as np
    >>> round(float(binary_focal_loss(np.array([[0.6, 0.3], [0.4, 0.7]]), np.array([[1, 0], [0, 1]]))), 6)
    0.056916
    """
    _check_options("binary_focal_loss", agg, eps)
    _smooth_number("binary_focal_loss", "gamma", gamma)
    y = _check("binary_focal_loss", yhat, y, targets="binary targets",
               probabilities="; apply sigmoid to logits first")
    p = yhat + _eps(yhat, eps)
    p_t = y * p + (1 - y) * (1 - p)
    return _aggregate(agg, -((1 - p_t) ** gamma) * basic.log(p_t))


def focal_loss(yhat: Array, y: Array, *, agg: Callable = mean, gamma: float = 2, eps: float | None = None) -> Array:
    """The focal loss of probabilities over classes on the last axis:
    ``agg(sum(-y (1 - ŷ - eps)^gamma log(ŷ + eps), axis=-1))``; ``gamma = 0`` gives :func:`crossentropy`.

    >>> import numpy as np
    >>> round(float(focal_loss(np.array([[0.4, 0.5, 0.1], [0.2, 0.5, 0.3]]), np.array([[1, 0, 0], [0, 0, 1]]))), 6)
    0.459906
    """
    _check_options("focal_loss", agg, eps)
    _smooth_number("focal_loss", "gamma", gamma)
    y = _check("focal_loss", yhat, y, classes=True, labels_hint=_INDEX_HINT, targets=_TARGETS,
               probabilities="; apply softmax to logits first")
    p = yhat + _eps(yhat, eps)
    return _aggregate(agg, _sum(-y * (1 - p) ** gamma * basic.log(p), axis=-1))


def siamese_contrastive_loss(yhat: Array, y: Array, *, agg: Callable = mean, margin: float = 1.0) -> Array:
    """The contrastive loss of siamese networks, ``agg((1 - y) ŷ^2 + y max(0, margin - ŷ)^2)``: ``ŷ`` distances,
    ``y`` 1 for dissimilar pairs and 0 for similar ones; ``margin >= 0``.

    >>> import numpy as np
    >>> round(float(siamese_contrastive_loss(np.array([0.6, 0.4, 0.1, 0.2, 0.7]), np.array([1, 0, 0, 1, 1]))), 4)
    0.212
    """
    _check_options("siamese_contrastive_loss", agg)
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not margin >= 0:
        raise ValueError(f"siamese_contrastive_loss expects margin >= 0, got {margin!r}")
    y = _check("siamese_contrastive_loss", yhat, y)
    h = basic.maximum(margin - yhat, 0)
    return _aggregate(agg, (1 - y) * yhat * yhat + y * h * h)
