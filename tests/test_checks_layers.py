"""Layers refuse bad sizes, options and inputs with errors naming the layer, before any kernel runs and before
any state changes; layers pickle with every activation; `from fluxpy import *` leaves the builtins alone."""
import builtins
import functools
import operator
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy.kernels.halfs import BFLOAT16
from fluxpy.layers import (AdaptiveMaxPool, AdaptiveMeanPool, BatchNorm, Chain, Conv, ConvTranspose, CrossCor,
                           Dense, DimensionMismatch, Dropout, DTypeMismatch, Embedding, GlobalMaxPool, GlobalMeanPool,
                           LayerNorm, MaxPool, MeanPool, Parallel, SkipConnection, f64, flatten, testmode, trainmode)
from fluxpy.ops.activations import elu, gelu, hardtanh, identity, leakyrelu, relu, relu6, sigmoid, softplus, swish


def f32(*shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Constructors


@pytest.mark.parametrize("build, error, message", [
    (lambda: Dense(3.5, 2), ValueError, "Dense: in_features must be a positive int, got 3.5"),
    (lambda: Dense(3, 0), ValueError, "Dense: out_features must be a positive int, got 0"),
    (lambda: Dense(-3, 2), ValueError, "Dense: in_features must be a positive int, got -3"),
    (lambda: Dense(True, 2), ValueError, "Dense: in_features must be a positive int, got True"),
    (lambda: Dense("3", 2), ValueError, "Dense: in_features must be a positive int, got '3'"),
    (lambda: Dense(3, 2, "relu"), TypeError, "Dense: act must be callable (a function such as relu, or None), got 'relu'"),
    (lambda: Dense(3, 2, init=0.1), TypeError, "Dense: init must be callable, got 0.1"),
    (lambda: Dense(3, 2, bias=np.ones(3)), ValueError, "Dense: bias must be True, False or an array of shape (2,)"),
    (lambda: Dense(3, 2, bias=[0.0, 0.0]), ValueError, "Dense: bias must be True, False or an array of shape (2,)"),
    (lambda: Conv((3, 3), 2, 4, groups=0), ValueError, "Conv: groups must be a positive int, got 0"),
    (lambda: Conv((3, 3), 2, 4, groups=1.0), ValueError, "Conv: groups must be a positive int, got 1.0"),
    (lambda: Conv((3, 3), 4, 6, groups=3), ValueError, "Conv: groups == 3 must divide cin == 4 and cout == 6"),
    (lambda: Conv((3, 3), 0, 4), ValueError, "Conv: cin must be a positive int, got 0"),
    (lambda: Conv((3, 3), 2, -4), ValueError, "Conv: cout must be a positive int, got -4"),
    (lambda: Conv(2.5, 1, 1), ValueError, "Conv: kernel must be a positive int or a pair of them, got 2.5"),
    (lambda: Conv((3, 3.0), 1, 1), ValueError, "Conv: kernel must be a positive int or a pair of them, got (3, 3.0)"),
    (lambda: Conv((3, 3, 3, 3), 1, 1), ValueError,
     "Conv: kernel must be a positive int or a tuple of 1, 2 or 3 positive ints (one per spatial axis), got "
     "(3, 3, 3, 3)"),
    (lambda: Conv((3, 3, 3), 1, 1, stride=(1, 2)), ValueError,
     "Conv: stride must be a positive int or a triple of them, got (1, 2)"),
    (lambda: Conv((3,), 1, 1, pad=(1, 1, 1)), ValueError,
     "Conv: pad must be a non-negative int, a 1-tuple (p,), a pair (left, right) or \"same\", got (1, 1, 1)"),
    (lambda: Conv(3, 1, 1, stride=0), ValueError, "Conv: stride must be a positive int or a pair of them, got 0"),
    (lambda: Conv(3, 1, 1, dilation=(1, 0)), ValueError, "Conv: dilation must be a positive int or a pair of them"),
    (lambda: Conv(3, 1, 1, pad=-1), ValueError, "Conv: pad must be a non-negative int, a pair (ph, pw), a 4-tuple"),
    (lambda: Conv(3, 1, 1, pad="valid"), ValueError, "Conv: pad must be a non-negative int, a pair (ph, pw)"),
    (lambda: Conv(3, 1, 1, pad=(1, 1, 1)), ValueError, "Conv: pad must be a non-negative int"),
    (lambda: Conv(3, 1, 1, print), None, None),   # any callable is an activation
    (lambda: Conv(3, 1, 1, "relu"), TypeError, "Conv: act must be callable"),
    (lambda: CrossCor(3, 1, 1, stride=-1), ValueError, "CrossCor: stride must be a positive int"),
    (lambda: CrossCor(3, 2, 2, groups=0), ValueError, "CrossCor: groups must be a positive int, got 0"),
    (lambda: ConvTranspose((2, 2), 8, 4, groups=0), ValueError, "ConvTranspose: groups must be a positive int, got 0"),
    (lambda: ConvTranspose((2, 2), 8, 4, groups=3), ValueError, "ConvTranspose: groups == 3 must divide cin == 8"),
    (lambda: ConvTranspose(2.0, 8, 4), ValueError, "ConvTranspose: kernel must be a positive int or a pair"),
    (lambda: ConvTranspose(2, 8, 4, stride=2, output_padding=2), ValueError,
     "ConvTranspose: output_padding must be smaller than stride (2, 2), got 2"),
    (lambda: ConvTranspose(2, 8, 4, output_padding=-1), ValueError,
     "ConvTranspose: output_padding must be a non-negative int or a pair of them, got -1"),
    (lambda: ConvTranspose(2, 8, 4, stride=2, pad="same", output_padding=1), ValueError,
     "ConvTranspose: output_padding must be 0 with pad=\"same\", got 1"),
    (lambda: ConvTranspose(2, 8, 4, pad=-2), ValueError, "ConvTranspose: pad must be a non-negative int"),
    (lambda: ConvTranspose(2, 8, 4, "tanh"), TypeError, "ConvTranspose: act must be callable"),
    (lambda: MaxPool(0), ValueError, "MaxPool: kernel must be a positive int or a pair of them, got 0"),
    (lambda: MaxPool((2, 2), stride=0), ValueError, "MaxPool: stride must be a positive int or a pair of them, got 0"),
    (lambda: MaxPool((2, 2), pad=(1, 2, 1)), ValueError, "MaxPool: pad must be a non-negative int, a pair"),
    (lambda: MeanPool((2, 2), pad=-1), ValueError, "MeanPool: pad must be a non-negative int"),
    (lambda: MeanPool(2.0), ValueError, "MeanPool: kernel must be a positive int or a pair of them, got 2.0"),
    (lambda: AdaptiveMaxPool((0, 2)), ValueError, "AdaptiveMaxPool: out_hw must be a positive int or a pair"),
    (lambda: AdaptiveMeanPool(1.5), ValueError, "AdaptiveMeanPool: out_hw must be a positive int or a pair"),
    (lambda: Embedding(0, 3), ValueError, "Embedding: n must be a positive int, got 0"),
    (lambda: Embedding(10, 2.0), ValueError, "Embedding: dim must be a positive int, got 2.0"),
    (lambda: Embedding(10, 2, init=None), TypeError, "Embedding: init must be callable, got None"),
    (lambda: LayerNorm(0), ValueError, "LayerNorm: shape must be a positive int or a tuple of them, got 0"),
    (lambda: LayerNorm((2, -1)), ValueError, "LayerNorm: shape must be a positive int or a tuple of them"),
    (lambda: LayerNorm(2.5), ValueError, "LayerNorm: shape must be a positive int or a tuple of them, got 2.5"),
    (lambda: LayerNorm(()), ValueError, "LayerNorm: shape must be a positive int or a tuple of them, got ()"),
    (lambda: LayerNorm(1), ValueError, "LayerNorm: shape 1 normalises a single value, whose output is always beta"),
    (lambda: LayerNorm((1, 1)), ValueError, "LayerNorm: shape (1, 1) normalises a single value"),
    (lambda: LayerNorm(4, eps=-1e-5), ValueError, "LayerNorm: eps must be a number >= 0, got -1e-05"),
    (lambda: LayerNorm(4, "gelu"), TypeError, "LayerNorm: act must be callable"),
    (lambda: BatchNorm(0), ValueError, "BatchNorm: channels must be a positive int, got 0"),
    (lambda: BatchNorm(3.0), ValueError, "BatchNorm: channels must be a positive int, got 3.0"),
    (lambda: BatchNorm(3, momentum=1.5), ValueError, "BatchNorm: momentum must be a number >= 0 and <= 1, got 1.5"),
    (lambda: BatchNorm(3, eps=-1), ValueError, "BatchNorm: eps must be a number >= 0, got -1"),
    (lambda: BatchNorm(3, "relu"), TypeError, "BatchNorm: act must be callable"),
    (lambda: BatchNorm(3, active="yes"), ValueError, "BatchNorm: active must be True, False or None"),
    (lambda: Dropout(0.5, active=1), ValueError, "Dropout: active must be True, False or None"),
    (lambda: Dropout(0.5, dims="channels"), ValueError, "Dropout: dims must be None, an axis or a tuple of axes"),
    (lambda: Dropout(np.float32(0.5)), None, None),   # a NumPy scalar is a probability too
    (lambda: SkipConnection(Dense(2, 2), "+"), TypeError, "SkipConnection: connection must be callable, got '+'"),
    (lambda: SkipConnection(3, operator.add), TypeError, "SkipConnection: layers must be callable, got 3"),
    (lambda: Parallel("cat", Dense(2, 2)), TypeError, "Parallel: connection must be callable, got 'cat'"),
    (lambda: Parallel(operator.add, Dense(2, 2), 5), TypeError, "Parallel: layer 1 must be callable, got 5"),
])
def test_constructor_errors_name_the_layer(build, error, message):
    if error is None:
        build()
        return
    with pytest.raises(error) as err:
        build()
    assert str(err.value).startswith(message), str(err.value)


def test_act_none_means_identity():
    d = Dense(2, 3, None)
    assert d.act is identity and repr(d) == "Dense(2 => 3)"
    assert Conv(3, 1, 1, None).act is identity and BatchNorm(2, None).act is identity


@given(cin=st.integers(-2, 6), cout=st.integers(-2, 6), groups=st.integers(-1, 4))
def test_conv_sizes_either_build_or_say_why(cin, cout, groups):
    ok = cin >= 1 and cout >= 1 and groups >= 1 and cin % groups == 0 and cout % groups == 0
    for cls in (Conv, CrossCor, ConvTranspose):
        if ok:
            layer = cls((3, 3), cin, cout, groups=groups)
            assert (layer.in_channels, layer.out_channels) == (cin, cout)
        else:
            with pytest.raises(ValueError, match=rf"^{cls.__name__}: (cin|cout|groups)"):
                cls((3, 3), cin, cout, groups=groups)


# ---------------------------------------------------------------------------------------------
# Input dtypes: the parameters' dtype, or an error that says how to convert


DTYPE_CASES = [
    (Dense(3, 2), (4, 3)),
    (Conv((3, 3), 2, 3), (1, 2, 5, 5)),
    (CrossCor((3, 3), 2, 3), (1, 2, 5, 5)),
    (ConvTranspose((2, 2), 2, 3), (1, 2, 5, 5)),
    (BatchNorm(3), (4, 3)),
    (BatchNorm(3, affine=False), (4, 3, 2, 2)),
    (LayerNorm(3), (4, 3)),
]


@pytest.mark.parametrize("layer, shape", DTYPE_CASES, ids=lambda v: repr(v) if not isinstance(v, tuple) else "")
@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.float16, np.int32])
def test_float32_layers_refuse_other_dtypes(layer, shape, dtype):
    if dtype is np.float16 and isinstance(layer, (BatchNorm, LayerNorm)):
        pytest.skip("normalisation layers take half inputs (test_normalisation_layers_take_half_inputs)")
    x = np.ones(shape, dtype)
    with pytest.raises(DTypeMismatch) as err:
        layer(x)
    hint = "convert the input with x.astype(np.float32)" + (", or the model with fluxpy.f64(model)"
                                                              if dtype is np.float64 else "")
    assert str(err.value) == (f"{layer!r} expects x of dtype float32 (its parameters' dtype), got {shape} "
                              f"{np.dtype(dtype).name}: {hint}")
    assert isinstance(err.value, TypeError)


@pytest.mark.parametrize("layer, shape", DTYPE_CASES[4:], ids=lambda v: repr(v) if not isinstance(v, tuple) else "")
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=str)
def test_normalisation_layers_take_half_inputs(layer, shape, dtype):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    y = layer(x.astype(dtype))   # float32 parameters and statistics, the output in x's dtype
    assert y.dtype == dtype and y.shape == x.shape
    np.testing.assert_allclose(y.astype(np.float32), layer(x.astype(dtype).astype(np.float32)), atol=0.05)
    with pytest.raises(DTypeMismatch, match="float64"):
        f64(layer)(x.astype(dtype))   # float64 parameters take float64 only


@pytest.mark.parametrize("layer, shape", DTYPE_CASES, ids=lambda v: repr(v) if not isinstance(v, tuple) else "")
def test_float64_layers_refuse_float32_and_both_conversions_work(layer, shape):
    model = f64(layer)
    with pytest.raises(DTypeMismatch, match=r"expects x of dtype float64 \(its parameters' dtype\), got .* float32: "
                                            r"convert the input with x.astype\(np.float64\), or the model with "
                                            r"fluxpy.f32\(model\)$"):
        model(f32(*shape))
    assert model(f32(*shape).astype(np.float64)).dtype == np.float64   # the suggested conversions work
    assert layer(np.ones(shape).astype(np.float32)).dtype == np.float32


@pytest.mark.parametrize("layer", [MaxPool((2, 2)), MeanPool((2, 2)), GlobalMaxPool(), GlobalMeanPool(),
                                   AdaptiveMaxPool((2, 2)), AdaptiveMeanPool((1, 1)), LayerNorm(4, affine=False),
                                   BatchNorm(4, affine=False, track_stats=False)], ids=repr)
def test_layers_without_parameters_take_any_float_but_no_integers(layer):
    shape = (2, 4, 4, 4) if not isinstance(layer, LayerNorm) else (2, 4)
    for dtype in (np.float32, np.float64):
        assert layer(np.random.default_rng(0).standard_normal(shape).astype(dtype)).dtype == dtype
    with pytest.raises(DTypeMismatch) as err:
        layer(np.ones(shape, np.int64))
    assert str(err.value) == (f"{layer!r} expects a floating-point x, got {shape} int64: convert the input with "
                              f"x.astype(np.float32)")


def test_chain_names_the_layer_of_a_dtype_error():
    model = Chain(Dense(3, 4), Chain(Dense(4, 2)))
    with pytest.raises(DTypeMismatch, match=r"^Chain layer 0: Dense\(3 => 4\) expects x of dtype float32"):
        model(np.ones((2, 3)))
    f64_inner = Chain(Dense(3, 4), f64(Chain(Dense(4, 2))))
    with pytest.raises(DTypeMismatch, match=r"^Chain layer 1: Chain layer 0: Dense\(4 => 2\) expects x of dtype float64"):
        f64_inner(np.ones((2, 3), np.float32))


def test_dtype_errors_inside_gradient_and_before_any_kernel(monkeypatch):
    import fluxpy.layers.basic
    import fluxpy.layers.conv
    import fluxpy.layers.normalise

    def boom(*args, **kw):
        raise AssertionError("a kernel ran")
    for module, name in [(fluxpy.layers.conv, "conv_bias_act"), (fluxpy.layers.conv, "conv_transpose"),
                         (fluxpy.layers.basic, "matmul"), (fluxpy.layers.basic, "bias_act"),
                         (fluxpy.layers.basic, "dense"),
                         (fluxpy.layers.normalise, "batchnorm"), (fluxpy.layers.normalise, "batchnorm_infer"),
                         (fluxpy.layers.normalise, "layernorm")]:
        monkeypatch.setattr(module, name, boom)
    for layer, shape in DTYPE_CASES:
        with pytest.raises(DTypeMismatch):
            layer(np.ones(shape))
        with pytest.raises(DTypeMismatch):
            fluxpy.gradient(lambda x: layer(x).sum(), np.ones(shape))


# ---------------------------------------------------------------------------------------------
# BatchNorm: more than one value per channel with batch statistics


def _stats(bn):
    return bn.running_mean.copy(), bn.running_var.copy()


@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1, 1), (1, 3, 1), (0, 3), (0, 3, 4, 4)])
def test_batchnorm_refuses_one_value_per_channel_in_training(shape):
    bn = BatchNorm(3)
    bn.running_mean[:] = 0.5
    before = _stats(bn)
    x = np.ones(shape, np.float32)
    message = (f"BatchNorm(3) expects more than 1 value per channel when using batch statistics (training, or "
               f"track_stats=False), got {shape} float32")
    with pytest.raises(DimensionMismatch) as err:
        fluxpy.gradient(lambda m: m(x).sum(), bn)          # training inside gradient
    assert str(err.value) == message
    with pytest.raises(DimensionMismatch):
        trainmode(bn)(x)                                     # training by mode
    np.testing.assert_array_equal(_stats(bn)[0], before[0])  # the running statistics did not move
    np.testing.assert_array_equal(_stats(bn)[1], before[1])
    assert testmode(bn)(x).shape == shape                    # test mode uses the running statistics: fine
    with pytest.raises(DimensionMismatch, match=r"BatchNorm\(3, affine=False, track_stats=False\) expects more than 1"):
        BatchNorm(3, affine=False, track_stats=False)(x)     # batch statistics always


@given(n=st.integers(1, 3), h=st.integers(1, 3), w=st.integers(1, 2))
def test_batchnorm_train_needs_exactly_two_values_per_channel(n, h, w):
    bn = trainmode(BatchNorm(2))
    x = np.random.default_rng(n * 9 + h * 3 + w).standard_normal((n, 2, h, w)).astype(np.float32)
    if n * h * w < 2:
        with pytest.raises(DimensionMismatch, match="more than 1 value per channel"):
            bn(x)
        np.testing.assert_array_equal(bn.running_var, 1)
    else:
        y = bn(x)
        assert np.all(np.isfinite(y)) and np.all(bn.running_var > 0)


def test_batchnorm_in_a_chain_names_its_index():
    model = trainmode(Chain(Dense(2, 3), BatchNorm(3)))
    with pytest.raises(DimensionMismatch, match=r"^Chain layer 1: BatchNorm\(3, active=True\) expects more than 1"):
        model(np.ones((1, 2), np.float32))


# ---------------------------------------------------------------------------------------------
# Pickling: every layer type, with every activation


ACTIVATIONS = [identity, relu, fluxpy.tanh, sigmoid, gelu, leakyrelu, relu6, elu, swish, softplus, hardtanh,
               fluxpy.exp, np.tanh, functools.partial(leakyrelu, a=0.2)]


def _layers(act):
    return [
        (Dense(3, 4, act, rng=0), f32(2, 3)),
        (Conv((3, 3), 2, 3, act, pad=1, rng=0), f32(1, 2, 5, 5)),
        (CrossCor((3, 3), 2, 3, act, rng=0), f32(1, 2, 5, 5)),
        (ConvTranspose((2, 2), 2, 3, act, stride=2, rng=0), f32(1, 2, 3, 3)),
        (trainmode(BatchNorm(2, act)), f32(4, 2)),
        (LayerNorm(4, act), f32(3, 4)),
        (Chain(Dense(3, 4, act, rng=1), Dense(4, 2, rng=2)), f32(2, 3)),
        (SkipConnection(Dense(3, 3, act, rng=0), operator.add), f32(2, 3)),
        (Parallel(operator.add, Dense(3, 2, act, rng=0), Dense(3, 2, rng=1)), f32(2, 3)),
    ]


PARAMETERLESS = [(MaxPool((2, 2)), f32(1, 2, 4, 4)), (MeanPool((2, 2), pad=1), f32(1, 2, 4, 4)),
                 (GlobalMaxPool(), f32(1, 2, 4, 4)), (GlobalMeanPool(), f32(1, 2, 4, 4)),
                 (AdaptiveMaxPool((2, 1)), f32(1, 2, 5, 4)), (AdaptiveMeanPool(1), f32(1, 2, 4, 4)),
                 (Dropout(0.3, rng=0), f32(2, 3)), (Embedding(5, 3, rng=0), np.array([[0, 4], [2, 2]])),
                 (Chain(flatten, Dense(8, 2, rng=0)), f32(2, 2, 2, 2))]


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: getattr(a, "__name__", None) or repr(a))
def test_every_layer_pickles_with_every_activation(act):
    for layer, x in _layers(act):
        copy = pickle.loads(pickle.dumps(layer))
        assert repr(copy) == repr(layer)
        np.testing.assert_array_equal(copy(x), layer(x))
        acts = [getattr(m, "act", None) for m in (copy, getattr(copy, "layers", None)) if m is not None]
        if not isinstance(act, functools.partial):
            assert all(a is act for a in acts if a is not None and a is not identity)   # the same object back


@pytest.mark.parametrize("layer, x", PARAMETERLESS, ids=lambda v: repr(v) if not isinstance(v, np.ndarray) else "")
def test_parameterless_and_index_layers_pickle(layer, x):
    copy = pickle.loads(pickle.dumps(layer))
    assert repr(copy) == repr(layer)
    np.testing.assert_array_equal(copy(x), layer(x))


def test_a_trained_model_pickles_with_its_state():
    model = Chain(Conv((3, 3), 1, 2, relu, pad=1, rng=0), BatchNorm(2, relu), MaxPool((2, 2)), flatten,
                  Dense(8, 3, fluxpy.tanh, rng=1))
    x = f32(4, 1, 4, 4)
    fluxpy.gradient(lambda m: m(x).sum(), model)   # moves the running statistics
    copy = pickle.loads(pickle.dumps(model))
    np.testing.assert_array_equal(copy[1].running_var, model[1].running_var)
    np.testing.assert_array_equal(copy(x), model(x))
    assert copy[0].act is relu and copy[4].act is fluxpy.tanh


def test_primitive_without_a_module_level_name_says_why():
    local = fluxpy.Primitive("local", lambda x: (x, lambda dy: (dy,)))
    with pytest.raises(pickle.PicklingError, match=r"cannot pickle <fluxpy primitive local>: no module-level name"):
        pickle.dumps(Dense(2, 2, local))


# ---------------------------------------------------------------------------------------------
# `from fluxpy import *`


@pytest.mark.parametrize("module", ["fluxpy", "fluxpy.layers", "fluxpy.losses"])
def test_star_import_does_not_shadow_builtins(module):
    ns = {}
    exec(f"from {module} import *", ns)
    shadowed = sorted(name for name in ns if name != "__builtins__" and hasattr(builtins, name))
    assert shadowed == []
    mod = __import__(module, fromlist=["__all__"])
    assert sorted(set(mod.__all__) & set(dir(builtins))) == []


def test_reductions_stay_reachable_as_attributes():
    x = np.array([-1.0, 2.0])
    assert float(fluxpy.sum(x)) == 1.0 and float(fluxpy.max(x)) == 2.0 and float(fluxpy.min(x)) == -1.0
    np.testing.assert_array_equal(fluxpy.abs(x), [1.0, 2.0])
    g, = fluxpy.gradient(lambda x: fluxpy.sum(fluxpy.abs(x)), x)
    np.testing.assert_array_equal(g, [-1.0, 1.0])
