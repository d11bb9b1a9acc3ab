"""Train a convolutional network on MNIST with fluxpy (the Flux model-zoo example).

    python examples/mnist_conv.py --data-dir ../shared/data/mnist
    python examples/mnist_conv.py --model lenet5 --epochs 10 --device gpu

The default model is the 2019 model-zoo conv net (three 3x3 conv + max-pool stages, then
Dense(288 => 10)); ``--model lenet5`` is today's zoo model. Both train with Adam on
logitcrossentropy. Each epoch prints the mean training loss, the test accuracy, the seconds
taken and the training images per second, and at the end the median speed of the epochs after the
first (which also builds and tunes the cuDNN plans). Then the script writes a PNG of the curves
(if matplotlib is installed), saves the model, loads it into a freshly built model and checks
that the test accuracy is unchanged.

On the GPU the training images stay in host memory (float32, converted once by ``load_mnist``;
the labels one-hot encoded once) and the ``DataLoader`` copies the next batch to the GPU while
the current one trains (``--no-prefetch``: each batch copied when it is needed, to compare), and
``train`` replays each step from a CUDA graph (its default on the GPU), with train's checks kept
(``--no-capture``: ``capture=False``, the eager step, to compare). ``--precision bfloat16`` (or ``float16``) trains the
model through ``fluxpy.mixed_precision``: the half type on tensor cores, float32 master weights (what
is saved).

Data: ``--data-dir`` holding the MNIST IDX files (``train-images-idx3-ubyte.gz`` ..., raw or
gzipped); by default the cache folder of ``fluxpy.datasets.load_mnist``. Missing files are
downloaded into that folder (created only if a download succeeds). Offline, the script trains
on the MNIST subset fluxpy ships (5,000 training images, 500 per digit) and tests on the official
10,000 test images it also ships, and says so; where even that is missing, it prints what to do
and exits with status 2. ``--seed`` goes to ``fluxpy.seed``: the same seed
gives the same initial weights and batch order.

Several GPUs: ``python -m fluxpy.distributed.run --nproc 2 examples/mnist_conv.py --device gpu`` runs one rank
per GPU (``fluxpy.distributed.init()`` reads the launcher's variables; torchrun or Slurm work too). The model is
wrapped in ``fluxpy.distributed.DataParallel`` (gradients averaged over the ranks during the backward pass), each
rank trains on its shard of every epoch (``DataLoader(shard=...)``, the same seed everywhere), ``--batchsize`` is
per rank (the global batch is N times it), and only rank 0 prints, plots and saves. Without the launcher nothing
changes.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))      # the examples' shared helpers (common.py)

import fluxpy  # noqa: E402
from common import pick_device, plot_curves, to_device  # noqa: E402
from fluxpy.data import DataLoader, onecold, onehotbatch  # noqa: E402
from fluxpy.datasets import MNISTUnavailableError, load_mnist, mnist_cache_dir  # noqa: E402
from fluxpy.distributed import DataParallel, init  # noqa: E402
from fluxpy.io import load, save  # noqa: E402
from fluxpy.layers import Chain, Conv, Dense, MaxPool, flatten  # noqa: E402
from fluxpy.losses import logitcrossentropy  # noqa: E402
from fluxpy.ops.activations import relu  # noqa: E402
from fluxpy.optimise import Adam, OptimiserChain, WeightDecay, adjust, setup  # noqa: E402
from fluxpy.random import seed  # noqa: E402
from fluxpy.schedules import Constant, Cosine  # noqa: E402
from fluxpy.train import train  # noqa: E402

# Per model: how to build it and its default learning rate and weight decay.
DEFAULTS = {"conv": dict(lr=5e-3, weight_decay=0.0), "lenet5": dict(lr=3e-4, weight_decay=1e-2)}


def conv_net(rng=None):
    """The Flux model-zoo MNIST conv net of 2019 (the model profiled in Flux issue #558)."""
    return Chain(
        Conv((3, 3), 1, 16, relu, pad=1, rng=rng), MaxPool((2, 2)),
        Conv((3, 3), 16, 32, relu, pad=1, rng=rng), MaxPool((2, 2)),
        Conv((3, 3), 32, 32, relu, pad=1, rng=rng), MaxPool((2, 2)),
        flatten,
        Dense(288, 10, rng=rng))


def lenet5(rng=None):
    """LeNet-5 as in today's Flux model zoo."""
    return Chain(
        Conv((5, 5), 1, 6, relu, rng=rng), MaxPool((2, 2)),
        Conv((5, 5), 6, 16, relu, rng=rng), MaxPool((2, 2)),
        flatten,
        Dense(256, 120, relu, rng=rng), Dense(120, 84, relu, rng=rng), Dense(84, 10, rng=rng))


MODELS = {"conv": conv_net, "lenet5": lenet5}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="conv")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batchsize", type=int, default=128)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 5e-3 conv, 3e-4 lenet5)")
    p.add_argument("--weight-decay", type=float, default=None, help="L2 decay (default: 0 conv, 1e-2 lenet5)")
    p.add_argument("--data-dir", default=None, help="folder with the MNIST IDX files (default: the fluxpy cache)")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--save", default=None, help="where to save the model (default: runs/mnist_<model>.npz)")
    p.add_argument("--plot", default=None, help="PNG of the curves (default: runs/mnist_<model>.png)")
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="learning rate per epoch: cosine decay from --lr to --lr/30, or constant")
    p.add_argument("--seed", type=int, default=0, help="for fluxpy.seed: initial weights and batch order")
    p.add_argument("--no-progress", action="store_true", help="no per-batch progress bar")
    p.add_argument("--no-prefetch", action="store_true",
                   help="move each batch to the GPU when it is needed instead of copying the next one ahead")
    p.add_argument("--no-capture", action="store_true", help="eager steps on the GPU instead of a CUDA graph")
    p.add_argument("--precision", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="run the model in bfloat16 or float16 with float32 master weights (fluxpy.mixed_precision; "
                        "float16 with a dynamic loss scale); the saved model is the float32 one")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.save = args.save or f"runs/mnist_{args.model}.npz"
    args.plot = args.plot or f"runs/mnist_{args.model}.png"
    return args


def accuracy(model, images, labels, device, batchsize=1000):
    """The fraction of ``images`` whose predicted class is the label, evaluated in batches."""
    correct = 0
    for x, y in DataLoader((images, labels), batchsize=batchsize, device=device):
        correct += int((fluxpy.cpu(onecold(model(x))) == fluxpy.cpu(y)).sum())
    return correct / len(labels)


def loss_fn(model, x, y):
    return logitcrossentropy(model(x), y)


def with_precision(model, precision):
    """``model`` as it trains: itself in float32, else wrapped to run in ``precision`` with float32 masters."""
    return model if precision == "float32" else fluxpy.mixed_precision(model, precision)


def masters(model):
    """The float32 model inside the data-parallel and mixed-precision wrappers (what is saved), or the model itself."""
    model = model.module if isinstance(model, DataParallel) else model
    return model.model if isinstance(model, fluxpy.MixedPrecision) else model


def _silent(*args, **kw):
    return None


def make_optimiser(args):
    adam = Adam(args.lr)
    return OptimiserChain(WeightDecay(args.weight_decay), adam) if args.weight_decay else adam


def make_schedule(args):
    """Cosine annealing from ``args.lr`` down to ``args.lr / 30`` in the last epoch, or a constant rate."""
    if args.schedule == "constant":
        return Constant(args.lr)
    return Cosine(args.lr, args.lr / 30, args.epochs)


def load_data(data_dir, say=print):
    """MNIST's train and test splits, and a line saying where they came from (announcing a fallback loudly)."""
    where = data_dir if data_dir is not None else mnist_cache_dir()
    if data_dir is not None and not Path(data_dir).expanduser().is_dir():
        say(f"--data-dir {data_dir} does not exist: trying to download MNIST into it")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            x_train, y_train = load_mnist("train", data_dir)
            x_test, y_test = load_mnist("test", data_dir)
        except MNISTUnavailableError as err:
            raise SystemExit(f"no MNIST data: {err}") from None
    notes = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    for note in dict.fromkeys(notes):
        say(f"NOTE: {note}")
    source = "the MNIST subset shipped with fluxpy (its official test set)" if any(
        "subset shipped with fluxpy" in n for n in notes) else f"the MNIST files in {where}"
    return (x_train, y_train, x_test, y_test), source


def main(argv=None):
    args = parse_args(argv)
    group = init()   # under python -m fluxpy.distributed.run: this rank's GPU and the others; else a job of one
    say = print if group.is_main else _silent
    device = pick_device(args.device)
    seed(args.seed)  # after the GPU probe, so that CPU and GPU runs start from the same weights
    if not group.is_main:
        group.barrier()   # rank 0 downloads the data first, if it must
    (x_train, y_train, x_test, y_test), source = load_data(args.data_dir, say)
    if group.is_main:
        group.barrier()
    ranks = f", {group.world_size} ranks (batch {args.batchsize} each)" if group.world_size > 1 else ""
    say(f"MNIST: {len(x_train)} training and {len(x_test)} test images from {source}; device: {device}{ranks}")

    build = MODELS[args.model]
    model = with_precision(to_device(build(), device), args.precision)   # weights from fluxpy's generator, seeded
    say(model)
    if group.world_size > 1:
        model = DataParallel(model, group)
    opt_state = setup(make_optimiser(args), model)
    schedule = make_schedule(args)
    loader = DataLoader((x_train, onehotbatch(y_train, range(10))), batchsize=args.batchsize, shuffle=True,
                        device="gpu" if device == "gpu" else None, prefetch=not args.no_prefetch,
                        shard=group.env.shard)

    history = {"loss": [], "accuracy": [], "images_per_s": []}
    for epoch in range(1, args.epochs + 1):
        adjust(opt_state, schedule(epoch))
        start = time.perf_counter()
        eager = {"capture": False} if args.no_capture else {}   # captured on the GPU by default
        losses = train(loss_fn, model, loader, opt_state, progress=not args.no_progress and group.is_main, **eager)
        seconds = time.perf_counter() - start
        acc = accuracy(model, x_test, y_test, device)
        history["loss"].append(float(np.mean(losses)))
        history["accuracy"].append(acc)
        history["images_per_s"].append(len(x_train) / seconds)   # every rank trains on its part of them
        say(f"epoch {epoch:2d}/{args.epochs}: train loss {history['loss'][-1]:.4f}, test accuracy {100 * acc:.2f}%, "
              f"{seconds:.2f} s, {history['images_per_s'][-1]:.0f} images/s", flush=True)
    if args.epochs > 1:   # the first epoch also builds and tunes the cuDNN plans
        say(f"training speed: {np.median(history['images_per_s'][1:]):.0f} images/s, the median over epochs 2 to "
              f"{args.epochs} ({'no ' if args.no_prefetch or device != 'gpu' else ''}prefetching, "
              f"{'captured' if device == 'gpu' and not args.no_capture else 'eager'} steps)")

    if not group.is_main:   # rank 0 alone plots and saves; every rank has the same weights
        return history["accuracy"][-1] if history["accuracy"] else None
    plot_curves(args.plot, history)
    Path(args.save).parent.mkdir(parents=True, exist_ok=True)
    save(args.save, masters(model))   # the float32 weights, as a plain model
    fresh = with_precision(load(args.save, to_device(build(np.random.default_rng(args.seed + 1)), device)),
                           args.precision)
    reloaded = accuracy(fresh, x_test, y_test, device)
    final = history["accuracy"][-1] if history["accuracy"] else accuracy(model, x_test, y_test, device)
    if reloaded != final:
        raise SystemExit(f"the reloaded model scores {100 * reloaded:.2f}%, the trained one {100 * final:.2f}%")
    print(f"saved {args.save}; reloaded model: same accuracy")
    print(f"final test accuracy: {100 * final:.2f}% ({len(x_test)} test images from {source})")
    return final


if __name__ == "__main__":
    main()
