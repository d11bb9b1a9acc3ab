"""Layers (Flux's ``src/layers/*.jl``): plain classes with a size constructor, ``__call__`` and a Flux-style ``repr``.

Each ``__call__`` checks the input's shape, then calls ops; layers hold no backward code and no
device code (move a model with :func:`fluxpy.gpu` / :func:`fluxpy.cpu`). A wrong input raises
:class:`DimensionMismatch` naming the layer before any kernel runs; inside a :class:`Chain` the
message also says which layer (by its index, as ``chain[i]``).

Layout: images ``(N, C, H, W)``, Dense input ``(batch, in)``, weights ``(out, in)`` and
``(K, C/groups, R, S)``. Parameters are float32 (convert a model with :func:`f64` / :func:`f32`).

>>> import numpy as np
>>> import fluxpy
>>> model = Chain(Dense(2, 3, relu, rng=0), Dense(3, 1, rng=1))
>>> model(np.ones((4, 2), np.float32)).shape
(4, 1)
>>> g, = fluxpy.gradient(lambda m: m(np.ones((4, 2), np.float32)).sum(), model)
>>> sorted(g["layers"][0])
['bias', 'weight']
"""
from __future__ import annotations

import functools
import math
import operator
import types

import numpy as np

from .autodiff import Primitive, in_gradient, is_tracked, value_of
from .backend import is_float_array
from .functors import children, fmap, layer, state, trainables
from .ops.activations import identity, relu  # noqa: F401  (relu: used by the docstring examples)
from .ops.bias_act import bias_act
from .ops.conv import conv_bias_act, conv_dims, conv_transpose
from .ops.dims import AdaptivePoolDims
from .ops.dropout import dropout
from .ops.linalg import matmul
from .ops.norm import batchnorm_infer, batchnorm_train, layernorm
from .ops.pool import (adaptive_maxpool, adaptive_meanpool, global_maxpool, global_meanpool, maxpool,
                       meanpool, pool_dims)
from .ops.shape import reshape, transpose

__all__ = ["Chain", "Dense", "Conv", "CrossCor", "ConvTranspose", "MaxPool", "MeanPool", "GlobalMaxPool",
           "GlobalMeanPool", "AdaptiveMaxPool", "AdaptiveMeanPool", "flatten", "BatchNorm", "LayerNorm", "Dropout",
           "Embedding", "SkipConnection", "Parallel", "DimensionMismatch", "istraining", "trainmode", "testmode",
           "f32", "f64", "glorot_uniform", "glorot_normal", "kaiming_uniform", "kaiming_normal", "randn32", "zeros32",
           "ones32", "nfan"]


class DimensionMismatch(ValueError):
    """A layer was given an input of the wrong shape (Flux's ``DimensionMismatch``); the message names the layer.

    >>> import numpy as np
    >>> try:
    ...     Dense(3, 2)(np.ones((4, 5), np.float32))
    ... except DimensionMismatch as err:
    ...     print(err)
    Dense(3 => 2) expects x.shape[-1] == 3, got (4, 5) float32
    """


# ---------------------------------------------------------------------------------------------
# Initialisers (Flux's src/utils.jl): float32 arrays; rng is a numpy Generator, a seed or None.


def _shape(dims):
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return tuple(int(d) for d in dims)


def _rng(rng):
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def nfan(*dims):
    """``nfan(*dims) -> (fan_in, fan_out)`` for a weight of shape ``dims`` in fluxpy's layout.

    ``(out, in)`` for Dense; ``(K, C, R, S)`` for Conv gives ``(C*R*S, K*R*S)``; a vector ``(n,)``
    gives ``(1, n)``.

    >>> nfan(16, 1, 3, 3), nfan(10, 288), nfan(7)
    ((9, 144), (288, 10), (1, 7))
    """
    dims = _shape(dims)
    if len(dims) == 0:
        return 1, 1
    if len(dims) == 1:
        return 1, dims[0]
    receptive = math.prod(dims[2:])
    return dims[1] * receptive, dims[0] * receptive


def glorot_uniform(*dims, rng=None, gain=1.0):
    """``glorot_uniform(*dims, rng=None, gain=1)``: ``U(-a, a)`` with ``a = gain * sqrt(6 / (fan_in + fan_out))``.

    ``dims`` are ints or one tuple; fans from :func:`nfan`. Float32 (Glorot & Bengio 2010).

    >>> w = glorot_uniform(3, 4, rng=0)
    >>> w.shape, w.dtype, bool(abs(w).max() <= (6 / 7) ** 0.5)
    ((3, 4), dtype('float32'), True)
    """
    shape = _shape(dims)
    fan_in, fan_out = nfan(shape)
    bound = gain * math.sqrt(6 / (fan_in + fan_out))
    return _rng(rng).uniform(-bound, bound, shape).astype(np.float32)


def glorot_normal(*dims, rng=None, gain=1.0):
    """``glorot_normal(*dims, rng=None, gain=1)``: normal with std ``gain * sqrt(2 / (fan_in + fan_out))``, float32.

    >>> glorot_normal((2, 5), rng=0).dtype
    dtype('float32')
    """
    shape = _shape(dims)
    fan_in, fan_out = nfan(shape)
    std = gain * math.sqrt(2 / (fan_in + fan_out))
    return (_rng(rng).standard_normal(shape) * std).astype(np.float32)


def kaiming_uniform(*dims, rng=None, gain=math.sqrt(2)):
    """``kaiming_uniform(*dims, rng=None, gain=sqrt(2))``: ``U(-a, a)``, ``a = gain * sqrt(3 / fan_in)``, float32.

    >>> w = kaiming_uniform(4, 6, rng=0)
    >>> bool(abs(w).max() <= 2 ** 0.5 * (3 / 6) ** 0.5)
    True
    """
    shape = _shape(dims)
    bound = gain * math.sqrt(3 / nfan(shape)[0])
    return _rng(rng).uniform(-bound, bound, shape).astype(np.float32)


def kaiming_normal(*dims, rng=None, gain=math.sqrt(2)):
    """``kaiming_normal(*dims, rng=None, gain=sqrt(2))``: normal with std ``gain / sqrt(fan_in)`` (He et al. 2015).

    >>> kaiming_normal(8, 3, 3, 3, rng=0).shape
    (8, 3, 3, 3)
    """
    shape = _shape(dims)
    std = gain / math.sqrt(nfan(shape)[0])
    return (_rng(rng).standard_normal(shape) * std).astype(np.float32)


def randn32(*dims, rng=None):
    """``randn32(*dims, rng=None)``: standard normal float32 (Flux's default for :class:`Embedding`).

    >>> randn32(2, 3, rng=0).shape
    (2, 3)
    """
    return _rng(rng).standard_normal(_shape(dims)).astype(np.float32)


def zeros32(*dims, rng=None):
    """``zeros32(*dims)``: float32 zeros (``rng`` is accepted and ignored, so it fits any ``init=``).

    >>> zeros32(2)
    array([0., 0.], dtype=float32)
    """
    return np.zeros(_shape(dims), dtype=np.float32)


def ones32(*dims, rng=None):
    """``ones32(*dims)``: float32 ones.

    >>> ones32(2)
    array([1., 1.], dtype=float32)
    """
    return np.ones(_shape(dims), dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# Train/test mode (Flux's istraining, trainmode!, testmode!)


def istraining(*xs) -> bool:
    """True inside :func:`fluxpy.gradient` (and ``withgradient``/``pullback``), or when any of ``xs`` is
    a Tracked value.

    :class:`Dropout` and :class:`BatchNorm` in automatic mode use this to decide whether they are
    training, so a Dropout applied straight to the data trains too.

    >>> import numpy as np, fluxpy
    >>> istraining(np.ones(2))
    False
    >>> fluxpy.gradient(lambda x: float(istraining(x)) * x.sum(), np.ones(2))
    (array([1., 1.]),)
    """
    return in_gradient() or any(is_tracked(x) for x in xs)


def _set_mode(model, active):
    seen = set()

    def walk(x):
        if id(x) in seen:
            return
        seen.add(id(x))
        if getattr(type(x), "_has_mode", False):
            x.active = active
        for _, child in children(x) or ():
            walk(child)
    walk(model)
    return model


def _mode_value(mode, when_true):
    if mode == "auto":
        return None
    if isinstance(mode, bool):
        return when_true if mode else not when_true
    raise ValueError(f"mode must be True, False or \"auto\", got {mode!r}")


def trainmode(model, mode=True):
    """``trainmode(model, mode=True)``: put every Dropout and BatchNorm in ``model`` in training mode, in place.

    ``mode=False`` means test mode and ``mode="auto"`` restores the default (training only
    inside :func:`fluxpy.gradient`, see :func:`istraining`). Returns ``model``.

    >>> import numpy as np
    >>> d = trainmode(Dropout(0.5, rng=0))
    >>> bool((d(np.ones(100)) == 0).any())   # drops even outside gradient
    True
    """
    return _set_mode(model, _mode_value(mode, True))


def testmode(model, mode=True):
    """``testmode(model, mode=True)``: put every Dropout and BatchNorm in test mode (identity / running stats), in place.

    ``mode=False`` means training mode, ``mode="auto"`` the default. Returns ``model``.

    >>> import numpy as np, fluxpy
    >>> d = testmode(Dropout(0.5))
    >>> fluxpy.gradient(lambda x: d(x).sum(), np.ones(3))   # never drops, even inside gradient
    (array([1., 1., 1.]),)
    """
    return _set_mode(model, _mode_value(mode, False))


testmode.__test__ = False  # not a test, whatever pytest guesses from the name


def _is_active(layer, *xs):
    return istraining(*xs) if layer.active is None else layer.active


def _mode_repr(active):
    return "" if active is None else f", active={active}"


# ---------------------------------------------------------------------------------------------
# Precision


def f32(model):
    """``f32(model)``: a copy of ``model`` with every floating-point array converted to float32.

    >>> f32(Dense(2, 3)).weight.dtype
    dtype('float32')
    """
    return _convert_floats(model, np.float32)


def f64(model):
    """``f64(model)``: a copy of ``model`` with every floating-point array converted to float64 (for gradient checks).

    >>> f64(Dense(2, 3)).weight.dtype
    dtype('float64')
    """
    return _convert_floats(model, np.float64)


def _convert_floats(model, dtype):
    return fmap(lambda a: a.astype(dtype) if is_float_array(a) else a, model)


# ---------------------------------------------------------------------------------------------
# Input checks and printing helpers


def _describe_input(x):
    if not hasattr(x, "shape"):
        return f"a {type(x).__name__}"
    return f"{tuple(x.shape)} {x.dtype}"


def _fail(layer, expectation, x):
    raise DimensionMismatch(f"{layer!r} expects {expectation}, got {_describe_input(x)}")


def _require_ndim(layer, x, ndim, layout):
    if not hasattr(x, "shape") or len(x.shape) != ndim:
        _fail(layer, f"a {ndim}-d input {layout}", x)


def _require_channels(layer, x, channels):
    _require_ndim(layer, x, 4, "(N, C, H, W)")
    if x.shape[1] != channels:
        _fail(layer, f"x.shape[1] == {channels}", x)


def _renamed(layer, err, op):
    """An error from a dims check (``"<op> expects ..."``) restated for the layer."""
    msg = str(err)
    if msg.startswith(op):
        msg = repr(layer) + msg[len(op):]
    return DimensionMismatch(msg)


_OPERATOR_NAMES = {operator.add: "+", operator.mul: "*", operator.sub: "-", operator.matmul: "@"}


def _fname(f):
    """How a function prints inside a layer's repr: ``relu``, ``+``, ``partial(leakyrelu, a=0.2)``."""
    if getattr(f, "__hash__", None) is not None and f in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[f]
    if isinstance(f, functools.partial):
        args = [_fname(f.func)] + [repr(a) for a in f.args] + [f"{k}={v!r}" for k, v in f.keywords.items()]
        return f"partial({', '.join(args)})"
    return getattr(f, "__name__", None) or getattr(f, "name", None) or repr(f)


def _act_part(act):
    return "" if act is identity or act is None else f", {_fname(act)}"


def _compact(value):
    """``1`` for ``(1, 1)`` or ``(1, 1, 1, 1)``, as Flux prints pads and strides."""
    if isinstance(value, (tuple, list)) and len(set(value)) == 1:
        return value[0]
    return tuple(value) if isinstance(value, list) else value


def _options(pairs):
    """``", pad=1, stride=2"``: the keyword options that differ from their defaults."""
    out = "".join(f", {name}={_compact(v)!r}" for name, v, default in pairs if _compact(v) != default)
    return out.replace("'", '"')


def _pair(name, value):
    pair = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, (int, np.integer)) and v >= 1 for v in pair):
        raise ValueError(f"{name} must be a positive int or a pair of them, got {value!r}")
    return tuple(int(v) for v in pair)


# ---------------------------------------------------------------------------------------------
# Chain


@layer(children=("layers",))
class Chain:
    """``Chain(*layers)``: apply the layers (any callables) in order, ``chain(x) = layers[-1](...layers[0](x))``.

    Indexing gives a layer, slicing a new Chain sharing the same layers; ``len`` and iteration
    work as for a tuple. ``repr`` prints one layer per line with its parameter count, as Flux.

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
    """

    def __init__(self, *layers):
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        for i, f in enumerate(layers):
            if not callable(f):
                raise TypeError(f"Chain: layer {i} is not callable: {f!r}")
        self.layers = tuple(layers)

    def __call__(self, x):
        for i, f in enumerate(self.layers):
            try:
                x = f(x)
            except DimensionMismatch as err:
                raise DimensionMismatch(f"Chain layer {i}: {err}") from None
        return x

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Chain(*self.layers[index])
        return self.layers[index]

    def __len__(self):
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __repr__(self):
        if _inside_repr():
            return f"Chain({', '.join(_layer_repr(f) for f in self.layers)})"
        return _block_repr(self)


# A Chain printed inside another layer's repr (SkipConnection, Parallel) takes one line.
_repr_depth = [0]


def _inside_repr():
    return _repr_depth[0] > 0


def _layer_repr(f):
    _repr_depth[0] += 1
    try:
        if isinstance(f, (types.FunctionType, types.BuiltinFunctionType, functools.partial, Primitive)):
            return _fname(f)
        return repr(f)
    finally:
        _repr_depth[0] -= 1


def _underscored(n):
    return f"{n:_}"


def _counts(model):
    """``(trainable arrays, trainable values, other arrays, other values, bytes)``."""
    train = trainables(model)
    ids = {id(a) for a in train}
    others, seen = [], set()

    def collect(st):
        if isinstance(st, dict):
            for v in st.values():
                collect(v)
        elif isinstance(st, list):
            for v in st:
                collect(v)
        elif st is not None and id(st) not in ids and id(st) not in seen:
            seen.add(id(st))
            others.append(st)
    collect(state(model))
    nbytes = sum(a.nbytes for a in train) + sum(a.nbytes for a in others)
    return len(train), sum(a.size for a in train), len(others), sum(a.size for a in others), nbytes


def _param_comment(model):
    ntrain, ptrain, nother, pother, _ = _counts(model)
    if ptrain == 0 and pother == 0:
        return ""
    text = f"# {_underscored(ptrain)} parameters"
    if pother:
        text += f", plus {_underscored(pother)} non-trainable"
    return text


def _block_lines(chain, indent):
    lines = []
    for f in chain.layers:
        if isinstance(f, Chain) and len(f.layers) > 0:
            lines.append((indent + "Chain(", ""))
            lines.extend(_block_lines(f, indent + "  "))
            lines.append((indent + "),", ""))
        else:
            lines.append((indent + _layer_repr(f) + ",", _param_comment(f)))
    return lines


def _block_repr(chain):
    lines = _block_lines(chain, "  ")
    width = max([len(text) for text, _ in lines] + [0]) + 2
    body = [text.ljust(width) + comment if comment else text for text, comment in lines]
    ntrain, ptrain, nother, pother, nbytes = _counts(chain)
    total = f"# Total: {ntrain} {'trainable ' if nother else ''}arrays, {_underscored(ptrain)} parameters"
    if nother:
        total += f", plus {nother} non-trainable, {_underscored(pother)} parameters"
    total += f", {nbytes / 1024:.3f} KiB."
    return "\n".join(["Chain("] + body + [")".ljust(width) + total])


# ---------------------------------------------------------------------------------------------
# Dense


@layer(children=("weight", "bias"))
class Dense:
    """``Dense(in, out, act=identity, bias=True, init=glorot_uniform, rng=None)``: ``y = act(x @ weight.T + bias)``.

    ``x`` is ``(batch, in)`` (any leading axes, or a single ``(in,)`` vector); ``weight`` is
    ``(out, in)``, ``bias`` ``(out,)`` (zeros; ``None`` with ``bias=False``). ``init(out, in,
    rng=rng)`` makes the weight; ``rng`` is a ``numpy.random.Generator`` or a seed.

    >>> import numpy as np
    >>> d = Dense(288, 10)
    >>> d, d.weight.shape, d(np.ones((128, 288), np.float32)).shape
    (Dense(288 => 10), (10, 288), (128, 10))
    >>> Dense(2, 3)(np.ones((5, 4), np.float32))
    Traceback (most recent call last):
    ...
    fluxpy.layers.DimensionMismatch: Dense(2 => 3) expects x.shape[-1] == 2, got (5, 4) float32
    """

    def __init__(self, in_features, out_features, act=identity, bias=True, init=glorot_uniform, rng=None):
        self.weight = init(out_features, in_features, rng=rng)
        self.bias = zeros32(out_features) if bias is True else _given_bias(bias, (out_features,), "Dense")
        self.act = act

    @property
    def in_features(self):
        return self.weight.shape[1]

    @property
    def out_features(self):
        return self.weight.shape[0]

    def __call__(self, x):
        if not hasattr(x, "shape") or len(x.shape) < 1 or x.shape[-1] != self.in_features:
            _fail(self, f"x.shape[-1] == {self.in_features}", x)
        return bias_act(matmul(x, transpose(self.weight)), self.bias, self.act)

    def __repr__(self):
        return (f"Dense({self.in_features} => {self.out_features}{_act_part(self.act)}"
                f"{'' if self.bias is not None else ', bias=False'})")


def _given_bias(bias, shape, name):
    """``bias=False`` -> None; an array -> itself (shape-checked)."""
    if bias is False or bias is None:
        return None
    if tuple(getattr(bias, "shape", ())) != shape:
        raise ValueError(f"{name}: bias must be True, False or an array of shape {shape}, got {bias!r}")
    return bias


# ---------------------------------------------------------------------------------------------
# Convolutions


@layer(children=("weight", "bias"))
class Conv:
    """``Conv(kernel, cin, cout, act=identity, *, stride=1, pad=0, dilation=1, groups=1, bias=True, init=glorot_uniform, rng=None)``.

    A 2-d convolution (true convolution, the kernel flipped, as Flux's ``Conv``; see
    :class:`CrossCor` for PyTorch's ``conv2d``), then the bias and ``act`` in one fused op:
    ``y = act(conv(x, weight) + bias)``. ``x`` is ``(N, cin, H, W)``, ``weight`` is
    ``(cout, cin/groups, *kernel)``, ``bias`` ``(cout,)``. ``pad`` is an int, a pair, a 4-tuple
    ``(top, bottom, left, right)`` or ``"same"``. Flux writes ``Conv((3, 3), 1 => 16, relu;
    pad=1)``; here it is ``Conv((3, 3), 1, 16, relu, pad=1)``, and ``repr`` prints Flux's form.

    >>> import numpy as np
    >>> c = Conv((3, 3), 1, 16, relu, pad=1)
    >>> c, c.weight.shape, c(np.ones((2, 1, 28, 28), np.float32)).shape
    (Conv((3, 3), 1 => 16, relu, pad=1), (16, 1, 3, 3), (2, 16, 28, 28))
    >>> Conv((3, 3), 2, 3)(np.ones((5, 4, 9, 9), np.float32))
    Traceback (most recent call last):
    ...
    fluxpy.layers.DimensionMismatch: Conv((3, 3), 2 => 3) expects x.shape[1] == 2, got (5, 4, 9, 9) float32
    """
    flipped = False

    def __init__(self, kernel, cin, cout, act=identity, *, stride=1, pad=0, dilation=1, groups=1, bias=True,
                 init=glorot_uniform, rng=None):
        kernel = _pair(f"{type(self).__name__}: kernel", kernel)
        if cin % groups or cout % groups:
            raise ValueError(f"{type(self).__name__}: groups == {groups} must divide cin == {cin} and cout == {cout}")
        self.weight = init(cout, cin // groups, *kernel, rng=rng)
        self.bias = zeros32(cout) if bias is True else _given_bias(bias, (cout,), type(self).__name__)
        self.act = act
        self.stride, self.pad, self.dilation, self.groups = stride, pad, dilation, groups

    @property
    def in_channels(self):
        return self.weight.shape[1] * self.groups

    @property
    def out_channels(self):
        return self.weight.shape[0]

    def _options(self):
        return dict(stride=self.stride, pad=self.pad, dilation=self.dilation, groups=self.groups,
                    flipped=self.flipped)

    def __call__(self, x):
        _require_channels(self, x, self.in_channels)
        try:
            conv_dims(x, self.weight, **self._options())
        except ValueError as err:
            raise _renamed(self, err, "conv") from None
        return conv_bias_act(x, self.weight, self.bias, self.act, **self._options())

    def __repr__(self):
        kernel = tuple(self.weight.shape[2:])
        return (f"{type(self).__name__}({kernel}, {self.in_channels} => {self.out_channels}{_act_part(self.act)}"
                + _options([("pad", self.pad, 0), ("stride", self.stride, 1), ("dilation", self.dilation, 1),
                            ("groups", self.groups, 1)])
                + ("" if self.bias is not None else ", bias=False") + ")")


@layer(children=("weight", "bias"))
class CrossCor(Conv):
    """``CrossCor(kernel, cin, cout, act=identity, **options)``: as :class:`Conv` but cross-correlation (no flip).

    The same weights as PyTorch's ``Conv2d``.

    >>> import numpy as np
    >>> c = CrossCor((2, 2), 1, 1, bias=False, init=ones32)
    >>> c, c(np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3))[0, 0]
    (CrossCor((2, 2), 1 => 1, bias=False), array([[ 8., 12.],
           [20., 24.]], dtype=float32))
    """
    flipped = True


@layer(children=("weight", "bias"))
class ConvTranspose:
    """``ConvTranspose(kernel, cin, cout, act=identity, *, stride=1, pad=0, dilation=1, groups=1, output_padding=0, bias=True, init=glorot_uniform, rng=None)``.

    The transpose (gradient with respect to the input) of :class:`Conv` with the same options,
    then ``act(. + bias)``: it maps ``(N, cin, H, W)`` to ``(N, cout, H', W')`` with
    ``H' = (H - 1) * stride - top - bottom + dilation * (kernel - 1) + 1 + output_padding``.
    ``weight`` is ``(cin, cout/groups, *kernel)``, as Flux.

    >>> import numpy as np
    >>> t = ConvTranspose((2, 2), 8, 4, relu, stride=2)
    >>> t, t.weight.shape, t(np.ones((1, 8, 7, 7), np.float32)).shape
    (ConvTranspose((2, 2), 8 => 4, relu, stride=2), (8, 4, 2, 2), (1, 4, 14, 14))
    """
    flipped = False

    def __init__(self, kernel, cin, cout, act=identity, *, stride=1, pad=0, dilation=1, groups=1, output_padding=0,
                 bias=True, init=glorot_uniform, rng=None):
        kernel = _pair("ConvTranspose: kernel", kernel)
        if cin % groups or cout % groups:
            raise ValueError(f"ConvTranspose: groups == {groups} must divide cin == {cin} and cout == {cout}")
        self.weight = init(cin, cout // groups, *kernel, rng=rng)
        self.bias = zeros32(cout) if bias is True else _given_bias(bias, (cout,), "ConvTranspose")
        self.act = act
        self.stride, self.pad, self.dilation, self.groups = stride, pad, dilation, groups
        self.output_padding = output_padding

    @property
    def in_channels(self):
        return self.weight.shape[0]

    @property
    def out_channels(self):
        return self.weight.shape[1] * self.groups

    def __call__(self, x):
        _require_channels(self, x, self.in_channels)
        try:  # conv_transpose validates the geometry before it runs any kernel
            y = conv_transpose(x, self.weight, stride=self.stride, pad=self.pad, dilation=self.dilation,
                               groups=self.groups, flipped=self.flipped, output_padding=self.output_padding)
        except ValueError as err:
            raise _renamed(self, err, "conv_transpose") from None
        bias = None if self.bias is None else reshape(self.bias, (1, -1, 1, 1))
        return bias_act(y, bias, self.act)

    def __repr__(self):
        kernel = tuple(self.weight.shape[2:])
        return (f"ConvTranspose({kernel}, {self.in_channels} => {self.out_channels}{_act_part(self.act)}"
                + _options([("pad", self.pad, 0), ("stride", self.stride, 1), ("dilation", self.dilation, 1),
                            ("groups", self.groups, 1), ("output_padding", self.output_padding, 0)])
                + ("" if self.bias is not None else ", bias=False") + ")")


# ---------------------------------------------------------------------------------------------
# Pooling


@layer(children=())
class MaxPool:
    """``MaxPool(kernel, stride=None, pad=0)``: the largest value of each window; ``stride`` defaults to ``kernel``.

    ``(N, C, H, W)`` -> ``(N, C, (H + pad_h - kh) // sh + 1, ...)``.

    >>> import numpy as np
    >>> p = MaxPool((2, 2))
    >>> p, p(np.ones((1, 16, 28, 28), np.float32)).shape
    (MaxPool((2, 2)), (1, 16, 14, 14))
    """
    _op = staticmethod(maxpool)
    _op_name = "maxpool"

    def __init__(self, kernel, stride=None, pad=0):
        self.kernel = _pair(f"{type(self).__name__}: kernel", kernel)
        self.stride = self.kernel if stride is None else _pair(f"{type(self).__name__}: stride", stride)
        self.pad = pad

    def __call__(self, x):
        _require_ndim(self, x, 4, "(N, C, H, W)")
        try:
            pool_dims(x, self.kernel, self.stride, self.pad, op=self._op_name)
        except ValueError as err:
            raise _renamed(self, err, self._op_name) from None
        return type(self)._op(x, self.kernel, stride=self.stride, pad=self.pad)

    def __repr__(self):
        return (f"{type(self).__name__}({self.kernel}"
                + _options([("pad", self.pad, 0), ("stride", self.stride, self.kernel[0] if
                                                    len(set(self.kernel)) == 1 else self.kernel)]) + ")")


@layer(children=())
class MeanPool(MaxPool):
    """``MeanPool(kernel, stride=None, pad=0)``: the mean of each window (padding counts as zeros).

    >>> import numpy as np
    >>> MeanPool((2, 2))(np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4))[0, 0]
    array([[ 2.5,  4.5],
           [10.5, 12.5]], dtype=float32)
    """
    _op = staticmethod(meanpool)
    _op_name = "meanpool"


@layer(children=())
class GlobalMaxPool:
    """``GlobalMaxPool()``: ``(N, C, H, W)`` -> ``(N, C, 1, 1)``, the largest value of each channel.

    >>> import numpy as np
    >>> GlobalMaxPool()(np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)).ravel()
    array([3., 7.], dtype=float32)
    """
    _op = staticmethod(global_maxpool)

    def __call__(self, x):
        _require_ndim(self, x, 4, "(N, C, H, W)")
        return type(self)._op(x)

    def __repr__(self):
        return f"{type(self).__name__}()"


@layer(children=())
class GlobalMeanPool(GlobalMaxPool):
    """``GlobalMeanPool()``: ``(N, C, H, W)`` -> ``(N, C, 1, 1)``, the mean of each channel.

    >>> import numpy as np
    >>> GlobalMeanPool()(np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)).ravel()
    array([1.5, 5.5], dtype=float32)
    """
    _op = staticmethod(global_meanpool)


@layer(children=())
class AdaptiveMaxPool:
    """``AdaptiveMaxPool(out_hw)``: max over ``out_hw`` near-equal bins, giving ``(N, C, *out_hw)`` for any H, W.

    >>> import numpy as np
    >>> p = AdaptiveMaxPool((2, 3))
    >>> p, p(np.ones((4, 3, 11, 7), np.float32)).shape
    (AdaptiveMaxPool((2, 3)), (4, 3, 2, 3))
    """
    _op = staticmethod(adaptive_maxpool)
    _op_name = "adaptive_maxpool"

    def __init__(self, out_hw):
        self.out_hw = _pair(f"{type(self).__name__}: out_hw", out_hw)

    def __call__(self, x):
        _require_ndim(self, x, 4, "(N, C, H, W)")
        try:
            AdaptivePoolDims.from_array(x, self.out_hw, op=self._op_name)
        except ValueError as err:
            raise _renamed(self, err, self._op_name) from None
        return type(self)._op(x, self.out_hw)

    def __repr__(self):
        return f"{type(self).__name__}({self.out_hw})"


@layer(children=())
class AdaptiveMeanPool(AdaptiveMaxPool):
    """``AdaptiveMeanPool(out_hw)``: the mean over ``out_hw`` near-equal bins.

    >>> import numpy as np
    >>> AdaptiveMeanPool((1, 1))(np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)).ravel()
    array([1.5], dtype=float32)
    """
    _op = staticmethod(adaptive_meanpool)
    _op_name = "adaptive_meanpool"


def flatten(x):
    """``flatten(x)``: ``(N, ...)`` -> ``(N, prod(...))``, keeping the observation axis.

    >>> import numpy as np
    >>> flatten(np.ones((128, 32, 3, 3))).shape
    (128, 288)
    """
    if not hasattr(x, "shape") or len(x.shape) < 1:
        raise DimensionMismatch(f"flatten expects an array with an observation axis, got {_describe_input(x)}")
    return reshape(x, (x.shape[0], -1))


# ---------------------------------------------------------------------------------------------
# Normalisation and regularisation


@layer(children=("gamma", "beta", "running_mean", "running_var"), trainable=("gamma", "beta"))
class BatchNorm:
    """``BatchNorm(C, act=identity, eps=1e-5, momentum=0.1, affine=True, track_stats=True)``: batch normalisation.

    ``x`` is ``(N, C, ...)``. Training: ``y = act((x - mean) / sqrt(var + eps) * gamma + beta)``
    with the batch's mean and variance over every axis but 1, and the running statistics
    move towards them: ``running = (1 - momentum) * running + momentum * batch`` (the
    variance unbiased, as Flux and PyTorch). Testing: the running statistics are used.
    Training happens inside :func:`fluxpy.gradient` unless :func:`trainmode`/:func:`testmode`
    say otherwise. ``gamma`` and ``beta`` are trainable; the running statistics are children
    (saved, moved to the GPU) but not trainable.

    >>> import numpy as np, fluxpy
    >>> bn = BatchNorm(2)
    >>> x = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> bn(x) is not None, bn.running_mean   # test mode outside gradient: stats unchanged
    (True, array([0., 0.], dtype=float32))
    >>> _ = fluxpy.gradient(lambda m: m(x).sum(), bn)   # training: stats move
    >>> bn.running_mean
    array([0.3, 0.4], dtype=float32)
    """
    _has_mode = True

    def __init__(self, channels, act=identity, eps=1e-5, momentum=0.1, affine=True, track_stats=True, active=None):
        self.gamma = ones32(channels) if affine else None
        self.beta = zeros32(channels) if affine else None
        self.running_mean = zeros32(channels) if track_stats else None
        self.running_var = ones32(channels) if track_stats else None
        self.channels = channels
        self.act, self.eps, self.momentum, self.active = act, eps, momentum, active

    def __call__(self, x):
        if not hasattr(x, "shape") or len(x.shape) < 2 or x.shape[1] != self.channels:
            _fail(self, f"x.shape[1] == {self.channels} (x of shape (N, C, ...))", x)
        if self.running_mean is None or _is_active(self, x, self.gamma, self.beta):
            y, mean, var = batchnorm_train(x, self.gamma, self.beta, self.eps)
            if self.running_mean is not None:
                self._track(mean, var, x.size // self.channels)
        else:
            y = batchnorm_infer(x, self.gamma, self.beta, self.running_mean, self.running_var, self.eps)
        return y if self.act is identity else bias_act(y, None, self.act)

    def _track(self, mean, var, m):
        # In place, so the model outside gradient (whose arrays the tape boxes, not copies) sees the update.
        mom = self.momentum
        running_mean, running_var = value_of(self.running_mean), value_of(self.running_var)
        running_mean *= 1 - mom
        running_mean += (mom * mean).astype(running_mean.dtype)
        running_var *= 1 - mom
        running_var += (mom * m / max(m - 1, 1) * var).astype(running_var.dtype)

    def __repr__(self):
        opts = [f", eps={self.eps}" if self.eps != 1e-5 else "",
                f", momentum={self.momentum}" if self.momentum != 0.1 else "",
                ", affine=False" if self.gamma is None else "",
                ", track_stats=False" if self.running_mean is None else ""]
        return f"BatchNorm({self.channels}{_act_part(self.act)}{''.join(opts)}{_mode_repr(self.active)})"


@layer(children=("gamma", "beta"))
class LayerNorm:
    """``LayerNorm(shape, act=identity, eps=1e-5, affine=True)``: normalise each sample over its last ``len(shape)`` axes.

    ``y = act((x - mean) / sqrt(var + eps) * gamma + beta)``, statistics per sample over the
    trailing axes, which must equal ``shape`` (an int or tuple); ``gamma`` (ones) and ``beta``
    (zeros) have that shape. PyTorch's ``LayerNorm(shape)``.

    >>> import numpy as np
    >>> ln = LayerNorm(4)
    >>> ln, ln(np.arange(8, dtype=np.float32).reshape(2, 4)).round(3)[0]
    (LayerNorm(4), array([-1.342, -0.447,  0.447,  1.342], dtype=float32))
    """

    def __init__(self, shape, act=identity, eps=1e-5, affine=True):
        self.shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        self.gamma = ones32(self.shape) if affine else None
        self.beta = zeros32(self.shape) if affine else None
        self.act, self.eps = act, eps

    def __call__(self, x):
        k = len(self.shape)
        if not hasattr(x, "shape") or tuple(x.shape[-k:]) != self.shape or len(x.shape) < k:
            _fail(self, f"x.shape[-{k}:] == {self.shape}", x)
        y = layernorm(x, self.gamma, self.beta, tuple(range(-k, 0)), self.eps)
        return y if self.act is identity else bias_act(y, None, self.act)

    def __repr__(self):
        shape = self.shape[0] if len(self.shape) == 1 else self.shape
        opts = (f", eps={self.eps}" if self.eps != 1e-5 else "") + (", affine=False" if self.gamma is None else "")
        return f"LayerNorm({shape}{_act_part(self.act)}{opts})"


@layer(children=())
class Dropout:
    """``Dropout(p, dims=None, rng=None)``: zero each entry with probability ``p`` and scale the rest by ``1/(1-p)``.

    Active inside :func:`fluxpy.gradient` (also when applied straight to the data), the identity
    otherwise, unless :func:`trainmode`/:func:`testmode` fix the mode. ``dims`` are the axes the mask
    varies along (``dims=(0, 1)`` on NCHW drops whole channels); ``rng`` a generator for the
    arrays' device (NumPy's for NumPy arrays) or a seed.

    >>> import numpy as np, fluxpy
    >>> d = Dropout(0.5, rng=0)
    >>> x = np.ones((2, 3), np.float32)
    >>> d, d(x) is x
    (Dropout(0.5), True)
    >>> g, = fluxpy.gradient(lambda x: d(x).sum(), x)
    >>> sorted(set(g.ravel().tolist())) in ([0.0, 2.0], [2.0], [0.0])
    True
    """
    _has_mode = True

    def __init__(self, p, dims=None, rng=None, active=None):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise ValueError(f"Dropout: p must be a probability in [0, 1), got {p!r}")
        self.p, self.dims, self.active = p, dims, active
        self.rng = rng if rng is None or hasattr(rng, "random") else np.random.default_rng(rng)

    def __call__(self, x):
        return dropout(x, self.p, rng=self.rng, dims=self.dims, active=_is_active(self, x))

    def __repr__(self):
        dims = "" if self.dims is None else f", dims={self.dims}"
        return f"Dropout({self.p}{dims}{_mode_repr(self.active)})"


# ---------------------------------------------------------------------------------------------
# Embedding and containers


@layer(children=("weight",))
class Embedding:
    """``Embedding(n, dim, init=randn32, rng=None)``: integer indices in ``[0, n)`` to rows of ``weight`` ``(n, dim)``.

    ``x`` of any shape gives ``x.shape + (dim,)``; the gradient scatters into the rows used
    (repeated indices accumulate).

    >>> import numpy as np
    >>> e = Embedding(10, 4)
    >>> e, e(np.array([[1, 2, 3]])).shape
    (Embedding(10 => 4), (1, 3, 4))
    """

    def __init__(self, n, dim, init=randn32, rng=None):
        self.weight = init(n, dim, rng=rng)

    def __call__(self, x):
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
    """``SkipConnection(layer, connection)``: ``connection(layer(x), x)``, e.g. a residual block with ``operator.add``.

    >>> import numpy as np, operator
    >>> s = SkipConnection(Dense(3, 3), operator.add)
    >>> s, s(np.ones((2, 3), np.float32)).shape
    (SkipConnection(Dense(3 => 3), +), (2, 3))
    """

    def __init__(self, layers, connection):
        self.layers = layers
        self.connection = connection

    def __call__(self, x):
        return self.connection(self.layers(x), x)

    def __repr__(self):
        return f"SkipConnection({_layer_repr(self.layers)}, {_fname(self.connection)})"


@layer(children=("connection", "layers"))
class Parallel:
    """``Parallel(connection, *layers)``: ``connection(layer_1(x), ..., layer_n(x))``.

    Called with several inputs, ``Parallel(c, f, g)(x, y) = c(f(x), g(y))``.

    >>> import numpy as np, fluxpy
    >>> p = Parallel(lambda *ys: fluxpy.concatenate(ys, axis=1), Dense(2, 3), Dense(2, 4))
    >>> p(np.ones((5, 2), np.float32)).shape
    (5, 7)
    """

    def __init__(self, connection, *layers):
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        self.connection = connection
        self.layers = tuple(layers)

    def __call__(self, *xs):
        if len(xs) == 1:
            return self.connection(*(f(xs[0]) for f in self.layers))
        if len(xs) != len(self.layers):
            raise DimensionMismatch(f"Parallel with {len(self.layers)} layers expects 1 or {len(self.layers)} inputs, "
                                    f"got {len(xs)}")
        return self.connection(*(f(x) for f, x in zip(self.layers, xs)))

    def __getitem__(self, index):
        return self.layers[index]

    def __len__(self):
        return len(self.layers)

    def __repr__(self):
        return f"Parallel({_fname(self.connection)}, {', '.join(_layer_repr(f) for f in self.layers)})"
