"""Shape and indexing primitives: reshape, transpose, broadcast_to, getitem, concatenate, stack, astype.

Each rule's pullback is written with these same ops, so they differentiate twice.

>>> import numpy as np
>>> from fluxpy import gradient
>>> gradient(lambda x: x[[0, 0, 2]].sum(), np.ones(3))   # repeated indices accumulate
(array([2., 0., 1.]),)
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..autodiff import Primitive, SliceCotangent, is_tracked, value_of
from ..backend import Array, get_array_module, reduced_axes
from ..kernels import find, lookup
from ..kernels.halfs import is_half
from ..layout import MEMORY_FORMATS, is_channels_last, to_channels_last, to_contiguous
from .scatter import _scatter

__all__ = ["reshape", "transpose", "broadcast_to", "unbroadcast", "reduced_axes", "getitem", "scatter_add",
           "concatenate", "stack", "astype", "swapaxes", "squeeze", "expand_dims", "ravel", "as_memory_format",
           "channel_shuffle"]


def _normalize_shape(shape):
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    return tuple(map(int, shape))


def _reshape_rule(x, shape):
    xshape = tuple(x.shape)

    def reshape_pullback(dy):
        return (_reshape(dy, xshape),)
    return _reshape(x, shape), reshape_pullback


def _reshape_impl(x, shape):
    try:
        return x.reshape(shape)
    except ValueError as err:
        raise ValueError(f"reshape: cannot reshape an array of shape {tuple(x.shape)} "
                         f"({x.size} elements) into shape {shape}") from err


_reshape = Primitive("reshape", _reshape_rule, impl=_reshape_impl)


def reshape(x: Array, shape: int | Sequence[int]) -> Array:
    """The same elements in a new shape (one entry may be -1).

    >>> import numpy as np
    >>> reshape(np.arange(6.0), (2, -1)).shape
    (2, 3)
    """
    return _reshape(x, _normalize_shape(shape))


def _transpose_rule(x, axes):
    inverse = tuple(sorted(range(len(axes)), key=axes.__getitem__))   # axes is a permutation: its inverse

    def transpose_pullback(dy):
        return (_transpose(dy, inverse),)
    return _transpose(x, axes), transpose_pullback


_transpose = Primitive("transpose", _transpose_rule, impl=lambda x, axes: x.transpose(axes))


def transpose(x: Array, axes: Sequence[int] | None = None) -> Array:
    """``x`` with its axes permuted (reversed by default), as ``numpy.transpose``.

    >>> import numpy as np
    >>> transpose(np.ones((2, 3, 4)), (2, 0, 1)).shape
    (4, 2, 3)
    """
    nd = x.ndim
    axes = tuple(range(nd - 1, -1, -1)) if axes is None else tuple(int(a) % nd for a in axes)
    if sorted(axes) != list(range(nd)):
        raise ValueError(f"transpose: axes {axes} are not a permutation of the {nd} axes of shape {tuple(x.shape)}")
    return _transpose(x, axes)


def swapaxes(x: Array, a: int, b: int) -> Array:
    """``x`` with the two axes ``a`` and ``b`` exchanged.

    >>> import numpy as np
    >>> swapaxes(np.ones((2, 3, 4)), -1, -2).shape
    (2, 4, 3)
    """
    axes = list(range(x.ndim))
    axes[a], axes[b] = axes[b], axes[a]
    return _transpose(x, tuple(axes))


def _broadcast_to_impl(x, shape):
    xp = get_array_module(x)
    try:
        return xp.broadcast_to(x, shape)
    except ValueError as err:
        raise ValueError(f"broadcast_to: cannot broadcast shape {tuple(np.shape(x))} to {shape}") from err


def _broadcast_to_rule(x, shape):
    xshape = x.shape

    def broadcast_to_pullback(dy):
        return (unbroadcast(dy, xshape),)
    return _broadcast_to(x, shape), broadcast_to_pullback


_broadcast_to = Primitive("broadcast_to", _broadcast_to_rule, impl=_broadcast_to_impl)


def broadcast_to(x: Array, shape: int | Sequence[int]) -> Array:
    """A read-only view of ``x`` broadcast to ``shape``; its gradient is ``unbroadcast``.

    >>> import numpy as np
    >>> broadcast_to(np.ones(3), (2, 3)).shape
    (2, 3)
    """
    return _broadcast_to(x, _normalize_shape(shape))


# ---------------------------------------------------------------------------------------------
# unbroadcast: the one reduction behind every broadcasting gradient (Zygote's unbroadcast)


def _unbroadcast_impl(g, shape):
    if g.shape == shape:
        return g
    axes = reduced_axes(g.shape, shape)
    kernel = find("sum", g)
    if kernel is not None:
        return kernel(g, axes, shape)
    if is_half(g.dtype):   # NumPy would add float16/bfloat16 in the half type: accumulate in float32, round once
        return g.sum(axis=axes, dtype=np.float32).astype(g.dtype).reshape(shape)
    return g.sum(axis=axes).reshape(shape)


def _unbroadcast_rule(g, shape):
    gshape = g.shape

    def unbroadcast_pullback(dz):
        return (broadcast_to(dz, gshape),)
    return _unbroadcast(g, shape), unbroadcast_pullback


_unbroadcast = Primitive("unbroadcast", _unbroadcast_rule, impl=_unbroadcast_impl)


def unbroadcast(grad: Array, shape: Sequence[int]) -> Array:
    """``grad`` summed down to ``shape``; ``grad`` itself when the shapes match.

    >>> import numpy as np
    >>> unbroadcast(np.ones((2, 3)), (3,))
    array([2., 2., 2.])
    """
    shape = tuple(shape)
    if tuple(grad.shape) == shape:
        return grad
    return _unbroadcast(grad, shape)


def _clean_index(index):
    """Indices are never differentiated: strip Tracked values, and make it a tuple."""
    if not isinstance(index, tuple):
        index = (index,)
    return tuple(value_of(i) for i in index)


def _is_basic_index(index):
    """Basic indices (ints, slices, None, ...) and boolean masks select each element at most once."""
    for i in index:
        if isinstance(i, (list,)) or (hasattr(i, "dtype") and i.dtype.kind in "iu" and getattr(i, "ndim", 0) > 0):
            return False
    return True


def _leading_integer_index(index, x):
    """For an index that selects along the leading axes with integer arrays alone (``x[i]``, ``x[i, j]``,
    ``x[i, :]``, ``x[i, ...]``): its arrays broadcast to one shape, negative entries wrapped, as ``scatter``
    takes them. ``None`` for any other index."""
    n = 0
    while n < len(index) and (isinstance(index[n], list) or getattr(index[n], "ndim", 0) > 0):
        n += 1
    rest = index[n:]
    if n == 0 or n > x.ndim or not all(r is Ellipsis or (isinstance(r, slice) and r == slice(None)) for r in rest):
        return None
    xp = get_array_module(x)
    arrays = [xp.asarray(i) for i in index[:n]]
    if any(a.dtype.kind not in "iu" for a in arrays):
        return None
    arrays = xp.broadcast_arrays(*arrays)
    return tuple(xp.where(a < 0, a + size, a) for a, size in zip(arrays, x.shape))


def _getitem_rule(x, index):
    xshape = x.shape
    y = _getitem(x, index)   # first: a bad index fails here, with getitem's message
    leading = _leading_integer_index(index, value_of(x))
    if leading is not None:   # x[i] with repeated rows (Embedding): the scatter-add op, whose gradient is gather
        def getitem_rows_pullback(dy):
            return (_scatter(dy, idx=leading, shape=xshape, op="add"),)
        return y, getitem_rows_pullback

    basic = _is_basic_index(index)

    def getitem_pullback(dy):
        if basic and not is_tracked(dy):   # the walk adds it into one buffer (x[t] at every step of a loop)
            return (SliceCotangent(dy, tuple(xshape), index),)
        return (scatter_add(dy, xshape, index),)
    return y, getitem_pullback


def _getitem_impl(x, index):
    try:
        return x[index]
    except IndexError as err:
        raise IndexError(f"getitem: index {index!r} does not fit an array of shape {tuple(x.shape)}: {err}") from err


_getitem = Primitive("getitem", _getitem_rule, impl=_getitem_impl)


def getitem(x: Array, index: Any) -> Array:
    """``x[index]``, differentiable: the gradient scatters back, repeated indices accumulate.

    >>> import numpy as np
    >>> getitem(np.arange(5.0), slice(1, 3))
    array([1., 2.])
    """
    return _getitem(x, _clean_index(index))


def _scatter_add_impl(dy, shape, index):
    if not _is_basic_index(index):
        return lookup("scatter", dy)("add", dy, index, shape)
    out = get_array_module(dy).zeros(shape, dtype=dy.dtype)
    out[index] = dy
    return out


def _scatter_add_rule(dy, shape, index):
    def scatter_add_pullback(dz):
        return (_getitem(dz, index),)
    return _scatter_add(dy, shape, index), scatter_add_pullback


_scatter_add = Primitive("scatter_add", _scatter_add_rule, impl=_scatter_add_impl)


def scatter_add(values: Array, shape: int | Sequence[int], index: Any) -> Array:
    """Zeros of ``shape`` with ``values`` added at the positions that ``[index]`` selects.

    The adjoint of :func:`getitem` for any index (slices, masks, arrays anywhere); repeated indices accumulate, in
    the kernel behind :func:`fluxpy.ops.scatter`. Integer arrays on the leading axes alone are
    ``scatter("+", values, index, dstsize=shape)``, which getitem's gradient uses there.

    >>> import numpy as np
    >>> scatter_add(np.ones(3), (2,), np.array([0, 1, 1]))
    array([1., 2.])
    """
    return _scatter_add(values, _normalize_shape(shape), _clean_index(index))


def _concat_rule(*xs, axis):
    sizes = [x.shape[axis] for x in xs]

    def concatenate_pullback(dy):
        grads, start = [], 0
        for n in sizes:
            grads.append(_getitem(dy, (slice(None),) * axis + (slice(start, start + n),)))
            start += n
        return tuple(grads)
    return _concat(*xs, axis=axis), concatenate_pullback


def _concat_impl(*xs, axis):
    xp = get_array_module(*xs)
    kernel = find("concatenate", *xs)
    try:
        return kernel(xs, axis=axis) if kernel is not None else xp.concatenate(xs, axis=axis)
    except ValueError as err:
        raise ValueError(f"concatenate: shapes {[tuple(x.shape) for x in xs]} do not fit along axis {axis}") from err


_concat = Primitive("concatenate", _concat_rule, impl=_concat_impl)


def concatenate(arrays: Sequence[Array], axis: int = 0) -> Array:
    """The arrays joined along an existing axis (the first by default).

    >>> import numpy as np
    >>> concatenate([np.ones((1, 2)), np.zeros((2, 2))]).shape
    (3, 2)
    """
    arrays = list(arrays)
    if not arrays:
        raise ValueError("concatenate: needs at least one array")
    return _concat(*arrays, axis=int(axis) % arrays[0].ndim)


def _stack_rule(*xs, axis):
    n = len(xs)

    def stack_pullback(dy):
        return tuple(_getitem(dy, (slice(None),) * axis + (i,)) for i in range(n))
    return _stack(*xs, axis=axis), stack_pullback


def _stack_impl(*xs, axis):
    xp = get_array_module(*xs)
    kernel = find("stack", *xs)
    try:
        return kernel(xs, axis=axis) if kernel is not None else xp.stack(xs, axis=axis)
    except ValueError as err:
        raise ValueError(f"stack: all shapes must be equal, got {[tuple(x.shape) for x in xs]}") from err


_stack = Primitive("stack", _stack_rule, impl=_stack_impl)


def stack(arrays: Sequence[Array], axis: int = 0) -> Array:
    """Equal-shaped arrays joined along a new axis (the first by default).

    >>> import numpy as np
    >>> stack([np.ones(2), np.zeros(2)], axis=1).shape
    (2, 2)
    """
    arrays = list(arrays)
    if not arrays:
        raise ValueError("stack: needs at least one array")
    return _stack(*arrays, axis=int(axis) % (arrays[0].ndim + 1))


def _astype_rule(x, dtype):
    src = x.dtype

    def astype_pullback(dy):
        return (_astype(dy, src),)
    return _astype(x, dtype), astype_pullback


def _astype_impl(x, dtype):
    kernel = find("astype", x, dtype) if x.dtype != dtype else None   # the GPU's halves: CuPy's go an item at a time
    return x.astype(dtype, copy=False) if kernel is None else kernel(x, dtype)


_astype = Primitive("astype", _astype_rule, impl=_astype_impl)


def astype(x: Array, dtype: Any) -> Array:
    """``x`` converted to ``dtype``; the gradient is converted back.

    >>> import numpy as np
    >>> astype(np.ones(2), np.float32).dtype
    dtype('float32')
    """
    return _astype(x, np.dtype(dtype))


def squeeze(x: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """``x`` without its size-1 axes (all of them, or those named).

    >>> import numpy as np
    >>> squeeze(np.ones((1, 3, 1))).shape
    (3,)
    """
    shape = x.shape
    if axis is None:
        new = tuple(s for s in shape if s != 1)
    else:
        axes = {a % len(shape) for a in ((axis,) if isinstance(axis, int) else axis)}
        bad = [a for a in axes if shape[a] != 1]
        if bad:
            raise ValueError(f"squeeze: axis {bad[0]} of shape {tuple(shape)} does not have size 1")
        new = tuple(s for i, s in enumerate(shape) if i not in axes)
    return reshape(x, new)


def expand_dims(x: Array, axis: int) -> Array:
    """``x`` with a size-1 axis inserted at ``axis``.

    >>> import numpy as np
    >>> expand_dims(np.ones(3), 0).shape
    (1, 3)
    """
    shape = list(x.shape)
    axis = axis % (len(shape) + 1)
    shape.insert(axis, 1)
    return reshape(x, tuple(shape))


def ravel(x: Array) -> Array:
    """``x`` flattened to one axis.

    >>> import numpy as np
    >>> ravel(np.ones((2, 3))).shape
    (6,)
    """
    return reshape(x, (-1,))



def _as_memory_format_impl(x, memory):
    return to_channels_last(x) if memory == "channels_last" else to_contiguous(x)


def _as_memory_format_rule(x, memory):
    back = "channels_last" if is_channels_last(x) else "contiguous"

    def as_memory_format_pullback(dy):
        return as_memory_format(dy, back), None
    return _as_memory_format(x, memory), as_memory_format_pullback


_as_memory_format = Primitive("as_memory_format", _as_memory_format_rule, impl=_as_memory_format_impl)


def as_memory_format(x: Array, memory: str) -> Array:
    """``x`` (``(N, C, *spatial)``) in ``memory`` format, ``"channels_last"`` or ``"contiguous"`` (C order), the same
    values (a copy only where the layout changes; see :mod:`fluxpy.layout`); its gradient comes back in ``x``'s
    layout.

    >>> import numpy as np
    >>> from fluxpy.layout import is_channels_last
    >>> is_channels_last(as_memory_format(np.ones((2, 3, 4, 4)), "channels_last"))
    True
    """
    if memory not in MEMORY_FORMATS:
        raise ValueError(f"as_memory_format: memory must be one of {MEMORY_FORMATS}, got {memory!r}")
    if len(getattr(x, "shape", ())) < 3:
        raise ValueError(f"as_memory_format expects an array of 3 or more axes (N, C, *spatial), got shape "
                         f"{tuple(getattr(x, 'shape', ()))}")
    return _as_memory_format(x, memory)


def channel_shuffle(x: Array, groups: int) -> Array:
    """The channels of ``x`` ``(N, C, *spatial)`` in ``groups`` interleaved (ShuffleNet; PyTorch's
    ``nn.ChannelShuffle``): seen as ``(groups, C / groups)``, transposed, flattened back.

    >>> import numpy as np
    >>> channel_shuffle(np.arange(6.0).reshape(1, 6, 1), 2)[0, :, 0]
    array([0., 3., 1., 4., 2., 5.])
    """
    shape = tuple(getattr(x, "shape", ()))
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"channel_shuffle expects groups to be an int >= 1, got {groups!r}")
    if len(shape) < 2 or shape[1] % groups:
        raise ValueError(f"channel_shuffle expects x of shape (N, C, ...) with C divisible by groups={groups}, got "
                         f"shape {shape}")
    n, c, rest = shape[0], shape[1], shape[2:]
    y = swapaxes(reshape(x, (n, int(groups), c // int(groups)) + rest), 1, 2)
    return reshape(y, shape)
