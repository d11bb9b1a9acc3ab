"""Fluxpy's own float32 flash attention on the GPU (``cuda/flash_attention.cu``): the FlashAttention-2 algorithm in
exact float32 arithmetic (FMAs, no TF32), forward and backward, for the float32 CuPy inputs of
:func:`fluxpy.ops.attention.dot_product_attention` (cuDNN's fused attention has no float32 engine).

- :func:`forward`: one launch, a block per (64 queries, head, batch) looping over the key blocks with an online
  softmax; ``y`` and the log-sum-exp per query (for the backward), the scores never stored.
- :func:`backward`: the row dot products ``D = rowsum(dy * y)``, then ``dk`` and ``dv`` (a block per 64 keys,
  looping over the queries) and ``dq`` (a block per 64 queries, looping over the keys), the probabilities
  recomputed from the log-sum-exp: three launches, no atomics (the result is the same bits every run). With at
  most 64 keys (one key block, so one block sees every score of a head) the block that forms ``dk`` and ``dv``
  also forms ``D`` and ``dq``: one launch, the same sums in the same order, so the same bits as the three.

The inputs are read in place, batch first with the heads side by side in the last axis (``q`` ``(N, Lq, heads *
dqk)``, ``k`` ``(N, Lk, heads * dqk)``, ``v`` ``(N, Lk, heads * dv)``, features contiguous); the results are
C-ordered in those layouts. Head sizes up to 128 are padded to 32, 64 or 128 (one compiled variant per pair);
``causal`` is top-left aligned (key ``j`` for query ``i`` when ``j <= i``); ``bias`` is a float32 array
broadcasting to ``(N, heads, Lq, Lk)``, read by its strides (a boolean mask arrives as a 0 / -inf bias); it gets no
gradient. :func:`why_not` says from shapes, dtypes and strides alone why a problem cannot run (None where it can).

>>> padded(48), padded(16), padded(128)
(64, 32, 128)
>>> why_not(*[np.ones((2, 5, 8), np.float32)] * 3, heads=2, bias=None) is None
True
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..backend import cupy
from . import compiler

__all__ = ["Problem", "padded", "why_not", "problem_of", "forward", "backward", "shared_bytes", "stats",
           "SOURCE_VARIANTS"]

SOURCE = "flash_attention.cu"
BLOCK = 64          # queries and keys per tile (BR, BC in the source)
THREADS = 256
MAX_HEAD = 128
_PADS = (32, 64, 128)
_GRID_LIMIT = 65535   # the grid's y (heads) and z (batch) extents
_ROWS_PER_BLOCK = THREADS // 32   # flash_row_dot: a warp per row
_calls = {"forward": 0, "backward": 0, "one_launch": 0}


def stats() -> dict:
    """How many forward and backward calls ran the kernels, and how many of the backward calls ran as one launch
    (what tests check to know which path ran).

    >>> sorted(stats())
    ['backward', 'forward', 'one_launch']
    """
    return dict(_calls)


class Problem(NamedTuple):
    """What the launches of one call depend on: sizes, heads, the two head sizes, causal or not, and whether a bias
    is read."""
    n: int
    heads: int
    lq: int
    lk: int
    dqk: int
    dv: int
    causal: bool
    bias: bool


def padded(d: int) -> int:
    """The compiled head size that holds ``d`` (1 to 128): 32, 64 or 128.

    >>> [padded(d) for d in (1, 32, 33, 80)]
    [32, 32, 64, 128]
    """
    return next(p for p in _PADS if d <= p)


def _defines(dqk_pad: int, dv_pad: int) -> dict:
    return {"DQK": dqk_pad, "DV": dv_pad}


def SOURCE_VARIANTS():
    """``(source, defines)`` of every variant the launches compile: each pair of padded head sizes.

    >>> len(list(SOURCE_VARIANTS()))
    9
    """
    for dqk in _PADS:
        for dv in _PADS:
            yield SOURCE, _defines(dqk, dv)


def shared_bytes(kernel: str, dqk_pad: int, dv_pad: int) -> int:
    """The dynamic shared memory of ``kernel`` for padded head sizes ``dqk_pad`` and ``dv_pad`` (the tiles of the
    source, each row padded by 4 floats, the score tiles by 16).

    >>> shared_bytes("flash_forward", 64, 64), shared_bytes("flash_backward_kv", 128, 128)
    (72704, 176640)
    """
    ldk, ldv, ldp = dqk_pad + 4, dv_pad + 4, BLOCK + 16
    floats = {"flash_forward": 2 * BLOCK * ldk + BLOCK * ldv + (0 if ldk >= ldp else BLOCK * ldp),
              "flash_backward_kv": 2 * BLOCK * (ldk + ldv + ldp) + 2 * BLOCK,
              "flash_backward_kvq": 2 * BLOCK * (ldk + ldv + ldp) + 2 * BLOCK,
              "flash_backward_q": 2 * BLOCK * (ldk + ldv) + BLOCK * ldp}[kernel]
    return 4 * floats


def _address(a: Any) -> int:
    return a.data.ptr if cupy is not None and isinstance(a, cupy.ndarray) else a.ctypes.data


def why_not(q: Any, k: Any, v: Any, heads: int, bias: Any) -> str | None:
    """Why the float32 flash kernels cannot take ``q``, ``k``, ``v`` (and the additive ``bias``, of the scores'
    4-d shape or None) with ``heads`` heads, from dtypes, shapes and strides alone; None where they can. NumPy arrays
    are judged as CuPy arrays of the same layout would be.

    >>> a = np.ones((1, 4, 256), np.float32)
    >>> why_not(a, a, a, heads=1, bias=None)
    'float32 flash attention takes head sizes from 1 to 128, got 256 and 256'
    """
    arrays = (q, k, v) + (() if bias is None else (bias,))
    if any(a.dtype != np.float32 for a in arrays):
        return (f"float32 flash attention takes float32 q, k, v and bias, got "
                f"{', '.join(str(a.dtype) for a in arrays)}")
    n, lq, fq = q.shape
    lk, fv = k.shape[1], v.shape[2]
    dqk, dv = fq // heads, fv // heads
    if not (1 <= dqk <= MAX_HEAD and 1 <= dv <= MAX_HEAD):
        return f"float32 flash attention takes head sizes from 1 to {MAX_HEAD}, got {dqk} and {dv}"
    if min(n, lq, lk) < 1:
        return f"float32 flash attention needs at least one query and one key, got q {q.shape}, k {k.shape}"
    if n > _GRID_LIMIT or heads > _GRID_LIMIT:
        return f"float32 flash attention takes at most {_GRID_LIMIT} batches and heads, got {n} and {heads}"
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.strides[2] != a.itemsize and a.shape[2] > 1:
            return f"float32 flash attention reads {name} with contiguous features, got strides {a.strides}"
    if bias is not None and tuple(bias.shape) != (n, heads, lq, lk):
        return f"float32 flash attention takes a bias of the scores' shape {(n, heads, lq, lk)}, got {bias.shape}"
    return None


def _vectors(dqk: int, dv: int, *arrays) -> int:
    """1 where every tile row can be read as float4s: head sizes, row strides and pointers multiples of 4 floats."""
    ok = dqk % 4 == 0 and dv % 4 == 0 and all(
        _address(a) % 16 == 0 and all((s // 4) % 4 == 0 for s in a.strides[:2]) for a in arrays)
    return int(ok)


def problem_of(q: Any, k: Any, v: Any, heads: int, causal: bool, bias: Any) -> Problem | str:
    """The :class:`Problem` of a call on CuPy arrays, or why the kernels cannot take it (:func:`why_not`).

    >>> problem_of(*[np.ones((1, 2, 8), np.float32)] * 3, heads=1, causal=False, bias=None)
    'float32 flash attention takes CuPy arrays, got numpy arrays'
    """
    if cupy is None or not all(isinstance(a, cupy.ndarray) for a in (q, k, v)):
        return f"float32 flash attention takes CuPy arrays, got {type(q).__module__} arrays"
    if bias is not None and not isinstance(bias, cupy.ndarray):
        return f"float32 flash attention takes a CuPy bias, got {type(bias).__module__}.{type(bias).__name__}"
    reason = why_not(q, k, v, heads, bias)
    if reason is not None:
        return reason
    n, lq, fq = q.shape
    return Problem(n, heads, lq, k.shape[1], fq // heads, v.shape[2] // heads, bool(causal), bias is not None)


def _function(p: Problem, kernel: str, nbytes: int = 0):
    fn = compiler.function(SOURCE, kernel, _defines(padded(p.dqk), padded(p.dv)))
    if nbytes and fn.max_dynamic_shared_size_bytes < nbytes:
        fn.max_dynamic_shared_size_bytes = nbytes
    return fn


def _rows(a) -> tuple:
    """The element strides of the batch and sequence axes of an ``(N, L, F)`` float32 array."""
    return np.int64(a.strides[0] // 4), np.int64(a.strides[1] // 4)


def _bias_args(bias) -> tuple:
    if bias is None:
        return (np.uint64(0),) + (np.int64(0),) * 4
    return (bias,) + tuple(np.int64(s // 4) for s in bias.strides)


def _sizes(p: Problem) -> tuple:
    return (np.int32(p.lq), np.int32(p.lk), np.int32(p.heads), np.int32(p.dqk), np.int32(p.dv),
            np.float32(1 / np.sqrt(p.dqk)), np.int32(p.causal))


def _launch(p: Problem, kernel: str, blocks: int, args: tuple) -> None:
    nbytes = shared_bytes(kernel, padded(p.dqk), padded(p.dv))
    compiler.launch(_function(p, kernel, nbytes), (blocks, p.heads, p.n), THREADS, args, nbytes)


def forward(p: Problem, q, k, v, bias) -> tuple:
    """``(y, lse)``: the attention ``(N, Lq, heads * dv)`` and the log-sum-exp of each query's scaled logits
    ``(N, heads, Lq)`` (NaN for a query with no key to see), float32, one launch.

    >>> forward.__name__   # needs a GPU: tests/gpu/test_flash_attention_gpu.py runs it
    'forward'
    """
    _calls["forward"] += 1
    y = cupy.empty((p.n, p.lq, p.heads * p.dv), dtype=np.float32)
    lse = cupy.empty((p.n, p.heads, p.lq), dtype=np.float32)
    vec = np.int32(_vectors(p.dqk, p.dv, q, k, v))
    _launch(p, "flash_forward", -(-p.lq // BLOCK),
            (q, *_rows(q), k, *_rows(k), v, *_rows(v), *_bias_args(bias), y, lse, *_sizes(p), vec))
    return y, lse


def backward(p: Problem, q, k, v, bias, y, lse, dy, need_q: bool = True, need_kv: bool = True,
             one_launch: bool = True) -> tuple:
    """``(dq, dk, dv)`` for the output cotangent ``dy`` (any strides; copied where its features are not
    contiguous), from the forward's ``y`` and ``lse``; ``dq`` None unless ``need_q``, ``dk`` and ``dv`` None unless
    ``need_kv``. All three of a problem with at most 64 keys come from one launch unless ``one_launch`` is false
    (the same bits either way; tests compare them).

    >>> backward.__name__   # needs a GPU: tests/gpu/test_flash_attention_gpu.py runs it
    'backward'
    """
    _calls["backward"] += 1
    if dy.strides[2] != 4 and dy.shape[2] > 1:
        dy = cupy.ascontiguousarray(dy)
    vec = np.int32(_vectors(p.dqk, p.dv, q, k, v, dy))
    inputs = (q, *_rows(q), k, *_rows(k), v, *_rows(v), *_bias_args(bias), dy, *_rows(dy), lse)
    if one_launch and need_q and need_kv and p.lk <= BLOCK:
        _calls["one_launch"] += 1
        dq, dk, dv = (cupy.empty(a.shape, dtype=np.float32) for a in (q, k, v))
        _launch(p, "flash_backward_kvq", 1, inputs + (y, dq, dk, dv, *_sizes(p), vec))
        return dq, dk, dv
    delta = cupy.empty((p.n, p.heads, p.lq), dtype=np.float32)
    rows = p.n * p.lq * p.heads
    compiler.launch(_function(p, "flash_row_dot"), -(-rows // _ROWS_PER_BLOCK), THREADS,
                    (dy, *_rows(dy), y, delta, np.int64(rows), np.int32(p.lq), np.int32(p.heads), np.int32(p.dv)))
    inputs += (delta,)
    dq = dk = dv = None
    if need_kv:
        dk = cupy.empty(k.shape, dtype=np.float32)
        dv = cupy.empty(v.shape, dtype=np.float32)
        _launch(p, "flash_backward_kv", -(-p.lk // BLOCK), inputs + (dk, dv, *_sizes(p), vec))
    if need_q:
        dq = cupy.empty(q.shape, dtype=np.float32)
        _launch(p, "flash_backward_q", -(-p.lq // BLOCK), inputs + (dq, *_sizes(p), vec))
    return dq, dk, dv
