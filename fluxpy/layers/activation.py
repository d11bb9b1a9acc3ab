"""Activation layers with parameters (PyTorch's ``torch.nn.PReLU``; Flux has none): PReLU."""
from __future__ import annotations

import numpy as np

from ..autodiff import value_of
from ..functors import layer
from ..ops.basic import where
from ..ops.shape import reshape
from ._checks import Array, _fail, _number, _positive_int, _require_dtype


@layer(children=("weight",))
class PReLU:
    """The parametric ReLU: ``y = x if x > 0 else weight * x``, with a learnt slope ``weight`` (He et al. 2015;
    PyTorch's ``PReLU(num_parameters=1, init=0.25)``).

    ``weight`` has ``num_parameters`` entries, all ``init``: one slope shared by every entry of ``x``, or one per
    channel, ``x.shape[1] == num_parameters`` (``x`` of shape ``(N, C, ...)``). Its derivative at 0 is ``weight``,
    as PyTorch's. ``x`` must have the weight's dtype (float32; see :class:`Dense`).

    >>> import numpy as np
    >>> act = PReLU(2, init=0.1)
    >>> act, act(np.array([[-1.0, -2.0], [3.0, 4.0]], np.float32))
    (PReLU(2, init=0.1), array([[-0.1, -0.2],
           [ 3. ,  4. ]], dtype=float32))
    """

    def __init__(self, num_parameters: int = 1, init: float = 0.25) -> None:
        n = _positive_int("PReLU", "num_parameters", num_parameters)
        self.init = _number("PReLU", "init", init, -np.inf)
        self.weight = np.full((n,), init, np.float32)

    def __call__(self, x: Array) -> Array:
        n = self.weight.shape[0]
        if not hasattr(x, "shape") or n > 1 and (len(x.shape) < 2 or x.shape[1] != n):
            _fail(self, f"x.shape[1] == {n} (x of shape (N, C, ...), one slope per channel)", x)
        _require_dtype(self, x, self.weight.dtype)
        shape = (1, n) + (1,) * (len(x.shape) - 2) if n > 1 else (1,) * len(x.shape)
        return where(value_of(x) > 0, x, reshape(self.weight, shape) * x)

    def __repr__(self):
        n = self.weight.shape[0]
        return f"PReLU({n}" + (f", init={self.init}" if self.init != 0.25 else "") + ")"
