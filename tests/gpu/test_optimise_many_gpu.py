"""The multi-tensor kernel generated from a rule's formula (``optimiser_step_many``) against the per-parameter
kernel generated from the same formula (``optimiser_step``) and the rule's NumPy path on the CPU: odd sizes, more
tensors than one launch takes, strided gradients, blocks striding over a long list, the calls it takes, and
update's groups on a model.

Against the per-parameter kernel float64 agrees to ``rtol=1e-14`` and float32 to ``rtol=1e-6`` (the same C
statements in two kernels; NVRTC may contract them differently); against the CPU float64 to ``rtol=1e-12`` and
float32 to ``rtol=1e-5`` (the GPU contracts ``a * b + c`` to one fused multiply-add, NumPy rounds twice).
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import contextlib
import copy

import numpy as np
import pytest

import fluxpy
from fluxpy import kernels
from fluxpy.kernels import cuda_optimise as K
from fluxpy.optimise import Adam, AdamW, Descent, Momentum, OptimiserChain, RAdam, WeightDecay, freeze, setup, update
from fluxpy.optimise.base import flatten, formula_of
from devices import assert_matches_cpu

pytestmark = pytest.mark.gpu

SIZES = [1, 3, 1000, 4097, 0, 256, 1024, 1025, 7, 0, 65537, 2]
RTOL = {np.float64: 1e-12, np.float32: 1e-5}
ATOL = {np.float64: 1e-14, np.float32: 1e-7}   # for entries near zero (a moment or a parameter that cancels out)
TWIN = {np.float64: 1e-14, np.float32: 1e-6}
RULES = [Adam(0.01, (0.8, 0.95), 1e-7), AdamW(0.01, lambd=0.3), Descent(0.05), Momentum(0.05, 0.8),
         RAdam(0.1, (0.8, 0.9)), OptimiserChain(WeightDecay(0.1), Adam(0.01))]


class Lists:
    """Parameters of ``sizes`` with a rule's state, as NumPy arrays (``cpu``) and twice on the GPU (``many``,
    ``each``), with the device counters of each GPU copy."""

    def __init__(self, rule, sizes, dtype, rng):
        import cupy as cp
        self.rule, self.f, self.hyper = rule, formula_of(rule), rule.hyper()
        xs = [rng.standard_normal(n).astype(dtype) for n in sizes]
        self.cpu = [(x, setup(rule, x)) for x in xs]
        self.many = [(cp.asarray(x), setup(rule, cp.asarray(x))) for x in xs]
        self.each = [(cp.asarray(x), setup(rule, cp.asarray(x))) for x in xs]
        counters = [float(c) for c in self._counters(self.cpu[0][1].state)]
        self.c_many = cp.array(counters, np.float64) if counters else None
        self.c_each = cp.array(counters, np.float64) if counters else None

    def _counters(self, state):
        values = flatten(self.rule.layout(), state, {})
        return [values[n] for n in self.f.counter_names]

    def arrays(self, pairs):
        return [[flatten(self.rule.layout(), s.state, {})[n] for n in self.f.state] for _, s in pairs]

    def step(self, dxs, dxs_gpu):
        import cupy as cp
        xs = [x for x, _ in self.many]
        inputs = [[] for _ in xs]
        assert kernels.find("optimiser_step_many", xs[0], self.f, xs, dxs_gpu, self.arrays(self.many), inputs) \
            is K.optimiser_step_many
        K.optimiser_step_many(xs[0], self.f, xs, dxs_gpu, self.arrays(self.many), inputs, self.hyper, self.c_many)
        for (x, _), dx, a in zip(self.each, dxs_gpu, self.arrays(self.each)):
            K.optimiser_step(x, self.f, cp.ascontiguousarray(dx), a, [], self.hyper, self.c_each)
        for counters in (self.c_many, self.c_each):
            if counters is not None:
                K.optimiser_advance(counters, self.f, self.hyper)
        for (x, s), dx in zip(self.cpu, dxs):
            s.state = self.rule.step(s.state, x, dx)
        if self.c_many is not None:   # the device counters move as the host's
            assert self.c_many.tolist() == [float(c) for c in self._counters(self.cpu[0][1].state)]

    def compare(self, dtype):
        import cupy as cp
        for (xm, _), (xe, _), (xc, _), am, ae, ac in zip(self.many, self.each, self.cpu, self.arrays(self.many),
                                                         self.arrays(self.each), self.arrays(self.cpu)):
            for m, e, c in zip([xm, *am], [xe, *ae], [xc, *ac]):
                np.testing.assert_allclose(cp.asnumpy(m), cp.asnumpy(e), rtol=TWIN[dtype], atol=ATOL[dtype])
                assert_matches_cpu(m, c, rtol=RTOL[dtype], atol=ATOL[dtype])


def run_three_ways(rule, sizes, dtype, steps=4, seed=0, strided=()):
    """Steps the same arrays with optimiser_step_many, optimiser_step and the CPU; compares after every step."""
    import cupy as cp
    rng = np.random.default_rng(seed)
    lists = Lists(rule, sizes, dtype, rng)
    for _ in range(steps):
        dxs = [rng.standard_normal(n).astype(dtype) for n in sizes]
        dxs_gpu = [cp.asarray(d) for d in dxs]
        for k in strided:   # a strided gradient of the same values
            wide = cp.zeros(2 * sizes[k], dtype)
            wide[::2] = dxs_gpu[k]
            dxs_gpu[k] = wide[::2]
            assert not dxs_gpu[k].flags.c_contiguous
        lists.step(dxs, dxs_gpu)
        lists.compare(dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_odd_sizes_match_the_per_parameter_kernel_and_the_cpu(rule, dtype):
    run_three_ways(rule, SIZES, dtype, steps=4)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_more_tensors_than_one_launch_takes(dtype):
    rng = np.random.default_rng(1)
    sizes = [int(n) for n in rng.integers(0, 300, 2 * K.CAP + 17)]   # three launches
    run_three_ways(RULES[0], sizes, dtype, steps=3, seed=2)


def test_strided_gradients_are_copied_first():
    run_three_ways(RULES[0], [5, 1000, 3, 4097], np.float64, steps=3, strided=(1, 3))


def test_blocks_stride_over_a_long_list(monkeypatch):
    monkeypatch.setattr(K, "_MAX_BLOCKS", 3)   # 3 blocks of 1024 elements for ~10k elements
    run_three_ways(RULES[0], [1, 3000, 4097, 0, 2500], np.float32, steps=2)
    run_three_ways(RULES[4], [1, 3000, 4097, 0, 2500], np.float64, steps=2)


def test_supports_takes_only_lists_it_can_run():
    import cupy as cp
    f = formula_of(Adam())
    a, b = cp.ones((2, 3)), cp.ones((2, 3))
    s = [cp.ones((2, 3)), cp.ones((2, 3))]
    assert K.optimiser_step_many_supports(a, f, [a], [b], [s], [[]])
    assert K.optimiser_step_many_supports(a, f, [a], [cp.ones((3, 2)).T], [s], [[]])  # strided dx: copied
    refused = {
        "empty": ([], [], [], []),
        "lengths": ([a], [b, b], [s], [[]]),
        "numpy": ([a], [np.ones((2, 3))], [s], [[]]),
        "dtype": ([a], [b.astype(np.float32)], [s], [[]]),
        "float16": ([a.astype(np.float16)], [b.astype(np.float16)], [[x.astype(np.float16) for x in s]], [[]]),
        "shape": ([a], [cp.ones(6)], [s], [[]]),
        "strided x": ([cp.ones((3, 2)).T], [b], [s], [[]]),
        "strided m": ([a], [b], [[cp.ones((3, 2)).T, s[1]]], [[]]),
        "an input of two entries": ([a], [b], [s], [[cp.ones(2)]]),
    }
    for why, args in refused.items():
        assert not K.optimiser_step_many_supports(a, f, *args), why


def model_of(rng, dtype):
    shapes = {"conv": (16, 3, 3, 3), "bn": (16,), "s": (), "empty": (0, 3), "long": (4097,), "dense": (10, 64),
              "odd": (3, 1, 5)}
    return {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}


@contextlib.contextmanager
def spy_on_many():
    """Wraps the registered optimiser_step_many in a spy recording the number of parameters of each call."""
    calls = []
    real = K.optimiser_step_many

    def spy(x, f, xs, *args, **kw):
        calls.append(len(xs))
        return real(x, f, xs, *args, **kw)
    before = kernels.snapshot()
    kernels.register("optimiser_step_many", "cupy", spy, K.optimiser_step_many_supports)
    try:
        yield calls
    finally:
        kernels.restore(before)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_update_on_a_cupy_model_launches_the_many_kernel(dtype):
    import cupy as cp
    rng = np.random.default_rng(3)
    cpu_model = model_of(rng, dtype)
    model = fluxpy.gpu(cpu_model)
    rule = Adam(0.01, (0.8, 0.95), 1e-7)
    state, cpu_state = setup(rule, model), setup(rule, cpu_model)
    for s in (state, cpu_state):
        freeze(s["odd"])
    for step in range(4):
        grad = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in cpu_model.items()}
        gpu_grad = {k: cp.asarray(v) for k, v in grad.items()}
        gpu_grad["dense"] = cp.asarray(np.ascontiguousarray(grad["dense"].T)).T   # as Dense's can be
        with spy_on_many() as calls:
            update(state, model, gpu_grad)
        assert calls == [6], "one call for the six unfrozen Adam parameters"
        update(cpu_state, cpu_model, grad)
        for k in cpu_model:
            m, v, bt = state[k].state
            assert_matches_cpu(model[k], cpu_model[k], rtol=RTOL[dtype], atol=ATOL[dtype])
            assert_matches_cpu(m, cpu_state[k].state[0], rtol=RTOL[dtype], atol=ATOL[dtype])
            assert_matches_cpu(v, cpu_state[k].state[1], rtol=RTOL[dtype], atol=ATOL[dtype])
            assert bt == cpu_state[k].state[2]
        assert state["conv"].state[2] == pytest.approx((0.8 ** (step + 2), 0.95 ** (step + 2)))


def test_rules_and_dtypes_make_their_own_groups():
    rng = np.random.default_rng(4)
    cpu_model = {"a": model_of(rng, np.float32), "b": model_of(rng, np.float64), "w": model_of(rng, np.float32)}
    model = fluxpy.gpu(cpu_model)
    rules = {"a": Adam(0.01), "b": Adam(0.01), "w": OptimiserChain(WeightDecay(0.1), Adam(0.01))}
    state = {k: setup(r, model[k]) for k, r in rules.items()}
    cpu_state = {k: setup(r, cpu_model[k]) for k, r in rules.items()}
    for _ in range(2):
        grad = {k: {n: rng.standard_normal(v.shape).astype(v.dtype) for n, v in sub.items()}
                for k, sub in cpu_model.items()}
        with spy_on_many() as calls:
            update(state, model, fluxpy.gpu(copy.deepcopy(grad)))
        assert calls == [7, 7, 7]   # Adam: one per dtype; the chain a group of its own
        update(cpu_state, cpu_model, grad)
    for k, sub in cpu_model.items():
        dtype = sub["conv"].dtype.type
        for n, want in sub.items():
            assert_matches_cpu(model[k][n], want, rtol=RTOL[dtype], atol=ATOL[dtype])


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_a_guarded_many_update_changes_nothing_when_the_flag_is_not_finite(rule):
    import cupy as cp
    rng = np.random.default_rng(6)
    lists = Lists(rule, [5, 300], np.float32, rng)
    xs = [x for x, _ in lists.many]
    dxs = [cp.asarray(rng.standard_normal(n).astype(np.float32)) for n in (5, 300)]
    arrays = lists.arrays(lists.many)
    every = xs + [s for per in arrays for s in per]
    before = [a.copy() for a in every]
    counters = None if lists.c_many is None else lists.c_many.copy()
    for flag in (cp.array(np.nan), cp.array(np.inf)):
        K.optimiser_step_many(xs[0], lists.f, xs, dxs, arrays, [[], []], lists.hyper, lists.c_many, ok=flag)
        if counters is not None:
            K.optimiser_advance(lists.c_many, lists.f, lists.hyper, ok=flag)
    for a, b in zip(every, before):
        assert bool(cp.array_equal(a, b))
    if counters is not None:
        assert bool(cp.array_equal(lists.c_many, counters))
    K.optimiser_step_many(xs[0], lists.f, xs, dxs, arrays, [[], []], lists.hyper, lists.c_many, ok=cp.array(0.0))
    assert not bool(cp.array_equal(xs[1], before[1]))   # a finite flag: the update runs
