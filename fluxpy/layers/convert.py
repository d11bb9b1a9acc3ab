"""Precision conversion of a whole model (Flux's ``f32`` / ``f64``): a copy with every float array converted."""
from __future__ import annotations

import numpy as np

from ..backend import is_float_array
from ..functors import fmap


def f32(model):
    """A copy of ``model`` with every floating-point array converted to float32.

    >>> from fluxpy.layers import Dense
    >>> f32(Dense(2, 3)).weight.dtype
    dtype('float32')
    """
    return _convert_floats(model, np.float32)


def f64(model):
    """A copy of ``model`` with every floating-point array converted to float64 (for gradient checks).

    >>> from fluxpy.layers import Dense
    >>> f64(Dense(2, 3)).weight.dtype
    dtype('float64')
    """
    return _convert_floats(model, np.float64)


def _convert_floats(model, dtype):
    return fmap(lambda a: a.astype(dtype) if is_float_array(a) else a, model)
