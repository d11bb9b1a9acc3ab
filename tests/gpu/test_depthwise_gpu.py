"""fluxpy's depthwise kernels (fluxpy.kernels.cuda_depthwise) against the CPU path in float64.

The kernels are called directly (so the comparison does not depend on which implementation the per-problem timing
keeps) over channel counts with and without whole 16-byte vectors, kernel sizes, strides, asymmetric padding,
dilation, true convolution and cross-correlation, in float16 and bfloat16, with the rule's tiles and with every
candidate tile (the forward's bit for bit alike); then through the conv op in a captured step, and the dispatch's
refusals (float32, C order, grouped but not depthwise).
"""
import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy.layout import is_channels_last, to_channels_last
from fluxpy.ops.conv import conv
from fluxpy.ops.dims import ConvDims
from sweeps import sweep
from test_half_conv_matmul import BF16

pytestmark = pytest.mark.gpu

CASES = [  # (N, C, H, W), (KH, KW), stride, pad (top, bottom, left, right), dilation
    ((4, 16, 9, 9), (3, 3), 1, (1, 1, 1, 1), 1),
    ((3, 24, 10, 7), (3, 3), 2, (1, 1, 1, 1), 1),
    ((2, 7, 8, 8), (3, 3), 1, (1, 1, 1, 1), 1),
    ((2, 264, 5, 6), (3, 3), 2, (0, 1, 1, 0), 1),
    ((2, 40, 11, 11), (5, 5), 1, (2, 2, 2, 2), 1),
    ((2, 8, 12, 12), (3, 3), (2, 1), (2, 2, 1, 1), 2),
    ((3, 32, 7, 9), (1, 3), 1, (0, 0, 1, 1), 1),
    ((1, 520, 4, 4), (3, 3), 1, (1, 1, 1, 1), 1),
]


def _draw(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _close(got, want, dtype, terms, what):
    """Within half-precision rounding of the result and of ``terms`` products added in float32."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), what
    eps = 2.0 ** -8 if dtype == BF16 else 2.0 ** -11
    scale = np.sqrt(terms) * (np.abs(want).max() + 1)
    assert np.max(np.abs(got - want)) <= 4 * eps * scale, (what, np.max(np.abs(got - want)), scale)


@pytest.mark.parametrize("dtype, case, flipped", sweep([np.float16, BF16], CASES, [False, True]),
                         ids=lambda v: str(v) if not isinstance(v, tuple) else "x".join(map(str, v[0])))
def test_kernels_match_the_cpu_path_in_float64(dtype, case, flipped):
    from fluxpy.kernels import cuda_depthwise as dw
    cp = cupy_module()
    shape, kernel, stride, pad, dilation = case
    rng = np.random.default_rng(7)
    x, w = _draw(rng, shape, dtype), _draw(rng, (shape[1], 1, *kernel), dtype)
    opts = dict(stride=stride, pad=pad, dilation=dilation, groups=shape[1], flipped=flipped)
    cd = ConvDims.from_shapes(x.shape, w.shape, **opts)   # NumPy bfloat16 is not a "floating" kind
    dy = _draw(rng, cd.y_shape, dtype)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    y_ref, back = fluxpy.pullback(lambda x, w: conv(x, w, **opts), x64, w64)
    dx_ref, dw_ref = back(dy64)
    xg, dyg = to_channels_last(cp.asarray(x)), to_channels_last(cp.asarray(dy))
    wg = cp.asarray(w)
    assert dw.supports(xg, wg, cd) and dw.supports(dyg, None, cd)
    y = dw.forward(xg, wg, cd)
    dx = dw.backward_data(dyg, wg, cd)
    dwt = dw.backward_filter(xg, dyg, cd)
    assert is_channels_last(y) or shape[1] == 1
    assert is_channels_last(dx) and dwt.shape == w.shape and y.dtype == dx.dtype == dwt.dtype == np.dtype(dtype)
    taps = kernel[0] * kernel[1]
    _close(y.get(), y_ref, dtype, taps, "y")
    _close(dx.get(), dx_ref, dtype, taps, "dx")
    _close(dwt.get(), dw_ref, dtype, y_ref.size // shape[1], "dw")


TILED = [CASES[i] for i in (0, 1, 2, 4, 6)]   # 3x3 at strides 1 and 2, single channels, 5x5, 1x3


@pytest.mark.parametrize("dtype, case", sweep([np.float16, BF16], TILED),
                         ids=lambda v: str(v) if not isinstance(v, tuple) else "x".join(map(str, v[0])))
def test_every_candidate_tile_matches_the_cpu_path_and_the_forwards_agree_bit_for_bit(dtype, case):
    from fluxpy.kernels import cuda_depthwise as dw
    cp = cupy_module()
    shape, kernel, stride, pad, dilation = case
    rng = np.random.default_rng(11)
    x, w = _draw(rng, shape, dtype), _draw(rng, (shape[1], 1, *kernel), dtype)
    opts = dict(stride=stride, pad=pad, dilation=dilation, groups=shape[1])
    cd = ConvDims.from_shapes(x.shape, w.shape, **opts)
    dy = _draw(rng, cd.y_shape, dtype)
    y_ref, back = fluxpy.pullback(lambda x, w: conv(x, w, **opts), *(a.astype(np.float64) for a in (x, w)))
    dw_ref = back(dy.astype(np.float64))[1]
    xg, dyg, wg = to_channels_last(cp.asarray(x)), to_channels_last(cp.asarray(dy)), cp.asarray(w)
    forwards = [dw.forward(xg, wg, cd, tile=t).get() for t in dw.candidates("forward", cd)]
    for t, y in zip(dw.candidates("forward", cd), forwards):
        _close(y, y_ref, dtype, kernel[0] * kernel[1], f"y {t}")
        assert np.array_equal(y.view(np.uint16), forwards[0].view(np.uint16)), f"{t}: each output's taps in order"
    for t in dw.candidates("filter", cd):
        _close(dw.backward_filter(xg, dyg, cd, tile=t).get(), dw_ref, dtype, y_ref.size // shape[1], f"dw {t}")


def test_the_sums_of_the_weights_gradient_are_deterministic():
    from fluxpy.kernels import cuda_depthwise as dw
    cp = cupy_module()
    rng = np.random.default_rng(3)
    x = to_channels_last(cp.asarray(_draw(rng, (64, 32, 16, 16), np.float16)))
    dy = to_channels_last(cp.asarray(_draw(rng, (64, 32, 16, 16), np.float16)))
    cd = ConvDims.from_shapes(x.shape, (32, 1, 3, 3), pad=1, groups=32)
    for tile in dw.candidates("filter", cd):
        first = dw.backward_filter(x, dy, cd, tile=tile).get()
        for _ in range(3):
            assert np.array_equal(dw.backward_filter(x, dy, cd, tile=tile).get(), first), tile


def test_the_dispatch_takes_only_channels_last_half_depthwise_problems():
    from fluxpy.kernels import cuda_depthwise as dw
    cp = cupy_module()
    x = to_channels_last(cp.ones((2, 16, 6, 6), np.float16))
    w = cp.ones((16, 1, 3, 3), np.float16)
    cd = ConvDims.from_shapes(x.shape, w.shape, pad=1, groups=16)
    assert dw.supports(x, w, cd)
    assert not dw.supports(cp.ascontiguousarray(x), w, cd), "C order"
    assert not dw.supports(x.astype(np.float32), w.astype(np.float32), cd), "float32"
    assert not dw.supports(x, w.astype(np.float32), cd), "mixed dtypes"
    grouped = ConvDims.from_shapes(x.shape, (16, 2, 3, 3), pad=1, groups=8)
    assert not dw.supports(x, cp.ones((16, 2, 3, 3), np.float16), grouped), "grouped, not depthwise"


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=str)
def test_a_depthwise_layer_in_a_captured_step_equals_its_eager_step(dtype):
    cp = cupy_module()
    rng = np.random.default_rng(5)
    x = to_channels_last(cp.asarray(_draw(rng, (8, 32, 12, 12), dtype)))

    def model():   # bias-free and without activation: the plain conv op, whose kernels these are
        chain = fluxpy.Chain(fluxpy.Conv((3, 3), 32, 32, pad=1, groups=32, bias=False, rng=0), fluxpy.relu,
                             fluxpy.flatten)
        return fluxpy.mixed_precision(fluxpy.gpu(chain), np.dtype(dtype))

    results = []
    for capture in (False, True):
        m = model()
        step = fluxpy.TrainStep(lambda m, x: fluxpy.sum(m(x) ** 2), m, fluxpy.setup(fluxpy.Descent(1e-3), m),
                                capture=capture)
        for _ in range(step.warmup + 3):
            loss = float(step(x))
        if capture:
            assert set(step.captured().values()) == {"captured"}
        results.append(loss)
    assert np.isfinite(results[0])
    np.testing.assert_allclose(results[1], results[0], rtol=1e-3)
