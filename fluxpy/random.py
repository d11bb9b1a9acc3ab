"""fluxpy's global random generator and :func:`seed`, the one way to make a run reproducible (Flux's ``Random.seed!``).

Everything in fluxpy that draws random numbers without being given a generator draws from here:
the weight initialisers of :mod:`fluxpy.layers.init` (``rng=None``, so every layer built without
``rng=``), :func:`fluxpy.dropout` and the ``Dropout`` layer (their masks), and
:class:`fluxpy.DataLoader` (its shuffled order). ``seed(n)`` resets all of them: after it, a
script builds the same model, draws the same dropout masks and the same batch orders every time.
Without a call to ``seed`` the generator starts from fresh operating-system entropy.

The NumPy generator is one ``numpy.random.Generator`` object for the whole process, reset in place
by ``seed(n)`` to the stream of ``numpy.random.default_rng(n)``, so objects that hold it (a
``DataLoader`` made before ``seed``) follow the reset. Dropout masks of GPU arrays are drawn on the
GPU by that module's generator, made on first use from a seed derived from ``n``: reproducible from
run to run, but not the same numbers as the CPU's. The generator is the kernel table's
``"default_rng"`` for the module (:func:`fluxpy.kernels.kernel_for`: for CuPy, a Philox generator
whose position lives on the device, so that a step captured as a CUDA graph draws new masks at every
replay), else the module's own ``random.default_rng``. fluxpy keeps its generators to itself: CuPy's
global generator (``cupy.random``) is never replaced.

NumPy's legacy global state (``np.random.seed``, ``np.random.rand``) is a different generator:
``seed`` leaves it alone, and fluxpy never uses it.

>>> import numpy as np
>>> seed(0)
>>> a = default_rng().random(3)
>>> seed(0)
>>> bool(np.array_equal(a, default_rng().random(3)))
True
>>> bool(np.array_equal(a, np.random.default_rng(0).random(3)))  # the stream of default_rng(n)
True
"""
from __future__ import annotations

import numbers
import zlib
from typing import Any

import numpy as np

from .kernels import kernel_for

__all__ = ["seed", "default_rng", "as_rng", "rng_for", "RNG"]

#: What an ``rng=`` argument accepts: a ``numpy.random.Generator``, a seed (an int >= 0), or ``None`` (the global one).
RNG = np.random.Generator | int | None

_generator = np.random.Generator(np.random.PCG64())  # fresh entropy until seed() is called
_seed: list = [None]  # the last seed given to seed(); None: fresh entropy
# array module -> (what made it, its generator): NumPy's is the global one, another module's (CuPy's) is made on
# first use and again when the kernel table's "default_rng" for it changes (fluxpy.kernels.gpu.unregister)
_device_generators: dict = {np: (None, _generator)}


def seed(n: int) -> None:
    """Reset fluxpy's global random generators to the seed ``n`` (an int >= 0), like Flux's ``Random.seed!``.

    Afterwards the default weight initialisers, dropout masks and ``DataLoader`` shuffles repeat
    exactly from run to run. The NumPy generator then gives the stream of
    ``numpy.random.default_rng(n)``; the GPU generator is remade from ``n`` when next used.

    >>> from fluxpy.layers import Dense
    >>> seed(42); w1 = Dense(3, 2).weight
    >>> seed(42); w2 = Dense(3, 2).weight
    >>> bool((w1 == w2).all())
    True
    >>> seed(-1)
    Traceback (most recent call last):
    ...
    ValueError: seed expects an int >= 0, got -1
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"seed expects an int >= 0, got {_describe(n)}")
    if n < 0:
        raise ValueError(f"seed expects an int >= 0, got {int(n)}")
    _generator.bit_generator.state = np.random.PCG64(int(n)).state
    _seed[0] = int(n)
    _device_generators.clear()
    _device_generators[np] = (None, _generator)


def default_rng() -> np.random.Generator:
    """fluxpy's global ``numpy.random.Generator``: the one reset by :func:`seed` (always the same object).

    >>> default_rng() is default_rng()
    True
    """
    return _generator


def as_rng(rng: Any, who: str = "rng") -> np.random.Generator:
    """``rng`` as a ``numpy.random.Generator``: itself, a new one from a seed, or the global one for ``None``.

    Also takes a ``numpy.random.SeedSequence`` or ``BitGenerator``. Anything else (a float, a
    negative int, a legacy ``RandomState``) is a ``TypeError``/``ValueError`` naming ``who``.

    >>> as_rng(None) is default_rng()
    True
    >>> as_rng(3).random() == np.random.default_rng(3).random()
    True
    >>> as_rng(1.5, "DataLoader")
    Traceback (most recent call last):
    ...
    TypeError: DataLoader expects rng to be a numpy.random.Generator, an int seed >= 0 or None, got float 1.5
    """
    if rng is None:
        return _generator
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (np.random.SeedSequence, np.random.BitGenerator)):
        return np.random.default_rng(rng)
    if isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
        if rng < 0:
            raise ValueError(f"{who} expects an int seed >= 0, got {int(rng)}")
        return np.random.default_rng(int(rng))
    raise TypeError(f"{who} expects rng to be a numpy.random.Generator, an int seed >= 0 or None, "
                    f"got {_describe(rng)}")


def rng_for(xp: Any) -> Any:
    """The global generator for arrays of the module ``xp``: :func:`default_rng` for NumPy.

    For another module (CuPy), ``make(s)``, made on first use, with ``s`` derived from the last
    :func:`seed` (fresh entropy if none), so that random arrays are drawn where they live. ``make`` is
    the kernel table's ``"default_rng"`` for ``xp`` (fluxpy's Philox generator for CuPy), else
    ``xp.random.default_rng``.

    >>> rng_for(np) is default_rng()
    True
    """
    made = _device_generators.get(xp)
    if made is not None and made[0] is None:   # NumPy's: the global generator, reset in place by seed()
        return made[1]
    make = kernel_for("default_rng", xp) or xp.random.default_rng
    if made is None or made[0] is not make:
        made = _device_generators[xp] = (make, make(_derived_seed(getattr(xp, "__name__", repr(xp)))))
    return made[1]


def _derived_seed(name):
    """A 32-bit seed for the module ``name``: fixed by the last seed(n), fresh entropy before any."""
    if _seed[0] is None:
        sequence = np.random.SeedSequence()
    else:
        sequence = np.random.SeedSequence(_seed[0], spawn_key=(zlib.crc32(name.encode()),))
    return int(sequence.generate_state(1)[0])


def _describe(x):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{type(x).__name__} of shape {tuple(x.shape)} {x.dtype}"
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
