"""cuDNN's fused attention (fluxpy.kernels.cudnn.attention, through ``dot_product_attention(..., need_scores=False)``)
on the GPU: forward and every gradient against the composite in float32 on the same inputs (rounded to the half
type), causal, boolean masks (shared, per batch, key padding), an additive bias with its gradient, several heads and
head sizes; the transformer layers in bfloat16 use it; a captured step through it equals the eager step; a repeated
call builds nothing; a problem cuDNN cannot take runs the composite and says why.
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import gradient
from fluxpy.kernels.cudnn import attention as fused
from fluxpy.ops.attention import dot_product_attention, fused_reason

pytestmark = pytest.mark.gpu

# Relative error of a half-precision attention against float32 on the same (rounded) inputs, by dtype.
TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2}


def _half(name):
    from ml_dtypes import bfloat16
    return {"float16": np.float16, "bfloat16": bfloat16}[name]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def _inputs(rng, n, lq, lk, heads, d, dtype):
    """q, k, v drawn on the host, rounded to ``dtype`` (so the float32 reference sees the same numbers)."""
    half = _half(dtype)
    return [rng.standard_normal((n, length, heads * d)).astype(half).astype(np.float32)
            for length in (lq, lk, lk)]


def _loss_and_grads(q, k, v, heads, dtype, **kw):
    """The attention's output and the gradients of ``sum(y * w)`` (``w`` drawn) to q, k, v and a bias, on the GPU
    in ``dtype`` (``need_scores=False``; float32, the reference, asks for the scores, so the composite runs)."""
    import cupy as cp
    w = cp.asarray(np.random.default_rng(9).standard_normal((q.shape[0], q.shape[1], v.shape[2])), dtype=np.float32)
    reference = dtype == "float32"
    cast = (lambda a: a) if reference else (lambda a: fluxpy.ops.shape.astype(a, _half(dtype)))
    arrays = [cp.asarray(a) for a in (q, k, v)]
    bias = kw.pop("bias", None)
    args = arrays + ([cp.asarray(bias)] if bias is not None else [])

    def loss(*a):
        b = a[3] if len(a) > 3 else None
        y, scores = dot_product_attention(cast(a[0]), cast(a[1]), cast(a[2]), nheads=heads, need_scores=reference,
                                          bias=None if b is None else cast(b), **kw)
        assert (scores is None) != reference
        return (fluxpy.ops.shape.astype(y, np.float32) * w).sum()

    def forward(*a):
        b = a[3] if len(a) > 3 else None
        return dot_product_attention(cast(a[0]), cast(a[1]), cast(a[2]), nheads=heads, need_scores=reference,
                                     bias=None if b is None else cast(b), **kw)[0]

    y = forward(*args)
    reason = fused_reason()
    grads = gradient(loss, *args)
    return np.asarray(y.astype(np.float32).get()), [g.get() for g in grads], reason


CASES = [   # n, lq, lk, heads, d, keywords
    (2, 64, 64, 3, 64, {}),
    (2, 33, 47, 2, 32, {}),
    (1, 128, 128, 4, 64, {"causal": True}),
    (3, 16, 24, 2, 128, {}),
    (2, 40, 40, 1, 16, {"causal": True}),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fused_attention_equals_the_composite(case, dtype):
    n, lq, lk, heads, d, kw = CASES[case]
    rng = np.random.default_rng(case)
    q, k, v = _inputs(rng, n, lq, lk, heads, d, dtype)
    y, grads, reason = _loss_and_grads(q, k, v, heads, dtype, **kw)
    assert reason == "", f"the fused kernels did not run: {reason}"
    ref_y, ref_grads, _ = _loss_and_grads(q, k, v, heads, "float32", **kw)
    assert _rel(y, ref_y) < TOLERANCE[dtype], f"output: {_rel(y, ref_y)}"
    for name, g, r in zip("qkv", grads, ref_grads):
        assert np.isfinite(g).all()
        assert _rel(g, r) < 2 * TOLERANCE[dtype], f"d{name}: {_rel(g, r)}"
    # the same problem again: nothing is built
    built = fused.stats()["built"]
    _loss_and_grads(q, k, v, heads, dtype, **kw)
    assert fused.stats()["built"] == built


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mask_kind", ["shared", "per_batch", "key_padding"])
def test_fused_attention_with_boolean_masks(mask_kind, dtype):
    rng = np.random.default_rng(3)
    n, l, heads, d = 3, 48, 2, 64
    q, k, v = _inputs(rng, n, l, l, heads, d, dtype)
    if mask_kind == "shared":
        mask = rng.random((l, l)) < 0.7
    elif mask_kind == "per_batch":
        mask = rng.random((n, 1, l, l)) < 0.7
    else:
        lengths = rng.integers(5, l + 1, n)
        mask = (np.arange(l)[None, :] < lengths[:, None])[:, None, None, :]
    mask[..., 0] = True   # every query sees at least one key (a fully masked row is NaN on both paths)
    import cupy as cp
    y, grads, reason = _loss_and_grads(q, k, v, heads, dtype, mask=cp.asarray(mask))
    assert reason == "", reason
    ref_y, ref_grads, _ = _loss_and_grads(q, k, v, heads, "float32", mask=cp.asarray(mask))
    assert _rel(y, ref_y) < TOLERANCE[dtype]
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < 2 * TOLERANCE[dtype]


@pytest.mark.parametrize("bias_shape", [(1, 2, 32, 32), (32, 32)])
def test_fused_attention_with_a_bias_and_its_gradient(bias_shape):
    rng = np.random.default_rng(5)
    n, l, heads, d = 2, 32, 2, 64
    q, k, v = _inputs(rng, n, l, l, heads, d, "bfloat16")
    bias = rng.standard_normal(bias_shape).astype(_half("bfloat16")).astype(np.float32)
    y, grads, reason = _loss_and_grads(q, k, v, heads, "bfloat16", bias=bias)
    ref_y, ref_grads, _ = _loss_and_grads(q, k, v, heads, "float32", bias=bias)
    if reason:   # cuDNN may not compute this bias's gradient: then the composite ran, and must be right
        assert "declined" in reason, reason
    assert _rel(y, ref_y) < TOLERANCE["bfloat16"]
    assert grads[3].shape == bias.shape
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < 2 * TOLERANCE["bfloat16"]


def test_declined_problems_run_the_composite_and_say_why():
    import cupy as cp
    rng = np.random.default_rng(1)
    q = cp.asarray(rng.standard_normal((2, 8, 2 * 12)).astype(np.float16))   # head size 12: not a multiple of 8
    y, _ = dot_product_attention(q, q, q, nheads=2, need_scores=False)
    assert "multiples of 8" in fused_reason()
    ref, _ = dot_product_attention(q.astype(np.float32), q.astype(np.float32), q.astype(np.float32), nheads=2)
    assert _rel(y.astype(np.float32).get(), ref.get()) < 1e-2
    dot_product_attention(q, q, q, nheads=2)   # scores asked for: the composite, no reason recorded as fused
    assert isinstance(fused_reason(), str)


def test_second_derivatives_run_the_composite():
    import cupy as cp
    from ml_dtypes import bfloat16
    rng = np.random.default_rng(2)
    q = cp.asarray(rng.standard_normal((1, 8, 16)).astype(bfloat16))

    f32 = lambda a: fluxpy.ops.shape.astype(a, np.float32)   # noqa: E731

    def inner(x):
        return gradient(lambda z: f32(dot_product_attention(z, z, z, need_scores=False)[0] ** 2).sum(), x)[0]

    g2 = gradient(lambda x: f32(inner(x)).sum(), q)[0]
    assert "derivative of a derivative" in fused_reason()
    assert np.isfinite(g2.astype(np.float32).get()).all()


def _dropped(q, k, v, heads, p, w=None, **kw):
    y, _ = dot_product_attention(q, k, v, nheads=heads, dropout=p, need_scores=False, **kw)
    return y if w is None else float((y.astype(np.float32) * w).sum())


def test_fused_dropout_draws_new_masks_and_averages_to_attention_without_dropout():
    import cupy as cp
    rng = np.random.default_rng(4)
    q, k, v = (cp.asarray(a, dtype=np.float16) for a in _inputs(rng, 2, 64, 64, 2, 64, "float16"))
    plain = _dropped(q, k, v, 2, None).astype(np.float32)
    first, second = (_dropped(q, k, v, 2, 0.3) for _ in range(2))
    assert fused_reason() == "", fused_reason()
    assert not cp.array_equal(first, second), "two calls drew the same dropout mask"
    mean = sum(_dropped(q, k, v, 2, 0.3).astype(np.float32) for _ in range(400)) / 400
    assert _rel(mean.get(), plain.get()) < 0.1


@pytest.mark.parametrize("p", [None, 0.25])
def test_fused_dropout_backward_uses_the_forward_mask(p):
    """A central difference of the loss along the change between two rounded float16 inputs equals the gradient's
    inner product with that change, with the generator put back to the same position for every evaluation."""
    import cupy as cp
    from fluxpy.random import rng_for
    rng = np.random.default_rng(6)
    q, k, v = (cp.asarray(a, dtype=np.float16) for a in _inputs(rng, 2, 32, 32, 2, 64, "float16"))
    w = cp.asarray(rng.standard_normal((2, 32, 128)), dtype=np.float32)
    direction = cp.asarray(rng.standard_normal(q.shape), dtype=np.float32)
    up, down = ((q.astype(np.float32) + s * 0.05 * direction).astype(np.float16) for s in (1, -1))
    offset = rng_for(cp).offset()
    start = offset.copy()

    def loss(qq):
        offset[...] = start
        return _dropped(qq, k, v, 2, p, w)

    difference = loss(up) - loss(down)
    offset[...] = start
    g = gradient(lambda qq: (fluxpy.ops.shape.astype(_dropped(qq, k, v, 2, p), np.float32) * w).sum(), q)[0]
    assert fused_reason() == "", fused_reason()
    predicted = float((g.astype(np.float32) * (up.astype(np.float32) - down.astype(np.float32))).sum())
    assert abs(difference - predicted) < 0.05 * abs(predicted) + 1e-2, (difference, predicted)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_transformer_step_is_captured_fused_and_equals_the_eager_step(precision, dropout):
    import cupy as cp
    from fluxpy import Adam, Chain, Dense, TrainStep, TransformerEncoderLayer, mixed_precision, setup

    def model():
        return Chain(TransformerEncoderLayer(64, 2, 128, dropout=dropout, rng=1),
                     TransformerEncoderLayer(64, 2, 128, dropout=dropout, rng=2),
                     lambda h: fluxpy.mean(h, axis=1), Dense(64, 10, rng=3))

    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((8, 32, 64)).astype(np.float32))
    y = cp.asarray(rng.integers(0, 10, 8))
    results = []
    for capture in (False, True):
        m = mixed_precision(fluxpy.gpu(model()), precision)
        step = TrainStep(lambda m, x, y: fluxpy.logitcrossentropy(m(x), y), m, setup(Adam(1e-3), m),
                         capture=capture, warmup=1)
        executed = fused.stats()["executed"]
        fluxpy.seed(7)
        losses = [float(step(x, y)) for _ in range(4)]
        assert fused.stats()["executed"] > executed, "the transformer layers did not run fused attention"
        if capture:
            assert set(step.captured().values()) == {"captured"}, step.captured()
        results.append(np.array(losses))
    eager, captured = results
    assert np.isfinite(captured).all()
    np.testing.assert_allclose(captured, eager, rtol=2e-2)
