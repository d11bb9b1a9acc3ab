"""Special functions: :func:`erf`, the error function (what NNlib's ``gelu_erf`` needs from SpecialFunctions.jl).

``erf`` is one primitive whose derivative is ``2/sqrt(pi) * exp(-x^2)``, written with fluxpy ops so it
differentiates again; dual numbers (:func:`fluxpy.broadcast`, ``bias_act``) carry the same derivative. Its forward
runs a kernel registered under ``"erf"`` where one takes the call (the CPU's is SciPy's ``erf`` when SciPy is
installed), otherwise a composite of elementwise array functions that runs on any array module: the Maclaurin series
for ``|x| <= 2`` (30 terms) and Laplace's continued fraction for ``erfc`` beyond (depth 60, evaluated backwards),
within 1e-15 relative of the exact value in float64 over the whole line (SciPy's: 4e-16). float16 and bfloat16 are
computed in float32 and rounded once. The composite is about 90 elementwise passes: on the GPU (no erf kernel is
registered there yet) it is correct but slow.

>>> import math
>>> import numpy as np
>>> erf(np.array([-1.0, 0.0, 0.5, 3.0])).round(8)
array([-0.84270079,  0.        ,  0.52049988,  0.99997791])
"""
from __future__ import annotations

import math

import numpy as np

from ..autodiff import Primitive
from ..backend import Array, get_array_module
from ..dual import Dual
from ..kernels import find
from ..kernels.elementwise import Sym
from ..kernels.halfs import is_half
from .basic import exp

__all__ = ["erf"]

_TWO_OVER_SQRT_PI = 2 / math.sqrt(math.pi)
_SQRT_PI = math.sqrt(math.pi)
_SERIES_LIMIT = 2.0
# erf(x) = 2/sqrt(pi) * x * sum_n (-1)^n x^(2n) / (n! (2n + 1)): 30 terms reach 1e-16 relative for |x| <= 2
_SERIES = tuple((-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(30))
_FRACTION_DEPTH = 60   # erfc(x) = exp(-x^2)/sqrt(pi) / (x + 1/2 / (x + 1 / (x + 3/2 / (x + ...)))): 1e-16 for x > 2


def erf_composite(x: Array) -> Array:
    """``erf`` of a plain float array with elementwise functions of its own array module (no kernel): see the
    module docstring. NaN gives NaN, ``±inf`` gives ``±1``.

    >>> abs(float(erf_composite(np.array(1.0))) - math.erf(1.0)) < 2e-16
    True
    """
    xp = get_array_module(x)
    if is_half(x.dtype):
        return erf_composite(x.astype(np.float32)).astype(x.dtype)
    small = xp.abs(x) <= _SERIES_LIMIT           # false for NaN, which takes the fraction's branch and stays NaN
    xs = xp.where(small, x, 0)
    z = xs * xs
    series = xp.zeros_like(xs) + _SERIES[-1]
    for c in _SERIES[-2::-1]:
        series = series * z + c
    series = series * xs * _TWO_OVER_SQRT_PI
    a = xp.where(small, _SERIES_LIMIT + 1, xp.abs(x))
    f = a
    for k in range(_FRACTION_DEPTH, 0, -1):
        f = a + (k / 2) / f
    erfc = xp.exp(-(a * a)) / (f * _SQRT_PI)
    return xp.where(small, series, xp.sign(x) * (1 - erfc)).astype(x.dtype, copy=False)


def _erf_impl(x):
    kernel = find("erf", x)
    return kernel(x) if kernel is not None else erf_composite(x)


def _erf_rule(x):
    def erf_pullback(dy):
        return (dy * (_TWO_OVER_SQRT_PI * exp(-(x * x))),)
    return _erf(x), erf_pullback


_erf = Primitive("erf", _erf_rule, impl=_erf_impl)


def erf(x: Array) -> Array:
    """The error function ``erf(x) = 2/sqrt(pi) * integral_0^x exp(-t^2) dt``, elementwise.

    Differentiable (``erf'(x) = 2/sqrt(pi) * exp(-x^2)``, to any order), on NumPy and CuPy arrays, Tracked values
    and dual numbers; float arrays keep their dtype. Within 1e-15 relative in float64 (see the module docstring).

    >>> import numpy as np
    >>> from fluxpy import gradient
    >>> erf(np.array([0.0, np.inf, -np.inf]))
    array([ 0.,  1., -1.])
    >>> gradient(lambda x: erf(x).sum(), np.array([0.0]))[0]       # 2 / sqrt(pi)
    array([1.12837917])
    """
    if type(x) is Sym:                      # inside a fused GPU kernel's trace (gelu_erf in broadcast, bias_act)
        return x.erf()
    if type(x) is Dual:
        slope = _TWO_OVER_SQRT_PI * np.exp(-(x.v * x.v))
        return Dual(erf(x.v), tuple(d * slope for d in x.d))
    if isinstance(x, (int, float, np.number)) and not isinstance(x, bool):
        x = np.asarray(x, dtype=np.result_type(x, np.float32) if isinstance(x, np.number) else np.float64)
    elif hasattr(x, "dtype") and np.dtype(x.dtype).kind in "iub":   # integers: in float64, with no gradient
        x = x.astype(np.float64)
    return _erf(x)
