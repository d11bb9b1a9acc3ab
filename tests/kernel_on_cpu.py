"""Running fluxpy's CUDA kernel sources on the CPU (the tests ``tests/test_*_cpu_run.py``): the source as NVRTC gets
it, made for g++ and ``tests/cuda_on_cpu/shim.h`` (a thread per CUDA thread, one block at a time), and built into a
shared library per define set with a driver of ``tests/cuda_on_cpu`` whose ``emu_launch`` runs a kernel by name.

The source is ``fluxpy.kernels.compiler.source`` (headers inlined), with ``halfs.cuh``'s two float16 PTX conversions
replaced by shim.h's host stand-ins (the host compiler's ``_Float16``, IEEE round to nearest even); bfloat16 runs
halfs.cuh's own bit form (no ``__CUDA_ARCH__`` on the host). The GPU's instructions are
``tests/gpu/test_halves_gpu.py``'s.
"""
import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from fluxpy.kernels import compiler

SHIM = Path(__file__).resolve().parent / "cuda_on_cpu"
GXX = ["g++", "-std=c++20", "-O1", "-fPIC", "-Wno-unknown-pragmas", "-pthread"]
PTX_STANDINS = {'asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));': "f = fx_cpu_f16_to_f32(h);",
                'asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));': "h = fx_cpu_f32_to_f16(f);"}


def source_for_cpu(name: str) -> str:
    """The text of ``cuda/<name>`` for g++ with shim.h; an AssertionError where it includes halfs.cuh but no longer
    holds its PTX conversions as written here (update the stand-ins)."""
    text = compiler.source(name)
    if "fx_load_f16" not in text:   # halfs.cuh not included: nothing to replace
        return text
    for ptx, call in PTX_STANDINS.items():
        assert text.count(ptx) == 1, f"{name}: halfs.cuh no longer holds {ptx!r} once: update the stand-ins"
        text = text.replace(ptx, call)
    return text


def build_folder(tmp_path_factory, source: str, driver: str) -> Path:
    """A folder for the CPU builds of kernel source ``source``: its text for the CPU (:func:`source_for_cpu`),
    shim.h precompiled, and the driver ``tests/cuda_on_cpu/<driver>`` beside that header (which g++ then takes).
    Skips the test where there is no g++ or it cannot build shim.h (C++20's ``<barrier>``, ``_Float16``)."""
    folder = tmp_path_factory.mktemp(Path(source).stem + "_on_cpu")
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the kernels for the CPU")
    header = subprocess.run(GXX + ["-I", str(SHIM), "-x", "c++-header", str(SHIM / "shim.h"), "-o",
                                   str(folder / "shim.h.gch")], capture_output=True, text=True)
    if header.returncode:
        pytest.skip(f"g++ cannot build tests/cuda_on_cpu/shim.h (C++20 <barrier>, _Float16): {header.stderr[-300:]}")
    (folder / source).write_text(source_for_cpu(source))
    shutil.copy(SHIM / driver, folder / driver)
    return folder


def library(folder: Path, source: str, driver: str, defines: dict) -> ctypes.CDLL:
    """The driver built in ``folder`` (:func:`build_folder`) with ``defines`` as NVRTC would get them and the source
    as the macro ``KERNEL_SOURCE`` names it, loaded; built once per define set (kept in ``folder``)."""
    flags = [o for o in compiler.compile_options(defines) if o.startswith("-D")]
    out = folder / f"{Path(driver).stem}_{hashlib.sha1(repr(flags).encode()).hexdigest()[:12]}.so"
    if not out.exists():
        subprocess.run(GXX + ["-Winvalid-pch", "-I", str(SHIM), "-shared", *flags,
                              f'-DKERNEL_SOURCE="{folder / source}"', "-o", str(out), str(folder / driver)],
                       check=True)
    return ctypes.CDLL(str(out))
