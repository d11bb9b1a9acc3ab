"""meanpool(..., count_include_pad=False) and MeanPool's option against PyTorch's avg_pool formula written out in
NumPy (each window's sum over the entries of x in it, divided by their number), in float64; gradients against finite
differences; hypothesis over spatial ranks, kernels, strides and pads (asymmetric ones too)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.ops import meanpool
from gradcheck import check_grad, check_second_order


def _torch_avg_pool_exclude_pad(x, kernel, stride, pad):
    nsp = len(kernel)
    sizes = x.shape[2:]
    out = [(n + pad[2 * i] + pad[2 * i + 1] - k) // s + 1 for i, (n, k, s) in enumerate(zip(sizes, kernel, stride))]
    y = np.zeros(x.shape[:2] + tuple(out))
    for idx in np.ndindex(*out):
        box = []
        for i in range(nsp):
            start = idx[i] * stride[i] - pad[2 * i]
            box.append(slice(max(start, 0), min(start + kernel[i], sizes[i])))
        window = x[(slice(None), slice(None)) + tuple(box)]
        count = window[0, 0].size
        y[(slice(None), slice(None)) + idx] = window.sum(axis=tuple(range(2, 2 + nsp))) / count if count else 0.0
    return y


@given(nsp=st.integers(1, 3), data=st.data(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_meanpool_without_counting_padding(nsp, data, seed):
    kernel = tuple(data.draw(st.integers(1, 3)) for _ in range(nsp))
    stride = tuple(data.draw(st.integers(1, 2)) for _ in range(nsp))
    pad = tuple(data.draw(st.integers(0, k // 2)) for k in kernel for _ in range(2))
    sizes = tuple(data.draw(st.integers(k, 5)) for k in kernel)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3) + sizes)
    f = lambda x: meanpool(x, kernel, stride, pad, count_include_pad=False)   # noqa: E731
    np.testing.assert_allclose(f(x), _torch_avg_pool_exclude_pad(x, kernel, stride, pad), rtol=1e-12, atol=1e-14)
    check_grad(f, x, rng=rng)


def test_the_layer_same_pad_second_order_and_errors():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 2, 5, 6))
    layer = fluxpy.MeanPool((3, 3), stride=2, pad="same", count_include_pad=False)
    np.testing.assert_allclose(layer(x), _torch_avg_pool_exclude_pad(x, (3, 3), (2, 2), (1, 1, 0, 1)), rtol=1e-12)
    np.testing.assert_array_equal(fluxpy.MeanPool((2, 2), count_include_pad=False)(x), fluxpy.MeanPool((2, 2))(x))
    check_second_order(lambda x: layer(x) ** 2, x, rng=rng)
    assert repr(layer) == 'MeanPool((3, 3), pad="same", stride=2, count_include_pad=False)'
    assert repr(fluxpy.MeanPool((2, 2))) == "MeanPool((2, 2))"
    assert fluxpy.MeanPool((2, 2), pad=1, count_include_pad=False)(x.astype(np.float32)).dtype == np.float32
    with pytest.raises(ValueError, match="MeanPool: count_include_pad must be True or False, got 0"):
        fluxpy.MeanPool((2, 2), count_include_pad=0)
    with pytest.raises(ValueError, match="meanpool expects count_include_pad True or False"):
        meanpool(x, 2, count_include_pad="no")
