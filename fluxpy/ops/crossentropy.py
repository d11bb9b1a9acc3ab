"""Cross-entropy from logits against integer class indices, one row per example, without a one-hot array.

PyTorch's ``cross_entropy(logits, target, weight, ignore_index=..., label_smoothing=a, reduction="none")`` of
``(N, C)`` logits and ``(N,)`` class indices, as one op. The op is *defined* by dense targets: row ``n``'s is

    ``y[n] = ((1 - a) onehot(t[n]) + a / C) * w * kept[n]``

(``w`` the class weights, all 1 without them; ``kept[n]`` 0 where ``t[n]`` is ``ignore_index``; a row of NaN where
``t[n]`` lies outside ``[0, C)``), and the loss is :func:`fluxpy.ops.softmax.logit_crossentropy_rows` of them:
``l[n] = sum(y[n]) lse(ŷ[n]) - <y[n], ŷ[n]>``, a class with ``y == 0`` adding nothing. But the targets are never
built: ``y[n] = h[n] onehot(t[n]) + u[n] w`` with ``h = (1 - a) w[t] kept`` and ``u = a / C kept``, so

    ``l[n] = h (lse - ŷ[n, t]) + u (sum(w) lse - <w, ŷ[n]>)``,
    ``dl/dŷ[n] = softmax(ŷ[n]) (h + u sum(w)) - h onehot(t) - u w``,

which read one logit per row beside the row's log-sum-exp (and, with smoothing, its weighted sum). On the GPU each
direction is one kernel (a warp per row); elsewhere vectorised array code. Differentiated twice, the backward runs
the dense rule (it builds the targets then), so every order of derivative is the dense op's.

>>> import numpy as np
>>> from fluxpy import gradient
>>> logits = np.array([[0.0, np.log(3.0)], [5.0, 0.0]])
>>> logit_crossentropy_labels(logits, np.array([1, 0])).round(4)
array([0.2877, 0.0067])
>>> gradient(lambda z: logit_crossentropy_labels(z, np.array([1, -100]), ignore_index=-100).sum(), logits)[0]
array([[ 0.25, -0.25],
       [ 0.  ,  0.  ]])
"""
from __future__ import annotations

import numbers

import numpy as np

from ..autodiff import Primitive, is_tracked, value_of
from ..backend import Array, get_array_module, is_float_dtype
from ..kernels import find
from ..kernels.halfs import is_half
from .softmax import _logsoftmax_impl, _softmax_impl, logit_crossentropy_rows_backward

__all__ = ["logit_crossentropy_labels", "logit_crossentropy_labels_backward"]


# ---------------------------------------------------------------------------------------------
# The targets: dense (the op's definition, and its rule when differentiated twice) and as row coefficients


def _valid(labels, classes):
    """Where ``labels`` lie in ``[0, classes)`` (a negative index, seen unsigned, is a huge one)."""
    return labels.astype(np.int64, copy=False).view(np.uint64) < classes


def _dense_targets(labels, classes, dtype, smoothing, weight, ignore):
    """The ``(N, classes)`` targets that define the op (see the module docstring), of ``dtype``."""
    xp = get_array_module(labels)
    kept = None if ignore is None else labels != ignore
    if kept is not None:
        labels = xp.where(kept, labels, 0)   # any class: the row is zeroed below
    hot = labels.astype(np.int64, copy=False).view(np.uint64)[:, None] == xp.arange(classes, dtype=np.uint64)
    y = hot.astype(dtype)
    with np.errstate(divide="ignore", invalid="ignore"):   # a bad index poisons its row: 0/0 = NaN
        y /= _valid(labels, classes)[:, None]
    if smoothing:
        y = y * (1 - smoothing) + smoothing / classes
    if kept is not None:
        y = y * kept[:, None].astype(dtype)
    return y if weight is None else y * weight


def _row_coefficients(labels, classes, dtype, smoothing, weight, ignore):
    """``(t, h, u)``, each ``(N,)``: row ``n``'s targets are ``h[n] onehot(t[n]) + u[n] w``. An ignored row has
    ``h = u = 0``, a row whose index is outside ``[0, classes)`` ``h = u = NaN``; both read class 0 as ``t``."""
    xp = get_array_module(labels)
    valid = _valid(labels, classes)
    t = xp.where(valid, labels, 0)
    h = dtype.type(1 - smoothing) if weight is None else weight[t] * dtype.type(1 - smoothing)
    h = xp.where(valid, h, dtype.type(np.nan))
    u = xp.where(valid, dtype.type(smoothing / classes), dtype.type(np.nan))
    if ignore is not None:
        kept = labels != ignore
        h, u = xp.where(kept, h, dtype.type(0)), xp.where(kept, u, dtype.type(0))
    return t, h, u


def _wide(a):
    """``a`` in its compute dtype: float16 and bfloat16 in float32 (each result is rounded once), None as None."""
    return a.astype(np.float32) if a is not None and is_half(a.dtype) else a


# ---------------------------------------------------------------------------------------------
# Array code (NumPy; CuPy where no kernel takes the call)


def _label_rows_arrays(yhat, labels, weight, smoothing, ignore):
    x, w = _wide(yhat), _wide(weight)
    xp = get_array_module(x)
    t, h, u = _row_coefficients(labels, x.shape[1], x.dtype, smoothing, w, ignore)
    logp = _logsoftmax_impl(x, (1,))
    picked = xp.take_along_axis(logp, t[:, None], axis=1)[:, 0]
    with np.errstate(invalid="ignore"):
        loss = -xp.where(h == 0, 0, h * picked)   # no target mass: nothing added, even for a masked (-inf) logit
        if smoothing:
            spread = logp.sum(axis=1) if w is None else xp.where(w == 0, 0, w * logp).sum(axis=1)
            loss -= xp.where(u == 0, 0, u * spread)
    return loss.astype(yhat.dtype, copy=False)


def _label_dyhat_arrays(dl, yhat, labels, weight, smoothing, ignore):
    x, w = _wide(yhat), _wide(weight)
    xp = get_array_module(x)
    n, classes = x.shape
    t, h, u = _row_coefficients(labels, classes, x.dtype, smoothing, w, ignore)
    mass = h   # sum(y[n])
    if smoothing:
        mass = h + u * (x.dtype.type(classes) if w is None else w.sum())
    with np.errstate(invalid="ignore"):
        g = _softmax_impl(x, (1,)) * mass[:, None]
        if smoothing:
            g -= u[:, None] if w is None else u[:, None] * w
        g[xp.arange(n), t] -= h
        g *= _wide(dl)[:, None]
    return g.astype(yhat.dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# The op and its backward


def _label_rows_impl(yhat, labels, weight, smoothing, ignore):
    fused = find("logit_crossentropy_labels", yhat, labels, weight, smoothing, ignore)
    if fused is not None:
        return fused(yhat, labels, weight, smoothing, ignore)
    return _label_rows_arrays(yhat, labels, weight, smoothing, ignore)


def _label_rows_rule(needs, yhat, labels, weight, smoothing, ignore):
    loss = _label_rows(yhat, labels, weight, smoothing, ignore)

    def logit_crossentropy_labels_pullback(dl):
        dyhat = logit_crossentropy_labels_backward(dl, yhat, labels, weight, smoothing, ignore) if needs[0] else None
        return dyhat, None, None, None, None
    return loss, logit_crossentropy_labels_pullback


_label_rows = Primitive("logit_crossentropy_labels", _label_rows_rule, impl=_label_rows_impl, needs_mask=True)


def logit_crossentropy_labels_backward(dl: Array, yhat: Array, labels: Array, weight: Array | None = None,
                                       smoothing: float = 0.0, ignore_index: int | None = None) -> Array:
    """The cotangent of the logits of :func:`logit_crossentropy_labels` (the same arguments, checked there):
    ``dl[:, None] * (softmax(ŷ) * sum(y, axis=1) - y)`` for the targets ``y`` the module docstring defines, which are
    built only where ``dl`` or ``ŷ`` is tracked (a derivative of the gradient: the dense rule differentiates again).

    >>> import numpy as np
    >>> logit_crossentropy_labels_backward(np.ones(1), np.zeros((1, 2)), np.array([1]))
    array([[ 0.5, -0.5]])
    """
    if is_tracked(dl) or is_tracked(yhat):
        y = _dense_targets(labels, yhat.shape[1], value_of(yhat).dtype, smoothing, weight, ignore_index)
        return logit_crossentropy_rows_backward(dl, yhat, y)
    fused = find("logit_crossentropy_labels_backward", dl, yhat, labels, weight, smoothing, ignore_index)
    if fused is not None:
        return fused(dl, yhat, labels, weight, smoothing, ignore_index)
    return _label_dyhat_arrays(dl, yhat, labels, weight, smoothing, ignore_index)


def _checked_arguments(yhat, labels, smoothing, weight, ignore_index):
    """The plain labels and weights (ŷ's dtype and device), after checking every argument's shape and type."""
    name, v = "logit_crossentropy_labels", value_of(yhat)
    shape = tuple(getattr(v, "shape", ()))
    if len(shape) != 2 or shape[1] == 0 or not is_float_dtype(v.dtype):
        raise ValueError(f"{name} expects ŷ, (N, C) floating-point logits with C >= 1, got {_described(v)}")
    labels = value_of(labels)
    if tuple(getattr(labels, "shape", ())) != shape[:1] or np.dtype(labels.dtype).kind not in "iu":
        raise ValueError(f"{name} expects labels, ({shape[0]},) integer class indices for ŷ of shape {shape}, got "
                         f"{_described(labels)}")
    if isinstance(smoothing, bool) or not isinstance(smoothing, numbers.Real) or not 0 <= smoothing < 1:
        raise ValueError(f"{name} expects smoothing in [0, 1), got {smoothing!r}")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral)):
        raise TypeError(f"{name} expects ignore_index to be None or an int (a class index), got {ignore_index!r}")
    xp = get_array_module(v, labels)   # a TypeError naming both where they are on different devices
    if weight is not None:
        weight = value_of(weight)
        weight = weight if hasattr(weight, "shape") else np.asarray(weight)
        real = is_float_dtype(weight.dtype) or np.dtype(weight.dtype).kind in "iu"
        if tuple(weight.shape) != shape[1:] or not real:
            raise ValueError(f"{name} expects weight, ({shape[1]},) class weights, got {_described(weight)}")
        weight = xp.asarray(weight, dtype=v.dtype)
    return xp.ascontiguousarray(labels), weight


def _described(a):
    return f"{tuple(a.shape)} {a.dtype}" if hasattr(a, "shape") else f"a {type(a).__name__}"


def logit_crossentropy_labels(yhat: Array, labels: Array, *, smoothing: float = 0.0, weight: Array | None = None,
                              ignore_index: int | None = None) -> Array:
    """The cross-entropy of each row of ``(N, C)`` logits against ``(N,)`` integer class indices, as one op.

    PyTorch's ``cross_entropy(ŷ, labels, weight, ignore_index=..., label_smoothing=smoothing, reduction="none")``:
    ``l[n] = (1 - a) w[t] (lse(ŷ[n]) - ŷ[n, t]) + (a / C) (sum(w) lse(ŷ[n]) - <w, ŷ[n]>)`` with ``t = labels[n]``,
    ``a = smoothing`` in [0, 1) and ``w`` the ``(C,)`` class weights (all 1 when ``weight`` is None; constants, no
    gradient); a row whose label is ``ignore_index`` is 0, and one whose label lies outside ``[0, C)`` is NaN (the
    labels' values are not read here: :func:`fluxpy.logitcrossentropy` checks them as its ``value_checks`` say). The
    one-hot targets are never built (the module docstring says how); on the GPU each direction is one kernel.

    >>> import numpy as np
    >>> logit_crossentropy_labels(np.zeros((2, 4)), np.array([0, 3]), smoothing=0.1).round(4)
    array([1.3863, 1.3863])
    >>> logit_crossentropy_labels(np.zeros((2, 4)), np.array([0, 9])).round(4)
    array([1.3863,    nan])
    """
    labels, weight = _checked_arguments(yhat, labels, smoothing, weight, ignore_index)
    ignore = None if ignore_index is None else int(ignore_index)
    return _label_rows(yhat, labels, weight, float(smoothing), ignore)
