"""Channels-last memory (fluxpy.layout) against C order on the GPU: the same values forward and backward, and the
layout kept by every op of a conv net (convolutions, batch norm, pools, elementwise ops, the tape's sums, the
reductions, the optimiser), so a net runs in NHWC memory with no conversions. Needs a GPU (``gpu`` marker).

Inputs are random normals (rounded to the dtype first); both layouts see the same numbers. cuDNN may pick other
engines for NHWC, which sum in another order: the bounds are a few units of the dtype's rounding times the
reduction length, as in ``test_half_conv_matmul_gpu``.
"""
import numpy as np
import pytest

import fluxpy
from devices import cupy_module, grad_leaves
from fluxpy.kernels.reduce import mapreduce
from fluxpy.layout import is_channels_last, to_channels_last
from fluxpy.ops.batchnorm import batchnorm
from fluxpy.ops.conv import conv, conv_bias_act
from fluxpy.ops.pool import maxpool, meanpool
from test_half_conv_matmul import BF16
from sweeps import case_id, sweep

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("isolated_cudnn_cache")]

DTYPES = [np.float32, np.float16, BF16]
EPS = {np.dtype(np.float32): 2e-6, np.dtype(np.float16): 2e-3, BF16: 1.6e-2}


def _draw(rng, shape, dtype, scale=1.0):
    cp = cupy_module()
    return cp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _f64(a):
    cp = cupy_module()
    return cp.asnumpy(cp.asarray(fluxpy.value_of(a)).astype(cp.float32)).astype(np.float64)


def _close(got, ref, dtype, length, what):
    """``got`` within ``8 u sqrt(length)`` of ``ref`` relative to ``ref``'s scale (u: the dtype's rounding)."""
    g, r = _f64(got), _f64(ref)
    bound = 8 * EPS[np.dtype(dtype)] * np.sqrt(length) * (np.abs(r).max() + 1e-30)
    err = np.abs(g - r).max()
    assert err <= bound, f"{what}: max error {err:.3g} above {bound:.3g}"


CONV_CASES = [
    dict(x=(4, 16, 12, 12), w=(32, 16, 3, 3), stride=1, pad=1),
    dict(x=(2, 24, 9, 9), w=(8, 24, 1, 1), stride=2, pad=0),
    dict(x=(3, 8, 10, 11), w=(16, 8, 3, 3), stride=2, pad=(0, 1, 1, 2)),     # asymmetric: padded first
    dict(x=(2, 3, 16, 16), w=(16, 3, 3, 3), stride=1, pad=1),                # an image: few channels
]


@pytest.mark.parametrize("dtype, case, which", sweep(DTYPES, CONV_CASES, ["x", "w"]),
                         ids=lambda c: f"x{c['x']}w{c['w']}s{c['stride']}" if isinstance(c, dict) else case_id(c))
def test_convolution_in_channels_last_matches_c_order_and_keeps_the_layout(dtype, case, which):
    """Either operand channels-last puts the convolution in NHWC memory: y, dx and dw come back channels-last,
    with C order's values."""
    rng = np.random.default_rng(1)
    x, w = _draw(rng, case["x"], dtype), _draw(rng, case["w"], dtype, 0.3)
    b = _draw(rng, (case["w"][0],), dtype)
    opts = dict(stride=case["stride"], pad=case["pad"])
    xl = to_channels_last(x) if which == "x" else x
    wl = to_channels_last(w) if which == "w" else w
    if not (is_channels_last(xl) or is_channels_last(wl)):
        pytest.skip("this operand has one layout only (1x1 weights)")

    def loss(x, w, b, dy):
        return (conv_bias_act(x, w, b, fluxpy.relu, **opts) * dy).sum()

    y = conv_bias_act(xl, wl, b, fluxpy.relu, **opts)
    ref = conv_bias_act(x, w, b, fluxpy.relu, **opts)
    assert is_channels_last(y) and not is_channels_last(ref)
    length = case["w"][1] * case["w"][2] * case["w"][3]
    _close(y, ref, dtype, length, "forward")
    dy = _draw(rng, ref.shape, dtype)
    got = fluxpy.gradient(loss, xl, wl, b, to_channels_last(dy))[:3]
    want = fluxpy.gradient(loss, x, w, b, dy)[:3]
    n_out = ref.size // ref.shape[1]
    for name, g, r, n in zip(("dx", "dw", "db"), got, want, (case["w"][0] * 9, n_out, n_out)):
        _close(g, r, dtype, n, name)
    assert is_channels_last(got[0]) or got[0].shape[1] == 1, "dx keeps the layout"
    assert is_channels_last(got[1]) or got[1].shape[2:] == (1, 1), "dw is channels-last like the conv"
    y2 = conv(xl, wl, **opts)
    assert is_channels_last(y2)
    _close(y2, conv(x, w, **opts), dtype, length, "conv without bias")


@pytest.mark.parametrize("dtype, shape, act", sweep(
    DTYPES, [(8, 16, 10, 10), (4, 40, 7, 5), (2, 3, 33, 9), (64, 70, 2, 2), (5, 8, 6), (6, 24, 5, 5),
            (3, 520, 3, 3), (2, 7, 4, 4), (128, 16, 16, 16)], [None, fluxpy.relu]),
    ids=lambda v: "relu" if v is fluxpy.relu else "identity" if v is None else case_id(v))
def test_batchnorm_in_channels_last_matches_c_order(dtype, shape, act):
    """fluxpy's column kernels: statistics, running statistics, y, dx, dgamma, dbeta as in C order, y and dx
    channels-last (channel counts not a whole number of vectors, under, at and over a chunk of 32 vectors, many
    row splits; a 3-d input)."""
    cp = cupy_module()
    rng = np.random.default_rng(2)
    c = shape[1]
    x = _draw(rng, shape, dtype, 2.0) + 0.5
    dy = _draw(rng, shape, dtype)
    g, b = cp.asarray(rng.standard_normal(c), cp.float32), cp.asarray(rng.standard_normal(c), cp.float32)
    runs = [[cp.asarray(rng.standard_normal(c), cp.float32), cp.asarray(rng.random(c) + 0.5, cp.float32)]
            for _ in range(2)]
    runs[1] = [a.copy() for a in runs[0]]

    def loss(x, g, b, dy, run):
        return (batchnorm(x, g, b, *run, momentum=0.1, eps=1e-5, act=act) * dy).sum()

    got = fluxpy.gradient(lambda x, g, b: loss(x, g, b, to_channels_last(dy), runs[0]), to_channels_last(x), g, b)
    want = fluxpy.gradient(lambda x, g, b: loss(x, g, b, dy, runs[1]), x, g, b)
    m = x.size // c
    for name, gv, wv in zip(("dx", "dgamma", "dbeta"), got, want):
        _close(gv, wv, dtype, m, name)
    assert is_channels_last(got[0])
    for a, r in zip(runs[0], runs[1]):
        _close(a, r, np.float32, m, "running statistics")
    y = batchnorm(to_channels_last(x), g, b, None, None, momentum=0.1, eps=1e-5, act=act)
    assert is_channels_last(y)
    _close(y, batchnorm(x, g, b, None, None, momentum=0.1, eps=1e-5, act=act), dtype, m, "y")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pool, opts", [(maxpool, dict(kernel=3, stride=2, pad=1)), (maxpool, dict(kernel=2)),
                                        (meanpool, dict(kernel=2)), (meanpool, dict(kernel=3, stride=1, pad=1))],
                         ids=["max3s2", "max2", "mean2", "mean3s1"])
def test_pools_in_channels_last_match_c_order(dtype, pool, opts):
    rng = np.random.default_rng(3)
    x = _draw(rng, (3, 20, 9, 8), dtype)
    x[:, :, 0, :2] = x[:, :, 0, 2:4]          # ties: the first maximum gets the gradient in both layouts
    y = pool(to_channels_last(x), **opts)
    ref = pool(x, **opts)
    assert is_channels_last(y)
    _close(y, ref, dtype, 9, "forward")
    dy = _draw(rng, ref.shape, dtype)
    got = fluxpy.gradient(lambda x: (pool(x, **opts) * to_channels_last(dy)).sum(), to_channels_last(x))[0]
    want = fluxpy.gradient(lambda x: (pool(x, **opts) * dy).sum(), x)[0]
    assert is_channels_last(got)
    _close(got, want, dtype, 9, "backward")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_elementwise_ops_the_tape_and_reductions_keep_channels_last(dtype):
    cp = cupy_module()
    rng = np.random.default_rng(4)
    x, z = _draw(rng, (4, 12, 5, 6), dtype), _draw(rng, (4, 12, 5, 6), dtype)
    xl, zl = to_channels_last(x), to_channels_last(z)
    bias = _draw(rng, (12, 1, 1), dtype)
    ops = fluxpy.ops   # fluxpy's ops keep the layout; CuPy's own operators on plain arrays write C order
    for name, f in [("relu(x + z)", lambda a, b: fluxpy.relu(ops.add(a, b))),
                    ("x * bias - z", lambda a, b: ops.subtract(ops.multiply(a, bias), b)),
                    ("tanh", lambda a, b: ops.multiply(fluxpy.tanh(a), b)),
                    ("where", lambda a, b: fluxpy.where(a > 0, a, b))]:
        y = f(xl, zl)
        assert is_channels_last(y), name
        _close(y, f(x, z), dtype, 1, name)
    # x used twice: the tape adds its two cotangents, in x's layout
    got = fluxpy.gradient(lambda a: (fluxpy.relu(a) * a + a).sum(), xl)[0]
    want = fluxpy.gradient(lambda a: (fluxpy.relu(a) * a + a).sum(), x)[0]
    assert is_channels_last(got)
    _close(got, want, dtype, 1, "gradient of x used twice")
    for axes in [(0, 2, 3), (2, 3), (1,), (0, 1, 2, 3), (0, 3)]:
        got = mapreduce(xl, axes)
        _close(got, mapreduce(x, axes), dtype, x.size, f"sum over {axes}")
    dz = cp.empty_like(xl)
    db = mapreduce(xl, (0, 2, 3), map="x * (y > 0)", y=zl, out_mapped=dz)
    _close(db, mapreduce(x, (0, 2, 3), map="x * (y > 0)", y=z), dtype, x.size, "masked sum")
    _close(dz, x * (z > 0), dtype, 1, "out_mapped")
    with pytest.raises(ValueError, match="channels-last"):
        mapreduce(xl, (0, 2, 3), map="x * (y > 0)", y=zl, out_mapped=cp.empty(x.shape, x.dtype))


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
def test_a_resnet_step_in_channels_last_is_as_accurate_as_c_order_with_every_activation_channels_last(dtype):
    """ResNet-20 moved with ``gpu(model, memory="channels_last")`` (mixed precision for bfloat16) against the same
    step in C order, both measured against float64 on the CPU: the loss, every gradient (relative error no more
    than twice C order's, or within the dtype's floor) and one Adam step; every 4-d activation a batch norm sees
    and every conv gradient is channels-last (nothing converted back to C order on the way)."""
    import copy
    from fluxpy.layers import BatchNorm
    cp = cupy_module()
    model = fluxpy.models.resnet20(rng=0)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 3, 32, 32)).astype(np.float32)
    y = fluxpy.onehotbatch(rng.integers(0, 10, 16), range(10))
    ref_loss, (ref,) = fluxpy.withgradient(lambda m: fluxpy.logitcrossentropy(m(x.astype(np.float64)), y),
                                           fluxpy.f64(copy.deepcopy(model)))
    ref = grad_leaves(ref)
    sides = {}
    for memory in ("contiguous", "channels_last"):
        m = fluxpy.gpu(copy.deepcopy(model), memory=memory)
        if dtype != np.float32:
            m = fluxpy.mixed_precision(m, dtype, memory=memory)
        seen = []
        original = BatchNorm.__call__

        def spy(self, v, _orig=original, _seen=seen):
            _seen.append(fluxpy.value_of(v))
            return _orig(self, v)
        BatchNorm.__call__ = spy
        try:
            gx, gy = fluxpy.gpu(x), fluxpy.gpu(y)
            loss, (grads,) = fluxpy.withgradient(lambda m: fluxpy.logitcrossentropy(m(gx), gy), m)
        finally:
            BatchNorm.__call__ = original
        state = fluxpy.setup(fluxpy.Adam(1e-3), m)
        fluxpy.update(state, m, grads)
        sides[memory] = (float(loss), grad_leaves(grads), fluxpy.trainables(m), seen)
    loss_c, grads_c, params_c, _ = sides["contiguous"]
    loss_l, grads_l, params_l, seen = sides["channels_last"]
    floor = 1e-4 if dtype == np.float32 else 3e-2
    assert abs(loss_l - float(ref_loss)) <= max(2 * abs(loss_c - float(ref_loss)), floor * float(ref_loss))
    assert seen and all(is_channels_last(v) for v in seen if v.ndim == 4 and v.shape[1] > 1 and v.shape[2] > 1)
    assert len(grads_l) == len(grads_c) == len(ref)
    for k, (gl, gc, r) in enumerate(zip(grads_l, grads_c, ref)):
        norm = np.linalg.norm(r) + 1e-30
        err_l, err_c = (np.linalg.norm(_f64(g) - r) / norm for g in (gl, gc))
        assert err_l <= max(2 * err_c, floor), f"gradient {k} {r.shape}: {err_l:.3g} against C order's {err_c:.3g}"
        if r.ndim == 4 and r.shape[2] > 1:
            assert is_channels_last(gl), f"the gradient of conv weight {k} is channels-last"
    for k, (pl, pc) in enumerate(zip(params_l, params_c)):
        assert float(cp.abs(pl - pc).max()) <= 2.5e-3, k     # Adam's steps are at most about lr = 1e-3
        if pc.ndim == 4 and pc.shape[2] > 1:
            assert is_channels_last(pl), f"conv weight {k} stays channels-last through the optimiser"


def test_multi_tensor_adam_on_channels_last_parameters_matches_c_order():
    cp = cupy_module()
    from fluxpy.kernels.cuda_optimise import optimiser_advance, optimiser_step_many, optimiser_step_many_supports
    from fluxpy.optimise import Adam
    from fluxpy.optimise.rules import formula_of
    rule = Adam(1e-2)
    f, hyper = formula_of(rule), rule.hyper()
    rng = np.random.default_rng(6)
    xs = [_draw(rng, s, np.float32) for s in [(8, 4, 3, 3), (16, 8, 1, 1), (5,), (6, 3, 3, 3)]]
    dxs = [_draw(rng, a.shape, np.float32) for a in xs]
    lx = [to_channels_last(a) if a.ndim == 4 else a.copy() for a in xs]
    # one gradient in the other layout: copied into its parameter's layout first
    ldx = [to_channels_last(d) if k != 3 and d.ndim == 4 else d.copy() for k, d in enumerate(dxs)]
    ms, vs = [cp.zeros_like(a) for a in xs], [cp.zeros_like(a) for a in xs]
    lms, lvs = [cp.zeros_like(a) for a in lx], [cp.zeros_like(a) for a in lx]
    states, lstates, none = [list(p) for p in zip(ms, vs)], [list(p) for p in zip(lms, lvs)], [[]] * len(xs)
    assert optimiser_step_many_supports(lx[0], f, lx, ldx, lstates, none)
    assert not optimiser_step_many_supports(lx[0], f, lx, ldx, [list(p) for p in zip(ms, lvs)], none), \
        "state laid out unlike its parameter"
    counters, lcounters = cp.array([0.9, 0.999]), cp.array([0.9, 0.999])
    for _ in range(3):
        optimiser_step_many(xs[0], f, xs, dxs, states, none, hyper, counters)
        optimiser_step_many(lx[0], f, lx, ldx, lstates, none, hyper, lcounters)
        optimiser_advance(counters, f, hyper)
        optimiser_advance(lcounters, f, hyper)
    for a, b in zip(lx, xs):
        assert bool(cp.isfinite(a).all()) and cp.array_equal(a, b)
    assert is_channels_last(lx[0]) and is_channels_last(lms[0])


def test_gpu_memory_argument_moves_weights_and_checks_its_value():
    model = fluxpy.Chain(fluxpy.Conv((3, 3), 4, 8), fluxpy.Dense(2, 3))
    moved = fluxpy.gpu(model, memory="channels_last")
    assert is_channels_last(moved[0].weight) and moved[1].weight.flags.c_contiguous
    back = fluxpy.gpu(moved, memory="contiguous")
    assert back[0].weight.flags.c_contiguous
    assert bool((back[0].weight == moved[0].weight).all())
    with pytest.raises(ValueError, match="memory must be one of"):
        fluxpy.gpu(model, memory="nhwc")


def test_mixed_precision_runs_a_c_order_model_in_channels_last_by_default():
    """The half copies of the conv weights and of the batch are channels-last (the float32 masters and their
    gradients keep C order); ``memory="contiguous"`` keeps C order throughout."""
    from fluxpy.layers import BatchNorm
    model = fluxpy.gpu(fluxpy.Chain(fluxpy.Conv((3, 3), 3, 8, pad=1), fluxpy.BatchNorm(8, fluxpy.relu),
                                    fluxpy.Conv((3, 3), 8, 4, pad=1), fluxpy.GlobalMeanPool(), fluxpy.flatten))
    x = fluxpy.gpu(np.random.default_rng(7).standard_normal((4, 3, 8, 8)).astype(np.float32))
    for memory in ("channels_last", "contiguous"):
        m = fluxpy.mixed_precision(model, BF16, memory=memory)
        seen = []
        original = BatchNorm.__call__
        BatchNorm.__call__ = lambda self, v, _o=original: seen.append(fluxpy.value_of(v)) or _o(self, v)
        try:
            (g,) = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), m)
        finally:
            BatchNorm.__call__ = original
        assert is_channels_last(seen[0]) == (memory == "channels_last"), memory
        dw = g["model"]["layers"][0]["weight"]
        assert dw.dtype == np.float32 and dw.flags.c_contiguous, "the master's gradient in the master's layout"
    assert "memory='contiguous'" in repr(fluxpy.mixed_precision(model, BF16, memory="contiguous"))
    with pytest.raises(ValueError, match="memory must be one of"):
        fluxpy.mixed_precision(model, BF16, memory="nhwc")


def test_the_finite_check_reads_channels_last_arrays_in_place():
    cp = cupy_module()
    from fluxpy.kernels.cuda_optimise import finite_total
    rng = np.random.default_rng(8)
    arrays = [to_channels_last(_draw(rng, (3, 5, 4, 4), dt)) for dt in (np.float32, BF16)]
    assert all(is_channels_last(a) for a in arrays)
    assert float(finite_total(arrays[0], arrays)) == 0.0
    arrays[1][2, 4, 3, 1] = cp.inf
    assert np.isnan(float(finite_total(arrays[0], arrays)))


def test_a_shape_error_on_channels_last_operands_names_the_shapes_as_given():
    rng = np.random.default_rng(9)
    x = to_channels_last(_draw(rng, (2, 3, 4, 5), np.float32))
    with pytest.raises(ValueError, match=r"add: shapes \(2, 3, 4, 5\) and \(7,\) cannot be broadcast"):
        fluxpy.ops.add(x, _draw(rng, (7,), np.float32))


@pytest.mark.parametrize("shape", [(8, 1, 6, 5), (8, 4, 1, 1), (2, 1, 3, 4, 5)])
def test_one_channel_or_one_pixel_goes_channels_last_without_a_copy(shape):
    """C order with one channel (an image's grey level) or one pixel is channels-last memory already: moved to
    channels-last it is a view of the same memory, and a convolution of it gives C order's values."""
    cp = cupy_module()
    from fluxpy.layout import channels_last_strides
    a = cp.asarray(np.random.default_rng(0).standard_normal(shape), np.float32)
    b = to_channels_last(a)
    assert b.data.ptr == a.data.ptr and b.shape == a.shape
    assert all(s == w or n == 1 for s, w, n in zip(b.strides, channels_last_strides(shape, 4), shape))
    cp.testing.assert_array_equal(b, a)
    x = cp.asarray(np.random.default_rng(1).standard_normal((8, 1, 12, 12)), np.float32)
    conv = fluxpy.gpu(fluxpy.Conv((3, 3), 1, 4, pad=1, rng=0))
    want = fluxpy.gpu(fluxpy.Conv((3, 3), 1, 4, pad=1, rng=0))(to_channels_last(x).copy())
    cp.testing.assert_allclose(conv(to_channels_last(x)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"], ids=str)
def test_a_one_channel_image_with_channels_last_weights_gives_a_channels_last_output(dtype):
    """A one-channel image and a one-channel kernel are both layouts; moved to channels-last (what
    ``mixed_precision`` does), the convolution computes in channels-last memory, so the next layers get channels-last
    data (no copy of the next convolution's input a step), with the values of C order."""
    cp = cupy_module()
    from fluxpy.layout import to_memory_format
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(8)
    x = cp.asarray(rng.standard_normal((8, 1, 14, 14)).astype(dt))
    w = cp.asarray(rng.standard_normal((6, 1, 3, 3)).astype(dt))
    y = conv(to_channels_last(x), to_memory_format(w, "channels_last"), pad=1)
    assert is_channels_last(y)
    cp.testing.assert_allclose(y.astype(np.float32), conv(x, w, pad=1).astype(np.float32), rtol=2e-2, atol=2e-2)
    first = []

    def record(x):   # a plain function: the model's half copy keeps it
        first.append(fluxpy.value_of(x))
        return x
    model = fluxpy.gpu(fluxpy.Chain(fluxpy.Conv((3, 3), 1, 8, fluxpy.relu, pad=1, rng=0), record,
                                    fluxpy.MaxPool((2, 2)), fluxpy.Conv((3, 3), 8, 8, pad=1, rng=1)))
    fluxpy.mixed_precision(model, BF16)(cp.asarray(rng.standard_normal((8, 1, 14, 14)), np.float32))
    assert len(first) == 1 and first[0].dtype == BF16 and is_channels_last(first[0])
