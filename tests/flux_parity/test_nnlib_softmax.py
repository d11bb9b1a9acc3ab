"""NNlib.jl's ``test/softmax.jl`` known-answer cases (FluxML/NNlib.jl at f71b71c), in fluxpy.

NNlib's default ``dims=1`` is the feature axis of a WHCN/feature-first array; fluxpy's default is the last axis of
``(batch, classes)``. So a Julia matrix ``A`` with ``dims=1`` is fluxpy's ``A.T`` with ``axis=-1`` (the same bytes),
and the expected results are transposed the same way (``J(...)`` below builds a Julia matrix and transposes it).
``∇softmax(dy, y)`` is the pullback of softmax at ``dy``. Not translated: the in-place ``softmax!`` forms and integer
input (fluxpy's softmax takes floats).
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import logsoftmax, logsumexp, softmax
from tests.gradcheck import check_grad, check_second_order


def J(rows, dtype=np.float64):
    """A Julia matrix literal (rows as written) as fluxpy lays it out for dims=1: transposed."""
    return np.array(rows, dtype).T


def pullback_of(f, x, dy, **kw):
    y, back = fluxpy.pullback(lambda z: f(z, **kw), x)
    return back(dy)[0]


def test_sums_to_one_on_every_axis():
    # NNlib softmax.jl:16-21
    xs = np.random.default_rng(0).random((5, 5))
    np.testing.assert_allclose(softmax(xs, axis=0).sum(axis=0), 1.0, rtol=1e-12)
    np.testing.assert_allclose(softmax(xs, axis=1).sum(axis=1), 1.0, rtol=1e-12)
    assert float(softmax(xs.ravel()).sum()) == pytest.approx(1.0)
    np.testing.assert_allclose(np.log(softmax(xs, axis=0)), logsoftmax(xs, axis=0), rtol=1e-12)


def test_large_negative_and_reference_formula():
    # NNlib softmax.jl:23-29
    xs = np.array([-100_000.0, -100_000.0])
    np.testing.assert_allclose(softmax(xs), [0.5, 0.5])
    np.testing.assert_allclose(logsoftmax(xs), np.log([0.5, 0.5]))
    xs = np.random.default_rng(1).random(5)
    np.testing.assert_allclose(softmax(xs), np.exp(xs) / np.exp(xs).sum(), rtol=1e-12)
    np.testing.assert_allclose(logsoftmax(xs), np.log(softmax(xs)), rtol=1e-12)


def test_logsoftmax_large_values():
    # NNlib softmax.jl:31-35
    np.testing.assert_allclose(logsoftmax(np.array([1, 2, 3000.0], np.float32)), [-2999, -2998, 0])
    xs = J([[1, 2, 3], [1000, 2000, 3000]], np.float32)
    np.testing.assert_allclose(logsoftmax(xs), J([[-999, -1998, -2997], [0, 0, 0]]), rtol=1e-6)


def test_pullbacks_of_ones():
    # NNlib softmax.jl:37-41: ∇logsoftmax(ones, y) == [1 1 1; -1 -1 -1], ∇softmax(ones, y) == 0
    xs = J([[1, 2, 3], [1000, 2000, 3000]], np.float32)
    ones = np.ones_like(xs)
    np.testing.assert_allclose(pullback_of(logsoftmax, xs, ones), J([[1, 1, 1], [-1, -1, -1]]), rtol=1e-6)
    np.testing.assert_allclose(pullback_of(softmax, xs, ones), 0.0, atol=1e-6)


# NNlib softmax.jl:44-53: "precalculated using PyTorch's nn.LogSoftmax"
XS = J([[-0.238639, 0.748142, -0.283194, -0.525461, -1.5348, -0.797842],
        [0.690384, 0.211427, 0.254794, -0.213572, -0.314174, -0.372663],
        [-1.146370, -0.577988, 0.718952, 0.919720, -0.620773, 0.929977]])
YS = J([[0.237703, -0.621474, 0.448193, 0.546047, 0.564185, 0.632273],
        [-0.930163, 0.0519798, 0.0549979, 0.3799, -0.477112, 0.437428],
        [0.69246, 0.569494, -0.503191, -0.925947, -0.0870738, -1.0697]])


def test_logsoftmax_pullback_known_values():
    # NNlib softmax.jl:55-59
    np.testing.assert_allclose(pullback_of(logsoftmax, XS, np.ones_like(XS)), YS, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pullback_of(softmax, XS, np.ones_like(XS)), 0.0, atol=1e-6)


def test_inf_and_nan():
    # NNlib softmax.jl:62-74. fluxpy follows NNlib here; PyTorch gives NaN for a slice holding +Inf.
    f32 = np.float32
    a = J([[1, 2], [3, np.inf]], f32)
    np.testing.assert_allclose(softmax(a), J([[0.11920292, 0.0], [0.880797, 1.0]]), rtol=1e-6)
    b = J([[1, -np.inf], [3, np.inf]], f32)
    np.testing.assert_allclose(softmax(b), J([[0.11920292, 0.0], [0.880797, 1.0]]), rtol=1e-6)
    c = J([[1, np.inf], [3, np.inf]], f32)
    np.testing.assert_allclose(softmax(c), J([[0.11920292, 0.5], [0.880797, 0.5]]), rtol=1e-6)
    d = softmax(J([[1, 2], [3, np.nan]], f32))
    np.testing.assert_allclose(d, J([[0.11920292, np.nan], [0.880797, np.nan]]), rtol=1e-6)   # NaN where NaN
    # dims=2 in Julia is fluxpy's axis 0 here; dims=(:) and (1, 2) are every axis
    np.testing.assert_allclose(softmax(a, axis=0), J([[0.26894143, 0.7310586], [0.0, 1.0]]), rtol=1e-6)
    np.testing.assert_allclose(softmax(a, axis=(0, 1)), J([[0.0, 0.0], [0.0, 1.0]]), atol=1e-7)
    for x in (a, b, c):
        np.testing.assert_allclose(np.exp(logsoftmax(x)), softmax(x), rtol=1e-6)


def test_logsumexp_identity():
    # NNlib softmax.jl:105-111: logsumexp(x) == mean(x - logsoftmax(x)), for dims = : and dims = 1 (Julia's dims=1 of
    # a 3x4 matrix is fluxpy's axis 1 of the 4x3 transpose; NNlib keeps the dims, fluxpy's keepdims=True)
    x = np.random.default_rng(2).random((4, 3))
    np.testing.assert_allclose(logsumexp(x), (x - logsoftmax(x, axis=(0, 1))).mean(), rtol=1e-12)
    np.testing.assert_allclose(logsumexp(x, axis=1, keepdims=True), (x - logsoftmax(x)).mean(axis=1, keepdims=True),
                               rtol=1e-12)
    assert logsumexp(x).shape == () and logsumexp(x, axis=1).shape == (4,)


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_logsumexp_gradients(axis):
    # NNlib softmax.jl:125-127 (gradtest(logsumexp, (3, 4), dims = :, 1, 2)) and 138-139 (its hessian)
    rng = np.random.default_rng(5)
    check_grad(lambda x: logsumexp(x, axis=axis), rng.standard_normal((3, 4)), rng=rng)
    check_second_order(lambda x: np.sin(logsumexp(x, axis=axis)), J([[1, 2, 3], [6, 5, 4]]), rng=rng)


@pytest.mark.parametrize("f", [softmax, logsoftmax])
@pytest.mark.parametrize("axis", [(0, 1), 0, 1])
def test_gradients(f, axis):
    # NNlib softmax.jl:113-123 (gradtest over dims = :, 1, 2, and times (1:3))
    rng = np.random.default_rng(3)
    check_grad(lambda x: f(x, axis=axis), rng.standard_normal((3, 4)), rng=rng)
    w = np.arange(1.0, 4.0)
    check_grad(lambda x: f(x) * w, rng.standard_normal((5, 3)), rng=rng)


@pytest.mark.parametrize("f", [softmax, logsoftmax])
def test_second_derivatives(f):
    # NNlib softmax.jl:130-136: the hessian of sum(sin, f(x)), x = [1 2 3; 6 5 4]
    check_second_order(lambda x: np.sin(f(x)), J([[1, 2, 3], [6, 5, 4]]), rng=np.random.default_rng(4))


def test_against_torch():
    torch = pytest.importorskip("torch")
    t = torch.tensor(XS, requires_grad=True)
    torch.log_softmax(t, -1).sum().backward()
    np.testing.assert_allclose(pullback_of(logsoftmax, XS, np.ones_like(XS)), t.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(YS, t.grad.numpy(), atol=1e-5)   # the upstream literal, transposed
    assert bool(torch.softmax(torch.tensor([2.0, float("inf")]), 0).isnan().all())   # PyTorch's choice (see above)
