"""What every rule is: :class:`Rule` (its hyperparameters checked by name, ``init``, ``apply`` and ``step`` made
from its formula) and the layout of a rule's state (:func:`flatten`, :func:`build`).

>>> from fluxpy.optimise import Adam
>>> layout = Adam.STATE
>>> flatten(layout, ("m", "v", (0.9, 0.999)), {})
{'m': 'm', 'v': 'v', 'b1t': 0.9, 'b2t': 0.999}
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar

import numpy as np

from ..backend import Array
from ..capturing import capturing, refuse
from ..kernels.halfs import is_half
from .formula import Formula, Hyper, advance, evaluate, initial, initial_counters

__all__ = ["Rule", "formula_of", "flatten", "build", "check_rule"]


class Rule:
    """Base class of optimisation rules.

    A rule written as a :class:`~fluxpy.optimise.formula.Formula` (every rule here) defines :meth:`formula` and
    ``STATE``; ``init``, ``apply`` and the fused GPU steps come from them. Any other rule defines
    ``init(x) -> state`` and ``apply(state, x, dx) -> (state, step)`` (``apply`` may update its state arrays in
    place but must not modify ``dx``); ``update`` then calls ``step``, which does ``x -= step``.

    >>> import numpy as np
    >>> from fluxpy.optimise import setup, update
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

    #: How the state looks: a formula's state array and counter names in tuples as ``init`` returns them.
    STATE: ClassVar[Any] = None

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

    def formula(self) -> Formula | None:
        """The rule's update as a :class:`Formula` (None: the rule has only ``apply``)."""
        return None

    def layout(self) -> Any:
        """The state's shape in names (``STATE``), matching :meth:`formula`'s arrays and counters."""
        return type(self).STATE

    def hyper(self) -> dict:
        """The numbers the formula reads by name: each number field, a tuple field ``beta`` as ``beta1``,
        ``beta2``.

        >>> from fluxpy.optimise import Adam
        >>> Adam(0.1).hyper()
        {'eta': 0.1, 'beta1': 0.9, 'beta2': 0.999, 'eps': 1e-08}
        """
        out = {}
        for field in dataclasses.fields(self) if dataclasses.is_dataclass(self) else ():
            value = getattr(self, field.name)
            if isinstance(value, (tuple, list)):
                out.update((f"{field.name}{i}", v) for i, v in enumerate(value, start=1))
            elif not isinstance(value, bool):
                out[field.name] = value
        return out

    def prepare(self, x: Array, dx: Array) -> dict:
        """The formula's ``inputs`` for one parameter (0-d arrays on its device, ClipNorm's scale); none here."""
        return {}

    def init(self, x: Array) -> Any:
        f = formula_of(self)
        if f is None:
            return None
        hyper = self.hyper()
        return build(self.layout(), dict(zip(f.state, initial(f, hyper, x))) |
                     dict(zip(f.counter_names, initial_counters(f, hyper))))

    def apply(self, state: Any, x: Array, dx: Array) -> tuple[Any, Array | None]:
        f = formula_of(self)
        if f is None:
            raise NotImplementedError(f"{type(self).__name__} defines neither formula nor apply")
        if f.counters and capturing():   # the message made only where it is raised
            refuse(f"{self!r} stepping with host-side counters (beta^t, a step count) inside a CUDA graph capture: "
                   "no fused kernel takes these arrays, and the graph would freeze the counters")
        values = flatten(self.layout(), state, {})
        arrays = [values[n] for n in f.state]
        counters = tuple(values[n] for n in f.counter_names)
        hyper = hyper_of(self)
        step = evaluate(f, hyper, arrays, counters, x, dx, self.prepare(x, dx) if f.inputs else None)
        values.update(zip(f.counter_names, advance(f, hyper, counters)))
        return build(self.layout(), values), step

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
        """Whether :meth:`step` (a rule without a formula) skips itself on the device where the step's guard flag
        is not finite (:func:`fluxpy.capturing.guarding`); such a rule without one refuses a checked capture.
        Rules with a formula are stepped by their generated kernels, which always take the guard.

        >>> import numpy as np
        >>> from fluxpy.optimise import Descent
        >>> Descent().guarded_kernel(np.ones(2), np.ones(2))
        False
        """
        return False


def formula_of(rule: Rule) -> Formula | None:
    """``rule.formula()``, made once per rule object (rules are immutable; :func:`adjust` makes new ones).

    >>> from fluxpy.optimise import Momentum
    >>> formula_of(Momentum()).state
    ('v',)
    """
    kept = getattr(rule, "__dict__", None)
    if kept is None:   # a rule with __slots__: made on every call
        return rule.formula()
    if "_formula" not in kept:
        kept["_formula"] = rule.formula()
    return kept["_formula"]


def hyper_of(rule: Rule) -> dict:
    """``rule.hyper()``, made once per frozen rule object (its fields cannot change) and afresh for any other; the
    dict is shared: read it, never change it.

    >>> from fluxpy.optimise import Adam
    >>> rule = Adam(0.1); hyper_of(rule) is hyper_of(rule), hyper_of(rule) == rule.hyper()
    (True, True)
    """
    params = getattr(type(rule), "__dataclass_params__", None)
    kept = getattr(rule, "__dict__", None)
    if kept is None or params is None or not params.frozen:
        return rule.hyper()
    hyper = kept.get("_hyper")
    if hyper is None:
        hyper = kept["_hyper"] = Hyper(rule.hyper())
    return hyper


def flatten(layout: Any, state: Any, out: dict) -> dict:
    """The values of ``state`` by the names in ``layout`` (a name, None, or a tuple of layouts)."""
    if isinstance(layout, str):
        out[layout] = state
    elif isinstance(layout, tuple):
        for part, value in zip(layout, state):
            flatten(part, value, out)
    return out


def build(layout: Any, values: dict) -> Any:
    """The state of ``layout`` holding ``values`` (the inverse of :func:`flatten`).

    >>> build(("quad", None), {"quad": 1.0})
    (1.0, None)
    """
    if isinstance(layout, str):
        return values[layout]
    if isinstance(layout, tuple):   # the names among the parts read in place (a step rebuilds every leaf's state)
        return tuple([values[part] if type(part) is str else build(part, values) for part in layout])
    return None


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


def check_rule(rule: Any, where: str) -> None:
    """A ``TypeError`` naming ``where`` unless ``rule`` is a :class:`Rule`.

    >>> check_rule("adam", "setup")
    Traceback (most recent call last):
    ...
    TypeError: setup expects optimisation rules such as Adam(1e-3), got 'adam'
    """
    if not isinstance(rule, Rule):
        raise TypeError(f"{where} expects optimisation rules such as Adam(1e-3), got {rule!r}")
