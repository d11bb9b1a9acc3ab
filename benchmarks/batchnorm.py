"""Batch norm in training, forward + backward, fluxpy against ``torch.nn.functional.batch_norm``.

For each shape, float32, NCHW: one training forward (batch statistics, running statistics updated) and the
backward of a fixed cotangent (``dx``, ``dgamma``, ``dbeta``), timed as a pair:

- fluxpy: ``fluxpy.pullback`` of :func:`fluxpy.ops.batchnorm.batchnorm`, then the pullback, with the kernels
  kept per direction (:mod:`fluxpy.kernels.cuda_norm` times both implementations and keeps the faster); and each
  implementation's forward and backward called directly: fluxpy's own two launches each way
  (:mod:`fluxpy.kernels.cuda_bn`) and cuDNN's one call each way (:mod:`fluxpy.kernels.cudnn.batchnorm`);
- PyTorch: ``F.batch_norm(x, rm, rv, w, b, training=True)`` then ``y.backward(dy)`` (autograd);
- the composite it replaced: ``fluxpy.ops.norm.normalise`` and the affine as separate ops, plus the running
  statistics update, as the layer did before.

Timing: CUDA events around each call after warm-up, median of the repetitions; ``gpu us`` queues the calls
behind a spin kernel so only GPU time counts, ``wall us`` does not (what a host-bound step pays). ``GB/s``
counts the minimum traffic of the pair, 5 x the bytes of ``x`` (forward: read x, write y; backward: read x and
dy, write dx), against a device-to-device copy of the same size measured in the same run (read + write).

``--layout channels_last --dtype bfloat16`` (or float16, float32) times the channels-last kernels instead: fluxpy's
own kernels called directly and through the op, against PyTorch's ``F.batch_norm`` on the same channels-last
tensor (cuDNN's legacy calls and the composite take C order only: their columns are blank). The shapes then are a
VGG's, a ResNet's and a MobileNet's layers (``CL_SHAPES``).

Run: ``PYTHONPATH=. python3 benchmarks/batchnorm.py [--reps N] [--layout c_order|channels_last] [--dtype float32]
[--json out.json]``
"""
from __future__ import annotations

import argparse
import json

import numpy as np
from elementwise import Timer

SHAPES = [(128, 16, 32, 32), (128, 64, 8, 8), (512, 32, 16, 16), (64, 64, 64, 64), (256, 256, 14, 14)]
CL_SHAPES = [(128, 16, 32, 32), (128, 64, 8, 8), (1024, 64, 32, 32), (1024, 128, 16, 16), (1024, 256, 8, 8),
             (1024, 512, 4, 4), (256, 32, 32, 32), (256, 128, 16, 16), (256, 256, 8, 8), (256, 1024, 2, 2)]


def fluxpy_pair(cp, x, g, b, rm, rv, dy):
    import fluxpy
    from fluxpy.ops.batchnorm import batchnorm

    def run():
        _, back = fluxpy.pullback(lambda x, g, b: batchnorm(x, g, b, rm, rv), x, g, b)
        return back(dy)
    return run


def kernel_pair(impl, x, g, b, rm, rv, dy):
    """One implementation's training forward and backward, called directly (no tape): ``impl`` is
    :mod:`fluxpy.kernels.cuda_bn` or :mod:`fluxpy.kernels.cudnn.batchnorm`."""
    from fluxpy.kernels import cuda_bn

    def run():
        _, mean, invstd = impl.forward_training(x, g, b, rm, rv, 0.1, 1e-5)
        if impl is cuda_bn:
            return cuda_bn.backward(dy, x, g, b, mean, invstd, 1e-5)
        return impl.backward(dy, x, g, mean, invstd, 1e-5)
    return run


def composite_pair(cp, x, g, b, rm, rv, dy):
    import fluxpy
    from fluxpy.ops.norm import normalise

    def run():
        def f(x, g, b):
            axes = (0, 2, 3)
            xv = fluxpy.value_of(x)   # the statistics as the layer took them: fluxpy's mean, twice
            mean = fluxpy.mean(xv, axis=axes)
            var = fluxpy.mean((xv - mean.reshape(1, -1, 1, 1)) ** 2, axis=axes)
            m = x.size // x.shape[1]
            rm[...] = 0.9 * rm + 0.1 * mean
            rv[...] = 0.9 * rv + 0.1 * var * m / (m - 1)
            return normalise(x, axis=axes) * g.reshape(1, -1, 1, 1) + b.reshape(1, -1, 1, 1)
        _, back = fluxpy.pullback(f, x, g, b)
        return back(dy)
    return run


def torch_pair(torch, x, g, b, rm, rv, dy):
    import torch.nn.functional as F
    def tensor(a):   # through float32 (DLPack has no bfloat16 here), the layout kept
        return torch.from_dlpack(a.astype("float32")).to(getattr(torch, str(a.dtype)))

    x, g, b = (tensor(a).requires_grad_(True) for a in (x, g, b))
    rm, rv, dy = (tensor(a) for a in (rm, rv, dy))

    def run():
        x.grad = g.grad = b.grad = None
        y = F.batch_norm(x, rm, rv, g, b, training=True, momentum=0.1, eps=1e-5)
        y.backward(dy)
    return run


def copy_us(cp, timer, nbytes):
    src = cp.empty(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    src[...] = 1
    return timer(lambda: cp.copyto(dst, src), True)


def measure(cp, torch, timer, shape, dtype="float32", channels_last=False):
    from fluxpy.layout import to_channels_last
    rng = np.random.default_rng(0)
    c = shape[1]
    layout = to_channels_last if channels_last else (lambda a: a)
    x = layout(cp.asarray(rng.standard_normal(shape, dtype=np.float32) * 2 + 0.5).astype(dtype))
    dy = layout(cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype))
    g = cp.asarray(rng.standard_normal(c, dtype=np.float32))
    b = cp.asarray(rng.standard_normal(c, dtype=np.float32))
    rm, rv = cp.zeros(c, cp.float32), cp.ones(c, cp.float32)
    from fluxpy.kernels import cuda_bn
    from fluxpy.kernels.cudnn import batchnorm as cudnn_bn
    row = {"shape": list(shape), "mbytes": x.nbytes / 1e6}
    for name, impl in (("fluxpy", cuda_bn), ("cudnn", cudnn_bn)):   # each implementation alone
        if name == "fluxpy" or not channels_last:
            row[f"{name}_kernels_gpu_us"], row[f"{name}_kernels_wall_us"] = timer.both(
                kernel_pair(impl, x, g, b, rm, rv, dy))
    row["fluxpy_gpu_us"], row["fluxpy_wall_us"] = timer.both(fluxpy_pair(cp, x, g, b, rm, rv, dy))
    if not channels_last:
        row["composite_gpu_us"], row["composite_wall_us"] = timer.both(
            composite_pair(cp, x, g, b, rm.copy(), rv.copy(), dy))
    if torch is not None:
        row["torch_gpu_us"], row["torch_wall_us"] = timer.both(torch_pair(torch, x, g, b, rm, rv, dy))
    copy = copy_us(cp, timer, x.nbytes)
    row["copy_gbs"] = 2 * x.nbytes / copy / 1e3
    row["fluxpy_gbs"] = 5 * x.nbytes / row["fluxpy_gpu_us"] / 1e3
    row["fluxpy_share_of_copy"] = row["fluxpy_gbs"] / row["copy_gbs"]
    row["fluxpy_us"], row["torch_us"] = row["fluxpy_gpu_us"], row.get("torch_gpu_us")   # what run.py compares
    return row


def _us(row, key):
    return f"{row[key]:.1f}" if key in row else "-"


def print_table(rows):
    print("| shape | MB | fluxpy gpu us | PyTorch gpu us | ratio | fluxpy wall us | PyTorch wall us | own kernels us "
          "| cuDNN us | composite gpu us | fluxpy GB/s | share of copy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t = r.get("torch_gpu_us")
        ratio = f"{r['fluxpy_gpu_us'] / t:.2f}" if t else "-"
        print(f"| {tuple(r['shape'])} | {r['mbytes']:.0f} | {r['fluxpy_gpu_us']:.1f} | {t or 0:.1f} | {ratio} | "
              f"{r['fluxpy_wall_us']:.1f} | {r.get('torch_wall_us', 0):.1f} | {r['fluxpy_kernels_gpu_us']:.1f} | "
              f"{_us(r, 'cudnn_kernels_gpu_us')} | {_us(r, 'composite_gpu_us')} | "
              f"{r['fluxpy_gbs']:.0f} | {r['fluxpy_share_of_copy']:.0%} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--layout", choices=("c_order", "channels_last"), default="c_order")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--json")
    args = p.parse_args()
    import cupy as cp
    try:
        import torch
    except ImportError:
        torch = None
    timer = Timer(cp, args.reps)
    dtype = np.dtype(args.dtype) if args.dtype != "bfloat16" else np.dtype(__import__("ml_dtypes").bfloat16)
    cl = args.layout == "channels_last"
    print(f"{args.dtype}, {args.layout}")
    rows = [measure(cp, torch, timer, s, dtype, cl) for s in (CL_SHAPES if cl else SHAPES)]
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
