"""train(): the loop, its return value, progress output and divergence errors."""

import io
import re
import sys
import types

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


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self):
        return True


def fake_terminal(monkeypatch):
    """Makes stderr a terminal for the rest of the test (called in the test: pytest's capture puts its own stderr
    back between a fixture and the test's body)."""
    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def fit(epochs=2, data=None, **kw):
    """Train a small regression; 4 batches an epoch unless ``data`` is given."""
    x, y = regression_problem(32)
    model = Dense(3, 1)
    data = DataLoader((x, y), batchsize=8) if data is None else data
    return train(lambda m, x, y: mse(m(x), y), model, data, setup(Adam(0.01), model), epochs=epochs, **kw)


def last_state(text):
    """What a line rewritten in place shows last: the text after its last carriage return."""
    return text.rstrip("\n").split("\r")[-1].rstrip()


def test_progress_draws_one_tqdm_bar_for_the_whole_call(monkeypatch):
    stderr = fake_terminal(monkeypatch)
    pytest.importorskip("tqdm")
    fit(epochs=3)
    out = stderr.getvalue()
    assert out.count("\n") == 1                        # one bar, left on screen once, not one per epoch
    assert "epoch 3/3" in last_state(out) and "12/12" in last_state(out)
    assert "/4 " not in out                            # no bar counted an epoch's batches alone
    assert "loss=" in out and "img_per_s=" in out


def test_progress_draws_one_plain_line_for_the_whole_call_without_tqdm(monkeypatch, no_tqdm):
    stderr = fake_terminal(monkeypatch)
    fit(epochs=3)
    out = stderr.getvalue()
    assert out.count("\n") == 1 and out.endswith("\n")
    assert re.fullmatch(r"epoch 3/3: 12/12 batches, loss \d+\.\d{4}, \d+ images/s", last_state(out))


@pytest.mark.parametrize("tqdm_installed", [True, False])
def test_progress_by_default_only_on_a_terminal(capsys, monkeypatch, tqdm_installed, request):
    if tqdm_installed:
        pytest.importorskip("tqdm")
    else:
        request.getfixturevalue("no_tqdm")
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    fit()                                              # stderr captured by pytest: not a terminal
    assert capsys.readouterr().err == ""
    fit(progress=True)                                 # asked for: drawn anyway
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "epoch 2/2" in last_state(err) and "8/8" in last_state(err)


@pytest.mark.parametrize("tqdm_installed", [True, False])
def test_progress_false_is_silent_on_a_terminal(monkeypatch, tqdm_installed, request):
    stderr = fake_terminal(monkeypatch)
    if tqdm_installed:
        pytest.importorskip("tqdm")
    else:
        request.getfixturevalue("no_tqdm")
    losses = fit(progress=False)
    assert len(losses) == 8 and stderr.getvalue() == ""


def test_progress_by_default_in_a_jupyter_kernel(capsys, monkeypatch, no_tqdm):
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    fit()
    assert "epoch 2/2: 8/8 batches" in last_state(capsys.readouterr().err)


def test_progress_of_data_without_a_length_counts_the_batches(monkeypatch, no_tqdm):
    stderr = fake_terminal(monkeypatch)
    x, y = regression_problem(24)
    fit(epochs=1, data=iter([(x[i:i + 8], y[i:i + 8]) for i in range(0, 24, 8)]))
    assert last_state(stderr.getvalue()).startswith("train: 3 batches, loss ")


def test_progress_counts_the_steps_a_resumed_run_skips(monkeypatch, no_tqdm, tmp_path):
    stderr = fake_terminal(monkeypatch)
    path = tmp_path / "run.npz"
    x, y = regression_problem(32)
    model = Dense(3, 1, rng=0)
    opt = setup(Adam(0.01), model)
    loader = DataLoader((x, y), batchsize=8)                # 4 batches an epoch
    calls = []

    def crashing(m, x, y):   # the first run stops in its 7th step, after the save of step 6 (epoch 2, batch 2)
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return mse(m(x), y)
    with pytest.raises(KeyboardInterrupt):
        train(crashing, model, loader, opt, epochs=3, progress=False, checkpoint=path, every=3)
    assert stderr.getvalue() == ""
    losses = train(lambda m, x, y: mse(m(x), y), model, loader, opt, epochs=3, checkpoint=path, every=3, resume=True)
    assert len(losses) == 12 - 6                         # epoch 1 skipped whole, epoch 2 from its third batch
    assert last_state(stderr.getvalue()).startswith("epoch 3/3: 12/12 batches, loss ")


@pytest.mark.parametrize("bad", ["yes", 2, np.array([1, 0])])
def test_progress_must_be_none_true_or_false(bad):
    model = {"w": np.array([1.0])}
    with pytest.raises(TypeError, match="train: progress must be None .a bar on a terminal only., True or False"):
        train(lambda m, x: (m["w"] * x).sum(), model, [(np.ones(1),)], setup(Descent(0.1), model), progress=bad)
    np.testing.assert_array_equal(model["w"], [1.0])


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
