"""Process groups of threads in one process, for tests and examples without GPUs: :func:`local_groups`.

Each thread plays one rank; the collectives meet at a barrier and compute with NumPy (or whatever arrays they are
given), in place, synchronously, with the same semantics as NCCL's: every rank must call the same collectives, of
the same shapes and dtypes, in the same order; a rank that does not arrive within ``timeout`` seconds, or that
calls a different collective, makes every rank raise :class:`DistributedError` naming it. ``log`` records each
rank's collectives in order.

>>> import threading, numpy as np
>>> groups = local_groups(2)
>>> out = [None, None]
>>> def rank(r):
...     out[r] = groups[r].all_reduce(np.array([r + 1.0]))
>>> threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
>>> for t in threads: t.start()
>>> for t in threads: t.join()
>>> out
[array([3.]), array([3.])]
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..backend import get_array_module
from .env import DistributedEnv
from .base import HostComm
from .group import DONE, DistributedError, ProcessGroup

__all__ = ["local_groups", "ThreadComm"]


class _Meeting:
    def __init__(self, world_size, timeout):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list = [None] * world_size
        self.timeout = timeout


class ThreadComm(HostComm):
    """One rank's side of a :class:`_Meeting` (what :class:`ProcessGroup` calls as its communicator).

    >>> ThreadComm(_Meeting(1, 1.0), 0).all_reduce(np.ones(1), "sum").done()
    True
    """

    device = None

    def __init__(self, meeting: _Meeting, rank: int) -> None:
        self.meeting, self.rank, self.world_size = meeting, rank, meeting.world_size
        self.log: list[tuple[str, str, tuple]] = []

    def _meet(self, what, x):
        """Deposit ``(what, shape, dtype, x)`` and return every rank's deposit, once all have arrived."""
        m = self.meeting
        key = (what, tuple(x.shape), str(x.dtype))
        self.log.append(key)
        m.slots[self.rank] = (key, x)
        self._wait(what)
        deposits = list(m.slots)
        keys = [d[0] for d in deposits]
        if any(k != keys[0] for k in keys):
            bad = [r for r, k in enumerate(keys) if k != keys[0]]
            self._wait(what)
            raise DistributedError(f"rank {self.rank}: ranks called different collectives: rank 0 {keys[0]}, "
                                   + ", ".join(f"rank {r} {keys[r]}" for r in bad))
        return [d[1] for d in deposits]

    def _wait(self, what):
        try:
            self.meeting.barrier.wait()
        except threading.BrokenBarrierError:
            raise DistributedError(f"rank {self.rank}: {what} did not complete in {self.meeting.timeout:g} s; another "
                                   "rank did not join it") from None

    def all_reduce(self, x: Any, op: str = "sum", *, wait: bool = True, what: str = "all_reduce") -> Any:
        xs = self._meet(f"all_reduce({op})", x)
        xp = get_array_module(x)
        reduce = {"sum": xp.add, "max": xp.maximum, "min": xp.minimum, "prod": xp.multiply}
        if op == "avg":
            total = sum(a.astype(np.float64) for a in xs) / len(xs)
        else:
            total = xs[0].copy()
            for a in xs[1:]:
                total = reduce[op](total, a)
        self._wait(what)          # everyone has read every input before anyone writes
        x[...] = total
        return DONE

    def broadcast(self, x: Any, root: int = 0, *, wait: bool = True, what: str = "broadcast") -> Any:
        xs = self._meet(f"broadcast(root={root})", x)
        src = xs[root].copy()
        self._wait(what)
        x[...] = src
        return DONE

    def all_gather(self, x: Any) -> Any:
        xs = self._meet("all_gather", x)
        out = get_array_module(x).stack([a.copy() for a in xs])
        self._wait("all_gather")
        return out

    def synchronize(self) -> None:
        return None

    def destroy(self) -> None:
        return None

    def abort(self) -> None:
        self.meeting.barrier.abort()


def local_groups(world_size: int, timeout: float = 30.0) -> list[ProcessGroup]:
    """``world_size`` :class:`ProcessGroup` objects whose collectives meet between threads of this process.

    >>> [g.rank for g in local_groups(3)]
    [0, 1, 2]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"local_groups: world_size must be an int >= 1, got {world_size!r}")
    meeting = _Meeting(world_size, timeout)
    return [ProcessGroup(DistributedEnv(rank=r, world_size=world_size, local_rank=r), ThreadComm(meeting, r))
            for r in range(world_size)]
