"""The rules (Optimisers.jl's ``rules.jl``): each its hyperparameters, its state and ONE formula.

A rule is a frozen dataclass (of :class:`~fluxpy.optimise.base.Rule`) whose ``formula()`` says its update as data
(:class:`Formula`: the state arrays, the per-step counters, the scalars and the elementwise statements; written with
:func:`~fluxpy.optimise.formula.parse`) and whose ``STATE`` says how its state looks to the user
(``("m", "v", ("b1t", "b2t"))`` for Adam). From that one formula come the NumPy path
(:meth:`Rule.apply`), the per-parameter CUDA kernel and the multi-tensor one (:mod:`fluxpy.kernels.cuda_optimise`),
each guarded and keeping the counters on the device, so every rule steps inside a captured step.

>>> import numpy as np
>>> from fluxpy.optimise import setup, update
>>> w = np.array([1.0, 2.0])
>>> _ = update(setup(Adam(0.1), w), w, np.array([1.0, -1.0]))
>>> w.round(6)
array([0.9, 2.1])
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..backend import Array, get_array_module
from ..capturing import capturing
from ..kernels import find
from .base import Rule, _pair, check_rule, formula_of
from .formula import Formula, chain, parse

__all__ = ["Rule", "Descent", "Momentum", "Nesterov", "RMSProp", "Adam", "AdamW", "WeightDecay", "ClipGrad",
           "ClipNorm", "OptimiserChain", "AdaGrad", "AdaDelta", "AdaMax", "NAdam", "RAdam", "OAdam", "AdaBelief",
           "Lion", "SignDecay", "AccumGrad", "AMSGrad", "Rprop"]


# Adam's moments and beta^t, shared by the Adam family's formulas (each writes the rest of its step)
_MOMENTS = """
    m = m * beta1
    m = m + c1 * dx
    v = v * beta2
    v = v + c2 * (dx * dx)
"""
_POWERS = dict(counters="b1t = b1t * beta1\nb2t = b2t * beta2", init="b1t = beta1\nb2t = beta2")
_CORRECTIONS = "c1 = 1 - beta1\nc2 = 1 - beta2\ne1 = 1 - b1t\ne2 = 1 - b2t\n"
# Adam's bias-corrected direction m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps), as Adam and AdamW round it
_DIRECTION = _MOMENTS + "d = sqrt(v * s2) + eps\ndirection = (m * s1) / d\n"
_BIAS = "s1 = 1 / (1 - b1t)\ns2 = 1 / (1 - b2t)"


def _adam_family(body: str, scalars: str = "", state=("m", "v"), **more) -> Formula:
    return parse(state=state, body=body, scalars=_CORRECTIONS + scalars, **_POWERS, **more)


@dataclasses.dataclass(frozen=True)
class Descent(Rule):
    """Plain gradient descent, ``step = eta * dx``.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.array([1.0, 2.0])
    >>> _ = update(setup(Descent(0.1), w), w, np.array([1.0, -1.0]))
    >>> w
    array([0.9, 2.1])
    """
    eta: float = 0.1

    def formula(self) -> Formula:
        return parse(body="step = eta * dx")


@dataclasses.dataclass(frozen=True)
class Momentum(Rule):
    """Gradient descent with momentum: ``v = rho v + eta dx``, ``step = v``.

    PyTorch's ``SGD(lr=eta, momentum=rho)`` (its buffer is ``v / eta``).

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(1)
    >>> st = setup(Momentum(0.1, 0.5), w)
    >>> for _ in range(2):
    ...     st, w = update(st, w, np.ones(1))
    >>> w   # -(0.1) - (0.05 + 0.1)
    array([-0.25])
    """
    eta: float = 0.01
    rho: float = 0.9
    STATE = "v"

    def formula(self) -> Formula:
        return parse(state=("v",), body="v = v * rho\nv = v + eta * dx\nstep = v")


@dataclasses.dataclass(frozen=True)
class Nesterov(Rule):
    """Nesterov momentum, as Optimisers.jl writes it.

    ``step = (1 + rho) eta dx - rho^2 v`` then ``v = rho v - eta dx``; the same steps as
    PyTorch's ``SGD(lr=eta, momentum=rho, nesterov=True)``.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(1)
    >>> _ = update(setup(Nesterov(0.1, 0.5), w), w, np.ones(1))
    >>> w
    array([-0.15])
    """
    eta: float = 0.001
    rho: float = 0.9
    STATE = "vel"

    def formula(self) -> Formula:
        return parse(state=("vel",), scalars="k1 = (1 + rho) * eta\nk2 = rho * rho",
                        body="step = k1 * dx - k2 * vel\nvel = vel * rho\nvel = vel - eta * dx")


@dataclasses.dataclass(frozen=True)
class RMSProp(Rule):
    """RMSProp: the gradient divided by a running root mean square of past gradients.

    ``quad = rho quad + (1 - rho) dx^2``; if centred also ``lin = rho lin + (1 - rho) dx``;
    ``step = eta dx / (sqrt(quad - lin^2) + eps)`` (eps outside the root, as Optimisers.jl and
    PyTorch's ``RMSprop(alpha=rho, centered=...)``).

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(1)
    >>> _ = update(setup(RMSProp(0.01, 0.9, 0.0), w), w, np.ones(1))
    >>> w.round(5)   # -0.01 / sqrt(0.1)
    array([-0.03162])
    """
    eta: float = 0.001
    rho: float = 0.9
    eps: float = 1e-8
    centred: bool = False

    def layout(self) -> Any:
        return ("quad", "lin" if self.centred else None)

    def formula(self) -> Formula:
        if self.centred:
            return parse(state=("quad", "lin"), scalars="c = 1 - rho", body="""
                quad = quad * rho
                quad = quad + c * (dx * dx)
                lin = lin * rho
                lin = lin + c * dx
                rms = sqrt(quad - lin * lin) + eps
                step = (eta * dx) / rms""")
        return parse(state=("quad",), scalars="c = 1 - rho", body="""
            quad = quad * rho
            quad = quad + c * (dx * dx)
            rms = sqrt(quad) + eps
            step = (eta * dx) / rms""")


@dataclasses.dataclass(frozen=True)
class Adam(Rule):
    """Adam: steps from bias-corrected running moments of the gradient.

    ``m = b1 m + (1 - b1) dx``, ``v = b2 v + (1 - b2) dx^2``,
    ``step = eta (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``: Optimisers.jl's bias
    correction (the same as PyTorch's ``Adam``).

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(2)
    >>> _ = update(setup(Adam(0.1), w), w, np.array([5.0, -0.01]))
    >>> w.round(6)   # the first step is eta * sign(dx)
    array([-0.1,  0.1])
    """
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    eps: float = 1e-8
    STATE = ("m", "v", ("b1t", "b2t"))

    def formula(self) -> Formula:
        return _adam_family(_DIRECTION + "step = direction * eta", _BIAS)


@dataclasses.dataclass(frozen=True)
class AdamW(Rule):
    """Adam with decoupled weight decay.

    ``step = eta (adam_direction + lambd x)``, i.e. Optimisers.jl's
    ``OptimiserChain(Adam(eta, beta, eps), WeightDecay(eta * lambd))`` and PyTorch's
    ``AdamW(lr=eta, weight_decay=lambd)``. One rule, so ``adjust(state, eta)`` scales the decay too.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.ones(1)
    >>> _ = update(setup(AdamW(0.1, lambd=0.5), w), w, np.ones(1))
    >>> w.round(6)   # 1 - 0.1 * (1 + 0.5)
    array([0.85])
    """
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    lambd: float = 0.0
    eps: float = 1e-8
    STATE = ("m", "v", ("b1t", "b2t"))

    def formula(self) -> Formula:
        return _adam_family(_DIRECTION + ("step = (direction + lambd * x) * eta" if self.lambd else
                                          "step = direction * eta"), _BIAS)


@dataclasses.dataclass(frozen=True)
class WeightDecay(Rule):
    """Adds ``lambd * x`` to the gradient (L2 regularisation).

    Put it before the optimiser in a chain: ``OptimiserChain(WeightDecay(1e-2), Adam(3e-4))``.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.array([2.0])
    >>> _ = update(setup(OptimiserChain(WeightDecay(0.5), Descent(0.1)), w), w, np.zeros(1))
    >>> w
    array([1.9])
    """
    lambd: float = 5e-4

    def formula(self) -> Formula:
        return parse(body="step = dx + lambd * x")


@dataclasses.dataclass(frozen=True)
class ClipGrad(Rule):
    """Clamps every gradient entry to ``[-delta, delta]``.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(2)
    >>> _ = update(setup(OptimiserChain(ClipGrad(1.0), Descent(1.0)), w), w, np.array([5.0, -0.5]))
    >>> w
    array([-1. ,  0.5])
    """
    delta: float = 10.0

    def formula(self) -> Formula:
        return parse(body="step = clip(dx, -delta, delta)")


@dataclasses.dataclass(frozen=True)
class ClipNorm(Rule):
    """Rescales each array's gradient so that its ``p``-norm is at most ``omega``.

    With ``throw`` a non-finite norm is an error naming the array's shape. Inside a captured step the norm stays
    on the device: the step's guard skips the update where a gradient is not finite (and the eager step that
    :func:`fluxpy.train` runs then raises).

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(2)
    >>> _ = update(setup(OptimiserChain(ClipNorm(1.0), Descent(1.0)), w), w, np.array([3.0, 4.0]))
    >>> w
    array([-0.6, -0.8])
    """
    omega: float = 10.0
    p: float = 2
    throw: bool = True

    # With throw, update checks every gradient for NaN/Inf before changing anything, so that a refused
    # gradient leaves the whole model as it was (the check in prepare stays, for a chain whose earlier rules
    # make a finite gradient infinite).
    needs_finite = property(lambda self: self.throw)

    def hyper(self) -> dict:
        return {}

    def formula(self) -> Formula:
        return parse(inputs=("scale",), body="step = dx * scale")

    def check(self, x: Array, dx: Array) -> None:
        self._norm(x, dx)

    def _norm(self, x, dx):
        xp = get_array_module(x)
        kernel = find("vector_norm", dx, self.p)   # the GPU's: reductions, which a capture takes
        if dx.size == 0:   # every norm of nothing is 0 (a max over nothing has no identity)
            norm = xp.zeros((), dx.dtype)
        else:
            norm = kernel(dx, self.p) if kernel is not None else xp.linalg.norm(dx.ravel(), ord=self.p)
        # As Flux's ClipNorm: with throw, the check reads the norm on the host (a sync on the GPU); inside a
        # capture the step's guard does it on the device instead.
        if self.throw and not capturing() and not bool(xp.isfinite(norm)):
            raise ValueError(f"ClipNorm: the gradient has {self.p}-norm {float(norm)}, for an array of shape "
                             f"{tuple(x.shape)} and dtype {x.dtype}")
        return norm

    def prepare(self, x: Array, dx: Array) -> dict:
        """``scale = min(1, omega / norm(dx))`` as a 0-d array of ``dx``'s dtype, on its device."""
        xp = get_array_module(x)
        norm = self._norm(x, dx)
        with np.errstate(divide="ignore"):   # a zero gradient: scale by min(1, inf) = 1
            scale = xp.minimum(1, self.omega / norm)
        return {"scale": xp.asarray(scale.astype(dx.dtype))}   # a 0-d array (NumPy gives a scalar)


class OptimiserChain(Rule):
    """Applies its rules in turn, each to the previous one's step; its formula is theirs, one after another.

    >>> import numpy as np
    >>> OptimiserChain(ClipGrad(1.0), Adam())
    OptimiserChain(ClipGrad(delta=1.0), Adam(eta=0.001, beta=(0.9, 0.999), eps=1e-08))
    """

    def __init__(self, *rules: Rule) -> None:
        for r in rules:
            check_rule(r, "OptimiserChain")
        self.rules = tuple(rules)
        self.needs_finite = any(r.needs_finite for r in self.rules)

    def __repr__(self):
        return f"OptimiserChain({', '.join(map(repr, self.rules))})"

    def __eq__(self, other):
        return type(other) is OptimiserChain and other.rules == self.rules

    __hash__ = None

    def formula(self) -> Formula | None:
        """The rules' formulas in turn; None where one has none, or one past the first has ``inputs`` (they are
        computed from the gradient that enters the chain)."""
        parts = [formula_of(r) for r in self.rules]
        if not parts or any(f is None for f in parts) or any(f.inputs for f in parts[1:]):
            return None
        return chain(parts)

    def layout(self) -> Any:
        return tuple(_prefixed(r.layout(), f"r{i}_") for i, r in enumerate(self.rules))

    def hyper(self) -> dict:
        return {f"r{i}_{k}": v for i, r in enumerate(self.rules) for k, v in r.hyper().items()}

    def prepare(self, x: Array, dx: Array) -> dict:
        return {f"r0_{k}": v for k, v in self.rules[0].prepare(x, dx).items()} if self.rules else {}

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


def _prefixed(layout, prefix):
    if isinstance(layout, str):
        return prefix + layout
    if isinstance(layout, tuple):
        return tuple(_prefixed(p, prefix) for p in layout)
    return None


@dataclasses.dataclass(frozen=True)
class AdaGrad(Rule):
    """AdaGrad (Optimisers.jl's): ``acc += dx^2`` (``acc`` starts at ``eps``), ``step = eta dx / (sqrt(acc) + eps)``.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(1)
    >>> _ = update(setup(AdaGrad(0.1), w), w, np.array([2.0]))
    >>> w.round(6)
    array([-0.1])
    """
    eta: float = 0.1
    eps: float = 1e-8
    STATE = "acc"

    def formula(self) -> Formula:
        return parse(state=("acc",), init="acc = eps",
                        body="acc = acc + dx * dx\nstep = dx * eta / (sqrt(acc) + eps)")


@dataclasses.dataclass(frozen=True)
class AdaDelta(Rule):
    """AdaDelta (Optimisers.jl's): ``acc = rho acc + (1 - rho) dx^2``, ``step = dx sqrt(dacc + eps) / sqrt(acc + eps)``,
    then ``dacc = rho dacc + (1 - rho) step^2``; no learning rate.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(1)
    >>> _ = update(setup(AdaDelta(0.9, 1e-6), w), w, np.array([1.0]))
    >>> w.round(6)   # -sqrt(1e-6) / sqrt(0.1 + 1e-6)
    array([-0.003162])
    """
    rho: float = 0.9
    eps: float = 1e-8
    STATE = ("acc", "dacc")

    def formula(self) -> Formula:
        return parse(state=("acc", "dacc"), scalars="c = 1 - rho", body="""
            acc = acc * rho
            acc = acc + c * (dx * dx)
            step = dx * sqrt(dacc + eps) / sqrt(acc + eps)
            dacc = dacc * rho
            dacc = dacc + c * (step * step)""")


@dataclasses.dataclass(frozen=True)
class AdaMax(Rule):
    """AdaMax, Adam on the infinity norm: ``u = max(b2 u, |dx|)``, ``step = eta / (1 - b1^t) m / (u + eps)``.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(1)
    >>> _ = update(setup(AdaMax(0.1), w), w, np.array([3.0]))
    >>> w.round(6)
    array([-0.1])
    """
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    eps: float = 1e-8
    STATE = ("m", "u", ("b1t", "b2t"))

    def formula(self) -> Formula:
        return _adam_family("""
            m = m * beta1
            m = m + c1 * dx
            u = u * beta2
            u = maximum(u, abs(dx))
            step = lr * m / (u + eps)""", "lr = eta / (1 - b1t)", state=("m", "u"))


@dataclasses.dataclass(frozen=True)
class OAdam(Rule):
    """Optimistic Adam: ``term = eta (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``, ``step = 2 term - term_prev``.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(1)
    >>> _ = update(setup(OAdam(0.1), w), w, np.array([1.0]))
    >>> w.round(6)   # twice Adam's first step
    array([-0.2])
    """
    eta: float = 0.001
    beta: tuple = (0.5, 0.9)
    eps: float = 1e-8
    STATE = ("m", "v", ("b1t", "b2t"), "term")

    def formula(self) -> Formula:
        return _adam_family(_MOMENTS + """
            prev = term
            term = eta * m / e1 / (sqrt(v / e2) + eps)
            step = 2 * term - prev""", state=("m", "v", "term"))


@dataclasses.dataclass(frozen=True)
class NAdam(Rule):
    """NAdam, Adam with Nesterov momentum (Optimisers.jl's formula):
    ``step = eta (b1 m / (1 - b1 b1^t) + (1 - b1) dx / (1 - b1^t)) / (sqrt(v b2 / (1 - b2^t)) + eps)``.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(1)
    >>> _ = update(setup(NAdam(0.1), w), w, np.array([1.0]))
    >>> float(w[0]) < 0
    True
    """
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    eps: float = 1e-8
    STATE = ("m", "v", ("b1t", "b2t"))

    def formula(self) -> Formula:
        return _adam_family(_MOMENTS + """
            a = beta1 * m / d1 + c1 * dx / e1
            step = a / (sqrt(v * beta2 / e2) + eps) * eta""", "d1 = 1 - beta1 * b1t")


@dataclasses.dataclass(frozen=True)
class RAdam(Rule):
    """Rectified Adam: Adam's step times ``r(t)`` once the variance estimate is trustworthy (``rho_t > 4``), plain
    bias-corrected momentum before (Optimisers.jl's formulas).

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(1)
    >>> _ = update(setup(RAdam(0.1), w), w, np.array([1.0]))
    >>> w.round(6)   # the first steps are momentum: 0.1 * m / (1 - b1)
    array([-0.1])
    """
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    eps: float = 1e-8
    STATE = ("m", "v", ("b1t", "b2t"), "t")

    def formula(self) -> Formula:
        f = _adam_family(_MOMENTS + "step = m / e1 / (sqrt(v / e2) + eps) * lr if trusted else m / e1 * eta", """
            rho_inf = 2 / (1 - beta2) - 1
            rho = rho_inf - 2 * t * b2t / (1 - b2t)
            trusted = rho > 4
            r = sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho)) if trusted else 0
            lr = eta * r""")
        return dataclasses.replace(f, counters=f.counters + (("t", "t + 1"),), init=f.init + (("t", "1"),))


@dataclasses.dataclass(frozen=True)
class AdaBelief(Rule):
    """AdaBelief: Adam with the variance of the gradient around its mean, ``s = b2 s + (1 - b2) (dx - m)^2 + eps``,
    ``step = eta (m / (1 - b1^t)) / (sqrt(s / (1 - b2^t)) + eps)``.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(1)
    >>> _ = update(setup(AdaBelief(0.1), w), w, np.array([1.0]))
    >>> float(w[0]) < 0
    True
    """
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    eps: float = 1e-16
    STATE = ("m", "s", ("b1t", "b2t"))

    def formula(self) -> Formula:
        return _adam_family("""
            m = m * beta1
            m = m + c1 * dx
            d = dx - m
            s = s * beta2
            s = s + (c2 * (d * d) + eps)
            step = eta * m / e1 / (sqrt(s / e2) + eps)""", state=("m", "s"))


@dataclasses.dataclass(frozen=True)
class Lion(Rule):
    """Lion: ``step = eta sign((b2 - b1) dx + b1 m)`` after ``m = b2 dx + (1 - b2) m`` (Optimisers.jl's form).

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(2)
    >>> _ = update(setup(Lion(0.1), w), w, np.array([3.0, -0.01]))
    >>> w
    array([-0.1,  0.1])
    """
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    _LIMITS = {"beta": (lambda v: _pair(v, closed=True), "a tuple (b1, b2) of numbers in [0, 1]")}
    STATE = "m"

    def formula(self) -> Formula:
        return parse(state=("m",), scalars="c2 = 1 - beta2\nd21 = beta2 - beta1", body="""
            m = m * c2
            m = m + beta2 * dx
            step = eta * sign(d21 * dx + beta1 * m)""")


@dataclasses.dataclass(frozen=True)
class SignDecay(Rule):
    """Adds ``lambd * sign(x)`` to the gradient (L1 regularisation); put it first in a chain.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.array([2.0, -2.0])
    >>> _ = update(setup(OptimiserChain(SignDecay(0.5), Descent(0.1)), w), w, np.zeros(2))
    >>> w
    array([ 1.95, -1.95])
    """
    lambd: float = 1e-3

    def formula(self) -> Formula:
        return parse(body="step = dx + lambd * sign(x)")


@dataclasses.dataclass(frozen=True)
class AccumGrad(Rule):
    """Accumulates ``n`` gradients and passes their mean on at every ``n``-th update (nothing in between):
    ``OptimiserChain(AccumGrad(n), Adam())`` trains with ``n`` times the batch a step.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.array([1.0])
    >>> st = setup(OptimiserChain(AccumGrad(2), Descent(0.1)), w)
    >>> _ = update(st, w, np.array([4.0])); w    # held back
    array([1.])
    >>> _ = update(st, w, np.array([2.0])); w    # the mean, 3, applied
    array([0.7])
    """
    n: int = 1
    STATE = ("acc", "count")

    def __post_init__(self):
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"AccumGrad must accumulate at least one gradient: n an int >= 1, got {self.n!r}")

    def formula(self) -> Formula:
        return parse(state=("acc",), scalars="first = count == 1\nfire = count == n",
                        counters="count = 1 if count == n else count + 1", init="count = 1", body="""
            acc = dx / n if first else acc + dx / n
            if fire
            step = acc""")


@dataclasses.dataclass(frozen=True)
class AMSGrad(Rule):
    """AMSGrad (Optimisers.jl's): Adam whose denominator never shrinks, ``m = b1 m + (1 - b1) dx``,
    ``v = b2 v + (1 - b2) dx^2``, ``vhat = max(vhat, v)``, ``step = eta m / (sqrt(vhat) + eps)``, with ``m``, ``v``
    and ``vhat`` starting at ``eps``.

    PyTorch's ``Adam(lr=eta, betas=beta, eps=eps, amsgrad=True)`` differs: its moments start at zero and it corrects
    their bias, ``step = eta / (1 - b1^t) m / (sqrt(vhat) / sqrt(1 - b2^t) + eps)`` (``vhat`` the running maximum
    of the uncorrected ``v``): its first step is ``eta sign(dx)``, this rule's ``eta (1 - b1) / sqrt(1 - b2) sign(dx)``
    (about ``3.16 eta`` with the default betas); the two tend to the same steps as ``b1^t`` and ``b2^t`` vanish.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(1)
    >>> _ = update(setup(AMSGrad(0.1), w), w, np.array([1.0]))
    >>> w.round(4)   # -0.1 * (1 - 0.9) / sqrt(1 - 0.999), up to the eps that m and v start at
    array([-0.3162])
    """
    eta: float = 0.001
    beta: tuple = (0.9, 0.999)
    eps: float = 1e-8
    STATE = ("m", "v", "vhat")

    def formula(self) -> Formula:
        return parse(state=("m", "v", "vhat"), init="m = eps\nv = eps\nvhat = eps",
                     scalars="c1 = 1 - beta1\nc2 = 1 - beta2", body=_MOMENTS + """
            vhat = maximum(vhat, v)
            step = eta * m / (sqrt(vhat) + eps)""")


def _factors(v) -> bool:
    return _pair_of(v) and 0 < v[0] < 1 < v[1]


def _sizes(v) -> bool:
    return _pair_of(v) and 0 <= v[0] <= v[1]


def _pair_of(v) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                                        and np.isfinite(b) for b in v)


@dataclasses.dataclass(frozen=True)
class Rprop(Rule):
    """Rprop (Optimisers.jl's): a step size per entry, grown while the gradient keeps its sign and shrunk when it
    flips; the step is that size times the sign of the gradient.

    With ``p = prev dx``: ``step_size = min(step_size ell2, gamma2)`` where ``p > 0``, ``max(step_size ell1,
    gamma1)`` where ``p < 0``, unchanged where ``p == 0``; ``prev = 0`` where ``p < 0`` (no step after a sign change,
    and no change of size at the next), else ``dx``; ``step = step_size sign(prev)``. ``step_size`` starts at
    ``eta`` and ``prev`` at zero. ``ell = (decrease, increase)`` with ``0 < ell1 < 1 < ell2``; ``gamma = (smallest,
    largest)`` step size.

    PyTorch's ``Rprop(lr=eta, etas=ell, step_sizes=gamma)`` takes the same steps while ``eta`` lies in ``gamma``
    (it clamps every size into ``gamma``, so an ``eta`` outside is moved in at once); its default learning rate is
    ``1e-2``, Optimisers.jl's ``1e-3``. A full-batch method: minibatch noise flips the signs.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
    >>> w = np.zeros(2)
    >>> st = setup(Rprop(0.1), w)
    >>> for dx in ([3.0, -1.0], [1.0, 1.0]):
    ...     st, w = update(st, w, np.array(dx))
    >>> w.round(6)   # the first entry stepped 0.1 then 0.12; the second flipped, so it did not step again
    array([-0.22,  0.1 ])
    """
    eta: float = 0.001
    ell: tuple = (0.5, 1.2)
    gamma: tuple = (1e-6, 50.0)
    _LIMITS = {"ell": (_factors, "a tuple (decrease, increase) of numbers with 0 < decrease < 1 < increase"),
               "gamma": (_sizes, "a tuple (smallest, largest) of finite step sizes with 0 <= smallest <= largest")}
    STATE = ("prev", "step_size")

    def formula(self) -> Formula:
        return parse(state=("prev", "step_size"), init="step_size = eta", body="""
            p = prev * dx
            grown = minimum(step_size * ell2, gamma2)
            shrunk = maximum(step_size * ell1, gamma1)
            step_size = where(p > 0, grown, where(p < 0, shrunk, step_size))
            prev = where(p < 0, 0, dx)
            step = step_size * sign(prev)""")
