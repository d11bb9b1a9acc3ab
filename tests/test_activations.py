"""Activations (directly, through broadcast's dual numbers, through bias_act) and bias_act's two rule paths."""
import functools
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import broadcast
from fluxpy.ops import activations as A
from fluxpy.ops.bias_act import bias_act
from gradcheck import check_grad, check_second_order
from strategies import shapes

seeds = st.integers(0, 2**31 - 1)

# name -> (function, kinks where the derivative jumps)
ACTIVATIONS = {
    "identity": (A.identity, ()),
    "relu": (A.relu, (0.0,)),
    "leakyrelu": (A.leakyrelu, (0.0,)),
    "leakyrelu_0.2": (functools.partial(A.leakyrelu, a=0.2), (0.0,)),
    "relu6": (A.relu6, (0.0, 6.0)),
    "elu": (A.elu, (0.0,)),
    "elu_0.5": (functools.partial(A.elu, a=0.5), (0.0,)),
    "gelu": (A.gelu, ()),
    "swish": (A.swish, ()),
    "sigmoid": (A.sigmoid, ()),
    "tanh": (A.tanh, ()),
    "softplus": (A.softplus, ()),
    "hardtanh": (A.hardtanh, (-1.0, 1.0)),
}
SMOOTH = [n for n, (_, kinks) in ACTIVATIONS.items() if not kinks]
OUTPUT_RULE = ["identity", "relu", "tanh", "sigmoid"]


def away_from(z, kinks, gap=0.05):
    """``z`` with entries within ``gap`` of a kink moved to ``gap`` from it (finite differences stay on one side)."""
    for k in kinks:
        near = np.abs(z - k) < gap
        z = np.where(near, k + np.where(z >= k, gap, -gap), z)
    return z


def inputs(rng, shape, kinks):
    return away_from(3.0 * rng.standard_normal(shape), kinks)


@st.composite
def shape_and_bias_shape(draw):
    """An x shape and a bias shape that broadcasts to it: dropped leading axes and size-1 axes."""
    full = draw(shapes(1, 4))
    drop = draw(st.integers(0, len(full)))
    return full, tuple(1 if draw(st.booleans()) else s for s in full[drop:])


def torch_reference(name):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    return {
        "identity": lambda t: t, "relu": F.relu, "leakyrelu": lambda t: F.leaky_relu(t, 0.01),
        "leakyrelu_0.2": lambda t: F.leaky_relu(t, 0.2), "relu6": F.relu6, "elu": F.elu,
        "elu_0.5": lambda t: F.elu(t, 0.5), "gelu": lambda t: F.gelu(t, approximate="tanh"), "swish": F.silu,
        "sigmoid": torch.sigmoid, "tanh": torch.tanh, "softplus": F.softplus, "hardtanh": F.hardtanh,
    }[name]


# ---------------------------------------------------------------------------------------------
# Activations on their own


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_values_and_gradients_match_torch(name):
    torch = pytest.importorskip("torch")
    f, kinks = ACTIVATIONS[name]
    x = inputs(np.random.default_rng(0), (7, 5), kinks)
    t = torch.tensor(x, requires_grad=True)
    ty = torch_reference(name)(t)
    ty.sum().backward()
    np.testing.assert_allclose(f(x), ty.detach().numpy(), rtol=1e-12, atol=1e-14)
    g, = fluxpy.gradient(lambda x: f(x).sum(), x)
    np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@given(shape=shapes(0, 3), seed=seeds)
def test_gradient_directly_and_through_broadcast(name, shape, seed):
    f, kinks = ACTIVATIONS[name]
    rng = np.random.default_rng(seed)
    x = inputs(rng, shape, kinks)
    np.testing.assert_allclose(broadcast(f, x), f(x), rtol=1e-15)
    g_direct = check_grad(f, x, rng=rng)[0]
    g_dual = check_grad(lambda x: broadcast(f, x), x, rng=rng)[0]
    if shape:
        assert g_direct.shape == g_dual.shape == shape


@pytest.mark.filterwarnings("ignore:gradient.*does not depend on its arguments")   # identity, relu: f'' == 0
@pytest.mark.parametrize("name", SMOOTH)
def test_second_derivatives(name):
    f, _ = ACTIVATIONS[name]
    x = inputs(np.random.default_rng(1), (3, 4), ())
    check_second_order(f, x, rtol=1e-5)
    check_second_order(lambda x: broadcast(f, x), x, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtype_is_kept(name, dtype):
    f, _ = ACTIVATIONS[name]
    x = np.linspace(-8, 8, 9, dtype=dtype)
    assert f(x).dtype == dtype
    assert fluxpy.gradient(lambda x: f(x).sum(), x)[0].dtype == dtype


@pytest.mark.parametrize("name", ["sigmoid", "softplus", "elu", "swish", "gelu", "tanh"])
def test_no_overflow_for_huge_inputs(name):
    f, _ = ACTIVATIONS[name]
    x = np.array([-1e4, -800.0, 0.0, 800.0, 1e4], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            y = f(x)
            g, = fluxpy.gradient(lambda x: f(x).sum(), x)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(g))


def test_known_values():
    x = np.array([-1000.0, -1.0, 0.0, 1.0, 1000.0])
    np.testing.assert_allclose(A.sigmoid(x), [0.0, 0.2689414213699951, 0.5, 0.7310585786300049, 1.0])
    np.testing.assert_allclose(A.softplus(x), [0.0, np.log1p(np.exp(-1.0)), np.log(2.0), 1 + np.log1p(np.exp(-1.0)),
                                               1000.0])
    assert A.sigmoid(np.array(-40.0)) == pytest.approx(np.exp(-40.0), rel=1e-12)  # no cancellation
    np.testing.assert_allclose(A.relu6(np.array([-1.0, 7.0])), [0.0, 6.0])
    np.testing.assert_allclose(A.hardtanh(np.array([-2.0, 2.0])), [-1.0, 1.0])


def test_derivatives_at_kinks_follow_nnlib():
    zero = np.zeros(1)
    for f, expected in ((A.relu, 0.0), (A.leakyrelu, 0.01), (A.elu, 1.0), (A.sigmoid, 0.25), (A.softplus, 0.5)):
        assert fluxpy.gradient(lambda x: f(x).sum(), zero)[0][0] == pytest.approx(expected)
        assert fluxpy.gradient(lambda x: broadcast(f, x).sum(), zero)[0][0] == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------
# bias_act


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@given(shapes_=shape_and_bias_shape(), seed=seeds)
def test_bias_act_gradients(name, shapes_, seed):
    f, kinks = ACTIVATIONS[name]
    xshape, bshape = shapes_
    rng = np.random.default_rng(seed)
    b = rng.standard_normal(bshape)
    x = inputs(rng, xshape, kinks) - b  # x + b stays away from the kinks
    np.testing.assert_allclose(bias_act(x, b, f), f(x + b), rtol=1e-14, atol=1e-14)
    gx, gb = check_grad(lambda x, b: bias_act(x, b, f), x, b, rng=rng)
    assert gx.shape == xshape and gb.shape == bshape


@pytest.mark.parametrize("name", OUTPUT_RULE)
def test_output_rule_agrees_with_the_generic_rule(name):
    f, kinks = ACTIVATIONS[name]
    rng = np.random.default_rng(2)
    x, b = inputs(rng, (4, 3, 2, 2), kinks), rng.standard_normal((1, 3, 1, 1))
    generic = lambda z: f(z)  # not recognised, so differentiated with dual numbers  # noqa: E731
    loss = lambda act: lambda x, b: (bias_act(x, b, act) * np.arange(48.0).reshape(x.shape)).sum()  # noqa: E731
    fast, slow = fluxpy.gradient(loss(f), x, b), fluxpy.gradient(loss(generic), x, b)
    for a, c in zip(fast, slow):
        np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-12)


def test_output_rule_keeps_only_the_output():
    x, b = np.array([[-1.0, 2.0]]), np.array([0.5, -0.5])

    def f(x, b):
        y = bias_act(x, b, A.tanh)
        cells = [c.cell_contents for c in y.node.pullback.__closure__]
        assert not any(c is x.value for c in cells if isinstance(c, np.ndarray))
        return y.sum()
    fluxpy.gradient(f, x, b)


@pytest.mark.filterwarnings("ignore:gradient.*does not depend on its arguments")   # identity, relu: f'' == 0
@pytest.mark.parametrize("name", ["identity", "tanh", "sigmoid", "gelu", "swish", "softplus", "elu_0.5"])
def test_bias_act_second_order(name):
    f, kinks = ACTIVATIONS[name]
    rng = np.random.default_rng(3)
    b = rng.standard_normal(3)
    x = inputs(rng, (2, 3), kinks) - b
    check_second_order(lambda x, b: bias_act(x, b, f), x, b, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:gradient.*does not depend on its arguments")   # identity, relu: f'' == 0
def test_bias_act_relu_second_order_is_zero():
    x, b = np.array([[-1.0, 2.0], [3.0, -0.5]]), np.array([0.25, 0.75])
    check_second_order(lambda x, b: bias_act(x, b, A.relu), x, b)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_bias_act_keeps_float32(name):
    f, _ = ACTIVATIONS[name]
    x = np.linspace(-3, 7, 12, dtype=np.float32).reshape(4, 3)
    b = np.array([0.1, -0.2, 0.3], dtype=np.float32)
    y = bias_act(x, b, f)
    gx, gb = fluxpy.gradient(lambda x, b: bias_act(x, b, f).sum(), x, b)
    assert y.dtype == gx.dtype == gb.dtype == np.float32


def test_bias_act_without_bias_and_numpy_tanh():
    x = np.array([[-1.0, 0.5]])
    for b in (None, False):
        np.testing.assert_allclose(bias_act(x, b, np.tanh), np.tanh(x))
        gx, = check_grad(lambda x: bias_act(x, b, np.tanh), x)
    g, = fluxpy.gradient(lambda x: bias_act(x, None, fluxpy.tanh).sum(), x)
    np.testing.assert_allclose(g, 1 - np.tanh(x) ** 2)
    assert bias_act(x, None) is x
    np.testing.assert_allclose(bias_act(x, np.ones(2), None), x + 1)


def test_bias_act_dense_and_conv_usage():
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((5, 3)), rng.standard_normal((4, 3)), rng.standard_normal(4)
    check_grad(lambda x, w, b: bias_act(x @ w.T, b, A.relu), x, w, b)
    y, b4 = rng.standard_normal((2, 4, 3, 3)), rng.standard_normal(4)
    check_grad(lambda y, b: bias_act(y, fluxpy.reshape(b, (1, 4, 1, 1)), A.sigmoid), y, b4)


def test_bias_act_shape_errors():
    with pytest.raises(ValueError, match=r"bias_act: the bias of shape \(3,\) must broadcast to x of shape \(2, 4\)"):
        bias_act(np.ones((2, 4)), np.ones(3), A.relu)
    with pytest.raises(ValueError, match=r"bias of shape \(2, 4\) must broadcast to x of shape \(4,\)"):
        bias_act(np.ones(4), np.ones((2, 4)))


def _tape_nodes(f, x):
    """How many nodes the tape holds for ``f(x)``."""
    count = []

    def g(x):
        y = f(x)
        seen, stack = set(), [y.node]
        while stack:
            n = stack.pop()
            if n.pullback is not None and id(n) not in seen:
                seen.add(id(n))
                stack.extend(p for p in n.parents if p is not None)
        count.append(len(seen))
        return y.sum()
    fluxpy.gradient(g, x)
    return count[0]


@pytest.mark.parametrize("name", sorted(set(A.__all__) - {"identity", "relu", "tanh", "rrelu"}))
def test_an_activation_alone_on_a_tracked_array_is_one_node_equal_to_its_definition(name):
    act = getattr(A, name)
    rng = np.random.default_rng(len(name))
    x = away_from(rng.standard_normal((3, 4)) * 2, (-1.0, 0.0, 1.0, 6.0, 0.5, -0.5))
    assert _tape_nodes(act, x) == 1 <= _tape_nodes(act.__wrapped__, x)
    (got,) = fluxpy.gradient(lambda x: (act(x) * x).sum(), x)
    (want,) = fluxpy.gradient(lambda x: (act.__wrapped__(x) * x).sum(), x)   # the definition, a node per ufunc
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(act(x), act.__wrapped__(x))


def test_an_activation_called_with_keywords_runs_its_definition():
    x = np.array([-1.0, 2.0])
    assert _tape_nodes(lambda x: A.leakyrelu(x, a=0.2), x) == _tape_nodes(A.leakyrelu.__wrapped__, x) > 1
    (g,) = fluxpy.gradient(lambda x: A.leakyrelu(x, a=0.2).sum(), x)
    np.testing.assert_array_equal(g, [0.2, 1.0])
