"""Dense layers with fused epilogues: a transformer MLP's forward + backward, fluxpy's ``dense`` fused (cuBLASLt
epilogues, :mod:`fluxpy.kernels.cublaslt`) against the same op unfused (``bias_act(matmul(x, w.T), b, act)``, what
``Dense`` ran before) and PyTorch (``F.linear`` and ``F.gelu(approximate="tanh")``, eager, and eager under
``autocast(bfloat16)``).

Cases (rows x width -> hidden, gelu -> width):

- ``vit``: 16384 x 192 -> 768 -> 192 (a small ViT's MLP: 256 images of 64 tokens);
- ``gpt``: 8192 x 768 -> 3072 -> 768 (a GPT-2 small MLP: 8 sequences of 1024 tokens).

Each in float32 (TF32 off on both sides) and bfloat16 (fluxpy's arrays in bfloat16; PyTorch's parameters in
bfloat16, and float32 under autocast). One call is ``y = mlp(x)`` and the gradients of ``<y, dy>`` with respect to
x and the four parameters (fluxpy: ``fluxpy.pullback``; PyTorch: ``torch.autograd.grad``). Measured per call, median
over ``--rounds`` of ``--reps`` calls: GPU time between CUDA events on the stream, and host time (the wall time to
queue the calls, the device not waited for). Also printed: the counts of cuBLASLt calls, proving the fused path ran.

Run (on a GPU): ``PYTHONPATH=. python3 benchmarks/dense.py [--cases vit,gpt] [--dtypes float32,bfloat16]
[--reps 20] [--rounds 7] [--json out.json]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import fluxpy  # noqa: E402
from fluxpy.kernels import cublaslt  # noqa: E402
from fluxpy.kernels.halfs import BFLOAT16  # noqa: E402
from fluxpy.ops import bias_act, dense, gelu, identity, matmul, transpose  # noqa: E402

CASES = {"vit": (16384, 192, 768), "gpt": (8192, 768, 3072)}


def _fluxpy_mlp(fused):
    def layer(x, w, b, act):
        return dense(x, w, b, act) if fused else bias_act(matmul(x, transpose(w)), b, act)

    def mlp(x, w1, b1, w2, b2):
        return layer(layer(x, w1, b1, gelu), w2, b2, identity)
    return mlp


def _fluxpy_call(fused, arrays, dy):
    mlp = _fluxpy_mlp(fused)

    def call():
        y, back = fluxpy.pullback(mlp, *arrays)
        return back(dy)
    return call


def _torch_call(torch, arrays, dy, autocast):
    import torch.nn.functional as F

    def mlp(x, w1, b1, w2, b2):
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    def call():
        if autocast:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = mlp(*arrays)
        else:
            y = mlp(*arrays)
        return torch.autograd.grad(y, arrays, dy)
    return call


def _time(call, sync, event, elapsed_ms, reps, rounds):
    """``(GPU us, host us)`` per call: medians over ``rounds`` of ``reps`` calls."""
    call()
    sync()
    gpu, host = [], []
    for _ in range(rounds):
        start, end = event(), event()
        start.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        gpu.append(elapsed_ms(start, end) * 1e3 / reps)
        host.append((t1 - t0) * 1e6 / reps)
    return statistics.median(gpu), statistics.median(host)


def _host_arrays(case, seed=0):
    rows, width, hidden = CASES[case]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    w1 = (rng.standard_normal((hidden, width)) / np.sqrt(width)).astype(np.float32)
    b1 = rng.standard_normal(hidden).astype(np.float32) * 0.1
    w2 = (rng.standard_normal((width, hidden)) / np.sqrt(hidden)).astype(np.float32)
    b2 = rng.standard_normal(width).astype(np.float32) * 0.1
    dy = rng.standard_normal((rows, width)).astype(np.float32)
    return [x, w1, b1, w2, b2], dy


def _cupy(a, dtype):
    import cupy as cp
    a = a.astype(dtype)
    return cp.asarray(a.view(np.uint16)).view(a.dtype) if a.itemsize == 2 else cp.asarray(a)


def run(cases, dtypes, reps, rounds):
    import cupy as cp
    torch = None
    try:
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    except ImportError:
        pass
    rows = []
    for case in cases:
        host, dy_host = _host_arrays(case)
        for dtype_name in dtypes:
            dtype = BFLOAT16 if dtype_name == "bfloat16" else np.dtype(np.float32)
            arrays, dy = [_cupy(a, dtype) for a in host], _cupy(dy_host, dtype)
            cp_event = cp.cuda.Event
            for mode, fused in (("fluxpy fused", True), ("fluxpy unfused", False)):
                cublaslt.clear_cache()
                gpu, host_us = _time(_fluxpy_call(fused, arrays, dy), cp.cuda.Device().synchronize, cp_event,
                                     cp.cuda.get_elapsed_time, reps, rounds)
                rows.append(dict(case=case, dtype=dtype_name, mode=mode, gpu_us=gpu, host_us=host_us,
                                 cublaslt_calls=cublaslt.stats()))
            if torch is None:
                continue
            tdtype = torch.bfloat16 if dtype_name == "bfloat16" else torch.float32
            modes = [("torch eager", tdtype, False)] + ([("torch autocast bf16", torch.float32, True)]
                                                        if dtype_name == "bfloat16" else [])
            for mode, storage, autocast in modes:
                t_arrays = [torch.tensor(a, device="cuda", dtype=storage, requires_grad=True) for a in host]
                t_dy = torch.tensor(dy_host, device="cuda", dtype=tdtype)
                gpu, host_us = _time(_torch_call(torch, t_arrays, t_dy, autocast), torch.cuda.synchronize,
                                     lambda: torch.cuda.Event(enable_timing=True), lambda s, e: s.elapsed_time(e),
                                     reps, rounds)
                rows.append(dict(case=case, dtype=dtype_name, mode=mode, gpu_us=gpu, host_us=host_us))
    return rows


def table(rows) -> str:
    """The rows as a Markdown table, with each row's GPU time over the fused one's of its case and dtype."""
    fused = {(r["case"], r["dtype"]): r["gpu_us"] for r in rows if r["mode"] == "fluxpy fused"}
    lines = ["| case | dtype | mode | GPU us | host us | GPU / fused |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        ratio = r["gpu_us"] / fused[(r["case"], r["dtype"])] if (r["case"], r["dtype"]) in fused else float("nan")
        lines.append(f"| {r['case']} {CASES[r['case']]} | {r['dtype']} | {r['mode']} | {r['gpu_us']:.1f} | "
                     f"{r['host_us']:.1f} | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="vit,gpt")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not fluxpy.backend.gpu_available()[0]:
        sys.exit("benchmarks/dense.py needs a GPU: " + fluxpy.backend.gpu_available()[1])
    rows = run(args.cases.split(","), args.dtypes.split(","), args.reps, args.rounds)
    print(table(rows))
    for r in rows:
        if r["mode"] == "fluxpy fused":
            print(f"{r['case']} {r['dtype']}: cuBLASLt calls {r['cublaslt_calls']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
