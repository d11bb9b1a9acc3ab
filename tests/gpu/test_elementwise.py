"""Fused elementwise kernels (fluxpy.kernels.elementwise) against the CPU dual-number path.

Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import functools
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import broadcast
from fluxpy.kernels import elementwise as E
from fluxpy.ops import activations as A
from fluxpy.ops.bias_act import bias_act, derivative_from_saved
from devices import assert_matches_cpu
from strategies import array, broadcast_pair
from test_broadcast import SCALAR_FUNCTIONS
from sweeps import examples

pytestmark = pytest.mark.gpu

FUNCTIONS = dict(SCALAR_FUNCTIONS)
FUNCTIONS.update({
    "pow": lambda x, b: np.abs(x) ** 2.5 + x ** -2 + np.abs(b) ** b,
    "sign_where": lambda x, b: np.where((x > 0) & (b < 1), x * b, -x) + np.sign(b) * x,
    "ignores_b": lambda x, b: x * 2.0 - 1,
    "gelu": lambda x, b: A.gelu(x + b),
    "elu": lambda x, b: A.elu(x * b),
    "swish": lambda x, b: A.swish(x - b),
    "hardtanh": lambda x, b: A.hardtanh(x + b),
})




def _value_and_grads(f, x, b, ct):
    """y and the gradients of sum(y * ct) through fluxpy.broadcast, on whatever arrays are given."""
    y = broadcast(f, x, b)
    g = fluxpy.gradient(lambda x, b: (broadcast(f, x, b) * ct).sum(), x, b)
    return y, g


def _close(gpu, cpu, rtol, atol):
    assert_matches_cpu(gpu, cpu, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@given(pair=broadcast_pair(), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([np.float64, np.float32]))
@examples(12, default=4)
def test_fused_matches_cpu(name, pair, seed, dtype):
    import cupy as cp
    f = FUNCTIONS[name]
    rng = np.random.default_rng(seed)
    x = np.asarray(array(rng, pair[0], away_from_zero=True))   # 0-d arrays, not NumPy scalars
    b = np.asarray(array(rng, pair[1], away_from_zero=True) + 0.1)
    if name in ("relu", "leaky", "hardtanh", "gelu") and np.any(np.abs(np.add(x, b)) < 1e-3):
        return
    shape = np.broadcast_shapes(pair[0], pair[1])
    ct = np.asarray(rng.standard_normal(shape))
    with np.errstate(all="ignore"):
        y0, g0 = _value_and_grads(f, x, b, ct)          # CPU, float64: the reference
    fallbacks = E.stats["fallbacks"]
    xg, bg, ctg = (cp.asarray(a.astype(dtype)) for a in (x, b, ct))
    y1, g1 = _value_and_grads(f, xg, bg, ctg)
    assert E.stats["fallbacks"] == fallbacks, "the function fell back to the generic path"
    rtol, atol = (1e-10, 1e-12) if dtype == np.float64 else (2e-4, 2e-5)
    if dtype == np.float32:   # compare with the float32 CPU path, and loosely with float64
        with np.errstate(all="ignore"):
            y0, g0 = _value_and_grads(f, x.astype(dtype), b.astype(dtype), ct.astype(dtype))
    assert y1.dtype == dtype
    scale = max(1.0, float(np.max(np.abs(y0)))) if np.size(y0) else 1.0
    _close(y1, y0, rtol, atol * scale)
    for a, c in zip(g1, g0):
        if c is None:
            assert a is None or not cp.asnumpy(a).any()
            continue
        s = max(1.0, float(np.max(np.abs(c)))) if np.size(c) else 1.0
        _close(a, c, rtol, atol * s * 10)


def test_partials_match_dual_numbers_elementwise():
    """The derivative kernel against the CPU dual numbers directly, unreduced, for every activation."""
    import cupy as cp
    from fluxpy.dual import partials
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 33)) * 3
    for name in A.__all__:
        if name == "rrelu":       # random slopes at every call: dual numbers refuse it (tested in test_special_gpu)
            continue
        act = getattr(A, name)
        f = (lambda act: lambda v: act(v))(act)
        dy = rng.standard_normal(x.shape)
        got = E.fused_pullback(f, (0,), cp.asarray(dy), cp.asarray(x))
        assert got is not None, name
        with np.errstate(all="ignore"):
            p, = partials(f, (x,), [0])
        ref = np.zeros_like(x) if p is None else dy * np.asarray(p, dtype=np.float64)
        g = np.zeros_like(x) if got[0] is None else cp.asnumpy(got[0])
        np.testing.assert_allclose(g, ref, rtol=1e-12, atol=1e-14, err_msg=name)
        y = E.fused_forward(f, cp.asarray(x))
        np.testing.assert_allclose(cp.asnumpy(y), act(x), rtol=1e-12, atol=1e-14, err_msg=name)


def test_cache_second_call_does_not_recompile():
    import cupy as cp
    x = cp.asarray(np.random.default_rng(1).standard_normal((5, 7)).astype(np.float32))
    b = cp.asarray(np.random.default_rng(2).standard_normal((7,)).astype(np.float32))

    def step(a):   # a lambda re-created per call, capturing a number: still one kernel
        return fluxpy.gradient(lambda x, b: broadcast(lambda u, v: np.tanh(u * a + v), x, b).sum(), x, b)
    E.clear_cache()   # an earlier test in this process may have compiled the kernels counted below
    step(1.5)
    traces, kernels = E.stats["traces"], E.stats["kernels"]
    for _ in range(3):
        step(1.5)
    assert (E.stats["traces"], E.stats["kernels"]) == (traces, kernels)
    step(2.5)   # another captured value is another kernel
    assert E.stats["kernels"] > kernels
    kernels = E.stats["kernels"]
    broadcast(functools.partial(A.leakyrelu, a=0.2), x)
    broadcast(functools.partial(A.leakyrelu, a=0.2), x)
    assert E.stats["kernels"] == kernels + 1


def test_python_scalars_and_mixed_dtypes():
    import cupy as cp
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal((3,))
    f = lambda u, s, v: u * s + np.exp(v)   # noqa: E731
    ref = broadcast(f, x, 2.5, b)
    got = broadcast(f, cp.asarray(x), 2.5, cp.asarray(b))
    assert got.dtype == ref.dtype == np.float64
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-6)
    g0 = fluxpy.gradient(lambda x, b: broadcast(f, x, 2.5, b).sum(), x, b)
    g1 = fluxpy.gradient(lambda x, b: broadcast(f, x, 2.5, b).sum(), cp.asarray(x), cp.asarray(b))
    for a, c in zip(g1, g0):
        assert a.dtype == c.dtype
        np.testing.assert_allclose(cp.asnumpy(a), c, rtol=1e-6)


def test_untraceable_function_falls_back_and_warns_once():
    import cupy as cp
    w = cp.asarray(np.arange(3.0))
    f = lambda u: u * w + 1   # noqa: E731  (an array captured in the closure cannot be compiled in)
    x = cp.asarray(np.ones((2, 3)))
    with pytest.warns(E.FusionFallbackWarning):
        y = broadcast(f, x)
    np.testing.assert_allclose(cp.asnumpy(y), np.arange(3.0) + 1 + np.zeros((2, 3)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g, = fluxpy.gradient(lambda x: broadcast(f, x).sum(), x)
    np.testing.assert_allclose(cp.asnumpy(g), np.tile(np.arange(3.0), (2, 1)))


def test_second_order_uses_the_generic_path():
    import cupy as cp
    x = np.array([0.3, -1.2, 2.0])
    f = lambda v: np.tanh(v) * v   # noqa: E731
    h = lambda x: fluxpy.gradient(lambda y: broadcast(f, y).sum(), x)[0].sum()   # noqa: E731
    ref, = fluxpy.gradient(h, x)
    got, = fluxpy.gradient(h, cp.asarray(x))
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-12)


def test_mixing_cpu_and_gpu_is_a_clear_error():
    import cupy as cp
    with pytest.raises(TypeError, match="numpy.*cupy|cupy.*numpy"):
        broadcast(lambda a, b: a + b, np.ones(3), cp.ones(3))
    with pytest.raises(TypeError, match="numpy.*cupy|cupy.*numpy"):
        bias_act(cp.ones((2, 3)), np.ones(3), A.relu)


def test_mapreduce_out_mapped():
    import cupy as cp
    from fluxpy.kernels.reduce import mapreduce
    rng = np.random.default_rng(4)
    for shape, axes in [((128, 16, 28, 28), (0, 2, 3)), ((128, 10), (0,)), ((3, 5, 7), (0, 2)), ((1000, 33), 1),
                        ((64, 7, 1, 3), (0, 2, 3))]:
        for dtype in (np.float32, np.float64):
            dy = rng.standard_normal(shape).astype(dtype)
            y = rng.standard_normal(shape).astype(dtype)
            dz = cp.full(shape, np.nan, dtype=dtype)
            db = mapreduce(cp.asarray(dy), axes, map="x * ((ACC)1 - y * y)", y=cp.asarray(y), out_mapped=dz)
            ref = dy.astype(np.float64) * (1 - y.astype(np.float64) ** 2)
            tol = 1e-5 if dtype == np.float32 else 1e-13   # float32: FMA contraction vs NumPy's two roundings
            np.testing.assert_allclose(cp.asnumpy(dz), ref, rtol=tol, atol=tol * np.abs(ref).max())
            np.testing.assert_allclose(cp.asnumpy(db), ref.astype(np.float64).sum(axis=axes),
                                       rtol=1e-4 if dtype == np.float32 else 1e-12, atol=1e-3)
    with pytest.raises(ValueError, match="out_mapped"):
        x = cp.ones((2, 3, 4), cp.float32)
        mapreduce(x, 1, out_mapped=cp.empty_like(x))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", ["identity", "relu", "tanh", "sigmoid"])
def test_bias_act_output_backward_both_variants(kind, fused):
    import cupy as cp
    rng = np.random.default_rng(5)
    for xs, bs in [((16, 8, 5, 5), (1, 8, 1, 1)), ((128, 10), (10,)), ((4, 6), (4, 6))]:
        y = rng.uniform(0.05, 0.95, xs) * rng.choice([-1, 1], xs) if kind in ("identity", "relu") \
            else rng.uniform(0.05, 0.95, xs)
        dy = rng.standard_normal(xs)
        d = {"identity": dy, "relu": np.where(y > 0, dy, 0), "tanh": dy * (1 - y * y),
             "sigmoid": dy * (y * (1 - y))}[kind]
        derivative = derivative_from_saved(getattr(A, kind))[0]
        dx, db = E.bias_act_backward(derivative, cp.asarray(y), cp.asarray(dy), bs, True, True, fused=fused)
        np.testing.assert_allclose(cp.asnumpy(dx), d, rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(cp.asnumpy(db), fluxpy.unbroadcast(d, bs), rtol=1e-12, atol=1e-12)


def test_fused_optimiser_updates_match_the_rules():
    import cupy as cp
    from fluxpy import optimise as O
    rng = np.random.default_rng(6)
    from fluxpy.optimise.rules import formula_of
    for rule in (O.Descent(0.1), O.Momentum(0.05, 0.8), O.Adam(0.01)):
        for dtype in (np.float64, np.float32):
            w = rng.standard_normal((7, 5)).astype(dtype)
            wg = cp.asarray(w)
            st_cpu, st_gpu = O.setup(rule, w), O.setup(rule, wg)
            for _ in range(3):
                g = rng.standard_normal(w.shape).astype(dtype)
                O.update(st_cpu, w, g)
                states = [a for a in (st_gpu.state if isinstance(st_gpu.state, tuple) else (st_gpu.state,))
                          if hasattr(a, "shape")]
                assert fluxpy.kernels.find("optimiser_step_many", wg, formula_of(rule), [wg], [cp.asarray(g)],
                                           [states], [[]]) is not None
                O.update(st_gpu, wg, cp.asarray(g))
            np.testing.assert_allclose(cp.asnumpy(wg), w, rtol=1e-12 if dtype == np.float64 else 1e-5)


def test_adam_with_a_non_contiguous_parameter_takes_the_elementwise_kernel():
    import cupy as cp
    from fluxpy import optimise as O
    from fluxpy.kernels import cuda_optimise as K
    from fluxpy.optimise.rules import formula_of
    rng = np.random.default_rng(7)
    w = rng.standard_normal((3, 4))
    wg = cp.zeros((3, 8))[:, ::2]   # a strided parameter: the per-parameter (ElementwiseKernel) step
    wg[...] = cp.asarray(w)
    rule = O.Adam(0.01)
    st_cpu, st_gpu = O.setup(rule, w), O.setup(rule, wg)
    for _ in range(3):
        g = rng.standard_normal((4, 3))
        O.update(st_cpu, w, g.T)
        gg = cp.asarray(g).T
        assert not gg.flags.c_contiguous
        args = (wg, formula_of(rule), gg, list(st_gpu.state[:2]), [])
        assert fluxpy.kernels.find("optimiser_step", *args) is K.optimiser_step
        O.update(st_gpu, wg, gg)
    np.testing.assert_allclose(cp.asnumpy(wg), w, rtol=1e-12)
