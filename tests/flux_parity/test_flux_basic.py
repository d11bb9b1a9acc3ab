"""Flux.jl's ``test/layers/basic.jl`` known-answer cases (FluxML/Flux.jl at 3f2f828), in fluxpy, batch first.

A Flux feature-first array ``(features, batch...)`` is fluxpy's ``(batch..., features)`` (the same bytes); a Flux
``Dense(10 => 5)`` is ``Dense(10, 5)``, ``Embedding(10 => 4)`` is ``Embedding(10, 4)`` with 0-based indices and an
``(n, dim)`` weight (Flux's ``(dim, n)``, the same bytes); Flux's ``Scale(2, 3)`` on WHCN data is ``Scale(3, 2)``.
Where fluxpy chooses differently, a test says so:

- Dense refuses input of another dtype than its weight (a ``DTypeMismatch`` naming the conversion) where Flux converts
  float64 with a warning and integers or bools silently (basic.jl:80-95, ``_match_eltype``).
- EmbeddingBag's bags run along the last axis (Flux's first), its ``offsets`` are 0-based, reductions are fluxpy's
  (``fluxpy.max`` for Flux's ``maximum``).

Not translated: ``Flux.activations`` (no fluxpy counterpart), ``Flux._splitat`` (private; its rules are tested through
``EmbeddingBag(data, offsets)``), named ``Parallel`` layers (fluxpy names ``Chain`` layers only), the old
``Bilinear(in1, in2, out)`` and ``Bilinear(weight)`` constructors, ``Flux.destructure``, Zygote's
``hessian_dual`` (fluxpy's second derivatives are reverse over reverse; checked against finite differences), the
issue-1673 custom input type, ``OneHotVector``/``OneHotMatrix`` types (one-hot arrays are bool or float arrays here).
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import (Bilinear, Chain, Dense, DimensionMismatch, DTypeMismatch, Embedding, EmbeddingBag, Maxout,
                    PairwiseFusion, Parallel, Scale, SkipConnection, gradient, identity, onehotbatch, relu, sigmoid)
from tests.gradcheck import check_grad, check_second_order


def randn32(*shape):
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


def ones_init(*shape, rng=None):
    return np.ones(shape, np.float32)


def test_chain():
    # basic.jl:16-38
    assert Chain(Dense(10, 5, sigmoid), Dense(5, 2))(randn32(10)).shape == (2,)
    with pytest.raises(DimensionMismatch, match=r"Dense\(2 => 1\)"):
        Chain(Dense(10, 5, sigmoid), Dense(2, 1))(randn32(10))
    m = Chain(first=Dense(10, 5, sigmoid), second=Dense(5, 2))
    assert m(randn32(10)).shape == (2,)
    assert m["first"] is m[0] and m.first is m[0]
    assert repr(m[0:2]) == repr(m) and m[0:2][1] is m[1]
    assert repr(fluxpy.fmap(identity, m)) == repr(m)                 # does not forget names
    with pytest.raises(ValueError, match="the layer name 'layers' is taken by Chain itself"):
        Chain(layers=Dense(10, 10), two=identity)                   # reserved name
    assert Chain([Dense(10, 5, sigmoid), Dense(5, 2)])(randn32(10)).shape == (2,)   # a list of layers
    c = Chain(Dense(10, 5, sigmoid), Dense(5, 2), Dense(2, 1, relu))
    assert c[0] is c[-3] and c[2] is c[-1]                           # Flux's c[begin], c[end]
    assert Chain(identity)(1, 2, 3) == (1, 2, 3)                     # multiple args become a tuple


def test_dense_constructors():
    # basic.jl:52-74
    assert Dense(10, 100).weight.shape == (100, 10) and Dense(10, 100).bias.shape == (100,)
    rng = np.random.default_rng(0)
    w = rng.random((100, 10)).astype(np.float32)
    assert Dense(w, rng.random(100).astype(np.float32)).act is identity
    assert Dense(w).act is identity and Dense(w).weight is w
    assert Dense(w, False).act is identity and Dense(w, False).bias is None
    assert Dense(w, False, np.tanh).act is np.tanh
    assert Dense(w.astype(np.float16), True).bias.dtype == np.float16          # creates the matching type
    assert Dense(w.astype(np.float16), rng.random(100)).bias.dtype == np.float16   # converts to match
    d = Dense(3, 4, init=lambda *s, rng=None: np.random.default_rng(0).standard_normal(s), bias=np.arange(4.0))
    assert d.bias.dtype == np.float64
    with pytest.raises(ValueError, match=r"Dense: out_features must be a positive int, got 10.5"):
        Dense(10, 10.5)
    with pytest.raises(ValueError, match=r"Dense: bias must be True, False or an array of shape \(4,\)"):
        Dense(3, 4, bias=rng.random(5))
    with pytest.raises(ValueError, match=r"Dense: bias must be True, False or an array of shape \(4,\)"):
        Dense(rng.random((4, 3)), rng.random(5))
    with pytest.raises(ValueError, match=r"Dense: a weight must be a float matrix \(out, in\), got \(5,\) float64"):
        Dense(rng.random(5))


def test_dense_dimensions():
    # basic.jl:75-85 (Flux's (10, 2, 3) input is fluxpy's (3, 2, 10))
    assert Dense(10, 5)(randn32(10)).shape == (5,)
    with pytest.raises(DimensionMismatch, match=r"Dense\(10 => 5\) expects x.shape\[-1\] == 10, got \(1,\) float32"):
        Dense(10, 5)(randn32(1))
    with pytest.raises(DimensionMismatch, match=r"Dense\(10 => 5\) expects x.shape\[-1\] == 10, got a int"):
        Dense(10, 5)(1)                                              # no broadcasting over a number
    d = fluxpy.f64(Dense(10, 5))
    for shape in [(10,), (2, 10), (3, 2, 10), (4, 3, 2, 10)]:
        assert d(np.random.default_rng(1).standard_normal(shape)).shape == shape[:-1] + (5,)
    with pytest.raises(DimensionMismatch, match=r"expects x.shape\[-1\] == 10, got \(3, 2, 11\)"):
        d(np.zeros((3, 2, 11)))


def test_dense_known_values():
    # basic.jl:86-92 ("zeros": init = ones)
    assert Dense(10, 1, init=ones_init)(np.ones((1, 10), np.float32)).tolist() == [[10.0]]
    assert Dense(10, 1, init=ones_init)(np.ones((2, 10), np.float32)).tolist() == [[10.0], [10.0]]
    assert Dense(10, 2, init=ones_init)(np.ones((1, 10), np.float32)).tolist() == [[10.0, 10.0]]
    x = np.stack([np.ones(10), 2 * np.ones(10)]).astype(np.float32)          # Flux's [ones 2ones], as rows
    assert Dense(10, 2, init=ones_init)(x).tolist() == [[10.0, 10.0], [20.0, 20.0]]
    assert Dense(10, 2, init=ones_init, bias=False)(x).tolist() == [[10.0, 10.0], [20.0, 20.0]]


def test_dense_type_matching_is_an_error_in_fluxpy():
    # basic.jl:93-109: Flux converts the input to the weight's type; fluxpy raises, naming the conversion
    d1 = Dense(2, 3)
    d2 = Dense(d1.weight, False)
    x1 = randn32(4, 2)
    np.testing.assert_allclose(d1(x1), d2(x1), rtol=1e-6)
    np.testing.assert_allclose(d1(x1), x1 @ d1.weight.T, rtol=1e-6)
    for x in (x1.astype(np.float64), np.arange(8).reshape(4, 2) - 4, np.eye(2, dtype=bool)[[0, 1, 1, 0]]):
        with pytest.raises(DTypeMismatch, match=r"Dense\(2 => 3\) expects x of dtype float32 \(its parameters' "
                                                 r"dtype\), got \(4, 2\) \w+: convert the input with x.astype"):
            d1(x)
        np.testing.assert_allclose(d1(x.astype(np.float32)), x.astype(np.float32) @ d1.weight.T, rtol=1e-6)


def test_scale():
    # basic.jl:111-130 (Flux's Scale(2, 3) on (2, 3, 4) is Scale(3, 2) on (4, 3, 2) here)
    f64 = fluxpy.f64
    r = np.random.default_rng(2)
    assert f64(Scale(10))(r.standard_normal(10)).shape == (10,)
    assert f64(Scale(10))(r.standard_normal(1)).shape == (10,)           # x broadcasts up
    assert f64(Scale(10, bias=False))(r.standard_normal(10)).shape == (10,)
    assert f64(Scale(10, act=np.tanh))(r.standard_normal(10)).shape == (10,)
    with pytest.raises(DimensionMismatch, match=r"Scale\(10\) expects x that broadcasts with \(10,\)"):
        f64(Scale(10))(r.standard_normal(2))
    # Flux's [1 2] (1x2) is [[1], [2]] here, and its [1 2; 1 2] is [[1, 1], [2, 2]]
    assert f64(Scale(2))(np.array([[1.0], [2.0]])).tolist() == [[1.0, 1.0], [2.0, 2.0]]
    assert f64(Scale(2))(np.array([1.0, 2.0])).tolist() == [1.0, 2.0]
    init = lambda *s, rng=None: np.random.default_rng(3).standard_normal(s)   # noqa: E731
    assert Scale(2, init=init)(np.array([1.0, 2.0])).tolist() != [1.0, 2.0]
    assert f64(Scale(2, bias=False))(np.array([[1.0, 3.0], [2.0, 4.0]])).tolist() == [[1.0, 3.0], [2.0, 4.0]]
    sq = Scale(2, act=np.square, bias=False, init=lambda *s, rng=None: np.ones(s))
    assert sq(np.array([[1.0, 3.0], [2.0, 4.0]])).tolist() == [[1.0, 9.0], [4.0, 16.0]]
    assert f64(Scale(2))(r.random((4, 3, 2))).shape == (4, 3, 2)
    assert f64(Scale(3, 2))(r.random((4, 3, 2))).shape == (4, 3, 2)
    assert f64(Scale(4, 3, 2, bias=False))(r.random((4, 3, 2))).shape == (4, 3, 2)
    assert f64(Scale(3, 2, bias=False))(r.random((4, 1, 2))).shape == (4, 3, 2)
    zero = Scale(3, 2, act=np.tanh, bias=False, init=lambda *s, rng=None: np.zeros(s))
    assert zero(r.random((4, 1, 2))).tolist() == np.zeros((4, 3, 2)).tolist()
    with pytest.raises(ValueError, match="Scale expects a size"):
        Scale()
    with pytest.raises(ValueError, match=r"Scale: size must be a positive int, got 1.0"):
        Scale(1.0)


def test_maxout():
    # basic.jl:132-161
    x = np.random.default_rng(4).random(40)
    assert (Maxout(lambda: identity, 4)(x) == x).all()
    assert (Maxout(lambda v: v, lambda v: 2 * v, lambda v: 0.5 * v)(x) == 2 * x).all()
    inp = np.array([[3.0], [2.0]])                                   # Flux's [3.0 2.0] (1x2), batch first
    mo = Maxout(lambda v: v @ np.array([[0.5, 0.1]]), lambda v: v @ np.array([[0.2, 0.7]]))
    assert mo(inp).tolist() == (np.array([0.5, 0.7]) * inp).tolist()
    assert len(fluxpy.trainables(Maxout(lambda: Dense(32, 64), 4))) == 8   # 4 alternatives, weight and bias each


def test_skip_connection():
    # basic.jl:163-173
    x = np.random.default_rng(5).standard_normal((10, 10, 10, 10))
    assert (SkipConnection(lambda v: np.zeros(v.shape), lambda a, b: a + b)(x) == x).all()
    x = randn32(2, 10)
    cat = SkipConnection(Dense(10, 10), lambda a, b: fluxpy.concatenate([a, b], axis=0))
    assert cat(x).shape == (4, 10)                                   # Flux's cat(dims=2) of (10, 2): (10, 4)


def test_bilinear():
    # basic.jl:175-197 (Flux's Bilinear(10, 10, 5) is Bilinear((10, 10), 5))
    sc = SkipConnection(Dense(10, 10), Bilinear((10, 10), 5))
    assert sc(randn32(9, 10)).shape == (9, 5)
    b = Bilinear((10, 2), 3)
    y = b(np.zeros((9, 10), np.float32), np.zeros((9, 2), np.float32))
    assert y.shape == (9, 3) and float((y ** 2).sum()) == 0.0
    b = fluxpy.f64(Bilinear((11, 11), 3, rng=0))
    x = np.random.default_rng(6).standard_normal((7, 11))
    assert b(x).shape == (7, 3)
    check_grad(lambda x: b(x), x)                                    # test_gradients(b, x)


def test_parallel():
    # basic.jl:216-266, 268-281
    x = np.random.default_rng(7).standard_normal((10, 10, 10, 10))
    assert (Parallel(lambda a, b: a + b, lambda v: np.zeros(v.shape), identity)(x) == x).all()
    x = randn32(2, 10)
    assert Parallel(lambda a, b: fluxpy.concatenate([a, b], axis=0), Dense(10, 10), identity)(x).shape == (4, 10)
    inputs = randn32(10), randn32(5), randn32(4)
    assert Parallel(lambda *ys: sum(ys), Dense(10, 2), Dense(5, 2), Dense(4, 2))(inputs).shape == (2,)
    with pytest.raises(DimensionMismatch, match=r"Parallel with 2 layers expects 1 or 2 inputs, got 3"):
        Parallel(lambda a, b: a + b, np.sin, np.cos)(1.0, 2.0, 3.0)  # wrong number of inputs
    assert Parallel(lambda a, b: a + b, np.sin, np.cos)(np.pi / 2) == pytest.approx(1.0)   # one input, two layers
    assert Parallel(lambda a, b: a / b, abs)(3, -4) == pytest.approx(3 / 4)   # one layer, several inputs
    assert Parallel(lambda a, b: a / b, abs)((3, -4)) == pytest.approx(3 / 4)
    assert Parallel(np.atleast_1d, np.log)(1.0).tolist() == [0.0]   # Flux's Parallel(vcat, log)(1) == [0]
    with pytest.raises(DimensionMismatch, match=r"expects at least one input, got none"):
        Parallel(np.hstack, np.exp)()                                # zero inputs: always an error
    with pytest.raises(ValueError, match=r"Parallel expects at least one layer after the connection"):
        Parallel(np.hstack)                                          # zero layers: an error
    calls = []

    def counted(*ys):
        calls.append(1)
        return sum(ys)
    Parallel(counted, np.sin, np.cos, np.tan)(1.0)
    Parallel(counted, np.sin, np.cos, np.tan)(1.0, 2.0, 3.0)
    Parallel(counted, np.sin)(1.0)
    Parallel(counted, np.sin)(1.0, 2.0, 3.0)
    assert len(calls) == 4                                            # the connection is called once per call


def test_embedding():
    # basic.jl:310-340 (0-based indices; Flux's (dim, n) weight is (n, dim) here)
    m = Embedding(10, 4)
    assert m.weight.shape == (10, 4)
    assert m(0).dtype == np.float32 and m(0).shape == (4,)
    np.testing.assert_array_equal(m(1), m.weight[1])
    np.testing.assert_array_equal(m(np.eye(10, dtype=bool)[2]), m.weight[2])   # a one-hot vector
    with pytest.raises(DimensionMismatch, match=r"one-hot rows of length 10 \(the last axis\), got \(1000,\) bool"):
        m(np.eye(1000, dtype=bool)[2])
    np.testing.assert_array_equal(m(3), m(np.arange(10) == 3))
    x = np.random.default_rng(8).integers(0, 10, 3)
    y = m(x)
    assert y.shape == (3, 4)
    np.testing.assert_array_equal(y, m.weight[x])
    np.testing.assert_allclose(m(onehotbatch(x, 10)), y, rtol=1e-7)
    with pytest.raises(DimensionMismatch):
        m(onehotbatch(x, 1000))
    np.testing.assert_array_equal(m(x[:, None] == np.arange(10)), y)
    x = np.random.default_rng(9).integers(0, 10, (4, 3))             # Flux's (3, 4)
    assert m(x).shape == (4, 3, 4)
    x3 = np.eye(10, dtype=np.float32)[x]                             # Flux's onehotbatch (10, 3, 4)
    assert x3.shape == (4, 3, 10) and m(x3).shape == (4, 3, 4)


def test_embedding_padding_idx():
    # basic.jl:342-380 (Flux's pad = 2 is fluxpy's 1)
    pad = 1
    m = Embedding(10, 4, padding_idx=pad)
    assert m.padding_idx == pad and not m.weight[pad].any() and f"padding_idx={pad}" in repr(m)
    for bad in (-1, 10):
        with pytest.raises(ValueError, match=r"Embedding: padding_idx must be an int in \[0, 10\) or None"):
            Embedding(10, 4, padding_idx=bad)
    assert not m(pad).any()
    x = np.array([0, pad, 2, pad, 3])
    y = m(x)
    assert not y[[1, 3]].any()
    np.testing.assert_allclose(m(onehotbatch(x, 10)), y, rtol=1e-7)
    assert not m(np.eye(10, dtype=bool)[pad]).any()
    xnd = np.array([[0, 2], [pad, pad]])                             # Flux's [1 pad; 3 pad], transposed
    assert not m(xnd)[1].any()
    m0 = Embedding(10, 4)
    m0.weight = m.weight.copy()
    for inp in (x, onehotbatch(x, 10)):
        g = gradient(lambda m: m(inp).sum(), m)[0]["weight"]
        g0 = gradient(lambda m: m(inp).sum(), m0)[0]["weight"]
        assert not g[pad].any() and g0[pad].any()
        np.testing.assert_array_equal(np.delete(g, pad, 0), np.delete(g0, pad, 0))
    assert not gradient(lambda m: m(pad).sum(), m)[0]["weight"].any()
    m64 = fluxpy.f64(m)
    for inp in (x, onehotbatch(x, 10).astype(np.float64)):   # test_gradients(m, x): finite differences
        check_grad(lambda w: Embedding.__call__(_with_weight(m64, w), inp), m64.weight.copy())
    opt = fluxpy.setup(fluxpy.Adam(0.1), m)
    fluxpy.train(lambda m, x: ((m(x) - 1) ** 2).sum(), m, [(x,)] * 5, opt, progress=False)
    assert not m.weight[pad].any()                                   # the padding row stays zero through training


def _with_weight(layer, w):
    clone = object.__new__(type(layer))
    clone.__dict__.update(layer.__dict__, weight=w)
    return clone


@pytest.mark.parametrize("name", ["sum", "mean", "max"])
def test_embedding_bag(name):
    # basic.jl:384-449 (Flux's maximum is fluxpy.max; 0-based indices and offsets, bags along the last axis)
    reduction = {"sum": fluxpy.sum, "mean": fluxpy.mean, "max": fluxpy.max}[name]
    bag = EmbeddingBag(10, 4, reduction)
    emb = Embedding(10, 4)
    emb.weight = bag.weight
    assert bag.weight.shape == (10, 4)
    with pytest.raises(ValueError, match=r"expects an array of indices \(a bag\), not just one index 1"):
        bag(1)
    rng = np.random.default_rng(10)
    x = rng.integers(0, 10, 3)
    np.testing.assert_allclose(bag(x), reduction(emb(x), axis=0), rtol=1e-6)
    assert bag(x).shape == (4,) and bag(x).dtype == np.float32
    data = np.array([0, 2, 1, 3, 4, 6])                              # Flux's [1,3,2,4,5,7], offsets [1,3,5]
    np.testing.assert_allclose(bag(data, [0, 2, 4]), bag([[0, 2], [1, 3], [4, 6]]), rtol=1e-6)
    np.testing.assert_allclose(bag(data, [0, 2, 4]), bag(np.array([[0, 2], [1, 3], [4, 6]])), rtol=1e-6)
    for offsets in ([1, 3], [0, 11]):
        with pytest.raises(ValueError, match=r"expects offsets that start at 0, increase strictly"):
            bag(np.arange(6), offsets)
    np.testing.assert_allclose(bag(np.arange(10), [0, 4, 5, 7]), bag([[0, 1, 2, 3], [4], [5, 6], [7, 8, 9]]),
                               rtol=1e-6)
    bags = [rng.integers(0, 10, 3) for _ in range(4)]
    np.testing.assert_allclose(bag(bags), np.stack([reduction(emb(b), axis=0) for b in bags]), rtol=1e-6)
    x = rng.integers(0, 10, (5, 3))                                   # Flux's (3, 5): 5 bags of 3
    np.testing.assert_allclose(bag(x), bag(list(x)), rtol=1e-6)
    np.testing.assert_allclose(bag(x), np.stack([reduction(emb(b), axis=0) for b in x]), rtol=1e-6)
    with pytest.raises(DimensionMismatch, match=r"not a one-hot vector"):
        bag(np.eye(10, dtype=bool)[2])                               # a one-hot vector is not a bag
    i2 = rng.integers(0, 10, 3)
    y2 = bag(np.eye(10, dtype=bool)[i2])                             # a one-hot matrix is one bag
    assert y2.shape == (4,) and y2.dtype == np.float32
    np.testing.assert_allclose(y2, reduction(emb(i2), axis=0), rtol=1e-6)
    with pytest.raises(DimensionMismatch):
        bag(np.eye(1000, dtype=bool)[:5])


def test_second_derivatives():
    # basic.jl:452-468 (hessian_dual vs hessian_reverse; here reverse-over-reverse vs finite differences)
    m1 = fluxpy.f64(Chain(Dense(3, 4, np.tanh, bias=False), Dense(4, 2)))
    x = np.array([1.0, 2.0, 3.0])
    check_second_order(lambda x: m1(x), x)
    m1v = Chain([m1[0], m1[1]])
    np.testing.assert_allclose(fluxpy.hessian(lambda x: m1v(x).sum(), x), fluxpy.hessian(lambda x: m1(x).sum(), x))
    m2 = fluxpy.f64(Chain(Dense(3, 4, np.tanh), Dense(4, 2), fluxpy.softmax))   # @test_broken in Flux
    check_second_order(lambda x: np.sin(m2(x)), x)
    m3 = fluxpy.f64(Chain(fluxpy.Conv((3,), 2, 3, relu, rng=0), Dense(2, 2)))   # NNlib issue 362
    x3 = np.array([[1.0, 3, 5, 7], [2, 4, 6, 8]])[None]              # Flux's cat(Float32[1 2; 3 4; 5 6; 7 8]; dims=3)
    # piecewise linear: the Hessian is zero (both of Zygote's modes agree on that); fluxpy says the gradient no longer
    # depends on x, and gives zeros
    with pytest.warns(fluxpy.DetachedGradientWarning):
        h = fluxpy.hessian(lambda x: m3(x).sum(), x3)
    assert np.asarray(h).size == x3.size ** 2 and not np.asarray(h).any()


def test_gradients_of_a_chain_of_a_list():
    # basic.jl:470-487
    m1 = Chain(Dense(3, 4, np.tanh, bias=False), Dense(4, 2))
    m1v = Chain([m1[0], m1[1]])
    assert sum(a.size for a in fluxpy.trainables(m1)) == sum(a.size for a in fluxpy.trainables(m1v)) == 22
    x1 = randn32(5, 3)
    np.testing.assert_array_equal(m1(x1), m1v(x1))
    y1 = (np.random.default_rng(11).random((5, 2)) > 0.5).astype(np.float32)
    g1 = gradient(lambda m: fluxpy.logitcrossentropy(m(x1), y1), m1)[0]
    g1v = gradient(lambda m: fluxpy.logitcrossentropy(m(x1), y1), m1v)[0]
    np.testing.assert_allclose(g1["layers"][0]["weight"], g1v["layers"][0]["weight"], rtol=1e-6)
    np.testing.assert_allclose(g1["layers"][1]["bias"], g1v["layers"][1]["bias"], rtol=1e-6)


def test_pairwise_fusion():
    # basic.jl:489-505 (Flux's (1, 10) and (30, 10) inputs are (10, 1) and (10, 30))
    x = (randn32(10, 1), randn32(10, 30))
    y = PairwiseFusion(lambda a, b: a + b, Dense(1, 30), Dense(30, 10))(x)
    assert len(y) == 2 and y[0].shape == (10, 30) and y[1].shape == (10, 10)
    y = PairwiseFusion(lambda a, b: a + b, Dense(1, 10), Dense(10, 1))(randn32(10, 1))
    assert len(y) == 2 and y[0].shape == (10, 10) and y[1].shape == (10, 1)

    def vcat(a, b):
        return np.concatenate([np.atleast_1d(a), np.atleast_1d(b)])
    out = PairwiseFusion(vcat, lambda v: v + 1, lambda v: v + 2, lambda v: v ** 3)(2, 10, 20)
    assert out[0] == 3 and out[1].tolist() == [5, 12] and out[2].tolist() == [125, 1728, 8000]
    out = PairwiseFusion(vcat, lambda v: v + 1, lambda v: v + 2, lambda v: v ** 3)(7)
    assert out[0] == 8 and out[1].tolist() == [10, 9] and out[2].tolist() == [1000, 729, 343]


def test_against_torch():
    torch = pytest.importorskip("torch")
    # Dense(W, b) and EmbeddingBag(mean) against PyTorch, float64, weights shared
    rng = np.random.default_rng(12)
    w, b = rng.standard_normal((3, 5)), rng.standard_normal(3)
    x = rng.standard_normal((4, 5))
    np.testing.assert_allclose(Dense(w, b, np.tanh)(x), torch.tanh(torch.nn.functional.linear(
        torch.tensor(x), torch.tensor(w), torch.tensor(b))).numpy(), rtol=1e-14)
    bag = fluxpy.f64(EmbeddingBag(10, 4, rng=0))
    idx = rng.integers(0, 10, (3, 5))
    t = torch.nn.functional.embedding_bag(torch.tensor(idx), torch.tensor(bag.weight), mode="mean")
    np.testing.assert_allclose(bag(idx), t.numpy(), rtol=1e-14)
