"""The layer features added for Flux's test/layers parity, on CuPy against the CPU path: attention with an additive
bias and general sizes, linear upsampling in 1 to 3 dimensions and to a size, recurrent layers with a vector state,
unbatched sequences and no bias, Recurrence, convolutions built from weights. Values and gradients in float64 (tight)
and float32.

Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere). Run:
``python -m pytest -q tests/gpu/test_flux_layers_gpu.py -p no:cacheprovider``.
"""
import copy

import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module, grad_leaves
from fluxpy.ops.resample import upsample_linear

pytestmark = pytest.mark.gpu

TOL = {np.float64: 1e-11, np.float32: 2e-5}


def _cases():
    r = np.random.default_rng(0)
    b = r.standard_normal((3, 3))
    return {
        "mha bias": (fluxpy.MultiHeadAttention(4, nheads=2, bias=True, rng=0),
                     lambda m, x: m(x, bias=fluxpy.get_array_module(x).asarray(b, dtype=x.dtype))[0], (2, 3, 4)),
        "mha sizes": (fluxpy.MultiHeadAttention(4, nheads=2, qk_dim=6, v_dim=8, out_dim=5, rng=1),
                      lambda m, x: m(x)[0], (2, 3, 4)),
        "upsample trilinear": (fluxpy.Upsample(mode="trilinear", size=(3, 5, 4)), lambda m, x: m(x), (2, 3, 2, 3, 2)),
        "upsample bilinear size": (fluxpy.Upsample(mode="bilinear", size=(5, 7), align_corners=False),
                                   lambda m, x: m(x), (2, 3, 3, 4)),
        "upsample nearest short": (fluxpy.Upsample(scale=(2,)), lambda m, x: m(x), (2, 3, 3, 4)),
        "lstm vector state": (fluxpy.LSTM(4, 3, rng=2),
                              lambda m, x: m(x, (x[0, 0, :3] * 0 + 0.5, x[0, 0, :3] * 0 - 0.5)), (2, 5, 4)),
        "gru unbatched": (fluxpy.GRU(4, 3, rng=3), lambda m, x: m(x[0]), (2, 5, 4)),
        "rnn no bias": (fluxpy.RNN(4, 3, bias=False, rng=4), lambda m, x: m(x), (2, 5, 4)),
        "recurrence": (fluxpy.Recurrence(fluxpy.LSTMCell(4, 3, rng=5)), lambda m, x: m(x), (2, 5, 4)),
        "conv from weight": (fluxpy.Conv(r.standard_normal((3, 2, 2, 3)).astype(np.float32), True, fluxpy.relu,
                                         pad=1), lambda m, x: m(x), (2, 2, 5, 6)),
        "depthwise from weight": (fluxpy.DepthwiseConv(r.standard_normal((2, 3, 3)).astype(np.float32)),
                                  lambda m, x: m(x), (2, 2, 7)),
    }


@pytest.mark.parametrize("name", sorted(_cases()))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_layers_match_the_cpu(name, dtype):
    cp = cupy_module()
    model, call, shape = _cases()[name]
    model = fluxpy.f64(model) if dtype == np.float64 else model
    x = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    gm = fluxpy.gpu(copy.deepcopy(model))
    y, back = fluxpy.pullback(call, gm, cp.asarray(x))
    y_ref, back_ref = fluxpy.pullback(call, model, x)
    tol = TOL[dtype]
    assert_matches_cpu(y, y_ref, rtol=tol, atol=tol)
    ct = np.random.default_rng(2).standard_normal(y_ref.shape).astype(dtype)
    got, ref = back(cp.asarray(ct)), back_ref(ct)
    for a, b in zip(grad_leaves(got), grad_leaves(ref)):
        assert_matches_cpu(a, b, rtol=10 * tol, atol=10 * tol)


@pytest.mark.parametrize("shape, size", [((2, 3, 5), (9,)), ((1, 2, 3, 4, 2), (5, 6, 3))])
def test_upsample_linear_on_gpu(shape, size):
    cp = cupy_module()
    x = np.random.default_rng(3).standard_normal(shape)
    for align in (True, False):
        y = upsample_linear(cp.asarray(x), None, align, size=size)
        assert_matches_cpu(y, upsample_linear(x, None, align, size=size), rtol=1e-12, atol=1e-13)
