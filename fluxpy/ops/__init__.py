"""Differentiable ops (the NNlib layer), and how Tracked values reach them.

Importing this package gives :class:`fluxpy.autodiff.Tracked` its operators
(:func:`fluxpy.autodiff.define_tracked_ops`) and makes NumPy's ufuncs and functions (``np.exp``,
``np.sum``, ``np.where``, ...) dispatch to these ops.

>>> import numpy as np
>>> from fluxpy import gradient
>>> gradient(lambda x: np.sum(np.maximum(x, 0.0) ** 2), np.array([-1.0, 2.0]))
(array([0., 4.]),)
"""
from __future__ import annotations

import numpy as np

from ..autodiff import define_tracked_ops, value_of
from ..backend import Array
from .basic import (abs, add, cos, divide, exp, expm1, log, log1p, maximum, minimum, multiply, negative, power,
                    sign, sin, sqrt, square, subtract, tanh, where)
from .linalg import cosine_similarity, dot, matmul, pairwise_distance, svdvals
from .linalg import norm as _linalg_norm   # fluxpy.ops.linalg.norm: fluxpy.ops.norm is the normalisation module
from .einsum import einsum
from .patches import fold, unfold
from .padding import pad_circular, pad_constant, pad_reflect, pad_repeat, pad_symmetric, pad_zeros
from .reduce import max, mean, min, sum
from .shape import (astype, broadcast_to, channel_shuffle, concatenate, expand_dims, getitem, ravel, reshape,
                    scatter_add, squeeze, stack, swapaxes, transpose)
from .scatter import check_indices, gather, scatter
from .numeric import (arccos, arcsin, arcsinh, arctan, arctanh, cosh, cumsum, flip, pad, prod, sinh, sort, std, tan,
                      tril, triu, var)
from .activations import (celu, elu, gelu, gelu_erf, gelu_sigmoid, gelu_tanh, hardsigmoid, hardswish, hardtanh,
                          identity, leakyrelu, lisht, logcosh, logsigmoid, mish, relu, relu6, rrelu, selu, sigmoid,
                          softplus, softshrink, softsign, swish, tanhshrink, trelu, hardshrink, softmin, glu, threshold)
from .bias_act import bias_act
from .dense import dense
from .conv import conv, conv_backward_data, conv_backward_filter, conv_bias_act, conv_transpose
from .batchnorm import batchnorm
from .dims import AdaptivePoolDims, ConvDims, PoolDims
from .dropout import dropout, dropout_mask
from .norm import batchnorm_infer, batchnorm_train, groupnorm, instancenorm, layernorm, normalise, rmsnorm
from .pool import (adaptive_maxpool, adaptive_meanpool, global_maxpool, global_meanpool, lpnormpool, maxpool,
                   maxpool_backward, meanpool, meanpool_backward)
from .recurrent import gru_gates, lstm_gates
from .resample import bilinear_weights, pixel_shuffle, upsample_bilinear, upsample_nearest
from .softmax import logsoftmax, logsumexp, softmax
from .special import erf

# sum, max, min and abs are fluxpy.ops.sum and so on, but not in __all__: `import *` must not shadow the builtins
__all__ = ["add", "subtract", "multiply", "divide", "power", "negative", "exp", "log", "sqrt", "tanh", "sin", "cos",
           "log1p", "expm1", "square", "sign", "maximum", "minimum", "where", "mean", "reshape", "transpose",
           "swapaxes", "broadcast_to", "getitem", "scatter_add", "scatter", "gather", "check_indices", "concatenate",
           "stack", "astype", "squeeze", "expand_dims", "ravel", "matmul", "dot", "clip", "identity", "relu",
           "leakyrelu", "relu6", "elu", "gelu", "swish", "sigmoid", "softplus", "hardtanh", "gelu_tanh", "gelu_sigmoid",
           "hardsigmoid", "hardswish",
           "lisht", "softsign", "selu", "celu", "trelu", "logcosh", "mish", "tanhshrink", "softshrink", "logsigmoid",
           "gelu_erf", "rrelu", "erf", "logsumexp", "hardshrink", "softmin", "glu", "tan", "arcsin", "arccos",
           "arctan", "sinh", "cosh", "arcsinh", "arctanh", "var", "std", "prod", "cumsum", "flip", "triu", "tril",
           "pad", "sort", "einsum", "svdvals", "pad_constant", "pad_zeros", "pad_reflect",
           "pad_repeat", "pad_symmetric", "pad_circular",
           "bias_act", "dense", "conv", "conv_transpose", "conv_bias_act",
           "conv_backward_data", "conv_backward_filter", "ConvDims", "PoolDims", "AdaptivePoolDims", "dropout",
           "dropout_mask", "normalise", "batchnorm", "batchnorm_train", "batchnorm_infer", "layernorm", "groupnorm",
           "instancenorm", "rmsnorm", "maxpool", "meanpool", "global_maxpool", "global_meanpool", "adaptive_maxpool",
           "adaptive_meanpool", "maxpool_backward", "meanpool_backward", "upsample_nearest", "upsample_bilinear",
           "bilinear_weights", "pixel_shuffle", "softmax", "logsoftmax", "lstm_gates", "gru_gates", "threshold",
           "channel_shuffle", "cosine_similarity", "pairwise_distance", "unfold", "fold", "lpnormpool"]


def clip(x: Array, lo: float | Array | None = None, hi: float | Array | None = None) -> Array:
    """``x`` limited to ``[lo, hi]`` elementwise (either bound may be None).

    >>> import numpy as np
    >>> clip(np.array([-2.0, 0.5, 3.0]), -1.0, 1.0)
    array([-1. ,  0.5,  1. ])
    """
    if lo is not None:
        x = maximum(x, lo)
    if hi is not None:
        x = minimum(x, hi)
    return x


def _not_differentiable(fn):
    """A NumPy function applied to the plain values: comparisons and tests give no gradient."""
    return lambda *args, **kw: fn(*[value_of(a) for a in args], **kw)


_UFUNCS = {
    np.add: add, np.subtract: subtract, np.multiply: multiply, np.true_divide: divide, np.power: power,
    np.negative: negative, np.positive: lambda x: x, np.exp: exp, np.log: log, np.sqrt: sqrt, np.tanh: tanh,
    np.absolute: abs, np.sin: sin, np.cos: cos, np.log1p: log1p, np.expm1: expm1, np.square: square,
    np.maximum: maximum, np.minimum: minimum, np.matmul: matmul,
}
for _u in (np.greater, np.greater_equal, np.less, np.less_equal, np.equal, np.not_equal, np.sign, np.isnan,
           np.isinf, np.isfinite, np.floor, np.ceil, np.rint, np.signbit, np.logical_and, np.logical_or,
           np.logical_not):
    _UFUNCS[_u] = _not_differentiable(_u)

_UFUNC_REDUCE = {np.add: sum, np.maximum: max, np.minimum: min}


def _array_ufunc(ufunc, method, *inputs, **kwargs):
    if kwargs.get("out") is not None:
        raise TypeError(f"np.{ufunc.__name__}(..., out=...) cannot write into a fluxpy Tracked value")
    if method == "reduce" and ufunc in _UFUNC_REDUCE:
        return _UFUNC_REDUCE[ufunc](inputs[0], axis=kwargs.get("axis", 0), keepdims=kwargs.get("keepdims", False))
    op = _UFUNCS.get(ufunc)
    name = f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
    if method != "__call__" or op is None:
        raise TypeError(f"{name} is not differentiable in fluxpy; supported ufuncs: " +
                        ", ".join(sorted(u.__name__ for u in _UFUNCS)))
    if any(k != "out" for k in kwargs):
        raise TypeError(f"{name} on a Tracked value takes no options, got {sorted(kwargs)}")
    return op(*inputs)


def _np_reduction(op):
    def call(a, axis=None, dtype=None, out=None, keepdims=False, **kw):
        if out is not None or dtype is not None or kw:
            raise TypeError(f"np.{op.__name__} on a Tracked value takes only axis and keepdims")
        return op(a, axis=axis, keepdims=keepdims)
    return call


_FUNCTIONS = {
    np.sum: _np_reduction(sum), np.mean: _np_reduction(mean), np.max: _np_reduction(max),
    np.min: _np_reduction(min), np.amax: _np_reduction(max), np.amin: _np_reduction(min),
    np.reshape: lambda a, shape=None, **kw: reshape(a, kw.get("newshape", shape)),
    np.transpose: lambda a, axes=None: transpose(a, axes),
    np.swapaxes: swapaxes,
    np.concatenate: lambda arrays, axis=0: concatenate(arrays, axis),
    np.stack: lambda arrays, axis=0: stack(arrays, axis),
    np.where: lambda cond, a, b: where(cond, a, b),
    np.dot: dot,
    np.einsum: lambda subscripts, *operands: einsum(subscripts, *operands),
    np.linalg.norm: lambda x, ord=None, axis=None, keepdims=False: _linalg_norm(x, ord, axis, keepdims),
    np.squeeze: lambda a, axis=None: squeeze(a, axis),
    np.expand_dims: expand_dims,
    np.broadcast_to: broadcast_to,
    np.ravel: lambda a: ravel(a),
    np.clip: lambda a, a_min=None, a_max=None: clip(a, a_min, a_max),
    np.shape: lambda a: a.shape,
    np.ndim: lambda a: a.ndim,
    np.size: lambda a: a.size,
    np.zeros_like: _not_differentiable(np.zeros_like),
    np.ones_like: _not_differentiable(np.ones_like),
    np.result_type: _not_differentiable(np.result_type),
    np.allclose: _not_differentiable(np.allclose),
    np.isclose: _not_differentiable(np.isclose),
    np.argmax: _not_differentiable(np.argmax),
    np.argmin: _not_differentiable(np.argmin),
}


def _array_function(func, args, kwargs):
    impl = _FUNCTIONS.get(func)
    if impl is None:
        raise TypeError(f"np.{func.__name__} is not differentiable in fluxpy; supported functions: " +
                        ", ".join(sorted(f.__name__ for f in _FUNCTIONS)))
    return impl(*args, **kwargs)


def _reshape_method(x, *shape):
    return reshape(x, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)


def _transpose_method(x, *axes):
    if not axes:
        return transpose(x)
    return transpose(x, axes[0] if len(axes) == 1 and not isinstance(axes[0], int) else axes)


define_tracked_ops(
    add=add, subtract=subtract, multiply=multiply, divide=divide, power=power, matmul=matmul, negative=negative,
    abs=abs, getitem=getitem, transpose=transpose, reshape_method=_reshape_method,
    transpose_method=_transpose_method, sum=sum, mean=mean, max=max, min=min, astype=astype, squeeze=squeeze,
    ravel=ravel, clip=clip,
    array_ufunc=lambda x, ufunc, method, *inputs, **kw: _array_ufunc(ufunc, method, *inputs, **kw),
    array_function=lambda x, func, types, args, kwargs: _array_function(func, args, kwargs))
