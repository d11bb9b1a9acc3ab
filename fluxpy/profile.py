"""Where a step's time goes, per primitive and per pullback: :func:`profile`.

Inside ``with profile() as prof:`` every primitive call and every pullback run by the backward
pass is timed on the host (``perf_counter``) and, for CuPy work, on the GPU (CUDA events on the
current stream). Times are *exclusive*: an op that calls other ops (a rule calling its forward,
a pullback calling ``conv_backward_data``) is charged only for what is not inside them. On exit
the table is printed, sorted by GPU time (host time without a GPU): op, calls, total, mean,
share of the step, and a last line comparing the whole step's wall time with the time spent in
ops, so that launch overhead and Python outside the ops show as the gap.

Events measure when the GPU reaches them, so when the host is slower than the kernels an op's
GPU time includes the gaps the GPU spent waiting for its launches: compare it with host time.

>>> import numpy as np
>>> import fluxpy
>>> with profile(print_table=False) as prof:
...     _ = fluxpy.gradient(lambda x: (np.tanh(x) * 2).sum(), np.ones(3))
>>> {"tanh", "tanh_pullback", "multiply", "sum"} <= {r.name for r in prof.rows()}
True
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from . import autodiff
from .autodiff import Primitive
from .backend import GPUUnavailableError, event_seconds, gpu_available, record_event

__all__ = ["profile", "Profile", "ProfileRow"]


@dataclass
class ProfileRow:
    """One line of the table: ``name``, ``calls``, exclusive ``host_s`` and ``gpu_s`` (None without a GPU)."""
    name: str
    calls: int = 0
    host_s: float = 0.0
    gpu_s: float | None = None


class _Frame:
    __slots__ = ("name", "t0", "t1", "ev0", "ev1", "children")

    def __init__(self, name, use_gpu):
        self.name = name
        self.children = []
        self.ev0 = self.ev1 = None
        if use_gpu:
            self.ev0 = record_event()
        self.t0 = time.perf_counter()

    def stop(self):
        self.t1 = time.perf_counter()
        if self.ev0 is not None:
            self.ev1 = record_event()

    def gpu_seconds(self):
        return event_seconds(self.ev0, self.ev1) if self.ev0 is not None else None


class Profile:
    """The recorder behind :func:`profile`; see the module docstring.

    ``rows()`` gives the per-op totals, ``table()`` the printed table; ``wall_s``, ``gpu_span_s``
    (first to last event of the block) describe the whole block.
    """

    def __init__(self, gpu: bool | None = None, print_table: bool = True) -> None:
        if not (gpu is None or isinstance(gpu, bool)):
            raise ValueError(f"profile: gpu must be True, False or None (time the GPU when one is usable), got {gpu!r}")
        usable, why = gpu_available()
        if gpu and not usable:
            raise GPUUnavailableError(f"profile(gpu=True) times the GPU with CUDA events, but no GPU is usable: {why}; "
                                      f"use profile(gpu=False) (host times only), or profile() to decide by itself")
        self.use_gpu = usable if gpu is None else gpu
        self.print_table = print_table
        self.top = []      # finished top-level frames
        self._stack = []
        self.wall_s = self.gpu_span_s = None
        self._saved = None

    # -- recording -------------------------------------------------------------------------

    def _timed(self, name, fn, *args, **kw):
        if self._stack and self._stack[-1].name == name:
            return fn(*args, **kw)  # a rule computing its own forward: one call of the op
        frame = _Frame(name, self.use_gpu)
        self._stack.append(frame)
        try:
            return fn(*args, **kw)
        finally:
            frame.stop()
            self._stack.pop()
            (self._stack[-1].children if self._stack else self.top).append(frame)

    def __enter__(self) -> Profile:
        original_call = Primitive.__call__
        self._saved = (original_call, autodiff._pullback_hook)

        def profiled_call(prim, *args, **kw):
            return self._timed(prim.name, original_call, prim, *args, **kw)

        def profiled_pullback(back):
            name = getattr(back, "__name__", "pullback")
            return lambda g: self._timed(name, back, g)
        Primitive.__call__ = profiled_call
        autodiff._pullback_hook = profiled_pullback
        self._block = _Frame("(block)", self.use_gpu)
        return self

    def __exit__(self, *exc: object) -> bool:
        Primitive.__call__, autodiff._pullback_hook = self._saved
        self._block.stop()
        if self.use_gpu:
            self._block.ev1.synchronize()
        self.wall_s = time.perf_counter() - self._block.t0
        self.gpu_span_s = self._block.gpu_seconds()
        if self.print_table and exc[0] is None:
            print(self.table())
        return False

    # -- results ---------------------------------------------------------------------------

    def rows(self) -> list[ProfileRow]:
        """Per-op totals of exclusive time, as :class:`ProfileRow`, in no particular order."""
        table = {}

        def visit(frame):
            row = table.setdefault(frame.name, ProfileRow(frame.name, gpu_s=0.0 if self.use_gpu else None))
            row.calls += 1
            row.host_s += (frame.t1 - frame.t0) - sum(c.t1 - c.t0 for c in frame.children)
            if self.use_gpu:
                row.gpu_s += frame.gpu_seconds() - sum(c.gpu_seconds() for c in frame.children)
            for c in frame.children:
                visit(c)
        for f in self.top:
            visit(f)
        return list(table.values())

    def table(self) -> str:
        """The markdown table printed on exit."""
        rows = self.rows()
        key = (lambda r: r.gpu_s) if self.use_gpu else (lambda r: r.host_s)
        rows.sort(key=key, reverse=True)
        in_ops = sum(key(r) for r in rows)
        step = self.wall_s or in_ops or 1.0
        clock = "GPU" if self.use_gpu else "host"
        host_column = self.use_gpu
        lines = [f"| op | calls | {clock} total ms | {clock} mean us | share of step |" +
                 (" host total ms |" if host_column else ""),
                 "|---|---:|---:|---:|---:|" + ("---:|" if host_column else "")]
        for r in rows:
            t = key(r)
            lines.append(f"| {r.name} | {r.calls} | {t * 1e3:.3f} | {t / r.calls * 1e6:.1f} | {t / step:.1%} |" +
                         (f" {r.host_s * 1e3:.3f} |" if host_column else ""))
        summary = f"step: wall {self.wall_s * 1e3:.3f} ms, {clock} time in ops {in_ops * 1e3:.3f} ms"
        if self.use_gpu:
            summary += f", GPU span {self.gpu_span_s * 1e3:.3f} ms"
        summary += f"; outside ops or waiting for launches: {(self.wall_s - in_ops) * 1e3:.3f} ms"
        return "\n".join(lines + ["", summary])


def profile(gpu: bool | None = None, print_table: bool = True) -> Profile:
    """A context that times each primitive and pullback run inside it, and prints a table on exit.

    Used as ``with fluxpy.profile() as prof:``. ``gpu``: time with CUDA events too (default: when a
    GPU is usable; ``gpu=True`` without a usable GPU raises :class:`fluxpy.GPUUnavailableError`
    saying why). ``print_table=False`` keeps quiet; ``prof.table()`` and ``prof.rows()`` give the
    results.

    >>> import numpy as np
    >>> import fluxpy
    >>> with fluxpy.profile(print_table=False) as prof:
    ...     _ = fluxpy.gradient(lambda w: (w @ w).sum(), np.ones((2, 2)))
    >>> {r.name for r in prof.rows()} >= {"matmul", "matmul_pullback"}
    True
    """
    return Profile(gpu=gpu, print_table=print_table)
