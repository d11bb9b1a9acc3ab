"""NVRTC through ctypes, from the ``nvidia-cuda-nvrtc`` pip wheel: compile CUDA source for a GPU architecture
without a GPU (a test tool: ``tests/test_kernel_sources.py`` compiles every kernel source with it).

>>> library() is None or callable(library().nvrtcCreateProgram)
True
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
from dataclasses import dataclass

_library = []


def _candidates():
    try:
        import nvidia
    except ImportError:
        return []
    found = []
    for root in nvidia.__path__:   # the CUDA 13 wheel's layout (nvidia/cu13/lib), then the CUDA 12 one's
        found += sorted(glob.glob(os.path.join(root, "cu*", "lib", "libnvrtc.so*")), reverse=True)
        found += sorted(glob.glob(os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so*")), reverse=True)
    return [f for f in found if "builtins" not in os.path.basename(f)]


def library():
    """The loaded ``libnvrtc`` of the pip wheel, or None where the wheel is not installed."""
    if not _library:
        lib = None
        for path in _candidates():
            try:
                # NVRTC dlopens its builtins by name: load the wheel's copy first, for wheels without an rpath to it
                for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
                    if ".alt." not in builtins:
                        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                lib = ctypes.CDLL(path)
                break
            except OSError:
                continue
        if lib is not None:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _library.append(lib)
    return _library[0]


def version() -> tuple:
    """NVRTC's ``(major, minor)``."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(status, what):
    if status:
        raise RuntimeError(f"{what}: {library().nvrtcGetErrorString(status).decode()}")


@dataclass(frozen=True)
class Result:
    """One compilation: ``ok`` (no error), the compiler's ``log`` (with ptxas' lines under ``-Xptxas=-v``)."""
    ok: bool
    log: str

    def spills(self) -> list:
        """The ptxas lines that report spilled bytes (stores or loads), with the function each belongs to."""
        out, function = [], "?"
        for line in self.log.splitlines():
            named = re.search(r"[Ff]unction properties for (\S+)", line) or re.search(r"Compiling entry function '([^']+)'", line)
            if named:
                function = named.group(1)
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m and (int(m.group(1)) or int(m.group(2))):
                out.append(f"{function}: {line.strip()}")
        return out

    def reported(self) -> bool:
        """Whether ptxas reported the registers of at least one function (``-Xptxas=-v`` was taken)."""
        return re.search(r"Used \d+ registers", self.log) is not None

    def attributes(self, kernel: str) -> tuple:
        """``(registers, local bytes, static shared bytes)`` of ``kernel`` as ptxas reports them (its stack frame
        is the local memory a launch gets), as a compiled function's ``num_regs``, ``local_size_bytes`` and
        ``shared_size_bytes`` give them on a GPU."""
        found, regs, local, shared = False, None, 0, 0
        for line in self.log.splitlines():
            named = re.search(r"[Ff]unction properties for (\S+)", line) or re.search(r"Compiling entry function '([^']+)'", line)
            if named:
                found = named.group(1) == kernel
                continue
            if not found:
                continue
            m = re.search(r"(\d+) bytes stack frame", line)
            if m:
                local = int(m.group(1))
            m = re.search(r"Used (\d+) registers", line)
            if m:
                regs = int(m.group(1))
                m = re.search(r"(\d+) bytes smem", line)
                shared = int(m.group(1)) if m else 0
        if regs is None:
            raise ValueError(f"ptxas reported no registers for {kernel!r} (was it compiled with -Xptxas=-v?)")
        return regs, local, shared


def compile(source: str, options: tuple, name: str = "kernel.cu", name_expressions: tuple = ()) -> Result:
    """Compile ``source`` with ``options`` (bytes-safe strings) and ``name_expressions`` (template kernels to
    instantiate); the program's log and whether it compiled."""
    lib = library()
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            _check(lib.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
        opts = [o.encode() for o in options]
        argv = (ctypes.c_char_p * len(opts))(*opts)
        status = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        log = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        return Result(status == 0, log.value.decode(errors="replace"))
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
