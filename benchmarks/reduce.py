"""Sum over axes on the GPU: fluxpy's mapreducedim kernel against ``torch.sum`` and ``cupy.sum``.

Same GPU, same run, same input buffers (torch reads the CuPy arrays through DLPack), float32.

Timing: each call between two CUDA events, with the launches queued behind a spin kernel so that
the events measure GPU time, not Python's launch cost; median of many calls after warm-up. Inputs
rotate over enough distinct buffers (views into one pool, >= 3x the L2 size in all) that no call
finds its input in L2. ``wall us`` is the other view: back-to-back calls timed on the host clock
(includes the Python launch cost of each library, which bounds small cases).

GB/s = bytes read / time. ``% copy`` compares with a device-to-device copy of a 1 GB array
(``cudaMemcpyAsync``, counting bytes read + written) measured in the same run.

Run: ``PYTHONPATH=. python3 benchmarks/reduce.py [--quick] [--sweep] [--json out.json]``
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import time

import numpy as np

CASES = [  # (shape, axes)
    ((128, 16, 28, 28), (0, 2, 3)),
    ((128, 32, 14, 14), (0, 2, 3)),
    ((256, 64, 56, 56), (0, 2, 3)),
    ((512, 64, 56, 56), (0, 2, 3)),
    ((64, 16, 14, 14), (0, 2, 3)),
    ((128, 10), (0,)),
    ((8192, 4096), (0,)),
    ((65536, 1024), (0,)),
    ((16384, 4096), (0,)),
    ((4096, 8192), (1,)),
    ((1 << 26,), (0,)),
]

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


class Bench:
    def __init__(self, cp, quick):
        self.cp = cp
        self.quick = quick
        self.spin = cp.RawKernel(_SPIN, "spin")
        props = cp.cuda.runtime.getDeviceProperties(0)
        self.l2 = props.get("l2CacheSize", 50 << 20)
        self.clock_khz = props.get("clockRate", 1_980_000) or 1_980_000

    def gpu_us(self, fn, bufs, calls, batch=25, warm=10):
        """Median GPU time per call (us): launches queued behind a spin kernel, one event pair each."""
        cp = self.cp
        for i in range(warm):
            fn(bufs[i % len(bufs)])
        cp.cuda.Device().synchronize()
        ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(batch)]
        times, i = [], warm
        while len(times) < calls:
            self.spin((1,), (1,), (np.int64(2 * self.clock_khz),))  # about 2 ms of spinning
            for s, e in ev:
                s.record()
                fn(bufs[i % len(bufs)])
                e.record()
                i += 1
            ev[-1][1].synchronize()
            times += [cp.cuda.get_elapsed_time(s, e) * 1000.0 for s, e in ev]
        return statistics.median(times), times

    def wall_us(self, fn, bufs, calls):
        cp = self.cp
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for i in range(calls):
            fn(bufs[i % len(bufs)])
        cp.cuda.Device().synchronize()
        return (time.perf_counter() - t) / calls * 1e6

    def buffers(self, shape, dtype=np.float32):
        """Distinct input arrays of ``shape`` (views into one pool) covering >= 3x L2 in all."""
        cp = self.cp
        n = math.prod(shape)
        nbytes = n * np.dtype(dtype).itemsize
        nbuf = max(1, min(20000, math.ceil(3 * self.l2 / nbytes)))
        stride = (n + 63) // 64 * 64          # 256-byte aligned views
        pool = cp.random.standard_normal(stride * nbuf, dtype=dtype)
        return [pool[i * stride:i * stride + n].reshape(shape) for i in range(nbuf)], pool

    def copy_gbs(self, nbytes=1 << 30):
        cp = self.cp
        src = cp.random.standard_normal(nbytes // 4, dtype=np.float32)
        dst = cp.empty_like(src)
        fn = lambda s: dst.data.copy_from_device_async(s.data, nbytes)  # noqa: E731
        us, _ = self.gpu_us(fn, [src], 20, batch=5, warm=3)
        fn2 = lambda s: cp.copyto(dst, s)  # noqa: E731
        us2, _ = self.gpu_us(fn2, [src], 20, batch=5, warm=3)
        del src, dst
        return 2 * nbytes / us / 1e3, 2 * nbytes / us2 / 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write all numbers to this file")
    ap.add_argument("--quick", action="store_true", help="fewer calls per case")
    ap.add_argument("--sweep", action="store_true", help="also time fluxpy over launch-parameter settings")
    ap.add_argument("--cases", default="", help="comma-separated case indices (default: all)")
    args = ap.parse_args(argv)

    import cupy as cp
    import torch

    from fluxpy.kernels import reduce as R

    b = Bench(cp, args.quick)
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    copy_gbs, copyto_gbs = b.copy_gbs()
    info = dict(gpu=name, date=datetime.date.today().isoformat(), cupy=cp.__version__, torch=torch.__version__,
                numpy=np.__version__, sm_count=R._sm_count(0), l2_bytes=b.l2, copy_gbs=copy_gbs,
                copyto_gbs=copyto_gbs, blocks_per_sm=R.BLOCKS_PER_SM, min_block_bytes=R.MIN_BLOCK_BYTES)
    print(f"# {name}, {info['date']}: copy {copy_gbs:.0f} GB/s (memcpy D2D), {copyto_gbs:.0f} GB/s (cupy.copyto); "
          f"{info['sm_count']} SMs, L2 {b.l2 >> 20} MB; cupy {cp.__version__}, torch {torch.__version__}", flush=True)

    host = host_costs(cp, torch, R, b)
    info["host_us_per_call"] = host
    print("# host us per call:", {k: round(v, 2) for k, v in host.items()}, flush=True)

    cases = CASES if not args.cases else [CASES[int(i)] for i in args.cases.split(",")]
    rows = [measure_case(cp, torch, R, b, shape, axes, info, args) for shape, axes in cases]
    print_table(rows, name, info["date"], copy_gbs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)


def host_costs(cp, torch, R, b):
    """Host us per call, back to back on a tiny input: where Python's launch cost puts the floor."""
    xs = cp.random.standard_normal((64, 16, 14, 14), dtype=np.float32)
    ts = torch.from_dlpack(xs)

    def per_call(f, n=3000):
        f()
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(n):
            f()
        dt = time.perf_counter() - t
        cp.cuda.Device().synchronize()
        return dt / n * 1e6
    return dict(mapreduce=per_call(lambda: R.mapreduce(xs, (0, 2, 3))),
                bare_rawkernel_launch=per_call(lambda: b.spin((1,), (1,), (np.int64(0),))),
                cupy_empty=per_call(lambda: cp.empty((16,), dtype=np.float32)),
                torch_sum=per_call(lambda: torch.sum(ts, dim=(0, 2, 3))))


def measure_case(cp, torch, R, b, shape, axes, info, args):
    """One table row: fluxpy, torch and cupy on one (shape, axes), after a float64 correctness check."""
    bufs, pool = b.buffers(shape)
    tbufs = [torch.from_dlpack(x) for x in bufs]
    nbytes = math.prod(shape) * 4
    calls = (100 if args.quick else 400) if nbytes < (64 << 20) else (25 if args.quick else 75)
    f_fx = lambda x: R.mapreduce(x, axes, "sum")  # noqa: E731
    f_cp = lambda x: cp.sum(x, axis=axes)  # noqa: E731
    f_th = lambda t: torch.sum(t, dim=axes)  # noqa: E731
    # correctness against float64 first
    ref = torch.sum(tbufs[0].double(), dim=axes)
    got = torch.from_dlpack(f_fx(bufs[0])).double()
    relerr = float((got - ref).norm() / ref.norm())
    assert relerr < 1e-5, f"{shape} over {axes}: relative error {relerr}"
    p = R.plan(shape, axes, np.float32, sm_count=info["sm_count"])
    fx, fx_all = b.gpu_us(f_fx, bufs, calls)
    th, _ = b.gpu_us(f_th, tbufs, calls)
    cu, _ = b.gpu_us(f_cp, bufs, max(10, calls // 4))
    wall_calls = max(20, calls // 2)
    copy_gbs = info["copy_gbs"]
    row = dict(shape=list(shape), axes=list(axes), mb=nbytes / 1e6, fluxpy_us=fx, torch_us=th, cupy_us=cu,
               fluxpy_gbs=nbytes / fx / 1e3, torch_gbs=nbytes / th / 1e3, cupy_gbs=nbytes / cu / 1e3,
               ratio=fx / th, pct_copy=100 * (nbytes / fx / 1e3) / copy_gbs,
               fluxpy_wall_us=b.wall_us(f_fx, bufs, wall_calls), torch_wall_us=b.wall_us(f_th, tbufs, wall_calls),
               fluxpy_p10_us=float(np.percentile(fx_all, 10)), fluxpy_p90_us=float(np.percentile(fx_all, 90)),
               relerr=relerr, nbuf=len(bufs), plan={k: v for k, v in p.items() if k != "transpose"})
    if args.sweep:
        row["sweep_us"] = sweep_launch_settings(R, b, f_fx, bufs, calls)
        print("  sweep", shape, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row["sweep_us"].items()},
              flush=True)
    print(f"  {shape} over {axes}: fluxpy {fx:.1f} us, torch {th:.1f} us, cupy {cu:.1f} us, "
          f"wall {row['fluxpy_wall_us']:.1f}/{row['torch_wall_us']:.1f} us, plan {row['plan']}", flush=True)
    del bufs, tbufs, pool
    cp.get_default_memory_pool().free_all_blocks()
    return row


def sweep_launch_settings(R, b, f_fx, bufs, calls):
    """fluxpy's GPU time over BLOCKS_PER_SM settings; the module's defaults restored after."""
    sweep = {}
    base = (R.BLOCKS_PER_SM, R.MIN_BLOCK_BYTES)
    for bps in (3, 4, 5, 6):
        R.BLOCKS_PER_SM = bps
        R._calls.clear()
        try:
            sweep[f"bps{bps}"] = b.gpu_us(f_fx, bufs, max(25, calls // 4))[0]
        except Exception as err:  # a setting that fails is reported, not fatal
            sweep[f"bps{bps}"] = repr(err)[:200]
    R.BLOCKS_PER_SM, R.MIN_BLOCK_BYTES = base
    R._calls.clear()
    return sweep


def print_table(rows, name, date, copy_gbs):
    print()
    print(f"GPU: {name}, {date}; copy bandwidth {copy_gbs:.0f} GB/s (read+write, 1 GB D2D memcpy); "
          f"float32; GPU time per call, median")
    print()
    print("| shape | axes | MB | fluxpy us | torch us | cupy us | fluxpy GB/s | fluxpy/torch | % copy BW "
          "| wall us fluxpy/torch |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {tuple(r['shape'])} | {tuple(r['axes'])} | {r['mb']:.2f} | {r['fluxpy_us']:.1f} | "
              f"{r['torch_us']:.1f} | {r['cupy_us']:.1f} | {r['fluxpy_gbs']:.0f} | {r['ratio']:.2f} | "
              f"{r['pct_copy']:.0f}% | {r['fluxpy_wall_us']:.1f} / {r['torch_wall_us']:.1f} |")


if __name__ == "__main__":
    main()
