"""A detached loss is an error, never a silent no-op: float(), .item(), bool(), ... of a Tracked value raise,
gradient/withgradient/pullback of a function that ignores its arguments warn, and train refuses such a step."""
import math
import operator
import warnings

import numpy as np
import pytest

import fluxpy
from fluxpy import gradient, no_grad, pullback, stop_gradient, value_of, withgradient
from fluxpy.autodiff import DetachedGradientWarning
from fluxpy.layers import Dense
from fluxpy.losses import mse
from fluxpy.optimise import Descent, setup
from fluxpy.train import train

CONVERSIONS = {
    "float()": float,
    "int()": int,
    "complex()": complex,
    "bool()": bool,
    "__index__": operator.index,
    "round()": round,
    ".item()": lambda x: x.item(),
    ".tolist()": lambda x: x.tolist(),
    "math.isfinite": math.isfinite,
    "np.asarray": np.asarray,
    "if": lambda x: 1 if x else 0,
    "range": lambda x: range(x),
}


@pytest.mark.parametrize("name", sorted(CONVERSIONS))
@pytest.mark.parametrize("shape", [(), (1,), (3,)])
def test_turning_a_tracked_value_into_a_plain_one_is_an_error(name, shape):
    convert = CONVERSIONS[name]

    def f(x):
        return convert((x ** 2).sum() if shape == () else x ** 2)
    with pytest.raises(TypeError, match="gradient would be lost silently") as err:
        gradient(f, np.ones(shape))
    assert "fluxpy.value_of" in str(err.value)


def test_the_messages_name_the_conversion():
    for name, convert, expected in [("float", float, "float()"), ("item", lambda x: x.item(), ".item()"),
                                    ("bool", bool, "bool()"), ("asarray", np.asarray, "np.asarray()")]:
        with pytest.raises(TypeError) as err:
            gradient(lambda x: convert(x.sum()), np.ones(2))  # noqa: B023
        assert str(err.value).startswith(expected), name
    with pytest.raises(TypeError, match=r"compare instead \(x > 0 gives a plain boolean array"):
        gradient(lambda x: x.sum() if x.sum() else x.sum(), np.ones(2))


def test_the_silent_examples_from_the_issue():
    # were (None,) and a training run that changed nothing
    with pytest.raises(TypeError, match="float()"):
        fluxpy.gradient(lambda x: float((x ** 2).sum()), np.ones(3))
    with pytest.raises(TypeError, match=r"\.item\(\)"):
        fluxpy.gradient(lambda x: (x ** 2).sum().item(), np.ones(3))
    model = Dense(2, 1, rng=0)
    before = model.weight.copy()
    x = np.ones((4, 2), np.float32)
    with pytest.raises(TypeError, match="float()"):
        train(lambda m, x: float(mse(m(x), x[:, :1])), model, [(x,)] * 20, setup(Descent(0.1), model),
              progress=False)
    assert np.array_equal(model.weight, before)


def test_comparisons_and_reading_values_on_purpose_still_work():
    def f(x):
        if (x > 0).any():            # comparisons give plain boolean arrays
            y = x * 2
        else:
            y = x
        scale = float(value_of(x).sum())    # reading the value on purpose
        text = f"{x.sum():.3f}"              # formatting prints the value
        assert text == "3.000" and len(x) == 3 and x.shape == (3,)
        return (y * scale).sum() + (x * stop_gradient(x)).sum()
    g, = gradient(f, np.ones(3))
    np.testing.assert_allclose(g, np.full(3, 2 * 3.0 + 1.0))


def test_conversions_of_plain_results_are_fine():
    val, (g,) = withgradient(lambda x: (x * x).sum(), np.array([1.0, 2.0]))
    assert float(val) == 5.0 and val.item() == 5.0 and bool(val)
    assert float(fluxpy.ops.sum(np.ones(3))) == 3.0


def test_gradient_of_a_detached_result_warns_and_gives_none():
    x = np.ones(3)
    cases = {
        "a global": lambda w: (x ** 2).sum(),
        "value_of": lambda w: (value_of(w) ** 2).sum(),
        "stop_gradient": lambda w: (stop_gradient(w) ** 2).sum(),
        "a constant": lambda w: 3.0,
    }
    for name, f in cases.items():
        with pytest.warns(DetachedGradientWarning, match=r"^gradient: the result of the function .* does not depend "
                                                         r"on its arguments, so every gradient is None"):
            assert gradient(f, x) == (None,), name
        with pytest.warns(DetachedGradientWarning, match="^withgradient: "):
            val, grads = withgradient(f, x)
        assert grads == (None,) and float(val) == pytest.approx(float(f(x)))


def test_no_grad_result_warns():
    def f(w):
        with no_grad():
            return (w * 2).sum()
    with pytest.warns(DetachedGradientWarning):
        assert gradient(f, np.ones(2)) == (None,)


def test_nothing_to_differentiate_says_so():
    with pytest.warns(DetachedGradientWarning, match="no argument holds a float array"):
        assert gradient(lambda i: np.float64(i.sum()), np.arange(3)) == (None,)


def test_pullback_of_a_detached_result_warns():
    with pytest.warns(DetachedGradientWarning, match="^pullback: "):
        y, back = pullback(lambda w: np.ones(2), np.ones(2))
    assert back(np.ones(2)) == (None,)


def test_no_warning_when_the_result_depends_on_an_argument():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = gradient(lambda a, b: (a * 2).sum(), np.ones(2), np.ones(3))   # b unused: fine, a is used
        assert g[1] is None
        pullback(lambda w: w * 2, np.ones(2))
        withgradient(lambda m: (m["w"] ** 2).sum(), {"w": np.ones(2), "unused": np.ones(2)})


def test_warning_points_at_the_caller():
    with pytest.warns(DetachedGradientWarning) as record:
        gradient(lambda w: 1.0, np.ones(1))
    assert record[0].filename == __file__


def test_nested_gradient_that_does_not_depend_on_the_outer_argument_warns():
    def outer(x):
        g, = gradient(lambda y: (y * y).sum(), np.ones(2))   # no x inside
        return (g * 1.0).sum()
    with pytest.warns(DetachedGradientWarning):
        assert gradient(outer, np.ones(2)) == (None,)


def test_the_warning_can_be_made_an_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DetachedGradientWarning)
        with pytest.raises(DetachedGradientWarning):
            gradient(lambda w: 0.0, np.ones(1))


# ---------------------------------------------------------------------------------------------
# train refuses a step whose gradient is entirely None


def test_train_refuses_a_loss_that_uses_a_global_model_naming_the_batch():
    model = Dense(2, 1, rng=0)
    other = Dense(2, 1, rng=1)
    before = (model.weight.copy(), model.bias.copy())
    x = np.ones((4, 2), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the error says it all: no DetachedGradientWarning on top
        with pytest.raises(ValueError, match=r"train: the loss at epoch 1, batch 1 gives no gradient to any "
                                             r"trainable array of the model, so the step would change nothing"):
            train(lambda m, x: mse(other(x), x[:, :1]), model, [(x,)] * 3, setup(Descent(0.1), model),
                  progress=False)
    assert np.array_equal(model.weight, before[0]) and np.array_equal(model.bias, before[1])


def test_train_refuses_a_detached_later_batch():
    model = {"w": np.array([1.0])}
    batches = [(np.array([1.0]), True), (np.array([1.0]), True), (np.array([1.0]), False)]

    def loss(m, x, attached):
        return (m["w"] * x).sum() if attached else (value_of(m["w"]) * x).sum()
    with pytest.raises(ValueError, match=r"loss at epoch 1, batch 3 gives no gradient") as err:
        train(loss, model, batches, setup(Descent(0.1), model), progress=False)
    assert "value_of, stop_gradient or no_grad" in str(err.value)
    np.testing.assert_allclose(model["w"], [0.8])


def test_train_refuses_a_loss_that_reaches_only_non_trainable_arrays():
    @fluxpy.layer(trainable=("w",))
    class Stats:
        def __init__(self):
            self.w = np.ones(2)
            self.running = np.ones(2)
    model = Stats()
    with pytest.raises(ValueError, match="its gradient reaches no trainable array"):
        train(lambda m, x: (m.running * x).sum(), model, [(np.ones(2),)], setup(Descent(0.1), model), progress=False)
