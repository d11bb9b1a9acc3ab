"""Weight initialisers (Flux's ``src/utils.jl``): float32 arrays of a given shape.

Each takes the dimensions as ints or as one tuple, and ``rng``: a ``numpy.random.Generator``, a
seed (an int >= 0), or ``None`` for fluxpy's global generator, which :func:`fluxpy.seed` resets (so
``fluxpy.seed(0)`` before building a model makes its weights the same on every run). Fans follow
fluxpy's layout, see :func:`nfan`. A negative or non-integer dimension is an error naming the initialiser.

>>> from fluxpy.random import seed
>>> seed(0); a = glorot_uniform(2, 3)
>>> seed(0); bool((a == glorot_uniform(2, 3)).all())
True
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..random import RNG, as_rng


def _shape(dims, who="init"):
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0:
            raise ValueError(f"{who} expects dimensions that are ints >= 0, got {_show_dims(dims)}")
    return tuple(int(d) for d in dims)


def _show_dims(dims):
    text = repr(tuple(dims))
    return text if len(text) <= 80 else text[:77] + "..."


def _rng(rng, who="init"):
    return as_rng(rng, who)


def nfan(*dims: int | tuple[int, ...]) -> tuple[int, int]:
    """The ``(fan_in, fan_out)`` of a weight of shape ``dims`` in fluxpy's layout.

    ``(out, in)`` for Dense; ``(K, C, R, S)`` for Conv gives ``(C*R*S, K*R*S)``; a vector ``(n,)``
    gives ``(1, n)``.

    >>> nfan(16, 1, 3, 3), nfan(10, 288), nfan(7)
    ((9, 144), (288, 10), (1, 7))
    """
    dims = _shape(dims, "nfan")
    if len(dims) == 0:
        return 1, 1
    if len(dims) == 1:
        return 1, dims[0]
    receptive = math.prod(dims[2:])
    return dims[1] * receptive, dims[0] * receptive


def glorot_uniform(*dims: int | tuple[int, ...], rng: RNG = None, gain: float = 1.0) -> np.ndarray:
    """Uniform on ``(-a, a)`` with ``a = gain * sqrt(6 / (fan_in + fan_out))`` (Glorot & Bengio 2010).

    The default initialiser of :class:`Dense` and :class:`Conv`.

    >>> w = glorot_uniform(3, 4, rng=0)
    >>> w.shape, w.dtype, bool(abs(w).max() <= (6 / 7) ** 0.5)
    ((3, 4), dtype('float32'), True)
    """
    shape = _shape(dims, "glorot_uniform")
    fan_in, fan_out = nfan(shape)
    bound = gain * math.sqrt(6 / (fan_in + fan_out))
    return _rng(rng, "glorot_uniform").uniform(-bound, bound, shape).astype(np.float32)


def glorot_normal(*dims: int | tuple[int, ...], rng: RNG = None, gain: float = 1.0) -> np.ndarray:
    """Normal with mean 0 and standard deviation ``gain * sqrt(2 / (fan_in + fan_out))``.

    >>> glorot_normal((2, 5), rng=0).dtype
    dtype('float32')
    """
    shape = _shape(dims, "glorot_normal")
    fan_in, fan_out = nfan(shape)
    std = gain * math.sqrt(2 / (fan_in + fan_out))
    return (_rng(rng, "glorot_normal").standard_normal(shape) * std).astype(np.float32)


def kaiming_uniform(*dims: int | tuple[int, ...], rng: RNG = None, gain: float = math.sqrt(2)) -> np.ndarray:
    """Uniform on ``(-a, a)`` with ``a = gain * sqrt(3 / fan_in)`` (He et al. 2015).

    >>> w = kaiming_uniform(4, 6, rng=0)
    >>> bool(abs(w).max() <= 2 ** 0.5 * (3 / 6) ** 0.5)
    True
    """
    shape = _shape(dims, "kaiming_uniform")
    bound = gain * math.sqrt(3 / nfan(shape)[0])
    return _rng(rng, "kaiming_uniform").uniform(-bound, bound, shape).astype(np.float32)


def kaiming_normal(*dims: int | tuple[int, ...], rng: RNG = None, gain: float = math.sqrt(2)) -> np.ndarray:
    """Normal with mean 0 and standard deviation ``gain / sqrt(fan_in)`` (He et al. 2015).

    >>> kaiming_normal(8, 3, 3, 3, rng=0).shape
    (8, 3, 3, 3)
    """
    shape = _shape(dims, "kaiming_normal")
    std = gain / math.sqrt(nfan(shape)[0])
    return (_rng(rng, "kaiming_normal").standard_normal(shape) * std).astype(np.float32)


def randn32(*dims: int | tuple[int, ...], rng: RNG = None) -> np.ndarray:
    """Standard normal entries (Flux's default for :class:`Embedding`).

    >>> randn32(2, 3, rng=0).shape
    (2, 3)
    """
    return _rng(rng, "randn32").standard_normal(_shape(dims, "randn32")).astype(np.float32)


def zeros32(*dims: int | tuple[int, ...], rng: RNG = None) -> np.ndarray:
    """Zeros; ``rng`` is accepted and ignored, so it fits any ``init=``.

    >>> zeros32(2)
    array([0., 0.], dtype=float32)
    """
    return np.zeros(_shape(dims, "zeros32"), dtype=np.float32)


def ones32(*dims: int | tuple[int, ...], rng: RNG = None) -> np.ndarray:
    """Ones; ``rng`` is accepted and ignored.

    >>> ones32(2)
    array([1., 1.], dtype=float32)
    """
    return np.ones(_shape(dims, "ones32"), dtype=np.float32)
