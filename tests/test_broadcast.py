"""broadcast(f, *xs) with dual-number derivatives, and unbroadcast."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import broadcast, unbroadcast
from fluxpy.broadcast import reduced_axes
from fluxpy.dual import Dual
from gradcheck import check_grad, check_second_order
from strategies import array, broadcast_pair, shapes

seeds = st.integers(0, 2**31 - 1)

SCALAR_FUNCTIONS = {
    "affine_tanh": lambda x, b: np.tanh(x * 1.5 + b),
    "leaky": lambda x, b: np.where(x + b > 0, x + b, 0.1 * (x + b)),
    "relu": lambda x, b: np.maximum(x + b, 0.0),
    "softplus": lambda x, b: np.log1p(np.exp(-np.abs(x + b))) + np.maximum(x + b, 0),
    "ratio": lambda x, b: (x * x + 1) / (b * b + 2) - x ** 3 + 2.0 ** b,
    "trig": lambda x, b: np.sin(x) * np.cos(b) + np.sqrt(x * x + 1) + np.expm1(b) - np.square(x - b),
    "sigmoid": lambda x, b: 1 / (1 + np.exp(-(x + b))),
    "min_abs": lambda x, b: np.minimum(np.abs(x), b) - (-x),
}


@pytest.mark.parametrize("name", sorted(SCALAR_FUNCTIONS))
@given(pair=broadcast_pair(), seed=seeds)
def test_broadcast_gradients(name, pair, seed):
    f = SCALAR_FUNCTIONS[name]
    rng = np.random.default_rng(seed)
    x, b = array(rng, pair[0], away_from_zero=True), array(rng, pair[1], away_from_zero=True)
    if name in ("relu", "leaky") and np.any(np.abs(np.add(x, b)) < 1e-3):
        return
    if name == "min_abs" and np.any(np.abs(np.abs(x) - b) < 1e-3):
        return
    y = broadcast(f, x, b)
    np.testing.assert_allclose(y, np.broadcast_to(f(x, b), np.broadcast_shapes(pair[0], pair[1])))
    check_grad(lambda x, b: broadcast(f, x, b), x, b, rng=rng)


@pytest.mark.parametrize("name", ["affine_tanh", "ratio", "trig", "sigmoid"])
@given(pair=broadcast_pair(max_dims=2), seed=seeds)
def test_broadcast_second_order(name, pair, seed):
    f = SCALAR_FUNCTIONS[name]
    rng = np.random.default_rng(seed)
    x, b = array(rng, pair[0]), array(rng, pair[1])
    check_second_order(lambda x, b: broadcast(f, x, b), x, b, rng=rng, rtol=1e-5)


def test_broadcast_is_one_node_on_the_tape():
    def f(x):
        y = broadcast(lambda v: np.tanh(v) * v + v ** 2, x)
        assert y.node.parents[1] is x.node  # one op, whose parents are (f, x)
        return y.sum()
    check_grad(lambda x: broadcast(lambda v: np.tanh(v) * v + v ** 2, x), np.linspace(-1, 1, 5))
    fluxpy.gradient(f, np.ones(3))


def test_broadcast_argument_that_f_ignores_gets_zero_gradient():
    x = np.array([1.0, 2.0])
    gx, gc = fluxpy.gradient(lambda x, c: broadcast(lambda x, c: x * 3.0, x, c).sum(), x, np.ones(2))
    np.testing.assert_allclose(gx, [3.0, 3.0])
    assert gc is None or not np.any(gc)


def test_broadcast_shape_error_names_both_shapes():
    with pytest.raises(ValueError, match=r"broadcast: shapes \(2, 3\) and \(4,\) cannot be broadcast"):
        broadcast(lambda a, b: a + b, np.ones((2, 3)), np.ones(4))


def test_dual_numbers():
    d = np.exp(Dual(np.array([0.0, 1.0]), (np.ones(2),)))
    np.testing.assert_allclose(d.v, np.exp([0.0, 1.0]))
    np.testing.assert_allclose(d.d[0], np.exp([0.0, 1.0]))
    q = 1.0 / Dual(2.0, (1.0,))
    assert q.v == 0.5 and q.d[0] == pytest.approx(-0.25)


@given(pair=broadcast_pair(), seed=seeds)
def test_unbroadcast_sums_broadcast_axes(pair, seed):
    rng = np.random.default_rng(seed)
    full = np.broadcast_shapes(*pair)
    g = array(rng, full)
    r = unbroadcast(g, pair[0])
    assert np.shape(r) == pair[0]
    # unbroadcast is the adjoint of broadcast_to: <broadcast(v), g> == <v, unbroadcast(g)>
    v = array(rng, pair[0])
    np.testing.assert_allclose(np.sum(np.broadcast_to(v, full) * g), np.sum(v * r), rtol=1e-10, atol=1e-10)
    check_grad(lambda g: unbroadcast(g * g, pair[0]), g, rng=rng)


def test_unbroadcast_returns_grad_itself_when_shapes_match():
    g = np.ones((2, 3))
    assert unbroadcast(g, (2, 3)) is g


def test_unbroadcast_rejects_shapes_that_did_not_broadcast():
    with pytest.raises(ValueError, match=r"unbroadcast: a gradient of shape \(2, 3\) cannot come from .*\(4,\)"):
        unbroadcast(np.ones((2, 3)), (4,))


@given(shapes(0, 4))
def test_reduced_axes_collapse_to_the_shape(shape):
    full = (2,) + tuple(s + 1 for s in shape)
    target = tuple(1 if i % 2 else s for i, s in enumerate(full[1:]))
    axes = reduced_axes(full, target)
    assert np.ones(full).sum(axis=axes).reshape(target).shape == target
