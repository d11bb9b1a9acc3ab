"""oneDNN's convolutions on the CPU: float32 convolutions forward, backward data and backward weights (and the bias's
gradient) through oneDNN's C API, the library behind PyTorch's CPU convolutions.

Where the ``onednn-cpu-gomp`` wheel is installed (``pip install fluxpy[cpu]``; Linux x86-64: it puts
``libdnnl.so.3`` under ``<prefix>/lib``) the NumPy convolution kernels of :mod:`fluxpy.kernels.cpu` hand float32
calls to it; elsewhere they run their im2col products. No maintained Python binding of oneDNN exists on PyPI, so
this is a ctypes binding of the dozen C functions a convolution needs, as fluxpy binds cuDNN.

Each problem (the kernel's kind and :class:`~fluxpy.ops.dims.ConvDims`) is built once: oneDNN picks the memory
layouts it runs fastest (channel-blocked), and each plain NCHW array NumPy holds is reordered into them and back,
as PyTorch does for its NCHW tensors. Errors raise naming oneDNN's status and the call.

The same binding runs large float32 products (:func:`matmul`) and a float32 LSTM layer, forward and backward, as one
call each (:func:`lstm_forward`, :func:`lstm_backward`: the kernels of :mod:`fluxpy.kernels.cpu_rnn`), and the
elementwise passes of batch norm and relu (:func:`scale_shift`, :func:`batchnorm_dx`, :func:`relu`,
:func:`relu_backward`: binary primitives with post-ops, for :mod:`fluxpy.kernels.cpu_norm` and the relu op).

>>> import numpy as np
>>> from fluxpy.ops.dims import ConvDims
>>> x, w = np.ones((1, 1, 3, 3), np.float32), np.ones((1, 1, 2, 2), np.float32)
>>> cd = ConvDims.from_arrays(x, w, flipped=True)
>>> (conv_forward(x, w, cd) if library() else np.full((1, 1, 2, 2), 4.0, np.float32))[0, 0].tolist()
[[4.0, 4.0], [4.0, 4.0]]
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["library", "takes", "conv_forward", "conv_backward_data", "conv_backward_weights", "takes_matmul", "matmul",
           "MATMUL_MIN_FLOPS", "takes_lstm", "lstm_forward", "lstm_backward", "ELTWISE_MIN_SIZE", "takes_eltwise",
           "relu", "relu_backward", "scale_shift", "scale_shift_relu6", "relu6_backward", "batchnorm_dx"]

_STATUS = {1: "dnnl_out_of_memory", 2: "dnnl_invalid_arguments", 3: "dnnl_unimplemented",
           4: "dnnl_last_impl_reached", 5: "dnnl_runtime_error", 6: "dnnl_not_required"}
_CPU, _F32, _FORMAT_ANY, _FORWARD_TRAINING, _DIRECT = 1, 3, 1, 64, 1
_QUERY = {"src": 129, "diff_src": 130, "weights": 131, "diff_weights": 132, "dst": 133, "diff_dst": 134}
_ARG = {"src": 1, "dst": 17, "weights": 33, "bias": 41, "diff_src": 129, "diff_dst": 145, "diff_weights": 161,
        "diff_bias": 169}
_Dims = ctypes.c_int64 * 12
_PROBLEMS_KEPT = 512   # a network's problems, each way (MobileNet's 27 convolutions make 81): no rebuild a step


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


class _Library:
    """The loaded library, its CPU engine and stream, and the lock every execution takes (a problem's buffers are
    shared between calls)."""

    def __init__(self, path: str) -> None:
        self.dll = ctypes.CDLL(path)
        self.dll.dnnl_primitive_desc_query_md.restype = ctypes.c_void_p
        self.dll.dnnl_memory_desc_equal.restype = ctypes.c_int
        self.dll.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        self.path = path
        self.engine, self.stream = ctypes.c_void_p(), ctypes.c_void_p()
        self.call("dnnl_engine_create", ctypes.byref(self.engine), _CPU, ctypes.c_size_t(0))
        self.call("dnnl_stream_create", ctypes.byref(self.stream), self.engine, ctypes.c_uint(1))
        self.lock = threading.Lock()
        self.problems: OrderedDict = OrderedDict()

    def call(self, name: str, *args: Any) -> None:
        status = getattr(self.dll, name)(*args)
        if status != 0:
            raise RuntimeError(f"oneDNN: {name} failed with {_STATUS.get(status, status)} ({self.path})")

    def handle(self, name: str, *args: Any) -> ctypes.c_void_p:
        """The object a ``dnnl_*_create`` call makes."""
        out = ctypes.c_void_p()
        self.call(name, ctypes.byref(out), *args)
        return out


def _candidates() -> list[str]:
    found = ctypes.util.find_library("dnnl")
    return [os.path.join(sys.prefix, "lib", "libdnnl.so.3")] + ([found] if found else [])


@functools.cache
def library() -> _Library | None:
    """The loaded oneDNN, or None where it is not installed (the NumPy kernels then run).

    >>> library() is None or library().engine.value is not None
    True
    """
    if not sys.platform.startswith("linux"):
        return None
    for path in _candidates():
        if os.path.exists(path) or not os.path.isabs(path):
            try:
                return _Library(path)
            except (OSError, AttributeError, RuntimeError):
                continue
    return None


def takes(*arrays: np.ndarray) -> bool:
    """Whether oneDNN runs a convolution of these NumPy arrays: the library is there and every array is float32 and
    not empty (an empty batch is NumPy's: oneDNN may leave a gradient's buffer unwritten).

    >>> takes(np.ones(2, np.float64)), takes(np.ones(0, np.float32))
    (False, False)
    """
    return (all(type(a) is np.ndarray and a.dtype == np.float32 and a.size for a in arrays)
            and library() is not None)


def _plain_md(lib, shape):
    strides = np.cumprod((1,) + tuple(shape[::-1]), dtype=np.int64)[:-1][::-1]
    return lib.handle("dnnl_memory_desc_create_with_strides", len(shape), _Dims(*shape), _F32,
                      _Dims(*(int(s) for s in strides)))


def _any_md(lib, shape):
    return lib.handle("dnnl_memory_desc_create_with_tag", len(shape), _Dims(*shape), _F32, _FORMAT_ANY)


class _Operand:
    """One plain NumPy array of a primitive: its memory (the array's data, set per call) and, where the primitive
    runs another layout, a memory in that layout (``size`` bytes, a buffer given per call: :meth:`hold`) and the
    reorder between the two."""

    def __init__(self, lib, plain_md, chosen_md, into: bool) -> None:
        self.lib, self.into = lib, into
        self.plain = lib.handle("dnnl_memory_create", plain_md, lib.engine, ctypes.c_void_p(None))
        self.memory, self.reorder, self.size, self.buffer, self.filled = self.plain, None, 0, None, False
        if not lib.dll.dnnl_memory_desc_equal(plain_md, ctypes.c_void_p(chosen_md)):
            chosen = ctypes.c_void_p(chosen_md)
            self.memory = lib.handle("dnnl_memory_create", chosen, lib.engine, ctypes.c_void_p(None))
            self.size = lib.dll.dnnl_memory_desc_get_size(chosen)
            src, dst = (plain_md, chosen) if into else (chosen, plain_md)
            pd = lib.handle("dnnl_reorder_primitive_desc_create", src, lib.engine, dst, lib.engine, None)
            self.reorder = lib.handle("dnnl_primitive_create", pd)
            lib.call("dnnl_primitive_desc_destroy", pd)

    def bind(self, array: np.ndarray) -> None:
        self.lib.call("dnnl_memory_set_data_handle", self.plain, ctypes.c_void_p(array.ctypes.data))

    def hold(self, buffer: np.ndarray | None = None, filled: bool = False) -> None:
        """Keep this call's reordered copy in ``buffer`` (64-byte aligned, ``size`` bytes; None: a new one):
        the buffers live only as long as a call needs them, so that a cached problem holds no memory of the size
        of its arrays. ``filled``: ``buffer`` holds this call's array reordered already (the reorder is skipped)."""
        self.buffer = _aligned_bytes(self.size) if buffer is None else buffer
        self.lib.call("dnnl_memory_set_data_handle", self.memory, ctypes.c_void_p(self.buffer.ctypes.data))
        self.filled = filled

    def release(self) -> None:
        self.buffer, self.filled = None, False

    def run_reorder(self) -> None:
        if self.reorder is not None and not self.filled:
            ends = (self.plain, self.memory) if self.into else (self.memory, self.plain)
            _execute(self.lib, self.reorder, ((_ARG["src"], ends[0]), (_ARG["dst"], ends[1])))

    def destroy(self) -> None:
        for memory in {self.plain.value: self.plain, self.memory.value: self.memory}.values():
            self.lib.call("dnnl_memory_destroy", memory)
        if self.reorder is not None:
            self.lib.call("dnnl_primitive_destroy", self.reorder)


def _execute(lib, primitive, args):
    packed = (_Arg * len(args))(*(_Arg(k, m) for k, m in args))
    lib.call("dnnl_primitive_execute", primitive, lib.stream, len(args), packed)


def _run_reordered(lib, primitive, operands: dict, args: list) -> None:
    """Reorder the input operands into the layouts the primitive chose (into buffers of this call, unless one was
    given: :meth:`_Operand.hold`), run it on ``args``, reorder its outputs back into their plain arrays, and wait
    for the stream."""
    try:
        for operand in operands.values():
            if operand.reorder is not None and operand.buffer is None:
                operand.hold()
        for operand in operands.values():
            if operand.into:
                operand.run_reorder()
        _execute(lib, primitive, args)
        for operand in operands.values():
            if not operand.into:
                operand.run_reorder()
        lib.call("dnnl_stream_wait", lib.stream)
    finally:
        for operand in operands.values():
            operand.release()


def _geometry(cdims):
    """oneDNN's ``(strides, dilates, padding_l, padding_r)`` of ``cdims`` (its dilation counts the gaps: d - 1)."""
    spatial = len(cdims.stride)
    return (_Dims(*cdims.stride), _Dims(*(d - 1 for d in cdims.dilation)),
            _Dims(*(cdims.pad[2 * i] for i in range(spatial))), _Dims(*(cdims.pad[2 * i + 1] for i in range(spatial))))


def _weight_shape(cdims):
    """The weights as oneDNN sees them: ``(G, K/G, C/G, *kernel)`` with groups, else ``(K, C, *kernel)``."""
    k, *rest = cdims.w_shape
    g = cdims.groups
    return (g, k // g, *rest) if g > 1 else tuple(cdims.w_shape)


class _Problem:
    """One convolution's primitive of one kind (``"forward"``, ``"backward_data"``, ``"backward_weights"``) with its
    operands; the forward's descriptor is the hint the backward ones need."""

    def __init__(self, lib, kind: str, cdims, bias: bool) -> None:
        self.lib, self.kind, self.cdims, self.bias = lib, kind, cdims, bias
        shapes = {"src": tuple(cdims.x_shape), "weights": _weight_shape(cdims), "dst": tuple(cdims.y_shape)}
        plain = {role: _plain_md(lib, shape) for role, shape in shapes.items()}
        chosen = {role: _any_md(lib, shape) for role, shape in shapes.items()}
        bias_md = _plain_md(lib, (cdims.y_shape[1],)) if bias else None
        geometry = _geometry(cdims)
        hint = lib.handle("dnnl_convolution_forward_primitive_desc_create", lib.engine, _FORWARD_TRAINING, _DIRECT,
                          chosen["src"], chosen["weights"], bias_md, chosen["dst"], *geometry, None)
        if kind == "forward":
            pd, roles = hint, (("src", "src", True), ("weights", "weights", True), ("dst", "dst", False))
        elif kind == "backward_data":
            pd = lib.handle("dnnl_convolution_backward_data_primitive_desc_create", lib.engine, _DIRECT,
                            chosen["src"], chosen["weights"], chosen["dst"], *geometry, hint, None)
            roles = (("diff_dst", "dst", True), ("weights", "weights", True), ("diff_src", "src", False))
        else:
            pd = lib.handle("dnnl_convolution_backward_weights_primitive_desc_create", lib.engine, _DIRECT,
                            chosen["src"], chosen["weights"], bias_md, chosen["dst"], *geometry, hint, None)
            roles = (("src", "src", True), ("diff_dst", "dst", True), ("diff_weights", "weights", False))
        query = lib.dll.dnnl_primitive_desc_query_md
        self.operands = {role: _Operand(lib, plain[shape_of], query(pd, _QUERY[role], 0), into)
                         for role, shape_of, into in roles}
        self.src_as_forward = bool(lib.dll.dnnl_memory_desc_equal(ctypes.c_void_p(query(hint, _QUERY["src"], 0)),
                                                                  ctypes.c_void_p(query(pd, _QUERY["src"], 0))))
        self.bias_memory = lib.handle("dnnl_memory_create", bias_md, lib.engine, ctypes.c_void_p(None)) if bias \
            else None
        self.primitive = lib.handle("dnnl_primitive_create", pd)
        if pd.value != hint.value:
            lib.call("dnnl_primitive_desc_destroy", pd)
        lib.call("dnnl_primitive_desc_destroy", hint)
        for md in (*plain.values(), *chosen.values(), *([bias_md] if bias_md is not None else [])):
            lib.call("dnnl_memory_desc_destroy", md)

    def run(self, arrays: dict, bias: np.ndarray | None = None, x: np.ndarray | None = None) -> None:
        """Run on ``arrays`` (role -> plain C-contiguous float32 array): inputs reordered in, the primitive, the
        output reordered out. ``x``: the caller's input array (see :meth:`_hold_src`)."""
        for role, array in arrays.items():
            self.operands[role].bind(array)
        src = self.operands.get("src")
        if src is not None and src.reorder is not None:
            self._hold_src(src, x)
        args = [(_ARG[role], operand.memory) for role, operand in self.operands.items()]
        if self.bias_memory is not None:
            self.lib.call("dnnl_memory_set_data_handle", self.bias_memory, ctypes.c_void_p(bias.ctypes.data))
            args.append((_ARG["bias" if self.kind == "forward" else "diff_bias"], self.bias_memory))
        _run_reordered(self.lib, self.primitive, self.operands, args)

    def _hold_src(self, src, x) -> None:
        """The forward reorders the input ``x`` into a buffer of its own kept beside ``x`` (while ``x`` lives); the
        weights' gradient of the same input reads that copy instead of reordering ``x`` again, where the forward's
        layout is its own."""
        key = (self.cdims, self.bias)
        if self.kind == "forward" and x is not None:
            buffer = _aligned_bytes(src.size)
            src.hold(buffer)
            _BLOCKED_INPUTS.keep(x, key, buffer)
        elif x is not None and self.src_as_forward:
            buffer = _BLOCKED_INPUTS.get(x, key)
            if buffer is not None:
                src.hold(buffer, filled=True)

    def destroy(self) -> None:
        for operand in self.operands.values():
            operand.destroy()
        if self.bias_memory is not None:
            self.lib.call("dnnl_memory_destroy", self.bias_memory)
        self.lib.call("dnnl_primitive_destroy", self.primitive)


class _Beside:
    """Values kept beside live NumPy arrays: :meth:`get` finds a value only for the very array and key it was kept
    with, and it is dropped when that array is freed."""

    def __init__(self) -> None:
        self.entries: dict = {}

    def keep(self, array: np.ndarray, key, value) -> None:
        where = (id(array), key)
        entry = self.entries.get(where)
        fresh = entry is None or entry[0]() is not array
        self.entries[where] = (weakref.ref(array), value)
        if fresh:   # one finaliser an array and key, however often it is kept again
            weakref.finalize(array, self.entries.pop, where, None)

    def get(self, array: np.ndarray, key):
        entry = self.entries.get((id(array), key))
        return entry[1] if entry is not None and entry[0]() is array else None


_BLOCKED_INPUTS = _Beside()   # a convolution's input -> its copy in the forward's layout, by (ConvDims, bias)


def _cached(lib, key, make):
    """The problem ``key`` (built by ``make()`` the first time), the least recently used ones beyond
    ``_PROBLEMS_KEPT`` destroyed. Called under ``lib.lock``."""
    problem = lib.problems.get(key)
    if problem is None:
        problem = lib.problems[key] = make()
        while len(lib.problems) > _PROBLEMS_KEPT:
            lib.problems.popitem(last=False)[1].destroy()
    else:
        lib.problems.move_to_end(key)
    return problem


def _run(kind: str, cdims, arrays: dict, bias: np.ndarray | None = None, x: np.ndarray | None = None) -> None:
    lib = library()
    with lib.lock:
        _cached(lib, (kind, cdims, bias is not None), lambda: _Problem(lib, kind, cdims, bias is not None)).run(
            arrays, bias, x)


def _c(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def _strided_md(lib, a):
    """A plain memory descriptor of the 2-d ``a`` as it lies (its strides: a transposed view is read in place)."""
    return lib.handle("dnnl_memory_desc_create_with_strides", 2, _Dims(*a.shape), _F32,
                      _Dims(*(s // a.itemsize for s in a.strides)))


class _Matmul:
    """One product ``a @ b`` of 2-d float32 operands of given shapes and strides, ``c`` row-major: oneDNN reads the
    plain layouts as they are, so there are no reorders."""

    def __init__(self, lib, a, b, c) -> None:
        self.lib = lib
        mds = [_strided_md(lib, m) for m in (a, b, c)]
        pd = lib.handle("dnnl_matmul_primitive_desc_create", lib.engine, mds[0], mds[1], None, mds[2], None)
        self.memories = [lib.handle("dnnl_memory_create", md, lib.engine, ctypes.c_void_p(None)) for md in mds]
        self.primitive = lib.handle("dnnl_primitive_create", pd)
        lib.call("dnnl_primitive_desc_destroy", pd)
        for md in mds:
            lib.call("dnnl_memory_desc_destroy", md)

    def run(self, a, b, c) -> None:
        for memory, array in zip(self.memories, (a, b, c)):
            self.lib.call("dnnl_memory_set_data_handle", memory, ctypes.c_void_p(array.ctypes.data))
        _execute(self.lib, self.primitive, ((_ARG["src"], self.memories[0]), (_ARG["weights"], self.memories[1]),
                                            (_ARG["dst"], self.memories[2])))
        self.lib.call("dnnl_stream_wait", self.lib.stream)

    def destroy(self) -> None:
        for memory in self.memories:
            self.lib.call("dnnl_memory_destroy", memory)
        self.lib.call("dnnl_primitive_destroy", self.primitive)


MATMUL_MIN_FLOPS = 1 << 20   # below this a product is cheaper in NumPy's BLAS than a call into oneDNN


def takes_matmul(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether :func:`matmul` runs ``a @ b``: float32 2-d NumPy operands, each with a unit stride, large enough that
    the call's host cost does not show (:data:`MATMUL_MIN_FLOPS`), and oneDNN is there.

    >>> takes_matmul(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    False
    """
    return (type(a) is np.ndarray and type(b) is np.ndarray and a.ndim == b.ndim == 2 and a.dtype == b.dtype
            == np.float32 and a.shape[1] == b.shape[0] and 2 * a.shape[0] * a.shape[1] * b.shape[1] >= MATMUL_MIN_FLOPS
            and all(a_.itemsize in (abs(s) for s in a_.strides) and min(a_.strides) > 0 for a_ in (a, b))
            and library() is not None)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` through oneDNN (the float32 products of a network whose convolutions run there: one thread pool,
    not OpenBLAS's beside oneDNN's OpenMP threads, which spin against each other on few cores)."""
    c = np.empty((a.shape[0], b.shape[1]), np.float32)
    lib = library()
    with lib.lock:
        _cached(lib, ("matmul", a.shape, a.strides, b.shape, b.strides), lambda: _Matmul(lib, a, b, c)).run(a, b, c)
    return c


def conv_forward(x: np.ndarray, w: np.ndarray, cdims: Any, b: np.ndarray | None = None) -> np.ndarray:
    """The cross-correlation of float32 ``x`` with ``w`` (already flipped for a true convolution), plus ``b``
    where given: ``cdims.y_shape``."""
    y = np.empty(cdims.y_shape, np.float32)
    _run("forward", cdims, {"src": _c(x), "weights": _c(w), "dst": y}, None if b is None else _c(b), x)
    return y


def conv_backward_data(dy: np.ndarray, w: np.ndarray, cdims: Any) -> np.ndarray:
    """The gradient of :func:`conv_forward` with respect to ``x``: ``cdims.x_shape``."""
    dx = np.empty(cdims.x_shape, np.float32)
    _run("backward_data", cdims, {"diff_dst": _c(dy), "weights": _c(w), "diff_src": dx})
    return dx


def conv_backward_weights(x: np.ndarray, dy: np.ndarray, cdims: Any, need_bias: bool = False) -> tuple:
    """``(dw, db)``: the gradients of :func:`conv_forward` with respect to the (flipped, where it was) weights and,
    with ``need_bias``, the bias (None otherwise)."""
    dw = np.empty(cdims.w_shape, np.float32)
    db = np.empty(cdims.y_shape[1], np.float32) if need_bias else None
    _run("backward_weights", cdims, {"src": _c(x), "diff_dst": _c(dy), "diff_weights": dw}, db, x)
    return dw, db


# oneDNN's LSTM: a whole layer (one or both directions) forward in one call and backward in one, as PyTorch's CPU
# LSTM runs. Its arguments beside the convolutions': the states (``iter``), the sequences (``layer``), the workspace.
_LSTM_ARG = {"src_layer": 1, "src_iter": 2, "src_iter_c": 3, "dst_layer": 17, "dst_iter": 18, "dst_iter_c": 19,
             "weights_layer": 33, "weights_iter": 34, "bias": 41, "workspace": 64}
_LSTM_ARG.update({"diff_" + role: arg + 128 for role, arg in _LSTM_ARG.items() if role != "workspace"})
_FORWARD_INFERENCE, _BACKWARD, _EXEC_ARG_MD = 96, 128, 255
_LEFT_TO_RIGHT, _BIDIRECTIONAL_CONCAT = 1, 3
_DIFF_WEIGHTS_OVERWRITE = 1   # the backward writes the weight gradients (by default it adds to them)
_LSTM_FORWARD_IN = ("src_layer", "src_iter", "src_iter_c", "weights_layer", "weights_iter", "bias")
_LSTM_FORWARD_OUT = ("dst_layer", "dst_iter", "dst_iter_c")
_LSTM_BACKWARD_IN = _LSTM_FORWARD_IN + _LSTM_FORWARD_OUT + ("diff_dst_layer", "diff_dst_iter", "diff_dst_iter_c")
_LSTM_BACKWARD_OUT = ("diff_src_layer", "diff_src_iter", "diff_src_iter_c", "diff_weights_layer", "diff_weights_iter",
                      "diff_bias")


def _md(lib, shape, strides):
    return lib.handle("dnnl_memory_desc_create_with_strides", len(shape), _Dims(*shape), _F32, _Dims(*strides))


def _lstm_plain_mds(lib, n, steps, n_in, hidden, directions):
    """The plain descriptors of a layer's NumPy arrays, by role: sequences ``(N, T, C)`` (oneDNN's dims ``(T, N,
    C)``, batch-first strides), states ``(D, N, H)``, weights as PyTorch holds them stacked over the directions,
    ``(D, 4H, C)`` (oneDNN's ldgoi), bias ``(D, 4H)``."""
    d, h = directions, hidden

    def sequence(c):
        return _md(lib, (steps, n, c), (c, steps * c, 1))

    def weights(c):
        return _md(lib, (1, d, c, 4, h), (d * 4 * h * c, 4 * h * c, 1, h * c, c))
    mds = {"src_layer": sequence(n_in), "dst_layer": sequence(d * h), "weights_layer": weights(n_in),
           "weights_iter": weights(h), "bias": _md(lib, (1, d, 4, h), (d * 4 * h, 4 * h, h, 1))}
    for role in ("src_iter", "src_iter_c", "dst_iter", "dst_iter_c"):
        mds[role] = _md(lib, (1, d, n, h), (d * n * h, n * h, h, 1))
    return mds


class _LSTMStep:
    """One primitive of an LSTM layer (its forward or its backward) with an operand per role (inputs reordered into
    the layouts it chose, outputs out of them) and, where it has one, the workspace."""

    def __init__(self, lib, pd, plain: dict, inputs: tuple, outputs: tuple, workspace_md) -> None:
        self.lib = lib
        query = lib.dll.dnnl_primitive_desc_query_md
        self.operands = {role: _Operand(lib, plain[role.removeprefix("diff_")],
                                        query(pd, _EXEC_ARG_MD, _LSTM_ARG[role]), role in inputs)
                         for role in inputs + outputs}
        if workspace_md is not None:
            self.operands["workspace"] = _Operand(lib, ctypes.c_void_p(workspace_md), workspace_md, True)
        self.primitive = lib.handle("dnnl_primitive_create", pd)

    def run(self, arrays: dict) -> None:
        for role, array in arrays.items():
            self.operands[role].bind(array)
        _run_reordered(self.lib, self.primitive, self.operands,
                       [(_LSTM_ARG[role], op.memory) for role, op in self.operands.items()])

    def destroy(self) -> None:
        for operand in self.operands.values():
            operand.destroy()
        self.lib.call("dnnl_primitive_destroy", self.primitive)


class _LSTMProblem:
    """One LSTM layer's problem (batch, steps, input and hidden sizes, directions): the forward primitive (for
    training or inference) and, for training, the backward one, whose descriptor the forward's hints. The weights
    reach the forward reordered into the layout it picked (``format_any``); the backward reads PyTorch's as they are
    (or reorders them too, where it picks another layout) and its weight gradients are reordered out."""

    def __init__(self, lib, n, steps, n_in, hidden, directions, training) -> None:
        self.lib = lib
        plain = _lstm_plain_mds(lib, n, steps, n_in, hidden, directions)
        chosen = dict(plain, weights_layer=_any_md(lib, (1, directions, n_in, 4, hidden)),
                      weights_iter=_any_md(lib, (1, directions, hidden, 4, hidden)))
        direction = _BIDIRECTIONAL_CONCAT if directions == 2 else _LEFT_TO_RIGHT
        forward_mds = [chosen[r] for r in ("src_layer", "src_iter", "src_iter_c", "weights_layer", "weights_iter")] + \
            [None, None] + [chosen[r] for r in ("bias", "dst_layer", "dst_iter", "dst_iter_c")]   # no peepholes
        forward_pd = lib.handle("dnnl_lstm_forward_primitive_desc_create", lib.engine,
                                _FORWARD_TRAINING if training else _FORWARD_INFERENCE, direction, *forward_mds,
                                ctypes.c_uint(0), None)
        pds = [forward_pd]
        workspace_md = lib.dll.dnnl_primitive_desc_query_md(forward_pd, _EXEC_ARG_MD, _LSTM_ARG["workspace"]) \
            if training else None
        self.forward = _LSTMStep(lib, forward_pd, plain, _LSTM_FORWARD_IN, _LSTM_FORWARD_OUT, workspace_md)
        self.backward, self.workspace_bytes, self.spare = None, 0, []
        if training:
            self.workspace_bytes = lib.dll.dnnl_memory_desc_get_size(ctypes.c_void_p(workspace_md))
            pds.append(lib.handle("dnnl_lstm_backward_primitive_desc_create", lib.engine, _BACKWARD, direction,
                                  *forward_mds, *forward_mds, ctypes.c_uint(_DIFF_WEIGHTS_OVERWRITE), forward_pd, None))
            self.backward = _LSTMStep(lib, pds[1], plain, _LSTM_BACKWARD_IN, _LSTM_BACKWARD_OUT, workspace_md)
        for pd in reversed(pds):
            lib.call("dnnl_primitive_desc_destroy", pd)
        for md in {md.value: md for md in (*plain.values(), *chosen.values())}.values():
            lib.call("dnnl_memory_desc_destroy", md)

    def workspace(self) -> np.ndarray:
        """A workspace for one forward, kept by the caller until its backward: a 64-byte aligned buffer, reused once
        the array handed out is dropped (it is large, and a fresh one costs page faults on every step)."""
        buffer = self.spare.pop() if self.spare else _aligned_bytes(self.workspace_bytes)
        lease = buffer[:]
        weakref.finalize(lease, self.spare.append, buffer)
        return lease

    def destroy(self) -> None:
        for step in (self.forward, self.backward):
            if step is not None:
                step.destroy()


def _aligned_bytes(size: int) -> np.ndarray:
    raw = np.empty(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + size]


def takes_lstm(*arrays: np.ndarray) -> bool:
    """Whether :func:`lstm_forward` and :func:`lstm_backward` run a layer of these arrays: all float32 NumPy arrays,
    none empty, and oneDNN is there (the same test as :func:`takes`).

    >>> takes_lstm(np.ones((1, 4), np.float64))
    False
    """
    return takes(*arrays)


def _lstm_problem(lib, x, w_hh, training):
    (n, steps, n_in), (directions, hidden) = x.shape, w_hh.shape[0::2]
    return _cached(lib, ("lstm", n, steps, n_in, hidden, directions, training),
                   lambda: _LSTMProblem(lib, n, steps, n_in, hidden, directions, training))


def lstm_forward(x: np.ndarray, h0: np.ndarray, c0: np.ndarray, w_ih: np.ndarray, w_hh: np.ndarray,
                 bias: np.ndarray, y: np.ndarray, hn: np.ndarray, cn: np.ndarray,
                 training: bool) -> np.ndarray | None:
    """One LSTM layer (PyTorch's cell, gates ``i, f, g, o``) over ``x`` ``(N, T, C)`` from the states ``h0``,
    ``c0`` ``(D, N, H)``, written into ``y`` ``(N, T, D H)`` (the directions concatenated) and ``hn``, ``cn``
    ``(D, N, H)``; ``D`` = 2 runs the second direction from the last step to the first. The weights are PyTorch's
    stacked over the directions: ``w_ih`` ``(D, 4H, C)``, ``w_hh`` ``(D, 4H, H)``, ``bias`` ``(D, 4H)`` (one bias:
    PyTorch's two summed). Every array float32 and C-contiguous. Returns the workspace that :func:`lstm_backward`
    reads (None unless ``training``).

    >>> d, n, t, c, h = 1, 2, 3, 4, 5
    >>> w_ih, w_hh = np.zeros((d, 4 * h, c), np.float32), np.zeros((d, 4 * h, h), np.float32)
    >>> b, zeros = np.zeros((d, 4 * h), np.float32), np.zeros((d, n, h), np.float32)
    >>> y, hn, cn = np.empty((n, t, h), np.float32), np.empty_like(zeros), np.empty_like(zeros)
    >>> if library():
    ...     _ = lstm_forward(np.ones((n, t, c), np.float32), zeros, zeros + 1, w_ih, w_hh, b, y, hn, cn, False)
    ... else:   # every gate 0.5 and g = 0: each step halves c; h = 0.5 tanh(c)
    ...     cn[...] = 0.125; hn[...] = 0.5 * np.tanh(cn)
    >>> round(float(cn[0, 0, 0]), 4), round(float(hn[0, 0, 0]), 4)
    (0.125, 0.0622)
    """
    lib = library()
    with lib.lock:
        problem = _lstm_problem(lib, x, w_hh, training)
        workspace = problem.workspace() if training else None
        arrays = {"src_layer": x, "src_iter": h0, "src_iter_c": c0, "weights_layer": w_ih, "weights_iter": w_hh,
                  "bias": bias, "dst_layer": y, "dst_iter": hn, "dst_iter_c": cn}
        problem.forward.run(arrays if workspace is None else dict(arrays, workspace=workspace))
    return workspace


def lstm_backward(x: np.ndarray, h0: np.ndarray, c0: np.ndarray, w_ih: np.ndarray, w_hh: np.ndarray,
                  bias: np.ndarray, y: np.ndarray, hn: np.ndarray, cn: np.ndarray, workspace: np.ndarray,
                  dy: np.ndarray, dhn: np.ndarray, dcn: np.ndarray) -> tuple:
    """The gradients ``(dx, dh0, dc0, dw_ih, dw_hh, dbias)`` of :func:`lstm_forward` (trained) from the cotangents
    ``dy``, ``dhn``, ``dcn`` of its outputs; the arguments before them are the forward's, its outputs and its
    workspace, unchanged."""
    grads = (np.empty_like(x), np.empty_like(h0), np.empty_like(c0), np.empty_like(w_ih), np.empty_like(w_hh),
             np.empty_like(bias))
    lib = library()
    with lib.lock:
        problem = _lstm_problem(lib, x, w_hh, True)
        arrays = {"src_layer": x, "src_iter": h0, "src_iter_c": c0, "weights_layer": w_ih, "weights_iter": w_hh,
                  "bias": bias, "dst_layer": y, "dst_iter": hn, "dst_iter_c": cn, "workspace": workspace,
                  "diff_dst_layer": dy, "diff_dst_iter": dhn, "diff_dst_iter_c": dcn}
        arrays.update(zip(_LSTM_BACKWARD_OUT, grads))
        problem.backward.run(arrays)
    return grads



# Elementwise passes over float32 arrays in memory order, on oneDNN's threads where NumPy's ufuncs run on one: relu
# each way and a per-channel ``x * scale + shift``, each one binary primitive with post-ops, the passes of batch
# norm's CPU kernels (:mod:`fluxpy.kernels.cpu_norm`). Batch norm's own primitive is not used: on plain NCHW data its
# kernel is slower than NumPy's statistics and these passes. relu is ``max(max(x, 0), x)``: oneDNN's max (and its
# relu) gives its second operand where one is NaN, so the first max turns NaN into 0 and the second gives the NaN
# back, as NumPy's ``maximum``.
_BINARY = {"add": 0x1FFF0, "mul": 0x1FFF1, "max": 0x1FFF2, "min": 0x1FFF3, "sub": 0x1FFF5, "gt": 0x1FFF7}
_ELTWISE = {"relu": 0x20, "linear": 0x26, "clip": 0x2E}   # relu(x, a = 0), linear a x + b, clip min(max(x, a), b)
_POST_OP_SRC1, _POST_OP_BASE = 2, 32768   # a post-op's operand: DNNL_ARG_ATTR_MULTIPLE_POST_OP(index) | SRC_1
ELTWISE_MIN_SIZE = 1 << 16   # below this many values NumPy's pass costs less than a call into oneDNN


def takes_eltwise(*arrays: np.ndarray) -> bool:
    """Whether the elementwise passes here take these arrays: C-contiguous float32 NumPy arrays of at least
    :data:`ELTWISE_MIN_SIZE` values, and oneDNN is there.

    >>> takes_eltwise(np.ones(4, np.float32))
    False
    """
    return (all(type(a) is np.ndarray and a.dtype == np.float32 and a.size >= ELTWISE_MIN_SIZE
                and a.flags.c_contiguous for a in arrays)
            and library() is not None)


class _Pass:
    """One binary primitive ``x <first> operand`` followed by post-ops, over float32 arrays of one shape (the
    operands of shape ``operand``, one value a channel of ``(N, C, S)`` or one in all): a memory per execution
    argument, whose data is set per call. ``post``: ``(<a binary op>, "channel" | "full")`` with the next operand
    (``"channel"``: of shape ``operand``), or an elementwise ``("relu" | "linear" | "clip", a, b)`` (oneDNN's relu
    and clip turn NaN into a number: for values known not to be NaN)."""

    def __init__(self, lib, shape: tuple, first: str, operand: tuple, post: tuple) -> None:
        self.lib = lib
        full, small = _plain_md(lib, shape), _plain_md(lib, operand)
        post_ops, attr = lib.handle("dnnl_post_ops_create"), lib.handle("dnnl_primitive_attr_create")
        mds = {_ARG["src"]: full, _POST_OP_SRC1: small}
        for index, (op, *kind) in enumerate(post):
            if op in _ELTWISE:
                lib.call("dnnl_post_ops_append_eltwise", post_ops, _ELTWISE[op], *map(ctypes.c_float, kind))
                continue
            md = full if kind[0] == "full" else small
            lib.call("dnnl_post_ops_append_binary", post_ops, _BINARY[op], md)
            mds[_POST_OP_BASE * (index + 1) | _POST_OP_SRC1] = md
        mds[_ARG["dst"]] = full
        lib.call("dnnl_primitive_attr_set_post_ops", attr, post_ops)
        pd = lib.handle("dnnl_binary_primitive_desc_create", lib.engine, _BINARY[first], full, small, full, attr)
        self.memories = {arg: lib.handle("dnnl_memory_create", md, lib.engine, ctypes.c_void_p(None))
                         for arg, md in mds.items()}
        self.primitive = lib.handle("dnnl_primitive_create", pd)
        lib.call("dnnl_primitive_desc_destroy", pd)
        lib.call("dnnl_primitive_attr_destroy", attr)
        lib.call("dnnl_post_ops_destroy", post_ops)
        for md in (full, small):
            lib.call("dnnl_memory_desc_destroy", md)

    def run(self, arrays: list) -> None:
        """Run on ``arrays``: ``x``, the first operand, one per binary post-op, the output (in that order)."""
        for memory, array in zip(self.memories.values(), arrays):
            self.lib.call("dnnl_memory_set_data_handle", memory, ctypes.c_void_p(array.ctypes.data))
        _execute(self.lib, self.primitive, list(self.memories.items()))
        self.lib.call("dnnl_stream_wait", self.lib.stream)

    def destroy(self) -> None:
        for memory in self.memories.values():
            self.lib.call("dnnl_memory_destroy", memory)
        self.lib.call("dnnl_primitive_destroy", self.primitive)


def _run_pass(x, first, per_channel, post, operands, out=None):
    """``out`` (new where None) of the :class:`_Pass` on ``x``: seen as ``(N, C, S)`` with ``per_channel`` operands,
    else as flat with a scalar first operand."""
    out = np.empty_like(x) if out is None else out
    if per_channel:   # (N, C) where S is 1: oneDNN 3.2 broadcasts a post-op's (1, C, 1) operand wrongly over (N, C, 1)
        spatial = x.size // (x.shape[0] * x.shape[1])
        shape = (x.shape[0], x.shape[1]) + ((spatial,) if spatial > 1 else ())
        operand = (1, shape[1]) + ((1,) if spatial > 1 else ())
    else:
        shape, operand = (x.size,), (1,)
    lib = library()
    with lib.lock:
        _cached(lib, ("pass", shape, first, post), lambda: _Pass(lib, shape, first, operand, post)).run(
            [x, *operands, out])
    return out


_ZERO = np.zeros(1, np.float32)


def relu(x: np.ndarray) -> np.ndarray:
    """``max(x, 0)`` of a float32 C-contiguous ``x``; NaN stays NaN.

    >>> x = np.linspace(-1, 1, 1 << 16, dtype=np.float32)
    >>> bool(((relu(x) if library() else np.maximum(x, 0)) == np.maximum(x, 0)).all())
    True
    """
    return _run_pass(x, "max", False, (("max", "full"),), (_ZERO, x))


def relu_backward(dy: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``dy * (y > 0)`` of float32 C-contiguous arrays of one shape, the gradient of relu from its output ``y``:
    NumPy's result, NaN in ``dy`` and signed zeros included, but where ``y`` is NaN (oneDNN's compare counts it as
    positive: ``dy`` passes where NumPy gives 0; that output made the loss NaN anyway)."""
    return _run_pass(y, "gt", False, (("mul", "full"),), (_ZERO, dy))


def scale_shift(x: np.ndarray, scale: np.ndarray, shift: np.ndarray, relu: bool = False,
                out: np.ndarray | None = None) -> np.ndarray:
    """``x * scale + shift`` (then oneDNN's ``max(., 0)`` with ``relu``: only for values that are not NaN) of a
    float32 C-contiguous ``x`` ``(N, C, ...)`` with one ``scale`` and ``shift`` value a channel (float32
    C-contiguous), into ``out`` (which may be ``x``) where given.

    >>> x = np.ones((2, 2, 1 << 14), np.float32)
    >>> s, t = np.array([2, 3], np.float32), np.array([-1, -5], np.float32)
    >>> y = scale_shift(x, s, t, relu=True) if library() else np.maximum(x * [[[2], [3]]] + [[[-1], [-5]]], 0)
    >>> y[0, :, 0].tolist()
    [1.0, 0.0]
    """
    post = (("add", "channel"),) + ((("relu", 0.0, 0.0),) if relu else ())
    return _run_pass(x, "mul", True, post, (scale, shift), out)


def scale_shift_relu6(x: np.ndarray, scale: np.ndarray, shift: np.ndarray,
                      out: np.ndarray | None = None) -> np.ndarray:
    """``min(max(x * scale + shift, 0), 6)`` as :func:`scale_shift` (only for values that are not NaN).

    >>> x = np.ones((2, 2, 1 << 14), np.float32)
    >>> s, t = np.array([2, 9], np.float32), np.array([1, 0], np.float32)
    >>> y = scale_shift_relu6(x, s, t) if library() else np.minimum(x * [[[2], [9]]] + [[[1], [0]]], 6)
    >>> y[0, :, 0].tolist()
    [3.0, 6.0]
    """
    return _run_pass(x, "mul", True, (("add", "channel"), ("clip", 0.0, 6.0)), (scale, shift), out)


_SIX = np.full(1, 6, np.float32)


def relu6_backward(dy: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``dy * ((y > 0) & (y < 6))`` of float32 C-contiguous arrays of one shape without NaN in ``y``, the gradient
    of relu6 from its output, as ``dy * (min(y, 6 - y) > 0)`` in one pass: ``6 - y`` is exact where it is the
    smaller (``y`` at least 3), so the mask is NumPy's exactly.

    >>> y = np.linspace(-1, 7, 1 << 16, dtype=np.float32)
    >>> want = (y > 0) & (y < 6)
    >>> bool(((relu6_backward(np.ones_like(y), y) if library() else want) == want).all())
    True
    """
    post = (("linear", -1.0, 0.0), ("min", "full"), ("gt", "channel"), ("mul", "full"))
    return _run_pass(y, "sub", False, post, (_SIX, y, _ZERO, dy))


def batchnorm_dx(x: np.ndarray, p: np.ndarray, g: np.ndarray, q: np.ndarray, a: np.ndarray,
                 into_g: bool = False) -> np.ndarray:
    """``(x * p + g + q) * a``, batch norm's input gradient in one pass: ``x`` and ``g`` float32 C-contiguous
    ``(N, C, ...)``, ``p``, ``q``, ``a`` one float32 value a channel; written over ``g`` with ``into_g`` (each value
    is read before its place is written)."""
    return _run_pass(x, "mul", True, (("add", "full"), ("add", "channel"), ("mul", "channel")), (p, g, q, a),
                     g if into_g else None)
