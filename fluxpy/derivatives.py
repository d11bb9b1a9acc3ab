"""Jacobians and Hessians, built from :func:`fluxpy.pullback` (Zygote's ``jacobian``, ``withjacobian``,
``hessian`` and ``diaghessian``): one pullback per output element, reverse over reverse for the Hessians. The
matrices are computed values, not differentiated further.

>>> import numpy as np
>>> y, (J,) = withjacobian(lambda x: x * x, np.array([1.0, 2.0]))
>>> y, J
(array([1., 4.]), array([[2., 0.],
       [0., 4.]]))
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .autodiff import pullback, value_of, withgradient_detailed
from .backend import get_array_module, is_float_array

__all__ = ["jacobian", "withjacobian", "hessian", "diaghessian"]


def _describe(y):
    v = value_of(y)
    return f"an array of shape {tuple(v.shape)} and dtype {v.dtype}" if hasattr(v, "shape") else f"a {type(v).__name__}"


def jacobian(f: Callable, *args: Any) -> tuple:
    """The Jacobian of ``f`` at ``args`` (float arrays or Python floats): one matrix per argument,
    ``J[i, j] = d y.ravel()[i] / d x.ravel()[j]`` of shape ``(y.size, x.size)``, as Zygote's ``jacobian`` (which
    flattens in Julia's column order; here NumPy's C order). One pullback per element of ``y`` (reverse mode),
    on the arrays' own device. The matrices are computed values: ``jacobian`` itself is not differentiated.

    >>> import numpy as np
    >>> jacobian(lambda x: x * x, np.array([1.0, 2.0]))
    (array([[2., 0.],
           [0., 4.]]),)
    """
    return withjacobian(f, *args)[1]


def withjacobian(f: Callable, *args: Any) -> tuple[Any, tuple]:
    """``(y, jacobians)``: the value ``y = f(*args)`` and :func:`jacobian`'s matrices, from one forward pass
    (Zygote's ``withjacobian``).

    >>> import numpy as np
    >>> y, (J,) = withjacobian(lambda x: 3 * x, np.array([1.0]))
    >>> y, J
    (array([3.]), array([[3.]]))
    """
    for i, a in enumerate(args):
        if not (is_float_array(a) or type(a) is float):
            raise TypeError(f"jacobian: argument {i} must be a float array or a Python float, got {_describe(a)}")
    y, back = pullback(f, *args)
    yv = value_of(y)
    if not (is_float_array(yv) or isinstance(yv, (float, np.floating))):
        raise TypeError(f"jacobian: f must return a float array or a Python float, got {_describe(yv)}")
    xp = get_array_module(yv, *args)
    yv = xp.asarray(yv)
    n = int(yv.size)
    mats = [xp.zeros((n, int(np.size(a))), dtype=np.result_type(yv.dtype, getattr(a, "dtype", np.float64)))
            for a in args]
    basis = xp.zeros(n, dtype=yv.dtype)
    for i in range(n):
        basis[i] = 1
        for k, g in enumerate(back(basis.reshape(yv.shape))):
            if g is not None:
                mats[k][i] = xp.asarray(g).reshape(-1)
        basis[i] = 0
    return y, tuple(mats)


def hessian(f: Callable, x: Any) -> Any:
    """The Hessian of scalar ``f`` at ``x`` (a float array or a Python float): ``H[i, j] = d^2 f / dx.ravel()[i]
    dx.ravel()[j]``, of shape ``(x.size, x.size)`` (Zygote's ``hessian``, NumPy's C order), the Jacobian of the
    gradient (reverse over reverse through the tape).

    >>> import numpy as np
    >>> hessian(lambda x: (x ** 3).sum(), np.array([1.0, 2.0]))
    array([[ 6.,  0.],
           [ 0., 12.]])
    """
    def grad(z):
        _, (g,), _ = withgradient_detailed(f, (z,), "hessian")   # errors (a non-scalar f) name hessian
        return z * 0 if g is None else g
    return jacobian(grad, x)[0]


def diaghessian(f: Callable, *args: Any) -> tuple:
    """The diagonal of the Hessian of scalar ``f`` with respect to each argument, shaped like it (Zygote's
    ``diaghessian``): ``d^2 f / dx_i^2`` for every entry ``x_i`` of each argument, the others held fixed.

    >>> import numpy as np
    >>> diaghessian(lambda x, y: (x ** 3).sum() * y ** 2, np.array([1.0, 2.0]), 3.0)
    (array([ 54., 108.]), 18.0)
    """
    out = []
    for k, a in enumerate(args):
        def alone(z, k=k):
            return f(*args[:k], z, *args[k + 1:])
        h = hessian(alone, a)
        d = h.diagonal().copy() if hasattr(h, "diagonal") else h
        out.append(float(d[0]) if type(a) is float else d.reshape(np.shape(a)))
    return tuple(out)
