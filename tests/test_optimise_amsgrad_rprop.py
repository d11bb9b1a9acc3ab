"""AMSGrad and Rprop against Optimisers.jl's ``apply!`` written out in NumPy (several steps, float64), against
PyTorch's ``Adam(amsgrad=True)`` and ``Rprop`` where their docstrings say how they relate; and different rules for
different parts of one model in one state (``setup(f, model)``, Optimisers.jl's)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import optimise as O
from strategies import shapes

seeds = st.integers(0, 2**31 - 1)


def run(rule, x, dxs):
    """``x`` after one update per gradient in ``dxs``, and the state."""
    x = x.copy()
    state = O.setup(rule, x)
    for dx in dxs:
        state, x = O.update(state, x, dx)
    return x, state


def gradients(rng, shape, steps, zeros=0.0):
    """Random gradients, some entries exactly zero (Rprop's third case) and some sign flips."""
    dxs = rng.standard_normal((steps, *shape))
    dxs[rng.random(dxs.shape) < zeros] = 0.0
    return list(dxs)


# -- Optimisers.jl's apply!, written out ------------------------------------------------------------------------

def amsgrad_jl(x, dxs, eta=0.001, beta=(0.9, 0.999), eps=1e-8):
    x, m, v, vhat = x.copy(), np.full_like(x, eps), np.full_like(x, eps), np.full_like(x, eps)
    for dx in dxs:
        m = beta[0] * m + (1 - beta[0]) * dx
        v = beta[1] * v + (1 - beta[1]) * dx ** 2
        vhat = np.maximum(vhat, v)
        x = x - eta * m / (np.sqrt(vhat) + eps)
    return x, (m, v, vhat)


def rprop_jl(x, dxs, eta=0.001, ell=(0.5, 1.2), gamma=(1e-6, 50.0)):
    x, g, size = x.copy(), np.zeros_like(x), np.full_like(x, eta)
    for dx in dxs:
        p = g * dx
        size = np.where(p > 0, np.minimum(size * ell[1], gamma[1]),
                        np.where(p < 0, np.maximum(size * ell[0], gamma[0]), size))
        g = np.where(p < 0, 0.0, dx)
        x = x - size * np.sign(g)
    return x, (g, size)


# -- PyTorch's single-tensor steps, written out -----------------------------------------------------------------

def amsgrad_torch(x, dxs, lr=0.001, betas=(0.9, 0.999), eps=1e-8):
    """``torch.optim.Adam(amsgrad=True)``: moments from zero, bias-corrected, the maximum of the raw ``v``."""
    x, m, v, vmax, out = x.copy(), np.zeros_like(x), np.zeros_like(x), np.zeros_like(x), []
    for t, dx in enumerate(dxs, start=1):
        m = m + (dx - m) * (1 - betas[0])
        v = v * betas[1] + (1 - betas[1]) * dx * dx
        vmax = np.maximum(vmax, v)
        denom = np.sqrt(vmax) / np.sqrt(1 - betas[1] ** t) + eps
        x = x - lr / (1 - betas[0] ** t) * m / denom
        out.append(x)
    return out


def rprop_torch(x, dxs, lr=0.01, etas=(0.5, 1.2), step_sizes=(1e-6, 50.0)):
    """``torch.optim.Rprop``'s step: the factor of each sign, a clamp, no step after a sign change."""
    x, prev, size = x.copy(), np.zeros_like(x), np.full_like(x, lr)
    for dx in dxs:
        s = np.sign(dx * prev)
        factor = np.where(s > 0, etas[1], np.where(s < 0, etas[0], 1.0))
        size = np.clip(size * factor, *step_sizes)
        dx = np.where(factor == etas[0], 0.0, dx)
        x = x - np.sign(dx) * size
        prev = dx
    return x


# -- AMSGrad ----------------------------------------------------------------------------------------------------

@settings(deadline=None, max_examples=30)
@given(shape=shapes(0, 3, 1, 5), seed=seeds, steps=st.integers(1, 8),
       hyper=st.sampled_from([{}, {"eta": 0.1}, {"eta": 0.01, "beta": (0.8, 0.95), "eps": 1e-6}]))
def test_amsgrad_is_optimisers_jl(shape, seed, steps, hyper):
    rng = np.random.default_rng(seed)
    x, dxs = rng.standard_normal(shape), gradients(rng, shape, steps)
    got, state = run(O.AMSGrad(**hyper), x, dxs)
    want, moments = amsgrad_jl(x, dxs, **hyper)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)
    for a, b in zip(state.state, moments):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)


def test_amsgrad_state_and_its_denominator_never_shrinking():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(6)
    state = O.setup(O.AMSGrad(0.01), x)
    assert [s.tolist() for s in state.state] == [[1e-8] * 6] * 3   # Optimisers.jl's init: every moment at eps
    last = state.state[2].copy()
    for dx in [5 * rng.standard_normal(6), 1e-3 * rng.standard_normal(6), np.zeros(6)]:
        state, x = O.update(state, x, dx)
        assert np.all(state.state[2] >= last) and np.all(state.state[2] >= state.state[1])
        last = state.state[2].copy()


def test_amsgrad_tends_to_pytorchs_steps_as_its_docstring_says():
    """PyTorch corrects the moments' bias and starts them at zero: its first step is ``lr sign(dx)``, fluxpy's
    (Optimisers.jl's) ``lr (1 - b1) / sqrt(1 - b2) sign(dx)``; once ``b^t`` is negligible the steps agree."""
    rng = np.random.default_rng(1)
    x, dxs = rng.standard_normal(5), gradients(rng, (5,), 300)
    beta = (0.5, 0.9)
    torch_xs = amsgrad_torch(x, dxs, 0.01, beta)
    np.testing.assert_allclose(torch_xs[0] - x, -0.01 * np.sign(dxs[0]), rtol=1e-6)   # up to eps
    ours, _ = run(O.AMSGrad(0.01, beta), x, dxs[:1])
    np.testing.assert_allclose(ours - x, -0.01 * 0.5 / np.sqrt(0.1) * np.sign(dxs[0]), rtol=1e-6)
    before, _ = run(O.AMSGrad(0.01, beta), x, dxs[:-1])
    after, _ = run(O.AMSGrad(0.01, beta), x, dxs)
    np.testing.assert_allclose(after - before, torch_xs[-1] - torch_xs[-2], rtol=1e-6)


# -- Rprop ------------------------------------------------------------------------------------------------------

RPROPS = [{}, {"eta": 0.1}, {"eta": 0.05, "ell": (0.3, 1.5), "gamma": (1e-3, 0.2)},
          {"eta": 1.0, "gamma": (0.01, 0.5)},        # eta above the largest size: Optimisers.jl keeps it until it grows
          {"eta": 1e-8, "ell": (0.9, 2.0)}]          # below the smallest


@settings(deadline=None, max_examples=30)
@given(shape=shapes(0, 3, 1, 5), seed=seeds, steps=st.integers(1, 10), zeros=st.sampled_from([0.0, 0.3]),
       hyper=st.sampled_from(RPROPS))
def test_rprop_is_optimisers_jl(shape, seed, steps, zeros, hyper):
    rng = np.random.default_rng(seed)
    x, dxs = rng.standard_normal(shape), gradients(rng, shape, steps, zeros)
    got, state = run(O.Rprop(**hyper), x, dxs)
    want, (prev, size) = rprop_jl(x, dxs, **hyper)
    np.testing.assert_array_equal(got, want)   # the same operations: bit for bit
    np.testing.assert_array_equal(state.state[0], prev)
    np.testing.assert_array_equal(state.state[1], size)


@settings(deadline=None, max_examples=20)
@given(seed=seeds, steps=st.integers(1, 12), eta=st.sampled_from([1e-3, 0.01, 0.3]),
       ell=st.sampled_from([(0.5, 1.2), (0.25, 1.9)]), gamma=st.sampled_from([(1e-6, 50.0), (1e-4, 0.5)]))
def test_rprop_takes_pytorchs_steps_while_eta_lies_within_the_step_sizes(seed, steps, eta, ell, gamma):
    rng = np.random.default_rng(seed)
    x, dxs = rng.standard_normal((4, 3)), gradients(rng, (4, 3), steps, 0.2)
    got, _ = run(O.Rprop(eta, ell, gamma), x, dxs)
    np.testing.assert_array_equal(got, rprop_torch(x, dxs, eta, ell, gamma))


def test_rprop_outside_the_step_sizes_differs_from_pytorch_as_documented():
    x, dx = np.zeros(1), np.ones(1)
    got, state = run(O.Rprop(1.0, gamma=(1e-6, 0.5)), x, [dx])
    assert got.tolist() == [-1.0] and state.state[1].tolist() == [1.0]   # Optimisers.jl: eta kept on the first step
    assert rprop_torch(x, [dx], 1.0, step_sizes=(1e-6, 0.5)).tolist() == [-0.5]   # PyTorch clamps at once
    got, state = run(O.Rprop(1.0, gamma=(1e-6, 0.5)), x, [dx, dx])
    assert state.state[1].tolist() == [0.5]   # then min(1.2, 0.5)


def test_rprop_grows_shrinks_and_skips_a_step_after_a_sign_change():
    x = np.zeros(3)
    state = O.setup(O.Rprop(0.1, (0.5, 2.0), (0.01, 0.3)), x)
    steps = []
    for dx in ([1.0, -1.0, 0.0], [2.0, 3.0, 1.0], [4.0, 5.0, 1.0], [1.0, 1.0, -1.0]):
        before = x.copy()
        state, x = O.update(state, x, np.array(dx))
        steps.append((before - x).round(12).tolist())
    assert steps == [[0.1, -0.1, 0.0],     # the first step: eta times the sign (zero where dx is zero)
                     [0.2, 0.0, 0.1],      # grown; flipped (no step, size halved); was zero (size kept)
                     [0.3, 0.05, 0.2],     # grown up to the largest size; after the flip: kept; grown
                     [0.3, 0.1, 0.0]]      # capped; grown; flipped
    assert state.state[1].round(12).tolist() == [0.3, 0.1, 0.1]


@pytest.mark.parametrize("rule", [O.AMSGrad(0.01), O.Rprop(0.01)], ids=repr)
def test_float32_steps_follow_the_float64_formula_and_float16_steps_in_float32(rule):
    rng = np.random.default_rng(2)
    x, dxs = rng.standard_normal((3, 4)), gradients(rng, (3, 4), 5, 0.1)
    want, _ = run(rule, x, dxs)
    got, state = run(rule, x.astype(np.float32), [d.astype(np.float32) for d in dxs])
    assert got.dtype == np.float32 and all(s.dtype == np.float32 for s in state.state)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    got16, state16 = run(rule, x.astype(np.float16), [d.astype(np.float16) for d in dxs])
    assert got16.dtype == np.float16 and all(s.dtype == np.float32 for s in state16.state)
    np.testing.assert_allclose(got16, want, rtol=2e-3, atol=2e-3)


def test_hyperparameters_are_checked_naming_the_rule():
    with pytest.raises(ValueError, match=r"^Rprop: ell must be a tuple \(decrease, increase\) of numbers with "
                                         r"0 < decrease < 1 < increase, got \(1.2, 0.5\)$"):
        O.Rprop(ell=(1.2, 0.5))
    with pytest.raises(ValueError, match=r"^Rprop: gamma must be a tuple \(smallest, largest\) of finite step "
                                         r"sizes with 0 <= smallest <= largest, got \(1.0, 0.1\)$"):
        O.Rprop(gamma=(1.0, 0.1))
    with pytest.raises(ValueError, match=r"^AMSGrad: beta must be"):
        O.AMSGrad(beta=(1.0, 0.9))
    state = O.setup(O.Rprop(0.1), np.ones(2))
    O.adjust(state, ell=(0.4, 1.1))
    assert state.rule == O.Rprop(0.1, (0.4, 1.1))
    assert fluxpy.AMSGrad is O.AMSGrad and fluxpy.Rprop is O.Rprop


def test_in_chains_and_by_formula():
    rng = np.random.default_rng(3)
    x, dxs = rng.standard_normal(4), gradients(rng, (4,), 6, 0.2)
    got, _ = run(O.OptimiserChain(O.ClipGrad(0.5), O.Rprop(0.05)), x, dxs)
    want, _ = rprop_jl(x, [np.clip(d, -0.5, 0.5) for d in dxs], 0.05)
    np.testing.assert_array_equal(got, want)
    got, _ = run(O.OptimiserChain(O.WeightDecay(0.1), O.AMSGrad(0.01)), x, dxs)
    ref, m, v, vhat = x.copy(), *(np.full(4, 1e-8) for _ in range(3))
    for d in dxs:   # the decay reads the parameter before the step
        g = d + 0.1 * ref
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g ** 2
        vhat = np.maximum(vhat, v)
        ref = ref - 0.01 * m / (np.sqrt(vhat) + 1e-8)
    np.testing.assert_allclose(got, ref, rtol=1e-12)


# -- different rules for different parts of one model -----------------------------------------------------------

def _model(rng):
    return fluxpy.f64(fluxpy.Chain(enc=fluxpy.Dense(3, 4, fluxpy.relu), dec=fluxpy.Dense(4, 2)))


def _loss(m, x, y):
    return fluxpy.mse(m(x), y)


def test_setup_with_a_function_gives_each_part_its_rule_in_one_state():
    rng = np.random.default_rng(4)
    model, x, y = _model(rng), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    layers = model.layers

    def rule(path, a):
        if path[:2] == ("layers", 1) and path[2] == "bias":
            return None                    # left untrained
        return O.Adam(0.01) if path[:2] == ("layers", 0) else O.Rprop(0.02)
    state = O.setup(rule, model)
    assert isinstance(state["layers"][0]["weight"].rule, O.Adam) and isinstance(state["layers"][1]["weight"].rule,
                                                                                 O.Rprop)
    assert state["layers"][1]["bias"] is None
    # the reference: each part set up on its own, stepped with the same gradients
    enc_state, dec_state = O.setup(O.Adam(0.01), layers[0].weight), O.setup(O.Rprop(0.02), layers[1].weight)
    enc_b_state = O.setup(O.Adam(0.01), layers[0].bias)
    refs = [layers[0].weight.copy(), layers[0].bias.copy(), layers[1].weight.copy()]
    dec_bias = layers[1].bias.copy()
    for _ in range(3):
        grad, = fluxpy.gradient(lambda m: _loss(m, x, y), model)
        g = grad["layers"]
        O.update(enc_state, refs[0], g[0]["weight"])
        O.update(enc_b_state, refs[1], g[0]["bias"])
        O.update(dec_state, refs[2], g[1]["weight"])
        O.update(state, model, grad)
    np.testing.assert_array_equal(layers[0].weight, refs[0])
    np.testing.assert_array_equal(layers[0].bias, refs[1])
    np.testing.assert_array_equal(layers[1].weight, refs[2])
    np.testing.assert_array_equal(layers[1].bias, dec_bias)
    O.adjust(state, 0.5)   # every rule's learning rate
    assert state["layers"][0]["weight"].rule.eta == state["layers"][1]["weight"].rule.eta == 0.5


def test_a_mixed_state_trains_and_ties_take_their_first_paths_rule():
    rng = np.random.default_rng(5)
    model, x, y = _model(rng), rng.standard_normal((8, 3)), rng.standard_normal((8, 2))
    state = O.setup(lambda path, a: O.AMSGrad(0.01) if path[1] == 0 else O.Descent(0.05), model)
    losses = fluxpy.train(_loss, model, [(x, y)] * 20, state, progress=False, capture=False)
    assert losses[-1] < losses[0]
    w = np.ones(3)
    tied = O.setup(lambda path, a: O.Descent(0.1) if path == ("a",) else O.Adam(), {"a": w, "b": w})
    assert tied["a"] is tied["b"] and isinstance(tied["a"].rule, O.Descent)


def test_setup_refuses_what_is_not_a_rule_naming_the_path():
    with pytest.raises(TypeError, match=r"^setup: the function given for the rules returned 'adam' for "
                                        r"model\.w; it should return an optimisation rule"):
        O.setup(lambda path, a: "adam", {"w": np.ones(2)})
    with pytest.raises(TypeError, match="setup expects optimisation rules such as Adam"):
        O.setup(_model(np.random.default_rng(0)), {"w": np.ones(2)})   # a model where the rule belongs


def test_a_mixed_state_of_the_new_rules_is_saved_and_resumed(tmp_path):
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((5, 3)), rng.standard_normal((5, 2))

    def made():
        model = _model(rng)
        return model, O.setup(lambda path, a: O.Rprop(0.01) if path[1] == 0 else O.AMSGrad(0.01), model)
    model, state = made()
    for _ in range(3):
        grad, = fluxpy.gradient(lambda m: _loss(m, x, y), model)
        O.update(state, model, grad)
    path = str(tmp_path / "run.safetensors")
    fluxpy.save_training(path, model, state, step=3)
    model2, state2 = made()
    assert fluxpy.load_training(path, model2, state2)["step"] == 3
    for a, b in zip(O.Plan.leaves(state), O.Plan.leaves(state2)):
        assert a.rule == b.rule and all(np.array_equal(u, v) for u, v in zip(a.state, b.state))


def test_matches_torch():
    """Where PyTorch is installed (the GPU machine): Rprop's steps equal torch.optim.Rprop's (eta inside the step
    sizes), and the written-out Adam(amsgrad=True) above is PyTorch's."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    x, dxs = rng.standard_normal((3, 4)), gradients(rng, (3, 4), 12, 0.2)

    def torch_steps(make):
        p = torch.tensor(x.copy(), requires_grad=True)
        opt = make([p])
        for dx in dxs:
            p.grad = torch.tensor(dx)
            opt.step()
        return p.detach().numpy()
    want = torch_steps(lambda ps: torch.optim.Rprop(ps, lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-4, 0.05)))
    got, _ = run(O.Rprop(0.01, (0.4, 1.3), (1e-4, 0.05)), x, dxs)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    want = torch_steps(lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.95), eps=1e-6, amsgrad=True))
    np.testing.assert_allclose(amsgrad_torch(x, dxs, 0.01, (0.8, 0.95), 1e-6)[-1], want, rtol=1e-10, atol=1e-13)
