"""Flux.jl's ``test/layers/upsample.jl`` and ``test/layers/stateless.jl`` cases (FluxML/Flux.jl at 3f2f828), in
fluxpy's NCHW.

A WHCN size ``(W, H, C, N)`` is fluxpy's ``(N, C, H, W)``; scales and sizes reverse with the axes (Flux's
``scale=(2, 3)`` is ``scale=(3, 2)``, ``size=(4, 6)`` is ``size=(6, 4)``); a scale tuple shorter than the spatial
axes scales Flux's first axes, fluxpy's last. Flux's ``Upsample(:bilinear, size=...)`` is
``Upsample(mode="bilinear", size=...)``. Where fluxpy chooses differently: ``fluxpy.ops.normalise``'s default axis
is the last (features, as LayerNorm), where ``Flux.normalise``'s default ``dims=ndims(x)`` is its last axis, the
batch: fluxpy's ``axis=0`` (stateless.jl:7-10 below).
"""
import numpy as np
import pytest

import fluxpy
from fluxpy import PixelShuffle, Upsample, flatten
from fluxpy.ops.norm import normalise
from fluxpy.ops.resample import upsample_linear
from tests.gradcheck import check_grad


def rand32(*shape):
    return np.random.default_rng(len(shape)).random(shape).astype(np.float32)


@pytest.mark.parametrize("m, shape, out", [
    # upsample.jl:1-20 (bilinear) and 22-41 (trilinear)
    (Upsample(mode="bilinear", scale=(3, 2)), (3, 2, 4, 3), (3, 2, 12, 6)),
    (Upsample(mode="bilinear", scale=3), (3, 2, 4, 3), (3, 2, 12, 9)),
    (Upsample(mode="bilinear", size=(6, 4)), (3, 2, 4, 3), (3, 2, 6, 4)),
    (Upsample(mode="trilinear", scale=(2, 3, 2)), (4, 3, 2, 4, 3), (4, 3, 4, 12, 6)),
    (Upsample(mode="trilinear", scale=3), (4, 3, 2, 4, 3), (4, 3, 6, 12, 9)),
    (Upsample(mode="trilinear", size=(4, 6, 4)), (4, 3, 2, 4, 3), (4, 3, 4, 6, 4)),
    # upsample.jl:43-74 (nearest)
    (Upsample(scale=(2,)), (3, 2, 3), (3, 2, 6)),
    (Upsample(scale=(3, 2)), (3, 2, 4, 3), (3, 2, 12, 6)),
    (Upsample(scale=(2,)), (3, 2, 4, 3), (3, 2, 4, 6)),       # Flux's first axis only: fluxpy's last
    (Upsample(scale=2), (3, 2, 4, 3), (3, 2, 8, 6)),
    (Upsample(size=(8, 6)), (3, 2, 4, 3), (3, 2, 8, 6)),
    # upsample.jl:76-87 (PixelShuffle)
    (PixelShuffle(2), (3, 18, 3), (3, 9, 6)),
    (PixelShuffle(3), (3, 18, 4, 3), (3, 2, 12, 9)),
], ids=lambda v: repr(v) if not isinstance(v, tuple) else "")
def test_output_shapes_and_dtype(m, shape, out):
    y = m(rand32(*shape))
    assert y.dtype == np.float32 and y.shape == out


def test_upsample_2_is_nearest_scale_2():
    # upsample.jl:69-71
    x = rand32(3, 2, 4, 3)
    np.testing.assert_array_equal(Upsample(2)(x), Upsample(mode="nearest", scale=2)(x))


def test_reprs_in_flux_form():
    # Flux src/layers/upsample.jl's show: Upsample(:bilinear, size = (4, 5))
    assert repr(Upsample(mode="bilinear", size=(5, 4))) == 'Upsample(mode="bilinear", size=(5, 4))'
    assert repr(Upsample(size=(6, 4))) == "Upsample(size=(6, 4))"
    assert repr(Upsample(scale=(3, 2))) == "Upsample((3, 2))"


def test_nearest_size_must_be_a_multiple():
    # NNlib's upsample_nearest(x; size) requires whole multiples
    with pytest.raises(fluxpy.DimensionMismatch, match=r"expects a spatial size that divides the output size"):
        Upsample(size=(5, 6))(rand32(1, 1, 2, 3))


@pytest.mark.parametrize("align_corners", [True, False])
@pytest.mark.parametrize("shape, size", [((2, 3, 5), (9,)), ((2, 3, 4, 5), (7, 3)), ((1, 2, 3, 4, 2), (5, 6, 3))])
def test_linear_modes_against_torch(shape, size, align_corners):
    torch = pytest.importorskip("torch")
    mode = {3: "linear", 4: "bilinear", 5: "trilinear"}[len(shape)]
    x = np.random.default_rng(0).standard_normal(shape)
    t = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.interpolate(t, size=size, mode=mode, align_corners=align_corners)
    dy = np.random.default_rng(1).standard_normal(ty.shape)
    ty.backward(torch.tensor(dy))
    y, back = fluxpy.pullback(lambda x: upsample_linear(x, None, align_corners, size=size), x)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(back(dy)[0], t.grad.numpy(), rtol=1e-12, atol=1e-13)
    check_grad(lambda x: upsample_linear(x, None, align_corners, size=size), x)


def test_flatten():
    # stateless.jl:2-5: Flux's (10, 10, 3, 2) -> (300, 2) is (2, 3, 10, 10) -> (2, 300)
    assert flatten(rand32(2, 3, 10, 10)).shape == (2, 300)


def test_normalise_default_axis_differs():
    # stateless.jl:7-10: Flux.normalise(x) == Flux.normalise(x; dims=3) for x of size (3, 2, 2): Flux's default is
    # its last axis, the batch, fluxpy's axis 0 here. fluxpy's default is the last axis (the features, as LayerNorm).
    x = rand32(2, 2, 3)
    y = normalise(x, axis=0)
    np.testing.assert_allclose(y.mean(axis=0), 0, atol=1e-6)
    np.testing.assert_allclose(normalise(x), normalise(x, axis=-1))
    assert not np.allclose(normalise(x), y)
