"""Dropout's one-kernel GPU path (``cuda/dropout.cu``, :meth:`PhiloxGenerator.dropout`, the ``dropout`` op's node):
its mask and output equal the generator's numbers thresholded and scaled, bit for bit against the host, in every
dtype and in channels-last memory; the position moves as a draw of the same size moves it; the gradient is the
cotangent times the mask, through the op, a second derivative and a captured step; what the kernel does not take
(``dims``, ``p = 1``, a host generator) keeps the composite.
"""
import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy.kernels import find
from fluxpy.kernels.halfs import BFLOAT16
from fluxpy.kernels.philox import PER_COUNTER, PhiloxGenerator, uniform_numpy
from fluxpy.layout import is_channels_last, to_channels_last
from fluxpy.ops.dropout import dropout

pytestmark = pytest.mark.gpu

DTYPES = [np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)]


def _real(dtype):
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _host_dropout(x, key, offset, p):
    """``(y, mask)`` on the host from the generator's reference numbers, flat: item i of ``x`` taking number i."""
    real = _real(x.dtype)
    flat = x.ravel()
    u = uniform_numpy(key, offset, flat.size, real)
    mask = ((u >= real.type(p)).astype(real) * real.type(1 / (1 - p))).astype(x.dtype)
    y = (flat.astype(real) * mask.astype(real)).astype(x.dtype)
    return y, mask


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 65), (4, 3, 5, 129)])
@pytest.mark.parametrize("p", [0.1, 0.37, 0.9])
def test_the_kernel_equals_the_generators_numbers_thresholded(dtype, shape, p):
    cp = cupy_module()
    rng = np.random.default_rng(len(shape) * 7 + int(p * 100))
    x_host = (rng.standard_normal(shape) * 3).astype(np.float32).astype(dtype)
    gen = PhiloxGenerator(2**35 + 3)
    gen.random(5, dtype=np.float32)                           # a position that is not 0
    start = int(gen.offset()[0])
    y, mask = gen.dropout(cp.asarray(x_host), p)
    want_y, want_mask = _host_dropout(x_host, gen.key, start, p)
    assert y.dtype == dtype and mask.dtype == dtype and y.shape == shape
    np.testing.assert_array_equal(_bits(cp.asnumpy(mask).ravel()), _bits(want_mask))
    np.testing.assert_array_equal(_bits(cp.asnumpy(y).ravel()), _bits(want_y))
    per = PER_COUNTER[_real(dtype)]
    assert int(gen.offset()[0]) == start + -(-x_host.size // per)   # as far as random() of that size moves it


@pytest.mark.parametrize("dtype", [BFLOAT16, np.dtype(np.float32)], ids=str)
def test_channels_last_data_keeps_its_layout_and_draws_in_memory_order(dtype):
    cp = cupy_module()
    x = to_channels_last(cp.asarray(np.random.default_rng(1).standard_normal((2, 16, 5, 3)).astype(dtype)))
    gen = PhiloxGenerator(9)
    y, mask = gen.dropout(x, 0.25)
    assert is_channels_last(y) and is_channels_last(mask)
    def nhwc(a):   # the items in memory order
        return cp.asnumpy(a.transpose(0, 2, 3, 1))
    want_y, want_mask = _host_dropout(nhwc(x), gen.key, 0, 0.25)
    np.testing.assert_array_equal(_bits(nhwc(y).ravel()), _bits(want_y))
    np.testing.assert_array_equal(_bits(nhwc(mask).ravel()), _bits(want_mask))


def test_the_op_is_one_node_and_its_gradient_is_the_mask():
    cp = cupy_module()
    rng = np.random.default_rng(3)
    x = cp.asarray(rng.standard_normal((64, 96)).astype(np.float32))
    w = cp.asarray(rng.standard_normal((64, 96)).astype(np.float32))
    fluxpy.seed(5)
    y = dropout(x, 0.3)
    fluxpy.seed(5)
    g, = fluxpy.gradient(lambda x: (dropout(x, 0.3) * w).sum(), x)
    kept = cp.asnumpy(y) != 0
    scale = np.float32(1 / (1 - 0.3))
    np.testing.assert_array_equal(cp.asnumpy(g), np.where(kept, cp.asnumpy(w) * scale, 0).astype(np.float32))
    assert 0.6 < kept.mean() < 0.8
    # the same mask as the composite drawn from the same position (fluxpy.seed makes the generator again)
    fluxpy.seed(5)
    u = fluxpy.random.rng_for(cp).random(x.shape, dtype=np.float32)
    np.testing.assert_array_equal(kept, cp.asnumpy(u >= np.float32(0.3)))


def test_a_second_derivative_runs_the_composite():
    cp = cupy_module()
    x = cp.asarray(np.random.default_rng(4).standard_normal(200))
    gen = PhiloxGenerator(1)
    gen2 = PhiloxGenerator(1)
    mask = gen2.dropout(x, 0.5)[1]

    def f(x):   # d/dx sum(dropout(x)^3) = 3 x^2 mask^3 ... differentiated again: 6 x mask^3
        g, = fluxpy.gradient(lambda x: (dropout(x, 0.5, rng=gen) ** 3).sum(), x)
        return g.sum()
    h, = fluxpy.gradient(f, x)
    np.testing.assert_allclose(cp.asnumpy(h), cp.asnumpy(6 * x * mask ** 3), rtol=1e-12)


def test_what_the_kernel_does_not_take_keeps_the_composite():
    cp = cupy_module()
    x = cp.asarray(np.random.default_rng(6).standard_normal((8, 16)).astype(np.float32))
    gen = PhiloxGenerator(2)
    assert find("dropout", x, 0.5, gen) is not None
    assert find("dropout", x, 1.0, gen) is None and find("dropout", x, 0.5, cp.random.default_rng(0)) is None
    assert find("dropout", x[:, ::2], 0.5, gen) is None                       # strided: the composite
    assert float(cp.abs(dropout(x, 1.0, rng=gen)).sum()) == 0.0
    y = dropout(x, 0.5, rng=gen, dims=0)                                      # a mask shared along axis 1
    rows = cp.asnumpy(y != 0).any(axis=1)
    np.testing.assert_array_equal(cp.asnumpy(y != 0), np.repeat(rows[:, None], 16, axis=1) & cp.asnumpy(x != 0))
    y = dropout(x[:, ::2], 0.5, rng=gen)
    assert y.shape == (8, 8) and set(np.unique(cp.asnumpy(y / x[:, ::2])).round(5).tolist()) <= {0.0, 2.0}


def test_a_captured_step_draws_a_new_mask_at_every_replay():
    cp = cupy_module()
    from fluxpy.layers import Chain, Dense, Dropout
    from fluxpy.optimise import Descent, setup
    model = fluxpy.gpu(Chain(Dense(32, 64), Dropout(0.5), Dense(64, 4)))
    x = cp.asarray(np.random.default_rng(7).standard_normal((16, 32)).astype(np.float32))
    step = fluxpy.TrainStep(lambda m, x: (m(x) ** 2).mean(), model, setup(Descent(0.0), model), capture=True)
    losses = [float(step(x)) for _ in range(6)]
    assert list(step.captured().values()) == ["captured"]
    assert len(set(losses[2:])) == 4   # eta 0: the weights stay, so only the masks move the loss
