"""Depthwise convolutions in half precision, channels-last: fluxpy's own kernels against cuDNN's plan and PyTorch.

For each MobileNet-style layer (3x3, ``groups`` = channels, stride 1 or 2) and dtype: the forward, the input's
gradient and the weight's gradient, GPU time of each (calls queued behind a spin kernel, so the host's time does
not count), of fluxpy's kernels (:mod:`fluxpy.kernels.cuda_depthwise`, called directly), of cuDNN's graph-API
plan as fluxpy would otherwise run it (:mod:`fluxpy.kernels.cudnn.graph`, chosen by its own timing), and of
PyTorch's ``conv2d`` and its two gradients on channels-last tensors (``cudnn.benchmark`` on).

``--sweep`` adds a second table: for each layer, dtype and the two directions whose kernels have tiles (the forward
and the weight's gradient), PyTorch's time and fluxpy's at every candidate tile (``cuda_depthwise.candidates``,
forced through ``tile=``; median of 15 calls each), the rule's pick (``cuda_depthwise.plan``) and the fastest. A tile
is written ``w<wb>`` (forward) or ``w<wb>k<khb>b<blocks a SM>`` (the weight's gradient).

Run (GPU): ``PYTHONPATH=. python3 benchmarks/depthwise_conv.py [--reps 30] [--sweep]``
"""
from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np
from elementwise import Timer

LAYERS = [(256, 32, 32, 1), (256, 64, 32, 2), (256, 128, 16, 1), (256, 128, 16, 2), (256, 256, 8, 1),
          (256, 512, 4, 1), (256, 1024, 2, 1)]   # (N, C, H = W, stride)
DTYPES = (ml_dtypes.bfloat16, np.float16)


def fluxpy_calls(cp, x, w, dy, cd):
    """``{(implementation, direction): call}`` for fluxpy's kernels and cuDNN's plan."""
    from fluxpy.kernels import cuda_depthwise as dw
    from fluxpy.kernels.cudnn import graph
    return {("fluxpy", "forward"): lambda: dw.forward(x, w, cd),
            ("fluxpy", "data"): lambda: dw.backward_data(dy, w, cd),
            ("fluxpy", "filter"): lambda: dw.backward_filter(x, dy, cd),
            ("cudnn", "forward"): lambda: graph.conv_forward(x, w, cd),
            ("cudnn", "data"): lambda: graph.conv_backward_data(dy, w, cd),
            ("cudnn", "filter"): lambda: graph.conv_backward_filter(x, dy, cd)}


def torch_calls(torch, x, w, dy, stride):
    """PyTorch's forward and its two gradients on the same values, channels-last."""
    def tensor(a):   # through float32 (DLPack has no bfloat16 here), the layout kept
        return torch.from_dlpack(a.astype("float32")).to(getattr(torch, str(a.dtype)))
    tx, tw, tdy = tensor(x), tensor(w).contiguous(memory_format=torch.channels_last), tensor(dy)
    grad = torch.nn.grad
    c = tx.shape[1]
    return {("torch", "forward"): lambda: torch.nn.functional.conv2d(tx, tw, stride=stride, padding=1, groups=c),
            ("torch", "data"): lambda: grad.conv2d_input(tx.shape, tw, tdy, stride=stride, padding=1, groups=c),
            ("torch", "filter"): lambda: grad.conv2d_weight(tx, tw.shape, tdy, stride=stride, padding=1, groups=c)}


def tile_name(tile):
    """``w4`` for a forward tile, ``w4k3b2`` for one of the weight's gradient."""
    return f"w{tile.wb}" + (f"k{tile.khb}b{tile.per_sm}" if tile.khb else "")


def sweep(timer, torch, draw, to_channels_last, ConvDims):
    """The sweep table: every candidate tile of the forward and the weight's gradient against PyTorch."""
    from fluxpy.kernels import cuda_depthwise as dw
    print("\nEvery candidate tile, GPU us a call, median of 15")
    print("| layer (N, C, H, W) | stride | dtype | direction | PyTorch | rule's tile | fastest tile | every tile |")
    print("|---|---:|---|---|---:|---|---|---|")
    for dtype in DTYPES:
        for n, c, h, stride in LAYERS:
            x, w = to_channels_last(draw((n, c, h, h), dtype)), draw((c, 1, 3, 3), dtype)
            cd = ConvDims.from_shapes(x.shape, w.shape, stride=stride, pad=1, groups=c)
            dy = to_channels_last(draw(cd.y_shape, dtype))
            theirs = torch_calls(torch, x, w, dy, stride)
            ours = {"forward": lambda t: dw.forward(x, w, cd, tile=t),
                    "filter": lambda t: dw.backward_filter(x, dy, cd, tile=t)}
            for direction, call in ours.items():
                times = {t: timer(lambda t=t: call(t), True) for t in dw.candidates(direction, cd)}
                rule, best = dw.plan(direction, cd), min(times, key=times.get)
                torch_us = timer(theirs[("torch", direction)], True)
                every = " ".join(f"{tile_name(t)} {v:.1f}" for t, v in times.items())
                print(f"| {(n, c, h, h)} | {stride} | {np.dtype(dtype).name} | {direction} | {torch_us:.1f} | "
                      f"{tile_name(rule)} {times[rule]:.1f} | {tile_name(best)} {times[best]:.1f} | {every} |",
                      flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--sweep", action="store_true",
                   help="also time every candidate tile of the forward and the weight's gradient")
    args = p.parse_args()
    import cupy as cp
    import torch
    from fluxpy.layout import to_channels_last
    from fluxpy.ops.dims import ConvDims
    torch.backends.cudnn.benchmark = True
    timer = Timer(cp, args.reps)
    print(f"{torch.cuda.get_device_name()}; GPU us a call, median of {args.reps}")
    print("| layer (N, C, H, W) | stride | dtype | direction | fluxpy | cuDNN plan | PyTorch | fluxpy / PyTorch |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)

    def draw(shape, dtype):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))
    for dtype in DTYPES:
        for n, c, h, stride in LAYERS:
            x, w = to_channels_last(draw((n, c, h, h), dtype)), draw((c, 1, 3, 3), dtype)
            cd = ConvDims.from_shapes(x.shape, w.shape, stride=stride, pad=1, groups=c)
            dy = to_channels_last(draw(cd.y_shape, dtype))
            calls = {**fluxpy_calls(cp, x, w, dy, cd), **torch_calls(torch, x, w, dy, stride)}
            times = {key: timer(call, True) for key, call in calls.items()}
            for direction in ("forward", "data", "filter"):
                ours, cudnn, theirs = (times[(side, direction)] for side in ("fluxpy", "cudnn", "torch"))
                print(f"| {(n, c, h, h)} | {stride} | {np.dtype(dtype).name} | {direction} | {ours:.1f} | "
                      f"{cudnn:.1f} | {theirs:.1f} | {ours / theirs:.2f} |", flush=True)
    if args.sweep:
        sweep(Timer(cp, 15), torch, draw, to_channels_last, ConvDims)


if __name__ == "__main__":
    main()
