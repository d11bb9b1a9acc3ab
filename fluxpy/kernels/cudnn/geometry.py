"""Where cuDNN's view of a convolution differs from :class:`fluxpy.ops.dims.ConvDims`, and the layout of the
arrays handed to it: written once, for the legacy and the graph paths alike.

cuDNN pads symmetrically. :func:`split_pad` gives it ``min(top, bottom)``, ``min(left, right)`` (``min(before,
after)`` per spatial axis) and leaves the rest (``extra_pad``) to :func:`pad_input`, which pads the input by it;
the data gradient comes back with the padded input's shape and :func:`crop_dx` crops it.

Problems of 1, 2 or 3 spatial axes share this: cuDNN is told of a 1-d problem as a 2-d one with a unit first
spatial axis (:func:`descriptor_shape`, :func:`descriptor_geometry`: ``(N, C, L)`` is ``(N, C, 1, L)``, the same
bytes), and of a 3-d one with 5-d descriptors; the arrays keep their own shapes. :func:`contiguous` casts and
copies to C order where needed; :func:`aligned` copies an array whose data is not :data:`ALIGN`-byte
aligned (what the graph API's tensors promise).

>>> from fluxpy.ops.dims import ConvDims
>>> split_pad(ConvDims((1, 1, 8, 8), (1, 1, 2, 2), pad=(0, 1, 1, 1)))
PadSplit(sym_pad=(0, 1), extra_pad=(0, 1, 0, 0), x_shape=(1, 1, 9, 8))
>>> split_pad(ConvDims((1, 1, 8, 8), (1, 1, 3, 3), pad=(1, 1, 1, 1))).extra_pad is None
True
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

from ...backend import cupy
from ..cuda_arrays import c_contiguous, contiguous

__all__ = ["ConvDimsLike", "PadSplit", "split_pad", "pad_input", "crop_dx", "contiguous", "aligned", "ALIGN",
           "descriptor_shape", "descriptor_geometry"]

ALIGN = 16
"""The byte alignment of every array the graph path hands to cuDNN."""


class ConvDimsLike(Protocol):
    """What the binding reads of a :class:`fluxpy.ops.dims.ConvDims` (kernels sit below the ops and do not
    import them); ``pad`` is ``(top, bottom, left, right)`` (a ``(before, after)`` pair per spatial axis)."""
    x_shape: tuple
    w_shape: tuple
    y_shape: tuple
    stride: tuple
    pad: tuple
    dilation: tuple
    groups: int
    flipped: bool


class PadSplit(NamedTuple):
    """``sym_pad`` ``(ph, pw)`` for cuDNN (one per spatial axis), ``extra_pad`` ``(top, bottom, left, right)`` that
    the input is padded by first (None where the padding is symmetric), and ``x_shape``, the input as cuDNN sees it
    (in the array's own rank)."""
    sym_pad: tuple
    extra_pad: tuple | None
    x_shape: tuple


def split_pad(cdims: ConvDimsLike) -> PadSplit:
    """The symmetric part of ``cdims.pad`` for cuDNN and the rest, to pad the input by (see the module)."""
    pad = cdims.pad
    sym = tuple(min(pad[i], pad[i + 1]) for i in range(0, len(pad), 2))
    extra = tuple(v - sym[i // 2] for i, v in enumerate(pad))
    sizes = tuple(s + extra[2 * i] + extra[2 * i + 1] for i, s in enumerate(cdims.x_shape[2:]))
    return PadSplit(sym, extra if any(extra) else None, tuple(cdims.x_shape[:2]) + sizes)


def descriptor_shape(shape: tuple) -> tuple:
    """The shape cuDNN is told of an array of ``shape``: a 1-d problem's ``(N, C, L)`` as ``(N, C, 1, L)``, the
    others as they are.

    >>> descriptor_shape((2, 3, 7)), descriptor_shape((2, 3, 4, 5))
    ((2, 3, 1, 7), (2, 3, 4, 5))
    """
    shape = tuple(shape)
    return shape[:2] + (1,) + shape[2:] if len(shape) == 3 else shape


def descriptor_geometry(cdims: ConvDimsLike, sym_pad: tuple) -> tuple:
    """``(stride, dilation, pad)`` per spatial axis of the descriptors (a unit axis first for a 1-d problem).

    >>> from fluxpy.ops.dims import ConvDims
    >>> descriptor_geometry(ConvDims((1, 1, 9), (1, 1, 3), stride=(2,), pad=(1, 1), dilation=(1,)), (1,))
    ((1, 2), (1, 1), (0, 1))
    """
    if len(sym_pad) == 1:
        return (1,) + tuple(cdims.stride), (1,) + tuple(cdims.dilation), (0,) + tuple(sym_pad)
    return tuple(cdims.stride), tuple(cdims.dilation), tuple(sym_pad)


def pad_input(x, extra_pad):
    """``x`` (CuPy) padded with zeros by ``extra_pad`` ``(top, bottom, left, right)`` (a pair per spatial axis), or,
    where that is None, ``x`` itself in C order."""
    if extra_pad is not None:
        pairs = tuple((extra_pad[i], extra_pad[i + 1]) for i in range(0, len(extra_pad), 2))
        return cupy.pad(x, ((0, 0), (0, 0)) + pairs)
    return c_contiguous(x)


def crop_dx(dx, extra_pad):
    """The data gradient of the padded input ``dx`` cropped to the unpadded input (C order); ``dx`` itself
    where ``extra_pad`` is None."""
    if extra_pad is None:
        return dx
    inner = tuple(slice(extra_pad[2 * i], n - extra_pad[2 * i + 1]) for i, n in enumerate(dx.shape[2:]))
    return c_contiguous(dx[(slice(None), slice(None)) + inner])


def aligned(a):
    """``a``, or a copy of it where its data pointer is not :data:`ALIGN`-byte aligned."""
    if a.data.ptr % ALIGN:
        a = a.copy()
    return a
