"""save_training / load_training in one process: every rule x both formats (hypothesis), the state's Python types,
tied weights, frozen leaves, adjusted hyperparameters, half-precision models, and every corrupt or mismatched
checkpoint refused with a CheckpointError naming the file and the key before anything changes."""
import copy
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fluxpy
import fluxpy.random as frandom
from fluxpy import CheckpointError, load_training, save_training
from fluxpy.io import flat_state, read_file, write_file
from fluxpy.layers import Chain, Dense, Dropout
from fluxpy.losses import mse
from fluxpy.optimise import (AccumGrad, AdaBelief, AdaDelta, AdaGrad, AdaMax, Adam, AdamW, ClipGrad, ClipNorm, Descent,
                             Lion, Momentum, NAdam, Nesterov, OAdam, OptimiserChain, RAdam, RMSProp, SignDecay,
                             WeightDecay, Leaf, adjust, freeze, setup)

ALL_RULES = [Descent(0.05), Momentum(0.05), Nesterov(0.05), RMSProp(0.01), RMSProp(0.01, centred=True), Adam(0.01),
             AdamW(0.01, lambd=0.01), AdaGrad(0.05), AdaDelta(0.9), AdaMax(0.01), NAdam(0.01), RAdam(0.01),
             OAdam(0.01), AdaBelief(0.01), Lion(0.001), OptimiserChain(SignDecay(1e-3), WeightDecay(1e-3),
                                                                        ClipGrad(1.0), ClipNorm(1.0), Adam(0.01)),
             OptimiserChain(AccumGrad(3), Momentum(0.05))]
FORMATS = ["npz", "safetensors"]


def _net(seed=3):
    fluxpy.seed(seed)
    return Chain(Dense(3, 6, fluxpy.tanh), Dropout(0.5), Dense(6, 2))


def _data(n, start=0, seed=4):
    rng = np.random.default_rng(seed)
    data = [(rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal((5, 2)).astype(np.float32))
            for _ in range(start + n)]
    return data[start:]


def _steps(model, opt, data):
    for x, y in data:
        (g,) = fluxpy.gradient(lambda m: mse(m(x), y), model)
        fluxpy.update(opt, model, g)


def _weights(model):
    return [np.array(a) for a in flat_state(model).values()]


def _snapshot(model, opt):
    """Everything a load could change, copied: the model's arrays, each leaf's rule, flag and state (with the
    Python types of its numbers), the random state and the loss scale."""
    leaves = [(leaf.rule, leaf.frozen, copy.deepcopy(leaf.state)) for leaf in fluxpy.optimise.Plan.leaves(opt)]
    scaler = getattr(model, "loss_scaler", None)
    return _weights(model), leaves, frandom.get_state(), None if scaler is None else scaler.get_state()


def _same(a, b):
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    return type(a) is type(b) and (a == b or (a != a and b != b))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rule=st.sampled_from(ALL_RULES), fmt=st.sampled_from(FORMATS), first=st.integers(1, 4),
       second=st.integers(1, 4))
def test_every_rule_resumes_bit_for_bit_in_both_formats(tmp_path, rule, fmt, first, second):
    model = _net()
    opt = setup(rule, model)
    _steps(model, opt, _data(first + second))
    other = _net()
    other_opt = setup(rule, other)
    _steps(other, other_opt, _data(first))
    path = tmp_path / f"run.{fmt}"
    save_training(path, other, other_opt, step=first)
    resumed = _net(seed=99)   # other weights and another generator state: the load sets both
    resumed_opt = setup(rule, resumed)
    assert load_training(path, resumed, resumed_opt) == {"step": first}
    _steps(resumed, resumed_opt, _data(second, start=first))
    assert _same(_weights(resumed), _weights(model))
    for a, b in zip(fluxpy.optimise.Plan.leaves(resumed_opt), fluxpy.optimise.Plan.leaves(opt)):
        assert _same(a.state, b.state)   # counters of the same Python type (int t, float beta^t) and value


@pytest.mark.parametrize("fmt", FORMATS)
def test_tied_weights_frozen_leaves_and_adjusted_rules_round_trip(tmp_path, fmt):
    w = np.random.default_rng(0).standard_normal((3, 3))
    model = {"a": w, "b": w, "c": np.ones(2)}   # a and b: one array, one leaf
    opt = setup(Adam(0.1), model)
    assert opt["a"] is opt["b"]
    grads = {"a": np.ones((3, 3)), "b": np.ones((3, 3)), "c": np.ones(2)}
    for _ in range(2):
        fluxpy.update(opt, model, grads)
    freeze(opt["c"])
    adjust(opt, 0.02, beta=(0.8, 0.99))
    save_training(tmp_path / f"t.{fmt}", model, opt, step=2, note="tied", epochs=[1, 2])
    w2 = np.zeros((3, 3))
    fresh = {"a": w2, "b": w2, "c": np.zeros(2)}
    fresh_opt = setup(Adam(0.1), fresh)
    assert load_training(tmp_path / f"t.{fmt}", fresh, fresh_opt) == {"step": 2, "note": "tied", "epochs": [1, 2]}
    assert fresh["a"] is fresh["b"] and fresh_opt["a"] is fresh_opt["b"]
    assert fresh_opt["c"].frozen and not fresh_opt["a"].frozen
    assert fresh_opt["a"].rule == Adam(0.02, beta=(0.8, 0.99))
    assert _same(fresh_opt["a"].state, opt["a"].state)
    for _ in range(2):
        fluxpy.update(opt, model, grads)
        fluxpy.update(fresh_opt, fresh, grads)
    assert _same(_weights(fresh), _weights(model))


def test_the_leaf_caches_are_dropped_so_the_counters_come_from_the_loaded_state(tmp_path):
    model = {"w": np.ones(4)}
    opt = setup(Adam(0.1), model)
    fluxpy.update(opt, model, {"w": np.ones(4)})   # the leaf caches its plan
    leaf = opt["w"]
    assert leaf._steps is not None
    save_training(tmp_path / "a.npz", model, opt)
    load_training(tmp_path / "a.npz", model, opt)
    assert leaf._steps is None and leaf._counters is None and isinstance(leaf, Leaf)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("convert", [fluxpy.bf16, fluxpy.f16], ids=["bf16", "f16"])
def test_a_half_model_and_its_float32_state_round_trip(tmp_path, fmt, convert):
    model = convert(Chain(Dense(3, 4, rng=0), Dense(4, 2, rng=1)))
    opt = setup(Adam(0.01), model)
    x = np.ones((2, 3), model.layers[0].weight.dtype)
    (g,) = fluxpy.gradient(lambda m: m(x).astype(np.float32).sum(), model)
    fluxpy.update(opt, model, g)
    save_training(tmp_path / f"h.{fmt}", model, opt, step=1)
    fresh = convert(Chain(Dense(3, 4, rng=5), Dense(4, 2, rng=6)))
    fresh_opt = setup(Adam(0.01), fresh)
    load_training(tmp_path / f"h.{fmt}", fresh, fresh_opt)
    assert _same(_weights(fresh), _weights(model))
    for a, b in zip(fluxpy.optimise.Plan.leaves(fresh_opt), fluxpy.optimise.Plan.leaves(opt)):
        assert _same(a.state, b.state)


def test_step_and_extra_values_are_checked_before_writing(tmp_path):
    model = {"w": np.ones(2)}
    opt = setup(Adam(), model)
    with pytest.raises(TypeError, match="step must be an int >= 0"):
        save_training(tmp_path / "s.npz", model, opt, step=-1)
    with pytest.raises(TypeError, match="JSON values"):
        save_training(tmp_path / "s.npz", model, opt, callback=print)
    with pytest.raises(ValueError, match="set up for another model|fields"):
        save_training(tmp_path / "s.npz", model, setup(Adam(), {"v": np.ones(2)}))
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# refused checkpoints: a CheckpointError naming the file and the key, nothing changed


def _saved_run(tmp_path, fmt, rule=None):
    model = _net()
    opt = setup(rule or Adam(0.01), model)
    _steps(model, opt, _data(2))
    path = tmp_path / f"run.{fmt}"
    save_training(path, model, opt, step=2)
    return path


def _target():
    model = _net(seed=50)
    opt = setup(Adam(0.01), model)
    _steps(model, opt, _data(1, seed=9))
    fluxpy.seed(77)
    return model, opt


def _rewritten(path, change):
    """The checkpoint at ``path`` rewritten with ``change(arrays, meta)`` applied (both edited in place)."""
    target, arrays, text = read_file(path, "test")
    meta = json.loads(text)
    change(arrays, meta)
    write_file(target, arrays, json.dumps(meta), "test")
    return target


def _edit_counter(arrays, meta):
    leaf = next(iter(meta["optimiser"].values()))
    counters = leaf["state"]["tuple"][2]["tuple"]
    counters[0] = {"int": 1}   # beta1^t saved as an int: not the float the state holds


CORRUPTIONS = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "corrupt|truncated"),
    "model shape": (lambda p: _rewritten(p, lambda a, m: a.__setitem__("model.layers.0.weight", np.ones((2, 2),
                                                                                                    np.float32))),
                    r"layers\.0\.weight has shape"),
    "missing model key": (lambda p: _rewritten(p, lambda a, m: a.pop("model.layers.2.bias")),
                          r"missing from the file: layers\.2\.bias"),
    "optimiser array dtype": (lambda p: _rewritten(p, lambda a, m: a.__setitem__(
        "optimiser.layers.0.weight.0", a["optimiser.layers.0.weight.0"].astype(np.float64))),
        r"optimiser\.layers\.0\.weight\.0 holds an array of shape \(6, 3\) and dtype float64"),
    "missing optimiser array": (lambda p: _rewritten(p, lambda a, m: a.pop("optimiser.layers.2.bias.1")),
                                r"missing: optimiser\.layers\.2\.bias\.1"),
    "counter type": (lambda p: _rewritten(p, _edit_counter), r"optimiser\.layers\.0\.weight\.2\.0 holds a int 1"),
    "rng": (lambda p: _rewritten(p, lambda a, m: m["rng"].__setitem__("numpy", {"bit_generator": "MT"})),
            "random state"),
    "stray array": (lambda p: _rewritten(p, lambda a, m: a.__setitem__("extra", np.ones(1))), "extra"),
    "version": (lambda p: _rewritten(p, lambda a, m: m.__setitem__("version", 99)), "format 99"),
    "loss scale": (lambda p: _rewritten(p, lambda a, m: m.__setitem__("loss_scale", {"skipped": 0}) or a.update(
        {"loss_scale.scale": np.float32(2.0), "loss_scale.good": np.int32(0)})), "dynamic loss scale"),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_a_corrupt_or_mismatched_checkpoint_changes_nothing(tmp_path, fmt, name):
    path = _saved_run(tmp_path, fmt)
    corrupt, match = CORRUPTIONS[name]
    corrupt(path)
    model, opt = _target()
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=match) as err:
        load_training(path, model, opt)
    assert str(path) in str(err.value) and err.value.path == path
    assert _same(_snapshot(model, opt), before)


@pytest.mark.parametrize("fmt", FORMATS)
def test_another_rule_or_chain_is_refused_naming_the_leaf(tmp_path, fmt):
    path = _saved_run(tmp_path, fmt, OptimiserChain(ClipNorm(1.0), Adam(0.01)))
    model = _net(seed=50)
    for rule, match in [(Momentum(), "saved with OptimiserChain but the state has Momentum"),
                        (OptimiserChain(ClipNorm(1.0), Nesterov()), r"rule 2 of its chain\) was saved with Adam"),
                        (OptimiserChain(Adam(0.01)), "chain of 2 rules")]:
        opt = setup(rule, model)
        before = _snapshot(model, opt)
        with pytest.raises(CheckpointError, match=match):
            load_training(path, model, opt)
        assert _same(_snapshot(model, opt), before)


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_files_and_training_files_each_name_the_other_reader(tmp_path, fmt):
    model, opt = _target()
    fluxpy.save(tmp_path / f"m.{fmt}", model)
    with pytest.raises(CheckpointError, match=r"model's arrays only .*fluxpy.load\(path, model\)"):
        load_training(tmp_path / f"m.{fmt}", model, opt)
    save_training(tmp_path / f"t.{fmt}", model, opt)
    with pytest.raises(CheckpointError, match=r"training checkpoint .*load_training"):
        fluxpy.load(tmp_path / f"t.{fmt}", model)


def test_a_missing_file_and_a_state_for_another_model(tmp_path):
    model, opt = _target()
    with pytest.raises(CheckpointError, match="load_training: no file"):
        load_training(tmp_path / "none.npz", model, opt)
    path = _saved_run(tmp_path, "npz")
    with pytest.raises(CheckpointError, match="set up for another model|fields"):
        load_training(path, model, setup(Adam(), {"w": np.ones(1)}))


def test_a_float16_run_and_a_float32_model_do_not_mix(tmp_path):
    mixed = fluxpy.mixed_precision(_net(), np.float16)
    opt = setup(Adam(), mixed)
    save_training(tmp_path / "m.npz", mixed, opt)
    plain = fluxpy.mixed_precision(_net(), np.float16, loss_scale=None)
    with pytest.raises(CheckpointError, match="the file has a dynamic loss scale but the model has none"):
        load_training(tmp_path / "m.npz", plain, setup(Adam(), plain))
    other = fluxpy.mixed_precision(_net(), np.float16, loss_scale=fluxpy.DynamicLossScale(init=4.0))
    load_training(tmp_path / "m.npz", other, setup(Adam(), other))
    assert other.loss_scale.scale == 2.0 ** 15   # the saved scale, not the model's init


# ---------------------------------------------------------------------------------------------
# the device generators' state (a stand-in module with a generator shaped like fluxpy's Philox one)


class _FakePhilox:
    device = [0]   # the current device of the stand-in module

    def __init__(self, seed):
        self.key, self._offsets = (seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF), {}

    def offset(self):
        return self._offsets.setdefault(self.device[0], np.zeros(1, np.uint64))


class _Device:
    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.before, _FakePhilox.device[0] = _FakePhilox.device[0], self.n

    def __exit__(self, *exc):
        _FakePhilox.device[0] = self.before


@pytest.fixture()
def fake_device_module(monkeypatch):
    import sys
    import types
    module = types.ModuleType("fake_device_xp")
    module.random = types.SimpleNamespace(default_rng=_FakePhilox)
    module.cuda = types.SimpleNamespace(Device=_Device)
    monkeypatch.setitem(sys.modules, "fake_device_xp", module)
    yield module
    frandom._device_generators.pop(module, None)


def test_device_generator_positions_are_saved_and_restored_in_place(fake_device_module):
    fluxpy.seed(5)
    generator = frandom.rng_for(fake_device_module)
    generator.offset()[...] = 123
    with _Device(1):
        generator.offset()[...] = 7
    saved = frandom.get_state()
    assert saved["devices"]["fake_device_xp"]["offsets"] == {"0": 123, "1": 7}
    kept = generator.offset()
    generator.offset()[...] = 999
    generator.key = (1, 2)
    frandom.set_state(saved)
    assert frandom.rng_for(fake_device_module) is generator and generator.offset() is kept
    assert int(kept[0]) == 123 and list(generator.key) == saved["devices"]["fake_device_xp"]["key"]
    frandom._device_generators.pop(fake_device_module)   # as in a new process: no generator yet
    frandom.set_state(saved)
    made = frandom.rng_for(fake_device_module)
    assert made is not generator and {d: int(o[0]) for d, o in made._offsets.items()} == {0: 123, 1: 7}


def test_save_of_an_optimiser_state_points_to_save_training(tmp_path):
    model, opt = _target()
    for tree in (opt, (model, opt), {"model": model, "opt": opt}):
        with pytest.raises(TypeError, match=r"optimiser state .*fluxpy.save_training\(path, model, opt_state\)"):
            fluxpy.save(tmp_path / "m.npz", tree)
    assert not list(tmp_path.iterdir())
