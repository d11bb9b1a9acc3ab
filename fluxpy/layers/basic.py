"""Dense layers and containers (Flux's ``src/layers/basic.jl``).

Chain, Dense and flatten, the containers that route an input through several layers (SkipConnection,
Parallel, PairwiseFusion), and Scale, Bilinear, Maxout and MultiHeadAttention. Embeddings: :mod:`.embedding`.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import numpy as np

from ..autodiff import in_gradient, is_tracked, value_of
from ..backend import get_array_module, is_float_dtype
from ..functors import layer
from ..random import as_rng
from ..ops import basic as _ops
from ..ops.attention import dot_product_attention
from ..ops.activations import identity, relu
from ..ops.bias_act import bias_act
from ..ops.dense import dense
from ..ops.linalg import matmul
from ..ops.reduce import sum as sum_
from ..ops.shape import expand_dims, reshape, transpose
from ._checks import (Array, DimensionMismatch, DTypeMismatch, _activation, _callable, _check_attention,
                      _describe_input, _fail, _given_bias, _initialised, _positive_int, _require_dtype)
from .init import RNG, glorot_uniform, ones32, zeros32
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

    Several arguments reach the first layer as one tuple, as Flux's: ``Chain(identity)(1, 2) == (1, 2)``.
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

    def __call__(self, x: Array, *more: Array) -> Array:
        if more:   # several arguments are one tuple (Flux's Chain: `Chain(identity)(1, 2, 3) == (1, 2, 3)`)
            x = (x,) + more
        return self._run(x, len(self.layers))

    def _run(self, x, stop: int):
        """The first ``stop`` layers applied in turn; a residual join followed by ``relu`` runs as one op (see
        :func:`_join_relu`)."""
        layers = self.layers
        i = 0
        while i < stop:
            f = layers[i]
            try:
                if i + 1 < stop and layers[i + 1] is relu and _joins_by_add(f):
                    x = f._add_relu(x)
                    i += 2
                    continue
                x = f(x)
            except (DimensionMismatch, DTypeMismatch) as err:
                raise self._located(err, i) from None
            i += 1
        return x

    def _located(self, err, i):
        """``err`` again, its message prefixed with the layer it came from."""
        where = f"{i} ({self.names[i]})" if self.names else f"{i}"
        return type(err)(f"Chain layer {where}: {err}")

    def _join_relu(self, x, shortcut: Callable):
        """``relu(self(x) + shortcut(x))`` with the join handed to the last layer, which has ``_join_residual``
        (a batch norm adds the residual and applies relu in its own passes); the layers before it, then the
        shortcut, run first."""
        last = len(self.layers) - 1
        z = self._run(x, last)
        r = shortcut(x)
        try:
            y = self.layers[last]._join_residual(z, r, relu)
            return _add_relu(self.layers[last](z), r) if y is None else y
        except (DimensionMismatch, DTypeMismatch) as err:
            raise self._located(err, last) from None

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
    for ``bias=False``, or the array given. It runs :func:`fluxpy.ops.dense`: on the GPU, one cuBLASLt call with the
    bias and activation in its epilogue where that op can fuse them (identity, relu, gelu).

    >>> import numpy as np
    >>> d = Dense(288, 10)
    >>> d, d.weight.shape, d(np.ones((128, 288), np.float32)).shape
    (Dense(288 => 10), (10, 288), (128, 10))
    >>> Dense(2, 3)(np.ones((5, 4), np.float32))
    Traceback (most recent call last):
    ...
    fluxpy.layers.DimensionMismatch: Dense(2 => 3) expects x.shape[-1] == 2, got (5, 4) float32

    Flux's ``Dense(W, b=true, act)`` form: a float ``weight`` ``(out, in)`` first, then the bias (True: zeros of the
    weight's dtype; False; or an array, converted to the weight's dtype) and the activation.

    >>> d = Dense(np.ones((3, 2), np.float16), False, np.tanh)
    >>> d, d.bias, d.weight.dtype
    (Dense(2 => 3, tanh, bias=False), None, dtype('float16'))
    """

    def __init__(self, in_features: int | Array, out_features: int | bool | Array | None = None,
                 act: Callable = identity, bias: bool | Array = True, init: Callable = glorot_uniform,
                 rng: RNG = None) -> None:
        if hasattr(in_features, "shape"):
            self._from_weight(in_features, True if out_features is None else out_features, act)
            return
        if out_features is None:
            raise TypeError("Dense expects the sizes Dense(in_features, out_features) or a weight Dense(weight, bias, "
                            "act)")
        in_features = _positive_int("Dense", "in_features", in_features)
        out_features = _positive_int("Dense", "out_features", out_features)
        self.act = _activation("Dense", act)
        self.weight = _initialised("Dense", init, (out_features, in_features), rng)
        self.bias = get_array_module(self.weight).zeros(out_features, dtype=self.weight.dtype) if bias is True \
            else _given_bias(bias, (out_features,), "Dense")   # in the weight's dtype (Flux issue 1421)

    def _from_weight(self, weight, bias, act):
        if len(weight.shape) != 2 or not is_float_dtype(weight.dtype):
            raise ValueError(f"Dense: a weight must be a float matrix (out, in), got {_describe_input(weight)}")
        self.act = _activation("Dense", act)
        self.weight = weight
        out = weight.shape[0]
        if bias is True:
            self.bias = get_array_module(weight).zeros(out, dtype=weight.dtype)
        elif hasattr(bias, "shape") and tuple(bias.shape) == (out,):
            self.bias = bias.astype(weight.dtype, copy=False)
        else:
            self.bias = _given_bias(bias, (out,), "Dense")

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
        return dense(x, self.weight, self.bias, self.act)

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
        return _join_relu(self.layers, x, identity)

    def __repr__(self):
        return f"SkipConnection({_layer_repr(self.layers)}, {_fname(self.connection)})"


@layer(children=("connection", "layers"))
class Parallel:
    """Applies each layer to the input and combines the results: ``connection(layer_1(x), ..., layer_n(x))``.

    Called with several inputs, one per layer, ``Parallel(c, f, g)(x, y) = c(f(x), g(y))``; a tuple is taken as
    its inputs (``p((x, y)) == p(x, y)``); one layer with several inputs is applied to each,
    ``Parallel(c, f)(x, y) = c(f(x), f(y))`` (Flux's rules).

    >>> import numpy as np, fluxpy
    >>> p = Parallel(lambda *ys: fluxpy.concatenate(ys, axis=1), Dense(2, 3), Dense(2, 4))
    >>> p(np.ones((5, 2), np.float32)).shape
    (5, 7)
    >>> Parallel(lambda a, b: a + b, Dense(2, 3, rng=0))(np.ones((1, 2), np.float32), np.ones((1, 2), np.float32)).shape
    (1, 3)
    """

    def __init__(self, connection: Callable, *layers: Callable | Sequence[Callable]) -> None:
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        self.connection = _callable("Parallel", "connection", connection)
        self.layers = _layer_tuple("Parallel", layers)
        if not self.layers:   # Flux: an error, not a layer that calls connection() with nothing
            raise ValueError("Parallel expects at least one layer after the connection, e.g. Parallel(+, f, g)")

    def __call__(self, *xs: Array) -> Array:
        if len(xs) == 1 and type(xs[0]) is tuple:
            xs = xs[0]
        if not xs:
            raise DimensionMismatch(f"{self!r} expects at least one input, got none")
        if len(xs) == 1:
            return self.connection(*(f(xs[0]) for f in self.layers))
        if len(self.layers) == 1:
            return self.connection(*(self.layers[0](x) for x in xs))
        if len(xs) != len(self.layers):
            raise DimensionMismatch(f"Parallel with {len(self.layers)} layers expects 1 or {len(self.layers)} inputs, "
                                    f"got {len(xs)}")
        return self.connection(*(f(x) for f, x in zip(self.layers, xs)))

    def _add_relu(self, x):
        """``relu(self(x))`` for two layers joined by adding (what a Chain runs for ``Parallel(+, f, g), relu``)."""
        return _join_relu(self.layers[0], x, self.layers[1])

    def __getitem__(self, index):
        return self.layers[index]

    def __len__(self):
        return len(self.layers)

    def __repr__(self):
        return f"Parallel({_fname(self.connection)}, {', '.join(_layer_repr(f) for f in self.layers)})"


@layer(children=("scale", "bias"))
class Scale:
    """An elementwise affine map, ``y = act(scale * x + bias)``, ``scale`` and ``bias`` of shape ``size`` broadcast
    against ``x`` by NumPy's rules, either way (Flux's ``Scale``: for the channels of ``(N, C, H, W)`` use
    ``Scale(C, 1, 1)``; Flux's ``Scale(2, 3)`` on WHCN data is ``Scale(3, 2)`` here).

    >>> import numpy as np
    >>> s = Scale(3)
    >>> s, s(np.ones((2, 3), np.float32)).tolist()
    (Scale(3), [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    """

    def __init__(self, *size: int, bias: bool | Array = True, init: Callable = ones32, act: Callable = identity,
                 rng: RNG = None) -> None:
        if not size:
            raise ValueError("Scale expects a size, e.g. Scale(3) or Scale(16, 1, 1)")
        size = tuple(_positive_int("Scale", "size", n) for n in size)
        self.scale = _initialised("Scale", init, size, rng)
        self.bias = zeros32(*size) if bias is True else _given_bias(bias, size, "Scale")
        self.act = _activation("Scale", act)

    def __call__(self, x: Array) -> Array:
        size = tuple(self.scale.shape)
        shape = tuple(getattr(x, "shape", ()))
        try:   # x may broadcast up, as in Flux (Scale(10) of a length-1 x has length 10)
            ok = bool(shape) and len(np.broadcast_shapes(shape, size)) == len(shape)
        except ValueError:
            ok = False
        if not ok:
            _fail(self, f"x that broadcasts with {size} (as many axes or more)", x)
        _require_dtype(self, x, self.scale.dtype)
        return bias_act(x * self.scale, self.bias, self.act)

    def __repr__(self):
        size = ", ".join(str(n) for n in self.scale.shape)
        return f"Scale({size}{_act_part(self.act)}{'' if self.bias is not None else ', bias=False'})"


@layer(children=("weight", "bias"))
class Bilinear:
    """A bilinear map of two inputs, ``y[n, o] = act(sum_ij x[n, i] weight[o, i, j] z[n, j] + bias[o])`` (Flux's and
    PyTorch's ``Bilinear``, ``weight`` ``(out, in1, in2)``). ``Bilinear((in1, in2), out)``; ``Bilinear(in, out)``
    means ``in1 = in2 = in``. Called as ``b(x, z)``, ``b((x, z))``, or ``b(x)`` for ``z = x``.

    >>> import numpy as np
    >>> b = Bilinear((2, 3), 4)
    >>> b, b(np.ones((5, 2), np.float32), np.ones((5, 3), np.float32)).shape
    (Bilinear((2, 3) => 4), (5, 4))
    """

    def __init__(self, in_features: int | tuple[int, int], out_features: int, act: Callable = identity,
                 bias: bool | Array = True, init: Callable = glorot_uniform, rng: RNG = None) -> None:
        ins = (in_features, in_features) if not isinstance(in_features, tuple) else in_features
        if len(ins) != 2:
            raise ValueError(f"Bilinear expects in_features to be an int or a pair (in1, in2), got {in_features!r}")
        in1, in2 = (_positive_int("Bilinear", "in_features", n) for n in ins)
        out = _positive_int("Bilinear", "out_features", out_features)
        self.weight = _initialised("Bilinear", init, (out, in1, in2), rng)
        self.bias = zeros32(out) if bias is True else _given_bias(bias, (out,), "Bilinear")
        self.act = _activation("Bilinear", act)

    def __call__(self, x: Array, z: Array | None = None) -> Array:
        if z is None and type(x) is tuple:
            if len(x) != 2:
                raise DimensionMismatch(f"{self!r} expects two inputs, got a tuple of {len(x)}")
            x, z = x
        z = x if z is None else z
        out, in1, in2 = self.weight.shape
        for name, a, n in (("x", x, in1), ("z", z, in2)):
            if not hasattr(a, "shape") or len(a.shape) != 2 or a.shape[1] != n:
                _fail(self, f"{name} of shape (batch, {n})", a)
            _require_dtype(self, a, self.weight.dtype)
        if x.shape[0] != z.shape[0]:
            raise DimensionMismatch(f"{self!r} expects x and z with one batch size, got {x.shape[0]} and "
                                    f"{z.shape[0]}")
        wz = matmul(z, transpose(reshape(self.weight, (out * in1, in2))))          # (batch, out * in1)
        y = _ops.multiply(reshape(wz, (x.shape[0], out, in1)), expand_dims(x, 1))   # x[n, i] W[o, i, :] z[n, :]
        return bias_act(sum_(y, axis=2), self.bias, self.act)

    def __repr__(self):
        out, in1, in2 = self.weight.shape
        ins = f"{in1}" if in1 == in2 else f"({in1}, {in2})"
        return (f"Bilinear({ins} => {out}{_act_part(self.act)}"
                f"{'' if self.bias is not None else ', bias=False'})")


@layer(children=("layers",))
class Maxout:
    """The elementwise maximum of its layers' outputs (Goodfellow et al. 2013; Flux's ``Maxout``). ``Maxout(f, n)``
    calls the constructor ``f`` ``n`` times for ``n`` independent layers.

    >>> import numpy as np
    >>> m = Maxout(lambda: Dense(3, 2), 4)
    >>> len(m.layers), m(np.ones((5, 3), np.float32)).shape
    (4, (5, 2))
    """

    def __init__(self, *layers: Callable) -> None:
        if len(layers) == 2 and callable(layers[0]) and isinstance(layers[1], int) and not isinstance(layers[1], bool):
            make, n = layers
            n = _positive_int("Maxout", "n", n)
            layers = tuple(make() for _ in range(n))
        if not layers:
            raise ValueError("Maxout expects layers, or a constructor and a count: Maxout(lambda: Dense(3, 2), 4)")
        self.layers = _layer_tuple("Maxout", layers)

    def __call__(self, x: Array) -> Array:
        y = self.layers[0](x)
        for f in self.layers[1:]:
            y = _ops.maximum(y, f(x))
        return y

    def __repr__(self):
        return f"Maxout({', '.join(_layer_repr(f) for f in self.layers)})"


@layer(children=("connection", "layers"))
class PairwiseFusion:
    """Layers that each see the previous one's output joined with their own input (Flux's ``PairwiseFusion``):
    ``y1 = layer1(x1)``, ``y_i = layer_i(connection(y_(i-1), x_i))``; returns the tuple ``(y1, ..., yn)``. ``x`` is a
    tuple of ``n`` inputs, or one input given to every layer.

    >>> import numpy as np, operator
    >>> p = PairwiseFusion(operator.add, Dense(2, 2, rng=0), Dense(2, 2, rng=1))
    >>> [y.shape for y in p((np.ones((3, 2), np.float32), np.ones((3, 2), np.float32)))]
    [(3, 2), (3, 2)]
    """

    def __init__(self, connection: Callable, *layers: Callable) -> None:
        self.connection = _callable("PairwiseFusion", "connection", connection)
        if not layers:
            raise ValueError("PairwiseFusion expects at least one layer after the connection")
        self.layers = _layer_tuple("PairwiseFusion", layers)

    def __call__(self, *xs: Array) -> tuple:
        if len(xs) == 1 and type(xs[0]) is tuple:
            xs = xs[0]
        n = len(self.layers)
        if len(xs) == 1:
            xs = xs * n
        if len(xs) != n:
            raise DimensionMismatch(f"PairwiseFusion with {n} layers expects 1 or {n} inputs, got {len(xs)}")
        ys = [self.layers[0](xs[0])]
        for f, x in zip(self.layers[1:], xs[1:]):
            ys.append(f(self.connection(ys[-1], x)))
        return tuple(ys)

    def __repr__(self):
        return f"PairwiseFusion({_fname(self.connection)}, {', '.join(_layer_repr(f) for f in self.layers)})"


@layer(children=("q_proj", "k_proj", "v_proj", "out_proj"))
class MultiHeadAttention:
    """Multi-head attention (Flux's ``MultiHeadAttention``), batch first: ``mha(q, k=None, v=None, mask=None) ->
    (y, scores)``. ``q``, ``k``, ``v`` are projected by ``q_proj``, ``k_proj``, ``v_proj`` (``Dense(dim, dim,
    bias=bias)``), attended in ``nheads`` heads (:func:`fluxpy.ops.attention.dot_product_attention`, with dropout
    ``dropout`` on the scores while training, as :class:`fluxpy.Dropout` decides: in a gradient, or by
    ``trainmode``/``testmode``), joined and projected by ``out_proj``. ``q`` ``(N, Lq, dim)``; ``k`` defaults to
    ``q`` and ``v`` to ``k``; ``scores`` ``(N, nheads, Lq, Lk)``; ``mask`` boolean, broadcasting to ``(Lq, Lk)``,
    true where attending is allowed (:func:`fluxpy.ops.attention.causal_mask` for a decoder); ``bias``, an array
    broadcasting to ``(Lq, Lk)`` or the scores' shape, added to the logits before the mask and the softmax (Flux's
    fourth argument ``mha(q, k, v, bias)``). Keywords: ``causal=True`` masks each query's later keys;
    ``need_scores=False`` returns ``(y, None)`` and lets the GPU run fused attention in half precision (PyTorch's
    ``need_weights=False``; the transformer layers pass it).

    Flux's general sizes ``(q_in, k_in, v_in) => (qk, v) => out`` are keywords here: ``kdim`` and ``vdim`` (the key
    and value inputs' features, PyTorch's names; default ``dim``), ``qk_dim`` and ``v_dim`` (the projected queries
    and keys, and values; default ``dim``; ``nheads`` divides both) and ``out_dim`` (default ``dim``): Flux's
    ``MultiHeadAttention(4 => 10 => 5)`` is ``MultiHeadAttention(4, qk_dim=10, v_dim=10, out_dim=5)``.

    >>> import numpy as np
    >>> from fluxpy.ops.attention import causal_mask
    >>> x = np.random.default_rng(0).standard_normal((2, 4, 6)).astype(np.float32)
    >>> mha = MultiHeadAttention(6, nheads=3, rng=0)
    >>> y, s = mha(x, mask=causal_mask(x))
    >>> mha, y.shape, s.shape, float(s[0, 0, 0, 1])   # the first query sees only the first key
    (MultiHeadAttention(6, nheads=3), (2, 4, 6), (2, 3, 4, 4), 0.0)
    >>> MultiHeadAttention(4, nheads=2, qk_dim=10, v_dim=10, out_dim=5)(np.ones((1, 3, 4), np.float32))[0].shape
    (1, 3, 5)
    """
    _has_mode = True

    def __init__(self, dim: int, nheads: int = 8, bias: bool = False, dropout: float = 0.0, *,
                 kdim: int | None = None, vdim: int | None = None, qk_dim: int | None = None,
                 v_dim: int | None = None, out_dim: int | None = None, rng: RNG = None,
                 active: bool | None = None) -> None:
        who = "MultiHeadAttention"
        dim = _positive_int(who, "dim", dim)
        given = {"kdim": kdim, "vdim": vdim, "qk_dim": qk_dim, "v_dim": v_dim, "out_dim": out_dim}
        sizes = {name: dim if n is None else _positive_int(who, name, n) for name, n in given.items()}
        nheads = _positive_int(who, "nheads", nheads)
        for name in ("qk_dim", "v_dim"):
            if sizes[name] % nheads:
                label = name if given[name] is not None else "dim"
                raise ValueError(f"MultiHeadAttention: nheads {nheads} must divide {label} {sizes[name]}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
            raise ValueError(f"MultiHeadAttention: dropout must be a probability in [0, 1], got {dropout!r}")
        rng = as_rng(rng, who)   # one generator for the four projections, in turn
        self.q_proj = Dense(dim, sizes["qk_dim"], bias=bias, rng=rng)
        self.k_proj = Dense(sizes["kdim"], sizes["qk_dim"], bias=bias, rng=rng)
        self.v_proj = Dense(sizes["vdim"], sizes["v_dim"], bias=bias, rng=rng)
        self.out_proj = Dense(sizes["v_dim"], sizes["out_dim"], bias=bias, rng=rng)
        self.nheads, self.dropout, self.active = nheads, float(dropout), active

    def __call__(self, q: Array, k: Array | None = None, v: Array | None = None,
                 mask: Array | None = None, bias: Array | None = None, *, causal: bool = False,
                 need_scores: bool = True) -> tuple[Array, Array | None]:
        k = q if k is None else k
        v = k if v is None else v
        _check_attention(self, (("q", q, self.q_proj), ("k", k, self.k_proj), ("v", v, self.v_proj)))
        active = (in_gradient() or is_tracked(q)) if self.active is None else self.active
        drop = self.dropout if self.dropout > 0 and active else None   # a probability: fused kernels draw it
        try:
            y, scores = dot_product_attention(self.q_proj(q), self.k_proj(k), self.v_proj(v), mask, self.nheads,
                                              drop, bias=bias, causal=causal, need_scores=need_scores)
        except (TypeError, ValueError) as err:   # a mask or bias that does not fit: named as this layer's error
            if not str(err).startswith("dot_product_attention expects"):
                raise
            msg = f"{self!r}{str(err)[len('dot_product_attention'):]}"
            raise (TypeError(msg) if isinstance(err, TypeError) else DimensionMismatch(msg)) from None
        return self.out_proj(y), scores

    def __repr__(self):
        dim = self.q_proj.in_features
        sizes = (("kdim", self.k_proj.in_features), ("vdim", self.v_proj.in_features),
                 ("qk_dim", self.q_proj.out_features), ("v_dim", self.v_proj.out_features),
                 ("out_dim", self.out_proj.out_features))
        extra = "" if self.q_proj.bias is None else ", bias=True"
        extra += "" if self.dropout == 0 else f", dropout={self.dropout}"
        extra += "".join(f", {name}={n}" for name, n in sizes if n != dim)
        return f"MultiHeadAttention({dim}, nheads={self.nheads}{extra})"


def _layer_tuple(who, layers):
    """``layers`` as a tuple, each checked to be callable (an error names ``who`` and the layer's index)."""
    for i, f in enumerate(layers):
        _callable(who, f"layer {i}", f)
    return tuple(layers)


def _joins_by_add(f) -> bool:
    """Whether ``f`` is a residual join by addition: ``SkipConnection(body, +)`` or ``Parallel(+, a, b)``."""
    kind = type(f)
    if kind is SkipConnection:
        return f.connection is operator.add or f.connection is _ops.add
    if kind is Parallel:
        return len(f.layers) == 2 and (f.connection is operator.add or f.connection is _ops.add)
    return False


def _join_relu(body: Callable, x: Array, shortcut: Callable) -> Array:
    """``relu(body(x) + shortcut(x))``, a residual block: where ``body`` is a Chain whose last layer takes the join
    (``_join_residual``: a BatchNorm), that layer adds the shortcut and applies relu in its own op; else
    :func:`_add_relu` of the two.

    >>> import numpy as np
    >>> from fluxpy.layers import BatchNorm
    >>> x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    >>> _join_relu(Chain(BatchNorm(2, active=True)), x, lambda x: x).round(3)   # relu(batchnorm(x) + x)
    array([[0., 1.],
           [4., 5.]], dtype=float32)
    """
    if type(body) is Chain and body.layers and hasattr(body.layers[-1], "_join_residual"):
        return body._join_relu(x, shortcut)
    return _add_relu(body(x), shortcut(x))


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
