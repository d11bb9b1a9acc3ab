"""DynamicLossScale: a float16 run whose gradients are never finite stops with LossScaleUnderflow (it does not return
having trained nothing); the scale is capped at max_scale; bad arguments are clear errors; its state saves and
loads (in place into the device arrays where they exist)."""
import copy

import numpy as np
import pytest

import fluxpy
from fluxpy import DynamicLossScale, mixed_precision
from fluxpy.layers import Dense
from fluxpy.losses import mse
from fluxpy.optimise import Adam, setup
from fluxpy.precision import LossScaleUnderflow


def _never_finite(m, x):
    """A finite loss (0) whose gradient is infinite at every scale: sqrt at 0."""
    return fluxpy.sqrt(m(x) * 0.0).sum()


def _model(init, **kw):
    return mixed_precision(Dense(3, 2, rng=0), np.float16, loss_scale=DynamicLossScale(init=init, **kw))


def test_train_with_gradients_never_finite_raises_naming_the_scale_and_the_steps_skipped():
    m = _model(1.0)
    before = copy.deepcopy(m.model)
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    with np.errstate(all="ignore"), pytest.raises(LossScaleUnderflow) as err:
        fluxpy.train(_never_finite, m, [(x,)] * 40, setup(Adam(), m), progress=False)
    assert isinstance(err.value, FloatingPointError)
    # 1 halved 15 times is 2**-15, the first scale below min_scale = 2**-14
    assert err.value.skipped == 15 and err.value.scale == 2.0 ** -15
    assert "fell to 3.05176e-05, below min_scale=6.10352e-05, after 15 steps in a row" in str(err.value)
    np.testing.assert_array_equal(m.model.weight, before.weight)   # nothing was trained, and it says so


def test_update_with_gradients_never_finite_raises_too():
    m = _model(2.0 ** -13)
    opt = setup(Adam(), m)
    x = np.ones((2, 3), np.float32)
    with np.errstate(all="ignore"):
        (g,) = fluxpy.gradient(lambda m: _never_finite(m, x), m)
        fluxpy.update(opt, m, g)   # 2**-14: at the floor, not below it
        with pytest.raises(LossScaleUnderflow, match="2 steps in a row"):
            fluxpy.update(opt, m, g)


def test_a_good_step_resets_the_count_of_skipped_steps():
    s = DynamicLossScale(init=1.0, growth_interval=1, min_scale=0.25)
    s.array(np)
    for flag in [np.inf, np.inf, 0.0, np.inf, 0.0, np.inf, 0.0, np.inf]:   # 5 overflows, never 3 in a row
        s.advance(np.asarray(flag))
    assert s.scale == 0.25 and s.get_state()["skipped"] == 1


@pytest.mark.parametrize("init, interval", [(2.0 ** 23, 1), (2.0 ** 20, 3)])
def test_the_scale_grows_to_max_scale_and_stays_there(init, interval):
    s = DynamicLossScale(init=init, growth_interval=interval)
    s.array(np)
    for _ in range(30 * interval):
        s.advance(np.asarray(0.0))
    assert s.scale == 2.0 ** 24 == s.max_scale
    small = DynamicLossScale(init=4.0, growth_interval=1, max_scale=16.0)
    small.array(np)
    for _ in range(10):
        small.advance(np.asarray(0.0))
    assert small.scale == 16.0
    small.advance(np.asarray(np.nan))
    assert small.scale == 8.0


def test_training_with_finite_gradients_never_reaches_infinity():
    m = _model(2.0 ** 23, growth_interval=1)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    with np.errstate(all="ignore"):
        fluxpy.train(lambda m, x, y: mse(m(x), y) * 1e-6, m, [(x, y)] * 12, setup(Adam(), m), progress=False)
    assert 0 < m.loss_scale.scale <= 2.0 ** 24


@pytest.mark.parametrize("kwargs, error, match", [
    ({"init": "1024"}, TypeError, "init must be a positive finite number, got str '1024'"),
    ({"init": None}, TypeError, "init must be a positive finite number, got NoneType None"),
    ({"init": True}, TypeError, "init must be"),
    ({"init": 0.0}, ValueError, "init must be a positive finite number, got 0.0"),
    ({"init": float("inf")}, ValueError, "init must be"),
    ({"growth_interval": 2.5}, TypeError, "growth_interval must be an int >= 1, got float 2.5"),
    ({"growth_interval": 0}, ValueError, "growth_interval must be an int >= 1, got 0"),
    ({"max_scale": "big"}, TypeError, "max_scale must be"),
    ({"min_scale": 1.0, "init": 0.5}, ValueError, "min_scale <= init <= max_scale"),
    ({"init": 2.0 ** 30}, ValueError, "min_scale <= init <= max_scale"),
])
def test_bad_arguments_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        DynamicLossScale(**kwargs)


def test_numpy_numbers_are_numbers():
    s = DynamicLossScale(init=np.float32(8.0), growth_interval=np.int64(3))
    assert s.scale == 8.0 and s.growth_interval == 3 and type(s.growth_interval) is int
    assert mixed_precision(Dense(2, 2), np.float16, loss_scale=np.float64(4.0)).loss_scale == 4.0


def test_state_round_trips_in_place():
    s = DynamicLossScale(init=8.0, growth_interval=2)
    scale = s.array(np)
    s.advance(np.asarray(0.0))
    s.advance(np.asarray(np.inf))
    saved = s.get_state()
    assert saved["scale"] == 4.0 and saved["good"] == 0 and saved["skipped"] == 1
    other = DynamicLossScale(init=8.0, growth_interval=2)
    kept = other.array(np)
    other.set_state(saved)
    assert other.array(np) is kept and float(kept) == 4.0 and other.get_state()["skipped"] == 1
    later = DynamicLossScale(init=8.0, growth_interval=2)
    later.set_state(saved)   # before its arrays exist: they are made from the saved values
    assert float(later.array(np)) == 4.0 and later.scale == 4.0
    assert scale is s.array(np)


def test_train_counts_its_captured_steps_overflows_and_raises_below_the_floor():
    """train's captured steps (a stand-in CheckedStep whose replays all overflow, as tests/test_train_lagged.py
    has it): the flags train reads are counted, and the scale the device lowered below min_scale raises."""
    from test_train_lagged import _driver, _StandIn, _train

    class Model:
        loss_scaler = DynamicLossScale(init=2.0 ** -13)

    s = _StandIn(bad=set(range(1, 10)), loss_scaled=True)
    s.model = Model()
    scaler = Model.loss_scaler
    scaler.array(np)
    real = s.replay

    def replay(n):   # the device's side of an overflowing replay: the scale halved
        flight = real(n)
        scaler._scale[...] = scaler._scale * np.float32(0.5)
        return flight
    s.replay = replay
    with pytest.raises(LossScaleUnderflow, match="below min_scale"):
        _train(_driver(s), list(range(1, 10)))
    assert scaler.scale < scaler.min_scale
