"""The process group of a data-parallel job: :func:`init` reads the launcher's environment, meets the other ranks
(TCP rendezvous passing rank 0's NCCL unique id), selects the GPU ``LOCAL_RANK`` and builds the NCCL communicator,
with a fault watchdog. A job of one process needs none of it: :func:`init` then gives a group of one whose
collectives do nothing, on the CPU too, so a script runs unchanged with and without the launcher.

>>> g = init()            # no launcher variables: one process
>>> g.rank, g.world_size, g.is_main
(0, 1, True)
>>> import numpy as np
>>> g.all_reduce(np.ones(2))
array([1., 1.])
"""
from __future__ import annotations

import contextlib
from typing import Any

from .base import DONE, DistributedError
from .env import DistributedEnv, read_env
from .rendezvous import DEFAULT_TIMEOUT, rendezvous
from .watchdog import Watchdog

__all__ = ["ProcessGroup", "init", "get_group", "is_initialized", "destroy", "DistributedError"]

_DEFAULT: ProcessGroup | None = None


class ProcessGroup:
    """Rank ``rank`` of ``world_size`` processes, one GPU each, and the collectives between them.

    ``all_reduce(x, op="sum")`` reduces in place and returns ``x``; ``start_all_reduce(x)`` queues it and returns a
    handle whose ``wait()`` makes the current stream wait for it (the host goes on); ``broadcast(x, root=0)``,
    ``broadcast_many(xs, root=0)`` (one launch), ``all_gather(x)`` (``(world_size, *x.shape)``), ``barrier()``.
    Every collective is queued on one stream of the communicator in the order the host calls it, so every rank must
    call the same collectives in the same order
    (as with any NCCL program). Made by :func:`init`; ``comm`` is a :class:`fluxpy.kernels.nccl.NcclComm`, or None in
    a group of one, where every collective returns its input.

    >>> g = ProcessGroup(DistributedEnv(), comm=None)
    >>> g.start_all_reduce(None).done(), g.barrier()
    (True, None)
    """

    def __init__(self, env: DistributedEnv, comm: Any = None, watchdog: Watchdog | None = None) -> None:
        self.env = env
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        self.comm, self.watchdog = comm, watchdog
        if comm is None and env.world_size > 1:
            self._no_collectives = ("this group was made with backend='none' (rendezvous and watchdog only); "
                                    "collectives need backend='nccl' or 'tcp'")
        else:
            self._no_collectives = None

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0: the rank that prints progress and writes checkpoints and plots."""
        return self.rank == 0

    @property
    def device(self) -> int | None:
        """The GPU this rank uses (``LOCAL_RANK`` by default), None in a group of one without NCCL."""
        return None if self.comm is None else self.comm.device

    def _comm(self, who):
        if self._no_collectives:
            raise DistributedError(f"{who}: {self._no_collectives}")
        return self.comm

    def all_reduce(self, x: Any, op: str = "sum") -> Any:
        """``x`` reduced over the ranks (``op``: sum, max, min, prod, avg), in place; ``x`` itself is returned."""
        comm = self._comm("all_reduce")
        if comm is not None and self.world_size > 1:
            self._track(comm.all_reduce(x, op, wait=True, what=f"all_reduce of {_nbytes(x)}"))
        return x

    def start_all_reduce(self, x: Any, op: str = "sum", what: str = "all_reduce") -> Any:
        """Queue ``all_reduce(x)`` without making the caller wait: a handle with ``wait()`` (the current stream waits
        for it) and ``done()``."""
        comm = self._comm("start_all_reduce")
        if comm is None or self.world_size == 1:
            return DONE
        work = comm.all_reduce(x, op, wait=False, what=what)
        self._track(work, what)
        return work

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """Rank ``root``'s ``x`` copied into ``x`` on every rank, in place; ``x`` is returned."""
        comm = self._comm("broadcast")
        if comm is not None and self.world_size > 1:
            self._track(comm.broadcast(x, root, wait=True, what=f"broadcast of {_nbytes(x)}"))
        return x

    def broadcast_many(self, xs: list, root: int = 0) -> list:
        """:meth:`broadcast` of each array of ``xs`` (contiguous), in one launch; ``xs`` is returned."""
        comm = self._comm("broadcast_many")
        if comm is not None and self.world_size > 1 and xs:
            nbytes = sum(getattr(x, "nbytes", 0) for x in xs)
            self._track(comm.broadcast_many(list(xs), root, wait=True,
                                            what=f"broadcast of {len(xs)} arrays ({nbytes} bytes)"))
        return xs

    def all_gather(self, x: Any) -> Any:
        """Every rank's ``x`` stacked on a new leading axis: ``(world_size, *x.shape)``."""
        comm = self._comm("all_gather")
        if comm is None or self.world_size == 1:
            return x[None]
        return comm.all_gather(x)

    def barrier(self) -> None:
        """Return once every rank has reached it (an all-reduce of one number, waited for on the host)."""
        comm = self._comm("barrier")
        if comm is None or self.world_size == 1:
            return
        import numpy as np

        from ..backend import to_gpu
        one = np.ones(1, np.float32) if comm.device is None else to_gpu(np.ones(1, np.float32))
        comm.all_reduce(one, "sum", wait=True, what="barrier")
        comm.synchronize()

    def _track(self, work, what=None):
        from ..capturing import capturing
        if self.watchdog is not None and not capturing():   # a captured collective has no event to ask yet
            self.watchdog.track(work, what or getattr(work, "what", "a collective"))

    def destroy(self) -> None:
        """Leave the job cleanly: finish the queued collectives, free the communicator, tell the peers."""
        if self.comm is not None:
            self.comm.destroy()
        if self.watchdog is not None:
            self.watchdog.close()

    def __repr__(self) -> str:
        dev = f", device={self.device}" if self.device is not None else ""
        return f"ProcessGroup(rank={self.rank}, world_size={self.world_size}{dev})"


def _nbytes(x):
    n = getattr(x, "nbytes", 0)
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def init(*, backend: str = "auto", timeout: float = DEFAULT_TIMEOUT, collective_timeout: float = 600.0,
         device: int | None = None, environ: Any = None) -> ProcessGroup:
    """Join the job the launcher started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``, as ``python -m fluxpy.distributed.run``, ``torchrun`` and Slurm wrappers set them) and return
    its :class:`ProcessGroup`, which also becomes the default group (:func:`get_group`). Calling it again returns
    that group.

    With ``WORLD_SIZE`` > 1: rank 0 makes an NCCL unique id; the TCP rendezvous (:func:`rendezvous`, ``timeout``
    seconds, an error naming the ranks that did not arrive) passes it to every rank; each rank selects GPU
    ``device`` (``LOCAL_RANK`` by default) and joins the NCCL communicator. A watchdog thread then ends this process
    with an error naming the rank (``fluxpy.distributed: rank 1 raised RuntimeError: ...; rank 0 exits``) when
    another rank dies or raises, or when a collective has not finished after ``collective_timeout`` seconds, instead
    of hanging. ``backend``: ``'nccl'`` (GPUs), ``'tcp'`` (NumPy arrays between processes through rank 0, slowly:
    tests and machines without GPUs, :mod:`fluxpy.distributed.tcp`), ``'auto'`` (the default: NCCL where CuPy has it
    and a GPU is there, else tcp), ``'none'`` (the rendezvous and the watchdog only, no collectives).
    Without the variables (or ``WORLD_SIZE=1``): a group of one, no rendezvous, no GPU needed.

    >>> init().world_size
    1
    """
    global _DEFAULT
    if _DEFAULT is not None:
        return _DEFAULT
    if backend not in ("auto", "nccl", "tcp", "none"):
        raise ValueError(f"init: backend must be 'auto', 'nccl', 'tcp' or 'none', got {backend!r}")
    env = read_env(environ)
    if env.world_size == 1:
        _DEFAULT = ProcessGroup(env)
        return _DEFAULT
    from ..kernels import nccl
    if backend == "auto":
        backend = "nccl" if nccl.nccl_available()[0] else "tcp"
    if backend == "nccl":
        ok, why = nccl.nccl_available()
        if not ok:
            raise DistributedError(f"init: rank {env.rank} of {env.world_size} cannot use NCCL ({why}); "
                                   "data-parallel jobs of more than one process need one GPU each")
    if backend == "nccl":
        nccl.use_device(env.local_rank if device is None else device)
    uid = nccl.unique_id() if env.rank == 0 and backend == "nccl" else None
    if env.rank == 0 and uid is None:
        uid = b""
    meeting = rendezvous(env.rank, env.world_size, env.master_addr, env.master_port, payload=uid, timeout=timeout)
    holder: dict = {}
    dog = Watchdog(meeting, abort=lambda: holder["comm"].abort() if "comm" in holder else None,
                   async_error=lambda: holder["comm"].async_error() if "comm" in holder else None,
                   collective_timeout=collective_timeout)
    dog.start()                 # a rank that dies while the others build the communicator must not hang them
    dog.install_excepthook()
    comm = None
    if backend == "nccl":
        comm = holder["comm"] = nccl.NcclComm(meeting.payload, env.rank, env.world_size,
                                              env.local_rank if device is None else device)
    elif backend == "tcp":
        from .tcp import TcpComm
        comm = TcpComm(meeting, dog, timeout=collective_timeout)
    _DEFAULT = ProcessGroup(env, comm, dog)
    return _DEFAULT


def get_group() -> ProcessGroup:
    """The default group: the one :func:`init` made (it calls :func:`init` if nothing did yet).

    >>> get_group() is init()
    True
    """
    return _DEFAULT if _DEFAULT is not None else init()


def is_initialized() -> bool:
    """Whether :func:`init` has made the default group.

    >>> _ = init(); is_initialized()
    True
    """
    return _DEFAULT is not None


def destroy() -> None:
    """Leave the job cleanly and forget the default group (a later :func:`init` meets the ranks again).

    >>> _ = init(); destroy(); is_initialized()
    False
    """
    global _DEFAULT
    group, _DEFAULT = _DEFAULT, None
    if group is not None:
        with contextlib.suppress(Exception):
            group.destroy()
