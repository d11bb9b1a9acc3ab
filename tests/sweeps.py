"""The GPU suite's budget: the default run covers every kernel and every variant in minutes; the full run sweeps.

A run is ``full`` when pytest gets ``--full`` or ``--hypothesis-profile=full``, or the environment has
``FLUXPY_TEST_PROFILE=full`` (tests/conftest.py reads them once, before the tests are collected). Otherwise:

- a long parameter sweep runs the cases :func:`cover` keeps: every value of every parameter, and every pair of
  values of any two parameters, appears in some kept case (so each kernel variant runs, and each two-way
  interaction: a dtype with each implementation, a shape with each dtype); :func:`sweep` marks the other cases
  ``full``, and tests marked ``full`` are skipped;
- a loop over a grid inside a test runs :func:`grid` of it (the covering subset);
- a property test draws :func:`examples` cases under the ``gpu`` hypothesis profile (the full count in a full run).

>>> cases = list(itertools.product("ab", "xyz", (1, 2)))
>>> kept = cover(cases)
>>> len(kept) < len(cases)
True
>>> pairs = lambda cs: {(i, c[i], j, c[j]) for c in cs for i in range(3) for j in range(i + 1, 3)}
>>> pairs(kept) == pairs(cases)
True
"""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import settings

FULL = pytest.mark.full
GPU_EXAMPLES = 8   # a property test's draws in the default GPU run


def is_full():
    """Whether this run is the full one (see the module docstring)."""
    return os.environ.get("FLUXPY_TEST_PROFILE", "") == "full"


def _key(value):
    try:
        hash(value)
        return value
    except TypeError:   # dicts, lists, arrays: their text tells them apart
        return repr(value)


def _facts(case):
    """Each value of ``case`` with its position, and each pair of them."""
    keys = [_key(v) for v in case]
    singles = {(i, k) for i, k in enumerate(keys)}
    return singles | {(i, keys[i], j, keys[j]) for i, j in itertools.combinations(range(len(keys)), 2)}


def _cover_indices(cases):
    facts = [_facts(c) for c in cases]
    left = set().union(*facts) if facts else set()
    chosen = []
    while left:   # greedy: the case that covers most of what is left, the earliest on a tie
        best = max(range(len(cases)), key=lambda k: (len(facts[k] & left), -k))
        chosen.append(best)
        left -= facts[best]
    return sorted(chosen)


def cover(cases):
    """The cases (tuples) to run by default: a subset, in the given order, in which every value at every position
    and every pair of values at two positions that ``cases`` holds occurs."""
    cases = [tuple(c) for c in cases]
    return [cases[k] for k in _cover_indices(cases)]


def grid(cases):
    """``cases`` in a full run, :func:`cover` of them otherwise: for a loop over a grid inside one test."""
    return [tuple(c) for c in cases] if is_full() else cover(cases)


def sweep(*values, cases=None):
    """``pytest.mark.parametrize`` values for the product of ``values`` (or for ``cases``, tuples): every case,
    those outside :func:`cover` marked ``full`` (skipped by default)."""
    cases = [tuple(c) for c in (cases if cases is not None else itertools.product(*values))]
    kept = set(_cover_indices(cases))
    return [pytest.param(*c, marks=() if k in kept else FULL) for k, c in enumerate(cases)]


def case_id(value):
    """A short test id for a parameter value: a dtype's name, a function's name, a tuple's items joined by x.

    >>> import numpy as np
    >>> [case_id(np.float32), case_id(np.dtype("float16")), case_id((2, 3)), case_id(len), case_id(None)]
    ['float32', 'float16', '2x3', 'len', 'None']
    """
    if isinstance(value, tuple):
        return "x".join(map(case_id, value))
    if isinstance(value, type) or hasattr(value, "kind") and hasattr(value, "itemsize"):
        try:
            dtype = np.dtype(value)
            if dtype.kind != "O":   # any other class reads as NumPy's object dtype
                return dtype.name
        except TypeError:
            pass
    return getattr(value, "__name__", None) or str(value)


def examples(n, default=GPU_EXAMPLES):
    """Hypothesis settings for a GPU property test: the ``gpu`` profile, with ``n`` examples in a full run and at
    most ``default`` otherwise (fewer for a test parametrized over many cases, each drawing its own)."""
    return settings(settings.get_profile("gpu"), max_examples=n if is_full() else min(n, default))
