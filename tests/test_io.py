"""save/load: bitwise round trips, key layout and mismatch errors."""
import numpy as np
import pytest

import fluxpy
from fluxpy.io import flat_state, load, save
from fluxpy.layers import BatchNorm, Chain, Conv, Dense, Embedding, MaxPool, flatten
from fluxpy.ops.activations import relu


def make_model(seed):
    rng = np.random.default_rng(seed)
    return Chain(Conv((3, 3), 1, 4, relu, pad=1, rng=rng), BatchNorm(4), MaxPool((2, 2)), flatten,
                 Dense(4 * 4 * 4, 3, rng=rng), Embedding(3, 2, rng=rng))


def arrays_of(model):
    return flat_state(model)


def test_flat_keys():
    keys = sorted(flat_state(make_model(0)))
    assert keys == ["layers.0.bias", "layers.0.weight", "layers.1.beta", "layers.1.gamma", "layers.1.running_mean",
                    "layers.1.running_var", "layers.4.bias", "layers.4.weight", "layers.5.weight"]


def test_roundtrip_is_bitwise(tmp_path):
    model = make_model(0)
    model[1].running_mean[:] = np.random.default_rng(1).standard_normal(4)
    path = tmp_path / "model.npz"
    save(path, model)
    fresh = make_model(1)
    assert not np.array_equal(fresh[0].weight, model[0].weight)
    out = load(path, fresh)
    assert out is fresh
    for key, a in arrays_of(model).items():
        b = arrays_of(fresh)[key]
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), key
    x = np.random.default_rng(2).random((2, 1, 8, 8), dtype=np.float32)
    np.testing.assert_array_equal(model[:5](x), fresh[:5](x))


def test_load_is_in_place(tmp_path):
    model, fresh = make_model(0), make_model(1)
    weight = fresh[0].weight
    save(tmp_path / "m.npz", model)
    load(tmp_path / "m.npz", fresh)
    assert fresh[0].weight is weight


def test_suffix_added_like_numpy(tmp_path):
    save(tmp_path / "model", make_model(0))
    assert (tmp_path / "model.npz").exists()
    load(tmp_path / "model", make_model(1))


def test_shape_mismatch_names_the_key(tmp_path):
    save(tmp_path / "m.npz", Chain(Dense(2, 3), Dense(3, 1)))
    with pytest.raises(ValueError) as err:
        load(tmp_path / "m.npz", Chain(Dense(2, 4), Dense(4, 1)))
    assert str(err.value) == f"load: layers.0.weight has shape (4, 2) in the model but (3, 2) in {tmp_path / 'm.npz'}"


def test_missing_and_unexpected_keys_are_named(tmp_path):
    save(tmp_path / "m.npz", Chain(Dense(2, 3), Dense(3, 1)))
    with pytest.raises(ValueError, match=r"missing from the file: layers\.2\.weight, layers\.2\.bias"):
        load(tmp_path / "m.npz", Chain(Dense(2, 3), Dense(3, 1), Dense(1, 1)))
    with pytest.raises(ValueError, match=r"not in the model: layers\.1\.weight, layers\.1\.bias"):
        load(tmp_path / "m.npz", Chain(Dense(2, 3)))


def test_float64_model_roundtrip(tmp_path):
    model = fluxpy.layers.f64(make_model(0))
    save(tmp_path / "m.npz", model)
    fresh = fluxpy.layers.f64(make_model(3))
    load(tmp_path / "m.npz", fresh)
    assert fresh[0].weight.dtype == np.float64
    assert fresh[0].weight.tobytes() == model[0].weight.tobytes()


def test_trained_model_roundtrip(tmp_path):
    from fluxpy.optimise import Adam, setup, update
    model = Chain(Dense(2, 3, relu), Dense(3, 1))
    opt = setup(Adam(0.1), model)
    x = np.ones((4, 2), np.float32)
    for _ in range(3):
        g, = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), model)
        update(opt, model, g)
    save(tmp_path / "m.npz", model)
    fresh = load(tmp_path / "m.npz", Chain(Dense(2, 3, relu), Dense(3, 1)))
    np.testing.assert_array_equal(fresh(x), model(x))


@pytest.mark.gpu
def test_gpu_model_roundtrip(tmp_path):
    import cupy
    model = fluxpy.gpu(make_model(0))
    save(tmp_path / "m.npz", model)
    with np.load(tmp_path / "m.npz") as f:
        assert isinstance(f["layers.0.weight"], np.ndarray)
    fresh = fluxpy.gpu(make_model(1))
    load(tmp_path / "m.npz", fresh)
    assert isinstance(fresh[0].weight, cupy.ndarray)
    assert cupy.asnumpy(fresh[0].weight).tobytes() == cupy.asnumpy(model[0].weight).tobytes()
    cpu_model = load(tmp_path / "m.npz", make_model(2))
    assert cpu_model[0].weight.tobytes() == cupy.asnumpy(model[0].weight).tobytes()
