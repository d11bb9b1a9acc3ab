"""The ResNets of ``benchmarks/models.py`` (the nets of ``benchmarks/resnet_step.py``), on the CPU.

They build, give the right shapes, have the parameter counts of their architecture and train; with
PyTorch installed, the PyTorch twin with the copied weights gives the same loss, gradients, Adam step
and running statistics in float64.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

import fluxpy
from fluxpy import BatchNorm, Chain, CrossCor, Dense, Parallel, SkipConnection

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from models import (RESNET18_PARAMETERS, RESNET20_PARAMETERS, RESNETS, basic_block,  # noqa: E402
                    parameter_count, resnet18, resnet20, resnet_twin)


def _layers(model, kind):
    """Every layer of type ``kind`` in the model tree, in order."""
    found = []

    def walk(x):
        if isinstance(x, kind):
            found.append(x)
        if isinstance(x, Chain):
            for f in x:
                walk(f)
        elif isinstance(x, SkipConnection):
            walk(x.layers)
        elif isinstance(x, Parallel):
            for f in x.layers:
                walk(f)
    walk(model)
    return found


def _batch(name, n, dtype=np.float32, seed=1, shape=None):
    _, default_shape, classes = RESNETS[name]
    shape = shape or default_shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)).astype(dtype)
    labels = rng.integers(0, classes, n)
    return x, labels, fluxpy.onehotbatch(labels, range(classes)).astype(dtype)


def test_resnet20_parameters_and_shapes():
    model = resnet20(0)
    # stem 3*16*9 + BN 2*16; stage 1: 3 blocks of 2 convs 16*16*9 and 2 BNs; stages 2 and 3: the first block
    # cin*c*9 + c*c*9 + 1x1 projection cin*c, 3 BNs; two more blocks of 2*c*c*9 and 2 BNs; Dense 64*10 + 10.
    stage1 = 3 * (2 * 16 * 16 * 9 + 2 * 2 * 16)

    def stage(cin, c):
        return (cin * c * 9 + c * c * 9 + cin * c + 3 * 2 * c) + 2 * (2 * c * c * 9 + 2 * 2 * c)
    expected = 3 * 16 * 9 + 2 * 16 + stage1 + stage(16, 32) + stage(32, 64) + 64 * 10 + 10
    assert expected == RESNET20_PARAMETERS == 272_474
    assert parameter_count(model) == RESNET20_PARAMETERS

    convs = _layers(model, CrossCor)
    assert len(convs) == 19 + 2                          # 19 3x3 convs (stem + 9 blocks x 2) + 2 projections
    assert sum(c.weight.shape[2:] == (3, 3) for c in convs) == 19
    assert all(c.bias is None for c in convs)
    assert len(_layers(model, BatchNorm)) == 21
    assert len(_layers(model, SkipConnection)) == 7 and len(_layers(model, Parallel)) == 2

    x, _, _ = _batch("resnet20", 2)
    assert model[:3](x).shape == (2, 16, 32, 32)
    assert model[:4](x).shape == (2, 32, 16, 16)
    assert model[:5](x).shape == (2, 64, 8, 8)
    assert model(x).shape == (2, 10)
    assert model(x).dtype == np.float32


def test_resnet18_parameters_and_shapes():
    model = resnet18(0)
    # torchvision's resnet18 has 11,689,512 parameters: its 7x7 stem (9,408) is a 3x3 one here (1,728), and its
    # Dense 512 => 1000 (513,000) is 512 => 200 (102,600).
    assert RESNET18_PARAMETERS == 11_689_512 - 9_408 + 1_728 - 513_000 + 102_600 == 11_271_432
    assert parameter_count(model) == RESNET18_PARAMETERS
    convs = _layers(model, CrossCor)
    assert len(convs) == 17 + 3 and all(c.bias is None for c in convs)
    assert convs[0].weight.shape == (64, 3, 3, 3) and convs[0].stride == 1
    assert isinstance(model[-1], Dense) and model[-1].weight.shape == (200, 512)

    x, _, _ = _batch("resnet18", 2)
    assert model[:3](x).shape == (2, 64, 64, 64)        # no max pool: stage 1 at the full 64x64
    assert model[:6](x).shape == (2, 512, 8, 8)
    assert model(x).shape == (2, 200)


def test_basic_block_shortcuts():
    assert isinstance(basic_block(16, 16, 1, rng=0)[0], SkipConnection)
    block = basic_block(16, 32, 2, rng=0)
    assert isinstance(block[0], Parallel)
    shortcut = block[0][1]
    assert shortcut[0].weight.shape == (32, 16, 1, 1) and shortcut[0].stride == 2 and shortcut[0].bias is None
    assert block(np.ones((2, 16, 8, 8), np.float32)).shape == (2, 32, 4, 4)


@pytest.mark.parametrize("name", ["resnet20", "resnet18"])
def test_one_gradient_step(name):
    model = RESNETS[name][0](0)
    x, _, y = _batch(name, 2)
    opt = fluxpy.setup(fluxpy.Adam(1e-3), model)
    before = [np.array(p) for p in fluxpy.trainables(model)]
    mean_before = model[1].running_mean.copy()
    loss, (grad,) = fluxpy.withgradient(lambda m: fluxpy.logitcrossentropy(m(x), y), model)
    assert np.isfinite(float(loss))
    assert np.all(np.isfinite(grad["layers"][0]["weight"])) and np.any(grad["layers"][0]["weight"] != 0)
    fluxpy.update(opt, model, grad)
    after = fluxpy.trainables(model)
    assert len(after) == len(before)
    assert all(np.all(np.isfinite(p)) for p in after)
    assert sum(not np.array_equal(a, b) for a, b in zip(before, after)) == len(before)  # every parameter moved
    assert not np.array_equal(mean_before, model[1].running_mean)                      # BatchNorm tracked


def test_resnet20_loss_decreases():
    model = resnet20(0)
    x, _, y = _batch("resnet20", 4)
    opt = fluxpy.setup(fluxpy.Adam(1e-3), model)
    losses = []
    for _ in range(5):
        loss, (grad,) = fluxpy.withgradient(lambda m: fluxpy.logitcrossentropy(m(x), y), model)
        fluxpy.update(opt, model, grad)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name,n,shape", [("resnet20", 4, None), ("resnet18", 2, (3, 32, 32))])
def test_torch_twin_same_loss_float64(name, n, shape):
    torch = pytest.importorskip("torch")
    model = fluxpy.f64(RESNETS[name][0](0))
    x, labels, y = _batch(name, n, np.float64, shape=shape)   # ResNet-18 at 32x32 here: the same net, 4x cheaper
    net = resnet_twin(torch, model).train()
    assert all(p.dtype == torch.float64 for p in net.parameters())
    assert sum(p.numel() for p in net.parameters()) == parameter_count(model)
    tx, ty = torch.from_numpy(x), torch.from_numpy(labels)

    # the loss and gradients of the first step
    loss, (grad,) = fluxpy.withgradient(lambda m: fluxpy.logitcrossentropy(m(x), y), model)
    t_loss = torch.nn.functional.cross_entropy(net(tx), ty)
    t_loss.backward()
    np.testing.assert_allclose(float(loss), t_loss.item(), rtol=1e-10)
    np.testing.assert_allclose(grad["layers"][0]["weight"], net[0].weight.grad.numpy(), rtol=1e-7, atol=1e-10)
    np.testing.assert_allclose(grad["layers"][-1]["weight"], net[-1].weight.grad.numpy(), rtol=1e-7, atol=1e-10)
    np.testing.assert_allclose(grad["layers"][1]["gamma"], net[1][0].weight.grad.numpy(), rtol=1e-7, atol=1e-10)

    # one Adam step each, then the second loss; then the running statistics in test mode
    opt = fluxpy.setup(fluxpy.Adam(1e-3), model)
    fluxpy.update(opt, model, grad)
    t_opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    t_opt.step()
    t_opt.zero_grad(set_to_none=True)
    loss2 = fluxpy.withgradient(lambda m: fluxpy.logitcrossentropy(m(x), y), model)[0]
    t_loss2 = torch.nn.functional.cross_entropy(net(tx), ty)
    np.testing.assert_allclose(float(loss2), t_loss2.item(), rtol=1e-9)
    fluxpy.testmode(model)
    net.eval()
    with torch.no_grad():
        np.testing.assert_allclose(model(x), net(tx).numpy(), rtol=1e-7, atol=1e-9)


def test_torch_twin_flips_true_convolutions():
    torch = pytest.importorskip("torch")
    from fluxpy import Conv
    rng = np.random.default_rng(0)
    for layer in (Conv((3, 3), 2, 4, fluxpy.relu, pad=1, stride=2, rng=0), CrossCor((3, 3), 2, 4, pad=1, rng=0)):
        layer = fluxpy.f64(layer)
        layer.bias = rng.standard_normal(4)
        x = rng.standard_normal((2, 2, 7, 7))
        np.testing.assert_allclose(layer(x), resnet_twin(torch, layer)(torch.from_numpy(x)).detach().numpy(),
                                   rtol=1e-10, atol=1e-12)
