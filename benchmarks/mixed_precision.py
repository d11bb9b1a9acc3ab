"""Training steps in bfloat16 and float16: fluxpy's ``mixed_precision`` against PyTorch ``autocast`` with
channels-last memory and fused Adam, and against each side's float32 step.

Nets (``models.py``): ResNet-20 (3x32x32) at batch 128 and 512, ResNet-18 at 3x64x64 batch 64, and the MNIST
reference net and LeNet-5 at batch 128. Same weights on every side (float32 masters), same batch, Adam(1e-3),
cross-entropy. Sides, each timed in rounds that take turns (``resnet_step.alternating_rounds``):

- fluxpy float32: ``TrainStep`` (captured as a CUDA graph; ``--eager`` for the eager step);
- fluxpy mixed: ``mixed_precision(model, dtype, memory="contiguous")`` in the same ``TrainStep``;
- fluxpy float32 CL and mixed CL: the same two with the weights and batch in channels-last memory
  (``fluxpy.gpu(model, memory="channels_last")``; mixed CL is ``mixed_precision``'s default,
  ``memory="channels_last"``; ``--no-channels-last`` leaves them out);
- PyTorch float32: eager, ``cudnn.benchmark``, ``Adam(fused=True)``;
- PyTorch autocast: the same step under ``torch.autocast("cuda", dtype)``, the model and batch in
  ``torch.channels_last`` memory, ``GradScaler`` for float16 (PyTorch's documented recipe).

TF32 off on both sides (float32 is float32). Per-step time = round time / steps; median and the 10th-90th
percentiles over rounds; the ratio ``fluxpy mixed / PyTorch autocast`` (below 1: fluxpy faster) and ``fluxpy mixed
/ fluxpy float32`` per case. The first losses of the four sides are printed as the check of equal weights (the
half sides agree to the half type's precision).

Run: ``python benchmarks/mixed_precision.py [--dtype bfloat16,float16] [--cases resnet20:128,...] [--json out]``
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fluxpy  # noqa: E402
import captured_step  # noqa: E402
from models import RESNETS, resnet_twin, torch_twin  # noqa: E402
from resnet_step import alternating_rounds, reset_case, round_stats, set_tf32  # noqa: E402

LEARNING_RATE = 1e-3
CASES = "resnet20:128,resnet20:512,resnet18:64,reference:128,lenet5:128"


def make_case(name, batch, seed=0):
    """``(model, x, labels, classes)``: ``captured_step.make_case`` and the number of classes."""
    model, x, labels = captured_step.make_case(name, batch, seed)
    return model, x, labels, RESNETS[name][2] if name in RESNETS else 10


def fluxpy_side(model, x, labels, classes, dtype, capture, memory=None):
    """``(step, first loss)``: a ``TrainStep`` of a GPU copy of ``model`` (wrapped in ``mixed_precision`` for a
    half ``dtype``), its weights and batch moved to ``memory`` (``"channels_last"``, or None: C order)."""
    import copy
    m = fluxpy.gpu(copy.deepcopy(model), memory=memory)
    if dtype != "float32":
        m = fluxpy.mixed_precision(m, dtype, memory=memory or "contiguous")
    gx, gy = fluxpy.gpu(x, memory=memory), fluxpy.gpu(fluxpy.onehotbatch(labels, range(classes)))
    step = fluxpy.TrainStep(lambda m, x, y: fluxpy.logitcrossentropy(m(x), y), m,
                            fluxpy.setup(fluxpy.Adam(LEARNING_RATE), m), capture=capture)
    first = float(step(gx, gy))
    return (lambda: step(gx, gy)), first


def torch_side(torch, model, name, x, labels, dtype):
    """``(step, first loss)``: PyTorch's step of the same weights, float32 or under autocast + channels-last."""
    twin = (resnet_twin if name in RESNETS else torch_twin)(torch, model).train().cuda()
    half = dtype != "float32"
    tx, ty = torch.from_numpy(x).cuda(), torch.from_numpy(labels).cuda()
    if half:
        twin = twin.to(memory_format=torch.channels_last)
        tx = tx.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.Adam(twin.parameters(), lr=LEARNING_RATE, fused=True)
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == "float16")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=tdtype, enabled=half):
            loss = torch.nn.functional.cross_entropy(twin(tx), ty)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()
    return step, float(step())


def run_case(torch, name, batch, dtype, a):
    model, x, labels, classes = make_case(name, batch)
    reset_case(torch, "gpu")
    sides, firsts = {}, {}
    sides["torch float32"], firsts["torch float32"] = torch_side(torch, model, name, x, labels, "float32")
    sides["torch autocast"], firsts["torch autocast"] = torch_side(torch, model, name, x, labels, dtype)
    sides["fluxpy float32"], firsts["fluxpy float32"] = fluxpy_side(model, x, labels, classes, "float32",
                                                                    not a.eager)
    sides["fluxpy mixed"], firsts["fluxpy mixed"] = fluxpy_side(model, x, labels, classes, dtype, not a.eager)
    if not a.no_channels_last:
        for k, dt in (("fluxpy float32 CL", "float32"), ("fluxpy mixed CL", dtype)):
            sides[k], firsts[k] = fluxpy_side(model, x, labels, classes, dt, not a.eager, "channels_last")
    import cupy
    sync = {k: torch.cuda.synchronize if k.startswith("torch") else cupy.cuda.Device().synchronize for k in sides}
    names = list(sides)
    times = alternating_rounds([(sides[k], sync[k]) for k in names], a.steps, a.rounds, a.warmup)
    row = dict(benchmark="mixed precision", model=name, batch=batch, dtype=dtype, first_losses=firsts)
    for k, t in zip(names, times):
        row[f"{k} us"] = round_stats(t)["us"]
        row[f"{k} p10"], row[f"{k} p90"] = round_stats(t)["p10_us"], round_stats(t)["p90_us"]
    row["mixed / torch autocast"] = row["fluxpy mixed us"] / row["torch autocast us"]
    row["mixed / fluxpy float32"] = row["fluxpy mixed us"] / row["fluxpy float32 us"]
    best = "fluxpy mixed"
    if "fluxpy mixed CL us" in row:
        row["mixed CL / torch autocast"] = row["fluxpy mixed CL us"] / row["torch autocast us"]
        row["mixed CL / fluxpy float32"] = row["fluxpy mixed CL us"] / row["fluxpy float32 us"]
        row["float32 CL / float32"] = row["fluxpy float32 CL us"] / row["fluxpy float32 us"]
        best = min(("fluxpy mixed", "fluxpy mixed CL"), key=lambda k: row[f"{k} us"])
    row["fluxpy_us"], row["torch_us"] = row[f"{best} us"], row["torch autocast us"]   # run.py's summary pair
    print(f"{name} batch {batch} {dtype}: first losses " + ", ".join(f"{k} {v:.4f}" for k, v in firsts.items()),
          flush=True)
    return row


def table(rows):
    cl = all("fluxpy mixed CL us" in r for r in rows)
    head = ("| model | batch | dtype | fluxpy mixed us [p10, p90] | PyTorch autocast us | fluxpy float32 us | "
            "PyTorch float32 us | mixed / autocast | mixed / fluxpy float32 |")
    rule = "|---|---:|---|---:|---:|---:|---:|---:|---:|"
    if cl:
        head += (" mixed CL us [p10, p90] | float32 CL us | mixed CL / autocast | mixed CL / fluxpy float32 | "
                 "float32 CL / float32 |")
        rule += "---:|---:|---:|---:|---:|"
    lines = [head, rule]
    for r in rows:
        line = (f"| {r['model']} | {r['batch']} | {r['dtype']} | {r['fluxpy mixed us']:.0f} "
                f"[{r['fluxpy mixed p10']:.0f}, {r['fluxpy mixed p90']:.0f}] | {r['torch autocast us']:.0f} | "
                f"{r['fluxpy float32 us']:.0f} | {r['torch float32 us']:.0f} | "
                f"{r['mixed / torch autocast']:.2f} | {r['mixed / fluxpy float32']:.2f} |")
        if cl:
            line += (f" {r['fluxpy mixed CL us']:.0f} [{r['fluxpy mixed CL p10']:.0f}, {r['fluxpy mixed CL p90']:.0f}]"
                     f" | {r['fluxpy float32 CL us']:.0f} | {r['mixed CL / torch autocast']:.2f} | "
                     f"{r['mixed CL / fluxpy float32']:.2f} | {r['float32 CL / float32']:.2f} |")
        lines.append(line)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=CASES)
    p.add_argument("--dtype", default="bfloat16,float16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--eager", action="store_true", help="fluxpy's eager step instead of the captured one")
    p.add_argument("--no-channels-last", action="store_true", help="leave out the channels-last fluxpy sides")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch
    torch.backends.cudnn.benchmark = True
    set_tf32(False, torch, "gpu")
    print(f"GPU: {torch.cuda.get_device_name()}; fluxpy {'eager' if a.eager else 'captured'} steps")
    rows = []
    for dtype in a.dtype.split(","):
        for case in a.cases.split(","):
            name, batch = case.split(":")
            rows.append(run_case(torch, name, int(batch), dtype, a))
    print("\n" + table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
