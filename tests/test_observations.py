"""MLUtils' observation functions (fluxpy.observations): partitions that cover every observation once, structure
kept through tuples and dicts, lazy views, and clear errors."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import batch, chunk, getobs, kfolds, mapobs, numobs, shuffleobs, splitobs, unbatch


def _data(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 3)), {"label": np.arange(n), "w": rng.random(n)})


def _rows(view):
    """The observation numbers in a view of :func:`_data` (its labels)."""
    return list(getobs(view, slice(None))[1]["label"]) if len(view) else []


@given(n=st.integers(1, 30), seed=st.integers(0, 2**31 - 1),
       at=st.one_of(st.floats(0.05, 0.95), st.tuples(st.floats(0.05, 0.45), st.floats(0.05, 0.45))),
       shuffle=st.booleans())
def test_splitobs_covers_every_observation_once(n, seed, at, shuffle):
    data = _data(n, seed)
    parts = splitobs(data, at=at, shuffle=shuffle, rng=seed)
    seen = [i for p in parts for i in _rows(p)]
    assert sorted(seen) == list(range(n))
    if not shuffle:
        assert seen == list(range(n))
    assert len(parts) == (2 if isinstance(at, float) else 3)
    assert len(parts[0]) == round((at if isinstance(at, float) else at[0]) * n)


@given(n=st.integers(2, 25), k=st.integers(2, 25))
def test_kfolds_validate_each_observation_once(n, k):
    if k > n:
        with pytest.raises(ValueError, match="kfolds expects k"):
            kfolds(np.arange(n), k)
        return
    folds = kfolds(np.arange(n), k)
    validated = [i for _, v in folds for i in getobs(v, slice(None))]
    assert validated == list(range(n))
    for train, val in folds:
        assert sorted(list(getobs(train, slice(None))) + list(getobs(val, slice(None)))) == list(range(n))
    sizes = [len(v) for _, v in folds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@given(n=st.integers(0, 20), parts=st.integers(1, 6), size=st.integers(1, 6))
def test_chunk_partitions_in_order(n, parts, size):
    x = np.arange(n)
    by_n = chunk(x, parts)
    assert [i for c in by_n for i in getobs(c, slice(None))] == list(range(n))
    assert all(abs(len(a) - len(b)) <= 1 for a in by_n for b in by_n)
    by_size = chunk(x, size=size)
    assert [len(c) for c in by_size[:-1]] == [size] * (len(by_size) - 1)
    assert [i for c in by_size for i in getobs(c, slice(None))] == list(range(n))


@given(n=st.integers(1, 10), seed=st.integers(0, 2**31 - 1))
def test_batch_and_unbatch_are_inverse_and_keep_the_structure(n, seed):
    data = _data(n, seed)
    again = batch(unbatch(data))
    np.testing.assert_array_equal(again[0], data[0])
    np.testing.assert_array_equal(again[1]["label"], data[1]["label"])
    assert numobs(data) == n and len(unbatch(data)) == n


def test_shuffleobs_and_mapobs_are_lazy_views():
    x = np.arange(6) * 10
    s = shuffleobs(x, rng=1)
    assert sorted(getobs(s, slice(None)).tolist()) == x.tolist() and len(s) == 6
    m = mapobs(lambda v: v + 1, s)
    assert [m[i] for i in range(6)] == [s[i] + 1 for i in range(6)]
    loader = fluxpy.DataLoader(batch([m[i] for i in range(6)]), batchsize=3)
    assert sum(len(b) for b in loader) == 6


def test_sequences_of_observations():
    items = [f"item{i}" for i in range(5)]
    assert numobs(items) == 5 and getobs(items, [3, 1]) == ["item3", "item1"]
    assert [len(p) for p in splitobs(items, at=0.6)] == [3, 2]


def test_errors_are_named():
    with pytest.raises(ValueError, match="as many observations each"):
        numobs((np.ones(3), np.ones(4)))
    with pytest.raises(ValueError, match="splitobs expects at"):
        splitobs(np.arange(4), at=(0.6, 0.5))
    with pytest.raises(IndexError, match="getobs: observation 5 of 3"):
        getobs(np.arange(3), 5)
    with pytest.raises(TypeError, match="numobs expects"):
        numobs(3)
    with pytest.raises(ValueError, match="batch expects observations of one shape"):
        batch([np.ones(2), np.ones(3)])
    with pytest.raises(ValueError, match="either n"):
        chunk(np.arange(3))
    with pytest.raises(TypeError, match="mapobs expects a function"):
        mapobs(np.arange(3), lambda v: v)
