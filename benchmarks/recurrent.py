"""Recurrent layers: fluxpy's LSTM and GRU (cuDNN's RNN calls on the GPU; the step loop, a step = one cuBLAS product
and one fused gate kernel, ``fluxpy.kernels.cuda_recurrent``, on the CPU) against ``torch.nn.LSTM`` /
``torch.nn.GRU`` in the same process on the same device, batch first.

Columns, per case (``cell N T in H dtype``) and op (``fwd``: the layer's output without a tape; ``fwd+bwd``: the
output and the gradients of ``sum(y * dy)`` for the weights and the input):

- ``fluxpy``: what the layers run: on the GPU one cuDNN RNN call forward and two backward
  (``fluxpy.kernels.cuda_rnn``), on the CPU the step loop with the fused gate kernels;
- ``unfused``: the same layers with cuDNN's RNN and the four gate kernels taken out of the table for the run, so the
  ops run their composites, a dozen small kernels a step as the cells did before the fused ops;
- ``torch``: PyTorch with cuDNN (its whole-sequence RNN kernels; ``--tf32`` sets ``torch.backends.cudnn.allow_tf32``,
  off by default as fluxpy's matrix products are);
- ``torch native``: PyTorch with cuDNN disabled, its per-step loop over ``_thnn_fused_lstm_cell`` /
  ``_thnn_fused_gru_cell`` (the design fluxpy follows: one fused gate kernel a step);
- ``captured`` (GPU): fluxpy's same call recorded once as a CUDA graph (``fluxpy.backend.capture_graph``, what
  ``TrainStep`` does for a whole training step) and replayed: no Python runs per step, so this is the GPU time of
  fluxpy's kernels; ``-`` with the reason where the capture fails.

Times are wall milliseconds per call, what a training loop sees: ``--reps`` back-to-back calls then a device
synchronize, median and range [low-high] over ``--rounds`` rounds (3 at least), after two warm-up calls; ``ratio``
= fluxpy / torch (cuDNN), ``native`` = fluxpy / torch native, ``fused gain`` = unfused / fluxpy; ``us/step`` =
fluxpy's wall time over T (for fwd+bwd: both passes of a step). ``--device cpu`` runs the same on NumPy and
PyTorch's CPU kernels (the NumPy gate kernels of ``fluxpy.kernels.cpu_recurrent``).

Run: ``PYTHONPATH=. python3 benchmarks/recurrent.py [--cells lstm,gru] [--sizes 64x50x256x512,64x200x256x512]
[--dtype float32] [--reps 3] [--rounds 5] [--device gpu|cpu] [--tf32 off|on] [--json out.json]``
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scatter import wall_us  # noqa: E402

GATE_OPS = ("lstm_gates_forward", "lstm_gates_backward", "gru_gates_forward", "gru_gates_backward", "rnn_forward")
SIZES = "64x50x256x512,64x200x256x512"


def wall_ms(sync, run, reps, rounds):
    """``(median, low, high)`` milliseconds per call of ``run`` over ``rounds`` of ``reps`` calls and a sync, after
    two warm-up calls (the scatter benchmark's clock)."""
    run()
    return tuple(t / 1e3 for t in wall_us(sync, run, reps, rounds))


def _unfused(module):
    """The kernel table without the gate kernels and cuDNN's RNN for ``module`` ("cupy" or "numpy"), and the table to
    restore."""
    from fluxpy import kernels
    table = kernels.snapshot()
    return {k: v for k, v in table.items() if not (k[0] in GATE_OPS and k[1] == module)}, table


def _fluxpy_calls(kind, n, steps, n_in, hidden, dtype, to_device):
    import fluxpy
    make = {"lstm": fluxpy.LSTM, "gru": fluxpy.GRU, "rnn": fluxpy.RNN}[kind]
    layer = fluxpy.functors.fmap(lambda a: to_device(a.astype(dtype)) if fluxpy.backend.is_array(a) else a,
                                 make(n_in, hidden, rng=0))
    rng = np.random.default_rng(1)
    x = to_device(rng.standard_normal((n, steps, n_in)).astype(np.float32).astype(dtype))
    dy = to_device(rng.standard_normal((n, steps, hidden)).astype(np.float32).astype(dtype))

    def fwd():
        return layer(x)

    def fwd_bwd():
        return fluxpy.gradient(lambda m, x: (m(x) * dy).sum(), layer, x)
    return fwd, fwd_bwd


def _captured(run, sync):
    """``run`` recorded as a CUDA graph (after the warm-up calls that compile its kernels), as a replay call; or
    the reason it could not be captured."""
    from fluxpy.backend import capture_graph
    try:
        run()
        run()
        sync()
        graph, _ = capture_graph(run)
    except Exception as err:   # an op that cannot be captured: reported, not fatal
        return f"{type(err).__name__}: {str(err)[:80]}"
    return graph.launch


def _torch_calls(torch, kind, n, steps, n_in, hidden, dtype, device, cudnn):
    make = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[kind]
    tdt = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16}[dtype]
    layer = make(n_in, hidden, batch_first=True).to(device=device, dtype=tdt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, steps, n_in, generator=g).to(device=device, dtype=tdt).requires_grad_(True)
    dy = torch.randn(n, steps, hidden, generator=g).to(device=device, dtype=tdt)

    def fwd():
        with torch.no_grad(), torch.backends.cudnn.flags(enabled=cudnn):
            return layer(x)[0]

    def fwd_bwd():
        with torch.backends.cudnn.flags(enabled=cudnn):
            y = layer(x)[0]
        return torch.autograd.grad(y, [x, *layer.parameters()], dy)
    return fwd, fwd_bwd


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="lstm,gru", help="comma-separated among lstm, gru, rnn")
    ap.add_argument("--sizes", default=SIZES, help="comma-separated NxTxINxH")
    ap.add_argument("--dtype", default="float32", help="float32, float64, float16 or bfloat16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    ap.add_argument("--tf32", default="off", choices=("off", "on"), help="PyTorch's cudnn.allow_tf32")
    ap.add_argument("--no-unfused", action="store_true", help="skip the unfused (composite) column")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 3:
        ap.error("--rounds must be 3 or more (median and range)")
    import torch

    import fluxpy  # noqa: F401  (registers the GPU kernels where CuPy is present)
    from fluxpy import kernels
    from fluxpy.kernels.halfs import BFLOAT16
    dtype = BFLOAT16 if args.dtype == "bfloat16" else np.dtype(args.dtype)
    if args.device == "gpu":
        import cupy as cp
        module, device = "cupy", torch.device("cuda")

        def to_device(a):
            return cp.asarray(a.view(np.uint16)).view(a.dtype) if a.dtype == BFLOAT16 else cp.asarray(a)

        def sync():
            cp.cuda.runtime.deviceSynchronize()
        where = torch.cuda.get_device_name()
    else:
        module, device = "numpy", torch.device("cpu")

        def to_device(a):
            return a

        def sync():
            pass
        where = f"CPU, {torch.get_num_threads()} torch threads"
    torch.backends.cudnn.allow_tf32 = args.tf32 == "on"
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{where}; fluxpy vs torch {torch.__version__}, {args.dtype}, cuDNN TF32 {args.tf32}; "
          f"wall ms per call, median [low-high] of {args.rounds} rounds x {args.reps} calls")
    fmt = "{:8.2f} [{:7.2f}-{:7.2f}]"
    print(f"{'case':34s} {'op':8s} {'fluxpy':>25s} {'unfused':>25s} {'captured':>25s} {'torch':>25s} "
          f"{'torch native':>25s} {'ratio':>6s} {'native':>6s} {'fused gain':>10s} {'us/step':>8s}")
    rows = []
    for kind in [c for c in args.cells.split(",") if c]:
        for size in [s for s in args.sizes.split(",") if s]:
            n, steps, n_in, hidden = (int(v) for v in size.lower().split("x"))
            case = f"{kind} N{n} T{steps} in{n_in} H{hidden} {args.dtype}"
            ours = _fluxpy_calls(kind, n, steps, n_in, hidden, dtype, to_device)
            theirs = _torch_calls(torch, kind, n, steps, n_in, hidden, args.dtype, device, True)
            native = _torch_calls(torch, kind, n, steps, n_in, hidden, args.dtype, device, False)
            for k, op in enumerate(("fwd", "fwd+bwd")):
                fl = wall_ms(sync, ours[k], args.reps, args.rounds)
                un = None
                if not args.no_unfused:
                    table, saved = _unfused(module)
                    kernels.restore(table)
                    try:
                        un = wall_ms(sync, ours[k], args.reps, args.rounds)
                    finally:
                        kernels.restore(saved)
                cap = None
                if args.device == "gpu":
                    replay = _captured(ours[k], sync)
                    cap = wall_ms(sync, replay, args.reps, args.rounds) if callable(replay) else replay
                    del replay
                th = wall_ms(sync, theirs[k], args.reps, args.rounds)
                nv = wall_ms(sync, native[k], args.reps, args.rounds)
                row = {"case": case, "op": op, "fluxpy_ms": fl, "unfused_ms": un, "captured_ms": cap, "torch_ms": th,
                       "torch_native_ms": nv, "ratio": fl[0] / th[0], "native_ratio": fl[0] / nv[0],
                       "fused_gain": None if un is None else un[0] / fl[0], "us_per_step": fl[0] * 1e3 / steps,
                       # run.py's summary reads these (microseconds)
                       "fluxpy_us": fl[0] * 1e3, "torch_us": th[0] * 1e3}
                rows.append(row)
                gain = "-" if un is None else f"{row['fused_gain']:.2f}"
                captured = fmt.format(*cap) if isinstance(cap, tuple) else "-"
                print(f"{case:34s} {op:8s} {fmt.format(*fl):>25s} {(fmt.format(*un) if un else '-'):>25s} "
                      f"{captured:>25s} {fmt.format(*th):>25s} {fmt.format(*nv):>25s} {row['ratio']:6.2f} {row['native_ratio']:6.2f} "
                      f"{gain:>10s} {row['us_per_step']:8.1f}")
                if isinstance(cap, str):
                    print(f"    not captured: {cap}")
            del ours, theirs, native
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "dtype": args.dtype, "tf32": args.tf32,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
