"""Matrix products: batched ``matmul`` with NumPy's rules (1-D operands, broadcast batch axes).

>>> import numpy as np
>>> from fluxpy import gradient
>>> a, b = np.ones((2, 3)), np.arange(3.0)
>>> gradient(lambda a, b: (a @ b).sum(), a, b)
(array([[0., 1., 2.],
       [0., 1., 2.]]), array([2., 2., 2.]))
"""
from __future__ import annotations

from ..autodiff import Primitive
from ..backend import Array, gpu_device
from ..capturing import refuse
from ..kernels import find
from ..kernels.halfs import is_half
from .shape import expand_dims, reshape, swapaxes, unbroadcast

__all__ = ["matmul", "dot"]


def _matmul_impl(a, b):
    kernel = find("matmul", a, b)
    if kernel is not None:
        return kernel(a, b)
    if gpu_device(a) is not None:
        refuse(f"matmul: {tuple(a.shape)} {a.dtype} @ {tuple(b.shape)} {b.dtype} runs as CuPy's own product (fluxpy's "
               f"cuBLAS binding takes float products within cuBLAS's 32-bit sizes)")
    try:
        return a @ b
    except ValueError:
        raise ValueError(f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not match "
                         "(the last axis of the first must equal the second-to-last of the second)") from None


def _as_matrices(a, b, dy):
    """Promote 1-D operands to matrices, as matmul does, and give ``dy`` the matching axes."""
    if a.ndim == 1:
        a = reshape(a, (1, a.shape[0]))
        dy = expand_dims(dy, -2 if b.ndim > 1 else 0)
    if b.ndim == 1:
        b = reshape(b, (b.shape[0], 1))
        dy = expand_dims(dy, -1)
    return a, b, dy


def _matmul_rule(needs, a, b):
    y = _matmul(a, b)

    def matmul_pullback(dy):
        a2, b2, dy2 = _as_matrices(a, b, dy)
        da = db = None
        if needs[0]:
            da = reshape(unbroadcast(_matmul(dy2, swapaxes(b2, -1, -2)), a2.shape), a.shape)
        if needs[1]:
            if b2.ndim == 2 and a2.ndim > 2:   # a batch against one matrix: one product over the stacked rows
                rows = reshape(a2, (-1, a2.shape[-1]))
                db = reshape(_matmul(swapaxes(rows, -1, -2), reshape(dy2, (-1, dy2.shape[-1]))), b.shape)
            else:
                db = reshape(unbroadcast(_matmul(swapaxes(a2, -1, -2), dy2), b2.shape), b.shape)
        return da, db
    return y, matmul_pullback


_matmul = Primitive("matmul", _matmul_rule, impl=_matmul_impl, needs_mask=True)


def matmul(a: Array, b: Array) -> Array:
    """The matrix product ``a @ b`` over the last two axes, batch axes broadcast.

    >>> import numpy as np
    >>> matmul(np.ones((5, 2, 3)), np.ones((3, 4))).shape
    (5, 2, 4)

    float16 and bfloat16 operands must share their dtype (the product accumulates in float32 and returns
    that dtype); a mix with another dtype is a ``TypeError``, raised before any kernel runs. On the GPU every float
    product, batched and broadcast ones included, forward and pullback, is one call of fluxpy's cuBLAS binding
    (:mod:`fluxpy.kernels.cublas`), which a CUDA-graph capture takes.
    """
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: operands must have at least one axis, got shapes {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    _check_half_mix(a, b)
    return _matmul(a, b)


def _is_half(dtype):
    return dtype is not None and is_half(dtype)


def _check_half_mix(a, b):
    """Raise where one operand is float16 or bfloat16 and the other has another dtype: NumPy would promote
    silently (bfloat16 @ float32 -> float32), the GPU kernels take one dtype."""
    da, db = getattr(a, "dtype", None), getattr(b, "dtype", None)
    if da != db and (_is_half(da) or _is_half(db)):
        raise TypeError(f"matmul expects a and b of one dtype when either is float16 or bfloat16, got a of shape "
                        f"{tuple(a.shape)} {da} and b of shape {tuple(b.shape)} {db}: convert one with astype")


def dot(a: Array, b: Array) -> Array:
    """The dot product of vectors or matrices, as ``numpy.dot`` (the same as ``matmul`` there).

    >>> import numpy as np
    >>> float(dot(np.ones(3), np.ones(3)))
    3.0
    """
    if a.ndim > 2 or b.ndim > 2:
        raise ValueError(f"dot: only vectors and matrices are supported, got shapes {tuple(a.shape)} and "
                         f"{tuple(b.shape)}; use matmul for batches")
    return matmul(a, b)
