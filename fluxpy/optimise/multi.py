"""How a plan's leaves are stepped: leaves whose rules have a formula in groups, one fused step per group.

A group is the unfrozen leaves whose rules declare the same :class:`~fluxpy.optimise.formula.Formula` with the
same hyperparameters (``rule.hyper()``) and whose states hold the same counters (``beta^t``, a step count; values
and Python types alike), whose parameters have one array type and dtype and share no memory with any other
parameter of the plan (so that stepping them together is stepping them one by one). Nothing here asks which
rule a leaf has: the rule's declaration (its formula, hyperparameters and ``STATE`` layout) is all.

Each step a group asks the kernel table for the multi-tensor kernel ``optimiser_step_many`` (one launch for the
whole group), else the per-parameter ``optimiser_step`` for each leaf; either reads the group's counters from a
float64 device array, which ``optimiser_advance`` then moves on (and :func:`fluxpy.capturing.on_replay` moves
the host's copy in the leaves' states after each replay of a captured step). A guarded step (loss-scaled or
checked: the device skips it where a gradient is not finite) leaves the host unsure, so the leaves' states read
the device's counters back when next asked for (``Leaf.state``). Where neither kernel takes the
arrays (NumPy; a strided float16 or bfloat16 parameter) the leaves step one by one through ``rule.step`` (the
formula on arrays). Leaves whose rule
has no formula step through ``rule.step`` too. Leaves and groups step in the plan's order.

The grouping is built once and reused while the plan has the same leaves in the same order, each with the same
array, the same rule object, the same ``frozen`` flag and the same state object as the last step left it;
anything else (``adjust``, ``freeze``, ``thaw``, a new array, a state put in by hand) builds it again.
"""
from __future__ import annotations

import numpy as np

from ..backend import get_array_module, gpu_device
from ..capturing import current_guard, on_replay, refuse
from ..kernels import find
from ..kernels.halfs import is_half
from .base import build, flatten, formula_of
from .formula import advance

__all__ = ["apply", "prepare"]


def apply(plan: list) -> None:
    """Steps every unfrozen leaf of ``plan`` (``(leaf, x, dx, path)`` entries), by the :class:`Steps` cached on
    the plan's first leaf.

    >>> import numpy as np
    >>> from fluxpy.optimise import Descent, Plan, setup
    >>> model = {"a": np.ones(2), "b": np.ones(1)}
    >>> apply(Plan(setup(Descent(0.5), model), model, {"a": np.ones(2), "b": np.ones(1)}).entries)
    >>> model
    {'a': array([0.5, 0.5]), 'b': array([0.5])}
    """
    if plan:
        _steps(plan).run(plan)


def prepare(plan: list) -> None:
    """Makes the device state that :func:`apply` of ``plan`` will use (the groups' counters), stepping nothing: a
    step whose update was skipped (a float16 overflow) still leaves it, so the next step can be captured (a capture
    cannot copy from the host).

    >>> import numpy as np
    >>> from fluxpy.optimise import Adam, Plan, setup
    >>> model = {"a": np.ones(2)}
    >>> prepare(Plan(setup(Adam(), model), model, {"a": np.ones(2)}).entries)
    >>> model
    {'a': array([1., 1.])}
    """
    if plan:
        for item in _steps(plan).order:
            if type(item) is not int:
                item.prepare()


def _steps(plan):
    anchor = plan[0][0]
    steps = anchor._steps
    if steps is None or not steps.fits(plan):
        steps = anchor._steps = Steps(plan)
    return steps


class Steps:
    """Which leaves of a plan step together, built once and reused (see the module's text)."""
    __slots__ = ("sig", "states", "order")

    def __init__(self, plan):
        self.sig = [(leaf, x, leaf.rule, leaf.frozen) for leaf, x, _, _ in plan]
        self.states = [None] * len(plan)   # a grouped leaf's state as the last step left it; None: not grouped
        shared = _sharing_memory(plan)
        groups, order = {}, []
        for i, (leaf, x, _, _) in enumerate(plan):
            if leaf.frozen:
                continue
            parts = _declared(leaf, x)
            if parts is None:
                order.append(i)
                continue
            key = None if i in shared else _group_key(parts, x)
            group = groups.get(key) if key is not None else None
            if group is None:
                group = Group(leaf.rule, parts)
                order.append(group)
                if key is not None:
                    groups[key] = group
            group.add(i, leaf, x, parts)
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
                    refuse_unguarded(leaf.rule, "stepping a parameter on its own")
                leaf.state = leaf.rule.step(leaf.state, x, dx)
            else:
                item.step(plan, self.states)


def refuse_unguarded(rule, how):
    """Inside :func:`fluxpy.capturing.guarding`: an update with no kernel that skips itself cannot be captured."""
    refuse(f"{rule!r} {how}: its update cannot skip itself on the device when the step's loss or gradients are "
           "not finite")


class _Parts:
    """A leaf's state as its rule's formula sees it: the state arrays in the formula's order and the counters."""
    __slots__ = ("formula", "hyper", "layout", "arrays", "counters", "values")

    def __init__(self, formula, hyper, layout, values):
        self.formula, self.hyper, self.layout, self.values = formula, hyper, layout, values
        self.arrays = [values[n] for n in formula.state]
        self.counters = tuple(values[n] for n in formula.counter_names)


def _declared(leaf, x):
    """The leaf's rule's formula and its state split by the rule's layout; None where the rule has no formula or
    the state is not one the formula made (a state put in by hand: ``rule.step`` deals with it)."""
    rule = leaf.rule
    f = formula_of(rule)
    if f is None:
        return None
    layout = rule.layout()
    try:
        values = flatten(layout, leaf.state, {})
        if not _identical(build(layout, values), leaf.state):
            return None
        parts = _Parts(f, rule.hyper(), layout, values)
    except (KeyError, TypeError, ValueError):
        return None
    if any(type(a) is not type(x) for a in parts.arrays):
        return None
    return parts


def _identical(a, b):
    """Whether the state ``a`` rebuilt from a layout is ``b``: the same tuples holding the same objects."""
    if type(a) is tuple:
        return type(b) is tuple and len(a) == len(b) and all(_identical(p, q) for p, q in zip(a, b))
    return a is b


def _typed(v):
    return type(v), v


def _group_key(parts, x):
    """What a leaf's group is known by (None: the leaf steps alone): the formula, the hyperparameters and the
    counters, each value with its type (so that a group's shared next counters are what each leaf's own step
    would make), the array type and dtype."""
    key = (parts.formula, type(x), x.dtype) + tuple((k,) + _typed(v) for k, v in parts.hyper.items()) \
        + tuple(_typed(c) for c in parts.counters)
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


class Group:
    """Leaves that one fused step moves: their plan indices, leaves, parameters, state arrays and layouts, and
    the counters twice: ``counters`` on the host (what each leaf's state holds, as ``rule.step`` makes it) and a
    float64 device array shared by the leaves (``Leaf._counters``: what the kernels read and advance, so that a
    replayed CUDA graph sees them advance); both advance by the same float64 arithmetic."""
    __slots__ = ("rule", "formula", "hyper", "counters", "index", "leaves", "xs", "parts", "states", "memo")

    def __init__(self, rule, parts):
        self.rule, self.formula, self.hyper = rule, parts.formula, parts.hyper
        self.counters = parts.counters
        self.states = None   # the Steps' record of the leaves' states, which read_counters keeps up to date
        self.index, self.leaves, self.xs, self.parts = [], [], [], []
        self.memo = {}   # the multi-parameter kernel's record of xs and the state arrays (the same every step)

    def add(self, i, leaf, x, parts):
        self.index.append(i)
        self.leaves.append(leaf)
        self.xs.append(x)
        self.parts.append(parts)

    def step(self, plan, states):
        dxs = [plan[i][2] for i in self.index]
        xs, f = self.xs, self.formula
        arrays = [p.arrays for p in self.parts]
        none = [[] for _ in xs]   # the kernels are asked before the inputs are made (the host path makes its own)
        many = find("optimiser_step_many", xs[0], f, xs, dxs, arrays, none, self.memo)
        one = None if many is not None else find("optimiser_step", xs[0], f, dxs[0], arrays[0], [])
        if many is None and one is None:
            self._host_steps(dxs, states)
            return
        inputs = [_inputs(self.rule, f, x, dx) for x, dx in zip(xs, dxs)] if f.inputs else none
        guard = current_guard()
        ok = {} if guard is None else {"ok": guard}
        counters = self._device_counters(get_array_module(xs[0])) if f.counters else None
        if many is not None:
            many(xs[0], f, xs, dxs, arrays, inputs, self.hyper, counters, memo=self.memo, **ok)
        else:
            for x, dx, a, i in zip(xs, dxs, arrays, inputs):
                if find("optimiser_step", x, f, dx, a, i) is None:   # a layout or shape the kernel refuses
                    raise TypeError(f"{self.rule!r}: no fused step takes a parameter of shape {x.shape}")
                one(x, f, dx, a, i, self.hyper, counters, **ok)
        if counters is not None:
            find("optimiser_advance", counters)(counters, f, self.hyper, **ok)
            if guard is None:
                self._advance_host(states)
                on_replay(lambda: self._advance_host(states))
            else:   # the device skips a non-finite step, so only its counters are known: read when asked for
                self.states = states
                self._mark_ahead()
                on_replay(self._mark_ahead)

    def prepare(self):
        """The group's device counters made now (on the device of its parameters), where its formula has any."""
        if self.formula.counters and gpu_device(self.xs[0]) is not None:
            self._device_counters(get_array_module(self.xs[0]))

    def _host_steps(self, dxs, states):
        """Leaf by leaf through ``rule.step`` (the formula on arrays); the host counters move with the leaves."""
        if current_guard() is not None:
            refuse_unguarded(self.rule, "stepping its parameters without a fused kernel")
        for leaf, x, dx, i in zip(self.leaves, self.xs, dxs, self.index):
            leaf._counters = None   # the host's counters move on alone: a later kernel step starts a new copy
            leaf.state = states[i] = leaf.rule.step(leaf.state, x, dx)
        if self.formula.counters:
            self.counters = tuple(flatten(self.parts[0].layout, self.leaves[0].state, {})[n]
                                  for n in self.formula.counter_names)

    def _device_counters(self, xp):
        """The group's device counters: the ones its leaves share already (kept across regroupings, since a
        captured CUDA graph holds their address), else a new array from the host's, given to every leaf."""
        shared = self.leaves[0]._counters   # (array, how many leaves share it): exactly this group's leaves, or none
        if shared is not None and shared[1] == len(self.leaves) and all(leaf._counters is shared
                                                                        for leaf in self.leaves):
            return shared[0]
        device = xp.array([float(c) for c in self.counters], dtype=np.float64)
        shared = (device, len(self.leaves))
        for leaf in self.leaves:
            leaf._counters = shared
        return device

    def _advance_host(self, states):
        """The host side of one step: the counters advanced as the device advanced them, in every leaf's state."""
        if any(leaf._ahead is not None for leaf in self.leaves):
            self.read_counters()
        self._set_host(advance(self.formula, self.hyper, self.counters), states)

    def _set_host(self, counters, states):
        self.counters = counters
        for i, leaf, parts in zip(self.index, self.leaves, self.parts):
            parts.values.update(zip(self.formula.counter_names, counters))
            leaf.state = states[i] = build(parts.layout, parts.values)

    def _mark_ahead(self):
        """The leaves' host counters may be behind the device's (a guarded step ran there): ``leaf.state`` reads
        them back (:meth:`read_counters`) before it is next used."""
        for leaf in self.leaves:
            leaf._ahead = self

    def read_counters(self):
        """The device counters copied into the host's counters and every leaf's state (one read, which waits for
        the device), in the host counters' Python types."""
        shared = self.leaves[0]._counters
        if shared is None:
            return
        device = shared[0].tolist()
        self._set_host(tuple(type(h)(d) for h, d in zip(self.counters, device)), self.states)


def _inputs(rule, formula, x, dx):
    """The formula's per-parameter inputs (0-d arrays; ClipNorm's scale), in the formula's order."""
    if not formula.inputs:
        return []
    if is_half(dx.dtype):   # made from the float32 gradient, as the NumPy path's float32 copy makes them
        dx = dx.astype(np.float32)
    made = rule.prepare(x, dx)
    return [made[n] for n in formula.inputs]

