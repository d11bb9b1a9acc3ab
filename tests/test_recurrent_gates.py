"""The fused gates of a recurrent step (fluxpy.ops.recurrent: lstm_gates, gru_gates) and their NumPy kernels
(fluxpy.kernels.cpu_recurrent): values against the composition of small ops the cells used before, gradients
against float64 finite differences and second order (hypothesis draws hidden sizes, leading shapes and broadcast
states), the kernels against the composites in every dtype they take, the table's choice, errors."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.kernels import cpu_recurrent, find
from fluxpy.ops import gru_gates, lstm_gates, stack
from fluxpy.ops.recurrent import gru_gates_backward, gru_gates_forward, lstm_gates_backward, lstm_gates_forward
from gradcheck import check_grad, check_second_order
from test_half_conv_matmul import BF16


def _sig(v):
    return 1 / (1 + np.exp(-v))


def _lstm_ref(gates, c_prev, gates_h=None):
    """The LSTM cell's gates as the cells composed them before the fused op (PyTorch's order i, f, g, o)."""
    z = gates if gates_h is None else gates + gates_h
    i, f, g, o = np.split(z, 4, axis=-1)
    c = _sig(f) * c_prev + _sig(i) * np.tanh(g)
    return _sig(o) * np.tanh(c), c


def _gru_ref(gi, gh, h_prev):
    n = gi.shape[-1] // 3
    r = _sig(gi[..., :n] + gh[..., :n])
    z = _sig(gi[..., n:2 * n] + gh[..., n:2 * n])
    cand = np.tanh(gi[..., 2 * n:] + r * gh[..., 2 * n:])
    return (1 - z) * cand + z * h_prev


@st.composite
def _lstm_case(draw):
    """Shapes of (gates, c_prev, gates_h or None): a leading shape, each operand's leading axes possibly 1 or
    missing (a state ``(H,)`` for the batch), ``gates_h`` absent or present."""
    hidden = draw(st.integers(1, 4))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))

    def operand(width):
        keep = draw(st.integers(0, len(lead)))
        return tuple(1 if draw(st.booleans()) else s for s in lead[len(lead) - keep:]) + (width,)
    has_h = draw(st.booleans())
    return operand(4 * hidden), operand(hidden), (operand(4 * hidden) if has_h else None)


@st.composite
def _gru_case(draw):
    hidden = draw(st.integers(1, 4))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))

    def operand(width):
        keep = draw(st.integers(0, len(lead)))
        return tuple(1 if draw(st.booleans()) else s for s in lead[len(lead) - keep:]) + (width,)
    return operand(3 * hidden), operand(3 * hidden), operand(hidden)


def _arrays(rng, shapes, scale=1.5):
    return [None if s is None else rng.standard_normal(s) * scale for s in shapes]


@settings(max_examples=20, deadline=None)
@given(_lstm_case(), st.integers(0, 2**16))
def test_lstm_gates_values_and_gradients(shapes, seed):
    rng = np.random.default_rng(seed)
    gates, c_prev, gates_h = _arrays(rng, shapes)
    h, c = lstm_gates(gates, c_prev, gates_h)
    want_h, want_c = _lstm_ref(gates, c_prev, gates_h)
    np.testing.assert_allclose(h, want_h, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(c, want_c, rtol=1e-12, atol=1e-14)
    if gates_h is None:
        f = (lambda g, c: stack(lstm_gates(g, c)))
        args = (gates, c_prev)
    else:
        f = (lambda g, c, gh: stack(lstm_gates(g, c, gh)))
        args = (gates, c_prev, gates_h)
    check_grad(f, *args, rng=rng)
    check_second_order(f, *args, rng=rng)


@settings(max_examples=20, deadline=None)
@given(_gru_case(), st.integers(0, 2**16))
def test_gru_gates_values_and_gradients(shapes, seed):
    rng = np.random.default_rng(seed)
    gi, gh, h_prev = _arrays(rng, shapes)
    np.testing.assert_allclose(gru_gates(gi, gh, h_prev), _gru_ref(gi, gh, h_prev), rtol=1e-12, atol=1e-14)
    check_grad(gru_gates, gi, gh, h_prev, rng=rng)
    check_second_order(gru_gates, gi, gh, h_prev, rng=rng)


def test_only_the_state_needs_a_gradient():
    rng = np.random.default_rng(1)
    gates, c_prev = rng.standard_normal((3, 8)), rng.standard_normal(2)   # one state for the batch
    check_grad(lambda c: stack(lstm_gates(gates, c)), c_prev, rng=rng)
    gi, gh = rng.standard_normal((3, 6)), rng.standard_normal(6)           # one hidden projection for the batch
    check_grad(lambda gh, h: gru_gates(gi, gh, h), gh, rng.standard_normal((3, 2)), rng=rng)
    assert fluxpy.gradient(lambda g: lstm_gates(g, c_prev)[0].sum(), gates)[0].shape == (3, 8)


def test_the_numpy_kernels_are_the_ones_found():
    x = np.zeros((2, 8), np.float32)
    c = np.zeros((2, 2), np.float32)
    assert find("lstm_gates_forward", x, c, None, True) is cpu_recurrent.lstm_gates_forward
    assert find("gru_gates_forward", x[:, :6], x[:, :6], c, True) is cpu_recurrent.gru_gates_forward
    assert find("lstm_gates_forward", x, c.astype(np.float64), None, True) is None   # mixed: the composite
    h, c2 = lstm_gates(x, c.astype(np.float64))
    assert h.dtype == np.float64 and c2.dtype == np.float64
    np.testing.assert_allclose(h, _lstm_ref(x.astype(np.float64), c.astype(np.float64))[0])


def _half(a, dtype):
    return a.astype(np.float32).astype(dtype)


def _f64(a):
    if a is None:
        return None
    return (a.astype(np.float32) if a.dtype == BF16 else a).astype(np.float64)


TOL = {np.dtype(np.float64): 1e-13, np.dtype(np.float32): 2e-6, np.dtype(np.float16): 2e-3, BF16: 1.6e-2}


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("with_h", [True, False], ids=["gates_h", "no_gates_h"])
def test_lstm_kernels_match_the_composites(dtype, with_h):
    rng = np.random.default_rng(2)
    dt = np.dtype(dtype)
    gates, c_prev, gh, dy = (_half(rng.standard_normal(s) * 2, dt) for s in ((5, 24), (6,), (5, 24), (2, 5, 6)))
    gh = gh if with_h else None
    y, act = cpu_recurrent.lstm_gates_forward(gates, c_prev, gh, True)
    assert y.dtype == dt and act.dtype == dt and y.shape == (2, 5, 6) and act.shape == (5, 24)
    y_ref, act_ref = lstm_gates_forward.composite(_f64(gates), _f64(c_prev), _f64(gh), True)
    tol = TOL[dt]
    np.testing.assert_allclose(_f64(y), y_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(_f64(act), act_ref, rtol=tol, atol=tol)
    y2, none = cpu_recurrent.lstm_gates_forward(gates, c_prev, gh, False)
    assert none is None and np.array_equal(_f64(y2), _f64(y))
    dz, dc = cpu_recurrent.lstm_gates_backward(dy, act, y, c_prev)
    assert dz.dtype == dt and dz.shape == (5, 24) and dc.shape == (5, 6)
    dz_ref, dc_ref = lstm_gates_backward.composite(_f64(dy), _f64(act), _f64(y), _f64(c_prev))
    np.testing.assert_allclose(_f64(dz), dz_ref, rtol=4 * tol, atol=4 * tol)
    np.testing.assert_allclose(_f64(dc), dc_ref, rtol=4 * tol, atol=4 * tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BF16], ids=str)
def test_gru_kernels_match_the_composites(dtype):
    rng = np.random.default_rng(3)
    dt = np.dtype(dtype)
    gi, gh, h_prev, dh = (_half(rng.standard_normal(s) * 2, dt) for s in ((5, 18), (18,), (5, 6), (5, 6)))
    h, act = cpu_recurrent.gru_gates_forward(gi, gh, h_prev, True)
    assert h.dtype == dt and act.shape == (5, 24)
    h_ref, act_ref = gru_gates_forward.composite(_f64(gi), _f64(gh), _f64(h_prev), True)
    tol = TOL[dt]
    np.testing.assert_allclose(_f64(h), h_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(_f64(act), act_ref, rtol=tol, atol=tol)
    got = cpu_recurrent.gru_gates_backward(dh, act, h_prev)
    want = gru_gates_backward.composite(_f64(dh), _f64(act), _f64(h_prev))
    for g, w in zip(got, want):
        assert g.dtype == dt and g.shape == w.shape
        np.testing.assert_allclose(_f64(g), w, rtol=4 * tol, atol=4 * tol)


def test_saturated_gates_stay_finite():
    """Pre-activations of +-1000 saturate every gate without overflow warnings or NaNs (exp overflowing to inf
    gives the exact 0 of the sigmoid)."""
    big = np.array([[1000.0, -1000.0, 1000.0, -1000.0]], np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        h, c = lstm_gates(big, np.ones((1, 1), np.float32))
        g = fluxpy.gradient(lambda g: lstm_gates(g, np.ones((1, 1), np.float32))[0].sum(), big)[0]
    assert float(c[0, 0]) == 1.0 and float(h[0, 0]) == 0.0 and np.all(np.isfinite(g))


def test_errors_name_the_op_and_the_shapes():
    with pytest.raises(ValueError, match=r"lstm_gates expects gates \(\.\.\., 4H\).*got \(2, 6\), \(2, 2\)"):
        lstm_gates(np.zeros((2, 6)), np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"lstm_gates expects .*got \(2, 8\), \(3, 2\)"):
        lstm_gates(np.zeros((2, 8)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"lstm_gates expects .*got \(2, 8\), \(2, 2\), \(2, 4\)"):
        lstm_gates(np.zeros((2, 8)), np.zeros((2, 2)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"gru_gates expects gi \(\.\.\., 3H\).*got \(2, 6\), \(2, 6\), \(2, 3\)"):
        gru_gates(np.zeros((2, 6)), np.zeros((2, 6)), np.zeros((2, 3)))
