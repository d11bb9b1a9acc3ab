"""float16 and bfloat16 through reductions, pooling, batch norm, normalisation and softmax, on the CPU.

Each op on a half array is compared with the same op on float32 copies of the same (half-rounded) values, forward
and gradient. ``U`` is the unit roundoff of the half type (bfloat16 2^-8, float16 2^-11). Tolerances:

- forward, ``FORWARD_ROUNDINGS * U * |ref|``: the ops compute in float32 and round the result once (1 rounding);
  ``mean`` multiplies the rounded sum by the rounded ``1/count`` and rounds again (3 roundings), so 3;
- gradients, ``GRADIENT_ROUNDINGS * U * max|ref|``: a pullback is a short chain of ops, each rounding its result to
  the half type (softmax's ``y * (dy - sum(dy * y))``: 4 roundings), and the subtractions cancel, so the error is
  bounded by the largest term rather than by each element; 8 leaves a factor of two over that chain.

The same cases run on the GPU in ``tests/gpu/test_half_kernels_gpu.py``.
"""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import ops
from fluxpy.autodiff import value_of
from fluxpy.backend import get_array_module
from fluxpy.ops.softmax import logit_crossentropy_rows

BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = [np.dtype(np.float16), BF16]
U = {np.dtype(np.float16): 2.0 ** -11, BF16: 2.0 ** -8}
FORWARD_ROUNDINGS = 3
GRADIENT_ROUNDINGS = 8


def _onehot_like(x):
    v = value_of(x)
    xp = get_array_module(v)
    return xp.asarray(np.eye(v.shape[1])[np.arange(v.shape[0]) % v.shape[1]].astype(v.dtype))


CASES = {
    "sum": (lambda x: ops.sum(x, axis=(0, 2)), (5, 3, 7)),
    "sum_all": (lambda x: ops.sum(x), (6, 13)),
    "mean": (lambda x: ops.mean(x, axis=1), (4, 9, 3)),
    "max": (lambda x: ops.max(x, axis=-1), (5, 11)),
    "maxpool": (lambda x: ops.maxpool(x, 2), (2, 3, 6, 6)),
    "maxpool_pad_stride": (lambda x: ops.maxpool(x, 3, stride=2, pad=1), (2, 2, 7, 5)),
    "meanpool": (lambda x: ops.meanpool(x, 2, stride=1, pad=1), (2, 3, 5, 4)),
    "global_meanpool": (lambda x: ops.global_meanpool(x), (2, 3, 5, 5)),
    "adaptive_maxpool": (lambda x: ops.adaptive_maxpool(x, 2), (1, 2, 5, 5)),
    "adaptive_meanpool": (lambda x: ops.adaptive_meanpool(x, (2, 3)), (1, 2, 5, 7)),
    "softmax": (lambda x: ops.softmax(x), (6, 10)),
    "logsoftmax": (lambda x: ops.logsoftmax(x, axis=0), (7, 5)),
    "logitcrossentropy": (lambda x: fluxpy.losses.logitcrossentropy(x, _onehot_like(x)), (8, 10)),
    "normalise": (lambda x: ops.normalise(x, axis=1), (4, 12)),
    "batchnorm": (lambda x: ops.batchnorm(x), (4, 3, 5, 5)),
    "batchnorm_relu": (lambda x: ops.batchnorm(x, act=ops.relu), (6, 5, 4)),
}


def random_input(shape, dtype, seed=0):
    """Normal values, never zero, rounded to ``dtype``; returned as ``dtype`` and as its exact float32 copy."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) + np.where(rng.random(shape) < 0.5, -0.1, 0.1)
    x = x.astype(np.float32).astype(dtype)
    return x, x.astype(np.float32)


def assert_close_forward(got, ref, dtype, roundings=FORWARD_ROUNDINGS):
    """``got`` (the half type) within ``roundings`` roundings of the float32 result ``ref``, elementwise."""
    assert np.dtype(got.dtype) == dtype, f"result dtype {got.dtype}, expected {dtype}"
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = np.abs(got - ref)
    bound = roundings * U[dtype] * np.abs(ref) + 1e-6 * np.abs(ref).max()
    assert np.all(err <= bound), f"max error {err.max():.3g}, at most {bound[err.argmax() if err.ndim else ()]:.3g}"


def assert_close_gradient(got, ref, dtype, want_dtype=None):
    """``got`` within ``GRADIENT_ROUNDINGS`` roundings of the float32 gradient ``ref``, relative to its largest
    element; ``got`` in ``want_dtype`` (the half type by default)."""
    assert np.dtype(got.dtype) == np.dtype(want_dtype or dtype), f"gradient dtype {got.dtype}"
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = max(np.abs(ref).max(), 1e-30)
    assert np.abs(got - ref).max() <= GRADIENT_ROUNDINGS * U[dtype] * scale, \
        f"max error {np.abs(got - ref).max():.3g}, scale {scale:.3g}"


def cotangent(f, x32, seed=1):
    """A random float32 weight ``w`` of ``f``'s output shape (rounded to bfloat16 so every half holds it)."""
    shape = np.shape(f(x32))
    return np.random.default_rng(seed).standard_normal(shape).astype(BF16).astype(np.float32)


def check_case(f, x, x32, dtype, to_host=np.asarray):
    """``f`` on ``x`` (a half array of any module) against ``f`` on ``x32``: forward and the gradient of
    ``sum(f(x) * w)``."""
    y = f(x)
    y32 = f(x32)
    assert_close_forward(to_host(y), to_host(y32), dtype)
    w32 = cotangent(f, to_host(x32))
    xp = get_array_module(x)
    w, w32 = xp.asarray(w32.astype(dtype)), xp.asarray(w32)
    (g,) = fluxpy.gradient(lambda x: ops.sum(f(x) * w), x)
    (g32,) = fluxpy.gradient(lambda x: ops.sum(f(x) * w32), x32)
    assert_close_gradient(to_host(g), to_host(g32), dtype)


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_float32(name, dtype):
    f, shape = CASES[name]
    x, x32 = random_input(shape, dtype)
    check_case(f, x, x32, dtype)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 3), h=st.integers(2, 7), w=st.integers(2, 7), k=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_pools_on_drawn_shapes_bfloat16(n, c, h, w, k, seed):
    k = min(k, h, w)
    x, x32 = random_input((n, c, h, w), BF16, seed)
    for f in (lambda x: ops.maxpool(x, k, stride=1), lambda x: ops.meanpool(x, k, stride=1)):
        check_case(f, x, x32, BF16)


POOL_LAYER_DTYPES = [np.dtype(np.float16), BF16]


@pytest.mark.parametrize("dtype", POOL_LAYER_DTYPES, ids=lambda d: d.name)
def test_pool_layers(dtype):
    x, x32 = random_input((4, 3, 6, 6), dtype)
    for layer in (fluxpy.MaxPool((2, 2)), fluxpy.MeanPool((3, 3), stride=1, pad=1)):
        check_case(layer, x, x32, dtype)


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: d.name)
def test_batchnorm_keeps_parameters_and_statistics_float32(dtype):
    x, x32 = random_input((4, 3, 6, 6), dtype)
    rng = np.random.default_rng(5)
    gamma, beta = (rng.standard_normal(3).astype(np.float32) for _ in range(2))
    stats, stats32 = [np.zeros(3, np.float32), np.ones(3, np.float32)], [np.zeros(3, np.float32), np.ones(3, np.float32)]
    w32 = cotangent(lambda x: x, x32)

    def loss(x, g, b, w, stats):
        return ops.sum(ops.batchnorm(x, g, b, *stats, act=ops.relu) * w)
    gx, gg, gb = fluxpy.gradient(lambda x, g, b: loss(x, g, b, w32.astype(dtype), stats), x, gamma, beta)
    rx, rg, rb = fluxpy.gradient(lambda x, g, b: loss(x, g, b, w32, stats32), x32, gamma, beta)
    assert_close_gradient(gx, rx, dtype)
    assert_close_gradient(gg, rg, dtype, want_dtype=np.float32)
    assert_close_gradient(gb, rb, dtype, want_dtype=np.float32)
    for got, ref in zip(stats, stats32):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    y = ops.batchnorm_infer(x, gamma, beta, *stats)
    assert_close_forward(y, ops.batchnorm_infer(x32, gamma, beta, *stats), dtype)


def test_bfloat16_reductions_round_once():
    x = np.full(4096, 1 + 2.0 ** -7, dtype=BF16)   # summed in bfloat16 this would stall at 2**... long before 4096
    got = ops.sum(x)
    assert got.dtype == BF16 and float(got) == float(np.float32(4096 * (1 + 2.0 ** -7)).astype(BF16))


def test_float16_with_bfloat16_is_an_error_naming_the_op():
    x = np.ones((1, 1, 2, 2), np.float16)
    pdims = ops.PoolDims.from_array(x, 2)
    with pytest.raises(TypeError, match=r"maxpool_backward expects .* one half type .* got dy bfloat16, x float16"):
        ops.maxpool_backward(np.ones((1, 1, 1, 1), BF16), x, ops.maxpool(x, 2), pdims)
    with pytest.raises(TypeError, match=r"logit_crossentropy_rows expects .* got yhat float16, y bfloat16"):
        logit_crossentropy_rows(np.ones((2, 3), np.float16), np.ones((2, 3), BF16))


def test_batchnorm_wants_float32_parameters_for_halves():
    x, _ = random_input((4, 2, 3), BF16)
    with pytest.raises(TypeError, match=r"batchnorm expects gamma of dtype float32 for x of dtype bfloat16 .* got "
                                        r"bfloat16"):
        ops.batchnorm(x, np.ones(2, BF16))
    with pytest.raises(fluxpy.layers.DTypeMismatch, match="BatchNorm"):
        fluxpy.BatchNorm(2)(np.ones((4, 2), np.int32))


def test_half_with_float32_cotangent_computes_in_float32():
    x, x32 = random_input((1, 2, 4, 4), BF16)
    pdims = ops.PoolDims.from_array(x, 2)
    dy = np.random.default_rng(3).standard_normal((1, 2, 2, 2)).astype(np.float32)
    got = ops.maxpool_backward(dy, x, ops.maxpool(x, 2), pdims)
    ref = ops.maxpool_backward(dy, x32, ops.maxpool(x32, 2), pdims)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, ref)
