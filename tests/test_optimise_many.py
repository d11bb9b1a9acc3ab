"""update's multi-tensor steps: one ``optimiser_step_many`` call per group of leaves whose rules declare the same
formula, hyperparameters and counters (Adam, AdamW, Descent, Momentum, chains: any rule), on the CPU.

NumPy stand-ins for the CUDA kernels (each rule's formula on arrays, the counters read from and advanced in the
"device" array) are put in the kernel table for a test and taken out after it (``kernels.snapshot`` / ``restore``). Every test runs
the same steps twice, on deep copies of the model and the state: once through the groups, once leaf by leaf (no
multi-tensor kernel registered), and asks for the same arrays and states, bit for bit.
"""
import contextlib
import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluxpy import kernels
from fluxpy.optimise.formula import advance, evaluate
from fluxpy.optimise import (AccumGrad, Adam, AdamW, ClipGrad, ClipNorm, Descent, Leaf, Momentum, Nesterov,
                             OptimiserChain, RAdam, RMSProp, WeightDecay, adjust, freeze, setup, thaw, update)

seeds = st.integers(0, 2**31 - 1)


MANY = ("optimiser_step_many", "optimiser_advance")


def numpy_step_many(calls):
    """optimiser_step_many for NumPy arrays: the rule's formula on each parameter in turn (its NumPy path, the
    counters read from the "device" array), recording ``(len(xs), eta)`` (``eta`` None where the formula has no
    field of that name: a chain's are prefixed)."""
    def optimiser_step_many(x, formula, xs, dxs, states, inputs, hyper, counters, ok=None, memo=None):
        assert ok is None and isinstance(memo, dict)
        calls.append((len(xs), hyper.get("eta")))
        now = () if counters is None else tuple(float(c) for c in counters)
        for x, dx, s, i in zip(xs, dxs, states, inputs):
            step = evaluate(formula, hyper, s, now, x, dx, dict(zip(formula.inputs, i)))
            if step is not None:
                x -= step
    return optimiser_step_many


def numpy_advance(counters, formula, hyper, ok=None):
    counters[...] = advance(formula, hyper, tuple(float(c) for c in counters))


def numpy_arrays(x, formula, xs, dxs, states, inputs, memo):
    return all(isinstance(a, np.ndarray) for a in xs) and all(isinstance(a, np.ndarray) for s in states for a in s)


@contextlib.contextmanager
def many_kernel(supports=numpy_arrays):
    """Registers the NumPy multi-tensor kernels for the block; yields the list of their calls."""
    before = kernels.snapshot()
    calls = []
    kernels.register("optimiser_step_many", "numpy", numpy_step_many(calls), supports)
    kernels.register("optimiser_advance", "numpy", numpy_advance)
    try:
        yield calls
    finally:
        kernels.restore(before)


def arrays_and_states(state, model):
    """Every array of the model and of the state tree, and every leaf's state as plain values, in a fixed order."""
    out = []

    def walk(node):
        if isinstance(node, np.ndarray):
            out.append(("array", node.dtype, node.shape, node.tobytes()))
        elif isinstance(node, Leaf):
            out.append(("leaf", type(node.rule).__name__, node.frozen))
            walk(node.state)
        elif isinstance(node, dict):
            for k in sorted(node, key=str):
                walk(node[k])
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)
        else:
            out.append((type(node), node))
    walk((state, model))
    return out


def assert_same(a, b):
    sa, sb = arrays_and_states(*a), arrays_and_states(*b)
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert x == y


class Twin:
    """The same model and state twice: ``grouped`` steps with the NumPy multi-tensor kernels, ``alone`` leaf by
    leaf."""

    def __init__(self, state, model, alone=None):
        self.alone = copy.deepcopy((state, model)) if alone is None else alone   # a deep copy un-aliases views
        self.grouped = (state, model)

    def both(self, f):
        """Runs ``f(state, model)`` on both copies (e.g. adjust, freeze)."""
        f(*self.grouped)
        f(*self.alone)

    def step(self, grad, calls, **kw):
        """One update of each; returns the calls the grouped update made to the multi-tensor kernels."""
        before = len(calls)
        update(*self.grouped, grad, **kw)
        made = calls[before:]
        saved = kernels.snapshot()
        kernels.restore({k: v for k, v in saved.items() if k[0] not in MANY})
        try:
            update(*self.alone, copy.deepcopy(grad), **kw)
        finally:
            kernels.restore(saved)
        assert_same(self.grouped, self.alone)
        return made


def grad_like(model, rng):
    if isinstance(model, dict):
        return {k: grad_like(v, rng) for k, v in model.items()}
    if isinstance(model, list):
        return [grad_like(v, rng) for v in model]
    return rng.standard_normal(model.shape).astype(model.dtype)


def odd_model(rng, dtype=np.float64):
    shapes = {"w1": (3, 5), "b1": (5,), "w2": (7, 1, 3), "s": (), "empty": (0, 4), "one": (1,), "long": (1001,)}
    return {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}


def test_one_call_per_step_and_the_same_results():
    rng = np.random.default_rng(0)
    model = odd_model(rng)
    twin = Twin(setup(Adam(0.01, (0.8, 0.95), 1e-7), model), model)
    with many_kernel() as calls:
        for _ in range(5):
            assert twin.step(grad_like(model, rng), calls) == [(7, 0.01)]
    assert twin.grouped[0]["w1"].state[2] == pytest.approx((0.8 ** 6, 0.95 ** 6))


def test_float32_and_float64_parameters_make_two_groups():
    rng = np.random.default_rng(1)
    model = {"a": odd_model(rng, np.float32), "b": odd_model(rng, np.float64)}
    twin = Twin(setup(Adam(0.05), model), model)
    with many_kernel() as calls:
        for _ in range(3):
            assert twin.step(grad_like(model, rng), calls) == [(7, 0.05), (7, 0.05)]
    assert model["a"]["w1"].dtype == np.float32


def test_frozen_leaves_are_left_out_and_thawed_ones_make_their_own_group():
    rng = np.random.default_rng(2)
    model = {"enc": odd_model(rng), "dec": odd_model(rng)}
    twin = Twin(setup(Adam(0.01), model), model)
    twin.both(lambda s, m: freeze(s["enc"]))
    frozen = copy.deepcopy(model["enc"])
    with many_kernel() as calls:
        for _ in range(2):
            assert twin.step(grad_like(model, rng), calls) == [(7, 0.01)]
        for k, v in frozen.items():
            np.testing.assert_array_equal(model["enc"][k], v)
        twin.both(lambda s, m: thaw(s))
        for _ in range(2):   # the thawed leaves are two steps behind in bias correction: a group of their own
            assert sorted(twin.step(grad_like(model, rng), calls)) == [(7, 0.01), (7, 0.01)]
        twin.both(lambda s, m: freeze(s["dec"]["w1"]))
        assert sorted(twin.step(grad_like(model, rng), calls)) == [(6, 0.01), (7, 0.01)]


def test_mixed_rules_and_adjust():
    rng = np.random.default_rng(3)
    model = {"a": odd_model(rng), "b": odd_model(rng), "m": [rng.standard_normal(4)],
             "w": [rng.standard_normal(3)], "c": [rng.standard_normal((2, 2))]}
    state = {"a": setup(Adam(0.01), model["a"]), "b": setup(Adam(0.01), model["b"]),
             "m": setup(Momentum(0.1), model["m"]), "w": setup(AdamW(0.01, lambd=0.1), model["w"]),
             "c": setup(OptimiserChain(ClipGrad(0.5), Adam(0.01)), model["c"])}
    twin = Twin(state, model)
    with many_kernel() as calls:
        others = [(1, 0.1), (1, 0.01), (1, None)]   # Momentum, AdamW, the chain: a group each
        assert twin.step(grad_like(model, rng), calls) == [(14, 0.01)] + others
        twin.both(lambda s, m: adjust(s["b"], 0.003))
        for _ in range(2):
            assert twin.step(grad_like(model, rng), calls) == [(7, 0.01), (7, 0.003)] + others
        twin.both(lambda s, m: adjust(s, 0.002))
        assert twin.step(grad_like(model, rng), calls) == [(14, 0.002), (1, 0.002), (1, 0.002), (1, None)]
        twin.both(lambda s, m: adjust(s["a"], beta=(0.5, 0.9)))
        assert twin.step(grad_like(model, rng), calls) == [(7, 0.002), (7, 0.002), (1, 0.002), (1, 0.002),
                                                           (1, None)]


def test_equal_hyperparameters_of_other_types_make_other_groups():
    rng = np.random.default_rng(12)
    model = {"a": odd_model(rng), "b": odd_model(rng)}
    twin = Twin(setup(Adam(0.01), model), model)
    twin.both(lambda s, m: adjust(s["b"], beta=(np.float64(0.9), np.float64(0.999))))   # equal values, NumPy floats
    with many_kernel() as calls:
        for _ in range(2):   # "b"'s next (b1t, b2t) are NumPy floats, "a"'s Python floats, as leaf by leaf
            assert twin.step(grad_like(model, rng), calls) == [(7, 0.01), (7, 0.01)]
    assert type(twin.grouped[0]["b"]["w1"].state[2][0]) is np.float64
    assert type(twin.grouped[0]["a"]["w1"].state[2][0]) is float


def test_tied_weights_step_once():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((3, 2))
    model = {"enc": w, "dec": w, "b": rng.standard_normal(2)}
    state = setup(Adam(0.1), model)
    assert state["enc"] is state["dec"]
    twin = Twin(state, model)
    with many_kernel() as calls:
        for _ in range(3):
            g = rng.standard_normal((3, 2))
            assert twin.step({"enc": g, "dec": g, "b": rng.standard_normal(2)}, calls) == [(2, 0.1)]


def test_parameters_sharing_memory_step_alone():
    def make():
        rng = np.random.default_rng(5)
        buf = rng.standard_normal(10)
        model = {"a": buf[:6], "b": buf[4:], "whole": buf, "own": rng.standard_normal(3),
                 "own2": rng.standard_normal(2), "row": rng.standard_normal((2, 3))[1]}
        return setup(Adam(0.1), model), model
    twin = Twin(*make(), alone=make())
    rng = np.random.default_rng(55)
    with many_kernel() as calls:
        for _ in range(3):   # a, b and whole overlap: each steps alone (a launch of its own), in the plan's order
            assert twin.step(grad_like(twin.grouped[1], rng), calls) == [(1, 0.1)] * 3 + [(3, 0.1)]
    assert np.shares_memory(twin.grouped[1]["a"], twin.grouped[1]["whole"])


def test_a_declined_call_steps_leaf_by_leaf_and_keeps_the_grouping():
    rng = np.random.default_rng(6)
    model = odd_model(rng)
    twin = Twin(setup(Adam(0.01), model), model)
    with many_kernel(supports=lambda *args: False) as calls:
        twin.step(grad_like(model, rng), calls)
        steps = next(iter(twin.grouped[0].values()))._steps
        for _ in range(3):
            assert twin.step(grad_like(model, rng), calls) == []
        assert next(iter(twin.grouped[0].values()))._steps is steps
    with many_kernel() as calls:   # and the groups' bias correction followed the leaf-by-leaf steps
        assert twin.step(grad_like(model, rng), calls) == [(7, 0.01)]


def test_the_grouping_is_kept_between_steps_and_made_again_after_a_change():
    rng = np.random.default_rng(7)
    model = odd_model(rng)
    state = setup(Adam(0.01), model)
    twin = Twin(state, model)
    first = state["w1"]   # the plan's first leaf holds the cache

    def cached():
        return first._steps

    with many_kernel() as calls:
        twin.step(grad_like(model, rng), calls)
        kept = cached()
        assert kept is not None
        twin.step(grad_like(model, rng), calls)
        assert cached() is kept
        changes = [
            lambda s, m: adjust(s, 0.02),
            lambda s, m: freeze(s["b1"]),
            lambda s, m: thaw(s),
            lambda s, m: m.__setitem__("long", m["long"].copy()),   # a new array at a path
            lambda s, m: setattr(s["one"], "state", copy.deepcopy(s["one"].state)),   # a state put in by hand
        ]
        for change in changes:
            twin.both(change)
            twin.step(grad_like(model, rng), calls)
            assert cached() is not kept
            kept = cached()
            twin.step(grad_like(model, rng), calls)
            assert cached() is kept


def test_a_state_put_in_by_hand_is_the_one_stepped():
    rng = np.random.default_rng(8)
    model = odd_model(rng)
    state = setup(Adam(0.01), model)
    with many_kernel() as calls:
        update(state, model, grad_like(model, rng))
        old_m = state["w1"].state[0]
        new = copy.deepcopy(state["w1"].state)
        state["w1"].state = new
        before = old_m.copy()
        update(state, model, grad_like(model, rng))
        np.testing.assert_array_equal(old_m, before)   # the replaced moments are no longer touched
        assert state["w1"].state[0] is new[0]
        assert len(calls) == 2


def test_a_zero_dim_parameter_with_a_numpy_scalar_gradient():
    model = {"t": np.array(1.0), "u": np.ones(2)}
    twin = Twin(setup(Adam(0.5), model), model)
    with many_kernel() as calls:
        for _ in range(2):
            assert twin.step({"t": np.float64(2.0), "u": np.array([1.0, -3.0])}, calls) == [(2, 0.5)]


@pytest.mark.parametrize("rule, made", [
    (AdamW(0.01, lambd=0.1), [(7, 0.01)]), (Momentum(0.01), [(7, 0.01)]), (Descent(0.05), [(7, 0.05)]),
    (OptimiserChain(ClipGrad(1.0), Adam(0.01)), [(7, None)]), (Nesterov(0.01), [(7, 0.01)]),
    (RAdam(0.1), [(7, 0.1)]), (OptimiserChain(ClipNorm(1.0), WeightDecay(0.1), Adam(0.01)), [(7, None)]),
    (OptimiserChain(AccumGrad(2), RMSProp(0.01, centred=True)), [(7, None)])])
def test_every_rule_with_a_formula_is_grouped_chains_too(rule, made):
    rng = np.random.default_rng(9)
    model = odd_model(rng)
    twin = Twin(setup(rule, model), model)
    with many_kernel() as calls:
        for _ in range(3):
            assert twin.step(grad_like(model, rng), calls) == made


def test_check_finite_refuses_before_any_group_steps():
    rng = np.random.default_rng(10)
    model = odd_model(rng)
    state = setup(Adam(0.01), model)
    before = copy.deepcopy((state, model))
    grad = grad_like(model, rng)
    grad["long"][3] = np.nan
    with many_kernel() as calls, pytest.raises(FloatingPointError):
        update(state, model, grad, check_finite=True)
    assert calls == []
    assert_same((state, model), before)


def test_copies_and_pickles_leave_the_cache_behind():
    rng = np.random.default_rng(11)
    model = odd_model(rng)
    state = setup(Adam(0.01), model)
    with many_kernel() as calls:
        update(state, model, grad_like(model, rng))
        assert state["w1"]._steps is not None
        for s2, m2 in (copy.deepcopy((state, model)), pickle.loads(pickle.dumps((state, model)))):
            assert s2["w1"]._steps is None and s2["w1"]._fits is None
            assert s2["w1"].rule == state["w1"].rule and not s2["w1"].frozen
            np.testing.assert_array_equal(s2["w1"].state[0], state["w1"].state[0])
            twin = Twin(s2, m2)
            assert twin.step(grad_like(m2, rng), calls) == [(7, 0.01)]
    assert "long" not in str(pickle.dumps(state["s"]))   # the model's other arrays are not pickled with a leaf


@given(data=st.data(), seed=seeds)
@settings(max_examples=30)
def test_groups_match_leaf_by_leaf_steps(data, seed):
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(1, 8))
    shapes = data.draw(st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), min_size=n, max_size=n))
    dtypes = data.draw(st.lists(st.sampled_from([np.float32, np.float64]), min_size=n, max_size=n))
    rule = data.draw(st.sampled_from([Adam(0.01), AdamW(0.01, lambd=0.2), Momentum(0.02, 0.8), Descent(0.1)]))
    model = [rng.standard_normal(s).astype(d) for s, d in zip(shapes, dtypes)]
    twin = Twin(setup(rule, model), model)
    with many_kernel() as calls:
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, n - 1))
            action = data.draw(st.sampled_from(["step", "freeze", "thaw", "adjust"]))
            if action == "freeze":
                twin.both(lambda s, m: freeze(s[i]))
            elif action == "thaw":
                twin.both(lambda s, m: thaw(s[i]))
            elif action == "adjust":
                eta = data.draw(st.sampled_from([0.01, 0.1]))
                twin.both(lambda s, m: adjust(s[i], eta))
            made = twin.step(grad_like(model, rng), calls)
            state = twin.grouped[0]
            adam = isinstance(rule, (Adam, AdamW))
            live = [(leaf.rule, leaf.state[2] if adam else None, x.dtype) for leaf, x in zip(state, model)
                    if not leaf.frozen]
            assert len(made) == len(set(live))
            assert sum(c[-2] for c in made) == len(live)
