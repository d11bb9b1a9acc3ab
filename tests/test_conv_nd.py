"""Convolutions and pools in 1 and 3 spatial dimensions (2-d: tests/test_conv.py, tests/test_pool.py), and the layers
of every rank: Conv, CrossCor, ConvTranspose, DepthwiseConv, MaxPool, MeanPool, the global and adaptive pools.

Forward results against direct loop references written per output element; gradients (first and second order)
against float64 finite differences over hypothesis-drawn shapes and options; PyTorch in float64 where it is
installed (those tests skip without it).
"""
import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import fluxpy
from fluxpy import (AdaptiveMaxPool, AdaptiveMeanPool, Conv, ConvTranspose, CrossCor, DepthwiseConv, DimensionMismatch,
                    GlobalMaxPool, GlobalMeanPool, MaxPool, MeanPool)
from fluxpy.ops.conv import conv, conv_backward_data, conv_backward_filter, conv_bias_act, conv_transpose
from fluxpy.ops.dims import AdaptivePoolDims, ConvDims, PoolDims
from fluxpy.ops.pool import (adaptive_maxpool, adaptive_meanpool, global_maxpool, global_meanpool, maxpool,
                             maxpool_backward, meanpool, meanpool_backward)
from gradcheck import check_grad, check_second_order

seeds = st.integers(0, 2**31 - 1)
ranks = st.sampled_from([1, 3])


# ---------------------------------------------------------------------------------------------
# Loop references, any rank (written independently of fluxpy.ops.dims)


def resolve_pad_nd(pad, sizes, kernel, stride):
    """((before, after), ...) per axis for each pad form: int, one per axis, a pair per axis, "same"."""
    n = len(sizes)
    if pad == "same":
        out = []
        for size, k, s in zip(sizes, kernel, stride):
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            out.append((total // 2, total - total // 2))
        return out
    if isinstance(pad, int):
        return [(pad, pad)] * n
    if len(pad) == n:
        return [(p, p) for p in pad]
    return [(pad[2 * i], pad[2 * i + 1]) for i in range(n)]


def padded(x, pads, fill=0.0):
    xp = np.full(x.shape[:2] + tuple(s + a + b for s, (a, b) in zip(x.shape[2:], pads)), fill)
    xp[(slice(None), slice(None)) + tuple(slice(a, a + s) for s, (a, _) in zip(x.shape[2:], pads))] = x
    return xp


def reference_conv(x, w, stride, pad=0, dilation=None, groups=1, flipped=False):
    n = x.ndim - 2
    dilation = dilation or (1,) * n
    kernel = w.shape[2:]
    dilated = tuple(d * (k - 1) + 1 for d, k in zip(dilation, kernel))
    xp = padded(x, resolve_pad_nd(pad, x.shape[2:], dilated, stride))
    out = tuple((p - d) // s + 1 for p, d, s in zip(xp.shape[2:], dilated, stride))
    k_, cg = w.shape[:2]
    kg = k_ // groups
    wf = w if flipped else w[(slice(None), slice(None)) + (slice(None, None, -1),) * n]
    y = np.zeros((x.shape[0], k_) + out)
    for k in range(k_):
        g = k // kg
        for o in itertools.product(*map(range, out)):
            window = tuple(slice(i * s, i * s + d, dl) for i, s, d, dl in zip(o, stride, dilated, dilation))
            patch = xp[(slice(None), slice(g * cg, (g + 1) * cg)) + window]        # (N, C/G, *kernel)
            y[(slice(None), k) + o] = np.sum(patch * wf[k], axis=tuple(range(1, patch.ndim)))
    return y


def reference_pool(x, kernel, stride, pad, reduce, fill):
    xp = padded(x, resolve_pad_nd(pad, x.shape[2:], kernel, stride), fill)
    out = tuple((p - k) // s + 1 for p, k, s in zip(xp.shape[2:], kernel, stride))
    y = np.zeros(x.shape[:2] + out)
    for o in itertools.product(*map(range, out)):
        window = tuple(slice(i * s, i * s + k) for i, s, k in zip(o, stride, kernel))
        y[(Ellipsis,) + o] = reduce(xp[(slice(None), slice(None)) + window], axis=tuple(range(2, x.ndim)))
    return y


def reference_adaptive(x, out, reduce):
    y = np.zeros(x.shape[:2] + tuple(out))
    for o in itertools.product(*map(range, out)):
        bins = tuple(slice(i * s // p, -(-(i + 1) * s // p)) for i, s, p in zip(o, x.shape[2:], out))
        y[(Ellipsis,) + o] = reduce(x[(slice(None), slice(None)) + bins], axis=tuple(range(2, x.ndim)))
    return y


def reference_first_max_gradient(x, kernel, stride, dy):
    """The gradient of an unpadded max pool that sends each dy to the first maximum of its window (row-major)."""
    dx = np.zeros_like(x)
    for idx in itertools.product(*map(range, dy.shape)):
        n, c, *o = idx
        window = tuple(slice(i * s, i * s + k) for i, s, k in zip(o, stride, kernel))
        block = x[(n, c) + window]
        first = np.unravel_index(np.argmax(block), block.shape)   # argmax: the first maximum in C order
        dx[(n, c) + tuple(i * s + f for i, s, f in zip(o, stride, first))] += dy[idx]
    return dx


# ---------------------------------------------------------------------------------------------
# Drawing problems


@st.composite
def pads(draw, n):
    kind = draw(st.sampled_from(["int", "per_axis", "pairs", "same"]))
    small = st.integers(0, 2)
    if kind == "int":
        return draw(small)
    if kind == "per_axis":
        return tuple(draw(small) for _ in range(n))
    if kind == "pairs":
        return tuple(draw(small) for _ in range(2 * n))
    return "same"


@st.composite
def conv_problems(draw, n=None, max_batch=2):
    """(x shape, w shape, options) of a valid conv of ``n`` spatial axes (1 or 3 when None), small."""
    n = draw(ranks) if n is None else n
    groups = draw(st.integers(1, 2))
    cg, kg = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    top = 3 if n == 1 else 2
    kernel = tuple(draw(st.integers(1, top)) for _ in range(n))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(n))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(n))
    dilated = tuple(d * (k - 1) + 1 for d, k in zip(dilation, kernel))
    sizes = tuple(draw(st.integers(d, d + (4 if n == 1 else 2))) for d in dilated)
    opts = dict(stride=stride, pad=draw(pads(n)), dilation=dilation, groups=groups, flipped=draw(st.booleans()))
    return (draw(st.integers(1, max_batch)), cg * groups) + sizes, (kg * groups, cg) + kernel, opts


@st.composite
def pool_problems(draw, n=None):
    n = draw(ranks) if n is None else n
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(n))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(n))
    pad_kind = draw(st.sampled_from(["none", "pairs", "same"]))
    if pad_kind == "pairs":
        pad = tuple(draw(st.integers(0, k - 1)) for k in kernel for _ in range(2))
    elif pad_kind == "same":
        pad = "same"
    else:
        pad = 0
    sizes = tuple(draw(st.integers(k, k + 3)) for k in kernel)
    return (draw(st.integers(1, 2)), draw(st.integers(1, 2))) + sizes, kernel, stride, pad


def randn(rng, shape):
    return rng.standard_normal(shape)


def _same_pool_pad_ok(shape, kernel, stride, pad):
    if pad != "same":
        return True
    pads = resolve_pad_nd(pad, shape[2:], kernel, stride)
    return all(max(p) < k for p, k in zip(pads, kernel))


# ---------------------------------------------------------------------------------------------
# Convolution ops


@given(problem=conv_problems(), seed=seeds)
def test_conv_matches_loop_reference(problem, seed):
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    x, w = randn(rng, xs), randn(rng, ws)
    y = conv(x, w, **opts)
    np.testing.assert_allclose(y, reference_conv(x, w, **opts), rtol=1e-10, atol=1e-10)
    assert y.shape == ConvDims.from_arrays(x, w, **opts).y_shape


@given(problem=conv_problems(), seed=seeds)
def test_conv_gradient(problem, seed):
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    check_grad(lambda x, w: conv(x, w, **opts), randn(rng, xs), randn(rng, ws), rng=rng)


@given(problem=conv_problems(), seed=seeds)
def test_backward_kernels_are_adjoints(problem, seed):
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    x, w = randn(rng, xs), randn(rng, ws)
    cd = ConvDims.from_arrays(x, w, **opts)
    dy = randn(rng, cd.y_shape)
    total = np.sum(conv(x, w, **opts) * dy)
    np.testing.assert_allclose(np.sum(x * conv_backward_data(dy, w, cd)), total, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.sum(w * conv_backward_filter(x, dy, cd)), total, rtol=1e-10, atol=1e-10)


@given(problem=conv_problems(max_batch=1), seed=seeds)
def test_conv_second_derivative(problem, seed):
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    check_second_order(lambda x, w: fluxpy.tanh(conv(x, w, **opts)), randn(rng, xs), randn(rng, ws), rng=rng)


@given(problem=conv_problems(), seed=seeds, act=st.sampled_from(["relu", "identity", "tanh"]))
def test_conv_bias_act_gradient(problem, seed, act):
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    f = {"relu": fluxpy.relu, "identity": None, "tanh": fluxpy.tanh}[act]
    x, w, b = randn(rng, xs), randn(rng, ws), randn(rng, ws[:1])
    y = conv_bias_act(x, w, b, f, **opts)
    z = reference_conv(x, w, **opts) + b.reshape((1, -1) + (1,) * (x.ndim - 2))
    np.testing.assert_allclose(y, {"relu": np.maximum(z, 0), "identity": z, "tanh": np.tanh(z)}[act], rtol=1e-10,
                               atol=1e-10)
    if act != "relu":   # relu's kink: finite differences across it are checked in 2-d with offsets
        check_grad(lambda x, w, b: conv_bias_act(x, w, b, f, **opts), x, w, b, rng=rng)


@given(problem=conv_problems(), seed=seeds, out_pad=st.integers(0, 1))
def test_conv_transpose_is_the_data_gradient(problem, seed, out_pad):
    """conv_transpose(x, w) is conv_backward_data(x, w) of the conv from its output back to x's size; and its
    gradient."""
    zs, ws, opts = problem
    assume(opts["pad"] != "same")
    out_pad = tuple(min(out_pad, s - 1) for s in opts["stride"])
    rng = np.random.default_rng(seed)
    w = randn(rng, ws)   # the forward's (K, C/G, ...) is the transpose's (C_in, C_out/G, ...)
    x = randn(rng, ConvDims.from_shapes(zs, ws, **opts).y_shape)
    try:
        y = conv_transpose(x, w, output_padding=out_pad, **opts)
    except ValueError as err:   # padding larger than what the transpose spreads over
        assert "expects a positive output size" in str(err)
        return
    cd = ConvDims.from_shapes(y.shape, ws, **opts)
    assert cd.y_shape == x.shape
    np.testing.assert_allclose(y, conv_backward_data(x, w, cd), rtol=1e-12, atol=1e-12)
    check_grad(lambda x, w: conv_transpose(x, w, output_padding=out_pad, **opts), x, w, rng=rng)


def test_conv_is_flipped_cross_correlation_in_1d_and_3d():
    rng = np.random.default_rng(0)
    x1, w1 = randn(rng, (2, 3, 9)), randn(rng, (4, 3, 3))
    np.testing.assert_allclose(conv(x1, w1), conv(x1, w1[:, :, ::-1].copy(), flipped=True), rtol=1e-12)
    x3, w3 = randn(rng, (1, 2, 4, 5, 6)), randn(rng, (3, 2, 2, 3, 2))
    np.testing.assert_allclose(conv(x3, w3), conv(x3, w3[:, :, ::-1, ::-1, ::-1].copy(), flipped=True), rtol=1e-12)


def test_conv_1d_is_2d_with_a_unit_axis():
    rng = np.random.default_rng(1)
    x, w = randn(rng, (2, 4, 11)), randn(rng, (6, 2, 3))
    y1 = conv(x, w, stride=2, pad=(1, 2), dilation=2, groups=2)
    y2 = conv(x[:, :, None], w[:, :, None], stride=(1, 2), pad=(0, 0, 1, 2), dilation=(1, 2), groups=2)
    np.testing.assert_allclose(y1, y2[:, :, 0], rtol=1e-12)


def test_float32_and_halves_keep_their_dtype():
    import ml_dtypes
    x, w = np.ones((2, 3, 4, 5, 5), np.float32), np.ones((4, 3, 3, 3, 3), np.float32)
    assert conv(x, w, pad=1).dtype == np.float32
    g = fluxpy.gradient(lambda x, w: conv(x, w, pad=1).sum(), x, w)
    assert g[0].dtype == np.float32 and g[1].dtype == np.float32
    xb, wb = np.ones((1, 2, 6), ml_dtypes.bfloat16), np.ones((3, 2, 3), ml_dtypes.bfloat16)
    yb = conv_bias_act(xb, wb, np.ones(3, ml_dtypes.bfloat16), fluxpy.relu)
    assert yb.dtype == ml_dtypes.bfloat16 and yb.astype(np.float32).ravel().tolist() == [7.0] * 12


@pytest.mark.parametrize("call,match", [
    (lambda: conv(np.ones((1, 2, 5)), np.ones((3, 2, 3, 3))),
     r"conv expects w of 3 dimensions \(K, C/groups, S\), got w of shape \(3, 2, 3, 3\) float64"),
    (lambda: conv(np.ones((1, 2, 5, 5, 5)), np.ones((3, 2, 3, 3))),
     r"conv expects w of 5 dimensions \(K, C/groups, T, R, S\), got w of shape \(3, 2, 3, 3\) float64"),
    (lambda: conv(np.ones((1, 2, 5, 5, 5, 5)), np.ones((3, 2, 3, 3, 3, 3))),
     r"conv expects x of 3, 4 or 5 dimensions \(N, C, \*spatial\) \(1, 2 or 3 spatial axes\), got x of shape "
     r"\(1, 2, 5, 5, 5, 5\)"),
    (lambda: conv(np.ones((1, 2, 5)), np.ones((3, 2, 3)), stride=(1, 1)),
     r"conv expects stride to be a positive int or a 1-tuple of them, got \(1, 1\)"),
    (lambda: conv(np.ones((1, 2, 5, 5, 5)), np.ones((3, 2, 3, 3, 3)), dilation=(1, 2)),
     r"conv expects dilation to be a positive int or a triple of them, got \(1, 2\)"),
    (lambda: conv(np.ones((1, 2, 5, 5, 5)), np.ones((3, 2, 3, 3, 3)), pad=(1, 1, 1, 1)),
     r"conv expects pad to be a non-negative int, a triple \(pd, ph, pw\), a 6-tuple \(front, back, top, bottom, "
     r"left, right\) or \"same\", got \(1, 1, 1, 1\)"),
    (lambda: conv(np.ones((1, 2, 2)), np.ones((3, 2, 3))),
     r"conv expects the padded input \(2,\) to be at least the dilated kernel \(3,\)"),
    (lambda: conv(np.ones((1, 3, 5)), np.ones((4, 2, 3)), groups=2),
     r"conv expects x.shape\[1\] == w.shape\[1\] \* groups == 4, got x of shape \(1, 3, 5\) float64"),
    (lambda: conv_transpose(np.ones((1, 4, 5, 5, 5)), np.ones((4, 2, 3, 3))),
     r"conv_transpose expects w of 5 dimensions \(C_in, C_out/groups, T, R, S\)"),
    (lambda: conv_transpose(np.ones((1, 4, 5)), np.ones((4, 2, 3)), stride=2, output_padding=2),
     r"conv_transpose expects output_padding smaller than stride \(2,\), got \(2,\)"),
])
def test_errors_name_the_op_expected_and_got(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# Pooling ops


@given(problem=pool_problems(), seed=seeds)
def test_pools_match_loop_references(problem, seed):
    shape, kernel, stride, pad = problem
    if not _same_pool_pad_ok(shape, kernel, stride, pad):
        return
    x = randn(np.random.default_rng(seed), shape)
    np.testing.assert_allclose(maxpool(x, kernel, stride, pad), reference_pool(x, kernel, stride, pad, np.max, -np.inf),
                               rtol=1e-12)
    mean = reference_pool(x, kernel, stride, pad, np.sum, 0.0) / np.prod(kernel)
    np.testing.assert_allclose(meanpool(x, kernel, stride, pad), mean, rtol=1e-12, atol=1e-12)


@given(problem=pool_problems(), seed=seeds)
def test_pool_gradients(problem, seed):
    shape, kernel, stride, pad = problem
    if not _same_pool_pad_ok(shape, kernel, stride, pad):
        return
    rng = np.random.default_rng(seed)
    x = rng.permutation(np.prod(shape)).reshape(shape) * 0.1   # distinct values: no ties within eps
    check_grad(lambda x: maxpool(x, kernel, stride, pad), x, rng=rng)
    check_grad(lambda x: meanpool(x, kernel, stride, pad), x, rng=rng)
    check_second_order(lambda x: maxpool(x, kernel, stride, pad) ** 2, x, rng=rng)


@given(problem=pool_problems(), seed=seeds)
def test_public_backward_ops_match_the_gradients(problem, seed):
    shape, kernel, stride, pad = problem
    if not _same_pool_pad_ok(shape, kernel, stride, pad):
        return
    rng = np.random.default_rng(seed)
    x = np.round(randn(rng, shape))    # ties
    d = PoolDims.from_array(x, kernel, stride, pad)
    y = maxpool(x, kernel, stride, pad)
    dy = randn(rng, y.shape)
    np.testing.assert_allclose(maxpool_backward(dy, x, y, d),
                               fluxpy.gradient(lambda x: (maxpool(x, kernel, stride, pad) * dy).sum(), x)[0],
                               rtol=1e-12)
    np.testing.assert_allclose(meanpool_backward(dy, d),
                               fluxpy.gradient(lambda x: (meanpool(x, kernel, stride, pad) * dy).sum(), x)[0],
                               rtol=1e-12, atol=1e-12)
    check_grad(lambda dy: maxpool_backward(dy, x, y, d), dy, rng=rng)
    check_grad(lambda dy: meanpool_backward(dy, d), dy, rng=rng)


@given(seed=seeds, n=ranks, kernel=st.integers(2, 3))
def test_maxpool_gradient_goes_to_the_first_maximum(seed, n, kernel):
    """Ties (small integers): each window's first maximum in row-major order gets its gradient, as a 3-d kernel would
    (the staged 3-d pool takes the first maximum per plane, then the first plane)."""
    rng = np.random.default_rng(seed)
    shape = (1, 2) + (kernel * 2,) * n
    x = rng.integers(0, 3, size=shape).astype(np.float64)
    k = (kernel,) * n
    dy = randn(rng, maxpool(x, k).shape)
    got = fluxpy.gradient(lambda x: (maxpool(x, k) * dy).sum(), x)[0]
    np.testing.assert_array_equal(got, reference_first_max_gradient(x, k, k, dy))


@given(seed=seeds, n=ranks, data=st.data())
def test_adaptive_pools_match_loop_references(seed, n, data):
    sizes = tuple(data.draw(st.integers(1, 6)) for _ in range(n))
    out = tuple(data.draw(st.integers(1, s)) for s in sizes)
    rng = np.random.default_rng(seed)
    x = rng.permutation(2 * int(np.prod(sizes))).reshape((1, 2) + sizes) * 0.1
    np.testing.assert_allclose(adaptive_maxpool(x, out), reference_adaptive(x, out, np.max), rtol=1e-12)
    np.testing.assert_allclose(adaptive_meanpool(x, out), reference_adaptive(x, out, np.mean), rtol=1e-12)
    check_grad(lambda x: adaptive_maxpool(x, out), x, rng=rng)
    check_grad(lambda x: adaptive_meanpool(x, out), x, rng=rng)
    assert AdaptivePoolDims.from_array(x, out).y_shape == (1, 2) + out


@pytest.mark.parametrize("shape", [(2, 3, 7), (1, 2, 3, 4, 5)])
def test_global_pools(shape):
    rng = np.random.default_rng(2)
    x = rng.permutation(int(np.prod(shape))).reshape(shape) * 0.5
    axes = tuple(range(2, len(shape)))
    np.testing.assert_allclose(global_maxpool(x), x.max(axis=axes, keepdims=True))
    np.testing.assert_allclose(global_meanpool(x), x.mean(axis=axes, keepdims=True))
    check_grad(global_maxpool, x, rng=rng)
    check_grad(global_meanpool, x, rng=rng)


def test_half_pools_stay_half():
    import ml_dtypes
    x = np.arange(64, dtype=np.float32).reshape(1, 1, 4, 4, 4).astype(ml_dtypes.bfloat16)
    for f in (maxpool, meanpool):
        y = f(x, (2, 2, 2))
        assert y.dtype == ml_dtypes.bfloat16
        np.testing.assert_allclose(y.astype(np.float32), f(x.astype(np.float32), (2, 2, 2)), rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# Layers: constructors, calls, repr, errors, gradients


@pytest.mark.parametrize("layer,shape,out,text", [
    (Conv((5,), 2, 4, fluxpy.relu, pad=2), (3, 2, 10), (3, 4, 10), "Conv((5,), 2 => 4, relu, pad=2)"),
    (Conv((3, 3, 3), 1, 8, stride=(1, 2, 2)), (2, 1, 5, 9, 9), (2, 8, 3, 4, 4),
     "Conv((3, 3, 3), 1 => 8, stride=(1, 2, 2))"),
    (CrossCor((2,), 2, 2, bias=False, dilation=2), (1, 2, 6), (1, 2, 4), "CrossCor((2,), 2 => 2, dilation=2, bias=False)"),
    (ConvTranspose((3,), 4, 2, stride=2, output_padding=1), (1, 4, 5), (1, 2, 12),
     "ConvTranspose((3,), 4 => 2, stride=2, output_padding=1)"),
    (ConvTranspose((2, 2, 2), 2, 3, groups=1), (1, 2, 2, 3, 4), (1, 3, 3, 4, 5), "ConvTranspose((2, 2, 2), 2 => 3)"),
    (DepthwiseConv((3,), 2, 6, pad=1), (4, 2, 9), (4, 6, 9), "DepthwiseConv((3,), 2 => 6, pad=1)"),
    (DepthwiseConv((3, 3, 3), 3, 3, fluxpy.relu), (1, 3, 4, 4, 4), (1, 3, 2, 2, 2),
     "DepthwiseConv((3, 3, 3), 3 => 3, relu)"),
    (DepthwiseConv((3, 3), 2, 4, stride=2), (1, 2, 7, 7), (1, 4, 3, 3), "DepthwiseConv((3, 3), 2 => 4, stride=2)"),
    (MaxPool((2,)), (1, 3, 9), (1, 3, 4), "MaxPool((2,))"),
    (MeanPool((2, 2, 2), pad=1), (1, 2, 3, 4, 5), (1, 2, 2, 3, 3), "MeanPool((2, 2, 2), pad=1)"),
    (MaxPool((3, 1, 2), stride=1), (1, 1, 4, 4, 4), (1, 1, 2, 4, 3), "MaxPool((3, 1, 2), stride=1)"),
    (GlobalMaxPool(), (2, 3, 5), (2, 3, 1), "GlobalMaxPool()"),
    (GlobalMeanPool(), (2, 3, 2, 3, 4), (2, 3, 1, 1, 1), "GlobalMeanPool()"),
    (AdaptiveMaxPool((3,)), (2, 1, 8), (2, 1, 3), "AdaptiveMaxPool((3,))"),
    (AdaptiveMeanPool((2, 1, 3)), (1, 2, 5, 4, 6), (1, 2, 2, 1, 3), "AdaptiveMeanPool((2, 1, 3))"),
])
def test_layers_of_every_rank(layer, shape, out, text):
    assert repr(layer) == text
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    assert layer(x).shape == out


@pytest.mark.parametrize("layer,x,message", [
    (Conv((3,), 2, 4), np.ones((1, 2, 5, 5), np.float32),
     "Conv((3,), 2 => 4) expects a 3-d input (N, C, L), got (1, 2, 5, 5) float32"),
    (Conv((3, 3, 3), 2, 4), np.ones((1, 2, 5, 5), np.float32),
     "Conv((3, 3, 3), 2 => 4) expects a 5-d input (N, C, D, H, W), got (1, 2, 5, 5) float32"),
    (Conv((3,), 2, 4), np.ones((1, 3, 5), np.float32), "Conv((3,), 2 => 4) expects x.shape[1] == 2, got (1, 3, 5) float32"),
    (Conv((3,), 2, 4), np.ones((1, 2, 2), np.float32),
     "Conv((3,), 2 => 4) expects the padded input (2,) to be at least the dilated kernel (3,)"),
    (DepthwiseConv((3, 3, 3), 2, 4), np.ones((1, 4, 5, 5, 5), np.float32),
     "DepthwiseConv((3, 3, 3), 2 => 4) expects x.shape[1] == 2, got (1, 4, 5, 5, 5) float32"),
    (ConvTranspose((2,), 3, 1), np.ones((1, 3, 4, 4), np.float32),
     "ConvTranspose((2,), 3 => 1) expects a 3-d input (N, C, L), got (1, 3, 4, 4) float32"),
    (MaxPool((2, 2, 2)), np.ones((1, 2, 4, 4), np.float32),
     "MaxPool((2, 2, 2)) expects a 5-d input (N, C, D, H, W), got (1, 2, 4, 4) float32"),
    (MeanPool((3,)), np.ones((1, 2, 2), np.float32),
     "MeanPool((3,)) expects the padded input (2,) to be at least the kernel (3,)"),
    (AdaptiveMaxPool((2,)), np.ones((1, 2, 4, 4), np.float32),
     "AdaptiveMaxPool((2,)) expects a 3-d input (N, C, L), got (1, 2, 4, 4) float32"),
    (GlobalMaxPool(), np.ones((2, 3), np.float32),
     "GlobalMaxPool() expects an input of 1, 2 or 3 spatial axes (N, C, L), (N, C, H, W) or (N, C, D, H, W), got "
     "(2, 3) float32"),
])
def test_layer_errors_name_the_layer(layer, x, message):
    with pytest.raises(DimensionMismatch) as err:
        layer(x)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("make,message", [
    (lambda: DepthwiseConv((3,), 4, 6), "DepthwiseConv: cout == 6 must be a multiple of cin == 4"),
    (lambda: Conv((3, 3, 3, 3), 1, 1), "Conv: kernel must be a positive int or a tuple of 1, 2 or 3 positive ints"),
    (lambda: ConvTranspose((2,), 1, 1, stride=2, output_padding=(1, 1)),
     "ConvTranspose: output_padding must be a non-negative int or a 1-tuple of them, got (1, 1)"),
    (lambda: MaxPool((2, 2, 2), pad=(-1, 0, 0)), "MaxPool: pad must be a non-negative int, a triple (pd, ph, pw)"),
    (lambda: MaxPool((2,), stride=(1, 1)), "MaxPool: stride must be a positive int or a 1-tuple of them, got (1, 1)"),
    (lambda: AdaptiveMeanPool(()), "AdaptiveMeanPool: out_hw must be a positive int or a tuple of 1, 2 or 3"),
])
def test_constructor_errors_name_the_layer(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value).startswith(message)


def test_depthwise_conv_is_a_grouped_conv():
    d = fluxpy.f64(DepthwiseConv((3, 3, 3), 2, 4, rng=0))
    x = np.random.default_rng(4).standard_normal((2, 2, 4, 5, 6))
    expected = conv(x, d.weight, groups=2) + d.bias.reshape(1, -1, 1, 1, 1)
    np.testing.assert_allclose(d(x), expected, rtol=1e-12)
    assert d.weight.shape == (4, 1, 3, 3, 3) and d.groups == 2


def test_crosscor_is_conv_with_the_kernel_reversed():
    c = fluxpy.f64(Conv((3,), 2, 3, rng=0))
    x = CrossCor((3,), 2, 3, init=lambda *s, rng=None: c.weight[:, :, ::-1].copy())
    x = fluxpy.f64(x)
    data = np.random.default_rng(5).standard_normal((2, 2, 8))
    np.testing.assert_allclose(x(data), c(data), rtol=1e-12)


@pytest.mark.parametrize("make,shape", [
    (lambda: Conv((3,), 2, 3, fluxpy.tanh, pad=1, rng=0), (2, 2, 6)),
    (lambda: Conv((2, 2, 2), 2, 2, fluxpy.tanh, stride=(1, 2, 1), rng=1), (1, 2, 3, 4, 3)),
    (lambda: ConvTranspose((2,), 2, 2, fluxpy.tanh, stride=2, rng=2), (1, 2, 4)),
    (lambda: DepthwiseConv((2, 2, 2), 2, 4, fluxpy.tanh, rng=3), (1, 2, 3, 3, 3)),
])
def test_layer_gradients_float64(make, shape):
    layer = fluxpy.f64(make())
    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape)
    cot = rng.standard_normal(layer(x).shape)
    g_model, g_x = fluxpy.gradient(lambda m, x: (m(x) * cot).sum(), layer, x)
    check_grad(lambda x: layer(x), x, rng=rng)
    check_grad(lambda w, b: type(layer).__call__(_with(layer, w, b), x), layer.weight, layer.bias, rng=rng)
    assert g_model["weight"].shape == layer.weight.shape and g_x.shape == x.shape


@st.composite
def layer_problems(draw):
    """A conv layer of 1, 2 or 3 spatial axes with drawn options, in float64, and an input shape it takes."""
    n = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["Conv", "CrossCor", "ConvTranspose", "DepthwiseConv"]))
    kernel = tuple(draw(st.integers(1, 2 if n == 3 else 3)) for _ in range(n))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(n))
    pad = draw(st.sampled_from([0, 1, "pairs"]))
    if pad == "pairs":
        pad = tuple(draw(st.integers(0, k - 1)) for k in kernel for _ in range(2))
    cin = draw(st.integers(1, 2))
    act = draw(st.sampled_from([fluxpy.tanh, fluxpy.identity]))
    if kind == "DepthwiseConv":
        layer = DepthwiseConv(kernel, cin, cin * draw(st.integers(1, 2)), act, stride=stride, pad=pad, rng=0)
    elif kind == "ConvTranspose":
        layer = ConvTranspose(kernel, cin, draw(st.integers(1, 2)), act, stride=stride, pad=pad, rng=0)
    else:
        cls = Conv if kind == "Conv" else CrossCor
        layer = cls(kernel, cin, draw(st.integers(1, 2)), act, stride=stride, pad=pad,
                    dilation=tuple(draw(st.integers(1, 2)) for _ in range(n)), rng=0)
    sizes = tuple(draw(st.integers(3, 5 if n < 3 else 4)) for _ in range(n))
    return fluxpy.f64(layer), (draw(st.integers(1, 2)), cin) + sizes


@given(problem=layer_problems(), seed=seeds)
def test_layer_gradients_under_hypothesis(problem, seed):
    """Every conv layer of every rank: gradients in x, weight and bias against float64 finite differences."""
    layer, shape = problem
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    try:
        layer(x)
    except DimensionMismatch:   # an input too small for the drawn kernel and padding: the layer says so
        return
    check_grad(lambda x, w, b: type(layer).__call__(_with(layer, w, b), x), x, layer.weight, layer.bias, rng=rng)


def _with(layer, w, b):
    """A shallow copy of ``layer`` holding ``w`` and ``b``."""
    import copy
    new = copy.copy(layer)
    new.weight, new.bias = w, b
    return new


# ---------------------------------------------------------------------------------------------
# Against PyTorch (float64; skipped where torch is not installed)


def _torch_conv(torch, x, w, opts):
    n = x.ndim - 2
    cd = ConvDims.from_arrays(x, w, **opts)
    pad = []
    for i in reversed(range(n)):
        pad += [cd.pad[2 * i], cd.pad[2 * i + 1]]
    tx = torch.nn.functional.pad(torch.tensor(x), pad)
    tw = w if opts["flipped"] else w[(slice(None), slice(None)) + (slice(None, None, -1),) * n].copy()
    f = {1: torch.nn.functional.conv1d, 3: torch.nn.functional.conv3d}[n]
    return f(tx, torch.tensor(tw), stride=cd.stride, dilation=cd.dilation, groups=cd.groups).numpy()


@given(problem=conv_problems(), seed=seeds)
def test_conv_against_torch(problem, seed):
    torch = pytest.importorskip("torch")
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    x, w = randn(rng, xs), randn(rng, ws)
    np.testing.assert_allclose(conv(x, w, **opts), _torch_conv(torch, x, w, opts), rtol=1e-10, atol=1e-10)


@given(problem=pool_problems(), seed=seeds)
def test_pools_against_torch(problem, seed):
    torch = pytest.importorskip("torch")
    shape, kernel, stride, pad = problem
    if not isinstance(pad, int) or pad != 0:
        return   # torch pads symmetrically only; the loop references cover padding
    n = len(shape) - 2
    x = np.round(randn(np.random.default_rng(seed), shape))   # ties: where their gradient goes must match too
    tx = torch.tensor(x, requires_grad=True)
    tmax = {1: torch.nn.functional.max_pool1d, 3: torch.nn.functional.max_pool3d}[n](tx, kernel, stride)
    tmean = {1: torch.nn.functional.avg_pool1d, 3: torch.nn.functional.avg_pool3d}[n](torch.tensor(x), kernel, stride)
    np.testing.assert_allclose(maxpool(x, kernel, stride), tmax.detach().numpy())
    np.testing.assert_allclose(meanpool(x, kernel, stride), tmean.numpy(), rtol=1e-12, atol=1e-12)
    dy = randn(np.random.default_rng(seed + 1), tuple(tmax.shape))
    tmax.backward(torch.tensor(dy))
    got = fluxpy.gradient(lambda x: (maxpool(x, kernel, stride) * dy).sum(), x)[0]
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-12)
