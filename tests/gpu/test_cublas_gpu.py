"""The ``matmul`` kernel of our cuBLAS binding (``fluxpy.kernels.cublas``) against NumPy in float64 and CuPy's
own product, for every layout it takes; the products it declines still come out right (as ``a @ b``); and it
can be captured into a CUDA graph and replayed, which CuPy's cuBLAS calls cannot.
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

import fluxpy
from fluxpy.kernels import cublas, find
from fluxpy.kernels.halfs import BFLOAT16
from sweeps import examples
from test_matmul_plan import products

pytestmark = pytest.mark.gpu

TOL = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float64: dict(rtol=1e-12, atol=1e-12)}


def _laid_out(cp, host, column_major):
    """``host`` on the GPU, stored row-major or column-major (a transposed view of a row-major buffer)."""
    return cp.asarray(host.T).T if column_major else cp.asarray(host)


@examples(40)
@given(m=st.integers(1, 70), k=st.integers(1, 70), n=st.integers(1, 70), a_col=st.booleans(), b_col=st.booleans(),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16))
def test_matrix_products_in_every_layout_match_numpy(m, k, n, a_col, b_col, dtype, seed):
    import cupy as cp
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    ga, gb = _laid_out(cp, a, a_col), _laid_out(cp, b, b_col)
    assert cublas.matmul_supports(ga, gb)
    got = cublas.matmul(ga, gb)
    assert got.shape == (m, n) and got.dtype == dtype and got.flags.c_contiguous
    np.testing.assert_allclose(cp.asnumpy(got), a.astype(np.float64) @ b.astype(np.float64), **TOL[dtype])
    np.testing.assert_allclose(cp.asnumpy(got), cp.asnumpy(ga @ gb), **TOL[dtype])


@pytest.mark.parametrize("lead", [(3,), (2, 4), (1, 1, 5)])
def test_batched_rows_times_a_matrix(lead):
    import cupy as cp
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((*lead, 6, 5)), rng.standard_normal((5, 7))
    got = cublas.matmul(cp.asarray(a), cp.asarray(b))
    assert got.shape == (*lead, 6, 7)
    np.testing.assert_allclose(cp.asnumpy(got), a @ b, rtol=1e-12, atol=1e-12)


def test_the_dense_layer_and_its_gradient_run_through_the_kernel_and_match_the_cpu(monkeypatch):
    import cupy as cp
    calls = []
    original = cublas.matmul
    monkeypatch.setitem(fluxpy.kernels._KERNELS, ("matmul", "cupy"),
                        (lambda a, b: calls.append(1) or original(a, b), cublas.matmul_supports))
    rng = np.random.default_rng(2)
    layer = fluxpy.f64(fluxpy.Dense(5, 3, fluxpy.relu, rng=rng))
    x = rng.standard_normal((4, 5))
    want_y = layer(x)
    want_g = fluxpy.gradient(lambda m, x: (m(x) ** 2).sum(), layer, x)
    glayer, gx = fluxpy.gpu(layer), cp.asarray(x)
    np.testing.assert_allclose(cp.asnumpy(glayer(gx)), want_y, rtol=1e-12)
    got_g = fluxpy.gradient(lambda m, x: (m(x) ** 2).sum(), glayer, gx)
    np.testing.assert_allclose(cp.asnumpy(got_g[1]), want_g[1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cp.asnumpy(got_g[0]["weight"]), want_g[0]["weight"], rtol=1e-12, atol=1e-12)
    assert len(calls) >= 3   # the forward product and both products of the pullback


def test_batched_vector_empty_strided_and_mixed_products_run_through_the_kernel():
    import cupy as cp
    rng = np.random.default_rng(3)
    cases = [(rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 5))),   # batched on both sides
             (rng.standard_normal(4), rng.standard_normal((4, 3))),              # a vector
             (rng.standard_normal((0, 4)), rng.standard_normal((4, 3))),         # an empty axis
             (rng.standard_normal((2, 0)), rng.standard_normal((0, 3))),         # k == 0: zeros
             (rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4, 2)))]  # float32 with float64
    for a, b in cases:
        ga, gb = cp.asarray(a), cp.asarray(b)
        assert find("matmul", ga, gb) is not None
        got = fluxpy.matmul(ga, gb)
        assert got.shape == (a @ b).shape and got.dtype == (a @ b).dtype
        np.testing.assert_allclose(cp.asnumpy(got), a @ b, rtol=1e-6, atol=1e-6)
    strided = cp.asarray(rng.standard_normal((6, 8)))[::2, ::2]   # neither row- nor column-major: copied first
    assert cublas.matmul_supports(strided, cp.ones((4, 2)))
    np.testing.assert_allclose(cp.asnumpy(fluxpy.matmul(strided, cp.ones((4, 2)))),
                               cp.asnumpy(strided) @ np.ones((4, 2)), rtol=1e-12)


def test_products_of_other_dtypes_still_run_as_a_at_b():
    import cupy as cp
    a, b = cp.arange(12, dtype=cp.int32).reshape(3, 4), cp.ones((4, 2), cp.int32)
    assert find("matmul", a, b) is None
    np.testing.assert_array_equal(cp.asnumpy(fluxpy.matmul(a, b)), cp.asnumpy(a) @ np.ones((4, 2), np.int32))


def test_a_product_on_another_stream_and_with_tf32():
    import cupy as cp
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((32, 16)).astype(np.float32)
    with cp.cuda.Stream(non_blocking=True) as s:
        got = cublas.matmul(cp.asarray(a), cp.asarray(b))
        s.synchronize()
    np.testing.assert_allclose(cp.asnumpy(got), a @ b, rtol=1e-5, atol=1e-5)
    with fluxpy.options(allow_tf32=True):
        tf32 = cublas.matmul(cp.asarray(a), cp.asarray(b))
    np.testing.assert_allclose(cp.asnumpy(tf32), a @ b, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(cp.asnumpy(cublas.matmul(cp.asarray(a), cp.asarray(b))), a @ b, rtol=1e-5, atol=1e-5)


def test_captured_into_a_cuda_graph_and_replayed_on_new_inputs():
    import cupy as cp
    rng = np.random.default_rng(5)
    a, b = cp.asarray(rng.standard_normal((8, 6))), cp.asarray(rng.standard_normal((6, 5)))
    cublas.matmul(a, b)   # the handle and the stream's workspace exist before capture
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cublas.matmul(a, b)
        stream.begin_capture()
        out = cublas.matmul(a, b)
        graph = stream.end_capture()
    for _ in range(2):
        new_a = rng.standard_normal((8, 6))
        with stream:
            a[...] = cp.asarray(new_a)   # the graph's static input, written on the graph's stream
            graph.launch(stream)
        stream.synchronize()
        np.testing.assert_allclose(cp.asnumpy(out), new_a @ cp.asnumpy(b), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Batched products (strided-batched calls) in every dtype, and captured


DTYPES = [np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)]
BATCH_TOL = {np.dtype(np.float16): 1e-2, BFLOAT16: 2e-2, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


def _host64(cp, x):
    """``x``'s values on the host in float64 (a half array moved as its bits: no conversion on the device)."""
    return (cp.asnumpy(x.view(cp.uint16)).view(x.dtype) if x.itemsize == 2 else cp.asnumpy(x)).astype(np.float64)


def _device(cp, host):
    """A C-ordered device copy of the host array ``host`` (a half one moved as its bits)."""
    host = np.ascontiguousarray(host)
    return cp.asarray(host.view(np.uint16)).view(host.dtype) if host.itemsize == 2 else cp.asarray(host)


def _contiguous(cp, x):
    """A C-ordered copy of the device array ``x`` (a half one copied as its bits)."""
    return cp.ascontiguousarray(x.view(cp.uint16)).view(x.dtype) if x.itemsize == 2 else cp.ascontiguousarray(x)


def _reference(cp, a, b):
    """CuPy's own matmul of the operands' values in float64 (as host arrays)."""
    return cp.asnumpy(cp.matmul(cp.asarray(_host64(cp, a)), cp.asarray(_host64(cp, b))))


@examples(60, default=24)
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_batched_products_of_every_layout_and_broadcast_match_cupys_float64_product(data, dtype):
    import cupy as cp
    a, b = data.draw(products(dtype, max_batch=3, max_size=40, xp=cp))
    assert cublas.matmul_supports(a, b)
    got = cublas.matmul(a, b)
    want = _reference(cp, a, b)
    assert got.shape == want.shape and got.dtype == dtype and got.flags.c_contiguous
    k = a.shape[-1]
    np.testing.assert_allclose(_host64(cp, got), want, rtol=BATCH_TOL[dtype], atol=BATCH_TOL[dtype] * (1 + k))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_shaped_products_in_every_dtype(dtype):
    import cupy as cp
    rng = np.random.default_rng(6)
    n, length, heads, d = 4, 33, 3, 16
    x = _device(cp, rng.standard_normal((n, length, heads * d)).astype(dtype))
    qh = x.reshape(n, length, heads, d).transpose(0, 2, 1, 3)           # split heads: a copy
    qc = _contiguous(cp, qh)
    cases = [(qh, qh.swapaxes(-1, -2)),                                 # q @ k^T
             (qc, qc.swapaxes(-1, -2)),                                 # heads apart: no copy
             (qc[:, :1], qc.swapaxes(-1, -2)),                          # a broadcast head
             (qc.swapaxes(-1, -2), qc)]                                 # s^T @ dy in a pullback
    for a, b in cases:
        got = fluxpy.matmul(a, b)
        np.testing.assert_allclose(_host64(cp, got), _reference(cp, a, b), rtol=BATCH_TOL[dtype],
                                   atol=BATCH_TOL[dtype] * (1 + a.shape[-1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_batched_product_is_captured_and_replayed_on_new_inputs(dtype):
    import cupy as cp
    from fluxpy.backend import capture_graph
    rng = np.random.default_rng(7)
    a = _device(cp, rng.standard_normal((3, 4, 9, 8)).astype(dtype))
    b = _device(cp, rng.standard_normal((4, 10, 8)).astype(dtype))   # broadcast over the first axis, transposed

    def product():
        return fluxpy.matmul(a[:, :, ::2], b.swapaxes(-1, -2))
    product()   # eager first: the handle exists
    graph, out = capture_graph(product)
    for _ in range(2):
        bits = cp.uint16 if a.itemsize == 2 else a.dtype   # the graph's input overwritten, a half as its bits
        a.view(bits)[...] = _device(cp, rng.standard_normal(a.shape).astype(dtype)).view(bits)
        graph.launch()
        cp.cuda.Device().synchronize()
        np.testing.assert_allclose(_host64(cp, out), _reference(cp, a[:, :, ::2], b.swapaxes(-1, -2)),
                                   rtol=BATCH_TOL[dtype], atol=BATCH_TOL[dtype] * 9)


def test_a_batched_product_is_captured_by_a_plain_stream_capture():
    import cupy as cp
    rng = np.random.default_rng(8)
    a, b = cp.asarray(rng.standard_normal((5, 6, 7))), cp.asarray(rng.standard_normal((5, 7, 3)))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fluxpy.matmul(a, b)   # this stream's workspace exists before the capture
        stream.begin_capture()
        out = fluxpy.matmul(a, b.swapaxes(-1, -2).copy().swapaxes(-1, -2))
        graph = stream.end_capture()
    new = rng.standard_normal(a.shape)
    with stream:
        a[...] = cp.asarray(new)
        graph.launch(stream)
    stream.synchronize()
    np.testing.assert_allclose(cp.asnumpy(out), new @ cp.asnumpy(b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=str)
def test_multi_head_attention_forward_and_backward_capture_and_match_eager(dtype):
    import cupy as cp
    from fluxpy.backend import capture_graph
    rng = np.random.default_rng(9)
    mha = fluxpy.gpu(fluxpy.MultiHeadAttention(16, nheads=4, bias=True, rng=0))
    if dtype != np.float32:
        mha = (fluxpy.f16 if dtype == np.float16 else fluxpy.bf16)(mha)
    x = _device(cp, rng.standard_normal((3, 12, 16)).astype(dtype))
    dy = cp.asarray(rng.standard_normal((3, 12, 16)).astype(np.float32))
    mask = fluxpy.causal_mask(x)

    def run():
        return fluxpy.gradient(lambda m, x: (fluxpy.ops.shape.astype(m(x, mask=mask)[0], np.float32) * dy).sum(),
                               mha, x)
    eager = run()
    graph, captured = capture_graph(run)
    graph.launch()
    cp.cuda.Device().synchronize()
    tol = 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(_host64(cp, captured[1]), _host64(cp, eager[1]), rtol=tol, atol=tol)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        np.testing.assert_allclose(_host64(cp, captured[0][name]["weight"]), _host64(cp, eager[0][name]["weight"]),
                                   rtol=tol, atol=tol)
