"""The GPU backend's registration: every CUDA kernel goes through the one table, and unregister()
puts the table back exactly as it was."""
import numpy as np
import pytest

import fluxpy
from fluxpy import kernels

pytestmark = pytest.mark.gpu


def test_unregister_restores_exactly_the_previous_table():
    import cupy as cp
    from fluxpy.kernels import gpu
    gpu.unregister()
    before = kernels.snapshot()
    assert not [k for k in before if k[1] == "cupy"], "no CuPy kernels once unregistered"
    try:
        assert gpu.register()
        during = kernels.snapshot()
        for module in gpu._modules():
            for name in module.KERNELS:
                assert (name, "cupy") in during, name
        x = cp.ones((4, 3), dtype=cp.float32)
        assert kernels.find("sum", x) is not None
        assert kernels.lookup("conv_forward", x).__module__.startswith("fluxpy.kernels")
        gpu.unregister()
        assert kernels.snapshot() == before
        assert kernels.find("sum", x) is None
    finally:
        gpu.register()


def test_ops_run_without_the_gpu_kernels_and_agree_with_them():
    """With the CUDA kernels unregistered the composites run on CuPy arrays, with the same results."""
    import cupy as cp
    from fluxpy.kernels import gpu
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((8, 5)))
    b = cp.asarray(rng.standard_normal(5))

    def loss(x, b):
        y = fluxpy.bias_act(x, b, fluxpy.relu) + fluxpy.broadcast(lambda u: np.tanh(u) * u, x)
        return y.sum() + fluxpy.unbroadcast(y, (1, 5)).sum()

    with_kernels = fluxpy.gradient(loss, x, b)
    gpu.unregister()
    try:
        without = fluxpy.gradient(loss, x, b)
    finally:
        gpu.register()
    for a, c in zip(with_kernels, without):
        np.testing.assert_allclose(cp.asnumpy(a), cp.asnumpy(c), rtol=1e-12, atol=1e-12)
