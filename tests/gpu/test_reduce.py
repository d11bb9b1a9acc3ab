"""The mapreducedim kernel (fluxpy.kernels.reduce) against NumPy float64, and unbroadcast on CuPy.

Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere). Kernels compile
once per (dtype, accumulator, op, map) module, so the draws keep to a few maps.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from devices import cupy_module
from fluxpy.kernels import reduce as R
from sweeps import examples

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 3, 4, 7, 8, 13, 16, 127, 128]
MAPS = {None: lambda x, y: x, "x * x": lambda x, y: x * x, "x * (y > 0)": lambda x, y: x * (y > 0)}
DTYPES = [np.float16, np.float32, np.float64]
MAX_ELEMENTS = 300_000


@st.composite
def shapes_and_axes(draw):
    ndim = draw(st.integers(0, 4))
    shape = [draw(st.sampled_from(SIZES)) for _ in range(ndim)]
    if ndim and draw(st.booleans()):
        shape[draw(st.integers(0, ndim - 1))] = 5140
    while np.prod(shape, dtype=np.int64) > MAX_ELEMENTS:
        shape[int(np.argmax(shape))] = 7
    shape = tuple(shape)
    kind = draw(st.sampled_from(["subset", "none", "all", "int"]))
    if kind == "all":
        axes = None
    elif kind == "int" and ndim:
        axes = draw(st.integers(-ndim, ndim - 1))
    elif kind == "none":
        axes = ()
    else:
        axes = tuple(draw(st.sets(st.integers(0, max(ndim - 1, 0)), max_size=ndim))) if ndim else ()
    return shape, axes


def _reference(x, y, axes, op, fn):
    x64 = x.astype(np.float64)
    y64 = None if y is None else y.astype(np.float64)
    m = np.asarray(fn(x64, y64 if y64 is not None else x64), dtype=np.float64)
    ax = tuple(range(x.ndim)) if axes is None else axes
    red = {"sum": np.sum, "mean": np.mean, "max": np.max}[op]
    return red(m, axis=ax), np.sum(np.abs(m), axis=ax), m


def _check(got, ref, sumabs, dtype, op, count):
    got = got.astype(np.float64)
    assert got.shape == ref.shape
    assert np.all(np.isfinite(got))
    if op == "max":
        # max is exact: the result is one of the inputs, rounded to dtype like them
        np.testing.assert_array_equal(got, ref.astype(dtype).astype(np.float64))
        return
    eps_out = {np.float16: 1e-3, np.float32: 2e-6, np.float64: 1e-14}[dtype]
    eps_acc = 1e-13 if dtype == np.float64 else 2e-6
    scale = sumabs / max(count, 1) if op == "mean" else sumabs
    tol = eps_out * np.abs(ref) + eps_acc * scale + (1e-7 if dtype == np.float16 else 0)
    err = np.abs(got - ref)
    assert np.all(err <= tol), f"max err {err.max()} tol {tol[np.argmax(err - tol)] if tol.ndim else tol}"


@given(sa=shapes_and_axes(), dtype=st.sampled_from(DTYPES), op=st.sampled_from(["sum", "mean", "max"]),
       map_expr=st.sampled_from(list(MAPS)), keepdims=st.booleans(), seed=st.integers(0, 2**31))
@examples(60)
def test_matches_numpy_float64(sa, dtype, op, map_expr, keepdims, seed):
    cp = cupy_module()
    shape, axes = sa
    if dtype == np.float16 and np.prod(shape) > 60_000:   # keep float16 sums of x*x finite
        shape = tuple(min(n, 7) for n in shape)
    rng = np.random.default_rng(seed)
    scale = 0.5 if dtype == np.float16 else 1.0
    x = (rng.standard_normal(shape) * scale).astype(dtype)
    y = rng.standard_normal(shape).astype(dtype) if map_expr == "x * (y > 0)" else None
    ref, sumabs, m = _reference(x, y, axes, op, MAPS[map_expr])
    nax = R._normalize_axes(axes, x.ndim)
    count = int(np.prod([shape[i] for i in nax])) if nax else 1
    if op == "max" and map_expr is not None:
        # max of a mapped value is the mapped value rounded to dtype at the end: compare in dtype
        ref = ref.astype(dtype).astype(np.float64)
    oshape = np.sum(m, axis=nax, keepdims=keepdims).shape
    out = cp.full(oshape, np.nan, dtype=dtype)   # poisoned: every element must be written
    got = R.mapreduce(cp.asarray(x), axes, op, map=map_expr, y=None if y is None else cp.asarray(y),
                      keepdims=keepdims, out=out)
    assert got is out and got.dtype == dtype
    _check(cp.asnumpy(got).reshape(ref.shape), ref, sumabs, dtype, op, count)


@pytest.mark.parametrize("shape,axes", [((128, 16, 28, 28), (0, 2, 3)), ((8192, 1024), 0), ((1000, 5140), 1),
                                         ((3, 5, 7), (0, 2)), ((4, 6, 5), 1), ((2_000_003,), None),
                                         ((127, 13, 5140), (0, 2)), ((64, 10), 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_shapes_each_dtype(shape, axes, dtype):
    cp = cupy_module()
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * (0.5 if dtype == np.float16 else 1)).astype(dtype)
    for op in ("sum", "mean", "max"):
        ref, sumabs, _ = _reference(x, None, axes, op, MAPS[None])
        count = x.size // max(np.asarray(ref).size, 1)
        _check(cp.asnumpy(R.mapreduce(cp.asarray(x), axes, op)), ref, sumabs, dtype, op, count)


def test_float64_accumulation_for_float32():
    cp = cupy_module()
    x = cp.asarray(np.random.default_rng(2).standard_normal((4096, 333)).astype(np.float32))
    a = R.mapreduce(x, 0, acc_dtype=np.float64)
    ref = cp.asnumpy(x).astype(np.float64).sum(0)
    np.testing.assert_allclose(cp.asnumpy(a), ref, rtol=1e-6, atol=1e-5)


def test_misaligned_and_strided_inputs():
    cp = cupy_module()
    base = cp.asarray(np.random.default_rng(3).standard_normal(4 * 1024 + 1).astype(np.float32))
    x = base[1:].reshape(4, 1024)            # 4-byte aligned only: falls back to scalar loads
    np.testing.assert_allclose(cp.asnumpy(R.mapreduce(x, 0)), cp.asnumpy(x).sum(0), rtol=1e-5, atol=1e-5)
    t = cp.asarray(np.random.default_rng(4).standard_normal((64, 96)).astype(np.float32)).T  # not contiguous
    np.testing.assert_allclose(cp.asnumpy(R.mapreduce(t, 1)), cp.asnumpy(t).sum(1), rtol=1e-5, atol=1e-5)


def test_nan_propagates_through_max_and_empty_inputs():
    cp = cupy_module()
    x = cp.zeros((1000, 8), dtype=cp.float32)
    x[517, 3] = cp.nan
    got = cp.asnumpy(R.mapreduce(x, 0, "max"))
    assert np.isnan(got[3]) and not np.isnan(got[[0, 1, 2, 4, 5, 6, 7]]).any()
    assert cp.asnumpy(R.mapreduce(cp.zeros((0, 3), cp.float32), 0)).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="zero-size"):
        R.mapreduce(cp.zeros((0, 3), cp.float32), 0, "max")


@pytest.mark.parametrize("shape,axes", [((256, 64, 28, 28), (0, 2, 3)), ((8192, 1024), 0), ((1 << 22,), None),
                                         ((512, 3, 999), (0, 2))])
def test_bitwise_identical_over_runs(shape, axes):
    cp = cupy_module()
    x = cp.asarray(np.random.default_rng(5).standard_normal(shape).astype(np.float32))
    assert R.plan(shape, axes, np.float32, sm_count=R._sm_count(x.device.id))["S"] > 1  # multi-block path
    first = cp.asnumpy(R.mapreduce(x, axes)).tobytes()
    for _ in range(10):
        assert cp.asnumpy(R.mapreduce(x, axes)).tobytes() == first


def test_unbroadcast_uses_the_kernel(monkeypatch):
    cp = cupy_module()
    from fluxpy.kernels import gpu
    assert gpu.register()
    calls = []
    real = R.mapreduce

    def spy(*a, **k):
        calls.append(a[1])
        return real(*a, **k)
    monkeypatch.setattr(R, "mapreduce", spy)
    g = np.random.default_rng(6).standard_normal((8, 3, 5, 5)).astype(np.float32)
    for shape in [(3, 1, 1), (1, 3, 1, 1), (5,), (8, 1, 5, 1), ()]:
        got = fluxpy.unbroadcast(cp.asarray(g), shape)
        assert isinstance(got, cp.ndarray) and got.shape == shape
        ref = fluxpy.unbroadcast(g.astype(np.float64), shape)
        np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-5, atol=1e-5)
    assert len(calls) == 5


def test_gradient_of_bias_product_matches_cpu():
    cp = cupy_module()
    from fluxpy.kernels import gpu
    gpu.register()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 6, 9, 9)).astype(np.float32)
    b = rng.standard_normal((1, 6, 1, 1)).astype(np.float32)
    gx, gb = fluxpy.gradient(lambda x, b: (x * b).sum(), cp.asarray(x), cp.asarray(b))
    cx, cb = fluxpy.gradient(lambda x, b: (x * b).sum(), x.astype(np.float64), b.astype(np.float64))
    assert isinstance(gb, cp.ndarray) and gb.shape == (1, 6, 1, 1)
    np.testing.assert_allclose(cp.asnumpy(gx), cx, rtol=1e-6)
    np.testing.assert_allclose(cp.asnumpy(gb), cb, rtol=1e-5, atol=1e-4)
