"""Choices kept on disk between runs: one JSON file per GPU model, cuDNN version and table.

The legacy path keeps its ranked algorithms in the table ``""`` (``<GPU>-cudnn<version>.json``), the graph path
its chosen engine configurations in ``"graph"`` (``<GPU>-cudnn<version>-graph.json``), both under
:func:`cache_dir`. A write merges what other processes wrote meanwhile and replaces the file atomically; a
read-only or missing home leaves the in-memory table working.

>>> cache_dir().endswith("cudnn")
True
>>> t = DiskTable("doc-example"); t.get("no such key") is None
True
"""
from __future__ import annotations

import json
import os

from ...backend import cupy
from ...options import options
from . import library

__all__ = ["cache_dir", "DiskTable"]


def cache_dir() -> str:
    """The folder ``cudnn`` under the ``cache_dir`` option (:mod:`fluxpy.options`).

    >>> with options(cache_dir="/tmp/fx"):
    ...     cache_dir()
    '/tmp/fx/cudnn'
    """
    return os.path.join(options.cache_dir, "cudnn")


def _gpu_name() -> str:
    try:
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        name = "gpu"
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


class DiskTable:
    """A ``{key: JSON value}`` table in the file :meth:`path` (read on first use, re-read when the path changes,
    e.g. when the ``cache_dir`` option does).

    >>> DiskTable("graph").name
    'graph'
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._loaded = None   # (path, dict)

    def path(self) -> str | None:
        """The file for this GPU model and cuDNN version (None without CuPy or cuDNN)."""
        if cupy is None or library.load() is None:
            return None
        suffix = f"-{self.name}" if self.name else ""
        return os.path.join(cache_dir(), f"{_gpu_name()}-cudnn{library.version()}{suffix}.json")

    def _table(self):
        path = self.path()
        if self._loaded is None or self._loaded[0] != path:
            self._loaded = (path, _read(path) if path else {})
        return self._loaded

    def get(self, key: str):
        """The value stored under ``key``, or None."""
        return self._table()[1].get(key)

    def put(self, key: str, value) -> None:
        """Store ``value`` under ``key`` in memory and in the file."""
        path, table = self._table()
        table[key] = value
        if not path:
            return
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            table.update({k: v for k, v in _read(path).items() if k not in table})   # other processes' rows
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(table, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
        except OSError:
            pass   # a read-only home: the in-memory table still works

    def forget(self, disk: bool = False) -> None:
        """Drop the table from memory (re-read on next use); with ``disk=True`` also delete the file."""
        self._loaded = None
        path = self.path() if disk else None
        if path and os.path.exists(path):
            os.remove(path)


def _read(path) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}
