"""NCCL through CuPy's binding (``cupy.cuda.nccl``): one communicator per process and GPU, its collectives on a
side stream ordered against the caller's stream with events.

:mod:`fluxpy.distributed` reaches NCCL only through this module (only ``backend`` and ``kernels`` name CuPy).
Every collective of a :class:`NcclComm` runs on the communicator's own stream, in the order the host issues them,
so that every rank queues the same collectives in the same order whatever streams its callers use: the side stream
first waits for an event recorded on the caller's current stream (the inputs are written), runs the NCCL call, and
records an event that the caller waits for (:meth:`Work.wait`, a stream wait: the host does not block). All of it is
legal inside a CUDA graph capture (an event wait forks the side stream into the capture; the caller's wait joins
it back).

A failed call raises :class:`NcclCallError` naming the NCCL call, the status (``ncclInvalidUsage`` ...) and the
rank. Importing this module needs neither CuPy nor a GPU; :func:`nccl_available` says whether NCCL can be used.

>>> NcclCallError("ncclAllReduce", 5, rank=1).status_name
'ncclInvalidUsage'
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any

try:   # CuPy is optional: the CPU never gets here through fluxpy.distributed (a world of one needs no NCCL)
    import cupy
    from cupy.cuda import nccl as _nccl
    _IMPORT_ERROR = None
except Exception as err:   # ImportError, or CuPy without NCCL / without a driver
    cupy = _nccl = None
    _IMPORT_ERROR = f"{type(err).__name__}: {err}"

from ..backend import hold_in_capture, release_graphs  # noqa: E402  (after the guarded CuPy import)

UNIQUE_ID_BYTES = 128

# ncclResult_t (nccl.h, NCCL 2.28). CuPy's own table stops at 5 and raises KeyError for newer statuses.
STATUS_NAMES = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress"}
_STATUS_HINTS = {1: "a CUDA call inside NCCL failed (out of memory, or a device error)",
                 2: "a system call failed (network, shared memory or /dev/shm too small)",
                 3: "NCCL's internal error", 4: "a bad argument (a null or wrong-device pointer, a bad count)",
                 5: "NCCL used wrongly (ranks calling different collectives, or a mismatched count)",
                 6: "another rank failed, or the network to it did", 7: "the operation is still in progress"}

# ncclDataType_t and ncclRedOp_t values (stable across NCCL 2.x)
_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
           "float64": 8, "bfloat16": 9}
REDUCE_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


class NcclCallError(RuntimeError):
    """An NCCL call failed: ``call`` (``"ncclAllReduce"``), ``status`` (the ``ncclResult_t`` number, or None when
    unknown), ``status_name`` and ``rank``; the message names all of them and what the status usually means.

    >>> str(NcclCallError("ncclCommInitRank", 6, rank=0, detail="2 ranks"))  # doctest: +NORMALIZE_WHITESPACE
    'ncclCommInitRank failed on rank 0 with ncclRemoteError (status 6: another rank failed, or the network to it
    did): 2 ranks'
    """

    def __init__(self, call: str, status: int | None, rank: int | None = None, detail: str = "") -> None:
        self.call, self.status, self.rank = call, status, rank
        self.status_name = STATUS_NAMES.get(status, "an unknown status") if status is not None else "an error"
        where = f" on rank {rank}" if rank is not None else ""
        hint = f" (status {status}: {_STATUS_HINTS[status]})" if status in _STATUS_HINTS else \
            (f" (status {status})" if status is not None else "")
        super().__init__(f"{call} failed{where} with {self.status_name}{hint}" + (f": {detail}" if detail else ""))


def nccl_available() -> tuple[bool, str]:
    """``(True, "")`` where CuPy with NCCL and a GPU are present; else ``(False, why)``.

    >>> ok, why = nccl_available()
    >>> isinstance(ok, bool) and isinstance(why, str)
    True
    """
    if _nccl is None:
        return False, f"cupy.cuda.nccl cannot be imported ({_IMPORT_ERROR})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        return False, f"no usable GPU ({type(err).__name__}: {err})"
    if n < 1:
        return False, "no GPU"
    return True, ""


def device_count() -> int:
    """The number of GPUs this process sees (0 without CuPy or a driver).

    >>> device_count() >= 0
    True
    """
    try:
        return int(cupy.cuda.runtime.getDeviceCount()) if cupy is not None else 0
    except Exception:
        return 0


def nccl_version() -> int | None:
    """NCCL's runtime version as an int (``22803`` for 2.28.3), None without NCCL.

    >>> nccl_version() is None or nccl_version() > 0
    True
    """
    return None if _nccl is None else int(_nccl.get_version())


def _status_of(err):
    status = getattr(err, "status", None)
    if status is None and isinstance(err, KeyError) and err.args and isinstance(err.args[0], int):
        status = err.args[0]   # CuPy's NcclError could not name a status newer than its table
    return status


def _call(name, rank, fn, *args):
    try:
        return fn(*args)
    except Exception as err:
        raise NcclCallError(name, _status_of(err), rank, f"{type(err).__name__}: {err}") from err


def use_device(device: int) -> None:
    """Make GPU ``device`` current in this thread (before anything creates a CUDA context on another one).

    >>> callable(use_device)
    True
    """
    _require()
    n = device_count()
    if not 0 <= device < n:
        raise RuntimeError(f"fluxpy.distributed: GPU {device} (LOCAL_RANK) was asked for but this process sees {n} "
                           "GPU(s); start at most one rank per GPU (check CUDA_VISIBLE_DEVICES)")
    cupy.cuda.Device(device).use()


def unique_id() -> bytes:
    """A new NCCL unique id (128 bytes) for rank 0 to hand to the others (``ncclGetUniqueId``).

    >>> callable(unique_id)
    True
    """
    _require()
    raw = _call("ncclGetUniqueId", 0, _nccl.get_unique_id)
    return bytes(b & 0xFF for b in raw)


def _communicator(world_size, uid, rank):
    """``cupy.cuda.nccl.NcclCommunicator``: CuPy 14 takes the id as bytes, older CuPy as a tuple of C chars."""
    try:
        return _nccl.NcclCommunicator(world_size, uid, rank)
    except TypeError:
        return _nccl.NcclCommunicator(world_size, tuple(b - 256 if b > 127 else b for b in uid), rank)


def _require():
    if _nccl is None:
        from ..backend import GPUUnavailableError
        raise GPUUnavailableError(f"NCCL needs CuPy with cupy.cuda.nccl: {_IMPORT_ERROR}")


class Work:
    """A collective queued on a communicator's stream: :meth:`wait` makes the caller's current stream wait for
    it (the host goes on), :meth:`done` asks without waiting, :meth:`synchronize` blocks the host.

    >>> callable(Work.wait)
    True
    """
    __slots__ = ("event", "what")

    def __init__(self, event: Any, what: str) -> None:
        self.event, self.what = event, what

    def wait(self) -> None:
        """Make the current stream wait for the collective (no host wait)."""
        cupy.cuda.get_current_stream().wait_event(self.event)

    def done(self) -> bool:
        """Whether the collective has finished on the device."""
        return bool(self.event.done)

    def synchronize(self) -> None:
        """Block the host until the collective has finished."""
        self.event.synchronize()


class NcclComm:
    """Rank ``rank`` of ``world_size`` in the NCCL clique of ``uid`` (rank 0's :func:`unique_id`), on GPU
    ``device`` (which becomes the current device). ``ncclCommInitRank`` blocks until every rank has called it.

    Collectives work in place on contiguous CuPy arrays of that device and return a :class:`Work`; ``wait=True``
    (the default) makes the current stream wait at once. ``all_reduce(x, op)`` (``"sum"``, ``"max"``, ``"min"``,
    ``"prod"``, ``"avg"``), ``broadcast(x, root)``, ``broadcast_many(xs, root)`` (one NCCL group:
    ``ncclGroupStart``/``ncclGroupEnd`` around the calls, one launch), ``all_gather(x)`` (a new array
    ``(world_size, *x.shape)``).
    :meth:`abort` ends the communicator at once (``ncclCommAbort``: collectives stuck waiting for a dead rank
    return); :meth:`async_error` reads ``ncclCommGetAsyncError``.

    >>> callable(NcclComm.all_reduce)
    True
    """

    def __init__(self, uid: bytes, rank: int, world_size: int, device: int) -> None:
        _require()
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"NcclComm: the unique id must be {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        self.rank, self.world_size, self.device = rank, world_size, device
        use_device(device)
        self._comm = _call("ncclCommInitRank", rank, _communicator, world_size, bytes(uid), rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.aborted = False
        self._lock = threading.Lock()

    # -- ordering against the caller's stream ------------------------------------------------------------

    def _enter(self):
        """The side stream waits for what the caller queued so far. A graph being captured now holds this
        communicator (:meth:`destroy` frees such graphs first)."""
        hold_in_capture(self)
        self.stream.wait_event(cupy.cuda.get_current_stream().record(cupy.cuda.Event(disable_timing=True)))

    def _leave(self, what, wait):
        event = self.stream.record(cupy.cuda.Event(disable_timing=True))
        work = Work(event, what)
        if wait:
            work.wait()
        return work

    def _check(self, x, who):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{who}: expects a CuPy array, got {type(x).__name__}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{who}: expects a C-contiguous array, got strides {x.strides} for shape {x.shape}")
        if x.device.id != self.device:
            raise ValueError(f"{who}: the array is on GPU {x.device.id}, rank {self.rank}'s communicator on GPU "
                             f"{self.device}")
        name = x.dtype.name
        if name not in _DTYPES:
            raise TypeError(f"{who}: NCCL has no dtype {name}; use one of {', '.join(_DTYPES)}")
        if self.aborted:
            raise RuntimeError(f"{who}: rank {self.rank}'s communicator was aborted")
        return _DTYPES[name]

    # -- collectives -------------------------------------------------------------------------------------

    def all_reduce(self, x: Any, op: str = "sum", *, wait: bool = True, what: str = "all_reduce") -> Work:
        """Reduce ``x`` over the ranks, in place (``ncclAllReduce``)."""
        dtype = self._check(x, "all_reduce")
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
        self._enter()
        _call("ncclAllReduce", self.rank, self._comm.allReduce, x.data.ptr, x.data.ptr, x.size, dtype,
              REDUCE_OPS[op], self.stream.ptr)
        return self._leave(what, wait)

    def broadcast(self, x: Any, root: int = 0, *, wait: bool = True, what: str = "broadcast") -> Work:
        """Rank ``root``'s ``x`` into every rank's ``x``, in place (``ncclBroadcast``)."""
        dtype = self._check(x, "broadcast")
        self._enter()
        _call("ncclBroadcast", self.rank, self._comm.broadcast, x.data.ptr, x.data.ptr, x.size, dtype, root,
              self.stream.ptr)
        return self._leave(what, wait)

    def broadcast_many(self, xs: list, root: int = 0, *, wait: bool = True, what: str = "broadcast") -> Work:
        """:meth:`broadcast` of each array of ``xs``, as one NCCL group (one launch)."""
        dtypes = [self._check(x, "broadcast_many") for x in xs]
        self._enter()
        _call("ncclGroupStart", self.rank, _nccl.groupStart)
        try:
            for x, dtype in zip(xs, dtypes):
                _call("ncclBroadcast", self.rank, self._comm.broadcast, x.data.ptr, x.data.ptr, x.size, dtype, root,
                      self.stream.ptr)
        finally:
            _call("ncclGroupEnd", self.rank, _nccl.groupEnd)
        return self._leave(what, wait)

    def all_gather(self, x: Any) -> Any:
        """Every rank's ``x`` stacked: an array ``(world_size, *x.shape)`` (``ncclAllGather``); the current
        stream waits for it."""
        dtype = self._check(x, "all_gather")
        out = cupy.empty((self.world_size,) + tuple(x.shape), x.dtype)
        self._enter()
        _call("ncclAllGather", self.rank, self._comm.allGather, x.data.ptr, out.data.ptr, x.size, dtype,
              self.stream.ptr)
        self._leave("all_gather", True)
        return out

    # -- faults ------------------------------------------------------------------------------------------

    def async_error(self) -> str | None:
        """None while the communicator is healthy (or was ended here, by :meth:`abort` or :meth:`destroy`), else the
        name of its asynchronous error (``ncclCommGetAsyncError``: a peer died, a network failure)."""
        with self._lock:   # never while another thread frees the communicator
            if self.aborted:
                return None
            try:
                self._comm.check_async_error()
            except Exception as err:
                status = _status_of(err)
                return STATUS_NAMES.get(status, f"status {status}") if status is not None else str(err)
        return None

    def abort(self) -> None:
        """``ncclCommAbort``: end the communicator now; its queued collectives return (idempotent, any thread)."""
        with self._lock:
            if not self.aborted:
                self.aborted = True
                with contextlib.suppress(Exception):
                    self._comm.abort()

    def destroy(self) -> None:
        """``ncclCommDestroy`` after the queued collectives (idempotent). The captured CUDA graphs that hold
        collectives of this communicator are freed first (their launch raises from then on): NCCL keeps a
        reference per such graph and ``ncclCommDestroy`` would wait for them forever."""
        if self.aborted:
            return
        with contextlib.suppress(Exception):
            self.stream.synchronize()
        release_graphs(self, f"rank {self.rank}'s NCCL communicator was destroyed")
        with self._lock:
            if not self.aborted:
                self.aborted = True
                with contextlib.suppress(Exception):
                    self._comm.destroy()

    def synchronize(self) -> None:
        """Block the host until every collective queued so far has finished."""
        self.stream.synchronize()

    def __repr__(self) -> str:
        return f"NcclComm(rank={self.rank}, world_size={self.world_size}, device={self.device})"
