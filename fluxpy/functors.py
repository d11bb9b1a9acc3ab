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

from .backend import Array, copy_into, get_array_module, is_array, is_float_dtype, to_cpu, to_gpu
from .layout import MEMORY_FORMATS, to_memory_format

__all__ = ["layer", "children", "fmap", "fmapstructure", "trainables", "arrays", "state", "loadstate", "is_leaf", "gpu",
           "cpu", "outputsize", "trainable_keys", "rebuild", "modules", "fmap_with_path"]

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
    kind = _kinds.get(type(x))
    if kind is None:   # not `or`: a layer declaring no children has the kind (), which is false
        kind = _classify(x)
    if kind is _SEQ:
        return list(enumerate(x))
    if kind is _DICT:
        return list(x.items())
    if kind is _LEAF:
        return None
    if kind is _ATTRS:
        d = getattr(x, "__dict__", None)
        if d is None:
            return None
        kids = [(k, v) for k, v in d.items() if not k.startswith("_")]
        return kids or None  # an object with no public fields is a leaf (as Flux's `nothing`)
    return [(n, getattr(x, n)) for n in kind]


# What kind of node each type is, found once per type (a model walk asks it for every node, every step):
# a leaf, a tuple or list, a dict, an object with declared children (the tuple of their names), or an
# object whose public attributes are its children.
_LEAF, _SEQ, _DICT, _ATTRS = (object() for _ in range(4))
_kinds: dict[type, Any] = {}


def _classify(x):
    if isinstance(x, (tuple, list)):
        kind = _SEQ
    elif isinstance(x, dict):
        kind = _DICT
    elif is_array(x) or getattr(x, "__fluxpy_tracked__", False) or isinstance(x, _NOT_NODES) \
            or getattr(type(x), "__fluxpy_leaf__", False):
        kind = _LEAF
    else:
        names = getattr(type(x), "__fluxpy_children__", None)
        kind = _ATTRS if names is None else tuple(names)
    _kinds[type(x)] = kind
    return kind


def trainable_keys(x: Any) -> set | None:
    """The field names ``@layer(trainable=...)`` declared for ``x``'s class, or None where it declared none (then
    every float array child is trainable).

    >>> @layer(trainable=("w",))
    ... class Affine:
    ...     def __init__(self):
    ...         self.w, self.b = 1.0, 2.0
    >>> trainable_keys(Affine()), trainable_keys([1.0])
    ({'w'}, None)
    """
    names = getattr(type(x), "__fluxpy_trainable__", None)
    return None if names is None else set(names)


def rebuild(x: Any, new_kids: list) -> Any:
    """A shallow copy of node ``x`` whose children are ``new_kids`` (``(key, value)`` pairs as :func:`children`
    gives them: same keys, same order).

    >>> rebuild({"a": 1, "b": 2}, [("a", 10), ("b", 20)]), rebuild((1, 2), [(0, 3), (1, 4)])
    ({'a': 10, 'b': 20}, (3, 4))
    """
    if isinstance(x, tuple):
        vals = [v for _, v in new_kids]
        return type(x)._make(vals) if hasattr(type(x), "_make") else type(x)(vals)
    if isinstance(x, list):
        return [v for _, v in new_kids]
    if isinstance(x, dict):
        out = copy.copy(x)
        out.update(new_kids)
        return out
    out = _shallow_copy(x)
    for k, v in new_kids:
        object.__setattr__(out, k, v)
    return out


def _shallow_copy(x):
    """``copy.copy(x)``, without its generic machinery for plain objects (a new instance sharing a copy of the
    attribute dict): the model is rebuilt this way on every gradient call."""
    cls = type(x)
    plain = _plain_types.get(cls)
    if plain is None:
        plain = _plain_types[cls] = _copies_plainly(cls, x)
    if not plain:
        return copy.copy(x)
    out = object.__new__(cls)
    out.__dict__.update(x.__dict__)
    return out


_plain_types: dict[type, bool] = {}


def _copies_plainly(cls, x):
    """Whether ``copy.copy`` of an instance of ``cls`` is just a new instance with a copy of ``__dict__``."""
    default_state = getattr(object, "__getstate__", None)
    return (hasattr(x, "__dict__") and cls.__new__ is object.__new__
            and not any("__slots__" in c.__dict__ for c in cls.__mro__)
            and getattr(cls, "__copy__", None) is None and getattr(cls, "__setstate__", None) is None
            and getattr(cls, "__getstate__", None) is default_state
            and cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__)


def fmap(f: Callable, x: Any, *, cache: dict | None = None) -> Any:
    """A copy of tree ``x`` with every leaf replaced by ``f(leaf)``.

    Shared leaves and nodes (the same object twice, e.g. tied weights) stay shared.

    >>> fmap(lambda v: v * 10, {"a": 1, "b": (2, 3)})
    {'a': 10, 'b': (20, 30)}
    """
    return _fmap(f, x, {} if cache is None else cache)


def _fmap(f, x, cache):
    key = id(x)
    hit = cache.get(key)
    if hit is not None:
        return hit[1]
    cls = type(x)
    kind = _kinds.get(cls)
    if kind is None:
        kind = _classify(x)
    if kind is _LEAF:
        y = f(x)
        if cls is np.ndarray or is_array(x):
            cache[key] = (x, y)  # keep x alive so its id is not reused
        return y
    if type(kind) is tuple and _plain_types.get(cls):
        # a layer with declared children that copies plainly (most layers): rebuild's work without its generality
        values = [_fmap(f, getattr(x, n), cache) for n in kind]
        y = object.__new__(cls)
        y.__dict__.update(x.__dict__)
        for n, v in zip(kind, values):
            object.__setattr__(y, n, v)
        cache[key] = (x, y)
        return y
    if cls is tuple:
        y = tuple([_fmap(f, v, cache) for v in x])
        cache[key] = (x, y)
        return y
    kids = children(x)
    if kids is None:   # an object without public fields: a leaf (not an array, so not cached)
        return f(x)
    y = rebuild(x, [(k, _fmap(f, v, cache)) for k, v in kids])
    cache[key] = (x, y)
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
    return _fmapstructure(f, x)


def _fmapstructure(f, x):
    kind = _kinds.get(type(x))
    if kind is _LEAF:
        return f(x)
    if type(kind) is tuple:   # a layer with declared children (most layers): children's work without the pairs
        return {n: _fmapstructure(f, getattr(x, n)) for n in kind}
    kids = children(x)
    if kids is None:
        return f(x)
    if isinstance(x, (tuple, list)):
        values = [_fmapstructure(f, v) for _, v in kids]
        return type(x)._make(values) if hasattr(type(x), "_make") else type(x)(values)
    return {k: _fmapstructure(f, v) for k, v in kids}


def modules(model: Any) -> list[Any]:
    """Every node of the model tree that is not a leaf, the model first, depth first, each once (Flux's
    ``Flux.modules``): layers, and the tuples, lists and dicts that hold them. For instance, to add a penalty on
    every Dense weight: ``sum((m.weight ** 2).sum() for m in modules(model) if isinstance(m, Dense))``.

    >>> from fluxpy import Chain, Dense
    >>> inner = Chain(Dense(2, 3), Dense(3, 2))
    >>> [type(m).__name__ for m in modules(Chain(inner, Dense(2, 1)))]
    ['Chain', 'tuple', 'Chain', 'tuple', 'Dense', 'Dense', 'Dense']
    """
    out, seen = [], set()

    def walk(x):
        kids = children(x)
        if kids is None or id(x) in seen:
            return
        seen.add(id(x))
        out.append(x)
        for _, v in kids:
            walk(v)
    walk(model)
    return out


def trainables(model: Any, path: bool = False) -> list[Array] | list[tuple[str, Array]]:
    """The distinct trainable arrays of a model, in tree order; with ``path=True``, ``(path, array)`` pairs, the
    path dotted as :func:`fluxpy.save` keys it (``"layers.0.weight"``; Flux's ``trainables(model; path=true)``,
    PyTorch's ``named_parameters()``). A tied array comes once, under its first path.

    >>> import numpy as np
    >>> w = np.ones(2)
    >>> len(trainables([w, w, np.arange(3)]))  # shared once; integer arrays are not trainable
    1
    >>> from fluxpy import Chain, Dense
    >>> [p for p, _ in trainables(Chain(Dense(2, 3), Dense(3, 1)), path=True)]
    ['layers.0.weight', 'layers.0.bias', 'layers.1.weight', 'layers.1.bias']
    """
    return _distinct_arrays(model, trainable_only=True, with_path=path)


def arrays(model: Any, path: bool = False) -> list[Array] | list[tuple[str, Array]]:
    """The distinct arrays of a model, in tree order: the trainable ones and the rest (BatchNorm's running
    statistics, integer arrays); with ``path=True``, ``(path, array)`` pairs (PyTorch's ``named_buffers`` and
    parameters together).

    >>> import numpy as np
    >>> w = np.ones(2)
    >>> len(arrays([w, w, np.arange(3)]))
    2
    >>> [p for p, _ in arrays({"a": w, "b": [np.arange(3)]}, path=True)]
    ['a', 'b.0']
    """
    return _distinct_arrays(model, trainable_only=False, with_path=path)


def _distinct_arrays(model, trainable_only, with_path=False):
    out, seen = [], set()

    def walk(x, prefix):
        kids = children(x)
        if kids is None:
            trainable = is_float_dtype(x.dtype) or x.dtype.kind == "c" if is_array(x) else False
            if is_array(x) and (not trainable_only or trainable) and id(x) not in seen:
                seen.add(id(x))
                out.append((prefix[:-1], x) if with_path else x)
            return
        allowed = trainable_keys(x) if trainable_only else None
        for k, v in kids:
            if allowed is None or k in allowed:
                walk(v, f"{prefix}{k}.")
    walk(model, "")
    return out


def fmap_with_path(f: Callable, x: Any) -> Any:
    """A copy of tree ``x`` with every leaf (arrays, and the functions and numbers a model holds, as :func:`fmap`)
    replaced by ``f(path, leaf)``, ``path`` dotted as in :func:`trainables` (Functors' ``fmap_with_path``): to treat
    arrays by where they sit, e.g. no weight decay on biases. Shared leaves stay shared (``f`` sees them once, under
    their first path).

    >>> import numpy as np
    >>> from fluxpy import Dense
    >>> d = fmap_with_path(lambda p, a: a * 0 if p.endswith("bias") else a, Dense(2, 1, bias=np.ones(1)))
    >>> d.bias
    array([0.])
    """
    cache: dict = {}

    def go(v, prefix):
        key = id(v)
        if key in cache:
            return cache[key][1]
        kids = children(v)
        y = f(prefix[:-1], v) if kids is None else rebuild(v, [(k, go(c, f"{prefix}{k}.")) for k, c in kids])
        if kids is not None or is_array(v):
            cache[key] = (v, y)   # keep v alive so its id is not reused
        return y
    return go(x, "")


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

    All or nothing: every array is checked before any is copied, so an error (a ``ValueError``
    naming the path) leaves the model exactly as it was. The state must have the model's structure
    (no missing or extra fields) and an array of the model's shape at each array, whose values the
    model's dtype holds: float into float (no finite value may overflow to infinity, e.g. 1e300 into
    float32), integers into float or int only where each value is exact, never complex into real,
    bool into numbers, or strings and objects into anything. The values are cast to the model's
    dtypes and copied to its device.

    >>> import numpy as np
    >>> m = {"w": np.zeros(2)}
    >>> _ = loadstate(m, {"w": np.array([1.0, 2.0])})
    >>> m["w"]
    array([1., 2.])
    >>> loadstate({"w": np.zeros(1, np.float32)}, {"w": np.array([1e300])})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: loadstate: model.w is float32, but the state holds float64 values such as 1e+300 that overflow it ...
    """
    copies: list = []
    try:
        _plan_load(model, st, path, copies, {})
    except ValueError as err:
        raise ValueError(f"{err}; nothing was loaded") from None
    for dst, src in copies:
        copy_into(dst, src)
    return model


def _plan_load(model, st, path, copies, seen):
    """Checks ``st`` against ``model`` and lists the ``(destination, source)`` copies; changes nothing."""
    kids = children(model)
    if kids is None:
        if is_array(model):
            _plan_copy(model, st, path, copies, seen)
        elif st is not None:
            raise ValueError(f"loadstate: {path} is {_describe(model, article=True)} in the model, not an array, but "
                             f"the state has {_describe(st, article=True)} there")
        return
    if isinstance(model, (tuple, list)):
        if not isinstance(st, (tuple, list)) or len(st) != len(model):
            raise ValueError(f"loadstate: {path} expects a list of {len(model)} entries, got {_describe(st)}")
        pairs = [(k, v, st[k]) for k, v in kids]
    else:
        if not isinstance(st, dict):
            raise ValueError(f"loadstate: {path} expects a dict of fields, got {_describe(st)}")
        names = {k for k, _ in kids}
        extra = [str(k) for k in st if k not in names]
        if extra:
            raise ValueError(f"loadstate: the state has fields {sorted(extra)} that {path} ({type(model).__name__}) "
                             "does not have; was it saved from another model?")
        pairs = [(k, v, st.get(k)) for k, v in kids]
    for k, v, s in pairs:
        sub = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}"
        if s is None:
            if not _empty(state(v)):
                raise ValueError(f"loadstate: {sub} is missing from the state")
            continue
        _plan_load(v, s, sub, copies, seen)


def _plan_copy(dst, src, path, copies, seen):
    if not hasattr(src, "shape") or not hasattr(src, "dtype"):
        raise ValueError(f"loadstate: {path} expects an array of shape {tuple(dst.shape)}, got {_describe(src)}")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"loadstate: {path} expects shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    if not getattr(getattr(dst, "flags", None), "writeable", True):
        raise ValueError(f"loadstate: {path} is a read-only array in the model, so it cannot be loaded in place")
    first = seen.get(id(dst))
    if first is not None:  # one array at two paths (tied weights): the state must agree at both
        other_path, other = first
        if other is not src and not _same_values(other, src):
            raise ValueError(f"loadstate: {other_path} and {path} are one array in the model (tied weights), but "
                             "the state has different values at the two")
        return
    seen[id(dst)] = (path, src)
    copies.append((dst, _cast_for(dst, src, path)))


def _same_values(a, b):
    a, b = to_cpu(a), to_cpu(b)
    return tuple(a.shape) == tuple(b.shape) and bool(np.array_equal(a, b))


def _kind(dtype):
    """The dtype's kind, with the extension floats (ml_dtypes' bfloat16, float8_*) as ``"f"``."""
    return "f" if is_float_dtype(dtype) else dtype.kind


_ACCEPTS = {"f": "fiu", "c": "fciu", "i": "iu", "u": "iu", "b": "b"}  # the model's kind -> the state's kinds it takes


def _cast_for(dst, src, path):
    """``src`` as ``dst``'s dtype, on ``src``'s device; raises where a value would change other than by rounding."""
    if src.dtype == dst.dtype:
        return src
    into, got = _kind(dst.dtype), _kind(src.dtype)
    if got not in _ACCEPTS.get(into, ""):
        raise ValueError(f"loadstate: {path} is {dst.dtype} in the model, but the state holds {src.dtype} values, "
                         f"which do not convert to it ({_WHY.get((into, got), 'a different kind of value')})")
    xp = get_array_module(src)
    with np.errstate(all="ignore"):
        cast = src.astype(dst.dtype)
        if got in "iu":   # integers: each must come back exactly (in range, and exact in a float), sign kept
            bad = (cast.astype(src.dtype) != src) | ((cast < 0) != (src < 0))
            what = "that it cannot hold exactly"
        else:             # floats: a finite value must stay finite (no overflow to infinity)
            bad = xp.isfinite(src) & ~xp.isfinite(cast)
            what = "that overflow it to infinity"
        if bool(bad.any()):
            example = to_cpu(src[bad].ravel()[:1])[0].item()
            raise ValueError(f"loadstate: {path} is {dst.dtype}, but the state holds {src.dtype} values such as "
                             f"{example!r} {what}")
    return cast


_WHY = {("f", "c"): "the imaginary part would be dropped", ("i", "c"): "the imaginary part would be dropped",
        ("u", "c"): "the imaginary part would be dropped", ("i", "f"): "the fractions would be cut off",
        ("u", "f"): "the fractions would be cut off", ("f", "b"): "booleans do not load into numbers",
        ("c", "b"): "booleans do not load into numbers", ("i", "b"): "booleans do not load into numbers",
        ("u", "b"): "booleans do not load into numbers"}


def _describe(x, article=False):
    if hasattr(x, "shape"):
        text = f"{type(x).__name__} of shape {tuple(x.shape)}"
    else:
        text = type(x).__name__
    return f"a {text}" if article else text


def gpu(x: Any, memory: str | None = None) -> Any:
    """A copy of an array, or of a whole model tree, with every array on the GPU (Flux's ``gpu``).

    ``memory="channels_last"`` also moves every array of 4 axes (the convolution weights; an image batch) to
    channels-last memory (:mod:`fluxpy.layout`): a net's convolutions, batch norms, pools and elementwise ops
    then run in NHWC memory end to end, as PyTorch's ``model.to(memory_format=torch.channels_last)``;
    ``"contiguous"`` moves them to C order; ``None`` keeps each array's layout.

    Raises :class:`fluxpy.GPUUnavailableError`, saying why, when no GPU is usable.

    >>> import numpy as np
    >>> from fluxpy.backend import GPUUnavailableError
    >>> try:
    ...     y = gpu(np.ones(3))
    ... except GPUUnavailableError:
    ...     y = None   # no GPU on this machine
    """
    if memory is None:
        return fmap(lambda a: to_gpu(a) if is_array(a) else a, x)
    if memory not in MEMORY_FORMATS:   # checked before anything is copied
        raise ValueError(f"gpu: memory must be one of {MEMORY_FORMATS} or None, got {memory!r}")
    return fmap(lambda a: to_memory_format(to_gpu(a), memory) if is_array(a) else a, x)


def cpu(x: Any) -> Any:
    """A copy of an array or model tree with every array as a NumPy array (Flux's ``cpu``).

    >>> import numpy as np
    >>> cpu({"w": np.ones(2)})["w"]
    array([1., 1.])
    """
    return fmap(to_cpu, x)


def _is_size(t):
    return isinstance(t, tuple) and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
                                        for d in t)


def outputsize(model: Callable, *inputsizes: tuple[int, ...] | tuple[tuple[int, ...], ...],
               padbatch: bool = False) -> tuple:
    """The shape of ``model``'s output for inputs of the given shapes (Flux's ``outputsize``), in NCHW.

    ``inputsizes``: one shape per input (several for a model of several inputs, or one tuple of shapes).
    ``padbatch=True`` puts a batch axis of size 1 in front of each shape (Flux appends it, WHCN's batch being
    last): ``outputsize(Dense(10, 5), (10,), padbatch=True) == (1, 5)``. A shape error is raised as the layer
    raises it (``DimensionMismatch`` naming the layer). The output of a model that returns a tuple is a tuple
    of shapes.

    Unlike Flux's (which runs the model on arrays of a shape-only number type), this runs the model once on zeros
    of the dtype and device of its first float array (float32 NumPy where it has none): it costs one forward
    pass. Outside :func:`fluxpy.gradient` the layers are in test mode, so no running statistic changes; a model
    put in ``trainmode`` would update its statistics with those zeros.

    >>> from fluxpy import Chain, Conv, Dense, flatten
    >>> outputsize(Chain(Conv((3, 3), 3, 16), Conv((3, 3), 16, 32)), (1, 3, 10, 10))
    (1, 32, 6, 6)
    >>> outputsize(Dense(10, 5), (10,), padbatch=True)
    (1, 5)
    """
    if len(inputsizes) == 1 and isinstance(inputsizes[0], tuple) and inputsizes[0] and \
            all(isinstance(t, tuple) for t in inputsizes[0]):
        inputsizes = inputsizes[0]
    if not inputsizes or not all(_is_size(t) for t in inputsizes):
        raise ValueError(f"outputsize expects one shape (a tuple of ints >= 0) per input, got {inputsizes!r}")
    floats = [a for a in arrays(model) if is_float_dtype(a.dtype)]
    like = floats[0] if floats else np.zeros((), np.float32)
    xp = get_array_module(like)
    shapes = [((1,) if padbatch else ()) + tuple(int(d) for d in t) for t in inputsizes]
    y = model(*[xp.zeros(shape, like.dtype) for shape in shapes])
    if isinstance(y, tuple):
        return tuple(tuple(a.shape) for a in y)
    return tuple(y.shape)
