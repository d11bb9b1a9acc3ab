"""The batchnorm primitive (fluxpy.ops.batchnorm): values, running statistics, first and second derivatives."""
import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.ops import activations as A
from fluxpy.ops.activations import relu
from fluxpy.ops.batchnorm import batchnorm, batchnorm_backward
from fluxpy.ops.norm import batchnorm_train
from gradcheck import check_grad, check_second_order


@st.composite
def problems(draw):
    ndim = draw(st.integers(2, 4))
    n = draw(st.integers(2, 4))
    c = draw(st.integers(1, 3))
    rest = tuple(draw(st.integers(1, 3)) for _ in range(ndim - 2))
    affine = draw(st.booleans())
    return (n, c) + rest, affine, draw(st.integers(0, 2**31 - 1))


def _reference(x, gamma, beta, eps):
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if gamma is not None:
        y = y * gamma.reshape(shape) + beta.reshape(shape)
    return y, mean.ravel(), var.ravel()


@given(problem=problems())
def test_values_and_running_statistics(problem):
    shape, affine, seed = problem
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3 + 1
    c = shape[1]
    gamma, beta = (rng.standard_normal(c), rng.standard_normal(c)) if affine else (None, None)
    rm, rv = rng.standard_normal(c), rng.random(c) + 0.5
    rm0, rv0 = rm.copy(), rv.copy()
    y = batchnorm(x, gamma, beta, rm, rv, momentum=0.3, eps=1e-3)
    ref, mean, var = _reference(x, gamma, beta, 1e-3)
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-10)
    m = x.size // c
    np.testing.assert_allclose(rm, 0.7 * rm0 + 0.3 * mean, rtol=1e-12)
    np.testing.assert_allclose(rv, 0.7 * rv0 + 0.3 * var * m / (m - 1), rtol=1e-12)
    # the composite of fluxpy.ops.norm computes the same
    y2, _, _ = batchnorm_train(x, gamma, beta, 1e-3)
    np.testing.assert_allclose(y, y2, rtol=1e-10, atol=1e-10)


@given(problem=problems())
def test_gradients_against_finite_differences(problem):
    shape, affine, seed = problem
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    c = shape[1]
    if affine:
        check_grad(lambda x, g, b: batchnorm(x, g, b, eps=1e-2), x, rng.standard_normal(c), rng.standard_normal(c),
                   rng=rng, rtol=1e-5, atol=1e-7)
    else:
        check_grad(lambda x: batchnorm(x, eps=1e-2), x, rng=rng, rtol=1e-5, atol=1e-7)


@given(problem=problems())
def test_second_derivatives(problem):
    shape, affine, seed = problem
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    c = shape[1]
    g, b = rng.standard_normal(c), rng.standard_normal(c)
    check_second_order(lambda x, g, b: batchnorm(x, g, b, eps=1e-2) ** 2, x, g, b, rng=rng, rtol=1e-4, atol=1e-6)


@given(problem=problems())
def test_relu_fused_equals_relu_after_and_differentiates(problem):
    shape, affine, seed = problem
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    c = shape[1]
    g, b = (rng.standard_normal(c), rng.standard_normal(c)) if affine else (None, None)
    np.testing.assert_allclose(batchnorm(x, g, b, act=relu, eps=1e-2), np.maximum(batchnorm(x, g, b, eps=1e-2), 0),
                               rtol=1e-12, atol=1e-12)
    y = batchnorm(x, g, b, eps=1e-2)
    if np.min(np.abs(y)) < 1e-4:   # finite differences across relu's kink
        return
    if affine:
        check_grad(lambda x, g, b: batchnorm(x, g, b, eps=1e-2, act=relu), x, g, b, rng=rng, rtol=1e-5, atol=1e-7)
    else:
        check_grad(lambda x: batchnorm(x, eps=1e-2, act=relu), x, rng=rng, rtol=1e-5, atol=1e-7)


FUSED = [a for a in (getattr(A, n) for n in A.__all__) if not getattr(a, "draws_random", False)] + \
    [functools.partial(A.leakyrelu, a=0.2), functools.partial(A.elu, a=0.5), np.tanh]


@pytest.mark.parametrize("act", FUSED, ids=repr)
def test_every_activation_fuses_and_equals_it_applied_after(act):
    """Forward: act of the normalised values; backward: the chain rule through act, whether the pullback reads the
    output or recomputes the pre-activation (against finite differences, in float64)."""
    rng = np.random.default_rng(abs(hash(repr(act))) % 2**32)
    x = rng.standard_normal((6, 3, 2))
    g, b = rng.standard_normal(3), rng.standard_normal(3)
    np.testing.assert_allclose(batchnorm(x, g, b, act=act, eps=1e-2), act(batchnorm(x, g, b, eps=1e-2)),
                               rtol=1e-12, atol=1e-12)
    z = batchnorm(x, g, b, eps=1e-2)
    if np.min(np.abs(np.abs(z[..., None] - np.array([0.0, 1.0, 3.0, 6.0, 0.5]))) ) < 1e-3:
        return   # finite differences across a kink
    check_grad(lambda x, g, b: batchnorm(x, g, b, eps=1e-2, act=act), x, g, b, rng=rng, rtol=1e-5, atol=1e-7)


def test_an_activation_drawing_random_numbers_is_refused():
    with pytest.raises(ValueError, match="draws no random numbers"):
        batchnorm(np.ones((4, 2)), act=A.rrelu)


def test_the_running_statistics_move_once_per_call_inside_gradient():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 3, 4, 4))
    rm, rv = np.zeros(3), np.ones(3)
    fluxpy.gradient(lambda x: (batchnorm(x, None, None, rm, rv, momentum=1.0) ** 2).sum(), x)
    np.testing.assert_allclose(rm, x.mean(axis=(0, 2, 3)), rtol=1e-12)


def test_backward_op_matches_the_gradient():
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((5, 2, 3)), rng.standard_normal((5, 2, 3))
    g = rng.standard_normal(2)
    _, back = fluxpy.pullback(lambda x, g: batchnorm(x, g, None, eps=1e-3), x, g)
    dx, dg = back(dy)
    mean = x.mean(axis=(0, 2))
    invstd = 1 / np.sqrt(x.var(axis=(0, 2)) + 1e-3)
    dx2, dg2, db2 = batchnorm_backward(dy, x, None, g, None, mean, invstd, 1e-3, None, None)
    np.testing.assert_allclose(dx, dx2, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dg, dg2, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(db2, dy.sum(axis=(0, 2)), rtol=1e-12)


@pytest.mark.parametrize("bad, message", [
    (dict(x=np.ones(3)), r"batchnorm expects x of shape \(N, C, \.\.\.\)"),
    (dict(x=np.ones((1, 3))), "more than one value per channel in training"),
    (dict(x=np.ones((4, 3)), gamma=np.ones(2)), r"gamma of shape \(3,\)"),
    (dict(x=np.ones((4, 3)), running_mean=np.zeros(3)), "both running_mean and running_var"),
])
def test_bad_input_is_refused_before_anything_changes(bad, message):
    rv = np.ones(3)
    with pytest.raises(ValueError, match=message):
        batchnorm(**bad)
    assert np.all(rv == 1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 2), st.booleans(),
       st.sampled_from([None, "relu", "elu", "sigmoid", "tanh"]), st.sampled_from([np.float32, np.float64]))
def test_the_cpu_backward_kernel_equals_the_composite(n, c, spatial, affine, act_name, dtype):
    from fluxpy.kernels import cpu_norm
    from fluxpy.ops import activations
    from fluxpy.ops.batchnorm import _backward_ops
    from fluxpy.ops.bias_act import derivative_from_saved
    rng = np.random.default_rng(n * 100 + c * 10 + spatial)
    shape = (n + 1, c) + (3,) * spatial
    x, dy = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
    gamma = rng.standard_normal(c).astype(dtype) if affine else None
    beta = rng.standard_normal(c).astype(dtype) if affine else None
    axes = (0,) + tuple(range(2, len(shape)))
    mean, invstd = x.mean(axis=axes), (1 / np.sqrt(x.var(axis=axes) + 1e-5)).astype(dtype)
    act = getattr(activations, act_name) if act_name else None
    y = y_derivative = None
    if act is not None:
        y_derivative, from_output = derivative_from_saved(act)
        assert from_output
        per_channel = (1, -1) + (1,) * spatial
        z = (x - mean.reshape(per_channel)) * invstd.reshape(per_channel)
        y = act(z if gamma is None else z * gamma.reshape(per_channel) + beta.reshape(per_channel))
    args = (dy, x, y, gamma, beta, mean, invstd, 1e-5, act, y_derivative)
    assert cpu_norm.batchnorm_backward_supports(*args)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    for got, want in zip(cpu_norm.batchnorm_backward(*args), _backward_ops(*args)):
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, **tol)
