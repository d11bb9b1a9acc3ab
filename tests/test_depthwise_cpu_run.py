"""fluxpy's depthwise kernels (``fluxpy/kernels/cuda/depthwise.cu``) run on the CPU, without a GPU: the source as
NVRTC gets it, compiled by g++ with ``tests/cuda_on_cpu/shim.h`` (a thread per CUDA thread, barriers for
``__syncthreads`` and the warp shuffles, one block at a time), its float16 conversions the host's (tests/kernel_on_cpu.py),
launched by ``fluxpy.kernels.cuda_depthwise``'s own host code (its CuPy calls given NumPy, its launches the
compiled library's), against a float64 NumPy reference. Every candidate segment width ``wb`` at strides 1 and 2 with
row tails, both halves, kernels of 1x3 to 7x7, dilation, strides above the kernel's reach, single channels and
several channel chunks. It checks the kernels' indexing, tails and sums; registers, speed and the GPU's own
arithmetic are ``tests/gpu/test_depthwise_gpu.py``'s. Skips where g++ lacks C++20's ``<barrier>`` or ``_Float16``.
"""
import ctypes
import types

import ml_dtypes
import numpy as np
import pytest

from fluxpy.kernels import compiler
from fluxpy.kernels import cuda_depthwise as dw
from fluxpy.layout import is_channels_last, to_channels_last
from fluxpy.ops.dims import ConvDims
from kernel_on_cpu import build_folder, library

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
SOURCE = "depthwise.cu"
PROCESSORS = 16   # the SMs the host code plans for: several blocks, and shares of the weight's gradient


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return build_folder(tmp_path_factory, SOURCE, "depthwise.cpp")


class _Function:
    def __init__(self, library, kernel):
        self.library, self.kernel = library, kernel


def _argument(a):
    if isinstance(a, np.ndarray):
        assert a.dtype in (F16, BF16, np.float32), f"a kernel got a {a.dtype} array"
        assert a.flags.c_contiguous or is_channels_last(a), "a kernel got a strided view"
        return ctypes.c_void_p(a.__array_interface__["data"][0])
    kinds = {np.int64: ctypes.c_longlong, np.int32: ctypes.c_int}
    assert type(a) in kinds, f"a kernel argument of type {type(a).__name__} ({a!r}): CuPy takes NumPy scalars"
    return kinds[type(a)](a.item())


def _launch(fn, grid, block, args, shared_mem=0):
    grid = (grid if isinstance(grid, tuple) else (int(grid),)) + (1, 1)
    block = (block if isinstance(block, tuple) else (int(block),)) + (1,)
    assert block[0] * block[1] in (256, 1024), f"a block of {block[:2]} threads: 256 (the row kernels) or 1,024"
    assert shared_mem <= 48 * 1024, f"{shared_mem} bytes of dynamic shared memory without opting in"
    values = [_argument(a) for a in args]
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    sizes = (ctypes.c_int * len(values))(*[ctypes.sizeof(v) for v in values])
    done = fn.library.emu_launch(fn.kernel.encode(), *grid[:3], *block[:2], pointers, sizes, len(values))
    assert done != 2, f"{fn.kernel}: arguments of {list(sizes)} bytes do not fit its parameters"
    assert done == 0, f"no kernel {fn.kernel} in the build"


def _nan_filled(shape, dtype):
    """np.empty that shows an element no kernel wrote (NaN)."""
    return np.full(shape, np.nan, dtype)


@pytest.fixture()
def on_cpu(build, monkeypatch):
    """cuda_depthwise's host code with NumPy for CuPy and the CPU build of each define set for its launches."""
    libraries = {}

    def function(name, kernel, defines, options=()):
        assert name == SOURCE
        key = tuple(sorted(defines.items()))
        if key not in libraries:
            libraries[key] = library(build, SOURCE, "depthwise.cpp", defines)
        return _Function(libraries[key], kernel)

    standin = types.SimpleNamespace(ndarray=np.ndarray, empty=_nan_filled)
    monkeypatch.setattr(dw, "cupy", standin)
    monkeypatch.setattr(compiler, "function", function)
    monkeypatch.setattr(compiler, "launch", _launch)
    monkeypatch.setattr(compiler, "device", lambda dev=None: types.SimpleNamespace(processors=PROCESSORS))


def _reference(x, w, dy, cd):
    """``(y, dx, dw)`` in float64 by slices of the padded input, one tap at a time."""
    n, c, h, wd = x.shape
    kh, kw = w.shape[2:]
    (sh, sw), (dh, dlw), (top, bottom, left, right) = cd.stride, cd.dilation, cd.pad
    oh, ow = cd.y_shape[2:]
    taps = w[:, 0] if cd.flipped else w[:, 0, ::-1, ::-1]   # cross-correlation weights
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    y, dxp, dtaps = np.zeros(cd.y_shape), np.zeros_like(xp), np.zeros_like(taps)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + (oh - 1) * sh + 1, sh)
            cols = slice(j * dlw, j * dlw + (ow - 1) * sw + 1, sw)
            y += xp[:, :, rows, cols] * taps[None, :, i, j, None, None]
            dxp[:, :, rows, cols] += dy * taps[None, :, i, j, None, None]
            dtaps[:, i, j] = np.einsum("nchw,nchw->c", dy, xp[:, :, rows, cols])
    dweight = (dtaps if cd.flipped else dtaps[:, ::-1, ::-1])[:, None]
    return y, dxp[:, :, top:top + h, left:left + wd], dweight


def _close(got, want, dtype, terms, what):
    """Within half-precision rounding of the result and of ``terms`` products added in float32 (as the GPU test)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{what}: not finite at {np.argwhere(~np.isfinite(got))[:4].tolist()}"
    eps = 2.0 ** -8 if dtype == BF16 else 2.0 ** -11
    scale = np.sqrt(terms) * (np.abs(want).max() + 1)
    assert np.max(np.abs(got - want)) <= 4 * eps * scale, (what, np.max(np.abs(got - want)), scale)


def _run(rng, shape, kernel, dtype, tiles=(None, None), inf_columns=(), **opts):
    """The three kernels on random values of ``shape`` against :func:`_reference`; ``tiles`` (forward, filter)
    forced where given; ``inf_columns``: input columns no output reads, set to inf."""
    c = shape[1]
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    w = rng.standard_normal((c, 1, *kernel)).astype(np.float32).astype(dtype)
    cd = ConvDims.from_shapes(x.shape, w.shape, groups=c, **opts)
    dy = rng.standard_normal(cd.y_shape).astype(np.float32).astype(dtype)
    want = _reference(*(a.astype(np.float64) for a in (x, w, dy)), cd)
    x[:, :, :, list(inf_columns)] = np.inf
    xl, dyl = to_channels_last(x), to_channels_last(dy)
    y = dw.forward(xl, w, cd, tile=tiles[0])
    dx = dw.backward_data(dyl, w, cd)
    dwt = dw.backward_filter(xl, dyl, cd, tile=tiles[1])
    assert is_channels_last(y) and is_channels_last(dx) and dwt.shape == w.shape
    assert y.dtype == dx.dtype == dwt.dtype == dtype
    taps = kernel[0] * kernel[1]
    for name, got, ref, terms in zip(("y", "dx", "dw"), (y, dx, dwt), want, (taps, taps, dy.size // c)):
        _close(got, ref, dtype, terms, f"{name} of {shape} {kernel} {opts} {tiles}")


def _width_with_a_tail(rng, wb, stride, reach):
    """An input width whose output row is at least ``wb`` wide and (for wb > 1) not a multiple of it."""
    while True:
        width = int(rng.integers(reach + stride * wb, reach + stride * 3 * wb + 3))
        ow = (width + 2 - reach) // stride + 1
        if ow >= wb and (wb == 1 or ow % wb):
            return width


# (wb, stride, dtype, khb of the weight's gradient): every width at strides 1 and 2, the halves and row counts mixed
WIDTHS = [(1, 1, F16, 1), (1, 2, BF16, 3), (2, 1, BF16, 3), (2, 2, F16, 1), (4, 1, F16, 3), (4, 2, BF16, 1),
          (8, 1, BF16, 1), (8, 2, F16, 1)]


@pytest.mark.parametrize("case", range(len(WIDTHS)))
def test_every_segment_width_at_strides_one_and_two_with_row_tails(on_cpu, case):
    wb, stride, dtype, khb = WIDTHS[case]
    rng = np.random.default_rng(case)
    c = 256 if case % 2 else int(rng.choice([8, 16, 24]))   # 256: a thread row a warp, up to 16 shares
    h = int(rng.integers(10, 16) if c == 256 else rng.integers(3, 7))
    shape = (int(rng.integers(1, 3)), c, h, _width_with_a_tail(rng, wb, stride, 3))
    tiles = (dw.Tile(wb), dw.Tile(wb, khb=khb, per_sm=2))
    _run(rng, shape, (3, 3), dtype, tiles, stride=stride, pad=1, flipped=case % 4 < 2)


FEATURES = [   # (C, H, W), kernel, dtype, options: each with the rule's tiles
    ((40, 7, 9), (5, 5), BF16, dict(pad=2)),
    ((8, 12, 11), (3, 3), F16, dict(stride=(2, 1), pad=(2, 2, 1, 1), dilation=2, flipped=True)),
    ((32, 5, 13), (1, 3), BF16, dict(pad=(0, 0, 1, 1))),
    ((264, 5, 6), (3, 3), F16, dict(stride=2, pad=(0, 1, 1, 0), flipped=True)),
    ((16, 9, 10), (7, 7), BF16, dict(pad=3)),
    ((16, 6, 17), (3, 3), BF16, dict(stride=(1, 2), dilation=(1, 2), pad=2)),
    ((24, 8, 14), (2, 2), F16, dict(stride=3)),
    ((16, 7, 12), (3, 1), BF16, dict(pad=(1, 1, 0, 0), flipped=True)),
]


@pytest.mark.parametrize("case", range(len(FEATURES)))
def test_kernel_sizes_dilation_wide_strides_and_channel_chunks(on_cpu, case):
    (c, h, width), kernel, dtype, opts = FEATURES[case]
    rng = np.random.default_rng(100 + case)
    _run(rng, (int(rng.integers(1, 3)), c, h, width), kernel, dtype, **opts)


@pytest.mark.parametrize("dtype, wb, khb", [(F16, 2, 3), (BF16, 8, 1)], ids=str)
def test_single_channels(on_cpu, dtype, wb, khb):
    rng = np.random.default_rng(wb)
    shape = (2, 7, 4, _width_with_a_tail(rng, wb, 1, 3))
    _run(rng, shape, (3, 3), dtype, (dw.Tile(wb), dw.Tile(wb, khb=khb, per_sm=4)), pad=1)


def test_the_weights_gradient_adds_many_shares_in_order(on_cpu):
    # 1,024 segments of a thread row each (256 channels: one thread row a warp), 64 shares: every row of
    # dw_filter_total's block adds two
    rng = np.random.default_rng(5)
    _run(rng, (2, 256, 16, 32), (3, 3), F16, (dw.Tile(1), dw.Tile(1, khb=3, per_sm=4)), pad=1)


def test_every_forward_tile_gives_the_same_bits(on_cpu):
    # each output's taps are added in (kh, kw) order whatever the width of its segment
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 16, 5, 19)).astype(np.float32).astype(BF16)
    w = rng.standard_normal((16, 1, 3, 3)).astype(np.float32).astype(BF16)
    cd = ConvDims.from_shapes(x.shape, w.shape, pad=1, groups=16)
    tiles = dw.candidates("forward", cd)
    ys = [dw.forward(to_channels_last(x), w, cd, tile=t).view(np.uint16) for t in tiles]
    assert [t.wb for t in tiles] == [1, 2, 4, 8]
    for t, y in zip(tiles, ys):
        assert np.array_equal(y, ys[0]), t


def test_columns_only_past_the_last_output_do_not_reach_the_sums(on_cpu):
    # stride 2, no padding, width 8: the three outputs read columns 0-6; the second segment of two also holds an
    # output past the row's end, which would read columns 6-8
    rng = np.random.default_rng(3)
    _run(rng, (2, 16, 5, 8), (3, 3), BF16, (dw.Tile(2), dw.Tile(2, khb=3, per_sm=2)), inf_columns=[7], stride=2)


def test_a_tile_that_is_not_a_candidate_is_refused_by_name():
    cd = ConvDims.from_shapes((2, 16, 8, 3), (16, 1, 7, 7), pad=3, groups=16)
    assert dw.Tile(4) not in dw.candidates("forward", cd), "wider than the row (3 columns)"
    with pytest.raises(ValueError, match="depthwise forward: tile"):
        dw.forward(None, None, cd, tile=dw.Tile(4))
    with pytest.raises(ValueError, match="depthwise filter"):
        dw.backward_filter(None, None, cd, tile=dw.Tile(2, khb=7, per_sm=2))


def test_the_rule_picks_a_candidate_no_wider_than_the_row():
    rng = np.random.default_rng(11)
    for _ in range(40):
        k = int(rng.choice([1, 3, 5, 7]))
        c, h = int(rng.choice([16, 32, 96, 1024])), int(rng.integers(k, 40))
        cd = ConvDims.from_shapes((int(rng.integers(1, 300)), c, h, h), (c, 1, k, k), pad=k // 2,
                                  stride=int(rng.integers(1, 3)), groups=c)
        sms = int(rng.integers(1, 200))
        for direction in ("forward", "filter"):
            tile = dw.plan(direction, cd, processors=sms)
            assert tile in dw.candidates(direction, cd), (direction, cd, tile)
            assert tile.wb == 1 or tile.wb <= cd.y_shape[3]


class _OnDevice(np.ndarray):
    """A NumPy array standing in for a CuPy one where the host code asks for its device or CuPy's layout flag."""
    device = types.SimpleNamespace(id=0)

    @property
    def _c_contiguous(self):
        return self.flags.c_contiguous


@pytest.mark.parametrize("fastest", ["tile", "cudnn"])
def test_the_kernel_table_keeps_whichever_timed_fastest_and_times_a_problem_once(on_cpu, monkeypatch, fastest):
    """conv_forward and conv_backward_filter time every tile of the shortlist and cuDNN's plan on a problem's first
    call (GPU time stood in for by a script: one tile made the fastest, or cuDNN's plan), keep the fastest and run
    it, and time nothing on the next call; the results at the kept tile match the reference."""
    monkeypatch.setattr(dw.cupy, "ndarray", _OnDevice)
    monkeypatch.setattr(dw, "_choices", {})
    rng = np.random.default_rng(7)
    shape, c = (2, 16, 6, 13), 16
    x = rng.standard_normal(shape).astype(np.float32).astype(BF16)
    w = rng.standard_normal((c, 1, 3, 3)).astype(np.float32).astype(BF16).view(_OnDevice)
    cd = ConvDims.from_shapes(x.shape, w.shape, groups=c, pad=1)
    dy = rng.standard_normal(cd.y_shape).astype(np.float32).astype(BF16)
    want = _reference(*(a.astype(np.float64) for a in (x, w, dy)), cd)
    xl, dyl = to_channels_last(x).view(_OnDevice), to_channels_last(dy).view(_OnDevice)
    ran, timed = [], []

    def spied(real):
        def spy(a, b, cdims, tile=None):
            ran.append(tile)
            return real(a, b, cdims, tile)
        return spy
    for name in ("forward", "backward_filter"):
        monkeypatch.setattr(dw, name, spied(getattr(dw, name)))

    def cudnn(*args):
        ran.append(dw.CUDNN)
        return dw.forward(xl, w, cd) if len(args) == 3 and args[1] is w else dw.backward_filter(xl, dyl, cd)
    monkeypatch.setattr(dw.graph, "conv_forward", cudnn)
    monkeypatch.setattr(dw.graph, "conv_backward_filter", cudnn)
    for direction, call in (("forward", lambda: dw.conv_forward(xl, w, cd)),
                            ("filter", lambda: dw.conv_backward_filter(xl, dyl, cd))):
        shortlist = dw._shortlist(direction, cd)
        kept = dw.CUDNN if fastest == "cudnn" else shortlist[len(shortlist) // 2]

        def time_ms(run, reps=5, failures=(), hide_host=False, _kept=kept):
            ran.clear()
            run()
            timed.append(ran[0])
            return 1.0 if ran[0] == _kept else 2.0
        monkeypatch.setattr(dw.compiler, "time_ms", time_ms)
        timed.clear()
        out = call()
        n = len(shortlist) + 1   # each by GPU time, then back to back the one near the fastest
        assert timed[:n] == shortlist + [dw.CUDNN] and set(timed[n:]) == {kept}, f"{direction}: timed {timed}"
        assert dw._choices[(direction, cd, xl.dtype, 0)] == kept
        ran.clear()
        timed.clear()
        again = call()
        assert timed == [] and ran[0] == kept, (direction, timed, ran)
        ref = want[0] if direction == "forward" else want[2]
        for got in (out, again):
            _close(got, ref, BF16, 9 if direction == "forward" else dy.size // c, f"{direction} kept {kept}")
