"""A rule's update written once: :class:`Formula`, and its evaluation on arrays.

A formula is plain data, a few lines of Python-syntax text that the NumPy path evaluates here and that
:mod:`fluxpy.kernels.cuda_optimise` translates into the per-parameter and the multi-tensor CUDA kernels, so the
three paths run the same operations in the same order:

- ``state``: the names of the per-element state arrays (updated in place), ``init`` their starting values
  (zero unless named there);
- ``counters``: per-step numbers (``beta^t``, a step count) as ``(name, next value)``, the next value an
  expression of the hyperparameters, the counters and the scalars; on the host they live in the rule's state, on
  the GPU in a float64 device array that the kernels read and advance;
- ``scalars``: per-step numbers computed from the hyperparameters (``rule.hyper()``) and the counters, in float64
  (Python floats on the host, ``double`` on the device);
- ``body``: elementwise statements ``(name, expression)`` over ``x``, ``dx``, the state arrays, ``inputs`` (0-d
  arrays a rule's ``prepare`` computes per parameter, ClipNorm's scale) and the numbers above, each number
  rounded once to the arrays' dtype (as NumPy rounds a Python number against an array). The body assigns
  ``step`` (``x -= step`` follows); an item ``("if", condition)`` on numbers ends the step there unless it holds
  (AccumGrad between its updates: no step, the remaining statements skipped).

Functions: ``sqrt``, ``abs``, ``sign``, ``maximum``, ``minimum``, ``clip`` (NumPy's, NaN-propagating),
``where(c, a, b)`` with ``c`` an elementwise comparison (Rprop's per-element cases), and ``a if c else b`` with ``c``
a number.

>>> import numpy as np
>>> f = Formula(state=("v",), body=(("v", "v * rho"), ("v", "v + eta * dx"), ("step", "v")))
>>> v = np.zeros(2)
>>> evaluate(f, {"eta": 0.1, "rho": 0.9}, [v], (), np.zeros(2), np.ones(2))
array([0.1, 0.1])
>>> v
array([0.1, 0.1])
"""
from __future__ import annotations

import dataclasses
import functools
import math

from ..backend import Array, get_array_module

__all__ = ["Formula", "parse", "evaluate", "advance", "chain"]


@dataclasses.dataclass(frozen=True)
class Formula:
    """One rule's update as data (see the module's text); hashable, so kernels are cached by it.

    >>> Formula(state=("v",), counters=(("t", "t + 1"),)).counter_names
    ('t',)
    """
    state: tuple = ()
    body: tuple = ()
    counters: tuple = ()
    scalars: tuple = ()
    inputs: tuple = ()
    init: tuple = ()    # (name, expression of the hyperparameters): each counter's first value, and a state
    #                     array's where it does not start at zero

    @functools.cached_property
    def counter_names(self) -> tuple:
        return tuple(name for name, _ in self.counters)


@functools.cache
def _code(expr: str):
    return compile(expr, f"<formula {expr}>", "eval")


_SCALAR_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs}


def numbers(formula: Formula, hyper: dict, counters: tuple) -> dict:
    """The hyperparameters, counters and per-step scalars of a step, by name (host values, float64).

    >>> numbers(Formula(scalars=(("c", "1 - rho"),)), {"rho": 0.75}, ())
    {'rho': 0.75, 'c': 0.25}
    """
    values = dict(hyper)
    values.update(zip(formula.counter_names, counters))
    space = dict(_SCALAR_FUNCTIONS)
    for name, expr in formula.scalars:
        space.update(values)
        values[name] = eval(_code(expr), space)
    return values


@functools.lru_cache(maxsize=512)
def _numbers_of(formula: Formula, hyper: tuple, counters: tuple, dtype) -> dict:
    """:func:`numbers` for ``hyper`` given as ``(name, type, value)`` and ``counters`` as ``(type, value)`` (the
    types keep a NumPy float apart from the equal Python float, whose results differ in type), each rounded to
    ``dtype`` where one is given: every parameter of a rule shares its step's numbers, so a step computes them once,
    not once per array. Read-only."""
    values = numbers(formula, {k: v for k, _, v in hyper}, tuple(v for _, v in counters))
    return values if dtype is None else {k: dtype.type(v) for k, v in values.items()}


class Hyper(dict):
    """A rule's hyperparameters by name (as ``rule.hyper()``) that no one changes, with the key of
    :func:`_numbers_of`'s cache made once (``key``) rather than at every parameter's step.

    >>> Hyper({"eta": 0.1}).key
    (('eta', <class 'float'>, 0.1),)
    """
    __slots__ = ("key",)

    def __init__(self, values: dict) -> None:
        super().__init__(values)
        self.key = _hyper_key(self)


def _hyper_key(hyper):
    return tuple([(k, type(v), v) for k, v in hyper.items()])


def _step_numbers(formula, hyper, counters, dtype=None):
    try:
        return _numbers_of(formula, hyper.key if type(hyper) is Hyper else _hyper_key(hyper),
                           tuple([(type(c), c) for c in counters]), dtype)
    except TypeError:   # an unhashable hyperparameter: computed afresh
        values = numbers(formula, hyper, counters)
        return values if dtype is None else {k: dtype.type(v) for k, v in values.items()}


def advance(formula: Formula, hyper: dict, counters: tuple) -> tuple:
    """The counters after one step (every next value from the old ones and the step's scalars), as the device's
    advance computes them.

    >>> advance(Formula(counters=(("bt", "bt * beta"),)), {"beta": 0.5}, (0.5,))
    (0.25,)
    """
    values = _step_numbers(formula, hyper, counters)
    return tuple(eval(_code(expr), dict(values)) for _, expr in formula.counters)


@functools.cache
def _functions(xp) -> dict:
    """The array functions a formula's body may call, from the array module ``xp``. Read-only."""
    return {"sqrt": xp.sqrt, "abs": xp.abs, "sign": xp.sign, "maximum": xp.maximum, "minimum": xp.minimum,
            "clip": xp.clip, "where": xp.where}


def evaluate(formula: Formula, hyper: dict, arrays: list, counters: tuple, x: Array, dx: Array,
             inputs: dict | None = None) -> Array | None:
    """One step of ``formula`` on arrays: the state ``arrays`` updated in place, the step returned (None where an
    ``("if", c)`` item stops it); ``x`` and ``dx`` unchanged."""
    space = dict(_functions(get_array_module(x)))
    space.update(_step_numbers(formula, hyper, counters, x.dtype))
    space.update(zip(formula.state, arrays))
    space.update(inputs or {})
    space["x"], space["dx"] = x, dx
    step = None
    for target, expr in formula.body:
        if target == "if":
            if not eval(_code(expr), space):
                break
            continue
        space[target] = eval(_code(expr), space)
    else:
        step = space["step"]
    for name, a in zip(formula.state, arrays):
        if space[name] is not a:
            a[...] = space[name]
    return step


def initial(formula: Formula, hyper: dict, x: Array) -> list:
    """The state arrays of a new parameter like ``x``: zeros, or the value ``init`` names.

    >>> import numpy as np
    >>> initial(Formula(state=("m", "acc"), init=(("acc", "eps"),)), {"eps": 0.5}, np.ones(2))
    [array([0., 0.]), array([0.5, 0.5])]
    """
    xp = get_array_module(x)
    init = dict(formula.init)
    return [xp.full_like(x, eval(_code(init[name]), dict(hyper))) if name in init else xp.zeros_like(x)
            for name in formula.state]


def initial_counters(formula: Formula, hyper: dict) -> tuple:
    """The counters of a new parameter (host values).

    >>> initial_counters(Formula(counters=(("t", "t + 1"),), init=(("t", "1"),)), {})
    (1,)
    """
    init = dict(formula.init)
    return tuple(eval(_code(init[name]), dict(hyper)) for name in formula.counter_names)


def rename(formula: Formula, prefix: str, dx: str) -> Formula:
    """``formula`` with every name of its own prefixed (``x`` kept, ``dx`` read from ``dx``), for a chain.

    >>> rename(Formula(body=(("step", "eta * dx + x"),)), "r1_", "r0_step").body
    (('r1_step', 'r1_eta * r0_step + x'),)
    """
    import ast

    own = set(formula.state) | set(formula.counter_names) | {n for n, _ in formula.scalars} | set(formula.inputs) \
        | {t for t, _ in formula.body if t != "if"}

    def text(expr, hyper_too=True):
        tree = ast.parse(expr, mode="eval")
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                if node.id == "dx":
                    node.id = dx
                elif node.id in own or (hyper_too and node.id not in _FUNCTIONS and node.id != "x"):
                    node.id = prefix + node.id
        return ast.unparse(tree)

    def item(t, e):
        return (t if t == "if" else prefix + t, text(e))
    return Formula(state=tuple(prefix + n for n in formula.state), body=tuple(item(t, e) for t, e in formula.body),
                   counters=tuple((prefix + n, text(e)) for n, e in formula.counters),
                   scalars=tuple((prefix + n, text(e)) for n, e in formula.scalars),
                   inputs=tuple(prefix + n for n in formula.inputs),
                   init=tuple((prefix + n, text(e)) for n, e in formula.init))


_FUNCTIONS = ("sqrt", "abs", "sign", "maximum", "minimum", "clip", "where")


def chain(formulas: list) -> Formula:
    """One formula of several applied in turn, each to the previous one's step (OptimiserChain): the names of
    rule ``i`` prefixed ``r{i}_``, its hyperparameters too.

    >>> decay, descent = Formula(body=(("step", "dx + lambd * x"),)), Formula(body=(("step", "eta * dx"),))
    >>> chain([decay, descent]).body
    (('r0_step', 'dx + r0_lambd * x'), ('r1_step', 'r1_eta * r0_step'), ('step', 'r1_step'))
    """
    out = Formula()
    dx = "dx"
    gates = []   # earlier rules' ("if", c) conditions: a later rule steps (and counts) only where they hold
    for i, f in enumerate(formulas):
        f = rename(f, f"r{i}_", dx)
        dx = f"r{i}_step"
        if gates:
            held = " and ".join(f"({g})" for g in gates)
            f = dataclasses.replace(f, counters=tuple((n, f"({e}) if {held} else {n}") for n, e in f.counters))
        gates += [e for t, e in f.body if t == "if"]
        out = Formula(state=out.state + f.state, body=out.body + f.body, counters=out.counters + f.counters,
                      scalars=out.scalars + f.scalars, inputs=out.inputs + f.inputs, init=out.init + f.init)
    return dataclasses.replace(out, body=out.body + (("step", dx),))


def parse(**parts) -> Formula:
    """A Formula from readable parts: ``state`` and ``inputs`` as names, ``body``, ``scalars``, ``counters`` and
    ``init`` as ``"name = expr"`` lines (``"if cond"`` in a body).

    >>> parse(state=("v",), scalars="c = 1 - rho", body="step = c * v").body
    (('step', 'c * v'),)"""
    def lines(text):
        out = []
        for line in text.strip().splitlines() if text else ():
            line = line.strip()
            if not line:
                continue
            if line.startswith("if "):
                out.append(("if", line[3:].strip()))
            else:
                name, expr = line.split("=", 1)
                out.append((name.strip(), expr.strip()))
        return tuple(out)
    return Formula(state=tuple(parts.get("state", ())), inputs=tuple(parts.get("inputs", ())),
                   body=lines(parts.get("body")), scalars=lines(parts.get("scalars")),
                   counters=lines(parts.get("counters")), init=lines(parts.get("init")))
