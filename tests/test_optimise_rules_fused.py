"""The fused per-parameter steps of the Optimisers.jl rules beyond Adam (``fluxpy.kernels.elementwise``:
``adagrad_update`` ... ``accum_grad_update``), on the CPU.

Every rule names its kernel in the GPU's table. The kernels themselves are checked without a GPU: their CUDA
bodies are compiled for the host by the C++ compiler, through a stand-in for ``cupy.ElementwiseKernel`` (the same
parameter lists, ``T`` bound to the arrays' dtype, inputs as const references and outputs as references to one
element, the body run once per element), and put in the kernel table for NumPy arrays for a test. The rules then
step through the same Python code as on the GPU (``find``, the kernel's host-side scalars, the guard), and must give
their array path's arrays and states bit for bit: the host compiler contracts nothing (``-ffp-contract=off``), so
each operation rounds as NumPy's does. (The GPU contracts ``a * b + c`` to fused multiply-adds: its comparison,
tests/gpu/test_optimise_rules_gpu.py, has tolerances.)
"""
import contextlib
import copy
import ctypes
import hashlib
import shutil
import subprocess
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import kernels
from fluxpy import optimise as O
from fluxpy.capturing import CaptureUnsupported, guarding, recording
from fluxpy.kernels import elementwise as E

# rule -> the kernel its step (or, for AccumGrad and SignDecay in a chain, its apply) runs
KERNEL_OF = {O.AdaGrad: "adagrad_update", O.AdaDelta: "adadelta_update", O.AdaMax: "adamax_update",
             O.OAdam: "oadam_update", O.NAdam: "nadam_update", O.RAdam: "radam_update",
             O.AdaBelief: "adabelief_update", O.Lion: "lion_update", O.SignDecay: "sign_decay_update",
             O.AccumGrad: "accum_grad_update"}
FUSED = tuple(KERNEL_OF.values()) + ("sign_decay_gradient",)
GUARDED = (O.AdaGrad, O.AdaDelta, O.Lion, O.SignDecay)   # no host-side counters: capturable, with a guard
COUNTED = (O.AdaMax, O.OAdam, O.NAdam, O.RAdam, O.AdaBelief, O.AccumGrad)   # beta^t or a count on the host

RULES = [O.AdaGrad(0.1), O.AdaGrad(0.01, eps=1e-3), O.AdaDelta(), O.AdaDelta(0.5, 1e-4), O.AdaMax(0.01),
         O.AdaMax(0.1, (0.8, 0.9), 1e-3), O.OAdam(0.01), O.OAdam(0.1, (0.9, 0.99)), O.NAdam(0.01),
         O.NAdam(0.1, (0.8, 0.95), 1e-6), O.RAdam(0.01), O.RAdam(0.1, (0.8, 0.9)), O.AdaBelief(0.01),
         O.AdaBelief(0.1, (0.5, 0.9), 1e-8), O.Lion(0.01), O.Lion(0.1, (0.5, 0.8)), O.SignDecay(0.01),
         O.SignDecay(0.5), O.AccumGrad(1), O.AccumGrad(3),
         O.OptimiserChain(O.AccumGrad(2), O.SignDecay(0.01), O.Descent(0.1)),
         O.OptimiserChain(O.SignDecay(0.1), O.Adam(0.01))]


def test_every_rule_names_a_kernel_the_gpu_registers():
    for rule, name in KERNEL_OF.items():
        assert name in E.KERNELS, rule.__name__
        fn, supports = E.KERNELS[name]
        assert fn is getattr(E, name) and supports is E.update_supports and name in E.__all__
    assert E.KERNELS["sign_decay_gradient"] == (E.sign_decay_gradient, E.update_supports)
    x = np.ones((2, 3))
    for name in FUSED:   # the CPU runs the rules' array ops
        assert kernels.find(name, x, x) is None, name


def test_the_host_counters_refusal_names_the_capturable_rules():
    for rule in GUARDED:
        assert rule.__name__ in O._HOST_COUNTERS


# -- a host stand-in for cupy.ElementwiseKernel ------------------------------------------------------------

_CTYPES = {np.dtype(np.float32): ("float", ctypes.c_float), np.dtype(np.float64): ("double", ctypes.c_double)}
_compiled = {}


def _compiler():
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _params(text):
    """``"T dx, raw float64 ok"`` -> ``[("T", False, "dx"), ("float64", True, "ok")]``."""
    out = []
    for p in text.split(","):
        words = p.split()
        raw = words[0] == "raw"
        out.append((words[-2], raw, words[-1]))
    return out


class HostElementwiseKernel:
    """``cupy.ElementwiseKernel(ins, outs, body, name)`` for NumPy arrays of one shape: ``T`` is the arrays' dtype
    (float32 or float64), a ``raw float64`` parameter a pointer, every other array one element."""

    def __init__(self, ins, outs, body, name, directory):
        self.ins, self.outs, self.body, self.name, self.directory = _params(ins), _params(outs), body, name, directory

    def __call__(self, *args):
        params = [(p, False) for p in self.ins] + [(p, True) for p in self.outs]
        assert len(args) == len(params), f"{self.name}: {len(args)} arguments for {len(params)} parameters"
        given = args   # arrays of any strides are run through C-order copies, outputs copied back
        args = [a.copy(order="C") if isinstance(a, np.ndarray) and not a.flags.c_contiguous else a for a in args]
        arrays = [a for a, ((_, raw, _), _) in zip(args, params) if isinstance(a, np.ndarray) and not raw]
        dtype = arrays[0].dtype
        for a in arrays:
            assert a.dtype == dtype and a.shape == arrays[0].shape and a.flags.c_contiguous, self.name
        ctype, cscalar = _CTYPES[dtype]
        decl, body, values = [], [], []
        for arg, ((typ, raw, name), out) in zip(args, params):
            assert typ in ("T", "float64"), typ
            if raw:
                assert isinstance(arg, np.ndarray) and arg.dtype == np.float64
                decl.append(f"const double* {name}")
                values.append(ctypes.c_void_p(arg.ctypes.data))
            elif isinstance(arg, np.ndarray):
                decl.append(f"{'' if out else 'const '}T* _raw_{name}")
                body.append(f"{'' if out else 'const '}T& {name} = _raw_{name}[_i];")
                values.append(ctypes.c_void_p(arg.ctypes.data))
            else:
                assert not out and type(arg) is dtype.type, f"{self.name}: the scalar {name} is {type(arg)}"
                decl.append(f"T {name}")
                values.append(cscalar(arg))
        source = ("#include <cmath>\nusing namespace std;\n"
                  f"typedef {ctype} T;\n"
                  f'extern "C" void {self.name}(long long _size, {", ".join(decl)}) {{\n'
                  "  for (long long _i = 0; _i < _size; ++_i) {\n    " + " ".join(body) + "\n    "
                  + self.body + "\n  }\n}\n")
        _build(source, self.name, self.directory)(ctypes.c_longlong(arrays[0].size), *values)
        for a, b, (_, out) in zip(given, args, params):
            if out and a is not b:
                a[...] = b


def _build(source, name, directory):
    fn = _compiled.get(source)
    if fn is None:
        tag = hashlib.sha1(source.encode()).hexdigest()[:16]
        src, lib = directory / f"{tag}.cpp", directory / f"{tag}.so"
        src.write_text(source)
        subprocess.run([_compiler(), "-O2", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
                        "-o", str(lib), str(src)], check=True, capture_output=True)
        fn = _compiled[source] = getattr(ctypes.CDLL(str(lib)), name)
        fn.restype = None
    return fn


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    if _compiler() is None:
        pytest.skip("needs a C++ compiler")
    return tmp_path_factory.mktemp("fused_rules")


def numpy_supports(x, dx):
    """update_supports for NumPy arrays: one float32/float64 dtype, one shape."""
    return type(x) is np.ndarray and type(dx) is np.ndarray and x.dtype == dx.dtype and x.dtype in _CTYPES \
        and x.shape == dx.shape


@pytest.fixture
def host_kernels(build_dir, monkeypatch):
    """The fused rule kernels, compiled for the host, in the table for NumPy arrays; yields the list of the
    kernels' names as they are called (``name`` or ``name + "_guarded"`` as the CUDA kernel is named)."""
    with host_kernels_in(build_dir, monkeypatch) as calls:
        yield calls


@contextlib.contextmanager
def host_kernels_in(build_dir, monkeypatch):
    calls = []

    class Kernel(HostElementwiseKernel):
        def __init__(self, ins, outs, body, name):
            super().__init__(ins, outs, body, name, build_dir)

        def __call__(self, *args):
            calls.append(self.name.removeprefix("fluxpy_"))
            return super().__call__(*args)

    fake = types.SimpleNamespace(ElementwiseKernel=Kernel, ndarray=np.ndarray, empty_like=np.empty_like)
    monkeypatch.setattr(E, "cupy", fake)
    monkeypatch.setattr(E, "_opt_kernels", {})
    before = kernels.snapshot()
    for name in FUSED:
        kernels.register(name, "numpy", getattr(E, name), numpy_supports)
    try:
        yield calls
    finally:
        kernels.restore(before)


@contextlib.contextmanager
def without_kernels():
    saved = kernels.snapshot()
    kernels.restore({k: v for k, v in saved.items() if k[0] not in FUSED})
    try:
        yield
    finally:
        kernels.restore(saved)


def flatten_state(s, out):
    """Every array (as dtype and bytes) and host value of a state, in order."""
    if isinstance(s, np.ndarray):
        out.append((s.dtype, s.shape, s.tobytes()))
    elif isinstance(s, (tuple, list)):
        for v in s:
            flatten_state(v, out)
    else:
        out.append((type(s), s))
    return out


def assert_bit_for_bit(a, b):
    fa, fb = flatten_state(a, []), flatten_state(b, [])
    assert len(fa) == len(fb)
    for p, q in zip(fa, fb):
        assert p == q


def kernels_expected(rule, dtype):
    """The kernels the steps of ``rule`` on a ``dtype`` parameter run (their names less ``_first``, ``_warmup``)."""
    half = np.dtype(dtype).itemsize == 2
    if type(rule) is O.SignDecay and half:   # Rule.step on the float32 copy: apply's kernel
        return {"sign_decay_gradient"}
    if isinstance(rule, O.OptimiserChain):
        names = set()
        for r in rule.rules:
            if type(r) is O.AccumGrad:
                names.add("accum_grad")
            elif type(r) is O.SignDecay:
                names.add("sign_decay_gradient")
        return names
    if type(rule) is O.AccumGrad:
        return {"accum_grad"}   # its accumulation, on the float32 copy of a half parameter too
    return set() if half else {KERNEL_OF[type(rule)].removesuffix("_update")}


def run_both(rule, x0, grads, exact=True):
    """``rule`` stepping a copy of ``x0`` through the kernels (registered) and another through the array path,
    compared bit for bit after every step (``exact=False``: value for value, NaN equal to any NaN); returns the
    kernel path's parameter and state."""
    x, y = x0.copy(), x0.copy()
    sx, sy = O.setup(rule, x), O.setup(rule, y)
    for g in grads:
        O.update(sx, x, g)
        with without_kernels():
            O.update(sy, y, g.copy())
        np.testing.assert_array_equal(x, y)
        if exact:
            assert x.tobytes() == y.tobytes()
            assert_bit_for_bit(sx.state, sy.state)
        else:
            for a, b in zip(flatten_state(sx.state, []), flatten_state(sy.state, [])):
                if isinstance(a[0], np.dtype):
                    np.testing.assert_array_equal(np.frombuffer(a[2], a[0]), np.frombuffer(b[2], b[0]))
                else:
                    assert a == b
    return x, sx


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_kernels_give_the_array_path_bit_for_bit(host_kernels, rule, dtype):
    rng = np.random.default_rng(0)
    shape = (5, 7)
    x0 = rng.standard_normal(shape).astype(dtype)
    x0[0, :3] = 0   # sign(0) for SignDecay
    grads = [rng.standard_normal(shape).astype(dtype) for _ in range(9)]   # RAdam is past its warm-up at t = 5
    grads[2][1, :2] = 0
    grads[1::2] = [np.ascontiguousarray(g.T).T for g in grads[1::2]]   # transposed, as a matrix product's can be
    run_both(rule, x0, grads)
    names = {c.removesuffix("_first").removesuffix("_warmup") for c in host_kernels}
    assert names == kernels_expected(rule, dtype)
    if type(rule) is O.RAdam and dtype != np.float16:
        assert {"radam_warmup", "radam"} <= set(host_kernels)   # both sides of the rectification
    if type(rule) is O.AccumGrad or isinstance(rule, O.OptimiserChain) and type(rule.rules[0]) is O.AccumGrad:
        n = rule.n if type(rule) is O.AccumGrad else rule.rules[0].n
        assert host_kernels.count("accum_grad_first") == -(-len(grads) // n)   # one per round


@settings(max_examples=20, deadline=None)
@given(which=st.integers(0, len(RULES) - 1), shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
       steps=st.integers(1, 8), scale=st.sampled_from([1e-6, 1.0, 1e3]), seed=st.integers(0, 2**31 - 1),
       double=st.booleans())
def test_kernels_give_the_array_path_bit_for_bit_on_drawn_problems(build_dir, which, shape, steps, scale, seed,
                                                                    double):
    with pytest.MonkeyPatch.context() as mp, host_kernels_in(build_dir, mp):
        rng = np.random.default_rng(seed)
        dtype = np.float64 if double else np.float32
        x0 = np.asarray(rng.standard_normal(shape), dtype)
        run_both(RULES[which], x0, [np.asarray(scale * rng.standard_normal(shape), dtype) for _ in range(steps)])


def test_non_finite_gradients_propagate_as_in_the_array_path(host_kernels):
    x0 = np.array([1.0, -2.0, 0.5, 3.0, 0.0])
    grads = [np.array([np.nan, 1.0, np.inf, -np.inf, 2.0]), np.array([1.0, np.nan, -1.0, 1.0, 0.0])]
    for rule in RULES:
        with np.errstate(all="ignore"):
            run_both(rule, x0, grads, exact=False)


# -- the guard and the capture ------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", [O.AdaGrad(0.1), O.AdaDelta(0.8), O.Lion(0.05), O.SignDecay(0.1)], ids=repr)
def test_a_guarded_step_changes_nothing_unless_the_flag_is_finite(host_kernels, rule):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4))
    state = O.setup(rule, x)
    O.update(state, x, rng.standard_normal((3, 4)))   # a state that is not all zeros
    assert rule.guarded_kernel(x, x) and not rule.guarded_kernel(x.astype(np.float16), x.astype(np.float16))
    before = copy.deepcopy((x, state.state))
    g = rng.standard_normal((3, 4))
    for flag in (np.array(np.nan), np.array(np.inf), np.array([-np.inf], np.float32)):
        with guarding(flag):
            O.update(state, x, g)
        assert_bit_for_bit((x, state.state), before)
    y, sy = copy.deepcopy((x, state))
    with guarding(np.array(0.0)):
        O.update(state, x, g)
    O.update(sy, y, g)   # unguarded: the same step
    assert_bit_for_bit((x, state.state), (y, sy.state))
    name = KERNEL_OF[type(rule)].removesuffix("_update")
    assert host_kernels.count(f"{name}_guarded") == 4 and host_kernels.count(name) == 2


@pytest.mark.parametrize("rule", [O.AdaMax(0.01), O.OAdam(0.01), O.NAdam(0.01), O.RAdam(0.01), O.AdaBelief(0.01),
                                  O.OptimiserChain(O.AccumGrad(2), O.Descent(0.1))], ids=repr)
def test_rules_with_host_counters_refuse_a_capture_before_any_change(host_kernels, rule):
    x = np.random.default_rng(2).standard_normal(6)
    state = O.setup(rule, x)
    O.update(state, x, np.ones(6))
    assert not rule.guarded_kernel(x, x)   # a checked capture refuses them too
    before = copy.deepcopy((x, state.state))
    calls = len(host_kernels)
    with recording(), pytest.raises(CaptureUnsupported, match="host-side counters"):
        O.update(state, x, np.ones(6))
    assert len(host_kernels) == calls
    assert_bit_for_bit((x, state.state), before)


def test_without_a_kernel_no_rule_steps_guarded():
    """On the CPU no fused kernel is registered: the rules run their array ops, and a checked capture (never on
    the CPU) would refuse them."""
    x = np.ones(3, np.float32)
    for rule in (O.AdaGrad(), O.AdaDelta(), O.Lion(), O.SignDecay(), O.AdaMax(), O.RAdam(), O.AccumGrad(2)):
        assert not rule.guarded_kernel(x, x)


def test_a_model_tree_steps_every_leaf_through_its_kernel(host_kernels):
    model = fluxpy.Chain(fluxpy.Dense(3, 4, fluxpy.relu, rng=0), fluxpy.Dense(4, 2, rng=1))
    twin = copy.deepcopy(model)
    x = np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)
    for rule in (O.NAdam(0.01), O.Lion(0.01)):
        st_, st2 = O.setup(rule, model), O.setup(rule, twin)
        del host_kernels[:]
        for _ in range(3):
            (g,) = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), model)
            O.update(st_, model, g)
            with without_kernels():
                O.update(st2, twin, copy.deepcopy(g))
        assert len(host_kernels) == 3 * 4   # four arrays, three steps
        for a, b in zip(fluxpy.trainables(model), fluxpy.trainables(twin)):
            assert a.tobytes() == b.tobytes()
