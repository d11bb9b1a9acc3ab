"""The training step captured as a CUDA graph: fluxpy's ``TrainStep`` against its eager step, PyTorch eager and
PyTorch's step captured with ``torch.cuda.graph`` (capturable Adam), same weights, same batch.

Nets: the MNIST reference net and LeNet-5 (``models.py``) at batch 128 and 1024, and ResNet-20 at batch 128;
float32, TF32 off on both sides, Adam(1e-3), cross-entropy. PyTorch runs with ``cudnn.benchmark``; its graph
is the documented recipe (warm-up steps on a side stream, ``zero_grad(set_to_none=True)``, one captured
forward, backward and ``Adam(capturable=True).step()``, then ``static_input.copy_()`` + ``replay()`` per step).
fluxpy: ``TrainStep(loss, model, opt_state)`` and ``TrainStep(..., capture=False)``, each step given the batch
(copied into the graph's input buffers by the captured step). The four sides' timed rounds take turns
(``resnet_step.alternating_rounds``); per-step time = round time / steps, median with the 10th and 90th
percentiles over rounds. The first losses of all four are printed as the check of equal weights.

Run: ``python benchmarks/captured_step.py [--cases reference:128,...] [--json out.json]``; ``--smoke`` runs the
fluxpy sides on the CPU for two steps (the eager step there: no graph).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fluxpy  # noqa: E402
from models import MODELS, RESNETS, fluxpy_adam_step, resnet_twin, torch_adam_step, torch_twin  # noqa: E402
from resnet_step import alternating_rounds, round_stats  # noqa: E402

LEARNING_RATE = 1e-3
CASES = "reference:128,lenet5:128,reference:1024,lenet5:1024,resnet20:128"


def make_case(name, batch, seed=0):
    """``(model, x, labels)``: a fresh fluxpy model (CPU) and a batch, the same for every side."""
    rng = np.random.default_rng(seed)
    if name in MODELS:
        return MODELS[name](rng), rng.random((batch, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, batch)
    ctor, shape, classes = RESNETS[name]
    return ctor(rng), rng.standard_normal((batch, *shape), dtype=np.float32), rng.integers(0, classes, batch)


def torch_graph_side(torch, net, x, labels, warmup=3):
    """``(step, first loss)``: PyTorch's step captured as a CUDA graph (capturable Adam), replayed per step."""
    net = net.cuda()
    opt = torch.optim.Adam(net.parameters(), lr=LEARNING_RATE, capturable=True)
    tx, ty = torch.from_numpy(x).cuda(), torch.from_numpy(labels).cuda()
    static_x, static_y = tx.clone(), ty.clone()
    loss_fn = torch.nn.functional.cross_entropy
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = None
        for _ in range(warmup):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(static_x), static_y)
            first = float(loss) if first is None else first
            loss.backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = loss_fn(net(static_x), static_y)
        static_loss.backward()
        opt.step()

    def step():
        static_x.copy_(tx)
        static_y.copy_(ty)
        graph.replay()
        return static_loss
    return step, first


def run_case(torch, name, batch, device, a):
    model, x, labels = make_case(name, batch)
    classes = RESNETS[name][2] if name in RESNETS else 10
    sides, firsts = {}, {}
    if torch is not None:
        twin = resnet_twin if name in RESNETS else torch_twin
        sides["torch eager"], firsts["torch eager"] = torch_adam_step(torch, twin(torch, model).train(), x, labels,
                                                                      device, LEARNING_RATE)
        sides["torch graph"], firsts["torch graph"] = torch_graph_side(torch, twin(torch, model).train(), x, labels)
    for side, capture in (("fluxpy eager", False), ("fluxpy captured", True)):
        sides[side], firsts[side], _ = fluxpy_adam_step(model, x, labels, classes, device, LEARNING_RATE, capture)
    syncs = {k: (torch.cuda.synchronize if k.startswith("torch") else fluxpy_sync(device)) for k in sides}
    names = list(sides)
    per_step = alternating_rounds([(sides[k], syncs[k]) for k in names], a.steps, a.rounds, a.warmup)
    row = dict(benchmark="captured step", model=name, batch=batch, device=device,
               first_losses={k: firsts[k] for k in names})
    for k, times in zip(names, per_step):
        stats = round_stats(times)
        row[f"{k} us"], row[f"{k} p10"], row[f"{k} p90"] = stats["us"], stats["p10_us"], stats["p90_us"]
    c = row["fluxpy captured us"]
    row["captured / eager"] = c / row["fluxpy eager us"]
    row["fluxpy_us"] = c   # the pair run.py's summary compares: captured against PyTorch's captured step
    if torch is not None:
        row["torch_us"] = row["torch graph us"]
        row["captured / torch graph"] = c / row["torch graph us"]
        row["captured / torch eager"] = c / row["torch eager us"]
    return row


def fluxpy_sync(device):
    if device != "gpu":
        return lambda: None
    import cupy
    return cupy.cuda.runtime.deviceSynchronize


def table(rows):
    sides = ["fluxpy captured", "fluxpy eager", "torch graph", "torch eager"]
    lines = ["| model | batch | " + " | ".join(f"{s} us [p10, p90]" for s in sides) +
             " | captured / torch graph | captured / eager | images/s captured |",
             "|---|---:|" + "---:|" * len(sides) + "---:|---:|---:|"]
    for r in rows:
        cells = [f"{r[f'{s} us']:.0f} [{r[f'{s} p10']:.0f}, {r[f'{s} p90']:.0f}]" if f"{s} us" in r else "-"
                 for s in sides]
        ratio = f"{r['captured / torch graph']:.2f}" if "captured / torch graph" in r else "-"
        lines.append(f"| {r['model']} | {r['batch']} | " + " | ".join(cells) +
                     f" | {ratio} | {r['captured / eager']:.2f} | {r['batch'] / (r['fluxpy captured us'] * 1e-6):.0f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=CASES, help="comma-separated MODEL:BATCH")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="fluxpy only, CPU, batch 4, two steps")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.cases, a.steps, a.rounds, a.warmup = "reference:4,resnet20:2", 1, 2, 1
        device, torch = "cpu", None
    else:
        device = "gpu" if fluxpy.gpu_available()[0] else "cpu"
        import torch
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for case in a.cases.split(","):
        name, batch = case.split(":")
        row = run_case(torch, name, int(batch), device, a)
        print(f"{name} batch {batch}: first losses " +
              ", ".join(f"{k} {v:.6f}" for k, v in row["first_losses"].items()), flush=True)
        rows.append(row)
    print("\n" + table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
