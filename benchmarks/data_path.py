"""The data path of training on the GPU: images/s of the MNIST reference net with data fed in four ways.

The net is the model-zoo MNIST conv net of ``../shared/DESIGN.md`` (``models.reference_net``),
batch 128, float32, ``logitcrossentropy`` on one-hot labels, Adam(1e-3). The cases:

- ``step``: the step of ``train_step.py``: ``withgradient`` + ``update`` on one batch already on
  the GPU, launched back to back (what the data path is measured against);
- ``train resident``: :func:`fluxpy.train` (progress off) over batches already on the GPU: train's
  own checks (the loss and the finite check read every step) without any data movement;
- ``train prefetch``: ``fluxpy.train`` over ``DataLoader((x, y), batchsize, shuffle=True,
  device="gpu")`` of host (NumPy) arrays, which prefetches: the next batch is gathered into
  pinned memory and copied on a side stream while the current step runs;
- ``train no prefetch``: the same with ``prefetch=False``: each batch gathered and moved with
  ``fluxpy.gpu`` (a synchronous copy from pageable memory) when it is needed.

Each case runs ``--steps`` steps per round (the loaders hold ``steps * batch`` host images, so one
epoch is one round), timed from a device synchronise to one after the round. One untimed round
of every case first (cuDNN plans, the memory pool), then ``--rounds`` rounds, the cases taking
turns within each round so that drift of the machine spreads over all of them. Reported: images/s,
the median and the range over rounds, and the ratio of each median to the ``step`` median.

Run (GPU): ``python3 benchmarks/data_path.py [--rounds 9 --steps 100] [--json out.json]``; ``--cases`` picks
some of them, and also takes ``loader prefetch`` and ``loader no prefetch``: the loaders iterated alone, their
host cost per batch.
``--smoke``: on the CPU with NumPy, batch 8, a few steps, so that every case and the report run
(the loaders then use ``device="cpu"``; no prefetching happens on the CPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fluxpy  # noqa: E402
from models import reference_net  # noqa: E402

LEARNING_RATE = 1e-3
CASES = ("step", "train resident", "train prefetch", "train no prefetch")
EXTRA_CASES = ("loader prefetch", "loader no prefetch")   # the loaders alone: their host cost per batch


def loss_fn(model, x, y):
    return fluxpy.logitcrossentropy(model(x), y)


def host_data(n, seed=0):
    """``n`` MNIST-shaped float32 images in [0, 1] and their one-hot float32 labels, on the host."""
    rng = np.random.default_rng(seed)
    x = rng.random((n, 1, 28, 28), dtype=np.float32)
    y = fluxpy.onehotbatch(rng.integers(0, 10, n), range(10))
    return x, y


def make_cases(batch, steps, device):
    """``{name: (run_round, images per round)}``: each ``run_round()`` trains a model of its own for ``steps`` steps."""
    x, y = host_data(batch * steps)
    move = fluxpy.gpu if device == "gpu" else (lambda a: a)
    loader_device = "gpu" if device == "gpu" else "cpu"

    def fresh():
        model = move(reference_net(np.random.default_rng(0)))
        return model, fluxpy.setup(fluxpy.Adam(LEARNING_RATE), model)

    def step_case():
        model, opt = fresh()
        xb, yb = move(x[:batch]), move(y[:batch])

        def run_round():
            for _ in range(steps):
                _, (grad,) = fluxpy.withgradient(lambda m: loss_fn(m, xb, yb), model)
                fluxpy.update(opt, model, grad)
        return run_round

    def train_case(data):
        model, opt = fresh()
        return lambda: fluxpy.train(loss_fn, model, data, opt, progress=False)

    def loader(prefetch):
        return fluxpy.DataLoader((x, y), batchsize=batch, shuffle=True, rng=0, device=loader_device,
                                 prefetch=prefetch)

    def loader_case(data):
        def run_round():
            for _ in data:
                pass
        return run_round

    resident = [(move(x[i:i + batch]), move(y[i:i + batch])) for i in range(0, batch * steps, batch)]
    images = batch * steps
    return {"step": (step_case(), images),
            "train resident": (train_case(resident), images),
            "train prefetch": (train_case(loader(True)), images),
            "train no prefetch": (train_case(loader(False)), images),
            "loader prefetch": (loader_case(loader(True)), images),
            "loader no prefetch": (loader_case(loader(False)), images)}


def device_sync(device):
    if device != "gpu":
        return lambda: None
    import cupy
    return cupy.cuda.runtime.deviceSynchronize


def measure(cases, names, rounds, sync):
    """Images/s of every round of every case in ``names``: one warm-up round each, then ``rounds`` taking turns."""
    for name in names:
        cases[name][0]()
    sync()
    rates = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            run_round, images = cases[name]
            sync()
            start = time.perf_counter()
            run_round()
            sync()
            rates[name].append(images / (time.perf_counter() - start))
    return rates


def rows_of(rates, batch, device):
    base = statistics.median(rates["step"]) if "step" in rates else None
    rows = []
    for name, values in rates.items():
        median = statistics.median(values)
        rows.append(dict(benchmark="data path", case=name, batch=batch, device=device, rounds=len(values),
                         images_per_s=median, images_per_s_min=min(values), images_per_s_max=max(values),
                         us_per_step=batch / median * 1e6, ratio_to_step=median / base if base else None))
    return rows


def table(rows):
    lines = ["| case | images/s (median) | range over rounds | us/step | ratio to step |",
             "|---|---:|---|---:|---:|"]
    for r in rows:
        ratio = f"{r['ratio_to_step']:.2f}" if r["ratio_to_step"] is not None else "-"
        lines.append(f"| {r['case']} | {r['images_per_s']:,.0f} | {r['images_per_s_min']:,.0f}-"
                     f"{r['images_per_s_max']:,.0f} | {r['us_per_step']:.0f} | {ratio} |")
    return "\n".join(lines)


def run(batch=128, steps=100, rounds=9, device=None, names=CASES):
    """The rows of the table, measured in this process."""
    device = device or ("gpu" if fluxpy.gpu_available()[0] else "cpu")
    unknown = [n for n in names if n not in CASES + EXTRA_CASES]
    if unknown:
        raise ValueError(f"data_path: unknown cases {unknown}; the cases are {list(CASES + EXTRA_CASES)}")
    rates = measure(make_cases(batch, steps, device), names, rounds, device_sync(device))
    return rows_of(rates, batch, device)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=100, help="steps per round (one epoch of the loaders)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--cases", default=",".join(CASES),
                   help="comma-separated subset of " + ", ".join(CASES + EXTRA_CASES))
    p.add_argument("--device", choices=["gpu", "cpu"], default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, batch 8, 3 steps, 3 rounds: checks that it all runs")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.smoke:
        a.batch, a.steps, a.rounds, a.device = 8, 3, 3, "cpu"
    rows = run(a.batch, a.steps, a.rounds, a.device, tuple(n for n in a.cases.split(",") if n))
    print(f"MNIST reference net, batch {a.batch}, {a.steps} steps per round, {a.rounds} rounds, "
          f"device {rows[0]['device']}\n")
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(rows=rows, settings=dict(batch=a.batch, steps=a.steps,
                                                                         rounds=a.rounds)), indent=1))
    return rows


if __name__ == "__main__":
    main()
