"""Resampling images: ``upsample_nearest``, ``upsample_bilinear`` and ``pixel_shuffle`` (NNlib's ``upsample.jl``).

All three are compositions of differentiable ops, so their gradients (and second derivatives) come from
those ops' rules: nearest is a broadcast (its gradient sums each ``scale`` block, through ``unbroadcast``),
bilinear two products with fixed interpolation matrices (one per spatial axis, separable), pixel shuffle a
reshape and a transpose.

>>> import numpy as np
>>> upsample_nearest(np.array([[[[1.0, 2.0]]]]), 2)
array([[[[1., 1., 2., 2.],
         [1., 1., 2., 2.]]]])
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..autodiff import Primitive, value_of
from ..backend import Array, get_array_module
from ..kernels import find
from .constants import device_constant
from .linalg import matmul
from .norm import _one_tape_level
from .shape import broadcast_to, reshape, transpose

__all__ = ["upsample_nearest", "upsample_linear", "upsample_bilinear", "upsample_trilinear", "pixel_shuffle",
           "bilinear_weights", "nearest_weights", "along_axis"]


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_scale(v):
    """A positive int, or a positive finite real number (a non-integer scale)."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) and math.isfinite(v) and v > 0


def _scales(name, scale, nspatial):
    """``scale`` as a tuple of ``nspatial`` positive numbers (one is used on every spatial axis); ints stay ints."""
    one = _is_scale(scale) and not isinstance(scale, (tuple, list))
    values = (scale,) * nspatial if one else tuple(scale) if isinstance(scale, (tuple, list)) else ()
    if len(values) != nspatial or not all(_is_scale(s) for s in values):
        raise ValueError(f"{name} expects scale to be a positive number or a tuple of {nspatial} of them (one per "
                         f"spatial axis), got {scale!r}")
    return tuple(int(s) if float(s).is_integer() else float(s) for s in values)


def _sizes(name, size, x):
    """The output's spatial ``size`` (an int, or one per spatial axis) checked, as a tuple."""
    n = x.ndim - 2
    values = (size,) * n if _is_int(size) else tuple(size) if isinstance(size, (tuple, list)) else ()
    if len(values) != n or not all(_is_int(s) and s >= 1 for s in values):
        raise ValueError(f"{name} expects size to be a positive int or a tuple of {n} of them (the output's "
                         f"spatial size), got {size!r}")
    return tuple(int(s) for s in values)


def _scale_or_size(name, scale, size, x, short=False):
    """The output's spatial sizes from exactly one of ``scale`` and ``size``, and per axis the step in the input
    per output index that PyTorch's ``interpolate`` maps with: ``1 / scale`` where a scale is given (the output
    size is ``floor(size * scale)``), ``in / out`` where a size is. ``short``: a scale tuple of fewer entries than
    spatial axes scales the last ones (Flux's first), as NNlib's ``upsample_nearest``."""
    if (scale is None) == (size is None):
        raise ValueError(f"{name} expects either scale or size, not both or neither")
    spatial = tuple(x.shape[2:])
    if size is not None:
        out = _sizes(name, size, x)
        return out, tuple(a / b for a, b in zip(spatial, out))
    n = len(spatial)
    if short and isinstance(scale, (tuple, list)) and 0 < len(scale) < n:
        scale = (1,) * (n - len(scale)) + tuple(scale)
    scales = _scales(name, scale, n)
    out = tuple(int(math.floor(a * b)) for a, b in zip(spatial, scales))
    if min(out) < 1:
        raise ValueError(f"{name}: scale {scale!r} leaves no output along an axis of x of shape {tuple(x.shape)}")
    return out, tuple(1.0 / b for b in scales)


def _require_spatial(name, x, layout, ndim=None):
    if x.ndim < 3 or (ndim is not None and x.ndim != ndim):
        raise ValueError(f"{name} expects x of shape {layout}, got {tuple(x.shape)}")


def upsample_nearest(x: Array, scale: int | tuple[int, ...] | None = 2, *,
                     size: int | tuple[int, ...] | None = None) -> Array:
    """Each value repeated ``scale`` times along every spatial axis: ``(N, C, S1, ...)`` ->
    ``(N, C, S1 * s1, ...)``; ``scale`` an int or one int per spatial axis. NNlib's ``upsample_nearest`` and
    PyTorch's ``interpolate(mode="nearest")`` with an integer ``scale_factor``. A tuple of fewer scales than spatial
    axes scales the last ones (NNlib's first, in WHCN); ``size=`` gives the output's spatial size instead (with
    ``scale=None``), a multiple of the input's along each axis (NNlib's rule).

    A non-integer ``scale`` (PyTorch's ``scale_factor``) gives ``floor(S * scale)`` outputs, output ``j`` reading
    input ``min(floor(j / scale), S - 1)`` (PyTorch's ``mode="nearest"``), as a product with a 0/1 matrix per axis
    (:func:`nearest_weights`), kept on the device.

    >>> import numpy as np
    >>> upsample_nearest(np.arange(2.0).reshape(1, 1, 2), 3)
    array([[[0., 0., 0., 1., 1., 1.]]])
    >>> upsample_nearest(np.ones((1, 1, 2, 3)), (2,)).shape, upsample_nearest(np.ones((1, 1, 2, 3)), None, size=6).shape
    ((1, 1, 2, 6), (1, 1, 6, 6))
    >>> upsample_nearest(np.arange(3.0).reshape(1, 1, 3), 1.5)
    array([[[0., 0., 1., 2.]]])
    """
    _require_spatial("upsample_nearest", x, "(N, C, S1, ...)")
    out, ratios = _scale_or_size("upsample_nearest", scale, size, x, short=True)
    # Repeating each value is PyTorch's map only where every axis steps by in/out exactly: an output size that
    # is a multiple of the input's reached by that whole scale (2 * 1.3 floors to 2, yet output 1 reads input 0).
    if any(o % n or r != n / o for o, n, r in zip(out, x.shape[2:], ratios)):
        if size is not None:
            raise ValueError(f"upsample_nearest expects an output size that is a multiple of the input's "
                             f"{tuple(x.shape[2:])} along each axis, got {out}")
        return _resampled(x, out, ratios, ("upsample_nearest",), lambda n_in, n_out, r: nearest_weights(n_in, n_out, r))
    s = tuple(o // n for o, n in zip(out, x.shape[2:]))
    if _one_tape_level(x) and find("upsample_nearest", value_of(x), s) is not None:
        return _nearest_repeat(x, s)
    lead, spatial = tuple(x.shape[:2]), tuple(x.shape[2:])
    spread = lead + tuple(d for n in spatial for d in (n, 1))
    wide = lead + tuple(d for n, k in zip(spatial, s) for d in (n, k))
    return reshape(broadcast_to(reshape(x, spread), wide), lead + tuple(n * k for n, k in zip(spatial, s)))


def _nearest_repeat_impl(x, scales):
    return find("upsample_nearest", x, scales)(x, scales)


def _nearest_repeat_rule(x, scales):
    y = _nearest_repeat_impl(x, scales)

    def upsample_nearest_pullback(dy):
        dy = dy if dy.dtype == x.dtype else dy.astype(x.dtype)
        args = (dy, tuple(x.shape), scales, x)
        if find("upsample_nearest_backward", *args) is None:   # a broadcast or permuted cotangent: C order first
            args = (get_array_module(dy).ascontiguousarray(dy),) + args[1:]
        return find("upsample_nearest_backward", *args)(*args), None
    return y, upsample_nearest_pullback


# Whole scales on the GPU: one gather forward, one fixed-order block sum backward (fluxpy.kernels.cuda_upsample).
_nearest_repeat = Primitive("upsample_nearest", _nearest_repeat_rule, impl=_nearest_repeat_impl)


def nearest_weights(n_in: int, n_out: int, ratio: float | None = None) -> np.ndarray:
    """The ``(n_out, n_in)`` 0/1 matrix of PyTorch's nearest resampling along one axis: output ``j`` reads input
    ``min(floor(j * ratio), n_in - 1)``, ``ratio`` being ``n_in / n_out`` by default (``1 / scale_factor`` where a
    scale was given), computed in float32 as PyTorch's kernels do.

    >>> nearest_weights(2, 3)
    array([[1., 0.],
           [1., 0.],
           [0., 1.]])
    """
    r = np.float32(n_in / n_out if ratio is None else ratio)
    src = np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * r).astype(np.int64), n_in - 1)
    w = np.zeros((n_out, n_in))
    w[np.arange(n_out), src] = 1.0
    return w


def bilinear_weights(n_in: int, n_out: int, align_corners: bool = True, ratio: float | None = None) -> np.ndarray:
    """The ``(n_out, n_in)`` float64 matrix of linear interpolation along one axis (rows sum to 1).

    Output index ``j`` reads the source position ``j * (n_in - 1) / (n_out - 1)`` with ``align_corners``
    (0 when ``n_out == 1``; NNlib's default), else ``max((j + 0.5) * ratio - 0.5, 0)`` (PyTorch's
    default), ``ratio`` being ``n_in / n_out`` by default (PyTorch's ``1 / scale_factor`` where a scale was given),
    between its neighbours ``floor(src)`` and the next one (clamped to the last).

    >>> bilinear_weights(2, 3)
    array([[1. , 0. ],
           [0.5, 0.5],
           [0. , 1. ]])
    """
    j = np.arange(n_out, dtype=np.float64)
    if align_corners:
        src = j * ((n_in - 1) / (n_out - 1)) if n_out > 1 else np.zeros(n_out)
    else:
        src = np.maximum((j + 0.5) * (n_in / n_out if ratio is None else ratio) - 0.5, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    lam = src - i0
    w = np.zeros((n_out, n_in))
    np.add.at(w, (np.arange(n_out), i0), 1 - lam)
    np.add.at(w, (np.arange(n_out), i1), lam)
    return w


def upsample_linear(x: Array, scale: int | tuple[int, ...] | None = 2, align_corners: bool = True, *,
                    size: int | tuple[int, ...] | None = None) -> Array:
    """Linear interpolation along every spatial axis of ``(N, C, S1, ...)`` (1, 2 or 3 of them: NNlib's
    ``upsample_linear``, ``upsample_bilinear`` and ``upsample_trilinear`` in one), to ``S * scale`` per axis or to
    ``size=`` (with ``scale=None``, any size).

    Each output is the weighted mean of its nearest inputs (see :func:`bilinear_weights` for the source positions).
    ``align_corners=True`` is NNlib's default (the corner pixels' centres coincide); ``False`` is PyTorch's
    ``interpolate(mode="linear"/"bilinear"/"trilinear")`` default. A non-integer ``scale`` gives ``floor(S * scale)``
    outputs and maps them as PyTorch's ``scale_factor`` does. Separable: one matrix product per axis, with
    interpolation matrices built once per size and dtype and kept on the device
    (:func:`~fluxpy.ops.constants.device_constant`: a captured step copies nothing from the host).

    >>> import numpy as np
    >>> upsample_linear(np.array([[[0.0, 3.0]]]), 2)
    array([[[0., 1., 2., 3.]]])
    >>> upsample_linear(np.ones((1, 1, 2, 2, 2)), None, size=(3, 4, 5)).shape
    (1, 1, 3, 4, 5)
    >>> upsample_linear(np.array([[[0.0, 3.0]]]), 1.5, align_corners=False)
    array([[[0. , 1.5, 3. ]]])
    """
    _require_spatial("upsample_linear", x, "(N, C, S1, ...) with 1, 2 or 3 spatial axes")
    if x.ndim > 5:
        raise ValueError(f"upsample_linear expects 1, 2 or 3 spatial axes, got {tuple(x.shape)}")
    if not isinstance(align_corners, (bool, np.bool_)):
        raise ValueError(f"upsample_linear expects align_corners True or False, got {align_corners!r}")
    out, ratios = _scale_or_size("upsample_linear", scale, size, x)
    corners = bool(align_corners)
    return _resampled(x, out, ratios, ("upsample_linear", corners),
                      lambda n_in, n_out, r: bilinear_weights(n_in, n_out, corners, r), skip_equal=corners)


def _resampled(x, out, ratios, what, weights, skip_equal=False):
    """``x`` with each spatial axis contracted with its ``weights(n_in, n_out, ratio)`` matrix, the last axis
    first; an axis whose ratio is 1 (or whose size is kept, where ``skip_equal``) is left as it is."""
    v = value_of(x)
    y = x
    for axis in range(x.ndim - 1, 1, -1):
        n_in, n_out, r = x.shape[axis], out[axis - 2], ratios[axis - 2]
        if n_in == n_out and (skip_equal or r == 1.0):
            continue
        w = device_constant(what + (n_in, n_out, r),   # (n_in, n_out), kept on the device
                            lambda n_in=n_in, n_out=n_out, r=r: weights(n_in, n_out, r).T, v)
        y = along_axis(y, axis, w)
    return y


def along_axis(y: Array, axis: int, m: Array) -> Array:
    """``y`` with its axis ``axis`` (of size ``m.shape[0]``) contracted with the matrix ``m``, giving it size
    ``m.shape[1]``: ``y`` with that axis moved last, its rows times ``m`` as one 2-D product, moved back. One
    matrix product of a 2-D left side runs as a single gemm on the GPU (fluxpy's cuBLAS binding, which a captured
    step records; a batched product would not be), whatever ``y``'s layout: the rows are copied where they are not
    contiguous.

    >>> import numpy as np
    >>> along_axis(np.ones((2, 3, 4)), 1, np.ones((3, 5))).shape
    (2, 5, 4)
    """
    nd = len(y.shape)
    if axis % nd != nd - 1:
        order = tuple(a for a in range(nd) if a != axis % nd) + (axis % nd,)
        back = tuple(order.index(a) for a in range(nd))
        return transpose(along_axis(transpose(y, order), nd - 1, m), back)
    shape = tuple(y.shape)
    return reshape(matmul(reshape(y, (-1, shape[-1])), m), shape[:-1] + (m.shape[1],))


def upsample_bilinear(x: Array, scale: int | tuple[int, int] | None = 2, align_corners: bool = True, *,
                      size: int | tuple[int, int] | None = None) -> Array:
    """Bilinear interpolation of ``(N, C, H, W)`` images to ``(N, C, H * sh, W * sw)`` (``scale`` an int or a pair)
    or to ``size=`` (with ``scale=None``): :func:`upsample_linear` on 2 spatial axes (NNlib's ``upsample_bilinear``).

    >>> import numpy as np
    >>> upsample_bilinear(np.array([[[[0.0, 3.0]]]]), (1, 2))
    array([[[[0., 1., 2., 3.]]]])
    """
    _require_spatial("upsample_bilinear", x, "(N, C, H, W)", 4)
    if not isinstance(align_corners, (bool, np.bool_)):
        raise ValueError(f"upsample_bilinear expects align_corners True or False, got {align_corners!r}")
    if scale is not None:
        _scales("upsample_bilinear", scale, 2)
    return upsample_linear(x, scale, align_corners, size=size)


def upsample_trilinear(x: Array, scale: int | tuple[int, int, int] | None = 2, align_corners: bool = True, *,
                       size: int | tuple[int, int, int] | None = None) -> Array:
    """Trilinear interpolation of ``(N, C, D, H, W)`` volumes (NNlib's ``upsample_trilinear``): :func:`upsample_linear`
    on 3 spatial axes.

    >>> import numpy as np
    >>> upsample_trilinear(np.ones((1, 1, 2, 2, 2)), (1, 2, 3)).shape
    (1, 1, 2, 4, 6)
    """
    _require_spatial("upsample_trilinear", x, "(N, C, D, H, W)", 5)
    if scale is not None:
        _scales("upsample_trilinear", scale, 3)
    return upsample_linear(x, scale, align_corners, size=size)


def pixel_shuffle(x: Array, r: int) -> Array:
    """Moves channel blocks into space: ``(N, C * r**d, S1, ..., Sd)`` -> ``(N, C, S1 * r, ..., Sd * r)``.

    PyTorch's ``pixel_shuffle`` channel order (for d = 2): ``y[n, c, h * r + i, w * r + j] ==
    x[n, c * r * r + i * r + j, h, w]``. NNlib's ``pixel_shuffle`` on the same bytes in WHCN.

    >>> import numpy as np
    >>> pixel_shuffle(np.arange(4.0).reshape(1, 4, 1, 1), 2)
    array([[[[0., 1.],
             [2., 3.]]]])
    """
    _require_spatial("pixel_shuffle", x, "(N, C * r**d, S1, ..., Sd)")
    if not _is_int(r) or r < 1:
        raise ValueError(f"pixel_shuffle expects r to be a positive int, got {r!r}")
    r, d, c = int(r), x.ndim - 2, x.shape[1]
    if c % r ** d:
        raise ValueError(f"pixel_shuffle expects x.shape[1] divisible by r**{d} == {r ** d}, got {tuple(x.shape)}")
    n, spatial = x.shape[0], tuple(x.shape[2:])
    split = reshape(x, (n, c // r ** d) + (r,) * d + spatial)
    # (N, C, r1..rd, S1..Sd) -> (N, C, S1, r1, S2, r2, ...)
    order = (0, 1) + tuple(a for k in range(d) for a in (2 + d + k, 2 + k))
    return reshape(transpose(split, order), (n, c // r ** d) + tuple(s * r for s in spatial))


