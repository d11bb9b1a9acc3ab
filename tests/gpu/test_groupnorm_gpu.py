"""fluxpy's group-norm kernels (fluxpy.kernels.cuda_groupnorm) against the CPU composite in float64: the output and
the gradients of x, gamma and beta, every dtype, C order and channels-last, fused activations, without the affine,
3-d to 5-d inputs, one group to one channel a group; the op and the layer take the fused path; determinism; inside a
CUDA graph. Needs a GPU (``gpu`` marker)."""
import numpy as np
import pytest

import fluxpy
from devices import cupy_module, half_to_device, to_host64
from fluxpy.backend import capture_graph
from fluxpy.kernels import find
from fluxpy.layout import is_channels_last, to_channels_last
from fluxpy.ops.activations import gelu, identity, relu, swish, tanh
from fluxpy.ops.norm import groupnorm, instancenorm
from test_half_conv_matmul import BF16

pytestmark = pytest.mark.gpu

TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 2e-5, np.dtype(np.float16): 4e-3, BF16: 3e-2}


def _reference(x, dy, gamma, beta, groups, act):
    """y, dx, dgamma, dbeta of the CPU composite in float64."""
    def f(x, gamma, beta):
        return (groupnorm(x, groups, gamma, beta, 1e-5, act) * dy).sum()
    y = groupnorm(x, groups, gamma, beta, 1e-5, act)
    grads = fluxpy.gradient(f, x, gamma, beta)
    return (np.asarray(y), *grads)


def _check(got, want, dtype, what):
    err = np.abs(to_host64(got) - want).max()
    bound = TOL[np.dtype(dtype)] * (np.abs(want).max() + 1)
    assert err <= bound, f"{what}: max error {err:.3g} above {bound:.3g}"


CASES = [((4, 8, 5, 7), 2), ((3, 32, 16, 16), 8), ((2, 6, 9), 3), ((2, 4, 3, 4, 5), 4), ((5, 16, 1, 3), 16),
         ((1, 12, 33, 2), 1), ((8, 64, 8, 8), 32)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("shape,groups", CASES, ids=str)
@pytest.mark.parametrize("act", [identity, relu, swish, gelu, tanh], ids=["identity", "relu", "swish", "gelu", "tanh"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_the_kernels_equal_the_composite(dtype, shape, groups, act, layout):
    if layout == "channels_last" and len(shape) != 4:
        pytest.skip("channels-last is 4-d")
    rng = np.random.default_rng(abs(hash((shape, groups))) % 2**32)
    x = rng.standard_normal(shape) * 2 + 0.7
    dy = rng.standard_normal(shape)
    c = shape[1]
    gamma, beta = rng.standard_normal(c) + 1, rng.standard_normal(c)
    xh = x.astype(np.float32).astype(dtype).astype(np.float64) if np.dtype(dtype) != np.float64 else x
    dyh = dy.astype(np.float32).astype(dtype).astype(np.float64) if np.dtype(dtype) != np.float64 else dy
    want = _reference(xh, dyh, gamma, beta, groups, act)
    pdt = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    gx, gdy = half_to_device(x, dtype), half_to_device(dy, dtype)
    if layout == "channels_last":
        gx, gdy = to_channels_last(gx), to_channels_last(gdy)
    cp = cupy_module()
    gg, gb = cp.asarray(gamma.astype(pdt)), cp.asarray(beta.astype(pdt))
    assert find("groupnorm_forward", gx, gg, gb, groups, 1e-5, None if act is identity else act) is not None
    y = groupnorm(gx, groups, gg, gb, 1e-5, act)
    assert y.dtype == gx.dtype and y.shape == gx.shape and is_channels_last(y) == (layout == "channels_last")
    dx, dg, db = fluxpy.gradient(lambda x, g, b: (groupnorm(x, groups, g, b, 1e-5, act) * gdy).sum(), gx, gg, gb)
    assert dx.dtype == gx.dtype and dg.dtype == pdt and db.dtype == pdt
    for got, ref, what in zip((y, dx, dg, db), want, ("y", "dx", "dgamma", "dbeta")):
        _check(got, ref, dtype, what)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
def test_without_the_affine_and_the_layer(dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 12, 7, 5)) * 3
    dy = rng.standard_normal(x.shape)
    xh = x.astype(np.float32).astype(dtype).astype(np.float64)
    dyh = dy.astype(np.float32).astype(dtype).astype(np.float64)
    y_ref, dx_ref, _, _ = _reference(xh, dyh, None, None, 4, swish)
    gx, gdy = half_to_device(x, dtype), half_to_device(dy, dtype)
    y = groupnorm(gx, 4, None, None, 1e-5, swish)
    dx, = fluxpy.gradient(lambda x: (groupnorm(x, 4, None, None, 1e-5, swish) * gdy).sum(), gx)
    _check(y, y_ref, dtype, "y")
    _check(dx, dx_ref, dtype, "dx")
    layer = fluxpy.gpu(fluxpy.GroupNorm(12, 4, swish))
    (grads,) = fluxpy.gradient(lambda m: (m(gx) * gdy).sum(), layer)
    _check(layer(gx), y_ref, dtype, "the layer's y")
    assert grads["gamma"].shape == (12,) and np.isfinite(to_host64(grads["beta"])).all()


def test_deterministic_and_captured():
    cp = cupy_module()
    rng = np.random.default_rng(5)
    x = cp.asarray(rng.standard_normal((16, 64, 16, 16)).astype(np.float32))
    dy = cp.asarray(rng.standard_normal(x.shape).astype(np.float32))
    g, b = cp.asarray(rng.standard_normal(64).astype(np.float32)), cp.asarray(rng.standard_normal(64).astype(np.float32))

    def run():
        return fluxpy.gradient(lambda x, g, b: (groupnorm(x, 8, g, b, 1e-5, gelu) * dy).sum(), x, g, b)
    first, second = run(), run()
    for a, c in zip(first, second):
        assert cp.array_equal(a, c)
    graph, out = capture_graph(run)
    x[...] = cp.asarray(rng.standard_normal(x.shape).astype(np.float32))
    graph.launch()
    cp.cuda.get_current_stream().synchronize()
    for a, c in zip(out, run()):
        assert cp.array_equal(a, c)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_instance_norm_takes_the_kernels(dtype, affine):
    cp = cupy_module()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 10, 6, 9)) * 2 - 1
    dy = rng.standard_normal(x.shape)
    gamma, beta = (rng.standard_normal(10) + 1, rng.standard_normal(10)) if affine else (None, None)
    xh = x.astype(np.float32).astype(dtype).astype(np.float64)
    dyh = dy.astype(np.float32).astype(dtype).astype(np.float64)

    def loss(w):
        return lambda x, *p: (instancenorm(x, *p) * w).sum()
    params = () if gamma is None else (gamma, beta)
    want = (np.asarray(instancenorm(xh, *params)), *fluxpy.gradient(loss(dyh), xh, *params))
    gx, gdy = half_to_device(x, dtype), half_to_device(dy, dtype)
    gparams = tuple(cp.asarray(p.astype(np.float32)) for p in params)
    assert find("groupnorm_forward", gx, *(gparams or (None, None)), 10, 1e-5, None) is not None
    got = (instancenorm(gx, *gparams), *fluxpy.gradient(loss(gdy), gx, *gparams))
    for g, w, what in zip(got, want, ("y", "dx", "dgamma", "dbeta")):
        _check(g, w, dtype, what)
