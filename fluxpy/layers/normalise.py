"""Normalisation and regularisation (Flux's ``src/layers/normalise.jl``): BatchNorm, LayerNorm, RMSNorm, GroupNorm,
InstanceNorm, Dropout, and the train/test mode that BatchNorm, InstanceNorm and Dropout follow (``istraining``,
``trainmode``, ``testmode``).
"""
from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from ..autodiff import in_gradient, is_tracked, value_of
from ..functors import children, layer
from ..ops.activations import identity
from ..ops.bias_act import bias_act
from ..ops.dropout import alpha_dropout, dropout
from ..ops.basic import sqrt
from ..journal import changing
from ..ops.batchnorm import batchnorm
from ..ops.bias_act import why_not_fused
from ..ops.shape import astype, reshape
from ..broadcast import broadcast
from ..ops.norm import batchnorm_infer, groupnorm, instancenorm, layernorm, rmsnorm
from ._checks import (Array, _activation, _fail, _is_int, _number, _positive_int, _require_float, _require_norm_dtype)
from .init import ones32, zeros32
from .show import _act_part


def istraining(*xs) -> bool:
    """True inside :func:`fluxpy.gradient` (and ``withgradient``/``pullback``) or when any of ``xs`` is Tracked.

    :class:`Dropout` and :class:`BatchNorm` in automatic mode use this to decide whether they are
    training, so a Dropout applied straight to the data trains too.

    >>> import numpy as np, fluxpy
    >>> istraining(np.ones(2))
    False
    >>> fluxpy.gradient(lambda x: float(istraining(x)) * x.sum(), np.ones(2))
    (array([1., 1.]),)
    """
    return in_gradient() or any(is_tracked(x) for x in xs)


def _set_mode(model, active):
    seen = set()

    def walk(x):
        if id(x) in seen:
            return
        seen.add(id(x))
        if getattr(type(x), "_has_mode", False):
            x.active = active
        for _, child in children(x) or ():
            walk(child)
    walk(model)
    return model


def _mode_value(mode, when_true):
    if mode == "auto":
        return None
    if isinstance(mode, bool):
        return when_true if mode else not when_true
    raise ValueError(f"mode must be True, False or \"auto\", got {mode!r}")


def trainmode(model, mode: bool | str = True):
    """Puts every Dropout and BatchNorm in ``model`` in training mode, in place, and returns ``model``.

    ``mode=False`` means test mode and ``mode="auto"`` restores the default (training only
    inside :func:`fluxpy.gradient`, see :func:`istraining`).

    >>> import numpy as np
    >>> d = trainmode(Dropout(0.5, rng=0))
    >>> bool((d(np.ones(100)) == 0).any())   # drops even outside gradient
    True
    """
    return _set_mode(model, _mode_value(mode, True))


def testmode(model, mode: bool | str = True):
    """Puts every Dropout and BatchNorm in ``model`` in test mode (identity / running stats), in place, and returns it.

    ``mode=False`` means training mode, ``mode="auto"`` the default.

    >>> import numpy as np, fluxpy
    >>> d = testmode(Dropout(0.5))
    >>> fluxpy.gradient(lambda x: d(x).sum(), np.ones(3))   # never drops, even inside gradient
    (array([1., 1., 1.]),)
    """
    return _set_mode(model, _mode_value(mode, False))


testmode.__test__ = False  # not a test, whatever pytest guesses from the name


def _check_active(who, active):
    if not (active is None or isinstance(active, bool)):
        raise ValueError(f"{who}: active must be True, False or None (automatic), got {active!r}")


def is_active(layer: Any, *xs: Any) -> bool:
    """Whether ``layer`` (Dropout, BatchNorm, ...) runs in its training mode on ``xs``: its ``active`` field where
    set (``trainmode``/``testmode``), else whether ``xs`` are being differentiated (:func:`istraining`).

    >>> import numpy as np
    >>> d = Dropout(0.5)
    >>> is_active(d, np.ones(3)), is_active(Dropout(0.5, active=True), np.ones(3))
    (False, True)
    """
    return istraining(*xs) if layer.active is None else layer.active


def _mode_repr(active):
    return "" if active is None else f", active={active}"


@functools.lru_cache(maxsize=64)
def _scale_shift_act(act):
    """The scalar function ``act(x * scale + shift)`` (one per activation, so the GPU's compiled kernel is reused)."""
    def scale_shift_act(x, scale, shift):
        return act(x * scale + shift)
    return scale_shift_act


@layer(children=("gamma", "beta", "running_mean", "running_var"), trainable=("gamma", "beta"))
class BatchNorm:
    """Batch normalisation of ``C`` channels: ``y = act((x - mean) / sqrt(var + eps) * gamma + beta)``.

    ``x`` is ``(N, C, ...)``. Training: the mean and variance are the batch's, over every axis
    but 1, and the running statistics move towards them:
    ``running = (1 - momentum) * running + momentum * batch`` (the variance unbiased, as Flux and
    PyTorch). Testing: the running statistics are used. Training happens inside
    :func:`fluxpy.gradient` unless :func:`trainmode`/:func:`testmode` or ``active`` say
    otherwise. ``gamma`` (ones) and ``beta`` (zeros) are trainable, absent with ``affine=False``;
    the running statistics are children (saved, moved to the GPU) but not trainable, and with
    ``track_stats=False`` there are none and the batch's statistics are always used.

    Batch statistics need more than one value per channel (``x.size // C > 1``): with one, the
    output would be ``beta`` whatever ``x`` and the running variance would go to zero, so that is an
    error (as PyTorch's), raised before the running statistics change. ``x`` must have the
    parameters' dtype (see :class:`Dense`).

    >>> import numpy as np, fluxpy
    >>> bn = BatchNorm(2)
    >>> x = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> bn(x) is not None, bn.running_mean   # test mode outside gradient: stats unchanged
    (True, array([0., 0.], dtype=float32))
    >>> _ = fluxpy.gradient(lambda m: m(x).sum(), bn)   # training: stats move
    >>> bn.running_mean
    array([0.3, 0.4], dtype=float32)
    >>> trainmode(bn)(np.ones((1, 2), np.float32))
    Traceback (most recent call last):
    ...
    fluxpy.layers.DimensionMismatch: BatchNorm(2, active=True) expects more than 1 value per channel when using \
batch statistics (training, or track_stats=False), got (1, 2) float32
    """
    _has_mode = True

    def __init__(self, channels: int, act: Callable = identity, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, track_stats: bool = True, active: bool | None = None) -> None:
        channels = _positive_int("BatchNorm", "channels", channels)
        act = _activation("BatchNorm", act)
        _number("BatchNorm", "eps", eps, 0)
        _number("BatchNorm", "momentum", momentum, 0, 1)
        _check_active("BatchNorm", active)
        self.gamma = ones32(channels) if affine else None
        self.beta = zeros32(channels) if affine else None
        self.running_mean = zeros32(channels) if track_stats else None
        self.running_var = ones32(channels) if track_stats else None
        self.channels = channels
        self.act, self.eps, self.momentum, self.active = act, eps, momentum, active

    def __call__(self, x: Array) -> Array:
        if self._batch_statistics(x):
            # In place, so the model outside gradient (whose arrays the tape boxes, not copies) sees the update.
            fused = why_not_fused(self.act) is None
            y = batchnorm(x, self.gamma, self.beta, self.running_mean, self.running_var, momentum=self.momentum,
                          eps=self.eps, act=self.act if fused else None)
            return y if fused else bias_act(y, None, self.act)
        if self.act is identity or why_not_fused(self.act) is not None:
            y = batchnorm_infer(x, self.gamma, self.beta, self.running_mean, self.running_var, self.eps)
            return y if self.act is identity else bias_act(y, None, self.act)
        return self._infer_fused(x)

    def _batch_statistics(self, x) -> bool:
        """Whether this call normalises with the batch's statistics (training, or no running ones), after checking
        ``x`` (channels, dtype, and more than one value per channel where the batch's statistics are used)."""
        if not hasattr(x, "shape") or len(x.shape) < 2 or x.shape[1] != self.channels:
            _fail(self, f"x.shape[1] == {self.channels} (x of shape (N, C, ...))", x)
        params = self.gamma if self.gamma is not None else self.running_mean
        if params is not None:
            _require_norm_dtype(self, x, params.dtype)
        else:
            _require_float(self, x)
        if self.running_mean is None or is_active(self, x, self.gamma, self.beta):
            if math.prod(x.shape) // self.channels < 2:
                _fail(self, "more than 1 value per channel when using batch statistics (training, or "
                            "track_stats=False)", x)
            return True
        return False

    def _join_residual(self, x, residual, act):
        """``act(self(x) + residual)``, a residual block's join and the activation after it, as one batch-norm op
        (the residual added and ``act`` applied in its own passes: :func:`fluxpy.ops.batchnorm.batchnorm`'s
        ``residual``) where this layer has no activation of its own, uses the batch's statistics, ``act`` fuses,
        ``residual`` has ``x``'s shape and dtype and the layer is a BatchNorm, not a subclass with a call of its
        own; else None (the caller calls the layer, adds and applies ``act`` itself).
        A :class:`Chain` ending in this layer hands it the join (``Chain(SkipConnection(Chain(..., BatchNorm(c)),
        +), relu)``).

        >>> import numpy as np, fluxpy
        >>> bn, x, r = BatchNorm(2, active=True), np.ones((3, 2), np.float32), np.full((3, 2), -1, np.float32)
        >>> bn._join_residual(x, r, fluxpy.relu)
        array([[0., 0.],
               [0., 0.],
               [0., 0.]], dtype=float32)
        """
        if type(self).__call__ is not BatchNorm.__call__:   # a subclass computes otherwise (SyncBatchNorm's
            return None                                       # statistics are the global batch's)
        if self.act is not identity or why_not_fused(act) is not None or not self._batch_statistics(x):
            return None
        if tuple(getattr(residual, "shape", ())) != tuple(x.shape) or getattr(residual, "dtype", None) != x.dtype:
            return None
        return batchnorm(x, self.gamma, self.beta, self.running_mean, self.running_var, momentum=self.momentum,
                         eps=self.eps, act=act, residual=residual)

    def _infer_fused(self, x):
        """``act(x * scale + shift)`` with the running statistics' per-channel scale and shift, one fused
        elementwise op (a kernel each way on the GPU)."""
        scale = 1 / sqrt(self.running_var + self.eps)
        if self.gamma is not None:
            scale = scale * self.gamma
        shift = -self.running_mean * scale
        if self.beta is not None:
            shift = shift + self.beta
        shape = (1, self.channels) + (1,) * (len(x.shape) - 2)
        scale, shift = reshape(scale, shape), reshape(shift, shape)
        if scale.dtype != x.dtype:   # a half x keeps its dtype (the parameters are float32)
            scale, shift = astype(scale, x.dtype), astype(shift, x.dtype)
        return broadcast(_scale_shift_act(self.act), x, scale, shift)

    def __repr__(self):
        opts = [f", eps={self.eps}" if self.eps != 1e-5 else "",
                f", momentum={self.momentum}" if self.momentum != 0.1 else "",
                ", affine=False" if self.gamma is None else "",
                ", track_stats=False" if self.running_mean is None else ""]
        return f"BatchNorm({self.channels}{_act_part(self.act)}{''.join(opts)}{_mode_repr(self.active)})"


@layer(children=("gamma", "beta"))
class LayerNorm:
    """Normalises each sample over its trailing axes: ``y = act((x - mean) / sqrt(var + eps) * gamma + beta)``.

    The statistics are per sample over the last ``len(shape)`` axes, which must equal ``shape``
    (an int or tuple); ``gamma`` (ones) and ``beta`` (zeros) have that shape, and are absent with
    ``affine=False``. PyTorch's ``LayerNorm(shape)``. The sizes must be positive ints normalising more
    than one value (over one, the output would be ``beta`` whatever ``x``), and ``x`` must have the
    parameters' dtype (see :class:`Dense`).

    >>> import numpy as np
    >>> ln = LayerNorm(4)
    >>> ln, ln(np.arange(8, dtype=np.float32).reshape(2, 4)).round(3)[0]
    (LayerNorm(4), array([-1.342, -0.447,  0.447,  1.342], dtype=float32))
    """

    def __init__(self, shape: int | tuple[int, ...], act: Callable = identity, eps: float = 1e-5,
                 affine: bool = True) -> None:
        dims = (shape,) if _is_int(shape) else tuple(shape) if isinstance(shape, (tuple, list)) else None
        if not dims or not all(_is_int(d) and d >= 1 for d in dims):
            raise ValueError(f"LayerNorm: shape must be a positive int or a tuple of them, got {shape!r}")
        self.shape = tuple(int(d) for d in dims)
        if math.prod(self.shape) < 2:
            raise ValueError(f"LayerNorm: shape {shape!r} normalises a single value, whose output is always beta; "
                             f"normalise more than one")
        self.act = _activation("LayerNorm", act)
        self.eps = _number("LayerNorm", "eps", eps, 0)
        self.gamma = ones32(self.shape) if affine else None
        self.beta = zeros32(self.shape) if affine else None

    def __call__(self, x: Array, residual: Array | None = None) -> Array:
        """``act(layernorm(x))``; with ``residual`` (``x``'s shape and dtype), of ``x + residual``, summed inside the
        layer norm's kernels on the GPU (the post-norm residual block in one pass each way)."""
        k = len(self.shape)
        if not hasattr(x, "shape") or tuple(x.shape[-k:]) != self.shape or len(x.shape) < k:
            _fail(self, f"x.shape[-{k}:] == {self.shape}", x)
        if residual is not None and (not hasattr(residual, "shape") or tuple(residual.shape) != tuple(x.shape)
                                     or residual.dtype != x.dtype):
            _fail(self, f"residual of x's shape {tuple(x.shape)} and dtype {x.dtype}", residual)
        if self.gamma is not None:
            _require_norm_dtype(self, x, self.gamma.dtype)
        else:
            _require_float(self, x)
        y = layernorm(x, self.gamma, self.beta, tuple(range(-k, 0)), self.eps, residual=residual)
        return y if self.act is identity else bias_act(y, None, self.act)

    def __repr__(self):
        shape = self.shape[0] if len(self.shape) == 1 else self.shape
        opts = (f", eps={self.eps}" if self.eps != 1e-5 else "") + (", affine=False" if self.gamma is None else "")
        return f"LayerNorm({shape}{_act_part(self.act)}{opts})"


_HALF_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def _dtype_eps(dtype):
    """The machine epsilon of a float dtype (halves included)."""
    dtype = np.dtype(dtype)
    return _HALF_EPS[dtype.name] if dtype.name in _HALF_EPS else float(np.finfo(dtype).eps)


@layer(children=("gamma",))
class RMSNorm:
    """Root-mean-square normalisation over the trailing axes: ``y = x / sqrt(mean(x**2) + eps) * gamma`` (Zhang &
    Sennrich 2019; PyTorch's ``RMSNorm(normalized_shape, eps=None, elementwise_affine=True)``; Flux has none).

    The mean is per sample over the last ``len(shape)`` axes, which must equal ``shape`` (an int or tuple);
    ``gamma`` (PyTorch's ``weight``, ones) has that shape and is absent with ``affine=False``. ``eps=None`` means
    the machine epsilon of ``x``'s dtype, as PyTorch's. Half-precision ``x`` is normalised in float32 and returned
    in its own dtype.

    >>> import numpy as np
    >>> rn = RMSNorm(2)
    >>> rn, rn(np.array([[3.0, 4.0]], np.float32)).round(4)
    (RMSNorm(2), array([[0.8485, 1.1314]], dtype=float32))
    """

    def __init__(self, shape: int | tuple[int, ...], eps: float | None = None, affine: bool = True) -> None:
        dims = (shape,) if _is_int(shape) else tuple(shape) if isinstance(shape, (tuple, list)) else None
        if not dims or not all(_is_int(d) and d >= 1 for d in dims):
            raise ValueError(f"RMSNorm: shape must be a positive int or a tuple of them, got {shape!r}")
        self.shape = tuple(int(d) for d in dims)
        self.eps = None if eps is None else _number("RMSNorm", "eps", eps, 0)
        self.gamma = ones32(self.shape) if affine else None

    def __call__(self, x: Array) -> Array:
        k = len(self.shape)
        if not hasattr(x, "shape") or len(x.shape) < k or tuple(x.shape[-k:]) != self.shape:
            _fail(self, f"x.shape[-{k}:] == {self.shape}", x)
        if self.gamma is not None:
            _require_norm_dtype(self, x, self.gamma.dtype)
        else:
            _require_float(self, x)
        eps = _dtype_eps(x.dtype) if self.eps is None else self.eps
        return rmsnorm(x, self.gamma, k, eps)

    def __repr__(self):
        shape = self.shape[0] if len(self.shape) == 1 else self.shape
        opts = (f", eps={self.eps}" if self.eps is not None else "") + (", affine=False" if self.gamma is None else "")
        return f"RMSNorm({shape}{opts})"


def _require_norm_input(layer, x, channels, params, min_ndim=2, layout="(N, C, ...)"):
    """Shape (``x.shape[1] == channels``, at least ``min_ndim`` axes) and dtype checks of a channel norm layer."""
    if not hasattr(x, "shape") or len(x.shape) < min_ndim or x.shape[1] != channels:
        _fail(layer, f"x.shape[1] == {channels} (x of shape {layout})", x)
    if params is not None:
        _require_norm_dtype(layer, x, params.dtype)
    else:
        _require_float(layer, x)


@layer(children=("gamma", "beta"))
class GroupNorm:
    """Group normalisation: the ``channels`` of each sample in ``groups`` groups of consecutive channels, each group
    normalised over its channels and spatial axes, then ``y = act(xhat * gamma + beta)`` per channel.

    ``x`` is ``(N, C, ...)`` with ``C == channels``, which ``groups`` must divide; each group must hold more than one
    value. ``gamma`` (ones) and ``beta`` (zeros) are ``(C,)``, absent with ``affine=False``. No running statistics:
    training and testing compute the same. Flux's ``GroupNorm(channels, groups, act; affine, eps)`` and PyTorch's
    ``GroupNorm(groups, channels)``. float32 parameters take float32, float16 or bfloat16 ``x``.

    >>> import numpy as np
    >>> gn = GroupNorm(4, 2)
    >>> gn, gn(np.array([[1.0, 3.0, 0.0, 10.0]], np.float32)).round(3)
    (GroupNorm(4, 2), array([[-1.,  1., -1.,  1.]], dtype=float32))
    """

    def __init__(self, channels: int, groups: int, act: Callable = identity, eps: float = 1e-5,
                 affine: bool = True) -> None:
        channels = _positive_int("GroupNorm", "channels", channels)
        groups = _positive_int("GroupNorm", "groups", groups)
        if channels % groups:
            raise ValueError(f"GroupNorm: groups must divide channels, got {channels} channels in {groups} groups")
        self.channels, self.groups = channels, groups
        self.act = _activation("GroupNorm", act)
        self.eps = _number("GroupNorm", "eps", eps, 0)
        self.gamma = ones32(channels) if affine else None
        self.beta = zeros32(channels) if affine else None

    def __call__(self, x: Array) -> Array:
        _require_norm_input(self, x, self.channels, self.gamma)
        if math.prod(x.shape[2:]) * (self.channels // self.groups) < 2:
            _fail(self, "more than 1 value per group (x.size // (N * groups))", x)
        return groupnorm(x, self.groups, self.gamma, self.beta, self.eps, self.act)

    def __repr__(self):
        opts = (f", eps={self.eps}" if self.eps != 1e-5 else "") + (", affine=False" if self.gamma is None else "")
        return f"GroupNorm({self.channels}, {self.groups}{_act_part(self.act)}{opts})"


@layer(children=("gamma", "beta", "running_mean", "running_var"), trainable=("gamma", "beta"))
class InstanceNorm:
    """Instance normalisation: each sample's channels normalised separately over the spatial axes, then
    ``y = act(xhat * gamma + beta)``.

    ``x`` is ``(N, C, S1, ...)`` with ``C == channels`` and more than one spatial value. With ``affine=True``,
    ``gamma`` (ones) and ``beta`` (zeros) are ``(C,)`` and trainable (Flux's default is ``affine=False``, as
    PyTorch's). With ``track_stats=True`` the layer keeps ``running_mean`` and ``running_var`` (``(C,)``, children
    but not trainable): in training (inside :func:`fluxpy.gradient` unless :func:`trainmode`/:func:`testmode` or
    ``active`` say otherwise) they move towards the batch's mean of the per-instance statistics,
    ``running = (1 - momentum) * running + momentum * batch`` (the variance unbiased over the spatial values, as
    Flux and PyTorch), and in testing they normalise instead of the instance's own statistics. Flux's
    ``InstanceNorm(channels, act; affine, track_stats, eps, momentum)``.

    >>> import numpy as np
    >>> norm = InstanceNorm(2)
    >>> norm, norm(np.array([[[1.0, 3.0], [0.0, 10.0]]], np.float32)).round(3)
    (InstanceNorm(2), array([[[-1.,  1.],
            [-1.,  1.]]], dtype=float32))
    """
    _has_mode = True

    def __init__(self, channels: int, act: Callable = identity, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = False, track_stats: bool = False, active: bool | None = None) -> None:
        channels = _positive_int("InstanceNorm", "channels", channels)
        self.act = _activation("InstanceNorm", act)
        self.eps = _number("InstanceNorm", "eps", eps, 0)
        self.momentum = _number("InstanceNorm", "momentum", momentum, 0, 1)
        _check_active("InstanceNorm", active)
        self.channels, self.active = channels, active
        self.gamma = ones32(channels) if affine else None
        self.beta = zeros32(channels) if affine else None
        self.running_mean = zeros32(channels) if track_stats else None
        self.running_var = ones32(channels) if track_stats else None

    def __call__(self, x: Array) -> Array:
        params = self.gamma if self.gamma is not None else self.running_mean
        _require_norm_input(self, x, self.channels, params, 3, "(N, C, S1, ...)")
        if math.prod(x.shape[2:]) < 2:
            _fail(self, "more than 1 spatial value per instance and channel", x)
        if self.running_mean is not None and not is_active(self, x, self.gamma, self.beta):
            y = batchnorm_infer(x, self.gamma, self.beta, self.running_mean, self.running_var, self.eps)
        else:
            y = instancenorm(x, self.gamma, self.beta, self.eps)
            if self.running_mean is not None:
                self._track(x)
        return y if self.act is identity else bias_act(y, None, self.act)

    def _track(self, x):
        """Moves the running statistics, in place, towards the batch's mean of the instances' statistics."""
        # The plain arrays, in place: inside gradient the layer's arrays are boxed, not copied.
        running_mean, running_var = value_of(self.running_mean), value_of(self.running_var)
        v = value_of(x).astype(running_mean.dtype, copy=False)
        axes = tuple(range(2, v.ndim))
        m = math.prod(v.shape[2:])
        with changing(running_mean, running_var):
            running_mean *= 1 - self.momentum
            running_mean += self.momentum * v.mean(axis=axes).mean(axis=0)
            running_var *= 1 - self.momentum
            running_var += (self.momentum * m / (m - 1)) * v.var(axis=axes).mean(axis=0)

    def __repr__(self):
        opts = [f", eps={self.eps}" if self.eps != 1e-5 else "",
                f", momentum={self.momentum}" if self.momentum != 0.1 else "",
                ", affine=True" if self.gamma is not None else "",
                ", track_stats=True" if self.running_mean is not None else ""]
        return f"InstanceNorm({self.channels}{_act_part(self.act)}{''.join(opts)}{_mode_repr(self.active)})"


@layer(children=())
class Dropout:
    """Zeroes each entry with probability ``p`` and scales the rest by ``1/(1-p)``.

    Active inside :func:`fluxpy.gradient` (also when applied straight to the data), the identity
    otherwise, unless :func:`trainmode`/:func:`testmode` or ``active`` fix the mode. ``dims`` are
    the axes the mask varies along (``dims=(0, 1)`` on NCHW drops whole channels); ``rng`` a
    generator for the arrays' device (NumPy's for NumPy arrays) or a seed.

    >>> import numpy as np, fluxpy
    >>> d = Dropout(0.5, rng=0)
    >>> x = np.ones((2, 3), np.float32)
    >>> d, d(x) is x
    (Dropout(0.5), True)
    >>> g, = fluxpy.gradient(lambda x: d(x).sum(), x)
    >>> sorted(set(g.ravel().tolist())) in ([0.0, 2.0], [2.0], [0.0])
    True
    """
    _has_mode = True

    def __init__(self, p: float, dims: int | tuple[int, ...] | None = None, rng: Any = None,
                 active: bool | None = None) -> None:
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p <= 1:
            raise ValueError(f"Dropout: p must be a probability in [0, 1], got {p!r}")
        if not (dims is None or _is_int(dims) or (isinstance(dims, tuple) and all(_is_int(d) for d in dims))):
            raise ValueError(f"Dropout: dims must be None, an axis or a tuple of axes, got {dims!r}")
        _check_active("Dropout", active)
        self.p, self.dims, self.active = p, dims, active
        self.rng = rng if rng is None or hasattr(rng, "random") else np.random.default_rng(rng)

    def __call__(self, x: Array) -> Array:
        return dropout(x, self.p, rng=self.rng, dims=self.dims, active=is_active(self, x))

    def __repr__(self):
        dims = "" if self.dims is None else f", dims={self.dims}"
        return f"Dropout({self.p}{dims}{_mode_repr(self.active)})"


@layer(children=())
class AlphaDropout:
    """Alpha dropout for SELU networks (Flux's ``AlphaDropout``, :func:`fluxpy.ops.dropout.alpha_dropout`): keeps
    the mean and variance of standardised inputs; active as :class:`Dropout` is (in a gradient, or by
    ``trainmode``/``active``).

    >>> import numpy as np, fluxpy
    >>> d = AlphaDropout(0.1, rng=0)
    >>> x = np.ones((2, 3), np.float32)
    >>> d, d(x) is x
    (AlphaDropout(0.1), True)
    """
    _has_mode = True

    def __init__(self, p: float, rng: Any = None, active: bool | None = None) -> None:
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p <= 1:
            raise ValueError(f"AlphaDropout: p must be a probability in [0, 1], got {p!r}")
        _check_active("AlphaDropout", active)
        self.p, self.active = p, active
        self.rng = rng if rng is None or hasattr(rng, "random") else np.random.default_rng(rng)

    def __call__(self, x: Array) -> Array:
        _require_float(self, x)
        return alpha_dropout(x, self.p, rng=self.rng, active=is_active(self, x))

    def __repr__(self):
        return f"AlphaDropout({self.p}{_mode_repr(self.active)})"
