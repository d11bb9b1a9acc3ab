"""The optimiser kernels every rule generates compile for sm_90 with NVRTC (from its pip wheel, no GPU needed),
without a warning: the multi-tensor ``cuda/optimise_many.cu`` with the formula's defines, the per-parameter body
inside a wrapper as CuPy's ElementwiseKernel makes one (references per element, the preamble, raw pointers), its
guarded twin, the counters' advance (the multi-tensor kernel for float16 and bfloat16 parameters too), and
``cuda/optimise_finite.cu`` for every dtype. Skipped where the
``nvidia-cuda-nvrtc`` wheel is not installed."""
import numpy as np
import pytest

import nvrtc
from fluxpy.kernels import compiler, halfs
from fluxpy.kernels import cuda_optimise as K
from fluxpy.optimise.rules import formula_of
from test_optimise_rules_fused import RULES

pytestmark = pytest.mark.skipif(nvrtc.library() is None, reason="needs the nvidia-cuda-nvrtc wheel")


def assert_compiles(text, options):
    """``text`` compiles for compute_90 with ``options`` and NVRTC warns of nothing."""
    result = nvrtc.compile(text, tuple(options) + ("--gpu-architecture=compute_90",), "k.cu")
    assert result.ok and "warning" not in result.log, result.log[-3000:]


def elementwise_text(f, hyper, dtype, guarded):
    """The per-parameter step as CuPy's ElementwiseKernel wraps its body (in outline)."""
    code = K.c_code(f, hyper, "fx_h{i}")
    params = ["const T* _raw_dx"] + [f"const T* fx_in_{n}" for n in f.inputs]
    params += [f"double fx_h{i}" for i in range(len(hyper))] + (["const double* fx_c"] if f.counters else [])
    params += (["const double* fx_ok"] if guarded else []) + ["T* _raw_x"] + [f"T* _raw_{n}" for n in f.state]
    refs = "const T dx = _raw_dx[i]; T& x = _raw_x[i]; " + " ".join(f"T& {n} = _raw_{n}[i];" for n in f.state)
    inputs = " ".join(f"const T {n} = fx_in_{n}[0];" for n in f.inputs)
    body = f"{code.prologue} {inputs} {code.body}"
    body = f"if (isfinite(fx_ok[0])) {{ {body} }}" if guarded else f"{{ {body} }}"
    ctype = "float" if dtype == np.float32 else "double"
    return (compiler.source("optimise.cuh") + f"\ntypedef {ctype} T;\n"
            f"extern \"C\" __global__ void k({', '.join(params + ['long long fx_n'])}) {{\n"
            "  for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < fx_n; i += blockDim.x * gridDim.x) {"
            f" {refs} {body} }}\n}}\n")


@pytest.mark.parametrize("dtype", halfs.KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_every_rules_kernels_compile_without_a_warning(rule, dtype):
    f, hyper = formula_of(rule), tuple(rule.hyper())
    assert_compiles(compiler.source("optimise_many.cu"), compiler.compile_options(K.many_defines(f, hyper, dtype)))
    if dtype not in (np.float32, np.float64):   # the per-parameter kernel takes float32 and float64
        return
    for guarded in (False, True):
        assert_compiles(elementwise_text(f, hyper, dtype, guarded), [compiler.STANDARD])
    if f.counters:
        advance = K.c_code(f, hyper, "fx_h{i}").advance
        params = ", ".join([f"double fx_h{i}" for i in range(len(hyper))] + ["double* fx_c"])
        assert_compiles(f'extern "C" __global__ void a({params}) {{ {advance} }}\n', [compiler.STANDARD])


@pytest.mark.parametrize("dtype", halfs.KERNEL_DTYPES, ids=str)
def test_the_finiteness_check_compiles_for_every_dtype(dtype):
    assert_compiles(compiler.source("optimise_finite.cu"),
                    list(compiler.compile_options({"CAP": K.CAP, **halfs.dtype_defines(dtype)})))
