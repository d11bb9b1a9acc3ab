"""Convolutions and matrix products in float16 and bfloat16 on the CPU (ml_dtypes' bfloat16), against float32.

The reference is the float32 path on the SAME half-rounded inputs (exactly representable in float32), so the only
differences are the rounding of results to the half type and float32 accumulation order. An output computed in
float32 and rounded once is within ``u * |y|`` of the float32 result (``u`` the unit roundoff: 2^-8 for bfloat16,
2^-11 for float16); a layer rounds up to twice (conv or matmul, then bias and activation), and accumulation
order in float32 adds at most ``L * 2^-24`` of the terms' absolute sum (``L`` the reduction length), far below
that. Near zero a relative bound is meaningless, so the bound is ``2u * (|ref| + scale)`` with ``scale`` the
typical output size, ``sqrt(L) * rms(a) * rms(b)`` for a sum of ``L`` products of random terms.
:func:`assert_half_close` applies it (and the GPU tests reuse it).
"""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluxpy import pullback
from fluxpy.kernels import cpu_dense
from fluxpy.layers import Conv, Dense, DTypeMismatch
from fluxpy.ops import relu
from fluxpy.ops.conv import conv, conv_backward_data, conv_backward_filter, conv_bias_act, conv_dims
from fluxpy.ops.linalg import matmul

BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = (np.dtype(np.float16), BF16)
UNIT_ROUNDOFF = {np.dtype(np.float16): 2.0 ** -11, BF16: 2.0 ** -8}


def _rms(a):
    return float(np.sqrt(np.mean(np.square(np.asarray(a, np.float64)))))


def assert_half_close(got, ref, dtype, length, a, b, what="", roundings=2):
    """``|got - ref| <= 2u (|ref| + sqrt(length) rms(a) rms(b))`` elementwise (``roundings`` in place of the 2
    where a kernel rounds more often), and ``got`` of ``dtype`` (see the module docstring); ``a`` and ``b`` are the
    factors of the products summed ``length`` at a time."""
    assert np.dtype(got.dtype) == np.dtype(dtype), f"{what}: dtype {got.dtype}, expected {dtype}"
    got64, ref64 = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got64.shape == ref64.shape, f"{what}: shape {got64.shape} != {ref64.shape}"
    assert np.isfinite(got64).all(), f"{what}: non-finite values"
    scale = math.sqrt(length) * _rms(a) * _rms(b)
    assert scale > 0, f"{what}: all-zero factors make the check vacuous"
    bound = roundings * UNIT_ROUNDOFF[np.dtype(dtype)] * (np.abs(ref64) + scale)
    excess = np.abs(got64 - ref64) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else ()
    assert (excess <= 0).all(), (f"{what} {np.dtype(dtype)}: got {got64[worst]} against {ref64[worst]} at {worst}, "
                                 f"bound {bound[worst]:.3g}")


def _rounded(rng, shape, dtype):
    """Random normal values rounded to ``dtype`` (never all zeros)."""
    return rng.standard_normal(shape).astype(dtype)


def _f32(a):
    return np.asarray(a).astype(np.float32)


conv_options = st.fixed_dictionaries({
    "stride": st.sampled_from([1, 2, (1, 2)]), "pad": st.sampled_from([0, 1, (0, 1, 1, 2), "same"]),
    "dilation": st.sampled_from([1, 2]), "groups": st.sampled_from([1, 2]), "flipped": st.booleans()})


@settings(max_examples=25, deadline=None)
@given(options=conv_options, dtype=st.sampled_from(HALVES), seed=st.integers(0, 2 ** 31 - 1),
       n=st.integers(1, 3), hw=st.integers(5, 8))
def test_conv_and_its_gradient_kernels_match_float32(options, dtype, seed, n, hw):
    rng = np.random.default_rng(seed)
    g = options["groups"]
    x, w = _rounded(rng, (n, 2 * g, hw, hw), dtype), _rounded(rng, (3 * g, 2, 3, 3), dtype)
    cd = conv_dims(x, w, **options)
    y = conv(x, w, **options)
    assert_half_close(y, conv(_f32(x), _f32(w), **options), dtype, 2 * 9, x, w, "conv")
    dy = _rounded(rng, cd.y_shape, dtype)
    cd32 = conv_dims(_f32(x), _f32(w), **options)
    assert_half_close(conv_backward_data(dy, w, cd), conv_backward_data(_f32(dy), _f32(w), cd32), dtype,
                      3 * 9, dy, w, "conv_backward_data")
    p, q = cd.y_shape[2:]
    assert_half_close(conv_backward_filter(x, dy, cd), conv_backward_filter(_f32(x), _f32(dy), cd32), dtype,
                      n * p * q, x, dy, "conv_backward_filter")


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_conv_bias_act_in_half_matches_float32(dtype):
    rng = np.random.default_rng(1)
    x, w, b = _rounded(rng, (2, 4, 7, 7), dtype), _rounded(rng, (5, 4, 3, 3), dtype), _rounded(rng, (5,), dtype)
    got = conv_bias_act(x, w, b, relu, pad=1)
    ref = conv_bias_act(_f32(x), _f32(w), _f32(b), relu, pad=1)
    assert_half_close(got, ref, dtype, 4 * 9, x, w, "conv_bias_act")
    assert (np.asarray(got, np.float32) > 0).any() and (np.asarray(got, np.float32) == 0).any()


def _layer_pullback(layer, x, dy):
    y, back = pullback(lambda m, x: m(x), layer, x)
    grads, dx = back(dy)
    return y, grads["weight"], grads["bias"], dx


def _as_dtype(layer, dtype, rng):
    layer.weight = _rounded(rng, layer.weight.shape, dtype)
    layer.bias = _rounded(rng, layer.bias.shape, dtype)
    return layer


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_conv_layer_gradients_in_half_match_float32(dtype):
    rng = np.random.default_rng(2)
    layer = _as_dtype(Conv(3, 4, 6, relu, pad=1, stride=2), dtype, rng)
    x = _rounded(rng, (3, 4, 9, 9), dtype)
    y, dw, db, dx = _layer_pullback(layer, x, _rounded(rng, (3, 6, 5, 5), dtype))
    dy = _rounded(np.random.default_rng(3), y.shape, dtype)
    y, dw, db, dx = _layer_pullback(layer, x, dy)
    ref = Conv(3, 4, 6, relu, pad=1, stride=2)
    ref.weight, ref.bias = _f32(layer.weight), _f32(layer.bias)
    y32, dw32, db32, dx32 = _layer_pullback(ref, _f32(x), _f32(dy))
    assert_half_close(y, y32, dtype, 4 * 9, x, layer.weight, "Conv forward")
    assert_half_close(dx, dx32, dtype, 6 * 9, dy, layer.weight, "Conv dx")
    assert_half_close(dw, dw32, dtype, 3 * 25, x, dy, "Conv dweight")
    assert_half_close(db, db32, dtype, 3 * 25, dy, np.ones(1), "Conv dbias")


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_dense_layer_gradients_in_half_match_float32(dtype):
    rng = np.random.default_rng(4)
    layer = _as_dtype(Dense(37, 11, relu), dtype, rng)
    x, dy = _rounded(rng, (13, 37), dtype), _rounded(rng, (13, 11), dtype)
    y, dw, db, dx = _layer_pullback(layer, x, dy)
    ref = Dense(37, 11, relu)
    ref.weight, ref.bias = _f32(layer.weight), _f32(layer.bias)
    y32, dw32, db32, dx32 = _layer_pullback(ref, _f32(x), _f32(dy))
    assert_half_close(y, y32, dtype, 37, x, layer.weight, "Dense forward")
    assert_half_close(dx, dx32, dtype, 11, dy, layer.weight, "Dense dx")
    assert_half_close(dw, dw32, dtype, 13, x, dy, "Dense dweight")
    assert_half_close(db, db32, dtype, 13, dy, np.ones(1), "Dense dbias")   # summed in float32 for both halves


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from(HALVES), m=st.integers(1, 9), k=st.integers(1, 300), n=st.integers(1, 9),
       batch=st.sampled_from([(), (2,)]), seed=st.integers(0, 2 ** 31 - 1))
def test_matmul_in_half_returns_the_half_type_within_tolerance(dtype, m, k, n, batch, seed):
    rng = np.random.default_rng(seed)
    a, b = _rounded(rng, batch + (m, k), dtype), _rounded(rng, (k, n), dtype)
    assert_half_close(matmul(a, b), _f32(a) @ _f32(b), dtype, k, a, b, "matmul")


def test_cpu_half_matmul_kernel_is_registered_for_halves_only():
    assert cpu_dense.matmul_half_supports(np.ones((2, 2), BF16), np.ones((2, 2), BF16))
    assert not cpu_dense.matmul_half_supports(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    assert not cpu_dense.matmul_half_supports(np.ones((2, 2), BF16), np.ones((2, 2), np.float16))


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_a_dtype_mix_is_refused_before_any_kernel_runs(dtype):
    x16, w32 = np.ones((1, 2, 4, 4), dtype), np.ones((3, 2, 3, 3), np.float32)
    with pytest.raises(TypeError, match=f"conv expects x and w of the same floating-point dtype, got x {dtype} "
                                        "and w float32"):
        conv(x16, w32)
    with pytest.raises(TypeError, match=f"conv_bias_act expects b of x's dtype {dtype}, got b of shape \\(3,\\) "
                                        "float32"):
        conv_bias_act(x16, w32.astype(dtype), np.ones(3, np.float32), relu)
    with pytest.raises(TypeError, match=f"matmul expects a and b of one dtype when either is float16 or bfloat16, "
                                        f"got a of shape \\(2, 3\\) {dtype} and b of shape \\(3, 4\\) float32"):
        matmul(np.ones((2, 3), dtype), np.ones((3, 4), np.float32))
    with pytest.raises(DTypeMismatch, match=f"Conv\\(\\(3, 3\\), 2 => 3\\) expects x of dtype float32 \\(its "
                                            f"parameters' dtype\\), got \\(1, 2, 4, 4\\) {dtype}"):
        Conv(3, 2, 3)(x16)
    with pytest.raises(DTypeMismatch, match=f"Dense\\(3 => 2\\) expects x of dtype float32 .* got \\(4, 3\\) {dtype}"):
        Dense(3, 2)(np.ones((4, 3), dtype))


def test_bfloat16_conv_reports_shape_errors_as_float_dtypes_do():
    with pytest.raises(ValueError, match="conv expects x.shape\\[1\\]"):
        conv(np.ones((1, 3, 4, 4), BF16), np.ones((2, 2, 3, 3), BF16))
