"""fluxpy's max-pool kernels (``fluxpy/kernels/cuda/pool.cu``) run on the CPU, without a GPU: the source as NVRTC gets
it (tests/kernel_on_cpu.py), compiled by g++ with ``tests/cuda_on_cpu/shim.h`` (a thread per CUDA thread, one block
at a time), launched by ``fluxpy.kernels.cuda_pool``'s own host code (its CuPy calls given NumPy), against the CPU
path (the ops on NumPy arrays), bit for bit where no sum is taken: the channels-last forms, a channel a thread and (channels in whole 16-byte vectors) a vector of
channels a thread, forward and the backward of disjoint and of overlapping windows, padding, pixels in no window,
ties (the first maximum takes the gradient) and NaN, in float16, bfloat16, float32 and float64. The GPU's own runs
are ``tests/gpu/test_pool_tiles_gpu.py``'s. Skips where g++ lacks C++20's ``<barrier>`` or ``_Float16``.
"""
import ctypes
import types

import ml_dtypes
import numpy as np
import pytest

from fluxpy.kernels import compiler, cpu, cuda_pool
from fluxpy.layout import is_channels_last, to_channels_last
from fluxpy.ops.dims import PoolDims
from fluxpy.ops.pool import maxpool, maxpool_backward
from kernel_on_cpu import build_folder, library

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return build_folder(tmp_path_factory, "pool.cu", "pool.cpp")


_SCALARS = {np.int64: ctypes.c_longlong, np.int32: ctypes.c_int, np.float32: ctypes.c_float,
            np.float64: ctypes.c_double}


def _argument(a):
    if isinstance(a, np.ndarray):
        assert a.flags.c_contiguous or is_channels_last(a), "a kernel got a strided view"
        return ctypes.c_void_p(a.__array_interface__["data"][0])
    assert type(a) in _SCALARS, f"a kernel argument of type {type(a).__name__} ({a!r}): CuPy takes NumPy scalars"
    return _SCALARS[type(a)](a.item())


class _Kernel:
    """A kernel of one CPU build, called as a CuPy RawKernel is: ``(grid, block, args)``; its launches counted by
    name in ``launched``."""

    def __init__(self, library, name, launched):
        self.library, self.name, self.launched = library, name, launched

    def __call__(self, grid, block, args):
        assert block == (256,), block
        values = [_argument(a) for a in args]
        sizes = (ctypes.c_int * len(values))(*[ctypes.sizeof(v) for v in values])
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        assert self.library.emu_launch(self.name.encode(), grid[0], block[0], pointers, sizes, len(values)) == 0
        self.launched[self.name] = self.launched.get(self.name, 0) + 1


@pytest.fixture()
def launched(build, monkeypatch):
    """cuda_pool's host code with NumPy for CuPy (outputs NaN-filled, so an unwritten element shows) and the CPU
    build of each define set for its kernels; the kernels' launches by name."""
    libraries, counts = {}, {}

    def function(name, kernel, defines, options=()):
        assert name == "pool.cu"
        key = tuple(sorted(defines.items()))
        if key not in libraries:
            libraries[key] = library(build, "pool.cu", "pool.cpp", defines)
        return _Kernel(libraries[key], kernel, counts)

    standin = types.SimpleNamespace(ndarray=np.ndarray, asarray=np.asarray,
                                    empty=lambda shape, dtype: np.full(shape, np.nan, dtype),
                                    cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0)))
    monkeypatch.setattr(cuda_pool, "cupy", standin)
    monkeypatch.setattr(cuda_pool, "_address", lambda a: a.__array_interface__["data"][0])
    monkeypatch.setattr(cuda_pool, "_calls", {})
    monkeypatch.setattr(cuda_pool, "_windows", {})
    monkeypatch.setattr(compiler, "function", function)
    return counts


GEOMETRIES = [   # x shape (N, C, H, W), kernel, stride, pad
    ((2, 16, 6, 6), (2, 2), (2, 2), (0, 0, 0, 0)),      # tiling the image
    ((1, 8, 7, 5), (2, 2), (2, 2), (0, 0, 0, 0)),       # the last row and column in no window
    ((2, 24, 6, 8), (2, 3), (3, 4), (0, 0, 0, 0)),      # gaps between windows
    ((1, 16, 5, 5), (2, 2), (2, 2), (1, 0, 1, 0)),      # padding before
    ((1, 8, 7, 7), (3, 3), (2, 2), (1, 1, 1, 1)),       # overlapping windows: the per-pixel backward
    ((2, 12, 6, 6), (2, 2), (2, 2), (0, 0, 0, 0)),      # channels not in whole vectors of halves: a channel a thread
]
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("geometry", range(len(GEOMETRIES)))
def test_channels_last_max_pooling_matches_the_cpu_kernels_bit_for_bit(launched, geometry, dtype):
    shape, kernel, stride, pad = GEOMETRIES[geometry]
    rng = np.random.default_rng(geometry)
    x = rng.integers(-3, 4, shape).astype(dtype)    # few values: ties in most windows
    x.reshape(-1)[rng.integers(0, x.size, 3)] = np.nan
    d = PoolDims.from_array(x, kernel, stride, pad)
    y_ref = maxpool(x, kernel, stride, pad)
    dy = rng.standard_normal(y_ref.shape).astype(dtype)
    dx_ref = maxpool_backward(dy, x, y_ref, d)
    y = cuda_pool.maxpool_forward(to_channels_last(x), d)
    dx = cuda_pool.maxpool_backward(to_channels_last(dy), to_channels_last(x), y, d)
    assert is_channels_last(y) and is_channels_last(dx) and y.dtype == dx.dtype == dtype
    np.testing.assert_array_equal(np.ascontiguousarray(y).astype(np.float64), y_ref.astype(np.float64))
    disjoint = cuda_pool._tiling(d)[0]
    if disjoint:   # one gradient a pixel: exact
        np.testing.assert_array_equal(np.ascontiguousarray(dx).astype(np.float64), dx_ref.astype(np.float64))
    else:          # sums over overlapping windows, in another order than the CPU's, rounded once
        eps = float(np.finfo(np.float32 if dtype == BF16 else dtype).eps) * (2.0 ** 16 if dtype == BF16 else 1)
        np.testing.assert_allclose(np.ascontiguousarray(dx).astype(np.float64), dx_ref.astype(np.float64),
                                   rtol=4 * eps, atol=4 * eps)
    vectors = shape[1] % (16 // dtype.itemsize) == 0
    expected = {("maxpool_fwd_vec" if vectors else "maxpool_fwd"): 1}
    if disjoint:
        expected["maxpool_bwd_tiles_vec" if vectors else "maxpool_bwd_tiles"] = 1
    else:
        expected["maxpool_bwd"] = 1
    assert launched == expected, launched


def test_an_unaligned_view_takes_a_channel_a_thread(launched):
    """Arrays whose first element is not 16-byte aligned (a view one element in) take the scalar kernels."""
    rng = np.random.default_rng(9)
    base = rng.standard_normal(1 + 2 * 6 * 6 * 16).astype(np.float32)
    x = base[1:].reshape(2, 6, 6, 16).transpose(0, 3, 1, 2)   # channels-last, 4 bytes off a 16-byte boundary
    assert is_channels_last(x) and x.__array_interface__["data"][0] % 16 != 0
    d = PoolDims.from_array(x, (2, 2))
    y = cuda_pool.maxpool_forward(x, d)
    np.testing.assert_array_equal(np.ascontiguousarray(y), maxpool(np.ascontiguousarray(x), (2, 2)))
    assert launched == {"maxpool_fwd": 1}, launched


@pytest.mark.parametrize("geometry", range(len(GEOMETRIES)))
def test_the_other_channels_last_pool_kernels_match_the_cpu_kernels(launched, geometry):
    """Mean pooling each way and the max pool's gather (second derivatives), a channel a thread, float32."""
    shape, kernel, stride, pad = GEOMETRIES[geometry]
    rng = np.random.default_rng(20 + geometry)
    x = rng.integers(-3, 4, shape).astype(np.float32)
    d = PoolDims.from_array(x, kernel, stride, pad)
    y = cpu.maxpool_forward(x, d)
    dx = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    xl = to_channels_last(x)
    checks = [(cuda_pool.meanpool_forward(xl, d), cpu.meanpool_forward(x, d)),
              (cuda_pool.meanpool_backward(to_channels_last(dy), d), cpu.meanpool_backward(dy, d)),
              (cuda_pool.maxpool_gather(to_channels_last(dx), xl, to_channels_last(y), d),
               cpu.maxpool_gather(dx, x, y, d))]
    for got, want in checks:
        assert is_channels_last(got)
        np.testing.assert_allclose(np.ascontiguousarray(got), want, rtol=1e-6, atol=1e-6)
    assert launched == {"meanpool_fwd": 1, "meanpool_bwd": 1, "maxpool_gather": 1}, launched
