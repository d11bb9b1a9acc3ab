"""Every setting of fluxpy in one place, set for the whole process or for a block (as ``jax.config`` and
``torch.backends``).

>>> from fluxpy.options import options
>>> options.deterministic                          # read one
False
>>> with options(deterministic=True):              # a block: the old value comes back after it, error or not
...     options.deterministic
True
>>> options.deterministic
False
>>> old = options.set(allow_tf32=True)             # the whole process; the previous values come back
>>> old, options.allow_tf32
({'allow_tf32': False}, True)
>>> _ = options.set(**old)
>>> sorted(options.get())[:3]                      # all of them, as a dict
['allow_tf32', 'autotune', 'cache_dir']
>>> options.set(index_checks="later")
Traceback (most recent call last):
...
ValueError: fluxpy.options: index_checks expects 'wait' or 'deferred', got 'later'

Each option and its default: :class:`Options`. The environment variables, read once, when this module is imported
(an empty one counts as unset):

- ``FLUXPY_CACHE``: ``cache_dir`` (unset: ``$XDG_CACHE_HOME/fluxpy``, else ``~/.cache/fluxpy``);
- ``FLUXPY_CHECKS``: ``value_checks`` (``1``, ``0`` or ``auto``; also ``true``/``false``, ``yes``/``no``,
  ``on``/``off``);
- ``FLUXPY_CUDNN_LIBRARY``: ``cudnn_library``;
- ``FLUXPY_CUBLAS_LIBRARY``: ``cublas_library``;
- ``FLUXPY_CPU_HEAP_KEEP_MB``: ``cpu_heap_keep_mb``.

A value is checked before anything changes: an unknown name or a bad value raises (``TypeError`` for a name,
``ValueError`` for a value) naming the option, what it expects and what it got, and leaves every option as it was.
The settings are the process's (every thread sees the same ones). Cached cuDNN plans and algorithm choices are kept
per ``(allow_tf32, deterministic, workspace_limit, autotune, search_budget_ms)``, so changing one of those selects
afresh, and changing it back finds the earlier choices again.

No other module of fluxpy reads these variables, and this one imports nothing of fluxpy: every layer may import it.
"""
from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Options", "options"]


class _Bad(ValueError):
    """A value an option does not take; the message says what it expects."""


# ---------------------------------------------------------------------------------------------
# What each option takes: a check returns the value as the option holds it, or raises _Bad("expects ...")


def _flag(value):
    if isinstance(value, bool):
        return value
    raise _Bad("True or False")


def _count(value):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise _Bad("an int >= 0")


def _milliseconds(value):
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise _Bad("a number of milliseconds >= 0")


def _heap_megabytes(value):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value <= 2047:
        return int(value)
    raise _Bad("a number of MiB from 0 to 2047 (glibc takes a C int of bytes)")


def _one_of(*choices):
    def check(value):
        if any(value is c or (isinstance(value, str) and value == c) for c in choices):
            return value
        raise _Bad(", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}")
    return check


def _folder(value):
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return os.path.expanduser(os.fspath(value))
    raise _Bad("a folder (a non-empty str or path)")


def _library(value):
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return os.fspath(value)
    raise _Bad("a library path (a non-empty str or path) or None")


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "allow_tf32": _flag,
    "deterministic": _flag,
    "workspace_limit": _count,
    "autotune": _count,
    "search_budget_ms": _milliseconds,
    "disk_cache": _flag,
    "cache_dir": _folder,
    "index_checks": _one_of("wait", "deferred"),
    "value_checks": _one_of("auto", True, False),
    "mutation_checks": _one_of("auto", True, False),
    "cudnn_library": _library,
    "cublas_library": _library,
    "cpu_heap_keep_mb": _heap_megabytes,
}


# ---------------------------------------------------------------------------------------------
# The defaults, from the environment


def _cache_dir(environ):
    root = environ.get("FLUXPY_CACHE")
    if root:
        return root
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return os.path.join(xdg, "fluxpy")


_WORDS = {"": "auto", "auto": "auto", "1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def _value_checks(environ):
    text = environ.get("FLUXPY_CHECKS", "")
    word = text.strip().lower()
    if word not in _WORDS:
        raise ValueError(f"FLUXPY_CHECKS (the option value_checks) expects 1, 0 or auto, got {text!r}")
    return _WORDS[word]


def _cpu_heap_keep_mb(environ):
    text = environ.get("FLUXPY_CPU_HEAP_KEEP_MB", "").strip()
    if not text:
        return 256
    try:
        return _heap_megabytes(int(text))
    except (ValueError, _Bad):
        raise ValueError(f"FLUXPY_CPU_HEAP_KEEP_MB (the option cpu_heap_keep_mb) expects a number of MiB from 0 to "
                         f"2047, got {text!r}") from None


def _defaults(environ: Mapping[str, str]) -> dict:
    """Every option's default, the environment variables applied."""
    return {
        "allow_tf32": False,
        "deterministic": False,
        "workspace_limit": 4 << 30,
        "autotune": 8,
        "search_budget_ms": 2000.0,
        "disk_cache": True,
        "cache_dir": _cache_dir(environ),
        "index_checks": "deferred",
        "value_checks": _value_checks(environ),
        "mutation_checks": "auto",
        "cudnn_library": environ.get("FLUXPY_CUDNN_LIBRARY") or None,
        "cublas_library": environ.get("FLUXPY_CUBLAS_LIBRARY") or None,
        "cpu_heap_keep_mb": _cpu_heap_keep_mb(environ),
    }


def _checked(values: dict) -> dict:
    """``values`` as the options hold them; raises for an unknown name or a bad value before anything changes."""
    unknown = [name for name in values if name not in _CHECKS]
    if unknown:
        raise TypeError(f"fluxpy.options: no option {unknown[0]!r}; expected one of {', '.join(sorted(_CHECKS))}")
    out = {}
    for name, value in values.items():
        try:
            out[name] = _CHECKS[name](value)
        except _Bad as bad:
            raise ValueError(f"fluxpy.options: {name} expects {bad}, got {value!r}") from None
    return out


# ---------------------------------------------------------------------------------------------
# The options


_EFFECTS: dict[str, Callable[[Any], Any]] = {}   # option -> what setting it does beyond storing it (take_effect)


class Options:
    """fluxpy's settings; :data:`options` is the one instance.

    The options, each with its default and, where there is one, the environment variable read when fluxpy is imported:

    - ``allow_tf32`` (False): float32 convolutions and matrix products may use TF32 tensor cores (about 3e-4 relative
      error); off, cuDNN runs them with ``CUDNN_FMA_MATH``. The halves always may use tensor cores, float64 never does.
    - ``deterministic`` (False): only algorithms that give the same bits every run (the cuDNN engines not marked
      non-deterministic, the deterministic scatter implementations).
    - ``workspace_limit`` (``4 << 30``, 4 GiB): the most workspace, in bytes, a cuDNN algorithm may take.
    - ``autotune`` (8): how many finalized cuDNN execution plans are timed per problem, the fastest kept; 0 takes the
      first that finalizes, in the heuristics' order, untimed.
    - ``search_budget_ms`` (2000.0): milliseconds per new problem for the search past cuDNN's heuristics (every
      engine, then the knobs of the fastest); 0 turns it off. Needs ``autotune`` > 0.
    - ``disk_cache`` (True): read and write the cuDNN algorithm choices on disk, under ``cache_dir``.
    - ``cache_dir`` (``$FLUXPY_CACHE``, else ``$XDG_CACHE_HOME/fluxpy``, else ``~/.cache/fluxpy``): the folder of the
      files fluxpy keeps between runs: the cuDNN choices (``cudnn/``), downloaded data sets (``mnist/``, ``cifar10/``).
    - ``index_checks`` (``"deferred"``): how ``scatter``/``gather`` (and ``Embedding``) report an index out
      of range that their GPU kernels find (and skip). ``"deferred"``: the call does not wait; the error, naming the op
      and the entry, comes where the device is read anyway: the loss ``fluxpy.train`` reads, ``fluxpy.check_indices()``
      or the next checked call. ``"wait"``: each such call waits for its kernel and raises ``IndexError`` at once (a
      host sync per call: for debugging). Host indices are checked before any work either way.
    - ``value_checks`` (``"auto"``; ``$FLUXPY_CHECKS``: ``1``, ``0`` or ``auto``): when the losses read their inputs'
      values to check them. ``"auto"``: NumPy arrays only (no host sync on the GPU); True: every device (a sync per
      check, for debugging); False: never. Shape checks are always on.
    - ``mutation_checks`` (``"auto"``): whether a gradient refuses an array changed in place between the forward
      pass that read it and the backward pass (:mod:`fluxpy.mutation`). ``"auto"``: NumPy arrays; True: CuPy
      arrays too, in eager steps (a reduction and a host read per array, for debugging); False: never.
    - ``cudnn_library`` (``$FLUXPY_CUDNN_LIBRARY``, else None): the ``libcudnn.so.9`` to load instead of the
      ``nvidia-cudnn-cu13`` wheel's or the system's; read when cuDNN is first loaded.
    - ``cublas_library`` (``$FLUXPY_CUBLAS_LIBRARY``, else None): the libcublas to load where CuPy has loaded none
      (else ``ctypes.util.find_library("cublas")``); read when cuBLAS is first loaded.
    - ``cpu_heap_keep_mb`` (``$FLUXPY_CPU_HEAP_KEEP_MB``, else 256): how many MiB of freed memory the C heap keeps for
      the next CPU step instead of giving it back to the system, so that a step's large arrays reuse pages rather
      than fault fresh ones (:mod:`fluxpy.kernels.cpu_heap`; glibc only); 0 leaves ``malloc`` as it is. Takes
      effect when fluxpy is imported and each time it is set.

    Read one as an attribute (``options.deterministic``), all with :meth:`get`; set them with :meth:`set` (for
    the process) or ``with options(name=value, ...):`` (for a block). ``Options(environ)`` starts from the
    defaults that ``environ`` (``os.environ`` by default) gives.

    >>> Options({"FLUXPY_CACHE": "/tmp/fx"}).cache_dir
    '/tmp/fx'
    >>> options.no_such_option
    Traceback (most recent call last):
    ...
    AttributeError: fluxpy.options: no option 'no_such_option'; expected one of allow_tf32, autotune, \
cache_dir, cpu_heap_keep_mb, cublas_library, cudnn_library, deterministic, disk_cache, index_checks, \
mutation_checks, search_budget_ms, value_checks, workspace_limit
    """

    # The values live in the instance's __dict__, so reading one is a plain attribute lookup (kernels read them
    # on every call); __setattr__ refuses, so they change only through set(), which checks them.

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.__dict__.update(_checked(_defaults(os.environ if environ is None else environ)))

    def __getattr__(self, name: str):
        raise AttributeError(f"fluxpy.options: no option {name!r}; expected one of {', '.join(sorted(_CHECKS))}")

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"fluxpy.options: set {name} with options.set({name}=...) or in a block, "
                             f"with options({name}=...): ...")

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_CHECKS))

    def __repr__(self) -> str:
        return "fluxpy.options(" + ", ".join(f"{k}={v!r}" for k, v in self.get().items()) + ")"

    def get(self) -> dict:
        """Every option and its value (a new dict, sorted by name).

        >>> options.get()["index_checks"]
        'deferred'
        """
        return {name: self.__dict__[name] for name in sorted(_CHECKS)}

    def set(self, **values) -> dict:
        """Set options for the whole process; returns their previous values, so ``options.set(**old)`` restores
        them. Every name and value is checked before any option changes.

        >>> old = options.set(workspace_limit=1 << 20, deterministic=True)
        >>> options.workspace_limit, sorted(old)
        (1048576, ['deterministic', 'workspace_limit'])
        >>> _ = options.set(**old)
        """
        new = _checked(values)
        old = {name: self.__dict__[name] for name in new}
        self.__dict__.update(new)
        for name in new:
            if name in _EFFECTS:
                _EFFECTS[name](new[name])
        return old

    def take_effect(self, name: str, effect: Callable[[Any], Any]) -> None:
        """Run ``effect(value)`` now and each time option ``name`` is set: for an option that changes something
        outside fluxpy (the C heap's thresholds), applied by the module that owns that thing.

        >>> seen = []
        >>> options.take_effect("autotune", seen.append)
        >>> with options(autotune=3):
        ...     pass
        >>> seen
        [8, 3, 8]
        >>> del _EFFECTS["autotune"]
        """
        if name not in _CHECKS:
            raise TypeError(f"fluxpy.options: no option {name!r}; expected one of {', '.join(sorted(_CHECKS))}")
        _EFFECTS[name] = effect
        effect(self.__dict__[name])

    def __call__(self, **values) -> _Block:
        """A block with these options: ``with options(deterministic=True): ...``. The values are checked here;
        they take effect when the block starts and the previous ones come back when it ends, also on an error.

        >>> with options(index_checks="wait", autotune=0):
        ...     options.index_checks, options.autotune
        ('wait', 0)
        >>> options.index_checks
        'deferred'
        """
        return _Block(self, _checked(values))


class _Block:
    """The context manager of ``with options(...)``."""

    def __init__(self, owner: Options, values: dict) -> None:
        self._owner, self._values, self._saved = owner, values, []

    def __enter__(self) -> Options:
        self._saved.append(self._owner.set(**self._values))
        return self._owner

    def __exit__(self, *exc) -> None:
        self._owner.set(**self._saved.pop())


options = Options()
"""fluxpy's settings: ``fluxpy.options`` (see :class:`Options` and the module docstring)."""
