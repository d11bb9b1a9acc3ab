"""The Flux-parity additions on the GPU against the CPU: the small layers (Scale, Bilinear, Maxout,
PairwiseFusion, AlphaDropout's statistics), RNN/LSTM/GRU, MultiHeadAttention, the Optimisers.jl rules, jacobian/hessian and named
Chains. Needs a
GPU (``gpu`` marker)."""
import copy
import operator

import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module, grad_leaves
from fluxpy import optimise as O

pytestmark = pytest.mark.gpu


def _models():
    return {
        "scale": (fluxpy.Scale(3, 1, 1, act=fluxpy.tanh), lambda m, x: m(x)),
        "bilinear": (fluxpy.Bilinear((3, 4), 5, fluxpy.relu, rng=0), lambda m, x: m(x[:, 0, 0, :], x[:, 1, :, 0])),
        "maxout": (fluxpy.Maxout(lambda: fluxpy.Dense(3, 2), 3), lambda m, x: m(x[:, 0, 0, :])),
        "pairwise": (fluxpy.PairwiseFusion(operator.add, fluxpy.Dense(3, 3, rng=1), fluxpy.Dense(3, 3, rng=2)),
                     lambda m, x: m((x[:, 0, 0, :], x[:, 1, 1, :]))[1]),
        "named": (fluxpy.Chain(enc=fluxpy.Dense(3, 4, fluxpy.relu, rng=3), dec=fluxpy.Dense(4, 2, rng=4)),
                  lambda m, x: m(x[:, 2, 2, :])),
        "lstm": (fluxpy.LSTM(3, 4, rng=5), lambda m, x: m(x[:, 0])),
        "gru": (fluxpy.GRU(3, 4, rng=6), lambda m, x: m(x[:, 1])),
        "rnn": (fluxpy.RNN(3, 4, rng=7), lambda m, x: m(x[:, 2])),
        "attention": (fluxpy.MultiHeadAttention(3, nheads=3, bias=True, rng=8),
                      lambda m, x: m(x[:, 0], mask=fluxpy.causal_mask(4, fluxpy.get_array_module(x)))[0]),
    }


@pytest.mark.parametrize("name", sorted(_models()))
def test_small_layers_match_the_cpu(name):
    model, call = _models()[name]
    model = fluxpy.f64(model)
    x = np.random.default_rng(0).standard_normal((6, 3, 4, 3))
    gm, gx = fluxpy.gpu(copy.deepcopy(model)), fluxpy.gpu(x)
    assert_matches_cpu(call(gm, gx), call(model, x), rtol=1e-10, atol=1e-12)
    (g_gpu,) = fluxpy.gradient(lambda m: (call(m, gx) ** 2).sum(), gm)
    (g_cpu,) = fluxpy.gradient(lambda m: (call(m, x) ** 2).sum(), model)
    for a, b in zip(grad_leaves(g_gpu), grad_leaves(g_cpu)):
        assert_matches_cpu(a, b, rtol=1e-9, atol=1e-12)


def test_alpha_dropout_keeps_the_statistics_on_the_gpu():
    cp = cupy_module()
    x = cp.asarray(np.random.default_rng(1).standard_normal((400, 500)))
    y = fluxpy.AlphaDropout(0.2, active=True)(x)
    assert abs(float(y.mean())) < 0.02 and abs(float(y.std()) - 1) < 0.02


@pytest.mark.parametrize("rule", [O.AdaGrad(0.1), O.AdaDelta(), O.AdaMax(0.01), O.NAdam(0.01), O.RAdam(0.01),
                                  O.OAdam(0.01), O.AdaBelief(0.01), O.Lion(0.01),
                                  O.OptimiserChain(O.AccumGrad(2), O.SignDecay(0.01), O.Descent(0.1))], ids=repr)
def test_optimiser_rules_match_the_cpu(rule):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4))
    gx = fluxpy.gpu(x)
    st_cpu, st_gpu = fluxpy.setup(rule, x), fluxpy.setup(rule, gx)
    for _ in range(6):
        dx = rng.standard_normal((3, 4))
        fluxpy.update(st_cpu, x, dx)
        fluxpy.update(st_gpu, gx, fluxpy.gpu(dx))
    assert_matches_cpu(gx, x, rtol=1e-10, atol=1e-12)


def test_jacobian_and_hessian_match_the_cpu():
    x = np.random.default_rng(3).standard_normal(5)
    w = np.random.default_rng(4).standard_normal((3, 5))
    gw = fluxpy.gpu(w)
    (j,) = fluxpy.jacobian(lambda v: fluxpy.tanh(fluxpy.matmul(gw, v)), fluxpy.gpu(x))
    (jc,) = fluxpy.jacobian(lambda v: fluxpy.tanh(fluxpy.matmul(w, v)), x)
    assert_matches_cpu(j, jc, rtol=1e-10, atol=1e-12)
    h = fluxpy.hessian(lambda v: (fluxpy.sin(v) * v).sum(), fluxpy.gpu(x))
    assert_matches_cpu(h, fluxpy.hessian(lambda v: (fluxpy.sin(v) * v).sum(), x), rtol=1e-10, atol=1e-12)
