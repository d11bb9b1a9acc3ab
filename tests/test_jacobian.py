"""jacobian, hessian and withgradient's auxiliary output (Zygote's API corners) against finite differences and
closed forms; hypothesis draws shapes."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy


def _fd_jacobian(f, x, h=1e-6):
    y = np.asarray(f(x)).ravel()
    out = np.zeros((y.size, x.size))
    for j in range(x.size):
        e = np.zeros(x.size)
        e[j] = h
        out[:, j] = (np.asarray(f(x + e.reshape(x.shape))).ravel() - np.asarray(f(x - e.reshape(x.shape))).ravel()) / (2 * h)
    return out


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(0, 10**6))
def test_jacobian_matches_finite_differences(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((3, x.size))

    def f(v):
        return fluxpy.tanh(fluxpy.matmul(w, fluxpy.reshape(v, (-1,)))) * fluxpy.sum(v * v)
    (j,) = fluxpy.jacobian(f, x)
    assert j.shape == (3, x.size)
    np.testing.assert_allclose(j, _fd_jacobian(lambda v: np.tanh(w @ v.ravel()) * (v * v).sum(), x), rtol=1e-6,
                               atol=1e-8)


def test_jacobian_of_two_arguments_and_of_a_scalar_output():
    a, b = np.array([1.0, 2.0]), np.array([3.0, 4.0, 5.0])
    ja, jb = fluxpy.jacobian(lambda a, b: fluxpy.sum(a) * b, a, b)
    np.testing.assert_allclose(ja, np.tile(b[:, None], (1, 2)))
    np.testing.assert_allclose(jb, np.eye(3) * 3.0)
    (g,) = fluxpy.jacobian(lambda a: (a * a).sum(), a)
    np.testing.assert_allclose(g, [[2.0, 4.0]])
    with pytest.raises(TypeError, match="jacobian: argument 0 must be a float array"):
        fluxpy.jacobian(lambda a: a, [1.0, 2.0])
    with pytest.raises(TypeError, match="jacobian: f must return a float array"):
        fluxpy.jacobian(lambda a: "no", a)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(0, 10**6))
def test_hessian_is_symmetric_and_matches_the_closed_form(n, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n))
    q = a @ a.T
    x = rng.standard_normal(n)
    h = fluxpy.hessian(lambda v: 0.5 * fluxpy.sum(v * fluxpy.matmul(q, v)) + fluxpy.sum(fluxpy.sin(v)), x)
    np.testing.assert_allclose(h, q - np.diag(np.sin(x)), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(h, h.T, atol=1e-12)


def test_withgradient_returns_auxiliary_output_as_plain_values():
    x = np.array([1.0, -2.0])
    (loss, pred, info), (g,) = fluxpy.withgradient(lambda x: ((x * x).sum(), x * 2, {"n": x.sum()}), x)
    assert float(loss) == 5.0 and not fluxpy.is_tracked(pred) and not fluxpy.is_tracked(info["n"])
    np.testing.assert_allclose(pred, x * 2)
    np.testing.assert_allclose(g, 2 * x)
    with pytest.raises(ValueError, match="must return a scalar"):
        fluxpy.withgradient(lambda x: (x * 2, 1.0), x)
    with pytest.raises(ValueError, match="empty tuple"):
        fluxpy.withgradient(lambda x: (), x)
    with pytest.raises(ValueError, match="must return a scalar"):
        fluxpy.gradient(lambda x: ((x * x).sum(), x), x)   # gradient keeps its scalar rule


def test_hessian_errors_name_hessian():
    with pytest.raises(ValueError, match="hessian: f must return a scalar"):
        fluxpy.hessian(lambda x: x * 2, np.ones(2))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 4), m=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_withjacobian_gives_the_value_and_jacobian_s_matrices(n, m, seed):
    rng = np.random.default_rng(seed)
    a, x = rng.standard_normal((m, n)), rng.standard_normal(n)

    def f(x):
        return np.tanh(a @ x) * 2.0
    y, (J,) = fluxpy.withjacobian(f, x)
    np.testing.assert_allclose(y, f(x), rtol=1e-14)
    np.testing.assert_array_equal(J, fluxpy.jacobian(f, x)[0])
    np.testing.assert_allclose(J, _fd_jacobian(f, x), rtol=1e-6, atol=1e-8)


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=2), seed=st.integers(0, 2**31 - 1))
def test_diaghessian_is_the_hessian_s_diagonal_for_each_argument_shaped_like_it(shape, seed):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(shape), rng.standard_normal(shape)

    def f(x, w):
        return (np.sin(x) * w ** 3).sum() + (x * w).sum() ** 2
    dx, dw = fluxpy.diaghessian(f, x, w)
    assert dx.shape == x.shape and dw.shape == w.shape
    np.testing.assert_allclose(dx.ravel(), np.diag(fluxpy.hessian(lambda z: f(z, w), x)), rtol=1e-12)
    # closed forms: d2/dx2 = -sin(x) w^3 + 2 w^2, d2/dw2 = 6 sin(x) w + 2 x^2
    np.testing.assert_allclose(dx, -np.sin(x) * w ** 3 + 2 * w ** 2, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dw, 6 * np.sin(x) * w + 2 * x ** 2, rtol=1e-10, atol=1e-12)
    assert fluxpy.diaghessian(lambda s: s ** 3, 2.0) == (12.0,)
