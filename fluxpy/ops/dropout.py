"""Inverted dropout (NNlib ``src/dropout.jl``): zero each entry with probability ``p``, scale the rest by ``1/(1-p)``.

The mask is a plain array (a constant for the tape), so the gradient is ``dy * mask``. On the GPU, with fluxpy's
generator and a mask over every axis, the mask and the product are one kernel (``cuda/dropout.cu``: the generator's
numbers, the composite's values) and the op one node of the tape.

>>> import numpy as np
>>> y = dropout(np.ones((2, 4)), 0.5, rng=np.random.default_rng(0))
>>> sorted(set(y.ravel().tolist()))
[0.0, 2.0]
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ..autodiff import Primitive, Tracked, value_of
from ..backend import Array, get_array_module
from ..capturing import refuse
from ..kernels import find
from ..random import as_rng, rng_for
from .fused import fused_op
from .reduce import normalize_axis

__all__ = ["dropout", "dropout_mask", "alpha_dropout"]


def _check_p(p):
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p <= 1:
        shown = repr(p) if isinstance(p, numbers.Real) else f"{type(p).__name__}"
        raise ValueError(f"dropout: p must be a probability in [0, 1], got {shown}")


def dropout_mask(x: Array, p: float, *, rng: Any = None, dims: int | tuple[int, ...] | None = None) -> Array:
    """The scaled keep-mask of dropout, ``(u >= p) / (1 - p)`` with ``u ~ U[0, 1)``.

    The mask has ``x``'s size along ``dims`` and size 1 along the other axes (it is shared
    there, as Flux's ``dims``); ``dims=None`` means every axis. Its dtype is ``x``'s (float16 and bfloat16 too:
    drawn and scaled in float32, rounded once), so ``x * mask`` keeps ``x``'s dtype.

    >>> import numpy as np
    >>> dropout_mask(np.ones((3, 2, 5)), 0.25, rng=np.random.default_rng(1), dims=1).shape
    (1, 2, 1)
    """
    _check_p(p)
    v = value_of(x)
    xp = get_array_module(v)
    u = _uniform(v, rng, dims, "dropout")
    if p == 1:   # everything dropped (Flux, PyTorch): zeros, not 0 * inf
        return xp.zeros(u.shape, v.dtype)
    return _in_dtype((u >= p).astype(u.dtype) * (1 / (1 - p)), v.dtype)


def _in_dtype(a, dtype):
    """``a`` (computed in ``u``'s float32 or float64) in ``x``'s dtype: a float16 or bfloat16 input gets a mask of
    its own dtype, so the product stays in it (a float32 mask would make it float32 under mixed precision)."""
    return a.astype(dtype, copy=False)


def _uniform(v, rng, dims, who):
    """``U[0, 1)`` numbers of ``v``'s shape (size 1 off ``dims``), on ``v``'s device, from ``rng`` (a generator or
    a seed; by default the array module's global generator)."""
    xp = get_array_module(v)
    axes = normalize_axis(dims, v.ndim, who)
    shape = tuple(v.shape) if axes is None else tuple(s if i in axes else 1 for i, s in enumerate(v.shape))
    if rng is None:
        rng = rng_for(xp)
    elif not hasattr(rng, "random"):
        rng = as_rng(rng, who)  # a seed; anything else is a TypeError naming the op
    if not getattr(rng, "capturable", False):
        refuse(f"{who}: its random numbers come from a generator whose position the host advances (a NumPy "
               "generator, or rng= given); a CUDA graph would replay the same mask every step")
    dtype = v.dtype if v.dtype in (np.float32, np.float64) else np.float32
    u = rng.random(shape, dtype=dtype)
    if get_array_module(u) is not xp:  # a NumPy generator for device arrays: the mask is drawn on the host
        u = xp.asarray(u)
    return u


# SELU's constants (Klambauer et al. 2017), as NNlib's
_SELU_LAMBDA = 1.0507009873554804934193349852946
_SELU_ALPHA = 1.6732632423543772848170429916717


def alpha_dropout(x: Array, p: float, *, rng: Any = None, active: bool = True) -> Array:
    """Alpha dropout (Klambauer et al. 2017; Flux's ``AlphaDropout``): entries are set to SELU's negative
    saturation ``-lambda * alpha`` with probability ``p``, then the whole is moved by ``a x + b`` so that inputs of
    mean 0 and variance 1 keep them: ``a = ((1 - p) (1 + p alpha'^2))^(-1/2)``, ``b = -a alpha' p``. The mask is a
    constant for the tape (the gradient is ``a dy`` where kept, 0 elsewhere). ``p`` in ``[0, 1]``; ``p = 1``
    gives zeros (Flux, PyTorch).

    >>> import numpy as np
    >>> y = alpha_dropout(np.random.default_rng(0).standard_normal(100_000), 0.2, rng=np.random.default_rng(1))
    >>> round(float(y.mean()), 1), round(float(y.std()), 1)
    (0.0, 1.0)
    """
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p <= 1:
        raise ValueError(f"alpha_dropout: p must be a probability in [0, 1], got {p!r}")
    if not active or p == 0:
        return x
    if p == 1:   # everything dropped: zeros and a zero gradient (Flux's AlphaDropout(1), PyTorch's alpha_dropout)
        return x * 0
    v = value_of(x)
    u = _uniform(v, rng, None, "alpha_dropout")
    keep = (u >= p).astype(u.dtype)
    drop_value = -_SELU_LAMBDA * _SELU_ALPHA
    a = ((1 - p) * (1 + p * drop_value ** 2)) ** -0.5
    b = -a * drop_value * p
    return x * _in_dtype(a * keep, v.dtype) + _in_dtype(a * drop_value * (1 - keep) + b, v.dtype)


def dropout(x: Array, p: float, *, rng: Any = None, dims: int | tuple[int, ...] | None = None,
            active: bool = True) -> Array:
    """Inverted dropout: ``x * mask`` with ``mask = (u >= p) / (1 - p)``.

    Each entry of ``x`` is zeroed with probability ``p`` and the others are scaled by
    ``1/(1-p)``, so the expectation is ``x``. ``dims`` (an axis or tuple of axes) are the axes
    along which the mask varies; it is shared along all others (``dims=(0, 1)`` on NCHW drops
    whole channels). ``rng`` is a ``numpy.random.Generator`` or an int seed (for CuPy arrays
    the mask is then drawn on the host and moved), or a CuPy generator for CuPy arrays; by default the global
    generator of the array module (:func:`fluxpy.random.rng_for`), which :func:`fluxpy.seed`
    resets, so masks repeat from run to run after ``fluxpy.seed(n)``. ``active=False`` or ``p == 0``
    returns ``x`` unchanged; ``p == 1`` gives zeros (and a zero gradient), as Flux and PyTorch. ``p`` outside
    ``[0, 1]`` is an error.

    >>> import numpy as np
    >>> from fluxpy import gradient
    >>> x = np.ones(6)
    >>> dropout(x, 0.5, active=False) is x
    True
    >>> g, = gradient(lambda x: dropout(x, 0.5, rng=np.random.default_rng(3)).sum(), x)
    >>> bool(np.all((g == 0) | (g == 2)))
    True
    """
    _check_p(p)
    if not active or p == 0:
        return x
    if dims is None:
        v = value_of(x)
        generator = rng_for(get_array_module(v)) if rng is None else rng
        kernel = find("dropout", v, p, generator)
        if kernel is not None:   # the GPU generator's: one kernel, the mask kept
            return _dropout(x, p, generator, kernel)
    return x * dropout_mask(x, p, rng=rng, dims=dims)


def _dropout_rule(x, p, rng, kernel):
    y, mask = kernel(value_of(x), p, rng)
    if type(x) is Tracked:   # a derivative of a derivative: the output recorded on the outer tape too
        y = x * mask

    def dropout_pullback(dy):
        return dropout_backward(dy, mask), None, None, None
    return y, dropout_pullback


_dropout = Primitive("dropout", _dropout_rule, impl=lambda x, p, rng, kernel: kernel(x, p, rng, False)[0])

dropout_backward = fused_op("dropout_backward", lambda dy, mask: dy * mask, doc="""
    ``dy * mask``, the cotangent of :func:`dropout`'s input (one vectorised kernel on the GPU where ``dy`` and
    ``mask`` share dtype, shape and layout).

    >>> import numpy as np
    >>> dropout_backward(np.ones(3), np.array([0.0, 2.0, 2.0]))
    array([0., 2., 2.])
    """)
