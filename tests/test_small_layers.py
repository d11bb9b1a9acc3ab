"""Scale, Bilinear, Maxout, PairwiseFusion, AlphaDropout and Parallel's Flux rules: values against NumPy,
gradients against float64 finite differences (hypothesis draws sizes), PyTorch's Bilinear where torch is
installed, and the errors that name the layer."""
import operator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import AlphaDropout, Bilinear, Dense, Maxout, PairwiseFusion, Parallel, Scale
from gradcheck import check_grad


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 5), st.booleans())
def test_bilinear_matches_its_formula_and_finite_differences(in1, in2, out, batch, bias):
    rng = np.random.default_rng(in1 * 100 + in2 * 10 + out)
    b = fluxpy.f64(Bilinear((in1, in2), out, fluxpy.tanh, bias=bias, rng=rng))
    if bias:
        b.bias[...] = rng.standard_normal(out)
    x, z = rng.standard_normal((batch, in1)), rng.standard_normal((batch, in2))
    want = np.tanh(np.einsum("ni,oij,nj->no", x, b.weight, z) + (b.bias if bias else 0))
    np.testing.assert_allclose(b(x, z), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b((x, z)), want, rtol=1e-12, atol=1e-12)
    check_grad(lambda w, x, z: Bilinear.__call__(_with(b, weight=w), x, z), b.weight, x, z)


def _with(layer, **arrays):
    import copy
    new = copy.copy(layer)
    for k, v in arrays.items():
        setattr(new, k, v)
    return new


def test_bilinear_with_one_input_errors_and_repr():
    b = Bilinear(3, 2, rng=0)
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(b(x), b(x, x))
    assert repr(b) == "Bilinear(3 => 2)" and repr(Bilinear((2, 3), 4, fluxpy.relu, bias=False)) == \
        "Bilinear((2, 3) => 4, relu, bias=False)"
    with pytest.raises(fluxpy.DimensionMismatch, match=r"Bilinear\(3 => 2\) expects z of shape \(batch, 3\)"):
        b(x, np.ones((4, 2), np.float32))
    with pytest.raises(fluxpy.DimensionMismatch, match="one batch size"):
        b(x, np.ones((5, 3), np.float32))
    with pytest.raises(ValueError, match="in_features to be an int or a pair"):
        Bilinear((1, 2, 3), 2)


def test_bilinear_matches_pytorch():
    torch = pytest.importorskip("torch")
    b = fluxpy.f64(Bilinear((3, 4), 5, rng=1))
    b.bias[...] = np.random.default_rng(2).standard_normal(5)
    t = torch.nn.Bilinear(3, 4, 5).double()
    with torch.no_grad():
        t.weight.copy_(torch.from_numpy(b.weight))
        t.bias.copy_(torch.from_numpy(b.bias))
    x, z = np.random.default_rng(3).standard_normal((6, 3)), np.random.default_rng(4).standard_normal((6, 4))
    np.testing.assert_allclose(b(x, z), t(torch.from_numpy(x), torch.from_numpy(z)).detach().numpy(), rtol=1e-12)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.integers(1, 3))
def test_scale_broadcasts_on_trailing_axes(size, batch):
    rng = np.random.default_rng(len(size) * 10 + batch)
    s = fluxpy.f64(Scale(*size, act=fluxpy.tanh))
    s.scale[...] = rng.standard_normal(size)
    s.bias[...] = rng.standard_normal(size)
    x = rng.standard_normal((batch, 2) + tuple(size))
    np.testing.assert_allclose(s(x), np.tanh(s.scale * x + s.bias), rtol=1e-12)
    check_grad(lambda sc, bi, x: Scale.__call__(_with(s, scale=sc, bias=bi), x), s.scale, s.bias, x)


def test_scale_errors_and_repr():
    assert repr(Scale(2, 3, act=fluxpy.relu)) == "Scale(2, 3, relu)" and repr(Scale(4, bias=False)) == \
        "Scale(4, bias=False)"
    with pytest.raises(fluxpy.DimensionMismatch, match=r"Scale\(3\) expects x that broadcasts with \(3,\)"):
        Scale(3)(np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="Scale expects a size"):
        Scale()


def test_maxout_takes_the_elementwise_maximum_and_routes_the_gradient():
    layers = [fluxpy.f64(Dense(3, 2, rng=i)) for i in range(3)]
    m = Maxout(*layers)
    x = np.random.default_rng(5).standard_normal((4, 3))
    np.testing.assert_array_equal(m(x), np.maximum(np.maximum(layers[0](x), layers[1](x)), layers[2](x)))
    check_grad(lambda x: m(x), x)
    assert len(Maxout(lambda: Dense(3, 2), 5).layers) == 5
    with pytest.raises(ValueError, match="Maxout expects layers"):
        Maxout()
    assert repr(Maxout(Dense(1, 1), Dense(1, 1))) == "Maxout(Dense(1 => 1), Dense(1 => 1))"


def test_pairwise_fusion_follows_flux():
    f1, f2, f3 = (fluxpy.f64(Dense(2, 2, rng=i)) for i in range(3))
    p = PairwiseFusion(operator.add, f1, f2, f3)
    xs = tuple(np.random.default_rng(i).standard_normal((3, 2)) for i in range(3))
    y1 = f1(xs[0])
    y2 = f2(y1 + xs[1])
    y3 = f3(y2 + xs[2])
    for got, want in zip(p(xs), (y1, y2, y3)):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    for got, want in zip(p(*xs), (y1, y2, y3)):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    one = p(xs[0])            # one input goes to every layer
    np.testing.assert_allclose(one[1], f2(one[0] + xs[0]), rtol=1e-12)
    with pytest.raises(fluxpy.DimensionMismatch, match="expects 1 or 3 inputs, got 2"):
        p(xs[0], xs[1])


def test_parallel_follows_flux_rules():
    f = fluxpy.f64(Dense(2, 3, rng=0))
    g = fluxpy.f64(Dense(2, 3, rng=1))
    x, y = np.ones((1, 2)), np.full((1, 2), 2.0)
    np.testing.assert_allclose(Parallel(operator.add, f)(x, y), f(x) + f(y))       # one layer, several inputs
    np.testing.assert_allclose(Parallel(operator.add, f, g)((x, y)), f(x) + g(y))  # a tuple is the inputs
    np.testing.assert_allclose(Parallel(operator.add, f, g)(x), f(x) + g(x))       # one input to every layer


def test_alpha_dropout_keeps_mean_and_variance_and_is_off_outside_training():
    x = np.random.default_rng(6).standard_normal((200, 500))
    d = AlphaDropout(0.3, rng=7)
    assert d(x) is x                            # inactive outside a gradient
    y = AlphaDropout(0.3, rng=7, active=True)(x)
    assert abs(y.mean()) < 0.02 and abs(y.std() - 1) < 0.02
    dropped = -1.0507009873554805 * 1.6732632423543772
    a = ((1 - 0.3) * (1 + 0.3 * dropped ** 2)) ** -0.5
    kept = np.isclose(y, a * x + (-a * dropped * 0.3))
    assert 0.65 < kept.mean() < 0.75
    (g,) = fluxpy.gradient(lambda x: AlphaDropout(0.3, rng=7)(x).sum(), x)
    assert set(np.unique(np.round(g, 12))) <= {0.0, round(a, 12)}
    with pytest.raises(ValueError, match=r"AlphaDropout: p must be a probability in \[0, 1\]"):
        AlphaDropout(1.5)
    assert repr(AlphaDropout(0.2)) == "AlphaDropout(0.2)"
