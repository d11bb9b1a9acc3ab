"""Port a torchvision ResNet to fluxpy with its weights, fine-tune it in fluxpy, and hand the weights back to PyTorch.

1. ``torchvision.models.resnet18(weights=--weights)``, its last layer replaced for MNIST's 10 classes (``--weights
   DEFAULT`` downloads ImageNet weights where the machine is online; without it the weights are torchvision's
   random initialisation, the same steps either way);
2. ``fluxpy.from_torch(net)``: the same network as a fluxpy model (``CrossCor`` convolutions, ``BatchNorm(relu)``,
   the residual blocks as ``SkipConnection``/``Parallel``), checked: both give the same logits on a batch;
3. ``--steps`` steps of fluxpy training on MNIST digits (grey images repeated to 3 channels, padded to 32x32),
   captured on the GPU, eager on the CPU, then the test accuracy;
4. ``fluxpy.to_torch_state(model, like=net.state_dict())`` back into the torchvision model, checked: PyTorch's
   predictions on the test images are fluxpy's.

Data: as ``mnist_conv.py`` (``--data-dir``, else the cache, else the MNIST subset fluxpy ships).

Needs PyTorch and torchvision (``pip install torch torchvision``). Run: ``python examples/torchvision_resnet.py
[--steps 300] [--device cpu|gpu] [--weights DEFAULT]``
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
from common import pick_device, to_device  # noqa: E402
from mnist_conv import load_data  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batchsize", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weights", default=None, help="torchvision's weights name (DEFAULT downloads ImageNet's)")
    p.add_argument("--test-images", type=int, default=2000, help="how many of the test images to score")
    p.add_argument("--data-dir", default=None, help="folder with the MNIST IDX files (default: the fluxpy cache)")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def as_rgb32(images: np.ndarray) -> np.ndarray:
    """MNIST's ``(N, 1, 28, 28)`` images as ``(N, 3, 32, 32)``: the grey channel three times, 2 pixels of zeros
    around (ImageNet's ResNets take 3 channels; 32 halves evenly down the five stride-2 stages)."""
    return np.pad(np.repeat(images, 3, axis=1), ((0, 0), (0, 0), (2, 2), (2, 2)))


def torchvision_resnet18(weights, torch, torchvision):
    """torchvision's ResNet-18 with ``weights`` and a new 10-class ``fc``, in evaluation mode."""
    torch.manual_seed(0)
    net = torchvision.models.resnet18(weights=weights)
    net.fc = torch.nn.Linear(net.fc.in_features, 10)
    return net.eval()


def predictions(model, images, device, batch=500):
    out = []
    for i in range(0, len(images), batch):
        x = images[i:i + batch]
        out.append(fluxpy.onecold(fluxpy.cpu(model(fluxpy.gpu(x) if device == "gpu" else x))))
    return np.concatenate(out)


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
        import torchvision
    except ImportError:
        raise SystemExit("this example needs PyTorch and torchvision: pip install torch torchvision") from None
    device = pick_device(args.device)
    fluxpy.seed(args.seed)
    (x_train, y_train, x_test, y_test), source = load_data(args.data_dir)
    x_train, x_test = as_rgb32(x_train), as_rgb32(x_test[:args.test_images])
    y_test = y_test[:args.test_images]
    print(f"MNIST: {len(x_train)} training and {len(x_test)} test images from {source}; device: {device}")

    net = torchvision_resnet18(args.weights, torch, torchvision)
    model = fluxpy.from_torch(net)                                   # 2. the same network, the same weights
    with torch.no_grad():
        theirs = net(torch.from_numpy(x_test[:8])).numpy()
    gap = float(np.abs(model(x_test[:8]) - theirs).max())
    print(f"from_torch: {len(fluxpy.trainables(model))} trainable arrays; largest logit difference from PyTorch's "
          f"on 8 images: {gap:.2e}")
    if gap > 1e-3:
        raise SystemExit("the converted model computes something else than PyTorch's")

    model = to_device(model, device)                                 # 3. fine-tune in fluxpy
    opt_state = fluxpy.setup(fluxpy.Adam(args.lr), model)
    loader = fluxpy.DataLoader((x_train, fluxpy.onehotbatch(y_train, range(10))), batchsize=args.batchsize,
                               shuffle=True, device="gpu" if device == "gpu" else None)
    epochs = -(-args.steps // len(loader))
    start = time.perf_counter()
    losses = fluxpy.train(lambda m, x, y: fluxpy.logitcrossentropy(m(x), y), model,
                          (batch for _, batch in zip(range(args.steps), _forever(loader, epochs))), opt_state,
                          progress=False)
    seconds = time.perf_counter() - start
    mine = predictions(model, x_test, device)
    acc = float(np.mean(mine == y_test))
    print(f"{len(losses)} steps in {seconds:.1f} s: loss {np.mean(losses[:10]):.3f} -> {np.mean(losses[-10:]):.3f}, "
          f"test accuracy {100 * acc:.2f}% ({len(x_test)} images)")

    state = fluxpy.to_torch_state(model, like=net.state_dict())       # 4. back into torchvision's model
    net.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
    with torch.no_grad():
        theirs = np.concatenate([net(torch.from_numpy(x_test[i:i + 500])).argmax(1).numpy()
                                 for i in range(0, len(x_test), 500)])
    agree = float(np.mean(theirs == mine))
    print(f"to_torch_state: PyTorch's predictions with the fine-tuned weights agree with fluxpy's on "
          f"{100 * agree:.2f}% of the test images")
    if agree < 0.99:
        raise SystemExit("the weights handed back to PyTorch predict otherwise")
    return acc


def _forever(loader, epochs):
    for _ in range(epochs):
        yield from loader


if __name__ == "__main__":
    main()
