"""A fluxpy model from a PyTorch module, weights included: :func:`from_torch`.

Each PyTorch module becomes the fluxpy layer that computes the same function in PyTorch's layouts: ``Sequential`` a
:class:`~fluxpy.layers.Chain`, ``Conv1d/2d/3d`` a :class:`~fluxpy.layers.CrossCor` (PyTorch's convolution is a
cross-correlation), ``ConvTranspose`` a :class:`~fluxpy.layers.ConvTranspose`, ``Linear`` a
:class:`~fluxpy.layers.Dense`, the normalisations, ``Embedding``, the pools, ``Flatten``, ``Dropout``,
``TransformerEncoderLayer`` and ``TransformerEncoder`` (batch first) and the activations their fluxpy namesakes,
and torchvision's ``ResNet`` (any of its depths and widths, ResNeXt's groups too) with its ``BasicBlock`` and
``Bottleneck`` (``Chain(SkipConnection(body, +), relu)``, or ``Parallel(+, body, downsample)`` where the block has
a ``downsample``, as :func:`fluxpy.models.basic_block` builds them);
then :func:`fluxpy.load_torch_state` copies the weights (and running statistics). The model's float dtype follows
the module's parameters (float64 gives :func:`fluxpy.f64`). A module with no fluxpy twin (or an option fluxpy does
not have, such as a convolution's ``padding_mode="reflect"``) raises
``TypeError`` naming it and its path.

>>> import torch                                                   # doctest: +SKIP
>>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
...                           torch.nn.Linear(4 * 26 * 26, 10))    # doctest: +SKIP
>>> from_torch(net)                                                # doctest: +SKIP
Chain(CrossCor((3, 3), 1 => 4), relu, flatten, Dense(2704 => 10))
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import numpy as np

from .layers import (AdaptiveMaxPool, AdaptiveMeanPool, BatchNorm, Chain, ConvTranspose, CrossCor, Dense, Dropout,
                     Embedding, GroupNorm, LayerNorm, MaxPool, MeanPool, Parallel, SkipConnection,
                     TransformerEncoderLayer, flatten)
from .ops import activations as act
from .layers.convert import f64
from .torch_state import load_torch_state

__all__ = ["from_torch"]


def _unsupported(module, path, why=""):
    raise TypeError(f"from_torch: no fluxpy twin for {type(module).__name__} at {path or '<root>'}"
                    + (f" ({why})" if why else ""))


def _conv(m, path):
    if m.padding_mode != "zeros":
        _unsupported(m, path, f"padding_mode={m.padding_mode!r}; fluxpy pads with zeros")
    pad = m.padding if isinstance(m.padding, str) else tuple(m.padding)
    pad = 0 if pad == "valid" else pad
    return CrossCor(tuple(m.kernel_size), m.in_channels, m.out_channels, stride=tuple(m.stride), pad=pad,
                    dilation=tuple(m.dilation), groups=m.groups, bias=m.bias is not None)


def _conv_transpose(m, path):
    if m.padding_mode != "zeros":
        _unsupported(m, path, f"padding_mode={m.padding_mode!r}")
    return ConvTranspose(tuple(m.kernel_size), m.in_channels, m.out_channels, stride=tuple(m.stride),
                         pad=tuple(m.padding), dilation=tuple(m.dilation), groups=m.groups,
                         output_padding=tuple(m.output_padding), bias=m.bias is not None)


def _batchnorm(m, path, activation=act.identity):
    if m.momentum is None:
        _unsupported(m, path, "momentum=None (a cumulative average); fluxpy's running statistics use a momentum")
    return BatchNorm(m.num_features, activation, eps=m.eps, momentum=m.momentum, affine=m.affine,
                     track_stats=m.track_running_stats)


def _torchvision(m, path):
    """Refuse a module that only shares a name with torchvision's (its forward is not read, only its parts)."""
    if not type(m).__module__.startswith("torchvision.models."):
        _unsupported(m, path, f"a {type(m).__name__} of {type(m).__module__}: only torchvision's converts, whose "
                              "forward fluxpy knows")


def _residual(body, m, path):
    """torchvision's ``relu(body(x) + shortcut(x))``, the shortcut ``m.downsample`` or the identity."""
    if m.downsample is None:
        return Chain(SkipConnection(body, operator.add), act.relu)
    return Chain(Parallel(operator.add, body, _convert(m.downsample, f"{path}.downsample")), act.relu)


def _basic_block(m, path):
    _torchvision(m, path)
    body = Chain(_conv(m.conv1, f"{path}.conv1"), _batchnorm(m.bn1, f"{path}.bn1", act.relu),
                 _conv(m.conv2, f"{path}.conv2"), _batchnorm(m.bn2, f"{path}.bn2"))
    return _residual(body, m, path)


def _bottleneck(m, path):
    _torchvision(m, path)
    body = Chain(_conv(m.conv1, f"{path}.conv1"), _batchnorm(m.bn1, f"{path}.bn1", act.relu),
                 _conv(m.conv2, f"{path}.conv2"), _batchnorm(m.bn2, f"{path}.bn2", act.relu),
                 _conv(m.conv3, f"{path}.conv3"), _batchnorm(m.bn3, f"{path}.bn3"))
    return _residual(body, m, path)


def _resnet(m, path):
    """torchvision's ResNet (any depth, width or groups): stem, max pool, four stages, mean pool, ``fc``."""
    _torchvision(m, path)
    at = (lambda name: f"{path}.{name}" if path else name)
    stages = [_convert(getattr(m, f"layer{i}"), at(f"layer{i}")) for i in range(1, 5)]
    return Chain(_conv(m.conv1, at("conv1")), _batchnorm(m.bn1, at("bn1"), act.relu),
                 _convert(m.maxpool, at("maxpool")), *stages, _convert(m.avgpool, at("avgpool")), flatten,
                 _convert(m.fc, at("fc")))


def _layernorm(m, path):
    if getattr(m, "bias", 0) is None and m.elementwise_affine:
        _unsupported(m, path, "a scale without a shift (bias=False)")
    return LayerNorm(tuple(m.normalized_shape), eps=m.eps, affine=m.elementwise_affine)


def _pool(layer):
    def make(m, path):
        if getattr(m, "ceil_mode", False):
            _unsupported(m, path, "ceil_mode=True")
        if getattr(m, "dilation", 1) not in (1, (1, 1), (1, 1, 1)):
            _unsupported(m, path, "a dilated pool")
        if layer is MeanPool and not m.count_include_pad and np.any(np.asarray(m.padding)):
            _unsupported(m, path, "count_include_pad=False with padding")
        if layer is MeanPool and getattr(m, "divisor_override", None) is not None:
            _unsupported(m, path, "divisor_override")
        stride = m.kernel_size if m.stride is None else m.stride
        return layer(m.kernel_size, stride=stride, pad=m.padding)
    return make


def _flatten(m, path):
    if m.start_dim != 1 or m.end_dim != -1:
        _unsupported(m, path, f"start_dim={m.start_dim}, end_dim={m.end_dim}; fluxpy's flatten keeps the batch axis")
    return flatten


def _embedding(m, path):
    if m.max_norm is not None:
        _unsupported(m, path, "max_norm")
    return Embedding(m.num_embeddings, m.embedding_dim, padding_idx=m.padding_idx)


def _encoder_layer(m, path):
    if not m.self_attn.batch_first:
        _unsupported(m, path, "batch_first=False; fluxpy's layers are batch first")
    act_fn = {1: act.relu, 2: act.gelu_erf}.get(getattr(m, "activation_relu_or_gelu", 0))
    if act_fn is None:
        _unsupported(m, path, f"activation {m.activation!r}; relu and gelu convert")
    return TransformerEncoderLayer(m.self_attn.embed_dim, m.self_attn.num_heads, m.linear1.out_features, act=act_fn,
                                   dropout=m.dropout.p, norm_first=m.norm_first, eps=m.norm1.eps,
                                   bias=m.linear1.bias is not None)


def _encoder(m, path):
    if getattr(m, "mask_check", True) is False or m.norm is not None and type(m.norm).__name__ != "LayerNorm":
        _unsupported(m, path, "a final norm other than LayerNorm")
    layers = [_convert(c, f"{path}.layers.{i}" if path else f"layers.{i}") for i, c in enumerate(m.layers)]
    return Chain(*layers, *([_convert(m.norm, f"{path}.norm")] if m.norm is not None else []))


def _gelu(m, path):
    return act.gelu if m.approximate == "tanh" else act.gelu_erf


def _function(f, m, path):
    """An activation module's fluxpy function (it has no options)."""
    return f


def _table():
    """PyTorch module class name -> maker ``(module, path) -> fluxpy layer or function``."""
    same = {"ReLU": act.relu, "ReLU6": act.relu6, "Tanh": act.tanh, "Sigmoid": act.sigmoid, "SiLU": act.swish,
            "Softplus": act.softplus, "Hardtanh": act.hardtanh, "Identity": act.identity}
    table = {name: functools.partial(_function, f) for name, f in same.items()}
    for dims in ("1d", "2d", "3d"):
        table[f"Conv{dims}"] = _conv
        table[f"ConvTranspose{dims}"] = _conv_transpose
        table[f"BatchNorm{dims}"] = _batchnorm
        table[f"MaxPool{dims}"] = _pool(MaxPool)
        table[f"AvgPool{dims}"] = _pool(MeanPool)
        table[f"AdaptiveAvgPool{dims}"] = lambda m, path: AdaptiveMeanPool(m.output_size)
        table[f"AdaptiveMaxPool{dims}"] = lambda m, path: AdaptiveMaxPool(m.output_size)
    table.update({
        "Linear": lambda m, path: Dense(m.in_features, m.out_features, bias=m.bias is not None),
        "LayerNorm": _layernorm,
        "GroupNorm": lambda m, path: GroupNorm(m.num_channels, m.num_groups, eps=m.eps, affine=m.affine),
        "Embedding": _embedding,
        "Dropout": lambda m, path: Dropout(m.p),
        "Flatten": _flatten,
        "TransformerEncoderLayer": _encoder_layer,
        "TransformerEncoder": _encoder,
        "GELU": _gelu,
        "LeakyReLU": lambda m, path: functools.partial(act.leakyrelu, a=m.negative_slope),
        "ELU": lambda m, path: functools.partial(act.elu, a=m.alpha),
        "Sequential": lambda m, path: Chain(*(_convert(c, f"{path}.{k}" if path else k)
                                              for k, c in m.named_children())),
        "BasicBlock": _basic_block,
        "Bottleneck": _bottleneck,
        "ResNet": _resnet,
    })
    return table


def _convert(module, path):
    maker = _table().get(type(module).__name__)
    if maker is None:
        _unsupported(module, path)
    return maker(module, path)


def from_torch(module: Any) -> Any:
    """The fluxpy model computing what the PyTorch ``module`` computes, with its weights and running statistics
    (see the module docstring for what converts). Parameters in float64 give a float64 model, otherwise float32.

    >>> from_torch(3)
    Traceback (most recent call last):
    TypeError: from_torch expects a torch.nn.Module, got int
    """
    if not hasattr(module, "state_dict") or not hasattr(module, "named_children"):
        raise TypeError(f"from_torch expects a torch.nn.Module, got {type(module).__name__}")
    model = _convert(module, "")
    dtypes = {str(p.dtype) for p in module.parameters()}
    if dtypes == {"torch.float64"}:
        model = f64(model)
    load_torch_state(model, module.state_dict())
    return model
