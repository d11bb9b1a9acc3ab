"""MeanPool(..., count_include_pad=False) on the GPU against the CPU: values and gradients, 1 to 3 spatial axes."""
import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=str)
@pytest.mark.parametrize("kernel, pad", [((3,), 1), ((3, 3), (1, 1, 0, 1)), ((3, 2, 3), 1)], ids=str)
def test_meanpool_exclude_pad_on_the_gpu_matches_the_cpu(kernel, pad, dtype):
    cp = cupy_module()
    pool = fluxpy.MeanPool(kernel, stride=1, pad=pad, count_include_pad=False)
    x = np.random.default_rng(0).standard_normal((2, 3) + (6, 5, 4)[:len(kernel)]).astype(dtype)

    def loss(z):
        return (pool(z) ** 2).sum()
    (y_cpu, (g_cpu,)), (y_gpu, (g_gpu,)) = (fluxpy.withgradient(loss, a) for a in (x, cp.asarray(x)))
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(float(y_gpu), float(y_cpu), rtol=tol)
    assert_matches_cpu(g_gpu, g_cpu, rtol=tol, atol=tol)
