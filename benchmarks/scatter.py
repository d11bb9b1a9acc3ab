"""Scatter and gather: ``fluxpy.scatter`` / ``fluxpy.gather`` (``fluxpy.kernels.cuda_scatter``) against PyTorch's
``scatter_add_``/``scatter_reduce_``, ``index_add_``, ``embedding_dense_backward``, ``index_select``, ``embedding``
and ``gather``, float32, indices int64 on the GPU.

Cases (the issue's):

- ``one element``: a one-element scatter-add (and gather) into a one-element array;
- ``index_add``: 32768 x 512 rows added into 50000 x 512 at random rows (gather: the same rows read back);
- ``embedding``: an Embedding's weight gradient, vocabulary 50,000, 64 x 512 tokens, 512 features (gather: the
  forward lookup);
- ``last axis 4-d``: every element of a (1000, 256, 7, 7) array sent along its last axis (fluxpy: four index
  arrays, three of them broadcast ``arange`` views read in place; PyTorch: ``scatter_add_(3, ...)`` /
  ``scatter_reduce_(3, ..., "amax")``; gather: ``torch.gather(..., 3, ...)``).

fluxpy's ``scatter`` returns a new array (NNlib's), so PyTorch's side is timed out of place too: ``torch.zeros``
(or ``torch.full`` for a max) then the in-place op; the in-place op alone is the ``torch in place`` column.

Timing is wall time per call, what a caller sees: ``--reps`` back-to-back calls, then a device synchronize, over
``--rounds`` rounds (median and range). fluxpy's public ops check device indices inside their kernels and wait for
that check (so each call includes its kernel's whole time); PyTorch checks with device-side asserts and does not
wait. ``ratio`` = fluxpy / PyTorch (out of place). The chosen implementation and every candidate's measured time
come from ``fluxpy.kernels.cuda_scatter.choices()``. Targets: ratio at most 1 everywhere, a one-element scatter
under 10 us.

Run: ``PYTHONPATH=. python3 benchmarks/scatter.py [--reps 50] [--rounds 5] [--json out.json]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def wall_us(sync, run, reps, rounds):
    """``(median, low, high)`` microseconds per call of ``run`` over ``rounds`` of ``reps`` calls and a sync."""
    run()
    sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        sync()
        times.append((time.perf_counter() - t0) * 1e6 / reps)
    return statistics.median(times), min(times), max(times)


def _cases(cp, torch):
    """``(name, fluxpy scatter call, torch out-of-place call, torch in-place call, fluxpy gather, torch gather)``."""
    import fluxpy
    rng = np.random.default_rng(0)
    dev = torch.device("cuda")

    def both(a):
        return cp.asarray(a), torch.as_tensor(a, device=dev)

    cases = []
    # one element
    src, tsrc = both(rng.standard_normal(1).astype(np.float32))
    idx, tidx = both(np.zeros(1, np.int64))
    tdst = torch.zeros(1, device=dev)
    cases.append(("one element", lambda: fluxpy.scatter("+", src, idx, dstsize=1),
                  lambda: torch.zeros(1, device=dev).scatter_add_(0, tidx, tsrc),
                  lambda: tdst.scatter_add_(0, tidx, tsrc),
                  lambda: fluxpy.gather(src, idx), lambda: torch.gather(tsrc, 0, tidx)))
    from fluxpy.kernels import cuda_scatter
    cases.append(("one element, the kernel unchecked", lambda: cuda_scatter.scatter("add", src, (idx,), (1,)),
                  lambda: torch.zeros(1, device=dev).scatter_add_(0, tidx, tsrc),
                  lambda: tdst.scatter_add_(0, tidx, tsrc),
                  lambda: cuda_scatter.gather(src, (idx,)), lambda: torch.gather(tsrc, 0, tidx)))
    # index_add
    rows, trows = both(rng.integers(0, 50000, 32768))
    vals, tvals = both(rng.standard_normal((32768, 512)).astype(np.float32))
    table, ttable = both(rng.standard_normal((50000, 512)).astype(np.float32))
    tdst2 = torch.zeros(50000, 512, device=dev)
    cases.append(("index_add 32768x512 -> 50000x512", lambda: fluxpy.scatter("+", vals, rows, dstsize=(50000, 512)),
                  lambda: torch.zeros(50000, 512, device=dev).index_add_(0, trows, tvals),
                  lambda: tdst2.index_add_(0, trows, tvals),
                  lambda: fluxpy.gather(table, rows), lambda: torch.index_select(ttable, 0, trows)))
    # embedding backward
    tokens, ttokens = both(rng.integers(0, 50000, (64, 512)))
    dy, tdy = both(rng.standard_normal((64, 512, 512)).astype(np.float32))
    cases.append(("embedding bwd 50000 x 512, 64x512 tokens",
                  lambda: fluxpy.scatter("+", dy, tokens, dstsize=(50000, 512)),
                  lambda: torch.ops.aten.embedding_dense_backward(tdy, ttokens, 50000, -1, False), None,
                  lambda: fluxpy.gather(table, tokens), lambda: torch.nn.functional.embedding(ttokens, ttable)))
    # 4-d scatter along the last axis
    shape = (1000, 256, 7, 7)
    last, tlast = both(rng.integers(0, 7, shape))
    grid = tuple(cp.broadcast_to(cp.arange(n).reshape([-1 if a == j else 1 for a in range(4)]), shape)
                 for j, n in enumerate(shape[:3]))
    big, tbig = both(rng.standard_normal(shape).astype(np.float32))
    tdst4 = torch.zeros(shape, device=dev)
    cases.append(("last axis of (1000,256,7,7), add", lambda: fluxpy.scatter("+", big, grid + (last,), dstsize=shape),
                  lambda: torch.zeros(shape, device=dev).scatter_add_(3, tlast, tbig),
                  lambda: tdst4.scatter_add_(3, tlast, tbig),
                  lambda: fluxpy.gather(big, grid + (last,)), lambda: torch.gather(tbig, 3, tlast)))
    cases.append(("last axis of (1000,256,7,7), max", lambda: fluxpy.scatter("max", big, grid + (last,), dstsize=shape),
                  lambda: torch.full(shape, -float("inf"), device=dev).scatter_reduce_(3, tlast, tbig, "amax"),
                  lambda: tdst4.scatter_reduce_(3, tlast, tbig, "amax"), None, None))
    return cases


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import cupy as cp
    import torch

    import fluxpy  # noqa: F401  (registers the GPU kernels)
    from fluxpy.kernels import cuda_scatter

    def sync():
        cp.cuda.runtime.deviceSynchronize()
    rows = []
    print(f"GPU: {torch.cuda.get_device_name()}; wall us per call, median [low-high] of {args.rounds} rounds x "
          f"{args.reps} calls")
    print(f"{'case':44s} {'op':7s} {'fluxpy':>22s} {'torch':>22s} {'torch in place':>16s} {'ratio':>6s}  chosen")
    for name, f_sc, t_sc, t_inplace, f_ga, t_ga in _cases(cp, torch):
        for op, f, t, t_in in (("scatter", f_sc, t_sc, t_inplace), ("gather", f_ga, t_ga, None)):
            if f is None:
                continue
            before = set(cuda_scatter.choices())
            fl = wall_us(sync, f, args.reps, args.rounds)
            th = wall_us(sync, t, args.reps, args.rounds)
            ti = wall_us(sync, t_in, args.reps, args.rounds) if t_in is not None else None
            new = [cuda_scatter.choices()[k] for k in set(cuda_scatter.choices()) - before]
            chosen = "; ".join(f"{n} {times}" for n, times in new)
            row = {"case": name, "op": op, "fluxpy_us": fl, "torch_us": th, "torch_inplace_us": ti,
                   "ratio": fl[0] / th[0], "chosen": chosen}
            rows.append(row)
            fmt = "{:7.1f} [{:6.1f}-{:6.1f}]"
            print(f"{name:44s} {op:7s} {fmt.format(*fl):>22s} {fmt.format(*th):>22s} "
                  f"{(f'{ti[0]:7.1f}' if ti else '-'):>16s} {fl[0] / th[0]:6.2f}  {chosen}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
