"""Dense layers and containers (Flux's ``src/layers/basic.jl``).

Chain, Dense, flatten and Embedding, and the containers that route an input through several
layers: SkipConnection and Parallel.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import numpy as np

from ..autodiff import value_of
from ..functors import layer
from ..ops import basic as _ops
from ..ops.activations import identity, relu
from ..ops.bias_act import bias_act
from ..ops.linalg import matmul
from ..ops.shape import reshape, transpose
from ._checks import (Array, DimensionMismatch, DTypeMismatch, _activation, _callable, _describe_input, _fail,
                      _given_bias, _initialised, _positive_int, _require_dtype)
from .init import RNG, glorot_uniform, randn32, zeros32
from .show import _act_part, _block_repr, _fname, _inside_repr, _layer_repr


@layer(children=("layers",))
class Chain:
    """Applies its layers (any callables) in order: ``chain(x) = layers[-1](...layers[0](x))``.

    The layers are given one by one or as one list or tuple. Indexing gives a layer, slicing a
    new Chain sharing the same layers; ``len`` and iteration work as for a tuple. ``repr`` prints
    one layer per line with its parameter count, as Flux.

    >>> import numpy as np
    >>> m = Chain(Dense(2, 3, relu), Dense(3, 4), flatten)
    >>> len(m), m[0], len(m[1:])
    (3, Dense(2 => 3, relu), 2)
    >>> m[1:](np.ones((5, 3), np.float32)).shape
    (5, 4)
    >>> m(np.ones((5, 7), np.float32))
    Traceback (most recent call last):
    ...
    fluxpy.layers.DimensionMismatch: Chain layer 0: Dense(2 => 3, relu) expects x.shape[-1] == 2, got (5, 7) float32

    Layers given by name (Flux's named Chain) are reached as attributes or by their name; the gradient and the
    optimiser state keep the same ``layers`` tuple as an unnamed Chain (``names`` only labels it):

    >>> ae = Chain(enc=Dense(4, 2), dec=Dense(2, 4))
    >>> ae.enc, ae["dec"], ae.names
    (Dense(4 => 2), Dense(2 => 4), ('enc', 'dec'))
    >>> ae[1:].names
    ('dec',)
    """

    def __init__(self, *layers: Callable | Sequence[Callable], **named: Callable) -> None:
        if named and layers:
            raise TypeError("Chain takes its layers either in order or by name, not both (as Flux's Chain)")
        names = None
        if named:
            names, layers = tuple(named), tuple(named.values())
            clash = [n for n in names if hasattr(type(self), n) or n in ("layers", "names")]
            if clash:
                raise ValueError(f"Chain: the layer name {clash[0]!r} is taken by Chain itself; choose another")
        elif len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        for i, f in enumerate(layers):
            if not callable(f):
                what = f"layer {names[i]!r}" if names else f"layer {i}"
                raise TypeError(f"Chain: {what} is not callable: {f!r}")
        self.layers = tuple(layers)
        self.names = names

    def __getattr__(self, name):
        names = self.__dict__.get("names")
        if names and name in names:
            return self.__dict__["layers"][names.index(name)]
        raise AttributeError(f"{type(self).__name__} has no attribute or layer named {name!r}")

    def __call__(self, x: Array) -> Array:
        layers = self.layers
        n, i = len(layers), 0
        while i < n:
            f = layers[i]
            try:
                if i + 1 < n and layers[i + 1] is relu and _joins_by_add(f):
                    x = f._add_relu(x)   # the residual join and the relu after it: one op (see _add_relu)
                    i += 2
                    continue
                x = f(x)
            except (DimensionMismatch, DTypeMismatch) as err:
                where = f"{i} ({self.names[i]})" if self.names else f"{i}"
                raise type(err)(f"Chain layer {where}: {err}") from None
            i += 1
        return x

    def __getitem__(self, index):
        if isinstance(index, str):
            if not self.names or index not in self.names:
                raise KeyError(f"Chain has no layer named {index!r}; its names are {self.names}")
            return self.layers[self.names.index(index)]
        if isinstance(index, slice):
            if self.names:
                return Chain(**dict(zip(self.names[index], self.layers[index])))
            return Chain(*self.layers[index])
        return self.layers[index]

    def __len__(self):
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __repr__(self):
        if _inside_repr():
            parts = [_layer_repr(f) for f in self.layers]
            if self.names:
                parts = [f"{n} = {p}" for n, p in zip(self.names, parts)]
            return f"Chain({', '.join(parts)})"
        return _block_repr(self, Chain)


@layer(children=("weight", "bias"))
class Dense:
    """A fully connected layer: ``y = act(x @ weight.T + bias)``.

    ``x`` is ``(batch, in)`` (any leading axes, or a single ``(in,)`` vector) of the weight's dtype
    (float32 unless converted with :func:`f64`; another dtype is a :class:`DTypeMismatch`);
    ``weight`` is ``(out, in)``, made by ``init(out, in, rng=rng)``; ``rng`` is a
    ``numpy.random.Generator`` or a seed. ``bias`` is ``(out,)``: zeros for ``bias=True``, ``None``
    for ``bias=False``, or the array given.

    >>> import numpy as np
    >>> d = Dense(288, 10)
    >>> d, d.weight.shape, d(np.ones((128, 288), np.float32)).shape
    (Dense(288 => 10), (10, 288), (128, 10))
    >>> Dense(2, 3)(np.ones((5, 4), np.float32))
    Traceback (most recent call last):
    ...
    fluxpy.layers.DimensionMismatch: Dense(2 => 3) expects x.shape[-1] == 2, got (5, 4) float32
    """

    def __init__(self, in_features: int, out_features: int, act: Callable = identity, bias: bool | Array = True,
                 init: Callable = glorot_uniform, rng: RNG = None) -> None:
        in_features = _positive_int("Dense", "in_features", in_features)
        out_features = _positive_int("Dense", "out_features", out_features)
        self.act = _activation("Dense", act)
        self.weight = _initialised("Dense", init, (out_features, in_features), rng)
        self.bias = zeros32(out_features) if bias is True else _given_bias(bias, (out_features,), "Dense")

    @property
    def in_features(self):
        return self.weight.shape[1]

    @property
    def out_features(self):
        return self.weight.shape[0]

    def __call__(self, x: Array) -> Array:
        if not hasattr(x, "shape") or len(x.shape) < 1 or x.shape[-1] != self.in_features:
            _fail(self, f"x.shape[-1] == {self.in_features}", x)
        _require_dtype(self, x, self.weight.dtype)
        return bias_act(matmul(x, transpose(self.weight)), self.bias, self.act)

    def __repr__(self):
        return (f"Dense({self.in_features} => {self.out_features}{_act_part(self.act)}"
                f"{'' if self.bias is not None else ', bias=False'})")


def flatten(x: Array) -> Array:
    """Reshapes ``(N, ...)`` to ``(N, prod(...))``, keeping the observation axis.

    >>> import numpy as np
    >>> flatten(np.ones((128, 32, 3, 3))).shape
    (128, 288)
    """
    if not hasattr(x, "shape") or len(x.shape) < 1:
        raise DimensionMismatch(f"flatten expects an array with an observation axis, got {_describe_input(x)}")
    return reshape(x, (x.shape[0], -1))


@layer(children=("weight",))
class Embedding:
    """A lookup table: integer indices in ``[0, n)`` pick rows of ``weight``, an ``(n, dim)`` array.

    ``x`` of any shape gives ``x.shape + (dim,)``; the gradient scatters into the rows used
    (repeated indices accumulate). ``init(n, dim, rng=rng)`` makes the weight.

    >>> import numpy as np
    >>> e = Embedding(10, 4)
    >>> e, e(np.array([[1, 2, 3]])).shape
    (Embedding(10 => 4), (1, 3, 4))
    """

    def __init__(self, n: int, dim: int, init: Callable = randn32, rng: RNG = None) -> None:
        n, dim = _positive_int("Embedding", "n", n), _positive_int("Embedding", "dim", dim)
        self.weight = _initialised("Embedding", init, (n, dim), rng)

    def __call__(self, x: Array | int) -> Array:
        x = value_of(x)
        if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
            x = np.asarray(x)
        if not hasattr(x, "dtype") or x.dtype.kind not in "iu":
            _fail(self, "integer indices", x)
        n = self.weight.shape[0]
        if x.size and (int(x.min()) < 0 or int(x.max()) >= n):
            _fail(self, f"indices in [0, {n}), found {int(x.min())} to {int(x.max())} in", x)
        return self.weight[x]

    def __repr__(self):
        return f"Embedding({self.weight.shape[0]} => {self.weight.shape[1]})"


@layer(children=("layers", "connection"))
class SkipConnection:
    """Computes ``connection(layers(x), x)``: with ``operator.add``, a residual block.

    >>> import numpy as np, operator
    >>> s = SkipConnection(Dense(3, 3), operator.add)
    >>> s, s(np.ones((2, 3), np.float32)).shape
    (SkipConnection(Dense(3 => 3), +), (2, 3))
    """

    def __init__(self, layers: Callable, connection: Callable) -> None:
        self.layers = _callable("SkipConnection", "layers", layers)
        self.connection = _callable("SkipConnection", "connection", connection)

    def __call__(self, x: Array) -> Array:
        return self.connection(self.layers(x), x)

    def _add_relu(self, x):
        """``relu(self(x))`` where the connection adds (what a Chain runs for ``SkipConnection(f, +), relu``)."""
        return _add_relu(self.layers(x), x)

    def __repr__(self):
        return f"SkipConnection({_layer_repr(self.layers)}, {_fname(self.connection)})"


@layer(children=("connection", "layers"))
class Parallel:
    """Applies each layer to the input and combines the results: ``connection(layer_1(x), ..., layer_n(x))``.

    Called with several inputs, one per layer, ``Parallel(c, f, g)(x, y) = c(f(x), g(y))``.

    >>> import numpy as np, fluxpy
    >>> p = Parallel(lambda *ys: fluxpy.concatenate(ys, axis=1), Dense(2, 3), Dense(2, 4))
    >>> p(np.ones((5, 2), np.float32)).shape
    (5, 7)
    """

    def __init__(self, connection: Callable, *layers: Callable | Sequence[Callable]) -> None:
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        self.connection = _callable("Parallel", "connection", connection)
        for i, f in enumerate(layers):
            _callable("Parallel", f"layer {i}", f)
        self.layers = tuple(layers)

    def __call__(self, *xs: Array) -> Array:
        if len(xs) == 1:
            return self.connection(*(f(xs[0]) for f in self.layers))
        if len(xs) != len(self.layers):
            raise DimensionMismatch(f"Parallel with {len(self.layers)} layers expects 1 or {len(self.layers)} inputs, "
                                    f"got {len(xs)}")
        return self.connection(*(f(x) for f, x in zip(self.layers, xs)))

    def _add_relu(self, x):
        """``relu(self(x))`` for two layers joined by adding (what a Chain runs for ``Parallel(+, f, g), relu``)."""
        return _add_relu(self.layers[0](x), self.layers[1](x))

    def __getitem__(self, index):
        return self.layers[index]

    def __len__(self):
        return len(self.layers)

    def __repr__(self):
        return f"Parallel({_fname(self.connection)}, {', '.join(_layer_repr(f) for f in self.layers)})"


def _joins_by_add(f) -> bool:
    """Whether ``f`` is a residual join by addition: ``SkipConnection(body, +)`` or ``Parallel(+, a, b)``."""
    kind = type(f)
    if kind is SkipConnection:
        return f.connection is operator.add or f.connection is _ops.add
    if kind is Parallel:
        return len(f.layers) == 2 and (f.connection is operator.add or f.connection is _ops.add)
    return False


def _add_relu(a: Array, b: Array) -> Array:
    """``relu(a + b)`` as one op (``bias_act(a, b, relu)``) where ``a`` and ``b`` agree in shape and dtype.

    A Chain runs a residual join followed by ``relu`` through it: one kernel each way instead of two, and
    the sum is never stored (the pullback needs only the output), as PyTorch's in-place ``add_`` + ``relu_``.

    >>> import numpy as np
    >>> _add_relu(np.array([1.0, -3.0]), np.array([1.0, 1.0]))
    array([2., 0.])
    """
    va, vb = value_of(a), value_of(b)
    if getattr(va, "shape", None) == getattr(vb, "shape", None) and getattr(va, "dtype", None) == \
            getattr(vb, "dtype", None) is not None:
        return bias_act(a, b, relu)
    return relu(a + b)
