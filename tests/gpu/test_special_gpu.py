"""erf, gelu_erf, rrelu, logsumexp, Embedding (one-hot, padding_idx) and EmbeddingBag on CuPy against the CPU path:
values and gradients, every float dtype where the op takes it. No erf kernel is registered for CuPy: the GPU runs
``erf``'s composite (fluxpy.ops.special), which these tests compare with SciPy's erf on the CPU.

Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere). Run:
``python -m pytest -q tests/gpu/test_special_gpu.py -p no:cacheprovider``.
"""
import copy

import ml_dtypes
import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module, grad_leaves
from fluxpy.ops.activations import gelu_erf, leakyrelu, rrelu
from fluxpy.ops.softmax import logsumexp
from fluxpy.ops.special import erf

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore::fluxpy.kernels.elementwise.FusionFallbackWarning")]

TOL = {np.float64: 1e-13, np.float32: 1e-6, np.float16: 2e-3, ml_dtypes.bfloat16: 1e-2}
DTYPES = list(TOL)


def _h(a):
    return np.asarray(fluxpy.cpu(a)).astype(np.float64)


@pytest.mark.parametrize("f", [erf, gelu_erf], ids=["erf", "gelu_erf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_erf_and_gelu_erf_match_the_cpu(f, dtype):
    cp = cupy_module()
    x = np.concatenate([np.linspace(-7, 7, 501), [0.0, 2.0, -2.0, np.inf, -np.inf]]).astype(dtype)
    y = f(cp.asarray(x))
    ref = f(x)
    assert isinstance(y, cp.ndarray) and y.dtype == ref.dtype   # (NumPy's bfloat16 * 0.5 is float32: gelu_erf's too)
    assert f is not erf or y.dtype == dtype
    np.testing.assert_allclose(_h(y), _h(ref), rtol=TOL[dtype], atol=TOL[dtype])
    if dtype in (np.float64, np.float32):
        ct = np.random.default_rng(0).standard_normal(x.shape).astype(dtype)
        fin = np.isfinite(x)
        xg, ctg = x[fin], ct[fin]
        g = fluxpy.gradient(lambda x: (f(x) * cp.asarray(ctg)).sum(), cp.asarray(xg))[0]
        g_ref = fluxpy.gradient(lambda x: (f(x) * ctg).sum(), xg)[0]
        np.testing.assert_allclose(_h(g), _h(g_ref), rtol=10 * TOL[dtype], atol=10 * TOL[dtype])


def test_second_order_erf_on_gpu():
    cp = cupy_module()
    x = np.linspace(-3, 3, 13)

    def h(x):
        return fluxpy.gradient(lambda z: fluxpy.gradient(lambda u: gelu_erf(u).sum(), z)[0].sum(), x)[0]
    np.testing.assert_allclose(_h(h(cp.asarray(x))), h(x), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_dense_gelu_erf_on_gpu(dtype):
    cp = cupy_module()
    m = fluxpy.Dense(5, 4, gelu_erf, rng=0)
    m = fluxpy.f64(m) if dtype == np.float64 else m
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(dtype)
    gm = fluxpy.gpu(copy.deepcopy(m))
    y, back = fluxpy.pullback(lambda m, x: m(x), gm, cp.asarray(x))
    y_ref, back_ref = fluxpy.pullback(lambda m, x: m(x), m, x)
    ct = np.ones(y_ref.shape, dtype)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert_matches_cpu(y, y_ref, rtol=tol, atol=tol)
    for a, b in zip(grad_leaves(back(cp.asarray(ct))), grad_leaves(back_ref(ct))):
        assert_matches_cpu(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_rrelu_on_gpu(dtype):
    cp = cupy_module()
    x = cp.asarray(np.concatenate([-np.linspace(0.5, 3, 500), np.linspace(0.5, 3, 500)]).astype(dtype))
    y, back = fluxpy.pullback(rrelu, x)
    assert isinstance(y, cp.ndarray) and y.dtype == dtype
    slope = _h(y)[:500] / _h(x)[:500]
    assert slope.min() >= 1 / 8 - 1e-3 and slope.max() <= 1 / 3 + 1e-3 and len(np.unique(slope)) > 100
    np.testing.assert_array_equal(_h(y)[500:], _h(x)[500:])
    (g,) = back(cp.ones_like(x))
    np.testing.assert_allclose(_h(g)[:500], slope, rtol=2e-3 if dtype == np.float16 else 1e-6)
    assert_matches_cpu(rrelu(x, 0.2, 0.2), leakyrelu(fluxpy.cpu(x), a=0.2), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("axis", [None, 0, -1, (0, 2)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_logsumexp_on_gpu(axis, dtype):
    cp = cupy_module()
    x = (np.random.default_rng(2).standard_normal((3, 4, 5)) * 20).astype(dtype)
    x[0, 0, :] = -np.inf
    tol = 1e-13 if dtype == np.float64 else 1e-5
    for keepdims in (False, True):
        y = logsumexp(cp.asarray(x), axis=axis, keepdims=keepdims)
        assert_matches_cpu(y, logsumexp(x, axis=axis, keepdims=keepdims), rtol=tol, atol=tol)
    xf = np.where(np.isfinite(x), x, 0).astype(dtype)
    g = fluxpy.gradient(lambda x: logsumexp(x, axis=axis).sum(), cp.asarray(xf))[0]
    assert_matches_cpu(g, fluxpy.gradient(lambda x: logsumexp(x, axis=axis).sum(), xf)[0], rtol=tol, atol=tol)


def _embedding_cases():
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 7, (4, 3))
    hot = np.eye(7, dtype=np.float32)[idx]
    data, offsets = rng.integers(0, 7, 9), np.array([0, 2, 3, 6])
    return [
        ("indices", fluxpy.Embedding(7, 5, rng=0), (idx,)),
        ("onehot", fluxpy.Embedding(7, 5, rng=0), (hot,)),
        ("onehot bool", fluxpy.Embedding(7, 5, rng=0), (hot.astype(bool),)),
        ("padding", fluxpy.Embedding(7, 5, rng=0, padding_idx=2), (idx,)),
        ("padding onehot", fluxpy.Embedding(7, 5, rng=0, padding_idx=2), (hot,)),
        ("bag mean", fluxpy.EmbeddingBag(7, 5, rng=1), (idx,)),
        ("bag sum offsets", fluxpy.EmbeddingBag(7, 5, fluxpy.sum, rng=1), (data, offsets)),
        ("bag max offsets", fluxpy.EmbeddingBag(7, 5, fluxpy.max, rng=1), (data, offsets)),
        ("bag mean offsets", fluxpy.EmbeddingBag(7, 5, rng=1), (data, offsets)),
        ("bag mean list", fluxpy.EmbeddingBag(7, 5, rng=1), ([data[:2], data[2:7], data[7:]],)),
        ("bag custom", fluxpy.EmbeddingBag(7, 5, lambda e, axis: fluxpy.sum(e * e, axis=axis), rng=1),
         (data, offsets)),
        ("bag onehot", fluxpy.EmbeddingBag(7, 5, rng=1), (hot,)),
    ]


@pytest.mark.parametrize("case", range(len(_embedding_cases())), ids=[c[0] for c in _embedding_cases()])
@pytest.mark.parametrize("device_inputs", [False, True], ids=["host inputs", "device inputs"])
def test_embeddings_match_the_cpu(case, device_inputs):
    cp = cupy_module()
    name, layer, args = _embedding_cases()[case]
    layer = fluxpy.f64(layer)
    gargs = tuple(cp.asarray(a) if device_inputs and isinstance(a, np.ndarray) else a for a in args)
    gm = fluxpy.gpu(copy.deepcopy(layer))
    y, back = fluxpy.pullback(lambda m: m(*gargs), gm)
    y_ref, back_ref = fluxpy.pullback(lambda m: m(*args), layer)
    assert_matches_cpu(y, y_ref, rtol=1e-12, atol=1e-13)
    ct = np.random.default_rng(4).standard_normal(y_ref.shape)
    for a, b in zip(grad_leaves(back(cp.asarray(ct))), grad_leaves(back_ref(ct))):
        assert_matches_cpu(a, b, rtol=1e-12, atol=1e-13)
