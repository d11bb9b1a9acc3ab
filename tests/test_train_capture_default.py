"""train's defaults for speed: steps captured on the GPU unless asked otherwise (``capture=True``; on the CPU the
same eager steps), and device index checks read where train reads each step's loss (``index_checks="deferred"``):
an out-of-range index stops training before that step's update, naming the epoch and the batch."""
import importlib
import inspect

import numpy as np
import pytest

from fluxpy import Chain, Dense, relu, train
from fluxpy.losses import mse
from fluxpy.optimise import Adam, Descent, setup

train_module = importlib.import_module("fluxpy.train")   # the module (fluxpy.train is also the function's name)


def _problem(seed=0, batches=4):
    rng = np.random.default_rng(seed)
    model = Chain(Dense(3, 5, relu, rng=rng), Dense(5, 2, rng=rng))
    data = [(rng.standard_normal((8, 3)).astype(np.float32), rng.standard_normal((8, 2)).astype(np.float32))
            for _ in range(batches)]
    return model, data, lambda m, x, y: mse(m(x), y)


def test_capture_is_the_default():
    assert inspect.signature(train).parameters["capture"].default is True
    assert "(the default)" in train.__doc__


@pytest.mark.parametrize("kw, captured", [({}, True), ({"capture": True}, True), ({"capture": False}, False),
                                          ({"max_loss_ratio": 1e6}, False)])
def test_the_default_runs_the_checked_captured_step_and_max_loss_ratio_or_capture_false_do_not(monkeypatch, kw,
                                                                                                captured):
    made = []
    real = train_module._checked_step

    def spy(*args):
        made.append(args)
        return real(*args)
    monkeypatch.setattr(train_module, "_checked_step", spy)
    model, data, loss = _problem()
    losses = train(loss, model, data, setup(Adam(0.01), model), progress=False, **kw)
    assert len(losses) == len(data) and all(np.isfinite(losses))
    assert bool(made) == captured


def test_every_step_reads_the_index_flags_without_waiting_after_its_loss(monkeypatch):
    calls = []
    monkeypatch.setattr(train_module, "check_indices", lambda wait=True: calls.append(wait))
    model, data, loss = _problem(1, batches=3)
    train(loss, model, data, setup(Descent(0.1), model), progress=False, epochs=2)
    assert calls == [False] * 6


def test_an_index_error_found_at_the_loss_stops_before_that_steps_update(monkeypatch):
    model, data, loss = _problem(2, batches=3)
    seen = []

    def check_indices(wait=True):
        seen.append(model[0].weight.copy())
        if len(seen) == 2:
            raise IndexError("gather: index 9 in idx is out of range for src axis 0 of size 4 (reported late: ...)")
    monkeypatch.setattr(train_module, "check_indices", check_indices)
    with pytest.raises(IndexError, match=r"^train \(epoch 1, batch 2\): gather: index 9 in idx is out of range.*"
                                         r"stopping before the update$"):
        train(loss, model, data, setup(Descent(0.1), model), progress=False)
    np.testing.assert_array_equal(model[0].weight, seen[1])   # batch 2's update did not run
    assert not np.array_equal(seen[0], seen[1])                # batch 1's did


def test_a_captured_steps_index_report_names_the_batch():
    """A replay's hooks report an index its step met (fluxpy.kernels.scatter_checks); train names the batch."""
    from fluxpy.backend import start_reading_scalars
    from fluxpy.step import Flight

    class Captured:
        loss_scaled = False

        def replay(self, n):
            def commit():
                if n == 3:
                    raise IndexError("gather: an index in the captured step was out of range (its entry was skipped)")
            return Flight(start_reading_scalars(float(n), 0.0, 0.0), commit, lambda: None)

    lagged = train_module._Lagged(Captured(), lambda args, batch: float(args[0]))
    assert lagged.step((1,), 1) == [] and lagged.step((2,), 2) == [1.0]
    lagged.step((3,), 3)
    with pytest.raises(IndexError, match=r"^train \(batch 3, a captured step\): gather: an index in the captured "
                                         r"step was out of range"):
        lagged.step((4,), 4)
