"""TransformerEncoderLayer and TransformerDecoderLayer: against a float64 NumPy transcription of PyTorch's
``TransformerEncoderLayer``/``TransformerDecoderLayer`` (batch first) with the same weights, against PyTorch itself
where it is installed, gradients against finite differences, masks, and errors that name the layer."""
import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import TransformerDecoderLayer, TransformerEncoderLayer, f64, gelu_erf, relu
from gradcheck import check_grad


def _dense(layer, x, act=None):
    y = x @ np.asarray(layer.weight, np.float64).T
    if layer.bias is not None:
        y = y + np.asarray(layer.bias, np.float64)
    return y if act is None else act(y)


def _norm(layer, x):
    m, v = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - m) / np.sqrt(v + layer.eps) * np.asarray(layer.gamma) + np.asarray(layer.beta)


def _attention(mha, q, kv, allowed):
    """PyTorch's multi-head attention: project, split heads, softmax(q k^T / sqrt(d) masked) v, join, project."""
    h = mha.nheads
    qp, kp, vp = _dense(mha.q_proj, q), _dense(mha.k_proj, kv), _dense(mha.v_proj, kv)
    split = lambda a: a.reshape(a.shape[0], a.shape[1], h, -1).transpose(0, 2, 1, 3)
    qh, kh, vh = split(qp), split(kp), split(vp)
    logits = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(qh.shape[-1])
    if allowed is not None:
        logits = np.where(allowed, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    y = (w @ vh).transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[1], -1)
    return _dense(mha.out_proj, y)


def _gelu_erf(x):
    return np.asarray(gelu_erf(x))


ACTS = {"relu": (relu, lambda x: np.maximum(x, 0)), "gelu_erf": (gelu_erf, _gelu_erf)}


def _reference_block(layer, x, act, sublayers):
    """PyTorch's residual wiring: pre-norm ``x + f(norm(x))`` or post-norm ``norm(x + f(x))``, per sub-layer."""
    for norm, f in sublayers:
        x = x + f(_norm(norm, x)) if layer.norm_first else _norm(norm, x + f(x))
    return x


def _reference_encoder(layer, x, act, allowed=None):
    ff = lambda h: _dense(layer.linear2, _dense(layer.linear1, h, act))
    return _reference_block(layer, x, act, [(layer.norm1, lambda h: _attention(layer.self_attn, h, h, allowed)),
                                            (layer.norm2, ff)])


def _reference_decoder(layer, x, memory, act, allowed=None):
    ff = lambda h: _dense(layer.linear2, _dense(layer.linear1, h, act))
    return _reference_block(layer, x, act, [(layer.norm1, lambda h: _attention(layer.self_attn, h, h, allowed)),
                                            (layer.norm2, lambda h: _attention(layer.cross_attn, h, memory, None)),
                                            (layer.norm3, ff)])


def _random_affine(layer, rng):
    """LayerNorms with random gamma and beta (their ones and zeros would hide a swapped parameter)."""
    for name in ("norm1", "norm2", "norm3"):
        norm = getattr(layer, name, None)
        if norm is not None:
            norm.gamma[...] = rng.standard_normal(norm.gamma.shape)
            norm.beta[...] = rng.standard_normal(norm.beta.shape)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 3), length=st.integers(1, 6), heads=st.sampled_from([1, 2]), head_dim=st.integers(2, 3),
       hidden=st.integers(1, 7), norm_first=st.booleans(), act=st.sampled_from(sorted(ACTS)), bias=st.booleans(),
       masked=st.sampled_from(["none", "causal", "keys"]), seed=st.integers(0, 2**31 - 1))
def test_the_encoder_layer_is_pytorchs_formula(n, length, heads, head_dim, hidden, norm_first, act, bias, masked,
                                                seed):
    rng = np.random.default_rng(seed)
    dim = heads * head_dim
    layer = f64(TransformerEncoderLayer(dim, heads, hidden, ACTS[act][0], norm_first=norm_first, bias=bias,
                                        rng=seed))
    _random_affine(layer, rng)
    x = rng.standard_normal((n, length, dim))
    key_mask = None
    allowed = None
    if masked == "causal":
        allowed = np.tril(np.ones((length, length), bool))
    elif masked == "keys":
        key_mask = rng.random((n, length)) < 0.7
        key_mask[:, 0] = True   # every query sees at least one key
        allowed = key_mask[:, None, None, :]
    got = layer(x, key_mask=key_mask, causal=masked == "causal")
    np.testing.assert_allclose(got, _reference_encoder(layer, x, ACTS[act][1], allowed), rtol=1e-10, atol=1e-10)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 3), length=st.integers(1, 5), source=st.integers(1, 6), heads=st.sampled_from([1, 2]),
       head_dim=st.integers(2, 3), memory_dim=st.integers(1, 5), norm_first=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_the_decoder_layer_is_pytorchs_formula_with_a_causal_self_attention(n, length, source, heads, head_dim,
                                                                             memory_dim, norm_first, seed):
    rng = np.random.default_rng(seed)
    dim = heads * head_dim
    layer = f64(TransformerDecoderLayer(dim, heads, 5, relu, norm_first=norm_first, memory_dim=memory_dim, rng=seed))
    _random_affine(layer, rng)
    x, memory = rng.standard_normal((n, length, dim)), rng.standard_normal((n, source, memory_dim))
    expected = _reference_decoder(layer, x, memory, ACTS["relu"][1], np.tril(np.ones((length, length), bool)))
    np.testing.assert_allclose(layer(x, memory), expected, rtol=1e-10, atol=1e-10)


def _with(layer, path, value, f):
    """``f()`` with the array at ``path`` (attribute names) of ``layer`` replaced by ``value``."""
    *parents, name = path.split(".")
    owner = layer
    for p in parents:
        owner = getattr(owner, p)
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        return f()
    finally:
        setattr(owner, name, old)


@pytest.mark.parametrize("path", ["linear1.weight", "self_attn.q_proj.weight", "self_attn.v_proj.bias",
                                  "norm1.gamma", "norm2.beta", "cross_attn.k_proj.weight"])
def test_gradients_match_finite_differences(path):
    rng = np.random.default_rng(1)
    enc = f64(TransformerEncoderLayer(4, 2, 6, norm_first=False, rng=2))
    dec = f64(TransformerDecoderLayer(4, 2, 6, memory_dim=3, rng=3))
    x, memory = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 3))
    check_grad(lambda x: enc(x, causal=True), x, rng=rng)
    check_grad(lambda x, memory: dec(x, memory), x, memory, rng=rng)
    for layer, run in ((enc, lambda: enc(x, causal=True)), (dec, lambda: dec(x, memory))):
        if path.startswith("cross_attn") and layer is enc:
            continue
        w = np.array(functools.reduce(getattr, path.split("."), layer))
        check_grad(lambda w: _with(layer, path, w, run), w, rng=rng)


def test_padding_keys_do_not_reach_the_real_tokens():
    rng = np.random.default_rng(0)
    enc = f64(TransformerEncoderLayer(6, 3, 8, rng=0))
    x = rng.standard_normal((2, 5, 6))
    key_mask = np.array([[True] * 5, [True, True, True, False, False]])
    y = enc(x, key_mask=key_mask)
    x2 = x.copy()
    x2[1, 3:] = 100 * rng.standard_normal((2, 6))   # change the padding
    y2 = enc(x2, key_mask=key_mask)
    np.testing.assert_allclose(y2[1, :3], y[1, :3], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(y2[0], y[0])


def test_a_decoder_layer_without_memory_is_a_gpt_block():
    rng = np.random.default_rng(0)
    dec = f64(TransformerDecoderLayer(4, 2, 8, rng=1))
    x = rng.standard_normal((2, 4, 4))
    y = dec(x)
    x2 = x.copy()
    x2[:, -1] += 1.0   # a later token never changes an earlier one's output
    np.testing.assert_allclose(dec(x2)[:, :-1], y[:, :-1], rtol=1e-12, atol=1e-12)


def test_bad_inputs_name_the_layer():
    enc = TransformerEncoderLayer(4, 2, 8, rng=0)
    with pytest.raises(fluxpy.DimensionMismatch, match=r"TransformerEncoderLayer\(4, nheads=2, hidden=8\) expects x "
                                                       r"of shape \(N, L, 4\), got \(2, 3\) float32"):
        enc(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="key_mask, a boolean array of shape"):
        enc(np.ones((2, 3, 4), np.float32), key_mask=np.ones((2, 3)))
    with pytest.raises(ValueError, match="nheads 3 must divide dim 4"):
        TransformerEncoderLayer(4, 3, 8)
    dec = TransformerDecoderLayer(4, 2, 8, memory_dim=6, rng=0)
    with pytest.raises(fluxpy.DimensionMismatch, match=r"expects memory of shape \(N, L, 6\)"):
        dec(np.ones((2, 3, 4), np.float32), np.ones((2, 3, 4), np.float32))
    assert repr(dec) == "TransformerDecoderLayer(4, nheads=2, hidden=8, memory_dim=6)"
    assert repr(TransformerEncoderLayer(4, 2, 8, relu, 0.1, norm_first=False)) == \
        "TransformerEncoderLayer(4, nheads=2, hidden=8, act=relu, dropout=0.1, norm_first=False)"


def _torch_state(layer, torch):
    """The fluxpy layer's weights under PyTorch's names (the q, k, v projections packed into ``in_proj``)."""
    t = lambda a: torch.tensor(np.asarray(a, np.float64))
    state = {}
    for name in ("self_attn", "multihead_attn"):
        mha = getattr(layer, "cross_attn" if name == "multihead_attn" else name, None)
        if mha is None:
            continue
        state[f"{name}.in_proj_weight"] = t(np.concatenate([mha.q_proj.weight, mha.k_proj.weight,
                                                            mha.v_proj.weight]))
        state[f"{name}.in_proj_bias"] = t(np.concatenate([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias]))
        state[f"{name}.out_proj.weight"], state[f"{name}.out_proj.bias"] = t(mha.out_proj.weight), t(mha.out_proj.bias)
    for name in ("linear1", "linear2"):
        state[f"{name}.weight"], state[f"{name}.bias"] = t(getattr(layer, name).weight), t(getattr(layer, name).bias)
    for name in ("norm1", "norm2", "norm3"):
        if hasattr(layer, name):
            state[f"{name}.weight"], state[f"{name}.bias"] = t(getattr(layer, name).gamma), t(getattr(layer, name).beta)
    return state


@pytest.mark.parametrize("norm_first", [True, False])
def test_against_pytorch_in_float64(norm_first):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    enc = f64(TransformerEncoderLayer(8, 2, 16, gelu_erf, norm_first=norm_first, rng=1))
    dec = f64(TransformerDecoderLayer(8, 2, 16, gelu_erf, norm_first=norm_first, rng=2))
    _random_affine(enc, rng)
    _random_affine(dec, rng)
    tenc = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True,
                                            norm_first=norm_first, dtype=torch.float64)
    tdec = torch.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True,
                                            norm_first=norm_first, dtype=torch.float64)
    tenc.load_state_dict(_torch_state(enc, torch))
    tdec.load_state_dict(_torch_state(dec, torch))
    x, memory = rng.standard_normal((3, 5, 8)), rng.standard_normal((3, 7, 8))
    key_mask = rng.random((3, 5)) < 0.7
    key_mask[:, 0] = True
    with torch.no_grad():
        want = tenc(torch.tensor(x), src_key_padding_mask=torch.tensor(~key_mask)).numpy()
        causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
        want_dec = tdec(torch.tensor(x), torch.tensor(memory), tgt_mask=causal, tgt_is_causal=True).numpy()
    got = enc(x, key_mask=key_mask)
    valid = key_mask[..., None] | np.zeros_like(got, bool)   # PyTorch's fast path may zero padded positions
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dec(x, memory), want_dec, rtol=1e-10, atol=1e-10)
