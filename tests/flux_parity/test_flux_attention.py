"""Flux.jl's ``test/layers/attention.jl`` known-answer cases (FluxML/Flux.jl at 3f2f828), in fluxpy, batch first.

Flux's ``q`` ``(dim, len, batch)`` is fluxpy's ``(batch, len, dim)``; its scores ``α`` ``(kv_len, q_len, nheads,
batch)`` are fluxpy's ``(batch, nheads, q_len, kv_len)``, so Flux's ``α[2, 1, :, :]`` (key 2, query 1) is
``scores[:, :, 0, 1]`` and its upper-triangular ``α[:, :, 1, 1]`` (keys up to the query) is a lower-triangular
``scores[0, 0]``. Flux's ``MultiHeadAttention(4 => 10 => 5)`` is ``MultiHeadAttention(4, qk_dim=10, v_dim=10,
out_dim=5)``; its positional attention bias ``mha(q, k, v, b)`` is the keyword ``bias=`` here (fluxpy's fourth
positional argument is the mask), with ``b`` in the scores' (query, key) order.
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import MultiHeadAttention
from fluxpy.ops.attention import causal_mask, dot_product_attention
from tests.gradcheck import check_grad

DIM, NHEADS, LEN, BATCH = 4, 2, 3, 5


def rand32(*shape, seed=0):
    return np.random.default_rng(seed).random(shape).astype(np.float32)


@pytest.fixture
def qkv():
    return rand32(BATCH, LEN, DIM, seed=1), rand32(BATCH, LEN, DIM, seed=2), rand32(BATCH, LEN, DIM, seed=3)


def test_shapes_and_dtypes(qkv):
    # attention.jl:3-14
    mha = MultiHeadAttention(DIM, nheads=NHEADS)
    y, a = mha(*qkv)
    assert y.dtype == np.float32 and y.shape == (BATCH, LEN, DIM)
    assert a.dtype == np.float32 and a.shape == (BATCH, NHEADS, LEN, LEN)


def test_self_attention_and_shared_key_value(qkv):
    # attention.jl:16-28
    q, k, _ = qkv
    mha = MultiHeadAttention(DIM, nheads=NHEADS)
    for (y1, a1), (y2, a2) in [(mha(q), mha(q, q, q)), (mha(q, k), mha(q, k, k))]:
        np.testing.assert_allclose(y1, y2, rtol=1e-6)
        np.testing.assert_allclose(a1, a2, rtol=1e-6)


def test_change_dims(qkv):
    # attention.jl:30-36: dims = 4 => 10 => 5 (the test builds it with nheads = 2, not its nhead = 5)
    mha2 = MultiHeadAttention(4, nheads=NHEADS, qk_dim=10, v_dim=10, out_dim=5)
    y2, _ = mha2(*qkv)
    assert y2.shape == (BATCH, LEN, 5)
    assert repr(mha2) == "MultiHeadAttention(4, nheads=2, qk_dim=10, v_dim=10, out_dim=5)"
    m = MultiHeadAttention(4, nheads=2, kdim=3, vdim=7, qk_dim=6, v_dim=8, out_dim=5)   # Flux's (4, 3, 7) => (6, 8) => 5
    y, a = m(qkv[0], rand32(BATCH, 6, 3), rand32(BATCH, 6, 7))
    assert y.shape == (BATCH, LEN, 5) and a.shape == (BATCH, 2, LEN, 6)
    with pytest.raises(ValueError, match=r"MultiHeadAttention: nheads 4 must divide qk_dim 6"):
        MultiHeadAttention(4, nheads=4, qk_dim=6)
    with pytest.raises(fluxpy.DimensionMismatch, match=r"expects k of shape \(N, L, 3\), got \(5, 3, 4\)"):
        m(*qkv)


def _assert_causal(a):
    assert (a[:, :, 0, 1] == 0).all()                                 # Flux's all(α[2, 1, :, :] .== 0)
    np.testing.assert_allclose(a[0, 0], np.tril(a[0, 0]), rtol=1e-6)   # Flux's α[:, :, 1, 1] ≈ triu(...)


def test_mask(qkv):
    # attention.jl:38-43 (NNlib.make_causal_mask(q) is causal_mask(q))
    mha = MultiHeadAttention(DIM, nheads=NHEADS)
    _, a = mha(qkv[0], mask=causal_mask(qkv[0]))
    _assert_causal(a)


def test_bias_as_a_causal_mask(qkv):
    # attention.jl:45-53: b[i, j] = typemax(Float32) = Inf for j >= i in Flux's (key, query) order, so every key up
    # to the query gets +Inf and the later ones none of the softmax (fluxpy's softmax splits evenly among +Inf, as
    # NNlib's); in the (query, key) order here that is the lower triangle
    b = np.where(np.tril(np.ones((LEN, LEN), bool)), np.float32(np.inf), np.float32(0))
    mha = MultiHeadAttention(DIM, nheads=NHEADS)
    _, a = mha(*qkv, bias=b)
    _assert_causal(a)
    np.testing.assert_allclose(a[0, 0, 2], [1 / 3] * 3, rtol=1e-6)


def test_gradient(qkv):
    # attention.jl:55-62: test_gradients(mha, q; loss = sum(y.^2) + sum(α.^2)), in float64 against finite differences
    mha = fluxpy.f64(MultiHeadAttention(DIM, nheads=NHEADS, bias=True, rng=0))
    q = qkv[0].astype(np.float64)

    def loss(m, q):
        y, a = m(q)
        return (y ** 2).sum() + (a ** 2).sum()
    check_grad(lambda q: loss(mha, q), q)
    check_grad(lambda w: loss(_with_q_weight(mha, w), q), mha.q_proj.weight.copy())


def _with_q_weight(mha, w):
    import copy
    m = copy.copy(mha)
    m.q_proj = copy.copy(mha.q_proj)
    m.q_proj.weight = w
    return m


def test_bias_against_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, 4)) for _ in range(3))
    b = rng.standard_normal((3, 3))
    y, _ = dot_product_attention(q, k, v, bias=b)
    t = torch.nn.functional.scaled_dot_product_attention(*(torch.tensor(a) for a in (q, k, v)),
                                                         attn_mask=torch.tensor(b))   # a float mask is added
    np.testing.assert_allclose(y, t.numpy(), rtol=1e-13)
    with pytest.raises(ValueError, match=r"expects a bias broadcasting to \(Lq, Lk\) = \(3, 3\)"):
        dot_product_attention(q, k, v, bias=np.zeros((3, 4)))
    g = fluxpy.gradient(lambda b: dot_product_attention(q, k, v, bias=b)[0].sum(), b)[0]
    tb = torch.tensor(b, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(*(torch.tensor(a) for a in (q, k, v)), attn_mask=tb).sum().backward()
    np.testing.assert_allclose(g, tb.grad.numpy(), rtol=1e-12)
