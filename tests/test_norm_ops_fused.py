"""The ops behind this wave's GPU norm and resampling kernels, on the CPU: ``rmsnorm`` (values, gradients against
float64 finite differences, bad input) and ``groupnorm``/``instancenorm`` with a fused activation and nearest
upsampling by whole scales (gradients against finite differences); hypothesis draws shapes and options. The GPU
kernels are checked against these composites in tests/gpu (test_groupnorm_gpu, test_rmsnorm_gpu,
test_upsample_nearest_gpu)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluxpy.ops import groupnorm, rmsnorm, upsample_nearest
from fluxpy.ops.activations import gelu, relu, swish, tanh
from gradcheck import check_grad


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.integers(1, 2), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_rmsnorm_values_and_gradients(lead, k, affine, seed):
    rng = np.random.default_rng(seed)
    tail = tuple(int(n) + 1 for n in rng.integers(1, 5, k))
    x = rng.standard_normal(tuple(lead) + tail)
    gamma = rng.standard_normal(tail) + 1 if affine else None
    axes = tuple(range(-k, 0))
    want = x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + 1e-5) * (1 if gamma is None else gamma)
    np.testing.assert_allclose(rmsnorm(x, gamma, k, 1e-5), want, rtol=1e-12)
    args = (x, gamma) if affine else (x,)
    check_grad(lambda x, g=None: rmsnorm(x, g, k, 1e-5), *args, rng=rng, rtol=1e-5)


def test_rmsnorm_refuses_bad_input_naming_itself():
    x = np.ones((2, 3))
    with pytest.raises(ValueError, match=r"rmsnorm expects k.*1\.\.2.*got 3"):
        rmsnorm(x, None, 3)
    with pytest.raises(ValueError, match=r"rmsnorm expects gamma of shape \(3,\).*got \(2,\)"):
        rmsnorm(x, np.ones(2))
    with pytest.raises(ValueError, match="rmsnorm"):
        rmsnorm(x, None, 1, -1.0)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([(2, 4, 3, 2, 2), (1, 6, 5, 3), (3, 4, 2, 4), (2, 6, 7, 6)]),
       st.sampled_from([relu, swish, gelu, tanh]), st.booleans(), st.integers(0, 2**31 - 1))
def test_groupnorm_with_an_activation(case, act, affine, seed):
    rng = np.random.default_rng(seed)
    n, c, h, groups = case[:4]
    x = rng.standard_normal((n, c, h, 3)) * 2
    g, b = rng.standard_normal(c) + 1, rng.standard_normal(c)
    plain = groupnorm(x, groups, g if affine else None, b if affine else None)
    np.testing.assert_allclose(groupnorm(x, groups, g if affine else None, b if affine else None, act=act),
                               np.asarray(act(plain)), rtol=1e-12, atol=1e-12)
    args = (x, g, b) if affine else (x,)
    check_grad(lambda x, g=None, b=None: groupnorm(x, groups, g, b, act=act), *args, rng=rng, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from([((2, 3, 4), (2,)), ((1, 2, 3, 2), (2, 3)), ((1, 1, 2, 2, 3), (1, 2, 2))]),
       st.integers(0, 2**31 - 1))
def test_nearest_upsampling_by_whole_scales(case, seed):
    shape, scales = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    y = upsample_nearest(x, scales)
    want = x
    for axis, s in enumerate(scales, start=2):
        want = np.repeat(want, s, axis=axis)
    np.testing.assert_array_equal(y, want)
    check_grad(lambda x: upsample_nearest(x, scales), x, rng=rng)
