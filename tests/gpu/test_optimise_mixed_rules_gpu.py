"""Different rules for different parts of one model in one state (``setup(f, model)``) on the GPU: a captured
TrainStep replays the eager steps, each part stepped by its own rule's kernels; an array left untrained stays."""
import copy
import warnings

import numpy as np
import pytest

import fluxpy
from fluxpy import CaptureWarning, Chain, Dense, TrainStep, logitcrossentropy, relu
from fluxpy import optimise as O
from fluxpy.options import options

pytestmark = pytest.mark.gpu


def _rule(path, x):
    if path == ("layers", 1, "bias"):
        return None
    return O.Rprop(0.01) if path[1] == 0 else O.AMSGrad(0.01)


def _loss(m, x, y):
    return logitcrossentropy(m(x), y)


def test_a_captured_step_of_a_mixed_state_replays_the_eager_steps():
    import cupy as cp
    rng = np.random.default_rng(0)
    model = Chain(Dense(20, 32, relu, rng=rng), Dense(32, 10, rng=rng))
    batches = [(cp.asarray(rng.standard_normal((16, 20), dtype=np.float32)),
                cp.asarray(fluxpy.onehotbatch(rng.integers(0, 10, 16), range(10)))) for _ in range(8)]
    captured_model, eager_model = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    bias = cp.asnumpy(captured_model.layers[1].bias)
    with options(deterministic=True):
        captured = TrainStep(_loss, captured_model, O.setup(_rule, captured_model))
        eager = TrainStep(_loss, eager_model, O.setup(_rule, eager_model), capture=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CaptureWarning)
            got = [float(captured(*b)) for b in batches]
        want = [float(eager(*b)) for b in batches]
    assert set(captured.captured().values()) == {"captured"}
    assert got == want
    for a, b in zip(fluxpy.trainables(captured_model), fluxpy.trainables(eager_model)):
        np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))
    np.testing.assert_array_equal(cp.asnumpy(captured_model.layers[1].bias), bias)
