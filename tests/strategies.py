"""Hypothesis strategies shared by the tests: shapes, broadcast patterns, axes, arrays."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st


def shapes(min_dims=0, max_dims=3, min_side=1, max_side=4):
    return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


@st.composite
def broadcast_pair(draw, max_dims=3):
    """Two shapes that broadcast together: size-1 axes, missing leading axes and scalars."""
    full = draw(shapes(0, max_dims))
    return draw(_operand_of(full)), draw(_operand_of(full))


@st.composite
def _operand_of(draw, full):
    drop = draw(st.integers(0, len(full)))
    kept = full[drop:]
    return tuple(1 if draw(st.booleans()) else s for s in kept)


@st.composite
def axes_for(draw, ndim):
    """None, one axis (possibly negative), or a tuple of distinct axes."""
    kind = draw(st.sampled_from(["none", "int", "tuple"]))
    if kind == "none" or ndim == 0:
        return None
    if kind == "int":
        return draw(st.integers(-ndim, ndim - 1))
    chosen = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    return tuple(chosen)


def array(rng, shape, low=None, high=None, away_from_zero=False):
    """A random float64 array; never zeros. ``away_from_zero`` keeps |x| >= 0.3 (for kinks)."""
    if low is not None:
        return np.array(rng.uniform(low, high, size=shape))
    x = np.array(rng.standard_normal(shape))
    if away_from_zero:
        x = np.where(x < 0, -0.3, 0.3) + x
    return x


def resolve_pad(pad, hw, kernel, stride):
    """The (top, bottom, left, right) that each pad form means (int, pair, 4-tuple, "same"), written out
    independently of fluxpy.ops.dims; ``kernel`` is the dilated kernel span per axis."""
    if pad == "same":
        out = []
        for size, k, s in zip(hw, kernel, stride):
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            out += [total // 2, total - total // 2]
        return tuple(out)
    if isinstance(pad, int):
        return (pad,) * 4
    if len(pad) == 2:
        return (pad[0], pad[0], pad[1], pad[1])
    return tuple(pad)
