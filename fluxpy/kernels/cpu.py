"""NumPy kernels for convolution and pooling: im2col + one BLAS matmul per group, and windowed pools.

Convolution (NCHW, weight ``(K, C/G, R, S)``, ``G`` groups) is computed as cross-correlation on
the padded input; true convolution (``cdims.flipped=False``) flips the kernel first.

- ``im2col`` copies the windows of the padded input into columns ``(G, C/G*R*S, N*P*Q')`` from a
  strided view (no Python loop), so the forward pass is one matmul per group,
  ``(K/G, C/G*R*S) @ (C/G*R*S, N*P*Q')`` (``Q'`` is ``Q``, or the padded width for stride 1).
- ``col2im`` is its adjoint: it adds columns back into the padded input, one strided slice per
  kernel offset ``(r, s)`` (``R*S`` vectorised adds, which also handle overlapping windows).
- Pools with small kernels loop over the ``R*S`` kernel offsets too; large ones (global,
  adaptive) gather their windows once.

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
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..backend import is_float_dtype
from . import register
from .halfs import is_half

__all__ = ["halves_in_float32", "pad_input", "crop_input", "im2col", "col2im", "conv_forward", "conv_backward_data",
           "conv_backward_filter", "maxpool_forward", "maxpool_argmax", "maxpool_backward", "maxpool_gather",
           "meanpool_forward", "meanpool_backward", "matmul_half", "matmul_half_supports", "conv_bias_act_half",
           "scatter_empty", "scatter", "gather"]


# ---------------------------------------------------------------------------------------------
# Padding


def pad_input(x: np.ndarray, pad: tuple[int, int, int, int], value: float = 0) -> np.ndarray:
    """``x`` (N, C, H, W) padded with ``value`` by ``pad = (top, bottom, left, right)``.

    >>> pad_input(np.ones((1, 1, 1, 2)), (1, 0, 0, 1))[0, 0]
    array([[0., 0., 0.],
           [1., 1., 0.]])
    """
    top, bottom, left, right = pad
    if not (top or bottom or left or right):
        return x
    n, c, h, w = x.shape
    out = np.empty((n, c, h + top + bottom, w + left + right), dtype=x.dtype)
    out[:, :, :top] = value
    out[:, :, top + h:] = value
    out[:, :, top:top + h, :left] = value
    out[:, :, top:top + h, left + w:] = value
    out[:, :, top:top + h, left:left + w] = x
    return out


def crop_input(xp: np.ndarray, pad: tuple[int, int, int, int]) -> np.ndarray:
    """The inverse of :func:`pad_input`: a view of ``xp`` without its padding.

    >>> crop_input(np.ones((1, 1, 3, 4)), (1, 1, 0, 2)).shape
    (1, 1, 1, 2)
    """
    top, bottom, left, right = pad
    h, w = xp.shape[2] - top - bottom, xp.shape[3] - left - right
    return xp[:, :, top:top + h, left:left + w]


# ---------------------------------------------------------------------------------------------
# Convolution, on channel-major copies: (C, N, H, W) makes every column block of im2col a plain
# strided copy and lets one matmul per group cover the whole batch, which BLAS runs far faster
# than one small matmul per image.
#
# The columns hold one entry per output position (n, p, q) for q < Q', the grid width. Q' is
# Q in general. When the horizontal stride is 1 it is the padded width Wp instead: each row of
# windows is then one contiguous run of the padded input, several times faster to copy (im2col)
# and to add back (col2im), at the price of Wp - Q garbage columns per row, which the forward
# drops and the backward feeds zeros. Reads past the end of the last row land in a few slack
# elements after the buffer.


def _grid_width(cdims):
    """Q', the number of column entries per output row (see above)."""
    q, wp = cdims.out_hw[1], cdims.padded_hw[1]
    return wp if cdims.stride[1] == 1 and 2 * (wp - q) <= q else q


def _channel_major_buffer(cdims, dtype):
    """Zeros ``(C, N, Hp, Wp)`` followed by the slack that the Q' = Wp grid reads past the end."""
    n, c = cdims.x_shape[:2]
    hp, wp = cdims.padded_hw
    slack = (cdims.kernel_hw[1] - 1) * cdims.dilation[1]
    return np.zeros(c * n * hp * wp + slack, dtype=dtype)[:c * n * hp * wp].reshape(c, n, hp, wp)


def _grid_view(xcn, cdims, offset=(0, 0), kernel_axes=True):
    """A strided view of the channel-major buffer ``xcn`` (C, N, Hp, Wp).

    With ``kernel_axes``: ``(C, R, S, N, P, Q')``, entry ``[c, r, s, n, p, q]`` being
    ``xcn[c, n, p*stride_h + r*dilation_h, q*stride_w + s*dilation_w]`` (im2col's windows).
    Without: ``(C, N, P, Q')`` at the kernel offset ``offset = (r, s)`` (col2im's targets).
    """
    (r, s), (p, q) = cdims.kernel_hw, (cdims.out_hw[0], _grid_width(cdims))
    (sh, sw), (dh, dw) = cdims.stride, cdims.dilation
    bc, bn, bh, bw = xcn.strides
    c, n = xcn.shape[:2]
    if kernel_axes:
        return as_strided(xcn, shape=(c, r, s, n, p, q), strides=(bc, bh * dh, bw * dw, bn, bh * sh, bw * sw),
                          writeable=False)
    start = xcn[:, :, offset[0] * dh:, offset[1] * dw:]
    return as_strided(start, shape=(c, n, p, q), strides=(bc, bn, bh * sh, bw * sw))


def im2col(x: np.ndarray, cdims: Any) -> np.ndarray:
    """The columns ``(G, C/G*R*S, N*P*Q')`` of the padded ``x`` (N, C, H, W), so that ``y = w @ cols``.

    >>> from fluxpy.ops.dims import ConvDims
    >>> x = np.arange(9.0).reshape(1, 1, 3, 3)
    >>> im2col(x, ConvDims.from_shapes(x.shape, (1, 1, 2, 2), stride=(1, 2)))[0]
    array([[0., 3.],
           [1., 4.],
           [3., 6.],
           [4., 7.]])
    """
    top, left = cdims.pad[0], cdims.pad[2]
    n, c, h, w = x.shape
    xcn = _channel_major_buffer(cdims, x.dtype)
    xcn[:, :, top:top + h, left:left + w] = x.transpose(1, 0, 2, 3)
    view = _grid_view(xcn, cdims)
    _, r, s, _, p, q = view.shape
    g = cdims.groups
    return view.reshape(g, (c // g) * r * s, n * p * q)


def col2im(cols: np.ndarray, cdims: Any) -> np.ndarray:
    """The adjoint of :func:`im2col`: columns summed back into ``(N, C, H, W)``.

    >>> from fluxpy.ops.dims import ConvDims
    >>> cd = ConvDims.from_shapes((1, 1, 3, 3), (1, 1, 2, 2), stride=(1, 2))
    >>> col2im(np.ones((1, 4, 2)), cd)[0, 0]   # how many windows cover each pixel
    array([[1., 1., 0.],
           [2., 2., 0.],
           [1., 1., 0.]])
    """
    n, c, h, w = cdims.x_shape
    (r, s), p, q = cdims.kernel_hw, cdims.out_hw[0], _grid_width(cdims)
    cols = cols.reshape(c, r, s, n, p, q)
    dxcn = _channel_major_buffer(cdims, cols.dtype)
    for i in range(r):
        for j in range(s):
            target = _grid_view(dxcn, cdims, offset=(i, j), kernel_axes=False)
            target += cols[:, i, j]
    top, left = cdims.pad[0], cdims.pad[2]
    return np.ascontiguousarray(dxcn[:, :, top:top + h, left:left + w].transpose(1, 0, 2, 3))


def _weight_matrix(w, cdims):
    """``w`` as ``(G, K/G, C/G*R*S)``, flipped for true convolution so all maths is cross-correlation."""
    if not cdims.flipped:
        w = w[:, :, ::-1, ::-1]
    k, cg, r, s = w.shape
    g = cdims.groups
    return w.reshape(g, k // g, cg * r * s)


def _channel_major_dy(dy, cdims):
    """``dy`` (N, K, P, Q) as ``(G, K/G, N*P*Q')``, zeros in the garbage columns."""
    n, k, p, q = dy.shape
    width = _grid_width(cdims)
    out = (np.zeros if width != q else np.empty)((k, n, p, width), dtype=dy.dtype)
    out[:, :, :, :q] = dy.transpose(1, 0, 2, 3)
    g = cdims.groups
    return out.reshape(g, k // g, n * p * width)


def conv_forward(x: np.ndarray, w: np.ndarray, cdims: Any) -> np.ndarray:
    """The convolution ``y`` of shape ``cdims.y_shape``, as ``w @ im2col(x)``.

    ``y[n, k, p, q] = sum_{c, r, s} w[k, c, r, s] * xpad[n, c, p*sh + r*dh, q*sw + s*dw]``, the kernel
    flipped unless ``cdims.flipped`` and ``c`` running over the group of ``k`` (see the module example).
    """
    n, k, p, q = cdims.y_shape
    y = np.matmul(_weight_matrix(w, cdims), im2col(x, cdims))     # (G, K/G, N*P*Q')
    y = y.reshape(k, n, p, _grid_width(cdims))[:, :, :, :q]
    return np.ascontiguousarray(y.transpose(1, 0, 2, 3))


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
    wm = _weight_matrix(w, cdims)
    return col2im(np.matmul(wm.transpose(0, 2, 1), _channel_major_dy(dy, cdims)), cdims)


def conv_backward_filter(x: np.ndarray, dy: np.ndarray, cdims: Any) -> np.ndarray:
    """The gradient of :func:`conv_forward` with respect to ``w``, ``dy @ im2col(x)^T`` (batch and
    pixels form one contraction axis), shape ``cdims.w_shape``.

    >>> from fluxpy.ops.dims import ConvDims
    >>> cd = ConvDims.from_shapes((1, 1, 3, 3), (1, 1, 2, 2), flipped=True)
    >>> conv_backward_filter(np.arange(9.0).reshape(1, 1, 3, 3), np.ones((1, 1, 2, 2)), cd)[0, 0]
    array([[ 8., 12.],
           [20., 24.]])
    """
    dw = np.matmul(_channel_major_dy(dy, cdims), im2col(x, cdims).transpose(0, 2, 1)).reshape(cdims.w_shape)
    if not cdims.flipped:
        dw = dw[:, :, ::-1, ::-1]
    return np.ascontiguousarray(dw)


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
        y += b.astype(np.float32).reshape(1, -1, 1, 1)
    if kind == "relu":
        np.maximum(y, 0, out=y)
    return y.astype(x.dtype)


def _conv_bias_act_half_supports(x, w, b, kind, cdims):
    return isinstance(x, np.ndarray) and is_half(x.dtype) and kind in ("relu", "identity")


def matmul_half(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` for float16 or bfloat16 NumPy arrays of one dtype, computed in float32 and rounded once to it.

    >>> import ml_dtypes
    >>> y = matmul_half(np.ones((2, 3), ml_dtypes.bfloat16), np.ones((3, 1), ml_dtypes.bfloat16))
    >>> y.dtype, y.ravel().tolist()
    (dtype(bfloat16), [3.0, 3.0])
    """
    return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)


def matmul_half_supports(a, b) -> bool:
    """Whether :func:`matmul_half` takes ``(a, b)``: NumPy arrays of one half dtype.

    >>> matmul_half_supports(np.ones(2, np.float16), np.ones(2, np.float16))
    True
    >>> matmul_half_supports(np.ones(2, np.float16), np.ones(2, np.float32))
    False
    """
    return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and is_half(a.dtype)


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


def maxpool_forward(x: np.ndarray, pdims: Any) -> np.ndarray:
    """The largest element of each window (padding counts as ``-inf``).

    >>> from fluxpy.ops.dims import PoolDims
    >>> x = np.arange(16.0).reshape(1, 1, 4, 4)
    >>> maxpool_forward(x, PoolDims.from_array(x, 2))[0, 0]
    array([[ 5.,  7.],
           [13., 15.]])
    """
    xp = pad_input(x, pdims.pad, _lowest(x.dtype))
    if not _loops(pdims):
        return _gathered_windows(xp, pdims).max(axis=-1)
    y = None
    for _, index in _offsets(pdims):
        y = xp[index].copy() if y is None else np.maximum(y, xp[index], out=y)
    return y


def _first_maxima(x, y, pdims):
    """``(index, hit)`` per kernel offset: ``hit`` (N, C, P, Q) marks the windows whose first maximum
    (row-major, as PyTorch) sits at that offset. Boolean ops only, no data-dependent branches."""
    xp = pad_input(x, pdims.pad, _lowest(x.dtype))
    taken = None
    for _, index in _offsets(pdims):
        hit = xp[index] == y
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
    dxp = np.zeros(x.shape[:2] + tuple(pdims.padded_hw), dtype=np.result_type(dy.dtype, x.dtype))
    if not _loops(pdims):
        np.add.at(dxp, _padded_positions(maxpool_argmax(x, pdims), pdims), dy)
    else:
        for index, hit in _first_maxima(x, y, pdims):
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


def scatter(op: str, src: np.ndarray, index: tuple, shape: tuple) -> np.ndarray:
    """A new array of ``shape`` holding :func:`scatter_empty` where ``dst[index] op= src`` writes nothing, and
    ``op`` (``"add"``, ``"max"`` or ``"min"``) of every ``src`` value sent to an entry elsewhere. ``index`` is any
    NumPy index tuple, ``src`` has the shape ``dst[index]`` has; repeated indices accumulate.

    >>> scatter("add", np.array([1.0, 2.0, 3.0]), (np.array([0, 2, 0]),), (3,))
    array([4., 0., 2.])
    """
    dst = np.full(shape, scatter_empty(op, src.dtype), dtype=src.dtype)
    _SCATTER_UFUNCS[op].at(dst, index, src)
    return dst


def gather(src: np.ndarray, index: tuple) -> np.ndarray:
    """``src[index]`` (a copy), the adjoint of :func:`scatter` with ``"add"``.

    >>> gather(np.array([10.0, 20.0, 30.0]), (np.array([2, 2, 0]),))
    array([30., 30., 10.])
    """
    return src[index]


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


for _name in ("conv_forward", "conv_backward_data", "conv_backward_filter", "maxpool_forward",
              "maxpool_backward", "maxpool_gather", "meanpool_forward", "meanpool_backward"):
    register(_name, "numpy", halves_in_float32(globals()[_name]))
register("scatter", "numpy", halves_in_float32(scatter))
register("gather", "numpy", gather)
register("matmul", "numpy", matmul_half, matmul_half_supports)
register("conv_bias_act_forward", "numpy", conv_bias_act_half, _conv_bias_act_half_supports)
