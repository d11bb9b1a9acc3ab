"""fluxpy's conversions between float32 and the halves and its sums of halves (fluxpy.kernels.cuda_halves) against
NumPy/ml_dtypes on the host, bit for bit: random values with NaN, infinities, values past float16's range, subnormals and signed zeros,
sizes with and without a whole number of 8-item vectors, channels-last arrays, the ops ``astype`` and ``+``
(forward and gradient), and the backward walk's sums."""
import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy import kernels
from fluxpy.kernels import cuda_halves
from fluxpy.kernels.halfs import BFLOAT16
from fluxpy.layout import is_channels_last, to_channels_last

pytestmark = pytest.mark.gpu

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16]
PAIRS = [(a, b) for a in DTYPES for b in DTYPES if a != b]


def _draw(rng, n, dtype):
    """Normal values at several scales, and the special ones, as ``dtype``."""
    v = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 6, n)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 7e4, -1e5, 6e-8, 3e-39, 1e-45], np.float64)
    where = rng.integers(0, n, min(n, 40))
    v[where] = special[rng.integers(0, len(special), where.size)]
    with np.errstate(over="ignore"):
        return v.astype(np.float32).astype(dtype)


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint16 if a.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4099, 1 << 17])
def test_cast_equals_the_host_bit_for_bit(src, dst, n):
    cp = cupy_module()
    rng = np.random.default_rng(n)
    host = _draw(rng, n, src)
    x = cp.asarray(host)
    assert cuda_halves.supports_cast(x, dst)
    with np.errstate(over="ignore", invalid="ignore"):
        want = host.astype(dst)
    got = cp.asnumpy(cuda_halves.cast(x, dst))
    assert got.dtype == dst
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan), f"{src}->{dst}: NaNs differ"
    assert np.array_equal(_bits(got)[~nan], _bits(want)[~nan]), f"{src}->{dst}: bits differ"


@pytest.mark.parametrize("src,dst", [(np.dtype(np.float32), BFLOAT16), (BFLOAT16, np.dtype(np.float32))])
def test_cast_keeps_channels_last(src, dst):
    cp = cupy_module()
    rng = np.random.default_rng(1)
    x = to_channels_last(cp.asarray(rng.standard_normal((3, 13, 5, 7)).astype(np.float32).astype(src)))
    y = cuda_halves.cast(x, dst)
    assert is_channels_last(y)
    np.testing.assert_array_equal(cp.asnumpy(y).astype(np.float32), cp.asnumpy(x).astype(dst).astype(np.float32))


def test_unsupported_inputs_are_left_to_cupy():
    cp = cupy_module()
    x = cp.arange(40, dtype=cp.float32)
    assert not cuda_halves.supports_cast(x[1:], BFLOAT16)           # not 32-byte aligned
    assert not cuda_halves.supports_cast(x[::2], BFLOAT16)          # not dense
    assert not cuda_halves.supports_cast(x, np.float64)             # not a dtype the kernel converts
    assert not cuda_halves.supports_cast(x, np.float32)             # nothing to convert
    assert not cuda_halves.supports_cast(np.ones(4, np.float32), BFLOAT16)
    assert kernels.find("astype", x, BFLOAT16) is cuda_halves.cast              # the table holds it for the op
    assert kernels.find("astype", x[1:], BFLOAT16) is None
    h = x.astype(BFLOAT16)
    assert kernels.find("add", h, h) is cuda_halves.add and kernels.find("add", x, x) is cuda_halves.add
    assert kernels.find("add", x.astype(np.float64), x.astype(np.float64)) is None   # float64: CuPy's
    y = fluxpy.ops.astype(x[1:], BFLOAT16)                   # the op still converts them (through CuPy)
    np.testing.assert_array_equal(cp.asnumpy(y).astype(np.float32), np.arange(1, 40, dtype=np.float32))


def test_astype_gradient_through_the_kernel():
    cp = cupy_module()
    rng = np.random.default_rng(2)
    w = cp.asarray(rng.standard_normal((64, 33)).astype(np.float32))
    g = fluxpy.gradient(lambda w: fluxpy.ops.sum(fluxpy.ops.astype(w, BFLOAT16) * 3), w)[0]
    assert g.dtype == np.float32
    np.testing.assert_array_equal(cp.asnumpy(g), np.full((64, 33), 3.0, np.float32))


HALVES = [np.dtype(np.float16), BFLOAT16]


@pytest.mark.parametrize("dtype", HALVES + [np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("n", [1, 9, 4099, 1 << 17])
def test_add_equals_the_host_bit_for_bit(dtype, n):
    cp = cupy_module()
    rng = np.random.default_rng(n + 7)
    ha, hb = _draw(rng, n, dtype), _draw(rng, n, dtype)
    a, b = cp.asarray(ha), cp.asarray(hb)
    assert cuda_halves.supports_add(a, b)
    with np.errstate(over="ignore", invalid="ignore"):
        want = (ha.astype(np.float32) + hb.astype(np.float32)).astype(dtype)
    got = cp.asnumpy(cuda_halves.add(a, b))
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan), f"{dtype}: NaNs differ"
    assert np.array_equal(_bits(got)[~nan], _bits(want)[~nan]), f"{dtype}: bits differ"


def test_add_keeps_channels_last_and_leaves_the_rest_to_cupy():
    cp = cupy_module()
    rng = np.random.default_rng(3)
    a = to_channels_last(cp.asarray(rng.standard_normal((2, 24, 3, 5)).astype(np.float32).astype(BFLOAT16)))
    b = to_channels_last(cp.asarray(rng.standard_normal((2, 24, 3, 5)).astype(np.float32).astype(BFLOAT16)))
    y = cuda_halves.plain_add(a, b)
    assert is_channels_last(y)
    want = (cp.asnumpy(a).astype(np.float32) + cp.asnumpy(b).astype(np.float32)).astype(BFLOAT16)
    np.testing.assert_array_equal(cp.asnumpy(y).astype(np.float32), want.astype(np.float32))
    c = cp.ascontiguousarray(b)
    assert not cuda_halves.supports_add(a, c)                          # layouts differ
    assert not cuda_halves.supports_add(a, b[:1])                      # shapes differ (broadcast)
    assert not cuda_halves.supports_add(a, b.astype(np.float16))       # dtypes differ
    assert not cuda_halves.supports_add(a.astype(np.float64), b.astype(np.float64))   # float64: CuPy's
    np.testing.assert_array_equal(cp.asnumpy(cuda_halves.plain_add(a, c)).astype(np.float32),
                                  want.astype(np.float32))


def test_half_gradient_sums_in_the_backward_walk():
    cp = cupy_module()
    rng = np.random.default_rng(4)
    x = cp.asarray(rng.standard_normal((64, 40)).astype(np.float32).astype(BFLOAT16))
    g = fluxpy.gradient(lambda x: fluxpy.ops.sum(fluxpy.ops.astype(x * 3 + x * x + x, np.float32)), x)[0]
    want = (3 + 2 * cp.asnumpy(x).astype(np.float64) + 1)
    np.testing.assert_allclose(cp.asnumpy(g).astype(np.float64), want, rtol=2e-2, atol=2e-2)


def _acts():
    from fluxpy.ops import activations as A
    return {"relu": A.relu, "gelu": A.gelu, "swish": A.swish, "tanh": np.tanh, "sigmoid": A.sigmoid}


BIASES = ["none", "same", "rows", "channels_last"]


def _bias_case(cp, rng, kind, dtype):
    """``(x, b)`` of one bias kind: none, of x's shape, a vector along the last axis, or along channels-last
    channels."""
    def draw(shape):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))
    if kind == "none":
        return draw((37, 29)), None
    if kind == "same":
        return draw((5, 3, 41)), draw((5, 3, 41))
    if kind == "rows":
        return draw((33, 48)), draw((48,))
    x = to_channels_last(draw((3, 24, 5, 7)))
    return x, draw((1, 24, 1, 1))


@pytest.mark.parametrize("dtype", HALVES + [np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("kind", BIASES)
@pytest.mark.parametrize("name", sorted(_acts()))
def test_bias_act_equals_the_traced_kernels(dtype, kind, name):
    cp = cupy_module()
    from fluxpy.kernels import elementwise
    act = _acts()[name]
    x, b = _bias_case(cp, np.random.default_rng(len(name) + len(kind)), kind, dtype)
    assert cuda_halves.supports_bias_act(x, b)
    y, z = cuda_halves.bias_act(x, b, elementwise._act_text(act, dtype), preactivation=True)
    fn = elementwise._act_fn(act, b is not None)
    want_y = elementwise.fused_forward(fn, x) if b is None else elementwise.fused_forward(fn, x, b)
    want_z = x if b is None else elementwise.fused_forward(lambda p, q: p + q, x, b)
    assert y.strides == x.strides and z.strides == x.strides
    np.testing.assert_array_equal(_bits(cp.asnumpy(y)), _bits(cp.asnumpy(want_y)), err_msg=f"{name} {kind} y")
    np.testing.assert_array_equal(_bits(cp.asnumpy(z)), _bits(cp.asnumpy(want_z)), err_msg=f"{name} {kind} z")


@pytest.mark.parametrize("dtype", HALVES + [np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("name", sorted(_acts()))
def test_act_grad_equals_the_traced_kernel(dtype, name):
    cp = cupy_module()
    from fluxpy.kernels import elementwise
    from fluxpy.ops.bias_act import derivative_from_saved
    derivative = derivative_from_saved(_acts()[name])[0]
    rng = np.random.default_rng(9)
    dy, s = (cp.asarray(rng.standard_normal((3, 1001)).astype(np.float32).astype(dtype)) for _ in range(2))
    got = cuda_halves.act_grad(dy, s, elementwise._act_text(derivative, dtype))
    want = elementwise._dz_kernel(derivative, s.dtype)(dy, s)
    np.testing.assert_array_equal(_bits(cp.asnumpy(got)), _bits(cp.asnumpy(want)), err_msg=name)


def test_bias_act_refuses_what_it_does_not_take():
    cp = cupy_module()
    x = cp.ones((4, 12), BFLOAT16)
    assert not cuda_halves.supports_bias_act(x, cp.ones(12, BFLOAT16))             # 12 channels: not whole vectors
    assert not cuda_halves.supports_bias_act(x.astype(np.float64), None)          # float64: CuPy's kernels do
    assert not cuda_halves.supports_bias_act(x, cp.ones((4, 1), BFLOAT16))          # a column, not a row bias
    assert not cuda_halves.supports_bias_act(cp.ones((4, 16), BFLOAT16), cp.ones(16, np.float16))   # dtypes differ
    nchw = cp.ones((2, 16, 3, 3), BFLOAT16)
    assert not cuda_halves.supports_bias_act(nchw, cp.ones((1, 16, 1, 1), BFLOAT16))   # NCHW channels: not a period
