"""Flux.jl's ``test/layers/conv.jl`` known-answer cases (FluxML/Flux.jl at 3f2f828), in fluxpy's NCHW.

A WHCN size ``(W, H, C, N)`` is ``(N, C, H, W)`` here, spatial options reverse (Flux's ``pad=(0, 1, 1, 2)``, (left,
right, top, bottom) of (W, H), is fluxpy's ``(1, 2, 0, 1)``, (top, bottom, left, right)); a Flux weight array is
fluxpy's with the axes reversed (the same bytes): a Conv's ``(kw, kh, cin, cout)`` is ``(cout, cin, kh, kw)``, a
DepthwiseConv's ``(k..., cout/cin, cin)`` is ``(cin, cout/cin, ...k)``. ``SamePad()`` is ``pad="same"``,
``outpad`` is ``output_padding``. Where fluxpy chooses differently: layers refuse an input of another dtype than
their weight (a ``DTypeMismatch`` naming the conversion) where Flux converts float64 and integers to float32
(conv.jl:318-333). Not translated: ``Flux._channels_in``/``_channels_out`` (private; fluxpy's layers have
``in_channels``/``out_channels``, checked instead), the ``cpu``/``f32`` maps of a bias-free model (``f32`` only).
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import (AdaptiveMaxPool, AdaptiveMeanPool, Chain, Conv, ConvTranspose, CrossCor, Dense, DepthwiseConv,
                    DTypeMismatch, GlobalMaxPool, GlobalMeanPool, MaxPool, MeanPool, flatten, gradient, relu, softmax)
from fluxpy.ops.pool import maxpool, meanpool

f32 = np.float32


def randn32(*shape):
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(f32)


def test_pooling():
    # conv.jl:1-20
    x, y = randn32(2, 3, 10, 10), randn32(2, 3, 20, 20)
    np.testing.assert_array_equal(AdaptiveMaxPool((5, 5))(x), maxpool(x, 2))
    # Flux tests ==; fluxpy's adaptive mean is two products with averaging matrices: a float32 rounding apart
    np.testing.assert_allclose(AdaptiveMeanPool((5, 5))(x), meanpool(x, 2), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(AdaptiveMaxPool((5, 10))(y), maxpool(y, (4, 2)))   # Flux's (10, 5) and (2, 4)
    np.testing.assert_allclose(AdaptiveMeanPool((5, 10))(y), meanpool(y, (4, 2)), rtol=1e-5, atol=1e-7)
    assert GlobalMaxPool()(x).shape == GlobalMeanPool()(x).shape == (2, 3, 1, 1)
    np.testing.assert_array_equal(MaxPool((2, 2))(x), maxpool(x, 2))
    np.testing.assert_array_equal(MeanPool((2, 2))(x), meanpool(x, 2))


def test_cnn():
    # conv.jl:22-33
    m = Chain(Conv((2, 2), 1, 16, relu), MaxPool((2, 2)), Conv((2, 2), 16, 8, relu), MaxPool((2, 2)), flatten,
              Dense(288, 10), softmax)
    assert m(np.zeros((5, 1, 28, 28), f32)).shape == (5, 10)


def test_bias_switch():
    # conv.jl:35-67
    layer = Conv(np.ones((3, 1, 2, 2), f32), np.ones(3, f32))       # Flux's Conv(ones(2, 2, 1, 3), ones(3))
    op = layer(np.zeros((1, 1, 28, 28), f32))
    assert op.sum() == op.size
    ip = np.zeros((1, 1, 28, 28), f32)
    for model in (Conv((2, 2), 1, 3, bias=False), fluxpy.f32(Conv((2, 2), 1, 3, bias=False))):
        assert model(ip).sum() == pytest.approx(0.0)
        assert gradient(lambda m: m(ip).sum(), model)[0]["bias"] is None
    # training without a bias cannot fit a constant 2 from a zero input: the loss stays 4
    model = Conv((2, 2), 1, 3, bias=False)
    target = np.zeros((1, 3, 27, 27), f32) + 2
    state = fluxpy.setup(fluxpy.Descent(), model)
    for _ in range(100):
        g = gradient(lambda m: fluxpy.mse(m(ip), target), model)[0]
        fluxpy.update(state, model, g)
    assert float(fluxpy.mse(model(ip), target)) == pytest.approx(4.0)


def test_grouped_conv():
    # conv.jl:69-91
    c = Conv((3,), 100, 25, groups=5)
    assert c.weight.shape == (25, 20, 3) and c(np.random.rand(2, 100, 28).astype(f32)).shape == (2, 25, 26)
    c = Conv((3, 3), 100, 25, groups=5)
    assert c.weight.shape == (25, 20, 3, 3) and c(np.random.rand(2, 100, 28, 28).astype(f32)).shape == (2, 25, 26, 26)
    c = Conv((5, 4, 3), 100, 25, groups=5)                            # Flux's (3, 4, 5)
    assert c.weight.shape == (25, 20, 5, 4, 3)
    assert c(np.random.rand(2, 100, 12, 11, 10).astype(f32)).shape == (2, 25, 8, 8, 8)
    for cin, cout in ((3, 10), (2, 9)):
        with pytest.raises(ValueError, match=rf"Conv: groups == 2 must divide cin == {cin} and cout == {cout}"):
            Conv((2, 2), cin, cout, groups=2)
    with pytest.raises(ValueError, match=r"Conv: init must return a float array of shape \(1, 1, 3, 3\)"):
        Conv((3, 3), 1, 1, init=lambda *s, rng=None: np.random.rand(3, 3, 1))


def test_channels():
    # conv.jl:93-126 (Flux._channels_in/_channels_out: in_channels/out_channels here)
    for make, cin, cout, groups in [(Conv, 2, 4, 1), (ConvTranspose, 1, 4, 1), (ConvTranspose, 8, 4, 4),
                                    (ConvTranspose, 2, 4, 2), (ConvTranspose, 3, 6, 3), (ConvTranspose, 10, 15, 5)]:
        for kernel in ((3,), (5, 6), (1, 2, 3)):
            m = make(kernel, cin, cout, groups=groups)
            assert (m.in_channels, m.out_channels) == (cin, cout)
    rng = np.random.default_rng(0)
    for make in (Conv, ConvTranspose):
        for _ in range(10):
            groups = int(rng.integers(1, 11))
            kernel = tuple(int(k) for k in rng.integers(1, 6, int(rng.integers(1, 4))))
            cin, cout = int(rng.integers(1, 6)) * groups, int(rng.integers(1, 6)) * groups
            m = make(kernel, cin, cout, groups=groups)
            assert (m.in_channels, m.out_channels) == (cin, cout)


def test_asymmetric_padding():
    # conv.jl:128-140: Flux's pad=(0, 1, 1, 2) on (W, H) is (top, bottom, left, right) = (1, 2, 0, 1); y_hat is
    # Flux's (W, H) slice, so y_hat[i, j] is y[0, 0, j, i] here
    m = Conv((3, 3), 1, 1, relu, pad=(1, 2, 0, 1))
    m.weight[...] = 1.0
    m.bias[...] = 0.0
    y = m(np.ones((1, 1, 28, 28), f32))[0, 0]
    assert y.shape == (29, 27)                                        # Flux's (27, 29)
    assert y[0, 0] == 6.0 and y[1, 1] == 9.0 and y[0, -1] == 4.0 and y[-1, 0] == 3.0 and y[-2, 0] == 6.0
    assert y[-1, -1] == 2.0


def test_depthwise_conv():
    # conv.jl:142-155
    r = np.zeros((5, 3, 28, 28), f32)
    assert DepthwiseConv((2, 2), 3, 15)(r).shape[1] == 15
    assert DepthwiseConv((3, 2), 3, 9)(r).shape[1] == 9
    assert DepthwiseConv((3, 2), 3, 9, bias=False)(r).shape[1] == 9
    with pytest.raises(ValueError, match=r"DepthwiseConv: cout == 10 must be a multiple of cin == 3"):
        DepthwiseConv((2, 2), 3, 10)


def test_conv_transpose():
    # conv.jl:157-214
    x = np.zeros((1, 1, 5, 5), f32)
    y = Conv((3, 3), 1, 1)(x)
    assert ConvTranspose((3, 3), 1, 1)(y).shape == ConvTranspose((3, 3), 1, 1, bias=False)(y).shape == x.shape
    gradient(lambda m: m(x).sum(), ConvTranspose((3, 3), 1, 1))       # Flux issue 900: does not throw
    gradient(lambda m: m(np.zeros((4, 2, 5, 5), f32)).sum(), ConvTranspose((3, 3), 2, 3))
    x = randn32(3, 2, 10, 10)
    m1 = ConvTranspose((3, 3), 2, 4, pad="same")
    assert m1.weight.shape == (2, 4, 3, 3) and m1(x).shape == (3, 4, 10, 10)   # Flux's (3, 3, 4, 2)
    m2 = ConvTranspose((3, 3), 2, 4, groups=2, pad="same")
    assert m2.weight.shape == (2, 2, 3, 3) and m2(x).shape == m1(x).shape
    gradient(lambda m: m(x).sum(), m2)
    m = ConvTranspose((3,), 2, 4, pad="same", groups=2)
    assert m(randn32(1, 2, 10)).shape == (1, 4, 10) and m.weight.size == 3 * 2 * 4 // 2
    m = ConvTranspose((5, 3), 4, 4, pad="same", groups=4)
    assert m(randn32(2, 4, 11, 10)).shape == (2, 4, 11, 10) and m.weight.size == 3 * 5 * 4 * 4 // 4
    m = ConvTranspose((3, 5, 3), 3, 6, pad="same", groups=3)
    assert m(randn32(2, 3, 12, 11, 10)).shape == (2, 6, 12, 11, 10) and m.weight.size == 3 * 5 * 3 * 3 * 6 // 3
    shown = repr(ConvTranspose((3, 3), 2, 4, groups=2))
    assert "groups=2" in shown and "2 => 4" in shown
    x = randn32(2, 3, 11, 10)
    m1 = ConvTranspose((5, 3), 3, 6, stride=3)
    m2 = ConvTranspose((5, 3), 3, 6, stride=3, output_padding=(0, 1))   # Flux's outpad=(1, 0)
    assert m2(x).shape[2:] == (m1(x).shape[2], m1(x).shape[3] + 1)
    x = randn32(2, 3, 12, 11, 10)
    m1 = ConvTranspose((3, 5, 3), 3, 6, stride=3)
    m2 = ConvTranspose((3, 5, 3), 3, 6, stride=3, output_padding=(1, 0, 1))
    assert m2(x).shape[2:] == tuple(a + b for a, b in zip(m1(x).shape[2:], (1, 0, 1)))


def test_crosscor():
    # conv.jl:216-236
    x = np.random.default_rng(1).random((1, 1, 28, 28)).astype(f32)
    w = np.random.default_rng(2).random((1, 1, 2, 2)).astype(f32)
    y = CrossCor(w, np.zeros(1, f32))
    assert float((w * x[:, :, :2, :2]).sum()) == pytest.approx(float(y(x)[0, 0, 0, 0]), rel=2e-7)
    m = Chain(CrossCor((2, 2), 1, 16, relu), MaxPool((2, 2)), CrossCor((2, 2), 16, 8, relu, bias=False),
              MaxPool((2, 2)), flatten, Dense(288, 10), softmax)
    assert m(np.zeros((5, 1, 28, 28), f32)).shape == (5, 10)
    assert not np.array_equal(y(x), Conv(w, np.zeros(1, f32))(x))
    np.testing.assert_allclose(CrossCor(w[:, :, ::-1, ::-1].copy(), np.zeros(1, f32))(x),
                               Conv(w, np.zeros(1, f32))(x), rtol=1e-6)


def test_conv_with_non_square_window():
    # conv.jl:238-259 (Flux issue 700): a one-hot image gives the (flipped) kernel back
    data = np.zeros((1, 1, 7, 7), f32)
    data[0, 0, 3, 3] = 1
    for kernel, out, where in [((3, 3), (5, 5), (slice(1, 4), slice(1, 4))),
                               ((1, 3), (7, 5), (slice(3, 4), slice(1, 4))),     # Flux's (3, 1)
                               ((3, 1), (5, 7), (slice(1, 4), slice(3, 4)))]:    # Flux's (1, 3)
        layer = Conv(kernel, 1, 1)
        expected = np.zeros((1, 1) + out, f32)
        expected[(0, 0) + where] = layer.weight[0, 0]
        np.testing.assert_allclose(layer(data), expected, rtol=1e-6)
    Conv((1, 6), 1, 1, fluxpy.sigmoid)(randn32(1, 1, 10, 10))           # does not throw


@pytest.mark.parametrize("make", [Conv, ConvTranspose, DepthwiseConv, CrossCor])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_symmetric_non_constant_padding(make, nd):
    # conv.jl:261-272: one pad per axis means that pad on both sides
    kernel = (3,) * nd
    data = np.ones((1, 1) + tuple(k + 5 for k in kernel), f32)
    pad = tuple(range(1, nd + 1))
    expanded = tuple(p for p in pad for _ in range(2))
    assert make(kernel, 1, 1, pad=pad)(data).shape == make(kernel, 1, 1, pad=expanded)(data).shape


@pytest.mark.parametrize("make", [Conv, ConvTranspose, DepthwiseConv, CrossCor])
@pytest.mark.parametrize("k", [(1,), (2,), (3,), (5, 4), (8, 7, 6)])
def test_same_pad(make, k):
    # conv.jl:274-290 (Flux's (4, 5) and (6, 7, 8) kernels reversed)
    data = np.ones((1, 1) + tuple(n + 3 for n in k), f32)
    assert make(k, 1, 1, pad="same")(data).shape == data.shape
    dilation = tuple(max(n // 2, 1) for n in k)   # Flux's k .÷ 2, where a 0 (k = 1) would be refused by both
    if min(n // 2 for n in k) >= 1:
        assert make(k, 1, 1, pad="same", dilation=dilation)(data).shape == data.shape
    y = make(k, 1, 1, pad="same", stride=3)(data)
    if make is ConvTranspose:
        assert y.shape[2:] == tuple(3 * n for n in data.shape[2:])
    else:
        assert y.shape[2:] == tuple(-(-n // 3) for n in data.shape[2:])


@pytest.mark.parametrize("make", [MeanPool, MaxPool])
@pytest.mark.parametrize("k", [(1,), (2,), (3,), (5, 4), (8, 7, 6)])
def test_same_pad_pools(make, k):
    # conv.jl:292-298
    data = np.ones((1, 1) + tuple(n + 3 for n in k), f32)
    assert make(k, pad="same")(data).shape[2:] == tuple(-(-n // w) for n, w in zip(data.shape[2:], k))


def test_bias_follows_the_weight_type():
    # conv.jl:300-303 (Flux issue 1421), 305-316 (constructors from weights; Flux's arrays reversed)
    randn = lambda *s, rng=None: np.random.default_rng(0).standard_normal(s)   # noqa: E731
    assert Conv((5, 5), 10, 20, fluxpy.identity, init=randn).bias.dtype == np.float64
    r = np.random.default_rng(3)
    for make in (Conv, CrossCor, ConvTranspose, DepthwiseConv):
        assert make(r.random((4, 3, 2))).bias.dtype == np.float64
        assert make(r.random((5, 4, 3, 2)), False).bias is None
        with pytest.raises(ValueError, match=r"bias must be True, False or an array of shape"):
            make(r.random((4, 3, 2)), r.random(6))
    assert Conv(r.random((6, 5, 4, 3, 2)), r.random(6)).bias.dtype == np.float64
    d = DepthwiseConv(r.random((6, 5, 4, 3, 2)), r.random(30))        # Flux's (2, 3, 4, 5, 6): cin 6, 5 per channel
    assert d.bias.dtype == np.float64 and (d.in_channels, d.out_channels) == (6, 30)


def test_type_matching_is_an_error_in_fluxpy():
    # conv.jl:318-333: Flux converts float64 and integer input to the layer's float32; fluxpy raises
    x = np.random.default_rng(4).random((5, 2, 10))
    for layer in (Conv((3,), 2, 4, relu), CrossCor((3,), 2, 1, relu), ConvTranspose((3,), 2, 4, relu)):
        with pytest.raises(DTypeMismatch, match=r"expects x of dtype float32 \(its parameters' dtype\)"):
            layer(x)
        assert layer(x.astype(f32)).dtype == np.float32


def test_depthwise_weight_against_a_grouped_conv_in_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 2, 2, 3))                              # (cin, cout/cin, kh, kw)
    x = rng.standard_normal((2, 3, 5, 6))
    d = DepthwiseConv(w, False)
    t = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w.reshape(6, 1, 2, 3)).flip(-1, -2), groups=3)
    np.testing.assert_allclose(d(x), t.numpy(), rtol=1e-13)
