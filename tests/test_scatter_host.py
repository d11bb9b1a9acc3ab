"""The GPU scatter's and gather's host code (``fluxpy.kernels.cuda_scatter`` and ``scatter_checks``) on the CPU,
through a stand-in for CuPy (``cupy_standin``) whose kernels run in NumPy from exactly the arguments the host
passes, checked against each kernel's parameter list: the packed kernel arguments of every implementation and index
layout, the problems and launches cached per call signature, and the index checks (``index_checks="wait"`` and
``"deferred"``, the flag, the record of deferred calls, ``check_indices``). The CUDA code itself runs only on a GPU
(tests/gpu/test_scatter_gpu.py); tests/test_kernel_sources.py compiles it with NVRTC. The stand-in reads the
kernels' parameter lists after the C preprocessor (``cpp``): these tests skip where there is none."""
import gc
import itertools
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

import fluxpy
from cupy_standin import CPP, FakeArray, kernel_parameters, make_cupy, preprocess
from fluxpy import backend, kernels
from fluxpy.kernels import compiler, cpu, cuda_scatter, scatter_checks
from fluxpy.options import options

if CPP is None:
    pytest.skip("no C preprocessor (cpp) to read the kernels' parameter lists", allow_module_level=True)


def _source(kind, *args):
    """Kind ``kind``'s CUDA source as the stand-in reads it: its defines (``cuda_scatter._defines(kind, *args)``)
    applied by the C preprocessor."""
    defines = cuda_scatter._defines(kind, *args)
    return preprocess(compiler.source(cuda_scatter._SOURCES[kind]), compiler.compile_options(defines))


@pytest.fixture
def cp(monkeypatch):
    """The stand-in as CuPy for fluxpy (arrays, kernels, the table's "cupy" entries), with empty caches; the choice
    of implementation is "timed" as ``times`` says (one_block fastest unless a test changes it)."""
    fake = make_cupy()
    monkeypatch.setattr(backend, "cupy", fake)
    monkeypatch.setattr(cuda_scatter, "cupy", fake)
    monkeypatch.setattr(scatter_checks, "cupy", fake)
    monkeypatch.setattr(compiler, "cupy", fake)
    monkeypatch.setattr(compiler, "_modules", {})
    monkeypatch.setattr(compiler, "_functions", {})
    monkeypatch.setattr(cuda_scatter, "c_contiguous", fake.ascontiguousarray)   # its tiled copy runs on a GPU only
    for cache in ("_problems", "_gathers", "_choices"):
        monkeypatch.setattr(cuda_scatter, cache, {})
    monkeypatch.setattr(scatter_checks, "_flags", {})
    fake.times = {"one_block": 1.0, "atomic": 2.0, "sorted": 3.0}

    def time_ms(run):
        run()
        return fake.times[run.__defaults__[0]]
    monkeypatch.setattr(compiler, "time_ms", time_ms)
    table = kernels.snapshot()
    for name, fn in cuda_scatter.KERNELS.items():
        kernels.register(name, "cupy", fn)
    before = options.get()
    yield fake
    options.set(**before)   # a test's options.set(...) ends with it
    kernels.restore(table)


def _host(x):
    return np.array(x.a) if isinstance(x, FakeArray) else x


def _dev(cp, *arrays):
    return tuple(cp.asarray(a) for a in arrays)


# ---------------------------------------------------------------------------------------------
# The kernels' arguments and results


def test_the_parameter_lists_put_the_index_arrays_first_then_their_scalars():
    code = _source("atomic", "add", np.dtype(np.float32), (np.dtype(np.int64), np.dtype(np.int32)), 2,
                                True)
    names = [name for _, _, name in kernel_parameters(code, "scatter_atomic")]
    assert names == ["src", "acc", "K", "F", "i0", "i1", "n0", "s0_0", "s0_1", "n1", "s1_0", "s1_1", "m1", "mg1",
                     "sh1", "bad", "call"]


def test_a_strided_layout_multiplies_only_by_the_strides_an_array_has():
    """``reads`` (``_reads``): a broadcast column's offset takes one multiply, a C-contiguous array's is ``k``; the
    parameters are those of the generic code."""
    dtypes = (np.dtype(np.int64),) * 3
    generic = _source("gather", 4, None, dtypes, 2, True)
    code = _source("gather", 4, None, dtypes, 2, True, ((0,), (0, 1), None))
    assert kernel_parameters(code, "gather_rows") == kernel_parameters(generic, "gather_rows")
    reads = cuda_scatter._index_defines(dtypes, 2, True, ((0,), (0, 1), None))
    assert (reads["FX_R0"], reads["FX_R1"], reads["FX_R2"]) == (0b01, 0b11, -1)
    assert all(cuda_scatter._index_defines(dtypes, 2, True)[f"FX_R{j}"] == 0b11 for j in range(3))
    walk = code.split("fx_row")[1]
    assert "int o2 = -1 < 0 ? (int)k : 0;" in walk   # a C-contiguous array: entry k at k, never a multiply
    for j, a in [(0, 0), (1, 0), (1, 1)]:   # the multiplies by the strides each array has, each behind its bit
        assert f"if ({reads[f'FX_R{j}']} >= 0 && (({reads[f'FX_R{j}']} >> ({a})) & 1)) o{j} += (int)c * s{j}_{a};" in walk


_CUDA_STUB = r"""
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
struct fx_dim3 { unsigned int x, y, z; };
static fx_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline unsigned int __umulhi(unsigned int a, unsigned int b) { return (unsigned int)(((unsigned long long)a * b) >> 32); }
inline float __int_as_float(int) { return 0; }
inline float __uint_as_float(unsigned) { return 0; }
inline unsigned int __float_as_uint(float) { return 0; }
inline int __float_as_int(float) { return 0; }
inline double __longlong_as_double(long long) { return 0; }
inline long long __double_as_longlong(double) { return 0; }
template <class T> T atomicAdd(T* a, T) { return *a; }
template <class T> T atomicMax(T* a, T) { return *a; }
template <class T> T atomicMin(T* a, T) { return *a; }
template <class T> T atomicCAS(T* a, T, T) { return *a; }
"""


def test_the_cuda_sources_parse_as_cpp(tmp_path):
    """Every kernel source (each kind, index layout and width, with a float, a half and an integer dtype) passes the
    host C++ compiler's syntax check with its defines, CUDA's names stubbed: the signatures, IDX_PARAMS and fx_flag
    agree (short of NVRTC, which tests/test_kernel_sources.py runs where its wheel is installed)."""
    compiler_path = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler_path is None:
        pytest.skip("no C++ compiler")
    variants = []
    for strided, small in itertools.product((0, 1, 3, "along"), (True, False)):
        index_dtypes = (np.dtype(np.int32),) if strided == "along" else (np.dtype(np.int32), np.dtype(np.int64))
        variants += [("gather", unit, None, index_dtypes, strided, small) for unit in (16, 1)]
        if strided in (1, 3):   # an array read by one axis beside a C-contiguous one
            variants.append(("gather", 4, None, index_dtypes, strided, small, ((0,), None)))
        for kind, op, dtype in itertools.product(("one_block", "atomic", "sorted"), ("add", "max"),
                                                 (np.float32, ml_dtypes.bfloat16, np.uint8)):
            variants.append((kind, op, np.dtype(dtype), index_dtypes, strided, small))
    path = tmp_path / "stub.h"
    path.write_text(_CUDA_STUB)
    for n, (kind, *args) in enumerate(variants):   # one translation unit each: their defines differ
        path = tmp_path / f"k{n}.cpp"
        path.write_text(compiler.source(cuda_scatter._SOURCES[kind]))
        options = [o for o in compiler.compile_options(cuda_scatter._defines(kind, *args)) if o.startswith("-D")]
        run = subprocess.run([compiler_path, "-std=c++14", "-fsyntax-only", "-w", "-include", tmp_path / "stub.h",
                              *options, str(path)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]


def _index(rng, layout, lead):
    """Index arrays of shape (6, 4) into axes ``lead``: C-contiguous, a transposed view, or broadcast aranges."""
    if layout == "contiguous":
        return tuple(rng.integers(0, n, size=(6, 4)) for n in lead)
    if layout == "transposed":
        return tuple(rng.integers(0, n, size=(4, 6)).T for n in lead)
    return tuple(np.broadcast_to(np.arange(6).reshape(6, 1) % n, (6, 4)) for n in lead)


@pytest.mark.parametrize("name", cuda_scatter.IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["add", "max", "min"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.uint64])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "broadcast"])
@pytest.mark.parametrize("lead, trailing", [((5,), (3,)), ((3, 4), ()), ((2, 3), (2, 2))])
def test_each_implementation_gets_its_arguments_and_matches_numpy(cp, name, op, dtype, layout, lead, trailing):
    rng = np.random.default_rng(0)
    idx = _index(rng, layout, lead)
    src = (rng.standard_normal((6, 4) + trailing) * 10).astype(dtype)
    want = cpu.halves_in_float32(cpu.scatter)(op, src, idx, lead + trailing)
    got = cuda_scatter.scatter_with(name, op, cp.asarray(src), tuple(FakeArray(i) for i in idx), lead + trailing)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(_host(got), want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int8])
@pytest.mark.parametrize("trailing", [(), (1,), (3,), (8,), (5, 4)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "broadcast"])
def test_gather_gets_its_arguments_and_matches_numpy(cp, dtype, trailing, layout):
    rng = np.random.default_rng(1)
    src = (rng.standard_normal((9,) + trailing) * 10).astype(dtype)
    idx = _index(rng, layout, (8,))
    np.testing.assert_array_equal(_host(cuda_scatter.gather(cp.asarray(src), tuple(FakeArray(i) for i in idx))),
                                  src[idx])
    view = cp.asarray(src)[1:]   # an offset start: narrower units
    np.testing.assert_array_equal(_host(cuda_scatter.gather(view, tuple(FakeArray(i) for i in idx))), src[1:][idx])


def test_a_call_of_a_known_signature_reuses_its_problem_and_choice_and_keeps_no_arrays(cp):
    options.set(index_checks="wait")
    src, idx = _dev(cp, np.arange(12.0).reshape(4, 3), np.array([2, 0, 2, 1]))
    first = fluxpy.scatter("+", src, idx, dstsize=(3, 3))
    (p,) = cuda_scatter._problems.values()
    (name, times), = cuda_scatter.choices().values()
    assert name == "one_block" and set(times) == {"one_block", "atomic", "sorted"}
    cp.times["atomic"] = 0.1   # a second call does not measure again
    again = fluxpy.scatter("+", src, idx, dstsize=(3, 3))
    assert list(cuda_scatter._problems.values()) == [p] and p.chosen == {False: "one_block"}
    np.testing.assert_array_equal(_host(again), _host(first))
    np.testing.assert_array_equal(_host(first), fluxpy.scatter("+", src.a, idx.a, dstsize=(3, 3)))
    assert p.src is None and p.index_args is None and p.flag_args is None
    assert cp.stream.waits["stream"] == 2   # each checked call waited once ("wait" mode)


def test_host_indices_and_lists_take_the_conversion_path(cp):
    src = cp.asarray(np.arange(6.0).reshape(3, 2))
    for idx in (np.array([2, 2, 0]), [2, 2, 0]):
        np.testing.assert_array_equal(_host(cuda_scatter.scatter("add", src, (idx,), (3, 2))),
                                      [[4.0, 5.0], [0.0, 0.0], [2.0, 4.0]])
        np.testing.assert_array_equal(_host(cuda_scatter.gather(src, (idx,))), src.a[[2, 2, 0]])


@pytest.mark.parametrize("small", [True, False])
@pytest.mark.parametrize("index", [(np.zeros((4, 3, 5), np.int64),) * 2, (np.arange(8, dtype=np.int32)[::2],) * 2,
                                   (np.broadcast_to(np.arange(4).reshape(4, 1, 1), (4, 3, 5)),) * 2])
def test_the_index_scalars_match_their_parameters(small, index):
    """Per-problem scalars against the parameters after the index arrays, 32- and 64-bit problems alike."""
    strided = cuda_scatter._index_layout(index)
    dtypes = tuple(a.dtype for a in index)
    params = kernel_parameters(_source("gather", 4, None, dtypes, strided, small), "gather_rows")
    scalars = cuda_scatter._index_scalars(index, (4, 4), strided, small)
    wanted = params[4 + len(index):-2]   # after src, out, K, F and the arrays; before bad, call
    assert len(scalars) == len(wanted)
    for (ctype, pointer, name), value in zip(wanted, scalars):
        assert not pointer and value.itemsize == (8 if ctype in ("long long", "unsigned long long") else 4), name
        assert (value.dtype.kind == "u") == ctype.startswith("unsigned"), name


# ---------------------------------------------------------------------------------------------
# The along-axis form (axis=): one index array of the source's shape, rows of one element


ALONG_CASES = [((3, 4, 5), 1, 6), ((2, 3, 4, 5), 3, 4), ((7,), 0, 3), ((4, 5), 0, 2), ((2, 1, 3), 1, 5)]


@pytest.fixture(params=[True, False], ids=["32-bit", "64-bit"])
def width(request, monkeypatch):
    """Both index widths: 32-bit problems divide by magic numbers, 64-bit ones (forced here) by ``/``."""
    if not request.param:
        monkeypatch.setattr(cuda_scatter, "_fits_32_bits", lambda *args: False)
    return request.param


@pytest.mark.parametrize("name", cuda_scatter.IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["add", "max", "min"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int16])
@pytest.mark.parametrize("shape, axis, n", ALONG_CASES)
def test_each_implementation_along_an_axis_gets_its_arguments_and_matches_numpy(cp, width, name, op, dtype, shape,
                                                                               axis, n):
    rng = np.random.default_rng(2)
    src = (rng.standard_normal(shape) * 10).astype(dtype)
    idx = rng.integers(0, n, size=shape)
    dst = shape[:axis] + (n,) + shape[axis + 1:]
    want = cpu.halves_in_float32(cpu.scatter)(op, src, (idx,), dst, False, axis)
    got = cuda_scatter.scatter_with(name, op, cp.asarray(src), (FakeArray(idx),), dst, axis)
    assert got.dtype == want.dtype and got.shape == dst
    np.testing.assert_array_equal(_host(got), want)
    assert all(p.small == width for p in cuda_scatter._problems.values())


@pytest.mark.parametrize("shape, axis, n", ALONG_CASES)
@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int8])
def test_gather_along_an_axis_gets_its_arguments_and_is_take_along_axis(cp, width, shape, axis, n, dtype):
    rng = np.random.default_rng(3)
    table = (rng.standard_normal(shape[:axis] + (n,) + shape[axis + 1:]) * 10).astype(dtype)
    idx = rng.integers(0, n, size=shape)
    want = np.take_along_axis(table, idx, axis)
    np.testing.assert_array_equal(_host(cuda_scatter.gather(cp.asarray(table), (FakeArray(idx),), False, axis)), want)
    transposed = FakeArray(np.ascontiguousarray(idx.T).T)   # a strided index: read as a contiguous copy
    np.testing.assert_array_equal(_host(cuda_scatter.gather(cp.asarray(table), (transposed,), False, axis)), want)


def test_the_along_scalars_match_their_parameters(width):
    params = kernel_parameters(_source("gather", 4, None, (np.dtype(np.int64),), "along", width),
                               "gather_rows")
    scalars = cuda_scatter._along_scalars((3, 4, 5), 1, 6, width)
    wanted = params[5:-2]   # after src, out, K, F and the array; before bad, call
    assert [name for _, _, name in wanted] == (["n0", "inner", "mgi", "shi", "na", "mga", "sha"] if width else
                                              ["n0", "inner", "na"])
    for (ctype, pointer, name), value in zip(wanted, scalars):
        assert not pointer and value.itemsize == (8 if ctype in ("long long", "unsigned long long") else 4), name
        assert (value.dtype.kind == "u") == ctype.startswith("unsigned"), name


@pytest.mark.parametrize("name", cuda_scatter.IMPLEMENTATIONS)
def test_empty_problems_along_an_axis(cp, width, name):
    """No entries (an axis of size 0 after, on or before the one indexed): empty results, or the empty value."""
    for shape, axis, n in [((2, 3, 0), 1, 4), ((2, 0, 3), 1, 4), ((0, 3), 1, 2)]:
        dst = shape[:axis] + (n,) + shape[axis + 1:]
        src, idx = _dev(cp, np.ones(shape), np.zeros(shape, np.int64))
        got = cuda_scatter.scatter_with(name, "max", src, (idx,), dst, axis)
        np.testing.assert_array_equal(_host(got), np.full(dst, -np.inf))
        table = cp.asarray(np.ones(dst))
        assert _host(cuda_scatter.gather(table, (idx,), False, axis)).shape == shape


def test_the_along_axis_kernels_turn_down_an_index_of_the_wrong_shape(cp):
    src, idx = _dev(cp, np.ones((2, 3)), np.zeros((2, 4), np.int64))
    with pytest.raises(ValueError, match=r"along axis 1: .*src's shape \(2, 3\); got 1 array\(s\) of shape \(2, 4\)"):
        cuda_scatter.scatter("add", src, (idx,), (2, 5), False, 1)
    with pytest.raises(ValueError, match=r"along axis 0: expects one integer index array of shape \(2, 3\) but on"):
        cuda_scatter.gather(src, (idx,), False, 0)
    assert _host(cuda_scatter.gather(src, (idx,), False, 1)).shape == (2, 4)   # another length on the axis


def test_bad_along_axis_indices_name_the_axis_in_either_mode(cp):
    src, idx = _dev(cp, np.ones((2, 3)), np.array([[0, 1, 2], [2, 7, 0]]))
    options.set(index_checks="wait")
    with pytest.raises(IndexError, match=r"^scatter: index 7 in idx is out of range for dstsize axis 1 of size 3$"):
        fluxpy.scatter("+", src, idx, dstsize=3, axis=1)
    with pytest.raises(IndexError, match=r"^gather: index 7 in idx is out of range for src axis 1 of size 3$"):
        fluxpy.gather(src, idx, axis=-1)
    options.set(index_checks="deferred")
    out = fluxpy.gather(src, idx, axis=1)
    np.testing.assert_array_equal(_host(out), [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])   # the bad entry: zero
    with pytest.raises(IndexError, match=r"gather: index 7 in idx is out of range for src axis 1 of size 3 "
                                         r"\(reported late"):
        fluxpy.check_indices()
    assert scatter_checks._flags[0].view[0] == 0


# ---------------------------------------------------------------------------------------------
# Index checks


def test_wait_mode_raises_at_the_call_and_clears_the_flag(cp):
    options.set(index_checks="wait")
    with pytest.raises(IndexError, match=r"scatter: index 5 in idx is out of range for dstsize axis 0 of size 3"):
        fluxpy.scatter("+", *_dev(cp, np.ones(2), np.array([0, 5])), dstsize=3)
    assert scatter_checks._flags[0].view[0] == 0
    with pytest.raises(IndexError, match="gather: expects non-negative"):
        fluxpy.gather(*_dev(cp, np.ones(3), np.array([-1])))
    np.testing.assert_array_equal(_host(fluxpy.gather(*_dev(cp, np.arange(3.0), np.array([2, 1])))), [2.0, 1.0])


def test_gradients_do_not_flag(cp):
    src, idx = _dev(cp, np.ones(2), np.array([0, 7]))
    cuda_scatter.scatter("add", src, (idx,), (3,))   # unchecked: the bad entry skipped, no trace
    cuda_scatter.gather(src, (idx,))
    assert 0 not in scatter_checks._flags or scatter_checks._flags[0].view[0] == 0
    assert cp.stream.waits["stream"] == 0


@pytest.fixture
def deferred(cp):
    options.set(index_checks="deferred")
    return cp


def test_the_default_mode_is_deferred_and_never_waits(cp):
    assert options.index_checks == "deferred"
    table, good, bad = _dev(cp, np.arange(8.0).reshape(4, 2), np.array([3, 0]), np.array([1, 4]))
    fluxpy.gather(table, good)
    out = fluxpy.gather(table, bad)   # returns, the bad row zero
    np.testing.assert_array_equal(_host(out), [[2.0, 3.0], [0.0, 0.0]])
    assert cp.stream.waits == {"stream": 0, "device": 0}
    with pytest.raises(IndexError, match=r"^gather: index 4 in idx is out of range for src axis 0 of size 4 "
                                         r"\(reported late: an earlier gather call, at .*test_scatter_host.py:\d+"):
        fluxpy.check_indices()


def test_a_deferred_call_returns_its_valid_entries_and_check_indices_raises_for_it(deferred):
    cp = deferred
    src, idx = _dev(cp, np.array([1.0, 2.0, 4.0]), np.array([0, 9, 0]))
    y = fluxpy.scatter("+", src, idx, dstsize=3)   # no error yet
    np.testing.assert_array_equal(_host(y), [5.0, 0.0, 0.0])
    assert cp.stream.waits["stream"] == 0
    with pytest.raises(IndexError) as info:
        fluxpy.check_indices()
    message = str(info.value)
    for words in ("scatter: index 9 in idx is out of range for dstsize axis 0 of size 3", "reported late",
                  "index_checks='deferred'", "test_scatter_host.py:"):
        assert words in message, message
    assert cp.stream.waits["device"] == 1
    flag = scatter_checks._flags[0]
    assert flag.view[0] == 0 and not flag.deferred
    fluxpy.check_indices()   # nothing pending
    np.testing.assert_array_equal(_host(fluxpy.gather(*_dev(cp, np.arange(3.0), np.array([2, 1])))), [2.0, 1.0])


def test_the_next_checked_call_raises_for_an_earlier_deferred_one_before_its_own_work(deferred):
    cp = deferred
    table, rows = _dev(cp, np.arange(8.0).reshape(4, 2), np.array([[1, -3]]))
    out = fluxpy.gather(table, rows)
    np.testing.assert_array_equal(_host(out), [[[2.0, 3.0], [0.0, 0.0]]])   # the bad row: zeros
    good = _dev(cp, np.ones(2), np.array([0, 1]))
    launches = sum(k.launches for k in compiler._functions.values())
    with pytest.raises(IndexError, match=r"^gather: expects non-negative \(0-based\) indices, got -3 in idx "
                                         r"\(reported late: an earlier gather call"):
        fluxpy.scatter("+", *good, dstsize=2)
    assert sum(k.launches for k in compiler._functions.values()) == launches   # raised before its own work
    np.testing.assert_array_equal(_host(fluxpy.scatter("+", *good, dstsize=2)), [1.0, 1.0])
    fluxpy.check_indices()


def test_a_wait_mode_call_reports_a_pending_deferred_error(deferred):
    cp = deferred
    src, *idx = _dev(cp, np.ones((2, 2)), np.array([0, 1]), np.array([1, 4]))
    cp.stream.queue = []   # the GPU runs the queued kernels later
    fluxpy.gather(src, tuple(idx))
    options.set(index_checks="wait")
    with pytest.raises(IndexError, match=r"gather: index 4 in idx\[1\] is out of range for src axis 1 of size 2 "
                                         r"\(reported late"):
        fluxpy.gather(*_dev(cp, np.ones(3), np.array([0])))   # read the flag (clear), queued, waited: flagged
    flag = scatter_checks._flags[0]
    assert flag.view[0] == 0 and not flag.deferred


def test_the_first_bad_deferred_call_is_reported_and_later_ones_stay_recorded(deferred):
    cp = deferred
    src, bad3, good, bad5 = _dev(cp, np.ones(2), np.array([0, 3]), np.array([1, 0]), np.array([5, 0]))
    cp.stream.queue = []   # the GPU runs the queued kernels later
    fluxpy.scatter("+", src, bad3, dstsize=2)
    fluxpy.scatter("+", src, bad5, dstsize=2)
    fluxpy.scatter("+", src, good, dstsize=2)
    flag = scatter_checks._flags[0]
    first = flag.deferred[0][0]
    assert flag.view[0] == 0 and [e[0] for e in flag.deferred] == [first, first + 1, first + 2]
    cp.stream.run_queued()
    assert flag.view[0] == first   # the second call's kernel found the flag taken: the first bad call is named
    with pytest.raises(IndexError, match="index 3 in idx"):
        fluxpy.gather(src, good)   # reports the first, before its own work
    assert flag.view[0] == 0 and [e[0] for e in flag.deferred] == [first + 1, first + 2]   # the later ones: kept
    fluxpy.scatter("+", src, bad5, dstsize=2)
    with pytest.raises(IndexError, match="index 5 in idx"):
        fluxpy.check_indices()
    assert not flag.deferred and not cp.stream.queue   # check_indices waited for the device: all forgotten


def test_an_error_whose_index_arrays_are_gone_still_names_the_op_and_the_axes(deferred):
    cp = deferred
    fluxpy.scatter("max", cp.asarray(np.ones((2, 3))), cp.asarray(np.array([0, 6])), dstsize=(4, 3))
    gc.collect()
    with pytest.raises(IndexError, match=r"scatter: an index was out of range for axes of sizes \(4,\).*no longer "
                                         r"held.*reported late: an earlier scatter call"):
        fluxpy.check_indices()


def test_the_record_is_bounded_and_a_forgotten_call_is_still_reported(deferred, monkeypatch):
    cp = deferred
    monkeypatch.setattr(scatter_checks, "_RECORDED", 4)
    src, bad, good = _dev(cp, np.ones(1), np.array([2]), np.array([0]))
    fluxpy.gather(src, bad)
    flag = scatter_checks._flags[0]
    assert flag.deferred.maxlen == 4
    call, flag.view[0] = flag.view[0], 0   # its report not yet arrived
    for _ in range(6):
        fluxpy.gather(src, good)
    assert len(flag.deferred) == 4
    flag.view[0] = call
    with pytest.raises(IndexError, match="no longer recorded"):
        fluxpy.gather(src, good)



def test_more_index_arrays_than_the_kernels_take_go_to_cupys_indexing(cp):
    """Past MAX_INDEX_ARRAYS index arrays (the parameters cuda/scatter_index.cuh spells out) a gather is CuPy's own
    indexing: the same values, no kernel of ours."""
    rng = np.random.default_rng(5)
    d = cuda_scatter.MAX_INDEX_ARRAYS + 1
    table = rng.standard_normal((2,) * d + (3,))
    index = tuple(rng.integers(0, 2, size=4) for _ in range(d))
    got = cuda_scatter.gather(cp.asarray(table), tuple(FakeArray(i) for i in index))
    np.testing.assert_array_equal(_host(got), table[index])
    assert not compiler._functions
    within = cuda_scatter.gather(cp.asarray(table), tuple(FakeArray(i) for i in index[:d - 1]))
    np.testing.assert_array_equal(_host(within), table[index[:d - 1]])
    assert compiler._functions
