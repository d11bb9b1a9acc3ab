"""Key paths: ``trainables(model, path=True)`` and ``arrays(model, path=True)`` name each array by the dotted path
that ``fluxpy.save`` keys it by (PyTorch's ``named_parameters``/``named_buffers``, Flux's ``trainables(m;
path=true)``), and ``fmap_with_path`` maps leaves knowing where they sit."""
import numpy as np
import pytest

import fluxpy
from fluxpy import BatchNorm, Chain, Conv, Dense, fmap_with_path, trainables
from fluxpy.functors import arrays
from fluxpy.io import flat_state


def _model():
    shared = Dense(4, 4, rng=1)
    return Chain(Conv((3, 3), 1, 4, pad=1, rng=0), BatchNorm(4), fluxpy.flatten,
                 Chain(shared, shared, Dense(4, 2, rng=2)))


def test_each_array_comes_once_under_the_key_save_gives_it():
    model = _model()
    keyed = flat_state(model)
    for named, plain in ((trainables(model, path=True), trainables(model)),
                         (arrays(model, path=True), arrays(model))):
        assert len(named) == len(plain) and all(x is y for (_, x), y in zip(named, plain))
        for path, a in named:
            assert keyed[path] is a
    paths = [p for p, _ in trainables(model, path=True)]
    assert paths[:4] == ["layers.0.weight", "layers.0.bias", "layers.1.gamma", "layers.1.beta"]
    assert "layers.3.layers.1.weight" not in paths   # the tied Dense comes once, under its first path
    assert {p for p, _ in arrays(model, path=True)} - set(paths) == {"layers.1.running_mean", "layers.1.running_var"}


def test_fmap_with_path_sees_every_leaf_with_its_path_and_keeps_ties():
    model = _model()
    seen = []

    def f(path, leaf):
        seen.append(path)
        return leaf + 1 if isinstance(leaf, np.ndarray) and path.endswith("bias") else leaf
    new = fmap_with_path(f, model)
    assert new is not model and new.layers[3].layers[0] is new.layers[3].layers[1]
    np.testing.assert_array_equal(new.layers[0].bias, model.layers[0].bias + 1)   # the original is untouched
    np.testing.assert_array_equal(new.layers[3].layers[2].bias, model.layers[3].layers[2].bias + 1)
    assert new.layers[0].weight is model.layers[0].weight
    assert "layers.0.weight" in seen and "layers.2" in seen   # flatten, a function leaf, under its index
    assert seen.count("layers.3.layers.0.weight") == 1 and "layers.3.layers.1.weight" not in seen


def test_paths_are_the_fluxpy_side_of_the_pytorch_key_map():
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 5 * 5, 3))
    model = fluxpy.from_torch(net)
    key_map = fluxpy.load_torch_state(model, net.state_dict())
    named = dict(arrays(model, path=True))
    assert set(key_map.values()) == set(named)
    assert len(trainables(model, path=True)) == len(list(net.named_parameters()))
