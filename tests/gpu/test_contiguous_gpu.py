"""cuda_arrays.c_contiguous: C-order copies of strided CuPy views, permuted ones (the axis adjacent in memory not the
last: NHWC of NCHW memory) by a tiled transpose kernel, the rest by CuPy; the same bits as NumPy's copy for every
dtype (bfloat16 included), shape, permutation, reversed and broadcast axes, and inside a CUDA-graph capture."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from devices import cupy_module
from fluxpy.backend import capture_graph
from fluxpy.kernels import cuda_arrays
from test_half_conv_matmul import BF16
from sweeps import examples

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, BF16, np.float32, np.float64, np.int8, np.int64, np.complex64]


def _device(host):
    cp = cupy_module()
    bits = np.dtype(f"u{host.itemsize}") if host.itemsize in (2, 4, 8) else None
    return cp.asarray(host.view(bits)).view(host.dtype) if bits is not None else cp.asarray(host)


def _host(a):
    cp = cupy_module()
    bits = np.dtype(f"u{a.itemsize}") if a.itemsize in (2, 4, 8) else None
    return cp.asnumpy(a.view(bits)).view(a.dtype) if bits is not None else cp.asnumpy(a)


@st.composite
def views(draw):
    """A strided view of a random C-contiguous array: its axes permuted, some reversed or stepped, and a broadcast
    axis at times; with the views it was taken by, to take the same of a NumPy copy."""
    ndim = draw(st.integers(2, 6))
    most = min(64, int(200_000 ** (1 / ndim)))   # at most some 200,000 elements
    shape = tuple(draw(st.lists(st.integers(1, most), min_size=ndim, max_size=ndim)))
    perm = tuple(draw(st.permutations(list(range(ndim)))))
    steps = tuple(draw(st.lists(st.sampled_from([1, 1, 1, -1, 2]), min_size=ndim, max_size=ndim)))
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    broadcast = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return shape, perm, steps, dtype, broadcast, seed


def _make(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape) * 40
    if dtype.kind == "c":
        values = values + 1j * rng.standard_normal(shape)
    return values.astype(np.float32).astype(dtype) if dtype == BF16 else values.astype(dtype)


def _take(a, perm, steps, broadcast):
    v = a[tuple(slice(None, None, s) for s in steps)].transpose(perm)
    if broadcast:   # a new leading axis of 3, stride 0
        v = (np if isinstance(v, np.ndarray) else cupy_module()).broadcast_to(v[None], (3,) + v.shape)
    return v


@given(views())
@examples(60)
def test_c_contiguous_copies_every_strided_view_bit_for_bit(case):
    shape, perm, steps, dtype, broadcast, seed = case
    host = _make(shape, dtype, seed)
    want = np.ascontiguousarray(_take(host, perm, steps, broadcast))
    got = cuda_arrays.c_contiguous(_take(_device(host), perm, steps, broadcast))
    assert got.flags.c_contiguous and got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(_host(got).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=str)
def test_permuted_views_take_the_tiled_copy(dtype):
    """NHWC views of NCHW arrays, ragged against the 32 x 32 tiles, take the transpose kernel."""
    dtype = np.dtype(dtype)
    host = _make((3, 70, 5, 33), dtype, 1)
    view = _device(host).transpose(0, 2, 3, 1)
    assert cuda_arrays._transpose_plan(view)[2] == 1   # (3, 5 * 33, 70): the merged H and W axis
    got = cuda_arrays.c_contiguous(view)
    assert np.array_equal(_host(got).view(np.uint8), np.ascontiguousarray(host.transpose(0, 2, 3, 1)).view(np.uint8))


def test_the_tiled_copy_replays_from_a_captured_graph():
    cp = cupy_module()
    x = cp.asarray(np.random.default_rng(2).standard_normal((4, 64, 9, 9)).astype(np.float32))
    graph, y = capture_graph(lambda: cuda_arrays.c_contiguous(x.transpose(0, 2, 3, 1)))
    x[...] = cp.asarray(np.random.default_rng(3).standard_normal((4, 64, 9, 9)).astype(np.float32))
    graph.launch()
    cp.cuda.get_current_stream().synchronize()
    cp.testing.assert_array_equal(y, cp.ascontiguousarray(x.transpose(0, 2, 3, 1)))
