"""What code running inside a CUDA-graph capture must know: whether a capture is under way, how to keep host-side
state in step with the replays, and how to refuse.

A captured training step (:class:`fluxpy.TrainStep`) runs the Python code of a step once, while the GPU work it
queues is recorded into a graph; later steps replay the graph and run no Python at all. Two kinds of host-side
work need care:

- bookkeeping that each step must advance on the host too (an optimiser's counters, ``beta^t`` or a step count,
  which its kernels read and advance on the device and the state mirrors on the host): the code registers it
  with :func:`on_replay`, and the step runs it after every replay;
- values that a step computes on the host and hands to a kernel as a number (which the graph would freeze at
  the captured value): such code calls :func:`refuse` while capturing, naming itself, and the step runs eagerly
  with a warning instead.

Outside a capture, :func:`on_replay` and :func:`refuse` do nothing.

>>> capturing()
False
>>> with recording() as hooks:
...     on_replay(lambda: None)
...     capturing()
True
>>> len(hooks)
1
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["capturing", "on_replay", "refuse", "recording", "CaptureUnsupported", "guarding", "current_guard"]

_hooks: contextvars.ContextVar[list | None] = contextvars.ContextVar("fluxpy_capture_hooks", default=None)
_guard: contextvars.ContextVar = contextvars.ContextVar("fluxpy_update_guard", default=None)


class CaptureUnsupported(RuntimeError):
    """Raised inside a capture by code whose work cannot be replayed from a graph; the message names it and why.

    >>> str(CaptureUnsupported("Adam (a parameter stepped alone): its bias correction is a host number"))
    'Adam (a parameter stepped alone): its bias correction is a host number'
    """


def capturing() -> bool:
    """Whether a CUDA-graph capture of a step is under way in this thread (or asyncio task).

    >>> capturing()
    False
    >>> with recording():
    ...     print(capturing())
    True
    """
    return _hooks.get() is not None


def on_replay(hook: Callable[[], None]) -> None:
    """While capturing, have ``hook()`` run on the host after every replay of the graph; otherwise nothing.

    >>> with recording() as hooks:
    ...     on_replay(lambda: print("replayed"))
    >>> for hook in hooks:
    ...     hook()
    replayed
    """
    hooks = _hooks.get()
    if hooks is not None:
        hooks.append(hook)


def refuse(what: str) -> None:
    """While capturing, raise :class:`CaptureUnsupported` with ``what`` (who refuses and why); otherwise nothing.

    >>> refuse("a host number")   # not capturing: nothing happens
    >>> with recording():
    ...     refuse("dropout: a host-side generator")
    Traceback (most recent call last):
    ...
    fluxpy.capturing.CaptureUnsupported: dropout: a host-side generator
    """
    if _hooks.get() is not None:
        raise CaptureUnsupported(what)


@contextmanager
def guarding(flag) -> Iterator[None]:
    """Within the block, optimiser updates run only where the device scalar ``flag`` is finite (a captured step
    checked on the device: the update of a step whose loss or gradients are not finite is skipped, there being
    no host to ask). Inside another ``guarding`` block both flags must be finite (the guard is their sum). An
    update that cannot skip itself on the device refuses capture (:func:`refuse`).

    >>> with guarding(0.0):
    ...     current_guard()
    0.0
    >>> with guarding(1.0), guarding(float("nan")):
    ...     current_guard()
    nan
    >>> current_guard() is None
    True
    """
    outer = _guard.get()
    token = _guard.set(flag if outer is None else outer + flag)
    try:
        yield
    finally:
        _guard.reset(token)


def current_guard():
    """The device flag of the innermost :func:`guarding` block, or None."""
    return _guard.get()


@contextmanager
def recording() -> Iterator[list]:
    """Mark this thread as capturing; yields the list that :func:`on_replay` fills.

    >>> with recording() as hooks:
    ...     on_replay(print)
    >>> len(hooks), capturing()
    (1, False)
    """
    hooks: list = []
    token = _hooks.set(hooks)
    try:
        yield hooks
    finally:
        _hooks.reset(token)
