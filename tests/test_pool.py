"""maxpool, meanpool, their global and adaptive forms, and their backward kernels.

Forward against loop references; gradients (first and second order) against float64 finite
differences; PyTorch in float64 where it is installed (these tests skip without it), including
where the gradient of tied maxima goes.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.kernels import cpu
from fluxpy.ops.dims import AdaptivePoolDims, PoolDims
from fluxpy.ops.pool import (adaptive_maxpool, adaptive_meanpool, global_maxpool, global_meanpool, maxpool,
                             maxpool_backward, meanpool, meanpool_backward)
from gradcheck import check_grad

from strategies import resolve_pad

seeds = st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------------------------------------
# Loop references


def reference_pool(x, kernel, stride, pad, reduce, fill):
    n_, c_, h_, w_ = x.shape
    (r_, s_), (sh, sw) = kernel, stride
    top, bottom, left, right = resolve_pad(pad, (h_, w_), kernel, stride)
    xp = np.full((n_, c_, h_ + top + bottom, w_ + left + right), fill)
    xp[:, :, top:top + h_, left:left + w_] = x
    p_, q_ = (xp.shape[2] - r_) // sh + 1, (xp.shape[3] - s_) // sw + 1
    y = np.zeros((n_, c_, p_, q_))
    for n in range(n_):
        for c in range(c_):
            for p in range(p_):
                for q in range(q_):
                    y[n, c, p, q] = reduce(xp[n, c, p * sh:p * sh + r_, q * sw:q * sw + s_])
    return y


def reference_adaptive(x, out_hw, reduce):
    n_, c_, h_, w_ = x.shape
    y = np.zeros((n_, c_) + tuple(out_hw))
    for i in range(out_hw[0]):
        for j in range(out_hw[1]):
            rows = slice(i * h_ // out_hw[0], -(-(i + 1) * h_ // out_hw[0]))
            cols = slice(j * w_ // out_hw[1], -(-(j + 1) * w_ // out_hw[1]))
            y[:, :, i, j] = reduce(x[:, :, rows, cols], axis=(2, 3))
    return y


# ---------------------------------------------------------------------------------------------
# Drawing problems


@st.composite
def pool_problems(draw, max_kernel=5):
    """(x shape, kernel, stride, pad) for a valid pool; kernels above 4x4 take the gathering path."""
    kernel = (draw(st.integers(1, max_kernel)), draw(st.integers(1, max_kernel)))
    stride = draw(st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 3))))
    kind = draw(st.sampled_from(["int", "pair", "four", "same"]))
    ph, pw = (draw(st.integers(0, k - 1)) for k in kernel)
    pad = {"int": min(ph, pw), "pair": (ph, pw), "same": "same",
           "four": (ph, draw(st.integers(0, kernel[0] - 1)), pw, draw(st.integers(0, kernel[1] - 1)))}[kind]
    h, w = draw(st.integers(kernel[0], kernel[0] + 5)), draw(st.integers(kernel[1], kernel[1] + 5))
    if kind == "same":
        try:
            PoolDims.from_array(np.zeros((1, 1, h, w)), kernel, stride, "same")
        except ValueError:
            pad = 0   # "same" would need padding as large as the kernel
    return (draw(st.integers(1, 2)), draw(st.integers(1, 3)), h, w), kernel, stride, pad


def randn(rng, shape):
    return rng.standard_normal(shape)


# ---------------------------------------------------------------------------------------------
# Forward


@given(problem=pool_problems(), seed=seeds)
def test_pools_match_loop_references(problem, seed):
    xs, kernel, stride, pad = problem
    rng = np.random.default_rng(seed)
    x = randn(rng, xs)
    st_ = kernel if stride is None else stride
    np.testing.assert_allclose(maxpool(x, kernel, stride, pad), reference_pool(x, kernel, st_, pad, np.max, -np.inf),
                               rtol=1e-12)
    np.testing.assert_allclose(meanpool(x, kernel, stride, pad), reference_pool(x, kernel, st_, pad, np.mean, 0.0),
                               rtol=1e-12, atol=1e-14)


def test_maxpool_pads_with_minus_infinity_and_meanpool_counts_zeros():
    x = -np.ones((1, 1, 2, 2))
    np.testing.assert_array_equal(maxpool(x, 2, stride=1, pad=1), -np.ones((1, 1, 3, 3)))
    np.testing.assert_allclose(meanpool(x, 2, stride=1, pad=1)[0, 0],
                               [[-0.25, -0.5, -0.25], [-0.5, -1.0, -0.5], [-0.25, -0.5, -0.25]])


def test_float32_stays_float32():
    x = np.ones((2, 3, 6, 6), np.float32)
    for f in (lambda x: maxpool(x, 2), lambda x: meanpool(x, 3, pad=1), global_maxpool, global_meanpool,
              lambda x: adaptive_maxpool(x, 4), lambda x: adaptive_meanpool(x, (2, 5))):
        assert f(x).dtype == np.float32
        assert fluxpy.gradient(lambda x: f(x).sum(), x)[0].dtype == np.float32


@pytest.mark.parametrize("h,w,out", [(5, 6, (2, 3)), (7, 7, (3, 3)), (4, 9, (4, 2)), (3, 2, (5, 4)), (6, 6, (1, 1))])
def test_adaptive_pools_match_loop_references(h, w, out):
    x = randn(np.random.default_rng(0), (2, 3, h, w))
    np.testing.assert_allclose(adaptive_maxpool(x, out), reference_adaptive(x, out, np.max), rtol=1e-12)
    np.testing.assert_allclose(adaptive_meanpool(x, out), reference_adaptive(x, out, np.mean), rtol=1e-12)


def test_global_pools():
    x = randn(np.random.default_rng(1), (2, 3, 5, 7))
    np.testing.assert_allclose(global_maxpool(x)[:, :, 0, 0], x.max(axis=(2, 3)), rtol=1e-12)
    np.testing.assert_allclose(global_meanpool(x)[:, :, 0, 0], x.mean(axis=(2, 3)), rtol=1e-12)


@given(problem=pool_problems(), seed=seeds)
def test_loop_and_gather_strategies_agree(problem, seed):
    """The two CPU strategies (kernel-offset loop, gathered windows) give identical results."""
    xs, kernel, stride, pad = problem
    rng = np.random.default_rng(seed)
    x = np.round(randn(rng, xs))   # many ties
    pdims = PoolDims.from_array(x, kernel, stride, pad)
    dy, dz = randn(rng, pdims.y_shape), randn(rng, xs)
    y = cpu.maxpool_forward(x, pdims)

    def run():
        return (cpu.maxpool_forward(x, pdims), cpu.maxpool_argmax(x, pdims), cpu.maxpool_backward(dy, x, y, pdims),
                cpu.maxpool_gather(dz, x, y, pdims), cpu.meanpool_forward(x, pdims), cpu.meanpool_backward(dy, pdims))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "_LOOP_MAX_OFFSETS", 0)
        gathered = run()
        mp.setattr(cpu, "_LOOP_MAX_OFFSETS", 10**9)
        looped = run()
    for a, b in zip(gathered, looped):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@given(n=st.integers(1, 2), c=st.integers(1, 3), kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       gap=st.tuples(st.integers(0, 1), st.integers(0, 1)), extra=st.tuples(st.integers(0, 2), st.integers(0, 2)),
       pad=st.integers(0, 1), seed=seeds, dtype=st.sampled_from([np.float32, np.float64]))
def test_the_disjoint_windows_backward_equals_the_gathered_one(n, c, kernel, gap, extra, pad, seed, dtype):
    """Windows that share no entry (stride >= kernel; leftover rows and columns, padding) write each gradient once:
    the same as the gathered strategy's scatter-add, ties (rounded data) and NaN windows (the first NaN takes the
    gradient) included."""
    rng = np.random.default_rng(seed)
    stride = (kernel[0] + gap[0], kernel[1] + gap[1])
    shape = (n, c, 2 * stride[0] + extra[0], 3 * stride[1] + extra[1])
    x = np.round(randn(rng, shape)).astype(dtype)
    x[rng.random(shape) < 0.1] = np.nan
    pdims = PoolDims.from_array(x, kernel, stride, min(pad, kernel[0] - 1, kernel[1] - 1))
    assert cpu._disjoint(pdims) and cpu._loops(pdims)
    y = cpu.maxpool_forward(x, pdims)
    dy = randn(rng, pdims.y_shape).astype(dtype)
    disjoint = cpu.maxpool_backward(dy, x, y, pdims)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "_LOOP_MAX_OFFSETS", 0)
        gathered = cpu.maxpool_backward(dy, x, y, pdims)
    assert disjoint.dtype == gathered.dtype
    np.testing.assert_array_equal(disjoint, gathered)


@given(n=st.integers(1, 2), c=st.integers(1, 2), kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       stride=st.tuples(st.integers(1, 3), st.integers(1, 3)), pad=st.integers(0, 1), seed=seeds)
def test_both_strategies_give_a_nan_window_s_gradient_to_its_first_nan(n, c, kernel, stride, pad, seed):
    rng = np.random.default_rng(seed)
    x = randn(rng, (n, c, 7, 8))
    x[rng.random(x.shape) < 0.15] = np.nan
    pdims = PoolDims.from_array(x, kernel, stride, min(pad, kernel[0] - 1, kernel[1] - 1))
    y = cpu.maxpool_forward(x, pdims)
    dy = randn(rng, pdims.y_shape)
    looped = cpu.maxpool_backward(dy, x, y, pdims)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "_LOOP_MAX_OFFSETS", 0)
        gathered = cpu.maxpool_backward(dy, x, y, pdims)
        assert np.array_equal(cpu.maxpool_forward(x, pdims), y, equal_nan=True)
    np.testing.assert_allclose(looped, gathered, rtol=1e-12, atol=1e-15)   # overlapping windows: sums' order
    assert np.isclose(looped.sum(), dy.sum())   # every window's gradient lands on one entry


# ---------------------------------------------------------------------------------------------
# Gradients


@given(problem=pool_problems(), seed=seeds)
def test_pool_gradients(problem, seed):
    xs, kernel, stride, pad = problem
    rng = np.random.default_rng(seed)
    x = randn(rng, xs)
    check_grad(lambda x: maxpool(x, kernel, stride, pad), x, rng=rng)
    check_grad(lambda x: meanpool(x, kernel, stride, pad), x, rng=rng)


@given(problem=pool_problems(max_kernel=3), seed=seeds)
def test_pool_second_derivatives(problem, seed):
    xs, kernel, stride, pad = problem
    rng = np.random.default_rng(seed)
    x = randn(rng, xs)
    for pool in (maxpool, meanpool):
        def gradient_of_pool(x):
            g, = fluxpy.gradient(lambda x: np.sin(pool(x, kernel, stride, pad)).sum(), x)
            return (g * g).sum()
        check_grad(gradient_of_pool, x, rng=rng)


@given(problem=pool_problems(), seed=seeds)
def test_backward_kernel_gradients(problem, seed):
    xs, kernel, stride, pad = problem
    rng = np.random.default_rng(seed)
    x = randn(rng, xs)
    pdims = PoolDims.from_array(x, kernel, stride, pad)
    dy, y = randn(rng, pdims.y_shape), maxpool(x, kernel, stride, pad)
    grads = check_grad(lambda dy: maxpool_backward(dy, x, y, pdims), dy, rng=rng)
    check_grad(lambda dy: meanpool_backward(dy, pdims), dy, rng=rng)
    assert grads[0].shape == dy.shape


@pytest.mark.parametrize("h,w,out", [(5, 6, (2, 3)), (3, 2, (5, 4)), (6, 6, (1, 1))])
def test_global_and_adaptive_gradients(h, w, out):
    rng = np.random.default_rng(2)
    x = randn(rng, (2, 2, h, w))
    for f in (global_maxpool, global_meanpool, lambda x: adaptive_maxpool(x, out),
              lambda x: adaptive_meanpool(x, out)):
        check_grad(f, x, rng=rng)

        def gradient_of(x, f=f):
            g, = fluxpy.gradient(lambda x: np.sin(f(x)).sum(), x)
            return (g * g).sum()
        check_grad(gradient_of, x, rng=rng)


def test_maxpool_gradient_goes_to_the_first_maximum():
    x = np.zeros((1, 1, 2, 4))
    g, = fluxpy.gradient(lambda x: maxpool(x, 2).sum() + global_maxpool(x).sum() + adaptive_maxpool(x, 1).sum(), x)
    np.testing.assert_array_equal(g[0, 0], [[3.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("call,match", [
    (lambda: maxpool(np.ones((2, 5)), 2),
     r"maxpool expects x of 3, 4 or 5 dimensions \(N, C, \*spatial\) \(1, 2 or 3 spatial axes\), got x of shape "
     r"\(2, 5\)"),
    (lambda: maxpool(np.ones((2, 5, 5)), (2, 2)),
     r"maxpool expects x of 4 dimensions \(N, C, H, W\) for a window of 2 axes \(2, 2\), got x of shape \(2, 5, 5\)"),
    (lambda: maxpool(np.ones((1, 2, 5, 5, 5)), 2, stride=(1, 2)),
     r"maxpool expects stride to be a positive int or a triple of them, got \(1, 2\)"),
    (lambda: meanpool(np.ones((1, 2, 5)), 3, pad=(1, 2, 1)),
     r"meanpool expects pad to be a non-negative int, a 1-tuple \(p,\), a pair \(left, right\) or \"same\""),
    (lambda: maxpool(np.ones((1, 1, 5, 5)), 0),
     r"maxpool expects kernel to be a positive int or a pair of them, got 0"),
    (lambda: meanpool(np.ones((1, 1, 5, 5)), 2, stride=(1, 0)), r"meanpool expects stride to be a positive int"),
    (lambda: meanpool(np.ones((1, 1, 2, 5)), 3),
     r"meanpool expects the padded input \(2, 5\) to be at least the kernel \(3, 3\), got x of shape \(1, 1, 2, 5\)"),
    (lambda: adaptive_maxpool(np.ones((1, 1, 5, 5)), (0, 2)),
     r"adaptive_maxpool expects the output size to be a positive"),
    (lambda: adaptive_meanpool(np.ones((5, 5)), 2), r"adaptive_meanpool expects x of 3, 4 or 5 dimensions"),
    (lambda: adaptive_maxpool(np.ones((1, 1, 5, 5)), (2, 2, 2)),
     r"adaptive_maxpool expects x of 5 dimensions \(N, C, D, H, W\) for a window of 3 axes"),
    (lambda: global_maxpool(np.ones((5, 5))), r"global_maxpool expects x of 3, 4 or 5 dimensions"),
    (lambda: global_meanpool(np.ones((1, 1, 2, 2, 2, 2))), r"global_meanpool expects x of 3, 4 or 5 dimensions"),
    (lambda: maxpool_backward(np.ones((1, 1, 3, 3)), np.ones((1, 1, 4, 4)), None,
                              PoolDims.from_array(np.ones((1, 1, 4, 4)), 2)),
     r"maxpool_backward expects dy of shape \(1, 1, 2, 2\) \(the pool's output\), got dy of shape \(1, 1, 3, 3\)"),
    (lambda: meanpool_backward(np.ones((1, 1, 3, 3)), PoolDims.from_array(np.ones((1, 1, 4, 4)), 2)),
     r"meanpool_backward expects dy of shape \(1, 1, 2, 2\)"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# Against PyTorch (float64; skipped where torch is not installed)


def _torch_pool(torch, x, kernel, stride, pad, kind):
    top, bottom, left, right = pad
    F = torch.nn.functional
    if kind == "max":
        return F.max_pool2d(F.pad(x, (left, right, top, bottom), value=-math.inf), kernel, stride)
    return F.avg_pool2d(F.pad(x, (left, right, top, bottom)), kernel, stride)


@given(problem=pool_problems(), seed=seeds, ties=st.booleans())
def test_pools_against_torch(problem, seed, ties):
    torch = pytest.importorskip("torch")
    xs, kernel, stride, pad = problem
    rng = np.random.default_rng(seed)
    x = randn(rng, xs)
    if ties:
        x = np.round(x)   # where the gradient of tied maxima goes must match too
    pdims = PoolDims.from_array(x, kernel, stride, pad)
    dy = randn(rng, pdims.y_shape)
    for ours, kind in ((maxpool, "max"), (meanpool, "mean")):
        tx = torch.tensor(x, requires_grad=True)
        ty = _torch_pool(torch, tx, pdims.kernel, pdims.stride, pdims.pad, kind)
        ty.backward(torch.tensor(dy))
        y, back = fluxpy.pullback(lambda x: ours(x, kernel, stride, pad), x)
        np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(back(dy)[0], tx.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_symmetric_padding_against_torch_pool_padding():
    torch = pytest.importorskip("torch")
    x = randn(np.random.default_rng(3), (2, 3, 7, 8))
    F = torch.nn.functional
    np.testing.assert_allclose(maxpool(x, 3, 2, 1), F.max_pool2d(torch.tensor(x), 3, 2, 1).numpy(), rtol=1e-12)
    np.testing.assert_allclose(meanpool(x, (3, 2), 1, (1, 1)),
                               F.avg_pool2d(torch.tensor(x), (3, 2), 1, (1, 1), count_include_pad=True).numpy(),
                               rtol=1e-12)


@pytest.mark.parametrize("h,w,out", [(5, 6, (2, 3)), (7, 7, (3, 3)), (4, 9, (4, 2)), (3, 2, (5, 4)), (6, 6, (1, 1)),
                                     (28, 28, (7, 7))])
@pytest.mark.parametrize("ties", [False, True])
def test_adaptive_and_global_against_torch(h, w, out, ties):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(4)
    x = randn(rng, (2, 3, h, w))
    if ties:
        x = np.round(x)
    dy = randn(rng, (2, 3) + out)
    cases = [(lambda x: adaptive_maxpool(x, out), lambda t: F.adaptive_max_pool2d(t, out)),
             (lambda x: adaptive_meanpool(x, out), lambda t: F.adaptive_avg_pool2d(t, out))]
    if out == (1, 1):
        cases += [(global_maxpool, lambda t: F.adaptive_max_pool2d(t, 1)),
                  (global_meanpool, lambda t: F.adaptive_avg_pool2d(t, 1))]
    for ours, theirs in cases:
        tx = torch.tensor(x, requires_grad=True)
        ty = theirs(tx)
        ty.backward(torch.tensor(dy))
        y, back = fluxpy.pullback(ours, x)
        np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(back(dy)[0], tx.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_adaptive_dims_bins():
    d = AdaptivePoolDims.from_array(np.ones((1, 1, 5, 3)), (3, 5))
    assert d.window_rows().tolist() == [[0, 1, 1], [1, 2, 3], [3, 4, 4]]
    assert d.window_cols().tolist() == [[0, 0], [0, 1], [1, 1], [1, 2], [2, 2]]   # bins overlap


@settings(max_examples=25, deadline=None)
@given(p=st.sampled_from([1, 2, 3, 1.5]), kernel=st.integers(1, 3), stride=st.integers(1, 3), pad=st.integers(0, 1),
       seed=seeds)
def test_lpnormpool_is_the_p_norm_of_each_window(p, kernel, stride, pad, seed):
    from fluxpy import lpnormpool
    pad = min(pad, kernel - 1) if kernel > 1 else 0
    rng = np.random.default_rng(seed)
    x = np.abs(randn(rng, (2, 2, 6, 5))) + 0.1   # positive: the fractional powers are real
    y = lpnormpool(x, p, kernel, stride, pad)
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    rows = (xp.shape[2] - kernel) // stride + 1
    cols = (xp.shape[3] - kernel) // stride + 1
    want = np.array([[[[(xp[n, c, i * stride:i * stride + kernel, j * stride:j * stride + kernel] ** p).sum()
                        ** (1 / p) for j in range(cols)] for i in range(rows)] for c in range(2)] for n in range(2)])
    np.testing.assert_allclose(y, want, rtol=1e-12)
    if p == 1:   # NNlib's identity: lpnormpool(x, 1, k) / prod(k) == meanpool(x, k)
        np.testing.assert_allclose(y / kernel ** 2, meanpool(x, kernel, stride, pad), rtol=1e-12)
    check_grad(lambda x: lpnormpool(x, p, kernel, stride, pad), x, rng=rng)


def test_lpnormpool_matches_pytorch_and_refuses_a_bad_p():
    from fluxpy import lpnormpool
    with pytest.raises(ValueError, match=r"^lpnormpool expects p to be a number in \(0, inf\), got 0"):
        lpnormpool(np.ones((1, 1, 4, 4)), 0, 2)
    torch = pytest.importorskip("torch")
    x = np.abs(randn(np.random.default_rng(2), (2, 3, 7, 6))) + 0.1
    for p, k, s in ((2, 2, 2), (3, (2, 3), 1), (1.5, 3, 2)):
        np.testing.assert_allclose(lpnormpool(x, p, k, s),
                                   torch.nn.functional.lp_pool2d(torch.from_numpy(x), p, k, s).numpy(), rtol=1e-12)


def test_lpnormpool_of_a_window_of_zeros_is_zero_with_a_zero_gradient():
    from fluxpy import lpnormpool, relu
    x = np.array([[[[-1.0, -2.0, 3.0, 4.0], [-0.5, -3.0, 1.0, 2.0]]]])   # after relu the first window is all zeros
    y, (g,) = fluxpy.withgradient(lambda x: lpnormpool(relu(x), 2, 2).sum(), x)
    np.testing.assert_allclose(float(y), np.sqrt(9 + 16 + 1 + 4), rtol=1e-14)
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(g[0, 0, :, :2], 0)
    np.testing.assert_allclose(g[0, 0, :, 2:], np.array([[3.0, 4.0], [1.0, 2.0]]) / np.sqrt(30), rtol=1e-14)
