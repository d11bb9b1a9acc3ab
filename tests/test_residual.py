"""Residual joins: a Chain runs ``SkipConnection(f, +), relu`` and ``Parallel(+, f, g), relu`` as one op.

The fused join must give what the two ops give (values, first and second derivatives, float64 finite
differences), record one node on the tape instead of two, and fall back where the operands differ in
shape or dtype.
"""
import operator

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

import fluxpy
from fluxpy import Chain, Dense, Parallel, SkipConnection, ops
from fluxpy.ops.activations import relu
from gradcheck import check_grad, check_second_order


def _unfused(join):
    """The same join followed by a relu that the Chain does not recognise (a lambda), so it runs two ops."""
    return Chain(join, lambda z: relu(z))


def _nodes(f, *args):
    """How many nodes the tape holds for ``f(*args)`` (all arguments tracked)."""
    seen = []

    def g(*xs):
        y = f(*xs)
        stack = [y.node]
        while stack:
            n = stack.pop()
            if n.pullback is not None and all(n is not s for s in seen):
                seen.append(n)
                stack.extend(p for p in n.parents if p is not None)
        return y.sum()
    fluxpy.gradient(g, *args)
    return len(seen)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 4), width=st.integers(1, 5), seed=st.integers(0, 2**16),
       connection=st.sampled_from([operator.add, ops.add]))
def test_skip_connection_relu_matches_the_two_ops(batch, width, seed, connection):
    rng = np.random.default_rng(seed)
    block = fluxpy.f64(SkipConnection(Dense(width, width, rng=rng), connection))
    x = rng.standard_normal((batch, width))
    fused, plain = Chain(block, relu), _unfused(block)
    np.testing.assert_allclose(fused(x), plain(x), rtol=1e-12, atol=1e-12)
    g_fused = fluxpy.gradient(lambda m, x: (m(x) ** 2).sum(), fused, x)
    g_plain = fluxpy.gradient(lambda m, x: (m(x) ** 2).sum(), plain, x)
    np.testing.assert_allclose(g_fused[1], g_plain[1], rtol=1e-12, atol=1e-12)
    w_fused = g_fused[0]["layers"][0]["layers"]["weight"]
    w_plain = g_plain[0]["layers"][0]["layers"]["weight"]
    np.testing.assert_allclose(w_fused, w_plain, rtol=1e-12, atol=1e-12)
    check_grad(lambda x: fused(x), x, rng=rng)
    check_second_order(lambda x: fused(x) ** 2, x, rng=rng)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 4), cin=st.integers(1, 4), cout=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_parallel_relu_matches_the_two_ops(batch, cin, cout, seed):
    rng = np.random.default_rng(seed)
    join = fluxpy.f64(Parallel(operator.add, Dense(cin, cout, rng=rng), Dense(cin, cout, rng=rng)))
    fused, plain = Chain(join, relu), _unfused(join)
    x = rng.standard_normal((batch, cin))
    np.testing.assert_allclose(fused(x), plain(x), rtol=1e-12, atol=1e-12)
    gf, gp = (fluxpy.gradient(lambda x: (m(x) ** 3).sum(), x)[0] for m in (fused, plain))
    np.testing.assert_allclose(gf, gp, rtol=1e-12, atol=1e-12)
    check_grad(lambda x: fused(x), x, rng=rng)
    check_second_order(lambda x: fused(x) ** 2, x, rng=rng)


def test_the_join_and_relu_are_one_node():
    rng = np.random.default_rng(0)
    block = fluxpy.f64(SkipConnection(Dense(3, 3, rng=rng), operator.add))
    x = rng.standard_normal((2, 3))
    # Dense records one node on the CPU (its dense op); the join then adds 1 fused node, or add + relu unfused
    assert _nodes(Chain(block, relu), x) == 2
    assert _nodes(_unfused(block), x) == 3


def test_operands_of_other_shapes_or_dtypes_fall_back_to_add_then_relu():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3))
    widen = Chain(SkipConnection(lambda z: z.sum(axis=1, keepdims=True), operator.add), relu)   # (4,1) + (4,3)
    np.testing.assert_allclose(widen(x), np.maximum(x.sum(axis=1, keepdims=True) + x, 0))
    g, = fluxpy.gradient(lambda x: widen(x).sum(), x)
    check_grad(lambda x: widen(x), x, rng=rng)
    assert g.shape == x.shape
    mixed = Chain(Parallel(operator.add, lambda z: z.astype(np.float32), lambda z: z), relu)
    y = mixed(x)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, np.maximum(x.astype(np.float32) + x, 0))


def test_a_join_not_followed_by_relu_and_other_connections_are_unchanged():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3))
    d = fluxpy.f64(Dense(3, 3, rng=rng))
    np.testing.assert_allclose(Chain(SkipConnection(d, operator.add))(x), d(x) + x)
    np.testing.assert_allclose(Chain(SkipConnection(d, operator.mul), relu)(x), np.maximum(d(x) * x, 0))
    three = Chain(Parallel(lambda a, b, c: a + b + c, d, d, d), relu)
    np.testing.assert_allclose(three(x), np.maximum(3 * d(x), 0))
