"""The initialisers of issue 41 (rand32, truncated_normal, lecun_normal, orthogonal, identity_init, sparse_init,
calculate_gain): shapes and dtypes, seeded statistics against their formulas with tolerances set by the sample
size, Flux's and PyTorch's definitions, and the errors that name the initialiser."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.layers.init import (calculate_gain, identity_init, lecun_normal, nfan, orthogonal, rand32, sparse_init,
                                truncated_normal)

RANDOM = [rand32, truncated_normal, lecun_normal, orthogonal]


def _close(sample_stat, want, sd, n, k=6.0):
    """``sample_stat`` within ``k`` standard errors (``sd / sqrt(n)``) of ``want``."""
    assert abs(sample_stat - want) <= k * sd / math.sqrt(n), (sample_stat, want, sd, n)


@pytest.mark.parametrize("init", RANDOM)
def test_shapes_dtypes_seeds_and_the_global_generator(init):
    a = init(6, 5, 3, rng=7)
    assert a.shape == (6, 5, 3) and a.dtype == np.float32
    np.testing.assert_array_equal(a, init((6, 5, 3), rng=7))
    np.testing.assert_array_equal(a, init([6, 5, 3], rng=np.random.default_rng(7)))
    fluxpy.seed(3)
    b = init(4, 5)
    fluxpy.seed(3)
    np.testing.assert_array_equal(b, init(4, 5))


@pytest.mark.parametrize("init", RANDOM + [identity_init])
def test_bad_dimensions_are_named(init):
    with pytest.raises(ValueError, match=f"{init.__name__} expects dimensions that are ints >= 0"):
        init(3, -1)
    with pytest.raises(ValueError, match=init.__name__):
        init(2.5, 3)


def test_rand32_is_uniform_on_0_1():
    n = 200_000
    a = rand32(n, rng=1).astype(np.float64)
    assert a.min() >= 0 and a.max() < 1
    _close(a.mean(), 0.5, math.sqrt(1 / 12), n)
    _close(a.var(), 1 / 12, math.sqrt(1 / 80 - 1 / 144), n)   # var of (u - 1/2)^2 is 1/80 - 1/144


def _truncated_moments(mean, std, lo, hi):
    """The mean and standard deviation of the normal (mean, std) truncated to [lo, hi] (textbook formulas)."""
    a, b = (lo - mean) / std, (hi - mean) / std
    pdf = lambda z: math.exp(-z * z / 2) / math.sqrt(2 * math.pi)   # noqa: E731
    cdf = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))   # noqa: E731
    z = cdf(b) - cdf(a)
    m = (pdf(a) - pdf(b)) / z
    var = 1 + (a * pdf(a) - b * pdf(b)) / z - m * m
    return mean + std * m, std * math.sqrt(var)


@settings(max_examples=15, deadline=None)
@given(st.floats(-2, 2), st.floats(0.2, 3), st.floats(-3, 0.5), st.floats(0.2, 3), st.integers(0, 2 ** 16))
def test_truncated_normal_has_its_bounds_and_moments(mean, std, lo, width, seed):
    hi = lo + width
    a_, b_ = (lo - mean) / std, (hi - mean) / std
    if 0.5 * (math.erf(b_ / math.sqrt(2)) - math.erf(a_ / math.sqrt(2))) < 1e-3:
        return   # bounds far in a tail: the rejection sampler refuses them (tested below)
    n = 40_000
    x = truncated_normal(n, rng=seed, mean=mean, std=std, lo=lo, hi=hi).astype(np.float64)
    assert x.min() >= np.float32(lo) and x.max() <= np.float32(hi)
    want_mean, want_std = _truncated_moments(mean, std, lo, hi)
    _close(x.mean(), want_mean, want_std, n)
    _close(x.std(), want_std, want_std * math.sqrt(2), n, k=8)


def test_truncated_normal_defaults_and_errors():
    x = truncated_normal(100_000, rng=0).astype(np.float64)
    assert x.min() >= -2 and x.max() <= 2
    want_mean, want_std = _truncated_moments(0, 1, -2, 2)
    _close(x.std(), want_std, want_std * math.sqrt(2), x.size)
    with pytest.raises(ValueError, match="truncated_normal: .* holds"):
        truncated_normal(3, mean=10.0, lo=-1.0, hi=1.0)
    with pytest.raises(ValueError, match="truncated_normal expects std > 0 and lo < hi"):
        truncated_normal(3, std=0.0)
    with pytest.raises(ValueError, match="truncated_normal expects std > 0 and lo < hi"):
        truncated_normal(3, lo=1.0, hi=1.0)


@pytest.mark.parametrize("shape, gain", [((300, 64), 1.0), ((40, 16, 3, 3), 2.0)])
def test_lecun_normal_has_std_gain_over_sqrt_fan_in(shape, gain):
    x = lecun_normal(shape, rng=4, gain=gain).astype(np.float64)
    std = gain / math.sqrt(nfan(shape)[0])
    assert np.abs(x).max() <= 2   # Flux's truncation at +-2, far out for these fans
    _close(x.mean(), 0.0, std, x.size)
    _close(x.std(), std, std * math.sqrt(2), x.size)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 7), st.lists(st.integers(1, 4), min_size=1, max_size=3), st.floats(0.1, 3),
       st.integers(0, 2 ** 16))
def test_orthogonal_rows_or_columns_are_orthonormal_times_gain(rows, rest, gain, seed):
    w = orthogonal(rows, *rest, rng=seed, gain=gain).astype(np.float64)
    assert w.shape == (rows, *rest)
    m = w.reshape(rows, -1)
    small = m @ m.T if rows <= m.shape[1] else m.T @ m
    np.testing.assert_allclose(small, gain ** 2 * np.eye(len(small)), atol=1e-5 * max(gain ** 2, 1))
    # PyTorch's orthogonal_ transcribed: Q of a normal matrix, signs of R's diagonal, transposed for wide shapes
    a = np.random.default_rng(seed).standard_normal((max(m.shape), min(m.shape)))
    q, r = np.linalg.qr(a)
    q = q * np.sign(np.diag(r))
    np.testing.assert_allclose(m, gain * (q.T if rows < m.shape[1] else q), rtol=1e-5, atol=1e-6 * gain)


def test_orthogonal_needs_two_dimensions():
    with pytest.raises(ValueError, match="orthogonal expects at least 2 dimensions, got \\(3,\\)"):
        orthogonal(3)
    assert orthogonal(0, 3).shape == (0, 3)


def test_orthogonal_is_uniform_over_orthogonal_matrices():
    # Haar: E[w] = 0 entrywise and each entry of a d x d orthogonal matrix has variance 1/d
    d, n = 4, 4000
    ws = np.stack([orthogonal(d, d, rng=s) for s in range(n)]).astype(np.float64)
    _close(ws.mean(axis=0).max(), 0.0, math.sqrt(1 / d), n, k=7)
    _close(ws.mean(axis=0).min(), 0.0, math.sqrt(1 / d), n, k=7)
    np.testing.assert_allclose(ws.var(axis=0), 1 / d, atol=8 * math.sqrt(2) / d / math.sqrt(n))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 5), st.integers(1, 5), st.sampled_from([(), (3,), (3, 3), (1, 5), (3, 3, 3)]),
       st.floats(-2, 2))
def test_identity_init_makes_a_layer_the_identity(out, inp, kernel, gain):
    w = identity_init(out, inp, *kernel, gain=gain)
    assert w.shape == (out, inp, *kernel) and w.dtype == np.float32
    rng = np.random.default_rng(out * 10 + inp)
    n = min(out, inp)
    if not kernel:
        x = rng.standard_normal((2, inp)).astype(np.float32)
        y = x @ w.T
    else:
        x = rng.standard_normal((2, inp) + (6,) * len(kernel)).astype(np.float32)
        y = np.asarray(fluxpy.ops.conv(x, w, pad=tuple((k - 1) // 2 for k in kernel)))
    np.testing.assert_allclose(y[:, :n], gain * x[:, :n], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(y[:, n:], 0)


def test_identity_init_vectors_shift_and_even_kernels():
    np.testing.assert_array_equal(identity_init(4, gain=3.0), np.zeros(4, np.float32))
    np.testing.assert_array_equal(identity_init(3, 3, shift=1), np.roll(np.eye(3, dtype=np.float32), 1, axis=0))
    w = identity_init(2, 2, 4, 2)   # Flux's centre of an even axis of size d: cld(d, 2), 1-based
    assert w[0, 0, 1, 0] == 1 and w[1, 1, 1, 0] == 1 and w.sum() == 2
    with pytest.raises(ValueError, match="identity_init expects shift"):
        identity_init(2, 2, shift=(1, 1, 1))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.floats(0, 1), st.integers(0, 2 ** 16))
def test_sparse_init_zeros_per_column(rows, cols, sparsity, seed):
    w = sparse_init(rows, cols, sparsity=sparsity, rng=seed)
    assert w.shape == (rows, cols) and w.dtype == np.float32
    np.testing.assert_array_equal((w == 0).sum(axis=0), [math.ceil(sparsity * rows)] * cols)


def test_sparse_init_std_and_errors():
    w = sparse_init(400, 300, sparsity=0.5, std=0.2, rng=0).astype(np.float64)
    kept = w[w != 0]
    _close(kept.std(), 0.2, 0.2 * math.sqrt(2), kept.size)
    assert len(set(map(tuple, (w == 0).T.tolist()))) > 1   # the zeros are at different rows in different columns
    with pytest.raises(ValueError, match="sparse_init expects 2 dimensions"):
        sparse_init(2, 3, 4, sparsity=0.1)
    with pytest.raises(ValueError, match="sparse_init expects 0 <= sparsity <= 1"):
        sparse_init(2, 3, sparsity=1.5)


def test_calculate_gain_is_pytorchs_table():
    want = {"linear": 1, "conv1d": 1, "conv2d": 1, "conv3d": 1, "conv_transpose1d": 1, "conv_transpose2d": 1,
            "conv_transpose3d": 1, "sigmoid": 1, "tanh": 5 / 3, "relu": math.sqrt(2), "selu": 3 / 4}
    for name, gain in want.items():
        assert calculate_gain(name) == pytest.approx(gain, rel=1e-15)
    slope = np.random.default_rng(0).uniform(0, 1)
    assert calculate_gain("leaky_relu", slope) == pytest.approx(math.sqrt(2 / (1 + slope ** 2)), rel=1e-15)
    assert calculate_gain("leaky_relu") == pytest.approx(math.sqrt(2 / (1 + 0.01 ** 2)), rel=1e-15)
    with pytest.raises(ValueError, match="calculate_gain: unsupported nonlinearity 'swish'"):
        calculate_gain("swish")
    with pytest.raises(ValueError, match="calculate_gain: the negative slope"):
        calculate_gain("leaky_relu", "0.1")


def test_the_names_are_exported():
    for name in ("rand32", "truncated_normal", "lecun_normal", "orthogonal", "identity_init", "sparse_init",
                 "calculate_gain"):
        assert getattr(fluxpy, name) is getattr(fluxpy.layers, name) and name in fluxpy.__all__
