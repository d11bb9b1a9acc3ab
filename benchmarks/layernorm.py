"""Layer norm at bandwidth: fluxpy's kernels (``fluxpy.kernels.cuda_layernorm``) against
``torch.nn.functional.layer_norm``, with the copy bandwidth of the same bytes measured in the same run.

Cases: 8192 rows x {768, 1024, 1536, 4096, 5140, 12288, 16384, 20480, 32768} in float16, bfloat16 and float32, with
gamma and beta (float32 for fluxpy's halves, as its LayerNorm keeps them; the input's dtype for PyTorch, as its
``LayerNorm`` under a half model). Rows:

- ``fwd``: fluxpy ``layernorm_forward`` (y, mean, rstd) against ``F.layer_norm``;
- ``fwd+bwd``: fluxpy's forward, then the ``layernorm_backward`` op (dx, dgamma, dbeta: the kernel of
  ``cuda_layernorm.backward_shape``, one sweep ``ln_bwd1``, ``ln_bwds``, ``ln_bwdr`` or ``ln_bwdc`` or two ``ln_bwd``, then
  ``ln_params``; or the split backward of the long rows, dx alone by ``ln_dx1``/``ln_dx2``, then ``ln_cols`` and
  ``ln_params``; the composite where no kernel takes the rows, as the layer norm's pullback runs it) against
  ``F.layer_norm`` and ``torch.autograd.grad`` of it for x, gamma and beta.
- ``--split``: where ``ln_bwds`` or ``ln_bwdc`` (the column sums in shared memory, of a block or of a cluster of
  blocks) or the two-sweep ``ln_bwd`` runs, the other backwards' times too (``layernorm_plan.SHARED_COLUMNS`` off,
  then also ``SPLIT_FROM`` set to that length), the measurements that decide those switches; where the forward
  stages the next row in shared memory, its time without (``STAGED_FORWARD`` off).

GPU time only: each side's calls are queued behind a ~10 ms spin kernel on the same stream, so host time is
hidden, and CUDA events time ``--reps`` calls (median of ``--rounds``). Bandwidth counts the bytes a kernel must
move: forward reads x and writes y (2 N L s bytes), backward reads x and dy and writes dx (3 N L s); ``copy`` is
``cupy.copyto`` of an array of x's size (its 2 N L s bytes), the practical peak; ``% copy`` = GB/s over copy's
GB/s. Targets (the issue's): forward at least 85% and backward at least 75% of copy bandwidth, and faster than
PyTorch on every case.

Every case is timed in two modes (:data:`MODES`), the copy with the rest, and printed as two tables:

- ``warm``: one set of inputs, read call after call. Where a call's bytes fit the L2 (50 MB on an H100 or H200: the
  short rows, 8192 x 768 halves moving 25 MB forward), the copy and the kernels run largely from the L2, as data
  just written by the op before often arrives. The older tables of docs/history/benchmarks.md are of this mode.
- ``hbm``: each call takes the next of several sets of inputs (x, dy, mean, rstd and the copy's output; PyTorch's
  too), enough to touch at least 4 L2s before a set comes round again (``--sets`` to choose), so every call reads
  device memory: copy bandwidth as a large device-to-device copy measures it, and the kernels against it.

Run: ``PYTHONPATH=. python3 benchmarks/layernorm.py [--lengths 768,4096] [--dtypes bfloat16] [--split]
[--sets 8] [--json out.json]``
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = 8192
LENGTHS = "768,1024,1536,4096,5140,12288,16384,20480,32768"
DTYPES = "float16,bfloat16,float32"
HBM_L2_MULTIPLE = 4   # the "hbm" mode's sets touch at least this many L2s between two reads of one set

_SPIN = r"""
extern "C" __global__ void bench_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


def gpu_us(cp, run, reps, rounds):
    """Median GPU microseconds per call over ``rounds``: ``reps`` calls queued behind a spin kernel, timed by
    events on the current stream."""
    spin = cp.RawKernel(_SPIN, "bench_spin")
    run()
    times = []
    for _ in range(rounds):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        spin((1,), (1,), (np.int64(20_000_000),))   # ~10 ms: 20 calls of host time
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0 / reps)
    return statistics.median(times)


def input_sets(cp, bytes_a_set, sets=None):
    """How many sets of inputs a mode rotates through: 1 for ``warm`` (one set, read again and again: what fits the
    L2 stays there, as data just written by the op before often arrives); for ``hbm``, enough sets to touch at least
    :data:`HBM_L2_MULTIPLE` times the GPU's L2 between two reads of one set, so each call reads from device memory
    (METHOD.md: repeated runs over one buffer measure the cache).

    >>> class D:                      # a stand-in for cupy with a 50 MiB L2
    ...     class cuda:
    ...         class Device:
    ...             attributes = {"L2CacheSize": 50 << 20}
    >>> input_sets(D, 25 << 20), input_sets(D, 1 << 30), input_sets(D, 25 << 20, sets=3)
    (8, 1, 3)
    """
    if sets:
        return sets
    l2 = int(cp.cuda.Device().attributes["L2CacheSize"])
    return max(1, -(-HBM_L2_MULTIPLE * l2 // bytes_a_set))


def rotating(items):
    """A function that returns the next of ``items`` on each call, round and round.

    >>> nxt = rotating("ab"); [nxt() for _ in range(3)]
    ['a', 'b', 'a']
    """
    it = itertools.cycle(items)
    return lambda: next(it)


def case(cp, torch, length, dtype_name, a):
    from fluxpy.kernels import cuda_layernorm as ln
    from fluxpy.kernels import layernorm_plan as lp
    from fluxpy.kernels.halfs import BFLOAT16
    from fluxpy.ops.norm import layernorm_backward
    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "float32": np.dtype(np.float32)}[dtype_name]
    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    rng = np.random.default_rng(0)
    g = cp.asarray(rng.standard_normal(length, dtype=np.float32))
    b = cp.asarray(rng.standard_normal(length, dtype=np.float32))
    tg = torch.from_numpy(cp.asnumpy(g)).cuda().to(tdtype).requires_grad_(True)
    tb = torch.from_numpy(cp.asnumpy(b)).cuda().to(tdtype).requires_grad_(True)
    s = np.dtype(dtype).itemsize
    bytes_fwd, bytes_bwd = 2 * ROWS * length * s, 3 * ROWS * length * s
    n_sets = input_sets(cp, bytes_bwd, a.sets)

    def one_set(seed):
        r = np.random.default_rng(seed)
        x32 = r.standard_normal((ROWS, length), dtype=np.float32) * 2 + 0.5
        dy32 = r.standard_normal((ROWS, length), dtype=np.float32)
        x, dy = cp.asarray(x32).astype(dtype), cp.asarray(dy32).astype(dtype)
        _, mean, rstd = ln.layernorm_forward(x, g, b, 1, 1e-5)
        return dict(x=x, dy=dy, out=cp.empty_like(x), mean=mean, rstd=rstd,
                    tx=torch.from_numpy(x32).cuda().to(tdtype).requires_grad_(True),
                    tdy=torch.from_numpy(dy32).cuda().to(tdtype))

    sets = [one_set(seed) for seed in range(n_sets)]
    first = sets[0]
    y, _, _ = ln.layernorm_forward(first["x"], g, b, 1, 1e-5)
    ty = torch.nn.functional.layer_norm(first["tx"], (length,), tg, tb, 1e-5)
    err = float(np.abs(cp.asnumpy(y.astype(cp.float32)) - ty.detach().float().cpu().numpy()).max())
    plan = ln.backward_shape(length, dtype)
    r = dict(dtype=dtype_name, length=length, rows=ROWS, max_abs_err_vs_torch=err, hbm_sets=n_sets,
             bwd_kernel="composite" if plan is None else f"{plan.kernel} VW{plan.vw} TPR{plan.tpr} RPB{plan.rpb} "
                                                         f"ITEMS{plan.items} PF{int(plan.prefetch)}")
    for mode, mode_sets in (("warm", sets[:1]), ("hbm", sets)):
        r[mode] = measure(cp, torch, ln, layernorm_backward, mode_sets, g, b, tg, tb, length, a)
        m = r[mode]
        copy_gbs = bytes_fwd / m["copy_us"] / 1e3
        m["copy_GBs"] = copy_gbs
        m["fwd_GBs"] = bytes_fwd / m["fluxpy_fwd_us"] / 1e3
        m["bwd_GBs"] = bytes_bwd / m["fluxpy_bwd_us"] / 1e3
        m["fwd_share"], m["bwd_share"] = m["fwd_GBs"] / copy_gbs, m["bwd_GBs"] / copy_gbs
        m["torch_fwd_share"] = bytes_fwd / m["torch_fwd_us"] / 1e3 / copy_gbs
        m["fwd_ratio"] = m["fluxpy_fwd_us"] / m["torch_fwd_us"]
        m["both_ratio"] = m["fluxpy_both_us"] / m["torch_both_us"]
    if a.split:
        split_times(cp, ln, lp, layernorm_backward, first, g, b, plan, length, dtype, bytes_fwd, bytes_bwd, r, a)
    r["fluxpy_us"], r["torch_us"] = r["warm"]["fluxpy_both_us"], r["warm"]["torch_both_us"]   # run.py's summary pair
    w, h = r["warm"], r["hbm"]
    print(f"{dtype_name:9s} L={length:6d}: fwd {w['fluxpy_fwd_us']:7.1f} us ({w['fwd_share']:.0%} of copy; from HBM "
          f"{h['fluxpy_fwd_us']:.1f}, {h['fwd_share']:.0%}) torch {w['torch_fwd_us']:7.1f} ({w['torch_fwd_share']:.0%}); "
          f"bwd {w['fluxpy_bwd_us']:7.1f} us ({w['bwd_share']:.0%}; from HBM {h['fluxpy_bwd_us']:.1f}, "
          f"{h['bwd_share']:.0%}; {r['bwd_kernel']}); fwd+bwd {w['fluxpy_both_us']:7.1f} vs torch "
          f"{w['torch_both_us']:7.1f}; max |y - torch y| {err:.2g}"
          + (f"; other backwards: {r['others']}" if r.get("others") else "")
          + (f"; forward unstaged {r['unstaged_fwd_us']:.1f} us" if "unstaged_fwd_us" in r else ""), flush=True)
    return r


def measure(cp, torch, ln, layernorm_backward, sets, g, b, tg, tb, length, a):
    """GPU microseconds a call of the copy, fluxpy's forward, backward and both, and PyTorch's forward and both, each
    call taking the next of ``sets`` (its own x, dy, mean, rstd and output)."""
    nxt = rotating(sets)

    def copy():
        c = nxt()
        cp.copyto(c["out"], c["x"])

    def fx_fwd():
        ln.layernorm_forward(nxt()["x"], g, b, 1, 1e-5)

    def fx_bwd():
        c = nxt()
        layernorm_backward(c["dy"], c["x"], g, c["mean"], c["rstd"], 1, True)

    def fx_both():
        c = nxt()
        _, mean, rstd = ln.layernorm_forward(c["x"], g, b, 1, 1e-5)
        layernorm_backward(c["dy"], c["x"], g, mean, rstd, 1, True)

    def t_fwd():
        with torch.no_grad():
            torch.nn.functional.layer_norm(nxt()["tx"], (length,), tg, tb, 1e-5)

    def t_both():
        c = nxt()
        yy = torch.nn.functional.layer_norm(c["tx"], (length,), tg, tb, 1e-5)
        torch.autograd.grad(yy, (c["tx"], tg, tb), c["tdy"])

    reps = max(a.reps, len(sets))
    return {name: gpu_us(cp, run, reps, a.rounds) for name, run in
            (("copy_us", copy), ("fluxpy_fwd_us", fx_fwd), ("torch_fwd_us", t_fwd), ("fluxpy_bwd_us", fx_bwd),
             ("fluxpy_both_us", fx_both), ("torch_both_us", t_both))}


def split_times(cp, ln, lp, layernorm_backward, first, g, b, plan, length, dtype, bytes_fwd, bytes_bwd, r, a):
    """``--split``: the other backwards' times (one set of inputs) where ``ln_bwd``, ``ln_bwds``, ``ln_bwdr`` or
    ``ln_bwdc`` runs, and the unstaged forward's where the forward stages rows."""
    x, dy, mean, rstd = first["x"], first["dy"], first["mean"], first["rstd"]

    def fx_bwd():
        layernorm_backward(dy, x, g, mean, rstd, 1, True)

    def fx_fwd():
        ln.layernorm_forward(x, g, b, 1, 1e-5)

    key = np.dtype(dtype).itemsize
    if plan is not None and plan.kernel in ("ln_bwd", "ln_bwds", "ln_bwdr", "ln_bwdc"):
        others = []
        for split_from in (lp.SPLIT_FROM[key], length):
            # no shared columns, and so no ln_bwdc, which runs ln_bwds a block
            with lp.switched(dtype, shared_columns=False, split_from=split_from):
                sp = ln.backward_shape(length, dtype)
                if sp is None or sp.kernel == plan.kernel or any(o[0] == sp.kernel for o in others):
                    continue
                us = gpu_us(cp, fx_bwd, a.reps, a.rounds)
                others.append((sp.kernel, us))
                r[f"{sp.kernel}_bwd_us"] = us
        copy_gbs = r["warm"]["copy_GBs"]
        r["others"] = ", ".join(f"{n} {us:.1f} ({bytes_bwd / us / 1e3 / copy_gbs:.0%})" for n, us in others)
    if lp.forward_plan(length, dtype, False, ln.limits()).stages:
        with lp.switched(dtype, staged_forward=False):   # compiled forwards are cached under the switches
            r["unstaged_fwd_us"] = gpu_us(cp, fx_fwd, a.reps, a.rounds)


MODES = {"warm": "one set of inputs, read again and again (what fits the L2 stays there)",
         "hbm": "inputs rotated through sets of at least 4 L2s, so each call reads device memory"}


def table(rows, gpu, mode):
    """The markdown table of ``rows`` in one mode (``warm`` or ``hbm``, :data:`MODES`)."""
    lines = [f"GPU: {gpu}; {ROWS} rows; GPU time per call (median); copy = cupy.copyto of x's bytes; {mode}: "
             f"{MODES[mode]}", "",
             "| dtype | L | sets | bwd kernel | copy GB/s | fwd us | fwd GB/s | fwd % copy | torch fwd us | torch % copy | "
             "fwd / torch | bwd us | bwd GB/s | bwd % copy | other backwards us (% copy) | fwd+bwd us | torch fwd+bwd us | "
             "fwd+bwd / torch |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r[mode]
        split = r.get("others", "") if mode == "warm" else ""
        lines.append(f"| {r['dtype']} | {r['length']} | {r['hbm_sets'] if mode == 'hbm' else 1} | "
                     f"{r['bwd_kernel'].split()[0]} | {m['copy_GBs']:.0f} | "
                     f"{m['fluxpy_fwd_us']:.1f} | "
                     f"{m['fwd_GBs']:.0f} | {m['fwd_share']:.0%} | {m['torch_fwd_us']:.1f} | "
                     f"{m['torch_fwd_share']:.0%} | {m['fwd_ratio']:.2f} | {m['fluxpy_bwd_us']:.1f} | "
                     f"{m['bwd_GBs']:.0f} | {m['bwd_share']:.0%} | {split} | {m['fluxpy_both_us']:.1f} | "
                     f"{m['torch_both_us']:.1f} | {m['both_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=LENGTHS)
    p.add_argument("--dtypes", default=DTYPES)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sets", type=int, default=None,
                   help="input sets the hbm mode rotates through (default: enough for 4 L2s)")
    p.add_argument("--json", default=None)
    p.add_argument("--split", action="store_true", help="also time the other backwards where ln_bwds, ln_bwdc or ln_bwd runs")
    a = p.parse_args(argv)
    import cupy as cp
    import torch
    import fluxpy  # noqa: F401  (registers the kernels)
    gpu = torch.cuda.get_device_name()
    rows = [case(cp, torch, int(n), d, a) for d in a.dtypes.split(",") for n in a.lengths.split(",")]
    for mode in MODES:
        print("\n" + table(rows, gpu, mode))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
