"""A first GPU path for ``scatter`` and ``gather``: CuPy's documented ``cupyx.scatter_add``, ``cupyx.scatter_max`` and
``cupyx.scatter_min`` (atomic, so repeated indices accumulate, in no fixed order: float sums may differ in the last
bits from run to run) and plain CuPy indexing.

The same contract as :func:`fluxpy.kernels.cpu.scatter`: a new array of ``shape`` filled with
:func:`~fluxpy.kernels.cpu.scatter_empty`, then ``op`` of every ``src`` value sent to an entry by ``index``.
float16 and bfloat16 are computed in float32 and rounded once, as the CPU kernels do. Faster kernels, chosen by
measurement, are for later; they take the same names.

>>> sorted(KERNELS)
['gather', 'scatter']
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .cpu import scatter_empty
from .halfs import is_half

__all__ = ["scatter", "gather", "KERNELS"]


def _scatter_function(op: str):
    import cupyx
    return {"add": cupyx.scatter_add, "max": cupyx.scatter_max, "min": cupyx.scatter_min}[op]


def scatter(op: str, src: Any, index: tuple, shape: tuple) -> Any:
    """``op`` (``"add"``, ``"max"``, ``"min"``) of the CuPy array ``src`` scattered by ``index`` into a new array of
    ``shape``; entries no index hits hold ``scatter_empty(op, src.dtype)``.

    >>> scatter.__name__
    'scatter'
    """
    import cupy
    wide = src.astype(np.float32) if is_half(src.dtype) else src
    dst = cupy.full(shape, scatter_empty(op, wide.dtype), dtype=wide.dtype)
    if op != "add" and wide.dtype == np.float64:
        _sorted_extremum(op, dst, index, wide)
    else:
        _scatter_function(op)(dst, index, wide)
    return dst.astype(src.dtype) if wide is not src else dst


def _sorted_extremum(op, dst, index, src):
    """``dst[index] = max/min(dst[index], src)`` with repeated indices, exactly, by a sort: CuPy 14.2's
    ``scatter_max``/``scatter_min`` round float64 values through float32 (measured on an H100). The values are
    sorted by destination, then by value (NaN last, so it wins a max, as NumPy's), and each destination takes the
    last of its run; a min is the max of the negated values."""
    import cupy
    flat = dst.reshape(-1)
    dest = cupy.arange(flat.size).reshape(dst.shape)[index]
    values = cupy.broadcast_to(src, dest.shape).reshape(-1)
    dest = dest.reshape(-1)
    if op == "min":
        values = -values
    order = cupy.lexsort(cupy.stack([values, dest.astype(values.dtype)]))
    dest, values = dest[order], values[order]
    last = cupy.ones(dest.size, dtype=bool)
    last[:-1] = dest[1:] != dest[:-1]
    dest, values = dest[last], values[last]
    current = flat[dest] if op == "max" else -flat[dest]
    best = cupy.where(cupy.isnan(values) | (values > current), values, current)
    flat[dest] = best if op == "max" else -best


def gather(src: Any, index: tuple) -> Any:
    """``src[index]`` for a CuPy array.

    >>> gather.__name__
    'gather'
    """
    return src[index]


KERNELS = {"scatter": scatter, "gather": gather}
