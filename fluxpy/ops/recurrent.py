"""The pointwise part of one recurrent step as one op each: :func:`lstm_gates` and :func:`gru_gates` (PyTorch's
``_thnn_fused_lstm_cell`` and ``_thnn_fused_gru_cell``; the matrix products stay outside, with cuBLAS or BLAS).

A step of an LSTM or GRU composed from small ops (gate slices, sigmoids, tanhs, products, sums) is a dozen
kernels forward and more backward; here the forward is one kernel and the backward one kernel, each an op with a
composite written with fluxpy ops (:func:`fluxpy.ops.fused.fused_op`): ``lstm_gates_forward``,
``lstm_gates_backward``, ``gru_gates_forward``, ``gru_gates_backward``. The forward saves what the backward reads
(the activated gates, and for the GRU the hidden projection's candidate part ``gh_n``). On plain arrays the kernels
registered for NumPy (:mod:`fluxpy.kernels.cpu_recurrent`) and CuPy (:mod:`fluxpy.kernels.cuda_recurrent`) run;
on Tracked values (a nested ``gradient``) the composites run, which the tape differentiates op by op: second
derivatives are those of the composites.

Gate order and maths are PyTorch's (LSTM ``i, f, g, o``; GRU ``r, z, n``). The leading axes of every operand
broadcast (a state of shape ``(H,)`` serves every row); float16 and bfloat16 are computed in float32 by the
kernels and each result rounded once.

>>> import numpy as np
>>> h, c = lstm_gates(np.zeros((1, 4)), np.ones((1, 1)))
>>> h.round(4), c
(array([[0.2311]]), array([[0.5]]))
>>> gru_gates(np.zeros((1, 3)), np.zeros((1, 3)), np.ones((1, 1)))   # z = 1/2: h = n/2 + h_prev/2, n = 0
array([[0.5]])
"""
from __future__ import annotations

import numpy as np

from ..autodiff import Primitive
from ..backend import Array
from .activations import sigmoid
from .basic import tanh
from .fused import fused_op
from .shape import broadcast_to, concatenate, getitem, stack, unbroadcast

__all__ = ["lstm_gates", "gru_gates", "lstm_gates_forward", "lstm_gates_backward", "gru_gates_forward",
           "gru_gates_backward"]


def _shape(a):
    return tuple(getattr(a, "shape", ()))


def _block(a, k, n):
    """Block ``k`` of width ``n`` along the last axis of ``a``."""
    return getitem(a, (Ellipsis, slice(k * n, (k + 1) * n)))


# ---------------------------------------------------------------------------------------------
# LSTM


def _lstm_forward_composite(gates, c_prev, gates_h, save):
    z = gates if gates_h is None else gates + gates_h
    n = z.shape[-1] // 4
    i, f, g, o = sigmoid(_block(z, 0, n)), sigmoid(_block(z, 1, n)), tanh(_block(z, 2, n)), sigmoid(_block(z, 3, n))
    c = f * c_prev + i * g
    h = o * tanh(c)
    return stack([h, c]), (concatenate([i, f, g, o], axis=-1) if save else None)


lstm_gates_forward = fused_op("lstm_gates_forward", _lstm_forward_composite, doc="""
    ``(y, act)`` of one LSTM step: ``z = gates + gates_h`` (``gates_h`` may be None), ``[i, f, g, o] =
    [sigmoid, sigmoid, tanh, sigmoid](z)`` (the four blocks of the last axis), ``c = f c_prev + i g``,
    ``h = o tanh(c)``; ``y = stack([h, c])`` ``(2, *lead, H)``; ``act = [i, f, g, o]`` concatenated, what the
    backward reads (None without ``save``). One kernel on the GPU.

    >>> import numpy as np
    >>> y, act = lstm_gates_forward(np.zeros((1, 4)), np.ones((1, 1)), None, True)
    >>> y.shape, act.tolist()
    ((2, 1, 1), [[0.5, 0.5, 0.0, 0.5]])
    """)


def _lstm_backward_composite(dy, act, y, c_prev):
    n = act.shape[-1] // 4
    i, f, g, o = (_block(act, k, n) for k in range(4))
    dh, dc = getitem(dy, 0), getitem(dy, 1)
    tc = tanh(getitem(y, 1))
    dct = dc + dh * o * (1 - tc * tc)
    dz = concatenate([dct * g * (i * (1 - i)), dct * c_prev * (f * (1 - f)), dct * (i * (1 - g * g)),
                      dh * tc * (o * (1 - o))], axis=-1)
    return dz, dct * f


lstm_gates_backward = fused_op("lstm_gates_backward", _lstm_backward_composite, doc="""
    ``(dgates, dc_prev)`` of :func:`lstm_gates_forward` from the cotangent ``dy`` of ``y = stack([h, c])`` and
    the forward's ``act`` and ``y``: ``dc' = dc + dh o (1 - tanh(c)^2)``, ``dgates = [dc' g i(1-i),
    dc' c_prev f(1-f), dc' i (1-g^2), dh tanh(c) o(1-o)]``, ``dc_prev = dc' f``, both of the broadcast (full)
    shape. One kernel on the GPU; a nested gradient differentiates the composite.

    >>> import numpy as np
    >>> y, act = lstm_gates_forward(np.zeros((1, 4)), np.zeros((1, 1)), None, True)
    >>> dz, dc = lstm_gates_backward(np.array([[[0.0]], [[1.0]]]), act, y, np.zeros((1, 1)))
    >>> dz.tolist(), dc.tolist()   # dc' = 1: only the candidate block gets i (1 - g^2) = 1/2
    ([[0.0, 0.0, 0.5, 0.0]], [[0.5]])
    """)


def _lstm_rule(needs, gates, c_prev, gates_h):
    y, act = lstm_gates_forward(gates, c_prev, gates_h, True)
    gshape, cshape, hshape = _shape(gates), _shape(c_prev), _shape(gates_h)

    def lstm_gates_pullback(dy):
        dz, dcp = lstm_gates_backward(dy, act, y, c_prev)
        return ((unbroadcast(dz, gshape) if needs[0] else None), (unbroadcast(dcp, cshape) if needs[1] else None),
                (unbroadcast(dz, hshape) if needs[2] else None))   # needs[2]: gates_h is given and tracked
    return y, lstm_gates_pullback


_lstm_gates = Primitive("lstm_gates", _lstm_rule, impl=lambda g, c, gh: lstm_gates_forward(g, c, gh, False)[0],
                        needs_mask=True)


def _check(name, what, arrays):
    """The last axes fit (each a multiple of ``H`` as :data:`_WIDTHS` says, ``H`` from the first), leading axes
    broadcast: else a ValueError naming the op and every shape, before any kernel runs."""
    shapes = [tuple(getattr(a, "shape", ())) for a in arrays]
    gates = _WIDTHS[name][0]
    width = shapes[0][-1] if shapes[0] else 0
    hidden = width // gates if width % gates == 0 else 0
    ok = hidden > 0 and all(s and s[-1] == hidden * k for s, k in zip(shapes, _WIDTHS[name]))
    if ok:
        leads = {s[:-1] for s in shapes}
        if len(leads) > 1:
            try:
                np.broadcast_shapes(*leads)
            except ValueError:
                ok = False
    if not ok:
        raise ValueError(f"{name} expects {what}, got " + ", ".join(str(s) for s in shapes))


_WIDTHS = {"lstm_gates": (4, 1, 4), "gru_gates": (3, 3, 1)}   # each operand's last axis, in units of H


def lstm_gates(gates: Array, c_prev: Array, gates_h: Array | None = None) -> tuple[Array, Array]:
    """One LSTM step after its matrix products: ``(h, c)`` from the pre-activation ``gates`` ``(..., 4H)`` (the
    input projection with the bias and the hidden projection ``h_prev W_hh^T``, gates ``i, f, g, o`` as PyTorch's)
    and the cell state ``c_prev`` ``(..., H)``.

    ``i, f, o = sigmoid``, ``g = tanh`` of their blocks; ``c = f c_prev + i g``; ``h = o tanh(c)``. ``gates_h``,
    where given, is added to ``gates`` inside the op (the input and hidden projections apart, as PyTorch's fused
    cell takes them: one addition fewer). Leading axes broadcast (a state ``(H,)`` serves every row). Forward and
    backward are one kernel each on the GPU and a few NumPy calls on the CPU; second derivatives go through the
    composite (see the module).

    >>> import numpy as np
    >>> h, c = lstm_gates(np.array([[0.0, 0.0, 10.0, 0.0]]), np.zeros(1))   # i = 1/2, g = tanh(10)
    >>> c.round(4), h.round(4)
    (array([[0.5]]), array([[0.2311]]))
    """
    arrays = (gates, c_prev) if gates_h is None else (gates, c_prev, gates_h)
    _check("lstm_gates", "gates (..., 4H), c_prev (..., H) and gates_h (..., 4H) or None, leading axes "
           "broadcasting", arrays)
    y = _lstm_gates(gates, c_prev, gates_h)
    return getitem(y, 0), getitem(y, 1)


# ---------------------------------------------------------------------------------------------
# GRU


def _gru_forward_composite(gi, gh, h_prev, save):
    n = gi.shape[-1] // 3
    r = sigmoid(_block(gi, 0, n) + _block(gh, 0, n))
    z = sigmoid(_block(gi, 1, n) + _block(gh, 1, n))
    ghn = _block(gh, 2, n)
    cand = tanh(_block(gi, 2, n) + r * ghn)
    h = (1 - z) * cand + z * h_prev
    if not save:
        return h, None
    ghn = broadcast_to(ghn, cand.shape) if ghn.shape != cand.shape else ghn
    return h, concatenate([r, z, cand, ghn], axis=-1)


gru_gates_forward = fused_op("gru_gates_forward", _gru_forward_composite, doc="""
    ``(h, act)`` of one GRU step: ``r = sigmoid(gi_r + gh_r)``, ``z = sigmoid(gi_z + gh_z)``,
    ``n = tanh(gi_n + r gh_n)``, ``h = (1 - z) n + z h_prev``; ``act = [r, z, n, gh_n]`` concatenated, what the
    backward reads (None without ``save``). One kernel on the GPU.

    >>> import numpy as np
    >>> h, act = gru_gates_forward(np.zeros((1, 3)), np.array([[0.0, 0.0, 2.0]]), np.ones((1, 1)), True)
    >>> h.tolist(), act.round(4).tolist()
    ([[0.5]], [[0.5, 0.5, 0.0, 2.0]])
    """)


def _gru_backward_composite(dh, act, h_prev):
    n = act.shape[-1] // 4
    r, z, cand, ghn = (_block(act, k, n) for k in range(4))
    dpn = dh * (1 - z) * (1 - cand * cand)
    dpz = dh * (h_prev - cand) * (z * (1 - z))
    dpr = dpn * ghn * (r * (1 - r))
    return (concatenate([dpr, dpz, dpn], axis=-1), concatenate([dpr, dpz, dpn * r], axis=-1), dh * z)


gru_gates_backward = fused_op("gru_gates_backward", _gru_backward_composite, doc="""
    ``(dgi, dgh, dh_prev)`` of :func:`gru_gates_forward` from the cotangent ``dh`` and the forward's ``act``:
    ``dn' = dh (1 - z)(1 - n^2)``, ``dz' = dh (h_prev - n) z(1-z)``, ``dr' = dn' gh_n r(1-r)``, ``dgi = [dr', dz',
    dn']``, ``dgh = [dr', dz', dn' r]``, ``dh_prev = dh z``, each of the broadcast (full) shape. One kernel on the
    GPU; a nested gradient differentiates the composite.

    >>> import numpy as np
    >>> _, act = gru_gates_forward(np.zeros((1, 3)), np.zeros((1, 3)), np.ones((1, 1)), True)
    >>> [g.tolist() for g in gru_gates_backward(np.ones((1, 1)), act, np.ones((1, 1)))]
    [[[0.0, 0.25, 0.5]], [[0.0, 0.25, 0.25]], [[0.5]]]
    """)


def _gru_rule(needs, gi, gh, h_prev):
    h, act = gru_gates_forward(gi, gh, h_prev, True)
    ishape, hshape, pshape = _shape(gi), _shape(gh), _shape(h_prev)

    def gru_gates_pullback(dh):
        dgi, dgh, dhp = gru_gates_backward(dh, act, h_prev)
        return ((unbroadcast(dgi, ishape) if needs[0] else None), (unbroadcast(dgh, hshape) if needs[1] else None),
                (unbroadcast(dhp, pshape) if needs[2] else None))
    return h, gru_gates_pullback


_gru_gates = Primitive("gru_gates", _gru_rule, impl=lambda gi, gh, hp: gru_gates_forward(gi, gh, hp, False)[0],
                       needs_mask=True)


def gru_gates(gi: Array, gh: Array, h_prev: Array) -> Array:
    """One GRU step after its matrix products: ``h`` from the input projection ``gi`` ``(..., 3H)`` (with its bias),
    the hidden projection ``gh`` ``(..., 3H)`` (``h_prev W_hh^T``, with PyTorch's ``b_hh`` where there is one) and
    the state ``h_prev`` ``(..., H)``, gates ``r, z, n`` as PyTorch's.

    ``r = sigmoid(gi_r + gh_r)``, ``z = sigmoid(gi_z + gh_z)``, ``n = tanh(gi_n + r gh_n)`` (the reset gate
    multiplies the hidden projection, PyTorch's and Flux's ``GRU``), ``h = (1 - z) n + z h_prev``. Leading axes
    broadcast. Forward and backward are one kernel each on the GPU and a few NumPy calls on the CPU; second
    derivatives go through the composite (see the module).

    >>> import numpy as np
    >>> gru_gates(np.array([[0.0, -30.0, 0.0]]), np.array([[0.0, 0.0, 4.0]]), np.zeros(1)).round(4)   # z ~ 0
    array([[0.964]])
    """
    _check("gru_gates", "gi (..., 3H), gh (..., 3H) and h_prev (..., H), leading axes broadcasting",
           (gi, gh, h_prev))
    return _gru_gates(gi, gh, h_prev)
