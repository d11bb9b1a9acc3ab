"""scatter and gather along one axis (``axis=``: ``np.take_along_axis`` and PyTorch's ``scatter_reduce``): a loop
reference under hypothesis (shapes, axes negative included, ops, dtypes), ``np.take_along_axis``, PyTorch in
float64 where it is installed, gradients against float64 finite differences (first and second order). Its bad
inputs are in test_scatter.py's table of errors."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import kernels
from fluxpy.kernels.cpu import along_axis_index
from fluxpy.ops import gather, scatter
from gradcheck import check_grad, check_second_order
from test_scatter import reference_scatter

seeds = st.integers(0, 2**31 - 1)
OPS = ("add", "max", "min", "mean")


def reference_scatter_along(op, src, idx, axis, n):
    """``dst[..., idx[..., j, ...], ...] op= src[..., j, ...]`` into ``n`` entries on ``axis``: test_scatter's loop
    over the index tuple that reads along the axis (``along_axis_index``, itself checked against
    ``np.take_along_axis`` below)."""
    return reference_scatter(op, src, along_axis_index(idx, axis), src.shape[:axis] + (n,) + src.shape[axis + 1:])


@st.composite
def along(draw):
    """``(src shape, axis as given, axis, n, idx, seed)``: 1 to 4 axes, an index array of the source's shape into
    ``n`` entries on ``axis`` (repeats, and entries no index hits)."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    ndim = len(shape)
    given_axis = draw(st.integers(-ndim, ndim - 1))
    axis = given_axis % ndim
    n = draw(st.integers(1, 5))
    seed = draw(seeds)
    idx = np.random.default_rng(seed).integers(0, n, size=shape)
    return shape, given_axis, axis, n, idx, seed


def distinct(rng, shape):
    """Values with no ties (a max or min has one winner, so the finite differences see a smooth function)."""
    return (rng.permutation(int(np.prod(shape))).reshape(shape) + rng.uniform(0.1, 0.4, size=shape)).astype(float)


# ---------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.int64, np.uint8])
@given(case=along())
def test_scatter_along_an_axis_matches_the_loop(op, dtype, case):
    shape, given_axis, axis, n, idx, seed = case
    src = (np.random.default_rng(seed).standard_normal(shape) * 10).astype(dtype)
    got = scatter(op, src, idx, dstsize=n, axis=given_axis)
    want = reference_scatter_along(op, src, idx, axis, n)
    assert got.shape == want.shape and got.dtype == want.dtype
    if np.dtype(dtype).kind == "f" and op in ("add", "mean"):
        # a sum of values of size ~10 that cancels to near 0 is exact only to its terms' rounding (summation order)
        eps = np.finfo(dtype).eps * 8 * float(np.abs(src).max(initial=0)) * max(shape)
        np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=eps)
    else:
        np.testing.assert_array_equal(got, want)


@given(case=along())
def test_gather_along_an_axis_is_take_along_axis_and_default_dstsize_is_the_smallest(case):
    shape, given_axis, axis, n, idx, seed = case
    rng = np.random.default_rng(seed)
    table = rng.standard_normal(shape[:axis] + (n,) + shape[axis + 1:])
    np.testing.assert_array_equal(gather(table, idx, axis=given_axis), np.take_along_axis(table, idx, axis))
    src = rng.standard_normal(shape)
    default = scatter("+", src, idx, axis=given_axis)
    assert default.shape[axis] == int(idx.max()) + 1
    np.testing.assert_allclose(default, reference_scatter_along("add", src, idx, axis, int(idx.max()) + 1),
                               rtol=1e-12)


def test_known_answers():
    src = np.array([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    idx = np.array([[2, 0, 2], [1, 1, 0]])
    np.testing.assert_array_equal(scatter("+", src, idx, axis=1), [[2.0, 0.0, 5.0], [32.0, 24.0, 0.0]])
    np.testing.assert_array_equal(scatter("max", src, idx, dstsize=4, axis=-1),
                                  [[2.0, -np.inf, 4.0, -np.inf], [32.0, 16.0, -np.inf, -np.inf]])
    np.testing.assert_array_equal(scatter("mean", src, np.array([[0, 0, 0], [1, 0, 1]]), axis=0),
                                  [[1.0, 9.0, 4.0], [8.0, 0.0, 32.0]])
    np.testing.assert_array_equal(gather(src, np.array([[2], [0]]), axis=1), [[4.0], [8.0]])
    np.testing.assert_array_equal(gather(src, np.array([[1, 0, 1]]), axis=0), [[8.0, 2.0, 32.0]])
    full = scatter("min", src, idx, dstsize=(2, 3), axis=1)   # the whole shape is accepted too
    np.testing.assert_array_equal(full, [[2.0, np.inf, 1.0], [32.0, 8.0, np.inf]])


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("op", OPS)
def test_halves_along_an_axis_are_computed_in_float32_and_rounded_once(dtype, op):
    rng = np.random.default_rng(3)
    src = rng.standard_normal((3, 6, 2)).astype(dtype)
    idx = rng.integers(0, 3, size=(3, 6, 2))
    got = scatter(op, src, idx, dstsize=3, axis=1)
    assert got.dtype == np.dtype(dtype)
    want = reference_scatter_along(op, src.astype(np.float32), idx, 1, 3).astype(np.float32).astype(dtype)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_along_axis_index_is_take_along_axis_and_a_bad_entry_names_the_axis():
    rng = np.random.default_rng(4)
    x, idx = rng.standard_normal((2, 3, 4)), rng.integers(0, 3, size=(2, 5, 4))
    np.testing.assert_array_equal(x[along_axis_index(idx, 1)], np.take_along_axis(x, idx, 1))
    bad = idx.copy()
    bad[1, 2, 3] = 3
    found = kernels.cpu.first_bad_index(along_axis_index(bad, 1), x.shape)
    assert (found.which, found.value, found.size) == (1, 3, 3)


def test_matches_torch_in_float64():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    src, idx = rng.standard_normal((4, 5, 3)), rng.integers(0, 6, size=(4, 5, 3))
    table = rng.standard_normal((4, 6, 3))
    tsrc, tidx, ttable = torch.from_numpy(src), torch.from_numpy(idx), torch.from_numpy(table)
    np.testing.assert_allclose(gather(table, idx, axis=1), torch.gather(ttable, 1, tidx).numpy(), rtol=0)
    for op, reduce, fill in [("add", "sum", 0.0), ("max", "amax", -np.inf), ("min", "amin", np.inf),
                             ("mean", "mean", 0.0)]:
        want = torch.full((4, 6, 3), fill, dtype=torch.float64).scatter_reduce(1, tidx, tsrc, reduce,
                                                                             include_self=False)
        np.testing.assert_allclose(scatter(op, src, idx, dstsize=6, axis=1), want.numpy(), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# Gradients: float64 finite differences


@pytest.mark.parametrize("op", ["add", "mean"])
@given(case=along())
def test_scatter_along_gradient(op, case):
    shape, given_axis, _, n, idx, seed = case
    rng = np.random.default_rng(seed)
    f = lambda s: scatter(op, s, idx, dstsize=n, axis=given_axis)   # noqa: E731
    check_grad(f, rng.standard_normal(shape), rng=rng)
    check_second_order(lambda s: f(s) ** 2, rng.standard_normal(shape), rng=rng)


@pytest.mark.parametrize("op", ["max", "min"])
@given(case=along())
def test_scatter_along_extreme_gradient(op, case):
    shape, given_axis, _, n, idx, seed = case
    rng = np.random.default_rng(seed)
    axis = given_axis % len(shape)
    n = min(n, shape[axis])   # every destination entry hit (one that is not holds -inf or inf)
    idx = np.moveaxis(idx, axis, 0).copy()
    idx[:n] = np.arange(n).reshape((n,) + (1,) * (len(shape) - 1))
    idx = np.moveaxis(idx, 0, axis)
    check_grad(lambda s: scatter(op, s, idx, dstsize=n, axis=given_axis), distinct(rng, shape), rng=rng)


@given(case=along())
def test_gather_along_gradient(case):
    shape, given_axis, axis, n, idx, seed = case
    rng = np.random.default_rng(seed)
    table = rng.standard_normal(shape[:axis] + (n,) + shape[axis + 1:])
    check_grad(lambda t: gather(t, idx, axis=given_axis), table, rng=rng)
    check_second_order(lambda t: gather(t, idx, axis=given_axis) ** 2, table, rng=rng)


def test_gather_along_gradient_is_the_scatter_add_along():
    idx = np.array([[0, 0, 2], [1, 1, 1]])
    g, = fluxpy.gradient(lambda t: (gather(t, idx, axis=1) * np.array([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])).sum(),
                         np.zeros((2, 3)))
    np.testing.assert_array_equal(g, [[3.0, 0.0, 4.0], [0.0, 56.0, 0.0]])


@pytest.mark.parametrize("op", OPS)
def test_float32_gradient_along_matches_float64(op):
    rng = np.random.default_rng(6)
    src, idx = distinct(rng, (3, 5, 2)), rng.integers(0, 4, size=(3, 5, 2))
    idx[:, :4, :] = np.arange(4).reshape(1, 4, 1)   # every destination entry hit: no -inf rows
    cot = rng.standard_normal((3, 4, 2))
    grads = [fluxpy.gradient(lambda s: (scatter(op, s, idx, dstsize=4, axis=1) * cot.astype(t)).sum(),
                             src.astype(t))[0] for t in (np.float64, np.float32)]
    assert grads[1].dtype == np.float32
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5, atol=1e-5)


def test_empty_index_arrays():
    out = scatter("+", np.ones((2, 0, 3)), np.zeros((2, 0, 3), int), axis=1)
    assert out.shape == (2, 0, 3)
    assert gather(np.ones((2, 4)), np.zeros((2, 0), int), axis=1).shape == (2, 0)
