"""Kernels behind the ops, chosen by array module (NNlib's CUDA extension; JAX's ``register_lowering``).

An op's rule calls ``lookup("conv_forward", x)(x, w, cdims)`` and never changes; each backend
registers its implementations under the name of the array module they take (``"numpy"``,
``"cupy"``). :mod:`fluxpy.kernels.cpu` registers the NumPy ones on import.

>>> import numpy as np
>>> lookup("conv_forward", np.ones(1)).__module__
'fluxpy.kernels.cpu'
"""
from __future__ import annotations

from ..backend import get_array_module

__all__ = ["register", "lookup", "find"]

_KERNELS = {}


def register(name, module, fn):
    """``register(name, module, fn)``: use ``fn`` for op ``name`` on arrays of ``module`` ("numpy", "cupy").

    >>> import numpy as np
    >>> register("conv_forward", "numpy", lookup("conv_forward", np.ones(1)))   # re-register the same
    """
    _KERNELS[(name, module)] = fn


def lookup(name, *arrays):
    """``lookup(name, *arrays)``: the implementation of ``name`` for the module owning ``arrays``.

    Raises ``NotImplementedError`` naming the op and the module when none is registered.

    >>> import numpy as np
    >>> lookup("maxpool_forward", np.ones(1)).__name__
    'maxpool_forward'
    """
    module = get_array_module(*arrays).__name__
    fn = _KERNELS.get((name, module))
    if fn is None:
        raise NotImplementedError(f"{name}: no kernel is registered for {module} arrays")
    return fn


def find(name, *arrays):
    """``find(name, *arrays)``: like :func:`lookup`, but None where no kernel is registered (an optional
    fused kernel, e.g. one that only the GPU backend has).

    >>> import numpy as np
    >>> find("logit_crossentropy_rows", np.ones(1)) is None
    True
    """
    return _KERNELS.get((name, get_array_module(*arrays).__name__))


from . import cpu  # noqa: E402,F401  (registers the NumPy kernels)
