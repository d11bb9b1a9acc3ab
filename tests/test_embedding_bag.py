"""Embedding with one-hot input and padding_idx, and EmbeddingBag (Flux's src/layers/basic.jl): values and gradients
against PyTorch 2.13 in float64 (weights copied), gradients against float64 finite differences under hypothesis,
Flux's docstring examples (0-based), reprs and error messages."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import DimensionMismatch, Embedding, EmbeddingBag, gradient, onehotbatch
from gradcheck import check_grad

seeds = st.integers(0, 2**31 - 1)


def eye_init(gain):
    """Flux's identity_init(gain=...) for an (n, dim) table: row i is gain * e_i."""
    return lambda n, d, rng=None: gain * np.eye(n, d, dtype=np.float32)


def with_weight(layer, w):
    """A copy of ``layer`` with its weight replaced (for finite differences in the weight)."""
    clone = object.__new__(type(layer))
    clone.__dict__.update(layer.__dict__, weight=w)
    return clone


# ---------------------------------------------------------------------------------------------
# Embedding


def test_flux_docstring_examples_zero_based():
    # Flux src/layers/basic.jl:745-771 (Embedding's docstring), indices and one-hot minus one
    emb = Embedding(26, 4, init=eye_init(22))
    assert repr(emb) == "Embedding(26 => 4)"
    np.testing.assert_array_equal(emb(1), [0, 22, 0, 0])
    y = emb(np.array([2, 0, 19, 13, 3, 14, 6]))
    assert y.shape == (7, 4) and y[0, 2] == 22 and y[1, 0] == 22 and y[4, 3] == 22
    hot = onehotbatch(list("cat&dog"), list("abcdefghijklmnopqrstuvwxyz") + ["&"])[:, :26]   # '&' -> no 1
    np.testing.assert_array_equal(emb(hot)[[0, 1, 2, 4, 5, 6]], y[[0, 1, 2, 4, 5, 6]])
    assert emb(np.random.default_rng(0).integers(0, 26, (12, 1, 10))).shape == (12, 1, 10, 4)
    p = Embedding(5, 2, padding_idx=0)
    np.testing.assert_array_equal(p(0), [0, 0])
    assert repr(p) == "Embedding(5 => 2, padding_idx=0)"


@pytest.mark.parametrize("hot_dtype", [np.float32, np.float64, np.bool_])
def test_one_hot_input_equals_indices(hot_dtype):
    emb = Embedding(6, 3, rng=0)
    idx = np.array([[5, 0, 2], [2, 2, 1]])
    hot = np.eye(6, dtype=hot_dtype)[idx]                      # (2, 3, 6)
    np.testing.assert_allclose(emb(hot), emb(idx), rtol=1e-7)
    assert emb(hot).dtype == np.float32
    np.testing.assert_array_equal(emb(np.eye(6, dtype=hot_dtype)[4]), emb(4))   # a one-hot vector
    g_hot = gradient(lambda m: (m(hot) ** 2).sum(), emb)[0]["weight"]
    g_idx = gradient(lambda m: (m(idx) ** 2).sum(), emb)[0]["weight"]
    np.testing.assert_allclose(g_hot, g_idx, rtol=1e-6)


@given(seed=seeds, padding=st.sampled_from([None, 0, 3]), onehot=st.booleans())
def test_embedding_gradients_against_finite_differences(seed, padding, onehot):
    rng = np.random.default_rng(seed)
    emb = fluxpy.f64(Embedding(5, 3, rng=seed % 1000, padding_idx=padding))
    idx = rng.integers(0, 5, (4, 2))
    x = np.eye(5)[idx] if onehot else idx
    g = check_grad(lambda w: with_weight(emb, w)(x), emb.weight.copy(), rng=rng)[0]
    if padding is not None:
        assert not g[padding].any(), "the padding row gets no gradient"
    if onehot:   # a float one-hot is differentiable too (a soft selection)
        check_grad(lambda h: emb(h), np.eye(5)[idx] + 0.0, rng=rng)


def test_padding_idx_against_torch():
    torch = pytest.importorskip("torch")
    emb = fluxpy.f64(Embedding(6, 4, rng=1, padding_idx=2))
    assert not emb.weight[2].any()
    t = torch.nn.Embedding(6, 4, padding_idx=2).double()
    with torch.no_grad():
        t.weight.copy_(torch.tensor(emb.weight))
    idx = np.array([[2, 1, 5], [2, 2, 0]])
    ct = np.random.default_rng(2).standard_normal((2, 3, 4))
    ty = t(torch.tensor(idx))
    ty.backward(torch.tensor(ct))
    y, back = fluxpy.pullback(lambda m: m(idx), emb)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-15)
    np.testing.assert_allclose(back(ct)[0]["weight"], t.weight.grad.numpy(), rtol=1e-14)
    # Flux masks the output (the row stays fixed even if someone writes into it); PyTorch returns the row
    emb.weight[2] = 7.0
    assert not emb(np.array([2])).any()


def test_embedding_errors():
    emb = Embedding(5, 2)
    with pytest.raises(DimensionMismatch, match=r"Embedding\(5 => 2\) expects integer indices, or one-hot rows of "
                                                r"length 5 \(the last axis\), got \(3, 4\) float32"):
        emb(np.zeros((3, 4), np.float32))
    with pytest.raises(DimensionMismatch, match=r"Embedding\(5 => 2\) expects indices in \[0, 5\), found indices from 0 to 5"):
        emb(np.array([0, 5]))
    with pytest.raises(ValueError, match=r"Embedding: padding_idx must be an int in \[0, 5\) or None, got 5"):
        Embedding(5, 2, padding_idx=5)
    with pytest.raises(ValueError, match=r"Embedding: padding_idx must be an int in \[0, 5\) or None, got True"):
        Embedding(5, 2, padding_idx=True)


# ---------------------------------------------------------------------------------------------
# EmbeddingBag


def test_flux_embedding_bag_docstring_examples_zero_based():
    # Flux src/layers/basic.jl:873-936 (EmbeddingBag's docstring), 0-based; bags along the last axis
    eb = EmbeddingBag(26, 3, init=eye_init(100))
    assert repr(eb) == "EmbeddingBag(26 => 3)"
    np.testing.assert_array_equal(eb(np.array([1])), [0, 100, 0])
    np.testing.assert_allclose(eb(np.array([2, 2, 0])), [100 / 3, 0, 200 / 3], rtol=1e-6)
    np.testing.assert_allclose(eb([[2, 0, 2], [1, 0]]), [[100 / 3, 0, 200 / 3], [50, 50, 0]], rtol=1e-6)
    # Flux's [1 1 1 1; 1 2 3 4] is 4 bags (columns) of 2: here (4, 2), bags as rows
    np.testing.assert_allclose(eb(np.array([[0, 0], [0, 1], [0, 2], [0, 3]])),
                               [[100, 0, 0], [50, 50, 0], [50, 0, 50], [50, 0, 0]])
    assert eb(np.random.default_rng(0).integers(0, 26, (5, 5, 10))).shape == (5, 5, 3)
    data = np.array([10, 0, 11, 1, 12, 2, 13])
    np.testing.assert_allclose(eb(data, [0, 3]), [[100 / 3, 0, 0], [0, 25, 25]], rtol=1e-6)
    letters = "abcdefghijklmnopqrstuvwxyz"
    np.testing.assert_allclose(eb(onehotbatch(list("bba"), letters)), [100 / 3, 200 / 3, 0], rtol=1e-6)
    np.testing.assert_allclose(eb([onehotbatch(list("bba"), letters), onehotbatch(list("cc"), letters)]),
                               [[100 / 3, 200 / 3, 0], [0, 0, 100]], rtol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_ragged_bags_against_torch(mode):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    reduction = {"sum": fluxpy.sum, "mean": fluxpy.mean, "max": fluxpy.max}[mode]
    eb = fluxpy.f64(EmbeddingBag(10, 4, reduction, rng=2))
    data = rng.integers(0, 10, 12)
    offsets = np.array([0, 2, 3, 7])
    t = torch.tensor(eb.weight, requires_grad=True)
    ty = torch.nn.functional.embedding_bag(torch.tensor(data), t, torch.tensor(offsets), mode=mode)
    ct = rng.standard_normal(ty.shape)
    ty.backward(torch.tensor(ct))
    y, back = fluxpy.pullback(lambda m: m(data, offsets), eb)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-14)
    np.testing.assert_allclose(back(ct)[0]["weight"], t.grad.numpy(), rtol=1e-13)
    # the same bags as a list, and as one (N, L) array where they have one length
    bags = [data[0:2], data[2:3], data[3:7], data[7:]]
    np.testing.assert_allclose(eb(bags), y, rtol=1e-14)
    np.testing.assert_allclose(eb(data[:8].reshape(2, 4)), eb(data[:8], [0, 4]), rtol=1e-14)
    assert repr(eb) == ("EmbeddingBag(10 => 4)" if mode == "mean" else f"EmbeddingBag(10 => 4, {mode})")


@given(seed=seeds, form=st.sampled_from(["array", "list", "offsets", "onehot"]),
       reduction=st.sampled_from(["mean", "sum", "max", "custom"]))
def test_embedding_bag_gradients_against_finite_differences(seed, form, reduction):
    rng = np.random.default_rng(seed)
    f = {"mean": fluxpy.mean, "sum": fluxpy.sum, "max": fluxpy.max,
         "custom": lambda e, axis: fluxpy.sum(e * e, axis=axis)}[reduction]
    eb = fluxpy.f64(EmbeddingBag(6, 3, f, rng=seed % 1000))
    eb.weight = eb.weight + np.arange(18).reshape(6, 3) * 0.37   # distinct values: no ties for max within eps
    if form == "array":
        args = (rng.integers(0, 6, (2, 3)),)
    elif form == "list":
        args = ([rng.integers(0, 6, n) for n in (1, 3, 2)],)
    elif form == "offsets":
        args = (rng.integers(0, 6, 5), np.array([0, 1, 4]))
    else:
        args = (np.eye(6)[rng.integers(0, 6, (2, 3))],)
    check_grad(lambda w: with_weight(eb, w)(*args), eb.weight, rng=rng)


def test_embedding_bag_errors():
    eb = EmbeddingBag(5, 2)
    with pytest.raises(ValueError, match=r"EmbeddingBag\(5 => 2\) expects an array of indices \(a bag\), not just one"):
        eb(3)
    with pytest.raises(DimensionMismatch, match=r"EmbeddingBag\(5 => 2\) expects a bag of one-hot rows \(L, 5\), not "
                                                r"a one-hot vector, got \(5,\) float32"):
        eb(np.eye(5, dtype=np.float32)[1])
    with pytest.raises(ValueError, match=r"expects offsets that start at 0, increase strictly and stay below "
                                         r"len\(data\) == 4 \(every bag non-empty\), got \[0, 2, 2\]"):
        eb(np.array([0, 1, 2, 3]), [0, 2, 2])
    with pytest.raises(ValueError, match=r"got \[1, 2\]"):
        eb(np.array([0, 1, 2, 3]), [1, 2])
    with pytest.raises(DimensionMismatch, match=r"expects bags that are non-empty 1-d sequences of integer indices"):
        eb([[0, 1], []])
    with pytest.raises(ValueError, match=r"expects at least one bag, got an empty list"):
        eb([])
    with pytest.raises(DimensionMismatch, match=r"expects indices in \[0, 5\), found indices from 0 to 7"):
        eb(np.array([[0, 7]]))
    with pytest.raises(TypeError, match=r"EmbeddingBag: reduction must be callable, got 'mean'"):
        EmbeddingBag(5, 2, "mean")


def test_embedding_bag_is_a_model_tree():
    eb = EmbeddingBag(4, 2, fluxpy.sum, rng=0)
    assert [k for k, _ in fluxpy.children(eb)] == ["weight"]
    g = gradient(lambda m: m(np.array([[0, 1]])).sum(), eb)[0]
    assert set(g) == {"weight"} and g["weight"][:2].tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_max_bag_ties_share_the_gradient_where_pytorch_gives_it_to_one_item():
    """A deliberate difference from PyTorch (EmbeddingBag's docstring says so): fluxpy's ``max`` shares a tied
    maximum's gradient evenly among the tied items (as ``fluxpy.max`` does everywhere), so a repeated index gets it
    once in total; PyTorch's ``mode="max"`` gives the whole of it to one item (its ``max_indices``)."""
    w = np.array([[1.0, 5.0], [1.0, 2.0], [0.0, 5.0]])   # column 0: rows 0 and 1 tie; column 1: rows 0 and 2 tie
    eb = EmbeddingBag(3, 2, fluxpy.max)
    eb.weight = w.copy()
    bag = np.array([[0, 1, 2]])
    g, = gradient(lambda m: m(bag).sum(), eb)
    np.testing.assert_allclose(g["weight"], [[0.5, 0.5], [0.5, 0.0], [0.0, 0.5]])
    repeated, = gradient(lambda m: m(np.array([[0, 0, 1]])).sum(), eb)
    assert repeated["weight"].sum(axis=0).tolist() == [1.0, 1.0]   # one unit per output column in total
    torch = pytest.importorskip("torch")
    tw = torch.tensor(w, requires_grad=True)
    torch.nn.functional.embedding_bag(torch.tensor(bag), tw, mode="max").sum().backward()
    theirs = tw.grad.numpy()
    assert theirs.sum(axis=0).tolist() == [1.0, 1.0] and sorted(theirs[:, 0].tolist()) == [0.0, 0.0, 1.0]
