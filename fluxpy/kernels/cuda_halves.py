"""Conversions between float32, float16 and bfloat16, sums of two half-precision arrays, and half-precision
activations with a bias (forward, and the derivative's product backward), for dense CuPy arrays, each in one
vectorised kernel (``cuda/cast.cu``, ``cuda/bias_act.cu``, whose identity activation with a same-shape "bias" is the
sum): eight items a thread, read and written as whole 16- or 32-byte vectors.

CuPy's elementwise kernels (its own and those fluxpy generates through it) move halves an item at a time, far from
the memory's speed. Mixed precision converts every parameter to the half type and every gradient back each step,
residual connections and the backward walk add half-precision arrays of activation size, and every Dense or
residual block with an activation runs one forward and one backward, so these are a training step's kernels.
An activation is computed in float32 from the loaded values and rounded once, as the traced kernels do, so the
results are theirs.
Conversions round to nearest even (NumPy's and ml_dtypes'), keep NaN a NaN, and turn values past a half's range
into infinities, as ``astype`` does; a sum is computed in float32 (exact for two halves) and rounded once.

>>> supports_cast(None, "float32"), supports_add(None, None), supports_bias_act(None, None)
(False, False, False)
"""
from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ..backend import cupy
from ..layout import is_channels_last
from . import compiler
from .halfs import BFLOAT16, HALVES, dtype_defines

__all__ = ["supports_cast", "cast", "supports_add", "add", "plain_add", "supports_bias_act", "bias_act", "act_grad",
           "act_defines", "KERNELS", "SOURCE_VARIANTS"]

_DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32))
_NULL = np.uint64(0)   # an absent array argument
_THREADS = 256


def _cast_defines(src, dst) -> dict:
    return {"SRC_DTYPE": dtype_defines(src)["FX_DTYPE"], "DST_DTYPE": dtype_defines(dst)["FX_DTYPE"]}


def act_defines(act_c: str, dtype, name: str) -> dict:
    """``cuda/bias_act.cu``'s defines: the half type's, and ``name`` (``FX_ACT`` for :func:`bias_act`,
    ``FX_DERIV`` for :func:`act_grad`) as the C expression ``act_c`` of ``v`` (``activation_c(f, dtype, "v")``).

    >>> act_defines("(v)", BFLOAT16, "FX_ACT")
    {'FX_DTYPE': 2, 'FX_ACT(v)': '(v)'}
    """
    return {**dtype_defines(dtype), f"{name}(v)": act_c}


_IDENTITY = "(v)"   # the sum: bias_act.cu's activation left out


def SOURCE_VARIANTS():
    """``(source, defines)`` of the conversions and sums launched here: a conversion for each ordered pair of
    distinct dtypes, a sum for each half type (``cuda/bias_act.cu``'s variants with an activation, which the tracer
    writes, are listed by :mod:`fluxpy.kernels.elementwise`).

    >>> len(list(SOURCE_VARIANTS()))
    8
    """
    for src in _DTYPES:
        for dst in _DTYPES:
            if src != dst:
                yield "cast.cu", _cast_defines(src, dst)
    for dtype in HALVES:
        yield "bias_act.cu", act_defines(_IDENTITY, dtype, "FX_ACT")


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
    """``a + b`` in ``a``'s layout (where :func:`supports_add` says so): :func:`bias_act` with no activation and
    ``b`` as the same-shape bias."""
    return bias_act(a, b, _IDENTITY)[0]


def plain_add(a, b):
    """``a + b`` of plain values: :func:`add` where it applies, else the arrays' own ``+``.

    >>> plain_add(np.ones(2), 1.0)
    array([2., 2.])
    """
    return add(a, b) if supports_add(a, b) else operator.add(a, b)


# name -> (kernel, supports): what fluxpy.kernels.gpu registers for CuPy arrays (the ops' astype and add; the backward
# walk, below the kernel table, is given plain_add by gpu.register)
KERNELS = {"astype": (cast, supports_cast), "add": (add, supports_add)}


def _period(x, b) -> int | None:
    """How ``b`` repeats along ``x``'s memory: 0 for none or an array of ``x``'s shape and layout, ``C`` for a
    vector along the last axis of C-order data or the channels of channels-last data (a multiple of 8), None for
    anything else."""
    if b is None or (b.shape == x.shape and b.strides == x.strides):
        return 0
    if not b._c_contiguous or x.ndim == 0:
        return None
    lead = tuple(d for d in b.shape if d != 1)
    if x._c_contiguous:
        c = x.shape[-1]
        ok = b.shape[-1:] == (c,) and lead == (c,)
    else:   # channels-last: the channel axis is the one adjacent in memory
        c = x.shape[1]
        ok = x.ndim >= 3 and len(b.shape) >= x.ndim - 1 and b.shape[-(x.ndim - 1)] == c and lead == (c,)
    return c if ok and c % 8 == 0 else None


def supports_bias_act(x: Any, b: Any) -> bool:
    """Whether :func:`bias_act` computes ``act(x + b)``: a non-empty half-precision CuPy ``x``, C-contiguous or
    channels-last, 16-byte aligned, with ``b`` None, an array like ``x`` (shape, layout), or a bias vector of its
    channels (the last axis of C-order data, the channel axis of channels-last data; a multiple of 8 of them),
    of ``x``'s dtype, contiguous and aligned."""
    if cupy is None or type(x) is not cupy.ndarray or x.dtype not in HALVES or x.size == 0 or x.data.ptr % 16:
        return False
    if not _dense(x):
        return False
    if b is None:
        return True
    if type(b) is not cupy.ndarray or b.dtype != x.dtype or b.data.ptr % 16 or b.device.id != x.device.id:
        return False
    return _period(x, b) is not None


def bias_act(x, b, act_c: str, preactivation: bool = False):
    """``(act(x + b), x + b or None)`` in ``x``'s layout (where :func:`supports_bias_act` says so; ``b`` None adds
    nothing), ``act_c`` the activation as a C expression of ``v``; the pre-activation is returned with
    ``preactivation``."""
    y = cupy.empty_like(x)
    z = cupy.empty_like(x) if preactivation else None
    kernel = compiler.function("bias_act.cu", "bias_act_vec8", act_defines(act_c, x.dtype, "FX_ACT"))
    compiler.launch(kernel, _blocks(x.size, x.device.id), _THREADS,
                    (x, _NULL if b is None else b, y, _NULL if z is None else z, np.int64(x.size),
                     np.int64(_period(x, b))))
    return y, z


def act_grad(dy, s, derivative_c: str):
    """``dy * derivative(s)`` in ``dy``'s layout, for ``dy`` and ``s`` that :func:`supports_add` takes,
    ``derivative_c`` the derivative as a C expression of ``v``."""
    dz = cupy.empty_like(dy)
    kernel = compiler.function("bias_act.cu", "act_grad_vec8", act_defines(derivative_c, dy.dtype, "FX_DERIV"))
    compiler.launch(kernel, _blocks(dy.size, dy.device.id), _THREADS, (dy, s, dz, np.int64(dy.size)))
    return dz
