"""Data-parallel scaling on one machine's GPUs: fluxpy's DataParallel against PyTorch's DistributedDataParallel, and
the all-reduce bandwidth of each one's NCCL communicator.

What is measured, in one run (each job in its own processes, started through ``python -m fluxpy.distributed.run``,
which only sets ``RANK``/``WORLD_SIZE``/``MASTER_*``; no torchrun):

- scaling efficiency = throughput on N GPUs / (N x throughput on one GPU), the same batch per GPU, for ResNet-20
  (CIFAR, 3x32x32) at batch 256 per GPU and the ResNet-18 at 3x64x64 at batch 64 per GPU (``fluxpy.models``; PyTorch
  gets the same network, ``models.resnet_twin``). One training step: forward, backward, gradient all-reduce, Adam
  (``fluxpy.TrainStep`` of ``DataParallel(model)``, captured as a CUDA graph unless ``--capture off``;
  ``torch.optim.Adam`` over ``DistributedDataParallel(net, bucket_cap_mb=25)``, eager). On one GPU each side runs its
  plain model (no wrapper). BatchNorm statistics per GPU on both sides; TF32 off on both sides; PyTorch with
  ``cudnn.benchmark``. Throughput = N x batch x steps / wall time of ``--steps`` steps between two device
  synchronisations on rank 0 (the ranks run in lock step through the all-reduces), after ``--warmup`` steps;
  ``--repeats`` such windows per job. Reported: the median and the range (min-max) over the windows.
- all-reduce of a ``--allreduce-mb`` MB float32 buffer (100 MB: 25,000,000 floats), in place, sum: fluxpy's
  ``ProcessGroup.all_reduce`` (``ncclAllReduce`` on the communicator's stream) and ``torch.distributed.all_reduce``;
  ``--iters`` calls between synchronisations per window; algbw = bytes / time per call, busbw = algbw x 2(n-1)/n
  (nccl-tests' definition). Median and range over the windows.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` and friends are set for every process started).

Run (2+ GPUs, PyTorch for its side): ``PYTHONPATH=. python3 benchmarks/data_parallel.py [--gpus 1,2]
[--models resnet20:256,resnet18:64] [--sides fluxpy,torch] [--tasks scaling,allreduce] [--steps 30 --warmup 10
--repeats 5] [--json out.json]``.
``--smoke``: fluxpy only, on the CPU, one process, ResNet-20 at batch 2, two steps (checks the code path);
``--cpu``: the fluxpy side on the CPU through the tcp backend, any ``--gpus`` (processes), to check the driver:
``--cpu --sides fluxpy --gpus 1,2 --models resnet20:4 --steps 2 --warmup 1 --repeats 3 --allreduce-mb 4``.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
RESULT = "DP-RESULT "
LEARNING_RATE = 1e-3


# ----------------------------------------------------------------------------------------------- the workers

def _windows(step, sync, steps, warmup, repeats, barrier):
    """``(window seconds, warm-up seconds)``: ``warmup`` steps (compiling, autotuning, capturing), then
    ``repeats`` windows of ``steps`` steps, each between a barrier and a device synchronisation."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warm = time.perf_counter() - t0
    out = []
    for _ in range(repeats):
        barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        out.append(time.perf_counter() - t0)
    return out, warm


def fluxpy_worker(a):
    started = time.perf_counter()
    import fluxpy
    from fluxpy.distributed import DataParallel, init
    from models import RESNETS
    group = init(timeout=300, collective_timeout=600)
    name, batch = a.model.split(":")
    batch = int(batch)
    ctor, shape, classes = RESNETS[name]
    rng = np.random.default_rng(group.rank)
    model = ctor(np.random.default_rng(0))
    x = rng.standard_normal((batch, *shape), dtype=np.float32)
    y = fluxpy.onehotbatch(rng.integers(0, classes, batch), range(classes))
    move = (lambda t: t) if a.cpu else fluxpy.gpu
    model, x, y = move((model, x, y))
    net = DataParallel(model) if group.world_size > 1 else model
    step = fluxpy.TrainStep(lambda m, x, y: fluxpy.logitcrossentropy(m(x), y), net,
                            fluxpy.setup(fluxpy.Adam(LEARNING_RATE), net), capture=a.capture == "on")
    if a.cpu:
        def sync():
            return None
    else:
        import cupy   # the benchmark, not the library: it may name CuPy
        sync = cupy.cuda.Device().synchronize
    setup = time.perf_counter() - started
    times, warm = _windows(lambda: step(x, y), sync, a.steps, a.warmup, a.repeats, group.barrier)
    captured = sorted(set(step.captured().values())) if hasattr(step, "captured") else []
    report(group.rank, dict(side="fluxpy", model=name, batch=batch, gpus=group.world_size, seconds=times,
                            steps=a.steps, captured=captured, setup_s=setup, warmup_s=warm,
                            buckets=len(net.buckets) if isinstance(net, DataParallel) else 0))
    group.destroy()


def torch_worker(a):
    started = time.perf_counter()
    import torch
    import torch.distributed as dist

    from models import RESNETS, resnet_twin
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    if world > 1:
        dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world,
                                device_id=torch.device("cuda", local))
    name, batch = a.model.split(":")
    batch = int(batch)
    ctor, shape, classes = RESNETS[name]
    rng = np.random.default_rng(rank)
    net = resnet_twin(torch, ctor(np.random.default_rng(0))).cuda().train()
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[local], bucket_cap_mb=25)
    opt = torch.optim.Adam(net.parameters(), lr=LEARNING_RATE)
    tx = torch.from_numpy(rng.standard_normal((batch, *shape), dtype=np.float32)).cuda()
    ty = torch.from_numpy(rng.integers(0, classes, batch)).cuda()

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(tx), ty).backward()
        opt.step()
    barrier = (lambda: dist.barrier(device_ids=[local])) if world > 1 else (lambda: None)
    setup = time.perf_counter() - started
    times, warm = _windows(step, torch.cuda.synchronize, a.steps, a.warmup, a.repeats, barrier)
    report(rank, dict(side="torch", model=name, batch=batch, gpus=world, seconds=times, steps=a.steps,
                      setup_s=setup, warmup_s=warm))
    if world > 1:
        dist.destroy_process_group()


def allreduce_worker(a):
    nbytes = int(a.allreduce_mb * 1e6)
    n = nbytes // 4
    if a.side == "fluxpy":
        from fluxpy.distributed import init
        from fluxpy.kernels.nccl import nccl_version
        group = init(timeout=300)
        if a.cpu:
            buf, sync, nccl = np.ones(n, np.float32), (lambda: None), "none (tcp backend)"
        else:
            import cupy
            buf, sync, nccl = cupy.ones(n, cupy.float32), cupy.cuda.Device().synchronize, nccl_version()

        def op():
            group.all_reduce(buf)
        barrier, rank, world = group.barrier, group.rank, group.world_size
    else:
        import torch
        import torch.distributed as dist
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world,
                                device_id=torch.device("cuda", local))
        buf = torch.ones(n, dtype=torch.float32, device="cuda")

        def op():
            dist.all_reduce(buf)
        sync, barrier = torch.cuda.synchronize, (lambda: dist.barrier(device_ids=[local]))
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    times, _ = _windows(op, sync, a.iters, a.warmup, a.repeats, barrier)
    per_call = [t / a.iters for t in times]
    algbw = [n * 4 / t / 1e9 for t in per_call]
    busbw = [b * 2 * (world - 1) / world for b in algbw]
    report(rank, dict(side=a.side, task="allreduce", gpus=world, bytes=n * 4, us=[t * 1e6 for t in per_call],
                      algbw=algbw, busbw=busbw, nccl=str(nccl)))
    if a.side == "torch":
        dist.destroy_process_group()


def report(rank, result):
    if rank == 0:
        print(RESULT + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------- the driver

def launch(nproc, args, timeout, log_dir=None):
    """Run one job under the launcher; ``(result, output)``. Its output goes to a log file (``log_dir``, or a
    temporary one) as it comes. Past ``timeout`` seconds the launcher gets SIGTERM (it stops every rank first; the
    ranks have dumped their Python stacks to that output shortly before) and the job counts as failed."""
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "fluxpy.distributed.run", "--nproc", str(nproc), str(Path(__file__).resolve()),
           *args, "--dump-after", f"{max(timeout - 30, 0.8 * timeout):.0f}"]
    name = "_".join(a.lstrip("-").replace(":", "-") for a in args[:6]) + f"_{nproc}gpu.log"
    log = Path(log_dir) / name if log_dir else Path(tempfile.mkdtemp()) / name
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    output = log.read_text(errors="replace")
    took = time.perf_counter() - started
    for line in output.splitlines():
        text = line.split("] ", 1)[-1]
        if text.startswith(RESULT):
            return json.loads(text[len(RESULT):]), output
    print(f"job failed ({' '.join(args)}, {nproc} GPU(s)), exit {proc.returncode} after {took:.0f} s (log {log}):\n"
          f"{output[-6000:]}", file=sys.stderr, flush=True)
    return None, output


def summary(values):
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def drive(a):
    gpus = [int(g) for g in a.gpus.split(",")] if a.gpus else [n for n in (1, 2, 4, 8) if n <= gpu_count()]
    if 1 not in gpus:
        gpus = [1] + gpus
    common = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--repeats", str(a.repeats)]
    rows, reduce_rows = [], []
    tasks = a.tasks.split(",")
    for model in a.models.split(",") if "scaling" in tasks else []:
        for side in a.sides.split(","):
            base = None
            for n in gpus:
                extra = (["--capture", a.capture] + (["--cpu"] if a.cpu else [])) if side == "fluxpy" else []
                res, _ = launch(n, ["--worker", side, "--model", model, *common, *extra], a.timeout, a.log_dir)
                if res is None:
                    continue
                thr = [n * res["batch"] * res["steps"] / s for s in res["seconds"]]
                if n == 1:
                    base = statistics.median(thr)
                eff = [t / (n * base) for t in thr] if base else None
                row = dict(side=side, model=model, gpus=n, images_per_s=summary(thr),
                           efficiency=summary(eff) if eff else None, captured=res.get("captured"),
                           buckets=res.get("buckets"), setup_s=res.get("setup_s"), warmup_s=res.get("warmup_s"))
                rows.append(row)
                print(_row_text(row), flush=True)
    for side in a.sides.split(",") if "allreduce" in tasks else []:
        for n in [g for g in gpus if g > 1]:
            res, _ = launch(n, ["--worker", "allreduce", "--side", side, "--allreduce-mb", str(a.allreduce_mb),
                                "--iters", str(a.iters), "--warmup", "5", "--repeats", str(a.repeats)]
                            + (["--cpu"] if a.cpu else []), a.timeout, a.log_dir)
            if res is None:
                continue
            row = dict(side=side, gpus=n, mb=a.allreduce_mb, us=summary(res["us"]), algbw=summary(res["algbw"]),
                       busbw=summary(res["busbw"]), nccl=res["nccl"])
            reduce_rows.append(row)
            print(f"all-reduce {a.allreduce_mb:g} MB, {side}, {n} GPUs (NCCL {row['nccl']}): busbw "
                  f"{_rng(row['busbw'], '.1f')} GB/s, algbw {_rng(row['algbw'], '.1f')} GB/s, "
                  f"{_rng(row['us'], '.0f')} us", flush=True)
    print("\n" + table(rows, reduce_rows))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(rows=rows, allreduce=reduce_rows, args=vars(a)), indent=1))


def _rng(s, spec):
    return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


def _row_text(r):
    eff = f", efficiency {_rng(r['efficiency'], '.3f')}" if r["efficiency"] else ""
    return (f"{r['side']} {r['model']} on {r['gpus']} GPU(s): {_rng(r['images_per_s'], '.0f')} images/s{eff} "
            f"(setup {r['setup_s']:.1f} s, warm-up {r['warmup_s']:.1f} s, captured: {r['captured'] or '-'})")


def table(rows, reduce_rows):
    lines = ["| model, batch per GPU | GPUs | fluxpy images/s | fluxpy efficiency | PyTorch DDP images/s | "
             "PyTorch efficiency |", "|---|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["model"], r["gpus"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for model, n in keys:
        cells = []
        for side in ("fluxpy", "torch"):
            r = next((r for r in rows if r["side"] == side and r["model"] == model and r["gpus"] == n), None)
            cells += ["-", "-"] if r is None else [_rng(r["images_per_s"], ".0f"),
                                                   _rng(r["efficiency"], ".3f") if r["efficiency"] else "-"]
        lines.append(f"| {model} | {n} | " + " | ".join(cells) + " |")
    if reduce_rows:
        lines += ["", "| all-reduce | GPUs | busbw GB/s (median, range) | algbw GB/s | time us |",
                  "|---|---:|---:|---:|---:|"]
        for r in reduce_rows:
            lines.append(f"| {r['side']} {r['mb']:g} MB float32 | {r['gpus']} | {_rng(r['busbw'], '.1f')} | "
                         f"{_rng(r['algbw'], '.1f')} | {_rng(r['us'], '.0f')} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=["fluxpy", "torch", "allreduce"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--side", default="fluxpy", help=argparse.SUPPRESS)
    p.add_argument("--model", default="resnet20:256", help=argparse.SUPPRESS)
    p.add_argument("--gpus", default=None, help="GPU counts to run, e.g. 1,2 (default: 1, 2, 4, 8 up to what exists)")
    p.add_argument("--models", default="resnet20:256,resnet18:64", help="model:batch per GPU, comma-separated")
    p.add_argument("--sides", default="fluxpy,torch")
    p.add_argument("--tasks", default="scaling,allreduce", help="scaling (the training steps), allreduce, or both")
    p.add_argument("--capture", choices=["on", "off"], default="on", help="fluxpy's step as a CUDA graph")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--allreduce-mb", type=float, default=100.0)
    p.add_argument("--iters", type=int, default=20, help="all-reduce calls per timed window")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--json", default=None)
    p.add_argument("--log-dir", default=None, help="keep every job's output here (default: a temporary folder)")
    p.add_argument("--dump-after", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--cpu", action="store_true", help="fluxpy on the CPU (tcp backend): checks the driver, no GPU")
    a = p.parse_args(argv)
    if a.worker and a.dump_after > 0:   # a stalled job shows where every rank stood before it is stopped
        faulthandler.dump_traceback_later(a.dump_after, exit=False)
    if a.worker == "fluxpy":
        return fluxpy_worker(a)
    if a.worker == "torch":
        return torch_worker(a)
    if a.worker == "allreduce":
        return allreduce_worker(a)
    if a.smoke:
        res, output = launch(1, ["--worker", "fluxpy", "--model", "resnet20:2", "--steps", "2", "--warmup", "1",
                                 "--repeats", "3", "--capture", "off", "--cpu"], a.timeout, a.log_dir)
        print(output.strip())
        return 0 if res is not None else 1
    return drive(a)


if __name__ == "__main__":
    sys.exit(main())
