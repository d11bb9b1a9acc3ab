"""fluxpy's layer-norm kernels (fluxpy.kernels.cuda_layernorm, planned by layernorm_plan) against the CPU composite in float64: forward,
dx, dgamma, dbeta for row lengths from 2 to 32,768 (a warp, a block, 1,024 threads a row; vector and scalar
loads), every dtype, with and without gamma/beta, one or two normalised axes; the one-sweep backward over many
rows (grid-stride with prefetch, ragged blocks, inside a CUDA graph), and the forward's (1,024-thread rows of
halves); the split backward of the long rows (dx alone by ln_dx1/ln_dx2, the column sums by ln_cols: ragged chunks
and tiles, fused residual/bias, the switch that sends shorter rows to it); determinism; no register spills; second
derivatives through the composite. Needs a GPU (``gpu`` marker)."""
import dataclasses

import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy.backend import capture_graph
from fluxpy.kernels import compiler, cuda_layernorm, find, layernorm_plan
from fluxpy.ops.norm import layernorm
from sweeps import case_id, is_full, sweep
from test_half_conv_matmul import BF16

pytestmark = pytest.mark.gpu

EPS = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 2e-6, np.dtype(np.float16): 2e-3, BF16: 1.6e-2}
LENGTHS = [2, 3, 7, 64, 512, 768, 1000, 1280, 5140, 12288, 20480, 32768]


def _case(rows, tail, dtype, affine, seed=0):
    cp = cupy_module()
    rng = np.random.default_rng(seed)
    shape = rows + tail
    x = (rng.standard_normal(shape) * 3 + 1.5).astype(np.float32).astype(dtype)
    dy = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    cdt = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    g = rng.standard_normal(tail).astype(cdt) if affine else None
    b = rng.standard_normal(tail).astype(cdt) if affine else None
    dev = [None if a is None else cp.asarray(a.view(np.uint16)).view(a.dtype) if a.dtype == BF16 else cp.asarray(a)
           for a in (x, dy, g, b)]
    host = [None if a is None else a.astype(np.float64) for a in (x, dy, g, b)]
    return dev, host


def _stats(x):
    """Arrays like the forward's mean and rstd of x's rows over its last axis (what the backward's supports reads:
    their dtype and size)."""
    cp = cupy_module()
    cdt = np.float64 if x.dtype == np.float64 else np.float32
    return cp.zeros(x.size // x.shape[-1], cdt), cp.ones(x.size // x.shape[-1], cdt)


def _np(a):
    cp = cupy_module()
    a = fluxpy.value_of(a)
    return cp.asnumpy(a.astype(cp.float32) if a.dtype == BF16 else a).astype(np.float64)


def _check(got, want, dtype, what, length=1):
    g, w = _np(got), want
    bound = 8 * EPS[np.dtype(dtype)] * np.sqrt(length) * (np.abs(w).max() + 1)
    err = np.abs(g - w).max()
    assert err <= bound, f"{what}: max error {err:.3g} above {bound:.3g}"


@pytest.mark.parametrize("length, dtype, affine", sweep(LENGTHS, [np.float32, np.float16, BF16, np.float64],
                                                      [True, False]), ids=case_id)
def test_layernorm_matches_the_float64_composite(length, dtype, affine):
    if np.dtype(dtype) == np.float64 and length > 16384:
        pytest.skip("float64 rows this long are turned down (the composite runs): checked below")
    (x, dy, g, b), (xh, dyh, gh, bh) = _case((5, 7), (length,), dtype, affine)
    assert find("layernorm_forward", x, g, b, 1, 1e-5) is not None, "the fused kernel takes the call"
    assert find("layernorm_backward", dy, x, g, *_stats(x), 1, True) is not None, "a backward kernel takes it"

    def loss(x, g, b, dy):
        return (layernorm(x, g, b, -1, 1e-5) * dy).sum()
    y = layernorm(x, g, b, -1, 1e-5)
    assert y.dtype == x.dtype and y.shape == x.shape
    _check(y, layernorm(xh, gh, bh, -1, 1e-5), dtype, "y")
    if affine:
        got = fluxpy.gradient(lambda x, g, b: loss(x, g, b, dy), x, g, b)
        want = fluxpy.gradient(lambda x, g, b: loss(x, g, b, dyh), xh, gh, bh)
    else:
        got = fluxpy.gradient(lambda x: loss(x, None, None, dy), x)
        want = fluxpy.gradient(lambda x: loss(x, None, None, dyh), xh)
    for name, a, w in zip(("dx", "dgamma", "dbeta"), got, want):
        _check(a, w, dtype, name, length if name == "dx" else 35)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
def test_two_normalised_axes_and_the_layer(dtype):
    cp = cupy_module()
    (x, dy, g, b), (xh, dyh, gh, bh) = _case((6,), (12, 64), dtype, True, seed=1)
    _check(layernorm(x, g, b, (-2, -1), 1e-5), layernorm(xh, gh, bh, (-2, -1), 1e-5), dtype, "y over 2 axes")
    layer = fluxpy.gpu(fluxpy.LayerNorm((12, 64)))
    layer.gamma[...] = cp.asarray(gh.astype(np.float32))
    layer.beta[...] = cp.asarray(bh.astype(np.float32))
    got = fluxpy.gradient(lambda m: (m(x) * dy).sum(), layer)[0]
    ref_layer = fluxpy.f64(fluxpy.LayerNorm((12, 64)))
    ref_layer.gamma[...], ref_layer.beta[...] = gh, bh
    want = fluxpy.gradient(lambda m: (m(xh) * dyh).sum(), ref_layer)[0]
    _check(got["gamma"], want["gamma"], dtype, "LayerNorm dgamma", 6)
    _check(got["beta"], want["beta"], dtype, "LayerNorm dbeta", 6)


def test_backward_is_deterministic_and_rows_longer_than_the_kernels_take_run_the_composite():
    cp = cupy_module()
    (x, dy, g, b), _ = _case((64,), (4096,), np.float32, True, seed=2)
    runs = [fluxpy.gradient(lambda x, g, b: (layernorm(x, g, b) * dy).sum(), x, g, b) for _ in range(3)]
    for later in runs[1:]:
        assert all(cp.array_equal(a, c) for a, c in zip(runs[0], later))
    (x64, dy64, g64, b64), (xh, dyh, gh, bh) = _case((3,), (20480,), np.float64, True, seed=3)
    assert find("layernorm_forward", x64, g64, b64, 1, 1e-5) is None
    assert not cuda_layernorm.backward_fits(20480, np.float64)
    _check(layernorm(x64, g64, b64), layernorm(xh, gh, bh), np.float64, "float64 composite")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.float64], ids=str)
def test_no_register_spills_at_any_size(dtype):
    """Every kernel that runs (ln_fwd; the backward's ln_bwd1 or ln_bwd, or ln_dx1 or ln_dx2 and ln_cols; and
    ln_params) keeps to registers, at the lengths of the tests and of the benchmark."""
    # by default the lengths where ptxas once spilled (9,728 float32 and 13,824 fused halves in ln_dx1, 16,896 fused
    # halves and 12,800 fused float64 in ln_fwd) and a short row; every length of the tests and the benchmark in a
    # full run (tests/test_kernel_sources.py checks sm_90's spills of every kernel family without a GPU)
    lengths = [768, 9728, 12800, 13824, 16896]
    if is_full():
        lengths = LENGTHS + [384, 640, 2304, 2560, 4096, 14340, 16380, 16388, 18436, 20476, 16384, 1536, 1024, 9728,
                             10236, 10240, 12800, 13568, 13824, 16896, 18432, 20484, 24576, 28672]
    for length in lengths:
        for fused in (False, True):
            attrs = cuda_layernorm.kernel_attributes(dtype, length, fused)
            if fused and not layernorm_plan.fused_fits(length, dtype):
                assert attrs == {}, "no fused kernel where the composite takes the rows"
                continue
            assert cuda_layernorm.backward_fits(length, dtype) == (layernorm_plan.row_shape(length, dtype)
                                                                   is not None), "the backward takes what the forward takes"
            if cuda_layernorm.backward_fits(length, dtype):
                name = cuda_layernorm.backward_shape(length, dtype, fused).kernel
                assert name in attrs and "ln_params" in attrs
                assert ("ln_cols" in attrs) == name.startswith("ln_dx")
                assert name != "ln_bwds" or layernorm_plan.shared_columns_bytes(length, dtype) <= 227 * 1024
            for name, (regs, local) in attrs.items():
                assert local == 0, (f"{name} at L={length} {np.dtype(dtype)} fused={fused}: {local} bytes of local "
                                    f"memory ({regs} regs)")


@pytest.mark.parametrize("length", [768, 1536, 5140])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
def test_one_sweep_backward_over_many_rows_matches_float64(length, dtype):
    """More rows than the grid holds groups (each group visits several rows, prefetching the next), a row count
    that is not a multiple of the rows a block takes, gamma given as an unaligned view (copied for the vector
    loads), dx alone (no partial rows); the same bits on every call, also from a captured CUDA graph."""
    cp = cupy_module()
    shape = cuda_layernorm.backward_shape(length, dtype)
    assert shape is not None and shape.kernel == "ln_bwd1"
    rpb = shape.rpb
    rows = 3 * 132 * rpb + rpb // 2 + 1     # three rounds of the grid on an H100 (132 SMs), a ragged last block
    (x, dy, g, b), (xh, dyh, gh, bh) = _case((rows,), (length,), dtype, True, seed=8)
    big = cp.zeros(length + 1, g.dtype)
    big[1:] = g
    g_view = big[1:]
    assert g_view.data.ptr % 16 != 0
    y, mean, rstd = cuda_layernorm.layernorm_forward(x, g_view, b, 1, 1e-5)
    dx, dg, db = cuda_layernorm.layernorm_backward(dy, x, g_view, mean, rstd, 1, True)
    want = fluxpy.gradient(lambda x, g, b: (layernorm(x, g, b, -1, 1e-5) * dyh).sum(), xh, gh, bh)
    for name, a, w in zip(("dx", "dgamma", "dbeta"), (dx, dg, db), want):
        _check(a, w, dtype, name, length if name == "dx" else rows)
    dx_only = cuda_layernorm.layernorm_backward(dy, x, g_view, mean, rstd, 1, False)
    assert dx_only[1] is None and dx_only[2] is None and cp.array_equal(dx_only[0], dx)
    again = cuda_layernorm.layernorm_backward(dy, x, g_view, mean, rstd, 1, True)
    assert all(cp.array_equal(a, c) for a, c in zip((dx, dg, db), again))
    graph, captured = capture_graph(lambda: cuda_layernorm.layernorm_backward(dy, x, g_view, mean, rstd, 1, True))
    for _ in range(2):
        graph.launch()
        cp.cuda.get_current_stream().synchronize()
        assert all(cp.array_equal(a, c) for a, c in zip((dx, dg, db), captured))


def test_second_derivatives_go_through_the_composite():
    (x, dy, g, b), (xh, dyh, gh, bh) = _case((4,), (33,), np.float64, True, seed=4)

    got = fluxpy.gradient(lambda x: fluxpy.gradient(lambda z: (layernorm(z, g, b) * dy).sum(), x)[0].sum(), x)[0]
    want = fluxpy.gradient(lambda x: fluxpy.gradient(lambda z: (layernorm(z, gh, bh) * dyh).sum(), x)[0].sum(),
                           xh)[0]
    _check(got, want, np.float64, "second derivative", 33)


def test_the_fused_pullback_differentiates_in_dy():
    """Inside an outer gradient in dy, the fused forward's pullback runs its composite on the Tracked dy."""
    (x, dy, g, b), (xh, dyh, gh, bh) = _case((4,), (40,), np.float64, True, seed=5)

    def outer(d, x, g, b):
        return (fluxpy.gradient(lambda z: (layernorm(z, g, b) * d).sum(), x)[0] ** 2).sum()
    got = fluxpy.gradient(lambda d: outer(d, x, g, b), dy)[0]
    want = fluxpy.gradient(lambda d: outer(d, xh, gh, bh), dyh)[0]
    _check(got, want, np.float64, "d/d(dy) of |dx|^2", 40)


@pytest.mark.parametrize("length", [64, 768, 5140, 12288, 20480, 32768])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16], ids=str)
def test_the_fused_residual_and_bias_form_matches_the_float64_composite(length, dtype):
    """``layernorm(x, g, b, residual=r, bias=c)`` = layer norm of ``x + r + c``, summed inside the kernels: y and
    the cotangents of x, r, c, gamma, beta against float64 on the CPU."""
    cp = cupy_module()
    (x, dy, g, b), (xh, dyh, gh, bh) = _case((3, 11), (length,), dtype, True, seed=6)
    (r, _, c, _), (rh, _, ch, _) = _case((3, 11), (length,), dtype, True, seed=7)
    assert find("layernorm_forward", x, g, b, 1, 1e-5, r, c) is not None

    def loss(x, r, c, g, b, dy):
        return (layernorm(x, g, b, -1, 1e-5, residual=r, bias=c) * dy).sum()
    y = layernorm(x, g, b, residual=r, bias=c)
    _check(y, layernorm(xh + rh + ch, gh, bh), dtype, "y of x + r + c")
    got = fluxpy.gradient(lambda x, r, c, g, b: loss(x, r, c, g, b, dy), x, r, c, g, b)
    want = fluxpy.gradient(lambda x, r, c, g, b: loss(x, r, c, g, b, dyh), xh, rh, ch, gh, bh)
    for name, a, w in zip(("dx", "dresidual", "dbias", "dgamma", "dbeta"), got, want):
        _check(a, w, dtype, name, length if name in ("dx", "dresidual") else 33 * 4)
    layer = fluxpy.gpu(fluxpy.LayerNorm(length))
    assert cp.array_equal(layer(x, residual=r), layernorm(x, layer.gamma, layer.beta, residual=r))


SPLIT_CASES = [(32764, np.float16), (20484, BF16), (20484, np.float32), (20484, np.float16), (10236, np.float64),
               (12288, np.float64), (16384, np.float64)]
READ_CASES = [(16388, np.float16), (16900, BF16), (16380, np.float32)]
CLUSTER_CASES = [(18432, np.float16), (20480, np.float16), (20480, BF16), (24576, np.float16), (26624, BF16),
                 (28672, np.float16), (32768, np.float16),
                 (32768, BF16), (16384, np.float32), (20480, np.float32), (24576, np.float32), (32768, np.float32)]
SHARED_CASES = [(8448, np.float16), (12288, np.float16), (12288, BF16), (16384, np.float16), (10240, np.float32),
                (12288, np.float32)]


def _ids(v):
    return str(np.dtype(v)) if not isinstance(v, int) else str(v)


@pytest.mark.parametrize("length,dtype", [(512, np.float16), (1280, BF16), (640, np.float32), (1792, np.float16)],
                         ids=_ids)
def test_short_rows_visited_grid_stride_match_float64(length, dtype):
    """More rows than the GPU holds at once, a count no block shape divides: the short rows' forward visits them
    grid-stride, loading the next row early (SHORT_ROW_PREFETCH), and ln_bwd1 its rows with a barrier a row group."""
    assert layernorm_plan.forward_plan(length, dtype).prefetch
    plan = cuda_layernorm.backward_shape(length, dtype)
    assert plan.kernel == "ln_bwd1" and plan.tpr > 32
    (x, dy, g, b), (xh, dyh, gh, bh) = _case((4099,), (length,), dtype, True, seed=7)
    _check(layernorm(x, g, b, -1, 1e-5), layernorm(xh, gh, bh, -1, 1e-5), dtype, "y")
    got = fluxpy.gradient(lambda x, g, b: (layernorm(x, g, b, -1, 1e-5) * dy).sum(), x, g, b)
    want = fluxpy.gradient(lambda x, g, b: (layernorm(x, g, b, -1, 1e-5) * dyh).sum(), xh, gh, bh)
    for name, a, w in zip(("dx", "dgamma", "dbeta"), got, want):
        _check(a, w, dtype, name, length if name == "dx" else 4099)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("length,dtype", SPLIT_CASES, ids=_ids)
def test_split_backward_of_long_rows_matches_float64(length, dtype, fused):
    """Rows whose column sums fit neither registers nor shared memory take the split backward (no composite): dx
    alone (ln_dx1, the row in registers, or ln_dx2, two sweeps), then ln_cols (tiles of 32 vectors of columns by
    chunks of rows; here ragged chunks, a ragged last tile at 20,484) and ln_params: rows that split into no
    cluster's whole vectors and whose row does not fit ln_bwds even without its copy of gamma (20,484 halves), and
    float64."""
    shape = cuda_layernorm.backward_shape(length, dtype, fused)
    assert shape is not None and shape.kernel in ("ln_dx1", "ln_dx2"), shape
    rows = 300                  # chunks of 64 rows (COLUMN_MIN_ROWS): the last one ragged, not a multiple of 8 warps
    assert layernorm_plan.column_plan(length, dtype, rows).chunks > 1
    _check_long_rows(length, dtype, fused, rows)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("length,dtype", SHARED_CASES, ids=_ids)
def test_one_sweep_backward_with_shared_column_sums_matches_float64(length, dtype, fused):
    """Rows too long for ln_bwd1's registers but whose column sums fit in a block's shared memory take ln_bwds: one
    sweep a row, the sums in dynamic shared memory (past the 48 KB a block gets without asking: 8448 float16 values
    are 67 KB of sums, 16,384 are 128 KB), here over more rows than the grid holds blocks (each block visits
    several, prefetching where the plan says so) with a ragged last round; gamma's (and the bias's) values of a
    thread's columns held in registers (the fused form takes more of them, so at 12,288 float32 values ln_bwdc)."""
    shape = cuda_layernorm.backward_shape(length, dtype)
    assert shape is not None and shape.kernel == "ln_bwds", shape
    if fused:
        assert cuda_layernorm.backward_shape(length, dtype, True).kernel in ("ln_bwds", "ln_bwdc")
    assert layernorm_plan.shared_columns_bytes(length, dtype) > 48 * 1024
    _check_long_rows(length, dtype, fused, 3 * 132 + 37)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("length,dtype", READ_CASES, ids=_ids)
def test_shared_sweep_reading_gamma_matches_float64(length, dtype, fused):
    """Rows whose copy of gamma does not fit beside the row in ln_bwds and that split into no cluster's whole
    vectors take ln_bwdr: ln_bwds reading gamma (and the bias, fused) twice a row, not the split backward."""
    shape = cuda_layernorm.backward_shape(length, dtype, fused)
    assert shape is not None and shape.kernel == "ln_bwdr", shape
    limit = cuda_layernorm.limits().shared_per_block
    assert layernorm_plan._shared_sweep_plan(length, np.dtype(dtype), limit, fused) is None   # held: no
    _check_long_rows(length, dtype, fused, 3 * 132 + 37)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("length,dtype", CLUSTER_CASES, ids=_ids)
def test_cluster_backward_matches_float64(length, dtype, fused):
    """Rows whose column sums do not fit one block's shared memory take ln_bwdc: a cluster of blocks a row, each
    block its share of the columns, the row sums exchanged through distributed shared memory, gamma's (and the
    bias's) values of a thread's columns held in registers; before the split backward (ln_dx1 or ln_dx2), which
    rereads x and dy. More rows than the clusters the GPU holds at once (each cluster visits several, the last round
    ragged)."""
    shape = cuda_layernorm.backward_shape(length, dtype, fused)
    assert shape is not None and shape.kernel == "ln_bwdc", shape
    limit = cuda_layernorm.limits().shared_per_block
    assert layernorm_plan._shared_sweep_plan(length, np.dtype(dtype), limit, fused) is None   # one block: no
    _check_long_rows(length, dtype, fused, 3 * 66 + 17)


@pytest.mark.parametrize("length,dtype", [(12288, np.float16), (20480, np.float32), (32768, BF16), (16388, np.float16)],
                         ids=_ids)
def test_held_gamma_kernels_without_gamma_with_residual_and_bias(length, dtype):
    """ln_bwds and ln_bwdc hold gamma's and the bias's values of a thread's columns in registers (ln_bwdr reads
    them): without gamma (a layer norm with no scale) and with a residual and bias, dx, dgamma and dbeta match
    float64 (dgamma and dbeta are those of gamma = 1 and beta = 0)."""
    cp = cupy_module()
    assert cuda_layernorm.backward_shape(length, dtype, True).kernel in ("ln_bwds", "ln_bwdc", "ln_bwdr")
    (x, dy, _, _), (xh, dyh, _, _) = _case((3 * 66 + 5,), (length,), dtype, False, seed=14)
    (r, _, c, _), (rh, _, ch, _) = _case((3 * 66 + 5,), (length,), dtype, True, seed=15)
    y, mean, rstd = cuda_layernorm.layernorm_forward(x, None, None, 1, 1e-5, r, c)
    got = cuda_layernorm.layernorm_backward(dy, x, None, mean, rstd, 1, True, r, c)
    ones, zeros = np.ones(length), np.zeros(length)
    want = fluxpy.gradient(lambda x, g, b: (layernorm(x, g, b, -1, 1e-5, residual=rh, bias=ch) * dyh).sum(),
                           xh, ones, zeros)
    for name, a, w in zip(("dx", "dgamma", "dbeta"), got, want):
        _check(a, w, dtype, f"{name} at L={length}", length if name == "dx" else x.shape[0])
    assert cp.array_equal(cuda_layernorm.layernorm_backward(dy, x, None, mean, rstd, 1, True, r, c)[0], got[0])


def test_the_driver_says_how_many_clusters_run_at_once():
    """cuOccupancyMaxActiveClusters answers for ln_bwdc (else the launcher guesses half the SMs' worth of clusters:
    on the H200 the cluster backward at 32,768 halves took 1,530 us so, and 848 us with the driver's 66 clusters)."""
    cp = cupy_module()
    x = cp.asarray(np.random.default_rng(3).standard_normal((64, 32768), dtype=np.float32)).astype(np.float16)
    g = cp.ones(32768, np.float32)
    cuda_layernorm._occupancy.clear()
    y, mean, rstd = cuda_layernorm.layernorm_forward(x, g, None, 1, 1e-5)
    cuda_layernorm.layernorm_backward(x, x, g, mean, rstd, 1)
    assert cuda_layernorm.CLUSTER_QUERY.get("status") == 0, cuda_layernorm.CLUSTER_QUERY


@pytest.mark.parametrize("length,dtype", [(32768, np.float16), (24576, np.float32)], ids=_ids)
def test_without_clusters_the_split_backward_takes_those_rows(monkeypatch, length, dtype):
    """CLUSTER_COLUMNS off (as on a GPU before sm_90): the split backward's two-sweep ln_dx2 takes the rows the
    clusters take, with the same results within rounding."""
    monkeypatch.setitem(layernorm_plan.CLUSTER_COLUMNS, np.dtype(dtype).itemsize, False)
    assert cuda_layernorm.backward_shape(length, dtype).kernel == "ln_dx2"
    _check_long_rows(length, dtype, False, 150)


def _check_long_rows(length, dtype, fused, rows):
    """dx, dgamma, dbeta (and with the residual/bias the cotangent of the sum) against float64 on the CPU; dx alone the
    same bits; the same bits on every call and from a captured CUDA graph."""
    cp = cupy_module()
    (x, dy, g, b), (xh, dyh, gh, bh) = _case((rows,), (length,), dtype, True, seed=9)
    r = c = rh = ch = None
    if fused:
        (r, _, c, _), (rh, _, ch, _) = _case((rows,), (length,), dtype, True, seed=10)
        if not layernorm_plan.fused_fits(length, dtype):   # float64 at 16,384: the composite (spills otherwise)
            assert find("layernorm_forward", x, g, b, 1, 1e-5, r, c) is None
            assert find("layernorm_backward", dy, x, g, *_stats(x), 1, True, r, c) is None
            return
    assert find("layernorm_backward", dy, x, g, *_stats(x), 1, True, r, c) is not None
    y, mean, rstd = cuda_layernorm.layernorm_forward(x, g, b, 1, 1e-5, r, c)
    got = cuda_layernorm.layernorm_backward(dy, x, g, mean, rstd, 1, True, r, c)
    want = fluxpy.gradient(lambda x, g, b: (layernorm(x, g, b, -1, 1e-5, residual=rh, bias=ch) * dyh).sum(),
                           xh, gh, bh)
    for name, a, w in zip(("dx", "dgamma", "dbeta"), got, want):
        _check(a, w, dtype, f"{name} at L={length}", length if name == "dx" else rows)
    dx_only = cuda_layernorm.layernorm_backward(dy, x, g, mean, rstd, 1, False, r, c)
    assert dx_only[1] is None and dx_only[2] is None and cp.array_equal(dx_only[0], got[0])
    for _ in range(2):
        again = cuda_layernorm.layernorm_backward(dy, x, g, mean, rstd, 1, True, r, c)
        assert all(cp.array_equal(a, a2) for a, a2 in zip(got, again)), "bitwise the same on every call"
    graph, captured = capture_graph(lambda: cuda_layernorm.layernorm_backward(dy, x, g, mean, rstd, 1, True, r, c))
    graph.launch()
    cp.cuda.get_current_stream().synchronize()
    assert all(cp.array_equal(a, a2) for a, a2 in zip(got, captured))


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
def test_long_rows_through_the_layer_norm_op(dtype):
    """fluxpy.gradient of layernorm at 20,480 values a row runs a backward kernel (ln_bwdc, a cluster of blocks a
    row; not the composite) and matches float64, with the fused residual and bias too."""
    (x, dy, g, b), (xh, dyh, gh, bh) = _case((2, 9), (20480,), dtype, True, seed=11)
    (r, _, c, _), (rh, _, ch, _) = _case((2, 9), (20480,), dtype, True, seed=12)
    assert cuda_layernorm.backward_shape(20480, dtype).kernel == "ln_bwdc"
    assert cuda_layernorm.backward_shape(20480, dtype, True).kernel == "ln_bwdc"

    def loss(x, r, c, g, b, dy):
        return (layernorm(x, g, b, -1, 1e-5, residual=r, bias=c) * dy).sum()
    got = fluxpy.gradient(lambda x, r, c, g, b: loss(x, r, c, g, b, dy), x, r, c, g, b)
    want = fluxpy.gradient(lambda x, r, c, g, b: loss(x, r, c, g, b, dyh), xh, rh, ch, gh, bh)
    for name, a, w in zip(("dx", "dresidual", "dbias", "dgamma", "dbeta"), got, want):
        _check(a, w, dtype, name, 20480 if name in ("dx", "dresidual") else 18)


def test_the_split_switch_sends_shorter_rows_to_the_split_backward(monkeypatch):
    """SPLIT_FROM (set from measurements) sends 10,240 float16 values from ln_bwd to the split backward: same
    results within rounding, and back when reset."""
    cp = cupy_module()
    assert cuda_layernorm.backward_shape(10240, np.float16).kernel == "ln_bwds"
    (x, dy, g, b), (xh, dyh, gh, bh) = _case((70,), (10240,), np.float16, True, seed=13)
    y, mean, rstd = cuda_layernorm.layernorm_forward(x, g, b, 1, 1e-5)
    shared = cuda_layernorm.layernorm_backward(dy, x, g, mean, rstd, 1, True)
    monkeypatch.setitem(layernorm_plan.SHARED_COLUMNS, 2, False)      # as on a GPU with too little shared memory
    assert cuda_layernorm.backward_shape(10240, np.float16).kernel == "ln_bwd"
    two = cuda_layernorm.layernorm_backward(dy, x, g, mean, rstd, 1, True)
    monkeypatch.setitem(layernorm_plan.SPLIT_FROM, 2, 10240)
    assert cuda_layernorm.backward_shape(10240, np.float16).kernel in ("ln_dx1", "ln_dx2")
    assert "ln_cols" in cuda_layernorm.kernel_attributes(np.float16, 10240)
    split = cuda_layernorm.layernorm_backward(dy, x, g, mean, rstd, 1, True)
    want = fluxpy.gradient(lambda x, g, b: (layernorm(x, g, b, -1, 1e-5) * dyh).sum(), xh, gh, bh)
    for name, a, w, t, s in zip(("dx", "dgamma", "dbeta"), split, want, two, shared):
        _check(a, w, np.float16, name, 10240 if name == "dx" else 70)
        _check(s, w, np.float16, name, 10240 if name == "dx" else 70)
        a, t = a.astype(cp.float32), t.astype(cp.float32)
        assert float(cp.abs(a - t).max()) <= 2e-3 * (float(cp.abs(t).max()) + 1), name
    monkeypatch.setitem(layernorm_plan.SPLIT_FROM, 2, None)
    assert cuda_layernorm.backward_shape(10240, np.float16).kernel == "ln_bwd"


def _forward_over_many_rows(dtype, fused, length):
    """The forward of 700 rows (more than the grid of a whole-block row has blocks: each block visits several, the
    last round ragged): y, mean and rstd against float64, the same bits from a captured CUDA graph."""
    cp = cupy_module()
    rows = 700
    (x, _, g, b), (xh, _, gh, bh) = _case((rows,), (length,), dtype, True, seed=14)
    r = c = rh = ch = None
    if fused:
        (r, _, c, _), (rh, _, ch, _) = _case((rows,), (length,), dtype, True, seed=15)
    y, mean, rstd = cuda_layernorm.layernorm_forward(x, g, b, 1, 1e-5, r, c)
    s = xh + (rh + ch if fused else 0)
    mu = s.mean(axis=1)
    rs = 1 / np.sqrt(((s - mu[:, None]) ** 2).mean(axis=1) + 1e-5)
    _check(y, (s - mu[:, None]) * rs[:, None] * gh + bh, dtype, "y", length)
    _check(mean, mu, np.float32, "mean", length)
    _check(rstd, rs, np.float32, "rstd", length)
    graph, captured = capture_graph(lambda: cuda_layernorm.layernorm_forward(x, g, b, 1, 1e-5, r, c))
    graph.launch()
    cp.cuda.get_current_stream().synchronize()
    assert all(cp.array_equal(a, a2) for a, a2 in zip((y, mean, rstd), captured))


@pytest.mark.parametrize("length", [24576, 32768])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=str)
def test_prefetching_forward_over_more_rows_than_the_grid_holds(dtype, fused, length):
    """Rows of 24,576 and 32,768 halves take a whole block, whose blocks visit the rows grid-stride, getting the next
    row early: the plain forward at 24,576 into registers, where the next row's raw vectors fit beside the row
    (PF); the others into shared memory, each thread copying its own vectors with cp.async (SPF, a row and the
    residual's: 48 to 128 KB a block)."""
    plan = layernorm_plan.forward_plan(length, dtype, fused, cuda_layernorm.limits())
    pf = plan.prefetch
    assert pf == (length == 24576 and not fused)
    assert plan.stages == (not pf)
    _forward_over_many_rows(dtype, fused, length)


@pytest.mark.parametrize("length,dtype,fused", [(28672, np.float16, False), (20480, np.float32, False),
                                                (24576, BF16, True)], ids=str)
def test_forward_staging_two_rows_ahead(monkeypatch, length, dtype, fused):
    """The staged forward's ring of two rows ahead (the form taken where ptxas spills the form of one), forced:
    each slot refilled with the row two visits on, the last copies empty."""
    monkeypatch.setattr(cuda_layernorm, "_forward_kernels", {})
    plan = layernorm_plan.forward_plan(length, dtype, fused, cuda_layernorm.limits())
    two = dataclasses.replace(plan, stages=2, blocks=1, prefetch=False)
    fn = compiler.module(*cuda_layernorm.forward_source(two, length, dtype, fused)).get_function("ln_fwd")
    cuda_layernorm._forward_kernels[cuda_layernorm._kernel_key(dtype, length, fused)] = (fn, two)
    assert cuda_layernorm._forward_kernel(dtype, length, fused)[1].stages == 2
    _forward_over_many_rows(dtype, fused, length)


def test_a_forward_that_spills_is_rebuilt_for_fewer_blocks_an_sm(monkeypatch):
    """Where ptxas spills the form asked for (here the rule told that a thread needs 40 registers fewer than its row
    values, and that no shape holds enough rows an SM, so it asks for 6 or more blocks an SM), the forward is rebuilt
    a block fewer at a time until it does not; it still matches float64."""
    monkeypatch.setattr(cuda_layernorm, "_forward_kernels", {})
    monkeypatch.setitem(layernorm_plan.FORWARD_SPARE, 2, -40)
    monkeypatch.setattr(layernorm_plan, "FORWARD_MIN_ROWS", 33)
    built, compiled = [], cuda_layernorm._compiled_attributes

    def recording(name, defines, kernel):
        built.append(defines["BLOCKS"])
        return compiled(name, defines, kernel)
    monkeypatch.setattr(cuda_layernorm, "_compiled_attributes", recording)
    length, dtype = 12288, np.float16
    asked = layernorm_plan.forward_plan(length, dtype, False, cuda_layernorm.limits()).blocks
    assert asked >= 6
    fn, plan = cuda_layernorm._forward_kernel(dtype, length)
    assert fn.local_size_bytes == 0 and plan.blocks < asked
    assert asked in built and min(built) < asked, built
    _forward_over_many_rows(dtype, False, length)


@pytest.mark.parametrize("length, dtype, fused", sweep([4608, 5140, 5376, 6144], [np.float16, BF16, np.float32],
                                                     [False, True]), ids=case_id)
def test_a_backward_of_one_row_an_sm_runs_two_blocks_where_ptxas_fits_them(length, dtype, fused):
    """ln_bwd1 where its plan holds one row an SM: for the halves, the first two-block form that ptxas compiles
    without spilling (else the plan, every form having spilled); float32 keeps its plan. Either way the result
    matches float64, the same bits on every call and from a captured CUDA graph."""
    dtype = np.dtype(dtype)
    plan = layernorm_plan.backward_plan(length, dtype, fused, cuda_layernorm.limits())
    assert plan.kernel == "ln_bwd1" and plan.rpb == 1
    launched, fn = cuda_layernorm._backward_kernels_of(dtype, length, fused)[:2]
    assert cuda_layernorm.backward_shape(length, dtype, fused) == launched
    blocks = launched.blocks
    if not layernorm_plan.BACKWARD_TWO_BLOCKS[dtype.itemsize]:
        assert (launched, blocks) == (plan, 1)
    elif blocks == 2:
        assert launched.items > plan.items and launched.tpr < plan.tpr, "more values a thread, fewer threads a row"
        assert fn.local_size_bytes == 0
        assert layernorm_plan.blocks_an_sm(launched.tpr, fn.num_regs, fn.shared_size_bytes) >= 2
    else:   # every two-block form spilled
        assert launched == plan
        for form in layernorm_plan.two_block_forms(plan, length):
            f = compiler.module(*cuda_layernorm.backward_source(form, length, dtype, fused)).get_function("ln_bwd1")
            assert f.local_size_bytes > 0 or layernorm_plan.blocks_an_sm(form.tpr, f.num_regs,
                                                                         f.shared_size_bytes) < 2
    if dtype.itemsize == 2 and length == 5140 and not fused:
        assert blocks == 2, "the H200's NVRTC fits 192 threads of 7 vectors (the benchmark's case)"
    _check_long_rows(length, dtype, fused, 2 * 132 * 2 + 7)   # more rows than two rounds of the grid


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=str)
def test_half_parameters_take_the_kernels(monkeypatch, dtype):
    """gamma, beta and the bias in x's half dtype (a PyTorch-style half model) are read in float32, so the fused
    kernels take the call rather than the composite; the result is the float32 parameters' to the bit, and their
    gradients come back in their own dtype, matching float64."""
    cp = cupy_module()
    (x, dy, g, b), (xh, dyh, gh, bh) = _case((3, 41), (768,), dtype, True, seed=21)
    (r, _, c, _), (rh, _, ch, _) = _case((3, 41), (768,), dtype, True, seed=22)
    host_halves = [a.astype(np.float32).astype(dtype) for a in (gh, bh, ch)]
    halves = [cp.asarray(a.view(np.uint16)).view(a.dtype) if a.dtype == BF16 else cp.asarray(a) for a in host_halves]
    exact = [cp.asarray(a.astype(np.float32)) for a in host_halves]   # the half values, in float32
    want_y = layernorm(x, *exact[:2], -1, 1e-5, residual=r, bias=exact[2])

    hosts = [a.astype(np.float64) for a in host_halves]   # the float64 reference first: the host runs the composite
    want = fluxpy.gradient(lambda g, b, c: (layernorm(xh, g, b, -1, 1e-5, residual=rh, bias=c) * dyh).sum(), *hosts)

    def composite(*args, **kw):
        raise AssertionError("the composite ran")
    monkeypatch.setattr(fluxpy.ops.norm, "normalise", composite)
    got_y = layernorm(x, *halves[:2], -1, 1e-5, residual=r, bias=halves[2])
    assert got_y.dtype == dtype and bool((got_y.view(cp.uint16) == want_y.view(cp.uint16)).all())   # the same bits
    assert find("layernorm_backward", dy, x, exact[0], *_stats(x), 1, True, r, exact[2]) is not None
    grads = fluxpy.gradient(lambda g, b, c: (layernorm(x, g, b, -1, 1e-5, residual=r, bias=c) * dy).sum(), *halves)
    for name, a, w in zip(("dgamma", "dbeta", "dbias"), grads, want):
        assert a.dtype == dtype, name
        _check(a, w, dtype, name, 123)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=str)
def test_strided_and_offset_arrays_take_the_kernels(dtype):
    """x, dy and the residual as transposed views (a ConvNeXt block's channels-last layer norm reads one, a
    transpose's pullback gives one) and x starting an element into its buffer: the kernels take them (copied
    C-contiguous first) and match float64. mean and rstd of another dtype or size are turned down (the composite
    runs)."""
    cp = cupy_module()
    (x, dy, _, _), (xh, dyh, _, _) = _case((2, 96), (35,), dtype, False, seed=31)   # (n, c, h * w) in memory
    (r, _, _, _), (rh, _, _, _) = _case((2, 96), (35,), dtype, False, seed=32)
    gh = np.random.default_rng(33).standard_normal(96).astype(np.float32).astype(np.float64)
    g = cp.asarray(gh.astype(np.float32))
    xt, dyt, rt = (a.transpose(0, 2, 1) for a in (x, dy, r))        # (n, h * w, c) views: c is strided
    xth, dyth, rth = (a.transpose(0, 2, 1) for a in (xh, dyh, rh))
    assert not xt.flags.c_contiguous and not dyt.flags.c_contiguous
    assert find("layernorm_forward", xt, g, None, 1, 1e-5, rt) is not None

    def loss(x, r, g, dy):
        return (layernorm(x, g, None, -1, 1e-5, residual=r) * dy).sum()
    got = fluxpy.gradient(lambda x, r, g: loss(x, r, g, dyt), xt, rt, g)
    want = fluxpy.gradient(lambda x, r, g: loss(x, r, g, dyth), xth, rth, gh)
    _check(layernorm(xt, g, None, -1, 1e-5, residual=rt), layernorm(xth, gh, None, -1, 1e-5, residual=rth), dtype,
           "y of strided x", 96)
    for name, a, w in zip(("dx", "dresidual", "dgamma"), got, want):
        _check(a, w, dtype, name, 96 if name != "dgamma" else 70)

    buffer = cp.empty(x.size + 1, x.dtype)
    offset = buffer[1:].reshape(x.shape)             # C-contiguous, 2 or 4 bytes past a 16-byte boundary
    bits = np.dtype(f"u{x.itemsize}")
    offset.view(bits)[...] = x.view(bits)   # the bits (CuPy's copy kernels do not know bfloat16)
    assert offset.data.ptr % 16
    y, mean, rstd = cuda_layernorm.layernorm_forward(offset, None, None, 1, 1e-5)
    _check(y, layernorm(xh, None, None, -1, 1e-5), dtype, "y of an offset x", 35)
    assert find("layernorm_backward", dy, offset, None, mean, rstd, 1, True) is not None
    assert find("layernorm_backward", dy, x, None, mean.astype(np.float64), rstd, 1, True) is None
    assert find("layernorm_backward", dy, x, None, mean[:-1], rstd[:-1], 1, True) is None
