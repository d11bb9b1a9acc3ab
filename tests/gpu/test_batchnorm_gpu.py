"""cuDNN's batch norm through fluxpy.ops.batchnorm against the CPU path, and the composite it falls back to."""
import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module
from fluxpy import kernels
from fluxpy.ops.batchnorm import batchnorm
from sweeps import sweep

pytestmark = pytest.mark.gpu

SHAPES = [(8, 3), (6, 4, 5), (16, 8, 7, 7), (32, 16, 4, 4), (3, 2, 1, 9)]


def _case(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = rng.standard_normal(shape) * 2 + 0.5
    g, b = rng.standard_normal(c), rng.standard_normal(c)
    rm, rv = rng.standard_normal(c), rng.random(c) + 0.5
    dy = rng.standard_normal(shape)
    return [a.astype(dtype) for a in (x, g, b, rm, rv, dy)]


def _preferring(name):
    """The batch norm kernels for the table, running ``name``'s implementation (``"fluxpy"``: fluxpy.kernels.cuda_bn,
    ``"cudnn"``: cuDNN's calls) wherever both take the call, the other where only that one does; the table's own
    kernels pick between the two by timing them, so this is how each is tested on every call."""
    from fluxpy.kernels import cuda_bn, cuda_norm
    from fluxpy.layout import like_layout

    def ours(x, params, act):
        return not cuda_norm._cudnn_fits(x, *params) or (name == "fluxpy" and cuda_bn.supports(x, *params, act=act))

    def forward(x, gamma, beta, running_mean, running_var, momentum, eps, act):
        impl = cuda_bn.forward_training if ours(x, (gamma, beta, running_mean, running_var), act) \
            else cuda_norm._cudnn_forward
        return impl(x, gamma, beta, running_mean, running_var, momentum, eps, act)

    def backward(dy, x, y, gamma, beta, mean, invstd, eps, act, y_derivative):
        dy = like_layout(dy, x)
        if ours(x, (gamma, beta, mean, invstd), act) or (act is not None and y is None):
            return cuda_bn.backward(dy, x, gamma, beta, mean, invstd, eps, act)
        return cuda_norm._cudnn_backward(dy, x, y, gamma, mean, invstd, eps, y_derivative)
    return {"batchnorm_forward": (forward, cuda_norm.forward_supports),
            "batchnorm_backward": (backward, cuda_norm.backward_supports)}


@pytest.fixture(params=["fluxpy", "cudnn", "auto"])
def impl(request):
    """Each implementation preferred in turn, then the table's own choice (``"auto"``)."""
    table = kernels.snapshot()
    if request.param != "auto":
        for op, (fn, supports) in _preferring(request.param).items():
            kernels.register(op, "cupy", fn, supports)
    yield request.param
    kernels.restore(table)


@pytest.mark.parametrize("shape, dtype, tol, act", sweep(cases=[
    (shape, dtype, tol, act) for shape in SHAPES for dtype, tol in [(np.float64, 1e-10), (np.float32, 2e-4)]
    for act in [None, fluxpy.relu]]))
def test_forward_backward_and_running_statistics_match_cpu(shape, dtype, tol, impl, act):
    cp = cupy_module()
    x, g, b, rm, rv, dy = _case(shape, dtype, 0)
    xg, gg, bg, rmg, rvg, dyg = (cp.asarray(a) for a in (x, g, b, rm, rv, dy))
    assert kernels.find("batchnorm_forward", xg, gg, bg, rmg, rvg) is not None, "cuDNN's kernel is used"
    rm64, rv64 = rm.astype(np.float64), rv.astype(np.float64)

    def f(bn_args):
        return lambda x, g, b: (batchnorm(x, g, b, *bn_args, momentum=0.2, eps=1e-3, act=act) * dy_of(x)).sum()

    def dy_of(x):
        return dyg if isinstance(x, cp.ndarray) or isinstance(fluxpy.value_of(x), cp.ndarray) else dy.astype(np.float64)

    y = batchnorm(xg, gg, bg, rmg, rvg, momentum=0.2, eps=1e-3, act=act)
    yc = batchnorm(*(a.astype(np.float64) for a in (x, g, b)), rm64, rv64, momentum=0.2, eps=1e-3, act=act)
    assert_matches_cpu(y, yc, rtol=tol, atol=tol)
    assert_matches_cpu(rmg, rm64, rtol=tol, atol=tol)
    assert_matches_cpu(rvg, rv64, rtol=tol, atol=tol)
    got = fluxpy.gradient(f(()), xg, gg, bg)
    ref = fluxpy.gradient(f(()), *(a.astype(np.float64) for a in (x, g, b)))
    for a, r in zip(got, ref):
        assert_matches_cpu(a, r, rtol=10 * tol, atol=10 * tol)


def test_without_affine_or_running_statistics():
    cp = cupy_module()
    x = np.random.default_rng(1).standard_normal((8, 4, 3, 3))
    y = batchnorm(cp.asarray(x))
    assert_matches_cpu(y, batchnorm(x), rtol=1e-10, atol=1e-10)
    gx, = fluxpy.gradient(lambda x: (batchnorm(x) ** 3).sum(), cp.asarray(x))
    cx, = fluxpy.gradient(lambda x: (batchnorm(x) ** 3).sum(), x)
    assert_matches_cpu(gx, cx, rtol=1e-8, atol=1e-9)


def test_second_derivatives_on_the_gpu_take_the_composite():
    cp = cupy_module()
    rng = np.random.default_rng(2)
    x, g = rng.standard_normal((6, 2, 3, 3)), rng.standard_normal(2)

    def hvp(x, g):
        gx, gg = fluxpy.gradient(lambda x, g: (batchnorm(x, g, None, eps=1e-2) ** 3).sum(), x, g)
        return (gx * gx).sum() + (gg * gg).sum()
    got = fluxpy.gradient(hvp, cp.asarray(x), cp.asarray(g))
    ref = fluxpy.gradient(hvp, x, g)
    for a, r in zip(got, ref):
        assert_matches_cpu(a, r, rtol=1e-8, atol=1e-9)


def test_mixed_parameter_dtypes_take_the_composite():
    cp = cupy_module()
    x = cp.asarray(np.random.default_rng(3).standard_normal((8, 3)).astype(np.float32))
    g64 = cp.ones(3, dtype=cp.float64)
    assert kernels.find("batchnorm_forward", x, g64, None, None, None) is None
    y = batchnorm(x, g64)
    assert y.shape == x.shape


def test_own_kernels_are_deterministic_and_accurate_with_a_large_mean():
    cp = cupy_module()
    from fluxpy.kernels import cuda_bn
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((64, 8, 33, 17)) * 0.5 + 1000.0).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    xg, dyg = cp.asarray(x), cp.asarray(dy)
    first = [a.get() for a in cuda_bn.forward_training(xg, None, None, None, None, 0.1, 1e-5)]
    for _ in range(5):
        again = [a.get() for a in cuda_bn.forward_training(xg, None, None, None, None, 0.1, 1e-5)]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))
    x64 = x.astype(np.float64)
    mean, var = x64.mean(axis=(0, 2, 3)), x64.var(axis=(0, 2, 3))
    np.testing.assert_allclose(first[1], mean, rtol=1e-7)
    np.testing.assert_allclose(first[2], 1 / np.sqrt(var + 1e-5), rtol=2e-3)   # var 0.25 under a mean of 1000
    g = cuda_bn.backward(dyg, xg, None, None, cp.asarray(first[1]), cp.asarray(first[2]), 1e-5)
    g2 = cuda_bn.backward(dyg, xg, None, None, cp.asarray(first[1]), cp.asarray(first[2]), 1e-5)
    assert all(a.get().tobytes() == b.get().tobytes() for a, b in zip(g, g2))


def test_the_kept_implementation_is_reported():
    cp = cupy_module()
    from fluxpy.kernels import cuda_norm
    x = cp.asarray(np.random.default_rng(5).standard_normal((16, 4, 6, 6)).astype(np.float32))
    fluxpy.gradient(lambda x: (batchnorm(x) ** 2).sum(), x)
    kept = {k: v for k, v in cuda_norm.choices().items() if k[1] == (16, 4, 6, 6)}
    assert {k[0] for k in kept} == {"forward", "backward"}
    for timed in kept.values():
        assert set(timed.gpu_ms) == {"fluxpy", "cudnn"} and timed.kept in timed.wall_ms
        assert timed.gpu_ms[timed.kept] <= 1.1 * min(timed.gpu_ms.values())
        assert timed.wall_ms[timed.kept] == min(timed.wall_ms.values())


@pytest.mark.parametrize("layout", ["c_order", "channels_last"])
def test_own_kernels_read_every_partial_fresh_across_layers_that_share_a_plan(layout):
    """Batch norms of one shape share one plan's scratch partials, and the last block of each channel (or chunk of
    channels) reads the other blocks' partials, some in cache lines that an earlier last block on its SM read. 24
    layers in a row, each forward and backward against float64: mean, invstd, dgamma and dbeta within 1e-4 of the
    sum of the terms' magnitudes (float32 rounding is well inside that; a stale partial, a whole block's share of
    another layer's sum, is some 4e-3 of it)."""
    cp = cupy_module()
    from fluxpy.kernels import cuda_bn
    from fluxpy.layout import to_channels_last
    rng = np.random.default_rng(3)
    shape, axes = (64, 48, 14, 14), (0, 2, 3)
    for layer in range(24):
        x = rng.standard_normal(shape) * (1 + layer % 3) + layer % 5
        dy = rng.standard_normal(shape)
        g, b = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
        xg, dyg = cp.asarray(x, np.float32), cp.asarray(dy, np.float32)
        if layout == "channels_last":
            xg, dyg = to_channels_last(xg), to_channels_last(dyg)
        gg, bg = cp.asarray(g, np.float32), cp.asarray(b, np.float32)
        _, mean, invstd = cuda_bn.forward_training(xg, gg, bg, None, None, 0.1, 1e-5)
        _, dgamma, dbeta = cuda_bn.backward(dyg, xg, gg, bg, mean, invstd, 1e-5)
        mu = x.mean(axes)
        inv = 1 / np.sqrt(x.var(axes) + 1e-5)
        xhat = (x - mu[None, :, None, None]) * inv[None, :, None, None]
        count = x.size // shape[1]
        for name, got, want, scale in (
                ("mean", mean, mu, np.abs(x - x[:1, :, :1, :1]).sum(axes) / count),
                ("invstd", invstd, inv, inv),
                ("dbeta", dbeta, dy.sum(axes), np.abs(dy).sum(axes)),
                ("dgamma", dgamma, (dy * xhat).sum(axes), np.abs(dy * xhat).sum(axes))):
            err = np.abs(cp.asnumpy(got).astype(np.float64) - want)
            assert (err <= 1e-4 * scale).all(), (
                f"layer {layer} {layout} {name}: error {err.max():.3g} at channel {int(err.argmax())}")


@pytest.mark.parametrize("layout", ["c_order", "channels_last"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, "bfloat16"])
def test_own_kernels_give_a_constant_channel_exactly_beta_and_relus_derivative_there(layout, dtype):
    """A channel whose values all equal its mean (a dead channel: a conv of zero inputs) normalises to exactly
    beta, as (x - mean) * scale + beta gives it (PyTorch's form): relu of it is exactly relu(beta), and the
    backward takes relu's derivative at that exact value, as the float64 reference does. At beta = 0 the channel
    passes no gradient (relu'(0) = 0): dbeta, dgamma and dx of it are exactly zero; a value a rounding away from
    zero (x * scale + shift) would pass the whole channel's dy or none, by the rounding's sign."""
    cp = cupy_module()
    from fluxpy.kernels import cuda_bn
    from fluxpy.layout import to_channels_last
    from test_half_conv_matmul import BF16
    from devices import half_to_device, to_host64
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(11)
    shape = (16, 24, 8, 8)
    x = rng.standard_normal(shape)
    x[:, 3] = 0.3721                    # constant, beta 0: no gradient
    x[:, 5] = -1.25                     # constant, beta 0.5: y exactly 0.5
    g = rng.standard_normal(shape[1]) + 2.0
    b = rng.standard_normal(shape[1])
    b[3], b[5] = 0.0, 0.5
    dy = rng.standard_normal(shape)
    xg, dyg = half_to_device(x, dt), half_to_device(dy, dt)
    if layout == "channels_last":
        xg, dyg = to_channels_last(xg), to_channels_last(dyg)
    pdt = cuda_bn.param_dtype(dt)
    gg, bg = cp.asarray(g, pdt), cp.asarray(b, pdt)
    y, mean, invstd = cuda_bn.forward_training(xg, gg, bg, None, None, 0.1, 1e-5, act=fluxpy.relu)
    dx, dgamma, dbeta = cuda_bn.backward(dyg, xg, gg, bg, mean, invstd, 1e-5, act=fluxpy.relu)
    y, dx = to_host64(y), to_host64(dx)
    dgamma, dbeta = cp.asnumpy(dgamma), cp.asnumpy(dbeta)
    assert (y[:, 3] == 0).all() and (y[:, 5] == 0.5).all(), (np.abs(y[:, 3]).max(), np.abs(y[:, 5] - 0.5).max())
    assert dbeta[3] == 0 and dgamma[3] == 0 and (dx[:, 3] == 0).all(), (dbeta[3], dgamma[3], np.abs(dx[:, 3]).max())
    assert dbeta[5] != 0 and np.isfinite(dx).all()
