"""Small CuPy array helpers shared by the CUDA kernels (pooling, the cuDNN calls).

>>> callable(contiguous)
True
"""
from __future__ import annotations

from ..backend import cupy

__all__ = ["contiguous"]


def contiguous(a, dtype):
    """``a`` (CuPy) as ``dtype`` in C order, copied only where needed."""
    if a.dtype != dtype:
        a = a.astype(dtype)
    if not a.flags.c_contiguous:
        a = cupy.ascontiguousarray(a)
    return a
