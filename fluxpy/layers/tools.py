"""Tools over whole models: ``destructure`` (Optimisers.jl's flat parameter vector and its rebuild), ``activations``
(Flux's per-layer outputs of a Chain), ``EMA`` (an exponential moving average of the weights, PyTorch's
``AveragedModel`` with an EMA rule; Flux has none) and gradient checkpointing (``Checkpoint``, ``checkpointed``:
PyTorch's ``torch.utils.checkpoint``; Flux has none).

They work on any model tree (:mod:`fluxpy.functors`) and sit above the layer families, which they never name.

>>> import numpy as np
>>> from fluxpy import Chain, Dense
>>> flat, re = destructure(Chain(Dense(2, 3, rng=0), Dense(3, 1, rng=1)))
>>> flat.shape, re(2 * flat)[0].weight.shape
((13,), (3, 2))
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..autodiff import Primitive, is_tracked, pullback, value_of
from ..backend import Array, gpu_device, is_array, is_float_dtype
from ..functors import children, fmap, layer, trainables
from ..random import default_rng
from ..ops.shape import astype, concatenate, getitem, reshape

__all__ = ["destructure", "Restructure", "activations", "EMA", "Checkpoint", "checkpointed"]


# ---------------------------------------------------------------------------------------------
# destructure


class Restructure:
    """The rebuild function :func:`destructure` returns: ``re(flat)`` is the model with its trainable arrays read
    from the vector ``flat`` (each in its own dtype), differentiable in ``flat``.

    >>> import numpy as np
    >>> from fluxpy import Dense
    >>> flat, re = destructure(Dense(2, 1, rng=0))
    >>> re
    Restructure(Dense, ..., 3)
    """

    def __init__(self, model: Any, layout: dict, length: int) -> None:
        self.model, self.layout, self.length = model, layout, length

    def __call__(self, flat: Array) -> Any:
        if not hasattr(flat, "shape") or tuple(flat.shape) != (self.length,):
            raise ValueError(f"destructure's rebuild expects a vector of {self.length} values (the trainable "
                             f"parameters), got {tuple(getattr(flat, 'shape', ())) or type(flat).__name__}")
        return fmap(lambda leaf: self._leaf(flat, leaf), self.model)

    def _leaf(self, flat, leaf):
        where = self.layout.get(id(leaf))
        if where is None:
            return leaf
        start, shape, dtype = where
        size = int(np.prod(shape, dtype=np.int64))
        part = reshape(getitem(flat, slice(start, start + size)), shape)
        return part if part.dtype == dtype else astype(part, dtype)

    def __repr__(self):
        return f"Restructure({type(self.model).__name__}, ..., {self.length})"


def destructure(model: Any) -> tuple[Array, Restructure]:
    """``(flat, re)``: the model's trainable arrays (:func:`fluxpy.trainables`: tied arrays once, BatchNorm's
    running statistics not) raveled into one vector, and the function that puts a vector of that length back into
    a copy of the model (Optimisers.jl's ``destructure``). ``flat`` has the arrays' promoted dtype; ``re(v)``
    differentiates through to ``v``, and ``flat`` through to the model, so ``gradient(v -> loss(re(v)), flat)`` is
    the gradient as one vector.

    >>> import numpy as np
    >>> from fluxpy import Dense, gradient
    >>> d = Dense(2, 1, rng=0)
    >>> flat, re = destructure(d)
    >>> x = np.ones((4, 2), np.float32)
    >>> g, = gradient(lambda v: re(v)(x).sum(), flat)
    >>> g
    array([4., 4., 4.], dtype=float32)
    """
    leaves = trainables(model) if not _has_tracked(model) else _tracked_leaves(model)
    if not leaves:
        return np.zeros(0, np.float32), Restructure(model, {}, 0)
    dtype = np.result_type(*[value_of(a).dtype for a in leaves])
    layout, start = {}, 0
    for a in leaves:
        layout[id(a)] = (start, tuple(a.shape), a.dtype)
        start += int(np.prod(a.shape, dtype=np.int64))
    flat = concatenate([reshape(a if a.dtype == dtype else astype(a, dtype), (-1,)) for a in leaves], 0)
    return flat, Restructure(model, layout, start)


def _has_tracked(model):
    found = []
    fmap(lambda leaf: found.append(leaf) if is_tracked(leaf) else None, model)
    return bool(found)


def _tracked_leaves(model):
    """The distinct float leaves of a model inside :func:`fluxpy.gradient` (its arrays are Tracked there)."""
    out, seen = [], set()

    def walk(x):
        kids = children(x)
        if kids is None:
            if (is_tracked(x) or is_array(x)) and is_float_dtype(value_of(x).dtype) and id(x) not in seen:
                seen.add(id(x))
                out.append(x)
            return
        for _, v in kids:
            walk(v)
    walk(model)
    return out


# ---------------------------------------------------------------------------------------------
# activations


def activations(chain: Any, x: Any) -> tuple:
    """The output of every layer of ``chain`` in turn (Flux's ``activations(c::Chain, x)``): a tuple as long as
    the chain, whose last entry is ``chain(x)``.

    >>> import numpy as np
    >>> from fluxpy import Chain, Dense, relu
    >>> outs = activations(Chain(Dense(2, 3, relu, rng=0), Dense(3, 1, rng=1)), np.ones((5, 2), np.float32))
    >>> [y.shape for y in outs]
    [(5, 3), (5, 1)]
    """
    layers = getattr(chain, "layers", None)
    if not isinstance(layers, (tuple, list)):
        raise TypeError(f"activations expects a Chain (a model with a tuple of layers), got {type(chain).__name__}")
    out = []
    for f in layers:
        x = f(x)
        out.append(x)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# EMA


class EMA:
    """An exponential moving average of a model's trainable arrays: ``update(model)`` moves each average by
    ``avg = decay * avg + (1 - decay) * weight`` (PyTorch's ``AveragedModel`` with ``get_ema_multi_avg_fn(decay)``;
    the averages start as copies of the weights, PyTorch's first update), in place on the arrays' device;
    ``copy_to(model)`` writes the averages into the model's arrays, ``averaged(model)`` gives a copy of the model
    holding them (the model is left as it is). Non-trainable arrays (BatchNorm's running statistics) are not
    averaged.

    >>> import numpy as np
    >>> from fluxpy import Dense
    >>> d = Dense(2, 1, rng=0)
    >>> ema = EMA(d, decay=0.5)
    >>> d.bias[...] = 4.0
    >>> ema.update(d)
    >>> ema, ema.averaged(d).bias, ema.count
    (EMA(decay=0.5), array([2.], dtype=float32), 1)
    """

    def __init__(self, model: Any, decay: float = 0.999) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float, np.floating)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA: decay must be a number in [0, 1], got {decay!r}")
        self.decay = float(decay)
        self.shadow = [value_of(a).copy() for a in trainables(model)]
        self.count = 0

    def _pairs(self, model, who):
        params = [value_of(a) for a in trainables(model)]
        if [tuple(a.shape) for a in params] != [tuple(s.shape) for s in self.shadow]:
            raise ValueError(f"EMA.{who} expects the model the EMA was made from: {len(self.shadow)} trainable "
                             f"arrays of shapes {[tuple(s.shape) for s in self.shadow]}, got "
                             f"{[tuple(a.shape) for a in params]}")
        if any(gpu_device(a) != gpu_device(s) for a, s in zip(params, self.shadow)):
            raise ValueError(f"EMA.{who}: the model and the averages are on different devices; move the EMA with "
                             f"the model (EMA(fluxpy.gpu(model)))")
        return zip(self.shadow, params)

    def update(self, model: Any) -> None:
        """Move each average towards the model's weight (in place)."""
        for s, p in self._pairs(model, "update"):
            s *= self.decay
            s += ((1.0 - self.decay) * p).astype(s.dtype, copy=False)
        self.count += 1

    def copy_to(self, model: Any) -> None:
        """Write the averages into the model's trainable arrays (in place)."""
        for s, p in self._pairs(model, "copy_to"):
            p[...] = s

    def averaged(self, model: Any) -> Any:
        """A copy of ``model`` holding the averages (arrays shared, not copied); the model is unchanged."""
        by_id = {id(p): s for s, p in self._pairs(model, "averaged")}
        return fmap(lambda leaf: by_id.get(id(leaf), leaf), model)

    def __repr__(self):
        return f"EMA(decay={self.decay})"


# ---------------------------------------------------------------------------------------------
# Gradient checkpointing


class _Plan:
    """What a checkpointed call needs beyond its arrays: the function, how many inputs come first, and where each
    tracked leaf of the function's tree sits (by identity)."""

    def __init__(self, fn, n_inputs, leaves):
        self.fn, self.n_inputs = fn, n_inputs
        self.index = {id(leaf): k for k, leaf in enumerate(leaves)}

    def bound(self, values):
        """The function with its tracked leaves replaced by ``values``."""
        if not self.index:
            return self.fn
        return fmap(lambda leaf: values[self.index[id(leaf)]] if id(leaf) in self.index else leaf, self.fn)

    def run(self, args):
        return self.bound(args[self.n_inputs:])(*args[:self.n_inputs])


def _checkpoint_rule(plan, *args):
    state = _random_state()
    y = plan.run(args)
    if not hasattr(y, "shape"):
        raise TypeError(f"Checkpoint expects a function that returns one array, got a {type(y).__name__}")
    if is_tracked(y) and not any(is_tracked(a) for a in args):
        raise ValueError("Checkpoint: the function reads differentiated arrays that are neither its inputs nor "
                         "fields of its layer (a closure?); pass them as inputs: checkpointed(f)(x, w)")

    def checkpoint_pullback(dy):
        # Run the forward again, now on a tape, from the same random state (NumPy's generator), then pull back.
        now = _random_state()
        _set_random_state(state)
        try:
            _, back = pullback(lambda *a: plan.run(a), *args)
        finally:
            _set_random_state(now)
        return (None,) + tuple(back(dy))
    return y, checkpoint_pullback


_checkpoint = Primitive("checkpoint", _checkpoint_rule)


def _random_state():
    """The state of fluxpy's NumPy generator (the CPU's dropout masks), a host dict: cheap, and read without
    waiting for a device. The GPU's generator keeps its position on the device and is not restored."""
    return default_rng().bit_generator.state


def _set_random_state(state):
    default_rng().bit_generator.state = state


def checkpointed(f: Callable) -> Callable:
    """``f`` (a layer, a model, or any function of arrays returning one array) run without keeping its
    intermediate values for the backward pass: the forward computes only the output, and the pullback runs ``f``
    again on a tape and pulls back through it (PyTorch's ``torch.utils.checkpoint``). Memory for the activations
    inside ``f`` is traded for a second forward. The gradients reach ``f``'s arrays (a layer's weights, found in its
    tree) and its array inputs; an array ``f`` reads from a closure is neither (an error: pass it as an input).
    They differentiate once (the recomputed backward is not itself recorded).

    The recompute starts from the same state of NumPy's generator, so Dropout inside ``f`` draws the same masks on
    the CPU; on the GPU it would draw new ones, so keep random layers outside a checkpointed block there. A layer
    that changes state when called (BatchNorm's running statistics in training) changes it twice, as in PyTorch.

    >>> import numpy as np
    >>> from fluxpy import Chain, Dense, gradient, tanh
    >>> block = Chain(Dense(3, 8, tanh, rng=0), Dense(8, 3, rng=1))
    >>> x = np.ones((2, 3), np.float32)
    >>> g1, = gradient(lambda m: checkpointed(m)(x).sum(), block)
    >>> g2, = gradient(lambda m: m(x).sum(), block)
    >>> bool(np.allclose(g1["layers"][0]["weight"], g2["layers"][0]["weight"]))
    True
    """
    def run(*xs):
        leaves = []
        fmap(lambda leaf: leaves.append(leaf) if is_tracked(leaf) else None, f)
        return _checkpoint(_Plan(f, len(xs), leaves), *xs, *leaves)
    return run


@layer(children=("layer",))
class Checkpoint:
    """``layer`` with gradient checkpointing (:func:`checkpointed`): its activations are recomputed in the
    backward pass instead of being kept from the forward.

    >>> import numpy as np
    >>> from fluxpy import Chain, Dense, relu
    >>> m = Chain(Checkpoint(Dense(4, 16, relu, rng=0)), Dense(16, 1, rng=2))
    >>> m[0], m(np.ones((3, 4), np.float32)).shape
    (Checkpoint(Dense(4 => 16, relu)), (3, 1))
    """

    def __init__(self, layer: Callable) -> None:
        if not callable(layer):
            raise TypeError(f"Checkpoint expects a callable layer, got {type(layer).__name__}")
        self.layer = layer

    def __call__(self, *xs: Any) -> Any:
        return checkpointed(self.layer)(*xs)

    def __repr__(self):
        return f"Checkpoint({self.layer!r})"
