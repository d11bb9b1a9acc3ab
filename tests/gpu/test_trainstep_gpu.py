"""TrainStep on the GPU: steps replayed from a CUDA graph give what eager steps give, from the same start.

cuDNN runs with ``deterministic=True`` here, so that two runs of the same step round alike and the weights can
be compared bit for bit; every other kernel of these steps is deterministic. Checked: the MNIST reference net
with Adam, a BatchNorm net with Momentum (running statistics too), a small ResNet-20 with Adam, a partial last
batch (its own graph), Adam's host-side bias correction after replays, a net with Dropout (its masks drawn
on the device: captured, the same as eager), and Dropout with a host generator (one CaptureWarning, then
the eager step).
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import copy
import warnings

import numpy as np
import pytest

import fluxpy
from fluxpy import (AdaptiveMeanPool, BatchNorm, CaptureWarning, Chain, Conv, Dense, Dropout, Embedding, MaxPool,
                    TrainStep, Upsample, flatten, logitcrossentropy, relu)
from fluxpy.models import resnet20
from fluxpy.optimise import Adam, AdamW, Descent, Momentum, setup

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _deterministic_cudnn():
    with fluxpy.options(deterministic=True):
        yield


def _reference(rng):
    return Chain(Conv((3, 3), 1, 16, relu, pad=1, rng=rng), MaxPool((2, 2)),
                 Conv((3, 3), 16, 32, relu, pad=1, rng=rng), MaxPool((2, 2)),
                 Conv((3, 3), 32, 32, relu, pad=1, rng=rng), MaxPool((2, 2)), flatten, Dense(288, 10, rng=rng))


def _bn_net(rng):
    return Chain(Conv((3, 3), 1, 8, pad=1, bias=False, rng=rng), BatchNorm(8, relu), MaxPool((2, 2)),
                 Conv((3, 3), 8, 8, pad=1, bias=False, rng=rng), BatchNorm(8), flatten, Dense(8 * 14 * 14, 10, rng=rng))


def _batches(n, batch, shape, seed=0):
    import cupy as cp
    rng = np.random.default_rng(seed)
    return [(cp.asarray(rng.standard_normal((batch, *shape), dtype=np.float32)),
             cp.asarray(fluxpy.onehotbatch(rng.integers(0, 10, batch), range(10)))) for _ in range(n)]


def _loss(m, x, y):
    return logitcrossentropy(m(x), y)


def _run_both(model, rule, batches):
    """The same batches through a captured TrainStep and an eager one, from the same start; both models, the
    steps, and the losses of each."""
    captured_model, eager_model = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    captured = TrainStep(_loss, captured_model, setup(rule, captured_model))
    eager = TrainStep(_loss, eager_model, setup(rule, eager_model), capture=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        got = [float(captured(x, y)) for x, y in batches]
    want = [float(eager(x, y)) for x, y in batches]
    return captured_model, eager_model, captured, eager, got, want


def _assert_same_arrays(a, b):
    import cupy as cp
    for x, y in zip(fluxpy.trainables(a), fluxpy.trainables(b)):
        np.testing.assert_array_equal(cp.asnumpy(x), cp.asnumpy(y))


def test_reference_net_with_adam_replays_the_eager_steps_bit_for_bit():
    model = _reference(np.random.default_rng(0))
    cm, em, captured, eager, got, want = _run_both(model, Adam(1e-3), _batches(100, 32, (1, 28, 28)))
    assert list(captured.captured().values()) == ["captured"]
    assert got == want
    _assert_same_arrays(cm, em)
    # the host's bias-correction powers advanced with the replays, as the eager steps advanced them
    leaves = [leaf for leaf in fluxpy.optimise._leaves(captured.opt_state)]
    twins = [leaf for leaf in fluxpy.optimise._leaves(eager.opt_state)]
    assert [leaf.state[2] for leaf in leaves] == [leaf.state[2] for leaf in twins]


def test_batchnorm_net_with_momentum_and_its_running_statistics():
    import cupy as cp
    model = _bn_net(np.random.default_rng(1))
    cm, em, captured, _, got, want = _run_both(model, Momentum(0.01), _batches(25, 16, (1, 28, 28), seed=1))
    assert got == want
    _assert_same_arrays(cm, em)
    for a, b in ((cm[1], em[1]), (cm[4], em[4])):
        np.testing.assert_array_equal(cp.asnumpy(a.running_mean), cp.asnumpy(b.running_mean))
        np.testing.assert_array_equal(cp.asnumpy(a.running_var), cp.asnumpy(b.running_var))


def test_a_small_resnet_with_adam():
    model = resnet20(rng=np.random.default_rng(2))
    cm, em, _, _, got, want = _run_both(model, Adam(1e-3), _batches(12, 8, (3, 32, 32), seed=2))
    assert got == want
    _assert_same_arrays(cm, em)


def test_a_partial_last_batch_gets_its_own_graph():
    model = _reference(np.random.default_rng(3))
    full, part = _batches(6, 32, (1, 28, 28), seed=3), _batches(6, 7, (1, 28, 28), seed=4)
    mixed = [b for pair in zip(full, part) for b in pair]
    cm, em, captured, _, got, want = _run_both(model, Adam(1e-3), mixed)
    assert sorted(captured.captured().values()) == ["captured", "captured"]
    assert got == want
    _assert_same_arrays(cm, em)


def _dropout_net(init_rng, **dropout_kw):
    return Chain(flatten, Dense(784, 32, relu, rng=init_rng), Dropout(0.5, **dropout_kw), Dense(32, 10, rng=init_rng))


def test_a_net_with_dropout_replays_the_eager_steps_and_draws_new_masks():
    model = _dropout_net(np.random.default_rng(5))
    batches = _batches(12, 16, (1, 28, 28), seed=5)
    runs = []
    for capture in (True, False):   # the same seed: the same counters of the GPU's generator, step by step
        fluxpy.seed(9)
        m = fluxpy.gpu(copy.deepcopy(model))
        step = TrainStep(_loss, m, setup(Adam(1e-3), m), capture=capture)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CaptureWarning)
            runs.append((m, [float(step(x, y)) for x, y in batches], step))
    (cm, got, captured), (em, want, _) = runs
    assert list(captured.captured().values()) == ["captured"]
    assert got == want
    _assert_same_arrays(cm, em)


def test_dropout_with_a_host_generator_runs_eagerly_after_one_warning():
    model = fluxpy.gpu(_dropout_net(np.random.default_rng(5), rng=0))   # a NumPy generator: drawn on the host
    step = TrainStep(_loss, model, setup(Adam(1e-3), model))
    with pytest.warns(CaptureWarning, match="dropout") as caught:
        for x, y in _batches(6, 16, (1, 28, 28), seed=5):
            assert np.isfinite(float(step(x, y)))
    assert len([w for w in caught if w.category is CaptureWarning]) == 1
    assert "dropout" in next(iter(step.captured().values()))


def test_the_returned_losses_are_not_overwritten_by_later_replays():
    model = fluxpy.gpu(_reference(np.random.default_rng(6)))
    step = TrainStep(_loss, model, setup(Adam(1e-2), model))
    batches = _batches(8, 32, (1, 28, 28), seed=6)
    kept = [step(x, y) for x, y in batches]
    values = [float(v) for v in kept]
    assert len(set(values)) == len(values)   # each step's own loss, read after all of them ran


def _cpu_batches(n, batch, seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 1, 28, 28), dtype=np.float32),
             fluxpy.onehotbatch(rng.integers(0, 10, batch), range(10))) for _ in range(n)]


@pytest.mark.parametrize("rule", [Adam(1e-3), AdamW(1e-3, lambd=0.05), Momentum(1e-2), Descent(1e-2)])
def test_train_with_capture_gives_the_eager_losses_and_weights(rule):
    model = _reference(np.random.default_rng(7))
    batches = [fluxpy.gpu(b) for b in _cpu_batches(30, 32, 7)]
    captured, eager = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)   # every rule's update is one guarded launch
        got = fluxpy.train(_loss, captured, batches, setup(rule, captured), progress=False, capture=True)
    want = fluxpy.train(_loss, eager, batches, setup(rule, eager), progress=False, capture=False)
    assert got == want
    _assert_same_arrays(captured, eager)


def _bn_dropout_net(rng):
    return Chain(Conv((3, 3), 1, 8, pad=1, bias=False, rng=rng), BatchNorm(8, relu), MaxPool((2, 2)),
                 Conv((3, 3), 8, 16, pad=1, bias=False, rng=rng), BatchNorm(16, relu), MaxPool((2, 2)), flatten,
                 Dropout(0.3), Dense(16 * 7 * 7, 32, relu, rng=rng), Dropout(0.2), Dense(32, 10, rng=rng))


def test_a_net_with_batchnorm_and_dropout_trained_100_steps_captured_and_eagerly_alike():
    import cupy as cp
    model = _bn_dropout_net(np.random.default_rng(12))
    batches = [fluxpy.gpu(b) for b in _cpu_batches(25, 32, 12)]
    runs = []
    for capture in (True, False):   # the same seed: the same draws of the GPU's generator, step by step
        fluxpy.seed(13)
        m = fluxpy.gpu(copy.deepcopy(model))
        opt = setup(AdamW(1e-3, lambd=1e-2), m)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CaptureWarning)
            losses = fluxpy.train(_loss, m, batches, opt, epochs=4, progress=False, capture=capture)
        runs.append((m, losses, opt))
    (cm, got, copt), (em, want, eopt) = runs
    assert len(got) == 100 and got == want
    _assert_same_arrays(cm, em)
    for a, b in ((cm[1], em[1]), (cm[4], em[4])):
        np.testing.assert_array_equal(cp.asnumpy(a.running_mean), cp.asnumpy(b.running_mean))
        np.testing.assert_array_equal(cp.asnumpy(a.running_var), cp.asnumpy(b.running_var))
    _assert_same_host_state(copt, eopt)


@pytest.mark.parametrize("rule", [Adam(1e-3), Momentum(1e-2)])   # the multi-tensor and a per-parameter kernel
@pytest.mark.parametrize("bad_batch", [3, 12])   # during the warm-up, and long after the capture
def test_train_with_capture_stops_where_the_eager_train_stops_and_leaves_the_same_weights(bad_batch, rule):
    model = _reference(np.random.default_rng(8))
    host = _cpu_batches(20, 16, 8)
    host[bad_batch - 1][0][0, 0, 0, 0] = np.nan
    batches = [fluxpy.gpu(b) for b in host]
    captured, eager = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    errors, states = [], []
    for m, capture in ((captured, True), (eager, False)):
        states.append(setup(rule, m))
        with warnings.catch_warnings():
            warnings.simplefilter("error", CaptureWarning)   # both rules' updates skip themselves on the device
            with pytest.raises(fluxpy.TrainingDiverged) as caught:
                fluxpy.train(_loss, m, batches, states[-1], progress=False, capture=capture)
        errors.append(caught.value)
    assert [e.batch for e in errors] == [bad_batch, bad_batch]
    assert str(errors[0]) == str(errors[1])   # the captured run reruns the bad batch eagerly: the same error
    # the captured run skipped the bad step's update on the device, and the next one's (launched before the bad
    # step's loss was read); the host side of the optimiser is where the eager run's is
    _assert_same_arrays(captured, eager)
    _assert_same_host_state(*states)


def _assert_same_host_state(a, b):
    """The optimiser's host-side state (Adam's bias-correction powers) alike in two runs."""
    def host(state):
        return [[s for s in (leaf.state if isinstance(leaf.state, tuple) else (leaf.state,)) if not hasattr(s, "shape")]
                for leaf in fluxpy.optimise._leaves(state)]
    assert host(a) == host(b)


def test_train_called_once_per_epoch_captures_once_and_gives_the_eager_run():
    from fluxpy.train import _checked_steps
    model = _reference(np.random.default_rng(9))
    batches = [fluxpy.gpu(b) for b in _cpu_batches(10, 16, 9)]
    captured, eager = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    cs, es = setup(Adam(1e-3), captured), setup(Adam(1e-3), eager)
    got, want, steps, graphs = [], [], [], []
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("error", CaptureWarning)
            got += fluxpy.train(_loss, captured, batches, cs, progress=False, capture=True)
        want += fluxpy.train(_loss, eager, batches, es, progress=False, capture=False)
        step = _checked_steps[captured][1]
        steps.append(step)
        graphs.append([e.graph for e in step._signatures.values()])
    assert steps[0] is steps[1] is steps[2]
    assert graphs[0] == graphs[1] == graphs[2] and graphs[0][0] is not None   # one capture for the three calls
    assert got == want
    _assert_same_arrays(captured, eager)
    _assert_same_host_state(cs, es)


def test_an_array_replaced_in_the_model_between_calls_is_captured_anew():
    import cupy as cp
    model = _reference(np.random.default_rng(10))
    batches = [fluxpy.gpu(b) for b in _cpu_batches(8, 16, 10)]
    captured, eager = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    runs = []
    for m, capture in ((captured, True), (eager, False)):
        opt = setup(Descent(1e-2), m)
        losses = fluxpy.train(_loss, m, batches, opt, progress=False, capture=capture)
        m[7].bias = cp.full_like(m[7].bias, 0.25)   # a new array: the first graph writes the old one
        losses += fluxpy.train(_loss, m, batches, setup(Descent(1e-2), m), progress=False, capture=capture)
        runs.append(losses)
    assert runs[0] == runs[1]
    _assert_same_arrays(captured, eager)


def test_an_exception_from_the_data_mid_epoch_leaves_the_optimiser_in_step_with_the_model():
    model = _reference(np.random.default_rng(11))
    batches = [fluxpy.gpu(b) for b in _cpu_batches(12, 16, 11)]

    def broken():
        yield from batches[:9]
        raise RuntimeError("the data source broke")

    captured, eager = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    states = []
    for m, capture in ((captured, True), (eager, False)):
        opt = setup(Adam(1e-3), m)
        with pytest.raises(RuntimeError, match="broke"):
            fluxpy.train(_loss, m, broken(), opt, progress=False, capture=capture)
        fluxpy.train(_loss, m, batches, opt, progress=False, capture=capture)
        states.append(opt)
    _assert_same_arrays(captured, eager)
    _assert_same_host_state(*states)


# ---------------------------------------------------------------------------------------------
# Layers whose step once copied from the host or read the device (issue 36's capture contract): host-built
# constants now cached on the device, Embedding's indices checked by the gather kernel without a wait


def _constant_net(kind, rng):
    if kind == "adaptive_meanpool":
        return Chain(Conv((3, 3), 1, 4, relu, pad=1, rng=rng), AdaptiveMeanPool((5, 3)), flatten,
                     Dense(4 * 5 * 3, 10, rng=rng))
    if kind == "adaptive_meanpool_1d":
        return Chain(flatten, lambda x: fluxpy.reshape(x, (x.shape[0], 4, 196)), AdaptiveMeanPool((9,)), flatten,
                     Dense(4 * 9, 10, rng=rng))
    align = kind == "bilinear"   # "bilinear_pytorch": PyTorch's align_corners=False
    return Chain(Conv((3, 3), 1, 4, relu, pad=1, rng=rng), MaxPool((2, 2)), Upsample(2, mode="bilinear",
                 align_corners=align), Upsample(mode="bilinear", size=(30, 20), align_corners=align),
                 MaxPool((3, 4)), flatten, Dense(4 * 10 * 5, 10, rng=rng))


@pytest.mark.parametrize("kind", ["adaptive_meanpool", "adaptive_meanpool_1d", "bilinear", "bilinear_pytorch"])
def test_adaptive_mean_pooling_and_bilinear_upsampling_are_captured_and_give_the_eager_steps(kind):
    model = _constant_net(kind, np.random.default_rng(20))
    cm, em, captured, _, got, want = _run_both(model, Adam(1e-3), _batches(8, 16, (1, 28, 28), seed=20))
    assert list(captured.captured().values()) == ["captured"]   # _run_both turns a CaptureWarning into an error
    assert got == want and all(np.isfinite(got))
    _assert_same_arrays(cm, em)


def _token_batches(n, batch, length, vocabulary, seed):
    import cupy as cp
    rng = np.random.default_rng(seed)
    return [(cp.asarray(rng.integers(0, vocabulary, (batch, length))),
             cp.asarray(fluxpy.onehotbatch(rng.integers(0, 10, batch), range(10)))) for _ in range(n)]


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_an_embedding_is_captured_and_gives_the_eager_steps(padding_idx):
    rng = np.random.default_rng(21)
    model = Chain(Embedding(30, 8, rng=rng, padding_idx=padding_idx), flatten, Dense(6 * 8, 10, rng=rng))
    cm, em, captured, _, got, want = _run_both(model, Adam(1e-2), _token_batches(8, 16, 6, 30, seed=21))
    assert list(captured.captured().values()) == ["captured"]
    assert got == want and all(np.isfinite(got))
    _assert_same_arrays(cm, em)
    fluxpy.check_indices()   # every token was in range: nothing pending


def test_train_raises_a_bad_token_where_it_reads_the_loss_naming_the_op_and_the_entry():
    import cupy as cp
    rng = np.random.default_rng(22)
    model = fluxpy.gpu(Chain(Embedding(30, 8, rng=rng), flatten, Dense(6 * 8, 10, rng=rng)))
    batches = _token_batches(4, 16, 6, 30, seed=22)
    batches[1][0][3, 2] = 31   # batch 2, an eager warm-up step: the layer's gather skips it and does not wait
    before = [cp.asnumpy(a) for a in fluxpy.trainables(model)]
    with pytest.raises(IndexError, match=r"^train \(epoch 1, batch 2\): gather: index 31 in idx is out of range for "
                                         r"src axis 0 of size 30 \(reported late.*stopping before the update$"):
        fluxpy.train(_loss, model, batches, setup(Adam(1e-2), model), progress=False)
    assert any(not np.array_equal(a, cp.asnumpy(b)) for a, b in zip(before, fluxpy.trainables(model)))   # batch 1
    fluxpy.check_indices()   # reported: nothing pending
    batches = _token_batches(8, 16, 6, 30, seed=23)
    batches[5][0][0, 0] = 40   # batch 6: replayed from the graph captured at batch 3
    # batch 6's flag is read by the first report after its kernel ran: batch 5's (if batch 6 ran before batch 5's
    # loss was read) or its own
    with pytest.raises(IndexError, match=r"^train \(batch [56], a captured step\): gather: an index in the captured "
                                         r"step was out of range"):
        fluxpy.train(_loss, model, batches, setup(Adam(1e-2), model), progress=False)
    fluxpy.check_indices()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_with_dropout_and_norm_layers_is_captured_and_gives_the_eager_steps(dtype):
    """Dropout keeps the half dtype for the next Dense; GroupNorm, InstanceNorm, LayerNorm and BatchNorm keep float32
    parameters and statistics and give half outputs; GlobalMeanPool's half mean uses its cached factor."""
    from fluxpy import AlphaDropout, GlobalMeanPool, GroupNorm, InstanceNorm, LayerNorm, mixed_precision
    rng = np.random.default_rng(23)
    base = Chain(Conv((3, 3), 1, 8, pad=1, bias=False, rng=rng), GroupNorm(8, 4, relu),
                 Conv((3, 3), 8, 8, pad=1, rng=rng), InstanceNorm(8, relu, affine=True, track_stats=True),
                 BatchNorm(8, relu), MaxPool((2, 2)), GlobalMeanPool(), flatten, Dropout(0.3), Dense(8, 16, rng=rng),
                 LayerNorm(16, relu), AlphaDropout(0.1), Dense(16, 10, rng=rng))
    batches = _batches(8, 16, (1, 28, 28), seed=23)
    runs = []
    for capture in (True, False):   # the same seed: the same draws of the GPU's generator, step by step
        fluxpy.seed(9)
        m = mixed_precision(fluxpy.gpu(copy.deepcopy(base)), dtype)
        step = TrainStep(_loss, m, setup(Adam(1e-3), m), capture=capture)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CaptureWarning)
            runs.append((m, [float(step(x, y)) for x, y in batches], step))
    (cm, got, captured), (em, want, _) = runs
    assert list(captured.captured().values()) == ["captured"]
    assert got == want and all(np.isfinite(got))
    _assert_same_arrays(cm, em)
    for layer in (cm.model[1], cm.model[3], cm.model[4], cm.model[10]):
        assert all(a.dtype == np.float32 for a in fluxpy.functors.arrays(layer)), layer
