"""Pools with a pad as large as the kernel on CuPy against the CPU path: windows of padding only give NNlib's values
(the lowest finite number of x's dtype for a max, 0 for a mean) and pass no gradient, in 1, 2 and 3 spatial
dimensions, C order and channels-last, every kernel dtype; the second-order path (``maxpool_gather``) too.

Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere). Run:
``python -m pytest -q tests/gpu/test_pool_pad_gpu.py -p no:cacheprovider``.
"""
import ml_dtypes
import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy.kernels.cpu import lowest_finite
from fluxpy.layout import is_channels_last, to_channels_last
from fluxpy.ops.dims import PoolDims
from fluxpy.ops.pool import maxpool, maxpool_backward, meanpool

pytestmark = pytest.mark.gpu

CASES = [  # (x shape, kernel, stride, pad): each has windows of padding only
    ((2, 3, 5), (2,), (2,), (3, 1)),
    ((2, 3, 5, 5), (2, 2), (2, 2), 3),                          # Flux's outputsize.jl:121
    ((2, 3, 4, 6), (1, 2), (1, 1), 1),                          # NNlib's issue 210
    ((1, 2, 3, 4), (2, 3), (3, 1), (2, 0, 0, 4)),
    ((2, 2, 3, 4, 5), (2, 2, 2), (2, 1, 2), (2, 0, 1, 2, 0, 3)),
]
DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16]


def _h(a):
    return np.asarray(fluxpy.cpu(a)).astype(np.float64)


@pytest.mark.parametrize("case", CASES, ids=[str(c[1:]) for c in CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("ties", [False, True])
def test_pools_with_empty_windows_match_cpu(case, dtype, ties):
    cp = cupy_module()
    shape, kernel, stride, pad = case
    rng = np.random.default_rng(3)
    x = (rng.integers(-2, 3, shape) if ties else rng.standard_normal(shape)).astype(dtype)
    assert PoolDims.from_array(x, kernel, stride, pad).has_empty_windows
    for pool in (maxpool, meanpool):
        def f(x):
            return pool(x, kernel, stride, pad)
        y_ref, back_ref = fluxpy.pullback(f, x)
        ct = rng.standard_normal(y_ref.shape).astype(dtype)
        (g_ref,) = back_ref(ct)
        y, back = fluxpy.pullback(f, cp.asarray(x))
        (g,) = back(cp.asarray(ct))
        assert isinstance(y, cp.ndarray) and y.dtype == y_ref.dtype and g.dtype == g_ref.dtype
        tol = 1e-2 if dtype in (np.float16, ml_dtypes.bfloat16) else 1e-6
        if pool is maxpool:   # exact, the empty windows' lowest value included
            np.testing.assert_array_equal(_h(y), _h(y_ref))
            assert (_h(y) == float(lowest_finite(dtype))).any()
        else:
            np.testing.assert_allclose(_h(y), _h(y_ref), rtol=tol, atol=tol)
        np.testing.assert_allclose(_h(g), _h(g_ref), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", [c for c in CASES if len(c[0]) == 4], ids=lambda c: str(c[1:]))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_channels_last_pools_with_empty_windows(case, dtype):
    cp = cupy_module()
    shape, kernel, stride, pad = case
    rng = np.random.default_rng(4)
    x = rng.standard_normal(shape).astype(dtype)
    for pool in (maxpool, meanpool):
        y = pool(to_channels_last(cp.asarray(x)), kernel, stride, pad)
        assert is_channels_last(y) or y.shape[1] == 1
        np.testing.assert_array_equal(_h(y), _h(pool(x, kernel, stride, pad)))


@pytest.mark.parametrize("case", CASES, ids=[str(c[1:]) for c in CASES])
def test_second_order_and_backward_op_with_empty_windows(case):
    """``maxpool_backward`` and its adjoint (``maxpool_gather``, reached by a gradient of a gradient)."""
    cp = cupy_module()
    shape, kernel, stride, pad = case
    rng = np.random.default_rng(5)
    x = rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1
    d = PoolDims.from_array(x, kernel, stride, pad)
    y = maxpool(x, kernel, stride, pad)
    dy = rng.standard_normal(y.shape)
    ref = maxpool_backward(dy, x, y, d)
    got = maxpool_backward(cp.asarray(dy), cp.asarray(x), cp.asarray(y), d)
    np.testing.assert_allclose(_h(got), ref, rtol=1e-12)
    v = rng.standard_normal(x.shape)

    def second(dy, x):
        w = cp.asarray(v) if isinstance(x, cp.ndarray) else v
        return fluxpy.gradient(lambda dy: (maxpool_backward(dy, x, maxpool(x, kernel, stride, pad), d) * w).sum(),
                               dy)[0]
    np.testing.assert_allclose(_h(second(cp.asarray(dy), cp.asarray(x))), second(dy, x), rtol=1e-12)
