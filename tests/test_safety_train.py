"""train catches divergence where it happens (NaN/Inf loss or gradient, naming the batch and the parameter; a loss
that grows past max_loss_ratio) before the update, and refuses wrong arguments before the first batch."""
import numpy as np
import pytest

import fluxpy
from fluxpy.data import DataLoader
from fluxpy.layers import BatchNorm, Chain, Dense
from fluxpy.losses import mse
from fluxpy.ops.activations import relu
from fluxpy.optimise import Adam, ClipNorm, Descent, OptimiserChain, freeze, setup
from fluxpy.train import TrainingDiverged, train
from devices import state_bytes

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")   # NumPy's divide-by-zero notes on the NaN paths


def sqrt_model_loss(m, x):
    """A finite loss whose gradient is NaN where x == 0: d/dw sqrt(w * x) = x / (2 sqrt(w x)) = 0 / 0."""
    return (np.sqrt(m["a"] * x) + m["b"] * x).sum()


def test_a_nan_gradient_names_the_batch_and_the_parameter_before_the_update():
    model = {"b": np.array([1.0]), "a": np.array([1.0, 1.0])}
    state = setup(Adam(0.1), model)
    batches = [(np.array([1.0, 2.0]),), (np.array([4.0, 1.0]),), (np.array([1.0, 0.0]),)]
    with pytest.raises(TrainingDiverged) as err:
        train(sqrt_model_loss, model, batches, state, progress=False)
    e = err.value
    assert (e.epoch, e.batch, e.path) == (1, 3, "model.a")
    assert np.isfinite(e.loss)
    assert str(e).startswith("train: the gradient for model.a has 1 NaN entries (of 2, shape (2,), dtype "
                             "float64) at epoch 1, batch 3 (the loss is ")
    # batches 1 and 2 were applied, batch 3 not: compare with a run of the first two
    ref = {"b": np.array([1.0]), "a": np.array([1.0, 1.0])}
    train(sqrt_model_loss, ref, batches[:2], setup(Adam(0.1), ref), progress=False)
    assert state_bytes(model) == state_bytes(ref)


def test_a_nan_gradient_in_a_layer_model():
    model = Chain(Dense(2, 3, relu, rng=0), Dense(3, 1, rng=1))
    state = setup(Adam(0.01), model)
    x = np.ones((4, 2), np.float32)
    before = state_bytes(model, state)

    def loss(m, x):
        return mse(m(x), np.zeros((4, 1), np.float32)) + (m[1].bias * np.float32(np.nan)).sum() * 0
    with pytest.raises(TrainingDiverged, match="loss is nan"):
        train(loss, model, [(x,)], state, progress=False)
    assert state_bytes(model, state) == before

    def loss(m, x):   # finite loss, infinite gradient for the last layer's bias only
        return mse(m(x), np.zeros((4, 1), np.float32)) + np.sqrt(m[1].bias - m[1].bias).sum()
    with pytest.raises(TrainingDiverged, match=r"the gradient for model\.layers\[1\]\.bias has 1 (NaN|infinite)") \
            as err:
        train(loss, model, [(x,)], state, progress=False)
    assert err.value.path == "model.layers[1].bias"
    assert state_bytes(model, state) == before


def test_check_finite_false_skips_the_gradient_check():
    model = {"b": np.array([1.0]), "a": np.array([1.0, 1.0])}
    with np.errstate(all="ignore"):
        train(sqrt_model_loss, model, [(np.array([1.0, 0.0]),)], setup(Descent(0.1), model), progress=False,
              check_finite=False)
    assert np.isnan(model["a"][1])


def test_a_clipnorm_rule_still_refuses_with_check_finite_off():
    model = {"b": np.array([1.0]), "a": np.array([1.0, 1.0])}
    state = setup(OptimiserChain(ClipNorm(1.0), Descent(0.1)), model)
    before = state_bytes(model, state)
    with pytest.raises(ValueError, match=r"train: ClipNorm: the gradient has 2-norm nan.*at model\.a; nothing was "
                                         r"updated"):
        train(sqrt_model_loss, model, [(np.array([1.0, 0.0]),)], state, progress=False, check_finite=False)
    assert state_bytes(model, state) == before


def test_a_diverged_error_names_running_statistics_spoiled_by_the_forward_pass():
    model = Chain(Dense(2, 2, rng=0), BatchNorm(2))
    x = np.ones((4, 2), np.float32)
    x[0, 0] = np.nan
    with pytest.raises(TrainingDiverged, match=r"the loss is nan at epoch 1, batch 1.*note that the model now holds "
                                               r"NaN or Inf in model\.layers\[1\]\.running_mean, "
                                               r"model\.layers\[1\]\.running_var \(arrays written during the forward"):
        train(lambda m, x: mse(m(x), x), model, [(x,)], setup(Adam(), model), progress=False)
    assert np.isfinite(model[0].weight).all()


def test_frozen_parameters_are_not_checked():
    model = {"b": np.array([1.0]), "a": np.array([1.0, 1.0])}
    state = setup(Descent(0.1), model)
    freeze(state["a"])
    train(sqrt_model_loss, model, [(np.array([1.0, 0.0]),)], state, progress=False)
    np.testing.assert_array_equal(model["a"], [1.0, 1.0])


def test_max_loss_ratio_stops_a_loss_that_grows_by_orders_of_magnitude():
    model = {"w": np.array([1.0])}
    scales = [1.0, 3.0, 50.0, 2e4, 1.0]
    batches = [(np.array([s]),) for s in scales]
    state = setup(Descent(0.0), model)
    with pytest.raises(TrainingDiverged, match=r"the loss 20000 at epoch 1, batch 4 is more than max_loss_ratio=10000 "
                                               r"times the first batch's loss 1; stopping before the update") as err:
        train(lambda m, x: (m["w"] * x).sum(), model, batches, state, progress=False, max_loss_ratio=1e4)
    assert (err.value.epoch, err.value.batch, err.value.loss, err.value.path) == (1, 4, 2e4, None)
    losses = train(lambda m, x: (m["w"] * x).sum(), model, batches[:3], state, progress=False, max_loss_ratio=1e4)
    assert losses == [1.0, 3.0, 50.0]
    assert train(lambda m, x: (m["w"] * x).sum(), model, batches, state, progress=False) == scales   # off by default


def test_max_loss_ratio_needs_a_positive_first_loss_and_a_sane_value():
    model = {"w": np.array([1.0])}
    state = setup(Descent(0.1), model)
    with pytest.raises(ValueError, match=r"max_loss_ratio compares every loss with the first batch's, which is -1\.0"):
        train(lambda m, x: (m["w"] * x).sum(), model, [(np.array([-1.0]),)], state, progress=False,
              max_loss_ratio=10)
    np.testing.assert_array_equal(model["w"], [1.0])
    for bad in [0.5, 1, -3, True, "1e4", float("nan")]:
        with pytest.raises(ValueError, match=r"train: max_loss_ratio must be a number > 1"):
            train(lambda m, x: (m["w"] * x).sum(), model, [(np.ones(1),)], state, progress=False,
                  max_loss_ratio=bad)


def test_the_nan_loss_error_closes_the_progress_line(capsys, no_tqdm):
    model = {"w": np.array([1.0])}
    with pytest.raises(TrainingDiverged):
        train(lambda m, x: (m["w"] * x).sum(), model, [(np.ones(1),), (np.array([np.nan]),)],
              setup(Descent(0.1), model), progress=True)
    err = capsys.readouterr().err
    assert err.endswith("\n")   # the line ended: the traceback starts on a line of its own
    assert err.split("\r")[-1].startswith("train: 1/2 batches, loss ")   # the batch before the bad one


# ---------------------------------------------------------------------------------------------
# Arguments: checked before the first batch


def problem():
    model = Chain(Dense(2, 2, rng=0), BatchNorm(2))
    x = np.random.default_rng(0).standard_normal((8, 2)).astype(np.float32)
    return model, [(x, x)], lambda m, x, y: mse(m(x), y)


def test_a_rule_instead_of_the_state():
    model, data, loss = problem()
    before = state_bytes(model)
    with pytest.raises(TypeError, match=r"train: got the rule Adam\(eta=0\.001, beta=\(0\.9, 0\.999\), eps=1e-08\) as "
                                        r"the optimiser state; make the state once with opt_state = fluxpy\.setup\("
                                        r"Adam\(eta=0\.001, beta=\(0\.9, 0\.999\), eps=1e-08\), model\)"):
        train(loss, model, data, fluxpy.Adam(), progress=False)
    assert state_bytes(model) == before   # not even BatchNorm's running statistics moved


def test_other_objects_as_the_state():
    model, data, loss = problem()
    before = state_bytes(model)
    for bad, message in [(model, r"the optimiser state should be the tree that fluxpy\.setup\(rule, model\) returns"),
                         ("adam", r"the optimiser state should be the tree .*got a str"),
                         (0.001, r"the optimiser state should be the tree .*got a float"),
                         (None, r"the optimiser state has no trainable array")]:
        with pytest.raises((TypeError, ValueError), match=message):
            train(loss, model, data, bad, progress=False)
    assert state_bytes(model) == before


def test_a_state_set_up_for_another_model():
    model, data, loss = problem()
    before = state_bytes(model)
    for other in [Chain(Dense(2, 2), BatchNorm(2), Dense(2, 2)), Chain(Dense(2, 3), BatchNorm(3)),
                  fluxpy.f64(Chain(Dense(2, 2), BatchNorm(2))), Dense(2, 2)]:
        with pytest.raises(ValueError, match=r"^train: .*(set up for another model|moved or converted after setup)"):
            train(loss, model, data, setup(Adam(), other), progress=False)
    assert state_bytes(model) == before


def test_arguments_in_the_wrong_order():
    model, data, loss = problem()
    state = setup(Adam(), model)
    with pytest.raises(TypeError, match=r"train: model is a function .*the arguments are train\(loss, model, data, "
                                        r"opt_state\)"):
        train(model, loss, data, state, progress=False)
    with pytest.raises(TypeError, match=r"train: model is the rule Adam"):
        train(loss, Adam(), data, state, progress=False)
    with pytest.raises(TypeError, match=r"train: loss must be a function called as loss\(model, \*batch\), got int 3"):
        train(3, model, data, state, progress=False)


def test_data_that_is_not_iterable_or_runs_out():
    model, data, loss = problem()
    state = setup(Adam(), model)
    with pytest.raises(TypeError, match=r"train: data must be an iterable of batches \(a DataLoader, or a list of "
                                        r"\(x, y\) tuples\), got int 5"):
        train(loss, model, 5, state, progress=False)
    with pytest.raises(ValueError, match=r"train: data is a generator, an iterator that is used up after one pass, so "
                                         r"epochs=3 would train on nothing after the first"):
        train(loss, model, (b for b in data), state, epochs=3, progress=False)
    assert len(train(loss, model, iter(data), state, epochs=1, progress=False)) == 1   # one pass is fine
    with pytest.raises(ValueError, match=r"train: data gave no batches in epoch 1"):
        train(loss, model, [], state, progress=False)

    class OnePass:   # an iterable (not an iterator) that is empty the second time
        def __init__(self):
            self.used = False

        def __iter__(self):
            batches = [] if self.used else data
            self.used = True
            return iter(batches)
    with pytest.raises(ValueError, match=r"data gave no batches in epoch 2; an iterator that is used up"):
        train(loss, model, OnePass(), state, epochs=2, progress=False)


def test_epochs_must_be_a_count():
    model, data, loss = problem()
    state = setup(Adam(), model)
    for bad in [-1, 1.5, "2", True]:
        with pytest.raises(ValueError, match=r"train: epochs must be an int >= 0"):
            train(loss, model, data, state, epochs=bad, progress=False)
    assert train(loss, model, data, state, epochs=0, progress=False) == []


def test_a_loss_that_is_not_a_scalar_names_the_batch():
    model, data, loss = problem()
    state = setup(Adam(), model)
    before = state_bytes(model, state)
    with pytest.raises(ValueError, match=r"train \(epoch 1, batch 1\): the loss must return a scalar \(a 0-d float "
                                         r"array or a number\), got an array of shape \(8, 2\)"):
        train(lambda m, x, y: m(x) - y, fluxpy.testmode(model), data, state, progress=False)
    assert state_bytes(model, state) == before   # (in test mode: BatchNorm's forward writes no running statistics)


def test_a_dataloader_runs_through_all_the_checks():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    model = Dense(3, 1, rng=0)
    losses = train(lambda m, x, y: mse(m(x), y), model, DataLoader((x, y), batchsize=16, shuffle=True, rng=0),
                   setup(Adam(0.05), model), epochs=10, progress=False, max_loss_ratio=100)
    assert losses[-1] < 0.1 * losses[0]
