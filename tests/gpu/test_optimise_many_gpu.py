"""The multi-tensor Adam kernel (``adam_update_many``) against the per-parameter CUDA kernel and the CPU.

Against ``adam_update`` the results are compared bit for bit: both kernels run the same per-element code
(``_ADAM_BODY``), and their PTX has the same arithmetic instructions per element. Against the CPU (``Adam`` on
NumPy arrays) float64 agrees to ``rtol=1e-12`` and float32 to ``rtol=1e-5`` (the GPU contracts ``a * b + c`` to
one fused multiply-add, NumPy rounds twice).
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import contextlib
import copy

import numpy as np
import pytest

import fluxpy
from fluxpy import kernels
from fluxpy.kernels import elementwise as E
from fluxpy.optimise import Adam, AdamW, freeze, setup, update
from devices import assert_matches_cpu

pytestmark = pytest.mark.gpu

SIZES = [1, 3, 1000, 4097, 0, 256, 1024, 1025, 7, 0, 65537, 2]
BETA = (0.8, 0.95)
RTOL = {np.float64: 1e-12, np.float32: 1e-5}
ATOL = {np.float64: 1e-14, np.float32: 1e-7}   # for entries near zero (a moment or a parameter that cancels out)


def make_lists(rng, sizes, dtype):
    """x, dx, m, v (v >= 0) for each size, as NumPy arrays."""
    xs = [rng.standard_normal(n).astype(dtype) for n in sizes]
    ms = [(0.1 * rng.standard_normal(n)).astype(dtype) for n in sizes]
    vs = [(0.01 + 0.1 * rng.random(n)).astype(dtype) for n in sizes]
    return xs, ms, vs


def to_gpu(arrays):
    import cupy as cp
    return [cp.asarray(a) for a in arrays]


def copies(arrays):
    return [a.copy() for a in arrays]


def per_parameter(xs, dxs, ms, vs, eta, beta, eps, b1t, b2t):
    """The per-parameter CUDA kernel (adam_update) on each array; the next (b1t, b2t)."""
    import cupy as cp
    out = None
    for x, dx, m, v in zip(xs, dxs, ms, vs):
        out = E.adam_update(x, cp.ascontiguousarray(dx), m, v, eta, beta, eps, b1t, b2t)
    return out


def on_cpu(xs, dxs, ms, vs, eta, beta, eps, b1t, b2t):
    """Adam's CPU step (NumPy) on each array; the next (b1t, b2t)."""
    rule = Adam(eta, beta, eps)
    out = None
    for x, dx, m, v in zip(xs, dxs, ms, vs):
        out = rule.step((m, v, (b1t, b2t)), x, dx)[2]
    return out


def assert_equal_gpu(a, b):
    import cupy as cp
    for p, q in zip(a, b):
        assert p.shape == q.shape
        assert bool(cp.array_equal(p, q)), "not bit for bit the per-parameter kernel's result"


def run_three_ways(sizes, dtype, steps=4, seed=0, strided=()):
    """Steps the same arrays with adam_update_many, adam_update and the CPU; compares after every step."""
    import cupy as cp
    rng = np.random.default_rng(seed)
    xs, ms, vs = make_lists(rng, sizes, dtype)
    many = [to_gpu(xs), to_gpu(ms), to_gpu(vs)]
    each = [to_gpu(xs), to_gpu(ms), to_gpu(vs)]
    cpu = [copies(xs), copies(ms), copies(vs)]
    eta, eps = 0.01, 1e-7
    bt_many = bt_each = bt_cpu = BETA
    powers = cp.array(BETA, dtype=np.float64)   # the device copy of beta^t that the kernel reads and advances
    for _ in range(steps):
        dxs = [rng.standard_normal(n).astype(dtype) for n in sizes]
        dxs_gpu = to_gpu(dxs)
        for k in strided:   # a strided gradient of the same values
            wide = cp.zeros(2 * sizes[k], dtype)
            wide[::2] = dxs_gpu[k]
            dxs_gpu[k] = wide[::2]
            assert not dxs_gpu[k].flags.c_contiguous
        x, m, v = many
        assert kernels.find("adam_update_many", x[0], x, dxs_gpu, m, v) is E.adam_update_many
        bt_many = E.adam_update_many(x, dxs_gpu, m, v, eta, BETA, eps, *bt_many, powers=powers)
        assert powers.tolist() == list(bt_many)   # the same float64 products on both sides
        bt_each = per_parameter(each[0], dxs_gpu, each[1], each[2], eta, BETA, eps, *bt_each)
        bt_cpu = on_cpu(cpu[0], dxs, cpu[1], cpu[2], eta, BETA, eps, *bt_cpu)
        assert bt_many == bt_each == bt_cpu
        for got, want, ref in zip(many, each, cpu):
            assert_equal_gpu(got, want)
            for g, r in zip(got, ref):
                assert_matches_cpu(g, r, rtol=RTOL[dtype], atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_odd_sizes_match_the_per_parameter_kernel_and_the_cpu(dtype):
    run_three_ways(SIZES, dtype, steps=4)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_more_tensors_than_one_launch_takes(dtype):
    rng = np.random.default_rng(1)
    sizes = [int(n) for n in rng.integers(0, 300, 2 * E._MANY_CAP + 17)]   # three launches
    run_three_ways(sizes, dtype, steps=3, seed=2)


def test_strided_gradients_are_copied_first():
    run_three_ways([5, 1000, 3, 4097], np.float64, steps=3, strided=(1, 3))


def test_blocks_stride_over_a_long_list(monkeypatch):
    monkeypatch.setattr(E, "_MANY_MAX_BLOCKS", 3)   # 3 blocks of 1024 elements for ~10k elements
    run_three_ways([1, 3000, 4097, 0, 2500], np.float32, steps=2)
    run_three_ways([1, 3000, 4097, 0, 2500], np.float64, steps=2)


def test_only_empty_tensors_change_nothing_but_the_powers():
    import cupy as cp
    xs = [cp.zeros((0, 3)), cp.zeros(0)]
    assert E.adam_update_many(xs, [cp.zeros((0, 3)), cp.zeros(0)], [cp.zeros((0, 3)), cp.zeros(0)],
                              [cp.zeros((0, 3)), cp.zeros(0)], 0.1, (0.9, 0.99), 1e-8, 0.9, 0.99) == \
        pytest.approx((0.81, 0.99 ** 2))


def test_supports_takes_only_lists_it_can_run():
    import cupy as cp
    a, b = cp.ones((2, 3)), cp.ones((2, 3))
    ok = ([a], [b], [cp.ones((2, 3))], [cp.ones((2, 3))])
    assert E.adam_update_many_supports(a, *ok)
    assert E.adam_update_many_supports(a, [a], [cp.ones((3, 2)).T], [b], [cp.ones((2, 3))])  # strided dx: copied
    refused = {
        "empty": ([], [], [], []),
        "lengths": ([a], [b, b], [b], [b]),
        "numpy": ([a], [np.ones((2, 3))], [b], [b]),
        "dtype": ([a], [b.astype(np.float32)], [b], [b]),
        "float16": ([a.astype(np.float16)], [b.astype(np.float16)], [b.astype(np.float16)], [b.astype(np.float16)]),
        "shape": ([a], [cp.ones(6)], [b], [b]),
        "strided x": ([cp.ones((3, 2)).T], [b], [b], [b]),
        "strided m": ([a], [b], [cp.ones((3, 2)).T], [b]),
    }
    for why, args in refused.items():
        assert not E.adam_update_many_supports(a, *args), why


def model_of(rng, dtype):
    shapes = {"conv": (16, 3, 3, 3), "bn": (16,), "s": (), "empty": (0, 3), "long": (4097,), "dense": (10, 64),
              "odd": (3, 1, 5)}
    return {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}


@contextlib.contextmanager
def spy_on_many():
    """Wraps the registered adam_update_many in a spy recording the number of parameters of each call."""
    calls = []
    real = E.adam_update_many

    def spy(xs, dxs, ms, vs, *args, **kw):
        calls.append(len(xs))
        return real(xs, dxs, ms, vs, *args, **kw)
    before = kernels.snapshot()
    kernels.register("adam_update_many", "cupy", spy, E.adam_update_many_supports)
    try:
        yield calls
    finally:
        kernels.restore(before)


@contextlib.contextmanager
def without_many():
    before = kernels.snapshot()
    kernels.restore({k: v for k, v in before.items() if k[0] != "adam_update_many"})
    try:
        yield
    finally:
        kernels.restore(before)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_update_on_a_cupy_model_launches_the_many_kernel(dtype):
    import cupy as cp
    rng = np.random.default_rng(3)
    cpu_model = model_of(rng, dtype)
    model = fluxpy.gpu(cpu_model)
    each_model = copy.deepcopy(model)
    rule = Adam(0.01, BETA, 1e-7)
    state, each_state, cpu_state = setup(rule, model), setup(rule, each_model), setup(rule, cpu_model)
    for s in (state, each_state, cpu_state):
        freeze(s["odd"])
    for step in range(4):
        grad = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in cpu_model.items()}
        grad["dense"] = np.ascontiguousarray(grad["dense"].T).T   # a transposed gradient, as Dense's can be
        gpu_grad = {k: cp.asarray(v) for k, v in grad.items()}
        gpu_grad["dense"] = cp.asarray(np.ascontiguousarray(grad["dense"].T)).T
        with spy_on_many() as calls:
            update(state, model, gpu_grad)
        assert calls == [6], "one call for the six unfrozen Adam parameters"
        with without_many():
            update(each_state, each_model, gpu_grad)
        update(cpu_state, cpu_model, grad)
        for k in cpu_model:
            m, v, bt = state[k].state
            pairs = ((model[k], each_model[k]), (m, each_state[k].state[0]), (v, each_state[k].state[1]))
            if k == "dense":   # leaf by leaf, a strided gradient takes adam_update's ElementwiseKernel
                for a, b in pairs:
                    assert_matches_cpu(a, cp.asnumpy(b), rtol=4 * float(np.finfo(dtype).eps), atol=ATOL[dtype])
            else:
                for a, b in pairs:
                    assert bool(cp.array_equal(a, b)), k
            assert_matches_cpu(model[k], cpu_model[k], rtol=RTOL[dtype], atol=ATOL[dtype])
            assert_matches_cpu(m, cpu_state[k].state[0], rtol=RTOL[dtype], atol=ATOL[dtype])
            assert_matches_cpu(v, cpu_state[k].state[1], rtol=RTOL[dtype], atol=ATOL[dtype])
            assert bt == each_state[k].state[2] == cpu_state[k].state[2]
        assert state["conv"].state[2] == pytest.approx((BETA[0] ** (step + 2), BETA[1] ** (step + 2)))


def test_adamw_and_mixed_dtypes_make_their_own_groups():
    rng = np.random.default_rng(4)
    cpu_model = {"a": model_of(rng, np.float32), "b": model_of(rng, np.float64), "w": model_of(rng, np.float32)}
    model = fluxpy.gpu(cpu_model)
    state = {"a": setup(Adam(0.01), model["a"]), "b": setup(Adam(0.01), model["b"]),
             "w": setup(AdamW(0.01, lambd=0.1), model["w"])}
    cpu_state = {"a": setup(Adam(0.01), cpu_model["a"]), "b": setup(Adam(0.01), cpu_model["b"]),
                 "w": setup(AdamW(0.01, lambd=0.1), cpu_model["w"])}
    for _ in range(2):
        grad = {k: {n: rng.standard_normal(v.shape).astype(v.dtype) for n, v in sub.items()}
                for k, sub in cpu_model.items()}
        with spy_on_many() as calls:
            update(state, model, fluxpy.gpu(grad))
        assert calls == [7, 7, 7]   # Adam: one per dtype; AdamW a group of its own
        update(cpu_state, cpu_model, grad)
    for k, sub in cpu_model.items():
        dtype = sub["conv"].dtype.type
        for n, want in sub.items():
            assert_matches_cpu(model[k][n], want, rtol=RTOL[dtype], atol=ATOL[dtype])


# -- Descent, Momentum (sgd_update_many) and AdamW (adam_update_many with lambd) -----------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rho", [None, 0.8])   # None: Descent
@pytest.mark.parametrize("sizes", [SIZES, [int(n) for n in np.random.default_rng(3).integers(0, 200, 2 * 96 + 5)]])
def test_sgd_many_matches_the_per_parameter_kernels_bit_for_bit_and_the_cpu(dtype, rho, sizes):
    from fluxpy.optimise import Descent, Momentum
    rng = np.random.default_rng(4)
    xs, _, vs = make_lists(rng, sizes, dtype)
    many, each = (to_gpu(xs), to_gpu(vs)), (to_gpu(xs), to_gpu(vs))
    cpu = (copies(xs), copies(vs))
    rule = Descent(0.05) if rho is None else Momentum(0.05, rho)
    for _ in range(3):
        dxs = [rng.standard_normal(n).astype(dtype) for n in sizes]
        dxs_gpu = to_gpu(dxs)
        v_many = None if rho is None else many[1]
        assert kernels.find("sgd_update_many", many[0][0], many[0], dxs_gpu, v_many) is E.sgd_update_many
        E.sgd_update_many(many[0], dxs_gpu, v_many, 0.05, rho)
        for k, dx in enumerate(dxs_gpu):
            if rho is None:
                E.descent_update(each[0][k], dx, 0.05)
            else:
                E.momentum_update(each[0][k], dx, each[1][k], 0.05, rho)
            state = None if rho is None else cpu[1][k]
            rule.step(state, cpu[0][k], dxs[k])
        for got, want, ref in zip(many, each, cpu):
            assert_equal_gpu(got, want)
            for g, r in zip(got, ref):
                assert_matches_cpu(g, r, rtol=RTOL[dtype], atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_adamw_many_matches_adamw_on_the_cpu(dtype):
    import cupy as cp
    rng = np.random.default_rng(5)
    xs, ms, vs = make_lists(rng, SIZES, dtype)
    gpu = [to_gpu(xs), to_gpu(ms), to_gpu(vs)]
    cpu = [copies(xs), copies(ms), copies(vs)]
    rule = AdamW(0.01, BETA, lambd=0.3, eps=1e-7)
    powers = cp.array(BETA, dtype=np.float64)
    bt = BETA
    for _ in range(4):
        dxs = [rng.standard_normal(n).astype(dtype) for n in SIZES]
        next_bt = E.adam_update_many(*gpu[:1], to_gpu(dxs), *gpu[1:], 0.01, BETA, 1e-7, *bt, powers=powers,
                                     lambd=0.3)
        for k, dx in enumerate(dxs):
            rule.step((cpu[1][k], cpu[2][k], bt), cpu[0][k], dx)
        bt = next_bt
        for got, ref in zip(gpu, cpu):
            for g, r in zip(got, ref):
                assert_matches_cpu(g, r, rtol=RTOL[dtype], atol=ATOL[dtype])


@pytest.mark.parametrize("rule", ["descent", "momentum", "adamw"])
def test_a_guarded_many_update_changes_nothing_when_the_flag_is_not_finite(rule):
    import cupy as cp
    rng = np.random.default_rng(6)
    xs, ms, vs = (to_gpu(a) for a in make_lists(rng, [5, 300], np.float32))
    dxs = to_gpu([rng.standard_normal(n).astype(np.float32) for n in (5, 300)])
    before = [a.copy() for a in xs + ms + vs]
    powers = cp.array(BETA, dtype=np.float64)
    for flag in (cp.array(np.nan), cp.array(np.inf)):
        if rule == "adamw":
            E.adam_update_many(xs, dxs, ms, vs, 0.01, BETA, 1e-7, *BETA, powers=powers, ok=flag, lambd=0.1)
        else:
            E.sgd_update_many(xs, dxs, vs if rule == "momentum" else None, 0.01, 0.9, ok=flag)
    for a, b in zip(xs + ms + vs, before):
        assert bool(cp.array_equal(a, b))
    assert powers.tolist() == list(BETA)
    E.sgd_update_many(xs, dxs, None, 0.01, ok=cp.array(0.0))   # a finite flag: the update runs
    assert not bool(cp.array_equal(xs[1], before[1]))
