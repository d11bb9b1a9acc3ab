"""How a Dense layer's forward should apply its bias and activation on the GPU, where the backward needs what the
activation's derivative reads: the ways ``fluxpy.ops.dense`` can take, GPU time of each (what decided its rules).

- ``epilogue``: one cuBLASLt call with the activation's epilogue, the pre-activation saved where the derivative
  reads it (gelu: ``GELU_AUX_BIAS``; relu reads its output: ``RELU_BIAS``), timed even where the op declines it as
  slower (``cublaslt._slower_than_ours``; its plan is cached as taken for the rest of this process);
- ``bias epilogue + act``: cuBLASLt with the bias epilogue (``BIAS``), then fluxpy's activation kernel on the
  product, which is itself the pre-activation (nothing written twice);
- ``bare + bias_act``: the bare product, then fluxpy's kernel adding the bias and applying the activation, writing
  the output and the pre-activation (``bias_act_preactivation``).

Cases (rows, in, out): a small ViT's MLP layers (256 images of 64 tokens, width 192), a GPT-2 small MLP layer
(8 x 1024 tokens), an MNIST MLP layer; float32 (TF32 off) and bfloat16; gelu (tanh) and relu. GPU microseconds a
call: ``--reps`` calls captured in one CUDA graph, replayed ``--rounds`` times; median and range.

Run on the GPU: ``PYTHONPATH=. python3 benchmarks/dense_epilogues.py [--rounds 5] [--reps 20]``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from graph_timing import captured_us  # noqa: E402

CASES = [(16384, 192, 768), (16384, 768, 192), (8192, 768, 3072), (512, 784, 1024)]


def ways(cublaslt, bias_act_impl, bias_act_preactivation, act, name, x, w, b):
    """The three ways of computing ``act(x @ w.T + b)`` with what its derivative reads, by name; a way the kernel
    declines is left out."""
    save = name == "gelu"
    found = {}
    declines = cublaslt._slower_than_ours
    cublaslt._slower_than_ours = lambda *args: None   # the epilogue the op declines as slower is timed too
    try:
        if cublaslt.dense_forward_supports(x, w, b, name, save):
            found["epilogue"] = lambda: cublaslt.dense_forward(x, w, b, name, save)
    finally:
        cublaslt._slower_than_ours = declines
    found["bias epilogue + act"] = lambda: bias_act_impl(cublaslt.dense_forward(x, w, b, "identity", False)[0],
                                                         None, act)
    found["bare + bias_act"] = lambda: bias_act_preactivation(
        cublaslt.dense_forward(x, w, None, "identity", False)[0], b, act)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    import cupy as cp
    from fluxpy.kernels import cublaslt
    from fluxpy.kernels.halfs import BFLOAT16
    from fluxpy.ops.activations import gelu, relu
    from fluxpy.ops.bias_act import _bias_act_impl, bias_act_preactivation
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{name}, GPU us a call, median (range) over {args.rounds} replays of {args.reps} captured calls")
    print("| (rows, in, out) | dtype | activation | epilogue | bias epilogue + act | bare + bias_act |")
    print("|---|---|---|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for dtype in (np.float32, BFLOAT16):
        for rows, n_in, n_out in CASES:
            x = cp.asarray(rng.standard_normal((rows, n_in)).astype(dtype))
            w = cp.asarray((rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(dtype))
            b = cp.asarray(rng.standard_normal(n_out).astype(dtype))
            for act, act_name in ((gelu, "gelu"), (relu, "relu")):
                found = ways(cublaslt, _bias_act_impl, bias_act_preactivation, act, act_name, x, w, b)
                cells = []
                for way in ("epilogue", "bias epilogue + act", "bare + bias_act"):
                    if way not in found:
                        cells.append("declined")
                        continue
                    med, lo, hi = captured_us(cp, found[way], args.reps, args.rounds)
                    cells.append(f"{med:.1f} ({lo:.1f}-{hi:.1f})")
                print(f"| ({rows}, {n_in}, {n_out}) | {np.dtype(dtype).name} | {act_name} | " + " | ".join(cells)
                      + " |", flush=True)


if __name__ == "__main__":
    main()
