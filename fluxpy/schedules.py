"""Learning-rate schedules in the spirit of ParameterSchedulers.jl: :class:`Step`, :class:`Cosine` (with warm-up),
:class:`Exp`, :class:`Constant`.

A schedule is a small immutable callable: ``schedule(t)`` is the value at epoch (or step) ``t``,
counted from 1 as in ParameterSchedulers.jl and fluxpy's examples. Give it to :func:`fluxpy.train`
(``train(..., schedule=Cosine(...), schedule_per="epoch")`` or ``"step"``), or set it on an optimiser's state
yourself with :func:`fluxpy.optimise.adjust` before each epoch (or step):

>>> import numpy as np
>>> from fluxpy.optimise import Momentum, adjust, setup
>>> schedule = Step(0.1, 0.5, [2, 1])
>>> [schedule(t) for t in range(1, 6)]
[0.1, 0.1, 0.05, 0.025, 0.025]
>>> state = setup(Momentum(schedule(1), 0.9), {"w": np.zeros(2)})
>>> adjust(state, eta=schedule(3))["w"].rule.eta
0.05
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
from collections.abc import Sequence

__all__ = ["Step", "Cosine", "Exp", "Constant"]


@dataclasses.dataclass(frozen=True)
class Step:
    """Step decay: ``start``, multiplied by ``decay`` at the end of every stage of ``step_sizes`` epochs (or steps).

    ``step_sizes`` is an int ``k`` (decay every ``k``: ``start * decay ** ((t - 1) // k)``) or a
    sequence of stage lengths ``(s1, s2, ...)``: ``start`` for ``t`` in ``1..s1``, ``start * decay``
    for the next ``s2``, and so on; after the last stage the value stays at
    ``start * decay ** len(step_sizes)``. He et al.'s CIFAR ResNets (lr 0.1, divided by 10 at 32k and
    48k of 64k iterations) over 160 epochs: ``Step(0.1, 0.1, [80, 40])``.

    >>> s = Step(1.0, 0.5, 2)
    >>> [s(t) for t in range(1, 7)]
    [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    >>> Step(0.1, 0.1, [80, 40])
    Step(start=0.1, decay=0.1, step_sizes=(80, 40))
    >>> Step(0.1, 0.1, [80, 0])
    Traceback (most recent call last):
    ...
    ValueError: Step expects step_sizes to be an int >= 1 or a non-empty sequence of them, got [80, 0]
    """
    start: float
    decay: float
    step_sizes: int | tuple[int, ...]

    def __post_init__(self):
        _check_value(self, "start", self.start)
        _check_value(self, "decay", self.decay)
        sizes = self.step_sizes
        one = _is_int(sizes) and sizes >= 1
        many = isinstance(sizes, Sequence) and not isinstance(sizes, str) and len(sizes) > 0 and \
            all(_is_int(s) and s >= 1 for s in sizes)
        if not (one or many):
            raise ValueError(f"Step expects step_sizes to be an int >= 1 or a non-empty sequence of them, "
                             f"got {sizes!r}")
        object.__setattr__(self, "step_sizes", int(sizes) if one else tuple(int(s) for s in sizes))
        object.__setattr__(self, "_ends", None if one else tuple(_cumsum(self.step_sizes)))

    def __call__(self, t: int) -> float:
        t = _check_t(self, t)
        if isinstance(self.step_sizes, int):
            decays = (t - 1) // self.step_sizes
        else:
            decays = bisect.bisect_left(self._ends, t)  # the stages that ended before t
        return self.start * self.decay ** decays


@dataclasses.dataclass(frozen=True)
class Cosine:
    """Cosine annealing from ``start`` down to ``stop`` over ``period`` epochs (or steps), after an optional linear
    warm-up of ``warmup`` epochs.

    During the warm-up (``t = 1 .. warmup``) the value rises linearly, ``start * t / (warmup + 1)``,
    so it reaches ``start`` at ``t = warmup + 1``, the first of the ``period`` annealing epochs:
    ``stop + (start - stop) * (1 + cos(pi * s / (period - 1))) / 2`` with ``s = t - warmup - 1``,
    from ``start`` at ``s = 0`` to ``stop`` at the last (``period=1``: ``start``). After that it
    stays at ``stop``. A run of ``E`` epochs: ``Cosine(lr, lr / 100, E - w, warmup=w)``.

    >>> s = Cosine(1.0, 0.0, 3)
    >>> [s(t) for t in range(1, 5)]
    [1.0, 0.5, 0.0, 0.0]
    >>> w = Cosine(0.4, 0.0, 3, warmup=3)
    >>> [round(w(t), 3) for t in range(1, 8)]
    [0.1, 0.2, 0.3, 0.4, 0.2, 0.0, 0.0]
    >>> w(0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Cosine(start=0.4, ...) expects t to be an int >= 1 (the first epoch or step is 1), got 0
    """
    start: float
    stop: float
    period: int
    warmup: int = dataclasses.field(default=0, kw_only=True)

    def __post_init__(self):
        _check_value(self, "start", self.start)
        _check_value(self, "stop", self.stop, positive=False)
        for name, low in (("period", 1), ("warmup", 0)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"Cosine expects {name} to be an int >= {low}, got {value!r}")

    def __call__(self, t: int) -> float:
        t = _check_t(self, t)
        if t <= self.warmup:
            return self.start * t / (self.warmup + 1)
        s = t - self.warmup - 1
        if s == 0:
            return self.start
        if s >= self.period - 1:
            return self.stop
        return self.stop + (self.start - self.stop) * (1 + math.cos(math.pi * s / (self.period - 1))) / 2


@dataclasses.dataclass(frozen=True)
class Exp:
    """Exponential decay: ``start * decay ** (t - 1)`` (ParameterSchedulers.jl's ``Exp``), never below ``floor``.

    >>> s = Exp(1.0, 0.5)
    >>> [s(t) for t in range(1, 5)]
    [1.0, 0.5, 0.25, 0.125]
    >>> Exp(1.0, 0.1, floor=0.05)(4)
    0.05
    """
    start: float
    decay: float
    floor: float = dataclasses.field(default=0.0, kw_only=True)

    def __post_init__(self):
        _check_value(self, "start", self.start)
        _check_value(self, "floor", self.floor, positive=False)
        if not (isinstance(self.decay, numbers.Real) and not isinstance(self.decay, bool) and 0 < self.decay <= 1):
            raise ValueError(f"Exp expects decay in (0, 1], got {self.decay!r}")

    def __call__(self, t: int) -> float:
        t = _check_t(self, t)
        return max(self.start * self.decay ** (t - 1), self.floor)


@dataclasses.dataclass(frozen=True)
class Constant:
    """The same ``value`` at every epoch (or step): no schedule, in the schedules' form.

    >>> Constant(0.01)(1), Constant(0.01)(1000)
    (0.01, 0.01)
    """
    value: float

    def __post_init__(self):
        _check_value(self, "value", self.value, positive=False)

    def __call__(self, t: int) -> float:
        _check_t(self, t)
        return self.value


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_value(schedule, name, value, positive=True):
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and \
        (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{type(schedule).__name__} expects {name} to be a finite number "
                         f"{'> 0' if positive else '>= 0'}, got {value!r}")


def _check_t(schedule, t):
    if not _is_int(t) or t < 1:
        raise ValueError(f"{schedule!r} expects t to be an int >= 1 (the first epoch or step is 1), got {t!r}")
    return int(t)


def _cumsum(sizes):
    total = 0
    for s in sizes:
        total += s
        yield total
