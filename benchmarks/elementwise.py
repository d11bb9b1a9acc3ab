"""Fused elementwise kernels on the GPU: ``broadcast(f)`` and ``bias_act`` against op-by-op fluxpy and PyTorch.

For each shape (the MNIST conv net's activations with a per-channel bias ``(1, C, 1, 1)``, and
Dense ``(128, 10)`` with ``(10,)``), float32:

- ``broadcast(f, x, b)`` forward + pullback (fused kernels + unbroadcast) vs the same ``f`` run
  op by op on Tracked CuPy arrays (one primitive per operation) vs PyTorch eager (the same ``f``
  from torch ops, autograd ``backward``). ``f`` is ``tanh(1.5 x + b) * x`` and ``gelu(x + b)``
  (tanh form).
- ``bias_act(x, b, relu)`` forward + backward vs torch ``relu(x + b)`` + ``backward``, and the two
  bias-gradient paths of the backward alone: one map+reduce pass that writes ``dx`` while
  summing ``db`` (``mapreduce(..., out_mapped=dx)``, what fluxpy runs where the layouts allow) vs an
  elementwise ``dx`` kernel then the reduction (``bias_act_backward(..., fused=False)``).

Timing: CUDA events around each call, median of many calls after warm-up. ``gpu us``: the calls
are queued behind a spin kernel, so the events measure GPU time alone; ``wall us``: no spin, so
the host's launch cost shows when it exceeds the GPU time (what a training step pays).

Run: ``PYTHONPATH=. python3 benchmarks/elementwise.py [--reps N] [--json out.json]``
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import numpy as np

SHAPES = [((128, 16, 28, 28), (1, 16, 1, 1)), ((128, 32, 14, 14), (1, 32, 1, 1)), ((128, 32, 7, 7), (1, 32, 1, 1)),
          ((128, 10), (10,))]

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


class Timer:
    def __init__(self, cp, reps):
        self.cp = cp
        self.reps = reps
        self.spin = cp.RawKernel(_SPIN, "spin")
        props = cp.cuda.runtime.getDeviceProperties(0)
        self.khz = props.get("clockRate", 1_980_000) or 1_980_000
        self.start, self.end = cp.cuda.Event(), cp.cuda.Event()

    def __call__(self, fn, spin):
        cp = self.cp
        for _ in range(5):
            fn()
        cp.cuda.Device().synchronize()
        times = []
        for _ in range(self.reps):
            if spin:
                self.spin((1,), (1,), (np.int64(3 * self.khz),))   # ~3 ms: the host queues everything meanwhile
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            times.append(cp.cuda.get_elapsed_time(self.start, self.end) * 1000.0)
        return statistics.median(times)

    def both(self, fn):
        return self(fn, True), self(fn, False)


def tanh_affine(x, b):
    return np.tanh(x * 1.5 + b) * x


def gelu_bias(x, b):
    from fluxpy.ops.activations import gelu
    return gelu(x + b)


def torch_tanh_affine(torch):
    return lambda x, b: torch.tanh(x * 1.5 + b) * x


def torch_gelu_bias(torch):
    c = math.sqrt(2 / math.pi)

    def f(x, b):
        z = x + b
        return 0.5 * z * (1 + torch.tanh(c * (z + 0.044715 * z ** 3)))
    return f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import cupy as cp

    from fluxpy.kernels import gpu
    try:
        import torch
    except Exception:   # pragma: no cover
        torch = None
    gpu.register()
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    timer = Timer(cp, args.reps)
    rng = np.random.default_rng(0)
    rows = []
    for xs, bs in SHAPES:
        x = cp.asarray(rng.standard_normal(xs).astype(np.float32))
        b = cp.asarray(rng.standard_normal(bs).astype(np.float32))
        dy = cp.asarray(rng.standard_normal(xs).astype(np.float32))
        rows += broadcast_rows(cp, torch, timer, x, b, dy, xs, bs)
        rows += bias_act_rows(torch, timer, x, b, dy, xs, bs)
        rows.append(bias_grad_row(cp, timer, x, b, dy, xs, bs))
    print_table(rows, name)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(gpu=name, rows=rows), fh, indent=1)


def _torch_view(torch, a):
    return torch.from_dlpack(a) if torch is not None else None


def broadcast_rows(cp, torch, timer, x, b, dy, xs, bs):
    """Rows timing the forward + pullback of ``broadcast(f, x, b)`` for each ``f``: fused, op by op, and
    PyTorch eager."""
    import fluxpy
    from fluxpy import broadcast
    rows = []
    for fname, f, tf in (("tanh(1.5x+b)*x", tanh_affine, torch_tanh_affine),
                         ("gelu(x+b)", gelu_bias, torch_gelu_bias)):
        def fused():
            y, back = fluxpy.pullback(lambda x, b: broadcast(f, x, b), x, b)
            back(dy)

        def unfused():
            y, back = fluxpy.pullback(lambda x, b: f(x, b), x, b)
            back(dy)
        # the same results both ways (a sanity check before timing)
        y0, back0 = fluxpy.pullback(lambda x, b: broadcast(f, x, b), x, b)
        y1, back1 = fluxpy.pullback(lambda x, b: f(x, b), x, b)
        for a, c in zip((y0,) + back0(dy), (y1,) + back1(dy)):
            assert float(cp.max(cp.abs(a - c))) <= 1e-3 * (1 + float(cp.max(cp.abs(c)))), fname
        row = dict(case=f"broadcast {fname} fwd+bwd", shape=f"{xs} + {bs}",
                   fused=timer.both(fused), unfused=timer.both(unfused))
        if torch is not None:
            txs, tbs = _torch_view(torch, x).clone().requires_grad_(), _torch_view(torch, b).clone().requires_grad_()
            tdy = _torch_view(torch, dy)
            g = tf(torch)

            def torch_run():
                txs.grad = tbs.grad = None
                g(txs, tbs).backward(tdy)
            row["torch"] = timer.both(torch_run)
        rows.append(row)
    return rows


def bias_act_rows(torch, timer, x, b, dy, xs, bs):
    """Rows timing ``bias_act(x, b, relu)``: forward + backward and forward alone, against PyTorch's
    ``relu(x + b)``."""
    import fluxpy
    from fluxpy.ops.activations import relu
    from fluxpy.ops.bias_act import bias_act

    def ba():
        y, back = fluxpy.pullback(lambda x, b: bias_act(x, b, relu), x, b)
        back(dy)

    def ba_fwd():
        bias_act(x, b, relu)
    row = dict(case="bias_act relu fwd+bwd", shape=f"{xs} + {bs}", fused=timer.both(ba))
    if torch is not None:
        txs, tbs = _torch_view(torch, x).clone().requires_grad_(), _torch_view(torch, b).clone().requires_grad_()
        tdy = _torch_view(torch, dy)

        def torch_ba():
            txs.grad = tbs.grad = None
            torch.relu(txs + tbs).backward(tdy)

        def torch_fwd():
            with torch.no_grad():
                torch.relu(txs + tbs)
        row["torch"] = timer.both(torch_ba)
    rows = [row]
    row = dict(case="bias_act relu fwd", shape=f"{xs} + {bs}", fused=timer.both(ba_fwd))
    if torch is not None:
        row["torch"] = timer.both(torch_fwd)
    rows.append(row)
    return rows


def bias_grad_row(cp, timer, x, b, dy, xs, bs):
    """The bias_act backward alone: one map+reduce pass against an elementwise ``dx`` then the reduction."""
    from fluxpy.kernels import elementwise as E
    from fluxpy.ops.activations import relu
    from fluxpy.ops.bias_act import bias_act, derivative_from_saved
    mask = derivative_from_saved(relu)[0]
    y = bias_act(x, b, relu)
    one = timer.both(lambda: E.bias_act_backward(mask, y, dy, bs, True, True, fused=True))
    two = timer.both(lambda: E.bias_act_backward(mask, y, dy, bs, True, True, fused=False))
    da, db_ = E.bias_act_backward(mask, y, dy, bs, True, True, fused=True)
    dc, dd = E.bias_act_backward(mask, y, dy, bs, True, True, fused=False)
    assert bool(cp.all(da == dc)) and float(cp.max(cp.abs(db_ - dd))) <= 1e-3 * (1 + float(cp.max(cp.abs(dd))))
    return dict(case="bias_act relu bwd: dx+db one pass | dx then db", shape=f"{xs} + {bs}", fused=one, unfused=two)


def print_table(rows, name):
    def fmt(v):
        return "" if v is None else f"{v[0]:.1f} / {v[1]:.1f}"
    print(f"\n### fluxpy fused elementwise kernels, {name}, float32, median us (gpu / wall)\n")
    print("| case | shape | fluxpy fused | fluxpy alt | torch eager |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        alt = r.get("unfused")
        print(f"| {r['case']} | {r['shape']} | {fmt(r['fused'])} | {fmt(alt)} | {fmt(r.get('torch'))} |")
    print("\nfluxpy alt: op-by-op broadcast for `broadcast` rows; elementwise-then-reduce for the `bwd` rows.")


if __name__ == "__main__":
    main()
