"""Small CuPy array helpers shared by the CUDA kernels (pooling, the cuDNN calls), and the joins (``stack``,
``concatenate``) that a CUDA-graph capture needs.

>>> callable(contiguous)
True
"""
from __future__ import annotations

from ..backend import cupy

__all__ = ["contiguous", "stack", "concatenate", "KERNELS"]


def contiguous(a, dtype):
    """``a`` (CuPy) as ``dtype`` in C order, copied only where needed."""
    if a.dtype != dtype:
        a = a.astype(dtype)
    if not a.flags.c_contiguous:
        a = cupy.ascontiguousarray(a)
    return a


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
