"""Conversions between float32, float16 and bfloat16 (of one array, or of many in one launch: a model's weights to the
half type and their gradients back, ``cuda/cast_many.cu``), sums of two arrays (halves or float32: residual
connections and the backward walk's cotangent sums) and the activation derivative's product of two, and
activations with a bias, halves and float32 (forward, and the derivative's product backward), for dense CuPy arrays,
each in one vectorised kernel (``cuda/cast.cu``, ``cuda/bias_act.cu``, whose identity activation with a same-shape
"bias" is the sum): eight items a thread, read and written as whole 16- or 32-byte vectors. The many-array
conversion takes an item a thread (its arrays are small, it changes layouts on the way, and one launch in place of
two per weight is its point: on small networks these launches, not the bytes, are the cost).

CuPy's elementwise kernels (its own and those fluxpy generates through it) move halves an item at a time, far from
the memory's speed (and float32 at about half of it: a (256, 64, 192) float32 sum at 2.2 TB/s on an H200).
Mixed precision converts every parameter to the half type and every gradient back each step,
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

__all__ = ["supports_cast", "cast", "supports_cast_many", "cast_many", "supports_add", "add", "plain_add",
           "supports_bias_act", "bias_act", "act_grad", "act_defines", "KERNELS", "SOURCE_VARIANTS"]

_DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32))
_NULL = np.uint64(0)   # an absent array argument
_THREADS = 256
_SUMMED = HALVES + (np.dtype(np.float32),)   # what add and act_grad take: eight items a thread, 16 or 32 bytes


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
    distinct dtypes, a sum and a product for each half type and float32 (``cuda/bias_act.cu``'s variants with an
    activation, which the tracer writes, are listed by :mod:`fluxpy.kernels.elementwise`), a conversion of many arrays
    from float32 to each half type and back, and their division by a loss scale in float32.

    >>> len(list(SOURCE_VARIANTS()))
    17
    """
    for src in _DTYPES:
        for dst in _DTYPES:
            if src != dst:
                yield "cast.cu", _cast_defines(src, dst)
    for dtype in _SUMMED:
        yield "bias_act.cu", act_defines(_IDENTITY, dtype, "FX_ACT")
        yield "bias_act.cu", act_defines(_IDENTITY, dtype, "FX_DERIV")
    for src, dst in _PAIRS + ((_F32, _F32),):
        yield "cast_many.cu", _many_defines(src, dst)


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
    """Whether :func:`add` sums ``a`` and ``b`` (and :func:`act_grad` multiplies them): non-empty CuPy arrays of one
    dtype (float16, bfloat16 or float32), shape and dense layout (C-contiguous or channels-last, the same strides),
    16-byte aligned, on one device."""
    if cupy is None or type(a) is not cupy.ndarray or type(b) is not cupy.ndarray:
        return False
    return (a.dtype == b.dtype and a.dtype in _SUMMED and a.shape == b.shape and a.strides == b.strides
            and a.size > 0 and a.data.ptr % 16 == 0 and b.data.ptr % 16 == 0 and a.device.id == b.device.id
            and _dense(a))


def add(a, b):
    """``a + b`` in ``a``'s layout (where :func:`supports_add` says so): :func:`bias_act` with no activation and
    ``b`` as the same-shape bias."""
    return bias_act(a, b, _IDENTITY)[0]


def multiply(a, b):
    """``a * b`` in ``a``'s layout (where :func:`supports_add` says so): :func:`act_grad` with the identity, one
    vectorised pass (the ``dropout_backward`` kernel: the cotangent times the kept mask)."""
    return act_grad(a, b, _IDENTITY)


def plain_add(a, b):
    """``a + b`` of plain values: :func:`add` where it applies, else the arrays' own ``+``.

    >>> plain_add(np.ones(2), 1.0)
    array([2., 2.])
    """
    return add(a, b) if supports_add(a, b) else operator.add(a, b)


# -- many arrays a launch: a model's weights to the half type and their gradients back (cuda/cast_many.cu) ---------

CAP = 64             # arrays a launch at most: the table of pointers, offsets and layouts stays inside CUDA's
                     # classic 4 KiB of kernel parameters (6 * CAP + 1 int64)
_ITEMS = 4           # items a thread in a block's chunk of the concatenated index space
_MAX_BLOCKS = 65535  # more items than that many chunks: the blocks stride over them
_ALIGN = 128         # each result starts a multiple of this many items into the shared buffer (256 bytes of halves)
_F32 = np.dtype(np.float32)
_PAIRS = tuple((a, b) for h in HALVES for a, b in ((_F32, h), (h, _F32)))


def _many_defines(src, dst) -> dict:
    return {**_cast_defines(src, dst), "CAP": CAP, "ITEMS": _ITEMS}


def supports_cast_many(x: Any, xs: Any, dtype: Any, channels_last: Any, scale: Any = None) -> bool:
    """Whether :func:`cast_many` converts the arrays ``xs`` (``x`` is ``xs[0]``, for :func:`fluxpy.kernels.find`)
    to ``dtype``: a non-empty list of CuPy arrays on one device, all float32 going to float16 or bfloat16 or all of
    one half type going to float32 (or float32 staying float32 where a scale divides them: the float32 layers'
    gradients under a loss scale), ``channels_last`` a bool for each, ``scale`` None, a positive number or a
    float32 CuPy array of one element."""
    if cupy is None or type(x) is not cupy.ndarray or not xs or len(channels_last) != len(xs):
        return False
    src, dtype = x.dtype, np.dtype(dtype)
    if (src, dtype) not in _PAIRS and not (src == dtype == _F32 and scale is not None):
        return False
    if not all(type(a) is cupy.ndarray and a.dtype == src and a.device.id == x.device.id for a in xs):
        return False
    if type(scale) is cupy.ndarray:
        return scale.dtype == np.float32 and scale.size == 1 and scale.device.id == x.device.id
    return scale is None or (isinstance(scale, float) and scale > 0)


def _channels_last_view(flat, shape):
    """``flat`` (``prod(shape)`` items) as the channels-last array of ``shape`` ``(N, C, *spatial)``."""
    nd = len(shape)
    return flat.reshape((shape[0], *shape[2:], shape[1])).transpose((0, nd - 1, *range(1, nd - 1)))


def _transposed(x) -> bool:
    """Whether ``x`` is a transposed C-order matrix (as a matmul's gradient can be)."""
    return x.ndim == 2 and not x.flags.c_contiguous and x.T.flags.c_contiguous


def _mapping(x, channels_last) -> tuple:
    """``(kind, channels, spatial)``: how ``cast_many.cu`` maps an item of the result to one of ``x`` (dense, or a
    transposed matrix): kind 0 the same order, 1 C order to channels-last, 2 channels-last to C order (a transposed
    matrix is the channels-last ``(1, rows, columns)``: columns of C-order rows)."""
    if _transposed(x):
        return 2, x.shape[0], x.shape[1]
    if x.ndim < 3 or channels_last == is_channels_last(x):
        return 0, 0, 0
    return (1 if channels_last else 2), x.shape[1], x.size // (x.shape[0] * x.shape[1])


def cast_many(x, xs, dtype, channels_last, scale=None) -> list:
    """The arrays ``xs`` (where :func:`supports_cast_many` says so) converted to ``dtype`` and divided by ``scale``
    where it is given, in one launch per :data:`CAP` arrays: the result ``k`` channels-last where
    ``channels_last[k]`` (an array of 3 or more axes), else in C order, all of them views into one new buffer
    (disjoint, each 256-byte aligned). An array neither C-contiguous, channels-last nor a transposed matrix is copied
    to C order first. Each item is what ``xs[k].astype(dtype) / scale`` holds, bit for bit."""
    dtype = np.dtype(dtype)
    sources = [a if a.flags.c_contiguous or is_channels_last(a) or _transposed(a) else cupy.ascontiguousarray(a)
               for a in xs]
    starts = [0]
    for a in sources:
        starts.append(starts[-1] + -(-a.size // _ALIGN) * _ALIGN)
    buffer = cupy.empty(max(starts[-1], 1), dtype)
    out, entries = [], []
    for a, last, begin in zip(sources, channels_last, starts):
        flat = buffer[begin:begin + a.size]
        last = bool(last) and a.ndim >= 3
        out.append(_channels_last_view(flat, a.shape) if last else flat.reshape(a.shape))
        if a.size:
            entries.append((a, flat, _mapping(a, last)))
    if entries:
        kernel = compiler.function("cast_many.cu", "cast_many", _many_defines(x.dtype, dtype))
        _launch_many(kernel, entries, scale)
    return out


def _address(a) -> int:
    """The device address of ``a``'s first item."""
    return a.data.ptr


def _launch_many(kernel, entries, scale) -> None:
    """``cast_many.cu`` over ``entries`` (source, destination, :func:`_mapping`), :data:`CAP` a launch, the table by
    value."""
    at = scale if type(scale) is cupy.ndarray else _NULL
    value = np.float32(0.0 if scale is None or type(scale) is cupy.ndarray else scale)
    for lo in range(0, len(entries), CAP):
        part = entries[lo:lo + CAP]
        table = np.zeros(6 * CAP + 1, np.int64)
        for k, (a, flat, (kind, channels, spatial)) in enumerate(part):
            table[k], table[CAP + k] = _address(a), _address(flat)
            table[3 * CAP + 1 + k], table[4 * CAP + 1 + k], table[5 * CAP + 1 + k] = channels, spatial, kind
        np.cumsum([a.size for a, _, _ in part], out=table[2 * CAP + 1:2 * CAP + 1 + len(part)])
        total = int(table[2 * CAP + len(part)])
        blocks = min(-(-total // (_THREADS * _ITEMS)), _MAX_BLOCKS)
        view = table.view(np.dtype([("t", np.int64, (table.size,))]))
        compiler.launch(kernel, blocks, _THREADS, (view, np.int32(len(part)), at, value))


# name -> (kernel, supports): what fluxpy.kernels.gpu registers for CuPy arrays (the ops' astype and add; the backward
# walk, below the kernel table, is given plain_add by gpu.register)
KERNELS = {"astype": (cast, supports_cast), "add": (add, supports_add),
           "astype_many": (cast_many, supports_cast_many), "dropout_backward": (multiply, supports_add)}


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
    """Whether :func:`bias_act` computes ``act(x + b)``: a non-empty float16, bfloat16 or float32 CuPy ``x``,
    C-contiguous or channels-last, 16-byte aligned, with ``b`` None, an array like ``x`` (shape, layout), or a bias
    vector of its channels (the last axis of C-order data, the channel axis of channels-last data; a multiple of 8
    of them), of ``x``'s dtype, contiguous and aligned. (float32 too: a launch of this kernel costs the host less
    than CuPy's elementwise kernel, which computes the same expression.)"""
    if cupy is None or type(x) is not cupy.ndarray or x.dtype not in _SUMMED or x.size == 0 or x.data.ptr % 16:
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
