"""train(..., schedule=...): the learning rate set per epoch or per step through adjust (Optimisers.jl's adjust!)."""
import math

import numpy as np
import pytest

import fluxpy
from fluxpy import train
from fluxpy.optimise import Adam, ClipGrad, Descent, OptimiserChain, WeightDecay, setup
from fluxpy.schedules import Constant, Cosine, Exp, Step


def run(schedule, per, epochs=3, batches=4, rule=None, **kw):
    """Descent on w with gradient -1 per step, so each step adds the rate in force: returns the rates used, in
    order (read back from w before each step), and the state."""
    model = {"w": np.zeros(1)}
    seen = []

    def loss(m, x):
        seen.append(float(fluxpy.value_of(m["w"])[0]))
        return (m["w"] * x).sum()
    state = setup(rule or Descent(123.0), model)
    train(loss, model, [(np.array([-1.0]),)] * batches, state, epochs, progress=False, schedule=schedule,
          schedule_per=per, **kw)
    seen.append(float(model["w"][0]))
    return list(np.diff(seen)), state


def test_per_epoch():
    s = Step(0.1, 0.5, 1)
    rates, state = run(s, "epoch")
    np.testing.assert_allclose(rates, [0.1] * 4 + [0.05] * 4 + [0.025] * 4, rtol=1e-12)
    assert state["w"].rule.eta == s(3)       # the state keeps the last rate


def test_per_step_counts_every_batch_of_every_epoch():
    s = Cosine(0.4, 0.0, 6, warmup=3)
    rates, _ = run(s, "step", epochs=3, batches=3)
    np.testing.assert_allclose(rates, [s(t) for t in range(1, 10)], rtol=1e-12, atol=1e-15)
    assert math.isclose(rates[3], 0.4) and math.isclose(rates[0], 0.1)


def test_default_is_per_epoch_and_any_function_is_a_schedule():
    rates, _ = run(lambda t: 0.01 * t, "epoch", epochs=2, batches=2)
    np.testing.assert_allclose(rates, [0.01, 0.01, 0.02, 0.02], rtol=1e-12)
    model = {"w": np.zeros(1)}
    state = setup(Descent(1.0), model)
    train(lambda m, x: (m["w"] * x).sum(), model, [(np.array([-1.0]),)] * 2, state, 2, progress=False,
          schedule=Exp(1.0, 0.5))
    assert model["w"][0] == 1.0 + 1.0 + 0.5 + 0.5


def test_a_loop_over_epochs_offsets_t():
    s = Step(1.0, 0.1, 1)
    model = {"w": np.zeros(1)}
    state = setup(Descent(5.0), model)
    for done in range(3):
        train(lambda m, x: (m["w"] * x).sum(), model, [(np.array([-1.0]),)], state, progress=False,
              schedule=lambda t, done=done: s(t + done))
    assert math.isclose(model["w"][0], 1.0 + 0.1 + 0.01)


def test_other_hyperparameters_and_chains_are_kept():
    rates, state = run(Constant(0.5), "step", epochs=1, batches=2,
                       rule=OptimiserChain(ClipGrad(10.0), WeightDecay(0.0), Descent(9.0)))
    np.testing.assert_allclose(rates, [0.5, 0.5])
    chain = state["w"].rule
    assert chain.rules[0].delta == 10.0 and chain.rules[2].eta == 0.5


def test_adam_moments_survive_the_schedule():
    model = {"w": np.ones(3)}
    state = setup(Adam(0.1), model)
    train(lambda m, x: (m["w"] ** 2).sum(), model, [(np.ones(1),)] * 3, state, 2, progress=False,
          schedule=Exp(0.1, 0.5))
    assert state["w"].rule.eta == 0.05 and np.any(state["w"].state[0] != 0)


def test_an_unchanged_rate_keeps_the_rule_object():
    """A captured step recaptures when a rule changes: a constant schedule must not change it."""
    model = {"w": np.zeros(1)}
    state = setup(Descent(0.5), model)
    seen = []

    def loss(m, x):
        seen.append(state["w"].rule)
        return (m["w"] * x).sum()
    train(loss, model, [(np.array([1.0]),)] * 3, state, 2, progress=False, schedule=Constant(0.25),
          schedule_per="step")
    assert len({id(r) for r in seen}) == 1 and seen[0].eta == 0.25


def test_capture_on_the_cpu_with_a_schedule():
    rates, _ = run(Step(0.1, 0.5, 1), "epoch", epochs=2, batches=2, capture=True)
    np.testing.assert_allclose(rates, [0.1, 0.1, 0.05, 0.05], rtol=1e-12)


@pytest.mark.parametrize("schedule,per,error,match,w_after", [
    (0.1, "epoch", TypeError, r"train: schedule must be a function of t = 1, 2, \.\.\. giving the learning rate", 0),
    (Constant(0.1), "batch", ValueError, r"train: schedule_per must be \"epoch\" or \"step\", got 'batch'", 0),
    (lambda t: -0.1, "epoch", ValueError, r"train: schedule\(1\) must be a finite number >= 0 \(the learning rate\)",
     0),
    (lambda t: float("nan"), "step", ValueError, r"train: schedule\(1\) must be a finite number >= 0", 0),
    (lambda t: "0.1", "step", ValueError, r"train: schedule\(1\) must be a finite number >= 0", 0),
    (lambda t: 0.1 if t < 2 else None, "step", ValueError, r"train: schedule\(2\) must be a finite number >= 0", 0.1),
])
def test_errors(schedule, per, error, match, w_after):
    model = {"w": np.zeros(1)}
    state = setup(Descent(1.0), model)
    with pytest.raises(error, match=match):
        train(lambda m, x: (m["w"] * x).sum(), model, [(np.array([-1.0]),)] * 2, state, progress=False,
              schedule=schedule, schedule_per=per)
    assert model["w"][0] == w_after   # failed before any update, or (t=2) after the first step only


def test_a_state_without_a_learning_rate_fails_before_training():
    model = {"w": np.zeros(1)}
    state = setup(ClipGrad(1.0), model)
    with pytest.raises(ValueError, match=r"adjust: no rule in the state tree has \['eta'\]"):
        train(lambda m, x: (m["w"] * x).sum(), model, [(np.array([-1.0]),)], state, progress=False,
              schedule=Constant(0.1))
    assert model["w"][0] == 0.0
