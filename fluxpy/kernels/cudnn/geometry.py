"""Where cuDNN's view of a convolution differs from :class:`fluxpy.ops.dims.ConvDims`, and the layout of the
arrays handed to it: written once, for the legacy and the graph paths alike.

cuDNN pads symmetrically. :func:`split_pad` gives it ``min(top, bottom)``, ``min(left, right)`` and
leaves the rest (``extra_pad``) to :func:`pad_input`, which pads the input by it; the data gradient
comes back with the padded input's shape and :func:`crop_dx` crops it. :func:`contiguous` casts and
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
from ..cuda_arrays import contiguous

__all__ = ["ConvDimsLike", "PadSplit", "split_pad", "pad_input", "crop_dx", "contiguous", "aligned", "ALIGN"]

ALIGN = 16
"""The byte alignment of every array the graph path hands to cuDNN."""


class ConvDimsLike(Protocol):
    """What the binding reads of a :class:`fluxpy.ops.dims.ConvDims` (kernels sit below the ops and do not
    import them); ``pad`` is ``(top, bottom, left, right)``."""
    x_shape: tuple
    w_shape: tuple
    y_shape: tuple
    stride: tuple
    pad: tuple
    dilation: tuple
    groups: int
    flipped: bool


class PadSplit(NamedTuple):
    """``sym_pad`` ``(ph, pw)`` for cuDNN, ``extra_pad`` ``(top, bottom, left, right)`` that the input is padded
    by first (None where the padding is symmetric), and ``x_shape``, the input as cuDNN sees it."""
    sym_pad: tuple
    extra_pad: tuple | None
    x_shape: tuple


def split_pad(cdims: ConvDimsLike) -> PadSplit:
    """The symmetric part of ``cdims.pad`` for cuDNN and the rest, to pad the input by (see the module)."""
    t, b, l, r = cdims.pad
    ph, pw = min(t, b), min(l, r)
    extra = (t - ph, b - ph, l - pw, r - pw)
    n, c, h, w = cdims.x_shape
    return PadSplit((ph, pw), extra if any(extra) else None, (n, c, h + extra[0] + extra[1], w + extra[2] + extra[3]))


def pad_input(x, extra_pad):
    """``x`` (CuPy) padded with zeros by ``extra_pad`` ``(top, bottom, left, right)``, or, where that is None,
    ``x`` itself in C order."""
    if extra_pad is not None:
        t, b, l, r = extra_pad
        return cupy.pad(x, ((0, 0), (0, 0), (t, b), (l, r)))
    if not x.flags.c_contiguous:
        x = cupy.ascontiguousarray(x)
    return x


def crop_dx(dx, extra_pad):
    """The data gradient of the padded input ``dx`` cropped to the unpadded input (C order); ``dx`` itself
    where ``extra_pad`` is None."""
    if extra_pad is None:
        return dx
    t, b, l, r = extra_pad
    return cupy.ascontiguousarray(dx[:, :, t:dx.shape[2] - b, l:dx.shape[3] - r])


def aligned(a):
    """``a``, or a copy of it where its data pointer is not :data:`ALIGN`-byte aligned."""
    if a.data.ptr % ALIGN:
        a = a.copy()
    return a
