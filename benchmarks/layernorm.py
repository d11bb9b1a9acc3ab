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
  blocks) or the two-sweep ``ln_bwd`` runs, the other backwards' times too (``cuda_layernorm.SHARED_COLUMNS`` off,
  then also ``SPLIT_FROM`` set to that length), the measurements that decide those switches; where the forward
  stages the next row in shared memory, its time without (``STAGED_FORWARD`` off).

GPU time only: each side's calls are queued behind a ~4 ms spin kernel on the same stream, so host time is
hidden, and CUDA events time ``--reps`` calls (median of ``--rounds``). Bandwidth counts the bytes a kernel must
move: forward reads x and writes y (2 N L s bytes), backward reads x and dy and writes dx (3 N L s); ``copy`` is
``cupy.copyto`` of an array of x's size (its 2 N L s bytes), the practical peak; ``% copy`` = GB/s over copy's
GB/s. Targets (the issue's): forward at least 85% and backward at least 75% of copy bandwidth, and faster than
PyTorch on every case.

Run: ``PYTHONPATH=. python3 benchmarks/layernorm.py [--lengths 768,4096] [--dtypes bfloat16] [--split]
[--json out.json]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = 8192
LENGTHS = "768,1024,1536,4096,5140,12288,16384,20480,32768"
DTYPES = "float16,bfloat16,float32"

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
        spin((1,), (1,), (np.int64(8_000_000),))
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0 / reps)
    return statistics.median(times)


def case(cp, torch, length, dtype_name, a):
    from fluxpy.kernels import cuda_layernorm as ln
    from fluxpy.kernels.halfs import BFLOAT16
    from fluxpy.ops.norm import layernorm_backward
    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "float32": np.dtype(np.float32)}[dtype_name]
    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    rng = np.random.default_rng(0)
    x32 = rng.standard_normal((ROWS, length), dtype=np.float32) * 2 + 0.5
    dy32 = rng.standard_normal((ROWS, length), dtype=np.float32)
    x, dy = cp.asarray(x32).astype(dtype), cp.asarray(dy32).astype(dtype)
    g = cp.asarray(rng.standard_normal(length, dtype=np.float32))
    b = cp.asarray(rng.standard_normal(length, dtype=np.float32))
    tx = torch.from_numpy(x32).cuda().to(tdtype).requires_grad_(True)
    tdy = torch.from_numpy(dy32).cuda().to(tdtype)
    tg = torch.from_numpy(cp.asnumpy(g)).cuda().to(tdtype).requires_grad_(True)
    tb = torch.from_numpy(cp.asnumpy(b)).cuda().to(tdtype).requires_grad_(True)
    out = cp.empty_like(x)
    s = x.itemsize
    bytes_fwd, bytes_bwd = 2 * x.size * s, 3 * x.size * s
    y, mean, rstd = ln.layernorm_forward(x, g, b, 1, 1e-5)
    ty = torch.nn.functional.layer_norm(tx, (length,), tg, tb, 1e-5)
    err = float(np.abs(cp.asnumpy(y.astype(cp.float32)) - ty.detach().float().cpu().numpy()).max())

    def fx_fwd():
        ln.layernorm_forward(x, g, b, 1, 1e-5)

    def fx_both():
        _, m, r = ln.layernorm_forward(x, g, b, 1, 1e-5)
        layernorm_backward(dy, x, g, m, r, 1, True)

    def fx_bwd():
        layernorm_backward(dy, x, g, mean, rstd, 1, True)

    def t_fwd():
        with torch.no_grad():
            torch.nn.functional.layer_norm(tx, (length,), tg, tb, 1e-5)

    def t_both():
        yy = torch.nn.functional.layer_norm(tx, (length,), tg, tb, 1e-5)
        torch.autograd.grad(yy, (tx, tg, tb), tdy)

    plan = ln.backward_shape(length, dtype)
    r = dict(dtype=dtype_name, length=length, rows=ROWS, max_abs_err_vs_torch=err,
             bwd_kernel="composite" if plan is None else f"{plan[0]} VW{plan[1]} TPR{plan[2]} RPB{plan[3]} "
                                                         f"ITEMS{plan[4]} PF{plan[5]}")
    r["copy_us"] = gpu_us(cp, lambda: cp.copyto(out, x), a.reps, a.rounds)
    r["fluxpy_fwd_us"] = gpu_us(cp, fx_fwd, a.reps, a.rounds)
    r["torch_fwd_us"] = gpu_us(cp, t_fwd, a.reps, a.rounds)
    r["fluxpy_bwd_us"] = gpu_us(cp, fx_bwd, a.reps, a.rounds)
    if a.split and plan is not None and plan[0] in ("ln_bwd", "ln_bwds", "ln_bwdr", "ln_bwdc"):
        key = np.dtype(dtype).itemsize
        old = ln.SPLIT_FROM[key], ln.SHARED_COLUMNS[key]
        others = []
        try:
            ln.SHARED_COLUMNS[key] = False      # and so ln_bwdc, which runs ln_bwds a block
            for split_from in (old[0], length):
                ln.SPLIT_FROM[key] = split_from
                sp = ln.backward_shape(length, dtype)
                if sp is None or sp[0] == plan[0] or any(o[0] == sp[0] for o in others):
                    continue
                us = gpu_us(cp, fx_bwd, a.reps, a.rounds)
                others.append((sp[0], us))
                r[f"{sp[0]}_bwd_us"] = us
        finally:
            ln.SPLIT_FROM[key], ln.SHARED_COLUMNS[key] = old
        copy_gbs_ = bytes_fwd / r["copy_us"] / 1e3
        r["others"] = ", ".join(f"{n} {us:.1f} ({bytes_bwd / us / 1e3 / copy_gbs_:.0%})" for n, us in others)
    if a.split and ln._forward_stages(length, dtype):
        key = np.dtype(dtype).itemsize
        ln.STAGED_FORWARD[key] = False
        ln._forward.clear()   # the compiled forwards, cached with their forms
        try:
            r["unstaged_fwd_us"] = gpu_us(cp, fx_fwd, a.reps, a.rounds)
        finally:
            ln.STAGED_FORWARD[key] = True
            ln._forward.clear()
    r["fluxpy_both_us"] = gpu_us(cp, fx_both, a.reps, a.rounds)
    r["torch_both_us"] = gpu_us(cp, t_both, a.reps, a.rounds)
    copy_gbs = bytes_fwd / r["copy_us"] / 1e3
    r["copy_GBs"] = copy_gbs
    r["fwd_GBs"] = bytes_fwd / r["fluxpy_fwd_us"] / 1e3
    r["bwd_GBs"] = bytes_bwd / r["fluxpy_bwd_us"] / 1e3
    r["fwd_share"], r["bwd_share"] = r["fwd_GBs"] / copy_gbs, r["bwd_GBs"] / copy_gbs
    r["torch_fwd_share"] = bytes_fwd / r["torch_fwd_us"] / 1e3 / copy_gbs
    r["fwd_ratio"] = r["fluxpy_fwd_us"] / r["torch_fwd_us"]
    r["both_ratio"] = r["fluxpy_both_us"] / r["torch_both_us"]
    r["fluxpy_us"], r["torch_us"] = r["fluxpy_both_us"], r["torch_both_us"]   # run.py's summary pair
    print(f"{dtype_name:9s} L={length:6d}: fwd {r['fluxpy_fwd_us']:7.1f} us ({r['fwd_share']:.0%} of copy) torch "
          f"{r['torch_fwd_us']:7.1f} ({r['torch_fwd_share']:.0%}); bwd {r['fluxpy_bwd_us']:7.1f} us "
          f"({r['bwd_share']:.0%}, {r['bwd_kernel']}); fwd+bwd {r['fluxpy_both_us']:7.1f} vs torch {r['torch_both_us']:7.1f}; "
          f"max |y - torch y| {err:.2g}"
          + (f"; other backwards: {r['others']}" if r.get("others") else "")
          + (f"; forward unstaged {r['unstaged_fwd_us']:.1f} us" if "unstaged_fwd_us" in r else ""), flush=True)
    return r


def table(rows, gpu):
    lines = [f"GPU: {gpu}; {ROWS} rows; GPU time per call (median); copy = cupy.copyto of x's bytes", "",
             "| dtype | L | bwd kernel | copy GB/s | fwd us | fwd GB/s | fwd % copy | torch fwd us | torch % copy | "
             "fwd / torch | bwd us | bwd GB/s | bwd % copy | other backwards us (% copy) | fwd+bwd us | torch fwd+bwd us | "
             "fwd+bwd / torch |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        split = r.get("others", "")
        lines.append(f"| {r['dtype']} | {r['length']} | {r['bwd_kernel'].split()[0]} | {r['copy_GBs']:.0f} | "
                     f"{r['fluxpy_fwd_us']:.1f} | "
                     f"{r['fwd_GBs']:.0f} | {r['fwd_share']:.0%} | {r['torch_fwd_us']:.1f} | "
                     f"{r['torch_fwd_share']:.0%} | {r['fwd_ratio']:.2f} | {r['fluxpy_bwd_us']:.1f} | "
                     f"{r['bwd_GBs']:.0f} | {r['bwd_share']:.0%} | {split} | {r['fluxpy_both_us']:.1f} | "
                     f"{r['torch_both_us']:.1f} | {r['both_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=LENGTHS)
    p.add_argument("--dtypes", default=DTYPES)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--split", action="store_true", help="also time the other backwards where ln_bwds, ln_bwdc or ln_bwd runs")
    a = p.parse_args(argv)
    import cupy as cp
    import torch
    import fluxpy  # noqa: F401  (registers the kernels)
    gpu = torch.cuda.get_device_name()
    rows = [case(cp, torch, int(n), d, a) for d in a.dtypes.split(",") for n in a.lengths.split(",")]
    print("\n" + table(rows, gpu))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
