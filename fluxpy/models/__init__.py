"""The model zoo: ready-made networks built of fluxpy's public layers (Metalhead.jl beside Flux).

- :mod:`fluxpy.models.resnet`: residual networks (He et al. 2016), :func:`resnet20` for CIFAR and :func:`resnet18`.

>>> import numpy as np
>>> import fluxpy
>>> model = fluxpy.models.resnet20(rng=0)
>>> fluxpy.models.parameter_count(model) == fluxpy.models.RESNET20_PARAMETERS
True
"""
from __future__ import annotations

from . import resnet
from .resnet import RESNET18_PARAMETERS, RESNET20_PARAMETERS, RESNETS, basic_block, parameter_count, resnet18, resnet20

__all__ = ["resnet", "resnet20", "resnet18", "basic_block", "parameter_count", "RESNETS", "RESNET20_PARAMETERS",
           "RESNET18_PARAMETERS"]
