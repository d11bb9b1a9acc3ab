"""cosine_similarity, pairwise_distance, channel_shuffle and threshold: values against PyTorch's documented formulas
written in float64 NumPy (and against PyTorch itself where it is installed), gradients against finite differences,
hypothesis over shapes and options, and errors that name the op."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import channel_shuffle, cosine_similarity, pairwise_distance, threshold
from gradcheck import check_grad

seeds = st.integers(0, 2**31 - 1)


def _cosine(a, b, axis, eps):
    na = np.maximum(np.linalg.norm(a, axis=axis, keepdims=True), eps)
    nb = np.maximum(np.linalg.norm(b, axis=axis, keepdims=True), eps)
    return ((a / na) * (b / nb)).sum(axis=axis)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 4), d=st.integers(1, 5), axis=st.sampled_from([-1, 0]), broadcast=st.booleans(),
       tiny=st.booleans(), seed=seeds)
def test_cosine_similarity_is_pytorch_s_formula_and_differentiates(n, d, axis, broadcast, tiny, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, d))
    b = rng.standard_normal((1, d) if broadcast else (n, d))
    if tiny:   # a row below eps: PyTorch clamps its norm, and so the gradient stays finite
        a[0] *= 1e-10
    got = cosine_similarity(a, b, axis=axis, eps=1e-8)
    np.testing.assert_allclose(got, _cosine(a, b, axis, 1e-8), rtol=1e-12, atol=1e-14)
    if tiny:   # finite differences cannot step below 1e-10; the clamped gradient is finite
        g = fluxpy.gradient(lambda a: cosine_similarity(a, b, axis=axis, eps=1e-8).sum(), a)[0]
        assert np.all(np.isfinite(g))
    else:
        check_grad(lambda a, b: cosine_similarity(a, b, axis=axis, eps=1e-8), a, b, rng=rng)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 4), d=st.integers(1, 5), p=st.sampled_from([1.0, 2.0, 3.0]), keepdims=st.booleans(),
       seed=seeds)
def test_pairwise_distance_is_the_p_norm_of_the_difference_plus_eps(n, d, p, keepdims, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    got = pairwise_distance(a, b, p=p, eps=1e-6, keepdims=keepdims)
    expected = (np.abs(a - b + 1e-6) ** p).sum(axis=-1, keepdims=keepdims) ** (1 / p)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    check_grad(lambda a, b: pairwise_distance(a, b, p=p), a, b, rng=rng)
    same = pairwise_distance(a, a)   # eps keeps the norm, and its gradient, away from 0
    assert np.all(same > 0) and np.all(np.isfinite(fluxpy.gradient(lambda z: pairwise_distance(z, a).sum(), a)[0]))


@given(n=st.integers(1, 2), groups=st.integers(1, 4), per=st.integers(1, 3), spatial=st.integers(0, 2), seed=seeds)
def test_channel_shuffle_interleaves_the_groups_and_its_gradient_shuffles_back(n, groups, per, spatial, seed):
    rng = np.random.default_rng(seed)
    c = groups * per
    x = rng.standard_normal((n, c) + (3,) * spatial)
    y = channel_shuffle(x, groups)
    expected = x.reshape((n, groups, per) + x.shape[2:]).swapaxes(1, 2).reshape(x.shape)
    np.testing.assert_array_equal(y, expected)
    order = [g * per + i for i in range(per) for g in range(groups)]   # output channel k is input channel order[k]
    np.testing.assert_array_equal(y, x[:, order])
    check_grad(lambda x: channel_shuffle(x, groups), x, rng=rng)


def test_threshold_keeps_what_lies_above_and_nan():
    x = np.array([-2.0, 0.5, 0.5000001, 3.0, np.nan])
    np.testing.assert_array_equal(threshold(x, 0.5, -1.0), [-1.0, -1.0, 0.5000001, 3.0, np.nan])
    g, = fluxpy.gradient(lambda z: threshold(z, 0.5, -1.0).sum(), x[:4])
    np.testing.assert_array_equal(g, [0.0, 0.0, 1.0, 1.0])


def test_errors_name_the_op():
    with pytest.raises(ValueError, match=r"^cosine_similarity: shapes \(2, 3\) and \(4, 3\) cannot be broadcast"):
        cosine_similarity(np.ones((2, 3)), np.ones((4, 3)))
    with pytest.raises(ValueError, match=r"^cosine_similarity: axis 2 is out of range for the broadcast shape"):
        cosine_similarity(np.ones((2, 3)), np.ones((2, 3)), axis=2)
    with pytest.raises(TypeError, match=r"^pairwise_distance expects two arrays, got a list and a ndarray"):
        pairwise_distance([1.0], np.ones(1))
    with pytest.raises(ValueError, match=r"^channel_shuffle expects x of shape \(N, C, \.\.\.\) with C divisible by "
                                         r"groups=4, got shape \(1, 6, 2\)"):
        channel_shuffle(np.ones((1, 6, 2)), 4)
    with pytest.raises(ValueError, match=r"^channel_shuffle expects groups to be an int >= 1, got 0"):
        channel_shuffle(np.ones((1, 6, 2)), 0)


def test_against_pytorch_itself():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    a[1] *= 1e-9
    t = torch.from_numpy
    for eps in (1e-8, 1e-3):
        np.testing.assert_allclose(cosine_similarity(a, b, eps=eps), F.cosine_similarity(t(a), t(b), dim=-1, eps=eps),
                                   rtol=1e-12, atol=1e-15)
    for p in (1.0, 2.0, 3.5):
        np.testing.assert_allclose(pairwise_distance(a, b, p=p), F.pairwise_distance(t(a), t(b), p=p), rtol=1e-12)
    x = rng.standard_normal((2, 6, 3, 3))
    np.testing.assert_array_equal(channel_shuffle(x, 3), torch.nn.ChannelShuffle(3)(t(x)).numpy())
    np.testing.assert_array_equal(threshold(a, 0.1, 20.0), F.threshold(t(a), 0.1, 20.0).numpy())


def _unfold_reference(x, kernel, stride, pad, dilation):
    """PyTorch's im2col written out: column ``l`` (output position, row-major) holds, in row ``c*k + j``, channel
    ``c`` at kernel offset ``j`` (row-major) of patch ``l``."""
    n, c, h, w = x.shape
    kh, kw = kernel
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    p = (h + 2 * pad[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    q = (w + 2 * pad[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, c * kh * kw, p * q))
    for ci in range(c):
        for i in range(kh):
            for j in range(kw):
                for pi in range(p):
                    for qi in range(q):
                        out[:, ci * kh * kw + i * kw + j, pi * q + qi] = \
                            xp[:, ci, pi * stride[0] + i * dilation[0], qi * stride[1] + j * dilation[1]]
    return out


@settings(max_examples=30, deadline=None)
@given(c=st.integers(1, 3), h=st.integers(3, 7), w=st.integers(3, 7), kh=st.integers(1, 3), kw=st.integers(1, 3),
       s=st.integers(1, 2), pad=st.integers(0, 1), d=st.integers(1, 2), seed=seeds)
def test_unfold_takes_pytorch_s_patches_and_fold_is_its_adjoint(c, h, w, kh, kw, s, pad, d, seed):
    from fluxpy import fold, unfold
    if (h + 2 * pad - d * (kh - 1) - 1) < 0 or (w + 2 * pad - d * (kw - 1) - 1) < 0:
        return   # no whole patch fits
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, c, h, w))
    cols = unfold(x, (kh, kw), stride=s, pad=pad, dilation=d)
    np.testing.assert_array_equal(cols, _unfold_reference(x, (kh, kw), (s, s), (pad, pad), (d, d)))
    z = rng.standard_normal(cols.shape)   # <unfold(x), z> == <x, fold(z)>: fold is unfold's adjoint
    back = fold(z, (h, w), (kh, kw), stride=s, pad=pad, dilation=d)
    assert back.shape == x.shape
    np.testing.assert_allclose((cols * z).sum(), (x * back).sum(), rtol=1e-12)
    check_grad(lambda x: unfold(x, (kh, kw), stride=s, pad=pad, dilation=d), x, rng=rng)
    check_grad(lambda z: fold(z, (h, w), (kh, kw), stride=s, pad=pad, dilation=d), z, rng=rng)


def test_unfold_and_fold_errors_name_the_op_and_the_shapes():
    from fluxpy import fold, unfold
    with pytest.raises(ValueError, match=r"^unfold expects x of shape \(N, C, \*spatial\)"):
        unfold(np.ones(4), 2)
    with pytest.raises(ValueError, match=r"^unfold expects kernel to be an int or 2 ints"):
        unfold(np.ones((1, 1, 4, 4)), (2, 2, 2))
    with pytest.raises(ValueError, match=r"^fold expects cols of shape \(N, C\*4, 9\) for output_size \(4, 4\)"):
        fold(np.ones((1, 4, 8)), (4, 4), 2)


def test_unfold_and_fold_match_pytorch_itself():
    torch = pytest.importorskip("torch")
    from fluxpy import fold, unfold
    F = torch.nn.functional
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 8, 7))
    for kernel, stride, pad, dil in (((2, 3), 1, 0, 1), (3, 2, 1, 1), ((2, 2), (2, 1), (1, 0), (1, 2))):
        cols = F.unfold(torch.from_numpy(x), kernel, dilation=dil, padding=pad, stride=stride).numpy()
        np.testing.assert_array_equal(unfold(x, kernel, stride=stride, pad=pad, dilation=dil), cols)
        np.testing.assert_array_equal(
            fold(cols, (8, 7), kernel, stride=stride, pad=pad, dilation=dil),
            F.fold(torch.from_numpy(cols), (8, 7), kernel, dilation=dil, padding=pad, stride=stride).numpy())
