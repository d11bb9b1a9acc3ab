"""A scalar function applied elementwise with broadcasting, as one differentiable op: :func:`broadcast`.

The derivative is taken in forward mode inside the pullback (dual numbers, :mod:`fluxpy.dual`, as
Flux does with ForwardDiff), so the tape holds one node however long ``f`` is. Both directions go
through the kernel table: where a backend has a fused kernel for ``f`` (the GPU compiles one from
``f``'s code), ``broadcast`` is one kernel forward and :func:`broadcast_backward` one kernel back.

>>> import numpy as np
>>> broadcast(lambda x, b: np.maximum(x + b, 0.0), np.array([[-1.0, 2.0]]), np.array([0.5]))
array([[0. , 2.5]])
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .autodiff import Primitive
from .backend import Array, get_array_module
from .dual import cotangents
from .kernels import find, halfs
from .ops.fused import fused_op
from .ops.shape import broadcast_to, reduced_axes, unbroadcast

__all__ = ["broadcast", "broadcast_backward", "unbroadcast", "reduced_axes"]


def _broadcast_shape(op, xs):
    shapes = [tuple(getattr(x, "shape", ())) for x in xs]
    try:
        return np.broadcast_shapes(*shapes)
    except ValueError:
        raise ValueError(f"{op}: shapes {' and '.join(map(str, shapes))} cannot be broadcast together") from None


def _broadcast_impl(f, *xs):
    shape = _broadcast_shape("broadcast", xs)
    kernel = find("broadcast", f, *xs)
    y = kernel(f, *xs) if kernel is not None else _on_host(f, xs)
    if tuple(getattr(y, "shape", ())) != shape:
        if not hasattr(y, "shape"):   # f ignored its arguments: a constant, filled on the arrays' device
            return get_array_module(*xs).full(shape, y, dtype=np.asarray(y).dtype)
        y = broadcast_to(y, shape)
    return y


def _on_host(f, xs):
    """``f(*xs)``; with NumPy half arrays (bfloat16, which ml_dtypes promotes unevenly, and float16, which NumPy
    rounds after every operation) in float32, the result rounded once to
    :func:`fluxpy.kernels.halfs.result_dtype`, as the GPU's fused kernel computes it."""
    if not _host_halves(xs):
        return f(*xs)
    out = halfs.result_dtype(f, [getattr(x, "dtype", None) if hasattr(x, "shape") else None for x in xs])
    return np.asarray(f(*[_float32(x) for x in xs])).astype(out)


def _host_halves(xs):
    return any(isinstance(x, np.ndarray) and x.dtype in halfs.HALVES for x in xs)


def _float32(x):
    return x.astype(np.float32) if isinstance(x, np.ndarray) and x.dtype in halfs.HALVES else x


def _broadcast_cotangents(f, wanted, dy, *xs):
    if _host_halves(xs) or _host_halves([dy]):
        grads = cotangents(f, [_float32(x) for x in xs], wanted, _float32(dy))
        return [None if g is None else np.asarray(g).astype(dy.dtype) for g in grads]
    return cotangents(f, xs, wanted, dy)


broadcast_backward = fused_op("broadcast_backward", _broadcast_cotangents, doc="""
    The cotangents of :func:`broadcast`, ``[dy * ∂f/∂x_i for i in wanted]``, unreduced (the broadcast
    shape), ``None`` where ``f`` ignores ``x_i``; one kernel on the GPU.

    >>> import numpy as np
    >>> broadcast_backward(lambda x, y: x * y, (0, 1), np.ones(2), np.array([2.0, 3.0]), np.array(4.0))
    [array([4., 4.]), array([2., 3.])]
    """)


def _broadcast_rule(needs, f, *xs):
    y = _broadcast(f, *xs)
    shapes = [tuple(getattr(x, "shape", ())) for x in xs]
    wanted = tuple(i for i, n in enumerate(needs[1:]) if n)

    def broadcast_pullback(dy):
        grads = [None] * len(xs)
        for i, g in zip(wanted, broadcast_backward(f, wanted, dy, *xs)):
            if g is not None:
                grads[i] = unbroadcast(g, shapes[i])
        return (None, *grads)
    return y, broadcast_pullback


_broadcast = Primitive("broadcast", _broadcast_rule, impl=_broadcast_impl, needs_mask=True)


def broadcast(f: Callable, *xs: Array) -> Array:
    """``f`` applied elementwise with NumPy broadcasting, as one differentiable op.

    ``f`` is a scalar function written with arithmetic and NumPy elementwise functions
    (``np.exp``, ``np.tanh``, ``np.maximum``, ``np.where`` on comparisons, ...). Its derivative
    is taken in forward mode (dual numbers) inside the pullback. Shapes that cannot broadcast
    raise an error naming them.

    >>> import numpy as np
    >>> from fluxpy import gradient
    >>> x, b = np.array([[-1.0, 2.0]]), np.array([0.5])
    >>> broadcast(lambda x, b: np.maximum(x + b, 0.0), x, b)
    array([[0. , 2.5]])
    >>> gradient(lambda b: broadcast(lambda x, b: np.tanh(x * b), x, b).sum(), b)[0].shape
    (1,)
    """
    _broadcast_shape("broadcast", xs)
    return _broadcast(f, *xs)
