"""What the dataset loaders share: the cache folder, checked downloads, atomic writes.

>>> cache_dir("mnist").name
'mnist'
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path


from ..options import options

DOWNLOAD_TIMEOUT = 10  # seconds per network operation
NETWORK_RETRY_AFTER = 300  # seconds: after the server could not be reached, do not try again for this long


def cache_dir(name: str) -> Path:
    """The folder of data set ``name``: ``<name>`` under the ``cache_dir`` option (:mod:`fluxpy.options`).

    >>> cache_dir("cifar10").name
    'cifar10'
    """
    return Path(options.cache_dir) / name


def fetch_checked(url: str, md5: str, timeout: float | None = None) -> bytes:
    """The bytes at ``url``, checked against ``md5`` (an OSError if they do not match).

    >>> fetch_checked("file:///dev/null", "d41d8cd98f00b204e9800998ecf8427e")
    b''
    """
    with urllib.request.urlopen(url, timeout=timeout or DOWNLOAD_TIMEOUT) as response:
        payload = response.read()
    digest = hashlib.md5(payload).hexdigest()
    if digest != md5:
        raise OSError(f"md5 {digest} does not match the expected {md5}")
    return payload


def unreachable(err: OSError) -> bool:
    """Whether ``err`` says the server could not be reached (rather than that it answered with an error).

    >>> unreachable(urllib.error.URLError("no route")), unreachable(OSError("md5 ... does not match"))
    (True, False)
    """
    return isinstance(err, (urllib.error.URLError, TimeoutError, ConnectionError)) and \
        not isinstance(err, urllib.error.HTTPError)


def write_new_file(target: Path, payload: bytes) -> Path:
    """Write ``payload`` to ``target`` atomically, making its folder (and parents) only now; undone on failure.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "new" / "file.bin"
    >>> write_new_file(path, b"abc").read_bytes()
    b'abc'
    """
    made = []
    for folder in reversed([target.parent, *target.parent.parents]):
        if not folder.exists():
            made.append(folder)
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, target)
        tmp = None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            for folder in reversed(made):
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only if still empty
    return target


