"""The optimiser package's surface: the public names, the one Plan that update, train and TrainStep share (train
and step import no private name of it), and the formulas' translation into C."""
import ast
import copy
import importlib
import inspect
from pathlib import Path

import numpy as np
import pytest

from fluxpy import optimise as O
from fluxpy.kernels import cuda_optimise as K
from fluxpy.optimise.formula import Formula, advance, chain, evaluate, parse
from fluxpy.optimise.rules import formula_of

ROOT = Path(__file__).resolve().parent.parent


def test_the_public_names_are_the_rules_the_tree_and_plan():
    assert set(O.__all__) == {"Rule", "Descent", "Momentum", "Nesterov", "RMSProp", "Adam", "AdamW", "WeightDecay",
                              "ClipGrad", "ClipNorm", "OptimiserChain", "AdaGrad", "AdaDelta", "AdaMax", "NAdam",
                              "RAdam", "OAdam", "AdaBelief", "Lion", "SignDecay", "AccumGrad", "AMSGrad", "Rprop",
                              "Leaf", "setup", "update", "adjust", "freeze", "thaw", "Plan", "clip_grad_norm"}
    for name in O.__all__:
        assert getattr(O, name).__doc__, name


@pytest.mark.parametrize("module", ["train.py", "step.py"])
def test_train_and_step_import_no_private_name_of_optimise(module):
    tree = ast.parse((ROOT / "fluxpy" / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and "optimise" in node.module:
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{module} imports {private} from {node.module}"


def test_a_plan_checks_before_anything_changes_and_steps():
    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(2), "frozen": rng.standard_normal(4)}
    state = O.setup(O.OptimiserChain(O.ClipNorm(1.0), O.Adam(0.1)), model)
    O.freeze(state["frozen"])
    grad = {k: rng.standard_normal(v.shape) for k, v in model.items()}
    plan = O.Plan(state, model, grad, "train")
    assert [O.Plan.path(p) for _, _, _, p in plan] == ["model.w", "model.b", "model.frozen"]
    assert len(plan.gradients()) == 2 and len(plan.gradients(False)) == 2   # ClipNorm refuses non-finite ones
    assert O.Plan.is_finite(O.Plan.finite_total(plan.gradients()))
    grad = copy.deepcopy(grad)   # the plan holds the gradients it was made with
    grad["b"][1] = np.nan
    before = copy.deepcopy((state, model))
    bad = O.Plan(state, model, grad, "train")
    assert [O.Plan.path(p) for _, _, _, p in bad.nonfinite()] == ["model.b"]
    assert "1 NaN entries (of 2, shape (2,), dtype float64)" == O.Plan.count_nonfinite(grad["b"])
    with pytest.raises(ValueError, match=r"train: ClipNorm: the gradient has 2-norm nan.*at model.b"):
        bad.check()
    plain = O.setup(O.Descent(), model)
    with pytest.raises(FloatingPointError, match="the gradient for model.b has 1 NaN"):
        O.Plan(plain, model, grad, "train").check(check_finite=True)
    O.Plan(plain, model, grad, "train").check()   # Descent refuses nothing of its own
    for a, b in zip(model.values(), before[1].values()):
        np.testing.assert_array_equal(a, b)
    plan.apply()
    assert not np.array_equal(model["w"], before[1]["w"])
    np.testing.assert_array_equal(model["frozen"], before[1]["frozen"])
    assert {id(leaf) for leaf in O.Plan.leaves(state)} == {id(state[k]) for k in model}


def test_a_plan_without_a_gradient_checks_the_state_against_the_model():
    model = {"w": np.ones(3)}
    state = O.setup(O.Momentum(), model)
    assert len(O.Plan(state, model)) == 1
    with pytest.raises(ValueError, match="the optimiser state at model.w holds"):
        O.Plan(state, {"w": np.ones(4)})


def test_formulas_compose_and_count_only_where_an_earlier_rule_fires():
    f = chain([formula_of(O.AccumGrad(2)), formula_of(O.Adam())])
    assert f.counter_names == ("r0_count", "r1_b1t", "r1_b2t")
    hyper = O.OptimiserChain(O.AccumGrad(2), O.Adam()).hyper()
    assert advance(f, hyper, (1, 0.9, 0.999)) == (2, 0.9, 0.999)      # held back: Adam's beta^t stays
    assert advance(f, hyper, (2, 0.9, 0.999)) == (1, 0.9 * 0.9, 0.999 * 0.999)


def test_a_formula_on_arrays_updates_its_state_in_place_and_leaves_dx():
    f = parse(state=("v",), scalars="c = 1 - rho", body="v = v * rho + c * dx\nstep = eta * v")
    v, dx = np.ones(3, np.float32), np.full(3, 2.0, np.float32)
    step = evaluate(f, {"eta": 0.5, "rho": 0.5}, [v], (), np.zeros(3, np.float32), dx)
    np.testing.assert_array_equal(v, [1.5, 1.5, 1.5])
    np.testing.assert_array_equal(step, [0.75, 0.75, 0.75])
    assert step.dtype == np.float32 and (dx == 2).all()


def test_the_c_of_a_formula_rounds_numbers_to_the_arrays_type_once():
    f = formula_of(O.RAdam())
    code = K.c_code(f, tuple(O.RAdam().hyper()))
    assert "const double rho = (rho_inf - (((((double)2) * t) * b2t) / (((double)1) - b2t)));" in code.prologue
    assert "((T)lr)" in code.body and "x = (x - step);" in code.body
    assert "fx_c[2] = fx_next2;" in code.advance
    with pytest.raises(ValueError, match="cannot say"):
        K.c_code(Formula(body=(("step", "dx ** 2"),)), ())


def test_no_rule_is_known_by_its_type_in_the_machinery():
    from fluxpy.optimise import multi, update
    for module in (multi, update):
        source = inspect.getsource(module)
        assert "type(rule)" not in source and "isinstance(rule, Adam" not in source


def _random_tree(rng, depth, shared):
    """A model tree of layers with declared fields, plain objects, dicts, lists and tuples; some arrays tied (the
    same array twice), some integer arrays, numbers and functions among the leaves."""
    from fluxpy.functors import layer

    @layer(children=("w", "inner", "act"), trainable=("w", "inner"))
    class Declared:
        pass

    class Plain:
        pass
    roll = rng.integers(0, 8) if depth else 7
    if roll == 7:
        pick = rng.integers(0, 5)
        if pick == 0 and shared:
            return shared[rng.integers(0, len(shared))]
        if pick == 1:
            return np.arange(3)
        if pick == 2:
            return 0.5 if rng.integers(0, 2) else abs
        a = rng.standard_normal(tuple(rng.integers(1, 4, size=rng.integers(1, 3))))
        shared.append(a)
        return a
    kids = [_random_tree(rng, depth - 1, shared) for _ in range(rng.integers(1, 4))]
    if roll in (0, 1):
        node = Declared()
        node.w, node.inner, node.act = kids[0], kids[-1], abs
        return node
    if roll == 2:
        node = Plain()
        for i, k in enumerate(kids):
            setattr(node, f"f{i}", k)
        return node
    if roll in (3, 4):
        return {f"k{i}": k for i, k in enumerate(kids)}
    return kids if roll == 5 else tuple(kids)


def _grad_like(rng, model):
    """A gradient tree of ``model``'s shape (fluxpy.gradient's), some subtrees None."""
    from fluxpy.functors import fmapstructure
    grad = fmapstructure(lambda a: a * 2.0 if isinstance(a, np.ndarray) and a.dtype.kind == "f" else None, model)

    def holes(g):
        if isinstance(g, dict):
            return {k: None if rng.random() < 0.15 else holes(v) for k, v in g.items()}
        if isinstance(g, (list, tuple)):
            return type(g)(None if rng.random() < 0.15 else holes(v) for v in g)
        return g
    return holes(grad)


def _corrupt(rng, tree):
    """``tree`` (a state or gradient tree) with one node changed: a key added or removed, a list shortened, a dict
    turned into a list, a leaf replaced; or unchanged."""
    nodes = []

    def collect(t):
        if isinstance(t, (dict, list)):
            nodes.append(t)
            for v in (t.values() if isinstance(t, dict) else t):
                collect(v)
    collect(tree)
    if not nodes:
        return tree
    node = nodes[rng.integers(0, len(nodes))]
    how = rng.integers(0, 4)
    if isinstance(node, dict):
        if how == 0:
            node["extra"] = None
        elif how == 1 and node:
            node.pop(next(iter(node)))
        elif how == 2 and node:
            node[next(iter(node))] = [1, 2]
    elif how == 0 and node:
        node.pop()
    elif how == 1 and node:
        node[0] = {"x": None}
    return tree


def _outcome(state, model, grad, fast, monkeypatch):
    U = importlib.import_module("fluxpy.optimise.update")
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(U, "_walk_common", lambda *args: False)
        try:
            return [(id(leaf), id(x), None if dx is None else id(dx), path)
                    for leaf, x, dx, path in U._plan(state, model, grad, "update")]
        except (ValueError, TypeError) as err:
            return type(err), str(err)


def test_the_walk_of_usual_nodes_plans_and_refuses_as_the_full_walk(monkeypatch):
    """update's walk decides the usual nodes by quick comparisons: on random trees (layers, objects, dicts, lists,
    tuples, tied and integer arrays, holes in the gradient) and random corruptions of the state or the gradient,
    it makes the same plan, or raises the same error, as the walk that checks every node in full."""
    rng = np.random.default_rng(38)
    checked = refused = 0
    for _ in range(300):
        model = _random_tree(rng, 3, [])
        state = O.setup(O.Adam(), model)
        grad = _grad_like(rng, model)
        if rng.random() < 0.5:
            if rng.random() < 0.5:
                state = _corrupt(rng, copy.copy(state) if not isinstance(state, O.Leaf) else state)
            else:
                grad = _corrupt(rng, grad)
        for g in (grad, importlib.import_module("fluxpy.optimise.update")._ALL):
            fast = _outcome(state, model, g, True, monkeypatch)
            assert fast == _outcome(state, model, g, False, monkeypatch)
            checked += 1
            refused += type(fast) is tuple
    assert refused > 10 and checked - refused > 100
