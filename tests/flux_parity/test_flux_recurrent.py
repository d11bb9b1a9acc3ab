"""Flux.jl's ``test/layers/recurrent.jl`` cases (FluxML/Flux.jl at 3f2f828), in fluxpy, batch first.

Flux's sequence ``(in, len, batch)`` is fluxpy's ``(batch, len, in)`` and an unbatched ``(in, len)`` is ``(len, in)``;
a cell's ``(in, batch)`` step is ``(batch, in)``; states ``(hidden, batch)`` are ``(batch, hidden)`` and a state
``(hidden,)`` serves the whole batch in both. ``RNN(2 => 4)`` is ``RNN(2, 4)``. Flux's ``test_gradients`` (AD
against finite differences) is ``check_grad`` in float64.

Where fluxpy chooses differently: the gates are stacked in PyTorch's order with PyTorch's parameter names
(``weight_ih``, ``weight_hh``, one ``bias``; Flux's ``Wi``, ``Wh``, ``b``), and the time axis is the second (batch
first). fluxpy's ``GRU`` is Flux's ``GRU`` (the reset gate multiplies ``W_hn h``, as PyTorch's); Flux's ``GRUv3``
(the reset gate inside the product, ``W_hn (r h)``) has no fluxpy counterpart, so recurrent.jl:277-331 and the
GRUv3 entries of 333-356 are not translated.
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import GRU, LSTM, RNN, GRUCell, LSTMCell, Recurrence, RNNCell, initialstates
from tests.gradcheck import check_grad


def rand(*shape, seed=0):
    return np.random.default_rng(seed + sum(shape)).random(shape)


def cell_loss1(cell, xs, state):
    for x in xs:
        _, state = cell(x, state)
    return (state[0] if isinstance(state, tuple) else state).mean()


def cell_loss2(cell, xs, state):
    return sum(cell(x, state)[0].mean() for x in xs)


def cell_loss4(cell, xs, state):
    ys = []
    for x in xs:
        y, state = cell(x, state)
        ys.append(y)
    return (fluxpy.stack(ys, axis=-2) ** 2).mean()


def with_params(cell, params):
    clone = object.__new__(type(cell))
    clone.__dict__.update(cell.__dict__, **params)
    return clone


def test_gradients(cell, xs, state, loss):
    """Flux's test_gradients(cell, x, h; loss): every parameter, the inputs and the state, by finite differences."""
    names = [n for n in ("weight_ih", "weight_hh", "bias") if getattr(cell, n) is not None]
    check_grad(lambda *ps: loss(with_params(cell, dict(zip(names, ps))), xs, state),
               *[getattr(cell, n).copy() for n in names])
    if isinstance(state, tuple):
        check_grad(lambda h, c: loss(cell, xs, (h, c)), *state)
    else:
        check_grad(lambda h: loss(cell, xs, h), state)
    check_grad(lambda *xs: loss(cell, list(xs), state), *xs)


test_gradients.__test__ = False   # a helper, not a test


def test_rnn_cell():
    # recurrent.jl:35-72
    r = fluxpy.f64(RNNCell(3, 5, rng=0))
    assert len(fluxpy.trainables(r)) == 3
    xs = [rand(4, 3, seed=i) for i in range(6)]       # a sequence of 6 steps, batch 4
    h = rand(5)                                        # a single vector state
    for loss in (cell_loss1, cell_loss2, cell_loss4):
        test_gradients(r, xs, h, loss)
    np.testing.assert_array_equal(initialstates(r), np.zeros(5))
    out, state = r(xs[0])
    assert out is state
    np.testing.assert_allclose(out, r(xs[0], np.zeros(5))[0], rtol=1e-15)
    test_gradients(r, xs, rand(4, 5), cell_loss4)      # a batched state
    xs1 = [rand(3, seed=i) for i in range(6)]          # no batch axis
    y, s = r(xs1[0], h)
    assert y.shape == (5,) and s.shape == (5,)
    test_gradients(r, xs1, h, cell_loss4)
    r = fluxpy.f64(RNNCell(3, 5, bias=False, rng=0))   # no bias
    assert len(fluxpy.trainables(r)) == 2 and repr(r) == "RNNCell(3 => 5, tanh, bias=False)"
    test_gradients(r, xs1, h, cell_loss4)


def test_rnn():
    # recurrent.jl:74-115 (Flux's ModelRNN holds h0 as a parameter: here a zero h0 passed in)
    rnn = fluxpy.f64(RNN(2, 4, rng=0))
    h0 = np.zeros(4)
    x = rand(1, 3, 2)
    y = rnn(x, h0)
    assert y.shape == (1, 3, 4) and y.dtype == np.float64
    check_grad(lambda x, h0: rnn(x, h0), x, h0 + 0.1)
    np.testing.assert_array_equal(initialstates(rnn), np.zeros(4))
    np.testing.assert_allclose(rnn(x), rnn(x, np.zeros(4)), rtol=1e-15)
    x = rand(3, 2)                                     # unbatched: (len, in)
    y = rnn(x, h0)
    assert y.shape == (3, 4)
    np.testing.assert_allclose(y, rnn(x[None])[0], rtol=1e-15)
    check_grad(lambda x: rnn(x, h0), x)
    rnn = fluxpy.f64(RNN(2, 4, return_state=True, rng=0))
    y, last = rnn(rand(1, 3, 2), h0)
    assert y.shape == (1, 3, 4) and last.shape == (1, 4) and repr(rnn) == "RNN(2 => 4, tanh, return_state=True)"


def test_lstm_cell():
    # recurrent.jl:117-152
    cell = fluxpy.f64(LSTMCell(3, 5, rng=0))
    assert len(fluxpy.trainables(cell)) == 3
    xs = [rand(4, 3, seed=i) for i in range(6)]
    h, c = np.zeros((4, 5)), np.zeros((4, 5))
    out, (hnew, cnew) = cell(xs[0], (h, c))
    assert out is hnew and hnew.shape == (4, 5) and cnew.shape == (4, 5)
    check_grad(lambda w: cell_loss2(with_params(cell, {"weight_ih": w}), xs[:1], (h, c)), cell.weight_ih.copy())
    test_gradients(cell, xs, (h + 0.1, c - 0.1), cell_loss4)
    h0, c0 = initialstates(cell)
    assert (h0 == 0).all() and (c0 == 0).all() and h0.shape == (5,)
    _, (h1, c1) = cell(xs[0])
    _, (h2, c2) = cell(xs[0], (np.zeros(5), np.zeros(5)))
    np.testing.assert_allclose(h1, h2, rtol=1e-15)
    np.testing.assert_allclose(c1, c2, rtol=1e-15)
    assert len(fluxpy.trainables(LSTMCell(3, 5, bias=False))) == 2


def test_lstm():
    # recurrent.jl:154-198
    lstm = fluxpy.f64(LSTM(2, 4, rng=0))
    h0, c0 = np.zeros(4), np.zeros(4)
    x = rand(1, 3, 2)
    y = lstm(x, (h0, c0))
    assert y.shape == (1, 3, 4)
    check_grad(lambda x: lstm(x, (h0, c0)), x)
    x = rand(3, 2)
    y = lstm(x, (h0, c0))
    assert y.shape == (3, 4)
    check_grad(lambda x: lstm(x, (h0, c0))[0].mean(), x)
    assert lstm(x).shape == (3, 4)
    h0, c0 = initialstates(lstm)
    assert (h0 == 0).all() and (c0 == 0).all() and h0.shape == (4,)
    np.testing.assert_allclose(lstm(x), lstm(x, (np.zeros(4), np.zeros(4))), rtol=1e-15)
    lstm = fluxpy.f64(LSTM(2, 4, return_state=True, rng=0))
    y, (h, c) = lstm(rand(1, 3, 2), (np.zeros(4), np.zeros(4)))
    assert y.shape == (1, 3, 4) and h.shape == (1, 4) and c.shape == (1, 4)


def test_gru_cell():
    # recurrent.jl:199-228
    r = fluxpy.f64(GRUCell(3, 5, rng=0))
    assert len(fluxpy.trainables(r)) == 3
    xs = [rand(4, 3, seed=i) for i in range(6)]
    h = rand(5)
    out, state = r(xs[0], h)
    assert out is state
    test_gradients(r, xs, h, cell_loss4)
    np.testing.assert_array_equal(initialstates(r), np.zeros(5))
    np.testing.assert_allclose(r(xs[0])[0], r(xs[0], np.zeros(5))[0], rtol=1e-15)
    test_gradients(r, xs, rand(4, 5), cell_loss4)
    xs1 = [rand(3, seed=i) for i in range(6)]
    test_gradients(r, xs1, h, cell_loss4)
    assert len(fluxpy.trainables(GRUCell(3, 5, bias=False))) == 2


def test_gru():
    # recurrent.jl:230-275
    gru = fluxpy.f64(GRU(2, 4, rng=0))
    x = rand(1, 3, 2)
    y = gru(x, np.zeros(4))
    assert y.shape == (1, 3, 4)
    check_grad(lambda x: gru(x, np.zeros(4)), x)
    np.testing.assert_array_equal(initialstates(gru), np.zeros(4))
    np.testing.assert_allclose(gru(x), gru(x, np.zeros(4)), rtol=1e-15)
    nob = fluxpy.f64(GRU(2, 4, bias=False, rng=0))
    assert len(fluxpy.trainables(nob)) == 2
    check_grad(lambda x: nob(x), x)
    gru = fluxpy.f64(GRU(2, 4, return_state=True, rng=0))
    y, last = gru(rand(1, 3, 2), np.zeros(4))
    assert y.shape == (1, 3, 4) and last.shape == (1, 4)


@pytest.mark.parametrize("make", [RNN, LSTM, GRU], ids=["RNN", "LSTM", "GRU"])
def test_recurrence(make):
    # recurrent.jl:333-356 (RNN, LSTM, GRU; not GRUv3)
    x = rand(4, 3, 2).astype(np.float32)               # Flux's (2, 3, 4)
    rnn = make(2, 3, rng=0)
    np.testing.assert_allclose(Recurrence(rnn.cell)(x), rnn(x), rtol=1e-6)
    rnn = make(2, 3, return_state=True, rng=0)
    rec = Recurrence(rnn.cell, return_state=True)
    (y1, s1), (y2, s2) = rec(x), rnn(x)
    np.testing.assert_allclose(y1, y2, rtol=1e-6)
    for a, b in zip(s1 if isinstance(s1, tuple) else (s1,), s2 if isinstance(s2, tuple) else (s2,)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_unbatched_and_vector_state_against_torch():
    torch = pytest.importorskip("torch")
    # PyTorch takes an unbatched (L, in) sequence too, with an (1, hidden) state: the same numbers
    lstm = fluxpy.f64(LSTM(3, 4, rng=2))
    t = torch.nn.LSTM(3, 4).double()
    with torch.no_grad():
        t.weight_ih_l0.copy_(torch.from_numpy(lstm.cell.weight_ih))
        t.weight_hh_l0.copy_(torch.from_numpy(lstm.cell.weight_hh))
        t.bias_ih_l0.copy_(torch.from_numpy(lstm.cell.bias))
        t.bias_hh_l0.zero_()
    x = rand(5, 3)
    h0, c0 = rand(4, seed=1), rand(4, seed=2)
    ty, (th, tc) = t(torch.tensor(x), (torch.tensor(h0)[None], torch.tensor(c0)[None]))
    y, (h, c) = lstm(x, (h0, c0), return_state=True)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-13)
    np.testing.assert_allclose(c, tc.detach().numpy()[0], rtol=1e-13)
    yb = lstm(np.stack([x, x]), (h0, c0))              # a vector state serves every batch entry
    np.testing.assert_allclose(yb[1], ty.detach().numpy(), rtol=1e-13)
