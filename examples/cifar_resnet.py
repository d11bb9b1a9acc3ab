"""Train ResNet-20 on CIFAR-10 with fluxpy (He et al. 2016, section 4.2).

    python examples/cifar_resnet.py --data-dir ~/data/cifar10 --epochs 30
    python examples/cifar_resnet.py --limit 2000 --test-limit 1000 --epochs 2 --device cpu   # a quick look

The model is ``fluxpy.models.resnet20`` (272,474 parameters): bias-free convolutions, BatchNorm,
identity and projection shortcuts. It trains with SGD with momentum 0.9 and weight decay
(``OptimiserChain(WeightDecay(wd), Momentum(lr, 0.9))``, PyTorch's ``SGD(lr, momentum=0.9,
weight_decay=wd)``) on logitcrossentropy, at a learning rate set every epoch by a schedule of
``fluxpy.schedules``: cosine annealing from ``--lr`` (default 0.1) towards 0 (reached just after
the last epoch) with an optional linear warm-up (``--warmup`` epochs), or ``--schedule step``, He
et al.'s division by 10 at 50% and 75% of the epochs. He et al. use weight decay 1e-4 for 64k
iterations (about 164 epochs); the default here is 5e-4, which suits the shorter cosine runs.

Each batch is augmented where the model is (on the GPU with ``--device gpu``): the uint8 images
are moved there, shifted by a random crop with 4 pixels of zero padding, flipped left to right
with probability 1/2 (``fluxpy.datasets.augment``), then normalised per channel; on the GPU ``train`` then replays
each step from a CUDA graph (its default, recaptured when the schedule changes the rate). Each epoch prints the
mean training loss, the test accuracy (BatchNorm in test mode: its running statistics), the
learning rate, the seconds taken and the training images per second. At the end the script
writes a PNG of the curves (if matplotlib is installed), saves the model (BatchNorm's running
statistics too), loads it into a freshly built model and checks that the test accuracy is unchanged.

Data: ``--data-dir`` holding ``cifar-10-batches-bin/`` (the official binary batches) or the
archive ``cifar-10-binary.tar.gz``; by default the cache folder of ``fluxpy.datasets.load_cifar10``.
Without either the archive is downloaded into that folder (170 MB; created only if the download
succeeds) unless ``--no-download``; where no data can be had the script says what to do and exits
with status 2. ``--seed`` goes to ``fluxpy.seed``: the same seed gives the same initial weights,
batch order and augmentation.

Several GPUs: ``python -m fluxpy.distributed.run --nproc 2 examples/cifar_resnet.py --device gpu`` runs one rank
per GPU (``fluxpy.distributed.init()`` reads the launcher's variables; torchrun or Slurm work too): the model is
wrapped in ``fluxpy.distributed.DataParallel``, each rank trains on its shard of every epoch
(``DataLoader(shard=...)``), ``--batchsize`` is per rank, BatchNorm keeps per-rank statistics unless
``--sync-batchnorm``, and only rank 0 prints, plots and saves. Without the launcher nothing changes.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))      # the examples' shared helpers (common.py)

from common import pick_device, plot_curves, to_device  # noqa: E402
from fluxpy.data import DataLoader, onecold  # noqa: E402
from fluxpy.datasets import (CIFAR10_MEAN, CIFAR10_STD, CIFARUnavailableError, cifar_cache_dir,  # noqa: E402
                             load_cifar10, normalise, random_crop, random_flip)
from fluxpy.distributed import DataParallel, init  # noqa: E402
from fluxpy.io import load, save  # noqa: E402
from fluxpy.layers import testmode, trainmode  # noqa: E402
from fluxpy.losses import logitcrossentropy  # noqa: E402
from fluxpy.models import parameter_count, resnet20  # noqa: E402
from fluxpy.optimise import Momentum, OptimiserChain, WeightDecay, adjust, setup  # noqa: E402
from fluxpy.random import seed  # noqa: E402
from fluxpy.schedules import Cosine, Step  # noqa: E402
from fluxpy.train import train  # noqa: E402

NO_DATA_STATUS = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=None,
                   help="folder with cifar-10-batches-bin/ or cifar-10-binary.tar.gz (default: the fluxpy cache)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batchsize", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate of SGD with momentum (default 0.1)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4, help="L2 decay (default 5e-4; He et al.: 1e-4)")
    p.add_argument("--schedule", choices=["cosine", "step"], default="cosine",
                   help="cosine: from --lr towards 0; step: --lr divided by 10 at 50%% and 75%% of the epochs")
    p.add_argument("--warmup", type=int, default=0, help="epochs of linear warm-up before the cosine (default 0)")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--seed", type=int, default=0, help="for fluxpy.seed: initial weights, batch order, augmentation")
    p.add_argument("--save", default="runs/cifar_resnet20.npz", help="where to save the model")
    p.add_argument("--plot", default="runs/cifar_resnet20.png", help="PNG of the curves")
    p.add_argument("--limit", type=int, default=None, help="train on the first N training images only")
    p.add_argument("--test-limit", type=int, default=None, help="evaluate on the first N test images only")
    p.add_argument("--no-download", action="store_true", help="never download the data")
    p.add_argument("--no-progress", action="store_true", help="no per-batch progress bar")
    p.add_argument("--sync-batchnorm", action="store_true",
                   help="with several ranks: BatchNorm statistics over the global batch (default: per rank)")
    args = p.parse_args(argv)
    for name in ("epochs", "batchsize", "limit", "test_limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 0 <= args.warmup < args.epochs:
        p.error(f"--warmup must be in 0 .. epochs - 1 = {args.epochs - 1}, got {args.warmup}")
    return args


def load_data(args):
    """CIFAR-10's train and test splits as uint8 images and int labels, cut to --limit / --test-limit."""
    download = not args.no_download
    try:
        x_train, y_train = load_cifar10("train", args.data_dir, dtype=np.uint8, download=download)
        x_test, y_test = load_cifar10("test", args.data_dir, dtype=np.uint8, download=download)
    except CIFARUnavailableError as err:
        print(f"no CIFAR-10 data: {err}", file=sys.stderr, flush=True)
        raise SystemExit(NO_DATA_STATUS) from None
    return x_train[:args.limit], y_train[:args.limit], x_test[:args.test_limit], y_test[:args.test_limit]


def make_schedule(args):
    if args.schedule == "step":
        first = max(args.epochs // 2, 1)
        return Step(args.lr, 0.1, [first, max(args.epochs * 3 // 4 - first, 1)])
    # period one longer than the run: the last epoch still trains (at a small rate), 0 would come after it
    return Cosine(args.lr, 0.0, args.epochs - args.warmup + 1, warmup=args.warmup)


def prepare(x, augment=False):
    """A uint8 batch (on its device) as normalised float32, randomly cropped and flipped first when training."""
    if augment:
        x = random_flip(random_crop(x, 4))
    return normalise(x, CIFAR10_MEAN, CIFAR10_STD)


class Augmented:
    """The batches of ``loader``, augmented; a fresh pass (new crops and flips) every time it is iterated."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for x, y in self.loader:
            yield prepare(x, augment=True), y


def _silent(*args, **kw):
    return None


def loss_fn(model, x, y):
    return logitcrossentropy(model(x), y)


def accuracy(model, images, labels, device, batchsize=500):
    """The fraction of ``images`` whose predicted class is the label, with BatchNorm in test mode (left so)."""
    testmode(model)
    correct = 0
    for x, y in DataLoader((images, labels), batchsize=batchsize, device="gpu" if device == "gpu" else None):
        correct += int((onecold(model(prepare(x))) == y).sum())
    return correct / len(labels)


def main(argv=None):
    args = parse_args(argv)
    group = init()   # under python -m fluxpy.distributed.run: this rank's GPU and the others; else a job of one
    say = print if group.is_main else _silent
    device = pick_device(args.device)
    seed(args.seed)  # after the GPU probe, so that CPU and GPU runs start from the same weights
    if not group.is_main:
        group.barrier()   # rank 0 downloads the data first, if it must
    x_train, y_train, x_test, y_test = load_data(args)
    if group.is_main:
        group.barrier()
    where = args.data_dir if args.data_dir is not None else cifar_cache_dir()
    ranks = f", {group.world_size} ranks (batch {args.batchsize} each)" if group.world_size > 1 else ""
    say(f"CIFAR-10: {len(x_train)} training and {len(x_test)} test images from {where}; device: {device}{ranks}")

    model = to_device(resnet20(), device)  # weights from fluxpy's generator, seeded above
    say(f"ResNet-20: {parameter_count(model):,} parameters")
    if group.world_size > 1:
        model = DataParallel(model, group, sync_batchnorm=args.sync_batchnorm)
    opt_state = setup(OptimiserChain(WeightDecay(args.weight_decay), Momentum(args.lr, args.momentum)), model)
    schedule = make_schedule(args)
    say(f"SGD momentum {args.momentum}, weight decay {args.weight_decay}, learning rate {schedule}")
    loader = DataLoader((x_train, y_train), batchsize=args.batchsize, shuffle=True,
                        device="gpu" if device == "gpu" else None, shard=group.env.shard)

    history = {"loss": [], "accuracy": [], "lr": []}
    for epoch in range(1, args.epochs + 1):
        lr = schedule(epoch)
        adjust(opt_state, lr)
        trainmode(model, "auto")  # BatchNorm: batch statistics inside gradient (accuracy() left it in test mode)
        start = time.perf_counter()
        losses = train(loss_fn, model, Augmented(loader), opt_state, progress=not args.no_progress and group.is_main)
        seconds = time.perf_counter() - start
        acc = accuracy(model, x_test, y_test, device)
        history["loss"].append(float(np.mean(losses)))
        history["accuracy"].append(acc)
        history["lr"].append(lr)
        say(f"epoch {epoch:3d}/{args.epochs}: train loss {history['loss'][-1]:.4f}, test accuracy "
              f"{100 * acc:.2f}%, lr {lr:.4g}, {seconds:.1f} s, {len(x_train) / seconds:.0f} images/s", flush=True)

    if not group.is_main:   # rank 0 alone plots and saves; every rank has the same weights
        return history["accuracy"][-1]
    plot_curves(args.plot, history, ("loss", "accuracy", "lr"))
    Path(args.save).parent.mkdir(parents=True, exist_ok=True)
    model = model.module if isinstance(model, DataParallel) else model
    save(args.save, model)
    fresh = load(args.save, to_device(resnet20(rng=args.seed + 1), device))
    reloaded = accuracy(fresh, x_test, y_test, device)
    final = history["accuracy"][-1]
    if reloaded != final:
        raise SystemExit(f"the reloaded model scores {100 * reloaded:.2f}%, the trained one {100 * final:.2f}%")
    print(f"saved {args.save}; reloaded model: same accuracy")
    print(f"final test accuracy: {100 * final:.2f}% ({len(x_test)} test images)")
    return final


if __name__ == "__main__":
    main()
