"""Transformer layers with PyTorch's semantics and parameter shapes, batch first: :class:`TransformerEncoderLayer`
and :class:`TransformerDecoderLayer`.

Each is a residual block of multi-head attention (:class:`~fluxpy.layers.MultiHeadAttention`) and a two-layer
feed-forward net, with layer norms placed before each sub-block (``norm_first=True``, the pre-norm of ViTs and GPTs)
or after each residual sum (``norm_first=False``, the original transformer's post-norm), as
``torch.nn.TransformerEncoderLayer(batch_first=True)`` and ``TransformerDecoderLayer``. The parameters carry
PyTorch's names (``self_attn``, ``linear1``, ``linear2``, ``norm1``, ...); PyTorch's packed ``in_proj_weight``
``(3 dim, dim)`` is fluxpy's ``self_attn.q_proj.weight``, ``k_proj`` and ``v_proj`` stacked.

Masks follow fluxpy's attention: boolean, true where attending is allowed. ``mask`` broadcasts to ``(Lq, Lk)``;
``key_mask`` ``(N, Lk)`` is true for the real keys of each sequence (PyTorch's ``key_padding_mask`` is its
negation); ``causal=True`` lets each query see only the keys at or before it.
"""
from __future__ import annotations

import numpy as np

from ..autodiff import value_of
from ..ops.activations import gelu
from ..random import as_rng
from ._checks import Array, DimensionMismatch, _activation, _describe_input, _number, _positive_int
from .basic import Dense, MultiHeadAttention
from .init import RNG
from .normalise import Dropout, LayerNorm
from .show import _fname

__all__ = ["TransformerEncoderLayer", "TransformerDecoderLayer"]


def _sizes(who, dim, nheads, hidden, dropout, eps):
    dim, nheads, hidden = (_positive_int(who, n, v) for n, v in (("dim", dim), ("nheads", nheads),
                                                                 ("hidden", hidden)))
    if dim < 2:
        raise ValueError(f"{who}: dim must be at least 2 (its layer norms normalise over dim), got {dim}")
    if dim % nheads:
        raise ValueError(f"{who}: nheads {nheads} must divide dim {dim}")
    return dim, nheads, hidden, _number(who, "dropout", dropout, 0, 1), _number(who, "eps", eps, 0, low_open=True)


def _check_sequence(layer, name, x, dim):
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 3 or shape[2] != dim:
        raise DimensionMismatch(f"{layer!r} expects {name} of shape (N, L, {dim}), got {_describe_input(x)}")


def _allowed(layer, q, k, mask, key_mask, causal):
    """The boolean mask (true where attending is allowed) of ``mask`` and ``key_mask`` together, or None where
    neither is given; each checked against the queries ``q`` and keys ``k``, and ``causal`` too (the attention
    applies it: the fused kernels have a causal mode of their own)."""
    n, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    parts = []
    if mask is not None:
        parts.append(value_of(mask))
    if key_mask is not None:
        km = value_of(key_mask)
        if getattr(km, "dtype", None) != np.bool_ or tuple(getattr(km, "shape", ())) != (n, lk):
            raise ValueError(f"{layer!r} expects key_mask, a boolean array of shape (N, Lk) = {(n, lk)} true for the "
                             f"real keys, got {_describe_input(km)}")
        parts.append(km[:, None, None, :])
    if causal and lq != lk:
        raise ValueError(f"{layer!r}: a causal mask needs as many queries as keys, got {lq} and {lk}")
    if not parts:
        return None
    allowed = parts[0]
    for p in parts[1:]:
        allowed = allowed & p
    return allowed


class _Block:
    """What the encoder and decoder layers share: the feed-forward net, the dropouts and the residual wiring."""

    def _feedforward(self, out):
        """The feed-forward sub-block ``out(linear2(dropout(linear1(x))))`` (``linear1`` holds the activation)."""
        return lambda x: self._drop(out, self.linear2(self._drop(self.dropout, self.linear1(x))))

    def _drop(self, layer, x):
        return x if layer.p == 0 else layer(x)

    def _residual(self, x, norm, block):
        """``x + block(norm(x))`` (pre-norm) or ``norm(x + block(x))`` (post-norm)."""
        if self.norm_first:
            return x + block(norm(x))
        return norm(x + block(x))

    def _ff_repr(self):
        act = _fname(self.linear1.act)
        extra = "" if act == "gelu" else f", act={act}"
        extra += "" if self.dropout.p == 0 else f", dropout={self.dropout.p}"
        extra += "" if self.norm_first else ", norm_first=False"
        return f"{self.linear1.in_features}, nheads={self.self_attn.nheads}, hidden={self.linear1.out_features}{extra}"


class TransformerEncoderLayer(_Block):
    """A transformer encoder block, batch first: self-attention, then a feed-forward net ``linear2(act(linear1(x)))``,
    each in a residual with its layer norm (PyTorch's ``TransformerEncoderLayer(dim, nheads, hidden,
    activation=act, dropout, batch_first=True, norm_first)``; the defaults here are a ViT's: ``act=gelu``,
    ``dropout=0``, ``norm_first=True``). ``layer(x, mask=None, key_mask=None, causal=False)`` takes ``x``
    ``(N, L, dim)`` and returns the same shape (see the module docstring for the masks).

    ``dropout`` drops the attention scores, the hidden activations and each sub-block's output while training (as
    :class:`fluxpy.Dropout` decides). ``bias=False`` leaves out every projection's bias.

    >>> import numpy as np
    >>> enc = TransformerEncoderLayer(8, 2, 16, rng=0)
    >>> x = np.random.default_rng(0).standard_normal((3, 5, 8)).astype(np.float32)
    >>> enc, enc(x).shape
    (TransformerEncoderLayer(8, nheads=2, hidden=16), (3, 5, 8))
    >>> key_mask = np.array([[True] * 5, [True] * 3 + [False] * 2, [True] * 4 + [False]])
    >>> enc(x, key_mask=key_mask).shape
    (3, 5, 8)
    """

    def __init__(self, dim: int, nheads: int, hidden: int, act=gelu, dropout: float = 0.0, *,
                 norm_first: bool = True, eps: float = 1e-5, bias: bool = True, rng: RNG = None) -> None:
        who = "TransformerEncoderLayer"
        dim, nheads, hidden, dropout, eps = _sizes(who, dim, nheads, hidden, dropout, eps)
        rng = as_rng(rng, who)
        self.self_attn = MultiHeadAttention(dim, nheads, bias=bias, dropout=dropout, rng=rng)
        self.linear1 = Dense(dim, hidden, _activation(who, act), bias=bias, rng=rng)
        self.linear2 = Dense(hidden, dim, bias=bias, rng=rng)
        self.norm1, self.norm2 = LayerNorm(dim, eps=eps), LayerNorm(dim, eps=eps)
        self.dropout, self.dropout1, self.dropout2 = Dropout(dropout), Dropout(dropout), Dropout(dropout)
        self.norm_first = bool(norm_first)

    def __call__(self, x: Array, mask: Array | None = None, key_mask: Array | None = None,
                 causal: bool = False) -> Array:
        _check_sequence(self, "x", x, self.linear1.in_features)
        allowed = _allowed(self, x, x, mask, key_mask, causal)
        x = self._residual(x, self.norm1, lambda h: self._drop(self.dropout1, self.self_attn(
            h, mask=allowed, causal=causal, need_scores=False)[0]))
        return self._residual(x, self.norm2, self._feedforward(self.dropout2))

    def __repr__(self):
        return f"TransformerEncoderLayer({self._ff_repr()})"


class TransformerDecoderLayer(_Block):
    """A transformer decoder block, batch first: causal self-attention, cross-attention to an encoder's ``memory``,
    then a feed-forward net, each in a residual with its layer norm (PyTorch's ``TransformerDecoderLayer(dim,
    nheads, hidden, activation=act, dropout, batch_first=True, norm_first)``, with ``tgt_is_causal`` the default
    here). ``layer(x, memory=None, mask=None, key_mask=None, memory_mask=None, memory_key_mask=None, causal=True)``:
    ``x`` ``(N, L, dim)``, ``memory`` ``(N, S, memory_dim)`` (``memory_dim`` defaults to ``dim``); the output has
    ``x``'s shape. ``memory=None`` skips the cross-attention (a GPT-style decoder-only block; its ``norm2`` and
    ``cross_attn`` then go unused). ``mask``, ``key_mask`` and ``causal`` mask the self-attention; ``memory_mask``
    ``(L, S)`` and ``memory_key_mask`` ``(N, S)`` the cross-attention.

    >>> import numpy as np
    >>> dec = TransformerDecoderLayer(8, 2, 16, rng=0)
    >>> rng = np.random.default_rng(0)
    >>> x, memory = rng.standard_normal((3, 5, 8)).astype(np.float32), rng.standard_normal((3, 7, 8)).astype(np.float32)
    >>> dec, dec(x, memory).shape
    (TransformerDecoderLayer(8, nheads=2, hidden=16), (3, 5, 8))
    """

    def __init__(self, dim: int, nheads: int, hidden: int, act=gelu, dropout: float = 0.0, *,
                 norm_first: bool = True, eps: float = 1e-5, bias: bool = True, memory_dim: int | None = None,
                 rng: RNG = None) -> None:
        who = "TransformerDecoderLayer"
        dim, nheads, hidden, dropout, eps = _sizes(who, dim, nheads, hidden, dropout, eps)
        memory_dim = dim if memory_dim is None else _positive_int(who, "memory_dim", memory_dim)
        rng = as_rng(rng, who)
        self.self_attn = MultiHeadAttention(dim, nheads, bias=bias, dropout=dropout, rng=rng)
        self.cross_attn = MultiHeadAttention(dim, nheads, bias=bias, dropout=dropout, kdim=memory_dim,
                                             vdim=memory_dim, rng=rng)
        self.linear1 = Dense(dim, hidden, _activation(who, act), bias=bias, rng=rng)
        self.linear2 = Dense(hidden, dim, bias=bias, rng=rng)
        self.norm1, self.norm2, self.norm3 = (LayerNorm(dim, eps=eps) for _ in range(3))
        self.dropout, self.dropout1, self.dropout2, self.dropout3 = (Dropout(dropout) for _ in range(4))
        self.norm_first = bool(norm_first)

    def __call__(self, x: Array, memory: Array | None = None, mask: Array | None = None,
                 key_mask: Array | None = None, memory_mask: Array | None = None,
                 memory_key_mask: Array | None = None, causal: bool = True) -> Array:
        _check_sequence(self, "x", x, self.linear1.in_features)
        allowed = _allowed(self, x, x, mask, key_mask, causal)
        x = self._residual(x, self.norm1, lambda h: self._drop(self.dropout1, self.self_attn(
            h, mask=allowed, causal=causal, need_scores=False)[0]))
        if memory is not None:
            _check_sequence(self, "memory", memory, self.cross_attn.k_proj.in_features)
            if memory.shape[0] != x.shape[0]:
                raise DimensionMismatch(f"{self!r} expects memory with x's batch size {x.shape[0]}, got "
                                        f"{_describe_input(memory)}")
            seen = _allowed(self, x, memory, memory_mask, memory_key_mask, False)
            x = self._residual(x, self.norm2, lambda h: self._drop(
                self.dropout2, self.cross_attn(h, memory, mask=seen, need_scores=False)[0]))
        return self._residual(x, self.norm3, self._feedforward(self.dropout3))

    def __repr__(self):
        memory = self.cross_attn.k_proj.in_features
        extra = "" if memory == self.linear1.in_features else f", memory_dim={memory}"
        return f"TransformerDecoderLayer({self._ff_repr()}{extra})"
