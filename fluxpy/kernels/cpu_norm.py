"""NumPy kernels of the normalisations: layer norm over the last ``k`` axes, each way one kernel (the CPU's
``layernorm_forward`` and ``layernorm_backward``; the GPU's are :mod:`fluxpy.kernels.cuda_layernorm`), so that
``layernorm`` records one tape node on the CPU too instead of its composite's dozen; and batch norm's backward
(``batchnorm_backward``) in plain NumPy calls instead of a dozen fluxpy ops. float32 and float64; the halves keep
the composites.

Large float32 batch norms in C order with spatial axes (``batchnorm_forward``, and the backward) take the
per-channel sums from NumPy and make their passes that write memory through oneDNN
(:func:`fluxpy.kernels.onednn.scale_shift` and :func:`~fluxpy.kernels.onednn.batchnorm_dx`: one pass each, on its
threads, relu and relu6 fused, each way), where it is installed: the composite's mean and biased variance, the sums
accumulated in float64 across rows.

>>> x = np.array([[1.0, 3.0], [0.0, 10.0]])
>>> y, mean, rstd = layernorm_forward(x, None, None, 1, 0.0)
>>> y, mean
(array([[-1.,  1.],
       [-1.,  1.]]), array([2., 5.]))
"""
from __future__ import annotations

import numpy as np

from ..journal import keep_copies
from . import onednn

__all__ = ["layernorm_forward", "layernorm_backward", "supports", "backward_supports", "batchnorm_forward",
           "batchnorm_forward_supports", "batchnorm_backward", "batchnorm_backward_supports", "update_running"]

_DTYPES = (np.float32, np.float64)


def _rows(a, k):
    """``a`` as ``(rows, length)``, the last ``k`` axes one row."""
    length = int(np.prod(a.shape[a.ndim - k:], dtype=np.int64))
    return a.reshape(-1, length)


def _summed_rows(x, k, residual, bias):
    s = x if residual is None else x + residual
    s = s if bias is None else s + bias
    return _rows(s, k)


def layernorm_forward(x: np.ndarray, gamma, beta, k: int, eps: float, residual=None, bias=None) -> tuple:
    """``(y, mean, rstd)``: ``y`` of ``x``'s shape and dtype, ``mean`` and ``rstd`` one per row, of the rows of
    ``x + residual + bias`` (each where given) normalised, then ``* gamma + beta``."""
    rows = _summed_rows(x, k, residual, bias)
    inv = 1.0 / rows.shape[1]   # sums times 1/length: ndarray.mean's Python layer costs more than a small row
    mean = rows.sum(axis=1) * inv
    centred = rows - mean[:, None]
    rstd = 1.0 / np.sqrt(np.square(centred).sum(axis=1) * inv + eps)
    y = centred
    y *= rstd[:, None]
    if gamma is not None:
        y *= gamma.reshape(-1)
    if beta is not None:
        y += beta.reshape(-1)
    return y.reshape(x.shape), mean, rstd.astype(x.dtype, copy=False)


def layernorm_backward(dy: np.ndarray, x: np.ndarray, gamma, mean, rstd, k: int, need_params: bool = True,
                       residual=None, bias=None) -> tuple:
    """``(dx, dgamma, dbeta)`` (the last two None without ``need_params``) from the forward's ``mean``/``rstd``;
    with ``residual``/``bias``, ``dx`` is the cotangent of the sum ``x + residual + bias`` (recomputed)."""
    rs = rstd[:, None]
    xhat = (_summed_rows(x, k, residual, bias) - mean[:, None]) * rs
    g = _rows(dy, k)
    gg = g if gamma is None else g * gamma.reshape(-1)
    inv = 1.0 / g.shape[1]
    dx = gg - gg.sum(axis=1, keepdims=True) * inv
    dx -= xhat * ((gg * xhat).sum(axis=1, keepdims=True) * inv)
    dx *= rs
    if not need_params:
        return dx.reshape(x.shape), None, None
    shape = x.shape[x.ndim - k:]
    return dx.reshape(x.shape), (g * xhat).sum(axis=0).reshape(shape), g.sum(axis=0).reshape(shape)


def supports(x, gamma, beta, k, eps, residual=None, bias=None) -> bool:
    """NumPy float32/float64 ``x`` normalised over its last ``k`` axes, ``gamma``/``beta``/``bias`` None or arrays
    of those axes' shape and ``x``'s dtype, ``residual`` None or like ``x``."""
    if type(x) is not np.ndarray or x.dtype not in _DTYPES or not 1 <= k <= x.ndim or x.size == 0:
        return False
    if residual is not None and (type(residual) is not np.ndarray or residual.dtype != x.dtype
                                 or residual.shape != x.shape):
        return False
    shape = x.shape[x.ndim - k:]
    return all(p is None or (type(p) is np.ndarray and p.shape == shape and p.dtype == x.dtype)
               for p in (gamma, beta, bias))


def backward_supports(dy, x, gamma, mean, rstd, k, need_params=True, residual=None, bias=None) -> bool:
    """The calls :func:`layernorm_backward` takes: the forward's arguments, ``dy`` like ``x``, ``mean`` and ``rstd``
    one value a row in ``x``'s dtype."""
    if not (type(dy) is np.ndarray and dy.dtype == x.dtype and dy.shape == x.shape
            and supports(x, gamma, None, k, 0.0, residual, bias)):
        return False
    rows = x.size // max(int(np.prod(x.shape[x.ndim - k:], dtype=np.int64)), 1)
    return all(type(s) is np.ndarray and s.dtype == x.dtype and s.shape == (rows,) for s in (mean, rstd))


def update_running(running_mean, running_var, mean, var, momentum: float, m: int) -> None:
    """``running = (1 - momentum) * running + momentum * batch`` in place, the variance unbiased (``var * m / (m -
    1)``, ``var`` the biased variance of ``m`` values); nothing where ``running_mean`` is None. Arrays of any module
    (the ops' composites use it too). A step's journal waiting for their old values gets copies first.

    >>> rm, rv = np.zeros(2), np.ones(2)
    >>> update_running(rm, rv, np.array([1.0, 2.0]), np.array([1.0, 1.0]), 0.5, 2)
    >>> rm.tolist(), rv.tolist()
    ([0.5, 1.0], [1.5, 1.5])
    """
    if running_mean is None:
        return
    keep_copies(running_mean, running_var)   # for a step's journal, where it waits for them (fluxpy.journal)
    running_mean *= 1 - momentum
    running_mean += (momentum * mean).astype(running_mean.dtype, copy=False)
    running_var *= 1 - momentum
    running_var += (momentum * m / (m - 1) * var).astype(running_var.dtype, copy=False)


def _is_relu(act) -> bool:
    """Whether ``act`` is fluxpy's relu primitive, known by its name (the kernels import no op)."""
    return getattr(act, "name", None) == "relu"


def _is_relu6(act) -> bool:
    """Whether ``act`` is fluxpy's relu6 (``fluxpy.ops.activations.relu6``), known by its names."""
    return getattr(act, "__name__", None) == "relu6" and getattr(act, "__module__", None) == "fluxpy.ops.activations"


def _onednn_takes(x, *arrays) -> bool:
    """Large float32 C-order ``x`` (and ``arrays``) with spatial axes, oneDNN there (without spatial axes NumPy's
    sums over the rows of ``(N, C)`` are as fast)."""
    return type(x) is np.ndarray and x.ndim >= 3 and onednn.takes_eltwise(x, *arrays)


def _channels(a):
    """``a`` as ``(N, C, S)``, its spatial axes one."""
    return a.reshape(a.shape[0], a.shape[1], -1)


def _channel_sums(a3):
    """``sum(a)`` per channel of an ``(N, C, S)`` array in float64, the rows of length ``S`` summed in ``a``'s
    dtype."""
    return np.einsum("ncs->nc", a3).astype(np.float64).sum(axis=0)


def _channel_dots(a3, b3):
    """``sum(a * b)`` per channel of ``(N, C, S)`` arrays in float64, the products of a row of length ``S`` summed
    in their dtype: as dot products (BLAS, no temporary) where the rows are long enough to pay for a call each."""
    if a3.shape[2] < 64:
        return np.einsum("ncs,ncs->nc", a3, b3).astype(np.float64).sum(axis=0)
    return (a3[..., None, :] @ b3[..., :, None]).astype(np.float64).sum(axis=(0, 2, 3))


def _f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


# The one-pass variance sum(x * x) / m - mean**2 loses float32 rounding of sum(x * x) times mean**2 / var: used where
# that ratio is at most this (its error then within a few times the two-pass one's), else the values are centred first.
_ONE_PASS_MAX_RATIO = 8.0


def batchnorm_forward(x: np.ndarray, gamma, beta, running_mean, running_var, momentum, eps, act,
                      residual=None) -> tuple:
    """``(y, mean, invstd)`` of batch norm in training of a large float32 C-order ``x`` (``(N, C, ...)``), ``y``
    through the activation ``act`` (None for none; relu and relu6 fused where no ``residual`` is added before it),
    the running statistics (where given) updated in place as :func:`fluxpy.ops.batchnorm.batchnorm` says. Two
    reads of ``x`` for the sums of ``x`` and ``x * x``, then one oneDNN pass ``y = x * scale + shift``; where the
    mean is large against the spread, the centred values are written first (the output's buffer) for a two-pass
    variance, and then scaled and shifted in place.

    >>> from fluxpy.ops.batchnorm import batchnorm
    >>> x = np.arange(1 << 16, dtype=np.float32).reshape(2, 2, -1)
    >>> y = batchnorm(x, eps=0.0)   # this kernel where oneDNN is installed, else the composite
    >>> float(abs(y.mean()).round(3)), float(y.std().round(3))
    (0.0, 1.0)
    """
    x3 = _channels(x)
    m = x3.shape[0] * x3.shape[2]
    mean64 = _channel_sums(x3) / m
    mean = mean64.astype(np.float32)
    var64 = _channel_dots(x3, x3) / m - mean64 * mean64
    centred = None
    if not (mean64 * mean64 <= _ONE_PASS_MAX_RATIO * var64).all():   # (NaN too) the two-pass variance
        centred = onednn.scale_shift(x, np.ones_like(mean), -mean)
        var64 = _channel_dots(*(_channels(centred),) * 2) / m
    var = var64.astype(np.float32)
    invstd = 1 / np.sqrt(var + eps)
    scale64 = invstd.astype(np.float64) * (1.0 if gamma is None else gamma)
    shift64 = np.zeros_like(mean64) if beta is None else beta.astype(np.float64)
    if centred is None:
        shift64 = shift64 - mean64 * scale64
    scale, shift = _f32(scale64), _f32(shift64)
    # oneDNN's relu and clip turn NaN into numbers: fused only where no value can be NaN (finite statistics mean a
    # finite x)
    finite = bool(np.isfinite(var64).all() and np.isfinite(scale).all() and np.isfinite(shift).all())
    fuse = finite and residual is None and (_is_relu(act) or _is_relu6(act))
    if fuse and _is_relu6(act):
        y = onednn.scale_shift_relu6(x if centred is None else centred, scale, shift, out=centred)
    else:
        y = onednn.scale_shift(x if centred is None else centred, scale, shift, fuse, out=centred)
    if residual is not None:
        y += residual
    if act is not None and not fuse:
        y = act(y)
    update_running(running_mean, running_var, mean, var, momentum, m)
    return y, mean, invstd


def batchnorm_forward_supports(x, gamma, beta, running_mean, running_var, momentum, eps, act,
                               residual=None) -> bool:
    """oneDNN there, a float32 C-order NumPy ``x`` with spatial axes of at least
    :data:`fluxpy.kernels.onednn.ELTWISE_MIN_SIZE` values, ``gamma`` and ``beta`` None or float32 NumPy arrays,
    a residual None or a NumPy array of ``x``'s shape and dtype (smaller ones, ``(N, C)``, other dtypes and
    layouts run the composite)."""
    if residual is not None and not (type(residual) is np.ndarray and residual.dtype == x.dtype
                                     and residual.shape == x.shape):
        return False
    return _onednn_takes(x) and all(p is None or (type(p) is np.ndarray and p.dtype == np.float32)
                                    for p in (gamma, beta))


def _onednn_backward(dy, x, y, gamma, mean, invstd, act, y_derivative):
    """:func:`batchnorm_backward` of large float32 C-order arrays: the per-channel sums ``sum(g)`` and
    ``sum(g * x)`` of ``g`` (``dy`` times the activation's derivative), then ``dx`` in one oneDNN pass as
    ``(x * p + g + q) * a``, the per-channel coefficients from the module docstring's formula in float64."""
    if act is None:
        g = dy
    elif _is_relu(act):
        g = onednn.relu_backward(dy, y)
    elif _is_relu6(act) and not np.isnan(y.max()):   # its one pass takes no NaN
        g = onednn.relu6_backward(dy, y)
    else:
        d = y_derivative(y)
        g = dy * (d if d.dtype in (np.bool_, dy.dtype) else d.astype(dy.dtype))
    g3, x3 = _channels(g), _channels(x)
    m = x3.shape[0] * x3.shape[2]
    dbeta = _channel_sums(g3)
    mean64, invstd64 = mean.astype(np.float64), invstd.astype(np.float64)
    dgamma = invstd64 * (_channel_dots(g3, x3) - mean64 * dbeta)   # sum(g * xhat)
    k = invstd64 * dgamma / m
    a = invstd64 if gamma is None else gamma * invstd64
    dx = onednn.batchnorm_dx(x, _f32(-k), g, _f32(k * mean64 - dbeta / m), _f32(a), into_g=g is not dy)
    return dx, dgamma.astype(np.float32), dbeta.astype(np.float32)


def batchnorm_backward(dy: np.ndarray, x: np.ndarray, y, gamma, beta, mean, invstd, eps, act, y_derivative) -> tuple:
    """``(dx, dgamma, dbeta)`` of batch norm over every axis but the channels' (axis 1), from the forward's
    per-channel ``mean`` and ``invstd``; ``dy`` first times ``y_derivative(y)`` where an activation's derivative is
    read from the kept output ``y`` (:func:`batchnorm_backward_supports` admits no other activation)."""
    if _onednn_takes(dy, x) and (act is None or onednn.takes_eltwise(y)):
        return _onednn_backward(dy, x, y, gamma, mean, invstd, act, y_derivative)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    axes = (0,) + tuple(range(2, x.ndim))
    m = x.size // x.shape[1]
    if act is not None:
        d = y_derivative(y)
        dy = dy * (d if d.dtype in (np.bool_, dy.dtype) else d.astype(dy.dtype))
    xhat = x - mean.reshape(shape)
    xhat *= invstd.reshape(shape)
    dbeta = dy.sum(axis=axes)
    dgamma = (dy * xhat).sum(axis=axes)
    scale = invstd if gamma is None else gamma * invstd
    dx = xhat
    dx *= (dgamma / m).reshape(shape)
    np.subtract(dy, dx, out=dx)
    dx -= (dbeta / m).reshape(shape)
    dx *= scale.reshape(shape)
    return dx, dgamma, dbeta


def batchnorm_backward_supports(dy, x, y, gamma, beta, mean, invstd, eps, act, y_derivative, residual=None) -> bool:
    """NumPy float32/float64 ``dy`` and ``x`` of one dtype and shape, statistics and parameters in it, and no
    activation or one whose derivative reads the kept output; no residual (the op asks with one only for an
    activation whose derivative needs the pre-activation, which these passes do not recompute)."""
    if residual is not None or not (type(x) is np.ndarray and type(dy) is np.ndarray and x.dtype in _DTYPES
                                    and dy.dtype == x.dtype and dy.shape == x.shape and x.ndim >= 2):
        return False
    if act is not None and (y is None or y_derivative is None or type(y) is not np.ndarray):
        return False
    return all(p is None or (type(p) is np.ndarray and p.dtype == x.dtype) for p in (gamma, mean, invstd))


KERNELS = {"layernorm_forward": (layernorm_forward, supports),
           "batchnorm_forward": (batchnorm_forward, batchnorm_forward_supports),
           "layernorm_backward": (layernorm_backward, backward_supports),
           "batchnorm_backward": (batchnorm_backward, batchnorm_backward_supports)}
