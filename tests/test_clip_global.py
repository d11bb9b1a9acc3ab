"""clip_grad_norm: the clipped gradient tree and the total norm against PyTorch's ``clip_grad_norm_`` formula in
float64 (hypothesis draws the tree, the shapes, ``p`` and ``max_norm``), NaN and infinity as PyTorch, no host read,
and the errors."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.capturing import CaptureUnsupported, recording
from fluxpy.optimise import clip_grad_norm


def _torch_clip(arrays, max_norm, p):
    """PyTorch's clip_grad_norm_ transcribed: the norm of the per-array norms, then one clamped coefficient."""
    norms = [np.max(np.abs(g)) if p == math.inf and g.size else np.linalg.norm(g.ravel(), p) if g.size else 0.0
             for g in arrays]
    total = max(norms) if p == math.inf else np.linalg.norm(np.array(norms), p)
    coef = min(max_norm / (total + 1e-6), 1.0)
    return [g * coef for g in arrays], total


shapes = st.lists(st.tuples(st.integers(0, 4), st.integers(1, 3)), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from([1, 2, 3, 0.5, math.inf]), st.floats(0.0, 10.0), st.integers(0, 2 ** 16))
def test_matches_pytorchs_formula_in_float64(shape_list, p, max_norm, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s) * rng.uniform(0.1, 5) for s in shape_list]
    grad = {"layers": [{"weight": a, "bias": None} for a in arrays[:-1]], "last": (arrays[-1], None)}
    clipped, total = clip_grad_norm(grad, max_norm, p)
    want, want_total = _torch_clip(arrays, max_norm, p)
    np.testing.assert_allclose(total, want_total, rtol=1e-12)
    got = [layer["weight"] for layer in clipped["layers"]] + [clipped["last"][0]]
    for g, w in zip(got, want):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-300)
    assert all(layer["bias"] is None for layer in clipped["layers"]) and clipped["last"][1] is None
    assert isinstance(clipped["last"], tuple)
    if max_norm > 0 and want_total > max_norm:
        new_total = clip_grad_norm(clipped, max_norm, p)[1]
        assert float(new_total) <= max_norm * (1 + 1e-9)


def test_leaves_a_small_gradient_unchanged_and_the_input_unmodified():
    rng = np.random.default_rng(0)
    g = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    copies = [a.copy() for a in g]
    clipped, total = clip_grad_norm(g, 1e6)
    for a, c, b in zip(g, copies, clipped):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_allclose(b, a, rtol=1e-12)
    clipped, _ = clip_grad_norm(g, 0.5)
    np.testing.assert_array_equal(g[0], copies[0])


def test_half_and_float32_gradients_keep_their_dtypes_and_sum_in_float32():
    rng = np.random.default_rng(1)
    big = (rng.standard_normal(1000) * 300).astype(np.float16)   # its squares overflow float16
    small = rng.standard_normal(5).astype(np.float32)
    clipped, total = clip_grad_norm({"a": big, "b": small}, 1.0)
    assert clipped["a"].dtype == np.float16 and clipped["b"].dtype == np.float32 and total.dtype == np.float32
    want = math.sqrt(float(np.sum(big.astype(np.float64) ** 2) + np.sum(small.astype(np.float64) ** 2)))
    np.testing.assert_allclose(float(total), want, rtol=1e-5)
    np.testing.assert_allclose(clipped["b"], small / (want + 1e-6), rtol=1e-5)


def test_nan_and_infinity_as_pytorch():
    clipped, total = clip_grad_norm({"a": np.array([1.0, np.nan]), "b": np.array([2.0])}, 1.0)
    assert np.isnan(total) and np.isnan(clipped["a"]).all() and np.isnan(clipped["b"]).all()
    with np.errstate(invalid="ignore"):   # inf * 0, as PyTorch's
        clipped, total = clip_grad_norm({"a": np.array([1.0, np.inf]), "b": np.array([2.0])}, 1.0)
    assert total == np.inf
    np.testing.assert_array_equal(clipped["b"], [0.0])
    assert clipped["a"][0] == 0.0 and np.isnan(clipped["a"][1])
    with pytest.raises(FloatingPointError, match="clip_grad_norm: the total 2-norm of the gradient is inf"):
        clip_grad_norm({"a": np.array([np.inf])}, 1.0, error_if_nonfinite=True)
    _, total = clip_grad_norm({"a": np.array([3.0, 4.0])}, 1.0, error_if_nonfinite=True)
    assert float(total) == 5.0


class _DeviceLike(np.ndarray):
    """An array whose value cannot be read on the host, as a device array inside a capture."""

    def __bool__(self):
        raise AssertionError("a host read")

    def __float__(self):
        raise AssertionError("a host read")

    def item(self, *args):
        raise AssertionError("a host read")


def test_reads_nothing_on_the_host_and_refuses_the_host_check_inside_a_capture():
    rng = np.random.default_rng(2)
    grad = {"w": rng.standard_normal((4, 3)).view(_DeviceLike), "b": rng.standard_normal(3).view(_DeviceLike)}
    with recording():
        clipped, total = clip_grad_norm(grad, 0.1)
        with pytest.raises(CaptureUnsupported, match="clip_grad_norm: error_if_nonfinite"):
            clip_grad_norm(grad, 0.1, error_if_nonfinite=True)
    assert isinstance(clipped["w"], _DeviceLike) and np.ndim(total) == 0
    np.testing.assert_allclose(np.sqrt(sum(np.sum(np.asarray(a) ** 2) for a in clipped.values())), 0.1, rtol=1e-5)


def test_a_model_trains_with_the_clipped_gradient():
    model = fluxpy.Chain(fluxpy.Dense(3, 4, fluxpy.tanh, rng=0), fluxpy.Dense(4, 1, rng=1))
    x = np.random.default_rng(3).standard_normal((8, 3)).astype(np.float32)
    state = fluxpy.setup(fluxpy.Descent(0.1), model)
    before = model.layers[0].weight.copy()
    grad, = fluxpy.gradient(lambda m: ((m(x) - 100.0) ** 2).mean(), model)
    clipped, total = clip_grad_norm(grad, 1.0)
    assert float(total) > 1.0
    fluxpy.update(state, model, clipped)
    moved = [np.asarray(before - model.layers[0].weight)]
    assert np.linalg.norm(moved[0]) <= 0.1 + 1e-6 and np.abs(moved[0]).max() > 0


def test_an_empty_tree_and_empty_arrays():
    clipped, total = clip_grad_norm({"a": None}, 1.0)
    assert clipped == {"a": None} and float(total) == 0.0
    clipped, total = clip_grad_norm([np.zeros((0, 3)), np.array([3.0, 4.0])], 1.0, p=math.inf)
    assert float(total) == 4.0 and clipped[0].shape == (0, 3)


@pytest.mark.parametrize("kw, match", [({"max_norm": -1.0}, "max_norm must be a number >= 0"),
                                       ({"max_norm": float("nan")}, "max_norm must be a number >= 0"),
                                       ({"max_norm": 1.0, "p": 0}, "p must be a number > 0"),
                                       ({"max_norm": 1.0, "p": True}, "p must be a number > 0")])
def test_bad_options_are_named(kw, match):
    with pytest.raises(ValueError, match=f"clip_grad_norm: {match}"):
        clip_grad_norm({"a": np.ones(2)}, **kw)


def test_bad_trees_are_named():
    with pytest.raises(TypeError, match="clip_grad_norm expects a gradient tree"):
        clip_grad_norm({"a": "text"}, 1.0)
    with pytest.raises(TypeError, match="clip_grad_norm expects floating-point gradients, got an array of dtype int64"):
        clip_grad_norm({"a": np.ones(2, np.int64)}, 1.0)
