"""One rank of the GPU data-parallel tests (``test_distributed_gpu.py`` starts it through the launcher).

``--mode train``: train a small conv net (conv, optional BatchNorm, pool, dense) for ``--steps`` batches of
``--batch`` per rank, wrapped in DataParallel, and save every rank's arrays to ``OUT.rank{r}.npz``. The data is
the same on every rank and in a one-process run (a seeded generator), and each rank takes its shard of every
batch (``DataLoader(shard=...)``), so that N ranks at batch B see what one process sees at batch N*B.
``--mode raise``: rank 1 raises in its third step. ``--mode mismatch``: rank 1 builds a wider last layer.
"""
import argparse
import faulthandler
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fluxpy  # noqa: E402
from fluxpy import DataLoader  # noqa: E402
from fluxpy.distributed import DataParallel, init  # noqa: E402
from fluxpy.functors import arrays, fmap  # noqa: E402
from fluxpy.layers import BatchNorm, Chain, Conv, Dense, MaxPool, flatten  # noqa: E402
from fluxpy.losses import logitcrossentropy  # noqa: E402
from fluxpy.optimise import Adam, Momentum, setup  # noqa: E402
from fluxpy.ops.activations import relu  # noqa: E402
from fluxpy.train import train  # noqa: E402


def net(bn, classes=10):
    # before a BatchNorm a conv has no bias: its gradient would be rounding noise, which Adam scales up to full steps
    layers = [Conv((3, 3), 3, 8, relu if not bn else fluxpy.identity, pad=1, bias=not bn, rng=1)]
    layers += [BatchNorm(8, relu)] if bn else []
    layers += [MaxPool((2, 2)), Conv((3, 3), 8, 8, relu, pad=1, rng=2), MaxPool((2, 2)), flatten,
               Dense(8 * 4 * 4, 32, relu, rng=3), Dense(32, classes, rng=4)]
    return Chain(*layers)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["train", "raise", "mismatch"], default="train")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16, help="per rank")
    p.add_argument("--bn", action="store_true", help="with BatchNorm (synchronised across ranks)")
    p.add_argument("--rule", choices=["momentum", "adam"], default="momentum")
    p.add_argument("--float64", action="store_true", help="the model and the data in float64")
    p.add_argument("--capture", action="store_true", help="train(..., capture=True): CUDA graphs")
    p.add_argument("--out", default=None)
    p.add_argument("--cpu", action="store_true", help="NumPy arrays (a one-process smoke run without a GPU)")
    p.add_argument("--dump-after", type=float, default=0.0, help="seconds: then print every thread's stack")
    a = p.parse_args()
    if a.dump_after > 0:   # a stalled job shows where each rank stood before the test stops it
        faulthandler.dump_traceback_later(a.dump_after, exit=False)
    group = init(timeout=120, collective_timeout=60)
    world, rank = group.world_size, group.rank
    rng = np.random.default_rng(0)
    n = a.steps * a.batch * world
    x = rng.standard_normal((n, 3, 16, 16), dtype=np.float32)
    y = fluxpy.onehotbatch(rng.integers(0, 10, n), range(10))
    model = net(a.bn, classes=11 if a.mode == "mismatch" and rank == 1 else 10)
    if a.float64:
        model = fmap(lambda v: v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype == np.float32 else v,
                     model)
        x, y = x.astype(np.float64), y.astype(np.float64)
    move = (lambda t: t) if a.cpu else fluxpy.gpu
    model = move(model)
    dp = DataParallel(model, bucket_mb=0.005, first_bucket_mb=0.002, sync_batchnorm=a.bn)
    rule = Momentum(0.05, 0.9) if a.rule == "momentum" else Adam(1e-3)
    opt = setup(rule, dp)
    batches = [move(b) for b in DataLoader((x, y), batchsize=a.batch, shuffle=False, shard=group.env.shard)]
    calls = [0]

    def loss(m, x, y):
        calls[0] += 1
        if a.mode == "raise" and rank == 1 and calls[0] == 3:
            raise RuntimeError("boom on rank 1 in step 3")
        return logitcrossentropy(m(x), y)
    losses = train(loss, dp, batches, opt, progress=False, capture=a.capture)
    if a.out:
        np.savez(f"{a.out}.rank{rank}.npz", *[fluxpy.cpu(v) for v in arrays(model)])
    print(f"rank {rank} of {world}: {len(dp.buckets)} buckets, losses {losses[0]:.5f} .. {losses[-1]:.5f}",
          flush=True)
    group.destroy()


if __name__ == "__main__":
    main()
