"""conv, conv_bias_act, conv_transpose and the pools on CuPy (cuDNN and RawKernels) against the CPU path.

Forward results and every gradient (x, w, b) over an option grid (stride, pad including "same" and
asymmetric, dilation, groups, flipped), float64 tight and float32 loose, against the NumPy path
in float64; gradients against float64 finite differences on the GPU; the channel check that runs
before cuDNN. Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import itertools

import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy.ops import activations as A
from fluxpy.ops.conv import conv, conv_bias_act, conv_transpose
from fluxpy.ops.pool import adaptive_maxpool, global_maxpool, maxpool, meanpool
from sweeps import grid

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("isolated_cudnn_cache")]


def _rel(got, ref):
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.all(np.isfinite(got)), "non-finite values"
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300)


TOL = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 5e-3}


def compare(f, args, dtype, seed=0, tol=None):
    """f and the gradient of <f, ct> in every float argument: NumPy float64 versus CuPy ``dtype``."""
    cp = cupy_module()
    tol = TOL[dtype] if tol is None else tol
    rng = np.random.default_rng(seed)
    args64 = [a.astype(np.float64) if isinstance(a, np.ndarray) else a for a in args]
    y_ref, back_ref = fluxpy.pullback(f, *args64)
    ct = rng.standard_normal(y_ref.shape)
    g_ref = back_ref(ct)
    gargs = [cp.asarray(a.astype(dtype)) if isinstance(a, np.ndarray) else a for a in args]
    y, back = fluxpy.pullback(f, *gargs)
    assert isinstance(y, cp.ndarray) and y.dtype == dtype
    assert _rel(y.get(), y_ref) < tol, ("forward", _rel(y.get(), y_ref))
    g = back(cp.asarray(ct.astype(dtype)))
    for i, (a, b) in enumerate(zip(g, g_ref)):
        if b is None:
            assert a is None
            continue
        assert isinstance(a, cp.ndarray), (i, type(a))
        err = _rel(a.get(), b)
        assert err < tol * 10, ("gradient", i, err)


PADS = [0, 1, "same", (1, 0, 2, 1)]
GRID = list(itertools.product([1, 2], PADS, [1, 2], [1, 2], [False, True]))   # each pair of options by default


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_conv_bias_act_relu_grid(dtype):
    rng = np.random.default_rng(1)
    failures = []
    for stride, pad, dilation, groups, flipped in grid(GRID):
        x = rng.standard_normal((2, 4, 9, 8))
        w = rng.standard_normal((6, 4 // groups, 3, 3))
        b = rng.standard_normal(6)
        opts = dict(stride=stride, pad=pad, dilation=dilation, groups=groups, flipped=flipped)
        try:
            compare(lambda x, w, b: conv_bias_act(x, w, b, A.relu, **opts), [x, w, b], dtype)
        except AssertionError as err:
            failures.append((opts, str(err)[:200]))
    assert not failures, failures


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_conv_and_identity_bias_grid(dtype):
    rng = np.random.default_rng(2)
    failures = []
    for stride, pad, dilation, groups, flipped in grid(GRID[::3]):
        x = rng.standard_normal((2, 4, 7, 9))
        w = rng.standard_normal((4, 4 // groups, 2, 3))
        b = rng.standard_normal(4)
        opts = dict(stride=stride, pad=pad, dilation=dilation, groups=groups, flipped=flipped)
        try:
            compare(lambda x, w: conv(x, w, **opts), [x, w], dtype)
            compare(lambda x, w, b: conv_bias_act(x, w, b, None, **opts), [x, w, b], dtype)
        except AssertionError as err:
            failures.append((opts, str(err)[:200]))
    assert not failures, failures


def test_other_activation_composes():
    rng = np.random.default_rng(3)
    x, w, b = rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
    compare(lambda x, w, b: conv_bias_act(x, w, b, A.tanh, pad=1), [x, w, b], np.float64)
    compare(lambda x, w: conv_bias_act(x, w, None, A.relu, stride=2), [x, w], np.float32)


def test_float16_forward_and_gradients():
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((2, 8, 8, 8)), rng.standard_normal((8, 8, 3, 3)) * 0.2, rng.standard_normal(8)
    compare(lambda x, w, b: conv_bias_act(x, w, b, A.relu, pad=1), [x, w, b], np.float16, tol=5e-3)


@pytest.mark.parametrize("opts", [dict(stride=2), dict(stride=2, pad=1, output_padding=1),
                                  dict(stride=1, pad=1, dilation=2), dict(stride=2, pad="same", groups=2),
                                  dict(stride=2, pad=(1, 0, 0, 1), flipped=True)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_conv_transpose(opts, dtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 5, 6))
    w = rng.standard_normal((4, 3 if opts.get("groups", 1) == 1 else 2, 3, 3))
    compare(lambda x, w: conv_transpose(x, w, **opts), [x, w], dtype)


POOLS = [
    (lambda x: maxpool(x, 2), "max 2"),
    (lambda x: maxpool(x, 3, stride=1, pad=1), "max 3 s1 p1"),
    (lambda x: maxpool(x, (2, 3), stride=(1, 2), pad=(1, 0, 0, 2)), "max asym"),
    (lambda x: global_maxpool(x), "global max"),
    (lambda x: adaptive_maxpool(x, (3, 2)), "adaptive max"),
    (lambda x: meanpool(x, 2), "mean 2"),
    (lambda x: meanpool(x, 3, stride=2, pad=1), "mean 3 s2 p1"),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("ties", [False, True])
def test_pools_match_cpu(dtype, ties):
    """Forward and gradient, including ties (small integers), where the gradient goes to the first max."""
    cp = cupy_module()
    rng = np.random.default_rng(6)
    x = rng.integers(0, 3, (2, 3, 7, 8)).astype(dtype) if ties else rng.standard_normal((2, 3, 7, 8)).astype(dtype)
    for f, name in POOLS:
        y_ref, back_ref = fluxpy.pullback(f, x)
        ct = rng.standard_normal(y_ref.shape).astype(dtype)
        (g_ref,) = back_ref(ct)
        y, back = fluxpy.pullback(f, cp.asarray(x))
        (g,) = back(cp.asarray(ct))
        assert y.dtype == y_ref.dtype and g.dtype == g_ref.dtype, (name, y.dtype, y_ref.dtype, g.dtype, g_ref.dtype)
        rtol = 2e-3 if dtype == np.float16 else 1e-6
        np.testing.assert_allclose(y.get(), y_ref, rtol=rtol, atol=rtol, err_msg=name)
        np.testing.assert_allclose(g.get(), g_ref, rtol=rtol, atol=rtol, err_msg=name)


def test_maxpool_second_order_on_gpu():
    cp = cupy_module()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 2, 6, 6))
    v = rng.standard_normal(x.shape)

    def hvp(x, xp):
        g, = fluxpy.gradient(lambda z: (maxpool(z, 2) ** 2).sum(), x)
        return g

    def outer(x, xp, v):
        return fluxpy.gradient(lambda z: (hvp(z, xp) * v).sum(), x)[0]
    ref = outer(x, np, v)
    got = outer(cp.asarray(x), cp, cp.asarray(v))
    np.testing.assert_allclose(got.get(), ref, rtol=1e-12, atol=1e-12)


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
    x = cp.asarray(rng.standard_normal((2, 4, 8, 7)))
    w = cp.asarray(rng.standard_normal((6, 2, 3, 3)))
    b = cp.asarray(rng.standard_normal(6))
    _fd_check(lambda x, w, b: conv_bias_act(x, w, b, A.relu, stride=2, pad="same", groups=2, flipped=True), [x, w, b])
    _fd_check(lambda x, w: conv(x, w, pad=(0, 2, 1, 0), dilation=2), [x, cp.asarray(rng.standard_normal((3, 4, 3, 3)))])
    _fd_check(lambda x, w: conv_transpose(x, w, stride=2, pad=1), [x, cp.asarray(rng.standard_normal((4, 3, 3, 3)))])


def test_second_derivative_of_conv_on_gpu():
    """Double backward through conv_backward_data/filter on cuDNN agrees with the CPU."""
    cp = cupy_module()
    rng = np.random.default_rng(10)
    x, w = rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((4, 3, 3, 3))
    v = rng.standard_normal(x.shape)

    def outer(x, w, v):
        def inner(x):
            return fluxpy.gradient(lambda z: (conv_bias_act(z, w, None, A.relu, pad=1) ** 2).sum(), x)[0]
        return fluxpy.gradient(lambda z: (inner(z) * v).sum(), x)[0]
    ref = outer(x, w, v)
    got = outer(cp.asarray(x), cp.asarray(w), cp.asarray(v))
    np.testing.assert_allclose(got.get(), ref, rtol=1e-10, atol=1e-10)


def test_wrong_channels_fail_before_cudnn():
    """A wrong channel count raises before any cuDNN kernel of the table is called (spies in the table)."""
    cp = cupy_module()
    from fluxpy import kernels
    from fluxpy.kernels import cuda_conv
    calls = []
    snap = kernels.snapshot()
    try:
        for name, real in cuda_conv.KERNELS.items():
            kernels.register(name, "cupy", lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
        x = cp.ones((2, 3, 8, 8), cp.float32)
        with pytest.raises(ValueError, match=r"conv expects x.shape\[1\] == w.shape\[1\] \* groups == 4"):
            conv(x, cp.ones((4, 4, 3, 3), cp.float32))
        with pytest.raises(ValueError, match=r"x.shape\[1\]"):
            conv_bias_act(x, cp.ones((4, 4, 3, 3), cp.float32), cp.zeros(4, cp.float32), A.relu)
        layer = fluxpy.gpu(fluxpy.Conv((3, 3), 4, 8, fluxpy.relu))
        with pytest.raises(Exception, match=r"x.shape\[1\] == 4"):
            layer(x)
        assert calls == [], calls
        conv(x, cp.ones((4, 3, 3, 3), cp.float32))   # the spies do see a valid call
        assert calls == ["conv_forward"], calls
    finally:
        kernels.restore(snap)


def test_conv_layer_on_gpu_matches_cpu():
    cp = cupy_module()
    rng = np.random.default_rng(11)
    model = fluxpy.Chain(fluxpy.Conv((3, 3), 1, 16, fluxpy.relu, pad=1, rng=rng), fluxpy.MaxPool((2, 2)),
                         fluxpy.Conv((3, 3), 16, 8, fluxpy.relu, pad=1, rng=rng), fluxpy.MeanPool((2, 2)))
    x = rng.standard_normal((4, 1, 12, 12)).astype(np.float32)
    gmodel = fluxpy.gpu(model)
    y_ref = model(x)
    y = gmodel(cp.asarray(x))
    np.testing.assert_allclose(y.get(), y_ref, rtol=1e-4, atol=1e-5)
    g_ref, = fluxpy.gradient(lambda m: m(x).sum(), model)
    g, = fluxpy.gradient(lambda m: m(cp.asarray(x)).sum(), gmodel)
    ga, gb = fluxpy.trainables(g), fluxpy.trainables(g_ref)
    assert len(ga) == len(gb) == 4
    for a, b in zip(ga, gb):
        np.testing.assert_allclose(a.get(), b, rtol=1e-3, atol=1e-4)
