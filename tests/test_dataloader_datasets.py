"""DataLoader over what Flux's (MLUtils) and PyTorch's take: dataset objects (``__len__``/``__getitem__``), lists of
``(x, y)`` pairs, dicts of arrays, ``collate``, ``drop_last``, and loading in worker threads (same batches, same
order, a bounded number ahead, errors at their batch, no thread left behind)."""
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
import fluxpy.data as data
from fluxpy import DataLoader


class Squares:
    """A PyTorch-style map dataset: observation i is (features, label), computed when asked for."""

    def __init__(self, n, dim=3, seed=0):
        self.x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
        self.calls = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.calls.append(i)
        return self.x[i] ** 2, int(i) % 3


def _same(a, b):
    """Batches equal in structure, dtype and values."""
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b)


def test_a_dataset_object_gives_collated_batches():
    ds = Squares(7)
    batches = list(DataLoader(ds, batchsize=3))
    assert [tuple(np.shape(p) for p in b) for b in batches] == [((3, 3), (3,)), ((3, 3), (3,)), ((1, 3), (1,))]
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    np.testing.assert_array_equal(x, ds.x ** 2)
    assert x.dtype == np.float32 and y.dtype.kind == "i" and y.tolist() == [i % 3 for i in range(7)]
    assert sorted(ds.calls) == list(range(7))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 23), batchsize=st.integers(1, 8), shuffle=st.booleans(), partial=st.booleans(),
       workers=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_a_list_of_pairs_batches_as_the_arrays_do(n, batchsize, shuffle, partial, workers, seed):
    """A list of (x, y) pairs, a dataset object and the arrays (x, y): the same batches in the same order, with the
    same seed, threads or not."""
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((n, 2, 3)), rng.integers(0, 10, n)
    pairs = [(x[i], y[i]) for i in range(n)]
    kw = dict(batchsize=batchsize, shuffle=shuffle, partial=partial, rng=seed)
    want = list(DataLoader((x, y), **kw))
    assert len(want) == len(DataLoader(pairs, **kw))
    for got in (list(DataLoader(pairs, workers=workers, **kw)), list(DataLoader(fluxpy.obsview(pairs_ds(pairs),
                                                                                                 range(n)), **kw))):
        assert len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))


def pairs_ds(pairs):
    class Pairs:
        def __len__(self):
            return len(pairs)

        def __getitem__(self, i):
            return pairs[i]
    return Pairs()


def test_dict_data_and_dict_observations():
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((5, 2)), rng.integers(0, 4, 5)
    batches = list(DataLoader({"x": x, "y": y}, batchsize=2))
    assert [sorted(b) for b in batches] == [["x", "y"]] * 3
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), x)
    observations = [{"x": x[i], "y": y[i]} for i in range(5)]
    for a, b in zip(DataLoader(observations, batchsize=2), batches):
        assert _same(a, b)
    assert "{(5, 2), (5,)}" in repr(DataLoader({"x": x, "y": y}))
    with pytest.raises(ValueError, match="at least one array, got an empty dict"):
        DataLoader({})
    with pytest.raises(ValueError, match=r"same number of observations on axis 0, got shapes \[\(5, 2\), \(4,\)\]"):
        DataLoader({"x": x, "y": y[:4]})


def test_mlutils_views_are_datasets():
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((10, 3)), np.arange(10)
    train, test = fluxpy.splitobs((x, y), at=0.7)
    got = list(DataLoader(test, batchsize=2))
    assert _same(got[0], (x[7:9], y[7:9])) and _same(got[1], (x[9:], y[9:]))
    doubled = fluxpy.mapobs(lambda o: (2 * o[0], o[1]), (x, y))
    xb, yb = next(iter(DataLoader(doubled, batchsize=4, shuffle=True, rng=0)))
    order = np.random.default_rng(0).permutation(10)[:4]
    np.testing.assert_array_equal(xb, 2 * x[order])
    np.testing.assert_array_equal(yb, order)


def test_collate_false_and_functions():
    ds = Squares(5)
    lists = list(DataLoader(ds, batchsize=2, collate=False))
    assert [len(b) for b in lists] == [2, 2, 1] and all(isinstance(b, list) for b in lists)
    assert _same(lists[1][0], ds[2])
    x = np.arange(10).reshape(5, 2)
    assert _same(list(DataLoader(x, batchsize=4, collate=False))[0], [x[0], x[1], x[2], x[3]])
    seen = []

    def count(observations):
        seen.append(len(observations))
        return len(observations)
    assert list(DataLoader((x, x[:, 0]), batchsize=2, collate=count)) == [2, 2, 1] and seen == [2, 2, 1]
    assert "collate=count" in repr(DataLoader(x, collate=count))
    ragged = [np.ones(n) for n in (3, 1, 2)]
    padded = list(DataLoader(ragged, batchsize=3, collate=lambda obs: np.stack(
        [np.pad(o, (0, 3 - len(o))) for o in obs])))
    np.testing.assert_array_equal(padded[0], [[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="DataLoader expects collate to be True, False or a function"):
            DataLoader(x, collate=bad)


def test_observations_that_do_not_collate_are_clear_errors():
    with pytest.raises(ValueError, match=r"DataLoader cannot collate the observations \[2, 3\] into a batch: "
                                         r"observation 3\[0\] has shape \(4,\), observation 2\[0\] has shape \(3,\)"):
        list(DataLoader([(np.ones(3), 0)] * 3 + [(np.ones(4), 1)], batchsize=2))
    with pytest.raises(ValueError, match=r"observation 1 is a ndarray of shape \(3,\) float64, observation 0 a "
                                         r"tuple of length 2"):
        list(DataLoader([(np.ones(3), 0), np.ones(3)], batchsize=2))
    with pytest.raises(ValueError, match=r"observation 1 is a dict of length 1, observation 0 a dict of length 2"):
        list(DataLoader([{"a": 1, "b": 2}, {"a": 1}], batchsize=2))
    with pytest.raises(ValueError, match=r"observations of type NoneType, int stack only into an array of Python "
                                         r"objects"):
        list(DataLoader([(np.ones(2), None), (np.ones(2), 1)], batchsize=2))
    with pytest.raises(ValueError, match="collate=False gives that list") as err:
        list(DataLoader([(np.ones(3), [1, 2]), (np.ones(3), [1])], batchsize=2))
    assert len(str(err.value)) < 500


def test_drop_last_is_partial_false():
    x = np.arange(7)
    assert [b.tolist() for b in DataLoader(x, batchsize=3, drop_last=True)] == [[0, 1, 2], [3, 4, 5]]
    assert len(DataLoader(x, batchsize=3, drop_last=False)) == 3
    assert len(DataLoader(x, batchsize=3, partial=False, drop_last=True)) == 2
    for partial, drop_last in ((True, True), (False, False)):
        with pytest.raises(ValueError, match=rf"partial={partial} and drop_last={drop_last}, which disagree"):
            DataLoader(x, partial=partial, drop_last=drop_last)
    with pytest.raises(TypeError, match="drop_last to be True or False, got str 'no'"):
        DataLoader(x, drop_last="no")


def test_workers_and_parallel_options():
    x = np.arange(4)
    assert DataLoader(x).workers == 0 and DataLoader(x, workers=3).workers == 3
    assert DataLoader(x, parallel=True).workers >= 1 and DataLoader(x, parallel=True, workers=2).workers == 2
    assert "workers=3" in repr(DataLoader(x, workers=3))
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="DataLoader expects workers to be an int >= 0 or None"):
            DataLoader(x, workers=bad)
    with pytest.raises(ValueError, match="parallel=True and workers=0"):
        DataLoader(x, parallel=True, workers=0)
    with pytest.raises(TypeError, match="parallel to be True or False"):
        DataLoader(x, parallel="yes")


class Slow:
    """Observation i takes ``delay(i)`` seconds (time.sleep releases the GIL, as NumPy work and file reads do)."""

    def __init__(self, n, delay):
        self.n, self.delay, self.lock, self.started = n, delay, threading.Lock(), []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.lock:
            self.started.append(i)
        time.sleep(self.delay(i))
        if i == 13:
            raise KeyError("observation 13 is broken")
        return np.full(2, i)


def test_threads_keep_the_order_when_later_batches_finish_first():
    ds = Slow(12, lambda i: 0.02 * (12 - i))   # the first batches are the slowest
    got = [b[:, 0].tolist() for b in DataLoader(ds, batchsize=2, workers=4)]
    assert got == [[2 * i, 2 * i + 1] for i in range(6)]


def test_threads_overlap_their_loads():
    ds = Slow(8, lambda i: 0.1)
    start = time.perf_counter()
    assert len(list(DataLoader(ds, batchsize=1, workers=8))) == 8
    assert time.perf_counter() - start < 0.6   # 0.8 s one by one


def test_threads_load_a_bounded_number_ahead():
    ds = Slow(40, lambda i: 0.0)
    it = iter(DataLoader(ds, batchsize=1, workers=2))
    next(it)
    time.sleep(0.2)   # ample time for the threads to run ahead, were they unbounded
    assert len(ds.started) <= 2 * 2 + 1
    it.close()


def test_an_error_comes_at_its_batch_and_leaves_no_thread():
    ds = Slow(20, lambda i: 0.01)
    seen = []
    with pytest.raises(KeyError, match="observation 13 is broken"):
        for b in DataLoader(ds, batchsize=2, workers=3):
            seen.append(b[:, 0].tolist())
    assert seen == [[2 * i, 2 * i + 1] for i in range(6)]   # batch 6 holds observation 13
    assert not [t for t in threading.enumerate() if t.name.startswith("DataLoader")]


def test_stopping_early_leaves_no_thread():
    ds = Slow(40, lambda i: 0.005)
    for i, _ in enumerate(DataLoader(ds, batchsize=1, workers=4)):
        if i == 3:
            break
    assert not [t for t in threading.enumerate() if t.name.startswith("DataLoader")]
    assert len(ds.started) < 40


def test_device_moves_every_array_of_a_collated_batch_and_observations_skip_the_copier(monkeypatch):
    monkeypatch.setattr(data, "host_to_device", lambda sources, rows: pytest.fail("no copier for observations"))
    moved = []
    ds = [{"x": np.ones(2), "y": (np.zeros(1), 3)}] * 3
    loader = DataLoader(ds, batchsize=2, device=lambda a: moved.append(a.shape) or a)
    batches = list(loader)
    assert moved == [(2, 2), (2, 1), (2,), (1, 2), (1, 1), (1,)]
    assert isinstance(batches[0]["y"], tuple)
    assert DataLoader(ds, device="gpu")._prefetcher() is None
    assert DataLoader(np.ones(3), device="gpu", collate=False)._prefetcher() is None


def test_sharded_datasets_split_as_arrays_do():
    ds = Squares(9)
    for rank in range(3):
        got = np.concatenate([b[0] for b in DataLoader(ds, batchsize=2, shuffle=True, rng=4, shard=(rank, 3))])
        want = np.concatenate(list(DataLoader(ds.x ** 2, batchsize=2, shuffle=True, rng=4, shard=(rank, 3))))
        np.testing.assert_array_equal(got, want)


def test_seeded_shuffles_of_datasets_repeat():
    ds = Squares(10)
    fluxpy.seed(5)
    first = [b[1].tolist() for b in DataLoader(ds, batchsize=4, shuffle=True, workers=2)]
    fluxpy.seed(5)
    assert [b[1].tolist() for b in DataLoader(ds, batchsize=4, shuffle=True)] == first


def test_dataset_errors():
    class Empty:
        def __len__(self):
            return 0

        def __getitem__(self, i):
            raise IndexError(i)
    with pytest.raises(ValueError, match="DataLoader expects at least one observation, got Empty"):
        DataLoader(Empty())
    with pytest.raises(TypeError, match=r"DataLoader expects an array, .* or a dataset .* got set of length 2"):
        DataLoader({1, 2})
    with pytest.raises(TypeError, match=r"got str 'abc' as data"):
        DataLoader("abc")
    assert "Squares of 4 observations" in repr(DataLoader(Squares(4), batchsize=2))


def test_train_runs_on_a_loader_of_pairs():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 4)).astype(np.float32)
    y = (x @ rng.standard_normal((4, 1))).astype(np.float32)
    pairs = [(x[i], y[i]) for i in range(32)]
    model = fluxpy.Dense(4, 1)
    opt = fluxpy.setup(fluxpy.Adam(0.05), model)
    losses = fluxpy.train(lambda m, a, b: fluxpy.mse(m(a), b), model, DataLoader(pairs, batchsize=8, workers=2),
                          opt, epochs=15, progress=False)
    assert len(losses) == 60 and np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4])


def test_mlutils_dataloader_known_answers():
    """MLUtils' test/dataloader.jl, batch first (its X2 = reshape(1:10, 2, 5) holds the rows of x below)."""
    x, y = np.arange(1, 11).reshape(5, 2), np.arange(1, 6)
    assert [b.tolist() for b in DataLoader(x, batchsize=2)] == [x[0:2].tolist(), x[2:4].tolist(), x[4:5].tolist()]
    assert len(DataLoader((x,), batchsize=2, partial=False)) == 2
    batches = list(DataLoader({"x": x, "y": y}, batchsize=2))
    assert _same(batches[2], {"x": x[4:5], "y": y[4:5]})
    assert [b.tolist() for b in DataLoader(np.arange(1, 13), batchsize=5, partial=False)] == [[1, 2, 3, 4, 5],
                                                                                              [6, 7, 8, 9, 10]]
    assert [b.tolist() for b in DataLoader(range(1, 11), batchsize=2)][0] == [1, 2]
    table = np.random.default_rng(0).random((20, 10))
    for i, b in enumerate(DataLoader(table, batchsize=2, collate=False)):
        assert _same(b, [table[2 * i], table[2 * i + 1]])
    for b in DataLoader((table, table), batchsize=2, collate=False):
        assert isinstance(b, list) and all(isinstance(o, tuple) for o in b)

    def collate_fn(batch):   # "collate function": the rows side by side, the strings joined
        return np.stack([o[0] for o in batch], axis=1), "".join(o[1] for o in batch)
    loader = DataLoader((np.random.default_rng(1).random((4, 10)), np.array(["a", "b", "c", "d"])), batchsize=2,
                        collate=collate_fn)
    assert [(xb.shape, s) for xb, s in loader] == [((10, 2), "ab"), ((10, 2), "cd")]
