"""Convolution and pooling geometry: :class:`ConvDims`, :class:`PoolDims`, :class:`AdaptivePoolDims`.

Each is a frozen dataclass (NNlib's ``DenseConvDims``/``PoolDims``) built once per call from the
array shapes and the keyword options. It expands ints to tuples, resolves ``pad="same"``,
validates everything with errors that name the op and say what was expected and what was
got, and computes the output shape. The CPU kernels, a GPU backend's descriptors and the
backward kernels all read the same object. It is a plain argument: it never goes on the tape.

Layout is NCHW and its relatives in 1 and 3 spatial dimensions: ``x`` is ``(N, C, L)``, ``(N, C, H, W)`` or
``(N, C, D, H, W)``, a convolution weight ``(K, C/groups, *kernel)`` with one kernel size per spatial axis. Options
given per axis (``stride``, ``dilation``, a kernel) are an int or a tuple of one int per spatial axis; padding is a
tuple of ``(before, after)`` pairs in axis order: ``(top, bottom, left, right)`` in 2-d, ``(left, right)`` in 1-d,
``(front, back, top, bottom, left, right)`` in 3-d. Properties named ``*_hw`` hold one value per spatial axis.

>>> import numpy as np
>>> cd = ConvDims.from_arrays(np.ones((2, 3, 9, 9)), np.ones((4, 3, 3, 3)), stride=2, pad="same")
>>> cd.pad, cd.y_shape
((1, 1, 1, 1), (2, 4, 5, 5))
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

__all__ = ["ConvDims", "PoolDims", "AdaptivePoolDims", "describe", "memoised", "ntuple", "pad_widths",
           "spatial_layout"]

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


_TUPLE_WORDS = {1: "1-tuple", 2: "pair", 3: "triple"}
_PAD_WORDS = {1: "a 1-tuple (p,), a pair (left, right)",
              2: "a pair (ph, pw), a 4-tuple (top, bottom, left, right)",
              3: "a triple (pd, ph, pw), a 6-tuple (front, back, top, bottom, left, right)"}
_X_LAYOUTS = {1: "(N, C, L)", 2: "(N, C, H, W)", 3: "(N, C, D, H, W)"}
_W_LAYOUTS = {1: "(K, C/groups, S)", 2: "(K, C/groups, R, S)", 3: "(K, C/groups, T, R, S)"}


def spatial_layout(n: int, weight: bool = False) -> str:
    """How errors spell the layout of an input (or, with ``weight``, a conv weight) of ``n`` spatial axes.

    >>> spatial_layout(1), spatial_layout(3, weight=True)
    ('(N, C, L)', '(K, C/groups, T, R, S)')
    """
    return (_W_LAYOUTS if weight else _X_LAYOUTS)[n]


def _fail_option(op, name, what, value, layer):
    """Raise the ValueError of a bad option: ``op expects name to be what`` (ops), ``op: name must be what``
    (``layer``: a layer's constructor)."""
    if layer:
        raise ValueError(f"{op}: {name} must be {what}, got {value!r}")
    raise ValueError(f"{op} expects {name} to be {what}, got {value!r}")


def ntuple(op: str, name: str, value: Any, n: int, minimum: int = 1, layer: bool = False) -> tuple:
    """``value`` (an int, or a tuple of ``n`` ints, each ``>= minimum``) as an ``n``-tuple; a ``ValueError``
    naming ``op`` otherwise (worded for a layer's constructor with ``layer=True``).

    >>> ntuple("conv", "stride", 2, 3)
    (2, 2, 2)
    >>> ntuple("conv", "stride", (1, 0), 2)
    Traceback (most recent call last):
    ...
    ValueError: conv expects stride to be a positive int or a pair of them, got (1, 0)
    """
    t = (value,) * n if _is_int(value) else tuple(value) if isinstance(value, (tuple, list)) else None
    if t is None or len(t) != n or not all(_is_int(v) and v >= minimum for v in t):
        kind = "positive" if minimum == 1 else "non-negative"
        _fail_option(op, name, f"a {kind} int or a {_TUPLE_WORDS.get(n, f'{n}-tuple')} of them", value, layer)
    return tuple(int(v) for v in t)


def pad_widths(op: str, pad: Any, n: int, layer: bool = False) -> tuple:
    """``pad`` (an int, an ``n``-tuple, one per axis, or a ``2n``-tuple of ``(before, after)`` pairs) as the
    ``2n``-tuple; "same" is resolved by the dims classes, which know the sizes.

    >>> pad_widths("conv", (1, 2), 2), pad_widths("conv", (1, 2), 1)
    ((1, 1, 2, 2), (1, 2))
    """
    if _is_int(pad):
        values = (pad,) * (2 * n)
    elif isinstance(pad, (tuple, list)) and len(pad) == n:
        values = tuple(v for v in pad for _ in range(2))
    elif isinstance(pad, (tuple, list)) and len(pad) == 2 * n:
        values = tuple(pad)
    else:
        values = None
    if values is None or not all(_is_int(v) and v >= 0 for v in values):
        _fail_option(op, "pad", f"a non-negative int, {_PAD_WORDS[n]} or \"same\"", pad, layer)
    return tuple(int(v) for v in values)


def _same_pad(size, kernel, stride):
    """TensorFlow's SAME split for one axis: the least padding giving ceil(size / stride) outputs,
    the odd pixel at the end (bottom/right), as TF and PyTorch's ``padding="same"`` do."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _expand_pad(op, pad, sizes, kernel, stride):
    """``pad`` (see :func:`pad_widths`, or "same") as ``(before, after)`` per spatial axis, flattened.

    ``kernel`` is the effective (dilated) kernel size, used only for "same".
    """
    if isinstance(pad, str) and pad == "same":
        return tuple(v for args in zip(sizes, kernel, stride) for v in _same_pad(*args))
    return pad_widths(op, pad, len(sizes))


def _check_spatial(op, name, a, weight=False, n=None, transposed=False):
    """Raise unless ``a`` is an array of ``n + 2`` axes (of 3, 4 or 5 where ``n`` is None); ``weight``: a conv
    weight's layout in the message (``transposed``: conv_transpose's, ``(C_in, C_out/groups, ...)``)."""
    layout = _X_LAYOUTS.get(n, "(N, C, *spatial)") if not weight else _W_LAYOUTS.get(n, "(K, C/groups, *kernel)")
    if transposed:
        layout = layout.replace("K, C/groups", "C_in, C_out/groups")
    if not hasattr(a, "shape"):
        raise TypeError(f"{op} expects {name} to be an array {layout}, got a {type(a).__name__}")
    if n is None and len(a.shape) not in (3, 4, 5):
        raise ValueError(f"{op} expects {name} of 3, 4 or 5 dimensions {layout} (1, 2 or 3 spatial axes), "
                         f"got {describe(name, a)}")
    if n is not None and len(a.shape) != n + 2:
        raise ValueError(f"{op} expects {name} of {n + 2} dimensions {layout}, got {describe(name, a)}")


def _out_size(padded, kernel, stride):
    return (padded - kernel) // stride + 1


class _Padded:
    """``padded_hw`` and ``spatial`` for dims that hold ``x_shape`` (N, C, *spatial) and ``pad``, a
    ``(before, after)`` pair per spatial axis."""

    @cached_property
    def spatial(self) -> int:
        """The number of spatial axes, 1, 2 or 3."""
        return len(self.x_shape) - 2

    @cached_property
    def padded_hw(self) -> tuple[int, ...]:
        """The padded input's size per spatial axis, ``(H + top + bottom, W + left + right)`` in 2-d."""
        p = self.pad
        return tuple(size + p[2 * i] + p[2 * i + 1] for i, size in enumerate(self.x_shape[2:]))


@dataclass(frozen=True)
class ConvDims(_Padded):
    """The geometry of ``conv(x, w)`` (NNlib's ``DenseConvDims``) in 1, 2 or 3 spatial dimensions, built by
    :meth:`from_arrays`.

    ``x`` is ``(N, C, *spatial)`` (``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``), ``w`` is
    ``(K, C/groups, *kernel)`` with as many spatial axes, the output ``y_shape`` is ``(N, K, *out)`` with, per axis,
    ``out = (size + before + after - dilation*(kernel-1) - 1) // stride + 1``.

    Keywords (defaults ``stride=1, pad=0, dilation=1, groups=1, flipped=False``): ``stride`` and
    ``dilation``, an int or one per spatial axis; ``pad``, an int, one per axis (``(ph, pw)`` in 2-d), a
    ``(before, after)`` pair per axis (``(top, bottom, left, right)`` in 2-d) or ``"same"`` (output
    ``ceil(size / stride)``, padding split as TensorFlow's SAME, the odd pixel at the end); ``groups`` divides ``C``
    and ``K``; ``flipped=False`` is true convolution (the kernel is flipped, as Flux's ``Conv``),
    ``flipped=True`` is cross-correlation (PyTorch's ``conv2d``, Flux's ``CrossCor``).

    Fields hold plain tuples: ``x_shape, w_shape, stride, pad`` (2 values per axis), ``dilation, groups,
    flipped``.

    >>> import numpy as np
    >>> cd = ConvDims.from_arrays(np.ones((5, 4, 9, 9)), np.ones((6, 2, 3, 3)), groups=2, dilation=2)
    >>> cd.y_shape, cd.padded_hw, cd.kernel_hw
    ((5, 6, 5, 5), (9, 9), (3, 3))
    >>> ConvDims.from_arrays(np.ones((1, 2, 8, 9, 9)), np.ones((3, 2, 2, 3, 3)), stride=(2, 1, 1), pad=1).y_shape
    (1, 3, 5, 9, 9)
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
    def from_arrays(cls, x: Any, w: Any, *, stride: int | tuple[int, ...] = 1, pad: int | tuple[int, ...] | str = 0,
                    dilation: int | tuple[int, ...] = 1, groups: int = 1, flipped: bool = False,
                    op: str = "conv") -> ConvDims:
        """Validate ``x``, ``w`` (anything with ``.shape`` and ``.dtype``) and the options; see the class.

        ``op`` is the name that errors give (``"conv"``; a layer or ``conv_transpose`` passes its own).
        """
        _check_conv_arrays(op, x, w)
        xd, wd = np.dtype(x.dtype), np.dtype(w.dtype)
        if xd != wd or xd.kind != "f":
            raise TypeError(f"{op} expects x and w of the same floating-point dtype, got x {xd} and w {wd}")
        return cls._validated(op, x, w, stride, pad, dilation, groups, flipped)

    @classmethod
    def from_shapes(cls, x_shape: tuple[int, ...], w_shape: tuple[int, ...], *, stride: int | tuple[int, ...] = 1,
                    pad: int | tuple[int, ...] | str = 0, dilation: int | tuple[int, ...] = 1, groups: int = 1,
                    flipped: bool = False, op: str = "conv") -> ConvDims:
        """As :meth:`from_arrays`, from shapes alone (no dtype check).

        >>> ConvDims.from_shapes((1, 1, 4, 4), (1, 1, 2, 2), pad=(0, 1, 0, 1)).y_shape
        (1, 1, 4, 4)
        >>> ConvDims.from_shapes((1, 1, 7), (1, 1, 3), stride=2, pad=(1, 0)).y_shape
        (1, 1, 3)
        """
        x, w = _Shaped(tuple(x_shape)), _Shaped(tuple(w_shape))
        _check_conv_arrays(op, x, w)
        return cls._validated(op, x, w, stride, pad, dilation, groups, flipped)

    @classmethod
    def _validated(cls, op, x, w, stride, pad, dilation, groups, flipped):
        n = len(x.shape) - 2
        stride = ntuple(op, "stride", stride, n)
        dilation = ntuple(op, "dilation", dilation, n)
        if not _is_int(groups) or groups < 1:
            raise ValueError(f"{op} expects groups to be a positive int, got {groups!r}")
        groups = int(groups)
        c, sizes = x.shape[1], tuple(x.shape[2:])
        k, cg, kernel = w.shape[0], w.shape[1], tuple(w.shape[2:])
        if min(kernel + (k, cg)) < 1:
            raise ValueError(f"{op} expects a non-empty kernel, got {describe('w', w)}")
        if k % groups:
            raise ValueError(f"{op} expects w.shape[0] (output channels) to be divisible by groups == {groups}, "
                             f"got {describe('w', w)}")
        if c != cg * groups:
            raise ValueError(f"{op} expects x.shape[1] == w.shape[1] * groups == {cg * groups}, "
                             f"got {describe('x', x)}")
        dilated = tuple(d * (r - 1) + 1 for d, r in zip(dilation, kernel))
        pad = _expand_pad(op, pad, sizes, dilated, stride)
        padded = tuple(size + pad[2 * i] + pad[2 * i + 1] for i, size in enumerate(sizes))
        if any(p < d for p, d in zip(padded, dilated)):
            raise ValueError(f"{op} expects the padded input {padded} to be at least the dilated kernel {dilated} "
                             f"(size + pad versus dilation * (kernel - 1) + 1 per axis), got {describe('x', x)}, "
                             f"{describe('w', w)}, pad {pad} and dilation {dilation}")
        return cls(tuple(int(v) for v in x.shape), tuple(int(v) for v in w.shape), stride, pad, dilation, groups,
                   bool(flipped))

    @property
    def kernel_hw(self) -> tuple[int, ...]:
        """The kernel's size per spatial axis, ``(R, S)`` in 2-d."""
        return self.w_shape[2:]

    @cached_property
    def dilated_kernel_hw(self) -> tuple[int, ...]:
        """``dilation * (kernel - 1) + 1`` per axis: the span of one window."""
        return tuple(d * (k - 1) + 1 for d, k in zip(self.dilation, self.kernel_hw))

    @cached_property
    def out_hw(self) -> tuple[int, ...]:
        """The output's size per spatial axis, ``(P, Q)`` in 2-d."""
        return tuple(_out_size(p, k, s) for p, k, s in zip(self.padded_hw, self.dilated_kernel_hw, self.stride))

    @cached_property
    def y_shape(self) -> tuple[int, ...]:
        """``(N, K, *out_hw)``, the shape of ``conv(x, w)``."""
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


def _check_conv_arrays(op, x, w):
    """``x`` of 1, 2 or 3 spatial axes, ``w`` of as many."""
    _check_spatial(op, "x", x)
    _check_spatial(op, "w", w, weight=True, n=len(x.shape) - 2)


class _Shaped:
    """A stand-in with only a shape, so shape-only validation shares the array path."""
    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = shape


@dataclass(frozen=True)
class PoolDims(_Padded):
    """The geometry of a pooling in 1, 2 or 3 spatial dimensions, built by :meth:`from_array`.

    ``kernel`` and ``stride`` are ints or one per spatial axis (``stride`` defaults to ``kernel``); ``pad`` is an
    int, one per axis, a ``(before, after)`` pair per axis (``(top, bottom, left, right)`` in 2-d) or ``"same"``.
    ``y_shape`` is ``(N, C, *out)`` with ``out = (size + before + after - kernel) // stride + 1`` per axis.

    A pad may be as large as or larger than the kernel, as NNlib's ``PoolDims`` allows (PyTorch refuses more than
    half the kernel): some windows then hold padding only (:meth:`empty_windows`), and the pools give them NNlib's
    values (see :func:`fluxpy.ops.pool.maxpool`). The padded input must still be at least the kernel.

    >>> import numpy as np
    >>> PoolDims.from_array(np.ones((2, 3, 7, 7)), 2).y_shape
    (2, 3, 3, 3)
    >>> PoolDims.from_array(np.ones((2, 3, 7, 7)), 3, stride=1, pad=1).y_shape
    (2, 3, 7, 7)
    >>> PoolDims.from_array(np.ones((2, 3, 4, 6, 6)), (2, 3, 3)).y_shape
    (2, 3, 2, 2, 2)
    >>> PoolDims.from_array(np.ones((1, 2, 5, 5)), 2, pad=3).y_shape     # Flux's outputsize.jl:121
    (1, 2, 5, 5)
    """
    x_shape: tuple
    kernel: tuple
    stride: tuple
    pad: tuple

    adaptive = False

    @classmethod
    def from_array(cls, x: Any, kernel: int | tuple[int, ...], stride: int | tuple[int, ...] | None = None,
                   pad: int | tuple[int, ...] | str = 0, op: str = "maxpool") -> PoolDims:
        """Validate ``x`` (anything with ``.shape``) and the options; see the class. ``op`` names errors.

        An int ``kernel`` means one size for each spatial axis of ``x``; a tuple must have one per axis.
        """
        n = _pool_spatial(op, x, kernel)
        kernel = ntuple(op, "kernel", kernel, n)
        stride = kernel if stride is None else ntuple(op, "stride", stride, n)
        sizes = tuple(x.shape[2:])
        pad = _expand_pad(op, pad, sizes, kernel, stride)
        padded = tuple(size + pad[2 * i] + pad[2 * i + 1] for i, size in enumerate(sizes))
        if any(p < k for p, k in zip(padded, kernel)):
            raise ValueError(f"{op} expects the padded input {padded} to be at least the kernel {kernel}, "
                             f"got {describe('x', x)} and pad {pad}")
        return cls(tuple(int(v) for v in x.shape), kernel, stride, pad)

    @cached_property
    def out_hw(self) -> tuple[int, ...]:
        """The output's size per spatial axis, ``(P, Q)`` in 2-d."""
        return tuple(_out_size(p, k, s) for p, k, s in zip(self.padded_hw, self.kernel, self.stride))

    @cached_property
    def y_shape(self) -> tuple[int, ...]:
        """``(N, C, *out_hw)``, the pool's output shape."""
        return tuple(self.x_shape[:2]) + self.out_hw

    @cached_property
    def has_empty_windows(self) -> bool:
        """Whether some window holds padding only (possible only where a pad reaches the kernel's size)."""
        return any(axis.any() for axis in self.empty_windows())

    def empty_windows(self) -> tuple[np.ndarray, ...]:
        """One boolean array per spatial axis, ``(P,)``, ``(Q,)`` in 2-d: true where that axis puts the window
        wholly in the padding. A window is empty where any of its axes says so.

        >>> import numpy as np
        >>> [a.tolist() for a in PoolDims.from_array(np.ones((1, 1, 3, 4)), 2, pad=(2, 0, 0, 0)).empty_windows()]
        [[True, False], [False, False]]
        """
        out = []
        for i, (size, k, s, n) in enumerate(zip(self.x_shape[2:], self.kernel, self.stride, self.out_hw)):
            start = np.arange(n) * s - self.pad[2 * i]     # first row of each window, in unpadded coordinates
            out.append((start + k <= 0) | (start >= size))
        return tuple(out)

    def window_rows(self) -> np.ndarray:
        """``(P, R)`` array: the padded-image row of each window's each kernel row (2-d dims, which the kernels
        take)."""
        return _regular_windows(self.out_hw[0], self.kernel[0], self.stride[0])

    def window_cols(self) -> np.ndarray:
        """``(Q, S)`` array: the padded-image column of each window's each kernel column (2-d dims)."""
        return _regular_windows(self.out_hw[1], self.kernel[1], self.stride[1])


def _pool_spatial(op, x, size):
    """The number of spatial axes of a pooling of ``x``: that of ``x`` (3 to 5 axes), which a tuple ``size``
    (kernel or output size) must match."""
    _check_spatial(op, "x", x)
    n = len(x.shape) - 2
    if isinstance(size, (tuple, list)) and len(size) != n:
        raise ValueError(f"{op} expects x of {len(size) + 2} dimensions "
                         f"{_X_LAYOUTS.get(len(size), '(N, C, *spatial)')} for a window of {len(size)} axes "
                         f"{tuple(size)}, got {describe('x', x)}")
    return n


@lru_cache(maxsize=256)
def _regular_windows(n_out, kernel, stride):
    """Made once per window geometry (a pooling asks for it several times a call, every step); read-only."""
    windows = np.arange(n_out)[:, None] * stride + np.arange(kernel)[None, :]
    windows.setflags(write=False)
    return windows


def _adaptive_bins(size, n_out):
    """PyTorch's adaptive bins along one axis: start = floor(i*size/n_out), end = ceil((i+1)*size/n_out)."""
    i = np.arange(n_out)
    return (i * size) // n_out, -((-(i + 1) * size) // n_out)


@dataclass(frozen=True)
class AdaptivePoolDims:
    """The geometry of an adaptive pooling: bins giving an ``(N, C, *out_hw)`` output, built by :meth:`from_array`
    (1, 2 or 3 spatial axes).

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

    adaptive = True
    has_empty_windows = False   # every bin holds part of the input

    @classmethod
    def from_array(cls, x: Any, out_hw: int | tuple[int, ...], op: str = "adaptive_maxpool") -> AdaptivePoolDims:
        """Validate ``x`` and ``out_hw`` (an int or one per spatial axis); see the class. ``op`` names errors."""
        n = _pool_spatial(op, x, out_hw)
        out_hw = ntuple(op, "the output size", out_hw, n)
        if min(x.shape[2:]) < 1:
            raise ValueError(f"{op} expects a non-empty image, got {describe('x', x)}")
        return cls(tuple(int(v) for v in x.shape), out_hw)

    @property
    def pad(self) -> tuple[int, ...]:
        """No padding: zeros, two per spatial axis."""
        return (0,) * (2 * len(self.out_hw))

    @cached_property
    def padded_hw(self) -> tuple[int, ...]:
        """The input's spatial size: adaptive pools do not pad."""
        return tuple(self.x_shape[2:])

    @cached_property
    def y_shape(self) -> tuple[int, ...]:
        """The output shape, ``(N, C, *out_hw)``."""
        return tuple(self.x_shape[:2]) + self.out_hw

    @property
    def kernel(self) -> tuple[int, ...]:
        """The largest bin per axis, ``(Lh, Lw)`` in 2-d: the window size the kernels gather."""
        return tuple(int((e - s).max()) for s, e in map(_adaptive_bins, self.x_shape[2:], self.out_hw))

    def window_rows(self) -> np.ndarray:
        """``(P, Lh)`` array of rows per bin; short bins repeat their last row (harmless for a max); 2-d dims."""
        return _padded_bins(self.x_shape[2], self.out_hw[0])

    def window_cols(self) -> np.ndarray:
        """``(Q, Lw)`` array of columns per bin, as :meth:`window_rows`."""
        return _padded_bins(self.x_shape[3], self.out_hw[1])

    def averaging_matrices(self) -> tuple[np.ndarray, ...]:
        """One matrix ``(P, H)`` per spatial axis: contracting each axis of ``x`` with its matrix is the adaptive
        mean (``y = A_h @ x @ A_w.T`` in 2-d)."""
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
