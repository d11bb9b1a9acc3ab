"""Every op, forward and backward, on CuPy arrays against the CPU path (float64 tight, float32 loose).

Also: a Dense/MLP gradient through ``fluxpy.gradient`` with CuPy parameters, the CPU/GPU mixing
error, and a whole training step (forward, backward, Adam update) with no hidden device-to-host
synchronisation (``cupyx.allow_synchronize(False)``). Needs a GPU (``gpu`` marker).
"""
import warnings

import numpy as np
import pytest

import fluxpy
from devices import to_device
from fluxpy import losses as L
from fluxpy import ops
from fluxpy.ops import activations as A
from fluxpy.ops.bias_act import bias_act
from fluxpy.ops.dropout import dropout, dropout_mask
from fluxpy.ops.norm import batchnorm_infer, batchnorm_train, layernorm, normalise
from fluxpy.ops.softmax import logsoftmax, softmax

pytestmark = pytest.mark.gpu




def check(f, *args, wrt=None, dtypes=(np.float64, np.float32), seed=0):
    """f(*args) and the gradient of sum(f * ct) agree between NumPy float64 and CuPy in each dtype."""
    import cupy as cp
    rng = np.random.default_rng(seed)
    wrt = tuple(i for i, a in enumerate(args) if isinstance(a, np.ndarray) and a.dtype.kind == "f") \
        if wrt is None else wrt
    y0 = f(*args)
    ct = rng.standard_normal(np.shape(fluxpy.value_of(y0)))

    def loss(ct):
        def inner(*ws):
            full = list(args_now)
            for i, w in zip(wrt, ws):
                full[i] = w
            return (f(*full) * ct).sum()
        return inner
    args_now = args
    g0 = fluxpy.gradient(loss(ct), *[args[i] for i in wrt])
    for dtype in dtypes:
        args_now = [to_device(a, cp, dtype) for a in args]
        y1 = f(*args_now)
        assert isinstance(fluxpy.value_of(y1), cp.ndarray), type(y1)
        g1 = fluxpy.gradient(loss(cp.asarray(ct.astype(dtype))), *[args_now[i] for i in wrt])
        rtol, atol = (1e-10, 1e-12) if dtype == np.float64 else (1e-4, 1e-5)
        np.testing.assert_allclose(cp.asnumpy(y1).astype(np.float64), y0, rtol=rtol, atol=atol)
        for a, c in zip(g1, g0):
            if c is None:
                assert a is None
                continue
            assert isinstance(a, cp.ndarray) and a.dtype == dtype and a.shape == c.shape
            s = max(1.0, float(np.abs(c).max())) if c.size else 1.0
            np.testing.assert_allclose(cp.asnumpy(a).astype(np.float64), c, rtol=rtol, atol=atol * s * 10)


rng = np.random.default_rng(42)
X = rng.standard_normal((4, 5))
Y = rng.standard_normal((4, 5))
ROW = rng.standard_normal((5,))
POS = rng.uniform(0.5, 2.0, (4, 5))


@pytest.mark.parametrize("name,f,args", [
    ("add", lambda a, b: a + b, (X, ROW)),
    ("subtract", lambda a, b: a - b, (X, Y)),
    ("multiply", lambda a, b: a * b, (X, ROW)),
    ("divide", lambda a, b: a / b, (X, POS)),
    ("power", lambda a, b: a ** b, (POS, X)),
    ("power_int", lambda a: a ** 3, (X,)),
    ("scalar_ops", lambda a: 2.0 * a - 1 / (a * a + 1) + 3, (X,)),
    ("maximum", lambda a, b: ops.maximum(a, b), (X, Y)),
    ("minimum", lambda a, b: ops.minimum(a, b), (X, ROW)),
    ("where", lambda a, b: ops.where(fluxpy.value_of(a) > 0, a, b), (X, Y)),
    ("exp_log", lambda a: ops.log(a) + ops.exp(a), (POS,)),
    ("sqrt_tanh_abs", lambda a, b: ops.sqrt(a) * ops.tanh(b) + ops.abs(b), (POS, X)),
    ("sin_cos_log1p_expm1_square", lambda a: ops.sin(a) * ops.cos(a) + ops.log1p(a) + ops.expm1(a) +
     ops.square(a), (POS,)),
    ("sum_axes", lambda a: ops.sum(a, axis=0) + ops.sum(a, axis=1, keepdims=True).sum(), (X,)),
    ("mean_max_min", lambda a: ops.mean(a, axis=1) * ops.max(a, axis=1) + ops.min(a), (X,)),
    ("getitem_slices", lambda a: a[1:3, ::2], (X,)),
    ("getitem_repeated", lambda a, i: a[i], (X, np.array([0, 0, 3, 1, 0]))),
    ("getitem_repeated_2d", lambda a, i: a[i, 1:4], (X, np.array([[2, 2], [0, 2]]))),
    ("getitem_mask", lambda a: a[fluxpy.value_of(a) > 0], (X,)),
    ("matmul", lambda a, b: a @ b, (X, rng.standard_normal((5, 3)))),
    ("matmul_batched_vec", lambda a, b: ops.matmul(a, b), (rng.standard_normal((2, 4, 5)), ROW)),
    ("concatenate_stack", lambda a, b: ops.stack([ops.concatenate([a, b], axis=1), ops.concatenate([b, a], 1)]),
     (X, Y)),
    ("reshape_transpose", lambda a: ops.transpose(ops.reshape(a, (2, 10))) * 2, (X,)),
    ("softmax", lambda a: softmax(a), (X,)),
    ("logsoftmax_axis0", lambda a: logsoftmax(a, axis=0), (X,)),
    ("broadcast_to", lambda a: ops.broadcast_to(a, (3, 5)), (ROW,)),
])
def test_op_matches_cpu(name, f, args):
    check(f, *args)


@pytest.mark.parametrize("act", ["identity", "relu", "leakyrelu", "relu6", "elu", "gelu", "swish", "sigmoid", "tanh",
                                 "softplus", "hardtanh"])
def test_activation_and_bias_act(act):
    fn = getattr(A, act)
    z = rng.standard_normal((6, 7)) * 3
    z[np.abs(z) < 1e-2] = 0.5
    check(fn, z)
    for xs, bs in [((8, 3, 5, 5), (1, 3, 1, 1)), ((16, 10), (10,))]:
        x = rng.standard_normal(xs)
        b = rng.standard_normal(bs)
        if act in ("relu", "leakyrelu", "relu6", "hardtanh"):
            v = x + b
            x = np.where(np.abs(v) < 1e-2, x + 0.1, x)
        check(lambda x, b: bias_act(x, b, fn), x, b)
        check(lambda x: bias_act(x, None, fn), x)


def test_bias_act_bias_gradient_in_either_layout_matches_the_cpu():
    """bias_act's gradients through the op, for C-order and channels-last ``x``, against float64 on the CPU (both
    paths of the kernel, one pass or ``dx`` then ``db``, are compared directly in test_elementwise.py)."""
    import cupy as cp
    from fluxpy.layout import to_channels_last
    x = rng.standard_normal((32, 16, 7, 7))
    b = rng.standard_normal((1, 16, 1, 1))

    def f(x, b):
        return (bias_act(x, b, A.tanh) * x).sum()
    want = fluxpy.gradient(f, x, b)
    for layout in (cp.asarray, to_channels_last):
        got = fluxpy.gradient(f, layout(cp.asarray(x.astype(np.float32))), cp.asarray(b.astype(np.float32)))
        for a, c in zip(got, want):
            np.testing.assert_allclose(cp.asnumpy(a), c, rtol=1e-4, atol=1e-4)


def test_dropout_with_a_fixed_mask_and_on_the_gpu():
    import cupy as cp
    x = rng.standard_normal((6, 8))
    mask = dropout_mask(x, 0.3, rng=np.random.default_rng(0))
    check(lambda x, m: x * m, x, mask, wrt=(0,))
    xg = cp.asarray(x.astype(np.float32))
    y = dropout(xg, 0.5, rng=cp.random.default_rng(1))
    g, = fluxpy.gradient(lambda x: dropout(x, 0.5, rng=cp.random.default_rng(1)).sum(), xg)
    assert isinstance(y, cp.ndarray) and set(np.unique(cp.asnumpy(g)).tolist()) <= {0.0, 2.0}
    np.testing.assert_array_equal(cp.asnumpy(y) != 0, cp.asnumpy(g) != 0)


def test_norms():
    x = rng.standard_normal((6, 3, 4, 4))
    gam, bet = rng.standard_normal(3), rng.standard_normal(3)
    check(lambda x: normalise(x, axis=(1, 2)), x)
    check(lambda x, g, b: batchnorm_train(x, g, b)[0], x, gam, bet)
    check(lambda x, g, b, m, v: batchnorm_infer(x, g, b, m, v), x, gam, bet, rng.standard_normal(3),
          rng.uniform(0.5, 2, 3))
    check(lambda x, g, b: layernorm(x, g, b, axes=(-2, -1)), x, rng.standard_normal((4, 4)), rng.standard_normal(4))


def test_losses():
    yhat = rng.standard_normal((8, 5))
    onehot = np.eye(5)[rng.integers(0, 5, 8)]
    prob = np.exp(yhat) / np.exp(yhat).sum(1, keepdims=True)
    target = rng.uniform(0.1, 0.9, (8, 5))
    check(lambda a, b: L.mse(a, b), yhat, target)
    check(lambda a, b: L.mae(a, b), yhat, target)
    check(lambda a, b: L.huber_loss(a, b, delta=0.5), yhat, target)
    check(lambda a, t: L.logitcrossentropy(a, t), yhat, onehot, wrt=(0,))
    check(lambda p, t: L.crossentropy(p, t), prob, onehot, wrt=(0,))
    check(lambda p, t: L.kldivergence(p, t), prob, target / target.sum(1, keepdims=True), dtypes=(np.float64,))
    check(lambda a, t: L.logitbinarycrossentropy(a, t), yhat, target, wrt=(0,))
    check(lambda p, t: L.binarycrossentropy(p, t), target[::-1].copy(), target, wrt=(0,))


def test_mixing_cpu_and_gpu_arrays_is_an_error_naming_both():
    import cupy as cp
    with pytest.raises(TypeError, match="numpy|cupy"):
        ops.add(np.ones(3), cp.ones(3))
    with pytest.raises(TypeError, match="numpy.*cupy|cupy.*numpy"):
        fluxpy.broadcast(lambda a, b: a * b, cp.ones(3), np.ones(3))
    with pytest.raises(TypeError, match="numpy.*cupy|cupy.*numpy"):
        fluxpy.get_array_module(np.ones(3), cp.ones(3))


def _mlp(dtype, seed=0):
    from fluxpy.layers import Chain, Dense
    r = np.random.default_rng(seed)
    m = Chain(Dense(20, 32, A.relu, rng=r), Dense(32, 16, A.gelu, rng=r), Dense(16, 10, rng=r))
    return fluxpy.fmap(lambda a: a.astype(dtype) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a, m)


def test_mlp_gradient_matches_cpu():
    import cupy as cp
    r = np.random.default_rng(1)
    x = r.standard_normal((64, 20))
    y = np.eye(10)[r.integers(0, 10, 64)]
    m64 = _mlp(np.float64)
    l0, g0 = fluxpy.withgradient(lambda m: L.logitcrossentropy(m(x), y), m64)
    mg = fluxpy.gpu(m64)
    l1, g1 = fluxpy.withgradient(lambda m: L.logitcrossentropy(m(cp.asarray(x)), cp.asarray(y)), mg)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-12)
    leaves0, leaves1 = [], []
    fluxpy.fmap(lambda a: leaves0.append(a) or a, g0[0])
    fluxpy.fmap(lambda a: leaves1.append(a) or a, g1[0])
    assert len(leaves0) == len(leaves1) >= 6
    for a, c in zip(leaves1, leaves0):
        if c is None:
            continue
        assert isinstance(a, cp.ndarray)
        np.testing.assert_allclose(cp.asnumpy(a), c, rtol=1e-9, atol=1e-12)


def test_training_step_has_no_hidden_synchronisation():
    import cupy as cp
    import cupyx
    from fluxpy import optimise as O
    r = np.random.default_rng(2)
    model = fluxpy.gpu(_mlp(np.float32))
    x = cp.asarray(r.standard_normal((128, 20)).astype(np.float32))
    y = cp.asarray(np.eye(10, dtype=np.float32)[r.integers(0, 10, 128)])
    state = O.setup(O.Adam(1e-3), model)

    def step():
        loss, (g,) = fluxpy.withgradient(lambda m: L.logitcrossentropy(m(x), y), model)
        O.update(state, model, g)
        return loss
    first = step()   # compiles kernels (outside the check)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # CuPy 14 notes that allow_synchronize is deprecated
        with cupyx.allow_synchronize(False):
            for _ in range(3):
                loss = step()
    assert float(loss) < float(first) + 1.0



def test_finite_differences_on_cupy_float64():
    """check_grad takes CuPy arrays: the GPU kernels' gradients against float64 finite differences."""
    import cupy as cp
    from gradcheck import check_grad
    r = np.random.default_rng(11)
    x, b = cp.asarray(r.standard_normal((5, 4))), cp.asarray(r.standard_normal(4))
    check_grad(lambda x, b: bias_act(x, b, A.tanh), x, b, rng=r)
    check_grad(lambda x, b: fluxpy.broadcast(lambda u, v: np.exp(u) * v, x, b), x, b, rng=r)
    check_grad(lambda x: logsoftmax(x), x, rng=r)
