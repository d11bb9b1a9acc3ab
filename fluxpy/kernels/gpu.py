"""GPU registrations: route fluxpy's generic entry points to the CUDA kernels for CuPy arrays.

``register()`` makes :func:`fluxpy.unbroadcast` reduce CuPy gradients with the deterministic
mapreducedim kernel :func:`fluxpy.kernels.reduce.mapreduce`. It does nothing and returns
``False`` where CuPy cannot be imported, so it is safe to call unconditionally, once, after
``fluxpy.broadcast`` is importable (e.g. at the end of ``fluxpy/__init__.py``)::

    from .kernels import gpu as _gpu
    _gpu.register()

``unregister()`` restores the default (``cupy.sum``).

>>> isinstance(register(), bool)
True
"""
from __future__ import annotations

from ..backend import cupy

__all__ = ["register", "unregister"]


def register() -> bool:
    """Register the CuPy implementations; ``True`` if CuPy is present (and they were registered).

    >>> register() == (cupy is not None)
    True
    """
    if cupy is None:
        return False
    from ..broadcast import register_reducer
    from .reduce import unbroadcast_sum
    register_reducer(cupy.ndarray, unbroadcast_sum)
    return True


def unregister() -> None:
    """Undo :func:`register`: CuPy gradients go back to ``cupy.sum``.

    >>> unregister()
    """
    if cupy is None:
        return
    from ..broadcast import register_reducer
    register_reducer(cupy.ndarray, None)
