"""The CPU's whole-network recurrent kernels (fluxpy.kernels.cpu_rnn, what ``fluxpy.ops.rnn.rnn`` runs for NumPy
arrays) against the cell-by-cell composite: the outputs, the final states and every gradient (of x, the initial
states and each weight), in float64, over cells, activations, layers, directions, bias and initial states drawn by
hypothesis; the kernel runs (a call is counted) and declines what it does not compute.
"""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import kernels
from fluxpy.kernels import cpu_rnn
from fluxpy.ops.rnn import RNNDims, rnn

GATES = {"lstm": 4, "gru": 3, "rnn": 1}


def _problem(rng, mode, layers, bidirectional, bias, states, n, steps, n_in, hidden):
    directions = 2 if bidirectional else 1
    weights = []
    for layer in range(layers):
        for _ in range(directions):
            width = n_in if layer == 0 else directions * hidden
            rows = GATES[mode] * hidden
            weights.append((rng.standard_normal((rows, width)) * 0.5, rng.standard_normal((rows, hidden)) * 0.5,
                            rng.standard_normal(rows) * 0.5 if bias else None))
    shape = (layers * directions, n, hidden)
    h0 = rng.standard_normal(shape) if states else None
    c0 = rng.standard_normal(shape) if states and mode == "lstm" else None
    return rng.standard_normal((n, steps, n_in)), weights, h0, c0


def _loss_and_gradients(mode, act, layers, bidirectional, x, weights, h0, c0, seeds):
    bias = weights[0][2] is not None
    flat = [a for triple in weights for a in triple if a is not None]

    def loss(x, h0, c0, *flat):
        it = iter(flat)
        triples = [(next(it), next(it), next(it) if bias else None) for _ in weights]
        y, h, c = rnn(x, triples, h0, c0, mode=mode, act=act, num_layers=layers, bidirectional=bidirectional)
        total = (y * seeds[0]).sum() + (h * seeds[1]).sum()
        return total + ((c * seeds[2]).sum() if c is not None else 0)
    args = (x, h0, c0, *flat)
    return loss(*args), fluxpy.gradient(loss, *args)


@settings(max_examples=25, deadline=None)
@given(mode=st.sampled_from(["lstm", "gru", "rnn_tanh", "rnn_relu"]), layers=st.integers(1, 3),
       bidirectional=st.booleans(), bias=st.booleans(), states=st.booleans(), n=st.integers(1, 3),
       steps=st.integers(1, 5), n_in=st.integers(1, 4), hidden=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_the_kernel_equals_the_composite(mode, layers, bidirectional, bias, states, n, steps, n_in, hidden, seed):
    rng = np.random.default_rng(seed)
    cell = mode.split("_")[0]
    act = fluxpy.relu if mode == "rnn_relu" else None
    x, weights, h0, c0 = _problem(rng, cell, layers, bidirectional, bias, states, n, steps, n_in, hidden)
    directions = 2 if bidirectional else 1
    seeds = [rng.standard_normal((n, steps, directions * hidden))] + \
        [rng.standard_normal((layers * directions, n, hidden)) for _ in range(2)]
    table = kernels.snapshot()
    calls = []
    try:
        kernels.register("rnn_forward", "numpy", lambda *a: calls.append(1) or cpu_rnn.rnn_forward(*a),
                         cpu_rnn.supports)
        fused_loss, fused = _loss_and_gradients(cell, act, layers, bidirectional, x, weights, h0, c0, seeds)
        kernels.register("rnn_forward", "numpy", cpu_rnn.rnn_forward, lambda *a: False)
        loss, composite = _loss_and_gradients(cell, act, layers, bidirectional, x, weights, h0, c0, seeds)
    finally:
        kernels.restore(table)
    assert calls, "the kernel did not run"
    np.testing.assert_allclose(fused_loss, loss, rtol=1e-12, atol=1e-12)
    assert [g is None for g in fused] == [g is None for g in composite]
    for a, b in zip(fused, composite):
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_the_kernel_takes_float32_and_float64_numpy_arrays_of_its_cells_only():
    dims = RNNDims("lstm", 2, 3, 4, 5, 1, False, True, np.dtype(np.float32))
    assert cpu_rnn.supports(dims, np.ones(2, np.float32))
    assert not cpu_rnn.supports(dims, np.ones(2, np.float64))            # a dtype other than the problem's
    assert not cpu_rnn.supports(RNNDims("rnn", 2, 3, 4, 5, 1, False, True, np.dtype(np.float32)))   # another act
    assert not cpu_rnn.supports(RNNDims("gru", 2, 3, 4, 5, 1, False, True, np.dtype(np.float16)),
                                np.ones(2, np.float16))                  # halves: the composite


@settings(max_examples=10, deadline=None)
@given(mode=st.sampled_from(["lstm", "gru", "rnn"]), bidirectional=st.booleans(), states=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_kernels_pullback_differentiates_through_the_composite(mode, bidirectional, states, seed):
    """A gradient of the pullback itself (its cotangent tracked): the kernel's backward is no differentiable op, so
    the composite's runs; its derivative in the cotangent equals a central difference."""
    rng = np.random.default_rng(seed)
    x, weights, h0, c0 = _problem(rng, mode, 1, bidirectional, True, states, 2, 3, 3, 2)
    y, back = fluxpy.pullback(lambda x: rnn(x, weights, h0, c0, mode=mode, bidirectional=bidirectional)[0], x)
    u, d = rng.standard_normal(y.shape), rng.standard_normal(y.shape)

    def f(u):
        return (back(u)[0] ** 2).sum()
    g = fluxpy.gradient(f, u)[0]
    eps = 1e-6
    np.testing.assert_allclose((g * d).sum(), (f(u + eps * d) - f(u - eps * d)) / (2 * eps), rtol=1e-6, atol=1e-8)
