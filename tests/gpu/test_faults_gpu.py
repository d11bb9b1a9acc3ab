"""Faults on the GPU: a real device out-of-memory inside a training step (``StepOutOfMemory`` naming the step; the
model, its running statistics and the optimiser state as they were; the failed step's memory given back, so a
smaller batch then trains), and a soak of 20,000 captured steps through ``train`` with the memory pool's bytes in
use and held flat.
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import (BatchNorm, Chain, Conv, Dense, MaxPool, StepOutOfMemory, TrainStep, flatten, logitcrossentropy,
                    relu, train)
from fluxpy.optimise import Adam, Momentum, Plan, setup

pytestmark = pytest.mark.gpu


def _host(tree):
    return [np.array(fluxpy.cpu(a)) for a in fluxpy.functors.arrays(tree)]


def _state(opt):
    out = []
    for leaf in Plan.leaves(opt):
        for a in (leaf.state if isinstance(leaf.state, tuple) else (leaf.state,)):
            out.append(np.array(fluxpy.cpu(a)) if hasattr(a, "shape") else a)
    return out


@pytest.mark.parametrize("capture", [False, True])
def test_a_device_out_of_memory_in_a_step_raises_naming_it_and_leaves_everything_as_it_was(capture):
    import cupy
    rng = np.random.default_rng(0)
    free = cupy.cuda.runtime.memGetInfo()[0]
    wide = int(2 * free // (4 * 40_000)) + 1   # the wide layer's output alone needs twice the free memory
    model = fluxpy.gpu(Chain(Dense(256, 64, rng=1), BatchNorm(64, relu), Dense(64, wide, rng=2)))
    opt = setup(Adam(1e-3), model)
    step = TrainStep(lambda m, x: (m(x) ** 2).mean(), model, opt, capture=capture)
    small = fluxpy.gpu(rng.standard_normal((32, 256)).astype(np.float32))
    for _ in range(3):   # warmed up (and, with capture, a graph for this batch shape)
        step(small)
    before, state_before = _host(model), _state(opt)
    pool = cupy.get_default_memory_pool()
    used_before = pool.used_bytes()
    big = fluxpy.gpu(rng.standard_normal((40_000, 256)).astype(np.float32))
    with pytest.raises(StepOutOfMemory, match=r"^TrainStep \(a step of batch \(40000, 256\)\): out of memory "
                                              r"\(OutOfMemoryError: .*\); the model and the optimiser state are"):
        step(big)
    for a, b in zip(_host(model), before):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_state(opt), state_before):
        np.testing.assert_array_equal(a, b)
    # the failed step's arrays are freed: its first layers' outputs alone would be 20 MB
    assert pool.used_bytes() <= used_before + big.nbytes + (1 << 20)
    assert np.isfinite(float(step(small)))                  # and training goes on


def _soak_model():
    rng = np.random.default_rng(3)
    return Chain(Conv((3, 3), 1, 8, pad=1, bias=False, rng=rng), BatchNorm(8, relu), MaxPool((2, 2)),
                 Conv((3, 3), 8, 16, relu, pad=1, rng=rng), MaxPool((2, 2)), flatten, Dense(16 * 7 * 7, 10, rng=rng))


def test_twenty_thousand_captured_steps_keep_device_memory_flat():
    import cupy
    rng = np.random.default_rng(4)
    batches = [(fluxpy.gpu(rng.standard_normal((64, 1, 28, 28)).astype(np.float32)),
                fluxpy.gpu(fluxpy.onehotbatch(rng.integers(0, 10, 64), range(10)))) for _ in range(20)]
    model = fluxpy.gpu(_soak_model())
    opt = setup(Momentum(0.01), model)
    pool = cupy.get_default_memory_pool()

    def loss(m, x, y):
        return logitcrossentropy(m(x), y)
    losses = train(loss, model, batches, opt, epochs=50)      # the first 1,000 steps: warm-up and capture
    used, held = [pool.used_bytes()], [pool.total_bytes()]
    for _ in range(19):                                        # 19,000 more, in calls of 1,000
        losses += train(loss, model, batches, opt, epochs=50)
        used.append(pool.used_bytes())
        held.append(pool.total_bytes())
    assert len(losses) == 20_000 and np.all(np.isfinite(losses))
    from fluxpy.train import _checked_steps   # train's one CheckedStep for this model, loss and optimiser
    (_, step) = _checked_steps[model]
    assert set(step.captured().values()) == {"captured"}
    assert used == [used[0]] * 20, used        # not one byte more in use
    assert held == [held[0]] * 20, held        # nor held by the pool (this process's device memory; the free
    #                                            memory of the device is shared with the other test workers)
