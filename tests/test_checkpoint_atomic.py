"""save is atomic: a unique temporary file, synced and renamed; concurrent savers and readers never see a torn file."""
import multiprocessing
import os
import threading

import numpy as np
import pytest

import fluxpy.io as io
from fluxpy.io import CheckpointError, flat_state, load, save

FORMATS = ["npz", "safetensors"]


def big_model(value):
    """A model whose every entry is ``value``: a loaded file must be all one value, whichever writer won."""
    return {"a": np.full((256, 256), value, np.float32), "b": [np.full(1000, value, np.float64)]}


def values_in(model):
    return {float(v) for a in flat_state(model).values() for v in np.unique(a)}


def _save_many(path, value, times):
    for _ in range(times):
        save(path, big_model(value))


@pytest.mark.parametrize("fmt", FORMATS)
def test_concurrent_threads_saving_one_path(tmp_path, fmt):
    path = tmp_path / f"m.{fmt}"
    save(path, big_model(-1.0))
    errors, loaded = [], []
    stop = threading.Event()

    def writer(value):
        try:
            _save_many(path, value, 10)
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    def reader():
        while not stop.is_set():
            try:
                loaded.append(values_in(load(path, big_model(0.0))))
            except BaseException as err:  # pragma: no cover - reported below
                errors.append(err)
                return

    writers = [threading.Thread(target=writer, args=(float(v),)) for v in range(1, 7)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors
    assert loaded and all(len(v) == 1 for v in loaded)  # every read saw one whole checkpoint
    final = values_in(load(path, big_model(0.0)))
    assert len(final) == 1 and final <= {1.0, 2.0, 3.0, 4.0, 5.0, 6.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"m.{fmt}"]  # no temporary file left behind


@pytest.mark.parametrize("fmt", FORMATS)
def test_concurrent_processes_saving_one_path(tmp_path, fmt):
    path = str(tmp_path / f"m.{fmt}")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_save_many, args=(path, float(v), 5)) for v in range(1, 5)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    final = values_in(load(path, big_model(0.0)))
    assert len(final) == 1 and final <= {1.0, 2.0, 3.0, 4.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"m.{fmt}"]


def test_planted_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "m.npz").symlink_to(victim)
    save(tmp_path / "m.npz", big_model(1.0))
    assert victim.read_text() == "precious"
    assert not (tmp_path / "m.npz").is_symlink()
    assert values_in(load(tmp_path / "m.npz", big_model(0.0))) == {1.0}


def test_the_old_fixed_temporary_name_is_not_used(tmp_path):
    """fluxpy once wrote to ``m.npz.tmp.npz``: a link planted there must not be written through."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "m.npz.tmp.npz").symlink_to(victim)
    save(tmp_path / "m.npz", big_model(1.0))
    assert victim.read_text() == "precious"


def test_temporary_file_is_unique_and_in_the_target_folder(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((src, dst))
        return real_replace(src, dst)
    monkeypatch.setattr(io.os, "replace", spy)
    save(tmp_path / "m.npz", big_model(1.0))
    save(tmp_path / "m.npz", big_model(2.0))
    (src1, dst1), (src2, dst2) = seen
    assert os.path.dirname(src1) == str(tmp_path) and src1 != src2 and dst1 == dst2 == tmp_path / "m.npz"


def test_file_and_folder_are_synced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else fd)
        return real_fsync(fd)
    monkeypatch.setattr(io.os, "fsync", spy)
    save(tmp_path / "m.npz", big_model(1.0))
    assert len(synced) == 2
    if os.path.exists("/proc/self/fd"):
        assert os.path.dirname(synced[0]) == str(tmp_path) and synced[1] == str(tmp_path)


def test_saved_file_gets_the_usual_permissions(tmp_path):
    """mkstemp makes 0600 files; a checkpoint is readable as any other file the user writes."""
    save(tmp_path / "m.npz", big_model(1.0))
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(tmp_path / "m.npz").st_mode & 0o777 == 0o666 & ~mask


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("where", ["write", "replace"])
def test_a_failed_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, fmt, where):
    path = tmp_path / f"m.{fmt}"
    save(path, big_model(1.0))
    before = path.read_bytes()
    if where == "write":
        monkeypatch.setattr(io.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    else:
        monkeypatch.setattr(io.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(13, "Permission denied")))
    with pytest.raises(CheckpointError) as err:
        save(path, big_model(2.0))
    assert str(path) in str(err.value)
    assert ("No space left" if where == "write" else "Permission denied") in str(err.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"m.{fmt}"]


def test_an_interrupted_save_removes_its_temporary(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "_write_npz", lambda f, arrays, extension: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path / "m.npz", big_model(1.0))
    assert list(tmp_path.iterdir()) == []
