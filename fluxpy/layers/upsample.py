"""Upsampling layers (Flux's ``src/layers/upsample.jl``): Upsample (nearest, linear, bilinear or trilinear),
PixelShuffle and its inverse PixelUnshuffle (PyTorch's).

None has parameters; both take floating-point ``(N, C, ...)`` images and check them, naming the layer.
"""
from __future__ import annotations

import math
import numbers

from ..functors import layer
from ..ops.resample import pixel_shuffle, upsample_linear, upsample_nearest
from ..ops.shape import reshape, transpose
from ._checks import Array, _fail, _is_int, _positive_int, _require_float, _require_ndim

_MODES = {"nearest": None, "linear": 1, "bilinear": 2, "trilinear": 3}   # mode -> its spatial axes (None: any)
_LAYOUTS = {1: "(N, C, L)", 2: "(N, C, H, W)", 3: "(N, C, D, H, W)"}


def _is_scale(s):
    return isinstance(s, numbers.Real) and not isinstance(s, bool) and math.isfinite(s) and s > 0


def _scale_option(scale):
    values = (scale,) if _is_scale(scale) else tuple(scale) if isinstance(scale, (tuple, list)) else ()
    if not values or not all(_is_scale(s) for s in values):
        raise ValueError(f"Upsample: scale must be a positive number or a tuple of them (one per spatial axis), "
                         f"got {scale!r}")
    values = tuple(int(s) if float(s).is_integer() else float(s) for s in values)
    return values[0] if _is_scale(scale) else values


def _size_option(size):
    values = (size,) if _is_int(size) else tuple(size) if isinstance(size, (tuple, list)) else ()
    if not values or not all(_is_int(s) and s >= 1 for s in values):
        raise ValueError(f"Upsample: size must be a positive int or a tuple of them (the output's spatial size), "
                         f"got {size!r}")
    return int(size) if _is_int(size) else tuple(int(s) for s in values)


@layer(children=())
class Upsample:
    """Upsamples ``(N, C, S1, ...)`` images by ``scale`` (a number, or one per spatial axis), or to the
    spatial ``size=`` (Flux's ``Upsample(mode; scale, size)``: give one of them; with neither, ``scale=2``).

    ``mode="nearest"`` repeats each value (any number of spatial axes; :func:`fluxpy.ops.upsample_nearest`; a scale
    tuple shorter than the spatial axes scales the last ones, Flux's first, and a ``size`` must be a multiple of
    the input's); ``mode="linear"`` interpolates ``(N, C, L)`` signals, ``mode="bilinear"`` ``(N, C, H, W)`` images
    and ``mode="trilinear"`` ``(N, C, D, H, W)`` volumes (:func:`fluxpy.ops.resample.upsample_linear`), with
    ``align_corners=True`` by default as NNlib's (PyTorch's default is False). A non-integer scale gives
    ``floor(S * scale)`` outputs per axis, mapped as PyTorch's ``interpolate(scale_factor=...)`` (which NNlib's
    size-based mapping equals only for integer scales). Sizes and scales are in fluxpy's axis order: Flux's
    ``scale=(2, 3)`` on WHCN data is ``scale=(3, 2)`` here.

    >>> import numpy as np
    >>> up = Upsample(2, mode="bilinear")
    >>> up, up(np.array([[[[0.0, 3.0]]]], np.float32))
    (Upsample(2, mode="bilinear"), array([[[[0., 1., 2., 3.],
             [0., 1., 2., 3.]]]], dtype=float32))
    >>> up = Upsample(mode="trilinear", size=(4, 6, 4))
    >>> up, up(np.ones((3, 2, 2, 4, 3), np.float32)).shape
    (Upsample(mode="trilinear", size=(4, 6, 4)), (3, 2, 4, 6, 4))
    >>> up = Upsample(1.5, mode="linear", align_corners=False)
    >>> up, up(np.array([[[0.0, 3.0]]], np.float32))
    (Upsample(1.5, mode="linear", align_corners=False), array([[[0. , 1.5, 3. ]]], dtype=float32))
    """

    def __init__(self, scale: int | tuple[int, ...] | None = None, mode: str = "nearest", align_corners: bool = True,
                 *, size: int | tuple[int, ...] | None = None) -> None:
        if mode not in _MODES:
            raise ValueError(f"Upsample: mode must be \"nearest\", \"linear\", \"bilinear\" or \"trilinear\", got "
                             f"{mode!r}")
        if scale is not None and size is not None:
            raise ValueError(f"Upsample: give scale or size, not both (got scale={scale!r} and size={size!r})")
        self.mode = mode
        self.scale = _scale_option(2 if scale is None and size is None else scale) if size is None else None
        self.size = None if size is None else _size_option(size)
        if not isinstance(align_corners, bool):
            raise ValueError(f"Upsample: align_corners must be True or False, got {align_corners!r}")
        if mode == "nearest" and not align_corners:
            raise ValueError("Upsample: align_corners applies to mode=\"linear\", \"bilinear\" or \"trilinear\" only")
        n = _MODES[mode]
        given = self.scale if self.size is None else self.size
        if n is not None and isinstance(given, tuple) and len(given) != n:
            what = "scale" if self.size is None else "size"
            form = ("of one axis", "int or pair", "int or triple")[n - 1]
            raise ValueError(f"Upsample: mode=\"{mode}\" takes a {what} {form}, got {given!r}")
        self.align_corners = align_corners

    def __call__(self, x: Array) -> Array:
        n = _MODES[self.mode]
        if n is not None:
            _require_ndim(self, x, n + 2, _LAYOUTS[n])
        elif not hasattr(x, "shape") or len(x.shape) < 3:
            _fail(self, "an input (N, C, S1, ...) with a spatial axis", x)
        given = self.scale if self.size is None else self.size
        if isinstance(given, tuple) and (len(given) > len(x.shape) - 2 or self.size is not None and
                                         len(given) != len(x.shape) - 2):
            _fail(self, f"{len(given)} spatial axes (one per {'scale' if self.size is None else 'size'})", x)
        _require_float(self, x)
        if self.mode != "nearest":
            return upsample_linear(x, self.scale, self.align_corners, size=self.size)
        if self.size is not None:
            out = (self.size,) * (len(x.shape) - 2) if _is_int(self.size) else self.size
            if any(o % s for o, s in zip(out, x.shape[2:])):
                _fail(self, f"a spatial size that divides the output size {out}", x)
        return upsample_nearest(x, self.scale, size=self.size)

    def __repr__(self):
        opts = (f", mode=\"{self.mode}\"" if self.mode != "nearest" else "") + \
            (", align_corners=False" if not self.align_corners else "")
        if self.size is not None:
            return f"Upsample({opts[2:]}{', ' if opts else ''}size={self.size})"
        return f"Upsample({self.scale}{opts})"


@layer(children=())
class PixelShuffle:
    """Rearranges ``(N, C * r**d, S1, ..., Sd)`` into ``(N, C, S1 * r, ..., Sd * r)`` with PyTorch's
    ``pixel_shuffle`` channel order (:func:`fluxpy.ops.pixel_shuffle`). Flux's ``PixelShuffle(r)``.

    >>> import numpy as np
    >>> ps = PixelShuffle(2)
    >>> ps, ps(np.ones((1, 8, 3, 3), np.float32)).shape
    (PixelShuffle(2), (1, 2, 6, 6))
    """

    def __init__(self, r: int) -> None:
        self.r = _positive_int("PixelShuffle", "r", r)

    def __call__(self, x: Array) -> Array:
        if not hasattr(x, "shape") or len(x.shape) < 3:
            _fail(self, "an input (N, C * r**d, S1, ..., Sd) with a spatial axis", x)
        block = self.r ** (len(x.shape) - 2)
        if x.shape[1] % block:
            _fail(self, f"x.shape[1] divisible by {self.r}**{len(x.shape) - 2} == {block}", x)
        _require_float(self, x)
        return pixel_shuffle(x, self.r)

    def __repr__(self):
        return f"PixelShuffle({self.r})"


@layer(children=())
class PixelUnshuffle:
    """Rearranges ``(N, C, S1 * r, ..., Sd * r)`` into ``(N, C * r**d, S1, ..., Sd)``, the inverse of
    :class:`PixelShuffle` (PyTorch's ``PixelUnshuffle(downscale_factor)``; Flux has none): output channel
    ``c * r**d + k`` holds the offset ``k`` (row-major over the ``d`` axes) of each ``r``-block of channel ``c``.

    >>> import numpy as np
    >>> pu = PixelUnshuffle(2)
    >>> x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    >>> pu, pu(x).shape, bool((PixelShuffle(2)(pu(x)) == x).all())
    (PixelUnshuffle(2), (1, 4, 2, 2), True)
    """

    def __init__(self, r: int) -> None:
        self.r = _positive_int("PixelUnshuffle", "r", r)

    def __call__(self, x: Array) -> Array:
        if not hasattr(x, "shape") or len(x.shape) < 3:
            _fail(self, "an input (N, C, S1 * r, ..., Sd * r) with a spatial axis", x)
        r, (n, c), spatial = self.r, x.shape[:2], tuple(x.shape[2:])
        if any(s % r for s in spatial):
            _fail(self, f"spatial sizes divisible by r == {r}", x)
        _require_float(self, x)
        d = len(spatial)
        split = (n, c) + tuple(v for s in spatial for v in (s // r, r))   # (N, C, S1, r, S2, r, ...)
        order = (0, 1) + tuple(range(3, 2 + 2 * d, 2)) + tuple(range(2, 2 + 2 * d, 2))   # (N, C, r.., S1, ..)
        return reshape(transpose(reshape(x, split), order), (n, c * r ** d) + tuple(s // r for s in spatial))

    def __repr__(self):
        return f"PixelUnshuffle({self.r})"
