"""fluxpy: a small deep-learning framework in the spirit of Flux.jl.

Models are plain Python objects, gradients are taken of ordinary functions, and the same code
runs on NumPy (CPU) and CuPy (GPU).

>>> import numpy as np
>>> import fluxpy
>>> fluxpy.gradient(lambda w: (w * w).sum(), np.array([1.0, -2.0]))
(array([ 2., -4.]),)
>>> model = fluxpy.Chain(fluxpy.Dense(3, 2, fluxpy.relu), fluxpy.Dense(2, 1))
>>> model(np.ones((4, 3), np.float32)).shape
(4, 1)

Applications built on the library have their own packages: data sets and augmentation in
:mod:`fluxpy.datasets` (``fluxpy.datasets.load_mnist``), ready-made networks in :mod:`fluxpy.models`
(``fluxpy.models.resnet20``). Importing fluxpy changes no other library's state; fluxpy's CUDA kernels
join the kernel table the first time a CuPy array asks for one (:mod:`fluxpy.kernels`).

The API reference (every public name by area, from these docstrings) and the pages "Coming from PyTorch" and
"Coming from Flux" are in ``docs/``: ``pip install -e '.[docs]'``, then
``python3 -m sphinx -b html docs docs/_build/html`` and open ``docs/_build/html/index.html``. ``help(fluxpy)``
lists the same public names (``fluxpy.__all__``); its PACKAGE CONTENTS lists every submodule, but only those
named in ``__all__`` (``fluxpy.ops``, ``fluxpy.losses``, ...) and ``fluxpy.distributed`` are public.

``from fluxpy import *`` brings in the public names but never shadows Python's builtins: the array
reductions ``fluxpy.sum``, ``fluxpy.max``, ``fluxpy.min`` and ``fluxpy.abs`` are reached through
the module (or ``fluxpy.ops``).

>>> ns = {}
>>> exec("from fluxpy import *", ns)
>>> "sum" in ns or "max" in ns, float(fluxpy.sum(np.ones(3)))
(False, 3.0)
"""
from __future__ import annotations

from .options import options as options  # every setting: fluxpy.options.set(...), with fluxpy.options(...): ...
from . import datasets, layout, losses, models, ops, optimise, schedules
from .autodiff import (DetachedGradientWarning, Primitive, Tracked, gradient, in_gradient, is_tracked, no_grad,
                       primitive, pullback, stop_gradient, value_of, withgradient)
from .derivatives import diaghessian, hessian, jacobian, withjacobian
from .backend import GPUUnavailableError, get_array_module, gpu_available
from .broadcast import broadcast, unbroadcast
from .checkpoint import load_training, save_training
from .data import DataLoader, onecold, onehot, onehotbatch
from .functors import (children, cpu, fmap, fmap_with_path, fmapstructure, gpu, layer, loadstate, outputsize, state,
                       trainables)
from .functors import modules
from .observations import batch, chunk, getobs, kfolds, mapobs, numobs, obsview, shuffleobs, splitobs, unbatch
from .sequences import batchseq, pad_sequence, sequence_mask, unpad_sequence
from .io import CheckpointError, load, save
from .from_torch import from_torch
from .torch_state import load_torch_state, to_torch_state
from .ops.attention import causal_mask, dot_product_attention
from .layout import is_channels_last, to_channels_last
from .layers import (AdaptiveMaxPool, AdaptiveMeanPool, AlphaDropout, BatchNorm, Bilinear, Chain, Conv, ConvTranspose,
                     CrossCor, Dense, DepthwiseConv, GRU, GRUCell, GRUv3, GRUv3Cell, LSTM, LSTMCell, Maxout,
                     MultiHeadAttention, PairwiseFusion, Recurrence, RNN, RNNCell, Scale, TransformerDecoderLayer,
                     TransformerEncoderLayer, initialstates,
                     DimensionMismatch, Dropout, DTypeMismatch, Embedding, EmbeddingBag, GlobalMaxPool, GlobalMeanPool,
                     GroupNorm, InstanceNorm, LayerNorm, MaxPool, MeanPool, Parallel, PixelShuffle, SkipConnection,
                     Upsample, f32, f64, flatten, glorot_normal, glorot_uniform, istraining, kaiming_normal,
                     kaiming_uniform, ones32, randn32, testmode, trainmode, zeros32)
from .layers import (PReLU, PixelUnshuffle, RMSNorm, calculate_gain, identity_init, lecun_normal, orthogonal, rand32,
                     sparse_init, truncated_normal)
from .layers import Checkpoint, SpectralNorm, WeightNorm, remove_weight_norms
from .layers.tools import EMA, activations, checkpointed, destructure
from .losses import (binary_focal_loss, binarycrossentropy, crossentropy, dice_coeff_loss, focal_loss, hinge_loss,
                     huber_loss, kldivergence, label_smoothing, logitbinarycrossentropy, logitcrossentropy, mae, mse,
                     msle, poisson_loss, siamese_contrastive_loss, squared_hinge_loss, tversky_loss)
from .losses import (cosine_embedding_loss, ctc_loss, gaussian_nll_loss, hinge_embedding_loss, margin_ranking_loss,
                     multi_margin_loss, multilabel_soft_margin_loss, nll_loss, smooth_l1_loss, soft_margin_loss,
                     triplet_margin_loss)
from .ops import (celu, erf, gelu_erf, gelu_sigmoid, gelu_tanh, hardsigmoid, hardswish, lisht, logcosh, logsigmoid,
                  logsumexp, mish, rrelu, selu, softshrink, softsign, tanhshrink, trelu)
from .ops import channel_shuffle, cosine_similarity, glu, hardshrink, pairwise_distance, softmin, threshold
from .ops import fold, lpnormpool, unfold
from .ops import einsum, pad_circular, pad_constant, pad_reflect, pad_repeat, pad_symmetric, pad_zeros
from .ops import check_indices
from .ops import dense
from .ops import (batchnorm, bias_act, clip, concatenate, conv, conv_transpose, cos, dot, dropout, elu, exp, gather,
                  gelu, hardtanh, identity, leakyrelu, log, log1p, logsoftmax, matmul, maximum, maxpool, mean, meanpool,
                  minimum, relu, relu6, reshape, scatter, sigmoid, sin, softmax, softplus, sqrt, stack, swish, tanh,
                  transpose, where)
from .ops import abs, max, min, sum  # noqa: F401  (fluxpy.sum etc.; kept out of __all__, see the docstring)
from .precision import DynamicLossScale, MixedPrecision, bf16, f16, mixed_precision
from .profile import profile
from .optimise import (AccumGrad, AdaBelief, AdaDelta, AdaGrad, AdaMax, Adam, AdamW, ClipGrad, ClipNorm, Descent, Lion,
                       Momentum, NAdam, Nesterov, OAdam, OptimiserChain, RAdam, RMSProp, SignDecay, WeightDecay, adjust,
                       freeze, setup, thaw, update)
from .optimise import AMSGrad, Rprop
from .optimise import clip_grad_norm
from .random import seed
from .journal import StepOutOfMemory
from .mutation import ChangedInPlaceError
from .step import CaptureWarning, TrainStep
from .train import TrainingDiverged, train

__version__ = "0.1.0"

__all__ = [
    # autodiff
    "gradient", "withgradient", "pullback", "jacobian", "withjacobian", "hessian", "diaghessian", "primitive",
    "Primitive", "Tracked", "no_grad",
    "stop_gradient",
    "value_of", "is_tracked", "in_gradient", "broadcast", "unbroadcast", "DetachedGradientWarning",
    "ChangedInPlaceError",
    # devices and model trees
    "get_array_module", "gpu", "cpu", "gpu_available", "GPUUnavailableError", "layer", "children", "fmap",
    "fmapstructure", "fmap_with_path", "trainables", "state", "loadstate", "outputsize", "save", "load",
    "CheckpointError", "seed",
    "save_training", "load_training",
    # ops (sum, max, min and abs too, but not in __all__: `from fluxpy import *` must not shadow the builtins)
    "ops", "clip", "concatenate", "cos", "dot", "exp", "gather", "log", "log1p", "matmul", "maximum", "mean",
    "minimum", "reshape", "scatter", "check_indices", "sin", "sqrt", "stack", "tanh", "transpose", "where", "bias_act",
    "dense",
    "conv", "conv_transpose", "maxpool", "meanpool", "dropout", "softmax", "logsoftmax", "batchnorm",
    "identity", "relu", "leakyrelu", "relu6", "elu", "gelu", "swish", "sigmoid", "softplus", "hardtanh",
    "gelu_tanh", "gelu_sigmoid", "hardsigmoid", "hardswish", "lisht", "softsign", "selu", "celu", "trelu", "logcosh",
    "mish", "tanhshrink", "softshrink", "logsigmoid", "gelu_erf", "rrelu", "erf", "logsumexp", "hardshrink", "softmin",
    "glu", "threshold", "channel_shuffle", "cosine_similarity", "pairwise_distance", "unfold", "fold",
    "lpnormpool",
    "einsum", "pad_constant", "pad_zeros", "pad_reflect", "pad_repeat", "pad_symmetric", "pad_circular",
    # layers
    "Chain", "Dense", "Conv", "CrossCor", "ConvTranspose", "DepthwiseConv", "MaxPool", "MeanPool", "GlobalMaxPool",
    "GlobalMeanPool",
    "AdaptiveMaxPool", "AdaptiveMeanPool", "flatten", "BatchNorm", "LayerNorm", "GroupNorm", "InstanceNorm", "Dropout",
    "Upsample", "PixelShuffle", "Embedding", "EmbeddingBag", "SkipConnection", "Parallel", "DimensionMismatch",
    "DTypeMismatch",
    "AlphaDropout", "Scale", "Bilinear", "Maxout", "PairwiseFusion", "RNN", "LSTM", "GRU", "RNNCell", "LSTMCell",
    "GRUCell", "GRUv3", "GRUv3Cell", "Recurrence", "initialstates", "MultiHeadAttention", "TransformerEncoderLayer",
    "TransformerDecoderLayer", "dot_product_attention", "causal_mask", "numobs", "getobs", "obsview", "shuffleobs",
    "splitobs", "kfolds", "batch", "unbatch", "chunk", "mapobs",
    "pad_sequence", "unpad_sequence", "batchseq", "sequence_mask",
    "istraining", "trainmode", "testmode", "f32", "f64", "glorot_uniform", "glorot_normal", "kaiming_uniform",
    "kaiming_normal", "randn32", "zeros32", "ones32", "PReLU", "RMSNorm", "PixelUnshuffle", "rand32",
    "truncated_normal", "lecun_normal", "orthogonal", "identity_init", "sparse_init", "calculate_gain",
    "load_torch_state", "to_torch_state", "from_torch",
    "WeightNorm", "remove_weight_norms", "SpectralNorm", "Checkpoint", "checkpointed", "destructure", "modules",
    "activations", "EMA",
    # losses, optimisers, training, data
    "losses", "mse", "mae", "huber_loss", "crossentropy", "logitcrossentropy", "binarycrossentropy",
    "logitbinarycrossentropy", "kldivergence", "msle", "poisson_loss", "hinge_loss", "squared_hinge_loss",
    "dice_coeff_loss", "tversky_loss", "binary_focal_loss", "focal_loss", "siamese_contrastive_loss", "label_smoothing",
    "ctc_loss", "smooth_l1_loss", "nll_loss", "margin_ranking_loss", "triplet_margin_loss", "cosine_embedding_loss",
    "gaussian_nll_loss", "soft_margin_loss", "hinge_embedding_loss", "multilabel_soft_margin_loss", "multi_margin_loss",
    "optimise", "Descent", "Momentum", "Nesterov", "RMSProp", "Adam",
    "AdamW", "WeightDecay", "ClipGrad", "ClipNorm", "OptimiserChain", "AdaGrad", "AdaDelta", "AdaMax", "NAdam",
    "RAdam", "OAdam", "AdaBelief", "Lion", "SignDecay", "AccumGrad", "setup", "update", "adjust", "freeze", "thaw",
    "clip_grad_norm", "AMSGrad", "Rprop",
    "train", "TrainingDiverged", "profile", "DataLoader", "onehot", "onehotbatch", "onecold", "schedules", "TrainStep",
    "CaptureWarning", "StepOutOfMemory",
    # applications: data sets and augmentation, the model zoo
    "datasets", "models",
    # precision
    "mixed_precision", "MixedPrecision", "DynamicLossScale", "f16", "bf16",
    # memory layout
    "layout", "to_channels_last", "is_channels_last",
]
