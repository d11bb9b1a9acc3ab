"""The training loop of ``Flux.train!``: :func:`train`.

For each batch, ``fluxpy.withgradient(lambda m: loss(m, *batch), model)`` gives the loss and
the model's gradient, and :func:`fluxpy.optimise.update` applies it in place. A progress bar
(tqdm when installed, plain lines otherwise) shows the loss and the throughput; a loss that
becomes NaN or infinite stops training with an error naming the epoch and the batch.

>>> import numpy as np
>>> from fluxpy.layers import Dense
>>> from fluxpy.losses import mse
>>> from fluxpy.optimise import Adam, setup
>>> x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(-1, 1)
>>> model = Dense(1, 1, rng=0)
>>> opt = setup(Adam(0.1), model)
>>> losses = train(lambda m, x, y: mse(m(x), y), model, [(x, 3 * x)] * 50, opt, progress=False)
>>> len(losses), losses[-1] < losses[0]
(50, True)
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from .autodiff import value_of, withgradient
from .optimise import update

__all__ = ["train", "TrainingDiverged"]


class TrainingDiverged(FloatingPointError):
    """The loss became NaN or infinite; ``epoch`` and ``batch`` (both counted from 1) say where.

    A ``FloatingPointError``, so ``except FloatingPointError`` catches it too.

    >>> err = TrainingDiverged("train: the loss is nan at epoch 2, batch 7", 2, 7, float("nan"))
    >>> isinstance(err, FloatingPointError), err.epoch, err.batch
    (True, 2, 7)
    """

    def __init__(self, message: str, epoch: int, batch: int, loss: float) -> None:
        super().__init__(message)
        self.epoch, self.batch, self.loss = epoch, batch, loss


def train(loss: Callable, model: Any, data: Iterable, opt_state: Any, epochs: int = 1,
          progress: bool = True) -> list[float]:
    """Train ``model`` in place on every batch of ``data``, ``epochs`` times; returns the per-batch losses.

    ``loss(model, *batch)`` is called for every batch of ``data`` (a tuple batch such as ``(x, y)``
    is splatted; any other batch is passed as one argument), and the model is updated in place
    with ``opt_state`` (from :func:`fluxpy.optimise.setup`), ``epochs`` times over ``data``.
    ``progress=True`` shows a bar with the loss and the images (observations) per second: tqdm
    when installed, otherwise one plain line per epoch on stderr. A NaN or infinite loss raises
    :class:`TrainingDiverged` (a ``FloatingPointError``) naming the epoch and batch, before the
    update. Returns the losses as floats, all epochs in order.

    >>> import numpy as np
    >>> from fluxpy.optimise import Descent, setup
    >>> model = {"w": np.array([1.0])}
    >>> train(lambda m, x: (m["w"] * x).sum(), model, [(np.array([np.nan]),)], setup(Descent(0.1), model),
    ...       progress=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fluxpy.train.TrainingDiverged: train: the loss is nan at epoch 1, batch 1; stopping before the update (lower ...)
    """
    losses = []
    for epoch in range(1, epochs + 1):
        bar = _progress_bar(data, epoch, epochs) if progress else None
        seen, start = 0, time.perf_counter()
        for batch_number, batch in enumerate(bar if bar is not None else data, start=1):
            args = batch if isinstance(batch, tuple) else (batch,)
            value, (grad,) = withgradient(lambda m: loss(m, *args), model)  # noqa: B023  (called at once)
            value = float(value_of(value))
            if not math.isfinite(value):
                if bar is not None:
                    bar.close()
                raise TrainingDiverged(f"train: the loss is {value} at epoch {epoch}, batch {batch_number}; stopping "
                                       "before the update (lower the learning rate, or check the data and the loss)",
                                       epoch, batch_number, value)
            update(opt_state, model, grad)
            losses.append(value)
            seen += _count(args[0])
            if bar is not None:
                bar.show(value, seen / max(time.perf_counter() - start, 1e-9))
        if bar is not None:
            bar.close()
    return losses


def _count(x):
    """How many observations a batch holds (axis 0 of its first array; 1 for anything else)."""
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape else 1


def _progress_bar(data, epoch, epochs):
    label = f"epoch {epoch}/{epochs}" if epochs > 1 else "train"
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _PlainProgress(data, label)
    return _TqdmProgress(tqdm, data, label)


class _TqdmProgress:
    def __init__(self, tqdm, data, label):
        total = len(data) if hasattr(data, "__len__") else None
        self.bar = tqdm(data, total=total, desc=label, leave=True, dynamic_ncols=True)
        self.calls = 0

    def __iter__(self):
        return iter(self.bar)

    def show(self, loss, rate):
        self.calls += 1
        if self.calls % 5 == 1:  # updating the postfix every batch costs more than a small training step
            self.bar.set_postfix(loss=f"{loss:.4f}", img_per_s=f"{rate:.0f}", refresh=False)

    def close(self):
        self.bar.close()


class _PlainProgress:
    """tqdm's stand-in: one line per epoch on stderr."""

    def __init__(self, data, label):
        self.data, self.label = data, label
        self.loss = self.rate = math.nan
        self.batches = 0
        self.closed = False

    def __iter__(self):
        return iter(self.data)

    def show(self, loss, rate):
        self.loss, self.rate = loss, rate
        self.batches += 1

    def close(self):
        if not self.closed:
            self.closed = True
            print(f"{self.label}: {self.batches} batches, loss {self.loss:.4f}, "
                  f"{self.rate:.0f} images/s", file=sys.stderr)
