"""The mutation check on CuPy arrays: off by default (``"auto"`` checks NumPy arrays only: no host read on the GPU);
with ``mutation_checks=True`` a changed device array raises as on the CPU, and a captured step is still captured
(the check skips itself inside a capture).
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import ChangedInPlaceError, Dense, TrainStep, gradient, options, pullback
from fluxpy.optimise import Adam, setup

pytestmark = pytest.mark.gpu


def _loss_changing(x):
    def f(w):
        y = (w * x).sum()
        x[0] += 1.0
        return y
    return f


def test_a_changed_device_array_raises_with_the_check_on_and_not_by_default():
    x = fluxpy.gpu(np.array([1.0, 2.0, 3.0], np.float32))
    w = fluxpy.gpu(np.ones(3, np.float32))
    (g,) = gradient(_loss_changing(x), w)            # "auto": CuPy arrays unchecked, the new values used
    np.testing.assert_array_equal(fluxpy.cpu(g), [2.0, 2.0, 3.0])
    with options(mutation_checks=True):
        with pytest.raises(ChangedInPlaceError, match=r"an array `multiply` read, of shape \(3,\) and dtype float32"):
            gradient(_loss_changing(x), w)
        y, back = pullback(lambda w: w * x, w)
        x[[0, 1]] = x[[1, 0]]                          # a swap: the same values, other places
        with pytest.raises(ChangedInPlaceError, match="^pullback's back"):
            back(fluxpy.gpu(np.ones(3, np.float32)))


def test_a_captured_step_with_the_check_on_is_captured_and_equals_the_unchecked_one():
    rng = np.random.default_rng(0)
    x = fluxpy.gpu(rng.standard_normal((16, 8)).astype(np.float32))
    losses = {}
    for mode in (True, "auto"):
        model = fluxpy.gpu(Dense(8, 4, rng=1))
        with options(mutation_checks=mode):
            step = TrainStep(lambda m, x: (m(x) ** 2).mean(), model, setup(Adam(1e-2), model))
            losses[mode] = [float(step(x)) for _ in range(6)]
            assert set(step.captured().values()) == {"captured"}
    assert losses[True] == losses["auto"]
