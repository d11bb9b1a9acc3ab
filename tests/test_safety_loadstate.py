"""loadstate is all or nothing: every array of the state is checked (structure, shape, a dtype whose values the
model's holds) before any is copied, so a bad one anywhere (hypothesis picks where) leaves the model byte-identical."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import layer, loadstate, state
from fluxpy.layers import BatchNorm, Chain, Dense


@layer(trainable=("weight", "bias"))
class Block:
    def __init__(self, rng, n, dtype):
        self.weight = rng.standard_normal((n, n)).astype(dtype)
        self.bias = rng.standard_normal(n).astype(dtype)
        self.counts = np.arange(n, dtype=np.int32)
        self.eps = 1e-5


def make_model(rng, sizes, dtype=np.float32):
    return {"blocks": [Block(rng, n, dtype) for n in sizes], "scale": np.ones(1, dtype)}


def arrays(model):
    return [a for a in _leaves(state(model))]


def _leaves(st):
    if isinstance(st, dict):
        for v in st.values():
            yield from _leaves(v)
    elif isinstance(st, list):
        for v in st:
            yield from _leaves(v)
    elif st is not None:
        yield st


def snapshot(model):
    return [(a.dtype.str, a.shape, a.tobytes()) for a in arrays(model)]


def slots(st):
    """(container, key) of every array in a state tree, in order."""
    out = []
    for block in st["blocks"]:
        out += [(block, "weight"), (block, "bias"), (block, "counts")]
    return out + [(st, "scale")]


FLOAT_CORRUPTIONS = {
    "shape": (lambda a: np.zeros(a.shape + (1,), a.dtype), r"expects shape"),
    "complex": (lambda a: a.astype(np.complex64), r"complex64 values, which do not convert to it \(the imaginary"),
    "bool": (lambda a: a > 0, r"bool values, which do not convert"),
    "string": (lambda a: a.astype(str), r"<U\d+ values, which do not convert"),
    "object": (lambda a: a.astype(object), r"object values, which do not convert"),
    "overflow": (lambda a: np.full(a.shape, 1e300), r"float64 values such as 1e\+300 that overflow it to infinity"),
    "inexact int": (lambda a: np.full(a.shape, 2**24 + 1, np.int64), r"int64 values such as 16777217 that it cannot "
                                                                     r"hold exactly"),
    "list": (lambda a: a.tolist(), r"expects an array of shape"),
    "missing": (lambda a: None, r"is missing from the state"),
}
INT_CORRUPTIONS = {
    "float": (lambda a: a.astype(np.float64), r"float64 values, which do not convert to it \(the fractions"),
    "out of range": (lambda a: np.full(a.shape, 2**40, np.int64), r"int64 values such as 1099511627776 that it cannot"),
}


@given(data=st.data(), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3), seed=st.integers(0, 2**31 - 1))
def test_a_bad_array_anywhere_loads_nothing(data, sizes, seed):
    rng = np.random.default_rng(seed)
    model = make_model(rng, sizes)
    source = make_model(np.random.default_rng(seed + 1), sizes)
    st_ = state(source)
    places = slots(st_)
    container, key = places[data.draw(st.integers(0, len(places) - 1), label="bad array")]
    table = INT_CORRUPTIONS if key == "counts" else FLOAT_CORRUPTIONS
    name = data.draw(st.sampled_from(sorted(table)), label="corruption")
    corrupt, message = table[name]
    container[key] = corrupt(container[key])
    before = snapshot(model)
    with pytest.raises(ValueError, match=message) as err:
        loadstate(model, st_)
    assert snapshot(model) == before
    assert str(err.value).startswith("loadstate: model.") and str(err.value).endswith("; nothing was loaded")
    assert f".{key}" in str(err.value)


@given(data=st.data(), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3), seed=st.integers(0, 2**31 - 1))
def test_a_structural_mismatch_anywhere_loads_nothing(data, sizes, seed):
    rng = np.random.default_rng(seed)
    model = make_model(rng, sizes)
    st_ = state(make_model(rng, sizes))
    kind = data.draw(st.sampled_from(["extra field", "extra block", "missing block", "array at a number",
                                      "list for a dict"]))
    i = data.draw(st.integers(0, len(sizes) - 1))
    if kind == "extra field":
        st_["blocks"][i]["momentum"] = np.zeros(1)
        message = r"the state has fields \['momentum'\] that model\.blocks\[\d\]"
    elif kind == "extra block":
        st_["blocks"].append(st_["blocks"][i])
        message = r"model\.blocks expects a list of \d entries, got list"
    elif kind == "missing block":
        del st_["blocks"][i]
        message = r"model\.blocks expects a list of \d entries"
    elif kind == "array at a number":
        st_["blocks"][i]["eps"] = np.ones(1)
        message = r"model\.blocks\[\d\]\.eps is a float in the model, not an array, but the state has a ndarray"
    else:
        st_["blocks"][i] = list(st_["blocks"][i].values())
        message = r"model\.blocks\[\d\] expects a dict of fields, got list"
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        loadstate(model, st_)
    assert snapshot(model) == before


def test_conversions_that_keep_every_value_are_allowed():
    model = {"w": np.zeros(3, np.float32), "i": np.zeros(2, np.int16), "c": np.zeros(1, np.complex64)}
    loadstate(model, {"w": np.array([1.5, 2**24, -3.0]), "i": np.array([-5, 300], np.int64),
                      "c": np.array([1.0])})
    np.testing.assert_array_equal(model["w"], [1.5, 2**24, -3.0])
    np.testing.assert_array_equal(model["i"], [-5, 300])
    loadstate(model, {"w": np.array([np.nan, np.inf, 1e-60]), "i": np.array([1, 2], np.uint8), "c": np.ones(1)})
    assert np.isnan(model["w"][0]) and np.isinf(model["w"][1]) and model["w"][2] == 0.0   # nan/inf as saved


def test_integer_sign_and_range():
    model = {"u": np.zeros(1, np.uint8), "i": np.zeros(1, np.int64)}
    with pytest.raises(ValueError, match=r"model\.u is uint8, but the state holds int64 values such as -1"):
        loadstate(model, {"u": np.array([-1]), "i": np.array([1])})
    with pytest.raises(ValueError, match=r"model\.i is int64, but the state holds uint64 values such as "
                                         r"18446744073709551615"):
        loadstate(model, {"u": np.array([1]), "i": np.array([2**64 - 1], np.uint64)})
    assert model["u"][0] == 0 and model["i"][0] == 0


def test_tied_arrays_must_agree():
    w = np.zeros(2)
    model = {"enc": w, "dec": w}
    loadstate(model, {"enc": np.ones(2), "dec": np.ones(2)})
    np.testing.assert_array_equal(w, 1.0)
    with pytest.raises(ValueError, match=r"model\.enc and model\.dec are one array in the model \(tied weights\), but "
                                         r"the state has different values"):
        loadstate(model, {"enc": np.full(2, 2.0), "dec": np.full(2, 3.0)})
    np.testing.assert_array_equal(w, 1.0)


def test_a_read_only_array_is_refused_before_anything_is_copied():
    ro = np.zeros(2)
    ro.flags.writeable = False
    model = {"a": np.zeros(2), "b": ro}
    with pytest.raises(ValueError, match=r"model\.b is a read-only array"):
        loadstate(model, {"a": np.ones(2), "b": np.ones(2)})
    np.testing.assert_array_equal(model["a"], 0.0)


def test_layers_round_trip_and_a_float64_state_into_a_float32_model():
    model = Chain(Dense(3, 4), BatchNorm(4))
    source = fluxpy.f64(Chain(Dense(3, 4, rng=5), BatchNorm(4)))
    loadstate(model, state(source))
    np.testing.assert_allclose(model[0].weight, source[0].weight.astype(np.float32))
    assert model[0].weight.dtype == np.float32
    source[1].running_var[0] = 1e200
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"model\.layers\[1\]\.running_var is float32, but the state holds float64 "
                                         r"values such as 1e\+200 that overflow it to infinity; nothing was loaded"):
        loadstate(model, state(source))
    assert snapshot(model) == before
