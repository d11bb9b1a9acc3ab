"""Collectives of NumPy arrays between processes over the rendezvous connections: the ``tcp`` backend of
:func:`fluxpy.distributed.init`, for jobs without GPUs (tests, CI, a laptop). Slow, and meant to be: rank 0 is the
hub (every rank sends it its array; it reduces and sends the result back), the arrays travel as raw bytes in
``D`` frames of at most :data:`CHUNK` bytes, handed over by the watchdog thread that reads the connections.

Same rules as NCCL: every rank calls the same collectives, of the same shapes and dtypes, in the same order; a
mismatch is a :class:`DistributedError` naming the ranks; a rank that does not take part within ``timeout`` seconds
is one too.

>>> TcpComm.device is None
True
"""
from __future__ import annotations

import queue
import struct
from typing import Any

import numpy as np

from .base import DONE, DistributedError, HostComm
from .rendezvous import Group, _send
from .watchdog import DATA, Watchdog

__all__ = ["TcpComm", "CHUNK"]

CHUNK = 1 << 19
_HEAD = struct.Struct(">QH")   # payload bytes, length of the key text


class TcpComm(HostComm):
    """Rank ``group.rank``'s side of the tcp backend over the rendezvous ``group`` (whose frames ``watchdog``
    reads). ``all_reduce``, ``broadcast`` and ``broadcast_many`` (root 0), ``all_gather``, as :class:`ProcessGroup`
    calls them; NumPy arrays only.

    >>> callable(TcpComm.all_reduce)
    True
    """

    device = None

    def __init__(self, group: Group, watchdog: Watchdog, timeout: float = 600.0) -> None:
        self.group, self.watchdog, self.timeout = group, watchdog, float(timeout)
        self.rank, self.world_size = group.rank, group.world_size

    # -- frames -------------------------------------------------------------------------------------------

    def _send(self, peer, key, payload):
        head = _HEAD.pack(len(payload), len(key)) + key.encode()
        sock = self.group.peers[peer]
        with self.watchdog.send_lock:
            _send(sock, DATA + head)
            for i in range(0, len(payload), CHUNK):
                _send(sock, DATA + payload[i:i + CHUNK])

    def _recv(self, peer, what):
        box = self.watchdog.inbox(peer)
        head = self._get(box, peer, what)
        size, nkey = _HEAD.unpack(head[:_HEAD.size])
        key = head[_HEAD.size:_HEAD.size + nkey].decode()
        parts, got = [], 0
        while got < size:
            part = self._get(box, peer, what)
            parts.append(part)
            got += len(part)
        return key, b"".join(parts)

    def _get(self, box, peer, what):
        try:
            return box.get(timeout=self.timeout)
        except queue.Empty:
            raise DistributedError(f"rank {self.rank}: {what} did not complete in {self.timeout:g} s; rank {peer} did "
                                   "not take part") from None

    @staticmethod
    def _key(kind, x):
        return f"{kind} {tuple(x.shape)} {x.dtype.str}"

    def _check(self, x, who):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{who}: the tcp backend moves NumPy arrays, got {type(x).__name__}; GPU arrays need "
                            "init(backend='nccl')")

    def _gather_at_root(self, key, x, what):
        """Rank 0: every rank's array (its own first), after checking that all called the same collective."""
        arrays = [x]
        for peer in range(1, self.world_size):
            theirs, payload = self._recv(peer, what)
            if theirs != key:
                raise DistributedError(f"{what}: ranks called different collectives: rank 0 {key}, rank {peer} "
                                       f"{theirs}")
            arrays.append(np.frombuffer(payload, dtype=x.dtype).reshape(x.shape))
        return arrays

    def _from_root(self, key, x, what):
        theirs, payload = self._recv(0, what)
        if theirs != key:
            raise DistributedError(f"{what}: ranks called different collectives: rank 0 {theirs}, rank {self.rank} "
                                   f"{key}")
        return payload

    # -- collectives --------------------------------------------------------------------------------------

    def all_reduce(self, x: Any, op: str = "sum", *, wait: bool = True, what: str = "all_reduce") -> Any:
        self._check(x, "all_reduce")
        key = self._key(f"all_reduce({op})", x)
        contiguous = np.ascontiguousarray(x)
        if self.rank == 0:
            arrays = self._gather_at_root(key, contiguous, what)
            if op in ("sum", "avg"):
                total = np.sum(np.stack(arrays).astype(np.float64 if x.dtype.kind == "f" else x.dtype), axis=0)
                total = total / len(arrays) if op == "avg" else total
            else:
                reduce = {"max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
                total = arrays[0]
                for a in arrays[1:]:
                    total = reduce(total, a)
            result = np.ascontiguousarray(np.asarray(total).astype(x.dtype))
            for peer in range(1, self.world_size):
                self._send(peer, key, result.tobytes())
            x[...] = result
        else:
            self._send(0, key, contiguous.tobytes())
            x[...] = np.frombuffer(self._from_root(key, x, what), dtype=x.dtype).reshape(x.shape)
        return DONE

    def broadcast(self, x: Any, root: int = 0, *, wait: bool = True, what: str = "broadcast") -> Any:
        self._check(x, "broadcast")
        if root != 0:
            raise NotImplementedError("the tcp backend broadcasts from rank 0 only")
        key = self._key("broadcast", x)
        if self.rank == 0:
            payload = np.ascontiguousarray(x).tobytes()
            for peer in range(1, self.world_size):
                self._send(peer, key, payload)
        else:
            x[...] = np.frombuffer(self._from_root(key, x, what), dtype=x.dtype).reshape(x.shape)
        return DONE

    def all_gather(self, x: Any) -> Any:
        self._check(x, "all_gather")
        key = self._key("all_gather", x)
        contiguous = np.ascontiguousarray(x)
        if self.rank == 0:
            out = np.stack([a.copy() for a in self._gather_at_root(key, contiguous, "all_gather")])
            for peer in range(1, self.world_size):
                self._send(peer, key, out.tobytes())
            return out
        self._send(0, key, contiguous.tobytes())
        payload = self._from_root(key, x, "all_gather")
        return np.frombuffer(payload, dtype=x.dtype).reshape((self.world_size,) + tuple(x.shape)).copy()

    def synchronize(self) -> None:
        return None

    def destroy(self) -> None:
        return None

    def abort(self) -> None:
        return None
