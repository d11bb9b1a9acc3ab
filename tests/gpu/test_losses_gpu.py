"""The classifier loss kernels (fluxpy/kernels/cuda_softmax.py) against the CPU path."""
import numpy as np
import pytest

import fluxpy
from fluxpy.ops.softmax import logit_crossentropy_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("n,c", [(1, 1), (5, 10), (128, 10), (7, 33), (3, 1000)])
@pytest.mark.parametrize("agg", ["mean", "weighted"])
def test_logitcrossentropy_on_the_gpu_matches_the_cpu(dtype, rtol, n, c, agg):
    import cupy as cp
    rng = np.random.default_rng(n * 1000 + c)
    yhat = (rng.standard_normal((n, c)) * 4).astype(dtype)
    y = rng.random((n, c)).astype(dtype)
    w = rng.random(n).astype(dtype)

    def run(xp):   # "weighted": a contiguous cotangent for the rows; "mean": a broadcast (stride 0) one
        wv = xp.asarray(w)
        aggregate = fluxpy.mean if agg == "mean" else (lambda rows: (rows * wv).sum())
        return fluxpy.withgradient(lambda a, b: fluxpy.logitcrossentropy(a, b, agg=aggregate),
                                   xp.asarray(yhat), xp.asarray(y))
    value_cpu, grads_cpu = run(np)
    value_gpu, grads_gpu = run(cp)
    np.testing.assert_allclose(float(value_gpu), float(value_cpu), rtol=rtol, atol=rtol * 1e-3)  # C=1: exactly 0
    for a, b in zip(grads_gpu, grads_cpu):
        np.testing.assert_allclose(cp.asnumpy(a), b, rtol=rtol, atol=rtol * 1e-2)


def test_the_kernels_run_and_non_contiguous_inputs_fall_back():
    import cupy as cp
    from fluxpy import kernels
    from fluxpy.kernels import cuda_softmax as K
    from fluxpy.ops.softmax import logit_crossentropy_rows_backward
    rng = np.random.default_rng(0)
    yhat = cp.asarray(rng.standard_normal((6, 4)).astype(np.float32))
    y = cp.asarray(np.eye(4, dtype=np.float32)[rng.integers(0, 4, 6)])
    assert kernels.find("logit_crossentropy_rows", yhat, y) is K.logit_crossentropy_rows
    assert kernels.find("logit_crossentropy_rows", cp.asfortranarray(yhat), y) is None   # the composite runs
    fused = logit_crossentropy_rows(yhat, y)
    generic = logit_crossentropy_rows(cp.asfortranarray(yhat), y)
    np.testing.assert_allclose(cp.asnumpy(fused), cp.asnumpy(generic), rtol=1e-6)
    np.testing.assert_allclose(cp.asnumpy(fused), logit_crossentropy_rows(cp.asnumpy(yhat), cp.asnumpy(y)),
                               rtol=1e-6)
    dl = cp.asarray(rng.standard_normal(6).astype(np.float32))
    np.testing.assert_allclose(cp.asnumpy(logit_crossentropy_rows_backward(dl, yhat, y)),
                               cp.asnumpy(logit_crossentropy_rows_backward(dl, cp.asfortranarray(yhat), y)),
                               rtol=1e-5, atol=1e-7)
