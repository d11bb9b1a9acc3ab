"""NumPy kernels of the Dense layer's op (:mod:`fluxpy.ops.dense`): the product, bias and activation as one op
forward, the weight and bias gradients as one op backward, so that a Dense layer records one tape node on the CPU
(the GPU's kernels are cuBLASLt's, :mod:`fluxpy.kernels.cublaslt`); large float32 products through oneDNN where it
is installed (:func:`fluxpy.kernels.onednn.matmul`). float32 and float64, activations ``identity``,
``relu`` and ``gelu``; everything else runs the op's composite.

>>> x, w, b = np.array([[1.0, -2.0]]), np.array([[1.0, 1.0], [2.0, 0.0]]), np.array([0.5, -1.0])
>>> dense_forward(x, w, b, "relu", False)
(array([[0., 1.]]), None)
"""
from __future__ import annotations

import math

import numpy as np

from . import onednn

__all__ = ["dense_forward", "dense_forward_supports", "dense_backward_weight", "dense_backward_weight_supports"]

_DTYPES = (np.float32, np.float64)
_GELU_LAMBDA, _GELU_ALPHA = math.sqrt(2 / math.pi), 0.044715


def _gelu(z):
    """:func:`fluxpy.ops.activations.gelu` (the tanh form; kernels do not import ops), the same operations in the same
    order (so the same bits), in one new array."""
    inner = z * z
    inner *= z
    inner *= _GELU_ALPHA
    inner += z
    inner *= _GELU_LAMBDA
    np.tanh(inner, out=inner)
    inner += 1
    inner *= 0.5 * z
    return inner


def dense_forward(x: np.ndarray, weight: np.ndarray, bias, name: str, save: bool) -> tuple:
    """``(act(x @ weight.T + bias), pre-activation or None)``: the pre-activation where ``save`` (gelu's derivative
    reads it; relu's reads the output)."""
    rows = x.reshape(-1, x.shape[-1])
    if onednn.takes_matmul(rows, weight.T):
        z = onednn.matmul(rows, weight.T).reshape(x.shape[:-1] + (weight.shape[0],))
    else:   # NumPy's product of x as it is: the composite's, to the bit
        z = np.matmul(x, weight.T)
    if bias is not None:
        z += bias
    if name == "relu":
        return np.maximum(z, 0, out=z), None
    if name == "gelu":
        return _gelu(z), (z if save else None)
    return z, None


def dense_forward_supports(x, weight, bias, name, save) -> bool:
    return (type(x) is np.ndarray and type(weight) is np.ndarray and x.dtype == weight.dtype and x.dtype in _DTYPES
            and (bias is None or (type(bias) is np.ndarray and bias.dtype == x.dtype))
            and name in ("identity", "relu", "gelu"))


def dense_backward_weight(dz: np.ndarray, x: np.ndarray, need_db: bool) -> tuple:
    """``(dz.T @ x, dz.sum(0) or None)`` for ``dz`` ``(rows, out)`` and ``x`` ``(rows, in)``."""
    dw = onednn.matmul(dz.T, x) if onednn.takes_matmul(dz.T, x) else np.matmul(dz.T, x)
    return dw, (dz.sum(axis=0) if need_db else None)


def dense_backward_weight_supports(dz, x, need_db) -> bool:
    return type(dz) is np.ndarray and type(x) is np.ndarray and dz.dtype == x.dtype and dz.dtype in _DTYPES


KERNELS = {"dense_forward": (dense_forward, dense_forward_supports),
           "dense_backward_weight": (dense_backward_weight, dense_backward_weight_supports)}
