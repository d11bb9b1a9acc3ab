"""Recurrent layers, batch first (Flux's ``src/layers/recurrent.jl``, PyTorch's gate order): the cells
:class:`RNNCell`, :class:`LSTMCell`, :class:`GRUCell` take one step, ``cell(x, state) -> (h, state)``; the layers
:class:`RNN`, :class:`LSTM`, :class:`GRU` run a cell over ``(N, T, in)`` and return ``(N, T, hidden)``.

Parameters: ``weight_ih`` ``(G * hidden, in)``, ``weight_hh`` ``(G * hidden, hidden)``, ``bias`` ``(G * hidden,)``,
``G`` = 1 (RNN), 4 (LSTM: gates i, f, g, o) or 3 (GRU: r, z, n), as PyTorch's. One bias, added to the input
projection: PyTorch's ``b_ih + b_hh`` is that bias for RNN and LSTM exactly; for GRU the candidate gate is
``n = tanh(W_in x + b_n + r * (W_hn h))`` (Flux's), PyTorch's ``b_hn`` sits inside the ``r *``, so weights move from
PyTorch exactly where ``b_hn`` is zero.

As in Flux: a state of shape ``(hidden,)`` serves every sequence of a batch (:func:`initialstates` gives the zero
one), an unbatched step ``(in,)`` or sequence ``(T, in)`` is taken as it is, ``bias=False`` drops the bias,
``return_state=True`` (in the constructor or the call) also returns the final state, and :class:`Recurrence` runs any
cell over time.

Sequences of different lengths: ``layer(x, lengths=lengths)`` takes a right-padded batch ``x`` ``(N, T, in)``
(:func:`fluxpy.pad_sequence`) and ``lengths`` ``(N,)``, ints in ``[1, T]``, with the semantics of PyTorch's packed
sequences: the outputs past each sequence's length are zero, and the final state (``return_state``) is the state at
its last step, as if each sequence had been run alone at its own length; gradients reach no padded step. The padded
steps are computed and discarded (:mod:`fluxpy.sequences` says why), so padding must be finite (zeros are). Lengths
on the host are checked; on the GPU give them as a device array, which is never read (a captured step stays
capturable). fluxpy's ``GRU`` is Flux's (and PyTorch's) form; Flux's ``GRUv3`` has no counterpart here.

``num_layers`` and ``bidirectional`` (RNN, LSTM, GRU; PyTorch's semantics and layout): layer ``k > 0`` takes layer
``k - 1``'s outputs, a reverse direction runs from the last step to the first, the output is ``(N, T, D hidden)``
(the directions concatenated on the feature axis), the state ``(num_layers * D, N, hidden)`` (an LSTM's a pair;
``(num_layers * D, hidden)`` for an unbatched sequence ``(T, in)``).
``layer.cell`` is layer 0's forward cell, ``layer.stacked`` the other cells in PyTorch's order (``weight_ih_l0_reverse``
is ``stacked[0]``'s ``weight_ih``). PyTorch's inter-layer ``dropout`` is not supported (a nonzero value is refused).

A batch ``(N, T, in)`` without ``lengths`` runs as one op, :func:`fluxpy.ops.rnn.rnn`: on the GPU one cuDNN call
forward and two backward for the whole stack (:mod:`fluxpy.kernels.cudnn.rnn`), elsewhere the step loop. The step
loop (also for ``lengths=``, unbatched sequences, :class:`GRUv3` and :class:`Recurrence`) runs through fluxpy's
ops: the input projection of a whole batched sequence is one matrix product before the loop; a step is the
recurrent product and one op for the gates (:func:`fluxpy.ops.lstm_gates`, :func:`fluxpy.ops.gru_gates`, the RNN's
:func:`fluxpy.ops.bias_act`), one kernel forward and one backward on the GPU.

>>> import numpy as np
>>> lstm = LSTM(3, 5, rng=0)
>>> x = np.ones((2, 7, 3), np.float32)
>>> lstm(x).shape, [a.shape for a in lstm(x, return_state=True)[1]]
((2, 7, 5), [(2, 5), (2, 5)])
>>> y, (h, c) = lstm(x, lengths=[7, 3], return_state=True)   # the second sequence has 3 steps
>>> bool((y[1, 3:] == 0).all()), bool(np.allclose(h[1], lstm(x[1:, :3])[0, -1]))
(True, True)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..autodiff import value_of
from ..backend import get_array_module, is_float_dtype
from ..functors import children, layer, rebuild
from ..kernels.halfs import is_half
from ..ops.activations import sigmoid
from ..ops.basic import tanh, where
from ..ops.bias_act import bias_act
from ..ops.linalg import matmul
from ..ops.recurrent import gru_gates, lstm_gates
from ..ops.rnn import rnn
from ..ops.shape import astype, broadcast_to, getitem, reshape, stack, transpose
from ..random import as_rng
from ..sequences import sequence_mask
from ._checks import (Array, DimensionMismatch, _activation, _describe_input, _fail, _initialised, _positive_int,
                      _require_dtype, _require_native)
from .init import RNG, glorot_uniform, zeros32
from .show import _act_part

__all__ = ["RNNCell", "LSTMCell", "GRUCell", "GRUv3Cell", "RNN", "LSTM", "GRU", "GRUv3", "Recurrence", "initialstates"]


def _cell_params(cell, who, gates, in_features, hidden, init, rng, bias=True):
    in_features = _positive_int(who, "in_features", in_features)
    hidden = _positive_int(who, "hidden", hidden)
    if not isinstance(bias, bool):
        raise ValueError(f"{who}: bias must be True or False, got {bias!r}")
    cell.weight_ih = _initialised(who, init, (gates * hidden, in_features), rng)
    cell.weight_hh = _initialised(who, init, (gates * hidden, hidden), rng)
    cell.bias = zeros32(gates * hidden) if bias else None


def _check_step(cell, x, state):
    """``x`` ``(batch, in)`` of the parameters' dtype, and the cell's ``state`` (:func:`_check_state`)."""
    n_in = cell.weight_ih.shape[1]
    if not hasattr(x, "shape") or len(x.shape) != 2 or x.shape[1] != n_in:
        _fail(cell, f"x of shape (batch, {n_in}) or ({n_in},)", x)
    _require_dtype(cell, x, cell.weight_ih.dtype)
    _check_state(cell, cell, x.shape[0], state)


def _check_state(who, cell, batch, state, dtype=None):
    """The state arrays of ``(batch, hidden)`` or ``(hidden,)`` and of the parameters' dtype (a float64 state is
    never silently promoted into a float32 cell's step; ``dtype`` where the input's is another, see
    :func:`_data_dtype`), one state for the whole batch (Flux's); an LSTM's a pair ``(h, c)``; None: zeros.
    ``who``: the cell, or the layer that runs it, named by the errors."""
    if isinstance(cell, LSTMCell):
        if state is not None and (not isinstance(state, tuple) or len(state) != 2):
            raise DimensionMismatch(f"{who!r} expects its state as a pair (h, c), got {_describe_input(state)}")
        named = () if state is None else zip(("state h", "state c"), state)
    else:
        named = (("state h", state),)
    hidden = cell.weight_hh.shape[1]
    for name, s in named:
        if s is None:
            continue
        if tuple(getattr(s, "shape", ())) not in ((batch, hidden), (hidden,)):
            _fail(who, f"a state of shape (batch, hidden) = ({batch}, {hidden}) or (hidden,) = ({hidden},)", s,
                  name)
        _require_dtype(who, s, cell.weight_hh.dtype if dtype is None else dtype, name)


def _data_dtype(cell, x):
    """The dtype a whole-sequence layer takes its input and states in: its weights', or a half type where they are
    float32 (:class:`fluxpy.MixedPrecision` keeps a recurrent layer's weights float32, the master weights, and the op
    takes them with half inputs)."""
    w = np.dtype(cell.weight_ih.dtype)
    dtype = getattr(x, "dtype", None)
    half = isinstance(dtype, np.dtype) and is_half(dtype)   # a foreign array's dtype: the dtype check names it
    return dtype if w == np.float32 and half else w


def _in_dtype(layer_, dtype):
    """``layer_`` with its float arrays cast to ``dtype`` (differentiable casts: the gradients reach the float32
    weights), for the step loop of a layer whose float32 weights meet a half input."""
    kids = children(layer_)
    if kids is None:
        return astype(layer_, dtype) if is_float_dtype(getattr(layer_, "dtype", None)) else layer_
    return rebuild(layer_, [(k, _in_dtype(v, dtype)) for k, v in kids])


def _unbatched(cell, step):
    """``cell.__call__`` that also takes one unbatched ``x`` ``(in,)`` (Flux's vector input): run as a batch of one,
    the outputs and state given back without the batch axis."""
    def call(self, x, state=None):
        _require_native(self, x)
        if not (hasattr(x, "shape") and len(x.shape) == 1):
            return step(self, x, state)
        h, new = step(self, reshape(x, (1, x.shape[0])), state)
        drop = (lambda a: reshape(a, a.shape[1:]) if len(a.shape) == 2 else a)
        return drop(h), (tuple(drop(a) for a in new) if isinstance(new, tuple) else drop(new))
    call.__doc__, call.__name__ = step.__doc__, step.__name__
    return call


def initialstates(layer: Any) -> Any:
    """The zero initial state of a recurrent cell or layer (Flux's ``initialstates``): ``zeros(hidden)`` in the
    weights' dtype, a pair ``(h, c)`` of them for an LSTM. A state of shape ``(hidden,)`` serves every batch.

    >>> initialstates(LSTMCell(3, 2))
    (array([0., 0.], dtype=float32), array([0., 0.], dtype=float32))
    """
    cell = getattr(layer, "cell", layer)
    if not hasattr(cell, "weight_hh"):
        raise TypeError(f"initialstates expects a recurrent cell or layer, got {type(layer).__name__}")
    w = value_of(cell.weight_hh)
    h = get_array_module(w).zeros(w.shape[1], dtype=w.dtype)
    return (h, h.copy()) if isinstance(cell, LSTMCell) else h


def _zeros_state(cell, x):
    xp = get_array_module(value_of(x))
    return xp.zeros((x.shape[0], cell.weight_hh.shape[1]), dtype=cell.weight_hh.dtype)


def _project(cell, x):
    """The input projection ``x W_ih^T + bias`` of any leading shape: one matrix product for a whole sequence."""
    xi = matmul(x, transpose(cell.weight_ih))
    return xi if cell.bias is None else xi + cell.bias


def _recurrent(cell, h, w_hh_t=None):
    """The recurrent part ``h W_hh^T`` (``w_hh_t``: ``W_hh^T`` made once for a whole sequence)."""
    return matmul(h, transpose(cell.weight_hh) if w_hh_t is None else w_hh_t)


@layer(children=("weight_ih", "weight_hh", "bias"))
class RNNCell:
    """One step of an Elman RNN: ``h' = act(x W_ih^T + bias + h W_hh^T)``; ``cell(x, h=None) -> (h', h')``.

    >>> import numpy as np
    >>> c = RNNCell(3, 4, rng=0)
    >>> h, state = c(np.ones((2, 3), np.float32))
    >>> c, h.shape, state is h
    (RNNCell(3 => 4, tanh), (2, 4), True)
    """

    def __init__(self, in_features: int, hidden: int, act: Callable = tanh, *, init: Callable = glorot_uniform,
                 rng: RNG = None, bias: bool = True) -> None:
        _cell_params(self, "RNNCell", 1, in_features, hidden, init, rng, bias)
        self.act = _activation("RNNCell", act)

    def _step(self, x: Array, h: Array | None = None) -> tuple[Array, Array]:
        _check_step(self, x, h)
        return self._advance(_project(self, x), h)

    def _advance(self, xi: Array, h: Array | None, w_hh_t: Array | None = None) -> tuple[Array, Array]:
        """The step from the projected input ``xi`` ``(batch, hidden)``: one fused ``act(xi + h W_hh^T)``."""
        h = _zeros_state(self, xi) if h is None else h
        h = bias_act(xi, _recurrent(self, h, w_hh_t), self.act)
        return h, h

    __call__ = _unbatched(None, _step)

    def __repr__(self):
        return f"RNNCell({self.weight_ih.shape[1]} => {self.weight_hh.shape[1]}{_act_part(self.act)}{_bias_part(self)})"


@layer(children=("weight_ih", "weight_hh", "bias"))
class LSTMCell:
    """One LSTM step (gates i, f, g, o as PyTorch): ``c' = f c + i g``, ``h' = o tanh(c')``;
    ``cell(x, (h, c)=None) -> (h', (h', c'))``.

    >>> import numpy as np
    >>> c = LSTMCell(3, 4, rng=0)
    >>> h, (h2, c2) = c(np.ones((2, 3), np.float32))
    >>> c, h.shape, c2.shape
    (LSTMCell(3 => 4), (2, 4), (2, 4))
    """

    def __init__(self, in_features: int, hidden: int, *, init: Callable = glorot_uniform, rng: RNG = None,
                 bias: bool = True) -> None:
        _cell_params(self, "LSTMCell", 4, in_features, hidden, init, rng, bias)

    def _step(self, x: Array, state: tuple[Array, Array] | None = None) -> tuple[Array, tuple[Array, Array]]:
        _check_step(self, x, state)
        return self._advance(_project(self, x), state)

    def _advance(self, xi: Array, state: tuple[Array, Array] | None,
                 w_hh_t: Array | None = None) -> tuple[Array, tuple[Array, Array]]:
        """The step from the projected input ``xi`` ``(batch, 4 hidden)``: the recurrent product, then the gates
        as one op (:func:`fluxpy.ops.lstm_gates`)."""
        h, c = (None, None) if state is None else state
        h = _zeros_state(self, xi) if h is None else h
        c = _zeros_state(self, xi) if c is None else c
        h, c = lstm_gates(xi, c, _recurrent(self, h, w_hh_t))
        return h, (h, c)

    __call__ = _unbatched(None, _step)

    def __repr__(self):
        return f"LSTMCell({self.weight_ih.shape[1]} => {self.weight_hh.shape[1]}{_bias_part(self)})"


@layer(children=("weight_ih", "weight_hh", "bias"))
class GRUCell:
    """One GRU step (gates r, z, n as PyTorch; the bias on the input projection, Flux's form):
    ``n = tanh(x W_in^T + b_n + r (h W_hn^T))``, ``h' = (1 - z) n + z h``; ``cell(x, h=None) -> (h', h')``.

    >>> import numpy as np
    >>> c = GRUCell(3, 4, rng=0)
    >>> c, c(np.ones((2, 3), np.float32))[0].shape
    (GRUCell(3 => 4), (2, 4))
    """

    def __init__(self, in_features: int, hidden: int, *, init: Callable = glorot_uniform, rng: RNG = None,
                 bias: bool = True) -> None:
        _cell_params(self, "GRUCell", 3, in_features, hidden, init, rng, bias)

    def _step(self, x: Array, h: Array | None = None) -> tuple[Array, Array]:
        _check_step(self, x, h)
        return self._advance(_project(self, x), h)

    def _advance(self, xi: Array, h: Array | None, w_hh_t: Array | None = None) -> tuple[Array, Array]:
        """The step from the projected input ``xi`` ``(batch, 3 hidden)``: the recurrent product, then the gates
        as one op (:func:`fluxpy.ops.gru_gates`)."""
        h = _zeros_state(self, xi) if h is None else h
        h = gru_gates(xi, _recurrent(self, h, w_hh_t), h)
        return h, h

    __call__ = _unbatched(None, _step)

    def __repr__(self):
        return f"GRUCell({self.weight_ih.shape[1]} => {self.weight_hh.shape[1]}{_bias_part(self)})"


@layer(children=("weight_ih", "weight_hh", "bias"))
class GRUv3Cell:
    """One step of GRU v3 (Cho et al. 2014's form, Flux's ``GRUv3Cell``): the reset gate applied to the state
    before its product, ``n = tanh(x W_in^T + b_n + (r h) W_hn^T)``, with ``r``, ``z`` and ``h' = (1 - z) n + z h``
    as :class:`GRUCell`'s; ``cell(x, h=None) -> (h', h')``. The parameters have :class:`GRUCell`'s shapes
    (``weight_hh`` stacks ``W_hr``, ``W_hz``, ``W_hn``); composed of fluxpy ops (no fused gate kernel).

    >>> import numpy as np
    >>> c = GRUv3Cell(3, 4, rng=0)
    >>> c, c(np.ones((2, 3), np.float32))[0].shape
    (GRUv3Cell(3 => 4), (2, 4))
    """

    def __init__(self, in_features: int, hidden: int, *, init: Callable = glorot_uniform, rng: RNG = None,
                 bias: bool = True) -> None:
        _cell_params(self, "GRUv3Cell", 3, in_features, hidden, init, rng, bias)

    def _step(self, x: Array, h: Array | None = None) -> tuple[Array, Array]:
        _check_step(self, x, h)
        return self._advance(_project(self, x), h)

    def _advance(self, xi: Array, h: Array | None, w_hh_t: Array | None = None) -> tuple[Array, Array]:
        """The step from the projected input ``xi`` ``(batch, 3 hidden)`` (``w_hh_t``: ``W_hh^T``, made once for a
        sequence)."""
        h = _zeros_state(self, xi) if h is None else h
        w = transpose(self.weight_hh) if w_hh_t is None else w_hh_t
        n = self.weight_hh.shape[1]
        both = Ellipsis, slice(0, 2 * n)
        # the gates through bias_act: one kernel each, which keeps a bfloat16 array bfloat16 on CuPy
        rz = bias_act(matmul(h, getitem(w, both)), getitem(xi, both), sigmoid)
        r, z = getitem(rz, (Ellipsis, slice(0, n))), getitem(rz, (Ellipsis, slice(n, 2 * n)))
        third = Ellipsis, slice(2 * n, 3 * n)
        cand = bias_act(matmul(r * h, getitem(w, third)), getitem(xi, third), tanh)
        h = cand + z * (h - cand)   # (1 - z) n + z h without a Python number, which CuPy meets in float32
        return h, h

    __call__ = _unbatched(None, _step)

    def __repr__(self):
        return f"GRUv3Cell({self.weight_ih.shape[1]} => {self.weight_hh.shape[1]}{_bias_part(self)})"


def _bias_part(cell):
    return "" if cell.bias is not None else ", bias=False"


def _run(layer_, x, state, return_state, lengths=None):
    """The cell over the time axis of ``x`` ``(N, T, in)`` (or ``(T, in)``, one unbatched sequence): outputs
    ``(N, T, hidden)`` (``(T, hidden)``) and, with ``return_state``, the final state. fluxpy's cells on a batch
    project the whole sequence's input in one matrix product first (each step's slice of it pulls back into one
    buffer: :class:`fluxpy.autodiff.SliceCotangent`) and transpose ``W_hh`` once; a step is then the recurrent
    product and the gates' one op. With ``lengths`` (:func:`_length_mask`), a step past a sequence's length keeps
    its state (only where the final state is asked for: no later output depends on those states, padding being
    at the end) and the outputs there are zeroed, one ``where`` each."""
    if not hasattr(x, "shape") or len(x.shape) not in (2, 3):
        _fail(layer_, "x of shape (N, T, in) (batch first) or (T, in)", x)
    if x.shape[-2] < 1:
        _fail(layer_, "at least one time step", x)
    cell = layer_.cell
    known = isinstance(cell, (RNNCell, LSTMCell, GRUCell, GRUv3Cell))
    if known:
        _check_sequence(layer_, cell, x, state)
    mask = None if lengths is None else _length_mask(layer_, x, lengths)
    if len(x.shape) == 3 and known:
        xi = _project(cell, x)
        w_hh_t = transpose(cell.weight_hh)
        step = (lambda t, state: cell._advance(getitem(xi, (slice(None), t)), state, w_hh_t))
    else:
        step = (lambda t, state: cell(getitem(x, (slice(None), t) if len(x.shape) == 3 else t), state))
    outs = []
    for t in range(x.shape[-2]):
        h, new = step(t, state)
        # step 0 is inside every sequence (lengths >= 1)
        state = _kept(layer_, mask[:, t:t + 1], new, state) if mask is not None and return_state and t else new
        outs.append(h)
    y = stack(outs, axis=len(x.shape) - 2)
    if mask is not None:
        y = where(mask.reshape(mask.shape + (1,) * (len(y.shape) - 2)), y, 0)
    return (y, state) if return_state else y


def _length_mask(layer_, x, lengths):
    """The mask ``(N, T)`` of the steps inside each sequence of ``x`` ``(N, T, in)``, on ``x``'s device
    (:func:`fluxpy.sequence_mask`). Lengths given on the host (a list, a NumPy array) are checked to lie in
    ``[1, T]``; device lengths are not read (no host sync): there a length below 1 acts as 1, one above ``T`` as
    ``T``."""
    if len(x.shape) != 3:
        _fail(layer_, "x of shape (N, T, in) with lengths= (one per sequence of the batch)", x)
    n, steps = x.shape[0], x.shape[1]
    lengths = value_of(lengths)
    if isinstance(lengths, (list, tuple)):
        lengths = np.asarray(lengths)
    if not hasattr(lengths, "shape") or tuple(lengths.shape) != (n,) or np.dtype(lengths.dtype).kind not in "iu":
        _fail(layer_, f"lengths of shape ({n},), one int per sequence", lengths, "lengths")
    if isinstance(lengths, np.ndarray) and n and (lengths.min() < 1 or lengths.max() > steps):   # host: no sync
        raise ValueError(f"{layer_!r} expects lengths in [1, {steps}] (x's time steps, the padded length), got "
                         f"values from {lengths.min()} to {lengths.max()}")
    xp = get_array_module(value_of(x))
    return sequence_mask(xp.maximum(xp.asarray(lengths), 1), steps)


def _kept(layer_, inside, new, old):
    """The state ``new`` where ``inside`` (``(N, 1)``: this step is inside the sequence), else ``old``: arrays, or
    tuples and lists of them (an LSTM's ``(h, c)``)."""
    if isinstance(new, (tuple, list)) and isinstance(old, (tuple, list)) and len(new) == len(old):
        return type(new)(_kept(layer_, inside, a, b) for a, b in zip(new, old))
    if not (hasattr(new, "shape") and hasattr(old, "shape")):
        raise TypeError(f"{layer_!r} with lengths= keeps each sequence's state past its length, so the cell's state "
                        f"must be arrays, or tuples or lists of them, of one structure at every step; got "
                        f"{_describe_input(new)} after {_describe_input(old)}")
    return where(inside, new, old)


def _check_sequence(layer_, cell, x, state, dtype=None):
    """The checks of :func:`_check_step` for a whole sequence ``x`` ``(N, T, in)`` or ``(T, in)`` and its initial
    state, before the first step, naming the layer (not the cell, nor one step's shape); ``dtype``: theirs, where
    not the weights' (:func:`_data_dtype`)."""
    n_in = cell.weight_ih.shape[1]
    if x.shape[-1] != n_in:
        _fail(layer_, f"x of shape (N, T, {n_in}) (batch first) or (T, {n_in})", x)
    _require_dtype(layer_, x, cell.weight_ih.dtype if dtype is None else dtype)
    _check_state(layer_, cell, x.shape[0] if len(x.shape) == 3 else 1, state, dtype)


class _Recurrent:
    """What RNN, LSTM, GRU and Recurrence share: a cell run over time, ``layer(x, state=None, *, lengths=None,
    return_state=None)``."""

    return_state = False

    def __call__(self, x: Array, state: Any = None, *, lengths: Any = None, return_state: bool | None = None) -> Any:
        try:
            return _run(self, x, state, self.return_state if return_state is None else return_state, lengths)
        except DimensionMismatch as err:   # from inside a cell of Recurrence's that checks nothing before
            if str(err).startswith(repr(self)):
                raise
            raise DimensionMismatch(f"{self!r}: {err}") from None

    def __repr__(self):
        c = self.cell
        extra = (_act_part(c.act) if isinstance(c, RNNCell) else "") + _bias_part(c)
        extra += f", num_layers={self.num_layers}" if getattr(self, "num_layers", 1) != 1 else ""
        extra += ", bidirectional=True" if getattr(self, "bidirectional", False) else ""
        extra += ", return_state=True" if self.return_state else ""
        return f"{type(self).__name__}({c.weight_ih.shape[1]} => {c.weight_hh.shape[1]}{extra})"


class _Stacked(_Recurrent):
    """RNN, LSTM and GRU: ``num_layers`` layers of one cell, one or two directions, as PyTorch's. ``cell`` is layer
    0's forward cell (the one cell of a one-layer, one-direction layer), ``stacked`` the others in PyTorch's order
    (layer 0 reversed, layer 1, layer 1 reversed, ...). A batch ``(N, T, in)`` without ``lengths`` runs as one op
    (:func:`fluxpy.ops.rnn.rnn`: one cuDNN call on the GPU), and so does an unbatched sequence ``(T, in)`` through
    a stacked layer (a batch of one); a one-layer layer takes the step loop for those and for ``lengths=``."""

    num_layers, bidirectional, stacked = 1, False, ()

    def __call__(self, x: Array, state: Any = None, *, lengths: Any = None, return_state: bool | None = None) -> Any:
        return_state = self.return_state if return_state is None else return_state
        if self.stacked:
            return _run_stacked(self, x, state, lengths, return_state)
        if lengths is not None or not hasattr(x, "shape") or len(x.shape) != 3:
            dtype = _data_dtype(self.cell, x)   # the step loop's cells in a half input's type, where it is one
            run = self if dtype == self.cell.weight_ih.dtype else _in_dtype(self, dtype)
            return _Recurrent.__call__(run, x, state, lengths=lengths, return_state=return_state)
        return _run_whole(self, x, state, return_state)


def _stack_cells(layer_, who, make, in_features, hidden, num_layers, bidirectional, dropout, rng):
    """Set ``layer_``'s ``cell``, ``stacked``, ``num_layers`` and ``bidirectional``; ``make(n_in, rng)`` makes a
    cell. One generator serves every cell of a stacked layer (a seed would give each cell the same draws)."""
    num_layers = _positive_int(who, "num_layers", num_layers)
    if not isinstance(bidirectional, bool):
        raise ValueError(f"{who}: bidirectional must be True or False, got {bidirectional!r}")
    if dropout != 0:
        raise ValueError(f"{who}: dropout between layers (PyTorch's dropout={dropout!r}) is not supported; stack "
                         f"one-layer {who}s with Dropout layers between them instead")
    directions = 2 if bidirectional else 1
    more = num_layers * directions - 1
    rng = as_rng(rng, who) if more else rng
    layer_.cell = make(in_features, rng)
    hidden = layer_.cell.weight_hh.shape[1]
    layer_.stacked = tuple(make(in_features if k < directions else directions * hidden, rng)
                           for k in range(1, more + 1))
    layer_.num_layers, layer_.bidirectional = num_layers, bidirectional


def _mode(cell):
    return "lstm" if isinstance(cell, LSTMCell) else "gru" if isinstance(cell, GRUCell) else "rnn"


def _weights(layer_):
    return [(c.weight_ih, c.weight_hh, c.bias) for c in (layer_.cell,) + layer_.stacked]


def _run_whole(layer_, x, state, return_state):
    """A one-layer, one-direction layer over a batch ``x`` ``(N, T, in)`` as one op; states ``(N, H)`` or ``(H,)``
    as the cells take them."""
    cell = layer_.cell
    if x.shape[1] < 1:
        _fail(layer_, "at least one time step", x)
    _check_sequence(layer_, cell, x, state, _data_dtype(cell, x))
    n, hidden = x.shape[0], cell.weight_hh.shape[1]
    lstm = isinstance(cell, LSTMCell)
    h0, c0 = (state if state is not None else (None, None)) if lstm else (state, None)
    h0, c0 = (None if s is None else reshape(broadcast_to(s, (n, hidden)), (1, n, hidden)) for s in (h0, c0))
    y, h, c = rnn(x, _weights(layer_), h0, c0, mode=_mode(cell), act=getattr(cell, "act", None))
    if not return_state:
        return y
    h = reshape(h, (n, hidden))
    return y, ((h, reshape(c, (n, hidden))) if lstm else h)


def _run_stacked(layer_, x, state, lengths, return_state):
    """A stacked or bidirectional layer over ``x`` ``(N, T, in)``, states ``(num_layers * directions, N, H)``
    (PyTorch's), an LSTM's a pair ``(h, c)``; or over one unbatched sequence ``(T, in)`` with states
    ``(num_layers * directions, H)``, run as a batch of one (PyTorch's unbatched input)."""
    cell = layer_.cell
    n_in, hidden = cell.weight_ih.shape[1], cell.weight_hh.shape[1]
    if lengths is not None:
        raise ValueError(f"{layer_!r}: lengths= is taken by one-layer, one-direction layers only (PyTorch's packed "
                         f"sequences through a bidirectional or stacked layer are not supported yet)")
    if not hasattr(x, "shape") or len(x.shape) not in (2, 3) or x.shape[-2] < 1 or x.shape[-1] != n_in:
        _fail(layer_, f"x of shape (N, T, {n_in}) (batch first) or (T, {n_in}), T >= 1", x)
    dtype = _data_dtype(cell, x)
    _require_dtype(layer_, x, dtype)
    lstm = isinstance(cell, LSTMCell)
    if lstm and state is not None and (not isinstance(state, tuple) or len(state) != 2):
        raise DimensionMismatch(f"{layer_!r} expects its state as a pair (h, c), got {_describe_input(state)}")
    h0, c0 = (state if state is not None else (None, None)) if lstm else (state, None)
    unbatched = len(x.shape) == 2
    layers = layer_.num_layers * (2 if layer_.bidirectional else 1)
    shape = (layers, hidden) if unbatched else (layers, x.shape[0], hidden)
    for name, s in (("state h", h0), ("state c", c0)):
        if s is not None:
            if tuple(getattr(s, "shape", ())) != shape:
                _fail(layer_, f"a state of shape (num_layers * directions, {'' if unbatched else 'N, '}hidden) = "
                              f"{shape}", s, name)
            _require_dtype(layer_, s, dtype, name)
    if unbatched:
        x = reshape(x, (1,) + tuple(x.shape))
        h0, c0 = (None if s is None else reshape(s, (layers, 1, hidden)) for s in (h0, c0))
    y, h, c = rnn(x, _weights(layer_), h0, c0, mode=_mode(cell), act=getattr(cell, "act", None),
                  num_layers=layer_.num_layers, bidirectional=layer_.bidirectional)
    if unbatched:
        y, h, c = reshape(y, y.shape[1:]), reshape(h, shape), (None if c is None else reshape(c, shape))
    return (y, ((h, c) if lstm else h)) if return_state else y


def _return_state_option(who, value):
    if not isinstance(value, bool):
        raise ValueError(f"{who}: return_state must be True or False, got {value!r}")
    return value


@layer(children=("cell", "stacked"))
class RNN(_Stacked):
    """An Elman RNN over ``(N, T, in)``: ``(N, T, D hidden)``; ``rnn(x, h0=None, lengths=None, return_state=False)``
    (``lengths``: see the module; ``num_layers``, ``bidirectional``: PyTorch's, see the module).

    >>> import numpy as np
    >>> RNN(3, 4, rng=0)(np.ones((2, 5, 3), np.float32)).shape
    (2, 5, 4)
    >>> from fluxpy import relu
    >>> RNN(3, 4, relu, num_layers=2, bidirectional=True, rng=0)(np.ones((2, 5, 3), np.float32)).shape
    (2, 5, 8)
    """

    def __init__(self, in_features: int, hidden: int, act: Callable = tanh, *, init: Callable = glorot_uniform,
                 rng: RNG = None, bias: bool = True, return_state: bool = False, num_layers: int = 1,
                 bidirectional: bool = False, dropout: float = 0) -> None:
        _stack_cells(self, "RNN", lambda n, r: RNNCell(n, hidden, act, init=init, rng=r, bias=bias), in_features,
                     hidden, num_layers, bidirectional, dropout, rng)
        self.return_state = _return_state_option("RNN", return_state)


@layer(children=("cell", "stacked"))
class LSTM(_Stacked):
    """An LSTM over ``(N, T, in)``: ``(N, T, D hidden)``; ``lstm(x, (h0, c0)=None, lengths=None,
    return_state=False)`` (``lengths``: see the module; ``num_layers``, ``bidirectional``: PyTorch's, see the
    module).

    >>> import numpy as np
    >>> LSTM(3, 4, rng=0)
    LSTM(3 => 4)
    >>> lstm = LSTM(3, 4, num_layers=2, bidirectional=True, rng=0)
    >>> y, (h, c) = lstm(np.ones((2, 5, 3), np.float32), return_state=True)
    >>> lstm, y.shape, h.shape, len(lstm.stacked)
    (LSTM(3 => 4, num_layers=2, bidirectional=True), (2, 5, 8), (4, 2, 4), 3)
    """

    def __init__(self, in_features: int, hidden: int, *, init: Callable = glorot_uniform, rng: RNG = None,
                 bias: bool = True, return_state: bool = False, num_layers: int = 1, bidirectional: bool = False,
                 dropout: float = 0) -> None:
        _stack_cells(self, "LSTM", lambda n, r: LSTMCell(n, hidden, init=init, rng=r, bias=bias), in_features,
                     hidden, num_layers, bidirectional, dropout, rng)
        self.return_state = _return_state_option("LSTM", return_state)


@layer(children=("cell", "stacked"))
class GRU(_Stacked):
    """A GRU over ``(N, T, in)``: ``(N, T, D hidden)``; ``gru(x, h0=None, lengths=None, return_state=False)``
    (``lengths``: see the module; ``num_layers``, ``bidirectional``: PyTorch's, see the module).

    >>> import numpy as np
    >>> GRU(3, 4, rng=0)(np.ones((2, 5, 3), np.float32), return_state=True)[1].shape
    (2, 4)
    >>> GRU(3, 4, num_layers=3, rng=0)(np.ones((2, 5, 3), np.float32), return_state=True)[1].shape
    (3, 2, 4)
    """

    def __init__(self, in_features: int, hidden: int, *, init: Callable = glorot_uniform, rng: RNG = None,
                 bias: bool = True, return_state: bool = False, num_layers: int = 1, bidirectional: bool = False,
                 dropout: float = 0) -> None:
        _stack_cells(self, "GRU", lambda n, r: GRUCell(n, hidden, init=init, rng=r, bias=bias), in_features,
                     hidden, num_layers, bidirectional, dropout, rng)
        self.return_state = _return_state_option("GRU", return_state)


@layer(children=("cell",))
class GRUv3(_Recurrent):
    """GRU v3 over ``(N, T, in)`` (:class:`GRUv3Cell`: the reset gate before the recurrent product; Flux's
    ``GRUv3``): ``(N, T, hidden)``; ``gru(x, h0=None, lengths=None, return_state=False)``.

    >>> import numpy as np
    >>> GRUv3(3, 4, rng=0)(np.ones((2, 5, 3), np.float32)).shape
    (2, 5, 4)
    """

    def __init__(self, in_features: int, hidden: int, *, init: Callable = glorot_uniform, rng: RNG = None,
                 bias: bool = True, return_state: bool = False) -> None:
        self.cell = GRUv3Cell(in_features, hidden, init=init, rng=rng, bias=bias)
        self.return_state = _return_state_option("GRUv3", return_state)


@layer(children=("cell",))
class Recurrence(_Recurrent):
    """Any cell ``cell(x, state) -> (h, state)`` run over the time axis of ``(N, T, in)`` (or ``(T, in)``), giving
    ``(N, T, hidden)`` (Flux's ``Recurrence``); ``return_state=True`` also gives the final state. ``RNN(a, b)`` is
    ``Recurrence(RNNCell(a, b))``. ``lengths=`` as the module says, for a cell whose state is arrays, or tuples or
    lists of them.

    >>> import numpy as np
    >>> r = Recurrence(GRUCell(2, 3, rng=0))
    >>> r, r(np.ones((4, 5, 2), np.float32)).shape
    (Recurrence(GRUCell(2 => 3)), (4, 5, 3))
    """

    def __init__(self, cell: Callable, *, return_state: bool = False) -> None:
        if not callable(cell):
            raise TypeError(f"Recurrence: cell must be callable as cell(x, state) -> (h, state), got {cell!r}")
        self.cell = cell
        self.return_state = _return_state_option("Recurrence", return_state)

    def __repr__(self):
        return f"Recurrence({self.cell!r}{', return_state=True' if self.return_state else ''})"
