"""The index checks of the GPU ``scatter`` and ``gather`` (:mod:`fluxpy.kernels.cuda_scatter`): a bad-index flag in
pinned host memory, what a checked call does with it, and :func:`check_indices`.

**Index checks run inside the kernels.** An index outside its axis (or negative) is skipped by every kernel. A
*checked* call (the public ``scatter``/``gather`` ops with indices on the device) has a number, and its kernels leave
it in a flag in pinned host memory (unless an earlier checked call's number is there: the flag names the first one
that met a bad index); unchecked calls (gradients, whose indices were checked on the way forward) leave nothing and
never wait. The ``index_checks`` option (:mod:`fluxpy.options`) says what a checked call does:

- ``"deferred"`` (the default; PyTorch's device-side asserts, CUDA.jl's kernel errors at the next synchronization):
  it does not wait, and returns its result with the bad entries skipped (a gather gives zeros there). The call is
  recorded (its op, axis sizes, weak references to its index arrays, the caller's file and line; the last 256 per
  device) and is reported later, as :class:`~fluxpy.kernels.DeferredBadIndex` (naming the entry while its index
  arrays live), where the host reads the device anyway: by the next checked call in either mode, which reads the
  flag before its own work (a read of pinned memory, no wait), by :func:`check_indices` (``fluxpy.check_indices()``),
  which waits for the device, or with ``wait=False`` reads what has been flagged so far (``fluxpy.train`` does, once
  it has read a step's loss). Reporting clears the flag.
- ``"wait"``: it waits for its kernel and raises :class:`~fluxpy.kernels.BadIndex` naming the first bad entry. The
  result is a new array, so nothing the caller holds has changed when the error comes. A host sync per call.

Inside a CUDA-graph capture there is no waiting in either mode: a flag raised by a replay is reported after the step
that raised it.

A call of :mod:`~fluxpy.kernels.cuda_scatter` takes its device's flag (:func:`_flag`), a number
(:func:`_start_checked`, or :data:`_UNCHECKED`) that its kernels get beside the flag's ``pointer``, and, once they
are queued, :func:`_finish_checked`.

>>> int(_UNCHECKED), _CAPTURED_CALL == 2 ** 31 - 1   # no number; every captured call's
(0, True)
"""
from __future__ import annotations

import collections
import itertools
import os
import sys
import weakref

import numpy as np

from ..backend import cupy
from ..capturing import capturing, on_replay
from ..options import options
from . import BadIndex, DeferredBadIndex
from .cpu import along_axis_index, first_bad_index

__all__ = ["check_indices"]

# The bad-index flag: one int in pinned host memory per device, which the kernels write directly (unified
# addressing maps pinned memory into the device's address space), so a call reads it without a copy or a wait.
# It holds 0, or the number of the first checked call whose kernels met a bad index.

_CAPTURED_CALL = 0x7FFFFFFF   # the number of every checked call made inside a CUDA-graph capture
_UNCHECKED = np.int32(0)      # the number of an unchecked call: its kernels skip a bad index and leave no trace
_RECORDED = 256               # deferred calls remembered per device (older ones are forgotten)
_numbers = itertools.count()
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep   # fluxpy/: not the caller


class _Flag:
    """One device's flag (``view[0]``; ``pointer``, the kernels' argument) and its record of recent deferred
    calls: ``(number, op name, axis sizes, weak references to the index arrays, the along-axis form's axis or None,
    (file, line) of the call)``, oldest first."""

    def __init__(self):
        self.memory = cupy.cuda.alloc_pinned_memory(4)
        self.view = np.frombuffer(self.memory, dtype=np.int32, count=1)
        self.view[0] = 0
        self.pointer = np.uint64(self.memory.ptr)
        self.deferred = collections.deque(maxlen=_RECORDED)


_flags: dict = {}


def _flag(device):
    """The :class:`_Flag` of ``device`` (made by its first scatter or gather problem)."""
    found = _flags.get(device)
    if found is None:
        found = _flags[device] = _Flag()
    return found


def _start_checked(flag):
    """A checked call's number for its kernels, after raising for an earlier deferred call that met a bad index
    (the flag is read without waiting)."""
    if capturing():
        return np.int32(_CAPTURED_CALL)
    if flag.view[0]:
        raise _deferred_error(flag)
    return np.int32(next(_numbers) % (_CAPTURED_CALL - 1) + 1)   # 1 .. 2**31 - 2


def _finish_checked(flag, call, fname, index, sizes, axis=None):
    """After a checked call's kernels are queued: in deferred mode, record the call; in wait mode, wait and raise
    :class:`BadIndex` for its first bad entry (found on the host: the error path may be slow), or for an earlier
    deferred call's. Inside a capture, have every replay report (a replay raises nothing by itself). ``sizes``:
    the indexed axes' (all of them in the along-axis form, ``axis``)."""
    if capturing():
        on_replay(lambda: _report_replay(flag, fname))
        return
    if options.index_checks == "deferred":
        flag.deferred.append((call, fname, sizes, tuple(weakref.ref(a) for a in index), axis, _caller()))
        return
    cupy.cuda.get_current_stream().synchronize()
    seen = flag.view[0]
    if seen == call:
        flag.view[0] = 0
        raise _first_bad_index(index, sizes, axis) or BadIndex(
            -1, -1, -1, f"{fname}: a kernel flagged an out-of-range index that the arrays no longer hold")
    if seen:
        raise _deferred_error(flag)


def _first_bad_index(index, sizes, axis):
    """:func:`~fluxpy.kernels.cpu.first_bad_index` of device index arrays, on the host (the along-axis form's names
    its axis)."""
    host = [cupy.asnumpy(a) for a in index]
    return first_bad_index(host if axis is None else along_axis_index(host[0], axis), sizes)


def _report_replay(flag, fname):
    seen = flag.view[0]
    if seen == _CAPTURED_CALL:
        flag.view[0] = 0
        raise BadIndex(-1, -1, -1, f"{fname}: an index in the captured step was out of range (its entry was skipped)")
    if seen:
        raise _deferred_error(flag)


def _caller():
    """``(file, line)`` of the code that called into fluxpy."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


def _deferred_error(flag):
    """:class:`~fluxpy.kernels.DeferredBadIndex` for the call whose number the flag holds, which is then cleared;
    that call and the recorded ones before it (which have run) are forgotten."""
    seen = int(flag.view[0])
    flag.view[0] = 0
    if seen == _CAPTURED_CALL:
        return BadIndex(-1, -1, -1, "an index in a captured step was out of range (its entry was skipped)")
    entry = next((e for e in flag.deferred if e[0] == seen), None)
    if entry is None:
        return DeferredBadIndex(-1, -1, -1, f"a scatter or gather call made with index_checks='deferred' met an "
                                            f"out-of-range index (skipped); it is no longer recorded (the last "
                                            f"{_RECORDED} such calls are)")
    while flag.deferred.popleft() is not entry:
        pass
    _, op, sizes, refs, axis, (file, line) = entry
    call = {"op": op, "arrays": len(refs), "where": f"{file}:{line}"}
    arrays = [ref() for ref in refs]
    bad = None if any(a is None for a in arrays) else _first_bad_index(arrays, sizes, axis)
    if bad is None:
        return DeferredBadIndex(-1, -1, -1, f"an index was out of range for axes of sizes {sizes} (its entry was "
                                            f"skipped); the index arrays are no longer held or have changed, so "
                                            f"which entry is not known", **call)
    return DeferredBadIndex(bad.which, bad.value, bad.size, **call)


def check_indices(wait: bool = True) -> None:
    """Wait for the current device, then raise :class:`~fluxpy.kernels.DeferredBadIndex` for the first checked
    call made with ``index_checks="deferred"`` that met an out-of-range index; the record of deferred calls is
    cleared either way. ``wait=False``: no wait, only what the kernels have flagged so far (for a caller that has
    just waited for the work it cares about), and the record of calls still in flight is kept. Nothing inside a
    CUDA-graph capture (a captured step reports after each replay).

    >>> check_indices.__name__
    'check_indices'
    """
    flag = _flags.get(cupy.cuda.runtime.getDevice())
    if flag is None or capturing():
        return
    if not wait:
        if flag.view[0]:
            raise _deferred_error(flag)
        return
    cupy.cuda.runtime.deviceSynchronize()
    try:
        if flag.view[0]:
            raise _deferred_error(flag)
    finally:
        flag.deferred.clear()
