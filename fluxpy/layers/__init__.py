"""Layers (Flux's ``src/layers/``): plain classes with a size constructor, ``__call__`` and a Flux-style ``repr``.

Each ``__call__`` checks the input's shape, then calls ops; layers hold no backward code and no
device code (move a model with :func:`fluxpy.gpu` / :func:`fluxpy.cpu`). A wrong input raises
:class:`DimensionMismatch` (a wrong shape) or :class:`DTypeMismatch` (a dtype other than the
parameters', e.g. float64 data into a float32 model) naming the layer before any kernel runs;
inside a :class:`Chain` the message also says which layer (by its index, as ``chain[i]``). A
constructor given a bad size or option (``Dense(3.5, 2)``, ``Conv(..., groups=0)``, an activation
that is not callable) raises at once, naming the layer.

Layout: images ``(N, C, H, W)`` (convolutions and pools also take ``(N, C, L)`` and ``(N, C, D, H, W)``),
Dense input ``(batch, in)``, weights ``(out, in)`` and ``(K, C/groups, R, S)``. Parameters are float32 (convert
a model with :func:`f64` / :func:`f32`).

The modules, by family: ``basic`` (Chain, Dense, flatten, SkipConnection, Parallel, Scale, Bilinear, Maxout,
PairwiseFusion, MultiHeadAttention), ``embedding`` (Embedding, EmbeddingBag),
``conv``, ``pool``, ``normalise`` (BatchNorm, LayerNorm, RMSNorm, GroupNorm, InstanceNorm, Dropout, AlphaDropout and the
train/test mode), ``upsample`` (Upsample, PixelShuffle, PixelUnshuffle), ``activation`` (PReLU),
``recurrent`` (RNN, LSTM, GRU and their cells), ``init`` (initialisers), ``convert`` (f32, f64), ``show``
(printing) and ``_checks`` (input checks, :class:`DimensionMismatch` and :class:`DTypeMismatch`). The families
import from ``init``, ``show`` and ``_checks``, never from each other; ``transformer`` (TransformerEncoderLayer,
TransformerDecoderLayer) is built from ``basic`` and ``normalise`` layers and sits above them; ``reparam``
(WeightNorm, SpectralNorm: wrappers that reparametrise a layer's weight) sits above ``normalise``; ``tools``
(destructure, activations, EMA, Checkpoint) works on any model tree.

>>> import numpy as np
>>> import fluxpy
>>> model = Chain(Dense(2, 3, fluxpy.relu, rng=0), Dense(3, 1, rng=1))
>>> model(np.ones((4, 2), np.float32)).shape
(4, 1)
>>> g, = fluxpy.gradient(lambda m: m(np.ones((4, 2), np.float32)).sum(), model)
>>> sorted(g["layers"][0])
['bias', 'weight']
"""
from __future__ import annotations

from ._checks import DimensionMismatch, DTypeMismatch
from .activation import PReLU
from .basic import (Bilinear, Chain, Dense, Maxout, MultiHeadAttention, PairwiseFusion, Parallel, Scale,
                    SkipConnection, flatten)
from .conv import Conv, ConvTranspose, CrossCor, DepthwiseConv
from .convert import f32, f64
from .embedding import Embedding, EmbeddingBag
from .init import (calculate_gain, glorot_normal, glorot_uniform, identity_init, kaiming_normal, kaiming_uniform,
                   lecun_normal, nfan, ones32, orthogonal, rand32, randn32, sparse_init, truncated_normal, zeros32)
from .normalise import (AlphaDropout, BatchNorm, Dropout, GroupNorm, InstanceNorm, LayerNorm, RMSNorm, istraining,
                        testmode, trainmode)
from .recurrent import GRU, LSTM, RNN, GRUCell, GRUv3, GRUv3Cell, LSTMCell, Recurrence, RNNCell, initialstates
from .pool import AdaptiveMaxPool, AdaptiveMeanPool, GlobalMaxPool, GlobalMeanPool, MaxPool, MeanPool
from .reparam import SpectralNorm, WeightNorm, remove_weight_norms
from .tools import Checkpoint
from .transformer import TransformerDecoderLayer, TransformerEncoderLayer
from .upsample import PixelShuffle, PixelUnshuffle, Upsample

__all__ = ["Chain", "Dense", "Conv", "CrossCor", "ConvTranspose", "DepthwiseConv", "MaxPool", "MeanPool",
           "GlobalMaxPool", "GlobalMeanPool", "AdaptiveMaxPool", "AdaptiveMeanPool", "flatten", "BatchNorm",
           "LayerNorm", "GroupNorm",
           "InstanceNorm", "Dropout", "AlphaDropout", "Upsample", "PixelShuffle", "Embedding", "EmbeddingBag",
           "SkipConnection",
           "Parallel", "Scale", "Bilinear", "Maxout", "PairwiseFusion", "RNN", "LSTM", "GRU", "RNNCell", "LSTMCell",
           "GRUCell", "GRUv3", "GRUv3Cell", "Recurrence",
           "initialstates", "MultiHeadAttention", "TransformerEncoderLayer",
           "TransformerDecoderLayer",
           "DimensionMismatch", "DTypeMismatch", "istraining", "trainmode", "testmode", "f32", "f64", "glorot_uniform",
           "glorot_normal", "kaiming_uniform", "kaiming_normal", "randn32", "zeros32", "ones32", "nfan",
           "PReLU", "RMSNorm", "PixelUnshuffle", "rand32", "truncated_normal", "lecun_normal", "orthogonal",
           "identity_init", "sparse_init", "calculate_gain", "WeightNorm", "SpectralNorm", "Checkpoint",
           "remove_weight_norms"]
