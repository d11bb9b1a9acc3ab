"""cuDNN backend-graph convolutions (fluxpy.kernels.cudnn.graph) vs the legacy calls (fluxpy.kernels.cudnn.legacy)
vs PyTorch.

Per layer and operation (float32, cross-correlation, TF32 off everywhere; PyTorch with
``torch.backends.cudnn.benchmark=True``):

- ``fwd``: conv + bias + relu (graph: one plan conv -> add -> relu; legacy: cudnnConvolutionBiasActivationForward;
  torch: ``relu(conv2d(x, w, b))``);
- ``bwd_data`` / ``bwd_filter``: (torch: ``aten.convolution_backward`` with one output mask).

``wall``: microseconds per call of ``iters`` back-to-back calls with one final synchronize (host and GPU
overlapped, as in a training step), median of ``reps``; ``cpu``: host CPU time per call (``time.thread_time``)
over the same calls. Kernel-level calls (no op layer, no tape). ``PYTHONPATH=. python3 benchmarks/cudnn_graph.py``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

LAYERS = [("mnist1 1>16 28", 128, 1, 28, 16), ("mnist2 16>32 14", 128, 16, 14, 32),
          ("mnist3 32>32 7", 128, 32, 7, 32), ("r50 64>64 56 N8", 8, 64, 56, 64)]


def measure(cp, fn, iters, reps, warm=5):
    for _ in range(warm):
        fn()
    cp.cuda.Device().synchronize()
    walls, cpus = [], []
    for _ in range(reps):
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(iters):
            fn()
        c1 = time.thread_time()
        cp.cuda.Device().synchronize()
        t1 = time.perf_counter()
        walls.append((t1 - t0) / iters * 1e6)
        cpus.append((c1 - c0) / iters * 1e6)
    return statistics.median(walls), statistics.median(cpus)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import cupy as cp
    import numpy as np

    from fluxpy.kernels import cudnn
    from fluxpy.kernels.cudnn import graph as cudnn_graph
    from fluxpy.kernels.cudnn import legacy
    from fluxpy.ops.dims import ConvDims
    from fluxpy.options import options

    options.set(allow_tf32=False)
    try:
        import torch
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    except Exception as err:   # torch is a reference, not a dependency
        print("no torch:", err)
        torch = None

    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["name"]
    name = name.decode() if isinstance(name, bytes) else name
    rows = []
    rng = np.random.default_rng(0)
    for label, n, c, h, k in LAYERS:
        x = cp.asarray(rng.standard_normal((n, c, h, h)).astype(np.float32))
        w = cp.asarray(rng.standard_normal((k, c, 3, 3)).astype(np.float32) * 0.1)
        b = cp.asarray(rng.standard_normal(k).astype(np.float32))
        cd = ConvDims.from_arrays(x, w, pad=1, flipped=True)
        dy = cp.asarray(rng.standard_normal(cd.y_shape).astype(np.float32))
        impls = {
            "graph": (lambda: cudnn_graph.conv_bias_act_forward(x, w, b, "relu", cd),
                      lambda: cudnn_graph.conv_backward_data(dy, w, cd),
                      lambda: cudnn_graph.conv_backward_filter(x, dy, cd)),
            "legacy": (lambda: legacy.conv_bias_act_forward(x, w, b, "relu", cd),
                       lambda: legacy.conv_backward_data(dy, w, cd),
                       lambda: legacy.conv_backward_filter(x, dy, cd)),
        }
        if torch is not None:
            tx, tw, tb, tdy = (torch.as_tensor(a, device="cuda") for a in (x, w, b, dy))
            cb = torch.ops.aten.convolution_backward
            F = torch.nn.functional
            impls["torch"] = (
                lambda: torch.relu(F.conv2d(tx, tw, tb, padding=1)),
                lambda: cb(tdy, tx, tw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False]),
                lambda: cb(tdy, tx, tw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False]))
        # correctness vs legacy first
        errs = []
        for g, l in zip(impls["graph"], impls["legacy"]):
            a, r = g(), l()
            errs.append(float(cp.linalg.norm(a - r) / cp.linalg.norm(r)))
        row = {"layer": label, "rel_err_vs_legacy": errs}
        for impl, fns in impls.items():
            for op, fn in zip(("fwd", "bwd_data", "bwd_filter"), fns):
                wall, cpu = measure(cp, fn, args.iters, args.reps)
                row[f"{op}_{impl}_wall"], row[f"{op}_{impl}_cpu"] = wall, cpu
        rows.append(row)
        print(row, flush=True)

    impls = ["graph", "legacy"] + (["torch"] if torch is not None else [])
    print(f"\n## cuDNN graph vs legacy vs PyTorch on {name}, cuDNN {cudnn.version()}, float32, TF32 off "
          f"(us per call: wall = back-to-back calls + final sync / cpu = host CPU time)\n")
    head = "| layer | op | " + " | ".join(f"{i} wall | {i} cpu" for i in impls) + " | graph/legacy | graph/torch |"
    print(head)
    print("|" + "---|" * (2 + 2 * len(impls) + 2))
    for row in rows:
        for op in ("fwd", "bwd_data", "bwd_filter"):
            cells = " | ".join(f"{row[f'{op}_{i}_wall']:.1f} | {row[f'{op}_{i}_cpu']:.1f}" for i in impls)
            gl = row[f"{op}_graph_wall"] / row[f"{op}_legacy_wall"]
            gt = row[f"{op}_graph_wall"] / row[f"{op}_torch_wall"] if torch is not None else float("nan")
            print(f"| {row['layer']} | {op} | {cells} | {gl:.2f} | {gt:.2f} |")
    # which path other problems take (graph or legacy fallback)
    for label, dtype, groups, flipped in (("float64", np.float64, 1, True), ("groups=2", np.float32, 2, True),
                                          ("true convolution", np.float32, 1, False)):
        x = cp.asarray(rng.standard_normal((4, 8, 12, 12)).astype(dtype))
        w = cp.asarray(rng.standard_normal((8, 8 // groups, 3, 3)).astype(dtype))
        b = cp.asarray(rng.standard_normal(8).astype(dtype))
        cd = ConvDims.from_arrays(x, w, pad=1, groups=groups, flipped=flipped)
        s0 = cudnn_graph.stats()
        cudnn_graph.conv_bias_act_forward(x, w, b, "relu", cd)
        cudnn_graph.conv_backward_data(cudnn_graph.conv_forward(x, w, cd), w, cd)
        cudnn_graph.conv_backward_filter(x, cudnn_graph.conv_forward(x, w, cd), cd)
        s1 = cudnn_graph.stats()
        print(f"{label}: {s1['executes'] - s0['executes']} graph executions, "
              f"{s1['fallbacks'] - s0['fallbacks']} legacy fallbacks")
    print("\nstats:", cudnn_graph.stats())
    print("fallbacks:", cudnn_graph.fallback_reasons())
    for info in cudnn_graph.plan_info():
        print("plan:", info)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
