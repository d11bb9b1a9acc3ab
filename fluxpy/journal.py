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

from .capturing import capturing
from .mutation import wrote

__all__ = ["StepOutOfMemory", "changing", "undone_on_out_of_memory"]

_journal: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fluxpy_step_journal", default=None)


class StepOutOfMemory(MemoryError):
    """A training step ran out of device or host memory; the model and the optimiser state are as they were
    before it. The message names the step and what ran out.

    >>> issubclass(StepOutOfMemory, MemoryError)
    True
    """


@contextmanager
def changing(*arrays: Any) -> Iterator[None]:
    """Around fluxpy's own in-place write of ``arrays`` (None skipped) during a forward pass: the step's journal
    keeps their old values first, and the mutation check takes their new fingerprints after.

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
                journal[id(a)] = (a, a.copy())
    yield
    wrote(*arrays)


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
    for a, old in journal.values():
        a[...] = old
    journal.clear()   # the copies would live on with the error's traceback
    raise StepOutOfMemory(f"{who}: out of memory ({failed}); the model and the optimiser state are as they were "
                          "before this step. Use a smaller batch, fluxpy.mixed_precision (half the activations' "
                          "memory), or free the device arrays you no longer need")
