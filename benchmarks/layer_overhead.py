"""Host cost per layer type, eager forward + backward: fluxpy against PyTorch, and where fluxpy's time goes.

Each case is a chain of ``--depth`` copies of one layer on a tiny input (the arithmetic is negligible, so the time is
the host's: Python, checks, the tape, dispatch, the launch; the "host us" column is the time to issue a round before
its sync, which tells where the GPU rather than the host set the pace), differentiated as a user's eager loop does
(``fluxpy.withgradient`` of the summed output, for the model and the input; PyTorch: forward, ``sum().backward()``, gradients set to None). The
optimiser case times ``update`` (fluxpy) and ``step`` (PyTorch) of Adam per parameter array. On ``--device gpu`` the
chain runs on CuPy / CUDA tensors without a sync until the end of a round, so a step's wall time is the host's as
long as the GPU keeps up (the shapes are tiny).

Then fluxpy's own time in one round is split by where it is spent (cProfile, own time per function, grouped by the
file that holds it): the tape (``autodiff``, ``backward``), layers, ops and their checks, kernel dispatch and
kernels, the array library (NumPy or CuPy, its Python and its C functions), the rest (Python built-ins among
them). cProfile slows Python down, so the shares, not the microseconds, are what that table says.

Run: ``PYTHONPATH=. python3 benchmarks/layer_overhead.py [--device cpu|gpu] [--depth 20] [--rounds 7]
[--only conv,dense] [--functions 25]``
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import fluxpy  # noqa: E402

# case -> (fluxpy layer from rng, PyTorch layer from torch, input shape); each keeps its input's shape
CASES = {
    "conv": (lambda rng: fluxpy.Conv((3, 3), 8, 8, fluxpy.relu, pad=1, rng=rng),
             lambda nn: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()), (2, 8, 8, 8)),
    "dense": (lambda rng: fluxpy.Dense(32, 32, fluxpy.relu, rng=rng),
              lambda nn: nn.Sequential(nn.Linear(32, 32), nn.ReLU()), (4, 32)),
    "batchnorm": (lambda rng: fluxpy.BatchNorm(8, fluxpy.relu),
                  lambda nn: nn.Sequential(nn.BatchNorm2d(8), nn.ReLU()), (2, 8, 8, 8)),
    "layernorm": (lambda rng: fluxpy.LayerNorm(32), lambda nn: nn.LayerNorm(32), (4, 32)),
    "maxpool": (lambda rng: fluxpy.MaxPool(3, stride=1, pad=1), lambda nn: nn.MaxPool2d(3, 1, 1), (2, 8, 8, 8)),
    "meanpool": (lambda rng: fluxpy.MeanPool(3, stride=1, pad=1), lambda nn: nn.AvgPool2d(3, 1, 1), (2, 8, 8, 8)),
    "gelu": (lambda rng: fluxpy.gelu, lambda nn: nn.GELU(approximate="tanh"), (4, 32)),
    "matmul": (lambda rng: _MatMul((rng.standard_normal((32, 32)) / 6).astype(np.float32)),
               lambda nn: _TorchMatMul(nn), (4, 32)),
    "attention": (lambda rng: _SelfAttention(fluxpy.MultiHeadAttention(32, 4, rng=rng)),
                  lambda nn: _TorchSelfAttention(nn.MultiheadAttention(32, 4, bias=False, batch_first=True)),
                  (2, 8, 32)),
}
# where a function's own time is charged: the first matching part of its file's path
PLACES = [("tape", ("fluxpy/autodiff.py", "fluxpy/backward.py", "fluxpy/derivatives.py")),
          ("layers", ("fluxpy/layers/",)), ("optimiser", ("fluxpy/optimise",)),
          ("kernel dispatch", ("fluxpy/kernels/__init__.py", "fluxpy/ops/fused.py")),
          ("kernels", ("fluxpy/kernels/",)), ("ops and checks", ("fluxpy/ops/", "fluxpy/")),
          ("array library", ("numpy", "cupy"))]   # their Python files and their C functions


class _MatMul:
    """``x @ w``: a product alone (no bias, no activation) as a layer of the chain."""

    def __init__(self, w):
        self.w = w

    def __call__(self, x):
        return x @ self.w


def _TorchMatMul(nn):
    import torch

    class MatMul(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 32) / 6)

        def forward(self, x):
            return x @ self.w
    return MatMul()


class _SelfAttention:
    """``mha(x, x, x)``: one self-attention block as a layer of the chain."""

    def __init__(self, mha):
        self.mha = mha

    def __call__(self, x):
        return self.mha(x, need_scores=False)[0]


def _TorchSelfAttention(mha):
    import torch

    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]
    return SelfAttention()


def _fluxpy_case(name, depth, device):
    make, _, shape = CASES[name]
    rng = np.random.default_rng(0)
    model = fluxpy.Chain(*[make(rng) for _ in range(depth)])
    x = rng.standard_normal(shape, dtype=np.float32)
    if device == "gpu":
        model, x = fluxpy.gpu(model), fluxpy.gpu(x)

    def step():   # the input's gradient too: a chain of pools or activations has no parameters
        return fluxpy.withgradient(lambda m, x: m(x).sum(), model, x)
    return step


def _fluxpy_optimiser(depth, device):
    rng = np.random.default_rng(0)
    model = fluxpy.Chain(*[fluxpy.Dense(32, 32, rng=rng) for _ in range(depth)])
    if device == "gpu":
        model = fluxpy.gpu(model)
    state = fluxpy.setup(fluxpy.Adam(1e-3), model)
    x = rng.standard_normal((4, 32), dtype=np.float32)
    (grads,) = fluxpy.gradient(lambda m: m(fluxpy.gpu(x) if device == "gpu" else x).sum(), model)
    return (lambda: fluxpy.update(state, model, grads)), 2 * depth


def _torch_case(torch, name, depth, device):
    _, make, shape = CASES[name]
    dev = "cuda" if device == "gpu" else "cpu"
    model = torch.nn.Sequential(*[make(torch.nn) for _ in range(depth)]).to(dev).train()
    x = torch.randn(shape, device=dev, requires_grad=True)

    def step():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        model(x).sum().backward()
    return step


def _torch_optimiser(torch, depth, device):
    dev = "cuda" if device == "gpu" else "cpu"
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(depth)]).to(dev)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 0.01
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    return opt.step, 2 * depth


def _per_call_us(step, sync, calls, rounds, steps=10):
    """Per call inside a step, in us, over ``rounds`` rounds of ``steps`` steps: the wall time to the end of the
    round's sync (median, min, max) and the median time the host took to issue the round (before the sync; where it
    is well below the wall time, the GPU, not the host, set the pace)."""
    for _ in range(3):
        step()
    sync()
    times, issued = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        t1 = time.perf_counter()
        sync()
        times.append((time.perf_counter() - t0) / steps / calls * 1e6)
        issued.append((t1 - t0) / steps / calls * 1e6)
    return statistics.median(times), min(times), max(times), statistics.median(issued)


def _profile(step, steps=10):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    return pstats.Stats(prof)


def _places(stats):
    """fluxpy's own time in a profile by place (see PLACES), as shares."""
    shares = dict.fromkeys([p for p, _ in PLACES] + ["other"], 0.0)
    for (file, _, function), (_, _, own, _, _) in stats.stats.items():
        where = function if file == "~" else file.replace("\\", "/")   # C functions: "<built-in method ...>"
        place = next((p for p, parts in PLACES if any(part in where for part in parts)), "other")
        shares[place] += own
    total = sum(shares.values()) or 1.0
    return {p: s / total for p, s in shares.items()}


def _top_functions(stats, n):
    """The ``n`` functions with the most own time in a profile: (own share, calls, "file:line(function)")."""
    rows = [(own, calls, f"{file.split('fluxpy/')[-1]}:{line}({function})")
            for (file, line, function), (_, calls, own, _, _) in stats.stats.items()]
    total = sum(r[0] for r in rows) or 1.0
    return [(own / total, calls, where) for own, calls, where in sorted(rows, reverse=True)[:n]]


def _syncs(device, torch):
    if device != "gpu":
        return (lambda: None), (lambda: None)
    import cupy
    return cupy.cuda.runtime.deviceSynchronize, (torch.cuda.synchronize if torch is not None else None)


def run(device="cpu", depth=20, rounds=7, only=None, functions=0):
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        torch = None
    sync_fluxpy, sync_torch = _syncs(device, torch)
    rows = []
    for name in (only or list(CASES) + ["adam"]):
        if name == "adam":
            step, calls = _fluxpy_optimiser(depth, device)
        else:
            step, calls = _fluxpy_case(name, depth, device), depth
        timed = _per_call_us(step, sync_fluxpy, calls, rounds)   # warm: compiles and plans are behind it
        stats = _profile(step)
        row = {"case": name, "fluxpy_us": timed, "places": _places(stats), "functions": _top_functions(stats, functions)}
        if torch is not None:
            tstep, tcalls = (_torch_optimiser(torch, depth, device) if name == "adam"
                             else (_torch_case(torch, name, depth, device), depth))
            row["torch_us"] = _per_call_us(tstep, sync_torch, tcalls, rounds)
        rows.append(row)
    return rows


def table(rows, device):
    unit = "parameter array" if any(r["case"] == "adam" for r in rows) else "layer"
    lines = [f"Host us per layer (adam: per {unit}), forward + backward, eager, {device}; median (range)", "",
             "| case | fluxpy us | fluxpy host us | PyTorch us | fluxpy / PyTorch | "
             + " | ".join(p for p, _ in PLACES) + " | other |",
             "|---|---:|---:|---:|---:|" + "---:|" * (len(PLACES) + 1)]
    for r in rows:
        f = r["fluxpy_us"]
        t = r.get("torch_us")
        cells = [f"{f[0]:.1f} ({f[1]:.1f}-{f[2]:.1f})", f"{f[3]:.1f}",
                 f"{t[0]:.1f} ({t[1]:.1f}-{t[2]:.1f})" if t else "n/a", f"{f[0] / t[0]:.2f}" if t else "n/a"]
        cells += [f"{share:.0%}" for share in r["places"].values()]
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    for r in rows:
        if r["functions"]:
            lines += ["", f"{r['case']}: fluxpy's functions by own time (10 steps under cProfile)"]
            lines += [f"  {share:6.1%} {calls:8d}  {where}" for share, calls, where in r["functions"]]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--depth", type=int, default=20, help="copies of the layer in the chain")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--only", help="comma-separated cases: " + ",".join(list(CASES) + ["adam"]))
    p.add_argument("--functions", type=int, default=0, help="list each case's N functions with the most own time")
    a = p.parse_args(argv)
    only = a.only.split(",") if a.only else None
    unknown = set(only or ()) - set(CASES) - {"adam"}
    if unknown:
        p.error(f"--only: no case {sorted(unknown)[0]!r}; expected some of {', '.join(list(CASES) + ['adam'])}")
    rows = run(a.device, a.depth, a.rounds, only, a.functions)
    print(table(rows, a.device))
    return rows


if __name__ == "__main__":
    main()
