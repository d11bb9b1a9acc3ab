"""Train a small vision transformer on MNIST: patches of 4x4 pixels as 49 tokens, pre-norm transformer encoder layers.

The model: ``PatchEmbedding(4, 1 => width)`` (a strided ``CrossCor`` and a learned position embedding), ``--depth``
``TransformerEncoderLayer(width, --heads, 4 width)`` (PyTorch's layer: self-attention and a GELU MLP, pre-norm,
batch first), a ``LayerNorm``, the mean over the tokens and a ``Dense`` to the 10 classes; AdamW with a cosine
schedule and label smoothing. On the GPU each step is captured as a CUDA graph and runs in bfloat16 with float32
master weights (``--precision float32`` or ``float16`` to change it, ``--no-capture`` for eager steps); on the CPU it
runs eagerly in float32. A progress bar per epoch, the curves as a PNG, the model saved and reloaded (its accuracy
checked) at the end, as ``mnist_conv.py`` does, and ``--checkpoint PATH`` saves the whole training state every epoch
(``fluxpy.save_training``) and resumes from it when the file exists.

Data: as ``mnist_conv.py``: ``--data-dir`` with the MNIST IDX files, else the cache (downloading when online), else
the MNIST subset fluxpy ships (5,000 training images and the official 10,000 test images).

Run: ``python examples/mnist_vit.py [--epochs 10] [--width 64 --depth 4 --heads 4] [--device cpu|gpu]``
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))      # the examples' shared helpers

import fluxpy  # noqa: E402
from common import pick_device, plot_curves, to_device  # noqa: E402
from fluxpy.data import DataLoader, onehotbatch  # noqa: E402
from fluxpy.layers import Chain, Dense, LayerNorm, TransformerEncoderLayer  # noqa: E402
from fluxpy.models.vit import PatchEmbedding, token_mean  # noqa: E402
from fluxpy.optimise import AdamW, adjust, setup  # noqa: E402
from fluxpy.schedules import Cosine  # noqa: E402
from mnist_conv import accuracy, load_data  # noqa: E402


def vit_mnist(width: int = 64, depth: int = 4, heads: int = 4, rng=None) -> Chain:
    """The ViT of this example for ``(N, 1, 28, 28)`` images (see the module docstring)."""
    layers = [TransformerEncoderLayer(width, heads, 4 * width, rng=rng) for _ in range(depth)]
    return Chain(PatchEmbedding(4, 1, width, image=(28, 28), rng=rng), *layers, LayerNorm(width), token_mean,
                 Dense(width, 10, rng=rng))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batchsize", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (cosine decay to lr/30)")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--data-dir", default=None, help="folder with the MNIST IDX files (default: the fluxpy cache)")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--precision", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: bfloat16 on the GPU, float32 on the CPU")
    p.add_argument("--no-capture", action="store_true", help="eager steps on the GPU instead of a CUDA graph")
    p.add_argument("--checkpoint", default=None, help="save the training state here every epoch; resume from it")
    p.add_argument("--save", default="runs/mnist_vit.npz")
    p.add_argument("--plot", default="runs/mnist_vit.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = pick_device(args.device)
    precision = args.precision if args.precision != "auto" else ("bfloat16" if device == "gpu" else "float32")
    fluxpy.seed(args.seed)
    (x_train, y_train, x_test, y_test), source = load_data(args.data_dir)
    print(f"MNIST: {len(x_train)} training and {len(x_test)} test images from {source}; device: {device}, "
          f"{precision}")
    model = to_device(vit_mnist(args.width, args.depth, args.heads), device)
    model = model if precision == "float32" else fluxpy.mixed_precision(model, precision)
    print(model)
    opt_state = setup(AdamW(args.lr, lambd=args.weight_decay), model)
    schedule = Cosine(args.lr, args.lr / 30, args.epochs)
    loader = DataLoader((x_train, onehotbatch(y_train, range(10))), batchsize=args.batchsize, shuffle=True,
                        device="gpu" if device == "gpu" else None)

    def loss(m, x, y):
        return fluxpy.logitcrossentropy(m(x), y, label_smoothing=args.label_smoothing)

    first = 1
    if args.checkpoint and Path(args.checkpoint).exists():
        first = fluxpy.load_training(args.checkpoint, model, opt_state)["step"] + 1
        print(f"resumed from {args.checkpoint} after epoch {first - 1}")
    history = {"loss": [], "accuracy": []}
    speeds = []
    for epoch in range(first, args.epochs + 1):
        adjust(opt_state, schedule(epoch))
        start = time.perf_counter()
        losses = fluxpy.train(loss, model, loader, opt_state, progress=not args.no_progress,
                              **({"capture": False} if args.no_capture else {}))
        seconds = time.perf_counter() - start
        acc = accuracy(model, x_test, y_test, device)
        history["loss"].append(float(np.mean(losses)))
        history["accuracy"].append(acc)
        speeds.append(len(x_train) / seconds)
        print(f"epoch {epoch:2d}/{args.epochs}: train loss {history['loss'][-1]:.4f}, test accuracy "
              f"{100 * acc:.2f}%, {seconds:.1f} s, {speeds[-1]:.0f} images/s", flush=True)
        if args.checkpoint:
            fluxpy.save_training(args.checkpoint, model, opt_state, step=epoch)
    if len(speeds) > 1:   # the first epoch also compiles, plans and captures
        print(f"training speed: {np.median(speeds[1:]):.0f} images/s, the median over epochs after the first")
    if not history["accuracy"]:
        return None
    plot_curves(args.plot, history)
    Path(args.save).parent.mkdir(parents=True, exist_ok=True)
    fluxpy.save(args.save, model.model if isinstance(model, fluxpy.MixedPrecision) else model)   # float32 masters
    fresh = fluxpy.load(args.save, to_device(vit_mnist(args.width, args.depth, args.heads, rng=args.seed + 1),
                                             device))
    fresh = fresh if precision == "float32" else fluxpy.mixed_precision(fresh, precision)
    if accuracy(fresh, x_test, y_test, device) != history["accuracy"][-1]:
        raise SystemExit("the reloaded model scores differently from the trained one")
    print(f"saved {args.save}; reloaded model: same accuracy")
    print(f"final test accuracy: {100 * history['accuracy'][-1]:.2f}% ({len(x_test)} test images from {source})")
    return history["accuracy"][-1]


if __name__ == "__main__":
    main()
