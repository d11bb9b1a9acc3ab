"""The cuDNN search past the heuristics (every engine, the knobs of the fastest) and the graph path's disk cache,
on the GPU: every configuration the search times computes the right answer, the choice is kept on disk and
rebuilt without timing, a stale row is searched again, deterministic mode stays deterministic.

Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import json
import os

import numpy as np
import pytest

from devices import cupy_module
from fluxpy.ops.conv import conv_backward_data, conv_backward_filter, conv_dims
from fluxpy.options import options

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("searching")]


@pytest.fixture()
def searching(graph, monkeypatch):
    """The graph module (conftest's ``graph``: temporary disk cache, empty plan caches, the options put back after
    the test) with a generous search budget that the budget alone bounds, and the graph path kept whatever the
    legacy call's time (these small problems' legacy call can time faster on a busy GPU, which these tests are
    not about)."""
    from fluxpy.kernels.cudnn import choice
    options.set(search_budget_ms=5000)
    monkeypatch.setattr(choice, "SEARCH_CALLS", 10**6)   # the search reads it where it lives
    monkeypatch.setattr(graph, "LEGACY_MARGIN", 0.0)
    return graph


def _problem(seed, n=8, c=32, h=14, k=48, r=3, stride=2, pad=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, h)).astype(np.float32)
    w = (rng.standard_normal((k, c, r, r)) / np.sqrt(c * r * r)).astype(np.float32)
    cd = conv_dims(x, w, stride=stride, pad=pad, flipped=True)
    dy = rng.standard_normal(cd.y_shape).astype(np.float32)
    return x, w, dy, cd


def _rel(got, ref):
    got = np.asarray(got, dtype=np.float64)
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


def _plan(graph, kind):
    plans = [p for p in graph._plans.values() if p is not None and p.kind == kind]
    assert len(plans) == 1, graph.plan_info()
    return plans[0]


@pytest.mark.parametrize("kind", ["bwd_filter", "bwd_data"])
def test_every_configuration_the_search_times_computes_the_gradient(graph, kind):
    """The search goes past the heuristics (other engines, knob values), and each configuration it timed, rebuilt
    from its Config, gives the float64 NumPy gradient."""
    cp = cupy_module()
    from fluxpy.kernels.cudnn import search
    from fluxpy.kernels.cudnn.handle import get_handle
    x, w, dy, cd = _problem(1)
    xg, wg, dyg = cp.asarray(x), cp.asarray(w), cp.asarray(dy)
    if kind == "bwd_filter":
        got = conv_backward_filter(xg, dyg, cd)
        ref = conv_backward_filter(x.astype(np.float64), dy.astype(np.float64), cd)
    else:
        got = conv_backward_data(dyg, wg, cd)
        ref = conv_backward_data(dy.astype(np.float64), w.astype(np.float64), cd)
    assert _rel(cp.asnumpy(got), ref) < 1e-5
    p = _plan(graph, kind)
    sources = [src for _, src, _ in p.tuned]
    assert any(s.startswith("heuristics") for s in sources), sources
    assert any(s == "engine search" or " + " in s for s in sources), f"nothing past the heuristics: {sources}"
    info = [i for i in graph.plan_info() if i["kind"] == kind][0]
    assert info["config"] == str(p.config) and info["source"] == p.source
    # timed (which is faster is a benchmark's question: on a GPU the other test workers share, timings move)
    assert info["ms"] < float("inf") and info["heuristics_ms"] < float("inf")
    # every timed configuration, rebuilt from its description, computes the gradient
    configs = {}
    for name, src, t in p.tuned:
        if name != "legacy" and t < float("inf"):
            configs[name] = src
    by_name = {}
    for c in _timed_configs(p):
        by_name[str(c)] = c
    assert set(configs) <= set(by_name), (set(configs) - set(by_name))
    handle = get_handle()
    for name in list(configs)[:24]:
        built = search.build_config(p.graph, by_name[name])
        assert built is not None, name
        cfg, descs = built
        plan, ws = p.try_plan(cfg)
        out = cp.full(cd.w_shape if kind == "bwd_filter" else cd.x_shape, cp.nan, dtype=cp.float32)
        ptrs = ((xg.data.ptr, out.data.ptr, dyg.data.ptr) if kind == "bwd_filter" else
                (out.data.ptr, wg.data.ptr, dyg.data.ptr))
        p.execute(handle, ptrs, plan, ws)
        assert _rel(cp.asnumpy(out), ref) < 1e-5, (name, configs[name])
        search.destroy_all([plan, cfg] + descs)


def _timed_configs(p):
    """The Config of every candidate in ``p.tuned`` (rebuilt from the knob text the search printed)."""
    from fluxpy.kernels.cudnn.search import KNOB_NAMES, Config
    codes = {v: k for k, v in KNOB_NAMES.items()}
    out = []
    for name, _, _ in p.tuned:
        if name == "legacy":
            continue
        head, _, rest = name.partition(" [")
        knobs = []
        for part in rest.rstrip("]").split(", ") if rest else []:
            k, v = part.split("=")
            knobs.append((codes[k], int(v)))
        out.append(Config(int(head.split()[1]), tuple(sorted(knobs))))
    return out


def test_the_choice_is_kept_on_disk_and_rebuilt_without_timing(graph):
    cp = cupy_module()
    x, w, dy, cd = _problem(2)
    xg, dyg = cp.asarray(x), cp.asarray(dy)
    first = cp.asnumpy(conv_backward_filter(xg, dyg, cd))
    p = _plan(graph, "bwd_filter")
    chosen, timed = str(p.config), len(p.tuned)
    assert timed > 1
    path = graph.cache_file()
    assert path.startswith(options.cache_dir) and os.path.exists(path)
    rows = json.load(open(path))
    assert any(v.get("config") == p.config.to_json() for v in rows.values())
    graph.clear_cache()                                   # a new process: memory empty, the file stays
    hits = graph.stats()["disk_hits"]
    again = cp.asnumpy(conv_backward_filter(xg, dyg, cd))
    q = _plan(graph, "bwd_filter")
    assert graph.stats()["disk_hits"] == hits + 1
    assert str(q.config) == chosen and len(q.tuned) == 1 and q.source.startswith("disk")
    np.testing.assert_allclose(again, first, rtol=1e-5, atol=1e-5)


def test_a_stale_row_on_disk_is_searched_again(graph):
    cp = cupy_module()
    x, w, dy, cd = _problem(3)
    xg, dyg = cp.asarray(x), cp.asarray(dy)
    ref = conv_backward_filter(x.astype(np.float64), dy.astype(np.float64), cd)
    conv_backward_filter(xg, dyg, cd)
    path = graph.cache_file()
    rows = json.load(open(path))
    for v in rows.values():
        if "config" in v:
            v["config"] = [10**6, [[17, 3]]]              # an engine this cuDNN does not have
    json.dump(rows, open(path, "w"))
    graph.clear_cache()
    got = cp.asnumpy(conv_backward_filter(xg, dyg, cd))
    q = _plan(graph, "bwd_filter")
    assert not q.source.startswith("disk") and len(q.tuned) > 1
    assert _rel(got, ref) < 1e-5
    assert json.load(open(path)) != rows                  # the fresh choice replaced the stale row


def test_deterministic_mode_searches_only_deterministic_engines(graph):
    cp = cupy_module()
    from fluxpy.kernels.cudnn import search
    from fluxpy.kernels.cudnn.descriptors import NOTE_NONDETERMINISTIC
    x, w, dy, cd = _problem(4)
    with options(deterministic=True):
        a = cp.asnumpy(conv_backward_filter(cp.asarray(x), cp.asarray(dy), cd))
        b = cp.asnumpy(conv_backward_filter(cp.asarray(x), cp.asarray(dy), cd))
        p = _plan(graph, "bwd_filter")
        for c in _timed_configs(p):
            eng = search.new_engine(p.graph, c.engine)
            _, num, _ = search.engine_info(eng)
            search.destroy_all([eng])
            assert NOTE_NONDETERMINISTIC not in num, str(c)
    np.testing.assert_array_equal(a, b)


def test_no_budget_keeps_to_the_heuristics(graph):
    cp = cupy_module()
    options.set(search_budget_ms=0)
    x, w, dy, cd = _problem(5)
    conv_backward_data(cp.asarray(dy), cp.asarray(w), cd)
    p = _plan(graph, "bwd_data")
    assert all(src.startswith(("heuristics", "fallback heuristics", "legacy")) for _, src, _ in p.tuned), p.tuned


def test_a_negative_search_budget_is_refused(graph):
    with pytest.raises(ValueError, match="search_budget_ms expects a number of milliseconds >= 0, got -1"):
        options.set(search_budget_ms=-1)
