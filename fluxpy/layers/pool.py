"""Pooling layers: MaxPool, MeanPool and their global and adaptive forms (in Flux, part of ``src/layers/conv.jl``).

All take floating-point inputs of 1, 2 or 3 spatial axes (``(N, C, L)``, ``(N, C, H, W)``, ``(N, C, D, H, W)``)
and pool each channel separately: a windowed or adaptive pool has as many spatial axes as its kernel or output
size has entries (an int means 2-d), a global pool takes any of the three. The constructors check their options,
naming the layer.
"""
from __future__ import annotations

from ..functors import layer
from ..ops.dims import AdaptivePoolDims, ntuple, pad_widths, spatial_layout
from ..ops.pool import (adaptive_maxpool, adaptive_meanpool, global_maxpool, global_meanpool, maxpool, meanpool,
                        pool_dims)
from ._checks import Array, _fail, _renamed, _require_float, _require_ndim
from .show import _options


@layer(children=())
class MaxPool:
    """The largest value of each ``kernel`` window; ``stride`` defaults to ``kernel``.

    ``(N, C, H, W)`` -> ``(N, C, (H + pad_h - kh) // sh + 1, ...)``; ``kernel`` has one size per spatial axis
    (``(k,)`` pools ``(N, C, L)``, ``(k, k, k)`` pools ``(N, C, D, H, W)``; an int means 2-d). ``pad`` is an int,
    one per axis, a ``(before, after)`` pair per axis (``(top, bottom, left, right)`` in 2-d) or ``"same"``; as in
    Flux it may reach or pass the kernel's size (PyTorch refuses a pad over half the kernel), and a window of
    padding only then gives NNlib's value: the lowest finite number of the dtype (``MaxPool``), 0 (``MeanPool``),
    and no gradient.

    >>> import numpy as np
    >>> p = MaxPool((2, 2))
    >>> p, p(np.ones((1, 16, 28, 28), np.float32)).shape
    (MaxPool((2, 2)), (1, 16, 14, 14))
    >>> MaxPool((2, 2, 2))(np.ones((1, 3, 4, 6, 8), np.float32)).shape
    (1, 3, 2, 3, 4)
    >>> MaxPool((3,), stride=1, pad=1)
    MaxPool((3,), pad=1, stride=1)
    >>> MaxPool((2, 2), pad=3)(np.ones((1, 2, 5, 5), np.float32)).shape     # Flux's outputsize.jl:121
    (1, 2, 5, 5)
    """
    _op = staticmethod(maxpool)
    _op_name = "maxpool"

    def __init__(self, kernel: int | tuple[int, ...], stride: int | tuple[int, ...] | None = None,
                 pad: int | tuple[int, ...] | str = 0) -> None:
        name = type(self).__name__
        self.kernel = _window(name, "kernel", kernel)
        n = len(self.kernel)
        self.stride = self.kernel if stride is None else ntuple(name, "stride", stride, n, layer=True)
        self.pad = pad
        if not (isinstance(pad, str) and pad == "same"):
            pad_widths(name, pad, n, layer=True)

    def __call__(self, x: Array) -> Array:
        _require_rank(self, x, len(self.kernel))
        _require_float(self, x)
        try:
            pool_dims(x, self.kernel, self.stride, self.pad, op=self._op_name)
        except ValueError as err:
            raise _renamed(self, err, self._op_name) from None
        return type(self)._op(x, self.kernel, stride=self.stride, pad=self.pad, **self._keywords())

    def _keywords(self):
        """The pool op's keywords beyond kernel, stride and pad."""
        return {}

    def __repr__(self):
        return (f"{type(self).__name__}({self.kernel}"
                + _options([("pad", self.pad, 0), ("stride", self.stride, self.kernel[0] if
                                                    len(set(self.kernel)) == 1 else self.kernel)]) + ")")


def _window(name, what, value):
    """A kernel or output size: a tuple of 1, 2 or 3 positive ints, or an int (2-d)."""
    if isinstance(value, (tuple, list)) and len(value) not in (1, 2, 3):
        raise ValueError(f"{name}: {what} must be a positive int or a tuple of 1, 2 or 3 positive ints (one per "
                         f"spatial axis), got {value!r}")
    return ntuple(name, what, value, len(value) if isinstance(value, (tuple, list)) else 2, layer=True)


def _require_rank(layer, x, n):
    """Raise :class:`DimensionMismatch` unless ``x`` has ``n`` spatial axes (any of 1 to 3 where ``n`` is None)."""
    if n is not None:
        _require_ndim(layer, x, n + 2, spatial_layout(n))
    elif not hasattr(x, "shape") or len(x.shape) not in (3, 4, 5):
        _fail(layer, "an input of 1, 2 or 3 spatial axes (N, C, L), (N, C, H, W) or (N, C, D, H, W)", x)


@layer(children=())
class MeanPool(MaxPool):
    """The mean of each ``kernel`` window (padding counts as zeros, and a window of padding only gives 0); the
    arguments are :class:`MaxPool`'s. ``count_include_pad=False`` (PyTorch's option; Flux has none) divides by
    the number of the input's entries in each window instead (:func:`fluxpy.ops.meanpool`).

    >>> import numpy as np
    >>> MeanPool((2, 2))(np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4))[0, 0]
    array([[ 2.5,  4.5],
           [10.5, 12.5]], dtype=float32)
    >>> p = MeanPool((3,), stride=1, pad=1, count_include_pad=False)
    >>> p, p(np.array([[[3.0, 6.0, 9.0]]], np.float32))
    (MeanPool((3,), pad=1, stride=1, count_include_pad=False), array([[[4.5, 6. , 7.5]]], dtype=float32))
    """
    _op = staticmethod(meanpool)
    _op_name = "meanpool"

    def __init__(self, kernel: int | tuple[int, ...], stride: int | tuple[int, ...] | None = None,
                 pad: int | tuple[int, ...] | str = 0, count_include_pad: bool = True) -> None:
        super().__init__(kernel, stride, pad)
        if not isinstance(count_include_pad, bool):
            raise ValueError(f"MeanPool: count_include_pad must be True or False, got {count_include_pad!r}")
        self.count_include_pad = count_include_pad

    def _keywords(self):
        return {"count_include_pad": getattr(self, "count_include_pad", True)}

    def __repr__(self):
        return super().__repr__()[:-1] + ("" if getattr(self, "count_include_pad", True) else
                                          ", count_include_pad=False") + ")"


@layer(children=())
class GlobalMaxPool:
    """The largest value of each channel: ``(N, C, H, W)`` -> ``(N, C, 1, 1)``; ``(N, C, L)`` and
    ``(N, C, D, H, W)`` likewise, every spatial axis to size 1.

    >>> import numpy as np
    >>> GlobalMaxPool()(np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)).ravel()
    array([3., 7.], dtype=float32)
    >>> GlobalMaxPool()(np.ones((2, 3, 4, 5, 6), np.float32)).shape
    (2, 3, 1, 1, 1)
    """
    _op = staticmethod(global_maxpool)

    def __call__(self, x: Array) -> Array:
        _require_rank(self, x, None)
        _require_float(self, x)
        return type(self)._op(x)

    def __repr__(self):
        return f"{type(self).__name__}()"


@layer(children=())
class GlobalMeanPool(GlobalMaxPool):
    """The mean of each channel: ``(N, C, H, W)`` -> ``(N, C, 1, 1)`` (1 to 3 spatial axes).

    >>> import numpy as np
    >>> GlobalMeanPool()(np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)).ravel()
    array([1.5, 5.5], dtype=float32)
    """
    _op = staticmethod(global_meanpool)


@layer(children=())
class AdaptiveMaxPool:
    """The largest value of each of ``out_hw`` near-equal bins, giving ``(N, C, *out_hw)`` for any H, W; one output
    size per spatial axis (1, 2 or 3 of them; an int means 2-d).

    >>> import numpy as np
    >>> p = AdaptiveMaxPool((2, 3))
    >>> p, p(np.ones((4, 3, 11, 7), np.float32)).shape
    (AdaptiveMaxPool((2, 3)), (4, 3, 2, 3))
    >>> AdaptiveMaxPool((4,))(np.ones((2, 3, 9), np.float32)).shape
    (2, 3, 4)
    """
    _op = staticmethod(adaptive_maxpool)
    _op_name = "adaptive_maxpool"

    def __init__(self, out_hw: int | tuple[int, ...]) -> None:
        self.out_hw = _window(type(self).__name__, "out_hw", out_hw)

    def __call__(self, x: Array) -> Array:
        _require_rank(self, x, len(self.out_hw))
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
    """The mean of each of ``out_hw`` near-equal bins, giving ``(N, C, *out_hw)`` for any H, W (1 to 3 spatial
    axes, as :class:`AdaptiveMaxPool`).

    >>> import numpy as np
    >>> AdaptiveMeanPool((1, 1))(np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)).ravel()
    array([1.5], dtype=float32)
    """
    _op = staticmethod(adaptive_meanpool)
    _op_name = "adaptive_meanpool"
