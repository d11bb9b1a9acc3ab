"""NNlib's padding functions (``src/padding.jl``): ``pad_constant``, ``pad_zeros``, ``pad_reflect``, ``pad_repeat``
(PyTorch's "replicate"), ``pad_symmetric`` and ``pad_circular``, differentiable.

Each pads the axes ``dims`` of ``x``. ``pad`` is an int (both sides of every axis in ``dims``), one int per axis in
``dims`` (both sides), or a ``(before, after)`` pair per axis in ``dims``, flattened, in axis order (``(top,
bottom, left, right)`` for the two spatial axes of an image, as the convolutions' ``pad``). Axes are fluxpy's
(NCHW): Flux's ``dims=1`` (W) is the last axis here. Without ``dims``, ``pad_constant`` and ``pad_zeros`` pad every
axis, as NNlib's; the others pad the spatial axes (all but the first two) for an int ``pad``, and the last
``len(pad) // 2`` axes for a tuple of pairs (NNlib's first ``n``, in its WHCN order).

The border modes are made of slices, flips and one concatenation per axis, so their gradients (a border entry's
cotangent added to the entry it copies) and second derivatives come from those ops, and on the GPU they run through
the same kernels, with no index array copied from the host.

>>> import numpy as np
>>> x = np.arange(3.0).reshape(1, 1, 3)
>>> pad_reflect(x, 2), pad_repeat(x, (1, 2)), pad_circular(x, 1)
(array([[[2., 1., 0., 1., 2., 1., 0.]]]), array([[[0., 0., 1., 2., 2., 2.]]]), array([[[2., 0., 1., 2., 0.]]]))
"""
from __future__ import annotations

import numbers

from ..backend import Array
from .numeric import flip
from .numeric import pad as constant_pad
from .shape import broadcast_to, concatenate, getitem

__all__ = ["pad_constant", "pad_zeros", "pad_reflect", "pad_repeat", "pad_symmetric", "pad_circular",
           "pad_widths_along"]


def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def pad_widths_along(op: str, x: Array, pad: int | tuple[int, ...], dims: int | tuple[int, ...] | None,
                     every_axis: bool) -> dict[int, tuple[int, int]]:
    """``{axis: (before, after)}`` for ``pad`` and ``dims`` as the module docstring says; ``every_axis``: the
    default ``dims`` are all axes (``pad_constant``), else the spatial ones. A ``ValueError`` naming ``op``.

    >>> import numpy as np
    >>> pad_widths_along("pad_reflect", np.ones((1, 1, 4, 4)), (1, 2, 3, 4), None, False)
    {2: (1, 2), 3: (3, 4)}
    """
    nd = len(x.shape)
    given = (pad,) if _is_int(pad) else tuple(pad) if isinstance(pad, (tuple, list)) else None
    if given is None or not given or not all(_is_int(p) and p >= 0 for p in given):
        raise ValueError(f"{op} expects pad, a non-negative int or a tuple of them, got {pad!r}")
    if dims is None:
        if every_axis or len(given) == 1:
            axes = tuple(range(nd)) if every_axis else tuple(range(2, nd))
        else:
            axes = tuple(range(nd - len(given) // 2, nd)) if len(given) % 2 == 0 and len(given) // 2 <= nd else None
            if axes is None:
                raise ValueError(f"{op} expects pad, (before, after) pairs for the last axes of x of shape "
                                 f"{tuple(x.shape)} (or give dims), got {pad!r}")
    else:
        axes = (dims,) if _is_int(dims) else tuple(dims) if isinstance(dims, (tuple, list)) else None
        if axes is None or not all(_is_int(a) and -nd <= a < nd for a in axes) or \
                len({a % nd for a in axes}) != len(axes):
            raise ValueError(f"{op} expects dims, distinct axes of x of shape {tuple(x.shape)}, got {dims!r}")
        axes = tuple(int(a) % nd for a in axes)
    if not axes:
        raise ValueError(f"{op} expects dims: x of shape {tuple(x.shape)} has no spatial axis (the axes after "
                         f"the first two)")
    if len(given) == 1:
        pairs = [(given[0], given[0])] * len(axes)
    elif len(given) == len(axes):
        pairs = [(p, p) for p in given]
    elif len(given) == 2 * len(axes):
        pairs = [(given[2 * k], given[2 * k + 1]) for k in range(len(axes))]
    else:
        raise ValueError(f"{op} expects pad, an int, {len(axes)} ints or {len(axes)} (before, after) pairs for "
                         f"the axes {axes} of x of shape {tuple(x.shape)}, got {pad!r}")
    return {a: (int(b), int(e)) for a, (b, e) in zip(axes, pairs)}


def pad_constant(x: Array, pad: int | tuple[int, ...], val: float = 0.0, *,
                 dims: int | tuple[int, ...] | None = None) -> Array:
    """``x`` padded with the constant ``val`` along ``dims`` (every axis by default); NNlib's ``pad_constant``.

    >>> import numpy as np
    >>> pad_constant(np.ones((2, 2)), (1, 0, 0, 2), 5.0)
    array([[5., 5., 5., 5.],
           [1., 1., 5., 5.],
           [1., 1., 5., 5.]])
    """
    widths = pad_widths_along("pad_constant", x, pad, dims, True)
    return constant_pad(x, tuple(widths.get(a, (0, 0)) for a in range(len(x.shape))), val)


def pad_zeros(x: Array, pad: int | tuple[int, ...], *, dims: int | tuple[int, ...] | None = None) -> Array:
    """``x`` padded with zeros along ``dims`` (every axis by default): :func:`pad_constant` with 0.

    >>> import numpy as np
    >>> pad_zeros(np.ones((1, 1, 2)), 1, dims=2)
    array([[[0., 1., 1., 0.]]])
    """
    widths = pad_widths_along("pad_zeros", x, pad, dims, True)
    return constant_pad(x, tuple(widths.get(a, (0, 0)) for a in range(len(x.shape))), 0.0)


def _along(x, axis, start, stop):
    return getitem(x, (slice(None),) * axis + (slice(start, stop),))


def _bordered(op, x, pad, dims, sides, limit):
    """``x`` with ``sides(x, axis, n, before, after)`` (the two border blocks) joined on each padded axis."""
    for axis, (before, after) in pad_widths_along(op, x, pad, dims, False).items():
        n = x.shape[axis]
        if max(before, after) > limit(n):
            raise ValueError(f"{op} expects a pad of at most {limit(n)} along axis {axis} of size {n} "
                             f"(x of shape {tuple(x.shape)}), got {(before, after)}")
        if before or after:
            left, right = sides(x, axis, n, before, after)
            x = concatenate([b for b in (left, x, right) if b.shape[axis]], axis)
    return x


def pad_reflect(x: Array, pad: int | tuple[int, ...], *, dims: int | tuple[int, ...] | None = None) -> Array:
    """``x`` reflected across its border, the edge not repeated (``[a, b, c]`` padded by 2: ``c b a b c b a``);
    PyTorch's ``"reflect"``, NumPy's ``mode="reflect"``. Each pad must be smaller than its axis.

    >>> import numpy as np
    >>> pad_reflect(np.array([[[1.0, 2.0, 3.0]]]), (2, 1))
    array([[[3., 2., 1., 2., 3., 2.]]])
    """
    return _bordered("pad_reflect", x, pad, dims, lambda x, axis, n, b, a: (
        flip(_along(x, axis, 1, b + 1), axis), flip(_along(x, axis, n - 1 - a, n - 1), axis)), lambda n: n - 1)


def pad_symmetric(x: Array, pad: int | tuple[int, ...], *, dims: int | tuple[int, ...] | None = None) -> Array:
    """``x`` mirrored at its border, the edge repeated (``[a, b, c]`` padded by 2: ``b a a b c c b``); NumPy's
    ``mode="symmetric"``. Each pad must be at most its axis's size.

    >>> import numpy as np
    >>> pad_symmetric(np.array([[[1.0, 2.0, 3.0]]]), 2)
    array([[[2., 1., 1., 2., 3., 3., 2.]]])
    """
    return _bordered("pad_symmetric", x, pad, dims, lambda x, axis, n, b, a: (
        flip(_along(x, axis, 0, b), axis), flip(_along(x, axis, n - a, n), axis)), lambda n: n)


def pad_repeat(x: Array, pad: int | tuple[int, ...], *, dims: int | tuple[int, ...] | None = None) -> Array:
    """``x`` with its edge values repeated outwards (``[a, b, c]`` padded by 2: ``a a a b c c c``); PyTorch's
    ``"replicate"``, NumPy's ``mode="edge"``.

    >>> import numpy as np
    >>> pad_repeat(np.array([[[1.0, 2.0]]]), (1, 3))
    array([[[1., 1., 2., 2., 2., 2.]]])
    """
    def sides(x, axis, n, b, a):
        def edge(i, k):
            shape = tuple(k if d == axis else s for d, s in enumerate(x.shape))
            return broadcast_to(_along(x, axis, i, i + 1), shape)
        return edge(0, b), edge(n - 1, a)
    return _bordered("pad_repeat", x, pad, dims, sides, lambda n: float("inf"))


def pad_circular(x: Array, pad: int | tuple[int, ...], *, dims: int | tuple[int, ...] | None = None) -> Array:
    """``x`` continued periodically (``[a, b, c]`` padded by 2: ``b c a b c a b``); PyTorch's ``"circular"``,
    NumPy's ``mode="wrap"``. Each pad must be at most its axis's size.

    >>> import numpy as np
    >>> pad_circular(np.array([[[1.0, 2.0, 3.0]]]), (1, 2))
    array([[[3., 1., 2., 3., 1., 2.]]])
    """
    return _bordered("pad_circular", x, pad, dims, lambda x, axis, n, b, a: (
        _along(x, axis, n - b, n), _along(x, axis, 0, a)), lambda n: n)
