"""Flux.jl's ``test/outputsize.jl`` known-answer cases (FluxML/Flux.jl at 3f2f828), in fluxpy.

A WHCN (or features-first) shape is fluxpy's NCHW (batch-first) shape reversed: Flux's ``(10, 10, 3, 1)`` is
``(1, 3, 10, 10)``, ``(10, 30)`` for a Dense is ``(30, 10)``. ``padbatch=True`` puts the batch axis of size 1 first
(Flux appends it). Flux's ``Dense(10 => 5)`` is ``Dense(10, 5)``, ``Conv((3, 3), 3 => 16)`` is ``Conv((3, 3), 3, 16)``.
Not translated: DepthwiseConv (fluxpy has ``groups=`` on Conv), ``Flux.unsqueeze``, ``@autosize``/``LazyLayer`` (no
fluxpy counterpart), and the activations' list beyond fluxpy's (all of fluxpy's are checked).
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import (AdaptiveMaxPool, AdaptiveMeanPool, AlphaDropout, BatchNorm, Bilinear, Chain, Conv, ConvTranspose,
                    CrossCor, Dense, DimensionMismatch, Dropout, GlobalMaxPool, GlobalMeanPool, GroupNorm,
                    InstanceNorm, LayerNorm, MaxPool, Maxout, MeanPool, Parallel, Scale, SkipConnection, flatten,
                    outputsize)
from fluxpy.ops import activations as A


def cat_channels(a, b):
    return fluxpy.concatenate([a, b], axis=1)


def test_basic():
    # Flux outputsize.jl:1-41
    assert outputsize(Chain(Conv((3, 3), 3, 16), Conv((3, 3), 16, 32)), (1, 3, 10, 10)) == (1, 32, 6, 6)
    m = Dense(10, 5)
    with pytest.raises(DimensionMismatch, match=r"Dense\(10 => 5\)"):
        outputsize(m, (2, 5))
    assert outputsize(m, (10,), padbatch=True) == (1, 5)
    m = Chain(Dense(10, 8, A.sigmoid), Dense(8, 5), Dense(5, 2))
    assert outputsize(m, (10,), padbatch=True) == (1, 2)
    assert outputsize(m, (30, 10)) == (30, 2)
    with pytest.raises(DimensionMismatch, match=r"Dense\(5 => 2\)"):
        outputsize(Chain(Dense(10, 8, A.sigmoid), Dense(8, 4), Dense(5, 2)), (1, 10))
    assert outputsize(Scale(10), (1, 10)) == (1, 10)
    assert outputsize(Maxout(Conv((3, 3), 3, 16), Conv((3, 3), 3, 16)), (1, 3, 10, 10)) == (1, 16, 8, 8)
    assert outputsize(flatten, (10, 3, 5, 5)) == (10, 75)
    m = Bilinear((10, 10), 7)
    assert outputsize(m, (32, 10)) == (32, 7)
    m = Chain(Conv((3, 3), 3, 16), BatchNorm(16), flatten, Dense(1024, 10))
    assert outputsize(m, (50, 3, 10, 10)) == (50, 10)
    assert outputsize(m, (2, 3, 10, 10)) == (2, 10)
    m = SkipConnection(Conv((3, 3), 3, 16, pad=1), cat_channels)
    assert outputsize(m, (1, 3, 10, 10)) == (1, 19, 10, 10)
    m = Parallel(cat_channels, Conv((3, 3), 3, 16, pad=1), fluxpy.identity)
    assert outputsize(m, (1, 3, 10, 10)) == (1, 19, 10, 10)


def test_multiple_inputs():
    # Flux outputsize.jl:43-55 (fluxpy's Dense takes (batch, features), so vcat of features is axis -1)
    m = Parallel(lambda a, b: fluxpy.concatenate([a, b], axis=-1), Dense(2, 4, A.relu), Dense(3, 6, A.relu))
    assert outputsize(m, (2,), (3,), padbatch=True) == (1, 10)
    assert outputsize(m, ((2,), (3,)), padbatch=True) == (1, 10)
    assert outputsize(m, (7, 2), (7, 3)) == (7, 10)
    m = Chain(m, Dense(10, 13, A.tanh), fluxpy.softmax)
    assert outputsize(m, (2,), (3,), padbatch=True) == (1, 13)
    assert outputsize(m, (7, 2), (7, 3)) == (7, 13)


@pytest.mark.parametrize("f", [A.celu, A.elu, A.gelu, A.hardsigmoid, A.hardtanh, A.leakyrelu, A.lisht, A.logcosh,
                               A.logsigmoid, A.mish, A.relu, A.relu6, A.selu, A.sigmoid, A.softplus, A.softshrink,
                               A.softsign, A.swish, A.tanhshrink, A.trelu, A.rrelu, A.gelu_erf],
                         ids=lambda f: getattr(f, "__name__", "relu"))
def test_activations(f):
    # Flux outputsize.jl:57-64
    assert outputsize(Dense(10, 5, f), (1, 10)) == (1, 5)


CONV = [  # Flux outputsize.jl:66-103: (layer, input NCHW, output NCHW); DepthwiseConv (87-94) not translated
    (Conv((3, 3), 3, 16), (1, 3, 10, 10), (1, 16, 8, 8)),
    (Conv((3, 3), 3, 16, stride=2), (1, 3, 5, 5), (1, 16, 2, 2)),
    (Conv((3, 3), 3, 16, stride=2, pad=3), (1, 3, 5, 5), (1, 16, 5, 5)),
    (Conv((3, 3), 3, 16, stride=2, pad=3, dilation=2), (1, 3, 5, 5), (1, 16, 4, 4)),
    (Conv((3, 3), 3, 16, stride=2, pad=3, dilation=2), (100, 3, 5, 5), (100, 16, 4, 4)),
    (ConvTranspose((3, 3), 3, 16), (1, 3, 8, 8), (1, 16, 10, 10)),
    (ConvTranspose((3, 3), 3, 16, stride=2), (1, 3, 2, 2), (1, 16, 5, 5)),
    (ConvTranspose((3, 3), 3, 16, stride=2, pad=3), (1, 3, 5, 5), (1, 16, 5, 5)),
    (ConvTranspose((3, 3), 3, 16, stride=2, pad=3, dilation=2), (1, 3, 4, 4), (1, 16, 5, 5)),
    (CrossCor((3, 3), 3, 16), (1, 3, 10, 10), (1, 16, 8, 8)),
    (CrossCor((3, 3), 3, 16, stride=2), (1, 3, 5, 5), (1, 16, 2, 2)),
    (CrossCor((3, 3), 3, 16, stride=2, pad=3), (1, 3, 5, 5), (1, 16, 5, 5)),
    (CrossCor((3, 3), 3, 16, stride=2, pad=3, dilation=2), (1, 3, 5, 5), (1, 16, 4, 4)),
    # Flux outputsize.jl:105-129: pooling
    (AdaptiveMaxPool((2, 2)), (1, 3, 10, 10), (1, 3, 2, 2)),
    (AdaptiveMeanPool((2, 2)), (1, 3, 10, 10), (1, 3, 2, 2)),
    (GlobalMaxPool(), (1, 3, 10, 10), (1, 3, 1, 1)),
    (GlobalMeanPool(), (1, 3, 10, 10), (1, 3, 1, 1)),
    (MaxPool((2, 2)), (1, 3, 10, 10), (1, 3, 5, 5)),
    (MaxPool((2, 2), stride=1), (1, 4, 5, 5), (1, 4, 4, 4)),
    (MeanPool((2, 2)), (1, 3, 10, 10), (1, 3, 5, 5)),
    (MeanPool((2, 2), stride=1), (1, 4, 5, 5), (1, 4, 4, 4)),
]


@pytest.mark.parametrize("m, x, y", CONV, ids=[f"{i}-{m!r}" for i, (m, _, _) in enumerate(CONV)])
def test_conv_and_pool(m, x, y):
    assert outputsize(m, x) == y


@pytest.mark.parametrize("pool", [MaxPool, MeanPool])
def test_pool_with_pad_larger_than_kernel(pool):
    # Flux outputsize.jl:121-122, 128-129 (PyTorch refuses a pad over half the kernel; fluxpy follows Flux)
    assert outputsize(pool((2, 2), stride=2, pad=3), (1, 2, 5, 5)) == (1, 2, 5, 5)
    y = pool((2, 2), stride=2, pad=3)(np.ones((1, 2, 5, 5), np.float32))
    assert y.shape == (1, 2, 5, 5)
    empty = np.float32(-np.finfo(np.float32).max) if pool is MaxPool else np.float32(0)
    # windows start at -3, -1, 1, 3, 5: the first and last along each axis hold padding only
    assert (y[..., 0, :] == empty).all() and (y[..., :, 4] == empty).all() and (y[..., 1:4, 1:4] != empty).all()


def test_conv_wrong_channels():
    # Flux outputsize.jl:75
    with pytest.raises(DimensionMismatch, match=r"Conv\(\(3, 3\), 3 => 16"):
        outputsize(Conv((3, 3), 3, 16, stride=2, pad=3, dilation=2), (2, 5, 5))


def test_normalisation():
    # Flux outputsize.jl:132-164. Flux's LayerNorm(32) normalises WHCN's first axis: fluxpy's last
    for m in (Dropout(0.1), AlphaDropout(0.1)):
        assert outputsize(m, (10, 10)) == (10, 10)
        assert outputsize(m, (10,), padbatch=True) == (1, 10)
    assert outputsize(LayerNorm(32), (16, 3, 32, 32)) == (16, 3, 32, 32)
    assert outputsize(LayerNorm(32), (3, 32, 32), padbatch=True) == (1, 3, 32, 32)
    m2 = LayerNorm((2, 3))
    assert outputsize(m2, (2, 3)) == (2, 3) == m2(np.random.default_rng(0).standard_normal((2, 3))
                                                   .astype(np.float32)).shape
    for m, c, bad in ((BatchNorm(3), 3, 5), (InstanceNorm(3), 3, 5), (GroupNorm(16, 4), 16, 15)):
        assert outputsize(m, (16, c, 32, 32)) == (16, c, 32, 32)
        assert outputsize(m, (c, 32, 32), padbatch=True) == (1, c, 32, 32)
        with pytest.raises(DimensionMismatch, match=type(m).__name__):
            outputsize(m, (1, bad, 32, 32))


def test_bad_sizes_are_an_error():
    with pytest.raises(ValueError, match="outputsize expects one shape"):
        outputsize(Dense(2, 3), 2)


def test_conv_shapes_against_torch():
    torch = pytest.importorskip("torch")
    nn = torch.nn
    cases = [(nn.Conv2d(3, 16, 3, stride=2, padding=3, dilation=2), (1, 3, 5, 5), (1, 16, 4, 4)),
             (nn.ConvTranspose2d(3, 16, 3, stride=2), (1, 3, 2, 2), (1, 16, 5, 5)),
             (nn.ConvTranspose2d(3, 16, 3, stride=2, padding=3), (1, 3, 5, 5), (1, 16, 5, 5)),
             (nn.ConvTranspose2d(3, 16, 3, stride=2, padding=3, dilation=2), (1, 3, 4, 4), (1, 16, 5, 5)),
             (nn.AdaptiveMaxPool2d((2, 2)), (1, 3, 10, 10), (1, 3, 2, 2))]
    for m, x, y in cases:
        assert tuple(m(torch.zeros(x)).shape) == y, m
