"""A training step that runs out of memory (fluxpy.journal): ``StepOutOfMemory`` naming the step, and the model (its
running statistics and SpectralNorm's vectors too) and the optimiser state exactly as they were, whether the forward
or the backward pass ran out, in ``TrainStep`` and in ``train``; the next step then is the step the run would have
taken without the fault. CuPy's ``OutOfMemoryError`` is a ``MemoryError``: these raise the host's in its place (a
real device out-of-memory: tests/gpu/test_faults_gpu.py)."""
import copy

import numpy as np
import pytest

import fluxpy
from fluxpy import StepOutOfMemory, TrainStep, train
from fluxpy.layers import BatchNorm, Chain, Dense, InstanceNorm, SpectralNorm
from fluxpy.losses import mse
from fluxpy.optimise import Adam, Momentum, Plan, setup

FAULT = {"where": None}


@fluxpy.primitive
def _fails_in_backward(x):
    def back(dy):
        raise MemoryError("out of memory allocating 68,719,476,736 bytes (backward)")
    return x, back


def _fault(x):
    """A layer that runs out of memory where FAULT says: in the forward pass, or in its pullback."""
    if FAULT["where"] == "forward":
        raise MemoryError("out of memory allocating 68,719,476,736 bytes (forward)")
    return _fails_in_backward(x) if FAULT["where"] == "backward" else x


def _model():
    return Chain(Dense(4, 6, rng=0), BatchNorm(6), SpectralNorm(Dense(6, 6, rng=1), rng=2),
                 lambda x: x.reshape(x.shape[0], 2, 3), InstanceNorm(2, track_stats=True),
                 lambda x: x.reshape(x.shape[0], 6), _fault, Dense(6, 2, rng=3))


def _flat(x):
    if isinstance(x, (tuple, list)):
        return [a for item in x for a in _flat(item)]
    return [np.array(x, copy=True)]


def _arrays(model):
    """Copies of every array of the model (running statistics and SpectralNorm's vectors too)."""
    return [np.array(a, copy=True) for a in fluxpy.functors.arrays(model)]


def _state(opt):
    """Copies of every array and number of the optimiser state (the moments, the counters)."""
    return [a for leaf in Plan.leaves(opt) for a in _flat(leaf.state)]


def _assert_same(a, b):
    assert len(a) == len(b) and len(a) > 0
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def _batch(seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((8, 2)).astype(np.float32)


def _loss(m, x, y):
    return mse(m(x), y)


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("rule", [Adam(1e-2), Momentum(0.1)], ids=["Adam", "Momentum"])
def test_a_train_step_out_of_memory_leaves_model_and_optimiser_as_they_were(where, rule):
    model = _model()
    step = TrainStep(_loss, model, setup(rule, model))
    for seed in range(2):
        step(*_batch(seed))
    before, state_before = _arrays(model), _state(step.opt_state)
    twin, twin_state = copy.deepcopy(model), copy.deepcopy(step.opt_state)
    FAULT["where"] = where
    try:
        with pytest.raises(StepOutOfMemory, match=r"^TrainStep \(a step of batch \(8, 4\), \(8, 2\)\): out of "
                                                  rf"memory \(MemoryError: .*\({where}\)\); the model and the "
                                                  "optimiser state are as they were"):
            step(*_batch(5))
    finally:
        FAULT["where"] = None
    _assert_same(_arrays(model), before)
    _assert_same(_state(step.opt_state), state_before)
    step(*_batch(6))                                   # the run goes on as if the fault had not been
    TrainStep(_loss, twin, twin_state)(*_batch(6))
    _assert_same(_arrays(model), _arrays(twin))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_train_out_of_memory_names_the_batch_and_leaves_the_model_as_it_was(where):
    model = _model()
    opt = setup(Adam(1e-2), model)
    data = [_batch(s) for s in range(3)]
    train(_loss, model, data[:2], opt)
    before, state_before = _arrays(model), _state(opt)
    FAULT["where"] = where
    try:
        with pytest.raises(StepOutOfMemory, match=r"^train \(epoch 1, batch 1\): out of memory"):
            train(_loss, model, data[2:], opt)
    finally:
        FAULT["where"] = None
    _assert_same(_arrays(model), before)
    _assert_same(_state(opt), state_before)


def test_the_error_holds_nothing_of_the_failed_step():
    model = _model()
    step = TrainStep(_loss, model, setup(Adam(), model))
    FAULT["where"] = "backward"
    try:
        with pytest.raises(StepOutOfMemory) as info:
            step(*_batch(0))
    finally:
        FAULT["where"] = None
    err = info.value
    assert err.__cause__ is None and err.__context__ is None   # no traceback of the failed pass, whose arrays it holds


def test_other_errors_pass_through_and_the_journal_keeps_nothing_after_a_step():
    from fluxpy import journal
    model = _model()
    step = TrainStep(_loss, model, setup(Adam(), model))
    with pytest.raises(ValueError):
        step(np.ones((8, 3), np.float32), np.ones((8, 2), np.float32))
    assert journal._journal.get() is None
    running = model[1].running_mean.copy()
    with journal.changing(model[1].running_mean):   # outside a step: nothing is kept, nothing put back
        model[1].running_mean[...] += 1
    np.testing.assert_array_equal(model[1].running_mean, running + 1)


def test_a_batchnorm_called_twice_in_a_failed_step_is_put_back_to_before_the_first_call():
    bn = BatchNorm(3)
    model = Chain(Dense(4, 3, rng=0), bn, bn, _fault, Dense(3, 2, rng=1))   # the same layer twice: two writes
    step = TrainStep(_loss, model, setup(Adam(1e-2), model))
    step(*_batch(0))
    before = _arrays(model)
    FAULT["where"] = "backward"
    try:
        with pytest.raises(StepOutOfMemory):
            step(*_batch(1))
    finally:
        FAULT["where"] = None
    _assert_same(_arrays(model), before)


def test_a_writer_that_keeps_the_old_values_itself_has_them_put_back():
    from fluxpy import journal
    running = np.arange(3.0)

    def step(raise_before_write):
        with journal.changing(running, writer_keeps=True):
            assert journal.awaits(running)
            if raise_before_write:   # nothing written, nothing kept: nothing to put back
                raise MemoryError("out of memory (before the write)")
            old = running[None].copy()   # a kernel's own buffer, holding what it overwrites
            journal.kept(old, running)
            running[...] = -1.0
            assert not journal.awaits(running)
        raise MemoryError("out of memory (after the write)")

    for before_write in (True, False):
        with pytest.raises(StepOutOfMemory):
            journal.undone_on_out_of_memory("a step", step, before_write)
        np.testing.assert_array_equal(running, np.arange(3.0))
    assert not journal.awaits(running)
