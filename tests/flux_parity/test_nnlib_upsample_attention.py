"""NNlib.jl's ``test/testsuite/upsample.jl`` and ``test/attention.jl`` known-answer cases (FluxML/NNlib.jl at
f71b71c), in fluxpy.

Layout: a WHCN array is fluxpy's NCHW array with the axes reversed (the same bytes), so a Julia ``W x H`` matrix
``A`` is fluxpy's ``A.T`` (``H x W``) and a Julia scale ``(sW, sH)`` is fluxpy's ``(sH, sW)``. NNlib's attention is
feature-first, ``q (dim, L, batch)`` with scores ``(Lk, Lq, heads, batch)``; fluxpy's is batch-first, ``(batch, L,
dim)`` with scores ``(batch, heads, Lq, Lk)``: again the axes reversed. Not translated (fluxpy lacks them; listed in
the report): ``upsample_nearest``/``upsample_bilinear`` with ``size=`` or a non-integer scale, ``upsample_linear``
(1-d), ``upsample_trilinear`` (3-d), integer/rational/complex element types, attention's ``bias`` argument and more
than one batch axis.
"""
import numpy as np
import pytest

import fluxpy
from fluxpy.ops.attention import causal_mask, dot_product_attention
from fluxpy.ops.resample import pixel_shuffle, upsample_bilinear, upsample_nearest
from tests.gradcheck import check_grad


def whcn(a):
    """A Julia array literal given as nested lists in Julia's index order, as fluxpy's NCHW array."""
    return np.asarray(a).T


def test_upsample_nearest():
    # NNlib upsample.jl:7-16: x[:, :, 1, 1] = [1 2; 3 4]
    x = whcn(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)[:, :, None, None])
    assert x.shape == (1, 1, 2, 2)
    assert upsample_nearest(x, (3, 3))[0, 0, :, 0].tolist() == [1, 1, 1, 2, 2, 2]      # Julia's y[1, :]
    y = upsample_nearest(x, (3, 2))                                                    # Julia's scale (2, 3)
    assert y.shape == (1, 1, 6, 4)                                                     # Julia's (4, 6, 1, 1)
    _, back = fluxpy.pullback(lambda z: upsample_nearest(z, (3, 2)), x)
    np.testing.assert_array_equal(back(y)[0][0, 0], whcn([[6, 12], [18, 24]]))          # ∇upsample_nearest(y)
    rng = np.random.default_rng(0)
    check_grad(lambda z: upsample_nearest(z, (3, 2)), rng.random((1, 1, 2, 2)), rng=rng)
    with pytest.raises(ValueError, match="upsample_nearest expects scale"):
        upsample_nearest(x, (1, 2, 3, 4, 5))                                           # :25


# NNlib upsample.jl:47-55: PyTorch v1.5's UpsamplingBilinear2d(scale_factor=(3, 2), align_corners=True)
Y_TRUE = np.array([[1, 4 / 3, 5 / 3, 2], [7 / 5, 26 / 15, 31 / 15, 12 / 5], [9 / 5, 32 / 15, 37 / 15, 14 / 5],
                   [11 / 5, 38 / 15, 43 / 15, 16 / 5], [13 / 5, 44 / 15, 49 / 15, 18 / 5], [3, 10 / 3, 11 / 3, 4]])


def test_upsample_bilinear():
    # NNlib upsample.jl:42-70: x = [1 2; 3 4] (W x H), repeated over 2 channels and 2 samples; scale (3, 2)
    x = np.broadcast_to(whcn(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)), (2, 2, 2, 2)).copy()
    y = upsample_bilinear(x, (2, 3))
    assert y.shape == (2, 2, 4, 6) and y.dtype == np.float32
    np.testing.assert_allclose(y, np.broadcast_to(Y_TRUE.T, (2, 2, 4, 6)), rtol=1e-6)
    # :67-70: the pullback of ones (6 x 4 outputs onto 2 x 2 inputs) is 6 everywhere
    _, back = fluxpy.pullback(lambda z: upsample_bilinear(z, (2, 3)), x[:1])
    np.testing.assert_allclose(back(np.ones((1, 2, 4, 6), np.float32))[0], 6.0, rtol=1e-6)
    rng = np.random.default_rng(1)
    check_grad(lambda z: upsample_bilinear(z, (2, 3)), rng.random((1, 1, 2, 2)), rng=rng)


def test_pixel_shuffle():
    # NNlib upsample.jl:130-179: x = reshape(1:16, (2, 2, 4, 1)) is fluxpy's arange(1, 17).reshape(1, 4, 2, 2)
    x = np.arange(1, 17).reshape(1, 4, 2, 2)
    y_true = whcn(np.array([[1, 9, 3, 11], [5, 13, 7, 15], [2, 10, 4, 12], [6, 14, 8, 16]]))
    np.testing.assert_array_equal(pixel_shuffle(x, 2)[0, 0], y_true)
    x = np.arange(1, 33).reshape(1, 8, 2, 2)
    y = pixel_shuffle(x, 2)
    assert y.shape == (1, 2, 4, 4)
    np.testing.assert_array_equal(y[0, 0], y_true)
    np.testing.assert_array_equal(y[0, 1], whcn([[17, 25, 19, 27], [21, 29, 23, 31], [18, 26, 20, 28],
                                                 [22, 30, 24, 32]]))
    x = np.arange(4 * 3 * 27 * 2).reshape(2, 27, 3, 4)
    y = pixel_shuffle(x, 3)
    assert y.shape == (2, 3, 9, 12)                                                    # Julia's (12, 9, 3, 2)
    np.testing.assert_array_equal(np.concatenate([pixel_shuffle(x[:1], 3), pixel_shuffle(x[1:], 3)]), y)


def test_attention_shapes_and_normalised_scores():
    # NNlib attention.jl:1-15 (batch sizes 1 and 2; fluxpy has exactly one batch axis)
    rng = np.random.default_rng(2)
    for batch in (1, 2):
        for nheads in (1, 3, 5):
            q = rng.random((batch, 3, 15)).astype(np.float32)
            k, v = rng.random((batch, 4, 15)).astype(np.float32), rng.random((batch, 4, 15)).astype(np.float32)
            y, a = dot_product_attention(q, k, v, nheads=nheads)
            assert y.dtype == np.float32 and y.shape == (batch, 3, 15) and a.shape == (batch, nheads, 3, 4)
            np.testing.assert_allclose(a.sum(axis=-1), 1.0, rtol=1e-5)


def test_attention_specific_results():
    # NNlib attention.jl:25-34: q = k = v = reshape(1:12, 4, 3, 1) ./ 12, nheads = 2
    q = np.arange(1, 13, dtype=np.float64).reshape(1, 3, 4) / 12
    y, a = dot_product_attention(q, q, q, nheads=2)
    ytrue = np.array([0.429754, 0.513087, 0.613791, 0.697125, 0.46431, 0.547644, 0.647876, 0.73121, 0.49773,
                      0.581064, 0.680455, 0.763788]).reshape(1, 3, 4)
    atrue = np.array([0.313896, 0.332948, 0.353157, 0.264431, 0.328206, 0.407362, 0.219215, 0.31838, 0.462405,
                      0.288691, 0.331243, 0.380066, 0.241239, 0.323893, 0.434868, 0.198438, 0.311761,
                      0.489801]).reshape(1, 2, 3, 3)
    np.testing.assert_allclose(y, ytrue, atol=1e-5)
    np.testing.assert_allclose(a, atrue, atol=1e-5)


def test_attention_masks():
    # NNlib attention.jl:36-52: NNlib's mask is (Lk, Lq), fluxpy's (Lq, Lk); scores are > 0 exactly where allowed
    rng = np.random.default_rng(3)
    q, k = rng.random((1, 3, 4)), rng.random((1, 5, 4))
    mask = rng.random((3, 5)) > 0.5
    mask[:, 0] = True   # NNlib draws the mask freely; a query with no allowed key would be NaN
    _, a = dot_product_attention(q, k, k, mask=mask, nheads=2)
    assert np.array_equal(a[0, 0] > 0, mask) and np.array_equal(a[0, 1] > 0, mask)
    x = rng.random((1, 3, 4))
    _, a = dot_product_attention(x, x, x, mask=causal_mask(x), nheads=2)
    assert np.array_equal(a[0, 0] > 0, causal_mask(3)) and np.array_equal(a[0, 1] > 0, causal_mask(3))


def test_attention_dropout_and_gradient():
    # NNlib attention.jl:54-59 (dropout of the scores) and 70-76 (gradient, without bias)
    rng = np.random.default_rng(4)
    q = rng.random((10, 10, 10))
    drop = fluxpy.Dropout(0.5, rng=5, active=True)
    _, a = dot_product_attention(q, q, q, nheads=2, dropout=drop)
    assert 0.4 < float((a > 0).mean()) < 0.6     # the scores returned are those after dropout, as NNlib's
    q, kv = rng.random((1, 5, 4)), rng.random((1, 3, 4))
    check_grad(lambda q, k, v: dot_product_attention(q, k, v, nheads=2)[0], q, kv, kv.copy(), rng=rng)


def test_against_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = np.broadcast_to(whcn(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)), (2, 2, 2, 2)).copy()
    t = F.interpolate(torch.tensor(x), scale_factor=(2, 3), mode="bilinear", align_corners=True)
    np.testing.assert_allclose(upsample_bilinear(x, (2, 3)), t.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(pixel_shuffle(np.arange(1, 33).reshape(1, 8, 2, 2), 2),
                                  F.pixel_shuffle(torch.arange(1, 33).reshape(1, 8, 2, 2), 2).numpy())
    q = np.arange(1, 13, dtype=np.float64).reshape(1, 3, 4) / 12
    mha_q = torch.tensor(q).reshape(1, 3, 2, 2).transpose(1, 2)   # (batch, heads, L, d)
    ty = F.scaled_dot_product_attention(mha_q, mha_q, mha_q).transpose(1, 2).reshape(1, 3, 4)
    np.testing.assert_allclose(dot_product_attention(q, q, q, nheads=2)[0], ty.numpy(), rtol=1e-12)
