"""Data parallelism as PyTorch's ``DistributedDataParallel``: :class:`DataParallel` wraps a model; each rank runs
it on its own shard of the batch, and the gradients are averaged over the ranks while the backward pass runs.

How (the reducer):

- At construction every rank checks that the model has the same structure as rank 0's (a hash of every array's
  path, shape and dtype, all-gathered; a mismatch is a :class:`DistributedError` naming the ranks and the first
  array that differs), then rank 0's arrays (weights and buffers such as BatchNorm's running statistics) are
  broadcast to every rank so that all start equal.
- The trainable arrays are grouped into buckets (:func:`bucket_plan`, ``bucket_mb`` each, the first
  ``first_bucket_mb``), filled from the last array to the first: the order in which the backward pass finishes
  their gradients. Each bucket is one flat buffer per dtype, allocated once.
- Called inside :func:`fluxpy.gradient` (or ``withgradient``, :func:`fluxpy.train`, :class:`fluxpy.TrainStep`), the
  wrapper registers a gradient hook (:func:`fluxpy.autodiff.register_gradient_hook`) on each trainable array. When
  an array's gradient is final the hook copies it into its place in the bucket; when a bucket's last gradient is
  in, its in-place all-reduce (NCCL's ``avg``: each rank's part times ``1 / world_size``, summed) is queued on the
  communicator's side stream (buckets start in plan order on every rank, as NCCL requires), while the backward
  pass goes on. The gradient the call returns for the array is its view of the bucket. Once every bucket has
  started, the compute stream waits for their events (a stream wait, not a host wait), so the optimiser's kernels
  read averaged gradients.
- An array that gets no gradient on a rank (unused in this step) contributes zeros; every rank then receives the
  average for it, so all ranks apply the same update.

The bucket views are reused at every step: a gradient returned by one step is overwritten by the next.

>>> import numpy as np
>>> from fluxpy.layers import Dense
>>> model = DataParallel(Dense(3, 2, rng=0))     # a job of one process: the wrapper only forwards
>>> model(np.ones((4, 3), np.float32)).shape
(4, 2)
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np

from ..autodiff import in_gradient, is_tracked, register_gradient_hook, value_of
from ..journal import changing
from ..backend import get_array_module, gpu_device, is_array, is_float_dtype
from ..functors import trainable_keys, children, layer
from .buckets import bucket_plan
from .group import DistributedError, ProcessGroup, get_group

__all__ = ["DataParallel", "structure_digest"]

MIB = 1024 * 1024


def _walk(model, trainable_only):
    """``[(path, leaf)]``: the distinct float arrays (or Tracked values) of ``model`` in tree order."""
    out, seen = [], set()

    def walk(x, path):
        kids = children(x)
        if kids is None:
            v = value_of(x)
            if (is_tracked(x) or is_array(x)) and is_array(v) and is_float_dtype(v.dtype) and id(x) not in seen:
                seen.add(id(x))
                out.append((path, x))
            return
        allowed = trainable_keys(x) if trainable_only else None
        for k, v in kids:
            if allowed is None or k in allowed:
                walk(v, f"{path}.{k}" if path else str(k))
    walk(model, "")
    return out


def structure_digest(model: Any) -> tuple[bytes, list[str]]:
    """``(digest, lines)``: a 48-byte fingerprint of ``model``'s arrays (the SHA-256 of one line ``path shape
    dtype`` per array, then the number of arrays and of elements) and the lines themselves.

    >>> import numpy as np
    >>> d, lines = structure_digest({"w": np.ones((2, 3), np.float32)})
    >>> len(d), lines
    (48, ['w (2, 3) float32'])
    """
    lines, total = [], 0
    for path, leaf in _walk(model, trainable_only=False):
        v = value_of(leaf)
        lines.append(f"{path} {tuple(v.shape)} {v.dtype}")
        total += int(v.size)
    digest = hashlib.sha256("\n".join(lines).encode()).digest() + struct.pack(">qq", len(lines), total)
    return digest, lines


@layer(children=("module",))
class DataParallel:
    """``DataParallel(model, group=None, *, bucket_mb=25, first_bucket_mb=1, broadcast=True, broadcast_buffers=True,
    sync_batchnorm=False)``:
    ``model`` trained by every rank of ``group`` (the default group, :func:`init`) on its own data, with gradients
    averaged over the ranks during the backward pass (see the module's docstring for how).

    Use it where the model goes: ``train(loss, DataParallel(model), loader, setup(rule, dp))`` with a
    ``DataLoader(..., shard=group.env.shard)`` on each rank, the same seed everywhere. Calling it calls ``model``;
    its gradient is ``{"module": model's gradient}``. ``.module`` is the model (save that). ``bucket_mb`` and
    ``first_bucket_mb`` size the gradient buckets (PyTorch's ``bucket_cap_mb`` and its 1 MiB first bucket);
    ``broadcast=False`` skips copying rank 0's arrays at start (when every rank loaded the same checkpoint);
    ``broadcast_buffers=True`` (PyTorch's default too) copies rank 0's buffers (the arrays that are not trainable,
    such as BatchNorm's running statistics; contiguous ones, as they are at construction) to every rank before each
    training forward pass, in one launch, so that every rank evaluates and saves the same model;
    ``sync_batchnorm=True`` replaces each :class:`fluxpy.BatchNorm` with a :class:`SyncBatchNorm` whose batch
    statistics are all-reduced over the ranks (per rank otherwise, as PyTorch's default). The model must be on the
    rank's GPU (``fluxpy.gpu(model)`` after :func:`init`) before it is wrapped when ``world_size > 1``. In a group
    of one it only forwards.

    >>> import numpy as np, fluxpy
    >>> from fluxpy.layers import Dense
    >>> dp = DataParallel(Dense(2, 1, rng=0))
    >>> g, = fluxpy.gradient(lambda m: m(np.ones((3, 2), np.float32)).sum(), dp)
    >>> sorted(g), g["module"]["weight"].shape
    (['module'], (1, 2))
    """

    def __init__(self, module: Any, group: ProcessGroup | None = None, *, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, broadcast: bool = True, broadcast_buffers: bool = True,
                 sync_batchnorm: bool = False) -> None:
        for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"DataParallel: {name} must be a number > 0 (MiB), got {value!r}")
        group = get_group() if group is None else group
        if sync_batchnorm:
            from .sync_batchnorm import convert_sync_batchnorm
            module = convert_sync_batchnorm(module, group)
        self.module = module
        self._group = group
        self._bucket_mb, self._first_bucket_mb = float(bucket_mb), float(first_bucket_mb)
        self._reducer = None
        self._buffers: list = []
        if group.world_size > 1:
            _check_device(module, group)
            check_structure(module, group)
            if broadcast:
                broadcast_arrays(module, group)
            self._reducer = _Reducer(module, group, int(bucket_mb * MIB), int(first_bucket_mb * MIB))
            if broadcast_buffers:   # the same arrays at every step (BatchNorm updates them in place)
                self._buffers = [b for b in _buffers(module) if b.flags.c_contiguous]

    @property
    def group(self) -> ProcessGroup:
        """The process group the gradients are averaged over."""
        return self._group

    @property
    def buckets(self) -> list[tuple[int, ...]]:
        """The buckets, as tuples of indices into the trainable arrays in tree order, in launch order (empty in a
        group of one)."""
        return [] if self._reducer is None else [b.indices for b in self._reducer.plan]

    @property
    def loss_scaler(self) -> Any:
        """The wrapped model's dynamic loss scale (:class:`fluxpy.MixedPrecision` in float16), or None: what
        :func:`fluxpy.train` and :class:`fluxpy.TrainStep` look for. Every rank reads the same (averaged) gradients,
        so every rank skips an overflowing step alike."""
        return getattr(self.module, "loss_scaler", None)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        if self._reducer is not None and in_gradient():
            if self._buffers:
                self._group.broadcast_many(self._buffers, 0)
            self._reducer.attach(self.module)
        return self.module(*args, **kw)

    def __repr__(self) -> str:
        opts = "" if self._bucket_mb == 25.0 else f", bucket_mb={self._bucket_mb:g}"
        return f"DataParallel({self.module!r}{opts})"


def check_structure(model: Any, group: ProcessGroup) -> None:
    """Raise :class:`DistributedError` on every rank unless every rank's ``model`` has rank 0's structure (the same
    array paths, shapes and dtypes): an all-gather of :func:`structure_digest`; on a mismatch every rank's list is
    all-gathered too, so that every rank's message names the first array where the first differing rank departs
    from rank 0 (whichever rank exits first, the message is the whole story).

    >>> from fluxpy.distributed import init
    >>> check_structure({"w": np.ones(2)}, init())   # one rank: nothing to compare
    """
    if group.world_size == 1:
        return
    digest, lines = structure_digest(model)
    xp = _xp_of(model)
    gathered = _to_host(group.all_gather(xp.asarray(np.frombuffer(digest, np.uint8).copy())))
    digests = [bytes(row.tobytes()) for row in gathered]
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if not differ:
        return
    lists = _all_gather_lines(group, xp, lines)
    other = differ[0]
    first = _first_difference(lists[0], lists[other], other)
    ranks = ", ".join(str(r) for r in differ)
    raise DistributedError(f"DataParallel: the model's structure differs between ranks: rank(s) {ranks} differ from "
                           f"rank 0 ({len(lists[0])} arrays on rank 0, {len(lists[other])} on rank {other}); "
                           f"{first}; every rank must build the same model")


def _all_gather_lines(group, xp, lines):
    """Every rank's ``lines`` (a list of strings per rank), through two all-gathers: the lengths, then the texts
    padded to the longest."""
    text = "\n".join(lines).encode()
    sizes = _to_host(group.all_gather(xp.asarray(np.array([len(text)], np.int64)))).reshape(-1)
    longest = int(sizes.max())
    mine = xp.asarray(np.frombuffer(text.ljust(longest, b" "), np.uint8).copy())
    rows = _to_host(group.all_gather(mine))
    return [bytes(row[:int(n)].tobytes()).decode("utf-8", "replace").split("\n") for row, n in zip(rows, sizes)]


def _first_difference(theirs, mine, rank):
    """Where rank ``rank``'s list ``mine`` first departs from rank 0's list ``theirs``."""
    for i in range(max(len(theirs), len(mine))):
        a = theirs[i] if i < len(theirs) else "(nothing)"
        b = mine[i] if i < len(mine) else "(nothing)"
        if a != b:
            return f"array {i}: rank 0 has {a}, rank {rank} has {b}"
    return "the lists are equal but their digests differ"


def broadcast_arrays(model: Any, group: ProcessGroup, buffers_only: bool = False) -> None:
    """Copy rank 0's arrays of ``model`` (trainable and buffers; only the buffers, the arrays that are not
    trainable such as BatchNorm's running statistics, with ``buffers_only``) into every rank's, in place, in one
    launch.

    >>> from fluxpy.distributed import init
    >>> broadcast_arrays({"w": np.ones(2)}, init())
    """
    if group.world_size == 1:
        return
    arrays = _buffers(model) if buffers_only else [value_of(x) for _, x in _walk(model, trainable_only=False)]
    if not arrays:
        return
    staged = [x if x.flags.c_contiguous else get_array_module(x).ascontiguousarray(x) for x in arrays]
    with changing(*arrays):   # inside a training forward pass: the step's journal and the mutation check know
        group.broadcast_many(staged, 0)
        for x, tmp in zip(arrays, staged):
            if tmp is not x:   # a channels-last array went through a contiguous copy
                x[...] = tmp


def _check_device(model, group):
    """Every array of ``model`` on the group's GPU (NCCL), or a plain NumPy array (the tcp backend)."""
    for path, x in _walk(model, trainable_only=False):
        where = gpu_device(value_of(x))
        if where != group.device:
            here = "the CPU" if where is None else f"GPU {where}"
            want = "the CPU (the tcp backend moves NumPy arrays)" if group.device is None else \
                f"rank {group.rank}'s GPU {group.device} (fluxpy.gpu(model) after init())"
            raise DistributedError(f"DataParallel: {path} is on {here}; every array of the model must be on {want}")


def _buffers(model):
    """The float arrays of ``model`` that are not trainable (BatchNorm's running statistics), in tree order."""
    trainable = {id(value_of(x)) for _, x in _walk(model, trainable_only=True)}
    return [value_of(x) for _, x in _walk(model, trainable_only=False) if id(value_of(x)) not in trainable]


def _xp_of(model):
    leaves = _walk(model, trainable_only=False)
    return get_array_module(value_of(leaves[0][1])) if leaves else np


def _to_host(x):
    get = getattr(x, "get", None)
    return get() if callable(get) and not isinstance(x, np.ndarray) else np.asarray(x)


class _Bucket:
    __slots__ = ("indices", "nbytes", "flat", "views", "missing", "work")

    def __init__(self, indices, nbytes):
        self.indices, self.nbytes = indices, nbytes
        self.flat, self.views, self.missing, self.work = None, {}, 0, None


class _Reducer:
    """The buckets of one model and their state during one backward pass."""

    def __init__(self, module, group, cap_bytes, first_cap_bytes):
        self.group = group
        params = [value_of(x) for _, x in _walk(module, trainable_only=True)]
        self.paths = [p for p, _ in _walk(module, trainable_only=True)]
        self.shapes = [tuple(p.shape) for p in params]
        self.dtypes = [p.dtype for p in params]
        self.plan = self._plan(params, cap_bytes, first_cap_bytes)
        self.bucket_of = {}
        for b, bucket in enumerate(self.plan):
            xp = get_array_module(params[bucket.indices[0]])
            dtype = params[bucket.indices[0]].dtype
            size = sum(params[i].size for i in bucket.indices)
            bucket.flat = xp.zeros(size, dtype)
            offset = 0
            for i in bucket.indices:
                n = params[i].size
                bucket.views[i] = bucket.flat[offset:offset + n].reshape(params[i].shape)
                offset += n
                self.bucket_of[i] = b
        self.level = None
        self.log: list | None = None   # tests: ("start", bucket) as buckets start

    @staticmethod
    def _plan(params, cap_bytes, first_cap_bytes):
        """Per-dtype bucket plans merged by readiness (a bucket is ready when its lowest index is): the same on
        every rank, a function of the model's structure only."""
        by_dtype = {}
        for i, p in enumerate(params):
            by_dtype.setdefault(p.dtype.str, []).append(i)
        buckets = []
        for idx in by_dtype.values():
            for b in bucket_plan([params[i].nbytes for i in idx], cap_bytes, first_cap_bytes):
                buckets.append(_Bucket(tuple(idx[j] for j in b.indices), b.nbytes))
        buckets.sort(key=lambda b: -b.indices[-1])
        return buckets

    def attach(self, boxed):
        """Hooks on the boxed model's trainable arrays, once per tape (a model called twice is hooked once)."""
        leaves = _walk(boxed, trainable_only=True)
        tracked = [x for _, x in leaves if is_tracked(x)]
        if not tracked:
            return
        level = tracked[0].level
        if level == self.level:
            return
        if len(leaves) != len(self.shapes):
            raise DistributedError(f"DataParallel: the model now has {len(leaves)} trainable arrays, "
                                   f"{len(self.shapes)} when it was wrapped; wrap the model again after changing it")
        self.level = level
        for bucket in self.plan:
            bucket.missing, bucket.work = len(bucket.indices), None
        self.next = 0
        self.started = 0
        for i, (_, x) in enumerate(leaves):
            if is_tracked(x) and x.level == level:
                register_gradient_hook(x, self._hook(i))
            else:
                self._arrive(i, None)   # not differentiated at this level: contributes zeros

    def _hook(self, i):
        def data_parallel_hook(g):
            return self._arrive(i, g)
        return data_parallel_hook

    def _arrive(self, i, g):
        b = self.bucket_of[i]
        bucket = self.plan[b]
        view = bucket.views[i]
        if g is None:
            view[...] = 0
        else:
            if is_tracked(g):
                raise DistributedError(f"DataParallel: the gradient of {self.paths[i]} is itself being differentiated "
                                       "(a gradient of a gradient); DataParallel averages first-order gradients only")
            get_array_module(view).copyto(view, g)   # a plain device copy where g is contiguous
        bucket.missing -= 1
        if bucket.missing == 0:
            self._launch_ready()
        return view

    def _launch_ready(self):
        while self.next < len(self.plan) and self.plan[self.next].missing == 0:
            b = self.next
            bucket = self.plan[b]
            what = f"gradient bucket {b} of {len(self.plan)} ({bucket.flat.nbytes / MIB:.1f} MiB)"
            bucket.work = self.group.start_all_reduce(bucket.flat, "avg", what=what)
            if self.log is not None:
                self.log.append(("start", b))
            self.next += 1
        if self.next == len(self.plan):
            for bucket in self.plan:   # the optimiser's stream waits for every bucket; the host does not
                bucket.work.wait()
            if self.log is not None:
                self.log.append(("waited", len(self.plan)))
            self.level = None

