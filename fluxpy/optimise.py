"""Optimisers in the style of Optimisers.jl: rules, a state tree, in-place updates.

A *rule* (``Adam(1e-3)``) says how a gradient becomes a step. ``setup(rule, model)`` returns a
state tree shaped like the model (dicts for objects, tuples/lists mirrored) with a :class:`Leaf`
(rule + per-array state) at every trainable float array and ``None`` elsewhere.
``update(state, model, grad)`` takes the gradient tree that ``fluxpy.gradient`` returns for
the model and subtracts each step from the model's arrays IN PLACE.

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
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar

import numpy as np

from .autodiff import value_of
from .backend import Array, get_array_module, is_array, is_float_array, is_float_dtype
from .capturing import capturing, current_guard, guarding, on_replay, refuse
from .kernels import find
from .kernels.halfs import is_half
from .functors import _trainable_keys, children

__all__ = ["Rule", "Descent", "Momentum", "Nesterov", "RMSProp", "Adam", "AdamW", "WeightDecay", "ClipGrad",
           "ClipNorm", "OptimiserChain", "AdaGrad", "AdaDelta", "AdaMax", "NAdam", "RAdam", "OAdam", "AdaBelief",
           "Lion", "SignDecay", "AccumGrad", "Leaf", "setup", "update", "adjust", "freeze", "thaw"]


class Rule:
    """Base class of optimisation rules.

    Subclasses define ``init(x) -> state`` (per-array state, e.g. moment estimates) and
    ``apply(state, x, dx) -> (state, step)``; ``update`` then calls ``step``, which does
    ``x -= step``. ``apply`` may update its state arrays in place but must not modify ``dx``. A rule
    with a fused kernel (one launch that updates ``x`` and its state) overrides ``step``: it looks
    the kernel up by name (:func:`fluxpy.kernels.find`), unpacks its own state for it, and falls
    back to ``Rule.step`` where none is found.

    >>> import numpy as np
    >>> class SignDescent(Rule):
    ...     def apply(self, state, x, dx):
    ...         return state, 0.1 * np.sign(dx)
    >>> w = np.array([1.0, 1.0])
    >>> _ = update(setup(SignDescent(), w), w, np.array([3.0, -0.5]))
    >>> w
    array([0.9, 1.1])
    """

    #: Whether the rule refuses a NaN or infinite gradient (``ClipNorm(throw=True)``): :func:`update` then checks
    #: the gradients of its arrays for non-finite values (one reduction over all of them) before changing any.
    needs_finite = False

    def __post_init__(self) -> None:
        """Every hyperparameter checked by its name (:data:`_HYPERPARAMETERS`; a rule's ``_LIMITS`` adds or
        overrides), when the rule is made and when :func:`adjust` makes it again: a bad value is a ``ValueError``
        naming the rule, the field and the value, before any update (PyTorch's optimisers check theirs too)."""
        limits = {**_HYPERPARAMETERS, **getattr(type(self), "_LIMITS", {})}
        for field in dataclasses.fields(self) if dataclasses.is_dataclass(self) else ():
            rule = limits.get(field.name)
            value = getattr(self, field.name)
            if rule is not None and not rule[0](value):
                raise ValueError(f"{type(self).__name__}: {field.name} must be {rule[1]}, got {value!r}")

    def init(self, x: Array) -> Any:
        return None

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        raise NotImplementedError

    def check(self, x: Array, dx: Array) -> None:
        """Raise (a ``ValueError``) if this rule refuses the gradient ``dx`` of ``x``; nothing by default.

        :func:`update` calls it, before any array or state changes, for an array whose gradient is
        not finite when the rule sets ``needs_finite``.
        """

    def step(self, state: Any, x: Array, dx: Array) -> Any:
        """``x -= step`` in place; returns the new state. A float16/bfloat16 parameter steps in float32 (its state
        is float32, :func:`setup`) and is rounded once back to its type."""
        if is_half(x.dtype):
            wide = x.astype(np.float32)
            state, step = self.apply(state, wide, dx.astype(np.float32))
            if step is not None:
                wide -= step
                x[...] = wide.astype(x.dtype)
            return state
        state, step = self.apply(state, x, dx)
        if step is not None:   # None: no step this time (AccumGrad between its updates)
            x -= step
        return state

    def guarded_kernel(self, x: Array, dx: Array) -> bool:
        """Whether :meth:`step` of ``x`` runs one kernel that skips itself on the device where the step's guard
        flag is not finite (:func:`fluxpy.capturing.guarding`); a rule without one refuses a checked capture.

        >>> import numpy as np
        >>> Descent().guarded_kernel(np.ones(2), np.ones(2))   # NumPy: no kernel
        False
        """
        return False


def _finite(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _pair(v, closed: bool) -> bool:
    return (isinstance(v, tuple) and len(v) == 2 and all(_finite(b) and 0 <= b and (b <= 1 if closed else b < 1)
                                                        for b in v))


#: What a hyperparameter of each name must be: ``(test, description)``.
_HYPERPARAMETERS = {
    "eta": (lambda v: _finite(v) and v >= 0, "the learning rate, a finite number >= 0"),
    "rho": (lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "eps": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "lambd": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "beta": (lambda v: _pair(v, closed=False), "a tuple (b1, b2) of numbers in [0, 1)"),
    "delta": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "omega": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "p": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0,
          "a number > 0 (math.inf: the largest entry)"),
    "centred": (lambda v: isinstance(v, bool), "True or False"),
    "throw": (lambda v: isinstance(v, bool), "True or False"),
}


def _guard() -> dict:
    """The keyword a guarded update kernel takes: ``{"ok": flag}`` inside :func:`fluxpy.capturing.guarding`."""
    flag = current_guard()
    return {} if flag is None else {"ok": flag}


class _FusedStep(Rule):
    """A rule whose step, where the kernel table has its fused kernel ``KERNEL`` for the arrays (the GPU:
    :mod:`fluxpy.kernels.elementwise`), is that one kernel, which takes the step's guard; elsewhere the array path
    (:meth:`Rule.step` over ``apply``). A subclass names the kernel and says what it takes after ``x, dx``."""
    KERNEL: ClassVar[str] = ""

    def kernel_args(self, state: Any) -> tuple:
        """The fused kernel's arguments after ``x, dx``: the state's arrays (updated in place), then the
        hyperparameters."""
        raise NotImplementedError

    def step(self, state: Any, x: Array, dx: Array) -> Any:
        kernel = find(self.KERNEL, x, dx)
        if kernel is None:
            return Rule.step(self, state, x, dx)
        kernel(x, dx, *self.kernel_args(state), **_guard())
        return state

    def guarded_kernel(self, x: Array, dx: Array) -> bool:
        return find(self.KERNEL, x, dx) is not None


@dataclasses.dataclass(frozen=True)
class Descent(_FusedStep):
    """Plain gradient descent, ``step = eta * dx``.

    >>> import numpy as np
    >>> w = np.array([1.0, 2.0])
    >>> _ = update(setup(Descent(0.1), w), w, np.array([1.0, -1.0]))
    >>> w
    array([0.9, 2.1])
    """
    eta: float = 0.1

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        return state, self.eta * dx

    KERNEL = "descent_update"

    def kernel_args(self, state: Any) -> tuple:
        return (self.eta,)


@dataclasses.dataclass(frozen=True)
class Momentum(_FusedStep):
    """Gradient descent with momentum: ``v = rho v + eta dx``, ``step = v``.

    PyTorch's ``SGD(lr=eta, momentum=rho)`` (its buffer is ``v / eta``).

    >>> import numpy as np
    >>> w = np.zeros(1)
    >>> st = setup(Momentum(0.1, 0.5), w)
    >>> for _ in range(2):
    ...     st, w = update(st, w, np.ones(1))
    >>> w   # -(0.1) - (0.05 + 0.1)
    array([-0.25])
    """
    eta: float = 0.01
    rho: float = 0.9

    def init(self, x: Array) -> Any:
        return get_array_module(x).zeros_like(x)

    def apply(self, v: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        v *= self.rho
        v += self.eta * dx
        return v, v

    KERNEL = "momentum_update"

    def kernel_args(self, v: Any) -> tuple:
        return (v, self.eta, self.rho)


@dataclasses.dataclass(frozen=True)
class Nesterov(Rule):
    """Nesterov momentum, as Optimisers.jl writes it.

    ``step = (1 + rho) eta dx - rho^2 v`` then ``v = rho v - eta dx``; the same steps as
    PyTorch's ``SGD(lr=eta, momentum=rho, nesterov=True)``.

    >>> import numpy as np
    >>> w = np.zeros(1)
    >>> _ = update(setup(Nesterov(0.1, 0.5), w), w, np.ones(1))
    >>> w
    array([-0.15])
    """
    eta: float = 0.001
    rho: float = 0.9

    def init(self, x: Array) -> Any:
        return get_array_module(x).zeros_like(x)

    def apply(self, vel: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        eta, rho = self.eta, self.rho
        step = ((1 + rho) * eta) * dx - (rho * rho) * vel
        vel *= rho
        vel -= eta * dx
        return vel, step


@dataclasses.dataclass(frozen=True)
class RMSProp(Rule):
    """RMSProp: the gradient divided by a running root mean square of past gradients.

    ``quad = rho quad + (1 - rho) dx^2``; if centred also ``lin = rho lin + (1 - rho) dx``;
    ``step = eta dx / (sqrt(quad - lin^2) + eps)`` (eps outside the root, as Optimisers.jl and
    PyTorch's ``RMSprop(alpha=rho, centered=...)``).

    >>> import numpy as np
    >>> w = np.zeros(1)
    >>> _ = update(setup(RMSProp(0.01, 0.9, 0.0), w), w, np.ones(1))
    >>> w.round(5)   # -0.01 / sqrt(0.1)
    array([-0.03162])
    """
    eta: float = 0.001
    rho: float = 0.9
    eps: float = 1e-8
    centred: bool = False

    def init(self, x: Array) -> Any:
        xp = get_array_module(x)
        return xp.zeros_like(x), (xp.zeros_like(x) if self.centred else None)

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        xp = get_array_module(x)
        quad, lin = state
        rho = self.rho
        quad *= rho
        quad += (1 - rho) * (dx * dx)
        if lin is not None:
            lin *= rho
            lin += (1 - rho) * dx
            rms = xp.sqrt(quad - lin * lin)
        else:
            rms = xp.sqrt(quad)
        rms += self.eps
        return state, (self.eta * dx) / rms


def _adam_direction(state, dx, beta, eps, xp):
    """Updates Adam's moments in place; returns the bias-corrected ``m / (sqrt(v) + eps)`` and the new state."""
    refuse(_ALONE_IN_CAPTURE)
    m, v, (b1t, b2t) = state
    b1, b2 = beta
    m *= b1
    m += (1 - b1) * dx
    v *= b2
    v += (1 - b2) * (dx * dx)
    denom = xp.sqrt(v * (1 / (1 - b2t)))
    denom += eps
    return (m * (1 / (1 - b1t))) / denom, (m, v, (b1t * b1, b2t * b2))


_ALONE_IN_CAPTURE = ("Adam/AdamW stepping a parameter on its own (not in one multi-tensor launch with the others): "
                     "its bias correction 1 / (1 - beta^t) is a host number, which a CUDA graph would freeze")


def _adam_init(x, beta):
    xp = get_array_module(x)
    return xp.zeros_like(x), xp.zeros_like(x), tuple(beta)


@dataclasses.dataclass(frozen=True)
class Adam(Rule):
    """Adam: steps from bias-corrected running moments of the gradient.

    ``m = b1 m + (1 - b1) dx``, ``v = b2 v + (1 - b2) dx^2``,
    ``step = eta (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``: Optimisers.jl's bias
    correction (the same as PyTorch's ``Adam``).

    >>> import numpy as np
    >>> w = np.zeros(2)
    >>> _ = update(setup(Adam(0.1), w), w, np.array([5.0, -0.01]))
    >>> w.round(6)   # the first step is eta * sign(dx)
    array([-0.1,  0.1])
    """
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    eps: float = 1e-8

    def init(self, x: Array) -> Any:
        return _adam_init(x, self.beta)

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        direction, state = _adam_direction(state, dx, self.beta, self.eps, get_array_module(x))
        direction *= self.eta
        return state, direction

    def step(self, state: Any, x: Array, dx: Array) -> Any:
        kernel = find("adam_update", x, dx)
        if kernel is None:
            return Rule.step(self, state, x, dx)
        refuse(_ALONE_IN_CAPTURE)
        m, v, (b1t, b2t) = state
        return m, v, kernel(x, dx, m, v, self.eta, self.beta, self.eps, b1t, b2t)


@dataclasses.dataclass(frozen=True)
class AdamW(Rule):
    """Adam with decoupled weight decay.

    ``step = eta (adam_direction + lambd x)``, i.e. Optimisers.jl's
    ``OptimiserChain(Adam(eta, beta, eps), WeightDecay(eta * lambd))`` and PyTorch's
    ``AdamW(lr=eta, weight_decay=lambd)``. One rule, so ``adjust(state, eta)`` scales the decay too.

    >>> import numpy as np
    >>> w = np.ones(1)
    >>> _ = update(setup(AdamW(0.1, lambd=0.5), w), w, np.ones(1))
    >>> w.round(6)   # 1 - 0.1 * (1 + 0.5)
    array([0.85])
    """
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    lambd: float = 0.0
    eps: float = 1e-8

    def init(self, x: Array) -> Any:
        return _adam_init(x, self.beta)

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        direction, state = _adam_direction(state, dx, self.beta, self.eps, get_array_module(x))
        if self.lambd:
            direction += self.lambd * x
        direction *= self.eta
        return state, direction


@dataclasses.dataclass(frozen=True)
class WeightDecay(Rule):
    """Adds ``lambd * x`` to the gradient (L2 regularisation).

    Put it before the optimiser in a chain: ``OptimiserChain(WeightDecay(1e-2), Adam(3e-4))``.

    >>> import numpy as np
    >>> w = np.array([2.0])
    >>> _ = update(setup(OptimiserChain(WeightDecay(0.5), Descent(0.1)), w), w, np.zeros(1))
    >>> w
    array([1.9])
    """
    lambd: float = 5e-4

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        return state, dx + self.lambd * x


@dataclasses.dataclass(frozen=True)
class ClipGrad(Rule):
    """Clamps every gradient entry to ``[-delta, delta]``.

    >>> import numpy as np
    >>> w = np.zeros(2)
    >>> _ = update(setup(OptimiserChain(ClipGrad(1.0), Descent(1.0)), w), w, np.array([5.0, -0.5]))
    >>> w
    array([-1. ,  0.5])
    """
    delta: float = 10.0

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        return state, get_array_module(x).clip(dx, -self.delta, self.delta)


@dataclasses.dataclass(frozen=True)
class ClipNorm(Rule):
    """Rescales each array's gradient so that its ``p``-norm is at most ``omega``.

    With ``throw`` a non-finite norm is an error naming the array's shape.

    >>> import numpy as np
    >>> w = np.zeros(2)
    >>> _ = update(setup(OptimiserChain(ClipNorm(1.0), Descent(1.0)), w), w, np.array([3.0, 4.0]))
    >>> w
    array([-0.6, -0.8])
    """
    omega: float = 10.0
    p: float = 2
    throw: bool = True

    # With throw, update checks every gradient for NaN/Inf before changing anything, so that a refused
    # gradient leaves the whole model as it was (the check in apply stays, for a chain whose earlier rules
    # make a finite gradient infinite).
    needs_finite = property(lambda self: self.throw)

    def check(self, x: Array, dx: Array) -> None:
        self._norm(x, dx)

    def _norm(self, x, dx):
        xp = get_array_module(x)
        norm = xp.linalg.norm(dx.ravel(), ord=self.p)
        # As Flux's ClipNorm: with throw, the check reads the norm on the host (a sync on the GPU).
        if self.throw and not bool(xp.isfinite(norm)):
            raise ValueError(f"ClipNorm: the gradient has {self.p}-norm {float(norm)}, for an array of shape "
                             f"{tuple(x.shape)} and dtype {x.dtype}")
        return norm

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        xp = get_array_module(x)
        norm = self._norm(x, dx)
        with np.errstate(divide="ignore"):   # a zero gradient: scale by min(1, inf) = 1
            scale = xp.minimum(1, self.omega / norm)
        return state, dx * scale.astype(dx.dtype)


class OptimiserChain(Rule):
    """Applies its rules in turn, each to the previous one's step.

    >>> import numpy as np
    >>> OptimiserChain(ClipGrad(1.0), Adam())
    OptimiserChain(ClipGrad(delta=1.0), Adam(eta=0.001, beta=(0.9, 0.999), eps=1e-08))
    """

    def __init__(self, *rules: Rule) -> None:
        for r in rules:
            _check_rule(r, "OptimiserChain")
        self.rules = tuple(rules)
        self.needs_finite = any(r.needs_finite for r in self.rules)

    def __repr__(self):
        return f"OptimiserChain({', '.join(map(repr, self.rules))})"

    def __eq__(self, other):
        return type(other) is OptimiserChain and other.rules == self.rules

    __hash__ = None

    def init(self, x: Array) -> Any:
        return tuple(r.init(x) for r in self.rules)

    def check(self, x: Array, dx: Array) -> None:
        for r in self.rules:
            r.check(x, dx)

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        new = list(state)
        for i, rule in enumerate(self.rules):
            if dx is None:   # an earlier rule holds this step back (AccumGrad): the rest keep their state
                break
            new[i], dx = rule.apply(state[i], x, dx)
        return tuple(new), dx


_HOST_COUNTERS = ("an Optimisers.jl rule with host-side counters (beta^t, a step count) stepping inside a CUDA "
                  "graph capture: the graph would freeze them; use Adam, AdamW, Momentum, Descent, AdaGrad, AdaDelta, "
                  "Lion or SignDecay in a captured step, or run this rule eagerly")


def _moments(state, dx, beta):
    """Adam's moments updated in place: ``m = b1 m + (1 - b1) dx``, ``v = b2 v + (1 - b2) dx^2``."""
    m, v = state[0], state[1]
    b1, b2 = beta
    m *= b1
    m += (1 - b1) * dx
    v *= b2
    v += (1 - b2) * (dx * dx)
    return m, v


def _zeros2(x, beta):
    xp = get_array_module(x)
    return xp.zeros_like(x), xp.zeros_like(x), tuple(beta)


@dataclasses.dataclass(frozen=True)
class _MomentRule(Rule):
    """The fields and the state of the Adam-like rules below: ``eta``, ``beta``, ``eps``; two moment arrays and
    ``beta^t``."""
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    eps: float = 1e-8
    KERNEL: ClassVar[str] = ""   # the fused step: kernel(x, dx, m, v, eta, beta, eps, b1t, b2t) -> beta^t advanced

    def init(self, x: Array) -> Any:
        return _zeros2(x, self.beta)

    def step(self, state: Any, x: Array, dx: Array) -> Any:
        """The fused kernel where the table has one (it refuses a capture: ``beta^t`` is a host number), else the
        array path."""
        kernel = find(self.KERNEL, x, dx)
        if kernel is None:
            return Rule.step(self, state, x, dx)
        refuse(_HOST_COUNTERS)
        return self._fused(kernel, state, x, dx)

    def _fused(self, kernel: Any, state: Any, x: Array, dx: Array) -> Any:
        """The state after ``kernel``'s step of ``x`` (a rule with more state says how it calls its kernel)."""
        m, v, (b1t, b2t) = state
        return m, v, kernel(x, dx, m, v, self.eta, self.beta, self.eps, b1t, b2t)


@dataclasses.dataclass(frozen=True)
class AdaGrad(_FusedStep):
    """AdaGrad (Optimisers.jl's): ``acc += dx^2`` (``acc`` starts at ``eps``), ``step = eta dx / (sqrt(acc) + eps)``.

    >>> import numpy as np
    >>> w = np.zeros(1)
    >>> _ = update(setup(AdaGrad(0.1), w), w, np.array([2.0]))
    >>> w.round(6)
    array([-0.1])
    """
    eta: float = 0.1
    eps: float = 1e-8

    def init(self, x: Array) -> Any:
        return get_array_module(x).full_like(x, self.eps)

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        state += dx * dx
        return state, dx * self.eta / (get_array_module(x).sqrt(state) + self.eps)

    KERNEL = "adagrad_update"

    def kernel_args(self, state: Any) -> tuple:
        return (state, self.eta, self.eps)


@dataclasses.dataclass(frozen=True)
class AdaDelta(_FusedStep):
    """AdaDelta (Optimisers.jl's): ``acc = rho acc + (1 - rho) dx^2``, ``step = dx sqrt(dacc + eps) / sqrt(acc + eps)``,
    then ``dacc = rho dacc + (1 - rho) step^2``; no learning rate.

    >>> import numpy as np
    >>> w = np.zeros(1)
    >>> _ = update(setup(AdaDelta(0.9, 1e-6), w), w, np.array([1.0]))
    >>> w.round(6)   # -sqrt(1e-6) / sqrt(0.1 + 1e-6)
    array([-0.003162])
    """
    rho: float = 0.9
    eps: float = 1e-8

    def init(self, x: Array) -> Any:
        xp = get_array_module(x)
        return xp.zeros_like(x), xp.zeros_like(x)

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        xp = get_array_module(x)
        acc, dacc = state
        acc *= self.rho
        acc += (1 - self.rho) * (dx * dx)
        step = dx * xp.sqrt(dacc + self.eps) / xp.sqrt(acc + self.eps)
        dacc *= self.rho
        dacc += (1 - self.rho) * (step * step)
        return state, step

    KERNEL = "adadelta_update"

    def kernel_args(self, state: Any) -> tuple:
        acc, dacc = state
        return (acc, dacc, self.rho, self.eps)


@dataclasses.dataclass(frozen=True)
class AdaMax(_MomentRule):
    """AdaMax, Adam on the infinity norm: ``u = max(b2 u, |dx|)``, ``step = eta / (1 - b1^t) m / (u + eps)``.

    >>> import numpy as np
    >>> w = np.zeros(1)
    >>> _ = update(setup(AdaMax(0.1), w), w, np.array([3.0]))
    >>> w.round(6)
    array([-0.1])
    """

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        refuse(_HOST_COUNTERS)
        xp = get_array_module(x)
        m, u, (b1t, b2t) = state
        b1, b2 = self.beta
        m *= b1
        m += (1 - b1) * dx
        u *= b2
        xp.maximum(u, xp.abs(dx), out=u)
        return (m, u, (b1t * b1, b2t * b2)), (self.eta / (1 - b1t)) * m / (u + self.eps)

    KERNEL = "adamax_update"


@dataclasses.dataclass(frozen=True)
class OAdam(_MomentRule):
    """Optimistic Adam: ``term = eta (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``, ``step = 2 term - term_prev``.

    >>> import numpy as np
    >>> w = np.zeros(1)
    >>> _ = update(setup(OAdam(0.1), w), w, np.array([1.0]))
    >>> w.round(6)   # twice Adam's first step
    array([-0.2])
    """
    beta: tuple = (0.5, 0.9)

    def init(self, x: Array) -> Any:
        return (*_zeros2(x, self.beta), get_array_module(x).zeros_like(x))

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        refuse(_HOST_COUNTERS)
        xp = get_array_module(x)
        m, v, (b1t, b2t), term = state
        _moments(state, dx, self.beta)
        prev = term.copy()
        term[...] = self.eta * m / (1 - b1t) / (xp.sqrt(v / (1 - b2t)) + self.eps)
        b1, b2 = self.beta
        return (m, v, (b1t * b1, b2t * b2), term), 2 * term - prev

    KERNEL = "oadam_update"

    def _fused(self, kernel: Any, state: Any, x: Array, dx: Array) -> Any:
        m, v, (b1t, b2t), term = state
        return m, v, kernel(x, dx, m, v, term, self.eta, self.beta, self.eps, b1t, b2t), term


@dataclasses.dataclass(frozen=True)
class NAdam(_MomentRule):
    """NAdam, Adam with Nesterov momentum (Optimisers.jl's formula):
    ``step = eta (b1 m / (1 - b1 b1^t) + (1 - b1) dx / (1 - b1^t)) / (sqrt(v b2 / (1 - b2^t)) + eps)``.

    >>> import numpy as np
    >>> w = np.zeros(1)
    >>> _ = update(setup(NAdam(0.1), w), w, np.array([1.0]))
    >>> float(w[0]) < 0
    True
    """

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        refuse(_HOST_COUNTERS)
        xp = get_array_module(x)
        m, v, (b1t, b2t) = state
        _moments(state, dx, self.beta)
        b1, b2 = self.beta
        step = (b1 * m / (1 - b1 * b1t) + (1 - b1) * dx / (1 - b1t)) / (xp.sqrt(v * b2 / (1 - b2t)) + self.eps)
        return (m, v, (b1t * b1, b2t * b2)), step * self.eta

    KERNEL = "nadam_update"


@dataclasses.dataclass(frozen=True)
class RAdam(_MomentRule):
    """Rectified Adam: Adam's step times ``r(t)`` once the variance estimate is trustworthy (``rho_t > 4``), plain
    bias-corrected momentum before (Optimisers.jl's formulas).

    >>> import numpy as np
    >>> w = np.zeros(1)
    >>> _ = update(setup(RAdam(0.1), w), w, np.array([1.0]))
    >>> w.round(6)   # the first steps are momentum: 0.1 * m / (1 - b1)
    array([-0.1])
    """
    def init(self, x: Array) -> Any:
        return (*_zeros2(x, self.beta), 1)

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        refuse(_HOST_COUNTERS)
        xp = get_array_module(x)
        m, v, (b1t, b2t), t = state
        _moments(state, dx, self.beta)
        b1, b2 = self.beta
        r = self._rectification(b2t, t)
        if r is not None:
            step = m / (1 - b1t) / (xp.sqrt(v / (1 - b2t)) + self.eps) * (self.eta * r)
        else:
            step = m / (1 - b1t) * self.eta
        return (m, v, (b1t * b1, b2t * b2), t + 1), step

    def _rectification(self, b2t, t):
        """``r(t)`` of step ``t`` (``b2t`` = b2^t), or None while ``rho_t <= 4`` (the warm-up: momentum alone)."""
        b2 = self.beta[1]
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * t * b2t / (1 - b2t)
        if rho > 4:
            return math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
        return None

    KERNEL = "radam_update"

    def _fused(self, kernel: Any, state: Any, x: Array, dx: Array) -> Any:
        m, v, (b1t, b2t), t = state
        bt = kernel(x, dx, m, v, self.eta, self.beta, self.eps, b1t, b2t, self._rectification(b2t, t))
        return m, v, bt, t + 1


@dataclasses.dataclass(frozen=True)
class AdaBelief(_MomentRule):
    """AdaBelief: Adam with the variance of the gradient around its mean, ``s = b2 s + (1 - b2) (dx - m)^2 + eps``,
    ``step = eta (m / (1 - b1^t)) / (sqrt(s / (1 - b2^t)) + eps)``.

    >>> import numpy as np
    >>> w = np.zeros(1)
    >>> _ = update(setup(AdaBelief(0.1), w), w, np.array([1.0]))
    >>> float(w[0]) < 0
    True
    """
    eps: float = 1e-16

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        refuse(_HOST_COUNTERS)
        xp = get_array_module(x)
        m, s, (b1t, b2t) = state
        b1, b2 = self.beta
        m *= b1
        m += (1 - b1) * dx
        d = dx - m
        s *= b2
        s += (1 - b2) * (d * d) + self.eps
        step = self.eta * m / (1 - b1t) / (xp.sqrt(s / (1 - b2t)) + self.eps)
        return (m, s, (b1t * b1, b2t * b2)), step

    KERNEL = "adabelief_update"


@dataclasses.dataclass(frozen=True)
class Lion(_FusedStep):
    """Lion: ``step = eta sign((b2 - b1) dx + b1 m)`` after ``m = b2 dx + (1 - b2) m`` (Optimisers.jl's form).

    >>> import numpy as np
    >>> w = np.zeros(2)
    >>> _ = update(setup(Lion(0.1), w), w, np.array([3.0, -0.01]))
    >>> w
    array([-0.1,  0.1])
    """
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    _LIMITS = {"beta": (lambda v: _pair(v, closed=True), "a tuple (b1, b2) of numbers in [0, 1]")}

    def init(self, x: Array) -> Any:
        return get_array_module(x).zeros_like(x)

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        b1, b2 = self.beta
        state *= 1 - b2
        state += b2 * dx
        return state, self.eta * get_array_module(x).sign((b2 - b1) * dx + b1 * state)

    KERNEL = "lion_update"

    def kernel_args(self, state: Any) -> tuple:
        return (state, self.eta, self.beta)


@dataclasses.dataclass(frozen=True)
class SignDecay(_FusedStep):
    """Adds ``lambd * sign(x)`` to the gradient (L1 regularisation); put it first in a chain.

    >>> import numpy as np
    >>> w = np.array([2.0, -2.0])
    >>> _ = update(setup(OptimiserChain(SignDecay(0.5), Descent(0.1)), w), w, np.zeros(2))
    >>> w
    array([ 1.95, -1.95])
    """
    lambd: float = 1e-3

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        kernel = find("sign_decay_gradient", x, dx)
        if kernel is not None:
            return state, kernel(x, dx, self.lambd)
        return state, dx + self.lambd * get_array_module(x).sign(x)

    KERNEL = "sign_decay_update"

    def kernel_args(self, state: Any) -> tuple:
        return (self.lambd,)


@dataclasses.dataclass(frozen=True)
class AccumGrad(Rule):
    """Accumulates ``n`` gradients and passes their mean on at every ``n``-th update (nothing in between):
    ``OptimiserChain(AccumGrad(n), Adam())`` trains with ``n`` times the batch a step.

    >>> import numpy as np
    >>> w = np.array([1.0])
    >>> st = setup(OptimiserChain(AccumGrad(2), Descent(0.1)), w)
    >>> _ = update(st, w, np.array([4.0])); w    # held back
    array([1.])
    >>> _ = update(st, w, np.array([2.0])); w    # the mean, 3, applied
    array([0.7])
    """
    n: int = 1

    def __post_init__(self):
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"AccumGrad must accumulate at least one gradient: n an int >= 1, got {self.n!r}")

    def init(self, x: Array) -> Any:
        return get_array_module(x).zeros_like(x), 1

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array | None]:
        refuse(_HOST_COUNTERS)
        acc, count = state
        kernel = find("accum_grad_update", acc, dx)
        if kernel is not None:
            kernel(acc, dx, self.n, count == 1)
        elif count == 1:
            acc[...] = dx / self.n
        else:
            acc += dx / self.n
        if count == self.n:
            return (acc, 1), acc
        return (acc, count + 1), None


def _check_rule(rule, where):
    if not isinstance(rule, Rule):
        raise TypeError(f"{where} expects optimisation rules such as Adam(1e-3), got {rule!r}")


# ---------------------------------------------------------------------------------------------
# The state tree


class Leaf:
    """The optimiser state of one array: its ``rule``, the rule's ``state`` and a ``frozen`` flag.

    >>> import numpy as np
    >>> setup(Descent(), np.ones(2))
    Leaf(Descent(eta=0.1))
    """
    __slots__ = ("rule", "state", "frozen", "_fits", "_steps", "_powers")

    def __init__(self, rule: Rule, state: Any, frozen: bool = False) -> None:
        self.rule = rule
        self.state = state
        self.frozen = frozen
        self._fits = None  # (id, type, shape, dtype) of the array that update last found the state fits
        self._steps = None  # the _Steps of the last update whose plan began at this leaf (a cache)
        self._powers = None  # the device copy of Adam's beta^t that the multi-tensor kernel reads (see _Group)

    def __repr__(self):
        return f"Leaf({self.rule!r}{', frozen' if self.frozen else ''})"

    # Copies and pickles hold the rule, the state and the flag; update's caches (which refer to the model's
    # arrays) are left behind and made again.
    def __getstate__(self):
        return self.rule, self.state, self.frozen

    def __setstate__(self, saved):
        if len(saved) == 2 and isinstance(saved[1], dict):   # pickled by an older fluxpy: (None, its slots)
            saved = saved[1]["rule"], saved[1]["state"], saved[1].get("frozen", False)
        self.__init__(*saved)


def _node(model, items):
    """A state (or gradient) node for ``model`` holding ``items`` (key, value) pairs."""
    if isinstance(model, list):
        return [v for _, v in items]
    if isinstance(model, tuple):
        return tuple(v for _, v in items)
    return dict(items)


def setup(rule: Rule, model: Any) -> Any:
    """The optimiser state of ``model``: a tree like it with a :class:`Leaf` at each trainable float array.

    Only the children named ``trainable`` by a :func:`fluxpy.layer` class get leaves; an array
    used twice in the model (tied weights) gets one leaf, shared. Set the model up where it will
    train (after :func:`fluxpy.gpu`, :func:`fluxpy.f64`, ...): :func:`update` refuses a state whose
    arrays no longer fit the model's in shape, dtype or device.

    >>> import numpy as np
    >>> setup(Momentum(), {"w": np.ones(2), "n": 3, "idx": np.arange(2)})
    {'w': Leaf(Momentum(eta=0.01, rho=0.9)), 'n': None, 'idx': None}
    """
    if not isinstance(rule, Rule) and isinstance(model, Rule):
        raise TypeError(f"setup expects the rule first, then the model: setup({model!r}, model), got a "
                        f"{type(rule).__name__} first")
    _check_rule(rule, "setup")
    leaves = {}

    def walk(x):
        kids = children(x)
        if kids is None:
            if not is_float_array(x):
                return None
            if id(x) not in leaves:
                leaves[id(x)] = Leaf(rule, rule.init(_master_like(x)))
            return leaves[id(x)]
        allowed = _trainable_keys(x)
        return _node(x, [(k, walk(v) if allowed is None or k in allowed else None) for k, v in kids])
    return walk(model)


def _describe(x):
    if is_array(x) or hasattr(x, "shape"):
        return f"an array of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    return f"a {type(x).__name__}"


def _sub(path, key):
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}"


def _path(keys):
    """``("layers", 0, "weight")`` -> ``"model.layers[0].weight"`` (paths are kept as tuples until an error)."""
    out = "model"
    for k in keys:
        out = _sub(out, k)
    return out


def _array_text(a):
    return f"{type(a).__module__.split('.')[0]} array of shape {tuple(a.shape)} and dtype {a.dtype}"


def update(state: Any, model: Any, grad: Any, *, check_finite: bool = False) -> tuple[Any, Any]:
    """One optimisation step, in place; returns ``(state, model)``.

    ``grad`` is the gradient of the model as ``fluxpy.gradient`` returns it (dicts for objects,
    ``None`` where there is no gradient). Every trainable array ``x`` becomes ``x - step``,
    written into ``x`` itself; frozen leaves are skipped; a tied array is stepped once (its
    gradient is already the total).

    All or nothing: the whole gradient tree is checked against the state and the model first
    (structure, shapes, a float gradient on the parameter's device, optimiser state that fits each
    array), and only then is any array or state changed, so an error (naming the path) leaves
    both exactly as they were. ``check_finite=True`` also refuses a gradient with a NaN or
    infinite entry (a ``FloatingPointError`` naming the array), at the cost of one reduction over
    all gradients and one device sync; :func:`fluxpy.train` does this check by default.

    >>> import numpy as np
    >>> import fluxpy
    >>> model = [np.array([1.0, 2.0]), np.array([3.0])]
    >>> state = setup(Descent(0.5), model)
    >>> grad, = fluxpy.gradient(lambda m: (m[0] ** 2).sum(), model)
    >>> state, model = update(state, model, grad)
    >>> model
    [array([0., 0.]), array([3.])]
    """
    plan = _plan(state, model, grad, "update")
    scaler = getattr(model, "loss_scaler", None)   # fluxpy.MixedPrecision's dynamic loss scale, or None
    if scaler is None:
        _check_gradients(plan, check_finite, "update")
        _apply(plan)
    else:
        _check_gradients(plan, False, "update")
        _apply_loss_scaled(plan, scaler)
    return state, model


def _apply_loss_scaled(plan, scaler):
    """The step of a model with a dynamic loss scale: applied only where every gradient is finite (an overflow of
    the scaled float16 gradients skips it), then the scale advanced. Inside a capture the update kernels skip
    themselves on the device; eagerly the flag is read once (as PyTorch's ``GradScaler.step``)."""
    flag = _finite_total([dx for leaf, _, dx, _ in plan if not leaf.frozen])
    if capturing():
        with guarding(flag):
            _apply(plan)
    elif _read_finite(flag):
        _apply(plan)
    scaler.advance(flag)


_ALL = object()  # stands for "a gradient everywhere": _plan then checks the state against the model alone


def _plan(state, model, grad, who):
    """Every ``(leaf, x, dx, path)`` that an update would step, each checked; raises before anything changes.

    With ``grad=_ALL``, checks the whole state tree against the model (``dx`` is then ``None``).
    """
    if isinstance(state, Rule):
        raise TypeError(f"{who}: got the rule {state!r} where the optimiser state belongs; make the state once with "
                        f"state = fluxpy.setup({state!r}, model) and pass that state (to every {who} call)")
    plan, seen = [], {}
    _walk(state, model, grad, (), plan, seen, who)
    return plan


def _walk(st, x, g, path, plan, seen, who):
    if st is None or g is None:
        return
    if type(st) is Leaf:
        _plan_leaf(st, x, g, path, plan, seen, who)
        return
    if not isinstance(st, (dict, list, tuple)):
        _bad_state(st, x, path, who)
    kids = children(x)
    if kids is None:
        raise ValueError(f"{who}: the state tree has a node at {_path(path)} but the model has {_describe(x)} there; "
                         "was the state set up for another model, or the model changed after setup?")
    everywhere = g is _ALL
    if isinstance(x, (tuple, list)):
        if not isinstance(st, (tuple, list)) or len(st) != len(x):
            raise ValueError(f"{who}: {_path(path)} is a {type(x).__name__} of {len(x)} but the optimiser state has "
                             f"{_describe(st)} there; was the state set up for another model?{_state_hint(st, x)}")
        if not everywhere and (not isinstance(g, (tuple, list)) or len(g) != len(x)):
            hint = _grad_hint(g, path)
            raise ValueError(f"{who}: {_path(path)} is a {type(x).__name__} of {len(x)}, so its gradient should be "
                             f"a tuple or list of {len(x)}, got {_describe(g)}{hint}")
        for (k, v), sk in zip(kids, st):
            _walk(sk, v, g if everywhere else g[k], path + (k,), plan, seen, who)
        return
    if not isinstance(st, dict) or len(st) != len(kids) or any(k not in st for k, _ in kids):
        raise ValueError(f"{who}: {_path(path)} is {_describe(x)} with fields {[str(k) for k, _ in kids]} but the "
                         f"optimiser state has {_describe(st)} there; was the state set up for another model?"
                         f"{_state_hint(st, x)}")
    if not everywhere:
        if not isinstance(g, dict):
            hint = _grad_hint(g, path)
            raise ValueError(f"{who}: {_path(path)} is {_describe(x)}, so its gradient should be a dict of its "
                             f"fields, got {_describe(g)}{hint}")
        if len(g) > len(kids) or any(k not in st for k in g):
            extra = [str(k) for k in g if k not in st]
            raise ValueError(f"{who}: the gradient for {_path(path)} has fields {sorted(extra)} that "
                             f"{_describe(x)} does not have")
    for k, v in kids:
        _walk(st[k], v, g if everywhere else g.get(k), path + (k,), plan, seen, who)


def _grad_hint(g, path):
    """A hint for the gradient trees that are really a whole return value (on the error path only)."""
    if path or not isinstance(g, tuple):
        return ""
    if len(g) == 1:
        return "; pass gradient(f, model)[0], not the whole tuple"
    if len(g) == 2 and isinstance(g[1], tuple):
        return "; this looks like withgradient's (value, gradients): pass gradients[0]"
    return ""


def _state_hint(st, x):
    if isinstance(st, tuple) and len(st) == 2 and st[1] is x:
        return (" It looks like the (state, model) pair that update returns: keep its first element "
                "(state, model = update(state, model, grad))")
    return ""


def _bad_state(st, x, path, who):
    what = f"the rule {st!r}" if isinstance(st, Rule) else _describe(st)
    where = "" if not path else f" at {_path(path)}"
    raise TypeError(f"{who}: the optimiser state{where} should be the tree that fluxpy.setup(rule, model) returns "
                    f"(Leaf objects in dicts, lists and tuples), got {what}; make it with state = setup(rule, model)")


def _plan_leaf(leaf, x, g, path, plan, seen, who):
    if not is_array(x):
        raise ValueError(f"{who}: the state tree has an array at {_path(path)} but the model has {_describe(x)}; "
                         "was the state set up for another model?")
    first = seen.get(id(leaf))
    if first is not None:  # a leaf shared by two paths: the model must hold one array (tied) there
        _check_tied(first, x, g, path, who)
        return
    other = seen.get(id(x))
    if other is not None:
        raise ValueError(f"{who}: the model holds one array (tied weights) at {_path(other[2])} and {_path(path)}, "
                         "but the optimiser state has a separate leaf at each, so it would be stepped twice; was the "
                         "state set up for another (untied) model?")
    _check_leaf_state(leaf, x, path, who)
    if g is _ALL:
        dx = None
    else:
        dx = value_of(g)
        if type(dx) is not type(x) or dx.shape != x.shape or not is_float_dtype(dx.dtype):
            _bad_gradient(x, dx, path, who)
    seen[id(leaf)] = seen[id(x)] = (x, g, path)
    plan.append((leaf, x, dx, path))


def _bad_gradient(x, dx, path, who):
    where = f"{who}: the gradient for {_path(path)}"
    if not hasattr(dx, "shape") or not hasattr(dx, "dtype"):  # NumPy scalars do for 0-d arrays
        raise ValueError(f"{where} should be an array of shape {tuple(x.shape)}, got {_describe(dx)}")
    if tuple(dx.shape) != tuple(x.shape):
        raise ValueError(f"{where} should be an array of shape {tuple(x.shape)}, got {_describe(dx)}")
    if not is_float_dtype(dx.dtype):
        raise TypeError(f"{where} should be a float array (the parameter is {x.dtype}), got dtype {dx.dtype}; a "
                        "complex, integer or boolean gradient cannot step a float parameter")
    on_cpu = isinstance(dx, (np.ndarray, np.generic))   # NumPy scalars do for 0-d arrays; subclasses do too
    if on_cpu != isinstance(x, np.ndarray) or not (on_cpu or is_array(dx)):
        raise TypeError(f"{where} is a {_array_text(dx)} but the parameter is a {_array_text(x)}: both must be on "
                        "one device (move the gradient or the model with fluxpy.gpu / fluxpy.cpu)")


def _check_tied(first, x, g, path, who):
    x0, g0, path0 = first
    if x0 is not x:
        raise ValueError(f"{who}: the optimiser state shares one leaf between {_path(path0)} and {_path(path)} (tied "
                         "weights), but the model has different arrays there; was the state set up for another model?")
    if g is _ALL or g0 is g:
        return
    a, b = value_of(g0), value_of(g)
    if not (hasattr(b, "shape") and tuple(b.shape) == tuple(x.shape) and
            bool(get_array_module(a, b).array_equal(a, b))):
        raise ValueError(f"{who}: {_path(path0)} and {_path(path)} are one array (tied weights), so they take one "
                         "gradient (the total, as fluxpy.gradient gives at both), but the gradient tree has different "
                         "values at the two")


def _master_like(x):
    """What a rule's state is made like: ``x``, or for a float16/bfloat16 ``x`` a float32 array of its values (the
    state of a half parameter is float32: Adam's ``eps`` and second moment underflow in float16)."""
    return x.astype(np.float32) if is_half(x.dtype) else x


def _state_arrays(s, out):
    if is_array(s):
        out.append(s)
    elif type(s) is tuple or type(s) is list:
        for v in s:
            _state_arrays(v, out)
    return out


def _master_like_dtype(dtype):
    return np.dtype(np.float32) if is_half(dtype) else dtype


def _check_leaf_state(leaf, x, path, who):
    key = (id(x), type(x), x.shape, x.dtype)
    if leaf._fits == key:  # the array the state was found to fit last time (rules keep their arrays' shapes)
        return
    for a in _state_arrays(leaf.state, []):
        if type(a) is not type(x) or a.shape != x.shape or a.dtype != _master_like_dtype(x.dtype):
            raise ValueError(f"{who}: the optimiser state at {_path(path)} holds a {_array_text(a)}, but the model has "
                             f"a {_array_text(x)} there; was the state set up for another model, or the model moved or "
                             "converted after setup? Call setup(rule, model) again for the model as it is now")
    leaf._fits = key


def _check_gradients(plan, check_finite, who):
    """Refuse NaN/Inf gradients before any change: all of them with ``check_finite``, else only where a rule says so.

    One reduction over every gradient checked and one read of its result; the slow search for the
    offending array runs only when that finds something.
    """
    if check_finite:
        todo = [(leaf, x, dx, path) for leaf, x, dx, path in plan if not leaf.frozen]
    else:
        todo = [(leaf, x, dx, path) for leaf, x, dx, path in plan if leaf.rule.needs_finite and not leaf.frozen]
    if not todo or _read_finite(_finite_total([t[2] for t in todo])):
        return
    for leaf, x, dx, path in _nonfinite(todo):
        if leaf.rule.needs_finite:
            try:
                leaf.rule.check(x, dx)
            except ValueError as err:
                raise ValueError(f"{who}: {err}, at {_path(path)}; nothing was updated") from None
        if check_finite:
            raise FloatingPointError(f"{who}: the gradient for {_path(path)} has {_count_nonfinite(dx)}; "
                                     "nothing was updated")


def _finite_total(arrays):
    """A scalar (on the arrays' device) that is finite when every entry of ``arrays`` is.

    The ``finite_total`` kernel where one takes the list (the GPU: one launch, 0 or NaN); else the float64 sum
    of each array (NaN or infinite where an entry is; it overflows only past 1e308, which then costs the exact
    search in :func:`_nonfinite`).
    """
    if not arrays:
        return 0.0
    try:
        kernel = find("finite_total", arrays[0], arrays)
    except TypeError:  # NumPy and CuPy arrays mixed: one total per array (a slow path, never the normal one)
        return [_finite_total([a]) for a in arrays]
    if kernel is not None:
        return kernel(arrays[0], arrays)
    total = 0.0
    for a in arrays:
        total = total + a.sum(dtype=np.float64)
    return total


def _read_finite(total):
    """Reads :func:`_finite_total`'s result on the host (the one sync of the check)."""
    if isinstance(total, list):
        return all(_read_finite(t) for t in total)
    return math.isfinite(float(total))


def _nonfinite(entries):
    """The entries ``(leaf, x, dx, path)`` whose gradient has a NaN or an infinity (one sync per array: error path)."""
    return [e for e in entries if not bool(get_array_module(e[2]).isfinite(e[2]).all())]


def _count_nonfinite(dx):
    xp = get_array_module(dx)
    nan, inf = int(xp.isnan(dx).sum()), int(xp.isinf(dx).sum())
    parts = [f"{n} {name}" for n, name in ((nan, "NaN"), (inf, "infinite")) if n]
    return f"{' and '.join(parts)} entries (of {dx.size}, shape {tuple(dx.shape)}, dtype {dx.dtype})"


def _apply(plan):
    """Steps every unfrozen leaf of ``plan``: groups of Adam leaves in one multi-tensor call each, where a kernel
    takes them, every other leaf by its rule's ``step`` (see :class:`_Steps`, cached on the plan's first leaf)."""
    if not plan:
        return
    anchor = plan[0][0]
    steps = anchor._steps
    if steps is None or not steps.fits(plan):
        steps = anchor._steps = _Steps(plan)
    steps.run(plan)


class _Steps:
    """How :func:`update` steps one plan: which leaves go alone and which together, built once and reused.

    A group is the unfrozen leaves whose rule is exactly :class:`Descent`, :class:`Momentum`, :class:`Adam` or
    :class:`AdamW` with equal hyperparameters (and, for Adam/AdamW, equal bias-correction state ``(b1t, b2t)``;
    values and Python types alike), whose parameters have one array type and dtype and share no memory with any
    other parameter of the plan (so that stepping them together is stepping them one by one). Each step a group
    asks the kernel table for its multi-tensor kernel (``sgd_update_many`` or ``adam_update_many``: one call for
    the whole group, and every leaf's state becomes exactly what the rule's ``step`` makes); where there is none
    (NumPy, or a call the kernel declines) its leaves step one by one. Chains and the other rules step leaf by
    leaf. Leaves and groups step in the plan's order.

    Reused while the plan has the same leaves in the same order, each with the same array, the same rule object,
    the same ``frozen`` flag and, for a grouped leaf, the same state object as the last step left it; anything
    else (``adjust``, ``freeze``, ``thaw``, a new array, a state put in by hand) builds it again. Checking that is
    a few identity tests per leaf.
    """
    __slots__ = ("sig", "states", "order")

    def __init__(self, plan):
        self.sig = [(leaf, x, leaf.rule, leaf.frozen) for leaf, x, _, _ in plan]
        self.states = [None] * len(plan)   # a grouped leaf's state as the last step left it; None: not grouped
        shared = _sharing_memory(plan)
        groups, order = {}, []
        for i, (leaf, x, _, _) in enumerate(plan):
            if leaf.frozen:
                continue
            key = None if i in shared else _group_key(leaf, x)
            if key is None:
                order.append(i)
                continue
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group(leaf.rule, leaf.state[2] if _is_adam(leaf.rule) else None)
                order.append(group)
            group.add(i, leaf, x)
            self.states[i] = leaf.state
        self.order = order

    def fits(self, plan):
        if len(plan) != len(self.sig):
            return False
        for (leaf, x, _, _), (leaf0, x0, rule0, frozen0), state0 in zip(plan, self.sig, self.states):
            if leaf is not leaf0 or x is not x0 or leaf.rule is not rule0 or leaf.frozen is not frozen0 or \
                    (state0 is not None and leaf.state is not state0):
                return False
        return True

    def run(self, plan):
        for item in self.order:
            if type(item) is int:
                leaf, x, dx, _ = plan[item]
                if current_guard() is not None and not leaf.rule.guarded_kernel(x, dx):
                    _refuse_unguarded(leaf.rule, "stepping a parameter on its own")
                leaf.state = leaf.rule.step(leaf.state, x, dx)
            else:
                item.step(plan, self.states)


def _refuse_unguarded(rule, how):
    """Inside :func:`fluxpy.capturing.guarding`: an update with no kernel that skips itself cannot be captured."""
    refuse(f"{rule!r} {how}: its update cannot skip itself on the device when the step's loss or gradients are "
           "not finite")


def _is_adam(rule):
    return type(rule) is Adam or type(rule) is AdamW


class _Group:
    """Leaves that one multi-tensor call steps: their plan indices, leaves, parameters and state arrays (Adam's
    moments ``m``, ``v``; Momentum's velocity ``v``; none for Descent). For Adam and AdamW the powers ``beta^t``
    twice: ``bt`` on the host (what each leaf's state holds, as ``Adam.step`` makes it) and ``powers`` on the
    device (what the kernel reads and advances, so that a replayed CUDA graph sees them advance); both advance by
    the same float64 products."""
    __slots__ = ("rule", "bt", "powers", "index", "leaves", "xs", "ms", "vs")

    def __init__(self, rule, bt):
        self.rule, self.bt, self.powers = rule, bt, None
        self.index, self.leaves, self.xs, self.ms, self.vs = [], [], [], [], []

    def add(self, i, leaf, x):
        self.index.append(i)
        self.leaves.append(leaf)
        self.xs.append(x)
        if self.bt is not None:
            self.ms.append(leaf.state[0])
            self.vs.append(leaf.state[1])
        elif type(self.rule) is Momentum:
            self.vs.append(leaf.state)

    def step(self, plan, states):
        dxs = [plan[i][2] for i in self.index]
        if self.bt is not None:
            self._step_adam(dxs, states)
            return
        xs, rule = self.xs, self.rule
        vs = self.vs if type(rule) is Momentum else None
        kernel = find("sgd_update_many", xs[0], xs, dxs, vs)
        if kernel is None:
            if current_guard() is not None:
                _refuse_unguarded(rule, "stepping its parameters without a multi-tensor kernel")
            for i, leaf, x, dx in zip(self.index, self.leaves, xs, dxs):
                leaf.state = states[i] = rule.step(leaf.state, x, dx)
        elif vs is None:
            kernel(xs, dxs, None, rule.eta, **_guard())
        else:
            kernel(xs, dxs, vs, rule.eta, rule.rho, **_guard())

    def _step_adam(self, dxs, states):
        xs, ms, vs = self.xs, self.ms, self.vs
        kernel = find("adam_update_many", xs[0], xs, dxs, ms, vs)
        if kernel is None:  # leaf by leaf, as Adam.step; the next step's states are recorded (and checked) all the same
            self.powers = None
            for i, leaf, x, dx in zip(self.index, self.leaves, xs, dxs):
                leaf._powers = None   # the host's beta^t moves on alone: a later kernel step starts a new copy
                leaf.state = states[i] = leaf.rule.step(leaf.state, x, dx)
            self.bt = self.leaves[0].state[2]
            return
        rule = self.rule
        b1t, b2t = self.bt
        if self.powers is None:
            self.powers = self._shared_powers(get_array_module(xs[0]))
        decay = {"lambd": rule.lambd} if type(rule) is AdamW else {}
        self.bt = bt = tuple(kernel(xs, dxs, ms, vs, rule.eta, rule.beta, rule.eps, b1t, b2t, powers=self.powers,
                                    **decay, **_guard()))   # a checked step: skipped where the flag is not finite
        self._record_states(bt, states)
        on_replay(lambda: self._advance_host(states))

    def _shared_powers(self, xp):
        """The device ``beta^t`` of the group: the one its leaves share already (kept across regroupings, since a
        captured CUDA graph holds its address), else a new one from the host's ``bt``, given to every leaf."""
        shared = self.leaves[0]._powers   # (array, how many leaves share it): exactly this group's leaves, or none
        if shared is not None and shared[1] == len(self.leaves) and all(leaf._powers is shared for leaf in self.leaves):
            return shared[0]
        powers = xp.array(list(self.bt), dtype=np.float64)
        shared = (powers, len(self.leaves))
        for leaf in self.leaves:
            leaf._powers = shared
        return powers

    def _record_states(self, bt, states):
        for i, leaf in zip(self.index, self.leaves):
            m, v, _ = leaf.state
            leaf.state = states[i] = (m, v, bt)

    def _advance_host(self, states):
        """The host side of one replayed step: ``bt`` advanced as the kernel advanced ``powers``."""
        b1, b2 = self.rule.beta
        self.bt = bt = (self.bt[0] * b1, self.bt[1] * b2)
        self._record_states(bt, states)


def _typed(v):
    return type(v), v


def _group_key(leaf, x):
    """What a leaf's multi-tensor group is known by (None: the leaf steps alone): the rule's type and
    hyperparameters, array type and dtype, and for Adam/AdamW the bias-correction state, each value with its type
    (so that a group's shared next ``(b1t, b2t)`` is what every leaf's own ``Adam.step`` would make)."""
    rule, state = leaf.rule, leaf.state
    kind = type(rule)
    if kind is Descent:
        if state is not None:
            return None
        hyper = (rule.eta,)
    elif kind is Momentum:
        if type(state) is not type(x):
            return None
        hyper = (rule.eta, rule.rho)
    elif kind is Adam or kind is AdamW:
        if type(state) is not tuple or len(state) != 3:
            return None
        bt, beta = state[2], rule.beta
        if type(bt) is not tuple or len(bt) != 2 or type(beta) not in (tuple, list) or len(beta) != 2:
            return None
        hyper = (rule.eta, beta[0], beta[1], rule.eps, bt[0], bt[1]) + ((rule.lambd,) if kind is AdamW else ())
    else:
        return None
    key = (kind, type(x), x.dtype) + tuple(_typed(h) for h in hyper)
    try:
        hash(key)
    except TypeError:   # an array or a list as a hyperparameter: that leaf steps alone
        return None
    return key


def _sharing_memory(plan):
    """The plan indices of parameters that may share memory with another parameter of the plan (views of one
    array or buffer): they step alone, in the plan's order, as before there were groups."""
    by_owner = {}
    for i, (_, x, _, _) in enumerate(plan):
        owner = x
        while getattr(owner, "base", None) is not None:   # a view's base, up to the array or buffer that owns it
            owner = owner.base
        by_owner.setdefault(id(owner), []).append(i)
    return {i for idx in by_owner.values() if len(idx) > 1 for i in idx}


def _leaves(tree):
    """The distinct leaves of a state tree (or a single Leaf)."""
    out, seen, stack = [], set(), [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Leaf):
            if id(node) not in seen:
                seen.add(id(node))
                out.append(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (tuple, list)):
            stack.extend(node)
    return out


def _adjusted(rule, changes, used):
    if isinstance(rule, OptimiserChain):
        return OptimiserChain(*(_adjusted(r, changes, used) for r in rule.rules))
    if not dataclasses.is_dataclass(rule):
        return rule
    names = {f.name for f in dataclasses.fields(rule)}
    mine = {k: v for k, v in changes.items() if k in names}
    used.update(mine)
    return dataclasses.replace(rule, **mine) if mine else rule


def adjust(state: Any, eta: float | None = None, **hyper: Any) -> Any:
    """Change hyperparameters of every rule in the state tree, in place; returns ``state``.

    ``adjust(state, 1e-4)`` sets the learning rate ``eta``; keywords set other fields
    (``adjust(state, rho=0.8)``). Rules in a chain without that field are left alone; a name
    that no rule has, or a value a rule refuses, is an error that changes nothing. Accumulated state (moments) is
    kept.

    >>> import numpy as np
    >>> st = setup(OptimiserChain(ClipGrad(1.0), Adam(0.1)), {"w": np.ones(2)})
    >>> adjust(st, 0.01)["w"]
    Leaf(OptimiserChain(ClipGrad(delta=1.0), Adam(eta=0.01, beta=(0.9, 0.999), eps=1e-08)))
    """
    changes = dict(hyper)
    if eta is not None:
        changes["eta"] = eta
    if not changes:
        raise ValueError("adjust: give a learning rate or hyperparameters to change, e.g. adjust(state, 1e-4)")
    used = set()
    leaves = _leaves(state)
    rules = [_adjusted(leaf.rule, changes, used) for leaf in leaves]   # every new rule made (and checked) first
    missing = set(changes) - used
    if leaves and missing:
        raise ValueError(f"adjust: no rule in the state tree has {sorted(missing)}")
    for leaf, rule in zip(leaves, rules):   # then all at once: a refused change leaves the state as it was
        leaf.rule = rule
    return state


def freeze(state: Any) -> Any:
    """Skip the leaves of this state (sub)tree in later updates, until :func:`thaw`; returns ``state``.

    >>> import numpy as np
    >>> model = {"a": np.ones(1), "b": np.ones(1)}
    >>> st = setup(Descent(1.0), model)
    >>> _ = freeze(st["a"])
    >>> _ = update(st, model, {"a": np.ones(1), "b": np.ones(1)})
    >>> model
    {'a': array([1.]), 'b': array([0.])}
    """
    for leaf in _leaves(state):
        leaf.frozen = True
    return state


def thaw(state: Any) -> Any:
    """Undo :func:`freeze` on every leaf of this state (sub)tree; returns ``state``.

    >>> import numpy as np
    >>> st = freeze(setup(Descent(), np.ones(1)))
    >>> thaw(st)
    Leaf(Descent(eta=0.1))
    """
    for leaf in _leaves(state):
        leaf.frozen = False
    return state
