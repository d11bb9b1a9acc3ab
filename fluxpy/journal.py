"""A training step stopped by running out of memory leaves the model as it was: the step's journal of fluxpy's own
in-place writes.

A forward pass writes some of a model's arrays in place: BatchNorm's and InstanceNorm's running statistics,
SpectralNorm's singular vectors. A step that runs out of device (or host) memory after such a write, in a later
layer or in the backward pass, would leave them moved by a step that never happened. So those writes go through
:func:`changing`, which, while a step runs in :func:`undone_on_out_of_memory`, keeps each array's old values
first (a copy of a few per-channel vectors); an out-of-memory error puts them back and raises
:class:`StepOutOfMemory`, naming the step. The optimiser has changed nothing by then: the update runs after the
gradient (its device state is made in the warm-up steps), and nothing of the failed step's tape stays referenced.
:func:`changing` also tells the mutation check (:func:`fluxpy.mutation.wrote`) that the write is fluxpy's own.

A writer that can keep the old values at no cost is named by ``changing(..., writer_keeps=True)``: it asks
:func:`awaits` and hands the old values over with :func:`kept` (batch norm's GPU statistics kernel writes them into
its own output as it moves the running statistics, which spares a copy launch per array and step), or has them
copied with :func:`keep_copies`.

>>> import numpy as np
>>> running = np.zeros(3)
>>> def step():
...     with changing(running):
...         running[...] += 1.0         # a layer's own state, moved by the forward pass
...     raise MemoryError("out of memory allocating 1,099,511,627,776 bytes")
>>> try:
...     undone_on_out_of_memory("train (epoch 1, batch 7)", step)
... except StepOutOfMemory as err:
...     print(str(err).split(";")[0])
train (epoch 1, batch 7): out of memory (MemoryError: out of memory allocating 1,099,511,627,776 bytes)
>>> running
array([0., 0., 0.])
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .backend import copy_of
from .capturing import capturing
from .mutation import wrote

__all__ = ["StepOutOfMemory", "changing", "awaits", "kept", "keep_copies", "undone_on_out_of_memory"]

_journal: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fluxpy_step_journal", default=None)


class StepOutOfMemory(MemoryError):
    """A training step ran out of device or host memory; the model and the optimiser state are as they were
    before it. The message names the step and what ran out.

    >>> issubclass(StepOutOfMemory, MemoryError)
    True
    """


_AWAITED = None   # a journal entry's old values until the writer keeps them (changing's writer_keeps)


@contextmanager
def changing(*arrays: Any, writer_keeps: bool = False) -> Iterator[None]:
    """Around fluxpy's own in-place write of ``arrays`` (None skipped) during a forward pass: the step's journal
    keeps their old values first, and the mutation check takes their new fingerprints after. With
    ``writer_keeps``, the code that writes them keeps the old values itself, before its write (:func:`awaits`,
    :func:`kept`, :func:`keep_copies`); what it did not keep it did not write, and nothing of it is put back.

    >>> import numpy as np
    >>> a = np.ones(2)
    >>> with changing(a, None):
    ...     a *= 3
    >>> a
    array([3., 3.])
    """
    arrays = tuple(a for a in arrays if a is not None)
    journal = _journal.get()
    if journal is not None and not capturing():   # a capture writes nothing until its graph is launched
        for a in arrays:
            if id(a) not in journal:
                journal[id(a)] = (a, _AWAITED, None) if writer_keeps else (a, a.copy(), ...)
    try:
        yield
    finally:
        if writer_keeps and journal is not None:
            for a in arrays:
                if _awaited(journal, a):
                    del journal[id(a)]
    wrote(*arrays)


def _awaited(journal: dict, a: Any) -> bool:
    entry = journal.get(id(a))
    return entry is not None and entry[1] is _AWAITED


def awaits(*arrays: Any) -> bool:
    """Whether the step's journal waits for the old values of one of ``arrays`` (None skipped) from their writer:
    inside ``changing(..., writer_keeps=True)``, before the step's first write of it.

    >>> import numpy as np
    >>> awaits(np.ones(2)), awaits(None)
    (False, False)
    """
    journal = _journal.get()
    if journal is not None:
        for a in arrays:
            if a is not None and _awaited(journal, a):
                return True
    return False


def kept(old: Any, *arrays: Any) -> None:
    """The writer of ``arrays`` has put the values each had before its write into ``old[i]`` (an array it owns and
    no longer writes): the journal keeps those of the arrays it :func:`awaits` (None skipped).

    >>> import numpy as np
    >>> rm, rv = np.zeros(2), np.ones(2)
    >>> def step():
    ...     with changing(rm, rv, writer_keeps=True):
    ...         old = np.stack([rm, rv])    # a kernel that keeps what it overwrites
    ...         kept(old, rm, rv)
    ...         rm[...] += 1; rv[...] += 1
    ...     raise MemoryError("out of memory")
    >>> try:
    ...     undone_on_out_of_memory("a step", step)
    ... except StepOutOfMemory:
    ...     rm, rv
    (array([0., 0.]), array([1., 1.]))
    """
    journal = _journal.get()
    if journal is not None:
        for i, a in enumerate(arrays):
            if a is not None and _awaited(journal, a):
                journal[id(a)] = (a, old, i)


def keep_copies(*arrays: Any) -> None:
    """Copy, before a write, those of ``arrays`` whose old values the journal :func:`awaits` (None skipped): for a
    writer with no buffer of its own to keep them in.

    >>> import numpy as np
    >>> keep_copies(np.ones(2), None)   # outside a step: nothing to keep
    """
    journal = _journal.get()
    if journal is not None:
        for a in arrays:
            if a is not None and _awaited(journal, a):
                journal[id(a)] = (a, copy_of(a), ...)


def undone_on_out_of_memory(who: str, f: Callable, *args: Any) -> Any:
    """``f(*args)``, a training step's forward and backward pass (``who`` names the step); where it raises
    ``MemoryError`` (CuPy's ``OutOfMemoryError`` is one), every array :func:`changing` wrote is put back and
    :class:`StepOutOfMemory` raised, outside the failed pass's frames and with no link to its error, so that the
    pass's arrays are freed as it propagates.

    >>> undone_on_out_of_memory("a step", lambda a, b: a + b, 2, 3)   # no error: f's value
    5
    """
    journal: dict = {}
    token = _journal.set(journal)
    try:
        return f(*args)
    except MemoryError as err:   # its traceback (the failed pass's arrays) goes at the end of this block
        failed = f"{type(err).__name__}: {err}"
    finally:
        _journal.reset(token)
    for a, old, index in journal.values():
        if old is not _AWAITED:
            a[...] = old[index]
    journal.clear()   # the copies would live on with the error's traceback
    raise StepOutOfMemory(f"{who}: out of memory ({failed}); the model and the optimiser state are as they were "
                          "before this step. Use a smaller batch, fluxpy.mixed_precision (half the activations' "
                          "memory), or free the device arrays you no longer need")
