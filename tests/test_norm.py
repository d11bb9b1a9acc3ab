"""Normalisation (normalise, batchnorm_train/infer, layernorm) and dropout."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.kernels import cpu_norm
from fluxpy.ops.dropout import dropout, dropout_mask
from fluxpy.ops.norm import batchnorm_infer, batchnorm_train, layernorm, normalise
from gradcheck import check_grad, check_second_order
from strategies import axes_for, shapes

seeds = st.integers(0, 2**31 - 1)


@st.composite
def nc_shape(draw):
    """(N, C, ...) with at least two values per channel."""
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 3))) + draw(shapes(0, 2, 1, 3))
    if np.prod(shape) // shape[1] < 2:
        shape = (2,) + shape[1:]
    return shape


def reference_batchnorm(x, gamma, beta, eps):
    axes = (0,) + tuple(range(2, x.ndim))
    k = (1, -1) + (1,) * (x.ndim - 2)
    mu, var = x.mean(axis=axes), x.var(axis=axes)
    return (x - mu.reshape(k)) / np.sqrt(var.reshape(k) + eps) * gamma.reshape(k) + beta.reshape(k), mu, var


# ---------------------------------------------------------------------------------------------
# normalise


@given(shape=shapes(1, 3, 2, 4), data=st.data(), seed=seeds)
def test_normalise_values_and_gradient(shape, data, seed):
    axis = data.draw(axes_for(len(shape)))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2 + 1
    m, v = x.mean(axis=axis, keepdims=True), x.var(axis=axis, keepdims=True)
    np.testing.assert_allclose(normalise(x, axis, eps=1e-3), (x - m) / np.sqrt(v + 1e-3), rtol=1e-12, atol=1e-12)
    check_grad(lambda x: normalise(x, axis, eps=1e-3), x, rng=rng, rtol=1e-5)


@given(shape=shapes(2, 2, 2, 4), seed=seeds)
def test_normalise_second_order(shape, seed):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(shape), rng.standard_normal(shape)
    check_second_order(lambda x: normalise(x, -1, eps=0.1) * w, x, rng=rng, rtol=1e-5)


def test_normalise_second_order_with_a_batchnorm_layer_inside():
    rng = np.random.default_rng(0)
    x, g, b = rng.standard_normal((3, 2, 2)), rng.standard_normal(2), rng.standard_normal(2)
    w = rng.standard_normal((3, 2, 2))
    check_second_order(lambda x, g, b: batchnorm_train(x, g, b, 0.1)[0] * w, x, g, b, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# batch norm


@given(shape=nc_shape(), seed=seeds)
def test_batchnorm_train(shape, seed):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x, gamma, beta = rng.standard_normal(shape) + 3, rng.standard_normal(c), rng.standard_normal(c)
    y, mu, var = batchnorm_train(x, gamma, beta, 1e-3)
    ey, emu, evar = reference_batchnorm(x, gamma, beta, 1e-3)
    np.testing.assert_allclose(y, ey, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mu, emu, rtol=1e-12)
    np.testing.assert_allclose(var, evar, rtol=1e-12, atol=1e-14)
    assert mu.shape == var.shape == (c,)
    check_grad(lambda x, g, b: batchnorm_train(x, g, b, 1e-3)[0], x, gamma, beta, rng=rng, rtol=1e-5)


def test_batchnorm_statistics_are_plain_arrays():
    def loss(x):
        y, mu, var = batchnorm_train(x, None, None)
        assert isinstance(mu, np.ndarray) and isinstance(var, np.ndarray)
        return (y * y).sum()
    fluxpy.gradient(loss, np.random.default_rng(0).standard_normal((4, 3)))


@given(shape=nc_shape(), seed=seeds)
def test_batchnorm_infer(shape, seed):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x, g, b = rng.standard_normal(shape), rng.standard_normal(c), rng.standard_normal(c)
    rm, rv = rng.standard_normal(c), rng.uniform(0.5, 2, c)
    k = (1, -1) + (1,) * (len(shape) - 2)
    expected = (x - rm.reshape(k)) / np.sqrt(rv.reshape(k) + 1e-5) * g.reshape(k) + b.reshape(k)
    np.testing.assert_allclose(batchnorm_infer(x, g, b, rm, rv), expected, rtol=1e-12, atol=1e-12)
    check_grad(lambda x, g, b, rm, rv: batchnorm_infer(x, g, b, rm, rv), x, g, b, rm, rv, rng=rng)
    np.testing.assert_allclose(batchnorm_infer(x, None, None, rm, rv),
                               (x - rm.reshape(k)) / np.sqrt(rv.reshape(k) + 1e-5), rtol=1e-12, atol=1e-12)


def test_batchnorm_matches_torch_including_running_statistics():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((4, 3, 5, 5)), rng.standard_normal((4, 3, 5, 5))
    gamma, beta = rng.standard_normal(3), rng.standard_normal(3)
    tx, tg, tb = (torch.tensor(a, requires_grad=True) for a in (x, gamma, beta))
    running_mean, running_var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    ty = F.batch_norm(tx, running_mean, running_var, tg, tb, training=True, momentum=0.1, eps=1e-5)
    ty.backward(torch.tensor(dy))

    _, mu, var = batchnorm_train(x, gamma, beta, 1e-5)
    y, back = fluxpy.pullback(lambda x, g, b: batchnorm_train(x, g, b, 1e-5)[0], x, gamma, beta)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    for ours, theirs in zip(back(dy), (tx, tg, tb)):
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=1e-9, atol=1e-11)
    # A BatchNorm layer's update, with PyTorch's (and Flux's) unbiased running variance:
    m = x.size // 3
    np.testing.assert_allclose(0.9 * 0 + 0.1 * mu, running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(0.9 * 1 + 0.1 * var * m / (m - 1), running_var.numpy(), rtol=1e-12)

    rm, rv = running_mean.numpy(), running_var.numpy()
    te = F.batch_norm(torch.tensor(x), running_mean, running_var, tg.detach(), tb.detach(), training=False, eps=1e-5)
    np.testing.assert_allclose(batchnorm_infer(x, gamma, beta, rm, rv), te.numpy(), rtol=1e-10, atol=1e-12)


def test_batchnorm_float32_and_errors():
    x = np.random.default_rng(2).standard_normal((8, 4, 3, 3)).astype(np.float32)
    g, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    y, mu, var = batchnorm_train(x, g, b)
    gx, gg = fluxpy.gradient(lambda x, g: batchnorm_train(x, g, b)[0].sum(), x, g)
    assert y.dtype == mu.dtype == var.dtype == gx.dtype == gg.dtype == np.float32
    with pytest.raises(ValueError, match=r"batchnorm_train expects gamma of shape \(4,\) for x of shape "
                                         r"\(8, 4, 3, 3\), got \(3,\)"):
        batchnorm_train(x, np.ones(3), b)
    with pytest.raises(ValueError, match=r"batchnorm_train expects x of shape \(N, C, ...\)"):
        batchnorm_train(np.ones(4), None, None)
    with pytest.raises(ValueError, match=r"batchnorm_infer expects running_var of shape \(4,\)"):
        batchnorm_infer(x, g, b, np.zeros(4), np.ones(5))


# ---------------------------------------------------------------------------------------------
# layer norm


@given(shape=shapes(2, 3, 2, 4), k=st.integers(1, 2), affine=st.booleans(), seed=seeds)
def test_layernorm(shape, k, affine, seed):
    k = min(k, len(shape))
    axes = tuple(range(-k, 0))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    g, b = (rng.standard_normal(shape[-k:]), rng.standard_normal(shape[-k:])) if affine else (None, None)
    m, v = x.mean(axis=axes, keepdims=True), x.var(axis=axes, keepdims=True)
    expected = (x - m) / np.sqrt(v + 1e-5)
    if affine:
        expected = expected * g + b
    np.testing.assert_allclose(layernorm(x, g, b, axes), expected, rtol=1e-10, atol=1e-12)
    args = (x, g, b) if affine else (x,)
    check_grad(lambda x, g=None, b=None: layernorm(x, g, b, axes), *args, rng=rng, rtol=1e-5)


def test_layernorm_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((4, 5, 6)), rng.standard_normal((4, 5, 6))
    g, b = rng.standard_normal((5, 6)), rng.standard_normal((5, 6))
    tx, tg, tb = (torch.tensor(a, requires_grad=True) for a in (x, g, b))
    ty = torch.nn.functional.layer_norm(tx, (5, 6), tg, tb, eps=1e-5)
    ty.backward(torch.tensor(dy))
    y, back = fluxpy.pullback(lambda x, g, b: layernorm(x, g, b, (-2, -1), 1e-5), x, g, b)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    for ours, theirs in zip(back(dy), (tx, tg, tb)):
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=1e-9, atol=1e-11)


def test_layernorm_errors():
    with pytest.raises(ValueError, match=r"layernorm: gamma of shape \(4,\) does not broadcast to x of shape \(2, 3\)"):
        layernorm(np.ones((2, 3)), np.ones(4), None)
    with pytest.raises(ValueError, match="layernorm: axis 2 is out of range"):   # names the op called
        layernorm(np.ones((2, 3)), None, None, axes=2)


@given(rows=st.integers(1, 4), length=st.integers(2, 9), fused=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=20, deadline=None)
def test_half_parameters_are_read_in_float32(rows, length, fused, seed):
    """gamma, beta and the bias in x's half dtype give the layer norm of their float32 values, to the bit (the GPU
    kernels read them so), and their gradients in their own dtype."""
    from fluxpy.kernels.halfs import BFLOAT16
    rng = np.random.default_rng(seed)
    for dtype in (np.dtype(np.float16), BFLOAT16):
        x, r = (rng.standard_normal((rows, length)).astype(dtype) for _ in range(2))
        halves = [rng.standard_normal(length).astype(dtype) for _ in range(3)]
        wide = [a.astype(np.float32) for a in halves]
        extra = (lambda p: dict(residual=r, bias=p[2])) if fused else (lambda p: {})
        y = layernorm(x, halves[0], halves[1], **extra(halves))
        assert y.dtype == dtype and np.array_equal(y, layernorm(x, wide[0], wide[1], **extra(wide)))
        grads = fluxpy.gradient(lambda g, b, c: (layernorm(x, g, b, **extra((g, b, c))).astype(np.float32) ** 2).sum(),
                                *halves)
        want = fluxpy.gradient(lambda g, b, c: (layernorm(x, g, b, **extra((g, b, c))).astype(np.float32) ** 2).sum(),
                               *wide)
        for got, w, used in zip(grads, want, (True, True, fused)):
            if used:
                assert got.dtype == dtype and np.array_equal(got, w.astype(dtype))


@pytest.mark.parametrize("call, message", [
    (lambda: normalise(np.ones(1)), r"normalise expects more than 1 value along axis -1, got x of shape \(1,\)"),
    (lambda: normalise(np.ones((3, 1)), axis=1), r"normalise expects more than 1 value along axis 1, got x of shape \(3, 1\)"),
    (lambda: normalise(np.ones((0, 4)), axis=None), r"normalise expects more than 1 value along axis None"),
    (lambda: batchnorm_train(np.ones((1, 3))),
     r"batchnorm_train expects more than 1 value per channel \(x.size // x.shape\[1\]\), got x of shape \(1, 3\)"),
    (lambda: batchnorm_train(np.ones((1, 3, 1, 1))), r"batchnorm_train expects more than 1 value per channel"),
    (lambda: batchnorm_train(np.ones((0, 3))), r"batchnorm_train expects more than 1 value per channel"),
    (lambda: layernorm(np.ones((2, 1))), r"layernorm expects more than 1 value along axes -1, got x of shape \(2, 1\)"),
    (lambda: layernorm(np.ones((2, 1, 1)), axes=(-2, -1)), r"layernorm expects more than 1 value along axes \(-2, -1\)"),
])
def test_normalising_a_single_value_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@given(n=st.integers(1, 3), c=st.integers(1, 3), hw=st.integers(1, 2))
def test_batchnorm_train_refuses_exactly_the_single_value_channels(n, c, hw):
    x = np.random.default_rng(n).standard_normal((n, c, hw, hw))
    if n * hw * hw < 2:
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            batchnorm_train(x)
    else:
        assert batchnorm_train(x)[0].shape == x.shape


# ---------------------------------------------------------------------------------------------
# dropout


@given(p=st.sampled_from([0.1, 0.5, 0.8]), seed=seeds)
def test_dropout_statistics(p, seed):
    x = np.ones(20000)
    y = dropout(x, p, rng=np.random.default_rng(seed))
    dropped = np.mean(y == 0)
    assert abs(dropped - p) < 5 * np.sqrt(p * (1 - p) / x.size)
    np.testing.assert_allclose(np.unique(y[y != 0]), [1 / (1 - p)])
    assert abs(y.mean() - 1) < 6 * np.sqrt(p / (1 - p) / x.size)


@given(shape=shapes(1, 4, 1, 4), data=st.data(), seed=seeds)
def test_dropout_gradient_with_a_fixed_mask(shape, data, seed):
    dims = data.draw(axes_for(len(shape)))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    f = lambda x: dropout(x, 0.4, rng=np.random.default_rng(seed), dims=dims)  # noqa: E731
    mask = dropout_mask(x, 0.4, rng=np.random.default_rng(seed), dims=dims)
    np.testing.assert_allclose(f(x), x * mask)
    check_grad(f, x, rng=rng)
    np.testing.assert_allclose(fluxpy.gradient(lambda x: f(x).sum(), x)[0], np.broadcast_to(mask, shape))


def test_dropout_dims_share_the_mask():
    x = np.ones((64, 8, 5, 5))
    y = dropout(x, 0.5, rng=np.random.default_rng(0), dims=(0, 1))  # whole channels
    per_channel = y.reshape(64, 8, 25)
    assert np.all(per_channel == per_channel[:, :, :1])
    assert 0 < np.mean(per_channel[:, :, 0] == 0) < 1
    assert dropout_mask(x, 0.5, rng=np.random.default_rng(0), dims=-1).shape == (1, 1, 1, 5)


def test_dropout_inactive_float32_and_errors():
    x = np.ones((3, 3), np.float32)
    assert dropout(x, 0.5, active=False) is x
    assert dropout(x, 0.0) is x
    assert dropout(x, 0.5, rng=np.random.default_rng(0)).dtype == np.float32
    assert dropout(x, 0.5).shape == (3, 3)  # the default generator
    for p in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match=r"dropout: p must be a probability in \[0, 1\]"):
            dropout(x, p)
    # p = 1 drops everything, as Flux and PyTorch: zeros and a zero gradient (not NaN from 0 * inf)
    assert np.array_equal(dropout(x, 1.0, rng=np.random.default_rng(0)), np.zeros((3, 3), np.float32))
    g, = fluxpy.gradient(lambda z: dropout(z, 1.0, rng=np.random.default_rng(0)).sum(), x)
    assert np.array_equal(g, np.zeros_like(x))
    layer = fluxpy.Dropout(1.0, active=True)
    assert np.array_equal(layer(x), np.zeros_like(x))
    with pytest.raises(ValueError, match="dropout: axis 2 is out of range"):
        dropout(x, 0.5, dims=2)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(2, 9), st.integers(1, 2), st.booleans(), st.booleans())
def test_layernorm_backward_composite_matches_the_gradient_of_layernorm(rows, length, k, affine, need_params):
    """The backward the kernels stand in for (the composite) and the CPU's kernel, from the per-row mean and rstd,
    against the tape's gradient of the layer norm written out op by op."""
    from fluxpy.ops.norm import _layernorm_backward_composite
    rng = np.random.default_rng(rows * 100 + length)
    tail = (length,) if k == 1 else (2, length)
    x = rng.standard_normal((rows,) + tail) * 2 + 1
    dy = rng.standard_normal(x.shape)
    g = rng.standard_normal(tail) if affine else None
    b = rng.standard_normal(tail) if affine else None
    axes = tuple(range(-k, 0))
    flat = x.reshape(rows, -1)
    mean, rstd = flat.mean(axis=1), 1 / np.sqrt(flat.var(axis=1) + 1e-5)
    def written_out(x, g=None, b=None):
        centred = x - x.mean(axis=axes, keepdims=True)
        y = centred / np.sqrt((centred * centred).mean(axis=axes, keepdims=True) + 1e-5)
        return ((y if g is None else y * g + b) * dy).sum()
    want = fluxpy.gradient(written_out, x, g, b) if affine else fluxpy.gradient(written_out, x) + (None, None)
    kernel = cpu_norm.layernorm_backward(dy, x, g, mean, rstd, k, need_params)
    for got in (_layernorm_backward_composite(dy, x, g, mean, rstd, k, need_params), kernel):
        _check_layernorm_backward(got, want, x, dy, mean, rstd, rows, k, affine, need_params)


def _check_layernorm_backward(got, want, x, dy, mean, rstd, rows, k, affine, need_params):
    dx, dg, db = got
    np.testing.assert_allclose(dx, want[0], rtol=1e-9, atol=1e-10)
    if need_params:
        np.testing.assert_allclose(dg, (dy * (x - mean.reshape((rows,) + (1,) * k)) *
                                        rstd.reshape((rows,) + (1,) * k)).sum(axis=0), rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(db, dy.sum(axis=0), rtol=1e-12)
        if affine:
            np.testing.assert_allclose(dg, want[1], rtol=1e-9, atol=1e-10)
    else:
        assert dg is None and db is None


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(2, 7), st.booleans(), st.booleans())
def test_layernorm_of_a_residual_sum_is_the_layernorm_of_the_sum(rows, length, with_residual, with_bias):
    from fluxpy.ops.norm import layernorm
    rng = np.random.default_rng(rows * 10 + length)
    x, r, c = rng.standard_normal((rows, length)), rng.standard_normal((rows, length)), rng.standard_normal(length)
    g, b, dy = rng.standard_normal(length), rng.standard_normal(length), rng.standard_normal((rows, length))
    r = r if with_residual else None
    c = c if with_bias else None
    total = x + (0 if r is None else r) + (0 if c is None else c)
    np.testing.assert_allclose(layernorm(x, g, b, residual=r, bias=c), layernorm(total, g, b), rtol=1e-12)
    args = [a for a in (x, r, c) if a is not None]

    def loss(*a):
        it = iter(a)
        xx = next(it)
        rr = next(it) if r is not None else None
        cc = next(it) if c is not None else None
        return (layernorm(xx, g, b, residual=rr, bias=cc) * dy).sum()
    grads = fluxpy.gradient(loss, *args)
    (ds,) = fluxpy.gradient(lambda s: (layernorm(s, g, b) * dy).sum(), total)
    np.testing.assert_allclose(grads[0], ds, rtol=1e-10, atol=1e-12)
    if r is not None:
        np.testing.assert_allclose(grads[1], ds, rtol=1e-10, atol=1e-12)
    if c is not None:
        np.testing.assert_allclose(grads[-1], ds.sum(axis=0), rtol=1e-10, atol=1e-12)


def test_layernorm_residual_errors_name_the_op_and_the_layer():
    from fluxpy.ops.norm import layernorm
    with pytest.raises(ValueError, match="layernorm: residual must have x's shape"):
        layernorm(np.ones((2, 3)), residual=np.ones((2, 4)))
    with pytest.raises(ValueError, match="layernorm: bias of shape"):
        layernorm(np.ones((2, 3)), bias=np.ones(4))
    with pytest.raises(fluxpy.DimensionMismatch, match="LayerNorm.*residual"):
        fluxpy.LayerNorm(3)(np.ones((2, 3), np.float32), residual=np.ones((2, 4), np.float32))
    y = fluxpy.LayerNorm(3)(np.ones((2, 3), np.float32), residual=np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_allclose(y, fluxpy.LayerNorm(3)(np.arange(6, dtype=np.float32).reshape(2, 3) + 1), rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.booleans(), st.booleans(), st.booleans())
def test_the_cpu_layernorm_kernel_in_float32_equals_float64(rows, length, affine, with_residual, with_bias):
    rng = np.random.default_rng(rows * 10 + length)
    spread = np.linspace(-2.0, 2.0, 2 * length).reshape(2, length)   # rows far from constant: float32 is then
    x64 = rng.standard_normal((rows, 2, length)) * 0.3 + spread + 1   # well conditioned (a nearly constant row is not)
    dy64 = rng.standard_normal((rows, 2, length))
    p64 = [rng.standard_normal((2, length)) if affine else None for _ in range(2)]
    r64 = rng.standard_normal(x64.shape) * 0.1 if with_residual else None
    c64 = rng.standard_normal((2, length)) * 0.1 if with_bias else None
    f32 = [None if a is None else a.astype(np.float32) for a in (x64, *p64, r64, c64)]
    assert cpu_norm.supports(f32[0], f32[1], f32[2], 2, 1e-5, f32[3], f32[4])
    results = []
    for x, g, b, r, c in ([x64, *p64, r64, c64], f32):
        y, mean, rstd = cpu_norm.layernorm_forward(x, g, b, 2, 1e-5, r, c)
        assert y.dtype == mean.dtype == rstd.dtype == x.dtype and mean.shape == rstd.shape == (rows,)
        grads = cpu_norm.layernorm_backward(dy64.astype(x.dtype), x, g, mean, rstd, 2, True, r, c)
        results.append((y, *grads))
    for ours, exact in zip(results[1], results[0]):
        np.testing.assert_allclose(ours, exact, rtol=2e-5, atol=2e-5)
    half = f32[0].astype(np.float16)
    assert not cpu_norm.supports(half, None, None, 2, 1e-5)   # the halves run the composite


def test_layernorm_checks_kept_per_problem_still_refuse_every_bad_call():
    """A problem whose checks passed is not checked again, but a call of another shape, dtype or eps is, and a bad
    call raises every time (nothing is kept from it)."""
    from fluxpy.ops import norm
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((3, 4)), rng.standard_normal(4)
    norm._checked.clear()
    good = layernorm(x, g, None)
    assert len(norm._checked) == 1
    np.testing.assert_allclose(layernorm(x, g, None), good)
    assert len(norm._checked) == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="gamma of shape \\(3,\\)"):
            layernorm(x, g[:3], None)
        with pytest.raises(ValueError, match="residual"):
            layernorm(x, g, None, residual=x[:, :2])
        with pytest.raises(ValueError, match="more than 1 value"):
            layernorm(x[:, :1], g[:1], None)
    assert len(norm._checked) == 1
