"""NNlib.jl's ``test/conv.jl`` known-answer cases (FluxML/NNlib.jl at f71b71c), in fluxpy's NCHW layout.

A Julia array of size ``(W, H, C, N)`` (or ``(L, C, N)``, ``(W, H, D, C, N)``) holds the same bytes, column-major, as
the NumPy array of the reversed shape ``(N, C, H, W)``: :func:`whcn` takes the values in Julia's memory order with the
Julia size and reverses the axes. Spatial options reverse too: NNlib's ``stride=(1, 2)`` (W, H) is fluxpy's
``(2, 1)`` (H, W), its ``padding=(w_lo, w_hi, h_lo, h_hi)`` is fluxpy's ``(top, bottom, left, right) = (h_lo, h_hi,
w_lo, w_hi)``. NNlib's ``conv`` flips the kernel (true convolution) like fluxpy's; its ``flipkernel=true`` is
fluxpy's ``flipped=True`` (cross-correlation). ``∇conv_filter(x, dy, cdims)`` is ``conv_backward_filter``,
``∇conv_data(dy, w, cdims)`` ``conv_backward_data``; ``depthwiseconv`` is a grouped conv with ``groups = C_in``
(fluxpy's ``DepthwiseConv``), its Julia weight ``(k..., C_mult, C_in)`` being fluxpy's ``(C_in*C_mult, 1, k...)``.

Not translated: the in-place ``conv!``/``∇conv_*!`` forms with ``alpha``/``beta`` and the ``_im2col``/``_direct``
variants (one implementation here), complex numbers, the NaN-loop checks of 1,000 repeated calls, the fuzzing
(``NNLIB_TEST_FUZZING``; tests/test_conv_nd.py draws shapes with hypothesis instead), mixed-dtype ``conv`` (fluxpy
requires one dtype), the Enzyme and ``conv_direct!`` type tests.
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import DepthwiseConv
from fluxpy.ops.conv import conv, conv_backward_data, conv_backward_filter
from fluxpy.ops.dims import ConvDims


def whcn(values, size):
    """A Julia array given by its values in memory order (column-major) and its size, as the NumPy array of the same
    bytes: the axes reversed."""
    return np.array(values, dtype=np.float64).reshape(tuple(reversed(size)))


def spatial(a):
    """NNlib's ``ddims``: drop the channel and batch axes (size 1)."""
    return a[0, 0]


# conv.jl:77-244 (conv_answer_dict)
CONV_ANSWERS = {
    1: {
        "y_pad": whcn([1, 4, 7, 10, 13, 10], (6,)),
        "y_dil": whcn([5, 8, 11], (3,)),
        "y_flip": whcn([5, 8, 11, 14], (4,)),
        "dx": whcn([8, 18, 27, 36, 13], (5,)),
        "dx_stride": whcn([8, 4, 20, 10, 0], (5,)),
        "dx_pad": whcn([9, 18, 27, 36, 33], (5,)),
        "dx_dil": whcn([10, 16, 27, 8, 11], (5,)),
        "dx_flip": whcn([5, 18, 27, 36, 28], (5,)),
        "dw": whcn([134, 100], (2,)),
        "dw_stride": whcn([48, 34], (2,)),
        "dw_pad": whcn([135, 150], (2,)),
        "dw_dil": whcn([102, 54], (2,)),
        "dw_flip": whcn([110, 148], (2,)),
    },
    2: {
        "y_pad": whcn([
            1, 4, 7, 10, 13, 10, 9, 29, 39, 49, 59, 40, 29, 79, 89, 99, 109, 70, 49, 129, 139, 149, 159, 100,
            48, 115, 122, 129, 136, 80
        ], (6, 5)),
        "y_dil": whcn([48, 58, 68, 98, 108, 118], (3, 2)),
        "y_flip": whcn([51, 61, 71, 81, 101, 111, 121, 131, 151, 161, 171, 181], (4, 3)),
        "dx": whcn([
            116, 243, 313, 383, 177, 374, 700, 800, 900, 386, 674, 1200, 1300, 1400, 586, 258, 407, 437, 467,
            159
        ], (5, 4)),
        "dx_stride": whcn([
            116, 87, 196, 147, 0, 58, 29, 98, 49, 0, 516, 387, 596, 447, 0, 258, 129, 298, 149, 0
        ], (5, 4)),
        "dx_pad": whcn([
            152, 261, 340, 419, 370, 470, 700, 800, 900, 746, 850, 1200, 1300, 1400, 1126, 911, 1240, 1319,
            1398, 1087
        ], (5, 4)),
        "dx_dil": whcn([
            192, 232, 416, 174, 204, 392, 432, 766, 324, 354, 96, 116, 184, 58, 68, 196, 216, 334, 108, 118
        ], (5, 4)),
        "dx_flip": whcn([
            51, 163, 193, 223, 162, 254, 700, 800, 900, 586, 454, 1200, 1300, 1400, 886, 453, 1087, 1157,
            1227, 724
        ], (5, 4)),
        "dw": whcn([17378, 16250, 11738, 10610], (2, 2)),
        "dw_stride": whcn([5668, 5312, 3888, 3532], (2, 2)),
        "dw_pad": whcn([18670, 19850, 22550, 23430], (2, 2)),
        "dw_dil": whcn([8632, 7636, 3652, 2656], (2, 2)),
        "dw_flip": whcn([12590, 13982, 19550, 20942], (2, 2)),
    },
    3: {
        "y_pad": whcn([
            1, 4, 7, 10, 13, 10, 9, 29, 39, 49, 59, 40, 29, 79, 89, 99, 109, 70, 49, 129, 139, 149, 159, 100,
            48, 115, 122, 129, 136, 80, 26, 80, 94, 108, 122, 80, 126, 322, 358, 394, 430, 260, 206, 502, 538,
            574, 610, 360, 286, 682, 718, 754, 790, 460, 220, 502, 524, 546, 568, 320, 146, 360, 374, 388,
            402, 240, 446, 1042, 1078, 1114, 1150, 660, 526, 1222, 1258, 1294, 1330, 760, 606, 1402, 1438,
            1474, 1510, 860, 420, 942, 964, 986, 1008, 560, 205, 456, 467, 478, 489, 270, 517, 1133, 1159,
            1185, 1211, 660, 577, 1263, 1289, 1315, 1341, 730, 637, 1393, 1419, 1445, 1471, 800, 392, 847,
            862, 877, 892, 480
        ], (6, 5, 4)),
        "y_dil": whcn([608, 644, 680, 788, 824, 860], (3, 2, 1)),
        "y_flip": whcn([
            686, 722, 758, 794, 866, 902, 938, 974, 1046, 1082, 1118, 1154, 1406, 1442, 1478, 1514, 1586,
            1622, 1658, 1694, 1766, 1802, 1838, 1874
        ], (4, 3, 2)),
        "dx": whcn([
            2576, 5118, 5658, 6198, 3010, 5948, 11576, 12512, 13448, 6420, 8468, 16256, 17192, 18128, 8580,
            4092, 7718, 8114, 8510, 3950, 9624, 18316, 19108, 19900, 9340, 18680, 34992, 36288, 37584, 17320,
            22280, 41472, 42768, 44064, 20200, 9776, 17756, 18260, 18764, 8340, 4168, 7438, 7690, 7942, 3450,
            6972, 11896, 12256, 12616, 5140, 8052, 13696, 14056, 14416, 5860, 2804, 4278, 4386, 4494, 1510
        ], (5, 4, 3)),
        "dx_stride": whcn([
            2576, 2254, 3152, 2758, 0, 1932, 1610, 2364, 1970, 0, 5456, 4774, 6032, 5278, 0, 4092, 3410, 4524,
            3770, 0, 1288, 966, 1576, 1182, 0, 644, 322, 788, 394, 0, 2728, 2046, 3016, 2262, 0, 1364, 682,
            1508, 754, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        ], (5, 4, 3)),
        "dx_pad": whcn([
            4220, 6343, 7116, 7889, 6550, 8490, 12276, 13312, 14348, 11606, 12350, 17456, 18492, 19528, 15546,
            11989, 16664, 17469, 18274, 14333, 16200, 22628, 23616, 24604, 19392, 25336, 34992, 36288, 37584,
            29320, 30216, 41472, 42768, 44064, 34200, 26236, 35664, 36652, 37640, 28940, 22816, 30831, 31636,
            32441, 24794, 32522, 43668, 44704, 45740, 34742, 36462, 48848, 49884, 50920, 38602, 29501, 39264,
            40037, 40810, 30733
        ], (5, 4, 3)),
        "dx_dil": whcn([
            4864, 5152, 9696, 4508, 4760, 6304, 6592, 12396, 5768, 6020, 3648, 3864, 7120, 3220, 3400, 4728,
            4944, 9100, 4120, 4300, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2432, 2576,
            4544, 1932, 2040, 3152, 3296, 5804, 2472, 2580, 1216, 1288, 1968, 644, 680, 1576, 1648, 2508, 824,
            860
        ], (5, 4, 3)),
        "dx_flip": whcn([
            686, 2094, 2202, 2310, 1588, 2924, 7544, 7904, 8264, 5124, 3644, 9344, 9704, 10064, 6204, 3138,
            7430, 7682, 7934, 4616, 4836, 11980, 12484, 12988, 7792, 14936, 34992, 36288, 37584, 21640, 17816,
            41472, 42768, 44064, 25240, 12620, 28412, 29204, 29996, 16728, 7030, 15646, 16042, 16438, 9084,
            17772, 38968, 39904, 40840, 22276, 19932, 43648, 44584, 45520, 24796, 12362, 26742, 27282, 27822,
            14992
        ], (5, 4, 3)),
        "dw": whcn([1058184, 1036200, 948264, 926280, 618504, 596520, 508584, 486600], (2, 2, 2)),
        "dw_stride": whcn([74760, 72608, 64000, 61848, 31720, 29568, 20960, 18808], (2, 2, 2)),
        "dw_pad": whcn([1260550, 1308050, 1403270, 1449230, 1737310, 1775890, 1832590, 1867310], (2, 2, 2)),
        "dw_dil": whcn([250320, 241512, 206280, 197472, 74160, 65352, 30120, 21312], (2, 2, 2)),
        "dw_flip": whcn([639480, 670200, 793080, 823800, 1253880, 1284600, 1407480, 1438200], (2, 2, 2)),
    },
}


def _known(rank):
    answers = CONV_ANSWERS[rank]
    inner = (slice(1, -1),) * rank                # y_pad[2:end-1, ...]
    every_other = (slice(1, -1, 2),) * rank        # y_pad[2:2:end-1, ...]
    x = np.arange(1.0, answers["dx"].size + 1).reshape((1, 1) + answers["dx"].shape)
    w = np.arange(1.0, answers["dw"].size + 1).reshape((1, 1) + answers["dw"].shape)
    return answers, answers["y_pad"][inner], answers["y_pad"][every_other], x, w


CASES = {"": {}, "_stride": dict(stride=2), "_dil": dict(dilation=2), "_pad": dict(pad=1), "_flip": dict(flipped=True)}


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_dense_convolution(rank):
    # conv.jl:249-303: conv, with stride, dilation, padding and the flipped kernel, in float64 and float32
    answers, y_plain, y_stride, x, w = _known(rank)
    expected = {"": y_plain, "_stride": y_stride, "_dil": answers["y_dil"], "_pad": answers["y_pad"],
                "_flip": answers["y_flip"]}
    for suffix, opts in CASES.items():
        np.testing.assert_allclose(spatial(conv(x, w, **opts)), expected[suffix], rtol=1e-7)
        np.testing.assert_allclose(spatial(conv(x.astype(np.float32), w.astype(np.float32), **opts)),
                                   expected[suffix].astype(np.float32), rtol=1e-6)
    view = np.lib.stride_tricks.as_strided(x, x.shape, x.strides)   # conv on views: conv.jl:285
    np.testing.assert_allclose(spatial(conv(view, w)), y_plain, rtol=1e-7)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_dense_convolution_gradients(rank):
    # conv.jl:345-390: dy = conv(x, w, cdims), then ∇conv_filter(x, dy) == dw and ∇conv_data(dy, w) == dx
    answers, _, _, x, w = _known(rank)
    for suffix, opts in CASES.items():
        cdims = ConvDims.from_arrays(x, w, **opts)
        dy = conv(x, w, **opts)
        np.testing.assert_allclose(spatial(conv_backward_filter(x, dy, cdims)), answers["dw" + suffix], rtol=1e-7)
        np.testing.assert_allclose(spatial(conv_backward_data(dy, w, cdims)), answers["dx" + suffix], rtol=1e-7)
        c32 = ConvDims.from_arrays(x.astype(np.float32), w.astype(np.float32), **opts)
        np.testing.assert_allclose(spatial(conv_backward_filter(x.astype(np.float32), dy.astype(np.float32), c32)),
                                   answers["dw" + suffix], rtol=1e-6)
        np.testing.assert_allclose(spatial(conv_backward_data(dy.astype(np.float32), w.astype(np.float32), c32)),
                                   answers["dx" + suffix], rtol=1e-6)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_depthwise_convolution(rank):
    # conv.jl:569-673: single-channel depthwise convolutions give the dense answers (groups = C_in = 1)
    answers, y_plain, y_stride, x, w = _known(rank)
    expected = {"": y_plain, "_stride": y_stride, "_dil": answers["y_dil"], "_pad": answers["y_pad"],
                "_flip": answers["y_flip"]}
    for suffix, opts in CASES.items():
        np.testing.assert_allclose(spatial(conv(x, w, groups=1, **opts)), expected[suffix], rtol=1e-7)
        cdims = ConvDims.from_arrays(x, w, groups=1, **opts)
        dy = conv(x, w, **opts)
        np.testing.assert_allclose(spatial(conv_backward_filter(x, dy, cdims)), answers["dw" + suffix], rtol=1e-7)
        np.testing.assert_allclose(spatial(conv_backward_data(dy, w, cdims)), answers["dx" + suffix], rtol=1e-7)
    layer = DepthwiseConv(answers["dw"].shape, 1, 1, bias=False, init=lambda *s, rng=None: w.astype(np.float32))
    np.testing.assert_allclose(spatial(layer(x.astype(np.float32))), y_plain, rtol=1e-6)


def test_real_depthwise_convolution():
    # conv.jl:675-681: x = reshape(1:2, (1, 2, 1)), w = reshape(1:6, (3, 1, 2)) (k, C_mult, C_in), padding 1
    x = whcn([1, 2], (1, 2, 1))
    w = whcn([1, 2, 3, 4, 5, 6], (3, 1, 2))              # (C_in, C_mult, k) = fluxpy's (C_in*C_mult, 1, k)
    np.testing.assert_allclose(conv(x, w, pad=1, groups=2).ravel(), [2, 10], rtol=1e-7)
    layer = DepthwiseConv((3,), 2, 2, pad=1, bias=False, init=lambda *s, rng=None: w.astype(np.float32))
    np.testing.assert_allclose(layer(x.astype(np.float32)).ravel(), [2, 10], rtol=1e-7)


def test_conv_dims():
    # conv.jl:7-75 (DenseConvDims): x = randn(5,4,3,2), w = randn(1,2,3,4) -> NCHW (2,3,4,5) and (4,3,2,1)
    x, w = np.zeros((2, 3, 4, 5)), np.zeros((4, 3, 2, 1))
    cd = ConvDims.from_arrays(x, w)
    assert cd.x_shape[2:] == (4, 5) and cd.kernel_hw == (2, 1) and cd.x_shape[1] == 3 and cd.w_shape[0] == 4
    assert (cd.stride, cd.dilation, cd.pad, cd.flipped, cd.out_hw) == ((1, 1), (1, 1), (0, 0, 0, 0), False, (3, 5))
    cd = ConvDims.from_arrays(x, w, stride=2, dilation=2, pad=3, flipped=True)
    assert (cd.stride, cd.dilation, cd.pad, cd.flipped, cd.out_hw) == ((2, 2), (2, 2), (3, 3, 3, 3), True, (4, 6))
    cd = ConvDims.from_arrays(x, w, stride=(2, 1), dilation=(2, 1), pad=(1, 0))   # NNlib's (1,2), (1,2), (0,1)
    assert (cd.stride, cd.dilation, cd.pad, cd.out_hw) == ((2, 1), (2, 1), (1, 1, 0, 0), (2, 5))
    cd = ConvDims.from_arrays(x, w, pad=(3, 4, 1, 2))                               # NNlib's padding=(1,2,3,4)
    assert cd.pad == (3, 4, 1, 2) and cd.out_hw == (10, 8)
    for bad in [dict(stride=(1,)), dict(stride=(1, 1, 1)), dict(pad=(1, 1, 1)), dict(pad=(1, 1, 1, 1, 1)),
                dict(dilation=(1,)), dict(dilation=(1, 1, 1)), dict(dilation=(5, 1))]:
        with pytest.raises(ValueError, match="conv expects"):
            ConvDims.from_arrays(x, w, **bad)
    with pytest.raises(ValueError, match=r"conv expects x.shape\[1\] == w.shape\[1\] \* groups == 1"):
        ConvDims.from_arrays(x, w[:, :1])


def test_grouped_convolutions():
    # conv.jl:765-796: x (28,28,100,2), w (3,3,20,15) -> NCHW (2,100,28,28), (15,20,3,3); 5 groups equal 5 convs
    rng = np.random.default_rng(0)
    x, w = rng.random((2, 100, 28, 28)).astype(np.float32), rng.random((15, 20, 3, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=r"x.shape\[1\] == w.shape\[1\] \* groups == 20"):
        conv(x, w)
    y = conv(x, w, groups=5)
    gx, gw = fluxpy.gradient(lambda x, w: conv(x, w, groups=5).sum(), x, w)
    for g in range(5):
        i, o = slice(20 * g, 20 * (g + 1)), slice(3 * g, 3 * (g + 1))
        np.testing.assert_allclose(conv(x[:, i], w[o]), y[:, o], rtol=1e-5)
        gx_g, gw_g = fluxpy.gradient(lambda x, w: conv(x, w).sum(), x[:, i], w[o])
        np.testing.assert_allclose(gx_g, gx[:, i], rtol=1e-5)
        np.testing.assert_allclose(gw_g, gw[o], rtol=1e-5)
    from tests.gradcheck import check_grad   # conv.jl:788-795: the grouped gradient against finite differences
    xs, ws = rng.random((2, 4, 6, 6)), rng.random((4, 2, 3, 3))
    check_grad(lambda x, w: conv(x, w, groups=2), xs, ws, rng=rng)


def test_conv_wrapper_sizes():
    # conv.jl:798-808: x rand(10,10,3,10), w rand(2,2,3,16), w1 rand(3,4,3,16) -> NCHW; NNlib's (W, H) options reversed
    x, w, w1 = np.zeros((10, 3, 10, 10)), np.zeros((16, 3, 2, 2)), np.zeros((16, 3, 4, 3))
    assert conv(x, w).shape == (10, 16, 9, 9)
    assert conv(x, w, stride=(2, 2), pad=(2, 2)).shape == (10, 16, 7, 7)
    assert conv(x, w1, stride=(2, 1), pad=(3, 2)).shape == (10, 16, 7, 12)
    assert conv(x, w, stride=(2, 1), pad=(3, 2), dilation=(2, 2)).shape == (10, 16, 7, 12)
    assert conv(x, w, stride=(2, 1), pad=(3, 2), dilation=(2, 2), flipped=True).shape == (10, 16, 7, 12)


def test_depthwiseconv_wrapper_sizes():
    # conv.jl:820-829: w rand(2,2,3,3) (k, k, C_mult, C_in) -> 9 output channels; as DepthwiseConv layers
    x = np.zeros((10, 3, 10, 10), np.float32)
    assert DepthwiseConv((2, 2), 3, 9)(x).shape == (10, 9, 9, 9)
    assert DepthwiseConv((2, 2), 3, 9, stride=(2, 2), pad=(2, 2))(x).shape == (10, 9, 7, 7)
    assert DepthwiseConv((4, 3), 3, 9, stride=(2, 1), pad=(3, 2))(x).shape == (10, 9, 7, 12)
    assert DepthwiseConv((4, 3), 3, 9, stride=(2, 1), pad=(3, 2), dilation=(2, 2))(x).shape == (10, 9, 5, 10)
    assert fluxpy.CrossCor((4, 3), 3, 9, stride=(2, 1), pad=(3, 2), dilation=(2, 2), groups=3)(x).shape == \
        (10, 9, 5, 10)
