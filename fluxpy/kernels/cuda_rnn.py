"""The glue from :func:`fluxpy.ops.rnn.rnn` to cuDNN's RNN calls (:mod:`fluxpy.kernels.cudnn.rnn`): ``rnn_forward``
and ``rnn_backward`` for CuPy arrays.

The forward packs the layer's parameters into cuDNN's flat weight space (one zeroing ``memset`` for the recurrent
biases cuDNN has and fluxpy's cells do not, then one device-to-device copy per array, at the offsets the plan
found), runs ``cudnnRNNForward`` into one output buffer (``y``, ``h_n``, ``c_n``: :attr:`RNNDims.segments`), and
keeps what the backward reads: the contiguous inputs, the packed weights and the reserve space. The backward runs
``cudnnRNNBackwardData_v8`` (always: it leaves in the reserve space what the weights' call reads), then, where a
weight needs a gradient, ``cudnnRNNBackwardWeights_v8`` adding into a zeroed space, whose parts are the
parameters' gradients (views, no copy). Copies and memsets are stream-ordered and allocations come from CuPy's
pool, so a step that runs these is capturable.

``supports`` takes the cells cuDNN has (LSTM, Flux's GRU, RNN with tanh or relu) in float32, float64, float16 and
bfloat16 where the library has the calls (a half problem's weights in its type or in float32, mixed precision's
master weights: converted in the packing only where the problem is computed in the half type); a problem whose
plan cuDNN turns down with a NOT_SUPPORTED status (bfloat16 on a library without it, say: also a BAD_PARAM there)
is remembered and runs the composite.

A float16 or bfloat16 problem is computed either in its own type or in float32 (its inputs and weights converted on
the way in, the outputs and gradients back on the way out), as timed on its first call outside a CUDA-graph capture
(:func:`computed_as`): a half-precision layer must not be slower than a float32 one, and cuDNN's half kernels are
not always faster (its bfloat16 RNNs have no persistent kernels; its float16 persistent kernels ran a small GRU
slower than the float32 ones). Until a problem is timed (a first call inside a capture), the rule stands in:
float32 for a bfloat16 problem whose float32 twin takes the persistent kernels.

>>> sorted(KERNELS)
['rnn_backward', 'rnn_forward']
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..backend import cupy
from . import compiler
from .cuda_halves import cast, supports_cast
from .cudnn import rnn as cudnn_rnn
from .cudnn.errors import CudnnError
from .halfs import BFLOAT16, HALVES

__all__ = ["rnn_forward", "rnn_backward", "supports", "KERNELS"]

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BFLOAT16)
_declined: set = set()   # problems whose plan cuDNN turned down as not supported
_PER_LAYER = {True: 3, False: 2}   # fluxpy's arrays per layer and direction: W_ih, W_hh (and its one bias)


_timed: dict = {}   # half problem -> the problem cuDNN runs for it (itself or its float32 twin), as timed


def computed_as(dims):
    """The problem cuDNN runs for ``dims``: a float32 or float64 one as it is; a half one as timed on its first call
    (:func:`_time_choice`), or before that by the rule: in float32 for a bfloat16 problem whose float32 twin takes
    the persistent kernels (:func:`~fluxpy.kernels.cudnn.rnn.algorithm`), else as it is.

    >>> from fluxpy.ops.rnn import RNNDims
    >>> small = RNNDims("lstm", 64, 100, 32, 128, 1, False, True, BFLOAT16)
    >>> computed_as(small).dtype, computed_as(dataclasses.replace(small, hidden=512)).dtype
    (dtype('float32'), dtype(bfloat16))
    """
    if dims.dtype not in HALVES:
        return dims
    chosen = _timed.get(dims)
    if chosen is not None:
        return chosen
    wide = _wide(dims)
    return wide if dims.dtype == BFLOAT16 and cudnn_rnn.algorithm(wide) != cudnn_rnn.ALGO_STANDARD else dims


def _wide(dims):
    return dataclasses.replace(dims, dtype=np.dtype(np.float32))


_HALF_MARGIN = 0.9   # the half type's time at most this fraction of float32's (see _time_choice)
_ROUNDS = 3   # _time_choice's rounds of each candidate


def _time_choice(dims, lengths, x, h0, c0, flat):
    """Time a half problem's forward and backward (GPU time, on the call's own inputs, the weights' gradients
    included) in its own type and in float32, and keep in :data:`_timed` the half type where it took at most
    :data:`_HALF_MARGIN` of float32's time, float32 otherwise (also where cuDNN turns the half plan down). The
    margin: float32 is the more accurate, and a near tie timed alone went either way from run to run (a small
    float16 GRU: 0.49 against 0.50 ms) while inside the network's captured step the half kernels ran 7% slower."""
    candidates = [_wide(dims)]
    try:
        cudnn_rnn.plan(dims)
        candidates.append(dims)
    except CudnnError as err:
        if not _turned_down(err, dims):
            raise
    if len(candidates) == 1:   # nothing to choose between
        _timed[dims] = candidates[0]
        return
    needs = [True] * (3 + len(flat))

    def step(run):
        out, saved = _forward(dims, run, lengths, x, h0, c0, flat, True)
        _backward(dims, lengths, saved, flat, out, out, needs)
    times = [float("inf")] * len(candidates)
    for _ in range(_ROUNDS):   # alternating rounds, the best of each: one round alone flipped the choice
        times = [min(t, compiler.time_ms(lambda run=run: step(run), hide_host=True))
                 for t, run in zip(times, candidates)]
    half_wins = times[1] <= _HALF_MARGIN * times[0]
    _timed[dims] = candidates[1] if half_wins else candidates[0]


def supports(dims, *arrays) -> bool:
    """Whether cuDNN runs this problem: its cell and dtype, CuPy arrays of that dtype, a plan cuDNN builds."""
    if dims.mode not in cudnn_rnn.MODES or dims.dtype not in _DTYPES or dims.batch < 1 or dims in _declined:
        return False
    wide = np.dtype(np.float32) if dims.dtype in HALVES else dims.dtype   # the op checked which array is which
    if not all(type(a) is cupy.ndarray and a.dtype in (dims.dtype, wide) for a in arrays) or not cudnn_rnn.available():
        return False
    try:
        cudnn_rnn.plan(computed_as(dims))
    except CudnnError as err:
        if not _turned_down(err, dims):
            raise
        _declined.add(dims)
        return False
    return True


def _turned_down(err, dims) -> bool:
    """Whether cuDNN's ``err`` planning ``dims`` says it does not take the problem: NOT_SUPPORTED and its family
    (for bfloat16 also BAD_PARAM, what a library without bfloat16 RNNs may say of the data type); anything else is
    a bug, to be raised."""
    return err.status // 1000 == 3 or (dims.dtype == BFLOAT16 and err.status // 1000 == 2)


def _as(a, dtype):
    """``a`` C-contiguous in ``dtype`` (None stays None): a half problem computed in float32 converts its input,
    output and their gradients each call, by fluxpy's vectorised cast where it takes the array (CuPy's goes an item
    at a time)."""
    if a is None:
        return None
    if a.dtype != dtype and supports_cast(a, dtype) and a._c_contiguous:
        return cast(a, dtype)
    return cupy.ascontiguousarray(a if a.dtype == dtype else a.astype(dtype))


def _part(buffer, start, stop, shape):
    return buffer[start:stop].reshape(shape)


def _pack(p, flat):
    """The parameters in cuDNN's weight space: a zeroed buffer, then each array copied to its offset."""
    mem = cupy.cuda.alloc(p.weight_bytes)
    stream = cupy.cuda.get_current_stream()
    mem.memset_async(0, p.weight_bytes, stream)
    size = p.dtype.itemsize
    arrays = iter(flat)
    for offsets in p.offsets:
        for offset in offsets[:_PER_LAYER[p.dims.bias]]:   # W_ih, W_hh and b_ih; b_hh stays zero
            a = _as(next(arrays), p.dtype)
            (mem + offset * size).copy_from_device_async(a.data, a.nbytes, stream)
    return cupy.ndarray((p.weight_elements,), p.dtype, mem)


def _unpack(p, dweights, needs):
    """The parameters' gradients as views of the weights' gradient space, in ``flat``'s order (None where
    ``needs`` says none)."""
    out, k = [], 0
    for layer, offsets in enumerate(p.offsets):
        shapes = p.dims.weight_shapes(layer)
        for offset, shape in zip(offsets[:_PER_LAYER[p.dims.bias]], shapes):
            n = int(np.prod(shape))
            out.append(dweights[offset:offset + n].reshape(shape) if needs[k] else None)
            k += 1
    return out


def rnn_forward(dims, lengths, x, h0, c0, flat, training):
    """``(out, saved)``: the output buffer (in ``dims.dtype``) and, with ``training``, what :func:`rnn_backward`
    reads. A half problem's first call outside a capture times how to compute it (:func:`_time_choice`)."""
    if dims.dtype in HALVES and dims not in _timed and not cupy.cuda.get_current_stream().is_capturing():
        _time_choice(dims, lengths, x, h0, c0, flat)
    return _forward(dims, computed_as(dims), lengths, x, h0, c0, flat, training)


def _forward(dims, run, lengths, x, h0, c0, flat, training):
    """:func:`rnn_forward` computing ``dims`` as the problem ``run``."""
    p = cudnn_rnn.plan(run)
    x, hx, cx = (_as(a, run.dtype) for a in (x, h0, c0))
    weights = _pack(p, flat)
    segments = run.segments
    out = cupy.empty(segments[-1][1] if segments[-1] else segments[1][1], dtype=run.dtype)
    y = _part(out, *segments[0], -1)
    hy = _part(out, *segments[1], -1)
    cy = None if segments[2] is None else _part(out, *segments[2], -1)
    reserve = cudnn_rnn.forward(p, lengths, x, hx, cx, weights, y, hy, cy, training)
    if run.dtype == dims.dtype:
        return out, ((run, x, hx, cx, weights, reserve, None) if training else None)
    return _as(out, dims.dtype), ((run, x, hx, cx, weights, reserve, out) if training else None)


def rnn_backward(dims, lengths, saved, x, h0, c0, flat, out, dout, needs):
    """The gradients of ``(x, h0, c0, *flat)`` (None where ``needs`` says none or the input is None) from the
    output buffer's cotangent ``dout``, each in its input's dtype (the states' and ``x``'s ``dims.dtype``, each
    weight's its own)."""
    return _backward(dims, lengths, saved, flat, out, dout, needs)


def _backward(dims, lengths, saved, flat, out, dout, needs):
    """:func:`rnn_backward` for the forward that computed ``dims`` as the problem ``saved[0]``."""
    run, x, hx, cx, weights, reserve, computed = saved
    p = cudnn_rnn.plan(run)
    out = out if computed is None else computed   # y as cuDNN computed it, for the bfloat16 computed in float32
    dout = _as(dout, run.dtype)
    segments = run.segments
    y, dy = _part(out, *segments[0], -1), _part(dout, *segments[0], -1)
    dhy = _part(dout, *segments[1], -1)
    dcy = None if segments[2] is None else _part(dout, *segments[2], -1)
    dx = cupy.empty(x.shape, dtype=run.dtype)
    dhx = None if hx is None else cupy.empty(hx.shape, dtype=run.dtype)
    dcx = None if cx is None else cupy.empty(cx.shape, dtype=run.dtype)
    cudnn_rnn.backward_data(p, lengths, y, dy, dx, hx, dhy, dhx, cx, dcy, dcx, weights, reserve)
    grads = [dx if needs[0] else None, dhx if needs[1] else None, dcx if needs[2] else None]
    if any(needs[3:]):
        mem = cupy.cuda.alloc(p.weight_bytes)
        mem.memset_async(0, p.weight_bytes, cupy.cuda.get_current_stream())
        dweights = cupy.ndarray((p.weight_elements,), p.dtype, mem)
        cudnn_rnn.backward_weights(p, lengths, x, hx, y, dweights, reserve)
        grads += _unpack(p, dweights, needs[3:])
    else:
        grads += [None] * len(flat)
    dtypes = [dims.dtype] * 3 + [a.dtype for a in flat]
    return tuple(g if g is None or g.dtype == d else _as(g, d) for g, d in zip(grads, dtypes))


KERNELS = {"rnn_forward": (rnn_forward, supports), "rnn_backward": rnn_backward}
