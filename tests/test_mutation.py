"""The mutation check (fluxpy.mutation): an array changed in place between the forward pass that read it and the
backward pass raises ``ChangedInPlaceError`` naming what read it; an array left alone (or changed and put back)
gives the gradient the check-off run gives; layers that write their own state in place (BatchNorm's running
statistics, SpectralNorm's vectors) do not trip it, also when called twice in one gradient."""
import copy

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import gradient, options, pullback, withgradient
from fluxpy.layers import BatchNorm, Chain, Dense, Embedding, SpectralNorm
from fluxpy.mutation import ChangedInPlaceError
from fluxpy.ops import shape as S


def _loss_reading(x, change):
    def f(w):
        y = (w * x).sum()
        change()
        return y
    return f


def test_a_constant_changed_inside_f_after_an_op_read_it_raises_naming_the_op():
    x = np.array([1.0, 2.0, 3.0])

    def change():
        x[1] = 7.0
    with pytest.raises(ChangedInPlaceError, match=r"^gradient: an array `multiply` read, of shape \(3,\) and "
                                                    r"dtype float64, was changed in place"):
        gradient(_loss_reading(x, change), np.ones(3))


def test_a_weight_changed_inside_the_loss_raises_naming_the_argument():
    model = Dense(3, 2, rng=0)
    x = np.ones((4, 3), np.float32)

    def loss(m):
        y = m(x).sum()
        model.weight[0, 0] += 1.0   # the array m's weight boxes: the input's gradient needs its old values
        return y
    with pytest.raises(ChangedInPlaceError, match="an array among the function's arguments, of shape"):
        gradient(loss, model)


def test_pullback_refuses_a_back_call_after_its_input_changed_and_accepts_it_once_put_back():
    x = np.array([0.5, -1.0, 2.0])
    y, back = pullback(lambda w: w * x, np.ones(3))
    expected = back(np.ones(3))
    x[2] = 4.0
    with pytest.raises(ChangedInPlaceError, match="^pullback's back: an array `multiply` read, of shape"):
        back(np.ones(3))
    x[2] = 2.0
    np.testing.assert_array_equal(back(np.ones(3))[0], expected[0])


@pytest.mark.parametrize("how", ["element", "augmented", "shuffle", "through the base", "through a view"])
def test_every_way_of_changing_the_bytes_is_caught(how):
    base = np.arange(12.0).reshape(3, 4) + 1.0
    x = base[1:]            # the op reads a view

    def change():
        if how == "element":
            x[0, 0] = -1.0
        elif how == "augmented":
            x[...] *= 2.0
        elif how == "shuffle":   # a permutation keeps every value and the sum
            x[0] = x[0, ::-1].copy()
        elif how == "through the base":
            base[2, 3] = 0.0
        else:
            base.reshape(-1)[5] = 0.0
    with pytest.raises(ChangedInPlaceError):
        gradient(_loss_reading(x, change), np.ones((2, 4)))


def test_an_index_array_changed_before_the_backward_pass_is_caught():
    idx = np.array([0, 2, 2])

    def f(w):
        y = (S.getitem(w, idx) ** 2).sum()
        idx[0] = 1
        return y
    with pytest.raises(ChangedInPlaceError, match="`getitem` read"):
        gradient(f, np.arange(3.0))


def test_embedding_indices_changed_inside_the_loss_are_caught():
    emb = Embedding(5, 3, rng=0)
    tokens = np.array([[1, 4, 4]])

    def loss(m):
        y = m(tokens).sum()
        tokens[0, 0] = 3
        return y
    with pytest.raises(ChangedInPlaceError):
        gradient(loss, emb)


def test_with_the_check_off_the_changed_array_gives_the_gradient_of_its_new_values():
    x = np.array([1.0, 2.0])

    def change():
        x[0] = 10.0
    with options(mutation_checks=False):
        (g,) = gradient(_loss_reading(x, change), np.ones(2))
    np.testing.assert_array_equal(g, [10.0, 2.0])   # the hole the check closes


def test_a_changed_array_freed_before_the_backward_pass_is_no_error():
    def f(w):
        tmp = np.array([3.0, 4.0])
        y = (w * tmp).sum()
        del tmp                  # the pullback still holds it: the gradient is the original values'
        return y
    np.testing.assert_array_equal(gradient(f, np.ones(2))[0], [3.0, 4.0])


def test_second_derivatives_and_nested_gradients_see_no_change():
    x = np.array([0.3, -0.7, 1.1])
    h = fluxpy.hessian(lambda w: (w * w * x).sum(), np.ones(3))
    np.testing.assert_allclose(h, np.diag(2 * x))


def test_batchnorm_called_twice_in_one_gradient_and_spectral_norm_twice_raise_nothing_and_match_copies():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 4)).astype(np.float64)
    for model in (Chain(Dense(4, 4, rng=1), BatchNorm(4)), SpectralNorm(Dense(4, 4, rng=2), rng=3)):
        model = fluxpy.f64(model)
        twice = copy.deepcopy(model)
        value, (g,) = withgradient(lambda m: (m(m(x)) ** 2).sum(), twice)
        with options(mutation_checks=False):
            value_off, (g_off,) = withgradient(lambda m: (m(m(x)) ** 2).sum(), copy.deepcopy(model))
        assert float(value) == float(value_off)
        for a, b in zip(fluxpy.trainables(g), fluxpy.trainables(g_off)):
            np.testing.assert_array_equal(a, b)


def test_spectral_norm_called_twice_in_one_gradient_differentiates_each_call_with_its_own_vectors():
    x = np.random.default_rng(4).standard_normal((3, 4))
    sn = fluxpy.f64(SpectralNorm(Dense(4, 4, rng=5), rng=6))
    first, second = copy.deepcopy(sn), copy.deepcopy(sn)
    (g,) = gradient(lambda m: (m(m(x)) ** 2).sum(), sn)   # training: a power iteration at each call
    first._power_iterations(first.layer.weight, 1)        # the same by hand, each call's vectors held fixed
    second.u, second.v = first.u.copy(), first.v.copy()
    second._power_iterations(second.layer.weight, 1)
    first.active = second.active = False

    def by_hand(w):
        first.layer.weight = second.layer.weight = w
        return (second(first(x)) ** 2).sum()
    (expected,) = gradient(by_hand, first.layer.weight.copy())
    np.testing.assert_allclose(g["layer"]["weight"], expected, rtol=1e-12, atol=1e-14)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       dtype=st.sampled_from([np.float64, np.float32, np.float16, ml_dtypes.bfloat16]),
       change=st.booleans(), data=st.data())
def test_any_changed_entry_raises_and_an_untouched_array_changes_nothing(shape, dtype, change, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    x = (rng.standard_normal(shape) * 4).astype(dtype)
    at = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    w = rng.standard_normal(shape)

    def f(w):
        y = (w * x).sum()
        if change:
            x[at] = x[at] + 1
        return y
    if change:
        with pytest.raises(ChangedInPlaceError, match=rf"of shape \({', '.join(map(str, shape))},?\) and dtype"):
            gradient(f, w)
    else:
        with options(mutation_checks=False):
            expected = gradient(f, w)
        np.testing.assert_array_equal(gradient(f, w)[0], expected[0])


def test_the_option_takes_auto_true_or_false_only():
    with pytest.raises(ValueError, match="mutation_checks expects"):
        options.set(mutation_checks="sometimes")
    assert options.mutation_checks == "auto"
