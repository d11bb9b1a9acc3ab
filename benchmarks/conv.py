"""fluxpy's cuDNN convolutions against PyTorch's, on the same GPU in the same run.

Rows per layer (float32, cross-correlation as PyTorch, TF32 off on both sides):

- ``fwd``: fluxpy ``conv_bias_act(x, w, b, relu, flipped=True)`` (one execute of a cached cuDNN graph
  conv -> bias add -> relu; ``fwd_kernel``: the legacy cudnnConvolutionBiasActivationForward,
  :func:`fluxpy.kernels.cudnn.legacy.conv_bias_act_forward`) vs
  ``relu(conv2d(x, w, b))``;
- ``bwd_data`` / ``bwd_filter``: fluxpy ``conv_backward_data`` / ``conv_backward_filter`` (the public ops)
  vs ``torch.ops.aten.convolution_backward`` with output_mask (True, False, False) / (False, True, False);
- ``bias_mr``: the relu backward and bias gradient ``(dz, db)`` by fluxpy's mapreduce (one pass,
  :func:`fluxpy.kernels.cuda_conv.conv_bias_act_backward`), vs ``threshold_backward`` + ``sum((0, 2, 3))``.

``--dtype float16,bfloat16`` (default ``float32``) runs the same rows in those dtypes against PyTorch in the same
dtype, both channels-first (NCHW) or both channels-last (``--memory channels_last``), on the ResNet layers (``--dtype`` with float32 keeps the MNIST rows); fluxpy
computes the halves in float32 on tensor cores (cuDNN's fused graph where an engine finalizes); the bias row sums in
float32 (the same mapreduce pass) against ``threshold_backward`` + ``sum``. The
issue's targets: fwd at most 0.8x, bwd_data and bwd_filter at most 1.0x.

Timing: CUDA events around ``iters`` back-to-back calls (host overhead included, as in a
training step), after warm-up (which also runs cuDNN's algorithm search on both sides), median of
``reps``. ``python benchmarks/conv.py [--quick] [--dtype float16,bfloat16] [--json out.json]``; prints a markdown
table per dtype.

``--layers resnet50``: every distinct convolution of ResNet-50 at batch 256 (``--quick``: the strided ones), rows
fwd / bwd_data / bwd_filter, each with the cuDNN configuration fluxpy chose (engine and knobs), where it came from
(the heuristics' rank, the engine search, or the knob change that won: ``... + SPLIT_K_SLC=4``) and the gain of
the search over the heuristics' best (issue 14, item 3: bwd_filter geometric mean at most 0.9x, bwd_data at most
0.95x, no layer above 1.02x). ``--search-ms 0`` turns fluxpy's search past the heuristics off (for comparison).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import numpy as np


MNIST = [("mnist1", 128, 1, 28, 16, 3, 1, 1), ("mnist2", 128, 16, 14, 32, 3, 1, 1), ("mnist3", 128, 32, 7, 32, 3, 1, 1)]
RESNET = [  # name, C, H, K, R, stride, pad
    ("r50 64>64 3x3 56", 64, 56, 64, 3, 1, 1),
    ("r50 128>128 3x3 s2 56", 128, 56, 128, 3, 2, 1),
    ("r50 256>64 1x1 56", 256, 56, 64, 1, 1, 0),
    ("r50 64>256 1x1 56", 64, 56, 256, 1, 1, 0),
    ("r50 256>256 3x3 14", 256, 14, 256, 3, 1, 1),
    ("r50 512>512 3x3 7", 512, 7, 512, 3, 1, 1),
    ("r50 1024>256 1x1 s2 14", 1024, 14, 256, 1, 2, 0),
]


# Every distinct convolution of torchvision's ResNet-50 (v1.5: the stride on the 3x3) at 224x224: name, C, H (input),
# K, R, stride, pad. The strided ones (s2) are where TVM measured cuDNN's strided dgrad winning.
RESNET50 = [
    ("conv1 3>64 7x7 s2 224", 3, 224, 64, 7, 2, 3),
    ("l1 64>64 1x1 56", 64, 56, 64, 1, 1, 0),
    ("l1 64>64 3x3 56", 64, 56, 64, 3, 1, 1),
    ("l1 64>256 1x1 56", 64, 56, 256, 1, 1, 0),
    ("l1 256>64 1x1 56", 256, 56, 64, 1, 1, 0),
    ("l2 256>128 1x1 56", 256, 56, 128, 1, 1, 0),
    ("l2 128>128 3x3 s2 56", 128, 56, 128, 3, 2, 1),
    ("l2 128>512 1x1 28", 128, 28, 512, 1, 1, 0),
    ("l2 down 256>512 1x1 s2 56", 256, 56, 512, 1, 2, 0),
    ("l2 512>128 1x1 28", 512, 28, 128, 1, 1, 0),
    ("l2 128>128 3x3 28", 128, 28, 128, 3, 1, 1),
    ("l3 512>256 1x1 28", 512, 28, 256, 1, 1, 0),
    ("l3 256>256 3x3 s2 28", 256, 28, 256, 3, 2, 1),
    ("l3 256>1024 1x1 14", 256, 14, 1024, 1, 1, 0),
    ("l3 down 512>1024 1x1 s2 28", 512, 28, 1024, 1, 2, 0),
    ("l3 1024>256 1x1 14", 1024, 14, 256, 1, 1, 0),
    ("l3 256>256 3x3 14", 256, 14, 256, 3, 1, 1),
    ("l4 1024>512 1x1 14", 1024, 14, 512, 1, 1, 0),
    ("l4 512>512 3x3 s2 14", 512, 14, 512, 3, 2, 1),
    ("l4 512>2048 1x1 7", 512, 7, 2048, 1, 1, 0),
    ("l4 down 1024>2048 1x1 s2 14", 1024, 14, 2048, 1, 2, 0),
    ("l4 2048>512 1x1 7", 2048, 7, 512, 1, 1, 0),
    ("l4 512>512 3x3 7", 512, 7, 512, 3, 1, 1),
]


def layers(quick, with_mnist=True, layer_set="default"):
    if layer_set == "resnet50":
        return [(f"{name} N256", 256, c, h, k, r, s, p) for name, c, h, k, r, s, p in RESNET50
                if not quick or " s2 " in f"{name} "]
    out = list(MNIST) if with_mnist else []
    for n in (8, 256):
        for name, c, h, k, r, s, p in RESNET:
            if quick and n == 256 and name not in ("r50 64>64 3x3 56", "r50 256>64 1x1 56", "r50 512>512 3x3 7"):
                continue
            out.append((f"{name} N{n}", n, c, h, k, r, s, p))
    return out


def timer(cp, fn, budget_s=0.25, reps=9, warm=3):
    """Median microseconds per call of ``fn``: events around ``iters`` calls, ``reps`` times."""
    for _ in range(warm):
        fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    fn()
    cp.cuda.Device().synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    iters = int(max(1, min(100, budget_s / reps / one)))
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / iters)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="host/GPU time of each piece of the call path")
    ap.add_argument("--budget", type=float, default=0.25, help="seconds of timing per row and side")
    ap.add_argument("--dtype", default="float32", help="comma-separated: float32, float16, bfloat16")
    ap.add_argument("--memory", default="contiguous", choices=("contiguous", "channels_last"),
                    help="the memory format of x, w and dy on both sides")
    ap.add_argument("--layers", default="default", choices=("default", "resnet50"),
                    help="default: MNIST and ResNet layers at batch 8 and 256; resnet50: every distinct convolution "
                         "of ResNet-50 at batch 256 (with --quick: the strided ones)")
    ap.add_argument("--search-ms", type=float, default=None,
                    help="fluxpy's search budget per problem past cuDNN's heuristics (default: the library's; 0: off)")
    args = ap.parse_args(argv)
    import ml_dtypes
    DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        ap.error(f"--dtype takes {', '.join(DTYPES)}, got {', '.join(unknown)}")

    import cupy as cp
    import torch
    import torch.nn.functional as F

    import fluxpy
    from fluxpy.kernels import cuda_conv, cudnn, gpu
    from fluxpy.layout import to_channels_last
    from fluxpy.ops.conv import conv_backward_data, conv_backward_filter, conv_bias_act
    from fluxpy.ops.dims import ConvDims

    gpu.register()   # fluxpy's default: cuDNN's graph API with cached plans (fwd_kernel: the legacy fused call)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    fluxpy.options.set(allow_tf32=False)
    if args.search_ms is not None:
        fluxpy.options.set(search_budget_ms=args.search_ms)
    relu = fluxpy.relu
    gpu = torch.cuda.get_device_name()
    print(f"# conv benchmark: {gpu}, cuDNN {cudnn.version()} (fluxpy) / {torch.backends.cudnn.version()} (torch), "
          f"torch {torch.__version__}, cupy {cp.__version__}, {datetime.date.today()}; fluxpy search budget "
          f"{fluxpy.options.search_budget_ms:g} ms per problem, graph choices file {cudnn.graph.cache_file()}", flush=True)

    if args.profile:
        profile(cp, torch, F, cudnn, cuda_conv, conv_bias_act, relu)
    rows = []
    for name in dtypes:
        rows += run_dtype(args, name, cp, torch, F, cudnn, cuda_conv, conv_bias_act, conv_backward_data,
                          conv_backward_filter, ConvDims, relu, gpu, to_channels_last)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, date=str(datetime.date.today()), rows=rows, plans=cudnn.graph.plan_info()), f,
                      indent=1, default=str)
    return 0



DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": None}   # bfloat16: ml_dtypes', set in main


def to_torch(torch, a):
    """A CuPy array as a torch tensor on the same memory (the halves through their bits: DLPack of bfloat16 is not
    everywhere)."""
    if a.dtype == np.float32:
        return torch.from_dlpack(a)
    bits = torch.from_dlpack(a.view(np.uint16))
    return bits.view(torch.float16 if a.dtype == np.float16 else torch.bfloat16)


def from_torch(cp, t):
    """A torch tensor as a float32 CuPy array."""
    return cp.from_dlpack(t.float().contiguous())


def as_f32(cp, a):
    """A CuPy array of float32, float16 or bfloat16 as float32."""
    from fluxpy.kernels.cudnn.legacy import half_to_float32
    return a if a.dtype == np.float32 else half_to_float32(a)


def run_dtype(args, dtype_name, cp, torch, F, cudnn, cuda_conv, conv_bias_act, conv_backward_data,
              conv_backward_filter, ConvDims, relu, gpu, to_channels_last):
    """The rows and the table of one dtype (see the module docstring)."""
    from fluxpy import options
    rows = []
    rng = np.random.default_rng(0)
    dtype, half = DTYPES[dtype_name], dtype_name != "float32"
    bias_rows = args.layers == "default"
    for name, n, c, h, k, r, s, p in layers(args.quick, with_mnist=not half, layer_set=args.layers):
        x = cp.asarray(rng.standard_normal((n, c, h, h), dtype=np.float32).astype(dtype))
        w = cp.asarray((rng.standard_normal((k, c, r, r), dtype=np.float32) / np.sqrt(c * r * r)).astype(dtype))
        b = cp.asarray((rng.standard_normal(k, dtype=np.float32) * 0.1).astype(dtype))
        cd = ConvDims.from_shapes(x.shape, w.shape, stride=s, pad=p, flipped=True)
        dy = cp.asarray(rng.standard_normal(cd.y_shape, dtype=np.float32).astype(dtype))
        tx, tw, tb, tdy = (to_torch(torch, a) for a in (x, w, b, dy))
        if args.memory == "channels_last":   # both sides in NHWC memory (filters KRSC), shapes unchanged
            tx, tw, tdy = (t.contiguous(memory_format=torch.channels_last) for t in (tx, tw, tdy))
            x, w, dy = (to_channels_last(a) for a in (x, w, dy))
        y = conv_bias_act(x, w, b, relu, stride=s, pad=p, flipped=True)
        ty = F.relu(F.conv2d(tx, tw, tb, stride=s, padding=p))
        err = float(cp.abs(as_f32(cp, y) - from_torch(cp, ty)).max() / (cp.abs(from_torch(cp, ty)).max() + 1e-30))
        cd_sym = cd

        def bwd(mask):
            return lambda: torch.ops.aten.convolution_backward(tdy, tx, tw, None, [s, s], [p, p], [1, 1], False,
                                                               [0, 0], 1, mask)

        def fx_bias():
            cuda_conv.conv_bias_act_backward(dy, y, "relu", cd_sym, True)

        def t_bias():
            dz = torch.ops.aten.threshold_backward(tdy, ty, 0)
            return dz.sum((0, 2, 3))

        pairs = {
            "fwd": (lambda: conv_bias_act(x, w, b, relu, stride=s, pad=p, flipped=True),
                    lambda: F.relu(F.conv2d(tx, tw, tb, stride=s, padding=p))),
            "fwd_kernel": (lambda: cudnn.legacy.conv_bias_act_forward(x, w, b, "relu", cd), None),
            "bwd_data": (lambda: conv_backward_data(dy, w, cd), bwd((True, False, False))),
            "bwd_filter": (lambda: conv_backward_filter(x, dy, cd), bwd((False, True, False))),
            "bias_mr": (fx_bias, t_bias),
        }
        # correctness of the backward rows against torch, once
        dx_err = float(cp.abs(as_f32(cp, conv_backward_data(dy, w, cd)) -
                              from_torch(cp, bwd((True, False, False))()[0])).max())
        dw_err = float(cp.abs(as_f32(cp, conv_backward_filter(x, dy, cd)) -
                              from_torch(cp, bwd((False, True, False))()[1])).max())
        if not bias_rows:
            pairs = {k: v for k, v in pairs.items() if k in ("fwd", "bwd_data", "bwd_filter")}
        chosen = _chosen(cudnn, x.shape, w.shape, s, x.dtype)
        for row, (fx, tt) in pairs.items():
            f_us = timer(cp, fx, args.budget)
            t_us = timer(cp, tt, args.budget) if tt is not None else None
            rows.append(dict(layer=name, row=row, fluxpy_us=f_us, torch_us=t_us,
                             ratio=(f_us / t_us) if t_us else None, **chosen.get(row, {})))
            print(f"{name:28s} {row:11s} fluxpy {f_us:9.1f} us  torch "
                  f"{(f'{t_us:9.1f}' if t_us else '      -  ')} us  ratio {(f'{f_us / t_us:5.2f}' if t_us else '  -  ')}",
                  flush=True)
        print(f"{name:28s} max rel err fwd {err:.1e}, max abs err dx {dx_err:.1e} dw {dw_err:.1e}", flush=True)
        for row, how in chosen.items():
            print(f"{name:28s} {row:11s} {how['config']} from {how['source']}; search gain "
                  f"{how['gain']:.3f}x over the heuristics' best", flush=True)
        del x, w, b, dy, tx, tw, tb, tdy, y, ty
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()

    print()
    print(f"GPU: {gpu}; date {datetime.date.today()}; {dtype_name}, {args.memory}, TF32 off both sides; medians of CUDA-event "
          f"timings (us per call, host overhead included); ratio = fluxpy / torch")
    print()
    by = {}
    for r in rows:
        by.setdefault(r["layer"], {})[r["row"]] = r
    if bias_rows:
        _table(by)
    else:
        _choice_table(by)
    geo = {row: float(np.exp(np.mean([np.log(d[row]["ratio"]) for d in by.values()])))
           for row in ("fwd", "bwd_data", "bwd_filter", "bias_mr") if row in next(iter(by.values()))}
    worst = {row: max(d[row]["ratio"] for d in by.values()) for row in geo}
    print()
    print("geometric-mean ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in geo.items()))
    print("largest ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))
    print(f"cudnn stats: legacy {cudnn.stats()}, graph {cudnn.graph.stats()}")
    spent = [i["choose_s"] for i in cudnn.graph.plan_info()]
    print(f"fluxpy spent {sum(spent):.1f} s choosing {len(spent)} graph plans (at most {max(spent, default=0):.2f} s "
          f"on one; search budget {options.search_budget_ms:g} ms per problem)")
    if half:
        reasons = {k: v for k, v in cudnn.graph.fallback_reasons().items() if dtype_name in k}
        print(f"{dtype_name} problems on the legacy path: {len(reasons)}" +
              "".join(f"\n  {k}: {v}" for k, v in list(reasons.items())[:8]))
    for r in rows:
        r["dtype"], r["memory"] = dtype_name, args.memory
    return rows


def _chosen(cudnn, x_shape, w_shape, stride, dtype):
    """Per row (fwd, bwd_data, bwd_filter): the graph configuration fluxpy runs for this layer, where it came from
    and the search's gain (the heuristics' best time / the chosen one's), from ``graph.plan_info()``."""
    out = {}
    rows = {"fwd_relu": "fwd", "bwd_data": "bwd_data", "bwd_filter": "bwd_filter"}
    for info in cudnn.graph.plan_info():
        row = rows.get(info["kind"])
        if row is None or tuple(info["w"]) != tuple(w_shape) or tuple(info["stride"]) != (stride, stride):
            continue
        if info["x"][0] != x_shape[0] or info["x"][1] != x_shape[1] or info["dtype"] != str(dtype):
            continue
        gain = info["heuristics_ms"] / info["ms"] if info["ms"] not in (0, float("inf")) else float("nan")
        out[row] = {"config": info["config"], "source": info["source"], "gain": gain}
    return out


def _table(by):
    print("| layer | fwd fluxpy | fwd torch | ratio | bwd_data fluxpy | torch | ratio | bwd_filter fluxpy | torch | ratio "
          "| bias mapreduce | torch relu'+sum |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layer, d in by.items():
        def cell(row, key="fluxpy_us"):
            v = d[row][key]
            return "-" if v is None else f"{v:.1f}"

        def ratio(row):
            v = d[row]["ratio"]
            return "-" if v is None else f"{v:.2f}"
        print(f"| {layer} | {cell('fwd')} | {cell('fwd', 'torch_us')} | {ratio('fwd')} | {cell('bwd_data')} | "
              f"{cell('bwd_data', 'torch_us')} | {ratio('bwd_data')} | {cell('bwd_filter')} | "
              f"{cell('bwd_filter', 'torch_us')} | {ratio('bwd_filter')} | {cell('bias_mr')} | "
              f"{cell('bias_mr', 'torch_us')} |")


def _choice_table(by):
    """One line per layer and row: the times, the ratio, the configuration chosen and where it came from."""
    print("| layer | row | fluxpy us | torch us | ratio | configuration | from | gain over heuristics |")
    print("|---|---|---|---|---|---|---|---|")
    for layer, d in by.items():
        for row in ("fwd", "bwd_data", "bwd_filter"):
            r = d[row]
            how = (f"{r['config']} | {r['source']} | {r['gain']:.3f}" if "config" in r else
                   "legacy call | legacy path | -")
            print(f"| {layer} | {row} | {r['fluxpy_us']:.1f} | {r['torch_us']:.1f} | {r['ratio']:.2f} | {how} |")


def profile(cp, torch, F, cudnn, cuda_conv, conv_bias_act, relu):
    """Host (cpu) and device (gpu) microseconds per call of each piece, by cupyx.profiler.benchmark."""
    import ctypes

    from cupyx.profiler import benchmark

    from fluxpy.ops.dims import ConvDims
    rng = np.random.default_rng(1)
    for (n, c, h, k) in ((128, 16, 14, 14 * 0 + 32), (128, 1, 28, 16)):
        x = cp.asarray(rng.standard_normal((n, c, h, h), dtype=np.float32))
        w = cp.asarray(rng.standard_normal((k, c, 3, 3), dtype=np.float32))
        b = cp.asarray(rng.standard_normal(k, dtype=np.float32))
        cd = ConvDims.from_arrays(x, w, pad=1, flipped=True)
        dy = cp.asarray(rng.standard_normal(cd.y_shape, dtype=np.float32))
        legacy = cudnn.legacy
        y = legacy.conv_bias_act_forward(x, w, b, "relu", cd)
        legacy.conv_backward_data(dy, w, cd)
        legacy.conv_backward_filter(x, dy, cd)
        p = cudnn.plan(cd, x.dtype)
        hd = cudnn.handle.get_handle()
        fn = cudnn.library.fn
        one, zero = ctypes.addressof(p.one), ctypes.addressof(p.zero)
        (fa, fm, fmem), (da, _, dmem), (wa, _, wmem) = (p.algos["fwd"][0], p.algos["bwd_data"][0],
                                                         p.algos["bwd_filter"][0])
        ws = cp.cuda.alloc(max(fmem, dmem, wmem, 1 << 20))
        out = cp.empty(cd.y_shape, cp.float32)
        dx = cp.empty(x.shape, cp.float32)
        dw = cp.empty(w.shape, cp.float32)
        p.set_math(fm)
        tx, tw, tb = (torch.from_dlpack(a) for a in (x, w, b))
        tdy = torch.from_dlpack(dy)
        print(f"algos: fwd {p.algos['fwd'][:3]} bwd_data {p.algos['bwd_data'][:3]} bwd_filter {p.algos['bwd_filter'][:3]}")
        items = {
            "noop": lambda: None,
            "cupy.empty(y)": lambda: cp.empty(cd.y_shape, cp.float32),
            "cupy.cuda.alloc(1MB)": lambda: cp.cuda.alloc(1 << 20),
            "getDevice+stream": lambda: (cp.cuda.runtime.getDevice(), cp.cuda.get_current_stream().ptr),
            "plan()+get_handle()": lambda: (cudnn.plan(cd, x.dtype), cudnn.handle.get_handle()),
            "raw cudnnConvolutionForward": lambda: fn.cudnnConvolutionForward(
                hd, one, p.xd, x.data.ptr, p.wd, w.data.ptr, p.convd, fa, ws.ptr, fmem, zero, p.yd, out.data.ptr),
            "raw fused relu": lambda: fn.cudnnConvolutionBiasActivationForward(
                hd, one, p.xd, x.data.ptr, p.wd, w.data.ptr, p.convd, fa, ws.ptr, fmem, zero, p.yd, out.data.ptr,
                p.bd, b.data.ptr, p.act["relu"], p.yd, out.data.ptr),
            "raw bwd_data": lambda: fn.cudnnConvolutionBackwardData(
                hd, one, p.wd, w.data.ptr, p.yd, dy.data.ptr, p.convd, da, ws.ptr, dmem, zero, p.xd, dx.data.ptr),
            "raw bwd_filter": lambda: fn.cudnnConvolutionBackwardFilter(
                hd, one, p.xd, x.data.ptr, p.yd, dy.data.ptr, p.convd, wa, ws.ptr, wmem, zero, p.wd, dw.data.ptr),
            "legacy.conv_bias_act_forward": lambda: legacy.conv_bias_act_forward(x, w, b, "relu", cd),
            "graph.conv_bias_act_forward": lambda: cudnn.graph.conv_bias_act_forward(x, w, b, "relu", cd),
            "ops.conv_bias_act": lambda: conv_bias_act(x, w, b, relu, pad=1, flipped=True),
            "legacy.conv_backward_data": lambda: legacy.conv_backward_data(dy, w, cd),
            "graph.conv_backward_data": lambda: cudnn.graph.conv_backward_data(dy, w, cd),
            "bias mapreduce": lambda: cuda_conv.conv_bias_act_backward(dy, y, "relu", cd, True),
            "torch conv2d": lambda: F.conv2d(tx, tw, None, padding=1),
            "torch conv2d+b+relu": lambda: F.relu(F.conv2d(tx, tw, tb, padding=1)),
            "torch bwd_data": lambda: torch.ops.aten.convolution_backward(tdy, tx, tw, None, [1, 1], [1, 1], [1, 1],
                                                                          False, [0, 0], 1, (True, False, False)),
        }
        print(f"## host/GPU profile, x {x.shape} w {w.shape} (us per call: cpu = host, gpu = events around one call)")
        for name, f in items.items():
            r = benchmark(f, n_repeat=300, n_warmup=30)
            print(f"{name:32s} cpu {np.median(r.cpu_times) * 1e6:8.1f}  gpu {np.median(r.gpu_times[0]) * 1e6:8.1f}",
                  flush=True)
        # back-to-back throughput of the raw fused call (no sync between calls)
        print(f"raw fused back-to-back: {timer(cp, items['raw fused relu'], 0.1):.1f} us; "
              f"torch conv2d back-to-back: {timer(cp, items['torch conv2d'], 0.1):.1f} us", flush=True)


if __name__ == "__main__":
    sys.exit(main())
