"""cuDNN 9's RNN API (``cudnn_adv``): a whole stacked, optionally bidirectional RNN, LSTM or GRU over a batch of
sequences in one ``cudnnRNNForward`` call, its gradients in ``cudnnRNNBackwardData_v8`` and
``cudnnRNNBackwardWeights_v8``.

A :class:`RNNPlan` holds one problem's descriptors (the RNN descriptor, the data descriptors of ``x`` and ``y`` in
``CUDNN_RNN_DATA_LAYOUT_BATCH_MAJOR_UNPACKED``, the ``(L D, N, H)`` state descriptor), the sizes of its weight,
work and reserve spaces, and where each layer's ``W_ih``, ``W_hh`` and biases lie in cuDNN's flat weight space
(:meth:`RNNPlan.offsets`, found once with ``cudnnGetRNNWeightParams``). Plans are cached per problem (cell, sizes,
layers, direction, dtype, batch, steps, and the options that set the math type), so a repeated call is a dict
lookup and the launches. Biases are ``CUDNN_RNN_DOUBLE_BIAS`` (PyTorch's mode: each gate's input and recurrent
bias); fluxpy's one bias goes in the input bias, the recurrent ones stay zero, which for a GRU is Flux's cell
exactly (PyTorch's ``b_hn`` sits inside ``r * (...)``).

Math: float32 in float32 (``CUDNN_FMA_MATH``: no TF32 unless ``options.allow_tf32``), float64 in float64, float16
and bfloat16 stored in 16 bits and computed in float32 on tensor cores (``CUDNN_TENSOR_OP_MATH``). Work and reserve
space come from CuPy's pool (no ``cudaMalloc`` inside a capture); every call runs on the handle's current stream.
This module knows nothing of ops: :mod:`fluxpy.kernels.cuda_rnn` packs the weights and runs the calls.

>>> MODES["lstm"] == LSTM and MODES["gru"] == GRU and MODES["rnn_tanh"] == RNN_TANH
True
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from ...backend import cupy
from . import descriptors
from .errors import CudnnError, check
from .handle import get_handle, options_key
from .legacy import math_type
from .library import fn, has, load

__all__ = ["RNNPlan", "plan", "clear_cache", "forward", "backward_data", "backward_weights", "available", "MODES",
           "CALLS"]

# cudnn_adv.h of cuDNN 9
ALGO_STANDARD, ALGO_PERSIST_STATIC_SMALL_H = 0, 3   # cudnnRNNAlgo_t
FWD_INFERENCE, FWD_TRAINING = 0, 1                  # cudnnForwardMode_t
RNN_RELU, RNN_TANH, LSTM, GRU = 0, 1, 2, 3          # cudnnRNNMode_t
NO_BIAS, SINGLE_INP_BIAS, DOUBLE_BIAS = 0, 1, 2     # cudnnRNNBiasMode_t
UNIDIRECTIONAL, BIDIRECTIONAL = 0, 1                # cudnnDirectionMode_t
LINEAR_INPUT = 0                                    # cudnnRNNInputMode_t
LAYOUT_BATCH_MAJOR_UNPACKED = 2                     # cudnnRNNDataLayout_t
PADDED_IO_ENABLED = 1                               # auxFlags of cudnnSetRNNDescriptor_v8
WGRAD_MODE_ADD = 0                                  # cudnnWgradMode_t

MODES = {"rnn_relu": RNN_RELU, "rnn_tanh": RNN_TANH, "lstm": LSTM, "gru": GRU}
"""fluxpy's cell modes (:class:`fluxpy.ops.rnn.RNNDims`) that cuDNN runs, as ``cudnnRNNMode_t``."""

CALLS = ("cudnnCreateDropoutDescriptor", "cudnnSetDropoutDescriptor", "cudnnCreateRNNDescriptor",
         "cudnnSetRNNDescriptor_v8", "cudnnCreateRNNDataDescriptor", "cudnnSetRNNDataDescriptor",
         "cudnnGetRNNWeightSpaceSize", "cudnnGetRNNTempSpaceSizes", "cudnnGetRNNWeightParams",
         "cudnnGetTensorNdDescriptor", "cudnnRNNForward", "cudnnRNNBackwardData_v8", "cudnnRNNBackwardWeights_v8")
"""The library's functions this module calls (bound from :data:`~fluxpy.kernels.cudnn.library.OPTIONAL_SIGNATURES`:
they live in ``libcudnn_adv``)."""

_P = ctypes.c_void_p
_NULL = None
_available: list = []   # the answer, once asked (the library does not change in a process)


def available() -> bool:
    """Whether cuDNN loads and has the RNN calls (:data:`CALLS`).

    >>> available() in (True, False)
    True
    """
    if not _available:
        _available.append(cupy is not None and load() is not None and all(has(c) for c in CALLS))
    return _available[0]


def algorithm(dims) -> int:
    """The ``cudnnRNNAlgo_t`` a problem runs: cuDNN's persistent kernels for small hidden sizes (the recurrent
    weights held in registers, one launch a layer and direction for the whole sequence, where the standard
    algorithm launches a product and a gates' kernel per step), PyTorch's choice; the standard algorithm for
    float64 and larger states. Both directions of the gradient must qualify (PyTorch's bounds for the backward:
    hidden <= 128 for LSTM and GRU, <= 256 for the plain cells), since the forward's reserve space feeds them.

    >>> from fluxpy.ops.rnn import RNNDims
    >>> lstm = lambda hidden, dtype: RNNDims("lstm", 64, 100, 32, hidden, 1, False, True, np.dtype(dtype))
    >>> algorithm(lstm(128, np.float16)) == ALGO_PERSIST_STATIC_SMALL_H, algorithm(lstm(256, np.float32))
    (True, 0)
    """
    small = 256 if dims.mode.startswith("rnn") else 128
    if np.dtype(dims.dtype) == np.float64 or dims.hidden > small:
        return ALGO_STANDARD
    return ALGO_PERSIST_STATIC_SMALL_H


class RNNPlan:
    """One problem's descriptors and sizes (see the module); ``dims`` the problem (a
    :class:`fluxpy.ops.rnn.RNNDims`), ``algo`` its ``cudnnRNNAlgo_t``. Descriptors live as long as the plan (plans
    are kept for the process)."""

    def __init__(self, dims, algo=ALGO_STANDARD):
        self.dims = d = dims
        self.algo = algo
        self.dtype = np.dtype(d.dtype)
        self.what = (f"{d.mode} in {d.input_size} hidden {d.hidden} layers {d.num_layers} "
                     f"{'bidirectional' if d.bidirectional else 'unidirectional'}{'' if d.bias else ' no bias'}, "
                     f"x ({d.batch}, {d.steps}, {d.input_size}) {self.dtype}, algorithm {algo}")
        dt = descriptors.data_type(self.dtype)
        prec = descriptors.compute_type(self.dtype)
        handle = get_handle()
        # no dropout between layers, said as PyTorch says it: a dropout descriptor of probability 0 and no states
        self.dropout = _new("Dropout")
        check(fn.cudnnSetDropoutDescriptor(self.dropout, handle, 0.0, _NULL, 0, 0), "cudnnSetDropoutDescriptor",
              self.what)
        self.rnn = _new("RNN")
        check(fn.cudnnSetRNNDescriptor_v8(
            self.rnn, algo, MODES[d.mode], DOUBLE_BIAS if d.bias else NO_BIAS,
            BIDIRECTIONAL if d.bidirectional else UNIDIRECTIONAL, LINEAR_INPUT, dt, prec, math_type(self.dtype),
            d.input_size, d.hidden, d.hidden, d.num_layers, self.dropout, PADDED_IO_ENABLED),
            "cudnnSetRNNDescriptor_v8", self.what)
        lengths = (ctypes.c_int * d.batch)(*([d.steps] * d.batch))
        self.x = _data_descriptor(dt, d.steps, d.batch, d.input_size, lengths, self.what)
        self.y = _data_descriptor(dt, d.steps, d.batch, d.directions * d.hidden, lengths, self.what)
        self.h = descriptors.tensor_descriptor(d.state_shape, self.dtype)
        size = ctypes.c_size_t()
        check(fn.cudnnGetRNNWeightSpaceSize(handle, self.rnn, ctypes.byref(size)), "cudnnGetRNNWeightSpaceSize",
              self.what)
        self.weight_bytes = size.value
        self.work, self.reserve = {}, {}
        for mode in (FWD_INFERENCE, FWD_TRAINING):
            work, reserve = ctypes.c_size_t(), ctypes.c_size_t()
            check(fn.cudnnGetRNNTempSpaceSizes(handle, self.rnn, mode, self.x, ctypes.byref(work),
                                               ctypes.byref(reserve)), "cudnnGetRNNTempSpaceSizes", self.what)
            self.work[mode], self.reserve[mode] = work.value, reserve.value
        self.offsets = self._offsets(handle)

    @property
    def weight_elements(self) -> int:
        return self.weight_bytes // self.dtype.itemsize

    def _offsets(self, handle):
        """Per layer and direction (PyTorch's order, cuDNN's pseudo-layers), the element offsets in the weight space
        of ``(W_ih, W_hh, b_ih, b_hh)`` (the biases None without them). Each is the start of one block that holds
        the gates' matrices (or biases) one after the other in the gate order (LSTM i, f, g, o; GRU r, z, n),
        each row-major as PyTorch's ``weight_ih`` rows: checked here gate by gate, so that a layout other than
        this one raises rather than mixing weights up."""
        d = self.dims
        space = cupy.cuda.alloc(max(self.weight_bytes, 1))
        base = space.ptr
        desc = descriptors.tensor_descriptor((1, 1, 1), self.dtype)   # cuDNN sets its dims and strides
        out = []
        try:
            for layer in range(d.num_layers * d.directions):
                w_shape = d.weight_shapes(layer)[0]
                parts = [self._block(handle, base, desc, layer, 0, w_shape[1] * d.hidden, True),
                         self._block(handle, base, desc, layer, d.gates, d.hidden * d.hidden, True)]
                if d.bias:
                    parts += [self._block(handle, base, desc, layer, 0, d.hidden, False),
                              self._block(handle, base, desc, layer, d.gates, d.hidden, False)]
                else:
                    parts += [None, None]
                out.append(tuple(parts))
        finally:
            descriptors.destroy("Tensor", desc)
        return out

    def _block(self, handle, base, desc, layer, first, per_gate, matrix):
        """The offset of the gates ``first .. first + G - 1``'s block, checking that gate ``k`` holds ``per_gate``
        elements right after gate ``k - 1``."""
        start = None
        for k in range(self.dims.gates):
            addr = _P()
            mdesc, maddr = (desc, ctypes.byref(addr)) if matrix else (_NULL, _NULL)
            bdesc, baddr = (_NULL, _NULL) if matrix else (desc, ctypes.byref(addr))
            check(fn.cudnnGetRNNWeightParams(handle, self.rnn, layer, self.weight_bytes, base, first + k, mdesc,
                                             maddr, bdesc, baddr), "cudnnGetRNNWeightParams",
                  f"{self.what}, pseudo-layer {layer}, linLayerID {first + k}")
            if not addr.value:
                raise RuntimeError(f"cudnnGetRNNWeightParams gave no {'matrix' if matrix else 'bias'} for pseudo-layer "
                                   f"{layer}, linLayerID {first + k} of {self.what}")
            offset, rest = divmod(addr.value - base, self.dtype.itemsize)
            count = _elements(desc)
            if rest or count != per_gate or (start is not None and offset != start + k * per_gate):
                raise RuntimeError(f"cuDNN's weight layout is not the one fluxpy packs for {self.what}: pseudo-layer "
                                   f"{layer}, linLayerID {first + k} at element {offset} (+{rest} bytes) holding "
                                   f"{count} elements, expected {per_gate} elements at "
                                   f"{'any offset' if start is None else start + k * per_gate}")
            start = offset if start is None else start
        return start


def _new(kind):
    p = _P()
    check(getattr(fn, f"cudnnCreate{kind}Descriptor")(ctypes.byref(p)), f"cudnnCreate{kind}Descriptor")
    return p.value


def _data_descriptor(dt, steps, batch, width, lengths, what):
    d = _new("RNNData")
    check(fn.cudnnSetRNNDataDescriptor(d, dt, LAYOUT_BATCH_MAJOR_UNPACKED, steps, batch, width, lengths, _NULL),
          "cudnnSetRNNDataDescriptor", what)
    return d


def _elements(desc):
    """The element count of a tensor descriptor cuDNN filled in (up to 8 dimensions)."""
    dt, nb = ctypes.c_int(), ctypes.c_int()
    dims, strides = (ctypes.c_int * 8)(), (ctypes.c_int * 8)()
    check(fn.cudnnGetTensorNdDescriptor(desc, 8, ctypes.byref(dt), ctypes.byref(nb), dims, strides),
          "cudnnGetTensorNdDescriptor")
    return int(np.prod([dims[i] for i in range(nb.value)]))


_plans: dict = {}
_lock = threading.Lock()


def plan(dims) -> RNNPlan:
    """The cached :class:`RNNPlan` of ``dims`` on the current device (built on first use with :func:`algorithm`'s
    choice, the standard algorithm where cuDNN turns a persistent one down; the math type follows
    ``options.allow_tf32``, so it is part of the key).

    Raises :class:`~fluxpy.kernels.cudnn.errors.CudnnError` where cuDNN turns the problem down."""
    key = (dims, cupy.cuda.runtime.getDevice(), options_key()[0])
    found = _plans.get(key)
    if found is None:
        with _lock:
            found = _plans.get(key)
            if found is None:
                found = _plans[key] = _build(dims)
    return found


def _build(dims) -> RNNPlan:
    algo = algorithm(dims)
    if algo != ALGO_STANDARD:
        try:
            return RNNPlan(dims, algo)
        except CudnnError as err:
            if err.status // 1000 != 3:   # NOT_SUPPORTED's family: this problem is beyond the persistent kernels
                raise
    return RNNPlan(dims)


def clear_cache() -> None:
    """Forget the plans (their descriptors are left to the process's end: a plan may still be in use).

    >>> clear_cache()
    """
    _plans.clear()


def _ptr(a):
    return 0 if a is None else a.data.ptr


class _Space:
    """Device memory from CuPy's pool (``ptr`` 0 for none); held by whoever must keep it alive."""
    __slots__ = ("mem", "ptr", "size")

    def __init__(self, nbytes):
        self.mem = cupy.cuda.alloc(nbytes) if nbytes else None
        self.ptr, self.size = (self.mem.ptr if nbytes else 0), nbytes


def forward(p: RNNPlan, lengths, x, hx, cx, weights, y, hy, cy, training: bool):
    """``cudnnRNNForward``: ``y`` (and ``hy``, ``cy`` where given) from ``x``, the initial states ``hx``, ``cx``
    (None: zeros) and the packed ``weights``; contiguous CuPy arrays of the plan's dtype, ``lengths`` the int32
    device array of the sequence lengths. Returns the reserve space (None for inference), which the backward calls
    read."""
    mode = FWD_TRAINING if training else FWD_INFERENCE
    work = _Space(p.work[mode])
    reserve = _Space(p.reserve[mode]) if training else _Space(0)
    check(fn.cudnnRNNForward(get_handle(), p.rnn, mode, _ptr(lengths), p.x, _ptr(x), p.y, _ptr(y), p.h, _ptr(hx),
                             _ptr(hy), p.h, _ptr(cx), _ptr(cy), p.weight_bytes, _ptr(weights), work.size, work.ptr,
                             reserve.size, reserve.ptr), "cudnnRNNForward", p.what)
    return reserve if training else None


def backward_data(p: RNNPlan, lengths, y, dy, dx, hx, dhy, dhx, cx, dcy, dcx, weights, reserve) -> None:
    """``cudnnRNNBackwardData_v8``: ``dx`` (and ``dhx``, ``dcx`` where given) from ``y``, ``dy`` and the final
    states' cotangents ``dhy``, ``dcy`` (None: zeros). It must run before :func:`backward_weights`, which reads
    what it leaves in the reserve space."""
    work = _Space(p.work[FWD_TRAINING])
    check(fn.cudnnRNNBackwardData_v8(get_handle(), p.rnn, _ptr(lengths), p.y, _ptr(y), _ptr(dy), p.x, _ptr(dx), p.h,
                                     _ptr(hx), _ptr(dhy), _ptr(dhx), p.h, _ptr(cx), _ptr(dcy), _ptr(dcx),
                                     p.weight_bytes, _ptr(weights), work.size, work.ptr, reserve.size, reserve.ptr),
          "cudnnRNNBackwardData_v8", p.what)


def backward_weights(p: RNNPlan, lengths, x, hx, y, dweights, reserve) -> None:
    """``cudnnRNNBackwardWeights_v8`` adding the weights' gradient into ``dweights`` (zeroed by the caller)."""
    work = _Space(p.work[FWD_TRAINING])
    check(fn.cudnnRNNBackwardWeights_v8(get_handle(), p.rnn, WGRAD_MODE_ADD, _ptr(lengths), p.x, _ptr(x), p.h,
                                        _ptr(hx), p.y, _ptr(y), p.weight_bytes, _ptr(dweights), work.size, work.ptr,
                                        reserve.size, reserve.ptr), "cudnnRNNBackwardWeights_v8", p.what)
