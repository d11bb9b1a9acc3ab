"""WeightNorm and SpectralNorm against the PyTorch / Flux formulas written out in NumPy (float64): torch's
weight_norm ``g * v / ||v||`` over every axis but dim, Flux's ``g * v / sqrt(sum(v^2; dims) + eps)``, torch's
spectral_norm power iteration (``v = normalize(W^T u)``, ``u = normalize(W v)``, ``sigma = u . W v``); gradients
against finite differences; hypothesis over shapes, dims and iteration counts."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import Conv, ConvTranspose, Dense, SpectralNorm, WeightNorm
from fluxpy.functors import rebuild
from gradcheck import check_grad


def _torch_weight_norm(g, v, dims, eps):
    return g * v / np.sqrt((v * v).sum(axis=dims, keepdims=True) + eps)


@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=4), data=st.data(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_weight_norm_matches_the_formula(shape, data, seed):
    rng = np.random.default_rng(seed)
    cin, cout = shape[1], shape[0]
    kernel = tuple(shape[2:])
    layer = fluxpy.f64(Dense(cin, cout, rng=seed) if not kernel else Conv(kernel, cin, cout, pad=1, rng=seed))
    nd = len(shape)
    dims = data.draw(st.one_of(st.none(), st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True)))
    eps = data.draw(st.sampled_from([None, 0.0]))
    wn = WeightNorm(layer, dims=dims, eps=eps)
    axes = tuple(range(1, nd)) if dims is None else tuple(sorted(dims))
    e = np.finfo(np.float64).eps if eps is None else 0.0
    np.testing.assert_allclose(wn.g, np.sqrt((layer.weight ** 2).sum(axis=axes, keepdims=True) + e), rtol=1e-14)
    wn.g = rng.uniform(0.5, 2.0, wn.g.shape)
    np.testing.assert_allclose(wn.weight(), _torch_weight_norm(wn.g, layer.weight, axes, e), rtol=1e-13)
    x = rng.standard_normal((2, cin) + tuple(k + 1 for k in kernel))

    def f(v, g, x):   # the wrapper with the direction v and the magnitude g
        return rebuild(wn, [("layer", rebuild(layer, [("weight", v)])), ("g", g)])(x)
    check_grad(f, layer.weight, wn.g, x, rng=rng)


def test_weight_norm_wraps_a_layer_in_a_model():
    rng = np.random.default_rng(0)
    model = fluxpy.f64(fluxpy.Chain(WeightNorm(fluxpy.f64(Dense(3, 4, fluxpy.tanh, rng=0))), Dense(4, 2, rng=1)))
    x = rng.standard_normal((5, 3))
    before = model(x)
    g, = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), model)
    assert set(g["layers"][0]) == {"layer", "g"} and g["layers"][0]["g"].shape == (4, 1)
    assert g["layers"][0]["layer"]["weight"].shape == (4, 3)
    assert len(fluxpy.trainables(model)) == 5   # v, its bias and g; the second Dense's two
    np.testing.assert_allclose(before, model.layers[1](model.layers[0].layer(x)), rtol=1e-12)
    assert repr(WeightNorm(Dense(3, 4), dims=0)) == "WeightNorm(Dense(3 => 4), dims=(0,))"
    with pytest.raises(ValueError, match="WeightNorm expects a layer with a float array field 'kernel'"):
        WeightNorm(Dense(3, 4), "kernel")
    with pytest.raises(ValueError, match="WeightNorm: the 'weight' field of Dense is all zeros"):
        WeightNorm(Dense(np.zeros((2, 3), np.float32)))
    with pytest.raises(ValueError, match="WeightNorm expects dims, distinct axes of the weight"):
        WeightNorm(Dense(3, 4), dims=(0, 0))


def _normalize(a, eps=1e-12):
    return a / max(np.linalg.norm(a), eps)


def _torch_spectral_step(w, u, v, dim, n):
    mat = np.moveaxis(w, dim, 0).reshape(w.shape[dim], -1)
    for _ in range(n):
        v = _normalize(mat.T @ u)
        u = _normalize(mat @ v)
    return w / (u @ mat @ v), u, v


@given(kind=st.sampled_from(["dense", "conv", "convtranspose"]), n=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_spectral_norm_matches_the_torch_power_iteration(kind, n, seed):
    rng = np.random.default_rng(seed)
    layer = {"dense": lambda: Dense(5, 3, rng=seed), "conv": lambda: Conv((3, 2), 2, 4, rng=seed),
             "convtranspose": lambda: ConvTranspose((2, 2), 3, 2, rng=seed)}[kind]()
    sn = fluxpy.f64(SpectralNorm(layer, n_power_iterations=n, rng=seed))
    dim = 1 if kind == "convtranspose" else 0
    assert sn.dim == dim
    x = rng.standard_normal((2, 5) if kind == "dense" else (2, sn.layer.weight.shape[1 - dim], 4, 4))
    w, u0, v0 = sn.layer.weight, sn.u.copy(), sn.v.copy()
    expected_w, u1, v1 = _torch_spectral_step(w, u0, v0, dim, n)
    fluxpy.trainmode(sn)
    y = sn(x)   # training: iterates, in place
    np.testing.assert_allclose(sn.u, u1, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(sn.v, v1, rtol=1e-10, atol=1e-12)
    plain = rebuild(sn.layer, [("weight", expected_w)])
    np.testing.assert_allclose(y, plain(x), rtol=1e-10, atol=1e-12)
    fluxpy.testmode(sn)
    u_before = sn.u.copy()
    np.testing.assert_allclose(sn(x), y, rtol=1e-12, atol=1e-12)   # test mode: the same u, v, no iteration
    np.testing.assert_array_equal(sn.u, u_before)

    def f(w, x):
        s = rebuild(sn, [("layer", rebuild(sn.layer, [("weight", w)])),
                                         ("u", sn.u), ("v", sn.v)])
        return s(x)
    check_grad(f, w, x, rng=rng)


def test_spectral_norm_trains_inside_gradient_and_its_errors():
    rng = np.random.default_rng(3)
    sn = fluxpy.f64(SpectralNorm(Dense(4, 3, rng=0), rng=2))
    x = rng.standard_normal((6, 4))
    u0, v0 = sn.u.copy(), sn.v.copy()
    g, = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), sn)   # automatic mode: iterates inside gradient
    _, u1, v1 = _torch_spectral_step(sn.layer.weight, u0, v0, 0, 1)
    np.testing.assert_allclose(sn.u, u1, rtol=1e-12)
    assert g["u"] is None and g["v"] is None and g["layer"]["weight"].shape == (3, 4)
    sn(x)   # outside gradient: test mode, u and v stay
    np.testing.assert_array_equal(sn.u, u1)
    assert fluxpy.trainables(sn) == [sn.layer.weight, sn.layer.bias]
    assert repr(SpectralNorm(Dense(4, 3), n_power_iterations=2)) == "SpectralNorm(Dense(4 => 3), n_power_iterations=2)"
    with pytest.raises(ValueError, match="SpectralNorm: n_power_iterations must be a positive int, got 0"):
        SpectralNorm(Dense(4, 3), n_power_iterations=0)
    with pytest.raises(ValueError, match="SpectralNorm: dim must be an axis of the weight of shape \\(3, 4\\)"):
        SpectralNorm(Dense(4, 3), dim=2)


def test_remove_weight_norms_keeps_the_function_and_leaves_one_weight():
    rng = np.random.default_rng(3)
    inner = fluxpy.Chain(WeightNorm(Conv((3, 3), 2, 4, pad=1, rng=1), dims=(0, 2, 3)), fluxpy.flatten)
    model = fluxpy.Chain(inner, WeightNorm(Dense(4 * 5 * 5, 3, rng=2)), SpectralNorm(Dense(3, 2, rng=4), rng=5))
    model = fluxpy.f64(model)
    plain = fluxpy.remove_weight_norms(model)
    x = rng.standard_normal((2, 2, 5, 5))
    np.testing.assert_allclose(fluxpy.testmode(plain)(x), fluxpy.testmode(model)(x), rtol=1e-12)
    assert type(plain[0][0]) is Conv and type(plain[1]) is Dense and type(plain[2]) is SpectralNorm
    assert plain[2] is model[2]                           # what holds no WeightNorm is shared, not copied
    assert not any(isinstance(m, WeightNorm) for m in fluxpy.modules(plain))
    np.testing.assert_allclose(plain[1].weight, model[1].weight(), rtol=1e-15)
    before = [w.copy() for w in fluxpy.trainables(model)]
    (g,) = fluxpy.gradient(lambda m: (fluxpy.testmode(m)(x) ** 2).sum(), plain)   # trains as a plain model
    assert g["layers"][1]["weight"].shape == plain[1].weight.shape
    assert all(np.array_equal(a, b) for a, b in zip(fluxpy.trainables(model), before))   # the original untouched


def test_onehot_encodes_one_label_and_refuses_several():
    np.testing.assert_array_equal(fluxpy.onehot(2, range(4)), [0, 0, 1, 0])
    np.testing.assert_array_equal(fluxpy.onehot("c", "abc"), fluxpy.onehotbatch(["c"], "abc")[0])
    with pytest.raises(ValueError, match=r"^onehot expects one label, got .*; several: onehotbatch"):
        fluxpy.onehot([1, 2], range(4))
    with pytest.raises(ValueError, match="onehotbatch: label 7 is not one of the classes"):
        fluxpy.onehot(7, range(4))
