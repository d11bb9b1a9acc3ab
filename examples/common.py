"""What the examples share: choosing the device, moving a model there, and plotting the training curves.

The examples import it from their own folder (``sys.path`` gets the folder first), so each still runs as
``python examples/<name>.py`` from a checkout.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import fluxpy
from fluxpy.layers import Conv

# The panels plot_curves knows: history key -> (y label, title, y scale, factor applied to the values)
PANELS = {"loss": ("mean training loss", "training loss", "log", 1.0),
          "accuracy": ("test accuracy (%)", "test accuracy", "linear", 100.0),
          "lr": ("learning rate", "learning rate", "linear", 1.0)}


def pick_device(choice: str) -> str:
    """"gpu" when asked for (an error if unusable) or, with "auto", when a GPU runs a small conv; else "cpu"."""
    if choice == "cpu":
        return "cpu"
    ok, why = fluxpy.gpu_available()
    if ok:
        try:
            probe = fluxpy.gpu(Conv((3, 3), 1, 2))
            fluxpy.cpu(probe(fluxpy.gpu(np.zeros((1, 1, 5, 5), np.float32))))
        except Exception as err:  # the GPU backend is installed but cannot run convolutions
            ok, why = False, f"a GPU convolution failed: {err}"
    if ok:
        return "gpu"
    if choice == "gpu":
        raise SystemExit(f"--device gpu: no usable GPU ({why})")
    print(f"no usable GPU ({why}); training on the CPU")
    return "cpu"


def to_device(model, device: str):
    """The model on ``device`` ("gpu": a copy with CuPy arrays; "cpu": the model itself)."""
    return fluxpy.gpu(model) if device == "gpu" else model


def plot_curves(path, history: dict, keys=("loss", "accuracy")) -> None:
    """A PNG at ``path`` with one panel per epoch curve in ``keys`` (see :data:`PANELS`); says so and returns
    where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path} (pip install matplotlib)")
        return
    epochs = np.arange(1, len(history[keys[0]]) + 1)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4))
    for ax, key, color in zip(np.atleast_1d(axes), keys, ("tab:blue", "tab:green", "tab:orange")):
        ylabel, title, scale, factor = PANELS[key]
        ax.plot(epochs, factor * np.asarray(history[key]), marker="o", color=color)
        ax.set(xlabel="epoch", ylabel=ylabel, yscale=scale, title=title)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
