"""fluxpy.kernels.onednn_pool: oneDNN's float32 max and mean pools give the NumPy kernels' results (shapes, strides,
asymmetric padding, ties, NaN, infinities: the max pool's gradient to each window's first maximum, a NaN window's to
its first NaN), the max pool's backward finds the forward's workspace or runs the forward again, the gradients match
finite differences, and arrays of the wrong shape are refused by name. Skipped where oneDNN is not installed."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluxpy.kernels import cpu, onednn, onednn_pool
from fluxpy.ops.dims import PoolDims
from test_pool import pool_problems

pytestmark = pytest.mark.skipif(onednn.library() is None, reason="oneDNN is not installed (pip install fluxpy[cpu])")

_SPECIALS = {"none": None, "nan": np.nan, "-inf": -np.inf, "inf": np.inf}


def _numpy(call):
    """``call()`` with oneDNN's pools turned off: the NumPy kernels' result."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(onednn_pool, "takes", lambda *args: False)
        return call()


def _case(problem, seed, special):
    xs, kernel, stride, pad = problem
    rng = np.random.default_rng(seed)
    x = np.round(2 * rng.standard_normal(xs)).astype(np.float32)   # rounded: many ties
    if _SPECIALS[special] is not None:
        x[rng.random(xs) < 0.15] = _SPECIALS[special]
    pdims = PoolDims.from_array(x, kernel, stride, pad)
    return x, pdims, rng.standard_normal(pdims.y_shape).astype(np.float32)


def _overlapping(pdims):
    return any(s < k for s, k in zip(pdims.stride, pdims.kernel))


@settings(deadline=None, max_examples=80)
@given(pool_problems(), st.integers(0, 2**16), st.sampled_from(sorted(_SPECIALS)))
def test_maxpool_matches_numpy_ties_nan_and_infinities(problem, seed, special):
    x, pdims, dy = _case(problem, seed, special)
    y = cpu.maxpool_forward(x, pdims)
    y_numpy = _numpy(lambda: cpu.maxpool_forward(x, pdims))
    assert y.dtype == np.float32 and np.array_equal(y, y_numpy, equal_nan=True)
    dx_numpy = _numpy(lambda: cpu.maxpool_backward(dy, x, y_numpy, pdims))
    for out in (y, y.copy()):   # the forward's workspace, and the forward run again for it
        dx = cpu.maxpool_backward(dy, x, out, pdims)
        assert dx.dtype == np.float32
        if _overlapping(pdims):   # windows sharing an entry add their gradients in another order
            np.testing.assert_allclose(dx, dx_numpy, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(dx, dx_numpy)


@settings(deadline=None, max_examples=60)
@given(pool_problems(), st.integers(0, 2**16), st.sampled_from(["none", "nan", "inf"]))
def test_meanpool_matches_numpy(problem, seed, special):
    x, pdims, dy = _case(problem, seed, special)
    y = cpu.meanpool_forward(x, pdims)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, _numpy(lambda: cpu.meanpool_forward(x, pdims)), rtol=1e-6, atol=1e-6)
    dx = cpu.meanpool_backward(dy, pdims)
    assert dx.dtype == np.float32
    np.testing.assert_allclose(dx, _numpy(lambda: cpu.meanpool_backward(dy, pdims)), rtol=1e-6,
                               atol=1e-7)


def test_the_workspace_is_kept_only_where_onednn_ran_and_only_while_the_output_lives():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    pdims = PoolDims.from_array(x, 2)
    y = cpu.maxpool_forward(x, pdims)
    assert onednn_pool._kept(y, x, pdims) is not None
    assert onednn_pool._kept(y, x.copy(), pdims) is None   # another input: the forward runs again
    key = (id(y), pdims)
    del y
    assert key not in onednn_pool._WORKSPACES.entries
    x[0, 0, 0, 0] = np.nan   # NumPy's kernel runs: nothing kept
    y = cpu.maxpool_forward(x, pdims)
    assert np.isnan(y[0, 0, 0, 0]) and onednn_pool._kept(y, x, pdims) is None


def _central_differences(forward, x, dy, pdims, step):
    """The gradient of ``sum(forward(x) * dy)``, each entry from float64 central differences of float32 outputs."""
    numeric = np.empty(x.shape)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += step
        down[i] -= step
        diff = forward(up, pdims).astype(np.float64) - forward(down, pdims).astype(np.float64)
        numeric[i] = np.sum(diff * dy.astype(np.float64)) / (2 * float(step))
    return numeric


@pytest.mark.parametrize("kernel,stride,pad", [(2, 2, 0), (3, 2, 1), (3, 1, (0, 2, 1, 0)), ((2, 3), (1, 2), 0)])
def test_gradients_match_float64_finite_differences(kernel, stride, pad):
    """The max pool of distinct integers: a step of 1/4 moves no maximum and rounds nothing, so its differences are
    exact; the mean pool of values near 1, where a step of 1/16 loses little to float32's rounding."""
    rng = np.random.default_rng(1)
    shape = (2, 2, 7, 6)
    x = rng.permutation(np.prod(shape)).reshape(shape).astype(np.float32)
    pdims = PoolDims.from_array(x, kernel, stride, pad)
    dy = rng.standard_normal(pdims.y_shape).astype(np.float32)
    grad = cpu.maxpool_backward(dy, x, cpu.maxpool_forward(x, pdims), pdims)
    np.testing.assert_allclose(grad, _central_differences(cpu.maxpool_forward, x, dy, pdims, 0.25), rtol=1e-6,
                               atol=1e-6)
    x = rng.standard_normal(shape).astype(np.float32)
    np.testing.assert_allclose(cpu.meanpool_backward(dy, pdims),
                               _central_differences(cpu.meanpool_forward, x, dy, pdims, 1 / 16), rtol=1e-4, atol=1e-5)


def test_a_geometry_onednn_refuses_runs_numpy(monkeypatch):
    x = np.random.default_rng(2).standard_normal((1, 2, 6, 5)).astype(np.float32)
    pdims = PoolDims.from_array(x, 3, 1, (1, 0, 0, 1))   # dims no other test builds: the refusal is remembered
    monkeypatch.setattr(onednn_pool, "_Pool", lambda *args: (_ for _ in ()).throw(RuntimeError("refused")))
    try:
        assert onednn_pool.maxpool_forward(x, pdims) is None and onednn_pool.meanpool_forward(x, pdims) is None
        y = cpu.maxpool_forward(x, pdims)
        np.testing.assert_array_equal(y, _numpy(lambda: cpu.maxpool_forward(x, pdims)))
        assert onednn_pool._kept(y, x, pdims) is None
    finally:
        for alg in (onednn_pool._MAX, onednn_pool._MEAN):
            onednn.library().problems.pop(("pool", alg, pdims), None)


@pytest.mark.parametrize("call,match", [
    (lambda x, y, p: onednn_pool.maxpool_forward(x[:, :, :4], p), r"maxpool_forward expects x of shape \(1, 2, 6, 6\)"),
    (lambda x, y, p: onednn_pool.maxpool_backward(y[:, :1], x, y, p),
     r"maxpool_backward expects dy of shape \(1, 2, 3, 3\) \(from its PoolDims\), got dy of shape \(1, 1, 3, 3\)"),
    (lambda x, y, p: onednn_pool.meanpool_forward(x[:1, :1], p), r"meanpool_forward expects x of shape"),
    (lambda x, y, p: onednn_pool.meanpool_backward(x, p), r"meanpool_backward expects dy of shape \(1, 2, 3, 3\)"),
])
def test_arrays_of_the_wrong_shape_are_refused(call, match):
    x = np.ones((1, 2, 6, 6), np.float32)
    pdims = PoolDims.from_array(x, 2)
    with pytest.raises(ValueError, match=match):
        call(x, np.ones(pdims.y_shape, np.float32), pdims)


def test_only_float32_regular_pools_without_empty_windows_are_taken():
    x = np.ones((1, 1, 4, 4), np.float32)
    assert onednn_pool.takes(x, PoolDims.from_array(x, 2))
    assert not onednn_pool.takes(x.astype(np.float64), PoolDims.from_array(x, 2))
    assert not onednn_pool.takes(x, PoolDims.from_array(x, 2, pad=(2, 0, 0, 0)))   # a window of padding only
