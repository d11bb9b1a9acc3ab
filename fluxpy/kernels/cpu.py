"""NumPy kernels for convolution and pooling: im2col + one BLAS matmul per group, and windowed pools.

Convolution (NCHW, weight ``(K, C/G, R, S)``, ``G`` groups; 1 and 3 spatial dimensions alike through the same
functions) is computed as cross-correlation on the padded input; true convolution (``cdims.flipped=False``) flips
the kernel first. The pools take 2-d dims (:mod:`fluxpy.ops.pool` runs 1-d and 3-d pools on them).

- ``im2col`` copies the windows of the padded input into columns ``(G, C/G*R*S, N*P*Q')`` from a
  strided view (no Python loop), so the forward pass is one matmul per group,
  ``(K/G, C/G*R*S) @ (C/G*R*S, N*P*Q')`` (``Q'`` is ``Q``, or the padded width for stride 1).
- ``col2im`` is its adjoint: it adds columns back into the padded input, one strided slice per
  kernel offset ``(r, s)`` (``R*S`` vectorised adds, which also handle overlapping windows).
- Pools with small kernels loop over the ``R*S`` kernel offsets too; large ones (global,
  adaptive) gather their windows once. float32 pools run oneDNN's one-pass primitives where it is installed
  (:mod:`fluxpy.kernels.onednn_pool`), with NumPy's results.

Every function here takes plain NumPy arrays and a dims object from :mod:`fluxpy.ops.dims`;
they are registered with :func:`fluxpy.kernels.register` under ``"numpy"``, float16 and bfloat16 computed in
float32 (:func:`halves_in_float32`).

>>> import numpy as np
>>> from fluxpy.ops.dims import ConvDims
>>> x, w = np.arange(16.0).reshape(1, 1, 4, 4), np.ones((1, 1, 2, 2))
>>> conv_forward(x, w, ConvDims.from_arrays(x, w, stride=2))
array([[[[10., 18.],
         [42., 50.]]]])
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..backend import is_float_dtype
from ..options import options
from . import BadIndex, onednn, onednn_pool, register
from .cpu_heap import keep_freed_memory
from .halfs import is_half

__all__ = ["halves_in_float32", "pad_input", "crop_input", "im2col", "col2im", "conv_forward", "conv_backward_data",
           "conv_backward_filter", "conv_bias_act_grads", "maxpool_forward", "maxpool_argmax", "maxpool_backward",
           "maxpool_gather", "meanpool_forward", "meanpool_backward", "conv_bias_act_half", "conv_bias_act_cpu",
           "scatter_empty", "first_bad_index", "along_axis_index", "scatter", "gather", "check_indices"]


# ---------------------------------------------------------------------------------------------
# Padding


def _spatial_slices(pad, sizes):
    """The slices that select the unpadded ``sizes`` inside an array padded by ``pad`` (a ``(before, after)``
    pair per spatial axis), after the two leading axes."""
    return (slice(None), slice(None)) + tuple(slice(pad[2 * i], pad[2 * i] + n) for i, n in enumerate(sizes))


def pad_input(x: np.ndarray, pad: tuple[int, ...], value: float = 0) -> np.ndarray:
    """``x`` (N, C, *spatial) padded with ``value`` by ``pad``, a ``(before, after)`` pair per spatial axis
    (``(top, bottom, left, right)`` in 2-d).

    >>> pad_input(np.ones((1, 1, 1, 2)), (1, 0, 0, 1))[0, 0]
    array([[0., 0., 0.],
           [1., 1., 0.]])
    """
    if not any(pad):
        return x
    sizes = x.shape[2:]
    padded = tuple(n + pad[2 * i] + pad[2 * i + 1] for i, n in enumerate(sizes))
    out = np.full(x.shape[:2] + padded, value, dtype=x.dtype)
    out[_spatial_slices(pad, sizes)] = x
    return out


def crop_input(xp: np.ndarray, pad: tuple[int, ...]) -> np.ndarray:
    """The inverse of :func:`pad_input`: a view of ``xp`` without its padding.

    >>> crop_input(np.ones((1, 1, 3, 4)), (1, 1, 0, 2)).shape
    (1, 1, 1, 2)
    """
    sizes = tuple(n - pad[2 * i] - pad[2 * i + 1] for i, n in enumerate(xp.shape[2:]))
    return xp[_spatial_slices(pad, sizes)]


# ---------------------------------------------------------------------------------------------
# Convolution in 1, 2 or 3 spatial dimensions (written here for 2-d: (H, W), kernel (R, S)), on channel-major
# copies: (C, N, H, W) makes every column block of im2col a plain strided copy and lets one matmul per group cover
# the whole batch, which BLAS runs far faster than one small matmul per image.
#
# The columns hold one entry per point (n, p, q) of a grid at least as large as the output. The forward's grid
# (_grid) is the output, but Q' wide along the last axis: Q in general; the padded width Wp when the stride along
# that axis is 1, so that each row of windows is one contiguous run of the padded input, several times faster to
# copy (im2col) and to add back (col2im), at the price of Wp - Q garbage columns per row, which the forward drops
# and the backward feeds zeros. The backward's grid (_backward_grid), where every stride is 1 and the padding
# small, is the whole padded input: the columns of one channel and kernel offset are then one contiguous run over
# all images, which col2im adds back as a plain stream (the garbage rows cost the products a little more work).
# Reads past the end of the last image land in slack elements after the buffer.


def _grid_width(cdims):
    """Q', the number of column entries per output row (see above)."""
    q, wp = cdims.out_hw[-1], cdims.padded_hw[-1]
    return wp if cdims.stride[-1] == 1 and 2 * (wp - q) <= q else q


def _grid(cdims):
    """The forward's grid per spatial axis: the output size, the last axis ``Q'`` wide."""
    return cdims.out_hw[:-1] + (_grid_width(cdims),)


def _backward_grid(cdims):
    """The gradients' grid per spatial axis: the whole padded input where every stride is 1 and it holds at most
    30% more points than the output (measured: a larger share of garbage costs the products more than the stream
    saves), else :func:`_grid`."""
    whole = tuple(cdims.padded_hw)
    if all(s == 1 for s in cdims.stride) and math.prod(whole) <= 1.3 * math.prod(cdims.out_hw):
        return whole
    return _grid(cdims)


def _channel_major_buffer(cdims, dtype):
    """Zeros ``(C, N, *padded)`` followed by the slack that a grid wider than the output reads past the end."""
    n, c = cdims.x_shape[:2]
    padded = cdims.padded_hw
    size = c * n * math.prod(padded)
    slack = sum((k - 1) * d * math.prod(padded[i + 1:])
                for i, (k, d) in enumerate(zip(cdims.kernel_hw, cdims.dilation)))
    return np.zeros(size + slack, dtype=dtype)[:size].reshape((c, n) + padded)


def _grid_view(xcn, cdims, grid, offset=None):
    """A strided view of the channel-major buffer ``xcn`` (C, N, *padded) over ``grid``.

    Without ``offset``: ``(C, *kernel, N, *grid)``, in 2-d entry ``[c, r, s, n, p, q]`` being
    ``xcn[c, n, p*stride_h + r*dilation_h, q*stride_w + s*dilation_w]`` (im2col's windows).
    With a kernel offset (``(r, s)`` in 2-d): ``(C, N, *grid)`` at that offset (col2im's targets).
    """
    bc, bn, *bs = xcn.strides
    c, n = xcn.shape[:2]
    steps = tuple(b * s for b, s in zip(bs, cdims.stride))
    if offset is None:
        taps = tuple(b * d for b, d in zip(bs, cdims.dilation))
        return as_strided(xcn, shape=(c,) + cdims.kernel_hw + (n,) + grid, strides=(bc,) + taps + (bn,) + steps,
                          writeable=False)
    start = xcn[(slice(None), slice(None)) + tuple(slice(o * d, None) for o, d in zip(offset, cdims.dilation))]
    return as_strided(start, shape=(c, n) + grid, strides=(bc, bn) + steps)


def _channel_major(a):
    """``a`` (N, C, *spatial) as ``(C, N, *spatial)`` (a view)."""
    return a.transpose((1, 0) + tuple(range(2, a.ndim)))


def im2col(x: np.ndarray, cdims: Any, grid: tuple[int, ...] | None = None) -> np.ndarray:
    """The columns ``(G, C/G*R*S, N*P*Q')`` of the padded ``x`` (N, C, H, W), so that ``y = w @ cols``; in 1-d and
    3-d the kernel and output sizes of every spatial axis multiply likewise. ``grid``: the points per spatial axis
    (default: the forward's, ``(P, Q')``; see the comment above).

    >>> from fluxpy.ops.dims import ConvDims
    >>> x = np.arange(9.0).reshape(1, 1, 3, 3)
    >>> im2col(x, ConvDims.from_shapes(x.shape, (1, 1, 2, 2), stride=(1, 2)))[0]
    array([[0., 3.],
           [1., 4.],
           [3., 6.],
           [4., 7.]])
    """
    n, c = x.shape[:2]
    grid = _grid(cdims) if grid is None else grid
    xcn = _channel_major_buffer(cdims, x.dtype)
    xcn[_spatial_slices(cdims.pad, x.shape[2:])] = _channel_major(x)
    view = _grid_view(xcn, cdims, grid)
    g = cdims.groups
    return view.reshape(g, (c // g) * math.prod(cdims.kernel_hw), n * math.prod(grid))


def col2im(cols: np.ndarray, cdims: Any, grid: tuple[int, ...] | None = None) -> np.ndarray:
    """The adjoint of :func:`im2col` (over the same ``grid``): columns summed back into ``(N, C, *spatial)``.

    >>> from fluxpy.ops.dims import ConvDims
    >>> cd = ConvDims.from_shapes((1, 1, 3, 3), (1, 1, 2, 2), stride=(1, 2))
    >>> col2im(np.ones((1, 4, 2)), cd)[0, 0]   # how many windows cover each pixel
    array([[1., 1., 0.],
           [2., 2., 0.],
           [1., 1., 0.]])
    """
    n, c = cdims.x_shape[:2]
    kernel = cdims.kernel_hw
    grid = _grid(cdims) if grid is None else grid
    cols = cols.reshape((c,) + kernel + (n,) + grid)
    dxcn = _channel_major_buffer(cdims, cols.dtype)
    for offset in itertools.product(*map(range, kernel)):
        target = _grid_view(dxcn, cdims, grid, offset)
        target += cols[(slice(None),) + offset]
    return np.ascontiguousarray(_channel_major(dxcn[_spatial_slices(cdims.pad, cdims.x_shape[2:])]))


def _unflipped(w, cdims):
    """``w`` with its spatial axes reversed for true convolution (``cdims.flipped`` False), so all maths is
    cross-correlation; ``w`` itself otherwise."""
    if cdims.flipped:
        return w
    return w[(slice(None), slice(None)) + (slice(None, None, -1),) * (w.ndim - 2)]


def _weight_matrix(w, cdims):
    """``w`` as ``(G, K/G, C/G*R*S)``, flipped for true convolution so all maths is cross-correlation."""
    w = _unflipped(w, cdims)
    g = cdims.groups
    return w.reshape(g, w.shape[0] // g, w[0].size)


def _channel_major_dy(dy, cdims, grid, mask=None):
    """``dy`` (N, K, *out) as ``(G, K/G, N*prod(grid))``, zeros at the grid points outside the output; with a
    boolean ``mask`` of ``dy``'s shape, ``dy * mask``. (The product is taken before the transposing copy: NumPy runs
    one ufunc over operands of different layouts four times slower than the two passes.)"""
    n, k = dy.shape[:2]
    out_hw = dy.shape[2:]
    out = (np.zeros if tuple(grid) != out_hw else np.empty)((k, n) + tuple(grid), dtype=dy.dtype)
    inside = out[(slice(None), slice(None)) + tuple(slice(0, m) for m in out_hw)]
    inside[...] = _channel_major(dy if mask is None else dy * mask)
    g = cdims.groups
    return out.reshape(g, k // g, out[0].size)


def conv_forward(x: np.ndarray, w: np.ndarray, cdims: Any) -> np.ndarray:
    """The convolution ``y`` of shape ``cdims.y_shape``, as ``w @ im2col(x)``.

    ``y[n, k, p, q] = sum_{c, r, s} w[k, c, r, s] * xpad[n, c, p*sh + r*dh, q*sw + s*dw]``, the kernel
    flipped unless ``cdims.flipped`` and ``c`` running over the group of ``k`` (see the module example); 1-d and 3-d
    likewise.
    """
    if onednn.takes(x, w):
        return onednn.conv_forward(x, _unflipped(w, cdims), cdims)
    n, k = cdims.y_shape[:2]
    y = np.matmul(_weight_matrix(w, cdims), im2col(x, cdims, _grid(cdims)))     # (G, K/G, N*P*Q')
    y = y.reshape((k, n) + _grid(cdims))[..., :cdims.out_hw[-1]]
    return np.ascontiguousarray(_channel_major(y))


def conv_backward_data(dy: np.ndarray, w: np.ndarray, cdims: Any) -> np.ndarray:
    """The gradient of :func:`conv_forward` with respect to ``x``, ``col2im(w^T @ dy)``, shape
    ``cdims.x_shape``.

    >>> from fluxpy.ops.dims import ConvDims
    >>> cd = ConvDims.from_shapes((1, 1, 3, 3), (1, 1, 2, 2))
    >>> conv_backward_data(np.ones((1, 1, 2, 2)), np.ones((1, 1, 2, 2)), cd)[0, 0]
    array([[1., 2., 1.],
           [2., 4., 2.],
           [1., 2., 1.]])
    """
    if onednn.takes(dy, w):
        return onednn.conv_backward_data(dy, _unflipped(w, cdims), cdims)
    grid = _backward_grid(cdims)
    wm = _weight_matrix(w, cdims)
    return col2im(np.matmul(wm.transpose(0, 2, 1), _channel_major_dy(dy, cdims, grid)), cdims, grid)


def conv_backward_filter(x: np.ndarray, dy: np.ndarray, cdims: Any) -> np.ndarray:
    """The gradient of :func:`conv_forward` with respect to ``w``, ``dy @ im2col(x)^T`` (batch and
    pixels form one contraction axis), shape ``cdims.w_shape``.

    >>> from fluxpy.ops.dims import ConvDims
    >>> cd = ConvDims.from_shapes((1, 1, 3, 3), (1, 1, 2, 2), flipped=True)
    >>> conv_backward_filter(np.arange(9.0).reshape(1, 1, 3, 3), np.ones((1, 1, 2, 2)), cd)[0, 0]
    array([[ 8., 12.],
           [20., 24.]])
    """
    if onednn.takes(x, dy):
        return np.ascontiguousarray(_unflipped(onednn.conv_backward_weights(x, dy, cdims)[0], cdims))
    grid = _backward_grid(cdims)
    return _filter_gradient(x, _channel_major_dy(dy, cdims, grid), cdims, grid)


def _filter_gradient(x, dyc, cdims, grid):
    """``w``'s gradient from the channel-major ``dyc`` (:func:`_channel_major_dy` over ``grid``), as
    ``(cols @ dyc.T).T``: OpenBLAS runs that order 1.3-2.4x faster than ``dyc @ cols.T`` on conv shapes (few output
    channels, a long contraction)."""
    dw = np.matmul(im2col(x, cdims, grid), dyc.transpose(0, 2, 1)).transpose(0, 2, 1).reshape(cdims.w_shape)
    return np.ascontiguousarray(_unflipped(dw, cdims))


def conv_bias_act_grads(dy: np.ndarray, y: np.ndarray | None, x: np.ndarray, w: np.ndarray, kind: str, cdims: Any,
                        need_x: bool, need_w: bool, need_b: bool) -> tuple:
    """``(dx, dw, db)``, the gradients of ``act(conv(x, w) + b)`` (``kind`` ``"relu"``, from its output ``y``, or
    ``"identity"``, ``y`` unused) for the cotangent ``dy``, each None where not needed: one channel-major copy of
    ``dy`` (masked by ``y > 0`` in the same pass) serves all three (:func:`conv_backward_data` and
    :func:`conv_backward_filter` each make their own).

    >>> from fluxpy.ops.dims import ConvDims
    >>> x, w = np.arange(9.0).reshape(1, 1, 3, 3), np.ones((1, 1, 2, 2))
    >>> cd = ConvDims.from_arrays(x, w, flipped=True)
    >>> dx, dw, db = conv_bias_act_grads(np.ones((1, 1, 2, 2)), None, x, w, "identity", cd, True, True, True)
    >>> dw[0, 0].tolist(), db.tolist()
    ([[8.0, 12.0], [20.0, 24.0]], [4.0])
    """
    if onednn.takes(dy, x, w):
        return _onednn_grads(dy * np.greater(y, 0) if kind == "relu" else dy, x, w, cdims, need_x, need_w, need_b)
    grid = _backward_grid(cdims)
    dyc = _channel_major_dy(dy, cdims, grid, mask=np.greater(y, 0) if kind == "relu" else None)
    db = dyc.reshape(dy.shape[1], -1).sum(axis=1) if need_b else None   # zeros off the output add nothing
    dw = _filter_gradient(x, dyc, cdims, grid) if need_w else None
    dx = col2im(np.matmul(_weight_matrix(w, cdims).transpose(0, 2, 1), dyc), cdims, grid) if need_x else None
    return dx, dw, db


def _onednn_grads(dz, x, w, cdims, need_x, need_w, need_b):
    """:func:`conv_bias_act_grads` of float32 arrays through oneDNN, from the masked cotangent ``dz``."""
    dx = onednn.conv_backward_data(dz, _unflipped(w, cdims), cdims) if need_x else None
    dw = db = None
    if need_w:
        dw, db = onednn.conv_backward_weights(x, dz, cdims, need_b)
        dw = np.ascontiguousarray(_unflipped(dw, cdims))
    elif need_b:
        db = dz.sum(axis=(0,) + tuple(range(2, dz.ndim)))
    return dx, dw, db


def _conv_bias_act_grads_supports(dy, y, x, w, kind, cdims, need_x, need_w, need_b):
    return (all(type(a) is np.ndarray for a in (dy, x, w)) and dy.dtype == x.dtype == w.dtype
            and dy.dtype in (np.float32, np.float64) and kind in ("relu", "identity")
            and (kind == "identity" or type(y) is np.ndarray))


def conv_bias_act_half(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, kind: str, cdims: Any) -> np.ndarray:
    """``act(conv(x, w) + b)`` (``kind`` ``"relu"`` or ``"identity"``) for float16 or bfloat16, all in float32 and
    rounded once, as cuDNN's fused call does: rounding the convolution before the bias add could flip the sign
    of an output near zero, and with it relu's mask in the gradient.

    >>> import ml_dtypes
    >>> from fluxpy.ops.dims import ConvDims
    >>> x = np.ones((1, 1, 2, 2), ml_dtypes.bfloat16)
    >>> b = np.array([-5.0], ml_dtypes.bfloat16)
    >>> y = conv_bias_act_half(x, x, b, "relu", ConvDims.from_shapes(x.shape, x.shape))
    >>> y.dtype, y.ravel().tolist()
    (dtype(bfloat16), [0.0])
    """
    y = conv_forward(x.astype(np.float32), w.astype(np.float32), cdims)
    if b is not None:
        y += b.astype(np.float32).reshape((1, -1) + (1,) * (y.ndim - 2))
    if kind == "relu":
        np.maximum(y, 0, out=y)
    return y.astype(x.dtype)


def conv_bias_act_cpu(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, kind: str, cdims: Any) -> np.ndarray:
    """``act(conv(x, w) + b)`` on the CPU: the halves as :func:`conv_bias_act_half`; float32 through oneDNN, the
    bias added by the convolution itself and relu in place.

    >>> from fluxpy.ops.dims import ConvDims
    >>> x = np.ones((1, 1, 2, 2), np.float32)
    >>> conv_bias_act_cpu(x, x, np.array([-5.0], np.float32), "relu", ConvDims.from_shapes(x.shape, x.shape)).ravel()
    array([0.], dtype=float32)
    """
    if is_half(x.dtype):
        return conv_bias_act_half(x, w, b, kind, cdims)
    y = onednn.conv_forward(x, _unflipped(w, cdims), cdims, b)
    return np.maximum(y, 0, out=y) if kind == "relu" else y


def _conv_bias_act_cpu_supports(x, w, b, kind, cdims):
    if kind not in ("relu", "identity") or not isinstance(x, np.ndarray):
        return False
    return is_half(x.dtype) or onednn.takes(x, w, *(() if b is None else (b,)))


# ---------------------------------------------------------------------------------------------
# Pooling. Small kernels loop over the kernel offsets (r, s): each selects an (N, C, P, Q) slice
# of the padded input, which NumPy reduces far faster than a 6-D window view. Large kernels
# (global and adaptive pools) instead gather all windows once, (N, C, P, Q, R*S), and reduce
# the last axis.

_LOOP_MAX_OFFSETS = 16   # kernels with more offsets than this gather their windows instead


def _loops(pdims):
    rows, cols = pdims.window_rows(), pdims.window_cols()
    return rows.shape[1] * cols.shape[1] <= _LOOP_MAX_OFFSETS


def _offsets(pdims):
    """``(k, index)`` for each kernel offset ``k = r*S + s``: ``xpad[index]`` is ``(N, C, P, Q)``."""
    rows, cols = pdims.window_rows(), pdims.window_cols()
    p, q, width = rows.shape[0], cols.shape[0], cols.shape[1]
    for i in range(rows.shape[1]):
        for j in range(width):
            if pdims.adaptive:
                index = (Ellipsis, rows[:, i][:, None], cols[:, j][None, :])
            else:
                sh, sw = pdims.stride
                index = (Ellipsis, slice(i, i + sh * (p - 1) + 1, sh), slice(j, j + sw * (q - 1) + 1, sw))
            yield i * width + j, index


def _gathered_windows(xp, pdims):
    """All windows of the padded input at once, ``(N, C, P, Q, R*S)`` (a copy)."""
    rows, cols = pdims.window_rows(), pdims.window_cols()
    windows = xp[:, :, rows[:, None, :, None], cols[None, :, None, :]]       # (N, C, P, Q, R, S)
    return windows.reshape(windows.shape[:4] + (-1,))


def _padded_positions(arg, pdims):
    """Index arrays ``(n, c, h, w)`` into the padded input of kernel offsets ``arg`` (N, C, P, Q)."""
    rows, cols = pdims.window_rows(), pdims.window_cols()
    n, c, p, q = arg.shape
    h = rows[np.arange(p)[:, None], arg // cols.shape[1]]
    w = cols[np.arange(q), arg % cols.shape[1]]
    return np.arange(n)[:, None, None, None], np.arange(c)[None, :, None, None], h, w


def _lowest(dtype):
    return -np.inf if is_float_dtype(dtype) else np.iinfo(dtype).min


def _scatter_add(dst, index, values):
    if isinstance(index[-1], slice):
        dst[index] += values
    else:  # adaptive bins may overlap or repeat: accumulate repeated indices
        np.add.at(dst, index, values)


def lowest_finite(dtype: Any) -> Any:
    """What a max pool gives a window of padding only: NNlib's ``nextfloat(typemin(T))`` (the lowest finite
    value) for floats, ``typemin`` for integers.

    >>> import ml_dtypes
    >>> float(lowest_finite(np.float16)), int(lowest_finite(np.int8)), float(lowest_finite(ml_dtypes.bfloat16))
    (-65504.0, -128, -3.3895313892515355e+38)
    """
    dtype = np.dtype(dtype)
    return dtype.type(-ml_dtypes.finfo(dtype).max if is_float_dtype(dtype) else np.iinfo(dtype).min)


def _fill_empty_windows(y, pdims, value):
    """``y`` (N, C, P, Q) with ``value`` in each window that holds padding only (none unless a pad reaches the
    kernel's size)."""
    if pdims.has_empty_windows:
        rows, cols = pdims.empty_windows()
        y[..., rows[:, None] | cols[None, :]] = value
    return y


def maxpool_forward(x: np.ndarray, pdims: Any, empty: Any = None) -> np.ndarray:
    """The largest element of each window (padding counts as ``-inf``); a window of padding only (a pad as large as
    the kernel) gives ``empty``, by default NNlib's value for ``x``'s dtype (:func:`lowest_finite`).

    >>> from fluxpy.ops.dims import PoolDims
    >>> x = np.arange(16.0).reshape(1, 1, 4, 4)
    >>> maxpool_forward(x, PoolDims.from_array(x, 2))[0, 0]
    array([[ 5.,  7.],
           [13., 15.]])
    >>> x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]], np.float32)
    >>> maxpool_forward(x, PoolDims.from_array(x, 1, pad=(1, 0, 0, 0)))[0, 0].tolist()   # row 0: padding only
    [[-3.4028234663852886e+38, -3.4028234663852886e+38], [1.0, 2.0], [3.0, 4.0]]
    """
    y = onednn_pool.maxpool_forward(x, pdims) if onednn_pool.takes(x, pdims) else None
    if y is not None:   # float32 without NaN: oneDNN's one pass (see onednn_pool)
        return y
    xp = pad_input(x, pdims.pad, _lowest(x.dtype))
    if not _loops(pdims):
        y = _gathered_windows(xp, pdims).max(axis=-1)
    else:
        y = None
        for _, index in _offsets(pdims):
            y = xp[index].copy() if y is None else np.maximum(y, xp[index], out=y)
    return _fill_empty_windows(y, pdims, lowest_finite(x.dtype) if empty is None else empty)


def _maxpool_forward_halves(x: np.ndarray, pdims: Any) -> np.ndarray:
    """:func:`maxpool_forward` computing halves in float32, each empty window given the half's lowest finite."""
    if not is_half(x.dtype):
        return maxpool_forward(x, pdims)
    return maxpool_forward(x.astype(np.float32), pdims, empty=np.float32(lowest_finite(x.dtype))).astype(x.dtype)


def _first_maxima(x, y, pdims):
    """``(index, hit)`` per kernel offset: ``hit`` (N, C, P, Q) marks the windows whose first maximum
    (row-major, as PyTorch) sits at that offset. Boolean ops only, no data-dependent branches. A window holding a
    NaN has the NaN as its maximum (``y`` is NaN there): its first NaN gets the hit, as NumPy's ``argmax`` of the
    gathered strategy gives it (``NaN == NaN`` alone would give the window's gradient to no entry)."""
    xp = pad_input(x, pdims.pad, _lowest(x.dtype))
    nan_windows = np.isnan(y) if y.dtype.kind == "f" else None   # one pass over y; the rest only where it has one
    if nan_windows is not None and not nan_windows.any():
        nan_windows = None
    taken = None
    for _, index in _offsets(pdims):
        hit = xp[index] == y
        if nan_windows is not None:
            hit |= nan_windows & np.isnan(xp[index])
        if taken is None:
            taken = hit.copy()
        else:
            np.greater(hit, taken, out=hit)          # hit and not taken
            taken |= hit
        yield index, hit


def maxpool_argmax(x: np.ndarray, pdims: Any, y: np.ndarray | None = None) -> np.ndarray:
    """The kernel offset ``r*S + s`` of each window's first maximum.

    ``y``, the forward's output, saves recomputing it.

    >>> from fluxpy.ops.dims import PoolDims
    >>> x = np.array([[[[1.0, 3.0], [3.0, 0.0]]]])
    >>> maxpool_argmax(x, PoolDims.from_array(x, 2))
    array([[[[1]]]])
    """
    if not _loops(pdims):
        return _gathered_windows(pad_input(x, pdims.pad, _lowest(x.dtype)), pdims).argmax(axis=-1)
    y = maxpool_forward(x, pdims) if y is None else y
    arg = np.zeros(pdims.y_shape, dtype=np.intp)
    for k, (_, hit) in enumerate(_first_maxima(x, y, pdims)):
        arg += k * hit
    return arg


def _disjoint(pdims):
    """Whether no two windows share an entry (a stride at least the kernel along every axis, fixed windows)."""
    return not pdims.adaptive and all(s >= k for s, k in zip(pdims.stride, pdims.kernel))


def maxpool_backward(dy: np.ndarray, x: np.ndarray, y: np.ndarray, pdims: Any) -> np.ndarray:
    """The gradient of :func:`maxpool_forward`: each ``dy`` goes to the first maximum of its window,
    found by comparing with the forward's output ``y``.

    >>> from fluxpy.ops.dims import PoolDims
    >>> x = np.array([[[[1.0, 3.0], [3.0, 0.0]]]])
    >>> d = PoolDims.from_array(x, 2)
    >>> maxpool_backward(np.ones((1, 1, 1, 1)), x, maxpool_forward(x, d), d)[0, 0]
    array([[0., 1.],
           [0., 0.]])
    """
    if onednn_pool.takes(x, pdims) and type(dy) is type(y) is np.ndarray and dy.dtype == y.dtype == np.float32:
        dx = onednn_pool.maxpool_backward(dy, x, y, pdims)
        if dx is not None:
            return dx
    dxp = np.zeros(x.shape[:2] + tuple(pdims.padded_hw), dtype=np.result_type(dy.dtype, x.dtype))
    if not _loops(pdims):
        np.add.at(dxp, _padded_positions(maxpool_argmax(x, pdims), pdims), dy)
    else:
        disjoint = _disjoint(pdims)
        for index, hit in _first_maxima(x, y, pdims):
            if disjoint:   # each entry lies in one window at most: written once, no read-modify-write pass
                np.multiply(hit, dy, out=dxp[index])
            else:
                _scatter_add(dxp, index, dy * hit)
    return crop_input(dxp, pdims.pad)


def maxpool_gather(dx: np.ndarray, x: np.ndarray, y: np.ndarray, pdims: Any) -> np.ndarray:
    """The adjoint of :func:`maxpool_backward` in ``dy``: ``dx`` read at each window's first maximum of
    ``x``.

    >>> from fluxpy.ops.dims import PoolDims
    >>> x = np.array([[[[1.0, 3.0], [3.0, 0.0]]]])
    >>> d = PoolDims.from_array(x, 2)
    >>> maxpool_gather(np.array([[[[10.0, 20.0], [30.0, 40.0]]]]), x, maxpool_forward(x, d), d)
    array([[[[20.]]]])
    """
    dxp = pad_input(dx, pdims.pad)
    if not _loops(pdims):
        return dxp[_padded_positions(maxpool_argmax(x, pdims), pdims)]
    out = np.zeros(pdims.y_shape, dtype=dx.dtype)
    for index, hit in _first_maxima(x, y, pdims):
        out += dxp[index] * hit
    return out


def _check_regular(pdims):
    if pdims.adaptive:  # adaptive bins repeat rows, which a mean would count twice
        raise ValueError("meanpool kernels take regular PoolDims; adaptive means are averaging matrices")


def meanpool_forward(x: np.ndarray, pdims: Any) -> np.ndarray:
    """The mean of each window, zero padding counted (``count_include_pad``).

    >>> from fluxpy.ops.dims import PoolDims
    >>> x = np.ones((1, 1, 2, 2))
    >>> meanpool_forward(x, PoolDims.from_array(x, 2, stride=1, pad=(1, 0, 0, 0)))[0, 0]
    array([[0.5],
           [1. ]])
    """
    _check_regular(pdims)
    y = onednn_pool.meanpool_forward(x, pdims) if onednn_pool.takes(x, pdims) else None
    if y is not None:
        return y
    xp = pad_input(x, pdims.pad)
    dtype = np.result_type(x.dtype, np.float32)
    if not _loops(pdims):
        return _gathered_windows(xp, pdims).mean(axis=-1, dtype=dtype)
    y = None
    for _, index in _offsets(pdims):
        y = xp[index].astype(dtype) if y is None else np.add(y, xp[index], out=y)
    y *= 1.0 / (pdims.kernel[0] * pdims.kernel[1])
    return y


def meanpool_backward(dy: np.ndarray, pdims: Any) -> np.ndarray:
    """The gradient of :func:`meanpool_forward`, ``dy / (R*S)`` per window.

    >>> from fluxpy.ops.dims import PoolDims
    >>> meanpool_backward(np.ones((1, 1, 1, 1)), PoolDims.from_array(np.ones((1, 1, 2, 2)), 2))[0, 0]
    array([[0.25, 0.25],
           [0.25, 0.25]])
    """
    _check_regular(pdims)
    dx = onednn_pool.meanpool_backward(dy, pdims) if onednn_pool.takes(dy, pdims) else None
    if dx is not None:
        return dx
    share = dy * (1.0 / (pdims.kernel[0] * pdims.kernel[1]))
    dxp = np.zeros(tuple(pdims.x_shape[:2]) + tuple(pdims.padded_hw), dtype=share.dtype)
    if not _loops(pdims):
        rows, cols = pdims.window_rows(), pdims.window_cols()
        index = (Ellipsis, rows[:, None, :, None], cols[None, :, None, :])   # (P, Q, R, S)
        np.add.at(dxp, index, np.broadcast_to(share[..., None, None], share.shape + rows.shape[1:] + cols.shape[1:]))
    else:
        for _, index in _offsets(pdims):
            _scatter_add(dxp, index, share)
    return crop_input(dxp, pdims.pad)


# ---------------------------------------------------------------------------------------------
# Scatter and gather: NumPy's unbuffered ``ufunc.at`` accumulates repeated indices.

_SCATTER_UFUNCS = {"add": np.add, "max": np.maximum, "min": np.minimum}


def scatter_empty(op: str, dtype: Any) -> Any:
    """The value of a destination entry that no index hits (NNlib's ``scatter_empty``): 0 for ``"add"``, the
    dtype's lowest value for ``"max"`` (``-inf`` for floats) and its highest for ``"min"``.

    >>> scatter_empty("max", np.float32), scatter_empty("min", np.int8)
    (-inf, 127)
    """
    if op == "add":
        return 0
    if is_float_dtype(dtype):
        return -np.inf if op == "max" else np.inf
    info = np.iinfo(dtype)
    return int(info.min) if op == "max" else int(info.max)


def first_bad_index(index: Sequence[np.ndarray], sizes: Sequence[int]) -> BadIndex | None:
    """The :class:`~fluxpy.kernels.BadIndex` of the first entry (in order) where one of the integer arrays
    ``index`` lies outside ``[0, sizes[j])``, or None.

    >>> first_bad_index([np.array([0, 2]), np.array([1, -1])], (3, 2)).value
    -1
    """
    bad = np.zeros(np.shape(index[0]), bool) if len(index) else None
    for a, n in zip(index, sizes):
        bad |= (a < 0) | (a >= n)
    if bad is None or not bad.any():
        return None
    k = int(np.flatnonzero(bad.reshape(-1))[0])
    for j, (a, n) in enumerate(zip(index, sizes)):
        v = int(a.reshape(-1)[k])
        if not 0 <= v < n:
            return BadIndex(j, v, int(n))
    return None


def along_axis_index(idx: Any, axis: int) -> tuple:
    """The NumPy index tuple that reads the NumPy array ``idx``'s entries along ``axis``: broadcast ``arange``
    columns on every other axis (views, no copies) and ``idx`` itself at ``axis``, so that ``x[index]`` is
    ``np.take_along_axis(x, idx, axis)`` and :func:`first_bad_index` names ``axis`` for a bad entry.

    >>> x = np.array([[10, 20, 30], [40, 50, 60]])
    >>> x[along_axis_index(np.array([[2, 0], [1, 1]]), 1)]
    array([[30, 10],
           [50, 50]])
    """
    shape = idx.shape
    return tuple(idx if a == axis else np.broadcast_to(np.arange(n).reshape([-1 if b == a else 1 for b in
                                                                               range(len(shape))]), shape)
                 for a, n in enumerate(shape))


def scatter(op: str, src: np.ndarray, index: tuple, shape: tuple, checked: bool = False,
            axis: int | None = None) -> np.ndarray:
    """A new array of ``shape`` holding :func:`scatter_empty` where ``dst[index] op= src`` writes nothing, and
    ``op`` (``"add"``, ``"max"`` or ``"min"``) of every ``src`` value sent to an entry elsewhere. ``index`` is any
    NumPy index tuple, ``src`` has the shape ``dst[index]`` has; repeated indices accumulate. ``checked`` (integer
    arrays on the leading axes): raise :class:`~fluxpy.kernels.BadIndex` for an index outside ``shape``.
    ``axis``: ``index`` is one integer array of ``src``'s shape whose entries index ``dst``'s ``axis``
    (``torch.scatter_reduce``'s form; :func:`along_axis_index`).

    >>> scatter("add", np.array([1.0, 2.0, 3.0]), (np.array([0, 2, 0]),), (3,))
    array([4., 0., 2.])
    >>> scatter("max", np.array([[1.0, 5.0, 3.0]]), (np.array([[1, 1, 0]]),), (1, 2), False, 1)
    array([[3., 5.]])
    """
    index = index if axis is None else along_axis_index(index[0], axis)
    bad = first_bad_index(index, shape) if checked else None
    if bad is not None:
        raise bad
    dst = np.full(shape, scatter_empty(op, src.dtype), dtype=src.dtype)
    _SCATTER_UFUNCS[op].at(dst, index, src)
    return dst


def gather(src: np.ndarray, index: tuple, checked: bool = False, axis: int | None = None) -> np.ndarray:
    """``src[index]`` (a copy), the adjoint of :func:`scatter` with ``"add"``; ``checked`` and ``axis`` as
    :func:`scatter`'s (with ``axis``, ``np.take_along_axis(src, index[0], axis)``).

    >>> gather(np.array([10.0, 20.0, 30.0]), (np.array([2, 2, 0]),))
    array([30., 30., 10.])
    """
    index = index if axis is None else along_axis_index(index[0], axis)
    bad = first_bad_index(index, src.shape) if checked else None
    if bad is not None:
        raise bad
    return src[index]


def check_indices(wait: bool = True) -> None:
    """Nothing, waiting or not: NumPy indices are checked on the host before any work, so no index error is ever
    pending (the GPU's ``check_indices`` reports those of calls made with ``index_checks="deferred"``).

    >>> check_indices()
    """


# ---------------------------------------------------------------------------------------------
# Half precision: NumPy has float16 but sums it slowly and, for bfloat16 (ml_dtypes), in bfloat16 itself. The
# registered kernels therefore compute both halves in float32 and round each result once to the half type.


def halves_in_float32(kernel: Callable) -> Callable:
    """``kernel`` computing float16/bfloat16 arrays in float32: half arguments are widened, and the result is
    rounded back to the half type when every array argument had that one half type (a mix with float32 or
    float64 keeps the wider result).

    >>> import ml_dtypes
    >>> from fluxpy.ops.dims import PoolDims
    >>> x = np.arange(16.0).reshape(1, 1, 4, 4).astype(ml_dtypes.bfloat16)
    >>> y = halves_in_float32(meanpool_forward)(x, PoolDims.from_array(x, 2))
    >>> y.dtype, y[0, 0].astype(np.float32).tolist()
    (dtype(bfloat16), [[2.5, 4.5], [10.5, 12.5]])
    """
    @functools.wraps(kernel)
    def call(*args):
        dtypes = {a.dtype for a in args if isinstance(a, np.ndarray)}
        if not any(is_half(d) for d in dtypes):
            return kernel(*args)
        wide = (a.astype(np.float32) if isinstance(a, np.ndarray) and is_half(a.dtype) else a for a in args)
        out = kernel(*wide)
        return out.astype(dtypes.pop()) if len(dtypes) == 1 and is_float_dtype(out.dtype) else out
    return call


register("maxpool_forward", "numpy", _maxpool_forward_halves)
try:   # SciPy is optional: without it the erf op runs its composite (fluxpy.ops.special)
    from scipy.special import erf as _scipy_erf
except ImportError:   # pragma: no cover - SciPy is installed where the tests run
    pass
else:
    register("erf", "numpy", _scipy_erf, lambda x: isinstance(x, np.ndarray) and x.dtype in (np.float32, np.float64))
for _name in ("conv_forward", "conv_backward_data", "conv_backward_filter",
              "maxpool_backward", "maxpool_gather", "meanpool_forward", "meanpool_backward"):
    register(_name, "numpy", halves_in_float32(globals()[_name]))
register("scatter", "numpy", halves_in_float32(scatter))
register("gather", "numpy", gather)
register("check_indices", "numpy", check_indices)
register("conv_bias_act_forward", "numpy", conv_bias_act_cpu, _conv_bias_act_cpu_supports)
register("conv_bias_act_grads", "numpy", conv_bias_act_grads, _conv_bias_act_grads_supports)
register("relu_forward", "numpy", onednn.relu, onednn.takes_eltwise)   # large float32 arrays; else np.maximum
register("relu_backward", "numpy", onednn.relu_backward,
         lambda dy, y: onednn.takes_eltwise(dy, y) and dy.shape == y.shape)
from . import cpu_recurrent as _cpu_recurrent  # noqa: E402  (the recurrent cells' gates: lstm_gates_*, gru_gates_*)
for _name, (_fn, _ok) in _cpu_recurrent.KERNELS.items():
    register(_name, "numpy", _fn, _ok)
from . import cpu_dense as _cpu_dense  # noqa: E402  (the Dense op: dense_forward, dense_backward_weight)
from . import cpu_norm as _cpu_norm  # noqa: E402  (layer norm: layernorm_forward, layernorm_backward)
from . import cpu_rnn as _cpu_rnn  # noqa: E402  (a whole RNN, LSTM or GRU: rnn_forward, rnn_backward)
for _name, _entry in (*_cpu_rnn.KERNELS.items(), *_cpu_norm.KERNELS.items(), *_cpu_dense.KERNELS.items()):
    register(_name, "numpy", *(_entry if isinstance(_entry, tuple) else (_entry,)))
options.take_effect("cpu_heap_keep_mb", keep_freed_memory)   # freed step arrays stay in the heap (see cpu_heap)
