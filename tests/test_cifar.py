"""CIFAR-10 files (fluxpy/datasets/cifar.py) in the real binary format, made here: reading, writing, the folder and
.tar.gz layouts, every error, downloads through a monkeypatched network; and examples/cifar_resnet.py end to end
on a tiny stand-in folder, on the CPU. Never the real network."""
import hashlib
import importlib.util
import io
import os
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy.datasets.cifar as cifar
from fluxpy.options import options
from fluxpy.datasets.cifar import (CIFAR10_FILES, CIFAR10_FOLDER, CIFARUnavailableError, cifar_cache_dir,
                                   extract_batches, load_cifar10, read_cifar_batch, write_cifar_batch)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cifar_resnet.py"


def make_batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3, 32, 32)).astype(np.uint8), rng.integers(0, 10, n)


def write_split(folder, split, n, seed=0):
    """The files of ``split`` in ``folder``, ``n`` records each; returns the images and labels, concatenated."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = [make_batch(n, seed + i) for i in range(len(CIFAR10_FILES[split]))]
    for name, (images, labels) in zip(CIFAR10_FILES[split], parts):
        write_cifar_batch(folder / name, images, labels)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def records(images, labels):
    """The bytes of a batch file, built independently of write_cifar_batch: label byte, then the pixels."""
    return np.concatenate([labels.astype(np.uint8)[:, None], images.reshape(len(images), -1)], axis=1).tobytes()


def archive_bytes(members):
    """A .tar.gz holding ``members``: name -> bytes (or a TarInfo, for links)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, payload in members.items():
            if isinstance(payload, tarfile.TarInfo):
                tar.addfile(payload)
                continue
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


def official_members(n=3, prefix=""):
    """Every batch file of both splits as archive members (``prefix`` before the folder), and the arrays they hold."""
    members, arrays = {}, {}
    for seed, name in enumerate(CIFAR10_FILES["train"] + CIFAR10_FILES["test"]):
        arrays[name] = make_batch(n, seed)
        members[f"{prefix}{CIFAR10_FOLDER}/{name}"] = records(*arrays[name])
    return members, arrays


class FakeResponse(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------------
# One batch file


@given(n=st.integers(1, 5), seed=st.integers(0, 2 ** 16))
def test_write_read_round_trip_in_the_official_layout(n, seed, tmp_path_factory):
    images, labels = make_batch(n, seed)
    path = tmp_path_factory.mktemp("batch") / "data_batch_1.bin"
    write_cifar_batch(path, images, labels)
    raw = path.read_bytes()
    assert raw == records(images, labels) and len(raw) == n * 3073
    k = n - 1  # record k: its label byte, then the red plane row by row, then green, then blue
    assert raw[k * 3073] == labels[k]
    assert raw[k * 3073 + 1 + 1024 + 5 * 32 + 7] == images[k, 1, 5, 7]
    back_images, back_labels = read_cifar_batch(path)
    assert back_images.dtype == np.uint8 and back_labels.dtype == np.int64
    np.testing.assert_array_equal(back_images, images)
    np.testing.assert_array_equal(back_labels, labels)


def test_read_errors_name_the_file_and_what_was_found(tmp_path):
    images, labels = make_batch(2)
    path = tmp_path / "data_batch_1.bin"
    raw = records(images, labels)

    path.write_bytes(raw[:-10])
    with pytest.raises(ValueError, match=r"data_batch_1.bin has 6136 bytes, not a whole number of 3073-byte records"
                                         r".*1 whole record and 3063 bytes of a truncated one"):
        read_cifar_batch(path)

    path.write_bytes(raw[:3073] + bytes([10]) + raw[3074:])
    with pytest.raises(ValueError, match=r"data_batch_1.bin record 1 \(counting from 0\) has label 10; expected a "
                                         r"class index 0..9"):
        read_cifar_batch(path)

    path.write_bytes(b"")
    with pytest.raises(ValueError, match="data_batch_1.bin is empty; expected 3073-byte records"):
        read_cifar_batch(path)

    with pytest.raises(FileNotFoundError, match="test_batch.bin does not exist; expected a CIFAR-10 binary batch"):
        read_cifar_batch(tmp_path / "test_batch.bin")
    with pytest.raises(FileNotFoundError, match="is a folder"):
        read_cifar_batch(tmp_path)


def test_write_checks_its_input(tmp_path):
    images, labels = make_batch(2)
    path = tmp_path / "b.bin"
    with pytest.raises(ValueError, match=r"expects images of shape \(N, 3, 32, 32\) uint8, got .* float32"):
        write_cifar_batch(path, images.astype(np.float32), labels)
    with pytest.raises(ValueError, match=r"expects 2 integer labels \(one per image\), got .* \(3,\)"):
        write_cifar_batch(path, images, [1, 2, 3])
    with pytest.raises(ValueError, match="expects labels in 0..9, got values from 1 to 10"):
        write_cifar_batch(path, images, [1, 10])
    assert not path.exists()


# ---------------------------------------------------------------------------------------------
# A split from a folder


@pytest.mark.parametrize("layout", ["extracted", "flat"])
def test_load_from_a_folder(tmp_path, layout):
    where = tmp_path / CIFAR10_FOLDER if layout == "extracted" else tmp_path
    train_images, train_labels = write_split(where, "train", 2)
    test_images, test_labels = write_split(where, "test", 3, seed=10)

    x, y = load_cifar10("train", tmp_path, download=False)
    assert x.shape == (10, 3, 32, 32) and x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(y, train_labels)                       # batches 1..5 in order
    np.testing.assert_allclose(x, train_images / np.float32(255), rtol=1e-7)
    assert 0 <= x.min() and x.max() <= 1

    raw, y = load_cifar10("test", tmp_path, dtype=np.uint8, download=False)
    np.testing.assert_array_equal(raw, test_images)
    np.testing.assert_array_equal(y, test_labels)
    assert load_cifar10("test", tmp_path, dtype=np.float64, download=False)[0].dtype == np.float64


def test_load_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match='load_cifar10: split must be "train" or "test", got str \'valid\''):
        load_cifar10("valid", tmp_path)
    with pytest.raises(ValueError, match="expects dtype to be numpy.uint8 or a float dtype, got int32"):
        load_cifar10("test", tmp_path, dtype=np.int32)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder holding cifar-10-batches-bin/"):
        load_cifar10("test", tmp_path / "file")


def test_batches_of_one_split_must_hold_the_same_number(tmp_path):
    write_split(tmp_path, "train", 3)
    write_cifar_batch(tmp_path / "data_batch_4.bin", *make_batch(2))   # cut short on a record boundary
    with pytest.raises(ValueError, match=r"data_batch_4.bin holds 2 records but .*data_batch_1.bin holds 3"):
        load_cifar10("train", tmp_path, download=False)


def test_missing_files_without_download_say_where_to_put_them(tmp_path):
    write_split(tmp_path / CIFAR10_FOLDER, "train", 2)
    with pytest.raises(CIFARUnavailableError) as err:
        load_cifar10("test", tmp_path, download=False)
    message = str(err.value)
    for part in ("load_cifar10: the CIFAR-10 test files (test_batch.bin)", str(tmp_path / CIFAR10_FOLDER),
                 "download=False", cifar.CIFAR10_URL, cifar.CIFAR10_MD5, "cifar-10-binary.tar.gz", "data_dir="):
        assert part in message


def test_default_folder_is_the_cache(tmp_path):
    with options(cache_dir=tmp_path):
        assert cifar_cache_dir() == tmp_path / "cifar10"
        _, labels = write_split(tmp_path / "cifar10" / CIFAR10_FOLDER, "test", 2)
        np.testing.assert_array_equal(load_cifar10("test", download=False)[1], labels)


# ---------------------------------------------------------------------------------------------
# The .tar.gz archive


@pytest.mark.parametrize("prefix", ["", "./"])
def test_load_from_the_archive_and_keep_the_files(tmp_path, prefix):
    members, arrays = official_members(prefix=prefix)
    (tmp_path / "cifar-10-binary.tar.gz").write_bytes(archive_bytes(members))
    x, y = load_cifar10("test", tmp_path, dtype=np.uint8, download=False)
    np.testing.assert_array_equal(x, arrays["test_batch.bin"][0])
    np.testing.assert_array_equal(y, arrays["test_batch.bin"][1])
    assert (tmp_path / CIFAR10_FOLDER / "test_batch.bin").is_file()       # kept for next time
    assert not (tmp_path / CIFAR10_FOLDER / "data_batch_1.bin").exists()  # only what was asked for

    (tmp_path / "cifar-10-binary.tar.gz").unlink()
    np.testing.assert_array_equal(load_cifar10("test", tmp_path, dtype=np.uint8, download=False)[0], x)


def test_the_archive_fills_in_only_the_missing_files(tmp_path):
    members, arrays = official_members()
    (tmp_path / "cifar-10-binary.tar.gz").write_bytes(archive_bytes(members))
    on_disk, _ = make_batch(3, seed=99)
    (tmp_path / CIFAR10_FOLDER).mkdir()
    write_cifar_batch(tmp_path / CIFAR10_FOLDER / "data_batch_2.bin", on_disk, np.zeros(3, int))
    x, _ = load_cifar10("train", tmp_path, dtype=np.uint8, download=False)
    np.testing.assert_array_equal(x[3:6], on_disk)                        # the file on disk wins
    np.testing.assert_array_equal(x[:3], arrays["data_batch_1.bin"][0])


def test_archive_members_never_become_paths(tmp_path):
    """Members named ../x or /x are ignored and nothing is written outside; a link under a wanted name is refused."""
    members, arrays = official_members()
    evil = {"../evil.bin": b"x", f"{CIFAR10_FOLDER}/../../evil2.bin": b"x", "/tmp/fluxpy_evil_abs.bin": b"x"}
    root = tmp_path / "data"
    root.mkdir()
    (root / "cifar-10-binary.tar.gz").write_bytes(archive_bytes({**evil, **members}))
    np.testing.assert_array_equal(load_cifar10("test", root, download=False)[1], arrays["test_batch.bin"][1])
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        ["data", "cifar-10-binary.tar.gz", CIFAR10_FOLDER, "test_batch.bin"])
    assert not Path("/tmp/fluxpy_evil_abs.bin").exists()

    link = tarfile.TarInfo(f"{CIFAR10_FOLDER}/test_batch.bin")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    (tmp_path / "cifar-10-binary.tar.gz").write_bytes(archive_bytes({link.name: link}))
    with pytest.raises(ValueError, match="member cifar-10-batches-bin/test_batch.bin is not a regular file"):
        extract_batches(tmp_path / "cifar-10-binary.tar.gz", ["test_batch.bin"])


def test_archive_errors_name_the_archive(tmp_path):
    path = tmp_path / "cifar-10-binary.tar.gz"
    path.write_bytes(archive_bytes({f"{CIFAR10_FOLDER}/data_batch_1.bin": b""}))
    with pytest.raises(ValueError, match=r"cifar-10-binary.tar.gz lacks cifar-10-batches-bin/test_batch.bin; "
                                         r"expected the CIFAR-10 binary archive"):
        load_cifar10("test", tmp_path, download=False)
    path.write_bytes(b"not a gzip file at all")
    with pytest.raises(ValueError, match="cifar-10-binary.tar.gz is not a readable .tar.gz archive"):
        load_cifar10("test", tmp_path, download=False)
    path.write_bytes(archive_bytes(official_members()[0])[:-200])        # cut short
    with pytest.raises(ValueError, match="is not a readable .tar.gz archive"):
        load_cifar10("test", tmp_path, download=False)


def test_a_bad_file_inside_the_archive_names_the_member(tmp_path):
    members, _ = official_members()
    members[f"{CIFAR10_FOLDER}/test_batch.bin"] = members[f"{CIFAR10_FOLDER}/test_batch.bin"][:-1]
    (tmp_path / "cifar-10-binary.tar.gz").write_bytes(archive_bytes(members))
    with pytest.raises(ValueError, match=r"cifar-10-binary.tar.gz:cifar-10-batches-bin/test_batch.bin has 9218 bytes"):
        load_cifar10("test", tmp_path, download=False)


# ---------------------------------------------------------------------------------------------
# Downloads (a monkeypatched network)


def test_a_download_with_a_bad_checksum_fails_and_makes_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: FakeResponse(b"not cifar"))
    monkeypatch.setattr(cifar, "_network_failure", [None])
    target = tmp_path / "new" / "cifar"
    with pytest.raises(CIFARUnavailableError, match=r"the download of .*cifar-10-binary.tar.gz failed: md5 "
                                                    r"[0-9a-f]{32} does not match the expected "
                                                    r"c32a1d4ab5d03f1284b67883e8d87530"):
        load_cifar10("test", target, verbose=False)
    assert not (tmp_path / "new").exists()


def test_a_good_download_writes_the_archive_then_the_files(tmp_path, monkeypatch, capsys):
    members, arrays = official_members()
    payload = archive_bytes(members)
    urls = []

    def serve(url, timeout):
        urls.append(url)
        return FakeResponse(payload)
    monkeypatch.setattr(urllib.request, "urlopen", serve)
    monkeypatch.setattr(cifar, "CIFAR10_MD5", hashlib.md5(payload).hexdigest())
    monkeypatch.setattr(cifar, "_network_failure", [None])
    target = tmp_path / "new" / "cifar"
    _, y = load_cifar10("train", target)
    assert urls == ["https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"]
    assert "downloading https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz" in capsys.readouterr().out
    assert (target / "cifar-10-binary.tar.gz").read_bytes() == payload
    assert sorted(os.listdir(target)) == [CIFAR10_FOLDER, "cifar-10-binary.tar.gz"]  # no temporary file left
    np.testing.assert_array_equal(y[-3:], arrays["data_batch_5.bin"][1])
    load_cifar10("test", target)
    assert len(urls) == 1                                                # the archive is there now


def test_offline_fails_once_then_at_once(tmp_path, monkeypatch):
    calls = []

    def unreachable(url, timeout=None):
        calls.append(url)
        raise urllib.error.URLError("network is unreachable")
    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    monkeypatch.setattr(cifar, "_network_failure", [None])
    with pytest.raises(CIFARUnavailableError, match="network is unreachable"):
        load_cifar10("train", tmp_path / "a", verbose=False)
    with pytest.raises(CIFARUnavailableError, match=r"network is unreachable.* s ago; not retried within 300 s"):
        load_cifar10("test", tmp_path / "a", verbose=False)
    assert len(calls) == 1 and not (tmp_path / "a").exists()


# ---------------------------------------------------------------------------------------------
# examples/cifar_resnet.py


def example():
    spec = importlib.util.spec_from_file_location("cifar_resnet_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_trains_saves_and_reloads_on_the_cpu(tmp_path, capsys):
    write_split(tmp_path / "cifar" / CIFAR10_FOLDER, "train", 8)
    write_split(tmp_path / "cifar" / CIFAR10_FOLDER, "test", 8, seed=10)
    out = tmp_path / "out"
    accuracy = example().main(["--data-dir", str(tmp_path / "cifar"), "--epochs", "1", "--batchsize", "8",
                               "--limit", "16", "--device", "cpu", "--no-progress", "--seed", "1",
                               "--save", str(out / "m.npz"), "--plot", str(out / "m.png")])
    text = capsys.readouterr().out
    assert f"CIFAR-10: 16 training and 8 test images from {tmp_path / 'cifar'}; device: cpu" in text
    assert "ResNet-20: 272,474 parameters" in text
    assert "epoch   1/1: train loss" in text and "images/s" in text
    assert "reloaded model: same accuracy" in text and "final test accuracy" in text
    assert 0 <= accuracy <= 1
    assert (out / "m.npz").is_file()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "m.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "matplotlib is not installed: skipping the plot" in text


@pytest.mark.parametrize("folder", ["empty", "missing"])
def test_example_without_data_exits_with_status_2_and_what_to_do(tmp_path, capsys, folder):
    data_dir = tmp_path / folder
    if folder == "empty":
        data_dir.mkdir()
    with pytest.raises(SystemExit) as exit_:
        example().main(["--data-dir", str(data_dir), "--no-download", "--device", "cpu"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("no CIFAR-10 data: load_cifar10: the CIFAR-10 train files")
    assert cifar.CIFAR10_URL in err and str(data_dir) in err
    assert data_dir.exists() == (folder == "empty")


def test_example_schedules_and_arguments(capsys):
    module = example()
    step = module.make_schedule(module.parse_args(["--schedule", "step", "--epochs", "8", "--lr", "0.2"]))
    assert [round(step(t), 6) for t in range(1, 9)] == [0.2] * 4 + [0.02] * 2 + [0.002] * 2
    cosine = module.make_schedule(module.parse_args(["--epochs", "4", "--warmup", "1"]))
    rates = [cosine(t) for t in range(1, 5)]
    assert rates[0] == 0.05 and rates[1] == 0.1 and rates[1] > rates[2] > rates[3] > 0
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(["--epochs", "2", "--warmup", "2"])
    assert exit_.value.code == 2 and "--warmup must be in 0 .. epochs - 1 = 1, got 2" in capsys.readouterr().err


def test_example_runs_under_the_launcher_and_only_rank_0_reports_and_saves(tmp_path):
    """Two processes through ``python -m fluxpy.distributed.run`` on the CPU (the tcp backend), with SyncBatchNorm:
    each trains on its shard, only rank 0 prints and saves."""
    import os
    import subprocess
    import sys
    write_split(tmp_path / "cifar" / CIFAR10_FOLDER, "train", 16)
    write_split(tmp_path / "cifar" / CIFAR10_FOLDER, "test", 8, seed=10)
    root = EXAMPLE.parents[1]
    run = subprocess.run([sys.executable, "-m", "fluxpy.distributed.run", "--nproc", "2", str(EXAMPLE),
                          "--data-dir", str(tmp_path / "cifar"), "--epochs", "1", "--batchsize", "4", "--limit", "16",
                          "--device", "cpu", "--no-progress", "--seed", "1", "--sync-batchnorm",
                          "--save", str(tmp_path / "m.npz"), "--plot", str(tmp_path / "m.png")],
                         cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "2 ranks (batch 4 each)" in run.stdout
    assert "[rank 0] epoch   1/1: train loss" in run.stdout and "[rank 0] final test accuracy" in run.stdout
    assert "[rank 1] epoch" not in run.stdout and "[rank 1] final" not in run.stdout
    assert (tmp_path / "m.npz").is_file()
