"""Sliding patches: :func:`unfold` (PyTorch's ``F.unfold``, im2col) and its adjoint :func:`fold` (``F.fold``).

Both are convolutions with a fixed one-hot kernel, one group per input channel: output channel ``c*k + j`` of
``unfold`` picks kernel position ``j`` (row-major) of channel ``c``, which is PyTorch's order; ``fold`` is the
transposed convolution with the same kernel, so overlapping patches add up. They run through :func:`fluxpy.conv` and
:func:`fluxpy.conv_transpose` (cuDNN on the GPU, captured with the rest of a step) and differentiate as those do. The
kernels are device constants (:func:`fluxpy.ops.constants.device_constant`): a captured step finds them made in its
warm-up.

>>> import numpy as np
>>> x = np.arange(9.0).reshape(1, 1, 3, 3)
>>> cols = unfold(x, 2)
>>> cols[0]
array([[0., 1., 3., 4.],
       [1., 2., 4., 5.],
       [3., 4., 6., 7.],
       [4., 5., 7., 8.]])
>>> fold(cols, (3, 3), 2)[0, 0]      # each pixel times the number of patches it lies in
array([[ 0.,  2.,  2.],
       [ 6., 16., 10.],
       [ 6., 14.,  8.]])
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import Array
from .constants import device_constant
from .conv import conv, conv_transpose
from .shape import reshape

__all__ = ["unfold", "fold"]



def _tuple(who, name, value, n):
    values = (value,) * n if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else tuple(value)
    if len(values) != n or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{who} expects {name} to be an int or {n} ints (one per spatial axis), got {value!r}")
    return tuple(int(v) for v in values)


def _one_hot(channels: int, kernel: tuple) -> np.ndarray:
    """``(channels * k, 1, *kernel)``: filter ``c*k + j`` is 1 at kernel position ``j``."""
    k = math.prod(kernel)
    host = np.zeros((channels * k, k), np.float32)
    host[np.arange(channels * k), np.arange(channels * k) % k] = 1
    return host.reshape((channels * k, 1) + kernel)


def _one_hot_kernel(channels: int, kernel: tuple, like: Any) -> Any:
    """:func:`_one_hot` on ``like``'s device in its dtype, made once (:func:`fluxpy.ops.constants.device_constant`)."""
    return device_constant(("patches_one_hot", channels, kernel), lambda: _one_hot(channels, kernel), like)


def unfold(x: Array, kernel: int | tuple[int, ...], *, stride: int | tuple[int, ...] = 1,
           pad: int | tuple[int, ...] = 0, dilation: int | tuple[int, ...] = 1) -> Array:
    """The patches of ``x`` ``(N, C, *spatial)`` that a convolution with ``kernel`` sees, as columns: ``(N, C*k,
    L)`` with ``k`` the kernel's size and ``L`` the number of output positions (PyTorch's ``F.unfold``, in 1, 2 and
    3 spatial dimensions). ``stride``, ``pad`` and ``dilation`` as :func:`fluxpy.conv`'s (``pad`` symmetric).

    >>> import numpy as np
    >>> unfold(np.ones((2, 3, 5, 5)), 3, stride=2).shape     # 3 channels x 9 kernel positions, 2 x 2 patches
    (2, 27, 4)
    """
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) not in (3, 4, 5):
        raise ValueError(f"unfold expects x of shape (N, C, *spatial) with 1 to 3 spatial axes, got shape {shape}")
    n_sp = len(shape) - 2
    kernel = _tuple("unfold", "kernel", kernel, n_sp)
    w = _one_hot_kernel(shape[1], kernel, x)
    y = conv(x, w, stride=_tuple("unfold", "stride", stride, n_sp), pad=_tuple("unfold", "pad", pad, n_sp),
             dilation=_tuple("unfold", "dilation", dilation, n_sp), groups=shape[1], flipped=True)
    return reshape(y, (shape[0], y.shape[1], math.prod(y.shape[2:])))


def fold(cols: Array, output_size: int | tuple[int, ...], kernel: int | tuple[int, ...], *,
         stride: int | tuple[int, ...] = 1, pad: int | tuple[int, ...] = 0,
         dilation: int | tuple[int, ...] = 1) -> Array:
    """The adjoint of :func:`unfold`: columns ``(N, C*k, L)`` summed back into ``(N, C, *output_size)``, patches
    that overlap adding up (PyTorch's ``F.fold``). ``L`` must be the number of patches :func:`unfold` takes from an
    image of ``output_size`` with these options.

    >>> import numpy as np
    >>> fold(np.ones((1, 4, 4)), (3, 3), 2)[0, 0]            # how many 2 x 2 patches cover each pixel
    array([[1., 2., 1.],
           [2., 4., 2.],
           [1., 2., 1.]])
    """
    shape = tuple(getattr(cols, "shape", ()))
    size = (output_size,) if isinstance(output_size, (int, np.integer)) else tuple(output_size)
    n_sp = len(size)
    if len(shape) != 3 or n_sp not in (1, 2, 3):
        raise ValueError(f"fold expects cols of shape (N, C*k, L) and an output_size of 1 to 3 sizes, got shape "
                         f"{shape} and output_size {output_size!r}")
    size = _tuple("fold", "output_size", size, n_sp)
    kernel, stride = _tuple("fold", "kernel", kernel, n_sp), _tuple("fold", "stride", stride, n_sp)
    pad, dilation = _tuple("fold", "pad", pad, n_sp), _tuple("fold", "dilation", dilation, n_sp)
    k = math.prod(kernel)
    grid = tuple((h + 2 * p - d * (r - 1) - 1) // s + 1 for h, p, d, r, s in zip(size, pad, dilation, kernel, stride))
    if shape[1] % k or shape[2] != math.prod(grid) or min(grid) < 1:
        raise ValueError(f"fold expects cols of shape (N, C*{k}, {math.prod(grid)}) for output_size {size}, kernel "
                         f"{kernel}, stride {stride}, pad {pad}, dilation {dilation}; got shape {shape}")
    channels = shape[1] // k
    w = _one_hot_kernel(channels, kernel, cols)
    extra = tuple(h - ((g - 1) * s - 2 * p + d * (r - 1) + 1)
                  for h, g, s, p, d, r in zip(size, grid, stride, pad, dilation, kernel))
    return conv_transpose(reshape(cols, shape[:2] + grid), w, stride=stride, pad=pad, dilation=dilation,
                          groups=channels, flipped=True, output_padding=extra)
