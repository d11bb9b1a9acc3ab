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


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("shape", [(128, 10), (7, 33), (3, 4, 5)])
@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_class_indices_on_the_gpu_match_the_cpu(dtype, rtol, shape, alpha):
    import cupy as cp
    rng = np.random.default_rng(sum(shape))
    yhat = (rng.standard_normal(shape) * 4).astype(dtype)
    labels = rng.integers(0, shape[-1], shape[:-1])

    def run(xp):
        return fluxpy.withgradient(lambda a: fluxpy.logitcrossentropy(a, xp.asarray(labels), label_smoothing=alpha),
                                   xp.asarray(yhat))
    value_cpu, (g_cpu,) = run(np)
    value_gpu, (g_gpu,) = run(cp)
    assert isinstance(g_gpu, cp.ndarray) and g_gpu.dtype == dtype
    np.testing.assert_allclose(float(value_gpu), float(value_cpu), rtol=rtol)
    np.testing.assert_allclose(cp.asnumpy(g_gpu), g_cpu, rtol=rtol, atol=rtol * 1e-2)


def test_class_indices_on_the_gpu_use_the_fused_kernel():
    import cupy as cp
    from fluxpy import kernels
    from fluxpy.kernels import cuda_softmax as K
    yhat, labels = cp.zeros((4, 3), np.float32), cp.asarray([0, 1, 2, 0])
    assert kernels.find("logit_crossentropy_labels", yhat, labels, None, 0.0, None) is K.logit_crossentropy_labels


def test_value_checks_on_the_gpu_follow_the_policy():
    import cupy as cp
    from fluxpy import losses as L
    logits, y = cp.asarray([[2.0, -1.0]]), cp.asarray([[1.0, 0.0]])
    labels = cp.asarray([0, 3, -1])
    with fluxpy.options(value_checks="auto"):
        assert not L._values_checked(logits)
        L.crossentropy(logits, y)   # "auto": values on the GPU are not read (no host sync)
        rows = cp.asnumpy(fluxpy.logitcrossentropy(cp.zeros((3, 3)), labels, agg=lambda l: l))
        assert np.isfinite(rows[0]) and np.isnan(rows[1:]).all()   # bad class indices poison their rows
    with fluxpy.options(value_checks=True):
        with pytest.raises(ValueError, match="crossentropy expects ŷ in"):
            L.crossentropy(logits, y)
        with pytest.raises(ValueError, match=r"class indices in \[0, 3\).*got values from -1 to 3"):
            fluxpy.logitcrossentropy(cp.zeros((3, 3)), labels)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"], ids=str)
def test_masked_logits_on_the_gpu_match_the_cpu(dtype):
    """-inf logits in classes with no target mass add nothing to the loss (the kernel skips 0 * -inf)."""
    import cupy as cp
    import ml_dtypes
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(4)
    n, c = 37, 50
    labels = rng.integers(0, c, n)
    mask = rng.random((n, c)) < 0.5
    mask[np.arange(n), labels] = False
    x = np.where(mask, -np.inf, rng.standard_normal((n, c))).astype(dtype)
    y = np.eye(c, dtype=dtype)[labels]
    loss = logit_crossentropy_rows(cp.asarray(x), cp.asarray(y))
    expected = logit_crossentropy_rows(x.astype(np.float32), y.astype(np.float32))
    assert bool(cp.isfinite(loss).all())
    np.testing.assert_allclose(cp.asnumpy(loss).astype(np.float32), expected, rtol=1e-2 if dtype.itemsize == 2 else 1e-5)


def test_class_weights_and_ignore_index_on_the_gpu_match_the_cpu():
    import cupy as cp
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((33, 7)).astype(np.float32)
    labels = rng.integers(0, 7, 33)
    labels[::4] = -100
    weight = rng.uniform(0.5, 2.0, 7).astype(np.float32)

    def run(xp):
        return fluxpy.withgradient(lambda z: fluxpy.logitcrossentropy(z, xp.asarray(labels), weight=xp.asarray(weight),
                                                                      ignore_index=-100, label_smoothing=0.1),
                                   xp.asarray(logits))
    (l_gpu, (g_gpu,)), (l_cpu, (g_cpu,)) = run(cp), run(np)
    np.testing.assert_allclose(float(l_gpu), float(l_cpu), rtol=2e-5)
    np.testing.assert_allclose(cp.asnumpy(g_gpu), g_cpu, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_binary_cross_entropies_with_weight_and_pos_weight_on_the_gpu_match_the_cpu(dtype, rtol):
    import cupy as cp
    rng = np.random.default_rng(7)
    z = (rng.standard_normal((6, 4)) * 3).astype(dtype)
    y = rng.integers(0, 2, (6, 4)).astype(dtype)
    w, p = rng.uniform(0.2, 2.0, (6, 1)).astype(dtype), rng.uniform(0.5, 3.0, 4).astype(dtype)

    def run(xp):   # the weights given as host arrays either way: moved to ŷ's device
        return fluxpy.withgradient(lambda a: fluxpy.logitbinarycrossentropy(a, xp.asarray(y), weight=w, pos_weight=p)
                                   + fluxpy.binarycrossentropy(fluxpy.sigmoid(a), xp.asarray(y), weight=w),
                                   xp.asarray(z))
    value_cpu, (g_cpu,) = run(np)
    value_gpu, (g_gpu,) = run(cp)
    np.testing.assert_allclose(float(value_gpu), float(value_cpu), rtol=rtol)
    np.testing.assert_allclose(cp.asnumpy(g_gpu), g_cpu, rtol=rtol, atol=rtol * 1e-2)
