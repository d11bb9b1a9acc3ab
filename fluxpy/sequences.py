"""Sequences of different lengths: :func:`pad_sequence` and :func:`unpad_sequence` (PyTorch's), :func:`batchseq`
(MLUtils'), and :func:`sequence_mask` (lengths to a mask).

A batch of sequences of different lengths is one padded array, batch first ``(N, T, *)``, with their ``lengths``
``(N,)``: what PyTorch's ``pad_packed_sequence`` gives back. The recurrent layers take it as it is,
``LSTM(...)(x, lengths=lengths)``, with the semantics of PyTorch's packed sequences: for each sequence, the steps
past its length leave the state alone (the final state is the state at its last step) and give zero outputs.

There is no ``pack_sequence``, ``pack_padded_sequence`` or ``PackedSequence``. That format (time-major, sorted by
length, a batch that shrinks step by step) exists for cuDNN's RNN kernels, so that they skip the padding; fluxpy's
layers step in Python with one fused gate op per step, where skipping would change the shapes of every step (a new
kernel plan, a new CUDA graph per batch). They compute the padded steps and discard them with one elementwise
``where`` per step: masks are device arrays made once per call from ``lengths`` (no read of a device value, no
boolean indexing), so a step that takes ``lengths`` as a device array can be captured as a CUDA graph (host lengths
are copied to the device at each call, which a capture refuses).

>>> import numpy as np
>>> x = pad_sequence([np.ones((3, 2)), np.ones((1, 2))])
>>> x.shape, x[:, :, 0].tolist()
((2, 3, 2), [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
>>> sequence_mask(np.array([3, 1]), 3).tolist()
[[True, True, True], [True, False, False]]
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from .autodiff import is_tracked, value_of
from .backend import Array, get_array_module
from .functors import cpu
from .ops import getitem, pad, stack

__all__ = ["pad_sequence", "unpad_sequence", "batchseq", "sequence_mask"]


def _describe(x):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{type(value_of(x)).__name__} of shape {tuple(x.shape)} {x.dtype}"
    return type(x).__name__


def _sequences(who, sequences):
    """``sequences`` as a list of arrays ``(L_i, *)`` of one trailing shape and dtype (lists of numbers converted
    with ``numpy.asarray``); a clear error naming ``who`` otherwise."""
    if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__iter__"):
        raise TypeError(f"{who} expects a list of arrays of shape (L_i, *), got {type(sequences).__name__}")
    out = []
    for i, s in enumerate(sequences):
        if not (is_tracked(s) or hasattr(s, "shape")):
            try:
                s = np.asarray(s)
            except ValueError as err:
                raise ValueError(f"{who}: sequence {i} does not convert to an array: {err}") from None
            if s.dtype == np.dtype(object):
                raise ValueError(f"{who}: sequence {i} converts only to an array of Python objects")
        if len(s.shape) < 1:
            raise ValueError(f"{who} expects sequences with a time axis first, (L_i, *), got sequence {i} of shape "
                             f"{tuple(s.shape)}")
        out.append(s)
    if not out:
        raise ValueError(f"{who} expects at least one sequence, got none")
    first = out[0]
    for i, s in enumerate(out):
        if tuple(s.shape[1:]) != tuple(first.shape[1:]) or s.dtype != first.dtype:
            raise ValueError(f"{who} expects sequences (L_i, *) of one trailing shape and dtype, got sequence 0 "
                             f"{_describe(first)} and sequence {i} {_describe(s)}")
    return out


def pad_sequence(sequences: Sequence[Array], batch_first: bool = True, padding_value: float = 0.0,
                 padding_side: str = "right") -> Array:
    """The sequences ``(L_i, *)`` padded to the longest, ``L``, and stacked: ``(N, L, *)`` with ``batch_first``
    (the default, fluxpy's layout and the recurrent layers' input), ``(L, N, *)`` without (PyTorch's default).

    PyTorch's ``torch.nn.utils.rnn.pad_sequence``: ``padding_value`` fills the steps past each length, at the end
    (``padding_side="right"``) or at the start (``"left"``; the recurrent layers' ``lengths=`` expects right
    padding). Differentiable: each sequence's gradient is its part of the padded array's. Lists of numbers are
    converted with ``numpy.asarray`` (token ids: ``pad_sequence([[5, 2, 7], [3]])``). Keep the lengths,
    ``[len(s) for s in sequences]``, for :func:`sequence_mask` and ``lengths=``.

    >>> import numpy as np
    >>> pad_sequence([[5, 2, 7], [3]], padding_value=-1)
    array([[ 5,  2,  7],
           [ 3, -1, -1]])
    >>> pad_sequence([np.ones((2, 4)), np.ones((3, 4))], batch_first=False).shape
    (3, 2, 4)
    """
    if not isinstance(batch_first, bool):
        raise TypeError(f"pad_sequence expects batch_first to be True or False, got {batch_first!r}")
    if padding_side not in ("right", "left"):
        raise ValueError(f"pad_sequence expects padding_side \"right\" or \"left\", got {padding_side!r}")
    seqs = _sequences("pad_sequence", sequences)
    longest = max(int(s.shape[0]) for s in seqs)
    padded = []
    for s in seqs:
        short = longest - int(s.shape[0])
        widths = ((0, short) if padding_side == "right" else (short, 0),) + ((0, 0),) * (len(s.shape) - 1)
        padded.append(pad(s, widths, padding_value) if short else s)
    return stack(padded, axis=0 if batch_first else 1)


def unpad_sequence(padded: Array, lengths: Any, batch_first: bool = True) -> list:
    """The list of sequences ``padded[i, :lengths[i]]`` (``padded[:lengths[i], i]`` without ``batch_first``): the
    inverse of :func:`pad_sequence` (right padding), PyTorch's ``unpad_sequence``. Differentiable. The lengths are
    read on the host (a device array of lengths costs one copy).

    >>> import numpy as np
    >>> [s.tolist() for s in unpad_sequence(np.array([[1, 2, 3], [4, 0, 0]]), [3, 1])]
    [[1, 2, 3], [4]]
    """
    if not hasattr(padded, "shape") or len(padded.shape) < 2:
        raise ValueError(f"unpad_sequence expects a padded array (N, L, *) or (L, N, *), got {_describe(padded)}")
    n, steps = (padded.shape[0], padded.shape[1]) if batch_first else (padded.shape[1], padded.shape[0])
    host = np.asarray(cpu(value_of(lengths)) if hasattr(lengths, "shape") else lengths)
    if host.shape != (n,) or host.dtype.kind not in "iu" or (n and (host.min() < 0 or host.max() > steps)):
        raise ValueError(f"unpad_sequence expects lengths, {n} ints in [0, {steps}], got {_describe(host)}"
                         + (f" from {host.min()} to {host.max()}" if host.size and host.dtype.kind in "iu" else ""))
    return [getitem(padded, (i, slice(0, int(k))) if batch_first else (slice(0, int(k)), i))
            for i, k in enumerate(host)]


def batchseq(seqs: Sequence[Array], val: float = 0) -> list:
    """MLUtils' ``batchseq``: the sequences ``(L_i, *)`` as one sequence of ``L = max L_i`` batches, a list of
    arrays ``(N, *)``, the short ones padded with ``val``: ``list(pad_sequence(seqs, batch_first=False,
    padding_value=val))``, what a loop over time steps (or a cell) takes.

    >>> [b.tolist() for b in batchseq([[1, 2, 3], [4, 5]], 0)]
    [[1, 4], [2, 5], [3, 0]]
    """
    padded = pad_sequence(seqs, batch_first=False, padding_value=val)
    return [getitem(padded, t) for t in range(padded.shape[0])]


def sequence_mask(lengths: Any, maxlen: int | None = None) -> Array:
    """The mask ``(N, maxlen)``, ``mask[i, t] = t < lengths[i]``, of booleans on the lengths' device (TensorFlow's
    ``sequence_mask``): True on the steps of each sequence, False on its padding.

    Made by one comparison of ``arange(maxlen)`` with ``lengths``: no device value is read when ``maxlen`` is given
    (``maxlen=None`` takes the longest length, which reads it). Lengths are not checked against ``maxlen``.

    >>> import numpy as np
    >>> sequence_mask([2, 0, 3]).astype(int)
    array([[1, 1, 0],
           [0, 0, 0],
           [1, 1, 1]])
    """
    lengths = value_of(lengths)
    if not hasattr(lengths, "shape"):
        lengths = np.asarray(lengths, dtype=None if len(lengths) else np.int64)
    if len(lengths.shape) != 1 or lengths.dtype.kind not in "iu":
        raise ValueError(f"sequence_mask expects lengths, a 1-d array of ints, got {_describe(lengths)}")
    if maxlen is None:
        maxlen = int(lengths.max()) if lengths.size else 0
    if isinstance(maxlen, bool) or not isinstance(maxlen, numbers.Integral) or maxlen < 0:
        raise ValueError(f"sequence_mask expects maxlen, an int >= 0 or None, got {maxlen!r}")
    xp = get_array_module(lengths)
    return xp.arange(int(maxlen))[None, :] < lengths[:, None]
