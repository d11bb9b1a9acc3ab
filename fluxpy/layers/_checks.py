"""Argument and input checks shared by the layers, and the errors they raise: :class:`DimensionMismatch` and
:class:`DTypeMismatch`.

A layer checks its input before any op runs, so a wrong shape is reported against the layer
(``Conv((3, 3), 2 => 3) expects x.shape[1] == 2, got (5, 4, 9, 9) float32``) rather than deep
inside a kernel; so is an input whose dtype differs from the layer's parameters, with the
conversion that fixes it. Constructors check their sizes and options, naming the layer.
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ..autodiff import value_of
from ..backend import DeviceArray, is_array, is_float_array, is_float_dtype
from ..kernels.halfs import is_half
from ..ops.activations import identity

# What a layer takes and returns: a NumPy or CuPy array, or a Tracked one inside gradient.
Array = Any


class DimensionMismatch(ValueError):
    """A layer was given an input of the wrong shape (Flux's ``DimensionMismatch``); the message names the layer.

    >>> import numpy as np
    >>> from fluxpy.layers import Dense
    >>> try:
    ...     Dense(3, 2)(np.ones((4, 5), np.float32))
    ... except DimensionMismatch as err:
    ...     print(err)
    Dense(3 => 2) expects x.shape[-1] == 3, got (4, 5) float32
    """


class DTypeMismatch(TypeError):
    """A layer was given an input whose dtype differs from its parameters'; the message names the layer and says
    how to convert (the input with ``x.astype``, or the model with :func:`fluxpy.f32` / :func:`fluxpy.f64`).

    A float32 layer never silently computes in float64 (slowly, returning float64) or on integers.

    >>> import numpy as np
    >>> from fluxpy.layers import Dense
    >>> try:
    ...     Dense(3, 2)(np.ones((4, 3)))
    ... except DTypeMismatch as err:
    ...     print(err)
    Dense(3 => 2) expects x of dtype float32 (its parameters' dtype), got (4, 3) float64: convert the input \
with x.astype(np.float32), or the model with fluxpy.f64(model)
    """


# Tracebacks (and the doctests that show them) print the name users import.
DimensionMismatch.__module__ = "fluxpy.layers"
DTypeMismatch.__module__ = "fluxpy.layers"


def _type_name(x):
    kind = type(x)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def _describe_input(x):
    """``x`` as a message shows it (``(4, 3) float32``, ``a list``, ``a torch.Tensor (4, 3) torch.float32``); it
    never raises, whatever ``x`` is: a message must not fail while it is being built."""
    try:
        if not hasattr(x, "shape"):
            return f"a {_type_name(x)}"
        text = f"{tuple(x.shape)} {getattr(x, 'dtype', 'of no dtype')}"
        return f"a {_type_name(x)} {text}" if _is_foreign(x) else text
    except Exception:   # a foreign object's shape or dtype that does not print
        return f"a {_type_name(x)}"


def _is_foreign(x):
    """Whether ``x`` is another library's array (a torch tensor, a JAX array...): it has a shape, but is neither a
    NumPy or CuPy array (or scalar) nor a Tracked one."""
    if type(x) is np.ndarray or type(x) is DeviceArray:   # the common cases, without the general checks below
        return False
    x = value_of(x)
    return hasattr(x, "shape") and not (is_array(x) or isinstance(x, np.generic))


def _require_native(who, x, name="x"):
    """Raise a ``TypeError`` naming ``who`` (a name, or a layer: its ``repr``, made only for the error) for another
    library's array (:func:`_is_foreign`), saying how to convert it, before anything reads its dtype.

    >>> class Tensor:   # another library's array
    ...     shape, dtype = (2, 3), "other.float32"
    >>> try:
    ...     _require_native("Dense(3 => 2)", Tensor())
    ... except TypeError as err:
    ...     print(err)   # doctest: +ELLIPSIS
    Dense(3 => 2) expects x as a NumPy or CuPy array, got a fluxpy.layers._checks.Tensor (2, 3) other.float32: ...
    """
    if _is_foreign(x):
        who = who if isinstance(who, str) else repr(who)
        raise TypeError(f"{who} expects {name} as a NumPy or CuPy array, got {_describe_input(x)}: convert it with "
                        f"numpy.asarray({name}) (then fluxpy.gpu(...) for the GPU), or share GPU memory through "
                        f"DLPack with cupy.from_dlpack({name})")


def _fail(layer, expectation, x, name="x"):
    _require_native(layer, x, name)
    raise DimensionMismatch(f"{layer!r} expects {expectation}, got {_describe_input(x)}")


def _require_dtype(layer, x, dtype, name="x"):
    """Raise :class:`DTypeMismatch` unless ``x`` has the parameters' ``dtype`` (``x`` already shape-checked);
    ``name``: what the message calls ``x``."""
    _require_native(layer, x, name)
    if x.dtype != dtype:
        _fail_dtype(layer, f"{name} of dtype {np.dtype(dtype).name} (its parameters' dtype)", x, np.dtype(dtype),
                    name)


def _require_norm_dtype(layer, x, dtype):
    """As :func:`_require_dtype`, but a normalisation layer with float32 parameters also takes float16 and bfloat16
    ``x`` (statistics in float32, the output in ``x``'s dtype: mixed precision, cuDNN's rule)."""
    _require_native(layer, x)
    if not (dtype == np.float32 and is_half(x.dtype)):
        _require_dtype(layer, x, dtype)


def _require_float(layer, x):
    """Raise :class:`DTypeMismatch` unless ``x`` is floating-point (for layers without parameters)."""
    _require_native(layer, x)
    if not is_float_dtype(x.dtype):
        _fail_dtype(layer, "a floating-point x", x, np.dtype(np.float32))


def _fail_dtype(layer, expectation, x, want, name="x"):
    _require_native(layer, x, name)
    got = np.dtype(x.dtype)
    hint = f"convert the input with x.astype(np.{want.name})" if name == "x" else \
        f"convert {name} with {name.split()[-1]}.astype(np.{want.name})"
    model = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
    if got.kind == "f" and got in model and got != want:
        hint += f", or the model with fluxpy.{model[got]}(model)"
    raise DTypeMismatch(f"{layer!r} expects {expectation}, got {_describe_input(x)}: {hint}")


def _check_attention(layer, inputs):
    """An attention layer's ``(name, x, projection)`` triples: each ``x`` ``(N, L, projection.in_features)`` of the
    projection's dtype, one ``N``, ``k`` and ``v`` of one ``L``, a key for every query; errors name ``layer``."""
    shapes = {}
    for name, x, proj in inputs:
        _require_native(layer, x, name)
        shapes[name] = shape = tuple(getattr(x, "shape", ()))
        if len(shape) != 3 or shape[2] != proj.in_features:
            _fail(layer, f"{name} of shape (N, L, {proj.in_features})", x, name)
        _require_dtype(layer, x, proj.weight.dtype, name)
    q, k, v = shapes["q"], shapes["k"], shapes["v"]
    if not q[0] == k[0] == v[0] or k[1] != v[1]:
        raise DimensionMismatch(f"{layer!r} expects q (N, Lq, _), k (N, Lk, _) and v (N, Lk, _) of one N and one Lk, "
                                f"got q {q}, k {k}, v {v}")
    if k[1] == 0 and q[1] > 0:
        raise DimensionMismatch(f"{layer!r} expects at least one key (Lk >= 1) for its {q[1]} queries: a query over "
                                f"no key has no softmax; got q {q}, k {k}")


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _positive_int(who, name, value):
    """``value`` as an int, which must be >= 1."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{who}: {name} must be a positive int, got {value!r}")
    return int(value)


def _callable(who, name, f):
    """``f``, which must be callable."""
    if not callable(f):
        raise TypeError(f"{who}: {name} must be callable, got {f!r}")
    return f


def _activation(who, act):
    """The activation ``act``, callable (``None`` means none: :func:`identity`)."""
    if act is None:
        return identity
    if not callable(act):
        raise TypeError(f"{who}: act must be callable (a function such as relu, or None), got {act!r}")
    return act


def _number(who, name, value, low, high=None, low_open=False):
    """``value``, a real number in [low, high] ((low, high] with ``low_open``)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and \
        (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise ValueError(f"{who}: {name} must be a number {bound}, got {value!r}")
    return value


def _require_ndim(layer, x, ndim, layout):
    if not hasattr(x, "shape") or len(x.shape) != ndim:
        _fail(layer, f"a {ndim}-d input {layout}", x)


def _renamed(layer, err, op):
    """An error from a dims check (``"<op> expects ..."``) restated for the layer."""
    msg = str(err)
    if msg.startswith(op):
        msg = repr(layer) + msg[len(op):]
    return DimensionMismatch(msg)


def _pair(name, value, minimum=1):
    pair = (value, value) if _is_int(value) else tuple(value) if isinstance(value, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(_is_int(v) and v >= minimum for v in pair):
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} int or a pair of them, got {value!r}")
    return tuple(int(v) for v in pair)


def _given_bias(bias, shape, name):
    """``bias=False`` -> None; an array -> itself (shape-checked)."""
    if bias is False or bias is None:
        return None
    if not hasattr(bias, "shape") or tuple(bias.shape) != shape:
        raise ValueError(f"{name}: bias must be True, False or an array of shape {shape}, got {bias!r}")
    return bias


def _initialised(name, init, shape, rng):
    """The weight ``init(*shape, rng=rng)`` makes, checked to be a float array of ``shape`` (Flux checks what a
    layer's ``init`` returns): a wrong one is an error naming the layer here, not a shape error at the first call.

    >>> import numpy as np
    >>> _initialised("Dense", lambda *s, rng=None: np.zeros(s, np.float32), (2, 3), None).shape
    (2, 3)
    """
    w = _callable(name, "init", init)(*shape, rng=rng)
    if getattr(w, "shape", None) != tuple(shape) or not is_float_array(w):
        got = (f"{type(w).__name__} of shape {tuple(w.shape)} and dtype {w.dtype}"
               if hasattr(w, "shape") and hasattr(w, "dtype") else repr(w))
        raise ValueError(f"{name}: init must return a float array of shape {tuple(shape)}, got {got}")
    return w
