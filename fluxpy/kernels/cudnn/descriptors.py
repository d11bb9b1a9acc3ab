"""cuDNN descriptors: the enums they take, the legacy tensor/filter/convolution/activation descriptors,
and the backend (graph) API's descriptor calls.

Legacy descriptors are plain ints (``cudnnTensorDescriptor_t`` ...), made by :func:`tensor_descriptor`,
:func:`filter_descriptor`, :func:`convolution_descriptor`, :func:`activation_descriptor` and freed by
:func:`destroy`. Tensors and filters of 4 dimensions take the ``4d`` calls, those of 5 (3-d convolutions) the
``Nd`` ones (bound here, on first use, from the loaded library: :func:`nd_function`). Backend descriptors are
made by :func:`backend_create`, given attributes by :func:`backend_set` and finalized by :func:`backend_finalize`.
Every status is checked (:func:`fluxpy.kernels.cudnn.errors.check`).

>>> compute_type(np.float16) == DATA_FLOAT and compute_type(np.float64) == DATA_DOUBLE
True
>>> data_type(BFLOAT16) == DATA_BFLOAT16 and compute_type(BFLOAT16) == DATA_FLOAT
True
>>> list(int64s(3, 4))
[3, 4]
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..halfs import BFLOAT16
from . import library
from .errors import check
from .library import fn

__all__ = ["DTYPES", "BFLOAT16", "data_type", "compute_type", "conv_mode", "scalars", "describe", "tensor_descriptor",
           "filter_descriptor", "convolution_descriptor", "activation_descriptor", "destroy", "backend_create",
           "backend_set", "backend_finalize", "backend_destroy", "int64s", "pointers", "nd_function", "ints"]

# ---------------------------------------------------------------------------------------------
# Enums shared by both APIs (cudnn_graph.h, cudnn_ops.h, cudnn_cnn.h of cuDNN 9)

DATA_FLOAT, DATA_DOUBLE, DATA_HALF, DATA_BFLOAT16 = 0, 1, 2, 9   # cudnnDataType_t
TENSOR_NCHW = 0                                             # cudnnTensorFormat_t
CONVOLUTION, CROSS_CORRELATION = 0, 1                       # cudnnConvolutionMode_t
NOT_PROPAGATE_NAN, PROPAGATE_NAN = 0, 1                     # cudnnNanPropagation_t

DTYPES = {np.dtype(np.float32): DATA_FLOAT, np.dtype(np.float64): DATA_DOUBLE, np.dtype(np.float16): DATA_HALF,
          BFLOAT16: DATA_BFLOAT16}

# ---------------------------------------------------------------------------------------------
# Enums of the backend API (cudnn_graph.h)

# cudnnBackendDescriptorType_t
D_POINTWISE, D_CONVOLUTION, D_ENGINE, D_ENGINECFG, D_ENGINEHEUR, D_EXECUTION_PLAN = 0, 1, 2, 3, 4, 5
D_KNOB_CHOICE, D_KNOB_INFO = 7, 8
D_OP_CONV_FWD, D_OP_CONV_BWD_FILTER, D_OP_CONV_BWD_DATA, D_OP_POINTWISE = 10, 11, 12, 13
D_OPERATIONGRAPH, D_VARIANT_PACK, D_TENSOR = 15, 16, 17

# cudnnBackendAttributeType_t
T_HANDLE, T_DATA_TYPE, T_BOOLEAN, T_INT64, T_FLOAT, T_DOUBLE, T_VOID_PTR, T_CONVOLUTION_MODE, T_HEUR_MODE = range(9)
T_KNOB_TYPE = 9
T_NUMERICAL_NOTE, T_POINTWISE_MODE, T_BACKEND_DESCRIPTOR, T_BEHAVIOR_NOTE = 11, 14, 15, 19

# cudnnBackendAttributeName_t
A_POINTWISE_MODE, A_POINTWISE_MATH_PREC = 0, 1
A_CONV_COMP_TYPE, A_CONV_MODE, A_CONV_DILATIONS, A_CONV_STRIDES, A_CONV_POST_PAD, A_CONV_PRE_PAD, A_CONV_DIMS = \
    100, 101, 102, 103, 104, 105, 106
A_HEUR_MODE, A_HEUR_GRAPH, A_HEUR_RESULTS = 200, 201, 202
A_CFG_ENGINE, A_CFG_KNOB_CHOICES = 300, 302
A_PLAN_HANDLE, A_PLAN_CONFIG, A_PLAN_WORKSPACE = 400, 401, 402
A_FWD_ALPHA, A_FWD_BETA, A_FWD_CONV, A_FWD_W, A_FWD_X, A_FWD_Y = 700, 701, 702, 703, 704, 705
A_BD_ALPHA, A_BD_BETA, A_BD_CONV, A_BD_W, A_BD_DX, A_BD_DY = 706, 707, 708, 709, 710, 711
A_BF_ALPHA, A_BF_BETA, A_BF_CONV, A_BF_DW, A_BF_X, A_BF_DY = 712, 713, 714, 715, 716, 717
A_PW_DESC, A_PW_X, A_PW_B, A_PW_Y = 750, 751, 752, 753
A_KNOB_CHOICE_TYPE, A_KNOB_CHOICE_VALUE = 600, 601
A_GRAPH_HANDLE, A_GRAPH_OPS, A_GRAPH_ENGINE_COUNT = 800, 801, 802
A_T_ALIGN, A_T_DTYPE, A_T_DIMS, A_T_STRIDES, A_T_UID, A_T_VIRTUAL = 900, 901, 902, 903, 906, 907
A_VP_UIDS, A_VP_PTRS, A_VP_WORKSPACE = 1000, 1001, 1003
A_KNOB_INFO_TYPE, A_KNOB_INFO_MAX, A_KNOB_INFO_MIN, A_KNOB_INFO_STRIDE = 1200, 1201, 1202, 1203
A_ENGINE_GRAPH, A_ENGINE_INDEX, A_ENGINE_KNOB_INFO = 1300, 1301, 1302
A_ENGINE_NUMERICAL_NOTE, A_ENGINE_BEHAVIOR_NOTE = 1303, 1305

PW_ADD, PW_RELU_FWD = 0, 100                                   # cudnnPointwiseMode_t
HEUR_MODE_INSTANT, HEUR_MODE_B, HEUR_MODE_FALLBACK, HEUR_MODE_A = 0, 1, 2, 3   # cudnnBackendHeurMode_t
NOTE_TENSOR_CORE, NOTE_DOWN_CONVERT_INPUTS, NOTE_NONDETERMINISTIC = 0, 1, 4    # cudnnBackendNumericalNote_t
BEHAVIOR_RUNTIME_COMPILATION = 0                               # cudnnBackendBehaviorNote_t


# ---------------------------------------------------------------------------------------------
# Types and names

def data_type(dtype) -> int:
    """The ``cudnnDataType_t`` of a NumPy dtype (float16, bfloat16, float32 or float64).

    >>> data_type(np.float32) == DATA_FLOAT
    True
    """
    return DTYPES[np.dtype(dtype)]


def compute_type(dtype) -> int:
    """The type cuDNN computes in for arrays of ``dtype``: double for float64, float otherwise (the halves as
    ``PSEUDO_HALF_CONFIG`` / ``PSEUDO_BFLOAT16_CONFIG``: half storage, float32 accumulation on tensor cores).

    >>> compute_type(np.float32) == DATA_FLOAT
    True
    """
    return DATA_DOUBLE if np.dtype(dtype) == np.float64 else DATA_FLOAT


def conv_mode(cdims) -> int:
    """``CUDNN_CROSS_CORRELATION`` where ``cdims.flipped``, else ``CUDNN_CONVOLUTION`` (true convolution)."""
    return CROSS_CORRELATION if cdims.flipped else CONVOLUTION


def scalars(dtype) -> tuple:
    """The ctypes scalars ``(one, zero)`` of the compute type of ``dtype``, for alpha and beta arguments
    (keep them alive while cuDNN may read their addresses).

    >>> [s.value for s in scalars(np.float64)]
    [1.0, 0.0]
    """
    scalar = ctypes.c_double if compute_type(dtype) == DATA_DOUBLE else ctypes.c_float
    return scalar(1.0), scalar(0.0)


def describe(cdims, dtype, x_shape=None) -> str:
    """The problem in words, for error messages; ``x_shape`` the input as cuDNN sees it where it differs.

    >>> from fluxpy.ops.dims import ConvDims
    >>> d = describe(ConvDims((1, 2, 5, 5), (3, 2, 3, 3), pad=(0, 1, 0, 0)), np.float32, (1, 2, 6, 5))
    >>> head, tail = d.split(", stride")
    >>> head
    'x (1, 2, 5, 5) padded to (1, 2, 6, 5), w (3, 2, 3, 3), y (1, 3, 4, 3) float32'
    >>> tail
    ' (1, 1), pad (0, 1, 0, 0), dilation (1, 1), groups 1, convolution'
    """
    c = cdims
    x = tuple(c.x_shape)
    if x_shape is not None and tuple(x_shape) != x:
        x = f"{x} padded to {tuple(x_shape)}"
    return (f"x {x}, w {c.w_shape}, y {c.y_shape} {np.dtype(dtype)}, stride {c.stride}, pad {c.pad}, "
            f"dilation {c.dilation}, groups {c.groups}, {'cross-correlation' if c.flipped else 'convolution'}")


# ---------------------------------------------------------------------------------------------
# Legacy descriptors

def _new(kind):
    p = ctypes.c_void_p()
    check(getattr(fn, f"cudnnCreate{kind}Descriptor")(ctypes.byref(p)), f"cudnnCreate{kind}Descriptor")
    return p.value


_PI = ctypes.POINTER(ctypes.c_int)
_ND_SIGNATURES = {
    "cudnnSetTensorNdDescriptor": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int, _PI, _PI], ctypes.c_int),
    "cudnnSetFilterNdDescriptor": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, _PI], ctypes.c_int),
    "cudnnSetConvolutionNdDescriptor": ([ctypes.c_void_p, ctypes.c_int, _PI, _PI, _PI, ctypes.c_int, ctypes.c_int],
                                        ctypes.c_int),
    "cudnnGetConvolutionNdForwardOutputDim": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, _PI],
                                              ctypes.c_int),
}
_nd = {}


def nd_function(name: str):
    """The legacy ``Nd`` call ``name`` (a key of ``_ND_SIGNATURES``: the tensor, filter and convolution setters and
    the output-shape query of 3-d convolutions), bound with its argument types on first use."""
    f = _nd.get(name)
    if f is None:
        lib = library.load()
        if lib is None:
            raise RuntimeError(library.load_error() or "libcudnn.so.9 is not loaded")
        f = getattr(lib, name)
        f.argtypes, f.restype = _ND_SIGNATURES[name]
        _nd[name] = f
    return f


def ints(*vals) -> ctypes.Array:
    """A ctypes ``int`` array of ``vals`` (the ``Nd`` calls' dimension arrays)."""
    return (ctypes.c_int * len(vals))(*vals)


def _c_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def tensor_descriptor(shape, dtype) -> int:
    """A new NCHW (NCDHW) ``cudnnTensorDescriptor_t`` (an int) of ``shape`` (4 or 5 ints, C order) and ``dtype``."""
    d = _new("Tensor")
    what = lambda: f"shape {tuple(shape)} {np.dtype(dtype)}"   # noqa: E731
    if len(shape) == 4:
        check(fn.cudnnSetTensor4dDescriptor(d, TENSOR_NCHW, data_type(dtype), *shape), "cudnnSetTensor4dDescriptor",
              what)
    else:
        check(nd_function("cudnnSetTensorNdDescriptor")(d, data_type(dtype), len(shape), ints(*shape),
                                                        ints(*_c_strides(shape))), "cudnnSetTensorNdDescriptor", what)
    return d


def filter_descriptor(shape, dtype) -> int:
    """A new NCHW (KCRS; KCTRS for 5 dimensions) ``cudnnFilterDescriptor_t`` of ``shape`` and ``dtype``."""
    d = _new("Filter")
    what = lambda: f"w of shape {tuple(shape)} {np.dtype(dtype)}"   # noqa: E731
    if len(shape) == 4:
        check(fn.cudnnSetFilter4dDescriptor(d, data_type(dtype), TENSOR_NCHW, *shape), "cudnnSetFilter4dDescriptor",
              what)
    else:
        check(nd_function("cudnnSetFilterNdDescriptor")(d, data_type(dtype), TENSOR_NCHW, len(shape), ints(*shape)),
              "cudnnSetFilterNdDescriptor", what)
    return d


def convolution_descriptor(cdims, geometry, dtype, math: int, what="") -> int:
    """A new ``cudnnConvolutionDescriptor_t``: ``geometry`` the ``(stride, dilation, pad)`` per descriptor axis
    (:func:`fluxpy.kernels.cudnn.geometry.descriptor_geometry`: 2 axes, or 3), ``cdims``' mode and groups,
    computing in :func:`compute_type` of ``dtype`` with math type ``math``."""
    stride, dilation, pad = geometry
    d = _new("Convolution")
    if len(pad) == 2:
        check(fn.cudnnSetConvolution2dDescriptor(d, *pad, *stride, *dilation, conv_mode(cdims), compute_type(dtype)),
              "cudnnSetConvolution2dDescriptor", what)
    else:
        check(nd_function("cudnnSetConvolutionNdDescriptor")(d, len(pad), ints(*pad), ints(*stride), ints(*dilation),
                                                             conv_mode(cdims), compute_type(dtype)),
              "cudnnSetConvolutionNdDescriptor", what)
    if cdims.groups > 1:
        check(fn.cudnnSetConvolutionGroupCount(d, cdims.groups), "cudnnSetConvolutionGroupCount", what)
    check(fn.cudnnSetConvolutionMathType(d, math), "cudnnSetConvolutionMathType", what)
    return d


def activation_descriptor(mode: int) -> int:
    """A new ``cudnnActivationDescriptor_t`` of ``mode`` (``cudnnActivationMode_t``), propagating NaN."""
    d = _new("Activation")
    check(fn.cudnnSetActivationDescriptor(d, mode, PROPAGATE_NAN, 0.0), "cudnnSetActivationDescriptor")
    return d


def destroy(kind: str, d: int) -> None:
    """Free a legacy descriptor of ``kind`` (``"Tensor"``, ``"Filter"``, ``"Convolution"``, ``"Activation"``)."""
    getattr(fn, f"cudnnDestroy{kind}Descriptor")(d)


# ---------------------------------------------------------------------------------------------
# Backend descriptors

_i64 = ctypes.c_int64
_P = ctypes.c_void_p


def int64s(*vals) -> ctypes.Array:
    """A ctypes ``int64_t`` array of ``vals``."""
    return (_i64 * len(vals))(*vals)


def pointers(*ds) -> ctypes.Array:
    """A ctypes ``void*`` array of ``ds`` (descriptors or device pointers)."""
    return (_P * len(ds))(*ds)


def backend_create(kind: int) -> int:
    """A new backend descriptor of ``cudnnBackendDescriptorType_t`` ``kind`` (an int)."""
    d = _P()
    check(fn.cudnnBackendCreateDescriptor(kind, ctypes.byref(d)), "cudnnBackendCreateDescriptor", f"type {kind}")
    return d.value


def backend_set(desc: int, attr: int, atype: int, values, what="") -> None:
    """Set ``attr`` (of type ``atype``) of ``desc`` to ``values``: a ctypes array, or one ctypes scalar."""
    n = len(values) if isinstance(values, ctypes.Array) else 1
    check(fn.cudnnBackendSetAttribute(desc, attr, atype, n, ctypes.byref(values)),
          f"cudnnBackendSetAttribute(attr {attr})", what)


def backend_finalize(desc: int, call: str, what="") -> None:
    """``cudnnBackendFinalize(desc)``; ``call`` names it in the error (e.g. ``"cudnnBackendFinalize(tensor)"``)."""
    check(fn.cudnnBackendFinalize(desc), call, what)


def backend_destroy(desc: int) -> None:
    """``cudnnBackendDestroyDescriptor(desc)`` (the status is not checked: it runs while cleaning up)."""
    fn.cudnnBackendDestroyDescriptor(desc)
