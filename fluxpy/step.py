"""A training step as one callable, captured as a CUDA graph on the GPU: :class:`TrainStep`.

An eager step of a small conv net is host-bound: Python dispatch and kernel launches, not the GPU, set its
time. ``TrainStep`` runs the same step (``withgradient`` of the loss, then ``update``), and on the GPU it
records the GPU work of one step into a CUDA graph and from then on only copies each batch into the graph's
input buffers and replays it: no Python runs per step but the copy and the launch.

>>> import numpy as np
>>> from fluxpy.layers import Dense
>>> from fluxpy.losses import mse
>>> from fluxpy.optimise import Descent, setup
>>> model = Dense(1, 1, rng=0)
>>> step = TrainStep(lambda m, x, y: mse(m(x), y), model, setup(Descent(0.1), model))
>>> x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(-1, 1)
>>> first = float(step(x, 3 * x))
>>> last = [float(step(x, 3 * x)) for _ in range(30)][-1]
>>> last < first / 10
True
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .autodiff import withgradient
from .backend import (CapturedGraph, ScalarsRead, capture_graph, copy_into, get_array_module, gpu_device,
                      start_reading_scalars)
from .capturing import guarding, recording
from .journal import undone_on_out_of_memory
from .optimise import Plan, update

__all__ = ["TrainStep", "CaptureWarning", "CheckedStep", "Flight"]


class CaptureWarning(UserWarning):
    """A :class:`TrainStep` could not capture its step as a CUDA graph and runs it eagerly; the message names why.

    >>> issubclass(CaptureWarning, UserWarning)
    True
    """


class _Signature:
    """What :class:`TrainStep` keeps per batch signature: eager steps so far, and the captured graph with its
    input buffers and outputs, the host-side hooks to run after each replay, the optimiser's host state from
    before the capture (for the first launch, whose host side ran during the capture), or why it runs eagerly."""
    __slots__ = ("seen", "graph", "inputs", "outputs", "hooks", "before", "fresh", "eager_because", "config")

    def __init__(self):
        self.seen, self.graph, self.inputs, self.outputs, self.hooks = 0, None, None, None, ()
        self.before, self.fresh, self.eager_because, self.config = (), False, None, ()

    def config_changed(self) -> bool:
        """Whether a leaf's rule or frozen flag changed since the capture (``adjust``, ``freeze``, ``thaw``): the
        graph holds the old learning rate as a number, so it must be captured again."""
        return any(leaf.rule is not rule or leaf.frozen is not frozen for leaf, rule, frozen in self.config)


class TrainStep:
    """One training step of ``loss(model, *batch)``: the gradient of the loss with respect to ``model``, then
    :func:`fluxpy.optimise.update` of ``model`` in place with ``opt_state``. Calling it with a batch returns the
    loss (a 0-d array: on the GPU a device array, read only when you ask, e.g. with ``float``).

    With ``capture=True`` (the default) and every batch argument a CuPy array, the step is captured as a CUDA
    graph per batch signature (shapes, dtypes, device): the first ``warmup`` calls run eagerly (kernels are
    compiled, cuDNN plans autotuned), the next records one step into a graph (on a stream and a memory pool of
    its own) and runs it, and every later call copies the batch into the graph's input buffers and replays it.
    A batch of another shape (the last, partial one) gets its own warm-up and graph. The replayed step is the
    captured one: the model, the optimiser state and BatchNorm's running statistics change on the device as an
    eager step changes them, and Adam's bias correction advances on the device and on the host alike. After
    ``adjust``, ``freeze`` or ``thaw`` (a learning-rate schedule) the next call steps eagerly and the one after
    captures the step again.

    Where a step cannot be captured (an op that needs the host mid-step, e.g. Dropout given a NumPy generator, or an
    optimiser whose step is a host number), that signature runs eagerly from then on, with one
    :class:`CaptureWarning` naming the reason, and the optimiser state as it was before the attempt. On the
    CPU, or with ``capture=False``, every call is the eager step.

    Unlike :func:`fluxpy.train` (which takes ``capture=True`` too, and keeps its checks), a step does no check of
    its own: read the loss when you want to know it.

    >>> import numpy as np
    >>> from fluxpy.layers import Dense
    >>> from fluxpy.optimise import Adam, setup
    >>> m = Dense(2, 1, rng=0)
    >>> step = TrainStep(lambda m, x: (m(x) ** 2).sum(), m, setup(Adam(0.1), m))
    >>> losses = [float(step(np.ones((4, 2), np.float32))) for _ in range(20)]
    >>> losses[-1] < losses[0]
    True
    """

    def __init__(self, loss: Callable, model: Any, opt_state: Any, *, capture: bool = True, warmup: int = 2) -> None:
        if not callable(loss):
            raise TypeError(f"TrainStep expects loss to be a function loss(model, *batch), got {type(loss).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"TrainStep expects warmup to be an int >= 1 (eager steps before capturing), got "
                             f"{warmup!r}")
        self.loss, self.model, self.opt_state = loss, model, opt_state
        self.capture, self.warmup = bool(capture), warmup
        self._signatures: dict = {}

    def __call__(self, *batch: Any) -> Any:
        entry = self._entry_for(batch)
        if entry is None:
            return self._eager(batch)
        outputs, commit, _ = self._launch(entry, batch)
        commit()
        return outputs[0].copy()   # the graph writes the next step's loss into the same buffer

    def captured(self) -> dict:
        """Per batch signature ``(device, shape, dtype) per argument``: ``"captured"``, ``"warming up"`` or why it
        runs eagerly."""
        return {key: ("captured" if e.graph is not None else e.eager_because or "warming up")
                for key, e in self._signatures.items()}

    # -- the step itself, eager and as the captured function -----------------------------------------

    def _eager(self, batch):
        who = "TrainStep (a step of batch " + ", ".join(str(tuple(getattr(b, "shape", ()))) for b in batch) + ")"
        value, (grad,) = undone_on_out_of_memory(who, withgradient, lambda m: self.loss(m, *batch), self.model)
        update(self.opt_state, self.model, grad)
        return value

    def _captured_outputs(self, inputs):
        """The step run while capturing; the arrays the graph writes that a call returns (the loss first)."""
        return (self._eager(inputs),)

    # -- signatures, capture and launch -------------------------------------------------------------

    def _signature(self, batch):
        if not self.capture or not batch:
            return None
        key = []
        for b in batch:
            device = gpu_device(b)
            if device is None:
                return None
            key.append((device, tuple(b.shape), b.dtype.str))
        return tuple(key)

    def _entry_for(self, batch):
        """The captured signature of ``batch``, capturing it now if its warm-up is over; None: step eagerly."""
        key = self._signature(batch)
        if key is None:
            return None
        entry = self._signatures.get(key)
        if entry is None:
            entry = self._signatures[key] = _Signature()
        if entry.graph is not None and entry.config_changed():
            entry.graph, entry.seen = None, self.warmup - 1   # one eager step with the new rules, then capture again
        if entry.eager_because is not None or entry.seen < self.warmup:
            entry.seen += 1
            return None
        if entry.graph is None and not self._capture(entry, batch):
            return None
        return entry

    def _capture(self, entry, batch):
        """Record the step into a graph (not run yet); False, after one warning, where it cannot be captured."""
        inputs = [get_array_module(b).empty_like(b) for b in batch]
        before = [(leaf, leaf.state) for leaf in Plan.leaves(self.opt_state)]
        try:
            with recording() as hooks:
                graph, outputs = capture_graph(lambda: self._captured_outputs(inputs))
        except Exception as err:   # nothing ran on the GPU: put the host-side optimiser state back, step eagerly
            _restore(before)
            entry.eager_because = f"{type(err).__name__}: {err}"
            warnings.warn(f"TrainStep: the step cannot be captured as a CUDA graph, so batches of this shape run "
                          f"eagerly ({entry.eager_because})", CaptureWarning, stacklevel=4)
            return False
        entry.graph, entry.inputs, entry.outputs, entry.hooks = graph, inputs, outputs, tuple(hooks)
        entry.before, entry.fresh = before, True
        entry.config = [(leaf, leaf.rule, leaf.frozen) for leaf, _ in before]
        return True

    def _launch(self, entry, batch):
        """Copy ``batch`` into the graph's inputs and launch it: ``(outputs, commit, undo)``. ``commit()`` brings the
        host side of the optimiser up to the step (the replay hooks); ``undo()`` puts it back where a checked
        step's update was skipped on the device. The first launch's host side ran during the capture."""
        for dst, src in zip(entry.inputs, batch):
            copy_into(dst, src)
        graph: CapturedGraph = entry.graph
        graph.launch()
        if entry.fresh:
            entry.fresh = False
            before = entry.before
            return entry.outputs, _nothing, lambda: _restore(before)
        hooks = entry.hooks
        return entry.outputs, lambda: _run_hooks(hooks), _nothing


def _nothing():
    return None


def _run_hooks(hooks):
    """Every replay hook, then the first error one raised (an index check's report): the optimiser's host
    bookkeeping after it must still follow the replay that ran."""
    error = None
    for hook in hooks:
        try:
            hook()
        except Exception as err:   # re-raised below, once the rest have run
            error = error or err
    if error is not None:
        raise error


def _restore(states):
    for leaf, state in states:
        leaf.state = state


class CheckedStep(TrainStep):
    """The captured step that :func:`fluxpy.train` runs: the graph also computes a device flag that is finite only
    where the loss (and, with ``check_gradients``, every gradient) is, and the update runs on the device only where
    it is (:func:`fluxpy.capturing.guarding`). The flag is sticky: once a replay finds a value that is not finite,
    every later replay skips its update too, until :meth:`clear_trip`, so that train may read a step's flag
    after the next step was launched and still stop with the model as it was before the bad step.

    The model is held weakly where it can be (train keeps one per model across its calls, and must not keep the
    model alive); a dict or list model is held as it is.
    """

    def __init__(self, loss: Callable, model: Any, opt_state: Any, *, check_gradients: bool = True,
                 warmup: int = 2) -> None:
        super().__init__(loss, model, opt_state, capture=True, warmup=warmup)
        self.check_gradients = check_gradients
        self._tripped = None   # a device float64: 0, or NaN once a replay skipped its update

    @property
    def model(self) -> Any:
        return self._model()

    @model.setter
    def model(self, model: Any) -> None:
        try:
            self._model = weakref.ref(model)
        except TypeError:   # a dict or list model: held as it is (train then makes a new step per call)
            self._model = lambda: model

    def _capture(self, entry, batch):
        if self._tripped is None:   # outside the capture: a zero-fill in the graph would clear it at every replay
            self._tripped = get_array_module(batch[0]).zeros((), np.float64)
        return super()._capture(entry, batch)

    def _captured_outputs(self, inputs):
        value, (grad,) = withgradient(lambda m: self.loss(m, *inputs), self.model)
        plan = Plan(self.opt_state, self.model, grad, "train")
        # the gradients train checks, and those a rule refuses when not finite (ClipNorm): the device skips the
        # update where one is not, and train's eager step then raises
        total = Plan.finite_total([value] + plan.gradients(self.check_gradients))
        guard = total + self._tripped
        copy_into(self._tripped, guard)
        with guarding(guard):
            plan.apply()
        if self.loss_scaled:
            self.model.loss_scaler.advance(total, guard)
        return value, guard, total

    @property
    def loss_scaled(self) -> bool:
        """Whether the model has a dynamic loss scale (fluxpy.MixedPrecision in float16): a step whose own
        gradients overflow is then skipped, not an error."""
        return getattr(self.model, "loss_scaler", None) is not None

    def run(self, *batch: Any) -> Flight | None:
        """Launch the step of ``batch`` (capturing it first where its warm-up is over); None: step it eagerly."""
        entry = self._entry_for(batch)
        return None if entry is None else self._fly(entry, batch)

    def replay(self, *batch: Any) -> Flight | None:
        """Launch the step of ``batch`` where its graph is ready (no warm-up step, no capture, no change of rule
        since); None otherwise (then :meth:`run` it, after reading what flies)."""
        key = self._signature(batch)
        entry = self._signatures.get(key) if key is not None else None
        if entry is None or entry.graph is None or entry.config_changed():
            return None
        return self._fly(entry, batch)

    def clear_trip(self) -> None:
        """Let the replays queued from now on update again (after a skipped step was dealt with)."""
        if self._tripped is not None:
            self._tripped.fill(0)

    def _fly(self, entry, batch):
        (value, guard, total), commit, undo = self._launch(entry, batch)
        return Flight(start_reading_scalars(value, guard, total), commit, undo)


class Flight:
    """A launched :class:`CheckedStep`: its loss, its (sticky) guard flag and its own gradients' flag on their way
    to the host, and what to do on the host once they are read: ``commit()`` where the update ran on the device
    (the guard is finite), ``undo()`` where it was skipped."""
    __slots__ = ("read", "commit", "undo", "batch")

    def __init__(self, read: ScalarsRead, commit: Callable[[], None], undo: Callable[[], None]) -> None:
        self.read, self.commit, self.undo, self.batch = read, commit, undo, None
