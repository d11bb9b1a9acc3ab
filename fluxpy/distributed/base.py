"""What the process group and its backends share: :class:`DistributedError`, the handle of a finished
collective, :data:`DONE`, and :class:`HostComm`, what the host-side backends (threads, tcp) have in common.

>>> DONE.done()
True
"""
from __future__ import annotations

__all__ = ["DistributedError", "DONE", "HostComm"]


class DistributedError(RuntimeError):
    """A collective was used wrongly or the ranks disagree (model structure, collective order); the message names
    the ranks.

    >>> issubclass(DistributedError, RuntimeError)
    True
    """


class _Done:
    """The handle of a collective that has nothing to wait for (a group of one)."""
    __slots__ = ()

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


DONE = _Done()


class HostComm:
    """The part of a host-side communicator (ranks as threads, the tcp backend) written once: ``broadcast_many`` as
    one ``broadcast`` per array, in order (NCCL's backend groups them into one launch instead).

    >>> hasattr(HostComm, "broadcast_many")
    True
    """

    def broadcast_many(self, xs: list, root: int = 0, *, wait: bool = True, what: str = "broadcast"):
        for x in xs:
            self.broadcast(x, root, what=what)
        return DONE
