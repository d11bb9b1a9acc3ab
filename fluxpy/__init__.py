"""fluxpy: a small deep-learning framework in the spirit of Flux.jl.

Models are plain Python objects, gradients are taken of ordinary functions, and the same code
runs on NumPy (CPU) and CuPy (GPU).

>>> import numpy as np
>>> import fluxpy
>>> fluxpy.gradient(lambda w: (w * w).sum(), np.array([1.0, -2.0]))
(array([ 2., -4.]),)
"""
from . import ops
from .autodiff import (Primitive, Tracked, gradient, is_tracked, no_grad, primitive, pullback, stop_gradient,
                       value_of, withgradient)
from .backend import GPUUnavailableError, cpu, get_array_module, gpu, gpu_available
from .broadcast import broadcast, unbroadcast
from .functors import children, fmap, fmapstructure, layer, loadstate, state, trainables
from .ops import (abs, clip, concatenate, cos, dot, exp, log, log1p, matmul, max, maximum, mean, min, minimum,
                  reshape, sin, sqrt, stack, sum, tanh, transpose, where)

__version__ = "0.1.0"

__all__ = ["gradient", "withgradient", "pullback", "primitive", "Primitive", "Tracked", "no_grad", "stop_gradient",
           "value_of", "is_tracked", "broadcast", "unbroadcast", "get_array_module", "gpu", "cpu", "gpu_available",
           "GPUUnavailableError", "layer", "children", "fmap", "fmapstructure", "trainables", "state", "loadstate",
           "ops", "abs", "clip", "concatenate", "cos", "dot", "exp", "log", "log1p", "matmul", "max", "maximum",
           "mean", "min", "minimum", "reshape", "sin", "sqrt", "stack", "sum", "tanh", "transpose", "where"]
