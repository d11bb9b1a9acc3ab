"""A sequence classifier: an LSTM over the sequence, its last output to a ``Dense`` layer: :func:`lstm_classifier`.

>>> import numpy as np
>>> model = lstm_classifier(32, 128, rng=0)
>>> model[0], model[1].__name__, model[2]
(LSTM(32 => 128), 'last_step', Dense(128 => 10))
>>> model(np.random.default_rng(0).standard_normal((4, 100, 32), dtype=np.float32)).shape
(4, 10)
"""
from __future__ import annotations

import numbers

from ..layers import LSTM, Chain, Dense
from ..random import RNG, as_rng

__all__ = ["lstm_classifier", "last_step"]


def last_step(x):
    """The last time step of a batch-first sequence: ``(N, T, features)`` -> ``(N, features)``.

    >>> import numpy as np
    >>> last_step(np.arange(6).reshape(1, 3, 2))
    array([[4, 5]])
    """
    return x[:, -1]


def lstm_classifier(in_features: int = 32, hidden: int = 128, classes: int = 10, *, rng: RNG = None) -> Chain:
    """``Chain(LSTM(in_features => hidden), last_step, Dense(hidden => classes))`` for ``(N, T, in_features)``
    sequences (batch first): the LSTM's output at the last step (its final hidden state) gives the class logits.
    ``rng``: a ``numpy.random.Generator``, an int seed, or ``None`` for fluxpy's global generator
    (:func:`fluxpy.seed`).

    >>> lstm_classifier(8, 16, 3, rng=0)[-1]
    Dense(16 => 3)
    """
    who = "lstm_classifier"
    if isinstance(classes, bool) or not isinstance(classes, numbers.Integral) or classes < 1:
        raise ValueError(f"{who} expects classes to be an int >= 1, got {classes!r}")
    rng = as_rng(rng, who)
    return Chain(LSTM(in_features, hidden, rng=rng), last_step, Dense(hidden, int(classes), rng=rng))
