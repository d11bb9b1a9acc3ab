"""Saving and loading a model's arrays: :func:`save` and :func:`load`, as ``.npz`` or ``.safetensors`` files.

The model's :func:`fluxpy.state` (every array, trainable or not: BatchNorm's running statistics
too) is written under flattened keys such as ``"layers.0.weight"``. The file's extension picks the
format: ``.safetensors`` (the `safetensors <https://huggingface.co/docs/safetensors>`_ format,
readable from PyTorch, JAX and others) or ``.npz`` (NumPy's zip of ``.npy`` arrays; added when the
name has neither). ``load`` copies the arrays back into a model of the same structure, in place,
after checking every one of them. Arrays of every dtype a model holds round-trip bit for bit, bfloat16 and
ml_dtypes' float8 types included (``BF16``, ``F8_E4M3``, ``F8_E5M2`` in a .safetensors header, as PyTorch writes
them); GPU arrays are saved from the host and loaded into whatever device the target model uses.

A save is atomic: the file is written under a unique temporary name in the same folder, flushed
to disk and renamed over the target, so a crash, a full disk or two processes saving to the same
path leave either the old file or one complete new one, never a mixture. Anything wrong with a
file (missing, a folder, truncated, corrupt, another format, arrays that do not fit the model) is
one :class:`CheckpointError` naming the path and the problem, raised before the model changes.

>>> import numpy as np, os, tempfile
>>> model = {"w": np.arange(3.0), "layers": [{"b": np.ones(2)}]}
>>> path = os.path.join(tempfile.mkdtemp(), "model.npz")
>>> save(path, model)
>>> sorted(np.load(path).files)
['layers.0.b', 'w']
>>> fresh = {"w": np.zeros(3), "layers": [{"b": np.zeros(2)}]}
>>> load(path, fresh)["w"]
array([0., 1., 2.])
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from .functors import cpu, loadstate, state

__all__ = ["save", "load", "flat_state", "CheckpointError", "FORMATS", "write_file", "read_file", "fitted_state"]

FORMATS = {".npz": "npz", ".safetensors": "safetensors"}
"""The file extensions :func:`save` and :func:`load` know, and their formats."""

_FORMAT_VERSION = 1  # written in a .safetensors file's metadata as {"format": "fluxpy", "fluxpy_format_version": "1"}
_SAFETENSORS_DTYPES = frozenset(map(np.dtype, ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                                               "uint64", "float16", "float32", "float64", "complex64")))
_MAX_LISTED = 8  # key names listed in one message
# ml_dtypes' types have no .npy descriptor (NumPy would write raw void bytes) and safetensors' NumPy layer does not
# know them although the format does: a checkpoint stores them as unsigned integers of their size, names the dtype
# in a manifest entry of a .npz and under its own name (BF16, F8_E4M3, F8_E5M2) in a .safetensors header.
_EXTENSION_DTYPES = {name: np.dtype(getattr(ml_dtypes, name)) for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")}
_SAFETENSORS_NAMES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_STORED_AS = {1: ("U8", np.dtype(np.uint8)), 2: ("U16", np.dtype(np.uint16))}
_MANIFEST = "__fluxpy_dtypes__.json"  # a .npz entry: {key: dtype name} of the arrays stored as unsigned integers
# a training checkpoint's JSON text (fluxpy.checkpoint): a .npz entry of its own, a key of a .safetensors' metadata
_META_ENTRY, _META_KEY = "__fluxpy_training__.json", "fluxpy_training"


class CheckpointError(OSError, ValueError):
    """A checkpoint that cannot be written or read, or does not fit the model; the message names the path and why.

    It is both an ``OSError`` and a ``ValueError`` (as the standard library's
    ``io.UnsupportedOperation`` is), so that code catching ``OSError`` around a load (a missing
    file) and code catching ``ValueError`` (a shape mismatch) both keep working. ``err.path`` is
    the file concerned.

    >>> issubclass(CheckpointError, OSError) and issubclass(CheckpointError, ValueError)
    True
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)


def flat_state(model: Any) -> dict:
    """The model's arrays under dotted paths: ``{"layers.0.weight": array, ...}``.

    Two arrays whose paths flatten to the same key (a field named ``"a.b"`` beside a field ``a``
    holding ``b``) are an error rather than one silently overwriting the other.

    >>> import numpy as np
    >>> sorted(flat_state({"a": [np.ones(1), None, np.zeros(2)]}))
    ['a.0', 'a.2']
    """
    out = {}

    def walk(st, prefix):
        if isinstance(st, dict):
            for k, v in st.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(st, list):
            for i, v in enumerate(st):
                walk(v, f"{prefix}{i}.")
        elif st is not None:
            key = prefix[:-1]
            if key in out:
                raise ValueError(f"flat_state: two arrays of the model flatten to the key {key!r}; rename a field "
                                 "so that no field name contains a '.' that another path also spells")
            out[key] = st
    walk(state(model), "")
    return out


# ---------------------------------------------------------------------------------------------
# save


def save(path: str | os.PathLike, model: Any) -> None:
    """Write every array of ``model`` to the file ``path``, atomically, as ``.npz`` or ``.safetensors``.

    The format follows the extension: ``.safetensors``, or ``.npz``, which is added when the name
    has neither (as ``numpy.savez`` does); ``.npy`` (one array) is an error. Keys are the dotted
    paths of :func:`flat_state`; arrays are written from the host (CuPy arrays are copied there
    first). The data go to a new temporary file in the same folder (``tempfile.mkstemp``, so a
    link planted under any name is never followed), which is flushed and synced to disk and then
    renamed over ``path`` (``os.replace``; a symbolic link at ``path`` is replaced, not followed),
    and the folder is synced. On any failure the temporary file is removed, an existing file at
    ``path`` is left as it was, and a :class:`CheckpointError` names ``path``. The folder must
    exist. A model without arrays, or with arrays of Python objects, is an error before anything
    is written.

    >>> import numpy as np, os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> save(os.path.join(folder, "m"), {"w": np.ones(2, np.float32)})
    >>> save(os.path.join(folder, "m.safetensors"), {"w": np.ones(2, np.float32)})
    >>> sorted(os.listdir(folder))
    ['m.npz', 'm.safetensors']
    """
    if _holds_optimiser_state(model):
        raise TypeError("save writes a model's arrays; it was given an optimiser state (the tree of Leaf objects "
                        "that setup returns), which it would leave out: save a training run with "
                        "fluxpy.save_training(path, model, opt_state)")
    arrays = flat_state(model)
    if not arrays:
        target, _ = _target(_check_path(path, "save"), "save")
        raise ValueError(f"save expects a model holding at least one array, got a {type(model).__name__} with none "
                         f"(nothing written to {target})")
    write_file(path, arrays, None, "save")


def _holds_optimiser_state(tree):
    """Whether the dicts, lists and tuples of ``tree`` hold an optimiser leaf (an object with ``rule``, ``state``
    and ``frozen``, as :class:`fluxpy.optimise.Leaf`), which a model's state leaves out."""
    if isinstance(tree, dict):
        return any(_holds_optimiser_state(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_holds_optimiser_state(v) for v in tree)
    return all(hasattr(tree, name) for name in ("rule", "state", "frozen"))


def write_file(path: str | os.PathLike, arrays: dict, meta: str | None, who: str) -> Path:
    """Write ``arrays`` (``{key: array}``, any device) and an optional JSON text ``meta`` to the checkpoint file
    ``path`` atomically, as :func:`save` writes a model; returns the file written. ``meta`` goes to the
    .safetensors header's metadata or to a .npz entry of its own: what :func:`fluxpy.save_training` adds to the
    arrays of a training run. Errors name ``who``.

    >>> import numpy as np, os, tempfile
    >>> target = write_file(os.path.join(tempfile.mkdtemp(), "t"), {"w": np.ones(2)}, '{"step": 3}', "save")
    >>> target.name, read_file(target, "load")[1:]
    ('t.npz', ({'w': array([1., 1.])}, '{"step": 3}'))
    """
    target, fmt = _target(_check_path(path, who), who)
    arrays, extension = _as_stored(_host_arrays(arrays, fmt, target, who))
    if fmt == "safetensors":
        st = _safetensors(who, target)
        metadata = {"format": "fluxpy", "fluxpy_format_version": str(_FORMAT_VERSION)}
        if meta is not None:
            metadata[_META_KEY] = meta

        def write(f):
            data = st.save(arrays, metadata=metadata)
            f.write(_retyped(data, {k: _SAFETENSORS_NAMES[name] for k, name in extension.items()}))
    else:
        def write(f):
            _write_npz(f, arrays, extension, *(() if meta is None else (meta,)))
    _atomic_write(target, write, who)
    return target


def _as_stored(arrays):
    """``(arrays, {key: dtype name})``: the arrays of an ml_dtypes type viewed as unsigned integers of their size."""
    stored, extension = {}, {}
    for key, a in arrays.items():
        name = next((n for n, d in _EXTENSION_DTYPES.items() if a.dtype == d), None)
        if name is not None:
            a, extension[key] = a.view(_STORED_AS[a.dtype.itemsize][1]), name
        stored[key] = a
    return stored, extension


def _retyped(data, dtypes):
    """The .safetensors bytes ``data`` with the header's dtype of each key of ``dtypes`` set to its value (the
    data offsets count from the end of the header, so the data need not move)."""
    if not dtypes:
        return data
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    for key, dtype in dtypes.items():
        header[key]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # the format pads the header with spaces to a multiple of 8 bytes
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


def _check_path(path, who):
    if isinstance(path, (str, os.PathLike)) and not isinstance(path, bytes):
        if not os.fspath(path):
            raise ValueError(f"{who} expects a file path, got an empty string")
        return Path(path)
    shown = repr(path) if isinstance(path, str) else type(path).__name__
    raise TypeError(f"{who} expects a file path (str or os.PathLike) as its first argument, got {shown}"
                    + (" (the model? the order is save(path, model) / load(path, model))"
                       if not isinstance(path, (str, bytes)) else ""))


def _target(path, who):
    """The file to use and its format: by extension; a name with no known one gets ``.npz``."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        raise CheckpointError(f"{who}: {path} is a .npy path, which holds one array; a fluxpy checkpoint is a "
                              f".npz or .safetensors file (one array per key)", path)
    if suffix in FORMATS:
        return path, FORMATS[suffix]
    return path.with_name(path.name + ".npz"), "npz"


def _host_arrays(flat, fmt, target, who):
    """The arrays of ``flat`` (``{key: array}``) as C-contiguous NumPy arrays, checked for what the format can
    store."""
    arrays = {}
    for key, a in flat.items():
        host = np.asarray(cpu(a))
        extension = host.dtype in _EXTENSION_DTYPES.values()
        if host.dtype.hasobject or (host.dtype.kind == "V" and not extension) or (
                fmt == "safetensors" and not extension and host.dtype.newbyteorder("=") not in _SAFETENSORS_DTYPES):
            kinds = "numeric or bool arrays" if host.dtype.hasobject or host.dtype.kind == "V" else \
                ", ".join(sorted(str(d) for d in _SAFETENSORS_DTYPES | set(_EXTENSION_DTYPES)))
            raise CheckpointError(f"{who}: {key} is an array of dtype {host.dtype}, which {target} cannot store "
                                  f"(a .{fmt} checkpoint holds {kinds})", target)
        arrays[key] = host if host.flags.c_contiguous else host.copy(order="C")
    return arrays


def _write_npz(f, arrays, extension, meta=None):
    """What ``numpy.savez`` writes (a zip of ``key.npy`` entries), without its keyword names clashing with keys, the
    manifest of ``extension`` (``{key: dtype name}``) where it names any array, and the text ``meta`` if any."""
    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, array in arrays.items():
            with zf.open(key + ".npy", "w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, array, allow_pickle=False)
        if extension:
            zf.writestr(_MANIFEST, json.dumps(extension, sort_keys=True))
        if meta is not None:
            zf.writestr(_META_ENTRY, meta)


def _atomic_write(target: Path, write: Callable[[BinaryIO], Any], who: str) -> None:
    """Run ``write(f)`` on a new temporary file beside ``target``, sync it, and rename it to ``target``."""
    folder = target.parent
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name[:100]}.", suffix=".tmp")
    except OSError as err:
        why = f"the folder {folder} does not exist" if not folder.is_dir() else _reason(err)
        raise CheckpointError(f"{who}: cannot write {target}: {why}", target) from err
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600; a checkpoint gets the usual mode
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if not isinstance(err, Exception):
            raise  # KeyboardInterrupt and the like, after removing the temporary file
        if isinstance(err, IsADirectoryError) or target.is_dir():
            raise CheckpointError(f"{who}: cannot write {target}: it is a folder", target) from err
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{who}: could not write {target}: {_reason(err)}", target) from err
    _fsync_folder(folder)


def _reason(err):
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = str(err) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _umask():
    """The process's umask, read without changing it where /proc allows (Linux), else by setting it back at once."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_folder(folder):
    """Sync the folder so that the rename itself is on disk (POSIX; a no-op where folders cannot be synced)."""
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _safetensors(who, path):
    try:
        import safetensors.numpy as st
    except ImportError as err:
        raise CheckpointError(f"{who}: {path} is a .safetensors file, which needs the safetensors package "
                              "(python3 -m pip install safetensors)", path) from err
    return st


# ---------------------------------------------------------------------------------------------
# load


def load(path: str | os.PathLike, model: Any) -> Any:
    """Copy the arrays saved in ``path`` into ``model`` in place, and return ``model``.

    The format follows the extension as for :func:`save` (``path`` without one finds
    ``path + ".npz"``). The file must hold exactly the model's arrays: the same keys, the same
    shapes, and dtypes that cast to the model's within their kind (float to float, int to float
    or int, ...). Every array is checked before any is copied, so a file that does not fit, and
    any file that cannot be read (missing, a folder, empty, truncated, corrupt, a ``.npy`` file,
    another format), is a :class:`CheckpointError` naming ``path`` and what is wrong, with the
    model untouched. Values are cast to the model's dtypes and copied to its device.

    >>> import numpy as np, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "m.npz")
    >>> save(path, {"w": np.ones(2)})
    >>> load(path, {"w": np.ones(3)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fluxpy.io.CheckpointError: load: ...m.npz does not fit the model: w has shape (3,) in the model but (2,) in ...
    """
    target, saved, meta = read_file(path, "load")
    if meta is not None:
        raise CheckpointError(f"load: {target} is a training checkpoint (model, optimiser state, ...): read it with "
                              "fluxpy.load_training(path, model, opt_state)", target)
    loadstate(model, fitted_state(model, saved, target, "load"))
    return model


def read_file(path: str | os.PathLike, who: str) -> tuple[Path, dict, str | None]:
    """``(target, arrays, meta)``: the file that ``path`` names (as :func:`load` finds it), its arrays, and its
    training JSON text (None in a model's file); or a :class:`CheckpointError` naming the file and what is wrong
    with it.

    >>> import numpy as np, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> save(path, {"w": np.zeros(1, np.float32)})
    >>> read_file(path, "load")[1:]
    ({'w': array([0.], dtype=float32)}, None)
    """
    target, fmt = _load_target(_check_path(path, who), who)
    saved, meta = _read_safetensors(target, who) if fmt == "safetensors" else _read_npz(target, who)
    return target, saved, meta


def fitted_state(model: Any, saved: dict, target: Path, who: str) -> Any:
    """The nested :func:`fluxpy.state` of ``model`` holding the arrays of ``saved`` (``{dotted key: array}``), for
    :func:`fluxpy.loadstate`, after checking every key, shape and dtype kind against the model: a
    :class:`CheckpointError` naming ``target`` and what differs, before anything changes.

    >>> import numpy as np
    >>> fitted_state({"w": np.zeros(2)}, {"w": np.ones(2)}, Path("m.npz"), "load")
    {'w': array([1., 1.])}
    """
    _check_match(flat_state(model), saved, target, who)
    return _nested_like(state(model), saved, "")


def _load_target(path, who):
    """The file to read and its format: ``path`` itself, or ``path + ".npz"`` when ``path`` has no known extension."""
    _target(path, who)  # a .npy path is an error
    fmt = FORMATS.get(path.suffix.lower(), "npz")
    candidates = [path] if path.suffix.lower() in FORMATS else [path, path.with_name(path.name + ".npz")]
    if path.is_dir():
        raise CheckpointError(f"{who}: {path} is a folder, not a checkpoint file", path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate, fmt
        if candidate.exists():  # a device or a socket: not a file
            raise CheckpointError(f"{who}: {candidate} is not a regular file", candidate)
    tried = " (nor " + str(candidates[1]) + ")" if len(candidates) > 1 else ""
    raise CheckpointError(f"{who}: no file {path}{tried}", path)


def _open(target, who):
    try:
        return open(target, "rb")
    except OSError as err:
        raise CheckpointError(f"{who}: cannot read {target}: {_reason(err)}", target) from err


def _read_npz(target, who):
    with _open(target, who) as f:
        head = f.read(16)
        if head[:2] != b"PK":
            raise CheckpointError(f"{who}: {target} is not a .npz checkpoint: {_what_is(head)}", target)
        f.seek(0)
        try:
            return _read_zip(f, target, who)
        except CheckpointError:
            raise
        except Exception as err:  # BadZipFile, EOFError, zlib.error, a truncated or mangled .npy entry, ...
            raise CheckpointError(f"{who}: {target} is a corrupt or truncated .npz file "
                                  f"({type(err).__name__}: {_reason(err)})", target) from err


def _read_zip(f, target, who):
    saved, extension, meta = {}, {}, None
    with zipfile.ZipFile(f) as zf:
        for name in zf.namelist():
            if name == _MANIFEST:
                extension = _manifest(zf.read(name), target, who)
                continue
            if name == _META_ENTRY:
                meta = _text(zf.read(name), target, who)
                continue
            if not name.endswith(".npy"):
                raise CheckpointError(f"{who}: {target} holds {name!r}, which is not a .npy array: not a fluxpy "
                                      "checkpoint", target)
            key = name[:-4]
            if key in saved:
                raise CheckpointError(f"{who}: {target} holds the key {key!r} twice", target)
            with zf.open(name) as entry:
                try:
                    saved[key] = np.lib.format.read_array(entry, allow_pickle=False)
                except ValueError as err:
                    if "allow_pickle" in str(err) or "pickled" in str(err):
                        raise CheckpointError(f"{who}: {target} holds {key} as an array of pickled Python objects, "
                                              "which a checkpoint never contains (and fluxpy never unpickles)",
                                              target) from err
                    raise
    return _as_saved(saved, extension, target, who), meta


def _text(data, target, who):
    try:
        return data.decode()
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{who}: {target} is corrupt: its {_META_ENTRY} is not UTF-8 text", target) from err


def _manifest(text, target, who):
    """The ``{key: dtype name}`` of a .npz's manifest entry, checked."""
    try:
        extension = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"{who}: {target} is corrupt: its {_MANIFEST} is not JSON ({_reason(err)})",
                              target) from err
    if not isinstance(extension, dict) or any(v not in _EXTENSION_DTYPES for v in extension.values()):
        raise CheckpointError(f"{who}: {target} is corrupt: its {_MANIFEST} should map keys to one of "
                              f"{', '.join(_EXTENSION_DTYPES)}, got {_reason(ValueError(str(extension)))}", target)
    return extension


def _as_saved(saved, extension, target, who):
    """The arrays of ``saved`` that ``extension`` names viewed back as their dtype, after checking how they were
    stored."""
    for key, name in extension.items():
        dtype = _EXTENSION_DTYPES[name]
        got = saved.get(key)
        if got is None or got.dtype != _STORED_AS[dtype.itemsize][1]:
            raise CheckpointError(f"{who}: {target} is corrupt: {key} should be stored as "
                                  f"{_STORED_AS[dtype.itemsize][1]} for its dtype {name}, found "
                                  f"{'no such array' if got is None else got.dtype}", target)
        saved[key] = got.view(dtype)
    return saved


def _what_is(head):
    if not head:
        return "the file is empty"
    if head.startswith(b"\x93NUMPY"):
        return "it is a single .npy array (numpy.save), not a .npz of named arrays"
    if len(head) >= 9 and head[8:9] == b"{":
        return "it looks like a .safetensors file: name it .safetensors"
    return f"it does not start with a zip header (its first bytes are {head[:8].hex()})"


def _read_safetensors(target, who):
    st = _safetensors(who, target)
    with _open(target, who) as f:
        data = f.read()
    if len(data) < 8:
        why = "the file is empty" if not data else f"it has {len(data)} bytes, fewer than the 8 of the header length"
        raise CheckpointError(f"{who}: {target} is not a .safetensors checkpoint: {why}", target)
    (n,) = struct.unpack("<Q", data[:8])
    if data[:2] == b"PK":
        raise CheckpointError(f"{who}: {target} is not a .safetensors checkpoint: it looks like a .npz (zip) file: "
                              "name it .npz", target)
    if 8 + n > len(data):
        raise CheckpointError(f"{who}: {target} is truncated or not a .safetensors file: its header length says "
                              f"{n} bytes, but the file has {len(data) - 8} after it", target)
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as err:
        raise CheckpointError(f"{who}: {target} is corrupt: its header is not JSON ({_reason(err)})", target) from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{who}: {target} is corrupt: its header is not a JSON object", target)
    meta = header.get("__metadata__") or {}
    version = meta.get("fluxpy_format_version") if isinstance(meta, dict) else None
    if version is not None and (not str(version).isdigit() or int(version) > _FORMAT_VERSION):
        raise CheckpointError(f"{who}: {target} was written in fluxpy's checkpoint format {version}; this fluxpy "
                              f"reads format {_FORMAT_VERSION} and older: upgrade fluxpy", target)
    extension = {k: n for k, v in header.items() if isinstance(v, dict) and k != "__metadata__"
                 for n, st_name in _SAFETENSORS_NAMES.items() if v.get("dtype") == st_name}
    stored_as = {k: _STORED_AS[_EXTENSION_DTYPES[n].itemsize][0] for k, n in extension.items()}
    training = meta.get(_META_KEY) if isinstance(meta, dict) else None
    if training is not None and not isinstance(training, str):
        raise CheckpointError(f"{who}: {target} is corrupt: its metadata's {_META_KEY} is not a text", target)
    try:
        return _as_saved(st.load(_retyped(data, stored_as)), extension, target, who), training
    except CheckpointError:
        raise
    except KeyError as err:
        raise CheckpointError(f"{who}: {target} holds an array of dtype {err.args[0] if err.args else '?'}, which "
                              "NumPy cannot represent", target) from err
    except Exception as err:  # SafetensorError: offsets past the end (truncated), overlapping data, bad dtype, ...
        raise CheckpointError(f"{who}: {target} is a corrupt or truncated .safetensors file "
                              f"({type(err).__name__}: {_reason(err)})", target) from err


def _listed(keys):
    keys = list(keys)
    more = f" and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else ""
    return ", ".join(keys[:_MAX_LISTED]) + more


def _check_match(expected, saved, path, who):
    """Every key, shape and dtype kind of the file against the model's; one error listing what differs."""
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the file: {_listed(missing)}")
        if unexpected:
            parts.append(f"not in the model: {_listed(unexpected)}")
        raise CheckpointError(f"{who}: {path} does not fit the model: {'; '.join(parts)}; nothing was loaded", path)
    problems = []
    for key, array in expected.items():
        got = saved[key]
        if tuple(array.shape) != tuple(got.shape):
            problems.append(f"{key} has shape {tuple(array.shape)} in the model but {tuple(got.shape)} in the file")
        elif not np.can_cast(got.dtype, array.dtype, casting="same_kind"):
            problems.append(f"{key} is {array.dtype} in the model but {got.dtype} in the file, which does not cast "
                            "to it")
    if problems:
        more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CheckpointError(f"{who}: {path} does not fit the model: {'; '.join(problems[:_MAX_LISTED])}{more}; "
                              "nothing was loaded", path)


def _nested_like(template, saved, prefix):
    """The nested state of :func:`fluxpy.state`, shaped like ``template``, with the saved arrays as leaves."""
    if isinstance(template, dict):
        return {k: _nested_like(v, saved, f"{prefix}{k}.") for k, v in template.items()}
    if isinstance(template, list):
        return [_nested_like(v, saved, f"{prefix}{i}.") for i, v in enumerate(template)]
    return None if template is None else saved[prefix[:-1]]
