"""The fused steps generated from each rule's formula (``fluxpy.kernels.cuda_optimise``: ``optimiser_step`` and
``optimiser_advance``), on the CPU.

The kernels are checked without a GPU: the C that ``cuda_optimise`` generates from a formula is compiled for the
host by the C++ compiler, through a stand-in for ``cupy.ElementwiseKernel`` (the same parameter lists, ``T`` bound
to the arrays' dtype, inputs as const references and outputs as references to one element, ``raw`` parameters as
pointers, the body run once per element or ``size`` times), and put in the kernel table for NumPy arrays for a
test. The rules then step through the same Python code as on the GPU (``find``, the groups, the device counters,
the guard), and must give their NumPy path's arrays and states bit for bit: the host compiler contracts nothing
(``-ffp-contract=off``), so each operation rounds as NumPy's does. (The GPU contracts ``a * b + c`` to fused
multiply-adds: its comparison, tests/gpu/test_optimise_rules_gpu.py, has tolerances.)
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
from fluxpy.kernels import cuda_optimise as K
from fluxpy.optimise.rules import formula_of

FUSED = ("optimiser_step", "optimiser_advance")

# every exported rule, with other hyperparameters, and chains
RULES = [O.Descent(0.1), O.Momentum(0.05, 0.8), O.Nesterov(0.1, 0.7), O.RMSProp(0.01), O.RMSProp(0.01, centred=True),
         O.Adam(0.01), O.Adam(0.1, (0.8, 0.9), 1e-6), O.AdamW(0.01, lambd=0.1), O.AdamW(0.01), O.WeightDecay(0.1),
         O.ClipGrad(0.5), O.ClipNorm(1.0), O.ClipNorm(2.0, p=np.inf, throw=False), O.AdaGrad(0.1),
         O.AdaGrad(0.01, eps=1e-3), O.AdaDelta(), O.AdaDelta(0.5, 1e-4), O.AdaMax(0.01), O.AdaMax(0.1, (0.8, 0.9), 1e-3),
         O.OAdam(0.01), O.OAdam(0.1, (0.9, 0.99)), O.NAdam(0.01), O.NAdam(0.1, (0.8, 0.95), 1e-6), O.RAdam(0.01),
         O.RAdam(0.1, (0.8, 0.9)), O.AdaBelief(0.01), O.AdaBelief(0.1, (0.5, 0.9), 1e-8), O.Lion(0.01),
         O.Lion(0.1, (0.5, 0.8)), O.SignDecay(0.01), O.SignDecay(0.5), O.AccumGrad(1), O.AccumGrad(3),
         O.OptimiserChain(O.AccumGrad(2), O.SignDecay(0.01), O.Descent(0.1)),
         O.OptimiserChain(O.SignDecay(0.1), O.Adam(0.01)),
         O.OptimiserChain(O.ClipNorm(1.0), O.WeightDecay(0.1), O.Adam(0.01)),
         O.OptimiserChain(O.ClipGrad(0.3), O.RAdam(0.1, (0.8, 0.9))),
         O.OptimiserChain(O.AccumGrad(3), O.OAdam(0.01), O.WeightDecay(0.01)), O.AMSGrad(0.01),
         O.AMSGrad(0.1, (0.8, 0.9), 1e-6), O.Rprop(0.01), O.Rprop(0.1, (0.3, 1.5), (1e-3, 0.2)),
         O.OptimiserChain(O.ClipGrad(0.5), O.Rprop(0.05)), O.OptimiserChain(O.AccumGrad(2), O.AMSGrad(0.01))]


def test_every_exported_rule_has_a_formula_the_kernels_take():
    exported = {getattr(O, n) for n in O.__all__ if isinstance(getattr(O, n), type) and issubclass(getattr(O, n),
                                                                                                  O.Rule)}
    covered = {type(r) for r in RULES}
    assert exported - {O.Rule} <= covered
    for rule in RULES:
        f = formula_of(rule)
        assert f is not None, rule
        K.c_code(f, tuple(rule.hyper()))   # every formula translates
    for name in ("optimiser_step", "optimiser_step_many", "optimiser_advance"):
        assert name in K.KERNELS
    x = np.ones((2, 3))
    assert kernels.find("optimiser_step", x, formula_of(O.Adam()), x, [x, x], []) is None   # the CPU: NumPy path


def test_no_rule_switches_on_types():
    """Grouping and stepping read the rules' declarations (formula, hyper, STATE), never their types."""
    import inspect

    from fluxpy.optimise import multi, update
    for module in (multi, update):
        assert "type(rule) is" not in inspect.getsource(module) and "_is_adam" not in inspect.getsource(module)


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
        if words:
            out.append((words[-2], words[0] == "raw", words[-1]))
    return out


class HostElementwiseKernel:
    """``cupy.ElementwiseKernel(ins, outs, body, name, preamble=...)`` for NumPy arrays of one shape: ``T`` is the
    arrays' dtype (float32 or float64), a ``raw`` parameter a pointer, every other array one element, a ``float64``
    parameter a double."""

    def __init__(self, ins, outs, body, name, directory, preamble=""):
        self.ins, self.outs, self.body, self.name = _params(ins), _params(outs), body, name
        self.directory, self.preamble = directory, preamble

    def __call__(self, *args, size=None):
        params = [(p, False) for p in self.ins] + [(p, True) for p in self.outs]
        assert len(args) == len(params), f"{self.name}: {len(args)} arguments for {len(params)} parameters"
        given = args   # arrays of any strides are run through C-order copies, outputs copied back
        args = [a.copy(order="C") if isinstance(a, np.ndarray) and not a.flags.c_contiguous else a for a in args]
        arrays = [a for a, ((_, raw, _), _) in zip(args, params) if isinstance(a, np.ndarray) and not raw]
        dtype = arrays[0].dtype if arrays else np.dtype(np.float64)
        for a in arrays:
            assert a.dtype == dtype and a.shape == arrays[0].shape and a.flags.c_contiguous, self.name
        count = arrays[0].size if arrays else size
        ctype, cscalar = _CTYPES[dtype]
        decl, body, values = [], [], []
        for arg, ((typ, raw, name), out) in zip(args, params):
            assert typ in ("T", "float64"), typ
            c = "double" if typ == "float64" else "T"
            if raw:
                assert isinstance(arg, np.ndarray) and arg.dtype == (np.float64 if typ == "float64" else dtype)
                decl.append(f"{'' if out else 'const '}{c}* {name}")
                values.append(ctypes.c_void_p(arg.ctypes.data))
            elif isinstance(arg, np.ndarray):
                decl.append(f"{'' if out else 'const '}T* _raw_{name}")
                body.append(f"{'' if out else 'const '}T& {name} = _raw_{name}[_i];")
                values.append(ctypes.c_void_p(arg.ctypes.data))
            else:
                want = np.float64 if typ == "float64" else dtype.type
                assert not out and type(arg) is want, f"{self.name}: the scalar {name} is {type(arg)}"
                decl.append(f"{c} {name}")
                values.append(ctypes.c_double(arg) if typ == "float64" else cscalar(arg))
        source = ("#include <cmath>\nusing namespace std;\n#define __device__\n#define __forceinline__ inline\n"
                  f"typedef {ctype} T;\n{self.preamble}\n"
                  f'extern "C" void {self.name}(long long _size, {", ".join(decl)}) {{\n'
                  "  for (long long _i = 0; _i < _size; ++_i) {\n    " + " ".join(body) + "\n    "
                  + self.body + "\n  }\n}\n")
        _build(source, self.name, self.directory)(ctypes.c_longlong(count), *values)
        for a, b, (_, out) in zip(given, args, params):
            if out and a is not b:
                a[...] = b


def _build(source, name, directory):
    fn = _compiled.get(source)
    if fn is None:
        tag = hashlib.sha1(source.encode()).hexdigest()[:16]
        src, lib = directory / f"{tag}.cpp", directory / f"{tag}.so"
        src.write_text(source)
        run = subprocess.run([_compiler(), "-O2", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
                              "-o", str(lib), str(src)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        fn = _compiled[source] = getattr(ctypes.CDLL(str(lib)), name)
        fn.restype = None
    return fn


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    if _compiler() is None:
        pytest.skip("needs a C++ compiler")
    return tmp_path_factory.mktemp("fused_rules")


def numpy_supports(x, formula, dx, states, inputs, *_):
    """optimiser_step_supports for NumPy arrays."""
    return type(x) is np.ndarray and type(dx) is np.ndarray and x.dtype == dx.dtype and x.dtype in _CTYPES \
        and x.shape == dx.shape and all(type(s) is np.ndarray and s.dtype == x.dtype for s in states)


@pytest.fixture
def host_kernels(build_dir, monkeypatch):
    """The generated kernels, compiled for the host, in the table for NumPy arrays; yields the list of the
    kernels' names as they are called (``step``, ``step_guarded``, ``advance``, ``advance_guarded``)."""
    with host_kernels_in(build_dir, monkeypatch) as calls:
        yield calls


@contextlib.contextmanager
def host_kernels_in(build_dir, monkeypatch, log=None):
    calls = []

    class Kernel(HostElementwiseKernel):
        def __init__(self, ins, outs, body, name, preamble=""):
            super().__init__(ins, outs, body, name, build_dir, preamble)

        def __call__(self, *args, **kw):
            guarded = any(n == "fx_ok" for _, _, n in self.ins)
            calls.append(self.name.removeprefix("fluxpy_optimiser_") + ("_guarded" if guarded else ""))
            return super().__call__(*args, **kw)

    fake = types.SimpleNamespace(ElementwiseKernel=Kernel, ndarray=np.ndarray)
    monkeypatch.setattr(K, "cupy", fake)
    monkeypatch.setattr(K, "_elementwise", {})
    monkeypatch.setattr(K, "_advance_kernels", {})
    before = kernels.snapshot()

    def logged(fn):
        def kernel(*args, **kw):
            if log is not None:
                log.append((fn, args, kw))
            return fn(*args, **kw)
        return kernel
    kernels.register("optimiser_step", "numpy", logged(K.optimiser_step), numpy_supports)
    kernels.register("optimiser_advance", "numpy", logged(K.optimiser_advance))
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


def run_both(rule, x0, grads, exact=True):
    """``rule`` stepping a copy of ``x0`` through the kernels (registered) and another through the NumPy path,
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
def test_kernels_give_the_numpy_path_bit_for_bit(host_kernels, rule, dtype):
    rng = np.random.default_rng(0)
    shape = (5, 7)
    x0 = rng.standard_normal(shape).astype(dtype)
    x0[0, :3] = 0   # sign(0) for SignDecay
    grads = [rng.standard_normal(shape).astype(dtype) for _ in range(9)]   # RAdam is past its warm-up at t = 5
    grads[2][1, :2] = 0
    grads[1::2] = [np.ascontiguousarray(g.T).T for g in grads[1::2]]   # transposed, as a matrix product's can be
    run_both(rule, x0, grads)
    if dtype == np.float16:   # halves step in float32 through the NumPy path: no kernel
        assert host_kernels == []
        return
    assert host_kernels.count("step") == len(grads)
    assert host_kernels.count("advance") == (len(grads) if formula_of(rule).counters else 0)


@settings(max_examples=20, deadline=None)
@given(which=st.integers(0, len(RULES) - 1), shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
       steps=st.integers(1, 8), scale=st.sampled_from([1e-6, 1.0, 1e3]), seed=st.integers(0, 2**31 - 1),
       double=st.booleans())
def test_kernels_give_the_numpy_path_bit_for_bit_on_drawn_problems(build_dir, which, shape, steps, scale, seed,
                                                                    double):
    with pytest.MonkeyPatch.context() as mp, host_kernels_in(build_dir, mp):
        rng = np.random.default_rng(seed)
        dtype = np.float64 if double else np.float32
        x0 = np.asarray(rng.standard_normal(shape), dtype)
        run_both(RULES[which], x0, [np.asarray(scale * rng.standard_normal(shape), dtype) for _ in range(steps)])


def test_non_finite_gradients_propagate_as_in_the_numpy_path(host_kernels):
    x0 = np.array([1.0, -2.0, 0.5, 3.0, 0.0])
    grads = [np.array([np.nan, 1.0, np.inf, -np.inf, 2.0]), np.array([1.0, np.nan, -1.0, 1.0, 0.0])]
    for rule in RULES:
        if rule.needs_finite:
            continue   # ClipNorm(throw=True) refuses these gradients
        with np.errstate(all="ignore"):
            run_both(rule, x0, grads, exact=False)


def test_a_model_tree_steps_every_leaf_through_the_kernels(host_kernels):
    model = fluxpy.Chain(fluxpy.Dense(3, 4, fluxpy.relu, rng=0), fluxpy.Dense(4, 2, rng=1))
    twin = copy.deepcopy(model)
    x = np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)
    for rule in (O.NAdam(0.01), O.Lion(0.01), O.OptimiserChain(O.ClipNorm(0.5), O.WeightDecay(0.1), O.Adam(0.01))):
        st_, st2 = O.setup(rule, model), O.setup(rule, twin)
        del host_kernels[:]
        for _ in range(3):
            (g,) = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), model)
            O.update(st_, model, g)
            with without_kernels():
                O.update(st2, twin, copy.deepcopy(g))
        assert host_kernels.count("step") == 3 * 4   # four arrays, three steps, no multi-tensor kernel on the host
        for a, b in zip(fluxpy.trainables(model), fluxpy.trainables(twin)):
            assert a.tobytes() == b.tobytes()


# -- the guard and the capture ------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_a_guarded_step_changes_nothing_unless_the_flag_is_finite(host_kernels, rule):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4))
    state = O.setup(rule, x)
    for _ in range(2):
        O.update(state, x, rng.standard_normal((3, 4)))   # a state that is not all zeros
    leaf = state
    arrays = copy.deepcopy((x, [a for a in flatten_state(state.state, []) if isinstance(a[0], np.dtype)]))
    device = None if leaf._counters is None else leaf._counters[0].copy()
    y, sy = copy.deepcopy((x, state))
    g = rng.standard_normal((3, 4))
    for flag in (np.array(np.nan), np.array(np.inf), np.array([-np.inf], np.float32)):
        with guarding(flag):
            O.update(state, x, g)
        assert x.tobytes() == arrays[0].tobytes()
        assert [a for a in flatten_state(state.state, []) if isinstance(a[0], np.dtype)] == arrays[1]
        if device is not None:   # the device counters stay where a skipped step leaves them
            assert leaf._counters[0].tobytes() == device.tobytes()
    assert "step_guarded" in host_kernels
    # (the host's copy of the counters moved on: in a captured step the caller undoes the host side of a skipped
    # step, TrainStep's undo; the kernels read the device's)
    with guarding(np.array(0.0)):
        O.update(state, x, g)
    with without_kernels():
        O.update(sy, y, g)   # unguarded, on arrays: the same step
    assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("rule", [r for r in RULES if not formula_of(r).inputs], ids=repr)
def test_a_captured_step_replayed_gives_the_eager_steps(build_dir, rule):
    """A capture on the host: the kernels the captured update launches are recorded and run again for each
    "replay" with the next gradient written into the same buffer, then the replay hooks; the parameter, the
    state arrays and the host counters then match eager steps, and the device counters moved with them. Every rule
    (counters included) captures: none refuses."""
    rng = np.random.default_rng(4)
    x0 = rng.standard_normal((4, 3))
    grads = [rng.standard_normal((4, 3)) for _ in range(7)]
    y, sy = x0.copy(), O.setup(rule, x0.copy())
    for g in grads:
        O.update(sy, y, g.copy())
    log = []
    with pytest.MonkeyPatch.context() as mp, host_kernels_in(build_dir, mp, log):
        x, sx = x0.copy(), O.setup(rule, x0.copy())
        buffer = grads[0].copy()
        with recording() as hooks:
            O.update(sx, x, buffer)   # the capture runs the step once
        assert log
        for g in grads[1:]:
            buffer[...] = g
            for fn, args, kw in log:
                fn(*args, **kw)
            for hook in hooks:
                hook()
    assert x.tobytes() == y.tobytes()
    assert_bit_for_bit(sx.state, sy.state)


def test_without_a_kernel_the_rules_with_counters_refuse_a_capture_before_any_change():
    """On the CPU no kernel is registered: the NumPy path's counters are host numbers, which a graph would freeze
    (never on the CPU, but the refusal is what a GPU half parameter gets)."""
    for rule in (O.AdaMax(0.01), O.RAdam(0.01), O.OptimiserChain(O.AccumGrad(2), O.Descent(0.1))):
        x = np.random.default_rng(2).standard_normal(6)
        state = O.setup(rule, x)
        before = copy.deepcopy((x, state.state))
        with recording(), pytest.raises(CaptureUnsupported, match="host-side counters"):
            O.update(state, x, np.ones(6))
        assert_bit_for_bit((x, state.state), before)


def test_a_chain_with_clipnorm_later_than_first_has_no_fused_step():
    """ClipNorm's scale is computed from the gradient that enters the chain: later in a chain it is array ops."""
    assert formula_of(O.OptimiserChain(O.WeightDecay(0.1), O.ClipNorm(1.0), O.Adam())) is None
    assert formula_of(O.OptimiserChain(O.ClipNorm(1.0), O.WeightDecay(0.1), O.Adam())) is not None
