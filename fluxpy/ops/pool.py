"""Pooling (NNlib ``src/pooling.jl``): max and mean pools, their global and adaptive forms, and their gradients.

Layout NCHW: ``x`` is ``(N, C, H, W)``, outputs ``(N, C, P, Q)``; in 1 and 3 spatial dimensions ``(N, C, L)`` and
``(N, C, D, H, W)``, with one kernel size per spatial axis. ``stride`` defaults to the kernel. ``maxpool`` pads
with ``-inf`` and sends each gradient to the first maximum of its window (as PyTorch); ``meanpool`` pads with
zeros and counts them (PyTorch's ``count_include_pad=True``), so a window of ``R*S`` always divides by ``R*S``.
A pad may reach the kernel's size, as in NNlib (PyTorch allows at most half the kernel): a window of padding only
then gives NNlib's values, the dtype's lowest finite number for ``maxpool`` (``nextfloat(typemin(T))``), 0 for
``meanpool``, and passes no gradient. A 3-d pool's stages keep that: an empty window's stages are empty or pool
lowest values.
float16 and bfloat16 pool in their own dtype, computed in float32 (sums rounded once).

The gradient kernels are public ops with their own rules (``maxpool_backward``,
``meanpool_backward``), so pools differentiate twice. The arithmetic runs in the kernel
registered for the arrays' module (:mod:`fluxpy.kernels`), which pools 2-d images. A pool of 1 or 3 spatial axes
runs as 2-d pools on reshaped views (:func:`pool_stages`): a 1-d one over ``(N, C, 1, L)``; a 3-d one, separable as
a max or a mean over a box is, first over ``(H, W)`` of ``(N, C*D, H, W)``, then over ``D`` of
``(N, C, D, P*Q)`` with a unit kernel along ``P*Q``. Taking the first maximum of each ``(H, W)`` window, then the
first of those along ``D``, is the first maximum of the box in row-major order, so ties go where a 3-d kernel
would send them.

>>> import numpy as np
>>> from fluxpy import gradient
>>> x = np.array([[[[1.0, 2.0], [4.0, 3.0]]]])
>>> maxpool(x, 2)
array([[[[4.]]]])
>>> gradient(lambda x: maxpool(x, 2).sum(), x)[0]
array([[[[0., 0.],
         [1., 0.]]]])
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..autodiff import Primitive, value_of
from ..backend import Array
from ..kernels import lookup
from ..kernels.halfs import is_half
from .constants import device_constant
from .dims import AdaptivePoolDims, PoolDims, _averaging_matrix, _check_spatial, describe, memoised
from .basic import where
from .resample import along_axis
from .reduce import check_half_mix, mean
from .shape import astype, reshape

__all__ = ["maxpool", "meanpool", "lpnormpool", "global_maxpool", "global_meanpool", "adaptive_maxpool",
           "adaptive_meanpool", "maxpool_backward", "meanpool_backward", "pool_stages", "PoolDims", "AdaptivePoolDims"]


_DIMS = {}


def pool_dims(x: Array, kernel: int | tuple[int, ...], stride: int | tuple[int, ...] | None = None,
              pad: int | tuple[int, ...] | str = 0, op: str = "maxpool") -> PoolDims:
    """The :class:`PoolDims` of a pooling (:meth:`PoolDims.from_array`), memoised per shape and options.

    >>> import numpy as np
    >>> pool_dims(np.ones((1, 1, 4, 4)), 2).y_shape
    (1, 1, 2, 2)
    """
    key = (getattr(x, "shape", None), kernel, type(kernel), stride, type(stride), pad, type(pad), op)
    return memoised(_DIMS, key, lambda: PoolDims.from_array(x, kernel, stride, pad, op=op))


# ---------------------------------------------------------------------------------------------
# Pools of 1 or 3 spatial axes as 2-d pools on reshaped views (see the module docstring)


class Stage(NamedTuple):
    """One 2-d pool of a staged pooling: the input is reshaped to ``in_shape`` and pooled by ``dims``."""
    in_shape: tuple
    dims: PoolDims | AdaptivePoolDims


_STAGES = {}


def pool_stages(pdims: PoolDims | AdaptivePoolDims) -> tuple[Stage, ...]:
    """The 2-d pools that a pooling of 1 or 3 spatial axes runs as, in order (one for 2-d dims: themselves).

    >>> import numpy as np
    >>> [s.dims.kernel for s in pool_stages(PoolDims.from_array(np.ones((1, 2, 4, 6, 6)), (2, 3, 3)))]
    [(3, 3), (2, 1)]
    """
    return memoised(_STAGES, pdims, lambda: _plan_stages(pdims))


def _plan_stages(d):
    n, c, *sizes = d.x_shape
    adaptive = d.adaptive
    if len(sizes) == 2:
        return (Stage(d.x_shape, d),)
    if len(sizes) == 1:
        shape = (n, c, 1, sizes[0])
        if adaptive:
            return (Stage(shape, AdaptivePoolDims(shape, (1,) + d.out_hw)),)
        return (Stage(shape, PoolDims(shape, (1,) + d.kernel, (1,) + d.stride, (0, 0) + d.pad)),)
    depth, h, w = sizes
    plane = (n, c * depth, h, w)
    if adaptive:
        first = AdaptivePoolDims(plane, d.out_hw[1:])
    else:
        first = PoolDims(plane, d.kernel[1:], d.stride[1:], d.pad[2:])
    p, q = first.y_shape[2:]
    column = (n, c, depth, p * q)
    if adaptive:
        second = AdaptivePoolDims(column, (d.out_hw[0], p * q))
    else:
        second = PoolDims(column, (d.kernel[0], 1), (d.stride[0], 1), d.pad[:2] + (0, 0))
    return Stage(plane, first), Stage(column, second)


def _pooled(prim, x, pdims):
    """``prim`` (``_maxpool`` or ``_meanpool``) of ``x`` under dims of any spatial rank."""
    if len(pdims.x_shape) == 4:
        return prim(x, pdims)
    for stage in pool_stages(pdims):
        x = prim(reshape(x, stage.in_shape), stage.dims)
    return reshape(x, pdims.y_shape)


def _staged_maxpool_backward(dy, x, y, pdims):
    """``maxpool_backward`` through the stages: each stage's input is recomputed, then the gradient runs back."""
    stages = pool_stages(pdims)
    inputs, outputs = [reshape(x, stages[0].in_shape)], []
    for stage, after in zip(stages[:-1], stages[1:]):
        outputs.append(_maxpool(inputs[-1], stage.dims))
        inputs.append(reshape(outputs[-1], after.in_shape))
    outputs.append(reshape(y, stages[-1].dims.y_shape))
    g = reshape(dy, stages[-1].dims.y_shape)
    for i in range(len(stages) - 1, -1, -1):
        g = _maxpool_backward(g, inputs[i], outputs[i], stages[i].dims)
        g = reshape(g, stages[i - 1].dims.y_shape if i else pdims.x_shape)
    return g


def _staged_meanpool_backward(dy, pdims):
    stages = pool_stages(pdims)
    g = reshape(dy, stages[-1].dims.y_shape)
    for i in range(len(stages) - 1, -1, -1):
        g = _meanpool_backward(g, stages[i].dims)
        g = reshape(g, stages[i - 1].dims.y_shape if i else pdims.x_shape)
    return g


# ---------------------------------------------------------------------------------------------
# Max pooling: the pool, its backward (a scatter to each window's argmax) and that scatter's adjoint (a gather)


def _maxpool_rule(x, pdims):
    y = _maxpool(x, pdims)

    def maxpool_pullback(dy):
        return _maxpool_backward(dy, x, y, pdims), None
    return y, maxpool_pullback


def _maxpool_backward_rule(needs, dy, x, y, pdims):
    dx = _maxpool_backward(dy, x, y, pdims)

    # Linear in dy; the argmax is piecewise constant in x, so x and y get no gradient.
    def maxpool_backward_pullback(ddx):
        return (_maxpool_gather(ddx, x, y, pdims) if needs[0] else None), None, None, None
    return dx, maxpool_backward_pullback


def _maxpool_gather_rule(needs, dx, x, y, pdims):
    z = _maxpool_gather(dx, x, y, pdims)

    def maxpool_gather_pullback(dz):
        return (_maxpool_backward(dz, x, y, pdims) if needs[0] else None), None, None, None
    return z, maxpool_gather_pullback


_maxpool = Primitive("maxpool", _maxpool_rule,
                     impl=lambda x, pdims: lookup("maxpool_forward", x)(x, pdims))
_maxpool_backward = Primitive("maxpool_backward", _maxpool_backward_rule, needs_mask=True,
                              impl=lambda dy, x, y, pdims: lookup("maxpool_backward", dy, x)(dy, x, y, pdims))
_maxpool_gather = Primitive("maxpool_gather", _maxpool_gather_rule, needs_mask=True,
                            impl=lambda dx, x, y, pdims: lookup("maxpool_gather", dx, x)(dx, x, y, pdims))


# ---------------------------------------------------------------------------------------------
# Mean pooling: linear, so the backward's pullback is the forward


def _meanpool_rule(x, pdims):
    def meanpool_pullback(dy):
        return _meanpool_backward(dy, pdims), None
    return _meanpool(x, pdims), meanpool_pullback


def _meanpool_backward_rule(dy, pdims):
    def meanpool_backward_pullback(ddx):
        return _meanpool(ddx, pdims), None
    return _meanpool_backward(dy, pdims), meanpool_backward_pullback


_meanpool = Primitive("meanpool", _meanpool_rule,
                      impl=lambda x, pdims: lookup("meanpool_forward", x)(x, pdims))
_meanpool_backward = Primitive("meanpool_backward", _meanpool_backward_rule,
                               impl=lambda dy, pdims: lookup("meanpool_backward", dy)(dy, pdims))


# ---------------------------------------------------------------------------------------------
# Public ops


def maxpool(x: Array, kernel: int | tuple[int, ...], stride: int | tuple[int, ...] | None = None,
            pad: int | tuple[int, ...] | str = 0) -> Array:
    """The maximum over each window of ``x``.

    ``y[n, c, p, q] = max_{r < R, s < S} xpad[n, c, p*sh + r, q*sw + s]`` with ``xpad`` padded by
    ``-inf``. ``x`` ``(N, C, H, W)`` -> ``(N, C, P, Q)``, ``P = (H + top + bottom - R) // sh + 1``;
    ``(N, C, L)`` and ``(N, C, D, H, W)`` likewise.

    ``kernel``, ``stride`` (default: ``kernel``): an int or one per spatial axis. ``pad``: an int, one per axis, a
    ``(before, after)`` pair per axis (``(top, bottom, left, right)`` in 2-d) or ``"same"``. The gradient goes to
    the first maximum of each window (row-major), as PyTorch's. A window holding NaN gives NaN; where its gradient
    goes is unspecified. A pad as large as the kernel is allowed, as in NNlib: a window of padding only gives the
    lowest finite value of ``x``'s dtype (NNlib's ``nextfloat(typemin(T))``; ``-3.4028235e38`` in float32) and no
    gradient; PyTorch refuses such pads.

    >>> import numpy as np
    >>> x = np.arange(16.0).reshape(1, 1, 4, 4)
    >>> maxpool(x, 2)[0, 0]
    array([[ 5.,  7.],
           [13., 15.]])
    >>> maxpool(x, 3, stride=1, pad=1).shape
    (1, 1, 4, 4)
    >>> maxpool(np.array([[[1.0, 3.0, 2.0, 0.0, 5.0]]]), (2,))
    array([[[3., 2.]]])
    >>> maxpool(np.arange(64.0).reshape(1, 1, 4, 4, 4), (2, 2, 2))[0, 0, :, 0]
    array([[21., 23.],
           [53., 55.]])
    >>> maxpool(np.array([[[1.0, 2.0]]], np.float32), (1,), pad=(1, 0)).tolist()    # an empty window
    [[[-3.4028234663852886e+38, 1.0, 2.0]]]
    """
    pdims = pool_dims(x, kernel, stride, pad, op="maxpool")
    return _maxpool(x, pdims) if len(pdims.x_shape) == 4 else _pooled(_maxpool, x, pdims)


def meanpool(x: Array, kernel: int | tuple[int, ...], stride: int | tuple[int, ...] | None = None,
             pad: int | tuple[int, ...] | str = 0, count_include_pad: bool = True) -> Array:
    """The mean over each window of ``x``.

    ``y[n, c, p, q] = sum_{r < R, s < S} xpad[n, c, p*sh + r, q*sw + s] / (R*S)`` with ``xpad``
    zero-padded: padding counts in the mean (PyTorch's ``avg_pool2d`` default,
    ``count_include_pad=True``), and a window of padding only (a pad as large as the kernel, as NNlib allows)
    gives 0. Shapes and keywords as :func:`maxpool` (1, 2 or 3 spatial axes).

    ``count_include_pad=False`` (PyTorch's option) divides each window's sum by the number of entries of ``x`` in
    it: the pool above times ``R*S / count``, a constant per output position built once per shape and kept on the
    device (so it runs through the same kernels, and a captured step copies nothing).

    >>> import numpy as np
    >>> meanpool(np.ones((1, 1, 2, 2)), 2, stride=1, pad=(1, 0, 1, 0), count_include_pad=False)[0, 0]
    array([[1., 1.],
           [1., 1.]])

    >>> import numpy as np
    >>> meanpool(np.arange(16.0).reshape(1, 1, 4, 4), 2)[0, 0]
    array([[ 2.5,  4.5],
           [10.5, 12.5]])
    >>> meanpool(np.ones((1, 1, 2, 2)), 2, stride=1, pad=(1, 0, 1, 0))[0, 0]   # zeros count
    array([[0.25, 0.5 ],
           [0.5 , 1.  ]])
    >>> meanpool(np.arange(8.0).reshape(1, 1, 2, 2, 2), 2).ravel()
    array([3.5])
    """
    if not isinstance(count_include_pad, (bool, np.bool_)):
        raise ValueError(f"meanpool expects count_include_pad True or False, got {count_include_pad!r}")
    pdims = pool_dims(x, kernel, stride, pad, op="meanpool")
    y = _meanpool(x, pdims) if len(pdims.x_shape) == 4 else _pooled(_meanpool, x, pdims)
    if count_include_pad or not any(pdims.pad):
        return y
    return y * device_constant(("meanpool_count_exclude_pad", pdims.x_shape[2:], pdims.kernel, pdims.stride,
                                pdims.pad), lambda: _window_fractions(pdims), x)


def _window_fractions(pdims):
    """Per output position, ``R*S`` over the number of ``x``'s entries in its window (0 for a window of padding
    only), shaped ``(1, 1, *out)``: separable, the product of one count per axis."""
    factor = np.ones(())
    for i, (n, k, s) in enumerate(zip(pdims.x_shape[2:], pdims.kernel, pdims.stride)):
        start = np.arange(pdims.y_shape[2 + i]) * s - pdims.pad[2 * i]
        inside = np.minimum(start + k, n) - np.maximum(start, 0)
        per_axis = np.where(inside > 0, k / np.maximum(inside, 1), 0.0)
        factor = np.multiply.outer(factor, per_axis)
    return factor.reshape((1, 1) + tuple(pdims.y_shape[2:]))


def maxpool_backward(dy: Array, x: Array, y: Array, pdims: PoolDims | AdaptivePoolDims) -> Array:
    """The gradient of ``maxpool`` with respect to ``x``.

    Each ``dy[n, c, p, q]`` goes to the first maximum of window ``(p, q)`` of ``x``; the result has
    ``x``'s shape. ``y = maxpool(x)`` and ``pdims`` (a :class:`~fluxpy.ops.dims.PoolDims`) are those of
    the forward call. Differentiable in ``dy`` (its pullback reads ``ddx`` at the same maxima).

    >>> import numpy as np
    >>> x = np.array([[[[1.0, 5.0], [5.0, 3.0]]]])
    >>> d = PoolDims.from_array(x, 2)
    >>> maxpool_backward(np.ones((1, 1, 1, 1)), x, maxpool(x, 2), d)[0, 0]   # the first of two maxima
    array([[0., 1.],
           [0., 0.]])
    """
    _check_pool_arrays("maxpool_backward", pdims, dy=dy, x=x)
    if len(pdims.x_shape) != 4:
        return _staged_maxpool_backward(dy, x, y, pdims)
    return _maxpool_backward(dy, x, y, pdims)


def lpnormpool(x: Array, p: float, kernel: int | tuple[int, ...], stride: int | tuple[int, ...] | None = None,
               pad: int | tuple[int, ...] = 0) -> Array:
    """The ``p``-norm pool, ``(sum over each window of x**p) ** (1/p)`` (NNlib's ``lpnormpool``, PyTorch's
    ``lp_pool2d``; Gulcehre et al. 2014): :func:`meanpool` of ``x**p`` times the window's size, to the ``1/p``.
    ``p`` is a number > 0; a window whose sum of ``x**p`` is negative (odd ``p``, negative ``x``) gives NaN for a
    fractional ``1/p``, as both references do. A window of zeros gives 0 with gradient 0 (PyTorch's gives NaN
    there, ``0 ** (1/p - 1)``; ``p < 1`` keeps an infinite derivative of ``x**p`` at a zero entry). Shapes and
    keywords as :func:`meanpool` (padding adds zeros).

    >>> import numpy as np
    >>> lpnormpool(np.array([[[3.0, 4.0, 1.0, 1.0]]]), 2, 2)
    array([[[5.        , 1.41421356]]])
    """
    if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)) or not 0 < p < np.inf:
        raise ValueError(f"lpnormpool expects p to be a number in (0, inf), got {p!r}")
    k = kernel if isinstance(kernel, (tuple, list)) else (kernel,) * (len(getattr(x, "shape", ())) - 2)
    total = meanpool(x ** p, kernel, stride, pad) * math.prod(k)
    # a window of zeros (after a relu, say) has norm 0 and gradient 0, not d(s**(1/p))/ds = inf there times 0
    empty = value_of(total) == 0
    return where(empty, 0, where(empty, 1, total) ** (1 / p))


def meanpool_backward(dy: Array, pdims: PoolDims) -> Array:
    """The gradient of ``meanpool``, ``dy / (R*S)`` spread over each window.

    Returns shape ``pdims.x_shape``; differentiable in ``dy`` (its pullback is ``meanpool``).

    >>> import numpy as np
    >>> meanpool_backward(np.ones((1, 1, 1, 1)), PoolDims.from_array(np.ones((1, 1, 2, 2)), 2))[0, 0]
    array([[0.25, 0.25],
           [0.25, 0.25]])
    """
    _check_pool_arrays("meanpool_backward", pdims, dy=dy)
    if len(pdims.x_shape) != 4:
        return _staged_meanpool_backward(dy, pdims)
    return _meanpool_backward(dy, pdims)


def _check_pool_arrays(op, pdims, dy, x=None):
    check_half_mix(op, dy=dy, x=x)
    if tuple(dy.shape) != tuple(pdims.y_shape):
        raise ValueError(f"{op} expects dy of shape {pdims.y_shape} (the pool's output), got {describe('dy', dy)}")
    if x is not None and tuple(x.shape) != tuple(pdims.x_shape):
        raise ValueError(f"{op} expects x of shape {pdims.x_shape}, got {describe('x', x)}")


def global_maxpool(x: Array) -> Array:
    """The maximum over each channel's image, ``(N, C, H, W)`` -> ``(N, C, 1, 1)`` (1 to 3 spatial axes, each
    to size 1).

    The gradient goes to the first maximum, as :func:`maxpool` with ``kernel=(H, W)``.

    >>> import numpy as np
    >>> global_maxpool(np.arange(8.0).reshape(1, 2, 2, 2))[:, :, 0, 0]
    array([[3., 7.]])
    >>> global_maxpool(np.arange(8.0).reshape(1, 2, 4)).shape
    (1, 2, 1)
    """
    _check_spatial("global_maxpool", "x", x)
    return _pooled(_maxpool, x, PoolDims.from_array(x, tuple(x.shape[2:]), op="global_maxpool"))


def global_meanpool(x: Array) -> Array:
    """The mean over each channel's image, ``(N, C, H, W)`` -> ``(N, C, 1, 1)`` (1 to 3 spatial axes).

    >>> import numpy as np
    >>> global_meanpool(np.arange(8.0).reshape(1, 2, 2, 2))[:, :, 0, 0]
    array([[1.5, 5.5]])
    """
    _check_spatial("global_meanpool", "x", x)
    return mean(x, axis=tuple(range(2, len(x.shape))), keepdims=True)


def adaptive_maxpool(x: Array, out_hw: int | tuple[int, ...]) -> Array:
    """Max pooling to a fixed output size ``(N, C, *out_hw)``.

    Output ``(i, j)`` is the maximum over rows ``floor(i*H/P) <= h < ceil((i+1)*H/P)`` and the
    columns likewise (PyTorch's ``adaptive_max_pool2d`` bins, which may overlap). ``out_hw``: an
    int or one size per spatial axis (1, 2 or 3 of them). The gradient goes to the first maximum of each bin.

    >>> import numpy as np
    >>> adaptive_maxpool(np.arange(25.0).reshape(1, 1, 5, 5), 2)[0, 0]
    array([[12., 14.],
           [22., 24.]])
    >>> adaptive_maxpool(np.arange(5.0).reshape(1, 1, 5), (2,))
    array([[[2., 4.]]])
    """
    return _pooled(_maxpool, x, AdaptivePoolDims.from_array(x, out_hw, op="adaptive_maxpool"))


def adaptive_meanpool(x: Array, out_hw: int | tuple[int, ...]) -> Array:
    """Mean pooling to a fixed output size ``(N, C, *out_hw)``.

    The bins are :func:`adaptive_maxpool`'s. A bin's mean is separable, so each spatial axis is contracted with
    an averaging matrix (``y = A_h @ x @ A_w.T`` in 2-d, ``A_h`` ``(P, H)`` and ``A_w`` ``(Q, W)``), each a 2-D
    ``matmul`` over the rows (:func:`~fluxpy.ops.resample.along_axis`), differentiable through it. The matrices
    are built once per shape and dtype and kept on the device (:func:`~fluxpy.ops.constants.device_constant`),
    so a captured step copies nothing from the host.

    >>> import numpy as np
    >>> adaptive_meanpool(np.arange(16.0).reshape(1, 1, 4, 4), (1, 2))[0, 0]
    array([[6.5, 8.5]])
    >>> adaptive_meanpool(np.arange(8.0).reshape(1, 1, 2, 2, 2), 1).ravel()
    array([3.5])
    """
    dims = AdaptivePoolDims.from_array(x, out_hw, op="adaptive_meanpool")
    if is_half(x.dtype):   # averaged in float32, rounded once to x's dtype
        return astype(adaptive_meanpool(astype(x, np.float32), out_hw), x.dtype)
    dtype = np.result_type(x.dtype, np.float32)
    y = x
    for axis in range(len(x.shape) - 1, 1, -1):   # the last axis first: each a 2-D product, A.T on the right
        size, n = dims.x_shape[axis], dims.out_hw[axis - 2]
        a = device_constant(("adaptive_meanpool", size, n), lambda size=size, n=n: _averaging_matrix(size, n).T,
                            x, dtype)   # (size, n), kept on the device
        y = along_axis(y, axis, a)
    return y
