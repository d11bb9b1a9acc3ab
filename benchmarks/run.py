"""Every fluxpy benchmark in one run on one GPU, and one table of fluxpy against PyTorch.

Runs, each in its own process so that one's allocations and compiled kernels do not colour the
next: the training step (``train_step.py``: both nets at batch 128 and 1024), the step captured as a CUDA
graph (``captured_step.py``: fluxpy's TrainStep against PyTorch's graph; its summary row is captured
against captured) and its kernels (``captured_profile.py``: GPU time by kind of kernel), mixed precision
(``mixed_precision.py``: bfloat16 and float16 steps against PyTorch autocast + channels-last), the ResNet training
step (``resnet_step.py``: ResNet-20 at batch 128 and 512, ResNet-18 at 64x64 batch 64, TF32 off and
on; its rows are labelled ``model, batch, tf32 off|on``), the reductions
(``reduce.py``), cuDNN convolutions (``conv.py``, and ``conv_half``: the same in bfloat16 and float16), the LSTM and
GRU layers against cuDNN's (``recurrent.py``), fused elementwise kernels (``elementwise.py``),
the tape's host overhead (``overhead.py``), the model zoo's networks, each side's best mode (``zoo.py``), their
eager steps against PyTorch's over several processes (``eager.py``),
attention forward and backward against PyTorch's SDPA (``attention.py``) and Dense layers with cuBLASLt epilogues
(``dense.py``). Each
writes JSON; this script prints each one's own table, then a summary markdown table (benchmark, case, fluxpy,
PyTorch, ratio fluxpy/PyTorch: below 1 means fluxpy is faster) headed by the GPU's name and the date, and writes everything to
``--json``. ``--write BENCHMARKS.md`` also replaces, for each benchmark that ran, its table in that file (the text
between ``<!-- table NAME -->`` and ``<!-- /table NAME -->``; :func:`bench_table` formats it, :data:`TABLES` names
its columns, :func:`write_tables` puts it in place).

Run: ``PYTHONPATH=. python3 benchmarks/run.py [--out DIR] [--quick] [--only train_step,reduce] [--write BENCHMARKS.md]``
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
    "zoo": ["--json", "{json}"],
    "eager": ["--json", "{json}"],
    "attention": ["--json", "{json}"],
    "dense": ["--json", "{json}"],
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
               "data_parallel": ["--steps", "10", "--warmup", "5", "--repeats", "3"],
               "zoo": ["--steps", "5", "--rounds", "3", "--warmup", "3", "--compile", "off"],
               "eager": ["--processes", "2", "--rounds", "3", "--steps", "4"],
               "attention": ["--calls", "20", "--rounds", "3"], "dense": ["--reps", "5", "--rounds", "3"]}
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


# The tables of BENCHMARKS.md, one a benchmark. A column is (header, key, kind): ``key`` names a row's field
# ("a.b" reads a nested dict) or is a pair (numerator, denominator) whose medians give a ratio; ``kind`` says how a
# cell is written (:data:`FORMATS`). A table with ``pivot`` gives one line per value of its ``text`` columns and, for
# each of the pivot field's ``values``, the ``per_value`` columns (their headers name the value with ``{}``).
TABLES = {
    "train_step": dict(columns=[
        ("model", "model", "text"), ("batch", "batch", "text"), ("fluxpy us", "fluxpy_us", "us"),
        ("PyTorch eager us", "torch_us", "us"), ("fluxpy / PyTorch eager", "ratio", "ratio")]),
    "captured_step": dict(columns=[
        ("model", "model", "text"), ("batch", "batch", "text"), ("fluxpy captured us", "fluxpy captured us", "us"),
        ("PyTorch graph us", "torch graph us", "us"), ("fluxpy eager us", "fluxpy eager us", "us"),
        ("PyTorch eager us", "torch eager us", "us"),
        ("captured / PyTorch graph", ("fluxpy captured us", "torch graph us"), "ratio")]),
    "captured_profile": dict(columns=[
        ("case", "case", "text"), ("fluxpy kernels us", "fluxpy_us", "us"),
        ("PyTorch graph kernels us", "torch_us", "us"), ("fluxpy / PyTorch graph", ("fluxpy_us", "torch_us"), "ratio"),
        ("fluxpy wall us", "fluxpy.wall_us", "us"), ("PyTorch wall us", "PyTorch.wall_us", "us")]),
    "data_path": dict(columns=[
        ("case", "case", "text"), ("images/s", "images_per_s", "count"), ("us/step", "us_per_step", "us"),
        ("ratio to step", "ratio_to_step", "ratio")]),
    "batchnorm": dict(columns=[
        ("shape", "shape", "text"), ("fluxpy us", "fluxpy_gpu_us", "us"), ("PyTorch us", "torch_gpu_us", "us"),
        ("fluxpy / PyTorch", ("fluxpy_gpu_us", "torch_gpu_us"), "ratio"),
        ("share of copy", "fluxpy_share_of_copy", "share")]),
    "resnet_step": dict(columns=[
        ("model", "model", "text"), ("batch", "batch", "text"), ("TF32", "case", "text"),
        ("fluxpy us", "fluxpy_us", "us"), ("PyTorch eager us", "torch_us", "us"),
        ("fluxpy / PyTorch eager", "ratio", "ratio"), ("peak MB fluxpy", "fluxpy_peak_mb", "count"),
        ("peak MB PyTorch", "torch_peak_mb", "count")]),
    "mixed_precision": dict(columns=[
        ("model", "model", "text"), ("batch", "batch", "text"), ("dtype", "dtype", "text"),
        ("fluxpy mixed CL us", "fluxpy mixed CL us", "us"), ("fluxpy mixed C-order us", "fluxpy mixed us", "us"),
        ("PyTorch autocast+CL us", "torch autocast us", "us"), ("fluxpy float32 us", "fluxpy float32 us", "us"),
        ("mixed CL / autocast", ("fluxpy mixed CL us", "torch autocast us"), "ratio"),
        ("mixed CL / fluxpy float32", ("fluxpy mixed CL us", "fluxpy float32 us"), "ratio")]),
    "reduce": dict(columns=[
        ("shape", "shape", "text"), ("axes", "axes", "text"), ("fluxpy us", "fluxpy_us", "us"),
        ("torch.sum us", "torch_us", "us"), ("fluxpy / torch.sum", "ratio", "ratio"),
        ("% of copy", "pct_copy", "percent")]),
    "layernorm": dict(columns=[
        ("dtype", "dtype", "text"), ("L", "length", "text"), ("backward", "bwd_kernel", "kernel"),
        ("fwd us", "hbm.fluxpy_fwd_us", "us"), ("fwd % copy", "hbm.fwd_share", "share"),
        ("bwd us", "hbm.fluxpy_bwd_us", "us"), ("bwd % copy", "hbm.bwd_share", "share"),
        ("fwd+bwd / PyTorch", "hbm.both_ratio", "ratio"), ("fwd % copy, warm", "warm.fwd_share", "share"),
        ("bwd % copy, warm", "warm.bwd_share", "share")]),
    "scatter": dict(columns=[
        ("case", "case", "text"), ("op", "op", "text"), ("fluxpy us", "fluxpy_us", "us"),
        ("deferred us", "fluxpy_deferred_us", "us"), ("PyTorch us", "torch_us", "us"),
        ("deferred / PyTorch", "ratio_deferred", "ratio"), ("GPU fluxpy us", "fluxpy_gpu_us", "us"),
        ("GPU PyTorch us", "torch_gpu_us", "us"), ("GPU ratio", ("fluxpy_gpu_us", "torch_gpu_us"), "ratio")]),
    "recurrent": dict(columns=[
        ("case", "case", "text"), ("op", "op", "text"), ("fluxpy eager ms", "fluxpy_ms", "ms"),
        ("fluxpy captured ms", "captured_ms", "ms"), ("PyTorch cuDNN ms", "torch_ms", "ms"),
        ("PyTorch native ms", "torch_native_ms", "ms"),
        ("captured / PyTorch cuDNN", ("captured_ms", "torch_ms"), "ratio")]),
    "elementwise": dict(columns=[
        ("case", "case", "text"), ("shape", "shape", "text"), ("fluxpy us", "fused", "us"),
        ("PyTorch eager us", "torch", "us"), ("fluxpy / PyTorch", ("fused", "torch"), "ratio")]),
    "overhead": dict(columns=[
        ("op", "op", "text"), ("NumPy us", "numpy_us", "us2"), ("fluxpy forward us", "record_us", "us2"),
        ("tape us", "tape_us", "us2"), ("fluxpy backward us", "backward_us", "us2"),
        ("PyTorch forward us", "torch_record_us", "us2"), ("PyTorch backward us", "torch_backward_us", "us2")]),
    "data_parallel": dict(pivot="side", values=("fluxpy", "torch"), columns=[
        ("model", "model", "text"), ("GPUs", "gpus", "text")], per_value=[
        ("{} images/s", "images_per_s", "count"), ("{} efficiency", "efficiency", "ratio3")]),
    "zoo": dict(columns=[
        ("model", "model", "text"), ("batch", "batch", "text"), ("fluxpy best", "fluxpy best", "text"),
        ("fluxpy best us", "fluxpy best us", "us"), ("PyTorch best", "torch best", "text"),
        ("PyTorch best us", "torch best us", "us"), ("best / best", ("fluxpy best us", "torch best us"), "ratio"),
        ("fluxpy half / float32", ("fluxpy half us", "fluxpy float32 us"), "ratio"), ("failed", "failed", "text")]),
    "eager": dict(columns=[
        ("model", "model", "text"), ("batch", "batch", "text"), ("processes", "processes", "text"),
        ("fluxpy eager us", "fluxpy", "us"), ("PyTorch eager us", "torch", "us"),
        ("fluxpy / PyTorch", "ratio", "ratio")]),
    "attention": dict(columns=[
        ("shape (N, heads, L, d)", "shape", "text"), ("dtype", "dtype", "text"), ("mode", "mode", "text"),
        ("fluxpy us", "fluxpy_us", "us"), ("PyTorch us", "torch_us", "us"),
        ("fluxpy / PyTorch", ("fluxpy_us", "torch_us"), "ratio")]),
    "dense": dict(columns=[
        ("case", "case", "text"), ("dtype", "dtype", "text"), ("mode", "mode", "text"), ("GPU us", "gpu_us", "us"),
        ("host us", "host_us", "us")]),
}
CONV = dict(pivot="row", values=("fwd", "bwd_data", "bwd_filter"), columns=[
    ("dtype", "dtype", "text"), ("layer", "layer", "text")], per_value=[
    ("{} us", "fluxpy_us", "us"), ("{} ratio", "ratio", "ratio")])
TABLES.update(conv=CONV, conv_half=CONV, conv_half_channels_last=CONV)
FORMATS = {"us": "us", "us2": ".2f", "ms": ".2f", "count": ",.0f", "ratio": ".2f", "ratio3": ".3f", "share": ".0%",
           "percent": "percent"}   # "text" and "kernel" (its first word) cells are written as they are
BEGIN, END = "<!-- table {} -->", "<!-- /table {} -->"


def _field(row, key):
    """``row[key]``, where ``"a.b"`` reads ``row["a"]["b"]``; None where it is missing."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _stat(row, key):
    """(median, low, high) of a field; low and high are None where the row gives no range.

    A field may be a number (its range then in ``KEY p10``/``KEY p90``, ``NAME_p10_us``/``NAME_p90_us`` or
    ``KEY_min``/``KEY_max`` beside it), a dict of median, min and max, a (median, low, high) triple, or a pair whose
    first item is the time compared (GPU time beside wall time).

    >>> _stat({"a us": 5.0, "a p10": 4.0, "a p90": 6.0}, "a us")
    (5.0, 4.0, 6.0)
    >>> _stat({"t": [3.0, 9.0]}, "t")
    (3.0, None, None)
    """
    value = _field(row, key)
    if isinstance(value, dict) and "median" in value:
        return value["median"], value.get("min"), value.get("max")
    if isinstance(value, (list, tuple)):
        if len(value) >= 3:
            return tuple(value[:3])
        return (value[0], None, None) if value else None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    for low, high in ((key[:-3] + " p10", key[:-3] + " p90") if key.endswith(" us") else (None, None),
                      (key[:-3] + "_p10_us", key[:-3] + "_p90_us") if key.endswith("_us") else (None, None),
                      (key + "_min", key + "_max")):
        if low and isinstance(row.get(low), (int, float)) and isinstance(row.get(high), (int, float)):
            return value, row[low], row[high]
    return value, None, None


def _number(value, kind):
    fmt = FORMATS[kind]
    if fmt == "us":   # microseconds: a decimal below 1,000, whole ones with a thousands comma above
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.1f}"
    if fmt == "percent":   # already in per cent
        return f"{value:.0f}%"
    return f"{value:{fmt}}"


def _cell(row, key, kind):
    """One cell: text as it is; a number as its kind says, with ``(low-high)`` where the row gives a range."""
    if kind in ("text", "kernel"):
        value = _field(row, key)
        if isinstance(value, list):
            value = "(" + ", ".join(map(str, value)) + (",)" if len(value) == 1 else ")")
        text = "-" if value is None else str(value)
        return text.split()[0] if kind == "kernel" and text.strip() else text
    if isinstance(key, tuple):
        top, bottom = _stat(row, key[0]), _stat(row, key[1])
        if not top or not bottom or not bottom[0]:
            return "-"
        return _number(top[0] / bottom[0], kind)
    stat = _stat(row, key)
    if stat is None:
        return "-"
    median, low, high = stat
    if low is None or high is None:
        return _number(median, kind)
    return f"{_number(median, kind)} ({_number(low, kind)}-{_number(high, kind)})"


def _pivot_lines(rows, spec):
    """(headers, text-column count, cell lists) of a pivoted table: one line per value of the ``text`` columns."""
    keys = [c for c in spec["columns"] if _field(rows[0], c[1]) is not None] if rows else []
    groups = {}
    for r in rows:
        groups.setdefault(tuple(str(_field(r, c[1])) for c in keys), {})[str(_field(r, spec["pivot"]))] = r
    values = [v for v in spec["values"] if any(v in g for g in groups.values())]
    headers = [c[0] for c in keys] + [h.format(v) for v in values for h, _, _ in spec["per_value"]]
    lines = []
    for label, by_value in groups.items():
        cells = list(label)
        for v in values:
            r = by_value.get(v)
            cells += [_cell(r, key, kind) if r else "-" for _, key, kind in spec["per_value"]]
        lines.append(cells)
    return headers, len(keys), lines


def _plain_lines(rows, spec):
    """(headers, text-column count, cell lists) of a table of one line a row, without the columns no row has."""
    def present(key):
        keys = key if isinstance(key, tuple) else (key,)
        return any(all(_field(r, k) is not None for k in keys) for r in rows)
    columns = [c for c in spec["columns"] if present(c[1])]
    texts = sum(1 for c in columns if c[2] in ("text", "kernel"))
    return [c[0] for c in columns], texts, [[_cell(r, key, kind) for _, key, kind in columns] for r in rows]


def bench_table(name, data, gpu, date, command):
    """The markdown table of one benchmark's results, as BENCHMARKS.md holds it; None where there are no rows.

    >>> print(bench_table("reduce", {"rows": [dict(shape=[8, 4], axes=[0], fluxpy_us=5.0, fluxpy_p10_us=4.5,
    ...       fluxpy_p90_us=5.5, torch_us=10.0, ratio=0.5, pct_copy=91.2)]}, "GPU X", "2026-01-01", "run.py"))
    GPU X, 2026-01-01, `run.py`. Median (range: the benchmark's rounds, p10-p90 or low-high) per cell.
    <BLANKLINE>
    | shape | axes | fluxpy us | torch.sum us | fluxpy / torch.sum | % of copy |
    |---|---|---:|---:|---:|---:|
    | (8, 4) | (0,) | 5.0 (4.5-5.5) | 10.0 | 0.50 | 91% |
    """
    spec = TABLES.get(name)
    rows = [r for r in _rows(data) if isinstance(r, dict)]
    if spec is None:   # a benchmark without a table of its own: its fluxpy / PyTorch pairs
        rows = [r for r in summary_rows({name: rows})]
        spec = dict(columns=[("case", "case", "text"), ("fluxpy us", "fluxpy_us", "us"),
                             ("PyTorch us", "torch_us", "us"), ("fluxpy / PyTorch", "ratio", "ratio")])
    if not rows:
        return None
    headers, text_columns, lines = (_pivot_lines if "pivot" in spec else _plain_lines)(rows, spec)
    align = ["---"] * text_columns + ["---:"] * (len(headers) - text_columns)
    out = [f"{gpu}, {date}, `{command}`. Median (range: the benchmark's rounds, p10-p90 or low-high) per cell.", "",
           "| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def write_tables(path, tables):
    """Put each ``{name: markdown}`` table into the file at ``path`` between its markers; a table whose markers
    the file lacks goes at the end under a heading of its name. Returns the names placed in existing sections.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "B.md"
    >>> _ = f.write_text("# B\\n<!-- table reduce -->\\nold\\n<!-- /table reduce -->\\ntail\\n")
    >>> write_tables(f, {"reduce": "new"})
    ['reduce']
    >>> print(f.read_text())
    # B
    <!-- table reduce -->
    new
    <!-- /table reduce -->
    tail
    <BLANKLINE>
    """
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    replaced = []
    for name, table in tables.items():
        begin, end = BEGIN.format(name), END.format(name)
        start, stop = text.find(begin), text.find(end)
        if start >= 0 and stop > start:
            text = text[:start + len(begin)] + "\n" + table.strip("\n") + "\n" + text[stop:]
            replaced.append(name)
        else:
            text = text.rstrip("\n") + f"\n\n## {name}\n\n{begin}\n{table.strip(chr(10))}\n{end}\n"
    path.write_text(text)
    return replaced


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
    p.add_argument("--write", default=None, metavar="MARKDOWN",
                   help="replace each benchmark's table in this file (BENCHMARKS.md) with this run's")
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
    if a.write:
        write_run(a.write, results, a.quick)
    return 1 if failed else 0


def write_run(path, results, quick):
    """Write the tables of the benchmarks that ran into the markdown file at ``path`` (see :func:`write_tables`)."""
    gpu, date = gpu_name(), datetime.date.today().isoformat()
    tables = {}
    for name, data in results.items():
        command = f"PYTHONPATH=. python3 benchmarks/run.py --only {name}" + (" --quick" if quick else "")
        table = bench_table(name, data, gpu, date, command) if data is not None else None
        if table is not None:
            tables[name] = table
    replaced = write_tables(path, tables)
    added = sorted(set(tables) - set(replaced))
    print(f"\n{path}: tables of {', '.join(replaced) or 'no benchmark'} replaced"
          + (f"; {', '.join(added)} added at the end" if added else ""))


if __name__ == "__main__":
    sys.exit(main())
