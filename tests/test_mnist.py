"""MNIST (fluxpy/datasets/mnist.py): IDX files and the loader's offline paths; end to end, the reference conv net
trained on the 5,000-image MNIST subset in ../shared/data/mnist, and the example examples/mnist_conv.py on small
stand-in data (always), offline and with no data at all.

Only the public API: load_mnist, DataLoader, onehotbatch/onecold, the layers, logitcrossentropy,
Adam with a cosine learning-rate schedule (adjust), train, save/load. The reference run is skipped
(saying why) unless the four MNIST files are in the shared folder: a fresh clone has no such folder.
About 10 epochs of 40 batches: well under a minute on two idle cores.
"""
import gzip
import hashlib
import importlib.util
import math
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import fluxpy.datasets.mnist as mnist
from fluxpy.data import DataLoader, onecold, onehotbatch
from fluxpy.datasets import MNISTUnavailableError, load_mnist, mnist_cache_dir, read_idx, write_idx
from fluxpy.datasets import _files
from fluxpy.io import load, save
from fluxpy.layers import Chain, Conv, Dense, MaxPool, flatten
from fluxpy.losses import logitcrossentropy
from fluxpy.ops.activations import relu
from fluxpy.optimise import Adam, adjust, setup
from fluxpy.train import train
from fluxpy.options import options

MNIST_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
MNIST_NAMES = [name for split in ("train", "test") for name in mnist.MNIST_FILES[split]]
MISSING = [name for name in MNIST_NAMES if not (MNIST_DIR / name).is_file()]
EPOCHS, PEAK_LR = 10, 5e-3
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mnist_conv.py"


def reference_net(rng):
    return Chain(Conv((3, 3), 1, 16, relu, pad=1, rng=rng), MaxPool((2, 2)),
                 Conv((3, 3), 16, 32, relu, pad=1, rng=rng), MaxPool((2, 2)),
                 Conv((3, 3), 32, 32, relu, pad=1, rng=rng), MaxPool((2, 2)),
                 flatten, Dense(288, 10, rng=rng))


def accuracy(model, images, labels):
    predictions = np.concatenate([onecold(model(x)) for x in DataLoader(images, batchsize=1000)])
    return float(np.mean(predictions == labels))


def cosine_rate(epoch):
    low = PEAK_LR / 30
    return low + 0.5 * (PEAK_LR - low) * (1 + math.cos(math.pi * (epoch - 1) / (EPOCHS - 1)))


@pytest.mark.skipif(bool(MISSING), reason=f"the MNIST files {', '.join(MISSING)} are not in {MNIST_DIR}")
def test_reference_net_reaches_96_percent_on_the_official_test_set(tmp_path):
    x_train, y_train = load_mnist("train", MNIST_DIR, download=False, fallback=False)
    x_test, y_test = load_mnist("test", MNIST_DIR, download=False, fallback=False)
    assert x_train.shape == (5000, 1, 28, 28) and x_test.shape == (10000, 1, 28, 28)

    model = reference_net(np.random.default_rng(0))
    opt_state = setup(Adam(PEAK_LR), model)
    loader = DataLoader((x_train, onehotbatch(y_train, range(10))), batchsize=128, shuffle=True, rng=0)
    start = time.perf_counter()
    losses = []
    for epoch in range(1, EPOCHS + 1):
        adjust(opt_state, cosine_rate(epoch))
        losses += train(lambda m, x, y: logitcrossentropy(m(x), y), model, loader, opt_state, progress=False)
    seconds = time.perf_counter() - start

    acc = accuracy(model, x_test, y_test)
    print(f"MNIST reference net: {100 * acc:.2f}% test accuracy, {seconds / EPOCHS:.1f} s/epoch")
    assert np.mean(losses[-len(loader):]) < 0.1
    assert acc >= 0.96

    save(tmp_path / "model.npz", model)
    fresh = load(tmp_path / "model.npz", reference_net(np.random.default_rng(1)))
    assert accuracy(fresh, x_test, y_test) == acc


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
    (tmp_path / "cut").write_bytes(bytes([0, 0, 8, 3, 0, 0, 0, 5]))
    with pytest.raises(ValueError, match=r"is truncated: its header needs 16 bytes for 3 dimensions, the file has 8"):
        read_idx(tmp_path / "cut")
    payload = gzip.compress(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9]))
    (tmp_path / "cut.gz").write_bytes(payload[:-6])
    with pytest.raises(ValueError, match=r"read_idx: .*cut\.gz is a corrupt or truncated gzip file"):
        read_idx(tmp_path / "cut.gz")
    (tmp_path / "notgz.gz").write_bytes(b"plain bytes")
    with pytest.raises(ValueError, match=r"read_idx: .*notgz\.gz is a corrupt or truncated gzip file"):
        read_idx(tmp_path / "notgz.gz")


def write_mnist(folder, split, n, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28)).astype(np.uint8)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    img_name, lab_name = mnist.MNIST_FILES[split]
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


def test_load_mnist_uses_the_cache_dir(tmp_path):
    write_mnist(tmp_path / "mnist", "test", 3)
    with options(cache_dir=tmp_path):
        assert mnist_cache_dir() == tmp_path / "mnist"
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
    monkeypatch.setattr(mnist, "_download_mnist_file", fake_download)
    x, y = load_mnist("test", tmp_path / "target")
    assert calls == list(mnist.MNIST_FILES["test"])
    np.testing.assert_array_equal(y, labels)


class FakeResponse:
    def __init__(self, payload):
        self.payload = payload

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def read(self):
        return self.payload


def test_fetch_checks_md5(tmp_path, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: FakeResponse(b"not mnist"))
    with pytest.raises(OSError, match="md5"):
        _files.fetch_checked("https://example.invalid/x", "0" * 32)


def test_a_bad_download_creates_no_folder(tmp_path, monkeypatch):
    """A data_dir that does not exist stays absent unless a file is written into it."""
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: FakeResponse(b"not mnist"))
    monkeypatch.setattr(mnist, "_packaged_mnist_dir", lambda: None)
    with pytest.raises(MNISTUnavailableError, match="md5"):
        load_mnist("test", tmp_path / "a" / "b", verbose=False)
    assert list(tmp_path.iterdir()) == []


def test_a_good_download_creates_the_folder_and_the_file(tmp_path, monkeypatch):
    source = tmp_path / "mirror"
    images, labels = write_mnist(source, "test", 4)
    payloads = {name: (source / name).read_bytes() for name in mnist.MNIST_FILES["test"]}
    monkeypatch.setattr(mnist, "MNIST_MD5", {name: hashlib.md5(p).hexdigest() for name, p in payloads.items()})
    monkeypatch.setattr(urllib.request, "urlopen",
                        lambda url, timeout: FakeResponse(payloads[url.rsplit("/", 1)[1]]))
    x, y = load_mnist("test", tmp_path / "new" / "mnist", verbose=False)
    np.testing.assert_array_equal(y, labels)
    assert sorted(p.name for p in (tmp_path / "new" / "mnist").iterdir()) == sorted(payloads)


def test_offline_download_fails_once_then_fast(tmp_path, monkeypatch):
    """No network: every mirror fails; the next file (and the next split) does not wait for the timeouts again."""
    calls = []

    def unreachable(url, timeout):
        calls.append((url, timeout))
        raise urllib.error.URLError(OSError(-2, "Name or service not known"))
    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    monkeypatch.setattr(mnist, "_network_failure", [None])
    monkeypatch.setattr(mnist, "_packaged_mnist_dir", lambda: None)
    with pytest.raises(MNISTUnavailableError, match="Name or service not known"):
        load_mnist("train", tmp_path / "x", verbose=False)
    assert len(calls) == len(mnist.MNIST_MIRRORS) and all(t == _files.DOWNLOAD_TIMEOUT <= 10 for _, t in calls)
    with pytest.raises(MNISTUnavailableError, match="not retried within"):
        load_mnist("test", tmp_path / "x", verbose=False)
    assert len(calls) == len(mnist.MNIST_MIRRORS)
    assert not (tmp_path / "x").exists()


def test_fallback_false_never_uses_the_packaged_subset(tmp_path, monkeypatch):
    offline(monkeypatch)
    with pytest.raises(MNISTUnavailableError, match="pass fallback=True"):
        load_mnist("test", tmp_path, fallback=False)


def test_data_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="load_mnist: data_dir .* is a file"):
        load_mnist("test", tmp_path / "f")


def offline(monkeypatch):
    def no_network(folder, name, verbose=True):
        raise OSError("network is unreachable")
    monkeypatch.setattr(mnist, "_download_mnist_file", no_network)


def test_missing_and_offline_without_the_packaged_subset_is_a_clear_error(tmp_path, monkeypatch):
    offline(monkeypatch)
    monkeypatch.setattr(mnist, "_packaged_mnist_dir", lambda: None)
    with pytest.raises(MNISTUnavailableError) as err:
        load_mnist("train", tmp_path)
    message = str(err.value)
    for needle in ("train-images-idx3-ubyte.gz", str(tmp_path), "network is unreachable", "data_dir=",
                   "FLUXPY_CACHE", "reinstall fluxpy with its package data"):
        assert needle in message


def test_offline_falls_back_to_the_packaged_subset(tmp_path, monkeypatch):
    packaged = tmp_path / "packaged"
    write_mnist(packaged, "train", 20)
    test_images, test_labels = write_mnist(packaged, "test", 10)
    offline(monkeypatch)
    monkeypatch.setattr(mnist, "_packaged_mnist_dir", lambda: packaged)
    with pytest.warns(UserWarning, match="subset shipped with fluxpy"):
        x, y = load_mnist("test", tmp_path / "empty")
    np.testing.assert_array_equal(y, test_labels)
    np.testing.assert_array_equal(x[:, 0], test_images.astype(np.float32) / 255)
    with pytest.warns(UserWarning, match="official 10,000 test images"):
        x_train, _ = load_mnist("train", tmp_path / "empty")
    assert len(x_train) == 20 and not (tmp_path / "empty").exists()


def test_the_packaged_subset_is_the_real_one():
    """fluxpy ships 5,000 training images (500 per digit) and the official test set, byte for byte."""
    import hashlib
    folder = mnist._packaged_mnist_dir()
    assert folder is not None, "the MNIST package data is missing from the installation"
    for name in mnist.MNIST_FILES["test"]:
        assert hashlib.md5((folder / name).read_bytes()).hexdigest() == mnist.MNIST_MD5[name]
    with pytest.warns(UserWarning, match="subset shipped with fluxpy"):
        x, y = load_mnist("train", folder.parent / "no-such-folder", download=False)
    assert x.shape == (5000, 1, 28, 28) and 0 < x.mean() < 0.5
    np.testing.assert_array_equal(np.bincount(y), [500] * 10)


def test_bad_split():
    with pytest.raises(ValueError, match="split must be \"train\" or \"test\", got str 'validation'"):
        load_mnist("validation")
    with pytest.raises(ValueError, match="got list of length 1"):
        load_mnist(["train"])


# ---------------------------------------------------------------------------------------------
# examples/mnist_conv.py


def example():
    spec = importlib.util.spec_from_file_location("mnist_conv_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_digits(folder, split, n, seed=0):
    """Small learnable stand-in data in MNIST's IDX format: digit d lights up row block d."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    images = rng.integers(0, 40, (n, 28, 28)).astype(np.uint8)
    for i, d in enumerate(labels):
        images[i, 2 * d:2 * d + 3, :] = 255
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / mnist.MNIST_FILES[split][0], images)
    write_idx(folder / mnist.MNIST_FILES[split][1], labels)


def run_example(tmp_path, *argv):
    args = ["--epochs", "2", "--batchsize", "32", "--device", "cpu", "--no-progress",
            "--save", str(tmp_path / "out" / "m.npz"), "--plot", str(tmp_path / "out" / "m.png"), *argv]
    return example().main(args)


def test_example_trains_saves_and_reloads(tmp_path, capsys):
    write_digits(tmp_path / "mnist", "train", 256)
    write_digits(tmp_path / "mnist", "test", 64, seed=1)
    accuracy = run_example(tmp_path, "--data-dir", str(tmp_path / "mnist"))
    out = capsys.readouterr().out
    assert f"256 training and 64 test images from the MNIST files in {tmp_path / 'mnist'}" in out
    assert "reloaded model: same accuracy" in out and "final test accuracy" in out
    assert accuracy > 0.5 and (tmp_path / "out" / "m.npz").is_file()


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_example_in_mixed_precision_saves_the_float32_model(tmp_path, capsys, precision):
    write_digits(tmp_path / "mnist", "train", 256)
    write_digits(tmp_path / "mnist", "test", 64, seed=1)
    accuracy = run_example(tmp_path, "--data-dir", str(tmp_path / "mnist"), "--precision", precision)
    out = capsys.readouterr().out
    assert "MixedPrecision(Chain(" in out and "reloaded model: same accuracy" in out
    assert accuracy > 0.5
    saved = load(tmp_path / "out" / "m.npz", reference_net(np.random.default_rng(3)))   # a plain float32 model
    assert saved.layers[0].weight.dtype == np.float32


def test_example_lenet5_with_safetensors(tmp_path, capsys):
    write_digits(tmp_path / "mnist", "train", 64)
    write_digits(tmp_path / "mnist", "test", 32, seed=1)
    run_example(tmp_path, "--data-dir", str(tmp_path / "mnist"), "--model", "lenet5", "--epochs", "1",
                "--save", str(tmp_path / "out" / "m.safetensors"))
    assert (tmp_path / "out" / "m.safetensors").is_file()
    assert "reloaded model: same accuracy" in capsys.readouterr().out


def test_example_is_reproducible_with_a_seed(tmp_path, capsys):
    write_digits(tmp_path / "mnist", "train", 96)
    write_digits(tmp_path / "mnist", "test", 32, seed=1)
    runs = []
    for _ in range(2):
        run_example(tmp_path, "--data-dir", str(tmp_path / "mnist"), "--seed", "3")
        runs.append([line for line in capsys.readouterr().out.splitlines() if "train loss" in line])
    assert [line.split(",")[:2] for line in runs[0]] == [line.split(",")[:2] for line in runs[1]]


def offline_with_subset(tmp_path, monkeypatch):
    """No network, and a small IDX folder standing in for the subset fluxpy ships."""
    def no_network(folder, name, verbose=True):
        raise OSError("network is unreachable")
    monkeypatch.setattr(mnist, "_download_mnist_file", no_network)
    packaged = tmp_path / "packaged"
    write_digits(packaged, "train", 150)
    write_digits(packaged, "test", 50, seed=1)
    monkeypatch.setattr(mnist, "_packaged_mnist_dir", lambda: packaged)


def test_example_with_a_missing_data_dir_falls_back_and_says_so(tmp_path, monkeypatch, capsys):
    """The README's command on a fresh clone: the data folder does not exist and there is no network."""
    offline_with_subset(tmp_path, monkeypatch)
    missing = tmp_path / "shared" / "data" / "mnist"
    run_example(tmp_path, "--data-dir", str(missing))
    out = capsys.readouterr().out
    assert f"--data-dir {missing} does not exist" in out
    assert "NOTE: MNIST train files not found" in out and "network is unreachable" in out
    assert "150 training and 50 test images from the MNIST subset shipped with fluxpy" in out
    assert "final test accuracy" in out
    assert not (tmp_path / "shared").exists()  # no empty folder left behind


def test_example_without_any_data_exits_with_what_to_do(tmp_path, monkeypatch, capsys):
    offline_with_subset(tmp_path, monkeypatch)
    monkeypatch.setattr(mnist, "_packaged_mnist_dir", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        run_example(tmp_path, "--data-dir", str(tmp_path / "nowhere"))
    message = str(exit_.value.code)
    assert message.startswith("no MNIST data: load_mnist: the MNIST train files")
    assert "reinstall fluxpy with its package data" in message and "data_dir=" in message
    assert not (tmp_path / "nowhere").exists()


def test_load_mnist_strict_in_the_reference_folder_layout(tmp_path):
    """fallback=False: an incomplete folder is an error, never a silent substitute."""
    write_digits(tmp_path, "train", 4)
    with pytest.raises(MNISTUnavailableError, match="t10k-images-idx3-ubyte.gz"):
        load_mnist("test", tmp_path, download=False, fallback=False)
