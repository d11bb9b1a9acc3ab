"""softmax and logsoftmax: values, stability, first and second derivatives, torch agreement."""
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy.ops.softmax import logsoftmax, softmax
from gradcheck import check_grad, check_second_order
from strategies import axes_for, shapes

seeds = st.integers(0, 2**31 - 1)


def reference_logsoftmax(x, axis):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


@st.composite
def shape_and_axis(draw):
    shape = draw(shapes(1, 3))
    axis = draw(axes_for(len(shape)))
    return shape, axis


@given(case=shape_and_axis(), seed=seeds)
def test_values_and_gradients(case, seed):
    shape, axis = case
    rng = np.random.default_rng(seed)
    x = 3 * rng.standard_normal(shape)
    expected = reference_logsoftmax(x, axis)
    np.testing.assert_allclose(logsoftmax(x, axis), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(softmax(x, axis), np.exp(expected), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(softmax(x, axis).sum(axis=axis), 1.0)
    check_grad(lambda x: softmax(x, axis), x, rng=rng)
    check_grad(lambda x: logsoftmax(x, axis), x, rng=rng)


@given(case=shape_and_axis(), seed=seeds)
def test_second_derivatives(case, seed):
    shape, axis = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    weights = rng.standard_normal(shape)  # so the Hessian-vector product is not trivially zero
    check_second_order(lambda x: softmax(x, axis) * weights, x, rng=rng, rtol=1e-5)
    check_second_order(lambda x: logsoftmax(x, axis) * weights, x, rng=rng, rtol=1e-5)


def test_default_axis_is_the_last():
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(softmax(x), softmax(x, axis=1))
    np.testing.assert_allclose(logsoftmax(x), logsoftmax(x, -1))


def test_stable_for_huge_inputs_and_masked_entries():
    x = np.array([[1e4, 0.0, -1e4], [-np.inf, 1.0, 1.0]], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, ly = softmax(x), logsoftmax(x)
        g, = fluxpy.gradient(lambda x: (logsoftmax(x)[:, 1:] * np.float32(2)).sum(), x)
    np.testing.assert_allclose(y, [[1, 0, 0], [0, 0.5, 0.5]])
    np.testing.assert_allclose(ly[0], [0, -1e4, -2e4])
    assert ly[1, 0] == -np.inf and np.all(np.isfinite(g))
    assert y.dtype == ly.dtype == g.dtype == np.float32


def test_pullbacks_are_the_documented_formulas():
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    y, back = fluxpy.pullback(softmax, x)
    np.testing.assert_allclose(back(dy)[0], y * (dy - (dy * y).sum(-1, keepdims=True)))
    ly, lback = fluxpy.pullback(logsoftmax, x)
    np.testing.assert_allclose(lback(dy)[0], dy - np.exp(ly) * dy.sum(-1, keepdims=True))


def test_one_node_on_the_tape():
    def f(x):
        y = softmax(x)
        assert y.node.parents[0] is x.node
        return y[0, 0]
    fluxpy.gradient(f, np.ones((2, 3)))


@pytest.mark.parametrize("axis", [0, 1, -1, (1, 2)])
def test_matches_torch(axis):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 4, 5))
    for ours, theirs in ((softmax, torch.softmax), (logsoftmax, torch.log_softmax)):
        t = torch.tensor(x, requires_grad=True)
        if isinstance(axis, tuple):  # torch takes one dim: flatten the two
            ty = theirs(t.reshape(3, 20), 1).reshape(3, 4, 5)
        else:
            ty = theirs(t, axis)
        ty.backward(torch.tensor(dy))
        y, back = fluxpy.pullback(lambda x: ours(x, axis), x)
        np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(back(dy)[0], t.grad.numpy(), rtol=1e-10, atol=1e-13)


def test_axis_errors():
    with pytest.raises(ValueError, match="softmax: axis 2 is out of range"):
        softmax(np.ones((2, 3)), axis=2)
    with pytest.raises(ValueError, match="logsoftmax: repeated axis"):
        logsoftmax(np.ones((2, 3)), axis=(1, -1))


@given(n=st.integers(1, 5), c=st.integers(1, 7), seed=st.integers(0, 2**31 - 1), soft=st.booleans())
def test_logit_crossentropy_rows_gradients_and_value(n, c, seed, soft):
    from fluxpy.ops.softmax import logit_crossentropy_rows
    rng = np.random.default_rng(seed)
    yhat = rng.standard_normal((n, c)) * 3
    y = rng.random((n, c)) if soft else np.eye(c)[rng.integers(0, c, n)]
    expected = -(y * (yhat - yhat.max(1, keepdims=True) - np.log(np.exp(yhat - yhat.max(1, keepdims=True))
                                                                  .sum(1, keepdims=True)))).sum(1)
    np.testing.assert_allclose(logit_crossentropy_rows(yhat, y), expected, rtol=1e-12, atol=1e-12)
    check_grad(logit_crossentropy_rows, yhat, y, rng=rng)
    check_second_order(logit_crossentropy_rows, yhat, y, rng=rng, rtol=1e-5)


def test_logit_crossentropy_rows_shape_error():
    from fluxpy.ops.softmax import logit_crossentropy_rows
    with pytest.raises(ValueError, match=r"logit_crossentropy_rows expects .* got \(2, 3\) and \(2, 4\)"):
        logit_crossentropy_rows(np.ones((2, 3)), np.ones((2, 4)))
