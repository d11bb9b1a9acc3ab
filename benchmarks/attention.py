"""Attention alone, forward + backward: ``fluxpy.dot_product_attention`` against PyTorch's
``torch.nn.functional.scaled_dot_product_attention``, eager and captured in a CUDA graph, in bfloat16 and float32.

Cases (:data:`SHAPES`, ``(N, heads, L, d)``): ``(256, 3, 64, 64)`` (the zoo's ViT), ``(8, 12, 1024, 64)`` causal (the
zoo's GPT), ``(32, 8, 512, 64)``. One call is the forward and the gradients of ``q``, ``k`` and ``v`` for a given
output cotangent ``dy``, on the same inputs on both sides (standard normal, rounded to the dtype):

- fluxpy: ``q``, ``k``, ``v`` and ``dy`` ``(N, L, heads * d)`` (the layout a projection gives),
  ``fluxpy.pullback`` of ``dot_product_attention(q, k, v, nheads=heads, causal=causal, need_scores=False)[0]``,
  then the pullback of ``dy`` (no scores asked for, as PyTorch's SDPA: in half precision on the GPU fluxpy runs
  cuDNN's fused kernels, in float32 its own flash kernels, ``fluxpy.kernels.cuda_flash``; the row's ``fluxpy_path``
  says "fused", or why the composite ran);
- PyTorch: the same ``(N, L, heads * d)`` tensors viewed as ``(N, heads, L, d)`` (as its ``MultiheadAttention``
  does), ``scaled_dot_product_attention(q, k, v, is_causal=causal)`` (PyTorch picks its kernel: flash, cuDNN or
  memory-efficient), then ``torch.autograd.grad`` of ``dy``.

Modes: ``eager`` (each call from Python) and ``captured`` (the call recorded once as a CUDA graph and replayed:
``fluxpy.backend.capture_graph`` and ``torch.cuda.graph`` after a warm-up on a side stream). Time: GPU time by CUDA
events on each side's current stream around ``--calls`` back-to-back calls, per call, over ``--rounds`` rounds (3 at
least): median, min and max in us, after ``--warmup`` calls. Eager times include whatever the host adds between the
calls' kernels (a host slower than the GPU shows); the host time to queue a call (``host`` in the JSON: the
round's calls by the wall clock, before the end event is waited for) beside it. TF32 is off on both
sides. ``max rel diff``: the largest difference between the two sides' gradients (eager) over the largest gradient,
per gradient, the largest of the three; at the dtype's rounding it is of the order of its epsilon. A side that
fails (to build, to capture, to run) is recorded with its error and listed under the table.

Run (GPU, PyTorch): ``PYTHONPATH=. python3 benchmarks/attention.py [--shapes 256x3x64x64,8x12x1024x64c]
[--dtypes bfloat16,float32] [--calls 50 --rounds 5 --warmup 5] [--out DIR] [--json rows.json]``; ``--out`` writes
``attention.md`` (the table) and ``attention.json`` (the rows) in that folder.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fluxpy  # noqa: E402
from fluxpy.kernels.halfs import BFLOAT16  # noqa: E402
from zoo import cell, first_line  # noqa: E402

DTYPES = ("bfloat16", "float32")
MODES = ("eager", "captured")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention problem: batch ``n``, ``heads``, sequence ``length``, head size ``d``, and whether it is causal.

    >>> Shape(8, 12, 1024, 64, True).label, Shape(8, 12, 1024, 64, True).features
    ('(8, 12, 1024, 64) causal', 768)
    """
    n: int
    heads: int
    length: int
    d: int
    causal: bool = False

    @property
    def features(self) -> int:
        return self.heads * self.d

    @property
    def label(self) -> str:
        return f"({self.n}, {self.heads}, {self.length}, {self.d})" + (" causal" if self.causal else "")


SHAPES = (Shape(256, 3, 64, 64), Shape(8, 12, 1024, 64, True), Shape(32, 8, 512, 64))


def parse_shapes(text: str) -> list[Shape]:
    """``--shapes``: comma-separated ``NxHEADSxLxD``, a trailing ``c`` for causal.

    >>> parse_shapes("256x3x64x64, 8x12x1024x64c")
    [Shape(n=256, heads=3, length=64, d=64, causal=False), Shape(n=8, heads=12, length=1024, d=64, causal=True)]
    """
    shapes = []
    for token in (t.strip().lower() for t in text.split(",")):
        if not token:
            continue
        causal = token.endswith("c")
        sizes = token[:-1] if causal else token
        parts = sizes.split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"attention: a shape is NxHEADSxLxD of positive ints, a trailing c for causal; got "
                             f"{token!r}")
        shapes.append(Shape(*(int(p) for p in parts), causal=causal))
    return shapes


def stats(per_call_us: list[float]) -> dict:
    """The median, min and max of per-call times in us, and the rounds.

    >>> stats([3.0, 1.0, 2.0])
    {'median': 2.0, 'min': 1.0, 'max': 3.0, 'rounds_us': [3.0, 1.0, 2.0]}
    """
    return dict(median=float(statistics.median(per_call_us)), min=min(per_call_us), max=max(per_call_us),
                rounds_us=[round(t, 2) for t in per_call_us])


def inputs(shape: Shape, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """``q, k, v, dy``: float32 arrays ``(N, L, heads * d)`` of standard normal values rounded to ``dtype``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(4):
        a = rng.standard_normal((shape.n, shape.length, shape.features), dtype=np.float32)
        out.append(a.astype(BFLOAT16).astype(np.float32) if dtype == "bfloat16" else a)
    return out


def fluxpy_call(shape: Shape, arrays: list, xp=np):
    """``call() -> (dq, dk, dv)``: fluxpy's forward and backward on ``arrays`` (``q, k, v, dy`` of one dtype, of
    ``xp``: NumPy or CuPy)."""
    q, k, v, dy = arrays

    def attend(q, k, v):
        return fluxpy.dot_product_attention(q, k, v, nheads=shape.heads, causal=shape.causal, need_scores=False)[0]

    def call():
        _, back = fluxpy.pullback(attend, q, k, v)
        return back(dy)
    return call


def torch_call(torch, shape: Shape, tensors: list):
    """``call() -> (dq, dk, dv)``: PyTorch's forward and backward on ``tensors`` (``q, k, v, dy``, ``(N, L, heads *
    d)``; ``q, k, v`` requiring gradients), viewed as ``(N, heads, L, d)``."""
    q, k, v, dy = tensors

    def heads(t):
        return t.view(shape.n, shape.length, shape.heads, shape.d).transpose(1, 2)

    def call():
        y = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=shape.causal)
        return torch.autograd.grad(y, (q, k, v), heads(dy))
    return call


def torch_tensors(torch, arrays: list, dtype: str, device: str) -> list:
    """``q, k, v`` (requiring gradients) and ``dy`` as PyTorch tensors of ``dtype`` on ``device``."""
    tensors = [torch.from_numpy(a).to(device=device, dtype=getattr(torch, dtype)) for a in arrays]
    return [t.requires_grad_(True) for t in tensors[:3]] + [tensors[3]]


def max_rel_diff(ours, theirs) -> float:
    """The largest ``max |a - b| / max |b|`` over pairs of gradients (float32 NumPy arrays).

    >>> max_rel_diff([np.array([1.0, 2.0])], [np.array([1.0, 4.0])])
    0.5
    """
    return max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) for a, b in zip(ours, theirs))


# ----------------------------------------------------------------------------------------------- the GPU

def to_device(a: np.ndarray):
    """A CuPy copy of ``a``; a bfloat16 array travels as its bits (CuPy has no bfloat16 of its own)."""
    import cupy
    return cupy.asarray(a.view(np.uint16)).view(a.dtype) if a.dtype == BFLOAT16 else cupy.asarray(a)


def to_host(a) -> np.ndarray:
    """A float32 NumPy copy of the CuPy array ``a`` (bfloat16 as its bits, then widened)."""
    import cupy
    host = cupy.asnumpy(a.view(cupy.uint16)).view(a.dtype) if a.dtype == BFLOAT16 else cupy.asnumpy(a)
    return host.astype(np.float32)


class Clock:
    """CUDA events of one side on its current stream: ``record()`` an event, ``ms(start, end)`` between two."""

    def __init__(self, side: str, torch=None):
        self.side, self.torch = side, torch

    def record(self):
        if self.side == "torch":
            event = self.torch.cuda.Event(enable_timing=True)
        else:
            import cupy
            event = cupy.cuda.Event()
        event.record()
        return event

    def ms(self, start, end) -> float:
        end.synchronize()
        if self.side == "torch":
            return start.elapsed_time(end)
        import cupy
        return cupy.cuda.get_elapsed_time(start, end)


def timed(run, clock: Clock, calls: int, rounds: int, warmup: int) -> dict:
    """GPU time per call (:func:`stats`) of ``run`` over ``rounds`` of ``calls`` calls, after ``warmup`` calls; the
    host time to queue a call beside it (``host``: the wall clock of the calls, no wait for the device)."""
    for _ in range(warmup):
        run()
    clock.ms(clock.record(), clock.record())
    gpu, host = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        start = clock.record()
        for _ in range(calls):
            run()
        end = clock.record()
        host.append((time.perf_counter() - t0) * 1e6 / calls)
        gpu.append(clock.ms(start, end) * 1e3 / calls)
    return dict(stats(gpu), host=stats(host))


def fluxpy_graph(call, warmup: int):
    """``call`` recorded as a CUDA graph by fluxpy (after ``warmup`` calls): its replay."""
    from fluxpy.backend import capture_graph
    for _ in range(warmup):
        call()
    graph, _ = capture_graph(call)
    return graph.launch


def torch_graph(torch, call, warmup: int):
    """``call`` recorded as a CUDA graph by PyTorch (warm-up on a side stream, its documented recipe): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()

    def replay():
        graph.replay()
        return outputs
    return replay


def run_case(torch, shape: Shape, dtype: str, a) -> list[dict]:
    """The rows (one a mode) of one shape and dtype: each side's stats, or its error."""
    import cupy
    arrays = inputs(shape, dtype)
    dtype_np = BFLOAT16 if dtype == "bfloat16" else np.float32
    ours = fluxpy_call(shape, [to_device(x.astype(dtype_np)) for x in arrays], xp=cupy)
    theirs = torch_call(torch, shape, torch_tensors(torch, arrays, dtype, "cuda"))
    clocks = dict(fluxpy=Clock("fluxpy"), torch=Clock("torch", torch))
    diff = None
    try:
        diff = max_rel_diff([to_host(g) for g in ours()],
                            [g.float().cpu().numpy() for g in theirs()])
    except Exception as err:   # reported in the rows: the timing below says which side fails
        print(f"{shape.label} {dtype}: no comparison ({first_line(err)})", flush=True)
    path = fluxpy.ops.attention.fused_reason() or "fused"
    if path != "fused":
        print(f"{shape.label} {dtype}: fluxpy ran the composite ({path})", flush=True)
    builders = dict(eager=dict(fluxpy=lambda: ours, torch=lambda: theirs),
                    captured=dict(fluxpy=lambda: fluxpy_graph(ours, a.warmup),
                                  torch=lambda: torch_graph(torch, theirs, a.warmup)))
    rows = []
    for mode in MODES:
        row = dict(benchmark="attention", shape=shape.label, causal=shape.causal, dtype=dtype, mode=mode,
                   max_rel_diff=diff, fluxpy_path=path)
        for side in ("fluxpy", "torch"):
            try:
                run = builders[mode][side]()
                row[side] = timed(run, clocks[side], a.calls, a.rounds, a.warmup)
            except Exception as err:   # a failing side is a result
                row[side] = dict(error=first_line(err))
            run = None   # a graph and its memory go before the next one is made
            cupy.cuda.runtime.deviceSynchronize()
            torch.cuda.synchronize()
        rows.append(finish_row(row))
        print(table([row], header=False), flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- rows (pure Python)

def finish_row(row: dict) -> dict:
    """Add the ratio fluxpy / PyTorch of the medians, and the pair run.py's summary compares.

    >>> finish_row(dict(fluxpy=dict(median=3.0), torch=dict(median=4.0)))["ratio"]
    0.75
    """
    ours, theirs = (row[s].get("median") for s in ("fluxpy", "torch"))
    row["fluxpy_us"], row["torch_us"] = ours, theirs
    row["ratio"] = ours / theirs if ours is not None and theirs else None
    return row


HEADER = ["| shape (N, heads, L, d) | dtype | mode | fluxpy us | PyTorch us | fluxpy / PyTorch | max rel diff |",
          "|---|---|---|---:|---:|---:|---:|"]


def table(rows: list[dict], header: bool = True) -> str:
    """The markdown table, a row per shape, dtype and mode (us: median (min-max) of GPU time per call), then the
    failures, one a line."""
    lines = list(HEADER) if header else []
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r.get("ratio") is not None else "-"
        diff = f"{r['max_rel_diff']:.1e}" if r.get("max_rel_diff") is not None else "-"
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['mode']} | {cell(r['fluxpy'])} | {cell(r['torch'])} | "
                     f"{ratio} | {diff} |")
    failures = [f"- {r['shape']} {r['dtype']} {r['mode']}, {side}: {r[side]['error']}"
                for r in rows for side in ("fluxpy", "torch") if "error" in r[side]]
    if failures:
        lines += ["", "Failures:", *failures]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(f"{s.n}x{s.heads}x{s.length}x{s.d}" + ("c" if s.causal else "")
                                                 for s in SHAPES), help="NxHEADSxLxD, a trailing c for causal")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--calls", type=int, default=50, help="calls a round, between two events")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None, help="a folder for attention.md and attention.json")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.rounds < 3:
        p.error("--rounds must be 3 or more (the median and range over rounds)")
    try:
        a.shapes = parse_shapes(a.shapes)
    except ValueError as err:
        p.error(str(err))
    a.dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if any(d not in DTYPES for d in a.dtypes):
        p.error(f"--dtypes: among {', '.join(DTYPES)}, got {a.dtypes}")
    import torch
    from resnet_step import set_tf32
    set_tf32(False, torch, "gpu")
    print(f"PyTorch {torch.__version__}, {torch.cuda.get_device_name()}; GPU us per forward + backward, median "
          f"(min-max) of {a.rounds} rounds of {a.calls} calls\n" + "\n".join(HEADER), flush=True)
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in a.shapes:
        for dtype in a.dtypes:
            rows += run_case(torch, shape, dtype, a)
            # after every case: a crash in a later one (a fault in a native library) keeps these
            for path in (a.json, out and out / "attention.json"):
                if path:
                    Path(path).write_text(json.dumps(rows, indent=1))
    text = table(rows)
    if out:
        (out / "attention.md").write_text(text + "\n")
    print("\n" + text)
    return rows


if __name__ == "__main__":
    main()
