"""The one place fluxpy's CUDA sources are compiled, launched and timed.

Every hand-written kernel lives in a ``.cu`` file under ``fluxpy/kernels/cuda/`` (headers it shares in ``.cuh``
files beside it). A kernel module asks for a compiled module by the source's name and a dict of defines:

>>> defines = {"L": 768, "FUSED": True, "T": "float"}
>>> compile_options(defines)
('--std=c++17', '-DFUSED=1', '-DL=768', '-DT=float')
>>> "#define LOAD" in source("halfs.cuh")   # a source as NVRTC sees it (local headers inlined)
True

- :func:`module` compiles ``name`` with ``defines`` passed as ``-D`` options (never pasted into the text), caches
  the result per (source, defines, options, device), and returns a ``cupy.RawModule``; :func:`function` takes one
  kernel of it.
- :func:`source` reads a ``.cu`` file with its local ``#include "x.cuh"`` lines replaced by the header's text, so
  the text handed to NVRTC (and CuPy's disk cache key, which hashes that text) changes whenever a header does.
- :func:`launch` runs a kernel on the current stream; :func:`device` gives the current GPU's properties, queried
  once per device (processor count, shared memory, registers, compute capability).
- :func:`time_ms` is the one GPU timer behind every choice made by timing (cuDNN plans, batch-norm and scatter
  candidates): one warm-up call, then back-to-back calls between CUDA events on an idle stream, so host time
  between launches counts as it does in a training step (``hide_host=True`` queues the calls behind a spin kernel
  instead, so only GPU time counts); ``inf`` where the call raises one of ``failures``. :func:`timed_choice` times
  implementations of one problem both ways and keeps, of those near the fastest GPU time, the fastest back to back.

CI compiles every source for sm_90 without a GPU (``tests/test_kernel_sources.py``, NVRTC from its pip wheel)
through :func:`compile_options` and :func:`source`, the same text and options the GPU path uses. A kernel module
says which variants it can launch with a function ``SOURCE_VARIANTS()`` yielding ``(source name, defines)`` pairs,
made by the same code that picks the defines at run time; the test compiles each one.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..backend import cupy

__all__ = ["SOURCE_DIR", "STANDARD", "source", "compile_options", "module", "function", "launch", "device",
           "DeviceProperties", "time_ms", "Timed", "timed_choice", "clear_cache", "SOURCE_VARIANTS"]

SOURCE_DIR = Path(__file__).resolve().parent / "cuda"
"""The folder that holds every ``.cu`` and ``.cuh`` file (package data)."""

STANDARD = "--std=c++17"

_DEFINE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\([A-Za-z_][A-Za-z0-9_]*(, *[A-Za-z_][A-Za-z0-9_]*)*\))?")
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)


@functools.cache
def source(name: str) -> str:
    """The text of ``cuda/<name>`` with each local ``#include "h.cuh"`` replaced by that header's text, once
    (a header included twice is inlined at its first include only).

    >>> "fx_load_f16" in source("halfs.cuh")
    True
    """
    seen: set[str] = set()

    def expand(file: str) -> str:
        path = SOURCE_DIR / file
        if not path.is_file():
            raise FileNotFoundError(f"no CUDA source {file!r} in {SOURCE_DIR}")
        text = path.read_text()

        def inline(match):
            header = match.group(1)
            if header in seen:
                return f"// {header} already included"
            seen.add(header)
            return f"// begin {header}\n{expand(header)}\n// end {header}"
        return _INCLUDE.sub(inline, text)
    seen.add(name)
    return expand(name)


def _define_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, (int, str)):
        return str(value)
    if hasattr(value, "item"):            # a NumPy scalar
        return str(value.item())
    raise TypeError(f"a CUDA define must be a bool, int or str, got {type(value).__name__} {value!r}")


def compile_options(defines: Mapping[str, Any] = {}, options: tuple = ()) -> tuple:
    """The NVRTC options for ``defines`` (``-DNAME=value``, sorted by name, bools as 0/1) and extra ``options``.
    A name may be a function-like macro's, ``"MAP(x, y)"`` (a small expression the kernel applies).

    >>> compile_options({"B": 2, "A": "float", "F(x)": "(x * 2)"}, ("-lineinfo",))
    ('--std=c++17', '-DA=float', '-DB=2', '-DF(x)=(x * 2)', '-lineinfo')
    """
    bad = [k for k in defines if not _DEFINE_NAME.fullmatch(k)]
    if bad:
        raise ValueError(f"CUDA define names must be identifiers or NAME(args), got {bad}")
    return (STANDARD,) + tuple(f"-D{k}={_define_value(defines[k])}" for k in sorted(defines)) + tuple(options)


_modules: dict = {}


def module(name: str, defines: Mapping[str, Any] = {}, options: tuple = (), name_expressions=None):
    """The ``cupy.RawModule`` of ``cuda/<name>`` compiled with ``defines`` for the current device (cached).

    ``name_expressions`` names template instantiations to compile (CuPy's own argument)."""
    opts = compile_options(defines, options)
    names = tuple(name_expressions) if name_expressions else None
    key = (name, opts, names, cupy.cuda.runtime.getDevice())
    found = _modules.get(key)
    if found is None:
        kwargs = {"name_expressions": names} if names else {}
        found = _modules[key] = cupy.RawModule(code=source(name), options=opts, **kwargs)
    return found


_functions: dict = {}


def function(name: str, kernel: str, defines: Mapping[str, Any] = {}, options: tuple = ()):
    """The kernel ``kernel`` of :func:`module` ``(name, defines, options)`` (cached: a launch looks it up by the
    defines as given, without building the options again)."""
    key = (name, kernel, tuple(defines.items()), options, cupy.cuda.runtime.getDevice())
    found = _functions.get(key)
    if found is None:
        found = _functions[key] = module(name, defines, options).get_function(kernel)
    return found


def launch(kernel, grid, block, args, shared_mem: int = 0) -> None:
    """Run ``kernel`` (a CuPy function) on the current stream with ``grid`` and ``block`` (ints or tuples), its
    arguments ``args`` and ``shared_mem`` bytes of dynamic shared memory."""
    grid = grid if isinstance(grid, tuple) else (int(grid),)
    block = block if isinstance(block, tuple) else (int(block),)
    kernel(grid, block, tuple(args), shared_mem=int(shared_mem))


@dataclass(frozen=True)
class DeviceProperties:
    """What kernels and planners ask of a GPU, queried once per device by :func:`device`."""
    id: int
    processors: int            # streaming multiprocessors
    compute_capability: int    # 90 for sm_90
    shared_per_block: int      # bytes a block may opt into
    shared_per_processor: int  # bytes an SM holds
    registers_per_processor: int
    threads_per_processor: int


_devices: dict = {}


def device(dev: int | None = None) -> DeviceProperties:
    """The properties of GPU ``dev`` (default: the current one), queried once."""
    dev = cupy.cuda.runtime.getDevice() if dev is None else int(dev)
    found = _devices.get(dev)
    if found is None:
        def attribute(name):
            return int(cupy.cuda.runtime.deviceGetAttribute(_ATTRIBUTES[name], dev))
        found = _devices[dev] = DeviceProperties(
            id=dev, processors=attribute("processors"),
            compute_capability=attribute("major") * 10 + attribute("minor"),
            shared_per_block=attribute("shared_per_block"), shared_per_processor=attribute("shared_per_processor"),
            registers_per_processor=attribute("registers_per_processor"),
            threads_per_processor=attribute("threads_per_processor"))
    return found


# cudaDeviceAttr values (driver_types.h), stable across CUDA versions
_ATTRIBUTES = {"processors": 16, "threads_per_processor": 39, "major": 75, "minor": 76, "shared_per_processor": 81,
               "registers_per_processor": 82, "shared_per_block": 97}


_SPIN_CYCLES = 2_000_000   # about a millisecond: longer than the host takes to queue a few calls


def time_ms(run: Callable[[], Any], reps: int = 5, failures: tuple = (), hide_host: bool = False) -> float:
    """Milliseconds per call of ``run()`` on the GPU: one warm-up call, then ``reps`` back-to-back calls between
    CUDA events recorded on an idle stream; ``inf`` if ``run`` raises one of ``failures`` (out of memory always
    counts as one). ``hide_host``: the calls are queued behind a spin kernel, so the time is the GPU's alone (for
    choices between kernels whose host costs are alike and would only add noise)."""
    failures = tuple(failures) + (cupy.cuda.memory.OutOfMemoryError,)
    try:
        run()
        stream = cupy.cuda.get_current_stream()
        stream.synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        if hide_host:
            launch(function("spin.cu", "fluxpy_spin"), 1, 1, (np.int64(_SPIN_CYCLES),))
        start.record(stream)
        for _ in range(reps):
            run()
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / reps
    except failures:
        return float("inf")


_GPU_MARGIN = 1.1   # timed_choice: how much more GPU time than the fastest an implementation may take


@dataclass(frozen=True)
class Timed:
    """The implementations of one problem as :func:`timed_choice` measured them: the one ``kept``, each one's
    milliseconds by GPU time alone, and back to back (host and GPU together, as an eager step pays them) for those
    near the fastest GPU time.

    >>> Timed("ours", {"cudnn": 0.010, "ours": 0.0105}, {"cudnn": 0.05, "ours": 0.03}).kept
    'ours'
    """
    kept: Any
    gpu_ms: Mapping
    wall_ms: Mapping


def timed_choice(runs: Mapping[Any, Callable[[], Any]], failures: tuple = ()) -> Timed:
    """Time each of ``runs`` (``{name: run}``, every run computing the same problem) by GPU time alone and back to
    back (the best of three rounds of ten calls: the host's pace drifts), and keep, of those within 10% of the
    fastest GPU time, the fastest back to back: a captured step pays the GPU time alone, an eager step the host's
    calls too, and one choice for both keeps a captured step equal to the eager one, bit for bit.
    Not inside a capture: the timing reads the clock on the host.

    >>> timed_choice.__name__
    'timed_choice'
    """
    gpu = {name: time_ms(run, failures=failures, hide_host=True) for name, run in runs.items()}
    fastest = min(gpu.values())
    wall = {name: min(time_ms(run, reps=10, failures=failures) for _ in range(3))
            for name, run in runs.items() if gpu[name] <= fastest * _GPU_MARGIN}
    return Timed(min(wall, key=wall.get), gpu, wall)


def clear_cache() -> None:
    """Forget every compiled module (the next call compiles again; CuPy's disk cache still answers)."""
    _modules.clear()
    _functions.clear()
    source.cache_clear()


def SOURCE_VARIANTS():
    """The compiler's own source: the spin kernel :func:`time_ms` waits behind.

    >>> list(SOURCE_VARIANTS())
    [('spin.cu', {})]
    """
    yield "spin.cu", {}
