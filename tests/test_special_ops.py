"""erf (fluxpy.ops.special), gelu_erf, rrelu (fluxpy.ops.activations) and logsumexp (fluxpy.ops.softmax): values
against math.erf / SciPy / PyTorch 2.13 in float64, gradients against float64 finite differences under hypothesis
(first and second order), dual numbers, fused bias_act and the error messages."""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import Dense, gradient
from fluxpy.ops.activations import gelu, gelu_erf, leakyrelu, rrelu
from fluxpy.ops.softmax import logsumexp, softmax
from fluxpy.ops.special import erf, erf_composite
from gradcheck import check_grad, check_second_order
from strategies import axes_for, shapes

seeds = st.integers(0, 2**31 - 1)


def _math_erf(x):
    return np.vectorize(math.erf)(x)


# ---------------------------------------------------------------------------------------------
# erf


@pytest.mark.parametrize("path", ["op", "composite"])
def test_erf_matches_math_erf_on_both_branches(path):
    f = erf if path == "op" else erf_composite
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-2, 2, 5000), rng.uniform(-30, 30, 5000), [0.0, 2.0, -2.0, 1e-310, -5.9, 6.1]])
    # the op runs SciPy's kernel where SciPy is installed, else the composite: 1e-15 relative either way
    np.testing.assert_allclose(f(x), _math_erf(x), rtol=1e-15, atol=0)
    y = f(np.array([np.inf, -np.inf, np.nan]))
    assert y[0] == 1.0 and y[1] == -1.0 and np.isnan(y[2])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_erf_keeps_the_float_dtype(dtype):
    x = np.linspace(-4, 4, 101).astype(dtype)
    for f in (erf, erf_composite):
        y = f(x)
        assert y.dtype == dtype
        tol = {np.float32: 3e-7}.get(dtype, 8e-3)
        np.testing.assert_allclose(y.astype(np.float64), _math_erf(x.astype(np.float64)), atol=tol)


def test_erf_of_integers_and_python_numbers():
    assert erf(np.array([1, 2])).dtype == np.float64
    assert float(erf(1)) == pytest.approx(math.erf(1.0), rel=1e-15)
    assert gradient(lambda x: erf(x).sum(), np.array([0.0]))[0][0] == pytest.approx(2 / math.sqrt(math.pi))


@given(shape=shapes(0, 3), seed=seeds)
def test_erf_gradients(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2
    check_grad(erf, x, rng=rng)
    check_second_order(erf, x, rng=rng)


def test_erf_through_dual_numbers_and_broadcast():
    x = np.linspace(-3, 3, 7)
    g = gradient(lambda x: fluxpy.broadcast(lambda z: erf(z) * z, x).sum(), x)[0]
    expected = _math_erf(x) + x * 2 / math.sqrt(math.pi) * np.exp(-x * x)
    np.testing.assert_allclose(g, expected, rtol=1e-14)


# ---------------------------------------------------------------------------------------------
# gelu_erf


def test_gelu_erf_against_torch_in_float64():
    torch = pytest.importorskip("torch")
    x = np.concatenate([np.linspace(-12, 12, 241), [-40.0, 40.0, 0.0]])
    t = torch.tensor(x, requires_grad=True)
    y = torch.nn.functional.gelu(t)                  # PyTorch's default: approximate="none", the erf form
    (g,) = torch.autograd.grad(y.sum(), t, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), t)
    # 1 + erf(x / sqrt(2)) cancels for x < 0 in both libraries: a few ulp of 1 apart there
    np.testing.assert_allclose(gelu_erf(x), y.detach().numpy(), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(gradient(lambda x: gelu_erf(x).sum(), x)[0], g.detach().numpy(), rtol=1e-14,
                               atol=1e-15)
    hess = gradient(lambda x: gradient(lambda z: gelu_erf(z).sum(), x)[0].sum(), x)[0]
    np.testing.assert_allclose(hess, h.numpy(), rtol=1e-13, atol=1e-15)


def test_gelu_is_the_tanh_form_and_gelu_erf_the_exact_one():
    torch = pytest.importorskip("torch")
    x = np.linspace(-5, 5, 101)
    np.testing.assert_allclose(gelu(x), torch.nn.functional.gelu(torch.tensor(x), approximate="tanh").numpy(),
                               rtol=1e-14, atol=1e-15)
    assert 1e-4 < np.abs(gelu(x) - gelu_erf(x)).max() < 1e-3


@given(shape=shapes(0, 3), seed=seeds)
def test_gelu_erf_gradients(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3
    check_grad(gelu_erf, x, rng=rng)
    check_second_order(gelu_erf, x, rng=rng)


def test_dense_with_gelu_erf_against_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    m = fluxpy.f64(Dense(4, 3, gelu_erf, rng=0))
    x = rng.standard_normal((5, 4))
    lin = torch.nn.Linear(4, 3).double()
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(m.weight))
        lin.bias.copy_(torch.tensor(m.bias))
    tx = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.gelu(lin(tx))
    ct = rng.standard_normal(ty.shape)
    ty.backward(torch.tensor(ct))
    y, back = fluxpy.pullback(lambda m, x: m(x), m, x)
    gm, gx = back(ct)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-13)
    np.testing.assert_allclose(gx, tx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(gm["weight"], lin.weight.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(gm["bias"], lin.bias.grad.numpy(), rtol=1e-12)
    assert repr(m) == "Dense(4 => 3, gelu_erf)"


# ---------------------------------------------------------------------------------------------
# rrelu


def test_rrelu_with_equal_bounds_is_leakyrelu_and_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(2).standard_normal(50)
    np.testing.assert_array_equal(rrelu(x, 0.2, 0.2), leakyrelu(x, a=0.2))
    t = torch.nn.functional.rrelu(torch.tensor(x), 0.2, 0.2, training=True)
    np.testing.assert_allclose(rrelu(x, 0.2, 0.2), t.numpy(), rtol=1e-15)
    # PyTorch's eval mode is the mean slope; NNlib (and fluxpy) draw at every call
    t = torch.nn.functional.rrelu(torch.tensor(x), 1 / 8, 1 / 3, training=False)
    np.testing.assert_allclose(leakyrelu(x, a=(1 / 8 + 1 / 3) / 2), t.numpy(), rtol=1e-15)


def test_rrelu_draws_per_element_and_repeats_with_a_seed():
    x = -np.ones(2000)
    a, b = rrelu(x, rng=3), rrelu(x, rng=3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(rrelu(x), rrelu(x))
    assert a.min() >= -1 / 3 and a.max() <= -1 / 8
    assert abs(a.mean() + (1 / 8 + 1 / 3) / 2) < 0.01       # uniform slopes: the mean slope


def test_rrelu_gradient_is_the_slope_it_drew():
    x = np.concatenate([-np.linspace(0.5, 3, 20), np.linspace(0.5, 3, 20)])
    y, back = fluxpy.pullback(rrelu, x)
    (g,) = back(np.ones_like(x))
    np.testing.assert_allclose(g, y / x, rtol=1e-15)


def test_dense_with_rrelu_differentiates_the_slopes_of_its_forward_pass():
    """bias_act applies rrelu on the tape: the backward pass must not draw new slopes (dual numbers would)."""
    m = fluxpy.f64(Dense(3, 50, rrelu, rng=0))
    x = -np.ones((1, 3)) * 2
    z = x @ m.weight.T + m.bias
    y, back = fluxpy.pullback(lambda m: m(x), m)
    gb = back(np.ones_like(y))[0]["bias"]
    np.testing.assert_allclose(gb, np.where(z[0] > 0, 1.0, y[0] / z[0]), rtol=1e-12)
    with pytest.raises(TypeError, match=r"rrelu draws new slopes at every call, so dual numbers cannot"):
        gradient(lambda x: fluxpy.broadcast(rrelu, x).sum(), x)


def test_rrelu_errors():
    with pytest.raises(ValueError, match=r"rrelu expects lo <= hi, got lo=0.5 and hi=0.1"):
        rrelu(np.ones(2), 0.5, 0.1)
    with pytest.raises(ValueError, match=r"rrelu expects hi to be a finite number, got nan"):
        rrelu(np.ones(2), 0.1, float("nan"))


# ---------------------------------------------------------------------------------------------
# logsumexp


@given(shape=shapes(1, 3), data=st.data(), keepdims=st.booleans(), seed=seeds)
def test_logsumexp_against_torch_and_its_gradients(shape, data, keepdims, seed):
    torch = pytest.importorskip("torch")
    axis = data.draw(axes_for(len(shape)))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 30
    dims = tuple(range(len(shape))) if axis is None else axis
    t = torch.logsumexp(torch.tensor(x), dim=dims, keepdim=keepdims).numpy()
    y = logsumexp(x, axis=axis, keepdims=keepdims)
    assert y.shape == t.shape
    np.testing.assert_allclose(y, t, rtol=1e-14)
    check_grad(lambda x: logsumexp(x, axis=axis, keepdims=keepdims), x, rng=rng)
    check_second_order(lambda x: logsumexp(x, axis=axis, keepdims=keepdims), x / 30, rng=rng)
    g = gradient(lambda x: logsumexp(x, axis=axis).sum(), x)[0]
    np.testing.assert_allclose(g, softmax(x, axis=tuple(range(len(shape))) if axis is None else axis), rtol=1e-12)


def test_logsumexp_infinities_and_large_values_as_torch():
    torch = pytest.importorskip("torch")
    x = np.array([[-np.inf, -np.inf], [np.inf, 1.0], [1000.0, 1000.0], [np.nan, 1.0], [-np.inf, 2.0]])
    np.testing.assert_array_equal(logsumexp(x, axis=1), torch.logsumexp(torch.tensor(x), 1).numpy())
    assert logsumexp(np.float32([1, 2])).dtype == np.float32


def test_logsumexp_errors():
    with pytest.raises(ValueError, match=r"logsumexp: axis 2 is out of range for an array with 2 dimensions"):
        logsumexp(np.ones((2, 3)), axis=2)
    with pytest.raises(ValueError, match=r"logsumexp expects no empty axis among those it reduces, got x of shape"):
        logsumexp(np.ones((2, 0)), axis=1)
