"""The capture contract: every exported layer class (tests/capture_contract.py has one network per class; a CPU test
fails when an export has none) trains in a captured :class:`fluxpy.TrainStep` on the GPU in float32, float16 and
bfloat16 (under ``mixed_precision``, whose half copies of 4-d arrays are channels-last) and, for image batches in a
full run (tests/sweeps.py), float32 channels-last: the step is captured (no :class:`CaptureWarning`), finite, and equal to the eager step from
the same start within the dtype's tolerance; in float32 with deterministic kernels, bit for bit. Every exported
optimiser rule is captured in tests/gpu/test_optimise_rules_gpu.py.

Each run makes two copies of the case's model: one steps eagerly ``STEPS`` times, the other takes one eager
warm-up step, then the captured one and replays; random cases (dropout) start both from the same seed.
"""
import copy
import warnings

import numpy as np
import pytest

import fluxpy
from fluxpy import CaptureWarning, TrainStep, mixed_precision, trainables
from fluxpy.optimise import Adam, setup
from fluxpy.options import options
from capture_contract import CASES
from sweeps import FULL

pytestmark = pytest.mark.gpu

STEPS = 3
TOLERANCE = {"float32": 2e-5, "float16": 2e-2, "bfloat16": 5e-2}   # relative, on the losses and the weights


def _runs():
    out = []
    for name in sorted(CASES):
        out += [(name, p, "contiguous") for p in ("float32", "float16", "bfloat16")]
        if CASES[name].image:
            out.append(pytest.param(name, "float32", "channels_last", marks=FULL))
    return out


def _prepare(model, x, y, precision, memory):
    model = fluxpy.gpu(model, memory=memory if memory == "channels_last" else None)
    x, y = fluxpy.gpu(x), fluxpy.gpu(y)
    if memory == "channels_last" and x.ndim == 4:
        x = fluxpy.to_channels_last(x)
    if precision != "float32":
        model = mixed_precision(model, precision)
    return model, x, y


def _train(model, x, y, loss, capture, seed):
    fluxpy.seed(seed)
    step = TrainStep(loss, model, setup(Adam(1e-3), model), capture=capture, warmup=1)
    losses = [step(x, y) for _ in range(STEPS)]
    return step, np.array([float(v) for v in losses]), [np.asarray(fluxpy.cpu(p), np.float64)
                                                         for p in trainables(model)]


@pytest.mark.parametrize("name,precision,memory", _runs())
def test_every_layer_is_captured_and_equals_the_eager_step(name, precision, memory):
    case = CASES[name]
    model, x, y, loss = case.make(seed=3)
    eager_model, x, y = _prepare(copy.deepcopy(model), x, y, precision, memory)
    captured_model, _, _ = _prepare(model, x, y, precision, memory)
    with options(deterministic=True):
        _, eager_losses, eager_weights = _train(eager_model, x, y, loss, False, seed=7)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CaptureWarning)
            step, losses, weights = _train(captured_model, x, y, loss, True, seed=7)
    assert set(step.captured().values()) == {"captured"}, step.captured()
    assert np.all(np.isfinite(losses)) and all(np.all(np.isfinite(w)) for w in weights), (losses, name)
    tol = TOLERANCE[precision]
    np.testing.assert_allclose(losses, eager_losses, rtol=tol, atol=tol, err_msg=f"{name} losses")
    for i, (w, e) in enumerate(zip(weights, eager_weights)):
        np.testing.assert_allclose(w, e, rtol=tol, atol=tol, err_msg=f"{name} weight {i}")
    if precision == "float32" and memory == "contiguous":
        same = [np.array_equal(w, e) for w, e in zip(weights, eager_weights)]
        assert np.array_equal(losses, eager_losses) and all(same), (
            f"{name}: captured float32 steps differ from the eager ones (losses {losses - eager_losses}, weights "
            f"equal: {same})")


def test_a_float16_step_is_captured_after_warm_up_steps_that_overflowed():
    """A dynamic loss scale skips the warm-up steps whose float16 gradients overflow; the optimiser's device state
    (Adam's counters) must exist anyway, since the capture cannot copy it from the host."""
    from fluxpy.layers import Chain, Dense
    from fluxpy.losses import mse
    rng = np.random.default_rng(0)
    model = mixed_precision(fluxpy.gpu(Chain(Dense(4, 8, fluxpy.tanh, rng=1), Dense(8, 1, rng=2))), "float16")
    x = fluxpy.gpu(rng.standard_normal((16, 4), dtype=np.float32))
    y = fluxpy.gpu(rng.standard_normal((16, 1), dtype=np.float32))
    before = [np.asarray(fluxpy.cpu(p)) for p in trainables(model)]
    step = TrainStep(lambda m, x, y: mse(1e4 * m(x), y), model, setup(Adam(1e-3), model), warmup=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        losses = [float(step(x, y)) for _ in range(4)]
    assert set(step.captured().values()) == {"captured"}
    assert np.all(np.isfinite(losses))
    after = [np.asarray(fluxpy.cpu(p)) for p in trainables(model)]
    assert all(np.array_equal(a, b) for a, b in zip(after, before)), "an overflowing step changed the weights"


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_layer_runs_its_inference_forward_in_half_precision_as_on_the_cpu(name, precision):
    """Outside a gradient (test mode) a layer computes on plain arrays, where CuPy's own operators apply (a Python
    number with a bfloat16 CuPy array gives float32): every case's forward under ``mixed_precision`` runs on the GPU
    and agrees with the CPU's (NumPy keeps the half type)."""
    case = CASES[name]
    model, x, _, _ = case.make(seed=5)
    model = fluxpy.testmode(model)
    on_cpu = _outputs(mixed_precision(copy.deepcopy(model), precision)(x))
    on_gpu = _outputs(mixed_precision(fluxpy.gpu(model), precision)(fluxpy.gpu(x)))
    tol = TOLERANCE[precision] * 4
    for g, c in zip(on_gpu, on_cpu, strict=True):
        got = np.asarray(fluxpy.cpu(g), np.float64)
        assert g.dtype == c.dtype and np.all(np.isfinite(got)), name
        np.testing.assert_allclose(got, np.asarray(c, np.float64), rtol=tol, atol=tol, err_msg=name)


def _outputs(y):
    return [a for item in y for a in _outputs(item)] if isinstance(y, tuple) else [y]
