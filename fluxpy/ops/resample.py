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

import numpy as np

from ..autodiff import value_of
from ..backend import Array, get_array_module
from .linalg import matmul
from .shape import broadcast_to, reshape, transpose

__all__ = ["upsample_nearest", "upsample_bilinear", "pixel_shuffle", "bilinear_weights"]


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _scales(name, scale, nspatial):
    """``scale`` as a tuple of ``nspatial`` positive ints (one int is used on every spatial axis)."""
    values = (scale,) * nspatial if _is_int(scale) else tuple(scale) if isinstance(scale, (tuple, list)) else ()
    if len(values) != nspatial or not all(_is_int(s) and s >= 1 for s in values):
        raise ValueError(f"{name} expects scale to be a positive int or a tuple of {nspatial} of them (one per "
                         f"spatial axis), got {scale!r}")
    return tuple(int(s) for s in values)


def _require_spatial(name, x, layout, ndim=None):
    if x.ndim < 3 or (ndim is not None and x.ndim != ndim):
        raise ValueError(f"{name} expects x of shape {layout}, got {tuple(x.shape)}")


def upsample_nearest(x: Array, scale: int | tuple[int, ...] = 2) -> Array:
    """Each value repeated ``scale`` times along every spatial axis: ``(N, C, S1, ...)`` ->
    ``(N, C, S1 * s1, ...)``; ``scale`` an int or one int per spatial axis. NNlib's ``upsample_nearest`` and
    PyTorch's ``interpolate(mode="nearest")`` with an integer ``scale_factor``.

    >>> import numpy as np
    >>> upsample_nearest(np.arange(2.0).reshape(1, 1, 2), 3)
    array([[[0., 0., 0., 1., 1., 1.]]])
    """
    _require_spatial("upsample_nearest", x, "(N, C, S1, ...)")
    s = _scales("upsample_nearest", scale, x.ndim - 2)
    lead, spatial = tuple(x.shape[:2]), tuple(x.shape[2:])
    spread = lead + tuple(d for n in spatial for d in (n, 1))
    wide = lead + tuple(d for n, k in zip(spatial, s) for d in (n, k))
    return reshape(broadcast_to(reshape(x, spread), wide), lead + tuple(n * k for n, k in zip(spatial, s)))


def bilinear_weights(n_in: int, n_out: int, align_corners: bool = True) -> np.ndarray:
    """The ``(n_out, n_in)`` float64 matrix of linear interpolation along one axis (rows sum to 1).

    Output index ``j`` reads the source position ``j * (n_in - 1) / (n_out - 1)`` with ``align_corners``
    (0 when ``n_out == 1``; NNlib's default), else ``max((j + 0.5) * n_in / n_out - 0.5, 0)`` (PyTorch's
    default), between its neighbours ``floor(src)`` and the next one (clamped to the last).

    >>> bilinear_weights(2, 3)
    array([[1. , 0. ],
           [0.5, 0.5],
           [0. , 1. ]])
    """
    j = np.arange(n_out, dtype=np.float64)
    if align_corners:
        src = j * ((n_in - 1) / (n_out - 1)) if n_out > 1 else np.zeros(n_out)
    else:
        src = np.maximum((j + 0.5) * (n_in / n_out) - 0.5, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    lam = src - i0
    w = np.zeros((n_out, n_in))
    np.add.at(w, (np.arange(n_out), i0), 1 - lam)
    np.add.at(w, (np.arange(n_out), i1), lam)
    return w


def upsample_bilinear(x: Array, scale: int | tuple[int, int] = 2, align_corners: bool = True) -> Array:
    """Bilinear interpolation of ``(N, C, H, W)`` images to ``(N, C, H * sh, W * sw)``; ``scale`` an int or a pair.

    Each output is the weighted mean of the four nearest inputs (see :func:`bilinear_weights` for the source
    positions). ``align_corners=True`` is NNlib's ``upsample_bilinear`` default (the corner pixels' centres
    coincide); ``False`` is PyTorch's ``interpolate(mode="bilinear")`` default. Separable: two matrix products,
    along W and then along H.

    >>> import numpy as np
    >>> upsample_bilinear(np.array([[[[0.0, 3.0]]]]), (1, 2))
    array([[[[0., 1., 2., 3.]]]])
    """
    _require_spatial("upsample_bilinear", x, "(N, C, H, W)", 4)
    if not isinstance(align_corners, (bool, np.bool_)):
        raise ValueError(f"upsample_bilinear expects align_corners True or False, got {align_corners!r}")
    sh, sw = _scales("upsample_bilinear", scale, 2)
    (h, w), v = x.shape[2:], value_of(x)
    xp = get_array_module(v)
    wh = xp.asarray(bilinear_weights(h, h * sh, bool(align_corners)).astype(v.dtype))
    ww = xp.asarray(bilinear_weights(w, w * sw, bool(align_corners)).T.astype(v.dtype))
    along_w = x if sw == 1 else matmul(x, ww)
    return along_w if sh == 1 else matmul(wh, along_w)


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


