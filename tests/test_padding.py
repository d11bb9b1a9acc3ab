"""fluxpy.ops.padding (NNlib's pad_* functions) against numpy.pad in float64, their gradients against finite
differences (hypothesis over shapes, axes and pads), and Conv's padding_mode against the PyTorch formula written
out: NumPy's pad in the mode (reflect / edge / wrap), then a convolution without padding."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.ops import padding
from gradcheck import check_grad, check_second_order

MODES = {"pad_reflect": "reflect", "pad_repeat": "edge", "pad_circular": "wrap", "pad_symmetric": "symmetric",
         "pad_zeros": "constant"}
LIMIT = {"pad_reflect": lambda n: n - 1, "pad_repeat": lambda n: 4, "pad_circular": lambda n: n,
         "pad_symmetric": lambda n: n, "pad_zeros": lambda n: 4}


@pytest.mark.parametrize("name", sorted(MODES))
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_padding_matches_numpy(name, shape, data, seed):
    nd = len(shape)
    dims = data.draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True))
    widths = [tuple(data.draw(st.integers(0, LIMIT[name](shape[a]))) for _ in range(2)) for a in dims]
    pad = tuple(v for w in widths for v in w)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    full = [(0, 0)] * nd
    for a, w in zip(dims, widths):
        full[a] = w
    fn = getattr(padding, name)
    np.testing.assert_array_equal(fn(x, pad, dims=tuple(dims)), np.pad(x, full, mode=MODES[name]))
    check_grad(lambda x: fn(x, pad, dims=tuple(dims)), x, rng=rng)


def test_defaults_and_symmetric_pads():
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5))
    spatial = ((0, 0), (0, 0), (2, 2), (2, 2))
    np.testing.assert_array_equal(padding.pad_reflect(x, 2), np.pad(x, spatial, mode="reflect"))
    np.testing.assert_array_equal(padding.pad_repeat(x, (1, 2)), np.pad(x, ((0, 0),) * 3 + ((1, 2),), mode="edge"))
    np.testing.assert_array_equal(padding.pad_circular(x, (1, 3), dims=(2, 3)),
                                  np.pad(x, ((0, 0), (0, 0), (1, 1), (3, 3)), mode="wrap"))
    np.testing.assert_array_equal(padding.pad_zeros(x, 1), np.pad(x, 1))
    np.testing.assert_array_equal(padding.pad_constant(x, 1, 2.5, dims=-1),
                                  np.pad(x, ((0, 0),) * 3 + ((1, 1),), constant_values=2.5))
    check_second_order(lambda x: padding.pad_reflect(x, (1, 2, 2, 1)) ** 2, x, rng=np.random.default_rng(1))


def test_padding_errors_name_the_function():
    x = np.ones((1, 1, 3))
    with pytest.raises(ValueError, match=r"pad_reflect expects a pad of at most 2 along axis 2 of size 3"):
        padding.pad_reflect(x, 3)
    with pytest.raises(ValueError, match="pad_circular expects pad, a non-negative int"):
        padding.pad_circular(x, -1)
    with pytest.raises(ValueError, match="pad_repeat expects dims, distinct axes"):
        padding.pad_repeat(x, 1, dims=3)
    with pytest.raises(ValueError, match="pad_symmetric expects pad, an int, 1 ints or 1 \\(before, after\\) pairs"):
        padding.pad_symmetric(x, (1, 2, 3), dims=2)
    with pytest.raises(ValueError, match="pad_reflect expects dims: x of shape \\(3, 3\\) has no spatial axis"):
        padding.pad_reflect(np.ones((3, 3)), 1)


def _torch_conv(x, w, b, stride, pad, mode, flipped):
    """PyTorch's Conv with padding_mode: F.pad(x, mode) then conv with padding 0, written out in NumPy."""
    nsp = x.ndim - 2
    xp = np.pad(x, ((0, 0), (0, 0)) + tuple((p, p) for p in pad), mode={"reflect": "reflect", "replicate": "edge",
                                                                          "circular": "wrap"}[mode])
    if not flipped:
        w = w[(slice(None), slice(None)) + (slice(None, None, -1),) * nsp]
    k = w.shape[2:]
    out = [(xp.shape[2 + i] - k[i]) // stride + 1 for i in range(nsp)]
    y = np.zeros((x.shape[0], w.shape[0], *out))
    for idx in np.ndindex(*out):
        window = xp[(slice(None), slice(None)) + tuple(slice(i * stride, i * stride + kk) for i, kk in zip(idx, k))]
        y[(slice(None), slice(None)) + idx] = np.tensordot(window, w, axes=(range(1, 2 + nsp), range(1, 2 + nsp)))
    return y + b.reshape((1, -1) + (1,) * nsp)


@pytest.mark.parametrize("layer", [fluxpy.Conv, fluxpy.CrossCor])
@given(nsp=st.integers(1, 3), mode=st.sampled_from(["reflect", "replicate", "circular"]), k=st.integers(1, 3),
       stride=st.integers(1, 2), seed=st.integers(0, 2**31 - 1), data=st.data())
@settings(max_examples=25, deadline=None)
def test_conv_padding_modes_match_pytorch(layer, nsp, mode, k, stride, seed, data):
    rng = np.random.default_rng(seed)
    sizes = tuple(data.draw(st.integers(3, 5)) for _ in range(nsp))
    pad = tuple(data.draw(st.integers(0, 2)) for _ in range(nsp))
    c = layer((k,) * nsp, 2, 3, pad=pad, stride=stride, padding_mode=mode, rng=seed)
    c = fluxpy.f64(c)
    c.bias = rng.standard_normal(3)
    x = rng.standard_normal((2, 2) + sizes)
    expected = _torch_conv(x, c.weight, c.bias, stride, pad, mode, layer is fluxpy.CrossCor)
    np.testing.assert_allclose(c(x), expected, rtol=1e-10, atol=1e-12)
    check_grad(lambda x, w: layer(w, False, pad=pad, stride=stride, padding_mode=mode)(x), x, c.weight, rng=rng)


def test_padding_mode_same_depthwise_repr_and_errors():
    x = np.random.default_rng(2).standard_normal((1, 2, 5, 6))
    d = fluxpy.f64(fluxpy.DepthwiseConv((3, 3), 2, 4, pad="same", padding_mode="replicate", rng=0))
    y = d(x)
    assert y.shape == (1, 4, 5, 6)
    plain = fluxpy.f64(fluxpy.DepthwiseConv(d.weight.reshape(2, 2, 3, 3), d.bias, pad=0))
    np.testing.assert_allclose(y, plain(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="edge")), rtol=1e-12)
    assert repr(d) == 'DepthwiseConv((3, 3), 2 => 4, pad="same", padding_mode="replicate")'
    with pytest.raises(ValueError, match='Conv: padding_mode must be "zeros", "reflect", "replicate" or "circular"'):
        fluxpy.Conv((3, 3), 1, 1, padding_mode="mirror")
    c = fluxpy.Conv((3,), 1, 1, pad=3, padding_mode="reflect")
    with pytest.raises(fluxpy.DimensionMismatch, match=r"Conv\(\(3,\), 1 => 1, pad=3, padding_mode=\"reflect\"\) "
                                                      r"expects a pad of at most 2 along axis 2 of size 3"):
        c(np.ones((1, 1, 3), np.float32))
