"""GroupNorm, InstanceNorm, Upsample and PixelShuffle: their ops against NumPy references and float64 finite
differences (hypothesis draws shapes and options), the layers' semantics, reprs and errors, and PyTorch in float64
with the same weights (skipped without torch)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.kernels.halfs import BFLOAT16
from fluxpy.layers import DimensionMismatch, DTypeMismatch, GroupNorm, InstanceNorm, PixelShuffle, Upsample
from fluxpy.ops import (bilinear_weights, groupnorm, instancenorm, pixel_shuffle, upsample_bilinear,
                        upsample_nearest)
from gradcheck import check_grad, check_second_order

seeds = st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------------------------------------
# References


def reference_groupnorm(x, groups, gamma, beta, eps):
    n, c = x.shape[:2]
    g = x.reshape(n, groups, -1)
    mu, var = g.mean(axis=2, keepdims=True), g.var(axis=2, keepdims=True)
    y = ((g - mu) / np.sqrt(var + eps)).reshape(x.shape)
    k = (1, c) + (1,) * (x.ndim - 2)
    return y * gamma.reshape(k) + beta.reshape(k)


def reference_instancenorm(x, gamma, beta, eps):
    axes = tuple(range(2, x.ndim))
    mu, var = x.mean(axis=axes, keepdims=True), x.var(axis=axes, keepdims=True)
    k = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    return (x - mu) / np.sqrt(var + eps) * gamma.reshape(k) + beta.reshape(k)


def reference_bilinear(x, sh, sw, align_corners):
    """Element by element: each output reads its four neighbours (PyTorch's and NNlib's formula)."""
    n, c, h, w = x.shape
    oh, ow = h * sh, w * sw

    def source(j, n_in, n_out):
        if align_corners:
            s = j * (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
        else:
            s = max((j + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = min(int(np.floor(s)), n_in - 1)
        return i0, min(i0 + 1, n_in - 1), s - i0
    y = np.empty((n, c, oh, ow))
    for i in range(oh):
        h0, h1, lh = source(i, h, oh)
        for j in range(ow):
            w0, w1, lw = source(j, w, ow)
            y[:, :, i, j] = ((1 - lh) * ((1 - lw) * x[:, :, h0, w0] + lw * x[:, :, h0, w1])
                             + lh * ((1 - lw) * x[:, :, h1, w0] + lw * x[:, :, h1, w1]))
    return y


def reference_pixel_shuffle(x, r):
    n, c, h, w = x.shape
    y = np.empty((n, c // (r * r), h * r, w * r))
    for ch in range(c // (r * r)):
        for i in range(r):
            for j in range(r):
                y[:, ch, i::r, j::r] = x[:, ch * r * r + i * r + j]
    return y


# ---------------------------------------------------------------------------------------------
# groupnorm and instancenorm ops


@st.composite
def group_case(draw):
    groups = draw(st.integers(1, 3))
    c = groups * draw(st.integers(1, 3))
    spatial = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple))
    if (c // groups) * int(np.prod(spatial)) < 2:
        spatial = spatial + (2,)
    return (draw(st.integers(1, 3)), c) + spatial, groups


@given(case=group_case(), affine=st.booleans(), seed=seeds)
def test_groupnorm_values_and_gradients(case, affine, seed):
    shape, groups = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2 + 0.5
    g, b = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
    one, zero = np.ones(shape[1]), np.zeros(shape[1])
    expected = reference_groupnorm(x, groups, g if affine else one, b if affine else zero, 1e-5)
    got = groupnorm(x, groups, g, b) if affine else groupnorm(x, groups)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    args = (x, g, b) if affine else (x,)
    check_grad(lambda x, g=None, b=None: groupnorm(x, groups, g, b), *args, rng=rng, rtol=1e-5)


@given(case=group_case(), seed=seeds)
@settings(max_examples=20)
def test_groupnorm_second_order(case, seed):
    shape, groups = case
    rng = np.random.default_rng(seed)
    x, g = rng.standard_normal(shape), rng.standard_normal(shape[1])
    check_second_order(lambda x, g: groupnorm(x, groups, g, None) ** 2, x, g, rng=rng, rtol=1e-4)


@given(shape=st.lists(st.integers(1, 3), min_size=3, max_size=4).map(tuple), affine=st.booleans(), seed=seeds)
def test_instancenorm_values_and_gradients(shape, affine, seed):
    if np.prod(shape[2:]) < 2:
        shape = shape + (2,)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3 - 1
    g, b = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
    one, zero = np.ones(shape[1]), np.zeros(shape[1])
    expected = reference_instancenorm(x, g if affine else one, b if affine else zero, 1e-5)
    got = instancenorm(x, g, b) if affine else instancenorm(x)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    args = (x, g, b) if affine else (x,)
    check_grad(lambda x, g=None, b=None: instancenorm(x, g, b), *args, rng=rng, rtol=1e-5)


def test_groupnorm_extremes_are_instance_and_layer_norm():
    x = np.random.default_rng(0).standard_normal((3, 4, 5))
    np.testing.assert_allclose(groupnorm(x, 4), instancenorm(x), rtol=1e-12)
    np.testing.assert_allclose(groupnorm(x, 1), fluxpy.ops.layernorm(x, axes=(1, 2)), rtol=1e-12)


@pytest.mark.parametrize("call, message", [
    (lambda: groupnorm(np.ones((2, 4, 3)), 3), r"groupnorm expects groups to be a positive int dividing x.shape\[1\] "
                                               r"== 4, got 3"),
    (lambda: groupnorm(np.ones((2, 4, 3)), 0), "groupnorm expects groups to be a positive int"),
    (lambda: groupnorm(np.ones((2, 4, 3)), 2, np.ones(3)), r"groupnorm expects gamma of shape \(4,\)"),
    (lambda: groupnorm(np.ones((2, 4)), 4), r"groupnorm expects more than 1 value per group"),
    (lambda: instancenorm(np.ones((2, 4))), r"instancenorm expects x of shape \(N, C, S1, ...\) with a spatial axis"),
    (lambda: instancenorm(np.ones((2, 4, 1))), r"instancenorm expects more than 1 value per instance and channel"),
    (lambda: instancenorm(np.ones((2, 4, 3)), None, np.ones(2)), r"instancenorm expects beta of shape \(4,\)"),
    # eps: a negative one makes var + eps negative (NaN) where the variance is small, an infinite one the output 0
    (lambda: groupnorm(np.ones((2, 4, 3)), 2, eps=-1e-5), r"groupnorm expects eps to be a finite number >= 0, got -1e-05"),
    (lambda: instancenorm(np.ones((2, 4, 3)), eps=float("inf")), r"instancenorm expects eps .* got inf"),
    (lambda: fluxpy.ops.layernorm(np.ones((2, 4)), eps=float("nan")), r"layernorm expects eps .* got nan"),
    (lambda: fluxpy.ops.layernorm(np.ones((2, 4)), eps="1e-5"), r"layernorm expects eps .* got '1e-5'"),
    (lambda: fluxpy.ops.normalise(np.ones((2, 4)), eps=-1.0), r"normalise expects eps .* got -1.0"),
    (lambda: fluxpy.ops.batchnorm_train(np.ones((2, 4)), eps=-1.0), r"batchnorm_train expects eps .* got -1.0"),
    (lambda: fluxpy.ops.batchnorm_infer(np.ones((2, 4)), None, None, np.zeros(4), np.ones(4), eps=-1.0),
     r"batchnorm_infer expects eps .* got -1.0"),
    (lambda: fluxpy.ops.batchnorm(np.ones((2, 4)), eps=True), r"batchnorm expects eps .* got True"),
    (lambda: fluxpy.ops.batchnorm(np.ones((2, 4)), momentum=1.5), r"batchnorm expects momentum to be a number in "
                                                                  r"\[0, 1\], got 1.5"),
])
def test_norm_op_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------------------------------
# GroupNorm and InstanceNorm layers


def test_groupnorm_layer():
    rng = np.random.default_rng(1)
    gn = GroupNorm(6, 3, fluxpy.relu)
    gn.gamma[:] = rng.standard_normal(6)
    gn.beta[:] = rng.standard_normal(6)
    x = rng.standard_normal((2, 6, 4, 4)).astype(np.float32)
    expected = np.maximum(reference_groupnorm(x.astype(np.float64), 3, gn.gamma, gn.beta, 1e-5), 0)
    np.testing.assert_allclose(gn(x), expected, rtol=1e-4, atol=1e-5)
    assert gn(x).dtype == np.float32
    g, = fluxpy.gradient(lambda m: m(x).sum(), gn)
    assert sorted(k for k, v in g.items() if v is not None) == ["beta", "gamma"]
    assert len(fluxpy.trainables(gn)) == 2
    assert len(fluxpy.trainables(GroupNorm(4, 2, affine=False))) == 0


def test_groupnorm_layer_gradient_float64():
    rng = np.random.default_rng(2)
    gn = fluxpy.f64(GroupNorm(4, 2, fluxpy.tanh))
    x, g, b = rng.standard_normal((3, 4, 5)), rng.standard_normal(4), rng.standard_normal(4)

    def f(x, g, b):
        gn.gamma, gn.beta = g, b
        return gn(x)
    check_grad(f, x, g, b, rng=rng, rtol=1e-5)


def test_instancenorm_layer_without_statistics():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    layer = InstanceNorm(3)
    assert layer.gamma is None and layer.running_mean is None and fluxpy.trainables(layer) == []
    expected = reference_instancenorm(x.astype(np.float64), np.ones(3), np.zeros(3), 1e-5)
    np.testing.assert_allclose(layer(x), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fluxpy.testmode(layer)(x), expected, rtol=1e-4, atol=1e-5)   # no stats: same


def test_instancenorm_track_stats_moves_and_then_uses_the_running_statistics():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 2, 4, 5)) * 2 + 1).astype(np.float32)
    layer = InstanceNorm(2, affine=True, track_stats=True, momentum=0.3)
    layer.gamma[:] = rng.standard_normal(2)
    layer.beta[:] = rng.standard_normal(2)
    fluxpy.gradient(lambda m: m(x).sum(), layer)   # training: statistics move
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=(2, 3)).mean(axis=0)
    var = (x64.var(axis=(2, 3)) * 20 / 19).mean(axis=0)
    np.testing.assert_allclose(layer.running_mean, 0.3 * mean, rtol=1e-5)
    np.testing.assert_allclose(layer.running_var, 0.7 + 0.3 * var, rtol=1e-5)
    k = (1, 2, 1, 1)
    expected = (x64 - layer.running_mean.reshape(k)) / np.sqrt(layer.running_var.reshape(k) + 1e-5) \
        * layer.gamma.reshape(k) + layer.beta.reshape(k)
    np.testing.assert_allclose(layer(x), expected, rtol=1e-4, atol=1e-5)   # test mode outside gradient
    before = layer.running_mean.copy()
    fluxpy.trainmode(layer)(x)
    assert not np.allclose(layer.running_mean, before)


@pytest.mark.parametrize("half", [np.float16, BFLOAT16])
def test_norm_layers_take_half_inputs(half):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    for layer in (GroupNorm(4, 2), InstanceNorm(4, affine=True), InstanceNorm(4)):
        y = layer(x.astype(half))
        assert y.dtype == half
        np.testing.assert_allclose(y.astype(np.float32), layer(x), atol=0.05)


def test_norm_layer_reprs():
    assert repr(GroupNorm(4, 2)) == "GroupNorm(4, 2)"
    assert repr(GroupNorm(6, 3, fluxpy.relu, eps=1e-3, affine=False)) == "GroupNorm(6, 3, relu, eps=0.001, affine=False)"
    assert repr(InstanceNorm(3)) == "InstanceNorm(3)"
    assert repr(InstanceNorm(3, fluxpy.relu, momentum=0.2, affine=True, track_stats=True, active=False)) == \
        "InstanceNorm(3, relu, momentum=0.2, affine=True, track_stats=True, active=False)"


@pytest.mark.parametrize("build, message", [
    (lambda: GroupNorm(4, 3), "GroupNorm: groups must divide channels, got 4 channels in 3 groups"),
    (lambda: GroupNorm(0, 1), "GroupNorm: channels must be a positive int, got 0"),
    (lambda: GroupNorm(4, 2.0), "GroupNorm: groups must be a positive int, got 2.0"),
    (lambda: GroupNorm(4, 2, eps=-1), "GroupNorm: eps must be a number >= 0, got -1"),
    (lambda: InstanceNorm(-1), "InstanceNorm: channels must be a positive int, got -1"),
    (lambda: InstanceNorm(2, momentum=2), "InstanceNorm: momentum must be a number >= 0 and <= 1, got 2"),
    (lambda: InstanceNorm(2, active="yes"), "InstanceNorm: active must be True, False or None"),
])
def test_norm_layer_constructor_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("layer, x, error, message", [
    (GroupNorm(4, 2), np.ones((2, 3, 5), np.float32), DimensionMismatch,
     r"GroupNorm\(4, 2\) expects x.shape\[1\] == 4 \(x of shape \(N, C, ...\)\), got \(2, 3, 5\) float32"),
    (GroupNorm(4, 4), np.ones((2, 4), np.float32), DimensionMismatch,
     r"GroupNorm\(4, 4\) expects more than 1 value per group \(x.size // \(N \* groups\)\), got \(2, 4\) float32"),
    (GroupNorm(4, 2), np.ones((2, 4, 5)), DTypeMismatch, r"GroupNorm\(4, 2\) expects x of dtype float32"),
    (InstanceNorm(3), np.ones((2, 3), np.float32), DimensionMismatch,
     r"InstanceNorm\(3\) expects x.shape\[1\] == 3 \(x of shape \(N, C, S1, ...\)\), got \(2, 3\) float32"),
    (InstanceNorm(3), np.ones((2, 3, 1, 1), np.float32), DimensionMismatch,
     r"InstanceNorm\(3\) expects more than 1 spatial value per instance and channel, got \(2, 3, 1, 1\) float32"),
    (InstanceNorm(3), np.ones((2, 3, 4), np.int64), DTypeMismatch, r"InstanceNorm\(3\) expects a floating-point x"),
    (InstanceNorm(3, affine=True), np.ones((2, 3, 4)), DTypeMismatch,
     r"InstanceNorm\(3, affine=True\) expects x of dtype float32"),
])
def test_norm_layer_input_errors(layer, x, error, message):
    with pytest.raises(error, match=message):
        layer(x)


def test_instancenorm_errors_leave_the_running_statistics_alone():
    layer = fluxpy.trainmode(InstanceNorm(2, track_stats=True))
    with pytest.raises(DimensionMismatch):
        layer(np.ones((2, 2, 1), np.float32) * 3)
    assert np.all(layer.running_mean == 0) and np.all(layer.running_var == 1)


# ---------------------------------------------------------------------------------------------
# upsample_nearest, upsample_bilinear, pixel_shuffle


@st.composite
def nearest_case(draw):
    nspatial = draw(st.integers(1, 3))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3))) + tuple(draw(st.integers(1, 3))
                                                                       for _ in range(nspatial))
    scale = draw(st.one_of(st.integers(1, 3), st.tuples(*[st.integers(1, 3)] * nspatial)))
    return shape, scale


@given(case=nearest_case(), seed=seeds)
def test_upsample_nearest_values_and_gradient(case, seed):
    shape, scale = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    scales = (scale,) * (len(shape) - 2) if isinstance(scale, int) else scale
    expected = x
    for axis, s in enumerate(scales, start=2):
        expected = np.repeat(expected, s, axis=axis)
    np.testing.assert_array_equal(upsample_nearest(x, scale), expected)
    check_grad(lambda x: upsample_nearest(x, scale), x, rng=rng)


@given(shape=st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 4), st.integers(1, 4)),
       sh=st.integers(1, 3), sw=st.integers(1, 3), align=st.booleans(), seed=seeds)
def test_upsample_bilinear_values_and_gradient(shape, sh, sw, align, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    scale = sh if sh == sw else (sh, sw)
    y = upsample_bilinear(x, scale, align_corners=align)
    np.testing.assert_allclose(y, reference_bilinear(x, sh, sw, align), rtol=1e-12, atol=1e-12)
    check_grad(lambda x: upsample_bilinear(x, scale, align_corners=align), x, rng=rng)


def test_upsample_bilinear_known_answers():
    x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    aligned = np.array([[1, 4 / 3, 5 / 3, 2], [5 / 3, 2, 7 / 3, 8 / 3], [7 / 3, 8 / 3, 3, 10 / 3],
                        [3, 10 / 3, 11 / 3, 4]])
    half_pixel = np.array([[1, 1.25, 1.75, 2], [1.5, 1.75, 2.25, 2.5], [2.5, 2.75, 3.25, 3.5], [3, 3.25, 3.75, 4]])
    np.testing.assert_allclose(upsample_bilinear(x, 2)[0, 0], aligned, rtol=1e-12)
    np.testing.assert_allclose(upsample_bilinear(x, 2, align_corners=False)[0, 0], half_pixel, rtol=1e-12)
    np.testing.assert_allclose(bilinear_weights(3, 7).sum(axis=1), 1.0, rtol=1e-12)
    assert upsample_bilinear(x.astype(np.float32), 2).dtype == np.float32


@given(r=st.integers(1, 3), c=st.integers(1, 2), n=st.integers(1, 2), h=st.integers(1, 3), w=st.integers(1, 3),
       seed=seeds)
def test_pixel_shuffle_values_and_gradient(r, c, n, h, w, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c * r * r, h, w))
    np.testing.assert_array_equal(pixel_shuffle(x, r), reference_pixel_shuffle(x, r))
    check_grad(lambda x: pixel_shuffle(x, r), x, rng=rng)


def test_pixel_shuffle_in_1d_and_3d():
    rng = np.random.default_rng(6)
    x1 = rng.standard_normal((2, 6, 4))
    np.testing.assert_array_equal(pixel_shuffle(x1, 3)[:, 1, 2::3], x1[:, 5])
    x3 = rng.standard_normal((1, 16, 2, 3, 2))
    y3 = pixel_shuffle(x3, 2)
    assert y3.shape == (1, 2, 4, 6, 4)
    # channel 1's block (i, j, k) is input channel 1 * 8 + i * 4 + j * 2 + k
    np.testing.assert_array_equal(y3[0, 1, 1::2, 0::2, 1::2], x3[0, 8 + 4 + 1])


@pytest.mark.parametrize("call, message", [
    (lambda: upsample_nearest(np.ones((2, 3)), 2), r"upsample_nearest expects x of shape \(N, C, S1, ...\)"),
    (lambda: upsample_nearest(np.ones((1, 1, 2, 2)), (2, 2, 2)), "upsample_nearest expects scale to be a positive number "
                                                                  r"or a tuple of 2 of them"),
    (lambda: upsample_nearest(np.ones((1, 1, 2)), -1.5), "upsample_nearest expects scale to be a positive number"),
    (lambda: upsample_bilinear(np.ones((1, 1, 2)), 2), r"upsample_bilinear expects x of shape \(N, C, H, W\)"),
    (lambda: upsample_bilinear(np.ones((1, 1, 2, 2)), 0), "upsample_bilinear expects scale to be a positive number"),
    (lambda: upsample_bilinear(np.ones((1, 1, 2, 2)), 2, align_corners=1), "upsample_bilinear expects align_corners"),
    (lambda: pixel_shuffle(np.ones((1, 6, 2, 2)), 2), r"pixel_shuffle expects x.shape\[1\] divisible by r\*\*2 == 4"),
    (lambda: pixel_shuffle(np.ones((1, 4, 2, 2)), 0), "pixel_shuffle expects r to be a positive int, got 0"),
])
def test_resample_op_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------------------------------
# Upsample and PixelShuffle layers


def test_upsample_and_pixel_shuffle_layers():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 8, 3, 5)).astype(np.float32)
    np.testing.assert_array_equal(Upsample()(x), upsample_nearest(x, 2))
    np.testing.assert_array_equal(Upsample((1, 3))(x), np.repeat(x, 3, axis=3))
    np.testing.assert_allclose(Upsample(2, mode="bilinear", align_corners=False)(x),
                               reference_bilinear(x.astype(np.float64), 2, 2, False), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(PixelShuffle(2)(x), reference_pixel_shuffle(x, 2))
    v = rng.standard_normal((1, 2, 3, 2, 2)).astype(np.float32)
    assert Upsample(2)(v).shape == (1, 2, 6, 4, 4)
    model = fluxpy.Chain(fluxpy.Conv((3, 3), 8, 4, pad=1), PixelShuffle(2), Upsample(2, mode="bilinear"))
    g, = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), model)
    assert g["layers"][0]["weight"].shape == (4, 8, 3, 3) and np.abs(g["layers"][0]["weight"]).sum() > 0
    for half in (np.float16, BFLOAT16):
        assert Upsample(2, mode="bilinear")(x.astype(half)).dtype == half
        assert PixelShuffle(2)(x.astype(half)).dtype == half


def test_resample_layer_reprs():
    assert repr(Upsample()) == "Upsample(2)"
    assert repr(Upsample((2, 3))) == "Upsample((2, 3))"
    assert repr(Upsample(4, mode="bilinear")) == 'Upsample(4, mode="bilinear")'
    assert repr(Upsample(2, mode="bilinear", align_corners=False)) == 'Upsample(2, mode="bilinear", align_corners=False)'
    assert repr(PixelShuffle(3)) == "PixelShuffle(3)"


@pytest.mark.parametrize("build, message", [
    (lambda: Upsample(0), "Upsample: scale must be a positive number or a tuple of them"),
    (lambda: Upsample(float("inf")), "Upsample: scale must be a positive number or a tuple of them"),
    (lambda: Upsample(2, mode="cubic"), "Upsample: mode must be \"nearest\", \"linear\", \"bilinear\" or \"trilinear\", "
                                        "got 'cubic'"),
    (lambda: Upsample(2, align_corners=False), "Upsample: align_corners applies to mode=\"linear\", \"bilinear\" or "
                                               "\"trilinear\""),
    (lambda: Upsample(2, size=4), "Upsample: give scale or size, not both"),
    (lambda: Upsample(mode="trilinear", size=(4, 4)), "Upsample: mode=\"trilinear\" takes a size int or triple"),
    (lambda: Upsample(2, mode="bilinear", align_corners=None), "Upsample: align_corners must be True or False"),
    (lambda: Upsample((2, 2, 2), mode="bilinear"), "Upsample: mode=\"bilinear\" takes a scale int or pair"),
    (lambda: PixelShuffle(0), "PixelShuffle: r must be a positive int, got 0"),
])
def test_resample_layer_constructor_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("layer, x, error, message", [
    (Upsample(2), np.ones((2, 3), np.float32), DimensionMismatch,
     r"Upsample\(2\) expects an input \(N, C, S1, ...\) with a spatial axis, got \(2, 3\) float32"),
    (Upsample((2, 2)), np.ones((2, 3, 4), np.float32), DimensionMismatch,
     r"Upsample\(\(2, 2\)\) expects 2 spatial axes \(one per scale\), got \(2, 3, 4\) float32"),
    (Upsample(2, mode="bilinear"), np.ones((2, 3, 4), np.float32), DimensionMismatch,
     r"Upsample\(2, mode=\"bilinear\"\) expects a 4-d input \(N, C, H, W\), got \(2, 3, 4\) float32"),
    (Upsample(2), np.ones((2, 3, 4), np.int32), DTypeMismatch, r"Upsample\(2\) expects a floating-point x"),
    (PixelShuffle(2), np.ones((2, 6, 3, 3), np.float32), DimensionMismatch,
     r"PixelShuffle\(2\) expects x.shape\[1\] divisible by 2\*\*2 == 4, got \(2, 6, 3, 3\) float32"),
    (PixelShuffle(2), np.ones((2, 4), np.float32), DimensionMismatch, r"PixelShuffle\(2\) expects an input"),
    (PixelShuffle(2), np.ones((2, 4, 3, 3), np.int64), DTypeMismatch, r"PixelShuffle\(2\) expects a floating-point x"),
])
def test_resample_layer_input_errors(layer, x, error, message):
    with pytest.raises(error, match=message):
        layer(x)


# ---------------------------------------------------------------------------------------------
# Against PyTorch, float64, same weights


def _torch_compare(ours, theirs, arrays, dy):
    torch = pytest.importorskip("torch")
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    ty = theirs(*ts)
    ty.backward(torch.tensor(dy))
    y, back = fluxpy.pullback(ours, *arrays)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    for g, t in zip(back(dy), ts):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("shape, groups", [((4, 6, 5, 5), 3), ((2, 4, 7), 1), ((3, 4, 2, 3, 2), 4)])
def test_groupnorm_matches_torch(shape, groups):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    x, dy = rng.standard_normal(shape), rng.standard_normal(shape)
    g, b = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
    _torch_compare(lambda x, g, b: groupnorm(x, groups, g, b, 1e-5),
                   lambda x, g, b: torch.nn.functional.group_norm(x, groups, g, b, 1e-5), (x, g, b), dy)


def test_instancenorm_layer_matches_torch_including_running_statistics():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    x, dy = rng.standard_normal((4, 3, 5, 6)) * 2 + 1, rng.standard_normal((4, 3, 5, 6))
    ours = fluxpy.f64(InstanceNorm(3, affine=True, track_stats=True))
    theirs = torch.nn.InstanceNorm2d(3, affine=True, track_running_stats=True).double()
    with torch.no_grad():
        theirs.weight[:] = torch.tensor(rng.standard_normal(3))
        theirs.bias[:] = torch.tensor(rng.standard_normal(3))
    ours.gamma[:], ours.beta[:] = theirs.weight.detach().numpy(), theirs.bias.detach().numpy()
    _torch_compare(lambda x: fluxpy.trainmode(ours)(x), lambda x: theirs.train()(x), (x,), dy)
    np.testing.assert_allclose(ours.running_mean, theirs.running_mean.numpy(), rtol=1e-10)
    np.testing.assert_allclose(ours.running_var, theirs.running_var.numpy(), rtol=1e-10)
    _torch_compare(lambda x: fluxpy.testmode(ours)(x), lambda x: theirs.eval()(x), (x,), dy)


@pytest.mark.parametrize("mode, align", [("nearest", None), ("bilinear", True), ("bilinear", False)])
@pytest.mark.parametrize("scale", [2, (3, 2), (1, 4)])
def test_upsample_matches_torch(mode, align, scale):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 3, 5, 4))
    s = (scale, scale) if isinstance(scale, int) else scale
    dy = rng.standard_normal((2, 3, 5 * s[0], 4 * s[1]))
    layer = Upsample(scale) if mode == "nearest" else Upsample(scale, mode=mode, align_corners=align)
    _torch_compare(layer, lambda x: torch.nn.functional.interpolate(x, scale_factor=s, mode=mode,
                                                                    align_corners=align), (x,), dy)


def test_pixel_shuffle_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    x, dy = rng.standard_normal((2, 18, 4, 5)), rng.standard_normal((2, 2, 12, 15))
    _torch_compare(PixelShuffle(3), lambda x: torch.nn.functional.pixel_shuffle(x, 3), (x,), dy)
