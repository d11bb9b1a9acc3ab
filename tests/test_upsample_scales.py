"""Upsampling by non-integer scales and the 1-d linear mode against PyTorch's F.interpolate, written out in NumPy
from its kernels (UpSample.h: the output size floor(S * scale_factor), the source index mapped with 1 / scale_factor
where a scale is given, align_corners as PyTorch's), in float64; gradients against finite differences."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.ops.resample import upsample_linear, upsample_nearest
from gradcheck import check_grad


def _torch_matrix(n_in, scale, mode, align_corners):
    """The (n_out, n_in) matrix of F.interpolate along one axis, one output index at a time."""
    n_out = math.floor(n_in * scale)
    m = np.zeros((n_out, n_in))
    for j in range(n_out):
        if mode == "nearest":   # nearest_neighbor_compute_source_index: floorf(dst * (float)(1/scale))
            m[j, min(int(np.floor(np.float32(j) * np.float32(1.0 / scale))), n_in - 1)] = 1.0
            continue
        if align_corners:
            src = j * (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
        else:
            src = max((j + 0.5) / scale - 0.5, 0.0)
        i0 = int(src)
        i1 = i0 + (1 if i0 < n_in - 1 else 0)
        lam = src - i0
        m[j, i0] += 1 - lam
        m[j, i1] += lam
    return m


def _torch_interpolate(x, scales, mode, align_corners):
    y = x
    for axis, s in enumerate(scales, start=2):
        y = np.moveaxis(np.tensordot(_torch_matrix(x.shape[axis], s, mode, align_corners), np.moveaxis(y, axis, 0),
                                     axes=1), 0, axis)
    return y


SCALES = [0.5, 0.75, 1.3, 1.5, 1.7, 2, 2.5, 3]


@given(shape=st.lists(st.integers(2, 5), min_size=1, max_size=3), data=st.data(),
       mode=st.sampled_from(["nearest", "linear"]), align_corners=st.booleans(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_non_integer_scales_match_torch(shape, data, mode, align_corners, seed):
    scales = tuple(data.draw(st.sampled_from(SCALES)) for _ in shape)
    if any(math.floor(n * s) < 1 for n, s in zip(shape, scales)) or (mode == "nearest" and align_corners):
        return
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3) + tuple(shape))
    expected = _torch_interpolate(x, scales, mode, align_corners)
    if mode == "nearest":
        def op(x):
            return upsample_nearest(x, scales)
    else:
        def op(x):
            return upsample_linear(x, scales, align_corners)
    np.testing.assert_allclose(op(x), expected, rtol=1e-12, atol=1e-14)
    check_grad(op, x, rng=rng)


@pytest.mark.parametrize("align_corners", [True, False])
def test_linear_mode_layer_for_signals(align_corners):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 5))
    for scale in (2, 1.5, 2.7):
        up = fluxpy.Upsample(scale, mode="linear", align_corners=align_corners)
        np.testing.assert_allclose(up(x), _torch_interpolate(x, (scale,), "linear", align_corners), rtol=1e-12)
        check_grad(up, x, rng=rng)
    assert repr(up) == f'Upsample(2.7, mode="linear"{", align_corners=False" if not align_corners else ""})'


def test_layer_scales_and_errors():
    x = np.random.default_rng(4).standard_normal((1, 2, 4, 3))
    np.testing.assert_allclose(fluxpy.Upsample((1.5, 2.5), mode="bilinear", align_corners=False)(x),
                               _torch_interpolate(x, (1.5, 2.5), "linear", False), rtol=1e-12)
    np.testing.assert_array_equal(fluxpy.Upsample(1.5)(x), _torch_interpolate(x, (1.5, 1.5), "nearest", False))
    assert fluxpy.Upsample(2.0).scale == 2 and repr(fluxpy.Upsample(2.0)) == "Upsample(2)"
    with pytest.raises(fluxpy.DimensionMismatch, match=r"Upsample\(2, mode=\"linear\"\) expects a 3-d input \(N, C, L\)"):
        fluxpy.Upsample(2, mode="linear")(x)
    with pytest.raises(ValueError, match="Upsample: mode=\"linear\" takes a scale of one axis, got \\(2, 2\\)"):
        fluxpy.Upsample((2, 2), mode="linear")
    with pytest.raises(ValueError, match=r"upsample_linear: scale 0.2 leaves no output along an axis"):
        upsample_linear(np.ones((1, 1, 3)), 0.2)
