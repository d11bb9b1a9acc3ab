"""The choice of a problem's execution plan: the candidates the heuristics propose (filtered by the options),
the search past them (:mod:`fluxpy.kernels.cudnn.search`) within a budget, each timed on the call's own buffers,
and the pick among them.

:mod:`fluxpy.kernels.cudnn.graph` builds the plan (:class:`~fluxpy.kernels.cudnn.graph.GraphPlan`), calls
:func:`_choose` once per problem, and keeps what it chose; this module holds no state of its own.

Engine choice: ``CUDNN_HEUR_MODE_A`` (then ``FALLBACK``) configurations in order, filtered as
PyTorch filters them: never ``DOWN_CONVERT_INPUTS``; float32 without ``allow_tf32`` never
``TENSOR_CORE``; ``deterministic`` never ``NONDETERMINISTIC``; plans whose workspace exceeds
``workspace_limit`` are dropped (the options are :mod:`fluxpy.options`'s).
Runtime-compiled engines are only tried when no precompiled one finalizes. With autotuning on
(the ``autotune`` option, default 8) up to that many finalized plans (those of ``HEUR_MODE_A``, then of
``FALLBACK``) are timed once on the call's own buffers (one warm run, then 5 under events) and the
fastest kept (as ``torch.backends.cudnn.benchmark``).

Past the heuristics (within the ``search_budget_ms`` option's budget per problem, and at most :data:`SEARCH_CALLS`
calls' worth of time): every other engine of the graph with its default knobs, then the knobs of the three fastest
configurations (split-K slices, tile shapes, stages... whatever the engine exposes), one knob at a time
(:mod:`fluxpy.kernels.cudnn.search`); the three fastest are timed again (20 calls) before the pick.

Timed plans within :data:`SAME_SPEED` of the fastest count as equally fast, and the one with the least workspace
wins (:func:`_fastest`; the candidates need only ``ms`` and ``ws`` there):

>>> from types import SimpleNamespace as Timed
>>> found = [Timed(ms=1.0, ws=4096), Timed(ms=1.0 * SAME_SPEED, ws=0), Timed(ms=2.0, ws=0)]
>>> _fastest(found) is found[1]
True
"""
from __future__ import annotations

import time

import numpy as np

from ...options import options
from .. import compiler
from . import search
from .descriptors import (BEHAVIOR_RUNTIME_COMPILATION, HEUR_MODE_A, HEUR_MODE_FALLBACK, NOTE_DOWN_CONVERT_INPUTS,
                          NOTE_NONDETERMINISTIC, NOTE_TENSOR_CORE, backend_destroy)
from .errors import CudnnError
from .search import Candidate

__all__ = ["SAME_SPEED", "SEARCH_CALLS"]

SEARCH_CALLS = 200
"""The search past the heuristics spends at most the time of this many calls of the problem (at the heuristics' best
speed), and at most the ``search_budget_ms`` option's budget: a fast problem gets a few engines, a slow one the whole
budget. A gain of 1% pays for the search within a hundred times this many calls (the disk cache keeps the choice,
so it is paid once per machine)."""


def _usable(num, fp32):
    """Whether an engine with numerical notes ``num`` obeys the options."""
    if NOTE_DOWN_CONVERT_INPUTS in num:
        return False
    if fp32 and not options.allow_tf32 and NOTE_TENSOR_CORE in num:
        return False
    return not (options.deterministic and NOTE_NONDETERMINISTIC in num)


def _within_limit(got):
    """``got`` (a plan and its workspace, or None) where the workspace is within the limit, else None (destroyed)."""
    if got is not None and got[1] > options.workspace_limit:
        backend_destroy(got[0])
        return None
    return got


def _finalized(p, want):
    """Up to ``want`` finalized :class:`~fluxpy.kernels.cudnn.search.Candidate` s in heuristics order
    (``HEUR_MODE_A``, then, when autotuning, ``FALLBACK``'s), and the runtime-compiled configurations left for
    later.

    Float32 with ``allow_tf32`` gets ``want`` tensor-core candidates AND ``want`` without tensor cores: the
    heuristics rank TF32 engines first, yet on small NCHW problems their layout transposes can make them slower
    than the FMA engines, so allowing TF32 must not drop those."""
    fp32 = p.dtype == np.float32
    split = fp32 and options.allow_tf32
    quota = {True: want, False: want} if split else {None: want}
    found, later, seen = [], [], set()
    for mode in (HEUR_MODE_A, HEUR_MODE_FALLBACK):
        try:
            cfgs = p.configs(mode)
        except CudnnError:
            continue
        for rank, cfg in enumerate(cfgs):
            try:
                idx, num, beh = p.notes(cfg)
            except CudnnError:
                continue
            pool = (NOTE_TENSOR_CORE in num) if split else None
            if not _usable(num, fp32) or quota[pool] <= 0:
                continue
            if BEHAVIOR_RUNTIME_COMPILATION in beh:
                later.append((idx, cfg))
                continue
            if (mode, idx) in seen:
                continue
            seen.add((mode, idx))
            got = _within_limit(p.try_plan(cfg))
            if got is None:
                continue
            where = "heuristics" if mode == HEUR_MODE_A else "fallback heuristics"
            found.append(Candidate(got[0], got[1], search.read_config(cfg), f"{where} #{rank}"))
            quota[pool] -= 1
            if max(quota.values()) <= 0:
                break
        if max(quota.values()) <= 0 or (found and want == 1):
            break   # with autotuning, the FALLBACK heuristics' configurations join the pool
    return found, later


def _runtime_compiled(p, later):
    """The first runtime-compiled configuration that finalizes within the workspace limit, as a candidate list."""
    for _, cfg in later:
        got = _within_limit(p.try_plan(cfg))
        if got is not None:
            return [Candidate(got[0], got[1], search.read_config(cfg), "runtime-compiled")]
    return []


def _choose(p, handle, ptrs):
    """Finalize execution plans in heuristics order (filtered by the options), with a search budget widen the
    pool past the heuristics (:func:`fluxpy.kernels.cudnn.search.widen`), and keep the fastest."""
    start = time.perf_counter()
    found, later = _finalized(p, max(1, options.autotune))
    if not found:
        found = _runtime_compiled(p, later)
    if not found:
        return False

    def timed(c, n=5):
        c.ms = _events_ms(lambda: p.execute(handle, ptrs, c.plan, c.ws), n)
        p.tuned.append((str(c.config), c.source, round(c.ms, 4)))

    if len(found) > 1 or (options.search_budget_ms > 0 and options.autotune):
        for c in found:
            timed(c)
    p.heuristics_ms = min(c.ms for c in found)
    budget_ms = min(options.search_budget_ms, SEARCH_CALLS * p.heuristics_ms)
    if budget_ms > 0 and options.autotune:
        fp32 = p.dtype == np.float32
        found += search.widen(p.graph, found, lambda cfg: _within_limit(p.try_plan(cfg)), timed,
                              lambda num: _usable(num, fp32), time.perf_counter() + budget_ms / 1e3)
        _retime_fastest(found, timed)
    best = _fastest(found)
    p.adopt(best)
    for c in found:
        if c is not best:
            c.destroy()
    p.choose_s = time.perf_counter() - start
    return True


def _retime_fastest(found, timed, n=3, reps=20):
    """Time the ``n`` fastest candidates again, ``reps`` calls each: the pick among many candidates timed once
    would otherwise favour a lucky measurement."""
    if len(found) > 1:
        for c in sorted(found, key=lambda c: c.ms)[:n]:
            timed(c, reps)


def _events_ms(run, n=5):
    """Milliseconds per call of ``run()`` by the one GPU timer (:func:`fluxpy.kernels.compiler.time_ms`: host time
    between launches counts, as in a training step); inf if cuDNN refuses the call or memory runs out."""
    return compiler.time_ms(run, n, failures=(CudnnError,))


SAME_SPEED = 1.03
"""Timed plans within this factor of the fastest count as equally fast: the one with the least workspace wins."""


def _fastest(found):
    """The fastest of the timed ``found`` candidates (the smallest workspace among those within
    :data:`SAME_SPEED` of the fastest: the workspace is memory held for the whole run); the first if none was
    timed."""
    fastest = min(c.ms for c in found)
    if fastest == float("inf"):
        return found[0]
    near = [c for c in found if c.ms <= SAME_SPEED * fastest]
    return min(near, key=lambda c: (c.ws, c.ms))
