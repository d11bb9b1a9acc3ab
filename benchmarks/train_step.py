"""One training step on the GPU (forward, backward, Adam update): fluxpy eager against PyTorch eager.

Both nets of ``../shared/DESIGN.md`` (the model-zoo conv net, "reference", and LeNet-5) at batch
128 and 1024, float32, on one GPU in one run. PyTorch runs with ``cudnn.benchmark`` on and TF32
off (cuDNN and matmul); fluxpy with TF32 off (its default). Both start from the same weights and
batch (the first losses are printed as a check). Steps are launched back to back with no
per-step synchronisation, as a training loop that logs every few steps would; the time per step
is the wall time of ``--steps`` steps after a synchronisation, divided by their number, median
over ``--rounds`` rounds.

Run: ``python benchmarks/train_step.py [--batches 128,1024] [--models reference,lenet5] [--json out.json]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fluxpy  # noqa: E402
from models import MODELS, fluxpy_adam_step, torch_adam_step, torch_twin  # noqa: E402
from resnet_step import timed_rounds  # noqa: E402

LEARNING_RATE = 1e-3


def _timed_rounds(step, sync, steps, rounds, warmup):
    return statistics.median(timed_rounds(step, sync, steps, rounds, warmup))


def fluxpy_case(model, x, labels, device):
    """``(step, first loss, model)`` of fluxpy's eager step on a copy of ``model`` (see ``models.fluxpy_adam_step``)."""
    return fluxpy_adam_step(model, x, labels, 10, device, LEARNING_RATE)


def torch_case(torch, model_cpu, x, labels, device):
    """``(step, first loss)`` of the PyTorch twin of ``model_cpu`` (its weights copied before fluxpy trains)."""
    return torch_adam_step(torch, torch_twin(torch, model_cpu), x, labels, device, LEARNING_RATE)


def run(batches=(128, 1024), models=("reference", "lenet5"), steps=50, rounds=5, warmup=10, device=None,
        profile_case=None):
    """Rows of ``{model, batch, fluxpy_us, torch_us, ratio, ...}`` measured in this process."""
    import torch
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    device = device or ("gpu" if fluxpy.gpu_available()[0] else "cpu")
    if device == "gpu":
        import cupy
        sync = cupy.cuda.runtime.deviceSynchronize
        torch_sync = torch.cuda.synchronize
    else:
        sync = torch_sync = (lambda: None)
    rows = []
    for name in models:
        for batch in batches:
            rng = np.random.default_rng(0)
            model = MODELS[name](rng)
            x = rng.random((batch, 1, 28, 28), dtype=np.float32)
            labels = rng.integers(0, 10, batch)
            t_step, t_first = torch_case(torch, model, x, labels, device)   # copies the weights first
            f_step, f_first, f_model = fluxpy_case(model, x, labels, device)
            f_time = _timed_rounds(f_step, sync, steps, rounds, warmup)
            t_time = _timed_rounds(t_step, torch_sync, steps, rounds, warmup)
            rows.append(dict(benchmark="train step", model=name, batch=batch, device=device,
                             fluxpy_us=f_time * 1e6, torch_us=t_time * 1e6, ratio=f_time / t_time,
                             fluxpy_images_per_s=batch / f_time, torch_images_per_s=batch / t_time,
                             first_loss_fluxpy=f_first, first_loss_torch=t_first))
            if profile_case == (name, batch):
                with fluxpy.profile():
                    f_step()
                    sync()
    return rows


def table(rows):
    lines = ["| model | batch | fluxpy us/step | PyTorch us/step | ratio fluxpy/PyTorch | fluxpy images/s | "
             "first loss fluxpy / PyTorch |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['fluxpy_us']:.0f} | {r['torch_us']:.0f} | "
                     f"{r['ratio']:.2f} | {r['fluxpy_images_per_s']:.0f} | "
                     f"{r['first_loss_fluxpy']:.5f} / {r['first_loss_torch']:.5f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="128,1024")
    p.add_argument("--models", default="reference,lenet5")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", choices=["gpu", "cpu"], default=None)
    p.add_argument("--profile", default=None, help="MODEL,BATCH: print fluxpy.profile() of one step of that case")
    p.add_argument("--json")
    a = p.parse_args(argv)
    prof = None
    if a.profile:
        m, b = a.profile.split(",")
        prof = (m, int(b))
    rows = run(tuple(int(b) for b in a.batches.split(",")), tuple(a.models.split(",")), a.steps, a.rounds,
               device=a.device, profile_case=prof)
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
