"""CuPy kernels for max and mean pooling: small gather RawKernels, deterministic, matching the CPU path on ties.

:data:`KERNELS` maps the op names of :mod:`fluxpy.ops.pool` to these functions, for the kernel table
(:func:`fluxpy.kernels.register` under ``"cupy"``); each has the signature of its NumPy kernel in
:mod:`fluxpy.kernels.cpu`.

cuDNN's max-pool backward does not say which of tied maxima gets the gradient, and the CPU path
sends it to the *first* maximum of each window (row-major, as PyTorch). So pooling uses small
gather kernels, one thread per output (forward) or per input pixel (backward), no atomics, so the
result is deterministic and matches the CPU path on ties (each kernel also compiled for channels-last data,
where a thread takes one channel of one pixel and the results keep that layout):

- ``maxpool_forward``: the max over each window (padding never wins; NaN propagates; a window of padding only,
  where a pad reaches the kernel's size, gives NNlib's lowest finite value of ``x``'s dtype, as the CPU kernel);
- ``maxpool_backward``: each input pixel sums ``dy`` over the windows that contain it and whose
  first maximum (the first ``x == y`` in the window) is that pixel;
- ``maxpool_gather`` (the adjoint, for second derivatives), ``meanpool_forward`` (zero padding
  counted: divides by ``R*S``, so a window of padding only gives 0) and ``meanpool_backward``; windows of padding
  only send no gradient.

Windows are given by per-axis start/end arrays, so regular and adaptive pools share the kernels. The kernels pool
2-d images; :mod:`fluxpy.ops.pool` runs 1-d and 3-d pools as 2-d ones on reshaped views (``pool_stages``). float16 and
bfloat16 are read and written in their own 16 bits and computed in float32 (sums rounded once; max exact). Max
pooling's forward and disjoint-window backward on channels-last data whose pixels are whole 16-byte vectors (the
channels a multiple of 8 in the halves, of 4 in float32) take a thread per (window, vector of channels), every load
and store one vector (``maxpool_fwd_vec``, ``maxpool_bwd_tiles_vec``). The module imports without CuPy (the kernels
are compiled on first use).

>>> sorted(KERNELS)
['maxpool_backward', 'maxpool_forward', 'maxpool_gather', 'meanpool_backward', 'meanpool_forward']
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..backend import cupy
from ..layout import empty_channels_last, is_channels_last, to_channels_last
from .cpu import lowest_finite
from .cuda_arrays import contiguous
from . import compiler
from .halfs import KERNEL_DTYPES, VECTORS, compute_dtype, dtype_defines

__all__ = ["KERNELS", "maxpool_forward", "maxpool_backward", "maxpool_gather", "meanpool_forward",
           "meanpool_backward", "SOURCE_VARIANTS"]


class PoolDimsLike(Protocol):
    """What these kernels read of a :class:`fluxpy.ops.dims.PoolDims` (kernels sit below the ops and do not
    import them)."""
    x_shape: tuple
    y_shape: tuple
    pad: tuple
    kernel: tuple
    adaptive: bool

    def window_rows(self) -> np.ndarray:
        """``(P, R)``: the padded-image row of each window's each kernel row."""

    def window_cols(self) -> np.ndarray:
        """``(Q, S)``: the padded-image column of each window's each kernel column."""



_windows = {}
_THREADS = 256


_VECTOR_KERNELS = ("maxpool_fwd", "maxpool_bwd_tiles")   # those with a form by 16-byte vectors (name + "_vec")


def _defines(dtype, channels_last, vectors=False):
    """``cuda/pool.cu``'s defines: the dtype's (halfs.cuh), ``CL`` (1 for channels-last memory) and, for the forms
    by vectors (channels-last only), the dtype's 16-byte vector ``VT`` of ``VW`` elements."""
    defines = {**dtype_defines(dtype), "CL": int(channels_last)}
    if vectors:
        defines["VT"], defines["VW"] = VECTORS[np.dtype(dtype)]
    return defines


def SOURCE_VARIANTS():
    """``(source, defines)`` of every variant the kernels launch: each dtype, in either layout, and channels-last
    by vectors.

    >>> len(list(SOURCE_VARIANTS()))
    12
    """
    for dtype in KERNEL_DTYPES:
        for channels_last in (False, True):
            yield "pool.cu", _defines(dtype, channels_last)
        yield "pool.cu", _defines(dtype, True, vectors=True)


def _function(name, dtype, channels_last=False, vectors=False):
    return compiler.function("pool.cu", name + ("_vec" if vectors else ""), _defines(dtype, channels_last, vectors))


def _vector_width(name, st, layout) -> int:
    """The channels a thread of kernel ``name`` takes as one 16-byte vector: the vector's width where the kernel
    has a form by vectors and the data is channels-last in whole vectors a pixel, else 1 (a channel a thread)."""
    vw = VECTORS[np.dtype(st)][1]
    return vw if name in _VECTOR_KERNELS and layout[0] and layout[1] % vw == 0 else 1


def _axis_windows(rows, pad_before, size):
    """Per-axis arrays: window start/end (in unpadded coordinates) and, per pixel, the first and
    last window containing it (an empty range where none does)."""
    start = rows[:, 0] - pad_before
    end = rows[:, -1] + 1 - pad_before
    pix = np.arange(size)[:, None]
    inside = (start[None, :] <= pix) & (end[None, :] > pix)
    any_ = inside.any(axis=1)
    lo = np.where(any_, inside.argmax(axis=1), 1)
    hi = np.where(any_, inside.shape[1] - 1 - inside[:, ::-1].argmax(axis=1), 0)
    return [a.astype(np.int32) for a in (start, end, lo, hi)]


def _geometry(pdims):
    key = (pdims, cupy.cuda.runtime.getDevice())
    g = _windows.get(key)
    if g is None:
        n, c, h, w = pdims.x_shape
        top, left = pdims.pad[0], pdims.pad[2]
        hs, he, plo, phi = _axis_windows(pdims.window_rows(), top, h)
        ws, we, qlo, qhi = _axis_windows(pdims.window_cols(), left, w)
        arrays = tuple(cupy.asarray(a) for a in (hs, he, ws, we, plo, phi, qlo, qhi))
        p, q = pdims.y_shape[2:]
        g = _windows[key] = (np.int32(h), np.int32(w), np.int32(p), np.int32(q), arrays)
    return g


_tilings = {}


def _tiling(pdims) -> tuple[bool, bool]:
    """``(disjoint, covered)``: whether no two windows share a pixel (along each axis), and whether every pixel lies
    in a window (else ``maxpool_bwd_tiles`` leaves it to a zero fill)."""
    got = _tilings.get(pdims)
    if got is None:
        n, c, h, w = pdims.x_shape
        disjoint, covered = True, True
        for rows, before, size in ((pdims.window_rows(), pdims.pad[0], h), (pdims.window_cols(), pdims.pad[2], w)):
            start, end, lo, hi = _axis_windows(rows, before, size)
            disjoint &= bool(np.all(start[1:] >= end[:-1]))
            covered &= bool(np.all(lo <= hi))
        got = _tilings[pdims] = (disjoint, covered)
    return got


def _storage(dtype):
    """The dtype the kernels read and write for arrays of ``dtype``: itself where a kernel stores it (the halves,
    float32, float64), else its compute type (integers are pooled in float32, as before)."""
    dtype = np.dtype(dtype)
    return dtype if dtype in KERNEL_DTYPES else compute_dtype(dtype)


def _compute(dtype):
    """The float type a kernel's scalar ``C`` argument has for storage ``dtype``."""
    return compute_dtype(dtype).type


class _Call:
    """One kernel's launch for one problem, all but its arrays: the kernel (and its form by vectors, where it has
    one and the channels come in whole vectors), the grids and the scalar arguments around the arrays (the thread
    count first, the channel count last: both in vectors for that form), the storage dtype and layout the arrays
    are given in, and ``zero``: whether the output is zeroed first (a backward whose windows do not cover the
    image)."""
    __slots__ = ("st", "layout", "fn", "grid", "tail", "vec", "zero")

    def __init__(self, name, st, layout, total, scalars, zero=False):
        self.st, self.layout, self.zero = st, layout, zero
        self.fn = _function(name, st, layout[0]) if total else None
        self.grid = ((total + _THREADS - 1) // _THREADS,)
        self.tail = (np.int64(total),) + scalars + (np.int32(layout[1]),)
        vw = _vector_width(name, st, layout)
        self.vec = None
        if total and vw > 1:
            self.vec = (_function(name, st, True, vectors=True), ((total // vw + _THREADS - 1) // _THREADS,),
                        (np.int64(total // vw),) + scalars + (np.int32(layout[1] // vw),))

    def launch(self, arrays):
        """The kernel over its threads (none where there are none), on ``arrays`` then the scalars: by vectors
        where it has that form and every array is 16-byte aligned."""
        if self.vec is not None and all(_address(a) % 16 == 0 for a in arrays):
            fn, grid, tail = self.vec
            fn(grid, (_THREADS,), arrays + tail)
        elif self.fn is not None:
            self.fn(self.grid, (_THREADS,), arrays + self.tail)


def _address(a) -> int:
    """The device address of CuPy array ``a``'s first element."""
    return a.data.ptr


_calls: dict = {}


def _call(key, make):
    """The :class:`_Call` kept under ``key`` (the op, its dims, dtypes and layout, and the device), made by
    ``make()`` on the first call of a problem: a repeated call is a lookup, its allocations and the launch."""
    key += (cupy.cuda.runtime.getDevice(),)
    found = _calls.get(key)
    if found is None:
        found = _calls[key] = make()
    return found


def _layout(a, pdims):
    """``(channels_last, C)``: the pool runs in channels-last memory where its leading array ``a`` is in it."""
    return is_channels_last(a), pdims.x_shape[1]


def _operand(a, st, layout):
    """``a`` as the kernel reads it: ``st``, in the layout's memory order."""
    if not layout[0]:
        return contiguous(a, st)
    return to_channels_last(a if a.dtype == st else a.astype(st))


def _new(shape, st, layout):
    return empty_channels_last(shape, st, cupy) if layout[0] else cupy.empty(shape, dtype=st)


def _size(shape):
    return int(np.prod(shape, dtype=np.int64))


_result_types: dict = {}


def _result_type(a, b):
    """``np.result_type(a, b)`` of two dtypes, kept (asked at every backward call)."""
    found = _result_types.get((a, b))
    if found is None:
        found = _result_types[(a, b)] = np.result_type(a, b)
    return found


def _maxpool_forward_call(pdims, dtype, layout):
    st = _storage(dtype)
    h, w, p, q, (hs, he, ws, we, *_r) = _geometry(pdims)
    total = _size(pdims.y_shape)
    empty = _compute(st)(lowest_finite(dtype))   # exact in the compute type, and after STORE in T
    return _Call("maxpool_fwd", st, layout, total, (h, w, p, q, hs, he, ws, we, empty))


def maxpool_forward(x: cupy.ndarray, pdims: PoolDimsLike) -> cupy.ndarray:
    """The max over each window of ``x`` (CuPy), as :func:`fluxpy.kernels.cpu.maxpool_forward`; the halves are
    read and written as they are (compared in float32). Channels-last ``x`` gives channels-last ``y``."""
    layout = _layout(x, pdims)
    call = _call(("maxpool_fwd", pdims, x.dtype, layout), lambda: _maxpool_forward_call(pdims, x.dtype, layout))
    st = call.st
    xc = _operand(x, st, layout)
    y = _new(pdims.y_shape, st, layout)
    call.launch((xc, y))
    return y if st == x.dtype else y.astype(x.dtype)


def _maxpool_backward_call(pdims, out, layout):
    st = _storage(out)
    h, w, p, q, (hs, he, ws, we, plo, phi, qlo, qhi) = _geometry(pdims)
    disjoint, covered = _tiling(pdims)
    if disjoint:   # a thread per window (see pool.cu)
        total = _size(pdims.y_shape)
        return _Call("maxpool_bwd_tiles", st, layout, total, (h, w, p, q, hs, he, ws, we),
                     zero=not covered)
    total = _size(pdims.x_shape)
    return _Call("maxpool_bwd", st, layout, total, (h, w, p, q, hs, he, ws, we, plo, phi, qlo, qhi))


def maxpool_backward(dy: cupy.ndarray, x: cupy.ndarray, y: cupy.ndarray, pdims: PoolDimsLike) -> cupy.ndarray:
    """Each ``dy`` to the first maximum of its window, as :func:`fluxpy.kernels.cpu.maxpool_backward` (summed in
    float32 for the halves, rounded once); ``dx`` in ``x``'s layout."""
    layout = _layout(x, pdims)
    out = _result_type(dy.dtype, x.dtype)
    call = _call(("maxpool_bwd", pdims, out, layout), lambda: _maxpool_backward_call(pdims, out, layout))
    st = call.st
    dx = _new(pdims.x_shape, st, layout)
    dy, x, y = _operand(dy, st, layout), _operand(x, st, layout), _operand(y, st, layout)
    if call.zero:
        dx.fill(0)
    call.launch((dy, x, y, dx))
    return dx if st == out else dx.astype(out)


def maxpool_gather(dx: cupy.ndarray, x: cupy.ndarray, y: cupy.ndarray, pdims: PoolDimsLike) -> cupy.ndarray:
    """``dx`` read at each window's first maximum, as :func:`fluxpy.kernels.cpu.maxpool_gather`."""
    layout = _layout(x, pdims)
    common = _result_type(dx.dtype, x.dtype)

    def make():
        h, w, p, q, (hs, he, ws, we, *_r) = _geometry(pdims)
        total = _size(pdims.y_shape)
        return _Call("maxpool_gather", _storage(common), layout, total, (h, w, p, q, hs, he, ws, we))
    call = _call(("maxpool_gather", pdims, common, layout), make)
    st = call.st
    out = _new(pdims.y_shape, st, layout)
    dtype = dx.dtype
    dx, x, y = _operand(dx, st, layout), _operand(x, st, layout), _operand(y, st, layout)
    call.launch((dx, x, y, out))
    return out if out.dtype == dtype else out.astype(dtype)


def _check_regular(pdims):
    if pdims.adaptive:
        raise ValueError("meanpool kernels take regular PoolDims; adaptive means are averaging matrices")


def _meanpool_forward_call(pdims, dtype, layout):
    st = _storage(dtype)
    h, w, p, q, (hs, he, ws, we, *_r) = _geometry(pdims)
    total = _size(pdims.y_shape)
    inv = _compute(st)(1.0 / (pdims.kernel[0] * pdims.kernel[1]))
    return _Call("meanpool_fwd", st, layout, total, (h, w, p, q, hs, he, ws, we, inv))


def meanpool_forward(x: cupy.ndarray, pdims: PoolDimsLike) -> cupy.ndarray:
    """The mean of each window, zero padding counted, as :func:`fluxpy.kernels.cpu.meanpool_forward`: floats keep
    their dtype (the halves summed in float32, rounded once), integers give float32."""
    _check_regular(pdims)
    layout = _layout(x, pdims)
    call = _call(("meanpool_fwd", pdims, x.dtype, layout), lambda: _meanpool_forward_call(pdims, x.dtype, layout))
    st = call.st
    y = _new(pdims.y_shape, st, layout)
    call.launch((_operand(x, st, layout), y))
    return y


def _meanpool_backward_call(pdims, dtype, layout):
    st = _storage(dtype)
    h, w, p, q, (_hs, _he, _ws, _we, plo, phi, qlo, qhi) = _geometry(pdims)
    total = _size(pdims.x_shape)
    inv = _compute(st)(1.0 / (pdims.kernel[0] * pdims.kernel[1]))
    return _Call("meanpool_bwd", st, layout, total, (h, w, p, q, plo, phi, qlo, qhi, inv))


def meanpool_backward(dy: cupy.ndarray, pdims: PoolDimsLike) -> cupy.ndarray:
    """``dy / (R*S)`` spread over each window, as :func:`fluxpy.kernels.cpu.meanpool_backward`; ``dx`` in
    ``dy``'s layout."""
    _check_regular(pdims)
    layout = _layout(dy, pdims)
    call = _call(("meanpool_bwd", pdims, dy.dtype, layout), lambda: _meanpool_backward_call(pdims, dy.dtype, layout))
    st = call.st
    dx = _new(pdims.x_shape, st, layout)
    call.launch((_operand(dy, st, layout), dx))
    return dx if st == dy.dtype else dx.astype(dy.dtype)


KERNELS = {
    "maxpool_forward": maxpool_forward, "maxpool_backward": maxpool_backward, "maxpool_gather": maxpool_gather,
    "meanpool_forward": meanpool_forward, "meanpool_backward": meanpool_backward,
}
"""Op name -> CuPy pooling kernel, for :func:`fluxpy.kernels.register`."""
