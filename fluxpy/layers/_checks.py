"""Argument and input checks shared by the layers, and :class:`DimensionMismatch`, the error they raise.

A layer checks its input before any op runs, so a wrong shape is reported against the layer
(``Conv((3, 3), 2 => 3) expects x.shape[1] == 2, got (5, 4, 9, 9) float32``) rather than deep
inside a kernel.
"""
from __future__ import annotations

from typing import Any

import numpy as np

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


# Tracebacks (and the doctests that show them) print the name users import.
DimensionMismatch.__module__ = "fluxpy.layers"


def _describe_input(x):
    if not hasattr(x, "shape"):
        return f"a {type(x).__name__}"
    return f"{tuple(x.shape)} {x.dtype}"


def _fail(layer, expectation, x):
    raise DimensionMismatch(f"{layer!r} expects {expectation}, got {_describe_input(x)}")


def _require_ndim(layer, x, ndim, layout):
    if not hasattr(x, "shape") or len(x.shape) != ndim:
        _fail(layer, f"a {ndim}-d input {layout}", x)


def _require_channels(layer, x, channels):
    _require_ndim(layer, x, 4, "(N, C, H, W)")
    if x.shape[1] != channels:
        _fail(layer, f"x.shape[1] == {channels}", x)


def _renamed(layer, err, op):
    """An error from a dims check (``"<op> expects ..."``) restated for the layer."""
    msg = str(err)
    if msg.startswith(op):
        msg = repr(layer) + msg[len(op):]
    return DimensionMismatch(msg)


def _pair(name, value):
    pair = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, (int, np.integer)) and v >= 1 for v in pair):
        raise ValueError(f"{name} must be a positive int or a pair of them, got {value!r}")
    return tuple(int(v) for v in pair)


def _given_bias(bias, shape, name):
    """``bias=False`` -> None; an array -> itself (shape-checked)."""
    if bias is False or bias is None:
        return None
    if tuple(getattr(bias, "shape", ())) != shape:
        raise ValueError(f"{name}: bias must be True, False or an array of shape {shape}, got {bias!r}")
    return bias
