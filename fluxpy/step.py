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
from collections.abc import Callable
from typing import Any

from .autodiff import withgradient
from .backend import CapturedGraph, capture_graph, copy_into, get_array_module, gpu_device
from .capturing import recording
from .optimise import _leaves, update

__all__ = ["TrainStep", "CaptureWarning"]


class CaptureWarning(UserWarning):
    """A :class:`TrainStep` could not capture its step as a CUDA graph and runs it eagerly; the message names why.

    >>> issubclass(CaptureWarning, UserWarning)
    True
    """


class _Signature:
    """What :class:`TrainStep` keeps per batch signature: eager steps so far, and the captured graph with its
    input buffers, its loss, and the host-side hooks to run after each replay (or why it runs eagerly)."""
    __slots__ = ("seen", "graph", "inputs", "loss", "hooks", "eager_because", "config")

    def __init__(self):
        self.seen, self.graph, self.inputs, self.loss, self.hooks, self.eager_because = 0, None, None, None, (), None
        self.config = ()

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

    Where a step cannot be captured (an op that needs the host mid-step, e.g. Dropout's generator, or an
    optimiser whose step is a host number), that signature runs eagerly from then on, with one
    :class:`CaptureWarning` naming the reason, and the optimiser state as it was before the attempt. On the
    CPU, or with ``capture=False``, every call is the eager step.

    Unlike :func:`fluxpy.train`, a step does no check of its own (no read of the loss, no finite-gradient check):
    read the loss when you want to know it.

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
        key = self._signature(batch)
        if key is None:
            return self._eager(batch)
        entry = self._signatures.get(key)
        if entry is None:
            entry = self._signatures[key] = _Signature()
        if entry.graph is not None and entry.config_changed():
            entry.graph, entry.seen = None, self.warmup - 1   # one eager step with the new rules, then capture again
        if entry.eager_because is not None or entry.seen < self.warmup:
            entry.seen += 1
            return self._eager(batch)
        if entry.graph is None:
            return self._capture(entry, batch)
        return self._replay(entry, batch)

    def captured(self) -> dict:
        """Per batch signature ``(device, shape, dtype) per argument``: ``"captured"``, ``"warming up"`` or why it
        runs eagerly."""
        return {key: ("captured" if e.graph is not None else e.eager_because or "warming up")
                for key, e in self._signatures.items()}

    # -- the three ways to run a step ----------------------------------------------------------------

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

    def _eager(self, batch):
        value, (grad,) = withgradient(lambda m: self.loss(m, *batch), self.model)
        update(self.opt_state, self.model, grad)
        return value

    def _capture(self, entry, batch):
        inputs = [get_array_module(b).empty_like(b) for b in batch]
        for dst, src in zip(inputs, batch):
            copy_into(dst, src)
        before = [(leaf, leaf.state) for leaf in _leaves(self.opt_state)]
        try:
            with recording() as hooks:
                graph, loss = capture_graph(lambda: self._eager(inputs))
        except Exception as err:   # nothing ran on the GPU: put the host-side optimiser state back, step eagerly
            for leaf, state in before:
                leaf.state = state
            entry.eager_because = f"{type(err).__name__}: {err}"
            warnings.warn(f"TrainStep: the step cannot be captured as a CUDA graph, so batches of this shape run "
                          f"eagerly ({entry.eager_because})", CaptureWarning, stacklevel=3)
            return self._eager(batch)
        entry.graph, entry.inputs, entry.loss, entry.hooks = graph, inputs, loss, tuple(hooks)
        entry.config = [(leaf, leaf.rule, leaf.frozen) for leaf, _ in before]
        graph.launch()   # the capture queued nothing: this is the step of this batch (its host side ran already)
        return loss.copy()

    def _replay(self, entry, batch):
        for dst, src in zip(entry.inputs, batch):
            copy_into(dst, src)
        graph: CapturedGraph = entry.graph
        graph.launch()
        for hook in entry.hooks:
            hook()
        return entry.loss.copy()   # the graph writes the next step's loss into the same buffer
