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

**Fused on the GPU.** With ``need_scores=False`` (the scores are not returned, so they need not exist) and
``dropout`` None or a probability, float16 and bfloat16 CuPy inputs run cuDNN's fused attention
(:mod:`fluxpy.kernels.cudnn.attention`): one kernel forward and one backward, the scores never stored, ``causal`` as
the kernel's own mask, a boolean mask and ``bias`` as one additive bias of the half type (its gradient from the same
kernel), dropout drawn by the kernel from fluxpy's GPU generator. Float32 CuPy inputs run fluxpy's own flash kernels
(:mod:`fluxpy.kernels.cuda_flash`, exact float32 arithmetic, no TF32): one kernel forward, three backward, ``causal``
and a boolean mask and ``bias`` as there, but no dropout and no gradient of ``bias`` (either runs the composite).
Where the fused kernels decline a problem (:func:`fused_reason` says why), on the CPU and while a derivative of a
derivative is recorded (the fused backward is not itself differentiable) the composite runs.

>>> import numpy as np
>>> q = np.ones((2, 3, 4))
>>> y, scores = dot_product_attention(q, q, q, nheads=2)
>>> y.shape, scores.shape
((2, 3, 4), (2, 2, 3, 3))
>>> dot_product_attention(q, q, q, nheads=2, causal=True, need_scores=False)[1] is None
True
"""
from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from ..autodiff import Primitive, gradient_depth, is_tracked, value_of
from ..backend import Array, get_array_module, is_array
from ..kernels import cuda_flash as flash_kernels
from ..kernels.cudnn import attention as fused_kernels
from ..kernels.halfs import is_half
from ..random import rng_for
from .basic import where
from .dropout import dropout as dropout_op
from .linalg import matmul
from .shape import as_memory_format, astype, broadcast_to, reshape, swapaxes, transpose
from .softmax import softmax

__all__ = ["dot_product_attention", "causal_mask", "fused_reason"]


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


def _check(q, k, v, nheads, mask, causal):
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
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"dot_product_attention expects causal, a bool, got {causal!r}")
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
                          dropout: Callable | float | None = None, *, bias: Array | None = None, causal: bool = False,
                          need_scores: bool = True) -> tuple[Array, Array | None]:
    """``(y, scores)`` of scaled dot-product attention (see the module docstring); ``dropout``, a function applied
    to the scores before they weigh ``v`` (a :class:`fluxpy.Dropout`, say, NNlib's ``fdrop``), a probability ``p``
    in [0, 1) (PyTorch's ``dropout_p``: :func:`fluxpy.dropout` of the scores, which the fused kernels draw
    themselves), or None. The scores returned are those that weighed ``v``, after ``dropout`` (NNlib's
    ``dot_product_attention`` and PyTorch's attention weights too).
    ``bias`` (NNlib's ``bias``, PyTorch's float ``attn_mask``): an array broadcasting to the scores' shape
    ``(N, nheads, Lq, Lk)`` (so ``(Lq, Lk)`` will do), added to the scaled logits before the mask and the softmax;
    differentiable. ``causal=True`` (PyTorch's ``is_causal``) lets query ``i`` see keys ``0..i`` only, on top of
    ``mask`` (as :func:`causal_mask`, aligned at the top left where ``Lq != Lk``). ``need_scores=False`` returns
    ``(y, None)`` (PyTorch's ``need_weights=False``), which lets the GPU run the fused kernels.

    >>> import numpy as np
    >>> q = np.array([[[1.0, 0.0]]]); k = np.array([[[1.0, 0.0], [0.0, 1.0]]]); v = np.array([[[1.0], [3.0]]])
    >>> y, s = dot_product_attention(q, k, v)
    >>> s.round(3), y.round(3)
    (array([[[[0.67, 0.33]]]]), array([[[1.66]]]))
    """
    _check(q, k, v, nheads, mask, causal)
    if bias is not None:
        _check_bias(bias, (q.shape[0], nheads, q.shape[1], k.shape[1]))
    p = _dropout_probability(dropout)
    if p == 0:
        dropout = None
    if not need_scores and (dropout is None or p is not None):
        y = _fused_attention(q, k, v, mask, nheads, bias, bool(causal), p or 0.0)
        if y is not None:
            return y, None
    if p is not None and p > 0:
        dropout = functools.partial(dropout_op, p=p, active=True)
    if causal:
        tri = get_array_module(value_of(q)).tri(q.shape[1], k.shape[1], dtype=bool)
        mask = tri if mask is None else value_of(mask) & tri
    y, scores = _composite(q, k, v, mask, nheads, dropout, bias)
    return y, (scores if need_scores else None)


def _dropout_probability(dropout):
    """``dropout``'s probability where it is a number (checked), else None (a function, or no dropout)."""
    if dropout is None or callable(dropout):
        return None
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
        raise ValueError(f"dot_product_attention expects dropout, a function of the scores or a probability in "
                         f"[0, 1), got {dropout!r}")
    return float(dropout)


def _composite(q, k, v, mask, nheads, dropout, bias):
    """The attention of fluxpy's ops: two products, the scaled logits, bias, mask and softmax between them."""
    qh, kh, vh = (_split_heads(a, nheads) for a in (q, k, v))
    logits = matmul(qh, swapaxes(kh, -1, -2))
    half = is_half(value_of(logits).dtype)
    if half:   # the products in the half type, the softmax and what comes before it in float32 (PyTorch's autocast)
        logits = astype(logits, np.float32)
    logits = logits * (1 / math.sqrt(q.shape[-1] // nheads))
    if bias is not None:
        logits = logits + (astype(bias, np.float32) if half and is_half(value_of(bias).dtype) else bias)
    if mask is not None:
        logits = where(value_of(mask), logits, -np.inf)
    scores = softmax(logits, axis=-1) if k.shape[1] else logits   # no key (and no query): empty scores
    weights = scores if dropout is None else dropout(scores)
    if half:
        weights = astype(weights, value_of(vh).dtype)
    return _join_heads(matmul(weights, vh)), weights   # the scores that weighed v: after dropout, as NNlib's


_last_reason = [""]


def fused_reason() -> str:
    """Why the last call of :func:`dot_product_attention` with ``need_scores=False`` ran the composite instead of
    the fused kernels, cuDNN's for float16 and bfloat16 and fluxpy's flash kernels for float32 ("" where it ran
    them).

    >>> import numpy as np
    >>> _ = dot_product_attention(np.ones((1, 2, 8)), np.ones((1, 2, 8)), np.ones((1, 2, 8)), need_scores=False)
    >>> fused_reason()[:30]
    'fused attention takes CuPy arr'
    """
    return _last_reason[0]


def _leading(a):
    """The batch and head sizes (each 1 or full) of a mask or bias broadcasting to the scores' shape."""
    shape = (1,) * (4 - len(a.shape)) + tuple(a.shape)
    return shape[0], shape[1]


def _fused_attention(q, k, v, mask, nheads, bias, causal, p):
    """``y`` through cuDNN's fused kernels (fluxpy's flash kernels in float32), or None (the reason in
    :func:`fused_reason`) where they cannot run."""
    vq, vk, vv = value_of(q), value_of(k), value_of(v)
    if gradient_depth() > 1 or any(is_tracked(a) and is_tracked(a.value) for a in (q, k, v, bias)):
        _last_reason[0] = "a derivative of a derivative is being recorded: the fused backward is not differentiable"
        return None
    if vq.dtype == np.float32:
        return _flash_attention(q, k, v, mask, nheads, bias, causal, p)
    lq, lk = vq.shape[1], vk.shape[1]
    shape4 = None
    if mask is not None or bias is not None:
        lead = [_leading(a) for a in (mask, bias) if a is not None]
        shape4 = (max(s[0] for s in lead), max(s[1] for s in lead), lq, lk)
    bias_grad = is_tracked(bias)
    training = bias_grad or any(is_tracked(a) for a in (q, k, v))
    problem = fused_kernels.problem_of(vq, vk, vv, nheads, causal, shape4, bias_grad, p)
    reason = problem if isinstance(problem, str) else fused_kernels.declined(problem, training)
    if reason is None and p and not getattr(rng_for(get_array_module(vq)), "reserve", None):
        reason = "the GPU's generator cannot give cuDNN's dropout a seed and an offset"
    _last_reason[0] = reason or ""
    if reason is not None:
        return None
    total = None
    if bias is not None:
        total = astype(reshape(bias, (1,) * (4 - len(bias.shape)) + tuple(bias.shape)), vq.dtype)
    if mask is not None:
        xp = get_array_module(vq)
        m = value_of(mask)
        additive = xp.where(m.reshape((1,) * (4 - m.ndim) + m.shape), 0.0, -np.inf).astype(vq.dtype)
        total = additive if total is None else total + additive
    if total is not None:
        total = as_memory_format(broadcast_to(total, shape4), "contiguous")
    seed = offset = None
    if p:   # the position of this call's numbers: a copy of the generator's, which then moves past them
        seed, offset = rng_for(get_array_module(vq)).reserve(-(-problem.n * nheads * lq * lk // 4))
    return _fused(q, k, v, total, seed, offset, problem=problem)


def _fused_rule(needs, q, k, v, bias, seed, offset, *, problem):
    rng = (seed, offset)
    y, lse = fused_kernels.forward(problem, q, k, v, bias, training=True, rng=rng)

    def fused_attention_pullback(dy):
        if is_tracked(dy):
            raise NotImplementedError("dot_product_attention: the pullback of cuDNN's fused attention is being "
                                      "differentiated (its backward kernel is not itself differentiable); take "
                                      "the derivative inside the outer gradient (the composite then runs) or "
                                      "pass need_scores=True")
        dq, dk, dv, dbias = fused_kernels.backward(problem, q, k, v, y, dy, lse, bias, rng=rng)
        return dq, dk, dv, dbias, None, None
    return y, fused_attention_pullback


def _fused_impl(q, k, v, bias, seed, offset, *, problem):
    return fused_kernels.forward(problem, q, k, v, bias, training=False, rng=(seed, offset))[0]


_fused = Primitive("fused_attention", _fused_rule, needs_mask=True, impl=_fused_impl)


def _flash_attention(q, k, v, mask, nheads, bias, causal, p):
    """``y`` through fluxpy's float32 flash kernels, or None (the reason in :func:`fused_reason`)."""
    vq = value_of(q)
    if p:
        reason = f"float32 flash attention has no dropout (got p = {p}): the composite draws it"
    elif is_tracked(bias):
        reason = "float32 flash attention computes no gradient of bias: the composite does"
    elif bias is not None and getattr(value_of(bias), "dtype", None) != np.float32:
        reason = (f"float32 flash attention takes a float32 bias, got "
                  f"{getattr(value_of(bias), 'dtype', type(value_of(bias)).__name__)}")
    else:
        reason = flash_kernels.problem_of(vq, value_of(k), value_of(v), nheads, causal, None)
    if isinstance(reason, str):
        _last_reason[0] = reason
        return None
    _last_reason[0] = ""
    total = _additive_bias(get_array_module(vq), mask, bias, (vq.shape[0], nheads, vq.shape[1], value_of(k).shape[1]))
    return _flash(q, k, v, total, problem=reason._replace(bias=total is not None))


def _additive_bias(xp, mask, bias, shape4):
    """``bias`` plus the boolean ``mask`` as 0 / -inf, float32, as a broadcast view of the scores' shape (the kernels
    read it by its strides, 0 along a broadcast axis); None for neither."""
    total = None
    if bias is not None:
        b = value_of(bias)
        total = b.reshape((1,) * (4 - b.ndim) + b.shape)
    if mask is not None:
        m = value_of(mask)
        additive = xp.where(m.reshape((1,) * (4 - m.ndim) + m.shape), np.float32(0), np.float32(-np.inf))
        additive = additive.astype(np.float32, copy=False)
        total = additive if total is None else total + additive
    return None if total is None else xp.broadcast_to(total, shape4)


def _flash_rule(needs, q, k, v, bias, *, problem):
    y, lse = flash_kernels.forward(problem, q, k, v, bias)

    def flash_attention_pullback(dy):
        if is_tracked(dy):
            raise NotImplementedError("dot_product_attention: the pullback of the float32 flash attention is being "
                                      "differentiated (its backward kernels are not themselves differentiable); "
                                      "take the derivative inside the outer gradient (the composite then runs) or "
                                      "pass need_scores=True")
        dq, dk, dv = flash_kernels.backward(problem, q, k, v, bias, y, lse, dy.astype(np.float32, copy=False),
                                            need_q=needs[0], need_kv=needs[1] or needs[2])
        return dq, dk if needs[1] else None, dv if needs[2] else None, None
    return y, flash_attention_pullback


def _flash_impl(q, k, v, bias, *, problem):
    return flash_kernels.forward(problem, q, k, v, bias)[0]


_flash = Primitive("flash_attention", _flash_rule, needs_mask=True, impl=_flash_impl)


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
