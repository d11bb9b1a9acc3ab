"""The tape itself: gradient structure, nesting, errors, memory, NumPy dispatch."""
import gc
import tracemalloc
import weakref

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import Tracked, gradient, no_grad, primitive, pullback, stop_gradient, withgradient
from gradcheck import check_grad

rng = np.random.default_rng(42)


def test_gradient_returns_one_entry_per_argument():
    x, y = rng.standard_normal(3), rng.standard_normal(3)
    gx, gy = gradient(lambda x, y: (x * y).sum(), x, y)
    np.testing.assert_allclose(gx, y)
    np.testing.assert_allclose(gy, x)


def test_nested_containers_mirror_their_structure():
    a, b, c = rng.standard_normal(2), rng.standard_normal((2, 2)), rng.standard_normal(1)
    args = {"a": a, "pair": (b, [c, 3]), "name": "x"}
    g, = gradient(lambda d: (d["a"] * 2).sum() + (d["pair"][0] ** 2).sum() + d["pair"][1][0].sum(), args)
    assert set(g) == {"a", "pair", "name"}
    np.testing.assert_allclose(g["a"], 2 * np.ones(2))
    assert isinstance(g["pair"], tuple) and isinstance(g["pair"][1], list)
    np.testing.assert_allclose(g["pair"][0], 2 * b)
    np.testing.assert_allclose(g["pair"][1][0], np.ones(1))
    assert g["pair"][1][1] is None and g["name"] is None


class Affine:
    def __init__(self):
        self.weight = rng.standard_normal((3, 2))
        self.bias = rng.standard_normal(3)
        self.act = np.tanh
        self.unused = rng.standard_normal(4)
        self.steps = np.arange(3)

    def __call__(self, x):
        return self.act(x @ self.weight.T + self.bias)


def test_model_object_gives_dict_of_fields():
    m = Affine()
    x = rng.standard_normal((5, 2))
    g, = gradient(lambda m: m(x).sum(), m)
    assert set(g) == {"weight", "bias", "act", "unused", "steps"}
    assert g["act"] is None and g["unused"] is None and g["steps"] is None
    assert g["weight"].shape == (3, 2) and g["bias"].shape == (3,)
    check_grad(lambda w, b: np.tanh(x @ w.T + b), m.weight, m.bias)
    # the model itself is not modified (boxing works on a copy)
    assert isinstance(m.weight, np.ndarray)


def test_shared_array_accumulates():
    w = rng.standard_normal(3)
    g, = gradient(lambda t: (t[0] * t[1]).sum(), (w, w))
    np.testing.assert_allclose(g[0], 2 * w)
    assert g[0] is g[1]


def test_unused_argument_is_none_and_float_argument_gives_float():
    x = rng.standard_normal(2)
    gx, gs, gi = gradient(lambda x, s, i: (x * s).sum() * i, x, 2.0, 3)
    assert isinstance(gs, float) and gs == pytest.approx(3 * x.sum())
    assert gi is None
    g = gradient(lambda x, y: (x * 2).sum(), x, x.copy())
    assert g[1] is None


def test_withgradient_and_pullback():
    x = rng.standard_normal((2, 3))
    val, (g,) = withgradient(lambda x: (x ** 2).sum(), x)
    assert float(val) == pytest.approx((x ** 2).sum())
    np.testing.assert_allclose(g, 2 * x)
    y, back = pullback(lambda x: np.exp(x) * 2, x)
    np.testing.assert_allclose(y, np.exp(x) * 2)
    dy = rng.standard_normal((2, 3))
    np.testing.assert_allclose(back(dy)[0], dy * np.exp(x) * 2)
    np.testing.assert_allclose(back(dy)[0], dy * np.exp(x) * 2)  # callable twice
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        back(np.ones(3))


def test_non_scalar_output_is_a_clear_error():
    with pytest.raises(ValueError, match=r"scalar.*shape \(4, 2\)"):
        gradient(lambda x: x * 2, np.ones((4, 2)))


def test_broadcast_errors_name_both_shapes():
    with pytest.raises(ValueError, match=r"add: shapes \(2, 3\) and \(4,\)"):
        gradient(lambda x, y: (x + y).sum(), np.ones((2, 3)), np.ones(4))
    with pytest.raises(ValueError, match=r"multiply: shapes \(2, 3\) and \(2,\)"):
        fluxpy.ops.multiply(np.ones((2, 3)), np.ones(2))


def test_converting_tracked_to_plain_array_is_an_error():
    with pytest.raises(TypeError, match="gradient would be lost"):
        gradient(lambda x: np.asarray(x).sum(), np.ones(2))


def test_unsupported_numpy_function_names_itself():
    with pytest.raises(TypeError, match="np.cumsum is not differentiable"):
        gradient(lambda x: np.cumsum(x).sum(), np.ones(2))
    with pytest.raises(TypeError, match="np.arctan is not differentiable"):
        gradient(lambda x: np.arctan(x).sum(), np.ones(2))


def test_numpy_functions_dispatch_to_ops():
    x = rng.standard_normal((3, 4))

    def f(x):
        h = np.maximum(x, 0.0) + np.exp(x) * np.sqrt(np.abs(x) + 1) - np.tanh(x) / np.log(x * x + 2)
        s = np.sum(h, axis=0) + np.mean(h, axis=0) + np.max(h, axis=0) - np.min(h, axis=0)
        z = np.concatenate([s, np.reshape(np.transpose(x), (-1,))[:4]]) * np.stack([s, s]).sum(axis=0).sum()
        return np.where(z > 0, z, 0.1 * z) @ np.ones(8) + np.dot(x[0], x[1]) + np.clip(x, -0.5, 0.5).sum()
    check_grad(f, x)


def test_comparisons_are_not_differentiable_and_return_plain_arrays():
    def f(x):
        mask = x > 0
        assert isinstance(mask, np.ndarray) and mask.dtype == bool
        return (x * mask).sum()
    g, = gradient(f, np.array([-1.0, 2.0]))
    np.testing.assert_array_equal(g, [0.0, 1.0])


def test_second_derivative_of_nested_gradient():
    x = rng.standard_normal(4)
    # d/dx sum(d/dy sum(y^3)) = 6x
    g, = gradient(lambda x: gradient(lambda y: (y ** 3).sum(), x)[0].sum(), x)
    np.testing.assert_allclose(g, 6 * x)


def test_perturbation_confusion_is_avoided():
    # d/dx [x * d/dy (x + y)] at y = 1: the inner derivative is 1, so the answer is 1 (not 2).
    def outer(x):
        inner, = gradient(lambda y: (x + y).sum(), np.ones(1))
        return (x * inner).sum()
    g, = gradient(outer, np.array([3.0]))
    np.testing.assert_allclose(g, [1.0])


def test_hessian_vector_product_of_matmul_and_indexing():
    a = rng.standard_normal((3, 3))
    v = rng.standard_normal(3)

    def f(x):
        return np.tanh(a @ x)[np.array([0, 2, 2])].sum()

    def grad_dot_v(x):
        return (gradient(f, x)[0] * v).sum()
    check_grad(grad_dot_v, rng.standard_normal(3))


def test_no_grad_and_stop_gradient():
    def f(x):
        with no_grad():
            y = x * 2
        assert not isinstance(y, Tracked)
        return (x * y).sum() + (x * stop_gradient(x)).sum()
    x = rng.standard_normal(3)
    g, = gradient(f, x)
    np.testing.assert_allclose(g, 3 * x)


def test_custom_primitive_with_rule():
    calls = []

    @primitive
    def softsign(x):
        def softsign_pullback(dy):
            calls.append(1)
            return (dy / (1 + np.abs(x)) ** 2,)
        return x / (1 + np.abs(x)), softsign_pullback
    x = np.array([-2.0, 0.5, 3.0])
    np.testing.assert_allclose(softsign(x), x / (1 + np.abs(x)))
    check_grad(lambda x: softsign(x), x)
    assert calls


def test_needs_mask_skips_unneeded_cotangents():
    seen = []

    def rule(needs, a, b):
        seen.append(needs)

        def pb(dy):
            return (dy * b if needs[0] else None, dy * a if needs[1] else None)
        return a * b, pb
    mul = fluxpy.Primitive("mul_masked", rule, needs_mask=True)
    g, = gradient(lambda a: mul(a, np.ones(2)).sum(), np.ones(2))
    assert seen == [(True, False)]
    np.testing.assert_array_equal(g, np.ones(2))


def test_tape_is_freed_after_each_call():
    refs = []

    def f(x):
        h = np.tanh(x * 2.0)
        refs.append(weakref.ref(h))
        return (h * h).sum()
    x = rng.standard_normal(1000)
    gradient(f, x)
    assert refs[0]() is None  # freed by reference counting alone: no cycles on the tape
    gc.collect()
    tracemalloc.start()
    for _ in range(20):
        gradient(f, x)
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(200):
        gradient(f, x)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert after - before < 100_000, f"memory grew by {after - before} bytes over 200 gradient calls"


def test_long_chains_do_not_hit_recursion_limits():
    def f(x):
        for _ in range(5000):
            x = x * 1.0001
        return x.sum()
    g, = gradient(f, np.ones(2))
    np.testing.assert_allclose(g, np.full(2, 1.0001 ** 5000))


def test_gradients_are_writable_arrays():
    g, = gradient(lambda x: x.sum(), np.ones((2, 3)))
    g += 1  # not a read-only broadcast view
    assert g.flags.writeable


@given(st.integers(1, 5), st.integers(1, 5))
def test_tracked_behaves_like_an_array(n, m):
    def f(x):
        assert x.shape == (n, m) and x.ndim == 2 and x.size == n * m and len(x) == n
        assert x.dtype == np.float64
        rows = list(x)
        assert len(rows) == n
        return (x.T.reshape(m * n) ** 2).sum() + x.mean() + x.max(axis=0).sum() + rows[0].sum()
    check_grad(f, rng.standard_normal((n, m)))


def test_values_that_no_pullback_saves_are_freed_during_the_forward_pass():
    import gc
    import weakref
    refs = []

    def f(x):
        h = x + 1.0                      # add saves nothing; sum saves only the shape
        refs.append(weakref.ref(h.value))
        return (h + 1.0).sum()
    x = np.random.default_rng(0).standard_normal(5)
    y, back = fluxpy.pullback(f, x)      # the tape is alive: back can still run
    gc.collect()
    assert refs[0]() is None, "the tape keeps an intermediate value that no pullback needs"
    np.testing.assert_array_equal(back(np.float64(1.0))[0], np.ones(5))


def test_gradient_frees_the_saved_arrays_as_the_backward_pass_goes():
    import weakref
    seen = []

    def f(x):
        h = x * x                        # multiply saves x (the argument) and nothing else
        e = np.exp(h)                    # exp saves its output
        seen.append(weakref.ref(e.value))
        return e.sum()
    x = np.random.default_rng(1).standard_normal(4)
    g, = fluxpy.gradient(f, x)
    np.testing.assert_allclose(g, 2 * x * np.exp(x * x))
    assert seen[0]() is None
