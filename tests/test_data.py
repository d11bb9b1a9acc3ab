"""DataLoader and onehotbatch/onecold (fluxpy/data.py); the MNIST files are tested in test_mnist.py."""
import time

import numpy as np
import pytest

import fluxpy
import fluxpy.data as data
from fluxpy.data import DataLoader, onecold, onehotbatch

# ---------------------------------------------------------------------------------------------
# DataLoader


def test_batches_in_order_with_partial_last_batch():
    x = np.arange(20).reshape(10, 2)
    y = np.arange(10)
    loader = DataLoader((x, y), batchsize=4)
    batches = list(loader)
    assert len(loader) == len(batches) == 3
    assert [b[0].shape for b in batches] == [(4, 2), (4, 2), (2, 2)]
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), y)
    assert all(isinstance(b, tuple) for b in batches)


def test_partial_false_drops_the_short_batch():
    loader = DataLoader(np.arange(10), batchsize=4, partial=False)
    assert len(loader) == 2
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_single_array_gives_arrays_and_tuple_gives_tuples():
    assert isinstance(next(iter(DataLoader(np.ones((3, 2))))), np.ndarray)
    assert isinstance(next(iter(DataLoader((np.ones(3), np.zeros(3))))), tuple)


def test_python_lists_are_converted_to_arrays():
    loader = DataLoader([[1, 2], [3, 4], [5, 6]], batchsize=2)
    assert isinstance(loader.data, np.ndarray) and loader.data.shape == (3, 2)
    assert [b.tolist() for b in loader] == [[[1, 2], [3, 4]], [[5, 6]]]
    x, y = next(iter(DataLoader(([0.5, 1.5, 2.5], ["a", "b", "c"]), batchsize=3)))
    assert x.dtype == np.float64 and y.tolist() == ["a", "b", "c"]
    mixed = DataLoader((np.ones((3, 2)), [0, 1, 2], range(3)), batchsize=2)
    assert [tuple(a.shape) for a in next(iter(mixed))] == [(2, 2), (2,), (2,)]


def test_a_list_of_arrays_is_observations_and_ambiguous_inside_a_tuple():
    """A top-level list of arrays is a list of observations, stacked into batches (PyTorch's list dataset, MLUtils'
    vector of observations); several arrays sliced alike are a tuple. Inside a tuple, a list of arrays (several
    sources, or rows?) is still an error rather than a guess."""
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(3) for _ in range(5)]
    batches = list(DataLoader(rows, batchsize=2))
    assert [b.shape for b in batches] == [(2, 3), (2, 3), (1, 3)]
    np.testing.assert_array_equal(np.concatenate(batches), np.stack(rows))
    with pytest.raises(ValueError, match=r"DataLoader cannot collate the observations \[0, 1\] into a batch: "
                                         r"observation 1 has shape \(4,\), observation 0 has shape \(3,\)"):
        list(DataLoader([np.ones(3), np.zeros(4)], batchsize=2))
    with pytest.raises(TypeError, match=r"data\[1\] is a list of arrays, which is ambiguous: pass a tuple \(x, y\)"):
        DataLoader((np.ones(2), [np.ones(3), np.ones(3)]))


def test_a_60000_row_list_is_fast_and_its_errors_are_short():
    rows = [[0.0] * 28 for _ in range(60_000)]
    start = time.perf_counter()
    loader = DataLoader(rows, batchsize=128)
    assert loader.data.shape == (60_000, 28) and len(loader) == 469
    with pytest.raises(ValueError) as err:
        DataLoader((rows, list(range(59_999))))
    assert len(str(err.value)) < 300 and "(60000, 28), (59999,)" in str(err.value)
    ragged = rows[:-1] + [[0.0] * 10]
    with pytest.raises(ValueError) as err:
        DataLoader(ragged)
    assert len(str(err.value)) < 400 and "list of length 60000" in str(err.value)
    with pytest.raises(ValueError) as err:
        DataLoader(rows, batchsize=0)
    assert len(str(err.value)) < 100
    with pytest.raises(TypeError) as err:
        DataLoader(rows, batchsize=rows)
    assert len(str(err.value)) < 100 and "list of length 60000" in str(err.value)
    assert time.perf_counter() - start < 20


def test_shuffle_is_a_new_permutation_each_epoch_and_keeps_pairs():
    x = np.arange(100)
    loader = DataLoader((x, x * 10), batchsize=32, shuffle=True, rng=0)
    first = np.concatenate([b[0] for b in loader])
    second = np.concatenate([b[0] for b in loader])
    assert sorted(first.tolist()) == list(range(100))
    assert not np.array_equal(first, x) and not np.array_equal(first, second)
    for bx, by in loader:
        np.testing.assert_array_equal(by, bx * 10)
    again = np.concatenate([b[0] for b in DataLoader((x, x), batchsize=32, shuffle=True, rng=0)])
    np.testing.assert_array_equal(first, again)  # same seed, same order


def test_dataloader_errors():
    with pytest.raises(ValueError, match=r"same number of observations on axis 0, got shapes \[\(3,\), \(4,\)\]"):
        DataLoader((np.ones(3), np.ones(4)))
    with pytest.raises(ValueError, match="same number of observations"):
        DataLoader((np.ones(3), [1, 2]))
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"DataLoader expects batchsize to be an int >= 1, got {bad}"):
            DataLoader(np.ones(3), batchsize=bad)
    for bad, shown in ((2.0, "float 2.0"), ("2", "str '2'"), (True, "bool True"), (None, "NoneType None")):
        with pytest.raises(TypeError, match=rf"DataLoader expects batchsize to be an int >= 1, got {shown}"):
            DataLoader(np.ones(3), batchsize=bad)
    assert DataLoader(np.ones(3), batchsize=np.int64(2)).batchsize == 2
    with pytest.raises(ValueError, match=r"device to be None, \"cpu\", \"gpu\" or a function, got str 'tpu'"):
        DataLoader(np.ones(3), device="tpu")
    with pytest.raises(TypeError, match="shuffle to be True or False, got str 'yes'"):
        DataLoader(np.ones(3), shuffle="yes")
    with pytest.raises(TypeError, match="partial to be True or False"):
        DataLoader(np.ones(3), partial=None)
    with pytest.raises(TypeError, match="DataLoader expects rng to be a numpy.random.Generator"):
        DataLoader(np.ones(3), rng=0.5)


def test_dataloader_empty_and_shapeless_data():
    for empty in (np.ones((0, 3)), [], (np.ones(0), np.ones(0))):
        with pytest.raises(ValueError, match="at least one observation"):
            DataLoader(empty)
    with pytest.raises(ValueError, match="at least one array, got an empty tuple"):
        DataLoader(())
    with pytest.raises(ValueError, match="observation axis, got a 0-d"):
        DataLoader(np.array(3.0))
    for bad, shown in ((5, "int 5"), ({"x": 1}, "int 1 as data\\['x'\\]"), (None, "NoneType None"),
                       (np.float32(1), "float32 1.0")):
        with pytest.raises(TypeError, match=rf"DataLoader expects an array, a list, or a tuple of them .* got {shown}"):
            DataLoader(bad)
    with pytest.raises(TypeError, match=r"got str 'abc' as data\[1\]"):
        DataLoader((np.ones(3), "abc"))
    with pytest.raises(ValueError, match="array of Python objects"):
        DataLoader([1, "a", None])


def test_device_function_is_applied_to_each_batch():
    moved = []
    loader = DataLoader((np.ones((4, 2)), np.zeros(4)), batchsize=2, device=lambda a: moved.append(a.shape) or a)
    list(loader)
    assert moved == [(2, 2), (2,), (2, 2), (2,)]
    assert list(DataLoader(np.ones(2), device="cpu"))[0].shape == (1,)
    assert "2 batches" in repr(loader)


@pytest.mark.gpu
def test_device_gpu_moves_batches():
    import cupy
    batch = next(iter(DataLoader((np.ones((4, 2)), np.arange(4)), batchsize=2, device="gpu")))
    assert all(isinstance(b, cupy.ndarray) for b in batch)


# ---------------------------------------------------------------------------------------------
# Prefetching with device="gpu": the pipeline's logic, with a fake copier in place of fluxpy.backend.HostToDevice


class FakeCopier:
    """Stands in for HostToDevice: ``stage`` gathers on the host (copies), ``ready`` hands them out; logs both."""

    def __init__(self, sources, rows):
        self.sources, self.rows, self.log = sources, rows, []

    def stage(self, index):
        parts = [np.array(s[index]) for s in self.sources]
        self.log.append(("stage", int(parts[0].flat[0])))
        return parts

    def ready(self, staged):
        self.log.append(("ready", int(staged[0].flat[0])))
        return staged


@pytest.fixture
def fake_copier(monkeypatch):
    made = []

    def factory(sources, rows):
        made.append(FakeCopier(sources, rows))
        return made[-1]
    monkeypatch.setattr(data, "host_to_device", factory)
    return made


def test_prefetch_stages_the_next_batch_before_handing_out_the_current_one(fake_copier):
    loader = DataLoader((np.arange(10), np.arange(10) * 10), batchsize=4, device="gpu")
    it = iter(loader)
    first = next(it)
    copier = fake_copier[0]
    assert copier.rows == 4 and copier.log == [("stage", 0), ("stage", 4), ("ready", 0)]
    second = next(it)
    assert copier.log[3:] == [("stage", 8), ("ready", 4)]
    third = next(it)
    assert copier.log[5:] == [("ready", 8)]                  # nothing left to stage
    assert [b[0].tolist() for b in (first, second, third)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert third[1].tolist() == [80, 90] and isinstance(third, tuple)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_prefetched_batches_equal_the_plain_ones(fake_copier, shuffle, partial, as_tuple):
    x = np.arange(23 * 2).reshape(23, 2)
    source = (x, x[:, 0] * 3) if as_tuple else x
    kw = dict(batchsize=5, shuffle=shuffle, partial=partial, rng=4)
    got, plain = list(DataLoader(source, device="gpu", **kw)), list(DataLoader(source, **kw))
    assert len(got) == len(plain) == (5 if partial else 4)
    for g, p in zip(got, plain):
        g, p = (g, p) if as_tuple else ((g,), (p,))
        assert all(np.array_equal(a, b) for a, b in zip(g, p))
    assert len(fake_copier) == 1                              # one copier per iteration


def test_each_iteration_has_its_own_copier_and_an_abandoned_batch_is_finished(fake_copier):
    loader = DataLoader(np.arange(12), batchsize=3, device="gpu")
    for i, _ in enumerate(loader):
        if i == 1:
            break
    # batches 0..2 staged, 0 and 1 handed out; leaving the loop finishes the staged batch 2 as well
    assert fake_copier[0].log == [("stage", 0), ("stage", 3), ("ready", 0), ("stage", 6), ("ready", 3),
                                  ("ready", 6)]
    assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert len(fake_copier) == 2 and len(fake_copier[1].log) == 8
    pairs = list(zip(loader, loader))                          # two iterations at once: two copiers
    assert len(fake_copier) == 4 and all(np.array_equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("device, prefetch", [(None, True), ("cpu", True), ("gpu", False), ("function", True)])
def test_only_device_gpu_with_prefetch_uses_a_copier(fake_copier, device, prefetch):
    loader = DataLoader(np.arange(4), batchsize=2, device=(lambda a: a + 1) if device == "function" else device,
                        prefetch=prefetch)
    assert loader._prefetcher() is None and fake_copier == []
    if device != "gpu":
        assert [b.tolist() for b in loader] == ([[1, 2], [3, 4]] if device == "function" else [[0, 1], [2, 3]])
        assert fake_copier == []


def test_without_a_copier_device_gpu_moves_each_batch_with_fluxpy_gpu(monkeypatch):
    """Where host_to_device says no (no GPU, strings, data on the GPU), batches go through fluxpy.gpu: without a
    GPU that is fluxpy.gpu's error."""
    monkeypatch.setattr(data, "host_to_device", lambda sources, rows: None)
    loader = DataLoader((np.ones((4, 2)), np.arange(4)), batchsize=2, device="gpu")
    ok, _ = fluxpy.gpu_available()
    if ok:
        pytest.skip("a GPU is present")
    with pytest.raises(fluxpy.GPUUnavailableError, match="no usable GPU"):
        next(iter(loader))


def test_prefetch_must_be_a_bool():
    with pytest.raises(TypeError, match="DataLoader expects prefetch to be True or False, got str 'no'"):
        DataLoader(np.ones(3), device="gpu", prefetch="no")
    assert DataLoader(np.ones(3), device="gpu").prefetch is True
    assert repr(DataLoader(np.ones(3), device="gpu", prefetch=False)) == \
        "DataLoader((3,), batchsize=1, shuffle=False, partial=True): 3 batches"


# ---------------------------------------------------------------------------------------------
# One-hot


def test_onehotbatch_and_onecold_roundtrip():
    labels = np.array([3, 0, 9, 3])
    y = onehotbatch(labels, range(10))
    assert y.shape == (4, 10) and y.dtype == np.float32
    assert y.sum() == 4 and y[0, 3] == 1 and y[2, 9] == 1
    np.testing.assert_array_equal(onecold(y), labels)
    np.testing.assert_array_equal(onehotbatch(labels, 10), y)


def test_onehot_with_arbitrary_classes():
    y = onehotbatch(["cat", "dog", "cat"], ["dog", "cat"])
    np.testing.assert_array_equal(y, [[0, 1], [1, 0], [0, 1]])
    assert onecold(y, ["dog", "cat"]).tolist() == ["cat", "dog", "cat"]
    np.testing.assert_array_equal(onehotbatch(np.array([20, 10]), [10, 20]), [[0, 1], [1, 0]])


def test_onehot_unknown_label_is_an_error():
    with pytest.raises(ValueError, match="label 10 is not one of the classes range"):
        onehotbatch([1, 10], range(10))
    with pytest.raises(ValueError, match="'z' is not one of the classes"):
        onehotbatch(["a", "z"], "abc")


def test_onecold_classes_must_match_the_last_axis():
    scores = np.zeros((4, 10))
    for classes in (range(9), "abc", list(range(11))):
        with pytest.raises(ValueError, match=rf"onecold expects len\(classes\) == y.shape\[-1\] == 10, got {len(classes)} "
                                             r"classes for y of shape \(4, 10\) float64"):
            onecold(scores, classes)
    assert onecold(scores, range(10)).tolist() == [0, 0, 0, 0]
    with pytest.raises(TypeError, match="ordered sequence of labels .* got set"):
        onecold(np.zeros(2), {"a", "b"})
    with pytest.raises(ValueError, match="non-empty last axis"):
        onecold(np.zeros((3, 0)))
    with pytest.raises(ValueError, match="non-empty last axis"):
        onecold(np.float64(1.0))


def test_onehotbatch_bad_classes_and_labels():
    with pytest.raises(TypeError, match="onehotbatch expects classes to be an int or an ordered sequence"):
        onehotbatch([1], {1, 2})
    with pytest.raises(ValueError, match="onehotbatch expects distinct classes, got repeats in \\[1, 2, 1\\]"):
        onehotbatch([1], [1, 2, 1])
    with pytest.raises(ValueError, match="onehotbatch expects classes to be an int >= 1"):
        onehotbatch([0], 0)
    with pytest.raises(ValueError, match="at least one class"):
        onehotbatch([0], [])
    with pytest.raises(ValueError, match="1-d sequence of labels, got ndarray of shape \\(2, 1\\)"):
        onehotbatch([[1], [2]], 3)
    with pytest.raises(ValueError, match="cannot convert the labels \\(list of length 2\\)"):
        onehotbatch([[1], [2, 3]], 3)


def test_onehot_messages_are_bounded():
    classes = [f"class-{i}" for i in range(10_000)]
    with pytest.raises(ValueError) as err:
        onehotbatch(["x" * 500], classes)
    assert len(str(err.value)) < 400 and "and 9980 more" in str(err.value)


def test_onecold_on_scores_and_tracked_values():
    import fluxpy
    scores = np.array([[0.1, 2.0, -1.0], [5.0, 0.0, 0.0]])
    np.testing.assert_array_equal(onecold(scores), [1, 0])
    seen = []
    fluxpy.gradient(lambda s: (seen.append(onecold(s)), s.sum())[1], scores)
    np.testing.assert_array_equal(seen[0], [1, 0])


def test_the_top_level_keeps_the_verbs_and_the_data_sets_live_in_fluxpy_datasets():
    assert (fluxpy.DataLoader, fluxpy.onehotbatch, fluxpy.onecold) == (DataLoader, onehotbatch, onecold)
    for name in ("load_mnist", "load_cifar10", "MNISTUnavailableError", "CIFARUnavailableError", "cifar", "augment"):
        assert not hasattr(fluxpy, name) and name not in fluxpy.__all__, name
    assert fluxpy.datasets.load_mnist is fluxpy.datasets.mnist.load_mnist
    assert fluxpy.datasets.load_cifar10 is fluxpy.datasets.cifar.load_cifar10
    assert fluxpy.datasets.random_crop is fluxpy.datasets.augment.random_crop
