"""The multi-tensor kernel generated from a rule's formula (``cuda/optimise_many.cu`` with the defines
``fluxpy.kernels.cuda_optimise`` makes), compiled for the host and run on NumPy arrays, on the CPU.

The ``.cu`` source is compiled by the C++ compiler with a small header standing in for CUDA's (``__global__``
empty, ``blockIdx``/``threadIdx``/``blockDim``/``gridDim`` plain variables) and the same defines as ``-D``
options; a launch runs every thread of every block in turn (the kernel has no barrier, so that is a valid
schedule). The host code of ``optimiser_step_many`` (the table of pointers, the start offsets, the launches per
group of tensors, the strided gradients copied first) runs as on the GPU. Every rule's update through it must
give the rule's NumPy path bit for bit (the host compiler contracts nothing, ``-ffp-contract=off``), bfloat16
parameters too.
"""
import contextlib
import ctypes
import hashlib
import subprocess
import types

import numpy as np
import pytest

import fluxpy
from fluxpy import kernels
from fluxpy import optimise as O
from fluxpy.kernels import compiler
from fluxpy.kernels import cuda_optimise as K
from fluxpy.kernels.halfs import BFLOAT16
from test_optimise_rules_fused import RULES, HostElementwiseKernel, _compiler, assert_bit_for_bit

_SHIM = r"""
#include <cmath>
#include <cstring>
using namespace std;
#define __global__
#define __device__
#define __forceinline__ static inline
struct fx_dim3 { unsigned x, y, z; };
static fx_dim3 blockIdx, blockDim, gridDim, threadIdx;
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
"""

_DRIVER = r"""
extern "C" void fx_run(unsigned grid, unsigned block, const Tensors* t, int count, const Numbers* h,
                       const double* c, const double* ok) {
  gridDim.x = grid; blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b)
    for (unsigned i = 0; i < block; ++i) {
      blockIdx.x = b; threadIdx.x = i;
      fx_step_many(*t, count, *h, c, ok);
    }
}
"""


class HostCompiler:
    """``fluxpy.kernels.compiler`` for the host: :meth:`function` compiles a ``.cu`` source (as
    :func:`compiler.source` gives it) with its defines, :meth:`launch` runs it; ``launches`` counts them."""

    def __init__(self, directory):
        self.directory, self.launches, self.built = directory, 0, {}
        self.source = compiler.source

    def function(self, name, kernel, defines):
        options = compiler.compile_options(defines)[1:]   # the -D options, as NVRTC gets them
        key = (name, options)
        if key not in self.built:
            text = _SHIM + compiler.source(name) + _DRIVER
            tag = hashlib.sha1((text + repr(options)).encode()).hexdigest()[:16]
            src, lib = self.directory / f"{tag}.cpp", self.directory / f"{tag}.so"
            src.write_text(text)
            run = subprocess.run([_compiler(), "-O2", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
                                  *options, "-o", str(lib), str(src)], capture_output=True, text=True)
            assert run.returncode == 0, run.stderr[-3000:]
            fn = ctypes.CDLL(str(lib)).fx_run
            fn.restype = None
            self.built[key] = fn
        return self.built[key]

    def launch(self, kernel, grid, block, args):
        table, count, numbers, counters, ok = args
        self.launches += 1

        def address(a):
            return ctypes.c_void_p(0 if isinstance(a, np.uint64) else a.ctypes.data)
        kernel(ctypes.c_uint(grid), ctypes.c_uint(block), address(table), ctypes.c_int(int(count)), address(numbers),
               address(counters), address(ok))


@pytest.fixture
def host_many(tmp_path, monkeypatch):
    """optimiser_step_many (the .cu compiled for the host), optimiser_step and optimiser_advance (the
    ElementwiseKernel stand-in) in the table for NumPy arrays; yields the host compiler."""
    if _compiler() is None:
        pytest.skip("needs a C++ compiler")
    host = HostCompiler(tmp_path)

    class Kernel(HostElementwiseKernel):
        def __init__(self, ins, outs, body, name, preamble=""):
            super().__init__(ins, outs, body, name, tmp_path, preamble)

    monkeypatch.setattr(K, "cupy", types.SimpleNamespace(ElementwiseKernel=Kernel, ndarray=np.ndarray))
    monkeypatch.setattr(K, "compiler", host)
    monkeypatch.setattr(K, "_address", lambda a: a.ctypes.data)
    monkeypatch.setattr(K, "_elementwise", {})
    monkeypatch.setattr(K, "_advance_kernels", {})
    before = kernels.snapshot()
    for name, (fn, supports) in K.KERNELS.items():
        if name.startswith("optimiser"):
            kernels.register(name, "numpy", fn, supports)
    try:
        yield host
    finally:
        kernels.restore(before)


@contextlib.contextmanager
def without_kernels():
    saved = kernels.snapshot()
    kernels.restore({k: v for k, v in saved.items() if not k[0].startswith("optimiser")})
    try:
        yield
    finally:
        kernels.restore(saved)


def model_of(rng, dtype):
    shapes = {"conv": (6, 3, 3, 3), "bn": (6,), "s": (), "empty": (0, 3), "long": (1500,), "dense": (10, 8),
              "odd": (3, 1, 5)}
    return {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}


def grad_of(model, rng):
    grad = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in model.items()}
    grad["dense"] = np.ascontiguousarray(grad["dense"].T).T   # a transposed gradient: copied into x's layout
    return grad


def run_both(rule, dtype, steps=7, seed=0):
    rng = np.random.default_rng(seed)
    model = model_of(rng, dtype)
    twin = {k: v.copy() for k, v in model.items()}
    state, twin_state = O.setup(rule, model), O.setup(rule, twin)
    for _ in range(steps):
        grad = grad_of(model, rng)
        O.update(state, model, grad)
        with without_kernels():
            O.update(twin_state, twin, {k: v.copy() for k, v in grad.items()})
        for k in model:
            assert model[k].tobytes() == twin[k].tobytes(), k
            assert_bit_for_bit(state[k].state, twin_state[k].state)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, BFLOAT16], ids=str)
@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_the_multi_tensor_kernel_gives_the_numpy_path_bit_for_bit(host_many, rule, dtype):
    """(A bfloat16 parameter: computed in float32 with a float32 state, rounded once, as its NumPy path; the
    float16 conversions are PTX, so float16 runs on the GPU only.)"""
    run_both(rule, dtype)
    assert host_many.launches == 7   # one launch a step for the whole model


def test_long_lists_take_several_launches_and_blocks_stride(host_many, monkeypatch):
    monkeypatch.setattr(K, "CAP", 3)          # 3 tensors a launch: 7 parameters in 3 launches
    monkeypatch.setattr(K, "_MAX_BLOCKS", 1)  # one block walks every chunk
    run_both(O.Adam(0.01), np.float32, steps=3, seed=1)
    assert host_many.launches == 3 * 3
    run_both(O.OptimiserChain(O.ClipNorm(1.0), O.WeightDecay(0.1), O.OAdam(0.01)), np.float64, steps=3, seed=2)


def test_a_guarded_launch_changes_nothing_unless_the_flag_is_finite(host_many):
    rng = np.random.default_rng(3)
    model = model_of(rng, np.float64)
    state = O.setup(O.RAdam(0.1), model)
    O.update(state, model, grad_of(model, rng))
    before = {k: v.copy() for k, v in model.items()}
    counters = state["long"].state[2:]
    with fluxpy.capturing.guarding(np.array(np.nan)):
        O.update(state, model, grad_of(model, rng))
    for k in model:
        assert model[k].tobytes() == before[k].tobytes()
    assert state["long"].state[2:] == counters   # the skipped step did not count (RAdam's beta^t and t)
    with fluxpy.capturing.guarding(np.array(0.0)):
        O.update(state, model, grad_of(model, rng))
    assert model["long"].tobytes() != before["long"].tobytes()
    twin = model_of(np.random.default_rng(3), np.float64)
    twin_state = O.setup(O.RAdam(0.1), twin)
    for _ in range(2):
        O.update(twin_state, twin, grad_of(twin, rng))
    assert state["long"].state[2:] == twin_state["long"].state[2:]   # counted once, as two unguarded steps
    assert [type(c) for c in state["long"].state[2:]] == [type(c) for c in twin_state["long"].state[2:]]


def test_the_kept_checks_and_addresses_follow_the_arrays(host_many):
    """What a group keeps from step to step (the parameters' and state arrays' checks and addresses) is made again
    when an array of its lists is another, and a launch's table carries the new address."""
    xs = [np.ones(4, np.float32), np.ones((2, 3), np.float32)]
    states = [[np.zeros(4, np.float32)], [np.zeros((2, 3), np.float32)]]
    memo = {}
    kept = K._kept(memo, xs, states)
    assert kept.ok and K._kept(memo, list(xs), [list(s) for s in states]) is kept
    states[1][0] = np.zeros((2, 3), np.float32)
    again = K._kept(memo, xs, states)
    assert again is not kept and memo["kept"] is again
    slots, cap = 3, 4   # x, dx and one state array a parameter; four parameters a launch
    table = again.table(slots, cap, 0, 2)
    assert table[0] == xs[0].ctypes.data and table[1] == xs[1].ctypes.data
    assert table[2 * cap + 1] == states[1][0].ctypes.data
    assert list(table[slots * cap:slots * cap + 3]) == [0, 4, 10]   # the running sizes
    table[cap] = 1   # a step writes its gradients' addresses into its own copy
    assert again.table(slots, cap, 0, 2)[cap] == 0
    assert not K._kept({}, xs, [[np.zeros(4, np.float64)], states[1]]).ok   # a state array of another dtype
