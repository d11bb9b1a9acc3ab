"""The model zoo's networks, each side's best training step: fluxpy (eager; captured in float32, bfloat16, float16)
against PyTorch (eager, whole-step CUDA graph, autocast + channels-last eager and graph, ``torch.compile``).

Networks (:data:`NETS`, defined in ``zoo_nets.py``; one case per network and batch, :data:`CASES`), the fluxpy
ones from ``fluxpy.models`` but for the GPT:

- ``mnist``: the Flux model-zoo MNIST conv net (``models.reference_net``), 1x28x28, batch 128, Adam;
- ``resnet20``: ``resnet20()``, CIFAR 3x32x32, batch 128 and 512, Adam;
- ``mobilenet``: ``mobilenet_cifar()`` (depthwise-separable blocks, relu6), batch 256, Adam;
- ``vgg``: ``vgg_cifar()`` (conv, max pool, BatchNorm, GELU), batch 1024, SGD with Nesterov momentum
  (``fluxpy.Nesterov``; ``torch.optim.SGD(nesterov=True)``), label smoothing 0.2, PyTorch's half type float16;
- ``vit``: ``vit_cifar()`` (4x4 patches: 64 tokens, width 192, 4 blocks of 3 heads), batch 256, AdamW;
- ``lstm``: ``lstm_classifier(32, 128)`` on sequences of 100 steps, batch 64, Adam;
- ``gpt``: a GPT-style decoder (``zoo_nets.GPT``: token and learned position embeddings, ``--gpt-layers`` pre-norm
  ``TransformerEncoderLayer`` blocks with a causal mask (gelu_erf, 4 x width hidden), a final LayerNorm, an untied
  head), 1,024 tokens, width 768, 12 heads, vocabulary 8,192, batch 8, AdamW; next-token loss;
- ``unet``, ``gru``, ``mlp``: layers no issue named (``zoo_nets.unet_cifar``: GroupNorm, swish, ConvTranspose,
  Upsample, batch 128; ``gru_classifier``, 100 steps, batch 64; ``mlp_mnist``: gelu_erf, LayerNorm, Dropout,
  batch 512, AdamW).

PyTorch runs the same network with the same weights (:func:`torch_twin`: the fluxpy model's arrays copied; fluxpy's
``Conv`` and ``DepthwiseConv`` are true convolutions, so their kernels are flipped; attention is PyTorch's
``scaled_dot_product_attention``, the GPT's blocks ``nn.TransformerEncoderLayer(norm_first=True, batch_first=True,
activation="gelu")`` called with a causal mask and ``is_causal=True``, the LSTM ``nn.LSTM`` with cuDNN); each
case prints both sides' parameter counts. The loss is the cross-entropy of the logits (with the network's label
smoothing) on a batch of standard normal inputs and uniform labels, or for the GPT of every position's logits
against the next of a sequence of uniformly drawn tokens (class indices on both sides), the same for every mode
(fixed seeds). TF32 is off on both sides; PyTorch runs with ``cudnn.benchmark``.

Modes (:data:`FLUXPY_MODES`, :data:`TORCH_MODES`):

- ``fluxpy eager``: ``TrainStep(..., capture=False)``, float32;
- ``fluxpy float32``, ``fluxpy bfloat16``, ``fluxpy float16``: ``TrainStep`` captured as a CUDA graph, the halves
  through ``fluxpy.mixed_precision(fluxpy.gpu(model), dtype)`` (float32 masters, half copies of 4-d arrays in
  channels-last memory, a dynamic loss scale for float16), README's recipe. A step that is not captured (the
  ``TrainStep`` fell back to eager) is recorded as that mode's failure, with the reason;
- ``torch eager``: float32, ``Adam(fused=True)`` / ``AdamW(fused=True)`` / ``SGD`` (foreach);
- ``torch graph``: float32, the whole step captured with ``torch.cuda.graph`` (warm-up on a side stream, a
  ``capturable=True`` optimiser), replayed after copying the batch into the graph's input;
- ``torch autocast`` and ``torch autocast graph``: the same two under ``torch.autocast`` in the network's half type
  (bfloat16, or float16 for ``vgg``), the model and a 4-d batch in ``channels_last`` memory; float16 eager uses
  ``GradScaler`` (PyTorch's recipe); float16 in a graph a static loss scale of :data:`GRAPH_LOSS_SCALE` (its
  ``GradScaler.step`` reads the host) and ``autocast(cache_enabled=False)`` (PyTorch's rule for graphs);
- ``torch compile``: ``torch.compile(model, mode=--compile)`` under the same autocast + channels-last, eager
  optimiser; its first steps run under a time limit (``--compile-timeout``), and a failure or a compile over the
  limit is recorded, not fatal. ``--compile off`` skips it (``--quick`` does).

Every mode is built and warmed up (``--warmup`` steps; a fluxpy captured mode first runs its ``TrainStep`` warm-up
and capture), then the modes' timed rounds take turns. On the GPU each PyTorch mode runs in a process of its own
(this script again, ``--modes`` naming it alone, the row handed back through a ``--json`` file), after the fluxpy
modes of the case, also where ``--modes`` names several: PyTorch's two graph modes and its eager modes in one process
stop at a device-side assert in ``nll_loss`` (labels out of range) that none of them raises alone, its two graph modes
of the ViT at an illegal memory access, and a process apiece also gives each mode its own caching allocator and cuDNN
autotuning, as a user's run has. Within a process: ``--rounds`` rounds (3 at least) of ``--steps`` steps back to
back, each round timed by wall clock from a synchronised start to a synchronised end; per-step time = round time /
steps; reported: the median and the range (lowest-highest) over rounds, in us. A mode that raises while it is built
or timed is recorded with its error's first line and left out of the rest of the case. ``--json`` (and ``--out``) is
written after every case.

The table gives, per case, each mode's step, each side's best mode and its step, the ratio best fluxpy / best
PyTorch (below 1: fluxpy faster), and fluxpy half / fluxpy float32 (its best half-precision step over its best
float32 step, eager or captured); the failures are listed under it. ``--json`` writes the rows.

Run (GPU, PyTorch): ``PYTHONPATH=. python3 benchmarks/zoo.py [--only resnet20,vit:256] [--steps 20 --rounds 5
--warmup 5] [--compile default|max-autotune-no-cudagraphs|off] [--gpt-layers 4] [--json out.json] [--out DIR]``
(``--out``: ``zoo.json`` and the table ``zoo.md`` in that folder); ``--smoke``: every case at batch 2 on the CPU,
the GPT at ``zoo_nets.GPT_SMOKE``'s tiny sizes (fluxpy's captured modes step eagerly there; PyTorch's eager and
autocast modes too where ``--sides`` has torch), one step a round, to check that everything builds and reports.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fluxpy  # noqa: E402
from fluxpy.models import parameter_count  # noqa: E402
from resnet_step import reset_case, set_tf32  # noqa: E402
from zoo_nets import GPT_SIZE, GPT_SMOKE, NETS, Net, make_case, nets, torch_twin  # noqa: E402

# ----------------------------------------------------------------------------------------------- the networks

WEIGHT_DECAY = 0.05     # AdamW's (decoupled) weight decay, both sides
NESTEROV_MOMENTUM = 0.9
GRAPH_LOSS_SCALE = 1024.0

CASES = tuple((name, batch) for name, net in NETS.items() for batch in net.batches)

FLUXPY_MODES = ("fluxpy eager", "fluxpy float32", "fluxpy bfloat16", "fluxpy float16")
TORCH_MODES = ("torch eager", "torch graph", "torch autocast", "torch autocast graph", "torch compile")
TORCH_HALF_MODES = ("torch autocast", "torch autocast graph", "torch compile")
TORCH_GRAPH_MODES = ("torch graph", "torch autocast graph")


# ----------------------------------------------------------------------------------------------- rows (pure Python)

def select_cases(only: str = "") -> list[tuple[str, int]]:
    """The cases ``--only`` names: comma-separated networks (each at all its batches) or ``NAME:BATCH``; all for "".

    >>> select_cases("resnet20,vit:64")
    [('resnet20', 128), ('resnet20', 512), ('vit', 64)]
    """
    if not only:
        return list(CASES)
    cases = []
    for token in (t.strip() for t in only.split(",")):
        if not token:
            continue
        name, _, batch = token.partition(":")
        if name not in NETS:
            raise ValueError(f"zoo: no network {name!r}; the networks are {', '.join(NETS)}")
        if batch and not (batch.isdigit() and int(batch) > 0):
            raise ValueError(f"zoo: the batch of {token!r} must be a positive int")
        cases += [(name, int(batch))] if batch else [(name, b) for b in NETS[name].batches]
    return cases


def first_line(err: BaseException) -> str:
    """``"TypeName: the first line of the message"``: how a mode's failure is recorded.

    >>> first_line(ValueError("bad dtype\\nmore detail"))
    'ValueError: bad dtype'
    """
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def mode_stats(per_step_s: list[float]) -> dict:
    """The median and range (lowest, highest) over rounds of per-step seconds, in us, and the rounds themselves.

    >>> mode_stats([0.002, 0.001, 0.003])
    {'median': 2000.0, 'min': 1000.0, 'max': 3000.0, 'rounds_us': [2000.0, 1000.0, 3000.0]}
    """
    us = [t * 1e6 for t in per_step_s]
    return dict(median=float(np.median(us)), min=min(us), max=max(us), rounds_us=[round(u, 1) for u in us])


def timed_modes(sides: dict, steps: int, rounds: int, warmup: int, clock=time.perf_counter) -> tuple[dict, dict]:
    """``({mode: per-step seconds of each round}, {mode: error})`` of each side ``{mode: (step, sync)}``: ``warmup``
    steps each, then ``rounds`` rounds taken in turn, each ``steps`` steps between two syncs. A side that raises is
    recorded with its error (:func:`first_line`) and left out from then on."""
    times, errors = {k: [] for k in sides}, {}
    for name, (step, sync) in sides.items():
        try:
            for _ in range(warmup):
                step()
            sync()
        except Exception as err:   # recorded in the row: a failing mode is a result
            errors[name] = first_line(err)
    for _ in range(rounds):
        for name, (step, sync) in sides.items():
            if name in errors:
                continue
            try:
                sync()
                t0 = clock()
                for _ in range(steps):
                    step()
                sync()
                times[name].append((clock() - t0) / steps)
            except Exception as err:
                errors[name] = first_line(err)
    return {k: v for k, v in times.items() if k not in errors}, errors


def mode_label(mode: str, half: str) -> str:
    """A mode's name as the table prints it: PyTorch's half modes name their type.

    >>> mode_label("torch autocast graph", "bfloat16"), mode_label("fluxpy float16", "bfloat16")
    ('torch autocast graph (bfloat16)', 'fluxpy float16')
    """
    return f"{mode} ({half})" if mode in TORCH_HALF_MODES else mode


def best_of(modes: dict, names) -> str | None:
    """The mode among ``names`` with the lowest median step in ``modes`` (``{mode: stats or {"error": ...}}``); None
    where none of them was measured.

    >>> best_of({"a": {"median": 5.0}, "b": {"median": 3.0}, "c": {"error": "x"}}, ["a", "b", "c"])
    'b'
    """
    measured = [n for n in names if "median" in modes.get(n, {})]
    return min(measured, key=lambda n: modes[n]["median"]) if measured else None


def finish_row(row: dict) -> dict:
    """Add to ``row`` (``model``, ``batch``, ``torch half`` and ``modes``) each side's best mode and step, the ratio of
    the bests, fluxpy's best half step over its best float32 step, the failed modes, and the pair run.py's summary
    compares (``fluxpy_us``, ``torch_us``: the best medians)."""
    modes, half = row["modes"], row["torch half"]
    for side, names in (("fluxpy", FLUXPY_MODES), ("torch", TORCH_MODES)):
        best = best_of(modes, names)
        row[f"{side} best"] = mode_label(best, half) if best else None
        row[f"{side} best us"] = _summary(modes[best]) if best else None
        row[f"{side}_us"] = modes[best]["median"] if best else None
    for key, names in (("fluxpy half", FLUXPY_MODES[2:]), ("fluxpy float32", FLUXPY_MODES[:2])):
        best = best_of(modes, names)
        row[key] = best
        row[f"{key} us"] = _summary(modes[best]) if best else None
    row["best / best"] = _ratio(row["fluxpy_us"], row["torch_us"])
    row["half / float32"] = _ratio(row["fluxpy half us"], row["fluxpy float32 us"])
    failed = [n for n in (*FLUXPY_MODES, *TORCH_MODES) if "error" in modes.get(n, {})]
    row["failed"] = ", ".join(failed) if failed else None
    return row


def _summary(stats):
    return {k: stats[k] for k in ("median", "min", "max")}


def _ratio(top, bottom):
    top = top["median"] if isinstance(top, dict) else top
    bottom = bottom["median"] if isinstance(bottom, dict) else bottom
    return top / bottom if top is not None and bottom else None


def _us(value):
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"


def cell(stats: dict | None) -> str:
    """A mode's cell: ``median (low-high)`` in us, ``failed``, ``skipped`` or ``-`` (not run).

    >>> cell({"median": 1500.0, "min": 1400.0, "max": 1650.0}), cell({"error": "E: x"}), cell(None)
    ('1,500 (1,400-1,650)', 'failed', '-')
    """
    if not stats:
        return "-"
    if "error" in stats:
        return "failed"
    if "skipped" in stats:
        return "skipped"
    return f"{_us(stats['median'])} ({_us(stats['min'])}-{_us(stats['max'])})"


def table(rows: list[dict]) -> str:
    """The markdown table of every mode of every case, then the failures, one a line."""
    modes = [m for m in (*FLUXPY_MODES, *TORCH_MODES) if any(m in r["modes"] for r in rows)]
    lines = ["| model | batch | " + " | ".join(f"{m} us" for m in modes) +
             " | fluxpy best | PyTorch best | best / best | fluxpy half / float32 |",
             "|---|---:|" + "---:|" * len(modes) + "---|---|---:|---:|"]
    for r in rows:
        ratios = [f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("best / best", "half / float32")]
        lines.append(f"| {r['model']} | {r['batch']} | " + " | ".join(cell(r["modes"].get(m)) for m in modes) +
                     f" | {r['fluxpy best'] or '-'} | {r['torch best'] or '-'} | {ratios[0]} | {ratios[1]} |")
    failures = [f"- {r['model']} {r['batch']}, {mode_label(m, r['torch half'])}: {s['error']}"
                for r in rows for m, s in r["modes"].items() if "error" in s]
    if failures:
        lines += ["", "Failures:", *failures]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- fluxpy

class NotCaptured(RuntimeError):
    """A fluxpy captured mode whose ``TrainStep`` fell back to eager steps."""


def fluxpy_rule(net: Net):
    """The network's optimiser rule in fluxpy.

    >>> fluxpy_rule(NETS["vgg"])
    Nesterov(eta=0.01, rho=0.9)
    """
    if net.optimiser == "nesterov":
        return fluxpy.Nesterov(net.lr, NESTEROV_MOMENTUM)
    if net.optimiser == "adamw":
        return fluxpy.AdamW(net.lr, lambd=WEIGHT_DECAY)
    return fluxpy.Adam(net.lr)


def fluxpy_side(net: Net, model, x, labels, mode: str, device: str):
    """``(step, first loss)`` of a fluxpy mode: a ``TrainStep`` of a copy of ``model`` (see the module docstring).
    A captured mode has run its warm-up and capture on return, and raises :class:`NotCaptured` where it fell back."""
    dtype = mode.split()[-1] if mode != "fluxpy eager" else "float32"
    m = copy.deepcopy(model)
    move = fluxpy.gpu if device == "gpu" else (lambda a: a)
    m = move(m)
    if dtype != "float32":
        m = fluxpy.mixed_precision(m, dtype)
    targets = labels if net.tokens else fluxpy.onehotbatch(labels, range(net.classes))   # next tokens: indices
    gx, gy = move(x), move(targets)
    smoothing = net.label_smoothing
    step = fluxpy.TrainStep(lambda m, x, y: fluxpy.logitcrossentropy(m(x), y, label_smoothing=smoothing), m,
                            fluxpy.setup(fluxpy_rule(net), m), capture=mode != "fluxpy eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fluxpy.CaptureWarning)   # the reason is recorded below
        first = float(step(gx, gy))
        for _ in range(step.warmup):   # the rest of the warm-up, then the capture
            step(gx, gy)
    if step.capture and device == "gpu":
        reasons = [why for why in step.captured().values() if why != "captured"]
        if reasons:
            raise NotCaptured(f"not captured ({reasons[0].splitlines()[0]})")
    return (lambda: step(gx, gy)), first


def fluxpy_sync(device: str):
    if device != "gpu":
        return lambda: None
    import cupy
    return cupy.cuda.runtime.deviceSynchronize


# ----------------------------------------------------------------------------------------------- PyTorch

def torch_optimiser(torch, net: Net, params, graph: bool, cuda: bool):
    """The network's optimiser in PyTorch: ``capturable=True`` for a graph, else the fused one on the GPU (SGD: the
    default, foreach, in both)."""
    if net.optimiser == "nesterov":
        return torch.optim.SGD(params, lr=net.lr, momentum=NESTEROV_MOMENTUM, nesterov=True)
    kw = dict(lr=net.lr)
    if net.optimiser == "adamw":
        kw["weight_decay"] = WEIGHT_DECAY
    if graph:
        kw["capturable"] = True
    elif cuda:
        kw["fused"] = True
    return (torch.optim.AdamW if net.optimiser == "adamw" else torch.optim.Adam)(params, **kw)


def torch_side(torch, net: Net, model, x, labels, mode: str, device: str, compile_mode: str = "default"):
    """``(step, first loss)`` of a PyTorch mode on a twin of ``model`` (see the module docstring)."""
    dev = "cuda" if device == "gpu" else "cpu"
    dtype = getattr(torch, net.half) if mode in TORCH_HALF_MODES else None
    twin = torch_twin(torch, model).train().to(dev)
    tx, ty = torch.from_numpy(x).to(dev), torch.from_numpy(labels).to(dev)
    if dtype is not None and tx.dim() == 4:
        twin = twin.to(memory_format=torch.channels_last)
        tx = tx.contiguous(memory_format=torch.channels_last)
    if mode == "torch compile":
        twin = torch.compile(twin, mode=compile_mode)
    smoothing = net.label_smoothing

    def loss_fn(logits, y):   # a GPT's (N, L, vocab) logits: one row a position
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten(), label_smoothing=smoothing)
    if mode in TORCH_GRAPH_MODES:
        return _torch_graph_step(torch, net, twin, tx, ty, dtype, loss_fn)
    return _torch_eager_step(torch, net, twin, tx, ty, dtype, loss_fn, dev)


def _torch_eager_step(torch, net, twin, tx, ty, dtype, loss_fn, dev):
    opt = torch_optimiser(torch, net, twin.parameters(), graph=False, cuda=dev == "cuda")
    scaler = torch.amp.GradScaler(dev, enabled=dtype is torch.float16)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(twin(tx), ty)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()
    return step, float(step())


def _torch_graph_step(torch, net, twin, tx, ty, dtype, loss_fn, warmup=3):
    """PyTorch's whole step captured with ``torch.cuda.graph`` (its documented recipe), replayed per step after the
    batch is copied into the graph's input."""
    params = list(twin.parameters())
    opt = torch_optimiser(torch, net, params, graph=True, cuda=True)
    static_x, static_y = tx.clone(), ty.clone()
    scale = GRAPH_LOSS_SCALE if dtype is torch.float16 else None

    def body():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None, cache_enabled=False):
            loss = loss_fn(twin(static_x), static_y)
        if scale is None:
            loss.backward()
        else:
            (loss * scale).backward()
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], 1.0 / scale)
        opt.step()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    first = None
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.zero_grad(set_to_none=True)
            loss = body()
            first = float(loss) if first is None else first
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = body()

    def step():
        static_x.copy_(tx)
        static_y.copy_(ty)
        graph.replay()
        return static_loss
    return step, first


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Raise ``TimeoutError`` in the block after ``seconds`` (SIGALRM; the main thread, POSIX): a ``torch.compile``
    that takes too long is recorded as a failure, not waited for."""
    def expire(signum, frame):
        raise TimeoutError(f"{what} took more than {seconds:g} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ----------------------------------------------------------------------------------------------- a case

def skipped_modes(sides: str, device: str, compile_mode: str, only_modes: tuple[str, ...] = ()) -> dict:
    """``{mode: {"skipped": why}}`` of the modes this run leaves out on purpose (``only_modes``: ``--modes``).

    >>> sorted(skipped_modes("fluxpy,torch", "gpu", "off"))
    ['torch compile']
    >>> sorted(skipped_modes("fluxpy,torch", "gpu", "off", ("torch graph",))) == sorted(
    ...     set(FLUXPY_MODES + TORCH_MODES) - {"torch graph"})
    True
    """
    skipped = {}
    if only_modes:
        skipped.update({m: dict(skipped="not in --modes") for m in (*FLUXPY_MODES, *TORCH_MODES)
                        if m not in only_modes})
    if "torch" not in sides:
        skipped.update({m: dict(skipped="--sides has no torch") for m in TORCH_MODES})
    elif device != "gpu":
        skipped.update({m: dict(skipped="needs CUDA") for m in (*TORCH_GRAPH_MODES, "torch compile")})
    elif compile_mode == "off":
        skipped["torch compile"] = dict(skipped="--compile off")
    if "fluxpy" not in sides:
        skipped.update({m: dict(skipped="--sides has no fluxpy") for m in FLUXPY_MODES})
    return skipped


def build_sides(torch, net, model, x, labels, a, modes: dict, firsts: dict) -> dict:
    """``{mode: (step, sync)}`` of every mode not skipped in ``modes``; a mode that fails to build is recorded in
    ``modes`` as its error."""
    sides = {}
    for mode in (*FLUXPY_MODES, *TORCH_MODES):
        if mode in modes:
            continue
        try:
            if mode.startswith("fluxpy"):
                step, first = fluxpy_side(net, model, x, labels, mode, a.device)
                sync = fluxpy_sync(a.device)
            elif mode == "torch compile":
                with time_limit(a.compile_timeout, f"torch.compile(mode={a.compile!r}) and its first steps"):
                    step, first = torch_side(torch, net, model, x, labels, mode, a.device, a.compile)
                    for _ in range(a.warmup):   # recompiles, if any, count here
                        step()
                sync = torch.cuda.synchronize
            else:
                step, first = torch_side(torch, net, model, x, labels, mode, a.device)
                sync = torch.cuda.synchronize if a.device == "gpu" else (lambda: None)
        except Exception as err:   # recorded in the row: a failing mode is a result
            modes[mode] = dict(error=first_line(err))
            if mode == "torch compile":
                torch._dynamo.reset()
            continue
        sides[mode], firsts[mode] = (step, sync), first
    return sides


def torch_modes_apart(name: str, batch: int, a, modes: dict, firsts: dict) -> None:
    """Run each PyTorch mode of the case not yet in ``modes`` in a process of its own (this script, ``--modes``
    naming it) and record its stats, or its error, in ``modes`` and its first loss in ``firsts``."""
    for mode in TORCH_MODES:
        if mode in modes:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--only", f"{name}:{batch}", "--modes", mode,
                   "--steps", str(a.steps), "--rounds", str(a.rounds), "--warmup", str(a.warmup),
                   "--compile", a.compile, "--compile-timeout", str(a.compile_timeout), "--device", a.device,
                   "--gpt-layers", str(a.gpt_layers), "--json", str(out)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(),
                                      timeout=a.compile_timeout + 600)
                rows = json.loads(out.read_text()) if out.exists() else []
            except subprocess.TimeoutExpired:
                modes[mode] = dict(error=f"TimeoutExpired: its process ran past {a.compile_timeout + 600:g} s")
                continue
        if rows:
            modes[mode] = rows[0]["modes"][mode]
            firsts.update({k: v for k, v in rows[0]["first_losses"].items() if k == mode})
        else:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            modes[mode] = dict(error=f"its process exited with {done.returncode}: {tail}")


def parameter_counts(torch, model, sides: str) -> dict:
    """``{"fluxpy": n, "torch": m}``: the trainable parameters of ``model`` and of its PyTorch twin (where ``sides``
    has torch; the LSTM's twin has PyTorch's second bias)."""
    counts = dict(fluxpy=parameter_count(model))
    if torch is not None and "torch" in sides:
        counts["torch"] = sum(p.numel() for p in torch_twin(torch, model).parameters())
    return counts


def run_case(torch, name: str, batch: int, a) -> dict:
    net, model, x, labels = make_case(name, batch, nets=a.nets)
    counts = parameter_counts(torch, model, a.sides)
    reset_case(torch, a.device)
    modes = skipped_modes(a.sides, a.device, a.compile, a.modes)
    apart = a.device == "gpu" and len(a.modes) != 1   # PyTorch's modes each in a child (which names one)
    if apart:
        pending = {m: dict(skipped="apart") for m in TORCH_MODES if m not in modes}
        modes.update(pending)
    firsts = {}
    sides = build_sides(torch, net, model, x, labels, a, modes, firsts)
    times, errors = timed_modes(sides, a.steps, a.rounds, a.warmup)
    modes.update({k: dict(error=e) for k, e in errors.items()})
    modes.update({k: mode_stats(t) for k, t in times.items()})
    if apart:
        for m in pending:
            del modes[m]
        torch_modes_apart(name, batch, a, modes, firsts)
    row = dict(benchmark="zoo", model=name, batch=batch, optimiser=net.optimiser, device=a.device,
               modes={m: modes[m] for m in (*FLUXPY_MODES, *TORCH_MODES) if m in modes},
               first_losses=firsts, parameters=counts, **{"torch half": net.half})
    print(f"{name} batch {batch}: parameters " + ", ".join(f"{k} {v:,}" for k, v in counts.items()), flush=True)
    print(f"{name} batch {batch}: first losses " + ", ".join(f"{k} {v:.5f}" for k, v in firsts.items()), flush=True)
    return finish_row(row)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated networks or NAME:BATCH among " + ", ".join(NETS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", default="default",
                   help="torch.compile's mode (default, max-autotune-no-cudagraphs, ...) or off")
    p.add_argument("--compile-timeout", type=float, default=180.0, help="seconds for a compile and its first steps")
    p.add_argument("--sides", default="fluxpy,torch", help="fluxpy, torch or both")
    p.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    p.add_argument("--modes", default="", help="comma-separated modes to run (the rest skipped): " +
                   ", ".join((*FLUXPY_MODES, *TORCH_MODES)))
    p.add_argument("--smoke", action="store_true", help="batch 2 on the CPU, one step a round")
    p.add_argument("--gpt-layers", type=int, default=None,
                   help=f"the GPT's blocks ({GPT_SIZE.layers}; {GPT_SMOKE.layers} with --smoke)")
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="a folder for zoo.json and the table, zoo.md")
    a = p.parse_args(argv)
    if a.rounds < 3:
        p.error("--rounds must be 3 or more (the median and range over rounds)")
    if a.gpt_layers is not None and a.gpt_layers < 1:
        p.error(f"--gpt-layers must be 1 or more, got {a.gpt_layers}")
    a.modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
    unknown = [m for m in a.modes if m not in (*FLUXPY_MODES, *TORCH_MODES)]
    if unknown:
        p.error(f"--modes: unknown {unknown}; the modes are {', '.join((*FLUXPY_MODES, *TORCH_MODES))}")
    cases = select_cases(a.only)
    if a.smoke:
        a.device, a.steps, a.rounds, a.warmup, a.compile = "cpu", 1, 3, 1, "off"
        cases = list(dict.fromkeys((name, 2) for name, _ in cases))
    size = GPT_SMOKE if a.smoke else GPT_SIZE
    a.gpt_layers = a.gpt_layers or size.layers
    a.nets = nets(dataclasses.replace(size, layers=a.gpt_layers))
    torch = None
    if "torch" in a.sides:
        import torch
        if a.device == "gpu":
            torch.backends.cudnn.benchmark = True
        print(f"PyTorch {torch.__version__}" + (f", {torch.cuda.get_device_name()}" if a.device == "gpu" else ""))
    set_tf32(False, torch, a.device)
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, batch in cases:
        rows.append(run_case(torch, name, batch, a))
        # after every case: a crash in a later one (a fault in a native library) keeps these
        for path in (a.json, out and out / "zoo.json"):
            if path:
                Path(path).write_text(json.dumps(rows, indent=1))
    text = table(rows)
    if out:
        (out / "zoo.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
