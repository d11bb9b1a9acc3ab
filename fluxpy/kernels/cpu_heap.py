"""The C heap between CPU steps: keep freed memory for the next step instead of giving it back to the system.

A CPU training step allocates and frees the same large arrays every step (im2col columns, activations, gradients).
glibc's ``malloc`` gives freed memory above a small threshold back to the system (``munmap``, or a trim of the
heap's top), so the next step's arrays are fresh pages, and the kernel zeroes each page on its first write: on the
MNIST reference net about 2,000 page faults a step and a fifth of its time. :func:`keep_freed_memory` raises the
thresholds with ``mallopt`` so that up to ``mb`` MiB of freed memory stays in the heap, to be reused without a
fault: what PyTorch's CPU allocator users get from jemalloc or tcmalloc, without a preloaded library.

It is set from :data:`fluxpy.options.cpu_heap_keep_mb` (``$FLUXPY_CPU_HEAP_KEEP_MB``, 256 by default) when fluxpy is
imported and each time that option is set; 0 leaves ``malloc`` as it is (or, once changed, puts glibc's defaults
back). Where the C library is not glibc (macOS, musl, Windows) it does nothing.

>>> keep_freed_memory(0) in (True, False)   # glibc's defaults; False where the C library is not glibc
True
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["keep_freed_memory"]

# mallopt's parameters (malloc.h) and glibc's defaults for them
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_DEFAULT = 128 * 1024
_MMAP_MAX = 32 << 20   # glibc refuses an mmap threshold above 32 MiB on 64-bit systems
_TOP_PAD_MAX = 64 << 20

_changed = False


@functools.cache
def _mallopt():
    """glibc's ``mallopt``, or None where the C library has none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None


def keep_freed_memory(mb: int) -> bool:
    """Keep up to ``mb`` MiB of freed memory in the C heap (see the module docstring); ``mb=0`` puts glibc's
    defaults back where this changed them. Returns whether glibc took the settings (False without glibc).

    >>> keep_freed_memory(256) in (True, False)
    True
    """
    global _changed
    mallopt = _mallopt()
    if mallopt is None or (mb == 0 and not _changed):
        return mallopt is not None
    if mb == 0:
        settings = {_M_TRIM_THRESHOLD: _DEFAULT, _M_TOP_PAD: _DEFAULT, _M_MMAP_THRESHOLD: _DEFAULT}
    else:
        keep = mb << 20
        settings = {_M_TRIM_THRESHOLD: keep, _M_TOP_PAD: min(keep, _TOP_PAD_MAX),
                    _M_MMAP_THRESHOLD: min(keep, _MMAP_MAX)}
    ok = all(mallopt(param, value) == 1 for param, value in settings.items())
    _changed = mb != 0
    return ok
