"""Batch norm and relu on the CPU through oneDNN's elementwise passes (fluxpy.kernels.cpu_norm's ``batchnorm_forward``
and ``batchnorm_backward``, fluxpy.kernels.onednn's ``relu``, ``scale_shift``, ``batchnorm_dx``): equal to the NumPy
kernels over shapes (one, two and three spatial axes; ``(N, C)`` stays with NumPy), eps, affine or not, activations,
training and inference through the layer (the running statistics included); the statistics as close to float64 as
the NumPy path's; gradients through the public BatchNorm layer equal float64 finite differences; NaN stays NaN; only
large float32 C-order arrays go there, and nothing without oneDNN; a failing call names oneDNN's status. Skipped where
oneDNN is not installed (``pip install fluxpy[cpu]``)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.kernels import cpu_norm, find, onednn
from fluxpy.layers import BatchNorm, testmode, trainmode
from fluxpy.ops.activations import DERIVATIVES_FROM_OUTPUT, relu, relu6, tanh
from fluxpy.ops.batchnorm import _forward_arrays, batchnorm

pytestmark = pytest.mark.skipif(onednn.library() is None, reason="oneDNN is not installed (pip install fluxpy[cpu])")

ACTS = {"none": None, "relu": relu, "tanh": tanh, "relu6": relu6}


def _numpy_only(mp):
    mp.setattr(onednn, "takes_eltwise", lambda *arrays: False)


def _problem(seed, shape, affine, offset=3.0):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + offset).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, c).astype(np.float32) if affine else None
    beta = rng.standard_normal(c).astype(np.float32) if affine else None
    dy = rng.standard_normal(shape).astype(np.float32)
    return x, gamma, beta, dy


shapes = st.tuples(st.integers(2, 6), st.integers(1, 5), st.lists(st.integers(1, 7), min_size=1, max_size=3)).map(
    lambda t: (t[0], t[1], *t[2]))


@settings(deadline=None, max_examples=60)
@given(shapes, st.sampled_from([0.0, 1e-5, 0.1]), st.booleans(), st.sampled_from(sorted(ACTS)), st.integers(0, 99))
def test_training_forward_and_backward_equal_the_numpy_kernels(shape, eps, affine, act_name, seed):
    act = ACTS[act_name]
    x, gamma, beta, dy = _problem(seed, shape, affine)
    c = shape[1]
    derivative = None if act is None else DERIVATIVES_FROM_OUTPUT[act].formula
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onednn, "ELTWISE_MIN_SIZE", 1)   # hypothesis's small shapes to oneDNN too
        assert find("batchnorm_forward", x, gamma, beta, None, None, 0.1, eps, act) is cpu_norm.batchnorm_forward
        stats = np.zeros(c, np.float32), np.ones(c, np.float32)
        y, mean, invstd = cpu_norm.batchnorm_forward(x, gamma, beta, *stats, 0.1, eps, act)
        grads = cpu_norm.batchnorm_backward(dy, x, y, gamma, beta, mean, invstd, eps, act, derivative)
    with pytest.MonkeyPatch.context() as mp:
        _numpy_only(mp)
        want_stats = np.zeros(c, np.float32), np.ones(c, np.float32)
        want_y, want_mean, want_invstd = _forward_arrays(x, gamma, beta, *want_stats, 0.1, eps, act)
        # the backward from the same forward values (a relu's kink is where rounding may put a value either side)
        want_grads = cpu_norm.batchnorm_backward(dy, x, y, gamma, beta, mean, invstd, eps, act, derivative)
    assert y.dtype == mean.dtype == invstd.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(invstd, want_invstd, rtol=1e-4)
    for got, want in zip(stats, want_stats):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # float32 rounding of sums over values offset from 0: what is left of the gradients where they nearly cancel
    # (with two values a channel dx is 0) grows with each channel's |mean| / std
    offset = float((1 + np.abs(mean) * invstd).max())
    scale = float(np.abs(dy).max()) * offset * (1.0 if gamma is None else float(np.abs(gamma).max()))
    for got, want, size in zip(grads, want_grads, (1, x.size // c, x.size // c)):
        assert got.dtype == want.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale * size * float(invstd.max()))


@pytest.mark.parametrize("offset", [0.0, 2.0, 30.0])   # the one-pass variance, and the two-pass one (30)
def test_the_statistics_are_as_close_to_float64_as_the_numpy_paths(offset):
    x, _, _, _ = _problem(1, (16, 8, 24, 24), False, offset)
    wide = x.astype(np.float64)
    true_mean, true_var = wide.mean(axis=(0, 2, 3)), wide.var(axis=(0, 2, 3))
    _, mean, invstd = cpu_norm.batchnorm_forward(x, None, None, None, None, 0.1, 0.0, None)
    with pytest.MonkeyPatch.context() as mp:
        _numpy_only(mp)
        _, numpy_mean, numpy_invstd = _forward_arrays(x, None, None, None, None, 0.1, 0.0, None)
    for got, numpy_got, true in ((mean, numpy_mean, true_mean), (invstd, numpy_invstd, 1 / np.sqrt(true_var))):
        error = float(np.abs(got / true - 1).max())
        assert error <= max(4 * float(np.abs(numpy_got / true - 1).max()), 2e-6)


def test_without_onednn_the_numpy_kernels_run(monkeypatch):
    x = np.ones((32, 16, 16, 16), np.float32)
    monkeypatch.setattr(onednn, "library", lambda: None)
    assert find("batchnorm_forward", x, None, None, None, None, 0.1, 1e-5, relu) is None
    assert not onednn.takes_eltwise(x)
    np.testing.assert_array_equal(relu(x - 1), np.maximum(x - 1, 0))


@settings(deadline=None, max_examples=20)
@given(shapes, st.booleans(), st.booleans(), st.integers(0, 99))
def test_the_layer_in_training_and_inference_equals_the_numpy_path(shape, affine, with_relu, seed):
    x, _, _, _ = _problem(seed, shape, affine)
    outputs = []
    for to_onednn in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(onednn, "ELTWISE_MIN_SIZE", 1)
            if not to_onednn:
                _numpy_only(mp)
            bn = BatchNorm(shape[1], relu if with_relu else fluxpy.ops.activations.identity, affine=affine)
            trained = [trainmode(bn)(x) for _ in range(2)]   # the running statistics move twice
            outputs.append((*trained, testmode(bn)(x), bn.running_mean.copy(), bn.running_var.copy()))
    for got, want in zip(*outputs):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


def test_a_large_batch_goes_to_onednn_and_smaller_or_other_ones_do_not():
    x = np.ones((32, 16, 16, 16), np.float32)
    c = np.ones(16, np.float32)
    assert find("batchnorm_forward", x, c, c, c, c, 0.1, 1e-5, relu) is cpu_norm.batchnorm_forward
    for other in (x.astype(np.float64), x.astype(np.float16), x[:, :, ::2], x.transpose(0, 2, 3, 1).copy()
                  .transpose(0, 3, 1, 2), np.ones((2, 16, 4, 4), np.float32), np.ones((4096, 64), np.float32)):
        assert find("batchnorm_forward", other, None, None, None, None, 0.1, 1e-5, None) is None
    assert not cpu_norm.batchnorm_forward_supports(x, c.astype(np.float64), None, None, None, 0.1, 1e-5, None)
    assert cpu_norm._is_relu(relu) and not cpu_norm._is_relu(tanh)   # relu is fused into the last pass


def test_a_large_batch_gives_the_numpy_paths_results_and_running_statistics():
    x, gamma, beta, dy = _problem(7, (32, 16, 32, 32), True, offset=10.0)
    results = []
    for to_onednn in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not to_onednn:
                _numpy_only(mp)
            rm, rv = np.zeros(16, np.float32), np.ones(16, np.float32)
            y = batchnorm(x, gamma, beta, rm, rv, act=relu)
            _, grads = fluxpy.withgradient(lambda x, g, b: (batchnorm(x, g, b, rm, rv, act=relu) * dy).sum(),
                                           x, gamma, beta)
            results.append((y, rm, rv, *grads))
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("act,spread", [(relu, 1.0), (relu6, 4.0)])   # relu6: outputs past 6 too
def test_gradients_through_the_layer_equal_float64_finite_differences(act, spread):
    rng = np.random.default_rng(3)
    x, _, _, w = _problem(11, (8, 4, 48, 48), False)
    bn = trainmode(BatchNorm(4, act))
    bn.gamma[:] = spread * rng.uniform(0.5, 1.5, 4)
    bn.beta[:] = spread * rng.standard_normal(4)
    assert onednn.takes_eltwise(x)
    gx, gm = fluxpy.gradient(lambda x, m: (m(x) * w).sum(), x, bn)
    if act is relu6:
        assert (bn(x) == 6).any() and (bn(x) == 0).any()

    wide = trainmode(BatchNorm(4, act, track_stats=False))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    g64, b64 = bn.gamma.astype(np.float64), bn.beta.astype(np.float64)

    def loss(t, vx, vg, vb):   # in float64 (the NumPy path) at (x, gamma, beta) + t * (vx, vg, vb)
        wide.gamma, wide.beta = g64 + t * vg, b64 + t * vb
        return float((wide(x64 + t * vx) * w64).sum())
    h = 1e-3
    for _ in range(3):   # directional derivatives along random unit directions (few values cross a kink)
        v = rng.standard_normal(x.shape), rng.standard_normal(4), rng.standard_normal(4)
        norm = np.sqrt(sum(float((a * a).sum()) for a in v))
        v = tuple(a / norm for a in v)
        numeric = (loss(h, *v) - loss(-h, *v)) / (2 * h)
        analytic = float((gx * v[0]).sum() + (gm["gamma"] * v[1]).sum() + (gm["beta"] * v[2]).sum())
        assert analytic == pytest.approx(numeric, rel=1e-3, abs=1e-3)


def test_nan_stays_nan_through_the_fused_relu():
    x, gamma, beta, _ = _problem(5, (32, 4, 32, 32), True)
    x[3, 1, 5, 5] = np.nan
    y, mean, _ = cpu_norm.batchnorm_forward(x, gamma, beta, None, None, 0.1, 1e-5, relu)
    assert np.isnan(mean[1]) and np.isnan(y[:, 1]).all() and not np.isnan(y[:, [0, 2, 3]]).any()


def test_nan_stays_nan_through_batch_norm_with_relu6_each_way():
    """A NaN channel is not fused (oneDNN's clip would turn NaN into a number): relu6 and its derivative run in
    NumPy there, with NumPy's results."""
    x, gamma, beta, dy = _problem(6, (32, 4, 32, 32), True)
    x[3, 1, 5, 5] = np.nan
    y, mean, invstd = cpu_norm.batchnorm_forward(x, gamma, beta, None, None, 0.1, 1e-5, relu6)
    assert np.isnan(y[:, 1]).all() and not np.isnan(y[:, [0, 2, 3]]).any()
    derivative = DERIVATIVES_FROM_OUTPUT[relu6].formula
    got = cpu_norm.batchnorm_backward(dy, x, y, gamma, beta, mean, invstd, 1e-5, relu6, derivative)
    with pytest.MonkeyPatch.context() as mp:
        _numpy_only(mp)
        want = cpu_norm.batchnorm_backward(dy, x, y, gamma, beta, mean, invstd, 1e-5, relu6, derivative)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@settings(deadline=None, max_examples=30)
@given(st.sampled_from([(1 << 16,), (64, 32, 33), (3, 1 << 15)]), st.integers(0, 2**16))
def test_relu6_passes_equal_numpys_at_the_kinks_and_signed_zeros(shape, seed):
    rng = np.random.default_rng(seed)
    y = (rng.standard_normal(shape) * 4 + 3).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    six, zero = np.float32(6), np.float32(0)
    kinks = [0.0, -0.0, 6.0, np.nextafter(six, zero), np.nextafter(six, 2 * six), np.nextafter(zero, six),
             np.nextafter(zero, -six), 3.0, np.nextafter(np.float32(3), zero), 1e-30, 12.0, 13.0, -np.inf, np.inf]
    y.reshape(-1)[rng.choice(y.size, len(kinks), replace=False)] = kinks
    want = dy * ((y > 0) & (y < 6))
    got = onednn.relu6_backward(dy, y)
    np.testing.assert_array_equal(got, want)
    assert (np.signbit(got) == np.signbit(want)).all()
    c = shape[1] if len(shape) > 1 else 1
    x3 = y.reshape(shape[0] if len(shape) > 1 else 1, c, -1)
    x3 = np.where(np.isfinite(x3), x3, 1).astype(np.float32)
    p, q = (rng.standard_normal(c).astype(np.float32) for _ in range(2))
    z = onednn.scale_shift(x3, p, q)
    np.testing.assert_array_equal(onednn.scale_shift_relu6(x3, p, q), relu6(z))


def test_the_fused_relu6_is_known_by_its_names():
    assert cpu_norm._is_relu6(relu6) and not cpu_norm._is_relu6(relu) and not cpu_norm._is_relu(relu6)

    def relu6_(x):   # another function of the name
        return x
    relu6_.__name__ = "relu6"
    assert not cpu_norm._is_relu6(relu6_)


@pytest.mark.parametrize("shape", [(1 << 16,), (64, 32, 33), (3, 1 << 15)])
def test_relu_and_its_gradient_equal_numpys_with_nan_inf_and_signed_zeros(shape):
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    flat, dflat = x.reshape(-1), dy.reshape(-1)
    flat[:6] = [np.nan, -np.nan, -0.0, 0.0, -np.inf, np.inf]
    dflat[6:9] = [np.nan, -1.0, np.inf]
    assert onednn.takes_eltwise(x, dy)
    y = np.maximum(x, 0)
    np.testing.assert_array_equal(relu(x), y)
    _, (tape,) = fluxpy.withgradient(lambda x: (relu(x) * dy).sum(), x)
    with np.errstate(invalid="ignore"):   # inf * False
        want = dy * (y > 0)
    want.reshape(-1)[:2] = dflat[:2]   # where y is NaN oneDNN's compare passes dy (NumPy's gives 0)
    for got in (onednn.relu_backward(dy, y), tape):
        np.testing.assert_array_equal(got, want)
        assert (np.signbit(got) == np.signbit(want)).all()


def test_the_passes_equal_numpys_arithmetic():
    rng = np.random.default_rng(0)
    for shape in [(64, 1024), (4, 3, 9000), (2, 5, 7, 1000), (1, 65536)]:
        x, g = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        p, q, a = (rng.standard_normal(shape[1]).astype(np.float32) for _ in range(3))
        c = (1, shape[1]) + (1,) * (len(shape) - 2)
        np.testing.assert_allclose(onednn.scale_shift(x, p, q, relu=True),
                                   np.maximum(x * p.reshape(c) + q.reshape(c), 0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(onednn.batchnorm_dx(x, p, g, q, a),
                                   (x * p.reshape(c) + g + q.reshape(c)) * a.reshape(c), rtol=1e-5, atol=1e-5)
        inplace = x.copy()
        assert onednn.scale_shift(inplace, p, q, out=inplace) is inplace
        np.testing.assert_allclose(inplace, x * p.reshape(c) + q.reshape(c), rtol=1e-6, atol=1e-6)
        over_g = g.copy()
        assert onednn.batchnorm_dx(x, p, over_g, q, a, into_g=True) is over_g
        np.testing.assert_array_equal(over_g, onednn.batchnorm_dx(x, p, g, q, a))


def test_a_failing_pass_names_the_status_and_the_function():
    lib = onednn.library()
    with pytest.raises(RuntimeError, match=r"oneDNN: dnnl_binary_primitive_desc_create failed with "
                                           r"dnnl_invalid_arguments"):
        onednn._Pass(lib, (4, 3), "mul", (1, 5), ())   # a per-channel operand of 5 channels for 3


def test_relu_takes_the_onednn_passes_through_the_kernel_table_for_large_float32_arrays_only(monkeypatch):
    big = np.random.default_rng(0).standard_normal((4, 16, 32, 32)).astype(np.float32)
    assert find("relu_forward", big) is onednn.relu
    assert find("relu_backward", big, big) is onednn.relu_backward
    for other in (big.astype(np.float64), big[:, :, :2, :2].copy(), big.transpose(0, 2, 3, 1)):
        assert find("relu_forward", other) is None
    assert find("relu_backward", big, big[:1]) is None
    calls = []
    monkeypatch.setattr(onednn, "relu_backward", lambda dy, y: calls.append("backward") or dy * (y > 0))
    from fluxpy import kernels
    table = kernels.snapshot()
    try:   # the op looks its kernels up by name, so a kernel registered anew is what it runs
        kernels.register("relu_forward", "numpy", lambda x: calls.append("forward") or np.maximum(x, 0),
                         onednn.takes_eltwise)
        kernels.register("relu_backward", "numpy", onednn.relu_backward, onednn.takes_eltwise)
        w = np.random.default_rng(1).standard_normal(big.shape).astype(np.float32)
        (g,) = fluxpy.gradient(lambda x: (relu(x) * w).sum(), big)
    finally:
        kernels.restore(table)
    assert calls == ["forward", "backward"]
    np.testing.assert_array_equal(g, w * (big > 0))
