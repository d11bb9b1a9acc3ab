"""Nearest upsampling by whole scales on the GPU (fluxpy.kernels.cuda_upsample) against the CPU composite: values
bit for bit, gradients within the dtype's rounding, every kernel dtype, one to three spatial axes, 4-d channels-last
(kept), broadcast and permuted cotangents, inside a CUDA graph. Needs a GPU (``gpu`` marker)."""
import numpy as np
import pytest

import fluxpy
from devices import cupy_module, half_to_device, to_host64
from fluxpy.backend import capture_graph
from fluxpy.kernels import find
from fluxpy.layout import is_channels_last, to_channels_last
from fluxpy.ops import upsample_nearest
from test_half_conv_matmul import BF16

pytestmark = pytest.mark.gpu

TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-6, np.dtype(np.float16): 2e-3, BF16: 1.6e-2}
CASES = [((2, 3, 5), (3,)), ((2, 3, 4, 5), (2, 2)), ((3, 2, 3, 4), (1, 3)), ((1, 4, 2, 3, 4), (2, 1, 2)),
         ((4, 16, 8, 8), (2, 2))]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("shape,scales", CASES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_the_kernels_equal_the_composite(dtype, shape, scales, layout):
    if layout == "channels_last" and len(shape) != 4:
        pytest.skip("channels-last is 4-d")
    rng = np.random.default_rng(len(shape) * 10 + sum(scales))
    x = rng.standard_normal(shape)
    out = tuple(shape[:2]) + tuple(n * s for n, s in zip(shape[2:], scales))
    w = rng.standard_normal(out)
    xh = to_host64(half_to_device(x, dtype))
    wh = to_host64(half_to_device(w, dtype))
    want_y = upsample_nearest(xh, scales)
    want_g, = fluxpy.gradient(lambda x: (upsample_nearest(x, scales) * wh).sum(), xh)
    gx, gw = half_to_device(x, dtype), half_to_device(w, dtype)
    if layout == "channels_last":
        gx = to_channels_last(gx)
    assert find("upsample_nearest", gx, scales) is not None
    y = upsample_nearest(gx, scales)
    assert y.shape == out and y.dtype == gx.dtype and is_channels_last(y) == (layout == "channels_last")
    np.testing.assert_array_equal(to_host64(y), want_y)
    g, = fluxpy.gradient(lambda x: (upsample_nearest(x, scales) * gw).sum(), gx)
    assert g.dtype == gx.dtype and g.shape == gx.shape
    err = np.abs(to_host64(g) - want_g).max()
    assert err <= TOL[np.dtype(dtype)] * (np.abs(want_g).max() + 1), err


def test_a_broadcast_cotangent_and_the_layer():
    cp = cupy_module()
    x = cp.asarray(np.random.default_rng(1).standard_normal((2, 3, 4, 4)).astype(np.float32))
    g, = fluxpy.gradient(lambda x: upsample_nearest(x, 2).sum(), x)   # dy: a broadcast of one value
    cp.testing.assert_array_equal(g, cp.full(x.shape, 4.0, cp.float32))
    layer = fluxpy.Upsample(3)
    g, = fluxpy.gradient(lambda x: (layer(x) ** 2).sum(), x)
    cp.testing.assert_allclose(g, 18 * x, rtol=1e-6)


def test_captured():
    cp = cupy_module()
    rng = np.random.default_rng(2)
    x = cp.asarray(rng.standard_normal((8, 16, 8, 8)).astype(np.float32))
    w = cp.asarray(rng.standard_normal((8, 16, 16, 16)).astype(np.float32))

    def run():
        return fluxpy.gradient(lambda x: (upsample_nearest(x, 2) ** 2 * w).sum(), x)[0]
    graph, out = capture_graph(run)
    x[...] = cp.asarray(rng.standard_normal(x.shape).astype(np.float32))
    graph.launch()
    cp.cuda.get_current_stream().synchronize()
    cp.testing.assert_array_equal(out, run())
