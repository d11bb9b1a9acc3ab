"""Upsampling layers (Flux's ``src/layers/upsample.jl``): Upsample (nearest or bilinear) and PixelShuffle.

Neither has parameters; both take floating-point ``(N, C, ...)`` images and check them, naming the layer.
"""
from __future__ import annotations

from ..functors import layer
from ..ops.resample import pixel_shuffle, upsample_bilinear, upsample_nearest
from ._checks import Array, _fail, _is_int, _positive_int, _require_float, _require_ndim

_MODES = ("nearest", "bilinear")


def _scale_option(scale):
    values = (scale,) if _is_int(scale) else tuple(scale) if isinstance(scale, (tuple, list)) else ()
    if not values or not all(_is_int(s) and s >= 1 for s in values):
        raise ValueError(f"Upsample: scale must be a positive int or a tuple of them (one per spatial axis), "
                         f"got {scale!r}")
    return int(scale) if _is_int(scale) else tuple(int(s) for s in values)


@layer(children=())
class Upsample:
    """Upsamples ``(N, C, S1, ...)`` images by the integer ``scale`` (an int, or one per spatial axis).

    ``mode="nearest"`` repeats each value (any number of spatial axes; :func:`fluxpy.ops.upsample_nearest`);
    ``mode="bilinear"`` interpolates ``(N, C, H, W)`` images (:func:`fluxpy.ops.upsample_bilinear`), with
    ``align_corners=True`` by default as NNlib's ``upsample_bilinear`` (PyTorch's default is False). Flux's
    ``Upsample(mode; scale)``.

    >>> import numpy as np
    >>> up = Upsample(2, mode="bilinear")
    >>> up, up(np.array([[[[0.0, 3.0]]]], np.float32))
    (Upsample(2, mode="bilinear"), array([[[[0., 1., 2., 3.],
             [0., 1., 2., 3.]]]], dtype=float32))
    """

    def __init__(self, scale: int | tuple[int, ...] = 2, mode: str = "nearest", align_corners: bool = True) -> None:
        if mode not in _MODES:
            raise ValueError(f"Upsample: mode must be \"nearest\" or \"bilinear\", got {mode!r}")
        self.scale, self.mode = _scale_option(scale), mode
        if not isinstance(align_corners, bool):
            raise ValueError(f"Upsample: align_corners must be True or False, got {align_corners!r}")
        if mode == "nearest" and not align_corners:
            raise ValueError("Upsample: align_corners applies to mode=\"bilinear\" only")
        if mode == "bilinear" and isinstance(self.scale, tuple) and len(self.scale) != 2:
            raise ValueError(f"Upsample: mode=\"bilinear\" takes a scale int or pair, got {scale!r}")
        self.align_corners = align_corners

    def __call__(self, x: Array) -> Array:
        if self.mode == "bilinear":
            _require_ndim(self, x, 4, "(N, C, H, W)")
        elif not hasattr(x, "shape") or len(x.shape) < 3:
            _fail(self, "an input (N, C, S1, ...) with a spatial axis", x)
        if isinstance(self.scale, tuple) and len(self.scale) != len(x.shape) - 2:
            _fail(self, f"{len(self.scale)} spatial axes (one per scale)", x)
        _require_float(self, x)
        if self.mode == "bilinear":
            return upsample_bilinear(x, self.scale, align_corners=self.align_corners)
        return upsample_nearest(x, self.scale)

    def __repr__(self):
        opts = (f", mode=\"{self.mode}\"" if self.mode != "nearest" else "") + \
            (", align_corners=False" if not self.align_corners else "")
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
