"""conv, conv_backward_data/filter, conv_transpose, conv_bias_act and ConvDims.

Forward results against a direct nested-loop reference; gradients (first and second order) against
float64 finite differences over hypothesis-drawn shapes and options; PyTorch in float64 where it
is installed (these tests skip without it).
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.ops.conv import conv, conv_backward_data, conv_backward_filter, conv_bias_act, conv_transpose
from fluxpy.ops.dims import ConvDims
from gradcheck import check_grad

from strategies import resolve_pad

seeds = st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------------------------------------
# A slow, obviously correct reference


def reference_conv(x, w, stride=(1, 1), pad=0, dilation=(1, 1), groups=1, flipped=False):
    n_, c_, h_, w_ = x.shape
    k_, cg, r_, s_ = w.shape
    (sh, sw), (dh, dw) = stride, dilation
    top, bottom, left, right = resolve_pad(pad, (h_, w_), (dh * (r_ - 1) + 1, dw * (s_ - 1) + 1), stride)
    xp = np.zeros((n_, c_, h_ + top + bottom, w_ + left + right))
    xp[:, :, top:top + h_, left:left + w_] = x
    p_ = (xp.shape[2] - dh * (r_ - 1) - 1) // sh + 1
    q_ = (xp.shape[3] - dw * (s_ - 1) - 1) // sw + 1
    kg = k_ // groups
    y = np.zeros((n_, k_, p_, q_))
    for n in range(n_):
        for k in range(k_):
            g = k // kg
            for p in range(p_):
                for q in range(q_):
                    acc = 0.0
                    for c in range(cg):
                        for r in range(r_):
                            for s in range(s_):
                                wr, ws = (r, s) if flipped else (r_ - 1 - r, s_ - 1 - s)
                                acc += w[k, c, wr, ws] * xp[n, g * cg + c, p * sh + r * dh, q * sw + s * dw]
                    y[n, k, p, q] = acc
    return y


# ---------------------------------------------------------------------------------------------
# Drawing problems


@st.composite
def pads(draw):
    kind = draw(st.sampled_from(["int", "pair", "four", "same"]))
    small = st.integers(0, 2)
    if kind == "int":
        return draw(small)
    if kind == "pair":
        return (draw(small), draw(small))
    if kind == "four":
        return tuple(draw(small) for _ in range(4))
    return "same"


@st.composite
def conv_problems(draw, max_batch=2):
    """(x shape, w shape, options) for a valid conv, small enough for the loop reference."""
    groups = draw(st.integers(1, 2))
    cg, kg = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    r, s = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    dilated = (dilation[0] * (r - 1) + 1, dilation[1] * (s - 1) + 1)
    h, w = draw(st.integers(dilated[0], dilated[0] + 4)), draw(st.integers(dilated[1], dilated[1] + 4))
    opts = dict(stride=stride, pad=draw(pads()), dilation=dilation, groups=groups, flipped=draw(st.booleans()))
    return (draw(st.integers(1, max_batch)), cg * groups, h, w), (kg * groups, cg, r, s), opts


def randn(rng, shape):
    return rng.standard_normal(shape)


# ---------------------------------------------------------------------------------------------
# Forward


@given(problem=conv_problems(), seed=seeds)
def test_conv_matches_loop_reference(problem, seed):
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    x, w = randn(rng, xs), randn(rng, ws)
    y = conv(x, w, **opts)
    np.testing.assert_allclose(y, reference_conv(x, w, **opts), rtol=1e-10, atol=1e-10)
    assert y.shape == ConvDims.from_arrays(x, w, **opts).y_shape


@given(problem=conv_problems(), seed=seeds)
def test_both_column_grids_agree(problem, seed):
    """The CPU kernels' padded-width column grid (stride 1) gives what the plain grid gives."""
    from fluxpy.kernels import cpu
    xs, ws, opts = problem
    opts = dict(opts, stride=(opts["stride"][0], 1))
    rng = np.random.default_rng(seed)
    x, w = randn(rng, xs), randn(rng, ws)
    cd = ConvDims.from_arrays(x, w, **opts)
    dy = randn(rng, cd.y_shape)

    def run():
        return (cpu.conv_forward(x, w, cd), cpu.conv_backward_data(dy, w, cd), cpu.conv_backward_filter(x, dy, cd))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "_grid_width", lambda cd: cd.padded_hw[1])
        padded = run()
        mp.setattr(cpu, "_grid_width", lambda cd: cd.out_hw[1])
        plain = run()
    for a, b in zip(padded, plain):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_conv_is_flipped_cross_correlation():
    rng = np.random.default_rng(0)
    x, w = randn(rng, (2, 3, 6, 5)), randn(rng, (4, 3, 3, 2))
    np.testing.assert_allclose(conv(x, w), conv(x, w[:, :, ::-1, ::-1].copy(), flipped=True), rtol=1e-12)


@pytest.mark.parametrize("size,stride,k", [(9, 2, 3), (10, 3, 4), (5, 1, 2), (7, 3, 1), (4, 2, 5)])
def test_same_pad_gives_ceil_size(size, stride, k):
    cd = ConvDims.from_shapes((1, 1, size, size + 1), (1, 1, k, k), stride=stride, pad="same")
    assert cd.out_hw == (math.ceil(size / stride), math.ceil((size + 1) / stride))
    top, bottom, left, right = cd.pad
    assert 0 <= bottom - top <= 1 and 0 <= right - left <= 1   # the odd pixel at the end, as TF


def test_float32_stays_float32():
    x, w = np.ones((2, 3, 5, 5), np.float32), np.ones((4, 3, 3, 3), np.float32)
    assert conv(x, w).dtype == np.float32
    g = fluxpy.gradient(lambda x, w: conv(x, w, pad=1).sum(), x, w)
    assert g[0].dtype == np.float32 and g[1].dtype == np.float32


def test_inputs_are_not_modified_and_noncontiguous_inputs_work():
    rng = np.random.default_rng(1)
    x = randn(rng, (3, 2, 7, 6)).transpose(0, 1, 3, 2)   # a non-contiguous view
    w = randn(rng, (4, 2, 3, 3))
    x0, w0 = x.copy(), w.copy()
    y = conv(x, w, pad=(1, 0, 2, 1), stride=2)
    np.testing.assert_allclose(y, reference_conv(x0, w0, stride=(2, 2), pad=(1, 0, 2, 1)), rtol=1e-10)
    assert np.array_equal(x, x0) and np.array_equal(w, w0)


# ---------------------------------------------------------------------------------------------
# Gradients


@given(problem=conv_problems(), seed=seeds)
def test_conv_gradient(problem, seed):
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    check_grad(lambda x, w: conv(x, w, **opts), randn(rng, xs), randn(rng, ws), rng=rng)


@given(problem=conv_problems(), seed=seeds)
def test_backward_kernels_are_adjoints(problem, seed):
    """<conv(x, w), dy> == <x, conv_backward_data(dy, w)> == <w, conv_backward_filter(x, dy)>."""
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    x, w = randn(rng, xs), randn(rng, ws)
    cd = ConvDims.from_arrays(x, w, **opts)
    dy = randn(rng, cd.y_shape)
    total = np.sum(conv(x, w, **opts) * dy)
    np.testing.assert_allclose(np.sum(x * conv_backward_data(dy, w, cd)), total, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.sum(w * conv_backward_filter(x, dy, cd)), total, rtol=1e-10, atol=1e-10)


@given(problem=conv_problems(), seed=seeds)
def test_backward_kernel_gradients(problem, seed):
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    x, w = randn(rng, xs), randn(rng, ws)
    cd = ConvDims.from_arrays(x, w, **opts)
    dy = randn(rng, cd.y_shape)
    check_grad(lambda dy, w: conv_backward_data(dy, w, cd), dy, w, rng=rng)
    check_grad(lambda x, dy: conv_backward_filter(x, dy, cd), x, dy, rng=rng)


@given(problem=conv_problems(max_batch=1), seed=seeds)
def test_conv_second_derivative(problem, seed):
    """check_grad through fluxpy.gradient of conv: the rules of both backward kernels, nested."""
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    x, w = randn(rng, xs), randn(rng, ws)
    c = randn(rng, ConvDims.from_arrays(x, w, **opts).y_shape)

    def gradient_of_conv(x, w):
        gx, gw = fluxpy.gradient(lambda x, w: (np.tanh(conv(x, w, **opts)) * c).sum(), x, w)
        return (gx * gx).sum() + (gw * gw).sum()
    check_grad(gradient_of_conv, x, w, rng=rng)


def test_second_derivative_of_backward_kernels():
    rng = np.random.default_rng(3)
    x, w = randn(rng, (2, 4, 6, 5)), randn(rng, (4, 2, 3, 2))
    cd = ConvDims.from_arrays(x, w, stride=(2, 1), pad=(1, 0, 0, 1), dilation=(1, 2), groups=2)
    dy = randn(rng, cd.y_shape)

    def through_data(dy, w):
        g = fluxpy.gradient(lambda dy, w: (conv_backward_data(dy, w, cd) ** 2).sum(), dy, w)
        return (g[0] * g[0]).sum() + (g[1] * g[1]).sum()

    def through_filter(x, dy):
        g = fluxpy.gradient(lambda x, dy: (conv_backward_filter(x, dy, cd) ** 2).sum(), x, dy)
        return (g[0] * g[0]).sum() + (g[1] * g[1]).sum()
    check_grad(through_data, dy, w, rng=rng)
    check_grad(through_filter, x, dy, rng=rng)


def test_only_needed_gradients_are_computed():
    from fluxpy import kernels
    from fluxpy.kernels import cpu
    calls, grads = [], []
    table = kernels.snapshot()
    try:
        for name in ("conv_backward_data", "conv_backward_filter"):
            fn = kernels.lookup(name, np.ones(1))
            kernels.register(name, "numpy", lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
        kernels.register("conv_bias_act_grads", "numpy",
                         lambda *a: grads.append(cpu.conv_bias_act_grads(*a)) or grads[-1],
                         cpu._conv_bias_act_grads_supports)
        x, w = np.ones((1, 1, 4, 4)), np.ones((1, 1, 2, 2))
        (fused,) = fluxpy.gradient(lambda w: conv(x, w).sum(), w)
        assert calls == [] and len(grads) == 1 and grads[0][0] is None and grads[0][2] is None   # the CPU's kernel
        kernels.register("conv_bias_act_grads", "numpy", cpu.conv_bias_act_grads, lambda *a: False)
        (composite,) = fluxpy.gradient(lambda w: conv(x, w).sum(), w)
    finally:
        kernels.restore(table)
    assert calls == ["conv_backward_filter"]   # the composite, where no kernel takes the call
    np.testing.assert_array_equal(fused, composite)
    np.testing.assert_array_equal(fused, np.full((1, 1, 2, 2), 9.0))


@given(conv_problems(), st.booleans(), st.sampled_from(["relu", "identity"]), st.booleans(), st.booleans(),
       st.booleans(), st.sampled_from([np.float32, np.float64]))
@settings(deadline=None, max_examples=80)
def test_the_cpu_kernel_of_all_three_gradients_equals_the_composite(problem, unit_stride, kind, need_x, need_w,
                                                                    need_b, dtype):
    from fluxpy.kernels import cpu
    from fluxpy.ops.conv import _conv_grads_composite, conv_dims
    xs, ws, opts = problem
    if unit_stride:   # the whole padded grid (the kernels' other layout)
        opts = dict(opts, stride=(1, 1))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype)
    cdims = conv_dims(x, w, **opts)
    y = rng.standard_normal(cdims.y_shape).astype(dtype)
    dy = rng.standard_normal(cdims.y_shape).astype(dtype)
    args = (dy, y if kind == "relu" else None, x, w, kind, cdims, need_x, need_w, need_b)
    assert cpu._conv_bias_act_grads_supports(*args)
    want = _conv_grads_composite(*args)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    rule = cpu._backward_grid
    layouts = [rule] + ([lambda cd: tuple(cd.padded_hw)] if unit_stride else [])   # the whole grid, whatever the rule
    try:
        for layout in layouts:
            cpu._backward_grid = layout
            got = cpu.conv_bias_act_grads(*args)
            for g, e, needed in zip(got, want, (need_x, need_w, need_b)):
                assert (g is None) == (e is None) == (not needed)
                if needed:
                    assert g.shape == e.shape and g.dtype == e.dtype == dtype
                    np.testing.assert_allclose(g, e, **tol)
    finally:
        cpu._backward_grid = rule


# ---------------------------------------------------------------------------------------------
# conv_transpose


@st.composite
def transpose_problems(draw):
    xs, ws, opts = draw(conv_problems())
    n, c, h, w = xs
    k, cg, r, s = ws
    if opts["pad"] == "same":
        out_pad = 0
    else:
        out_pad = (draw(st.integers(0, opts["stride"][0] - 1)), draw(st.integers(0, opts["stride"][1] - 1)))
    # conv_transpose takes the conv's output and the weight in the same (K, C/groups, R, S) layout.
    h_in, w_in = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return (n, k, h_in, w_in), ws, dict(opts, output_padding=out_pad)


def _transpose_output_ok(xs, ws, opts):
    try:
        conv_transpose(np.zeros(xs), np.zeros(ws), **opts)
    except ValueError as err:
        assert "positive output size" in str(err)
        return False
    return True


@given(problem=transpose_problems(), seed=seeds)
def test_conv_transpose_is_the_adjoint_of_conv(problem, seed):
    xs, ws, opts = problem
    if not _transpose_output_ok(xs, ws, opts):
        return
    rng = np.random.default_rng(seed)
    x, w = randn(rng, xs), randn(rng, ws)
    y = conv_transpose(x, w, **opts)
    conv_opts = {k: v for k, v in opts.items() if k != "output_padding"}
    z = randn(rng, y.shape)
    assert conv(z, w, **conv_opts).shape == x.shape   # conv maps the output back to the input's size
    np.testing.assert_allclose(np.sum(y * z), np.sum(x * conv(z, w, **conv_opts)), rtol=1e-10, atol=1e-10)
    check_grad(lambda x, w: conv_transpose(x, w, **opts), x, w, rng=rng)


def test_conv_transpose_same_multiplies_size_by_stride():
    y = conv_transpose(np.ones((1, 2, 5, 3)), np.ones((2, 3, 3, 3)), stride=(2, 3), pad="same")
    assert y.shape == (1, 3, 10, 9)


# ---------------------------------------------------------------------------------------------
# conv_bias_act


def test_conv_bias_act_matches_the_composition():
    pytest.importorskip("fluxpy.ops.bias_act")
    from fluxpy.ops.activations import relu, tanh
    rng = np.random.default_rng(4)
    x, w, b = randn(rng, (2, 4, 6, 6)), randn(rng, (6, 2, 3, 3)), randn(rng, 6)
    opts = dict(pad=1, stride=2, groups=2)
    expected = np.maximum(conv(x, w, **opts) + b.reshape(1, 6, 1, 1), 0)
    np.testing.assert_allclose(conv_bias_act(x, w, b, relu, **opts), expected, rtol=1e-12)
    np.testing.assert_allclose(conv_bias_act(x, w, None, **opts), conv(x, w, **opts), rtol=1e-12)
    np.testing.assert_allclose(conv_bias_act(x, w, False, tanh, **opts), np.tanh(conv(x, w, **opts)), rtol=1e-12)
    check_grad(lambda x, w, b: conv_bias_act(x, w, b, tanh, **opts), x, w, b, rng=rng)


@pytest.mark.parametrize("act_name", ["relu", "identity"])
@given(problem=conv_problems(), seed=seeds)
def test_fused_conv_bias_act_gradients(act_name, problem, seed):
    """The fused primitive (relu, identity): its pullback takes the activation's derivative from the output."""
    from fluxpy.ops import activations
    from gradcheck import check_second_order
    act = getattr(activations, act_name)
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    x, w, b = randn(rng, xs), randn(rng, ws), randn(rng, ws[0])
    z = conv(x, w, **opts) + b.reshape(1, -1, 1, 1)
    if act_name == "relu" and np.min(np.abs(z)) < 1e-3:
        return   # finite differences straddle relu's kink
    np.testing.assert_allclose(conv_bias_act(x, w, b, act, **opts), act(z), rtol=1e-12, atol=1e-12)
    check_grad(lambda x, w, b: conv_bias_act(x, w, b, act, **opts), x, w, b, rng=rng)
    check_second_order(lambda x, w, b: conv_bias_act(x, w, b, act, **opts), x, w, b, rng=rng, rtol=1e-5)


def test_conv_bias_act_checks_the_bias():
    pytest.importorskip("fluxpy.ops.bias_act")
    with pytest.raises(ValueError, match=r"conv_bias_act expects b of shape \(6,\).*got b of shape \(3,\)"):
        conv_bias_act(np.ones((1, 2, 4, 4)), np.ones((6, 2, 3, 3)), np.ones(3))


# ---------------------------------------------------------------------------------------------
# Errors: raised before computing, naming the op, expected and got


def test_channel_mismatch_message():
    with pytest.raises(ValueError, match=r"^conv expects x.shape\[1\] == w.shape\[1\] \* groups == 4, "
                                         r"got x of shape \(5, 3, 9, 9\) float32$"):
        conv(np.ones((5, 3, 9, 9), np.float32), np.ones((8, 2, 3, 3), np.float32), groups=2)


@pytest.mark.parametrize("kw,match", [
    (dict(stride=0), r"conv expects stride to be a positive int or a pair of them, got 0"),
    (dict(stride=(1, 2, 3)), r"conv expects stride to be a positive int or a pair of them, got \(1, 2, 3\)"),
    (dict(dilation=-1), r"conv expects dilation to be a positive int"),
    (dict(pad=-1), r"conv expects pad to be a non-negative int, a pair \(ph, pw\), a 4-tuple"),
    (dict(pad=(1, 2, 3)), r"conv expects pad .* got \(1, 2, 3\)"),
    (dict(pad="valid"), r"conv expects pad .* got 'valid'"),
    (dict(groups=0), r"conv expects groups to be a positive int, got 0"),
    (dict(groups=3), r"conv expects w.shape\[0\] \(output channels\) to be divisible by groups == 3, "
                     r"got w of shape \(4, 2, 3, 3\) float64"),
])
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        conv(np.ones((1, 2, 5, 5)), np.ones((4, 2, 3, 3)), **kw)


def test_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"conv expects x of 3, 4 or 5 dimensions \(N, C, \*spatial\) \(1, 2 or 3 "
                                         r"spatial axes\), got x of shape \(2, 5\)"):
        conv(np.ones((2, 5)), np.ones((4, 2, 3, 3)))
    with pytest.raises(ValueError, match=r"conv expects w of 3 dimensions \(K, C/groups, S\), got w of shape "
                                         r"\(4, 2, 3, 3\)"):
        conv(np.ones((2, 5, 5)), np.ones((4, 2, 3, 3)))
    with pytest.raises(ValueError, match=r"conv expects w of 4 dimensions .* got w of shape \(4, 2, 3\)"):
        conv(np.ones((1, 2, 5, 5)), np.ones((4, 2, 3)))
    with pytest.raises(ValueError, match=r"conv expects the padded input \(4, 5\) to be at least the dilated "
                                         r"kernel \(5, 3\)"):
        conv(np.ones((1, 2, 4, 5)), np.ones((4, 2, 3, 3)), dilation=(2, 1))
    with pytest.raises(TypeError, match=r"conv expects x and w of the same floating-point dtype, "
                                        r"got x float32 and w float64"):
        conv(np.ones((1, 2, 5, 5), np.float32), np.ones((4, 2, 3, 3)))
    with pytest.raises(TypeError, match=r"conv expects x to be an array \(N, C, \*spatial\), got a list"):
        conv([[[[1.0]]]], np.ones((1, 1, 1, 1)))
    with pytest.raises(TypeError, match=r"got x int64 and w int64"):
        conv(np.ones((1, 2, 5, 5), np.int64), np.ones((4, 2, 3, 3), np.int64))


def test_backward_kernel_shape_errors():
    cd = ConvDims.from_shapes((1, 2, 5, 5), (4, 2, 3, 3))
    with pytest.raises(ValueError, match=r"conv_backward_data expects dy of shape \(1, 4, 3, 3\) \(the conv output\), "
                                         r"got dy of shape \(1, 4, 5, 5\) float64"):
        conv_backward_data(np.ones((1, 4, 5, 5)), np.ones((4, 2, 3, 3)), cd)
    with pytest.raises(ValueError, match=r"conv_backward_filter expects x of shape \(1, 2, 5, 5\)"):
        conv_backward_filter(np.ones((1, 2, 6, 5)), np.ones((1, 4, 3, 3)), cd)


def test_conv_transpose_errors():
    with pytest.raises(ValueError, match=r"conv_transpose expects w of 4 dimensions \(C_in, C_out/groups, R, S\), "
                                         r"got w of shape \(4, 2, 3\) float64"):
        conv_transpose(np.ones((1, 4, 5, 5)), np.ones((4, 2, 3)))
    with pytest.raises(ValueError, match=r"conv_transpose expects x.shape\[1\] == w.shape\[0\] == 4 \(input "
                                         r"channels\), got x of shape \(1, 3, 5, 5\) float64"):
        conv_transpose(np.ones((1, 3, 5, 5)), np.ones((4, 2, 3, 3)))
    with pytest.raises(ValueError, match=r"conv_transpose expects output_padding smaller than stride \(2, 2\), "
                                         r"got \(2, 0\)"):
        conv_transpose(np.ones((1, 4, 5, 5)), np.ones((4, 2, 3, 3)), stride=2, output_padding=(2, 0))
    with pytest.raises(ValueError, match=r"conv_transpose expects groups to be a positive int dividing x.shape\[1\]"):
        conv_transpose(np.ones((1, 4, 5, 5)), np.ones((4, 2, 3, 3)), groups=3)
    with pytest.raises(ValueError, match=r"conv_transpose expects a positive output size"):
        conv_transpose(np.ones((1, 4, 1, 1)), np.ones((4, 2, 1, 1)), pad=1)


# ---------------------------------------------------------------------------------------------
# Against PyTorch (float64; skipped where torch is not installed)


def _torch_padded(torch, x, pad):
    top, bottom, left, right = pad
    return torch.nn.functional.pad(x, (left, right, top, bottom))


@given(problem=conv_problems(), seed=seeds)
def test_conv_against_torch(problem, seed):
    torch = pytest.importorskip("torch")
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    x, w = randn(rng, xs), randn(rng, ws)
    cd = ConvDims.from_arrays(x, w, **opts)
    tw = torch.tensor(w if opts["flipped"] else w[:, :, ::-1, ::-1].copy(), requires_grad=True)
    tx = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.conv2d(_torch_padded(torch, tx, cd.pad), tw, stride=cd.stride, dilation=cd.dilation,
                                    groups=cd.groups)
    dy = randn(rng, tuple(ty.shape))
    ty.backward(torch.tensor(dy))
    y, back = fluxpy.pullback(lambda x, w: conv(x, w, **opts), x, w)
    dx, dw = back(dy)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dw if opts["flipped"] else dw[:, :, ::-1, ::-1], tw.grad.numpy(), rtol=1e-10,
                               atol=1e-10)


@given(problem=transpose_problems(), seed=seeds)
def test_conv_transpose_against_torch(problem, seed):
    torch = pytest.importorskip("torch")
    xs, ws, opts = problem
    if opts["pad"] == "same" or not _transpose_output_ok(xs, ws, opts):
        return   # torch's conv_transpose2d has no "same"
    top, bottom, left, right = resolve_pad(opts["pad"], (1, 1), (1, 1), (1, 1))
    if top != bottom or left != right:
        return   # nor asymmetric padding
    rng = np.random.default_rng(seed)
    x, w = randn(rng, xs), randn(rng, ws)
    tw = w if opts["flipped"] else w[:, :, ::-1, ::-1].copy()
    expected = torch.nn.functional.conv_transpose2d(
        torch.tensor(x), torch.tensor(tw), stride=opts["stride"], padding=(top, left),
        output_padding=opts["output_padding"], groups=opts["groups"], dilation=opts["dilation"])
    np.testing.assert_allclose(conv_transpose(x, w, **opts), expected.numpy(), rtol=1e-10, atol=1e-10)


def test_mnist_layers_float32_against_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    for xs, ws in [((8, 1, 28, 28), (16, 1, 3, 3)), ((8, 16, 14, 14), (32, 16, 3, 3)), ((8, 32, 7, 7), (32, 32, 3, 3))]:
        x, w = randn(rng, xs).astype(np.float32), randn(rng, ws).astype(np.float32)
        expected = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), padding=1).numpy()
        np.testing.assert_allclose(conv(x, w, pad=1, flipped=True), expected, rtol=1e-4, atol=1e-4)
