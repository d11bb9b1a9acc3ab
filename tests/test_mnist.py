"""End to end: the reference conv net trained on the 5,000-image MNIST subset in ../shared/data/mnist.

Only the public API: load_mnist, DataLoader, onehotbatch/onecold, the layers, logitcrossentropy,
Adam with a cosine learning-rate schedule (adjust), train, save/load. Skipped when the shared
data folder is absent. About 10 epochs of 40 batches: well under a minute on two idle cores.
"""
import math
import time
from pathlib import Path

import numpy as np
import pytest

from fluxpy.data import DataLoader, load_mnist, onecold, onehotbatch
from fluxpy.io import load, save
from fluxpy.layers import Chain, Conv, Dense, MaxPool, flatten
from fluxpy.losses import logitcrossentropy
from fluxpy.ops.activations import relu
from fluxpy.optimise import Adam, adjust, setup
from fluxpy.train import train

MNIST_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
EPOCHS, PEAK_LR = 10, 5e-3


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


@pytest.mark.skipif(not MNIST_DIR.is_dir(), reason=f"no MNIST data in {MNIST_DIR}")
def test_reference_net_reaches_96_percent_on_the_official_test_set(tmp_path):
    x_train, y_train = load_mnist("train", MNIST_DIR, download=False)
    x_test, y_test = load_mnist("test", MNIST_DIR, download=False)
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
