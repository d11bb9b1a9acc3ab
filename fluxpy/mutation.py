"""The mutation check: an array changed in place while a gradient still needs it raises, instead of giving a wrong
gradient.

A tape reads arrays from outside it: the arguments of :func:`fluxpy.gradient` (a model's weights) and the constants
its ops take (the batch, a mask, an index array). Its pullbacks keep some of them to compute the gradient later, so
changing one of them in place between the forward pass and the backward pass (inside ``f`` after an op read it, or
between :func:`fluxpy.pullback` and a call of its ``back``) would silently change the gradient. PyTorch refuses
this with version counters on its tensors; NumPy and CuPy arrays have none, so the tape keeps a fingerprint (a
CRC-32 of the bytes: :func:`fluxpy.backend.fingerprint`) of each such array when an op first reads it and compares
it before the backward pass runs.
The check is strict: it also refuses a change to an array that no pullback kept (an addend, say), since which
arrays a rule keeps is the rule's own business.

What it catches: any change to the bytes of an array the tape read (``x[0] = 1``, ``x += 1``, ``np.random.shuffle
(x)``, writes through another view of the same memory). What it cannot: arrays that fluxpy's ops only reach
through Python objects the tape never sees, and a change undone before the backward pass (which changes nothing).

:data:`fluxpy.options` ``mutation_checks``: ``"auto"`` (the default) checks NumPy arrays (the CRC runs at about
4 GB/s, well under 1% of a CPU step: BENCHMARKS.md); True checks CuPy arrays too, in eager steps (a reduction and a
host read per array: for debugging; a CUDA-graph capture skips it); False turns it off.

>>> import numpy as np
>>> from fluxpy import gradient
>>> x = np.array([1.0, 2.0])
>>> def f(w):
...     y = (w * x).sum()
...     x[0] = 10.0           # the product's pullback still needs the old x
...     return y
>>> gradient(f, np.ones(2))
Traceback (most recent call last):
...
fluxpy.mutation.ChangedInPlaceError: gradient: an array `multiply` read, of shape (2,) and dtype float64, was \
changed in place before the backward pass, so its gradient would be computed from the new values; change a copy \
(x = x.copy()) or change it after the gradient (fluxpy.options(mutation_checks=False) turns this check off)
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from .backend import fingerprint, gpu_device
from .capturing import capturing
from .options import options

__all__ = ["ChangedInPlaceError", "Watch", "start", "stop", "watching", "wrote"]

watching: dict[int, Watch] = {}
"""The :class:`Watch` of each tape level being recorded (``Primitive`` adds the constants its ops take)."""


class ChangedInPlaceError(RuntimeError):
    """An array a tape read was changed in place before the backward pass that needs it; the message names the op
    that read it (or the argument), its shape and dtype.

    >>> issubclass(ChangedInPlaceError, RuntimeError)
    True
    """


def _ref(a: Any):
    """A weak reference to ``a`` (an array freed meanwhile cannot have changed), else a strong one."""
    try:
        return weakref.ref(a)
    except TypeError:
        return lambda: a


def _watchable(a: Any) -> bool:
    if type(a) is np.ndarray:
        return a.size > 0 and a.dtype != object
    if options.mutation_checks is not True or capturing():
        return False
    return gpu_device(a) is not None and a.size > 0


class Watch:
    """The arrays one tape read from outside it, each with its fingerprint when first read and what read it.

    >>> import numpy as np
    >>> w, x = Watch(), np.ones(3)
    >>> w.add(x, "an array `multiply` read")
    >>> w.check("gradient")          # nothing changed
    >>> x[1] = 2.0
    >>> w.check("gradient")
    Traceback (most recent call last):
    ...
    fluxpy.mutation.ChangedInPlaceError: gradient: an array `multiply` read, of shape (3,) and dtype float64, was \
changed in place before the backward pass, so its gradient would be computed from the new values; change a copy \
(x = x.copy()) or change it after the gradient (fluxpy.options(mutation_checks=False) turns this check off)
    """
    __slots__ = ("seen", "devices")

    def __init__(self) -> None:
        self.seen: dict[int, tuple] = {}   # id(array) -> (weak reference, fingerprint, what read it)
        self.devices = options.mutation_checks is True   # CuPy arrays too (else only NumPy's are looked at)

    def add(self, a: Any, what: str) -> None:
        """Keep ``a``'s fingerprint, where ``a`` is an array the check covers not seen before, or those in the
        tuple or list ``a`` (an index); ``what`` says who read it, as the message names it."""
        if type(a) is tuple or type(a) is list:
            for item in a:
                self.add(item, what)
            return
        key = id(a)
        entry = self.seen.get(key)
        if entry is not None and entry[0]() is a:
            return
        if _watchable(a):
            self.seen[key] = (_ref(a), fingerprint(a), what)

    def check(self, who: str) -> None:
        """Raise :class:`ChangedInPlaceError` (``who``: the caller it names) where a watched array still alive
        has other bytes than when it was first read."""
        for ref, first, what in self.seen.values():
            a = ref()
            if a is not None and fingerprint(a) != first:
                raise ChangedInPlaceError(
                    f"{who}: {what}, of shape {tuple(a.shape)} and dtype {a.dtype}, was changed in place before "
                    "the backward pass, so its gradient would be computed from the new values; "
                    "change a copy (x = x.copy()) or change it after the gradient "
                    "(fluxpy.options(mutation_checks=False) turns this check off)")


def wrote(*arrays: Any) -> None:
    """Say that fluxpy itself changed ``arrays`` in place on purpose while a tape records (a layer's own state:
    BatchNorm's running statistics, SpectralNorm's vectors): every watch holding one takes its new fingerprint.

    >>> import numpy as np
    >>> w, x = Watch(), np.ones(2)
    >>> watching[-1] = w; w.add(x, "BatchNorm's running mean")
    >>> x += 1; wrote(x); w.check("gradient"); del watching[-1]
    """
    for watch in list(watching.values()):
        for a in arrays:
            entry = watch.seen.get(id(a))
            if entry is not None and entry[0]() is a:
                watch.seen[id(a)] = (entry[0], fingerprint(a), entry[2])


def start(level: int) -> Watch | None:
    """The watch of the tape at ``level`` (registered in :data:`watching`), or None where the check is off.

    >>> w = start(10**9); (w is watching[10**9], stop(10**9), 10**9 in watching)
    (True, None, False)
    """
    if options.mutation_checks is False:
        return None
    watch = watching[level] = Watch()
    return watch


def stop(level: int) -> None:
    """The tape at ``level`` has stopped recording: its ops read nothing more.

    >>> w = start(10**9); stop(10**9); 10**9 in watching
    False
    """
    watching.pop(level, None)
