"""fluxpy.ops.constants: the host-built constants of adaptive mean pooling, linear upsampling and a half-precision
mean, built once per (what, dtype, module, device) and kept (on the device, for a captured step), in a bounded cache;
inside a capture a hit is held by the graph and a miss refuses the capture. On the CPU, with NumPy arrays."""
import ml_dtypes
import numpy as np
import pytest

import fluxpy
from fluxpy import backend
from fluxpy.capturing import CaptureUnsupported, recording
from fluxpy.ops import adaptive_meanpool, bilinear_weights, upsample_bilinear
from fluxpy.ops import constants
from fluxpy.ops.constants import clear_constants, constants_held, device_constant
from fluxpy.ops.dims import AdaptivePoolDims
from fluxpy.ops.reduce import mean


@pytest.fixture(autouse=True)
def empty_cache():
    clear_constants()
    yield
    clear_constants()


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_adaptive_meanpool_builds_its_matrices_once_per_shape_and_dtype():
    rng = _rng(1)
    x = rng.standard_normal((2, 3, 7, 5)).astype(np.float32)
    y = adaptive_meanpool(x, (3, 2))
    a_h, a_w = AdaptivePoolDims.from_array(x, (3, 2)).averaging_matrices()
    np.testing.assert_allclose(y, np.einsum("ph,nchw,qw->ncpq", a_h, x, a_w), rtol=1e-5, atol=1e-6)
    held = constants_held()
    assert held == 2   # one matrix per spatial axis
    for _ in range(3):   # the same problem, another batch: nothing new
        adaptive_meanpool(rng.standard_normal((4, 3, 7, 5)).astype(np.float32), (3, 2))
    assert constants_held() == held
    adaptive_meanpool(x.astype(np.float64), (3, 2))   # another dtype: its own matrices
    assert constants_held() == held + 2
    adaptive_meanpool(x, (2, 2))   # another output size along H only: one new matrix
    assert constants_held() == held + 3


def test_the_gradient_through_cached_matrices_is_unchanged():
    rng = _rng(2)
    x = rng.standard_normal((1, 2, 6, 4))
    w = rng.standard_normal((1, 2, 4, 3))
    g1, = fluxpy.gradient(lambda x: (adaptive_meanpool(x, (4, 3)) * w).sum(), x)
    g2, = fluxpy.gradient(lambda x: (adaptive_meanpool(x, (4, 3)) * w).sum(), x)   # from the cache
    a_h, a_w = AdaptivePoolDims.from_array(x, (4, 3)).averaging_matrices()
    np.testing.assert_allclose(g1, np.einsum("ph,ncpq,qw->nchw", a_h, w, a_w), rtol=1e-12)
    np.testing.assert_array_equal(g1, g2)


@pytest.mark.parametrize("align_corners", [True, False])
def test_bilinear_upsampling_keys_its_weights_by_sizes_and_corners(align_corners):
    rng = _rng(3)
    x = rng.standard_normal((2, 1, 3, 4)).astype(np.float32)
    y = upsample_bilinear(x, (2, 3), align_corners)
    wh, ww = bilinear_weights(3, 6, align_corners), bilinear_weights(4, 12, align_corners)
    np.testing.assert_allclose(y, np.einsum("ph,nchw,qw->ncpq", wh, x, ww), rtol=1e-5, atol=1e-6)
    held = constants_held()
    assert held == 2
    upsample_bilinear(rng.standard_normal((5, 2, 3, 4)).astype(np.float32), (2, 3), align_corners)
    assert constants_held() == held
    upsample_bilinear(x, (2, 3), not align_corners)
    assert constants_held() == held + 2


def test_a_half_mean_keeps_its_factor_once():
    x = _rng(4).standard_normal((3, 8)).astype(ml_dtypes.bfloat16)
    m = mean(x, axis=1)
    assert m.dtype == x.dtype
    np.testing.assert_allclose(m.astype(np.float32), x.astype(np.float32).mean(axis=1), atol=0.02)
    held = constants_held()
    assert held == 1
    mean(x * x, axis=1)
    assert constants_held() == held


def test_entries_are_keyed_by_dtype_and_module_and_read_only_on_the_host():
    like32, like64 = np.ones(1, np.float32), np.ones(1)
    a = device_constant(("k", 2), lambda: np.arange(2.0), like32)
    b = device_constant(("k", 2), lambda: np.arange(2.0), like64)
    assert a.dtype == np.float32 and b.dtype == np.float64 and constants_held() == 2
    assert device_constant(("k", 2), lambda: 1 / 0, like32) is a   # a hit never builds
    assert device_constant(("k", 2), lambda: np.arange(2.0), like64, np.float32) is a
    with pytest.raises(ValueError):
        a[0] = 5.0
    np.testing.assert_array_equal(a, [0.0, 1.0])


def test_the_cache_is_bounded_and_drops_the_least_recently_used(monkeypatch):
    monkeypatch.setattr(constants, "LIMIT", 4)
    like = np.ones(1, np.float32)
    first = device_constant(("n", 0), lambda: np.zeros(1), like)
    for i in range(1, 10):
        device_constant(("n", i), lambda i=i: np.full(1, i), like)
        assert device_constant(("n", 0), lambda: np.zeros(1), like) is first   # used again: kept
        assert constants_held() <= 4
    assert constants_held() == 4
    again = device_constant(("n", 1), lambda: np.full(1, 1.0), like)   # dropped long ago: built again
    np.testing.assert_array_equal(again, [1.0])


def test_inside_a_capture_a_miss_refuses_and_a_hit_is_held_by_the_graph(monkeypatch):
    like = np.ones(1, np.float32)
    with recording():
        with pytest.raises(CaptureUnsupported, match="upsample_linear: a constant built on the host"):
            device_constant(("upsample_linear", 3, 6, True), lambda: bilinear_weights(3, 6), like)
    assert constants_held() == 0
    built = device_constant(("upsample_linear", 3, 6, True), lambda: bilinear_weights(3, 6), like)   # eager
    holds = []
    monkeypatch.setattr(backend._CAPTURE, "holds", holds, raising=False)   # as capture_graph sets it
    with recording():
        assert device_constant(("upsample_linear", 3, 6, True), lambda: 1 / 0, like) is built
    assert any(h is built for h in holds)


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 5, 4), (1, 2, 3, 4, 5)])
def test_every_product_is_two_dimensional_forward_and_back(monkeypatch, shape):
    """A 2-D left side is one gemm through fluxpy's cuBLAS binding on the GPU, which a capture records (a batched
    product goes to CuPy's cuBLAS, which a capture refuses): upsampling and adaptive pooling use no other, and a
    transposed or channels-last input is flattened into rows first."""
    import importlib
    resample = importlib.import_module("fluxpy.ops.resample")
    linalg = importlib.import_module("fluxpy.ops.linalg")
    shapes = []
    real = linalg._matmul

    def checked(a, b):
        shapes.append((len(a.shape), len(b.shape)))
        return real(a, b)
    monkeypatch.setattr(linalg, "_matmul", checked)
    rng = _rng(5)
    x = rng.standard_normal(shape)
    n = len(shape) - 2
    ups = lambda x: resample.upsample_linear(x, None, False, size=tuple(s + 2 for s in shape[2:]))   # noqa: E731
    pool = lambda x: adaptive_meanpool(x, tuple(max(1, s - 2) for s in shape[2:]))   # noqa: E731
    for f in (ups, pool):
        w = rng.standard_normal(f(x).shape)
        g, = fluxpy.gradient(lambda x: (f(x) * w).sum(), x)
        assert g.shape == x.shape
    assert shapes and set(shapes) == {(2, 2)}
    assert len(shapes) >= 4 * n   # a forward and a backward product per axis and op
