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
from sweeps import examples

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


def test_products_it_declines_still_run_as_a_at_b():
    import cupy as cp
    rng = np.random.default_rng(3)
    cases = [(rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 5))),   # batched on both sides
             (rng.standard_normal(4), rng.standard_normal((4, 3))),              # a vector
             (rng.standard_normal((0, 4)), rng.standard_normal((4, 3))),         # an empty axis
             (rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4, 2)))]  # mixed dtypes
    for a, b in cases:
        ga, gb = cp.asarray(a), cp.asarray(b)
        assert find("matmul", ga, gb) is None
        got = fluxpy.matmul(ga, gb)
        np.testing.assert_allclose(cp.asnumpy(got), a @ b, rtol=1e-3 if a.dtype == np.float16 else 1e-6, atol=1e-3)
    strided = cp.asarray(rng.standard_normal((6, 8)))[::2, ::2]   # neither row- nor column-major
    assert not cublas.matmul_supports(strided, cp.ones((4, 2)))
    np.testing.assert_allclose(cp.asnumpy(fluxpy.matmul(strided, cp.ones((4, 2)))),
                               cp.asnumpy(strided) @ np.ones((4, 2)), rtol=1e-12)


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
