"""Recurrent layers, batch first (Flux's ``src/layers/recurrent.jl``, PyTorch's gate order): the cells
:class:`RNNCell`, :class:`LSTMCell`, :class:`GRUCell` take one step, ``cell(x, state) -> (h, state)``; the layers
:class:`RNN`, :class:`LSTM`, :class:`GRU` run a cell over ``(N, T, in)`` and return ``(N, T, hidden)``.

Parameters: ``weight_ih`` ``(G * hidden, in)``, ``weight_hh`` ``(G * hidden, hidden)``, ``bias`` ``(G * hidden,)``,
``G`` = 1 (RNN), 4 (LSTM: gates i, f, g, o) or 3 (GRU: r, z, n), as PyTorch's. One bias, added to the input
projection: PyTorch's ``b_ih + b_hh`` is that bias for RNN and LSTM exactly; for GRU the candidate gate is
``n = tanh(W_in x + b_n + r * (W_hn h))`` (Flux's), PyTorch's ``b_hn`` sits inside the ``r *``, so weights move from
PyTorch exactly where ``b_hn`` is zero.

The time loop runs step by step through fluxpy's ops (on the GPU each step is a few kernels; a fused step kernel
is not built yet).

>>> import numpy as np
>>> lstm = LSTM(3, 5, rng=0)
>>> x = np.ones((2, 7, 3), np.float32)
>>> lstm(x).shape, [a.shape for a in lstm(x, return_state=True)[1]]
((2, 7, 5), [(2, 5), (2, 5)])
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..autodiff import value_of
from ..backend import get_array_module
from ..functors import layer
from ..ops.activations import sigmoid
from ..ops.basic import tanh
from ..ops.linalg import matmul
from ..ops.shape import getitem, stack, transpose
from ._checks import (Array, DimensionMismatch, _activation, _fail, _initialised, _positive_int, _require_dtype)
from .init import RNG, glorot_uniform, zeros32
from .show import _act_part

__all__ = ["RNNCell", "LSTMCell", "GRUCell", "RNN", "LSTM", "GRU"]


def _cell_params(cell, who, gates, in_features, hidden, init, rng):
    in_features = _positive_int(who, "in_features", in_features)
    hidden = _positive_int(who, "hidden", hidden)
    cell.weight_ih = _initialised(who, init, (gates * hidden, in_features), rng)
    cell.weight_hh = _initialised(who, init, (gates * hidden, hidden), rng)
    cell.bias = zeros32(gates * hidden)


def _check_step(cell, x, state_shapes):
    """``x`` ``(batch, in)`` of the parameters' dtype; the state arrays of ``(batch, hidden)``."""
    n_in = cell.weight_ih.shape[1]
    if not hasattr(x, "shape") or len(x.shape) != 2 or x.shape[1] != n_in:
        _fail(cell, f"x of shape (batch, {n_in})", x)
    _require_dtype(cell, x, cell.weight_ih.dtype)
    hidden = cell.weight_hh.shape[1]
    for s in state_shapes:
        if s is not None and tuple(getattr(s, "shape", ())) != (x.shape[0], hidden):
            _fail(cell, f"a state of shape (batch, hidden) = ({x.shape[0]}, {hidden})", s)


def _zeros_state(cell, x):
    xp = get_array_module(value_of(x))
    return xp.zeros((x.shape[0], cell.weight_hh.shape[1]), dtype=cell.weight_hh.dtype)


def _gates(cell, x, h):
    """``x W_ih^T + bias + h W_hh^T`` and its two parts (the GRU needs the recurrent part on its own)."""
    xi = matmul(x, transpose(cell.weight_ih)) + cell.bias
    hh = matmul(h, transpose(cell.weight_hh))
    return xi, hh


def _gate(a, k, n):
    """Gate ``k`` of the stacked gates ``a`` ``(batch, G * n)``."""
    return getitem(a, (slice(None), slice(k * n, (k + 1) * n)))


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
                 rng: RNG = None) -> None:
        _cell_params(self, "RNNCell", 1, in_features, hidden, init, rng)
        self.act = _activation("RNNCell", act)

    def __call__(self, x: Array, h: Array | None = None) -> tuple[Array, Array]:
        _check_step(self, x, (h,))
        h = _zeros_state(self, x) if h is None else h
        xi, hh = _gates(self, x, h)
        h = self.act(xi + hh)
        return h, h

    def __repr__(self):
        return f"RNNCell({self.weight_ih.shape[1]} => {self.weight_hh.shape[1]}{_act_part(self.act)})"


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

    def __init__(self, in_features: int, hidden: int, *, init: Callable = glorot_uniform, rng: RNG = None) -> None:
        _cell_params(self, "LSTMCell", 4, in_features, hidden, init, rng)

    def __call__(self, x: Array, state: tuple[Array, Array] | None = None) -> tuple[Array, tuple[Array, Array]]:
        if state is not None and (not isinstance(state, tuple) or len(state) != 2):
            raise DimensionMismatch(f"{self!r} expects its state as a pair (h, c), got {type(state).__name__}")
        h, c = (None, None) if state is None else state
        _check_step(self, x, (h, c))
        h = _zeros_state(self, x) if h is None else h
        c = _zeros_state(self, x) if c is None else c
        xi, hh = _gates(self, x, h)
        z = xi + hh
        i, f, g, o = (_gate(z, k, self.weight_hh.shape[1]) for k in range(4))
        c = sigmoid(f) * c + sigmoid(i) * tanh(g)
        o = sigmoid(o)
        h = o * tanh(c)
        return h, (h, c)

    def __repr__(self):
        return f"LSTMCell({self.weight_ih.shape[1]} => {self.weight_hh.shape[1]})"


@layer(children=("weight_ih", "weight_hh", "bias"))
class GRUCell:
    """One GRU step (gates r, z, n as PyTorch; the bias on the input projection, Flux's form):
    ``n = tanh(x W_in^T + b_n + r (h W_hn^T))``, ``h' = (1 - z) n + z h``; ``cell(x, h=None) -> (h', h')``.

    >>> import numpy as np
    >>> c = GRUCell(3, 4, rng=0)
    >>> c, c(np.ones((2, 3), np.float32))[0].shape
    (GRUCell(3 => 4), (2, 4))
    """

    def __init__(self, in_features: int, hidden: int, *, init: Callable = glorot_uniform, rng: RNG = None) -> None:
        _cell_params(self, "GRUCell", 3, in_features, hidden, init, rng)

    def __call__(self, x: Array, h: Array | None = None) -> tuple[Array, Array]:
        _check_step(self, x, (h,))
        h = _zeros_state(self, x) if h is None else h
        xi, hh = _gates(self, x, h)
        n = self.weight_hh.shape[1]
        r = sigmoid(_gate(xi, 0, n) + _gate(hh, 0, n))
        z = sigmoid(_gate(xi, 1, n) + _gate(hh, 1, n))
        cand = tanh(_gate(xi, 2, n) + r * _gate(hh, 2, n))
        h = (1 - z) * cand + z * h
        return h, h

    def __repr__(self):
        return f"GRUCell({self.weight_ih.shape[1]} => {self.weight_hh.shape[1]})"


def _run(layer_, x, state, return_state):
    """The cell over the time axis of ``x`` ``(N, T, in)``: outputs ``(N, T, hidden)`` (and the final state)."""
    if not hasattr(x, "shape") or len(x.shape) != 3:
        _fail(layer_, "x of shape (N, T, in) (batch first)", x)
    if x.shape[1] < 1:
        _fail(layer_, "at least one time step", x)
    outs = []
    for t in range(x.shape[1]):
        h, state = layer_.cell(getitem(x, (slice(None), t)), state)
        outs.append(h)
    y = stack(outs, axis=1)
    return (y, state) if return_state else y


class _Recurrent:
    """What RNN, LSTM and GRU share: a cell run over time."""

    def __call__(self, x: Array, state: Any = None, *, return_state: bool = False) -> Any:
        try:
            return _run(self, x, state, return_state)
        except DimensionMismatch as err:
            raise DimensionMismatch(f"{type(self).__name__}: {err}") from None

    def __repr__(self):
        c = self.cell
        extra = _act_part(c.act) if isinstance(c, RNNCell) else ""
        return f"{type(self).__name__}({c.weight_ih.shape[1]} => {c.weight_hh.shape[1]}{extra})"


@layer(children=("cell",))
class RNN(_Recurrent):
    """An Elman RNN over ``(N, T, in)``: ``(N, T, hidden)``; ``rnn(x, h0=None, return_state=False)``.

    >>> import numpy as np
    >>> RNN(3, 4, rng=0)(np.ones((2, 5, 3), np.float32)).shape
    (2, 5, 4)
    """

    def __init__(self, in_features: int, hidden: int, act: Callable = tanh, *, init: Callable = glorot_uniform,
                 rng: RNG = None) -> None:
        self.cell = RNNCell(in_features, hidden, act, init=init, rng=rng)


@layer(children=("cell",))
class LSTM(_Recurrent):
    """An LSTM over ``(N, T, in)``: ``(N, T, hidden)``; ``lstm(x, (h0, c0)=None, return_state=False)``.

    >>> import numpy as np
    >>> LSTM(3, 4, rng=0)
    LSTM(3 => 4)
    """

    def __init__(self, in_features: int, hidden: int, *, init: Callable = glorot_uniform, rng: RNG = None) -> None:
        self.cell = LSTMCell(in_features, hidden, init=init, rng=rng)


@layer(children=("cell",))
class GRU(_Recurrent):
    """A GRU over ``(N, T, in)``: ``(N, T, hidden)``; ``gru(x, h0=None, return_state=False)``.

    >>> import numpy as np
    >>> GRU(3, 4, rng=0)(np.ones((2, 5, 3), np.float32), return_state=True)[1].shape
    (2, 4)
    """

    def __init__(self, in_features: int, hidden: int, *, init: Callable = glorot_uniform, rng: RNG = None) -> None:
        self.cell = GRUCell(in_features, hidden, init=init, rng=rng)
