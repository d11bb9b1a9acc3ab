"""The fused recurrent gates on the GPU (fluxpy.kernels.cuda_recurrent: one kernel forward, one backward, per step)
against the CPU: the ops lstm_gates and gru_gates over dtypes (float64, float32, float16, bfloat16) and operand
shapes (a step's strided slice of a projected sequence, a vector state for the batch, no hidden gates, one
unbatched row, broadcast cotangents), the RNN, LSTM and GRU layers forward and backward over dtypes and sizes,
the kernels really taking the cell loop's calls (counted), second derivatives through the composites on CuPy.

Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere). Run:
``python -m pytest -q tests/gpu/test_recurrent_gpu.py -p no:cacheprovider``.
"""
import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy import kernels
from fluxpy.functors import fmap
from fluxpy.kernels import cuda_recurrent, find
from fluxpy.ops import gru_gates, lstm_gates, stack
from gradcheck import check_grad, check_second_order
from sweeps import case_id, sweep
from test_half_conv_matmul import BF16

pytestmark = pytest.mark.gpu

DTYPES = [np.float64, np.float32, np.float16, BF16]
# Errors relative to 1 + max|reference|. Ops: about a rounding of a float32 result (gradients: 4 times that). The
# same tests on the CPU kernels (which round as the GPU's do) measured at most 1.2e-7 (float32), 6.5e-4 (float16),
# 4.7e-3 (bfloat16), gradients included.
TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 3e-6, np.dtype(np.float16): 2e-3, BF16: 1.6e-2}
# Layers (errors carried over the steps): the CPU layers in these dtypes measured at most 6e-7, 1.8e-3 and 1.4e-2
# on the sizes below; cuDNN's persistent small-hidden kernels (PyTorch's choice for float32 too) 1.4e-5 in float32
# (a weight gradient of the tanh RNN).
LAYER_TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 3e-5, np.dtype(np.float16): 1e-2, BF16: 6e-2}


def _dev(a):
    """A host array on the device, its dtype kept (bfloat16 through its bits)."""
    cp = cupy_module()
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    return cp.asarray(a.view(np.uint16)).view(a.dtype) if a.dtype == BF16 else cp.asarray(a)


def _host64(a):
    """A CuPy or NumPy array (any float dtype) as a float64 NumPy array."""
    cp = cupy_module()
    a = fluxpy.value_of(a)
    if isinstance(a, cp.ndarray):
        a = cp.asnumpy(a.view(np.uint16)).view(BF16) if a.dtype == BF16 else cp.asnumpy(a)
    return (a.astype(np.float32) if a.dtype == BF16 else a).astype(np.float64)


def _rounded(a, dtype):
    """A float64 host array rounded to ``dtype`` (what the device receives), and that as float64."""
    r = a.astype(np.float32).astype(dtype) if np.dtype(dtype) != np.float64 else a
    return r, _host64(r)


def _close(got, want, dtype, what, scale=1.0, table=TOL):
    g, w = _host64(got), _host64(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape}, CPU {w.shape}"
    tol = table[np.dtype(dtype)] * scale
    err = np.abs(g - w).max() if g.size else 0.0
    bound = tol * (1 + np.abs(w).max())
    assert err <= bound, f"{what}: max error {err:.3g} above {bound:.3g}"


# operand shapes: (gates or gi, state, gates_h or gh); "strided" takes the gates as a step of an (N, T, G H) array
LSTM_CASES = {
    "plain": ((6, 4 * 5), (6, 5), (6, 4 * 5), False),
    "strided step": ((6, 4 * 5), (6, 5), (6, 4 * 5), True),
    "vector state": ((6, 4 * 7), (7,), (6, 4 * 7), True),
    "no gates_h": ((3, 4 * 33), (3, 33), None, False),
    "vector gates_h": ((4, 4 * 3), (4, 3), (4 * 3,), False),
    "one row": ((4 * 9,), (9,), (4 * 9,), False),
    "wide": ((64, 4 * 512), (64, 512), (64, 4 * 512), True),
}
GRU_CASES = {
    "plain": ((6, 3 * 5), (6, 3 * 5), (6, 5), False),
    "strided step": ((6, 3 * 5), (6, 3 * 5), (6, 5), True),
    "vector state": ((6, 3 * 7), (6, 3 * 7), (7,), True),
    "vector gh": ((4, 3 * 3), (3 * 3,), (4, 3), False),
    "one row": ((3 * 9,), (3 * 9,), (9,), False),
    "wide": ((64, 3 * 512), (64, 3 * 512), (64, 512), True),
}


def _strided(a, dtype, strided):
    """``a`` on the device; with ``strided``, as the step t = 1 of an (N, 3, width) array (row stride 3 width)."""
    if not strided:
        return _dev(a)
    big = np.random.default_rng(9).standard_normal((a.shape[0], 3, a.shape[1])).astype(np.float32).astype(a.dtype)
    big[:, 1] = a
    return _dev(big)[:, 1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(LSTM_CASES))
def test_lstm_gates_match_the_cpu(case, dtype):
    gs, cs, hs, strided = LSTM_CASES[case]
    rng = np.random.default_rng(1)
    (g, g64), (c, c64) = _rounded(rng.standard_normal(gs) * 2, dtype), _rounded(rng.standard_normal(cs), dtype)
    gh, gh64 = _rounded(rng.standard_normal(hs) * 2, dtype) if hs is not None else (None, None)
    dg, dc, dgh = _strided(g, dtype, strided), _dev(c), _dev(gh)
    assert find("lstm_gates_forward", dg, dc, dgh, True) is cuda_recurrent.lstm_gates_forward
    h, cn = lstm_gates(dg, dc, dgh)
    h64, c64n = lstm_gates(g64, c64, gh64)
    assert h.dtype == np.dtype(dtype) and cn.dtype == np.dtype(dtype)
    _close(h, h64, dtype, "h")
    _close(cn, c64n, dtype, "c")
    cot, cot64 = _rounded(rng.standard_normal((2,) + h64.shape), dtype)
    dcot = _dev(cot)
    args = (dg, dc) if gh is None else (dg, dc, dgh)
    args64 = (g64, c64) if gh is None else (g64, c64, gh64)
    got = fluxpy.gradient(lambda *a: (stack(lstm_gates(*a)) * dcot).sum(), *args)
    want = fluxpy.gradient(lambda *a: (stack(lstm_gates(*a)) * cot64).sum(), *args64)
    for name, a, w in zip(("dgates", "dc_prev", "dgates_h"), got, want):
        assert a.dtype == np.dtype(dtype)
        _close(a, w, dtype, name, scale=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(GRU_CASES))
def test_gru_gates_match_the_cpu(case, dtype):
    is_, hs, ps, strided = GRU_CASES[case]
    rng = np.random.default_rng(2)
    (gi, gi64), (gh, gh64), (hp, hp64) = (_rounded(rng.standard_normal(s) * 2, dtype) for s in (is_, hs, ps))
    dgi, dgh, dhp = _strided(gi, dtype, strided), _dev(gh), _dev(hp)
    assert find("gru_gates_forward", dgi, dgh, dhp, True) is cuda_recurrent.gru_gates_forward
    h = gru_gates(dgi, dgh, dhp)
    h64 = gru_gates(gi64, gh64, hp64)
    assert h.dtype == np.dtype(dtype)
    _close(h, h64, dtype, "h")
    cot, cot64 = _rounded(rng.standard_normal(h64.shape), dtype)
    dcot = _dev(cot)
    got = fluxpy.gradient(lambda *a: (gru_gates(*a) * dcot).sum(), dgi, dgh, dhp)
    want = fluxpy.gradient(lambda *a: (gru_gates(*a) * cot64).sum(), gi64, gh64, hp64)
    for name, a, w in zip(("dgi", "dgh", "dh_prev"), got, want):
        assert a.dtype == np.dtype(dtype)
        _close(a, w, dtype, name, scale=4)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
def test_broadcast_cotangents_are_read_in_place(dtype):
    """A cotangent with every stride 0 (what ``.sum()`` pulls back) or transposed: the backward kernels read it
    where it lies, and agree with the CPU kernels on the same numbers."""
    from fluxpy.kernels import cpu_recurrent
    cp = cupy_module()
    rng = np.random.default_rng(3)
    g, c = (_rounded(rng.standard_normal(s), dtype)[0] for s in ((5, 16), (5, 4)))
    y, act = cuda_recurrent.lstm_gates_forward(_dev(g), _dev(c), None, True)
    y_cpu, act_cpu = cpu_recurrent.lstm_gates_forward(g, c, None, True)
    _close(y, y_cpu, dtype, "y")
    dt = _rounded(rng.standard_normal((4, 5, 2)), dtype)[0]
    for dy, dy_cpu in ((cp.broadcast_to(_dev(np.full((), 0.75, dtype)), y.shape), np.full(y_cpu.shape, 0.75, dtype)),
                       (_dev(dt).T, dt.T)):
        assert cuda_recurrent.lstm_backward_supports(dy, act, y, _dev(c))
        for a, w in zip(cuda_recurrent.lstm_gates_backward(dy, act, y, _dev(c)),
                        cpu_recurrent.lstm_gates_backward(dy_cpu, act_cpu, y_cpu, c)):
            _close(a, w, dtype, "lstm backward", scale=4)
    gi, hp = (_rounded(rng.standard_normal(s), dtype)[0] for s in ((5, 12), (5, 4)))
    h, act = cuda_recurrent.gru_gates_forward(_dev(gi), _dev(gi), _dev(hp), True)
    _, act_cpu = cpu_recurrent.gru_gates_forward(gi, gi, hp, True)
    dh = cp.broadcast_to(_dev(np.full((), 0.75, dtype)), h.shape)
    assert cuda_recurrent.gru_backward_supports(dh, act, _dev(hp))
    for a, w in zip(cuda_recurrent.gru_gates_backward(dh, act, _dev(hp)),
                    cpu_recurrent.gru_gates_backward(np.full(h.shape, 0.75, dtype), act_cpu, hp)):
        _close(a, w, dtype, "gru backward", scale=4)


def test_second_derivatives_on_the_gpu():
    """Nested gradients run the composites with CuPy ops: finite differences of Hessian-vector products."""
    cp = cupy_module()
    rng = np.random.default_rng(4)
    g, c, gh = (cp.asarray(rng.standard_normal(s)) for s in ((3, 8), (3, 2), (3, 8)))
    check_grad(lambda g, c, gh: stack(lstm_gates(g, c, gh)), g, c, gh, rng=rng)
    check_second_order(lambda g, c, gh: stack(lstm_gates(g, c, gh)), g, c, gh, rng=rng)
    gi, gh3, hp = (cp.asarray(rng.standard_normal(s)) for s in ((3, 6), (3, 6), (3, 2)))
    check_grad(gru_gates, gi, gh3, hp, rng=rng)
    check_second_order(gru_gates, gi, gh3, hp, rng=rng)


MAKERS = {"rnn": fluxpy.RNN, "lstm": fluxpy.LSTM, "gru": fluxpy.GRU}
SIZES = [(2, 5, 3, 4), (7, 13, 16, 33), (32, 20, 64, 128)]   # (N, T, in, hidden)


def _model(kind, n_in, hidden, dtype):
    """The float64 host layer with random biases, and its copy in ``dtype`` on the device."""
    layer = fluxpy.f64(MAKERS[kind](n_in, hidden, rng=5))
    layer.cell.bias[...] = np.random.default_rng(6).standard_normal(layer.cell.bias.shape) * 0.5
    host = fmap(lambda a: _rounded(a, dtype)[1] if fluxpy.backend.is_array(a) else a, layer)
    dev = fmap(lambda a: _dev(_rounded(a, dtype)[0]) if fluxpy.backend.is_array(a) else a, layer)
    return host, dev


@pytest.mark.parametrize("kind, size, dtype", sweep(sorted(MAKERS), SIZES, DTYPES), ids=case_id)
def test_layers_match_the_cpu(kind, size, dtype):
    """Outputs, the final state and every gradient (input, initial state, weights) of a layer in ``dtype`` on the
    GPU against the float64 CPU layer on the same (rounded) numbers."""
    n, steps, n_in, hidden = size
    rng = np.random.default_rng(7)
    host, dev = _model(kind, n_in, hidden, dtype)
    (x, x64), (h0, h064), (c0, c064) = (_rounded(rng.standard_normal(s), dtype)
                                         for s in ((n, steps, n_in), (n, hidden), (n, hidden)))
    (dy, dy64), (ds, ds64) = (_rounded(rng.standard_normal(s), dtype) for s in ((n, steps, hidden), (n, hidden)))
    ddy, dds = _dev(dy), _dev(ds)

    def loss(m, x, h0, c0, dy, ds):
        y, state = m(x, (h0, c0) if kind == "lstm" else h0, return_state=True)
        last = state[1] if kind == "lstm" else state
        return (y * dy).sum() + (last * ds).sum()
    y, state = dev(_dev(x), (_dev(h0), _dev(c0)) if kind == "lstm" else _dev(h0), return_state=True)
    y64, state64 = host(x64, (h064, c064) if kind == "lstm" else h064, return_state=True)
    assert y.dtype == np.dtype(dtype)
    _close(y, y64, dtype, "y", table=LAYER_TOL)
    for a, w in zip(state if kind == "lstm" else (state,), state64 if kind == "lstm" else (state64,)):
        _close(a, w, dtype, "final state", table=LAYER_TOL)
    got = fluxpy.gradient(lambda *a: loss(*a, ddy, dds), dev, _dev(x), _dev(h0), _dev(c0))
    want = fluxpy.gradient(lambda *a: loss(*a, dy64, ds64), host, x64, h064, c064)
    for name in ("weight_ih", "weight_hh", "bias"):
        _close(got[0]["cell"][name], want[0]["cell"][name], dtype, name, table=LAYER_TOL)
    _close(got[1], want[1], dtype, "dx", table=LAYER_TOL)
    _close(got[2], want[2], dtype, "dh0", table=LAYER_TOL)
    if kind == "lstm":
        _close(got[3], want[3], dtype, "dc0", table=LAYER_TOL)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_step_loop_runs_one_gate_kernel_a_step(kind):
    """Every step of the cell loop's forward and backward pass goes to the fused kernels (none falls back to the
    composite): T calls of each. The loop of a layer's cell (Recurrence; a layer takes it with lengths= or an
    unbatched sequence: a batch without lengths is one cuDNN call, tests/gpu/test_cudnn_rnn_gpu.py)."""
    cp = cupy_module()
    counts = {}
    table = kernels.snapshot()
    try:
        for name in (f"{kind}_gates_forward", f"{kind}_gates_backward"):
            fn, ok = cuda_recurrent.KERNELS[name]

            def counted(*args, _fn=fn, _name=name):
                counts[_name] = counts.get(_name, 0) + 1
                return _fn(*args)
            kernels.register(name, "cupy", counted, ok)
        layer = fluxpy.gpu(fluxpy.Recurrence(MAKERS[kind](16, 32, rng=0).cell))
        x = cp.asarray(np.random.default_rng(8).standard_normal((4, 9, 16)).astype(np.float32))
        fluxpy.gradient(lambda m: m(x).sum(), layer)
    finally:
        kernels.restore(table)
    assert counts == {f"{kind}_gates_forward": 9, f"{kind}_gates_backward": 9}
