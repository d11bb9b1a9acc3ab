"""Array backends: NumPy on the CPU, CuPy on an NVIDIA GPU.

Every op in fluxpy is written once against an array module ``xp`` found by
:func:`get_array_module`; only ``fluxpy/kernels`` knows about CUDA.

>>> import numpy as np
>>> get_array_module(np.ones(3)) is np
True
"""
from __future__ import annotations

import ctypes
import threading
import weakref
import zlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

try:  # CuPy is optional (the ``cuda`` extra); any failure just means "no GPU backend".
    import cupy as _cupy
    _CUPY_IMPORT_ERROR: BaseException | None = None
except Exception as err:  # pragma: no cover - depends on the machine
    _cupy = None
    _CUPY_IMPORT_ERROR = err

cupy = _cupy

DeviceArray = cupy.ndarray if cupy is not None else type("NoDeviceArray", (), {})
"""The GPU array type (``cupy.ndarray``), or a class nothing is an instance of where CuPy is absent."""

__all__ = ["get_array_module", "is_array", "DeviceArray", "to_gpu", "to_cpu", "copy_into", "copy_of", "gpu_available",
           "GPUUnavailableError",
           "default_float", "is_float_array", "is_float_dtype", "reduced_axes", "record_event", "event_seconds",
           "HostToDevice",
           "host_to_device", "read_scalars", "start_reading_scalars", "ScalarsRead", "Array"]

default_float = np.float32

Array = Any  # a NumPy or CuPy ndarray, or a Tracked value (fluxpy.autodiff) wrapping one


class GPUUnavailableError(RuntimeError):
    """Raised by :func:`gpu` when CuPy or a CUDA device cannot be used; the message says why."""


def _unwrap(x):
    # Tracked values (fluxpy.autodiff) carry their array in ``.value``, possibly nested.
    while getattr(x, "__fluxpy_tracked__", False):
        x = x.value
    return x


def get_array_module(*xs: Any) -> ModuleType:
    """The array module, ``numpy`` or ``cupy``, that owns the arrays among ``xs``.

    Tracked values are looked through. Mixing NumPy and CuPy arrays is an error
    that names both.

    >>> import numpy as np
    >>> get_array_module(np.zeros(2), 3.0).__name__
    'numpy'
    """
    found = _OTHER
    for x in xs:
        kind = _kinds.get(type(x)) or _kind_of(type(x))
        while kind is _TRACKED:
            x = x.value
            kind = _kinds.get(type(x)) or _kind_of(type(x))
        if kind is _OTHER:
            continue
        if found is not _OTHER and kind is not found:
            raise TypeError(_mixed_message(xs))
        found = kind
    return cupy if found is _GPU else np


# What each type is to get_array_module, found once per type (every op asks it of every argument): a NumPy
# array, a CuPy array, a Tracked value (looked through), or anything else.
_CPU, _GPU, _TRACKED, _OTHER = "cpu", "gpu", "tracked", "other"
_kinds: dict[type, str] = {}


def _kind_of(t: type) -> str:
    if getattr(t, "__fluxpy_tracked__", False):
        kind = _TRACKED
    elif issubclass(t, np.ndarray):
        kind = _CPU
    elif cupy is not None and issubclass(t, cupy.ndarray):
        kind = _GPU
    else:
        kind = _OTHER
    _kinds[t] = kind
    return kind


def _mixed_message(xs):
    parts = [f"{type(_unwrap(x)).__module__}.{type(_unwrap(x)).__name__} {getattr(x, 'shape', '')}" for x in xs]
    return "cannot mix CPU (numpy) and GPU (cupy) arrays in one op; got " + ", ".join(parts) + \
        ": move them with fluxpy.gpu(...) or fluxpy.cpu(...)"


def is_array(x: Any) -> bool:
    """True for a NumPy or CuPy ndarray (not for Python numbers or Tracked values).

    >>> import numpy as np
    >>> is_array(np.ones(2)), is_array(1.0)
    (True, False)
    """
    return isinstance(x, np.ndarray) or (cupy is not None and isinstance(x, cupy.ndarray))


def is_float_array(x: Any) -> bool:
    """True for a NumPy/CuPy array of a floating dtype (:func:`is_float_dtype`): the arrays that gradients flow to.

    >>> import numpy as np
    >>> is_float_array(np.ones(2)), is_float_array(np.arange(2))
    (True, False)
    """
    return is_array(x) and is_float_dtype(x.dtype)


def is_float_dtype(dtype: Any) -> bool:
    """True for NumPy's floating dtypes and the extension floats of ``ml_dtypes`` (bfloat16, float8_*), which NumPy
    files under kind ``"V"``.

    >>> import ml_dtypes, numpy as np
    >>> is_float_dtype(np.float16), is_float_dtype(ml_dtypes.bfloat16), is_float_dtype(np.int32)
    (True, True, False)
    """
    floating = _FLOATING.get(dtype)
    if floating is None:   # np.issubdtype costs a microsecond: gradient asks it of every leaf of a model, every step
        d = np.dtype(dtype)
        floating = _FLOATING[dtype] = bool(np.issubdtype(d, np.floating)) or (
            d.kind == "V" and d.name.startswith(("bfloat", "float")))
    return floating


_FLOATING: dict = {}   # dtype -> whether it is a floating dtype


def reduced_axes(gshape: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The axes of a broadcast result ``gshape`` to sum so it collapses to ``shape``.

    >>> reduced_axes((4, 2, 3), (2, 1))
    (0, 2)
    """
    gshape, shape = tuple(gshape), tuple(shape)
    extra = len(gshape) - len(shape)
    if extra < 0 or any(s != 1 and s != g for s, g in zip(shape, gshape[extra:])):
        raise ValueError(f"unbroadcast: a gradient of shape {gshape} cannot come from broadcasting shape {shape}")
    return tuple(range(extra)) + tuple(extra + i for i, s in enumerate(shape) if s == 1 and gshape[extra + i] != 1)


def gpu_available() -> tuple[bool, str]:
    """Whether a CUDA GPU can be used through CuPy, and if not, why: ``(usable, reason)``.

    >>> ok, why = gpu_available()
    >>> isinstance(ok, bool) and isinstance(why, str)
    True
    """
    if cupy is None:
        return False, f"CuPy could not be imported ({_CUPY_IMPORT_ERROR!r}); install fluxpy[cuda]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CUDA driver missing, no device, ...
        return False, f"CuPy is installed but CUDA is not usable: {err}"
    if count == 0:
        return False, "CuPy is installed but no CUDA device was found"
    return True, f"{count} CUDA device(s)"


def to_gpu(a: Array) -> Array:
    """A CuPy copy of a NumPy array (a CuPy array as it is); raises :class:`GPUUnavailableError`, saying why,
    when no GPU is usable. :func:`fluxpy.gpu` moves whole model trees with it.

    >>> import numpy as np
    >>> try:
    ...     y = to_gpu(np.ones(3))
    ... except GPUUnavailableError:
    ...     y = None   # no GPU on this machine
    """
    ok, why = gpu_available()
    if not ok:
        raise GPUUnavailableError(f"fluxpy.gpu: no usable GPU: {why}")
    return cupy.asarray(a)


def to_cpu(a: Any) -> Any:
    """A NumPy copy of a CuPy array; anything else as it is. :func:`fluxpy.cpu` moves whole trees with it.

    >>> import numpy as np
    >>> to_cpu(np.ones(2))
    array([1., 1.])
    """
    if cupy is not None and isinstance(a, cupy.ndarray):
        return cupy.asnumpy(a)
    return a


def gpu_device(x: Any) -> int | None:
    """The CUDA device id of a CuPy array, None for anything else.

    >>> import numpy as np
    >>> gpu_device(np.ones(2)) is None
    True
    """
    if cupy is not None and isinstance(x, cupy.ndarray):
        return x.device.id
    return None


def fingerprint(a: Array) -> int:
    """A number that changes when any byte of ``a`` does: a CRC-32 of a NumPy array's bytes (C order); for a CuPy
    array, a position-weighted sum of its bytes computed on the device and read back (a sync: for debugging).

    >>> import numpy as np
    >>> a = np.arange(4.0); before = fingerprint(a); a[[0, 1]] = a[[1, 0]]   # a swap keeps the sum
    >>> fingerprint(a) != before
    True
    """
    if isinstance(a, np.ndarray):
        return zlib.crc32(a if a.flags.c_contiguous else np.ascontiguousarray(a))   # any dtype's bytes
    raw = cupy.ascontiguousarray(a).reshape(-1).view(cupy.uint8).astype(cupy.uint64)
    return int((raw * cupy.arange(1, raw.size + 1, dtype=cupy.uint64)).sum())


def copy_into(dst: Array, src: Array) -> None:
    """Copy ``src`` into ``dst`` in place (``dst[...] = src``), across devices: ``src`` is moved to ``dst``'s
    device first.

    >>> import numpy as np
    >>> dst = np.zeros(2); copy_into(dst, np.ones(2)); dst
    array([1., 1.])
    """
    dst[...] = get_array_module(dst).asarray(to_cpu(src) if isinstance(dst, np.ndarray) else src)


def copy_of(a: Array) -> Array:
    """A new array with ``a``'s values: for a C-order CuPy array one device-to-device copy queued on the current
    stream (CuPy's ``copy`` launches a kernel, several times the host time of a queued copy for a few values).

    >>> import numpy as np
    >>> a = np.arange(3.0); b = copy_of(a); b[0] = 9.0; a
    array([0., 1., 2.])
    """
    if type(a) is not DeviceArray or not a.flags.c_contiguous:
        return a.copy()
    out = cupy.empty(a.shape, a.dtype)
    cupy.cuda.runtime.memcpyAsync(out.data.ptr, a.data.ptr, a.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
                                  cupy.cuda.get_current_stream().ptr)
    return out


def record_event() -> Any:
    """A CUDA event recorded now on the current stream, for timing GPU work (:func:`fluxpy.profile`).

    >>> callable(record_event)
    True
    """
    event = cupy.cuda.Event()
    event.record()
    return event


def event_seconds(start: Any, end: Any) -> float:
    """Seconds of GPU time between two :func:`record_event` events (waits for ``end``).

    >>> callable(event_seconds)
    True
    """
    return cupy.cuda.get_elapsed_time(start, end) / 1e3


def read_scalars(*xs: Any) -> list[float]:
    """``[float(x) for x in xs]``, with one wait for the GPU however many of ``xs`` are on it.

    Each ``x`` is anything ``float`` takes: a number, a 0-d NumPy or CuPy array. The 0-d CuPy
    arrays on the current device are copied into one pinned host buffer on the current stream and
    read after one wait (``float`` of each costs a synchronous copy of its own); the rest go to
    ``float`` as they are. :func:`start_reading_scalars` is the same without the wait.

    >>> import numpy as np
    >>> read_scalars(np.float32(1.5), np.array(2.0), 3)
    [1.5, 2.0, 3.0]
    """
    return start_reading_scalars(*xs).result()


class ScalarsRead:
    """Scalars on their way to the host (:func:`start_reading_scalars`): :meth:`result` waits for their copy only,
    not for GPU work queued after it.

    >>> import numpy as np
    >>> start_reading_scalars(np.float32(0.5), 2).result()
    [0.5, 2.0]
    """
    __slots__ = ("_xs", "_buffer", "_offsets", "_event")

    def __init__(self, xs, buffer, offsets, event):
        self._xs, self._buffer, self._offsets, self._event = xs, buffer, offsets, event

    def result(self) -> list[float]:
        """The scalars as floats (waits for their copy the first time)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        raw = np.frombuffer(self._buffer, np.uint8) if self._buffer is not None else None
        offsets = self._offsets
        return [float(raw[offsets[id(x)]:offsets[id(x)] + x.nbytes].view(x.dtype)[0]) if id(x) in offsets
                else float(x) for x in self._xs]


def start_reading_scalars(*xs: Any) -> ScalarsRead:
    """Queue the copy of ``xs`` (as for :func:`read_scalars`) to the host on the current stream, into a pinned
    buffer of its own, and return at once: the GPU work queued next runs while the host waits for these values
    alone (a training loop reads one step's loss while the next step runs).

    >>> start_reading_scalars(1.5).result()
    [1.5]
    """
    device = _current_device_scalars(xs)
    if not device:
        return ScalarsRead(xs, None, {}, None)
    buffer = cupy.cuda.alloc_pinned_memory(sum(-(-x.nbytes // 8) * 8 for x in device))
    stream = cupy.cuda.get_current_stream()
    address, offsets, offset = buffer.ptr, {}, 0
    for x in device:
        x.data.copy_to_host_async(ctypes.c_void_p(address + offset), x.nbytes, stream)
        offsets[id(x)] = offset
        offset += -(-x.nbytes // 8) * 8
    return ScalarsRead(xs, buffer, offsets, stream.record())


def _current_device_scalars(xs):
    """The 0-d CuPy arrays among ``xs`` that live on the current device (each once)."""
    if cupy is None:
        return []
    found = [x for x in xs if isinstance(x, cupy.ndarray) and x.ndim == 0]
    if not found:
        return []
    here = cupy.cuda.runtime.getDevice()
    return list({id(x): x for x in found if x.data.device_id == here}.values())


# ---------------------------------------------------------------------------------------------
# Host-to-device copies ahead of use: pinned staging buffers, a side stream, events


def host_to_device(sources: Sequence[Any], rows: int, slots: int = 3) -> HostToDevice | None:
    """A :class:`HostToDevice` copier for batches of up to ``rows`` rows of ``sources``, or ``None`` where it does
    not apply: no usable GPU, or a source that is not a NumPy array of a native-order number or bool dtype (such
    batches take :func:`to_gpu`, which raises or refuses as before).

    >>> import numpy as np
    >>> copier = host_to_device([np.array(["a", "b"])], rows=2)
    >>> copier is None   # strings never go through pinned buffers (and no GPU here in any case)
    True
    """
    if not gpu_available()[0] or not all(_pinnable(s) for s in sources):
        return None
    return HostToDevice(sources, rows, slots)


def _pinnable(x):
    return isinstance(x, np.ndarray) and x.dtype.kind in "biufc" and x.dtype.isnative and x.ndim >= 1


class HostToDevice:
    """Copies batches of rows of host arrays to the GPU ahead of their use.

    ``stage(index)`` gathers the rows ``index`` (a slice, or an integer array such as a piece of
    a shuffled order) of every source straight into a pinned (page-locked) host buffer, one
    gather and no other host copy, and enqueues ONE copy of them all into a fresh block of device
    memory on a side stream (``self.stream``); it returns at once. ``ready(staged)`` makes the
    current stream wait for that copy (an event: no host sync) and returns one device array per
    source, views of the batch's own block (from CuPy's memory pool; no later batch writes
    into it).

    ``slots`` pinned buffers are used in rotation; before one is written again the host waits
    for the copy that last read it (normally long finished). The side stream first waits for
    the work already on the current stream, because the pool may hand out memory that this
    work still reads; so the copy of batch i+1, staged before step i is launched, overlaps
    step i. The arrays come from the pool of the stream current at ``stage``: use them there.

    >>> import numpy as np
    >>> HostToDevice.__name__, callable(host_to_device)   # needs a GPU: see tests/gpu/test_prefetch_gpu.py
    ('HostToDevice', True)
    """

    def __init__(self, sources: Sequence[np.ndarray], rows: int, slots: int = 3) -> None:
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
            raise ValueError(f"HostToDevice expects rows to be an int >= 1, got {rows!r}")
        if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
            raise ValueError(f"HostToDevice expects slots to be an int >= 1, got {slots!r}")
        if not sources or not all(_pinnable(s) for s in sources):
            raise TypeError("HostToDevice expects NumPy arrays of a native-order number or bool dtype, with an axis "
                            f"of rows, got {[_summary(s) for s in sources]}")
        self.sources = list(sources)
        self.rows = int(rows)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._offsets, self._nbytes = _layout(self.sources, self.rows)
        self._last_row_bytes = _row_bytes(self.sources[-1])
        self._slots: list[tuple[Any, list[np.ndarray]] | None] = [None] * int(slots)   # (host address, views)
        self._copied: list[Any] = [None] * int(slots)   # per slot: the event of the last copy out of it
        self._pinned: list[Any] = [None] * int(slots)   # per slot: the pinned memory (kept alive here)
        self._next = 0

    def stage(self, index: slice | np.ndarray) -> tuple[list[Any], Any]:
        """Gather rows ``index`` of every source into the next pinned slot and enqueue their copy to the GPU."""
        count = _check_index(index, len(self.sources[0]), self.rows)
        slot = self._next
        self._next = (slot + 1) % len(self._slots)
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()
        address, buffers = self._slots[slot] or self._make_slot(slot)
        for src, buffer in zip(self.sources, buffers):
            _gather(src, index, buffer[:count])
        block = cupy.cuda.alloc(self._nbytes)   # the current stream's pool
        self.stream.wait_event(_event(cupy.cuda.get_current_stream()))
        block.copy_from_host_async(address, self._offsets[-1] + count * self._last_row_bytes, self.stream)
        done = _event(self.stream)
        self._copied[slot] = done
        arrays = [cupy.ndarray((count,) + b.shape[1:], b.dtype, block + offset)
                  for b, offset in zip(buffers, self._offsets)]
        return arrays, done

    def ready(self, staged: tuple[list[Any], Any]) -> list[Any]:
        """The device arrays of ``staged``, once the current stream has been told to wait for their copy."""
        arrays, done = staged
        cupy.cuda.get_current_stream().wait_event(done)
        return arrays

    def synchronize(self) -> None:
        """Wait on the host until every copy enqueued so far has finished."""
        self.stream.synchronize()

    def _make_slot(self, slot):
        memory = cupy.cuda.alloc_pinned_memory(self._nbytes)
        raw = np.frombuffer(memory, np.uint8, self._nbytes)
        buffers = [raw[offset:offset + self.rows * _row_bytes(src)].view(src.dtype).reshape(
            (self.rows,) + tuple(src.shape[1:])) for src, offset in zip(self.sources, self._offsets)]
        self._pinned[slot] = memory
        self._slots[slot] = (ctypes.c_void_p(memory.ptr), buffers)
        return self._slots[slot]

    def __del__(self):
        # The pinned memory goes back to CuPy's pool with this object; no copy may still read it then.
        try:
            self.stream.synchronize()
        except Exception:  # interpreter shutdown, or the CUDA context already gone
            pass


_ALIGN = 256   # bytes: each source's rows start at such an offset of a slot (and of the device block)


def _row_bytes(src):
    return int(np.prod(src.shape[1:], dtype=np.int64)) * src.dtype.itemsize


def _layout(sources, rows):
    """The byte offset of each source's ``rows`` rows in one buffer, each aligned, and the buffer's size (>= 1)."""
    offsets, end = [], 0
    for src in sources:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + rows * _row_bytes(src)
    return offsets, max(end, 1)


def _event(stream):
    """A CUDA event (no timing) recorded now on ``stream``."""
    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    return event


def _check_index(index, nobs, rows):
    """``index`` picks at most ``rows`` rows, all in ``range(nobs)``; a clear error otherwise (before any copy)."""
    if isinstance(index, slice):
        count = len(range(*index.indices(nobs)))
    else:
        index = np.asarray(index)
        if index.ndim != 1 or index.dtype.kind not in "iu":
            raise TypeError(f"HostToDevice.stage expects a slice or a 1-d integer array of rows, got "
                            f"{_summary(index)}")
        count = len(index)
        if count and (index.min() < 0 or index.max() >= nobs):
            raise IndexError(f"HostToDevice.stage expects row indices in [0, {nobs}), got values from "
                             f"{index.min()} to {index.max()}")
    if count > rows:
        raise ValueError(f"HostToDevice.stage expects at most rows={rows} rows per batch, got {count}")
    return count


def _gather(src, index, out):
    """Rows ``index`` of ``src`` written into ``out`` (as many rows), with no intermediate copy."""
    if isinstance(index, slice):
        np.copyto(out, src[index])
    else:
        np.take(src, index, axis=0, out=out, mode="clip")   # "clip": no buffering of out (mode="raise" buffers)


def _summary(x):
    return f"{type(x).__name__} {getattr(x, 'dtype', '')} {tuple(getattr(x, 'shape', ()))}".strip()


# ---------------------------------------------------------------------------------------------
# CUDA graphs: the work a function queues, recorded once and replayed


class CapturedGraph:
    """A CUDA graph recorded from the GPU work that one call of a function queued (:func:`capture_graph`), with
    the stream it replays on and the private memory pool its buffers came from.

    The pool is used by nothing else, so the addresses the graph reads and writes stay its own between replays
    (the pool's blocks live as long as this object or an array taken from them). :meth:`launch` orders the
    replay after the work already queued on the current stream, and that stream's later work after the replay.
    ``holds``: the resources the captured work uses that cannot be freed while the graph lives (an NCCL
    communicator: :func:`hold_in_capture`); :func:`release_graphs` frees the graphs holding one, after which
    :meth:`launch` raises.

    >>> CapturedGraph.__name__
    'CapturedGraph'
    """
    __slots__ = ("graph", "stream", "pool", "holds", "released", "__weakref__")

    def __init__(self, graph: Any, stream: Any, pool: Any, holds: tuple = ()) -> None:
        self.graph, self.stream, self.pool = graph, stream, pool
        self.holds, self.released = tuple(holds), None

    def launch(self) -> None:
        """Replay the graph once, between the current stream's earlier and later work (no host wait)."""
        if self.graph is None:
            raise RuntimeError(f"this captured CUDA graph was released ({self.released}); it cannot be replayed")
        current = cupy.cuda.get_current_stream()
        self.stream.wait_event(current.record())
        self.graph.launch(self.stream)
        current.wait_event(self.stream.record())

    def release(self, why: str) -> None:
        """Free the graph now (after the device has finished its launches); :meth:`launch` then raises naming
        ``why``."""
        if self.graph is not None:
            if cupy is not None:
                cupy.cuda.Device().synchronize()
            self.graph, self.released = None, why


_LIVE_GRAPHS: weakref.WeakSet = weakref.WeakSet()   # every CapturedGraph not yet garbage
_CAPTURE = threading.local()                        # .holds: the resources of the capture under way in this thread


def hold_in_capture(resource: Any) -> bool:
    """Called by code that queues work on a resource which must outlive every graph that captured such work (an
    NCCL communicator: ``ncclCommDestroy`` waits until those graphs are gone): while :func:`capture_graph` runs
    in this thread, the graph being recorded holds ``resource`` (see :func:`release_graphs`). Returns whether a
    capture is under way.

    >>> hold_in_capture(object())   # no capture under way
    False
    """
    holds = getattr(_CAPTURE, "holds", None)
    if holds is None:
        return False
    if all(r is not resource for r in holds):
        holds.append(resource)
    return True


def release_graphs(resource: Any, why: str) -> int:
    """Free every live captured graph that holds ``resource`` (:func:`hold_in_capture`), so that the resource can
    be destroyed; their :meth:`CapturedGraph.launch` then raises naming ``why``. Returns how many were freed.

    >>> release_graphs(object(), "nothing holds it")
    0
    """
    freed = 0
    for g in list(_LIVE_GRAPHS):
        if g.graph is not None and any(r is resource for r in g.holds):
            g.release(why)
            freed += 1
    return freed


def capture_graph(fn: Any) -> tuple[CapturedGraph, Any]:
    """``(graph, fn())``: the GPU work queued by one call of ``fn()`` recorded as a CUDA graph, NOT run.

    ``fn`` runs on a stream of its own (after the current stream's queued work), in relaxed capture mode, with
    its allocations taken from a new private memory pool. An exception from ``fn`` (or a CUDA call that cannot
    be captured) ends the capture and propagates. Launch the graph (:meth:`CapturedGraph.launch`) to do the work.

    >>> callable(capture_graph)
    True
    """
    if cupy is None:
        raise GPUUnavailableError(f"capture_graph needs CuPy: {_CUPY_IMPORT_ERROR}")
    pool = cupy.cuda.MemoryPool()
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())
    mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", 2)
    outer, _CAPTURE.holds = getattr(_CAPTURE, "holds", None), []
    try:
        with cupy.cuda.using_allocator(pool.malloc), stream:
            stream.begin_capture(mode)
            try:
                result = fn()
            except BaseException:
                try:
                    stream.end_capture()
                except Exception:   # the failed capture is invalidated; ending it is all that is needed
                    pass
                raise
            graph = stream.end_capture()
        captured = CapturedGraph(graph, stream, pool, _CAPTURE.holds)
    finally:
        _CAPTURE.holds = outer
    _LIVE_GRAPHS.add(captured)
    return captured, result
