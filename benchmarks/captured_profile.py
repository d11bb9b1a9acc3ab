"""Where the captured step's GPU time goes: its kernels, in GPU time, for fluxpy's and PyTorch's captured steps.

The two steps of ``captured_step.py`` (fluxpy's ``TrainStep`` replayed from its CUDA graph, PyTorch's step
captured with ``torch.cuda.graph`` and ``Adam(capturable=True)``), same weights, same batch, each replayed
``--steps`` times under ``torch.profiler`` (CUPTI records every kernel a graph launches, CuPy's and cuDNN's as
PyTorch's own). Per side: the kernels grouped by what they do (batch norm, convolution forward / backward data /
backward filter, matmul, pooling, the loss, the optimiser update, other elementwise), GPU microseconds per step, the
kernel count per step, and the wall time per step measured outside the profiler. The busiest kernels are listed
by name too.

Run: ``python benchmarks/captured_profile.py [--cases reference:128,resnet20:128] [--steps 50] [--json out.json]``
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from captured_step import LEARNING_RATE, make_case, torch_graph_side  # noqa: E402
from models import RESNETS, fluxpy_adam_step, resnet_twin, torch_twin  # noqa: E402

# What a kernel does, from its name: the first pattern (lower case) that the name contains wins.
KINDS = [
    ("batch norm", ("bn_", "batchnorm", "batch_norm")),
    ("conv backward filter", ("wgrad", "dgrad_filter", "convolve_wgrad", "bwd_filter", "backward_filter")),
    ("conv backward data", ("dgrad", "bwd_data", "backward_data")),
    ("conv forward", ("fprop", "conv", "winograd", "cudnn")),
    ("matmul", ("gemm", "sgemm", "cublas", "cutlass", "matmul", "ampere_", "sm90_")),
    ("pooling", ("pool", "fluxpy_max")),
    ("optimiser update", ("optimiser", "fx_step_many", "adam", "momentum", "descent", "sgd")),
    ("loss and softmax", ("softmax", "logsoftmax", "crossentropy", "nll", "logit")),
    ("reductions", ("reduce", "sum", "mapreduce", "nonfinite", "segments")),
]


def kind_of(name):
    low = name.lower()
    for kind, patterns in KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other elementwise"


def profile_side(torch, step, steps):
    """``(kernels, wall_us)``: {kernel name: (GPU us per step, launches per step)} over ``steps`` replays."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for evt in prof.events():
        if evt.device_type.name != "CUDA" or "memcpy" in evt.name.lower() or "memset" in evt.name.lower():
            continue
        us, n = kernels.get(evt.name, (0.0, 0))
        kernels[evt.name] = (us + evt.device_time / steps, n + 1 / steps)
    return kernels, wall


def by_kind(kernels):
    out = {}
    for name, (us, n) in kernels.items():
        k = kind_of(name)
        a, b = out.get(k, (0.0, 0.0))
        out[k] = (a + us, b + n)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="reference:128,resnet20:128")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()}; {args.steps} replays profiled per side")
    results = []
    for case in args.cases.split(","):
        name, batch = case.split(":")
        model, x, labels = make_case(name, int(batch))
        classes = RESNETS[name][2] if name in RESNETS else 10
        fstep, _, _ = fluxpy_adam_step(model, x, labels, classes, "gpu", LEARNING_RATE, capture=True)
        for _ in range(3):
            fstep()   # warm-up steps, then the capture
        twin = resnet_twin if name in RESNETS else torch_twin
        tstep, _ = torch_graph_side(torch, twin(torch, model).train(), x, labels)
        sides = {}
        for side, step in (("fluxpy", fstep), ("PyTorch", tstep)):
            kernels, wall = profile_side(torch, step, args.steps)
            sides[side] = {"wall_us": wall, "kernels": kernels, "kinds": by_kind(kernels)}
        totals = {side: sum(us for us, _ in sides[side]["kernels"].values()) for side in sides}
        # run.py's summary compares the GPU time of the two captured steps' kernels
        results.append({"case": case, "fluxpy_us": totals["fluxpy"], "torch_us": totals["PyTorch"], **sides})
        print(f"\n### {case}: GPU microseconds per step by kind of kernel (launches per step)\n")
        kinds = sorted(set(sides["fluxpy"]["kinds"]) | set(sides["PyTorch"]["kinds"]),
                       key=lambda k: -sides["fluxpy"]["kinds"].get(k, (0, 0))[0])
        print("| kind | fluxpy us | fluxpy kernels | PyTorch us | PyTorch kernels |\n|---|---:|---:|---:|---:|")
        for k in kinds:
            f = sides["fluxpy"]["kinds"].get(k, (0.0, 0.0))
            t = sides["PyTorch"]["kinds"].get(k, (0.0, 0.0))
            print(f"| {k} | {f[0]:.1f} | {f[1]:.0f} | {t[0]:.1f} | {t[1]:.0f} |")
        ftot, ttot = totals["fluxpy"], totals["PyTorch"]
        fn = sum(v[1] for v in sides["fluxpy"]["kernels"].values())
        tn = sum(v[1] for v in sides["PyTorch"]["kernels"].values())
        print(f"| **all kernels** | **{ftot:.1f}** | {fn:.0f} | **{ttot:.1f}** | {tn:.0f} |")
        print(f"| wall time per replayed step | {sides['fluxpy']['wall_us']:.1f} | | {sides['PyTorch']['wall_us']:.1f} | |")
        for side in ("fluxpy", "PyTorch"):
            top = sorted(sides[side]["kernels"].items(), key=lambda kv: -kv[1][0])[:args.top]
            print(f"\n{side}'s busiest kernels ({case}): " + "; ".join(
                f"{n[:70]} {us:.1f} us x{c:.0f}" for n, (us, c) in top))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
