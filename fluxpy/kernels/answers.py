"""Answers kept per problem: what a kernel module's checks (or plans) answered for one problem, so that a repeated
call pays a key and a lookup. A problem's key is made of what the checks read: shapes, strides, dtypes, array types
(:func:`kind`), options. A table is emptied when it reaches :data:`KEPT` problems (a model has a few dozen; a
program that makes new shapes without end does not grow it without end).

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


def answered(table: dict, key: Hashable, make: Callable[[], Any]) -> Any:
    """``table[key]``, made by ``make()`` the first time (``make`` must not return None); the table is emptied first
    when it holds :data:`KEPT` answers.

    >>> t = {}
    >>> answered(t, "k", lambda: 3)
    3
    """
    found = table.get(key)
    if found is None:
        if len(table) >= KEPT:
            table.clear()
        found = table[key] = make()
    return found
