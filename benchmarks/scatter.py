"""Scatter and gather: ``fluxpy.scatter`` / ``fluxpy.gather`` (``fluxpy.kernels.cuda_scatter``) against PyTorch's
``scatter_add_``/``scatter_reduce_``, ``index_add_``, ``embedding_dense_backward``, ``index_select``, ``embedding``
and ``gather``, float32, indices int64 on the GPU.

Cases (the issue's):

- ``one element``: a one-element scatter-add (and gather) into a one-element array;
- ``index_add``: 32768 x 512 rows added into 50000 x 512 at random rows (gather: the same rows read back);
- ``embedding``: an Embedding's weight gradient, vocabulary 50,000, 64 x 512 tokens, 512 features (gather: the
  forward lookup);
- ``last axis 4-d``: every element of a (1000, 256, 7, 7) array sent along its last axis, in both of fluxpy's
  forms: NNlib's (four index arrays, three of them broadcast ``arange`` views read in place) and the along-axis
  form (``axis=3``: the one index array, as PyTorch's ``scatter_add_(3, ...)`` / ``scatter_reduce_(3, ...,
  "amax")``; gather: ``torch.gather(..., 3, ...)``).

fluxpy's ``scatter`` returns a new array (NNlib's), so PyTorch's side is timed out of place too: ``torch.zeros``
(or ``torch.full`` for a max) then the in-place op; the in-place op alone is the ``torch in place`` column.

Timing is wall time per call, what a caller sees: ``--reps`` back-to-back calls, then a device synchronize, over
``--rounds`` rounds (median and range). fluxpy's public ops check device indices inside their kernels; the ``fluxpy``
column is ``index_checks="wait"`` (each call waits for that check, so it includes its kernel's whole time), the
``deferred`` column the same calls in the default mode, ``index_checks="deferred"`` (no wait: a bad index is reported
by a later checked call or ``fluxpy.check_indices()``, run once after the timing), which is how PyTorch checks
(device-side asserts, no wait). ``ratio`` = fluxpy / PyTorch (out of place), wall times,
``ratio def.`` the same for the deferred column. ``GPU`` columns: GPU time alone (fluxpy's kernel-level call,
unchecked, and PyTorch's out-of-place call queued behind a spin kernel, so host time is hidden). The chosen
implementation and every candidate's measured time come from ``fluxpy.kernels.cuda_scatter.choices()``. Targets:
ratio at most 1 everywhere, a one-element scatter under 10 us.

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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from layernorm import gpu_us  # noqa: E402  (GPU time behind a spin kernel, as the layer-norm benchmark takes it)


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
    """Rows of ``(case, op, fluxpy call, its kernel unchecked, torch out of place, torch in place or None)``."""
    import fluxpy
    from fluxpy.kernels import cuda_scatter
    rng = np.random.default_rng(0)
    dev = torch.device("cuda")

    def both(a):
        return cp.asarray(a), torch.as_tensor(a, device=dev)

    def rows(case, src, idx, shape, t_scatter, t_inplace, t_gather, table=None, op="+", axis=None):
        table = src if table is None else table
        name = {"+": "add", "max": "max"}[op]
        index = idx if isinstance(idx, tuple) else (idx,)
        out = [(case, f"scatter {name}", lambda: fluxpy.scatter(op, src, idx, dstsize=shape, axis=axis),
                lambda: cuda_scatter.scatter(name, src, index, shape, False, axis), t_scatter, t_inplace)]
        if t_gather is not None:
            out.append((case, "gather", lambda: fluxpy.gather(table, idx, axis=axis),
                        lambda: cuda_scatter.gather(table, index, False, axis), t_gather, None))
        return out

    cases = []
    src, tsrc = both(rng.standard_normal(1).astype(np.float32))
    idx, tidx = both(np.zeros(1, np.int64))
    tdst = torch.zeros(1, device=dev)
    cases += rows("one element", src, idx, (1,), lambda: torch.zeros(1, device=dev).scatter_add_(0, tidx, tsrc),
                  lambda: tdst.scatter_add_(0, tidx, tsrc), lambda: torch.gather(tsrc, 0, tidx))
    rows_, trows = both(rng.integers(0, 50000, 32768))
    vals, tvals = both(rng.standard_normal((32768, 512)).astype(np.float32))
    table, ttable = both(rng.standard_normal((50000, 512)).astype(np.float32))
    tdst2 = torch.zeros(50000, 512, device=dev)
    cases += rows("index_add 32768x512 -> 50000x512", vals, rows_, (50000, 512),
                  lambda: torch.zeros(50000, 512, device=dev).index_add_(0, trows, tvals),
                  lambda: tdst2.index_add_(0, trows, tvals), lambda: torch.index_select(ttable, 0, trows), table)
    tokens, ttokens = both(rng.integers(0, 50000, (64, 512)))
    dy, tdy = both(rng.standard_normal((64, 512, 512)).astype(np.float32))
    cases += rows("embedding 50000 x 512, 64x512 tokens", dy, tokens, (50000, 512),
                  lambda: torch.ops.aten.embedding_dense_backward(tdy, ttokens, 50000, -1, False), None,
                  lambda: torch.nn.functional.embedding(ttokens, ttable), table)
    shape = (1000, 256, 7, 7)
    last, tlast = both(rng.integers(0, 7, shape))
    grid = tuple(cp.broadcast_to(cp.arange(n).reshape([-1 if a == j else 1 for a in range(4)]), shape)
                 for j, n in enumerate(shape[:3]))
    big, tbig = both(rng.standard_normal(shape).astype(np.float32))
    tdst4 = torch.zeros(shape, device=dev)
    cases += rows("last axis of (1000,256,7,7)", big, grid + (last,), shape,
                  lambda: torch.zeros(shape, device=dev).scatter_add_(3, tlast, tbig),
                  lambda: tdst4.scatter_add_(3, tlast, tbig), lambda: torch.gather(tbig, 3, tlast))
    cases += rows("last axis of (1000,256,7,7)", big, grid + (last,), shape,
                  lambda: torch.full(shape, -float("inf"), device=dev).scatter_reduce_(3, tlast, tbig, "amax"),
                  lambda: tdst4.scatter_reduce_(3, tlast, tbig, "amax"), None, op="max")
    cases += rows("(1000,256,7,7) axis=3", big, last, shape,
                  lambda: torch.zeros(shape, device=dev).scatter_add_(3, tlast, tbig),
                  lambda: tdst4.scatter_add_(3, tlast, tbig), lambda: torch.gather(tbig, 3, tlast), axis=3)
    cases += rows("(1000,256,7,7) axis=3", big, last, shape,
                  lambda: torch.full(shape, -float("inf"), device=dev).scatter_reduce_(3, tlast, tbig, "amax"),
                  lambda: tdst4.scatter_reduce_(3, tlast, tbig, "amax"), None, op="max", axis=3)
    return cases


def deferred_wall_us(sync, run, reps, rounds):
    """:func:`wall_us` of ``run`` with ``index_checks="deferred"``, then ``fluxpy.check_indices()`` (the benchmark's
    indices are all good: it raises nothing)."""
    import fluxpy
    try:
        with fluxpy.options(index_checks="deferred"):
            return wall_us(sync, run, reps, rounds)
    finally:
        fluxpy.check_indices()


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
          f"{args.reps} calls; GPU us: the kernel unchecked, host time hidden")
    print(f"{'case':38s} {'op':12s} {'fluxpy':>22s} {'deferred':>22s} {'torch':>22s} {'ratio':>6s} "
          f"{'ratio def.':>10s} {'GPU flux':>9s} {'GPU torch':>9s} {'torch in place':>14s}  chosen")
    fmt = "{:7.1f} [{:6.1f}-{:6.1f}]"
    for case, op, f, kernel, t, t_in in _cases(cp, torch):
        before = set(cuda_scatter.choices())
        with fluxpy.options(index_checks="wait"):
            fl = wall_us(sync, f, args.reps, args.rounds)
        fd = deferred_wall_us(sync, f, args.reps, args.rounds)
        th = wall_us(sync, t, args.reps, args.rounds)
        ti = wall_us(sync, t_in, args.reps, args.rounds) if t_in is not None else None
        g_fl, g_th = gpu_us(cp, kernel, args.reps, args.rounds), gpu_us(cp, t, args.reps, args.rounds)
        chosen = "; ".join(f"{n} {times}" for k, (n, times) in cuda_scatter.choices().items() if k not in before)
        row = {"case": case, "op": op, "fluxpy_us": fl, "fluxpy_deferred_us": fd, "torch_us": th,
               "torch_inplace_us": ti, "ratio": fl[0] / th[0], "ratio_deferred": fd[0] / th[0],
               "fluxpy_gpu_us": g_fl, "torch_gpu_us": g_th, "chosen": chosen}
        rows.append(row)
        print(f"{case:38s} {op:12s} {fmt.format(*fl):>22s} {fmt.format(*fd):>22s} {fmt.format(*th):>22s} "
              f"{fl[0] / th[0]:6.2f} {fd[0] / th[0]:10.2f} {g_fl:9.1f} {g_th:9.1f} "
              f"{(f'{ti[0]:7.1f}' if ti else '-'):>14s}  {chosen}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
