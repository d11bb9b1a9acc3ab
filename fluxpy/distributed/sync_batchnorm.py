"""Batch normalisation with statistics over every rank's batch: :class:`SyncBatchNorm` (PyTorch's
``SyncBatchNorm``), and the differentiable all-reduce it is built on, :func:`all_reduce_sum`.

In training each rank sums ``x`` and ``x * x`` per channel over its own batch, and one all-reduce of
``[sums, sums of squares, count]`` gives every rank the statistics of the whole global batch. The pullback of an
all-reduced sum is the all-reduced sum of the cotangents, so the backward pass is exact too (one more all-reduce).
It runs as a composite of fluxpy ops (not the fused batch-norm kernels), so it costs more than :class:`BatchNorm`;
per-rank statistics (plain ``BatchNorm``) stay the default.

>>> import numpy as np
>>> from fluxpy.layers import BatchNorm, Chain
>>> m = convert_sync_batchnorm(Chain(BatchNorm(2)))
>>> type(m[0]).__name__
'SyncBatchNorm'
"""
from __future__ import annotations

from typing import Any

from ..autodiff import Primitive, no_grad, value_of
from ..journal import changing
from ..backend import get_array_module
from ..functors import children, layer
from ..layers import BatchNorm
from ..layers.normalise import is_active
from ..ops import bias_act, concatenate, sqrt
from ..ops import sum as _sum
from .group import ProcessGroup, get_group

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "all_reduce_sum"]


def _all_reduce_rule(x, group):
    y = group.all_reduce(get_array_module(x).array(x, copy=True), "sum")

    def all_reduce_pullback(dy):
        return (all_reduce_sum(dy, group),)
    return y, all_reduce_pullback


_all_reduce = Primitive("all_reduce_sum", _all_reduce_rule,
                        impl=lambda x, group: group.all_reduce(get_array_module(x).array(x, copy=True), "sum"))


def all_reduce_sum(x: Any, group: ProcessGroup | None = None) -> Any:
    """The sum of ``x`` over the ranks of ``group`` (the default group), differentiable: its pullback all-reduces
    the cotangent (every rank's loss depends on every rank's ``x``). ``x`` itself is not changed.

    >>> import numpy as np
    >>> from fluxpy.distributed import init
    >>> all_reduce_sum(np.array([1.0, 2.0]), init())   # one rank
    array([1., 2.])
    """
    return _all_reduce(x, group=get_group() if group is None else group)


@layer(children=("gamma", "beta", "running_mean", "running_var"), trainable=("gamma", "beta"))
class SyncBatchNorm(BatchNorm):
    """:class:`fluxpy.BatchNorm` whose training statistics are those of the global batch (every rank's), summed
    over ``group`` (the default group). Outside training, and in a group of one, it is ``BatchNorm``.

    >>> import numpy as np, fluxpy
    >>> bn = SyncBatchNorm(2)
    >>> x = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> _ = fluxpy.gradient(lambda m: m(x).sum(), bn)
    >>> bn.running_mean     # as BatchNorm's in one process
    array([0.3, 0.4], dtype=float32)
    """

    def __init__(self, channels: int, *args: Any, group: ProcessGroup | None = None, **kw: Any) -> None:
        super().__init__(channels, *args, **kw)
        self._group = group

    @classmethod
    def from_batchnorm(cls, bn: BatchNorm, group: ProcessGroup | None = None) -> SyncBatchNorm:
        """A SyncBatchNorm sharing ``bn``'s arrays and options.

        >>> SyncBatchNorm.from_batchnorm(BatchNorm(3))
        SyncBatchNorm(3)
        """
        new = object.__new__(cls)
        new.__dict__.update(bn.__dict__)
        new._group = group
        return new

    def __call__(self, x: Any) -> Any:
        group = self._group if self._group is not None else get_group()
        training = self.running_mean is None or is_active(self, x, self.gamma, self.beta)
        if group.world_size == 1 or not training or not hasattr(x, "shape") or len(x.shape) < 2 \
                or x.shape[1] != self.channels:
            return super().__call__(x)   # (and BatchNorm's own shape errors)
        c = self.channels
        axes = (0,) + tuple(range(2, len(x.shape)))
        shape = (1, c) + (1,) * (len(x.shape) - 2)
        xp = get_array_module(value_of(x))
        count = xp.full((1,), value_of(x).size // c, dtype=value_of(x).dtype)
        stats = all_reduce_sum(concatenate([_sum(x, axis=axes), _sum(x * x, axis=axes), count]), group)
        n = stats[2 * c:]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        y = (x - mean.reshape(shape)) / sqrt(var + self.eps).reshape(shape)
        if self.gamma is not None:
            y = y * self.gamma.reshape(shape) + self.beta.reshape(shape)
        if self.running_mean is not None:
            with no_grad():
                m, nv = self.momentum, value_of(n)
                rm, rv = value_of(self.running_mean), value_of(self.running_var)
                with changing(rm, rv):
                    rm[...] = (1 - m) * rm + m * value_of(mean)
                    rv[...] = (1 - m) * rv + m * value_of(var) * nv / (nv - 1)
        return bias_act(y, None, self.act)

    def __repr__(self) -> str:
        return "Sync" + super().__repr__()


def convert_sync_batchnorm(model: Any, group: ProcessGroup | None = None) -> Any:
    """``model`` with every :class:`fluxpy.BatchNorm` replaced (in place where the tree allows: layers, lists,
    dicts; tuples are rebuilt) by a :class:`SyncBatchNorm` sharing its arrays. Returns the model.

    >>> convert_sync_batchnorm(BatchNorm(4))
    SyncBatchNorm(4)
    """
    if type(model) is BatchNorm:
        return SyncBatchNorm.from_batchnorm(model, group)
    kids = children(model)
    if kids is None:
        return model
    new = [(k, convert_sync_batchnorm(v, group)) for k, v in kids]
    if isinstance(model, tuple):
        vals = [v for _, v in new]
        return type(model)._make(vals) if hasattr(type(model), "_make") else type(model)(vals)
    for (k, old), (_, v) in zip(kids, new):
        if v is not old:
            if isinstance(model, (list, dict)):
                model[k] = v
            else:
                object.__setattr__(model, k, v)
    return model
