"""Batch norm with a residual joined before its activation on the GPU (fluxpy.kernels.cuda_bn, ``FX_RES``): the
residual read by the apply kernel, read again by both backward kernels, ``dresidual`` written beside ``dx``;
against the float64 CPU path in every dtype and layout, and a residual block's captured step against its eager
one."""
import operator

import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module, half_to_device, to_host64
from fluxpy import kernels
from fluxpy.ops.batchnorm import batchnorm
from sweeps import sweep

pytestmark = pytest.mark.gpu

# 2-d, odd spatial sizes (scalar loads), short rows (the flat grid), long rows (a block per row chunk)
SHAPES = [(8, 3), (6, 4, 5), (16, 8, 7, 7), (4, 8, 64, 64)]
TOL = {"float64": 1e-10, "float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}


def _dtype(name):
    from fluxpy.kernels.halfs import BFLOAT16
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


@pytest.mark.parametrize("shape, dtype, layout, act", sweep(cases=[
    (shape, dtype, layout, act) for shape in SHAPES for dtype in TOL
    for layout in (["c_order", "channels_last"] if len(shape) == 4 else ["c_order"])
    for act in [None, fluxpy.relu, fluxpy.gelu]]))
def test_values_statistics_and_gradients_match_the_cpu(shape, dtype, layout, act):
    cp = cupy_module()
    from fluxpy.kernels import cuda_bn
    from fluxpy.layout import to_channels_last
    dt, tol = _dtype(dtype), TOL[dtype]
    pdt = cuda_bn.param_dtype(dt)
    rng = np.random.default_rng(len(shape) * 7 + shape[1])
    c = shape[1]
    x, r, dy = rng.standard_normal(shape) * 2 + 0.5, rng.standard_normal(shape), rng.standard_normal(shape)
    g, b = rng.standard_normal(c), rng.standard_normal(c)
    rm, rv = rng.standard_normal(c), rng.random(c) + 0.5
    xg, rg, dyg = (half_to_device(a, dt) for a in (x, r, dy))
    if layout == "channels_last":
        xg, rg, dyg = (to_channels_last(a) for a in (xg, rg, dyg))
    x, r, dy = (to_host64(a) for a in (xg, rg, dyg))   # the CPU path starts from the same rounded values
    gg, bg, rmg, rvg = (cp.asarray(a, pdt) for a in (g, b, rm, rv))
    g, b, rm, rv = (cp.asnumpy(a).astype(np.float64) for a in (gg, bg, rmg, rvg))
    assert kernels.find("batchnorm_forward", xg, gg, bg, rmg, rvg, 0.2, 1e-3, act, rg) is not None

    def loss(dy, rm, rv):
        return lambda x, g, b, r: (batchnorm(x, g, b, rm, rv, momentum=0.2, eps=1e-3, act=act,
                                             residual=r).astype(dy.dtype) * dy).sum()

    y = batchnorm(xg, gg, bg, rmg, rvg, momentum=0.2, eps=1e-3, act=act, residual=rg)
    assert y.dtype == dt and y.strides == xg.strides
    want = batchnorm(x, g, b, rm, rv, momentum=0.2, eps=1e-3, act=act, residual=r)
    assert_matches_cpu(y.astype(np.float64), want, rtol=tol, atol=tol)
    got = fluxpy.gradient(loss(dyg, rmg, rvg), xg, gg, bg, rg)
    ref = fluxpy.gradient(loss(dy, rm, rv), x, g, b, r)
    assert got[3].dtype == dt and got[3].strides == xg.strides
    for name, a, w in zip(("dx", "dgamma", "dbeta", "dresidual"), got, ref):
        scale = max(1.0, float(np.abs(w).max()))
        assert_matches_cpu(a.astype(np.float64), w, rtol=10 * tol, atol=10 * tol * scale), name
    assert_matches_cpu(rmg.astype(np.float64), rm, rtol=tol, atol=tol)   # moved twice: once a call
    assert_matches_cpu(rvg.astype(np.float64), rv, rtol=tol, atol=tol)


def test_float32_relu_join_equals_the_batch_norm_then_the_join():
    """In float32 the joined forward is the batch norm's output plus the residual, relu'd, item for item (the
    normalised value is rounded to float32 in either case before the residual is added), and ``dresidual`` is
    ``dy`` where that is positive."""
    cp = cupy_module()
    from fluxpy.kernels import cuda_bn
    rng = np.random.default_rng(4)
    shape = (16, 24, 12, 12)
    xg, rg, dyg = (cp.asarray(rng.standard_normal(shape), np.float32) for _ in range(3))
    gg, bg = (cp.asarray(rng.standard_normal(24), np.float32) for _ in range(2))
    y, mean, invstd = cuda_bn.forward_training(xg, gg, bg, None, None, 0.1, 1e-5, fluxpy.relu, rg)
    plain, mean2, invstd2 = cuda_bn.forward_training(xg, gg, bg, None, None, 0.1, 1e-5)
    cp.testing.assert_array_equal(mean, mean2)
    cp.testing.assert_array_equal(y, cp.maximum(plain + rg, 0))
    dx, dgamma, dbeta, dr = cuda_bn.backward(dyg, xg, gg, bg, mean, invstd, 1e-5, fluxpy.relu, rg)
    cp.testing.assert_array_equal(dr, cp.where(plain + rg > 0, dyg, 0))
    dx2, dgamma2, dbeta2 = cuda_bn.backward(dr, xg, gg, bg, mean, invstd, 1e-5)
    cp.testing.assert_allclose(dx, dx2, rtol=1e-5, atol=1e-6)
    cp.testing.assert_allclose(dbeta, dbeta2, rtol=1e-5, atol=1e-5)
    cp.testing.assert_allclose(dgamma, dgamma2, rtol=1e-5, atol=1e-5)


def test_a_residual_in_another_layout_or_strided_takes_the_composite():
    cp = cupy_module()
    from fluxpy.layout import to_channels_last
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 8, 6, 6))
    r = rng.standard_normal((4, 8, 6, 6))
    xg, rg = cp.asarray(x, np.float32), to_channels_last(cp.asarray(r, np.float32))
    assert kernels.find("batchnorm_forward", xg, None, None, None, None, 0.1, 1e-5, fluxpy.relu, rg) is None
    y = batchnorm(xg, act=fluxpy.relu, residual=rg)
    assert_matches_cpu(y.astype(np.float64), batchnorm(x, act=fluxpy.relu, residual=r.astype(np.float32)
                                                        .astype(np.float64)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_residual_blocks_captured_step_equals_its_eager_step(precision):
    """Two residual blocks (identity and projection shortcuts) and a head, a captured TrainStep against eager
    steps from the same start: the same weights and running statistics bit for bit after three steps."""
    cp = cupy_module()
    from fluxpy import TrainStep, logitcrossentropy
    from fluxpy.functors import arrays
    from fluxpy.kernels.halfs import BFLOAT16
    from fluxpy.models import basic_block
    from fluxpy.optimise import Momentum, setup
    rng = np.random.default_rng(6)

    def build():
        return fluxpy.Chain(basic_block(8, 8, rng=1), basic_block(8, 16, 2, rng=2), fluxpy.GlobalMeanPool(),
                            fluxpy.flatten, fluxpy.Dense(16, 10, rng=3))
    x = cp.asarray(rng.standard_normal((16, 8, 8, 8)), np.float32)
    y = cp.asarray(rng.integers(0, 10, 16))
    results = []
    with fluxpy.options(deterministic=True):
        for capture in (False, True):
            model = fluxpy.gpu(build())
            if precision == "bfloat16":
                model = fluxpy.mixed_precision(model, BFLOAT16)
            step = TrainStep(lambda m, x, y: logitcrossentropy(m(x), y), model, setup(Momentum(0.05), model),
                             capture=capture)
            for _ in range(3):
                step(x, y)
            results.append([cp.asnumpy(a) for a in arrays(model)])
    assert len(results[0]) == len(results[1]) > 10
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_the_join_runs_in_the_batch_norm_of_a_resnet_on_the_gpu(monkeypatch):
    cp = cupy_module()
    from fluxpy.models import basic_block
    from test_batchnorm_residual import batchnorm_calls
    joined = batchnorm_calls(monkeypatch)
    block = fluxpy.gpu(fluxpy.Chain(basic_block(4, 4, rng=0), basic_block(4, 8, 2, rng=1)))
    x = cp.asarray(np.random.default_rng(7).standard_normal((4, 4, 8, 8)), np.float32)
    fluxpy.gradient(lambda m: (m(x) ** 2).sum(), block)
    assert joined.count(True) == 2 and len(joined) == 5
    assert operator.add is block[0][0].connection
