"""The cuDNN backend-graph convolutions (fluxpy.kernels.cudnn.graph) against the NumPy path and the legacy path.

Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import contextlib
import itertools

import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy import losses as L
from fluxpy.ops import activations as A
from fluxpy.ops.conv import conv, conv_backward_data, conv_backward_filter, conv_bias_act, conv_dims
from sweeps import sweep

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def legacy_kernels():
    """The kernel table with cuDNN's legacy calls for the convolution ops (restored afterwards)."""
    from fluxpy import kernels
    from fluxpy.kernels.cudnn import legacy
    snap = kernels.snapshot()
    try:
        for name in ("conv_forward", "conv_backward_data", "conv_backward_filter", "conv_bias_act_forward"):
            kernels.register(name, "cupy", getattr(legacy, name))
        yield
    finally:
        kernels.restore(snap)


def _rel(got, ref):
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.all(np.isfinite(got))
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300)


GRID = list(itertools.product((1, 2), (0, 1, "same"), (1, 2), (True, False)))
TOL = 1e-4


@pytest.mark.parametrize("stride,pad,dilation,flipped", sweep(cases=GRID))
def test_forward_and_backward_match_numpy(graph, stride, pad, dilation, flipped):
    cp = cupy_module()
    rng = np.random.default_rng(hash((stride, str(pad), dilation, flipped)) % 2**32)
    x = rng.standard_normal((3, 5, 11, 10)).astype(np.float32)
    w = rng.standard_normal((6, 5, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    opts = dict(stride=stride, pad=pad, dilation=dilation, flipped=flipped)
    xg, wg, bg = cp.asarray(x), cp.asarray(w), cp.asarray(b)
    x64, w64, b64 = x.astype(np.float64), w.astype(np.float64), b.astype(np.float64)
    before = graph.stats()
    for act in (A.relu, None):
        for with_b in (True, False):
            ref = conv_bias_act(x64, w64, b64 if with_b else None, act, **opts)
            got = conv_bias_act(xg, wg, bg if with_b else None, act, **opts)
            assert _rel(cp.asnumpy(got), ref) < TOL, (act, with_b)
    assert _rel(cp.asnumpy(conv(xg, wg, **opts)), conv(x64, w64, **opts)) < TOL
    cd64 = conv_dims(x64, w64, **opts)
    cd = conv_dims(xg, wg, **opts)
    dy = rng.standard_normal(cd.y_shape)
    dyg = cp.asarray(dy.astype(np.float32))
    assert _rel(cp.asnumpy(conv_backward_data(dyg, wg, cd)), conv_backward_data(dy, w64, cd64)) < TOL
    assert _rel(cp.asnumpy(conv_backward_filter(xg, dyg, cd)), conv_backward_filter(x64, dy, cd64)) < TOL
    after = graph.stats()
    assert after["executes"] > before["executes"]   # the graph path ran (at least partly)


def test_groups_and_asymmetric_pad(graph):
    cp = cupy_module()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 9, 9))
    b = rng.standard_normal(6)
    for opts in (dict(groups=2, pad=1), dict(pad=(0, 1, 1, 0), stride=2), dict(pad="same")):
        w = rng.standard_normal((6, 4 // opts.get("groups", 1), 2, 2))
        xg, wg, bg = (cp.asarray(a.astype(np.float32)) for a in (x, w, b))
        ref = conv_bias_act(x, w, b, A.relu, **opts)
        got = conv_bias_act(xg, wg, bg, A.relu, **opts)
        assert _rel(cp.asnumpy(got), ref) < TOL, opts
        cd64, cd = conv_dims(x, w, **opts), conv_dims(xg, wg, **opts)
        dy = rng.standard_normal(cd.y_shape)
        dyg = cp.asarray(dy.astype(np.float32))
        assert _rel(cp.asnumpy(conv_backward_data(dyg, wg, cd)), conv_backward_data(dy, w, cd64)) < TOL, opts
        assert _rel(cp.asnumpy(conv_backward_filter(xg, dyg, cd)), conv_backward_filter(x, dy, cd64)) < TOL, opts


def test_float64_and_float16(graph):
    cp = cupy_module()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 8, 8))
    w = rng.standard_normal((4, 3, 3, 3))
    b = rng.standard_normal(4)
    ref = conv_bias_act(x, w, b, A.relu, pad=1)
    got = conv_bias_act(cp.asarray(x), cp.asarray(w), cp.asarray(b), A.relu, pad=1)
    assert _rel(cp.asnumpy(got), ref) < 1e-12
    got16 = conv_bias_act(*(cp.asarray(a.astype(np.float16)) for a in (x, w, b)), A.relu, pad=1)
    assert got16.dtype == np.float16 and _rel(cp.asnumpy(got16), ref) < 5e-3


def test_plan_cache_hit_on_second_call(graph):
    cp = cupy_module()
    rng = np.random.default_rng(5)
    xg = cp.asarray(rng.standard_normal((8, 4, 12, 12)).astype(np.float32))
    wg = cp.asarray(rng.standard_normal((8, 4, 3, 3)).astype(np.float32))
    bg = cp.asarray(rng.standard_normal(8).astype(np.float32))
    cd = conv_dims(xg, wg, pad=1, flipped=True)
    s0 = graph.stats()
    y1 = graph.conv_bias_act_forward(xg, wg, bg, "relu", cd)
    s1 = graph.stats()
    assert s1["builds"] == s0["builds"] + 1
    assert s1["fallbacks"] == s0["fallbacks"], graph.fallback_reasons()
    y2 = graph.conv_bias_act_forward(xg, wg, bg, "relu", cd)
    s2 = graph.stats()
    assert s2["builds"] == s1["builds"] and s2["hits"] == s1["hits"] + 1
    assert s2["executes"] == s1["executes"] + 1
    assert bool(cp.all(y1 == y2))
    for _ in range(3):
        graph.conv_backward_data(y2, wg, cd)
        graph.conv_backward_filter(xg, y2, cd)
    s3 = graph.stats()
    assert s3["builds"] == s2["builds"] + 2 and s3["fallbacks"] == s2["fallbacks"], graph.fallback_reasons()


def test_mnist_layers_take_the_graph_path(graph):
    cp = cupy_module()
    for n, c, h, k in ((128, 1, 28, 16), (128, 16, 14, 32), (128, 32, 7, 32)):
        x = cp.ones((n, c, h, h), np.float32)
        w = cp.ones((k, c, 3, 3), np.float32)
        b = cp.zeros(k, np.float32)
        cd = conv_dims(x, w, pad=1)
        s0 = graph.stats()
        y = graph.conv_bias_act_forward(x, w, b, "relu", cd)
        graph.conv_backward_data(y, w, cd)
        graph.conv_backward_filter(x, y, cd)
        s1 = graph.stats()
        assert s1["fallbacks"] == s0["fallbacks"], graph.fallback_reasons()
    assert len(graph.plan_info()) >= 9


def test_error_is_cudnn_error(graph):
    from fluxpy.kernels.cudnn import CudnnError, errors, library
    library.require()
    with pytest.raises(CudnnError) as info:
        errors.check(library.fn.cudnnBackendFinalize(None), "cudnnBackendFinalize")
    assert "cudnnBackendFinalize" in str(info.value) and info.value.status != 0


def test_deterministic_and_tf32_options_replan(graph):
    cp = cupy_module()
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 8, 10, 10))
    w = rng.standard_normal((8, 8, 3, 3))
    xg, wg = cp.asarray(x.astype(np.float32)), cp.asarray(w.astype(np.float32))
    cd = conv_dims(xg, wg, pad=1)
    dy = cp.asarray(rng.standard_normal(cd.y_shape).astype(np.float32))
    with fluxpy.options(deterministic=True):
        a = graph.conv_backward_filter(xg, dy, cd)
        b = graph.conv_backward_filter(xg, dy, cd)
        assert bool(cp.all(a == b))
    n = graph.stats()["builds"]
    graph.conv_backward_filter(xg, dy, cd)
    assert graph.stats()["builds"] == n + 1   # other options: another plan


def _mnist_chain(seed=0):
    from fluxpy.layers import Chain, Conv, Dense, MaxPool, flatten
    r = np.random.default_rng(seed)
    return Chain(Conv((3, 3), 1, 8, A.relu, pad=1, rng=r), MaxPool((2, 2)), Conv((3, 3), 8, 16, A.relu, pad=1, rng=r),
                 MaxPool((2, 2)), flatten, Dense(16 * 7 * 7, 10, rng=r))


def test_chain_gradient_matches_legacy(graph):
    cp = cupy_module()
    r = np.random.default_rng(7)
    x = cp.asarray(r.standard_normal((16, 1, 28, 28)).astype(np.float32))
    y = cp.asarray(np.eye(10, dtype=np.float32)[r.integers(0, 10, 16)])
    m = fluxpy.gpu(_mnist_chain())
    loss = lambda m: L.logitcrossentropy(m(x), y)   # noqa: E731
    s0 = graph.stats()
    l1, g1 = fluxpy.withgradient(loss, m)
    assert graph.stats()["executes"] >= s0["executes"] + 5
    with legacy_kernels():
        s1 = graph.stats()
        l0, g0 = fluxpy.withgradient(loss, m)
        assert graph.stats()["executes"] == s1["executes"]   # the legacy calls ran
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    leaves0, leaves1 = [], []
    fluxpy.fmap(lambda a: leaves0.append(a) or a, g0[0])
    fluxpy.fmap(lambda a: leaves1.append(a) or a, g1[0])
    assert len(leaves0) == len(leaves1) >= 6
    for a, c in zip(leaves1, leaves0):
        if c is None:
            continue
        assert _rel(cp.asnumpy(a), cp.asnumpy(c)) < 1e-4


def test_the_legacy_call_keeps_a_problem_where_it_is_faster(monkeypatch, tmp_path):
    import cupy as cp
    from fluxpy.kernels.cudnn import graph as G
    from fluxpy.ops.dims import ConvDims
    with fluxpy.options(cache_dir=tmp_path):
        rng = np.random.default_rng(11)
        x = cp.asarray(rng.standard_normal((2, 3, 9, 9)))
        w = cp.asarray(rng.standard_normal((4, 3, 3, 3)))
        cd = ConvDims.from_arrays(x, w, pad=1, flipped=True)
        expected = None
        for margin, graph in ((1e9, False), (0.0, True)):   # the legacy call always / never "clearly faster"
            G.clear_cache(disk=True)
            monkeypatch.setattr(G, "LEGACY_MARGIN", margin)
            y = G.conv_forward(x, w, cd)
            reasons = " ".join(G.fallback_reasons().values())
            assert ("legacy call was faster" in reasons) is (not graph)
            expected = y if expected is None else expected
            np.testing.assert_allclose(cp.asnumpy(y), cp.asnumpy(expected), rtol=1e-12)
            if not graph:   # the verdict is kept on disk: a new process goes to the legacy call without timing
                G.clear_cache()
                monkeypatch.setattr(G, "LEGACY_MARGIN", 0.0)
                G.conv_forward(x, w, cd)
                assert "legacy call was faster" in " ".join(G.fallback_reasons().values())
                assert "disk cache" in " ".join(G.fallback_reasons().values())
        G.clear_cache(disk=True)
