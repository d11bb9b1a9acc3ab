"""``dense`` through fluxpy's cuBLASLt binding (fluxpy.kernels.cublaslt) on the GPU: the fused forward (bias and
activation in the product's epilogue, gelu's pre-activation saved) and backward (the weight gradient with the bias
gradient summed by the same call) against the CPU's float64 result and against the GPU's unfused composite, in
float32, float16 and bfloat16, every activation with an epilogue and some without, with and without a bias; odd
shapes are declined (and still right); the kernels' counters show the fused path ran; a repeated call builds no new
plan; a captured TrainStep of an MLP equals the eager one; mixed precision takes the fused path.
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import copy
import warnings

import numpy as np
import pytest

import fluxpy
from fluxpy import CaptureWarning, Chain, Dense, TrainStep, logitcrossentropy
from fluxpy.kernels import cublaslt
from fluxpy.kernels.halfs import BFLOAT16
from fluxpy.ops import bias_act, dense, matmul, transpose
from fluxpy.ops.activations import gelu, gelu_erf, identity, relu, swish
from fluxpy.optimise import Adam, setup

pytestmark = pytest.mark.gpu

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16]
# |got - want| <= atol + rtol |want|, the values O(1): float32 without TF32 accumulates in float32; the halves are
# rounded once on the way in (the inputs are made in the half type) and once on the way out
TOL = {np.dtype(np.float32): dict(rtol=1e-5, atol=1e-5), np.dtype(np.float16): dict(rtol=1e-2, atol=1e-2),
       BFLOAT16: dict(rtol=3e-2, atol=3e-2)}
# gradients sum over the rows: a looser bound, relative to the largest entry
GRAD_TOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 2e-2, BFLOAT16: 6e-2}


def _name(act):
    return getattr(act, "__name__", None) or act.name   # relu is a Primitive, named by .name


@pytest.fixture(autouse=True)
def _fresh_plans():
    cublaslt.clear_cache()
    yield
    cublaslt.clear_cache()


def _composite(x, w, b, act):
    return bias_act(matmul(x, transpose(w)), b, act)


def _case(lead, n_in, n_out, bias, dtype, seed=0):
    """``(x, w, b)`` on the host in ``dtype`` (weights scaled so that outputs are O(1))."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (n_in,)).astype(dtype)
    w = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(dtype)
    b = rng.standard_normal(n_out).astype(dtype) if bias else None
    return x, w, b


def _exact_case(lead, n_in, n_out, bias, dtype, seed=0):
    """``(x, w, b)`` whose pre-activation every path computes exactly (sums of multiples of 1/32, in float32) and
    never within 1/64 of 0, so relu's derivative is the same bit on every path however it rounds: with a bias, the
    bias is an odd multiple of 1/64; without, each product is an odd multiple of 1/32 but the first, which is 0, and
    ``n_in`` is even, so an odd count of odd terms sums to an odd multiple of 1/32."""
    assert n_in % 2 == 0
    rng = np.random.default_rng(seed)
    odd = np.array([-3, -1, 1, 3])
    if bias:
        x, w = rng.integers(-2, 3, lead + (n_in,)) / 4, rng.integers(-2, 3, (n_out, n_in)) / 8
        b = (rng.integers(-8, 8, n_out) * 2 + 1) / 64
    else:
        x, w, b = rng.choice(odd, lead + (n_in,)) / 4, rng.choice(odd, (n_out, n_in)) / 8, None
        x[..., 0] = 0.0
    return tuple(None if a is None else a.astype(dtype) for a in (x, w, b))


def _gpu(*arrays):
    """Host arrays on the device (halves moved as their bits: no conversion on the device)."""
    import cupy as cp
    out = []
    for a in arrays:
        if a is None:
            out.append(None)
        elif a.dtype.itemsize == 2:
            out.append(cp.asarray(a.view(np.uint16)).view(a.dtype))
        else:
            out.append(cp.asarray(a))
    return out


def _host64(a):
    import cupy as cp
    a = fluxpy.value_of(a)
    if a.dtype.itemsize == 2:
        return cp.asnumpy(a.view(cp.uint16)).view(a.dtype).astype(np.float64)
    return cp.asnumpy(a).astype(np.float64)


def _f64(*arrays):
    return [None if a is None else a.astype(np.float64) for a in arrays]


def _close(got, want, tol, what):
    err = np.max(np.abs(got - want) - tol["rtol"] * np.abs(want)) if got.size else 0.0
    assert got.shape == want.shape and err <= tol["atol"], \
        f"{what}: max |got - want| - rtol |want| = {err:.3g} > atol {tol['atol']} (shape {got.shape})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", [identity, relu, gelu], ids=lambda f: _name(f))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(256,), (4, 33), ()], ids=str)
def test_the_fused_forward_matches_float64_and_the_unfused_composite(dtype, act, bias, lead):
    host = _case(lead, 192, 64, bias, dtype)
    x, w, b = _gpu(*host)
    y = dense(x, w, b, act)
    assert cublaslt.stats().get("dense_forward") == 1, f"the fused path was not taken: {cublaslt.stats()} " \
        f"(plan: {cublaslt.forward_plan(x, w, b, cublaslt.ACTIVATIONS[[identity, relu, gelu].index(act)], False)}; " \
        f"declined by the heuristic: {cublaslt.declined()})"
    assert y.shape == lead + (64,) and y.dtype == dtype and y.flags.c_contiguous
    want = _composite(*_f64(*host), act)
    _close(_host64(y), want, TOL[dtype], f"dense vs CPU float64 ({_name(act)}, {dtype})")
    _close(_host64(y), _host64(_composite(x, w, b, act)), TOL[dtype], "dense vs the GPU composite")


def _grads(f, x, w, b, cot):
    args = (x, w) if b is None else (x, w, b)
    fn = (lambda x, w: (f(x, w, None) * cot).sum()) if b is None else (lambda x, w, b: (f(x, w, b) * cot).sum())
    return fluxpy.gradient(fn, *args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", [identity, relu, gelu], ids=lambda f: _name(f))
@pytest.mark.parametrize("bias", [True, False])
def test_the_fused_backward_matches_float64_and_the_unfused_composite(dtype, act, bias):
    host = _exact_case((8, 32), 64, 128, bias, dtype, seed=1)
    cot_host = np.random.default_rng(2).standard_normal((8, 32, 128)).astype(dtype)
    x, w, b, cot = _gpu(*host, cot_host)
    got = _grads(lambda x, w, b: dense(x, w, b, act), x, w, b, cot)
    counts = cublaslt.stats()
    assert counts.get("dense_forward") == 1 and counts.get("dense_backward_weight") == 1, \
        f"the fused path was not taken: {counts}; declined by the heuristic: {cublaslt.declined()}"
    x64, w64, b64 = _f64(*host)
    want = _grads(lambda x, w, b: _composite(x, w, b, act), x64, w64, b64, cot_host.astype(np.float64))
    unfused = _grads(lambda x, w, b: _composite(x, w, b, act), x, w, b, cot)
    for name, g, w_, u in zip(("dx", "dw", "db"), got, want, unfused):
        scale = max(1.0, float(np.max(np.abs(w_))))
        tol = dict(rtol=0.0, atol=GRAD_TOL[dtype] * scale)
        assert g.dtype == dtype
        _close(_host64(g), w_, tol, f"{name} vs CPU float64 ({_name(act)}, {dtype})")
        _close(_host64(g), _host64(u), tol, f"{name} vs the GPU composite ({_name(act)}, {dtype})")


@pytest.mark.parametrize("act", [gelu_erf, swish], ids=lambda f: _name(f))
def test_activations_without_an_epilogue_run_after_the_bare_product(act):
    """One product kernel call each way (the activation in one bias_act pass after it), the weight's gradient in
    the weight's layout, equal to the composite within float32's rounding of a sum of 32 products."""
    x, w, b = _gpu(*_case((64,), 32, 32, True, np.float32))
    got = _grads(lambda x, w, b: dense(x, w, b, act), x, w, b, 1.0)
    stats = cublaslt.stats()
    assert stats["dense_forward"] == 1 and stats["dense_backward_weight"] == 1, stats
    assert got[1].flags.c_contiguous
    want = _grads(lambda x, w, b: _composite(x, w, b, act), x, w, b, 1.0)
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(_host64(g), _host64(w_), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["in 5 (20 bytes)", "out 12 half", "gelu out 12", "x strided", "1-d x", "offset x"])
def test_odd_shapes_are_declined_or_handled_and_still_right(case):
    import cupy as cp
    dtype, n_in, n_out, lead = np.float32, 16, 16, (8,)
    if case == "in 5 (20 bytes)":
        n_in = 5
    elif case == "out 12 half":
        dtype, n_out = np.float16, 12
    elif case == "gelu out 12":
        n_out = 12   # float32: 48 bytes, fine for the product; the saved pre-activation needs a multiple of 8
    elif case == "1-d x":
        lead = ()
    host = _case(lead, n_in, n_out, True, dtype, seed=3)
    x, w, b = _gpu(*host)
    if case == "x strided":
        x = cp.asarray(np.repeat(host[0], 2, axis=-1))[..., ::2]
    elif case == "offset x":
        x = cp.concatenate([cp.zeros(1, dtype), x.ravel()])[1:].reshape(x.shape)   # 4 bytes past an aligned start
    got = _grads(lambda x, w, b: dense(x, w, b, gelu), x, w, b, 1.0)
    y = dense(x, w, b, gelu)
    want = _grads(lambda x, w, b: _composite(x, w, b, gelu), *_f64(*host), 1.0)
    # "gelu out 12": inference fused; the gradient's forward (gelu's pre-activation saved) declined, so the bare
    # product by the same kernel, then gelu
    expected_forward = {"in 5 (20 bytes)": 0, "out 12 half": 0, "gelu out 12": 2, "x strided": 0, "1-d x": 2,
                        "offset x": 0}[case]
    assert cublaslt.stats().get("dense_forward", 0) == expected_forward, (case, cublaslt.stats(), cublaslt.declined())
    _close(_host64(y), _composite(*_f64(*host), gelu), TOL[np.dtype(dtype)], case)
    for g, w_ in zip(got, want):
        _close(_host64(g), w_, dict(rtol=0.0, atol=GRAD_TOL[np.dtype(dtype)] * max(1.0, np.max(np.abs(w_)))), case)


def test_a_repeated_call_builds_nothing_new():
    x, w, b = _gpu(*_case((512,), 128, 256, True, np.float32))
    step = lambda: fluxpy.gradient(lambda w, b: dense(x, w, b, gelu).sum(), w, b)   # noqa: E731
    step()
    built = cublaslt.stats()["built"]
    # the forward with its saved pre-activation; the weight and bias gradients
    assert built == 2, (cublaslt.stats(), cublaslt.declined())
    plans = {dev: set(d.plans) for dev, d in cublaslt._devices.items()}
    for _ in range(3):
        step()
    assert cublaslt.stats()["built"] == built and cublaslt.stats()["dense_forward"] == 4
    assert {dev: set(d.plans) for dev, d in cublaslt._devices.items()} == plans


def test_tf32_follows_the_option():
    x, w, b = _gpu(*_case((64,), 64, 64, True, np.float32))
    dense(x, w, b, relu)
    with fluxpy.options(allow_tf32=True):
        dense(x, w, b, relu)
    plans = [p for d in cublaslt._devices.values() for p in d.plans]
    assert sorted(p.tf32 for p in plans) == [False, True]


def _mlp(rng):
    return Chain(Dense(64, 128, gelu, rng=rng), Dense(128, 128, relu, rng=rng), Dense(128, 16, rng=rng))


def _loss(m, x, y):
    return logitcrossentropy(m(x), y)


def test_a_captured_mlp_step_equals_the_eager_step():
    import cupy as cp
    rng = np.random.default_rng(4)
    model = _mlp(rng)
    batches = [(cp.asarray(rng.standard_normal((256, 64), dtype=np.float32)),
                cp.asarray(fluxpy.onehotbatch(rng.integers(0, 16, 256), range(16)))) for _ in range(6)]
    captured_model, eager_model = fluxpy.gpu(model), fluxpy.gpu(copy.deepcopy(model))
    captured = TrainStep(_loss, captured_model, setup(Adam(1e-3), captured_model))
    eager = TrainStep(_loss, eager_model, setup(Adam(1e-3), eager_model), capture=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        got = [float(captured(x, y)) for x, y in batches]
    assert list(captured.captured().values()) == ["captured"], captured.captured()
    counts = cublaslt.stats()
    want = [float(eager(x, y)) for x, y in batches]
    assert cublaslt.stats()["dense_forward"] > counts["dense_forward"], "the eager steps did not take the fused path"
    # the same algorithms on the same inputs: equal up to the order of float32 sums that equal algorithms keep
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for a, b in zip(fluxpy.trainables(captured_model), fluxpy.trainables(eager_model)):
        np.testing.assert_allclose(cp.asnumpy(a), cp.asnumpy(b), rtol=1e-6, atol=1e-7)


def test_the_kernels_replay_from_a_cuda_graph():
    from fluxpy.backend import capture_graph
    x, w, b = _gpu(*_case((128,), 64, 64, True, np.float16))
    want = dense(x, w, b, gelu)
    graph, y = capture_graph(lambda: dense(x, w, b, gelu))
    graph.launch()
    np.testing.assert_array_equal(_host64(y), _host64(want))


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_mixed_precision_takes_the_fused_path(half):
    import cupy as cp
    rng = np.random.default_rng(5)
    model = fluxpy.gpu(_mlp(rng))
    x = cp.asarray(rng.standard_normal((128, 64), dtype=np.float32))
    want = _host64(model(x))
    mixed = fluxpy.mixed_precision(model, half)
    cublaslt.clear_cache()
    got = _host64(mixed(x))
    assert cublaslt.stats().get("dense_forward") == 3, (cublaslt.stats(), cublaslt.declined())
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
    grads = fluxpy.gradient(lambda m: m(x).sum(), mixed)
    assert cublaslt.stats().get("dense_backward_weight") == 3, cublaslt.stats()
    assert grads is not None
