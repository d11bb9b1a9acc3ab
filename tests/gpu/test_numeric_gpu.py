"""fluxpy.ops.numeric on the GPU against the CPU: values and gradients in float32 and float64."""
import numpy as np
import pytest

import fluxpy
from fluxpy import ops

pytestmark = pytest.mark.gpu

CASES = {"tan": lambda x: ops.tan(x), "arcsin": lambda x: ops.arcsin(0.5 * x), "arctan": ops.arctan,
         "sinh": ops.sinh, "arctanh": lambda x: ops.arctanh(0.5 * x), "var": lambda x: ops.var(x, 1, correction=1),
         "std": lambda x: ops.std(x, 0), "prod": lambda x: ops.prod(x, 1), "cumsum": lambda x: ops.cumsum(x, 0),
         "flip": lambda x: ops.flip(x, 1), "triu": lambda x: ops.triu(x, 1), "pad": lambda x: ops.pad(x, 1, 2.0),
         "sort": lambda x: ops.sort(x, 1)}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_numeric_ops_on_the_gpu_match_the_cpu(name, dtype):
    import cupy as cp
    x = np.random.default_rng(3).uniform(-1, 1, (5, 7)).astype(dtype)
    f = CASES[name]
    (y_cpu, (g_cpu,)), (y_gpu, (g_gpu,)) = (fluxpy.withgradient(lambda z: (f(z) ** 2).sum(), a)
                                            for a in (x, cp.asarray(x)))
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(float(y_gpu), float(y_cpu), rtol=tol)
    np.testing.assert_allclose(cp.asnumpy(g_gpu), g_cpu, rtol=tol, atol=tol)
