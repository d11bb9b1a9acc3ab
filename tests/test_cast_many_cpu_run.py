"""fluxpy's batched conversion kernel (``fluxpy/kernels/cuda/cast_many.cu``) run on the CPU, without a GPU: the source
as NVRTC gets it, compiled by g++ with ``tests/cuda_on_cpu/shim.h`` (a thread per CUDA thread, one block at a time),
launched by ``fluxpy.kernels.cuda_halves.cast_many``'s own host code (its CuPy calls given NumPy, its launches the
compiled library's), against NumPy/ml_dtypes bit for bit: float32 to both halves and back, NaN, infinities, values
past float16's range and subnormals, every layout mapping (C order to channels-last and back, channels-last kept,
transposed matrices to C order), strided sources, empty arrays, more arrays than one launch's table holds, a static
and a dynamic loss scale; and
MixedPrecision's batched casts (``fluxpy.precision._to_halves``) through it against the per-array casts, forward and
gradients (tests/test_precision_cast_many.py's checks), and a MixedPrecision model's loss and gradients (its GPU casts
on NumPy). The source is tests/kernel_on_cpu.py's (halfs.cuh's float16 PTX as the host compiler's ``_Float16``).
Skips where g++ lacks C++20's ``<barrier>`` or ``_Float16``.
"""
import copy
import ctypes
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import precision
from fluxpy.kernels import compiler, cuda_halves
from fluxpy.layout import is_channels_last, to_channels_last
from kernel_on_cpu import build_folder, library
from test_precision_cast_many import (HALF_DTYPES, SHAPES, assert_same, check, check_unscaled, draw, specs,
                                      weights_of)

F32 = np.dtype(np.float32)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return build_folder(tmp_path_factory, "cast_many.cu", "cast_many.cpp")


def _argument(a):
    """A launch argument as ctypes holds it: the table's bytes (a struct by value), an address, a number."""
    if isinstance(a, np.ndarray) and a.dtype.names:
        return (ctypes.c_char * a.nbytes).from_address(a.__array_interface__["data"][0])
    if isinstance(a, np.ndarray):
        assert a.dtype == np.float32 and a.size == 1, f"the scale must be one float32, got {a.dtype} {a.shape}"
        return ctypes.c_void_p(a.__array_interface__["data"][0])
    kinds = {np.uint64: ctypes.c_void_p, np.int32: ctypes.c_int, np.float32: ctypes.c_float}
    assert type(a) in kinds, f"a kernel argument of type {type(a).__name__} ({a!r}): CuPy takes NumPy scalars"
    return kinds[type(a)](a.item())


@pytest.fixture()
def launches(build, monkeypatch):
    """cuda_halves' host code with NumPy for CuPy and the CPU build of each variant for its launches; the list of
    the launches' (table, count) as they are made."""
    libraries, made = {}, []

    def function(name, kernel, defines, options=()):
        assert (name, kernel) == ("cast_many.cu", "cast_many")
        key = tuple(sorted(defines.items()))
        if key not in libraries:
            libraries[key] = library(build, "cast_many.cu", "cast_many.cpp", defines)
        return libraries[key]

    def launch(library, grid, block, args, shared_mem=0):
        assert shared_mem == 0 and block == cuda_halves._THREADS
        values = [_argument(a) for a in args]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
                                                      for v in values])
        assert library.emu_launch(b"cast_many", int(grid), 1, 1, int(block), pointers) == 0
        made.append((args[0]["t"][0].copy(), int(args[1])))

    standin = types.SimpleNamespace(ndarray=np.ndarray, empty=np.empty, ascontiguousarray=np.ascontiguousarray)
    monkeypatch.setattr(cuda_halves, "cupy", standin)
    monkeypatch.setattr(cuda_halves, "_address", lambda a: a.__array_interface__["data"][0])
    monkeypatch.setattr(compiler, "function", function)
    monkeypatch.setattr(compiler, "launch", launch)
    return made


def _want(x, dtype, scale):
    with np.errstate(all="ignore"):
        y = x.astype(dtype)
        return y if scale is None else np.asarray(y / np.float32(scale if isinstance(scale, float) else scale[()]))


def _pairs():
    return [(F32, h) for h in HALF_DTYPES] + [(h, F32) for h in HALF_DTYPES] + [(F32, F32)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), spec=specs(), pair=st.sampled_from(_pairs()),
       layouts=st.lists(st.booleans(), min_size=6, max_size=6), scale=st.sampled_from(["none", "static", "dynamic"]))
def test_the_kernel_on_the_cpu_equals_numpy_bit_for_bit(launches, seed, spec, pair, layouts, scale):
    src, dst = pair
    with np.errstate(over="ignore"):
        xs = [w.astype(src) for w in weights_of(seed, spec)]
    xs = [x if is_channels_last(x) or x.flags.c_contiguous else to_channels_last(x) for x in xs]
    xs = [np.asfortranarray(x) if x.ndim == 2 and flag else x for x, flag in zip(xs, layouts[::-1])]   # transposed
    scale = scale if dst == F32 else "none"   # a loss scale is taken off the gradients only
    scale = "static" if src == dst and scale == "none" else scale   # float32 to float32: only to divide
    scale = {"none": None, "static": 96.0, "dynamic": np.asarray(np.float32(2.0 ** -3))}[scale]
    last = layouts[:len(xs)]
    launches.clear()
    got = cuda_halves.cast_many(xs[0], xs, dst, last, scale)
    assert len(launches) == (1 if any(x.size for x in xs) else 0)
    for i, (x, y, cl) in enumerate(zip(xs, got, last)):
        want = _want(x, dst, scale)
        want = to_channels_last(want) if cl and x.ndim >= 3 else want.copy()
        assert_same(y, want, f"array {i}, shape {x.shape}, {src} -> {dst}, channels-last {cl}")


def test_a_strided_source_and_more_arrays_than_a_launch_holds(launches):
    rng = np.random.default_rng(7)
    xs = [draw(rng, SHAPES[i % len(SHAPES)]) for i in range(cuda_halves.CAP + 9)]
    xs[3] = draw(rng, (6, 5)).T   # a transposed matrix: read in place
    xs[4] = to_channels_last(draw(rng, (2, 3, 2, 5)))[:, :, :, ::2]   # strided: copied to C order first
    xs[5] = draw(rng, (7, 4))[::2]
    last = [i % 3 == 0 for i in range(len(xs))]
    got = cuda_halves.cast_many(xs[0], xs, np.float16, last)
    filled = sum(1 for x in xs if x.size)   # an empty array takes no entry
    assert filled > cuda_halves.CAP and [count for _, count in launches] == [cuda_halves.CAP, filled - cuda_halves.CAP]
    for i, (x, y, cl) in enumerate(zip(xs, got, last)):
        want = _want(x, np.float16, None)
        want = to_channels_last(want) if cl and x.ndim >= 3 else want.copy()
        assert_same(y, want, f"array {i}, shape {x.shape}")
    table, _ = launches[0]
    assert table[3] == xs[3].__array_interface__["data"][0], "the transposed matrix was copied"
    addresses = [y.__array_interface__["data"][0] for y in got]
    assert len({a % 256 for a in addresses}) == 1, "the results are not laid out a multiple of 256 bytes apart"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), spec=specs(), dtype=st.sampled_from(HALF_DTYPES),
       memory=st.sampled_from(["channels_last", "contiguous"]), scale=st.sampled_from(["none", "static", "dynamic"]))
def test_mixed_precisions_batched_casts_through_the_kernel_equal_the_per_array_casts(launches, monkeypatch, seed, spec,
                                                                                   dtype, memory, scale):
    real = precision.find
    monkeypatch.setattr(precision, "find", lambda name, *args: cuda_halves.cast_many if name == "astype_many"
                        else real(name, *args))
    launches.clear()
    check(seed, spec, dtype, memory, scale, kernel=True)
    assert launches or not any(size for shape, _ in spec for size in [int(np.prod(shape))]), "the kernel never ran"
    assert len(launches) <= 3, f"{len(launches)} launches: more than one for each forward (a plain one and a " \
        "recorded one) and one for the backward"


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_a_mixed_precision_model_through_the_kernel_equals_it_through_the_per_array_casts(launches, monkeypatch,
                                                                                         dtype):
    monkeypatch.setattr(precision, "gpu_device", lambda x: 0)   # the GPU's casts (no rounding back), on NumPy
    real = precision.find
    monkeypatch.setattr(precision, "find", lambda name, *args: cuda_halves.cast_many if name == "astype_many"
                        else real(name, *args))
    rng = np.random.default_rng(11)
    base = fluxpy.Chain(fluxpy.Conv((3, 3), 2, 4, fluxpy.relu, rng=rng), fluxpy.flatten,
                        fluxpy.Dense(4 * 4 * 4, 3, rng=rng))
    x = rng.standard_normal((3, 2, 6, 6)).astype(np.float32)

    def run(batched):
        kw = {"loss_scale": precision.DynamicLossScale(init=2.0 ** 6)} if dtype == np.float16 else {}
        m = precision.mixed_precision(copy.deepcopy(base), dtype, **kw)
        with monkeypatch.context() as patch:
            if not batched:
                patch.setattr(precision, "_why_not_batched", lambda *a: "per-array casts asked for by the test")
            launches.clear()
            loss, (g,) = fluxpy.withgradient(lambda m: (m(x) ** 2).sum(), m)
            return loss, fluxpy.trainables(g), len(launches), precision.cast_reason()
    got, want = run(True), run(False)
    assert got[2:] == (2, "") and want[2] == 0
    assert got[0] == want[0]
    for i, (a, b) in enumerate(zip(got[1], want[1])):
        assert_same(a, b, f"gradient {i}", layout=False)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), spec=specs(), scale=st.sampled_from(["static", "dynamic"]))
def test_the_float32_layers_batched_unscaling_through_the_kernel_equals_one_division_each(launches, monkeypatch, seed,
                                                                                          spec, scale):
    real = precision.find
    monkeypatch.setattr(precision, "find", lambda name, *args: cuda_halves.cast_many if name == "astype_many"
                        else real(name, *args))
    launches.clear()
    check_unscaled(seed, spec, scale, kernel=True)
    used = [shape for shape, _ in spec[1 if len(spec) > 1 else 0:]]   # a 0-d weight's cotangent is a NumPy scalar:
    batched = any(len(s) and int(np.prod(s)) for s in used)            # divided alone, as the half casts do
    assert len(launches) == (1 if batched else 0), f"{len(launches)} launches"


def test_a_float16_models_float32_layers_gradients_are_unscaled_in_one_launch(launches, monkeypatch):
    """Under float16's loss scale the float32 layers' parameters (batch norm, layer norm) get their gradients divided
    by the scale in one launch (float32 to float32), bit for bit as one division each, and the half weights' casts
    keep their launch each way."""
    monkeypatch.setattr(precision, "gpu_device", lambda x: 0)   # the GPU's casts (no rounding back), on NumPy
    real = precision.find
    monkeypatch.setattr(precision, "find", lambda name, *args: cuda_halves.cast_many if name == "astype_many"
                        else real(name, *args))
    rng = np.random.default_rng(5)
    base = fluxpy.Chain(fluxpy.Dense(6, 8, rng=rng), fluxpy.LayerNorm(8), fluxpy.Dense(8, 5, fluxpy.relu, rng=rng),
                        fluxpy.LayerNorm(5), fluxpy.Dense(5, 3, rng=rng))
    x = rng.standard_normal((4, 6)).astype(np.float32)

    def run(batched):
        m = precision.mixed_precision(copy.deepcopy(base), np.float16,
                                      loss_scale=precision.DynamicLossScale(init=2.0 ** 6))
        with monkeypatch.context() as patch:
            if not batched:
                patch.setattr(precision, "_kept_unscaler",
                              lambda leaves, scale: lambda w: precision._unscaled_backward(w, scale))
            launches.clear()
            loss, (g,) = fluxpy.withgradient(lambda m: (m(x) ** 2).sum(), m)
            return loss, fluxpy.trainables(g), len(launches)
    got, want = run(True), run(False)
    assert (got[2], want[2]) == (3, 2), "the float32 layers' gradients were not unscaled in one launch"
    assert got[0] == want[0] and len(got[1]) == len(want[1]) == 10
    for i, (a, b) in enumerate(zip(got[1], want[1])):
        assert a.dtype == np.float32
        assert_same(a, b, f"gradient {i}", layout=False)
