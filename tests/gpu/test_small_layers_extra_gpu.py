"""hardshrink, softmin, glu, PReLU, RMSNorm and PixelUnshuffle on CuPy against the CPU: values and gradients in
float32 and float64 (RMSNorm in float16 too). The layers' captured steps are in tests/gpu/test_capture_contract_gpu.py.

Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere). Run:
``python -m pytest -q tests/gpu/test_small_layers_extra_gpu.py -p no:cacheprovider``.
"""
import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module, grad_leaves
from fluxpy import PixelUnshuffle, PReLU, RMSNorm
from fluxpy.ops import glu, hardshrink, softmin

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore::fluxpy.kernels.elementwise.FusionFallbackWarning")]

TOL = {np.float64: 1e-12, np.float32: 1e-5}

OPS = {"hardshrink": lambda x: hardshrink(x, lam=0.3), "softmin": lambda x: softmin(x, 1),
       "glu": lambda x: glu(x, 1), "glu_last": glu}


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("dtype", list(TOL), ids=lambda d: np.dtype(d).name)
def test_ops_match_the_cpu(name, dtype):
    cp = cupy_module()
    f = OPS[name]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 6, 8)) * 2).astype(dtype)
    dy = rng.standard_normal(f(x).shape).astype(dtype)
    assert_matches_cpu(f(cp.asarray(x)), f(x), rtol=TOL[dtype], atol=TOL[dtype])
    g, = fluxpy.gradient(lambda x: (f(x) * cp.asarray(dy)).sum(), cp.asarray(x))
    want, = fluxpy.gradient(lambda x: (f(x) * dy).sum(), x)
    assert_matches_cpu(g, want, rtol=TOL[dtype], atol=TOL[dtype])


LAYERS = {"PReLU": (lambda: PReLU(6, init=0.1), (4, 6, 5, 5)), "PReLU_shared": (lambda: PReLU(), (4, 6, 5)),
          "RMSNorm": (lambda: RMSNorm(5), (4, 6, 5)), "PixelUnshuffle": (lambda: PixelUnshuffle(2), (2, 3, 4, 6))}


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("dtype", list(TOL), ids=lambda d: np.dtype(d).name)
def test_layers_match_the_cpu(name, dtype):
    cp = cupy_module()
    make, shape = LAYERS[name]
    layer = make() if dtype == np.float32 else fluxpy.f64(make())
    rng = np.random.default_rng(1)
    for a in fluxpy.trainables(layer):
        a[...] = rng.standard_normal(a.shape)
    x = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(layer(x).shape).astype(dtype)
    on_gpu = fluxpy.gpu(layer)
    assert_matches_cpu(on_gpu(cp.asarray(x)), layer(x), rtol=TOL[dtype], atol=TOL[dtype])
    got = fluxpy.gradient(lambda m, x: (m(x) * cp.asarray(dy)).sum(), on_gpu, cp.asarray(x))
    want = fluxpy.gradient(lambda m, x: (m(x) * dy).sum(), layer, x)
    for g, w in zip(grad_leaves(got), grad_leaves(want)):
        assert_matches_cpu(g, w, rtol=TOL[dtype], atol=TOL[dtype])


def test_rmsnorm_in_float16_matches_the_cpu():
    cp = cupy_module()
    x = (np.random.default_rng(2).standard_normal((4, 8)) * 300).astype(np.float16)
    y = RMSNorm(8)
    got = fluxpy.gpu(y)(cp.asarray(x))
    assert got.dtype == np.float16
    assert_matches_cpu(got, y(x).astype(np.float32), rtol=2e-3, atol=2e-3)
