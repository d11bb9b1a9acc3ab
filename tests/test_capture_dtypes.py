"""Half precision through Dropout, AlphaDropout and the norm layers, as a mixed-precision step on the GPU sees them:
float16 and bfloat16 activations (on the CPU as NumPy arrays of those dtypes), float32 norm parameters and
statistics. The output keeps the activations' dtype, the gradients reach each array in its own dtype, and the values
are the float32 computation's within the half type's tolerance."""
import numpy as np
import pytest

import fluxpy
from fluxpy import (AlphaDropout, BatchNorm, Chain, Dense, Dropout, GroupNorm, InstanceNorm, LayerNorm, bf16, f16,
                    mixed_precision, relu)
from fluxpy.kernels.halfs import BFLOAT16
from fluxpy.ops.dropout import alpha_dropout, dropout, dropout_mask

HALVES = {"float16": (np.dtype(np.float16), 2.0 ** -11), "bfloat16": (BFLOAT16, 2.0 ** -8)}


def _close(got, want, eps, scale=8):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=scale * eps, atol=scale * eps * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BFLOAT16])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_dropout_keeps_the_inputs_dtype_forward_and_back(dtype, p):
    x = np.random.default_rng(0).standard_normal((6, 5)).astype(dtype)
    for f in (lambda x: dropout(x, p, rng=np.random.default_rng(1)),
              lambda x: alpha_dropout(x, p, rng=np.random.default_rng(1))):
        assert f(x).dtype == dtype
        g, = fluxpy.gradient(lambda x: f(x).astype(np.float32).sum(), x)
        assert g.dtype == dtype
    assert dropout_mask(x, p, rng=np.random.default_rng(1)).dtype == dtype


@pytest.mark.parametrize("half", sorted(HALVES))
def test_a_half_dropout_mask_is_the_float32_mask_rounded(half):
    dtype, eps = HALVES[half]
    x = np.random.default_rng(2).standard_normal((50, 40)).astype(np.float32)
    for p in (0.1, 0.5):
        want = dropout(x, p, rng=np.random.default_rng(3))
        got = dropout(x.astype(dtype), p, rng=np.random.default_rng(3))   # the same uniforms (drawn in float32)
        _close(got, want, eps)
        assert ((np.asarray(got, np.float32) == 0) == (want == 0)).all()
        _close(alpha_dropout(x.astype(dtype), p, rng=np.random.default_rng(4)),
               alpha_dropout(x, p, rng=np.random.default_rng(4)), eps)


@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("drop", [lambda: Dropout(0.4, rng=5), lambda: AlphaDropout(0.4, rng=5)])
def test_a_dense_after_dropout_in_half_precision_takes_its_output(half, drop):
    """The half model of a mixed-precision step (its weights and activations in the half type): Dropout hands the
    next Dense its own dtype, no DTypeMismatch; the values are the float32 model's within the half tolerance."""
    dtype, eps = HALVES[half]
    model = fluxpy.trainmode(Chain(Dense(6, 8, relu, rng=0), drop(), Dense(8, 3, rng=1)))
    half_model = (bf16 if dtype == BFLOAT16 else f16)(model)
    fluxpy.trainmode(half_model)
    half_model.layers[1].rng = np.random.default_rng(5)
    x = np.random.default_rng(6).standard_normal((16, 6)).astype(np.float32)
    y = half_model(x.astype(dtype))
    assert y.dtype == dtype
    reference = Chain(*[fluxpy.f32(m) for m in half_model.layers])   # the half weights, in float32
    reference.layers[1].rng = np.random.default_rng(5)
    _close(y, reference(x.astype(dtype).astype(np.float32)), eps, scale=16)
    g, = fluxpy.gradient(lambda m: m(x.astype(dtype)).astype(np.float32).sum(), half_model)
    assert g["layers"][0]["weight"].dtype == dtype


def _norm_layers():
    return [("BatchNorm", lambda: BatchNorm(4, relu)), ("LayerNorm", lambda: LayerNorm((5, 3))),
            ("GroupNorm", lambda: GroupNorm(4, 2)), ("InstanceNorm", lambda: InstanceNorm(4, affine=True)),
            ("InstanceNorm tracked", lambda: InstanceNorm(4, affine=True, track_stats=True))]


@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("name, make", _norm_layers(), ids=[n for n, _ in _norm_layers()])
def test_norm_layers_take_half_activations_with_float32_parameters(half, name, make):
    dtype, eps = HALVES[half]
    rng = np.random.default_rng(7)
    x = (3 * rng.standard_normal((6, 4, 5, 3)) + 1).astype(dtype)
    w = rng.standard_normal(x.shape).astype(np.float32)
    layer, reference = make(), make()
    for m in (layer, reference):
        fluxpy.trainmode(m)
        if m.gamma is not None:
            m.gamma[...] = np.linspace(0.5, 1.5, m.gamma.size, dtype=np.float32).reshape(m.gamma.shape)
            m.beta[...] = np.linspace(-1, 1, m.beta.size, dtype=np.float32).reshape(m.beta.shape)
    (gl, gx) = fluxpy.gradient(lambda m, x: (m(x).astype(np.float32) * w).sum(), layer, x)
    (rl, rx) = fluxpy.gradient(lambda m, x: (m(x) * w).sum(), reference, x.astype(np.float32))
    if getattr(layer, "running_mean", None) is not None:   # statistics in float32, moved as the float32 layer's
        assert layer.running_mean.dtype == np.float32 and layer.running_var.dtype == np.float32
        _close(layer.running_mean, reference.running_mean, eps, scale=16)
        _close(layer.running_var, reference.running_var, eps, scale=16)
    assert gx.dtype == dtype
    _close(gx, rx, eps, scale=32)
    for key in ("gamma", "beta"):
        assert gl[key].dtype == np.float32 and layer.gamma.dtype == np.float32
        _close(gl[key], rl[key], eps, scale=32)
    y = layer(x)
    assert y.dtype == dtype
    _close(y, reference(x.astype(np.float32)), eps, scale=16)


@pytest.mark.parametrize("convert", [f16, bf16])
def test_conversions_and_mixed_precision_keep_every_norm_layer_float32(convert):
    model = Chain(Dense(3, 4), GroupNorm(4, 2), InstanceNorm(4, affine=True, track_stats=True), LayerNorm(4),
                  BatchNorm(4))
    converted = convert(model)
    assert converted.layers[0].weight.dtype != np.float32
    for layer in converted.layers[1:]:
        assert all(a.dtype == np.float32 for a in fluxpy.functors.arrays(layer)), layer


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_mixed_precision_model_with_dropout_and_norms_trains_close_to_float32(dtype):
    def make():
        return Chain(Dense(6, 8, rng=0), GroupNorm(8, 4, relu), Dropout(0.3, rng=1), Dense(8, 8, rng=2),
                     LayerNorm(8), AlphaDropout(0.2, rng=3), Dense(8, 2, rng=4))
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((32, 6)).astype(np.float32), rng.standard_normal((32, 2)).astype(np.float32)
    plain, mixed = make(), mixed_precision(make(), dtype)
    losses = {}
    for name, m in (("float32", plain), (dtype, mixed)):
        value, (g,) = fluxpy.withgradient(lambda m: ((m(x) - y) ** 2).mean(), m)
        losses[name] = float(value)
        assert np.isfinite(value)
    np.testing.assert_allclose(losses[dtype], losses["float32"], rtol=0.05)
