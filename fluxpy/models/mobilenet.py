"""A MobileNet-style network for CIFAR (Howard et al. 2017): depthwise-separable convolutions, :func:`mobilenet_cifar`.

A depthwise-separable block (:func:`separable_block`) is a 3x3 ``DepthwiseConv`` (one kernel per channel, with the
block's stride) then ``BatchNorm(act)``, then a 1x1 ``CrossCor`` mixing the channels, then ``BatchNorm(act)``: about
a ninth of a full 3x3 convolution's multiply-adds. Every convolution is bias-free (the BatchNorm after it has the
shift) and He-normal initialised (fan_in); ``act`` is ``relu6`` (MobileNet's) unless given. Inputs are NCHW float32.

>>> import numpy as np
>>> from fluxpy.models import parameter_count
>>> model = mobilenet_cifar(rng=0)
>>> parameter_count(model) == MOBILENET_CIFAR_PARAMETERS
True
>>> model(np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)).shape
(2, 10)
"""
from __future__ import annotations

import numbers

from ..layers import BatchNorm, Chain, CrossCor, Dense, DepthwiseConv, GlobalMeanPool, flatten, kaiming_normal
from ..ops.activations import relu6
from ..random import RNG, as_rng

__all__ = ["mobilenet_cifar", "separable_block", "MOBILENET_CIFAR_STAGES", "MOBILENET_CIFAR_PARAMETERS"]

MOBILENET_CIFAR_STAGES = ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1), (512, 1), (512, 1),
                          (512, 1), (512, 1), (1024, 2), (1024, 1))
"""``(channels, stride)`` of each depthwise-separable block of :func:`mobilenet_cifar`: MobileNet v1's thirteen,
with the stem's stride 2 dropped for 32x32 inputs (so the feature maps are 32, 16, 8, 4 and 2 pixels wide)."""

MOBILENET_CIFAR_PARAMETERS = 3_217_226
"""The trainable parameters of ``mobilenet_cifar()`` (10 classes)."""


def separable_block(cin: int, cout: int, stride: int = 1, *, act=relu6, rng: RNG = None) -> Chain:
    """A depthwise-separable block ``cin => cout``: ``DepthwiseConv((3, 3), cin => cin, stride, pad=1)``,
    ``BatchNorm(cin, act)``, ``CrossCor((1, 1), cin => cout)``, ``BatchNorm(cout, act)``; bias-free convolutions.

    >>> import numpy as np
    >>> block = separable_block(8, 16, 2, rng=0)
    >>> block[0], block(np.ones((2, 8, 6, 6), np.float32)).shape
    (DepthwiseConv((3, 3), 8 => 8, pad=1, stride=2, bias=False), (2, 16, 3, 3))
    """
    rng = as_rng(rng, "separable_block")
    return Chain(DepthwiseConv((3, 3), cin, cin, stride=stride, pad=1, bias=False, init=kaiming_normal, rng=rng),
                 BatchNorm(cin, act),
                 CrossCor((1, 1), cin, cout, bias=False, init=kaiming_normal, rng=rng),
                 BatchNorm(cout, act))


def mobilenet_cifar(rng: RNG = None, classes: int = 10, act=relu6) -> Chain:
    """MobileNet v1 for CIFAR, ``(N, 3, 32, 32)`` inputs: a stem ``CrossCor((3, 3), 3 => 32, pad=1)`` +
    ``BatchNorm(32, act)``, the thirteen depthwise-separable blocks of :data:`MOBILENET_CIFAR_STAGES`
    (:func:`separable_block`), global mean pool, ``Dense(1024 => classes)``. 3,217,226 trainable parameters with
    10 classes (:data:`MOBILENET_CIFAR_PARAMETERS`). ``rng``: a ``numpy.random.Generator``, an int seed, or
    ``None`` for fluxpy's global generator (:func:`fluxpy.seed`); ``act``: the activation after every BatchNorm.

    >>> import numpy as np
    >>> from fluxpy.ops.activations import relu
    >>> model = mobilenet_cifar(rng=0, classes=100, act=relu)
    >>> len(model), model[1], model[-1]
    (18, BatchNorm(32, relu), Dense(1024 => 100))
    """
    who = "mobilenet_cifar"
    if isinstance(classes, bool) or not isinstance(classes, numbers.Integral) or classes < 1:
        raise ValueError(f"{who} expects classes to be an int >= 1, got {classes!r}")
    rng = as_rng(rng, who)
    layers = [CrossCor((3, 3), 3, 32, pad=1, bias=False, init=kaiming_normal, rng=rng), BatchNorm(32, act)]
    cin = 32
    for cout, stride in MOBILENET_CIFAR_STAGES:
        layers.append(separable_block(cin, cout, stride, act=act, rng=rng))
        cin = cout
    return Chain(*layers, GlobalMeanPool(), flatten, Dense(cin, int(classes), rng=rng))
