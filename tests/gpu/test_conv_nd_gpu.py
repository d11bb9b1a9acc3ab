"""Convolutions and pools of 1 and 3 spatial dimensions on CuPy (cuDNN: 1-d as 2-d with a unit axis, 3-d with 5-d
descriptors; the pools' RawKernels through the staged 2-d pools) against the CPU path.

Forward results and every gradient over option grids (stride, pad including "same" and asymmetric, dilation,
groups and depthwise, flipped), float64 tight and float32 loose against NumPy in float64, float16 and bfloat16
against the float32 result; the graph and the legacy cuDNN paths each; finite differences on the GPU; the layers.
Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere). Run:
``python -m pytest -q tests/gpu/test_conv_nd_gpu.py -p no:cacheprovider``.
"""
import itertools

import ml_dtypes
import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy.kernels.cudnn import graph, legacy
from fluxpy.ops import activations as A
from fluxpy.ops.conv import conv, conv_bias_act, conv_dims, conv_transpose
from fluxpy.ops.pool import adaptive_maxpool, adaptive_meanpool, global_maxpool, global_meanpool, maxpool, meanpool
from sweeps import grid

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("isolated_cudnn_cache")]

TOL = {np.float64: 1e-12, np.float32: 1e-5}


def _rel(got, ref):
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.all(np.isfinite(got)), "non-finite values"
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300)


def compare(f, args, dtype, seed=0, tol=None):
    """f and the gradient of <f, ct> in every array argument: NumPy float64 versus CuPy ``dtype``."""
    cp = cupy_module()
    tol = TOL[dtype] if tol is None else tol
    rng = np.random.default_rng(seed)
    args64 = [a.astype(np.float64) if isinstance(a, np.ndarray) else a for a in args]
    y_ref, back_ref = fluxpy.pullback(f, *args64)
    ct = rng.standard_normal(y_ref.shape)
    g_ref = back_ref(ct)
    gargs = [cp.asarray(a.astype(dtype)) if isinstance(a, np.ndarray) else a for a in args]
    y, back = fluxpy.pullback(f, *gargs)
    assert isinstance(y, cp.ndarray) and y.dtype == dtype and y.shape == y_ref.shape
    assert _rel(y.get(), y_ref) < tol, ("forward", _rel(y.get(), y_ref))
    g = back(cp.asarray(ct.astype(dtype)))
    for i, (a, b) in enumerate(zip(g, g_ref)):
        if b is None:
            assert a is None
            continue
        err = _rel(a.get(), b)
        assert err < tol * 10, ("gradient", i, err)


# (x spatial size, kernel, option grid) per rank
SHAPES = {1: ((13,), (3,)), 3: ((6, 7, 5), (3, 2, 3))}
PADS = {1: [0, 1, "same", (2, 0)], 3: [0, 1, "same", (1, 0, 0, 2, 1, 1)]}


def _grid(n, step=1):
    """The option grid of rank ``n`` (every ``step``-th case): each pair of options by default, all with --full."""
    cases = list(itertools.product([1, 2], PADS[n], [1, 2], [1, 2], [False, True]))[::step]
    return [dict(stride=s, pad=p, dilation=d, groups=g, flipped=f) for s, p, d, g, f in grid(cases)]


def _problem(rng, n, groups, cin=4, cout=6):
    size, kernel = SHAPES[n]
    return rng.standard_normal((2, cin) + size), rng.standard_normal((cout, cin // groups) + kernel)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_conv_bias_act_relu_grid(n, dtype):
    rng = np.random.default_rng(1)
    failures = []
    for opts in _grid(n):
        x, w = _problem(rng, n, opts["groups"])
        b = rng.standard_normal(w.shape[0])
        try:
            compare(lambda x, w, b: conv_bias_act(x, w, b, A.relu, **opts), [x, w, b], dtype)
        except (AssertionError, ValueError) as err:
            failures.append((opts, str(err)[:200]))
    assert not failures, failures


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_conv_identity_and_no_bias_grid(n, dtype):
    rng = np.random.default_rng(2)
    failures = []
    for opts in _grid(n, step=3):
        x, w = _problem(rng, n, opts["groups"])
        b = rng.standard_normal(w.shape[0])
        try:
            compare(lambda x, w: conv(x, w, **opts), [x, w], dtype)
            compare(lambda x, w, b: conv_bias_act(x, w, b, None, **opts), [x, w, b], dtype)
            compare(lambda x, w: conv_bias_act(x, w, None, A.relu, **opts), [x, w], dtype)
            compare(lambda x, w, b: conv_bias_act(x, w, b, A.tanh, **opts), [x, w, b], dtype)
        except (AssertionError, ValueError) as err:
            failures.append((opts, str(err)[:200]))
    assert not failures, failures


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("path", ["graph", "legacy"])
def test_each_cudnn_path_matches_the_cpu(n, path):
    """The graph and the legacy calls directly (forward, fused relu, backward data and filter), float64."""
    cp = cupy_module()
    kernels = {"graph": graph, "legacy": legacy}[path]
    from fluxpy.kernels import cpu
    rng = np.random.default_rng(3)
    failures = []
    for opts in _grid(n)[::2]:
        x, w = _problem(rng, n, opts["groups"])
        b = rng.standard_normal(w.shape[0])
        cd = conv_dims(x, w, **opts)
        dy = rng.standard_normal(cd.y_shape)
        xg, wg, bg, dyg = map(cp.asarray, (x, w, b, dy))
        y = cpu.conv_forward(x, w, cd)
        pairs = [(kernels.conv_forward(xg, wg, cd), y),
                 (kernels.conv_bias_act_forward(xg, wg, bg, "relu", cd),
                  np.maximum(y + b.reshape((1, -1) + (1,) * n), 0)),
                 (kernels.conv_backward_data(dyg, wg, cd), cpu.conv_backward_data(dy, w, cd)),
                 (kernels.conv_backward_filter(xg, dyg, cd), cpu.conv_backward_filter(x, dy, cd))]
        for i, (got, ref) in enumerate(pairs):
            if got.shape != ref.shape or _rel(got.get(), ref) > 1e-12:
                failures.append((opts, i, got.shape, ref.shape))
    assert not failures, failures


def _device(a):
    """A host array on the device, its dtype kept (bfloat16 through its bits)."""
    cp = cupy_module()
    a = np.ascontiguousarray(a)
    return cp.asarray(a.view(np.uint16)).view(a.dtype) if a.dtype == ml_dtypes.bfloat16 else cp.asarray(a)


def _as_float32(a):
    """A CuPy float16, bfloat16 or float32 array as float32 (bfloat16 by its bits: the top half of a float32)."""
    if a.dtype == ml_dtypes.bfloat16:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


@pytest.mark.parametrize("n", [1, 3])
def test_graph_path_plans_1d_and_3d(n):
    """The fast path: cuDNN's graph API plans the forward, both backward convolutions and the fused forward of 1-d
    (as 2-d) and 3-d problems in float32, with no call sent to the legacy path. Untimed (``autotune=0``): timed,
    these small problems' legacy call can win on a busy GPU, and the test is about planning them."""
    cp = cupy_module()
    rng = np.random.default_rng(12)
    x, w = _problem(rng, n, 1)
    x, w = cp.asarray(x.astype(np.float32)), cp.asarray(w.astype(np.float32))
    b = cp.asarray(rng.standard_normal(w.shape[0]).astype(np.float32))
    cd = conv_dims(x, w, pad=1)
    dy = cp.asarray(rng.standard_normal(cd.y_shape).astype(np.float32))
    graph.clear_cache()
    before = graph.stats()["fallbacks"]
    with fluxpy.options(autotune=0):
        graph.conv_forward(x, w, cd)
        graph.conv_bias_act_forward(x, w, b, "relu", cd)
        graph.conv_backward_data(dy, w, cd)
        graph.conv_backward_filter(x, dy, cd)
    assert graph.stats()["fallbacks"] == before, graph.fallback_reasons()
    kinds = sorted(p["kind"] for p in graph.plan_info() if len(p["x"]) == n + 2)
    assert kinds == ["bwd_data", "bwd_filter", "fwd", "fwd_relu"], (kinds, graph.fallback_reasons())


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_half_convolutions_match_float32(n, dtype):
    """Half storage, float32 compute: the forward and both gradients against the float32 GPU result of the same
    (rounded) numbers."""
    cupy_module()
    rng = np.random.default_rng(4)
    tol = 1e-2 if dtype == np.float16 else 4e-2
    for opts in [dict(pad=1), dict(stride=2, pad="same", groups=2), dict(dilation=2, flipped=True, groups=4)]:
        x, w = _problem(rng, n, opts["groups"] if "groups" in opts else 1, cin=4, cout=8)
        x, w = x.astype(dtype), (w * 0.3).astype(dtype)
        b = rng.standard_normal(8).astype(dtype)
        ct = rng.standard_normal(conv_dims(x, w, **opts).y_shape).astype(dtype)

        def run(dt):
            args = [_device(a.astype(np.float32).astype(dt)) for a in (x, w, b)]
            y, back = fluxpy.pullback(lambda x, w, b: conv_bias_act(x, w, b, A.relu, **opts), *args)
            return [_as_float32(a) for a in (y, *back(_device(ct.astype(np.float32).astype(dt))))]
        got, ref = run(dtype), run(np.float32)
        for i, (a, r) in enumerate(zip(got, ref)):
            assert _rel(a.get(), r.get()) < tol, (opts, i, _rel(a.get(), r.get()))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_conv_transpose(n, dtype):
    rng = np.random.default_rng(5)
    size, kernel = SHAPES[n]
    x = rng.standard_normal((2, 4) + tuple(max(s // 2, 2) for s in size))
    for opts in [dict(stride=2), dict(stride=2, pad=1, output_padding=1), dict(pad=1, dilation=2),
                 dict(stride=2, pad="same", groups=2), dict(stride=2, flipped=True, pad=(1, 0) * n)]:
        w = rng.standard_normal((4, 3 if opts.get("groups", 1) == 1 else 2) + kernel)
        compare(lambda x, w: conv_transpose(x, w, **opts), [x, w], dtype)


POOLS = {
    1: [(lambda x: maxpool(x, (2,)), "max 2"), (lambda x: maxpool(x, (3,), stride=1, pad=1), "max 3 s1 p1"),
        (lambda x: meanpool(x, (3,), stride=2, pad=(1, 2)), "mean asym"), (global_maxpool, "global max"),
        (global_meanpool, "global mean"), (lambda x: adaptive_maxpool(x, (3,)), "adaptive max"),
        (lambda x: adaptive_meanpool(x, (4,)), "adaptive mean")],
    3: [(lambda x: maxpool(x, (2, 2, 2)), "max 2"), (lambda x: maxpool(x, (3, 2, 3), stride=1, pad=1), "max p1"),
        (lambda x: maxpool(x, (2, 3, 2), stride=(1, 2, 1), pad=(1, 0, 0, 2, 1, 1)), "max asym"),
        (lambda x: meanpool(x, (2, 2, 2), pad="same"), "mean same"), (global_maxpool, "global max"),
        (global_meanpool, "global mean"), (lambda x: adaptive_maxpool(x, (2, 3, 2)), "adaptive max"),
        (lambda x: adaptive_meanpool(x, (3, 2, 2)), "adaptive mean")],
}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("ties", [False, True])
def test_pools_match_cpu(n, dtype, ties):
    """Forward and gradient, including ties (small integers), where the gradient goes to the first max."""
    cp = cupy_module()
    rng = np.random.default_rng(6)
    shape = (2, 3, 11) if n == 1 else (2, 3, 5, 6, 7)
    x = rng.integers(0, 3, shape).astype(dtype) if ties else rng.standard_normal(shape).astype(dtype)
    for f, name in POOLS[n]:
        y_ref, back_ref = fluxpy.pullback(f, x)
        ct = rng.standard_normal(y_ref.shape).astype(dtype)
        (g_ref,) = back_ref(ct)
        y, back = fluxpy.pullback(f, cp.asarray(x))
        (g,) = back(cp.asarray(ct))
        assert y.dtype == y_ref.dtype and g.dtype == g_ref.dtype, (name, y.dtype, y_ref.dtype, g.dtype, g_ref.dtype)
        rtol = 2e-3 if dtype == np.float16 else 1e-6
        np.testing.assert_allclose(y.get(), y_ref, rtol=rtol, atol=rtol, err_msg=name)
        np.testing.assert_allclose(g.get(), g_ref, rtol=rtol, atol=rtol, err_msg=name)


def _fd_check(f, args, eps=1e-6, seed=8):
    """Directional derivative of <f(args), ct> by central differences, all on the GPU in float64."""
    cp = cupy_module()
    rng = np.random.default_rng(seed)
    y, back = fluxpy.pullback(f, *args)
    ct = cp.asarray(rng.standard_normal(y.shape))
    grads = back(ct)
    dirs = [cp.asarray(rng.standard_normal(a.shape)) for a in args]

    def loss(sign):
        shifted = [a + sign * eps * d for a, d in zip(args, dirs)]
        return float((f(*shifted) * ct).sum())
    numeric = (loss(1) - loss(-1)) / (2 * eps)
    analytic = sum(float((g * d).sum()) for g, d in zip(grads, dirs))
    assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), (numeric, analytic)


def test_gradients_against_finite_differences_on_gpu():
    cp = cupy_module()
    rng = np.random.default_rng(9)
    x1, w1 = cp.asarray(rng.standard_normal((2, 4, 12))), cp.asarray(rng.standard_normal((6, 2, 3)))
    b = cp.asarray(rng.standard_normal(6))
    _fd_check(lambda x, w, b: conv_bias_act(x, w, b, A.tanh, stride=2, pad="same", groups=2, flipped=True),
              [x1, w1, b])
    x3, w3 = cp.asarray(rng.standard_normal((1, 2, 5, 6, 4))), cp.asarray(rng.standard_normal((3, 2, 2, 3, 2)))
    _fd_check(lambda x, w: conv(x, w, pad=(0, 1, 1, 0, 2, 1), dilation=(1, 2, 1)), [x3, w3])
    _fd_check(lambda x, w: conv_transpose(x, w, stride=2, pad=1), [x3, cp.asarray(rng.standard_normal((2, 3, 3, 3, 3)))])
    _fd_check(lambda x: maxpool(x, (2, 2, 2), pad=1) ** 2, [x3])


def test_channels_last_3d_conv_matches_c_order():
    cp = cupy_module()
    from fluxpy.layout import to_channels_last
    rng = np.random.default_rng(10)
    x, w = rng.standard_normal((2, 8, 4, 5, 6)).astype(np.float32), rng.standard_normal((8, 8, 3, 3, 3))
    w = w.astype(np.float32)
    ref = conv_bias_act(cp.asarray(x), cp.asarray(w), None, A.relu, pad=1).get()
    got = conv_bias_act(to_channels_last(cp.asarray(x)), to_channels_last(cp.asarray(w)), None, A.relu, pad=1)
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make,shape", [
    (lambda rng: fluxpy.Conv((5,), 3, 8, fluxpy.relu, pad=2, rng=rng), (4, 3, 16)),
    (lambda rng: fluxpy.CrossCor((3,), 4, 4, stride=2, rng=rng), (2, 4, 9)),
    (lambda rng: fluxpy.Conv((3, 3, 3), 2, 4, fluxpy.relu, pad=1, rng=rng), (2, 2, 5, 6, 7)),
    (lambda rng: fluxpy.ConvTranspose((2, 2, 2), 4, 2, stride=2, rng=rng), (1, 4, 3, 3, 3)),
    (lambda rng: fluxpy.ConvTranspose((4,), 4, 2, stride=2, pad=1, rng=rng), (2, 4, 7)),
    (lambda rng: fluxpy.DepthwiseConv((3,), 4, 8, fluxpy.relu, pad=1, rng=rng), (2, 4, 10)),
    (lambda rng: fluxpy.DepthwiseConv((3, 3), 8, 8, pad=1, rng=rng), (2, 8, 9, 9)),
    (lambda rng: fluxpy.DepthwiseConv((3, 3, 3), 4, 4, fluxpy.relu, stride=2, rng=rng), (2, 4, 7, 7, 7)),
])
def test_layers_on_gpu_match_cpu(make, shape):
    cp = cupy_module()
    rng = np.random.default_rng(11)
    layer = make(rng)
    model = fluxpy.Chain(layer, fluxpy.GlobalMeanPool())
    x = rng.standard_normal(shape).astype(np.float32)
    gmodel = fluxpy.gpu(model)
    np.testing.assert_allclose(gmodel(cp.asarray(x)).get(), model(x), rtol=1e-4, atol=1e-5)
    g_ref, = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), model)
    g, = fluxpy.gradient(lambda m: (m(cp.asarray(x)) ** 2).sum(), gmodel)
    for a, b in zip(fluxpy.trainables(g), fluxpy.trainables(g_ref)):
        np.testing.assert_allclose(a.get(), b, rtol=1e-3, atol=1e-4)
