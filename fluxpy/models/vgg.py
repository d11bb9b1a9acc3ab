"""A VGG-style CIFAR net of the speed-run kind (Page's and Jordan's CIFAR-10 speed runs): :func:`vgg_cifar`.

A stem ``CrossCor((3, 3), 3 => 32)`` + ``BatchNorm(32, gelu)``, then three conv groups (:func:`conv_group`), each
``conv3x3 -> MaxPool(2) -> BatchNorm(gelu) -> conv3x3 -> BatchNorm(gelu)`` (the pooling straight after the first
convolution, so the rest of the group runs at a quarter of the pixels), widths 64, 256, 256 at 16, 8 and 4 pixels,
then ``MaxPool((4, 4))`` to one pixel, ``flatten`` and a bias-free ``Dense``, initialised at an eighth of Glorot's
scale (the speed runs scale the logits down: large logits at the start slow the first steps). Every convolution is
bias-free (the BatchNorm after it has the shift) and He-normal initialised (fan_in). ``gelu`` is fluxpy's (the tanh
form). Speed runs train it with SGD and Nesterov momentum (:class:`fluxpy.Nesterov`), label smoothing
(``logitcrossentropy(..., label_smoothing=0.2)``) and float16 (:func:`fluxpy.mixed_precision`) at large batches.
Inputs ``(N, 3, 32, 32)``.

>>> import numpy as np
>>> from fluxpy.models import parameter_count
>>> model = vgg_cifar(rng=0)
>>> parameter_count(model) == VGG_CIFAR_PARAMETERS
True
>>> model(np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)).shape
(2, 10)
"""
from __future__ import annotations

import numbers

from ..layers import BatchNorm, Chain, CrossCor, Dense, MaxPool, flatten, glorot_uniform, kaiming_normal
from ..ops.activations import gelu
from ..random import RNG, as_rng

__all__ = ["vgg_cifar", "conv_group", "VGG_CIFAR_WIDTHS", "VGG_CIFAR_PARAMETERS"]

VGG_CIFAR_WIDTHS = (64, 256, 256)
"""The channels of :func:`vgg_cifar`'s three conv groups."""

VGG_CIFAR_PARAMETERS = 1_978_016
"""The trainable parameters of ``vgg_cifar()`` (10 classes)."""


def _head_init(*dims, rng=None):
    return glorot_uniform(*dims, rng=rng, gain=0.125)


def _conv3x3(cin, cout, rng):
    return CrossCor((3, 3), cin, cout, pad=1, bias=False, init=kaiming_normal, rng=rng)


def conv_group(cin: int, cout: int, *, act=gelu, rng: RNG = None) -> Chain:
    """``CrossCor((3, 3), cin => cout, pad=1)``, ``MaxPool((2, 2))``, ``BatchNorm(cout, act)``,
    ``CrossCor((3, 3), cout => cout, pad=1)``, ``BatchNorm(cout, act)``: halves the image, bias-free convolutions.

    >>> import numpy as np
    >>> group = conv_group(4, 8, rng=0)
    >>> group[1], group[2], group(np.ones((2, 4, 8, 8), np.float32)).shape
    (MaxPool((2, 2)), BatchNorm(8, gelu), (2, 8, 4, 4))
    """
    rng = as_rng(rng, "conv_group")
    return Chain(_conv3x3(cin, cout, rng), MaxPool((2, 2)), BatchNorm(cout, act), _conv3x3(cout, cout, rng),
                 BatchNorm(cout, act))


def vgg_cifar(rng: RNG = None, classes: int = 10, act=gelu) -> Chain:
    """The speed-run VGG for CIFAR (see the module docstring), ``(N, 3, 32, 32)`` inputs: 1,978,016 trainable
    parameters with 10 classes (:data:`VGG_CIFAR_PARAMETERS`). ``rng``: a ``numpy.random.Generator``, an int seed,
    or ``None`` for fluxpy's global generator (:func:`fluxpy.seed`); ``act``: the activation after every BatchNorm.

    >>> model = vgg_cifar(rng=0, classes=100)
    >>> len(model), model[1], model[-3], model[-1]
    (8, BatchNorm(32, gelu), MaxPool((4, 4)), Dense(256 => 100, bias=False))
    """
    who = "vgg_cifar"
    if isinstance(classes, bool) or not isinstance(classes, numbers.Integral) or classes < 1:
        raise ValueError(f"{who} expects classes to be an int >= 1, got {classes!r}")
    rng = as_rng(rng, who)
    layers = [_conv3x3(3, 32, rng), BatchNorm(32, act)]
    cin = 32
    for width in VGG_CIFAR_WIDTHS:
        layers.append(conv_group(cin, width, act=act, rng=rng))
        cin = width
    return Chain(*layers, MaxPool((4, 4)), flatten, Dense(cin, int(classes), bias=False, init=_head_init, rng=rng))
