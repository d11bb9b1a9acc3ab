"""Datasets as observations: MLUtils' ``numobs``, ``getobs``, ``shuffleobs``, ``splitobs``, ``kfolds``, ``batch``,
``unbatch``, ``chunk`` and ``mapobs``, batch first.

A dataset is an array whose FIRST axis runs over observations (fluxpy's batch-first layout; MLUtils' last axis of
column-major arrays holds the same bytes), a tuple or list of such arrays with one count (``(x, y)``), a dict of
them, or any object with ``__len__`` and ``__getitem__`` (one observation per index). What these functions return has
the input's structure: ``getobs((x, y), [0, 2])`` is ``(x[[0, 2]], y[[0, 2]])``. They work on NumPy and CuPy arrays
alike (the indices are taken where the data are) and copy nothing until an observation is asked for, except
``getobs``, ``batch`` and ``unbatch``.

>>> import numpy as np
>>> x, y = np.arange(20.0).reshape(10, 2), np.arange(10)
>>> numobs((x, y))
10
>>> train, test = splitobs((x, y), at=0.8)
>>> numobs(train), numobs(test)
(8, 2)
>>> getobs(test, 0)
(array([16., 17.]), np.int64(8))
"""
from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .backend import get_array_module, is_array
from .random import as_rng

__all__ = ["numobs", "getobs", "obsview", "shuffleobs", "splitobs", "kfolds", "batch", "unbatch", "chunk", "mapobs"]


# ---------------------------------------------------------------------------------------------
# Bounded descriptions for error messages: never the whole data


def short(text, limit=80):
    """``text`` cut to ``limit`` characters, so that an error message never holds the whole data.

    >>> short("x" * 100, 10)
    'xxxxxxx...'
    """
    text = str(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe(x) -> str:
    """``x`` in a few words for an error message: type, shape and dtype of an array, type and length of a sequence.

    >>> describe(np.zeros((2, 3), np.uint8))
    'ndarray of shape (2, 3) uint8'
    """
    if hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.generic):
        return f"{type(x).__name__} of shape {tuple(x.shape)} {x.dtype}"
    if isinstance(x, (str, bytes)):
        return f"{type(x).__name__} {short(repr(x), 60)}"
    if isinstance(x, (list, tuple, range, dict, set)):
        return f"{type(x).__name__} of length {len(x)}"
    if isinstance(x, (int, float, complex, np.generic)) or x is None:
        return f"{type(x).__name__} {short(repr(x.item() if isinstance(x, np.generic) else x), 60)}"
    return type(x).__name__


def numobs(data: Any) -> int:
    """The number of observations in ``data`` (the first axis of an array; one count for a tuple, list or dict of
    them, which must agree; ``len`` of any other sized object).

    >>> import numpy as np
    >>> numobs({"x": np.ones((3, 2)), "y": np.zeros(3)})
    3
    """
    if is_array(data):
        if data.ndim == 0:
            raise ValueError("numobs expects an array with an observation axis (the first), got a 0-d array")
        return int(data.shape[0])
    if isinstance(data, (tuple, list, dict)) and data and not _is_observation_list(data):
        parts = data.values() if isinstance(data, dict) else data
        counts = [numobs(p) for p in parts]
        if len(set(counts)) != 1:
            raise ValueError(f"numobs expects the parts of the dataset to hold as many observations each, got "
                             f"{counts}")
        return counts[0]
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return len(data)
    raise TypeError(f"numobs expects an array, a tuple, list or dict of arrays, or an object with __len__ and "
                    f"__getitem__, got {describe(data)}")


def _is_observation_list(data):
    """A list whose items are not datasets themselves (numbers, strings): a plain sequence of observations."""
    return isinstance(data, list) and not any(is_array(d) or isinstance(d, (tuple, list, dict)) for d in data)


def getobs(data: Any, index: Any) -> Any:
    """The observations ``index`` (an int, a slice, or an integer array) of ``data``, in its structure.

    >>> import numpy as np
    >>> getobs((np.arange(6).reshape(3, 2), np.array([7, 8, 9])), [2, 0])
    (array([[4, 5],
           [0, 1]]), array([9, 7]))
    """
    n = numobs(data)
    index = _checked_index(index, n)
    return _take(data, index)


def _checked_index(index, n):
    if isinstance(index, slice):
        return index
    if isinstance(index, numbers.Integral) and not isinstance(index, bool):
        if not -n <= index < n:
            raise IndexError(f"getobs: observation {index} of {n}")
        return int(index)
    idx = np.asarray(index) if not is_array(index) else index
    if idx.ndim != 1 or (idx.size and np.dtype(idx.dtype).kind not in "iu"):
        raise TypeError(f"getobs expects an int, a slice or a 1-d array of ints as the index, got {describe(idx)}")
    return idx


def _take(data, index):
    if is_array(data):
        if is_array(index) and not isinstance(index, get_array_module(data).ndarray):
            index = get_array_module(data).asarray(index)
        return data[index]
    if isinstance(data, tuple):
        return tuple(_take(d, index) for d in data)
    if isinstance(data, dict):
        return {k: _take(v, index) for k, v in data.items()}
    if isinstance(data, list) and not _is_observation_list(data):
        return [_take(d, index) for d in data]
    if isinstance(data, (ObsView, MappedObs)) or isinstance(index, int):
        return data[index]
    return [data[int(i)] for i in np.arange(len(data))[index]]   # any other sequence: a list of its items


class ObsView:
    """Observations ``indices`` of ``data``, taken when asked (``len`` and ``[i]``); what :func:`obsview`,
    :func:`shuffleobs`, :func:`splitobs` and :func:`kfolds` return.

    >>> import numpy as np
    >>> v = obsview(np.arange(5), [4, 1])
    >>> len(v), v[0], getobs(v, [1, 0])
    (2, np.int64(4), array([1, 4]))
    """

    def __init__(self, data: Any, indices: Any) -> None:
        self.data, self.indices = data, np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: Any) -> Any:
        picked = self.indices[_checked_index(index, len(self)) if not isinstance(index, slice) else index]
        return _take(self.data, picked if np.ndim(picked) else int(picked))

    def __iter__(self) -> Iterator:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"ObsView({len(self)} of {numobs(self.data)} observations)"


def obsview(data: Any, indices: Any) -> ObsView:
    """A lazy view of the observations ``indices`` of ``data`` (MLUtils' ``obsview``)."""
    n = numobs(data)
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 1 or (idx.size and (idx.min() < -n or idx.max() >= n)):
        raise IndexError(f"obsview expects a 1-d array of observation indices in [-{n}, {n}), got {idx!r}")
    return ObsView(data, idx % n if n else idx)


def shuffleobs(data: Any, rng: Any = None) -> ObsView:
    """``data``'s observations in a random order (a lazy view); ``rng`` a NumPy generator or seed.

    >>> import numpy as np
    >>> sorted(getobs(shuffleobs(np.arange(4), rng=0), slice(None)).tolist())
    [0, 1, 2, 3]
    """
    return obsview(data, as_rng(rng, "shuffleobs").permutation(numobs(data)))


def splitobs(data: Any, at: float | tuple[float, ...] = 0.7, shuffle: bool = False, rng: Any = None) -> tuple:
    """``data`` split into consecutive parts: ``at`` a fraction in (0, 1) gives two parts (the first
    ``round(at * n)`` observations, the rest), a tuple of fractions summing below 1 gives one more part than it has
    fractions. ``shuffle=True`` shuffles first (``rng``). Lazy views, as MLUtils' ``splitobs``.

    >>> import numpy as np
    >>> [len(p) for p in splitobs(np.arange(10), at=(0.5, 0.3))]
    [5, 3, 2]
    """
    fractions = (at,) if isinstance(at, numbers.Real) else tuple(at)
    if not fractions or any(isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0 < f < 1
                            for f in fractions) or sum(fractions) >= 1 + 1e-12:
        raise ValueError(f"splitobs expects at, a fraction in (0, 1) or a tuple of them summing below 1, got {at!r}")
    n = numobs(data)
    order = as_rng(rng, "splitobs").permutation(n) if shuffle else np.arange(n)
    cuts = [0]
    for f in fractions:
        cuts.append(cuts[-1] + round(f * n))
    cuts.append(n)
    return tuple(ObsView(data, order[a:b]) for a, b in zip(cuts[:-1], cuts[1:]))


def kfolds(data: Any, k: int = 5) -> list[tuple[ObsView, ObsView]]:
    """``k`` pairs ``(train, validation)`` of lazy views: fold ``i`` validates on the ``i``-th of ``k`` consecutive
    parts (sizes differing by one at most) and trains on the rest (MLUtils' ``kfolds``).

    >>> import numpy as np
    >>> [(len(t), len(v)) for t, v in kfolds(np.arange(10), k=3)]
    [(6, 4), (7, 3), (7, 3)]
    """
    n = numobs(data)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 2 <= k <= n:
        raise ValueError(f"kfolds expects k, an int in [2, {n}] (the number of observations), got {k!r}")
    bounds = _even_bounds(n, k)
    everything = np.arange(n)
    folds = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        folds.append((ObsView(data, np.concatenate([everything[:a], everything[b:]])), ObsView(data, everything[a:b])))
    return folds


def batch(observations: Any) -> Any:
    """One batch from a sequence of observations (arrays of one shape, or tuples/dicts of them): stacked along a new
    first axis, in the observations' structure (MLUtils' ``batch``).

    >>> import numpy as np
    >>> batch([(np.ones(2), 1), (np.zeros(2), 2)])
    (array([[1., 1.],
           [0., 0.]]), array([1, 2]))
    """
    items = list(observations)
    if not items:
        raise ValueError("batch expects at least one observation, got none")
    first = items[0]
    if isinstance(first, tuple):
        return tuple(batch([it[i] for it in items]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: batch([it[k] for it in items]) for k in first}
    xp = get_array_module(first) if is_array(first) else np
    try:
        return xp.stack([xp.asarray(it) for it in items])
    except ValueError as err:
        shapes = sorted({tuple(np.shape(it)) for it in items})
        raise ValueError(f"batch expects observations of one shape, got shapes {shapes}") from err


def unbatch(data: Any) -> list:
    """The observations of ``data`` as a list (MLUtils' ``unbatch``; the inverse of :func:`batch`).

    >>> import numpy as np
    >>> unbatch(np.arange(4).reshape(2, 2))
    [array([0, 1]), array([2, 3])]
    """
    return [getobs(data, i) for i in range(numobs(data))]


def chunk(data: Any, n: int | None = None, *, size: int | None = None) -> list:
    """``data`` in ``n`` consecutive chunks of sizes differing by one at most, or in chunks of ``size`` (the last one
    shorter): lazy views (MLUtils' ``chunk``).

    >>> import numpy as np
    >>> [len(c) for c in chunk(np.arange(7), 3)], [len(c) for c in chunk(np.arange(7), size=3)]
    ([3, 2, 2], [3, 3, 1])
    """
    total = numobs(data)
    if (n is None) == (size is None):
        raise ValueError("chunk expects either n (how many chunks) or size (how large each is), not both or neither")
    given = n if n is not None else size
    if isinstance(given, bool) or not isinstance(given, numbers.Integral) or given < 1:
        raise ValueError(f"chunk expects {'n' if n is not None else 'size'} to be an int >= 1, got {given!r}")
    bounds = list(range(0, total, size)) + [total] if size is not None else _even_bounds(total, n)
    order = np.arange(total)
    return [ObsView(data, order[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a or total == 0]


def _even_bounds(total, parts):
    """The bounds of ``parts`` consecutive pieces of ``total`` items, the first ones one longer where they differ."""
    base, extra = divmod(total, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class MappedObs:
    """``f`` applied to each observation of ``data`` when it is asked for (:func:`mapobs`)."""

    def __init__(self, f: Callable, data: Any) -> None:
        self.f, self.data = f, data

    def __len__(self) -> int:
        return numobs(self.data)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, numbers.Integral) and not isinstance(index, bool):
            return self.f(getobs(self.data, index))
        return [self.f(getobs(self.data, int(i))) for i in np.arange(len(self))[index]]

    def __repr__(self) -> str:
        return f"MappedObs({getattr(self.f, '__name__', 'f')}, {len(self)} observations)"


def mapobs(f: Callable, data: Any) -> MappedObs:
    """A lazy dataset whose observation ``i`` is ``f(getobs(data, i))`` (MLUtils' ``mapobs``): augmentation or
    decoding applied when an observation is read.

    >>> import numpy as np
    >>> m = mapobs(lambda x: 2 * x, np.arange(3))
    >>> len(m), m[2], batch(m[0:2])
    (3, np.int64(4), array([0, 2]))
    """
    if not callable(f):
        raise TypeError(f"mapobs expects a function f first, then the data, got {type(f).__name__}")
    numobs(data)   # a clear error now for data that has no observations
    return MappedObs(f, data)
