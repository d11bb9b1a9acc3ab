"""TrainStep on the CPU: the eager step (withgradient, then update), whatever ``capture`` says; its argument
checks. The captured step is tested on the GPU (tests/gpu/test_trainstep_gpu.py)."""
import copy

import numpy as np
import pytest

import fluxpy
from fluxpy import Chain, Dense, TrainStep, logitcrossentropy, relu
from fluxpy.capturing import CaptureUnsupported, capturing, on_replay, recording, refuse
from fluxpy.optimise import Adam, Momentum, setup, update


def _net(seed):
    rng = np.random.default_rng(seed)
    return Chain(Dense(6, 8, relu, rng=rng), Dense(8, 3, rng=rng))


def _batches(n, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((5, 6)).astype(np.float32), fluxpy.onehotbatch(rng.integers(0, 3, 5), range(3)))
            for _ in range(n)]


@pytest.mark.parametrize("rule", [Adam(0.01), Momentum(0.05)])
@pytest.mark.parametrize("capture", [True, False])
def test_the_cpu_step_is_withgradient_then_update(rule, capture):
    model = _net(0)
    twin = copy.deepcopy(model)
    step = TrainStep(lambda m, x, y: logitcrossentropy(m(x), y), model, setup(rule, model), capture=capture)
    state = setup(rule, twin)
    for x, y in _batches(6):
        got = step(x, y)
        want, (g,) = fluxpy.withgradient(lambda m: logitcrossentropy(m(x), y), twin)
        update(state, twin, g)
        assert float(got) == float(want)
    for a, b in zip(fluxpy.trainables(model), fluxpy.trainables(twin)):
        np.testing.assert_array_equal(a, b)
    assert step.captured() == {}   # nothing is captured on the CPU


def test_arguments_are_checked():
    model = _net(0)
    with pytest.raises(TypeError, match="TrainStep expects loss to be a function"):
        TrainStep("mse", model, setup(Adam(), model))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="TrainStep expects warmup to be an int >= 1"):
            TrainStep(lambda m, x: m(x).sum(), model, setup(Adam(), model), warmup=bad)


def test_capturing_hooks_and_refusals_act_only_inside_a_capture():
    ran = []
    on_replay(lambda: ran.append(1))   # outside: ignored
    refuse("nothing")                  # outside: no error
    assert not capturing() and ran == []
    with recording() as hooks:
        assert capturing()
        on_replay(lambda: ran.append(2))
        with pytest.raises(CaptureUnsupported, match="dropout"):
            refuse("dropout: host-side generator")
    assert not capturing()
    for hook in hooks:
        hook()
    assert ran == [2]


def test_dropout_and_a_lone_adam_refuse_to_be_captured():
    x = np.ones((2, 3))
    with recording():
        with pytest.raises(CaptureUnsupported, match="dropout"):
            fluxpy.dropout(x, 0.5)
        w = np.ones(3)
        with pytest.raises(CaptureUnsupported, match="Adam"):
            update(setup(Adam(), w), w, np.ones(3))


def test_a_changed_rule_or_frozen_flag_means_the_graph_is_stale():
    from fluxpy.optimise import adjust, freeze, thaw
    from fluxpy.step import _Signature
    model = _net(0)
    state = setup(Adam(0.01), model)
    entry = _Signature()
    entry.config = [(leaf, leaf.rule, leaf.frozen) for leaf in fluxpy.optimise._leaves(state)]
    assert not entry.config_changed()
    adjust(state, 0.001)                      # a new rule object on every leaf: the graph's eta is stale
    assert entry.config_changed()
    entry.config = [(leaf, leaf.rule, leaf.frozen) for leaf in fluxpy.optimise._leaves(state)]
    freeze(state)
    assert entry.config_changed()
    thaw(state)
    assert not entry.config_changed()


def test_a_checked_capture_takes_only_updates_that_can_skip_themselves_on_the_device():
    from fluxpy.capturing import guarding
    from fluxpy.optimise import Descent, Momentum, OptimiserChain, WeightDecay
    for rule in (Descent(0.1), Momentum(0.1), OptimiserChain(WeightDecay(0.1), Adam(0.1))):
        w = np.ones(3)
        state = setup(rule, w)
        with recording(), guarding(0.0):
            with pytest.raises(CaptureUnsupported, match="cannot skip itself on the device"):
                update(state, w, np.ones(3))   # NumPy has no guarded kernel: refused before any change
        np.testing.assert_array_equal(w, np.ones(3))
