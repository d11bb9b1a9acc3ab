"""NumPy kernels of the products. The Dense layer's op (:mod:`fluxpy.ops.dense`): the product, bias and activation
as one op forward, the weight and bias gradients as one op backward, so that a Dense layer records one tape node on
the CPU (the GPU's kernels are cuBLASLt's, :mod:`fluxpy.kernels.cublaslt`); float32 and float64, activations
``identity``, ``relu`` and ``gelu``; everything else runs the op's composite. The matmul op's CPU kernel
(:func:`matmul_cpu`): the halves in float32. Large float32 products go through oneDNN where it is installed
(:func:`fluxpy.kernels.onednn.matmul`).

>>> x, w, b = np.array([[1.0, -2.0]]), np.array([[1.0, 1.0], [2.0, 0.0]]), np.array([0.5, -1.0])
>>> dense_forward(x, w, b, "relu", False)
(array([[0., 1.]]), None)
"""
from __future__ import annotations

import math

import numpy as np

from . import onednn
from .halfs import is_half

__all__ = ["dense_forward", "dense_forward_supports", "dense_backward_weight", "dense_backward_weight_supports",
           "matmul_half", "matmul_half_supports", "matmul_cpu"]

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


def matmul_half(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` for float16 or bfloat16 NumPy arrays of one dtype, computed in float32 and rounded once to it.

    >>> import ml_dtypes
    >>> y = matmul_half(np.ones((2, 3), ml_dtypes.bfloat16), np.ones((3, 1), ml_dtypes.bfloat16))
    >>> y.dtype, y.ravel().tolist()
    (dtype(bfloat16), [3.0, 3.0])
    """
    return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)


def matmul_cpu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` on the CPU where NumPy's own product is not the one to run: the halves as :func:`matmul_half`,
    large float32 products through oneDNN (:func:`fluxpy.kernels.onednn.matmul`).

    >>> y = matmul_cpu(np.ones((2, 3), np.float16), np.ones((3, 1), np.float16))
    >>> y.dtype, y.ravel().tolist()
    (dtype('float16'), [3.0, 3.0])
    """
    return matmul_half(a, b) if is_half(a.dtype) else onednn.matmul(a, b)


def _matmul_cpu_supports(a, b) -> bool:
    return matmul_half_supports(a, b) or onednn.takes_matmul(a, b)


def matmul_half_supports(a, b) -> bool:
    """Whether :func:`matmul_half` takes ``(a, b)``: NumPy arrays of one half dtype.

    >>> matmul_half_supports(np.ones(2, np.float16), np.ones(2, np.float16))
    True
    >>> matmul_half_supports(np.ones(2, np.float16), np.ones(2, np.float32))
    False
    """
    return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and is_half(a.dtype)


KERNELS = {"dense_forward": (dense_forward, dense_forward_supports),
           "dense_backward_weight": (dense_backward_weight, dense_backward_weight_supports),
           "matmul": (matmul_cpu, _matmul_cpu_supports)}
