"""Pools whose padding reaches the kernel's size (Flux and NNlib accept it; PyTorch refuses a pad over half the
kernel): windows of padding only give NNlib's values (the dtype's lowest finite number for a max, 0 for a mean) and
pass no gradient. Against a loop reference written from NNlib's ``src/impl/pooling_direct.jl`` (it visits only the
window's elements inside the input, starting from ``nextfloat(typemin(T))`` for a max and dividing a sum by the
whole kernel for a mean), in 1, 2 and 3 spatial dimensions."""
import itertools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import MaxPool, MeanPool
from fluxpy.ops.dims import PoolDims
from fluxpy.ops.pool import maxpool, maxpool_backward, meanpool, meanpool_backward
from gradcheck import check_grad, check_second_order

seeds = st.integers(0, 2**31 - 1)


def nnlib_pool(x, kernel, stride, pads, kind):
    """NNlib's direct pooling on NCHW data; ``pads`` a (before, after) pair per spatial axis."""
    sizes = x.shape[2:]
    out = tuple((n + a + b - k) // s + 1 for n, (a, b), k, s in zip(sizes, pads, kernel, stride))
    lowest = -np.finfo(x.dtype).max
    y = np.zeros(x.shape[:2] + out, x.dtype)
    for o in itertools.product(*map(range, out)):
        bounds = [(max(i * s - a, 0), min(i * s - a + k, n)) for i, s, (a, _), k, n in zip(o, stride, pads, kernel, sizes)]
        window = x[(slice(None), slice(None)) + tuple(slice(lo, max(lo, hi)) for lo, hi in bounds)]
        axes = tuple(range(2, x.ndim))
        if kind == "max":
            y[(Ellipsis,) + o] = window.max(axis=axes) if window.size else lowest
        else:
            y[(Ellipsis,) + o] = window.sum(axis=axes) / np.prod(kernel)
    return y


def empty_mask(x_shape, kernel, stride, pads):
    """True at each output whose window holds padding only."""
    sizes = x_shape[2:]
    out = tuple((n + a + b - k) // s + 1 for n, (a, b), k, s in zip(sizes, pads, kernel, stride))
    mask = np.zeros(out, bool)
    for o in itertools.product(*map(range, out)):
        mask[o] = any(i * s - a + k <= 0 or i * s - a >= n for i, s, (a, _), k, n in zip(o, stride, pads, kernel, sizes))
    return mask


@st.composite
def big_pad_problems(draw):
    """A pool of 1 to 3 spatial axes with pads up to two more than the kernel (at least one reaching it)."""
    n = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(n))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(n))
    pads = [(draw(st.integers(0, k + 2)), draw(st.integers(0, k + 2))) for k in kernel]
    axis = draw(st.integers(0, n - 1))
    pads[axis] = (max(pads[axis][0], kernel[axis]), pads[axis][1])
    sizes = tuple(draw(st.integers(1, 4)) for _ in kernel)
    sizes = tuple(max(s, k - a - b) for s, k, (a, b) in zip(sizes, kernel, pads))   # padded input >= kernel
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2))) + sizes
    return shape, kernel, stride, tuple(pads)


def flat(pads):
    return tuple(v for pair in pads for v in pair)


@given(problem=big_pad_problems(), seed=seeds)
def test_pools_match_nnlib_with_pads_over_the_kernel(problem, seed):
    shape, kernel, stride, pads = problem
    x = np.random.default_rng(seed).standard_normal(shape)
    for dtype in (np.float64, np.float32):
        xd = x.astype(dtype)
        y = maxpool(xd, kernel, stride, flat(pads))
        assert y.dtype == dtype
        np.testing.assert_array_equal(y, nnlib_pool(xd, kernel, stride, pads, "max"))
        np.testing.assert_allclose(meanpool(xd, kernel, stride, flat(pads)),
                                   nnlib_pool(xd, kernel, stride, pads, "mean"), rtol=1e-6, atol=1e-7)
    assert empty_mask(shape, kernel, stride, pads).any()   # the strategy's point: some window is padding only


@given(problem=big_pad_problems(), seed=seeds)
def test_gradients_with_pads_over_the_kernel(problem, seed):
    shape, kernel, stride, pads = problem
    rng = np.random.default_rng(seed)
    x = rng.permutation(np.prod(shape)).reshape(shape) * 0.1 - 1.0    # distinct values: no ties within eps
    keep = ~empty_mask(shape, kernel, stride, pads)                   # the huge empty values would swamp the FD sum
    pad = flat(pads)
    check_grad(lambda x: maxpool(x, kernel, stride, pad) * keep, x, rng=rng)
    check_grad(lambda x: meanpool(x, kernel, stride, pad), x, rng=rng)
    check_second_order(lambda x: (maxpool(x, kernel, stride, pad) * keep) ** 2, x, rng=rng)
    # no gradient through an empty window (a tiny cotangent there: the sum of lowest values would overflow)
    d = PoolDims.from_array(x, kernel, stride, pad)
    dy = np.broadcast_to(np.where(keep, 0.0, 1e-300), d.y_shape).copy()
    assert not fluxpy.gradient(lambda x: (maxpool(x, kernel, stride, pad) * dy).sum(), x)[0].any()
    assert not fluxpy.gradient(lambda x: (meanpool(x, kernel, stride, pad) * dy).sum(), x)[0].any()
    assert not maxpool_backward(dy, x, maxpool(x, kernel, stride, pad), d).any()
    assert not meanpool_backward(dy, d).any()


def test_empty_windows_of_every_dtype():
    x = np.arange(1, 5, dtype=np.float64).reshape(1, 1, 2, 2)
    for dtype, lowest in [(np.float64, -1.7976931348623157e308), (np.float32, -3.4028234663852886e38),
                          (np.float16, -65504.0), (ml_dtypes.bfloat16, -3.3895313892515355e38)]:
        y = maxpool(x.astype(dtype), 2, stride=2, pad=2)
        assert y.dtype == dtype and y.shape == (1, 1, 3, 3)
        expected = np.full((3, 3), lowest)
        expected[1, 1] = 4.0
        np.testing.assert_array_equal(y[0, 0].astype(np.float64), expected)
        m = meanpool(x.astype(dtype), 2, stride=2, pad=2)
        expected = np.zeros((3, 3))
        expected[1, 1] = 2.5
        np.testing.assert_array_equal(m[0, 0].astype(np.float64), expected)


def test_a_window_of_real_minus_infinities_is_not_empty():
    x = np.full((1, 1, 2, 2), -np.inf)
    y = maxpool(x, 2, stride=2, pad=2)
    assert y[0, 0, 1, 1] == -np.inf and y[0, 0, 0, 0] == -np.finfo(np.float64).max


def test_layers_accept_the_pads_and_say_so_in_their_repr():
    m = MaxPool((2, 2), pad=3, stride=2)
    assert repr(m) == "MaxPool((2, 2), pad=3)"
    assert m(np.ones((1, 2, 5, 5), np.float32)).shape == (1, 2, 5, 5)
    m = MeanPool((2,), pad=(2, 0))
    assert m(np.ones((1, 1, 3), np.float32)).tolist() == [[[0.0, 1.0]]]
    g = fluxpy.gradient(lambda x: MaxPool((1, 1, 1), pad=1)(x)[..., 1, 1, 1].sum(), np.ones((1, 1, 1, 1, 1)))[0]
    assert g.tolist() == [[[[[1.0]]]]]


def test_still_refused_where_the_padded_input_is_smaller_than_the_kernel():
    with pytest.raises(ValueError, match=r"maxpool expects the padded input \(3, 3\) to be at least the kernel"):
        maxpool(np.ones((1, 1, 1, 1)), 4, pad=1)


def test_against_torch_where_torch_allows_it():
    torch = pytest.importorskip("torch")
    # PyTorch allows pad <= kernel / 2, where no window is empty: both agree there
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 6))
    t = torch.nn.functional.max_pool2d(torch.from_numpy(x), 4, stride=3, padding=2).numpy()
    np.testing.assert_array_equal(maxpool(x, 4, stride=3, pad=2), t)
    with pytest.raises(RuntimeError, match="pad should be at most half"):
        torch.nn.functional.max_pool2d(torch.from_numpy(x), 2, stride=2, padding=3)
