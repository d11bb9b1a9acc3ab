"""Max-pool backward on the GPU where windows do not overlap (``maxpool_bwd_tiles``: a thread per window) and where
they do (``maxpool_bwd``), against the CPU kernel: every geometry kind (tiling the image, leaving pixels out, a
stride over the kernel, padding), ties (the first maximum takes the gradient), NaN windows, float32 and bfloat16, C
order and channels-last, channel counts in whole 16-byte vectors (the vector forms) and not; the forward too.
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import ml_dtypes
import numpy as np
import pytest

from devices import cupy_module
from fluxpy.kernels import cuda_pool
from fluxpy.layout import to_channels_last
from fluxpy.ops.dims import PoolDims
from fluxpy.ops.pool import maxpool, maxpool_backward

pytestmark = pytest.mark.gpu

GEOMETRIES = [   # x shape, kernel, stride, pad, whether windows are disjoint
    ((3, 5, 8, 8), (2, 2), (2, 2), (0, 0, 0, 0), True),
    ((2, 4, 9, 7), (2, 2), (2, 2), (0, 0, 0, 0), True),       # the last row and column in no window
    ((2, 3, 10, 10), (2, 3), (3, 4), (0, 0, 0, 0), True),     # gaps between windows
    ((2, 6, 7, 7), (2, 2), (2, 2), (1, 0, 1, 0), True),       # padding before
    ((2, 3, 9, 9), (3, 3), (2, 2), (1, 1, 1, 1), False),      # overlapping: the per-pixel kernel
    ((3, 16, 8, 8), (2, 2), (2, 2), (0, 0, 0, 0), True),      # channels in whole 16-byte vectors: the vector forms
    ((2, 24, 9, 7), (2, 2), (2, 2), (0, 0, 0, 0), True),
    ((2, 8, 7, 7), (2, 2), (2, 2), (1, 0, 1, 0), True),
    ((2, 16, 9, 9), (3, 3), (2, 2), (1, 1, 1, 1), False),
]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("geometry", range(len(GEOMETRIES)))
def test_maxpool_backward_matches_the_cpu(geometry, dtype, layout):
    cp = cupy_module()
    shape, kernel, stride, pad, disjoint = GEOMETRIES[geometry]
    rng = np.random.default_rng(geometry)
    x = rng.integers(-3, 4, shape).astype(dtype)   # few values: ties in most windows
    x.reshape(-1)[rng.integers(0, x.size, 3)] = np.nan
    d = PoolDims.from_array(x, kernel, stride, pad)
    assert cuda_pool._tiling(d)[0] == disjoint
    y = maxpool(x, kernel, stride, pad)
    dy = rng.standard_normal(y.shape).astype(dtype)
    ref = maxpool_backward(dy, x, y, d)
    move = (lambda a: to_channels_last(cp.asarray(a))) if layout == "channels_last" else cp.asarray
    got = maxpool_backward(move(dy), move(x), move(y), d)
    assert got.dtype == ref.dtype
    got, ref = cp.asnumpy(cp.ascontiguousarray(got)).astype(np.float32), ref.astype(np.float32)
    if disjoint:   # one gradient a pixel: exact
        np.testing.assert_array_equal(got, ref)
    else:          # sums over overlapping windows, in another order than the CPU's
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("geometry", range(len(GEOMETRIES)))
def test_maxpool_forward_matches_the_cpu(geometry, dtype, layout):
    """The forward, bit for bit (a max is exact), NaN winning its window, on every geometry."""
    cp = cupy_module()
    shape, kernel, stride, pad, _ = GEOMETRIES[geometry]
    rng = np.random.default_rng(50 + geometry)
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    x.reshape(-1)[rng.integers(0, x.size, 3)] = np.nan
    ref = maxpool(x, kernel, stride, pad)
    move = (lambda a: to_channels_last(cp.asarray(a))) if layout == "channels_last" else cp.asarray
    got = maxpool(move(x), kernel, stride, pad)
    assert got.dtype == ref.dtype
    np.testing.assert_array_equal(cp.asnumpy(cp.ascontiguousarray(got)).astype(np.float32), ref.astype(np.float32))
