"""CIFAR-10 in its official binary format: :func:`load_cifar10`, :func:`read_cifar_batch`, :func:`write_cifar_batch`.

The binary archive (``cifar-10-binary.tar.gz``) unpacks to a folder ``cifar-10-batches-bin`` holding
``data_batch_1.bin`` ... ``data_batch_5.bin`` (the 50,000 training images) and ``test_batch.bin``
(10,000). Each file is a run of 3,073-byte records: one label byte (0 to 9, an index into
:data:`CIFAR10_CLASSES`), then the 3x32x32 uint8 image, the red plane first, each plane row by
row. That is fluxpy's NCHW layout (``(N, 3, 32, 32)``) already: the pixels of a record reshape to it as they are.

>>> import numpy as np, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "test_batch.bin")
>>> write_cifar_batch(path, np.zeros((2, 3, 32, 32), np.uint8), [3, 8])
>>> os.path.getsize(path)
6146
>>> images, labels = read_cifar_batch(path)
>>> images.shape, images.dtype, labels
((2, 3, 32, 32), dtype('uint8'), array([3, 8]))
>>> [CIFAR10_CLASSES[i] for i in labels]
['cat', 'ship']
"""
from __future__ import annotations

import contextlib
import os
import tarfile
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ._files import NETWORK_RETRY_AFTER, cache_dir, fetch_checked, unreachable, write_new_file
from ..data import describe

__all__ = ["load_cifar10", "read_cifar_batch", "write_cifar_batch", "extract_batches", "cifar_cache_dir",
           "CIFARUnavailableError", "CIFAR10_CLASSES", "CIFAR10_FILES", "CIFAR10_MEAN", "CIFAR10_STD", "CIFAR10_URL",
           "CIFAR10_MD5"]

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
"""The official binary archive (170 MB)."""
CIFAR10_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
"""The md5 of the archive at :data:`CIFAR10_URL`, checked after every download."""
CIFAR10_ARCHIVE = "cifar-10-binary.tar.gz"
CIFAR10_FOLDER = "cifar-10-batches-bin"
CIFAR10_FILES = {"train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)), "test": ("test_batch.bin",)}
"""The batch files of each split, in the order their images are concatenated."""
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
"""The class names, indexed by label."""
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
"""Per-channel (R, G, B) mean of the training images scaled to [0, 1], for :func:`fluxpy.datasets.normalise`."""
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
"""Per-channel standard deviation of the training images scaled to [0, 1]."""

_SHAPE = (3, 32, 32)
_IMAGE_BYTES = 3 * 32 * 32
_RECORD_BYTES = 1 + _IMAGE_BYTES
_RECORD_TEXT = f"{_RECORD_BYTES}-byte records (1 label byte + 3x32x32 = {_IMAGE_BYTES} pixel bytes)"
_network_failure: list = [None]  # (time.monotonic(), message) of the last failed attempt to reach the server


class CIFARUnavailableError(RuntimeError):
    """CIFAR-10 is not on disk and cannot be downloaded; the message says where to put the files.

    >>> issubclass(CIFARUnavailableError, RuntimeError)
    True
    """


def cifar_cache_dir() -> Path:
    """Where CIFAR-10 is looked for and downloaded by default: ``cifar10`` under the ``cache_dir`` option
    (:mod:`fluxpy.options`), beside :func:`fluxpy.datasets.mnist_cache_dir`.

    >>> cifar_cache_dir().name
    'cifar10'
    """
    return cache_dir("cifar10")


# ---------------------------------------------------------------------------------------------
# One batch file


def read_cifar_batch(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """The images and labels of one CIFAR-10 binary batch file: uint8 ``(N, 3, 32, 32)`` and int64 ``(N,)``.

    ``N`` is the number of 3,073-byte records in the file (10,000 in the official files). A missing
    file, an empty file, a size that is not a whole number of records (a truncated file) and a label
    outside 0..9 are errors naming the file, what was expected and what was found.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "data_batch_1.bin")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(bytes([7]) + bytes(3072) + bytes([1, 2, 3]))
    >>> read_cifar_batch(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: read_cifar_batch: ...data_batch_1.bin has 3076 bytes, not a whole number of 3073-byte records ...
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"read_cifar_batch: {path} {what}; expected a CIFAR-10 binary batch file of "
                                f"{_RECORD_TEXT}")
    return _parse_batch(path.read_bytes(), path)



def _parse_batch(raw: bytes, source) -> tuple[np.ndarray, np.ndarray]:
    if len(raw) == 0:
        raise ValueError(f"read_cifar_batch: {source} is empty; expected {_RECORD_TEXT}")
    whole, rest = divmod(len(raw), _RECORD_BYTES)
    if rest:
        records = "record" if whole == 1 else "records"
        raise ValueError(f"read_cifar_batch: {source} has {len(raw)} bytes, not a whole number of {_RECORD_TEXT}: "
                         f"{whole} whole {records} and {rest} bytes of a truncated one")
    table = np.frombuffer(raw, dtype=np.uint8).reshape(whole, _RECORD_BYTES)
    labels = table[:, 0]
    bad = np.flatnonzero(labels >= len(CIFAR10_CLASSES))
    if bad.size:
        raise ValueError(f"read_cifar_batch: {source} record {bad[0]} (counting from 0) has label {labels[bad[0]]}; "
                         f"expected a class index 0..9 ({bad.size} of {whole} records are out of range)")
    return table[:, 1:].reshape(whole, *_SHAPE), labels.astype(np.int64)


def write_cifar_batch(path: str | os.PathLike, images: np.ndarray, labels: Sequence[int] | np.ndarray) -> None:
    """Store ``images`` (uint8 ``(N, 3, 32, 32)``) and ``labels`` (``N`` ints in 0..9) as a CIFAR-10 binary batch.

    The inverse of :func:`read_cifar_batch`; made for tests and for small stand-in data sets.

    >>> import numpy as np, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "test_batch.bin")
    >>> write_cifar_batch(path, np.full((1, 3, 32, 32), 255, np.uint8), [9])
    >>> int(read_cifar_batch(path)[0].min()), os.path.getsize(path)
    (255, 3073)
    >>> write_cifar_batch(path, np.zeros((1, 32, 32, 3), np.uint8), [9])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: write_cifar_batch expects images of shape (N, 3, 32, 32) uint8, got ... (1, 32, 32, 3) uint8
    """
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim != 4 or images.shape[1:] != _SHAPE or images.dtype != np.uint8:
        raise ValueError(f"write_cifar_batch expects images of shape (N, 3, 32, 32) uint8, got {describe(images)}")
    if labels.shape != (len(images),) or labels.dtype.kind not in "iu":
        raise ValueError(f"write_cifar_batch expects {len(images)} integer labels (one per image), "
                         f"got {describe(labels)}")
    if labels.size and (labels.min() < 0 or labels.max() >= len(CIFAR10_CLASSES)):
        raise ValueError(f"write_cifar_batch expects labels in 0..9, got values from {labels.min()} to {labels.max()}")
    table = np.empty((len(images), _RECORD_BYTES), np.uint8)
    table[:, 0] = labels
    table[:, 1:] = images.reshape(len(images), _IMAGE_BYTES)
    Path(path).write_bytes(table.tobytes())


# ---------------------------------------------------------------------------------------------
# A split from a folder, an archive, or the web


def load_cifar10(split: str = "train", data_dir: str | os.PathLike | None = None, *, dtype=np.float32,
                 download: bool = True, verbose: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The CIFAR-10 ``split`` (``"train"`` or ``"test"``) as ``(images, labels)``, images NCHW ``(N, 3, 32, 32)``.

    ``dtype=np.float32`` (the default, or any float dtype) scales the pixels to ``[0, 1]``;
    ``dtype=np.uint8`` gives the raw bytes (four times smaller, to move to the GPU and augment
    there). ``labels`` is int64 ``(N,)``. ``N`` comes from the files: 50,000 and 10,000 for the
    official ones.

    The batch files (:data:`CIFAR10_FILES`) are looked for in ``data_dir`` (default
    :func:`cifar_cache_dir`): in its sub-folder ``cifar-10-batches-bin``, or in ``data_dir``
    itself. Files that are missing are taken from the archive ``cifar-10-binary.tar.gz`` in
    ``data_dir`` (only the known batch members, written by fluxpy under their own names: a member
    path such as ``../x`` is never followed) and saved into ``data_dir/cifar-10-batches-bin`` for
    next time. Without the archive it is downloaded from :data:`CIFAR10_URL` (170 MB, md5-checked,
    written atomically; ``data_dir`` is created only when that succeeds) unless ``download=False``.
    When none of that gives the files, :class:`CIFARUnavailableError` says where to put them.

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> write_cifar_batch(os.path.join(folder, "test_batch.bin"), np.zeros((2, 3, 32, 32), np.uint8), [0, 9])
    >>> x, y = load_cifar10("test", folder)
    >>> x.shape, x.dtype, y
    ((2, 3, 32, 32), dtype('float32'), array([0, 9]))
    >>> load_cifar10("train", folder, download=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fluxpy.datasets.cifar.CIFARUnavailableError: load_cifar10: the CIFAR-10 train files (data_batch_1.bin, ...
    """
    if not isinstance(split, str) or split not in CIFAR10_FILES:
        raise ValueError(f"load_cifar10: split must be \"train\" or \"test\", got {describe(split)}")
    dtype = _check_dtype(dtype)
    folder = Path(data_dir).expanduser() if data_dir is not None else cifar_cache_dir()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"load_cifar10: data_dir {folder} is a file, not a folder holding {CIFAR10_FOLDER}/ "
                                 f"or {CIFAR10_ARCHIVE}")
    batches = _load_batches(split, folder, download, verbose)
    _check_same_sizes(batches)
    images = np.concatenate([b[1] for b in batches])
    labels = np.concatenate([b[2] for b in batches])
    if dtype != np.uint8:
        images = images.astype(dtype)
        images /= dtype.type(255)  # in place: the float training set is 600 MB
    return images, labels


def _check_dtype(dtype):
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"load_cifar10 expects dtype to be numpy.uint8 or a float dtype, got {describe(dtype)}") \
            from None
    if dtype != np.uint8 and dtype.kind != "f":
        raise ValueError(f"load_cifar10 expects dtype to be numpy.uint8 or a float dtype, got {dtype}")
    return dtype


def _load_batches(split, folder, download, verbose):
    """``[(source, images, labels)]`` for every file of ``split``: those on disk, then the rest from the archive."""
    names = CIFAR10_FILES[split]
    found = {name: _find_batch(folder, name) for name in names}
    missing = [name for name in names if found[name] is None]
    payloads = _missing_payloads(split, folder, missing, download, verbose) if missing else {}
    batches = []
    for name in names:
        if found[name] is not None:
            batches.append((found[name], *read_cifar_batch(found[name])))
        else:
            source = f"{folder / CIFAR10_ARCHIVE}:{CIFAR10_FOLDER}/{name}"
            batches.append((source, *_parse_batch(payloads[name], source)))
    return batches


def _find_batch(folder, name):
    for candidate in (folder / CIFAR10_FOLDER / name, folder / name):
        if candidate.is_file():
            return candidate
    return None


def _missing_payloads(split, folder, missing, download, verbose):
    """The bytes of the ``missing`` batch files, from the archive in ``folder`` or a downloaded one."""
    archive = folder / CIFAR10_ARCHIVE
    if not archive.is_file():
        if not download:
            _unavailable(split, folder, "downloading is switched off (download=False)")
        try:
            _download_archive(archive, verbose)
        except OSError as err:  # URLError, timeouts, a read-only folder, a bad checksum
            _unavailable(split, folder, f"the download of {CIFAR10_URL} failed: {err}")
    payloads = extract_batches(archive, missing)
    _save_extracted(folder / CIFAR10_FOLDER, payloads)
    return payloads


def _unavailable(split, folder, problem):
    names = ", ".join(CIFAR10_FILES[split])
    raise CIFARUnavailableError(
        f"load_cifar10: the CIFAR-10 {split} files ({names}) are not in {folder / CIFAR10_FOLDER} nor {folder}, there "
        f"is no {CIFAR10_ARCHIVE} in {folder}, and {problem}. Options: download {CIFAR10_URL} (md5 {CIFAR10_MD5}) "
        f"and put it, or the {CIFAR10_FOLDER} folder it holds, into {folder} (or pass data_dir= / --data-dir the "
        "folder where it is, or set $FLUXPY_CACHE); or connect to the internet so that it can be downloaded")


def _download_archive(archive, verbose):
    """Fetch the archive (md5-checked) and write it atomically; nothing is written, no folder made, on failure.

    When the server could not be reached, later calls within a few minutes fail at once with the same message.
    """
    failed = _network_failure[0]
    if failed is not None and time.monotonic() - failed[0] < NETWORK_RETRY_AFTER:
        raise OSError(f"{failed[1]} ({time.monotonic() - failed[0]:.0f} s ago; not retried within "
                      f"{NETWORK_RETRY_AFTER} s of that failure)")
    if verbose:
        print(f"fluxpy: downloading {CIFAR10_URL} (170 MB)", flush=True)
    try:
        payload = fetch_checked(CIFAR10_URL, CIFAR10_MD5)
    except OSError as err:
        if unreachable(err):
            _network_failure[0] = (time.monotonic(), str(err))
        raise
    write_new_file(archive, payload)


def extract_batches(archive: str | os.PathLike, names: Sequence[str]) -> dict[str, bytes]:
    """The bytes of the batch files ``names`` (e.g. ``"test_batch.bin"``) inside a CIFAR-10 ``.tar.gz`` archive.

    Only the members ``cifar-10-batches-bin/<name>`` (an optional leading ``./`` allowed) are read,
    in one pass; nothing is written and no member path is ever used as a path on disk, so an
    archive with ``../`` or absolute member names cannot write outside anywhere. A member that is
    a link or anything but a regular file, a name not found, and a corrupt archive are errors
    naming the archive.

    >>> import io, os, tarfile, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "cifar-10-binary.tar.gz")
    >>> with tarfile.open(path, "w:gz") as tar:
    ...     info = tarfile.TarInfo("cifar-10-batches-bin/test_batch.bin"); info.size = 3073
    ...     tar.addfile(info, io.BytesIO(bytes(3073)))
    >>> {k: len(v) for k, v in extract_batches(path, ["test_batch.bin"]).items()}
    {'test_batch.bin': 3073}
    """
    archive = Path(archive)
    wanted = {f"{CIFAR10_FOLDER}/{name}": name for name in names}
    found = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                name = wanted.get(member.name.removeprefix("./"))
                if name is None:
                    continue
                if not member.isfile():
                    raise ValueError(f"extract_batches: {archive} member {member.name} is not a regular file "
                                     "(a link or a special file); refusing to read it")
                found[name] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, zlib.error, OSError) as err:
        raise ValueError(f"extract_batches: {archive} is not a readable .tar.gz archive ({type(err).__name__}: "
                         f"{err})") from err
    absent = [f"{CIFAR10_FOLDER}/{n}" for n in names if n not in found]
    if absent:
        raise ValueError(f"extract_batches: {archive} lacks {', '.join(absent)}; expected the CIFAR-10 binary "
                         f"archive ({CIFAR10_URL})")
    return found


def _save_extracted(target_folder, payloads):
    """Keep the extracted files for next time; a folder that cannot be written only means extracting again."""
    for name, payload in payloads.items():
        with contextlib.suppress(OSError):
            write_new_file(target_folder / name, payload)


def _check_same_sizes(batches):
    """The batches of a split hold the same number of records (10,000 each officially): a file cut short on a
    record boundary is otherwise a valid, smaller file."""
    counts = [len(labels) for _, _, labels in batches]
    if len(set(counts)) > 1:
        first = batches[0]
        odd = next(b for b in batches if len(b[2]) != len(first[2]))
        raise ValueError(f"load_cifar10: {odd[0]} holds {len(odd[2])} records but {first[0]} holds {len(first[2])}; "
                         "every batch file of a split holds the same number (10,000 in the official files): "
                         "is one truncated?")
