"""Answers kept per problem, the kernels' one memo: what a kernel module's checks answered for one problem, or what
it built or timed for it (a plan, a compiled kernel, a timed choice), so that a repeated call pays a key and a
lookup. A problem's key is made of what the checks read: shapes, strides, dtypes, array types (:func:`kind`),
options, activations. A table of checks' answers is emptied when it reaches :data:`KEPT` problems (a model has a
few dozen; a program that makes new shapes without end does not grow it without end); a table whose entries a
captured CUDA graph holds or that cannot be made again inside a capture (plans with their buffers, timed choices)
never forgets (``kept=None``).

>>> table = {}
>>> answered(table, ("forward", (2, 3)), lambda: "taken"), answered(table, ("forward", (2, 3)), lambda: "again")
('taken', 'taken')
>>> kind(None), kind(1.0)
(None, (<class 'float'>, None, None))
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["KEPT", "kind", "answered"]

KEPT = 4096
"""Problems a table keeps before it is emptied."""


def kind(a: Any) -> tuple | None:
    """``(type, shape, dtype)`` of an array argument for a problem's key (None for None; what has no shape or
    dtype gives None in their place).

    >>> import numpy as np
    >>> kind(np.ones((2, 3), np.float32))
    (<class 'numpy.ndarray'>, (2, 3), dtype('float32'))
    """
    if a is None:
        return None
    return type(a), getattr(a, "shape", None), getattr(a, "dtype", None)


def answered(table: dict, key: Hashable, make: Callable[[], Any], kept: int | None = KEPT) -> Any:
    """``table[key]``, made by ``make()`` the first time (``make`` must not return None); a key that cannot be
    hashed (an unhashable function in it) is made at every call and kept nowhere. The table is emptied first when
    it holds ``kept`` answers; ``kept=None`` for a table that must never forget (a choice timed on the GPU, which
    cannot be timed again inside a capture; compiled kernels).

    >>> t = {}
    >>> answered(t, "k", lambda: 3), answered(t, ["a list"], lambda: 4), t
    (3, 4, {'k': 3})
    """
    try:
        found = table.get(key)
    except TypeError:
        return make()
    if found is None:
        if kept is not None and len(table) >= kept:
            table.clear()
        found = table[key] = make()
    return found
