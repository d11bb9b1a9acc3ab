"""More losses, re-exported by :mod:`fluxpy.losses` (``fluxpy.losses.ctc_loss`` and ``fluxpy.ctc_loss`` both work):
Flux's ``ctc_loss``, and PyTorch's ``smooth_l1_loss``, ``nll_loss``, ``margin_ranking_loss``,
``triplet_margin_loss``, ``cosine_embedding_loss`` and ``gaussian_nll_loss`` with PyTorch's formulas.

They follow :mod:`fluxpy.losses`' conventions: the prediction first, the reduction as ``agg`` (default the mean;
``sum`` or ``lambda l: l`` for the unreduced losses: PyTorch's ``reduction="sum"`` and ``"none"``), shapes checked
always and values (class indices, labels, variances) under the ``value_checks`` option (on NumPy arrays by default,
never a host sync on the GPU unless asked); an error names the loss and says what it expected and what it got.

>>> import numpy as np
>>> float(smooth_l1_loss(np.array([0.5, 3.0]), np.zeros(2)))    # (0.125 + 2.5) / 2
1.3125
>>> nll_loss(np.log(np.array([[0.25, 0.75]])), np.array([2]))
Traceback (most recent call last):
...
ValueError: nll_loss expects class indices in [0, 2) (ŷ has 2 classes on axis -1), got values from 2 to 2 in y of \
shape (1,) int64
"""
from __future__ import annotations

import builtins
import math
import numbers
from collections.abc import Callable

import numpy as np

from .autodiff import Primitive, value_of
from .backend import Array, get_array_module, is_array, is_float_dtype
from .kernels.halfs import is_half
from .options import options
from .ops import basic
from .ops.activations import softplus
from .ops.linalg import matmul
from .ops.reduce import max as _max
from .ops.reduce import mean
from .ops.reduce import sum as _sum
from .ops.shape import reshape, transpose

__all__ = ["ctc_loss", "smooth_l1_loss", "nll_loss", "margin_ranking_loss", "triplet_margin_loss",
           "cosine_embedding_loss", "gaussian_nll_loss", "soft_margin_loss", "hinge_embedding_loss",
           "multilabel_soft_margin_loss", "multi_margin_loss"]


# ---------------------------------------------------------------------------------------------
# Checks (the policy of fluxpy.losses: shapes always, values under options.value_checks)


def _values_checked(v) -> bool:
    policy = options.value_checks
    return isinstance(v, np.ndarray) if policy == "auto" else bool(policy) and is_array(v)


def _shape(a) -> tuple:
    return tuple(getattr(value_of(a), "shape", ()))


def _describe(label, a) -> str:
    v = value_of(a)
    if not hasattr(v, "shape"):
        return f"{label} a {type(v).__name__}"
    return f"{label} of shape {tuple(v.shape)} {v.dtype}"


def _aggregate(name, agg, losses):
    if not callable(agg):
        raise TypeError(f"{name} expects agg to be a function such as fluxpy.mean, sum or lambda l: l, got {agg!r}")
    return _sum(losses) if agg is builtins.sum else agg(losses)   # the builtin would iterate over the rows


def _number(name, what, v, test=lambda v: True, expected="a number"):
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not test(v):
        raise ValueError(f"{name} expects {what} to be {expected}, got {v!r}")
    return float(v)


def _float_input(name, label, a):
    v = value_of(a)
    if not is_array(v) or not is_float_dtype(v.dtype):
        raise TypeError(f"{name} expects {label} to be a float array, got {_describe(label, a)}")


def _same_shapes(name, **arrays):
    shapes = {k: _shape(a) for k, a in arrays.items()}
    if len(set(shapes.values())) > 1:
        said = ", ".join(f"{k} {s}" for k, s in shapes.items())
        raise ValueError(f"{name} expects {', '.join(arrays)} of one shape, got {said}")
    if math.prod(next(iter(shapes.values()))) == 0:
        first = next(iter(arrays))
        raise ValueError(f"{name} expects a non-empty batch, got {_describe(first, arrays[first])}")


def _as_dtype_of(y, like):
    """An integer or boolean target as ``like``'s float dtype (what the arithmetic needs)."""
    v = value_of(y)
    return y.astype(value_of(like).dtype) if is_array(v) and v.dtype.kind in "biu" else y


def _range_text(v) -> str:
    return f"values from {v.min()} to {v.max()}"


# ---------------------------------------------------------------------------------------------
# Regression


def smooth_l1_loss(yhat: Array, y: Array, *, agg: Callable = mean, beta: float = 1.0) -> Array:
    """PyTorch's smooth L1 loss: ``0.5 d^2 / beta`` where ``|d| < beta``, else ``|d| - beta / 2``, ``d = ŷ - y``,
    reduced by ``agg`` (the mean by default).

    ``beta >= 0``; ``beta = 0`` is the L1 loss (:func:`fluxpy.mae`). For ``beta > 0`` it is
    ``huber_loss(ŷ, y, delta=beta) / beta``: the Huber loss scaled to slope 1 (PyTorch's ``smooth_l1_loss`` and
    ``huber_loss`` relate the same way).

    >>> import numpy as np
    >>> smooth_l1_loss(np.array([0.5, 3.0]), np.zeros(2), beta=2.0, agg=lambda l: l)
    array([0.0625, 2.    ])
    """
    beta = _number("smooth_l1_loss", "beta", beta, lambda v: v >= 0, "a number >= 0")
    _same_shapes("smooth_l1_loss", ŷ=yhat, y=y)
    err = basic.abs(yhat - _as_dtype_of(y, yhat))
    if beta == 0:
        return _aggregate("smooth_l1_loss", agg, err)
    small = value_of(err) < beta
    return _aggregate("smooth_l1_loss", agg, basic.where(small, 0.5 * err * err / beta, err - 0.5 * beta))


def gaussian_nll_loss(yhat: Array, y: Array, var: Array | float, *, full: bool = False, eps: float = 1e-6,
                      agg: Callable = mean) -> Array:
    """PyTorch's Gaussian negative log-likelihood: ``0.5 (log(max(var, eps)) + (ŷ - y)^2 / max(var, eps))``, plus
    ``0.5 log(2 pi)`` with ``full``, reduced by ``agg`` (the mean over every entry by default).

    ``ŷ`` the predicted means and ``y`` the targets, of one shape; ``var`` the predicted variances, ``>= 0``: of
    ``ŷ``'s shape (one per entry), of ``ŷ.shape[:-1]`` or with a last axis of 1 (one per row, shared by its
    entries), or a number. As PyTorch, the clamp at ``eps`` passes the gradient through unchanged.

    >>> import numpy as np
    >>> round(float(gaussian_nll_loss(np.array([1.0, 2.0]), np.array([1.0, 4.0]), np.array([1.0, 2.0]))), 6)
    0.673287
    """
    name = "gaussian_nll_loss"
    eps = _number(name, "eps", eps, lambda v: v >= 0, "a number >= 0")
    if not isinstance(full, bool):
        raise TypeError(f"{name} expects full to be True or False, got {full!r}")
    _same_shapes(name, ŷ=yhat, y=y)
    var = _variances(name, yhat, var)
    v = value_of(var)
    if _values_checked(v) and bool((v < 0).any()):
        raise ValueError(f"{name} expects var >= 0 (variances), got {_range_text(v)} in {_describe('var', v)}")
    # max(var, eps) whose gradient is 1 everywhere, as PyTorch's clamp under no_grad: var - var is an exact zero
    clamped = basic.where(v < eps, (var - v) + eps, var)
    d = yhat - _as_dtype_of(y, yhat)
    loss = 0.5 * (basic.log(clamped) + d * d / clamped)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return _aggregate(name, agg, loss)


def _variances(name, yhat, var):
    """``var`` shaped to broadcast against ``ŷ`` by PyTorch's rules, or an error."""
    shape = _shape(yhat)
    if isinstance(var, numbers.Real) and not isinstance(var, bool):
        v = value_of(yhat)
        return get_array_module(v).full(shape, var, v.dtype)
    _float_input(name, "var", var)
    got = _shape(var)
    if got == shape or (len(shape) >= 1 and len(got) == len(shape) and got[:-1] == shape[:-1] and got[-1] == 1):
        return var
    if len(shape) >= 1 and got == shape[:-1]:
        return reshape(var, got + (1,))
    raise ValueError(f"{name} expects var of ŷ's shape {shape}, of {shape[:-1]} or {shape[:-1] + (1,)} (one "
                     f"variance per row), or a number, got {_describe('var', var)}")


# ---------------------------------------------------------------------------------------------
# Classification: negative log-likelihood


def nll_loss(yhat: Array, y: Array, *, weight: Array | None = None, ignore_index: int | None = None,
             agg: Callable = mean, axis: int = -1) -> Array:
    """The negative log-likelihood of log-probabilities ``ŷ`` (e.g. from :func:`fluxpy.logsoftmax`) at the class
    indices ``y``: ``-weight[y] ŷ[..., y]`` per example (PyTorch's ``nll_loss``), reduced by ``agg``.

    ``ŷ`` has the classes on ``axis`` (the last by default, as fluxpy's ``(batch, classes)``; ``axis=1`` takes
    PyTorch's ``(N, C, d1, ...)``); ``y`` holds integer class indices in ``[0, classes)`` of ``ŷ``'s shape without
    that axis. ``weight``, a ``(classes,)`` array, weighs each class; ``ignore_index`` (PyTorch's default is -100,
    here None: no label is dropped) drops the examples of that label. With ``agg=mean`` the mean is PyTorch's
    weighted one: the sum of the examples' losses over the sum of their weights (the count of examples kept,
    without ``weight``; NaN where every example is ignored). ``nll_loss(logsoftmax(z), y)`` is
    ``logitcrossentropy(z, y)``.

    >>> import numpy as np
    >>> logp = np.log(np.array([[0.25, 0.75], [0.5, 0.5]]))
    >>> round(float(nll_loss(logp, np.array([1, 0]))), 4)     # -(log 0.75 + log 0.5) / 2
    0.4904
    >>> round(float(nll_loss(logp, np.array([1, -100]), ignore_index=-100)), 4)
    0.2877
    """
    name = "nll_loss"
    _float_input(name, "ŷ", yhat)
    shape = _shape(yhat)
    if not shape:
        raise ValueError(f"{name} expects ŷ with a class axis, got a 0-d {_describe('ŷ', yhat)}")
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not -len(shape) <= axis < len(shape):
        raise ValueError(f"{name} expects axis, the class axis of ŷ, in [-{len(shape)}, {len(shape)}), got {axis!r} "
                         f"for {_describe('ŷ', yhat)}")
    axis = int(axis) % len(shape)
    classes = shape[axis]
    labels = value_of(y)
    rest = shape[:axis] + shape[axis + 1:]
    if not is_array(labels) or labels.dtype.kind not in "iu" or tuple(labels.shape) != rest:
        raise ValueError(f"{name} expects y, integer class indices of shape {rest} (ŷ's shape without its class "
                         f"axis {axis}), got {_describe('y', y)}")
    if math.prod(shape) == 0:
        raise ValueError(f"{name} expects a non-empty batch, got {_describe('ŷ', yhat)}")
    if axis != len(shape) - 1:
        yhat = transpose(yhat, [a for a in range(len(shape)) if a != axis] + [axis])
    xp, dtype = get_array_module(labels), value_of(yhat).dtype
    kept = None
    if ignore_index is not None:
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
            raise TypeError(f"{name} expects ignore_index to be an int (a class index), got {ignore_index!r}")
        kept = labels != int(ignore_index)
        labels = xp.where(kept, labels, 0)
    targets = _one_hot(name, labels, classes, dtype, axis - len(shape))
    w = _class_weights(name, weight, classes, value_of(yhat))
    if w is not None:
        targets = targets * w
    if kept is not None:
        targets = targets * kept[..., None].astype(dtype)
    rows = -_sum(yhat * targets, axis=-1)
    if agg is mean and (w is not None or kept is not None):
        counted = targets.sum()   # the sum of weight[y] over the examples kept
        with np.errstate(invalid="ignore", divide="ignore"):   # every example ignored: NaN, as PyTorch
            return _sum(rows) / counted
    return _aggregate(name, agg, rows)


def _one_hot(name, labels, classes, dtype, axis):
    """``(..., classes)`` one-hot rows; rows of NaN for indices outside [0, classes) when they are not checked."""
    xp = get_array_module(labels)
    if _values_checked(labels) and labels.size:
        if int(labels.min()) < 0 or int(labels.max()) >= classes:
            raise ValueError(f"{name} expects class indices in [0, {classes}) (ŷ has {classes} classes on axis "
                             f"{axis}), got {_range_text(labels)} in {_describe('y', labels)}")
        return (labels[..., None] == xp.arange(classes)).astype(dtype)
    unsigned = labels.astype(np.int64, copy=False).view(np.uint64)   # a negative index becomes a huge one
    hot = (unsigned[..., None] == xp.arange(classes, dtype=np.uint64)).astype(dtype)
    with np.errstate(divide="ignore", invalid="ignore"):   # no host sync to look: a bad index poisons its row
        return hot / (unsigned < classes)[..., None]


def _class_weights(name, weight, classes, like):
    if weight is None:
        return None
    w = value_of(weight)
    w = w if hasattr(w, "shape") else np.asarray(w)
    if tuple(w.shape) != (classes,) or np.dtype(w.dtype).kind not in "fiu":
        raise ValueError(f"{name} expects weight, a ({classes},) array of class weights, got {_describe('weight', w)}")
    return get_array_module(like).asarray(w, dtype=like.dtype)


# ---------------------------------------------------------------------------------------------
# Pairs and triplets (metric learning)


def _plus_minus_one(name, y):
    v = value_of(y)
    if _values_checked(v) and bool(((v != 1) & (v != -1)).any()):
        raise ValueError(f"{name} expects y of 1 (similar) or -1 (dissimilar), got {_range_text(v)} in "
                         f"{_describe('y', v)}; 0/1 labels give y = 2 * labels - 1")


def margin_ranking_loss(x1: Array, x2: Array, y: Array, *, margin: float = 0.0, agg: Callable = mean) -> Array:
    """PyTorch's margin ranking loss, ``max(0, -y (x1 - x2) + margin)`` elementwise, reduced by ``agg``: ``y = 1``
    says ``x1`` should rank higher than ``x2`` (by ``margin``), ``y = -1`` lower (other labels are refused where
    values are checked). ``x1``, ``x2`` and ``y`` have one shape.

    >>> import numpy as np
    >>> margin_ranking_loss(np.array([0.2, 0.8]), np.array([0.5, 0.5]), np.array([1, 1]), margin=0.1, agg=lambda l: l)
    array([0.4, 0. ])
    """
    name = "margin_ranking_loss"
    margin = _number(name, "margin", margin)
    _same_shapes(name, x1=x1, x2=x2, y=y)
    _plus_minus_one(name, y)
    return _aggregate(name, agg, basic.maximum(margin - _as_dtype_of(y, x1) * (x1 - x2), 0))


def _rows_of_vectors(name, **arrays):
    """The shared shape of ``(N, D)`` rows or one ``(D,)`` vector, checked."""
    _same_shapes(name, **arrays)
    shape = _shape(next(iter(arrays.values())))
    if len(shape) not in (1, 2):
        raise ValueError(f"{name} expects {', '.join(arrays)} of shape (N, D) or (D,), got {shape}")
    return shape


def _distance(d, p):
    """``||d||_p`` over the last axis (``p`` a number > 0 or math.inf)."""
    if p == math.inf:
        return _max(basic.abs(d), axis=-1)
    if p == 2:
        return basic.sqrt(_sum(d * d, axis=-1))
    if p == 1:
        return _sum(basic.abs(d), axis=-1)
    return _sum(basic.abs(d) ** p, axis=-1) ** (1 / p)


def triplet_margin_loss(anchor: Array, positive: Array, negative: Array, *, margin: float = 1.0, p: float = 2,
                        eps: float = 1e-6, swap: bool = False, agg: Callable = mean) -> Array:
    """PyTorch's triplet margin loss, ``max(0, margin + d(a, p) - d(a, n))`` per row, reduced by ``agg``.

    ``d(u, v) = ||u - v + eps||_p`` over the last axis (PyTorch's ``pairwise_distance``; ``p > 0``, ``math.inf``
    for the largest entry). With ``swap`` (Balntas et al. 2016) ``d(a, n)`` is ``min(d(a, n), d(p, n))``. The
    three inputs are ``(N, D)`` rows or one ``(D,)`` vector.

    >>> import numpy as np
    >>> a, pos, neg = np.zeros((1, 2)), np.array([[3.0, 4.0]]), np.array([[6.0, 8.0]])
    >>> round(float(triplet_margin_loss(a, pos, neg, eps=0.0, margin=6.0)), 6)   # 6 + 5 - 10
    1.0
    """
    name = "triplet_margin_loss"
    margin = _number(name, "margin", margin)
    eps = _number(name, "eps", eps, lambda v: v >= 0, "a number >= 0")
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not p > 0:
        raise ValueError(f"{name} expects p to be a number > 0 (math.inf: the largest entry), got {p!r}")
    if not isinstance(swap, bool):
        raise TypeError(f"{name} expects swap to be True or False, got {swap!r}")
    _rows_of_vectors(name, anchor=anchor, positive=positive, negative=negative)
    d_pos = _distance(anchor - positive + eps, p)
    d_neg = _distance(anchor - negative + eps, p)
    if swap:
        d_neg = basic.minimum(d_neg, _distance(positive - negative + eps, p))
    return _aggregate(name, agg, basic.maximum(margin + d_pos - d_neg, 0))


_COSINE_EPS = 1e-12   # PyTorch's EPSILON in cosine_embedding_loss: added to each squared norm


def cosine_embedding_loss(x1: Array, x2: Array, y: Array, *, margin: float = 0.0, agg: Callable = mean) -> Array:
    """PyTorch's cosine embedding loss: ``1 - cos(x1, x2)`` where ``y = 1`` (similar pairs),
    ``max(0, cos(x1, x2) - margin)`` where ``y = -1``, per row, reduced by ``agg``.

    ``cos = sum(x1 x2) / sqrt((sum(x1^2) + 1e-12) (sum(x2^2) + 1e-12))`` over the last axis; ``x1`` and ``x2`` are
    ``(N, D)`` rows with ``y`` of shape ``(N,)``, or ``(D,)`` vectors with a 0-d ``y``. ``y`` must hold 1 or -1
    (checked as the module says; PyTorch gives a silent 0 for other labels).

    >>> import numpy as np
    >>> x1, x2 = np.array([[1.0, 0.0], [1.0, 1.0]]), np.array([[0.0, 1.0], [1.0, 1.0]])
    >>> cosine_embedding_loss(x1, x2, np.array([1, -1]), agg=lambda l: l).round(6)
    array([1., 1.])
    """
    name = "cosine_embedding_loss"
    margin = _number(name, "margin", margin)
    shape = _rows_of_vectors(name, x1=x1, x2=x2)
    if _shape(y) != shape[:-1]:
        raise ValueError(f"{name} expects y of shape {shape[:-1]} (one label per row of x1 and x2), got "
                         f"{_describe('y', y)}")
    _plus_minus_one(name, y)
    cos = _sum(x1 * x2, axis=-1) / basic.sqrt((_sum(x1 * x1, axis=-1) + _COSINE_EPS) *
                                              (_sum(x2 * x2, axis=-1) + _COSINE_EPS))
    labels = value_of(y)   # as PyTorch, a label that is neither 1 nor -1 (where unchecked) adds 0
    dissimilar = basic.where(labels == -1, basic.maximum(cos - margin, 0), 0)
    return _aggregate(name, agg, basic.where(labels == 1, 1 - cos, dissimilar))


# ---------------------------------------------------------------------------------------------
# Connectionist temporal classification


def ctc_loss(yhat: Array, y: Array, input_lengths=None, target_lengths=None, *, blank: int = 0,
             agg: Callable = mean, zero_infinity: bool = False) -> Array:
    """The connectionist temporal classification loss (Graves et al. 2006): ``-log p(y | ŷ)``, the probability of
    every alignment of the frames of ``ŷ`` that collapses to the target ``y`` (repeats merged, then blanks removed),
    per sequence, reduced by ``agg``.

    PyTorch's ``ctc_loss``: ``ŷ`` holds log-probabilities (e.g. :func:`fluxpy.logsoftmax` over the classes) of shape
    ``(T, N, C)`` (time, batch, classes) or ``(T, C)`` for one sequence; ``y`` the targets as ``(N, S)`` class
    indices padded to ``S`` (or ``(S,)`` for one sequence, or the ``N`` targets concatenated into one 1-d array);
    ``input_lengths`` the frames of each sequence (``<= T``, default ``T``), ``target_lengths`` the labels of each
    target (``<= S``, default ``S``); ``blank`` the blank's class index, which no target may hold.
    ``zero_infinity=True`` gives 0 (and a zero gradient) where no alignment exists (a target too long for its
    input), instead of ``inf``.

    The reduction is fluxpy's ``agg`` over the per-sequence losses (the mean by default); PyTorch's default
    ``reduction="mean"`` also divides each by its target length first:
    ``agg=lambda l: fluxpy.mean(l / np.maximum(target_lengths, 1))``. Flux's ``ctc_loss(ŷ, y)`` takes one sequence
    of logits, classes by time (Julia's column-major, so ``(T, C)`` here) with the blank last:
    ``ctc_loss(logsoftmax(ŷ), y, blank=C - 1)`` with 0-based labels.

    The forward-backward recursions run in log space, vectorised over the batch; the gradient with respect to ``ŷ``
    is the exact one, ``-(posterior of each class at each frame)`` (PyTorch's adds ``exp(ŷ)``, which is what the
    gradient through a preceding log-softmax needs, so the logits' gradients agree); it has no second derivative.

    >>> import numpy as np
    >>> logp = np.log(np.full((2, 2), 0.5))      # two frames, classes {blank, a}
    >>> round(float(ctc_loss(logp, np.array([1]))), 6)   # "a" from (a, a), (a, -), (-, a): -log(3/4)
    0.287682
    """
    name = "ctc_loss"
    _float_input(name, "ŷ", yhat)
    shape = _shape(yhat)
    if len(shape) not in (2, 3):
        raise ValueError(f"{name} expects ŷ of shape (T, N, C) (time, batch, classes) or (T, C), got "
                         f"{_describe('ŷ', yhat)}")
    single = len(shape) == 2
    frames, batch, classes = (shape[0], 1, shape[1]) if single else shape
    if isinstance(blank, bool) or not isinstance(blank, numbers.Integral) or not 0 <= blank < classes:
        raise ValueError(f"{name} expects blank, a class index, in [0, {classes}) (ŷ has {classes} classes), got "
                         f"{blank!r}")
    if not isinstance(zero_infinity, bool):
        raise TypeError(f"{name} expects zero_infinity to be True or False, got {zero_infinity!r}")
    xp = get_array_module(value_of(yhat))
    inputs = _lengths(name, "input_lengths", input_lengths, batch, frames, "T", xp)
    targets, lengths = _targets(name, y, target_lengths, batch, single, xp)
    _check_labels(name, targets, lengths, classes, int(blank))
    if single:
        yhat = reshape(yhat, (frames, 1, classes))
    losses = _ctc(yhat, targets, inputs, lengths, blank=int(blank), zero_infinity=zero_infinity)
    return _aggregate(name, agg, reshape(losses, ()) if single else losses)


def _as_ints(v):
    """``v`` as an integer array (a list becomes a NumPy one), or None where it holds no integers."""
    v = value_of(v)
    if not is_array(v):
        v = np.asarray(v)
    return v if v.dtype.kind in "iu" else None


def _lengths(name, what, given, batch, most, letter, xp):
    """``given`` lengths as a ``(batch,)`` int64 array on ``xp``'s device, each in ``[0, most]``; ``most`` where
    None."""
    if given is None:
        return xp.full(batch, most, np.int64)
    v = _as_ints(given)
    if v is None or tuple(v.shape) not in ((batch,),) + (((),) if batch == 1 else ()):
        raise ValueError(f"{name} expects {what}, {batch} integers (one per sequence), got {given!r}")
    if _values_checked(v) and v.size and (int(v.min()) < 0 or int(v.max()) > most):
        raise ValueError(f"{name} expects {what} in [0, {most}] ({letter} = {most}), got {_range_text(v)}")
    return xp.asarray(v.reshape(batch), dtype=np.int64)


def _targets(name, y, target_lengths, batch, single, xp):
    """The targets as ``(batch, S)`` int64 on ``xp``'s device and their lengths; from padded rows, one sequence's
    labels, or the batch's labels concatenated (which needs ``target_lengths``)."""
    v = _as_ints(y)
    if v is None or v.ndim not in (1, 2) or (single and v.ndim != 1):
        raise ValueError(f"{name} expects y, integer class indices of shape (N, S) or (S,) (or the targets "
                         f"concatenated), got {_describe('y', y) if hasattr(value_of(y), 'shape') else repr(y)}")
    if v.ndim == 1 and not single:   # the batch's targets concatenated
        if target_lengths is None and batch > 1:
            raise ValueError(f"{name} expects target_lengths with concatenated targets, got y of shape {v.shape}")
        lengths = _lengths(name, "target_lengths", target_lengths, batch, v.shape[0], "the labels given", xp)
        lengths = value_of(lengths)
        host = np.asarray(value_of(lengths).get() if hasattr(value_of(lengths), "get") else lengths)
        if int(host.sum()) != v.shape[0]:
            raise ValueError(f"{name} expects target_lengths summing to the {v.shape[0]} concatenated labels, got "
                             f"{host.tolist()}")
        starts = np.concatenate([[0], np.cumsum(host)[:-1]])
        width = int(host.max()) if host.size else 0
        index = np.minimum(starts[:, None] + np.arange(width), max(v.shape[0] - 1, 0))
        v = xp.asarray(v)[xp.asarray(index)] if v.shape[0] else xp.zeros((batch, width), np.int64)
        return xp.asarray(v, dtype=np.int64), lengths
    if v.ndim == 2 and v.shape[0] != batch:
        raise ValueError(f"{name} expects y with {batch} rows (one target per sequence of ŷ), got y of shape "
                         f"{tuple(v.shape)}")
    rows = xp.asarray(v, dtype=np.int64).reshape(batch, -1)
    return rows, _lengths(name, "target_lengths", target_lengths, batch, rows.shape[1], "S", xp)


def _check_labels(name, targets, lengths, classes, blank):
    if not _values_checked(targets) or not targets.size:
        return
    xp = get_array_module(targets)
    used = targets[xp.arange(targets.shape[1]) < lengths[:, None]]
    bad = used[(used < 0) | (used >= classes) | (used == blank)]
    if bad.size:
        raise ValueError(f"{name} expects target labels in [0, {classes}) other than the blank {blank}, got "
                         f"{bad[0]} in {_describe('y', targets)}")


def _logaddexp3(a, b, c, xp):
    top = xp.maximum(xp.maximum(a, b), c)
    top = xp.where(xp.isinf(top), 0, top)   # all -inf: stays -inf below, without inf - inf
    with np.errstate(divide="ignore"):
        return top + xp.log(xp.exp(a - top) + xp.exp(b - top) + xp.exp(c - top))


def _shift(a, by, xp):
    """``a`` moved ``by`` places along its last axis (right for by > 0), -inf where nothing comes in."""
    out = xp.full_like(a, -xp.inf)
    if by > 0:
        out[..., by:] = a[..., :-by]
    else:
        out[..., :by] = a[..., -by:]
    return out


class _Lattice:
    """The extended label sequences (blanks around and between the labels) of a batch, and what both recursions
    read: the emissions ``e[t, n, s]``, where a skip over a blank is allowed, the last positions of each target."""

    def __init__(self, lp, targets, inputs, lengths, blank):
        xp = get_array_module(lp)
        frames, batch, classes = lp.shape
        width = targets.shape[1]
        labels = xp.arange(width) < lengths[:, None]
        valid = labels & (targets >= 0) & (targets < classes) & (targets != blank)
        self.bad = xp.any(labels & ~valid, axis=1)     # unchecked bad labels: the sequence's loss is NaN
        targets = xp.where(valid, targets, blank)
        self.ext = xp.full((batch, 2 * width + 1), blank, np.int64)
        self.ext[:, 1::2] = targets
        self.e = xp.take_along_axis(lp, xp.broadcast_to(self.ext, (frames, *self.ext.shape)), axis=2)
        self.skip = xp.zeros(self.ext.shape, bool)
        self.skip[:, 3::2] = targets[:, 1:] != targets[:, :-1]
        s = xp.arange(self.ext.shape[1])
        self.end = (s == 2 * lengths[:, None]) | (s == 2 * lengths[:, None] - 1)
        self.inputs, self.lengths, self.xp = inputs, lengths, xp

    def alpha(self):
        """``alpha[t, n, s]``: log-probability of the prefixes through ``s`` at frame ``t`` (frozen after each
        sequence's last frame)."""
        xp, e = self.xp, self.e
        a = xp.full(e.shape, -xp.inf, e.dtype)
        first = xp.full(e.shape[1:], -xp.inf, e.dtype)
        first[:, 0] = e[0, :, 0]
        if e.shape[2] > 1:
            first[:, 1] = xp.where(self.lengths > 0, e[0, :, 1], -xp.inf)
        a[0] = xp.where((self.inputs > 0)[:, None], first, -xp.inf)
        for t in range(1, e.shape[0]):
            prev = a[t - 1]
            step = _logaddexp3(prev, _shift(prev, 1, xp), xp.where(self.skip, _shift(prev, 2, xp), -xp.inf), xp)
            a[t] = xp.where((t < self.inputs)[:, None], step + e[t], prev)
        return a

    def beta(self):
        """``beta[t, n, s]``: log-probability of the suffixes from ``s`` at frame ``t`` (emission at ``t`` included),
        -inf after each sequence's last frame."""
        xp, e = self.xp, self.e
        b = xp.full(e.shape, -xp.inf, e.dtype)
        skip_next = _shift(self.skip.astype(e.dtype), -2, xp) > 0   # from s, a skip to s + 2 is allowed
        nxt = xp.full(e.shape[1:], -xp.inf, e.dtype)
        for t in range(e.shape[0] - 1, -1, -1):
            step = _logaddexp3(nxt, _shift(nxt, -1, xp), xp.where(skip_next, _shift(nxt, -2, xp), -xp.inf), xp)
            last = (t == self.inputs - 1)[:, None]
            inside = (t < self.inputs - 1)[:, None]
            b[t] = xp.where(last, xp.where(self.end, e[t], -xp.inf), xp.where(inside, step + e[t], -xp.inf))
            nxt = b[t]
        return b

    def log_likelihood(self, a):
        """``log p(y_n | x_n)`` from the last frame's ``alpha``; NaN for a sequence with bad labels."""
        xp = self.xp
        last = a[-1]
        total = xp.where(self.end, last, -xp.inf)
        top = xp.max(total, axis=1)
        top = xp.where(xp.isinf(top), 0, top)
        with np.errstate(divide="ignore"):
            ll = top + xp.log(xp.exp(total - top[:, None]).sum(axis=1))
        empty = self.inputs == 0   # no frame: only the empty target, with probability 1
        ll = xp.where(empty, xp.where(self.lengths == 0, 0.0, -xp.inf), ll)
        return xp.where(self.bad, xp.nan, ll)

    def gradient(self, a, b, ll, classes):
        """d(-ll_n)/d lp[t, n, c] = -sum over s with ext[n, s] = c of exp(alpha + beta - e - ll)."""
        xp = self.xp
        with np.errstate(invalid="ignore", over="ignore"):
            post = xp.exp(a + b - self.e - ll[None, :, None])        # (T, N, L): the occupancy of each position
        post = xp.where(xp.isnan(post) & ~xp.isnan(ll)[None, :, None], 0, post)   # -inf - -inf where unreachable
        hot = (self.ext[..., None] == xp.arange(classes)).astype(post.dtype)      # (N, L, C)
        per_class = matmul(xp.ascontiguousarray(post.transpose(1, 0, 2)), hot)     # (N, T, C)
        return -per_class.transpose(1, 0, 2)


def _ctc_losses(lp, targets, inputs, lengths, blank, zero_infinity, with_gradient):
    wide = lp.astype(np.float32) if is_half(lp.dtype) else lp    # halves: the recursions in float32
    lattice = _Lattice(wide, targets, inputs, lengths, blank)
    a = lattice.alpha()
    ll = lattice.log_likelihood(a)
    losses = -ll
    grad = lattice.gradient(a, lattice.beta(), ll, lp.shape[2]) if with_gradient else None
    if zero_infinity:
        xp = lattice.xp
        impossible = xp.isinf(losses)
        losses = xp.where(impossible, 0, losses)
        if grad is not None:
            grad = xp.where(impossible[None, :, None], 0, grad)
            grad = xp.where(xp.isnan(grad) & impossible[None, :, None], 0, grad)
    if grad is not None and is_half(lp.dtype):
        grad = grad.astype(lp.dtype)
    return losses.astype(lp.dtype), grad


def _ctc_rule(lp, targets, inputs, lengths, *, blank, zero_infinity):
    losses, grad = _ctc_losses(value_of(lp), targets, inputs, lengths, blank, zero_infinity, True)

    def ctc_pullback(dy):
        return (_ctc_gradient(lp, grad=grad) * reshape(dy, (1, -1, 1)), None, None, None)
    return losses, ctc_pullback


_ctc = Primitive("ctc_loss", _ctc_rule, impl=lambda lp, targets, inputs, lengths, *, blank, zero_infinity:
                 _ctc_losses(lp, targets, inputs, lengths, blank, zero_infinity, False)[0])


def _no_second_derivative(lp, *, grad):
    raise NotImplementedError("ctc_loss has no second derivative: its gradient is computed by the forward-backward "
                              "recursions, which are not differentiated again")


# The gradient computed in the forward pass, as an op of ``lp`` so that differentiating it again says it cannot.
_ctc_gradient = Primitive("ctc_loss_gradient", _no_second_derivative, impl=lambda lp, *, grad: grad)


# ---------------------------------------------------------------------------------------------
# PyTorch's margin losses for binary and multi-label targets


def soft_margin_loss(x: Array, y: Array, *, agg: Callable = mean) -> Array:
    """PyTorch's soft margin loss, ``log(1 + exp(-y x))`` elementwise (computed as ``softplus(-y x)``), reduced by
    ``agg``; ``y`` of 1 or -1, ``x`` and ``y`` of one shape.

    >>> import numpy as np
    >>> round(float(soft_margin_loss(np.array([0.0, 2.0]), np.array([1, -1]))), 4)   # (log 2 + log(1 + e^2)) / 2
    1.41
    """
    name = "soft_margin_loss"
    _float_input(name, "x", x)
    _same_shapes(name, x=x, y=y)
    _plus_minus_one(name, y)
    return _aggregate(name, agg, softplus(-_as_dtype_of(y, x) * x))


def hinge_embedding_loss(x: Array, y: Array, *, margin: float = 1.0, agg: Callable = mean) -> Array:
    """PyTorch's hinge embedding loss: ``x`` where ``y`` is 1, ``max(0, margin - x)`` where it is -1, reduced by
    ``agg`` (``x`` usually a distance between two embeddings, small for similar pairs).

    >>> import numpy as np
    >>> hinge_embedding_loss(np.array([0.3, 0.4, 1.5]), np.array([1, -1, -1]), agg=lambda l: l)
    array([0.3, 0.6, 0. ])
    """
    name = "hinge_embedding_loss"
    margin = _number(name, "margin", margin)
    _float_input(name, "x", x)
    _same_shapes(name, x=x, y=y)
    _plus_minus_one(name, y)
    similar = value_of(y) == 1
    return _aggregate(name, agg, basic.where(similar, x, basic.maximum(margin - x, 0)))


def multilabel_soft_margin_loss(x: Array, y: Array, *, weight: Array | None = None,
                                agg: Callable = mean) -> Array:
    """PyTorch's multi-label soft margin loss: per example of ``x`` ``(N, C)`` (logits, one per label) and targets
    ``y`` ``(N, C)`` in [0, 1], the mean over the labels of ``weight * (y softplus(-x) + (1 - y) softplus(x))``
    (a binary cross-entropy per label), reduced over the examples by ``agg``. ``weight``: ``(C,)``.

    >>> import numpy as np
    >>> round(float(multilabel_soft_margin_loss(np.zeros((1, 2)), np.array([[1.0, 0.0]]))), 4)   # log 2
    0.6931
    """
    name = "multilabel_soft_margin_loss"
    _float_input(name, "x", x)
    shape = _rows_of_vectors(name, x=x, y=y)
    y = _as_dtype_of(y, x)
    per_label = y * softplus(-x) + (1 - y) * softplus(x)
    w = _class_weights(name, weight, shape[-1], value_of(x))
    if w is not None:
        per_label = per_label * w
    return _aggregate(name, agg, _sum(per_label, axis=-1) / shape[-1])


def multi_margin_loss(x: Array, y: Array, *, p: int = 1, margin: float = 1.0, weight: Array | None = None,
                      agg: Callable = mean) -> Array:
    """PyTorch's multi-class margin (hinge) loss: per example of scores ``x`` ``(N, C)`` and class indices ``y``
    ``(N,)``, ``sum over i != y of weight[y] * max(0, margin - x[y] + x[i]) ** p``, divided by ``C``, reduced over
    the examples by ``agg``. ``p`` is 1 or 2.

    >>> import numpy as np
    >>> round(float(multi_margin_loss(np.array([[0.1, 0.2, 0.4, 0.8]]), np.array([3]))), 6)   # (0.3 + 0.4 + 0.6) / 4
    0.325
    """
    name = "multi_margin_loss"
    margin = _number(name, "margin", margin)
    if p not in (1, 2) or isinstance(p, bool):
        raise ValueError(f"{name} expects p to be 1 or 2, got {p!r}")
    _float_input(name, "x", x)
    shape = _shape(x)
    labels = value_of(y)
    if len(shape) != 2 or not is_array(labels) or labels.dtype.kind not in "iu" or tuple(labels.shape) != shape[:1]:
        raise ValueError(f"{name} expects x of shape (N, C) and y, integer class indices of shape (N,), got "
                         f"{_describe('x', x)} and {_describe('y', y)}")
    hot = _one_hot(name, labels, shape[1], value_of(x).dtype, -1)
    target = _sum(x * hot, axis=-1, keepdims=True)
    hinge = basic.maximum(margin - target + x, 0) * (1 - hot)
    rows = _sum(hinge if p == 1 else hinge * hinge, axis=-1) / shape[1]
    w = _class_weights(name, weight, shape[1], value_of(x))
    if w is not None:
        rows = rows * _sum(hot * w, axis=-1)
    return _aggregate(name, agg, rows)
