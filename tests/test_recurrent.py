"""RNN, LSTM and GRU (batch first) against NumPy loops with PyTorch's gate order, gradients against float64 finite
differences (hypothesis draws sizes), states in and out, errors naming the layer, and PyTorch's nn.LSTM / nn.GRU /
nn.RNN with the same weights where torch is installed."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import GRU, LSTM, RNN, GRUv3, LSTMCell
from gradcheck import check_grad


def _sig(v):
    return 1 / (1 + np.exp(-v))


def _np_run(kind, cell, x, state=None):
    wi, wh, b = cell.weight_ih, cell.weight_hh, cell.bias
    n, steps, _ = x.shape
    hidden = wh.shape[1]
    h = np.zeros((n, hidden)) if state is None else (state[0] if kind == "lstm" else state)
    c = np.zeros((n, hidden)) if state is None or kind != "lstm" else state[1]
    outs = []
    for t in range(steps):
        xi, hh = x[:, t] @ wi.T + b, h @ wh.T
        if kind == "rnn":
            h = np.tanh(xi + hh)
        elif kind == "lstm":
            z = xi + hh
            i, f, g, o = np.split(z, 4, axis=1)
            c = _sig(f) * c + _sig(i) * np.tanh(g)
            h = _sig(o) * np.tanh(c)
        else:
            r = _sig(xi[:, :hidden] + hh[:, :hidden])
            u = _sig(xi[:, hidden:2 * hidden] + hh[:, hidden:2 * hidden])
            if kind == "gru":   # the reset gate after the recurrent product (PyTorch's, Flux's GRU)
                cand = np.tanh(xi[:, 2 * hidden:] + r * hh[:, 2 * hidden:])
            else:               # gruv3: before it (Flux's GRUv3, Cho et al. 2014)
                cand = np.tanh(xi[:, 2 * hidden:] + (r * h) @ wh[2 * hidden:].T)
            h = (1 - u) * cand + u * h
        outs.append(h)
    return np.stack(outs, axis=1), ((h, c) if kind == "lstm" else h)


MAKERS = {"rnn": RNN, "lstm": LSTM, "gru": GRU, "gruv3": GRUv3}
TORCH_TWINS = ["gru", "lstm", "rnn"]   # PyTorch has no GRU v3


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(sorted(MAKERS)), st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.integers(1, 4))
def test_layers_match_numpy_loops_and_finite_differences(kind, batch, steps, n_in, hidden):
    rng = np.random.default_rng(batch * 1000 + steps * 100 + n_in * 10 + hidden)
    layer = fluxpy.f64(MAKERS[kind](n_in, hidden, rng=rng))
    layer.cell.bias[...] = rng.standard_normal(layer.cell.bias.shape) * 0.5
    x = rng.standard_normal((batch, steps, n_in))
    y, state = layer(x, return_state=True)
    want, want_state = _np_run(kind, layer.cell, x)
    np.testing.assert_allclose(y, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(state if kind == "lstm" else (state,), want_state if kind == "lstm" else (want_state,)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    check_grad(lambda x: layer(x), x)
    check_grad(lambda w: MAKERS[kind].__call__(_with_weight(layer, w), x), layer.cell.weight_hh)


def _with_weight(layer, w):
    import copy
    new = copy.copy(layer)
    new.cell = copy.copy(layer.cell)
    new.cell.weight_hh = w
    return new


def test_initial_states_and_cells():
    rng = np.random.default_rng(1)
    lstm = fluxpy.f64(LSTM(3, 4, rng=0))
    x = rng.standard_normal((2, 5, 3))
    h0, c0 = rng.standard_normal((2, 4)), rng.standard_normal((2, 4))
    y, (h, c) = lstm(x, (h0, c0), return_state=True)
    want, (wh, wc) = _np_run("lstm", lstm.cell, x, (h0, c0))
    np.testing.assert_allclose(y, want, rtol=1e-10)
    np.testing.assert_allclose(c, wc, rtol=1e-10)
    # the cell alone is one step of the layer
    h1, (h1b, c1) = lstm.cell(x[:, 0], (h0, c0))
    np.testing.assert_allclose(h1, y[:, 0], rtol=1e-12)
    gru = fluxpy.f64(GRU(3, 4, rng=1))
    g0 = rng.standard_normal((2, 4))
    np.testing.assert_allclose(gru(x, g0), _np_run("gru", gru.cell, x, g0)[0], rtol=1e-10)


def test_errors_name_the_layer():
    lstm = LSTM(3, 4)
    with pytest.raises(fluxpy.DimensionMismatch, match=r"LSTM\(3 => 4\) expects x of shape \(N, T, 3\)"):
        lstm(np.ones((2, 5, 2), np.float32))
    with pytest.raises(fluxpy.DimensionMismatch, match=r"LSTMCell\(3 => 4\) expects x of shape \(batch, 3\)"):
        lstm.cell(np.ones((2, 2), np.float32))
    with pytest.raises(fluxpy.DimensionMismatch, match=r"LSTM\(3 => 4\) expects x of shape \(N, T, in\) \(batch "
                                                      r"first\) or \(T, in\)"):
        lstm(np.ones((1, 2, 3, 3), np.float32))
    with pytest.raises(fluxpy.DimensionMismatch, match=r"expects its state as a pair \(h, c\)"):
        LSTMCell(3, 4)(np.ones((2, 3), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(fluxpy.DimensionMismatch, match=r"a state of shape \(batch, hidden\) = \(2, 4\)"):
        RNN(3, 4)(np.ones((2, 5, 3), np.float32), np.zeros((3, 4), np.float32))
    with pytest.raises(fluxpy.DTypeMismatch):
        GRU(3, 4)(np.ones((2, 5, 3)))
    assert repr(RNN(3, 4, fluxpy.relu)) == "RNN(3 => 4, relu)" and repr(GRU(2, 5)) == "GRU(2 => 5)"


@pytest.mark.parametrize("kind", TORCH_TWINS)
def test_against_pytorch_with_the_same_weights(kind):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    layer = fluxpy.f64(MAKERS[kind](3, 5, rng=3))
    t = {"rnn": torch.nn.RNN, "lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](3, 5, batch_first=True).double()
    b_ih = rng.standard_normal(layer.cell.bias.shape)
    b_hh = rng.standard_normal(layer.cell.bias.shape)
    if kind == "gru":
        b_hh[10:] = 0          # PyTorch's b_hn sits inside r * (...): fluxpy's single bias matches it only at 0
    layer.cell.bias[...] = b_ih + b_hh
    with torch.no_grad():
        t.weight_ih_l0.copy_(torch.from_numpy(layer.cell.weight_ih))
        t.weight_hh_l0.copy_(torch.from_numpy(layer.cell.weight_hh))
        t.bias_ih_l0.copy_(torch.from_numpy(b_ih))
        t.bias_hh_l0.copy_(torch.from_numpy(b_hh))
    x = rng.standard_normal((2, 6, 3))
    want = t(torch.from_numpy(x))[0].detach().numpy()
    np.testing.assert_allclose(layer(x), want, rtol=1e-10, atol=1e-12)


def _torch_pair(kind, rng, n_in=3, hidden=5, bias_hn=False):
    """A float64 fluxpy layer and the torch layer with the same weights (PyTorch's b_ih + b_hh as fluxpy's bias;
    the GRU's b_hn zero, where the two forms agree)."""
    torch = pytest.importorskip("torch")
    layer = fluxpy.f64(MAKERS[kind](n_in, hidden, rng=int(rng.integers(100))))
    t = {"rnn": torch.nn.RNN, "lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](n_in, hidden, batch_first=True)
    t = t.double()
    b_ih, b_hh = rng.standard_normal(layer.cell.bias.shape), rng.standard_normal(layer.cell.bias.shape)
    if kind == "gru":
        b_hh[2 * hidden:] = 0
    layer.cell.bias[...] = b_ih + b_hh
    with torch.no_grad():
        t.weight_ih_l0.copy_(torch.from_numpy(layer.cell.weight_ih))
        t.weight_hh_l0.copy_(torch.from_numpy(layer.cell.weight_hh))
        t.bias_ih_l0.copy_(torch.from_numpy(b_ih))
        t.bias_hh_l0.copy_(torch.from_numpy(b_hh))
    return layer, t


@pytest.mark.parametrize("kind", TORCH_TWINS)
def test_gradients_against_pytorch_with_the_same_weights(kind):
    """The fused gates' backward (fluxpy.ops.lstm_gates / gru_gates, the RNN's bias_act) against torch's autograd:
    the input's, the initial state's and every weight's gradient, float64, with a cotangent on every output and on
    the final state."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    layer, t = _torch_pair(kind, rng)
    x = rng.standard_normal((3, 7, 3))
    h0, c0 = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    dy, dh = rng.standard_normal((3, 7, 5)), rng.standard_normal((3, 5))

    def loss(m, x, h0, c0):
        y, state = m(x, (h0, c0) if kind == "lstm" else h0, return_state=True)
        return (y * dy).sum() + ((state[1] if kind == "lstm" else state) * dh).sum()
    gm, gx, gh0, gc0 = fluxpy.gradient(loss, layer, x, h0, c0)
    tx, th0, tc0 = (torch.tensor(a, requires_grad=True) for a in (x, h0[None], c0[None]))
    y, state = t(tx, (th0, tc0) if kind == "lstm" else th0)
    last = state[1] if kind == "lstm" else state
    ((y * torch.from_numpy(dy)).sum() + (last[0] * torch.from_numpy(dh)).sum()).backward()
    np.testing.assert_allclose(gx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gh0, th0.grad.numpy()[0], rtol=1e-10, atol=1e-12)
    if kind == "lstm":
        np.testing.assert_allclose(gc0, tc0.grad.numpy()[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gm["cell"]["weight_ih"], t.weight_ih_l0.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gm["cell"]["weight_hh"], t.weight_hh_l0.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gm["cell"]["bias"], t.bias_ih_l0.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_second_derivatives_through_the_layers(kind):
    """A Hessian-vector product of each layer by finite differences: a nested gradient runs the gate ops'
    composites, which the outer tape differentiates."""
    from gradcheck import check_second_order
    rng = np.random.default_rng(5)
    layer = fluxpy.f64(MAKERS[kind](2, 3, rng=6))
    layer.cell.bias[...] = rng.standard_normal(layer.cell.bias.shape) * 0.5
    check_second_order(lambda x: layer(x), rng.standard_normal((2, 3, 2)), rng=rng)


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_half_precision_layers_on_the_cpu(kind):
    """bfloat16 and float16 layers: the gates computed in float32 and rounded once, close to float32's."""
    from fluxpy.precision import bf16, f16
    rng = np.random.default_rng(7)
    layer = MAKERS[kind](3, 4, rng=8)
    x = rng.standard_normal((2, 6, 3)).astype(np.float32)
    want = layer(x)
    gwant = fluxpy.gradient(lambda m: m(x).sum(), layer)[0]["cell"]["weight_hh"]
    for convert, tol in ((bf16, 3e-2), (f16, 4e-3)):
        half = convert(layer)
        xh = x.astype(half.cell.weight_ih.dtype)
        y = half(xh)
        assert y.dtype == xh.dtype
        np.testing.assert_allclose(y.astype(np.float32), want, atol=tol)
        g = fluxpy.gradient(lambda m: m(xh).sum(), half)[0]["cell"]["weight_hh"]
        assert g.dtype == xh.dtype
        np.testing.assert_allclose(g.astype(np.float32), gwant, atol=4 * tol * (1 + np.abs(gwant).max()))


def test_gruv3_cell_steps_as_its_layer_and_takes_lengths():
    rng = np.random.default_rng(3)
    layer = fluxpy.f64(GRUv3(3, 4, rng=1))
    layer.cell.bias[...] = rng.standard_normal(12) * 0.5
    x = rng.standard_normal((2, 5, 3))
    h, outs = None, []
    for t in range(5):   # the cell alone, step by step, as the layer runs it
        y, h = layer.cell(x[:, t], h)
        outs.append(y)
    np.testing.assert_allclose(layer(x), np.stack(outs, axis=1), rtol=1e-13)
    y, state = layer(x, lengths=[5, 2], return_state=True)   # the short sequence, alone, gives its own state
    alone, alone_state = layer(x[1:, :2], return_state=True)
    np.testing.assert_allclose(y[1, :2], alone[0], rtol=1e-13)
    np.testing.assert_array_equal(y[1, 2:], 0)
    np.testing.assert_allclose(state[1], alone_state[0], rtol=1e-13)
    assert repr(layer) == "GRUv3(3 => 4)" and repr(layer.cell) == "GRUv3Cell(3 => 4)"
    np.testing.assert_allclose(layer(x), _np_run("gruv3", layer.cell, x)[0], rtol=1e-12)
    check_grad(lambda x: layer(x), x)
    check_grad(lambda w: GRUv3.__call__(_with_weight(layer, w), x), layer.cell.weight_hh)
    with pytest.raises(fluxpy.DimensionMismatch, match=r"GRUv3\(3 => 4\) expects x of shape \(N, T, 3\)"):
        layer(np.ones((2, 5, 4)))
