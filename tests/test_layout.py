"""fluxpy.layout on the CPU: what counts as channels-last, the conversions, and that a conv net gives the same
values and gradients on channels-last NumPy arrays (NumPy keeps layouts itself; the GPU side is
tests/gpu/test_channels_last_gpu.py)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.layout import (channels_last_strides, empty_channels_last, is_channels_last, keeping_layout,
                           like_layout, to_channels_last, to_contiguous, to_memory_format)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=3, max_size=5), st.sampled_from([np.float16, np.float32, np.float64]))
def test_to_channels_last_keeps_values_and_gives_nhwc_strides(shape, dtype):
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    y = to_channels_last(x)
    assert y.shape == x.shape and np.array_equal(y, x)
    assert np.moveaxis(y, 1, -1).flags.c_contiguous
    # one channel or one pixel: both layouts at once, which counts as C order
    ambiguous = shape[1] == 1 or int(np.prod(shape[2:])) == 1
    assert is_channels_last(y) == (not ambiguous)
    assert not is_channels_last(x)
    back = to_contiguous(y)
    assert back.flags.c_contiguous and np.array_equal(back, x)
    assert np.shares_memory(to_channels_last(y), y)   # no copy where it already is


def test_strides_and_empty_arrays():
    assert channels_last_strides((2, 3, 4, 5), 2) == (120, 2, 30, 6)
    e = empty_channels_last((2, 3, 4, 5), np.float32)
    assert e.shape == (2, 3, 4, 5) and is_channels_last(e)
    assert is_channels_last(like_layout(np.ones((2, 3, 4, 5)), e))
    assert like_layout(e, np.ones((2, 3, 4, 5))).flags.c_contiguous
    assert not is_channels_last(np.ones((2, 3)))          # two axes: never channels-last
    assert not is_channels_last(np.ones((2, 3, 4, 5))[:, :, ::2])   # strided, not dense
    assert not is_channels_last([1, 2, 3])


def test_to_memory_format_moves_only_four_axis_arrays_and_checks_its_argument():
    w, v = np.ones((4, 3, 3, 3)), np.ones((4, 3))
    assert is_channels_last(to_memory_format(w, "channels_last"))
    assert to_memory_format(v, "channels_last") is v
    assert to_memory_format(to_channels_last(w), "contiguous").flags.c_contiguous
    with pytest.raises(ValueError, match="memory must be one of"):
        to_memory_format(w, "NHWC")
    with pytest.raises(ValueError, match="to_channels_last expects an array of 3 or more axes"):
        to_channels_last(v)


def test_keeping_layout_passes_numpy_and_tracked_values_through():
    x = to_channels_last(np.arange(24.0).reshape(1, 2, 3, 4))
    y = keeping_layout(np.add, x, 1.0)
    assert np.array_equal(y, x + 1.0) and is_channels_last(y)   # NumPy keeps the layout itself
    g = fluxpy.gradient(lambda a: keeping_layout(np.multiply, a, a).sum(), x)[0]
    assert np.array_equal(g, 2 * x)


def test_gpu_memory_argument_is_checked_before_anything_moves():
    with pytest.raises(ValueError, match="memory must be one of"):
        fluxpy.gpu({"w": np.ones((2, 2, 2, 2))}, memory="nhwc")


@pytest.mark.parametrize("act", [fluxpy.relu, fluxpy.tanh])
def test_a_conv_net_on_channels_last_numpy_arrays_matches_c_order(act):
    rng = np.random.default_rng(1)
    model = fluxpy.Chain(fluxpy.Conv((3, 3), 3, 6, act, pad=1), fluxpy.BatchNorm(6, fluxpy.relu),
                         fluxpy.MaxPool((2, 2)), fluxpy.Conv((1, 1), 6, 4), fluxpy.GlobalMeanPool(), fluxpy.flatten)
    model = fluxpy.f64(model)
    x = rng.standard_normal((2, 3, 8, 8))
    moved = fluxpy.fmap(lambda a: to_memory_format(a, "channels_last") if isinstance(a, np.ndarray) else a,
                        fluxpy.f64(model))

    def loss(m, x):
        return (m(x) ** 2).sum()
    got = fluxpy.gradient(loss, moved, to_channels_last(x))
    want = fluxpy.gradient(loss, model, x)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[0]["layers"][0]["weight"], want[0]["layers"][0]["weight"], rtol=1e-10,
                               atol=1e-12)
    np.testing.assert_allclose(loss(moved, to_channels_last(x)), loss(model, x), rtol=1e-12)


@pytest.mark.parametrize("memory", ["channels_last", "contiguous"])
def test_as_memory_format_is_differentiable_and_gives_gradients_in_the_input_layout(memory):
    from fluxpy.ops.shape import as_memory_format
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 4, 5))
    start = to_channels_last(x) if memory == "contiguous" else x
    y = as_memory_format(start, memory)
    assert np.array_equal(y, x) and is_channels_last(y) == (memory == "channels_last")
    g = fluxpy.gradient(lambda a: (as_memory_format(a, memory) * w).sum(), start)[0]
    assert np.array_equal(g, w) and is_channels_last(g) == is_channels_last(start)
    # twice differentiable: the pullback is the same op
    hv = fluxpy.gradient(lambda a: (fluxpy.gradient(lambda b: (as_memory_format(b, memory) ** 2).sum(), a)[0]
                                    * w).sum(), start)[0]
    np.testing.assert_allclose(hv, 2 * w)
    with pytest.raises(ValueError, match="memory must be one of"):
        as_memory_format(x, "nhwc")
    with pytest.raises(ValueError, match="3 or more axes"):
        as_memory_format(np.ones((2, 3)), memory)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=3, max_size=5), st.sampled_from(["channels_last", "contiguous"]),
       st.booleans())
def test_as_memory_format_gradient_matches_finite_differences(shape, memory, start_channels_last):
    from fluxpy.ops.shape import as_memory_format
    from gradcheck import check_grad
    x = np.random.default_rng(len(shape)).standard_normal(shape)
    x = to_channels_last(x) if start_channels_last else x
    check_grad(lambda a: fluxpy.tanh(as_memory_format(a, memory)), x)


@pytest.mark.parametrize("shape", [(3, 1, 4, 5), (3, 6, 1, 1), (2, 1, 3, 4, 2)])
def test_one_channel_or_one_pixel_goes_channels_last_as_a_view(shape):
    a = np.random.default_rng(0).standard_normal(shape)
    b = to_channels_last(a)
    assert np.shares_memory(a, b) and b.shape == a.shape
    np.testing.assert_array_equal(b, a)


def test_made_channels_last_tells_the_ambiguous_arrays_by_their_strides():
    from fluxpy.layout import made_channels_last
    rng = np.random.default_rng(0)
    for shape in [(3, 1, 4, 5), (3, 6, 1, 1), (2, 1, 3, 4, 2)]:
        a = rng.standard_normal(shape)
        assert not made_channels_last(a) and made_channels_last(to_channels_last(a))
    wide = rng.standard_normal((2, 3, 4, 5))
    assert not made_channels_last(wide) and made_channels_last(to_channels_last(wide))
    assert not made_channels_last(rng.standard_normal((4, 1))) and not made_channels_last(np.ones((1, 1, 1, 1)))
