"""What fluxpy does with Python's cyclic garbage collector while it trains, and why.

A training step makes thousands of short-lived objects (tape nodes, closures, tuples). Reference counting frees
them (the tape is acyclic), but their allocations trigger the cyclic collector, which now and then scans every
object of the process: with a large library such as PyTorch imported, that scan can take longer than a whole
training step, and it lands in the middle of one every few dozen steps. Two policies, each on while any user of it runs
(nested calls and threads count; the last to end restores what was there):

- :data:`paused_while_recording`: the collector is off while a tape is alive (``gradient`` and friends), so
  collections happen between steps, when the tape is gone, and never promote a live tape;
- :data:`frozen_while_training`: the objects alive when :func:`fluxpy.train` starts (modules, data, the model)
  are moved out of the collector's scans (``gc.freeze``) until it ends (``gc.unfreeze``).

>>> import gc
>>> with paused_while_recording:
...     paused = not gc.isenabled()
>>> paused, gc.isenabled()
(True, True)
"""
from __future__ import annotations

import gc
import threading
from collections.abc import Callable

__all__ = ["WhileAnyRuns", "paused_while_recording", "frozen_while_training"]


class WhileAnyRuns:
    """A context manager that calls ``begin()`` when the first of its (nested or concurrent) uses starts and
    ``end(begin's result)`` when the last one ends.

    >>> calls = []
    >>> policy = WhileAnyRuns(lambda: calls.append("begin"), lambda _: calls.append("end"))
    >>> with policy:
    ...     with policy:
    ...         pass
    >>> calls
    ['begin', 'end']
    """

    def __init__(self, begin: Callable[[], object], end: Callable[[object], None]) -> None:
        self._begin, self._end = begin, end
        self._lock = threading.Lock()
        self._users = 0
        self._saved = None

    def __enter__(self) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = self._begin()
            self._users += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._end(self._saved)


def _pause():
    enabled = gc.isenabled()
    gc.disable()
    return enabled


def _resume(was_enabled):
    if was_enabled:
        gc.enable()


paused_while_recording = WhileAnyRuns(_pause, _resume)
frozen_while_training = WhileAnyRuns(gc.freeze, lambda _: gc.unfreeze())
