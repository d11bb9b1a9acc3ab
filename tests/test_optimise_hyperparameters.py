"""Every optimisation rule checks its hyperparameters by name when it is made and when ``adjust`` makes it again:
a bad value is a ValueError naming the rule, the field and the value, and a refused ``adjust`` changes nothing."""
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import optimise
from fluxpy.optimise import Adam, ClipGrad, Lion, OptimiserChain, adjust, setup, update

RULES = [optimise.Descent, optimise.Momentum, optimise.Nesterov, optimise.RMSProp, optimise.Adam, optimise.AdamW,
         optimise.WeightDecay, optimise.ClipGrad, optimise.ClipNorm, optimise.AdaGrad, optimise.AdaDelta,
         optimise.AdaMax, optimise.OAdam, optimise.NAdam, optimise.RAdam, optimise.AdaBelief, optimise.Lion,
         optimise.SignDecay, optimise.AccumGrad, optimise.AMSGrad, optimise.Rprop]

BAD = {   # field -> values every rule with that field refuses
    "eta": [-1e-3, math.nan, math.inf, True, "0.1", None],
    "rho": [-0.1, 1.5, math.nan],
    "eps": [-1e-8, math.nan, math.inf],
    "lambd": [-1e-4, math.nan],
    "beta": [(0.9,), (0.9, 0.999, 0.5), (-0.1, 0.9), (0.9, math.nan), [0.9, 0.999], 0.9],
    "delta": [0.0, -1.0, math.inf],
    "omega": [0.0, -1.0, math.nan],
    "p": [0, -2, math.nan, True],
    "centred": [1, "yes"],
    "throw": [0, None],
    "ell": [(0.5,), (0.0, 1.2), (0.5, 1.0), (1.2, 0.5), (0.5, math.inf), [0.5, 1.2]],
    "gamma": [(1e-6,), (-1e-6, 50.0), (1.0, 0.5), (1e-6, math.inf), (math.nan, 1.0), [1e-6, 50.0]],
}


def test_every_rule_is_made_with_its_defaults_and_every_field_is_checked():
    for rule in RULES:
        made = rule()
        names = {f.name for f in dataclasses.fields(made)}
        assert names <= set(BAD) | {"n"}, f"{rule.__name__} has an unchecked field: {names - set(BAD)}"


@given(data=st.data())
def test_a_bad_hyperparameter_is_refused_naming_the_rule_the_field_and_the_value(data):
    rule = data.draw(st.sampled_from([r for r in RULES if r is not optimise.AccumGrad]))
    field = data.draw(st.sampled_from([f.name for f in dataclasses.fields(rule())]))
    value = data.draw(st.sampled_from(BAD[field]))
    with pytest.raises(ValueError) as err:
        rule(**{field: value})
    assert str(err.value).startswith(f"{rule.__name__}: {field} must be ") and str(err.value).endswith(
        f", got {value!r}")


def test_the_limits_at_their_edges():
    Adam(0.0, (0.0, 0.0), 0.0)                      # all allowed
    with pytest.raises(ValueError, match=r"Adam: beta must be a tuple \(b1, b2\) of numbers in \[0, 1\), got"):
        Adam(beta=(1.0, 0.9))                       # 1 - b1^t would be 0
    Lion(beta=(1.0, 1.0))                           # Lion's betas may reach 1
    with pytest.raises(ValueError, match=r"Lion: beta must be a tuple \(b1, b2\) of numbers in \[0, 1\], got"):
        Lion(beta=(1.1, 0.9))
    optimise.ClipNorm(1.0, p=math.inf)              # the largest entry
    optimise.Momentum(0.1, 1.0)
    with pytest.raises(ValueError, match="AccumGrad must accumulate at least one gradient"):
        optimise.AccumGrad(0)


def test_a_refused_adjust_changes_nothing():
    model = {"a": np.ones(2), "b": np.ones(2)}
    state = setup(Lion(0.1), model)
    state["b"] = setup(OptimiserChain(ClipGrad(1.0), Adam(0.1)), model["b"])
    before = {k: leaf.rule for k, leaf in state.items()}
    with pytest.raises(ValueError, match=r"Adam: beta must be .* got \(1.0, 0.5\)"):
        adjust(state, beta=(1.0, 0.5))              # Lion takes it, Adam does not: neither changes
    assert {k: leaf.rule for k, leaf in state.items()} == before
    with pytest.raises(ValueError, match=r"adjust: no rule in the state tree has \['gamma'\]"):
        adjust(state, 0.01, gamma=2.0)
    assert {k: leaf.rule for k, leaf in state.items()} == before
    adjust(state, 0.01)
    assert state["a"].rule.eta == 0.01 and state["b"].rule.rules[1].eta == 0.01
    update(state, model, {"a": np.ones(2), "b": np.ones(2)})
    assert np.all(np.isfinite(model["a"])) and np.all(np.isfinite(model["b"]))


def test_train_schedule_refuses_a_negative_rate_before_any_step():
    model = fluxpy.Dense(2, 1, rng=0)
    w = model.weight.copy()
    with pytest.raises(ValueError, match=r"schedule\(1\) must be a finite number >= 0"):
        fluxpy.train(lambda m, x: (m(x) ** 2).sum(), model, [np.ones((3, 2), np.float32)],
                     setup(Adam(0.1), model), schedule=lambda t: -1.0, progress=False)
    np.testing.assert_array_equal(model.weight, w)
