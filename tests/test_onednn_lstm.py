"""fluxpy.kernels.onednn's LSTM (what fluxpy.kernels.cpu_rnn runs for a float32 LSTM where oneDNN is installed):
the outputs, final states and every gradient equal the NumPy kernel's in float64 over sizes, layers, directions,
bias and initial states drawn by hypothesis, and through the op and the tape; only float32 LSTMs go there; inference
equals training's forward; a workspace still held is never reused; an evicted problem rebuilds; a failing call names
oneDNN's status. Skipped where oneDNN is not installed (``pip install fluxpy[cpu]``)."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluxpy.kernels import cpu_rnn, onednn
from fluxpy.ops.rnn import RNNDims

pytestmark = pytest.mark.skipif(onednn.library() is None, reason="oneDNN is not installed (pip install fluxpy[cpu])")


def _problem(rng, dims, states):
    """``(x, h0, c0, flat, dout)`` in float32: inputs, weights in PyTorch's order, the output buffer's cotangent
    (weights of a network whose float32 rounding does not grow over the steps, as a chaotic one's would)."""
    x = rng.standard_normal((dims.batch, dims.steps, dims.input_size)).astype(np.float32)
    h0, c0 = (rng.standard_normal(dims.state_shape).astype(np.float32) if states else None for _ in range(2))
    bound = 2 / np.sqrt(dims.hidden)   # twice PyTorch's initial scale: saturating some gates, yet not chaotic
    flat = [rng.uniform(-bound, bound, shape).astype(np.float32)
            for k in range(dims.num_layers * dims.directions) for shape in dims.weight_shapes(k)]
    dout = rng.standard_normal(dims.segments[2][1]).astype(np.float32)
    return x, h0, c0, flat, dout


def _run(dims, x, h0, c0, flat, dout):
    """The forward's output buffer and every gradient (:func:`cpu_rnn.rnn_backward` with all needed)."""
    out, saved = cpu_rnn.rnn_forward(dims, None, x, h0, c0, flat, True)
    return out, cpu_rnn.rnn_backward(dims, None, saved, x, h0, c0, flat, out, dout, [True] * (3 + len(flat)))


def _in_float64(dims, *arrays):
    wide = dataclasses.replace(dims, dtype=np.dtype(np.float64))
    x, h0, c0, flat, dout = (None if a is None else [f.astype(np.float64) for f in a] if isinstance(a, list)
                             else a.astype(np.float64) for a in arrays)
    return wide, x, h0, c0, flat, dout


def _counted(monkeypatch):
    calls = []
    forward, backward = onednn.lstm_forward, onednn.lstm_backward
    monkeypatch.setattr(onednn, "lstm_forward", lambda *a: calls.append("forward") or forward(*a))
    monkeypatch.setattr(onednn, "lstm_backward", lambda *a: calls.append("backward") or backward(*a))
    return calls


def _assert_close(got, want):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)


@settings(max_examples=30, deadline=None)
@given(layers=st.integers(1, 3), bidirectional=st.booleans(), bias=st.booleans(), states=st.booleans(),
       n=st.integers(1, 5), steps=st.integers(1, 12), n_in=st.integers(1, 9), hidden=st.integers(1, 40),
       seed=st.integers(0, 2**16))
def test_onednn_equals_the_numpy_kernel_in_float64(layers, bidirectional, bias, states, n, steps, n_in, hidden, seed):
    dims = RNNDims("lstm", n, steps, n_in, hidden, layers, bidirectional, bias, np.dtype(np.float32))
    case = _problem(np.random.default_rng(seed), dims, states)
    with pytest.MonkeyPatch.context() as mp:
        calls = _counted(mp)
        out, grads = _run(dims, *case)
    assert calls == ["forward"] * layers + ["backward"] * layers
    want_out, want = _run(*_in_float64(dims, *case))
    assert out.dtype == np.float32
    _assert_close(out, want_out)
    assert [g is None for g in grads] == [g is None for g in want]
    for got, ref in zip(grads, want):
        if ref is not None:
            assert got.dtype == np.float32 and got.shape == ref.shape
            _assert_close(got, ref)


def test_only_float32_lstms_go_to_onednn(monkeypatch):
    calls = _counted(monkeypatch)
    rng = np.random.default_rng(1)
    for mode, dtype in (("gru", np.float32), ("rnn_tanh", np.float32), ("lstm", np.float64)):
        dims = RNNDims(mode, 2, 3, 4, 5, 1, False, True, np.dtype(dtype))
        x = rng.standard_normal((2, 3, 4)).astype(dtype)
        flat = [rng.standard_normal(s).astype(dtype) for s in dims.weight_shapes(0)]
        cpu_rnn.rnn_forward(dims, None, x, None, None, flat, True)
    assert calls == []
    assert onednn.takes_lstm(np.ones(2, np.float32)) and not onednn.takes_lstm(np.ones((0, 2), np.float32))


def test_inference_equals_the_trained_forward():
    dims = RNNDims("lstm", 3, 7, 4, 6, 2, True, True, np.dtype(np.float32))
    x, h0, c0, flat, _ = _problem(np.random.default_rng(2), dims, True)
    out, saved = cpu_rnn.rnn_forward(dims, None, x, h0, c0, flat, False)
    assert saved is None
    np.testing.assert_allclose(out, cpu_rnn.rnn_forward(dims, None, x, h0, c0, flat, True)[0], rtol=1e-6, atol=1e-6)


def test_a_held_workspace_is_not_reused_and_a_dropped_one_is(monkeypatch):
    """Two forwards of one problem before either backward (a network applied twice): each backward reads its own
    forward's workspace."""
    dims = RNNDims("lstm", 2, 5, 3, 4, 1, False, True, np.dtype(np.float32))
    rng = np.random.default_rng(3)
    first, second = _problem(rng, dims, True), _problem(rng, dims, True)
    kept = [cpu_rnn.rnn_forward(dims, None, *case[:4], True) for case in (first, second)]
    workspaces = [saved[0].workspace for _, saved in kept]
    assert workspaces[0].ctypes.data != workspaces[1].ctypes.data
    for case, (out, saved) in zip((first, second), kept):
        got = cpu_rnn.rnn_backward(dims, None, saved, *case[:4], out, case[4], [True] * 6)
        want = _run(*_in_float64(dims, *case))[1]
        for g, ref in zip(got, want):
            _assert_close(g, ref)
    addresses = {w.ctypes.data for w in workspaces}
    del kept, workspaces, saved
    again = cpu_rnn.rnn_forward(dims, None, *first[:4], True)[1][0].workspace
    assert again.ctypes.data in addresses   # a dropped buffer came back


def test_a_problem_evicted_between_forward_and_backward_rebuilds(monkeypatch):
    monkeypatch.setattr(onednn, "_PROBLEMS_KEPT", 1)
    dims = RNNDims("lstm", 2, 4, 3, 5, 1, True, False, np.dtype(np.float32))
    case = _problem(np.random.default_rng(4), dims, False)
    out, saved = cpu_rnn.rnn_forward(dims, None, *case[:4], True)
    other = RNNDims("lstm", 3, 4, 3, 5, 1, True, False, np.dtype(np.float32))
    cpu_rnn.rnn_forward(other, None, *_problem(np.random.default_rng(5), other, False)[:4], True)
    assert len(onednn.library().problems) == 1
    got = cpu_rnn.rnn_backward(dims, None, saved, *case[:4], out, case[4], [True] * 7)
    want_out, want = _run(*_in_float64(dims, *case))
    _assert_close(out, want_out)
    for g, ref in zip(got, want):
        if ref is not None:
            _assert_close(g, ref)


def test_a_failing_call_names_the_status_and_the_function():
    with pytest.raises(RuntimeError, match=r"oneDNN: dnnl_lstm_forward_primitive_desc_create failed with "
                                           r"dnnl_invalid_arguments"):
        onednn._LSTMProblem(onednn.library(), 2, 3, 4, 5, 3, True)   # three directions: there is no such LSTM


@pytest.mark.parametrize("bidirectional, states", [(False, False), (True, True)])
def test_the_ops_gradients_in_float32_equal_float64s(bidirectional, states, monkeypatch):
    """Through the public op and the tape: the float32 gradients (oneDNN's) of a loss of all three outputs equal the
    float64 ones (the NumPy kernel's)."""
    import fluxpy
    from fluxpy.ops.rnn import rnn
    dims = RNNDims("lstm", 3, 8, 5, 7, 2, bidirectional, True, np.dtype(np.float32))
    rng = np.random.default_rng(6)
    x, h0, c0, flat, _ = _problem(rng, dims, states)
    seeds = [rng.standard_normal(dims.y_shape), rng.standard_normal(dims.state_shape),
             rng.standard_normal(dims.state_shape)]

    def gradients(dtype):
        def loss(x, *flat):
            triples = [tuple(flat[k:k + 3]) for k in range(0, len(flat), 3)]
            y, h, c = rnn(x, triples, cast(h0), cast(c0), mode="lstm", num_layers=2, bidirectional=bidirectional)
            return (y * cast(seeds[0])).sum() + (h * cast(seeds[1])).sum() + (c * cast(seeds[2])).sum()

        def cast(a):
            return None if a is None else a.astype(dtype)
        return fluxpy.gradient(loss, cast(x), *(cast(w) for w in flat))
    calls = _counted(monkeypatch)
    narrow = gradients(np.float32)
    assert calls == ["forward", "forward", "backward", "backward"]
    wide = gradients(np.float64)
    assert calls == ["forward", "forward", "backward", "backward"]
    for got, ref in zip(narrow, wide):
        assert got.dtype == np.float32
        _assert_close(got, ref)
