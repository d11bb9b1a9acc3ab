"""Small CuPy array helpers shared by the CUDA kernels (pooling, the cuDNN calls, layer norm): C-order copies, with
a tiled transpose for permuted views, and the joins (``stack``, ``concatenate``) that a CUDA-graph capture needs.

>>> callable(contiguous), callable(c_contiguous)
(True, True)
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import cupy
from . import compiler

__all__ = ["contiguous", "c_contiguous", "row_addresses", "stack", "concatenate", "KERNELS",
           "SOURCE_VARIANTS"]


def contiguous(a, dtype):
    """``a`` (CuPy) as ``dtype`` in C order, copied only where needed (:func:`c_contiguous`)."""
    if a.dtype != dtype:
        a = a.astype(dtype)
    return c_contiguous(a)


def row_addresses(a) -> list:
    """The device addresses of ``a[0], a[1], ...`` (a C-order array, CuPy) as kernel arguments: the rows of one
    allocation handed to a kernel without an array object each (a view costs more host time than the address).

    >>> row_addresses.__name__
    'row_addresses'
    """
    base, step = a.data.ptr, a.strides[0]
    return [np.uint64(base + i * step) for i in range(a.shape[0])]


# A permuted view (NHWC of NCHW memory: the axis whose elements are adjacent in memory is not the last) is copied in
# TILE x TILE tiles of those two axes through shared memory, read along the one and written along the other, so that
# both sides are coalesced, after neighbouring axes that step through memory as one are merged (H and W there). CuPy's
# copy reads such a view a strided element at a time. TILE x ROWS threads a tile, each thread copying TILE / ROWS of
# its elements (the shapes not taken: BENCHMARKS.md). The other axes, at most _OUTER of them, index the tiles' batch.
# The words are copied as unsigned integers of the item's size: the same bits, for every dtype (bfloat16 too).
_OUTER = 4
TILE, ROWS = 64, 4
_WORDS = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


def _transpose_defines(itemsize):
    """``cuda/transpose.cu``'s defines for items of ``itemsize`` bytes."""
    return {"W": _WORDS[itemsize], "TILE": TILE, "ROWS": ROWS}


def SOURCE_VARIANTS():
    """``(source, defines)`` of every variant :func:`c_contiguous` launches: one per word size.

    >>> [d["W"] for _, d in SOURCE_VARIANTS()]
    ['unsigned short', 'unsigned int', 'unsigned long long']
    """
    for itemsize in _WORDS:
        yield "transpose.cu", _transpose_defines(itemsize)


def _merged(a):
    """``a``'s ``(sizes, element strides)`` with its axes of one element dropped and each pair of neighbours that
    steps through memory as one axis merged (H and W of an NHWC view of NCHW memory): the same elements in the same
    order, in fewer, longer axes."""
    sizes, strides = [], []
    for n, st in zip(a.shape, a.strides):
        if n == 1:
            continue
        st //= a.itemsize
        if sizes and strides[-1] == st * n:
            sizes[-1], strides[-1] = sizes[-1] * n, st
        else:
            sizes.append(n)
            strides.append(st)
    return sizes, strides


# A tile's two axes must fill an eighth of it at least: a permutation of short axes (a sum over 2x2 blocks moves
# them first) would launch a tile for every few elements, where CuPy's copy reads them well enough.
_SHORTEST = TILE // 8


def _transpose_plan(a):
    """``(sizes, strides, axis)`` of ``a``'s merged axes (:func:`_merged`) where ``cuda/transpose.cu`` copies it: the
    axis of element stride 1 (``axis``) is not the last, both are :data:`_SHORTEST` long at least, no axis is
    broadcast (stride 0), and the others number at most :data:`_OUTER`; else None (CuPy's copy runs: it reads rows
    whose elements are adjacent well enough).

    >>> import numpy as np
    >>> _transpose_plan(np.zeros((64, 32), np.float32).T)
    ([32, 64], [1, 32], 0)
    >>> _transpose_plan(np.zeros((4, 2, 2, 4), np.float32).transpose(1, 3, 0, 2)) is None   # short axes
    True
    """
    if a.itemsize not in _WORDS or any(st % a.itemsize for st in a.strides):
        return None
    sizes, strides = _merged(a)
    ones = [i for i in range(len(sizes) - 1) if strides[i] == 1]
    if len(sizes) < 2 or len(ones) != 1 or len(sizes) - 2 > _OUTER or sizes[ones[0]] > TILE * 65535 \
            or a.size // sizes[-1] >= 2**32 or min(sizes[ones[0]], sizes[-1]) < _SHORTEST or 0 in strides:
        return None   # (the grid's y: the tiles along the axis; z: the outer index, 32 bits)
    return sizes, strides, ones[0]


def c_contiguous(a):
    """``a`` (CuPy) in C order: itself where it is, else a copy (a permuted view copied by tiles, see above).

    >>> c_contiguous.__name__
    'c_contiguous'
    """
    if a.flags.c_contiguous:
        return a
    plan = _transpose_plan(a) if a.size else None
    if plan is None:
        return cupy.ascontiguousarray(a.view(f"u{a.itemsize}")).view(a.dtype) if a.itemsize in _WORDS \
            else cupy.ascontiguousarray(a)
    sizes, strides, axis = plan
    out = cupy.empty(a.shape, a.dtype)
    word = np.dtype(f"u{a.itemsize}")
    c_strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    outer = [i for i in range(len(sizes) - 1) if i != axis]
    pad = _OUTER - len(outer)
    outer_sizes = [1] * pad + [sizes[i] for i in outer]
    src_st = [0] * pad + [strides[i] for i in outer]
    dst_st = [0] * pad + [c_strides[i] for i in outer]
    na, nb, outer_count = sizes[axis], sizes[-1], math.prod(outer_sizes)
    fn = compiler.function("transpose.cu", "transpose_copy", _transpose_defines(a.itemsize))
    args = ([np.uint32(outer_count)] + [np.int64(v) for v in (na, nb, strides[-1], c_strides[axis])]
            + [np.uint32(n) for n in outer_sizes[1:]] + [np.int64(v) for v in (*src_st, *dst_st)])
    fn((-(-nb // TILE), -(-na // TILE), min(outer_count, 65535)), (TILE, ROWS), (a.view(word), out.view(word), *args))
    return out


# CuPy joins many arrays with one kernel that reads their addresses from a device table it copies from the host: a
# host-to-device transfer, which a CUDA-graph capture refuses. Inside a capture the joins below copy each array into
# its place instead (a copy kernel per array); outside one, CuPy's single kernel is faster and is what runs.

def _supports(*xs):
    """Only while a capture is under way on the current stream."""
    return bool(xs) and cupy.cuda.get_current_stream().is_capturing()


def concatenate(xs, axis):
    """``cupy.concatenate(xs, axis)`` with one copy per array (capturable)."""
    first = xs[0]
    rest = first.shape[:axis] + first.shape[axis + 1:]
    if any(x.ndim != first.ndim or x.shape[:axis] + x.shape[axis + 1:] != rest for x in xs):
        raise ValueError("concatenate: the shapes differ off the joined axis")
    out = cupy.empty(first.shape[:axis] + (sum(x.shape[axis] for x in xs),) + first.shape[axis + 1:],
                     cupy.result_type(*xs))
    start = 0
    for x in xs:
        out[(slice(None),) * axis + (slice(start, start + x.shape[axis]),)] = x
        start += x.shape[axis]
    return out


def stack(xs, axis):
    """``cupy.stack(xs, axis)`` with one copy per array (capturable)."""
    first = xs[0]
    if any(x.shape != first.shape for x in xs):
        raise ValueError("stack: the shapes differ")
    out = cupy.empty(first.shape[:axis] + (len(xs),) + first.shape[axis:], cupy.result_type(*xs))
    for i, x in enumerate(xs):
        out[(slice(None),) * axis + (i,)] = x
    return out


KERNELS = {
    "stack": (stack, _supports),
    "concatenate": (concatenate, _supports),
}
