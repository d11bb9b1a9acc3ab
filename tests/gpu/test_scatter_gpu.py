"""scatter and gather on CuPy arrays (fluxpy/kernels/cuda_scatter.py: one_block, atomic and sorted scatters chosen
by measurement, one gather kernel, index checks inside the kernels) against the NumPy path: every implementation,
op and dtype, repeated indices and unused destination rows, index tuples, empty problems, the choice and its
cache, deterministic mode, bad indices on the device, gradients, and the gradient of indexing and of Embedding.
Needs a GPU (``gpu`` marker)."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from devices import assert_matches_cpu, cupy_module
from fluxpy import kernels
from fluxpy.ops import gather, scatter
from sweeps import examples, sweep

pytestmark = pytest.mark.gpu

OPS = ("add", "max", "min", "mean")
DTYPES = (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.int64)


def _problem(seed, d=1, trailing=(3,)):
    """idx (tuple of d arrays of shape (7, 2)) with repeated entries, into leading axes of size 5 (some unused)."""
    rng = np.random.default_rng(seed)
    idx = tuple(rng.integers(0, 4, size=(7, 2)) for _ in range(d))   # row 4 never hit
    for i in idx:
        i.ravel()[:4] = np.arange(4)                                   # rows 0-3 always hit
    return rng, idx, (5,) * d + trailing


def _tolerance(dtype):
    return {np.dtype(np.float16): 1e-3, np.dtype(ml_dtypes.bfloat16): 1e-2, np.dtype(np.float32): 1e-6}.get(
        np.dtype(dtype), 1e-12)


def test_the_cuda_kernels_are_registered():
    from fluxpy.kernels import cuda_scatter
    cp = cupy_module()
    assert kernels.lookup("scatter", cp.ones(1)) is cuda_scatter.scatter
    assert kernels.lookup("gather", cp.ones(1)) is cuda_scatter.gather


@pytest.mark.parametrize("op, dtype, d", sweep(OPS, DTYPES, [1, 2]))
def test_scatter_matches_cpu(op, dtype, d):
    cp = cupy_module()
    rng, idx, shape = _problem(0, d)
    src = (rng.standard_normal(idx[0].shape + shape[d:]) * 10).astype(dtype)
    want = scatter(op, src, idx, dstsize=shape)
    got = scatter(op, cp.asarray(src), tuple(cp.asarray(i) for i in idx), dstsize=shape)
    assert got.dtype == want.dtype
    if np.dtype(dtype).kind in "iu" or op in ("max", "min"):   # exact: no rounding, -inf/inf/typemin rows equal
        np.testing.assert_array_equal(cp.asnumpy(got), want)
    else:
        assert_matches_cpu(got, want, rtol=_tolerance(dtype), atol=_tolerance(dtype))


def test_host_indices_with_device_src():
    cp = cupy_module()
    src, idx = np.arange(12.0).reshape(4, 3), np.array([2, 0, 2, 1])
    assert_matches_cpu(scatter("+", cp.asarray(src), idx), scatter("+", src, idx))
    assert_matches_cpu(gather(cp.asarray(src), idx), gather(src, idx))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_matches_cpu(dtype):
    cp = cupy_module()
    rng, idx, shape = _problem(1, 2)
    src = (rng.standard_normal(shape) * 10).astype(dtype)
    got = gather(cp.asarray(src), tuple(cp.asarray(i) for i in idx))
    np.testing.assert_array_equal(cp.asnumpy(got), gather(src, idx))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_scatter_gradient_matches_cpu(op, dtype):
    cp = cupy_module()
    rng, idx, shape = _problem(2)
    src = rng.permutation(14 * 3).reshape(7, 2, 3) * 0.1   # distinct: no ties for max/min
    cot = rng.standard_normal((4, 3))

    def loss(i, c):   # rows 0-3, all hit (row 4 is -inf/inf for max/min)
        return lambda x: (scatter(op, x, i, dstsize=shape)[:4] * c).sum()
    want, = fluxpy.gradient(loss(idx, cot), src)
    got, = fluxpy.gradient(loss(tuple(cp.asarray(i) for i in idx), cp.asarray(cot, dtype)), cp.asarray(src, dtype))
    assert_matches_cpu(got, want, rtol=_tolerance(dtype), atol=_tolerance(dtype))


def test_gather_gradient_and_second_order_match_cpu():
    cp = cupy_module()
    rng, idx, shape = _problem(3, 2)
    src, cot = rng.standard_normal(shape), rng.standard_normal(idx[0].shape + shape[2:])
    v = rng.standard_normal(shape)

    def grad(x, i, c):
        return fluxpy.gradient(lambda w: ((gather(w, i) ** 2) * c).sum(), x)[0]

    def hessian_times_v(x, i, c, v):
        return fluxpy.gradient(lambda z: (grad(z, i, c) * v).sum(), x)[0]
    dev = (cp.asarray(src), tuple(cp.asarray(i) for i in idx), cp.asarray(cot))
    assert_matches_cpu(grad(*dev), grad(src, idx, cot), rtol=1e-12)
    assert_matches_cpu(hessian_times_v(*dev, cp.asarray(v)), hessian_times_v(src, idx, cot, v), rtol=1e-12)


@pytest.mark.parametrize("index", [np.array([0, 0, 3, -1]), (np.array([[1], [1]]), np.array([0, 2])),
                                   (slice(None), np.array([0, 0, 2]))])
def test_getitem_gradient_matches_cpu(index):
    cp = cupy_module()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 3))
    dy = rng.standard_normal(x[index].shape)
    dev_index = tuple(cp.asarray(i) if isinstance(i, np.ndarray) else i for i in
                      (index if isinstance(index, tuple) else (index,)))
    got, = fluxpy.gradient(lambda v: (v[dev_index] * cp.asarray(dy)).sum(), cp.asarray(x))
    want, = fluxpy.gradient(lambda v: (v[index] * dy).sum(), x)
    assert_matches_cpu(got, want, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_embedding_gradient_matches_cpu(dtype):
    cp = cupy_module()
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((50, 8)).astype(dtype)
    tokens, dy = rng.integers(0, 40, size=(16, 12)), rng.standard_normal((16, 12, 8)).astype(dtype)
    grads = []
    for move in (lambda a: a, cp.asarray):
        emb = fluxpy.Embedding(50, 8)
        emb.weight = move(weight)
        grads.append(fluxpy.gradient(lambda m: (m(move(tokens)) * move(dy)).sum(), emb)[0]["weight"])
    assert_matches_cpu(grads[1], grads[0], rtol=_tolerance(dtype), atol=_tolerance(dtype) * 10)
    assert not cp.asnumpy(grads[1][40:]).astype(np.float32).any()   # rows no token hits: zero


@pytest.mark.parametrize("mode", ["deferred", "wait"])
def test_errors_are_raised_on_the_gpu_too(mode):
    cp = cupy_module()
    with fluxpy.options(index_checks=mode):
        idx, negative = cp.asarray([0, 5]), cp.asarray([-1])   # held: a deferred report can then name the entry
        with pytest.raises(IndexError, match="scatter: index 5 in idx is out of range"):
            scatter("+", cp.ones(2), idx, dstsize=3)
            fluxpy.check_indices()   # deferred: reported here
        with pytest.raises(IndexError, match="gather: expects non-negative"):
            gather(cp.ones(3), negative)
            fluxpy.check_indices()
    fluxpy.check_indices()


# ---------------------------------------------------------------------------------------------
# Every implementation, forced


INT_DTYPES = (np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64, np.uint64)


def _source(rng, shape, dtype):
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -100), min(info.max, 100), size=shape, endpoint=True).astype(dtype)
    return (rng.standard_normal(shape) * 10).astype(dtype)


@pytest.mark.parametrize("name, op, dtype, d, trailing", sweep(cases=[
    (name, op, dtype, d, trailing) for name in ("one_block", "atomic", "sorted") for op in ("add", "max", "min")
    for dtype in DTYPES + INT_DTYPES for d, trailing in [(1, (3,)), (2, (3,)), (1, ()), (3, (5, 2))]]))
def test_each_implementation_matches_cpu(name, op, dtype, d, trailing):
    from fluxpy.kernels import cpu, cuda_scatter
    cp = cupy_module()
    rng, idx, shape = _problem(7, d, trailing)
    src = _source(rng, idx[0].shape + shape[d:], dtype)
    want = cpu.halves_in_float32(cpu.scatter)(op, src, idx, shape)   # halves in float32, as the GPU
    got = cuda_scatter.scatter_with(name, op, cp.asarray(src), tuple(cp.asarray(i) for i in idx), shape)
    assert got.dtype == want.dtype and got.shape == want.shape
    if np.dtype(dtype).kind in "iu" or op in ("max", "min"):
        np.testing.assert_array_equal(cp.asnumpy(got), want)
    else:
        assert_matches_cpu(got, want, rtol=_tolerance(dtype), atol=_tolerance(dtype))


@pytest.mark.parametrize("name", ["one_block", "atomic", "sorted"])
def test_int32_indices_nan_and_empty_problems(name):
    from fluxpy.kernels import cuda_scatter
    cp = cupy_module()
    src = cp.asarray([[1.0, np.nan], [3.0, 2.0], [-1.0, 0.5]])
    idx = (cp.asarray([1, 1, 0], dtype=cp.int32),)
    got = cp.asnumpy(cuda_scatter.scatter_with(name, "max", src, idx, (3, 2)))
    np.testing.assert_array_equal(got, [[-1.0, 0.5], [3.0, np.nan], [-np.inf, -np.inf]])   # NaN wins, as NumPy
    empty = cuda_scatter.scatter_with(name, "add", cp.ones((0, 2)), (cp.zeros(0, cp.int64),), (4, 2))
    np.testing.assert_array_equal(cp.asnumpy(empty), np.zeros((4, 2)))
    assert cuda_scatter.scatter_with(name, "add", cp.ones((2, 0)), (cp.asarray([0, 1]),), (3, 0)).shape == (3, 0)


def test_scatter_along_the_last_axis_of_a_4d_array():
    """The benchmark's case in small: every element sent along the last axis (d = 4 index arrays, no columns)."""
    cp = cupy_module()
    rng = np.random.default_rng(8)
    shape = (3, 4, 5, 6)
    src = rng.standard_normal(shape)
    idx = tuple(np.broadcast_to(np.arange(n).reshape([-1 if a == j else 1 for a in range(4)]), shape)
                for j, n in enumerate(shape[:3])) + (rng.integers(0, 6, size=shape),)
    for op in ("add", "max"):
        want = scatter(op, src, idx, dstsize=shape)
        got = scatter(op, cp.asarray(src), tuple(cp.asarray(i) for i in idx), dstsize=shape)
        assert_matches_cpu(got, want, rtol=1e-12)
    assert_matches_cpu(gather(cp.asarray(src), tuple(cp.asarray(i) for i in idx)), gather(src, idx), rtol=0)


def test_strided_index_arrays_are_read_by_their_own_axes_only():
    """Index arrays of a strided layout are read through the strides they have (``cuda_scatter._reads``): a
    broadcast ``arange`` column by one axis, a transposed view and a reversed one (negative strides) by every axis,
    a broadcast scalar by none, a C-contiguous array at its entry number; gather and scatter-add against the CPU."""
    from fluxpy.kernels import cuda_scatter
    cp = cupy_module()
    rng = np.random.default_rng(21)
    shape, table_shape = (5, 6, 7), (4, 5, 6, 3, 4, 2)
    index = (cp.broadcast_to(cp.arange(5).reshape(5, 1, 1) % 4, shape),
             cp.asarray(rng.integers(0, 5, size=shape[::-1])).transpose(2, 1, 0),
             cp.asarray(rng.integers(0, 6, size=shape))[:, ::-1, :],
             cp.broadcast_to(cp.asarray(2), shape),
             cp.asarray(rng.integers(0, 4, size=shape)))
    assert cuda_scatter._reads(index) == ((0,), (0, 1, 2), (0, 1, 2), (), None)
    host = tuple(cp.asnumpy(i) for i in index)
    table = rng.standard_normal(table_shape)
    assert_matches_cpu(gather(cp.asarray(table), index), gather(table, host), rtol=0)
    values = rng.standard_normal(shape + (2,))
    assert_matches_cpu(scatter("+", cp.asarray(values), index, dstsize=table_shape),
                       scatter("+", values, host, dstsize=table_shape), rtol=1e-12)


def test_the_choice_is_measured_once_and_kept():
    from fluxpy.kernels import cuda_scatter
    cp = cupy_module()
    cuda_scatter.clear_choices()
    src, idx = cp.asarray(np.random.default_rng(9).standard_normal((300, 16))), cp.arange(300) % 7
    first = scatter("+", src, idx, dstsize=(7, 16))
    kept = cuda_scatter.choices()
    assert len(kept) == 1
    (key, (name, times)), = kept.items()
    assert name in cuda_scatter.IMPLEMENTATIONS and set(times) == {"one_block", "atomic", "sorted"}
    assert times[name] == min(times.values())
    again = scatter("+", src, idx, dstsize=(7, 16))
    assert cuda_scatter.choices() == kept
    assert_matches_cpu(again, cp.asnumpy(first), rtol=1e-12)


def test_deterministic_mode_uses_deterministic_implementations_only():
    from fluxpy.kernels import cuda_scatter
    cp = cupy_module()
    rng = np.random.default_rng(10)
    src, idx = cp.asarray(rng.standard_normal((20000, 64)).astype(np.float32)), cp.asarray(rng.integers(0, 50, 20000))
    cuda_scatter.clear_choices()
    try:
        with fluxpy.options(deterministic=True):
            results = [cp.asnumpy(scatter("+", src, idx, dstsize=(50, 64))) for _ in range(3)]
            (name, times), = cuda_scatter.choices().values()
            assert name != "atomic" and "atomic" not in times
    finally:
        cuda_scatter.clear_choices()
    assert all(np.array_equal(r, results[0]) for r in results)   # bit for bit


@pytest.mark.parametrize("call, words", [
    (lambda cp: scatter("+", cp.ones(3), cp.asarray([0, -2, 1]), dstsize=4), ["scatter", "non-negative", "-2"]),
    (lambda cp: scatter("max", cp.ones((3, 2)), (cp.asarray([0, 1, 1]), cp.asarray([0, 9, 1])), dstsize=(2, 3, 2)),
     ["scatter", "index 9", "idx[1]", "axis 1 of size 3"]),
    (lambda cp: scatter("mean", cp.ones(2), cp.asarray([4, 0]), dstsize=3), ["scatter", "index 4", "size 3"]),
    (lambda cp: gather(cp.ones((4, 2)), cp.asarray([[0, 4]])), ["gather", "index 4", "size 4"]),
    (lambda cp: gather(cp.ones((4, 2)), (cp.asarray([1]), cp.asarray([-3]))), ["gather", "non-negative", "idx[1]"]),
])
@pytest.mark.parametrize("mode", ["deferred", "wait"])
def test_bad_device_indices_raise_naming_the_entry_and_the_next_call_is_clean(call, words, mode):
    cp = cupy_module()
    with fluxpy.options(index_checks=mode):
        with pytest.raises(IndexError) as info:
            call(cp)   # deferred: returns; its index arrays are the lambda's temporaries, gone by the report
            fluxpy.check_indices()
        for w in words[:1] + (words[1:] if mode == "wait" else []):   # deferred: the entry while its arrays live
            assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"
        assert_matches_cpu(scatter("+", cp.ones(2), cp.asarray([1, 1]), dstsize=2), np.array([0.0, 2.0]))
        fluxpy.check_indices()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int8, np.uint16])
@pytest.mark.parametrize("trailing", [(), (1,), (3,), (8,), (5, 4)])
def test_gather_units_match_cpu(dtype, trailing):
    """Rows of every byte length (1-, 2-, 4-, 8- and 16-byte units) and an offset view as the source."""
    cp = cupy_module()
    rng = np.random.default_rng(11)
    src = _source(rng, (9,) + trailing, dtype)
    idx = rng.integers(0, 8, size=(4, 3))
    assert_matches_cpu(gather(cp.asarray(src), cp.asarray(idx)), gather(src, idx), rtol=0)
    view = cp.asarray(src)[1:]   # an offset start: narrower units
    np.testing.assert_array_equal(cp.asnumpy(gather(view, cp.asarray(idx))), gather(src[1:], idx))


def test_cached_problems_keep_no_arrays_of_the_call():
    from fluxpy.kernels import cuda_scatter
    cp = cupy_module()
    scatter("+", cp.ones((5, 3)), cp.asarray([0, 1, 1, 2, 0]), dstsize=(3, 3))
    assert cuda_scatter._problems
    assert all(p.src is None and p.index_args is None for p in cuda_scatter._problems.values())


# ---------------------------------------------------------------------------------------------
# The host path: a call of a cached signature (the fast path) gives what the first call gave


@pytest.mark.parametrize("op, dtype", [("max", np.float32), ("add", np.int64), ("min", np.float16)])
@pytest.mark.parametrize("layout", ["contiguous", "broadcast"])
def test_a_cached_call_keeps_the_choice_and_the_result(op, dtype, layout):
    """First call (measures, makes the problem) and later calls (the cached signature: no conversion, no checks
    again, the problem's packed arguments) give the same bits as the chosen implementation run alone."""
    from fluxpy.kernels import cpu, cuda_scatter
    cp = cupy_module()
    rng = np.random.default_rng(12)
    if layout == "contiguous":
        idx = (rng.integers(0, 5, size=(40, 3)), rng.integers(0, 4, size=(40, 3)))
    else:   # a broadcast arange view (strides 0) and a full array
        idx = (np.broadcast_to(np.arange(40).reshape(40, 1) % 5, (40, 3)), rng.integers(0, 4, size=(40, 3)))
    shape = (5, 4, 2)
    src = _source(rng, (40, 3, 2), dtype)
    dev = tuple(cp.asarray(i) if layout == "contiguous" or j else cp.broadcast_to(
        cp.arange(40).reshape(40, 1) % 5, (40, 3)) for j, i in enumerate(idx))
    cuda_scatter.clear_choices()
    results = [cp.asnumpy(scatter(op, cp.asarray(src), dev, dstsize=shape)) for _ in range(3)]
    (name, _), = cuda_scatter.choices().values()
    alone = cp.asnumpy(cuda_scatter.scatter_with(name, op, cp.asarray(src), dev, shape))
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    if op != "add" or np.dtype(dtype).kind in "iu":   # bit for bit where the order of a sum cannot matter
        np.testing.assert_array_equal(alone, results[0])
        np.testing.assert_array_equal(results[0], cpu.halves_in_float32(cpu.scatter)(op, src, idx, shape))
    assert len(cuda_scatter.choices()) == 1 and len(cuda_scatter._problems) == 1


def test_a_cached_gather_and_a_changed_index_shape():
    """An index tuple whose second array changes shape (same dtypes and strides) is not taken for the cached
    signature: mismatched shapes go to CuPy's own indexing, which refuses them."""
    from fluxpy.kernels import cuda_scatter
    cp = cupy_module()
    cuda_scatter.clear_choices()
    src = cp.arange(20.0).reshape(5, 4)
    i, j = cp.asarray([4, 0, 2]), cp.asarray([3, 3, 1])
    for _ in range(2):
        np.testing.assert_array_equal(cp.asnumpy(cuda_scatter.gather(src, (i, j))), [19.0, 3.0, 9.0])
    assert len(cuda_scatter._gathers) == 1
    with pytest.raises((IndexError, ValueError)):
        cuda_scatter.gather(src, (i, j[:2]))
    assert len(cuda_scatter._gathers) == 1


# ---------------------------------------------------------------------------------------------
# index_checks="deferred": a bad device index does not raise at the call; check_indices() (or the next checked call)
# raises for it


@pytest.fixture
def deferred():
    """``index_checks="deferred"`` for the test; afterwards the option is put back and nothing is left pending."""
    assert fluxpy.options.index_checks == "deferred"   # the default, named anyway
    with fluxpy.options(index_checks="deferred"):
        yield
    try:
        fluxpy.check_indices()
    except IndexError:
        pass


def _flag_value():
    from fluxpy.kernels import scatter_checks
    cp = cupy_module()
    flag = scatter_checks._flags.get(cp.cuda.runtime.getDevice())
    return 0 if flag is None else int(flag.view[0])


def _valid(idx, sizes):
    ok = np.ones(idx[0].shape, bool)
    for i, n in zip(idx, sizes):
        ok &= (i >= 0) & (i < n)
    return ok


DEFERRED_CASES = [
    ("scatter", "add", (np.array([0, 7, 2, 0]),), (3, 2), ["scatter", "index 7 in idx", "dstsize axis 0 of size 3"]),
    ("scatter", "max", (np.array([1, -4, 1]),), (2, 3), ["scatter", "non-negative", "-4 in idx"]),
    ("scatter", "add", (np.array([0, 1, 1]), np.array([0, 1, 5])), (2, 3, 2),
     ["scatter", "index 5 in idx[1]", "axis 1 of size 3"]),
    ("gather", None, (np.array([[0, 4], [1, 2]]),), (4, 3), ["gather", "index 4 in idx", "src axis 0 of size 4"]),
    ("gather", None, (np.array([2, 0]), np.array([-1, 1])), (3, 2, 2), ["gather", "non-negative", "-1 in idx[1]"]),
]


@pytest.mark.parametrize("fname, op, idx, shape, words", DEFERRED_CASES)
def test_deferred_bad_index_is_skipped_and_reported_by_check_indices(deferred, fname, op, idx, shape, words):
    cp = cupy_module()
    rng = np.random.default_rng(13)
    d = len(idx)
    dev_idx = tuple(cp.asarray(i) for i in idx)
    ok = _valid(idx, shape[:d])
    if fname == "scatter":
        src = rng.standard_normal(idx[0].shape + shape[d:])
        got = scatter(op, cp.asarray(src), dev_idx, dstsize=shape)   # no error here
        want = scatter(op, src[ok], tuple(i[ok] for i in idx), dstsize=shape)
        np.testing.assert_array_equal(cp.asnumpy(got), want)   # the valid entries (at most two a row: exact sums)
    else:
        src = rng.standard_normal(shape)
        got = cp.asnumpy(gather(cp.asarray(src), dev_idx))   # no error here
        np.testing.assert_array_equal(got[ok], src[tuple(i[ok] for i in idx)])
        assert not got[~ok].any()   # a bad entry gives zeros
    with pytest.raises(IndexError) as info:
        fluxpy.check_indices()
    message = str(info.value)
    for w in words + ["reported late", "index_checks='deferred'", "test_scatter_gpu.py:"]:
        assert w in message, f"{w!r} not in {message!r}"
    assert _flag_value() == 0
    fluxpy.check_indices()   # cleared: nothing more
    np.testing.assert_array_equal(cp.asnumpy(gather(cp.arange(3.0), cp.asarray([2, 0]))), [2.0, 0.0])
    fluxpy.check_indices()


@pytest.mark.parametrize("mode", ["deferred", "wait"])
def test_the_next_checked_call_raises_for_an_earlier_deferred_call(deferred, mode):
    cp = cupy_module()
    bad = cp.asarray([0, 9])
    scatter("+", cp.ones(2), bad, dstsize=4)   # deferred: no error here
    cp.cuda.runtime.deviceSynchronize()         # its kernel has run: the flag is up
    fluxpy.options.set(index_checks=mode)   # the fixture's block puts it back
    with pytest.raises(IndexError, match=r"scatter: index 9 in idx is out of range for dstsize axis 0 of size 4 "
                                         r"\(reported late: an earlier scatter call"):
        gather(cp.arange(4.0), cp.asarray([1]))   # a good call: raises for the earlier one
    assert _flag_value() == 0
    np.testing.assert_array_equal(cp.asnumpy(gather(cp.arange(4.0), cp.asarray([1]))), [1.0])
    fluxpy.check_indices()


def test_deferred_good_calls_do_not_raise_and_match_wait_mode(deferred):
    cp = cupy_module()
    rng = np.random.default_rng(14)
    src, idx = rng.standard_normal((50, 3)), rng.integers(0, 7, 50)
    deferred_results = [cp.asnumpy(scatter("max", cp.asarray(src), cp.asarray(idx), dstsize=(7, 3))),
                        cp.asnumpy(gather(cp.asarray(src), cp.asarray(idx)))]
    fluxpy.check_indices()
    fluxpy.options.set(index_checks="wait")   # the fixture's block puts it back
    wait_results = [cp.asnumpy(scatter("max", cp.asarray(src), cp.asarray(idx), dstsize=(7, 3))),
                    cp.asnumpy(gather(cp.asarray(src), cp.asarray(idx)))]
    for a, b in zip(deferred_results, wait_results):
        np.testing.assert_array_equal(a, b)


def test_the_wait_mode_raises_at_the_call():
    cp = cupy_module()
    with fluxpy.options(index_checks="wait"):
        with pytest.raises(IndexError, match="gather: index 3 in idx is out of range for src axis 0 of size 3$"):
            gather(cp.ones(3), cp.asarray([0, 3]))
        assert _flag_value() == 0
    fluxpy.check_indices()


def test_the_default_mode_defers_to_check_indices_naming_op_and_entry():
    """By default a checked call does not wait; check_indices() raises, naming the op, the entry and the call."""
    cp = cupy_module()
    assert fluxpy.options.index_checks == "deferred"
    src, idx = cp.arange(12.0).reshape(4, 3), cp.asarray([[1, 3], [7, 0]])
    out = cp.asnumpy(gather(src, idx))   # no error here
    np.testing.assert_array_equal(out[1, 0], np.zeros(3))
    with pytest.raises(IndexError, match=r"^gather: index 7 in idx is out of range for src axis 0 of size 4 "
                                         r"\(reported late: an earlier gather call, at .*test_scatter_gpu\.py:\d+"):
        fluxpy.check_indices()
    assert _flag_value() == 0
    fluxpy.check_indices()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_an_embedding_of_a_bad_device_token_raises_at_check_indices_by_default(dtype):
    cp = cupy_module()
    emb = fluxpy.Embedding(10, 4)
    emb.weight = cp.asarray(emb.weight.astype(dtype))
    tokens = cp.asarray([[1, 2], [12, 0]])
    y = emb(tokens)   # returns without waiting: the bad token's row is zeros
    assert y.dtype == dtype and not cp.asnumpy(y[1, 0]).astype(np.float32).any()
    np.testing.assert_array_equal(cp.asnumpy(y[0]), cp.asnumpy(emb.weight[cp.asarray([1, 2])]))
    with pytest.raises(IndexError, match=r"^gather: index 12 in idx is out of range for src axis 0 of size 10 "
                                         r"\(reported late"):
        fluxpy.check_indices()
    emb(cp.asarray([3]))
    fluxpy.check_indices()


def test_a_deferred_error_whose_index_arrays_are_gone_names_the_op_and_axes(deferred):
    import gc
    cp = cupy_module()
    scatter("+", cp.ones(2), cp.asarray([0, 6]), dstsize=3)   # the index array is a temporary
    gc.collect()
    with pytest.raises(IndexError, match=r"scatter: an index was out of range for axes of sizes \(3,\)"):
        fluxpy.check_indices()


def test_gradients_never_flag(deferred):
    """The gradient of a gather with a bad index is computed with the bad entry skipped; only the forward,
    checked, reports it."""
    cp = cupy_module()
    x, idx = cp.ones(3), cp.asarray([0, 5])
    g, = fluxpy.gradient(lambda v: gather(v, idx).sum(), x)
    np.testing.assert_array_equal(cp.asnumpy(g), [1.0, 0.0, 0.0])
    with pytest.raises(IndexError, match="gather: index 5"):
        fluxpy.check_indices()
    fluxpy.check_indices()


@pytest.mark.parametrize("mode", ["wait", "deferred"])
def test_a_captured_bad_index_is_reported_after_the_replay(mode):
    from fluxpy.backend import capture_graph
    from fluxpy.capturing import recording
    from fluxpy.kernels import BadIndex
    cp = cupy_module()
    src, idx = cp.ones(2), cp.asarray([0, 1])
    scatter("+", src, idx, dstsize=2)   # the choice is made eagerly
    with fluxpy.options(index_checks=mode):
        with recording() as hooks:
            graph, y = capture_graph(lambda: scatter("+", src, idx, dstsize=2))
        graph.launch()
        cp.cuda.runtime.deviceSynchronize()
        for hook in hooks:
            hook()   # a good replay: nothing
        np.testing.assert_array_equal(cp.asnumpy(y), [1.0, 1.0])
        idx[1] = 5
        graph.launch()
        cp.cuda.runtime.deviceSynchronize()
        with pytest.raises(BadIndex, match="captured step was out of range"):
            for hook in hooks:
                hook()
        assert _flag_value() == 0
    fluxpy.check_indices()


# ---------------------------------------------------------------------------------------------
# The along-axis form (axis=): np.take_along_axis and PyTorch's scatter_reduce, the same kernels with rows of one
# element


ALONG_CASES = [((3, 4, 5), 1, 6), ((2, 3, 4, 7), 3, 7), ((300,), 0, 11), ((40, 50), 0, 3), ((2, 1, 33), 1, 5),
               ((64, 9, 2, 3), -3, 4)]


@pytest.fixture(params=[True, False], ids=["32-bit", "64-bit"])
def width(request, monkeypatch):
    """Both index widths (64-bit problems forced: they divide with ``/`` where 32-bit ones use magic numbers)."""
    from fluxpy.kernels import cuda_scatter
    monkeypatch.setattr(cuda_scatter, "_problems", {})
    monkeypatch.setattr(cuda_scatter, "_gathers", {})
    if not request.param:
        monkeypatch.setattr(cuda_scatter, "_fits_32_bits", lambda *args: False)
    return request.param


@pytest.mark.parametrize("width, name, op, dtype, shape, axis, n", sweep(cases=[
    (width, name, op, dtype, *case) for width in (True, False) for name in ("one_block", "atomic", "sorted")
    for op in ("add", "max", "min")
    for dtype in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.uint8)
    for case in ALONG_CASES]), indirect=["width"])
def test_each_implementation_along_an_axis_matches_cpu(width, name, op, dtype, shape, axis, n):
    from fluxpy.kernels import cpu, cuda_scatter
    cp = cupy_module()
    rng = np.random.default_rng(15)
    axis %= len(shape)
    src = _source(rng, shape, dtype)
    idx = rng.integers(0, n, size=shape)
    dst = shape[:axis] + (n,) + shape[axis + 1:]
    want = cpu.halves_in_float32(cpu.scatter)(op, src, (idx,), dst, False, axis)
    got = cuda_scatter.scatter_with(name, op, cp.asarray(src), (cp.asarray(idx),), dst, axis)
    assert got.dtype == want.dtype and got.shape == want.shape
    if np.dtype(dtype).kind in "iu" or op in ("max", "min"):
        np.testing.assert_array_equal(cp.asnumpy(got), want)
    else:   # float32: up to ~20 terms of size ~10 summed in another order, cancelling to near zero
        atol = 1e-4 if np.dtype(dtype) == np.float32 else _tolerance(dtype)
        assert_matches_cpu(got, want, rtol=_tolerance(dtype), atol=atol)


@pytest.mark.parametrize("width, dtype, shape, axis, n", sweep(cases=[
    (width, dtype, *case) for width in (True, False)
    for dtype in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, np.int8) for case in ALONG_CASES]),
    indirect=["width"])
def test_gather_along_an_axis_is_take_along_axis(width, dtype, shape, axis, n):
    cp = cupy_module()
    rng = np.random.default_rng(16)
    table = _source(rng, shape[:axis % len(shape)] + (n,) + shape[axis % len(shape) + 1:], dtype)
    idx = rng.integers(0, n, size=shape).astype(np.int32)
    got = gather(cp.asarray(table), cp.asarray(idx), axis=axis)
    np.testing.assert_array_equal(cp.asnumpy(got), np.take_along_axis(table, idx, axis % len(shape)))
    transposed = cp.asfortranarray(cp.asarray(idx))   # a strided index array
    np.testing.assert_array_equal(cp.asnumpy(gather(cp.asarray(table), transposed, axis=axis)), cp.asnumpy(got))


@pytest.mark.parametrize("op", OPS)
def test_scatter_along_an_axis_and_its_gradient_match_cpu(op):
    cp = cupy_module()
    rng = np.random.default_rng(17)
    src = rng.permutation(4 * 9 * 5).reshape(4, 9, 5) + rng.uniform(0.1, 0.4, size=(4, 9, 5))   # no ties
    idx = rng.integers(0, 6, size=(4, 9, 5))
    idx[:, :6] = np.arange(6).reshape(1, 6, 1)   # every destination entry hit
    cot = rng.standard_normal((4, 6, 5))

    def value_and_grad(xp):
        f = lambda s: (scatter(op, s, xp.asarray(idx), dstsize=6, axis=1) * xp.asarray(cot)).sum()   # noqa: E731
        y, (g,) = fluxpy.withgradient(f, xp.asarray(src))
        return float(y), g
    (y, g), (want_y, want_g) = value_and_grad(cp), value_and_grad(np)
    assert_matches_cpu(g, want_g, rtol=1e-12, atol=1e-12)
    assert abs(y - want_y) <= 1e-9 * max(1.0, abs(want_y))


def test_gather_along_an_axis_gradient_and_second_order_match_cpu():
    cp = cupy_module()
    rng = np.random.default_rng(18)
    table, idx = rng.standard_normal((5, 4, 3)), rng.integers(0, 4, size=(5, 7, 3))
    cot = rng.standard_normal((5, 7, 3))

    def grads(xp):
        f = lambda t: (gather(t, xp.asarray(idx), axis=1) ** 2 * xp.asarray(cot)).sum()   # noqa: E731
        g, = fluxpy.gradient(f, xp.asarray(table))
        gg, = fluxpy.gradient(lambda t: (fluxpy.gradient(f, t)[0] * xp.asarray(cot[:, :4])).sum(), xp.asarray(table))
        return g, gg
    for got, want in zip(grads(cp), grads(np)):
        assert_matches_cpu(got, want, rtol=1e-12, atol=1e-12)


def test_the_benchmarks_4d_case_along_the_last_axis_matches_the_index_tuple_form():
    cp = cupy_module()
    rng = np.random.default_rng(19)
    shape = (5, 8, 7, 7)
    src, last = cp.asarray(rng.standard_normal(shape)), cp.asarray(rng.integers(0, 7, shape))
    grid = tuple(cp.broadcast_to(cp.arange(n).reshape([-1 if a == j else 1 for a in range(4)]), shape)
                 for j, n in enumerate(shape[:3]))
    for op in ("add", "max", "min", "mean"):
        assert_matches_cpu(scatter(op, src, last, dstsize=7, axis=3), cp.asnumpy(scatter(op, src, grid + (last,))),
                           rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(cp.asnumpy(gather(src, last, axis=-1)), cp.asnumpy(gather(src, grid + (last,))))


def test_deterministic_mode_along_an_axis_is_bit_for_bit():
    from fluxpy.kernels import cuda_scatter
    cp = cupy_module()
    rng = np.random.default_rng(20)
    src = cp.asarray(rng.standard_normal((64, 3000, 4)).astype(np.float32))
    idx = cp.asarray(rng.integers(0, 20, (64, 3000, 4)))
    cuda_scatter.clear_choices()
    try:
        with fluxpy.options(deterministic=True):
            results = [cp.asnumpy(scatter("+", src, idx, dstsize=20, axis=1)) for _ in range(3)]
            (name, times), = cuda_scatter.choices().values()
            assert name != "atomic" and "atomic" not in times
    finally:
        cuda_scatter.clear_choices()
    assert all(np.array_equal(r, results[0]) for r in results)
    want = scatter("+", cp.asnumpy(src).astype(np.float64), cp.asnumpy(idx), dstsize=20, axis=1)
    np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("mode", ["wait", "deferred"])
def test_a_bad_device_index_along_an_axis_names_the_axis(mode):
    cp = cupy_module()
    src, idx = cp.ones((3, 4)), cp.asarray([[0, 1, 2, 3], [3, 9, 0, 1], [0, 0, 0, 0]])
    with fluxpy.options(index_checks=mode):
        for call, words in [(lambda: scatter("max", src, idx, dstsize=4, axis=1), "scatter: index 9 in idx is out "
                             "of range for dstsize axis 1 of size 4"),
                            (lambda: gather(src, idx, axis=-1), "gather: index 9 in idx is out of range for src axis "
                             "1 of size 4")]:
            with pytest.raises(IndexError) as info:
                call()
                fluxpy.check_indices()   # deferred: reported here
            assert str(info.value).startswith(words), str(info.value)
            assert _flag_value() == 0
    fluxpy.check_indices()


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_the_atomic_float_max_and_min_order_every_sign_infinity_and_nan(op, dtype):
    """The atomic scatter's max/min is one integer atomic on the float's bits: positive and negative values, signed
    zeros, infinities and NaN (of either sign: it wins, as NumPy's) into few destinations, against the CPU."""
    from fluxpy.kernels import cpu, cuda_scatter
    cp = cupy_module()
    rng = np.random.default_rng(21)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 1.5, -1.5, 1e-30, -1e-30])
    values = np.concatenate([rng.standard_normal(4000) * 10, np.repeat(specials, 50)])
    rows = rng.integers(0, 40, size=values.size)
    nan_rows = rng.choice(40, size=5, replace=False)
    nans = np.array([np.nan, -np.nan, np.nan, -np.nan, np.nan])   # a NaN of each sign
    values = np.concatenate([values, nans]).astype(dtype)
    rows = np.concatenate([rows, nan_rows])
    order = rng.permutation(values.size)
    values, rows = values[order], rows[order]
    want = cpu.halves_in_float32(cpu.scatter)(op, values, (rows,), (41,))   # row 40: never hit
    got = cp.asnumpy(cuda_scatter.scatter_with("atomic", op, cp.asarray(values), (cp.asarray(rows),), (41,)))
    got, want = got.astype(np.float64), want.astype(np.float64)   # (NumPy takes NaN == NaN for its own dtypes only)
    np.testing.assert_array_equal(got, want)   # NaN where NaN; -0.0 == 0.0
    assert np.isnan(got[nan_rows]).all()


@pytest.mark.parametrize("name", ["one_block", "atomic", "sorted"])
def test_empty_problems_along_an_axis(name):
    from fluxpy.kernels import cuda_scatter
    cp = cupy_module()
    for shape, axis, n in [((2, 3, 0), 1, 4), ((2, 0, 3), 1, 4), ((0, 3), 1, 2)]:
        dst = shape[:axis] + (n,) + shape[axis + 1:]
        src, idx = cp.ones(shape), cp.zeros(shape, cp.int64)
        got = cuda_scatter.scatter_with(name, "max", src, (idx,), dst, axis)
        np.testing.assert_array_equal(cp.asnumpy(got), np.full(dst, -np.inf))
        assert gather(cp.ones(dst), idx, axis=axis).shape == shape


@st.composite
def _along_cases(draw):
    """A source shape of 1 to 4 axes, an axis (negative too), the destination's length on it, an index dtype."""
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=4)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    return shape, axis, draw(st.integers(1, 12)), draw(st.sampled_from([np.int64, np.int32, np.uint8])), \
        draw(st.integers(0, 2**31 - 1))


@examples(40)
@given(case=_along_cases(), op=st.sampled_from(OPS))
def test_the_along_axis_ops_and_gradients_match_cpu_at_drawn_shapes(case, op):
    cp = cupy_module()
    shape, axis, n, idx_dtype, seed = case
    rng = np.random.default_rng(seed)
    a = axis % len(shape)
    src, idx = rng.standard_normal(shape), rng.integers(0, n, size=shape).astype(idx_dtype)
    table = rng.standard_normal(shape[:a] + (n,) + shape[a + 1:])
    assert_matches_cpu(scatter(op, cp.asarray(src), cp.asarray(idx), dstsize=n, axis=axis),
                       scatter(op, src, idx, dstsize=n, axis=axis), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(cp.asnumpy(gather(cp.asarray(table), cp.asarray(idx), axis=axis)),
                                  np.take_along_axis(table, idx.astype(np.int64), a))
    cot = rng.standard_normal(table.shape)
    grads = [fluxpy.gradient(lambda s: (scatter("+", s, xp.asarray(idx), dstsize=n, axis=axis)
                                        * xp.asarray(cot)).sum(), xp.asarray(src))[0] for xp in (cp, np)]
    assert_matches_cpu(grads[0], grads[1], rtol=1e-12, atol=1e-12)
