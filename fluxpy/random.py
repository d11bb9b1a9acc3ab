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
import sys
import zlib
from typing import Any

import numpy as np

from .kernels import kernel_for

__all__ = ["seed", "default_rng", "as_rng", "rng_for", "RNG", "get_state", "set_state", "check_state"]

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


def get_state() -> dict:
    """The state of fluxpy's generators as plain data (ints, strings, dicts; JSON-ready): the NumPy generator's,
    the last :func:`seed`, and each device generator's key and positions (fluxpy's Philox generator for CuPy). A
    training checkpoint (:func:`fluxpy.save_training`) stores it, so that a resumed run draws the dropout masks
    and batch orders the run would have drawn. A device generator of another kind (no ``key`` and
    ``_offsets``) has no state here: it is made again from the seed.

    >>> seed(3); state = get_state()
    >>> a = default_rng().random(2)
    >>> set_state(state)
    >>> bool((default_rng().random(2) == a).all())
    True
    """
    devices = {}
    for xp, (make, generator) in _device_generators.items():
        if make is not None and hasattr(generator, "key") and hasattr(generator, "_offsets"):
            devices[getattr(xp, "__name__", repr(xp))] = {
                "key": [int(k) for k in generator.key],
                "offsets": {str(dev): int(offset[0]) for dev, offset in generator._offsets.items()}}
    return {"numpy": _generator.bit_generator.state, "seed": _seed[0], "devices": devices}


def set_state(state: dict) -> None:
    """Restore what :func:`get_state` returned: the NumPy generator in place (objects holding it follow), the
    seed, and the device generators' keys and positions (written into their device arrays in place, so a captured
    step keeps drawing from them). A device module that is not imported in this process (CuPy on a machine
    without a GPU) is left out. A malformed state is a ``ValueError`` before anything changes.

    >>> set_state({"numpy": "x"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: set_state expects what fluxpy.random.get_state returned (...), got a dict with numpy 'x'
    """
    check_state(state)
    _generator.bit_generator.state = state["numpy"]
    _seed[0] = state["seed"]
    for xp in [xp for xp in _device_generators if getattr(xp, "__name__", repr(xp)) not in state["devices"]]:
        if _device_generators[xp][0] is not None:   # a device's (NumPy's, made by no maker, stays)
            del _device_generators[xp]   # made again from the restored seed when next used, as after seed()
    for name, saved in state["devices"].items():
        xp = sys.modules.get(name)
        if xp is None:
            continue
        generator = rng_for(xp)   # the one in use where it exists (its arrays keep their addresses), else a new one
        if not (hasattr(generator, "key") and hasattr(generator, "_offsets")):
            continue
        generator.key = tuple(saved["key"])
        for dev, value in saved["offsets"].items():
            offset = generator._offsets.get(int(dev))
            if offset is None:
                with xp.cuda.Device(int(dev)):
                    offset = generator.offset()
            offset[...] = np.uint64(value)


def check_state(state: Any) -> None:
    """A ``ValueError`` naming what is wrong, unless ``state`` has the form :func:`get_state` returns (what
    :func:`set_state` checks before it changes anything).

    >>> check_state(get_state())
    >>> check_state({"numpy": {}, "seed": None, "devices": {}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: set_state expects what fluxpy.random.get_state returned (...), got a dict with numpy {}
    """
    problem = _state_problem(state)
    if problem is not None:
        raise ValueError("set_state expects what fluxpy.random.get_state returned ({\"numpy\": ..., \"seed\": ..., "
                         f"\"devices\": ...}}), got {problem}")


def _state_problem(state):
    if not isinstance(state, dict):
        return f"a {type(state).__name__}"
    try:
        np.random.PCG64().state = state.get("numpy")   # a throwaway generator: what PCG64 refuses, before any change
    except (TypeError, ValueError, KeyError):
        return f"a dict with numpy {state.get('numpy')!r:.60}"
    seed = state.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        return f"a dict with seed {seed!r:.60}"
    devices = state.get("devices")
    if not isinstance(devices, dict) or not all(map(_device_state_ok, devices.values())):
        return f"a dict with devices {devices!r:.60}"
    return None


def _device_state_ok(d):
    return (isinstance(d, dict) and isinstance(d.get("key"), list) and len(d["key"]) == 2
            and all(isinstance(k, int) and 0 <= k < 2 ** 32 for k in d["key"]) and isinstance(d.get("offsets"), dict)
            and all(str(o).isdigit() and isinstance(v, int) and 0 <= v < 2 ** 64 for o, v in d["offsets"].items()))


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
