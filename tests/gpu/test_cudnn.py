"""The cuDNN binding (fluxpy.kernels.cudnn): loading, errors, options, the legacy calls and their algorithm
cache, streams.

Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import json
import os

import numpy as np
import pytest

from devices import cupy_module
from fluxpy.ops.dims import ConvDims
from fluxpy.options import options

pytestmark = pytest.mark.gpu


@pytest.fixture()
def cudnn(tmp_path):
    """The cuDNN package with a temporary disk cache and empty plan caches; the options a test sets are put back."""
    from fluxpy.kernels import cudnn
    before = options.get()
    options.set(cache_dir=tmp_path)
    cudnn.clear_cache()
    yield cudnn
    options.set(**before)
    cudnn.clear_cache()


def _problem(rng, n=4, c=8, h=12, k=16, r=3, dtype=np.float32, **opts):
    cp = cupy_module()
    x = cp.asarray(rng.standard_normal((n, c, h, h)).astype(dtype))
    w = cp.asarray(rng.standard_normal((k, c // opts.get("groups", 1), r, r)).astype(dtype))
    return x, w, ConvDims.from_arrays(x, w, **opts)


def test_available_and_version(cudnn):
    ok, why = cudnn.available()
    assert ok, why
    assert cudnn.version() >= 90000
    print(why)


def test_forced_error_names_status(cudnn):
    with pytest.raises(cudnn.CudnnError) as info:
        cudnn.descriptors.tensor_descriptor((0, -1, 3, 3), np.float32)
    err = info.value
    assert err.call == "cudnnSetTensor4dDescriptor"
    assert err.status_name.startswith("CUDNN_STATUS_BAD_PARAM"), err.status_name
    assert "CUDNN_STATUS_BAD_PARAM" in str(err) and "(0, -1, 3, 3)" in str(err)


def test_fused_forward_ignores_garbage_output_memory(cudnn):
    """alpha2 = 0 with z = y: cuDNN must not read the (uninitialised) output; poison it with NaN."""
    cp = cupy_module()
    rng = np.random.default_rng(0)
    x, w, cd = _problem(rng, flipped=True, pad=1)
    b = cp.asarray(rng.standard_normal(cd.y_shape[1]).astype(np.float32))
    for kind in ("relu", "identity"):
        cp.get_default_memory_pool().free_all_blocks()
        poison = cp.full(cd.y_shape, np.nan, np.float32)
        del poison   # its block goes back to the pool and is handed out next
        y = cudnn.legacy.conv_bias_act_forward(x, w, b, kind, cd)
        assert cudnn.plan(cd, x.dtype).fused_ok[kind], kind   # the fused call ran (cuDNN did not refuse it)
        assert bool(cp.isfinite(y).all()), kind
        ref = cudnn.legacy.conv_forward(x, w, cd) + b.reshape(1, -1, 1, 1)
        if kind == "relu":
            ref = cp.maximum(ref, 0)
        assert float(cp.abs(y - ref).max()) < 1e-4


def test_refused_fusion_composes(cudnn):
    """Where cuDNN refuses the fused call the legacy kernel composes conv, bias and relu: never None."""
    cp = cupy_module()
    rng = np.random.default_rng(12)
    x, w, cd = _problem(rng, pad=(0, 1, 1, 0))
    b = cp.asarray(rng.standard_normal(cd.y_shape[1]).astype(np.float32))
    for kind in ("relu", "identity"):
        for bias in (b, None):
            cudnn.plan(cd, x.dtype).fused_ok[kind] = False
            y = cudnn.legacy.conv_bias_act_forward(x, w, bias, kind, cd)
            ref = cudnn.legacy.conv_forward(x, w, cd) + (0 if bias is None else bias.reshape(1, -1, 1, 1))
            if kind == "relu":
                ref = cp.maximum(ref, 0)
            assert y.shape == cd.y_shape and float(cp.abs(y - ref).max()) < 1e-5, (kind, bias is None)


def test_algorithm_cache_written_and_reused(cudnn):
    cp = cupy_module()
    rng = np.random.default_rng(1)
    x, w, cd = _problem(rng, stride=2, pad=1)
    before = cudnn.stats()
    y = cudnn.legacy.conv_forward(x, w, cd)
    dy = cp.asarray(rng.standard_normal(y.shape).astype(np.float32))
    cudnn.legacy.conv_backward_data(dy, w, cd)
    cudnn.legacy.conv_backward_filter(x, dy, cd)
    mid = cudnn.stats()
    assert mid["find"] - before["find"] == 3
    path = cudnn.cache_file()
    assert path.startswith(options.cache_dir) and os.path.exists(path)
    table = json.load(open(path))
    kinds = sorted(k.split("|")[0] for k in table)
    assert kinds == ["bwd_data", "bwd_filter", "fwd"], table.keys()
    cudnn.clear_cache()          # memory only: the next run reads the file
    y2 = cudnn.legacy.conv_forward(x, w, cd)
    cudnn.legacy.conv_backward_data(dy, w, cd)
    cudnn.legacy.conv_backward_filter(x, dy, cd)
    after = cudnn.stats()
    assert after["find"] == mid["find"] and after["disk_hits"] - mid["disk_hits"] == 3
    assert float(cp.abs(y2 - y).max()) <= 1e-5 * float(cp.abs(y).max())
    cudnn.clear_cache(disk=True)
    assert not os.path.exists(path)


def test_deterministic_mode(cudnn):
    cp = cupy_module()
    rng = np.random.default_rng(2)
    options.set(deterministic=True)
    x, w, cd = _problem(rng, n=32, c=32, h=14, k=32, pad=1)
    dy = cp.asarray(rng.standard_normal(cd.y_shape).astype(np.float32))
    dws = [cudnn.legacy.conv_backward_filter(x, dy, cd) for _ in range(3)]
    dxs = [cudnn.legacy.conv_backward_data(dy, w, cd) for _ in range(3)]
    assert all(bool((d == dws[0]).all()) for d in dws) and all(bool((d == dxs[0]).all()) for d in dxs)
    table = json.load(open(cudnn.cache_file()))
    rows = [r for k, v in table.items() if "det=1" in k for r in v]
    assert rows and all(r[3] == 1 for r in rows), rows


def test_tf32_switch_and_dtypes(cudnn):
    rng = np.random.default_rng(3)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5), (np.float16, 3e-3)):
        x, w, cd = _problem(rng, n=2, c=16, h=10, k=16, dtype=dtype, pad=1, flipped=True)
        ref = _cpu_conv(x, w, cd)
        y = cudnn.legacy.conv_forward(x, w, cd)
        assert y.dtype == dtype
        err = np.linalg.norm(y.get().astype(np.float64) - ref) / np.linalg.norm(ref)
        assert err < tol, (dtype, err)
    options.set(allow_tf32=True)
    x, w, cd = _problem(rng, n=8, c=64, h=16, k=64, pad=1)
    ref = _cpu_conv(x, w, cd)
    err = np.linalg.norm(cudnn.legacy.conv_forward(x, w, cd).get() - ref) / np.linalg.norm(ref)
    assert err < 3e-3, err   # TF32 or not, the result is close


def _cpu_conv(x, w, cd):
    from fluxpy.kernels import cpu
    return cpu.conv_forward(x.get().astype(np.float64), w.get().astype(np.float64), cd)


def test_bias_gradient_with_and_without_db(cudnn):
    cp = cupy_module()
    from fluxpy.kernels import cuda_conv
    rng = np.random.default_rng(4)
    x, w, cd = _problem(rng, n=8, c=8, h=14, k=16, pad=1)
    y = cp.maximum(cudnn.legacy.conv_forward(x, w, cd), 0)
    dy = cp.asarray(rng.standard_normal(cd.y_shape).astype(np.float32))
    ref_dz = np.where(y.get() > 0, dy.get(), 0)
    ref_db = ref_dz.astype(np.float64).sum(axis=(0, 2, 3))
    dz, db = cuda_conv.conv_bias_act_backward(dy, y, "relu", cd, True)   # one pass: the mask and the sum
    np.testing.assert_array_equal(dz.get(), ref_dz)
    np.testing.assert_allclose(db.get(), ref_db, rtol=1e-5, atol=1e-4)
    dz, db = cuda_conv.conv_bias_act_backward(dy, y, "relu", cd, False)   # the mask alone
    np.testing.assert_array_equal(dz.get(), ref_dz)
    assert db is None


def test_non_default_stream(cudnn):
    cp = cupy_module()
    rng = np.random.default_rng(5)
    x, w, cd = _problem(rng, pad=1)
    y0 = cudnn.legacy.conv_forward(x, w, cd)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        y1 = cudnn.legacy.conv_forward(x, w, cd)
    s.synchronize()
    assert bool((y0 == y1).all())


def test_workspace_limit_zero_still_runs(cudnn):
    cp = cupy_module()
    rng = np.random.default_rng(6)
    options.set(workspace_limit=0)
    x, w, cd = _problem(rng, pad=1, stride=2)
    y = cudnn.legacy.conv_forward(x, w, cd)
    dy = cp.ones_like(y)
    cudnn.legacy.conv_backward_data(dy, w, cd)
    cudnn.legacy.conv_backward_filter(x, dy, cd)
    ref = _cpu_conv(x, w, cd)
    assert np.linalg.norm(y.get() - ref) / np.linalg.norm(ref) < 1e-5
