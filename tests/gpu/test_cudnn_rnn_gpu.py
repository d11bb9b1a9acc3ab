"""Recurrent layers through cuDNN's RNN API (fluxpy.kernels.cudnn.rnn, glued by fluxpy.kernels.cuda_rnn): the whole
sequence in one ``cudnnRNNForward`` and two backward calls, against the float64 composite on the CPU (the same
rounded numbers) for RNN (tanh, relu), LSTM and GRU, one to three layers, one or two directions, with and without
bias and initial states, in float32, float64, float16 and bfloat16: outputs, final states and every gradient; that
cuDNN really takes each call (counted); that a repeated call builds no new plan; that a captured TrainStep of an
LSTM classifier (one layer, and stacked bidirectional) is captured and equals the eager step.

Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere). Run:
``python -m pytest -q tests/gpu/test_cudnn_rnn_gpu.py -p no:cacheprovider``. A failure names the case and the
array: ``y``, ``h_n``, ``c_n``, ``dx``, ``dh0``, ``dc0``, or a weight as ``layer-and-direction k weight_ih``.
"""
import copy
import warnings

import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy import CaptureWarning, TrainStep, kernels
from fluxpy.functors import fmap
from fluxpy.kernels import cuda_rnn
from fluxpy.kernels.cudnn import rnn as cudnn_rnn
from fluxpy.losses import logitcrossentropy
from fluxpy.models.recurrent import last_step
from fluxpy.optimise import Adam, setup
from sweeps import case_id, sweep
from test_half_conv_matmul import BF16

pytestmark = pytest.mark.gpu

DTYPES = [np.float32, np.float64, np.float16, BF16]
# Errors relative to 1 + max|reference| (the float64 CPU composite on the same rounded numbers): float32 about
# 1e-4 as PyTorch's cuDNN against its CPU LSTM; the halves round every step's state in 16 bits, as the composite's
# fused gates do in their own order.
TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-4, np.dtype(np.float16): 2e-2, BF16: 8e-2}
KINDS = ("rnn_tanh", "rnn_relu", "lstm", "gru")
# (N, T, in, hidden, num_layers, bidirectional, bias, initial state given)
SHAPES = [(2, 5, 3, 4, 1, False, True, True), (3, 7, 5, 6, 2, True, True, False), (4, 3, 8, 16, 3, True, False, True),
          (5, 9, 16, 32, 2, False, True, True), (1, 1, 2, 3, 1, True, True, True)]


def _dev(a):
    """A host array on the device, its dtype kept (bfloat16 through its bits)."""
    cp = cupy_module()
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    return cp.asarray(a.view(np.uint16)).view(a.dtype) if a.dtype == BF16 else cp.asarray(a)


def _host64(a):
    cp = cupy_module()
    a = fluxpy.value_of(a)
    if isinstance(a, cp.ndarray):
        a = cp.asnumpy(a.view(np.uint16)).view(BF16) if a.dtype == BF16 else cp.asnumpy(a)
    return (a.astype(np.float32) if a.dtype == BF16 else a).astype(np.float64)


def _rounded(a, dtype):
    """``a`` rounded to ``dtype`` (what the device gets) and that as float64 (what the CPU gets)."""
    r = a.astype(np.float32).astype(dtype) if np.dtype(dtype) != np.float64 else a
    return r, _host64(r)


def _close(got, want, dtype, what):
    g, w = _host64(got), _host64(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} on the GPU, {w.shape} on the CPU"
    err = np.abs(g - w).max() if g.size else 0.0
    bound = TOL[np.dtype(dtype)] * (1 + np.abs(w).max())
    assert err <= bound, f"{what}: max error {err:.3g} against the CPU composite, above {bound:.3g}"


def _layer(kind, n_in, hidden, layers, bidirectional, bias, seed=5):
    kw = dict(num_layers=layers, bidirectional=bidirectional, bias=bias, rng=seed)
    if kind.startswith("rnn"):
        return fluxpy.RNN(n_in, hidden, fluxpy.relu if kind == "rnn_relu" else fluxpy.tanh, **kw)
    return {"lstm": fluxpy.LSTM, "gru": fluxpy.GRU}[kind](n_in, hidden, **kw)


def _pair(kind, n_in, hidden, layers, bidirectional, bias, dtype):
    """The float64 CPU layer (biases random, not zero) and its copy in ``dtype`` on the device."""
    layer = fluxpy.f64(_layer(kind, n_in, hidden, layers, bidirectional, bias))
    rng = np.random.default_rng(6)
    for cell in (layer.cell,) + layer.stacked:
        if cell.bias is not None:
            cell.bias[...] = rng.standard_normal(cell.bias.shape) * 0.5
    host = fmap(lambda a: _rounded(a, dtype)[1] if fluxpy.backend.is_array(a) else a, layer)
    dev = fmap(lambda a: _dev(_rounded(a, dtype)[0]) if fluxpy.backend.is_array(a) else a, layer)
    return host, dev


class _Count:
    """Counts the calls of the ``rnn_forward`` and ``rnn_backward`` kernels (wrapped in the table, restored
    after)."""

    def __enter__(self):
        self.counts, self.table = {"rnn_forward": 0, "rnn_backward": 0}, kernels.snapshot()
        for name, entry in cuda_rnn.KERNELS.items():
            fn, ok = entry if isinstance(entry, tuple) else (entry, None)

            def counted(*args, _fn=fn, _name=name):
                self.counts[_name] += 1
                return _fn(*args)
            kernels.register(name, "cupy", counted, ok)
        return self

    def __exit__(self, *exc):
        kernels.restore(self.table)


def _declined(dims_dtype):
    return any(d.dtype == dims_dtype for d in cuda_rnn._declined)


@pytest.mark.parametrize("kind, shape, dtype", sweep(KINDS, SHAPES, DTYPES), ids=case_id)
def test_cudnn_matches_the_cpu_composite(kind, shape, dtype):
    """Forward, final states and the gradients of x, the initial states and every weight, a random cotangent on
    every output and on each final state, against the float64 CPU composite."""
    n, steps, n_in, hidden, layers, bidirectional, bias, given = shape
    d = 2 if bidirectional else 1
    stacked = layers > 1 or bidirectional
    rng = np.random.default_rng(7)
    host, dev = _pair(kind, n_in, hidden, layers, bidirectional, bias, dtype)
    state_shape = (layers * d, n, hidden) if stacked else (n, hidden)
    (x, x64), (h0, h064), (c0, c064) = (_rounded(rng.standard_normal(s), dtype)
                                         for s in ((n, steps, n_in), state_shape, state_shape))
    (dy, dy64), (dh, dh64), (dc, dc64) = (_rounded(rng.standard_normal(s), dtype)
                                          for s in ((n, steps, d * hidden), state_shape, state_shape))
    lstm = kind == "lstm"

    def loss(m, x, h0, c0, dy, dh, dc):
        y, s = m(x, ((h0, c0) if lstm else h0) if given else None, return_state=True)
        h, c = s if lstm else (s, None)
        return (y * dy).sum() + (h * dh).sum() + ((c * dc).sum() if lstm else 0)

    with _Count() as count:
        y, s = dev(_dev(x), ((_dev(h0), _dev(c0)) if lstm else _dev(h0)) if given else None, return_state=True)
        got = fluxpy.gradient(lambda *a: loss(*a, _dev(dy), _dev(dh), _dev(dc)), dev, _dev(x), _dev(h0), _dev(c0))
    y64, s64 = host(x64, ((h064, c064) if lstm else h064) if given else None, return_state=True)
    want = fluxpy.gradient(lambda *a: loss(*a, dy64, dh64, dc64), host, x64, h064, c064)
    assert y.dtype == np.dtype(dtype), f"y is {y.dtype}, the layer's dtype is {np.dtype(dtype)}"
    _close(y, y64, dtype, "y")
    for a, w, name in zip(s if lstm else (s,), s64 if lstm else (s64,), ("h_n", "c_n")):
        _close(a, w, dtype, name)
    _close(got[1], want[1], dtype, "dx")
    if given:
        _close(got[2], want[2], dtype, "dh0")
        if lstm:
            _close(got[3], want[3], dtype, "dc0")
    for k in range(layers * d):
        g, w = (t["cell"] if k == 0 else t["stacked"][k - 1] for t in (got[0], want[0]))
        for name in ("weight_ih", "weight_hh") + (("bias",) if bias else ()):
            _close(g[name], w[name], dtype, f"layer-and-direction {k} {name}")
    if np.dtype(dtype) == BF16 and _declined(BF16):
        pytest.skip("this cuDNN turned bfloat16 RNNs down: the composite ran (and matched); no cuDNN call to count")
    assert count.counts == {"rnn_forward": 2, "rnn_backward": 1}, \
        f"cuDNN's RNN calls did not take every call (a fallback to the composite?): {count.counts}"


def test_a_repeated_call_builds_nothing_new():
    """The second call of a problem finds its plan (descriptors, sizes, weight offsets) and its device lengths
    built: no new plan, no new device constant."""
    cp = cupy_module()
    from fluxpy.ops.constants import constants_held
    lstm = fluxpy.gpu(fluxpy.LSTM(8, 16, num_layers=2, bidirectional=True, rng=0))
    x = cp.asarray(np.random.default_rng(1).standard_normal((4, 6, 8)).astype(np.float32))
    fluxpy.gradient(lambda m: m(x).sum(), lstm)
    plans, held = dict(cudnn_rnn._plans), constants_held()
    with _Count() as count:
        fluxpy.gradient(lambda m: m(x).sum(), lstm)
        lstm(x)
    assert count.counts == {"rnn_forward": 2, "rnn_backward": 1}
    assert cudnn_rnn._plans == plans, "a repeated call built a new cuDNN RNN plan"
    assert constants_held() == held, "a repeated call made a new device constant"


def test_float32_is_deterministic_and_without_tf32():
    """Two runs give the same bits (cuDNN's standard algorithm, float32 math: CUDNN_FMA_MATH)."""
    cp = cupy_module()
    gru = fluxpy.gpu(fluxpy.GRU(16, 32, num_layers=2, rng=0))
    x = cp.asarray(np.random.default_rng(2).standard_normal((8, 10, 16)).astype(np.float32))
    runs = [fluxpy.withgradient(lambda m: (m(x) ** 2).sum(), gru) for _ in range(2)]
    assert float(runs[0][0]) == float(runs[1][0])
    first, second = (_arrays(r[1][0]) for r in runs)
    assert len(first) == 2 * 3 and len(second) == len(first)
    for a, b in zip(first, second):
        assert cp.array_equal(a, b)


def _arrays(tree):
    """The arrays of a gradient tree (dicts and tuples), in order."""
    if isinstance(tree, dict):
        return [a for v in tree.values() for a in _arrays(v)]
    if isinstance(tree, (tuple, list)):
        return [a for v in tree for a in _arrays(v)]
    return [] if tree is None else [tree]


def _classifier(stacked, rng):
    hidden = 24
    lstm = fluxpy.LSTM(12, hidden, num_layers=2, bidirectional=True, rng=rng) if stacked else \
        fluxpy.LSTM(12, hidden, rng=rng)
    return fluxpy.Chain(lstm, last_step, fluxpy.Dense(hidden * (2 if stacked else 1), 5, rng=rng))


@pytest.mark.parametrize("stacked", [False, True], ids=["one layer", "two layers bidirectional"])
def test_a_captured_lstm_classifier_step_equals_the_eager_step(stacked):
    """TrainStep(..., capture=True) captures the step (no CaptureWarning; its graph says "captured"), and its
    replays give the eager steps' losses and weights."""
    cp = cupy_module()
    rng = np.random.default_rng(0)
    model = _classifier(stacked, np.random.default_rng(3))
    batches = [(cp.asarray(rng.standard_normal((16, 20, 12), dtype=np.float32)),
                cp.asarray(fluxpy.onehotbatch(rng.integers(0, 5, 16), range(5)))) for _ in range(6)]
    captured_model, eager_model = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))

    def loss(m, x, y):
        return logitcrossentropy(m(x), y)
    captured = TrainStep(loss, captured_model, setup(Adam(1e-3), captured_model))
    eager = TrainStep(loss, eager_model, setup(Adam(1e-3), eager_model), capture=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        got = [float(captured(x, y)) for x, y in batches]
    want = [float(eager(x, y)) for x, y in batches]
    assert list(captured.captured().values()) == ["captured"], captured.captured()
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg="captured losses against eager ones")
    for a, b in zip(fluxpy.trainables(captured_model), fluxpy.trainables(eager_model)):
        np.testing.assert_allclose(cp.asnumpy(a), cp.asnumpy(b), rtol=1e-4, atol=1e-6)


def test_a_small_lstm_runs_cudnns_persistent_kernels_and_a_large_one_the_standard_algorithm():
    """PyTorch's choice on this problem (a float16 LSTM of 128 hidden units, 64 sequences of 100 steps) is cuDNN's
    persistent small-hidden algorithm; fluxpy's plan takes it too, and the standard one past 128 units."""
    cupy_module()
    from fluxpy.ops.rnn import RNNDims
    small = RNNDims("lstm", 64, 100, 32, 128, 1, False, True, np.dtype(np.float16))
    large = RNNDims("lstm", 64, 100, 32, 256, 1, False, True, np.dtype(np.float16))
    assert cudnn_rnn.plan(small).algo == cudnn_rnn.ALGO_PERSIST_STATIC_SMALL_H
    assert cudnn_rnn.plan(large).algo == cudnn_rnn.ALGO_STANDARD
