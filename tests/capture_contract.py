"""The capture contract's cases: one small network per exported layer class, each ending in a loss.

Each :class:`Case` builds, from a seed, a float32 model on the CPU that uses its layer where it has trainable
parameters next to it (a shape-only layer such as ``MaxPool`` sits behind a ``Conv``), and the batch to train it on:
``(x, y)`` with ``loss(model, x, y)`` a scalar. tests/test_capture_contract.py checks on the CPU that every class
fluxpy exports as a layer has a case here and that each case trains; tests/gpu/test_capture_contract_gpu.py runs
each case in a captured :class:`fluxpy.TrainStep` in float32, float16 and bfloat16 (under ``mixed_precision``) and
channels-last where the batch is 4-d, against the eager step.

>>> sorted(CASES)[:3]
['AdaptiveMaxPool', 'AdaptiveMeanPool', 'AlphaDropout']
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np

import fluxpy
from fluxpy import layers as L
from fluxpy.losses import mse


@dataclass(frozen=True)
class Case:
    """``build(rng) -> (model, x, y)``: a float32 CPU model and its batch; ``loss(model, x, y)`` a scalar.

    ``image``: the batch is 4-d (``(N, C, H, W)``), so the case runs channels-last too; ``random``: the step draws
    random numbers (dropout), so a captured step is compared with an eager one started from the same seed."""
    build: Callable
    loss: Callable = None
    image: bool = False
    random: bool = False

    def make(self, seed: int = 0):
        """``(model, x, y, loss)`` from ``seed``."""
        model, x, y = self.build(np.random.default_rng(seed))
        return model, x, y, self.loss or regression


def regression(model, x, y):
    """The mean squared error of the model's output (its first, where it returns a tuple) against ``y``."""
    out = model(x)
    if isinstance(out, tuple):
        out = out[0]
    return mse(out, y)


def _normal(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


def _target(model, x, rng):
    """A random target of the shape the model outputs for ``x``."""
    out = model(x)
    if isinstance(out, tuple):
        out = out[0]
    return _normal(rng, *out.shape)


def _seed(rng):
    return int(rng.integers(1 << 30))


def _chain_case(make_layers, x_shape, image=False, **kw):
    """A case of ``Chain(*make_layers(rng))`` on a random batch of ``x_shape``."""
    def build(rng):
        model = L.Chain(*make_layers(rng))
        x = _normal(rng, *x_shape)
        return model, x, _target(model, x, rng)
    return Case(build, image=image, **kw)


def _tokens_case(make_model, n=11, shape=(4, 6)):
    """A case whose batch is integer token indices in ``[0, n)``."""
    def build(rng):
        model = make_model(rng)
        x = rng.integers(0, n, size=shape).astype(np.int64)
        return model, x, _target(model, x, rng)
    return Case(build)


def _conv(rng, cin=4, cout=4, **kw):
    return L.Conv((3, 3), cin, cout, fluxpy.relu, pad=1, rng=_seed(rng), **kw)


IMG = (4, 4, 8, 8)   # N, C, H, W of the image cases
SEQ = (4, 5, 6)      # N, T, features of the sequence cases

CASES: dict[str, Case] = {
    "Chain": _chain_case(lambda r: [L.Dense(6, 5, fluxpy.tanh, rng=_seed(r)), L.Dense(5, 3, rng=_seed(r))], (8, 6)),
    "Dense": _chain_case(lambda r: [L.Dense(6, 3, fluxpy.gelu, rng=_seed(r))], (8, 6)),
    "Conv": _chain_case(lambda r: [L.Conv((3, 3), 4, 6, fluxpy.relu, pad=1, rng=_seed(r)),
                                   L.Conv((3, 3), 6, 4, fluxpy.gelu, stride=2, rng=_seed(r))], IMG, image=True),
    "CrossCor": _chain_case(lambda r: [L.CrossCor((3, 3), 4, 5, fluxpy.swish, pad=1, rng=_seed(r))], IMG,
                            image=True),
    "ConvTranspose": _chain_case(lambda r: [L.ConvTranspose((3, 3), 4, 3, fluxpy.relu, stride=2, pad=1,
                                                            rng=_seed(r))], IMG, image=True),
    "DepthwiseConv": _chain_case(lambda r: [L.DepthwiseConv((3, 3), 4, 8, fluxpy.relu6, pad=1, rng=_seed(r)),
                                            L.Conv((1, 1), 8, 4, rng=_seed(r))], IMG, image=True),
    "MaxPool": _chain_case(lambda r: [_conv(r), L.MaxPool((2, 2))], IMG, image=True),
    "MeanPool": _chain_case(lambda r: [_conv(r), L.MeanPool((3, 3), stride=2, pad=1)], IMG, image=True),
    "GlobalMaxPool": _chain_case(lambda r: [_conv(r), L.GlobalMaxPool(), L.flatten, L.Dense(4, 2, rng=_seed(r))],
                                 IMG, image=True),
    "GlobalMeanPool": _chain_case(lambda r: [_conv(r), L.GlobalMeanPool(), L.flatten, L.Dense(4, 2, rng=_seed(r))],
                                  IMG, image=True),
    "AdaptiveMaxPool": _chain_case(lambda r: [_conv(r), L.AdaptiveMaxPool((3, 3))], IMG, image=True),
    "AdaptiveMeanPool": _chain_case(lambda r: [_conv(r), L.AdaptiveMeanPool((3, 3))], IMG, image=True),
    "BatchNorm": _chain_case(lambda r: [L.Conv((3, 3), 4, 6, pad=1, rng=_seed(r)), L.BatchNorm(6, fluxpy.relu),
                                        L.Conv((3, 3), 6, 4, pad=1, rng=_seed(r)), L.BatchNorm(4, fluxpy.gelu)],
                             IMG, image=True),
    "LayerNorm": _chain_case(lambda r: [L.Dense(6, 8, rng=_seed(r)), L.LayerNorm(8, fluxpy.gelu),
                                        L.Dense(8, 3, rng=_seed(r))], SEQ),
    "GroupNorm": _chain_case(lambda r: [_conv(r, cout=6), L.GroupNorm(6, 3, fluxpy.swish)], IMG, image=True),
    "InstanceNorm": _chain_case(lambda r: [_conv(r), L.InstanceNorm(4, affine=True)], IMG, image=True),
    "Dropout": _chain_case(lambda r: [L.Dense(6, 16, fluxpy.relu, rng=_seed(r)), L.Dropout(0.3),
                                      L.Dense(16, 3, rng=_seed(r))], (8, 6), random=True),
    "AlphaDropout": _chain_case(lambda r: [L.Dense(6, 16, fluxpy.selu, rng=_seed(r)), L.AlphaDropout(0.2),
                                           L.Dense(16, 3, rng=_seed(r))], (8, 6), random=True),
    "Upsample": _chain_case(lambda r: [_conv(r), L.Upsample(2, mode="bilinear"), _conv(r),
                                       L.Upsample(scale=(1, 2)), _conv(r)], IMG, image=True),
    "PixelShuffle": _chain_case(lambda r: [_conv(r, cout=8), L.PixelShuffle(2), _conv(r, cin=2)], IMG, image=True),
    "Embedding": _tokens_case(lambda r: L.Chain(L.Embedding(11, 5, rng=_seed(r)), L.Dense(5, 3, rng=_seed(r)))),
    "EmbeddingBag": _tokens_case(lambda r: L.Chain(L.EmbeddingBag(11, 5, rng=_seed(r)),
                                                   L.Dense(5, 3, rng=_seed(r)))),
    "SkipConnection": _chain_case(lambda r: [L.SkipConnection(L.Chain(_conv(r), _conv(r)), operator.add)], IMG,
                                  image=True),
    "Parallel": _chain_case(lambda r: [L.Parallel(lambda a, b: fluxpy.concatenate((a, b), axis=1),
                                                  L.Dense(6, 3, rng=_seed(r)), L.Dense(6, 2, fluxpy.tanh,
                                                                                       rng=_seed(r)))], (8, 6)),
    "Scale": _chain_case(lambda r: [_conv(r), L.Scale(4, 1, 1, act=fluxpy.sigmoid)], IMG, image=True),
    "Bilinear": _chain_case(lambda r: [L.Dense(6, 4, fluxpy.tanh, rng=_seed(r)), L.Bilinear(4, 3, rng=_seed(r))],
                            (8, 6)),
    "Maxout": _chain_case(lambda r: [L.Maxout(lambda: L.Dense(6, 4, rng=_seed(r)), 3)], (8, 6)),
    "PairwiseFusion": _chain_case(lambda r: [L.PairwiseFusion(operator.add, L.Dense(6, 6, rng=_seed(r)),
                                                              L.Dense(6, 6, fluxpy.tanh, rng=_seed(r))),
                                             lambda ys: ys[0] * ys[1]], (8, 6)),
    # each recurrent layer twice: one layer, one direction (states (N, H)), then stacked and bidirectional
    "RNN": _chain_case(lambda r: [L.RNN(6, 5, rng=_seed(r)),
                                  L.RNN(5, 3, fluxpy.relu, num_layers=2, bidirectional=True, rng=_seed(r))], SEQ),
    "LSTM": _chain_case(lambda r: [L.LSTM(6, 5, rng=_seed(r)),
                                   L.LSTM(5, 3, num_layers=2, bidirectional=True, rng=_seed(r))], SEQ),
    "GRU": _chain_case(lambda r: [L.GRU(6, 5, rng=_seed(r)), L.GRU(5, 3, num_layers=3, rng=_seed(r))], SEQ),
    "RNNCell": _chain_case(lambda r: [L.RNNCell(6, 5, rng=_seed(r))], (8, 6)),
    "LSTMCell": _chain_case(lambda r: [L.LSTMCell(6, 5, rng=_seed(r))], (8, 6)),
    "GRUCell": _chain_case(lambda r: [L.GRUCell(6, 5, rng=_seed(r))], (8, 6)),
    "GRUv3": _chain_case(lambda r: [L.GRUv3(6, 5, rng=_seed(r))], SEQ),
    "GRUv3Cell": _chain_case(lambda r: [L.GRUv3Cell(6, 5, rng=_seed(r))], (8, 6)),
    "Recurrence": _chain_case(lambda r: [L.Recurrence(L.GRUCell(6, 4, rng=_seed(r)))], SEQ),
    "MultiHeadAttention": _chain_case(lambda r: [L.Dense(6, 8, rng=_seed(r)),
                                                 L.MultiHeadAttention(8, 2, rng=_seed(r))], SEQ),
    "TransformerEncoderLayer": _chain_case(lambda r: [L.Dense(6, 8, rng=_seed(r)),
                                                      L.TransformerEncoderLayer(8, 2, 16, rng=_seed(r)),
                                                      L.Dense(8, 3, rng=_seed(r))], SEQ),
    "TransformerDecoderLayer": _chain_case(lambda r: [L.Dense(6, 8, rng=_seed(r)),
                                                      L.TransformerDecoderLayer(8, 2, 16, fluxpy.relu,
                                                                                rng=_seed(r))], SEQ),
    "PReLU": _chain_case(lambda r: [_conv(r), L.PReLU(4), L.Conv((3, 3), 4, 4, pad=1, rng=_seed(r)), L.PReLU()],
                         IMG, image=True),
    "RMSNorm": _chain_case(lambda r: [L.Dense(6, 8, rng=_seed(r)), L.RMSNorm(8), L.Dense(8, 3, rng=_seed(r))], SEQ),
    "PixelUnshuffle": _chain_case(lambda r: [_conv(r), L.PixelUnshuffle(2), _conv(r, cin=16)], IMG, image=True),
    "WeightNorm": _chain_case(lambda r: [L.WeightNorm(_conv(r, padding_mode="reflect")),
                                         L.MeanPool((3, 3), stride=1, pad=1, count_include_pad=False),
                                         L.WeightNorm(_conv(r), dims=(0, 2, 3))], IMG, image=True),
    "SpectralNorm": _chain_case(lambda r: [L.SpectralNorm(_conv(r), rng=_seed(r)),
                                           L.SpectralNorm(L.ConvTranspose((3, 3), 4, 4, pad=1, rng=_seed(r)),
                                                          n_power_iterations=2, rng=_seed(r))], IMG, image=True),
    "Checkpoint": _chain_case(lambda r: [L.Checkpoint(L.Chain(_conv(r, padding_mode="circular"), _conv(r))),
                                         L.Upsample(1.5, mode="bilinear", align_corners=False), _conv(r)], IMG,
                              image=True),
}
"""The case of each exported layer class, by name."""

NOT_LAYERS = {"DimensionMismatch", "DTypeMismatch"}
"""Classes that ``fluxpy.layers`` exports and that are not layers."""


def exported_layer_classes() -> set[str]:
    """The names of the classes ``fluxpy.layers`` exports as layers."""
    return {n for n in L.__all__ if isinstance(getattr(L, n), type) and n not in NOT_LAYERS}
