"""Saving and resuming a whole training run: :func:`save_training` and :func:`load_training`.

A model alone is saved with :func:`fluxpy.save` (its arrays under plain keys, a file PyTorch or JAX reads too). A
training run needs more to go on exactly where it stopped: the optimiser state (every rule's moments and its Python
counters, such as Adam's ``beta^t``, in every leaf, chains and tied weights included), the dynamic loss scale of
float16 :func:`fluxpy.mixed_precision`, the step count (the position of a learning-rate schedule) and fluxpy's random
generators (:mod:`fluxpy.random`: the dropout masks and batch orders still to come). ``save_training(path, model,
opt_state, step=...)`` writes all of it to ONE file, atomically, in either format (``.npz`` or ``.safetensors``,
by the extension, as :func:`fluxpy.save`); ``load_training(path, model, opt_state)`` puts it back in place into a
model and an optimiser state made as for the first run (``setup(rule, model)``), and returns the step and what else
was saved. A run that is resumed this way, in a new process, continues bit for bit as the run that never stopped.

Why two functions beside ``save``/``load``, and not one ``save`` that also takes an optimiser state: what a
PyTorch user writes (``torch.save({"model": ..., "optimizer": ..., "step": ...})``) and what a Flux user writes
(``JLD2.jldsave(path; model_state, opt_state)``) are one call that saves everything a run needs and one that loads
it back, and the model-only file must stay a plain model file that other libraries read. So each file has one
reader: ``load`` refuses a training checkpoint and ``load_training`` a model file, each naming the other.
:func:`fluxpy.train` saves with ``checkpoint=path, every=n`` and resumes with ``resume=True``.

A load checks everything first (the model's keys, shapes and dtypes; the optimiser state's leaves, rules, arrays
and counters, their Python types included; tied weights; the loss scale; the random state) and changes nothing
unless all of it fits: anything wrong is one :class:`fluxpy.CheckpointError` naming the file and the key. The
optimiser's arrays are copied into the state's own arrays (on their device); its counters are set on the host, and
the next update makes the device copy of them again (a :class:`fluxpy.TrainStep` that captured the state before
the load takes one eager step and captures again, as after :func:`fluxpy.adjust`).

>>> import numpy as np, os, tempfile, fluxpy
>>> from fluxpy.layers import Chain, Dense, Dropout
>>> from fluxpy.optimise import Adam, setup
>>> def run(steps, model, opt):
...     for _ in range(steps):
...         (g,) = fluxpy.gradient(lambda m: (m(np.ones((4, 3), np.float32)) ** 2).sum(), model)
...         fluxpy.update(opt, model, g)
>>> def fresh():
...     fluxpy.seed(0)
...     model = Chain(Dense(3, 8, fluxpy.relu), Dropout(0.5), Dense(8, 1))
...     return model, setup(Adam(0.01), model)
>>> model, opt = fresh(); run(6, model, opt)                      # six steps without a stop
>>> other, opt2 = fresh(); run(3, other, opt2)                    # three steps, saved
>>> path = os.path.join(tempfile.mkdtemp(), "run.safetensors")
>>> save_training(path, other, opt2, step=3, epoch=1)
>>> resumed, opt3 = fresh()                                       # a new run (a new process would do the same)
>>> load_training(path, resumed, opt3)
{'step': 3, 'epoch': 1}
>>> run(3, resumed, opt3)                                         # three more steps: the same weights, bit for bit
>>> all(np.array_equal(a, b) for a, b in zip(fluxpy.trainables(model), fluxpy.trainables(resumed)))
True
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import numbers
import os
from typing import Any

import numpy as np

from . import random
from .backend import copy_into, is_array
from .functors import loadstate
from .io import CheckpointError, fitted_state, flat_state, read_file, write_file
from .optimise import Leaf, OptimiserChain, Plan

__all__ = ["save_training", "load_training"]

_FORMAT = "fluxpy training"
_VERSION = 1   # of the JSON text beside the arrays; a newer one is refused
_MODEL, _OPTIMISER, _SCALE = "model.", "optimiser.", "loss_scale."


# ---------------------------------------------------------------------------------------------
# save


def save_training(path: str | os.PathLike, model: Any, opt_state: Any, *, step: int = 0, **info: Any) -> None:
    """Write the whole state of a training run to the file ``path``, atomically: ``model``'s arrays, ``opt_state``
    (from :func:`fluxpy.setup`), the model's dynamic loss scale (:class:`fluxpy.DynamicLossScale`, where
    ``model`` is a float16 :class:`fluxpy.MixedPrecision`), fluxpy's random generators
    (:func:`fluxpy.random.get_state`), ``step`` (an int >= 0: the steps done, a schedule's position) and ``info``
    (JSON values: numbers, strings, lists, dicts; e.g. ``epoch=3``). The format follows the extension, as for
    :func:`fluxpy.save`; the file is written as ``save`` writes one (a temporary file renamed over ``path``). Read
    it with :func:`load_training`.

    >>> import numpy as np, os, tempfile
    >>> from fluxpy.optimise import Momentum, setup
    >>> model = {"w": np.ones(2)}
    >>> path = os.path.join(tempfile.mkdtemp(), "run.npz")
    >>> save_training(path, model, setup(Momentum(), model), step=7)
    >>> sorted(np.load(path).files)
    ['__fluxpy_training__.json', 'model.w', 'optimiser.w']
    """
    who = "save_training"
    _check_step(step, who)
    arrays = {_MODEL + k: a for k, a in flat_state(model).items()}
    if not arrays:
        raise ValueError(f"{who} expects a model holding at least one array, got a {type(model).__name__} with none")
    Plan(opt_state, model, who=who)   # the state fits the model (setup(rule, model) for this model), or an error
    leaves, tied = _leaf_paths(opt_state)
    optimiser = {path: {"rule": _rule_data(leaf.rule), "frozen": leaf.frozen,
                        "state": _described(leaf.state, _OPTIMISER + path, arrays, who)}
                 for path, leaf in leaves.items()}
    scale = None
    scaler = getattr(model, "loss_scaler", None)
    if scaler is not None:
        saved = scaler.get_state()
        arrays[_SCALE + "scale"], arrays[_SCALE + "good"] = saved["scale"], saved["good"]
        scale = {"skipped": saved["skipped"]}
    meta = {"format": _FORMAT, "version": _VERSION, "step": int(step), "info": info, "optimiser": optimiser,
            "tied": tied, "loss_scale": scale, "rng": random.get_state()}
    try:
        text = json.dumps(meta)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{who}: the extra values ({', '.join(sorted(info))}) must be JSON values (numbers, strings, "
                        f"booleans, None, lists and dicts of them): {err}") from None
    write_file(path, arrays, text, who)


def _check_step(step, who):
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise TypeError(f"{who}: step must be an int >= 0 (the steps done), got {step!r}")


def _leaf_paths(tree):
    """``({path: leaf}, {path: first path})``: every distinct leaf of a state tree under its first dotted path, and
    each further path of a leaf shared by tied weights."""
    leaves, tied, first = {}, {}, {}

    def walk(node, prefix):
        if isinstance(node, Leaf):
            path = prefix[:-1]
            if id(node) in first:
                tied[path] = first[id(node)]
            else:
                first[id(node)], leaves[path] = path, node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{prefix}{i}.")
    walk(tree, "")
    return leaves, tied


def _rule_data(rule):
    """A rule as JSON: its type, and its number fields (an adjusted learning rate is part of the run)."""
    if isinstance(rule, OptimiserChain):
        return {"type": "OptimiserChain", "rules": [_rule_data(r) for r in rule.rules]}
    fields = {}
    for field in dataclasses.fields(rule) if dataclasses.is_dataclass(rule) else ():
        value = getattr(rule, field.name)
        if isinstance(value, (numbers.Real, tuple)) and all(isinstance(v, numbers.Real) for v in np.ravel(value)):
            fields[field.name] = list(value) if isinstance(value, tuple) else value
    return {"type": type(rule).__name__, "fields": fields}


def _described(value, key, arrays, who):
    """The JSON description of one leaf's state (nested tuples of arrays, Python numbers and None), its arrays put
    in ``arrays`` under ``key`` and the positions below it."""
    if is_array(value):
        arrays[key] = value
        return "array"
    if isinstance(value, np.generic):   # a NumPy scalar: kept as a 0-d array of its dtype
        arrays[key] = np.asarray(value)
        return "scalar"
    if type(value) in (bool, int, float):
        return {type(value).__name__: value}
    if value is None:
        return None
    if type(value) in (tuple, list):
        return {type(value).__name__: [_described(v, f"{key}.{i}", arrays, who) for i, v in enumerate(value)]}
    raise TypeError(f"{who}: the optimiser state at {key} holds a {type(value).__name__}, which a checkpoint "
                    "cannot store (arrays, Python numbers, None, and tuples or lists of them)")


# ---------------------------------------------------------------------------------------------
# load


def load_training(path: str | os.PathLike, model: Any, opt_state: Any) -> dict:
    """Put the training run saved by :func:`save_training` back into ``model`` and ``opt_state`` in place (a model
    of the same structure and ``setup(rule, model)`` with the rules of the saved run), with its loss scale and
    fluxpy's random generators; returns ``{"step": step, **info}`` as saved. The rules' hyperparameters are the
    saved ones (a learning rate a schedule adjusted), and so are the ``frozen`` flags.

    Everything is checked before anything changes: a file that cannot be read, a model's file, or one that does
    not fit the model or the optimiser state (another rule, other shapes or dtypes, other counters) is a
    :class:`fluxpy.CheckpointError` naming the file and the first keys that differ; the model, the state, the loss
    scale and the generators are then as they were.

    >>> import numpy as np, os, tempfile
    >>> from fluxpy.optimise import Adam, Descent, setup
    >>> model = {"w": np.ones(2)}
    >>> path = os.path.join(tempfile.mkdtemp(), "run.npz")
    >>> save_training(path, model, setup(Adam(), model), step=5)
    >>> load_training(path, model, setup(Descent(), model))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fluxpy.io.CheckpointError: load_training: ...run.npz does not fit the optimiser state: optimiser.w was saved ...
    """
    who = "load_training"
    target, saved, text = read_file(path, who)
    meta = _meta(text, target)
    fits = _Fit(target)
    fits.keys(saved, meta, model)
    state = fitted_state(model, {k[len(_MODEL):]: a for k, a in saved.items() if k.startswith(_MODEL)}, target, who)
    try:
        Plan(opt_state, model, who=who)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{err}; nothing was loaded", target) from None
    leaves = fits.optimiser(meta, saved, opt_state)
    scaler = fits.loss_scale(meta, saved, model)
    try:
        random.check_state(meta["rng"])
    except ValueError as err:
        raise CheckpointError(f"{who}: {target} is corrupt: its random state does not fit ({err}); nothing was "
                              "loaded", target) from None
    try:
        loadstate(model, state)   # checks its values once more (no float overflows), then copies
    except ValueError as err:
        raise CheckpointError(f"{who}: {target}: {err}", target) from None
    for leaf, rule, value, frozen, copies in leaves:
        for dst, src in copies:
            copy_into(dst, src)
        # a new rule object even where the hyperparameters are the same: a TrainStep that captured this state
        # sees a changed rule and captures again (its graph holds the device counters the restore replaces)
        leaf.restore(copy.copy(rule) if rule is leaf.rule else rule, value, frozen)
    if scaler is not None:
        scaler[0].set_state(scaler[1])
    random.set_state(meta["rng"])
    return {"step": meta["step"], **meta["info"]}


def _meta(text, target):
    """The checkpoint's JSON text, parsed and checked for the entries every version has."""
    who = "load_training"
    if text is None:
        raise CheckpointError(f"{who}: {target} holds a model's arrays only (written by fluxpy.save), not a "
                              "training run: load it with fluxpy.load(path, model)", target)
    try:
        meta = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"{who}: {target} is corrupt: its training record is not JSON ({err})", target) from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise CheckpointError(f"{who}: {target} is corrupt: its training record is not fluxpy's", target)
    version = meta.get("version")
    if not isinstance(version, int) or version > _VERSION:
        raise CheckpointError(f"{who}: {target} was written in fluxpy's training checkpoint format {version!r}; this "
                              f"fluxpy reads format {_VERSION} and older: upgrade fluxpy", target)
    kinds = {"step": int, "info": dict, "optimiser": dict, "tied": dict, "rng": dict}
    for name, kind in kinds.items():
        if not isinstance(meta.get(name), kind) or isinstance(meta.get(name), bool):
            raise CheckpointError(f"{who}: {target} is corrupt: its training record's {name!r} should be a "
                                  f"{kind.__name__}, got {meta.get(name)!r:.60}", target)
    return meta


class _Fit:
    """The checks of one load, each raising a :class:`CheckpointError` naming the file and the key; none changes
    anything, and each returns what the load will then set."""

    def __init__(self, target):
        self.target = target

    def fail(self, what, problem):
        raise CheckpointError(f"load_training: {self.target} does not fit {what}: {problem}; nothing was loaded",
                              self.target)

    def keys(self, saved, meta, model):
        """No array in the file that no part of the run names (a model key is checked with the model)."""
        expected_scale = {_SCALE + "scale", _SCALE + "good"} if meta.get("loss_scale") is not None else set()
        stray = [k for k in saved if not k.startswith((_MODEL, _OPTIMISER)) and k not in expected_scale]
        if stray:
            self.fail("a training run", f"it holds arrays no part of a run names: {', '.join(stray[:8])}")
        named = set()
        for path, entry in meta["optimiser"].items():
            if isinstance(entry, dict):
                _array_keys(entry.get("state"), _OPTIMISER + path, named)
        extra = sorted(k for k in saved if k.startswith(_OPTIMISER) and k not in named)
        missing = sorted(k for k in named if k not in saved)
        if extra or missing:
            self.fail("its own record", f"optimiser arrays {'missing: ' + ', '.join(missing[:8]) if missing else ''}"
                      f"{'; ' if extra and missing else ''}{'not described: ' + ', '.join(extra[:8]) if extra else ''}")

    def optimiser(self, meta, saved, opt_state):
        """``[(leaf, rule, state, frozen, copies)]``: each leaf's restored values, checked against the state."""
        leaves, tied = _leaf_paths(opt_state)
        entries = meta["optimiser"]
        missing, extra = [p for p in leaves if p not in entries], [p for p in entries if p not in leaves]
        if missing or extra:
            self.fail("the optimiser state", "; ".join(part for part in (
                f"leaves missing from the file: {', '.join(missing[:8])}" if missing else "",
                f"leaves not in the state: {', '.join(extra[:8])}" if extra else "") if part))
        if tied != meta["tied"]:
            self.fail("the optimiser state", f"tied weights (one leaf at several paths) are {meta['tied']} in the "
                      f"file but {tied} in the state")
        out = []
        for path, leaf in leaves.items():
            entry = entries[path]
            where = _OPTIMISER + path
            if not isinstance(entry, dict) or not isinstance(entry.get("frozen"), bool):
                self.fail("its own record", f"{where} is malformed")
            rule = self.rule(entry.get("rule"), leaf.rule, where)
            copies = []
            value = self.value(entry.get("state"), leaf.state, saved, where, copies)
            out.append((leaf, rule, value, entry["frozen"], copies))
        return out

    def rule(self, data, rule, where):
        """The rule to restore: ``rule`` itself, or with the saved hyperparameters where they differ."""
        name = type(rule).__name__
        if not isinstance(data, dict) or data.get("type") != name:
            got = data.get("type") if isinstance(data, dict) else data
            self.fail("the optimiser state", f"{where} was saved with {got} but the state has {name}")
        if isinstance(rule, OptimiserChain):
            saved = data.get("rules")
            if not isinstance(saved, list) or len(saved) != len(rule.rules):
                self.fail("the optimiser state", f"{where} was saved with a chain of "
                          f"{len(saved) if isinstance(saved, list) else '?'} rules but the state has {rule!r}")
            rules = tuple(self.rule(d, r, f"{where} (rule {i + 1} of its chain)")
                          for i, (d, r) in enumerate(zip(saved, rule.rules)))
            return rule if all(a is b for a, b in zip(rules, rule.rules)) else OptimiserChain(*rules)
        fields = data.get("fields")
        if not isinstance(fields, dict):
            self.fail("its own record", f"{where}'s rule has no fields")
        changes = {}
        for field, value in fields.items():
            current = getattr(rule, field, None)
            restored = tuple(value) if isinstance(current, tuple) and isinstance(value, list) else value
            if current is None or _kind(restored) != _kind(current):
                self.fail("the optimiser state", f"{where}: {name}'s {field} is {value!r} in the file but "
                          f"{current!r} in the state")
            if restored != current:
                changes[field] = restored
        try:
            return dataclasses.replace(rule, **changes) if changes else rule
        except (TypeError, ValueError) as err:
            self.fail("the optimiser state", f"{where}: {err}")

    def value(self, desc, current, saved, key, copies):
        """``current`` with the saved values (arrays listed in ``copies`` to copy into its own), after checking
        that the saved state has its form: the same nesting, arrays of the same shape and dtype, numbers of the
        same Python type."""
        def differ(got):
            self.fail("the optimiser state", f"{key} holds {got} in the file but {_what(current)} in the state")

        if desc == "array" or desc == "scalar":
            array = saved[key]
            if desc == "scalar" and isinstance(current, np.generic) and array.shape == () and \
                    array.dtype == current.dtype:
                return array[()]
            if desc == "array" and is_array(current) and tuple(current.shape) == array.shape and \
                    current.dtype == array.dtype:
                copies.append((current, array))
                return current
            differ(_what(array) if desc == "array" else f"a NumPy {array.dtype} number")
        if desc is None:
            if current is not None:
                differ("nothing")
            return None
        if not isinstance(desc, dict) or len(desc) != 1:
            self.fail("its own record", f"{key} is malformed")
        (kind, content), = desc.items()
        if kind in ("bool", "int", "float"):
            if type(current).__name__ != kind or type(content).__name__ != kind:
                differ(f"a {kind} {content!r}")
            return content
        if kind in ("tuple", "list") and isinstance(content, list):
            if type(current).__name__ != kind or len(current) != len(content):
                differ(f"a {kind} of {len(content)}")
            made = [self.value(d, c, saved, f"{key}.{i}", copies) for i, (d, c) in enumerate(zip(content, current))]
            return tuple(made) if kind == "tuple" else made
        self.fail("its own record", f"{key} is malformed")

    def loss_scale(self, meta, saved, model):
        """``(scaler, state)`` to restore, or None when neither the file nor the model has a dynamic scale."""
        scaler, data = getattr(model, "loss_scaler", None), meta.get("loss_scale")
        if scaler is None and data is None:
            return None
        if scaler is None or data is None:
            has = "a dynamic loss scale" if data is not None else "no dynamic loss scale"
            model_has = "one" if scaler is not None else "none"
            self.fail("the model", f"the file has {has} but the model has {model_has} (a float16 MixedPrecision "
                      "has one)")
        scale, good = saved[_SCALE + "scale"], saved[_SCALE + "good"]
        skipped = data.get("skipped") if isinstance(data, dict) else None
        if scale.shape != () or scale.dtype != np.float32 or good.shape != () or good.dtype != np.int32 or \
                not isinstance(skipped, int) or not math.isfinite(float(scale)) or not float(scale) > 0:
            self.fail("the model", f"its loss scale is malformed ({_what(scale)} {scale!r:.40}, {_what(good)})")
        return scaler, {"scale": scale, "good": good, "skipped": skipped}


def _array_keys(desc, key, out):
    """The array keys a state description names."""
    if desc in ("array", "scalar"):
        out.add(key)
    elif isinstance(desc, dict) and len(desc) == 1:
        (kind, content), = desc.items()
        if kind in ("tuple", "list") and isinstance(content, list):
            for i, d in enumerate(content):
                _array_keys(d, f"{key}.{i}", out)


def _kind(v):
    """What a hyperparameter is, for comparing a saved one with the rule's: an int and a float are both numbers."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, numbers.Real):
        return "number"
    return "tuple" if isinstance(v, tuple) else type(v).__name__


def _what(x):
    if is_array(x):
        return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    if x is None:
        return "nothing"
    return f"a {type(x).__name__} {x!r:.40}"
