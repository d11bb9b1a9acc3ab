"""The model zoo's networks beside the ResNets (fluxpy.models: mobilenet_cifar, vgg_cifar, vit_cifar,
lstm_classifier) on the CPU: each builds, runs forward and backward on a small random batch with the right shapes,
trains (a few steps lower the loss), runs under mixed precision; the ViT's own layers against finite differences."""
import numpy as np
import pytest

import fluxpy
import fluxpy.models as models
from fluxpy import DimensionMismatch, DepthwiseConv, MaxPool

from gradcheck import check_grad

# name -> (builder(rng), one example's shape)
NETS = {
    "mobilenet_cifar": (lambda rng: models.mobilenet_cifar(rng=rng), (3, 32, 32)),
    "vgg_cifar": (lambda rng: models.vgg_cifar(rng=rng), (3, 32, 32)),
    "vit_cifar": (lambda rng: models.vit_cifar(rng=rng, width=48, depth=2), (3, 32, 32)),
    "lstm_classifier": (lambda rng: models.lstm_classifier(8, 16, rng=rng), (12, 8)),
}


def _batch(shape, n, seed):
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % 10)
    return rng.standard_normal((n, *shape), dtype=np.float32), fluxpy.onehotbatch(labels, range(10))


@pytest.mark.parametrize("name", sorted(NETS))
def test_forward_and_gradient_shapes(name):
    build, shape = NETS[name]
    seed = int(np.random.default_rng().integers(1 << 16))
    model = build(seed)
    x, y = _batch(shape, 3, seed)
    assert model(x).shape == (3, 10)
    loss, (grad,) = fluxpy.withgradient(lambda m: fluxpy.logitcrossentropy(m(x), y), model)
    assert np.isfinite(float(loss))
    params, grads = fluxpy.trainables(model), fluxpy.trainables(grad)
    assert len(params) == len(grads) > 0
    for p, g in zip(params, grads):
        assert g.shape == p.shape and g.dtype == p.dtype
        assert np.all(np.isfinite(g))
    assert sum(float(np.abs(g).sum()) > 0 for g in grads) == len(grads)   # every parameter reaches the loss


@pytest.mark.parametrize("name", sorted(NETS))
def test_training_lowers_the_loss(name):
    build, shape = NETS[name]
    model = build(1)
    x, y = _batch(shape, 4, 2)
    step = fluxpy.TrainStep(lambda m, x, y: fluxpy.logitcrossentropy(m(x), y), model,
                            fluxpy.setup(fluxpy.Adam(1e-3), model))
    losses = [float(step(x, y)) for _ in range(4)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("name", sorted(NETS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_runs_each_network_near_its_float32_output(name, dtype):
    build, shape = NETS[name]
    model = fluxpy.testmode(build(3))
    x, _ = _batch(shape, 2, 4)
    y32, y16 = model(x), fluxpy.mixed_precision(model, dtype)(x)
    assert y16.dtype == np.float32 and y16.shape == y32.shape
    scale = float(np.abs(y32).max())
    assert float(np.abs(y16 - y32).max()) < 0.1 * scale


def test_parameter_counts_and_the_layer_plan():
    mobile = models.mobilenet_cifar(rng=0)
    assert models.parameter_count(mobile) == models.MOBILENET_CIFAR_PARAMETERS
    blocks = mobile[2:2 + len(models.MOBILENET_CIFAR_STAGES)]
    assert [b[2].out_channels for b in blocks] == [c for c, _ in models.MOBILENET_CIFAR_STAGES]
    assert [b[0].stride for b in blocks] == [s for _, s in models.MOBILENET_CIFAR_STAGES]
    assert all(type(b[0]) is DepthwiseConv and b[0].groups == b[0].in_channels for b in blocks)
    vgg = models.vgg_cifar(rng=0)
    assert models.parameter_count(vgg) == models.VGG_CIFAR_PARAMETERS
    groups = vgg[2:5]
    assert [g[0].out_channels for g in groups] == list(models.VGG_CIFAR_WIDTHS)
    assert all(isinstance(g[1], MaxPool) and g[2].act is fluxpy.gelu for g in groups)
    x = np.zeros((1, 3, 32, 32), np.float32)
    assert [vgg[:i](x).shape[2] for i in (2, 3, 4, 5)] == [32, 16, 8, 4]


def test_vit_shapes_and_sizes():
    model = models.vit_cifar(rng=0, width=32, depth=3, nheads=4, patch=8, image=(16, 24), classes=7)
    assert model[0].position.shape == (6, 32) and len(model) == 3 + 3 + 1
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 24), dtype=np.float32)
    assert model[:4](x).shape == (2, 6, 32) and model(x).shape == (2, 7)
    assert repr(model[1]) == "EncoderBlock(32, nheads=4)"


@pytest.mark.parametrize("call,error,message", [
    (lambda: models.mobilenet_cifar(classes=0), ValueError, "mobilenet_cifar expects classes to be an int >= 1, got 0"),
    (lambda: models.vgg_cifar(classes=2.5), ValueError, "vgg_cifar expects classes to be an int >= 1, got 2.5"),
    (lambda: models.vit_cifar(classes=True), ValueError, "vit_cifar expects classes to be an int >= 1, got True"),
    (lambda: models.lstm_classifier(classes=-1), ValueError, "lstm_classifier expects classes to be an int >= 1"),
    (lambda: models.PatchEmbedding(4, 3, 8, image=(32, 30)), ValueError, "each a multiple of patch 4, got (32, 30)"),
    (lambda: models.PatchEmbedding(0, 3, 8), ValueError, "PatchEmbedding expects patch to be an int >= 1, got 0"),
    (lambda: models.PatchEmbedding(4, 3, 8, image=(8, 8))(np.ones((1, 2, 8, 8), np.float32)), DimensionMismatch,
     "PatchEmbedding(4, 3 => 8, image=(8, 8)) expects x of shape (N, 3, 8, 8), got (1, 2, 8, 8) float32"),
    (lambda: models.EncoderBlock(8, 2)(np.ones((2, 8), np.float32)), DimensionMismatch,
     "EncoderBlock(8, nheads=2) expects x of shape (N, L, 8), got (2, 8) float32"),
    (lambda: models.vit_cifar()(np.ones((1, 3, 16, 16), np.float32)), DimensionMismatch,
     "expects x of shape (N, 3, 32, 32), got (1, 3, 16, 16) float32"),
])
def test_bad_arguments_and_inputs_are_named(call, error, message):
    with pytest.raises(error) as err:
        call()
    assert message in str(err.value)


def test_patch_embedding_gradient_against_finite_differences():
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 16)))
    embed = fluxpy.f64(models.PatchEmbedding(2, 3, 5, image=(4, 6), rng=rng))

    def f(x, w, b, position):
        embed.conv.weight, embed.conv.bias, embed.position = w, b, position
        return embed(x)
    args = (rng.standard_normal((2, 3, 4, 6)), embed.conv.weight.copy(), embed.conv.bias + rng.standard_normal(5),
            embed.position.copy())
    check_grad(f, *args, rng=rng)
    x = args[0]   # token t is the patch at row t // 3, column t % 3, in every channel
    tokens = f(*args)
    w = args[1]
    expected = np.einsum("ncij,kcij->nk", x[:, :, 2:4, 4:6], w) + args[2] + args[3][5]
    np.testing.assert_allclose(tokens[:, 5], expected, rtol=1e-10)


def test_encoder_block_gradient_against_finite_differences():
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 16)))
    block = fluxpy.f64(models.EncoderBlock(6, 2, mlp_ratio=2, rng=rng))
    x = rng.standard_normal((2, 3, 6))
    check_grad(lambda x: block(x), x, rng=rng)
    (grad,) = fluxpy.gradient(lambda b: (b(x) * x).sum(), block)
    w = block.mlp[1].weight
    eps, d = 1e-6, rng.standard_normal(w.shape)
    block.mlp[1].weight = w + eps * d
    up = float((block(x) * x).sum())
    block.mlp[1].weight = w - eps * d
    down = float((block(x) * x).sum())
    block.mlp[1].weight = w
    np.testing.assert_allclose((up - down) / (2 * eps), float((grad["mlp"]["layers"][1]["weight"] * d).sum()), rtol=1e-6)
