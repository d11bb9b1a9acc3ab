"""fluxpy.precision: f16/bf16 conversions and the MixedPrecision wrapper, on the CPU (where the casts round to the
half type and the arithmetic is float32; the GPU's real half path is tested in tests/gpu/test_precision_gpu.py)."""
import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import BatchNorm, Chain, Dense, MixedPrecision, bf16, f16, mixed_precision, relu, tanh
from fluxpy.backend import is_float_dtype
from fluxpy.kernels.halfs import BFLOAT16
from fluxpy.optimise import Adam, setup

EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def _net(seed=0, act=relu):
    rng = np.random.default_rng(seed)
    return Chain(Dense(6, 8, act, rng=rng), Dense(8, 3, rng=rng))


def _x(seed=1, n=5):
    return np.random.default_rng(seed).standard_normal((n, 6)).astype(np.float32)


def test_conversions_keep_normalisation_layers_float32():
    m = Chain(Dense(2, 3), BatchNorm(3), Dense(3, 1))
    for convert, dtype in ((f16, np.float16), (bf16, BFLOAT16)):
        h = convert(m)
        assert h.layers[0].weight.dtype == dtype and h.layers[2].bias.dtype == dtype
        assert h.layers[1].running_mean.dtype == np.float32 and h.layers[1].gamma.dtype == np.float32
        assert m.layers[0].weight.dtype == np.float32   # a copy: the model is untouched


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_output_and_master_weights_stay_float32_and_values_are_the_half_models(dtype):
    m = mixed_precision(_net(), dtype)
    x = _x()
    y = m(x)
    assert y.dtype == np.float32 and m.model.layers[0].weight.dtype == np.float32
    want = m.model(x)
    np.testing.assert_allclose(y, want, rtol=30 * EPS[dtype], atol=30 * EPS[dtype])
    assert not np.array_equal(y, want)   # the weights and input were rounded to the half type


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 9))
def test_gradients_reach_the_float32_weights_close_to_the_float32_models(dtype, seed, n):
    # smooth (a relu kink crossed by rounding changes a gradient by O(1)); float16 with a static scale of 256: the
    # default dynamic scale starts at 2^15, where these gradients may overflow (a step train would skip)
    m = mixed_precision(_net(seed, tanh), dtype, **({"loss_scale": 256.0} if dtype == "float16" else {}))
    x = _x(seed + 1, n)
    (g,) = fluxpy.gradient(lambda m: (m(x) ** 2).mean(), m)
    (want,) = fluxpy.gradient(lambda m: (m(x) ** 2).mean(), m.model)
    for got, ref in zip(fluxpy.trainables(g), fluxpy.trainables(want)):
        assert got.dtype == np.float32 and got.shape == ref.shape
        scale = np.abs(ref).max() + 1e-6
        np.testing.assert_allclose(got / scale, ref / scale, atol=60 * EPS[dtype])


def test_a_loss_scale_keeps_small_float16_gradients_from_underflowing():
    m = Chain(Dense(6, 1, rng=np.random.default_rng(2)))
    x = _x(3)
    tiny = 1e-6   # cotangents of about 1e-8: below float16's smallest subnormal (6e-8) without scaling

    def grads(model):
        return fluxpy.trainables(fluxpy.gradient(lambda m: tiny * m(x).sum() / 100, model)[0])
    unscaled = grads(MixedPrecision(m, np.float16, loss_scale=None))
    scaled = grads(MixedPrecision(m, np.float16, loss_scale=2.0 ** 16))
    exact = grads(m)
    assert all(not g.any() for g in unscaled)   # underflowed to zero
    for g, e in zip(scaled, exact):   # within the rounding of the half inputs (a sum of 5 products)
        np.testing.assert_allclose(g, e, rtol=0, atol=8 * EPS["float16"] * np.abs(e).max())


def test_training_moves_the_master_weights():
    m = mixed_precision(_net(), "bfloat16")
    before = copy.deepcopy(m.model)
    x, y = _x(n=32), fluxpy.onehotbatch(np.random.default_rng(4).integers(0, 3, 32), range(3))
    losses = fluxpy.train(lambda m, x, y: fluxpy.logitcrossentropy(m(x), y), m, [(x, y)] * 30,
                          setup(Adam(1e-2), m), progress=False)
    assert losses[-1] < 0.7 * losses[0]
    assert m.model.layers[0].weight.dtype == np.float32
    assert not np.array_equal(m.model.layers[0].weight, before.layers[0].weight)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="float16 or bfloat16.*got 'float32'"):
        mixed_precision(_net(), "float32")
    with pytest.raises(TypeError, match="master weights must be float32.*float64"):
        mixed_precision(fluxpy.f64(_net()), "bfloat16")
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="loss_scale"):
            MixedPrecision(_net(), np.float16, loss_scale=bad)
    for bad in (True, "big", [2.0]):   # not a number: a TypeError naming the argument and what it got
        with pytest.raises(TypeError, match="loss_scale.*got"):
            MixedPrecision(_net(), np.float16, loss_scale=bad)


def test_repr_and_defaults():
    assert repr(MixedPrecision(Dense(2, 2), "bfloat16")) == "MixedPrecision(Dense(2 => 2), bfloat16)"
    assert MixedPrecision(Dense(2, 2), "bfloat16").loss_scale is None
    assert isinstance(MixedPrecision(Dense(2, 2), np.float16).loss_scale, fluxpy.DynamicLossScale)
    assert repr(MixedPrecision(Dense(2, 2), np.float16)) == "MixedPrecision(Dense(2 => 2), float16)"
    assert repr(MixedPrecision(Dense(2, 2), np.float16, loss_scale=8)) == \
        "MixedPrecision(Dense(2 => 2), float16, loss_scale=8.0)"


def test_a_dynamic_loss_scale_skips_an_overflowing_step_and_halves_then_grows():
    m = mixed_precision(_net(), np.float16, loss_scale=fluxpy.DynamicLossScale(init=2.0 ** 15, growth_interval=3))
    x, y = _x(n=16), fluxpy.onehotbatch(np.random.default_rng(5).integers(0, 3, 16), range(3))
    opt = setup(Adam(1e-3), m)
    # a loss of about 1e4: its cotangents times 2^15 pass float16's largest value (65504): the step overflows
    huge = [(x, y, 1e4)]
    before = copy.deepcopy(m.model)
    losses = fluxpy.train(lambda m, x, y, k: k * fluxpy.logitcrossentropy(m(x), y), m, huge, opt, progress=False)
    assert np.isfinite(losses[0])
    for a, b in zip(fluxpy.trainables(m.model), fluxpy.trainables(before)):
        np.testing.assert_array_equal(a, b)   # skipped: the master weights did not move
    assert m.loss_scale.scale == 2.0 ** 14
    normal = [(x, y, 1.0)] * 3
    fluxpy.train(lambda m, x, y, k: k * fluxpy.logitcrossentropy(m(x), y), m, normal, opt, progress=False)
    assert m.loss_scale.scale == 2.0 ** 15   # three good steps: doubled again
    assert not np.array_equal(m.model.layers[0].weight, before.layers[0].weight)


def test_update_with_a_dynamic_loss_scale_skips_where_a_gradient_is_not_finite():
    m = mixed_precision(_net(), np.float16, loss_scale=fluxpy.DynamicLossScale(init=4.0, growth_interval=100))
    opt = setup(Adam(1e-3), m)
    x = _x()
    (g,) = fluxpy.gradient(lambda m: m(x).sum(), m)
    before = copy.deepcopy(m.model)
    g["model"]["layers"][1]["bias"][0] = np.inf   # an overflow
    fluxpy.update(opt, m, g, check_finite=True)   # no error: the step is skipped, the scale halved
    for a, b in zip(fluxpy.trainables(m.model), fluxpy.trainables(before)):
        np.testing.assert_array_equal(a, b)
    assert m.loss_scale.scale == 2.0
    g["model"]["layers"][1]["bias"][0] = 1.0
    fluxpy.update(opt, m, g)
    assert not np.array_equal(m.model.layers[1].bias, before.layers[1].bias)


@pytest.mark.parametrize("convert, dtype", [(bf16, BFLOAT16), (f16, np.dtype(np.float16))], ids=["bf16", "f16"])
@pytest.mark.parametrize("rule", [fluxpy.Adam(1e-2), fluxpy.AdamW(1e-2, lambd=0.1), fluxpy.Momentum(0.05),
                                  fluxpy.Descent(0.2), fluxpy.OptimiserChain(fluxpy.ClipNorm(1.0), fluxpy.Adam(1e-2))],
                         ids=lambda r: type(r).__name__)
def test_a_half_model_trains_with_float32_optimiser_state(convert, dtype, rule):
    m = convert(_net())
    x = _x(n=32).astype(dtype)
    y = fluxpy.onehotbatch(np.random.default_rng(6).integers(0, 3, 32), range(3))
    opt = setup(rule, m)
    states = [a for leaf in fluxpy.optimise._leaves(opt) for a in fluxpy.optimise._state_arrays(leaf.state, [])]
    assert all(a.dtype == np.float32 for a in states)   # Adam's eps and second moment would underflow in float16
    losses = fluxpy.train(lambda m, x, y: fluxpy.logitcrossentropy(m(x), y), m, [(x, y)] * 20, opt, progress=False)
    assert m.layers[0].weight.dtype == dtype and all(np.isfinite(losses))
    assert losses[-1] < 0.9 * losses[0]


# ---------------------------------------------------------------------------------------------
# Every layer of the matrix-product families in mixed precision, and in the half type itself (bf16/f16 models on
# half inputs: the dtypes the GPU sees, each op rounding to the half type on the CPU too)


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _layer_cases():
    """name -> (layer maker, input maker): each layer family whose maths is a matrix product, or that runs one."""
    from fluxpy import (GRU, LSTM, RNN, Bilinear, Embedding, EmbeddingBag, GRUCell, LSTMCell, Maxout,
                        MultiHeadAttention, PairwiseFusion, RNNCell, Scale)
    return {
        "Dense": (lambda r: Dense(6, 4, tanh, rng=r), lambda r: (_f32(r, 5, 6),)),
        "Bilinear": (lambda r: Bilinear((6, 3), 4, rng=r), lambda r: (_f32(r, 5, 6), _f32(r, 5, 3))),
        "Embedding": (lambda r: Embedding(7, 4, rng=r), lambda r: (r.integers(0, 7, (3, 2)),)),
        "EmbeddingBag": (lambda r: EmbeddingBag(7, 4, rng=r), lambda r: (r.integers(0, 7, (3, 2)),)),
        "EmbeddingBag-lists": (lambda r: EmbeddingBag(7, 4, rng=r), lambda r: ([[1, 2], [3], [0, 4, 6]],)),
        "RNNCell": (lambda r: RNNCell(6, 4, rng=r), lambda r: (_f32(r, 5, 6), _f32(r, 5, 4))),
        "LSTMCell": (lambda r: LSTMCell(6, 4, rng=r), lambda r: (_f32(r, 5, 6), (_f32(r, 5, 4), _f32(r, 5, 4)))),
        "GRUCell": (lambda r: GRUCell(6, 4, rng=r), lambda r: (_f32(r, 5, 6), _f32(r, 4))),
        "RNN": (lambda r: RNN(6, 4, rng=r), lambda r: (_f32(r, 3, 5, 6),)),
        "LSTM": (lambda r: LSTM(6, 4, rng=r), lambda r: (_f32(r, 3, 5, 6),)),
        "GRU": (lambda r: GRU(6, 4, rng=r), lambda r: (_f32(r, 3, 5, 6),)),
        "Maxout": (lambda r: Maxout(lambda: Dense(6, 4, rng=r), 3), lambda r: (_f32(r, 5, 6),)),
        "Scale": (lambda r: Scale(6, act=tanh, init=lambda *s, rng=None: _f32(r, *s)), lambda r: (_f32(r, 5, 6),)),
        "PairwiseFusion": (lambda r: PairwiseFusion(fluxpy.ops.basic.add, Dense(6, 6, tanh, rng=r),
                                                    Dense(6, 6, rng=r)), lambda r: ((_f32(r, 5, 6), _f32(r, 5, 6)),)),
        "MultiHeadAttention": (lambda r: MultiHeadAttention(8, nheads=2, rng=r), lambda r: (_f32(r, 2, 5, 8),)),
    }


def _arrays(v):
    if isinstance(v, (tuple, list)):
        return [a for item in v for a in _arrays(item)]
    return [v] if hasattr(v, "dtype") and is_float_dtype(v.dtype) else []


def _tree(v, fn):
    """``v`` with ``fn`` applied to each float array inside its nested tuples."""
    if isinstance(v, tuple):
        return tuple(_tree(item, fn) for item in v)
    return fn(v) if _arrays(v) else v


def _loss(outputs, weights):
    """A smooth scalar of every float output, weighed by fixed random ``weights`` (one per output)."""
    return sum((fluxpy.ops.shape.astype(y, np.float32) * w).sum() for y, w in zip(_arrays(outputs), weights))


def _relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-12))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(_layer_cases()))
def test_each_layer_in_mixed_precision_runs_forward_and_backward_close_to_float32(name, dtype):
    make, inputs = _layer_cases()[name]
    rng = np.random.default_rng(len(name))
    model, xs = make(rng), inputs(rng)
    want = model(*xs)
    weights = [rng.standard_normal(a.shape).astype(np.float32) for a in _arrays(want)]
    mp = mixed_precision(model, dtype, **({"loss_scale": 64.0} if dtype == "float16" else {}))
    got = mp(*xs)
    assert [a.dtype for a in _arrays(got)] == [np.float32] * len(weights)
    for g, w in zip(_arrays(got), _arrays(want)):
        assert g.shape == w.shape and _relative_error(g, w) < 12 * EPS[dtype]
    (grads,) = fluxpy.gradient(lambda m: _loss(m(*xs), weights), mp)
    (ref,) = fluxpy.gradient(lambda m: _loss(m(*xs), weights), model)
    pairs = list(zip(fluxpy.trainables(grads), fluxpy.trainables(ref)))
    assert pairs
    for g, r in pairs:
        assert g.dtype == np.float32 and g.shape == r.shape and np.isfinite(g).all()
        assert _relative_error(g, r) < 16 * EPS[dtype]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(_layer_cases()))
def test_each_layer_converted_to_the_half_type_computes_in_it(name, dtype):
    make, inputs = _layer_cases()[name]
    rng = np.random.default_rng(len(name) + 1)
    model, xs = make(rng), inputs(rng)
    half_dtype = BFLOAT16 if dtype == "bfloat16" else np.dtype(np.float16)
    half = (bf16 if dtype == "bfloat16" else f16)(model)
    rounded = fluxpy.functors.fmap(lambda a: a.astype(half_dtype).astype(np.float32) if _arrays(a) else a, model)
    hxs = _tree(xs, lambda a: a.astype(half_dtype))
    wide = _tree(hxs, lambda a: a.astype(np.float32))   # the same values in float32
    want = rounded(*wide)
    got = half(*hxs)
    assert [a.dtype for a in _arrays(got)] == [half_dtype] * len(_arrays(want))
    for g, w in zip(_arrays(got), _arrays(want)):
        assert _relative_error(g, w) < 12 * EPS[dtype]
    weights = [rng.standard_normal(a.shape).astype(np.float32) for a in _arrays(want)]
    (grads,) = fluxpy.gradient(lambda m: _loss(m(*hxs), weights), half)
    (ref,) = fluxpy.gradient(lambda m: _loss(m(*wide), weights), rounded)
    for g, r in zip(fluxpy.trainables(grads), fluxpy.trainables(ref)):
        assert g.dtype == half_dtype and _relative_error(g, r) < 16 * EPS[dtype]


def test_norm_layer_gradients_come_back_unscaled_under_a_dynamic_loss_scale():
    """Under float16's loss scale every gradient, the float32 norm layers' parameters' included, is divided by the
    scale again (they were once returned scaled by it, about 32768 times too large), and the running statistics
    still move in the model's own arrays."""
    import warnings

    from fluxpy import BatchNorm, Chain, Conv, Dense, LayerNorm, flatten, gelu, gradient, mixed_precision
    from fluxpy.losses import mse
    rng = np.random.default_rng(0)
    model = Chain(Conv((3, 3), 3, 4, pad=1, rng=0), BatchNorm(4, gelu), flatten, Dense(144, 8, rng=1), LayerNorm(8),
                  Dense(8, 2, rng=2))
    x, y = rng.standard_normal((4, 3, 6, 6)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    (g32,) = gradient(lambda m: mse(m(x), y), model)
    before = model[1].running_mean.copy()
    wrapped = mixed_precision(model, np.float16, loss_scale=1024.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        (g16,) = gradient(lambda m: mse(m(x), y), wrapped)
    g16 = g16["model"]
    for layer, name in ((1, "gamma"), (1, "beta"), (4, "gamma"), (4, "beta")):
        np.testing.assert_allclose(g16["layers"][layer][name], g32["layers"][layer][name], rtol=2e-2, atol=2e-3)
    assert not np.array_equal(model[1].running_mean, before)
