"""The C that fluxpy's fused kernels compile for each activation (``fluxpy.kernels.trace.activation_c``: the formula,
its derivative, and the derivative from what ``bias_act`` keeps) agrees with the activation's NumPy definition.

The expressions are compiled on the host with the system's C++ compiler (the text the GPU kernels get as ``-D``
defines, a few CUDA intrinsics given host definitions) and evaluated on random inputs away from the activations'
kinks; the derivatives are checked against float64 central differences of the NumPy activation. That each compiles
for sm_90 without spills is ``tests/test_kernel_sources.py``'s part.
"""
import ctypes
import functools
import hashlib
import shutil
import subprocess

import numpy as np
import pytest

from fluxpy.kernels.elementwise import fuses
from fluxpy.kernels.trace import Untraceable, activation_c
from fluxpy.ops import activations as A
from fluxpy.ops.bias_act import derivative_from_saved, why_not_fused

ACTIVATIONS = [getattr(A, n) for n in A.__all__ if n != "rrelu"] + [
    functools.partial(A.leakyrelu, a=0.2), functools.partial(A.elu, a=0.5), functools.partial(A.celu, a=2.0),
    functools.partial(A.leakyrelu, a=-0.5), functools.partial(A.softshrink, lam=1.5), np.tanh]
KINKS = np.array([0.0, 0.5, 1.0, 1.5, 3.0, 6.0])   # where some activation is not differentiable (and their negatives)

_HOST_HEADER = """#include <cmath>
#include <cstring>
using namespace std;
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
"""


def _compiler():
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _name(act):
    if isinstance(act, functools.partial):
        return f"{_name(act.func)}({', '.join(f'{k}={v}' for k, v in act.keywords.items())})"
    return getattr(act, "__name__", None) or act.name


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """``host(expressions, ctype)``: a function per C expression in ``v`` (of type ``ctype``), each mapping a NumPy
    array elementwise, all compiled in one shared library."""
    if _compiler() is None:
        pytest.skip("needs a C++ compiler")
    directory = tmp_path_factory.mktemp("fusion_formulas")

    def build(expressions, ctype):
        body = [_HOST_HEADER]
        for i, e in enumerate(expressions):
            body.append(f'extern "C" void f{i}(const {ctype}* in, {ctype}* out, long long n) '
                        f"{{ for (long long i = 0; i < n; ++i) {{ const {ctype} v = in[i]; out[i] = {e}; }} }}")
        source = "\n".join(body)
        tag = hashlib.sha1(source.encode()).hexdigest()[:16]
        src, lib = directory / f"{tag}.cpp", directory / f"{tag}.so"
        src.write_text(source)
        run = subprocess.run([_compiler(), "-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared",
                              "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        dll = ctypes.CDLL(str(lib))
        dtype = np.float64 if ctype == "double" else np.float32

        def caller(i):
            fn = getattr(dll, f"f{i}")
            fn.restype = None

            def call(x):
                x = np.ascontiguousarray(x, dtype)
                out = np.empty_like(x)
                fn(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_longlong(x.size))
                return out
            return call
        return [caller(i) for i in range(len(expressions))]
    return build


def _inputs(seed, dtype=np.float64):
    """Random inputs over the activations' interesting range, none near a kink."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.uniform(-8, 8, 300), rng.standard_normal(300)])
    far = np.min(np.abs(np.abs(x)[:, None] - KINKS[None, :]), axis=1) > 1e-3
    return x[far].astype(dtype)


def _central_difference(act, x, h=1e-6):
    return (act(x + h) - act(x - h)) / (2 * h)


def test_every_exported_activation_but_rrelu_fuses():
    for act in ACTIVATIONS:
        assert why_not_fused(act) is None, (_name(act), why_not_fused(act))
    assert "random" in why_not_fused(A.rrelu)


def test_an_untraceable_activation_says_why():
    def branchy(v):
        return v if v > 0 else 0 * v
    reason = why_not_fused(branchy)
    assert reason is not None and "control flow" in reason
    assert not fuses(branchy)
    with pytest.raises(Untraceable):
        activation_c(branchy, np.float32, "v")


def test_formulas_and_derivatives_in_float64(host):
    """The forward against NumPy, the derivative against central differences, and the derivative from what
    bias_act keeps (the output or the pre-activation) against the derivative."""
    expressions = []
    for act in ACTIVATIONS:
        d, _ = derivative_from_saved(act)
        expressions += [activation_c(act, np.float64, "v"), activation_c(act, np.float64, "v", derivative=True),
                        activation_c(d, np.float64, "v") if d is not None else "((double)1)"]
    fns = host(expressions, "double")
    for i, act in enumerate(ACTIVATIONS):
        forward, derivative, from_saved = fns[3 * i: 3 * i + 3]
        x = _inputs(i)
        with np.errstate(all="ignore"):
            want = act(x)
            np.testing.assert_allclose(forward(x), want, rtol=1e-12, atol=1e-14, err_msg=_name(act))
            slope = derivative(x)
            np.testing.assert_allclose(slope, _central_difference(act, x), rtol=1e-6, atol=1e-7, err_msg=_name(act))
            _, from_output = derivative_from_saved(act)
            saved = want if from_output else x
            np.testing.assert_allclose(from_saved(saved), slope, rtol=1e-9, atol=1e-12, err_msg=_name(act))


def test_formulas_in_float32(host):
    """The float32 text (what the float32, float16 and bfloat16 kernels compute in) against NumPy in float32."""
    expressions = []
    for act in ACTIVATIONS:
        d, _ = derivative_from_saved(act)
        expressions += [activation_c(act, np.float32, "v"), activation_c(act, np.float32, "v", derivative=True),
                        activation_c(d, np.float32, "v") if d is not None else "((float)1)"]
    fns = host(expressions, "float")
    for i, act in enumerate(ACTIVATIONS):
        forward, derivative, from_saved = fns[3 * i: 3 * i + 3]
        x = _inputs(100 + i)
        x32 = x.astype(np.float32)
        with np.errstate(all="ignore"):
            want = act(x)
            np.testing.assert_allclose(forward(x32), want, rtol=2e-5, atol=2e-6, err_msg=_name(act))
            slope = _central_difference(act, x)
            np.testing.assert_allclose(derivative(x32), slope, rtol=1e-4, atol=2e-5, err_msg=_name(act))
            _, from_output = derivative_from_saved(act)
            saved = (want if from_output else x).astype(np.float32)
            # from the output rounded to float32: its error grows where the output is flat (tanh, sigmoid near 1)
            np.testing.assert_allclose(from_saved(saved), slope, rtol=1e-3, atol=1e-4, err_msg=_name(act))


def test_the_numpy_derivative_from_the_output_matches_dual_numbers():
    """What the CPU composite computes: the output derivative of DERIVATIVES_FROM_OUTPUT against the dual numbers."""
    from fluxpy.dual import derivative
    for act in ACTIVATIONS:
        d, from_output = derivative_from_saved(act)
        if d is None or not from_output:
            continue
        x = _inputs(7)
        np.testing.assert_allclose(np.asarray(d(act(x)), np.float64), derivative(act, x), rtol=1e-9, atol=1e-12,
                                   err_msg=_name(act))


def test_the_derivatives_from_the_input_match_dual_numbers():
    """The closed forms of DERIVATIVES_FROM_INPUT (what bias_act's pullback reads for gelu and swish) against the
    dual numbers of the activation's definition, in float64 and float32, and as what derivative_from_saved gives."""
    from fluxpy.dual import derivative
    assert A.DERIVATIVES_FROM_INPUT, "no derivative from the input to check"
    for i, (act, formula) in enumerate(A.DERIVATIVES_FROM_INPUT.items()):
        assert derivative_from_saved(act) == (formula, False)
        x = _inputs(20 + i)
        np.testing.assert_allclose(formula(x), derivative(act, x), rtol=1e-12, atol=1e-14, err_msg=_name(act))
        x32 = x.astype(np.float32)
        got = formula(x32)
        assert got.dtype == np.float32, _name(act)
        np.testing.assert_allclose(got, derivative(act, x32), rtol=1e-5, atol=1e-6, err_msg=_name(act))


def test_a_negative_slope_is_differentiated_from_the_input():
    """leakyrelu with a < 0 gives outputs whose sign does not tell the branch: its derivative is not taken from
    the output."""
    assert derivative_from_saved(A.leakyrelu)[1]
    assert not derivative_from_saved(functools.partial(A.leakyrelu, a=-0.5))[1]
    assert derivative_from_saved(A.gelu)[1] is False and derivative_from_saved(A.identity) == (None, True)


@pytest.mark.parametrize("act", ACTIVATIONS, ids=_name)
def test_the_kernel_cache_key_of_every_activation_is_built_and_tells_parameters_apart(act):
    # The activations that record one tape node refer to themselves through their closure; the GPU kernel cache
    # keys a function by its code and captured values, so that key must stop at the self-reference.
    from fluxpy.kernels.elementwise import _func_key
    key = _func_key(act)
    assert hash(key) == hash(_func_key(act)) and key == _func_key(act)
    other = functools.partial(A.leakyrelu, a=0.3)
    assert key != _func_key(other) or act is other


def test_the_kernel_cache_key_tells_a_wrapper_from_the_function_it_wraps():
    from fluxpy.kernels.elementwise import _func_key

    def doubled(x):
        return 2 * A.gelu(x)
    doubled = functools.wraps(A.gelu)(doubled)
    assert _func_key(doubled) != _func_key(A.gelu)
    assert _func_key(functools.partial(A.elu, a=0.5)) != _func_key(functools.partial(A.elu, a=0.6))
