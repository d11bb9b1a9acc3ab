"""Learning-rate schedules in the spirit of ParameterSchedulers.jl: :class:`Step`, :class:`Cosine` (with warm-up),
:class:`Exp`, :class:`Constant`, :class:`Poly`, :class:`Triangle`, :class:`CosineRestarts` (SGDR),
:class:`OneCycle` and :class:`Sequence` (schedules one after another); and, driven by a measured value rather than
the epoch, :class:`ReduceOnPlateau` and :class:`EarlyStopping`.

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
from collections import abc

__all__ = ["Step", "Cosine", "Exp", "Constant", "Poly", "Triangle", "CosineRestarts", "OneCycle", "Sequence",
           "ReduceOnPlateau", "EarlyStopping"]


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
        many = isinstance(sizes, abc.Sequence) and not isinstance(sizes, str) and len(sizes) > 0 and \
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
        _check_int(self, "period", self.period, 1)
        _check_int(self, "warmup", self.warmup, 0)

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


@dataclasses.dataclass(frozen=True)
class Poly:
    """Polynomial decay to 0 over ``max_iter`` epochs (or steps): ``start * (1 - (t - 1) / max_iter) ** degree``,
    then 0 (ParameterSchedulers.jl's ``Poly``; PyTorch's ``PolynomialLR`` with ``total_iters=max_iter``).

    >>> s = Poly(1.0, 2, 4)
    >>> [s(t) for t in range(1, 6)]
    [1.0, 0.5625, 0.25, 0.0625, 0.0]
    """
    start: float
    degree: float
    max_iter: int

    def __post_init__(self):
        _check_value(self, "start", self.start)
        _check_value(self, "degree", self.degree)
        _check_int(self, "max_iter", self.max_iter, 1)

    def __call__(self, t: int) -> float:
        t = _check_t(self, t)
        return self.start * max(0.0, 1 - (t - 1) / self.max_iter) ** self.degree


@dataclasses.dataclass(frozen=True)
class Triangle:
    """A triangle wave between ``start`` and ``peak`` of ``period`` epochs (or steps): ``start`` at ``t = 1``,
    ``peak`` half a period later, ``start`` again after a whole one (PyTorch's ``CyclicLR(mode="triangular")`` with
    ``step_size_up = period / 2``; ParameterSchedulers.jl's ``Triangle``).

    >>> s = Triangle(0.0, 1.0, 4)
    >>> [s(t) for t in range(1, 7)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.5]
    """
    start: float
    peak: float
    period: int

    def __post_init__(self):
        _check_value(self, "start", self.start, positive=False)
        _check_value(self, "peak", self.peak, positive=False)
        _check_int(self, "period", self.period, 2)

    def __call__(self, t: int) -> float:
        phase = ((_check_t(self, t) - 1) % self.period) / self.period
        return self.start + (self.peak - self.start) * (1 - abs(2 * phase - 1))


@dataclasses.dataclass(frozen=True)
class CosineRestarts:
    """Cosine annealing with warm restarts (SGDR; PyTorch's ``CosineAnnealingWarmRestarts(T_0=period,
    T_mult=mult, eta_min=stop)``): within a cycle of ``T`` epochs (or steps), ``stop + (start - stop) * (1 +
    cos(pi * s / T)) / 2`` for ``s = 0 .. T - 1``; the first cycle has ``period``, each next one ``mult`` times more.

    >>> s = CosineRestarts(1.0, 0.0, 2, mult=2)
    >>> [round(s(t), 3) for t in range(1, 8)]
    [1.0, 0.5, 1.0, 0.854, 0.5, 0.146, 1.0]
    """
    start: float
    stop: float
    period: int
    mult: int = dataclasses.field(default=1, kw_only=True)

    def __post_init__(self):
        _check_value(self, "start", self.start)
        _check_value(self, "stop", self.stop, positive=False)
        _check_int(self, "period", self.period, 1)
        _check_int(self, "mult", self.mult, 1)

    def __call__(self, t: int) -> float:
        s, length = _check_t(self, t) - 1, self.period
        while s >= length:
            s, length = s - length, length * self.mult
        return self.stop + (self.start - self.stop) * (1 + math.cos(math.pi * s / length)) / 2


@dataclasses.dataclass(frozen=True)
class OneCycle:
    """The one-cycle policy over ``total`` steps (PyTorch's ``OneCycleLR`` with cosine annealing and
    ``three_phase=False``; ParameterSchedulers.jl's ``OneCycle``): from ``peak / start_div`` up to ``peak`` over the
    first ``pct_start`` of the steps, then down to ``peak / start_div / final_div``, each phase a half cosine.

    >>> s = OneCycle(8, 1.0, start_div=10, final_div=100, pct_start=0.375)
    >>> [round(s(t), 4) for t in (1, 3, 8)]
    [0.1, 1.0, 0.001]
    """
    total: int
    peak: float
    start_div: float = dataclasses.field(default=25.0, kw_only=True)
    final_div: float = dataclasses.field(default=1e4, kw_only=True)
    pct_start: float = dataclasses.field(default=0.25, kw_only=True)

    def __post_init__(self):
        _check_int(self, "total", self.total, 2)
        for name in ("peak", "start_div", "final_div"):
            _check_value(self, name, getattr(self, name))
        if not (isinstance(self.pct_start, numbers.Real) and 0 < self.pct_start < 1):
            raise ValueError(f"OneCycle expects pct_start in (0, 1), got {self.pct_start!r}")

    def __call__(self, t: int) -> float:
        step = min(_check_t(self, t), self.total) - 1   # PyTorch's step count, from 0
        low, high = self.peak / self.start_div, self.peak
        end = low / self.final_div
        up = float(self.pct_start * self.total) - 1     # the step of the peak, as PyTorch places it
        if step <= up:
            return _cosine(low, high, step / up if up > 0 else 1.0)
        return _cosine(high, end, (step - up) / (self.total - 1 - up))


def _cosine(a, b, fraction):
    """From ``a`` (fraction 0) to ``b`` (fraction 1) along half a cosine."""
    return b + (a - b) * (1 + math.cos(math.pi * fraction)) / 2


@dataclasses.dataclass(frozen=True)
class Sequence:
    """Schedules one after another: ``schedules[i]`` for ``step_sizes[i]`` epochs (or steps), each starting again
    from its own ``t = 1``; the last one goes on (ParameterSchedulers.jl's ``Sequence``). A linear warm-up and then a
    cosine: ``Sequence([Poly(...)...])``, or any callables ``t -> value``.

    >>> s = Sequence([Constant(0.1), Exp(1.0, 0.5)], [2, 3])
    >>> [s(t) for t in range(1, 7)]
    [0.1, 0.1, 1.0, 0.5, 0.25, 0.125]
    """
    schedules: tuple
    step_sizes: tuple

    def __post_init__(self):
        schedules, sizes = tuple(self.schedules), tuple(self.step_sizes)
        if not schedules or len(schedules) != len(sizes) or not all(callable(f) for f in schedules) or \
                not all(_is_int(n) and n >= 1 for n in sizes):
            raise ValueError(f"Sequence expects schedules (callables) and as many step_sizes (ints >= 1), got "
                             f"{len(schedules)} schedules and step_sizes {self.step_sizes!r}")
        object.__setattr__(self, "schedules", schedules)
        object.__setattr__(self, "step_sizes", tuple(int(n) for n in sizes))

    def __call__(self, t: int) -> float:
        t = _check_t(self, t)
        for schedule, n in zip(self.schedules[:-1], self.step_sizes[:-1]):
            if t <= n:
                return schedule(t)
            t -= n
        return self.schedules[-1](t)


class ReduceOnPlateau:
    """A learning rate cut by ``factor`` when a measured value (a validation loss) has not improved for ``patience``
    calls (PyTorch's ``ReduceLROnPlateau``: ``mode`` "min" or "max", relative ``threshold``, ``cooldown`` calls after a
    cut, never below ``floor``). Call it with each measurement; it returns the rate to use, which you set with
    :func:`fluxpy.optimise.adjust`.

    >>> plateau = ReduceOnPlateau(0.1, factor=0.5, patience=1)
    >>> [plateau(loss) for loss in (1.0, 0.9, 0.95, 0.97, 0.5)]
    [0.1, 0.1, 0.1, 0.05, 0.05]
    """

    def __init__(self, start: float, *, factor: float = 0.1, patience: int = 10, mode: str = "min",
                 threshold: float = 1e-4, cooldown: int = 0, floor: float = 0.0) -> None:
        _check_value(self, "start", start)
        if not (isinstance(factor, numbers.Real) and 0 < factor < 1):
            raise ValueError(f"ReduceOnPlateau expects factor in (0, 1), got {factor!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"ReduceOnPlateau expects mode 'min' or 'max', got {mode!r}")
        _check_int(self, "patience", patience, 0)
        _check_int(self, "cooldown", cooldown, 0)
        _check_value(self, "threshold", threshold, positive=False)
        _check_value(self, "floor", floor, positive=False)
        self.value, self.factor, self.patience, self.mode = float(start), float(factor), patience, mode
        self.threshold, self.cooldown, self.floor = float(threshold), cooldown, float(floor)
        self.best, self.bad, self.waiting = None, 0, 0

    def __call__(self, measured: float) -> float:
        measured = _check_measured(self, measured)
        if self.best is None or _improves(measured, self.best, self.mode, self.threshold):
            self.best, self.bad = measured, 0
        else:
            self.bad += 1
        if self.waiting > 0:
            self.waiting -= 1
            self.bad = 0
        elif self.bad > self.patience:
            self.value, self.bad, self.waiting = max(self.value * self.factor, self.floor), 0, self.cooldown
        return self.value

    def __repr__(self) -> str:
        return f"ReduceOnPlateau({self.value}, factor={self.factor}, patience={self.patience}, mode={self.mode!r})"


class EarlyStopping:
    """Whether to stop: true once a measured value (a validation loss) has not improved by ``min_delta`` for
    ``patience`` calls in a row (Flux's ``early_stopping``, Keras's ``EarlyStopping``; ``mode="max"`` for an
    accuracy). ``best`` is the best value seen.

    >>> stop = EarlyStopping(patience=2)
    >>> [stop(loss) for loss in (1.0, 0.8, 0.85, 0.81, 0.9)]
    [False, False, False, True, True]
    """

    def __init__(self, patience: int = 5, *, min_delta: float = 0.0, mode: str = "min") -> None:
        _check_int(self, "patience", patience, 1)
        _check_value(self, "min_delta", min_delta, positive=False)
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping expects mode 'min' or 'max', got {mode!r}")
        self.patience, self.min_delta, self.mode = patience, float(min_delta), mode
        self.best, self.bad = None, 0

    def __call__(self, measured: float) -> bool:
        measured = _check_measured(self, measured)
        better = self.best is None or (measured < self.best - self.min_delta if self.mode == "min"
                                       else measured > self.best + self.min_delta)
        if better:
            self.best, self.bad = measured, 0
        else:
            self.bad += 1
        return self.bad >= self.patience

    def __repr__(self) -> str:
        return f"EarlyStopping(patience={self.patience}, min_delta={self.min_delta}, mode={self.mode!r})"


def _improves(value, best, mode, threshold):
    """PyTorch's relative threshold: better than ``best`` by more than ``threshold * |best|``."""
    return value < best - threshold * abs(best) if mode == "min" else value > best + threshold * abs(best)


def _check_measured(who, value):
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{type(who).__name__} expects a measured number (a loss), got {value!r}") from None
    if math.isnan(value):
        raise ValueError(f"{type(who).__name__} was given NaN as the measured value")
    return value


def _check_int(schedule, name, value, low):
    if not _is_int(value) or value < low:
        raise ValueError(f"{type(schedule).__name__} expects {name} to be an int >= {low}, got {value!r}")


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
