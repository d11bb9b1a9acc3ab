"""The benchmark networks (``../shared/DESIGN.md``, "Reference model") in fluxpy and in PyTorch, same weights.

``reference_net``: the Flux model-zoo MNIST conv net of 2019 (the profile of Flux issue #558);
``lenet5``: today's model-zoo LeNet-5. ``torch_twin(torch, model)`` builds the same network in
PyTorch with the same weights (fluxpy's ``Conv`` is a true convolution, so PyTorch's
cross-correlating ``Conv2d`` gets the flipped kernels).

``resnet20`` (CIFAR, 3x32x32) and ``resnet18`` (3x64x64): residual nets of fluxpy's public layers
(``RESNETS``; built by ``fluxpy.models`` and re-exported here, with ``basic_block``, ``parameter_count`` and the
parameter counts); ``resnet_twin(torch, model)`` builds any tree of those layers in PyTorch, written as
torchvision writes its ResNets (in-place add and ReLU), with the same weights.
"""
from __future__ import annotations

import copy
import operator
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fluxpy.layers import (BatchNorm, Chain, Conv, Dense, GlobalMeanPool, MaxPool, Parallel,  # noqa: E402
                           SkipConnection, flatten)
import fluxpy  # noqa: E402
from fluxpy.autodiff import Primitive  # noqa: E402
from fluxpy.models import (RESNET18_PARAMETERS, RESNET20_PARAMETERS, RESNETS, basic_block,  # noqa: E402, F401
                           parameter_count, resnet18, resnet20)
from fluxpy.ops.activations import identity, relu  # noqa: E402


def reference_net(rng):
    return Chain(Conv((3, 3), 1, 16, relu, pad=1, rng=rng), MaxPool((2, 2)),
                 Conv((3, 3), 16, 32, relu, pad=1, rng=rng), MaxPool((2, 2)),
                 Conv((3, 3), 32, 32, relu, pad=1, rng=rng), MaxPool((2, 2)),
                 flatten, Dense(288, 10, rng=rng))


def lenet5(rng):
    return Chain(Conv((5, 5), 1, 6, relu, rng=rng), MaxPool((2, 2)),
                 Conv((5, 5), 6, 16, relu, rng=rng), MaxPool((2, 2)),
                 flatten, Dense(256, 120, relu, rng=rng), Dense(120, 84, relu, rng=rng), Dense(84, 10, rng=rng))


MODELS = {"reference": reference_net, "lenet5": lenet5}


def torch_twin(torch, model):
    """The same layers and weights as a ``torch.nn.Sequential`` (on the CPU; move it yourself)."""
    nn = torch.nn
    layers = []
    for layer in model:
        if isinstance(layer, Conv):
            k, c, r, s = layer.weight.shape
            conv = nn.Conv2d(c, k, (r, s), padding=layer.pad[0] if isinstance(layer.pad, tuple) else layer.pad)
            _copy(torch, conv, layer.weight[:, :, ::-1, ::-1], layer.bias)
            layers.append(conv)
        elif isinstance(layer, Dense):
            out, inp = layer.weight.shape
            lin = nn.Linear(inp, out)
            _copy(torch, lin, layer.weight, layer.bias)
            layers.append(lin)
        elif isinstance(layer, MaxPool):
            layers.append(nn.MaxPool2d(layer.kernel))
        elif layer is flatten:
            layers.append(nn.Flatten())
        else:
            raise TypeError(f"torch_twin: no PyTorch twin for {layer!r}")
        act = getattr(layer, "act", identity)
        if act is relu:
            layers.append(nn.ReLU())
        elif act is not identity:
            raise TypeError(f"torch_twin: no PyTorch twin for the activation of {layer!r}")
    return nn.Sequential(*layers)


def _copy(torch, module, weight, bias):
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight)))
        module.bias.copy_(torch.from_numpy(np.ascontiguousarray(bias)))


# ---------------------------------------------------------------------------------------------------------------
# Residual nets (He et al. 2016) of fluxpy's public layers: built by fluxpy.models (imported above); their
# PyTorch twin.
# ---------------------------------------------------------------------------------------------------------------

def fluxpy_adam_step(model, x, labels, classes, device, lr, capture=False):
    """``(step, first loss, the model it trains)``: ``step()`` is one Adam step (``fluxpy.TrainStep``; ``capture``:
    replayed from a CUDA graph on the GPU) of a copy of ``model`` on ``device``, with ``logitcrossentropy`` on the
    one-hot ``labels``, always on the batch ``x`` (NumPy)."""
    y = fluxpy.onehotbatch(labels, range(classes))
    move = fluxpy.gpu if device == "gpu" else fluxpy.cpu
    model, x, y = move((copy.deepcopy(model), x, y))   # fluxpy.cpu keeps NumPy arrays as they are: copy first
    step = fluxpy.TrainStep(lambda m, x, y: fluxpy.logitcrossentropy(m(x), y), model,
                            fluxpy.setup(fluxpy.Adam(lr), model), capture=capture)
    first = float(step(x, y))
    return (lambda: step(x, y)), first, model


def torch_adam_step(torch, net, x, labels, device, lr):
    """``(step, first loss)``: ``step()`` is one Adam step of the PyTorch ``net`` on the batch ``x`` (NumPy)
    with cross-entropy on the class indices ``labels``, on ``device`` ("gpu" or "cpu")."""
    dev = "cuda" if device == "gpu" else "cpu"
    net = net.to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    tx, ty = torch.from_numpy(x).to(dev), torch.from_numpy(labels).to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(net(tx), ty)
        loss.backward()
        opt.step()
        return loss.detach()
    first = float(step())
    return step, first


def resnet_twin(torch, model):
    """The same network and weights in PyTorch (an ``nn.Module`` on the CPU; move it yourself).

    Handles Chain, Conv / CrossCor (any bias, relu or no activation), BatchNorm (2-d inputs of 4-d images, relu
    or none; the running statistics copied too), Dense, SkipConnection and Parallel with ``operator.add``,
    GlobalMeanPool, MaxPool, ``flatten`` and ``relu``. Written as torchvision's ResNets: ``nn.ReLU(inplace=True)``
    and the residual sum added in place into the body's output (``out += shortcut(x)``). fluxpy's ``Conv`` is a
    true convolution, so its kernels are flipped for PyTorch's cross-correlation; a ``CrossCor``'s are copied as
    they are. Each module takes its layer's dtype (float64 for a model converted with ``fluxpy.f64``, else float32).
    """
    nn = torch.nn

    class Residual(nn.Module):
        """``out = body(x); out += shortcut(x)`` (the identity when shortcut is None), as torchvision's blocks."""

        def __init__(self, body, shortcut=None):
            super().__init__()
            self.body, self.shortcut = body, shortcut

        def forward(self, x):
            out = self.body(x)
            out += x if self.shortcut is None else self.shortcut(x)
            return out

    def act(layer, module):
        a = getattr(layer, "act", identity)
        if _same_op(a, identity):
            return module
        if _same_op(a, relu):
            return nn.Sequential(module, nn.ReLU(inplace=True))
        raise TypeError(f"resnet_twin: no PyTorch twin for the activation of {layer!r}")

    def param(t):
        return torch.from_numpy(np.ascontiguousarray(t))

    def dtype(a):
        return torch.float64 if a is not None and a.dtype == np.float64 else torch.float32

    def convert(layer):
        if isinstance(layer, Chain):
            return nn.Sequential(*(convert(f) for f in layer))
        if isinstance(layer, Conv):  # and CrossCor
            if layer.groups != 1 or layer.dilation not in (1, (1, 1)):
                raise TypeError(f"resnet_twin: groups and dilation are not supported: {layer!r}")
            k, c, r, s = layer.weight.shape
            conv = nn.Conv2d(c, k, (r, s), stride=layer.stride, padding=_torch_pad(layer.pad),
                             bias=layer.bias is not None, dtype=dtype(layer.weight))
            w = layer.weight if layer.flipped else layer.weight[:, :, ::-1, ::-1]
            with torch.no_grad():
                conv.weight.copy_(param(w))
                if layer.bias is not None:
                    conv.bias.copy_(param(layer.bias))
            return act(layer, conv)
        if isinstance(layer, BatchNorm):
            bn = nn.BatchNorm2d(layer.channels, eps=layer.eps, momentum=layer.momentum,
                                affine=layer.gamma is not None, track_running_stats=layer.running_mean is not None,
                                dtype=dtype(layer.gamma if layer.gamma is not None else layer.running_mean))
            with torch.no_grad():
                if layer.gamma is not None:
                    bn.weight.copy_(param(layer.gamma))
                    bn.bias.copy_(param(layer.beta))
                if layer.running_mean is not None:
                    bn.running_mean.copy_(param(layer.running_mean))
                    bn.running_var.copy_(param(layer.running_var))
            return act(layer, bn)
        if isinstance(layer, Dense):
            out, inp = layer.weight.shape
            lin = nn.Linear(inp, out, bias=layer.bias is not None, dtype=dtype(layer.weight))
            with torch.no_grad():
                lin.weight.copy_(param(layer.weight))
                if layer.bias is not None:
                    lin.bias.copy_(param(layer.bias))
            return act(layer, lin)
        if isinstance(layer, SkipConnection) and layer.connection is operator.add:
            return Residual(convert(layer.layers))
        if isinstance(layer, Parallel) and layer.connection is operator.add and len(layer) == 2:
            return Residual(convert(layer[0]), convert(layer[1]))
        if isinstance(layer, GlobalMeanPool):
            return nn.AdaptiveAvgPool2d(1)
        if isinstance(layer, MaxPool):
            return nn.MaxPool2d(layer.kernel, layer.stride, padding=_torch_pad(layer.pad))
        if layer is flatten:
            return nn.Flatten()
        if _same_op(layer, relu):
            return nn.ReLU(inplace=True)
        raise TypeError(f"resnet_twin: no PyTorch twin for {layer!r}")

    return convert(model)


def _same_op(f, op):
    """``f is op``, or a copy of that op: ``fluxpy.gpu``/``cpu``/``f64`` copy an activation that stands alone in a
    Chain (a ``Primitive`` is a tree node to ``fluxpy.functors``, with public fields), so ``gpu(m)[i] is relu`` fails."""
    return f is op or (isinstance(f, Primitive) and isinstance(op, Primitive) and f.name == op.name
                       and f.rule is op.rule)


def _torch_pad(pad):
    """fluxpy's symmetric ``pad`` (an int, a pair, or a 4-tuple with equal sides) as PyTorch's ``padding``."""
    if isinstance(pad, int):
        return pad
    pad = tuple(pad) if not isinstance(pad, str) else pad
    if isinstance(pad, tuple) and len(pad) == 2:
        return pad
    if isinstance(pad, tuple) and len(pad) == 4 and pad[0] == pad[1] and pad[2] == pad[3]:
        return (pad[0], pad[2])
    raise TypeError(f"resnet_twin: no PyTorch padding for pad={pad!r}")

