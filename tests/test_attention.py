"""dot_product_attention and MultiHeadAttention against NumPy (heads, masks, the causal mask), gradients against
float64 finite differences (hypothesis draws sizes), errors naming the op or layer, and PyTorch's attention where
torch is installed."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import MultiHeadAttention, causal_mask, dot_product_attention
from gradcheck import check_grad


def _np_attention(q, k, v, nheads, mask=None):
    n, lq, d = q.shape
    dh, dv = d // nheads, v.shape[2] // nheads
    qh = q.reshape(n, lq, nheads, dh).transpose(0, 2, 1, 3)
    kh = k.reshape(n, k.shape[1], nheads, dh).transpose(0, 2, 1, 3)
    vh = v.reshape(n, v.shape[1], nheads, dv).transpose(0, 2, 1, 3)
    logits = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(dh)
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    s = e / e.sum(axis=-1, keepdims=True)
    return (s @ vh).transpose(0, 2, 1, 3).reshape(n, lq, nheads * dv), s


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.sampled_from([1, 2]), st.integers(1, 3),
       st.booleans())
def test_attention_matches_numpy_and_finite_differences(n, lq, lk, nheads, dh, causal):
    rng = np.random.default_rng(n * 1000 + lq * 100 + lk * 10 + nheads)
    q, k = rng.standard_normal((n, lq, nheads * dh)), rng.standard_normal((n, lk, nheads * dh))
    v = rng.standard_normal((n, lk, nheads * 2))
    mask = np.tril(np.ones((lq, lk), bool)) if causal else None
    y, s = dot_product_attention(q, k, v, mask, nheads)
    wy, ws = _np_attention(q, k, v, nheads, mask)
    np.testing.assert_allclose(y, wy, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(s, ws, rtol=1e-10, atol=1e-12)
    check_grad(lambda q, k, v: dot_product_attention(q, k, v, mask, nheads)[0], q, k, v)


def test_masks():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 6))
    assert np.array_equal(causal_mask(x), np.tril(np.ones((4, 4), bool))) and causal_mask(2).shape == (2, 2)
    _, s = dot_product_attention(x, x, x, causal_mask(x), nheads=3)
    assert np.all(s[..., 0, 1:] == 0) and np.allclose(s.sum(-1), 1)
    none = np.zeros((4, 4), bool)
    y, _ = dot_product_attention(x, x, x, none)
    assert np.isnan(y).all()                    # no key allowed: NaN, as NNlib and PyTorch
    with pytest.raises(TypeError, match="boolean mask"):
        dot_product_attention(x, x, x, np.ones((4, 4)))
    with pytest.raises(ValueError, match=r"mask broadcasting to \(Lq, Lk\) = \(4, 4\)"):
        dot_product_attention(x, x, x, np.ones((4, 5), bool))
    with pytest.raises(ValueError, match="nheads, an int >= 1 that divides dim 6"):
        dot_product_attention(x, x, x, nheads=4)
    with pytest.raises(ValueError, match="one N, dim and Lk"):
        dot_product_attention(x, x[:, :, :4], x)


def test_multi_head_attention_composes_its_projections():
    rng = np.random.default_rng(2)
    mha = fluxpy.f64(MultiHeadAttention(6, nheads=2, bias=True, rng=0))
    for d in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
        d.bias[...] = rng.standard_normal(6)
    q, kv = rng.standard_normal((2, 3, 6)), rng.standard_normal((2, 5, 6))
    y, s = mha(q, kv)
    wy, ws = _np_attention(mha.q_proj(q), mha.k_proj(kv), mha.v_proj(kv), 2)
    np.testing.assert_allclose(s, ws, rtol=1e-10)
    np.testing.assert_allclose(y, mha.out_proj(wy), rtol=1e-10)
    (g,) = fluxpy.gradient(lambda m: (m(q, kv)[0] ** 2).sum(), mha)
    assert all(g[name]["weight"] is not None for name in ("q_proj", "k_proj", "v_proj", "out_proj"))
    check_grad(lambda q: mha(q)[0], q)
    assert repr(MultiHeadAttention(8)) == "MultiHeadAttention(8, nheads=8)"
    with pytest.raises(ValueError, match="nheads 3 must divide dim 8"):
        MultiHeadAttention(8, nheads=3)
    with pytest.raises(fluxpy.DimensionMismatch, match=r"expects k of shape \(N, L, 6\)"):
        mha(q, np.ones((2, 5, 4)))


def test_attention_dropout_only_while_training():
    x = np.random.default_rng(3).standard_normal((2, 5, 4)).astype(np.float32)
    mha = MultiHeadAttention(4, nheads=2, dropout=0.5, rng=0)
    y1, _ = mha(x)
    y2, _ = mha(x)
    np.testing.assert_array_equal(y1, y2)      # inference: no dropout
    fluxpy.trainmode(mha)
    ys = [mha(x)[0] for _ in range(3)]
    assert not all(np.array_equal(ys[0], y) for y in ys[1:])


def test_against_pytorch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, 8)) for _ in range(3))
    mask = np.tril(np.ones((3, 3), bool))
    y, _ = dot_product_attention(q, k, v, mask, nheads=2)
    tq, tk, tv = (torch.from_numpy(a).reshape(2, 3, 2, 4).transpose(1, 2) for a in (q, k, v))
    ty = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(mask))
    np.testing.assert_allclose(y, ty.transpose(1, 2).reshape(2, 3, 8).numpy(), rtol=1e-10, atol=1e-12)
    mha = fluxpy.f64(MultiHeadAttention(8, nheads=2, rng=1))
    t = torch.nn.MultiheadAttention(8, 2, bias=False, batch_first=True).double()
    with torch.no_grad():
        t.in_proj_weight.copy_(torch.from_numpy(np.concatenate([mha.q_proj.weight, mha.k_proj.weight,
                                                                mha.v_proj.weight])))
        t.out_proj.weight.copy_(torch.from_numpy(mha.out_proj.weight))
    want, want_w = t(*(torch.from_numpy(a) for a in (q, k, v)), average_attn_weights=False)
    got, got_w = mha(q, k, v)
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got_w, want_w.detach().numpy(), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Half precision (PyTorch's autocast recipe): products in the half type, logits, bias, mask, softmax and dropout in
# float32, the scores rounded to the half type before they weigh v


HALVES = {"float16": (np.dtype(np.float16), 2.0 ** -11), "bfloat16": (fluxpy.kernels.halfs.BFLOAT16, 2.0 ** -8)}


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("half", sorted(HALVES))
def test_half_attention_runs_its_products_in_the_half_type_and_its_softmax_in_float32(half, monkeypatch):
    import fluxpy.ops.attention as attention
    dtype, eps = HALVES[half]
    seen = {"matmul": [], "softmax": [], "dropout": []}

    def spy(name, f):
        def call(x, *args, **kw):
            seen[name].append([fluxpy.value_of(a).dtype for a in (x, *args) if hasattr(a, "dtype")])
            return f(x, *args, **kw)
        return call
    monkeypatch.setattr(attention, "matmul", spy("matmul", attention.matmul))
    monkeypatch.setattr(attention, "softmax", spy("softmax", attention.softmax))
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, l, 8)).astype(dtype) for l in (3, 5, 5))
    bias = rng.standard_normal((3, 5)).astype(dtype)
    keep = (rng.random((2, 2, 3, 5)) > 0.2) / 0.8
    drop = spy("dropout", lambda s: s * keep.astype(np.float32))
    mask = np.tril(np.ones((3, 5), bool), 2)
    y, s = dot_product_attention(q, k, v, mask, 2, drop, bias=bias)
    assert y.dtype == s.dtype == dtype and y.shape == (2, 3, 8) and s.shape == (2, 2, 3, 5)
    assert seen["matmul"] == [[dtype, dtype]] * 2
    assert seen["softmax"] == [[np.float32]] and seen["dropout"] == [[np.float32]]
    wide = [a.astype(np.float32) for a in (q, k, v, bias)]
    wy, ws = dot_product_attention(*wide[:3], mask, 2, lambda s: s * keep.astype(np.float32), bias=wide[3])
    assert _rel(y, wy) < 8 * eps and _rel(s, ws) < 4 * eps


@pytest.mark.parametrize("half", sorted(HALVES))
def test_half_attention_gradients_are_of_the_half_type_and_close_to_float32(half):
    dtype, eps = HALVES[half]
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, l, 6)).astype(dtype) for l in (4, 4, 4))
    bias = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)   # a float32 bias joins the float32 logits
    dy = rng.standard_normal((2, 4, 6)).astype(np.float32)

    def f(q, k, v, bias):
        y, _ = dot_product_attention(q, k, v, causal_mask(4), 3, bias=bias)
        return (fluxpy.ops.shape.astype(y, np.float32) * dy).sum()
    got = fluxpy.gradient(f, q, k, v, bias)
    want = fluxpy.gradient(f, *(a.astype(np.float32) for a in (q, k, v)), bias)
    for g, w, a in zip(got, want, (q, k, v, bias)):
        assert g.dtype == a.dtype and np.isfinite(g.astype(np.float32)).all()
        assert _rel(g, w) < 16 * eps


@pytest.mark.parametrize("half", sorted(HALVES))
def test_multi_head_attention_in_mixed_precision_with_dropout_trains(half):
    from fluxpy import mixed_precision
    from fluxpy.optimise import Adam, setup, update
    dtype, eps = HALVES[half]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 5, 8)).astype(np.float32)
    mha = MultiHeadAttention(8, nheads=2, dropout=0.1, rng=0)
    m = mixed_precision(mha, half)
    y, s = m(x)
    assert y.dtype == s.dtype == np.float32
    want_y, want_s = mha(x)
    assert _rel(y, want_y) < 12 * eps and _rel(s, want_s) < 8 * eps
    opt = setup(Adam(1e-3), m)
    before = mha.q_proj.weight.copy()
    loss, (g,) = fluxpy.withgradient(lambda m: (m(x)[0] ** 2).mean(), m)
    assert np.isfinite(loss) and all(a.dtype == np.float32 for a in fluxpy.trainables(g))
    update(opt, m, g)
    assert mha.q_proj.weight.dtype == np.float32 and not np.array_equal(before, mha.q_proj.weight)
