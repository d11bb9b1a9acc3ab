"""fluxpy.ops.einsum and fluxpy.ops.norm / svdvals: values against NumPy in float64 (numpy.einsum and
numpy.linalg.norm are the reference PyTorch's torch.einsum and torch.linalg.norm match), gradients against finite
differences (hypothesis over subscripts, shapes and options), PyTorch's gradient at 0, and the errors."""
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import ops
from fluxpy.ops.linalg import norm
from gradcheck import check_grad, check_second_order

LABELS = "abcdB"


@st.composite
def einsum_problems(draw):
    """Subscripts NumPy accepts (repeated labels, size-1 broadcasting, '...', implicit output) and operand shapes."""
    sizes = {c: draw(st.integers(1, 3)) for c in LABELS}
    batch = draw(st.lists(st.integers(1, 3), max_size=2))
    terms, shapes = [], []
    for _ in range(draw(st.integers(1, 3))):
        labels = draw(st.lists(st.sampled_from(LABELS), max_size=3))
        shape = [sizes[c] for c in labels]
        # a label not repeated in this term may broadcast from size 1
        shape = [1 if labels.count(c) == 1 and draw(st.booleans()) and draw(st.booleans()) else n
                 for c, n in zip(labels, shape)]
        term = "".join(labels)
        if batch and draw(st.booleans()):
            k = draw(st.integers(0, len(batch)))
            term = "..." + term
            shape = [1 if draw(st.booleans()) and draw(st.booleans()) else n for n in batch[len(batch) - k:]] + shape
        terms.append(term)
        shapes.append(tuple(shape))
    used = sorted(set("".join(terms)) - set("."))
    if draw(st.booleans()):
        out = "".join(draw(st.permutations(used))[:draw(st.integers(0, len(used)))])
        if any("..." in t for t in terms) and draw(st.booleans()):
            out = "..." + out
        return ",".join(terms) + "->" + out, shapes
    return ",".join(terms), shapes


@given(problem=einsum_problems(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=120, deadline=None)
def test_einsum_matches_numpy_and_finite_differences(problem, seed):
    subscripts, shapes = problem
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(s) for s in shapes]
    # NumPy's optimised path is the one that sums '...' axes left out of an explicit output (as torch.einsum)
    expected = np.einsum(subscripts, *xs, optimize=True)
    np.testing.assert_allclose(ops.einsum(subscripts, *xs), expected, rtol=1e-12, atol=1e-12)
    check_grad(lambda *a: ops.einsum(subscripts, *a), *xs, rng=rng)


@pytest.mark.parametrize("subscripts, shapes", [("ij,jk->ik", [(2, 3), (3, 4)]), ("ii->i", [(3, 3)]),
                                                ("...ij,...jk", [(1, 2, 3), (4, 3, 2)]), ("i,i", [(3,), (3,)]),
                                                ("iij,jk->ki", [(2, 2, 3), (3, 4)])])
@pytest.mark.filterwarnings("ignore::fluxpy.DetachedGradientWarning")
def test_einsum_differentiates_twice(subscripts, shapes):
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(s) for s in shapes]
    check_second_order(lambda *a: ops.einsum(subscripts, *a), *xs, rng=rng)


def test_einsum_float32_and_errors():
    a = np.ones((2, 3), np.float32)
    assert ops.einsum("ij->j", a).dtype == np.float32
    with pytest.raises(ValueError, match="einsum 'ij,jk' names 2 operands, got 1"):
        ops.einsum("ij,jk", a)
    with pytest.raises(ValueError, match="label 'j' has size 3 and size 4"):
        ops.einsum("ij,jk", a, np.ones((4, 2)))
    with pytest.raises(ValueError, match="operand 0 has shape \\(2, 3\\)"):
        ops.einsum("i", a)
    with pytest.raises(ValueError, match="each output label must occur once"):
        ops.einsum("ij->iik", a)
    with pytest.raises(ValueError, match="einsum expects subscripts of letters"):
        ops.einsum("i1", a)
    with pytest.raises(TypeError, match="einsum expects the subscripts as a string"):
        ops.einsum(a, a)


VECTOR_ORDS = [None, 2, 1, np.inf, -np.inf, 0, 3, 0.5, 1.5, -1.5]
MATRIX_ORDS = [None, "fro", "nuc", 1, -1, 2, -2, np.inf, -np.inf]


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), ord=st.sampled_from(VECTOR_ORDS),
       axis=st.integers(0, 5), keepdims=st.booleans(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=80, deadline=None)
def test_vector_norms(shape, ord, axis, keepdims, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.2, 1.5, shape) * rng.choice([-1, 1], shape)
    axis = axis % len(shape)
    np.testing.assert_allclose(norm(x, ord, axis, keepdims), np.linalg.norm(x, ord, axis, keepdims),
                               rtol=1e-12)
    check_grad(lambda x: norm(x, ord, axis, keepdims), x, rng=rng)


@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=3), ord=st.sampled_from(MATRIX_ORDS),
       axes=st.permutations(range(3)), keepdims=st.booleans(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=80, deadline=None)
def test_matrix_norms(shape, ord, axes, keepdims, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    axis = tuple(a for a in axes if a < len(shape))[:2]
    np.testing.assert_allclose(norm(x, ord, axis, keepdims), np.linalg.norm(x, ord, axis, keepdims),
                               rtol=1e-10, atol=1e-12)
    assume(_kink_gap(x, ord, axis) > 1e-4)   # finite differences across a tie of two sums (or singular values) fail
    check_grad(lambda x: norm(x, ord, axis, keepdims), x, rng=rng, rtol=1e-5)


def _kink_gap(x, ord, axis):
    """The smallest gap, over the matrices of ``x``, between the largest (or smallest) candidate the norm picks and
    the next: row or column sums of ``|x|`` for the 1 and inf norms, singular values for 2 and -2; inf for the
    smooth ones."""
    m = np.moveaxis(x, axis, (-2, -1))
    if ord in (1, -1, np.inf, -np.inf):
        cands = np.abs(m).sum(axis=-2 if ord in (1, -1) else -1)
    elif ord in (2, -2):
        cands = np.linalg.svd(m, compute_uv=False)
    else:
        return np.inf
    if cands.shape[-1] < 2:
        return np.inf
    cands = np.sort(cands, axis=-1)
    pick = (cands[..., -1] - cands[..., -2]) if ord in (1, np.inf, 2) else (cands[..., 1] - cands[..., 0])
    return float(np.min(pick))


def test_norm_without_axis():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4))
    np.testing.assert_allclose(norm(x), np.linalg.norm(x), rtol=1e-13)
    np.testing.assert_allclose(norm(x, keepdims=True), np.linalg.norm(x, keepdims=True), rtol=1e-13)
    for ord in (1, np.inf, "fro", "nuc", -2):
        np.testing.assert_allclose(norm(x[0], ord), np.linalg.norm(x[0], ord), rtol=1e-12)
    for ord in (1, 3, -np.inf):
        np.testing.assert_allclose(norm(x[0, 0], ord), np.linalg.norm(x[0, 0], ord), rtol=1e-12)
    check_second_order(lambda x: norm(x, 2, 1), x, rng=rng)
    check_second_order(lambda x: norm(x, 3, 2), x, rng=rng)


@pytest.mark.parametrize("ord", [None, 2, 1, np.inf, -np.inf, 0, 3, 0.5, 1.5, -1.5])
def test_norm_gradient_at_zero_is_zero_as_pytorch(ord):
    # torch.linalg.vector_norm's backward (norm_backward): the subgradient 0 where the norm is 0, never NaN
    x = np.zeros((3, 4))
    x[0] = np.random.default_rng(1).standard_normal(4)
    g, = fluxpy.gradient(lambda x: norm(x, ord, axis=1).sum(), x)
    assert np.isfinite(g).all() and (g[1:] == 0).all()


def test_inf_norm_ties_share_the_gradient():
    # torch: sgn(x) * grad / (number of entries at the max) on each of them
    g, = fluxpy.gradient(lambda x: norm(x, np.inf), np.array([2.0, -2.0, 1.0]))
    np.testing.assert_array_equal(g, [0.5, -0.5, 0.0])


def test_svdvals_and_its_gradient():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, 3))
    np.testing.assert_allclose(ops.svdvals(x), np.linalg.svd(x, compute_uv=False), rtol=1e-12)
    check_grad(ops.svdvals, x, rng=rng, rtol=1e-5)


def test_numpy_functions_dispatch_on_tracked_values():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((3,))
    check_grad(lambda a, b: np.einsum("ij,j->i", a, b), a, b, rng=rng)
    check_grad(lambda a: np.linalg.norm(a, axis=1, keepdims=True), a, rng=rng)


def test_norm_errors():
    x = np.ones((2, 3, 4))
    with pytest.raises(ValueError, match="norm with ord=1 and axis=None expects a vector or a matrix"):
        norm(x, 1)
    with pytest.raises(ValueError, match="norm expects a vector ord"):
        norm(x, "fro", axis=0)
    with pytest.raises(ValueError, match="norm expects a matrix ord"):
        norm(x, 3, axis=(0, 1))
    with pytest.raises(ValueError, match="norm expects axis None, an int or a pair of distinct ints"):
        norm(x, axis=(1, 1))
    with pytest.raises(ValueError, match="svdvals expects an array of 2 or more axes"):
        ops.svdvals(np.ones(3))
