"""NumPy kernels of the normalisations: layer norm over the last ``k`` axes, each way one kernel (the CPU's
``layernorm_forward`` and ``layernorm_backward``; the GPU's are :mod:`fluxpy.kernels.cuda_layernorm`), so that
``layernorm`` records one tape node on the CPU too instead of its composite's dozen; and batch norm's backward
(``batchnorm_backward``) in plain NumPy calls instead of a dozen fluxpy ops. float32 and float64; the halves keep
the composites.

>>> x = np.array([[1.0, 3.0], [0.0, 10.0]])
>>> y, mean, rstd = layernorm_forward(x, None, None, 1, 0.0)
>>> y, mean
(array([[-1.,  1.],
       [-1.,  1.]]), array([2., 5.]))
"""
from __future__ import annotations

import numpy as np

__all__ = ["layernorm_forward", "layernorm_backward", "supports", "backward_supports", "batchnorm_backward",
           "batchnorm_backward_supports"]

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


def batchnorm_backward(dy: np.ndarray, x: np.ndarray, y, gamma, beta, mean, invstd, eps, act, y_derivative) -> tuple:
    """``(dx, dgamma, dbeta)`` of batch norm over every axis but the channels' (axis 1), from the forward's
    per-channel ``mean`` and ``invstd``; ``dy`` first times ``y_derivative(y)`` where an activation's derivative is
    read from the kept output ``y`` (:func:`batchnorm_backward_supports` admits no other activation)."""
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


def batchnorm_backward_supports(dy, x, y, gamma, beta, mean, invstd, eps, act, y_derivative) -> bool:
    """NumPy float32/float64 ``dy`` and ``x`` of one dtype and shape, statistics and parameters in it, and no
    activation or one whose derivative reads the kept output."""
    if not (type(x) is np.ndarray and type(dy) is np.ndarray and x.dtype in _DTYPES and dy.dtype == x.dtype
            and dy.shape == x.shape and x.ndim >= 2):
        return False
    if act is not None and (y is None or y_derivative is None or type(y) is not np.ndarray):
        return False
    return all(p is None or (type(p) is np.ndarray and p.dtype == x.dtype) for p in (gamma, mean, invstd))


KERNELS = {"layernorm_forward": (layernorm_forward, supports),
           "layernorm_backward": (layernorm_backward, backward_supports),
           "batchnorm_backward": (batchnorm_backward, batchnorm_backward_supports)}
