"""Learning-rate schedules (fluxpy/schedules.py): their values, their bounds, their errors, and use with adjust."""
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fluxpy.optimise import Momentum, OptimiserChain, WeightDecay, adjust, setup
from fluxpy import schedules as S
from fluxpy.schedules import Constant, Cosine, Step


def test_step_every_k():
    s = Step(0.1, 0.5, 3)
    assert [s(t) for t in range(1, 10)] == [0.1] * 3 + [0.05] * 3 + [0.025] * 3
    assert s(np.int64(4)) == 0.05


def test_step_stages_as_he_et_al():
    s = Step(0.1, 0.1, [80, 40])
    assert s(1) == s(80) == 0.1
    assert math.isclose(s(81), 0.01) and math.isclose(s(120), 0.01)
    assert math.isclose(s(121), 0.001) and math.isclose(s(10_000), 0.001)
    assert s.step_sizes == (80, 40)


@given(start=st.floats(1e-4, 1.0), decay=st.floats(0.01, 1.0), sizes=st.lists(st.integers(1, 5), min_size=1,
                                                                               max_size=4))
def test_step_decays_once_at_the_end_of_each_stage(start, decay, sizes):
    s = Step(start, decay, sizes)
    values = [s(t) for t in range(1, sum(sizes) + 4)]
    ends = np.cumsum(sizes)
    for t, value in enumerate(values, start=1):
        assert math.isclose(value, start * decay ** int(np.sum(ends < t)), rel_tol=1e-12)


def test_cosine_values():
    s = Cosine(1.0, 0.1, 5)
    values = [s(t) for t in range(1, 8)]
    assert values[0] == 1.0 and values[4] == values[5] == values[6] == 0.1
    assert math.isclose(values[2], 0.55)                                  # the midpoint
    assert all(a > b for a, b in zip(values[:4], values[1:5]))
    assert Cosine(0.3, 0.0, 1)(1) == 0.3 and Cosine(0.3, 0.0, 1)(2) == 0.0


def test_cosine_warmup_rises_linearly_to_start():
    s = Cosine(0.5, 0.0, 4, warmup=4)
    assert [round(s(t), 10) for t in range(1, 6)] == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert s(8) == 0.0


@given(start=st.floats(1e-4, 1.0), ratio=st.floats(0.0, 1.0), period=st.integers(1, 20), warmup=st.integers(0, 5))
def test_cosine_bounds(start, ratio, period, warmup):
    stop = start * ratio
    s = Cosine(start, stop, period, warmup=warmup)
    values = [s(t) for t in range(1, warmup + period + 3)]
    assert all(0 < v <= start for v in values[:warmup])
    assert all(a < b for a, b in zip(values[:warmup], values[1:warmup + 1]))
    assert values[warmup] == start
    annealing = values[warmup:warmup + period]
    assert all(stop - 1e-12 <= v <= start + 1e-12 for v in annealing)
    assert all(a >= b - 1e-12 for a, b in zip(annealing, annealing[1:]))
    assert period == 1 or math.isclose(annealing[-1], stop, abs_tol=1e-12)
    assert values[-1] == stop


def test_constant():
    assert [Constant(0.01)(t) for t in (1, 2, 100)] == [0.01] * 3


def test_schedules_are_immutable_and_print_as_built():
    s = Cosine(0.1, 0.0, 30, warmup=2)
    assert repr(s) == "Cosine(start=0.1, stop=0.0, period=30, warmup=2)"
    assert s == Cosine(0.1, 0.0, 30, warmup=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.start = 1.0


@pytest.mark.parametrize("make,message", [
    (lambda: Step(0.0, 0.1, 2), "Step expects start to be a finite number > 0, got 0.0"),
    (lambda: Step(0.1, -1, 2), "Step expects decay to be a finite number > 0, got -1"),
    (lambda: Step(0.1, 0.1, 0), "Step expects step_sizes to be an int >= 1 or a non-empty sequence of them, got 0"),
    (lambda: Step(0.1, 0.1, []), "got []"),
    (lambda: Step(0.1, 0.1, [2.5]), "got [2.5]"),
    (lambda: Cosine(float("nan"), 0.0, 3), "Cosine expects start to be a finite number > 0, got nan"),
    (lambda: Cosine(0.1, -0.1, 3), "Cosine expects stop to be a finite number >= 0, got -0.1"),
    (lambda: Cosine(0.1, 0.0, 0), "Cosine expects period to be an int >= 1, got 0"),
    (lambda: Cosine(0.1, 0.0, 3, warmup=-1), "Cosine expects warmup to be an int >= 0, got -1"),
    (lambda: Constant(True), "Constant expects value to be a finite number >= 0, got True"),
])
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value)


@pytest.mark.parametrize("t", [0, -1, 1.0, True, "1"])
def test_t_counts_from_one(t):
    with pytest.raises(ValueError, match=r"Step\(start=0.1, decay=0.5, step_sizes=2\) expects t to be an int >= 1 "
                                         r"\(the first epoch or step is 1\), got "):
        Step(0.1, 0.5, 2)(t)


def test_with_adjust_each_epoch():
    model = {"w": np.ones(3)}
    state = setup(OptimiserChain(WeightDecay(1e-4), Momentum(0.1, 0.9)), model)
    schedule = Cosine(0.1, 0.0, 3)
    seen = []
    for epoch in range(1, 4):
        adjust(state, schedule(epoch))
        seen.append(state["w"].rule.rules[1].eta)
    np.testing.assert_allclose(seen, [0.1, 0.05, 0.0], atol=1e-15)
    assert state["w"].rule.rules[0].lambd == 1e-4                        # the rest of the chain untouched


# PyTorch's schedulers transcribed as the loops they run (torch/optim/lr_scheduler.py), step k counted from 0 = t - 1


def _torch_one_cycle(total, peak, start_div, final_div, pct):
    initial, low = peak / start_div, peak / start_div / final_div
    phases = [(float(pct * total) - 1, initial, peak), (total - 1, peak, low)]
    out = []
    for k in range(total):
        start_step = 0
        for i, (end_step, a, b) in enumerate(phases):
            if k <= end_step or i == len(phases) - 1:
                frac = (k - start_step) / (end_step - start_step)
                out.append(b + (a - b) / 2 * (math.cos(math.pi * frac) + 1))
                break
            start_step = end_step
    return out


def _torch_warm_restarts(start, stop, t0, mult, n):
    out, t_cur, t_i = [], 0, t0
    for _ in range(n):
        out.append(stop + (start - stop) * (1 + math.cos(math.pi * t_cur / t_i)) / 2)
        t_cur += 1
        if t_cur >= t_i:
            t_cur, t_i = t_cur - t_i, t_i * mult
    return out


def _torch_cyclic(base, peak, step_size, n):
    out = []
    for k in range(n):
        cycle = math.floor(1 + k / (2 * step_size))
        x = abs(k / step_size - 2 * cycle + 1)
        out.append(base + (peak - base) * max(0.0, 1 - x))
    return out


def _torch_plateau(start, factor, patience, threshold, cooldown, floor, losses):
    lr, best, bad, wait, out = start, math.inf, 0, 0, []
    for loss in losses:
        if loss < best * (1 - threshold):
            best, bad = loss, 0
        else:
            bad += 1
        if wait > 0:
            wait, bad = wait - 1, 0
        if bad > patience:
            lr, wait, bad = max(lr * factor, floor), cooldown, 0
        out.append(lr)
    return out


@given(total=st.integers(2, 40), peak=st.floats(0.01, 10), start_div=st.floats(1.5, 50), final_div=st.floats(1.5, 1e4),
       pct=st.floats(0.05, 0.95))
def test_one_cycle_is_pytorchs(total, peak, start_div, final_div, pct):
    s = S.OneCycle(total, peak, start_div=start_div, final_div=final_div, pct_start=pct)
    if float(pct * total) - 1 <= 0:
        return   # PyTorch divides by zero there; ours starts at the peak
    np.testing.assert_allclose([s(t) for t in range(1, total + 1)],
                               _torch_one_cycle(total, peak, start_div, final_div, pct), rtol=1e-12)


@given(start=st.floats(0.01, 1), stop=st.floats(0, 0.009), t0=st.integers(1, 6), mult=st.integers(1, 3))
def test_cosine_restarts_are_pytorchs(start, stop, t0, mult):
    s = S.CosineRestarts(start, stop, t0, mult=mult)
    np.testing.assert_allclose([s(t) for t in range(1, 40)], _torch_warm_restarts(start, stop, t0, mult, 39),
                               rtol=1e-12, atol=1e-15)


@given(base=st.floats(0, 1), peak=st.floats(1, 2), half=st.integers(1, 6))
def test_triangle_is_pytorchs_triangular_cycle(base, peak, half):
    s = S.Triangle(base, peak, 2 * half)
    np.testing.assert_allclose([s(t) for t in range(1, 30)], _torch_cyclic(base, peak, half, 29), rtol=1e-12,
                               atol=1e-15)


@given(losses=st.lists(st.floats(0.1, 2), min_size=1, max_size=30), patience=st.integers(0, 3),
       cooldown=st.integers(0, 2), factor=st.sampled_from([0.1, 0.5]))
def test_reduce_on_plateau_is_pytorchs(losses, patience, cooldown, factor):
    plateau = S.ReduceOnPlateau(1.0, factor=factor, patience=patience, cooldown=cooldown, floor=1e-3)
    np.testing.assert_allclose([plateau(v) for v in losses],
                               _torch_plateau(1.0, factor, patience, 1e-4, cooldown, 1e-3, losses), rtol=1e-12)


@given(degree=st.floats(0.5, 3), n=st.integers(1, 10))
def test_poly_is_pytorchs_polynomial_decay(degree, n):
    s = S.Poly(2.0, degree, n)
    np.testing.assert_allclose([s(t) for t in range(1, n + 4)],
                               [2.0 * (1 - min(n, k) / n) ** degree for k in range(n + 3)], rtol=1e-12)


def test_sequence_early_stopping_and_errors():
    warm_then_cosine = S.Sequence([lambda t: 0.1 * t, S.Cosine(0.3, 0.0, 3)], [2, 3])
    assert [round(warm_then_cosine(t), 6) for t in range(1, 7)] == [0.1, 0.2, 0.3, 0.15, 0.0, 0.0]
    stop = S.EarlyStopping(patience=2, mode="max", min_delta=0.01)
    assert [stop(a) for a in (0.5, 0.6, 0.605, 0.61, 0.7)] == [False, False, False, True, False]
    with pytest.raises(ValueError, match="Sequence expects schedules"):
        S.Sequence([S.Constant(1.0)], [1, 2])
    with pytest.raises(ValueError, match="ReduceOnPlateau expects factor"):
        S.ReduceOnPlateau(0.1, factor=2)
    with pytest.raises(TypeError, match="EarlyStopping expects a measured number"):
        S.EarlyStopping()("x")
    with pytest.raises(ValueError, match="Triangle expects period to be an int >= 2"):
        S.Triangle(0.0, 1.0, 1)
