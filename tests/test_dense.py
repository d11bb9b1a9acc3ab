"""The ``dense`` op (fluxpy.ops.dense): equal to its composite ``bias_act(matmul(x, transpose(w)), b, act)`` with the
same gradients (float64 finite differences), on the CPU as it runs there (one op through
fluxpy.kernels.cpu_dense for identity, relu and gelu; the composite otherwise) and through its fused route: the cuBLASLt kernels of fluxpy.kernels.cublaslt registered for NumPy arrays and run against the stand-in
library of test_cublaslt_plan (float64 admitted for the finite differences), which checks the rule, the saved
pre-activation, the pullback's two products and the kernels' host code together. Bad input raises naming ``dense``.
"""
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import fluxpy
from fluxpy import kernels
from fluxpy.kernels import cublaslt
from fluxpy.ops import bias_act, dense, matmul, transpose
from fluxpy.ops.activations import gelu, gelu_erf, identity, relu, swish, tanh
from gradcheck import check_grad, check_second_order
from test_cublaslt_plan import fake_library

ACTS = [identity, relu, gelu, gelu_erf, swish, tanh]


def _composite(x, w, b, act):
    return bias_act(matmul(x, transpose(w)), b, act)


def _case(rng, lead, n_in, n_out, bias, dtype=np.float64):
    x = rng.standard_normal(lead + (n_in,)).astype(dtype)
    w = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(dtype)
    b = rng.standard_normal(n_out).astype(dtype) if bias else None
    return x, w, b


@settings(deadline=None, max_examples=30)
@given(lead=st.lists(st.integers(1, 3), max_size=2).map(tuple), n_in=st.integers(1, 5), n_out=st.integers(1, 5),
       act=st.sampled_from(ACTS), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_dense_is_its_composite_and_differentiates_as_it(lead, n_in, n_out, act, bias, seed):
    rng = np.random.default_rng(seed)
    x, w, b = _case(rng, lead, n_in, n_out, bias)
    y = dense(x, w, b, act)
    assert y.shape == lead + (n_out,)
    np.testing.assert_array_equal(y, _composite(x, w, b, act))
    args = (x, w) if b is None else (x, w, b)
    f = (lambda x, w: dense(x, w, None, act)) if b is None else (lambda x, w, b: dense(x, w, b, act))
    g = check_grad(f, *args, rng=rng)
    want = fluxpy.gradient(lambda *a: (f(*a) * 1.5).sum(), *args)
    got = fluxpy.gradient(lambda *a: (f(*a) * 1.5).sum(), *args)
    for gi, wi, a in zip(got, want, args):
        np.testing.assert_allclose(gi, wi, rtol=1e-12)
        assert gi.shape == a.shape
    assert len(g) == len(args)


@pytest.fixture()
def fused(monkeypatch):
    """The cuBLASLt kernels registered for NumPy arrays, run against the stand-in library, float64 admitted."""
    table = kernels.snapshot()
    fake = fake_library(monkeypatch, dtypes=((1, np.float64),))

    def registered(*arrays):   # the stand-in reads and writes only inside arrays it was told of
        fake.register(*(a for a in arrays if isinstance(a, np.ndarray)))
        return arrays

    def kernel(fn):
        return lambda *args: fn(*registered(*args))
    for name, (fn, supports) in cublaslt.KERNELS.items():
        kernels.register(name, "numpy", kernel(fn), supports)
    yield registered
    kernels.restore(table)


LEADS = [(), (6,), (2, 3)]


@pytest.mark.parametrize("act", [identity, relu, gelu])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", LEADS)
def test_the_fused_route_equals_the_composite_and_its_gradients(fused, act, bias, lead):
    rng = np.random.default_rng(len(lead) * 7 + bias)
    x, w, b = fused(*_case(rng, lead, 8, 16, bias))
    y = dense(x, w, b, act)
    assert cublaslt.stats()["dense_forward"] == 1   # inference: one call, nothing saved
    np.testing.assert_allclose(y, _composite(x, w, b, act), rtol=1e-12, atol=1e-12)
    args = (x, w) if b is None else (x, w, b)
    f = (lambda x, w: dense(x, w, None, act)) if b is None else (lambda x, w, b: dense(x, w, b, act))
    cot = rng.standard_normal(y.shape)
    got = fluxpy.gradient(lambda *a: (f(*a) * cot).sum(), *args)
    want = fluxpy.gradient(lambda *a: (_composite(*(a if b is not None else a + (None,)), act) * cot).sum(), *args)
    for gi, wi in zip(got, want):
        np.testing.assert_allclose(gi, wi, rtol=1e-10, atol=1e-12)
    counts = cublaslt.stats()
    assert counts["dense_forward"] == 2 and counts["dense_backward_weight"] == 1, counts
    check_grad(f, *args, rng=rng)


def test_a_repeated_step_builds_nothing_new(fused, monkeypatch):
    # NumPy's allocations are 16-byte aligned or more, by chance; CuPy's are 512-byte aligned: the plans' alignment
    # class is fixed here as it is there (the GPU test checks the same with real allocations)
    monkeypatch.setattr(cublaslt, "_alignment", lambda ptr: 16)
    rng = np.random.default_rng(3)
    x, w, b = fused(*_case(rng, (4,), 8, 16, True))
    step = lambda: fluxpy.gradient(lambda w, b: dense(x, w, b, gelu).sum(), w, b)   # noqa: E731
    first = step()
    built = cublaslt.stats()["built"]
    # the forward (gelu, pre-activation saved) and the weight gradient (bias gradient summed), each also for outputs
    # less aligned than the 256 bytes planned for
    assert built == 4
    second = step()
    assert cublaslt.stats()["built"] == built and cublaslt.stats()["dense_forward"] == 2
    for a, b_ in zip(first, second):
        np.testing.assert_array_equal(a, b_)


def test_a_call_plans_once(fused, monkeypatch):
    planned = []
    original = cublaslt.forward_plan
    monkeypatch.setattr(cublaslt, "forward_plan", lambda *a: planned.append(a[3:]) or original(*a))
    rng = np.random.default_rng(11)
    x, w, b = fused(*_case(rng, (4,), 8, 16, True))
    dense(x, w, b, gelu)
    assert planned == [("gelu", False)]   # asked twice (dense, then the primitive), planned once
    fluxpy.gradient(lambda w: dense(x, w, b, gelu).sum(), w)
    assert planned == [("gelu", False), ("gelu", True)]
    dense(x, w, b, gelu)
    fluxpy.gradient(lambda w: dense(x, w, b, gelu).sum(), w)
    assert planned == [("gelu", False), ("gelu", True)]   # the same problems again: nothing planned
    x2 = fused(*_case(rng, (5,), 8, 16, True))[0]
    dense(x2, w, b, gelu)
    assert planned[2:] == [("gelu", False)]   # another batch: planned once more


def test_gradients_of_only_some_arguments(fused):
    rng = np.random.default_rng(4)
    x, w, b = fused(*_case(rng, (5,), 8, 8, True))
    (dx,) = fluxpy.gradient(lambda x: dense(x, w, b, relu).sum(), x)
    assert cublaslt.stats().get("dense_backward_weight", 0) == 0   # no weight or bias gradient asked for
    np.testing.assert_allclose(dx, fluxpy.gradient(lambda x: _composite(x, w, b, relu).sum(), x)[0], rtol=1e-12)
    (db,) = fluxpy.gradient(lambda b: dense(x, w, b, relu).sum(), b)
    assert cublaslt.stats()["dense_backward_weight"] == 1
    np.testing.assert_allclose(db, fluxpy.gradient(lambda b: _composite(x, w, b, relu).sum(), b)[0], rtol=1e-12)


def test_second_derivatives_run_the_composite(fused):
    rng = np.random.default_rng(5)
    x, w, b = fused(*_case(rng, (3,), 8, 8, True))
    check_second_order(lambda x, w, b: dense(x, w, b, gelu), x, w, b, rng=rng)


@pytest.mark.parametrize("act", [gelu_erf, swish, tanh])
@pytest.mark.parametrize("bias", [True, False])
def test_activations_without_an_epilogue_run_after_the_bare_product(fused, act, bias):
    rng = np.random.default_rng(6)
    x, w, b = fused(*_case(rng, (4,), 8, 8, bias))
    np.testing.assert_allclose(dense(x, w, b, act), _composite(x, w, b, act), rtol=1e-12, atol=1e-12)
    args = (x, w) if b is None else (x, w, b)
    f = (lambda x, w: dense(x, w, None, act)) if b is None else (lambda x, w, b: dense(x, w, b, act))
    got = fluxpy.gradient(lambda *a: (f(*a) * 1.5).sum(), *args)
    stats = cublaslt.stats()
    assert stats["dense_forward"] == 2 and stats["dense_backward_weight"] == 1, stats
    g = lambda *a: (_composite(a[0], a[1], None if b is None else a[2], act) * 1.5).sum()   # noqa: E731
    for gi, wi in zip(got, fluxpy.gradient(g, *args)):
        np.testing.assert_allclose(gi, wi, rtol=1e-12, atol=1e-12)
    assert got[1].flags.c_contiguous   # the weight's gradient in the weight's layout


def test_an_activation_that_draws_runs_the_composite(fused):
    from fluxpy.ops.activations import rrelu
    rng = np.random.default_rng(16)
    x, w, b = fused(*_case(rng, (4,), 8, 8, True))
    y = dense(x, w, b, rrelu)
    assert y.shape == (4, 8) and cublaslt.stats() == {}


def test_declined_epilogues_run_the_bare_product_in_one_node(fused):
    rng = np.random.default_rng(7)
    x, w, b = fused(*_case(rng, (4,), 5, 8, True))   # 5 float64 in features: 40 bytes, not a multiple of 16
    np.testing.assert_array_equal(dense(x, w, b, relu), _composite(x, w, b, relu))   # matmul's product
    assert cublaslt.stats() == {}
    x, w, b = fused(*_case(rng, (4,), 8, 6, True))   # gelu saves its pre-activation: out must be divisible by 8
    y = dense(x, w, b, gelu)   # inference saves nothing: fused
    assert cublaslt.stats()["dense_forward"] == 1
    with fluxpy.profile(gpu=False, print_table=False) as prof:
        g = fluxpy.gradient(lambda w: (dense(x, w, b, gelu) * y).sum(), w)[0]
    assert cublaslt.stats()["dense_forward"] == 2   # in a gradient, the bare product, then gelu by bias_act
    names = {r.name for r in prof.rows()}
    assert "dense" in names and not names & {"bias_act", "transpose", "matmul"}, names
    np.testing.assert_allclose(g, fluxpy.gradient(lambda w: (_composite(x, w, b, gelu) * y).sum(), w)[0], rtol=1e-12)
    assert g.flags.c_contiguous


def test_the_dense_layer_calls_the_op(fused):
    rng = np.random.default_rng(8)
    layer = fluxpy.f64(fluxpy.Dense(8, 16, relu, rng=rng))
    fused(layer.weight, layer.bias)
    x = fused(rng.standard_normal((3, 8)))[0]
    np.testing.assert_allclose(layer(x), _composite(x, layer.weight, layer.bias, relu), rtol=1e-12)
    grads = fluxpy.gradient(lambda m: m(x).sum(), layer)[0]
    assert cublaslt.stats()["dense_forward"] == 2 and cublaslt.stats()["dense_backward_weight"] == 1
    want = fluxpy.gradient(lambda w, b: _composite(x, w, b, relu).sum(), layer.weight, layer.bias)
    np.testing.assert_allclose(grads["weight"], want[0], rtol=1e-12)
    np.testing.assert_allclose(grads["bias"], want[1], rtol=1e-12)


def test_float32_and_halves_on_the_fused_route(fused):
    rng = np.random.default_rng(9)
    for dtype, tol in ((np.float32, 1e-5), (np.float16, 2e-2), (fluxpy.kernels.halfs.BFLOAT16, 3e-2)):
        x, w, b = fused(*_case(rng, (4,), 16, 8, True, dtype))
        y = dense(x, w, b, gelu)
        assert y.dtype == dtype
        want = _composite(*(a.astype(np.float64) for a in (x, w, b)), gelu)
        np.testing.assert_allclose(y.astype(np.float64), want, rtol=tol, atol=tol)
    assert cublaslt.stats()["dense_forward"] == 3


@pytest.mark.parametrize("args, error, message", [
    ((np.ones((2, 4)), np.ones((5, 3))), ValueError, r"dense expects x.shape\[-1\] == weight.shape\[1\] == 3, got x "
                                                     r"\(2, 4\) and weight \(5, 3\)"),
    ((np.ones((2, 3)), np.ones(3)), ValueError, r"dense expects a weight \(out, in\), got shape \(3,\)"),
    ((np.ones((2, 3)), np.ones((5, 3)), np.ones(4)), ValueError, r"dense expects a bias of shape \(5,\) \(one per "
                                                                 r"output\), got \(4,\)"),
    (([1.0, 2.0], np.ones((5, 2))), TypeError, "dense expects x to be an array, got list"),
    ((np.ones((2, 3)), np.ones((5, 3)), 1.0), ValueError, r"dense expects a bias of shape \(5,\).*got float"),
])
def test_bad_input_is_named(args, error, message):
    with pytest.raises(error, match=message):
        dense(*args)


def test_no_bias_and_no_activation_spelt_both_ways():
    rng = np.random.default_rng(10)
    x, w, _ = _case(rng, (3,), 4, 2, False)
    np.testing.assert_array_equal(dense(x, w, False, None), x @ w.T)
    np.testing.assert_array_equal(dense(x, w), x @ w.T)


@pytest.mark.parametrize("act", [relu, gelu, identity, gelu_erf, swish])
def test_the_cpu_runs_a_dense_layer_as_one_op(act):
    rng = np.random.default_rng(5)
    x, w, b = _case(rng, (3,), 4, 6, True, np.float32)
    with fluxpy.profile(gpu=False, print_table=False) as prof:
        grads = fluxpy.gradient(lambda x, w, b: dense(x, w, b, act).sum(), x, w, b)
    names = {r.name for r in prof.rows()}
    assert "dense" in names and "bias_act" not in names and "transpose" not in names, names
    want = fluxpy.gradient(lambda x, w, b: _composite(x, w, b, act).sum(), x, w, b)
    for g, e in zip(grads, want):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_cpu_kernels_gelu_is_the_activations_bit_for_bit(dtype):
    from fluxpy.kernels import cpu_dense
    z = (np.random.default_rng(9).standard_normal(20_000) * 4).astype(dtype)
    np.testing.assert_array_equal(cpu_dense._gelu(z.copy()), gelu(z))
