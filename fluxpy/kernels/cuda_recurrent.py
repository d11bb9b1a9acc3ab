"""CUDA kernels for one step of the recurrent cells' gates: each step's pointwise maths in one launch forward and
one launch backward (the ops of :mod:`fluxpy.ops.recurrent`; PyTorch's ``_thnn_fused_lstm_cell`` and
``_thnn_fused_gru_cell`` do the same split: the matrix products stay with cuBLAS).

One thread per ``(row, j)``, ``j < H``, reading the row's gates at ``j``, ``H + j``, ... (neighbouring threads read
neighbouring values). Every operand is a matrix of rows with unit element stride and its own row stride in elements,
0 for a vector that serves every row (a state of shape ``(H,)``, a broadcast projection): so a step's slice
``xi[:, t]`` of the projected sequence, ``(N, 4H)`` with row stride ``T * 4H``, is read where it lies, no copy.
Results are new C-contiguous arrays. Arithmetic in float32 for float16, bfloat16 and float32 (the halves stored
in 16 bits, each result rounded once, :mod:`fluxpy.kernels.halfs`), float64 for float64.

- ``lstm_fwd``: ``z = gx + gh`` (``gh`` optional), ``i, f, o = sigmoid``, ``g = tanh``, ``c = f c_prev + i g``,
  ``h = o tanh(c)``; writes ``y = [h; c]`` ``(2, M, H)`` and, when saving for the backward, the activated gates
  ``act = [i, f, g, o]`` ``(M, 4H)``.
- ``lstm_bwd``: from ``dy = [dh; dc]``, ``act``, ``c`` and ``c_prev``: ``dz`` ``(M, 4H)`` and ``dc_prev``
  ``(M, H)`` (``tanh(c)`` recomputed).
- ``gru_fwd``: ``r, z = sigmoid(gi + gh)``, ``n = tanh(gi_n + r gh_n)``, ``h = (1 - z) n + z h_prev``; saves
  ``act = [r, z, n, gh_n]`` ``(M, 4H)``.
- ``gru_bwd``: ``dgi``, ``dgh`` ``(M, 3H)`` and ``dh_prev`` ``(M, H)``.

Other calls (more than one leading axis, strided rows, mixed dtypes) are turned down by the ``supports``
predicates and the ops run their composites. Modules are compiled per dtype and cached.

>>> sorted(KERNELS)
['gru_gates_backward', 'gru_gates_forward', 'lstm_gates_backward', 'lstm_gates_forward']
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import Array, cupy
from . import compiler
from .halfs import KERNEL_DTYPES, dtype_defines

__all__ = ["lstm_gates_forward", "lstm_gates_backward", "gru_gates_forward", "gru_gates_backward",
           "lstm_forward_supports", "gru_forward_supports", "lstm_backward_supports", "gru_backward_supports",
           "KERNELS", "SOURCE_VARIANTS"]


_THREADS = 256
_MAX_BLOCKS = 65535 * 4     # a grid-stride loop beyond that
_NULL = np.uint64(0)


def SOURCE_VARIANTS():
    """``(source, defines)`` of every variant the kernels launch: ``cuda/recurrent.cu`` for each dtype.

    >>> [d for _, d in SOURCE_VARIANTS()][0]
    {'FX_DTYPE': 1}
    """
    for dtype in KERNEL_DTYPES:
        yield "recurrent.cu", dtype_defines(dtype)


def _function(name, dtype):
    return compiler.function("recurrent.cu", name, dtype_defines(dtype))


def _launch(name, dtype, total, args):
    blocks = min(-(-total // _THREADS), _MAX_BLOCKS)
    _function(name, dtype)((blocks,), (_THREADS,), args)


def _rows(a, m):
    """``a``'s row stride in elements for ``m`` rows: 0 for a vector or a single row (it serves every row)."""
    return np.int64(0 if a.ndim == 1 or a.shape[0] == 1 else a.strides[0] // a.itemsize)


def _lead_rows(*arrays):
    """``(lead shape, M)``: the leading shape the operands broadcast to (``()`` or ``(M,)``) and its row count."""
    m = max((a.shape[0] for a in arrays if a is not None and a.ndim == 2), default=None)
    return ((), 1) if m is None else ((m,), m)


def _strides(a, m):
    """``(row stride, element stride)`` of ``a`` in elements for ``m`` rows (row stride 0 for one row)."""
    isz = a.itemsize
    if a.ndim == 1:
        return np.int64(0), np.int64(a.strides[0] // isz)
    return np.int64(0 if a.shape[0] == 1 else a.strides[0] // isz), np.int64(a.strides[1] // isz)


def _cotangent_fits(a, width, dtype, m):
    """Like :func:`_operand_fits`, any element stride (a broadcast cotangent, all strides 0, is read in place)."""
    if type(a) is not cupy.ndarray or a.dtype != dtype or a.ndim not in (1, 2) or a.shape[-1] != width:
        return False
    if a.ndim == 2 and a.shape[0] not in (1, m):
        return False
    return all(st % a.itemsize == 0 for st in a.strides)


def _operand_fits(a, width, dtype, m):
    """A CuPy array of ``dtype``, ``(width,)`` or ``(m or 1, width)``, unit element stride, whole row strides."""
    if type(a) is not cupy.ndarray or a.dtype != dtype or a.ndim not in (1, 2) or a.shape[-1] != width:
        return False
    if a.ndim == 2 and a.shape[0] not in (1, m):
        return False
    isz = a.itemsize
    return a.strides[-1] == isz and (a.ndim == 1 or a.strides[0] % isz == 0)


def _fit_all(pairs):
    """Each ``(array or None, width)`` fits with one dtype and one row count; the first array sets the dtype."""
    first = pairs[0][0]
    if type(first) is not cupy.ndarray or first.dtype not in KERNEL_DTYPES or first.size == 0:
        return False
    m = max((a.shape[0] for a, _ in pairs if a is not None and getattr(a, "ndim", 0) == 2), default=1)
    if m >= 2**31 or pairs[0][1] == 0:
        return False
    return all(a is None or _operand_fits(a, w, first.dtype, m) for a, w in pairs)


def lstm_forward_supports(gates: Any, c_prev: Any, gates_h: Any, save: bool) -> bool:
    """CuPy arrays of one dtype among float16, bfloat16, float32, float64: ``gates`` and ``gates_h`` (or None)
    ``(4H,)`` or ``(M or 1, 4H)``, ``c_prev`` ``(H,)`` or ``(M or 1, H)``, each with unit element stride (any row
    stride)."""
    if type(gates) is not cupy.ndarray or type(c_prev) is not cupy.ndarray:
        return False
    width = gates.shape[-1] if gates.ndim else 0
    return width % 4 == 0 and _fit_all(((gates, width), (c_prev, width // 4), (gates_h, width)))


def gru_forward_supports(gi: Any, gh: Any, h_prev: Any, save: bool) -> bool:
    """CuPy arrays of one dtype among float16, bfloat16, float32, float64: ``gi`` and ``gh`` ``(3H,)`` or
    ``(M or 1, 3H)``, ``h_prev`` ``(H,)`` or ``(M or 1, H)``, each with unit element stride (any row stride)."""
    if type(gi) is not cupy.ndarray or type(gh) is not cupy.ndarray or type(h_prev) is not cupy.ndarray:
        return False
    width = gi.shape[-1] if gi.ndim else 0
    return width % 3 == 0 and _fit_all(((gi, width), (gh, width), (h_prev, width // 3)))


def lstm_gates_forward(gates: Array, c_prev: Array, gates_h: Array | None = None,
                       save: bool = True) -> tuple[Array, Array | None]:
    """``(y, act)`` of the LSTM step in one launch: ``y = [h; c]`` ``(2, *lead, H)``, ``act`` the activated gates
    ``(*lead, 4H)`` (None without ``save``)."""
    hidden = gates.shape[-1] // 4
    lead, m = _lead_rows(gates, c_prev, gates_h)
    y = cupy.empty((2,) + lead + (hidden,), gates.dtype)
    act = cupy.empty(lead + (4 * hidden,), gates.dtype) if save else None
    other = (_NULL, np.int64(0)) if gates_h is None else (gates_h, _rows(gates_h, m))
    _launch("lstm_fwd", gates.dtype, m * hidden, (gates, _rows(gates, m), *other, c_prev, _rows(c_prev, m), y,
                                                  _NULL if act is None else act, np.int64(m), np.int32(hidden)))
    return y, act


def lstm_backward_supports(dy: Any, act: Any, y: Any, c_prev: Any) -> bool:
    """``dy`` ``(2, *lead, H)`` (any strides), ``act`` and ``y`` as the forward made them (C-contiguous),
    ``c_prev`` as the forward took it; one dtype."""
    if type(dy) is not cupy.ndarray or type(act) is not cupy.ndarray or type(y) is not cupy.ndarray:
        return False
    if dy.shape != y.shape or dy.ndim not in (2, 3) or not (act.flags.c_contiguous and y.flags.c_contiguous):
        return False
    hidden = y.shape[-1]
    m = 1 if y.ndim == 2 else y.shape[1]
    return act.shape == y.shape[1:-1] + (4 * hidden,) and _fit_all(((act, 4 * hidden), (c_prev, hidden))) and \
        _cotangent_fits(dy[0], hidden, act.dtype, m) and _cotangent_fits(dy[1], hidden, act.dtype, m)


def lstm_gates_backward(dy: Array, act: Array, y: Array, c_prev: Array) -> tuple[Array, Array]:
    """``(dgates, dc_prev)`` of the LSTM step in one launch, both of the full shape."""
    hidden = y.shape[-1]
    m = 1 if y.ndim == 2 else y.shape[1]
    dz = cupy.empty(act.shape, act.dtype)
    dcp = cupy.empty(y.shape[1:], act.dtype)
    dh, dc = dy[0], dy[1]
    _launch("lstm_bwd", act.dtype, m * hidden, (dh, *_strides(dh, m), dc, *_strides(dc, m), act, y[1], c_prev,
                                                _rows(c_prev, m), dz, dcp, np.int64(m), np.int32(hidden)))
    return dz, dcp


def gru_gates_forward(gi: Array, gh: Array, h_prev: Array, save: bool = True) -> tuple[Array, Array | None]:
    """``(h, act)`` of the GRU step in one launch: ``h`` ``(*lead, H)``, ``act = [r, z, n, gh_n]`` ``(*lead, 4H)``
    (None without ``save``)."""
    hidden = gi.shape[-1] // 3
    lead, m = _lead_rows(gi, gh, h_prev)
    h = cupy.empty(lead + (hidden,), gi.dtype)
    act = cupy.empty(lead + (4 * hidden,), gi.dtype) if save else None
    _launch("gru_fwd", gi.dtype, m * hidden, (gi, _rows(gi, m), gh, _rows(gh, m), h_prev, _rows(h_prev, m), h,
                                              _NULL if act is None else act, np.int64(m), np.int32(hidden)))
    return h, act


def gru_backward_supports(dh: Any, act: Any, h_prev: Any) -> bool:
    """``dh`` ``(*lead, H)`` (any strides), ``act`` as the forward made it, ``h_prev`` as it took it."""
    if type(act) is not cupy.ndarray or type(dh) is not cupy.ndarray or not act.flags.c_contiguous:
        return False
    hidden = act.shape[-1] // 4
    return dh.shape == act.shape[:-1] + (hidden,) and _fit_all(((act, 4 * hidden), (h_prev, hidden))) and \
        _cotangent_fits(dh, hidden, act.dtype, act.shape[0] if act.ndim == 2 else 1)


def gru_gates_backward(dh: Array, act: Array, h_prev: Array) -> tuple[Array, Array, Array]:
    """``(dgi, dgh, dh_prev)`` of the GRU step in one launch, each of the full shape."""
    hidden = act.shape[-1] // 4
    lead = act.shape[:-1]
    m = lead[0] if lead else 1
    dgi = cupy.empty(lead + (3 * hidden,), act.dtype)
    dgh = cupy.empty(lead + (3 * hidden,), act.dtype)
    dhp = cupy.empty(lead + (hidden,), act.dtype)
    _launch("gru_bwd", act.dtype, m * hidden, (dh, *_strides(dh, m), act, h_prev, _rows(h_prev, m), dgi, dgh, dhp,
                                               np.int64(m), np.int32(hidden)))
    return dgi, dgh, dhp


KERNELS = {"lstm_gates_forward": (lstm_gates_forward, lstm_forward_supports),
           "lstm_gates_backward": (lstm_gates_backward, lstm_backward_supports),
           "gru_gates_forward": (gru_gates_forward, gru_forward_supports),
           "gru_gates_backward": (gru_gates_backward, gru_backward_supports)}
