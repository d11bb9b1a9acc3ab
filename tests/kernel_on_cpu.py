"""A kernel source as NVRTC gets it, made for g++ and ``tests/cuda_on_cpu/shim.h`` (the tests that run fluxpy's CUDA
kernels on the CPU: ``tests/test_*_cpu_run.py``): ``fluxpy.kernels.compiler.source`` (headers inlined), with
``halfs.cuh``'s two float16 PTX conversions replaced by shim.h's host stand-ins (the host compiler's ``_Float16``,
IEEE round to nearest even). bfloat16 runs halfs.cuh's own bit form (no ``__CUDA_ARCH__`` on the host); the GPU's
instructions are ``tests/gpu/test_halves_gpu.py``'s.
"""
from fluxpy.kernels import compiler

PTX_STANDINS = {'asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));': "f = fx_cpu_f16_to_f32(h);",
                'asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));': "h = fx_cpu_f32_to_f16(f);"}


def source_for_cpu(name: str) -> str:
    """The text of ``cuda/<name>`` for g++ with shim.h; an AssertionError where it no longer holds halfs.cuh's PTX
    conversions as written here (update the stand-ins)."""
    text = compiler.source(name)
    for ptx, call in PTX_STANDINS.items():
        assert text.count(ptx) == 1, f"{name}: halfs.cuh no longer holds {ptx!r} once: update the stand-ins"
        text = text.replace(ptx, call)
    return text
