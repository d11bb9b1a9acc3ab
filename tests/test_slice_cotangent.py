"""The backward walk's slice cotangents (fluxpy.backward.SliceCotangent): getitem with a basic index pulls back
into one buffer per array, in place, with the same gradients as the dense scatter, and never writes into an array
it does not own (a seed, or a cotangent another pullback handed on)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.backward import SliceCotangent, accumulate
from fluxpy.ops.shape import getitem, stack


def _loop_loss(x, w):
    # x[:, t] at every step plus a dense use of x: slice and dense cotangents meet
    h = fluxpy.tanh(getitem(x, (slice(None), 0)))
    for t in range(1, x.shape[1]):
        h = fluxpy.tanh(getitem(x, (slice(None), t)) * w + h)
    return (h * h).sum() + (x * x).sum() * 0.5


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 4), steps=st.integers(2, 6), f=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_a_loop_of_slices_has_the_gradient_of_finite_differences(n, steps, f, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, steps, f))
    w = rng.standard_normal(f)
    gx, gw = fluxpy.gradient(_loop_loss, x, w)
    eps = 1e-6
    for arr, g in ((x, gx), (w, gw)):
        num = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + eps
            up = float(_loop_loss(x, w))
            arr[i] = old - eps
            down = float(_loop_loss(x, w))
            arr[i] = old
            num[i] = (up - down) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-7)


def test_slices_stacked_back_and_a_mask_match_the_dense_scatter():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 2))
    mask = x[0] > 0

    def f(x):
        parts = [getitem(x, (slice(None), t)) * (t + 1) for t in range(5)]
        return (stack(parts, axis=1) ** 2).sum() + getitem(x, (0, mask)).sum() + getitem(x, (Ellipsis, 1)).sum()
    g, = fluxpy.gradient(f, x)
    ref = 2 * x * np.arange(1, 6)[None, :, None] ** 2
    ref[0][mask] += 1
    ref[..., 1] += 1
    np.testing.assert_allclose(g, ref, rtol=1e-12)


def test_second_derivatives_through_a_slice_still_record():
    x = np.array([1.0, 2.0, 3.0])
    h = fluxpy.hessian(lambda x: (getitem(x, slice(0, 2)) ** 3).sum(), x)
    np.testing.assert_allclose(h, np.diag([6.0, 12.0, 0.0]))


def test_the_walk_never_writes_into_an_array_it_does_not_own():
    seed = np.ones((2, 3))
    keep = seed.copy()
    grads, owned = {}, set()
    accumulate(grads, owned, 7, seed)                           # a dense cotangent the walk did not make
    accumulate(grads, owned, 7, SliceCotangent(np.full(3, 5.0), (2, 3), (1,)))
    np.testing.assert_array_equal(seed, keep)                     # copied, not written
    np.testing.assert_array_equal(grads[7], [[1, 1, 1], [6, 6, 6]])
    accumulate(grads, owned, 7, SliceCotangent(np.full(3, 1.0), (2, 3), (0,)))   # now in place, in its own buffer
    np.testing.assert_array_equal(grads[7], [[2, 2, 2], [6, 6, 6]])
    # a user's dy handed to a pullback is left alone
    dy = np.ones(2)
    y, back = fluxpy.pullback(lambda x: getitem(x, slice(0, 2)) + getitem(x, slice(1, 3)), np.zeros(3))
    g, = back(dy)
    np.testing.assert_array_equal(g, [1.0, 2.0, 1.0])
    np.testing.assert_array_equal(dy, [1.0, 1.0])


def test_mixed_dtypes_fall_back_to_a_dense_sum():
    grads, owned = {}, set()
    accumulate(grads, owned, 1, SliceCotangent(np.ones(2, np.float32), (3,), (slice(0, 2),)))
    accumulate(grads, owned, 1, SliceCotangent(np.ones(2, np.float64), (3,), (slice(1, 3),)))
    assert grads[1].dtype == np.float64
    np.testing.assert_array_equal(grads[1], [1.0, 2.0, 1.0])
