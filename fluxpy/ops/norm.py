"""Normalisation: ``normalise``, ``batchnorm_train``, ``batchnorm_infer``, ``layernorm``, ``groupnorm`` and
``instancenorm``.

The reduction-heavy part, ``xhat = (x - mean) / sqrt(var + eps)`` over some axes, is one
primitive with the hand-written rule

    dx = (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) / sqrt(var + eps)

(means over the same axes). The affine ``xhat * gamma + beta`` is ordinary broadcasting, whose gradients go through
``unbroadcast``. Variances are biased (divided by the count), as in Flux and PyTorch. float16 and bfloat16 are
normalised in float32 and rounded once to their own dtype (batch norm's statistics stay float32, see
:mod:`fluxpy.ops.batchnorm`). Each op refuses to normalise over fewer than two values (the result would be 0
whatever the input, the variance 0), naming itself, before any arithmetic.

>>> import numpy as np
>>> x = np.array([[1.0, 3.0], [2.0, 6.0]])
>>> normalise(x, axis=0, eps=0.0)
array([[-1., -1.],
       [ 1.,  1.]])
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..autodiff import Primitive, is_tracked, value_of
from ..kernels import find, lookup
from ..kernels.answers import answered
from ..backend import Array, get_array_module
from ..kernels.halfs import compute_dtype, is_half
from .activations import identity
from .basic import sqrt
from .bias_act import bias_act
from .batchnorm import batchnorm, check_eps
from .fused import fused_op
from .reduce import check_half_mix
from .reduce import mean as _mean
from .reduce import sum as _sum
from .reduce import normalize_axis
from .shape import astype, reshape

__all__ = ["normalise", "batchnorm_train", "batchnorm_infer", "layernorm", "groupnorm", "instancenorm", "rmsnorm"]


def _moments(x, axes):
    """Mean and biased variance over ``axes`` with kept dimensions, in two passes."""
    mu = _mean(x, axes, keepdims=True)
    xc = x - mu
    return mu, _mean(xc * xc, axes, keepdims=True)


def _normalise_rule(x, mu, var, axes, eps):
    if is_tracked(x):
        # Differentiating again: the outer tape must see how the statistics depend on x.
        mu, var = _moments(x, axes)
    invstd = 1 / sqrt(var + eps)
    xhat = (x - mu) * invstd

    def normalise_pullback(dxhat):
        centred = dxhat - _mean(dxhat, axes, keepdims=True)
        return (invstd * (centred - xhat * _mean(dxhat * xhat, axes, keepdims=True)), None, None)
    return xhat, normalise_pullback


# ``mu`` and ``var`` are the batch statistics of ``x`` (computed once by the caller, which also
# needs them); the rule differentiates through their dependence on ``x``.
_normalise = Primitive("normalise", _normalise_rule)


def _count(x, axes):
    return math.prod(x.shape[a] for a in axes)


def _require_values(name, x, axes, what):
    """Raise unless more than one value of ``x`` lies along ``axes`` (a shape check, no data read)."""
    if _count(x, axes) < 2:
        raise ValueError(f"{name} expects more than 1 value {what}, got x of shape {tuple(x.shape)}")


def _normalised(x, axes, eps):
    """``(xhat, mu, var)``: ``mu`` and ``var`` are plain arrays with kept dimensions."""
    mu, var = _moments(value_of(x), axes)
    return _normalise(x, mu, var, axes=axes, eps=eps), mu, var


def normalise(x: Array, axis: int | tuple[int, ...] | None = -1, eps: float = 1e-5) -> Array:
    """``x`` normalised over ``axis``: ``(x - mean(x)) / sqrt(var(x) + eps)``.

    ``axis`` is an int (the last by default), a tuple, or None for all axes; the variance is biased. Flux's
    ``normalise``, with the axis convention of NumPy.

    >>> import numpy as np
    >>> normalise(np.array([1.0, 2.0, 3.0]), eps=0.0).round(4)
    array([-1.2247,  0.    ,  1.2247])
    """
    check_eps("normalise", eps)
    axes = normalize_axis(axis, x.ndim, "normalise")
    if axes is None:
        axes = tuple(range(x.ndim))
    _require_values("normalise", x, axes, f"along axis {axis!r}")
    if is_half(x.dtype):   # statistics in float32, the result rounded once to x's dtype
        return astype(_normalised(astype(x, np.float32), axes, eps)[0], x.dtype)
    return _normalised(x, axes, eps)[0]


def _channel_shape(x):
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _check_channel_params(name, x, **params):
    if x.ndim < 2:
        raise ValueError(f"{name} expects x of shape (N, C, ...) with the channels on axis 1, got {tuple(x.shape)}")
    c = x.shape[1]
    for pname, p in params.items():
        if p is not None and tuple(p.shape) != (c,):
            raise ValueError(f"{name} expects {pname} of shape ({c},) for x of shape {tuple(x.shape)}, "
                             f"got {tuple(p.shape)}")


def _affine(xhat, gamma, beta, shape):
    if gamma is not None:
        xhat = xhat * (reshape(gamma, shape) if shape is not None else gamma)
    if beta is not None:
        xhat = xhat + (reshape(beta, shape) if shape is not None else beta)
    return xhat


def batchnorm_train(x: Array, gamma: Array | None = None, beta: Array | None = None,
                    eps: float = 1e-5) -> tuple[Array, Array, Array]:
    """Batch norm with batch statistics; returns ``(y, mean, var)``.

    ``x`` is ``(N, C, ...)``; statistics are taken over every axis but the channel axis 1.
    ``y = (x - mean) / sqrt(var + eps) * gamma + beta`` with ``gamma``, ``beta`` of shape
    ``(C,)`` (None for none). ``mean`` and ``var`` are plain ``(C,)`` arrays, not on the tape,
    for the layer's running statistics; ``var`` is the biased variance used to normalise
    (Flux and PyTorch update the running variance with ``var * m / (m - 1)``,
    ``m = x.size // C``).

    >>> import numpy as np
    >>> x = np.array([[0.0, 1.0], [2.0, 5.0]])
    >>> y, mean, var = batchnorm_train(x, np.ones(2), np.zeros(2), eps=0.0)
    >>> y, mean, var
    (array([[-1., -1.],
           [ 1.,  1.]]), array([1., 3.]), array([1., 4.]))
    """
    _check_channel_params("batchnorm_train", x, gamma=gamma, beta=beta)
    check_eps("batchnorm_train", eps)
    axes = (0,) + tuple(range(2, x.ndim))
    _require_values("batchnorm_train", x, axes, "per channel (x.size // x.shape[1])")
    # The batchnorm primitive, with running statistics that momentum 1 sets to the batch's.
    v = value_of(x)
    xp, c, m = get_array_module(v), v.shape[1], v.size // v.shape[1]
    mean, var = xp.zeros(c, compute_dtype(v.dtype)), xp.ones(c, compute_dtype(v.dtype))   # float32 for halves
    y = batchnorm(x, gamma, beta, mean, var, momentum=1.0, eps=eps)
    var *= (m - 1) / m   # back from the unbiased running variance to the biased one used to normalise
    return y, mean, var


def batchnorm_infer(x: Array, gamma: Array | None, beta: Array | None, running_mean: Array, running_var: Array,
                    eps: float = 1e-5) -> Array:
    """Batch norm with fixed statistics ``running_mean`` and ``running_var``.

    ``y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta`` along the channel
    axis 1 of ``x`` (``(N, C, ...)``); every parameter is ``(C,)`` (``gamma``/``beta`` may be
    None). Differentiable in all arguments; it costs two passes over ``x``.

    >>> import numpy as np
    >>> batchnorm_infer(np.array([[3.0, 3.0]]), None, None, np.array([1.0, 2.0]), np.array([4.0, 1.0]), eps=0.0)
    array([[1., 1.]])
    """
    _check_channel_params("batchnorm_infer", x, gamma=gamma, beta=beta, running_mean=running_mean,
                          running_var=running_var)
    check_eps("batchnorm_infer", eps)
    scale = 1 / sqrt(running_var + eps)
    if gamma is not None:
        scale = scale * gamma
    shift = -running_mean * scale
    if beta is not None:
        shift = shift + beta
    shape = _channel_shape(x)
    y = x * reshape(scale, shape) + reshape(shift, shape)
    return astype(y, x.dtype) if is_half(x.dtype) and y.dtype != x.dtype else y


def layernorm(x: Array, gamma: Array | None = None, beta: Array | None = None,
              axes: int | tuple[int, ...] = -1, eps: float = 1e-5, residual: Array | None = None,
              bias: Array | None = None) -> Array:
    """Layer norm: ``normalise(x, axes) * gamma + beta``.

    Statistics are per sample, over ``axes`` (an int or tuple, the last axis by default; PyTorch's ``layer_norm`` with
    ``normalized_shape = x.shape[-k:]`` is ``axes=(-k, ..., -1)``). ``gamma`` and ``beta``
    broadcast against ``x``, usually with the shape of the normalised axes (None for none).

    ``residual`` (``x``'s shape and dtype) and ``bias`` (broadcasting to ``x``) make it the layer norm of
    ``x + residual + bias``, the post-norm residual block's; on the GPU the sum is made on the fly by the
    layer-norm kernels, one read of each input and one write of the output, never stored (the backward sums again).
    The halves add in float32.

    >>> import numpy as np
    >>> layernorm(np.array([[1.0, 3.0], [0.0, 10.0]]), np.full(2, 2.0), np.ones(2), eps=0.0)
    array([[-1.,  3.],
           [-1.,  3.]])
    >>> layernorm(np.array([[1.0, 2.0]]), residual=np.array([[0.0, 1.0]]), bias=np.array([1.0, 0.0]), eps=0.0)
    array([[-1.,  1.]])
    """
    key = (axes, eps, _kind(x), _kind(gamma), _kind(beta), _kind(residual), _kind(bias))
    # axes given as a list make the key unhashable: checked every call
    k = answered(_checked, key, lambda: _layernorm_checks(x, gamma, beta, axes, eps, residual, bias))
    gamma, beta, bias = _in_compute_type(gamma, x), _in_compute_type(beta, x), _in_compute_type(bias, x)
    if k and _one_tape_level(x, gamma, beta, residual, bias) and \
            find("layernorm_forward", value_of(x), value_of(gamma), value_of(beta), k, eps, value_of(residual),
                 value_of(bias)) is not None:
        return _layernorm_rows(x, gamma, beta, residual, bias, k, eps)
    summed = _summed(x, residual, bias)
    y = _affine(normalise(summed, axes, eps), gamma, beta, None)
    return astype(y, x.dtype) if is_half(x.dtype) and y.dtype != x.dtype else y


# (axes, eps, each array's type, shape and dtype) -> the k of _trailing, for the calls whose checks passed: they read
# shapes and dtypes alone, so a repeated problem pays a key and a lookup
_checked: dict = {}


def _kind(a):
    return None if a is None else (type(value_of(a)), tuple(a.shape), a.dtype)


def _layernorm_checks(x, gamma, beta, axes, eps, residual, bias):
    """:func:`layernorm`'s checks of its arguments (raising, naming the op); the ``k`` of :func:`_trailing`."""
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype):
        raise ValueError(f"layernorm: residual must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    for name, p in (("gamma", gamma), ("beta", beta), ("bias", bias)):
        if p is None:
            continue
        pshape, shape = tuple(p.shape), tuple(x.shape)
        if pshape != shape[len(shape) - len(pshape):]:   # else x's trailing shape
            try:
                ok = np.broadcast_shapes(tuple(x.shape), tuple(p.shape)) == tuple(x.shape)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"layernorm: {name} of shape {tuple(p.shape)} does not broadcast to x of shape "
                                 f"{tuple(x.shape)}")
    check_eps("layernorm", eps)
    dims = normalize_axis(axes, x.ndim, "layernorm")
    _require_values("layernorm", x, tuple(range(x.ndim)) if dims is None else dims, f"along axes {axes!r}")
    check_half_mix("layernorm", x=x, gamma=gamma, beta=beta, bias=bias)
    return _trailing(dims, x.ndim)


def _in_compute_type(p, x):
    """A half ``gamma``, ``beta`` or ``bias`` in ``x``'s compute type (float32 for halves and float32; exact), as the
    kernels read them: half parameters (a PyTorch-style half model) take the fused kernels too, not the composite,
    and get the same result from either. Their gradients come back in their own dtype."""
    if p is None or not is_half(p.dtype) or compute_dtype(x.dtype) == p.dtype:
        return p
    return astype(p, compute_dtype(x.dtype))


def _summed(x, residual, bias):
    """``x + residual + bias`` (each where given); the halves add in float32, as the kernels do."""
    if residual is None and bias is None:
        return x
    s = astype(x, np.float32) if is_half(x.dtype) else x
    if residual is not None:
        s = s + (astype(residual, s.dtype) if is_half(residual.dtype) else residual)
    return s if bias is None else s + bias


def _trailing(dims, ndim):
    """``k`` where ``dims`` are the last ``k`` axes (None: all), else 0."""
    if dims == (ndim - 1,):   # the last axis alone (dims come sorted from normalize_axis)
        return 1
    dims = tuple(range(ndim)) if dims is None else tuple(sorted(dims))
    return len(dims) if dims == tuple(range(ndim - len(dims), ndim)) else 0


def _one_tape_level(*args):
    """No argument is a Tracked of a Tracked, and the Tracked ones share one tape: the fused layer norm's rule
    sees plain arrays (a nested gradient runs the composite, whose statistics the outer tape follows)."""
    level = None
    for a in args:
        if is_tracked(a):
            if is_tracked(a.value) or level not in (None, a.level):
                return False
            level = a.level
    return True


def _layernorm_rows_impl(x, gamma, beta, residual, bias, k, eps):   # layernorm found the kernel takes the call
    return lookup("layernorm_forward", x)(x, gamma, beta, k, eps, residual, bias)[0]


def _layernorm_rows_rule(needs, x, gamma, beta, residual, bias, k, eps):
    y, mean, rstd = lookup("layernorm_forward", x)(x, gamma, beta, k, eps, residual, bias)

    def layernorm_pullback(dy):
        ds, dgamma, dbeta = layernorm_backward(dy, x, gamma, mean, rstd, k, needs[1] or needs[2], residual, bias)
        dbias = None
        if needs[4]:   # the bias is added to every row: its cotangent sums the rows, in the bias's dtype
            lead = tuple(range(ds.ndim - k))
            dbias = _sum(astype(ds, bias.dtype) if ds.dtype != bias.dtype else ds, lead)
        return ((ds if needs[0] else None), (dgamma if needs[1] else None), (dbeta if needs[2] else None),
                (ds if needs[3] else None), dbias, None, None)
    return y, layernorm_pullback


_layernorm_rows = Primitive("layernorm_rows", _layernorm_rows_rule, impl=_layernorm_rows_impl, needs_mask=True)


def _layernorm_backward_composite(dy, x, gamma, mean, rstd, k, need_params, residual=None, bias=None):
    """``(dx, dgamma, dbeta)`` of the layer norm over the last ``k`` axes, from the forward's per-row ``mean`` and
    ``rstd``, with fluxpy ops (computed in ``mean``'s dtype, ``dx`` rounded to ``x``'s); with ``residual``/``bias``
    the normalised rows are those of ``x + residual + bias`` and ``dx`` is their cotangent."""
    axes = tuple(range(x.ndim - k, x.ndim))
    lead = tuple(range(x.ndim - k))
    rows = x.shape[:x.ndim - k] + (1,) * k
    cdt = mean.dtype
    xc, dyc = astype(_summed(x, residual, bias), cdt), astype(dy, cdt)
    mu, rs = reshape(mean, rows), reshape(rstd, rows)
    xhat = (xc - mu) * rs
    g = dyc if gamma is None else dyc * gamma
    dx = rs * (g - _mean(g, axes, keepdims=True) - xhat * _mean(g * xhat, axes, keepdims=True))
    dx = astype(dx, x.dtype)
    if not need_params:
        return dx, None, None
    return dx, _sum(dyc * xhat, lead), _sum(dyc, lead)


layernorm_backward = fused_op("layernorm_backward", _layernorm_backward_composite, doc="""
    ``(dx, dgamma, dbeta)`` of :func:`layernorm` over the last ``k`` axes, from its per-row ``mean`` and ``rstd``
    (the GPU: one pass for ``dx`` and a deterministic two-level sum for ``dgamma``/``dbeta``); without
    ``need_params`` the last two are None.

    >>> import numpy as np
    >>> x = np.array([[1.0, 3.0]]); dx, dg, db = layernorm_backward(np.ones((1, 2)), x, None, np.array([2.0]),
    ...                                                           np.array([1.0]), 1, True)
    >>> dx, dg, db
    (array([[0., 0.]]), array([-1.,  1.]), array([1., 1.]))
    """)


def _channel_affine(name, x, xhat, gamma, beta):
    """``xhat * gamma + beta`` with ``(C,)`` parameters along axis 1, in ``x``'s dtype for halves."""
    check_half_mix(name, x=x, gamma=gamma, beta=beta)
    y = _affine(xhat, gamma, beta, _channel_shape(x))
    return astype(y, x.dtype) if is_half(x.dtype) and y.dtype != x.dtype else y


def groupnorm(x: Array, groups: int, gamma: Array | None = None, beta: Array | None = None,
              eps: float = 1e-5, act: Callable | None = None) -> Array:
    """Group norm: the ``C`` channels of each sample split into ``groups`` groups of ``C // groups`` consecutive
    channels, each group normalised over its channels and spatial axes, then ``* gamma + beta`` per channel, then
    the activation ``act`` (None for none).

    ``x`` is ``(N, C, ...)`` with ``C`` divisible by ``groups``; ``gamma`` and ``beta`` are ``(C,)`` or None. Flux's
    ``GroupNorm`` and PyTorch's ``group_norm`` (biased variance). ``groups == C`` is instance norm, ``groups == 1``
    layer norm over ``(C, ...)``. On the GPU one fused op each way (:mod:`fluxpy.kernels.cuda_groupnorm`, the
    activation inside), where the arguments are plain or of one tape level; the composite otherwise.

    >>> import numpy as np
    >>> x = np.array([[1.0, 3.0, 0.0, 10.0]])
    >>> groupnorm(x, 2, eps=0.0)
    array([[-1.,  1., -1.,  1.]])
    """
    _check_channel_params("groupnorm", x, gamma=gamma, beta=beta)
    check_eps("groupnorm", eps)
    c = x.shape[1]
    if not (isinstance(groups, (int, np.integer)) and not isinstance(groups, bool) and groups >= 1 and c % groups == 0):
        raise ValueError(f"groupnorm expects groups to be a positive int dividing x.shape[1] == {c}, got {groups!r}")
    groups = int(groups)
    grouped = reshape(x, (x.shape[0], groups, c // groups) + tuple(x.shape[2:]))
    axes = tuple(range(2, grouped.ndim))
    _require_values("groupnorm", grouped, axes, "per group (x.size // (x.shape[0] * groups))")
    act = None if act is identity else act
    if _one_tape_level(x, gamma, beta) and find("groupnorm_forward", value_of(x), value_of(gamma), value_of(beta),
                                                groups, eps, act) is not None:
        return _groupnorm_fused(x, gamma, beta, groups, eps, act)
    xhat = reshape(normalise(grouped, axes, eps), tuple(x.shape))
    y = _channel_affine("groupnorm", x, xhat, gamma, beta)
    return y if act is None else bias_act(y, None, act)


def _rmsnorm_rows_impl(x, gamma, k, eps):
    return find("rmsnorm_forward", x, gamma, k, eps)(x, gamma, k, eps)[0]


def _rmsnorm_rows_rule(needs, x, gamma, k, eps):
    y, rstd = find("rmsnorm_forward", x, gamma, k, eps)(x, gamma, k, eps)

    def rmsnorm_pullback(dy):
        dy = dy if dy.dtype == x.dtype else dy.astype(x.dtype)
        args = (dy, x, gamma, rstd, k, needs[1])
        if find("rmsnorm_backward", *args) is None:   # a broadcast or permuted cotangent: C order first
            args = (get_array_module(dy).ascontiguousarray(dy),) + args[1:]
        dx, dgamma = find("rmsnorm_backward", *args)(*args)
        return (dx if needs[0] else None), (dgamma if needs[1] else None), None, None
    return y, rmsnorm_pullback


# One kernel each way on the GPU (fluxpy.kernels.cuda_rmsnorm).
_rmsnorm_rows = Primitive("rmsnorm_rows", _rmsnorm_rows_rule, impl=_rmsnorm_rows_impl, needs_mask=True)


def rmsnorm(x: Array, gamma: Array | None = None, k: int = 1, eps: float = 1e-6) -> Array:
    """RMS norm over the last ``k`` axes: ``x / sqrt(mean(x**2) + eps) * gamma`` (``gamma`` of those axes' shape, or
    None). Half-precision ``x`` is normalised in float32 (``x**2`` would overflow float16) and returned in its own
    dtype. On the GPU one fused op each way (:mod:`fluxpy.kernels.cuda_rmsnorm`) where the arguments are plain or of
    one tape level; the composite otherwise. The op of :class:`fluxpy.layers.RMSNorm`.

    >>> import numpy as np
    >>> rmsnorm(np.array([[3.0, 4.0]]), eps=0.0).round(4)
    array([[0.8485, 1.1314]])
    """
    ndim = len(x.shape)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= ndim:
        raise ValueError(f"rmsnorm expects k, the normalised trailing axes, an int in 1..{ndim} (x of shape "
                         f"{tuple(x.shape)}), got {k!r}")
    if gamma is not None and tuple(gamma.shape) != tuple(x.shape[ndim - k:]):
        raise ValueError(f"rmsnorm expects gamma of shape {tuple(x.shape[ndim - k:])} (x's last {k} axes), got "
                         f"{tuple(gamma.shape)}")
    check_eps("rmsnorm", eps)
    if _one_tape_level(x, gamma) and find("rmsnorm_forward", value_of(x), value_of(gamma), k, eps) is not None:
        return _rmsnorm_rows(x, gamma, k, eps)
    xf = astype(x, np.float32) if is_half(x.dtype) else x
    y = xf / sqrt(_mean(xf * xf, tuple(range(-k, 0)), keepdims=True) + eps)
    if gamma is not None:
        y = y * (astype(gamma, y.dtype) if gamma.dtype != y.dtype else gamma)
    return astype(y, x.dtype) if y.dtype != x.dtype else y


def _groupnorm_fused_impl(x, gamma, beta, groups, eps, act):
    return find("groupnorm_forward", x, gamma, beta, groups, eps, act)(x, gamma, beta, groups, eps, act)[0]


def _groupnorm_fused_rule(needs, x, gamma, beta, groups, eps, act):
    y, mean, rstd = find("groupnorm_forward", x, gamma, beta, groups, eps, act)(x, gamma, beta, groups, eps, act)

    def groupnorm_pullback(dy):
        dy = dy if dy.dtype == x.dtype else dy.astype(x.dtype)
        args = (dy, x, gamma, beta, mean, rstd, groups, act, needs[1] or needs[2])
        dx, dgamma, dbeta = find("groupnorm_backward", *args)(*args)
        return ((dx if needs[0] else None), (dgamma if needs[1] else None), (dbeta if needs[2] else None),
                None, None, None)
    return y, groupnorm_pullback


_groupnorm_fused = Primitive("groupnorm_fused", _groupnorm_fused_rule, impl=_groupnorm_fused_impl,
                             needs_mask=True)


def instancenorm(x: Array, gamma: Array | None = None, beta: Array | None = None, eps: float = 1e-5) -> Array:
    """Instance norm: each sample's channels normalised separately over the spatial axes, then ``* gamma + beta``
    per channel.

    ``x`` is ``(N, C, S1, ...)`` with at least one spatial axis and more than one spatial value; ``gamma`` and
    ``beta`` are ``(C,)`` or None. Flux's ``InstanceNorm`` and PyTorch's ``instance_norm`` with batch statistics
    (biased variance).

    >>> import numpy as np
    >>> instancenorm(np.array([[[1.0, 3.0], [0.0, 10.0]]]), eps=0.0)
    array([[[-1.,  1.],
            [-1.,  1.]]])
    """
    _check_channel_params("instancenorm", x, gamma=gamma, beta=beta)
    check_eps("instancenorm", eps)
    axes = tuple(range(2, x.ndim))
    if not axes:
        raise ValueError(f"instancenorm expects x of shape (N, C, S1, ...) with a spatial axis, got {tuple(x.shape)}")
    _require_values("instancenorm", x, axes, "per instance and channel (spatial size)")
    c = int(x.shape[1])   # group norm of one channel a group: its kernels where they apply
    if _one_tape_level(x, gamma, beta) and find("groupnorm_forward", value_of(x), value_of(gamma), value_of(beta), c,
                                                eps, None) is not None:
        return _groupnorm_fused(x, gamma, beta, c, eps, None)
    return _channel_affine("instancenorm", x, normalise(x, axes, eps), gamma, beta)
