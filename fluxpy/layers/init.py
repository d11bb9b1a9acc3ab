"""Weight initialisers (Flux's ``src/utils.jl``): float32 arrays of a given shape.

Each takes the dimensions as ints or as one tuple, and ``rng``: a ``numpy.random.Generator``, a
seed, or ``None`` for fresh entropy. Fans follow fluxpy's layout, see :func:`nfan`.
"""
from __future__ import annotations

import math

import numpy as np

RNG = np.random.Generator | int | None


def _shape(dims):
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return tuple(int(d) for d in dims)


def _rng(rng):
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def nfan(*dims: int | tuple[int, ...]) -> tuple[int, int]:
    """The ``(fan_in, fan_out)`` of a weight of shape ``dims`` in fluxpy's layout.

    ``(out, in)`` for Dense; ``(K, C, R, S)`` for Conv gives ``(C*R*S, K*R*S)``; a vector ``(n,)``
    gives ``(1, n)``.

    >>> nfan(16, 1, 3, 3), nfan(10, 288), nfan(7)
    ((9, 144), (288, 10), (1, 7))
    """
    dims = _shape(dims)
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
    shape = _shape(dims)
    fan_in, fan_out = nfan(shape)
    bound = gain * math.sqrt(6 / (fan_in + fan_out))
    return _rng(rng).uniform(-bound, bound, shape).astype(np.float32)


def glorot_normal(*dims: int | tuple[int, ...], rng: RNG = None, gain: float = 1.0) -> np.ndarray:
    """Normal with mean 0 and standard deviation ``gain * sqrt(2 / (fan_in + fan_out))``.

    >>> glorot_normal((2, 5), rng=0).dtype
    dtype('float32')
    """
    shape = _shape(dims)
    fan_in, fan_out = nfan(shape)
    std = gain * math.sqrt(2 / (fan_in + fan_out))
    return (_rng(rng).standard_normal(shape) * std).astype(np.float32)


def kaiming_uniform(*dims: int | tuple[int, ...], rng: RNG = None, gain: float = math.sqrt(2)) -> np.ndarray:
    """Uniform on ``(-a, a)`` with ``a = gain * sqrt(3 / fan_in)`` (He et al. 2015).

    >>> w = kaiming_uniform(4, 6, rng=0)
    >>> bool(abs(w).max() <= 2 ** 0.5 * (3 / 6) ** 0.5)
    True
    """
    shape = _shape(dims)
    bound = gain * math.sqrt(3 / nfan(shape)[0])
    return _rng(rng).uniform(-bound, bound, shape).astype(np.float32)


def kaiming_normal(*dims: int | tuple[int, ...], rng: RNG = None, gain: float = math.sqrt(2)) -> np.ndarray:
    """Normal with mean 0 and standard deviation ``gain / sqrt(fan_in)`` (He et al. 2015).

    >>> kaiming_normal(8, 3, 3, 3, rng=0).shape
    (8, 3, 3, 3)
    """
    shape = _shape(dims)
    std = gain / math.sqrt(nfan(shape)[0])
    return (_rng(rng).standard_normal(shape) * std).astype(np.float32)


def randn32(*dims: int | tuple[int, ...], rng: RNG = None) -> np.ndarray:
    """Standard normal entries (Flux's default for :class:`Embedding`).

    >>> randn32(2, 3, rng=0).shape
    (2, 3)
    """
    return _rng(rng).standard_normal(_shape(dims)).astype(np.float32)


def zeros32(*dims: int | tuple[int, ...], rng: RNG = None) -> np.ndarray:
    """Zeros; ``rng`` is accepted and ignored, so it fits any ``init=``.

    >>> zeros32(2)
    array([0., 0.], dtype=float32)
    """
    return np.zeros(_shape(dims), dtype=np.float32)


def ones32(*dims: int | tuple[int, ...], rng: RNG = None) -> np.ndarray:
    """Ones; ``rng`` is accepted and ignored.

    >>> ones32(2)
    array([1., 1.], dtype=float32)
    """
    return np.ones(_shape(dims), dtype=np.float32)
