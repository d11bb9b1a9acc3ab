"""tests/sweeps.py, the GPU suite's budget: the default subset of a sweep keeps every value and every pair of
values, and the full run keeps everything."""
import itertools
import random

import pytest

import sweeps


def _facts(cases):
    return set().union(*(sweeps._facts(c) for c in cases))


@pytest.mark.parametrize("seed", range(6))
def test_cover_keeps_every_value_and_pair_of_a_random_grid(seed):
    rng = random.Random(seed)
    lists = [[f"v{i}{j}" for j in range(rng.randint(1, 6))] for i in range(rng.randint(1, 5))]
    cases = list(itertools.product(*lists))
    rng.shuffle(cases)
    kept = sweeps.cover(cases)
    assert _facts(kept) == _facts(cases)
    assert [c for c in cases if c in kept] == kept, "in the given order"
    assert len(kept) <= len(cases)
    if len(lists) >= 3 and min(map(len, lists)) >= 2:
        assert len(kept) < len(cases)


def test_cover_handles_unhashable_values_and_an_explicit_case_list():
    cases = [(dict(stride=s), [p], p) for s in (1, 2) for p in (0, 1, 2)]
    assert _facts(sweeps.cover(cases)) == _facts(cases)


def test_sweep_marks_the_cases_outside_the_cover_full(monkeypatch):
    rng = random.Random(4)
    lists = [list(range(rng.randint(2, 4))) for _ in range(4)]
    params = sweeps.sweep(*lists)
    assert [p.values for p in params] == list(itertools.product(*lists))
    default = [p.values for p in params if not p.marks]
    assert default == sweeps.cover(itertools.product(*lists))
    assert all(p.marks == (sweeps.FULL,) for p in params if p.values not in default)
    monkeypatch.setenv("FLUXPY_TEST_PROFILE", "full")
    assert sweeps.grid(itertools.product(*lists)) == list(itertools.product(*lists))
    monkeypatch.delenv("FLUXPY_TEST_PROFILE")
    assert sweeps.grid(itertools.product(*lists)) == default


def test_examples_are_few_by_default_and_all_in_a_full_run(monkeypatch):
    monkeypatch.delenv("FLUXPY_TEST_PROFILE", raising=False)
    assert sweeps.examples(60).max_examples == sweeps.GPU_EXAMPLES
    assert sweeps.examples(3).max_examples == 3
    assert sweeps.examples(12, default=4).max_examples == 4
    assert sweeps.examples(60).deadline is None
    monkeypatch.setenv("FLUXPY_TEST_PROFILE", "full")
    assert sweeps.examples(60).max_examples == 60
