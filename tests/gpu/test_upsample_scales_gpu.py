"""Upsampling by non-integer scales and the 1-d linear mode on the GPU against the CPU, values and gradients."""
import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module

pytestmark = pytest.mark.gpu

CASES = [("nearest", True, (1.5,)), ("nearest", True, (1.5, 2.5)), ("linear", True, (1.7,)),
         ("bilinear", False, (1.5, 0.75)), ("trilinear", True, (1.3, 2, 2.5)), ("linear", False, (2,))]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=str)
@pytest.mark.parametrize("mode, align_corners, scale", CASES, ids=str)
def test_upsample_scales_on_the_gpu_match_the_cpu(mode, align_corners, scale, dtype):
    cp = cupy_module()
    up = fluxpy.Upsample(scale if len(scale) > 1 else scale[0], mode=mode, align_corners=align_corners)
    x = np.random.default_rng(0).standard_normal((2, 3) + (5, 4, 3)[:len(scale)]).astype(dtype)

    def loss(z):
        return (up(z) ** 2).sum()
    (y_cpu, (g_cpu,)), (y_gpu, (g_gpu,)) = (fluxpy.withgradient(loss, a) for a in (x, cp.asarray(x)))
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(float(y_gpu), float(y_cpu), rtol=tol)
    assert_matches_cpu(g_gpu, g_cpu, rtol=tol, atol=tol)
