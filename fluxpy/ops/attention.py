"""Scaled dot-product attention (NNlib's ``dot_product_attention``), batch first, and a causal mask.

``q`` ``(N, Lq, dim)``, ``k`` ``(N, Lk, dim)``, ``v`` ``(N, Lk, vdim)``; with ``nheads`` the feature axes split into
heads (``dim / nheads`` and ``vdim / nheads`` each). Scores ``softmax(q k^T / sqrt(dim / nheads))`` over the keys,
``(N, nheads, Lq, Lk)``; the output ``scores @ v`` with the heads joined again, ``(N, Lq, vdim)``. ``mask``: a
boolean array broadcasting to ``(Lq, Lk)`` (or to the scores' shape), true where attending is allowed (Flux's
convention); a query with no allowed key gets NaN, as NNlib's and PyTorch's. Composed of fluxpy's ops (the softmax
is the fused kernel on the GPU), so it differentiates to any order.

In float16 and bfloat16 (:func:`fluxpy.mixed_precision`) the two products run in the half type (float32
accumulation in cuBLAS), the scaled logits, ``bias``, mask, softmax and ``dropout`` in float32, and the scores are
rounded to the half type before they weigh ``v`` (PyTorch's autocast): ``y`` and ``scores`` are of the half type.

>>> import numpy as np
>>> q = np.ones((2, 3, 4))
>>> y, scores = dot_product_attention(q, q, q, nheads=2)
>>> y.shape, scores.shape
((2, 3, 4), (2, 2, 3, 3))
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..autodiff import value_of
from ..backend import Array, get_array_module, is_array
from ..kernels.halfs import is_half
from .basic import where
from .linalg import matmul
from .shape import as_memory_format, astype, reshape, swapaxes, transpose
from .softmax import softmax

__all__ = ["dot_product_attention", "causal_mask"]


def _split_heads(x, nheads):
    """``(N, heads, L, d)``, copied C-ordered once: each head's ``(L, d)`` matrices then lie one stride apart, so the
    products forward and back read them as they lie (a strided view would be copied by each product)."""
    n, length, dim = x.shape
    heads = transpose(reshape(x, (n, length, nheads, dim // nheads)), (0, 2, 1, 3))
    return as_memory_format(heads, "contiguous")


def _join_heads(x):
    """``(N, L, heads * d)``; ``as_memory_format`` (no copy forward: ``x`` is a product's C-ordered result) makes its
    gradient C-ordered once for the two products of the pullback."""
    n, heads, length, d = x.shape
    return reshape(transpose(as_memory_format(x, "contiguous"), (0, 2, 1, 3)), (n, length, heads * d))


def _check(q, k, v, nheads, mask):
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not is_array(value_of(a)):
            raise TypeError(f"dot_product_attention expects {name} as a NumPy or CuPy array, got "
                            f"{type(a).__module__}.{type(a).__name__}: convert it with numpy.asarray({name}) (then "
                            f"fluxpy.gpu(...) for the GPU), or through DLPack with cupy.from_dlpack({name})")
    shapes = [tuple(a.shape) for a in (q, k, v)]
    if any(len(s) != 3 for s in shapes):
        raise ValueError(f"dot_product_attention expects q, k, v of shapes (N, L, dim), got {shapes}")
    (nq, lq, dq), (nk, lk, dk), (nv, lv, dv) = shapes
    if not (nq == nk == nv) or dq != dk or lk != lv:
        raise ValueError(f"dot_product_attention expects q (N, Lq, dim), k (N, Lk, dim), v (N, Lk, vdim) with one N, "
                         f"dim and Lk, got {shapes}")
    if dq < 1:
        raise ValueError(f"dot_product_attention expects q and k of at least one feature (dim >= 1: the logits are "
                         f"scaled by 1/sqrt(dim)), got {shapes}")
    if lk == 0 and lq > 0:
        raise ValueError(f"dot_product_attention expects at least one key (Lk >= 1) for {lq} queries: a query over "
                         f"no key has no softmax; got q {shapes[0]}, k {shapes[1]}")
    if isinstance(nheads, bool) or not isinstance(nheads, int) or nheads < 1 or dq % nheads or dv % nheads:
        raise ValueError(f"dot_product_attention expects nheads, an int >= 1 that divides dim {dq} and vdim {dv}, "
                         f"got {nheads!r}")
    if mask is not None:
        m = value_of(mask)
        if getattr(m, "dtype", None) != np.bool_:
            raise TypeError(f"dot_product_attention expects a boolean mask (true where attending is allowed), got "
                            f"{getattr(m, 'dtype', type(m).__name__)}")
        scores = (nq, nheads, shapes[0][1], lk)
        try:
            ok = np.broadcast_shapes(tuple(m.shape), scores) == scores
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"dot_product_attention expects a mask broadcasting to (Lq, Lk) = {scores[2:]} (or to "
                             f"the scores' shape {scores}), got {tuple(m.shape)}")


def dot_product_attention(q: Array, k: Array, v: Array, mask: Array | None = None, nheads: int = 1,
                          dropout: Callable | None = None, *, bias: Array | None = None) -> tuple[Array, Array]:
    """``(y, scores)`` of scaled dot-product attention (see the module docstring); ``dropout``, a function applied
    to the scores before they weigh ``v`` (a :class:`fluxpy.Dropout`, say), or None. The scores returned are those
    that weighed ``v``, after ``dropout`` (NNlib's ``dot_product_attention`` and PyTorch's attention weights too).
    ``bias`` (NNlib's ``bias``, PyTorch's float ``attn_mask``): an array broadcasting to the scores' shape
    ``(N, nheads, Lq, Lk)`` (so ``(Lq, Lk)`` will do), added to the scaled logits before the mask and the softmax;
    differentiable.

    >>> import numpy as np
    >>> q = np.array([[[1.0, 0.0]]]); k = np.array([[[1.0, 0.0], [0.0, 1.0]]]); v = np.array([[[1.0], [3.0]]])
    >>> y, s = dot_product_attention(q, k, v)
    >>> s.round(3), y.round(3)
    (array([[[[0.67, 0.33]]]]), array([[[1.66]]]))
    """
    _check(q, k, v, nheads, mask)
    qh, kh, vh = (_split_heads(a, nheads) for a in (q, k, v))
    logits = matmul(qh, swapaxes(kh, -1, -2))
    half = is_half(value_of(logits).dtype)
    if half:   # the products in the half type, the softmax and what comes before it in float32 (PyTorch's autocast)
        logits = astype(logits, np.float32)
    logits = logits * (1 / math.sqrt(q.shape[-1] // nheads))
    if bias is not None:
        _check_bias(bias, tuple(logits.shape))
        logits = logits + (astype(bias, np.float32) if half and is_half(value_of(bias).dtype) else bias)
    if mask is not None:
        logits = where(value_of(mask), logits, -np.inf)
    scores = softmax(logits, axis=-1) if k.shape[1] else logits   # no key (and no query): empty scores
    weights = scores if dropout is None else dropout(scores)
    if half:
        weights = astype(weights, value_of(vh).dtype)
    return _join_heads(matmul(weights, vh)), weights   # the scores that weighed v: after dropout, as NNlib's


def _check_bias(bias, scores):
    shape = tuple(getattr(bias, "shape", ()))
    try:
        ok = np.broadcast_shapes(shape, scores) == scores
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"dot_product_attention expects a bias broadcasting to (Lq, Lk) = {scores[2:]} (or to the "
                         f"scores' shape {scores}), got {shape}")


def causal_mask(x: Array | int, xp: Any = None) -> Array:
    """The causal mask for a sequence of ``x.shape[1]`` (or ``x``) steps: ``(L, L)``, true where the key's index is
    at most the query's (NNlib's ``make_causal_mask``, in the (query, key) order of the scores). ``x``: an int
    ``L >= 0`` or an array of at least two axes, ``(N, L, ...)``; ``causal_mask(0)`` is the empty ``(0, 0)`` mask.

    >>> causal_mask(3)
    array([[ True, False, False],
           [ True,  True, False],
           [ True,  True,  True]])
    """
    number = isinstance(x, (int, np.integer)) and not isinstance(x, bool)
    if not number and not hasattr(x, "shape"):
        raise TypeError(f"causal_mask expects a length, an int >= 0, or an array (N, L, ...), got {x!r}")
    if number and x < 0 or not number and len(x.shape) < 2:
        got = repr(x) if number else f"an array of shape {tuple(x.shape)}"
        raise ValueError(f"causal_mask expects a length, an int >= 0, or an array (N, L, ...), got {got}")
    length = int(x) if number else x.shape[1]
    xp = xp if xp is not None else (np if number else get_array_module(value_of(x)))
    return xp.tril(xp.ones((length, length), dtype=bool))
