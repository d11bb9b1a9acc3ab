"""save/load: bitwise round trips in both formats (.npz, .safetensors), key layout and mismatch errors.

Corrupt files and bad arguments: tests/test_checkpoint_errors.py; atomic and concurrent saves:
tests/test_checkpoint_atomic.py."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy.io import CheckpointError, flat_state, load, save
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


FORMATS = ["npz", "safetensors"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_roundtrip_is_bitwise(tmp_path, fmt):
    model = make_model(0)
    model[1].running_mean[:] = np.random.default_rng(1).standard_normal(4)
    path = tmp_path / f"model.{fmt}"
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


@pytest.mark.parametrize("fmt", FORMATS)
def test_batchnorm_running_stats_roundtrip(tmp_path, fmt):
    """Running statistics are state, not trainables: they must be saved and restored too."""
    model = Chain(Dense(3, 4), BatchNorm(4))
    x = np.random.default_rng(0).standard_normal((16, 3)).astype(np.float32)
    for _ in range(3):
        fluxpy.gradient(lambda m: m(x).sum(), model)  # trains the running statistics
    assert not np.allclose(model[1].running_mean, 0) and not np.allclose(model[1].running_var, 1)
    save(tmp_path / f"bn.{fmt}", model)
    fresh = load(tmp_path / f"bn.{fmt}", Chain(Dense(3, 4), BatchNorm(4)))
    np.testing.assert_array_equal(fresh[1].running_mean, model[1].running_mean)
    np.testing.assert_array_equal(fresh[1].running_var, model[1].running_var)
    np.testing.assert_array_equal(fluxpy.testmode(fresh)(x), fluxpy.testmode(model)(x))


def test_safetensors_file_is_standard(tmp_path):
    """A .safetensors checkpoint is an ordinary safetensors file, with fluxpy's format version in its metadata."""
    from safetensors import safe_open
    model = make_model(0)
    save(tmp_path / "m.safetensors", model)
    with safe_open(str(tmp_path / "m.safetensors"), framework="np") as f:
        assert sorted(f.keys()) == sorted(flat_state(model))
        assert f.metadata() == {"format": "fluxpy", "fluxpy_format_version": "1"}
        np.testing.assert_array_equal(f.get_tensor("layers.0.weight"), model[0].weight)


def test_format_follows_the_extension(tmp_path):
    save(tmp_path / "a.safetensors", make_model(0))
    save(tmp_path / "b.npz", make_model(0))
    assert (tmp_path / "a.safetensors").read_bytes()[8:9] == b"{"
    assert (tmp_path / "b.npz").read_bytes()[:2] == b"PK"
    save(tmp_path / "c.SafeTensors", make_model(0))  # case-insensitive
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.npz", "c.SafeTensors"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_and_scalar_arrays(tmp_path, fmt):
    """safetensors reads raw memory: a transposed view and a 0-d array must still round-trip exactly."""
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    model = {"t": base.T, "s": np.array(2.5), "i": np.arange(3, dtype=np.int64), "b": np.array([True, False])}
    save(tmp_path / f"m.{fmt}", model)
    fresh = {"t": np.zeros((4, 3), np.float32), "s": np.array(0.0), "i": np.zeros(3, np.int64),
             "b": np.zeros(2, bool)}
    load(tmp_path / f"m.{fmt}", fresh)
    for key in model:
        np.testing.assert_array_equal(fresh[key], model[key])
        assert fresh[key].shape == model[key].shape


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
    save(tmp_path / "model.v2", make_model(0))  # an unknown extension: .npz is added
    assert (tmp_path / "model.v2.npz").exists()


def test_shape_mismatch_names_the_key(tmp_path):
    save(tmp_path / "m.npz", Chain(Dense(2, 3), Dense(3, 1)))
    with pytest.raises(CheckpointError) as err:
        load(tmp_path / "m.npz", Chain(Dense(2, 3), Dense(4, 1)))
    assert str(err.value) == (f"load: {tmp_path / 'm.npz'} does not fit the model: layers.1.weight has shape (1, 4) "
                              "in the model but (1, 3) in the file; nothing was loaded")
    assert isinstance(err.value, ValueError) and err.value.path == tmp_path / "m.npz"


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_and_unexpected_keys_are_named(tmp_path, fmt):
    path = tmp_path / f"m.{fmt}"
    save(path, Chain(Dense(2, 3), Dense(3, 1)))
    with pytest.raises(CheckpointError, match=r"missing from the file: layers\.2\.weight, layers\.2\.bias"):
        load(path, Chain(Dense(2, 3), Dense(3, 1), Dense(1, 1)))
    with pytest.raises(CheckpointError, match=r"not in the model: layers\.1\.(weight|bias), layers\.1\.(weight|bias)"):
        load(path, Chain(Dense(2, 3)))


def test_float64_model_roundtrip(tmp_path):
    model = fluxpy.layers.f64(make_model(0))
    save(tmp_path / "m.npz", model)
    fresh = fluxpy.layers.f64(make_model(3))
    load(tmp_path / "m.npz", fresh)
    assert fresh[0].weight.dtype == np.float64
    assert fresh[0].weight.tobytes() == model[0].weight.tobytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_cast_to_the_model_dtype(tmp_path, fmt):
    save(tmp_path / f"m.{fmt}", {"w": np.array([1.5, 2.5])})
    fresh = {"w": np.zeros(2, np.float32)}
    load(tmp_path / f"m.{fmt}", fresh)
    assert fresh["w"].dtype == np.float32 and fresh["w"].tolist() == [1.5, 2.5]


def test_trained_model_roundtrip(tmp_path):
    from fluxpy.optimise import Adam, setup, update
    model = Chain(Dense(2, 3, relu), Dense(3, 1))
    opt = setup(Adam(0.1), model)
    x = np.ones((4, 2), np.float32)
    for _ in range(3):
        g, = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), model)
        update(opt, model, g)
    for fmt in FORMATS:
        save(tmp_path / f"m.{fmt}", model)
        fresh = load(tmp_path / f"m.{fmt}", Chain(Dense(2, 3, relu), Dense(3, 1)))
        np.testing.assert_array_equal(fresh(x), model(x))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_model_roundtrip(tmp_path, fmt):
    import cupy
    model = fluxpy.gpu(make_model(0))
    path = tmp_path / f"m.{fmt}"
    save(path, model)
    if fmt == "npz":
        with np.load(path) as f:
            assert isinstance(f["layers.0.weight"], np.ndarray)
    fresh = fluxpy.gpu(make_model(1))
    load(path, fresh)
    assert isinstance(fresh[0].weight, cupy.ndarray)
    assert cupy.asnumpy(fresh[0].weight).tobytes() == cupy.asnumpy(model[0].weight).tobytes()
    assert cupy.asnumpy(fresh[1].running_var).tobytes() == cupy.asnumpy(model[1].running_var).tobytes()
    cpu_model = load(path, make_model(2))
    assert cpu_model[0].weight.tobytes() == cupy.asnumpy(model[0].weight).tobytes()


DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64", "complex64", "bfloat16", "float8_e4m3fn", "float8_e5m2"]


def _dtype(name):
    import ml_dtypes
    return np.dtype(getattr(ml_dtypes, name, None) or name)


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
@given(names=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=5),
       shape=st.lists(st.integers(0, 4), max_size=3), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_dtype_round_trips_bit_for_bit(tmp_path, fmt, names, shape, seed):
    """Every dtype a model may hold, the halves and ml_dtypes' float8s included, in both formats, bit for bit."""
    rng = np.random.default_rng(seed)
    model = {}
    for i, name in enumerate(names):
        bits = rng.integers(0, 256, size=int(np.prod(shape)) * _dtype(name).itemsize, dtype=np.uint8)
        model[f"a{i}"] = bits.view(_dtype(name)).reshape(shape)
    path = tmp_path / f"m.{fmt}"
    save(path, model)
    fresh = {k: np.zeros_like(v) for k, v in model.items()}
    load(path, fresh)
    for k, v in model.items():
        assert fresh[k].dtype == v.dtype and fresh[k].tobytes() == v.tobytes(), k


def test_bfloat16_safetensors_say_bf16_and_a_float32_model_loads_them(tmp_path):
    import json
    import struct

    import ml_dtypes
    w = np.array([[1.5, -2.0], [0.0078125, 3e38]], ml_dtypes.bfloat16)
    save(tmp_path / "m.safetensors", {"w": w})
    data = (tmp_path / "m.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0 and json.loads(data[8:8 + n])["w"]["dtype"] == "BF16"
    into = {"w": np.zeros((2, 2), np.float32)}
    load(tmp_path / "m.safetensors", into)
    np.testing.assert_array_equal(into["w"], w.astype(np.float32))


def test_a_corrupt_dtype_manifest_is_named(tmp_path):
    import zipfile

    import ml_dtypes
    save(tmp_path / "m.npz", {"w": np.ones(3, ml_dtypes.bfloat16)})
    with zipfile.ZipFile(tmp_path / "m.npz", "a") as zf:
        zf.writestr("__fluxpy_dtypes__.json", '{"w": "float128"}')   # a second, bad manifest wins on read
    with pytest.raises(CheckpointError, match="__fluxpy_dtypes__.json"):
        load(tmp_path / "m.npz", {"w": np.zeros(3, ml_dtypes.bfloat16)})
