"""update is all or nothing: the whole gradient tree is checked against the state and the model before any array or
state changes, so a bad gradient (wherever hypothesis puts it) leaves both byte-identical. Also the mistakes in its
arguments: a rule instead of the state, a state from another model, tied weights that disagree."""
import copy

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy.backend import is_array
from fluxpy.layers import Chain, Dense
from fluxpy.optimise import (Adam, AdamW, ClipGrad, ClipNorm, Descent, Leaf, Momentum, Nesterov, OptimiserChain,
                             RMSProp, WeightDecay, freeze, setup, update)
from strategies import shapes

RULES = {
    "descent": Descent(0.1),
    "momentum": Momentum(0.1, 0.9),
    "nesterov": OptimiserChain(WeightDecay(0.1), Nesterov(0.1)),
    "rmsprop": RMSProp(0.01, centred=True),
    "adam": Adam(0.1),
    "adamw": AdamW(0.1, lambd=0.1),
    "clip": OptimiserChain(ClipGrad(1.0), ClipNorm(2.0), Adam(0.1)),
}


def snapshot(*trees):
    """Every array's dtype, shape and bytes, and every other value, of model and state trees, in order."""
    out = []

    def walk(x):
        if isinstance(x, Leaf):
            out.append(("leaf", x.frozen, repr(x.rule)))
            walk(x.state)
        elif is_array(x):
            out.append((x.dtype.str, x.shape, x.tobytes()))
        elif isinstance(x, (list, tuple)):
            out.append(type(x).__name__)
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for k in x:
                out.append(k)
                walk(x[k])
        elif hasattr(x, "__dict__") and not callable(x):
            walk(vars(x))
        else:
            out.append(repr(x))
    for t in trees:
        walk(t)
    return out


def make_model(rng, shape_list):
    return {"layers": [{"w": rng.standard_normal(s), "b": rng.standard_normal(s[:1])} for s in shape_list],
            "scale": np.array([1.5]), "steps": np.arange(3), "name": "net"}


def good_grad(rng, model):
    return {"layers": [{"w": rng.standard_normal(l["w"].shape), "b": rng.standard_normal(l["b"].shape)}
                       for l in model["layers"]], "scale": rng.standard_normal(1), "steps": None, "name": None}


def leaf_slots(grad):
    """(container, key) of every gradient array, in tree order."""
    slots = [(layer, k) for layer in grad["layers"] for k in ("w", "b")]
    return slots + [(grad, "scale")]


CORRUPTIONS = {
    "shape": lambda g: np.concatenate([g.ravel(), [0.0]]),
    "transposed": lambda g: g.reshape(g.shape + (1,)),
    "complex": lambda g: g.astype(np.complex128),
    "int": lambda g: g.astype(np.int64),
    "bool": lambda g: g > 0,
    "list": lambda g: g.tolist(),
    "python float": lambda g: 1.0,
    "nan": lambda g: np.where(np.arange(g.size).reshape(g.shape) == g.size - 1, np.nan, g),
    "inf": lambda g: np.full_like(g, -np.inf),
}


@given(data=st.data(), shape_list=st.lists(shapes(1, 2), min_size=1, max_size=3),
       rule=st.sampled_from(sorted(RULES)), warm=st.integers(0, 2), seed=st.integers(0, 2**31 - 1),
       corruption=st.sampled_from(sorted(CORRUPTIONS)))
def test_a_bad_gradient_anywhere_changes_nothing(data, shape_list, rule, warm, seed, corruption):
    rng = np.random.default_rng(seed)
    model = make_model(rng, shape_list)
    state = setup(RULES[rule], model)
    for _ in range(warm):   # moments that are not zero
        update(state, model, good_grad(rng, model))
    grad = good_grad(rng, model)
    slots = leaf_slots(grad)
    container, key = slots[data.draw(st.integers(0, len(slots) - 1), label="bad leaf")]
    container[key] = CORRUPTIONS[corruption](container[key])
    check_finite = corruption in ("nan", "inf") and rule != "clip"   # ClipNorm refuses them by itself
    before = snapshot(model, state)
    with pytest.raises((ValueError, TypeError, FloatingPointError)) as err:
        update(state, model, grad, check_finite=check_finite)
    assert snapshot(model, state) == before
    assert str(err.value).startswith("update: ")
    assert ("model.scale" if key == "scale" else f".{key}") in str(err.value)


@given(data=st.data(), shape_list=st.lists(shapes(1, 2), min_size=2, max_size=3),
       rule=st.sampled_from(sorted(set(RULES) - {"descent"})), seed=st.integers(0, 2**31 - 1))
def test_a_state_from_another_model_changes_nothing(data, shape_list, rule, seed):
    """(Descent keeps no arrays, so its state fits any model of the same structure.)"""
    rng = np.random.default_rng(seed)
    model = make_model(rng, shape_list)
    i = data.draw(st.integers(0, len(shape_list) - 1), label="differing layer")
    other_shapes = list(shape_list)
    other_shapes[i] = other_shapes[i] + (2,) if len(other_shapes[i]) < 3 else other_shapes[i][:1]
    state = setup(RULES[rule], make_model(rng, other_shapes))
    before = snapshot(model, state)
    with pytest.raises(ValueError, match=r"update: the optimiser state at model\.layers\[\d\]\.[wb] holds a numpy "
                                         r"array of shape .* but the model has .*set up for another model"):
        update(state, model, good_grad(rng, model))
    assert snapshot(model, state) == before


def test_a_gradient_for_another_model_changes_nothing():
    model, other = Chain(Dense(3, 4), Dense(4, 2)), Chain(Dense(3, 4), Dense(4, 5))
    state = setup(Adam(), model)
    x = np.ones((2, 3), np.float32)
    grad, = fluxpy.gradient(lambda m: m(x).sum(), other)
    before = snapshot(model, state)
    with pytest.raises(ValueError, match=r"update: the gradient for model\.layers\[1\]\.weight should be an array of "
                                         r"shape \(2, 4\), got an array of shape \(5, 4\)"):
        update(state, model, grad)
    assert snapshot(model, state) == before
    deeper = Chain(Dense(3, 4), Dense(4, 2), Dense(2, 2))
    grad, = fluxpy.gradient(lambda m: m(x).sum(), deeper)
    with pytest.raises(ValueError, match=r"model\.layers is a tuple of 2, so its gradient should be a tuple or list "
                                         r"of 2, got a tuple of 3"):
        update(state, model, grad)
    assert snapshot(model, state) == before


def test_a_structurally_different_state_is_refused():
    model = {"a": [np.ones(2), np.ones(2)], "b": np.ones(1)}
    grad = {"a": [np.ones(2), np.ones(2)], "b": np.ones(1)}
    for bad in [{"a": [setup(Descent(), np.ones(2))], "b": None},
                {"a": {"0": None}, "b": None},
                {"b": None},
                {"a": [None, None], "b": None, "c": None}]:
        with pytest.raises(ValueError, match="update: model.*optimiser state has .*set up for another model"):
            update(bad, model, grad)
    np.testing.assert_array_equal(model["a"][0], 1.0)


def test_a_rule_or_a_model_is_not_a_state():
    model = Dense(2, 2)
    grad, = fluxpy.gradient(lambda m: m(np.ones((1, 2), np.float32)).sum(), model)
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"update: got the rule Adam\(eta=0\.001.*\) where the optimiser state belongs; "
                                        r"make the state once with state = fluxpy\.setup\(Adam"):
        update(Adam(), model, grad)
    with pytest.raises(TypeError, match=r"update: the optimiser state should be the tree that fluxpy\.setup\(rule, "
                                        r"model\) returns .*got a Dense"):
        update(model, model, grad)
    with pytest.raises(TypeError, match=r"optimiser state at model\.weight should be .*got the rule Descent"):
        update({"weight": Descent(), "bias": None}, model, grad)
    with pytest.raises(TypeError, match=r"at model\.weight .*got an array of shape \(2, 2\)"):
        update(fluxpy.state(model), model, grad)
    assert snapshot(model) == before


def test_setup_with_its_arguments_swapped():
    with pytest.raises(TypeError, match=r"setup expects the rule first, then the model: setup\(Adam"):
        setup(Dense(2, 2), Adam())
    with pytest.raises(TypeError, match="setup expects optimisation rules such as Adam"):
        setup("adam", Dense(2, 2))


def test_a_model_moved_or_converted_after_setup_is_refused():
    model = Dense(2, 2)
    state = setup(Adam(), model)
    model64 = fluxpy.f64(model)
    grad, = fluxpy.gradient(lambda m: m(np.ones((1, 2))).sum(), model64)
    before = snapshot(model64, state)
    with pytest.raises(ValueError, match=r"optimiser state at model\.weight holds a numpy array of shape \(2, 2\) and "
                                         r"dtype float32, but the model has a numpy array of shape \(2, 2\) and dtype "
                                         r"float64 there.*moved or converted after setup"):
        update(state, model64, grad)
    assert snapshot(model64, state) == before


def test_tied_weights_checks():
    w = np.array([1.0, 2.0])
    tied = {"enc": w, "dec": w}
    # a state from an untied model: two leaves for one array would step it twice
    untied_state = setup(Descent(0.1), {"enc": w.copy(), "dec": w.copy()})
    with pytest.raises(ValueError, match=r"one array \(tied weights\) at model\.enc and model\.dec, but the optimiser "
                                         r"state has a separate leaf at each"):
        update(untied_state, tied, {"enc": np.ones(2), "dec": np.ones(2)})
    # a state from a tied model used with an untied one: one leaf, two arrays
    tied_state = setup(Descent(0.1), tied)
    untied = {"enc": w.copy(), "dec": w.copy()}
    with pytest.raises(ValueError, match=r"shares one leaf between model\.enc and model\.dec \(tied weights\), but the "
                                         r"model has different arrays there"):
        update(tied_state, untied, {"enc": np.ones(2), "dec": np.ones(2)})
    # two different gradients for one array
    with pytest.raises(ValueError, match=r"model\.enc and model\.dec are one array \(tied weights\), so they take one "
                                         r"gradient"):
        update(tied_state, tied, {"enc": np.ones(2), "dec": np.zeros(2)})
    np.testing.assert_array_equal(w, [1.0, 2.0])
    # equal gradients that are different objects (fmapstructure of a gradient tree) are fine: stepped once
    update(tied_state, tied, {"enc": np.ones(2), "dec": np.ones(2)})
    np.testing.assert_allclose(w, [0.9, 1.9])
    g = np.ones(2)
    update(tied_state, tied, {"enc": None, "dec": g})
    np.testing.assert_allclose(w, [0.8, 1.8])


def test_frozen_leaves_are_checked_too():
    model = {"a": np.ones(2), "b": np.ones(2)}
    state = setup(Descent(1.0), model)
    freeze(state["a"])
    with pytest.raises(ValueError, match=r"model\.a should be an array of shape \(2,\)"):
        update(state, model, {"a": np.ones(3), "b": np.ones(2)})
    np.testing.assert_array_equal(model["b"], 1.0)


def test_check_finite_names_the_array_and_changes_nothing():
    model = {"a": np.ones(2), "b": np.ones(3)}
    state = setup(Momentum(0.1), model)
    bad = {"a": np.ones(2), "b": np.array([1.0, np.nan, np.inf])}
    before = snapshot(model, state)
    with pytest.raises(FloatingPointError, match=r"update: the gradient for model\.b has 1 NaN and 1 infinite entries "
                                                 r"\(of 3, shape \(3,\), dtype float64\); nothing was updated"):
        update(state, model, bad, check_finite=True)
    assert snapshot(model, state) == before
    update(state, model, bad)   # off by default: NumPy's arithmetic as it is
    assert np.isnan(model["b"][1])


def test_clipnorm_refuses_before_any_change():
    model = [np.ones(2), np.ones(2)]
    state = setup(OptimiserChain(ClipNorm(1.0), Descent(1.0)), model)
    before = snapshot(model, state)
    with pytest.raises(ValueError, match=r"update: ClipNorm: the gradient has 2-norm nan, for an array of shape \(2,\) "
                                         r"and dtype float64, at model\[1\]; nothing was updated"):
        update(state, model, [np.ones(2), np.array([np.nan, 0.0])])
    assert snapshot(model, state) == before
    quiet = setup(OptimiserChain(ClipNorm(1.0, throw=False), Descent(1.0)), model)
    update(quiet, model, [np.ones(2), np.array([np.nan, 0.0])])  # throw=False: as before, no error


def test_a_zero_dim_parameter_takes_a_numpy_scalar_gradient():
    model = {"t": np.array(1.0)}
    state = setup(Descent(0.5), model)
    update(state, model, {"t": np.float64(2.0)})
    assert float(model["t"]) == 0.0


def test_the_state_check_is_cached_but_sees_a_new_array():
    model = {"w": np.ones(3, np.float32)}
    state = setup(Adam(), model)
    update(state, model, {"w": np.ones(3, np.float32)})
    assert state["w"]._fits is not None
    model["w"] = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r"optimiser state at model\.w holds a numpy array of shape \(3,\)"):
        update(state, model, {"w": np.ones(4, np.float32)})


def test_update_deepcopied_state_and_model_still_work():
    model = Chain(Dense(2, 2), Dense(2, 1))
    state = setup(Adam(0.1), model)
    m2, s2 = copy.deepcopy((model, state))
    grad, = fluxpy.gradient(lambda m: m(np.ones((1, 2), np.float32)).sum(), m2)
    update(s2, m2, grad)
    assert not np.array_equal(m2[0].weight, model[0].weight)


def test_whole_return_values_in_place_of_the_state_or_the_gradient():
    model = Dense(2, 2)
    state = setup(Adam(), model)
    x = np.ones((1, 2), np.float32)
    pair = update(state, model, fluxpy.gradient(lambda m: m(x).sum(), model)[0])   # (state, model)
    before = snapshot(model, state)
    with pytest.raises(ValueError, match=r"looks like the \(state, model\) pair that update returns"):
        update(pair, model, fluxpy.gradient(lambda m: m(x).sum(), model)[0])
    with pytest.raises(ValueError, match=r"pass gradient\(f, model\)\[0\], not the whole tuple"):
        update(state, model, fluxpy.gradient(lambda m: m(x).sum(), model))
    with pytest.raises(ValueError, match=r"looks like withgradient's \(value, gradients\): pass gradients\[0\]"):
        update(state, model, fluxpy.withgradient(lambda m: m(x).sum(), model))
    assert snapshot(model, state) == before
