"""Host cost of the tape: time per tracked primitive on tiny arrays, against the plain NumPy call.

For each op, a chain of ``--chain`` applications is run three ways on a (4, 4) float32 array:

* plain: the NumPy calls alone;
* record: the same chain on a Tracked value (``fluxpy.pullback``), i.e. forward with the tape;
* backward: the backward walk over that tape (``back(dy)``), which runs each pullback.

"tape us/op" is (record - plain) per op: what recording adds to each forward call. The target is
at most 5 us. PyTorch CPU autograd (forward with ``requires_grad`` minus without, and its
``backward``) is measured in the same run where torch is installed.

Run: ``python benchmarks/overhead.py [--chain 200] [--repeat 30] [--json out.json]``
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

_B = np.linspace(-0.01, 0.01, 4).astype(np.float32)
OPS = {
    "add": (lambda x: x + _B, "x + b, b (4,)"),
    "multiply": (lambda x: x * 1.0001, "x * c"),
    "tanh": (np.tanh, "tanh(x)"),
    "exp": (lambda x: np.exp(x * 0.001), "exp(x * c)"),
    "maximum": (lambda x: np.maximum(x, 0.1), "maximum(x, c)"),
    "getitem": (lambda x: x[:, :], "x[:, :]"),
    "reshape": (lambda x: x.reshape(16).reshape(4, 4), "2 reshapes"),
    "matmul": (lambda x: x @ x * 0.25, "x @ x * c"),
    "sum_broadcast": (lambda x: x - x.sum(axis=0, keepdims=True) * 0.01, "x - sum(x)*c"),
}

# The number of primitives each chain step records (used to report per-primitive times).
PRIMS_PER_STEP = {"add": 1, "multiply": 1, "tanh": 1, "exp": 2, "maximum": 1, "getitem": 1, "reshape": 2,
                  "matmul": 2, "sum_broadcast": 3}


def _torch_ops(torch):
    b = torch.tensor(_B)
    return {
        "add": lambda x: x + b, "multiply": lambda x: x * 1.0001, "tanh": torch.tanh,
        "exp": lambda x: torch.exp(x * 0.001), "maximum": lambda x: torch.clamp_min(x, 0.1),
        "getitem": lambda x: x[:, :], "reshape": lambda x: x.reshape(16).reshape(4, 4),
        "matmul": lambda x: x @ x * 0.25, "sum_broadcast": lambda x: x - x.sum(dim=0, keepdim=True) * 0.01,
    }


def _median_time(fn, repeat):
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _chain(op, n):
    def run(x):
        for _ in range(n):
            x = op(x)
        return x
    return run


def measure_fluxpy(op, x, n, repeat):
    chain = _chain(op, n)
    plain = _median_time(lambda: chain(x), repeat)
    record = _median_time(lambda: fluxpy.pullback(chain, x), repeat)
    y, back = fluxpy.pullback(chain, x)
    dy = np.ones_like(y)
    backward = _median_time(lambda: back(dy), repeat)
    return plain, record, backward


def measure_torch(torch, op, x, n, repeat):
    chain = _chain(op, n)
    t = torch.tensor(x)
    plain = _median_time(lambda: chain(t), repeat)
    tg = t.clone().requires_grad_(True)
    record = _median_time(lambda: chain(tg), repeat)

    def fwd_bwd():
        chain(tg).backward(torch.ones(4, 4))
    total = _median_time(fwd_bwd, repeat)
    return plain, record, total - record


def run(chain=200, repeat=30):
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32) * 0.5
    try:
        import torch
        torch.set_num_threads(1)
        tops = _torch_ops(torch)
    except ImportError:
        torch, tops = None, {}
    rows = []
    for name, (op, desc) in OPS.items():
        per = chain * PRIMS_PER_STEP[name]
        plain, record, backward = measure_fluxpy(op, x, chain, repeat)
        row = {"op": name, "what": desc, "numpy_us": plain / per * 1e6, "record_us": record / per * 1e6,
               "tape_us": (record - plain) / per * 1e6, "backward_us": backward / per * 1e6}
        if torch is not None:
            tp, tr, tb = measure_torch(torch, tops[name], x, chain, repeat)
            row.update(torch_plain_us=tp / per * 1e6, torch_record_us=tr / per * 1e6,
                       torch_tape_us=(tr - tp) / per * 1e6, torch_backward_us=tb / per * 1e6)
        rows.append(row)
    return rows


def table(rows):
    has_torch = "torch_tape_us" in rows[0]
    head = "| op | numpy us | fluxpy fwd us | tape us/op | fluxpy bwd us |"
    sep = "|---|---:|---:|---:|---:|"
    if has_torch:
        head += " torch fwd us | torch tape us/op | torch bwd us | fwd+bwd ratio fluxpy/torch |"
        sep += "---:|---:|---:|---:|"
    lines = [head, sep]
    for r in rows:
        line = (f"| {r['op']} ({r['what']}) | {r['numpy_us']:.2f} | {r['record_us']:.2f} | {r['tape_us']:.2f} | "
                f"{r['backward_us']:.2f} |")
        if has_torch:
            ratio = (r["record_us"] + r["backward_us"]) / (r["torch_record_us"] + r["torch_backward_us"])
            line += (f" {r['torch_record_us']:.2f} | {r['torch_tape_us']:.2f} | {r['torch_backward_us']:.2f} | "
                     f"{ratio:.2f} |")
        lines.append(line)
    worst = max(r["tape_us"] for r in rows)
    lines.append("")
    lines.append(f"Largest tape cost: {worst:.2f} us per primitive (target: at most 5 us).")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chain", type=int, default=200)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--json", help="also write the rows as JSON to this path")
    a = p.parse_args()
    rows = run(a.chain, a.repeat)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
