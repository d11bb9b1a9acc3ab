"""Every exported rule (and chains) on the GPU: the kernels generated from its formula (``optimiser_step_many`` for
dense parameters, ``optimiser_step`` otherwise, ``optimiser_advance`` for the counters) against the rule's NumPy
path on the CPU, several steps on random parameters and gradients; the guard; and a captured TrainStep and
``train(capture=True)`` with each rule against eager steps, with no CaptureWarning (no rule refuses a capture).

float64 agrees to ``rtol=1e-11`` and float32 to ``rtol=1e-5`` (the GPU contracts ``a * b + c`` to one fused
multiply-add, NumPy rounds twice; tests/test_optimise_rules_fused.py compiles the same generated C for the host,
without contraction, and asks for the NumPy path bit for bit). A float16 parameter's multi-tensor step computes in
float32 with a float32 state and rounds once, as its NumPy path does; a strided float16 parameter takes the NumPy
path (the per-parameter kernel takes float32 and float64). The counters on the host equal the CPU's exactly.
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import contextlib
import copy
import warnings

import numpy as np
import pytest

import fluxpy
from fluxpy import CaptureWarning, Chain, Dense, TrainStep, kernels, logitcrossentropy, relu
from fluxpy import optimise as O
from fluxpy.capturing import guarding
from fluxpy.kernels import cuda_optimise as K
from fluxpy.options import options
from fluxpy.optimise.rules import formula_of
from devices import assert_matches_cpu
from test_optimise_rules_fused import RULES

pytestmark = pytest.mark.gpu

RTOL = {np.float64: 1e-11, np.float32: 1e-5, np.float16: 2e-3}
ATOL = {np.float64: 1e-13, np.float32: 1e-6, np.float16: 2e-3}
SHAPES = [(0,), (1,), (7, 5), (4097,), (3, 1, 5, 2)]
STEPS = 9   # RAdam is past its warm-up at t = 5 with beta2 = 0.999
NAMES = ("optimiser_step", "optimiser_step_many", "optimiser_advance")


@pytest.fixture(autouse=True)
def _deterministic_cudnn():
    with options(deterministic=True):
        yield


@contextlib.contextmanager
def spies():
    """The generated kernels in the table wrapped in spies; yields the names called, in order."""
    calls = []
    before = kernels.snapshot()

    def spy(name, fn):
        def kernel(*args, **kw):
            calls.append(name + ("_guarded" if kw.get("ok") is not None else ""))
            return fn(*args, **kw)
        return kernel
    for name in NAMES:
        fn, supports = K.KERNELS[name]
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
    tol = np.float32 if dtype is np.float16 else dtype
    for a, b in zip(g, c):
        if hasattr(b, "shape"):
            assert a.dtype == b.dtype
            assert_matches_cpu(a, fluxpy.cpu(b), rtol=RTOL[tol], atol=ATOL[tol])   # b may be on the GPU too
        else:
            assert a == b and type(a) is type(b)   # beta^t, counts: the same float64 arithmetic on the host


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_fused_steps_match_the_cpu_numpy_path(rule, dtype):
    import cupy as cp
    rng = np.random.default_rng(0)
    counted = bool(formula_of(rule).counters)
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
        assert calls.count("optimiser_step_many") == STEPS, shape   # float16 too: computed in float32
        assert calls.count("optimiser_advance") == (STEPS if counted else 0), shape


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_the_per_parameter_kernel_matches_the_cpu_on_a_strided_parameter(rule):
    import cupy as cp
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 5))
    wide = cp.zeros((6, 10))
    gx = wide[:, ::2]   # a parameter the multi-tensor kernel does not take: the per-parameter one steps it
    gx[...] = cp.asarray(x)
    st_cpu, st_gpu = O.setup(rule, x), O.setup(rule, gx)
    with spies() as calls:
        for _ in range(STEPS):
            g = rng.standard_normal((6, 5))
            O.update(st_cpu, x, g)
            O.update(st_gpu, gx, cp.asarray(g))
    assert calls.count("optimiser_step") == STEPS
    assert_matches_cpu(gx, x, rtol=RTOL[np.float64], atol=ATOL[np.float64])
    assert_state_matches(st_gpu.state, st_cpu.state, np.float64)


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_a_guarded_step_changes_nothing_when_the_flag_is_not_finite(rule):
    import cupy as cp
    rng = np.random.default_rng(2)
    x = cp.asarray(rng.standard_normal((33, 7)))
    state = O.setup(rule, x)
    for _ in range(2):
        O.update(state, x, cp.asarray(rng.standard_normal((33, 7))))
    arrays = [a.copy() for a in state_parts((x, state.state), []) if hasattr(a, "shape")]
    device = None if state._counters is None else state._counters[0].copy()
    g = cp.asarray(rng.standard_normal((33, 7)))
    with spies() as calls:
        for flag in (cp.array(np.nan), cp.array(np.inf), cp.array([-np.inf], np.float32)):
            with guarding(flag):
                O.update(state, x, g)
    assert "optimiser_step_many_guarded" in calls
    for a, b in zip([a for a in state_parts((x, state.state), []) if hasattr(a, "shape")], arrays):
        assert bool(cp.array_equal(a, b))
    if device is not None:
        assert bool(cp.array_equal(state._counters[0], device))


# -- captured steps ------------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_a_captured_trainstep_with_each_rule_replays_the_eager_steps(rule):
    model = _net(np.random.default_rng(4))
    batches = _batches(10, 16, 4)
    captured_model, eager_model = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    captured = TrainStep(_loss, captured_model, O.setup(rule, captured_model))
    eager = TrainStep(_loss, eager_model, O.setup(rule, eager_model), capture=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)   # no rule refuses the capture
        got = [float(captured(*b)) for b in batches]
    want = [float(eager(*b)) for b in batches]
    assert set(captured.captured().values()) == {"captured"}
    assert got == want
    _assert_same_arrays(captured_model, eager_model)
    for a, b in zip(O.Plan.leaves(captured.opt_state), O.Plan.leaves(eager.opt_state)):
        assert_state_matches(a.state, b.state, np.float64)   # the host's counters advanced with the replays


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_train_with_capture_and_each_rule_gives_the_eager_run(rule):
    model = _net(np.random.default_rng(5))
    batches = _batches(8, 16, 5)
    captured, eager = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        got = fluxpy.train(_loss, captured, batches, O.setup(rule, captured), progress=False, capture=True)
    want = fluxpy.train(_loss, eager, batches, O.setup(rule, eager), progress=False, capture=False)
    assert got == want
    _assert_same_arrays(captured, eager)


def test_train_with_capture_and_clipnorm_stops_where_the_eager_train_stops():
    """ClipNorm's check is the step's guard inside a capture: a non-finite gradient skips the update on the device,
    and the eager step train then runs raises as the eager train does."""
    import cupy as cp
    rule = O.OptimiserChain(O.ClipNorm(1.0), O.WeightDecay(0.01), O.Adam(1e-3))
    batches = _batches(8, 16, 6)
    bad = (cp.full_like(batches[5][0], np.nan), batches[5][1])
    batches[5] = bad
    results = []
    for capture in (True, False):
        model = fluxpy.gpu(_net(np.random.default_rng(6)))
        with pytest.raises(FloatingPointError) as err:
            fluxpy.train(_loss, model, batches, O.setup(rule, model), progress=False, capture=capture)
        results.append((str(err.value), [cp.asnumpy(a) for a in fluxpy.trainables(model)]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)
