"""Depthwise convolutions in half precision, channels-last: fluxpy's own kernels against cuDNN's plan and PyTorch.

For each MobileNet-style layer (3x3, ``groups`` = channels, stride 1 or 2) and dtype: the forward, the input's
gradient and the weight's gradient, GPU time of each (calls queued behind a spin kernel, so the host's time does
not count), of fluxpy's kernels (:mod:`fluxpy.kernels.cuda_depthwise`, called directly), of cuDNN's graph-API
plan as fluxpy would otherwise run it (:mod:`fluxpy.kernels.cudnn.graph`, chosen by its own timing), and of
PyTorch's ``conv2d`` and its two gradients on channels-last tensors (``cudnn.benchmark`` on).

Run (GPU): ``PYTHONPATH=. python3 benchmarks/depthwise_conv.py [--reps 30]``
"""
from __future__ import annotations

import argparse

import numpy as np
from elementwise import Timer

LAYERS = [(256, 32, 32, 1), (256, 64, 32, 2), (256, 128, 16, 1), (256, 128, 16, 2), (256, 256, 8, 1),
          (256, 512, 4, 1), (256, 1024, 2, 1)]   # (N, C, H = W, stride)


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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    import cupy as cp
    import ml_dtypes
    import torch
    from fluxpy.layout import to_channels_last
    from fluxpy.ops.dims import ConvDims
    torch.backends.cudnn.benchmark = True
    timer = Timer(cp, args.reps)
    print(f"{torch.cuda.get_device_name()}; GPU us a call, median of {args.reps}")
    print("| layer (N, C, H, W) | stride | dtype | direction | fluxpy | cuDNN plan | PyTorch | fluxpy / PyTorch |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for dtype in (ml_dtypes.bfloat16, np.float16):
        for n, c, h, stride in LAYERS:
            def draw(shape):
                return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))
            x, w = to_channels_last(draw((n, c, h, h))), draw((c, 1, 3, 3))
            cd = ConvDims.from_shapes(x.shape, w.shape, stride=stride, pad=1, groups=c)
            dy = to_channels_last(draw(cd.y_shape))
            calls = {**fluxpy_calls(cp, x, w, dy, cd), **torch_calls(torch, x, w, dy, stride)}
            times = {key: timer(call, True) for key, call in calls.items()}
            for direction in ("forward", "data", "filter"):
                ours, cudnn, theirs = (times[(side, direction)] for side in ("fluxpy", "cudnn", "torch"))
                print(f"| {(n, c, h, h)} | {stride} | {np.dtype(dtype).name} | {direction} | {ours:.1f} | "
                      f"{cudnn:.1f} | {theirs:.1f} | {ours / theirs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
