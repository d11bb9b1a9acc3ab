"""save/load with bad files and bad arguments: one CheckpointError naming the path and the problem, model untouched."""
import gzip
import os
import zipfile

import numpy as np
import pytest

from fluxpy.io import CheckpointError, load, save
from fluxpy.layers import BatchNorm, Chain, Dense

FORMATS = ["npz", "safetensors"]


def model(seed=0, width=3):
    return Chain(Dense(2, width, rng=seed), BatchNorm(width))


def snapshot(m):
    return [m[0].weight.copy(), m[0].bias.copy(), m[1].running_mean.copy(), m[1].running_var.copy()]


def assert_untouched(m, before):
    for a, b in zip(snapshot(m), before):
        np.testing.assert_array_equal(a, b)


def load_fails(path, match, target=None):
    """load(path) into a fresh model: a CheckpointError matching ``match`` and naming the path; the model unchanged."""
    m = model(1)
    before = snapshot(m)
    with pytest.raises(CheckpointError, match=match) as err:
        load(path, m)
    assert str(target or path) in str(err.value)
    assert isinstance(err.value, OSError) and isinstance(err.value, ValueError)
    assert_untouched(m, before)
    return err.value


@pytest.fixture
def good(tmp_path):
    """A valid checkpoint of each format: {"npz": path, "safetensors": path}."""
    m = model(0)
    m[1].running_mean[:] = [1, 2, 3]
    paths = {fmt: tmp_path / f"good.{fmt}" for fmt in FORMATS}
    for path in paths.values():
        save(path, m)
    return paths


# ---------------------------------------------------------------------------------------------
# Files that are not checkpoints


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_file(tmp_path, fmt):
    load_fails(tmp_path / f"nothing.{fmt}", "no file")


def test_missing_file_without_extension_names_both_candidates(tmp_path):
    err = load_fails(tmp_path / "nothing", r"no file .*nothing \(nor .*nothing\.npz\)")
    assert str(tmp_path / "nothing.npz") in str(err)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_folder(tmp_path, fmt):
    (tmp_path / f"dir.{fmt}").mkdir()
    load_fails(tmp_path / f"dir.{fmt}", "is a folder")


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_file(tmp_path, fmt):
    (tmp_path / f"e.{fmt}").write_bytes(b"")
    load_fails(tmp_path / f"e.{fmt}", "empty")


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_file(tmp_path, good, fmt, fraction):
    data = good[fmt].read_bytes()
    path = tmp_path / f"cut.{fmt}"
    path.write_bytes(data[:int(len(data) * fraction)])
    load_fails(path, "truncated")


@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_bytes_everywhere(tmp_path, good, fmt):
    """Corrupting any single byte gives a CheckpointError, a model-mismatch CheckpointError, or (in array data that
    safetensors does not checksum) a successful load; never another exception, and never a half-loaded model."""
    data = good[fmt].read_bytes()
    path = tmp_path / f"flip.{fmt}"
    for i in range(0, len(data), max(1, len(data) // 97)):
        corrupt = bytearray(data)
        corrupt[i] ^= 0xFF
        path.write_bytes(bytes(corrupt))
        m = model(1)
        before = snapshot(m)
        try:
            load(path, m)
        except CheckpointError as err:
            assert str(path) in str(err)
            assert_untouched(m, before)


def test_npz_crc_error_is_named(tmp_path, good):
    data = bytearray(good["npz"].read_bytes())
    with zipfile.ZipFile(good["npz"]) as zf:
        info = zf.getinfo("layers.0.weight.npy")
    data[info.header_offset + 30 + len(info.filename) + info.file_size - 1] ^= 0xFF  # the last byte of the array
    (tmp_path / "crc.npz").write_bytes(bytes(data))
    load_fails(tmp_path / "crc.npz", r"corrupt or truncated \.npz file \(BadZipFile: Bad CRC-32")


def test_garbage_npz_is_not_reported_as_pickled_data(tmp_path):
    """NumPy's own np.load says 'contains pickled data ... allow_pickle' here: misleading."""
    (tmp_path / "g.npz").write_bytes(b"this is not a checkpoint at all" * 4)
    err = load_fails(tmp_path / "g.npz", "does not start with a zip header")
    assert "pickle" not in str(err)


def test_npy_file_named_npz(tmp_path):
    with open(tmp_path / "one.npz", "wb") as f:
        np.save(f, np.ones(3))
    load_fails(tmp_path / "one.npz", r"single \.npy array")


@pytest.mark.parametrize("action", [load, save])
def test_npy_path_is_an_error(tmp_path, action):
    with pytest.raises(CheckpointError, match=r"\.npy path, which holds one array") as err:
        action(tmp_path / "m.npy", model())
    assert str(tmp_path / "m.npy") in str(err.value)
    assert not (tmp_path / "m.npy").exists() and not (tmp_path / "m.npy.npz").exists()


def test_gzip_file_named_npz(tmp_path):
    (tmp_path / "z.npz").write_bytes(gzip.compress(b"abc"))
    load_fails(tmp_path / "z.npz", "zip header")


def test_pickled_object_array(tmp_path):
    np.savez(tmp_path / "obj.npz", **{"layers.0.weight": np.array([object()], dtype=object)})
    load_fails(tmp_path / "obj.npz", "pickled Python objects")


def test_zip_with_a_foreign_entry(tmp_path):
    with zipfile.ZipFile(tmp_path / "foreign.npz", "w") as zf:
        zf.writestr("readme.txt", "hello")
    load_fails(tmp_path / "foreign.npz", "not a .npy array")


def test_each_format_under_the_other_name(tmp_path, good):
    (tmp_path / "st.npz").write_bytes(good["safetensors"].read_bytes())
    load_fails(tmp_path / "st.npz", "looks like a .safetensors file")
    (tmp_path / "zip.safetensors").write_bytes(good["npz"].read_bytes())
    load_fails(tmp_path / "zip.safetensors", r"looks like a \.npz")


def test_safetensors_bad_header(tmp_path, good):
    data = good["safetensors"].read_bytes()
    n = int.from_bytes(data[:8], "little")
    (tmp_path / "json.safetensors").write_bytes(data[:8] + b"!" + data[9:])
    load_fails(tmp_path / "json.safetensors", "header is not JSON")
    (tmp_path / "huge.safetensors").write_bytes((10 ** 12).to_bytes(8, "little") + data[8:])
    load_fails(tmp_path / "huge.safetensors", "header length says")
    (tmp_path / "short.safetensors").write_bytes(data[:5])
    load_fails(tmp_path / "short.safetensors", "fewer than the 8")
    (tmp_path / "list.safetensors").write_bytes((2).to_bytes(8, "little") + b"[]" + data[8 + n:])
    load_fails(tmp_path / "list.safetensors", "not a JSON object")


def test_safetensors_from_a_newer_fluxpy(tmp_path):
    from safetensors.numpy import save_file
    m = model()
    from fluxpy.io import flat_state
    save_file(dict(flat_state(m)), str(tmp_path / "new.safetensors"),
              metadata={"format": "fluxpy", "fluxpy_format_version": "99"})
    load_fails(tmp_path / "new.safetensors", "format 99")


def test_safetensors_from_elsewhere_loads_when_it_fits(tmp_path):
    """A file written by another program (no fluxpy metadata) is fine if its keys and shapes fit."""
    from safetensors.numpy import save_file

    from fluxpy.io import flat_state
    source = model(0)
    save_file({k: np.ascontiguousarray(v) for k, v in flat_state(source).items()}, str(tmp_path / "x.safetensors"))
    m = load(tmp_path / "x.safetensors", model(1))
    np.testing.assert_array_equal(m[0].weight, source[0].weight)


# ---------------------------------------------------------------------------------------------
# Files that do not fit the model


@pytest.mark.parametrize("fmt", FORMATS)
def test_shape_mismatch_loads_nothing(good, fmt):
    m = model(1, width=4)
    before = [m[0].weight.copy(), m[1].running_mean.copy()]
    with pytest.raises(CheckpointError, match=r"layers\.0\.weight has shape \(4, 2\) in the model but \(3, 2\)") as err:
        load(good[fmt], m)
    assert "nothing was loaded" in str(err.value) and str(good[fmt]) in str(err.value)
    np.testing.assert_array_equal(m[0].weight, before[0])
    np.testing.assert_array_equal(m[1].running_mean, before[1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_late_mismatch_still_loads_nothing(tmp_path, fmt):
    """Only the LAST array differs: the earlier ones must not have been copied."""
    save(tmp_path / f"m.{fmt}", {"a": np.ones(2), "b": np.ones(2), "z": np.ones(3)})
    target = {"a": np.zeros(2), "b": np.zeros(2), "z": np.zeros(4)}
    with pytest.raises(CheckpointError, match=r"z has shape \(4,\) in the model but \(3,\)"):
        load(tmp_path / f"m.{fmt}", target)
    assert target["a"].tolist() == [0, 0] and target["b"].tolist() == [0, 0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_extra_and_missing_keys_load_nothing(tmp_path, fmt):
    save(tmp_path / f"m.{fmt}", {"a": np.ones(2), "extra": np.ones(1)})
    target = {"a": np.zeros(2), "b": np.zeros(2)}
    with pytest.raises(CheckpointError, match=r"missing from the file: b; not in the model: extra; nothing was loaded"):
        load(tmp_path / f"m.{fmt}", target)
    assert target["a"].tolist() == [0, 0]


def test_many_missing_keys_are_listed_briefly(tmp_path):
    save(tmp_path / "m.npz", {"a": np.ones(1)})
    target = {"a": np.zeros(1), **{f"k{i}": np.zeros(1) for i in range(1000)}}
    with pytest.raises(CheckpointError, match=r"and 992 more") as err:
        load(tmp_path / "m.npz", target)
    assert len(str(err.value)) < 500


@pytest.mark.parametrize("fmt", FORMATS)
def test_dtype_that_does_not_cast(tmp_path, fmt):
    save(tmp_path / f"f.{fmt}", {"w": np.array([1.5, 2.5])})
    target = {"w": np.zeros(2, np.int64)}
    with pytest.raises(CheckpointError, match=r"w is int64 in the model but float64 in the file"):
        load(tmp_path / f"f.{fmt}", target)
    assert target["w"].tolist() == [0, 0]


# ---------------------------------------------------------------------------------------------
# Bad arguments to save and load


@pytest.mark.parametrize("action", [load, save])
def test_arguments_swapped(tmp_path, action):
    with pytest.raises(TypeError, match=rf"{action.__name__} expects a file path .* got Chain \(the model\?"):
        action(model(), tmp_path / "m.npz")


@pytest.mark.parametrize("action", [load, save])
def test_empty_path(action):
    with pytest.raises(ValueError, match="empty string"):
        action("", model())


def test_save_into_a_missing_folder_creates_nothing(tmp_path):
    with pytest.raises(CheckpointError, match=r"cannot write .*m\.npz: the folder .*absent does not exist"):
        save(tmp_path / "absent" / "m.npz", model())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_over_a_folder(tmp_path, fmt):
    (tmp_path / f"d.{fmt}").mkdir()
    with pytest.raises(CheckpointError, match="is a folder") as err:
        save(tmp_path / f"d.{fmt}", model())
    assert str(tmp_path / f"d.{fmt}") in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == [f"d.{fmt}"]  # no temporary file left


def test_save_a_model_without_arrays(tmp_path):
    with pytest.raises(ValueError, match="at least one array, got a str with none"):
        save(tmp_path / "m.npz", "not a model")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_object_arrays(tmp_path, fmt):
    with pytest.raises(CheckpointError, match=rf"w is an array of dtype object, which .*m\.{fmt} cannot store"):
        save(tmp_path / f"m.{fmt}", {"w": np.array([None, 1], dtype=object)})
    assert list(tmp_path.iterdir()) == []


def test_save_dtype_safetensors_cannot_store(tmp_path):
    with pytest.raises(CheckpointError, match=r"dtype complex128, which .*cannot store"):
        save(tmp_path / "m.safetensors", {"w": np.ones(2, np.complex128)})
    save(tmp_path / "m.npz", {"w": np.ones(2, np.complex128)})  # .npz stores any non-object dtype


def test_keys_that_clash_when_flattened(tmp_path):
    with pytest.raises(ValueError, match="flatten to the key 'a.b'"):
        save(tmp_path / "m.npz", {"a.b": np.ones(1), "a": {"b": np.ones(1)}})


def test_npz_keys_named_like_numpy_keywords(tmp_path):
    """numpy.savez(file, **arrays) cannot take a key named 'file' or 'allow_pickle': fluxpy writes the zip itself."""
    m = {"file": np.ones(1), "allow_pickle": np.ones(2)}
    save(tmp_path / "m.npz", m)
    with np.load(tmp_path / "m.npz") as f:
        assert sorted(f.files) == ["allow_pickle", "file"]


def test_unreadable_file(tmp_path, good):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    os.chmod(good["npz"], 0)
    load_fails(good["npz"], "cannot read")
