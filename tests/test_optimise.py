"""Optimisers: Optimisers.jl's formulas written out, torch.optim agreement, the state tree, errors."""
import collections
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import layer
from fluxpy.optimise import (Adam, AdamW, ClipGrad, ClipNorm, Descent, Leaf, Momentum, Nesterov, OptimiserChain,
                             RMSProp, WeightDecay, adjust, freeze, setup, thaw, update)
from strategies import shapes

seeds = st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------------------------------------
# Optimisers.jl's apply! for each rule, written out for one array: (state, x, dx) -> (state, step)

def ref_init(rule, x):
    z = np.zeros_like(x)
    if isinstance(rule, (Momentum, Nesterov)):
        return z
    if isinstance(rule, RMSProp):
        return z, z
    if isinstance(rule, (Adam, AdamW)):
        return z, z, rule.beta
    return None


def ref_apply(rule, s, x, dx):
    t = type(rule)
    if t is Descent:
        return s, rule.eta * dx
    if t is Momentum:
        v = rule.rho * s + rule.eta * dx
        return v, v
    if t is Nesterov:  # newdx = -ρ² vel + (1+ρ) η dx; vel = ρ vel - η dx
        return rule.rho * s - rule.eta * dx, -rule.rho ** 2 * s + (1 + rule.rho) * rule.eta * dx
    if t is RMSProp:
        quad = rule.rho * s[0] + (1 - rule.rho) * dx ** 2
        lin = rule.rho * s[1] + (1 - rule.rho) * dx if rule.centred else s[1]
        return (quad, lin), dx * rule.eta / (np.sqrt(quad - lin ** 2) + rule.eps)
    if t in (Adam, AdamW):
        (b1, b2), (b1t, b2t) = rule.beta, s[2]
        m = b1 * s[0] + (1 - b1) * dx
        v = b2 * s[1] + (1 - b2) * dx ** 2
        step = m / (1 - b1t) / (np.sqrt(v / (1 - b2t)) + rule.eps) * rule.eta
        if t is AdamW:  # OptimiserChain(Adam(η), WeightDecay(η λ))
            step = step + rule.eta * rule.lambd * x
        return (m, v, (b1t * b1, b2t * b2)), step
    if t is WeightDecay:
        return s, dx + rule.lambd * x
    if t is ClipGrad:
        return s, np.clip(dx, -rule.delta, rule.delta)
    if t is ClipNorm:
        norm = np.linalg.norm(dx.ravel(), rule.p)
        return s, dx * min(rule.omega / norm, 1.0)
    raise AssertionError(t)


RULES = {
    "descent": Descent(0.05),
    "momentum": Momentum(0.02, 0.8),
    "nesterov": Nesterov(0.03, 0.7),
    "rmsprop": RMSProp(0.01, 0.85, 1e-6),
    "rmsprop_centred": RMSProp(0.01, 0.85, 1e-6, centred=True),
    "adam": Adam(0.01, (0.8, 0.95), 1e-7),
    "adamw": AdamW(0.01, (0.8, 0.95), 0.1, 1e-7),
    "weightdecay": WeightDecay(0.3),
    "clipgrad": ClipGrad(0.5),
    "clipnorm": ClipNorm(1.5),
    "clipnorm_1": ClipNorm(1.5, p=1),
    "clipnorm_inf": ClipNorm(0.5, p=math.inf),
}


@pytest.mark.parametrize("name", sorted(RULES))
@given(shape_list=st.lists(shapes(0, 3), min_size=1, max_size=3), steps=st.integers(1, 4), seed=seeds)
def test_rules_follow_the_optimisers_jl_formulas(name, shape_list, steps, seed):
    rule = RULES[name]
    rng = np.random.default_rng(seed)
    model = [np.asarray(rng.standard_normal(s)) for s in shape_list]
    expected = [w.copy() for w in model]
    ref_states = [ref_init(rule, w) for w in expected]
    state = setup(rule, model)
    for _ in range(steps):
        grad = [3 * rng.standard_normal(s) for s in shape_list]
        state, model = update(state, model, grad)
        for i, (w, g) in enumerate(zip(expected, grad)):
            ref_states[i], step = ref_apply(rule, ref_states[i], w, g)
            expected[i] = w - step
    for w, e in zip(model, expected):
        np.testing.assert_allclose(w, e, rtol=1e-12, atol=1e-14)


@given(seed=seeds, steps=st.integers(1, 4))
def test_chains_apply_rules_in_order(seed, steps):
    rules = (ClipGrad(1.0), WeightDecay(0.1), Momentum(0.1, 0.5))
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(5)
    expected, states = w.copy(), [ref_init(r, w) for r in rules]
    state = setup(OptimiserChain(*rules), w)
    for _ in range(steps):
        g = 2 * rng.standard_normal(5)
        update(state, w, g)
        step = g
        for i, r in enumerate(rules):
            states[i], step = ref_apply(r, states[i], expected, step)
        expected = expected - step
    np.testing.assert_allclose(w, expected, rtol=1e-12)


def test_adamw_is_adam_chained_with_weight_decay_times_eta():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4)), None
    b = a.copy()
    sa = setup(AdamW(0.01, (0.9, 0.999), 0.2, 1e-8), a)
    sb = setup(OptimiserChain(Adam(0.01, (0.9, 0.999), 1e-8), WeightDecay(0.01 * 0.2)), b)
    for _ in range(5):
        g = rng.standard_normal((3, 4))
        update(sa, a, g)
        update(sb, b, g)
    np.testing.assert_allclose(a, b, rtol=1e-13)


# ---------------------------------------------------------------------------------------------
# torch.optim, float64


def run_torch(make_opt, params, grads):
    torch = pytest.importorskip("torch")
    ps = [torch.tensor(p.copy(), requires_grad=True) for p in params]
    opt = make_opt(ps)
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = torch.tensor(g)
        opt.step()
    return [p.detach().numpy() for p in ps]


def run_ours(rule, params, grads):
    model = {"w": params[0].copy(), "b": params[1].copy()}
    state = setup(rule, model)
    for g in grads:
        state, model = update(state, model, {"w": g[0], "b": g[1]})
    return [model["w"], model["b"]]


TORCH_CASES = {
    # Optimisers.jl's Momentum keeps v = eta * (torch's buffer): the same steps for a fixed eta.
    "sgd": (Descent(0.1), lambda o, ps: o.SGD(ps, lr=0.1)),
    "momentum": (Momentum(0.05, 0.9), lambda o, ps: o.SGD(ps, lr=0.05, momentum=0.9)),
    # Optimisers.jl's Nesterov (formula above) equals torch's nesterov=True, so both are checked.
    "nesterov": (Nesterov(0.05, 0.8), lambda o, ps: o.SGD(ps, lr=0.05, momentum=0.8, nesterov=True)),
    "weight_decay": (OptimiserChain(WeightDecay(0.01), Descent(0.1)),
                     lambda o, ps: o.SGD(ps, lr=0.1, weight_decay=0.01)),
    # eps outside the square root in both.
    "rmsprop": (RMSProp(0.01, 0.9, 1e-8), lambda o, ps: o.RMSprop(ps, lr=0.01, alpha=0.9, eps=1e-8)),
    "rmsprop_centred": (RMSProp(0.01, 0.9, 1e-8, centred=True),
                        lambda o, ps: o.RMSprop(ps, lr=0.01, alpha=0.9, eps=1e-8, centered=True)),
    "adam": (Adam(0.01, (0.9, 0.99), 1e-8), lambda o, ps: o.Adam(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-8)),
    "adamw": (AdamW(0.01, (0.9, 0.99), 0.05, 1e-8),
              lambda o, ps: o.AdamW(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)),
}


@pytest.mark.parametrize("name", sorted(TORCH_CASES))
def test_matches_torch_optim(name):
    torch = pytest.importorskip("torch")
    rule, make = TORCH_CASES[name]
    rng = np.random.default_rng(1)
    params = [rng.standard_normal((4, 3)), rng.standard_normal(3)]
    grads = [[rng.standard_normal((4, 3)), rng.standard_normal(3)] for _ in range(6)]
    theirs = run_torch(lambda ps: make(torch.optim, ps), params, grads)
    ours = run_ours(rule, params, grads)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)


def test_nesterov_step_by_hand():
    # Optimisers.jl: step = (1+ρ) η g - ρ² v, then v = ρ v - η g.
    w, (eta, rho) = np.zeros(1), (0.1, 0.5)
    st_ = setup(Nesterov(eta, rho), w)
    update(st_, w, np.ones(1))              # step 0.15, v = -0.1
    update(st_, w, np.ones(1))              # step 0.15 + 0.025, v = -0.15
    np.testing.assert_allclose(w, [-0.15 - 0.175])


def test_clipnorm_by_hand_and_non_finite_norms():
    w = np.zeros(2)
    st_ = setup(OptimiserChain(ClipNorm(5.0), Descent(1.0)), w)
    update(st_, w, np.array([3.0, 4.0]))    # norm 5: unchanged
    np.testing.assert_allclose(w, [-3.0, -4.0])
    with pytest.raises(ValueError, match=r"ClipNorm: the gradient has 2-norm inf, for an array of shape \(2,\)"):
        update(st_, w, np.array([np.inf, 0.0]))
    quiet = setup(ClipNorm(1.0, throw=False), np.zeros(1))
    update(quiet, np.zeros(1), np.array([np.nan]))  # no error
    update(setup(ClipNorm(), np.zeros(2)), np.zeros(2), np.zeros(2))  # zero norm


# ---------------------------------------------------------------------------------------------
# The state tree


@layer(trainable=("weight", "bias"))
class Affine:
    def __init__(self, n):
        self.weight = np.ones((n, n))
        self.bias = np.zeros(n)
        self.running = np.zeros(n)
        self.act = np.tanh

    def __call__(self, x):
        return np.tanh(x @ self.weight.T + self.bias)


Pair = collections.namedtuple("Pair", ["first", "second"])


def make_model():
    return {"layers": [Affine(2), Affine(2)], "scale": np.array([2.0]), "steps": np.arange(3), "pair": Pair(
        np.ones(1), (np.ones(2), 4.0))}


def test_setup_mirrors_the_model_with_leaves_at_trainable_arrays():
    st_ = setup(Descent(), make_model())
    assert set(st_) == {"layers", "scale", "steps", "pair"}
    assert isinstance(st_["layers"], list) and len(st_["layers"]) == 2
    assert set(st_["layers"][0]) == {"weight", "bias", "running", "act"}
    assert isinstance(st_["layers"][0]["weight"], Leaf) and st_["layers"][0]["running"] is None
    assert st_["steps"] is None and st_["layers"][0]["act"] is None
    assert isinstance(st_["pair"], tuple) and isinstance(st_["pair"][1][0], Leaf) and st_["pair"][1][1] is None


def test_update_with_gradient_trees_from_fluxpy():
    model = make_model()
    running = model["layers"][0].running
    weight = model["layers"][0].weight
    x = np.array([[0.5, -1.0]])

    def loss(m):
        h = m["layers"][1](m["layers"][0](x)) * m["scale"]
        return (h * h).sum() + (m["layers"][0].running * 3.0).sum() + m["pair"][1][0].sum()
    state = setup(Momentum(0.1), model)
    grad, = fluxpy.gradient(loss, model)
    before = fluxpy.fmap(lambda a: a.copy() if isinstance(a, np.ndarray) else a, model)
    state, new = update(state, model, grad)
    assert new is model and model["layers"][0].weight is weight  # in place
    np.testing.assert_array_equal(running, 0.0)                  # not trainable, though it has a gradient
    np.testing.assert_allclose(model["layers"][0].weight, before["layers"][0].weight - 0.1 *
                               grad["layers"][0]["weight"])
    np.testing.assert_allclose(model["pair"][1][0], before["pair"][1][0] - 0.1)
    np.testing.assert_array_equal(model["pair"][0], 1.0)         # unused: no gradient, no step
    np.testing.assert_array_equal(model["steps"], np.arange(3))


def test_training_reduces_the_loss_and_keeps_float32():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3)[:, None]
    model = {"w": np.zeros((1, 3), np.float32), "b": np.zeros(1, np.float32)}
    loss = lambda m: ((x @ m["w"].T + m["b"] - y) ** 2).mean()  # noqa: E731
    state = setup(OptimiserChain(ClipGrad(10.0), Adam(0.05)), model)
    first = float(loss(model))
    for _ in range(200):
        grad, = fluxpy.gradient(loss, model)
        state, model = update(state, model, grad)
    assert float(loss(model)) < 1e-3 * first
    assert model["w"].dtype == model["b"].dtype == np.float32
    assert state["w"].state[1][0].dtype == np.float32


def test_tied_weights_share_one_leaf_and_step_once():
    w = np.array([1.0, 2.0])
    model = {"enc": w, "dec": w}
    state = setup(Momentum(0.1, 0.0), model)
    assert state["enc"] is state["dec"]
    grad, = fluxpy.gradient(lambda m: (m["enc"] * m["dec"]).sum(), model)  # total gradient 2w at both
    update(state, model, grad)
    np.testing.assert_allclose(w, [0.8, 1.6])


def test_none_gradients_are_skipped():
    model = [np.ones(2), {"a": np.ones(1)}]
    state = setup(Descent(1.0), model)
    update(state, model, None)
    update(state, model, [None, {"a": None}])
    update(state, model, [np.ones(2), None])
    np.testing.assert_array_equal(model[0], 0.0)
    np.testing.assert_array_equal(model[1]["a"], 1.0)


def test_freeze_and_thaw():
    model = {"enc": [np.ones(2)], "dec": np.ones(2)}
    state = setup(Descent(0.5), model)
    grad = {"enc": [np.ones(2)], "dec": np.ones(2)}
    freeze(state["enc"])
    update(state, model, grad)
    np.testing.assert_array_equal(model["enc"][0], 1.0)
    np.testing.assert_array_equal(model["dec"], 0.5)
    thaw(state)
    update(state, model, grad)
    np.testing.assert_array_equal(model["enc"][0], 0.5)
    assert "frozen" in repr(freeze(state)["dec"])


def test_adjust_learning_rate_and_other_fields():
    model = {"w": np.zeros(1), "v": np.zeros(1)}
    state = setup(OptimiserChain(WeightDecay(0.0), Momentum(0.1, 0.9)), model)
    update(state, model, {"w": np.ones(1), "v": np.ones(1)})   # v = 0.1
    adjust(state, 0.01)
    update(state, model, {"w": np.ones(1), "v": np.ones(1)})   # v = 0.09 + 0.01
    np.testing.assert_allclose(model["w"], [-0.2])
    adjust(state, rho=0.0, lambd=1.0)
    assert state["w"].rule == OptimiserChain(WeightDecay(1.0), Momentum(0.01, 0.0))
    adjust(state["v"], 1.0)
    assert state["w"].rule.rules[1].eta == 0.01 and state["v"].rule.rules[1].eta == 1.0
    with pytest.raises(ValueError, match=r"adjust: no rule in the state tree has \['beta'\]"):
        adjust(state, beta=(0.8, 0.9))
    with pytest.raises(ValueError, match="adjust: give a learning rate"):
        adjust(state)


def test_adjust_keeps_the_moments():
    w = np.zeros(3)
    state = setup(Adam(0.1), w)
    update(state, w, np.ones(3))
    m = state.state[0].copy()
    adjust(state, 0.5)
    assert state.rule == Adam(0.5) and np.array_equal(state.state[0], m)


def test_errors_name_the_path():
    model = make_model()
    state = setup(Adam(), model)
    grad, = fluxpy.gradient(lambda m: m["scale"].sum(), model)
    bad = dict(grad, scale=np.ones(3))
    with pytest.raises(ValueError, match=r"update: the gradient for model\.scale should be an array of shape \(1,\), "
                                         r"got an array of shape \(3,\)"):
        update(state, model, bad)
    bad = dict(grad, layers=[grad["layers"][0]])
    with pytest.raises(ValueError, match=r"model\.layers is a list of 2, so its gradient should be a tuple or list "
                                         r"of 2, got a list of 1"):
        update(state, model, bad)
    bad = dict(grad, layers=[{"weight": None, "bias": None, "running": None, "act": None, "extra": 1},
                             grad["layers"][1]])
    with pytest.raises(ValueError, match=r"gradient for model\.layers\[0\] has fields \['extra'\] that a Affine"):
        update(state, model, bad)
    with pytest.raises(ValueError, match=r"pass gradient\(f, model\)\[0\], not the whole tuple"):
        update(state, model, (grad,))
    with pytest.raises(TypeError, match="setup expects optimisation rules such as Adam"):
        setup("adam", model)
    with pytest.raises(TypeError, match="OptimiserChain expects optimisation rules"):
        OptimiserChain(Adam(), 0.1)


def test_reprs():
    assert repr(Adam()) == "Adam(eta=0.001, beta=(0.9, 0.999), eps=1e-08)"
    assert repr(OptimiserChain(WeightDecay(), Descent())) == "OptimiserChain(WeightDecay(lambd=0.0005), " \
                                                             "Descent(eta=0.1))"
    assert repr(RMSProp()) == "RMSProp(eta=0.001, rho=0.9, eps=1e-08, centred=False)"
