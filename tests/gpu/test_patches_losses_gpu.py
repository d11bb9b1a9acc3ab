"""The ops and losses composed of other ops (cosine_similarity, pairwise_distance, channel_shuffle, threshold, unfold,
fold, lpnormpool, the margin losses, the binary cross-entropies' weights, GRUv3) on the GPU against the CPU: values
and gradients in float64 and float32, and a captured step through unfold and lpnormpool.
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import losses as L

pytestmark = pytest.mark.gpu

RTOL = {np.float64: 1e-11, np.float32: 2e-5}


def _cases(rng, move=lambda a: a):
    """name -> (function, arguments); the targets the functions hold are put on the device by ``move``."""
    x4 = np.abs(rng.standard_normal((2, 6, 7, 6))) + 0.1
    a, b = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    labels, pm = rng.integers(0, 4, 5), rng.choice([-1.0, 1.0], (5, 4))
    labels, pm, ones, twos = move(labels), move(pm), move(np.ones(4)), move(np.full(4, 2.0))
    return {
        "cosine_similarity": (lambda a, b: fluxpy.cosine_similarity(a, b), (a, b)),
        "pairwise_distance": (lambda a, b: fluxpy.pairwise_distance(a, b, p=3.0), (a, b)),
        "channel_shuffle": (lambda x: fluxpy.channel_shuffle(x, 3), (x4,)),
        "threshold": (lambda a: fluxpy.threshold(a, 0.2, -1.0), (a,)),
        "unfold": (lambda x: fluxpy.unfold(x, (2, 3), stride=2, pad=1), (x4,)),
        "fold": (lambda c: fluxpy.fold(c, (7, 6), 2, stride=2, pad=1),
                 (rng.standard_normal((2, 6 * 4, 16)),)),
        "lpnormpool": (lambda x: fluxpy.lpnormpool(x, 3, 2, 2), (x4,)),
        "soft_margin_loss": (lambda a: L.soft_margin_loss(a, pm), (a,)),
        "hinge_embedding_loss": (lambda a: L.hinge_embedding_loss(a, pm, margin=0.5), (a,)),
        "multilabel_soft_margin_loss": (lambda a: L.multilabel_soft_margin_loss(a, (pm + 1) / 2), (a,)),
        "multi_margin_loss": (lambda a: L.multi_margin_loss(a, labels, p=2, weight=ones * 0.5), (a,)),
        "logitbinarycrossentropy": (lambda a: L.logitbinarycrossentropy(a, (pm + 1) / 2, pos_weight=twos),
                                    (a,)),
    }


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", sorted(_cases(np.random.default_rng(0))))
def test_each_op_on_the_gpu_matches_the_cpu(name, dtype):
    import cupy as cp
    _, args = _cases(np.random.default_rng(1))[name]
    args = tuple(a.astype(dtype) for a in args)

    def run(move):
        f = _cases(np.random.default_rng(1), move)[name][0]
        moved = tuple(move(a) for a in args)
        y = f(*moved)
        seed = move(np.random.default_rng(2).standard_normal(y.shape).astype(dtype))
        return y, fluxpy.gradient(lambda *z: (f(*z) * seed).sum(), *moved)
    y_cpu, g_cpu = run(lambda a: a)
    y_gpu, g_gpu = run(cp.asarray)
    assert y_gpu.dtype == y_cpu.dtype
    np.testing.assert_allclose(cp.asnumpy(y_gpu), y_cpu, rtol=RTOL[dtype], atol=RTOL[dtype])
    for a, b in zip(g_gpu, g_cpu):
        np.testing.assert_allclose(cp.asnumpy(a), b, rtol=RTOL[dtype], atol=RTOL[dtype])


def test_gruv3_on_the_gpu_matches_the_cpu():
    import cupy as cp
    layer = fluxpy.f64(fluxpy.GRUv3(3, 4, rng=0))
    x = np.random.default_rng(3).standard_normal((2, 5, 3))
    y_cpu, (g_cpu,) = fluxpy.withgradient(lambda m: (m(x) ** 2).sum(), layer)
    y_gpu, (g_gpu,) = fluxpy.withgradient(lambda m: (m(cp.asarray(x)) ** 2).sum(), fluxpy.gpu(layer))
    np.testing.assert_allclose(float(y_gpu), float(y_cpu), rtol=1e-12)
    np.testing.assert_allclose(cp.asnumpy(g_gpu["cell"]["weight_hh"]), g_cpu["cell"]["weight_hh"], rtol=1e-10)


def test_a_step_through_unfold_and_lpnormpool_is_captured():
    import cupy as cp
    rng = np.random.default_rng(4)
    model = fluxpy.gpu(fluxpy.Chain(fluxpy.Conv((3, 3), 2, 4, fluxpy.relu, pad=1, rng=1),
                                    lambda x: fluxpy.lpnormpool(x, 2, 2),
                                    lambda x: fluxpy.unfold(x, 2).reshape(x.shape[0], -1),
                                    fluxpy.Dense(16 * 9, 3, rng=2)))
    x = cp.asarray(rng.standard_normal((8, 2, 8, 8)).astype(np.float32))
    y = cp.asarray(rng.standard_normal((8, 3)).astype(np.float32))
    step = fluxpy.TrainStep(lambda m, x, y: fluxpy.mse(m(x), y), model, fluxpy.setup(fluxpy.Adam(1e-2), model))
    losses = [float(step(x, y)) for _ in range(6)]
    assert set(step.captured().values()) == {"captured"} and losses[-1] < losses[0]
