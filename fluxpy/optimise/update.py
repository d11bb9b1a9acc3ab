"""The update machinery: :class:`Leaf`, :func:`setup`, :func:`update`, :func:`adjust`, :func:`freeze`,
:func:`thaw`, and :class:`Plan`, the one checked plan of a step that ``update``, :func:`fluxpy.train` and
:class:`fluxpy.TrainStep` all use.

>>> import numpy as np
>>> from fluxpy.optimise import Descent
>>> model = {"w": np.ones(2)}
>>> state = setup(Descent(0.5), model)
>>> plan = Plan(state, model, {"w": np.ones(2)})
>>> len(plan), plan.check(), plan.apply(), model["w"]
(1, None, None, array([0.5, 0.5]))
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..autodiff import value_of
from ..backend import Array, get_array_module, is_array, is_float_array, is_float_dtype
from ..capturing import capturing, guarding
from ..functors import trainable_keys, children
from ..kernels import find
from ..kernels.halfs import is_half
from . import multi
from .base import Rule, check_rule
from .rules import OptimiserChain

__all__ = ["Leaf", "setup", "update", "adjust", "freeze", "thaw", "Plan"]


_ALL = object()  # stands for "a gradient everywhere": a Plan then checks the state against the model alone


class Leaf:
    """The optimiser state of one array: its ``rule``, the rule's ``state`` and a ``frozen`` flag.

    >>> import numpy as np
    >>> from fluxpy.optimise import Descent
    >>> setup(Descent(), np.ones(2))
    Leaf(Descent(eta=0.1))
    """
    __slots__ = ("rule", "_state", "frozen", "_fits", "_steps", "_counters", "_ahead")

    def __init__(self, rule: Rule, state: Any, frozen: bool = False) -> None:
        self.rule = rule
        self.state = state
        self.frozen = frozen
        self._fits = None  # (array, shape, dtype) that update last found the state fits
        self._steps = None  # the _Steps of the last update whose plan began at this leaf (a cache)
        self._counters = None  # the device copy of the rule's counters that its kernels read (see multi.Group)

    @property
    def state(self) -> Any:
        """The rule's state. After a guarded step (a loss-scaled or checked one, which the device may skip) the
        device's counters are the true ones: they are read back here, once, outside a capture."""
        group = self._ahead
        if group is not None and not capturing():
            group.read_counters()
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._state, self._ahead = value, None

    def __repr__(self):
        return f"Leaf({self.rule!r}{', frozen' if self.frozen else ''})"

    def restore(self, rule: Rule, state: Any, frozen: bool) -> None:
        """Set the rule, the state and the flag (a loaded checkpoint's), dropping update's caches: the next update
        groups the leaves again and makes the device copy of the rule's counters from the restored host ones.

        >>> from fluxpy.optimise import Adam
        >>> leaf = setup(Adam(), np.ones(2))
        >>> leaf.restore(Adam(0.1), (np.zeros(2), np.zeros(2), (0.5, 0.25)), True)
        >>> leaf, leaf.state[2]
        (Leaf(Adam(eta=0.1, beta=(0.9, 0.999), eps=1e-08), frozen), (0.5, 0.25))
        """
        self.__init__(rule, state, frozen)

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


def setup(rule: Rule | Callable, model: Any) -> Any:
    """The optimiser state of ``model``: a tree like it with a :class:`Leaf` at each trainable float array.

    Only the children named ``trainable`` by a :func:`fluxpy.layer` class get leaves; an array
    used twice in the model (tied weights) gets one leaf, shared. Set the model up where it will
    train (after :func:`fluxpy.gpu`, :func:`fluxpy.f64`, ...): :func:`update` refuses a state whose
    arrays no longer fit the model's in shape, dtype or device.

    Different rules for different parts of one model (Optimisers.jl's ``setup(f, model)``): pass a function
    ``rule(path, x)`` instead of a rule; it is called once per trainable array with its path (a tuple of keys, as
    ``("layers", 0, "weight")``) and the array, and returns that array's rule, or None to leave the array untrained
    (a tied array takes the rule of its first path). The parts step in one :func:`update`, each by its own rule.

    >>> import numpy as np
    >>> from fluxpy.optimise import Adam, Momentum
    >>> setup(Momentum(), {"w": np.ones(2), "n": 3, "idx": np.arange(2)})
    {'w': Leaf(Momentum(eta=0.01, rho=0.9)), 'n': None, 'idx': None}
    >>> setup(lambda path, x: Adam() if path[0] == "enc" else Momentum(), {"enc": np.ones(2), "dec": np.ones(2)})
    {'enc': Leaf(Adam(eta=0.001, beta=(0.9, 0.999), eps=1e-08)), 'dec': Leaf(Momentum(eta=0.01, rho=0.9))}
    """
    if not isinstance(rule, Rule) and isinstance(model, Rule):
        raise TypeError(f"setup expects the rule first, then the model: setup({model!r}, model), got a "
                        f"{type(rule).__name__} first")
    choose = _rule_function(rule)
    leaves = {}

    def walk(x, path):
        kids = children(x)
        if kids is None:
            if not is_float_array(x):
                return None
            if id(x) not in leaves:
                chosen = choose(path, x)
                leaves[id(x)] = None if chosen is None else Leaf(chosen, chosen.init(_master_like(x)))
            return leaves[id(x)]
        allowed = trainable_keys(x)
        return _node(x, [(k, walk(v, path + (k,)) if allowed is None or k in allowed else None) for k, v in kids])
    return walk(model, ())


def _rule_function(rule):
    """``setup``'s first argument as a function ``(path, x) -> rule or None``, the rules it gives checked."""
    if isinstance(rule, Rule):
        return lambda path, x: rule
    if not callable(rule) or children(rule) is not None:   # a model (a callable tree) is not a function of paths
        check_rule(rule, "setup")

    def chosen(path, x):
        r = rule(path, x)
        if r is not None and not isinstance(r, Rule):
            raise TypeError(f"setup: the function given for the rules returned {r!r} for {Plan.path(path)}; it should "
                            "return an optimisation rule such as Adam(1e-3), or None to leave the array untrained")
        return r
    return chosen


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
    return Plan.path(keys)


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
    all gradients and one device sync; :func:`fluxpy.train` does this check by default. Inside a captured step
    (:class:`fluxpy.TrainStep`) nothing is read on the host: what the checks refuse skips the update on the device
    instead (:func:`fluxpy.capturing.guarding`).

    >>> import numpy as np
    >>> from fluxpy.optimise import Descent
    >>> import fluxpy
    >>> model = [np.array([1.0, 2.0]), np.array([3.0])]
    >>> state = setup(Descent(0.5), model)
    >>> grad, = fluxpy.gradient(lambda m: (m[0] ** 2).sum(), model)
    >>> state, model = update(state, model, grad)
    >>> model
    [array([0., 0.]), array([3.])]
    """
    plan = Plan(state, model, grad, "update")
    scaler = getattr(model, "loss_scaler", None)   # fluxpy.MixedPrecision's dynamic loss scale, or None
    if capturing():   # no host reads inside a capture: what the checks refuse, the device skips
        checked = plan.gradients(check_finite)
        with _also_guarded(Plan.finite_total(checked) if checked else None):
            if scaler is None:
                plan.apply()
            else:
                _apply_loss_scaled(plan, scaler)
        return state, model
    plan.check(check_finite if scaler is None else False)
    if scaler is None:
        plan.apply()
    else:
        _apply_loss_scaled(plan, scaler)
    return state, model


def _apply_loss_scaled(plan, scaler):
    """The step of a model with a dynamic loss scale: applied only where every gradient is finite (an overflow of
    the scaled float16 gradients skips it), then the scale advanced. Inside a capture the update kernels skip
    themselves on the device; eagerly the flag is read once (as PyTorch's ``GradScaler.step``)."""
    flag = Plan.finite_total(plan.gradients())
    if capturing():
        with _also_guarded(flag):
            plan.apply()
    elif Plan.is_finite(flag):
        plan.apply()
    else:
        plan.prepare()   # the skipped step still makes the device state a captured step will use
    scaler.advance(flag)


class Plan:
    """The checked plan of one update: every ``(leaf, x, dx, path)`` of the state tree that the gradient reaches
    (``entries``), checked against the model and the gradient (structure, shapes, dtypes, devices, a state that
    fits each array) when made, so an error (naming the path) is raised before anything changes. Without
    ``grad`` it checks the whole state tree against the model (``dx`` is then None). :func:`update`,
    :func:`fluxpy.train` and :class:`fluxpy.TrainStep` all step through one.

    >>> import numpy as np
    >>> from fluxpy.optimise import Adam
    >>> model = {"w": np.ones(2), "b": np.zeros(1)}
    >>> plan = Plan(setup(Adam(), model), model, {"w": np.ones(2), "b": None})
    >>> [Plan.path(path) for _, _, _, path in plan]
    ['model.w']
    """
    __slots__ = ("entries", "who")

    def __init__(self, state: Any, model: Any, grad: Any = _ALL, who: str = "update") -> None:
        self.who = who
        self.entries = _plan(state, model, grad, who)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def gradients(self, check_finite: bool = True) -> list:
        """The gradients a finiteness check covers: every unfrozen one, or (``check_finite=False``) those whose
        rule refuses a non-finite gradient (``needs_finite``)."""
        return [dx for leaf, _, dx, _ in self.entries if not leaf.frozen and (check_finite or leaf.rule.needs_finite)]

    def check(self, check_finite: bool = False) -> None:
        """Refuse NaN/Inf gradients before any change: all of them with ``check_finite``, else only where a rule
        says so (``needs_finite``). One reduction over every gradient checked and one read of its result; the slow
        search for the offending array runs only when that finds something.
        """
        todo = self.gradients(check_finite)
        if not todo or Plan.is_finite(Plan.finite_total(todo)):
            return
        for leaf, x, dx, path in self.nonfinite():
            if leaf.rule.needs_finite:
                try:
                    leaf.rule.check(x, dx)
                except ValueError as err:
                    raise ValueError(f"{self.who}: {err}, at {Plan.path(path)}; nothing was updated") from None
            if check_finite:
                raise FloatingPointError(f"{self.who}: the gradient for {Plan.path(path)} has "
                                         f"{Plan.count_nonfinite(dx)}; nothing was updated")

    def apply(self) -> None:
        """Step every unfrozen leaf (the multi-tensor groups of :mod:`fluxpy.optimise.multi`, in the plan's
        order). Inside :func:`fluxpy.capturing.guarding` every kernel skips itself where the guard is not finite;
        a step that cannot refuses the capture."""
        multi.apply(self.entries)

    def prepare(self) -> None:
        """Make the device state :meth:`apply` will use (:func:`fluxpy.optimise.multi.prepare`), stepping nothing."""
        multi.prepare(self.entries)

    def nonfinite(self) -> list:
        """The unfrozen entries whose gradient has a NaN or an infinity (one sync per array: the error path)."""
        return [e for e in self.entries
                if not e[0].frozen and not bool(get_array_module(e[2]).isfinite(e[2]).all())]

    @staticmethod
    def finite_total(arrays: list) -> Any:
        """A scalar (on the arrays' device) that is finite when every entry of ``arrays`` is.

        The ``finite_total`` kernel where one takes the list (the GPU: one launch, 0 or NaN); else the float64
        sum of each array (NaN or infinite where an entry is; it overflows only past 1e308, which then costs the
        exact search in :meth:`nonfinite`).

        >>> import numpy as np
        >>> Plan.is_finite(Plan.finite_total([np.ones(2), np.array([np.inf])]))
        False
        """
        if not arrays:
            return 0.0
        try:
            kernel = find("finite_total", arrays[0], arrays)
        except TypeError:  # NumPy and CuPy arrays mixed: one total per array (a slow path, never the normal one)
            return [Plan.finite_total([a]) for a in arrays]
        if kernel is not None:
            return kernel(arrays[0], arrays)
        total = 0.0
        for a in arrays:
            total = total + a.sum(dtype=np.float64)
        return total

    @staticmethod
    def is_finite(total: Any) -> bool:
        """Reads :meth:`finite_total`'s result on the host (the one sync of the check)."""
        if isinstance(total, list):
            return all(Plan.is_finite(t) for t in total)
        return math.isfinite(float(total))

    @staticmethod
    def count_nonfinite(dx: Array) -> str:
        """``"2 NaN entries (of 6, shape (2, 3), dtype float32)"``: what an error says of a bad gradient."""
        xp = get_array_module(dx)
        nan, inf = int(xp.isnan(dx).sum()), int(xp.isinf(dx).sum())
        parts = [f"{n} {name}" for n, name in ((nan, "NaN"), (inf, "infinite")) if n]
        return f"{' and '.join(parts)} entries (of {dx.size}, shape {tuple(dx.shape)}, dtype {dx.dtype})"

    @staticmethod
    def path(keys: tuple) -> str:
        """``("layers", 0, "weight")`` -> ``"model.layers[0].weight"`` (paths are kept as tuples until an
        error)."""
        out = "model"
        for k in keys:
            out = _sub(out, k)
        return out

    @staticmethod
    def leaves(tree: Any) -> list:
        """The distinct :class:`Leaf` objects of a state tree (or a single Leaf)."""
        return _leaves(tree)


def _also_guarded(flag):
    """Within the block, updates run only where ``flag`` (and any outer guard) is finite; None: no new guard."""
    return contextlib.nullcontext() if flag is None else guarding(flag)




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
    if _walk_common(st, x, g, path, plan, seen, who):
        return
    _walk_checked(st, x, g, path, plan, seen, who)


def _walk_common(st, x, g, path, plan, seen, who):
    """The walk below a node whose state and gradient fit the model node in the usual way (a layer or dict with
    a dict of state and of gradient for its fields; a tuple or list with ones of its length), with the same
    checks as :func:`_walk_checked` made by C-level comparisons, and the children without state or gradient
    skipped without a call. False (having looked at nothing below) for any other node: the full walk checks it
    and says what is wrong."""
    everywhere = g is _ALL
    if type(st) is dict:
        if isinstance(x, (tuple, list)):
            return False
        kids = children(x)
        if kids is None or len(st) != len(kids):
            return False
        try:
            states = [st[k] for k, _ in kids]   # with the lengths equal: the state has exactly the node's fields
        except KeyError:
            return False
        if not everywhere and (type(g) is not dict or len(g) > len(kids) or not g.keys() <= st.keys()):
            return False
        for (k, v), s in zip(kids, states):
            if s is not None:
                gk = g if everywhere else g.get(k)
                if gk is not None:
                    _walk(s, v, gk, path + (k,), plan, seen, who)
        return True
    if (type(st) is list or type(st) is tuple) and (type(x) is tuple or type(x) is list) and len(st) == len(x):
        if not everywhere and not ((type(g) is tuple or type(g) is list) and len(g) == len(x)):
            return False
        for k, (v, s) in enumerate(zip(x, st)):
            if s is not None:
                gk = g if everywhere else g[k]
                if gk is not None:
                    _walk(s, v, gk, path + (k,), plan, seen, who)
        return True
    return False


def _walk_checked(st, x, g, path, plan, seen, who):
    """The walk below a node with every check spelled out, raising the error that names what does not fit."""
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
    if type(x) is not np.ndarray and not is_array(x):
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
    fits = leaf._fits
    if fits is not None and fits[0] is x and fits[1] == x.shape and fits[2] == x.dtype:
        return   # the array the state was found to fit last time (rules keep their arrays' shapes)
    for a in _state_arrays(leaf.state, []):
        if type(a) is not type(x) or a.shape != x.shape or a.dtype != _master_like_dtype(x.dtype):
            raise ValueError(f"{who}: the optimiser state at {_path(path)} holds a {_array_text(a)}, but the model has "
                             f"a {_array_text(x)} there; was the state set up for another model, or the model moved or "
                             "converted after setup? Call setup(rule, model) again for the model as it is now")
    leaf._fits = (x, x.shape, x.dtype)


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
    >>> from fluxpy.optimise import Adam, ClipGrad, OptimiserChain
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
    >>> from fluxpy.optimise import Descent
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
    >>> from fluxpy.optimise import Descent
    >>> st = freeze(setup(Descent(), np.ones(1)))
    >>> thaw(st)
    Leaf(Descent(eta=0.1))
    """
    for leaf in _leaves(state):
        leaf.frozen = False
    return state
