"""Saving and loading a model's arrays: :func:`save` and :func:`load`.

The model's :func:`fluxpy.state` (every array, trainable or not) is written to a NumPy ``.npz``
file under flattened keys such as ``"layers.0.weight"``. ``load`` copies them back into a model
of the same structure, in place. Arrays round-trip bit for bit; GPU arrays are saved as NumPy
arrays and loaded into whatever device the target model uses.

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

import os
from pathlib import Path
from typing import Any

import numpy as np

from .functors import cpu, loadstate, state

__all__ = ["save", "load", "flat_state"]


def flat_state(model: Any) -> dict:
    """The model's arrays under dotted paths: ``{"layers.0.weight": array, ...}``.

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
            out[prefix[:-1]] = st
    walk(state(model), "")
    return out


def save(path: str | os.PathLike, model: Any) -> None:
    """Write every array of ``model`` to the ``.npz`` file ``path`` (as NumPy arrays).

    The suffix ``.npz`` is added when missing, as ``numpy.savez`` does. Keys are the dotted
    paths of :func:`flat_state`.

    >>> import numpy as np, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "m")
    >>> save(path, {"w": np.ones(2, np.float32)})
    >>> os.path.exists(path + ".npz")
    True
    """
    arrays = {key: np.asarray(cpu(a)) for key, a in flat_state(model).items()}
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)  # never leave a half-written file under the real name


def load(path: str | os.PathLike, model: Any) -> Any:
    """Copy the arrays saved in ``path`` into ``model`` in place, and return ``model``.

    The file must hold exactly the model's arrays (same keys, same shapes); otherwise a
    ``ValueError`` names the missing, unexpected or mismatched keys with both shapes. Values
    are cast to the model's dtypes and copied to its device.

    >>> import numpy as np, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "m.npz")
    >>> save(path, {"w": np.ones(2)})
    >>> load(path, {"w": np.ones(3)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: load: w has shape (3,) in the model but (2,) in ...m.npz
    """
    path = Path(path)
    if not path.exists() and path.with_name(path.name + ".npz").exists():
        path = path.with_name(path.name + ".npz")
    with np.load(path, allow_pickle=False) as archive:
        saved = {key: archive[key] for key in archive.files}
    _check_match(flat_state(model), saved, path)
    loadstate(model, _nested_like(state(model), saved, ""))
    return model


def _check_match(expected, saved, path):
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the file: {', '.join(missing)}")
        if unexpected:
            parts.append(f"not in the model: {', '.join(unexpected)}")
        raise ValueError(f"load: {path} does not fit the model ({'; '.join(parts)})")
    for key, array in expected.items():
        if tuple(array.shape) != tuple(saved[key].shape):
            raise ValueError(f"load: {key} has shape {tuple(array.shape)} in the model but "
                             f"{tuple(saved[key].shape)} in {path}")


def _nested_like(template, saved, prefix):
    """The nested state of :func:`fluxpy.state`, shaped like ``template``, with the saved arrays as leaves."""
    if isinstance(template, dict):
        return {k: _nested_like(v, saved, f"{prefix}{k}.") for k, v in template.items()}
    if isinstance(template, list):
        return [_nested_like(v, saved, f"{prefix}{i}.") for i, v in enumerate(template)]
    return None if template is None else saved[prefix[:-1]]
