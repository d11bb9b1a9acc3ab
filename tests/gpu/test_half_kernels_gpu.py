"""float16 and bfloat16 through fluxpy's own CUDA kernels (mapreduce, pooling, batch norm, the cross-entropy rows):
each op on a half CuPy array against the float32 GPU path on the same values, and against the CPU half path.

Tolerances are those of ``tests/test_half_kernels.py`` (its docstring justifies them): one rounding of a float32
result for the forwards, eight roundings of the largest element for the gradients.
"""
import numpy as np
import pytest
from test_half_kernels import (BF16, CASES, HALVES, assert_close_forward, assert_close_gradient, check_case,
                               random_input)

import fluxpy
from devices import cupy_module
from fluxpy import ops
from fluxpy.kernels import find
from fluxpy.kernels import reduce as R
from fluxpy.kernels import cuda_bn
from sweeps import case_id, sweep

pytestmark = pytest.mark.gpu
IDS = {"ids": lambda d: d.name}


def _gpu(*arrays):
    cp = cupy_module()
    return tuple(cp.asarray(a) for a in arrays)


@pytest.mark.parametrize("dtype", HALVES, **IDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_float32_on_the_gpu(name, dtype):
    f, shape = CASES[name]
    x, x32 = random_input(shape, dtype)
    check_case(f, *_gpu(x, x32), dtype, to_host=cupy_module().asnumpy)


@pytest.mark.parametrize("dtype", HALVES, **IDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_the_cpu_half_path(name, dtype):
    f, shape = CASES[name]
    x, _ = random_input(shape, dtype, seed=7)
    got, ref = f(_gpu(x)[0]), f(x)
    assert got.dtype == dtype
    # both round a float32 result once; the float32 results differ in summation order only
    assert_close_forward(cupy_module().asnumpy(got), ref.astype(np.float32), dtype, roundings=2)


@pytest.mark.parametrize("dtype", HALVES, **IDS)
def test_the_half_kernels_are_the_ones_found(dtype):
    x, _ = random_input((8, 4, 6, 6), dtype)
    (xg,) = _gpu(x)
    params = _gpu(*(np.ones(4, np.float32) for _ in range(4)))
    assert find("sum", xg) is not None
    assert find("batchnorm_forward", xg, *params) is not None
    assert cuda_bn.supports(xg, *params)
    y2 = xg.reshape(8, -1)
    assert find("logit_crossentropy_rows", y2, y2) is not None


@pytest.mark.parametrize("dtype, shape, axes, op", sweep(cases=[
    (dtype, shape, axes, op) for dtype in HALVES
    for shape, axes in [((64, 16, 28, 28), (0, 2, 3)), ((512, 136), (0,)), ((33, 517), (1,)), ((7, 5, 9), (1,)),
                        ((4099,), None), ((128, 8, 24), (0, 2))]
    for op in ["sum", "mean", "max"]]), ids=case_id)
def test_mapreduce_halves_round_a_float32_result_once(dtype, shape, axes, op):
    """Vector widths 8, 4, 2 and 1, split and unsplit reductions, the transposed copy."""
    x, x32 = random_input(shape, dtype, seed=3)
    xg, x32g = _gpu(x, x32)
    got = R.mapreduce(xg, axes, op)
    ref = R.mapreduce(x32g, axes, op)
    assert got.dtype == dtype
    cp = cupy_module()
    if op == "max":
        np.testing.assert_array_equal(cp.asnumpy(got).astype(np.float32), cp.asnumpy(ref))
    else:
        # float32 sums of up to 50k terms differ from the exact one by far less than a half's rounding
        assert_close_forward(cp.asnumpy(got), cp.asnumpy(ref), dtype, roundings=1.01)


@pytest.mark.parametrize("dtype", HALVES, **IDS)
def test_mapreduce_half_with_map_and_out_mapped(dtype):
    x, x32 = random_input((96, 40), dtype, seed=4)
    xg, x32g = _gpu(x, x32)
    cp = cupy_module()
    outm = cp.empty_like(xg)
    got = R.mapreduce(xg, 0, map="x * (y > 0)", y=xg, out_mapped=outm)
    ref = R.mapreduce(x32g, 0, map="x * (y > 0)", y=x32g)
    assert_close_forward(cp.asnumpy(got), cp.asnumpy(ref), dtype, roundings=1.01)
    np.testing.assert_array_equal(cp.asnumpy(outm).astype(np.float32), np.maximum(x32, 0))


@pytest.mark.parametrize("dtype", HALVES, **IDS)
@pytest.mark.parametrize("shape", [(16, 8, 32, 32), (6, 3, 5, 7), (64, 24), (5, 4, 8, 8)])
def test_batchnorm_kernels_halves_against_float32(dtype, shape):
    """fluxpy's kernels (vector rows where H*W is a multiple of 8, flat otherwise): statistics and parameters
    float32, y and dx in the half type."""
    x, x32 = random_input(shape, dtype, seed=6)
    c = shape[1]
    rng = np.random.default_rng(8)
    gamma, beta = (rng.standard_normal(c).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    cp = cupy_module()
    xg, x32g, gg, bg, dyg, dy32g = _gpu(x, x32, gamma, beta, dy, dy.astype(np.float32))
    rm, rv, rm32, rv32 = _gpu(np.zeros(c, np.float32), np.ones(c, np.float32), np.zeros(c, np.float32),
                              np.ones(c, np.float32))
    y, mean, invstd = cuda_bn.forward_training(xg, gg, bg, rm, rv, 0.1, 1e-5, act=fluxpy.relu)
    y32, mean32, invstd32 = cuda_bn.forward_training(x32g, gg, bg, rm32, rv32, 0.1, 1e-5, act=fluxpy.relu)
    assert y.dtype == dtype and mean.dtype == invstd.dtype == rm.dtype == np.float32
    assert_close_forward(cp.asnumpy(y), cp.asnumpy(y32), dtype, roundings=1.01)
    for a, b in ((mean, mean32), (invstd, invstd32), (rm, rm32), (rv, rv32)):
        np.testing.assert_allclose(cp.asnumpy(a), cp.asnumpy(b), rtol=1e-5, atol=1e-6)
    dx, dgamma, dbeta = cuda_bn.backward(dyg, xg, gg, bg, mean, invstd, 1e-5, act=fluxpy.relu)
    dx32, dgamma32, dbeta32 = cuda_bn.backward(dy32g, x32g, gg, bg, mean32, invstd32, 1e-5, act=fluxpy.relu)
    assert dx.dtype == dtype and dgamma.dtype == dbeta.dtype == np.float32
    assert_close_gradient(cp.asnumpy(dx), cp.asnumpy(dx32), dtype)
    np.testing.assert_allclose(cp.asnumpy(dgamma), cp.asnumpy(dgamma32), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cp.asnumpy(dbeta), cp.asnumpy(dbeta32), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", HALVES, **IDS)
def test_pool_layers_on_the_gpu(dtype):
    """The layers in float16; bfloat16 through the layers' ops, as layers/_checks._require_float still refuses
    dtype kind "V" (an expected failure in tests/test_half_kernels.py)."""
    x, x32 = random_input((8, 4, 12, 12), dtype, seed=9)
    layers = [fluxpy.MaxPool((2, 2)), fluxpy.MeanPool((3, 3), stride=2, pad=1)]
    if dtype == BF16:
        layers = [lambda x: ops.maxpool(x, 2), lambda x: ops.meanpool(x, 3, stride=2, pad=1)]
    for f in layers:
        check_case(f, *_gpu(x, x32), dtype, to_host=cupy_module().asnumpy)


def test_maxpool_ties_go_to_the_first_maximum_in_bfloat16():
    x = np.array([[[[1.0, 3.0], [3.0, 0.0]]]], dtype=BF16)
    (xg,) = _gpu(x)
    (g,) = fluxpy.gradient(lambda x: ops.sum(ops.maxpool(x, 2)), xg)
    assert g.dtype == BF16
    np.testing.assert_array_equal(cupy_module().asnumpy(g).astype(np.float32), [[[[0.0, 1.0], [0.0, 0.0]]]])
