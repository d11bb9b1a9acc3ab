"""fluxpy's hand-written cuDNN binding against NVIDIA's ``nvidia-cudnn-frontend`` (the ``cudnn`` Python module), on
the same GPU, the same cuDNN library and the same convolutions (issue 35, item 8).

The problems: ``benchmarks/conv.py``'s default layers (MNIST, and the ResNet-50 layers at batch 8 and 256), float32,
NCHW, cross-correlation, TF32 off on both sides; and the 21 convolutions of one ResNet-20 training step at batch 128
(``fluxpy.models.resnet20``: every forward, every data gradient but the stem's, every filter gradient). Ops:

- ``fwd``: the convolution alone; ``fwd_bias_relu``: conv -> bias add -> relu in one graph;
- ``bwd_data`` / ``bwd_filter``: the data / filter gradient.

Sides. fluxpy: :mod:`fluxpy.kernels.cudnn.graph`'s entry points (``conv_forward``, ``conv_bias_act_forward``,
``conv_backward_data``, ``conv_backward_filter``: the cached plan's variant pack and one ``cudnnBackendExecute``
through ctypes). frontend: :class:`Frontend` below, the same calls written on ``cudnn.pygraph`` (what fluxpy's code
would be with the frontend): a graph per problem built once (``conv_fprop`` / ``bias`` / ``relu`` /
``conv_dgrad`` / ``conv_wgrad``), then per call the output from CuPy's pool, the workspace from CuPy's pool, and
``graph.execute`` on plain int pointers on CuPy's current stream. Both filter out TF32 (tensor-core) and
down-converting engines for float32, as fluxpy's option ``allow_tf32=False`` does.

Measured per problem, op and side (``--reps`` repeats, median and range):

- ``eager``: host microseconds per call (wall time of ``n`` back-to-back calls queued behind a long GPU matmul, so
  the host never waits on the GPU), and GPU microseconds per call (CUDA events around the same ``n`` calls, which the
  GPU runs back to back because they were all queued before it reached them);
- ``exec``: the host cost of the binding alone, buffers allocated once: fluxpy's ``GraphPlan.execute`` (the
  workspace from the pool, the variant pack from its cache, ``cudnnBackendExecute``), the frontend's
  ``execute`` with the workspace from the pool, ordered (``tensor_uids``) and by a ``{uid: pointer}`` dict;
- ``build``: milliseconds of the first call of a new problem (graph, heuristics, plan; with ``--tune`` the candidates
  timed too), synchronised;
- ``capture``: whether a call runs inside a CuPy graph capture (``fluxpy.backend.capture_graph``) and its replay
  gives the eager result;
- the ResNet-20 step: the 62 convolution calls of one step, back to back (host and GPU microseconds per step), and
  captured as one graph (replay GPU time).

Plans: ``--tune 0`` (default) takes the first engine configuration of cuDNN's heuristics that finalizes on both
sides (fluxpy ``set_autotune(0)``); ``--tune 8`` times up to 8 finalized candidates once and keeps the fastest on
both sides (fluxpy ``set_autotune(8)`` with ``set_search(0)``; its disk cache is off either way). ``--deadline``
seconds bound the run: sections left when it passes are reported as not run.

Run on the GPU: ``python3 benchmarks/cudnn_frontend.py [--quick] [--tune 0] [--out DIR]``; needs CuPy, the
``nvidia-cudnn-frontend`` wheel and fluxpy's cuDNN (``nvidia-cudnn-cu13``).
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from conv import layers as conv_layers  # noqa: E402

OPS = ("fwd", "fwd_bias_relu", "bwd_data", "bwd_filter")
GRAPH_KIND = {"fwd": "fwd", "fwd_bias_relu": "fwd_relu", "bwd_data": "bwd_data", "bwd_filter": "bwd_filter"}


def resnet20_convs(batch):
    """``(name, x_shape, w_shape, stride, pad)`` of every convolution of ResNet-20 (stem, three stages of three basic
    blocks of 16, 32, 64 channels, projection shortcuts where a stage starts with stride 2)."""
    out = [("stem", (batch, 3, 32, 32), (16, 3, 3, 3), 1, 1)]
    cin, size = 16, 32
    for width, stride in ((16, 1), (32, 2), (64, 2)):
        for block in range(3):
            s = stride if block == 0 else 1
            out.append((f"{width} b{block} conv1", (batch, cin, size, size), (width, cin, 3, 3), s, 1))
            if s != 1 or cin != width:
                out.append((f"{width} b{block} proj", (batch, cin, size, size), (width, cin, 1, 1), s, 0))
            size //= s
            out.append((f"{width} b{block} conv2", (batch, width, size, size), (width, width, 3, 3), 1, 1))
            cin = width
    return out


# ----------------------------------------------------------------------------------------------- the two sides

class Problem:
    """One convolution's arrays (random on the GPU, float32; ``rng`` a ``cupy.random.RandomState``) and geometry."""

    def __init__(self, cp, rng, x_shape, w_shape, stride, pad):
        from fluxpy.ops.dims import ConvDims
        self.cd = ConvDims.from_shapes(x_shape, w_shape, stride=stride, pad=pad, flipped=True)
        fan = int(np.prod(w_shape[1:]))
        self.x = rng.standard_normal(x_shape, dtype=np.float32)
        self.w = rng.standard_normal(w_shape, dtype=np.float32) / np.float32(np.sqrt(fan))
        self.b = rng.standard_normal(w_shape[0], dtype=np.float32) * np.float32(0.1)
        self.dy = rng.standard_normal(self.cd.y_shape, dtype=np.float32)


class Fluxpy:
    """fluxpy's binding: the graph path's entry points (:mod:`fluxpy.kernels.cudnn.graph`)."""

    name = "fluxpy"

    def __init__(self, tune):
        from fluxpy.kernels import cudnn
        from fluxpy.kernels.cudnn import graph
        from fluxpy.options import options
        self.graph, self.handle = graph, cudnn.handle
        options.set(allow_tf32=False, disk_cache=False, autotune=tune, search_budget_ms=0)

    def call(self, op, p):
        g, cd = self.graph, p.cd
        if op == "fwd":
            return g.conv_forward(p.x, p.w, cd)
        if op == "fwd_bias_relu":
            return g.conv_bias_act_forward(p.x, p.w, p.b, "relu", cd)
        if op == "bwd_data":
            return g.conv_backward_data(p.dy, p.w, cd)
        return g.conv_backward_filter(p.x, p.dy, cd)

    def bare(self, op, p):
        """``(calls, why)``: dict of zero-argument calls of the cached plan's execute on buffers made once, or None
        and why (the legacy path kept the problem)."""
        g, kind = self.graph, GRAPH_KIND[op]
        plans = [q for q in g._plans.values() if q is not None and q.kind == kind and q.cdims == p.cd]
        if not plans:
            return None, "no cached graph plan (the legacy path runs it)"
        q = plans[-1]
        if op == "fwd":
            got = g._fwd_bufs(q, p.x, p.w, None, q.dtype)
        elif op == "fwd_bias_relu":
            got = g._fwd_bufs(q, p.x, p.w, p.b, q.dtype)
        elif op == "bwd_data":
            got = g._bwd_data_bufs(q, p.dy, p.w, q.dtype)
        else:
            got = g._bwd_filter_bufs(q, p.x, p.dy, q.dtype)
        ptrs, get_handle = got[0], self.handle.get_handle

        def run():
            q.execute(get_handle(), ptrs)
        run.keep = got
        return {"exec": run}, ""

    def forget(self):
        self.graph.clear_cache()


class Frontend:
    """The same calls through ``nvidia-cudnn-frontend``: what fluxpy's cuDNN code would be with it (one graph per
    problem, built once, cached; per call: output and workspace from CuPy's pool, one ``execute`` on int pointers on
    CuPy's current stream)."""

    name = "frontend"

    def __init__(self, cudnn, cp, tune):
        from fluxpy.kernels.cudnn.geometry import aligned, contiguous
        self.cudnn, self.cp, self.tune = cudnn, cp, tune
        self.ready = lambda a: aligned(contiguous(a, a.dtype))
        self.handle = cudnn.create_handle()
        self.plans = {}

    def call(self, op, p):
        cd, ready, cp = p.cd, self.ready, self.cp
        if op in ("fwd", "fwd_bias_relu"):
            x, w = ready(p.x), ready(p.w)
            out = cp.empty(cd.y_shape, np.float32)
            ptrs = (x.data.ptr, w.data.ptr) + ((ready(p.b).data.ptr,) if op == "fwd_bias_relu" else ())
        elif op == "bwd_data":
            dy, w = ready(p.dy), ready(p.w)
            out = cp.empty(cd.x_shape, np.float32)
            ptrs = (dy.data.ptr, w.data.ptr)
        else:
            x, dy = ready(p.x), ready(p.dy)
            out = cp.empty(cd.w_shape, np.float32)
            ptrs = (x.data.ptr, dy.data.ptr)
        plan = self.plan(op, cd, (ptrs + (out.data.ptr,)))
        self.execute(plan, ptrs + (out.data.ptr,))
        return out

    def execute(self, plan, ptrs, ordered=True):
        g, uids, ws_size = plan
        self.cudnn.set_stream(self.handle, self.cp.cuda.get_current_stream().ptr)
        ws = self.cp.cuda.alloc(ws_size) if ws_size else None
        ws_ptr = ws.ptr if ws is not None else 0
        if ordered:
            g.execute(ptrs, ws_ptr, handle=self.handle, tensor_uids=uids)
        else:
            g.execute(dict(zip(uids, ptrs)), ws_ptr, handle=self.handle)

    def plan(self, op, cd, ptrs):
        key = (op, cd, self.cp.cuda.runtime.getDevice())
        got = self.plans.get(key)
        if got is None:
            got = self.plans[key] = self.build(op, cd, ptrs)
        return got

    def build(self, op, cd, ptrs):
        """``(graph, uids, workspace bytes)`` of a new problem: the graph, cuDNN's heuristics (mode A, then
        fallback) without TF32 or down-converting engines, the first plan that finalizes (``tune``: the fastest of
        up to ``tune`` of them, each timed on the call's buffers)."""
        cudnn = self.cudnn
        f32 = cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)

        def tensor(name, shape):
            return g.tensor(name=name, dim=list(shape), stride=_row_major(shape), data_type=f32)

        if cd.pad[0::2] != cd.pad[1::2]:
            raise ValueError(f"Frontend: symmetric padding only, got {cd.pad}")
        geo = dict(padding=list(cd.pad[0::2]), stride=list(cd.stride), dilation=list(cd.dilation),
                   compute_data_type=f32)
        if op in ("fwd", "fwd_bias_relu"):
            ins = [tensor("x", cd.x_shape), tensor("w", cd.w_shape)]
            out = g.conv_fprop(ins[0], ins[1], name="conv", **geo)
            if op == "fwd_bias_relu":
                ins.append(tensor("b", (1, cd.w_shape[0], 1, 1)))
                out = g.relu(g.bias(out, ins[2], name="bias"), name="relu")
        elif op == "bwd_data":
            ins = [tensor("dy", cd.y_shape), tensor("w", cd.w_shape)]
            out = g.conv_dgrad(ins[0], ins[1], name="dgrad", out_dims=list(cd.x_shape), **geo)
        else:
            ins = [tensor("x", cd.x_shape), tensor("dy", cd.y_shape)]
            out = g.conv_wgrad(ins[0], ins[1], name="wgrad", out_dims=list(cd.w_shape), **geo)
        # The output's strides are set, not left to the frontend: it would write convolution outputs channels-last.
        shape = {"bwd_data": cd.x_shape, "bwd_filter": cd.w_shape}.get(op, cd.y_shape)
        out.set_output(True).set_data_type(f32).set_dim(list(shape)).set_stride(_row_major(shape))
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        notes = [getattr(cudnn.numerical_note, n) for n in ("TENSOR_CORE", "DOWN_CONVERT_INPUTS")
                 if hasattr(cudnn.numerical_note, n)]
        g.deselect_numeric_notes(notes)
        g.check_support()
        uids = tuple(t.uid for t in ins + [out])
        if not self.tune:
            g.build_plans()
            return g, uids, g.get_workspace_size()
        g.build_plans(cudnn.build_plan_policy.ALL)
        return self.tuned(g, uids, ptrs)

    def tuned(self, g, uids, ptrs):
        """Time up to ``tune`` plans that run (one warm call, then 5 under events) and select the fastest."""
        cp, found = self.cp, []
        self.cudnn.set_stream(self.handle, cp.cuda.get_current_stream().ptr)
        for i in range(len(g.plans)):
            if len(found) >= self.tune:
                break
            try:
                ws_size = g.get_workspace_size_plan_at_index(i)
                ws = cp.cuda.alloc(ws_size) if ws_size else None
                pack = dict(zip(uids, ptrs))

                def run(i=i, ws=ws, pack=pack):
                    g.execute_plan_at_index(pack, ws.ptr if ws is not None else 0, index=i, handle=self.handle)
                run()
                found.append((events_ms(cp, run, 5), i, ws_size))
            except Exception:   # a plan that does not build or run is not a candidate
                continue
        if not found:
            raise RuntimeError("Frontend: no plan runs")
        _, best, ws_size = min(found)
        g.build_plan_at_index(best)
        return g, uids, ws_size

    def bare(self, op, p):
        out = self.call(op, p)   # builds the plan; its buffers are the bare calls' buffers
        cd = p.cd
        ins = {"fwd": (p.x, p.w), "fwd_bias_relu": (p.x, p.w, p.b), "bwd_data": (p.dy, p.w),
               "bwd_filter": (p.x, p.dy)}[op]
        ptrs = tuple(a.data.ptr for a in ins) + (out.data.ptr,)
        plan = self.plans[(op, cd, self.cp.cuda.runtime.getDevice())]
        calls = {"exec": lambda: self.execute(plan, ptrs, True), "exec_dict": lambda: self.execute(plan, ptrs, False)}
        calls["exec"].keep = calls["exec_dict"].keep = (ins, out)
        return calls, ""

    def forget(self):
        self.plans.clear()


def _row_major(shape):
    return [int(np.prod(shape[i + 1:])) for i in range(len(shape))]


# ----------------------------------------------------------------------------------------------- timing

def events_ms(cp, run, n):
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(n):
        run()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / n


class Busy:
    """Keeps the GPU busy for a given time by queueing float32 matmuls, so that the calls timed after it are all
    queued before the GPU reaches them."""

    def __init__(self, cp):
        self.cp = cp
        rng = np.random.default_rng(1)
        self.a = cp.asarray(rng.standard_normal((4096, 4096), dtype=np.float32))
        self.b = cp.asarray(rng.standard_normal((4096, 4096), dtype=np.float32))
        self.out = cp.empty_like(self.a)
        for _ in range(3):
            cp.matmul(self.a, self.b, out=self.out)
        self.ms = events_ms(cp, lambda: cp.matmul(self.a, self.b, out=self.out), 10)

    def __call__(self, ms):
        for _ in range(max(1, math.ceil(ms / self.ms))):
            self.cp.matmul(self.a, self.b, out=self.out)


def timed(cp, busy, run, n, reps):
    """``(host us per call, GPU us per call, repeats where the GPU caught up)`` lists over ``reps`` repeats of ``n``
    back-to-back calls of ``run`` queued behind ``busy``."""
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    cp.cuda.Device().synchronize()
    bound_ms = (time.perf_counter() - t0) * 1e3   # host + GPU of n calls: more than the host's part
    host, gpu, caught = [], [], 0
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(reps):
        busy(1.5 * bound_ms + 1.0)
        start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            run()
        t1 = time.perf_counter()
        end.record()
        caught += bool(start.done)   # the GPU reached the calls before they were all queued: GPU time has gaps
        end.synchronize()
        host.append((t1 - t0) * 1e6 / n)
        gpu.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / n)
    return host, gpu, caught


def calls_for(cp, run, target_ms=15.0):
    """How many calls make about ``target_ms`` of wall time (10 to 200)."""
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    run()
    cp.cuda.Device().synchronize()
    one = max((time.perf_counter() - t0) * 1e3, 1e-3)
    return int(max(10, min(200, target_ms / one)))


def stat(values):
    return dict(median=statistics.median(values), lo=min(values), hi=max(values))


def fmt(s, spec=".1f"):
    return "-" if s is None else f"{s['median']:{spec}} [{s['lo']:{spec}}, {s['hi']:{spec}}]"


def rel_err(cp, a, ref):
    return float(cp.abs(a - ref).max() / (cp.abs(ref).max() + 1e-30))


# ----------------------------------------------------------------------------------------------- sections

def first_call_ms(cp, side, op, p):
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    out = side.call(op, p)
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) * 1e3, out


def bench_problem(cp, busy, sides, name, p, reps, log):
    """Rows of one problem: per op, build ms, correctness, eager host/GPU, bare exec host per side."""
    rows = []
    for op in OPS:
        row = dict(layer=name, op=op, x=p.cd.x_shape, w=p.cd.w_shape, stride=p.cd.stride[0], pad=p.cd.pad[0])
        outs = {}
        for side in sides:
            try:
                ms, outs[side.name] = first_call_ms(cp, side, op, p)
                row[f"{side.name}_build_ms"] = ms
                run = (lambda side=side: side.call(op, p))
                n = calls_for(cp, run)
                host, gpu, caught = timed(cp, busy, run, n, reps)
                row.update({f"{side.name}_host": stat(host), f"{side.name}_gpu": stat(gpu), f"{side.name}_n": n,
                            f"{side.name}_caught": caught})
                calls, why = side.bare(op, p)
                for label, c in (calls or {}).items():
                    h, _, _ = timed(cp, busy, c, n, reps)
                    row[f"{side.name}_{label}"] = stat(h)
                if why:
                    row[f"{side.name}_note"] = why
            except Exception as err:   # one side failing one problem is a result, not the end of the run
                row[f"{side.name}_error"] = f"{type(err).__name__}: {err}"
                log(f"  {name} {op} {side.name}: {row[f'{side.name}_error']}")
        if len(outs) == 2:
            row["rel_err"] = rel_err(cp, outs["frontend"], outs["fluxpy"])
        rows.append(row)
        log(f"  {name} {op}: " + ", ".join(f"{s.name} host {fmt(row.get(s.name + '_host'))} us gpu "
                                           f"{fmt(row.get(s.name + '_gpu'))} us build "
                                           f"{row.get(s.name + '_build_ms', float('nan')):.1f} ms" for s in sides)
            + f", rel err {row.get('rel_err', float('nan')):.1e}")
    return rows


def capture_check(cp, side, op, p):
    """``(ok, detail)``: the call captured into a CUDA graph (after an eager call on the same problem) and replayed
    gives the eager result."""
    from fluxpy.backend import capture_graph
    ref = side.call(op, p)
    try:
        graph, out = capture_graph(lambda: side.call(op, p))
        out.fill(float("nan"))   # the replay must write every element
        graph.launch()
        cp.cuda.Device().synchronize()
        err = rel_err(cp, out, ref)
        return bool(err < 1e-5), f"replay rel err {err:.1e}"
    except Exception as err:
        return False, f"{type(err).__name__}: {str(err)[:200]}"


def step_calls(side, probs):
    """The 62 conv calls of one ResNet-20 step: every forward, then backward in reverse order (no stem dgrad)."""
    def step():
        for p in probs:
            side.call("fwd", p)
        for i, p in reversed(list(enumerate(probs))):
            if i:
                side.call("bwd_data", p)
            side.call("bwd_filter", p)
    return step


def bench_step(cp, busy, sides, probs, reps, log):
    out = {}
    for side in sides:
        step = step_calls(side, probs)
        try:
            t0 = time.perf_counter()
            step()
            cp.cuda.Device().synchronize()
            first = (time.perf_counter() - t0) * 1e3
            step()
            host, gpu, caught = timed(cp, busy, step, 3, reps)
            r = dict(first_step_ms=first, host=stat(host), gpu=stat(gpu), caught=caught)
            from fluxpy.backend import capture_graph
            graph, _ = capture_graph(step)
            replay_ms = [events_ms(cp, graph.launch, 10) for _ in range(reps)]
            r.update(captured=True, replay_gpu=stat([m * 1e3 for m in replay_ms]))
        except Exception as err:
            r = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
        out[side.name] = r
        log(f"  resnet20 step {side.name}: {r}")
    return out


# ----------------------------------------------------------------------------------------------- report

def lines_of_code():
    """Lines of fluxpy's cuDNN package per file, and of :class:`Frontend` (this file)."""
    out = {}
    for f in sorted((ROOT / "fluxpy" / "kernels" / "cudnn").glob("*.py")):
        out[f.name] = len(f.read_text().splitlines())
    out["Frontend (this benchmark)"] = len(inspect.getsource(Frontend).splitlines())
    return out


def geo_ratio(rows, key, op):
    """Geometric mean over rows of ``frontend / fluxpy`` medians of ``key`` for ``op``."""
    r = [row[f"frontend_{key}"]["median"] / row[f"fluxpy_{key}"]["median"] for row in rows
         if row["op"] == op and f"frontend_{key}" in row and f"fluxpy_{key}" in row]
    return (math.exp(sum(map(math.log, r)) / len(r)), min(r), max(r), len(r)) if r else None


def med_of(rows, key, op):
    v = [row[key]["median"] if isinstance(row.get(key), dict) else row.get(key) for row in rows if row["op"] == op]
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else None


def summary(rows, caps, step, gpu_name, tune):
    out = [f"## cuDNN frontend vs fluxpy's binding, {gpu_name}, tune={tune}, float32 TF32 off",
           "",
           "Per op over the conv.py layers: median over layers of each side's per-layer median; ratio = frontend / "
           "fluxpy, geometric mean [min, max] over layers.",
           "",
           "| op | layers | host us eager fluxpy / frontend | ratio | host us exec fluxpy / frontend (ordered, dict) "
           "| ratio | GPU us ratio | build ms fluxpy / frontend | capture fluxpy / frontend |",
           "|---|---:|---|---|---|---|---|---|---|"]
    for op in OPS:
        def r(key):
            g = geo_ratio(rows, key, op)
            return "-" if g is None else f"{g[0]:.2f} [{g[1]:.2f}, {g[2]:.2f}]"

        def m(key, spec=".1f"):
            v = med_of(rows, key, op)
            return "-" if v is None else f"{v:{spec}}"
        hx = [row for row in rows if row["op"] == op and "fluxpy_exec" in row and "frontend_exec" in row]
        ex = [row["frontend_exec"]["median"] / row["fluxpy_exec"]["median"] for row in hx]
        exr = "-" if not ex else f"{math.exp(sum(map(math.log, ex)) / len(ex)):.2f} [{min(ex):.2f}, {max(ex):.2f}]"
        cap = caps.get(op, {})
        out.append(f"| {op} | {sum(row['op'] == op for row in rows)} | {m('fluxpy_host')} / {m('frontend_host')} | "
                   f"{r('host')} | {m('fluxpy_exec')} / {m('frontend_exec')}, {m('frontend_exec_dict')} | {exr} | "
                   f"{r('gpu')} | {m('fluxpy_build_ms')} / {m('frontend_build_ms')} | "
                   f"{cap.get('fluxpy', '-')} / {cap.get('frontend', '-')} |")
    if step:
        out += ["", "ResNet-20 step at batch 128, its 62 conv calls (us per step, median [min, max]):", "",
                "| side | host | GPU | GPU while the host queued (caught up) | first step ms | captured replay GPU |",
                "|---|---|---|---|---|---|"]
        for name, r in step.items():
            if "error" in r:
                out.append(f"| {name} | error: {r['error']} | | | | |")
            else:
                out.append(f"| {name} | {fmt(r['host'], '.0f')} | {fmt(r['gpu'], '.0f')} | {r['caught']} | "
                           f"{r['first_step_ms']:.0f} | {fmt(r.get('replay_gpu'), '.0f')} |")
    return "\n".join(out)


def layer_table(rows):
    out = ["| layer | op | host us fluxpy | host us frontend | exec us fluxpy | exec us frontend (ordered / dict) | "
           "GPU us fluxpy | GPU us frontend | build ms fluxpy / frontend | rel err | notes |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        notes = "; ".join(f"{k}: {r[k]}" for k in r if k.endswith(("_error", "_note")) or k.endswith("_caught") and r[k])
        out.append(f"| {r['layer']} | {r['op']} | {fmt(r.get('fluxpy_host'))} | {fmt(r.get('frontend_host'))} | "
                   f"{fmt(r.get('fluxpy_exec'))} | {fmt(r.get('frontend_exec'))} / {fmt(r.get('frontend_exec_dict'))} "
                   f"| {fmt(r.get('fluxpy_gpu'))} | {fmt(r.get('frontend_gpu'))} | "
                   f"{r.get('fluxpy_build_ms', float('nan')):.1f} / {r.get('frontend_build_ms', float('nan')):.1f} | "
                   f"{r.get('rel_err', float('nan')):.1e} | {notes} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------- main

def reference(op, p, flip=False):
    """The float64 result of ``op`` on ``p`` on the host (cross-correlation, NumPy; ``flip``: true convolution)."""
    from numpy.lib.stride_tricks import sliding_window_view
    x, w, b, dy = (a.get().astype(np.float64) for a in (p.x, p.w, p.b, p.dy))
    if flip:
        w = w[:, :, ::-1, ::-1]
        if op == "bwd_filter":
            return reference(op, p)[:, :, ::-1, ::-1]
    (s, _), (pt, pb, pl, pr) = p.cd.stride, p.cd.pad
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    r, t = w.shape[2:]
    win = sliding_window_view(xp, (r, t), axis=(2, 3))[:, :, ::s, ::s]   # (N, C, P, Q, R, S)
    if op in ("fwd", "fwd_bias_relu"):
        y = np.einsum("ncpqrs,kcrs->nkpq", win, w)
        return y if op == "fwd" else np.maximum(y + b[None, :, None, None], 0)
    if op == "bwd_filter":
        return np.einsum("nkpq,ncpqrs->kcrs", dy, win)
    dxp = np.zeros_like(xp)
    n_p, n_q = dy.shape[2:]
    for i in range(r):
        for j in range(t):
            dxp[:, :, i:i + s * n_p:s, j:j + s * n_q:s] += np.einsum("nkpq,kc->ncpq", dy, w[:, :, i, j])
    return dxp[:, :, pt:xp.shape[2] - pb, pl:xp.shape[3] - pr]


def smoke(cp, sides, rng, log):
    """Every op of a small strided problem on both sides against a float64 reference, and captured; 1 on failure."""
    bad = 0
    p = Problem(cp, rng, (4, 8, 12, 12), (16, 8, 3, 3), 2, 1)
    for op in OPS:
        try:
            ref = reference(op, p)
            outs = [side.call(op, p) for side in sides]
            cp.cuda.Device().synchronize()
            errs = [float(np.abs(o.get() - ref).max() / np.abs(ref).max()) for o in outs]
            caps = [capture_check(cp, side, op, p) for side in sides]
            calls = [side.bare(op, p)[0] or {} for side in sides]
            for c in calls:
                for run in c.values():
                    run()
            cp.cuda.Device().synchronize()
            bad += not max(errs) < 1e-4
            if not max(errs) < 1e-4:   # which function did the wrong side compute: the flipped kernel's?
                flip = reference(op, p, flip=True)
                log(f"  against the flipped kernel: {[float(np.abs(o.get() - flip).max() / np.abs(flip).max()) for o in outs]}")
            log(f"smoke {op}: rel err against float64 {dict(zip([s.name for s in sides], errs))}, capture {caps}, "
                f"bare calls {[sorted(c) for c in calls]}")
        except Exception as e:
            import traceback
            bad += 1
            log(f"smoke {op}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    return bad


def environment(cp, cudnn):
    """GPU, versions, and every libcudnn*.so mapped into this process (one copy: both sides share it)."""
    from fluxpy.kernels.cudnn import library
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    maps = sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                   if "libcudnn" in line and "/" in line})
    return dict(gpu=name.decode() if isinstance(name, bytes) else name, cupy=cp.__version__,
                fluxpy_cudnn=library.version(), fluxpy_library=library.library_path(),
                frontend=getattr(cudnn, "__version__", "?"), frontend_backend=cudnn.backend_version(),
                mapped=maps, date=str(datetime.datetime.now(datetime.timezone.utc)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="conv.py's quick layer set")
    ap.add_argument("--tune", type=int, default=0, help="candidates timed per problem (0: heuristics' first)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds; sections after it are not run")
    ap.add_argument("--no-step", action="store_true")
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true",
                    help="one small problem per op on both sides, checked against each other and captured; exit 1 on "
                         "any error")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_file = open(out_dir / f"cudnn_frontend_tune{a.tune}.log", "w")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    def late():
        return time.perf_counter() - t_start > a.deadline

    import cupy as cp
    import cudnn

    fx = Fluxpy(a.tune)
    fe = Frontend(cudnn, cp, a.tune)
    sides = (fx, fe)
    rng = cp.random.RandomState(0)
    warm = Problem(cp, rng, (2, 4, 8, 8), (4, 4, 3, 3), 1, 1)   # handles, library load: out of the build times
    for side in sides:
        for op in OPS:
            side.call(op, warm)
    env = environment(cp, cudnn)
    env["lines"] = lines_of_code()
    log(f"# {json.dumps(env, default=str)}")
    if a.smoke:
        get_stream = getattr(cudnn._pybind_module, "get_stream", None)
        log(f"# frontend handle stream {fe.handle.stream}, backend's "
            f"{get_stream(fe.handle.backend_handle) if get_stream else '?'}, CuPy's {cp.cuda.get_current_stream().ptr}")
        return smoke(cp, sides, rng, log)
    busy = Busy(cp)
    log(f"# busy matmul {busy.ms:.3f} ms")

    caps, cap_detail = {}, {}
    for op in OPS:   # capture: a small and a large problem per op
        for side in sides:
            oks = []
            for shape in (((8, 64, 56, 56), (64, 64, 3, 3), 1, 1), ((128, 16, 32, 32), (32, 16, 3, 3), 2, 1)):
                ok, detail = capture_check(cp, side, op, Problem(cp, rng, *shape))
                oks.append(ok)
                cap_detail.setdefault(op, {}).setdefault(side.name, []).append(detail)
            caps.setdefault(op, {})[side.name] = f"{sum(oks)}/{len(oks)}"
    log(f"# capture {json.dumps(cap_detail)}")

    rows, skipped, step = [], [], None
    if not a.no_step:   # first: the layers stop at the deadline
        probs = [Problem(cp, rng, x, w, s, p) for _, x, w, s, p in resnet20_convs(128)]
        step = bench_step(cp, busy, sides, probs, a.reps, log)
        del probs
    for name, n, c, h, k, r, s, p in conv_layers(a.quick):
        if late():
            skipped.append(name)
            continue
        for side in sides:
            side.forget()
        prob = Problem(cp, rng, (n, c, h, h), (k, c, r, r), s, p)
        rows += bench_problem(cp, busy, sides, name, prob, a.reps, log)
        del prob
        cp.get_default_memory_pool().free_all_blocks()


    table = summary(rows, caps, step, env["gpu"], a.tune)
    detail = layer_table(rows)
    tail = f"\nnot run (deadline {a.deadline:g} s): {', '.join(skipped)}" if skipped else ""
    (out_dir / f"cudnn_frontend_tune{a.tune}.md").write_text(table + "\n\n" + detail + tail + "\n")
    (out_dir / f"cudnn_frontend_tune{a.tune}.json").write_text(json.dumps(
        dict(environment=env, rows=rows, capture=cap_detail, step=step, skipped=skipped), indent=1, default=str))
    log(detail)
    log("")
    log(table + tail)
    log(f"# {time.perf_counter() - t_start:.0f} s")
    return rows


if __name__ == "__main__":
    got = main()
    sys.exit(got if isinstance(got, int) else 0)
