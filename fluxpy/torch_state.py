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
n-gate bias, which PyTorch applies inside ``r * (...)``, must be zero: Flux's GRU has none); a stacked or
bidirectional one (``num_layers``, ``bidirectional``) pairs with the fluxpy layer of the same form as one module
(``weight_ih_l1_reverse`` is the cell of layer 1's reverse direction).

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

from .backend import get_array_module, is_array, to_cpu
from .functors import children
from .layers import (GRU, LSTM, RNN, BatchNorm, Conv, ConvTranspose, CrossCor, Dense, DepthwiseConv, Embedding,
                     GroupNorm, GRUCell, InstanceNorm, LayerNorm, LSTMCell, MultiHeadAttention, PReLU, RMSNorm, RNNCell)

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
    """PyTorch's arrays ``names`` and the fluxpy attributes ``attrs`` (dotted paths in the layer) they make:
    ``load(*arrays)`` gives the attributes' values (raising ValueError where it cannot), ``save(*values)``
    PyTorch's arrays back."""
    names: tuple
    attrs: tuple
    load: Callable
    save: Callable


def _one(name, attr, convert=_same):
    return _Pair((name,), (attr,), lambda a: (convert(a),), lambda v: (convert(v),))


def _recurrent_bias(cell, suffix="_l0", attr="bias"):
    """PyTorch's two biases ``bias_ih{suffix}``, ``bias_hh{suffix}`` as a cell's one (on the input projection,
    Flux's form; the layer's attribute ``attr``): summed; written back as ``(bias, 0)``. A GRU's recurrent bias of
    its n gate sits inside ``r * (...)`` in PyTorch: it must be zero."""
    def load(ih, hh):
        if isinstance(cell, GRUCell):
            h = hh.shape[0] // 3
            if np.any(hh[2 * h:]):
                raise ValueError(f"load_torch_state: {cell!r} has no recurrent bias of the n gate, but PyTorch's "
                                 f"bias_hh{suffix}[{2 * h}:] is not zero (PyTorch's GRU adds it inside r * (...))")
        return (ih + hh,)
    return _Pair((f"bias_ih{suffix}", f"bias_hh{suffix}"), (attr,), load, lambda v: (v, np.zeros_like(v)))


def _stacked_pairs(layer):
    """A stacked or bidirectional RNN, LSTM or GRU: PyTorch's ``weight_ih_l{k}[_reverse]``, ... per layer and
    direction, in PyTorch's order (the layer's ``cell``, then ``stacked.0``, ``stacked.1``, ...)."""
    directions = 2 if layer.bidirectional else 1
    pairs = []
    for k, cell in enumerate((layer.cell,) + layer.stacked):
        suffix = f"_l{k // directions}" + ("_reverse" if k % directions else "")
        path = "cell" if k == 0 else f"stacked.{k - 1}"
        pairs += [_one(f"weight_ih{suffix}", f"{path}.weight_ih"), _one(f"weight_hh{suffix}", f"{path}.weight_hh"),
                  _recurrent_bias(cell, suffix, f"{path}.bias")]
    return pairs


def _is_stacked(layer):
    return isinstance(layer, (RNN, LSTM, GRU)) and bool(layer.stacked)


def _split3(name, part):
    """PyTorch's packed ``in_proj_weight`` / ``in_proj_bias`` as the q, k and v projections' ``part``."""
    def load(a):
        if a.shape[0] % 3:
            raise ValueError(f"load_torch_state: {name} has {a.shape[0]} rows, not three equal parts (q, k, v)")
        return tuple(np.split(a, 3))
    return _Pair((name,), tuple(f"{p}_proj.{part}" for p in "qkv"), load, lambda *qkv: (np.concatenate(qkv),))


def _pairs(layer) -> list[list[_Pair]]:
    """The :class:`_Pair` s of each PyTorch module ``layer`` takes, in PyTorch's order: one module for most layers,
    two for attention (``attn`` with the packed q, k, v projections, then ``attn.out_proj``)."""
    held = {k for k, v in _array_items(layer)}
    if isinstance(layer, MultiHeadAttention):
        if layer.q_proj.weight.shape[1] != layer.k_proj.weight.shape[1] or \
                layer.q_proj.weight.shape[1] != layer.v_proj.weight.shape[1]:
            packed = [_one(f"{p}_proj_weight", f"{p}_proj.weight") for p in "qkv"]
        else:
            packed = [_split3("in_proj_weight", "weight")]
        modules = [packed + [_split3("in_proj_bias", "bias")], [_one("weight", "out_proj.weight"),
                                                                 _one("bias", "out_proj.bias")]]
    elif isinstance(layer, _CONVS):
        modules = [[_one("weight", "weight", _kernel(layer)), _one("bias", "bias")]]
    elif isinstance(layer, (Dense, Embedding, PReLU)):
        modules = [[_one("weight", "weight"), _one("bias", "bias")]]
    elif isinstance(layer, _NORMS):
        modules = [[_one("weight", "gamma"), _one("bias", "beta"), _one("running_mean", "running_mean"),
                    _one("running_var", "running_var")]]
    elif _is_stacked(layer):
        modules = [_stacked_pairs(layer)]
    elif isinstance(layer, _CELLS):   # PyTorch's one-layer RNN, LSTM and GRU (gate orders i f g o and r z n alike)
        modules = [[_one("weight_ih_l0", "weight_ih"), _one("weight_hh_l0", "weight_hh"), _recurrent_bias(layer)]]
    else:
        raise TypeError(f"load_torch_state: no PyTorch mapping for {type(layer).__name__} yet (it holds "
                        f"{', '.join(sorted(held))}); the layers with one: Dense, Conv, CrossCor, DepthwiseConv, "
                        f"ConvTranspose, BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm, Embedding, PReLU, "
                        f"RNN, LSTM, GRU, MultiHeadAttention (and the transformer layers made of them)")
    return [[p for p in pairs if all(a in held for a in p.attrs)] for pairs in modules]


def _array_items(layer, prefix=""):
    """``(dotted attribute, array)`` for each array of ``layer`` and of its sub-layers."""
    out = []
    for k, v in children(layer) or []:
        if is_array(v):
            out.append((f"{prefix}{k}", v))
        elif children(v) is not None:
            out += _array_items(v, f"{prefix}{k}.")
    return out


def _attribute(layer, dotted):
    for part in dotted.split("."):
        layer = layer[int(part)] if isinstance(layer, (tuple, list)) else getattr(layer, part)
    return layer


def _array_layers(model, path=""):
    """``(path, layer)`` for each node of ``model`` that holds arrays itself (an attention layer counts as one),
    in order (Chain order, then attribute order); ``path`` is fluxpy's (``"layers.0"``)."""
    kids = children(model)
    if kids is None:
        return []
    if isinstance(model, MultiHeadAttention) or _is_stacked(model) or any(is_array(v) for _, v in kids):
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
    units = [(path, layer, _pairs(layer)) for path, layer in layers]
    if sum(len(modules) for _, _, modules in units) != len(groups):
        raise ValueError(f"load_torch_state: the model has {len(layers)} layers with arrays "
                         f"({', '.join(type(v).__name__ for _, v in layers)}) but the state has {len(groups)} "
                         f"modules ({', '.join(m or '<root>' for m, _ in groups)})")
    plan, i = [], 0
    for path, layer, modules in units:
        for pairs in modules:
            module, entries = groups[i]
            i += 1
            plan += _planned_module(state, path, layer, pairs, module, entries)
    return plan


def _planned_module(state, path, layer, pairs, module, entries):
    names = {name: key for name, key in entries}
    wanted = [n for p in pairs for n in p.names]
    if set(names) != set(wanted):
        raise ValueError(f"load_torch_state: module {module!r} holds {sorted(names)} but the layer it pairs with, "
                         f"{path} ({layer!r}), takes {sorted(wanted)}")
    plan = []
    for pair in pairs:
        keys = [names[n] for n in pair.names]
        arrays = [_host(state[k], k) for k in keys]
        if len({a.shape for a in arrays}) > 1:
            raise ValueError(f"load_torch_state: {keys} have shapes {[a.shape for a in arrays]}, not one")
        for attr, value in zip(pair.attrs, pair.load(*arrays)):
            target = _attribute(layer, attr)
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"load_torch_state: {keys[0]!r} gives shape {tuple(value.shape)} but "
                                 f"{path}.{attr} of {layer!r} has shape {tuple(target.shape)}")
            where = f"{path}.{attr}" if path else attr
            plan += [(k, where, target, value) for k in keys]
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
    for _, _, target, value in plan:   # an attribute made of two arrays is written twice, alike
        target[...] = get_array_module(target).asarray(value.astype(target.dtype))
    keys: dict = {}
    for key, path, _, _ in plan:   # a packed array (attention's in_proj) names its parts together
        keys[key] = path if key not in keys else f"{keys[key]}, {path}"
    return keys


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
    units = [(path, _pairs(layer), layer) for path, layer in _array_layers(model)]
    prefixes = [f"{path}.out_proj" if n else path for path, modules, _ in units for n in range(len(modules))]
    if like is not None:
        modules = [m for m, _ in _grouped(like)]
        if len(modules) != len(prefixes):
            raise ValueError(f"to_torch_state: the model has {len(prefixes)} modules with arrays but like has "
                             f"{len(modules)} modules")
        prefixes = modules
    else:
        prefixes = [p.removeprefix("layers.").replace(".layers.", ".") for p in prefixes]
    i = 0
    for _, modules, layer in units:
        for pairs in modules:
            prefix, i = prefixes[i], i + 1
            for pair in pairs:
                arrays = [np.asarray(to_cpu(_attribute(layer, a))) for a in pair.attrs]
                for name, value in zip(pair.names, pair.save(*arrays)):
                    out[f"{prefix}.{name}" if prefix else name] = np.ascontiguousarray(value)
    return out

