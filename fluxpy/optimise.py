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
from typing import Any

import numpy as np

from .autodiff import value_of
from .backend import Array, get_array_module, is_array, is_float_array
from .kernels import find
from .functors import _trainable_keys, children

__all__ = ["Rule", "Descent", "Momentum", "Nesterov", "RMSProp", "Adam", "AdamW", "WeightDecay", "ClipGrad",
           "ClipNorm", "OptimiserChain", "Leaf", "setup", "update", "adjust", "freeze", "thaw"]


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

    def init(self, x: Array) -> Any:
        return None

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        raise NotImplementedError

    def step(self, state: Any, x: Array, dx: Array) -> Any:
        """``x -= step`` in place; returns the new state."""
        state, step = self.apply(state, x, dx)
        x -= step
        return state


@dataclasses.dataclass(frozen=True)
class Descent(Rule):
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

    def step(self, state: Any, x: Array, dx: Array) -> Any:
        kernel = find("descent_update", x, dx)
        if kernel is None:
            return Rule.step(self, state, x, dx)
        kernel(x, dx, self.eta)
        return state


@dataclasses.dataclass(frozen=True)
class Momentum(Rule):
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

    def step(self, v: Any, x: Array, dx: Array) -> Any:
        kernel = find("momentum_update", x, dx)
        if kernel is None:
            return Rule.step(self, v, x, dx)
        kernel(x, dx, v, self.eta, self.rho)
        return v


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
    m, v, (b1t, b2t) = state
    b1, b2 = beta
    m *= b1
    m += (1 - b1) * dx
    v *= b2
    v += (1 - b2) * (dx * dx)
    denom = xp.sqrt(v * (1 / (1 - b2t)))
    denom += eps
    return (m * (1 / (1 - b1t))) / denom, (m, v, (b1t * b1, b2t * b2))


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

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        xp = get_array_module(x)
        norm = xp.linalg.norm(dx.ravel(), ord=self.p)
        # As Flux's ClipNorm: with throw, the check reads the norm on the host (a sync on the GPU).
        if self.throw and not bool(xp.isfinite(norm)):
            raise ValueError(f"ClipNorm: the gradient has {self.p}-norm {float(norm)}, for an array of shape "
                             f"{tuple(x.shape)} and dtype {x.dtype}")
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

    def __repr__(self):
        return f"OptimiserChain({', '.join(map(repr, self.rules))})"

    def __eq__(self, other):
        return type(other) is OptimiserChain and other.rules == self.rules

    __hash__ = None

    def init(self, x: Array) -> Any:
        return tuple(r.init(x) for r in self.rules)

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array]:
        new = []
        for rule, s in zip(self.rules, state):
            s, dx = rule.apply(s, x, dx)
            new.append(s)
        return tuple(new), dx


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
    __slots__ = ("rule", "state", "frozen")

    def __init__(self, rule: Rule, state: Any, frozen: bool = False) -> None:
        self.rule = rule
        self.state = state
        self.frozen = frozen

    def __repr__(self):
        return f"Leaf({self.rule!r}{', frozen' if self.frozen else ''})"


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
    used twice in the model (tied weights) gets one leaf, shared.

    >>> import numpy as np
    >>> setup(Momentum(), {"w": np.ones(2), "n": 3, "idx": np.arange(2)})
    {'w': Leaf(Momentum(eta=0.01, rho=0.9)), 'n': None, 'idx': None}
    """
    _check_rule(rule, "setup")
    leaves = {}

    def walk(x):
        kids = children(x)
        if kids is None:
            if not is_float_array(x):
                return None
            if id(x) not in leaves:
                leaves[id(x)] = Leaf(rule, rule.init(x))
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


def update(state: Any, model: Any, grad: Any) -> tuple[Any, Any]:
    """One optimisation step, in place; returns ``(state, model)``.

    ``grad`` is the gradient of the model as ``fluxpy.gradient`` returns it (dicts for objects,
    ``None`` where there is no gradient). Every trainable array ``x`` becomes ``x - step``,
    written into ``x`` itself; frozen leaves are skipped; a tied array is stepped once (its
    gradient is already the total). A gradient that does not fit the model is an error naming
    the path.

    >>> import numpy as np
    >>> import fluxpy
    >>> model = [np.array([1.0, 2.0]), np.array([3.0])]
    >>> state = setup(Descent(0.5), model)
    >>> grad, = fluxpy.gradient(lambda m: (m[0] ** 2).sum(), model)
    >>> state, model = update(state, model, grad)
    >>> model
    [array([0., 0.]), array([3.])]
    """
    _update(state, model, grad, "model", set())
    return state, model


def _update(st, x, g, path, done):
    if st is None or g is None:
        return
    if isinstance(st, Leaf):
        _step(st, x, g, path, done)
        return
    kids = children(x)
    if kids is None:
        raise ValueError(f"update: the state tree has a node at {path} but the model has {_describe(x)} there; "
                         "was the model changed after setup?")
    if isinstance(x, (tuple, list)):
        if not isinstance(g, (tuple, list)) or len(g) != len(x):
            hint = "" if not (isinstance(g, tuple) and len(g) == 1) else \
                "; pass gradient(f, model)[0], not the whole tuple"
            raise ValueError(f"update: {path} is a {type(x).__name__} of {len(x)}, so its gradient should be a "
                             f"tuple or list of {len(x)}, got {_describe(g)}{hint}")
        pairs = [(k, v, g[k]) for k, v in kids]
    else:
        if not isinstance(g, dict):
            hint = "; pass gradient(f, model)[0], not the whole tuple" if isinstance(g, tuple) and len(g) == 1 else ""
            raise ValueError(f"update: {path} is {_describe(x)}, so its gradient should be a dict of its fields, "
                             f"got {_describe(g)}{hint}")
        extra = set(g) - {k for k, _ in kids}
        if extra:
            raise ValueError(f"update: the gradient for {path} has fields {sorted(map(str, extra))} that "
                             f"{_describe(x)} does not have")
        pairs = [(k, v, g.get(k)) for k, v in kids]
    for k, v, gk in pairs:
        _update(st[k], v, gk, _sub(path, k), done)


def _step(leaf, x, g, path, done):
    if id(leaf) in done:
        return
    done.add(id(leaf))
    dx = value_of(g)
    if not is_array(x):
        raise ValueError(f"update: the state tree has an array at {path} but the model has {_describe(x)}")
    if not hasattr(dx, "shape") or tuple(dx.shape) != tuple(x.shape):  # NumPy scalars do for 0-d arrays
        raise ValueError(f"update: the gradient for {path} should be an array of shape {tuple(x.shape)}, "
                         f"got {_describe(dx)}")
    if leaf.frozen:
        return
    leaf.state = leaf.rule.step(leaf.state, x, dx)


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
    that no rule has is an error. Accumulated state (moments) is kept.

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
    for leaf in leaves:
        leaf.rule = _adjusted(leaf.rule, changes, used)
    missing = set(changes) - used
    if leaves and missing:
        raise ValueError(f"adjust: no rule in the state tree has {sorted(missing)}")
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
