"""One CPU training step: fluxpy against PyTorch, same machine, same process, float32.

A step is forward, backward and an Adam update of one of issue 42's networks (``--model``): the MNIST reference
net (``reference``: ``Conv(3x3, 1=>16, relu, pad 1), MaxPool 2, Conv(16=>32), MaxPool 2, Conv(32=>32), MaxPool 2,
flatten, Dense(288=>10)``) or ``lenet5`` at batch 128 on 28x28 images, ``resnet20`` (CIFAR, 3x32x32) at batch 32,
or the ``lstm`` classifier (``lstm_classifier(32, 128)``, sequences of 100 steps) at batch 64 (and, beyond the
issue's four, ``mobilenet``: ``mobilenet_cifar()``, depthwise convolutions, at batch 32), with
logitcrossentropy. Both frameworks start from the same weights (``zoo.torch_twin``: fluxpy's Conv is a true
convolution, so PyTorch gets the flipped kernels) and the same batch; the first losses are printed as a check that
both compute the same thing. Each framework runs in a Python process of its own (two OpenMP runtimes in one process
spin against each other), each step timed separately after ``--warmup`` steps; the median of ``--repeat`` steps is
reported, as a markdown table with the ratio fluxpy / PyTorch.

With ``--profile``, the step is then profiled by op on both sides (in this one process), per step: fluxpy's host time per primitive and
pullback (:func:`fluxpy.profile`, exclusive times) and PyTorch's self CPU time per aten op (``torch.profiler``), the
``--top`` busiest of each.

Run: ``python benchmarks/cpu_step.py [--model reference|lenet5|resnet20|lstm|mobilenet] [--batch N] [--repeat 30]
[--threads N] [--profile] [--top 12]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fluxpy  # noqa: E402
from fluxpy.data import onehotbatch  # noqa: E402
from fluxpy.losses import logitcrossentropy  # noqa: E402
from fluxpy.optimise import Adam, setup, update  # noqa: E402
from fluxpy.models import lstm_classifier, mobilenet_cifar, resnet20  # noqa: E402
from models import lenet5, reference_net  # noqa: E402

# --model -> (builder, one example's shape, default batch)
MODELS = {"reference": (reference_net, (1, 28, 28), 128), "lenet5": (lenet5, (1, 28, 28), 128),
          "resnet20": (lambda rng: resnet20(rng=rng), (3, 32, 32), 32),
          "lstm": (lambda rng: lstm_classifier(32, 128, rng=rng), (100, 32), 64),
          "mobilenet": (lambda rng: mobilenet_cifar(rng=rng), (3, 32, 32), 32)}


def fluxpy_step(model, opt_state, x, y):
    def loss(m):
        return logitcrossentropy(m(x), y)
    value, (grad,) = fluxpy.withgradient(loss, model)
    update(opt_state, model, grad)
    return float(value)


def torch_setup(torch, model):
    """The same network and weights in PyTorch, with its Adam."""
    from zoo import torch_twin   # the zoo's twin covers every network here (and needs torch)
    net = torch_twin(torch, model)
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def torch_step(torch, net, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def median_time(step, warmup, repeat):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def fluxpy_profile(step, steps, top):
    """The ``top`` ops of fluxpy's step by host time (exclusive), ms per step."""
    with fluxpy.profile(gpu=False, print_table=False) as prof:
        for _ in range(steps):
            step()
    rows = sorted(prof.rows(), key=lambda r: -r.host_s)[:top]
    return [(r.name, r.host_s / steps * 1e3, r.calls / steps) for r in rows], prof.wall_s / steps * 1e3


def torch_profile(torch, step, steps, top):
    """The ``top`` aten ops of PyTorch's step by self CPU time, ms per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [(e.key, e.self_cpu_time_total / steps / 1e3, e.count / steps) for e in events]


def profile_table(ours, theirs, wall_ms):
    """Markdown: fluxpy's busiest ops beside PyTorch's, ms per step (calls per step)."""
    lines = [f"Where a step goes (ms per step, calls per step in brackets); fluxpy's profiled step {wall_ms:.1f} ms",
             "", "| fluxpy op | ms | PyTorch op | ms |", "|---|---:|---|---:|"]
    for i in range(max(len(ours), len(theirs))):
        a = f"{ours[i][0]} ({ours[i][2]:.0f}) | {ours[i][1]:.2f}" if i < len(ours) else " | "
        b = f"{theirs[i][0]} ({theirs[i][2]:.0f}) | {theirs[i][1]:.2f}" if i < len(theirs) else " | "
        lines.append(f"| {a} | {b} |")
    return "\n".join(lines)


def _case(args):
    build, shape, _ = MODELS[args.model]
    rng = np.random.default_rng(0)
    x = rng.random((args.batch, *shape), dtype=np.float32)
    labels = rng.integers(0, 10, args.batch)
    return x, labels, build(rng)


def run_side(side, args):
    """One side's ``{"name", "first", "median", "best"}`` (seconds), in this process; None without PyTorch."""
    x, labels, model = _case(args)
    if side == "torch":
        try:
            import torch
        except ImportError:
            return None
        if args.threads:
            torch.set_num_threads(args.threads)
        net, opt = torch_setup(torch, model)
        tx, ty = torch.from_numpy(x), torch.from_numpy(labels)
        step = lambda: torch_step(torch, net, opt, tx, ty)   # noqa: E731
        name = f"PyTorch {torch.__version__} ({torch.get_num_threads()} threads)"
    else:
        opt_state, y = setup(Adam(1e-3), model), onehotbatch(labels, range(10))
        step = lambda: fluxpy_step(model, opt_state, x, y)   # noqa: E731
        name = "fluxpy"
    first = step()
    median, best = median_time(step, args.warmup, args.repeat)
    return {"name": name, "first": first, "median": median, "best": best}


def _in_own_process(side, argv):
    """:func:`run_side` in a fresh Python: each framework's OpenMP threads spin in no one else's process."""
    out = subprocess.run([sys.executable, __file__, *argv, "--side", side], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="reference")
    p.add_argument("--batch", type=int, default=None, help="default: 128, 32 for resnet20, 64 for lstm")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="PyTorch intra-op threads (default: its own)")
    p.add_argument("--profile", action="store_true", help="then profile the step by op on both sides")
    p.add_argument("--top", type=int, default=12, help="ops listed per side with --profile")
    p.add_argument("--side", choices=["fluxpy", "torch"], help=argparse.SUPPRESS)   # one side, this process
    args = p.parse_args(argv)
    args.batch = args.batch or MODELS[args.model][2]
    if args.side:
        print(json.dumps(run_side(args.side, args)))
        return None

    sides = [_in_own_process(side, [a for a in argv if a != "--profile"]) for side in ("fluxpy", "torch")]
    rows = [(s["name"], s["median"], s["best"]) for s in sides if s is not None]
    if sides[1] is not None:
        print(f"first-step loss: fluxpy {sides[0]['first']:.6f}, PyTorch {sides[1]['first']:.6f}")
    print(f"\nOne training step (forward + backward + Adam), {args.model}, batch {args.batch}, float32, CPU, "
          f"median of {args.repeat} after {args.warmup} warm-up steps, each framework in a process of its own\n")
    print("| framework | median ms/step | best ms/step | images/s | ratio to PyTorch |")
    print("|---|---:|---:|---:|---:|")
    base = rows[1][1] if len(rows) > 1 else None
    for name, t, best in rows:
        ratio = f"{t / base:.2f}x" if base else "n/a"
        print(f"| {name} | {1e3 * t:.2f} | {1e3 * best:.2f} | {args.batch / t:.0f} | {ratio} |")
    if sides[1] is None:
        print("\nPyTorch is not installed: no comparison (pip install torch)")
    if args.profile:
        x, labels, model = _case(args)
        opt_state, y = setup(Adam(1e-3), model), onehotbatch(labels, range(10))
        ours, wall = fluxpy_profile(lambda: fluxpy_step(model, opt_state, x, y), 5, args.top)
        theirs = []
        if sides[1] is not None:
            import torch
            net, opt = torch_setup(torch, model)
            tx, ty = torch.from_numpy(x), torch.from_numpy(labels)
            theirs = torch_profile(torch, lambda: torch_step(torch, net, opt, tx, ty), 5, args.top)
        print("\n" + profile_table(ours, theirs, wall))
    return rows


if __name__ == "__main__":
    main()
