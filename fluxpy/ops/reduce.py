"""Reductions: sum, mean, max, min over any axes, with ``keepdims``.

float16 and bfloat16 are reduced in float32 and rounded once to their own dtype (on the GPU by the
mapreducedim kernel, :mod:`fluxpy.kernels.reduce`).

>>> import numpy as np
>>> from fluxpy import gradient
>>> gradient(lambda x: x.max(axis=1).sum(), np.array([[1.0, 3.0], [2.0, 2.0]]))  # ties share
(array([[0. , 1. ],
       [0.5, 0.5]]),)
"""
from __future__ import annotations

import numpy as np

from ..autodiff import Primitive, value_of
from ..backend import Array
from ..kernels import find
from ..kernels.halfs import is_half
from .constants import device_constant
from .shape import broadcast_to, reshape

__all__ = ["sum", "mean", "max", "min", "normalize_axis", "check_half_mix"]


def check_half_mix(op: str, **arrays: Array) -> None:
    """Raise ``TypeError`` naming ``op`` where float16 meets bfloat16 among ``arrays`` (None skipped): they have no
    common dtype. A half with float32 or float64 is computed in the wider type.

    >>> import ml_dtypes
    >>> check_half_mix("maxpool_backward", dy=np.ones(1, np.float16), x=np.ones(1, ml_dtypes.bfloat16))
    Traceback (most recent call last):
    ...
    TypeError: maxpool_backward expects its arrays in one half type (float16 or bfloat16, each also with float32 or \
float64), got dy float16, x bfloat16
    """
    if len({a.dtype for a in arrays.values() if a is not None and is_half(a.dtype)}) < 2:
        return
    dtypes = {name: np.dtype(a.dtype) for name, a in arrays.items() if a is not None}
    if len({d for d in dtypes.values() if is_half(d)}) > 1:
        got = ", ".join(f"{name} {d.name}" for name, d in dtypes.items())
        raise TypeError(f"{op} expects its arrays in one half type (float16 or bfloat16, each also with float32 or "
                        f"float64), got {got}")


def normalize_axis(axis: int | tuple[int, ...] | None, ndim: int, op: str = "reduce") -> tuple[int, ...] | None:
    """``axis`` (None, an int or a tuple, negatives allowed) as a sorted tuple of axes, or None.

    >>> normalize_axis(-1, 3), normalize_axis((0, 2), 3), normalize_axis(None, 2)
    ((2,), (0, 2), None)
    """
    if axis is None:
        return None
    if type(axis) is int and -ndim <= axis < ndim:   # the common case, decided without the loop below
        return (axis % ndim,)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"{op}: axis {a} is out of range for an array with {ndim} dimensions")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: repeated axis in {axis}")
    return tuple(sorted(out))


def _kept_shape(shape, axes):
    """The shape of the reduction with ``keepdims=True``."""
    if axes is None:
        return (1,) * len(shape)
    return tuple(1 if i in axes else s for i, s in enumerate(shape))


def _expand_back(dy, shape, axes):
    """Broadcast a reduction's cotangent back over the reduced axes of ``shape``."""
    return broadcast_to(reshape(dy, _kept_shape(shape, axes)), shape)


def _sum_rule(x, axes, keepdims):
    shape = x.shape

    def sum_pullback(dy):
        return (_expand_back(dy, shape, axes),)
    return _sum(x, axes, keepdims), sum_pullback


def _sum_impl(x, axes, keepdims):
    kernel = find("sum", x)   # the kernel's supports() looks at x alone
    if kernel is None:
        if is_half(x.dtype):   # NumPy adds bfloat16 in bfloat16: add in float32, round once
            return x.astype(np.float32).sum(axis=axes, keepdims=keepdims).astype(x.dtype)
        return x.sum(axis=axes, keepdims=keepdims)
    all_axes = tuple(range(x.ndim)) if axes is None else axes
    shape = _kept_shape(x.shape, all_axes) if keepdims else tuple(
        s for i, s in enumerate(x.shape) if i not in all_axes)
    return kernel(x, all_axes, shape)


_sum = Primitive("sum", _sum_rule, impl=_sum_impl)


def sum(x: Array, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """The sum over ``axis`` (all axes by default).

    >>> import numpy as np
    >>> sum(np.ones((2, 3)), axis=0)
    array([2., 2., 2.])
    """
    return _sum(x, normalize_axis(axis, x.ndim, "sum"), keepdims)


def mean(x: Array, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """The mean over ``axis`` (all axes by default).

    >>> import numpy as np
    >>> mean(np.arange(4.0).reshape(2, 2), axis=1)
    array([0.5, 2.5])
    """
    axes = normalize_axis(axis, x.ndim, "mean")
    count = int(np.prod([x.shape[a] for a in axes])) if axes is not None else x.size
    return _sum(x, axes, keepdims) * _scalar_like(x, 1.0 / count)


def _scalar_like(x, value):
    """``value`` as a factor that keeps ``x``'s dtype: a Python float, or for the halves (which NumPy promotes to
    float32 when multiplied by a Python float) a 0-d array of their dtype.

    >>> import ml_dtypes
    >>> _scalar_like(np.ones(2, ml_dtypes.bfloat16), 0.5).dtype, _scalar_like(np.ones(2), 0.5)
    (dtype(bfloat16), 0.5)
    """
    v = value_of(x)
    if not is_half(v.dtype):
        return value
    # rounded by NumPy, copied to the device once (a copy inside a captured step would be a host transfer)
    return device_constant(("a half-precision factor", value), lambda: np.asarray(value), v)


def _extremum(name, method):
    prim = None

    def rule(x, axes, keepdims):
        y = prim(x, axes, keepdims)
        shape = x.shape

        def pullback(dy):
            # The cotangent goes to the elements equal to the extremum, shared evenly among ties.
            xv = value_of(x)
            yk = value_of(y).reshape(_kept_shape(shape, axes))
            hit = (xv == yk)
            weight = (hit / hit.sum(axis=axes, keepdims=True)).astype(xv.dtype)
            return (_expand_back(dy, shape, axes) * weight,)
        pullback.__name__ = f"{name}_pullback"
        return y, pullback

    def impl(x, axes, keepdims):
        if x.size == 0:
            raise ValueError(f"{name}: cannot reduce an empty array of shape {tuple(x.shape)}")
        if is_half(x.dtype):   # exact in float32, and CuPy's own bfloat16 reductions are experimental
            return getattr(x.astype(np.float32), method)(axis=axes, keepdims=keepdims).astype(x.dtype)
        return getattr(x, method)(axis=axes, keepdims=keepdims)
    prim = Primitive(name, rule, impl=impl)
    return prim


_max = _extremum("max", "max")
_min = _extremum("min", "min")


def max(x: Array, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """The largest element over ``axis`` (all axes by default); ties share the gradient.

    >>> import numpy as np
    >>> max(np.array([[1.0, 5.0], [7.0, 2.0]]), axis=1)
    array([5., 7.])
    """
    return _max(x, normalize_axis(axis, x.ndim, "max"), keepdims)


def min(x: Array, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """The smallest element over ``axis`` (all axes by default); ties share the gradient.

    >>> import numpy as np
    >>> min(np.array([[1.0, 5.0], [7.0, 2.0]]), axis=0)
    array([1., 2.])
    """
    return _min(x, normalize_axis(axis, x.ndim, "min"), keepdims)
