"""Layers: shapes, reprs, error messages, gradients (float64 finite differences), modes, containers."""
import functools
import operator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy.functors import fmap, trainables
from fluxpy.layers import (AdaptiveMaxPool, AdaptiveMeanPool, BatchNorm, Chain, Conv, ConvTranspose, CrossCor,
                           Dense, DimensionMismatch, Dropout, Embedding, GlobalMaxPool, GlobalMeanPool, LayerNorm,
                           MaxPool, MeanPool, Parallel, SkipConnection, f32, f64, flatten, glorot_normal,
                           glorot_uniform, istraining, kaiming_normal, kaiming_uniform, nfan, ones32, randn32,
                           testmode, trainmode, zeros32)
from fluxpy.ops.activations import gelu, identity, leakyrelu, relu, sigmoid, tanh
from gradcheck import check_grad

seeds = st.integers(0, 2**31 - 1)
ACTS = [identity, relu, tanh, sigmoid, gelu]


def reference_net():
    return Chain(Conv((3, 3), 1, 16, relu, pad=1), MaxPool((2, 2)), Conv((3, 3), 16, 32, relu, pad=1), MaxPool((2, 2)),
                 Conv((3, 3), 32, 32, relu, pad=1), MaxPool((2, 2)), flatten, Dense(288, 10))


def check_layer(layer, x, rng=None, wrt_x=True, **kw):
    """Finite-difference check of ``layer(x)`` in float64 with respect to ``x`` and every trainable array.

    Also checks that ``fluxpy.gradient`` of the model itself (the dict tree) gives the same numbers.
    """
    layer = f64(layer)
    params = trainables(layer)

    def with_params(*ps):
        lookup = {id(p): q for p, q in zip(params, ps)}
        return fmap(lambda a: lookup.get(id(a), a), layer)

    def f(x, *ps):
        return with_params(*ps)(x)
    args = (x, *params)
    wrt = list(range(len(args))) if wrt_x else list(range(1, len(args)))
    grads = check_grad(f, *args, rng=rng, wrt=wrt, **kw)
    return layer, grads


def x64(rng, *shape):
    return rng.standard_normal(shape)


def f32_input(*shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Initialisers


def test_nfan_and_initialiser_scales():
    assert nfan(10, 288) == (288, 10)
    assert nfan(16, 1, 3, 3) == (9, 144)
    assert nfan(5) == (1, 5)
    rng = np.random.default_rng(0)
    w = glorot_uniform(200, 300, rng=rng)
    assert w.dtype == np.float32 and w.shape == (200, 300)
    assert abs(w).max() <= np.sqrt(6 / 500) and abs(w).max() > 0.9 * np.sqrt(6 / 500)
    assert np.std(glorot_normal(200, 300, rng=rng)) == pytest.approx(np.sqrt(2 / 500), rel=0.05)
    assert np.std(kaiming_normal((64, 32, 3, 3), rng=rng)) == pytest.approx(np.sqrt(2 / 288), rel=0.05)
    assert abs(kaiming_uniform(100, 50, rng=rng)).max() <= np.sqrt(2) * np.sqrt(3 / 50)
    assert randn32(3, rng=0).dtype == np.float32
    assert zeros32(2, 3).sum() == 0 and ones32((2, 3)).sum() == 6


def test_initialisers_reproducible_with_seed():
    np.testing.assert_array_equal(glorot_uniform(3, 4, rng=7), glorot_uniform(3, 4, rng=7))
    np.testing.assert_array_equal(Dense(3, 4, rng=1).weight, Dense(3, 4, rng=1).weight)


# ---------------------------------------------------------------------------------------------
# repr


@pytest.mark.parametrize("layer, text", [
    (Dense(288, 10), "Dense(288 => 10)"),
    (Dense(2, 3, relu, bias=False), "Dense(2 => 3, relu, bias=False)"),
    (Dense(2, 3, functools.partial(leakyrelu, a=0.2)), "Dense(2 => 3, partial(leakyrelu, a=0.2))"),
    (Conv((3, 3), 1, 16, relu, pad=1), "Conv((3, 3), 1 => 16, relu, pad=1)"),
    (Conv((3, 3), 2, 3), "Conv((3, 3), 2 => 3)"),
    (Conv((5, 3), 4, 8, stride=2, pad=(1, 2), dilation=2, groups=2, bias=False),
     "Conv((5, 3), 4 => 8, pad=(1, 2), stride=2, dilation=2, groups=2, bias=False)"),
    (Conv((3, 3), 1, 1, pad="same"), 'Conv((3, 3), 1 => 1, pad="same")'),
    (CrossCor((3, 3), 1, 16, tanh), "CrossCor((3, 3), 1 => 16, tanh)"),
    (ConvTranspose((2, 2), 8, 4, relu, stride=2), "ConvTranspose((2, 2), 8 => 4, relu, stride=2)"),
    (MaxPool((2, 2)), "MaxPool((2, 2))"),
    (MaxPool((3, 3), stride=1, pad=1), "MaxPool((3, 3), pad=1, stride=1)"),
    (MeanPool((2, 2)), "MeanPool((2, 2))"),
    (GlobalMaxPool(), "GlobalMaxPool()"),
    (GlobalMeanPool(), "GlobalMeanPool()"),
    (AdaptiveMeanPool((5, 5)), "AdaptiveMeanPool((5, 5))"),
    (AdaptiveMaxPool((2, 3)), "AdaptiveMaxPool((2, 3))"),
    (BatchNorm(16), "BatchNorm(16)"),
    (BatchNorm(16, relu, momentum=0.2), "BatchNorm(16, relu, momentum=0.2)"),
    (LayerNorm(5), "LayerNorm(5)"),
    (LayerNorm((2, 3), affine=False), "LayerNorm((2, 3), affine=False)"),
    (Dropout(0.5), "Dropout(0.5)"),
    (Dropout(0.2, dims=1), "Dropout(0.2, dims=1)"),
    (Embedding(10, 4), "Embedding(10 => 4)"),
    (SkipConnection(Dense(2, 2), operator.add), "SkipConnection(Dense(2 => 2), +)"),
    (Parallel(operator.add, Dense(2, 2), Dense(2, 2)), "Parallel(+, Dense(2 => 2), Dense(2 => 2))"),
])
def test_repr(layer, text):
    assert repr(layer) == text


def test_chain_repr_counts_parameters_like_flux():
    text = repr(reference_net())
    lines = text.splitlines()
    assert lines[0] == "Chain("
    assert lines[1].startswith("  Conv((3, 3), 1 => 16, relu, pad=1),") and lines[1].endswith("# 160 parameters")
    assert lines[7] == "  flatten,"
    assert lines[8].endswith("# 2_890 parameters")
    assert lines[-1].startswith(")") and "# Total: 8 arrays, 16_938 parameters" in lines[-1]


def test_chain_repr_nested_and_non_trainable():
    text = repr(Chain(Dense(2, 4), BatchNorm(4), Chain(Dense(4, 2), Dense(2, 1))))
    assert "BatchNorm(4)," in text and "# 8 parameters, plus 8 non-trainable" in text
    assert "\n  Chain(\n    Dense(4 => 2)," in text
    assert "plus 2 non-trainable" in text.splitlines()[-1]


# ---------------------------------------------------------------------------------------------
# Shapes


@pytest.mark.parametrize("layer, shape, out", [
    (Dense(3, 5), (7, 3), (7, 5)),
    (Dense(3, 5), (3,), (5,)),
    (Dense(3, 5), (2, 4, 3), (2, 4, 5)),
    (Conv((3, 3), 2, 4), (1, 2, 9, 9), (1, 4, 7, 7)),
    (Conv((3, 3), 2, 4, pad="same", stride=2), (1, 2, 9, 9), (1, 4, 5, 5)),
    (Conv((3, 3), 4, 6, groups=2, dilation=2), (2, 4, 9, 9), (2, 6, 5, 5)),
    (CrossCor((1, 1), 2, 3), (1, 2, 4, 4), (1, 3, 4, 4)),
    (ConvTranspose((3, 3), 2, 4, stride=2, pad=1, output_padding=1), (1, 2, 5, 5), (1, 4, 10, 10)),
    (MaxPool((2, 2)), (2, 3, 7, 7), (2, 3, 3, 3)),
    (MeanPool((3, 3), stride=1, pad=1), (2, 3, 7, 7), (2, 3, 7, 7)),
    (GlobalMaxPool(), (2, 3, 7, 5), (2, 3, 1, 1)),
    (GlobalMeanPool(), (2, 3, 7, 5), (2, 3, 1, 1)),
    (AdaptiveMeanPool((2, 3)), (2, 3, 7, 5), (2, 3, 2, 3)),
    (AdaptiveMaxPool((2, 3)), (2, 3, 7, 5), (2, 3, 2, 3)),
    (BatchNorm(3), (4, 3, 5, 5), (4, 3, 5, 5)),
    (BatchNorm(3), (4, 3), (4, 3)),
    (LayerNorm((4, 5)), (2, 3, 4, 5), (2, 3, 4, 5)),
    (Dropout(0.5), (2, 3), (2, 3)),
    (reference_net(), (3, 1, 28, 28), (3, 10)),
])
def test_output_shape_and_dtype(layer, shape, out):
    y = layer(f32_input(*shape))
    assert y.shape == out
    assert y.dtype == np.float32


def test_flatten():
    assert flatten(np.ones((4, 2, 3, 3))).shape == (4, 18)
    assert flatten(np.ones((4,))).shape == (4, 1)


def test_embedding_rows():
    e = Embedding(5, 3)
    idx = np.array([[0, 4], [4, 2]])
    np.testing.assert_array_equal(e(idx), e.weight[idx])
    assert e(3).shape == (3,)


# ---------------------------------------------------------------------------------------------
# Error messages


def test_conv_error_message_exact():
    with pytest.raises(DimensionMismatch) as err:
        Conv((3, 3), 2, 3)(np.ones((5, 4, 9, 9), np.float32))
    assert str(err.value) == "Conv((3, 3), 2 => 3) expects x.shape[1] == 2, got (5, 4, 9, 9) float32"


def test_dense_error_message_exact():
    with pytest.raises(DimensionMismatch) as err:
        Dense(2, 3)(np.ones((5, 4), np.float32))
    assert str(err.value) == "Dense(2 => 3) expects x.shape[-1] == 2, got (5, 4) float32"


def test_chain_error_names_the_layer_index():
    model = Chain(Dense(4, 3), Dense(3, 2), Conv((3, 3), 2, 3))
    with pytest.raises(DimensionMismatch) as err:
        model(np.ones((5, 4), np.float32))
    assert str(err.value) == "Chain layer 2: Conv((3, 3), 2 => 3) expects a 4-d input (N, C, H, W), got (5, 2) float32"
    with pytest.raises(DimensionMismatch, match=r"^Chain layer 1: Chain layer 0: Dense\(5 => 1\) expects"):
        Chain(Dense(1, 2), Chain(Dense(5, 1)))(np.ones((1, 1), np.float32))


@pytest.mark.parametrize("layer, x, message", [
    (CrossCor((3, 3), 2, 3, relu), np.ones((5, 4, 9, 9), np.float32),
     "CrossCor((3, 3), 2 => 3, relu) expects x.shape[1] == 2, got (5, 4, 9, 9) float32"),
    (Conv((3, 3), 2, 3), np.ones((4, 2, 9), np.float64),
     "Conv((3, 3), 2 => 3) expects a 4-d input (N, C, H, W), got (4, 2, 9) float64"),
    (ConvTranspose((2, 2), 8, 4), np.ones((1, 3, 5, 5), np.float32),
     "ConvTranspose((2, 2), 8 => 4) expects x.shape[1] == 8, got (1, 3, 5, 5) float32"),
    (BatchNorm(3), np.ones((2, 4), np.float32),
     "BatchNorm(3) expects x.shape[1] == 3 (x of shape (N, C, ...)), got (2, 4) float32"),
    (LayerNorm(3), np.ones((2, 4), np.float32), "LayerNorm(3) expects x.shape[-1:] == (3,), got (2, 4) float32"),
    (Embedding(5, 2), np.array([0, 5]), "Embedding(5 => 2) expects indices in [0, 5), found indices from 0 to 5 in x, got (2,) int64"),
    (Embedding(5, 2), np.array([0.5]),
     "Embedding(5 => 2) expects integer indices, or one-hot rows of length 5 (the last axis), got (1,) float64"),
    (MaxPool((2, 2)), np.ones((1, 2, 4), np.float32), "MaxPool((2, 2)) expects a 4-d input (N, C, H, W), got (1, 2, 4) float32"),
    (Dense(2, 3), [1.0, 2.0], "Dense(2 => 3) expects x.shape[-1] == 2, got a list"),
])
def test_error_messages(layer, x, message):
    with pytest.raises(DimensionMismatch) as err:
        layer(x)
    assert str(err.value) == message


@pytest.mark.parametrize("layer, shape, fragment", [
    (Conv((5, 5), 1, 2), (1, 1, 3, 3), "Conv((5, 5), 1 => 2) expects the padded input (3, 3) to be at least"),
    (MaxPool((5, 5)), (1, 1, 3, 3), "MaxPool((5, 5)) expects the padded input (3, 3) to be at least the kernel"),
    (ConvTranspose((3, 3), 1, 1, pad=3), (1, 1, 2, 2), "ConvTranspose((3, 3), 1 => 1, pad=3) expects a positive output"),
    (AdaptiveMaxPool((2, 2)), (1, 1, 0, 3), "AdaptiveMaxPool((2, 2)) expects a non-empty image"),
])
def test_spatial_errors_name_the_layer(layer, shape, fragment):
    with pytest.raises(DimensionMismatch) as err:
        layer(np.ones(shape, np.float32))
    assert str(err.value).startswith(fragment)


def test_error_raised_before_any_kernel(monkeypatch):
    import fluxpy.layers.basic
    import fluxpy.layers.conv

    def boom(*args, **kw):
        raise AssertionError("a kernel ran")
    monkeypatch.setattr(fluxpy.layers.conv, "conv_bias_act", boom)
    monkeypatch.setattr(fluxpy.layers.basic, "matmul", boom)
    with pytest.raises(DimensionMismatch):
        Conv((3, 3), 2, 3)(np.ones((5, 4, 9, 9), np.float32))
    with pytest.raises(DimensionMismatch):
        Conv((3, 3), 2, 3)(np.ones((5, 2, 1, 9), np.float32))
    with pytest.raises(DimensionMismatch):
        Dense(2, 3)(np.ones((5, 4), np.float32))


def test_constructor_errors():
    with pytest.raises(ValueError, match="groups == 3 must divide"):
        Conv((3, 3), 4, 6, groups=3)
    with pytest.raises(ValueError, match="kernel must be"):
        Conv((3, 0), 1, 1)
    with pytest.raises(ValueError, match=r"p must be a probability"):
        Dropout(1.5)


# ---------------------------------------------------------------------------------------------
# Chain as a sequence


def test_chain_indexing_slicing_iteration():
    layers = [Dense(2, 3), Dense(3, 4), Dense(4, 5)]
    model = Chain(*layers)
    assert len(model) == 3
    assert model[0] is layers[0] and model[-1] is layers[2]
    tail = model[1:]
    assert isinstance(tail, Chain) and len(tail) == 2 and tail[0] is layers[1]
    assert list(model) == layers
    x = f32_input(6, 2)
    np.testing.assert_allclose(model(x), model[1:](model[0](x)), rtol=1e-6)
    assert Chain(layers).layers == tuple(layers)
    with pytest.raises(TypeError, match="not callable"):
        Chain(Dense(2, 3), 5)


def test_chain_of_functions_and_gradient_structure():
    model = Chain(Dense(2, 3, relu), lambda x: x * 2, Dense(3, 1))
    g, = fluxpy.gradient(lambda m: m(f32_input(4, 2)).sum(), model)
    assert set(g) == {"layers"}
    assert g["layers"][1] is None
    assert g["layers"][0]["weight"].shape == (3, 2) and g["layers"][2]["bias"].shape == (1,)


# ---------------------------------------------------------------------------------------------
# Gradients against finite differences (float64)


@given(seed=seeds, batch=st.integers(1, 3), nin=st.integers(1, 4), nout=st.integers(1, 4),
       act=st.sampled_from(ACTS), bias=st.booleans())
def test_dense_gradient(seed, batch, nin, nout, act, bias):
    rng = np.random.default_rng(seed)
    check_layer(Dense(nin, nout, act, bias=bias, rng=rng), x64(rng, batch, nin) + 0.05, rng=rng)


@st.composite
def conv_config(draw):
    groups = draw(st.sampled_from([1, 2]))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = draw(st.integers(1, 2))
    dilation = draw(st.integers(1, 2))
    pad = draw(st.sampled_from([0, 1, (1, 0), (0, 1, 1, 0)]))
    hw = (draw(st.integers(5, 7)), draw(st.integers(5, 7)))
    return dict(kernel=kernel, cin=cin, cout=cout, stride=stride, dilation=dilation, pad=pad, groups=groups, hw=hw)


@given(cfg=conv_config(), seed=seeds, cls=st.sampled_from([Conv, CrossCor]), act=st.sampled_from([identity, tanh]))
def test_conv_gradient(cfg, seed, cls, act):
    rng = np.random.default_rng(seed)
    layer = cls(cfg["kernel"], cfg["cin"], cfg["cout"], act, stride=cfg["stride"], pad=cfg["pad"],
                dilation=cfg["dilation"], groups=cfg["groups"], rng=rng)
    layer.bias = rng.standard_normal(layer.bias.shape).astype(np.float32)
    check_layer(layer, x64(rng, 2, cfg["cin"], *cfg["hw"]), rng=rng)


@given(cfg=conv_config(), seed=seeds)
def test_conv_transpose_gradient(cfg, seed):
    rng = np.random.default_rng(seed)
    layer = ConvTranspose(cfg["kernel"], cfg["cin"], cfg["cout"], tanh, stride=cfg["stride"], pad=0,
                          dilation=cfg["dilation"], groups=cfg["groups"], rng=rng)
    check_layer(layer, x64(rng, 2, cfg["cin"], 3, 4), rng=rng)


def test_conv_is_true_convolution_and_crosscor_is_not():
    x = np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3)
    w = np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)
    conv, cross = Conv((2, 2), 1, 1, bias=False), CrossCor((2, 2), 1, 1, bias=False)
    conv.weight, cross.weight = w, w
    expected_cross = np.array([[19, 25], [37, 43]], np.float32)
    np.testing.assert_allclose(cross(x)[0, 0], expected_cross)
    cross.weight = w[:, :, ::-1, ::-1].copy()
    np.testing.assert_allclose(conv(x), cross(x))


@given(seed=seeds, kernel=st.integers(1, 3), stride=st.integers(1, 2), pool=st.sampled_from([MaxPool, MeanPool]))
def test_pool_gradient(seed, kernel, stride, pool):
    rng = np.random.default_rng(seed)
    pad = 1 if kernel > 1 and pool is MeanPool else 0
    check_layer(pool((kernel, kernel), stride=stride, pad=pad), x64(rng, 2, 2, 5, 6), rng=rng)


@given(seed=seeds, pool=st.sampled_from([GlobalMaxPool(), GlobalMeanPool(), AdaptiveMaxPool((2, 3)),
                                         AdaptiveMeanPool((3, 2))]))
def test_global_and_adaptive_pool_gradient(seed, pool):
    rng = np.random.default_rng(seed)
    check_layer(pool, x64(rng, 2, 2, 5, 6), rng=rng)


@given(seed=seeds, shape=st.sampled_from([(4, 3), (2, 3, 2, 2)]), act=st.sampled_from([identity, tanh]))
def test_batchnorm_gradient_train_and_test(seed, shape, act):
    rng = np.random.default_rng(seed)
    bn = BatchNorm(shape[1], act)
    bn.gamma = rng.uniform(0.5, 1.5, shape[1]).astype(np.float32)
    bn.beta = rng.standard_normal(shape[1]).astype(np.float32)
    spread = np.linspace(-1, 1, shape[0]).reshape((-1,) + (1,) * (len(shape) - 1))  # batch variances >> eps
    check_layer(trainmode(bn), x64(rng, *shape) + spread, rng=rng)
    bn.running_mean = rng.standard_normal(shape[1]).astype(np.float32)
    check_layer(testmode(bn), x64(rng, *shape), rng=rng)


@given(seed=seeds, shape=st.sampled_from([3, (2, 3)]), affine=st.booleans())
def test_layernorm_gradient(seed, shape, affine):
    rng = np.random.default_rng(seed)
    ln = LayerNorm(shape, affine=affine)
    if affine:
        ln.gamma = rng.uniform(0.5, 1.5, ln.gamma.shape).astype(np.float32)
        ln.beta = rng.standard_normal(ln.beta.shape).astype(np.float32)
    # A spread along the normalised axes keeps every variance well above eps (else finite differences fail).
    x = x64(rng, 2, *ln.shape) + np.linspace(-1, 1, np.prod(ln.shape)).reshape(ln.shape)
    check_layer(ln, x, rng=rng)


@given(seed=seeds, dims=st.sampled_from([None, 1, (0, 1)]))
def test_dropout_gradient(seed, dims):
    rng = np.random.default_rng(seed)

    def fixed_mask_dropout(x):  # the same mask on every call, so finite differences see one function
        return Dropout(0.4, dims=dims, rng=np.random.default_rng(seed), active=True)(x)
    check_grad(fixed_mask_dropout, x64(rng, 3, 4, 2), rng=rng)


@given(seed=seeds)
def test_embedding_gradient_scatters_and_accumulates(seed):
    rng = np.random.default_rng(seed)
    emb = f64(Embedding(5, 3, rng=rng))
    idx = np.array([[0, 2], [2, 4]])
    check_grad(lambda w: Embedding.__call__(_with_weight(emb, w), idx), emb.weight, rng=rng)
    g, = fluxpy.gradient(lambda m: m(idx).sum(), emb)
    np.testing.assert_array_equal(g["weight"][:, 0], [1, 0, 2, 0, 1])


def _with_weight(emb, w):
    out = Embedding.__new__(Embedding)
    out.weight = w
    return out


@given(seed=seeds)
def test_skipconnection_and_parallel_gradient(seed):
    rng = np.random.default_rng(seed)
    skip = SkipConnection(Chain(Dense(3, 3, tanh, rng=rng), Dense(3, 3, rng=rng)), operator.add)
    check_layer(skip, x64(rng, 2, 3), rng=rng)
    par = Parallel(lambda a, b: fluxpy.concatenate([a, b], axis=1), Dense(3, 2, rng=rng), Dense(3, 4, tanh, rng=rng))
    layer, _ = check_layer(par, x64(rng, 2, 3), rng=rng)
    assert layer(x64(rng, 2, 3)).shape == (2, 6)
    a, b = x64(rng, 2, 3).astype(np.float32), x64(rng, 5, 3).astype(np.float32)
    assert Parallel(lambda u, v: (u.shape, v.shape), Dense(3, 2), Dense(3, 4))(a, b) == ((2, 2), (5, 4))


def test_reference_net_gradient():
    rng = np.random.default_rng(0)
    model = Chain(Conv((3, 3), 1, 4, relu, pad=1, rng=rng), MaxPool((2, 2)), Conv((3, 3), 4, 4, tanh, pad=1, rng=rng),
                  MeanPool((2, 2)), flatten, Dense(16, 3, rng=rng))
    check_layer(model, x64(rng, 2, 1, 8, 8), rng=rng, wrt_x=False)


# ---------------------------------------------------------------------------------------------
# Train / test modes


def test_istraining_only_inside_gradient():
    seen = []
    fluxpy.gradient(lambda x: (seen.append(istraining(x)), x.sum())[1], np.ones(2))
    assert seen == [True] and not istraining(np.ones(2))


def test_dropout_modes():
    x = np.ones((20, 20), np.float32)
    d = Dropout(0.5, rng=0)
    assert d(x) is x  # auto, outside gradient: off
    g, = fluxpy.gradient(lambda x: d(x).sum(), x)
    assert set(np.unique(g)) == {0.0, 2.0}  # auto, inside gradient: on
    trainmode(d)
    assert set(np.unique(d(x))) == {0.0, 2.0}
    testmode(d)
    g, = fluxpy.gradient(lambda x: d(x).sum(), x)
    np.testing.assert_array_equal(g, 1)
    testmode(d, "auto")
    assert d.active is None
    trainmode(d, False)
    assert d.active is False
    with pytest.raises(ValueError, match="mode must be"):
        trainmode(d, "yes")


def test_batchnorm_running_stats_update_only_in_train_mode():
    rng = np.random.default_rng(0)
    model = Chain(Dense(3, 4, rng=rng), BatchNorm(4))
    bn = model[1]
    x = (rng.standard_normal((32, 3)) * 3 + 1).astype(np.float32)
    model(x)  # auto mode outside gradient: test mode
    np.testing.assert_array_equal(bn.running_mean, 0)
    np.testing.assert_array_equal(bn.running_var, 1)

    h = model[0](x)
    g, = fluxpy.gradient(lambda m: m(x).sum(), model)  # inside gradient: training
    np.testing.assert_allclose(bn.running_mean, 0.1 * h.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.running_var, 0.9 + 0.1 * h.var(axis=0, ddof=1), rtol=1e-5)
    assert g["layers"][1]["running_mean"] is None
    assert g["layers"][1]["gamma"].shape == (4,)

    before = bn.running_mean.copy()
    testmode(model)
    fluxpy.gradient(lambda m: m(x).sum(), model)
    np.testing.assert_array_equal(bn.running_mean, before)  # test mode inside gradient: frozen
    y = model(x)
    np.testing.assert_allclose(y, (h - bn.running_mean) / np.sqrt(bn.running_var + 1e-5), rtol=1e-4, atol=1e-5)

    trainmode(model)
    model(x)  # train mode outside gradient: batch statistics, and the stats move
    assert not np.array_equal(bn.running_mean, before)
    out = model(x)
    np.testing.assert_allclose(out.mean(axis=0), 0, atol=1e-5)


def test_batchnorm_without_tracking_uses_batch_stats():
    bn = BatchNorm(2, track_stats=False, affine=False)
    x = np.array([[0.0, 1.0], [2.0, 5.0]], np.float32)
    np.testing.assert_allclose(bn(x), [[-1, -1], [1, 1]], atol=1e-4)
    assert repr(bn) == "BatchNorm(2, affine=False, track_stats=False)"


# ---------------------------------------------------------------------------------------------
# Conversions and devices


def test_f64_f32_and_cpu_roundtrip():
    model = Chain(Conv((3, 3), 1, 2), BatchNorm(2), flatten, Dense(2 * 26 * 26, 3), Embedding(3, 2))
    m64 = f64(model)
    assert all(a.dtype == np.float64 for a in trainables(m64))
    assert m64[1].running_var.dtype == np.float64
    assert m64[0].weight is not model[0].weight and model[0].weight.dtype == np.float32
    assert all(a.dtype == np.float32 for a in trainables(f32(m64)))
    moved = fluxpy.cpu(model)
    assert repr(moved) == repr(model)


def _compare_on_gpu(model, x, loss=lambda y: (y * y).sum()):
    """Forward and gradient of ``model`` on the GPU against the CPU (train mode, so BatchNorm uses batch stats)."""
    import cupy
    gm = fluxpy.gpu(model)
    assert all(isinstance(a, cupy.ndarray) for a in trainables(gm))
    xg = cupy.asarray(x)
    np.testing.assert_allclose(cupy.asnumpy(gm(xg)), model(x), rtol=1e-4, atol=1e-5)
    g_cpu, = fluxpy.gradient(lambda m: loss(m(x)), model)
    g_gpu, = fluxpy.gradient(lambda m: loss(m(xg)), gm)
    for a, b in zip(trainables(fluxpy.cpu(g_gpu)), trainables(g_cpu)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
    return gm


@pytest.mark.gpu
def test_dense_norm_embedding_layers_on_gpu_match_cpu():
    import cupy
    rng = np.random.default_rng(0)
    model = Chain(Dense(5, 8, tanh, rng=rng), BatchNorm(8, relu), LayerNorm(8), Dense(8, 3, rng=rng))
    gm = _compare_on_gpu(model, f32_input(6, 5))
    assert isinstance(gm[1].running_mean, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(gm[1].running_mean), model[1].running_mean, rtol=1e-4, atol=1e-6)
    emb = Embedding(7, 3, rng=rng)
    idx = np.array([[0, 6], [6, 2]])
    np.testing.assert_array_equal(cupy.asnumpy(fluxpy.gpu(emb)(cupy.asarray(idx))), emb(idx))
    g, = fluxpy.gradient(lambda m: m(cupy.asarray(idx)).sum(), fluxpy.gpu(emb))
    np.testing.assert_array_equal(cupy.asnumpy(g["weight"])[:, 0], [1, 0, 1, 0, 0, 0, 2])
    d = trainmode(Dropout(0.5))
    assert set(cupy.asnumpy(d(cupy.ones((50, 50), np.float32))).ravel().tolist()) == {0.0, 2.0}


@pytest.mark.gpu
def test_conv_layers_on_gpu_match_cpu():
    rng = np.random.default_rng(0)
    model = Chain(Conv((3, 3), 1, 4, relu, pad=1, rng=rng), MaxPool((2, 2)), CrossCor((3, 3), 4, 4, stride=2, rng=rng),
                  MeanPool((2, 2)), BatchNorm(4), GlobalMeanPool(), flatten, Dense(4, 3, rng=rng))
    _compare_on_gpu(model, f32_input(2, 1, 28, 28))


def test_dropout_on_the_data_trains_inside_gradient_only():
    d = fluxpy.Dropout(0.5, rng=0)
    w = np.ones(1000)
    x = np.ones(1000)
    assert np.array_equal(d(x), x)                     # outside gradient: the identity
    g, = fluxpy.gradient(lambda w: (d(x) * w).sum(), w)
    assert 300 < np.count_nonzero(g) < 700             # inside: about half dropped, though x is not tracked
    assert set(np.unique(g)) <= {0.0, 2.0}


# ---------------------------------------------------------------------------------------------
# The package


def test_package_exports_every_public_name():
    import fluxpy.layers
    assert [name for name in fluxpy.layers.__all__ if not hasattr(fluxpy.layers, name)] == []
    assert DimensionMismatch.__module__ == "fluxpy.layers"   # the name a traceback prints


# Families built from others' layers, and the families they build on (layers/__init__.py's docstring).
COMPOSITES = {"transformer": {"basic", "normalise"}, "reparam": {"normalise"}}


def test_layer_families_import_only_the_shared_modules():
    import ast
    import pathlib

    import fluxpy.layers
    shared = {"init", "show", "_checks"}
    for path in pathlib.Path(fluxpy.layers.__file__).parent.glob("*.py"):
        if path.stem == "__init__":
            continue
        siblings = {node.module for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.level == 1}
        allowed = set() if path.stem in shared | {"convert"} else shared
        if path.stem in COMPOSITES:
            allowed = shared | COMPOSITES[path.stem]
        assert siblings <= allowed, f"{path.name} imports {sorted(siblings - allowed)}"
