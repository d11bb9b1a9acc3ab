"""fluxpy.ops.numeric: each op against NumPy in float64, its gradient against finite differences (hypothesis over
shapes and options), and the second derivative where the pullback is made of ops."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import ops
from gradcheck import check_grad

UNARY = {"tan": (np.tan, (-1.2, 1.2)), "arcsin": (np.arcsin, (-0.9, 0.9)), "arccos": (np.arccos, (-0.9, 0.9)),
         "arctan": (np.arctan, (-3, 3)), "sinh": (np.sinh, (-2, 2)), "cosh": (np.cosh, (-2, 2)),
         "arcsinh": (np.arcsinh, (-3, 3)), "arctanh": (np.arctanh, (-0.9, 0.9))}


@pytest.mark.parametrize("name", sorted(UNARY))
@given(shape=st.lists(st.integers(1, 4), max_size=3), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=15, deadline=None)
def test_unary_functions_and_their_gradients(name, shape, seed):
    fn, (lo, hi) = UNARY[name]
    x = np.random.default_rng(seed).uniform(lo, hi, shape)
    op = getattr(ops, name)
    np.testing.assert_allclose(op(x), fn(x), rtol=1e-14)
    check_grad(op, x, rng=np.random.default_rng(seed))
    check_grad(lambda x: fluxpy.gradient(lambda z: op(z).sum(), x)[0], x, rng=np.random.default_rng(seed))


def _axis(draw_axis, ndim):
    return None if draw_axis is None or ndim == 0 else draw_axis % ndim


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), axis=st.one_of(st.none(), st.integers(0, 5)),
       correction=st.integers(0, 1), keepdims=st.booleans(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_var_and_std(shape, axis, correction, keepdims, seed):
    x = np.random.default_rng(seed).standard_normal(shape)
    axis = _axis(axis, len(shape))
    n = x.size if axis is None else shape[axis]
    if correction >= n:
        with pytest.raises(ValueError, match="var expects correction"):
            ops.var(x, axis, keepdims, correction)
        return
    np.testing.assert_allclose(ops.var(x, axis, keepdims, correction), np.var(x, axis, keepdims=keepdims,
                                                                            ddof=correction), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ops.std(x, axis, keepdims, correction), np.std(x, axis, keepdims=keepdims,
                                                                            ddof=correction), rtol=1e-12, atol=1e-14)
    check_grad(lambda x: ops.var(x, axis, keepdims, correction), x, rng=np.random.default_rng(seed))


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), axis=st.one_of(st.none(), st.integers(0, 5)),
       zeros=st.integers(0, 2), keepdims=st.booleans(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_prod_with_zeros(shape, axis, zeros, keepdims, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape)
    x.reshape(-1)[rng.choice(x.size, min(zeros, x.size), replace=False)] = 0.0
    axis = _axis(axis, len(shape))
    np.testing.assert_allclose(ops.prod(x, axis, keepdims), np.prod(x, axis, keepdims=keepdims), rtol=1e-14)
    check_grad(lambda x: ops.prod(x, axis, keepdims), x, rng=rng)


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), axis=st.one_of(st.none(), st.integers(0, 5)),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_cumsum_flip_and_sort(shape, axis, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    axis = _axis(axis, len(shape))
    np.testing.assert_allclose(ops.cumsum(x, axis), np.cumsum(x, axis), rtol=1e-13, atol=1e-14)
    check_grad(lambda x: ops.cumsum(x, axis), x, rng=rng)
    np.testing.assert_array_equal(ops.flip(x, axis), np.flip(x, axis))
    check_grad(lambda x: ops.flip(x, axis), x, rng=rng)
    sort_axis = -1 if axis is None else axis
    np.testing.assert_array_equal(ops.sort(x, sort_axis), np.sort(x, sort_axis))
    check_grad(lambda x: ops.sort(x, sort_axis), x, rng=rng)


@given(n=st.integers(1, 4), m=st.integers(1, 4), batch=st.integers(0, 2), k=st.integers(-3, 3),
       widths=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), min_size=2, max_size=2),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_triangles_and_pad(n, m, batch, k, widths, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch + 1, n, m)) if batch else rng.standard_normal((n, m))
    for name in ("triu", "tril"):
        np.testing.assert_array_equal(getattr(ops, name)(x, k), getattr(np, name)(x, k))
        check_grad(lambda x: getattr(ops, name)(x, k), x, rng=rng)
    y = x[0] if batch else x
    np.testing.assert_array_equal(ops.pad(y, widths, value=2.0), np.pad(y, widths, constant_values=2.0))
    check_grad(lambda y: ops.pad(y, widths), y, rng=rng)


def test_errors_are_named():
    with pytest.raises(ValueError, match="prod expects axis"):
        ops.prod(np.ones(3), axis=1)
    with pytest.raises(ValueError, match="triu expects an array of 2 or more axes"):
        ops.triu(np.ones(3))
    with pytest.raises(ValueError, match="pad expects pad_width"):
        ops.pad(np.ones(3), -1)
