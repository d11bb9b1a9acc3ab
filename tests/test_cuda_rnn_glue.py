"""The host code of fluxpy.kernels.cuda_rnn (the glue from fluxpy.ops.rnn to cuDNN's RNN calls) on the CPU: CuPy's
memory stood in for by host bytes, cuDNN's calls by NumPy stand-ins that follow their contracts (a None pointer
is a zero state or a result not written; the backward weights' call reads what the backward data's call left in
the reserve space; weight gradients are added into a zeroed space). What this checks: the packing of fluxpy's
arrays at the plan's offsets, the output buffer's parts, which arrays go to which call, the needs mask, the
gradients' order and shapes. cuDNN itself runs in tests/gpu/test_cudnn_rnn_gpu.py."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

import fluxpy
from fluxpy import kernels
from fluxpy.kernels import cuda_rnn
from fluxpy.ops import rnn as rnn_module
from fluxpy.ops.rnn import RNNDims, rnn


class _Memory:
    """A stand-in for CuPy's ``MemoryPointer`` over host bytes: offsets, memset and copies as CuPy's."""

    def __init__(self, buf, offset=0):
        self.buf, self.offset = buf, offset

    def __add__(self, n):
        return _Memory(self.buf, self.offset + n)

    def memset_async(self, value, n, stream):
        self.buf[self.offset:self.offset + n] = value

    def copy_from_device_async(self, src, n, stream):
        self.buf[self.offset:self.offset + n] = src.buf[src.offset:src.offset + n]


class _Device(np.ndarray):
    """A NumPy array whose ``data`` is a :class:`_Memory` (what the glue copies from), as a CuPy array's."""

    @property
    def data(self):
        return _Memory(np.ascontiguousarray(self).view(np.uint8).reshape(-1))


def _fake_cupy():
    return SimpleNamespace(
        cuda=SimpleNamespace(alloc=lambda n: _Memory(np.full(n, 0xAB, np.uint8)), get_current_stream=lambda: None),
        ascontiguousarray=lambda a: np.ascontiguousarray(a).view(_Device),
        empty=lambda shape, dtype: np.full(shape, np.nan, dtype).view(_Device),
        ndarray=lambda shape, dtype, mem: np.ndarray(shape, dtype, buffer=mem.buf, offset=mem.offset))


def _plan(dims, gap=3):
    """A plan whose blocks lie apart (``gap`` elements between them), each layer's biases after its matrices."""
    offsets, at = [], 5
    for k in range(dims.num_layers * dims.directions):
        rows = dims.gates * dims.hidden
        sizes = [int(np.prod(s)) for s in dims.weight_shapes(k)[:2]] + [rows, rows]
        starts = []
        for n in sizes:
            starts.append(at)
            at += n + gap
        offsets.append(tuple(starts) if dims.bias else tuple(starts[:2]) + (None, None))
    return SimpleNamespace(dims=dims, dtype=dims.dtype, weight_bytes=at * dims.dtype.itemsize, weight_elements=at,
                           offsets=offsets)


def test_the_weights_are_packed_and_unpacked_where_the_plan_says(monkeypatch):
    """Each of fluxpy's arrays lands at its offset in the weight space, everything else (cuDNN's recurrent biases,
    gaps) is zero, and the gradients come back as the parameters' shapes from their offsets, in their order."""
    monkeypatch.setattr(cuda_rnn, "cupy", _fake_cupy())
    rng = np.random.default_rng(0)
    for bias in (True, False):
        dims = RNNDims("gru", 2, 3, 4, 5, 2, True, bias, np.dtype(np.float32))
        plan = _plan(dims)
        flat = [rng.standard_normal(s).astype(np.float32) for k in range(4) for s in dims.weight_shapes(k)]
        w = cuda_rnn._pack(plan, flat)
        per = 3 if bias else 2
        written = np.zeros(plan.weight_elements, bool)
        for k, starts in enumerate(plan.offsets):
            for j, a in enumerate(flat[k * per:(k + 1) * per]):
                np.testing.assert_array_equal(w[starts[j]:starts[j] + a.size], a.ravel())
                written[starts[j]:starts[j] + a.size] = True
        assert not w[~written].any(), "the weight space outside fluxpy's arrays (recurrent biases, gaps) is not zero"
        grads = cuda_rnn._unpack(plan, w, [True] * len(flat))
        assert [g.shape for g in grads] == [a.shape for a in flat]
        for g, a in zip(grads, flat):
            np.testing.assert_array_equal(g, a)
        assert cuda_rnn._unpack(plan, w, [False] * len(flat)) == [None] * len(flat)


def _weights_of(plan, weights):
    """The (w_ih, w_hh, bias) triples a packed weight space holds (the stand-ins' reading of it)."""
    flat = cuda_rnn._unpack(plan, weights, [True] * sum(len(plan.dims.weight_shapes(k))
                                                        for k in range(len(plan.offsets))))
    per = 3 if plan.dims.bias else 2
    return [tuple(flat[k * per:(k + 1) * per]) + ((None,) if not plan.dims.bias else ())
            for k in range(len(plan.offsets))]


class _FakeCudnn:
    """cuDNN's three RNN calls in NumPy (the composite), following their contracts (the backward data's call gets
    no ``x``: it reads the reserve space, where this forward keeps its inputs); records the calls."""

    def __init__(self, dims):
        self.the_plan, self.calls = _plan(dims), []

    def plan(self, dims):
        assert dims == self.the_plan.dims
        return self.the_plan

    def _run(self, x, hx, cx, weights):
        return rnn_module._composite(self.the_plan.dims, None, x, _weights_of(self.the_plan, weights), hx, cx)

    def forward(self, p, lengths, x, hx, cx, weights, y, hy, cy, training):
        self.calls.append(("forward", training, hx is None, cx is None))
        out = self._run(x, hx, cx, weights)
        for dst, src in zip((y, hy, cy), out):
            if dst is not None:
                dst[...] = np.ravel(src)
        return dict(x=np.array(x), hx=hx, cx=cx, weights=np.array(weights)) if training else None

    def _loss(self, reserve, x, hx, cx, weights):
        return sum((a * c).sum() for a, c in zip(self._run(x, hx, cx, weights), reserve["cotangents"]))

    def backward_data(self, p, lengths, y, dy, dx, hx, dhy, dhx, cx, dcy, dcx, weights, reserve):
        self.calls.append(("backward_data", dhx is None, dcx is None))
        dims = p.dims
        reserve["cotangents"] = [a.reshape(s) for a, s in zip((dy, dhy, dcy), (dims.y_shape, dims.state_shape,
                                                                               dims.state_shape)) if a is not None]
        zero = np.zeros(dims.state_shape)
        grads = fluxpy.gradient(lambda x, hx, cx: self._loss(reserve, x, hx, cx, weights), reserve["x"],
                                zero if hx is None else hx, zero if cx is None else cx)
        for dst, src in zip((dx, dhx, dcx), grads):
            if dst is not None:
                dst[...] = src.reshape(dst.shape)

    def backward_weights(self, p, lengths, x, hx, y, dweights, reserve):
        self.calls.append(("backward_weights",))
        assert "cotangents" in reserve, "the weights' call ran before the data's"
        np.testing.assert_array_equal(x, reserve["x"])
        grad = fluxpy.gradient(lambda w: self._loss(reserve, x, hx, reserve["cx"], w), reserve["weights"])[0]
        dweights += grad   # CUDNN_WGRAD_MODE_ADD


@pytest.mark.parametrize("mode, layers, bidirectional, bias, states", [
    ("lstm", 2, True, True, True), ("lstm", 1, False, True, False), ("gru", 3, False, False, True),
    ("rnn_relu", 1, True, True, False)])
def test_the_glue_gives_the_composites_values_and_gradients(monkeypatch, mode, layers, bidirectional, bias, states):
    """The op through cuda_rnn's rnn_forward and rnn_backward (registered for NumPy arrays, over the stand-ins)
    against the composite: outputs, final states and the gradients of x, the initial states and every weight."""
    dims = RNNDims(mode, 3, 4, 2, 3, layers, bidirectional, bias, np.dtype(np.float64))
    fake = _FakeCudnn(dims)
    monkeypatch.setattr(cuda_rnn, "cupy", _fake_cupy())
    monkeypatch.setattr(cuda_rnn, "cudnn_rnn", fake)
    rng = np.random.default_rng(4)
    w = [tuple(rng.standard_normal(s) * 0.5 for s in dims.weight_shapes(k)) + ((None,) if not bias else ())
         for k in range(layers * dims.directions)]
    x = rng.standard_normal((3, 4, 2))
    h0 = rng.standard_normal(dims.state_shape) if states else None
    c0 = rng.standard_normal(dims.state_shape) if states and mode == "lstm" else None
    dy, dh, dc = (rng.standard_normal(s) for s in (dims.y_shape, dims.state_shape, dims.state_shape))
    kind = mode.split("_")[0]
    act = fluxpy.relu if mode == "rnn_relu" else None

    def loss(x, h0, c0, w):
        y, h, c = rnn(x, w, h0, c0, mode=kind, act=act, num_layers=layers, bidirectional=bidirectional)
        return (y * dy).sum() + (h * dh).sum() + ((c * dc).sum() if c is not None else 0)
    want = fluxpy.withgradient(loss, x, h0, c0, w)
    table = kernels.snapshot()
    try:
        kernels.register("rnn_forward", "numpy", cuda_rnn.rnn_forward, lambda dims, *arrays: True)
        kernels.register("rnn_backward", "numpy", cuda_rnn.rnn_backward)
        got = fluxpy.withgradient(loss, x, h0, c0, w)
    finally:
        kernels.restore(table)
    assert fake.calls == [("forward", True, h0 is None, c0 is None), ("backward_data", h0 is None, c0 is None),
                          ("backward_weights",)]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    for a, b, what in zip(got[1][:3], want[1][:3], ("dx", "dh0", "dc0")):
        assert (a is None) == (b is None), what
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=what)
    for k, (ga, gb) in enumerate(zip(got[1][3], want[1][3])):
        for a, b in zip(ga, gb):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=f"layer-and-direction {k}")


def test_supports_declines_what_cudnn_turns_down_and_raises_on_a_bug(monkeypatch):
    """A plan cuDNN refuses as NOT_SUPPORTED (or, for bfloat16, BAD_PARAM) is remembered and the composite runs;
    any other failure raises; other cells, dtypes and mixed arrays are declined before cuDNN is asked."""
    from fluxpy.kernels.cudnn.errors import CudnnError
    from fluxpy.kernels.halfs import BFLOAT16
    status = {}

    def plan(dims):
        if dims in status:
            raise CudnnError("cudnnSetRNNDescriptor_v8", status[dims])
        return "a plan"
    monkeypatch.setattr(cuda_rnn, "cupy", SimpleNamespace(ndarray=np.ndarray))
    real = cuda_rnn.cudnn_rnn
    monkeypatch.setattr(cuda_rnn, "cudnn_rnn", SimpleNamespace(MODES=real.MODES, plan=plan, available=lambda: True,
                                                               algorithm=real.algorithm,
                                                               ALGO_STANDARD=real.ALGO_STANDARD))
    monkeypatch.setattr(cuda_rnn, "_declined", set())
    f32 = np.dtype(np.float32)
    ok = RNNDims("lstm", 2, 3, 4, 5, 1, False, True, f32)
    x = np.ones((2, 3, 4), np.float32)
    assert cuda_rnn.supports(ok, x)
    assert not cuda_rnn.supports(RNNDims("rnn", 2, 3, 4, 5, 1, False, True, f32), x)   # an activation cuDNN lacks
    assert not cuda_rnn.supports(ok, x.astype(np.float64))
    assert not cuda_rnn.supports(RNNDims("lstm", 0, 3, 4, 5, 1, False, True, f32), x[:0])
    refused = RNNDims("gru", 2, 3, 4, 5, 2, True, True, f32)
    status[refused] = 3000
    assert not cuda_rnn.supports(refused, x) and refused in cuda_rnn._declined
    half = RNNDims("gru", 2, 3, 4, 200, 2, True, True, BFLOAT16)   # past the persistent kernels: run in bfloat16
    status[half] = 2000
    assert not cuda_rnn.supports(half, x.astype(BFLOAT16))
    small = RNNDims("gru", 2, 3, 4, 6, 2, True, True, BFLOAT16)   # planned (and computed) in float32
    status[small] = 2000
    assert cuda_rnn.computed_as(small).dtype == f32 and cuda_rnn.supports(small, x.astype(BFLOAT16))
    bug = RNNDims("gru", 2, 3, 4, 7, 2, True, True, f32)
    status[bug] = 2000
    with pytest.raises(CudnnError, match="CUDNN_STATUS_BAD_PARAM"):
        cuda_rnn.supports(bug, x)


@pytest.mark.parametrize("faster", ["half", "float32"])
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_a_half_problem_runs_as_the_faster_of_its_two_timed_forms(monkeypatch, faster, half):
    """A half problem's first call outside a capture times its forward and backward in its own type and in float32
    (on its own inputs) and keeps the faster; later calls run that without timing again; a backward runs as its
    forward ran even where the choice changed in between; a first call inside a capture runs the rule, untimed."""
    from fluxpy.kernels.halfs import BFLOAT16
    dtype = BFLOAT16 if half == "bfloat16" else np.dtype(np.float16)
    dims = RNNDims("gru", 4, 5, 3, 6, 1, False, True, dtype)
    capturing = [False]
    ran = []
    monkeypatch.setattr(cuda_rnn, "cupy", SimpleNamespace(cuda=SimpleNamespace(
        get_current_stream=lambda: SimpleNamespace(is_capturing=lambda: capturing[0]))))
    monkeypatch.setattr(cuda_rnn, "cudnn_rnn", SimpleNamespace(plan=lambda d: "a plan",
                                                               algorithm=cuda_rnn.cudnn_rnn.algorithm,
                                                               ALGO_STANDARD=cuda_rnn.cudnn_rnn.ALGO_STANDARD))
    monkeypatch.setattr(cuda_rnn, "_timed", {})
    monkeypatch.setattr(cuda_rnn, "_forward", lambda d, run, *a: ran.append(("forward", run.dtype)) or ("out", (run,)))
    monkeypatch.setattr(cuda_rnn, "_backward", lambda d, lengths, saved, *a: ran.append(("backward", saved[0].dtype)))
    wanted = dtype if faster == "half" else np.dtype(np.float32)

    def time_ms(run, hide_host):   # each candidate's step ran here; the wanted one measured faster (the half
        run()                      # type by more than the margin)
        return 1.0 if ran[-1] == ("backward", wanted) else 1.0 / cuda_rnn._HALF_MARGIN ** 2
    monkeypatch.setattr(cuda_rnn.compiler, "time_ms", time_ms)
    capturing[0] = True
    cuda_rnn.rnn_forward(dims, None, None, None, None, [], True)
    rule = cuda_rnn.computed_as(dims).dtype
    assert ran == [("forward", rule)] and not cuda_rnn._timed, "timed inside a capture"
    capturing[0] = False
    ran.clear()
    _, saved = cuda_rnn.rnn_forward(dims, None, None, None, None, [], True)
    f32 = np.dtype(np.float32)
    assert set(ran[:-1]) == {("forward", dtype), ("backward", dtype), ("forward", f32), ("backward", f32)}
    assert ran[-1] == ("forward", wanted) and cuda_rnn.computed_as(dims).dtype == wanted
    ran.clear()
    cuda_rnn.rnn_forward(dims, None, None, None, None, [], True)
    assert ran == [("forward", wanted)], "timed a second time"
    other = f32 if wanted == dtype else dtype
    cuda_rnn._timed[dims] = dataclasses.replace(dims, dtype=other)
    ran.clear()
    cuda_rnn.rnn_backward(dims, None, saved, None, None, None, [], None, None, [True] * 3)
    assert ran == [("backward", wanted)], "the backward ran otherwise than its forward"


def _timing_alone(mode, monkeypatch):
    """A float16 problem of ``mode`` whose timing runs nothing (plans, forward and backward stood in for): the
    test's stand-in ``time_ms`` decides."""
    monkeypatch.setattr(cuda_rnn, "cudnn_rnn", SimpleNamespace(plan=lambda d: "a plan"))
    monkeypatch.setattr(cuda_rnn, "_timed", {})
    monkeypatch.setattr(cuda_rnn, "_forward", lambda d, run, *a: ("out", (run,)))
    monkeypatch.setattr(cuda_rnn, "_backward", lambda *a: None)
    return RNNDims(mode, 4, 5, 3, 6, 1, False, True, np.dtype(np.float16))


def test_a_half_problem_runs_in_float32_unless_its_own_type_wins_by_the_margin(monkeypatch):
    """A half type timed faster than float32 but within the margin is not taken: float32 runs."""
    dims = _timing_alone("lstm", monkeypatch)
    for half_ms, want in ((0.99, np.float32), (0.5, np.float16)):
        times = iter([1.0, half_ms] * cuda_rnn._ROUNDS)   # float32 first, then the half type, each round
        monkeypatch.setattr(cuda_rnn.compiler, "time_ms", lambda run, hide_host: next(times))
        cuda_rnn._time_choice(dims, None, None, None, None, [])
        assert cuda_rnn.computed_as(dims).dtype == want


def test_a_half_problem_is_chosen_by_the_best_of_its_rounds(monkeypatch):
    """One slow round of float32 (a cold first call) does not decide: each candidate's best round is compared."""
    dims = _timing_alone("gru", monkeypatch)
    rounds = [2.0, 0.7] + [0.6, 0.7] * (cuda_rnn._ROUNDS - 1)   # float32 slow only in the first round
    times = iter(rounds)
    monkeypatch.setattr(cuda_rnn.compiler, "time_ms", lambda run, hide_host: next(times))
    cuda_rnn._time_choice(dims, None, None, None, None, [])
    assert cuda_rnn.computed_as(dims).dtype == np.float32
    assert next(times, None) is None, "every round was timed"


def test_a_half_plan_cudnn_turns_down_runs_in_float32_and_a_bug_raises(monkeypatch):
    """Timing a half problem whose half plan cuDNN refuses as NOT_SUPPORTED keeps float32 (nothing to time);
    another status is a bug and raises."""
    from fluxpy.kernels.cudnn.errors import CudnnError
    dims = RNNDims("gru", 4, 5, 3, 6, 1, False, True, np.dtype(np.float16))
    status = [3000]

    def plan(d):
        if d.dtype == np.float16:
            raise CudnnError("cudnnSetRNNDescriptor_v8", status[0])
        return "a plan"
    timed = []
    monkeypatch.setattr(cuda_rnn, "cudnn_rnn", SimpleNamespace(plan=plan))
    monkeypatch.setattr(cuda_rnn, "_timed", {})
    monkeypatch.setattr(cuda_rnn, "_forward", lambda d, run, *a: timed.append(run.dtype) or ("out", (run,)))
    monkeypatch.setattr(cuda_rnn, "_backward", lambda *a: None)
    monkeypatch.setattr(cuda_rnn.compiler, "time_ms", lambda run, hide_host: run() or 1.0)
    cuda_rnn._time_choice(dims, None, None, None, None, [])
    assert cuda_rnn.computed_as(dims).dtype == np.float32 and timed == []
    status[0] = 2000   # BAD_PARAM for float16: not a refusal this library makes of the data type
    cuda_rnn._timed.clear()
    with pytest.raises(CudnnError):
        cuda_rnn._time_choice(dims, None, None, None, None, [])
