"""One ResNet training step on the GPU (forward, backward, Adam update): fluxpy eager against PyTorch eager.

The nets (``models.py``): ResNet-20 for CIFAR (3x32x32, 10 classes) at batch 128 and 512, and ResNet-18
at 3x64x64 (200 classes; the CIFAR-style 3x3 stride-1 stem without max pool, the same architecture on
both sides) at batch 64; float32, NCHW on both sides. fluxpy builds the model of its public layers
(``CrossCor`` convs without bias, ``BatchNorm(c, relu)``, ``SkipConnection``/``Parallel`` with ``+``,
``GlobalMeanPool``, ``flatten``, ``Dense``); PyTorch gets the same weights (``models.resnet_twin``: written
as torchvision's ResNets, in-place add and ReLU). Loss ``logitcrossentropy`` / ``cross_entropy``; Adam(1e-3)
(``fluxpy.setup(Adam(1e-3), model)`` + ``update``; ``torch.optim.Adam(lr=1e-3)``, its default
implementation). Inputs are standard normal, labels uniform over the classes; the first losses (same
weights, same batch, BatchNorm on batch statistics) are printed side by side as the check. PyTorch runs
with ``cudnn.benchmark = True``. Every case runs twice: TF32 off and TF32 on, the same on both sides
(fluxpy: ``fluxpy.options.set(allow_tf32=...)``; PyTorch: ``torch.backends.cudnn.allow_tf32``
and ``torch.backends.cuda.matmul.allow_tf32``; fluxpy's one matmul, the Dense 64/512 => classes, is a CuPy
matmul and stays float32 either way).

What is measured, per case and side, in this order:

- step time: ``--warmup`` steps of each side, a device synchronise, then ``--rounds`` rounds of ``--steps``
  steps launched back to back (no per-step synchronise, as a training loop that logs now and then), each
  round timed by wall clock from a synchronised start to a synchronise at its end; per-step time = round
  time / steps. The two sides' rounds alternate (fluxpy, PyTorch, fluxpy, ...), so that a slow spell of a
  shared machine falls on both. Reported: the median over rounds with the 10th and 90th percentiles
  (linear interpolation).
- single steps: ``--single-steps`` steps, each one synchronised and timed alone by wall clock (host time
  and GPU time of that step, no overlap with the next). Reported: the slowest step over the median of this
  pass, how many steps took more than 1.5x that median, and their indices (to see periodic stalls). The
  issue's target: no step slower than 1.5x the median. Python's garbage collector stays on (it is part of
  a real step).
- peak memory of a step, over ``--memory-steps`` steps after the above:
  fluxpy: the most bytes in use in CuPy's default memory pool, tracked exactly at every pool malloc and
  free by a ``cupy.cuda.MemoryHook`` (block sizes as the pool rounds them, to 512 B), starting from
  ``used_bytes()`` before the first measured step; it counts every live array (parameters, Adam moments,
  the batch, activations kept for the backward pass, gradients, temporaries) and the cuDNN workspaces
  (taken from the pool for each call). PyTorch: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``:
  bytes in live tensors of its caching allocator (parameters, the ``.grad`` tensors that PyTorch keeps
  from one step to the next, Adam state, the batch, activations, temporaries, cuDNN workspaces, all
  rounded to 512 B). Neither counts the CUDA context, library handles or code. ``start`` is what was in
  use just before the measured steps (the resident model, optimiser state and batch, plus PyTorch's
  gradients). ``reserved``: the most the allocator held from the driver during the whole case (CuPy pool
  ``total_bytes()`` after the case, the pool emptied at its start; ``torch.cuda.max_memory_reserved()``
  since ``empty_cache()`` + reset at its start), caching and fragmentation included.

Run (GPU, PyTorch): ``python3 benchmarks/resnet_step.py [--cases resnet20:128,resnet20:512,resnet18:64]
[--tf32 off,on] [--rounds 7 --steps 30 --warmup 10 --single-steps 200] [--json out.json]``.
``--smoke``: the fluxpy side only, on the CPU with NumPy, batch 2, a few steps of each net (no PyTorch), to
check that everything builds, trains and reports.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fluxpy  # noqa: E402
from models import RESNETS, fluxpy_adam_step, resnet_twin, torch_adam_step  # noqa: E402

LEARNING_RATE = 1e-3
CASES = (("resnet20", 128), ("resnet20", 512), ("resnet18", 64))
SLOW = 1.5      # a single step slower than SLOW x the median counts as a stall
MB = 1 << 20


# ----------------------------------------------------------------------------------------------- the two sides

def make_case(name, batch, seed=0):
    """``(model, x, labels, classes)``: a fresh fluxpy model (float32, CPU) and a batch, the same for every side."""
    ctor, shape, classes = RESNETS[name]
    rng = np.random.default_rng(seed)
    model = ctor(rng)
    x = rng.standard_normal((batch, *shape), dtype=np.float32)
    labels = rng.integers(0, classes, batch)
    if batch > 1 and np.all(labels == labels[0]):   # never one constant label
        labels[1] = (labels[0] + 1) % classes
    return model, x, labels, classes


def fluxpy_case(model, x, labels, classes, device):
    """``(step, first loss, model)`` of fluxpy's eager step on a copy of ``model`` (see ``models.fluxpy_adam_step``)."""
    return fluxpy_adam_step(model, x, labels, classes, device, LEARNING_RATE)


def torch_case(torch, model_cpu, x, labels, device):
    """``(step, first loss)`` of the PyTorch twin of ``model_cpu`` (its weights copied before fluxpy trains)."""
    return torch_adam_step(torch, resnet_twin(torch, model_cpu).train(), x, labels, device, LEARNING_RATE)


# ----------------------------------------------------------------------------------------------- measurements

def timed_rounds(step, sync, steps, rounds, warmup):
    """Seconds per step of each round: ``warmup`` steps, then ``rounds`` x ``steps`` back to back."""
    for _ in range(warmup):
        step()
    sync()
    per_step = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        per_step.append((time.perf_counter() - t0) / steps)
    return per_step


def single_steps(step, sync, n):
    """Seconds of each of ``n`` steps, each synchronised and timed alone."""
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def round_stats(per_step):
    p10, p50, p90 = np.percentile(np.asarray(per_step) * 1e6, [10, 50, 90])
    return dict(us=float(p50), p10_us=float(p10), p90_us=float(p90),
                rounds_us=[round(t * 1e6, 1) for t in per_step])


def single_stats(times):
    if not times:
        return dict(single_median_us=None, single_p90_us=None, single_max_us=None, max_over_median=None,
                    slow_steps=None, slow_step_indices=[])
    us = np.asarray(times) * 1e6
    med = float(np.median(us))
    slow = [int(i) for i in np.flatnonzero(us > SLOW * med)]
    return dict(single_median_us=med, single_p90_us=float(np.percentile(us, 90)), single_max_us=float(us.max()),
                max_over_median=float(us.max() / med), slow_steps=len(slow), slow_step_indices=slow[:50],
                slowest_step_index=int(us.argmax()))


def fluxpy_memory(step, sync, n):
    """Peak bytes in use in CuPy's default pool over ``n`` steps (see the module's docstring), and more."""
    import cupy

    pool = cupy.get_default_memory_pool()

    class PeakHook(cupy.cuda.MemoryHook):
        name = "resnet_step_peak"

        def __init__(self, start):
            self.used = self.peak = start
            self.mallocs = 0

        def malloc_postprocess(self, **kw):
            if kw.get("mem_ptr"):
                self.mallocs += 1
                self.used += kw["mem_size"]
                if self.used > self.peak:
                    self.peak = self.used

        def free_postprocess(self, **kw):
            self.used -= kw["mem_size"]

    gc.collect()
    sync()
    start = pool.used_bytes()
    hook = PeakHook(start)
    with hook:
        for _ in range(n):
            step()
        sync()
    end = pool.used_bytes()
    return dict(peak_mb=hook.peak / MB, start_mb=start / MB, end_mb=end / MB, reserved_mb=pool.total_bytes() / MB,
                mallocs_per_step=hook.mallocs / max(n, 1), hook_drift_mb=(hook.used - end) / MB)


def torch_memory(torch, step, n):
    gc.collect()
    torch.cuda.synchronize()
    # The allocated peak restarts here. The reserved peak restarts at what is held now, which is all that the
    # case has reserved so far (the caching allocator keeps what it reserves until empty_cache).
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return dict(peak_mb=torch.cuda.max_memory_allocated() / MB, start_mb=start / MB,
                end_mb=torch.cuda.memory_allocated() / MB)


def alternating_rounds(sides, steps, rounds, warmup):
    """:func:`timed_rounds` of each ``(step, sync)`` side, their rounds taken in turn; one list per side."""
    for step, sync in sides:
        for _ in range(warmup):
            step()
        sync()
    out = [[] for _ in sides]
    for _ in range(rounds):
        for times, (step, sync) in zip(out, sides):
            times.extend(timed_rounds(step, sync, steps, 1, 0))
    return out


# ----------------------------------------------------------------------------------------------- devices, TF32

def set_tf32(on, torch, device):
    if torch is not None:
        torch.backends.cudnn.allow_tf32 = on
        torch.backends.cuda.matmul.allow_tf32 = on
    if device == "gpu":
        fluxpy.options.set(allow_tf32=on)


def reset_case(torch, device):
    """Give every cached block back before a case, so that its reserved memory is its own; collect, then freeze
    what is alive (the imports, both models) out of the cyclic collector's scans, as ``fluxpy.train`` does
    while it runs (both sides are timed under the same setting)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if device != "gpu":
        return
    import cupy
    cupy.cuda.runtime.deviceSynchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def environment(torch, device):
    env = dict(python=platform.python_version(), numpy=np.__version__, device=device)
    if torch is not None:
        env["torch"] = torch.__version__
        if device == "gpu":
            env["torch_cudnn"] = torch.backends.cudnn.version()
    if device == "gpu":
        import cupy
        from fluxpy.kernels import cudnn
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        env.update(gpu=name.decode() if isinstance(name, bytes) else name, cupy=cupy.__version__)
        try:
            env["fluxpy_cudnn"] = cudnn.version()
        except Exception as err:  # reported, not fatal
            env["fluxpy_cudnn"] = f"unknown ({type(err).__name__})"
    return env


# ----------------------------------------------------------------------------------------------- the run

def run_case(name, batch, tf32, torch, device, a):
    model, x, labels, classes = make_case(name, batch)
    sync = (lambda: None)
    if device == "gpu":
        import cupy
        sync = cupy.cuda.runtime.deviceSynchronize
    reset_case(torch, device)
    t_step = t_first = None
    if torch is not None:
        t_step, t_first = torch_case(torch, model, x, labels, device)   # copies the weights first
    f_step, f_first, f_model = fluxpy_case(model, x, labels, classes, device)
    if not math.isfinite(f_first):
        raise RuntimeError(f"{name} batch {batch}: fluxpy's first loss is {f_first}")
    sides = [(f_step, sync)]
    if torch is not None:
        t_sync = torch.cuda.synchronize if device == "gpu" else (lambda: None)
        sides.append((t_step, t_sync))
    per_step = alternating_rounds(sides, a.steps, a.rounds, a.warmup)
    f = round_stats(per_step[0])
    f.update(single_stats(single_steps(f_step, sync, a.single_steps)))
    f_mem = fluxpy_memory(f_step, sync, a.memory_steps) if device == "gpu" and a.memory_steps else None
    del f_step, f_model
    gc.collect()
    t = t_mem = None
    if torch is not None:
        t = round_stats(per_step[1])
        t.update(single_stats(single_steps(t_step, t_sync, a.single_steps)))
        if device == "gpu" and a.memory_steps:
            t_mem = torch_memory(torch, t_step, a.memory_steps)
            t_mem["reserved_mb"] = torch.cuda.max_memory_reserved() / MB
        del t_step
    row = dict(benchmark="resnet step", model=name, batch=batch, case=f"tf32 {'on' if tf32 else 'off'}", tf32=tf32,
               device=device, fluxpy_us=f["us"], torch_us=t["us"] if t else None,
               ratio=f["us"] / t["us"] if t else None,
               fluxpy_images_per_s=batch / (f["us"] * 1e-6), torch_images_per_s=batch / (t["us"] * 1e-6) if t else None,
               first_loss_fluxpy=f_first, first_loss_torch=t_first,
               first_loss_rel_diff=abs(f_first - t_first) / max(abs(t_first), 1e-12) if t_first is not None else None)
    for side, stats, mem in (("fluxpy", f, f_mem), ("torch", t, t_mem)):
        for k, v in (stats or {}).items():
            if k != "us":
                row[f"{side}_{k}"] = v
        for k, v in (mem or {}).items():
            row[f"{side}_{k}"] = v
    if f_mem and t_mem:
        row["peak_ratio"] = f_mem["peak_mb"] / t_mem["peak_mb"]
    tol = 5e-3 if tf32 else 1e-4
    if row["first_loss_rel_diff"] is not None and row["first_loss_rel_diff"] > tol:
        print(f"WARNING {name} batch {batch} tf32 {tf32}: first losses differ: fluxpy {f_first:.6f}, "
              f"PyTorch {t_first:.6f} (relative {row['first_loss_rel_diff']:.1e} > {tol:g})", flush=True)
    return row


def run(a, torch):
    device = a.device or ("gpu" if fluxpy.gpu_available()[0] else "cpu")
    if torch is not None:
        torch.backends.cudnn.benchmark = True
    cases = [(n, int(b)) for n, b in (c.split(":") for c in a.cases.split(","))]
    tf32s = [{"off": False, "on": True}[t] for t in a.tf32.split(",")]
    rows = []
    for tf32 in tf32s:
        set_tf32(tf32, torch, device)
        for name, batch in cases:
            row = run_case(name, batch, tf32, torch, device, a)
            print(f"{name} batch {batch} tf32 {'on' if tf32 else 'off'}: fluxpy {row['fluxpy_us']:.0f} us"
                  + (f", PyTorch {row['torch_us']:.0f} us, ratio {row['ratio']:.2f}" if row["torch_us"] else "")
                  + f"; first loss fluxpy {row['first_loss_fluxpy']:.6f}"
                  + (f", PyTorch {row['first_loss_torch']:.6f}" if row["first_loss_torch"] is not None else ""),
                  flush=True)
            rows.append(row)
    set_tf32(False, torch, device)
    return rows, environment(torch, device)


def _fmt(v, spec=".0f"):
    return "-" if v is None else format(v, spec)


def table(rows):
    lines = ["| model | batch | TF32 | fluxpy us/step [p10, p90] | PyTorch us/step [p10, p90] | ratio | "
             "fluxpy images/s | slowest/median step fluxpy / PyTorch (steps > 1.5x) | peak MB fluxpy / PyTorch | "
             "first loss fluxpy / PyTorch |",
             "|---|---:|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        g = r.get
        lines.append(
            f"| {r['model']} | {r['batch']} | {'on' if r['tf32'] else 'off'} | "
            f"{_fmt(r['fluxpy_us'])} [{_fmt(g('fluxpy_p10_us'))}, {_fmt(g('fluxpy_p90_us'))}] | "
            f"{_fmt(r['torch_us'])} [{_fmt(g('torch_p10_us'))}, {_fmt(g('torch_p90_us'))}] | "
            f"{_fmt(r['ratio'], '.2f')} | {_fmt(r['fluxpy_images_per_s'])} | "
            f"{_fmt(g('fluxpy_max_over_median'), '.2f')} ({_fmt(g('fluxpy_slow_steps'), 'd')}) / "
            f"{_fmt(g('torch_max_over_median'), '.2f')} ({_fmt(g('torch_slow_steps'), 'd')}) | "
            f"{_fmt(g('fluxpy_peak_mb'))} / {_fmt(g('torch_peak_mb'))} | "
            f"{_fmt(r['first_loss_fluxpy'], '.5f')} / {_fmt(r['first_loss_torch'], '.5f')} |")
    return "\n".join(lines)


def memory_table(rows):
    lines = ["| model | batch | TF32 | peak MB fluxpy / PyTorch | ratio | start MB fluxpy / PyTorch | "
             "reserved MB fluxpy / PyTorch |", "|---|---:|---|---|---:|---|---|"]
    for r in rows:
        g = r.get
        lines.append(f"| {r['model']} | {r['batch']} | {'on' if r['tf32'] else 'off'} | "
                     f"{_fmt(g('fluxpy_peak_mb'))} / {_fmt(g('torch_peak_mb'))} | {_fmt(g('peak_ratio'), '.2f')} | "
                     f"{_fmt(g('fluxpy_start_mb'))} / {_fmt(g('torch_start_mb'))} | "
                     f"{_fmt(g('fluxpy_reserved_mb'))} / {_fmt(g('torch_reserved_mb'))} |")
    return "\n".join(lines)


def smoke(a):
    """The fluxpy side on the CPU, tiny: every net builds, its output has the right shape, a step trains it, and the
    measuring and reporting code runs end to end."""
    from models import parameter_count
    for name, (_, shape, classes) in RESNETS.items():
        model, x, labels, _ = make_case(name, 2)
        out = model(x)
        assert out.shape == (2, classes), (name, out.shape)
        before = model[-1].weight.copy()
        step, first, trained = fluxpy_case(model, x, labels, classes, "cpu")
        assert math.isfinite(first), (name, first)
        assert not np.array_equal(before, trained[-1].weight), f"{name}: the update left the weights unchanged"
        print(f"smoke {name}: {parameter_count(model):,} parameters, input (2, {', '.join(map(str, shape))}) -> "
              f"{tuple(out.shape)}, first loss {first:.4f}", flush=True)
    a.cases = "resnet20:2,resnet18:2"
    a.tf32, a.device = "off", "cpu"
    a.warmup, a.rounds, a.steps, a.single_steps, a.memory_steps = 1, 2, 1, 3, 0
    return run(a, None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(f"{n}:{b}" for n, b in CASES),
                   help="comma-separated MODEL:BATCH, MODEL one of " + ", ".join(RESNETS))
    p.add_argument("--tf32", default="off,on", help="off, on, or off,on")
    p.add_argument("--steps", type=int, default=30, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--single-steps", type=int, default=200, help="steps timed one by one (the stall check)")
    p.add_argument("--memory-steps", type=int, default=3, help="steps over which the memory peak is taken")
    p.add_argument("--device", choices=["gpu", "cpu"], default=None)
    p.add_argument("--no-torch", action="store_true", help="fluxpy only")
    p.add_argument("--smoke", action="store_true", help="fluxpy only, CPU, batch 2, a few steps (no PyTorch)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.smoke:
        rows, env = smoke(a)
    else:
        torch = None
        if not a.no_torch:
            import torch
        rows, env = run(a, torch)
    head = ", ".join(f"{k} {v}" for k, v in env.items())
    torch_note = "; PyTorch with cudnn.benchmark on" if "torch" in env else "; fluxpy only"
    print(f"\n{head}{torch_note}; {a.rounds} rounds x {a.steps} steps after {a.warmup} warm-up, "
          f"{a.single_steps} single steps\n")
    print(table(rows))
    if any(r.get("fluxpy_peak_mb") is not None for r in rows):
        print("\n" + memory_table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(rows=rows, environment=env, settings=dict(
            steps=a.steps, rounds=a.rounds, warmup=a.warmup, single_steps=a.single_steps,
            memory_steps=a.memory_steps, slow_threshold=SLOW)), indent=1))
    return rows


if __name__ == "__main__":
    main()
