"""Model trees, as in Functors.jl and Optimisers.jl.

A model is a tree: tuples, lists and dicts hold their elements, and any object
with a ``__dict__`` holds its public attributes (the *children*). Everything
else (arrays, numbers, functions) is a leaf. The :func:`layer` decorator narrows
which attributes are children and which of those are trainable.

>>> import numpy as np
>>> @layer(trainable=("w",))
... class Scale:
...     def __init__(self, n):
...         self.w = np.ones(n)
...         self.running = np.zeros(n)
>>> m = Scale(2)
>>> [a.shape for a in trainables(m)]
[(2,)]
>>> sorted(state(m))
['running', 'w']
"""
from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .backend import Array, copy_into, is_array, to_cpu, to_gpu

__all__ = ["layer", "children", "fmap", "fmapstructure", "trainables", "state", "loadstate", "is_leaf", "gpu", "cpu"]

_NOT_NODES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type,
              functools.partial, np.ufunc)


def layer(cls: type | None = None, *, children: Sequence[str] | None = None,
          trainable: Sequence[str] | None = None) -> type | Callable[[type], type]:
    """Class decorator declaring a layer's children and trainable arrays.

    ``children``: attribute names that form the tree (default: every public
    attribute). ``trainable``: the subset optimisers update (default: all children).

    >>> import numpy as np
    >>> @layer(children=("w",))
    ... class Affine:
    ...     def __init__(self):
    ...         self.w = np.ones(2)
    ...         self.cache = {}
    >>> [k for k, _ in children(Affine())]
    ['w']
    """
    def decorate(c):
        c.__fluxpy_children__ = tuple(children) if children is not None else None
        c.__fluxpy_trainable__ = tuple(trainable) if trainable is not None else None
        return c
    return decorate(cls) if cls is not None else decorate


def is_leaf(x: Any) -> bool:
    """True when ``x`` has no children: arrays, numbers, strings, functions, ``None``.

    >>> import numpy as np
    >>> is_leaf(np.ones(2)), is_leaf((1, 2))
    (True, False)
    """
    return children(x) is None


def children(x: Any) -> list[tuple[Any, Any]] | None:
    """The children of node ``x`` as a list of ``(key, child)`` pairs, or ``None`` for a leaf.

    Keys are indices for tuples and lists, keys for dicts, attribute names for objects.

    >>> children((5, 6))
    [(0, 5), (1, 6)]
    """
    if isinstance(x, (tuple, list)):
        return list(enumerate(x))
    if isinstance(x, dict):
        return list(x.items())
    if is_array(x) or getattr(x, "__fluxpy_tracked__", False) or isinstance(x, _NOT_NODES):
        return None
    names = getattr(type(x), "__fluxpy_children__", None)
    if names is not None:
        return [(n, getattr(x, n)) for n in names]
    d = getattr(x, "__dict__", None)
    if d is None:
        return None
    kids = [(k, v) for k, v in d.items() if not k.startswith("_")]
    return kids or None  # an object with no public fields is a leaf (as Flux's `nothing`)


def _trainable_keys(x):
    names = getattr(type(x), "__fluxpy_trainable__", None)
    return None if names is None else set(names)


def _rebuild(x, new_kids):
    """A shallow copy of node ``x`` whose children are ``new_kids`` (same keys, same order)."""
    if isinstance(x, tuple):
        vals = [v for _, v in new_kids]
        return type(x)._make(vals) if hasattr(type(x), "_make") else type(x)(vals)
    if isinstance(x, list):
        return [v for _, v in new_kids]
    if isinstance(x, dict):
        out = copy.copy(x)
        out.update(new_kids)
        return out
    out = copy.copy(x)
    for k, v in new_kids:
        object.__setattr__(out, k, v)
    return out


def fmap(f: Callable, x: Any, *, cache: dict | None = None) -> Any:
    """A copy of tree ``x`` with every leaf replaced by ``f(leaf)``.

    Shared leaves and nodes (the same object twice, e.g. tied weights) stay shared.

    >>> fmap(lambda v: v * 10, {"a": 1, "b": (2, 3)})
    {'a': 10, 'b': (20, 30)}
    """
    cache = {} if cache is None else cache
    key = id(x)
    if key in cache:
        return cache[key][1]
    kids = children(x)
    y = f(x) if kids is None else _rebuild(x, [(k, fmap(f, v, cache=cache)) for k, v in kids])
    if kids is not None or is_array(x):
        cache[key] = (x, y)  # keep x alive so its id is not reused
    return y


def fmapstructure(f: Callable, x: Any, *, cache: dict | None = None) -> Any:
    """Like :func:`fmap`, but objects become dicts of their children (how gradients are shaped).

    >>> import numpy as np
    >>> class Lin:
    ...     def __init__(self):
    ...         self.w, self.act = np.ones(2), abs
    >>> fmapstructure(lambda v: v if isinstance(v, np.ndarray) else None, Lin())
    {'w': array([1., 1.]), 'act': None}
    """
    cache = {} if cache is None else cache
    kids = children(x)
    if kids is None:
        return f(x)
    mapped = [(k, fmapstructure(f, v, cache=cache)) for k, v in kids]
    if isinstance(x, (tuple, list)):
        return type(x)(v for _, v in mapped) if not hasattr(type(x), "_make") else type(x)._make(
            v for _, v in mapped)
    return dict(mapped)


def trainables(model: Any) -> list[Array]:
    """The distinct trainable arrays of a model, in tree order.

    >>> import numpy as np
    >>> w = np.ones(2)
    >>> len(trainables([w, w, np.arange(3)]))  # shared once; integer arrays are not trainable
    1
    """
    out, seen = [], set()

    def walk(x):
        kids = children(x)
        if kids is None:
            if is_array(x) and x.dtype.kind in "fc" and id(x) not in seen:
                seen.add(id(x))
                out.append(x)
            return
        allowed = _trainable_keys(x)
        for k, v in kids:
            if allowed is None or k in allowed:
                walk(v)
    walk(model)
    return out


def state(model: Any) -> Any:
    """The model's arrays (trainable or not) as nested dicts and lists.

    Non-array leaves are left out; the arrays are the model's own (not copies).

    >>> import numpy as np
    >>> state({"w": np.ones(1), "act": abs})
    {'w': array([1.])}
    """
    kids = children(model)
    if kids is None:
        return model if is_array(model) else None
    out = [(k, state(v)) for k, v in kids]
    out = [(k, v) for k, v in out if not _empty(v)]
    if isinstance(model, (tuple, list)):
        full = dict(out)
        return [full.get(i) for i in range(len(model))]
    return dict(out)


def _empty(st):
    return st is None or (isinstance(st, (dict, list)) and all(_empty(v) for v in (
        st.values() if isinstance(st, dict) else st)))


def loadstate(model: Any, st: Any, *, path: str = "model") -> Any:
    """Copy the arrays of the state ``st`` (as :func:`state` gives) into ``model`` in place; returns ``model``.

    Every array must match the model's in shape; a mismatch names the path.

    >>> import numpy as np
    >>> m = {"w": np.zeros(2)}
    >>> _ = loadstate(m, {"w": np.array([1.0, 2.0])})
    >>> m["w"]
    array([1., 2.])
    """
    kids = children(model)
    if kids is None:
        if is_array(model):
            _copy_into(model, st, path)
        return model
    if isinstance(model, (tuple, list)):
        if not isinstance(st, (tuple, list)) or len(st) != len(model):
            raise ValueError(f"loadstate: {path} expects a list of {len(model)} entries, got {_describe(st)}")
        pairs = [(k, v, st[k]) for k, v in kids]
    else:
        if not isinstance(st, dict):
            raise ValueError(f"loadstate: {path} expects a dict of fields, got {_describe(st)}")
        pairs = [(k, v, st.get(k)) for k, v in kids]
    for k, v, s in pairs:
        sub = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}"
        if s is None:
            if not _empty(state(v)):
                raise ValueError(f"loadstate: {sub} is missing from the state")
            continue
        loadstate(v, s, path=sub)
    return model


def _copy_into(dst, src, path):
    if not hasattr(src, "shape"):
        raise ValueError(f"loadstate: {path} expects an array of shape {dst.shape}, got {_describe(src)}")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"loadstate: {path} expects shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    copy_into(dst, src)


def _describe(x):
    if hasattr(x, "shape"):
        return f"{type(x).__name__} of shape {tuple(x.shape)}"
    return type(x).__name__


def gpu(x: Any) -> Any:
    """A copy of an array, or of a whole model tree, with every array on the GPU (Flux's ``gpu``).

    Raises :class:`fluxpy.GPUUnavailableError`, saying why, when no GPU is usable.

    >>> import numpy as np
    >>> from fluxpy.backend import GPUUnavailableError
    >>> try:
    ...     y = gpu(np.ones(3))
    ... except GPUUnavailableError:
    ...     y = None   # no GPU on this machine
    """
    return fmap(lambda a: to_gpu(a) if is_array(a) else a, x)


def cpu(x: Any) -> Any:
    """A copy of an array or model tree with every array as a NumPy array (Flux's ``cpu``).

    >>> import numpy as np
    >>> cpu({"w": np.ones(2)})["w"]
    array([1., 1.])
    """
    return fmap(to_cpu, x)
