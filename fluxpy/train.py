"""The training loop of ``Flux.train!``: :func:`train`.

For each batch, ``fluxpy.withgradient(lambda m: loss(m, *batch), model)`` gives the loss and
the model's gradient, and :func:`fluxpy.optimise.update` applies it in place. One progress bar for
the whole call (tqdm when installed, a plain line otherwise) shows the loss and the throughput. Each step is
checked before it changes anything: a NaN or infinite loss or gradient (or, as an option, a
loss grown past ``max_loss_ratio``) stops training with :class:`TrainingDiverged` naming the
epoch, the batch and the parameter, and a loss that gives the model no gradient is an error.

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
import numbers
import os
import sys
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .autodiff import withgradient_detailed, value_of
from .journal import undone_on_out_of_memory
from .backend import get_array_module, is_float_dtype, read_scalars
from .checkpoint import load_training, save_training
from .collector import frozen_while_training
from .functors import arrays, state
from .ops import check_indices
from .optimise import Plan, Rule, adjust
from .step import CheckedStep

__all__ = ["train", "TrainingDiverged"]


class TrainingDiverged(FloatingPointError):
    """Training went wrong numerically: a NaN or infinite loss or gradient, or a loss that grew past
    ``max_loss_ratio``. ``epoch`` and ``batch`` (both counted from 1) say where, ``loss`` is that batch's
    loss, and ``path`` names the parameter whose gradient was not finite (``None`` otherwise).

    A ``FloatingPointError``, so ``except FloatingPointError`` catches it too.

    >>> err = TrainingDiverged("train: the loss is nan at epoch 2, batch 7", 2, 7, float("nan"))
    >>> isinstance(err, FloatingPointError), err.epoch, err.batch, err.path
    (True, 2, 7, None)
    """

    def __init__(self, message: str, epoch: int, batch: int, loss: float, path: str | None = None) -> None:
        super().__init__(message)
        self.epoch, self.batch, self.loss, self.path = epoch, batch, loss, path


def train(loss: Callable, model: Any, data: Iterable, opt_state: Any, epochs: int = 1, progress: bool | None = None, *,
          check_finite: bool = True, max_loss_ratio: float | None = None, capture: bool = True,
          schedule: Callable[[int], float] | None = None, schedule_per: str = "epoch",
          checkpoint: str | os.PathLike | None = None, every: int | None = None, resume: bool = False) -> list[float]:
    """Train ``model`` in place on every batch of ``data``, ``epochs`` times; returns the per-batch losses.

    ``loss(model, *batch)`` is called for every batch of ``data`` (a tuple batch such as ``(x, y)``
    is splatted; any other batch is passed as one argument), and the model is updated in place
    with ``opt_state`` (from :func:`fluxpy.optimise.setup`), ``epochs`` times over ``data``.
    ``progress``: one bar on stderr for the whole call (``epochs`` times the batches of ``data``), showing the
    epoch, the loss and the images (observations) per second: tqdm's (``tqdm.auto``) when tqdm is installed,
    otherwise one plain line rewritten in place. ``None`` (the default) draws it only where someone watches:
    stderr is a terminal, or this runs in a Jupyter kernel; logs, pipes and batch jobs get nothing. ``True``
    draws it anyway; ``False`` is silent. Returns the losses as floats, all epochs in order.

    Every step is checked before the model changes, and stops with :class:`TrainingDiverged` (a
    ``FloatingPointError``) naming the epoch and the batch when:

    - the loss is NaN or infinite;
    - ``check_finite`` (the default) and a gradient has a NaN or infinite entry; the error names the
      parameter (``err.path``). The check is one reduction over all gradients, read together with
      the loss (no sync per parameter); ``check_finite=False`` skips it;
    - ``max_loss_ratio`` is given and the loss exceeds ``max_loss_ratio`` times the first batch's
      loss (of this call; the loss must be positive then): ``max_loss_ratio=1e4`` stops a run whose
      loss grew ten-thousandfold.

    ``capture=True`` (the default): on the GPU, after two eager steps per batch shape, each step is captured as a
    CUDA graph and replayed (:class:`fluxpy.TrainStep`: no Python runs per step but the batch copy, the launch and
    the check's read). The checks stay: the graph also finds whether the loss (and, with ``check_finite``, every
    gradient) is finite and skips its update on the device where it is not; train then runs that batch again
    eagerly, which raises :class:`TrainingDiverged` as above. Each step's loss is read after the next step was
    launched, so the GPU is never idle while the host prepares a batch. A step that cannot be captured (Dropout
    given a NumPy generator, a rule of one's own with ``apply`` and no formula) runs eagerly after one
    :class:`fluxpy.CaptureWarning`; with ``max_loss_ratio`` every step runs eagerly; ``capture=False`` steps
    eagerly (to compare, or to debug); on the CPU ``capture`` changes nothing. A loop that calls train once per
    epoch captures once: the captured steps are kept per model while the loss, the optimiser state and the model's
    arrays stay the same objects (with the GPU memory their graphs hold, until the model is freed).

    An index out of range that a checked ``scatter``, ``gather`` or ``Embedding`` met on the GPU (the
    kernels skip it and do not wait, ``index_checks="deferred"``) is raised as an ``IndexError`` naming the op, the
    entry, the epoch and the batch where train reads that step's loss, before an eager step's update (a captured
    step's replay reports it once it has run, naming the batch).

    ``schedule``: a learning-rate schedule, any function of ``t = 1, 2, ...`` giving a number ``>= 0``
    (:mod:`fluxpy.schedules`: ``Cosine``, ``Step``, ``Exp``, ``Constant``). With ``schedule_per="epoch"`` (the
    default) train sets the rules' learning rate to ``schedule(epoch)`` before each epoch, with
    ``schedule_per="step"`` to ``schedule(t)`` before the ``t``-th step, counting every batch of every epoch. It
    sets it with :func:`fluxpy.optimise.adjust` (Optimisers.jl's ``adjust!``: ``eta`` of every rule that has one,
    the moments kept), so the state keeps the last rate after train returns. ``t`` counts from 1 in each call: a
    loop that calls train once per epoch passes ``schedule=lambda t: s(t + done)``. When steps are captured a new
    rate means a new capture (the graph holds the rate as a number): per epoch that costs one eager step and one
    capture per epoch, per step every step runs eagerly.

    ``checkpoint=path``: the whole training state (:func:`fluxpy.save_training`: the model, the optimiser state,
    the loss scale, fluxpy's random generators and the steps done) is saved to ``path`` (``.npz`` or
    ``.safetensors``; atomically, so a process killed while saving leaves the last complete file) every ``every``
    steps (counting every batch of every epoch; ``every=None``: at the end of each epoch), and after the last step.
    ``resume=True`` continues the run saved there: the state is loaded (:func:`fluxpy.load_training`) and the steps
    it had done are skipped (the batches are taken from ``data`` and dropped; a schedule counts them), so running
    the same script again after a crash, with ``resume=True``, continues the same run, bit for bit on the same
    device, as if it had never stopped; without a file at ``path`` it starts from the beginning. The batches must
    come in the same order: a list, or a ``DataLoader`` without shuffling; a ``DataLoader`` that shuffles (from
    fluxpy's generator) gives the same order where the checkpoint was saved at the end of an epoch (``every=None``).
    Resuming is for a run made of one ``train`` call: a loop that calls ``train`` once per epoch resumes with
    ``load_training`` and its own count of the epochs done.

    A loss that gives no gradient to any trainable array (computed from a global model instead of
    its argument, or through ``value_of``/``no_grad``) is a ``ValueError`` naming the batch: such a
    step would change nothing. The arguments are checked before the first batch: ``opt_state``
    must be ``setup(rule, model)`` for this model (not a rule), ``data`` iterable (a one-pass
    iterator only with ``epochs=1``).

    >>> import numpy as np
    >>> from fluxpy.optimise import Descent, setup
    >>> model = {"w": np.array([1.0])}
    >>> train(lambda m, x: (m["w"] * x).sum(), model, [(np.array([np.nan]),)], setup(Descent(0.1), model),
    ...       progress=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fluxpy.train.TrainingDiverged: train: the loss is nan at epoch 1, batch 1; stopping before the update (lower ...)

    A schedule, per step:

    >>> from fluxpy.schedules import Step
    >>> opt = setup(Descent(1.0), model)
    >>> _ = train(lambda m, x: (m["w"] * x).sum(), model, [(np.array([0.0]),)] * 3, opt, progress=False,
    ...           schedule=Step(0.1, 0.5, 1), schedule_per="step")
    >>> opt["w"].rule
    Descent(eta=0.025)
    """
    _check_arguments(loss, model, data, opt_state, epochs, max_loss_ratio)
    if not isinstance(capture, bool):
        raise TypeError(f"train: capture must be True or False, got {_short(capture)}")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"train: progress must be None (a bar on a terminal only), True or False, got "
                        f"{_short(progress)}")
    saves = None if checkpoint is None and every is None and not resume else _Checkpoints(checkpoint, every, resume)
    rates = None if schedule is None else _Rates(schedule, schedule_per, opt_state)
    if saves is not None:
        saves.start(model, opt_state)
    captured = _checked_step(loss, model, opt_state, check_finite) if capture and max_loss_ratio is None else None
    with frozen_while_training:   # see fluxpy.collector: the objects alive now are not scanned while it trains
        return _train_epochs(loss, model, data, opt_state, epochs, progress, check_finite, max_loss_ratio, captured,
                             rates, saves)


def _train_epochs(loss, model, data, opt_state, epochs, progress, check_finite, max_loss_ratio, captured,
                  rates=None, saves=None):
    bar = _progress_bar(data, epochs) if epochs and (_watched() if progress is None else progress) else None
    try:
        return _run_epochs(loss, model, data, opt_state, epochs, bar, check_finite, max_loss_ratio, captured,
                           rates, saves)
    finally:
        if bar is not None:
            bar.close()


def _run_epochs(loss, model, data, opt_state, epochs, bar, check_finite, max_loss_ratio, captured, rates, saves):
    losses: list[float] = []
    first = None
    for epoch in range(1, epochs + 1):
        if rates is not None:
            rates.epoch(epoch)
        if bar is not None:
            bar.epoch(epoch)
        if saves is not None and saves.skip_epoch(data, rates):   # resumed: done before the stop, data untouched
            if bar is not None:
                bar.skip(len(data))
            continue
        seen, start, batches = 0, time.perf_counter(), 0

        # captured steps are never checked against max_loss_ratio (train steps eagerly with it)
        lagged = None if captured is None else _Lagged(captured, lambda args, batch_number, epoch=epoch: _step(
            loss, model, args, opt_state, epoch, batch_number, check_finite, None, None))
        try:
            for batch_number, batch in enumerate(data, start=1):
                args = batch if isinstance(batch, tuple) else (batch,)
                if rates is not None:
                    rates.step()
                if saves is not None and saves.skip():   # resumed: this step was done before the stop
                    batches += 1
                    if bar is not None:
                        bar.skip(1)
                    continue
                values = lagged.step(args, batch_number) if lagged is not None else [
                    _step(loss, model, args, opt_state, epoch, batch_number, check_finite, max_loss_ratio, first)]
                if first is None and values:
                    first = values[0]
                losses.extend(values)
                batches += 1
                seen += _count(args[0])
                if bar is not None:
                    bar.step(losses[-1] if losses else math.nan, seen / max(time.perf_counter() - start, 1e-9))
                if saves is not None and saves.due():
                    if lagged is not None:   # the step in flight settled first: the file holds finished steps
                        losses.extend(lagged.finish())
                    saves.save(model, opt_state, epoch, batch_number)
            if lagged is not None:
                losses.extend(lagged.finish())
            if saves is not None and (saves.every is None or epoch == epochs):
                saves.save(model, opt_state, epoch, batches)
        finally:
            if lagged is not None:
                lagged.abandon()
        if not batches:
            raise ValueError(f"train: data gave no batches in epoch {epoch}" + (
                "; an iterator that is used up after one pass cannot train several epochs: pass a list or a "
                "DataLoader" if epoch > 1 else ""))
    return losses


# train's captured steps, one per model (held weakly), reused by the next call for the same loss and optimiser
# state while the model's arrays are the ones its graphs write: a loop that calls train once per epoch captures once
_checked_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _checked_step(loss, model, opt_state, check_finite):
    """The :class:`CheckedStep` for ``train(loss, model, ..., opt_state, check_finite=...)``: the one the last
    call made where nothing it captured has changed, else a new one."""
    fingerprint = tuple(id(a) for a in arrays(model))
    try:
        kept = _checked_steps.get(model)
    except TypeError:   # a model that cannot be referenced weakly (a dict): a new step per call
        return CheckedStep(loss, model, opt_state, check_gradients=check_finite)
    if kept is not None and kept[0] == (loss, opt_state, check_finite, fingerprint):
        return kept[1]
    step = CheckedStep(loss, model, opt_state, check_gradients=check_finite)
    _checked_steps[model] = ((loss, opt_state, check_finite, fingerprint), step)
    return step


class _Lagged:
    """Steps replayed from their CUDA graphs with the loss read one step late: the host launches step k+1, then
    waits for step k's loss and flag, so the GPU runs one step while the host prepares the next.

    The checks stay exact. A step whose flag is not finite skipped its update on the device, and so did the
    step launched after it (the flag is sticky, :class:`fluxpy.step.CheckedStep`): both are undone on the host and
    run again eagerly, in order, where train's checked step raises :class:`TrainingDiverged` for the bad one.
    Batches that are not replays (warm-up, capture, another shape) wait for the step in flight first.
    """

    def __init__(self, captured: CheckedStep, eager: Callable) -> None:
        self.captured, self.eager, self.flying = captured, eager, None

    def step(self, args: tuple, batch_number: int) -> list[float]:
        """Launch (or run) the step of ``args``; the losses of the steps that finished by now, in order."""
        flight = self.captured.replay(*args)
        if flight is not None:
            flight.batch = (args, batch_number)
            earlier, self.flying = self.flying, flight
            return self._settle(earlier) if earlier is not None else []
        done = self.finish()
        flight = self.captured.run(*args)
        if flight is None:
            return done + [self.eager(args, batch_number)]
        flight.batch = (args, batch_number)
        return done + self._settle(flight)

    def finish(self) -> list[float]:
        """Wait for the step in flight; its loss (and any step run again)."""
        flight, self.flying = self.flying, None
        return self._settle(flight) if flight is not None else []

    def abandon(self) -> None:
        """After an exception: bring the host side of the step in flight in line with the device, no rerun."""
        flight, self.flying = self.flying, None
        if flight is not None:
            value, guard, _ = flight.read.result()
            if math.isfinite(value) and math.isfinite(guard):
                flight.commit()
            else:
                flight.undo()
                self.captured.clear_trip()

    def _settle(self, flight) -> list[float]:
        value, guard, own = flight.read.result()
        scaler = getattr(getattr(self.captured, "model", None), "loss_scaler", None) if self.captured.loss_scaled \
            else None
        if math.isfinite(value) and math.isfinite(guard):
            try:
                flight.commit()   # its replay hooks report an index out of range that the step met
            except IndexError as err:
                raise IndexError(f"train (batch {flight.batch[1]}, a captured step): {err}") from None
            if scaler is not None:
                scaler.counted(True)
            return [value]
        # a loss-scaled model's own overflow: skipped (and the scale lowered) on the device, as the eager step does
        overflow = self.captured.loss_scaled and math.isfinite(value) and not math.isfinite(own)
        skipped = ([] if overflow else [flight]) + ([self.flying] if self.flying is not None else [])
        self.flying = None
        self.captured.clear_trip()
        for f in reversed(skipped):   # the device skipped them: undone on the host, then run again eagerly in order
            f.undo()
        if overflow:
            flight.undo()
            if scaler is not None:
                scaler.counted(False)   # LossScaleUnderflow where the scale fell below its floor
        return ([value] if overflow else []) + [self.eager(*f.batch) for f in skipped]


def _step(loss, model, args, opt_state, epoch, batch, check_finite, max_loss_ratio, first):
    """One checked training step; returns the loss. Raises, with the model untouched, when anything is wrong."""
    where = f"epoch {epoch}, batch {batch}"
    value, (grad,), detached = undone_on_out_of_memory(f"train ({where})", withgradient_detailed,
                                                       lambda m: loss(m, *args), (model,), f"train ({where})",
                                                       "the loss")
    plan = Plan(opt_state, model, grad, "train")
    if not len(plan):
        why = detached or ("its gradient reaches no trainable array (only constants, or arrays that the model's "
                           "layers do not declare trainable)")
        raise ValueError(f"train: the loss at {where} gives no gradient to any trainable array of the model, so the "
                         f"step would change nothing ({why}); the loss must be computed from the model it is "
                         "given as its first argument, loss(model, *batch)")
    scaler = getattr(model, "loss_scaler", None)   # fluxpy.MixedPrecision's dynamic loss scale: always checked
    total = Plan.finite_total(plan.gradients()) if check_finite or scaler is not None else None
    value, finite = _read_loss_and_total(value_of(value), total)   # the step's one wait for the device
    _indices_checked(where)
    if not math.isfinite(value):
        raise TrainingDiverged(f"train: the loss is {value} at {where}; stopping before the update (lower the "
                               f"learning rate, or check the data and the loss){_buffers_note(model)}",
                               epoch, batch, value)
    if not finite and scaler is not None:   # the scaled float16 gradients overflowed: skip, lower the scale
        scaler.advance(total)
        return value
    if not finite:
        bad = plan.nonfinite()
        if bad:
            _, _, dx, path = bad[0]
            raise TrainingDiverged(f"train: the gradient for {Plan.path(path)} has {Plan.count_nonfinite(dx)} at "
                                   f"{where} "
                                   f"(the loss is {value:.6g}); stopping before the update (lower the learning rate, "
                                   f"or look for a log, sqrt or division at zero in the loss or the model)"
                                   f"{_buffers_note(model)}", epoch, batch, value, Plan.path(path))
    if max_loss_ratio is not None:
        if first is None and value <= 0:
            raise ValueError(f"train: max_loss_ratio compares every loss with the first batch's, which is {value} "
                             "(not positive); leave max_loss_ratio out for this loss")
        if first is not None and value > max_loss_ratio * first:
            raise TrainingDiverged(f"train: the loss {value:.6g} at {where} is more than max_loss_ratio="
                                   f"{max_loss_ratio:g} times the first batch's loss {first:.6g}; stopping before "
                                   f"the update (lower the learning rate){_buffers_note(model)}", epoch, batch,
                                   value)
    plan.check()  # what the rules refuse (ClipNorm): before any change
    plan.apply()
    if scaler is not None:
        scaler.advance(total)
    return value


def _indices_checked(where):
    """Raise for an index out of range that a checked scatter, gather or Embedding of this step (or before) met on
    the GPU: read without waiting, the step's loss having just been read."""
    try:
        check_indices(wait=False)
    except IndexError as err:
        raise IndexError(f"train ({where}): {err}; stopping before the update") from None


def _read_loss_and_total(value, total):
    """The loss as a float, and whether :meth:`Plan.finite_total`'s ``total`` (None: not checked) is finite; a loss
    and a total on the GPU come back with one wait (:func:`fluxpy.backend.read_scalars`; ``float`` of each waits
    twice)."""
    if total is None:
        return float(value), True
    if isinstance(total, list):   # NumPy and CuPy gradients mixed: one total per array (never the normal path)
        return float(value), Plan.is_finite(total)
    loss, total = read_scalars(value, total)
    return loss, math.isfinite(total)


def _buffers_note(model):
    """On the error path: the model's arrays that hold NaN or Inf now. The forward pass of the failed batch may
    have written them (BatchNorm's running statistics); train does not roll those back."""
    bad = []

    def walk(st, keys):
        if isinstance(st, dict):
            for k, v in st.items():
                walk(v, keys + (k,))
        elif isinstance(st, list):
            for i, v in enumerate(st):
                walk(v, keys + (i,))
        elif st is not None and (is_float_dtype(st.dtype) or st.dtype.kind == "c") and \
                not bool(get_array_module(st).isfinite(st).all()):
            bad.append(Plan.path(keys))
    walk(state(model), ())
    if not bad:
        return ""
    return (f"; note that the model now holds NaN or Inf in {', '.join(bad)} (arrays written during the forward "
            "pass, such as BatchNorm's running statistics, are not rolled back)")


def _check_arguments(loss, model, data, opt_state, epochs, max_loss_ratio):
    """The mistakes that would otherwise fail late, or silently: before the first batch (and any change)."""
    if isinstance(model, types.FunctionType) and not isinstance(loss, types.FunctionType):
        raise TypeError(f"train: model is a function ({model!r}); the arguments are train(loss, model, data, "
                        "opt_state), with loss(model, *batch)")
    if not callable(loss):
        raise TypeError(f"train: loss must be a function called as loss(model, *batch), got {_short(loss)}")
    if isinstance(model, Rule):
        raise TypeError(f"train: model is the rule {model!r}; the arguments are train(loss, model, data, "
                        "opt_state) with opt_state = setup(rule, model)")
    if isinstance(opt_state, Rule):
        raise TypeError(f"train: got the rule {opt_state!r} as the optimiser state; make the state once with "
                        f"opt_state = fluxpy.setup({opt_state!r}, model) and pass that")
    if not isinstance(data, Iterable) and not hasattr(data, "__getitem__"):
        raise TypeError(f"train: data must be an iterable of batches (a DataLoader, or a list of (x, y) tuples), "
                        f"got {_short(data)}")
    if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs < 0:
        raise ValueError(f"train: epochs must be an int >= 0, got {epochs!r}")
    if epochs > 1 and isinstance(data, Iterator):
        raise ValueError(f"train: data is a {type(data).__name__}, an iterator that is used up after one pass, so "
                         f"epochs={epochs} would train on nothing after the first; pass a list or a DataLoader")
    if max_loss_ratio is not None and (isinstance(max_loss_ratio, bool) or not isinstance(
            max_loss_ratio, numbers.Real) or not max_loss_ratio > 1):
        raise ValueError(f"train: max_loss_ratio must be a number > 1 (e.g. 1e4), or None, got {max_loss_ratio!r}")
    if not len(Plan(opt_state, model, who="train")):
        raise ValueError("train: the optimiser state has no trainable array, so there is nothing to train; "
                         "make it with setup(rule, model) for a model that holds float arrays")


class _Checkpoints:
    """train's ``checkpoint``, ``every`` and ``resume``: the steps done, counted over every epoch, saved every
    ``every`` of them with :func:`fluxpy.save_training`, and the steps to skip when a run is resumed."""

    def __init__(self, path, every, resume):
        if path is None:
            raise ValueError("train: every and resume need checkpoint=path, the file to save the run to")
        if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise TypeError(f"train: checkpoint must be a file path (str or os.PathLike), got {_short(path)}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1):
            raise ValueError(f"train: every must be an int >= 1 (save every that many steps), or None, got {every!r}")
        if not isinstance(resume, bool):
            raise TypeError(f"train: resume must be True or False, got {_short(resume)}")
        self.path, self.every, self.resume = path, every, resume
        self.done = self.skipping = self.saved = 0

    def start(self, model, opt_state):
        """Load the saved run when resuming from a file that exists; the steps it had done are then skipped."""
        if self.resume and any(os.path.isfile(p) for p in (self.path, f"{os.fspath(self.path)}.npz")):
            self.skipping = self.saved = load_training(self.path, model, opt_state)["step"]

    def skip_epoch(self, data, rates):
        """Whether a whole epoch was done before the stop: skipped without iterating ``data`` (a shuffling
        DataLoader would draw a new order from the restored generator)."""
        n = len(data) if hasattr(data, "__len__") else None
        if not n or self.skipping < n:
            return False
        self.skipping -= n
        self.done += n
        for _ in range(n if rates is not None else 0):
            rates.step()
        return True

    def skip(self):
        """Whether this step was done before the stop (and is skipped); counts it either way."""
        self.done += 1
        if self.skipping:
            self.skipping -= 1
            return True
        return False

    def due(self):
        return self.every is not None and self.done % self.every == 0 and self.done > self.saved

    def save(self, model, opt_state, epoch, batch):
        if self.done > self.saved:   # only after steps beyond the loaded ones (a finished run saves nothing new)
            save_training(self.path, model, opt_state, step=self.done, epoch=epoch, batch=batch)
            self.saved = self.done


class _Rates:
    """train's ``schedule``: sets the learning rate of ``opt_state`` with ``adjust`` per epoch or per step."""

    def __init__(self, schedule, per, opt_state):
        if not callable(schedule):
            raise TypeError(f"train: schedule must be a function of t = 1, 2, ... giving the learning rate (e.g. "
                            f"fluxpy.schedules.Cosine), got {_short(schedule)}")
        if per not in ("epoch", "step"):
            raise ValueError(f"train: schedule_per must be \"epoch\" or \"step\", got {per!r}")
        self.schedule, self.per, self.opt_state, self.t, self.eta = schedule, per, opt_state, 0, None
        self._set(1)   # before any change: a schedule that fails, or a state without a learning rate, fails here

    def _set(self, t):
        eta = self.schedule(t)
        if isinstance(eta, bool) or not isinstance(eta, numbers.Real) or not math.isfinite(eta) or eta < 0:
            raise ValueError(f"train: schedule({t}) must be a finite number >= 0 (the learning rate), got "
                             f"{_short(eta)}")
        if float(eta) != self.eta:   # an unchanged rate keeps the rule (and a captured step's graph)
            self.eta = float(eta)
            adjust(self.opt_state, eta=self.eta)

    def epoch(self, epoch):
        if self.per == "epoch" and epoch > 1:   # epoch 1's rate was set when checked
            self._set(epoch)

    def step(self):
        self.t += 1
        if self.per == "step" and self.t > 1:
            self._set(self.t)


def _short(x):
    text = repr(x)
    return f"{type(x).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _count(x):
    """How many observations a batch holds (axis 0 of its first array; 1 for anything else)."""
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape else 1


def _watched():
    """Whether ``progress=None`` draws the bar: stderr is a terminal, or this runs in a Jupyter kernel (whose
    stderr is a pipe, but its output is shown under the cell; tqdm.auto draws a notebook bar there)."""
    try:
        if sys.stderr is not None and sys.stderr.isatty():
            return True
    except (AttributeError, ValueError):   # a stream without isatty, or a closed one
        pass
    return "ipykernel" in sys.modules


def _progress_bar(data, epochs):
    """The bar of a whole train call: ``epochs`` times the batches of ``data`` (unknown without ``len``)."""
    total = epochs * len(data) if hasattr(data, "__len__") else None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _PlainProgress(total, epochs)
    return _TqdmProgress(tqdm, total, epochs)


def _label(epoch, epochs):
    return f"epoch {epoch}/{epochs}" if epochs > 1 else "train"


class _TqdmProgress:
    """One tqdm bar for the whole call: the batches of every epoch, the epoch as its description."""

    def __init__(self, tqdm, total, epochs):
        self.bar = tqdm(total=total, desc=_label(1, epochs), unit="batch", dynamic_ncols=True, file=sys.stderr)
        self.epochs, self.calls = epochs, 0

    def epoch(self, epoch):
        self.bar.set_description(_label(epoch, self.epochs), refresh=False)

    def skip(self, batches):
        self.bar.update(batches)

    def step(self, loss, rate):
        self.calls += 1
        if self.calls % 5 == 1:  # updating the postfix every batch costs more than a small training step
            self.bar.set_postfix(loss=f"{loss:.4f}", img_per_s=f"{rate:.0f}", refresh=False)
        self.bar.update(1)

    def close(self):
        self.bar.close()


class _PlainProgress:
    """tqdm's stand-in: one line on stderr, rewritten in place (at most every ``interval`` seconds), ended when
    the call ends."""

    interval = 0.5

    def __init__(self, total, epochs):
        self.total, self.epochs = total, epochs
        self.label = _label(1, epochs)
        self.loss = self.rate = math.nan
        self.batches, self.width, self.shown = 0, 0, -math.inf
        self.closed = False

    def epoch(self, epoch):
        self.label = _label(epoch, self.epochs)

    def skip(self, batches):
        self.batches += batches

    def step(self, loss, rate):
        self.loss, self.rate = loss, rate
        self.batches += 1
        if time.monotonic() - self.shown >= self.interval:
            self._write()

    def _write(self, end=""):
        done = f"{self.batches}/{self.total}" if self.total is not None else f"{self.batches}"
        text = f"{self.label}: {done} batches, loss {self.loss:.4f}, {self.rate:.0f} images/s"
        # "\r" goes back to the line's start; the padding blanks what a longer line left there
        sys.stderr.write("\r" + text.ljust(self.width) + end)
        sys.stderr.flush()
        self.width, self.shown = len(text), time.monotonic()

    def close(self):
        if not self.closed:
            self.closed = True
            self._write(end="\n")
