"""Convolution (NNlib ``src/conv.jl``): ``conv``, its two gradient kernels, ``conv_transpose`` and ``conv_bias_act``.

Layout NCHW: ``x`` is ``(N, C, H, W)``, the weight ``w`` is ``(K, C/groups, R, S)``, the output
``(N, K, P, Q)``; in 1 and 3 spatial dimensions ``(N, C, L)`` and ``(N, C, D, H, W)`` likewise, the weight with
one kernel size per spatial axis (:class:`~fluxpy.ops.dims.ConvDims`). ``flipped=False`` (the default) is true
convolution, the kernel flipped, as Flux's ``Conv``; ``flipped=True`` is cross-correlation, what PyTorch's
``conv2d`` computes and Flux calls ``CrossCor``.

The gradient kernels are public ops named as cuDNN's calls, each with its own rule, so second
derivatives come for free (NNlib's conv rrules)::

    conv(x, w)                  -> dx = conv_backward_data(dy, w),    dw = conv_backward_filter(x, dy)
    conv_backward_data(dy, w)   -> ddy = conv(ddx, w),                dw = conv_backward_filter(ddx, dy)
    conv_backward_filter(x, dy) -> dx = conv_backward_data(dy, ddw),  ddy = conv(x, ddw)

(``ddx``, ``ddw``: the cotangents arriving at the backward kernels' outputs.)

The arithmetic runs in the kernel registered for the arrays' module (:mod:`fluxpy.kernels`;
NumPy's is im2col + BLAS), so these rules never change for another backend.

>>> import numpy as np
>>> from fluxpy import gradient
>>> x, w = np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2))
>>> conv(x, w)
array([[[[4., 4.],
         [4., 4.]]]])
>>> gradient(lambda w: conv(x, w).sum(), w)[0][0, 0]
array([[4., 4.],
       [4., 4.]])
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..autodiff import Primitive, value_of
from ..backend import Array, get_array_module, is_float_dtype
from ..kernels import find, lookup
from ..kernels.halfs import is_half
from .activations import identity, relu
from .dims import ConvDims, _check_spatial, _expand_pad, _is_int, describe, memoised, ntuple
from .fused import fused_op
from .reduce import sum as _sum
from .shape import astype, reshape

__all__ = ["conv", "conv_backward_data", "conv_backward_filter", "conv_transpose", "conv_bias_act",
           "conv_bias_act_backward", "ConvDims"]


# ---------------------------------------------------------------------------------------------
# The three primitives


def _conv_rule(needs, x, w, cdims):
    y = _conv(x, w, cdims)

    def conv_pullback(dy):
        dx, dw, _ = _conv_grads(dy, None, x, w, "identity", cdims, needs[0], needs[1], False)
        return dx, dw, None
    return y, conv_pullback


def _conv_backward_data_rule(needs, dy, w, cdims):
    dx = _conv_backward_data(dy, w, cdims)

    def conv_backward_data_pullback(ddx):
        ddy = _conv(ddx, w, cdims) if needs[0] else None
        dw = _conv_backward_filter(ddx, dy, cdims) if needs[1] else None
        return ddy, dw, None
    return dx, conv_backward_data_pullback


def _conv_backward_filter_rule(needs, x, dy, cdims):
    dw = _conv_backward_filter(x, dy, cdims)

    def conv_backward_filter_pullback(ddw):
        dx = _conv_backward_data(dy, ddw, cdims) if needs[0] else None
        ddy = _conv(x, ddw, cdims) if needs[1] else None
        return dx, ddy, None
    return dw, conv_backward_filter_pullback


_conv = Primitive("conv", _conv_rule, needs_mask=True,
                  impl=lambda x, w, cdims: lookup("conv_forward", x, w)(x, w, cdims))
_conv_backward_data = Primitive("conv_backward_data", _conv_backward_data_rule, needs_mask=True,
                                impl=lambda dy, w, cdims: lookup("conv_backward_data", dy, w)(dy, w, cdims))
_conv_backward_filter = Primitive("conv_backward_filter", _conv_backward_filter_rule, needs_mask=True,
                                  impl=lambda x, dy, cdims: lookup("conv_backward_filter", x, dy)(x, dy, cdims))


# ---------------------------------------------------------------------------------------------
# Public ops

_DIMS = {}   # validated ConvDims by (shapes, dtypes, options): a call checks a problem once


def conv_dims(x: Array, w: Array, stride: int | tuple[int, ...] = 1, pad: int | tuple[int, ...] | str = 0,
              dilation: int | tuple[int, ...] = 1, groups: int = 1, flipped: bool = False) -> ConvDims:
    """The :class:`ConvDims` of ``conv(x, w, ...)`` (:meth:`ConvDims.from_arrays`), memoised on hashable
    options; the same errors otherwise.

    >>> import numpy as np
    >>> conv_dims(np.ones((1, 2, 5, 5)), np.ones((3, 2, 3, 3)), pad=1).y_shape
    (1, 3, 5, 5)
    """
    key = (getattr(x, "shape", None), getattr(w, "shape", None), getattr(x, "dtype", None),
           getattr(w, "dtype", None), stride, type(stride), pad, type(pad), dilation, type(dilation), groups,
           type(groups), flipped)
    return memoised(_DIMS, key, lambda: _dims_from_arrays(x, w, stride=stride, pad=pad, dilation=dilation,
                                                          groups=groups, flipped=flipped))


def _dims_from_arrays(x, w, **options):
    """:meth:`ConvDims.from_arrays`, which also takes bfloat16 ``x`` and ``w`` (of the same dtype)."""
    xd, wd = getattr(x, "dtype", None), getattr(w, "dtype", None)
    if xd is not None and xd == wd and is_float_dtype(xd) and xd.kind != "f":   # from_arrays knows kind "f" only
        return ConvDims.from_shapes(x.shape, w.shape, **options)   # which checks the shapes
    return ConvDims.from_arrays(x, w, **options)


def conv(x: Array, w: Array, *, stride: int | tuple[int, ...] = 1, pad: int | tuple[int, ...] | str = 0,
         dilation: int | tuple[int, ...] = 1, groups: int = 1, flipped: bool = False) -> Array:
    """The convolution of ``x`` with the kernel ``w`` in 1, 2 or 3 spatial dimensions (2-d written out below).

    ``y[n, k, p, q] = sum_{c, r, s} w[k, c, R-1-r, S-1-s] * xpad[n, g*C/G + c, p*sh + r*dh, q*sw + s*dw]``
    where ``g = k // (K/G)`` is the group of output channel ``k`` and ``xpad`` is ``x`` zero-padded;
    with ``flipped=True`` the kernel is read unflipped, ``w[k, c, r, s]`` (cross-correlation).

    Shapes: ``x`` ``(N, C, H, W)``, ``w`` ``(K, C/groups, R, S)``, ``y`` ``(N, K, P, Q)`` with
    ``P = (H + top + bottom - dilation_h*(R-1) - 1) // stride_h + 1``. ``x`` and ``w`` must share a
    floating dtype. In 1-d ``x`` is ``(N, C, L)`` and ``w`` ``(K, C/groups, S)``; in 3-d ``(N, C, D, H, W)`` and
    ``(K, C/groups, T, R, S)``; the options then take one value per spatial axis.

    Keywords: ``stride``, ``dilation``: an int or a pair; ``pad``: an int, a pair ``(ph, pw)``, a
    4-tuple ``(top, bottom, left, right)`` or ``"same"`` (output ``ceil(H / stride)``, TensorFlow's
    split); ``groups``: divides ``C`` and ``K``; ``flipped``: cross-correlation instead of convolution.
    See :class:`fluxpy.ops.dims.ConvDims`. Bad shapes or options raise ``ValueError`` before any
    arithmetic, naming the op, what was expected and what was got.

    >>> import numpy as np
    >>> x = np.arange(16.0).reshape(1, 1, 4, 4)
    >>> conv(x, np.array([[[[1.0, 0.0], [0.0, 0.0]]]]))[0, 0]        # true convolution: flipped kernel
    array([[ 5.,  6.,  7.],
           [ 9., 10., 11.],
           [13., 14., 15.]])
    >>> conv(x, np.array([[[[1.0, 0.0], [0.0, 0.0]]]]), flipped=True)[0, 0]
    array([[ 0.,  1.,  2.],
           [ 4.,  5.,  6.],
           [ 8.,  9., 10.]])
    >>> conv(np.ones((2, 4, 9, 9)), np.ones((6, 2, 3, 3)), stride=2, pad="same", groups=2).shape
    (2, 6, 5, 5)
    >>> conv(np.arange(5.0).reshape(1, 1, 5), np.array([[[1.0, 0.0]]]))           # 1-d, flipped kernel
    array([[[1., 2., 3., 4.]]])
    >>> conv(np.ones((1, 2, 4, 5, 6)), np.ones((3, 2, 2, 2, 2)), pad=(0, 1, 0)).shape
    (1, 3, 3, 6, 5)
    """
    cdims = conv_dims(x, w, stride=stride, pad=pad, dilation=dilation, groups=groups, flipped=flipped)
    return _conv(x, w, cdims)


def conv_backward_data(dy: Array, w: Array, cdims: ConvDims) -> Array:
    """The gradient of ``conv`` with respect to ``x``.

    ``dx = ∂/∂x <conv(x, w), dy>``, the adjoint of ``x -> conv(x, w)``; shape ``cdims.x_shape``.
    ``dy`` is ``cdims.y_shape`` ``(N, K, P, Q)``, ``w`` is ``cdims.w_shape``; ``cdims`` is the
    :class:`~fluxpy.ops.dims.ConvDims` of the forward call. Differentiable in ``dy`` and ``w``.

    >>> import numpy as np
    >>> x, w = np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2))
    >>> cd = ConvDims.from_arrays(x, w)
    >>> conv_backward_data(np.ones(cd.y_shape), w, cd)[0, 0]
    array([[1., 2., 1.],
           [2., 4., 2.],
           [1., 2., 1.]])
    """
    cdims.check_y("conv_backward_data", dy)
    cdims.check_w("conv_backward_data", w)
    return _conv_backward_data(dy, w, cdims)


def conv_backward_filter(x: Array, dy: Array, cdims: ConvDims) -> Array:
    """The gradient of ``conv`` with respect to ``w``.

    ``dw = ∂/∂w <conv(x, w), dy>``; shape ``cdims.w_shape``. ``x`` is ``cdims.x_shape``, ``dy``
    is ``cdims.y_shape``. Differentiable in ``x`` and ``dy``.

    >>> import numpy as np
    >>> x, w = np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2))
    >>> cd = ConvDims.from_arrays(x, w)
    >>> conv_backward_filter(x, np.ones(cd.y_shape), cd)[0, 0]
    array([[4., 4.],
           [4., 4.]])
    """
    cdims.check_x("conv_backward_filter", x)
    cdims.check_y("conv_backward_filter", dy)
    return _conv_backward_filter(x, dy, cdims)


def _transpose_dims(x, w, stride, pad, dilation, groups, flipped, output_padding):
    """The ConvDims of the forward conv whose ``conv_backward_data`` is this ``conv_transpose``."""
    op = "conv_transpose"
    _check_spatial(op, "x", x)
    n = len(x.shape) - 2
    _check_spatial(op, "w", w, n=n, weight=True, transposed=True)
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"{op} expects x.shape[1] == w.shape[0] == {w.shape[0]} (input channels), "
                         f"got {describe('x', x)}")
    if x.dtype != w.dtype or not is_float_dtype(x.dtype):
        raise TypeError(f"{op} expects x and w of the same floating-point dtype, got x {x.dtype} and w {w.dtype}")
    if not _is_int(groups) or groups < 1 or x.shape[1] % groups:
        raise ValueError(f"{op} expects groups to be a positive int dividing x.shape[1] (input channels), "
                         f"got groups {groups!r} and {describe('x', x)}")
    stride, dilation = ntuple(op, "stride", stride, n), ntuple(op, "dilation", dilation, n)
    out_pad = ntuple(op, "output_padding", output_padding, n, minimum=0)
    if any(o >= s for o, s in zip(out_pad, stride)):
        raise ValueError(f"{op} expects output_padding smaller than stride {stride}, got {out_pad}")
    sizes = tuple(x.shape[2:])
    c_out = w.shape[1] * groups
    dilated = tuple(d * (r - 1) + 1 for d, r in zip(dilation, w.shape[2:]))
    if isinstance(pad, str) and pad == "same":
        if any(out_pad):
            raise ValueError(f"{op} expects output_padding 0 with pad=\"same\", got {out_pad}")
        out = tuple(size * s for size, s in zip(sizes, stride))   # the conv of this size with "same" gives sizes
    else:
        p = _expand_pad(op, pad, sizes, dilated, stride)
        out = tuple((size - 1) * s - p[2 * i] - p[2 * i + 1] + d + o
                    for i, (size, s, d, o) in enumerate(zip(sizes, stride, dilated, out_pad)))
        if min(out) < 1:
            raise ValueError(f"{op} expects a positive output size, got {out} from {describe('x', x)}, "
                             f"{describe('w', w)}, stride {stride}, pad {pad!r} and dilation {dilation}")
    return ConvDims.from_shapes((x.shape[0], c_out) + out, w.shape, stride=stride, pad=pad, dilation=dilation,
                                groups=groups, flipped=flipped, op=op)


def conv_transpose(x: Array, w: Array, *, stride: int | tuple[int, ...] = 1, pad: int | tuple[int, ...] | str = 0,
                   dilation: int | tuple[int, ...] = 1, groups: int = 1, flipped: bool = False,
                   output_padding: int | tuple[int, ...] = 0) -> Array:
    """The transposed convolution (PyTorch's ``conv_transpose2d``, Flux's ``ConvTranspose``).

    It is the gradient of ``conv`` with respect to its input, ``conv_backward_data(x, w, cdims)``,
    where ``cdims`` describes the forward conv from the output back to ``x``.

    Shapes: ``x`` ``(N, C_in, H, W)``; ``w`` ``(C_in, C_out/groups, R, S)``, PyTorch's layout for
    ``conv_transpose2d`` (the forward conv's ``(K, C/groups, R, S)`` with ``K = C_in``); output
    ``(N, C_out, H_out, W_out)`` with ``H_out = (H-1)*stride_h - top - bottom + dilation_h*(R-1) + 1
    + output_padding_h``. ``pad="same"`` gives ``H_out = H * stride_h``. 1-d and 3-d likewise (``x`` of 3 or 5
    dimensions, ``w`` ``(C_in, C_out/groups, *kernel)``).

    Keywords as :func:`conv` (they describe the forward conv); ``output_padding`` (int or pair,
    smaller than ``stride``) adds rows/columns at the bottom/right to pick among the input sizes
    that a strided conv maps to the same output size. With ``flipped=True`` it equals PyTorch's
    ``conv_transpose2d(x, w, stride, padding, output_padding, groups, dilation)``.

    >>> import numpy as np
    >>> conv_transpose(np.ones((1, 1, 2, 2)), np.ones((1, 1, 2, 2)), stride=2)[0, 0]
    array([[1., 1., 1., 1.],
           [1., 1., 1., 1.],
           [1., 1., 1., 1.],
           [1., 1., 1., 1.]])
    >>> conv_transpose(np.ones((2, 4, 5, 5)), np.ones((4, 3, 3, 3)), stride=2, pad=1, output_padding=1).shape
    (2, 3, 10, 10)
    >>> conv_transpose(np.ones((1, 2, 3)), np.ones((2, 1, 2)), stride=2)[0, 0]
    array([2., 2., 2., 2., 2., 2.])
    """
    cdims = _transpose_dims(x, w, stride, pad, dilation, groups, flipped, output_padding)
    return _conv_backward_data(x, w, cdims)


# ---------------------------------------------------------------------------------------------
# conv_bias_act: one primitive for relu and identity, whose pullback needs only the output


def _conv_bias_act_impl(x, w, b, kind, cdims):
    fused = find("conv_bias_act_forward", x, w, b, kind, cdims)
    if fused is not None:
        return fused(x, w, b, kind, cdims)
    y = lookup("conv_forward", x, w)(x, w, cdims)
    if b is not None:
        y += b.reshape(_channel_shape(y.ndim))
    if kind == "relu":
        get_array_module(y).maximum(y, 0, out=y)
    return y


def _bias_backward(dy, y, kind, cdims, need_b):
    dz = dy * (value_of(y) > 0) if kind == "relu" else dy  # a mask product: cheaper than NumPy's where
    return dz, (_bias_sum(dz) if need_b else None)


def _channel_shape(ndim):
    """``(1, -1, 1, ...)``: a per-channel vector's shape against arrays of ``ndim`` axes."""
    return (1, -1) + (1,) * (ndim - 2)


def _bias_axes(ndim):
    """``(0, 2, ...)``: every axis but the channels'."""
    return (0, 2, 3) if ndim == 4 else (0,) + tuple(range(2, ndim))


def _bias_sum(dz):
    """``dz`` summed over every axis but the channels' (``(0, 2, 3)`` in 2-d); the halves accumulate in float32
    (NumPy would add in the half type)."""
    axes = _bias_axes(len(dz.shape))
    if not is_half(dz.dtype):
        return _sum(dz, axis=axes)
    return astype(_sum(astype(dz, np.float32), axis=axes), dz.dtype)


conv_bias_act_backward = fused_op("conv_bias_act_backward", _bias_backward, doc="""
    The cotangents ``(dz, db)`` of ``conv + b``, from the output ``y`` of :func:`conv_bias_act`:
    ``dz = dy * (y > 0)`` for ``kind="relu"``, ``dy`` for ``"identity"``, and, with ``need_b``,
    ``db``, its sum over ``(0, 2, 3)`` (every axis but the channels'); on the GPU one pass writes ``dz`` while it
    sums ``db``.

    >>> import numpy as np
    >>> dz, db = conv_bias_act_backward(np.ones((1, 2, 1, 1)), np.array([[[[0.0]], [[3.0]]]]), "relu", None, True)
    >>> db
    array([0., 1.])
    """)


def _conv_grads_composite(dy, y, x, w, kind, cdims, need_x, need_w, need_b):
    if kind == "identity" and not need_b:   # a plain conv's pullback: nothing to mask or sum
        dz, db = dy, None
    else:
        dz, db = conv_bias_act_backward(dy, y, kind, cdims, need_b)
    dx = _conv_backward_data(dz, w, cdims) if need_x else None
    dw = _conv_backward_filter(x, dz, cdims) if need_w else None
    return dx, dw, db


_conv_grads = fused_op("conv_bias_act_grads", _conv_grads_composite, doc="""
    ``(dx, dw, db)`` of ``act(conv(x, w) + b)`` (``kind`` ``"relu"``, from its output ``y``, or ``"identity"``) for
    the cotangent ``dy``, each None where its ``need_*`` is false: ``conv_bias_act_backward`` then the two gradient
    convolutions, or one kernel that shares their work (the CPU's).

    >>> import numpy as np
    >>> x, w = np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2))
    >>> dx, dw, db = _conv_grads(np.ones((1, 1, 2, 2)), None, x, w, "identity", ConvDims.from_arrays(x, w),
    ...                          True, True, True)
    >>> dx[0, 0].tolist(), dw[0, 0].tolist(), db.tolist()
    ([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]], [[4.0, 4.0], [4.0, 4.0]], [4.0])
    """)


def _conv_bias_act_rule(needs, x, w, b, kind, cdims):
    y = _conv_bias_act(x, w, b, kind, cdims)

    def conv_bias_act_pullback(dy):
        dx, dw, db = _conv_grads(dy, y, x, w, kind, cdims, needs[0], needs[1], needs[2] and b is not None)
        return dx, dw, db, None, None
    return y, conv_bias_act_pullback


_conv_bias_act = Primitive("conv_bias_act", _conv_bias_act_rule, needs_mask=True, impl=_conv_bias_act_impl)


def _fused_kind(act):
    try:
        return _FUSED.get(act)
    except TypeError:   # an unhashable callable
        return None


def conv_bias_act(x: Array, w: Array, b: Array | bool | None, act: Callable | None = None, **options: Any) -> Array:
    """The convolution with bias and activation, ``act(conv(x, w) + b)``.

    ``b`` of shape ``(K,)`` and ``x``'s dtype is added per output channel (x, w and b share one dtype:
    float16, bfloat16, float32 or float64). ``b=None`` or ``False`` means no bias;
    ``act=None`` (the default) is the identity. Keywords as :func:`conv` (``stride=1, pad=0,
    dilation=1, groups=1, flipped=False``).

    For ``relu`` and ``identity`` it is one primitive: on the GPU one
    ``cudnnConvolutionBiasActivationForward``; its pullback computes ``dz`` from the output alone
    (``dz = dy * (y > 0)`` for relu), the bias gradient as the sum of ``dz`` over ``(0, 2, 3)`` (on the GPU
    in the same pass), then ``dx = conv_backward_data(dz, w)`` and ``dw = conv_backward_filter(x, dz)``
    (their primitives, so second derivatives work). Other activations run :func:`conv`, then the
    fused :func:`fluxpy.ops.bias_act.bias_act`: on the GPU one kernel forward and one back (``dz`` written while
    ``db`` sums) for every activation :func:`fluxpy.ops.bias_act.why_not_fused` passes, its derivative taken
    from the output where it is a function of it (tanh, sigmoid, elu, ...) and from the kept pre-activation
    otherwise (gelu, swish, ...).

    >>> import numpy as np
    >>> from fluxpy.ops.activations import relu
    >>> conv_bias_act(np.ones((1, 1, 2, 2)), np.ones((2, 1, 2, 2)), np.array([-5.0, 1.0]), relu)[0, :, 0, 0]
    array([0., 5.])
    """
    if b is False:
        b = None
    if b is not None:
        k = w.shape[0]
        if tuple(b.shape) != (k,):
            raise ValueError(f"conv_bias_act expects b of shape ({k},) (one per output channel), got "
                             f"{describe('b', b)}")
        if b.dtype != x.dtype:
            raise TypeError(f"conv_bias_act expects b of x's dtype {x.dtype}, got {describe('b', b)}: convert "
                            f"it with b.astype(x.dtype)")
    cdims = conv_dims(x, w, **options)
    kind = _fused_kind(identity if act is None else act)
    if kind is not None:
        if b is None and kind == "identity":
            return _conv(x, w, cdims)
        return _conv_bias_act(x, w, b, kind, cdims)
    from .bias_act import bias_act  # imported here: bias_act lives in its own module
    y = _conv(x, w, cdims)
    if b is not None:
        b = reshape(b, (1, w.shape[0]) + (1,) * (len(x.shape) - 2))
    return bias_act(y, b) if act is None else bias_act(y, b, act)


_FUSED = {relu: "relu", identity: "identity"}

