"""torchvision's ResNets through ``fluxpy.from_torch`` (BasicBlock, Bottleneck, ResNeXt's groups), in float64 against
PyTorch itself: the same outputs in evaluation, the same loss, gradients and running statistics in a training step,
the same weights after an SGD step, and the weights back in torchvision's model through ``to_torch_state``. A class
that only shares torchvision's names is refused. Needs torch and torchvision (CI installs both)."""
import copy

import numpy as np
import pytest

import fluxpy

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

NETS = {"resnet18": torchvision.models.resnet18, "resnet50": torchvision.models.resnet50,
        "resnext50_32x4d": torchvision.models.resnext50_32x4d}


def _pair(name, seed=0):
    torch.manual_seed(seed)
    net = NETS[name](weights=None, num_classes=5).double()
    with torch.no_grad():   # running statistics and BatchNorm parameters away from their defaults
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return net, fluxpy.from_torch(net)


def _batch(seed=1, n=3, size=32):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 3, size, size)), rng.integers(0, 5, n)


@pytest.mark.parametrize("name", sorted(NETS))
def test_evaluation_outputs_equal_pytorch_s(name):
    net, model = _pair(name)
    x, _ = _batch()
    with torch.no_grad():
        expected = net.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model(x), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_a_training_step_equals_pytorch_s(name):
    net, model = _pair(name, seed=2)
    x, labels = _batch(seed=3)
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(labels))
    opt.zero_grad()
    loss.backward()
    y = fluxpy.onehotbatch(labels, range(5)).astype(np.float64)
    value, (grad,) = fluxpy.withgradient(lambda m: fluxpy.logitcrossentropy(m(x), y), model)
    assert float(value) == pytest.approx(loss.item(), rel=1e-10)   # float64 through 50 layers, summed otherwise
    for got, ref in ((grad["layers"][0]["weight"], net.conv1.weight.grad), (grad["layers"][-1]["weight"],
                                                                              net.fc.weight.grad)):
        ref = ref.numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-8, atol=1e-9 * np.abs(ref).max())
    opt.step()
    fluxpy.update(fluxpy.setup(fluxpy.Descent(0.1), model), model, grad)
    state = fluxpy.to_torch_state(model, like=net.state_dict())
    for key, value in net.state_dict().items():   # weights after the step, and the moved running statistics
        if key.endswith("num_batches_tracked"):
            continue
        ref = value.numpy()
        np.testing.assert_allclose(state[key], ref, rtol=1e-7, atol=1e-9 * max(1.0, np.abs(ref).max()), err_msg=key)


def test_weights_go_back_into_torchvision_s_model():
    net, model = _pair("resnet18", seed=4)
    model = fluxpy.fmap(lambda a: a * 1.5 if isinstance(a, np.ndarray) and a.ndim == 4 else a, model)
    fresh = torchvision.models.resnet18(weights=None, num_classes=5).double().eval()
    state = fluxpy.to_torch_state(model, like=fresh.state_dict())
    missing, unexpected = fresh.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v))
                                                 for k, v in state.items()}, strict=False)
    assert unexpected == [] and all(k.endswith("num_batches_tracked") for k in missing)
    x, _ = _batch(seed=5)
    with torch.no_grad():
        expected = fresh(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model(x), expected, rtol=1e-10, atol=1e-12)


def test_a_block_of_another_package_with_torchvision_s_names_is_refused():
    block = copy.deepcopy(torchvision.models.resnet18(weights=None).layer1[0])
    mine = type("BasicBlock", (torch.nn.Module,), {"__module__": "my_models", "forward": lambda self, x: x})()
    mine.__dict__.update({k: v for k, v in block.__dict__.items() if k.startswith("_modules")})
    with pytest.raises(TypeError, match=r"from_torch: no fluxpy twin for BasicBlock at <root> \(a BasicBlock of "
                                        r"my_models: only torchvision's converts"):
        fluxpy.from_torch(mine)
