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


def rand32(*dims: int | tuple[int, ...], rng: RNG = None) -> np.ndarray:
    """Uniform entries on ``[0, 1)`` (Flux's ``rand32``).

    >>> w = rand32(2, 3, rng=0)
    >>> w.shape, w.dtype, bool(((0 <= w) & (w < 1)).all())
    ((2, 3), dtype('float32'), True)
    """
    return _rng(rng, "rand32").random(_shape(dims, "rand32")).astype(np.float32)


def _normal_cdf(z):
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def truncated_normal(*dims: int | tuple[int, ...], rng: RNG = None, mean: float = 0.0, std: float = 1.0,
                     lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    """Normal with ``mean`` and ``std``, truncated to ``[lo, hi]`` (bounds in the entries' units, not in standard
    deviations: Flux's ``truncated_normal`` and PyTorch's ``trunc_normal_``).

    Drawn by rejection: each entry outside ``[lo, hi]`` is drawn again. Bounds holding less than 1e-4 of the
    probability are an error (Flux warns when ``mean`` is more than 2 ``std`` outside them).

    >>> w = truncated_normal(100, 50, rng=0, std=2.0, lo=-1.0, hi=3.0)
    >>> w.shape, bool(w.min() >= -1.0 and w.max() <= 3.0)
    ((100, 50), True)
    """
    shape = _shape(dims, "truncated_normal")
    if not (std > 0 and lo < hi):
        raise ValueError(f"truncated_normal expects std > 0 and lo < hi, got std={std!r}, lo={lo!r}, hi={hi!r}")
    mass = _normal_cdf((hi - mean) / std) - _normal_cdf((lo - mean) / std)
    if mass < 1e-4:
        raise ValueError(f"truncated_normal: [lo, hi] = [{lo}, {hi}] holds {mass:.2g} of the normal with mean "
                         f"{mean} and std {std}; give bounds nearer the mean")
    generator = _rng(rng, "truncated_normal")
    out = generator.normal(mean, std, shape)
    bad = (out < lo) | (out > hi)
    while bad.any():
        out[bad] = generator.normal(mean, std, int(bad.sum()))
        bad = (out < lo) | (out > hi)
    return out.astype(np.float32)


def lecun_normal(*dims: int | tuple[int, ...], rng: RNG = None, gain: float = 1.0) -> np.ndarray:
    """:func:`truncated_normal` with mean 0 and standard deviation ``gain / sqrt(fan_in)``, truncated to
    ``[-2, 2]`` as Flux's ``lecun_normal`` (LeCun et al. 1998; the initialiser of ``selu`` networks).

    >>> lecun_normal(16, 8, 3, 3, rng=0).shape
    (16, 8, 3, 3)
    """
    shape = _shape(dims, "lecun_normal")
    return truncated_normal(shape, rng=_rng(rng, "lecun_normal"), std=gain / math.sqrt(nfan(shape)[0]))


def orthogonal(*dims: int | tuple[int, ...], rng: RNG = None, gain: float = 1.0) -> np.ndarray:
    """A (semi-)orthogonal matrix times ``gain`` (Saxe et al. 2014): Flux's ``orthogonal`` and PyTorch's
    ``orthogonal_``.

    The array is seen as a matrix ``(dims[0], prod(dims[1:]))`` (the output axis first, fluxpy's and PyTorch's
    layout); its rows are orthonormal when there are no more rows than columns, else its columns. It is the Q of
    the QR factorisation of a standard normal matrix, with the signs of R's diagonal, so it is uniform over the
    orthogonal matrices. At least two dimensions.

    >>> import numpy as np
    >>> w = orthogonal(3, 5, rng=0)
    >>> bool(np.allclose(w @ w.T, np.eye(3), atol=1e-6))
    True
    """
    shape = _shape(dims, "orthogonal")
    if len(shape) < 2:
        raise ValueError(f"orthogonal expects at least 2 dimensions, got {_show_dims(shape)}")
    rows, cols = shape[0], math.prod(shape[1:])
    if rows * cols == 0:
        return np.zeros(shape, np.float32)
    a = _rng(rng, "orthogonal").standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(a)
    q = q * np.where(np.diag(r) < 0, -1.0, 1.0)   # the signs of diag(r), 0 counted as +, as PyTorch's
    if rows < cols:
        q = q.T
    return (gain * q).reshape(shape).astype(np.float32)


def identity_init(*dims: int | tuple[int, ...], rng: RNG = None, gain: float = 1.0,
                  shift: int | tuple[int, ...] = 0) -> np.ndarray:
    """Weights that make a layer the identity map (Flux's ``identity_init``; PyTorch's ``eye_`` and ``dirac_``).

    A vector is zeros (a bias); a matrix ``(out, in)`` has ``gain`` on its diagonal and zeros elsewhere; a
    convolution's ``(K, C, S1, ...)`` has ``gain`` at ``[i, i, centre...]`` for ``i < min(K, C)``, the centre of
    each kernel axis of size ``d`` at index ``(d - 1) // 2`` (Flux's ``cld(d, 2)``, 1-based). ``shift`` then rolls
    the array circularly along its leading axes (an int: the first axis; a tuple: one per leading axis), as
    Flux's ``circshift``.

    >>> identity_init(2, 3, gain=2.0)
    array([[2., 0., 0.],
           [0., 2., 0.]], dtype=float32)
    >>> identity_init(2, 2, 3, 3)[:, :, 1, 1]
    array([[1., 0.],
           [0., 1.]], dtype=float32)
    """
    shape = _shape(dims, "identity_init")
    out = np.zeros(shape, np.float32)
    if len(shape) >= 2:
        centre = tuple((d - 1) // 2 for d in shape[2:])
        if all(d > 0 for d in shape[2:]):
            for i in range(min(shape[:2])):
                out[(i, i) + centre] = gain
    shifts = (shift,) if isinstance(shift, numbers.Integral) else tuple(shift)
    if not all(isinstance(s, numbers.Integral) for s in shifts) or len(shifts) > max(len(shape), 1):
        raise ValueError(f"identity_init expects shift to be an int or a tuple of at most {len(shape)} ints, "
                         f"got {shift!r}")
    return np.roll(out, shifts, axis=tuple(range(len(shifts)))) if len(shape) else out


def sparse_init(*dims: int | tuple[int, ...], sparsity: float, rng: RNG = None, std: float = 0.01) -> np.ndarray:
    """A matrix ``(rows, cols)`` of normal entries with mean 0 and standard deviation ``std``, in each column of
    which ``ceil(sparsity * rows)`` entries, at random rows, are zero (Martens 2010; Flux's ``sparse_init`` and
    PyTorch's ``sparse_``). Two dimensions only; ``0 <= sparsity <= 1``.

    >>> w = sparse_init(10, 4, sparsity=0.3, rng=0)
    >>> (w == 0).sum(axis=0).tolist()
    [3, 3, 3, 3]
    """
    shape = _shape(dims, "sparse_init")
    if len(shape) != 2:
        raise ValueError(f"sparse_init expects 2 dimensions (rows, cols), got {_show_dims(shape)}")
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real) or not 0 <= sparsity <= 1:
        raise ValueError(f"sparse_init expects 0 <= sparsity <= 1, got {sparsity!r}")
    rows, cols = shape
    generator = _rng(rng, "sparse_init")
    out = generator.normal(0.0, std, shape)
    zeros = math.ceil(sparsity * rows)
    for j in range(cols):
        out[generator.permutation(rows)[:zeros], j] = 0.0
    return out.astype(np.float32)


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The gain that keeps the variance of activations through ``nonlinearity`` (PyTorch's ``calculate_gain``):
    1 for ``"linear"``, the ``"conv*"`` names, ``"sigmoid"`` and ``"identity"``; 5/3 for ``"tanh"``; sqrt(2) for
    ``"relu"``; ``sqrt(2 / (1 + param**2))`` for ``"leaky_relu"`` (``param`` its slope, 0.01 by default); 3/4
    for ``"selu"``. Pass it as the ``gain=`` of an initialiser.

    >>> calculate_gain("tanh"), round(calculate_gain("leaky_relu", 0.2), 4)
    (1.6666666666666667, 1.3868)
    """
    ones = {"linear", "identity", "sigmoid", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
            "conv_transpose3d"}
    fixed = {"tanh": 5 / 3, "relu": math.sqrt(2.0), "selu": 3 / 4}
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else param
        if isinstance(slope, bool) or not isinstance(slope, numbers.Real):
            raise ValueError(f"calculate_gain: the negative slope of leaky_relu must be a number, got {param!r}")
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity in ones:
        return 1.0
    if nonlinearity in fixed:
        return fixed[nonlinearity]
    raise ValueError(f"calculate_gain: unsupported nonlinearity {nonlinearity!r}; expected one of "
                     f"{sorted(ones | set(fixed) | {'leaky_relu'})}")
