"""Eager training steps against PyTorch's eager steps, each case in several fresh processes (issue 38's figure).

An eager step is the host's work, and the host's pace differs between processes on one machine: fluxpy's eager
ResNet-20 step took 10.7 to 19.2 ms over five processes of one tree with the same kernel choices (BENCHMARKS.md,
zoo), so the ratio of one process carries up to 1.5x of noise. Here each case runs in ``--processes`` children, one
after another; a child builds the zoo's network (``zoo_nets``) and times fluxpy's eager step
(``TrainStep(capture=False)``, float32, the zoo's loss and optimiser) and PyTorch's eager step on its twin
as ``zoo.py`` does: ``--warmup`` steps each, then ``--rounds`` rounds in turn of ``--steps`` steps between syncs.
A child's figures are its medians over rounds; a row is the median over the children and their range, for each
side and for the ratio fluxpy / PyTorch (below 1: fluxpy faster), each child's ratio taken within that child.

``--against DIR`` measures a change: ``DIR`` holds another fluxpy tree (``DIR/fluxpy``, e.g. ``git archive REV
fluxpy | tar -x -C DIR``), and each case's children alternate between this tree and that one (``--processes`` of
each), so that both meet the same drift of the host; each child says which fluxpy it imported, and a child that
imported the other one is an error. The table then has a row per tree.

Run: ``PYTHONPATH=. python3 benchmarks/eager.py [--only mlp:512,resnet20:128] [--processes 3] [--device gpu]
[--against DIR] [--json F] [--out DIR]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
_TREE = os.environ.get("FLUXPY_EAGER_TREE")   # a child of --against: that tree's fluxpy, before zoo puts ours first
if _TREE:
    sys.path.insert(0, _TREE)
    import fluxpy  # noqa: E402,F401

import zoo  # noqa: E402
from zoo_nets import make_case  # noqa: E402

DEFAULT_CASES = "mnist:128,resnet20:128,mobilenet:256,vgg:1024,vit:256,lstm:64,gru:64,mlp:512,unet:128"


def measure(name: str, batch: int, device: str, steps: int, rounds: int, warmup: int) -> dict:
    """``{"fluxpy": [us a step, a round each], "torch": [...]}``: both eager steps of one case in this process,
    their rounds alternating (:func:`zoo.timed_modes`, the zoo's own timing)."""
    import torch
    if device == "gpu":
        torch.backends.cudnn.benchmark = True   # as zoo.py runs PyTorch
    zoo.set_tf32(False, torch, device)
    net, model, x, labels = make_case(name, batch)
    zoo.reset_case(torch, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sides = {"fluxpy": (zoo.fluxpy_side(net, model, x, labels, "fluxpy eager", device)[0], zoo.fluxpy_sync(device)),
                 "torch": (zoo.torch_side(torch, net, model, x, labels, "torch eager", device)[0],
                           torch.cuda.synchronize if device == "gpu" else (lambda: None))}
        times, errors = zoo.timed_modes(sides, steps, rounds, warmup)
    if errors:
        raise RuntimeError(f"eager: {name}:{batch}: " + "; ".join(f"{side} {err}" for side, err in errors.items()))
    return {side: [t * 1e6 for t in per_step] for side, per_step in times.items()}


def summarise(children: list[dict]) -> dict:
    """A row's figures from its children's rounds: per side ``(median, low, high)`` over the children's medians,
    and the ratio's ``(median, low, high)`` over the children's own ratios.

    >>> summarise([{"fluxpy": [10, 12, 11], "torch": [10, 10, 10]}, {"fluxpy": [30], "torch": [20]}])
    {'fluxpy': (20.5, 11, 30), 'torch': (15.0, 10, 20), 'ratio': (1.3, 1.1, 1.5), 'processes': 2}
    """
    medians = {side: [statistics.median(c[side]) for c in children] for side in ("fluxpy", "torch")}
    ratios = [f / t for f, t in zip(medians["fluxpy"], medians["torch"])]
    row = {side: (statistics.median(v), min(v), max(v)) for side, v in medians.items()}
    row["ratio"] = (round(statistics.median(ratios), 6), round(min(ratios), 6), round(max(ratios), 6))
    row["processes"] = len(children)
    return row


def _us(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (each a :func:`summarise` row with ``model`` and ``batch``, and ``tree``
    where ``--against`` gave two: a column then names each row's).

    >>> print(table([dict(model="mlp", batch=512, **summarise([{"fluxpy": [2000], "torch": [1000]}]))]))
    | model | batch | processes | fluxpy eager us | PyTorch eager us | fluxpy / PyTorch |
    |---|---:|---:|---:|---:|---:|
    | mlp | 512 | 1 | 2,000 (2,000-2,000) | 1,000 (1,000-1,000) | **2.00** (2.00-2.00) |
    """
    trees = any("tree" in r for r in rows)
    lines = ["| model | batch |" + (" fluxpy tree |" if trees else "") +
             " processes | fluxpy eager us | PyTorch eager us | fluxpy / PyTorch |",
             "|---|---:|" + ("---|" if trees else "") + "---:|---:|---:|---:|"]
    for r in rows:
        f, t, q = r["fluxpy"], r["torch"], r["ratio"]
        tree = f" {r.get('tree', '')} |" if trees else ""
        lines.append(f"| {r['model']} | {r['batch']} |{tree} {r['processes']} | {_us(f[0])} ({_us(f[1])}-{_us(f[2])}) "
                     f"| {_us(t[0])} ({_us(t[1])}-{_us(t[2])}) | **{q[0]:.2f}** ({q[1]:.2f}-{q[2]:.2f}) |")
    return "\n".join(lines)


def _child(name: str, batch: int, a, against: Path | None = None) -> dict:
    """One child process's :func:`measure` of the case (this script with ``--child``), importing the fluxpy of the
    tree in ``against`` where given; an error where it imported another fluxpy than asked for."""
    env = {k: v for k, v in os.environ.items() if k != "FLUXPY_EAGER_TREE"}
    if against is not None:
        env["FLUXPY_EAGER_TREE"] = str(against)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--only", f"{name}:{batch}",
               "--device", a.device, "--steps", str(a.steps), "--rounds", str(a.rounds), "--warmup", str(a.warmup),
               "--json", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"eager: the child of {name}:{batch} exited with {done.returncode}: {tail}")
        got = json.loads(out.read_text())
    imported = Path(got.pop("fluxpy_file")).resolve()
    if (a.against is not None and imported.is_relative_to(a.against)) != (against is not None):
        want = f"the one under {against}" if against is not None else "this tree's"
        raise RuntimeError(f"eager: the child of {name}:{batch} imported fluxpy from {imported}, not {want}")
    return got


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=DEFAULT_CASES, help="comma-separated NAME:BATCH (or NAME: all its batches)")
    p.add_argument("--processes", type=int, default=3, help="children per case, one after another")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a child may run")
    p.add_argument("--against", type=Path, default=None,
                   help="a folder holding another fluxpy tree (DIR/fluxpy): children alternate between the two")
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="a folder for eager.json and the table, eager.md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.processes < 1 or a.steps < 1 or a.rounds < 1 or a.warmup < 0:
        p.error("--processes, --steps and --rounds must be 1 or more, --warmup 0 or more")
    try:
        cases = zoo.select_cases(a.only)
    except ValueError as err:
        p.error(str(err))
    if a.against is not None:
        a.against = a.against.resolve()
        if not (a.against / "fluxpy" / "__init__.py").is_file():
            p.error(f"--against expects a folder holding a fluxpy tree (DIR/fluxpy/__init__.py), got {a.against}")
    if a.child:
        import fluxpy
        (name, batch), = cases
        got = measure(name, batch, a.device, a.steps, a.rounds, a.warmup)
        Path(a.json).write_text(json.dumps({**got, "fluxpy_file": fluxpy.__file__}))
        return
    trees = [None] if a.against is None else [None, a.against]
    rows = []
    for name, batch in cases:
        children = {tree: [] for tree in trees}
        for _ in range(a.processes):
            for tree in trees:   # alternating, so that both trees meet the host's drift alike
                children[tree].append(_child(name, batch, a, tree))
        for tree in trees:
            label = {} if a.against is None else {"tree": "this" if tree is None else str(tree)}
            rows.append(dict(benchmark="eager", model=name, batch=batch, device=a.device, **label,
                             **summarise(children[tree]), children=children[tree]))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        for path in (a.json, a.out and Path(a.out) / "eager.json"):
            if path:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text(json.dumps(rows, indent=1))
    text = table(rows)
    if a.out:
        (Path(a.out) / "eager.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
