"""RMSNorm on the GPU (fluxpy.kernels.cuda_rmsnorm) against the CPU composite in float64: the output and the
gradients of x and gamma, every dtype, one and two normalised axes, rows of 1 to 5,000 values, without the affine, a
broadcast cotangent, determinism, inside a CUDA graph. Needs a GPU (``gpu`` marker)."""
import numpy as np
import pytest

import fluxpy
from devices import cupy_module, half_to_device, to_host64
from fluxpy.backend import capture_graph
from fluxpy.kernels import find
from test_half_conv_matmul import BF16

pytestmark = pytest.mark.gpu

TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 2e-5, np.dtype(np.float16): 4e-3, BF16: 3e-2}
CASES = [((4, 7), 1), ((3, 5, 768), 1), ((2, 4, 6), 2), ((1, 5000), 1), ((9, 1), 1), ((300, 64), 1)]


def _check(got, want, dtype, what):
    err = np.abs(to_host64(got) - want).max()
    bound = TOL[np.dtype(dtype)] * (np.abs(want).max() + 1)
    assert err <= bound, f"{what}: max error {err:.3g} above {bound:.3g}"


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("shape,k", CASES, ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_the_kernels_equal_the_composite(dtype, shape, k, affine):
    rng = np.random.default_rng(sum(shape) + k)
    x, w = rng.standard_normal(shape) * 3, rng.standard_normal(shape)
    norm_shape = shape[len(shape) - k:]
    layer = fluxpy.RMSNorm(norm_shape, eps=1e-5, affine=affine)
    pdt = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    if affine:
        layer.gamma = (rng.standard_normal(norm_shape) + 1).astype(pdt)
    host = fluxpy.f64(layer)
    xh, wh = to_host64(half_to_device(x, dtype)), to_host64(half_to_device(w, dtype))
    want_y = np.asarray(host(xh))
    want = fluxpy.gradient(lambda m, x: (m(x) * wh).sum(), host, xh)
    gl = fluxpy.gpu(layer)
    gx, gw = half_to_device(x, dtype), half_to_device(w, dtype)
    assert find("rmsnorm_forward", gx, gl.gamma, k, 1e-5) is not None
    y = gl(gx)
    assert y.dtype == gx.dtype and y.shape == gx.shape
    _check(y, want_y, dtype, "y")
    got = fluxpy.gradient(lambda m, x: (m(x) * gw).sum(), gl, gx)
    _check(got[1], want[1], dtype, "dx")
    if affine:
        assert got[0]["gamma"].dtype == pdt
        _check(got[0]["gamma"], want[0]["gamma"], dtype, "dgamma")
    else:
        assert got[0] is None or got[0].get("gamma") is None


def test_a_broadcast_cotangent_deterministic_and_captured():
    cp = cupy_module()
    rng = np.random.default_rng(4)
    layer = fluxpy.gpu(fluxpy.RMSNorm(512))
    layer.gamma = cp.asarray(rng.standard_normal(512).astype(np.float32))
    x = cp.asarray(rng.standard_normal((64, 512)).astype(np.float32))
    g, = fluxpy.gradient(lambda x: layer(x).sum(), x)   # dy: one value broadcast
    assert g.shape == x.shape and bool(cp.isfinite(g).all())

    def run():
        return fluxpy.gradient(lambda m, x: (m(x) ** 2).sum(), layer, x)
    first, second = run(), run()
    assert cp.array_equal(first[0]["gamma"], second[0]["gamma"]) and cp.array_equal(first[1], second[1])
    graph, out = capture_graph(run)
    x[...] = cp.asarray(rng.standard_normal(x.shape).astype(np.float32))
    graph.launch()
    cp.cuda.get_current_stream().synchronize()
    again = run()
    assert cp.array_equal(out[0]["gamma"], again[0]["gamma"]) and cp.array_equal(out[1], again[1])
