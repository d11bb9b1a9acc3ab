"""The model zoo: ready-made networks built of fluxpy's public layers (Metalhead.jl beside Flux).

- :mod:`fluxpy.models.resnet`: residual networks (He et al. 2016), :func:`resnet20` for CIFAR and :func:`resnet18`.
- :mod:`fluxpy.models.mobilenet`: :func:`mobilenet_cifar`, depthwise-separable convolutions (MobileNet v1).
- :mod:`fluxpy.models.vgg`: :func:`vgg_cifar`, a VGG-style CIFAR speed-run net (max pooling, BatchNorm, GELU).
- :mod:`fluxpy.models.vit`: :func:`vit_cifar`, a small vision transformer.
- :mod:`fluxpy.models.recurrent`: :func:`lstm_classifier`, an LSTM sequence classifier.

>>> import numpy as np
>>> import fluxpy
>>> model = fluxpy.models.resnet20(rng=0)
>>> fluxpy.models.parameter_count(model) == fluxpy.models.RESNET20_PARAMETERS
True
"""
from __future__ import annotations

from . import mobilenet, recurrent, resnet, vgg, vit
from .mobilenet import MOBILENET_CIFAR_PARAMETERS, MOBILENET_CIFAR_STAGES, mobilenet_cifar, separable_block
from .recurrent import last_step, lstm_classifier
from .resnet import RESNET18_PARAMETERS, RESNET20_PARAMETERS, RESNETS, basic_block, parameter_count, resnet18, resnet20
from .vgg import VGG_CIFAR_PARAMETERS, VGG_CIFAR_WIDTHS, conv_group, vgg_cifar
from .vit import EncoderBlock, PatchEmbedding, token_mean, vit_cifar

__all__ = ["resnet", "resnet20", "resnet18", "basic_block", "parameter_count", "RESNETS", "RESNET20_PARAMETERS",
           "RESNET18_PARAMETERS",
           "mobilenet", "mobilenet_cifar", "separable_block", "MOBILENET_CIFAR_STAGES", "MOBILENET_CIFAR_PARAMETERS",
           "vgg", "vgg_cifar", "conv_group", "VGG_CIFAR_WIDTHS", "VGG_CIFAR_PARAMETERS",
           "vit", "vit_cifar", "PatchEmbedding", "EncoderBlock", "token_mean",
           "recurrent", "lstm_classifier", "last_step"]
