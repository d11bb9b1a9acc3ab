"""What the process group and its backends share: :class:`DistributedError` and the handle of a finished
collective, :data:`DONE`.

>>> DONE.done()
True
"""
from __future__ import annotations

__all__ = ["DistributedError", "DONE"]


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
