"""Pooling layers: MaxPool, MeanPool and their global and adaptive forms (in Flux, part of ``src/layers/conv.jl``).

All take floating-point images ``(N, C, H, W)`` and pool each channel separately; the constructors
check their options, naming the layer.
"""
from __future__ import annotations

from ..functors import layer
from ..ops.dims import AdaptivePoolDims
from ..ops.pool import (adaptive_maxpool, adaptive_meanpool, global_maxpool, global_meanpool, maxpool, meanpool,
                        pool_dims)
from ._checks import Array, _pad_option, _pair, _renamed, _require_float, _require_ndim
from .show import _options


@layer(children=())
class MaxPool:
    """The largest value of each ``kernel`` window; ``stride`` defaults to ``kernel``.

    ``(N, C, H, W)`` -> ``(N, C, (H + pad_h - kh) // sh + 1, ...)``. ``pad`` is an int, a pair, a
    4-tuple ``(top, bottom, left, right)`` or ``"same"``, smaller than the kernel on every side.

    >>> import numpy as np
    >>> p = MaxPool((2, 2))
    >>> p, p(np.ones((1, 16, 28, 28), np.float32)).shape
    (MaxPool((2, 2)), (1, 16, 14, 14))
    """
    _op = staticmethod(maxpool)
    _op_name = "maxpool"

    def __init__(self, kernel: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
                 pad: int | tuple[int, ...] = 0) -> None:
        name = type(self).__name__
        self.kernel = _pair(f"{name}: kernel", kernel)
        self.stride = self.kernel if stride is None else _pair(f"{name}: stride", stride)
        self.pad = _pad_option(name, pad)
        if not isinstance(pad, str):
            pads = (pad,) * 4 if not isinstance(pad, (tuple, list)) else \
                (pad[0], pad[0], pad[1], pad[1]) if len(pad) == 2 else tuple(pad)
            if max(pads[:2]) >= self.kernel[0] or max(pads[2:]) >= self.kernel[1]:
                raise ValueError(f"{name}: pad must be smaller than the kernel {self.kernel} on every side, "
                                 f"got {pad!r}")

    def __call__(self, x: Array) -> Array:
        _require_ndim(self, x, 4, "(N, C, H, W)")
        _require_float(self, x)
        try:
            pool_dims(x, self.kernel, self.stride, self.pad, op=self._op_name)
        except ValueError as err:
            raise _renamed(self, err, self._op_name) from None
        return type(self)._op(x, self.kernel, stride=self.stride, pad=self.pad)

    def __repr__(self):
        return (f"{type(self).__name__}({self.kernel}"
                + _options([("pad", self.pad, 0), ("stride", self.stride, self.kernel[0] if
                                                    len(set(self.kernel)) == 1 else self.kernel)]) + ")")


@layer(children=())
class MeanPool(MaxPool):
    """The mean of each ``kernel`` window (padding counts as zeros); the arguments are :class:`MaxPool`'s.

    >>> import numpy as np
    >>> MeanPool((2, 2))(np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4))[0, 0]
    array([[ 2.5,  4.5],
           [10.5, 12.5]], dtype=float32)
    """
    _op = staticmethod(meanpool)
    _op_name = "meanpool"


@layer(children=())
class GlobalMaxPool:
    """The largest value of each channel: ``(N, C, H, W)`` -> ``(N, C, 1, 1)``.

    >>> import numpy as np
    >>> GlobalMaxPool()(np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)).ravel()
    array([3., 7.], dtype=float32)
    """
    _op = staticmethod(global_maxpool)

    def __call__(self, x: Array) -> Array:
        _require_ndim(self, x, 4, "(N, C, H, W)")
        _require_float(self, x)
        return type(self)._op(x)

    def __repr__(self):
        return f"{type(self).__name__}()"


@layer(children=())
class GlobalMeanPool(GlobalMaxPool):
    """The mean of each channel: ``(N, C, H, W)`` -> ``(N, C, 1, 1)``.

    >>> import numpy as np
    >>> GlobalMeanPool()(np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)).ravel()
    array([1.5, 5.5], dtype=float32)
    """
    _op = staticmethod(global_meanpool)


@layer(children=())
class AdaptiveMaxPool:
    """The largest value of each of ``out_hw`` near-equal bins, giving ``(N, C, *out_hw)`` for any H, W.

    >>> import numpy as np
    >>> p = AdaptiveMaxPool((2, 3))
    >>> p, p(np.ones((4, 3, 11, 7), np.float32)).shape
    (AdaptiveMaxPool((2, 3)), (4, 3, 2, 3))
    """
    _op = staticmethod(adaptive_maxpool)
    _op_name = "adaptive_maxpool"

    def __init__(self, out_hw: int | tuple[int, int]) -> None:
        self.out_hw = _pair(f"{type(self).__name__}: out_hw", out_hw)

    def __call__(self, x: Array) -> Array:
        _require_ndim(self, x, 4, "(N, C, H, W)")
        _require_float(self, x)
        try:
            AdaptivePoolDims.from_array(x, self.out_hw, op=self._op_name)
        except ValueError as err:
            raise _renamed(self, err, self._op_name) from None
        return type(self)._op(x, self.out_hw)

    def __repr__(self):
        return f"{type(self).__name__}({self.out_hw})"


@layer(children=())
class AdaptiveMeanPool(AdaptiveMaxPool):
    """The mean of each of ``out_hw`` near-equal bins, giving ``(N, C, *out_hw)`` for any H, W.

    >>> import numpy as np
    >>> AdaptiveMeanPool((1, 1))(np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)).ravel()
    array([1.5], dtype=float32)
    """
    _op = staticmethod(adaptive_meanpool)
    _op_name = "adaptive_meanpool"
