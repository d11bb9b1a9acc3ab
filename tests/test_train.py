"""train(): the loop, its return value, progress output and divergence errors."""

import numpy as np
import pytest

from fluxpy.data import DataLoader, onehotbatch
from fluxpy.layers import Chain, Dense
from fluxpy.losses import logitcrossentropy, mse
from fluxpy.ops.activations import relu
from fluxpy.optimise import Adam, Descent, setup
from fluxpy.train import TrainingDiverged, train


def regression_problem(n=64):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)
    return x, y


def test_train_reduces_the_loss_and_returns_per_batch_losses():
    x, y = regression_problem()
    model = Dense(3, 1, rng=0)
    opt = setup(Adam(0.05), model)
    loader = DataLoader((x, y), batchsize=16, shuffle=True, rng=0)
    losses = train(lambda m, x, y: mse(m(x), y), model, loader, opt, epochs=20, progress=False)
    assert len(losses) == 20 * len(loader)
    assert all(isinstance(v, float) for v in losses)
    assert losses[-1] < 0.01 * losses[0]


def test_train_classifier():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((200, 2)).astype(np.float32)
    labels = (x[:, 0] * x[:, 1] > 0).astype(np.int64)
    y = onehotbatch(labels, range(2))
    model = Chain(Dense(2, 16, relu, rng=rng), Dense(16, 2, rng=rng))
    opt = setup(Adam(0.02), model)
    train(lambda m, x, y: logitcrossentropy(m(x), y), model, DataLoader((x, y), batchsize=32, shuffle=True, rng=1),
          opt, epochs=60, progress=False)
    accuracy = np.mean(model(x).argmax(axis=1) == labels)
    assert accuracy > 0.9


def test_non_tuple_batches_are_passed_whole():
    model = {"w": np.array([2.0])}
    seen = []

    def loss(m, batch):
        seen.append(batch.shape)
        return (m["w"] * batch).sum()
    train(loss, model, [np.ones(3), np.ones(2)], setup(Descent(0.1), model), progress=False)
    assert seen == [(3,), (2,)]
    np.testing.assert_allclose(model["w"], [2.0 - 0.3 - 0.2])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_loss_names_epoch_and_batch(bad):
    model = {"w": np.array([1.0])}
    batches = [(np.array([1.0]),), (np.array([2.0]),), (np.array([bad]),)]
    with pytest.raises(FloatingPointError) as err:
        train(lambda m, x: (m["w"] * x).sum(), model, batches, setup(Descent(0.1), model), epochs=2, progress=False)
    assert isinstance(err.value, TrainingDiverged)
    assert (err.value.epoch, err.value.batch) == (1, 3)
    assert f"the loss is {bad} at epoch 1, batch 3" in str(err.value)
    np.testing.assert_allclose(model["w"], [1.0 - 0.1 - 0.2])  # the bad batch did not update


def test_progress_with_tqdm(capsys):
    pytest.importorskip("tqdm")
    x, y = regression_problem(32)
    model = Dense(3, 1)
    train(lambda m, x, y: mse(m(x), y), model, DataLoader((x, y), batchsize=8), setup(Adam(0.01), model), epochs=2)
    err = capsys.readouterr().err
    assert "epoch 1/2" in err and "epoch 2/2" in err and "4/4" in err


def test_progress_without_tqdm(capsys, no_tqdm):
    x, y = regression_problem(32)
    model = Dense(3, 1)
    train(lambda m, x, y: mse(m(x), y), model, DataLoader((x, y), batchsize=8), setup(Adam(0.01), model), epochs=2)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("epoch 1/2: 4 batches, loss ") and lines[0].endswith("images/s")


def test_train_freezes_the_startup_objects_only_while_it_runs():
    import gc
    model = {"w": np.array([1.0, 2.0])}
    frozen_inside = []

    def loss(m, x):
        frozen_inside.append(gc.get_freeze_count())
        return (m["w"] * x).sum()
    before = gc.get_freeze_count()
    train(loss, model, [(np.ones(2),)] * 3, setup(Descent(0.1), model), progress=False)
    assert min(frozen_inside) > before            # the objects alive at the start were frozen during training
    assert gc.get_freeze_count() == before        # and unfrozen when it ended
    with pytest.raises(TrainingDiverged):
        train(loss, model, [(np.array([np.nan, 1.0]),)], setup(Descent(0.1), model), progress=False)
    assert gc.get_freeze_count() == before        # also after an error


def test_capture_changes_nothing_on_the_cpu():
    import copy
    rng = np.random.default_rng(3)
    model = Chain(Dense(4, 6, relu, rng=rng), Dense(6, 3, rng=rng))
    twin = copy.deepcopy(model)
    data = [(rng.standard_normal((5, 4)).astype(np.float32), onehotbatch(rng.integers(0, 3, 5), range(3)))
            for _ in range(6)]
    f = lambda m, x, y: logitcrossentropy(m(x), y)
    got = train(f, model, data, setup(Adam(0.01), model), progress=False)   # capture=True, the default
    want = train(f, twin, data, setup(Adam(0.01), twin), progress=False, capture=False)
    assert got == want
    np.testing.assert_array_equal(model[0].weight, twin[0].weight)
    with pytest.raises(TypeError, match="train: capture must be True or False"):
        train(f, model, data, setup(Adam(0.01), model), progress=False, capture="yes")
