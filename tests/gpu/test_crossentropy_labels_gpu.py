"""logitcrossentropy against class indices on the GPU: the kernels ce_labels_forward / ce_labels_backward
(fluxpy/kernels/cuda_softmax.py, cuda/softmax.cu) against the CPU path in every dtype, their fallback, bad labels
without a host sync, masked logits, and a captured step."""
import ml_dtypes
import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy import kernels
from fluxpy.backend import capture_graph
from fluxpy.ops.crossentropy import logit_crossentropy_labels, logit_crossentropy_labels_backward
from sweeps import case_id, sweep

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), BF16]
# (loss, gradient) relative tolerances against the CPU path, which computes the halves in float32 too and rounds once
TOLERANCES = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 2e-5, np.dtype(np.float16): 4e-3, BF16: 2e-2}
SHAPES = [(128, 10), (7, 33), (3, 4, 5), (2, 64, 8192), (5, 1), (1, 1000)]
OPTIONS = {"plain": dict(), "smoothed": dict(label_smoothing=0.1), "weighted-ignored": dict(weight=True, ignore_index=-100),
           "all": dict(label_smoothing=0.2, weight=True, ignore_index=3),
           "smoothed-ignored": dict(label_smoothing=0.1, ignore_index=-100)}


def _problem(shape, label_type, options, seed=0):
    rng = np.random.default_rng(seed + sum(shape))
    c = shape[-1]
    logits = rng.standard_normal(shape) * 4
    labels = rng.integers(0, c, shape[:-1]).astype(label_type)
    keywords = dict(options)
    if "ignore_index" in keywords:
        labels[rng.random(shape[:-1]) < 0.25] = keywords["ignore_index"]
        labels.reshape(-1)[0] = (keywords["ignore_index"] + 1) % c   # one kept example at least
    if keywords.get("weight"):
        keywords["weight"] = rng.uniform(0.2, 2.0, c)
        keywords["weight"][rng.random(c) < 0.2] = 0.0
        keywords["weight"][labels.reshape(-1)[0]] = 1.0
    return logits, labels, keywords


def _run(xp, dtype, logits, labels, keywords, agg, cot):
    kw = dict(keywords)
    if kw.get("weight") is not None:
        kw["weight"] = xp.asarray(kw["weight"].astype(dtype))
    aggregate = {"mean": fluxpy.mean, "sum": sum, "none": lambda l: l}[agg]
    c = xp.asarray(cot.astype(dtype))
    return fluxpy.withgradient(lambda z: (fluxpy.logitcrossentropy(z, xp.asarray(labels), agg=aggregate, **kw) * c)
                               .sum(), xp.asarray(logits.astype(dtype)))


@pytest.mark.parametrize("dtype, shape, label_type, options, agg", sweep(
    DTYPES, SHAPES, [np.int32, np.int64], sorted(OPTIONS), ["mean", "sum", "none"]), ids=case_id)
def test_the_gpu_matches_the_cpu_in_every_dtype(dtype, shape, label_type, options, agg):
    cp = cupy_module()
    logits, labels, keywords = _problem(shape, label_type, OPTIONS[options])
    cot = np.random.default_rng(1).standard_normal(shape[:-1] if agg == "none" else ())
    value_cpu, (g_cpu,) = _run(np, dtype, logits, labels, keywords, agg, cot)
    value_gpu, (g_gpu,) = _run(cp, dtype, logits, labels, keywords, agg, cot)
    assert isinstance(g_gpu, cp.ndarray) and g_gpu.dtype == dtype and value_gpu.dtype == dtype
    rtol = TOLERANCES[dtype]
    g_cpu = np.asarray(g_cpu, np.float64)
    np.testing.assert_allclose(float(value_gpu), float(value_cpu), rtol=rtol, atol=rtol * 1e-2)
    np.testing.assert_allclose(cp.asnumpy(g_gpu).astype(np.float64), g_cpu, rtol=rtol,
                               atol=rtol * max(np.abs(g_cpu).max(), 1e-300))


@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("label_type", [np.int32, np.int64], ids=case_id)
def test_the_kernels_are_the_ones_found_and_other_labels_fall_back(dtype, label_type):
    cp = cupy_module()
    from fluxpy.kernels import cuda_softmax as K
    logits, labels, kw = _problem((33, 17), label_type, dict(label_smoothing=0.1, weight=True, ignore_index=2))
    x, t, w = cp.asarray(logits.astype(dtype)), cp.asarray(labels), cp.asarray(kw["weight"].astype(dtype))
    args = (t, w, 0.1, 2)
    assert kernels.find("logit_crossentropy_labels", x, *args) is K.logit_crossentropy_labels
    dl = cp.ones(33, dtype)
    assert kernels.find("logit_crossentropy_labels_backward", dl, x, *args) is K.logit_crossentropy_labels_backward
    assert kernels.find("logit_crossentropy_labels", x, t.astype(np.uint8), w, 0.1, 2) is None
    assert kernels.find("logit_crossentropy_labels", cp.asfortranarray(x), *args) is None
    fused = logit_crossentropy_labels(x, t, smoothing=0.1, weight=w, ignore_index=2)
    fallback = logit_crossentropy_labels(x, t.astype(np.uint8), smoothing=0.1, weight=w, ignore_index=2)
    rtol = TOLERANCES[np.dtype(dtype)]
    np.testing.assert_allclose(cp.asnumpy(fused).astype(np.float64), cp.asnumpy(fallback).astype(np.float64),
                               rtol=rtol, atol=rtol)
    mean_dl = cp.broadcast_to(cp.asarray(np.array(0.3, dtype)), (33,))   # stride 0, as a mean's cotangent
    d_fused = logit_crossentropy_labels_backward(mean_dl, x, t, w, 0.1, 2)
    d_fallback = logit_crossentropy_labels_backward(mean_dl, x, t.astype(np.uint8), w, 0.1, 2)
    np.testing.assert_allclose(cp.asnumpy(d_fused).astype(np.float64), cp.asnumpy(d_fallback).astype(np.float64),
                               rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_bad_labels_poison_their_rows_without_a_host_sync(dtype, alpha):
    """Under value_checks="auto" the GPU's labels are not read: a bad one makes its row NaN (loss and gradient),
    the others are the CPU's; value_checks=True reads them and raises the CPU's error."""
    cp = cupy_module()
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((6, 5)).astype(dtype)
    labels = np.array([0, -1, 5, 2, 7, 4])
    kw = dict(agg=lambda l: l, label_smoothing=alpha, ignore_index=7)
    with fluxpy.options(value_checks="auto"):
        g, = fluxpy.gradient(lambda z: fluxpy.logitcrossentropy(z, cp.asarray(labels), **kw).sum(),
                             cp.asarray(logits))
        rows = cp.asnumpy(fluxpy.logitcrossentropy(cp.asarray(logits), cp.asarray(labels), **kw))
    g = cp.asnumpy(g).astype(np.float64)
    good = [0, 3, 5]
    want = fluxpy.logitcrossentropy(logits[good], labels[good], **kw)
    rtol = TOLERANCES[np.dtype(dtype)]
    np.testing.assert_allclose(rows[good].astype(np.float64), want.astype(np.float64), rtol=rtol)
    assert np.isnan(rows[[1, 2]].astype(np.float64)).all() and rows[4] == 0
    assert np.isnan(g[[1, 2]]).all() and np.isfinite(g[good]).all() and (g[4] == 0).all()
    with fluxpy.options(value_checks=True):
        with pytest.raises(ValueError, match=r"class indices in \[0, 5\).*got values from -1 to 5"):
            fluxpy.logitcrossentropy(cp.asarray(logits), cp.asarray(labels), ignore_index=7)


@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
def test_masked_logits_add_nothing_on_the_gpu(dtype):
    """-inf logits in classes with no target mass (no smoothing, or a class weight of 0) add nothing: the kernels
    skip 0 * -inf, as the CPU path does."""
    cp = cupy_module()
    rng = np.random.default_rng(4)
    n, c = 37, 50
    labels = rng.integers(0, c, n)
    mask = rng.random((n, c)) < 0.5
    mask[np.arange(n), labels] = False
    weight = np.where(mask.any(0), 0.0, 1.0)   # with smoothing: the masked classes weigh 0
    weight[labels] = 1.0
    mask &= weight[None, :] == 0
    x = np.where(mask, -np.inf, rng.standard_normal((n, c))).astype(dtype)
    for kw in (dict(), dict(smoothing=0.1, weight=weight.astype(dtype))):
        gpu_kw = {k: cp.asarray(v) if k == "weight" else v for k, v in kw.items()}
        loss = logit_crossentropy_labels(cp.asarray(x), cp.asarray(labels), **gpu_kw)
        dx = logit_crossentropy_labels_backward(cp.ones(n, dtype), cp.asarray(x), cp.asarray(labels),
                                                gpu_kw.get("weight"), kw.get("smoothing", 0.0), None)
        want = logit_crossentropy_labels(x, labels, **kw)
        assert bool(cp.isfinite(loss).all()) and bool(cp.isfinite(dx).all())
        assert bool((dx[cp.asarray(mask)] == 0).all())
        rtol = TOLERANCES[np.dtype(dtype)]
        np.testing.assert_allclose(cp.asnumpy(loss).astype(np.float64), want.astype(np.float64), rtol=rtol)


@pytest.mark.parametrize("options", ["plain", "weighted-ignored", "all"])
def test_a_gpt_loss_and_gradient_capture_and_match_eager(options):
    """A GPT's (batch, tokens, vocabulary) logits against its next tokens: forward and backward captured in a CUDA
    graph (no host sync: the labels are not read), replayed on new logits and labels, equal to eager."""
    cp = cupy_module()
    logits, labels, kw = _problem((4, 128, 1024), np.int64, OPTIONS[options], seed=5)
    x, t = cp.asarray(logits.astype(BF16)), cp.asarray(labels)
    if kw.get("weight") is not None:
        kw["weight"] = cp.asarray(kw["weight"].astype(BF16))

    def step():
        return fluxpy.withgradient(lambda z: fluxpy.logitcrossentropy(z, t, **kw), x)
    graph, (loss, (g,)) = capture_graph(step)
    rng = np.random.default_rng(6)
    x[...] = cp.asarray((rng.standard_normal(x.shape) * 4).astype(BF16))
    fresh = rng.integers(0, 1024, labels.shape)
    if "ignore_index" in kw:
        fresh = np.where(labels == kw["ignore_index"], labels, fresh)
    t[...] = cp.asarray(fresh)
    graph.launch()
    cp.cuda.Device().synchronize()
    eager_loss, (eager_g,) = step()
    cp.testing.assert_allclose(loss.astype(np.float32), eager_loss.astype(np.float32), rtol=1e-6)
    cp.testing.assert_allclose(g.astype(np.float32), eager_g.astype(np.float32), rtol=1e-6, atol=1e-9)


def test_second_derivatives_on_the_gpu_match_the_cpu():
    """Differentiated twice, the backward runs the dense rule on the device: the Hessian-vector product is the CPU's."""
    cp = cupy_module()
    logits, labels, kw = _problem((9, 4, 7), np.int64, OPTIONS["all"], seed=7)
    v = np.random.default_rng(8).standard_normal(logits.shape)

    def hvp(xp):
        w, t, vv = xp.asarray(kw["weight"]), xp.asarray(labels), xp.asarray(v)
        f = lambda q: fluxpy.logitcrossentropy(q, t, label_smoothing=kw["label_smoothing"], weight=w,
                                               ignore_index=kw["ignore_index"])
        return fluxpy.gradient(lambda z: (fluxpy.gradient(f, z)[0] * vv).sum(), xp.asarray(logits))[0]
    np.testing.assert_allclose(cp.asnumpy(hvp(cp)), hvp(np), rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
def test_rows_of_whole_vectors_are_read_as_vectors_and_agree(dtype):
    cp = cupy_module()
    from fluxpy.kernels import cuda_softmax as K
    width = 16 // dtype.itemsize
    logits, labels, keywords = _problem((9, 40 * width), np.int64, OPTIONS["all"])
    x = cp.asarray(logits.astype(dtype))
    assert K._vec(x) and not K._vec(x[:, 1:]) and not K._vec(cp.asarray(logits[:, :-1].astype(dtype)))
    cot = np.random.default_rng(2).standard_normal(())
    value_cpu, (g_cpu,) = _run(np, dtype, logits, labels, keywords, "mean", cot)
    value_gpu, (g_gpu,) = _run(cp, dtype, logits, labels, keywords, "mean", cot)
    rtol = TOLERANCES[dtype]
    g_cpu = np.asarray(g_cpu, np.float64)
    np.testing.assert_allclose(float(value_gpu), float(value_cpu), rtol=rtol, atol=rtol * 1e-2)
    np.testing.assert_allclose(cp.asnumpy(g_gpu).astype(np.float64), g_cpu, rtol=rtol,
                               atol=rtol * max(np.abs(g_cpu).max(), 1e-300))
