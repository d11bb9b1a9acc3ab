"""fluxpy's own group-norm kernels for CuPy arrays (``cuda/groupnorm.cu``): two launches forward, three backward,
an activation fused into both directions, deterministic.

The composite (a reshape, :func:`fluxpy.ops.norm.normalise`, the per-channel affine through broadcasting, the
activation) runs a dozen elementwise kernels and reductions each way, several of them in float32 on half data.
Here ``gn_stats`` reduces each (sample, group) in a block, ``gn_apply`` writes ``act((x - mean) * rstd * gamma +
beta)``; the backward sums ``dz = dy * act'`` and ``dz * xhat`` per (sample, channel) (``gn_bwd_channels`` for C
order, a block a channel; ``gn_bwd_groups_cl`` for channels-last, a block a group), makes each group's coefficients
and the parameters' gradients from those sums in a fixed order (``gn_bwd_finish``), and writes ``dx``
(``gn_bwd_apply``). The pre-activation is recomputed from ``x`` (neither it nor ``y`` is kept). Channels-last data
whose groups' channels do not divide the block is copied to C order first
(:func:`fluxpy.kernels.cuda_arrays.c_contiguous`) and the results are given back in its layout.
float16 and bfloat16 compute in float32 with float32 ``gamma``, ``beta``, statistics and parameter gradients.

>>> sorted(KERNELS)
['groupnorm_backward', 'groupnorm_forward']
"""
from __future__ import annotations

import numpy as np

from ..backend import cupy
from ..layout import is_channels_last, like_layout
from . import compiler
from .cuda_arrays import c_contiguous
from .answers import answered
from .elementwise import fuses
from .halfs import KERNEL_DTYPES, compute_dtype, dtype_defines
from .trace import activation_c

__all__ = ["supports", "forward", "backward", "SOURCE_VARIANTS", "KERNELS"]

_THREADS = 256
_NULL = np.uint64(0)


def _identity(v):
    return v


_variants: dict = {}


def _defines(dtype, act=None):
    """``cuda/groupnorm.cu``'s defines: the dtype's and the activation's formula and derivative (None: identity)."""
    def make():
        f = _identity if act is None else act
        return {**dtype_defines(dtype), "FX_ACT(v)": activation_c(f, dtype, "v"),
                "FX_ACT_GRAD(v)": activation_c(f, dtype, "v", derivative=True)}
    return answered(_variants, (np.dtype(dtype), act), make, kept=None)


def SOURCE_VARIANTS(activations=()):
    """``(source, defines)`` of the variants launched: every dtype without an activation, float32 with each of
    ``activations``.

    >>> len(list(SOURCE_VARIANTS()))
    4
    """
    for dtype in KERNEL_DTYPES:
        yield "groupnorm.cu", _defines(dtype)
    for act in activations:
        yield "groupnorm.cu", _defines(np.dtype(np.float32), act)


def _fn(name, dtype, act):
    return compiler.function("groupnorm.cu", name, _defines(dtype, act))


def supports(x, gamma, beta, groups, eps, act=None) -> bool:
    """CuPy float16/bfloat16/float32/float64 ``(N, C, ...)`` arrays (any layout) whose groups divide ``C``, with
    ``gamma``/``beta`` (or None) ``(C,)`` arrays of the compute dtype, and an activation (or None) that the
    elementwise tracer compiles."""
    if act is not None and not fuses(act):
        return False
    if type(x) is not cupy.ndarray or x.dtype not in KERNEL_DTYPES or x.ndim < 2 or x.size == 0:
        return False
    c = x.shape[1]
    if c % groups:
        return False
    pdt = compute_dtype(x.dtype)
    return all(p is None or (type(p) is cupy.ndarray and p.dtype == pdt and p.shape == (c,)) for p in (gamma, beta))


def _geometry(x, groups):
    n, c = x.shape[0], x.shape[1]
    s = x.size // (n * c)
    return n, c, s, c // groups


def _grid(units, dev):
    return (int(max(1, min(units, 32 * compiler.device(dev).processors))),)


def _p(a):
    return _NULL if a is None else a


def _native(x, groups):
    """Whether ``x`` runs in its own layout: C order, or channels-last with a group's channels dividing the block
    (each thread of ``gn_bwd_groups_cl`` then meets one channel); else it is copied to C order around the kernels."""
    return x._c_contiguous or (is_channels_last(x) and _THREADS % (x.shape[1] // groups) == 0)


def forward(x, gamma, beta, groups, eps, act=None):
    """``(y, mean, rstd)``: ``y = act(groupnorm(x) * gamma + beta)`` in ``x``'s layout, the statistics ``(N *
    groups,)`` in the compute dtype."""
    xc = x if _native(x, groups) else c_contiguous(x)
    cl = np.int32(not xc._c_contiguous)
    n, c, s, cg = _geometry(xc, groups)
    runs, dev = n * groups, xc.device.id
    pdt = compute_dtype(x.dtype)
    stats = cupy.empty((2, runs), pdt)
    mean, rstd = stats[0], stats[1]
    _fn("gn_stats", x.dtype, act)(_grid(runs, dev), (_THREADS,), (xc, np.int64(runs), np.int64(s), np.int64(c),
                                                                   np.int64(cg), cl, pdt.type(eps), mean, rstd))
    y = cupy.empty_like(xc)   # in xc's layout
    total = xc.size
    _fn("gn_apply", x.dtype, act)(_grid(-(-total // _THREADS), dev), (_THREADS,),
                                   (xc, _p(gamma), _p(beta), mean, rstd, y, np.int64(total), np.int64(s),
                                    np.int64(c), np.int64(cg), cl))
    return like_layout(y, x), mean, rstd


def backward(dy, x, gamma, beta, mean, rstd, groups, act=None, need_params=True):
    """``(dx, dgamma, dbeta)`` of :func:`forward` (``dx`` in ``x``'s layout; the last two None without
    ``need_params`` or without ``gamma``)."""
    xc = x if _native(x, groups) else c_contiguous(x)
    dyc = like_layout(dy, xc)
    cl = np.int32(not xc._c_contiguous)
    n, c, s, cg = _geometry(xc, groups)
    dev, pdt = xc.device.id, compute_dtype(x.dtype)
    part = cupy.empty((2, n * c), pdt)   # sum(dz), sum(dz * xhat) per (sample, channel)
    dbeta_part, dgamma_part = part[0], part[1]
    sums_args = (dyc, xc, _p(gamma), _p(beta), mean, rstd, dbeta_part, dgamma_part)
    if cl:
        _fn("gn_bwd_groups_cl", x.dtype, act)(_grid(n * groups, dev), (_THREADS,),
                                               (*sums_args, np.int64(n * groups), np.int64(s), np.int64(c),
                                                np.int64(cg)))
    else:
        _fn("gn_bwd_channels", x.dtype, act)(_grid(n * c, dev), (_THREADS,),
                                              (*sums_args, np.int64(n * c), np.int64(s), np.int64(c), np.int64(cg)))
    params = need_params and gamma is not None
    coef = cupy.empty((2, n * groups), pdt)
    grads = cupy.empty((2, c), pdt) if params else None
    units = n * groups + (c if params else 0)
    _fn("gn_bwd_finish", x.dtype, act)((-(-units // _THREADS),), (_THREADS,),
                                        (_p(gamma), dbeta_part, dgamma_part, coef[0], coef[1],
                                         _p(None if grads is None else grads[0]),
                                         _p(None if grads is None else grads[1]), np.int64(n), np.int64(c),
                                         np.int64(cg), np.int64(cg * s)))
    dx = cupy.empty_like(xc)
    total = xc.size
    _fn("gn_bwd_apply", x.dtype, act)(_grid(-(-total // _THREADS), dev), (_THREADS,),
                                       (dyc, xc, _p(gamma), _p(beta), mean, rstd, coef[0], coef[1], dx,
                                        np.int64(total), np.int64(s), np.int64(c), np.int64(cg), cl))
    if grads is None:
        return like_layout(dx, x), None, None
    return like_layout(dx, x), grads[0], grads[1]


def backward_supports(dy, x, gamma, beta, mean, rstd, groups, act=None, need_params=True) -> bool:
    """:func:`supports` of the forward's arguments, and ``dy`` a CuPy array of ``x``'s shape and dtype."""
    return type(dy) is cupy.ndarray and dy.shape == x.shape and dy.dtype == x.dtype and \
        supports(x, gamma, beta, groups, 0.0, act)


KERNELS = {"groupnorm_forward": (forward, supports), "groupnorm_backward": (backward, backward_supports)}
