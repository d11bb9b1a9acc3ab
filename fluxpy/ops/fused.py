"""Ops with an optional fused kernel: the composite defines the op, a kernel may run it faster.

``fused_op(name, composite)`` makes an op that runs, on plain arrays, the kernel registered under
``name`` for their module where one accepts the call (:func:`fluxpy.kernels.find`), and otherwise
``composite``, written with fluxpy ops. On Tracked values (a nested ``gradient``) it always runs
``composite``, which the tape records op by op, so the op differentiates to any order. This is how
a faster fused backward becomes an op of its own (``bias_act_backward``, ``broadcast_backward``, ...):
the rule calls it and never asks which kernel exists.

>>> import numpy as np
>>> double = fused_op("double", lambda x: x * 2, doc="Twice x.")
>>> double(np.ones(2))
array([2., 2.])
"""
from __future__ import annotations

from collections.abc import Callable

from ..autodiff import Tracked
from ..kernels import find

__all__ = ["fused_op"]


def fused_op(name: str, composite: Callable, doc: str | None = None) -> Callable:
    """The op ``name``: a registered kernel on plain arrays where one accepts the call, else ``composite``.

    >>> import numpy as np
    >>> from fluxpy import gradient
    >>> cube = fused_op("cube", lambda x: x * x * x)
    >>> gradient(lambda x: cube(x).sum(), np.array([2.0]))
    (array([12.]),)
    """
    def op(*args):
        for a in args:
            if type(a) is Tracked:
                return composite(*args)
        kernel = find(name, *args)
        return composite(*args) if kernel is None else kernel(*args)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc or composite.__doc__
    op.composite = composite
    return op
