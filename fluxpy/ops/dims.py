"""Convolution and pooling geometry: :class:`ConvDims`, :class:`PoolDims`, :class:`AdaptivePoolDims`.

Each is a frozen dataclass (NNlib's ``DenseConvDims``/``PoolDims``) built once per call from the
array shapes and the keyword options. It expands ints to tuples, resolves ``pad="same"``,
validates everything with errors that name the op and say what was expected and what was
got, and computes the output shape. The CPU kernels, a GPU backend's descriptors and the
backward kernels all read the same object. It is a plain argument: it never goes on the tape.

Layout is NCHW: ``x`` is ``(N, C, H, W)``, a convolution weight ``(K, C/groups, R, S)``.

>>> import numpy as np
>>> cd = ConvDims.from_arrays(np.ones((2, 3, 9, 9)), np.ones((4, 3, 3, 3)), stride=2, pad="same")
>>> cd.pad, cd.y_shape
((1, 1, 1, 1), (2, 4, 5, 5))
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ConvDims", "PoolDims", "AdaptivePoolDims", "describe", "memoised"]

_MEMO_LIMIT = 4096


def memoised(cache: dict, key: Hashable, build: Callable[[], Any]) -> Any:
    """The result of ``build()``, built once per hashable ``key`` and kept in the dict ``cache``; an
    unhashable key just builds.

    Dims are validated once per problem: the checks cost several microseconds per op call.

    >>> cache = {}
    >>> memoised(cache, ("k", 1), lambda: [1]) is memoised(cache, ("k", 1), lambda: [2])
    True
    """
    try:
        found = cache.get(key)
    except TypeError:   # e.g. a list where a tuple was meant
        return build()
    if found is None:
        found = build()
        if len(cache) < _MEMO_LIMIT:
            cache[key] = found
    return found


def describe(name: str, a: Any) -> str:
    """How errors name an argument: ``"x of shape (5, 3, 9, 9) float32"``.

    >>> import numpy as np
    >>> describe("x", np.ones((2, 3), np.float32))
    'x of shape (2, 3) float32'
    """
    dtype = getattr(a, "dtype", None)
    return f"{name} of shape {tuple(a.shape)}" + (f" {dtype}" if dtype is not None else "")


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _pair(op, name, value, minimum=1):
    """``value`` (an int or a pair of ints, each >= minimum) as a pair."""
    pair = (value, value) if _is_int(value) else tuple(value) if isinstance(value, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(_is_int(v) and v >= minimum for v in pair):
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{op} expects {name} to be a {kind} int or a pair of them, got {value!r}")
    return tuple(int(v) for v in pair)


def _same_pad(size, kernel, stride):
    """TensorFlow's SAME split for one axis: the least padding giving ceil(size / stride) outputs,
    the odd pixel at the end (bottom/right), as TF and PyTorch's ``padding="same"`` do."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _pad4(op, pad, hw, kernel, stride):
    """``pad`` (int, pair, 4-tuple or "same") as ``(top, bottom, left, right)``.

    ``kernel`` is the effective (dilated) kernel size, used only for "same".
    """
    if isinstance(pad, str) and pad == "same":
        return _same_pad(hw[0], kernel[0], stride[0]) + _same_pad(hw[1], kernel[1], stride[1])
    if _is_int(pad):
        values = (pad,) * 4
    elif isinstance(pad, (tuple, list)) and len(pad) == 2:
        values = (pad[0], pad[0], pad[1], pad[1])
    elif isinstance(pad, (tuple, list)) and len(pad) == 4:
        values = tuple(pad)
    else:
        values = None
    if values is None or not all(_is_int(v) and v >= 0 for v in values):
        raise ValueError(f"{op} expects pad to be a non-negative int, a pair (ph, pw), a 4-tuple "
                         f"(top, bottom, left, right) or \"same\", got {pad!r}")
    return tuple(int(v) for v in values)


def _check_4d(op, name, a, layout):
    if not hasattr(a, "shape"):
        raise TypeError(f"{op} expects {name} to be an array {layout}, got a {type(a).__name__}")
    if len(a.shape) != 4:
        raise ValueError(f"{op} expects {name} of 4 dimensions {layout}, got {describe(name, a)}")


def _out_size(padded, kernel, stride):
    return (padded - kernel) // stride + 1


class _Padded:
    """``padded_hw`` for dims that hold ``x_shape`` (N, C, H, W) and ``pad`` (top, bottom, left, right)."""

    @property
    def padded_hw(self) -> tuple[int, int]:
        """The padded input's height and width, ``(H + top + bottom, W + left + right)``."""
        t, b, l, r = self.pad
        return self.x_shape[2] + t + b, self.x_shape[3] + l + r


@dataclass(frozen=True)
class ConvDims(_Padded):
    """The geometry of ``conv(x, w)`` (NNlib's ``DenseConvDims``), built by :meth:`from_arrays`.

    ``x`` is ``(N, C, H, W)``, ``w`` is
    ``(K, C/groups, R, S)``, the output ``y_shape`` is ``(N, K, P, Q)`` with
    ``P = (H + top + bottom - dilation_h*(R-1) - 1) // stride_h + 1`` (``Q`` likewise).

    Keywords (defaults ``stride=1, pad=0, dilation=1, groups=1, flipped=False``): ``stride`` and
    ``dilation``, an int or a pair; ``pad``, an int, a pair ``(ph, pw)``,
    a 4-tuple ``(top, bottom, left, right)`` or ``"same"`` (output ``ceil(H / stride)``, padding
    split as TensorFlow's SAME, the odd pixel at the bottom/right); ``groups`` divides ``C`` and
    ``K``; ``flipped=False`` is true convolution (the kernel is flipped, as Flux's ``Conv``),
    ``flipped=True`` is cross-correlation (PyTorch's ``conv2d``, Flux's ``CrossCor``).

    Fields hold plain tuples: ``x_shape, w_shape, stride, pad`` (4 values), ``dilation, groups,
    flipped``.

    >>> import numpy as np
    >>> cd = ConvDims.from_arrays(np.ones((5, 4, 9, 9)), np.ones((6, 2, 3, 3)), groups=2, dilation=2)
    >>> cd.y_shape, cd.padded_hw, cd.kernel_hw
    ((5, 6, 5, 5), (9, 9), (3, 3))
    >>> ConvDims.from_arrays(np.ones((5, 3, 9, 9)), np.ones((6, 2, 3, 3)), groups=2)
    Traceback (most recent call last):
    ...
    ValueError: conv expects x.shape[1] == w.shape[1] * groups == 4, got x of shape (5, 3, 9, 9) float64
    """
    x_shape: tuple
    w_shape: tuple
    stride: tuple = (1, 1)
    pad: tuple = (0, 0, 0, 0)
    dilation: tuple = (1, 1)
    groups: int = 1
    flipped: bool = False

    @classmethod
    def from_arrays(cls, x: Any, w: Any, *, stride: int | tuple[int, int] = 1, pad: int | tuple[int, ...] | str = 0,
                    dilation: int | tuple[int, int] = 1, groups: int = 1, flipped: bool = False,
                    op: str = "conv") -> ConvDims:
        """Validate ``x``, ``w`` (anything with ``.shape`` and ``.dtype``) and the options; see the class.

        ``op`` is the name that errors give (``"conv"``; a layer or ``conv_transpose`` passes its own).
        """
        _check_4d(op, "x", x, "(N, C, H, W)")
        _check_4d(op, "w", w, "(K, C/groups, R, S)")
        xd, wd = np.dtype(x.dtype), np.dtype(w.dtype)
        if xd != wd or xd.kind != "f":
            raise TypeError(f"{op} expects x and w of the same floating-point dtype, got x {xd} and w {wd}")
        return cls._validated(op, x, w, stride, pad, dilation, groups, flipped)

    @classmethod
    def from_shapes(cls, x_shape: tuple[int, ...], w_shape: tuple[int, ...], *, stride: int | tuple[int, int] = 1,
                    pad: int | tuple[int, ...] | str = 0, dilation: int | tuple[int, int] = 1, groups: int = 1,
                    flipped: bool = False, op: str = "conv") -> ConvDims:
        """As :meth:`from_arrays`, from shapes alone (no dtype check).

        >>> ConvDims.from_shapes((1, 1, 4, 4), (1, 1, 2, 2), pad=(0, 1, 0, 1)).y_shape
        (1, 1, 4, 4)
        """
        x, w = _Shaped(tuple(x_shape)), _Shaped(tuple(w_shape))
        _check_4d(op, "x", x, "(N, C, H, W)")
        _check_4d(op, "w", w, "(K, C/groups, R, S)")
        return cls._validated(op, x, w, stride, pad, dilation, groups, flipped)

    @classmethod
    def _validated(cls, op, x, w, stride, pad, dilation, groups, flipped):
        stride = _pair(op, "stride", stride)
        dilation = _pair(op, "dilation", dilation)
        if not _is_int(groups) or groups < 1:
            raise ValueError(f"{op} expects groups to be a positive int, got {groups!r}")
        groups = int(groups)
        (_, c, h, wd), (k, cg, r, s) = tuple(x.shape), tuple(w.shape)
        if min(r, s, k, cg) < 1:
            raise ValueError(f"{op} expects a non-empty kernel, got {describe('w', w)}")
        if k % groups:
            raise ValueError(f"{op} expects w.shape[0] (output channels) to be divisible by groups == {groups}, "
                             f"got {describe('w', w)}")
        if c != cg * groups:
            raise ValueError(f"{op} expects x.shape[1] == w.shape[1] * groups == {cg * groups}, "
                             f"got {describe('x', x)}")
        dilated = (dilation[0] * (r - 1) + 1, dilation[1] * (s - 1) + 1)
        pad = _pad4(op, pad, (h, wd), dilated, stride)
        padded = (h + pad[0] + pad[1], wd + pad[2] + pad[3])
        if padded[0] < dilated[0] or padded[1] < dilated[1]:
            raise ValueError(f"{op} expects the padded input {padded} to be at least the dilated kernel {dilated} "
                             f"(H + pad and W + pad versus dilation * (kernel - 1) + 1), got {describe('x', x)}, "
                             f"{describe('w', w)}, pad {pad} and dilation {dilation}")
        return cls(tuple(int(v) for v in x.shape), tuple(int(v) for v in w.shape), stride, pad, dilation, groups,
                   bool(flipped))

    @property
    def kernel_hw(self) -> tuple[int, int]:
        """``(R, S)``, the kernel's height and width."""
        return self.w_shape[2:]

    @property
    def dilated_kernel_hw(self) -> tuple[int, int]:
        """``dilation * (kernel - 1) + 1`` per axis: the span of one window."""
        return tuple(d * (k - 1) + 1 for d, k in zip(self.dilation, self.kernel_hw))

    @property
    def out_hw(self) -> tuple[int, int]:
        """``(P, Q)``, the output's height and width."""
        return tuple(_out_size(p, k, s) for p, k, s in zip(self.padded_hw, self.dilated_kernel_hw, self.stride))

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        """``(N, K, P, Q)``, the shape of ``conv(x, w)``."""
        return (self.x_shape[0], self.w_shape[0]) + self.out_hw

    def check_y(self, op: str, dy: Any) -> None:
        """Raise unless ``dy`` has the output shape (for the backward kernels)."""
        if tuple(dy.shape) != self.y_shape:
            raise ValueError(f"{op} expects dy of shape {self.y_shape} (the conv output), got {describe('dy', dy)}")

    def check_x(self, op: str, x: Any) -> None:
        """Raise unless ``x`` has the input shape."""
        if tuple(x.shape) != self.x_shape:
            raise ValueError(f"{op} expects x of shape {self.x_shape}, got {describe('x', x)}")

    def check_w(self, op: str, w: Any) -> None:
        """Raise unless ``w`` has the weight shape."""
        if tuple(w.shape) != self.w_shape:
            raise ValueError(f"{op} expects w of shape {self.w_shape}, got {describe('w', w)}")


class _Shaped:
    """A stand-in with only a shape, so shape-only validation shares the array path."""
    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = shape


@dataclass(frozen=True)
class PoolDims(_Padded):
    """The geometry of a pooling, built by :meth:`from_array`.

    ``kernel`` and ``stride`` are ints or pairs (``stride`` defaults to ``kernel``); ``pad`` is an
    int, a pair, a 4-tuple ``(top, bottom, left, right)`` or ``"same"``, and must be smaller than
    the kernel on every side so that each window holds at least one pixel of ``x``.
    ``y_shape`` is ``(N, C, P, Q)`` with ``P = (H + top + bottom - R) // stride_h + 1``.

    >>> import numpy as np
    >>> PoolDims.from_array(np.ones((2, 3, 7, 7)), 2).y_shape
    (2, 3, 3, 3)
    >>> PoolDims.from_array(np.ones((2, 3, 7, 7)), 3, stride=1, pad=1).y_shape
    (2, 3, 7, 7)
    """
    x_shape: tuple
    kernel: tuple
    stride: tuple
    pad: tuple

    adaptive = False

    @classmethod
    def from_array(cls, x: Any, kernel: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
                   pad: int | tuple[int, ...] | str = 0, op: str = "maxpool") -> PoolDims:
        """Validate ``x`` (anything with ``.shape``) and the options; see the class. ``op`` names errors."""
        _check_4d(op, "x", x, "(N, C, H, W)")
        kernel = _pair(op, "kernel", kernel)
        stride = kernel if stride is None else _pair(op, "stride", stride)
        hw = tuple(x.shape[2:])
        pad = _pad4(op, pad, hw, kernel, stride)
        if max(pad[0], pad[1]) >= kernel[0] or max(pad[2], pad[3]) >= kernel[1]:
            raise ValueError(f"{op} expects pad smaller than the kernel {kernel} on every side, got pad {pad}")
        padded = (hw[0] + pad[0] + pad[1], hw[1] + pad[2] + pad[3])
        if padded[0] < kernel[0] or padded[1] < kernel[1]:
            raise ValueError(f"{op} expects the padded input {padded} to be at least the kernel {kernel}, "
                             f"got {describe('x', x)} and pad {pad}")
        return cls(tuple(int(v) for v in x.shape), kernel, stride, pad)

    @property
    def out_hw(self) -> tuple[int, int]:
        """``(P, Q)``, the output's height and width."""
        return tuple(_out_size(p, k, s) for p, k, s in zip(self.padded_hw, self.kernel, self.stride))

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        """``(N, C, P, Q)``, the pool's output shape."""
        return tuple(self.x_shape[:2]) + self.out_hw

    def window_rows(self) -> np.ndarray:
        """``(P, R)`` array: the padded-image row of each window's each kernel row."""
        return _regular_windows(self.out_hw[0], self.kernel[0], self.stride[0])

    def window_cols(self) -> np.ndarray:
        """``(Q, S)`` array: the padded-image column of each window's each kernel column."""
        return _regular_windows(self.out_hw[1], self.kernel[1], self.stride[1])


def _regular_windows(n_out, kernel, stride):
    return np.arange(n_out)[:, None] * stride + np.arange(kernel)[None, :]


def _adaptive_bins(size, n_out):
    """PyTorch's adaptive bins along one axis: start = floor(i*size/n_out), end = ceil((i+1)*size/n_out)."""
    i = np.arange(n_out)
    return (i * size) // n_out, -((-(i + 1) * size) // n_out)


@dataclass(frozen=True)
class AdaptivePoolDims:
    """The geometry of an adaptive pooling: bins giving an ``(N, C, *out_hw)`` output, built by :meth:`from_array`.

    Bin ``i`` of an axis of size ``H`` with ``P`` outputs spans ``floor(i*H/P)`` to ``ceil((i+1)*H/P)``
    (PyTorch's rule); bins may overlap and differ in size. No padding. ``window_rows`` lists the rows
    of each bin, the short ones repeating their last row.

    >>> import numpy as np
    >>> d = AdaptivePoolDims.from_array(np.ones((1, 1, 5, 4)), (3, 2))
    >>> d.y_shape, d.window_rows().tolist()
    ((1, 1, 3, 2), [[0, 1, 1], [1, 2, 3], [3, 4, 4]])
    """
    x_shape: tuple
    out_hw: tuple

    pad = (0, 0, 0, 0)
    adaptive = True

    @classmethod
    def from_array(cls, x: Any, out_hw: int | tuple[int, int], op: str = "adaptive_maxpool") -> AdaptivePoolDims:
        """Validate ``x`` and ``out_hw`` (an int or a pair); see the class. ``op`` names errors."""
        _check_4d(op, "x", x, "(N, C, H, W)")
        out_hw = _pair(op, "the output size", out_hw)
        hw = tuple(x.shape[2:])
        if min(hw) < 1:
            raise ValueError(f"{op} expects a non-empty image, got {describe('x', x)}")
        return cls(tuple(int(v) for v in x.shape), out_hw)

    @property
    def padded_hw(self) -> tuple[int, int]:
        """``(H, W)``: adaptive pools do not pad."""
        return tuple(self.x_shape[2:])

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        """The output shape, ``(N, C, *out_hw)``."""
        return tuple(self.x_shape[:2]) + self.out_hw

    @property
    def kernel(self) -> tuple[int, int]:
        """The largest bin, ``(Lh, Lw)``: the window size the kernels gather."""
        return tuple(int((e - s).max()) for s, e in map(_adaptive_bins, self.x_shape[2:], self.out_hw))

    def window_rows(self) -> np.ndarray:
        """``(P, Lh)`` array of rows per bin; short bins repeat their last row (harmless for a max)."""
        return _padded_bins(self.x_shape[2], self.out_hw[0])

    def window_cols(self) -> np.ndarray:
        """``(Q, Lw)`` array of columns per bin, as :meth:`window_rows`."""
        return _padded_bins(self.x_shape[3], self.out_hw[1])

    def averaging_matrices(self) -> tuple[np.ndarray, np.ndarray]:
        """``(A_h, A_w)`` of shapes ``(P, H)`` and ``(Q, W)``: ``y = A_h @ x @ A_w.T`` is the adaptive mean."""
        return tuple(_averaging_matrix(size, n) for size, n in zip(self.x_shape[2:], self.out_hw))


def _padded_bins(size, n_out):
    start, end = _adaptive_bins(size, n_out)
    longest = int((end - start).max())
    return np.minimum(start[:, None] + np.arange(longest)[None, :], end[:, None] - 1)


def _averaging_matrix(size, n_out):
    start, end = _adaptive_bins(size, n_out)
    cols = np.arange(size)[None, :]
    inside = (cols >= start[:, None]) & (cols < end[:, None])
    return inside / (end - start)[:, None]
