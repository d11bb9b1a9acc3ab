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
bfloat16 are read and written in their own 16 bits and computed in float32 (sums rounded once; max exact); every
pooled value is its own load, so there are no vector loads to widen. The module imports without CuPy (the kernels
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
from .halfs import KERNEL_DTYPES, compute_dtype, dtype_defines

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


def _defines(dtype, channels_last):
    """``cuda/pool.cu``'s defines: the dtype's (halfs.cuh) and ``CL``, 1 for channels-last memory."""
    return {**dtype_defines(dtype), "CL": int(channels_last)}


def SOURCE_VARIANTS():
    """``(source, defines)`` of every variant the kernels launch: each dtype, in either layout.

    >>> len(list(SOURCE_VARIANTS()))
    8
    """
    for dtype in KERNEL_DTYPES:
        for channels_last in (False, True):
            yield "pool.cu", _defines(dtype, channels_last)


def _function(name, dtype, channels_last=False):
    return compiler.function("pool.cu", name, _defines(dtype, channels_last))


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


def _launch(name, dtype, total, args, layout):
    """``name`` over ``total`` threads; ``layout`` (from :func:`_layout`) picks the C-order or channels-last
    kernel and gives its channel count."""
    channels_last, channels = layout
    if total:
        _function(name, dtype, channels_last)(((total + _THREADS - 1) // _THREADS,), (_THREADS,),
                                              args + (np.int32(channels),))


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


def maxpool_forward(x: cupy.ndarray, pdims: PoolDimsLike) -> cupy.ndarray:
    """The max over each window of ``x`` (CuPy), as :func:`fluxpy.kernels.cpu.maxpool_forward`; the halves are
    read and written as they are (compared in float32). Channels-last ``x`` gives channels-last ``y``."""
    st = _storage(x.dtype)
    layout = _layout(x, pdims)
    xc = _operand(x, st, layout)
    h, w, p, q, (hs, he, ws, we, *_r) = _geometry(pdims)
    y = _new(pdims.y_shape, st, layout)
    empty = _compute(st)(lowest_finite(x.dtype))   # exact in the compute type, and after STORE in T
    _launch("maxpool_fwd", st, y.size, (xc, y, np.int64(y.size), h, w, p, q, hs, he, ws, we, empty), layout)
    return y if st == x.dtype else y.astype(x.dtype)


def maxpool_backward(dy: cupy.ndarray, x: cupy.ndarray, y: cupy.ndarray, pdims: PoolDimsLike) -> cupy.ndarray:
    """Each ``dy`` to the first maximum of its window, as :func:`fluxpy.kernels.cpu.maxpool_backward` (summed in
    float32 for the halves, rounded once); ``dx`` in ``x``'s layout."""
    out = np.result_type(dy.dtype, x.dtype)
    st = _storage(out)
    layout = _layout(x, pdims)
    h, w, p, q, (hs, he, ws, we, plo, phi, qlo, qhi) = _geometry(pdims)
    dx = _new(pdims.x_shape, st, layout)
    dy, x, y = (_operand(a, st, layout) for a in (dy, x, y))
    disjoint, covered = _tiling(pdims)
    if disjoint:   # a thread per window (see pool.cu)
        if not covered:
            dx.fill(0)
        _launch("maxpool_bwd_tiles", st, y.size, (dy, x, y, dx, np.int64(y.size), h, w, p, q, hs, he, ws, we),
                layout)
    else:
        _launch("maxpool_bwd", st, dx.size, (dy, x, y, dx, np.int64(dx.size), h, w, p, q,
                                             hs, he, ws, we, plo, phi, qlo, qhi), layout)
    return dx if st == out else dx.astype(out)


def maxpool_gather(dx: cupy.ndarray, x: cupy.ndarray, y: cupy.ndarray, pdims: PoolDimsLike) -> cupy.ndarray:
    """``dx`` read at each window's first maximum, as :func:`fluxpy.kernels.cpu.maxpool_gather`."""
    st = _storage(np.result_type(dx.dtype, x.dtype))
    layout = _layout(x, pdims)
    h, w, p, q, (hs, he, ws, we, *_r) = _geometry(pdims)
    out = _new(pdims.y_shape, st, layout)
    dtype = dx.dtype
    dx, x, y = (_operand(a, st, layout) for a in (dx, x, y))
    _launch("maxpool_gather", st, out.size, (dx, x, y, out, np.int64(out.size), h, w, p, q, hs, he, ws, we),
            layout)
    return out if out.dtype == dtype else out.astype(dtype)


def _check_regular(pdims):
    if pdims.adaptive:
        raise ValueError("meanpool kernels take regular PoolDims; adaptive means are averaging matrices")


def meanpool_forward(x: cupy.ndarray, pdims: PoolDimsLike) -> cupy.ndarray:
    """The mean of each window, zero padding counted, as :func:`fluxpy.kernels.cpu.meanpool_forward`: floats keep
    their dtype (the halves summed in float32, rounded once), integers give float32."""
    _check_regular(pdims)
    st = _storage(x.dtype)
    layout = _layout(x, pdims)
    h, w, p, q, (hs, he, ws, we, *_r) = _geometry(pdims)
    y = _new(pdims.y_shape, st, layout)
    inv = _compute(st)(1.0 / (pdims.kernel[0] * pdims.kernel[1]))
    _launch("meanpool_fwd", st, y.size,
            (_operand(x, st, layout), y, np.int64(y.size), h, w, p, q, hs, he, ws, we, inv), layout)
    return y


def meanpool_backward(dy: cupy.ndarray, pdims: PoolDimsLike) -> cupy.ndarray:
    """``dy / (R*S)`` spread over each window, as :func:`fluxpy.kernels.cpu.meanpool_backward`; ``dx`` in
    ``dy``'s layout."""
    _check_regular(pdims)
    st = _storage(dy.dtype)
    layout = _layout(dy, pdims)
    h, w, p, q, (_hs, _he, _ws, _we, plo, phi, qlo, qhi) = _geometry(pdims)
    dx = _new(pdims.x_shape, st, layout)
    inv = _compute(st)(1.0 / (pdims.kernel[0] * pdims.kernel[1]))
    _launch("meanpool_bwd", st, dx.size,
            (_operand(dy, st, layout), dx, np.int64(dx.size), h, w, p, q, plo, phi, qlo, qhi, inv), layout)
    return dx if st == dy.dtype else dx.astype(dy.dtype)


KERNELS = {
    "maxpool_forward": maxpool_forward, "maxpool_backward": maxpool_backward, "maxpool_gather": maxpool_gather,
    "meanpool_forward": meanpool_forward, "meanpool_backward": meanpool_backward,
}
"""Op name -> CuPy pooling kernel, for :func:`fluxpy.kernels.register`."""
