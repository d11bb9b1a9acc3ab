"""GroupNorm, InstanceNorm, Upsample and PixelShuffle on CuPy arrays against the NumPy path: ops forward and
backward over an option grid in float64, float32 and the halves, the layers moved with fluxpy.gpu (running
statistics included). Needs a GPU (``gpu`` marker)."""
import ml_dtypes
import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module
from fluxpy.layers import GroupNorm, InstanceNorm, PixelShuffle, Upsample
from fluxpy.ops import groupnorm, instancenorm, pixel_shuffle, upsample_bilinear, upsample_nearest

pytestmark = pytest.mark.gpu

TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-4, np.dtype(np.float16): 2e-2,
       np.dtype(ml_dtypes.bfloat16): 1e-1}
DTYPES = (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)


def _value_and_grads(f, *arrays):
    """``f``'s value and the gradients of ``sum(f * dy)`` for a fixed random ``dy``, on the arrays' device."""
    y = fluxpy.value_of(f(*arrays))
    xp = fluxpy.get_array_module(y)
    dy = xp.asarray(np.random.default_rng(99).standard_normal(y.shape).astype(y.dtype))
    return y, fluxpy.gradient(lambda *a: (f(*a) * dy).sum(), *arrays)


def _compare(f, arrays, dtype):
    cp = cupy_module()
    tol = TOL[np.dtype(dtype)]
    y, grads = _value_and_grads(f, *arrays)
    yg, gradsg = _value_and_grads(f, *(cp.asarray(a) for a in arrays))
    assert yg.dtype == y.dtype
    assert_matches_cpu(yg, y.astype(np.float64), rtol=tol, atol=tol)
    for g, gg in zip(grads, gradsg):
        assert_matches_cpu(gg, g.astype(np.float64), rtol=tol, atol=10 * tol)


def _case(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    params = np.float32 if np.dtype(dtype).itemsize == 2 else dtype
    return x, rng.standard_normal(shape[1]).astype(params), rng.standard_normal(shape[1]).astype(params)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, groups", [((4, 6, 5, 5), 3), ((2, 8, 7), 2), ((3, 4, 2, 3, 2), 4), ((8, 32, 16, 16), 8)])
def test_groupnorm_matches_cpu(shape, groups, dtype):
    x, g, b = _case(shape, dtype)
    _compare(lambda x, g, b: groupnorm(x, groups, g, b), (x, g, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (2, 8, 7), (16, 32, 8, 8)])
def test_instancenorm_matches_cpu(shape, dtype):
    x, g, b = _case(shape, dtype)
    _compare(lambda x, g, b: instancenorm(x, g, b), (x, g, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, scale", [((2, 3, 5, 4), 2), ((2, 3, 5, 4), (3, 1)), ((1, 2, 3, 4, 5), 2),
                                          ((2, 4, 7), 3), ((8, 16, 32, 32), 2)])
def test_upsample_nearest_matches_cpu(shape, scale, dtype):
    x = _case(shape, dtype)[0]
    _compare(lambda x: upsample_nearest(x, scale), (x,), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("align", [True, False])
@pytest.mark.parametrize("shape, scale", [((2, 3, 5, 4), 2), ((2, 3, 5, 4), (1, 3)), ((8, 16, 32, 32), 2)])
def test_upsample_bilinear_matches_cpu(shape, scale, align, dtype):
    x = _case(shape, dtype)[0]
    _compare(lambda x: upsample_bilinear(x, scale, align_corners=align), (x,), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, r", [((2, 8, 3, 5), 2), ((2, 18, 4, 4), 3), ((1, 16, 2, 3, 2), 2), ((2, 6, 5), 3)])
def test_pixel_shuffle_matches_cpu(shape, r, dtype):
    x = _case(shape, dtype)[0]
    _compare(lambda x: pixel_shuffle(x, r), (x,), dtype)


def test_layers_on_the_gpu_match_the_cpu_including_running_statistics():
    cp = cupy_module()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 8, 6, 6)).astype(np.float32)
    model = fluxpy.Chain(GroupNorm(8, 4, fluxpy.relu), InstanceNorm(8, affine=True, track_stats=True),
                         PixelShuffle(2), Upsample(2, mode="bilinear"), Upsample(2))
    model_gpu = fluxpy.gpu(fluxpy.fmap(lambda a: a.copy() if hasattr(a, "copy") else a, model))
    loss = lambda m, x: (m(x) ** 2).mean()   # noqa: E731
    g = fluxpy.gradient(loss, model, x)
    gg = fluxpy.gradient(loss, model_gpu, cp.asarray(x))
    assert_matches_cpu(gg[1], g[1], rtol=1e-3, atol=1e-6)
    for name in ("gamma", "beta"):
        for i in (0, 1):
            assert_matches_cpu(gg[0]["layers"][i][name], g[0]["layers"][i][name], rtol=1e-3, atol=1e-6)
    for name in ("running_mean", "running_var"):
        assert_matches_cpu(getattr(model_gpu[1], name), getattr(model[1], name), rtol=1e-5)
    assert_matches_cpu(model_gpu(cp.asarray(x)), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("op", ["bilinear", "adaptive_meanpool"])
def test_channels_last_and_repeated_calls_match_the_cpu_and_reuse_the_device_constants(op, dtype):
    """Each axis is one 2-D product over the rows (channels-last rows are copied into C order first); the
    interpolation and averaging matrices are copied to the device on the first call only."""
    from fluxpy.ops import adaptive_meanpool
    from fluxpy.ops.constants import clear_constants, constants_held
    from fluxpy.ops.shape import as_memory_format
    cp = cupy_module()
    f = (lambda x: upsample_bilinear(x, None, False, size=(11, 7))) if op == "bilinear" else \
        (lambda x: adaptive_meanpool(x, (4, 3)))
    x = np.random.default_rng(30).standard_normal((3, 5, 9, 6)).astype(dtype)
    clear_constants()
    _compare(f, [x], dtype)
    held = constants_held()
    assert held >= 2
    _compare(lambda x: f(as_memory_format(x, "channels_last")), [x], dtype)
    assert constants_held() == held
    y = f(cp.asarray(x))
    assert y.dtype == x.dtype and constants_held() == held
