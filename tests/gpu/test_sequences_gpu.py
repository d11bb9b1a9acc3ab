"""Variable-length sequences on the GPU: pad_sequence and sequence_mask on CuPy against the CPU, ``lengths=``
through RNN, LSTM, GRU and Recurrence (outputs, final states, gradients) against the CPU, and a TrainStep whose
loss takes device lengths captured as a CUDA graph that replays the eager steps; the DataLoader's collated batches
moved to the GPU.

Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere). Run:
``python -m pytest -q tests/gpu/test_sequences_gpu.py -p no:cacheprovider``.
"""
import copy
import warnings

import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy import GRU, LSTM, RNN, CaptureWarning, DataLoader, GRUCell, Recurrence, TrainStep, pad_sequence, \
    sequence_mask
from fluxpy.optimise import Adam, setup

pytestmark = pytest.mark.gpu

MAKERS = {"rnn": lambda: RNN(3, 4, rng=1), "lstm": lambda: LSTM(3, 4, rng=1), "gru": lambda: GRU(3, 4, rng=1),
          "recurrence": lambda: Recurrence(GRUCell(3, 4, rng=1))}


def _host(a):
    return cupy_module().asnumpy(fluxpy.value_of(a))


def _states(state):
    return state if isinstance(state, tuple) else (state,)


def test_pad_sequence_and_sequence_mask_on_the_device():
    cp = cupy_module()
    rng = np.random.default_rng(0)
    seqs = [rng.standard_normal((n, 2)).astype(np.float32) for n in (3, 1, 4)]
    got = pad_sequence([cp.asarray(s) for s in seqs], padding_value=-1.0)
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(_host(got), pad_sequence(seqs, padding_value=-1.0))
    lengths = np.array([3, 1, 4])
    mask = sequence_mask(cp.asarray(lengths), 5)
    assert isinstance(mask, cp.ndarray) and mask.dtype == np.bool_
    np.testing.assert_array_equal(_host(mask), sequence_mask(lengths, 5))


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_lengths_on_the_device_match_the_cpu(kind, dtype):
    cp = cupy_module()
    rng = np.random.default_rng(1)
    cpu_layer = MAKERS[kind]()
    cpu_layer = fluxpy.f64(cpu_layer) if dtype == np.float64 else cpu_layer
    gpu_layer = fluxpy.gpu(copy.deepcopy(cpu_layer))
    lengths = np.array([5, 2, 4, 1])
    x = rng.standard_normal((4, 5, 3)).astype(dtype)
    x[~sequence_mask(lengths, 5)] = 0
    cot = rng.standard_normal((4, 5, 4)).astype(dtype)
    tol = 1e-10 if dtype == np.float64 else 1e-5

    def loss(m, x, lengths, cot):
        y, state = m(x, lengths=lengths, return_state=True)
        return (y * cot).sum() + sum((s * s).sum() for s in _states(state))
    want, (gx_want, gm_want) = fluxpy.withgradient(lambda x, m: loss(m, x, lengths, cot), x, cpu_layer)
    got, (gx, gm) = fluxpy.withgradient(lambda x, m: loss(m, x, cp.asarray(lengths), cp.asarray(cot)),
                                        cp.asarray(x), gpu_layer)
    np.testing.assert_allclose(float(got), float(want), rtol=tol)
    np.testing.assert_allclose(_host(gx), gx_want, rtol=tol, atol=tol)
    assert not _host(gx)[~sequence_mask(lengths, 5)].any()
    for k, w in gm_want["cell"].items():
        if w is not None:
            np.testing.assert_allclose(_host(gm["cell"][k]), w, rtol=tol, atol=tol)


def test_a_step_with_device_lengths_is_captured_and_replays_the_eager_steps():
    cp = cupy_module()
    rng = np.random.default_rng(2)
    model = {"lstm": LSTM(3, 8, rng=3), "head": fluxpy.Dense(8, 1, rng=4)}

    def loss(m, x, lengths, y):
        _, (h, _) = m["lstm"](x, lengths=lengths, return_state=True)
        return fluxpy.mse(m["head"](h), y)
    batches = []
    for _ in range(8):
        lengths = rng.integers(1, 7, 16)
        x = rng.standard_normal((16, 6, 3)).astype(np.float32)
        x[~sequence_mask(lengths, 6)] = 0
        batches.append((cp.asarray(x), cp.asarray(lengths), cp.asarray(rng.standard_normal((16, 1), np.float32))))
    captured_model, eager_model = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    captured = TrainStep(loss, captured_model, setup(Adam(1e-2), captured_model))
    eager = TrainStep(loss, eager_model, setup(Adam(1e-2), eager_model), capture=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        got = [float(captured(*b)) for b in batches]
    want = [float(eager(*b)) for b in batches]
    assert list(captured.captured().values()) == ["captured"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(fluxpy.trainables(captured_model), fluxpy.trainables(eager_model)):
        np.testing.assert_allclose(_host(a), _host(b), rtol=1e-5, atol=1e-6)


def test_collated_batches_move_to_the_device():
    cp = cupy_module()
    pairs = [(np.full(3, i, np.float32), i) for i in range(10)]
    for xb, yb in DataLoader(pairs, batchsize=4, device="gpu", workers=2):
        assert isinstance(xb, cp.ndarray) and isinstance(yb, cp.ndarray)
    got = [(_host(x), _host(y)) for x, y in DataLoader(pairs, batchsize=4, device="gpu", shuffle=True, rng=0)]
    want = list(DataLoader(pairs, batchsize=4, shuffle=True, rng=0))
    assert all(np.array_equal(a, c) and np.array_equal(b, d) for (a, b), (c, d) in zip(got, want))
