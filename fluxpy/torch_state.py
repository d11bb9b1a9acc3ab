"""PyTorch weights in and out: :func:`load_torch_state` and :func:`to_torch_state`.

A PyTorch state dict names its arrays by module path (``"0.weight"``, ``"features.3.running_mean"``); a fluxpy model
names them by its own structure (``"layers.0.weight"``). The two are paired by order: the state dict's modules (its
keys grouped by the path before the last dot, in the dict's order, which is PyTorch's registration order) against
the fluxpy model's layers that hold arrays, walked in order. Each pair must be of one kind (a ``Linear`` with a
:class:`~fluxpy.layers.Dense`, a ``Conv2d`` with a :class:`~fluxpy.layers.CrossCor` or a ``Conv``, ...) with the same
names and shapes, or nothing is changed and the error says which pair differs.

Layouts: fluxpy's layers hold PyTorch's layouts (``Dense.weight`` is ``(out, in)`` as ``Linear.weight``, convolution
kernels ``(out, in/groups, *kernel)``, transposed ones ``(in, out/groups, *kernel)``, ``Embedding.weight``
``(num, dim)``), with one difference: :class:`~fluxpy.layers.Conv`, :class:`~fluxpy.layers.DepthwiseConv` and
:class:`~fluxpy.layers.ConvTranspose` are Flux's true convolutions, so their kernels are PyTorch's flipped along every
spatial axis (a :class:`~fluxpy.layers.CrossCor` takes PyTorch's as they are). Normalisation layers name their
scale and shift ``gamma`` and ``beta`` where PyTorch says ``weight`` and ``bias``. One-layer ``RNN``, ``LSTM`` and
``GRU`` (PyTorch's gate orders) pair with fluxpy's cells, whose one bias is PyTorch's two summed (a GRU's recurrent
n-gate bias, which PyTorch applies inside ``r * (...)``, must be zero: Flux's GRU has none).

>>> import numpy as np
>>> from fluxpy import Chain, Dense, relu
>>> model = Chain(Dense(2, 3, relu), Dense(3, 1))
>>> state = {"0.weight": np.ones((3, 2), np.float32), "0.bias": np.zeros(3, np.float32),
...          "2.weight": np.full((1, 3), 2.0, np.float32), "2.bias": np.ones(1, np.float32)}
>>> load_torch_state(model, state)
{'0.weight': 'layers.0.weight', '0.bias': 'layers.0.bias', '2.weight': 'layers.1.weight', '2.bias': 'layers.1.bias'}
>>> model(np.ones((1, 2), np.float32))
array([[13.]], dtype=float32)
>>> list(to_torch_state(model))
['0.weight', '0.bias', '1.weight', '1.bias']
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .backend import get_array_module, is_array
from .functors import children
from .layers import (BatchNorm, Conv, ConvTranspose, CrossCor, Dense, DepthwiseConv, Embedding, GroupNorm,
                     GRUCell, InstanceNorm, LayerNorm, LSTMCell, PReLU, RMSNorm, RNNCell)

__all__ = ["load_torch_state", "to_torch_state"]

_SKIPPED = ("num_batches_tracked",)   # PyTorch's BatchNorm counter: fluxpy's momentum is fixed, it has no use


def _flip(a):
    """``a`` reversed along its spatial axes (every axis after the first two)."""
    return a[(slice(None), slice(None)) + (slice(None, None, -1),) * (a.ndim - 2)]


def _same(a):
    return a


def _kernel(layer):
    return _same if layer.flipped else _flip


_CONVS = (Conv, CrossCor, DepthwiseConv, ConvTranspose)
_NORMS = (BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm)
_CELLS = (RNNCell, LSTMCell, GRUCell)


@dataclasses.dataclass(frozen=True)
class _Pair:
    """PyTorch's arrays ``names`` and the fluxpy attribute ``attr`` they make: ``load(*arrays)`` gives the attribute's
    value (raising ValueError where it cannot), ``save(value)`` PyTorch's arrays back."""
    names: tuple
    attr: str
    load: Callable = _same
    save: Callable = lambda v: (v,)


def _one(name, attr, convert=_same):
    return _Pair((name,), attr, convert, lambda v: (convert(v),))


def _recurrent_bias(cell):
    """PyTorch's two biases as a cell's one (on the input projection, Flux's form): summed; written back as
    ``(bias, 0)``. A GRU's recurrent bias of its n gate sits inside ``r * (...)`` in PyTorch: it must be zero."""
    def load(ih, hh):
        if isinstance(cell, GRUCell):
            h = hh.shape[0] // 3
            if np.any(hh[2 * h:]):
                raise ValueError(f"load_torch_state: {cell!r} has no recurrent bias of the n gate, but PyTorch's "
                                 f"bias_hh_l0[{2 * h}:] is not zero (PyTorch's GRU adds it inside r * (...))")
        return ih + hh
    return _Pair(("bias_ih_l0", "bias_hh_l0"), "bias", load, lambda v: (v, np.zeros_like(v)))


def _pairs(layer) -> list[_Pair]:
    """A :class:`_Pair` for each array ``layer`` holds, in PyTorch's order."""
    held = [k for k, v in children(layer) or [] if is_array(v)]
    if isinstance(layer, _CONVS):
        table = [_one("weight", "weight", _kernel(layer)), _one("bias", "bias")]
    elif isinstance(layer, (Dense, Embedding, PReLU)):
        table = [_one("weight", "weight"), _one("bias", "bias")]
    elif isinstance(layer, _NORMS):
        table = [_one("weight", "gamma"), _one("bias", "beta"), _one("running_mean", "running_mean"),
                 _one("running_var", "running_var")]
    elif isinstance(layer, _CELLS):   # PyTorch's one-layer RNN, LSTM and GRU (gate orders i f g o and r z n alike)
        table = [_one("weight_ih_l0", "weight_ih"), _one("weight_hh_l0", "weight_hh"), _recurrent_bias(layer)]
    else:
        raise TypeError(f"load_torch_state: no PyTorch mapping for {type(layer).__name__} yet (it holds "
                        f"{', '.join(held)}); the layers with one: Dense, Conv, CrossCor, DepthwiseConv, "
                        f"ConvTranspose, BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm, Embedding, PReLU, "
                        f"RNN, LSTM, GRU")
    return [p for p in table if p.attr in held]


def _array_layers(model, path=""):
    """``(path, layer)`` for each node of ``model`` that holds arrays itself, in order (Chain order, then
    attribute order); ``path`` is fluxpy's (``"layers.0"``)."""
    kids = children(model)
    if kids is None:
        return []
    if any(is_array(v) for _, v in kids):
        return [(path, model)]
    out = []
    for k, v in kids:
        out += _array_layers(v, f"{path}.{k}" if path else str(k))
    return out


def _grouped(state):
    """The state dict's keys grouped by module path, in order: ``[(module path, [(name, key), ...])]``."""
    groups: dict = {}
    for key in state:
        module, _, name = key.rpartition(".")
        if name in _SKIPPED:
            continue
        groups.setdefault(module, []).append((name, key))
    return list(groups.items())


def _host(value, key):
    """A state dict's entry as a NumPy array (a torch tensor through ``.detach().cpu().numpy()``)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"load_torch_state: expects the state's {key!r} to be an array or a torch tensor, got "
                        f"{type(value).__name__}")
    return value


def _read_state(source):
    if isinstance(source, Mapping):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_torch_state: expects a state dict (a mapping of names to arrays or tensors) or the "
                        f"path of a .safetensors or .pt file, got {type(source).__name__}")
    path = os.fspath(source)
    if path.endswith(".safetensors"):
        from safetensors.numpy import load_file
        return load_file(path)
    try:
        import torch
    except ImportError:
        raise ImportError(f"load_torch_state: reading {path!r} (a PyTorch pickle) needs torch; save the state as "
                          f".safetensors to read it without torch") from None
    return torch.load(path, map_location="cpu", weights_only=True)


def _plan(model, state):
    """Every ``(torch key, fluxpy path, layer, attribute, array)`` to copy, checked whole before any change."""
    layers, groups = _array_layers(model), _grouped(state)
    if len(layers) != len(groups):
        raise ValueError(f"load_torch_state: the model has {len(layers)} layers with arrays "
                         f"({', '.join(type(v).__name__ for _, v in layers)}) but the state has {len(groups)} "
                         f"modules ({', '.join(m or '<root>' for m, _ in groups)})")
    plan = []
    for (path, layer), (module, entries) in zip(layers, groups):
        pairs = _pairs(layer)
        names = {name: key for name, key in entries}
        wanted = [n for p in pairs for n in p.names]
        if set(names) != set(wanted):
            raise ValueError(f"load_torch_state: module {module!r} holds {sorted(names)} but the layer it pairs with, "
                             f"{path} ({layer!r}), takes {sorted(wanted)}")
        for pair in pairs:
            keys = [names[n] for n in pair.names]
            arrays = [_host(state[k], k) for k in keys]
            if len({a.shape for a in arrays}) > 1:
                raise ValueError(f"load_torch_state: {keys} have shapes {[a.shape for a in arrays]}, not one")
            value = pair.load(*arrays)
            target = getattr(layer, pair.attr)
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"load_torch_state: {keys[0]!r} has shape {tuple(value.shape)} but "
                                 f"{path}.{pair.attr} of {layer!r} has shape {tuple(target.shape)}")
            where = f"{path}.{pair.attr}" if path else pair.attr
            plan += [(k, where, layer, pair.attr, value) for k in keys]
    return plan


def load_torch_state(model: Any, state: Mapping | str | os.PathLike) -> dict:
    """Copy a PyTorch state dict (a mapping of names to torch tensors or NumPy arrays, or a ``.safetensors`` or
    ``.pt`` file of one) into ``model``'s arrays, in place (each keeps its dtype and device); returns the key map
    ``{torch key: fluxpy path}``. Pairs and layouts: see the module docstring. Every pair is checked before any array
    changes. BatchNorm's ``num_batches_tracked`` is ignored.

    >>> import numpy as np
    >>> from fluxpy.layers import CrossCor, Conv
    >>> w = np.arange(4.0, dtype=np.float32).reshape(1, 1, 2, 2)
    >>> a, b = CrossCor((2, 2), 1, 1), Conv((2, 2), 1, 1)
    >>> _ = load_torch_state(a, {"weight": w, "bias": np.zeros(1, np.float32)})
    >>> _ = load_torch_state(b, {"weight": w, "bias": np.zeros(1, np.float32)})
    >>> a.weight[0, 0].tolist(), b.weight[0, 0].tolist()     # Conv holds the flipped kernel: the same function
    ([[0.0, 1.0], [2.0, 3.0]], [[3.0, 2.0], [1.0, 0.0]])
    """
    plan = _plan(model, _read_state(state))
    for _, _, layer, attr, value in plan:   # an attribute made of two arrays is written twice, alike
        target = getattr(layer, attr)
        target[...] = get_array_module(target).asarray(value.astype(target.dtype))
    return {key: path for key, path, _, _, _ in plan}


def to_torch_state(model: Any, like: Mapping | None = None) -> dict:
    """``model``'s arrays as a PyTorch state dict of NumPy arrays (host copies, in PyTorch's layouts): keys from the
    model's structure (``"0.weight"`` for the first layer of a Chain), or, with ``like`` (a PyTorch state dict, or
    any mapping with its keys), that dict's keys paired by order as :func:`load_torch_state` pairs them. Load it with
    ``module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)`` (BatchNorm's
    ``num_batches_tracked`` is not written).

    >>> import numpy as np
    >>> from fluxpy.layers import Chain, BatchNorm, Dense
    >>> state = to_torch_state(Chain(Dense(2, 3), BatchNorm(3)))
    >>> [(k, v.shape) for k, v in state.items()][:3]
    [('0.weight', (3, 2)), ('0.bias', (3,)), ('1.weight', (3,))]
    """
    out = {}
    layers = _array_layers(model)
    modules = None if like is None else [m for m, _ in _grouped(like)]
    if modules is not None and len(modules) != len(layers):
        raise ValueError(f"to_torch_state: the model has {len(layers)} layers with arrays but like has "
                         f"{len(modules)} modules")
    for i, (path, layer) in enumerate(layers):
        prefix = path.removeprefix("layers.").replace(".layers.", ".") if modules is None else modules[i]
        for pair in _pairs(layer):
            array = getattr(layer, pair.attr)
            host = array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else np.asarray(array)
            for name, value in zip(pair.names, pair.save(host)):
                out[f"{prefix}.{name}" if prefix else name] = np.ascontiguousarray(value)
    return out
