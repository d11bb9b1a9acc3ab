"""Clipping by the global norm of all gradients: PyTorch's ``torch.nn.utils.clip_grad_norm_`` on a gradient tree.

Flux's and Optimisers.jl's :class:`~fluxpy.optimise.ClipNorm` clips each array by its own norm; this clips the
whole gradient by the norm of all its arrays together, as PyTorch does. It is named :func:`clip_grad_norm`,
PyTorch's name without the trailing underscore because it returns new arrays instead of changing the gradient in
place (Flux has no function for it).
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import numpy as np

from ..backend import Array, get_array_module, is_array, is_float_dtype
from ..capturing import refuse

__all__ = ["clip_grad_norm"]

_EPS = 1e-6   # PyTorch's: keeps the scale finite where every gradient is zero


def _arrays(tree: Any) -> list[Array]:
    """The arrays of a gradient tree (dicts, lists and tuples of arrays; ``None`` where there is no gradient)."""
    if tree is None:
        return []
    if isinstance(tree, dict):
        return [a for v in tree.values() for a in _arrays(v)]
    if isinstance(tree, (list, tuple)):
        return [a for v in tree for a in _arrays(v)]
    if is_array(tree):
        return [tree]
    raise TypeError(f"clip_grad_norm expects a gradient tree of dicts, lists, tuples, arrays and None, got "
                    f"{type(tree).__name__}")


def _scaled(tree: Any, scale: Array) -> Any:
    """``tree`` with each array multiplied by ``scale`` (in the array's dtype); the structure kept."""
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {k: _scaled(v, scale) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        out = [_scaled(v, scale) for v in tree]
        return type(tree)(*out) if hasattr(tree, "_fields") else type(tree)(out)
    return tree * scale.astype(tree.dtype)


def _norm(g: Array, p: float, dtype) -> Array:
    """The ``p``-norm of every entry of ``g`` as a 0-d array of ``dtype`` on ``g``'s device, by elementwise ops and
    reductions only (no cuBLAS, which a CUDA-graph capture refuses); half precision is summed in float32."""
    xp = get_array_module(g)
    if g.size == 0:
        return xp.zeros((), dtype)
    a = xp.abs(g.astype(dtype, copy=False))
    if p == math.inf:
        return a.max()
    if p == 2:
        return xp.sqrt(xp.square(a).sum())
    if p == 1:
        return a.sum()
    return (a ** p).sum() ** (1 / p)


def _check(max_norm, p):
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm >= 0:
        raise ValueError(f"clip_grad_norm: max_norm must be a number >= 0, got {max_norm!r}")
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (p > 0 or p == math.inf) or math.isnan(p):
        raise ValueError(f"clip_grad_norm: p must be a number > 0 or math.inf, got {p!r}")


def clip_grad_norm(grad: Any, max_norm: float, p: float = 2, *, error_if_nonfinite: bool = False
                   ) -> tuple[Any, Array]:
    """``(clipped, total)``: the gradient tree ``grad`` scaled so that the ``p``-norm of all its arrays together is
    at most ``max_norm``, and that norm before clipping (PyTorch's ``clip_grad_norm_``, returning new arrays).

    ``total = norm([norm(g, p) for g in arrays], p)`` (``p=math.inf``: the largest absolute entry), each array's
    norm taken in float32 (float64 for float64 arrays); every array is multiplied by
    ``scale = min(1, max_norm / (total + 1e-6))``. ``total`` and ``scale`` are 0-d arrays on the gradient's device
    and nothing is read on the host, so the clip runs inside a captured :class:`fluxpy.TrainStep`. ``grad`` is a
    tree as :func:`fluxpy.gradient` returns for a model: dicts, lists and tuples of arrays, ``None`` where there
    is no gradient (kept as ``None``); the arrays must share a device.

    NaN and infinity follow PyTorch: a NaN in any gradient makes ``total`` and every clipped array NaN; an infinite
    ``total`` makes ``scale`` 0, so finite entries become 0 and infinite ones NaN. ``error_if_nonfinite=True``
    reads ``total`` on the host instead and raises ``FloatingPointError`` when it is not finite (eagerly only: a
    captured step cannot read the host, and raises :class:`fluxpy.capturing.CaptureUnsupported`; its update guard
    skips a non-finite step already).

    >>> import numpy as np
    >>> grad = {"w": np.array([3.0, 0.0]), "b": np.array([4.0]), "c": None}
    >>> clipped, total = clip_grad_norm(grad, 1.0)
    >>> float(total), clipped["w"].round(6), clipped["b"].round(6), clipped["c"]
    (5.0, array([0.6, 0. ]), array([0.8]), None)
    >>> float(clip_grad_norm(grad, 10.0, p=math.inf)[1])
    4.0
    """
    _check(max_norm, p)
    arrays = _arrays(grad)
    if not arrays:
        return grad, np.zeros((), np.float32)
    xp = get_array_module(*arrays)
    for a in arrays:
        if not is_float_dtype(a.dtype):
            raise TypeError(f"clip_grad_norm expects floating-point gradients, got an array of dtype {a.dtype} "
                            f"and shape {tuple(a.shape)}")
    dtype = np.float64 if any(a.dtype == np.float64 for a in arrays) else np.float32
    # combined one by one rather than stacked: CuPy's stack of many arrays copies their addresses from the host
    norms = [_norm(a, p, dtype) for a in arrays]
    if p == math.inf:
        total = functools.reduce(xp.maximum, norms)
    else:
        total = functools.reduce(xp.add, [n ** p for n in norms]) ** (1 / p)
    total = xp.asarray(total)
    if error_if_nonfinite:
        refuse("clip_grad_norm: error_if_nonfinite reads the norm on the host, which a captured step cannot; leave "
               "it False there (the step's guard skips a non-finite update)")
        if not bool(xp.isfinite(total)):
            raise FloatingPointError(f"clip_grad_norm: the total {p}-norm of the gradient is {float(total)}")
    # Python numbers, not arrays made from them: a kernel takes them as arguments, where making a device array
    # would copy from the host, which a capture refuses
    scale = xp.minimum(max_norm / (total + _EPS), 1.0)
    return _scaled(grad, scale), total
