"""Every fluxpy benchmark in one run on one GPU, and one table of fluxpy against PyTorch.

Runs, each in its own process so that one's allocations and compiled kernels do not colour the
next: the training step (``train_step.py``: both nets at batch 128 and 1024), the step captured as a CUDA
graph (``captured_step.py``: fluxpy's TrainStep against PyTorch's graph; its summary row is captured
against captured) and its kernels (``captured_profile.py``: GPU time by kind of kernel), mixed precision
(``mixed_precision.py``: bfloat16 and float16 steps against PyTorch autocast + channels-last), the ResNet training
step (``resnet_step.py``: ResNet-20 at batch 128 and 512, ResNet-18 at 64x64 batch 64, TF32 off and
on; its rows are labelled ``model, batch, tf32 off|on``), the reductions
(``reduce.py``), cuDNN convolutions (``conv.py``, and ``conv_half``: the same in bfloat16 and float16), the LSTM and
GRU layers against cuDNN's (``recurrent.py``), fused elementwise kernels (``elementwise.py``)
and the tape's host overhead (``overhead.py``). Each writes JSON; this script prints each one's
own table, then a summary markdown table (benchmark, case, fluxpy, PyTorch, ratio fluxpy/PyTorch:
below 1 means fluxpy is faster) headed by the GPU's name and the date, and writes everything to
``--json``.

Run: ``PYTHONPATH=. python3 benchmarks/run.py [--out DIR] [--quick] [--only train_step,reduce]``
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = {
    "train_step": ["--json", "{json}"],
    "captured_step": ["--json", "{json}"],
    "captured_profile": ["--json", "{json}"],
    "data_path": ["--json", "{json}"],
    "batchnorm": ["--json", "{json}"],
    "resnet_step": ["--json", "{json}"],
    "mixed_precision": ["--json", "{json}"],
    "reduce": ["--json", "{json}"],
    "conv": ["--json", "{json}"],
    "conv_half": ["--dtype", "bfloat16,float16", "--json", "{json}"],
    "conv_half_channels_last": ["--dtype", "bfloat16,float16", "--memory", "channels_last", "--json", "{json}"],
    "layernorm": ["--json", "{json}"],
    "scatter": ["--json", "{json}"],
    "recurrent": ["--json", "{json}"],
    "elementwise": ["--json", "{json}"],
    "overhead": ["--json", "{json}"],
    "data_parallel": ["--json", "{json}"],   # only where 2 GPUs or more exist (main skips it otherwise)
}
QUICK_FLAGS = {"batchnorm": ["--reps", "20"], "train_step": ["--steps", "20", "--rounds", "3"],
               "captured_step": ["--steps", "20", "--rounds", "3", "--warmup", "5"],
               "captured_profile": ["--steps", "10"],
               "resnet_step": ["--steps", "10", "--rounds", "3", "--warmup", "5", "--single-steps", "50"],
               "mixed_precision": ["--steps", "5", "--rounds", "3", "--warmup", "3"],
               "reduce": ["--quick"], "conv": ["--quick"], "conv_half": ["--quick"],
               "conv_half_channels_last": ["--quick"], "layernorm": ["--lengths", "768,5140,20480", "--reps", "10"],
               "scatter": ["--reps", "10", "--rounds", "3"], "recurrent": ["--reps", "2", "--rounds", "3"],
               "elementwise": ["--reps", "20"], "overhead": ["--chain", "100", "--repeat", "10"],
               "data_parallel": ["--steps", "10", "--warmup", "5", "--repeats", "3"]}
SCRIPTS = {"conv_half": "conv", "conv_half_channels_last": "conv"}   # a benchmark that runs another one's script with other arguments
LABEL_KEYS = ("model", "batch", "case", "layer", "name", "row", "op", "shape", "axes", "dtype", "length")


def run_one(name, out_dir, quick):
    path = out_dir / f"{name}.json"
    args = [a.format(json=path) for a in BENCHMARKS[name]] + (QUICK_FLAGS.get(name, []) if quick else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    script = HERE / f"{SCRIPTS.get(name, name)}.py"
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env)
    (out_dir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    print(f"\n## {name}\n\n{proc.stdout.strip()}", flush=True)
    if proc.returncode != 0:
        print(f"\n{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
        return None
    return json.loads(path.read_text()) if path.exists() else None


def _rows(data):
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        for key in ("rows", "results", "cases"):
            if isinstance(data.get(key), list):
                return data[key]
    return []


def _time(value):
    """A time in us from a row field: a number, or (gpu_us, wall_us) where only GPU time is compared."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value if isinstance(value, (int, float)) else None


def _pair(row):
    """(fluxpy us, PyTorch us) of a row, whatever the benchmark called them."""
    for ours, theirs in (("fluxpy_us", "torch_us"), ("fused", "torch"), ("fluxpy", "torch"),
                         ("record_us", "torch_record_us")):
        if ours in row and theirs in row:
            return _time(row[ours]), _time(row[theirs])
    return None, None


def summary_rows(results):
    rows = []
    for bench, data in results.items():
        for r in _rows(data):
            ours, theirs = _pair(r)
            if ours is None or theirs is None or theirs <= 0:
                continue
            label = ", ".join(f"{k} {r[k]}" if k in ("batch",) else str(r[k]) for k in LABEL_KEYS if k in r)
            rows.append(dict(benchmark=bench, case=label, fluxpy_us=ours, torch_us=theirs, ratio=ours / theirs))
    return rows


def _gpu_count():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:   # no CuPy or no driver
        return 0


def gpu_name():
    try:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else name
    except Exception as err:  # no GPU: the CPU benchmarks still run
        return f"no GPU ({type(err).__name__})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/bench"), help="folder for logs and JSON")
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(BENCHMARKS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None, help="the combined JSON (default: OUT/benchmarks.json)")
    a = p.parse_args(argv)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [n for n in (a.only.split(",") if a.only else BENCHMARKS) if n]
    if "data_parallel" in names and _gpu_count() < 2:
        print("data_parallel: skipped (needs 2 GPUs or more)", flush=True)
        names.remove("data_parallel")
    results = {n: run_one(n, out_dir, a.quick) for n in names}
    rows = summary_rows({k: v for k, v in results.items() if v is not None})
    head = f"# fluxpy vs PyTorch, {gpu_name()}, {datetime.date.today().isoformat()}"
    lines = [head, "", "Times in us (GPU time where the benchmark measures it; host time for overhead); "
             "ratio = fluxpy / PyTorch, below 1 means fluxpy is faster.", "",
             "| benchmark | case | fluxpy us | PyTorch us | ratio |", "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['benchmark']} | {r['case']} | {r['fluxpy_us']:.1f} | {r['torch_us']:.1f} | "
                     f"{r['ratio']:.2f} |")
    print("\n" + "\n".join(lines))
    failed = [n for n, v in results.items() if v is None]
    if failed:
        print(f"\nfailed or wrote no JSON: {', '.join(failed)}")
    Path(a.json or out_dir / "benchmarks.json").write_text(json.dumps(
        dict(gpu=gpu_name(), date=datetime.date.today().isoformat(), summary=rows, results=results), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
