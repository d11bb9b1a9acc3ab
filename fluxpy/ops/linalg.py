"""Matrix products: batched ``matmul`` with NumPy's rules (1-D operands, broadcast batch axes); vector and matrix
norms (``norm``, as ``numpy.linalg.norm``) and singular values (``svdvals``).

>>> import numpy as np
>>> from fluxpy import gradient
>>> a, b = np.ones((2, 3)), np.arange(3.0)
>>> gradient(lambda a, b: (a @ b).sum(), a, b)
(array([[0., 1., 2.],
       [0., 1., 2.]]), array([2., 2., 2.]))
"""
from __future__ import annotations

import numbers

import numpy as np

from ..autodiff import Primitive, is_tracked, value_of
from ..backend import Array, get_array_module, gpu_device
from ..capturing import refuse
from ..kernels import find
from ..kernels.halfs import is_half
from .basic import abs as abs_
from .basic import maximum, power, sign, where
from .reduce import max as max_
from .reduce import min as min_
from .reduce import sum as sum_
from .shape import expand_dims, reshape, swapaxes, transpose, unbroadcast

__all__ = ["matmul", "dot", "norm", "svdvals", "cosine_similarity", "pairwise_distance"]


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
            if a2.ndim == 2 and b2.ndim == 2 and _transposed(a):   # (b dy^T)^T: da laid out as a is
                da = swapaxes(_matmul(b2, swapaxes(dy2, -1, -2)), -1, -2)
            else:
                da = reshape(unbroadcast(_matmul(dy2, swapaxes(b2, -1, -2)), a2.shape), a.shape)
        if needs[1]:
            if b2.ndim == 2 and a2.ndim >= 2:   # the batch's rows stacked against one matrix: one product
                rows = reshape(a2, (-1, a2.shape[-1]))
                dy_rows = reshape(dy2, (-1, dy2.shape[-1]))
                if _transposed(b):   # (dy^T rows)^T: db laid out as b is (a weight used as w.T)
                    db = swapaxes(_matmul(swapaxes(dy_rows, -1, -2), rows), -1, -2)
                else:
                    db = reshape(_matmul(swapaxes(rows, -1, -2), dy_rows), b.shape)
            else:
                db = reshape(unbroadcast(_matmul(swapaxes(a2, -1, -2), dy2), b2.shape), b.shape)
        return da, db
    return y, matmul_pullback


def _transposed(a) -> bool:
    """Whether ``a`` is a 2-D array in Fortran order only (the transpose of a C-order one, as ``w.T``): its
    cotangent is formed as the transpose of a C-order product, the same product's cost, so that it reaches the
    C-order array behind it in that array's layout (no copy where the optimiser steps it).

    >>> import numpy as np
    >>> _transposed(np.ones((3, 2)).T), _transposed(np.ones((3, 2))), _transposed(np.ones((3, 1)).T)
    (True, False, False)
    """
    flags = getattr(a, "flags", None)
    return a.ndim == 2 and flags is not None and flags.f_contiguous and not flags.c_contiguous


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


# ---------------------------------------------------------------------------------------------
# Norms


def _vector_norm_impl(x, p, axes, keepdims):
    xp = get_array_module(x)
    a = xp.abs(x)
    if p == 2:
        return xp.sqrt(xp.sum(x * x, axis=axes, keepdims=keepdims))
    if p == np.inf:
        return xp.max(a, axis=axes, keepdims=keepdims)
    if p == -np.inf:
        return xp.min(a, axis=axes, keepdims=keepdims)
    if p == 0:
        return xp.sum(x != 0, axis=axes, keepdims=keepdims).astype(x.dtype)
    if p == 1:
        return xp.sum(a, axis=axes, keepdims=keepdims)
    with np.errstate(divide="ignore"):   # |0|^p for p < 0 is inf, and the norm 0, as NumPy's and PyTorch's
        return xp.sum(a ** p, axis=axes, keepdims=keepdims) ** (1.0 / p)


def _vector_norm_rule(x, p, axes, keepdims):
    y = _vector_norm(x, p, axes, keepdims)

    def vector_norm_pullback(dy):
        kept = tuple(1 if a in axes else n for a, n in enumerate(x.shape))
        g = reshape(dy, kept)
        n = reshape(y, kept) if not is_tracked(x) else _vector_norm(x, p, axes, True)   # x tracked: n depends on it
        return _vector_norm_grad(x, p, axes, g, n), None, None, None
    return y, vector_norm_pullback


def _vector_norm_grad(x, p, axes, g, n):
    """PyTorch's ``norm_backward``: the subgradient 0 where the norm is 0, ties of an inf-norm share the gradient."""
    xv, nv = value_of(x), value_of(n)
    xp = get_array_module(xv)
    if p == 0:
        return xp.zeros_like(xv)
    if p == 1:
        return sign(x) * g
    if p in (np.inf, -np.inf):
        hits = (xp.abs(xv) == nv) | xp.isnan(xv)
        share = hits / xp.sum(hits, axis=axes, keepdims=True)
        return sign(x) * g * share.astype(xv.dtype)
    if p < 1:   # |x|^(p-1) is infinite at x == 0, where the gradient is taken as 0
        zero = xv == 0
        return sign(x) * where(zero, 0.0, power(where(zero, 1.0, abs_(x)), p - 1)) * g * power(n, 1 - p)
    nonzero = nv != 0
    scale = where(nonzero, g / power(where(nonzero, n, 1.0), p - 1), 0.0)
    if p == 2:
        return x * scale
    if p < 2:
        return sign(x) * power(abs_(x), p - 1) * scale
    return x * power(abs_(x), p - 2) * scale


_vector_norm = Primitive("vector_norm", _vector_norm_rule, impl=_vector_norm_impl)


def _svdvals_rule(x):
    xp = get_array_module(x)
    u, s, vh = xp.linalg.svd(x, full_matrices=False)

    def svdvals_pullback(ds):   # d(sigma_i) = u_i^T dA v_i: the gradient is U diag(ds) V^T (once differentiable)
        return (matmul(u * expand_dims(ds, -2), vh),)
    return s, svdvals_pullback


def _svdvals_impl(x):
    if gpu_device(x) is not None:
        refuse(f"svdvals of {tuple(x.shape)}: CuPy's SVD (cuSOLVER) allocates its workspace on the host's call")
    return get_array_module(x).linalg.svd(x, compute_uv=False)


_svdvals = Primitive("svdvals", _svdvals_rule, impl=_svdvals_impl)


def svdvals(x: Array) -> Array:
    """The singular values of the matrices in the last two axes of ``x``, largest first (``torch.linalg.svdvals``).
    The gradient is ``U diag(ds) V^T``, exact where the singular values are distinct (a subgradient where they
    are not); it differentiates once.

    >>> import numpy as np
    >>> svdvals(np.diag([1.0, 3.0, 2.0]))
    array([3., 2., 1.])
    """
    if x.ndim < 2:
        raise ValueError(f"svdvals expects an array of 2 or more axes (matrices in the last two), got shape "
                         f"{tuple(x.shape)}")
    return _svdvals(x)


_VECTOR_ORDS = "None, 2, 1, inf, -inf, 0 or another number"


def _axes_of(x, axis):
    if axis is None:
        return None
    axes = (axis,) if isinstance(axis, numbers.Integral) and not isinstance(axis, bool) else axis
    ok = isinstance(axes, (tuple, list)) and len(axes) in (1, 2) and all(
        isinstance(a, numbers.Integral) and not isinstance(a, bool) and -x.ndim <= a < x.ndim for a in axes)
    if not ok or len({int(a) % x.ndim for a in axes}) != len(axes):
        raise ValueError(f"norm expects axis None, an int or a pair of distinct ints in [-{x.ndim}, {x.ndim}), got "
                         f"{axis!r} for an array of shape {tuple(x.shape)}")
    return tuple(int(a) % x.ndim for a in axes)


def norm(x: Array, ord: float | str | None = None, axis: int | tuple[int, int] | None = None,
         keepdims: bool = False) -> Array:
    """The vector or matrix norm of ``x``, as ``numpy.linalg.norm`` and ``torch.linalg.norm``.

    ``axis`` an int: vector norms along it, ``ord`` None or 2 (Euclidean), 1, ``inf`` (largest ``|x|``),
    ``-inf`` (smallest), 0 (the number of nonzeros) or any other number ``p``, ``sum(|x|^p)^(1/p)``. ``axis`` a
    pair: matrix norms over those two axes, ``ord`` None or ``"fro"`` (Frobenius), ``"nuc"`` (the sum of the
    singular values), 1 / -1 (the largest / smallest column sum of ``|x|``), ``inf`` / ``-inf`` (row sums), 2 / -2
    (the largest / smallest singular value). ``axis=None``: the 2-norm of all entries when ``ord`` is None, else
    ``x`` must be a vector or a matrix. ``keepdims`` keeps the reduced axes with size 1.

    The gradient is PyTorch's: 0 (a subgradient, never NaN) where the norm is 0, shared between ties of the
    ``inf`` norms and of the matrix norms' maxima; the singular-value norms differentiate once (:func:`svdvals`).

    >>> import numpy as np
    >>> from fluxpy import gradient
    >>> x = np.array([[3.0, -4.0], [0.0, 0.0]])
    >>> float(norm(x)), float(norm(x, 1)), norm(x, axis=1), norm(x, np.inf, axis=1)
    (5.0, 4.0, array([5., 0.]), array([4., 0.]))
    >>> gradient(lambda x: norm(x, axis=1).sum(), x)[0]
    array([[ 0.6, -0.8],
           [ 0. ,  0. ]])
    """
    if not hasattr(x, "shape"):
        raise TypeError(f"norm expects an array, got a {type(x).__name__}")
    axes = _axes_of(x, axis)
    if axes is None:
        if ord is None:
            return _vector_norm(x, 2, tuple(range(x.ndim)), bool(keepdims))
        if x.ndim not in (1, 2):
            raise ValueError(f"norm with ord={ord!r} and axis=None expects a vector or a matrix, got shape "
                             f"{tuple(x.shape)}: give axis")
        axes = tuple(range(x.ndim))
    if len(axes) == 1:
        if isinstance(ord, str) or not (ord is None or isinstance(ord, numbers.Real)):
            raise ValueError(f"norm expects a vector ord, {_VECTOR_ORDS}, got {ord!r}")
        return _vector_norm(x, 2 if ord is None else float(ord), axes, bool(keepdims))
    return _matrix_norm(x, ord, axes, bool(keepdims))


def _matrix_norm(x, ord, axes, keepdims):
    if ord is None or ord == "fro":
        return _vector_norm(x, 2, axes, keepdims)
    valid = ord == "nuc" if isinstance(ord, str) else isinstance(ord, numbers.Real) and ord in (1, -1, 2, -2, np.inf,
                                                                                                 -np.inf)
    if not valid:
        raise ValueError(f"norm expects a matrix ord, None, 'fro', 'nuc', 1, -1, 2, -2, inf or -inf, got {ord!r}")
    kept = tuple(1 if a in axes else n for a, n in enumerate(x.shape))
    if ord in (1, -1, np.inf, -np.inf):   # the extreme column (1) or row (inf) sum of |x|
        summed, over = (axes[0], axes[1]) if abs(ord) == 1 else (axes[1], axes[0])
        y = (max_ if ord > 0 else min_)(sum_(abs_(x), axis=summed, keepdims=True), axis=over, keepdims=True)
    else:
        s = svdvals(transpose(x, tuple(a for a in range(x.ndim) if a not in axes) + axes))
        y = reshape(sum_(s, axis=-1) if ord == "nuc" else (max_ if ord == 2 else min_)(s, axis=-1), kept)
    return y if keepdims else reshape(y, tuple(n for a, n in enumerate(x.shape) if a not in axes))


def _check_pair(who, a, b):
    if not (hasattr(a, "shape") and hasattr(b, "shape")):
        raise TypeError(f"{who} expects two arrays, got a {type(a).__name__} and a {type(b).__name__}")
    try:
        return np.broadcast_shapes(tuple(a.shape), tuple(b.shape))
    except ValueError:
        raise ValueError(f"{who}: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be broadcast together") from None


def cosine_similarity(a: Array, b: Array, axis: int = -1, eps: float = 1e-8) -> Array:
    """The cosine of the angle between ``a`` and ``b`` along ``axis`` (broadcast together), PyTorch's
    ``F.cosine_similarity`` (whose default ``dim`` is 1; here the last axis, the features of ``(N, features)``): each
    divided by its 2-norm clamped below at ``eps``, then the sum of the products.

    >>> import numpy as np
    >>> cosine_similarity(np.array([[1.0, 0.0], [1.0, 1.0]]), np.array([[0.0, 2.0], [3.0, 3.0]])).round(6)
    array([0., 1.])
    """
    shape = _check_pair("cosine_similarity", a, b)
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"cosine_similarity: axis {axis} is out of range for the broadcast shape {shape}")
    an = maximum(norm(a, axis=axis, keepdims=True), eps)
    bn = maximum(norm(b, axis=axis, keepdims=True), eps)
    return sum_((a / an) * (b / bn), axis=axis)


def pairwise_distance(a: Array, b: Array, p: float = 2.0, eps: float = 1e-6, keepdims: bool = False) -> Array:
    """The ``p``-norm of ``a - b + eps`` along the last axis (broadcast together), PyTorch's ``F.pairwise_distance``
    (``eps`` keeps the gradient finite where ``a == b``).

    >>> import numpy as np
    >>> float(pairwise_distance(np.array([0.0, 0.0]), np.array([3.0, 4.0]), eps=0.0))
    5.0
    """
    _check_pair("pairwise_distance", a, b)
    return norm(a - b + eps, p, axis=-1, keepdims=keepdims)
