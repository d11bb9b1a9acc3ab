"""Flux.jl's ``test/layers/normalisation.jl`` and NNlib.jl's ``test/dropout.jl`` known-answer cases, in fluxpy.

(FluxML/Flux.jl at 3f2f828, FluxML/NNlib.jl at f71b71c.) Flux's ``evalwgrad(m, x)`` (the forward pass of a
pullback, so training mode) is fluxpy's ``trainmode(m)(x)``. Layout: a Julia ``(C, N)`` matrix is fluxpy's
``(N, C)``; Julia's ``reshape(1:12, 3, 2, 2)`` (W, C, N) is fluxpy's ``arange(1, 13).reshape(2, 2, 3)`` (N, C, W),
the same bytes. Not translated: complex inputs, ``@inferred``/allocation counts, Float16.
"""
import math

import numpy as np
import pytest

import fluxpy
from fluxpy import AlphaDropout, BatchNorm, Dropout, InstanceNorm, LayerNorm, testmode, trainmode
from fluxpy.ops.dropout import alpha_dropout, dropout


def test_dropout_layer_modes():
    # Flux normalisation.jl:3-60
    x = np.array([1.0, 2.0, 3.0])
    assert Dropout(0.1)(x) is x                                   # :11, outside a gradient: identity
    np.testing.assert_array_equal(trainmode(Dropout(0))(x), x)    # :12
    np.testing.assert_array_equal(trainmode(Dropout(1))(x), 0 * x)    # :13
    x = np.random.default_rng(0).random(100)
    m = trainmode(Dropout(0.9, rng=1))
    assert (m(x) == 0).sum() > 50                                 # :16-18
    testmode(m)
    assert (m(x) == 0).sum() == 0                                 # :19-21
    m2 = Dropout(0.9, active=False, rng=1)
    assert (fluxpy.gradient(lambda x: m2(x).sum(), x)[0] == 0).sum() == 0   # :27-29, active=False wins
    # :40-48: dims. Flux's (100, 50) with dims=2 is fluxpy's (50, 100) with dims=0: one mask per row, shared
    # by the 100 features, so every feature column has the same number of zeros
    x = np.random.default_rng(2).random((50, 100)) + 0.1
    y = trainmode(Dropout(0.5, dims=0, rng=3))(x)
    c = (y == 0).sum(axis=0)
    assert c.min() == c.max()
    y = trainmode(Dropout(0.5, dims=1, rng=3))(x)
    c = (y == 0).sum(axis=1)
    assert c.min() == c.max()
    assert Dropout(0.5, active=True).active is True               # :75-76
    with pytest.raises(ValueError, match="active"):
        Dropout(0.5, active="something_else")


def test_alpha_dropout():
    # Flux normalisation.jl:79-121
    x = np.array([1.0, 2.0, 3.0])
    assert AlphaDropout(0.1)(x) is x
    np.testing.assert_array_equal(trainmode(AlphaDropout(0))(x), x)
    # :84: p = 1 gives zeros (fluxpy refused p = 1 before; now as Flux and PyTorch)
    np.testing.assert_array_equal(trainmode(AlphaDropout(1))(x), np.zeros(3))
    x = np.random.default_rng(4).standard_normal(1000)
    m = trainmode(AlphaDropout(0.5, rng=5))
    y = m(x)
    assert abs(y.mean()) < 0.2 and abs(y.var() - 1) < 0.2         # :89-92
    testmode(m)
    np.testing.assert_array_equal(m(x), x)                         # :94-95
    # :104-106 (values from PyTorch's C++ tests): sum over 100 ones in (40, 130)
    assert 40 < float(trainmode(AlphaDropout(0.5, rng=6))(np.ones(100)).sum()) < 130
    with pytest.raises(ValueError, match="active"):
        AlphaDropout(0.5, active="something_else")


def test_batchnorm_statistics():
    # Flux normalisation.jl:124-162. Julia's x = [1 3 5; 2 4 6] is (C=2, N=3): fluxpy's (3, 2)
    m = BatchNorm(2)
    x = np.array([[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]], np.float32).T
    assert len(fluxpy.trainables(m)) == 2
    assert m.beta.tolist() == [0, 0] and m.gamma.tolist() == [1, 1]
    y = trainmode(m)(x)
    np.testing.assert_allclose(y, np.array([[-1.22474, 0, 1.22474]] * 2).T, atol=1e-5)
    np.testing.assert_allclose(m.running_mean, [0.3, 0.4], rtol=1e-6)       # :150, momentum 0.1
    np.testing.assert_allclose(m.running_var, 0.1 * x.var(axis=0) * 3 / 2 + 0.9, rtol=1e-6)   # :156, 1.3
    y = testmode(m)(x)
    assert float(y[0, 0]) == pytest.approx((1 - 0.3) / math.sqrt(1.3), abs=1e-5)   # :158-159


def test_batchnorm_single_value_per_channel():
    # Flux normalisation.jl:174-185: an error in training (as PyTorch), fine in test mode
    m = trainmode(BatchNorm(1))
    with pytest.raises(fluxpy.DimensionMismatch, match="more than 1 value per channel"):
        m(np.zeros((1, 1), np.float32))
    assert m(np.arange(4, dtype=np.float32).reshape(1, 1, 4)).shape == (1, 1, 4)
    np.testing.assert_array_equal(testmode(BatchNorm(1))(np.zeros((1, 1), np.float32)), np.zeros((1, 1)))


def test_batchnorm_activation_and_channel_axis():
    # Flux normalisation.jl:187-220
    x = np.array([[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]], np.float32).T
    m = BatchNorm(2, fluxpy.sigmoid)
    np.testing.assert_allclose(m(x), fluxpy.sigmoid((x - m.running_mean) / np.sqrt(m.running_var + m.eps)),
                               atol=1e-7)
    # :201-220: BatchNorm on (N, C, ...) equals BatchNorm on the channels moved last and flattened to (rows, C)
    for shape in ((1, 2, 3), (1, 2, 3, 2), (1, 2, 3, 2, 2)):
        x = np.arange(1, math.prod(shape) + 1, dtype=np.float32).reshape(shape)
        flat = np.moveaxis(x, 1, -1).reshape(-1, 2)
        expected = np.moveaxis(trainmode(BatchNorm(2))(flat).reshape(np.moveaxis(x, 1, -1).shape), -1, 1)
        np.testing.assert_allclose(trainmode(BatchNorm(2))(x), expected, rtol=1e-6, atol=1e-6)
    assert len(fluxpy.trainables(BatchNorm(10, affine=False))) == 0


def test_instancenorm_statistics():
    # Flux normalisation.jl:236-281: sizes (3, 2, 2) = (W, C, N), fluxpy's (N, C, W) = (2, 2, 3)
    m = InstanceNorm(2, affine=True, track_stats=True)
    x = np.arange(1, 13, dtype=np.float32).reshape(2, 2, 3)
    assert len(fluxpy.trainables(m)) == 2
    trainmode(m)(x)
    np.testing.assert_allclose(m.running_mean, [0.5, 0.8], rtol=1e-6)       # :269
    n = 3
    var = x.var(axis=2)                                                       # per instance and channel
    np.testing.assert_allclose(m.running_var, 0.1 * n / (n - 1) * var.mean(axis=0) + 0.9, rtol=1e-6)   # :273
    y = testmode(m)(x)
    np.testing.assert_allclose(y, (x - m.running_mean[None, :, None]) /
                               np.sqrt(m.running_var[None, :, None] + 1e-5), atol=1e-5)   # :278


def test_instancenorm_without_stats():
    # Flux normalisation.jl:299-326: normalised over the spatial axis per instance, then the activation
    x = np.arange(1, 13, dtype=np.float64).reshape(2, 2, 3)
    for m in (InstanceNorm(2, fluxpy.sigmoid, affine=True), InstanceNorm(2, fluxpy.sigmoid)):
        m = fluxpy.f64(m) if m.gamma is not None else m
        mu, var = x.mean(axis=2, keepdims=True), x.var(axis=2, keepdims=True)
        np.testing.assert_allclose(m(x), fluxpy.sigmoid((x - mu) / np.sqrt(var + m.eps)), atol=1e-7)
    assert len(fluxpy.trainables(InstanceNorm(10))) == 0


def test_layernorm_is_normalise_over_the_feature_axes():
    # Flux normalisation.jl:41-54 (LayerNorm(2) normalises WHCN's first axis: fluxpy's last)
    rng = np.random.default_rng(7)
    for shape, dims in (((3, 2), (-1,)), ((5, 4, 3, 2), (-1,)), ((5, 4, 3, 2), (-2, -1)), ((5, 4, 3, 2), (-3, -2, -1))):
        x = rng.random(shape).astype(np.float32)
        m = LayerNorm(tuple(shape[d] for d in dims))
        mu, var = x.mean(axis=dims, keepdims=True), x.var(axis=dims, keepdims=True)
        np.testing.assert_allclose(m(x), (x - mu) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-5)


def test_nnlib_dropout_values():
    # NNlib dropout.jl:21-32, 39-43, 54-56, 71-74
    rng = np.random.default_rng(8)
    x1 = rng.standard_normal((4, 3)).astype(np.float32)
    assert dropout(x1, 0) is x1
    np.testing.assert_array_equal(dropout(x1, 1), np.zeros_like(x1))
    d45 = dropout(np.ones((100, 100, 100)), 0.45, rng=rng)
    assert abs(float(d45.mean()) - 1) < 1e-2
    dpi2 = dropout(np.full(1000, math.pi), 0.2, rng=rng)
    np.testing.assert_allclose(np.unique(dpi2), [0, 5 * math.pi / 4])
    d33 = dropout(np.full((1000, 10), 3.0), 0.3, dims=0, rng=rng)    # NNlib's (10, 1000) with dims=2
    np.testing.assert_allclose(np.unique(d33), [0, 3 / 0.7])
    assert all(len(np.unique(row)) == 1 for row in d33)
    x = np.stack([np.ones(1000), np.zeros(1000)], axis=1)
    (dx,) = fluxpy.gradient(lambda z: (dropout(z, 0.45, rng=9) * 3).sum(), x)
    assert not np.all(dx[:, 1] == 0)                                     # the mask is saved, not recomputed
    np.testing.assert_allclose(np.unique(dx), [0, 3 / 0.55])
    assert fluxpy.gradient(lambda z: dropout(z, 0).sum(), x1)[0].tolist() == np.ones((4, 3)).tolist()
    assert fluxpy.gradient(lambda z: dropout(z, 1).sum(), x1)[0].tolist() == np.zeros((4, 3)).tolist()
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=r"dropout: p must be a probability in \[0, 1\]"):
            dropout(x1, bad)


def test_against_torch():
    torch = pytest.importorskip("torch")
    x = np.array([[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]], np.float32).T
    tm = torch.nn.BatchNorm1d(2)
    ty = tm(torch.tensor(x))
    m = BatchNorm(2)
    np.testing.assert_allclose(trainmode(m)(x), ty.detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(m.running_mean, tm.running_mean.numpy(), rtol=1e-6)
    np.testing.assert_allclose(m.running_var, tm.running_var.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(alpha_dropout(np.ones(3, np.float32), 1.0),
                                  torch.nn.functional.alpha_dropout(torch.ones(3), 1.0, True).numpy())
