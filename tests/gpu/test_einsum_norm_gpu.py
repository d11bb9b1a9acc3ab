"""fluxpy.ops.einsum, fluxpy.ops.linalg.norm and svdvals on the GPU against the CPU: values and gradients in float32
and float64."""
import numpy as np
import pytest

import fluxpy
from fluxpy import ops
from fluxpy.ops.linalg import norm

pytestmark = pytest.mark.gpu

CASES = {
    "matmul": ("ij,jk->ik", [(5, 7), (7, 3)]), "batched": ("...ij,...jk", [(1, 5, 7), (4, 7, 3)]),
    "trace": ("ii", [(5, 5)]), "diagonal": ("iij,jk->ki", [(4, 4, 3), (3, 2)]), "outer": ("i,j", [(5,), (7,)]),
    "three": ("ab,bc,cd->ad", [(2, 3), (3, 4), (4, 5)]), "implicit": ("Ba,aC", [(3, 4), (4, 2)]),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_einsum_on_the_gpu_matches_the_cpu(name, dtype):
    import cupy as cp
    subscripts, shapes = CASES[name]
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(s).astype(dtype) for s in shapes]

    def loss(*a):
        return (ops.einsum(subscripts, *a) ** 2).sum()
    y_cpu, g_cpu = fluxpy.withgradient(loss, *xs)
    y_gpu, g_gpu = fluxpy.withgradient(loss, *[cp.asarray(x) for x in xs])
    tol = 1e-12 if dtype == np.float64 else 2e-4
    np.testing.assert_allclose(float(y_gpu), float(y_cpu), rtol=tol)
    for a, b in zip(g_gpu, g_cpu):
        np.testing.assert_allclose(cp.asnumpy(a), b, rtol=tol, atol=tol)


NORMS = [(None, 1), (1, 0), (np.inf, 1), (-np.inf, 0), (0.5, 1), (3, 1), (0, 1), ("fro", (0, 1)), ("nuc", (1, 2)),
         (2, (1, 2)), (-2, (0, 2)), (1, (0, 1)), (-np.inf, (2, 1))]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=str)
@pytest.mark.parametrize("ord, axis", NORMS, ids=str)
def test_norm_on_the_gpu_matches_the_cpu(ord, axis, dtype):
    import cupy as cp
    x = np.random.default_rng(6).uniform(-1, 1, (3, 5, 4)).astype(dtype)
    if not (isinstance(axis, tuple) and ord in ("nuc", 2, -2)):   # an SVD's basis of a zero matrix is arbitrary
        x[0] = 0   # the norm's subgradient at 0
    (y_cpu, (g_cpu,)), (y_gpu, (g_gpu,)) = (fluxpy.withgradient(lambda z: (norm(z, ord, axis) ** 2).sum(), a)
                                            for a in (x, cp.asarray(x)))
    tol = 1e-10 if dtype == np.float64 else 2e-4
    np.testing.assert_allclose(float(y_gpu), float(y_cpu), rtol=tol)
    np.testing.assert_allclose(cp.asnumpy(g_gpu), g_cpu, rtol=tol, atol=tol)
    assert np.isfinite(cp.asnumpy(g_gpu)).all()
