"""Model trees: children, fmap, trainables, state/loadstate."""
import numpy as np
import pytest

import fluxpy
from fluxpy import fmap, layer, loadstate, state, trainables
from fluxpy.functors import children


@layer(trainable=("weight", "bias"))
class Norm:
    def __init__(self, n):
        self.weight = np.ones(n, np.float32)
        self.bias = np.zeros(n, np.float32) + 0.5
        self.running = np.full(n, 2.0, np.float32)
        self.eps = 1e-5


class Block:
    def __init__(self):
        self.norm = Norm(3)
        self.layers = (np.arange(6.0).reshape(2, 3), [Norm(2)])
        self.act = np.tanh
        self._cache = {"private": 1}


def test_children_of_containers_and_objects():
    assert children([1, 2]) == [(0, 1), (1, 2)]
    assert [k for k, _ in children(Block())] == ["norm", "layers", "act"]
    assert children(np.tanh) is None and children(np.ones(2)) is None and children(3.0) is None


def test_fmap_rebuilds_without_touching_the_original():
    b = Block()
    doubled = fmap(lambda a: a * 2 if isinstance(a, np.ndarray) else a, b)
    assert type(doubled) is Block and doubled is not b
    np.testing.assert_array_equal(doubled.norm.bias, 2 * b.norm.bias)
    np.testing.assert_array_equal(b.norm.bias, np.full(3, 0.5, np.float32))
    assert doubled.act is np.tanh and doubled.norm.eps == 1e-5


def test_fmap_keeps_shared_leaves_shared():
    w = np.ones(2)
    out = fmap(lambda a: a + 1 if isinstance(a, np.ndarray) else a, {"a": w, "b": w})
    assert out["a"] is out["b"]


def test_trainables_respect_the_layer_declaration():
    b = Block()
    names = [a.shape for a in trainables(b)]
    # Norm(3).weight, .bias, the float matrix, Norm(2).weight, .bias; running stats are not trainable
    assert names == [(3,), (3,), (2, 3), (2,), (2,)]


def test_state_round_trip_and_errors():
    b, c = Block(), Block()
    c.norm.running[:] = 7.0
    c.layers[1][0].bias[:] = -1.0
    loadstate(b, state(c))
    np.testing.assert_array_equal(b.norm.running, np.full(3, 7.0, np.float32))
    np.testing.assert_array_equal(b.layers[1][0].bias, np.full(2, -1.0, np.float32))
    bad = state(Block())
    bad["layers"][0] = np.ones((3, 3))
    with pytest.raises(ValueError, match=r"model.layers\[0\] expects shape \(2, 3\), got \(3, 3\)"):
        loadstate(b, bad)
    missing = state(Block())
    del missing["norm"]["running"]
    with pytest.raises(ValueError, match=r"model.norm.running is missing"):
        loadstate(b, missing)


def test_gradient_of_a_layer_tree():
    b = Block()
    x = np.ones(3)
    g, = fluxpy.gradient(lambda m: (m.act(m.norm.weight * x + m.norm.bias) * m.layers[0]).sum(), b)
    assert set(g) == {"norm", "layers", "act"}
    assert g["norm"]["running"] is None and g["norm"]["eps"] is None and g["act"] is None
    assert g["layers"][1] == [{"weight": None, "bias": None, "running": None, "eps": None}]  # mirrors the tree
    assert g["norm"]["weight"].dtype == np.float32


def test_fmap_and_fmapstructure_over_every_kind_of_node():
    """The walks' shortcuts (declared children, a layer declaring none, plain tuples) give what the general path
    gives: copies with the leaves mapped, shared nodes shared, gradients shaped as dicts of the declared fields."""
    from collections import namedtuple
    from fluxpy.functors import fmapstructure

    @layer(children=())
    class Fixed:
        def __init__(self):
            self.k = 3

    @layer(children=("w", "b"))
    class Lin:
        def __init__(self, rng):
            self.w, self.b, self.note = rng.standard_normal(2), rng.standard_normal(1), "kept"

    Pair = namedtuple("Pair", "a c")
    rng = np.random.default_rng(7)
    lin, fixed = Lin(rng), Fixed()
    tree = {"t": (lin, fixed, lin), "p": Pair(np.arange(2.0), [lin.w])}
    out = fmap(lambda v: v * 2 if isinstance(v, np.ndarray) else v, tree)
    a, f2, a2 = out["t"]
    assert a is a2 and a is not lin and a.note == "kept" and f2 is not fixed and f2.k == 3
    np.testing.assert_array_equal(a.w, lin.w * 2)
    assert out["p"].c[0] is a.w and type(out["p"]) is Pair
    shaped = fmapstructure(lambda v: v.shape if isinstance(v, np.ndarray) else None, tree)
    assert shaped == {"t": ({"w": (2,), "b": (1,)}, {}, {"w": (2,), "b": (1,)}), "p": Pair((2,), [(2,)])}
