"""Embeddings (Flux's ``Embedding`` and ``EmbeddingBag`` of ``src/layers/basic.jl``): rows of a weight matrix
looked up by integer indices (or one-hot rows), and bags of them reduced to one row each.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..autodiff import is_tracked, value_of
from ..backend import get_array_module, gpu_device, is_float_dtype, to_gpu
from ..capturing import refuse
from ..functors import cpu, layer
from ..ops.linalg import matmul
from ..ops.reduce import max as max_
from ..ops.reduce import mean as mean_
from ..ops.reduce import min as min_
from ..ops.reduce import sum as sum_
from ..ops.scatter import gather, scatter
from ..ops.shape import stack
from ._checks import Array, _callable, _fail, _initialised, _positive_int
from .init import RNG, randn32
from .show import _fname


@layer(children=("weight",))
class Embedding:
    """A lookup table: integer indices in ``[0, n)`` pick rows of ``weight``, an ``(n, dim)`` array (Flux's
    ``Embedding(n => dim)``, whose ``(dim, n)`` weight has the same bytes).

    ``x`` of integers, of any shape, gives ``x.shape + (dim,)``; the gradient scatters into the rows used (repeated
    indices accumulate). ``x`` may instead be one-hot, as Flux accepts ``OneHotMatrix`` input: a bool or float array
    whose LAST axis has length ``n`` (fluxpy's :func:`~fluxpy.onehotbatch` gives ``(batch, n)``, the transpose of
    Flux's ``(n, batch)``), giving ``x.shape[:-1] + (dim,)`` as ``x @ weight`` (a float one-hot that is part of the
    computation, a soft selection, gets a gradient too). ``init(n, dim, rng=rng)`` makes the weight. Indices on the
    host are checked here (a ``DimensionMismatch`` naming the layer); indices on the GPU are checked by the
    :func:`~fluxpy.gather` kernel as it reads them, without a host wait: a bad one is raised as an ``IndexError``
    naming the op and the entry where the device is read anyway (the loss :func:`fluxpy.train` reads,
    :func:`fluxpy.check_indices`, the next checked call; ``fluxpy.options.index_checks``).

    ``padding_idx`` (Flux's, 0-based here as PyTorch's): that row starts as zeros and its embedding is masked to
    zero in every output, so it gets no gradient and stays fixed (Flux multiplies the output by the mask; PyTorch
    instead skips the row's gradient but returns whatever the row holds).

    >>> import numpy as np
    >>> e = Embedding(10, 4)
    >>> e, e(np.array([[1, 2, 3]])).shape
    (Embedding(10 => 4), (1, 3, 4))
    >>> from fluxpy import onehotbatch
    >>> bool((e(onehotbatch([2, 0], 10)) == e(np.array([2, 0]))).all())
    True
    >>> p = Embedding(5, 2, padding_idx=0)
    >>> p, p(np.array([0, 1]))[0]
    (Embedding(5 => 2, padding_idx=0), array([0., 0.], dtype=float32))
    """

    padding_idx = None   # the class default: models pickled before padding_idx existed load unchanged

    def __init__(self, n: int, dim: int, init: Callable = randn32, rng: RNG = None, *,
                 padding_idx: int | None = None) -> None:
        n, dim = _positive_int("Embedding", "n", n), _positive_int("Embedding", "dim", dim)
        self.weight = _initialised("Embedding", init, (n, dim), rng)
        self.padding_idx = _padding_index("Embedding", padding_idx, n)
        if self.padding_idx is not None:
            self.weight[self.padding_idx] = 0

    def __call__(self, x: Array | int) -> Array:
        return _embed(self, self.weight, x, self.padding_idx)

    def __repr__(self):
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"Embedding({self.weight.shape[0]} => {self.weight.shape[1]}{pad})"


def _padding_index(who, padding_idx, n):
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, (int, np.integer)) or not 0 <= padding_idx < n:
        raise ValueError(f"{who}: padding_idx must be an int in [0, {n}) or None, got {padding_idx!r}")
    return int(padding_idx)


def _is_onehot(x):
    """Whether an Embedding input is one-hot rows (bool or float) rather than indices."""
    return is_tracked(x) or hasattr(x, "dtype") and (np.dtype(x.dtype).kind == "b" or is_float_dtype(x.dtype))


def _embed(layer, weight, x, padding_idx):
    """``Embedding``'s lookup of integer indices or one-hot rows in ``weight`` (``n``, ``dim``), checked against
    ``layer``, with the ``padding_idx`` mask."""
    n = weight.shape[0]
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        x = np.asarray(x)
    if _is_onehot(x):
        if len(x.shape) < 1 or x.shape[-1] != n:
            _fail(layer, f"integer indices, or one-hot rows of length {n} (the last axis)", x)
        xv = value_of(x)
        if not is_tracked(x) and xv.dtype != weight.dtype:
            x = xv.astype(weight.dtype)            # 0/1 data: exact in the weight's dtype
        x = _on_weight_device(x, weight)           # host one-hot rows for a GPU table, as host indices are taken
        y = matmul(x, weight)
        if padding_idx is None:
            return y
        return y * (1 - x[..., padding_idx:padding_idx + 1])    # Flux's mask, differentiable in a soft x
    if not hasattr(x, "dtype") or np.dtype(x.dtype).kind not in "iu":
        _fail(layer, f"integer indices, or one-hot rows of length {n} (bool or float)", x)
    if isinstance(x, np.ndarray) and x.size and (x.min() < 0 or x.max() >= n):   # host indices: no device read
        _fail(layer, f"indices in [0, {n}), found indices from {int(x.min())} to {int(x.max())} in x", x)
    # Device indices are checked by the gather kernel as it reads them, never read back here (a host read would be a
    # sync in every step, which a captured step cannot have); options.index_checks says when a bad one is raised.
    y = gather(weight, x)
    if padding_idx is None:
        return y
    return y * _on_weight_device((x != padding_idx)[..., None].astype(y.dtype), weight)


def _on_weight_device(a, weight):
    """A plain host array ``a`` moved to the GPU where ``weight`` is there (inputs such as token ids and one-hot
    rows come from the host); anything else unchanged."""
    if isinstance(a, np.ndarray) and gpu_device(value_of(weight)) is not None:
        return to_gpu(a)
    return a


# Ragged bags at once: a sum or mean as one scatter over all bags; a max or min over bags padded to one length by
# repeating each bag's last item (a repeat changes neither, and ties share the gradient, so a row's total is right)
_SCATTER_REDUCTIONS = {mean_: "mean", sum_: "+", np.mean: "mean", np.sum: "+"}
_PADDED_REDUCTIONS = {max_, min_, np.max, np.min}


@layer(children=("weight",))
class EmbeddingBag:
    """A lookup table whose input is bags of indices, each bag's embeddings reduced to one by ``reduction`` (Flux's
    ``EmbeddingBag(n => dim, reduction=mean)``; PyTorch's ``nn.EmbeddingBag``): ``weight`` is ``(n, dim)``.

    ``reduction(e, axis=...)`` reduces the ``(..., L, dim)`` embeddings of bags of ``L`` items along their item axis:
    ``fluxpy.mean`` (the default), ``fluxpy.sum``, ``fluxpy.max`` or any such function. Inputs, batch first (Flux's
    bags run along the first axis of its column-major arrays, so they run along the last here):

    - an integer array ``(..., L)``: bags of ``L`` items along the last axis, giving ``(..., dim)``; a 1-d array is
      one bag, ``(dim,)``;
    - a list of bags (1-d integer arrays or lists, of any lengths, or one-hot ``(L, n)`` arrays): ``(nbags, dim)``;
    - ``(data, offsets)``: the 1-d integer ``data`` cut into bags starting at each of ``offsets``, which must start at
      0 and increase strictly, every bag non-empty (Flux's ``eb(data, at)`` with 0-based ``at``; PyTorch's
      ``offsets``): ``(len(offsets), dim)``;
    - one-hot: a bool or float array ``(..., L, n)``, bags of ``L`` one-hot rows (a single one-hot vector is an
      error, as in Flux).

    Ragged bags run at once for ``mean`` and ``sum`` (one ``scatter``) and ``max`` and ``min`` (bags padded by
    repeating their last item), bag by bag for other reductions. ``max`` shares the gradient among tied items, as
    ``fluxpy.max`` does (PyTorch's ``mode="max"`` gives it to one), so a repeated index gets it once in total.

    >>> import numpy as np
    >>> import fluxpy
    >>> eb = EmbeddingBag(26, 3, init=lambda n, d, rng=None: 100 * np.eye(n, d, dtype=np.float32))
    >>> eb, eb(np.array([2, 2, 0])).round(3)              # Flux basic.jl's example, 0-based
    (EmbeddingBag(26 => 3), array([33.333,  0.   , 66.667], dtype=float32))
    >>> eb([[2, 0, 2], [1, 0]]).round(3)
    array([[33.333,  0.   , 66.667],
           [50.   , 50.   ,  0.   ]], dtype=float32)
    >>> eb(np.array([10, 0, 11, 1, 12, 2, 13]), np.array([0, 3])).round(3)
    array([[33.333,  0.   ,  0.   ],
           [ 0.   , 25.   , 25.   ]], dtype=float32)
    >>> EmbeddingBag(26, 3, fluxpy.sum)
    EmbeddingBag(26 => 3, sum)
    """

    def __init__(self, n: int, dim: int, reduction: Callable | None = None, init: Callable = randn32,
                 rng: RNG = None) -> None:
        n, dim = _positive_int("EmbeddingBag", "n", n), _positive_int("EmbeddingBag", "dim", dim)
        self.weight = _initialised("EmbeddingBag", init, (n, dim), rng)
        self.reduction = mean_ if reduction is None else _callable("EmbeddingBag", "reduction", reduction)

    def __call__(self, x: Array | Sequence, offsets: Array | Sequence | None = None) -> Array:
        if offsets is not None:
            return self._ragged(*_split_offsets(self, x, offsets))
        if isinstance(x, (list, tuple)):
            if not x:
                raise ValueError(f"{self!r} expects at least one bag, got an empty {type(x).__name__}")
            if all(_is_onehot(b) for b in x):
                return stack([self(b) for b in x])
            bags = [_bag_indices(self, b) for b in x]
            lengths = [len(b) for b in bags]
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            return self._ragged(np.concatenate(bags), starts, lengths)
        if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
            raise ValueError(f"{self!r} expects an array of indices (a bag), not just one index {x!r}")
        if _is_onehot(x) and len(x.shape) < 2:
            _fail(self, f"a bag of one-hot rows (L, {self.weight.shape[0]}), not a one-hot vector", x)
        if hasattr(x, "shape") and len(x.shape) == 0:
            _fail(self, "an array of indices (a bag), not just one", x)
        e = _embed(self, self.weight, x, None)               # (..., L, dim)
        return self.reduction(e, axis=-2)

    def _ragged(self, data, starts, lengths):
        """Bags ``data[starts[i]:starts[i] + lengths[i]]`` of the host integer array ``data``."""
        xp = get_array_module(value_of(self.weight))
        e = _embed(self, self.weight, xp.asarray(data), None)   # (total, dim)
        known = _hashable(self.reduction)
        op = _SCATTER_REDUCTIONS.get(self.reduction) if known else None
        if op is not None:
            bag = np.repeat(np.arange(len(lengths)), lengths)
            return scatter(op, e, xp.asarray(bag), dstsize=(len(lengths), e.shape[1]))
        if known and self.reduction in _PADDED_REDUCTIONS:
            item = np.minimum(np.arange(max(lengths))[None, :], np.asarray(lengths)[:, None] - 1)
            return self.reduction(e[xp.asarray(np.asarray(starts)[:, None] + item)], axis=1)
        return stack([self.reduction(e[int(s):int(s) + int(n)], axis=0) for s, n in zip(starts, lengths)])

    def __repr__(self):
        shown = "" if self.reduction is mean_ else f", {_fname(self.reduction)}"
        return f"EmbeddingBag({self.weight.shape[0]} => {self.weight.shape[1]}{shown})"


def _hashable(f):
    try:
        hash(f)
    except TypeError:
        return False
    return True


def _bag_indices(layer, bag):
    """One bag of a list: a non-empty 1-d host integer array."""
    _refuse_device_bags(layer, bag)
    b = np.asarray(cpu(value_of(bag)) if hasattr(bag, "shape") else bag)
    if b.ndim != 1 or b.size == 0 or b.dtype.kind not in "iu":
        _fail(layer, "bags that are non-empty 1-d sequences of integer indices", b)
    return b


def _refuse_device_bags(layer, a):
    """Ragged bags are cut on the host, which reads device indices back: refused inside a captured step."""
    if gpu_device(value_of(a)) is not None:
        refuse(f"{layer!r}: ragged bags (a list, or data with offsets) are cut on the host, which reads device "
               "indices; in a captured step give bags of one length as an (..., L) device array")


def _split_offsets(layer, data, offsets):
    """``(data, starts, lengths)`` on the host for Flux's ``eb(data, at)``, checked as Flux's ``_splitat``."""
    _refuse_device_bags(layer, offsets)
    d = _bag_indices(layer, data)
    at = np.asarray(cpu(value_of(offsets)) if hasattr(offsets, "shape") else offsets)
    if at.ndim != 1 or at.size == 0 or at.dtype.kind not in "iu":
        raise ValueError(f"{layer!r} expects offsets to be a non-empty 1-d sequence of integers, got {at!r}")
    if at[0] != 0 or at[-1] >= len(d) or (np.diff(at) <= 0).any():
        raise ValueError(f"{layer!r} expects offsets that start at 0, increase strictly and stay below "
                         f"len(data) == {len(d)} (every bag non-empty), got {at.tolist()}")
    return d, at, np.diff(np.append(at, len(d)))
