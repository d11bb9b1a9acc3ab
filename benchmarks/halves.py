"""Conversions between float32 and the halves, as mixed precision runs them every step (each parameter to the half
type, each gradient back), and sums of two half-precision arrays (residual connections, the backward walk):
fluxpy's kernels (:mod:`fluxpy.kernels.cuda_halves`) against CuPy's ``astype`` and ``+`` and PyTorch's
``Tensor.to`` and ``+``, GPU time a call (calls queued behind a spin kernel, so the host's time does not count),
and the bandwidth fluxpy's reach (bytes read and written over its time); then a bias and gelu forward (with the
pre-activation kept) and the derivative's product backward, against the traced elementwise kernels fluxpy ran
before (CuPy ``ElementwiseKernel``s) and PyTorch's ``gelu(x + b)`` and ``gelu_backward``.

Run (GPU): ``PYTHONPATH=. python3 benchmarks/halves.py [--reps 30]``
"""
from __future__ import annotations

import argparse

import numpy as np
from elementwise import Timer

SIZES = [(768, 768), (768, 3072), (8192, 768), (8, 1024, 768), (256, 64, 32, 32)]
ACT_SIZES = [(8192, 3072), (16384, 768), (128, 64, 16, 16)]   # a GPT and a ViT MLP layer, a residual block


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    import cupy as cp
    import ml_dtypes
    import torch
    from fluxpy.kernels import cuda_halves
    timer = Timer(cp, args.reps)
    print(f"{torch.cuda.get_device_name()}; GPU us a call, median of {args.reps}")
    print("| shape | op | fluxpy | CuPy | PyTorch | fluxpy / PyTorch | fluxpy GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    pairs = [(np.float32, ml_dtypes.bfloat16), (ml_dtypes.bfloat16, np.float32), (np.float32, np.float16),
             (np.float16, np.float32)]
    names = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
             np.dtype(ml_dtypes.bfloat16): torch.bfloat16}
    for shape in SIZES:
        for src, dst in pairs:
            src, dst = np.dtype(src), np.dtype(dst)
            x = cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(src))
            tx = torch.randn(shape, device="cuda").to(names[src])
            ours = timer(lambda: cuda_halves.cast(x, dst), True)
            theirs_cp = timer(lambda: x.astype(dst), True)
            theirs = timer(lambda: tx.to(names[dst]), True)
            gbs = x.size * (src.itemsize + dst.itemsize) / ours / 1e3
            print(f"| {shape} | {src.name} to {dst.name} | {ours:.1f} | {theirs_cp:.1f} | {theirs:.1f} | "
                  f"{ours / theirs:.2f} | {gbs:,.0f} |", flush=True)
        for dtype in (ml_dtypes.bfloat16, np.float16):
            dtype = np.dtype(dtype)
            a, b = (cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype)) for _ in range(2))
            ta, tb = (torch.randn(shape, device="cuda").to(names[dtype]) for _ in range(2))
            ours = timer(lambda: cuda_halves.add(a, b), True)
            theirs_cp = timer(lambda: a + b, True)
            theirs = timer(lambda: ta + tb, True)
            gbs = 3 * a.nbytes / ours / 1e3
            print(f"| {shape} | {dtype.name} + | {ours:.1f} | {theirs_cp:.1f} | {theirs:.1f} | {ours / theirs:.2f} | "
                  f"{gbs:,.0f} |", flush=True)

    print("\n| shape | op | fluxpy | traced kernel | PyTorch | fluxpy / PyTorch | fluxpy GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    _act_rows(cp, torch, timer, rng, names)


def _act_rows(cp, torch, timer, rng, names):
    """Rows of the bias + gelu forward and its backward's product."""
    import ml_dtypes
    from fluxpy.kernels import cuda_halves, elementwise
    from fluxpy.layout import to_channels_last
    from fluxpy.ops.activations import gelu
    from fluxpy.ops.bias_act import derivative_from_saved
    derivative = derivative_from_saved(gelu)[0]
    dtype = np.dtype(ml_dtypes.bfloat16)
    for shape in ACT_SIZES:
        def draw(shape):
            return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))
        x = draw(shape) if len(shape) == 2 else to_channels_last(draw(shape))
        c = shape[-1] if len(shape) == 2 else shape[1]
        b = draw((c,)) if len(shape) == 2 else draw((1, c, 1, 1))
        dy = x.copy()
        traced = elementwise._scalar_kernel("fluxpy_bias_act_preactivation", ("x", "b"), ("y", "z"),
                                            f"z_c = x_c + b_c; y_c = {elementwise.activation_c(gelu, dtype, 'z_c')};",
                                            dtype)
        tx = torch.from_dlpack(x.astype(np.float32)).to(torch.bfloat16)
        tb = torch.from_dlpack(b.astype(np.float32)).to(torch.bfloat16)
        rows = {"bias + gelu": (lambda: cuda_halves.bias_act(x, b, elementwise._act_text(gelu, dtype), preactivation=True),
                                lambda: elementwise.keeping_layout(traced, x, b),
                                lambda: torch.nn.functional.gelu(tx + tb, approximate="tanh"), 4),
                "gelu derivative * dy": (lambda: cuda_halves.act_grad(dy, x, elementwise._act_text(derivative, dtype)),
                                         lambda: elementwise._dz_kernel(derivative, dtype)(dy, x),
                                         lambda: torch.ops.aten.gelu_backward(tx, tx, approximate="tanh"), 3)}
        for op, (ours_fn, traced_fn, torch_fn, passes) in rows.items():
            ours, old, theirs = timer(ours_fn, True), timer(traced_fn, True), timer(torch_fn, True)
            gbs = passes * x.nbytes / ours / 1e3
            print(f"| {shape} | {op} | {ours:.1f} | {old:.1f} | {theirs:.1f} | {ours / theirs:.2f} | {gbs:,.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
