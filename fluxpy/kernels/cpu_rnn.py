"""A whole recurrent network on the CPU: ``rnn_forward`` and ``rnn_backward`` for NumPy arrays (the kernels of
:func:`fluxpy.ops.rnn.rnn`; :mod:`fluxpy.kernels.cuda_rnn` is their cuDNN twin).

Per layer and direction the input projection of the whole sequence is one matrix product, then each step is the
recurrent product and the gates' kernel (:mod:`fluxpy.kernels.cpu_recurrent`), with no tape: what the backward needs
(the activated gates, the states) is kept per step in arrays of the whole sequence. The backward runs the steps in
reverse for the states' gradients (one product a step), then the weights' gradients as one product each over all
steps and the batch (``dW_hh = dG_h^T H_prev``, ``dW_ih = dG^T X``, the bias's a sum): where the tape would add a
gradient per step, this adds none. The cells are the composite's exactly (LSTM, Flux's GRU, RNN with tanh or relu;
one bias, on the input projection), in float32 and float64; the output is the one buffer of
:attr:`fluxpy.ops.rnn.RNNDims.segments`.

A float32 LSTM where oneDNN is installed runs oneDNN's LSTM primitive instead, as PyTorch's CPU LSTM does: one call a
layer forward with both directions in it and one backward (:func:`fluxpy.kernels.onednn.lstm_forward`), the steps,
gates and products inside the library; what the backward reads is the forward's arrays and oneDNN's workspace.

>>> sorted(KERNELS)
['rnn_backward', 'rnn_forward']
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import onednn
from .cpu_recurrent import gru_gates_backward, gru_gates_forward, lstm_gates_backward, lstm_gates_forward

__all__ = ["rnn_forward", "rnn_backward", "supports", "KERNELS"]

_MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def supports(dims, *arrays) -> bool:
    """The composite's cells in float32 or float64, every array a NumPy array of that dtype.

    >>> from fluxpy.ops.rnn import RNNDims
    >>> supports(RNNDims("lstm", 2, 3, 4, 5, 1, False, True, np.dtype(np.float32)), np.ones(1, np.float32))
    True
    """
    return dims.mode in _MODES and dims.dtype in _DTYPES and dims.batch >= 1 and \
        all(type(a) is np.ndarray and a.dtype == dims.dtype for a in arrays)


def _triples(dims, flat):
    """``(w_ih, w_hh, bias or None)`` per layer and direction, in PyTorch's order."""
    per = 3 if dims.bias else 2
    return [tuple(flat[k:k + per]) + ((None,) if not dims.bias else ()) for k in range(0, len(flat), per)]


def _order(dims, reverse):
    return range(dims.steps - 1, -1, -1) if reverse else range(dims.steps)


def _direction_forward(dims, x, w_ih, w_hh, bias, h, c, reverse, training):
    """One layer in one direction: its outputs ``(N, T, H)`` and final ``(h, c)``, and what the backward reads."""
    xi = np.matmul(x, w_ih.T)
    if bias is not None:
        xi += bias
    w_t = w_hh.T   # a view, as the composite's transpose: the same products, the same rounding
    n, steps, hidden = dims.batch, dims.steps, dims.hidden
    hs = np.empty((n, steps, hidden), dims.dtype)
    cs = np.empty((n, steps, hidden), dims.dtype) if dims.mode == "lstm" else None
    acts = np.empty((n, steps, 4 * hidden), dims.dtype) if training and dims.mode in ("lstm", "gru") else None
    for t in _order(dims, reverse):
        rec = h @ w_t
        if dims.mode == "lstm":
            y, act = lstm_gates_forward(xi[:, t], c, rec, training)
            h, c = y[0], y[1]
            cs[:, t] = c
        elif dims.mode == "gru":
            h, act = gru_gates_forward(xi[:, t], rec, h, training)
        else:
            rec += xi[:, t]
            h = np.tanh(rec, out=rec) if dims.mode == "rnn_tanh" else np.maximum(rec, 0, out=rec)
            act = None
        if acts is not None:
            acts[:, t] = act
        hs[:, t] = h
    return hs, h, c, (cs, acts)


def rnn_forward(dims, lengths, x, h0, c0, flat, training):
    """``(out, saved)``: the output buffer and, with ``training``, what :func:`rnn_backward` reads (``lengths``,
    every sequence's full length, is cuDNN's and unused here)."""
    segments = dims.segments
    out = np.zeros(segments[-1][1] if segments[-1] else segments[1][1], dtype=dims.dtype)
    hn = out[slice(*segments[1])].reshape(dims.state_shape)
    cn = out[slice(*segments[2])].reshape(dims.state_shape) if segments[2] else None
    if dims.mode == "lstm" and onednn.takes_lstm(x, *flat):
        return out, _onednn_forward(dims, x, h0, c0, flat, training, out, hn, cn)
    zero = np.zeros((dims.batch, dims.hidden), dims.dtype)
    triples, saved, inputs, k = _triples(dims, flat), [], x, 0
    for _ in range(dims.num_layers):
        ys = []
        for d in range(dims.directions):
            h = zero if h0 is None else h0[k]
            c = zero if c0 is None else c0[k]
            hs, h, c, kept = _direction_forward(dims, inputs, *triples[k], h, c, d == 1, training)
            ys.append(hs)
            hn[k] = h
            if cn is not None:
                cn[k] = c
            saved.append((inputs, hs) + kept)
            k += 1
        inputs = ys[0] if len(ys) == 1 else np.concatenate(ys, axis=-1)
    out[slice(*segments[0])] = inputs.reshape(-1)
    return out, (saved if training else None)


def _previous(seq, first, reverse):
    """The state before each step, ``(N, T, H)``: ``seq`` shifted one step against the direction, ``first`` where
    the direction starts."""
    prev = np.empty_like(seq)
    if reverse:
        prev[:, :-1], prev[:, -1] = seq[:, 1:], first
    else:
        prev[:, 1:], prev[:, 0] = seq[:, :-1], first
    return prev


def _direction_backward(dims, kept, w_ih, w_hh, h_first, c_first, dys, dh, dc, reverse):
    """The gradients of one layer in one direction: ``(dx, dh0, dc0, dw_ih, dw_hh, dbias)``."""
    x, hs, cs, acts = kept
    h_prev = _previous(hs, h_first, reverse)
    c_prev = _previous(cs, c_first, reverse) if dims.mode == "lstm" else None
    dgi = np.empty((dims.batch, dims.steps, dims.gates * dims.hidden), dims.dtype)
    dgh = np.empty_like(dgi) if dims.mode == "gru" else dgi   # the other cells' two parts share one gradient
    for t in reversed(_order(dims, reverse)):
        dh_t = dh + dys[:, t]
        if dims.mode == "lstm":
            dz, dc = lstm_gates_backward(np.stack([dh_t, dc]), acts[:, t], np.stack([hs[:, t], cs[:, t]]),
                                         c_prev[:, t])
            dgi[:, t] = dz
            dh = dz @ w_hh
        elif dims.mode == "gru":
            gi_t, gh_t, dh_keep = gru_gates_backward(dh_t, acts[:, t], h_prev[:, t])
            dgi[:, t], dgh[:, t] = gi_t, gh_t
            dh = gh_t @ w_hh + dh_keep
        else:
            h_t = hs[:, t]
            dz = dh_t * (1 - h_t * h_t) if dims.mode == "rnn_tanh" else dh_t * (h_t > 0)
            dgi[:, t] = dz
            dh = dz @ w_hh
    rows = dims.batch * dims.steps
    flat_gi = dgi.reshape(rows, -1)
    dw_hh = dgh.reshape(rows, -1).T @ h_prev.reshape(rows, -1)
    dw_ih = flat_gi.T @ x.reshape(rows, -1)
    dx = (flat_gi @ w_ih).reshape(x.shape)
    return dx, dh, dc, dw_ih, dw_hh, flat_gi.sum(axis=0)


def rnn_backward(dims, lengths, saved, x, h0, c0, flat, out, dout, needs):
    """The gradients of ``(x, h0, c0, *flat)`` (None where ``needs`` says none or the input is None) from the
    output buffer's cotangent ``dout``."""
    dout = np.asarray(dout)
    backward = _onednn_backward if type(saved[0]) is _OneDNNLayer else _numpy_backward
    dx, dh0, dc0, weights = backward(dims, saved, h0, c0, flat, dout)
    states = [dx if needs[0] else None, dh0 if needs[1] and h0 is not None else None,
              dc0 if needs[2] and c0 is not None else None]
    return tuple(states) + tuple(g if need else None for g, need in zip(weights, needs[3:]))


def _numpy_backward(dims, saved, h0, c0, flat, dout):
    """``(dx, dh0, dc0, [the weights' gradients])`` of :func:`rnn_forward`'s NumPy path, a layer and direction at a
    time."""
    segments = dims.segments
    dy = dout[slice(*segments[0])].reshape(dims.y_shape)
    dhn = dout[slice(*segments[1])].reshape(dims.state_shape)
    dcn = dout[slice(*segments[2])].reshape(dims.state_shape) if segments[2] else None
    zero = np.zeros((dims.batch, dims.hidden), dims.dtype)
    triples = _triples(dims, flat)
    dflat = [None] * len(triples)
    dh0 = np.empty(dims.state_shape, dims.dtype)
    dc0 = np.empty(dims.state_shape, dims.dtype) if dims.mode == "lstm" else None
    hidden = dims.hidden
    for layer in reversed(range(dims.num_layers)):
        dx = None
        for d in range(dims.directions):
            k = layer * dims.directions + d
            w_ih, w_hh, bias = triples[k]
            h_first = zero if h0 is None else h0[k]
            c_first = zero if c0 is None else c0[k]
            dc = dcn[k] if dcn is not None else None
            grads = _direction_backward(dims, saved[k], w_ih, w_hh, h_first, c_first,
                                        dy[..., d * hidden:(d + 1) * hidden], dhn[k], dc, d == 1)
            dx = grads[0] if dx is None else dx + grads[0]
            dh0[k] = grads[1]
            if dc0 is not None:
                dc0[k] = grads[2]
            dflat[k] = grads[3:5] + ((grads[5],) if bias is not None else ())
        dy = dx
    return dy, dh0, dc0, [g for triple in dflat for g in triple]


class _OneDNNLayer(NamedTuple):
    """What oneDNN's backward of one LSTM layer reads: the forward's arguments (the weights stacked over the
    directions), its outputs and its workspace."""
    x: np.ndarray
    h0: np.ndarray
    c0: np.ndarray
    w_ih: np.ndarray
    w_hh: np.ndarray
    bias: np.ndarray
    y: np.ndarray
    hn: np.ndarray
    cn: np.ndarray
    workspace: np.ndarray | None


def _stacked(dims, arrays):
    """A layer's weights of one kind, its directions' stacked (zeros for absent biases): oneDNN's one array."""
    if arrays[0] is None:
        return np.zeros((len(arrays), dims.gates * dims.hidden), dims.dtype)
    return np.stack(arrays)


def _onednn_forward(dims, x, h0, c0, flat, training, out, hn, cn):
    """An LSTM's layers through oneDNN (:func:`fluxpy.kernels.onednn.lstm_forward`), one call a layer with both
    directions in it, written into ``out`` (``hn``, ``cn`` its views); what the backward reads, one
    :class:`_OneDNNLayer` a layer, or None without ``training``."""
    d = dims.directions
    zeros = np.zeros(dims.state_shape, dims.dtype)
    h0 = zeros if h0 is None else np.ascontiguousarray(h0)
    c0 = zeros if c0 is None else np.ascontiguousarray(c0)
    triples = _triples(dims, flat)
    inputs, saved = np.ascontiguousarray(x), []
    for layer in range(dims.num_layers):
        ks = slice(layer * d, (layer + 1) * d)
        w_ih, w_hh, bias = (_stacked(dims, kind) for kind in zip(*triples[ks]))
        y = out[slice(*dims.segments[0])].reshape(dims.y_shape) if layer == dims.num_layers - 1 else \
            np.empty(dims.y_shape, dims.dtype)
        workspace = onednn.lstm_forward(inputs, h0[ks], c0[ks], w_ih, w_hh, bias, y, hn[ks], cn[ks], training)
        saved.append(_OneDNNLayer(inputs, h0[ks], c0[ks], w_ih, w_hh, bias, y, hn[ks], cn[ks], workspace))
        inputs = y
    return saved if training else None


def _onednn_backward(dims, saved, h0, c0, flat, dout):
    """:func:`_numpy_backward`'s result for :func:`_onednn_forward`: one oneDNN call a layer, the last first."""
    segments, d = dims.segments, dims.directions

    def part(k, shape):
        return np.ascontiguousarray(dout[slice(*segments[k])].reshape(shape), dtype=dims.dtype)
    dy, dhn, dcn = part(0, dims.y_shape), part(1, dims.state_shape), part(2, dims.state_shape)
    dh0, dc0 = np.empty(dims.state_shape, dims.dtype), np.empty(dims.state_shape, dims.dtype)
    dflat = [None] * dims.num_layers
    for layer in reversed(range(dims.num_layers)):
        ks = slice(layer * d, (layer + 1) * d)
        dy, dh0[ks], dc0[ks], dw_ih, dw_hh, db = onednn.lstm_backward(*saved[layer], dy, dhn[ks], dcn[ks])
        dflat[layer] = [g for k in range(d) for g in (dw_ih[k], dw_hh[k]) + ((db[k],) if dims.bias else ())]
    return dy, dh0, dc0, [g for layer in dflat for g in layer]


KERNELS = {"rnn_forward": (rnn_forward, supports), "rnn_backward": rnn_backward}
