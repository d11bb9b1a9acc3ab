"""The fused elementwise kernels (broadcast forward and pullback, bias_act, the finite check) on float16 and
bfloat16: computed in float32 and rounded once to the half type, so each result is exactly the float32
kernel's result rounded to the half type (the same traced C, the same float32 operations); against the CPU path
(NumPy float32, then rounded) within one unit in the last place of the half type (the GPU contracts a * b + c
into one fused multiply-add, NumPy rounds twice).
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy.broadcast import broadcast
from fluxpy.kernels import cuda_optimise
from fluxpy.kernels import elementwise as E
from fluxpy.kernels.halfs import BFLOAT16
from fluxpy.ops import activations as A
from fluxpy.ops.bias_act import derivative_from_saved
from sweeps import examples

pytestmark = pytest.mark.gpu

HALVES = [np.dtype(np.float16), BFLOAT16]
ULP = {np.dtype(np.float16): 2.0 ** -10, BFLOAT16: 2.0 ** -7}   # one unit in the last place, relative
FUNCTIONS = {
    "tanh affine": lambda x, b: np.tanh(x * 1.5 + b),
    "relu": lambda x, b: np.maximum(x + b, 0.0),
    "sigmoid": lambda x, b: 1.0 / (1.0 + np.exp(-(x - b))),
    "square ratio": lambda x, b: (x * x) / (1.0 + b * b),
}


def _pair(rng, shape, dtype):
    import cupy as cp
    x = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal((1,) * (len(shape) - 1) + (shape[-1],)).astype(np.float32)
    return cp.asarray(x.astype(dtype)), cp.asarray(b.astype(dtype))


def _host(a):
    import cupy as cp
    return cp.asnumpy(a)


def _rounded(a, dtype):
    """A float32 CuPy array rounded to ``dtype`` on the host (ml_dtypes and NumPy round to nearest even)."""
    return _host(a).astype(dtype)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("name", list(FUNCTIONS))
@examples(6, default=3)
@given(shape=st.lists(st.integers(1, 33), min_size=1, max_size=3).map(tuple), seed=st.integers(0, 2**31 - 1))
def test_forward_and_pullback_are_the_float32_kernels_rounded_once(dtype, name, shape, seed):
    f = FUNCTIONS[name]
    rng = np.random.default_rng(seed)
    x, b = _pair(rng, shape, dtype)
    x32, b32 = x.astype(np.float32), b.astype(np.float32)
    y = E.fused_forward(f, x, b)
    assert y.dtype == dtype and y.shape == np.broadcast_shapes(x.shape, b.shape)
    assert np.array_equal(_host(y).view(np.uint16), _rounded(E.fused_forward(f, x32, b32), dtype).view(np.uint16))
    dy = x.copy()   # a random cotangent of the output's shape
    gx, gb = E.fused_pullback(f, (0, 1), dy, x, b)
    wx, wb = E.fused_pullback(f, (0, 1), dy.astype(np.float32), x32, b32)
    for got, want in ((gx, wx), (gb, wb)):
        assert got.dtype == dtype
        assert np.array_equal(_host(got).view(np.uint16), _rounded(want, dtype).view(np.uint16))
    # and the CPU path (float32 NumPy, rounded): within one unit in the last place
    host = broadcast(f, _host(x), _host(b))
    assert host.dtype == dtype
    np.testing.assert_allclose(_host(y).astype(np.float32), host.astype(np.float32), rtol=ULP[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_mixed_half_and_float32_operands_compute_in_float32(dtype):
    import cupy as cp
    rng = np.random.default_rng(3)
    x, _ = _pair(rng, (5, 7), dtype)
    w = cp.asarray(rng.standard_normal((1, 7)).astype(np.float32))
    y = E.fused_forward(lambda x, w: x * w + 1.0, x, w)
    assert y.dtype == np.float32   # one fused multiply-add against CuPy's two roundings: within a float32 unit
    np.testing.assert_allclose(_host(y), _host(x.astype(np.float32) * w + 1.0), rtol=2 ** -23, atol=2 ** -24)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_gradients_through_broadcast_and_unbroadcast_in_half(dtype):
    import cupy as cp
    rng = np.random.default_rng(4)
    x, b = _pair(rng, (16, 9), dtype)

    def loss(x, b):
        return broadcast(lambda x, b: np.tanh(x * 1.5 + b), x, b).astype(np.float32).sum()
    gx, gb = fluxpy.gradient(loss, x, b)
    assert gx.dtype == dtype and gb.dtype == dtype and gb.shape == b.shape
    rx, rb = fluxpy.gradient(loss, x.astype(np.float32), b.astype(np.float32))
    tol = 4 * ULP[dtype]
    np.testing.assert_allclose(_host(gx).astype(np.float32), _host(rx), rtol=tol, atol=tol)
    # the bias gradient sums 16 rounded half cotangents (in float32): within 16 of their units
    np.testing.assert_allclose(_host(gb).astype(np.float32), _host(rb), rtol=16 * ULP[dtype], atol=16 * ULP[dtype])
    assert bool(cp.isfinite(gx.astype(np.float32)).all())


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_the_finite_check_reads_half_arrays(dtype):
    import cupy as cp
    arrays = [cp.asarray(np.ones(n, np.float32).astype(dtype)) for n in (3, 1000, 70000)]
    assert cuda_optimise.finite_total_supports(arrays[0], arrays)
    assert float(cuda_optimise.finite_total(arrays[0], arrays)) == 0.0
    for bad in (np.nan, np.inf, -np.inf):
        arrays[2][12345] = cp.asarray(np.array(bad, np.float32).astype(dtype))
        assert np.isnan(float(cuda_optimise.finite_total(arrays[0], arrays)))


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("kind", ["relu", "tanh", "sigmoid", "identity"])
def test_bias_act_backward_from_the_output_in_half(dtype, kind):
    rng = np.random.default_rng(5)
    y, _ = _pair(rng, (6, 4, 5, 5), dtype)
    if kind in ("tanh", "sigmoid"):   # outputs the activation can give
        y = (np.tanh(y.astype(np.float32)) if kind == "tanh" else 1 / (1 + np.exp(-y.astype(np.float32)))).astype(dtype)
    dy, _ = _pair(rng, (6, 4, 5, 5), dtype)
    derivative = derivative_from_saved(getattr(A, kind))[0]
    assert E.bias_act_backward_supports(derivative, y, dy)
    for fused in (True, False):
        dx, db = E.bias_act_backward(derivative, y, dy, (1, 4, 1, 1), True, True, fused=fused)
        wx, wb = E.bias_act_backward(derivative, y.astype(np.float32), dy.astype(np.float32), (1, 4, 1, 1), True,
                                     True, fused=fused)
        assert dx.dtype == dtype and db.dtype == dtype and db.shape == (1, 4, 1, 1)
        assert np.array_equal(_host(dx).view(np.uint16), _rounded(wx, dtype).view(np.uint16))
        # db sums 150 products in float32 (from the rounded dz, or from dy and y in one pass) and rounds once
        np.testing.assert_allclose(_host(db).astype(np.float32), _host(wb), rtol=2 * ULP[dtype],
                                   atol=2 * ULP[dtype] * float(abs(_host(wb)).max()))


@pytest.mark.parametrize("number_first", [False, True])
@pytest.mark.parametrize("op", ["add", "subtract", "multiply", "divide", "power", "maximum", "minimum"])
def test_a_python_number_with_a_bfloat16_array_stays_bfloat16_as_numpy_keeps_it(op, number_first):
    from fluxpy.ops import basic
    rng = np.random.default_rng(5)
    x = (np.abs(rng.standard_normal((3, 5))) + 0.5).astype(BFLOAT16)
    number = 1.2e-7 if op in ("add", "subtract") else 3 if op == "power" else 1.7
    args = (number, x) if number_first else (x, number)
    expected = getattr(basic, op)(*args)                     # NumPy with ml_dtypes: bfloat16
    got = getattr(basic, op)(*[fluxpy.gpu(a) if isinstance(a, np.ndarray) else a for a in args])
    assert expected.dtype == BFLOAT16 and got.dtype == BFLOAT16
    np.testing.assert_allclose(fluxpy.cpu(got).astype(np.float32), expected.astype(np.float32),
                               rtol=ULP[BFLOAT16])


def test_weight_norm_under_bfloat16_hands_the_layer_a_bfloat16_weight():
    from fluxpy.layers import Conv, WeightNorm
    wn = fluxpy.mixed_precision(fluxpy.gpu(WeightNorm(Conv((3, 3), 2, 3, pad=1, rng=0))), "bfloat16")
    x = fluxpy.gpu(np.random.default_rng(1).standard_normal((2, 2, 5, 5)).astype(np.float32))
    y = wn(x)
    assert y.dtype == np.float32 and bool(fluxpy.cpu((y == y).all()))   # the wrapper hands back float32
