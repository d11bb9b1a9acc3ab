"""fluxpy.ops.padding and Conv's padding_mode on the GPU against the CPU: values and gradients in float32 and
float64."""
import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module
from fluxpy.ops import padding

pytestmark = pytest.mark.gpu

PADS = {"pad_reflect": (1, 2, 2, 1), "pad_repeat": 3, "pad_circular": (2, 0, 1, 3), "pad_symmetric": 2,
        "pad_zeros": (1, 2)}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=str)
@pytest.mark.parametrize("name", sorted(PADS))
def test_padding_on_the_gpu_matches_the_cpu(name, dtype):
    cp = cupy_module()
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 5)).astype(dtype)
    fn = getattr(padding, name)

    def loss(z):
        return (fn(z, PADS[name], dims=(2, 3)) ** 2).sum()
    (y_cpu, (g_cpu,)), (y_gpu, (g_gpu,)) = (fluxpy.withgradient(loss, a) for a in (x, cp.asarray(x)))
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(float(y_gpu), float(y_cpu), rtol=tol)
    assert_matches_cpu(g_gpu, g_cpu, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("kernel", [(3,), (3, 3), (3, 3, 3)], ids=str)
def test_conv_padding_modes_on_the_gpu_match_the_cpu(mode, kernel):
    cp = cupy_module()
    n = len(kernel)
    layer = fluxpy.f64(fluxpy.CrossCor(kernel, 2, 3, fluxpy.relu, pad=1, padding_mode=mode, rng=0))
    x = np.random.default_rng(2).standard_normal((2, 2) + (5,) * n)
    (y_cpu, (g_cpu,)) = fluxpy.withgradient(lambda m: (m(x) ** 2).sum(), layer)
    on_gpu = fluxpy.gpu(layer)
    (y_gpu, (g_gpu,)) = fluxpy.withgradient(lambda m: (m(cp.asarray(x)) ** 2).sum(), on_gpu)
    np.testing.assert_allclose(float(y_gpu), float(y_cpu), rtol=1e-10)
    assert_matches_cpu(g_gpu["weight"], g_cpu["weight"], rtol=1e-10, atol=1e-12)
