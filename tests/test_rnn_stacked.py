"""Recurrent layers as one op (fluxpy.ops.rnn.rnn) with num_layers and bidirectional: against PyTorch's nn.RNN,
nn.LSTM and nn.GRU with the same weights (outputs, final states, every gradient; float64, hypothesis draws sizes,
layers and directions), the composite against float64 finite differences (first and second order), the
one-layer op path against the step loop it replaced, state I/O (fluxpy's files, PyTorch's state dicts), and the
errors, which name the layer or the op."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import GRU, LSTM, RNN, GRUCell, LSTMCell, Recurrence, RNNCell
from fluxpy.ops.rnn import RNNDims, rnn
from fluxpy.torch_state import load_torch_state, to_torch_state
from gradcheck import check_grad, check_second_order

KINDS = ("rnn", "rnn_relu", "lstm", "gru")


def _layer(kind, n_in, hidden, **kw):
    if kind.startswith("rnn"):
        return RNN(n_in, hidden, fluxpy.relu if kind == "rnn_relu" else fluxpy.tanh, **kw)
    return {"lstm": LSTM, "gru": GRU}[kind](n_in, hidden, **kw)


def _torch_twin(torch, kind, n_in, hidden, layers, bidirectional, rng):
    """A float64 torch module of ``kind`` with random biases (a GRU's ``b_hn`` zero: fluxpy's GRU has none)."""
    if kind.startswith("rnn"):
        t = torch.nn.RNN(n_in, hidden, layers, nonlinearity="relu" if kind == "rnn_relu" else "tanh",
                         batch_first=True, bidirectional=bidirectional)
    else:
        t = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](n_in, hidden, layers, batch_first=True,
                                                               bidirectional=bidirectional)
    t = t.double()
    with torch.no_grad():
        for name, p in t.named_parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * 0.5))
            if kind == "gru" and name.startswith("bias_hh"):
                p[2 * hidden:] = 0
    return t


def _cell_gradient(grads, k):
    return grads["cell"] if k == 0 else grads["stacked"][k - 1]


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(KINDS), layers=st.integers(1, 3), bidirectional=st.booleans(), n=st.integers(1, 3),
       steps=st.integers(1, 4), n_in=st.integers(1, 4), hidden=st.integers(1, 4), given_state=st.booleans(),
       seed=st.integers(0, 2**16))
def test_against_pytorch(kind, layers, bidirectional, n, steps, n_in, hidden, given_state, seed):
    """Outputs, final states and the gradients of x, the initial states and every weight against torch's
    autograd, float64, a random cotangent on the outputs and on each final state; the weights go in through
    load_torch_state (PyTorch's two biases summed)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    t = _torch_twin(torch, kind, n_in, hidden, layers, bidirectional, rng)
    layer = fluxpy.f64(_layer(kind, n_in, hidden, num_layers=layers, bidirectional=bidirectional, rng=seed))
    load_torch_state(layer, t.state_dict())
    d = 2 if bidirectional else 1
    x = rng.standard_normal((n, steps, n_in))
    h0, c0 = rng.standard_normal((layers * d, n, hidden)), rng.standard_normal((layers * d, n, hidden))
    dy, dh, dc = (rng.standard_normal(s) for s in ((n, steps, d * hidden), h0.shape, c0.shape))
    lstm = kind == "lstm"
    stacked = layers > 1 or bidirectional
    if not stacked:   # the one-layer layer takes and gives states (N, H), as the cells do
        h0, c0, dh, dc = h0[0], c0[0], dh[0], dc[0]

    def loss(m, x, h0, c0):
        state = ((h0, c0) if lstm else h0) if given_state else None
        y, s = m(x, state, return_state=True)
        h, c = s if lstm else (s, None)
        return (y * dy).sum() + (h * dh).sum() + ((c * dc).sum() if lstm else 0)
    (value, (gm, gx, gh0, gc0)) = fluxpy.withgradient(loss, layer, x, h0, c0)

    tx = torch.tensor(x, requires_grad=True)
    th0, tc0 = (torch.tensor(s if stacked else s[None], requires_grad=True) for s in (h0, c0))
    tstate = ((th0, tc0) if lstm else th0) if given_state else None
    y, s = t(tx, tstate)
    th, tc = s if lstm else (s, None)
    squeeze = (lambda a: a if stacked else a[0])
    want = (y * torch.from_numpy(dy)).sum() + (squeeze(th) * torch.from_numpy(dh)).sum()
    if lstm:
        want = want + (squeeze(tc) * torch.from_numpy(dc)).sum()
    want.backward()
    close = dict(rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(value, want.item(), **close)
    np.testing.assert_allclose(gx, tx.grad.numpy(), **close)
    if given_state:
        np.testing.assert_allclose(gh0, squeeze(th0.grad.numpy()), **close)
        if lstm:
            np.testing.assert_allclose(gc0, squeeze(tc0.grad.numpy()), **close)
    for k in range(layers * d):
        suffix = f"_l{k // d}" + ("_reverse" if k % d else "")
        g = _cell_gradient(gm, k)
        for mine, theirs in (("weight_ih", "weight_ih"), ("weight_hh", "weight_hh"), ("bias", "bias_ih")):
            np.testing.assert_allclose(g[mine], getattr(t, theirs + suffix).grad.numpy(), **close,
                                       err_msg=f"{mine} of layer-and-direction {k} ({theirs}{suffix})")


@pytest.mark.parametrize("kind", KINDS)
def test_forward_against_pytorch_in_float32(kind):
    """The default dtype: a 2-layer bidirectional layer against torch's, float32 tolerances."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    t = _torch_twin(torch, kind, 3, 5, 2, True, rng).float()
    layer = _layer(kind, 3, 5, num_layers=2, bidirectional=True, rng=1)
    load_torch_state(layer, t.state_dict())
    x = rng.standard_normal((4, 6, 3)).astype(np.float32)
    y, s = layer(x, return_state=True)
    ty, ts = t(torch.from_numpy(x))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s[0] if kind == "lstm" else s, (ts[0] if kind == "lstm" else ts).detach().numpy(),
                               rtol=1e-4, atol=1e-5)
    assert y.dtype == np.float32


def _weights(rng, dims):
    return [tuple(rng.standard_normal(s) * 0.6 for s in dims.weight_shapes(k)) + ((None,) if not dims.bias else ())
            for k in range(dims.num_layers * dims.directions)]


@settings(max_examples=15, deadline=None)
@given(mode=st.sampled_from(("rnn", "lstm", "gru")), layers=st.integers(1, 2), bidirectional=st.booleans(),
       bias=st.booleans(), steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_composite_gradients_by_finite_differences(mode, layers, bidirectional, bias, steps, seed):
    """The composite's gradient of x, h0, c0 and every weight, float64 central differences (the RNN with a
    softsign activation: an activation cuDNN has not, which only the composite runs)."""
    rng = np.random.default_rng(seed)
    n, n_in, hidden = 2, 3, 2
    dims = RNNDims(mode, n, steps, n_in, hidden, layers, bidirectional, bias, np.dtype(np.float64))
    w = _weights(rng, dims)
    flat = [a for triple in w for a in triple if a is not None]
    per = 3 if bias else 2
    x, h0, c0 = rng.standard_normal((n, steps, n_in)), rng.standard_normal(dims.state_shape), \
        rng.standard_normal(dims.state_shape)
    act = fluxpy.softsign if mode == "rnn" else None

    def f(x, h0, c0, *flat):
        triples = [tuple(flat[k * per:(k + 1) * per]) + ((None,) if not bias else ())
                   for k in range(len(flat) // per)]
        y, h, c = rnn(x, triples, h0, c0 if mode == "lstm" else None, mode=mode, act=act, num_layers=layers,
                      bidirectional=bidirectional)
        return fluxpy.ops.concatenate([fluxpy.ops.reshape(y, (-1,)), fluxpy.ops.reshape(h, (-1,))] +
                                      ([fluxpy.ops.reshape(c, (-1,))] if c is not None else []))
    grads = check_grad(f, x, h0, c0, *flat, rng=rng)
    assert grads[2] is None or mode == "lstm"


def test_composite_second_order():
    """A nested gradient differentiates the composite (its pullback is made of fluxpy ops)."""
    rng = np.random.default_rng(3)
    dims = RNNDims("lstm", 2, 3, 2, 2, 1, True, True, np.dtype(np.float64))
    w = _weights(rng, dims)
    flat = [a for triple in w for a in triple]

    def f(x, *flat):
        triples = [tuple(flat[k * 3:(k + 1) * 3]) for k in range(len(flat) // 3)]
        return rnn(x, triples, mode="lstm", bidirectional=True)[0]
    check_second_order(f, rng.standard_normal((2, 3, 2)), *flat, rng=rng)


@pytest.mark.parametrize("cell_type", (RNNCell, LSTMCell, GRUCell))
def test_one_layer_op_path_equals_the_step_loop(cell_type):
    """A one-layer layer over a batch (one op) against Recurrence of the same cell (the step loop): outputs, final
    state and gradients, float64; a state of shape (hidden,) serves every sequence in both."""
    rng = np.random.default_rng(11)
    layer = fluxpy.f64({RNNCell: RNN, LSTMCell: LSTM, GRUCell: GRU}[cell_type](3, 4, rng=5))
    loop = Recurrence(layer.cell, return_state=True)
    x = rng.standard_normal((2, 5, 3))
    h = rng.standard_normal(4)
    state = (h, rng.standard_normal((2, 4))) if cell_type is LSTMCell else h

    def loss(m, x):
        y, s = m(x, state, return_state=True)
        last = s[1] if cell_type is LSTMCell else s
        return (y * y).sum() + (last * 3).sum()
    v1, g1 = fluxpy.withgradient(loss, layer, x)
    v2, g2 = fluxpy.withgradient(loss, loop, x)
    np.testing.assert_allclose(v1, v2, rtol=1e-12)
    np.testing.assert_allclose(g1[1], g2[1], rtol=1e-10, atol=1e-12)
    for name in ("weight_ih", "weight_hh", "bias"):
        np.testing.assert_allclose(g1[0]["cell"][name], g2[0]["cell"][name], rtol=1e-10, atol=1e-12)


def test_reverse_direction_is_the_forward_of_the_flipped_sequence():
    """Layer 0's reverse direction is its cell run over the time-reversed input, outputs flipped back."""
    rng = np.random.default_rng(5)
    layer = fluxpy.f64(GRU(3, 4, bidirectional=True, rng=2))
    x = rng.standard_normal((2, 6, 3))
    y, h = layer(x, return_state=True)
    back = Recurrence(layer.stacked[0], return_state=True)
    yb, hb = back(x[:, ::-1].copy())
    np.testing.assert_allclose(y[:, :, 4:], yb[:, ::-1], rtol=1e-12)
    np.testing.assert_allclose(h[1], hb, rtol=1e-12)


def test_parameters_state_and_files(tmp_path):
    """Stacked cells are children: trainables, fluxpy's files and PyTorch's state dicts (keys in PyTorch's names and
    order) carry every one."""
    lstm = LSTM(3, 4, num_layers=2, bidirectional=True, rng=0)
    assert len(fluxpy.trainables(lstm)) == 4 * 3
    assert [c.weight_ih.shape for c in (lstm.cell,) + lstm.stacked] == [(16, 3), (16, 3), (16, 8), (16, 8)]
    path = tmp_path / "lstm.npz"
    fluxpy.save(path, lstm)
    other = fluxpy.load(path, LSTM(3, 4, num_layers=2, bidirectional=True, rng=1))
    for a, b in zip(fluxpy.trainables(lstm), fluxpy.trainables(other)):
        np.testing.assert_array_equal(a, b)
    state = to_torch_state(lstm)
    suffixes = ["_l0", "_l0_reverse", "_l1", "_l1_reverse"]
    assert list(state) == [f"{p}{s}" for s in suffixes for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    fresh = LSTM(3, 4, num_layers=2, bidirectional=True, rng=3)
    keys = load_torch_state(fresh, state)
    assert keys["weight_hh_l1_reverse"] == "stacked.2.weight_hh"
    np.testing.assert_array_equal(fresh.stacked[2].bias, lstm.stacked[2].bias)
    x = np.ones((2, 3, 3), np.float32)
    np.testing.assert_allclose(fresh(x), lstm(x), rtol=1e-6)


def test_pytorch_state_dict_keys_match():
    torch = pytest.importorskip("torch")
    t = torch.nn.GRU(3, 4, num_layers=3, bidirectional=True, batch_first=True)
    assert list(to_torch_state(GRU(3, 4, num_layers=3, bidirectional=True))) == list(t.state_dict())
    with torch.no_grad():
        for name, p in t.named_parameters():
            if name.startswith("bias_hh"):
                p[8:] = 0
    load_torch_state(GRU(3, 4, num_layers=3, bidirectional=True), t.state_dict())
    with torch.no_grad():
        t.bias_hh_l2_reverse[9] = 1.0
    with pytest.raises(ValueError, match=r"bias_hh_l2_reverse\[8:\] is not zero"):
        load_torch_state(GRU(3, 4, num_layers=3, bidirectional=True), t.state_dict())


def test_layer_errors():
    with pytest.raises(ValueError, match="LSTM: dropout between layers"):
        LSTM(3, 4, num_layers=2, dropout=0.5)
    with pytest.raises(ValueError, match="num_layers"):
        GRU(3, 4, num_layers=0)
    with pytest.raises(ValueError, match="bidirectional must be True or False"):
        RNN(3, 4, bidirectional=1)
    lstm = LSTM(3, 4, num_layers=2)
    x = np.ones((2, 5, 3), np.float32)
    with pytest.raises(ValueError, match=r"lengths= is taken by one-layer, one-direction layers only"):
        lstm(x, lengths=[5, 3])
    with pytest.raises(fluxpy.DimensionMismatch, match=r"LSTM\(3 => 4, num_layers=2\) expects x of shape \(N, T, 3\)"):
        lstm(np.ones((2, 5, 2), np.float32))
    with pytest.raises(fluxpy.DimensionMismatch, match=r"\(num_layers \* directions, hidden\) = \(2, 4\)"):
        lstm(x[0], (np.zeros((2, 2, 4), np.float32), np.zeros((2, 4), np.float32)))
    with pytest.raises(fluxpy.DimensionMismatch, match=r"\(num_layers \* directions, N, hidden\) = \(2, 2, 4\)"):
        lstm(x, (np.zeros((1, 2, 4), np.float32), np.zeros((2, 2, 4), np.float32)))
    with pytest.raises(fluxpy.DimensionMismatch, match=r"as a pair \(h, c\)"):
        lstm(x, np.zeros((2, 2, 4), np.float32))
    with pytest.raises(fluxpy.DTypeMismatch):
        GRU(3, 4, bidirectional=True)(np.ones((2, 5, 3)))
    with pytest.raises(fluxpy.DimensionMismatch, match="T >= 1"):
        RNN(3, 4, num_layers=2)(np.ones((2, 0, 3), np.float32))


def test_op_errors():
    rng = np.random.default_rng(0)
    dims = RNNDims("lstm", 2, 3, 3, 4, 2, False, True, np.dtype(np.float64))
    w = _weights(rng, dims)
    x = rng.standard_normal((2, 3, 3))
    with pytest.raises(ValueError, match=r"rnn expects 2 \(w_ih, w_hh, bias\) triples"):
        rnn(x, w[:1], mode="lstm", num_layers=2)
    with pytest.raises(ValueError, match=r"weights\[1\].w_ih of shape \(16, 4\)"):
        rnn(x, [w[0], (w[0][0], w[1][1], w[1][2])], mode="lstm", num_layers=2)
    with pytest.raises(ValueError, match=r"h0 of shape .* = \(2, 2, 4\)"):
        rnn(x, w, np.zeros((2, 4)), mode="lstm", num_layers=2)
    with pytest.raises(ValueError, match="mode must be one of"):
        rnn(x, w, mode="peephole", num_layers=2)
    with pytest.raises(ValueError, match="c0 is an LSTM's cell state"):
        rnn(x, [(np.zeros((4, 3)), np.zeros((4, 4)), None)], c0=np.zeros((1, 2, 4)), mode="rnn")
    with pytest.raises(ValueError, match=r"rnn expects x of shape \(N, T, in\)"):
        rnn(x[0], w, mode="lstm", num_layers=2)
    y, h, c = rnn(x[:0], w, mode="lstm", num_layers=2)   # an empty batch is no error
    assert y.shape == (0, 3, 4) and h.shape == c.shape == (2, 0, 4)


def test_the_kernel_path_plumbing_with_a_stand_in_kernel():
    """The op's kernel path (one output buffer split into y, h_n, c_n; the pullback's gradients in the order of
    x, h0, c0 and the weights; the needs mask; the device lengths) with NumPy stand-ins for cuDNN's calls that
    compute the composite: the same values and gradients as the composite itself."""
    from fluxpy import kernels
    from fluxpy.ops import rnn as rnn_module
    calls = []

    def triples(dims, flat):
        per = 3 if dims.bias else 2
        return [tuple(flat[k * per:(k + 1) * per]) + ((None,) if not dims.bias else ())
                for k in range(len(flat) // per)]

    def flat_out(dims, y, h, c):
        segments = dims.segments
        out = np.full(segments[-1][1] if segments[-1] else segments[1][1], np.nan)
        for seg, a in zip(segments, (y, h, c)):
            if seg is not None:
                out[seg[0]:seg[1]] = np.ravel(a)
        return out

    def forward(dims, lengths, x, h0, c0, flat, training):
        assert lengths.dtype == np.int32 and lengths.tolist() == [dims.steps] * dims.batch
        calls.append(("forward", training))
        y, h, c = rnn_module._composite(dims, None, x, triples(dims, flat), h0, c0)
        return flat_out(dims, y, h, c), ("saved",) if training else None

    def backward(dims, lengths, saved, x, h0, c0, flat, out, dout, needs):
        assert saved == ("saved",) and np.isnan(out).any() == (dims.segments[1][0] > dims.segments[0][1])
        calls.append(("backward", tuple(needs)))

        def f(x, h0, c0, *flat):
            y, h, c = rnn_module._composite(dims, None, x, triples(dims, flat), h0, c0)
            pieces = [fluxpy.ops.reshape(a, (-1,)) * dout[s[0]:s[1]] for a, s in zip((y, h, c), dims.segments)
                      if s is not None]
            return sum(p.sum() for p in pieces)
        grads = fluxpy.gradient(f, x, h0, c0, *flat)
        return tuple(g if need else None for g, need in zip(grads, needs))

    rng = np.random.default_rng(9)
    dims = RNNDims("lstm", 3, 4, 2, 3, 2, True, True, np.dtype(np.float64))
    w = _weights(rng, dims)
    x, h0, c0 = rng.standard_normal((3, 4, 2)), rng.standard_normal(dims.state_shape), \
        rng.standard_normal(dims.state_shape)
    dy, dh = rng.standard_normal(dims.y_shape), rng.standard_normal(dims.state_shape)

    def loss(x, h0, c0, w):
        y, h, c = rnn(x, w, h0, c0, mode="lstm", num_layers=2, bidirectional=True)
        return (y * dy).sum() + (h * dh).sum() + c.sum()
    want = fluxpy.withgradient(loss, x, h0, c0, w)
    table = kernels.snapshot()
    try:
        kernels.register("rnn_forward", "numpy", forward, lambda dims, *arrays: dims.mode == "lstm")
        kernels.register("rnn_backward", "numpy", backward)
        got = fluxpy.withgradient(loss, x, h0, c0, w)
        plain = rnn(x, w, h0, c0, mode="lstm", num_layers=2, bidirectional=True)
    finally:
        kernels.restore(table)
    assert calls == [("forward", True), ("backward", (True,) * 3 + (True,) * 12), ("forward", False)]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    for g, w_ in zip(got[1][:3], want[1][:3]):   # x, h0, c0
        np.testing.assert_allclose(g, w_, rtol=1e-10, atol=1e-12)
    for k in range(4):                             # each layer-and-direction's weights
        for a, b in zip(got[1][3][k], want[1][3][k]):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(plain[0], rnn_module._composite(dims, None, x, w, h0, c0)[0], rtol=1e-12)



@pytest.mark.parametrize("kind", ("lstm", "gru"))
def test_an_unbatched_sequence_through_a_stacked_layer_is_a_batch_of_one(kind):
    """PyTorch's unbatched input: x (T, in), states (num_layers * directions, H)."""
    rng = np.random.default_rng(8)
    layer = fluxpy.f64(_layer(kind, 3, 4, num_layers=2, bidirectional=True, rng=1))
    x, h0, c0 = rng.standard_normal((5, 3)), rng.standard_normal((4, 4)), rng.standard_normal((4, 4))
    state = (h0, c0) if kind == "lstm" else h0
    batched = (h0[:, None], c0[:, None]) if kind == "lstm" else h0[:, None]
    y, s = layer(x, state, return_state=True)
    yb, sb = layer(x[None], batched, return_state=True)
    assert y.shape == (5, 8)
    np.testing.assert_allclose(y, yb[0], rtol=1e-12)
    for a, b in zip(s if kind == "lstm" else (s,), sb if kind == "lstm" else (sb,)):
        assert a.shape == (4, 4)
        np.testing.assert_allclose(a, b[:, 0], rtol=1e-12)
    check_grad(lambda x, h0: layer(x, (h0, c0) if kind == "lstm" else h0), x, h0, rng=rng)


@pytest.mark.parametrize("make, call", [
    (lambda: GRU(3, 4, rng=0), {}),                                          # one op
    (lambda: LSTM(3, 4, num_layers=2, bidirectional=True, rng=1), {}),       # one op, stacked
    (lambda: GRU(3, 4, rng=2), {"lengths": [5, 2]}),                         # the step loop
    (lambda: RNN(3, 4, rng=3), {"return_state": True}),
])
def test_float32_weights_take_a_half_input_as_the_half_layer_would(make, call):
    """A whole-sequence layer with float32 weights (MixedPrecision's masters) takes a float16 input and its
    states: the output in float16, equal to the layer converted to float16 on that input, and the weights'
    gradients in float32, equal to the float16 layer's converted."""
    layer = make()
    half = fluxpy.f16(layer)
    x = np.random.default_rng(4).standard_normal((2, 5, 3)).astype(np.float16)
    out, want = layer(x, **call), half(x, **call)
    flat = (lambda v: [a for item in v for a in flat(item)] if isinstance(v, tuple) else [v])
    for a, b in zip(flat(out), flat(want)):
        assert a.dtype == np.float16
        np.testing.assert_array_equal(a, b)

    def loss(m):
        y = m(x, **call)
        y = y[0] if isinstance(y, tuple) else y
        return (y.astype(np.float32) ** 2).sum()
    (g,), (gh,) = fluxpy.gradient(loss, layer), fluxpy.gradient(loss, half)
    pairs = list(zip(fluxpy.trainables(g), fluxpy.trainables(gh)))
    assert pairs
    for a, b in pairs:
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b.astype(np.float32), rtol=1e-3, atol=1e-3)
