"""scatter and gather: NNlib's known answers (translated to row-major, 0-based), a loop reference under
hypothesis, gradients against float64 finite differences (first and second order), the gradient of indexing and
of Embedding through the scatter-add op, and the errors."""
import operator

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import kernels
from fluxpy.ops import gather, scatter
from gradcheck import check_grad, check_second_order

seeds = st.integers(0, 2**31 - 1)
OPS = ("add", "max", "min", "mean")


# ---------------------------------------------------------------------------------------------
# A loop reference: dst[idx[k], ...] = op(dst[idx[k], ...], src[k, ...]), one k at a time


def _empty(op, dtype):
    if op in ("add", "mean"):
        return 0
    if np.dtype(dtype).kind == "f":
        return -np.inf if op == "max" else np.inf
    return np.iinfo(dtype).min if op == "max" else np.iinfo(dtype).max


def reference_scatter(op, src, idx, shape):
    idx = idx if isinstance(idx, tuple) else (idx,)
    out_dtype = np.float64 if op == "mean" and src.dtype.kind in "iu" else src.dtype
    dst = np.full(shape, _empty(op, src.dtype), dtype=np.float64 if op == "mean" else src.dtype)
    count = np.zeros(shape[:len(idx)])
    with np.errstate(over="ignore"):   # integer sums wrap, as NumPy's add.at wraps them
        for k in np.ndindex(idx[0].shape):
            at = tuple(int(i[k]) for i in idx)
            if op in ("add", "mean"):
                dst[at] += src[k]
            else:
                dst[at] = (np.maximum if op == "max" else np.minimum)(dst[at], src[k])
            count[at] += 1
    if op == "mean":
        dst = dst / np.maximum(count, 1).reshape(count.shape + (1,) * (len(shape) - len(idx)))
    return dst.astype(out_dtype)


@st.composite
def problems(draw, cover=False):
    """(idx tuple, dstsize, src shape): 1 or 2 index arrays of one shape (1 or 2 axes), repeated indices, and
    (unless ``cover``) destination rows that no index hits."""
    d = draw(st.integers(1, 2))
    ishape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    lead = tuple(draw(st.integers(1, 4)) for _ in range(d))
    trailing = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    seed = draw(seeds)
    rng = np.random.default_rng(seed)
    if cover:   # every destination entry hit at least once (max/min would leave -inf/inf there)
        n = int(np.prod(ishape))
        if int(np.prod(lead)) > n:
            lead = (min(n, lead[0]),) + (1,) * (d - 1)
        rows = int(np.prod(lead))
        flat = rng.permutation(np.concatenate([np.arange(rows), rng.integers(0, rows, n - rows)]))
        idx = tuple(a.reshape(ishape) for a in np.unravel_index(flat, lead))
    else:
        idx = tuple(rng.integers(0, s, size=ishape) for s in lead)
    return idx, lead + trailing, ishape + trailing, seed


def distinct(rng, shape):
    """Values at least 0.1 apart: no ties for max/min, even after finite-difference steps."""
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.1 + rng.uniform(0, 0.01, n)).reshape(shape) - 0.05 * n


# ---------------------------------------------------------------------------------------------
# Forward


def test_nnlib_known_answers():
    # NNlib.scatter(+, [10,100,1000], [3,1,2]) == [100, 1000, 10]
    np.testing.assert_array_equal(scatter("+", np.array([10, 100, 1000]), np.array([2, 0, 1])), [100, 1000, 10])
    # NNlib.scatter(+, [1 2 3 4; 5 6 7 8], [2,1,1,5]) == [5 1 0 0 4; 13 5 0 0 8]: columns become rows here
    got = scatter("+", np.array([[1, 5], [2, 6], [3, 7], [4, 8]]), np.array([1, 0, 0, 4]))
    np.testing.assert_array_equal(got, [[5, 13], [1, 5], [0, 0], [0, 0], [4, 8]])
    # NNlib.gather([1,20,300,4000], [2,4,2]) == [20, 4000, 20]; gather([1 2 3; 4 5 6], [1,3,1,3,1])
    np.testing.assert_array_equal(gather(np.array([1, 20, 300, 4000]), np.array([1, 3, 1])), [20, 4000, 20])
    np.testing.assert_array_equal(gather(np.array([[1, 4], [2, 5], [3, 6]]), np.array([0, 2, 0, 2, 0])),
                                  [[1, 4], [3, 6], [1, 4], [3, 6], [1, 4]])
    # NNlib.gather(reshape(1:15, 3, 5), [1, 2], [2, 4]) == [4, 11]: the tuples (1,2) and (2,4)
    src = np.arange(1, 16).reshape(5, 3)    # row-major copy of the 3x5 column-major array, axes swapped
    np.testing.assert_array_equal(gather(src, (np.array([1, 3]), np.array([0, 1]))), [4, 11])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.int64, np.uint8])
@given(problem=problems())
def test_scatter_matches_the_loop(op, dtype, problem):
    idx, dstsize, sshape, seed = problem
    src = (np.random.default_rng(seed).standard_normal(sshape) * 10).astype(dtype)
    got = scatter(op, src, idx if len(idx) > 1 else idx[0], dstsize=dstsize)
    want = reference_scatter(op, src, idx, dstsize)
    assert got.dtype == want.dtype and got.shape == want.shape
    single = dtype == np.float32   # sums of float32 values in another order: cancellation
    np.testing.assert_allclose(got, want, rtol=1e-5 if single else 1e-12, atol=1e-4 if single else 0)


@given(problem=problems())
def test_gather_matches_indexing_and_default_dstsize_is_the_smallest(problem):
    idx, dstsize, sshape, seed = problem
    src = np.random.default_rng(seed).standard_normal(dstsize)
    np.testing.assert_array_equal(gather(src, idx), src[idx])
    y = scatter("+", gather(src, idx), idx)
    assert y.shape[:len(idx)] == tuple(int(i.max()) + 1 for i in idx) and y.shape[len(idx):] == dstsize[len(idx):]


@pytest.mark.parametrize("op, float_empty, int_empty", [("add", 0, 0), ("mean", 0, 0), ("max", -np.inf, -128),
                                                         ("min", np.inf, 127)])
def test_entries_no_index_hits(op, float_empty, int_empty):
    """NNlib's scatter_empty: zero for + and mean, typemin for max, typemax for min."""
    y = scatter(op, np.array([1.0, 2.0]), np.array([0, 0]), dstsize=3)
    assert y[1] == float_empty and y[2] == float_empty
    yi = scatter(op, np.array([1, 2], np.int8), np.array([2, 2]), dstsize=3)
    assert yi[0] == int_empty and yi[1] == int_empty


def test_op_spellings():
    src, idx = np.array([1.0, 4.0, 2.0]), np.array([0, 0, 1])
    for spelling in ("+", "add", operator.add, np.add, np.sum):
        np.testing.assert_array_equal(scatter(spelling, src, idx), [5.0, 2.0])
    for spelling in ("max", max, np.maximum, fluxpy.max):
        np.testing.assert_array_equal(scatter(spelling, src, idx), [4.0, 2.0])
    for spelling in ("min", min, np.minimum, fluxpy.min):
        np.testing.assert_array_equal(scatter(spelling, src, idx), [1.0, 2.0])
    for spelling in ("mean", np.mean, fluxpy.mean):
        np.testing.assert_array_equal(scatter(spelling, src, idx), [2.5, 2.0])


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("op", OPS)
def test_halves_are_computed_in_float32_and_rounded_once(dtype, op):
    rng = np.random.default_rng(0)
    src = rng.standard_normal((300, 2)).astype(dtype)
    idx = rng.integers(0, 3, 300)
    got = scatter(op, src, idx)
    want = scatter(op, src.astype(np.float32), idx).astype(dtype)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_kernels_are_in_the_table():
    assert ("scatter", "numpy") in kernels.registered("numpy")
    assert ("gather", "numpy") in kernels.registered("numpy")


# ---------------------------------------------------------------------------------------------
# Gradients: float64 finite differences, first and second order


@pytest.mark.parametrize("op", ["add", "mean"])
@given(problem=problems())
def test_scatter_gradient(op, problem):
    idx, dstsize, sshape, seed = problem
    rng = np.random.default_rng(seed)
    f = lambda s: scatter(op, s, idx, dstsize=dstsize)   # noqa: E731
    check_grad(f, rng.standard_normal(sshape), rng=rng)
    check_second_order(f, rng.standard_normal(sshape), rng=rng)


@pytest.mark.parametrize("op", ["max", "min"])
@given(problem=problems(cover=True))
def test_scatter_extreme_gradient(op, problem):
    idx, dstsize, sshape, seed = problem
    rng = np.random.default_rng(seed)
    f = lambda s: scatter(op, s, idx, dstsize=dstsize)   # noqa: E731
    check_grad(f, distinct(rng, sshape), rng=rng)
    with pytest.warns(fluxpy.DetachedGradientWarning):   # piecewise linear: the second derivative is zero
        check_second_order(f, distinct(rng, sshape), rng=rng)


@given(problem=problems())
def test_gather_gradient(problem):
    idx, dstsize, _, seed = problem
    rng = np.random.default_rng(seed)
    check_grad(lambda s: gather(s, idx), rng.standard_normal(dstsize), rng=rng)
    check_second_order(lambda s: gather(s, idx) ** 2, rng.standard_normal(dstsize), rng=rng)


@pytest.mark.parametrize("op", OPS)
@given(problem=problems(cover=True))
def test_float32_gradient_matches_float64(op, problem):
    idx, dstsize, sshape, seed = problem
    rng = np.random.default_rng(seed)
    src, cot = distinct(rng, sshape), rng.standard_normal(dstsize)
    grads = [fluxpy.gradient(lambda s: (scatter(op, s, idx, dstsize=dstsize) * cot.astype(t)).sum(),
                             src.astype(t))[0] for t in (np.float64, np.float32)]
    assert grads[1].dtype == np.float32
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, want", [("max", [0.0, 1.0, 1.0, 0.0]), ("min", [1.0, 0.0, 0.0, 1.0])])
def test_ties_each_get_the_whole_gradient(op, want):
    """NNlib's ∇scatter_src for max/min: (src .== gather(dst, idx)) .* gather(Δ, idx), ties not split."""
    src = np.array([1.0, 3.0, 3.0, 1.0])
    g, = fluxpy.gradient(lambda s: scatter(op, s, np.zeros(4, np.int64)).sum(), src)
    np.testing.assert_array_equal(g, want)


def test_mean_gradient_divides_by_the_count():
    g, = fluxpy.gradient(lambda s: (scatter("mean", s, np.array([0, 0, 0, 2])) * np.array([6.0, 5.0, 2.0])).sum(),
                         np.ones(4))
    np.testing.assert_array_equal(g, [2.0, 2.0, 2.0, 2.0])


# ---------------------------------------------------------------------------------------------
# Indexing and Embedding go through the scatter-add op


def _add_at(shape, index, dy):
    out = np.zeros(shape)
    np.add.at(out, index, dy)
    return out


@pytest.fixture
def scatter_calls(monkeypatch):
    """The calls that reach the "scatter" kernel (the table entry wrapped, then put back)."""
    calls = []
    inner = kernels.lookup("scatter", np.ones(1))

    def spy(op, src, index, shape, checked=False, axis=None):
        calls.append(op)
        return inner(op, src, index, shape, checked, axis)
    before = kernels.snapshot()
    kernels.register("scatter", "numpy", spy)
    yield calls
    kernels.restore(before)


@pytest.mark.parametrize("index", [np.array([0, 0, 3, -1]), ([2, 2, 0],), (np.array([[1], [1]]), np.array([0, 2])),
                                   (np.array([3, 3]), slice(None)), (np.array([1, 1]), Ellipsis)])
def test_getitem_gradient_is_the_scatter_add(index, scatter_calls):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3))
    dy = rng.standard_normal(x[index].shape)
    g, = fluxpy.gradient(lambda v: (v[index] * dy).sum(), x)
    np.testing.assert_allclose(g, _add_at(x.shape, index, dy))
    assert scatter_calls == ["add"]
    check_grad(lambda v: v[index], x, rng=rng)
    check_second_order(lambda v: v[index] ** 2, x, rng=rng)


@pytest.mark.parametrize("index", [(slice(None), np.array([0, 0, 2])), (np.array([True, False, True, True]),),
                                   (slice(1, 3),), (1, np.array([2, 2]))])
def test_other_indices_keep_their_gradient(index):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3))
    dy = rng.standard_normal(x[index].shape)
    g, = fluxpy.gradient(lambda v: (v[index] * dy).sum(), x)
    np.testing.assert_allclose(g, _add_at(x.shape, index, dy))
    check_second_order(lambda v: v[index] ** 2, x, rng=rng)


def test_embedding_gradient_is_the_scatter_add(scatter_calls):
    rng = np.random.default_rng(2)
    emb = fluxpy.Embedding(5, 3)
    emb.weight = rng.standard_normal((5, 3))
    tokens = np.array([[1, 4, 1], [0, 1, 4]])
    dy = rng.standard_normal((2, 3, 3))
    g, = fluxpy.gradient(lambda m: (m(tokens) * dy).sum(), emb)
    np.testing.assert_allclose(g["weight"], scatter("+", dy, tokens, dstsize=(5, 3)))
    assert g["weight"][2].tolist() == [0.0, 0.0, 0.0] and g["weight"][3].tolist() == [0.0, 0.0, 0.0]
    assert scatter_calls == ["add", "add"]   # the gradient, then the reference above


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors before any work


@pytest.fixture
def kernel_calls():
    """The calls that reach the "scatter" and "gather" kernels (the table entries wrapped, then put back)."""
    calls = []
    before = kernels.snapshot()
    for name in ("scatter", "gather"):
        inner = kernels.lookup(name, np.ones(1))
        kernels.register(name, "numpy", lambda *a, _inner=inner, _name=name: calls.append(_name) or _inner(*a))
    yield calls
    kernels.restore(before)


_X = np.ones((2, 3, 4))


@pytest.mark.parametrize("call, error, words", [
    (lambda: scatter("*", np.ones(2), np.array([0, 1])), TypeError, ["scatter: op must be", "'*'"]),
    (lambda: scatter("+", np.ones(2), np.array([0.0, 1.0])), TypeError, ["scatter", "integer indices", "float64"]),
    (lambda: scatter("+", np.ones(2), np.array([0, -1])), IndexError, ["scatter", "non-negative", "-1"]),
    (lambda: scatter("+", np.ones(3), np.array([0, 1])), ValueError, ["scatter", "(2,)", "src.shape (3,)"]),
    (lambda: scatter("+", np.ones(2), np.array([0, 4]), dstsize=3), IndexError,
     ["scatter", "index 4", "out of range", "size 3"]),
    (lambda: scatter("+", np.ones((2, 3)), np.array([0, 1]), dstsize=(2, 4)), ValueError,
     ["scatter", "dstsize", "(n, *(3,))", "(2, 4)"]),
    (lambda: scatter("+", np.ones(2), np.array([0, 1]), dstsize=6.7), TypeError,
     ["scatter", "dstsize to be an int or a tuple of ints", "6.7"]),   # never rounded to 6
    (lambda: scatter("+", np.ones((2, 3)), np.array([0, 1]), dstsize=(2.0, 3)), TypeError, ["scatter", "(2.0, 3)"]),
    (lambda: scatter("+", np.ones(2), np.array([0, 1]), dstsize="3"), TypeError, ["scatter", "dstsize", "'3'"]),
    (lambda: scatter("+", np.ones(2), np.array([0, 1]), dstsize=(-2,)), ValueError,
     ["scatter", "non-negative sizes in dstsize", "(-2,)"]),
    (lambda: scatter("+", _X, np.zeros((2, 3, 4), int), dstsize=4.0, axis=2), TypeError, ["scatter", "4.0"]),
    (lambda: scatter("+", np.ones(2), (np.array([0, 1]), np.array([0]))), ValueError,
     ["scatter", "one shape", "[(2,), (1,)]"]),
    (lambda: scatter("+", np.ones(2, bool), np.array([0, 1])), TypeError, ["scatter", "float or integer", "bool"]),
    (lambda: gather(np.ones(3), np.array([0, 3])), IndexError, ["gather", "index 3", "out of range", "size 3"]),
    (lambda: gather(np.ones(3), np.array([-1])), IndexError, ["gather", "non-negative"]),
    (lambda: gather(np.ones(3), np.array([True])), TypeError, ["gather", "integer indices", "bool"]),
    (lambda: gather(np.ones(3), (np.array([0]), np.array([0]))), ValueError, ["gather", "at least 2 axes"]),
    # the along-axis form (axis=)
    (lambda: gather(_X, np.zeros((2, 3, 4), int), axis=3), ValueError,
     ["gather", "axis 3 is out of range", "3 axes", "(2, 3, 4)"]),
    (lambda: gather(_X, np.zeros((2, 3, 4), int), axis=-4), ValueError, ["gather", "axis -4"]),
    (lambda: gather(_X, np.zeros((2, 3, 4), int), axis=1.0), TypeError, ["gather", "axis", "1.0"]),
    (lambda: gather(_X, np.zeros((2, 3, 4), int), axis=True), TypeError, ["gather", "axis", "True"]),
    (lambda: gather(_X, (np.zeros((2, 3, 4), int),) * 2, axis=1), TypeError,
     ["gather", "one integer array", "tuple of 2"]),
    (lambda: gather(_X, np.zeros((2, 5, 3), int), axis=1), ValueError,
     ["gather", "every axis but 1", "(2, 3, 4)", "idx.shape (2, 5, 3)"]),
    (lambda: gather(_X, np.zeros((2, 3), int), axis=1), ValueError, ["gather", "idx.shape (2, 3)"]),
    (lambda: gather(_X, np.full((2, 1, 4), 3), axis=1), IndexError,
     ["gather", "index 3 in idx", "src axis 1 of size 3"]),
    (lambda: gather(_X, np.full((2, 3, 1), -1), axis=-1), IndexError, ["gather", "non-negative", "-1 in idx"]),
    (lambda: gather(_X, np.zeros((2, 3, 4)), axis=0), TypeError, ["gather", "integer indices", "float64"]),
    (lambda: scatter("+", _X, np.zeros((2, 2, 4), int), axis=1), ValueError,
     ["scatter", "idx.shape to be src.shape (2, 3, 4)", "(2, 2, 4)"]),
    (lambda: scatter("+", _X, np.full((2, 3, 4), 5), dstsize=5, axis=2), IndexError,
     ["scatter", "index 5 in idx", "dstsize axis 2 of size 5"]),
    (lambda: scatter("+", _X, np.zeros((2, 3, 4), int), dstsize=(2, 4, 4), axis=2), ValueError,
     ["scatter", "dstsize", "(2, 4, 4)", "axis 2"]),
    (lambda: scatter("+", _X, np.zeros((2, 3, 4), int), dstsize=-1, axis=2), ValueError,
     ["scatter", "non-negative dstsize", "-1"]),
    (lambda: scatter("max", _X, np.zeros((2, 3, 4), int), axis=5), ValueError, ["scatter", "axis 5 is out of range"]),
    (lambda: scatter("+", _X.astype(bool), np.zeros((2, 3, 4), int), axis=0), TypeError,
     ["scatter", "float or integer", "bool"]),
])
def test_errors_name_the_op_what_it_expected_and_what_it_got(call, error, words, kernel_calls):
    with pytest.raises(error) as info:
        call()
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"
    assert kernel_calls == []   # raised before any kernel ran


# ---------------------------------------------------------------------------------------------
# The index_checks kernel option ("wait" or "deferred") and check_indices


def test_the_index_checks_option_is_validated_and_keeps_the_plan_key():
    from fluxpy.kernels.cudnn import handle
    from fluxpy.options import options
    assert options.index_checks == "deferred"   # the default: no host wait inside a step
    key, before = handle.options_key(), options.get()
    with options(index_checks="wait"):
        assert options.index_checks == "wait"
        assert handle.options_key() == key   # plans and algorithm choices do not depend on it
        for bad in ("Deferred", "later", True, 1, None):
            with pytest.raises(ValueError, match=r"index_checks expects 'wait' or 'deferred', got"):
                options.set(index_checks=bad)
        with pytest.raises(ValueError):   # a bad value changes nothing, not even the options before it
            options.set(deterministic=True, index_checks="sometimes")
        assert options.get() == dict(before, index_checks="wait")
    assert options.get() == before and handle.options_key() == key


def test_check_indices_on_the_cpu_does_nothing_and_host_indices_raise_at_the_call():
    for mode in ("deferred", "wait"):
        with fluxpy.options(index_checks=mode):
            assert fluxpy.check_indices() is None
            np.testing.assert_array_equal(gather(np.arange(3), np.array([2])), [2])
            with pytest.raises(IndexError, match="gather: index 3 in idx"):
                gather(np.arange(3), np.array([3]))
            with pytest.raises(IndexError, match="scatter: expects non-negative"):
                scatter("+", np.ones(1), np.array([-1]))
            assert fluxpy.check_indices() is None and fluxpy.check_indices(wait=False) is None
    assert fluxpy.check_indices is fluxpy.ops.check_indices and "check_indices" in fluxpy.__all__
