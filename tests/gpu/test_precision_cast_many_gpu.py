"""MixedPrecision's batched casts on the GPU (``fluxpy.kernels.cuda_halves.cast_many``, ``cuda/cast_many.cu``): the
kernel equals the per-array casts (``cuda_halves.cast``, then channels-last) and NumPy/ml_dtypes bit for bit, both
ways, with the loss scale; a MixedPrecision step casts every weight in one launch and every gradient back in one;
training with it equals training with the per-array casts bit for bit, eagerly and in a captured ``TrainStep``, in
bfloat16 and in float16 with a dynamic loss scale. Every test needs a GPU (``gpu`` marker)."""
import contextlib
import copy

import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy import kernels, mixed_precision, precision
from fluxpy.kernels import cuda_halves
from fluxpy.kernels.halfs import BFLOAT16
from fluxpy.layout import is_channels_last, to_channels_last
from fluxpy.optimise import Adam, setup
from test_mnist import reference_net
from test_precision_cast_many import assert_same, draw

pytestmark = pytest.mark.gpu

HALVES = [np.dtype(np.float16), BFLOAT16]
SHAPES = [(16, 4, 3, 3), (16,), (32, 16, 3, 3), (), (10, 288), (0, 3), (4097,), (3, 5, 7), (2, 8, 1, 1)]


def _weights(cp, rng):
    """float32 weights of every rank, a 4-d and a 3-d one channels-last, with the special values of ``draw``."""
    out = [cp.asarray(draw(rng, s)) for s in SHAPES]
    out[2], out[7] = to_channels_last(out[2]), to_channels_last(out[7])
    return out


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_the_kernel_equals_the_per_array_casts_both_ways(dtype):
    cp = cupy_module()
    rng = np.random.default_rng(0)
    ws = _weights(cp, rng)
    last = [(w.ndim == 4) or is_channels_last(w) for w in ws]
    halves = cuda_halves.cast_many(ws[0], ws, dtype, last)
    for w, h, cl in zip(ws, halves, last):
        want = fluxpy.ops.astype(w, dtype)
        want = to_channels_last(want) if cl and w.ndim >= 3 else want
        assert_same(cp.asnumpy(h), cp.asnumpy(want), f"{w.shape} -> {dtype}")
        assert is_channels_last(h) == is_channels_last(want) and h.data.ptr % 256 == 0
    dys = [cp.asarray(draw(rng, w.shape)).astype(dtype) for w in ws]
    dys[0] = to_channels_last(dys[0])                                       # channels-last to C order
    dys[4] = cp.ascontiguousarray(dys[4].T).T                               # a transposed matrix to C order
    dys[8] = cp.asarray(draw(rng, (4, 8, 2, 2))).astype(dtype)[::2, :, :1, :1]   # strided: copied first
    for scale in (None, 512.0, cp.asarray(np.float32(2.0 ** 11))):
        back = [is_channels_last(w) for w in ws]
        grads = cuda_halves.cast_many(dys[0], dys, np.float32, back, scale)
        for dy, g, cl in zip(dys, grads, back):
            want = fluxpy.ops.astype(dy, np.float32)
            if scale is not None:
                want = want / (np.float32(scale) if isinstance(scale, float) else scale)
            assert_same(cp.asnumpy(g), cp.asnumpy(want), f"{dy.shape} back, scale {scale}", layout=False)
            assert is_channels_last(g) == cl


@contextlib.contextmanager
def _counting():
    """Counts the calls of the kernel table's ``astype_many`` and ``astype`` (the per-array cast)."""
    calls = {"astype_many": 0, "astype": 0}
    before = kernels.snapshot()

    def spy(name):
        real, supports = cuda_halves.KERNELS[name]

        def counted(*args):
            calls[name] += 1
            return real(*args)
        kernels.register(name, "cupy", counted, supports)
    spy("astype_many")
    spy("astype")
    try:
        yield calls
    finally:
        kernels.restore(before)


def _loss(m, x, y):
    return fluxpy.logitcrossentropy(m(x), y)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_a_step_casts_the_weights_in_one_launch_and_their_gradients_in_one(dtype):
    cp = cupy_module()
    rng = np.random.default_rng(1)
    model = mixed_precision(fluxpy.gpu(reference_net(rng)), dtype)
    x = cp.asarray(rng.random((8, 1, 28, 28), dtype=np.float32))
    y = cp.asarray(fluxpy.onehotbatch(rng.integers(0, 10, 8), range(10)))
    with _counting() as calls:
        _, (g,) = fluxpy.withgradient(lambda m: _loss(m, x, y), model)
    assert precision.cast_reason() == ""
    assert calls["astype_many"] == 2, calls
    assert calls["astype"] < len(fluxpy.trainables(model)), f"per-array casts of weights: {calls}"
    for got, w in zip(fluxpy.trainables(g), fluxpy.trainables(model)):
        assert got.dtype == np.float32 and got.shape == w.shape and is_channels_last(got) == is_channels_last(w)


def _train(dtype, capture, batched, steps=6):
    """The MNIST net's weights after ``steps`` Adam steps in ``dtype`` (float16: a dynamic loss scale, one step
    overflowing), with the batched casts or the per-array ones."""
    cp = cupy_module()
    rng = np.random.default_rng(3)
    base = reference_net(rng)
    batches = [(cp.asarray(rng.random((16, 1, 28, 28), dtype=np.float32)),
                cp.asarray(fluxpy.onehotbatch(rng.integers(0, 10, 16), range(10))),
                cp.asarray(np.float32(1e4 if i == 3 and dtype == np.float16 else 1.0))) for i in range(steps)]
    kw = {"loss_scale": fluxpy.DynamicLossScale(init=2.0 ** 8, growth_interval=2)} if dtype == np.float16 else {}
    m = mixed_precision(fluxpy.gpu(copy.deepcopy(base)), dtype, **kw)
    step = fluxpy.TrainStep(lambda m, x, y, k: k * _loss(m, x, y), m, setup(Adam(1e-3), m), capture=capture)
    with contextlib.ExitStack() as stack:
        if not batched:
            stack.enter_context(pytest.MonkeyPatch.context()).setattr(
                precision, "_why_not_batched", lambda *a: "per-array casts asked for by the test")
        for b in batches:
            step(*b)
    if capture:
        assert list(step.captured().values()) == ["captured"], step.captured()
    scale = m.loss_scale.scale if dtype == np.float16 else None
    return [fluxpy.cpu(w) for w in fluxpy.trainables(m.model)], scale


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_training_with_the_batched_casts_equals_the_per_array_casts_captured_and_eager(dtype):
    with fluxpy.options(deterministic=True):
        want, want_scale = _train(dtype, capture=False, batched=False)
        for capture in (False, True):
            got, scale = _train(dtype, capture=capture, batched=True)
            assert scale == want_scale
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
