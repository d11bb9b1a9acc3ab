"""Batch norm with a residual joined before its activation (``batchnorm(..., act, residual)``), and the residual
blocks that hand their join to it (``Chain(SkipConnection(Chain(..., BatchNorm(c)), +), relu)``,
``Parallel(+, body, shortcut)``): values, running statistics, first and second derivatives, the CPU kernels,
errors."""
import functools
import operator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.functors import arrays
from fluxpy.kernels import onednn
from fluxpy.kernels.halfs import HALVES
from fluxpy.layers import BatchNorm, Chain, Conv, Dense, Parallel, SkipConnection, normalise
from fluxpy.ops import activations as A
from fluxpy.ops.batchnorm import batchnorm
from gradcheck import check_grad, check_second_order

ACTS = [None, A.relu, A.gelu, A.tanh, A.swish, functools.partial(A.leakyrelu, a=0.2), A.elu]


@st.composite
def problems(draw):
    ndim = draw(st.integers(2, 4))
    shape = (draw(st.integers(2, 4)), draw(st.integers(1, 3))) + tuple(draw(st.integers(1, 3))
                                                                        for _ in range(ndim - 2))
    return shape, draw(st.booleans()), draw(st.sampled_from(ACTS)), draw(st.integers(0, 2**31 - 1))


def _unfused(x, g, b, rm, rv, act, r):
    y = batchnorm(x, g, b, rm, rv, momentum=0.3, eps=1e-2) + r
    return y if act is None else act(y)


def _near_a_kink(x, g, b, r):
    """Whether some pre-activation lies within 1e-3 of a point where an activation's derivative jumps."""
    z = batchnorm(x, g, b, eps=1e-2) + r
    return np.min(np.abs(z[..., None] - np.array([0.0, 1.0, 3.0, 6.0]))) < 1e-3


@given(problem=problems())
def test_values_and_running_statistics_equal_the_join_after_the_batch_norm(problem):
    shape, affine, act, seed = problem
    rng = np.random.default_rng(seed)
    c = shape[1]
    x, r = rng.standard_normal(shape) * 2 + 1, rng.standard_normal(shape)
    g, b = (rng.standard_normal(c), rng.standard_normal(c)) if affine else (None, None)
    rm, rv = rng.standard_normal(c), rng.random(c) + 0.5
    rm2, rv2 = rm.copy(), rv.copy()
    got = batchnorm(x, g, b, rm, rv, momentum=0.3, eps=1e-2, act=act, residual=r)
    np.testing.assert_allclose(got, _unfused(x, g, b, rm2, rv2, act, r), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rm, rm2, rtol=1e-14)
    np.testing.assert_allclose(rv, rv2, rtol=1e-14)


@given(problem=problems())
def test_gradients_against_finite_differences(problem):
    shape, affine, act, seed = problem
    rng = np.random.default_rng(seed)
    c = shape[1]
    x, r = rng.standard_normal(shape), rng.standard_normal(shape)
    g, b = rng.standard_normal(c), rng.standard_normal(c)
    if _near_a_kink(x, g, b, r):
        return
    if affine:
        check_grad(lambda x, g, b, r: batchnorm(x, g, b, eps=1e-2, act=act, residual=r), x, g, b, r, rng=rng,
                   rtol=1e-5, atol=1e-7)
    else:
        check_grad(lambda x, r: batchnorm(x, eps=1e-2, act=act, residual=r), x, r, rng=rng, rtol=1e-5, atol=1e-7)


@settings(max_examples=25)
@given(problem=problems())
def test_second_derivatives(problem):
    shape, _, act, seed = problem
    act = A.tanh if act is None or act in (A.relu, A.elu) or isinstance(act, functools.partial) else act
    rng = np.random.default_rng(seed)
    c = shape[1]
    x, r = rng.standard_normal(shape), rng.standard_normal(shape)
    g, b = rng.standard_normal(c), rng.standard_normal(c)
    check_second_order(lambda x, g, b, r: batchnorm(x, g, b, eps=1e-2, act=act, residual=r) ** 2, x, g, b, r,
                       rng=rng, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dt", HALVES, ids=str)
def test_halves_are_computed_in_float32_and_rounded_once(dt):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 5)).astype(dt)
    r = rng.standard_normal((4, 3, 5)).astype(dt)
    g, b = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    y = batchnorm(x, g, b, eps=1e-3, act=A.gelu, residual=r)
    assert y.dtype == dt
    want = batchnorm(x.astype(np.float32), g, b, eps=1e-3, act=A.gelu, residual=r.astype(np.float32))
    np.testing.assert_array_equal(y, want.astype(dt))
    dx, dg, db, dr = fluxpy.gradient(lambda x, g, b, r: batchnorm(x, g, b, eps=1e-3, act=A.gelu,
                                                                  residual=r).astype(np.float32).sum(), x, g, b, r)
    assert dx.dtype == dr.dtype == dt and dg.dtype == db.dtype == np.float32
    dx32, _, _, dr32 = fluxpy.gradient(lambda x, g, b, r: batchnorm(x, g, b, eps=1e-3, act=A.gelu, residual=r).sum(),
                                       x.astype(np.float32), g, b, r.astype(np.float32))
    np.testing.assert_array_equal(dr, dr32.astype(dt))
    np.testing.assert_allclose(dx.astype(np.float32), dx32, rtol=2e-2, atol=2e-2)


def _cpu_forward_against_the_composite(shape, affine, act, rng):
    """cpu_norm's forward with a residual against the op's formulas, float32; whether it took the call. Its
    backward turns a residual down (the op asks with one only where the pre-activation must be recomputed)."""
    from fluxpy.kernels import cpu_norm
    from fluxpy.ops.batchnorm import _forward_arrays
    from fluxpy.ops.bias_act import derivative_from_saved
    x, r, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    c = shape[1]
    gamma = rng.standard_normal(c).astype(np.float32) if affine else None
    beta = rng.standard_normal(c).astype(np.float32) if affine else None
    args = (x, gamma, beta, None, None, 0.1, 1e-5, act, r)
    y, mean, invstd = _forward_arrays(*args)
    taken = cpu_norm.batchnorm_forward_supports(*args)
    if taken:
        got_y, got_mean, got_invstd = cpu_norm.batchnorm_forward(*args)
        np.testing.assert_allclose(got_y, y, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got_invstd, invstd, rtol=1e-4)
    y_derivative = derivative_from_saved(act)[0] if act is not None else None
    assert not cpu_norm.batchnorm_backward_supports(dy, x, y, gamma, beta, mean, invstd, 1e-5, act, y_derivative, r)
    return taken


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 5), st.integers(1, 5), st.integers(0, 2), st.booleans(),
       st.sampled_from([None, "relu", "relu6", "elu", "tanh"]))
def test_the_cpu_kernels_equal_the_composite(n, c, spatial, affine, act_name):
    """At these sizes cpu_norm declines the forward (NumPy's composite runs); the backward declines a residual."""
    rng = np.random.default_rng(n * 100 + c * 10 + spatial)
    _cpu_forward_against_the_composite((n, c) + (3,) * spatial, affine, getattr(A, act_name) if act_name else None,
                                       rng)


@pytest.mark.skipif(onednn.library() is None, reason="oneDNN is not installed (pip install fluxpy[cpu])")
@pytest.mark.parametrize("act", [None, A.relu, A.relu6, A.tanh], ids=repr)
def test_the_cpu_forward_with_onednn_equals_the_composite(act):
    """Large float32 batches: oneDNN's scale-shift pass, the residual then added, the activation after."""
    assert _cpu_forward_against_the_composite((8, 3, 64, 64), True, act, np.random.default_rng(7))


@pytest.mark.parametrize("residual, message", [
    (np.ones((4, 2)), r"residual of x's shape and dtype, \(4, 3\) float64, got \(4, 2\) float64"),
    (np.ones((4, 3), np.float32), r"residual of x's shape and dtype, \(4, 3\) float64, got \(4, 3\) float32"),
    ([[1.0] * 3] * 4, r"got \(\) None"),
])
def test_a_residual_unlike_x_is_refused_before_anything_changes(residual, message):
    rm, rv = np.zeros(3), np.ones(3)
    with pytest.raises(ValueError, match=message):
        batchnorm(np.random.default_rng(0).standard_normal((4, 3)), None, None, rm, rv, act=A.relu,
                  residual=residual)
    assert np.all(rm == 0) and np.all(rv == 1)


def batchnorm_calls(monkeypatch) -> list:
    """A list that records, for each call of ``batchnorm`` by the BatchNorm layer from now on, whether it was given a
    residual (the join handed to it)."""
    joined = []
    original = normalise.batchnorm

    def spy(*args, **kw):
        joined.append(kw.get("residual") is not None)
        return original(*args, **kw)
    monkeypatch.setattr(normalise, "batchnorm", spy)
    return joined


def _blocks(rng):
    """A residual block of each kind (identity and projection shortcuts), 4-d and 2-d, float64."""
    def conv(cin, cout, stride=1):
        return Conv((3, 3), cin, cout, stride=stride, pad=1, bias=False, rng=rng)
    identity = Chain(SkipConnection(Chain(conv(3, 3), BatchNorm(3, A.relu), conv(3, 3), BatchNorm(3)), operator.add),
                     A.relu)
    projection = Chain(Parallel(operator.add, Chain(conv(3, 4, 2), BatchNorm(4, A.relu), conv(4, 4), BatchNorm(4)),
                                Chain(Conv((1, 1), 3, 4, stride=2, bias=False, rng=rng), BatchNorm(4))), A.relu)
    dense = Chain(SkipConnection(Chain(Dense(5, 5, rng=rng), BatchNorm(5)), operator.add), A.relu)
    return [(fluxpy.f64(identity), (4, 3, 6, 6)), (fluxpy.f64(projection), (4, 3, 6, 6)),
            (fluxpy.f64(dense), (6, 5))]


def _unjoined(model):
    """The same model with each ``relu`` after a residual join replaced by an equal function that the Chain does not
    recognise, so the join runs as an add and a relu after the batch norm."""
    def plain_relu(x):
        return A.relu(x)
    return Chain(*[plain_relu if f is A.relu else f for f in model.layers])


@pytest.mark.parametrize("which", [0, 1, 2])
def test_residual_blocks_hand_the_join_to_their_last_batch_norm(which, monkeypatch):
    rng = np.random.default_rng(which)
    model, shape = _blocks(rng)[which]
    x = rng.standard_normal(shape)
    joined = batchnorm_calls(monkeypatch)
    twin = fluxpy.fmap(lambda a: a.copy() if isinstance(a, np.ndarray) else a, model)
    loss, grads = fluxpy.withgradient(lambda m: (m(x) ** 2).sum(), model)
    assert joined.count(True) == 1
    joined.clear()
    loss2, grads2 = fluxpy.withgradient(lambda m: (_unjoined(m)(x) ** 2).sum(), twin)
    assert joined.count(True) == 0
    np.testing.assert_allclose(loss, loss2, rtol=1e-12)
    assert len(arrays(grads)) == len(arrays(grads2)) >= 4
    for a, b in zip(arrays(grads), arrays(grads2)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    for a, b in zip(arrays(model), arrays(twin)):   # the running statistics moved alike
        np.testing.assert_allclose(a, b, rtol=1e-12)
    # outside gradient (test mode) the join is the plain add and relu, with the running statistics
    np.testing.assert_allclose(model(x), _unjoined(model)(x), rtol=1e-12)


def test_a_batch_norm_with_its_own_activation_or_a_broadcast_shortcut_keeps_the_plain_join():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 3))
    own = Chain(SkipConnection(Chain(Dense(3, 3, rng=rng), BatchNorm(3, A.tanh)), operator.add), A.relu)
    wide = Chain(Parallel(operator.add, Chain(Dense(3, 3, rng=rng), BatchNorm(3)), lambda x: x[:1]), A.relu)
    for model in (fluxpy.f64(own), fluxpy.f64(wide)):
        got = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), model)
        twin = fluxpy.fmap(lambda a: a.copy() if isinstance(a, np.ndarray) else a, model)
        want = fluxpy.gradient(lambda m: (_unjoined(m)(x) ** 2).sum(), twin)
        assert len(arrays(got)) == len(arrays(want)) >= 3
        for a, b in zip(arrays(got), arrays(want)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_a_bad_input_names_the_chain_layer():
    block = Chain(SkipConnection(Chain(Dense(3, 3), BatchNorm(4)), operator.add), A.relu)
    with pytest.raises(fluxpy.layers.DimensionMismatch, match="Chain layer 1: BatchNorm"):
        fluxpy.gradient(lambda m: m(np.ones((2, 3), np.float32)).sum(), block)


def test_a_sync_batch_norm_keeps_its_own_call_in_a_residual_block(monkeypatch):
    """SyncBatchNorm's training statistics are the global batch's: a residual block ending in one calls it (then
    adds and applies relu) rather than handing it the join, which would normalise with this rank's statistics."""
    from fluxpy.distributed import SyncBatchNorm, convert_sync_batchnorm
    rng = np.random.default_rng(9)
    block = convert_sync_batchnorm(fluxpy.f64(Chain(SkipConnection(Chain(Dense(4, 4, rng=rng), BatchNorm(4)),
                                                                  operator.add), A.relu)))
    assert type(block[0].layers[1]) is SyncBatchNorm
    synced, original = [], SyncBatchNorm.__call__

    def call(self, x):
        synced.append(x.shape)
        return original(self, x)
    monkeypatch.setattr(SyncBatchNorm, "__call__", call)
    joined = batchnorm_calls(monkeypatch)
    x = rng.standard_normal((6, 4))
    got = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), block)
    assert synced == [(6, 4)] and joined == [False]
    twin = fluxpy.fmap(lambda a: a.copy() if isinstance(a, np.ndarray) else a, block)
    want = fluxpy.gradient(lambda m: (_unjoined(m)(x) ** 2).sum(), twin)
    for a, b in zip(arrays(got), arrays(want)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
