"""The benchmark networks (``../shared/DESIGN.md``, "Reference model") in fluxpy and in PyTorch, same weights.

``reference_net``: the Flux model-zoo MNIST conv net of 2019 (the profile of Flux issue #558);
``lenet5``: today's model-zoo LeNet-5. ``torch_twin(torch, model)`` builds the same network in
PyTorch with the same weights (fluxpy's ``Conv`` is a true convolution, so PyTorch's
cross-correlating ``Conv2d`` gets the flipped kernels).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fluxpy.layers import Chain, Conv, Dense, MaxPool, flatten  # noqa: E402
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
