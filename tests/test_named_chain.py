"""Named Chains (Flux's ``Chain(enc=..., dec=...)``): access by attribute and name, slicing, errors, repr, and
that gradients, optimisers, fmap, copies and checkpoints treat them as the same Chain unnamed."""
import copy
import pickle

import numpy as np
import pytest

import fluxpy
from fluxpy import Chain, Dense


def _model():
    return Chain(enc=Dense(4, 3, fluxpy.relu, rng=0), dec=Dense(3, 2, rng=1))


def test_named_layers_are_reached_by_attribute_name_and_position():
    m = _model()
    assert m.enc is m["enc"] is m[0] and m.dec is m[1] and m.names == ("enc", "dec")
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(m(x), m.dec(m.enc(x)), rtol=1e-6)
    unnamed = Chain(m.enc, m.dec)
    np.testing.assert_array_equal(m(x), unnamed(x))
    assert m[1:].names == ("dec",) and m[1:].dec is m.dec
    with pytest.raises(KeyError, match="no layer named 'mid'"):
        m["mid"]
    with pytest.raises(AttributeError, match="no attribute or layer named 'mid'"):
        _ = m.mid
    with pytest.raises(KeyError, match="its names are None"):
        unnamed["enc"]


def test_errors_name_the_problem():
    with pytest.raises(TypeError, match="either in order or by name"):
        Chain(Dense(2, 2), enc=Dense(2, 2))
    with pytest.raises(ValueError, match="'layers' is taken by Chain itself"):
        Chain(layers=Dense(2, 2))
    with pytest.raises(TypeError, match="layer 'dec' is not callable"):
        Chain(enc=Dense(2, 2), dec=3)
    with pytest.raises(fluxpy.DimensionMismatch, match=r"Chain layer 1 \(dec\): Dense\(3 => 2\)"):
        Chain(enc=Dense(4, 4), dec=Dense(3, 2))(np.ones((1, 4), np.float32))


def test_repr_prints_the_names():
    text = repr(_model())
    assert "enc = Dense(4 => 3, relu)," in text and "dec = Dense(3 => 2)," in text
    nested = repr(Chain(_model(), Dense(2, 1)))
    assert "  Chain(\n    enc = Dense(4 => 3, relu)," in nested
    inline = repr(fluxpy.SkipConnection(Chain(enc=Dense(2, 2, rng=0), dec=Dense(2, 2, rng=1)), fluxpy.ops.add))
    assert "Chain(enc = Dense(2 => 2), dec = Dense(2 => 2))" in inline


def test_gradients_optimisers_copies_and_checkpoints_see_the_same_tree(tmp_path):
    m = _model()
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    (g,) = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), m)
    (gu,) = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), Chain(m.enc, m.dec))
    np.testing.assert_array_equal(g["layers"][0]["weight"], gu["layers"][0]["weight"])
    state = fluxpy.setup(fluxpy.Adam(1e-2), m)
    before = m.enc.weight.copy()
    fluxpy.update(state, m, g)
    assert not np.array_equal(before, m.enc.weight)
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m)), fluxpy.fmap(lambda a: a, m), fluxpy.f64(m)):
        assert other.names == ("enc", "dec") and other.enc.weight.shape == (3, 4)
    fluxpy.save(tmp_path / "m.npz", m)
    fresh = _model()
    loaded = fluxpy.load(tmp_path / "m.npz", fresh)
    np.testing.assert_array_equal(loaded.enc.weight, m.enc.weight)
