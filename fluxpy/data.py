"""Data: mini-batches (:class:`DataLoader`) and one-hot labels (:func:`onehotbatch`, :func:`onecold`), MLUtils' verbs.

Data sets (MNIST, CIFAR-10) and augmentation are applications built on these, in :mod:`fluxpy.datasets`.

The observation axis is the FIRST axis everywhere (``(N, C, H, W)`` images, ``(N,)`` labels,
``(N, classes)`` one-hot targets), as in the rest of fluxpy. ``DataLoader`` also takes observations one by one (a
list of ``(x, y)`` pairs, any dataset with ``__len__`` and ``__getitem__``, read with :mod:`fluxpy.observations`'
``getobs``) and stacks each batch, in worker threads if asked; :mod:`fluxpy.sequences` pads sequences of different
lengths.

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
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .autodiff import value_of
from .backend import Array, get_array_module, host_to_device, is_array
from .functors import cpu, gpu
from .observations import batch, describe, getobs, numobs, short
from .random import as_rng

__all__ = ["DataLoader", "onehot", "onehotbatch", "onecold", "describe", "short"]


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


_EXPECTED = ("DataLoader expects an array, a list, or a tuple of them (or a dict; observations on the first axis), or "
             "a dataset (an object with __len__ and __getitem__)")


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
        raise TypeError(f"{_EXPECTED}, got {describe(x)} as {where}")
    if len(array.shape) < 1:
        raise ValueError(f"DataLoader expects {where} to have an observation axis, got a 0-d {describe(array)}")
    return array


def _is_observations(data):
    """Data given as observations, each fetched alone and then collated: a list of arrays, tuples or dicts (PyTorch's
    list dataset, MLUtils' vector of observations), or a dataset object (``__len__`` and ``__getitem__``)."""
    if isinstance(data, list):
        return any(len(getattr(e, "shape", ())) >= 1 or isinstance(e, (tuple, dict)) for e in data)
    return (hasattr(data, "__len__") and hasattr(data, "__getitem__") and not hasattr(data, "shape")
            and not isinstance(data, (str, bytes, tuple, dict, range)))


def _sources(data):
    """``(kind, arrays)``: ``"array"``, ``"tuple"`` or ``"dict"`` with the array sources a batch slices alike, or
    ``"observations"`` with None."""
    if isinstance(data, (tuple, dict)):
        kind = type(data).__name__
        if not data:
            raise ValueError(f"DataLoader expects at least one array, got an empty {kind}")
        named = data.items() if isinstance(data, dict) else enumerate(data)
        return kind, [_as_source(a, f"data[{k!r}]") for k, a in named]
    if _is_observations(data):
        return "observations", None
    return "array", [_as_source(data, "data")]


def _check_collate(collate):
    if isinstance(collate, (bool, np.bool_)):
        return bool(collate)
    if callable(collate):
        return collate
    raise TypeError(f"DataLoader expects collate to be True, False or a function of a list of observations, got "
                    f"{describe(collate)}")


def _worker_count(parallel, workers):
    """The number of loading threads: ``workers``, or one per CPU core (:func:`_cores`) for ``parallel=True``; 0
    loads in the caller's thread."""
    if not isinstance(parallel, (bool, np.bool_)):
        raise TypeError(f"DataLoader expects parallel to be True or False, got {describe(parallel)}")
    if workers is None:
        return _cores() if parallel else 0
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 0:
        raise ValueError(f"DataLoader expects workers to be an int >= 0 or None, got {describe(workers)}")
    if parallel and workers == 0:
        raise ValueError("DataLoader got parallel=True and workers=0: give workers >= 1 threads, or leave it None "
                         "for one per CPU core")
    return int(workers)


def _cores():
    """The CPU cores this process may run on (a container's or ``taskset``'s share, where the system says)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _partial_option(partial, drop_last):
    """``partial``, or ``not drop_last`` (PyTorch's name for the same choice); both given must agree."""
    if drop_last is None:
        return True if partial is _UNSET else partial
    if not isinstance(drop_last, (bool, np.bool_)):
        raise TypeError(f"DataLoader expects drop_last to be True or False, got {describe(drop_last)}")
    if partial is not _UNSET and bool(partial) == bool(drop_last):
        raise ValueError(f"DataLoader got partial={partial} and drop_last={drop_last}, which disagree: "
                         "give one of them (drop_last=True is partial=False)")
    return not drop_last


class _Unset:
    """The default of ``partial``: not given (so that ``drop_last`` may say it)."""

    def __repr__(self):
        return "True"


_UNSET = _Unset()


class DataLoader:
    """Mini-batches of ``data``, one per step of iteration (Flux's and MLUtils' ``DataLoader``, PyTorch's).

    ``data`` is one of:

    - an array, or a tuple or dict of arrays whose FIRST axis indexes observations (all of the same length): a
      batch is the same rows of each, as an array, a tuple or a dict. A Python list (or range) of numbers is
      converted to one array with ``numpy.asarray``, as is each list inside the tuple: ``DataLoader(([1, 2, 3],
      [0, 1, 0]))`` batches two int arrays. Inside a tuple or dict, a list of arrays is ambiguous and an error.
    - observations: a list of arrays, tuples or dicts (a list of ``(x, y)`` pairs), or a dataset, any object with
      ``__len__`` and ``__getitem__`` (PyTorch's map-style ``Dataset``; :func:`fluxpy.mapobs`, :func:`fluxpy.obsview`
      and :func:`fluxpy.splitobs` views). The observations of a batch are read with :func:`fluxpy.getobs` (one
      protocol for both kinds; a view of arrays gives its rows at once) and collated: stacked along a new first
      axis in their structure by :func:`fluxpy.batch` (PyTorch's ``default_collate``), so a list of ``(x, y)`` pairs
      gives ``(xs, ys)`` batches.

    ``collate`` (MLUtils' keyword; PyTorch's ``collate_fn``): ``True`` (the default) as above; ``False`` gives each
    batch as the list of its observations; a function is called with that list and its result is the batch (for
    sequences of different lengths, one that pads them: :func:`fluxpy.pad_sequence`). Observations that do not
    stack (different shapes or structures, ``None``) are a ``ValueError`` naming the observations and what differs.

    ``shuffle=True`` draws a new order every epoch from ``rng``: a ``numpy.random.Generator``,
    an int seed, or ``None`` for fluxpy's global generator (reset by :func:`fluxpy.seed`).
    ``partial=False`` (PyTorch's ``drop_last=True``, also accepted) drops a last, smaller batch. ``device="gpu"``
    moves each batch to the GPU (``"cpu"`` with :func:`fluxpy.cpu`; any function works, applied to each array of a
    batch). ``len(loader)`` is the number of batches. Empty data, arrays of different lengths, a
    ``batchsize`` that is not an int >= 1 and a non-bool ``shuffle``, ``partial`` or ``prefetch``
    are errors.

    ``workers=N`` loads batches in ``N`` threads (``parallel=True``, MLUtils' keyword: one per CPU core this process
    may use); the default,
    ``workers=None`` with ``parallel=False``, loads each batch in the caller's thread when it is asked for. The
    batches are the same, in the same order, as without threads (each thread loads whole batches; they are handed
    out in order, an error at the batch where it happened), and at most ``2 * N`` batches are loaded ahead. Threads
    help where loading releases the GIL: NumPy work on large arrays, file reads, image decoding; a dataset's
    ``__getitem__`` is then called from several threads at once, so it must be thread-safe, and random draws in it
    come in a thread-dependent order (draw from a generator seeded by the observation's index to repeat them). There
    are no worker processes: each batch would be pickled across, a dataset and a collate function would have to be
    importable by name (``spawn``, the default start method on macOS and from Python 3.14) or forked from a process
    holding threads and a CUDA context (unsafe), and a worker that dies would need a watchdog; a Python-heavy dataset
    is better prepared once, ahead of training, into arrays. Device moves (``device=``) stay in the caller's thread,
    on its CUDA stream.

    With ``device="gpu"``, a usable GPU and NumPy arrays of numbers (the first kind of ``data``, ``collate=True``),
    iteration prefetches (``prefetch=True``, the default): before batch i is handed out, batch i+1 is gathered into
    a pinned host buffer and its copy enqueued on a side CUDA stream, so that it overlaps the
    caller's step i (:class:`fluxpy.backend.HostToDevice`; the gather is one NumPy call per array, so ``workers``
    are not used). Each batch is its own set of device
    arrays, ready for the CUDA stream current when it is handed out (that stream waits for the
    copy; the host does not); no later batch overwrites it. Batch i+1 is read from ``data``
    before batch i is handed out, so a change to ``data`` during iteration shows one batch later.
    ``prefetch=False``, other data (observations, strings, arrays already on the GPU) and no GPU move each batch
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
    >>> pairs = [(np.full(2, i), i % 2) for i in range(5)]          # a list of (x, y) observations
    >>> [(xb.shape, yb.tolist()) for xb, yb in DataLoader(pairs, batchsize=2, workers=2)]
    [((2, 2), [0, 1]), ((2, 2), [0, 1]), ((1, 2), [0])]
    >>> [len(b) for b in DataLoader(pairs, batchsize=3, collate=False)]
    [3, 2]
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

    def __init__(self, data: Any, batchsize: int = 1, shuffle: bool = False, partial: bool = _UNSET,
                 rng: np.random.Generator | int | None = None, device: str | Callable | None = None,
                 prefetch: bool = True, shard: tuple[int, int] | None = None, *, drop_last: bool | None = None,
                 collate: bool | Callable = True, parallel: bool = False, workers: int | None = None) -> None:
        self._kind, arrays = _sources(data)
        self.is_tuple = self._kind == "tuple"
        self._dict_keys = list(data) if self._kind == "dict" else None
        self.nobs = self._count_observations(data, arrays)
        if isinstance(batchsize, bool) or not isinstance(batchsize, (int, np.integer)):
            raise TypeError(f"DataLoader expects batchsize to be an int >= 1, got {describe(batchsize)}")
        if batchsize < 1:
            raise ValueError(f"DataLoader expects batchsize to be an int >= 1, got {int(batchsize)}")
        partial = _partial_option(partial, drop_last)
        for name, flag in (("shuffle", shuffle), ("partial", partial), ("prefetch", prefetch)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"DataLoader expects {name} to be True or False, got {describe(flag)}")
        self.collate = _check_collate(collate)
        self.workers = _worker_count(parallel, workers)
        self.shard = _check_shard(shard, self.nobs, bool(partial))
        self.rng = as_rng(rng, "DataLoader")
        self._move = _device_mover(device)
        self.data = data if arrays is None else self._pack(arrays)
        self.arrays = arrays
        self.batchsize = int(batchsize)
        self.shuffle = bool(shuffle)
        self.partial = bool(partial)
        self.prefetch = bool(prefetch)
        self.device = device

    def _count_observations(self, data, arrays):
        if arrays is None:
            n = len(data) if isinstance(data, list) else numobs(data)
        else:
            n = int(arrays[0].shape[0])
            if any(int(a.shape[0]) != n for a in arrays):
                raise ValueError("DataLoader expects every array to have the same number of observations on axis 0, "
                                 f"got shapes {short([tuple(a.shape) for a in arrays], 300)}")
        if n == 0:
            shown = describe(arrays[0] if arrays else data)
            raise ValueError(f"DataLoader expects at least one observation, got {shown}")
        return n

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
        if copier is not None:
            yield from _prefetched(copier, indices, self._pack)
            return
        loaded = _threaded(self._load, indices, self.workers) if self.workers else map(self._load, indices)
        for batch_ in loaded:
            yield batch_ if self._move is None else _map_arrays(self._move, batch_)

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
        if self.arrays is None or self.collate is not True:
            return None
        return host_to_device(self.arrays, self.batchsize)

    def _load(self, index):
        """Batch ``index`` (a slice or an array of positions) on the host, collated; run by the worker threads."""
        if self.collate is True and self.arrays is not None:   # arrays: the same rows of each, no stacking
            return self._pack([a[index] for a in self.arrays])
        if self.collate is True and not isinstance(self.data, list):   # a dataset: getobs, which views batch
            got = getobs(self.data, index)   # a list of observations, or a view's rows already batched
            return _collated(got, index, self.nobs) if isinstance(got, list) else got
        items = [self.data[i] if isinstance(self.data, list) else getobs(self.data, i)
                 for i in _positions(index, self.nobs)]
        if self.collate is True:
            return _collated(items, index, self.nobs)
        return items if self.collate is False else self.collate(items)

    def _pack(self, parts):
        if self._kind == "tuple":
            return tuple(parts)
        if self._kind == "dict":
            return dict(zip(self._dict_keys, parts))
        return parts[0]

    def __repr__(self):
        if self.arrays is None:
            what = describe(self.data) + ("" if isinstance(self.data, list) else f" of {self.nobs} observations")
        else:
            shapes = ", ".join(str(tuple(a.shape)) for a in self.arrays)
            what = "(" + shapes + ")" if self.is_tuple else ("{" + shapes + "}" if self._kind == "dict" else shapes)
        extra = "" if self.shard is None else f", shard={self.shard}"
        extra += "" if self.collate is True else f", collate={getattr(self.collate, '__name__', self.collate)}"
        extra += "" if not self.workers else f", workers={self.workers}"
        return (f"DataLoader({what}, batchsize={self.batchsize}, shuffle={self.shuffle}, partial={self.partial}"
                f"{extra}): {len(self)} batches")


def _positions(index, n):
    """The observation positions of a batch's ``index`` (a slice or an array of them), as Python ints."""
    return range(*index.indices(n)) if isinstance(index, slice) else [int(i) for i in index]


def _map_arrays(f, batch_):
    """``f`` applied to every array in ``batch_`` (an array, or tuples, lists and dicts of them); the rest kept."""
    if is_array(batch_):
        return f(batch_)
    if isinstance(batch_, (tuple, list)):
        return type(batch_)(_map_arrays(f, b) for b in batch_)
    if isinstance(batch_, dict):
        return {k: _map_arrays(f, v) for k, v in batch_.items()}
    return batch_


def _collated(items, index, n):
    """:func:`fluxpy.batch` of ``items``, the observations at ``index``; a ValueError naming DataLoader, the
    observations and what differs where they do not stack."""
    try:
        out = batch(items)
        problem = _object_leaf(out)
    except (ValueError, TypeError, IndexError, KeyError) as err:
        problem = _mismatch(items, list(_positions(index, n))) or short(err, 200)
    if problem is None:
        return out
    raise ValueError(f"DataLoader cannot collate the observations {short(list(_positions(index, n)), 60)} into a "
                     f"batch: {problem}. Observations of different sizes need collate=f, a function of the list of "
                     "observations (one that pads sequences with fluxpy.pad_sequence); collate=False gives that list")


def _object_leaf(out):
    """What is wrong with a collated batch that holds Python objects (``None``, mixed types), or None."""
    if isinstance(out, (tuple, list)):
        return next((p for p in map(_object_leaf, out) if p), None)
    if isinstance(out, dict):
        return next((p for p in map(_object_leaf, out.values()) if p), None)
    if is_array(out) and out.dtype == np.dtype(object):
        kinds = sorted({type(v).__name__ for v in out.ravel()[:1000]})
        return f"observations of type {', '.join(kinds)} stack only into an array of Python objects"
    return None


def _mismatch(items, positions, path=""):
    """Where ``items`` differ in structure or shape: the first such observation against the first, or None."""
    first = items[0]
    for i, item in enumerate(items):
        if isinstance(first, (tuple, dict)) or isinstance(item, (tuple, dict)):
            same = type(item) is type(first) and len(item) == len(first) and (
                not isinstance(item, dict) or set(item) == set(first))
            if not same:
                return (f"observation {positions[i]}{path} is a {describe(item)}, observation {positions[0]}{path} a "
                        f"{describe(first)}")
    if isinstance(first, (tuple, dict)):
        keys = range(len(first)) if isinstance(first, tuple) else list(first)
        for k in keys:
            found = _mismatch([it[k] for it in items], positions, f"{path}[{k!r}]")
            if found:
                return found
        return None
    shapes = [_shape_of(it) for it in items]
    for i, s in enumerate(shapes):
        if s != shapes[0]:
            return (f"observation {positions[i]}{path} has shape {s}, observation {positions[0]}{path} has shape "
                    f"{shapes[0]}")
    return None


def _shape_of(x):
    if hasattr(x, "shape"):
        return tuple(x.shape)
    try:
        return np.shape(x)
    except ValueError:   # a ragged nest of lists
        return f"of a ragged {type(x).__name__}"


def _threaded(load, indices, workers):
    """``load(index)`` for each of ``indices`` in ``workers`` threads, handed out in the order of ``indices``.

    Each thread loads whole batches; at most ``2 * workers`` are loading or loaded ahead of the caller (PyTorch's
    ``prefetch_factor=2`` per worker). An error in a batch is raised when that batch's turn comes. When the caller
    stops early, the batches not yet started are cancelled and those loading are waited for, so that no thread
    outlives the iteration.
    """
    pool = ThreadPoolExecutor(workers, thread_name_prefix="DataLoader")
    pending: deque = deque()
    try:
        for index in indices:
            pending.append(pool.submit(load, index))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


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


def onehot(label: Any, classes: Sequence | int) -> Array:
    """The one-hot vector of one ``label``: a ``(nclasses,)`` float32 array (Flux's ``onehot``; ``classes`` as in
    :func:`onehotbatch`).

    >>> onehot("b", "abc")
    array([0., 1., 0.], dtype=float32)
    """
    if isinstance(label, (list, tuple)) or getattr(label, "ndim", 0) > 0:
        raise ValueError(f"onehot expects one label, got {describe(label)}; several: onehotbatch(labels, classes)")
    return onehotbatch([label], classes)[0]


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

