"""Engine configurations past cuDNN's heuristics: every engine of an operation graph and the knobs each one
exposes (split-K slices, tile shapes, stages...), timed within a budget.

cuDNN's heuristics rank a handful of configurations per problem, each engine with the knob values the
heuristics guessed. :func:`widen` goes further, in two steps, until a deadline:

1. **engines**: every engine of the graph (``OPERATIONGRAPH_ENGINE_GLOBAL_COUNT``) that the heuristics did not
   propose, with its default knobs (runtime-compiled engines and those the options rule out are skipped);
2. **knobs**: for the fastest :data:`KNOB_ENGINES` configurations so far, one knob at a time over its values
   (``KNOB_INFO`` minimum, maximum and stride, at most :data:`KNOB_VALUES` of them), keeping a value where it is
   faster (a greedy walk, one knob after another).

A configuration is a :class:`Config` (engine global index and knob choices): what the graph path prints, keeps
on disk and rebuilds (:func:`build_config`). Candidates carry where they came from (``source``), so a gain can be
traced to the engine or knob that gave it.

>>> str(Config(12, ((KNOB_SPLIT_K_SLC, 4), (2, 3))))
'engine 12 [SPLIT_K_SLC=4, TILE_SIZE=3]'
>>> Config.from_json(Config(7, ((2, 1),)).to_json())
Config(engine=7, knobs=((2, 1),))
>>> knob_values(1, 64, 1)
[1, 2, 4, 8, 16, 32, 64]
"""
from __future__ import annotations

import ctypes
import time
from typing import NamedTuple

from .descriptors import (A_CFG_ENGINE, A_CFG_KNOB_CHOICES, A_ENGINE_BEHAVIOR_NOTE, A_ENGINE_GRAPH, A_ENGINE_INDEX,
                          A_ENGINE_KNOB_INFO, A_ENGINE_NUMERICAL_NOTE, A_GRAPH_ENGINE_COUNT, A_KNOB_CHOICE_TYPE,
                          A_KNOB_CHOICE_VALUE, A_KNOB_INFO_MAX, A_KNOB_INFO_MIN, A_KNOB_INFO_STRIDE, A_KNOB_INFO_TYPE,
                          BEHAVIOR_RUNTIME_COMPILATION, D_ENGINE, D_ENGINECFG, D_KNOB_CHOICE, D_KNOB_INFO,
                          T_BACKEND_DESCRIPTOR, T_BEHAVIOR_NOTE, T_INT64, T_KNOB_TYPE, T_NUMERICAL_NOTE,
                          backend_create, backend_destroy, pointers)
from .library import fn

__all__ = ["Config", "Candidate", "KNOB_NAMES", "KNOB_VALUES", "KNOB_ENGINES", "engine_info", "read_config",
           "build_config", "destroy_all", "knob_space", "knob_values", "engine_count", "new_engine", "widen"]

# cudnnBackendKnobType_t (cudnn_graph.h of cuDNN 9)
KNOB_NAMES = {0: "SPLIT_K", 1: "SWIZZLE", 2: "TILE_SIZE", 3: "USE_TEX", 4: "EDGE", 5: "KBLOCK", 6: "LDGA", 7: "LDGB",
              8: "CHUNK_K", 9: "SPLIT_H", 10: "WINO_TILE", 11: "MULTIPLY", 12: "SPLIT_K_BUF", 13: "TILEK",
              14: "STAGES", 15: "REDUCTION_MODE", 16: "CTA_SPLIT_K_MODE", 17: "SPLIT_K_SLC", 18: "IDX_MODE",
              19: "SLICED", 20: "SPLIT_RS", 21: "SINGLEBUFFER", 22: "LDGC", 23: "SPECFILT", 24: "KERNEL_CFG",
              25: "WORKSPACE", 26: "TILE_CGA", 27: "TILE_CGA_M", 28: "TILE_CGA_N", 29: "BLOCK_SIZE",
              30: "OCCUPANCY", 31: "ARRAY_SIZE_PER_THREAD", 32: "NUM_C_PER_BLOCK", 33: "SPLIT_COLS",
              34: "TILE_ROWS", 35: "TILE_COLS", 36: "LOAD_SIZE", 37: "CTA_COUNT", 38: "STREAM_K",
              39: "SPLIT_P_SLC", 40: "TILE_M", 41: "TILE_N", 42: "WARP_SPEC_CFG", 43: "SWAP_AB",
              44: "INPUT_TMA_ENABLE", 45: "OUTPUT_TMA_ENABLE"}
KNOB_SPLIT_K_SLC = 17

KNOB_VALUES = 8
"""The most values of one knob tried (spread geometrically over its range where it has more)."""

KNOB_ENGINES = 3
"""How many of the fastest configurations get their knobs walked."""

BETTER = 0.98
"""A knob value is kept where it takes under this fraction of the time of the configuration it changes."""

_i64 = ctypes.c_int64
_P = ctypes.c_void_p


class Config(NamedTuple):
    """An engine configuration: the engine's global index and its knob choices ``((knob type, value), ...)``
    sorted by type (empty: the engine's defaults).

    >>> c = Config(20).with_knob(KNOB_SPLIT_K_SLC, 4)
    >>> c, str(c)
    (Config(engine=20, knobs=((17, 4),)), 'engine 20 [SPLIT_K_SLC=4]')
    """
    engine: int
    knobs: tuple = ()

    def __str__(self):
        knobs = ", ".join(f"{KNOB_NAMES.get(t, t)}={v}" for t, v in self.knobs)
        return f"engine {self.engine}" + (f" [{knobs}]" if knobs else "")

    def with_knob(self, knob: int, value: int) -> Config:
        """This configuration with ``knob`` set to ``value``."""
        return Config(self.engine, tuple(sorted({**dict(self.knobs), knob: value}.items())))

    def to_json(self) -> list:
        return [self.engine, [list(k) for k in self.knobs]]

    @classmethod
    def from_json(cls, value) -> Config:
        return cls(int(value[0]), tuple((int(t), int(v)) for t, v in value[1]))


class Candidate:
    """A finalized execution plan (``plan``, workspace bytes ``ws``) of ``config``, its time in ms once timed,
    where it came from (``source``: ``"heuristics #2"``, ``"engine search"``, ``"... + SPLIT_K_SLC=4"``), and the
    descriptors made for it (destroyed with it).

    >>> c = Candidate(plan=None, ws=0, config=Config(5), source="engine search")
    >>> c.ms, c.source
    (inf, 'engine search')
    """
    __slots__ = ("plan", "ws", "config", "source", "ms", "descs")

    def __init__(self, plan, ws, config, source, descs=()):
        self.plan, self.ws, self.config, self.source = plan, ws, config, source
        self.ms = float("inf")
        self.descs = list(descs)

    def destroy(self) -> None:
        backend_destroy(self.plan)
        for d in reversed(self.descs):
            backend_destroy(d)
        self.plan, self.descs = None, []


# ---------------------------------------------------------------------------------------------
# Reading and building engine configurations

def _get_int(desc, attr, atype, ctype=_i64):
    v, got = ctype(-1), _i64()
    if fn.cudnnBackendGetAttribute(desc, attr, atype, 1, ctypes.byref(got), ctypes.byref(v)):
        return None
    return int(v.value)


def _get_descriptors(desc, attr, kind, most):
    """Up to ``most`` descriptors of ``kind`` read from ``desc``'s attribute ``attr`` (created here: the caller
    destroys them)."""
    made = [backend_create(kind) for _ in range(most)]
    arr, got = pointers(*made), _i64()
    if fn.cudnnBackendGetAttribute(desc, attr, T_BACKEND_DESCRIPTOR, most, ctypes.byref(got), arr):
        got.value = 0
    for d in made[got.value:]:
        backend_destroy(d)
    return made[:got.value]


def engine_info(eng) -> tuple:
    """``(global index, numerical notes, behavior notes)`` of a finalized engine descriptor."""
    idx = _get_int(eng, A_ENGINE_INDEX, T_INT64)
    notes = []
    for attr, atype in ((A_ENGINE_NUMERICAL_NOTE, T_NUMERICAL_NOTE), (A_ENGINE_BEHAVIOR_NOTE, T_BEHAVIOR_NOTE)):
        vals, n = (ctypes.c_int * 16)(), _i64(0)
        if fn.cudnnBackendGetAttribute(eng, attr, atype, 16, ctypes.byref(n), vals):
            n.value = 0
        notes.append(set(vals[:n.value]))
    return (-1 if idx is None else idx), notes[0], notes[1]


def read_config(cfg) -> Config:
    """The :class:`Config` of a finalized engine configuration descriptor (e.g. one the heuristics gave)."""
    eng = backend_create(D_ENGINE)
    try:
        got = _i64()
        if fn.cudnnBackendGetAttribute(cfg, A_CFG_ENGINE, T_BACKEND_DESCRIPTOR, 1, ctypes.byref(got), pointers(eng)):
            return Config(-1)
        idx = _get_int(eng, A_ENGINE_INDEX, T_INT64)
    finally:
        backend_destroy(eng)
    knobs = []
    for choice in _get_descriptors(cfg, A_CFG_KNOB_CHOICES, D_KNOB_CHOICE, len(KNOB_NAMES)):
        t = _get_int(choice, A_KNOB_CHOICE_TYPE, T_KNOB_TYPE, ctypes.c_int)
        v = _get_int(choice, A_KNOB_CHOICE_VALUE, T_INT64)
        backend_destroy(choice)
        if t is not None and v is not None:
            knobs.append((t, v))
    return Config(-1 if idx is None else idx, tuple(sorted(knobs)))


def _finalized(kind, sets):
    """A new descriptor of ``kind`` with ``sets`` ``[(attr, type, count, ctypes value)]`` applied and finalized,
    or None where cuDNN refuses (the descriptor is destroyed)."""
    d = backend_create(kind)
    for attr, atype, count, value in sets:
        if fn.cudnnBackendSetAttribute(d, attr, atype, count, value):
            backend_destroy(d)
            return None
    if fn.cudnnBackendFinalize(d):
        backend_destroy(d)
        return None
    return d


def new_engine(graph, index):
    """The finalized engine ``index`` of operation graph ``graph``, or None where it does not support the graph."""
    return _finalized(D_ENGINE, [(A_ENGINE_GRAPH, T_BACKEND_DESCRIPTOR, 1, ctypes.byref(_P(graph))),
                                 (A_ENGINE_INDEX, T_INT64, 1, ctypes.byref(_i64(index)))])


def build_config(graph, config: Config):
    """``(engine config descriptor, [descriptors to destroy after it: the engine first, then the knob choices])`` of
    ``config`` on ``graph``, or None where the engine or one of the knob values is refused."""
    eng = new_engine(graph, config.engine)
    if eng is None:
        return None
    descs = [eng]
    choices = []
    for t, v in config.knobs:
        c = _finalized(D_KNOB_CHOICE, [(A_KNOB_CHOICE_TYPE, T_KNOB_TYPE, 1, ctypes.byref(ctypes.c_int(t))),
                                       (A_KNOB_CHOICE_VALUE, T_INT64, 1, ctypes.byref(_i64(v)))])
        if c is None:
            destroy_all(descs)
            return None
        descs.append(c)
        choices.append(c)
    sets = [(A_CFG_ENGINE, T_BACKEND_DESCRIPTOR, 1, ctypes.byref(_P(eng)))]
    if choices:
        sets.append((A_CFG_KNOB_CHOICES, T_BACKEND_DESCRIPTOR, len(choices), pointers(*choices)))
    cfg = _finalized(D_ENGINECFG, sets)
    if cfg is None:
        destroy_all(descs)
        return None
    return cfg, descs


def destroy_all(descs):
    for d in reversed(descs):
        backend_destroy(d)


def knob_values(lo: int, hi: int, stride: int, most: int = KNOB_VALUES) -> list:
    """The values of a knob with range ``lo..hi`` in steps of ``stride``: all of them where there are at most
    ``most``, else ``lo + stride * (2**k - 1)`` for k = 0, 1, ... and ``hi`` (thinned evenly to ``most``).

    >>> knob_values(0, 3, 1)
    [0, 1, 2, 3]
    >>> knob_values(1, 64, 1)
    [1, 2, 4, 8, 16, 32, 64]
    >>> knob_values(0, 0, 1)
    [0]
    """
    stride = max(1, stride)
    if hi < lo:
        return []
    n = (hi - lo) // stride + 1
    if n <= most:
        return [lo + i * stride for i in range(n)]
    steps, k = [], 1
    while k - 1 < n - 1:
        steps.append(k - 1)
        k *= 2
    steps.append(n - 1)
    if len(steps) > most:
        steps = [steps[round(i * (len(steps) - 1) / (most - 1))] for i in range(most)]
    return [lo + i * stride for i in steps]


def knob_space(graph, engine_index: int) -> list:
    """``[(knob type, [values])]`` of the knobs engine ``engine_index`` exposes on ``graph`` (only knobs with more
    than one value)."""
    eng = new_engine(graph, engine_index)
    if eng is None:
        return []
    try:
        infos = _get_descriptors(eng, A_ENGINE_KNOB_INFO, D_KNOB_INFO, len(KNOB_NAMES))
    finally:
        backend_destroy(eng)
    space = []
    for info in infos:
        t = _get_int(info, A_KNOB_INFO_TYPE, T_KNOB_TYPE, ctypes.c_int)
        lo, hi = _get_int(info, A_KNOB_INFO_MIN, T_INT64), _get_int(info, A_KNOB_INFO_MAX, T_INT64)
        stride = _get_int(info, A_KNOB_INFO_STRIDE, T_INT64)
        backend_destroy(info)
        if None in (t, lo, hi):
            continue
        values = knob_values(lo, hi, stride or 1)
        if len(values) > 1:
            space.append((t, values))
    return space


def engine_count(graph) -> int:
    """How many engines cuDNN has for operation graph ``graph`` (global indices ``0 .. count - 1``)."""
    n = _get_int(graph, A_GRAPH_ENGINE_COUNT, T_INT64)
    return max(0, n or 0)


# ---------------------------------------------------------------------------------------------
# The search

def widen(graph, found: list, try_plan, timed, usable, deadline: float) -> list:
    """New :class:`Candidate` s past ``found`` (the heuristics' candidates, timed), each timed, until
    ``time.perf_counter()`` passes ``deadline``: the engines not in ``found`` with their default knobs, then the
    knobs of the fastest configurations one at a time (see the module docstring).

    ``try_plan(cfg)`` gives ``(plan, workspace)`` or None (also None past the workspace limit), ``timed(c)`` sets
    ``c.ms``, ``usable(numerical notes)`` says whether the options allow an engine."""
    new = []
    seen = {c.config for c in found}

    def attempt(config, source):
        if config in seen or time.perf_counter() > deadline:
            return None
        seen.add(config)
        built = build_config(graph, config)
        if built is None:
            return None
        cfg, descs = built
        _, num, beh = engine_info(descs[0])      # the engine: the options may rule it out
        got = try_plan(cfg) if usable(num) and BEHAVIOR_RUNTIME_COMPILATION not in beh else None
        if got is None:
            destroy_all([cfg] + descs)
            return None
        c = Candidate(got[0], got[1], config, source, [cfg] + descs)
        timed(c)
        new.append(c)
        return c

    proposed = {c.config.engine for c in found}
    for index in range(engine_count(graph)):
        if time.perf_counter() > deadline:
            break
        if index in proposed:
            continue
        attempt(Config(index), "engine search")
    ranked = sorted(found + new, key=lambda c: c.ms)
    for start in ranked[:KNOB_ENGINES]:
        best = start
        for knob, values in knob_space(graph, start.config.engine):
            for v in values:
                c = attempt(best.config.with_knob(knob, v), f"{best.source} + {KNOB_NAMES.get(knob, knob)}={v}")
                if c is not None and c.ms < BETTER * best.ms:
                    best = c
    return new

