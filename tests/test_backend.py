"""Backend selection and moving trees between devices."""
import numpy as np
import pytest

import fluxpy
from fluxpy import GPUUnavailableError, cpu, get_array_module, gpu, gpu_available


def test_numpy_is_the_default_module():
    assert get_array_module(np.ones(2), 1.0, None) is np
    assert get_array_module() is np


def test_gpu_raises_a_reason_without_a_gpu():
    ok, why = gpu_available()
    if ok:
        pytest.skip("a GPU is present")
    with pytest.raises(GPUUnavailableError, match="no usable GPU: .+"):
        gpu(np.ones(2))


def test_cpu_is_identity_for_numpy_trees():
    tree = {"w": np.ones(2), "n": 3}
    out = cpu(tree)
    assert out["n"] == 3 and isinstance(out["w"], np.ndarray)


@pytest.mark.gpu
def test_gpu_round_trip_and_mixing_error():
    import cupy
    tree = {"w": np.arange(3.0), "act": np.tanh}
    g = gpu(tree)
    assert isinstance(g["w"], cupy.ndarray) and g["act"] is np.tanh
    np.testing.assert_array_equal(cpu(g)["w"], tree["w"])
    with pytest.raises(TypeError, match="cannot mix CPU"):
        get_array_module(np.ones(2), cupy.ones(2))


@pytest.mark.gpu
def test_gradient_on_gpu_matches_cpu():
    x = np.random.default_rng(0).standard_normal((4, 3))
    b = np.random.default_rng(1).standard_normal(3)
    f = lambda x, b: (np.tanh(x * b + 1.0) ** 2).sum() + (x @ b).sum()  # noqa: E731
    gc = fluxpy.gradient(f, x, b)
    gg = fluxpy.gradient(f, *gpu((x, b)))
    for a, c in zip(gc, gg):
        np.testing.assert_allclose(cpu(c), a, rtol=1e-12)
