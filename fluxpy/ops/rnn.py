"""Recurrent networks over a whole sequence as one op: :func:`rnn` (PyTorch's ``nn.RNN``/``nn.LSTM``/``nn.GRU``
forward, batch first, with ``num_layers`` and ``bidirectional``; Flux's ``cuDNN`` path for its recurrent layers).

``rnn(x, weights, h0, c0, mode=...)`` runs ``num_layers`` stacked layers of one cell kind (``mode``: ``"lstm"``,
``"gru"`` or ``"rnn"`` with ``act`` tanh or relu, or any activation on the composite) over ``x`` ``(N, T, in)``.
``weights`` holds one ``(w_ih, w_hh, bias)`` per layer and direction in PyTorch's order (layer 0, layer 0 reversed,
layer 1, ...): ``w_ih`` ``(G H, in_k)`` (``in_k`` is ``in`` for layer 0, ``D H`` above it), ``w_hh`` ``(G H, H)``,
``bias`` ``(G H,)`` or None, ``G`` = 4 (LSTM gates i, f, g, o), 3 (GRU r, z, n) or 1, the gate maths of
:func:`fluxpy.ops.lstm_gates` and :func:`fluxpy.ops.gru_gates` (one bias, on the input projection: a GRU's
candidate is ``tanh(W_in x + b_n + r (W_hn h))``, PyTorch's with ``b_hn = 0``). The reverse direction runs from
the last step to the first; each layer's input above the first is the concatenation of the directions' outputs.
Returns ``(y, h_n, c_n)``: ``y`` ``(N, T, D H)`` (directions concatenated on the feature axis, PyTorch's layout),
``h_n`` and ``c_n`` ``(L D, N, H)`` (``c_n`` None but for an LSTM); ``h0``, ``c0`` of that shape, or None
(zeros). The weights are in ``x``'s dtype, or float32 for a float16 or bfloat16 ``x`` (mixed precision's master
weights: cuDNN converts them only where it computes the problem in the half type; the composite casts them);
their gradients come back in their own dtype.

Where the kernel table has ``rnn_forward`` for the arrays (CuPy: cuDNN's ``cudnnRNNForward`` and its two backward
calls, :mod:`fluxpy.kernels.cuda_rnn`; NumPy in float32 and float64: :mod:`fluxpy.kernels.cpu_rnn`) the whole
network is one op forward and one backward, whose pullback gives the gradients of ``x``, the initial states and every
weight. Otherwise (a cell or dtype neither takes, or a nested ``gradient``, whose inner pullback must itself be
differentiable) the composite runs: per layer and
direction, the input projection of the whole sequence is one matrix product, then each step the recurrent product
and the gates' one op, which the tape differentiates op by op.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> w = [(rng.standard_normal((8, 3)), rng.standard_normal((8, 2)), None) for _ in range(2)]   # one layer, both ways
>>> y, h, c = rnn(np.ones((4, 5, 3)), w, mode="lstm", bidirectional=True)
>>> y.shape, h.shape, c.shape
((4, 5, 4), (2, 4, 2), (2, 4, 2))
>>> bool(np.allclose(y[:, -1, :2], h[0])), bool(np.allclose(y[:, 0, 2:], h[1]))   # forward ends last, reverse first
(True, True)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from ..autodiff import Primitive, Tracked, gradient, value_of
from ..backend import Array, get_array_module
from ..kernels import find, lookup
from ..kernels.halfs import is_half
from .activations import relu
from .basic import tanh
from .bias_act import bias_act
from .constants import device_constant
from .linalg import matmul
from .recurrent import gru_gates, lstm_gates
from .shape import astype, concatenate, getitem, reshape, stack, transpose

__all__ = ["rnn", "RNNDims", "weight_dtypes"]

_GATES = {"rnn": 1, "lstm": 4, "gru": 3}


@dataclasses.dataclass(frozen=True)
class RNNDims:
    """One recurrent network's problem, never on the tape: the cell ``mode`` (``"rnn_tanh"``, ``"rnn_relu"``,
    ``"lstm"``, ``"gru"``; ``"rnn"`` for another activation), ``batch``, ``steps``, ``input_size``, ``hidden``,
    ``num_layers``, ``bidirectional``, ``bias`` and the ``dtype``: what cuDNN's descriptors and plans are keyed by.

    >>> d = RNNDims("lstm", 2, 5, 3, 4, 2, True, True, np.dtype(np.float32))
    >>> d.gates, d.directions, d.state_shape, d.y_shape, d.weight_shapes(2)
    (4, 2, (4, 2, 4), (2, 5, 8), ((16, 8), (16, 4), (16,)))
    """
    mode: str
    batch: int
    steps: int
    input_size: int
    hidden: int
    num_layers: int
    bidirectional: bool
    bias: bool
    dtype: np.dtype

    @property
    def gates(self) -> int:
        return _GATES[self.mode.split("_")[0]]

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def state_shape(self) -> tuple:
        return (self.num_layers * self.directions, self.batch, self.hidden)

    @property
    def y_shape(self) -> tuple:
        return (self.batch, self.steps, self.directions * self.hidden)

    @property
    def segments(self) -> tuple:
        """``(y, h_n, c_n)``'s ``(start, stop)`` in the kernels' one flat output buffer (``c_n``'s None but for an
        LSTM), each start a multiple of 64 elements so that every part is aligned as cuDNN's arrays must be."""
        ny, ns = int(np.prod(self.y_shape)), int(np.prod(self.state_shape))
        up = (lambda n: -(-n // 64) * 64)
        h = up(ny)
        c = up(h + ns)
        return (0, ny), (h, h + ns), ((c, c + ns) if self.mode == "lstm" else None)

    def weight_shapes(self, pseudo_layer: int) -> tuple:
        """The shapes of ``(w_ih, w_hh, bias)`` of layer-and-direction ``pseudo_layer`` (PyTorch's order)."""
        rows = self.gates * self.hidden
        n_in = self.input_size if pseudo_layer < self.directions else self.directions * self.hidden
        return ((rows, n_in), (rows, self.hidden)) + (((rows,),) if self.bias else ())


def _mode(mode, act):
    """The problem's mode: ``"rnn"`` splits into cuDNN's tanh and relu cells where ``act`` is one of them."""
    if mode not in _GATES:
        raise ValueError(f"rnn: mode must be one of {sorted(_GATES)}, got {mode!r}")
    if mode != "rnn":
        return mode
    if act is None or act is tanh:
        return "rnn_tanh"
    return "rnn_relu" if act is relu else "rnn"


def weight_dtypes(dtype) -> tuple:
    """The dtypes :func:`rnn` takes weights in for data of ``dtype``: its own, and float32 for the halves.

    >>> weight_dtypes(np.dtype(np.float16))
    (dtype('float16'), dtype('float32'))
    """
    return (dtype, np.dtype(np.float32)) if is_half(dtype) else (dtype,)


def _check(dims, x, weights, h0, c0):
    """Every shape and dtype against ``dims``, naming the op, expected against got, before any work."""
    want = dims.num_layers * dims.directions
    if len(weights) != want:
        raise ValueError(f"rnn expects {want} (w_ih, w_hh, bias) triples (num_layers {dims.num_layers} x "
                         f"{dims.directions} directions), got {len(weights)}")
    for k, triple in enumerate(weights):
        if len(triple) != 3 or (triple[2] is None) == dims.bias:
            raise ValueError(f"rnn expects weights[{k}] as (w_ih, w_hh, bias), bias None for all or for none, "
                             f"got {len(triple)} items")
        for name, a, shape in zip(("w_ih", "w_hh", "bias"), triple, dims.weight_shapes(k)):
            if tuple(a.shape) != shape or np.dtype(a.dtype) not in weight_dtypes(dims.dtype):
                raise ValueError(f"rnn expects weights[{k}].{name} of shape {shape} and dtype "
                                 f"{' or '.join(str(d) for d in weight_dtypes(dims.dtype))} (x {tuple(x.shape)} "
                                 f"{dims.dtype}, mode {dims.mode}), got {tuple(a.shape)} {np.dtype(a.dtype)}")
    for name, s in (("h0", h0), ("c0", c0)):
        if s is not None and (tuple(s.shape) != dims.state_shape or np.dtype(s.dtype) != dims.dtype):
            raise ValueError(f"rnn expects {name} of shape (num_layers * directions, N, hidden) = "
                             f"{dims.state_shape} and dtype {dims.dtype}, got {tuple(s.shape)} {np.dtype(s.dtype)}")
    if c0 is not None and dims.mode != "lstm":
        raise ValueError(f"rnn: c0 is an LSTM's cell state; mode {dims.mode!r} has none")


def rnn(x: Array, weights: Sequence[tuple], h0: Array | None = None, c0: Array | None = None, *, mode: str,
        act: Callable | None = None, num_layers: int = 1,
        bidirectional: bool = False) -> tuple[Array, Array, Array | None]:
    """``(y, h_n, c_n)`` of a stacked, optionally bidirectional RNN, LSTM or GRU over ``x`` ``(N, T, in)``: see the
    module for the layout of ``weights``, the states and the outputs. ``act`` (mode ``"rnn"`` only): the
    activation, tanh by default.

    >>> import numpy as np
    >>> w = [(np.full((3, 2), 0.1), np.zeros((3, 3)), np.zeros(3))]
    >>> y, h, c = rnn(np.ones((1, 4, 2)), w, mode="rnn")
    >>> y.shape, bool(np.allclose(y[0, -1], np.tanh(0.2))), c is None
    ((1, 4, 3), True, True)
    """
    if not (hasattr(x, "shape") and len(x.shape) == 3 and x.shape[1] >= 1):
        raise ValueError(f"rnn expects x of shape (N, T, in) with T >= 1, got {getattr(x, 'shape', type(x))}")
    if not weights or not weights[0] or not hasattr(weights[0][1], "shape"):
        raise ValueError("rnn expects weights as a sequence of (w_ih, w_hh, bias) triples, one per layer and "
                         "direction")
    n, steps, n_in = x.shape
    hidden = weights[0][1].shape[1]
    dims = RNNDims(_mode(mode, act), n, steps, n_in, hidden, num_layers, bool(bidirectional),
                   weights[0][2] is not None, np.dtype(x.dtype))
    _check(dims, x, weights, h0, c0)
    flat = [a for triple in weights for a in (triple if dims.bias else triple[:2])]
    kernel = _kernel(dims, x, h0, c0, flat)
    if kernel is None:
        return _composite(dims, act, x, weights, h0, c0)
    lengths = device_constant(("rnn sequence lengths", n, steps), lambda: np.full(n, steps, np.int32), x, np.int32)
    out = _rnn(x, h0, c0, *flat, dims=dims, lengths=lengths)
    return _split(dims, out)


def _kernel(dims, x, h0, c0, flat):
    """The ``rnn_forward`` kernel for this call, or None: none registered, one that declines the problem, or a
    nested ``gradient`` (values tracked by two tapes: cuDNN's backward is no differentiable op)."""
    args = [a for a in (x, h0, c0, *flat) if a is not None]
    tracked = [a for a in args if type(a) is Tracked]
    if len({a.level for a in tracked}) > 1 or any(type(a.value) is Tracked for a in tracked):
        return None
    return find("rnn_forward", dims, *(value_of(a) for a in args))


def _split(dims, out):
    """The kernels' one output buffer as ``(y, h_n, c_n)`` (:attr:`RNNDims.segments`)."""
    y, h, c = dims.segments
    return (reshape(getitem(out, slice(*y)), dims.y_shape), reshape(getitem(out, slice(*h)), dims.state_shape),
            None if c is None else reshape(getitem(out, slice(*c)), dims.state_shape))


def _rnn_rule(needs, x, h0, c0, *flat, dims, lengths):
    out, saved = lookup("rnn_forward", x)(dims, lengths, x, h0, c0, flat, True)

    def rnn_pullback(dout):
        if type(dout) is Tracked:   # the pullback itself is differentiated: the composite's, which can be
            return _composite_pullback(dims, (x, h0, c0, *flat), needs, dout)
        return lookup("rnn_backward", x)(dims, lengths, saved, x, h0, c0, flat, out, dout, needs)
    return out, rnn_pullback


def _composite_pullback(dims, args, needs, dout):
    """The cotangents of ``args`` (``x, h0, c0, *flat``) for the output buffer's cotangent ``dout``, through the
    composite: the gradient of ``<outputs, dout>``, itself differentiable in ``dout`` and the arguments."""
    dy, dh, dc = _split(dims, dout)
    present = [i for i, a in enumerate(args) if a is not None and needs[i]]
    act = relu if dims.mode == "rnn_relu" else None

    def inner(*values):
        full = list(args)
        for i, value in zip(present, values):
            full[i] = value
        x, h0, c0, *flat = full
        per = 3 if dims.bias else 2
        weights = [tuple(flat[k:k + per]) + (() if dims.bias else (None,)) for k in range(0, len(flat), per)]
        y, h, c = _composite(dims, act, x, weights, h0, c0)
        total = (y * dy).sum() + (h * dh).sum()
        return total if c is None else total + (c * dc).sum()
    grads = gradient(inner, *(args[i] for i in present)) if present else ()
    out = [None] * len(args)
    for i, g in zip(present, grads):
        out[i] = g
    return tuple(out)


_rnn = Primitive("rnn", _rnn_rule, needs_mask=True,
                 impl=lambda x, h0, c0, *flat, dims, lengths:
                 lookup("rnn_forward", x)(dims, lengths, x, h0, c0, flat, False)[0])


# ---------------------------------------------------------------------------------------------
# The composite: cell by cell, through fluxpy's ops


def _direction(dims, act, x, w_ih, w_hh, bias, h, c, reverse):
    """One layer in one direction over ``x`` ``(N, T, in_k)``: its outputs ``(N, T, H)`` in time order and its
    final ``(h, c)``. The projection of the whole sequence is one product, ``W_hh^T`` made once."""
    xi = matmul(x, transpose(w_ih))
    xi = xi if bias is None else xi + bias
    w_t = transpose(w_hh)
    outs = [None] * dims.steps
    for t in (reversed(range(dims.steps)) if reverse else range(dims.steps)):
        g, rec = getitem(xi, (slice(None), t)), matmul(h, w_t)
        if dims.mode == "lstm":
            h, c = lstm_gates(g, c, rec)
        elif dims.mode == "gru":
            h = gru_gates(g, rec, h)
        else:
            h = bias_act(g, rec, relu if dims.mode == "rnn_relu" else (act or tanh))
        outs[t] = h
    return stack(outs, axis=1), h, c


def _composite(dims, act, x, weights, h0, c0):
    weights = [tuple(a if a is None or a.dtype == dims.dtype else astype(a, dims.dtype) for a in triple)
               for triple in weights]   # float32 master weights of a half x: cast, differentiably
    xp = get_array_module(value_of(x))
    zero = xp.zeros((dims.batch, dims.hidden), dtype=dims.dtype)
    hs, cs, k = [], [], 0
    for _ in range(dims.num_layers):
        ys = []
        for d in range(dims.directions):
            h = zero if h0 is None else getitem(h0, k)
            c = zero if c0 is None else getitem(c0, k)
            y, h, c = _direction(dims, act, x, *weights[k], h, c, reverse=d == 1)
            ys.append(y)
            hs.append(h)
            cs.append(c)
            k += 1
        x = ys[0] if len(ys) == 1 else concatenate(ys, axis=-1)
    return x, stack(hs), (stack(cs) if dims.mode == "lstm" else None)

