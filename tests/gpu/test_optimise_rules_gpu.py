"""The fused per-parameter steps of the Optimisers.jl rules beyond Adam (AdaGrad, AdaDelta, AdaMax, OAdam, NAdam,
RAdam, AdaBelief, Lion, SignDecay, AccumGrad's accumulation; ``fluxpy.kernels.elementwise``) against the rules'
array path on the CPU, several steps on random parameters and gradients.

float64 agrees to ``rtol=1e-11`` and float32 to ``rtol=1e-5`` (the GPU contracts ``a * b + c`` to one fused
multiply-add, NumPy rounds twice; tests/test_optimise_rules_fused.py compiles the same kernel bodies for the host,
without contraction, and asks for the array path bit for bit). float16 parameters take the array path in float32
(as Adam's do: the kernels take float32 and float64 only), apart from AccumGrad's and SignDecay's kernels on the
float32 copies. Also: each step is the one kernel (a spy in the table, and CuPy's compiled kernels), the guarded
kernels change nothing when the step's flag is not finite, the rules with host-side counters refuse a capture, and
train(capture=True) with a guarded rule gives the eager run.
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import contextlib
import copy
import warnings

import numpy as np
import pytest

import fluxpy
from fluxpy import CaptureWarning, Chain, Dense, kernels, logitcrossentropy, relu
from fluxpy import optimise as O
from fluxpy.capturing import CaptureUnsupported, recording
from fluxpy.kernels import elementwise as E
from devices import assert_matches_cpu
from test_optimise_rules_fused import FUSED, KERNEL_OF, RULES

pytestmark = pytest.mark.gpu

RTOL = {np.float64: 1e-11, np.float32: 1e-5, np.float16: 2e-3}
ATOL = {np.float64: 1e-13, np.float32: 1e-6, np.float16: 2e-3}
SHAPES = [(0,), (1,), (7, 5), (4097,), (3, 1, 5, 2)]
STEPS = 9   # RAdam is past its warm-up at t = 5 with beta2 = 0.999


@contextlib.contextmanager
def spies():
    """Every fused rule kernel in the table wrapped in a spy; yields the names of the kernels called, in order."""
    calls = []
    before = kernels.snapshot()

    def spy(name, fn):
        def kernel(*args, **kw):
            calls.append(name + ("_guarded" if kw.get("ok") is not None else ""))
            return fn(*args, **kw)
        return kernel
    for name in FUSED:
        fn, supports = E.KERNELS[name]
        assert kernels.find(name, *[fluxpy.gpu(np.ones(2, np.float32))] * 2) is fn, name   # registered for CuPy
        kernels.register(name, "cupy", spy(name, fn), supports)
    try:
        yield calls
    finally:
        kernels.restore(before)


def state_parts(s, out):
    """The arrays and the host values of a rule's state, in order."""
    if hasattr(s, "shape"):
        out.append(s)
    elif isinstance(s, (tuple, list)):
        for v in s:
            state_parts(v, out)
    else:
        out.append(s)
    return out


def assert_state_matches(gpu, cpu, dtype):
    g, c = state_parts(gpu, []), state_parts(cpu, [])
    assert len(g) == len(c)
    for a, b in zip(g, c):
        if hasattr(b, "shape"):
            # a half parameter's state is float32: the array path on both sides, rounding alike but for a contracted
            # multiply-add of AccumGrad's or SignDecay's kernel
            tol = np.float32 if dtype is np.float16 else dtype
            assert a.dtype == b.dtype
            assert_matches_cpu(a, b, rtol=RTOL[tol], atol=ATOL[tol])
        else:
            assert a == b   # beta^t, counts: the same float64 products on the host


def expected_calls(rule, dtype, steps):
    """The fused kernels ``steps`` updates of one parameter call, by name (for the spies)."""
    half = dtype is np.float16
    if isinstance(rule, O.OptimiserChain):
        first = rule.rules[0]
        n = first.n if type(first) is O.AccumGrad else 1
        out = {}
        if type(first) is O.AccumGrad:
            out["accum_grad_update"] = steps
        if any(type(r) is O.SignDecay for r in rule.rules):
            out["sign_decay_gradient"] = steps // n
        return out
    if type(rule) is O.AccumGrad:
        return {"accum_grad_update": steps}
    if half:
        return {"sign_decay_gradient": steps} if type(rule) is O.SignDecay else {}
    return {KERNEL_OF[type(rule)]: steps}


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_fused_steps_match_the_cpu_array_path(rule, dtype):
    import cupy as cp
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        x = rng.standard_normal(shape).astype(dtype)
        x.reshape(-1)[:3] = 0   # sign(0), for SignDecay
        gx = cp.asarray(x)
        st_cpu, st_gpu = O.setup(rule, x), O.setup(rule, gx)
        with spies() as calls:
            for step in range(STEPS):
                g = rng.standard_normal(shape).astype(dtype)
                g.reshape(-1)[3:5] = 0
                gg = cp.asarray(g)
                if len(shape) == 2 and step % 2:   # a transposed gradient, as a matrix product's can be
                    gg = cp.asarray(np.ascontiguousarray(g.T)).T
                    assert not gg.flags.c_contiguous
                O.update(st_cpu, x, g)
                O.update(st_gpu, gx, gg)
                assert_matches_cpu(gx, x, rtol=RTOL[dtype], atol=ATOL[dtype])
                assert_state_matches(st_gpu.state, st_cpu.state, dtype)
        counted = {name: calls.count(name) for name in set(calls)}
        assert counted == expected_calls(rule, dtype, STEPS), shape


def test_each_rule_compiles_its_own_kernels():
    import cupy as cp
    E._opt_kernels.clear()
    rng = np.random.default_rng(1)
    for rule in RULES:
        x = cp.asarray(rng.standard_normal(6))
        st_ = O.setup(rule, x)
        for _ in range(STEPS):
            O.update(st_, x, cp.asarray(rng.standard_normal(6)))
    assert {"adagrad", "adadelta", "adamax", "oadam", "nadam", "radam_warmup", "radam", "adabelief", "lion",
            "sign_decay", "sign_decay_gradient", "accum_grad_first", "accum_grad"} <= set(E._opt_kernels)
    assert all(type(k) is cp.ElementwiseKernel for k in E._opt_kernels.values())


# -- the guard and the capture ------------------------------------------------------------------------------

def _guarded_call(name, x, dx, states, ok):
    kernel = E.KERNELS[name][0]
    if name == "adagrad_update":
        kernel(x, dx, states[0], 0.1, 1e-8, ok=ok)
    elif name == "adadelta_update":
        kernel(x, dx, states[0], states[1], 0.9, 1e-6, ok=ok)
    elif name == "lion_update":
        kernel(x, dx, states[0], 0.01, (0.9, 0.99), ok=ok)
    else:
        kernel(x, dx, 0.05, ok=ok)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["adagrad_update", "adadelta_update", "lion_update", "sign_decay_update"])
def test_a_guarded_update_changes_nothing_when_the_flag_is_not_finite(name, dtype):
    import cupy as cp
    rng = np.random.default_rng(2)
    x = cp.asarray(rng.standard_normal((33, 7)).astype(dtype))
    dx = cp.asarray(rng.standard_normal((33, 7)).astype(dtype))
    states = [cp.asarray((0.01 + rng.random((33, 7))).astype(dtype)) for _ in range(2)]
    before = [a.copy() for a in [x] + states]
    for flag in (cp.array(np.nan), cp.array(np.inf), cp.array([-np.inf], np.float32)):
        _guarded_call(name, x, dx, states, flag)
        for a, b in zip([x] + states, before):
            assert bool(cp.array_equal(a, b))
    plain = [a.copy() for a in before]
    _guarded_call(name, x, dx, states, cp.array(0.0))        # a finite flag: the step runs
    _guarded_call(name, plain[0], dx, plain[1:], None)        # as the unguarded kernel runs it, bit for bit
    assert not bool(cp.array_equal(x, before[0]))
    for a, b in zip([x] + states, plain):
        assert bool(cp.array_equal(a, b))


def test_which_rules_step_guarded():
    import cupy as cp
    x32, x16 = cp.ones((2, 3), np.float32), cp.ones((2, 3), np.float16)
    for rule in (O.AdaGrad(), O.AdaDelta(), O.Lion(), O.SignDecay()):
        assert rule.guarded_kernel(x32, x32) and not rule.guarded_kernel(x16, x16), rule
    for rule in (O.AdaMax(), O.OAdam(), O.NAdam(), O.RAdam(), O.AdaBelief(), O.AccumGrad(2)):
        assert not rule.guarded_kernel(x32, x32), rule


@pytest.mark.parametrize("rule", [O.AdaMax(0.01), O.OAdam(0.01), O.NAdam(0.01), O.RAdam(0.01), O.AdaBelief(0.01),
                                  O.OptimiserChain(O.AccumGrad(2), O.Descent(0.1))], ids=repr)
def test_rules_with_host_counters_refuse_a_capture_before_any_change(rule):
    import cupy as cp
    x = cp.asarray(np.random.default_rng(3).standard_normal(6))
    state = O.setup(rule, x)
    O.update(state, x, cp.ones(6))
    before = [a.copy() if hasattr(a, "shape") else a for a in state_parts((x, state.state), [])]
    with spies() as calls, recording(), pytest.raises(CaptureUnsupported, match="host-side counters"):
        O.update(state, x, cp.ones(6))
    assert calls == []
    for a, b in zip(state_parts((x, state.state), []), before):
        assert bool(cp.array_equal(a, b)) if hasattr(b, "shape") else a == b


def _net(rng):
    return Chain(Dense(20, 32, relu, rng=rng), Dense(32, 10, rng=rng))


def _batches(n, batch, seed):
    import cupy as cp
    rng = np.random.default_rng(seed)
    return [(cp.asarray(rng.standard_normal((batch, 20), dtype=np.float32)),
             cp.asarray(fluxpy.onehotbatch(rng.integers(0, 10, batch), range(10)))) for _ in range(n)]


def _loss(m, x, y):
    return logitcrossentropy(m(x), y)


def _assert_same_arrays(a, b):
    import cupy as cp
    for x, y in zip(fluxpy.trainables(a), fluxpy.trainables(b)):
        np.testing.assert_array_equal(cp.asnumpy(x), cp.asnumpy(y))


@pytest.mark.parametrize("rule", [O.AdaGrad(0.01), O.AdaDelta(), O.Lion(1e-3)], ids=repr)
def test_train_with_capture_and_a_guarded_rule_gives_the_eager_run(rule):
    model = _net(np.random.default_rng(4))
    batches = _batches(12, 16, 4)
    captured, eager = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)   # the rule's update is one guarded launch per parameter
        got = fluxpy.train(_loss, captured, batches, O.setup(rule, captured), progress=False, capture=True)
    want = fluxpy.train(_loss, eager, batches, O.setup(rule, eager), progress=False)
    assert got == want
    _assert_same_arrays(captured, eager)


def test_train_with_capture_and_a_counting_rule_warns_and_runs_eagerly():
    model = _net(np.random.default_rng(5))
    batches = _batches(6, 16, 5)
    captured, eager = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    rule = O.NAdam(1e-3)
    with pytest.warns(CaptureWarning):
        got = fluxpy.train(_loss, captured, batches, O.setup(rule, captured), progress=False, capture=True)
    want = fluxpy.train(_loss, eager, batches, O.setup(rule, eager), progress=False)
    assert got == want
    _assert_same_arrays(captured, eager)
