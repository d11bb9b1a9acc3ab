"""destructure (Optimisers.jl), modules and activations (Flux), EMA (PyTorch's AveragedModel with the EMA rule) and
gradient checkpointing (Checkpoint, checkpointed; torch.utils.checkpoint): against their formulas in float64,
gradients against finite differences and against the same model without checkpointing."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import (EMA, BatchNorm, Chain, Checkpoint, Conv, Dense, Dropout, activations, checkpointed, destructure,
                    modules)
from gradcheck import check_grad


def _model(seed, width):
    return fluxpy.f64(Chain(Dense(3, width, fluxpy.tanh, rng=seed), BatchNorm(width), Dense(width, 2, rng=seed + 1)))


@given(width=st.integers(1, 5), seed=st.integers(0, 2**20))
@settings(max_examples=20, deadline=None)
def test_destructure_round_trip_and_gradients(width, seed):
    rng = np.random.default_rng(seed)
    model = _model(seed, width)
    flat, re = destructure(model)
    params = fluxpy.trainables(model)
    np.testing.assert_array_equal(flat, np.concatenate([p.ravel() for p in params]))
    assert flat.shape == (sum(p.size for p in params),)
    x = rng.standard_normal((4, 3))
    np.testing.assert_array_equal(re(flat)(x), model(x))
    v = rng.standard_normal(flat.shape)
    rebuilt = re(v)
    assert rebuilt.layers[1].running_mean is model.layers[1].running_mean   # not trainable: kept
    np.testing.assert_array_equal(rebuilt.layers[0].weight.ravel(), v[:3 * width])
    fluxpy.testmode(model)   # BatchNorm on its running statistics, as the finite differences see it
    check_grad(lambda v: re(v)(x), v, rng=rng)
    g, = fluxpy.gradient(lambda m: (destructure(m)[0] ** 2).sum(), model)   # through flat to the model
    np.testing.assert_allclose(g["layers"][0]["weight"], 2 * model.layers[0].weight)


def test_destructure_ties_dtypes_and_errors():
    d = Dense(2, 2, rng=0)
    tied = Chain(d, d)
    flat, re = destructure(tied)
    assert flat.shape == (6,) and flat.dtype == np.float32
    again = re(flat + 1)
    assert again.layers[0].weight is again.layers[1].weight
    mixed = Chain(fluxpy.f64(Dense(2, 1, rng=0)), Dense(1, 1, rng=1))
    flat, re = destructure(mixed)
    assert flat.dtype == np.float64 and re(flat).layers[1].weight.dtype == np.float32
    assert repr(re) == "Restructure(Chain, ..., 5)"
    with pytest.raises(ValueError, match="destructure's rebuild expects a vector of 5 values"):
        re(np.ones(4))


def test_modules_as_flux():
    # Flux's docstring: modules(Chain(Chain(Dense, BatchNorm), Dense)) lists 7 nodes, tuples included
    inner = Chain(Dense(4, 3), BatchNorm(3))
    m = Chain(inner, Dense(3, 2))
    found = modules(m)
    assert len(found) == 7 and found[0] is m and found[2] is inner
    assert [type(x).__name__ for x in found] == ["Chain", "tuple", "Chain", "tuple", "Dense", "BatchNorm", "Dense"]
    d = Dense(2, 2)
    assert len(modules(Chain(d, d))) == 3   # a shared layer once


def test_activations():
    rng = np.random.default_rng(1)
    m = _model(1, 4)
    x = rng.standard_normal((5, 3))
    outs = activations(m, x)
    assert len(outs) == 3
    np.testing.assert_array_equal(outs[0], m.layers[0](x))
    np.testing.assert_array_equal(outs[-1], m(x))
    with pytest.raises(TypeError, match="activations expects a Chain"):
        activations(Dense(2, 2), x)


@given(decay=st.floats(0.0, 1.0), steps=st.integers(1, 4), seed=st.integers(0, 2**20))
@settings(max_examples=20, deadline=None)
def test_ema_formula(decay, steps, seed):
    rng = np.random.default_rng(seed)
    model = _model(seed, 3)
    ema = EMA(model, decay)
    expected = [p.copy() for p in fluxpy.trainables(model)]
    for _ in range(steps):
        for p in fluxpy.trainables(model):
            p[...] = rng.standard_normal(p.shape)
        ema.update(model)
        expected = [decay * e + (1 - decay) * p for e, p in zip(expected, fluxpy.trainables(model))]
    for s, e in zip(ema.shadow, expected):
        np.testing.assert_allclose(s, e, rtol=1e-12, atol=1e-15)
    assert ema.count == steps
    avg = ema.averaged(model)
    np.testing.assert_array_equal(avg.layers[0].weight, expected[0])
    assert avg.layers[1].running_var is model.layers[1].running_var
    ema.copy_to(model)
    np.testing.assert_array_equal(model.layers[2].bias, expected[-1])


def test_ema_errors():
    with pytest.raises(ValueError, match="EMA: decay must be a number in \\[0, 1\\], got 1.5"):
        EMA(Dense(2, 2), 1.5)
    ema = EMA(Dense(2, 2))
    with pytest.raises(ValueError, match="EMA.update expects the model the EMA was made from"):
        ema.update(Dense(2, 3))


def _block(seed):
    return fluxpy.f64(Chain(Conv((3, 3), 2, 3, fluxpy.tanh, pad=1, rng=seed), Conv((3, 3), 3, 2, pad=1, rng=seed + 1)))


def test_checkpoint_gives_the_gradients_of_the_plain_model():
    rng = np.random.default_rng(2)
    block = _block(0)
    x = rng.standard_normal((2, 2, 5, 5))
    ct = rng.standard_normal((2, 2, 5, 5))
    plain = fluxpy.gradient(lambda m, x: (m(x) * ct).sum(), block, x)
    checked = fluxpy.gradient(lambda m, x: (Checkpoint(m)(x) * ct).sum(), block, x)
    np.testing.assert_allclose(checked[1], plain[1], rtol=1e-12)
    for k in (0, 1):
        for name in ("weight", "bias"):
            np.testing.assert_allclose(checked[0]["layers"][k][name], plain[0]["layers"][k][name], rtol=1e-12)
    wrapped = Chain(Checkpoint(block), Dense(5, 1, rng=3))
    g, = fluxpy.gradient(lambda m: m(x).sum(), fluxpy.f64(wrapped))
    assert set(g["layers"][0]) == {"layer"} and g["layers"][0]["layer"]["layers"][0]["weight"].shape == (3, 2, 3, 3)
    check_grad(lambda w, x: checkpointed(lambda z, w: Conv(w, False, fluxpy.tanh, pad=1)(z) ** 2)(x, w),
               block.layers[0].weight, x, rng=rng)


def test_checkpoint_recomputes_dropout_with_the_same_masks_on_the_cpu():
    rng = np.random.default_rng(4)
    block = fluxpy.f64(Chain(Dense(4, 16, fluxpy.relu, rng=0), Dropout(0.5), Dense(16, 4, rng=1)))
    x = rng.standard_normal((8, 4))
    fluxpy.seed(7)
    plain = fluxpy.withgradient(lambda m: (m(x) ** 2).sum(), block)
    fluxpy.seed(7)
    checked = fluxpy.withgradient(lambda m: (checkpointed(m)(x) ** 2).sum(), block)
    assert float(checked[0]) == float(plain[0])
    np.testing.assert_allclose(checked[1][0]["layers"][0]["weight"], plain[1][0]["layers"][0]["weight"], rtol=1e-12)


def test_checkpoint_errors_and_repr():
    with pytest.raises(TypeError, match="Checkpoint expects a callable layer"):
        Checkpoint(3)
    with pytest.raises(TypeError, match="Checkpoint expects a function that returns one array"):
        fluxpy.gradient(lambda x: checkpointed(lambda z: (z, z))(x)[0].sum(), np.ones(2))
    with pytest.raises(ValueError, match="Checkpoint: the function reads differentiated arrays that are neither"):
        fluxpy.gradient(lambda w: checkpointed(lambda z: z * w)(np.ones(2)).sum(), np.ones(2))
    assert repr(Checkpoint(Dense(2, 3))) == "Checkpoint(Dense(2 => 3))"
