"""Optimisers in the style of Optimisers.jl: rules, a state tree, in-place updates.

A *rule* (``Adam(1e-3)``) says how a gradient becomes a step. ``setup(rule, model)`` returns a
state tree shaped like the model (dicts for objects, tuples/lists mirrored) with a :class:`Leaf`
(rule + per-array state) at every trainable float array and ``None`` elsewhere.
``update(state, model, grad)`` takes the gradient tree that ``fluxpy.gradient`` returns for
the model and subtracts each step from the model's arrays IN PLACE.

- :mod:`~fluxpy.optimise.rules`: every rule, its state and its ONE formula (:mod:`~fluxpy.optimise.formula`);
- :mod:`~fluxpy.optimise.update`: ``setup``, ``update``, ``adjust``, ``freeze``/``thaw`` and :class:`Plan`, the
  checked plan of a step that ``update``, :func:`fluxpy.train` and :class:`fluxpy.TrainStep` share;
- :mod:`~fluxpy.optimise.multi`: the leaves stepped in groups by their rules' formulas, on the GPU by kernels
  generated from them (:mod:`fluxpy.kernels.cuda_optimise`).

Update formulas are Optimisers.jl's. A rule's ``apply(state, x, dx) -> (state, step)`` uses the
array module of ``x`` (NumPy or CuPy) and never modifies ``dx``.

>>> import numpy as np
>>> import fluxpy
>>> model = {"w": np.array([1.0, -2.0]), "b": np.zeros(1)}
>>> state = setup(Adam(0.1), model)
>>> loss = lambda m: ((m["w"] * 3.0 + m["b"]) ** 2).sum()
>>> for _ in range(3):
...     grad, = fluxpy.gradient(loss, model)
...     state, model = update(state, model, grad)
>>> model["w"].round(2)
array([ 0.7, -1.7])
"""
from .base import Rule
from .clip import clip_grad_norm
from .rules import (AccumGrad, AdaBelief, AdaDelta, AdaGrad, AdaMax, Adam, AdamW, AMSGrad, ClipGrad, ClipNorm,
                    Descent, Lion, Momentum, NAdam, Nesterov, OAdam, OptimiserChain, RAdam, RMSProp, Rprop, SignDecay,
                    WeightDecay)
from .update import Leaf, Plan, adjust, freeze, setup, thaw, update
from .update import _leaves, _state_arrays   # noqa: F401  (tests and tools that walk a state tree)

_finite_total, _read_finite = Plan.finite_total, Plan.is_finite   # the names older callers use

__all__ = ["Rule", "Descent", "Momentum", "Nesterov", "RMSProp", "Adam", "AdamW", "WeightDecay", "ClipGrad",
           "ClipNorm", "OptimiserChain", "AdaGrad", "AdaDelta", "AdaMax", "NAdam", "RAdam", "OAdam", "AdaBelief",
           "Lion", "SignDecay", "AccumGrad", "AMSGrad", "Rprop", "Leaf", "setup", "update", "adjust", "freeze",
           "thaw", "Plan", "clip_grad_norm"]
