"""The Optimisers.jl rules added for Flux parity (AdaGrad, AdaDelta, AdaMax, NAdam, RAdam, OAdam, AdaBelief, Lion,
SignDecay, AccumGrad) against straight transcriptions of Optimisers.jl's ``apply!`` formulas, several steps on
random gradients, float64; and how they sit in fluxpy (chains, adjust, half parameters, errors)."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import optimise as O


def _adagrad(xs, dxs, eta=0.1, eps=1e-8):
    x, acc = xs.copy(), np.full_like(xs, eps)
    for dx in dxs:
        acc = acc + dx ** 2
        x = x - dx * eta / (np.sqrt(acc) + eps)
    return x


def _adadelta(xs, dxs, rho=0.9, eps=1e-8):
    x, acc, dacc = xs.copy(), np.zeros_like(xs), np.zeros_like(xs)
    for dx in dxs:
        acc = rho * acc + (1 - rho) * dx ** 2
        step = dx * np.sqrt(dacc + eps) / np.sqrt(acc + eps)
        dacc = rho * dacc + (1 - rho) * step ** 2
        x = x - step
    return x


def _adamax(xs, dxs, eta=0.001, beta=(0.9, 0.999), eps=1e-8):
    x, m, u, bt = xs.copy(), np.zeros_like(xs), np.zeros_like(xs), list(beta)
    for dx in dxs:
        m = beta[0] * m + (1 - beta[0]) * dx
        u = np.maximum(beta[1] * u, np.abs(dx))
        x = x - (eta / (1 - bt[0])) * m / (u + eps)
        bt = [bt[0] * beta[0], bt[1] * beta[1]]
    return x


def _oadam(xs, dxs, eta=0.001, beta=(0.5, 0.9), eps=1e-8):
    x, m, v, term, bt = xs.copy(), np.zeros_like(xs), np.zeros_like(xs), np.zeros_like(xs), list(beta)
    for dx in dxs:
        m = beta[0] * m + (1 - beta[0]) * dx
        v = beta[1] * v + (1 - beta[1]) * dx ** 2
        prev = term
        term = eta * m / (1 - bt[0]) / (np.sqrt(v / (1 - bt[1])) + eps)
        x = x - (2 * term - prev)
        bt = [bt[0] * beta[0], bt[1] * beta[1]]
    return x


def _nadam(xs, dxs, eta=0.001, beta=(0.9, 0.999), eps=1e-8):
    x, m, v, bt = xs.copy(), np.zeros_like(xs), np.zeros_like(xs), list(beta)
    for dx in dxs:
        m = beta[0] * m + (1 - beta[0]) * dx
        v = beta[1] * v + (1 - beta[1]) * dx ** 2
        step = (beta[0] * m / (1 - beta[0] * bt[0]) + (1 - beta[0]) * dx / (1 - bt[0])) / \
            (np.sqrt(v * beta[1] / (1 - bt[1])) + eps) * eta
        x = x - step
        bt = [bt[0] * beta[0], bt[1] * beta[1]]
    return x


def _radam(xs, dxs, eta=0.001, beta=(0.9, 0.999), eps=1e-8):
    x, m, v, bt, t = xs.copy(), np.zeros_like(xs), np.zeros_like(xs), list(beta), 1
    rho_inf = 2 / (1 - beta[1]) - 1
    for dx in dxs:
        m = beta[0] * m + (1 - beta[0]) * dx
        v = beta[1] * v + (1 - beta[1]) * dx ** 2
        rho = rho_inf - 2 * t * bt[1] / (1 - bt[1])
        if rho > 4:
            r = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            x = x - m / (1 - bt[0]) / (np.sqrt(v / (1 - bt[1])) + eps) * eta * r
        else:
            x = x - m / (1 - bt[0]) * eta
        bt, t = [bt[0] * beta[0], bt[1] * beta[1]], t + 1
    return x


def _adabelief(xs, dxs, eta=0.001, beta=(0.9, 0.999), eps=1e-16):
    x, m, s, bt = xs.copy(), np.zeros_like(xs), np.zeros_like(xs), list(beta)
    for dx in dxs:
        m = beta[0] * m + (1 - beta[0]) * dx
        s = beta[1] * s + (1 - beta[1]) * (dx - m) ** 2 + eps
        x = x - eta * m / (1 - bt[0]) / (np.sqrt(s / (1 - bt[1])) + eps)
        bt = [bt[0] * beta[0], bt[1] * beta[1]]
    return x


def _lion(xs, dxs, eta=0.001, beta=(0.9, 0.999)):
    x, m = xs.copy(), np.zeros_like(xs)
    for dx in dxs:
        m = beta[1] * dx + (1 - beta[1]) * m
        x = x - eta * np.sign((beta[1] - beta[0]) * dx + beta[0] * m)
    return x


CASES = [(O.AdaGrad(0.1), _adagrad), (O.AdaDelta(0.9), _adadelta), (O.AdaMax(0.01), lambda x, d: _adamax(x, d, 0.01)),
         (O.OAdam(0.01), lambda x, d: _oadam(x, d, 0.01)), (O.NAdam(0.01), lambda x, d: _nadam(x, d, 0.01)),
         (O.RAdam(0.01), lambda x, d: _radam(x, d, 0.01)), (O.AdaBelief(0.01), lambda x, d: _adabelief(x, d, 0.01)),
         (O.Lion(0.01), lambda x, d: _lion(x, d, 0.01))]


@settings(max_examples=15, deadline=None)
@given(st.integers(0, len(CASES) - 1), st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(1, 12),
       st.integers(0, 10**6))
def test_rules_follow_optimisers_jl(which, shape, steps, seed):
    rule, reference = CASES[which]
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal(shape)
    dxs = [rng.standard_normal(shape) for _ in range(steps)]
    x = x0.copy()
    state = fluxpy.setup(rule, x)
    for dx in dxs:
        fluxpy.update(state, x, dx)
    np.testing.assert_allclose(x, reference(x0, dxs), rtol=1e-10, atol=1e-12)


def test_radam_switches_to_the_rectified_step_after_its_warm_up():
    x0, dxs = np.ones(1), [np.full(1, 0.5)] * 8
    x = x0.copy()
    st_ = fluxpy.setup(O.RAdam(0.01), x)
    for dx in dxs:
        fluxpy.update(st_, x, dx)
    np.testing.assert_allclose(x, _radam(x0, dxs, 0.01), rtol=1e-12)
    assert st_.state[3] == 9


def test_sign_decay_and_accumulation_in_chains():
    w = np.array([1.0, -3.0])
    st_ = fluxpy.setup(O.OptimiserChain(O.AccumGrad(3), O.SignDecay(0.1), O.Descent(0.5)), w)
    grads = [np.array([3.0, 0.0]), np.array([0.0, 3.0]), np.array([6.0, -6.0])]
    for g in grads[:2]:
        fluxpy.update(st_, w, g)
        np.testing.assert_array_equal(w, [1.0, -3.0])   # held back
    fluxpy.update(st_, w, grads[2])
    mean = sum(grads) / 3
    np.testing.assert_allclose(w, np.array([1.0, -3.0]) - 0.5 * (mean + 0.1 * np.sign([1.0, -3.0])))
    fluxpy.update(st_, w, np.ones(2))                   # a new round starts: held back again
    np.testing.assert_allclose(w, np.array([1.0, -3.0]) - 0.5 * (mean + 0.1 * np.sign([1.0, -3.0])))
    with pytest.raises(ValueError, match="AccumGrad must accumulate at least one gradient"):
        O.AccumGrad(0)


def test_adjust_half_parameters_and_a_model_tree():
    model = fluxpy.Chain(fluxpy.Dense(3, 2, rng=0))
    state = fluxpy.setup(O.NAdam(0.1), model)
    fluxpy.adjust(state, 0.01)
    assert state["layers"][0]["weight"].rule.eta == 0.01
    x = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    before = model[0].weight.copy()
    (g,) = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), model)
    fluxpy.update(state, model, g)
    assert not np.array_equal(before, model[0].weight)
    w16 = np.array([1.0, 2.0], np.float16)
    st16 = fluxpy.setup(O.AdaBelief(0.1), w16)
    assert st16.state[0].dtype == np.float32     # float32 state for a half parameter
    fluxpy.update(st16, w16, np.array([1.0, -1.0], np.float16))
    assert w16.dtype == np.float16 and w16[0] < 1 and w16[1] > 2
    with pytest.raises(ValueError, match="no rule in the state tree has"):
        fluxpy.adjust(fluxpy.setup(O.AdaDelta(), np.ones(2)), 0.1)   # AdaDelta has no learning rate


def test_exponential_schedule_and_its_checks():
    from fluxpy.schedules import Exp
    s = Exp(0.1, 0.9, floor=0.01)
    values = [s(t) for t in range(1, 40)]
    assert values[0] == 0.1 and all(a >= b for a, b in zip(values, values[1:])) and min(values) == 0.01
    np.testing.assert_allclose(values[:3], [0.1, 0.09, 0.081])
    for bad in (dict(start=0.1, decay=1.5), dict(start=-1.0, decay=0.5), dict(start=0.1, decay=0.0)):
        with pytest.raises(ValueError, match="Exp expects"):
            Exp(**bad)
    with pytest.raises(ValueError, match="expects t to be an int >= 1"):
        s(0)


@pytest.mark.parametrize("make", [
    lambda init: fluxpy.Conv((3, 3), 2, 4, init=init), lambda init: fluxpy.ConvTranspose((2, 2), 4, 2, init=init),
    lambda init: fluxpy.Dense(3, 5, init=init), lambda init: fluxpy.Embedding(7, 3, init=init)])
def test_init_functions_must_return_a_float_array_of_the_weight_shape(make):
    wrong_shape = lambda *shape, rng=None: np.zeros((1,) + shape, np.float32)     # noqa: E731
    integers = lambda *shape, rng=None: np.zeros(shape, np.int32)                 # noqa: E731
    right = lambda *shape, rng=None: np.full(shape, 0.5, np.float32)              # noqa: E731
    with pytest.raises(ValueError, match="init must return a float array of shape"):
        make(wrong_shape)
    with pytest.raises(ValueError, match="init must return a float array of shape"):
        make(integers)
    assert float(make(right).weight.mean()) == 0.5
