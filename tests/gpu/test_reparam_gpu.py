"""WeightNorm and SpectralNorm on the GPU against the CPU: outputs, gradients and SpectralNorm's in-place power
iteration, float64 and float32."""
import copy

import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module
from fluxpy import Conv, ConvTranspose, Dense, SpectralNorm, WeightNorm

pytestmark = pytest.mark.gpu

MODELS = {
    "weightnorm_dense": lambda: WeightNorm(Dense(5, 3, fluxpy.tanh, rng=0)),
    "weightnorm_conv": lambda: WeightNorm(Conv((3, 3), 2, 4, pad=1, rng=1), dims=(0, 2, 3)),
    "spectralnorm_conv": lambda: SpectralNorm(Conv((3, 3), 2, 4, pad=1, rng=2), n_power_iterations=2, rng=3),
    "spectralnorm_convtranspose": lambda: SpectralNorm(ConvTranspose((2, 2), 2, 3, stride=2, rng=4), rng=5),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=str)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_reparametrised_layers_on_the_gpu_match_the_cpu(name, dtype):
    cp = cupy_module()
    convert = fluxpy.f64 if dtype == np.float64 else fluxpy.f32
    cpu_model = convert(MODELS[name]())
    gpu_model = fluxpy.gpu(copy.deepcopy(cpu_model))
    x = np.random.default_rng(0).standard_normal((2, 5) if "dense" in name else (2, 2, 5, 5)).astype(dtype)
    y_cpu, (g_cpu,) = fluxpy.withgradient(lambda m: (m(x) ** 2).sum(), cpu_model)
    y_gpu, (g_gpu,) = fluxpy.withgradient(lambda m: (m(cp.asarray(x)) ** 2).sum(), gpu_model)
    tol = 1e-10 if dtype == np.float64 else 2e-4
    np.testing.assert_allclose(float(y_gpu), float(y_cpu), rtol=tol)
    assert_matches_cpu(g_gpu["layer"]["weight"], g_cpu["layer"]["weight"], rtol=tol, atol=tol)
    if "spectral" in name:
        assert_matches_cpu(gpu_model.u, cpu_model.u, rtol=tol, atol=tol)
