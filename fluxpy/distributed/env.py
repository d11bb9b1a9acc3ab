"""The launcher's environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.

These are the variables ``torchrun``, Slurm wrappers and ``python -m fluxpy.distributed.run`` set, so any of
them can start a fluxpy job. Nothing here touches a device.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_ADDR = "127.0.0.1"
DEFAULT_PORT = 29500


class DistributedEnvError(ValueError):
    """A launcher variable is missing or malformed; the message names it, the expected form and the value got.

    >>> issubclass(DistributedEnvError, ValueError)
    True
    """


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process stands in a job: its ``rank`` of ``world_size``, its ``local_rank`` on its machine
    (the GPU it should use), and rank 0's rendezvous address ``master_addr:master_port``.

    >>> env = DistributedEnv(rank=1, world_size=2, local_rank=1, master_addr="127.0.0.1", master_port=29500)
    >>> env.is_main, env.shard
    (False, (1, 2))
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = DEFAULT_ADDR
    master_port: int = DEFAULT_PORT

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the one that logs and saves checkpoints).

        >>> DistributedEnv().is_main
        True
        """
        return self.rank == 0

    @property
    def shard(self) -> tuple[int, int]:
        """``(rank, world_size)``, as ``DataLoader(..., shard=...)`` takes it.

        >>> DistributedEnv().shard
        (0, 1)
        """
        return (self.rank, self.world_size)


def read_env(environ: Mapping[str, str] | None = None) -> DistributedEnv:
    """The :class:`DistributedEnv` described by ``environ`` (``os.environ`` by default).

    None of the variables set: one process, ``DistributedEnv()`` (rank 0 of 1, ``127.0.0.1:29500``).
    Otherwise ``RANK`` and ``WORLD_SIZE`` are required together (ints, ``0 <= RANK < WORLD_SIZE``);
    ``LOCAL_RANK`` defaults to ``RANK`` (one machine); ``MASTER_ADDR`` and ``MASTER_PORT`` (1..65535) are
    required when ``WORLD_SIZE > 1``. A bad or missing variable is a :class:`DistributedEnvError` naming it,
    the form expected and the value got.

    >>> read_env({})
    DistributedEnv(rank=0, world_size=1, local_rank=0, master_addr='127.0.0.1', master_port=29500)
    >>> read_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}).shard
    (1, 2)
    >>> read_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    Traceback (most recent call last):
    ...
    fluxpy.distributed.env.DistributedEnvError: RANK must be an int with 0 <= RANK < WORLD_SIZE (2), got '2'
    """
    environ = os.environ if environ is None else environ
    if not any(name in environ for name in VARIABLES):
        return DistributedEnv()
    for name in ("RANK", "WORLD_SIZE"):
        if name not in environ:
            present = ", ".join(n for n in VARIABLES if n in environ)
            raise DistributedEnvError(f"{name} is not set but {present} is: a launcher sets RANK and WORLD_SIZE "
                                      "together (torchrun, srun wrappers, python -m fluxpy.distributed.run)")
    world_size = _int(environ, "WORLD_SIZE", 1, None, "an int >= 1")
    rank = _int(environ, "RANK", 0, world_size - 1, f"an int with 0 <= RANK < WORLD_SIZE ({world_size})")
    local_rank = rank
    if "LOCAL_RANK" in environ:
        local_rank = _int(environ, "LOCAL_RANK", 0, world_size - 1,
                          f"an int with 0 <= LOCAL_RANK < WORLD_SIZE ({world_size})")
    addr, port = _master(environ, world_size)
    return DistributedEnv(rank, world_size, local_rank, addr, port)


def _master(environ, world_size):
    """``(MASTER_ADDR, MASTER_PORT)``: required when there is more than one rank, else defaults."""
    if world_size > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in environ:
                raise DistributedEnvError(f"{name} is not set; with WORLD_SIZE={world_size} every rank needs rank "
                                          "0's address (MASTER_ADDR, a host name or IP) and port (MASTER_PORT)")
    addr = environ.get("MASTER_ADDR", DEFAULT_ADDR)
    if not addr or addr != addr.strip() or any(c.isspace() for c in addr):
        raise DistributedEnvError(f"MASTER_ADDR must be a host name or IP address without spaces, got {addr!r}")
    port = DEFAULT_PORT
    if "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT", 1, 65535, "an int port number in 1..65535")
    return addr, port


def _int(environ, name, low, high, form):
    text = environ[name]
    try:
        value = int(text.strip())
    except (ValueError, AttributeError):
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise DistributedEnvError(f"{name} must be {form}, got {text!r}")
    return value
