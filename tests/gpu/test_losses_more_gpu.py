"""The losses of fluxpy.losses_more on CuPy arrays against the same calls on NumPy arrays: values and gradients,
float64 and float32 (ctc_loss's recursions run on the device, its gradient through the kernel table's matmul)."""
import numpy as np
import pytest

import fluxpy
from fluxpy import losses as L

pytestmark = pytest.mark.gpu

TOL = {np.float64: 1e-11, np.float32: 2e-5}


def _log_softmax(z, axis=-1):
    z = z - z.max(axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis, keepdims=True))


def _cases(rng, dtype):
    """``(name, loss of the float arrays, float arrays)``, every other argument bound (host values)."""
    x1, x2, x3 = (rng.standard_normal((6, 5)).astype(dtype) for _ in range(3))
    labels, pm = rng.integers(0, 5, 6), rng.choice([-1, 1], 6)
    var = rng.uniform(0.1, 2.0, (6,)).astype(dtype)
    lp = _log_softmax(rng.standard_normal((9, 3, 5))).astype(dtype)
    targets, inputs, lengths = np.array([[1, 2, 2], [4, 3, 0], [2, 0, 0]]), np.array([9, 7, 5]), np.array([3, 2, 1])
    w = rng.uniform(0.5, 1.5, 5)
    return [
        ("smooth_l1_loss", lambda a, b: L.smooth_l1_loss(a, b, beta=0.5), (x1, x2)),
        ("gaussian_nll_loss", lambda a, b, v: L.gaussian_nll_loss(a, b, v, full=True), (x1, x2, var)),
        ("nll_loss", lambda a, xp: L.nll_loss(a, xp.asarray(labels), weight=xp.asarray(w), ignore_index=3),
         (_log_softmax(x1),)),
        ("margin_ranking_loss", lambda a, b, xp: L.margin_ranking_loss(a, b, xp.asarray(pm.repeat(5).reshape(6, 5)),
                                                                       margin=0.2), (x1, x2)),
        ("triplet_margin_loss", lambda a, b, c: L.triplet_margin_loss(a, b, c, swap=True), (x1, x2, x3)),
        ("triplet_margin_loss p=3", lambda a, b, c: L.triplet_margin_loss(a, b, c, p=3), (x1, x2, x3)),
        ("cosine_embedding_loss", lambda a, b, xp: L.cosine_embedding_loss(a, b, xp.asarray(pm), margin=0.1),
         (x1, x2)),
        ("ctc_loss", lambda a, xp: L.ctc_loss(a, xp.asarray(targets), xp.asarray(inputs), xp.asarray(lengths),
                                              blank=0), (lp,)),
        ("ctc_loss host lengths", lambda a, xp: L.ctc_loss(a, xp.asarray(targets), inputs, lengths, agg=sum),
         (lp,)),
        ("ctc_loss concatenated", lambda a, xp: L.ctc_loss(a, xp.asarray(np.array([1, 2, 2, 4, 3, 2])), inputs,
                                                           lengths, zero_infinity=True), (lp,)),
    ]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("index", range(10))
def test_each_loss_on_the_gpu_matches_the_cpu(dtype, index):
    import cupy as cp
    name, loss, arrays = _cases(np.random.default_rng(index), dtype)[index]
    takes_xp = "xp" in loss.__code__.co_varnames

    def run(xp):
        args = [xp.asarray(a) for a in arrays]
        f = (lambda *a: loss(*a, xp)) if takes_xp else loss
        return fluxpy.withgradient(f, *args)
    value_cpu, grads_cpu = run(np)
    value_gpu, grads_gpu = run(cp)
    tol = TOL[dtype]
    assert isinstance(value_gpu, cp.ndarray), name
    np.testing.assert_allclose(float(value_gpu), float(value_cpu), rtol=tol, err_msg=name)
    for g_gpu, g_cpu in zip(grads_gpu, grads_cpu):
        assert isinstance(g_gpu, cp.ndarray) and g_gpu.dtype == g_cpu.dtype, name
        np.testing.assert_allclose(cp.asnumpy(g_gpu), g_cpu, rtol=tol, atol=tol, err_msg=name)


def test_unchecked_bad_labels_on_the_gpu_poison_their_rows_without_a_host_sync():
    import cupy as cp
    lp = cp.asarray(_log_softmax(np.zeros((4, 2, 3))))
    rows = L.ctc_loss(lp, cp.asarray(np.array([[1, 1], [1, 7]])), agg=lambda l: l)   # auto: no value check on CuPy
    assert np.isfinite(float(rows[0])) and np.isnan(float(rows[1]))
    nll = L.nll_loss(cp.asarray(_log_softmax(np.zeros((2, 3)))), cp.asarray(np.array([0, 9])), agg=lambda l: l)
    assert np.isfinite(float(nll[0])) and np.isnan(float(nll[1]))
