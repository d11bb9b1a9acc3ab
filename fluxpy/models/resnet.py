"""Residual networks (He et al. 2016) built of fluxpy's public layers: :func:`resnet20` (CIFAR) and :func:`resnet18`.

A basic block is ``conv3x3(stride) -> BatchNorm(relu) -> conv3x3 -> BatchNorm``, added to the shortcut, then relu:

- ``Chain(SkipConnection(body, +), relu)`` where the shapes agree (identity shortcut);
- ``Chain(Parallel(+, body, Chain(conv1x1(stride), BatchNorm)), relu)`` where they do not (projection shortcut).

Every convolution is bias-free (the BatchNorm after it has the shift), He-normal initialised
(fan_in), and by default a ``CrossCor`` (PyTorch's conv2d; ``conv=Conv`` for true convolutions).
BatchNorm has PyTorch's defaults, eps 1e-5 and momentum 0.1. Inputs are NCHW float32.

>>> import numpy as np
>>> model = resnet20(rng=0)
>>> parameter_count(model)
272474
>>> model(np.zeros((2, 3, 32, 32), np.float32)).shape
(2, 10)
"""
from __future__ import annotations

import numbers
import operator

import numpy as np

from ..functors import trainables
from ..layers import (BatchNorm, Chain, Conv, CrossCor, Dense, GlobalMeanPool, Parallel, SkipConnection, flatten,
                     kaiming_normal)
from ..ops.activations import relu
from ..random import RNG, as_rng

__all__ = ["resnet20", "resnet18", "basic_block", "parameter_count", "RESNETS", "RESNET20_PARAMETERS",
           "RESNET18_PARAMETERS"]

RESNET20_PARAMETERS = 272_474
"""The trainable parameters of ``resnet20()`` (10 classes)."""
RESNET18_PARAMETERS = 11_271_432
"""The trainable parameters of ``resnet18()`` (200 classes)."""


def _conv(conv, kernel, cin, cout, rng, stride=1):
    return conv((kernel, kernel), cin, cout, stride=stride, pad=kernel // 2, bias=False, init=kaiming_normal, rng=rng)


def basic_block(cin: int, cout: int, stride: int = 1, *, rng: RNG = None, conv=CrossCor) -> Chain:
    """ResNet's basic block ``relu(body(x) + shortcut(x))``: ``cin => cout`` channels, the first conv with ``stride``;
    the shortcut is the identity when ``stride == 1`` and ``cin == cout``, else a projection (conv1x1 + BatchNorm).

    >>> import numpy as np
    >>> block = basic_block(16, 32, 2, rng=0)
    >>> type(block[0]).__name__, block(np.ones((2, 16, 8, 8), np.float32)).shape
    ('Parallel', (2, 32, 4, 4))
    >>> type(basic_block(16, 16, rng=0)[0]).__name__
    'SkipConnection'
    """
    rng = as_rng(rng, "basic_block")
    body = Chain(_conv(conv, 3, cin, cout, rng, stride), BatchNorm(cout, relu),
                 _conv(conv, 3, cout, cout, rng), BatchNorm(cout))
    if stride == 1 and cin == cout:
        return Chain(SkipConnection(body, operator.add), relu)
    shortcut = Chain(_conv(conv, 1, cin, cout, rng, stride), BatchNorm(cout))
    return Chain(Parallel(operator.add, body, shortcut), relu)


def _resnet(who, rng, stem_width, stages, classes, conv):
    """Stem ``conv3x3(3 => stem_width), BatchNorm(relu)``, then ``stages`` of ``(width, blocks, stride)``, global
    mean pool, ``Dense(width => classes)``."""
    if isinstance(classes, bool) or not isinstance(classes, numbers.Integral) or classes < 1:
        raise ValueError(f"{who} expects classes to be an int >= 1, got {classes!r}")
    if not (isinstance(conv, type) and issubclass(conv, Conv)):
        raise TypeError(f"{who} expects conv to be fluxpy's Conv or CrossCor (the class), got {conv!r}")
    rng = as_rng(rng, who)
    layers = [_conv(conv, 3, 3, stem_width, rng), BatchNorm(stem_width, relu)]
    cin = stem_width
    for width, blocks, stride in stages:
        stage = []
        for i in range(blocks):
            stage.append(basic_block(cin, width, stride if i == 0 else 1, rng=rng, conv=conv))
            cin = width
        layers.append(Chain(stage))
    return Chain(*layers, GlobalMeanPool(), flatten, Dense(cin, int(classes), rng=rng))


def resnet20(rng: RNG = None, classes: int = 10, conv=CrossCor) -> Chain:
    """ResNet-20 for CIFAR (He et al. 2016, section 4.2), for ``(N, 3, 32, 32)`` inputs.

    Stem conv3x3 3 => 16 + BatchNorm(relu), three stages of three basic blocks of 16, 32, 64
    channels (at 32x32, 16x16, 8x8), the first block of stages 2 and 3 with stride 2 and a
    projection shortcut (conv1x1 stride 2 + BatchNorm: the paper's option B), global mean pool,
    ``Dense(64 => classes)``. 272,474 trainable parameters with 10 classes
    (:data:`RESNET20_PARAMETERS`). ``rng``: a ``numpy.random.Generator``, an int seed, or ``None``
    for fluxpy's global generator (:func:`fluxpy.seed`).

    >>> import numpy as np
    >>> model = resnet20(rng=0)
    >>> parameter_count(model) == RESNET20_PARAMETERS == 272_474
    True
    >>> x = np.zeros((2, 3, 32, 32), np.float32)
    >>> model[:3](x).shape, model[:4](x).shape, model[:5](x).shape, model(x).shape
    ((2, 16, 32, 32), (2, 32, 16, 16), (2, 64, 8, 8), (2, 10))
    """
    return _resnet("resnet20", rng, 16, [(16, 3, 1), (32, 3, 2), (64, 3, 2)], classes, conv)


def resnet18(rng: RNG = None, classes: int = 200, conv=CrossCor) -> Chain:
    """ResNet-18 for ``(N, 3, 64, 64)`` inputs (Tiny-ImageNet size, 200 classes).

    torchvision's ResNet-18 (stages of two basic blocks of 64, 128, 256, 512 channels, projection
    shortcuts where the shape changes) with the CIFAR-style stem, a 3x3 stride-1 conv 3 => 64 +
    BatchNorm(relu) and NO max pool, in place of the 7x7 stride-2 conv and max pool. So stage 1
    runs at the full 64x64 (then 32, 16, 8): about 2.3 GFLOPs (multiply-adds) per image forward, a
    compute-heavy net beside ResNet-20's small, launch-bound convolutions. 11,271,432 trainable
    parameters with 200 classes (:data:`RESNET18_PARAMETERS`).

    >>> parameter_count(resnet18(rng=0, classes=10))
    11173962
    """
    return _resnet("resnet18", rng, 64, [(64, 2, 1), (128, 2, 2), (256, 2, 2), (512, 2, 2)], classes, conv)


RESNETS = {"resnet20": (resnet20, (3, 32, 32), 10), "resnet18": (resnet18, (3, 64, 64), 200)}
"""name -> (constructor(rng), input shape (C, H, W), classes)."""


def parameter_count(model) -> int:
    """The number of trainable parameters of ``model`` (:func:`fluxpy.trainables`: running statistics excluded).

    >>> from fluxpy.layers import Dense
    >>> parameter_count(Dense(3, 2))
    8
    """
    return sum(int(np.prod(p.shape)) for p in trainables(model))
