"""The plans of matrix products as cuBLAS calls (fluxpy.kernels.gemm_plan) and the host side of the cuBLAS kernel
(fluxpy.kernels.cublas), without a GPU: NumPy operands of every layout (transposed matrices, permuted and broadcast
batch axes, steps, reversed axes) are laid out as the kernel lays them out, and a stand-in for the cuBLAS library
runs the kernel's exact ctypes calls, reading host memory by address as column-major cuBLAS reads the device's
(its signatures are the documented ones). The product must be NumPy's, in every dtype the kernel takes."""
import ctypes
import types

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from fluxpy.kernels import cublas
from fluxpy.kernels.gemm_plan import INT_MAX, batch_stride, matmul_shape, matrix_layout, plan_matmul
from fluxpy.kernels.halfs import BFLOAT16

DTYPES = [np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)]
TOL = {np.dtype(np.float16): 1e-2, BFLOAT16: 2e-2, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


# ---------------------------------------------------------------------------------------------
# Operands of every layout


def _stored(rng, shape, how, axis, dtype=np.float64, xp=np):
    """A random array of ``shape`` and ``dtype`` (of ``xp``: NumPy, or CuPy for the GPU tests) stored ``how``: C
    order, its matrices transposed, its axes permuted, every other element of a larger array along ``axis``, reversed
    along ``axis``, or broadcast (stride 0) along ``axis``."""
    shape = tuple(shape)
    axis = axis % len(shape)

    def values(s):   # C-ordered, made on the host (a half one moved as its bits: no conversion on the device)
        v = rng.standard_normal(s).astype(dtype)
        return v if xp is np else xp.asarray(v.view(np.uint16)).view(v.dtype) if v.itemsize == 2 else xp.asarray(v)
    if how == "transposed":
        return values(shape[:-2] + shape[:-3:-1]).swapaxes(-1, -2)
    if how == "permuted":
        order = rng.permutation(len(shape))
        return values(tuple(shape[i] for i in order)).transpose(tuple(int(i) for i in np.argsort(order)))
    if how == "step":
        big = list(shape)
        big[axis] *= 2
        return values(tuple(big))[(slice(None),) * axis + (slice(None, None, 2),)]
    if how == "reversed":
        return values(shape)[(slice(None),) * axis + (slice(None, None, -1),)]
    if how == "broadcast":
        small = list(shape)
        small[axis] = 1
        return xp.broadcast_to(values(tuple(small)), shape)
    return values(shape)


HOWS = ["c", "transposed", "permuted", "step", "reversed", "broadcast"]


@st.composite
def products(draw, dtype, max_batch=3, max_size=4, xp=np):
    """``(a, b)`` operands of ``matmul`` (2 or more axes each; NumPy arrays, or ``xp``'s), batch axes
    broadcasting."""
    batch = draw(st.lists(st.integers(1, 3), max_size=max_batch))
    m, k, n = (draw(st.integers(0 if draw(st.booleans()) else 1, max_size)) for _ in range(3))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    ops = []
    for rows, cols in ((m, k), (k, n)):
        own = batch[draw(st.integers(0, len(batch))):]
        own = [1 if draw(st.integers(0, 3)) == 0 else s for s in own]   # some axes broadcast as size 1
        how, axis = draw(st.sampled_from(HOWS)), draw(st.integers(0, 8))
        ops.append(_stored(rng, own + [rows, cols], how, axis, dtype, xp))
    return tuple(ops)


def _elements(x):
    return tuple(x.shape), tuple(s // x.itemsize for s in x.strides)


# ---------------------------------------------------------------------------------------------
# A stand-in for libcublas: the documented signatures, reading host memory by address


_HALF_TYPES = {2: np.dtype(np.float16), 14: BFLOAT16, 0: np.dtype(np.float32)}


class FakeCublas:
    """The six gemm calls of cuBLAS on host memory (``C = alpha op(A) op(B) + beta C``, column-major, per batch
    entry ``A + i strideA`` ...). Every read and write must fall inside one of the ``buffers`` registered."""

    def __init__(self):
        self.buffers, self.calls = [], []

    def register(self, *arrays):
        for x in arrays:
            root = x
            while isinstance(root.base, np.ndarray):
                root = root.base
            self.buffers.append((root.__array_interface__["data"][0], root.nbytes))

    def _view(self, ptr, dtype, offsets):
        """The elements at ``ptr + offsets`` (in elements of ``dtype``) as an array, after checking the range."""
        lo, hi = int(offsets.min()), int(offsets.max())
        start, end = ptr + lo * dtype.itemsize, ptr + (hi + 1) * dtype.itemsize
        assert any(b <= start and end <= b + n for b, n in self.buffers), "cuBLAS would read or write outside"
        raw = np.frombuffer((ctypes.c_char * (end - start)).from_address(start), dtype=dtype)
        return raw, offsets - lo

    def _matrix(self, ptr, dtype, op, rows, cols, ld, stride, batch):
        """``op(X)`` ``(batch, rows, cols)`` of the column-major X stored at ``ptr`` with ``ld`` and ``stride``."""
        assert op in (0, 1)
        stored_rows = rows if op == 0 else cols
        assert ld >= max(1, stored_rows), f"ld {ld} below the stored matrix's {stored_rows} rows"
        t, i, j = np.meshgrid(np.arange(batch), np.arange(rows), np.arange(cols), indexing="ij")
        offsets = t * stride + (i + j * ld if op == 0 else j + i * ld)
        raw, idx = self._view(ptr, dtype, offsets)
        return raw[idx].astype(np.float64)

    def _run(self, name, dtype, transa, transb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch):
        self.calls.append(name)
        assert min(m, n, k, batch) >= 1 and max(m, n, k, lda, ldb, ldc, batch) <= INT_MAX
        a = self._matrix(A, dtype, transa, m, k, lda, sa, batch)
        b = self._matrix(B, dtype, transb, k, n, ldb, sb, batch)
        assert ldc >= max(1, m) and (batch == 1 or sc >= ldc * n), "the C matrices would overlap"
        t, i, j = np.meshgrid(np.arange(batch), np.arange(m), np.arange(n), indexing="ij")
        raw, idx = self._view(C, dtype, t * sc + i + j * ldc)
        alpha, beta = alpha._obj.value, beta._obj.value
        assert (alpha, beta) == (1.0, 0.0)
        raw[idx] = (alpha * np.matmul(a, b)).astype(dtype)
        return 0

    def cublasSgemm_v2(self, h, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        assert isinstance(alpha._obj, ctypes.c_float)
        return self._run("Sgemm", np.dtype(np.float32), ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc,
                         0, 1)

    def cublasDgemm_v2(self, h, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        assert isinstance(alpha._obj, ctypes.c_double)
        return self._run("Dgemm", np.dtype(np.float64), ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc,
                         0, 1)

    def cublasGemmEx(self, h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc, compute, algo):
        assert at == bt == ct and at in _HALF_TYPES and (compute, algo) == (68, -1)
        return self._run("GemmEx", _HALF_TYPES[at], ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc,
                         0, 1)

    def cublasSgemmStridedBatched(self, h, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch):
        assert isinstance(alpha._obj, ctypes.c_float)
        return self._run("SgemmStridedBatched", np.dtype(np.float32), ta, tb, m, n, k, alpha, A, lda, sa, B, ldb,
                         sb, beta, C, ldc, sc, batch)

    def cublasDgemmStridedBatched(self, h, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch):
        assert isinstance(alpha._obj, ctypes.c_double)
        return self._run("DgemmStridedBatched", np.dtype(np.float64), ta, tb, m, n, k, alpha, A, lda, sa, B, ldb,
                         sb, beta, C, ldc, sc, batch)

    def cublasGemmStridedBatchedEx(self, h, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct,
                                   ldc, sc, batch, compute, algo):
        assert at == bt == ct and at in _HALF_TYPES and (compute, algo) == (68, -1)
        return self._run("GemmStridedBatchedEx", _HALF_TYPES[at], ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb,
                         beta, C, ldc, sc, batch)


def test_the_stand_in_has_the_signatures_the_binding_declares():
    import inspect
    for name, args in cublas._SIGNATURES.items():
        if "gemm" in name.lower():
            assert len(inspect.signature(getattr(FakeCublas, name)).parameters) - 1 == len(args), name


_FAKE_CUPY = types.SimpleNamespace(ndarray=np.ndarray, empty=np.empty, zeros=np.zeros, float32=np.float32)


def _run_kernel(a, b):
    """``a @ b`` through the kernel (``matmul_supports``, then ``matmul``: plan, layout, copies, the ctypes call) with
    NumPy arrays standing for CuPy's and :class:`FakeCublas` for the library; the plan and the stand-in too."""
    ((plan, got),), fake = _run_kernels([(a, b)])
    return plan, got, fake


def _run_kernels(pairs):
    """Each ``a @ b`` of ``pairs`` in turn through the kernel (see :func:`_run_kernel`), one stand-in library and one
    table of planned problems for them all: ``([(plan, result), ...], stand-in)``."""
    fake, seen = FakeCublas(), []
    laid_out = cublas._laid_out

    def laid_out_and_registered(x, side, operand, batch_shape):
        out = laid_out(x, side, operand, batch_shape)
        if operand.copy is None:
            assert np.shares_memory(out, x)   # read where it lies: no copy
        fake.register(out)
        return out

    def pointer_of_registered(x):   # an operand read where it lies (or promoted) reaches cuBLAS only so
        fake.register(x)
        return x.__array_interface__["data"][0]

    def empty(shape, dtype):
        out = np.empty(shape, dtype)
        fake.register(out)
        seen.append(out)
        return out
    results = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cublas, "cupy", types.SimpleNamespace(**{**vars(_FAKE_CUPY), "empty": empty}))
        patch.setattr(cublas, "_load", lambda: fake)
        patch.setattr(cublas, "_handle", lambda lib, dtype: 0)
        patch.setattr(cublas, "_pointer", pointer_of_registered)
        patch.setattr(cublas, "_laid_out", laid_out_and_registered)
        patch.setattr(cublas, "_problems", {})   # the calls bound to this stand-in only
        for a, b in pairs:
            calls_before = len(fake.calls)
            assert cublas.matmul_supports(a, b)
            got = cublas.matmul(a, b)
            plan = _reference_plan(*(x.astype(np.result_type(a.dtype, b.dtype), copy=False) for x in (a, b)))
            half = a.dtype in (np.float16, BFLOAT16)
            if plan.kind in ("empty", "zeros"):
                assert len(fake.calls) == calls_before
            else:
                name = "GemmEx" if half else {np.float32: "Sgemm", np.float64: "Dgemm"}[got.dtype.type]
                if plan.kind == "strided":
                    name = "GemmStridedBatchedEx" if half else name + "StridedBatched"
                assert fake.calls[calls_before:] == [name] and seen and np.shares_memory(got, seen[-1])
            results.append((plan, got))
    return results, fake


def _reference_plan(a, b):
    """The plan of ``a @ b`` as this test makes it (the planner itself, not the kernel's table of problems)."""
    va, vb = cublas._matrix_view(a, "a"), cublas._matrix_view(b, "b")
    return plan_matmul(va[0], va[1], vb[0], vb[1])


def test_a_problem_is_planned_once_and_each_layout_of_it_apart():
    rng = np.random.default_rng(5)
    a, w = rng.standard_normal((6, 4)), rng.standard_normal((5, 4))
    column_major = np.asfortranarray(w.T)   # w.T as a copy: the same layout as the view w.T, another array
    pairs = [(a, w.T), (a + 1, w.T), (a, column_major), (a, np.ascontiguousarray(w.T)), (a[:3], w.T), (a, w.T)]
    planned = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cublas, "plan_matmul", lambda *args: planned.append(args) or plan_matmul(*args))
        results, _ = _run_kernels(pairs)
    # (6, 4) @ w.T planned once for its three calls and the column-major copy; C-ordered w.T and 3 rows apart
    assert len(planned) == 3
    assert [plan.b.transposed for plan, _ in results] == [True, True, True, False, True, True]
    for (a_, b_), (_, got) in zip(pairs, results):
        np.testing.assert_allclose(got, a_ @ b_, rtol=1e-12)


@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_every_layout_and_broadcast_runs_as_one_call_giving_numpys_product(data, dtype):
    a, b = data.draw(products(dtype))
    plan, got, fake = _run_kernel(a, b)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert got.shape == want.shape and got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * (1 + plan.k))


@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_products_sharing_one_table_of_problems_each_give_numpys_product(data, dtype):
    pairs = [data.draw(products(dtype)) for _ in range(3)]
    pairs += pairs[::-1]   # each problem again, after the others: planned then, reused now
    results, _ = _run_kernels(pairs)
    for (a, b), (_, got) in zip(pairs, results):
        want = np.matmul(a.astype(np.float64), b.astype(np.float64))
        assert got.shape == want.shape and got.dtype == dtype
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * 5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_dimensional_operands_as_numpy_promotes_them(dtype):
    rng = np.random.default_rng(0)
    for sa, sb in [((4,), (4,)), ((4,), (2, 4, 3)), ((2, 3, 4), (4,)), ((3,), (3, 5))]:
        a, b = rng.standard_normal(sa).astype(dtype), rng.standard_normal(sb).astype(dtype)
        _, got, _ = _run_kernel(a, b)
        want = np.matmul(a.astype(np.float64), b.astype(np.float64))
        assert got.shape == want.shape
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * 5)


# ---------------------------------------------------------------------------------------------
# The plans the common products get


def test_the_products_of_dense_and_attention_need_no_copy():
    x, w = np.ones((16, 10, 32)), np.ones((64, 32))
    p = plan_matmul(*_elements(x), *_elements(w.T))   # Dense: one gemm over 160 rows, w.T column-major
    assert (p.kind, p.batch, p.a.copy, p.b.copy, p.b.transposed, p.b.stride) == ("gemm", 16, None, None, True, 0)
    q, k = np.ones((8, 4, 16, 32)), np.ones((8, 4, 24, 32))   # heads apart: q @ k^T and scores @ v
    p = plan_matmul(*_elements(q), *_elements(k.swapaxes(-1, -2)))
    assert (p.kind, p.batch, p.a.copy, p.b.copy, p.b.transposed) == ("strided", 32, None, None, True)
    s, v = np.ones((8, 4, 16, 24)), np.ones((8, 4, 24, 32))
    p = plan_matmul(*_elements(s.swapaxes(-1, -2)), *_elements(v[:, :, :16]))   # the pullback's s^T @ dy: a view
    assert (p.kind, p.a.copy, p.b.copy, p.a.transposed) == ("strided", None, None, True)
    p = plan_matmul(*_elements(np.ones((1, 16, 32))), *_elements(np.ones((6, 32, 8))))   # a broadcast: stride 0
    assert (p.kind, p.batch, p.a.stride, p.a.copy) == ("strided", 6, 0, None)


@given(data=st.data())
def test_a_single_product_is_one_plain_gemm_in_any_layout(data):
    a, b = data.draw(products(np.float32, max_batch=0))
    p = plan_matmul(*_elements(a), *_elements(b))
    assert p.kind in ("gemm", "empty", "zeros") and p.batch == 1


def test_split_heads_and_mixed_broadcasts_are_copied():
    q = np.ones((8, 16, 4, 32)).transpose(0, 2, 1, 3)   # (N, heads, L, d) viewed from (N, L, heads, d)
    p = plan_matmul(*_elements(q), *_elements(np.ones((8, 4, 32, 5))))
    assert p.a == type(p.a)("contiguous", False, 32, 16 * 32)
    p = plan_matmul(*_elements(np.ones((8, 1, 3, 2))), *_elements(np.ones((5, 2, 3))))
    assert p.a.copy == p.b.copy == "broadcast" and p.batch == 40


def test_single_rows_one_stride_apart_are_one_gemm():
    x = np.ones((6, 9, 32))[:, 4:5]   # the last step of each sequence: rows 9 * 32 apart
    p = plan_matmul(*_elements(x), *_elements(np.ones((32, 7))))
    assert (p.kind, p.a.ld, p.call().n) == ("gemm", 9 * 32, 6)


def test_empty_products_and_k_zero_need_no_call():
    assert plan_matmul((2, 0, 3), (0, 3, 1), (3, 4), (4, 1)).kind == "empty"
    assert plan_matmul((0, 2, 3), (6, 3, 1), (3, 4), (4, 1)).kind == "empty"
    assert plan_matmul((2, 3, 0), (0, 0, 1), (0, 4), (4, 1)).kind == "zeros"


def test_sizes_beyond_32_bit_ints_are_declined_and_a_long_batch_stays_batched():
    big = INT_MAX + 1
    assert plan_matmul((big, 2), (2, 1), (2, 3), (3, 1)) is None
    assert plan_matmul((2, big), (big, 1), (big, 3), (3, 1)) is None
    p = plan_matmul((2**17, 2**15, 2), (2**16, 2, 1), (2, 3), (3, 1))   # 2^32 rows: not one gemm
    assert p.kind == "strided" and p.batch == 2**17
    assert plan_matmul((2**16, 2**16, 1, 2), (2**17, 2, 2, 1), (2**16, 2**16, 2, 1), (2, 2, 1, 1)) is None


def test_mismatched_shapes_have_no_plan():
    assert plan_matmul((2, 3), (3, 1), (4, 5), (5, 1)) is None
    assert plan_matmul((2, 2, 3), (6, 3, 1), (3, 3, 5), (15, 5, 1)) is None
    assert matmul_shape((3,), (4,)) is None and matmul_shape((), (3,)) is None


@given(rows=st.integers(1, 5), cols=st.integers(1, 5), sr=st.integers(-3, 12), sc=st.integers(-3, 12))
def test_matrix_layout_reads_every_element_where_it_lies(rows, cols, sr, sc):
    got = matrix_layout(rows, cols, sr, sc)
    if got is None:
        assert not ((sc == 1 or cols == 1) and sr >= cols) and not ((sr == 1 or rows == 1) and sc >= rows) or \
            (rows > 1 and cols > 1 and sr == sc == 1)
        return
    transposed, ld = got
    assert ld >= (rows if transposed else cols) >= 1
    for i in range(rows):
        for j in range(cols):
            where = (i * sr if rows > 1 else 0) + (j * sc if cols > 1 else 0)   # a length-1 axis is never stepped
            assert (i + j * ld if transposed else j + i * ld) == where


@given(batch=st.lists(st.integers(1, 4), max_size=4), seed=st.integers(0, 2**16))
def test_batch_stride_steps_through_the_flattened_batch(batch, seed):
    rng = np.random.default_rng(seed)
    own = [1 if rng.random() < 0.3 else n for n in batch[rng.integers(0, len(batch) + 1):]]
    x = _stored(rng, own + [2, 2], rng.choice(HOWS), int(rng.integers(0, 8)))
    shape, strides = _elements(x)
    step = batch_stride(tuple(batch), shape[:-2], strides[:-2])
    full = np.broadcast_to(x, tuple(batch) + (2, 2)).reshape(-1, 2, 2) if batch else x.reshape(1, 2, 2)
    if step is None:
        return
    first = x[(0,) * (x.ndim - 2)]
    base = first.__array_interface__["data"][0]
    for t, mat in enumerate(full):
        assert mat.__array_interface__["data"][0] == base + t * step * x.itemsize


def test_float32_with_float64_is_promoted_and_other_dtypes_are_declined():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((4, 5))
    _, got, _ = _run_kernel(a, b)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-12)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cublas, "cupy", _FAKE_CUPY)
        assert not cublas.matmul_supports(np.ones((2, 3), np.int32), np.ones((3, 2), np.int32))
        assert not cublas.matmul_supports(np.ones((2, 3), np.float16), np.ones((3, 2), np.float32))
        assert not cublas.matmul_supports(np.ones((2, 3)), np.ones((4, 2)))   # shapes that do not fit
