"""Conversions between float32, float16 and bfloat16, and sums of two half-precision arrays, for dense CuPy arrays,
each in one vectorised kernel (``cuda/cast.cu``, ``cuda/add.cu``): eight items a thread, read and written as whole
16- or 32-byte vectors.

CuPy converts and adds halves an item at a time through its generic kernels, far from the memory's speed. Mixed
precision converts every parameter to the half type and every gradient back each step, and residual connections
and the backward walk add half-precision arrays of activation size, so these are a training step's kernels.
Conversions round to nearest even (NumPy's and ml_dtypes'), keep NaN a NaN, and turn values past a half's range
into infinities, as ``astype`` does; a sum is computed in float32 (exact for two halves) and rounded once.

>>> supports_cast(None, "float32"), supports_add(None, None)
(False, False)
"""
from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ..backend import cupy
from ..layout import is_channels_last
from . import compiler
from .halfs import BFLOAT16, HALVES, dtype_defines

__all__ = ["supports_cast", "cast", "supports_add", "add", "plain_add", "SOURCE_VARIANTS"]

_DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32))
_THREADS = 256


def _cast_defines(src, dst) -> dict:
    return {"SRC_DTYPE": dtype_defines(src)["FX_DTYPE"], "DST_DTYPE": dtype_defines(dst)["FX_DTYPE"]}


def SOURCE_VARIANTS():
    """``(source, defines)`` of every kernel launched here: a conversion for each ordered pair of distinct dtypes,
    a sum for each half type.

    >>> len(list(SOURCE_VARIANTS()))
    8
    """
    for src in _DTYPES:
        for dst in _DTYPES:
            if src != dst:
                yield "cast.cu", _cast_defines(src, dst)
    for dtype in HALVES:
        yield "add.cu", dtype_defines(dtype)


def _dense(x) -> bool:
    return x._c_contiguous or is_channels_last(x)


def _blocks(n, dev) -> int:
    return min(-(-max(1, n // 8) // _THREADS), 32 * compiler.device(dev).processors)


def supports_cast(x: Any, dtype: Any) -> bool:
    """Whether :func:`cast` converts ``x`` to ``dtype``: a non-empty CuPy array, C-contiguous or channels-last, of
    float32, float16 or bfloat16, to another of the three, its data 32-byte aligned (CuPy's allocations are; a view
    at an odd offset is left to CuPy)."""
    if cupy is None or type(x) is not cupy.ndarray or x.dtype not in _DTYPES or x.size == 0:
        return False
    dtype = np.dtype(dtype)
    return dtype in _DTYPES and dtype != x.dtype and x.data.ptr % 32 == 0 and _dense(x)


def cast(x, dtype):
    """``x`` converted to ``dtype`` in ``x``'s memory layout (where :func:`supports_cast` says so)."""
    dtype = np.dtype(dtype)
    y = cupy.empty_like(x, dtype=dtype)   # order "K": the same layout, so the same item order in memory
    if tuple(s // x.itemsize for s in x.strides) != tuple(s // y.itemsize for s in y.strides):
        return x.astype(dtype)
    kernel = compiler.function("cast.cu", "cast_vec8", _cast_defines(x.dtype, dtype))
    compiler.launch(kernel, _blocks(x.size, x.device.id), _THREADS, (x, y, np.int64(x.size)))
    return y


def supports_add(a: Any, b: Any) -> bool:
    """Whether :func:`add` sums ``a`` and ``b``: non-empty CuPy arrays of one half type, shape and dense layout
    (C-contiguous or channels-last, the same strides), 16-byte aligned, on one device."""
    if cupy is None or type(a) is not cupy.ndarray or type(b) is not cupy.ndarray:
        return False
    return (a.dtype == b.dtype and a.dtype in HALVES and a.shape == b.shape and a.strides == b.strides
            and a.size > 0 and a.data.ptr % 16 == 0 and b.data.ptr % 16 == 0 and a.device.id == b.device.id
            and _dense(a))


def add(a, b):
    """``a + b`` in ``a``'s layout (where :func:`supports_add` says so)."""
    y = cupy.empty_like(a)
    kernel = compiler.function("add.cu", "add_vec8", dtype_defines(a.dtype))
    compiler.launch(kernel, _blocks(a.size, a.device.id), _THREADS, (a, b, y, np.int64(a.size)))
    return y


def plain_add(a, b):
    """``a + b`` of plain values: :func:`add` where it applies, else the arrays' own ``+``.

    >>> plain_add(np.ones(2), 1.0)
    array([2., 2.])
    """
    return add(a, b) if supports_add(a, b) else operator.add(a, b)
