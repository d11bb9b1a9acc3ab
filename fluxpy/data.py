"""Data: mini-batches (:class:`DataLoader`) and one-hot labels (:func:`onehotbatch`, :func:`onecold`), MLUtils' verbs.

Data sets (MNIST, CIFAR-10) and augmentation are applications built on these, in :mod:`fluxpy.datasets`.

The observation axis is the FIRST axis everywhere (``(N, C, H, W)`` images, ``(N,)`` labels,
``(N, classes)`` one-hot targets), as in the rest of fluxpy.

>>> import numpy as np
>>> x, y = np.arange(10.0).reshape(5, 2), np.arange(5)
>>> [xb.shape for xb, yb in DataLoader((x, y), batchsize=2)]
[(2, 2), (2, 2), (1, 2)]
>>> onehotbatch([1, 0], range(3))
array([[0., 1., 0.],
       [1., 0., 0.]], dtype=float32)
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .autodiff import value_of
from .backend import Array, get_array_module, host_to_device, is_array
from .functors import cpu, gpu
from .random import as_rng

__all__ = ["DataLoader", "onehotbatch", "onecold", "describe", "short"]


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


# ---------------------------------------------------------------------------------------------
# DataLoader


def _device_mover(device):
    if device is None:
        return None
    if callable(device):
        return device
    if isinstance(device, str) and device == "gpu":
        return gpu
    if isinstance(device, str) and device == "cpu":
        return cpu
    raise ValueError(f"DataLoader expects device to be None, \"cpu\", \"gpu\" or a function, got {describe(device)}")


def _as_source(x, where):
    """One data source as an array: arrays as they are, lists and ranges converted with ``numpy.asarray``."""
    if hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.generic):
        array = x
    elif isinstance(x, (list, range)):
        if isinstance(x, list) and any(len(getattr(e, "shape", ())) >= 1 for e in x):
            raise TypeError(f"DataLoader: {where} is a list of arrays, which is ambiguous: pass a tuple (x, y) for "
                            "several arrays sliced alike, or numpy.stack(...) for one array of observations; "
                            f"got {describe(x)}")
        try:
            array = np.asarray(x)
        except (ValueError, TypeError) as err:
            raise ValueError(f"DataLoader: cannot convert {where} ({describe(x)}) to an array: "
                             f"{short(err, 200)}") from None
        if array.dtype == object:
            raise ValueError(f"DataLoader: {where} ({describe(x)}) converts only to an array of Python objects "
                             "(mixed types?); pass numbers or strings of one kind")
    else:
        raise TypeError("DataLoader expects an array, a list, or a tuple of them (observations on the first axis), "
                        f"got {describe(x)} as {where}")
    if len(array.shape) < 1:
        raise ValueError(f"DataLoader expects {where} to have an observation axis, got a 0-d {describe(array)}")
    return array


class DataLoader:
    """Mini-batches of ``data``, one per step of iteration.

    ``data`` is an array, or a tuple of arrays whose FIRST axis indexes observations (all of the
    same length). A Python list (or range) is converted to one array with ``numpy.asarray``, as
    is each list inside the tuple: ``DataLoader(([1, 2, 3], [0, 1, 0]))`` batches two int arrays.
    A list of arrays is ambiguous (several sources, or rows?) and an error: pass a tuple for
    several arrays, ``numpy.stack`` for one. Iterating gives one batch per step: an array, or a
    tuple of arrays sliced alike.

    ``shuffle=True`` draws a new order every epoch from ``rng``: a ``numpy.random.Generator``,
    an int seed, or ``None`` for fluxpy's global generator (reset by :func:`fluxpy.seed`).
    ``partial=False`` drops a last, smaller batch. ``device="gpu"`` moves each batch to the GPU
    (``"cpu"`` with :func:`fluxpy.cpu`; any function works, applied to each array of a batch).
    ``len(loader)`` is the number of batches. Empty data, arrays of different lengths, a
    ``batchsize`` that is not an int >= 1 and a non-bool ``shuffle``, ``partial`` or ``prefetch``
    are errors.

    With ``device="gpu"``, a usable GPU and NumPy arrays of numbers, iteration prefetches
    (``prefetch=True``, the default): before batch i is handed out, batch i+1 is gathered into
    a pinned host buffer and its copy enqueued on a side CUDA stream, so that it overlaps the
    caller's step i (:class:`fluxpy.backend.HostToDevice`). Each batch is its own set of device
    arrays, ready for the CUDA stream current when it is handed out (that stream waits for the
    copy; the host does not); no later batch overwrites it. Batch i+1 is read from ``data``
    before batch i is handed out, so a change to ``data`` during iteration shows one batch later.
    ``prefetch=False``, other data (strings, arrays already on the GPU) and no GPU move each batch
    with :func:`fluxpy.gpu` when it is handed out.

    >>> import numpy as np
    >>> x = np.arange(5)
    >>> loader = DataLoader(x, batchsize=2, partial=False)
    >>> len(loader), [b.tolist() for b in loader]
    (2, [[0, 1], [2, 3]])
    >>> sorted(np.concatenate(list(DataLoader(x, batchsize=2, shuffle=True, rng=0))).tolist())
    [0, 1, 2, 3, 4]
    >>> [(x.tolist(), y.tolist()) for x, y in DataLoader(([1, 2, 3], ["a", "b", "c"]), batchsize=2)]
    [([1, 2], ['a', 'b']), ([3], ['c'])]
    >>> DataLoader(x, device="gpu").prefetch, DataLoader(x, device="gpu", prefetch=False).prefetch
    (True, False)

    ``shard=(rank, world_size)`` gives this process its part of each epoch in data-parallel training, as
    PyTorch's ``DistributedSampler`` does: the epoch's order (a permutation when shuffling, else ``0..N-1``)
    is split by observation, rank ``r`` taking positions ``r, r + world_size, r + 2 * world_size, ...``, and is
    then batched. So that every rank has the same number of observations, hence of batches (no rank waits for a
    step the others never take): with ``partial=True`` the order is padded by repeating its first
    ``ceil(N / world_size) * world_size - N`` entries (every observation is seen, a few twice: torch's
    ``drop_last=False``); with ``partial=False`` its last ``N % world_size`` entries are dropped (torch's
    ``drop_last=True``; shuffled, a different few each epoch), as is each rank's short last batch. The ranks'
    parts are disjoint (except for the padding) only when every rank draws the same permutation: give every
    rank the same ``rng`` seed (or call :func:`fluxpy.seed` with the same seed on every rank for ``rng=None``).
    ``shard`` must be two ints with ``0 <= rank < world_size``; ``fluxpy.distributed.read_env().shard`` is this
    process's.

    >>> [b.tolist() for b in DataLoader(np.arange(7), batchsize=2, shard=(1, 3))]
    [[1, 4], [0]]
    >>> [b.tolist() for b in DataLoader(np.arange(7), batchsize=2, partial=False, shard=(1, 3))]
    [[1, 4]]
    """

    def __init__(self, data: Array | Sequence, batchsize: int = 1, shuffle: bool = False, partial: bool = True,
                 rng: np.random.Generator | int | None = None, device: str | Callable | None = None,
                 prefetch: bool = True, shard: tuple[int, int] | None = None) -> None:
        self.is_tuple = isinstance(data, tuple)
        if self.is_tuple:
            if not data:
                raise ValueError("DataLoader expects at least one array, got an empty tuple")
            arrays = [_as_source(a, f"data[{i}]") for i, a in enumerate(data)]
        else:
            arrays = [_as_source(data, "data")]
        self.nobs = int(arrays[0].shape[0])
        if any(int(a.shape[0]) != self.nobs for a in arrays):
            raise ValueError("DataLoader expects every array to have the same number of observations on axis 0, "
                             f"got shapes {short([tuple(a.shape) for a in arrays], 300)}")
        if self.nobs == 0:
            raise ValueError(f"DataLoader expects at least one observation, got {describe(arrays[0])}")
        if isinstance(batchsize, bool) or not isinstance(batchsize, (int, np.integer)):
            raise TypeError(f"DataLoader expects batchsize to be an int >= 1, got {describe(batchsize)}")
        if batchsize < 1:
            raise ValueError(f"DataLoader expects batchsize to be an int >= 1, got {int(batchsize)}")
        for name, flag in (("shuffle", shuffle), ("partial", partial), ("prefetch", prefetch)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"DataLoader expects {name} to be True or False, got {describe(flag)}")
        self.shard = _check_shard(shard, self.nobs, bool(partial))
        self.rng = as_rng(rng, "DataLoader")
        self._move = _device_mover(device)
        self.data = tuple(arrays) if self.is_tuple else arrays[0]
        self.arrays = arrays
        self.batchsize = int(batchsize)
        self.shuffle = bool(shuffle)
        self.partial = bool(partial)
        self.prefetch = bool(prefetch)
        self.device = device

    def __len__(self):
        n = self._count() / self.batchsize
        return math.ceil(n) if self.partial else math.floor(n)

    def _count(self):
        """The number of observations one epoch hands out (this rank's share when sharded)."""
        if self.shard is None:
            return self.nobs
        world = self.shard[1]
        return -(-self.nobs // world) if self.partial else self.nobs // world

    def __iter__(self):
        order = self.rng.permutation(self.nobs) if self.shuffle else None
        if self.shard is not None:
            order = self._shard_order(order)
        indices = (self._index(order, i) for i in range(len(self)))
        copier = self._prefetcher()
        if copier is None:
            for index in indices:
                yield self._batch(index)
        else:
            yield from _prefetched(copier, indices, self._pack)

    def _shard_order(self, order):
        """This rank's positions of the epoch's ``order``: padded or cut to a multiple of world_size, then strided."""
        rank, world = self.shard
        order = np.arange(self.nobs) if order is None else order
        return np.resize(order, self._count() * world)[rank::world]

    def _index(self, order, i):
        start, stop = i * self.batchsize, min((i + 1) * self.batchsize, self._count())
        return slice(start, stop) if order is None else order[start:stop]

    def _prefetcher(self):
        """A host-to-device copier for one iteration (``device="gpu"`` with ``prefetch``); ``None`` where none applies.

        Each iteration has its own (pinned buffers come from CuPy's pool), so that iterations at once, in one
        thread or several, share nothing.
        """
        if not (self.prefetch and isinstance(self.device, str) and self.device == "gpu"):
            return None
        return host_to_device(self.arrays, self.batchsize)

    def _batch(self, index):
        parts = [a[index] for a in self.arrays]
        if self._move is not None:
            parts = [self._move(p) for p in parts]
        return self._pack(parts)

    def _pack(self, parts):
        return tuple(parts) if self.is_tuple else parts[0]

    def __repr__(self):
        shapes = ", ".join(str(tuple(a.shape)) for a in self.arrays)
        shard = "" if self.shard is None else f", shard={self.shard}"
        return (f"DataLoader({'(' + shapes + ')' if self.is_tuple else shapes}, batchsize={self.batchsize}, "
                f"shuffle={self.shuffle}, partial={self.partial}{shard}): {len(self)} batches")


def _check_shard(shard, nobs, partial):
    """``shard`` as ``(rank, world_size)`` ints, or ``None``; a clear error for anything else."""
    if shard is None:
        return None
    if not isinstance(shard, (tuple, list)) or len(shard) != 2 or \
            any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in shard):
        raise TypeError(f"DataLoader expects shard to be (rank, world_size), two ints, got {describe(shard)}"
                        + (f" {short(repr(tuple(shard)), 60)}" if isinstance(shard, (tuple, list)) else ""))
    rank, world = int(shard[0]), int(shard[1])
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"DataLoader expects shard=(rank, world_size) with world_size >= 1 and "
                         f"0 <= rank < world_size, got ({rank}, {world})")
    if not partial and nobs < world:
        raise ValueError(f"DataLoader with shard=({rank}, {world}) and partial=False drops the last N % world_size "
                         f"observations, leaving none of the {nobs}: pass partial=True (pads by repetition) or "
                         "more data")
    return (rank, world)


def _prefetched(copier, indices, pack):
    """The batches of ``indices``, each staged on ``copier`` one batch ahead of its hand-out.

    ``copier.stage(index)`` starts moving a batch (and returns at once), ``copier.ready(staged)``
    finishes it into a list of arrays, one per source. Batch i+1 is staged before batch i is handed
    out, so its copy runs while the caller works on batch i. A batch staged but never handed out
    (the caller stopped early) is still finished, so that no copy into memory outlives its batch.
    """
    pending = None   # staged, not yet handed out
    try:
        for index in indices:
            previous, pending = pending, copier.stage(index)
            if previous is not None:
                yield pack(copier.ready(previous))
        if pending is not None:
            last, pending = pending, None
            yield pack(copier.ready(last))
    finally:
        if pending is not None:
            copier.ready(pending)


# ---------------------------------------------------------------------------------------------
# One-hot labels


def onehotbatch(labels: Array | Sequence, classes: Sequence | int) -> Array:
    """The one-hot encoding of ``labels``: a ``(batch, nclasses)`` float32 array, one 1 per row.

    ``classes`` is the sequence of possible labels (``range(10)``, ``"abc"``, a list or array of
    distinct values; not a set, whose order is arbitrary) or an int ``n`` for ``range(n)``;
    column ``j`` stands for ``classes[j]``. A label not in ``classes`` is an error. CuPy labels
    give a CuPy array.

    >>> onehotbatch(["b", "a"], "abc")
    array([[0., 1., 0.],
           [1., 0., 0.]], dtype=float32)
    >>> onehotbatch([3], range(3))
    Traceback (most recent call last):
    ...
    ValueError: onehotbatch: label 3 is not one of the classes range(0, 3)
    """
    xp = get_array_module(labels)
    try:
        labels_np = np.asarray(cpu(value_of(labels)) if is_array(labels) else labels)
    except (ValueError, TypeError) as err:
        raise ValueError(f"onehotbatch cannot convert the labels ({describe(labels)}) to an array: "
                         f"{short(err, 200)}") from None
    if labels_np.ndim != 1:
        raise ValueError(f"onehotbatch expects a 1-d sequence of labels, got {describe(labels_np)}")
    classes = _check_classes(classes, "onehotbatch")
    columns = _class_columns(labels_np, classes)
    out = np.zeros((len(labels_np), len(classes)), dtype=np.float32)
    out[np.arange(len(labels_np)), columns] = 1
    return xp.asarray(out)


def _check_classes(classes, who):
    """``classes`` as a sized, ordered sequence (an int ``n`` as ``range(n)``); a clear error for anything else."""
    if isinstance(classes, (int, np.integer)) and not isinstance(classes, bool):
        if classes < 1:
            raise ValueError(f"{who} expects classes to be an int >= 1 or a sequence of labels, got {int(classes)}")
        return range(int(classes))
    if isinstance(classes, (set, frozenset, dict)) or not hasattr(classes, "__len__") or \
            not hasattr(classes, "__getitem__"):
        raise TypeError(f"{who} expects classes to be an int or an ordered sequence of labels (list, tuple, range, "
                        f"str, array), got {describe(classes)}")
    if len(classes) == 0:
        raise ValueError(f"{who} expects at least one class, got an empty {type(classes).__name__}")
    return classes


def _class_columns(labels, classes):
    """The column of each label: its position in ``classes``."""
    if isinstance(classes, range) and classes.step == 1 and labels.dtype.kind in "iu":
        columns = labels.astype(np.int64) - classes.start
        bad = (columns < 0) | (columns >= len(classes))
    else:
        keys = np.asarray(list(classes))
        if len(np.unique(keys)) != len(keys):
            raise ValueError(f"onehotbatch expects distinct classes, got repeats in {_show(classes)}")
        try:
            order = np.argsort(keys, kind="stable")
            pos = np.clip(np.searchsorted(keys[order], labels), 0, len(keys) - 1)
        except (TypeError, ValueError):  # numpy's DTypePromotionError is a TypeError
            raise ValueError(f"onehotbatch: labels of dtype {labels.dtype} cannot be compared with the classes "
                             f"{_show(classes)} (dtype {keys.dtype})") from None
        columns = order[pos]
        bad = keys[columns] != labels
    if np.any(bad):
        raise ValueError(f"onehotbatch: label {short(repr(labels[np.argmax(bad)].item()), 60)} is not one of the "
                         f"classes {_show(classes)}")
    return columns


def _show(classes):
    if isinstance(classes, (range, str)):
        return short(repr(classes), 200)
    shown = [getattr(c, "item", lambda: c)() for c in list(classes)[:20]]  # noqa: B023  (called at once)
    more = f" and {len(classes) - 20} more" if len(classes) > 20 else ""
    return short(repr(shown), 200) + more


def onecold(y: Array, classes: Sequence | None = None) -> Any:
    """The index of the largest entry along the last axis, or ``classes[index]`` when ``classes`` is given.

    The inverse of :func:`onehotbatch`, and the predicted class of a row of scores. Works on
    NumPy and CuPy arrays and on Tracked values (no gradient). ``classes`` must have one label
    per entry of that axis (``len(classes) == y.shape[-1]``); a mismatch is an error.

    >>> import numpy as np
    >>> onecold(np.array([[0.1, 0.7, 0.2], [0.9, 0.0, 0.1]]))
    array([1, 0])
    >>> onecold(np.array([0.1, 0.7, 0.2]), "abc")
    'b'
    >>> onecold(np.array([0.1, 0.7, 0.2]), "ab")
    Traceback (most recent call last):
    ...
    ValueError: onecold expects len(classes) == y.shape[-1] == 3, got 2 classes for y of shape (3,) float64
    """
    v = value_of(y)
    xp = get_array_module(v)
    if not hasattr(v, "shape"):
        v = np.asarray(v)
    if len(v.shape) < 1 or v.shape[-1] == 0:
        raise ValueError(f"onecold expects scores with a non-empty last axis, got {describe(v)}")
    if classes is not None:
        classes = _check_classes(classes, "onecold")
        if len(classes) != v.shape[-1]:
            raise ValueError(f"onecold expects len(classes) == y.shape[-1] == {v.shape[-1]}, got {len(classes)} "
                             f"classes for y of shape {tuple(v.shape)} {v.dtype}")
    index = xp.argmax(v, axis=-1)
    if classes is None:
        return index
    lookup = np.asarray(list(classes))
    picked = lookup[np.asarray(cpu(index))]
    return picked.item() if picked.ndim == 0 else picked

