"""Every core primitive against float64 finite differences, first and second order."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import ops
from gradcheck import check_grad, check_second_order
from strategies import array, axes_for, broadcast_pair, shapes

seeds = st.integers(0, 2**31 - 1)

BINARY = {
    "add": (lambda a, b: a + b, None),
    "subtract": (lambda a, b: a - b, None),
    "multiply": (lambda a, b: a * b, None),
    "divide": (lambda a, b: a / b, "b_away"),
    "power": (lambda a, b: a ** b, "a_positive"),
    "maximum": (np.maximum, "no_ties"),
    "minimum": (np.minimum, "no_ties"),
    "rsub_scalar": (lambda a, b: 2.0 - a * b, None),
    "rdiv_scalar": (lambda a, b: 1.5 / (a * a + 1) + b, None),
}


def _binary_inputs(kind, rng, sa, sb):
    a, b = array(rng, sa), array(rng, sb)
    if kind == "b_away":
        b = array(rng, sb, away_from_zero=True)
    if kind == "a_positive":
        a = np.array(rng.uniform(0.5, 2.0, size=sa))
    if kind == "no_ties":
        b = b + 0.25  # random reals never tie, this keeps them apart enough for finite differences
    return a, b


@pytest.mark.parametrize("name", sorted(BINARY))
@given(pair=broadcast_pair(), seed=seeds)
def test_binary_broadcasting(name, pair, seed):
    f, kind = BINARY[name]
    rng = np.random.default_rng(seed)
    a, b = _binary_inputs(kind, rng, *pair)
    if kind == "no_ties" and np.any(np.abs(np.subtract(a, b)) < 1e-3):
        return
    check_grad(lambda a, b: f(a, b) + 0 * a, a, b, rng=rng)


UNARY = {
    "exp": (np.exp, None), "log": (np.log, "positive"), "sqrt": (np.sqrt, "positive"), "tanh": (np.tanh, None),
    "abs": (np.abs, "away"), "sin": (np.sin, None), "cos": (np.cos, None), "log1p": (np.log1p, "positive"),
    "expm1": (np.expm1, None), "square": (np.square, None), "negative": (np.negative, None),
    "pow3": (lambda x: x ** 3, None), "rpow": (lambda x: 2.0 ** x, None), "clip": (lambda x: np.clip(x, -0.5, 0.5),
                                                                                  "away_from_clip"),
}


def _unary_input(kind, rng, shape):
    if kind == "positive":
        return np.array(rng.uniform(0.2, 3.0, size=shape))
    if kind == "away":
        return array(rng, shape, away_from_zero=True)
    if kind == "away_from_clip":
        x = np.array(rng.uniform(-1, 1, size=shape))
        return np.where(np.abs(np.abs(x) - 0.5) < 0.05, 0.0 + x * 0.5, x)
    return array(rng, shape)


@pytest.mark.parametrize("name", sorted(UNARY))
@given(shape=shapes(), seed=seeds)
def test_unary(name, shape, seed):
    f, kind = UNARY[name]
    rng = np.random.default_rng(seed)
    x = _unary_input(kind, rng, shape)
    check_grad(f, x, rng=rng)


@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "tanh", "sin", "square", "pow3", "rpow"])
@given(shape=shapes(max_dims=2), seed=seeds)
def test_unary_second_order(name, shape, seed):
    f, kind = UNARY[name]
    rng = np.random.default_rng(seed)
    x = _unary_input(kind, rng, shape)
    check_second_order(f, x, rng=rng, rtol=1e-5)


@pytest.mark.parametrize("name", ["add", "multiply", "divide", "power"])
@given(pair=broadcast_pair(max_dims=2), seed=seeds)
def test_binary_second_order(name, pair, seed):
    f, kind = BINARY[name]
    rng = np.random.default_rng(seed)
    a, b = _binary_inputs(kind, rng, *pair)
    check_second_order(lambda a, b: f(a, b) * f(a, b), a, b, rng=rng, rtol=1e-5)


@given(pair=broadcast_pair(), seed=seeds)
def test_where(pair, seed):
    rng = np.random.default_rng(seed)
    a, b = array(rng, pair[0]), array(rng, pair[1])
    cond = rng.random(np.broadcast_shapes(pair[0], pair[1])) > 0.5
    check_grad(lambda a, b: np.where(cond, a * a, b), a, b, rng=rng)


@pytest.mark.parametrize("reduction", ["sum", "mean", "max", "min"])
@given(shape=shapes(1, 3), data=st.data(), keepdims=st.booleans(), seed=seeds)
def test_reductions(reduction, shape, data, keepdims, seed):
    axis = data.draw(axes_for(len(shape)))
    rng = np.random.default_rng(seed)
    x = array(rng, shape)
    f = lambda x: getattr(x, reduction)(axis=axis, keepdims=keepdims)  # noqa: E731
    check_grad(f, x, rng=rng)
    expected = getattr(np, reduction)(x, axis=axis, keepdims=keepdims)
    np.testing.assert_allclose(fluxpy.value_of(getattr(ops, reduction)(x, axis, keepdims)), expected)


@pytest.mark.parametrize("reduction", ["sum", "mean", "max"])
@given(shape=shapes(1, 2), data=st.data(), seed=seeds)
def test_reductions_second_order(reduction, shape, data, seed):
    axis = data.draw(axes_for(len(shape)))
    rng = np.random.default_rng(seed)
    x = array(rng, shape)
    check_second_order(lambda x: getattr(x * x, reduction)(axis=axis) * 1.5, x, rng=rng, rtol=1e-5)


def test_max_ties_share_gradient():
    x = np.array([[2.0, 2.0, 1.0], [0.0, 3.0, 3.0]])
    g, = fluxpy.gradient(lambda x: x.max(axis=1).sum(), x)
    np.testing.assert_array_equal(g, [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])


INDICES = [
    lambda s: (slice(None, None, 2),),
    lambda s: (0,),
    lambda s: (-1, Ellipsis),
    lambda s: (None, slice(1, None)),
    lambda s: (np.array([0, 0, s[0] - 1, 0]),),              # repeated indices accumulate
    lambda s: (Ellipsis, np.array([[0, s[-1] - 1], [0, 0]])),
    lambda s: "mask",
]


@pytest.mark.parametrize("make_index", range(len(INDICES)))
@given(shape=shapes(1, 3, min_side=2), seed=seeds)
def test_getitem(make_index, shape, seed):
    rng = np.random.default_rng(seed)
    x = array(rng, shape)
    index = INDICES[make_index](shape)
    if index == "mask":
        index = x > 0
    check_grad(lambda x: x[index] * x[index], x, rng=rng)
    check_second_order(lambda x: x[index] * x[index] * x[index], x, rng=rng, rtol=1e-5)


def test_getitem_repeated_indices_accumulate():
    g, = fluxpy.gradient(lambda x: x[np.array([1, 1, 1, 0])].sum(), np.ones(3))
    np.testing.assert_array_equal(g, [1.0, 3.0, 0.0])


@given(shape=shapes(1, 3, min_side=1, max_side=4), seed=seeds, data=st.data())
def test_reshape_transpose(shape, seed, data):
    rng = np.random.default_rng(seed)
    x = array(rng, shape)
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    check_grad(lambda x: np.transpose(x * x, perm).reshape(-1)[::-1].reshape(1, -1), x, rng=rng)
    check_grad(lambda x: x.T * 2.0, x, rng=rng)
    check_second_order(lambda x: np.transpose(x * x * x, perm).reshape(-1), x, rng=rng, rtol=1e-5)


@given(pair=broadcast_pair(), seed=seeds)
def test_broadcast_to(pair, seed):
    rng = np.random.default_rng(seed)
    full = np.broadcast_shapes(*pair)
    x = array(rng, pair[0])
    check_grad(lambda x: np.broadcast_to(x * x, full), x, rng=rng)


@given(base=shapes(1, 3), n=st.integers(1, 3), data=st.data(), seed=seeds)
def test_concatenate_and_stack(base, n, data, seed):
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(-len(base), len(base) - 1))
    sizes = [data.draw(st.integers(1, 3)) for _ in range(n)]
    parts = []
    for k in sizes:
        s = list(base)
        s[axis] = k
        parts.append(array(rng, tuple(s)))
    check_grad(lambda *xs: np.concatenate([x * x for x in xs], axis=axis), *parts, rng=rng)
    same = [array(rng, base) for _ in range(n)]
    check_grad(lambda *xs: np.stack([np.exp(x) for x in xs], axis=axis), *same, rng=rng)


MATMUL_SHAPES = [((3,), (3,)), ((2, 3), (3,)), ((3,), (3, 4)), ((2, 3), (3, 4)), ((5, 2, 3), (3, 4)),
                 ((2, 3), (5, 3, 4)), ((5, 1, 2, 3), (4, 3, 2)), ((4,), (2, 4, 3)), ((2, 2, 4), (4,))]


@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES)
def test_matmul(sa, sb):
    rng = np.random.default_rng(7)
    a, b = array(rng, sa), array(rng, sb)
    np.testing.assert_allclose(fluxpy.value_of(ops.matmul(a, b)), a @ b)
    check_grad(lambda a, b: a @ b, a, b, rng=rng)
    check_grad(lambda a, b: np.matmul(a, b), a, b, rng=rng)
    check_second_order(lambda a, b: np.tanh(a @ b), a, b, rng=rng, rtol=1e-5)


@given(m=st.integers(1, 4), k=st.integers(1, 4), n=st.integers(1, 4), batch=shapes(0, 2, max_side=3), seed=seeds)
def test_matmul_drawn(m, k, n, batch, seed):
    rng = np.random.default_rng(seed)
    a, b = array(rng, batch + (m, k)), array(rng, (k, n))
    check_grad(lambda a, b: a @ b, a, b, rng=rng)


@given(m=st.integers(2, 4), k=st.integers(2, 4), n=st.integers(2, 4), batch=shapes(0, 2, max_side=3), seed=seeds,
       transposed=st.sampled_from(["a", "b", "both"]))
def test_matmul_of_transposed_operands_gives_gradients_in_their_layout(m, k, n, batch, seed, transposed):
    """``x @ w.T`` (a weight used transposed): w's gradient reaches w in C order, equal to finite differences."""
    rng = np.random.default_rng(seed)
    lead = batch if transposed == "b" else ()
    a_t, b_t = transposed in ("a", "both"), transposed in ("b", "both")
    a = array(rng, (k, m) if a_t else lead + (m, k))
    b = array(rng, (n, k) if b_t else (k, n))

    def f(a, b):
        return ops.matmul(ops.transpose(a) if a_t else a, ops.transpose(b) if b_t else b)
    ga, gb = fluxpy.gradient(lambda a, b: (f(a, b) * np.arange(1.0, 1.0 + m * n).reshape(m, n)).sum(), a, b)
    assert ga.flags.c_contiguous and gb.flags.c_contiguous
    check_grad(f, a, b, rng=rng)


def test_dot_matches_matmul():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal(4)
    check_grad(lambda a, b: np.dot(a, b), a, b, rng=rng)


@given(shape=shapes(0, 3), seed=seeds)
def test_astype_round_trip_gradient(shape, seed):
    rng = np.random.default_rng(seed)
    x = array(rng, shape).astype(np.float32)
    g, = fluxpy.gradient(lambda x: (x.astype(np.float64) * 3.0).sum(), x)
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g, np.full(shape, 3.0, np.float32))


@given(shape=shapes(1, 3), seed=seeds)
def test_squeeze_expand_dims(shape, seed):
    rng = np.random.default_rng(seed)
    x = array(rng, shape)
    check_grad(lambda x: np.squeeze(np.expand_dims(x, 0) * 2.0), x, rng=rng)


@given(shape=shapes(0, 3), seed=seeds)
def test_float32_gradients_stay_float32(shape, seed):
    rng = np.random.default_rng(seed)
    x = array(rng, shape).astype(np.float32)
    b = array(rng, shape[1:]).astype(np.float32)
    gx, gb = fluxpy.gradient(lambda x, b: (np.tanh(x * b + 1.0) ** 2 / 3.0 + np.exp(-x) * 0.5).mean(), x, b)
    assert gx.dtype == np.float32 and gb.dtype == np.float32
