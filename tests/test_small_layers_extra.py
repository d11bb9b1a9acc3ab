"""PReLU, RMSNorm, PixelUnshuffle, hardshrink, softmin and glu (issue 41): values against PyTorch's formulas in
float64 (hypothesis draws shapes and options), gradients against float64 finite differences, and the errors that
name the layer or op."""
import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import DimensionMismatch, DTypeMismatch, PixelShuffle, PixelUnshuffle, PReLU, RMSNorm
from fluxpy.ops import glu, hardshrink, softmin
from gradcheck import check_grad

shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4)


def _with(layer, **arrays):
    new = copy.copy(layer)
    for k, v in arrays.items():
        setattr(new, k, v)
    return new


def _away_from(x, points, gap=1e-3):
    """``x`` with entries within ``gap`` of a kink moved off it (finite differences need smooth points)."""
    for p in points:
        near = np.abs(x - p) < gap
        x = np.where(near, p + 10 * gap, x)
    return x


@settings(max_examples=25, deadline=None)
@given(shapes, st.floats(0.0, 2.0), st.integers(0, 2 ** 16))
def test_hardshrink_is_pytorchs(shape, lam, seed):
    x = _away_from(np.random.default_rng(seed).standard_normal(shape) * 2, (-lam, lam))
    np.testing.assert_array_equal(hardshrink(x, lam=lam), np.where(np.abs(x) > lam, x, 0.0))
    check_grad(lambda x: hardshrink(x, lam=lam), x)


def test_hardshrink_keeps_nan_and_its_default():
    y = hardshrink(np.array([np.nan, -0.5, 0.5, 0.51, -np.inf]))
    assert np.isnan(y[0]) and y[1:].tolist() == [0.0, 0.0, 0.51, -np.inf]


@settings(max_examples=25, deadline=None)
@given(shapes, st.integers(0, 2 ** 16), st.data())
def test_softmin_is_the_softmax_of_minus_x(shape, seed, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = np.random.default_rng(seed).standard_normal(shape) * 3
    e = np.exp(-x - (-x).max(axis=axis, keepdims=True))
    np.testing.assert_allclose(softmin(x, axis), e / e.sum(axis=axis, keepdims=True), rtol=1e-12, atol=1e-15)
    check_grad(lambda x: softmin(x, axis), x)


@settings(max_examples=25, deadline=None)
@given(shapes, st.integers(0, 2 ** 16), st.data())
def test_glu_splits_in_halves_and_gates(shape, seed, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    shape = list(shape)
    shape[axis] *= 2
    x = np.random.default_rng(seed).standard_normal(shape) * 2
    a, b = np.split(x, 2, axis=axis)
    np.testing.assert_allclose(glu(x, axis), a / (1 + np.exp(-b)), rtol=1e-12, atol=1e-15)
    check_grad(lambda x: glu(x, axis), x)


def test_glu_errors_and_default_axis():
    assert glu(np.ones((2, 6, 4))).shape == (2, 6, 2)
    with pytest.raises(ValueError, match=r"glu expects an even size along axis 1, got shape \(2, 3\)"):
        glu(np.ones((2, 3)), 1)
    with pytest.raises(ValueError, match="glu: axis 2 is out of range"):
        glu(np.ones((2, 4)), 2)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2), st.booleans(), st.floats(-1, 1), st.integers(0, 2 ** 16))
def test_prelu_is_pytorchs_and_differentiable(channels, spatial, shared, init, seed):
    rng = np.random.default_rng(seed)
    layer = fluxpy.f64(PReLU(1 if shared else channels, init=init))
    layer.weight[...] = rng.standard_normal(layer.weight.shape)
    x = _away_from(rng.standard_normal((3, channels) + (4,) * spatial), (0.0,))
    w = layer.weight.reshape((1, -1) + (1,) * spatial) if not shared else layer.weight[0]
    np.testing.assert_allclose(layer(x), np.maximum(x, 0) + w * np.minimum(x, 0), rtol=1e-15)
    check_grad(lambda w, x: PReLU.__call__(_with(layer, weight=w), x), layer.weight, x)


def test_prelu_defaults_repr_errors_and_its_slope_at_zero():
    act = PReLU()
    assert repr(act) == "PReLU(1)" and act.weight.dtype == np.float32 and act.weight.tolist() == [0.25]
    assert repr(PReLU(3, init=0.1)) == "PReLU(3, init=0.1)"
    g, = fluxpy.gradient(lambda x: act(x).sum(), np.zeros(3, np.float32))
    np.testing.assert_array_equal(g, [0.25] * 3)   # PyTorch's: the slope at x == 0 is the weight
    assert act(np.ones(5, np.float32)).shape == (5,)
    with pytest.raises(DimensionMismatch, match=r"PReLU\(3\) expects x.shape\[1\] == 3"):
        PReLU(3)(np.ones((2, 4), np.float32))
    with pytest.raises(DTypeMismatch, match=r"PReLU\(1\)"):
        act(np.ones(2))
    with pytest.raises(ValueError, match="PReLU: num_parameters must be a positive int"):
        PReLU(0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(1, 2), st.sampled_from([None, 1e-5, 0.1]),
       st.integers(0, 2 ** 16))
def test_rmsnorm_is_pytorchs_and_differentiable(shape, k, eps, seed):
    k = min(k, len(shape))
    rng = np.random.default_rng(seed)
    layer = fluxpy.f64(RMSNorm(tuple(shape[-k:]), eps=eps))
    layer.gamma[...] = rng.standard_normal(layer.gamma.shape)
    x = rng.standard_normal(shape)
    e = np.finfo(np.float64).eps if eps is None else eps
    axes = tuple(range(-k, 0))
    want = x / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + e) * layer.gamma
    np.testing.assert_allclose(layer(x), want, rtol=1e-12, atol=1e-14)
    check_grad(lambda g, x: RMSNorm.__call__(_with(layer, gamma=g), x), layer.gamma, x)


def test_rmsnorm_without_affine_in_half_precision_repr_and_errors():
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32) * 300
    plain = RMSNorm(5, affine=False)
    assert plain.gamma is None and repr(plain) == "RMSNorm(5, affine=False)"
    assert repr(RMSNorm((2, 3), eps=0.01)) == "RMSNorm((2, 3), eps=0.01)"
    want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.finfo(np.float32).eps)
    np.testing.assert_allclose(plain(x), want, rtol=1e-6)
    half = RMSNorm(5)(x.astype(np.float16))   # x**2 overflows float16: normalised in float32
    assert half.dtype == np.float16
    np.testing.assert_allclose(half.astype(np.float32), want, rtol=2e-3, atol=2e-3)
    with pytest.raises(DimensionMismatch, match=r"RMSNorm\(4\) expects x.shape\[-1:\] == \(4,\)"):
        RMSNorm(4)(x)
    with pytest.raises(ValueError, match="RMSNorm: shape must be a positive int"):
        RMSNorm(0)
    with pytest.raises(ValueError, match="RMSNorm: eps must be a number >= 0"):
        RMSNorm(3, eps=-1.0)


def _torch_pixel_unshuffle(x, r):
    """PyTorch's pixel_unshuffle transcribed (2-d): (N, C, H, W) -> (N, C*r*r, H/r, W/r)."""
    n, c, h, w = x.shape
    return x.reshape(n, c, h // r, r, w // r, r).transpose(0, 1, 3, 5, 2, 4).reshape(n, c * r * r, h // r, w // r)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2 ** 16))
def test_pixel_unshuffle_is_pytorchs_and_inverts_pixel_shuffle(r, c, h, w, seed):
    x = np.random.default_rng(seed).standard_normal((2, c, h * r, w * r))
    np.testing.assert_array_equal(PixelUnshuffle(r)(x), _torch_pixel_unshuffle(x, r))
    np.testing.assert_array_equal(PixelShuffle(r)(PixelUnshuffle(r)(x)), x)
    check_grad(lambda x: PixelUnshuffle(r)(x), x)


@pytest.mark.parametrize("spatial", [(4,), (2, 4, 6)])
def test_pixel_unshuffle_in_1_and_3_dimensions(spatial):
    x = np.random.default_rng(1).standard_normal((2, 3) + spatial)
    y = PixelUnshuffle(2)(x)
    assert y.shape == (2, 3 * 2 ** len(spatial)) + tuple(s // 2 for s in spatial)
    np.testing.assert_array_equal(PixelShuffle(2)(y), x)
    check_grad(lambda x: PixelUnshuffle(2)(x), x)


def test_pixel_unshuffle_repr_and_errors():
    assert repr(PixelUnshuffle(3)) == "PixelUnshuffle(3)"
    with pytest.raises(DimensionMismatch, match=r"PixelUnshuffle\(2\) expects spatial sizes divisible by r == 2"):
        PixelUnshuffle(2)(np.ones((1, 1, 3, 4), np.float32))
    with pytest.raises(DimensionMismatch, match=r"PixelUnshuffle\(2\) expects an input"):
        PixelUnshuffle(2)(np.ones((4, 4), np.float32))
    with pytest.raises(DTypeMismatch, match=r"PixelUnshuffle\(2\)"):
        PixelUnshuffle(2)(np.ones((1, 1, 4, 4), np.int64))
    with pytest.raises(ValueError, match="PixelUnshuffle: r must be a positive int"):
        PixelUnshuffle(0)


def test_the_names_are_exported():
    for name in ("PReLU", "RMSNorm", "PixelUnshuffle"):
        assert getattr(fluxpy, name) is getattr(fluxpy.layers, name) and name in fluxpy.layers.__all__
    for name in ("hardshrink", "softmin", "glu"):
        assert getattr(fluxpy, name) is getattr(fluxpy.ops, name) and name in fluxpy.ops.__all__
