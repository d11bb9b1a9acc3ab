"""``scatter`` and ``gather`` (NNlib's), differentiable, on the leading axes or along one axis.

NNlib indexes the trailing axes of column-major arrays; fluxpy is row-major, so here ``idx`` indexes the LEADING
axes of the destination and ``src``'s leading axes are ``idx``'s shape::

    scatter(op, src, idx)[idx[k], ...]  =  op over every k of src[k, ...]
    gather(src, idx)[k, ...]            =  src[idx[k], ...]

``idx`` is an integer array (one index per entry, ``d = 1``) or a tuple of ``d`` integer arrays of one shape
(NumPy's ``x[i, j]``: the ``d``-tuple ``(i[k], j[k])`` indexes the ``d`` leading axes; NNlib's tuple or
CartesianIndex indices). Indices are 0-based and never negative.

With ``axis=a`` both work along that one axis instead (NumPy's ``take_along_axis``, PyTorch's ``gather`` and
``scatter_reduce``): ``idx`` is one integer array with ``src``'s number of axes, and for 3-d arrays and ``a = 1``::

    scatter(op, src, idx, axis=1)[i, idx[i, j, k], k]  =  op over every j of src[i, j, k]
    gather(src, idx, axis=1)[i, j, k]                   =  src[i, idx[i, j, k], k]

The gradient of ``gather`` is a scatter-add and that of a scatter-add is a gather, so second derivatives come free;
the gradient of ``x[i]`` for integer-array indices on the leading axes (and so of ``Embedding``) is this
scatter-add too.

Index checks: an index out of range (or negative) raises ``IndexError`` naming the op, the value, the index array,
the axis and its size. Indices given on the host are checked before any work. Indices on the GPU are checked by the
kernels as they read them (they skip a bad entry), and the option ``index_checks``
(:mod:`fluxpy.options`) says when the error comes: ``"deferred"`` (the default) lets each call return at once
(PyTorch's and CUDA.jl's way: no host wait inside a step), and the error, saying which earlier call made it, comes
where the host reads the device anyway: the loss :func:`fluxpy.train` reads, the next checked ``scatter``/``gather``
call, or :func:`check_indices`, which waits for the GPU; ``"wait"`` has each call wait for its kernel and raise
before returning. Gradients never check (their indices were checked on the way forward).

>>> import numpy as np
>>> from fluxpy import gradient
>>> gradient(lambda w: gather(w, np.array([2, 0, 2])).sum(), np.zeros(3))
(array([1., 0., 2.]),)
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..autodiff import Primitive, value_of
from ..backend import Array, get_array_module, gpu_device, is_float_dtype
from ..capturing import refuse
from ..kernels import BadIndex, DeferredBadIndex, lookup, registered_for
from ..kernels.cpu import along_axis_index, first_bad_index
from ..kernels.halfs import is_half
from .dims import _is_int

__all__ = ["scatter", "gather", "check_indices"]

# op names (a string, or a callable's __name__: operator.add, max, np.maximum, np.mean, fluxpy.mean, ...)
_OP_NAMES = {"+": "add", "add": "add", "sum": "add", "max": "max", "maximum": "max", "amax": "max",
             "min": "min", "minimum": "min", "amin": "min", "mean": "mean"}


def _op_name(op):
    name = _OP_NAMES.get(op if isinstance(op, str) else getattr(op, "__name__", None))
    if name is None:
        raise TypeError(f"scatter: op must be '+' (or 'add', operator.add, np.add), 'max' (max, np.maximum), "
                        f"'min' (min, np.minimum) or 'mean' (np.mean), got {op!r}")
    return name


# ---------------------------------------------------------------------------------------------
# Checks, all before any work: NNlib's checkbounds_idx and scatter_dims, with the names of what is wrong


_HOST_INDEX = (np.ndarray, np.generic, list, int)


def _indices(fname, idx, src):
    """``(arrays, xp, on_host)``: ``idx`` as a tuple of integer arrays of one shape, the array module of ``src``,
    and whether the indices were given on the host. Host indices are checked here (no device work) and stay NumPy
    arrays until :func:`_on_device_of`; those on the GPU are checked by the kernel as it reads them (a separate pass
    would read them twice and wait for each of its results)."""
    xp = get_array_module(value_of(src))
    entries = value_of(idx)
    entries = tuple(value_of(e) for e in entries) if isinstance(entries, tuple) else (entries,)
    if not entries:
        raise ValueError(f"{fname}: idx must be an integer array or a tuple of them, got an empty tuple")
    on_host = all(isinstance(e, _HOST_INDEX) for e in entries)
    if on_host:
        arrays = tuple(np.asarray(e) for e in entries)
    else:
        arrays = tuple(e if isinstance(e, xp.ndarray) else xp.asarray(e) for e in entries)
    for j, a in enumerate(arrays):
        if a.dtype.kind not in "iu":
            raise TypeError(f"{fname}: expects integer indices, got {_where(j, arrays)} of dtype {a.dtype}")
    if len(arrays) > 1:
        shapes = [tuple(a.shape) for a in arrays]
        if len(set(shapes)) > 1:
            raise ValueError(f"{fname}: the {len(arrays)} index arrays must have one shape, got shapes {shapes}")
    if on_host:
        for j, a in enumerate(arrays):
            if a.size and int(a.min()) < 0:
                raise IndexError(_bad_index_message(fname, BadIndex(j, int(a.min()), -1), len(arrays), ""))
    return arrays, xp, on_host


def _where(j, arrays):
    return f"idx[{j}]" if len(arrays) > 1 else "idx"


def _bad_index_message(fname, bad, d, what):
    """The op's message for a :class:`~fluxpy.kernels.BadIndex` (from a host check or a checked kernel)."""
    where = f"idx[{bad.which}]" if d > 1 else "idx"
    if bad.which < 0:
        return f"{fname}: {bad}"
    if bad.value < 0:
        return f"{fname}: expects non-negative (0-based) indices, got {bad.value} in {where}"
    return f"{fname}: index {bad.value} in {where} is out of range for {what} axis {bad.which} of size {bad.size}"


_WHAT = {"scatter": "dstsize", "gather": "src"}   # what each op's index arrays index


def _index_error(fname, bad, d):
    """The ``IndexError`` for a :class:`~fluxpy.kernels.BadIndex` raised during a call of ``fname`` with ``d`` index
    arrays: its own, or an earlier call's made with ``index_checks="deferred"`` (named as that call's)."""
    if not isinstance(bad, DeferredBadIndex):
        return IndexError(_bad_index_message(fname, bad, d, _WHAT.get(fname, "its")))
    op = bad.op or "scatter/gather"
    return IndexError(_bad_index_message(op, bad, bad.arrays, _WHAT.get(bad.op, "its")) + (
        f" (reported late: an earlier {op} call, at {bad.where}, ran with index_checks='deferred' and skipped the "
        f"out-of-range entries; index_checks='wait' raises at the call)" if bad.op else " (reported late)"))


def _check_bounds(fname, index, sizes, what, arrays=None):
    """Host index arrays against the axis ``sizes``, before any work; ``arrays``: how many the caller gave (the
    along-axis form gives one, expanded by ``along_axis_index``)."""
    bad = first_bad_index(index, sizes)
    if bad is not None:
        raise IndexError(_bad_index_message(fname, bad, arrays or len(index), what))


def _check_src(fname, src, index):
    ishape = tuple(index[0].shape)
    if tuple(src.shape[:len(ishape)]) != ishape:
        raise ValueError(f"{fname}: expects src.shape to start with idx's shape {ishape}, got src.shape "
                         f"{tuple(src.shape)}")
    _check_dtype(fname, src)


def _check_dtype(fname, src):
    if not (is_float_dtype(src.dtype) or src.dtype.kind in "iu"):
        raise TypeError(f"{fname}: expects a float or integer src, got dtype {src.dtype}")


def _along_axis(fname, idx, src, axis):
    """The along-axis form's ``(index, xp, on_host, axis)``: ``axis`` checked and made non-negative, ``idx`` one
    integer array with ``src``'s number of axes and (on every other axis) its sizes; ``axis`` may differ for a
    gather, not for a scatter (one index per ``src`` entry)."""
    ndim, sshape = len(src.shape), tuple(src.shape)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{fname}: expects axis to be an int or None, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{fname}: axis {axis} is out of range for src with {ndim} axes (shape {sshape})")
    axis = int(axis) % ndim
    entries = value_of(idx)
    if isinstance(entries, tuple):
        raise TypeError(f"{fname}: with axis, expects idx to be one integer array (np.take_along_axis's form), got "
                        f"a tuple of {len(entries)}")
    index, xp, on_host = _indices(fname, idx, src)
    ishape = tuple(index[0].shape)
    same = [a for a in range(ndim) if fname == "scatter" or a != axis]
    if len(ishape) != ndim or any(ishape[a] != sshape[a] for a in same):
        wanted = "src.shape" if fname == "scatter" else f"src.shape on every axis but {axis}"
        raise ValueError(f"{fname}: with axis={axis}, expects idx.shape to be {wanted} {sshape}, got idx.shape "
                         f"{ishape}")
    _check_dtype(fname, src)
    return index, xp, on_host, axis


def _dstsize(dstsize):
    """``dstsize`` as a shape tuple: an int, or a tuple or list of non-negative ints (no float is rounded)."""
    sizes = (dstsize,) if _is_int(dstsize) else tuple(dstsize) if isinstance(dstsize, (tuple, list)) else None
    if sizes is None or not all(_is_int(s) for s in sizes):
        raise TypeError(f"scatter: expects dstsize to be an int or a tuple of ints, got {dstsize!r}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"scatter: expects non-negative sizes in dstsize, got {dstsize!r}")
    return tuple(int(s) for s in sizes)


def _size_from_indices(on_host):
    """Inside a captured step, refuse to read the destination's size from device indices (a host read; give
    ``dstsize``)."""
    if not on_host:
        refuse("scatter: without dstsize, the destination's size is read from the largest device index (a host "
               "read); give dstsize")


MAX_INFERRED_ENTRIES = 2 ** 31
"""The most entries :func:`scatter` makes ``dst`` of without ``dstsize``: a larger one (an index such as ``10**12``,
a stray value more often than a wanted size) is an error before anything is allocated; ``dstsize`` allows any."""


def _inferred(shape, largest):
    """``shape``, read from the largest index ``largest`` (``dstsize`` not given), within
    :data:`MAX_INFERRED_ENTRIES`."""
    if math.prod(shape) > MAX_INFERRED_ENTRIES:
        raise ValueError(f"scatter: without dstsize, the largest index {largest} makes dst of shape {shape}, "
                         f"{math.prod(shape):.3g} entries, more than {MAX_INFERRED_ENTRIES} (MAX_INFERRED_ENTRIES) "
                         f"made without dstsize: pass dstsize to make so large a dst on purpose (or check the indices)")
    return shape


def _destination_shape(src, index, dstsize, on_host):
    """``dstsize`` checked, or the smallest shape that holds the largest index (NNlib's ``maximum_dims``)."""
    trailing = tuple(src.shape[index[0].ndim:])
    if dstsize is None:
        _size_from_indices(on_host)
        largest = [int(a.max()) if a.size else -1 for a in index]
        return _inferred(tuple(max(m + 1, 0) for m in largest) + trailing, max(largest))
    shape = _dstsize(dstsize)
    d = len(index)
    if len(shape) != d + len(trailing) or shape[d:] != trailing:
        raise ValueError(f"scatter: expects dstsize of the form ({', '.join(['n'] * d)}, *{trailing}) for "
                         f"{d} index array(s) and src.shape {tuple(src.shape)}, got dstsize {shape}")
    if on_host:
        _check_bounds("scatter", index, shape, "dstsize")
    return shape


def _destination_shape_along(src, index, dstsize, on_host, axis):
    """The along-axis form's ``dst.shape``: ``src.shape`` with ``axis`` of ``dstsize`` (an int, or the whole shape),
    by default the smallest that holds the largest index."""
    sshape = tuple(src.shape)
    if dstsize is None:
        _size_from_indices(on_host)
        largest = int(index[0].max()) if index[0].size else -1
        n = max(largest + 1, 0)
        _inferred(sshape[:axis] + (n,) + sshape[axis + 1:], largest)
    elif _is_int(dstsize):
        n = int(dstsize)
    else:
        given = _dstsize(dstsize)
        if len(given) != len(sshape) or any(g != s for a, (g, s) in enumerate(zip(given, sshape)) if a != axis):
            raise ValueError(f"scatter: with axis={axis}, expects dstsize to be an int or src.shape {sshape} with "
                             f"another size on axis {axis}, got dstsize {given}")
        n = given[axis]
    if n < 0:
        raise ValueError(f"scatter: expects a non-negative dstsize, got {n} for axis {axis}")
    shape = sshape[:axis] + (n,) + sshape[axis + 1:]
    if on_host:
        _check_bounds("scatter", along_axis_index(index[0], axis), shape, "dstsize", arrays=1)
    return shape


# ---------------------------------------------------------------------------------------------
# The primitives (``checked``: the kernel checks device indices; gradients, whose indices were checked, do not)


def _scatter_impl(src, idx, shape, op, checked=False, axis=None):
    return lookup("scatter", src)(op, src, idx, shape, checked, axis)


def _scatter_rule(src, idx, shape, op, checked=False, axis=None):
    y = _scatter(src, idx=idx, shape=shape, op=op, checked=checked, axis=axis)   # src may be tracked further out
    if op == "add":
        def scatter_add_pullback(dy):
            return (_gather(dy, idx=idx, axis=axis),)
        return y, scatter_add_pullback
    # NNlib's ∇scatter_src for max/min: every src entry equal to its result gets the whole dy (ties are not split)
    plain = value_of(src)
    hit = (plain == _gather_impl(value_of(y), idx, axis=axis)).astype(plain.dtype)

    def scatter_extreme_pullback(dy):
        return (_gather(dy, idx=idx, axis=axis) * hit,)
    return y, scatter_extreme_pullback


_scatter = Primitive("scatter", _scatter_rule, impl=_scatter_impl)


def _gather_impl(src, idx, checked=False, axis=None):
    return lookup("gather", src)(src, idx, checked, axis)


def _gather_rule(src, idx, checked=False, axis=None):
    shape = tuple(src.shape)

    def gather_pullback(dz):
        return (_scatter(dz, idx=idx, shape=shape, op="add", axis=axis),)
    return _gather(src, idx=idx, checked=checked, axis=axis), gather_pullback


_gather = Primitive("gather", _gather_rule, impl=_gather_impl)


def _scatter_mean(src, idx, shape, checked, axis):
    """The scatter-add over the counts, 0 where no index hits (NNlib's ``safe_div``); integers average in float64
    (NNlib's ``float(T)``), float16/bfloat16 in float32, rounded once. ``axis``: the along-axis form (the counts
    have the destination's whole shape)."""
    dtype = src.dtype
    wide = np.dtype(np.float32) if is_half(dtype) else dtype if is_float_dtype(dtype) else np.dtype(np.float64)
    src = src if wide == dtype else src.astype(wide)
    xp = get_array_module(value_of(src))
    ones = xp.ones(idx[0].shape, wide)
    if axis is None:
        d = len(idx)
        counts = lookup("scatter", ones)("add", ones, idx, shape[:d], checked, None)
        counts = counts.reshape(shape[:d] + (1,) * (len(shape) - d))
    else:
        counts = lookup("scatter", ones)("add", ones, idx, shape, checked, axis)
    y = _scatter(src, idx=idx, shape=shape, op="add", axis=axis) / xp.maximum(counts, 1)
    return y.astype(dtype) if is_half(dtype) else y


# ---------------------------------------------------------------------------------------------
# The public ops


def scatter(op: Any, src: Array, idx: Any, dstsize: int | Sequence[int] | None = None,
            axis: int | None = None) -> Array:
    """``dst[idx[k], ...] = op(dst[idx[k], ...], src[k, ...])`` for every ``k``, into a new ``dst`` (NNlib's
    ``scatter``, on the leading axes); with ``axis``, PyTorch's ``scatter_reduce`` along that axis.

    ``op``: ``"+"`` (``"add"``, ``operator.add``, ``np.add``), ``"max"`` (``max``, ``np.maximum``), ``"min"``
    (``min``, ``np.minimum``) or ``"mean"`` (``np.mean``). ``idx``: an integer array, or a tuple of ``d`` integer
    arrays of one shape, indexing the ``d`` leading axes of ``dst``; ``src.shape`` is ``idx``'s shape followed by
    the trailing shape of ``dst``. ``dstsize``: the whole shape of ``dst`` (an int for a 1-d one); by default the
    smallest that holds the largest index, up to :data:`MAX_INFERRED_ENTRIES` (``2**31``) entries (a larger one is
    an error naming the largest index: give ``dstsize`` for it). Entries no index hits hold 0 for ``+`` and
    ``mean``, the dtype's lowest value for ``max`` (``-inf`` for floats) and its highest for ``min`` (NNlib's
    ``scatter_empty``).

    ``axis`` (an int, negative counts from the end): ``idx`` is one integer array of ``src``'s shape and each entry
    sends its ``src`` value along ``axis``: ``dst[i, idx[i, j], k] op= src[i, j, k]`` for ``axis=1`` of 3-d arrays
    (``torch.Tensor.scatter_reduce(axis, idx, src)`` into a new array, one kernel on the GPU). ``dst.shape`` is
    ``src.shape`` with ``dstsize`` on ``axis`` (an int, or the whole shape; by default the largest index plus one).

    Gradient: ``+``: ``gather(dy, idx)``; ``mean``: ``gather(dy, idx) / count``; ``max``/``min``:
    ``gather(dy, idx)`` at every ``src`` entry equal to its result (tied entries each get all of it, as NNlib); the
    same ``axis`` throughout.

    >>> import numpy as np
    >>> scatter("+", np.array([10.0, 100.0, 1000.0]), np.array([2, 0, 1]))
    array([ 100., 1000.,   10.])
    >>> scatter("max", np.array([[1.0, 5.0], [3.0, 2.0]]), np.array([1, 1]), dstsize=(3, 2))
    array([[-inf, -inf],
           [  3.,   5.],
           [-inf, -inf]])
    >>> scatter("mean", np.array([1.0, 2.0, 6.0]), (np.array([0, 0, 1]), np.array([1, 1, 0])))
    array([[0. , 1.5],
           [6. , 0. ]])
    >>> scatter("+", np.array([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]]), np.array([[0, 0, 1], [1, 1, 1]]), axis=1)
    array([[ 3.,  4.],
           [ 0., 56.]])
    """
    name = _op_name(op)
    if axis is None:
        index, xp, on_host = _indices("scatter", idx, src)
        _check_src("scatter", src, index)
        shape = _destination_shape(src, index, dstsize, on_host)
    else:
        index, xp, on_host, axis = _along_axis("scatter", idx, src, axis)
        shape = _destination_shape_along(src, index, dstsize, on_host, axis)
    index = _on_device_of(xp, index, on_host, src)
    try:
        if name == "mean":
            return _scatter_mean(src, index, shape, not on_host, axis)
        return _scatter(src, idx=index, shape=shape, op=name, checked=not on_host, axis=axis)
    except BadIndex as bad:
        raise _index_error("scatter", bad, len(index)) from None


def _on_device_of(xp, index, on_host, src):
    """Host index arrays on ``xp``'s device, that of ``src`` (indices given on the device are there already)."""
    if not on_host:
        return index
    if gpu_device(value_of(src)) is not None:
        refuse("scatter/gather: indices given on the host are copied to the device at every call (put them on the "
               "device, e.g. as part of the batch)")
    return tuple(xp.asarray(a) for a in index)


def gather(src: Array, idx: Any, axis: int | None = None) -> Array:
    """``out[k, ...] = src[idx[k], ...]`` (NNlib's ``gather``, on the leading axes): ``src`` read at the integer
    array ``idx``, or at the tuples of a tuple of ``d`` integer arrays of one shape, which index ``src``'s ``d``
    leading axes. ``out.shape`` is ``idx``'s shape followed by ``src.shape[d:]``.

    ``axis`` (an int, negative counts from the end): ``np.take_along_axis(src, idx, axis)`` (``torch.gather``):
    ``idx`` is one integer array with ``src``'s sizes on every other axis, ``out[i, j, k] = src[i, idx[i, j, k], k]``
    for ``axis=1`` of 3-d arrays, ``out.shape == idx.shape`` (one kernel on the GPU).

    Its gradient is ``scatter("+", dout, idx, dstsize=src.shape)`` (with the same ``axis``).

    >>> import numpy as np
    >>> gather(np.array([[1, 2], [3, 4], [5, 6]]), np.array([2, 0, 2]))
    array([[5, 6],
           [1, 2],
           [5, 6]])
    >>> gather(np.arange(6).reshape(2, 3), (np.array([1, 0]), np.array([2, 2])))
    array([5, 2])
    >>> gather(np.array([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2]]), np.array([[1], [0]]), axis=1)   # picked per row
    array([[0.7],
           [0.5]])
    """
    if axis is None:
        index, xp, on_host = _indices("gather", idx, src)
        if len(index) > src.ndim:
            raise ValueError(f"gather: {len(index)} index arrays need src with at least {len(index)} axes, got "
                             f"src.shape {tuple(src.shape)}")
        if on_host:
            _check_bounds("gather", index, src.shape, "src")
    else:
        index, xp, on_host, axis = _along_axis("gather", idx, src, axis)
        if on_host:
            _check_bounds("gather", along_axis_index(index[0], axis), src.shape, "src", arrays=1)
    try:
        return _gather(src, idx=_on_device_of(xp, index, on_host, src), checked=not on_host, axis=axis)
    except BadIndex as bad:
        raise _index_error("gather", bad, len(index)) from None


def check_indices(wait: bool = True) -> None:
    """Wait for the GPU's work so far, then raise ``IndexError`` for the first ``scatter`` or ``gather`` call
    (``Embedding``'s included) made with ``index_checks="deferred"`` (the default) whose device indices had one out of
    range (the call skipped those entries and did not wait): the message names the op, the bad value, its axis and
    the axis's size (while the call's index arrays are still held) and the file and line of the call. Forgets the
    deferred calls either way; nothing to do on the CPU, where indices are checked before any work.

    ``wait=False`` does not wait: it raises for what the kernels have flagged so far, for code that has just waited
    for the work it cares about (:func:`fluxpy.train` calls it once it has read a step's loss). A later checked call
    also raises for an earlier call's bad index, before its own work. ``fluxpy.options.set(index_checks="wait")`` has
    every checked call wait for its kernel and raise at once instead.

    >>> import numpy as np
    >>> scatter("+", np.array([1.0, 2.0]), np.array([1, 1]))   # NumPy indices: checked at the call
    array([0., 3.])
    >>> check_indices(), check_indices(wait=False)   # nothing pending
    (None, None)
    """
    try:
        for check in registered_for("check_indices"):
            check(wait)
    except BadIndex as bad:
        raise _index_error("check_indices", bad, 1) from None
