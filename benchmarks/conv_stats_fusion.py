"""cuDNN's runtime fusion of a convolution with batch-norm statistics against fluxpy's separate kernels (issue 36,
item 3: "for conv followed by batch norm, use cuDNN's runtime fusion where it measures faster").

The problems: ResNet-20's three 3x3 convolutions (stride 1, pad 1; (channels in, height = width, channels out) =
(16, 32, 16), (32, 16, 32), (64, 8, 64)), channels-last, in ``--dtype`` (float16 or bfloat16), at ``--batch``.
Graphs built with NVIDIA's ``nvidia-cudnn-frontend`` (the ``cudnn`` module) on CuPy pointers, every plan its
heuristics offer timed and the fastest kept:

- ``conv``: ``conv_fprop`` alone;
- ``conv+stats``: ``conv_fprop`` then ``genstats`` (the per-channel sum and sum of squares in float32, in the
  convolution's epilogue): what would replace fluxpy's statistics kernel;
- ``sbr+conv+stats``: the previous batch norm's scale, shift and relu applied to the input in the prologue, then
  the above: what would also replace the previous batch norm's apply kernel.

fluxpy's side: ``ops.conv`` (its cached cuDNN graph plan), the batch norm's statistics kernel alone
(``kernels/cuda_bn``'s ``bn_stats_cl``, the launch ``forward_training`` makes) and ``ops.batchnorm`` with relu
(statistics and apply). The fusion pays where ``conv+stats - conv`` is less than ``fluxpy stats``.

GPU microseconds per call: 20 calls captured in one CUDA graph, replayed ``--rounds`` times; median and range.
A graph no engine takes is reported as such (cuDNN 9.19 on an H200 offers none in bfloat16).

Run on the GPU: ``python3 benchmarks/conv_stats_fusion.py [--batch 128] [--dtype float16] [--rounds 5]``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from graph_timing import captured_us  # noqa: E402

SHAPES = [(16, 32, 16), (32, 16, 32), (64, 8, 64)]
CALLS = 20


def channels_last_strides(shape):
    n, c, h, w = shape
    return [h * w * c, 1, w * c, c]


def fused_graph(cudnn, handle, kind, io_type, n, c, hw, k):
    """The frontend graph of ``kind`` and its tensors by name, or a string saying why none was built."""
    g = cudnn.pygraph(io_data_type=io_type, intermediate_data_type=io_type,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    x_shape, w_shape, y_shape = (n, c, hw, hw), (k, c, 3, 3), (n, k, hw, hw)
    x = g.tensor(name="X", dim=list(x_shape), stride=channels_last_strides(x_shape), data_type=io_type)
    w = g.tensor(name="W", dim=list(w_shape), stride=channels_last_strides(w_shape), data_type=io_type)
    tensors = {"X": x, "W": w}
    image = x
    if kind == "sbr+conv+stats":
        scale = g.tensor(name="S", dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=io_type)
        shift = g.tensor(name="B", dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=io_type)
        tensors.update(S=scale, B=shift)
        image = g.relu(name="relu", input=g.bias(name="shift", input=g.scale(name="scale", input=x, scale=scale),
                                                 bias=shift))
    y = g.conv_fprop(image=image, weight=w, padding=[1, 1], stride=[1, 1], dilation=[1, 1],
                     compute_data_type=cudnn.data_type.FLOAT)
    y.set_output(True).set_data_type(io_type).set_dim(list(y_shape)).set_stride(channels_last_strides(y_shape))
    tensors["Y"] = y
    if kind != "conv":
        total, squares = g.genstats(name="stats", input=y)
        total.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        squares.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        tensors.update(SUM=total, SQSUM=squares)
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
    except Exception as err:   # the frontend's "not supported" errors differ by version; the message says which
        return f"no engine ({str(err).splitlines()[0][:80]})"
    return g, tensors


def fastest_plan(cp, cudnn, handle, graph, pack, rounds):
    best = None
    for index in range(graph.get_execution_plan_count()):
        workspace = cp.empty(max(graph.get_workspace_size_plan_at_index(index), 1), np.uint8)

        def run(index=index, workspace=workspace):
            cudnn.set_stream(handle=handle, stream=cp.cuda.get_current_stream().ptr)
            graph.execute_plan_at_index(pack, workspace.data.ptr, index=index, handle=handle)
        try:
            timed = captured_us(cp, run, CALLS, rounds)
        except Exception:   # a plan that fails to run is skipped; the others are timed
            continue
        best = timed if best is None or timed[0] < best[0] else best
    return best


def fluxpy_stats_call(cp, y, gamma, beta, running_mean, running_var):
    """The statistics launch of ``kernels.cuda_bn.forward_training`` alone (no public entry point runs it alone)."""
    from fluxpy.kernels import cuda_bn
    plan = cuda_bn._plan(None, False, y)
    stats = cp.empty((4, y.shape[1]), plan.pdt)
    addresses = [np.uint64(a.data.ptr) for a in (gamma, beta, *stats, running_mean, running_var)]
    args = (y, *plan.scalars, *plan.part, plan.counter, *addresses, np.uint64(0), np.float64(0.1), np.float64(1e-5))
    return lambda: plan.stats(*plan.red, args)


def cell(timed):
    return timed if isinstance(timed, str) else f"{timed[0]:.1f} ({timed[1]:.1f}-{timed[2]:.1f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import cupy as cp
    import cudnn
    from fluxpy import ops, relu
    from fluxpy.kernels.halfs import BFLOAT16
    from fluxpy.layout import to_channels_last
    dtype = np.float16 if args.dtype == "float16" else BFLOAT16
    io_type = cudnn.data_type.HALF if args.dtype == "float16" else cudnn.data_type.BFLOAT16
    handle = cudnn.create_handle()
    rng = np.random.default_rng(0)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{name}, cuDNN {cudnn.backend_version_string()}, {args.dtype}, batch {args.batch}, GPU us a call, median (range) "
          f"over {args.rounds} replays of {CALLS} calls")
    print("| (C, H=W, K) | conv | conv+stats | sbr+conv+stats | fluxpy conv | fluxpy stats | fluxpy batchnorm+relu |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c, hw, k in SHAPES:
        n = args.batch
        x = to_channels_last(cp.asarray(rng.standard_normal((n, c, hw, hw)).astype(dtype)))
        w = to_channels_last(cp.asarray((rng.standard_normal((k, c, 3, 3)) * 0.1).astype(dtype)))
        y = to_channels_last(cp.asarray(rng.standard_normal((n, k, hw, hw)).astype(dtype)))   # the graphs overwrite it
        scale = cp.asarray(rng.uniform(0.5, 1.5, (1, c, 1, 1)).astype(dtype))
        shift = cp.asarray(rng.uniform(-0.1, 0.1, (1, c, 1, 1)).astype(dtype))
        total, squares = cp.empty((1, k, 1, 1), np.float32), cp.empty((1, k, 1, 1), np.float32)
        pointers = {"X": x, "W": w, "Y": y, "S": scale, "B": shift, "SUM": total, "SQSUM": squares}
        cells = []
        for kind in ("conv", "conv+stats", "sbr+conv+stats"):
            built = fused_graph(cudnn, handle, kind, io_type, n, c, hw, k)
            if isinstance(built, str):
                cells.append(built)
                continue
            graph, tensors = built
            pack = {t: pointers[key].data.ptr for key, t in tensors.items()}
            cells.append(fastest_plan(cp, cudnn, handle, graph, pack, args.rounds) or "no plan ran")
        gamma, beta = cp.asarray(rng.uniform(0.5, 1.5, k).astype(np.float32)), cp.zeros(k, np.float32)
        running_mean, running_var = cp.zeros(k, np.float32), cp.ones(k, np.float32)
        stats = fluxpy_stats_call(cp, y, gamma, beta, running_mean, running_var)
        for run in (lambda: ops.conv(x, w, pad=1), stats,
                    lambda: ops.batchnorm(y, gamma, beta, running_mean, running_var, act=relu)):
            cells.append(captured_us(cp, run, CALLS, args.rounds))
        print(f"| ({c}, {hw}, {k}) | " + " | ".join(cell(t) for t in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
