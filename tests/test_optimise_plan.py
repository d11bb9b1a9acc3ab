"""The optimiser package's surface: the public names, the one Plan that update, train and TrainStep share (train
and step import no private name of it), and the formulas' translation into C."""
import ast
import copy
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
