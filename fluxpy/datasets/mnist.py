"""MNIST (LeCun et al. 1998) from its IDX files: :func:`load_mnist`, and :func:`read_idx`/:func:`write_idx` for the
format.

>>> import numpy as np, os, tempfile
>>> folder = tempfile.mkdtemp()
>>> write_idx(os.path.join(folder, "t10k-images-idx3-ubyte.gz"), np.zeros((2, 28, 28), np.uint8))
>>> write_idx(os.path.join(folder, "t10k-labels-idx1-ubyte.gz"), np.array([4, 2], np.uint8))
>>> x, y = load_mnist("test", folder, download=False)
>>> x.shape, y
((2, 1, 28, 28), array([4, 2]))
"""
from __future__ import annotations

import gzip
import os
import struct
import time
import warnings
import zlib
from pathlib import Path

import numpy as np

from ._files import NETWORK_RETRY_AFTER, cache_dir, fetch_checked, unreachable, write_new_file
from ..data import describe, short

__all__ = ["load_mnist", "read_idx", "write_idx", "mnist_cache_dir", "MNISTUnavailableError", "MNIST_FILES",
           "MNIST_MIRRORS"]


# ---------------------------------------------------------------------------------------------
# IDX files


_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """The array stored in an IDX file (raw, or gzip-compressed when the name ends in .gz).

    The header gives the element type and the dimensions; the data size must match them.

    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "tiny-idx1-ubyte")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9]))
    >>> read_idx(path)
    array([7, 8, 9], dtype=uint8)
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise ValueError(f"read_idx: {path} is a corrupt or truncated gzip file ({type(err).__name__}: "
                         f"{short(err, 200)})") from err
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"read_idx: {path} is not an IDX file (bad magic number {raw[:4].hex()})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"read_idx: {path} is truncated: its header needs {header} bytes for {ndim} dimensions, "
                         f"the file has {len(raw)}")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"read_idx: {path} has {len(raw) - header} bytes of data but its header {dims} "
                         f"({dtype}) needs {expected}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Store ``array`` (uint8, int8, int16, int32, float32 or float64) as an IDX file.

    Gzip-compressed when ``path`` ends in .gz. The inverse of :func:`read_idx`.

    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "a-idx2-ubyte.gz")
    >>> write_idx(path, np.arange(6, dtype=np.uint8).reshape(2, 3))
    >>> read_idx(path)
    array([[0, 1, 2],
           [3, 4, 5]], dtype=uint8)
    """
    array = np.asarray(array)
    codes = {np.dtype(v).newbyteorder("="): k for k, v in _IDX_TYPES.items()}
    code = codes.get(array.dtype.newbyteorder("="))
    if code is None:
        raise ValueError(f"write_idx: IDX cannot store dtype {array.dtype}")
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(_IDX_TYPES[code], copy=False).tobytes()
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(payload)


# ---------------------------------------------------------------------------------------------
# MNIST

MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)


class MNISTUnavailableError(RuntimeError):
    """MNIST is not on disk, cannot be downloaded, and no offline copy is installed; the message lists the options.

    >>> issubclass(MNISTUnavailableError, RuntimeError)
    True
    """


def mnist_cache_dir() -> Path:
    """Where downloaded MNIST files live: ``mnist`` under the ``cache_dir`` option (:mod:`fluxpy.options`).

    >>> mnist_cache_dir().name
    'mnist'
    """
    return cache_dir("mnist")


def load_mnist(split: str = "train", data_dir: str | os.PathLike | None = None, *, download: bool = True,
               fallback: bool = True, verbose: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The MNIST ``split`` (``"train"`` or ``"test"``) as ``(images, labels)``.

    ``images`` is float32 ``(N, 1, 28, 28)`` in ``[0, 1]``, ``labels`` int64 ``(N,)``; ``N`` comes
    from the files (60,000/10,000 for the full sets). The IDX files
    (``train-images-idx3-ubyte.gz`` ..., raw or gzipped) are read from ``data_dir``, else from
    :func:`mnist_cache_dir`. Missing files are downloaded there (md5-checked, trying each of
    ``MNIST_MIRRORS`` with a 10 s timeout; the folder is created only when a file is written
    into it) unless ``download=False``. When that fails (offline), and ``fallback`` is true,
    the MNIST subset fluxpy ships as package data is used, with a ``UserWarning`` saying so:
    5,000 training images (500 per digit) as ``"train"`` and the official 10,000 test images as
    ``"test"`` (CC BY-SA 3.0; see ``fluxpy/datasets/data/mnist/README.md``). Otherwise
    :class:`MNISTUnavailableError` lists the options.

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> write_idx(os.path.join(folder, "t10k-images-idx3-ubyte.gz"), np.zeros((3, 28, 28), np.uint8))
    >>> write_idx(os.path.join(folder, "t10k-labels-idx1-ubyte"), np.array([7, 2, 1], np.uint8))
    >>> x, y = load_mnist("test", folder)
    >>> x.shape, x.dtype, y
    ((3, 1, 28, 28), dtype('float32'), array([7, 2, 1]))
    """
    if not isinstance(split, str) or split not in MNIST_FILES:
        raise ValueError(f"load_mnist: split must be \"train\" or \"test\", got {describe(split)}")
    folder = Path(data_dir).expanduser() if data_dir is not None else mnist_cache_dir()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"load_mnist: data_dir {folder} is a file, not a folder of MNIST IDX files")
    paths = [_find_idx(folder, name) for name in MNIST_FILES[split]]
    problem = None
    if any(p is None for p in paths) and download:
        try:
            paths = [p if p is not None else _download_mnist_file(folder, name, verbose)
                     for p, name in zip(paths, MNIST_FILES[split])]
        except OSError as err:  # URLError, timeouts, a read-only folder, a bad checksum
            problem = f"the download failed: {err}"
    if all(p is not None for p in paths):
        return _mnist_arrays(read_idx(paths[0]), read_idx(paths[1]), paths)
    problem = problem or "downloading is switched off (download=False)"
    return _mnist_offline(split, folder, problem, fallback)


def _find_idx(folder, gz_name):
    for candidate in (folder / gz_name, folder / gz_name[:-3]):
        if candidate.is_file():
            return candidate
    return None


def _mnist_arrays(images, labels, paths=("images", "labels")):
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f"load_mnist: {paths[0]} holds {images.shape} images and {paths[1]} {labels.shape} labels; "
                         "expected (N, 28, 28) and (N,)")
    x = (images.astype(np.float32) / np.float32(255))[:, None, :, :]
    return x, labels.astype(np.int64)


_network_failure: list = [None]  # (time.monotonic(), message) of the last time no mirror answered


def _download_mnist_file(folder, name, verbose=True):
    """Fetch one file from the first mirror that serves it with the right md5; raises OSError if none does.

    Nothing is written (no folder is made) unless a download succeeds. When no mirror could be
    reached, later calls in the next few minutes fail at once with the same message.
    """
    failed = _network_failure[0]
    if failed is not None and time.monotonic() - failed[0] < NETWORK_RETRY_AFTER:
        raise OSError(f"no MNIST mirror answered {time.monotonic() - failed[0]:.0f} s ago, so {name} was not tried "
                      f"(not retried within {NETWORK_RETRY_AFTER} s of that failure)")
    errors, none_answered = [], True
    for mirror in MNIST_MIRRORS:
        url = mirror + name
        try:
            if verbose:
                print(f"fluxpy: downloading {url}", flush=True)
            payload = fetch_checked(url, MNIST_MD5[name])
        except OSError as err:
            none_answered &= unreachable(err)
            errors.append(f"{url}: {err}")
            continue
        return write_new_file(folder / name, payload)
    message = "; ".join(errors)
    if none_answered:
        _network_failure[0] = (time.monotonic(), message)
    raise OSError(message)


def _packaged_mnist_dir():
    """The folder of the MNIST subset shipped with fluxpy (package data: 5,000 training images, 500 per digit, and
    the official 10,000 test images, in IDX), or None where the installation lacks it."""
    folder = Path(__file__).resolve().parent / "data" / "mnist"
    return folder if all((folder / name).is_file() for names in MNIST_FILES.values() for name in names) else None


def _mnist_offline(split, folder, problem, fallback=True):
    packaged = _packaged_mnist_dir() if fallback else None
    if packaged is None:
        names = ", ".join(MNIST_FILES[split])
        last = ("reinstall fluxpy with its package data (the 5,000-image subset it ships)" if fallback else
                "pass fallback=True to use the 5,000-image subset fluxpy ships")
        raise MNISTUnavailableError(
            f"load_mnist: the MNIST {split} files ({names}) are not in {folder} and {problem}. Options: "
            f"pass data_dir= a folder holding the IDX files (raw or .gz); copy them into {folder} "
            f"(or set $FLUXPY_CACHE); connect to the internet so they can be downloaded; or {last}")
    warnings.warn(f"MNIST {split} files not found in {folder} and {problem}; using the MNIST subset shipped with "
                  f"fluxpy ({packaged}): 5,000 training images (500 per digit) and the official 10,000 test images",
                  stacklevel=3)
    paths = [packaged / name for name in MNIST_FILES[split]]
    return _mnist_arrays(read_idx(paths[0]), read_idx(paths[1]), paths)
