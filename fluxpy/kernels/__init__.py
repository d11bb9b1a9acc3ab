"""The one table from op to kernel, keyed by (op name, array module) (NNlib's CUDA extension; JAX's
``register_lowering``).

An op never asks which kernel exists. It calls either

- ``lookup(name, *arrays)(...)`` for an op every backend must implement (``conv_forward``,
  ``maxpool_forward``, ...): an error naming the op and the module where none is registered; or
- ``find(name, *args)`` for an optional fast kernel (a fused broadcast, the reducer behind
  ``unbroadcast``, a fused optimiser step): the kernel, or ``None``, and then the op runs its own
  composite of other ops. A kernel registered with ``supports`` is found only for the calls it
  accepts (``supports(*args)`` is true: a dtype it handles, a function it can compile); a kernel
  that is found always computes the result.

Each backend registers its implementations under its array module's name (``"numpy"``,
``"cupy"``): :mod:`fluxpy.kernels.cpu` on import, :mod:`fluxpy.kernels.gpu` the first time the
table is asked about CuPy arrays (by :func:`lookup`, :func:`find` or :func:`kernel_for`), so that
importing fluxpy compiles nothing and changes no other library's state (but the C heap's thresholds, which
:mod:`fluxpy.kernels.cpu_heap` raises as ``fluxpy.options.cpu_heap_keep_mb`` says). :func:`snapshot` and
:func:`restore` put the table back exactly as it was.

>>> import numpy as np
>>> lookup("conv_forward", np.ones(1)).__module__
'fluxpy.kernels.cpu'
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..backend import get_array_module

__all__ = ["register", "lookup", "find", "kernel_for", "snapshot", "restore", "registered", "registered_for",
           "BadIndex", "DeferredBadIndex"]

class BadIndex(IndexError):
    """Raised by a ``scatter`` or ``gather`` kernel called with ``checked=True`` when an index lies outside its axis:
    ``which`` index array, the ``value`` and the axis ``size`` (the op turns it into its own message).

    >>> err = BadIndex(0, 7, 5); (err.which, err.value, err.size)
    (0, 7, 5)
    """

    def __init__(self, which: int, value: int, size: int, note: str = "") -> None:
        super().__init__(note or f"index {value} in index array {which} is outside an axis of size {size}")
        self.which, self.value, self.size = which, value, size


class DeferredBadIndex(BadIndex):
    """A :class:`BadIndex` of an earlier checked ``scatter``/``gather`` call made with ``index_checks="deferred"``
    (:mod:`fluxpy.options`), reported late: by a later checked call or by ``check_indices``. Beside
    ``which``, ``value`` and ``size`` (-1 where they are not known): ``op`` (``"scatter"``, ``"gather"``, or None
    where the call is no longer recorded), ``arrays`` (its number of index arrays) and ``where`` (``"file:line"`` of
    the call into fluxpy).

    >>> err = DeferredBadIndex(0, 7, 5, op="gather", where="train.py:12"); (err.op, err.value, err.where)
    ('gather', 7, 'train.py:12')
    """

    def __init__(self, which: int, value: int, size: int, note: str = "", *, op: str | None = None, arrays: int = 1,
                 where: str = "an unknown place") -> None:
        super().__init__(which, value, size, note)
        self.op, self.arrays, self.where = op, arrays, where


# (op name, array module name) -> (kernel, supports or None)
_KERNELS: dict[tuple[str, str], tuple[Callable, Callable | None]] = {}

# Array module names whose backend has registered (or been told not to): the table is asked no more about them.
# Checked without the lock, so it gains a name only once that backend's entries are all in the table.
_settled: set[str] = {"numpy"}
_loading: set[str] = set()  # names whose backend the thread holding _backend_lock is registering now
_backend_lock = threading.RLock()


def _module_name(args) -> str:
    """The name of the array module of ``args``; its backend is registered first if this is its first use."""
    name = get_array_module(*args).__name__
    if name not in _settled:
        _first_use(name)
    return name


def _first_use(name: str) -> None:
    """Register the backend of the array module ``name`` (fluxpy's CUDA kernels for ``"cupy"``), once.

    Other threads wait on the lock until the table is whole; a lookup made by the registering thread
    itself (while a kernel module is imported) sees the table as it is.
    """
    with _backend_lock:
        if name in _settled or name in _loading:
            return
        _loading.add(name)
        try:
            if name == "cupy":
                gpu.register()
        finally:
            _loading.discard(name)
        _settled.add(name)


def _settle(name: str) -> None:
    """Mark ``name``'s backend as decided (registered, or unregistered on purpose): no first-use registration."""
    _settled.add(name)


def register(name: str, module: str, fn: Callable, supports: Callable | None = None) -> None:
    """Use ``fn`` for op ``name`` on arrays of ``module`` (``"numpy"`` or ``"cupy"``), replacing any other.

    ``supports(*args) -> bool`` limits an optional kernel to the calls it handles: it is given the
    arguments that the op passes to :func:`find` (the call's arguments, or the leading ones that
    decide), and where it says no, ``find`` returns None and the op runs its composite.

    >>> import numpy as np
    >>> register("conv_forward", "numpy", lookup("conv_forward", np.ones(1)))   # re-register the same
    """
    _KERNELS[(name, module)] = (fn, supports)


def lookup(name: str, *arrays) -> Callable:
    """The implementation of ``name`` for the module owning ``arrays``.

    Raises ``NotImplementedError`` naming the op and the module when none is registered.

    >>> import numpy as np
    >>> lookup("gather", np.ones(1)).__name__
    'gather'
    """
    module = _module_name(arrays)
    entry = _KERNELS.get((name, module))
    if entry is None:
        raise NotImplementedError(f"{name}: no kernel is registered for {module} arrays")
    return entry[0]


def find(name: str, *args) -> Callable | None:
    """The optional kernel for ``name`` on these arguments: ``None`` where none is registered for the
    arrays' module, or where the kernel's ``supports(*args)`` turns this call down.

    >>> import numpy as np
    >>> find("logit_crossentropy_rows", np.ones(1)) is None
    True
    """
    entry = _KERNELS.get((name, _module_name(args)))
    if entry is None:
        return None
    fn, supports = entry
    return fn if supports is None or supports(*args) else None


def kernel_for(name: str, module: Any) -> Callable | None:
    """The kernel for ``name`` registered for the array module ``module`` (the module, or its name), or ``None``:
    for what has no array argument to dispatch on, as a module's default random generator (``"default_rng"``,
    called with a seed).

    >>> import numpy as np
    >>> kernel_for("conv_forward", np) is lookup("conv_forward", np.ones(1)), kernel_for("default_rng", "numpy")
    (True, None)
    """
    name_of_module = module if isinstance(module, str) else getattr(module, "__name__", None)
    if name_of_module is None:
        return None
    if name_of_module not in _settled:
        _first_use(name_of_module)
    entry = _KERNELS.get((name, name_of_module))
    return None if entry is None else entry[0]


def registered(module: str | None = None) -> list[tuple[str, str]]:
    """The ``(name, module)`` pairs in the table, sorted; only ``module``'s when given.

    >>> ("conv_forward", "numpy") in registered("numpy")
    True
    """
    return sorted(k for k in _KERNELS if module is None or k[1] == module)


def registered_for(name: str) -> list[Callable]:
    """Every module's kernel for ``name``, by module name: for an op with no array argument to dispatch on (as
    ``check_indices``, which asks each backend).

    >>> "fluxpy.kernels.cpu" in [fn.__module__ for fn in registered_for("gather")]
    True
    """
    return [_KERNELS[k][0] for k in sorted(_KERNELS) if k[0] == name]


def snapshot() -> dict:
    """A copy of the whole table, for :func:`restore`. The CUDA kernels are registered first where CuPy is present
    and they have not been yet (as on first use), so that restoring never takes away kernels registered in between.

    >>> restore(snapshot())
    """
    if "cupy" not in _settled:
        _first_use("cupy")
    return dict(_KERNELS)


def restore(table: dict) -> None:
    """Put back a table taken by :func:`snapshot`: entries added since are removed, replaced ones restored.

    >>> import numpy as np
    >>> before = snapshot()
    >>> register("my_op", "numpy", abs)
    >>> restore(before)
    >>> find("my_op", np.ones(1)) is None
    True
    """
    _KERNELS.clear()
    _KERNELS.update(table)


from . import cpu  # noqa: E402,F401  (registers the NumPy kernels)
from . import gpu  # noqa: E402  (registers the CUDA kernels, on first use)
