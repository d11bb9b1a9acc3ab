"""The networks of ``benchmarks/zoo.py``: each one's fluxpy model, its batch, and its twin in PyTorch.

The fluxpy networks come from ``fluxpy.models``, but for the GPT-style decoder, built here (:class:`GPT`): token
embedding plus a learned position embedding, ``layers`` pre-norm ``TransformerEncoderLayer`` blocks called with
``causal=True`` (the decoder layer's cross-attention has no use without an encoder: its parameters would get no
gradient), a final ``LayerNorm`` and an untied language-model head ``Dense(width => vocab, bias=False)``; the
loss is the next-token cross-entropy over every position of a sequence of random tokens.

:func:`torch_twin` builds the same network with the same weights in PyTorch: fluxpy's ``Conv`` and
``DepthwiseConv`` are true convolutions, so their kernels are flipped; attention is PyTorch's
``scaled_dot_product_attention`` (the ViT's by hand, the GPT's through ``nn.TransformerEncoderLayer`` with
``is_causal=True``), the LSTM ``nn.LSTM`` with cuDNN.

>>> net, model, x, labels = make_case("gpt", 2, nets=nets(GPT_SMOKE))
>>> model, x.shape, labels.shape, bool((x[:, 1:] == labels[:, :-1]).all())
(GPT(vocab=96, length=16, width=32, nheads=4, layers=2), (2, 16), (2, 16), True)
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from fluxpy import models as zoo_models
from fluxpy.functors import layer
from fluxpy.layers import (GRU, LSTM, BatchNorm, Chain, Conv, ConvTranspose, Dense, DimensionMismatch, Dropout,
                           Embedding, GlobalMeanPool, GroupNorm, LayerNorm, MaxPool, TransformerEncoderLayer, Upsample,
                           flatten, truncated_normal)
from fluxpy.models import EncoderBlock, PatchEmbedding, last_step, token_mean
from fluxpy.ops.activations import gelu, gelu_erf, identity, relu, relu6, swish
from fluxpy.random import as_rng
from models import _same_op, _torch_pad, reference_net, resnet_twin


@dataclasses.dataclass(frozen=True)
class Net:
    """One network of the zoo: its fluxpy builder ``build(rng)``, one example's shape, the batches it runs at, its
    optimiser (``"adam"``, ``"adamw"`` or ``"nesterov"``) and learning rate, its label smoothing, PyTorch's
    autocast type for it and its classes; ``tokens``: its input is a sequence of token ids (``shape`` is
    ``(length,)``, ``classes`` the vocabulary) and its labels are the next tokens, one per position."""
    build: Callable
    shape: tuple
    batches: tuple
    optimiser: str = "adam"
    lr: float = 1e-3
    label_smoothing: float = 0.0
    half: str = "bfloat16"
    classes: int = 10
    tokens: bool = False


@dataclasses.dataclass(frozen=True)
class GPTSize:
    """The GPT's sizes: vocabulary, sequence length, width, heads and blocks (the feed-forward net is 4 x width).

    >>> GPTSize(layers=2).hidden
    3072
    """
    vocab: int = 8192
    length: int = 1024
    width: int = 768
    nheads: int = 12
    layers: int = 4

    @property
    def hidden(self) -> int:
        return 4 * self.width


GPT_SIZE = GPTSize()
GPT_SMOKE = GPTSize(vocab=96, length=16, width=32, nheads=4, layers=2)   # ``--smoke`` and the CPU tests


@layer(children=("token", "position", "blocks", "norm", "head"))
class GPT:
    """A GPT-style decoder on ``(N, length)`` token ids, giving ``(N, length, vocab)`` logits: ``token(x) +
    position``, then each block with a causal self-attention mask, ``norm``, ``head`` (see the module docstring).
    Embeddings start as GPT-2's, normal with standard deviation 0.02.

    >>> import numpy as np
    >>> gpt = GPT(GPTSize(vocab=10, length=5, width=8, nheads=2, layers=1), rng=0)
    >>> gpt(np.zeros((3, 5), np.int64)).shape, gpt.blocks[0]
    ((3, 5, 10), TransformerEncoderLayer(8, nheads=2, hidden=32, act=gelu_erf))
    """

    def __init__(self, size: GPTSize, rng=None):
        rng = as_rng(rng, "GPT")
        self.size = size
        self.token = Embedding(size.vocab, size.width, init=functools.partial(truncated_normal, std=0.02), rng=rng)
        self.position = truncated_normal(size.length, size.width, std=0.02, rng=rng)
        self.blocks = tuple(TransformerEncoderLayer(size.width, size.nheads, size.hidden, gelu_erf, rng=rng)
                            for _ in range(size.layers))
        self.norm = LayerNorm(size.width)
        self.head = Dense(size.width, size.vocab, bias=False, rng=rng)

    def __call__(self, tokens):
        shape, dtype = tuple(getattr(tokens, "shape", ())), getattr(tokens, "dtype", None)
        if len(shape) != 2 or shape[1] != self.size.length or np.dtype(dtype).kind not in "iu":
            raise DimensionMismatch(f"{self!r} expects token ids, integers of shape (N, {self.size.length}), got "
                                    f"{shape} {dtype}")
        x = self.token(tokens) + self.position
        for block in self.blocks:
            x = block(x, causal=True)
        return self.head(self.norm(x))

    def __repr__(self):
        s = self.size
        return f"GPT(vocab={s.vocab}, length={s.length}, width={s.width}, nheads={s.nheads}, layers={s.layers})"


def unet_cifar(rng=None) -> Chain:
    """A small encoder-decoder classifier of the layers diffusion and segmentation nets are made of: 3x3
    convolutions with ``GroupNorm`` and swish, max pools down, a ``ConvTranspose`` (stride 2) and a nearest
    ``Upsample`` back up, a global mean and a ``Dense`` head, for 3x32x32 images.

    >>> unet_cifar(rng=0)[6]
    ConvTranspose((2, 2), 64 => 32, stride=2)
    """
    rng = as_rng(rng, "unet_cifar")
    return Chain(Conv((3, 3), 3, 32, pad=1, rng=rng), GroupNorm(32, 8, swish), MaxPool(2),
                 Conv((3, 3), 32, 64, pad=1, rng=rng), GroupNorm(64, 8, swish), MaxPool(2),
                 ConvTranspose((2, 2), 64, 32, stride=2, rng=rng), GroupNorm(32, 8, swish), Upsample(2),
                 Conv((3, 3), 32, 16, swish, pad=1, rng=rng), GlobalMeanPool(), flatten, Dense(16, 10, rng=rng))


def gru_classifier(in_features: int = 32, hidden: int = 128, rng=None) -> Chain:
    """``Chain(GRU(in_features => hidden), last_step, Dense(hidden => 10))`` for ``(N, T, in_features)`` sequences.

    >>> gru_classifier(8, 16, rng=0)[0]
    GRU(8 => 16)
    """
    rng = as_rng(rng, "gru_classifier")
    return Chain(GRU(in_features, hidden, rng=rng), last_step, Dense(hidden, 10, rng=rng))


def mlp_mnist(dropout: float = 0.1, rng=None) -> Chain:
    """A wide MLP on 28x28 images: two ``Dense(gelu_erf)`` layers of 1,024, each followed by ``LayerNorm``, the
    first by ``Dropout(dropout)``, and a ``Dense`` head.

    >>> len(mlp_mnist(rng=0))
    7
    """
    rng = as_rng(rng, "mlp_mnist")
    return Chain(flatten, Dense(784, 1024, gelu_erf, rng=rng), LayerNorm(1024), Dropout(dropout),
                 Dense(1024, 1024, gelu_erf, rng=rng), LayerNorm(1024), Dense(1024, 10, rng=rng))


def nets(gpt: GPTSize = GPT_SIZE, dropout: float = 0.1) -> dict:
    """The zoo's networks by name, the GPT of size ``gpt``:

    - ``mnist``: the Flux model-zoo MNIST conv net (``models.reference_net``), 1x28x28, batch 128, Adam;
    - ``resnet20``: ``resnet20()``, CIFAR 3x32x32, batch 128 and 512, Adam;
    - ``mobilenet``: ``mobilenet_cifar()`` (depthwise-separable blocks, relu6), batch 256, Adam;
    - ``vgg``: ``vgg_cifar()`` (conv, max pool, BatchNorm, GELU), batch 1024, SGD with Nesterov momentum, label
      smoothing 0.2, PyTorch's half type float16;
    - ``vit``: ``vit_cifar()`` (4x4 patches: 64 tokens, width 192, 4 blocks of 3 heads), batch 256, AdamW;
    - ``lstm``: ``lstm_classifier(32, 128)`` on sequences of 100 steps, batch 64, Adam;
    - ``gpt``: :class:`GPT` (1,024 tokens, width 768, 12 heads, 4 blocks, vocabulary 8,192), batch 8, AdamW;

    and three of layers no issue named, to keep the rest of fluxpy honest: ``unet`` (:func:`unet_cifar`: GroupNorm,
    swish, ConvTranspose, Upsample), batch 128, Adam; ``gru`` (:func:`gru_classifier`, sequences of 100 steps),
    batch 64, Adam; ``mlp`` (:func:`mlp_mnist`, gelu_erf, LayerNorm, ``Dropout(dropout)``), batch 512, AdamW.

    >>> list(nets()), nets(GPTSize(layers=2))["gpt"].batches
    (['mnist', 'resnet20', 'mobilenet', 'vgg', 'vit', 'lstm', 'gpt', 'unet', 'gru', 'mlp'], (8,))
    """
    return {
        "mnist": Net(reference_net, (1, 28, 28), (128,)),
        "resnet20": Net(lambda rng: zoo_models.resnet20(rng=rng), (3, 32, 32), (128, 512)),
        "mobilenet": Net(lambda rng: zoo_models.mobilenet_cifar(rng=rng), (3, 32, 32), (256,)),
        "vgg": Net(lambda rng: zoo_models.vgg_cifar(rng=rng), (3, 32, 32), (1024,), optimiser="nesterov", lr=0.01,
                   label_smoothing=0.2, half="float16"),
        "vit": Net(lambda rng: zoo_models.vit_cifar(rng=rng), (3, 32, 32), (256,), optimiser="adamw"),
        "lstm": Net(lambda rng: zoo_models.lstm_classifier(32, 128, rng=rng), (100, 32), (64,)),
        "gpt": Net(lambda rng: GPT(gpt, rng=rng), (gpt.length,), (8,), optimiser="adamw", lr=3e-4,
                   classes=gpt.vocab, tokens=True),
        "unet": Net(lambda rng: unet_cifar(rng=rng), (3, 32, 32), (128,)),
        "gru": Net(lambda rng: gru_classifier(32, 128, rng=rng), (100, 32), (64,)),
        "mlp": Net(lambda rng: mlp_mnist(dropout, rng=rng), (1, 28, 28), (512,), optimiser="adamw"),
    }


NETS = nets()


def make_case(name: str, batch: int, seed: int = 0, nets: dict = NETS):
    """``(net, model, x, labels)``: the network's fluxpy model (float32, CPU) and a batch, the same for every mode:
    standard normal inputs and uniform labels (never one label only), or, for a network of tokens, uniformly drawn
    tokens and the next token of each position as its label (int64, PyTorch's index type)."""
    net = nets[name]
    rng = np.random.default_rng(seed)
    model = net.build(rng)
    if net.tokens:   # one sequence of length + 1 tokens a row: the model reads all but the last
        sequence = rng.integers(0, net.classes, (batch, net.shape[0] + 1))
        return net, model, np.ascontiguousarray(sequence[:, :-1]), np.ascontiguousarray(sequence[:, 1:])
    x = rng.standard_normal((batch, *net.shape), dtype=np.float32)
    labels = rng.integers(0, net.classes, batch)
    if batch > 1 and np.all(labels == labels[0]):
        labels[1] = (labels[0] + 1) % net.classes
    return net, model, x, labels


def torch_twin(torch, model):
    """The same network and weights in PyTorch (an ``nn.Module`` on the CPU; move it yourself).

    Handles the zoo's layers: Chain, Conv / CrossCor / DepthwiseConv (groups; a ``Conv``'s kernel flipped for
    PyTorch's cross-correlation), ``ConvTranspose`` (flipped too), BatchNorm, GroupNorm, Dense and LayerNorm with
    identity, relu, relu6, gelu (the tanh form, ``nn.GELU(approximate="tanh")``), gelu_erf or swish,
    ``PatchEmbedding``, ``EncoderBlock`` (attention by ``scaled_dot_product_attention``), ``token_mean``, ``LSTM``
    and ``GRU`` (``nn.LSTM``, ``nn.GRU``: fluxpy's one bias is ``b_ih``, ``b_hh`` is zero), nearest ``Upsample``,
    ``Dropout``, ``last_step`` and :class:`GPT` (``nn.Embedding``, ``nn.TransformerEncoderLayer(norm_first=True,
    batch_first=True, activation="gelu")`` blocks called with PyTorch's causal mask and ``is_causal=True``; its
    packed ``in_proj_weight`` is fluxpy's q, k and v projections stacked); the rest (pools, ``flatten``, residual
    blocks) as :func:`models.resnet_twin` writes them.
    """
    nn, functional = torch.nn, torch.nn.functional

    def param(a):
        return torch.from_numpy(np.ascontiguousarray(a))

    def copy_into(module, **arrays):
        with torch.no_grad():
            for name, a in arrays.items():
                getattr(module, name).copy_(param(a))
        return module

    def with_act(module, act):
        for op, make in ((identity, None), (relu, lambda: nn.ReLU(inplace=True)),
                         (relu6, lambda: nn.ReLU6(inplace=True)), (gelu, lambda: nn.GELU(approximate="tanh")),
                         (gelu_erf, nn.GELU), (swish, lambda: nn.SiLU(inplace=True))):
            if _same_op(act, op):
                return module if make is None else nn.Sequential(module, make())
        raise TypeError(f"torch_twin: no PyTorch twin for the activation {act!r}")

    def conv(layer):
        k, c, r, s = layer.weight.shape
        m = nn.Conv2d(c * layer.groups, k, (r, s), stride=layer.stride, padding=_torch_pad(layer.pad),
                      dilation=layer.dilation, groups=layer.groups, bias=layer.bias is not None)
        w = layer.weight if layer.flipped else layer.weight[:, :, ::-1, ::-1]
        return copy_into(m, weight=w, **({} if layer.bias is None else dict(bias=layer.bias)))

    def conv_transpose(layer):
        c, k, r, s = layer.weight.shape   # (in, out / groups, *kernel); fluxpy's a true convolution's: flipped
        m = nn.ConvTranspose2d(c, k * layer.groups, (r, s), stride=layer.stride, padding=_torch_pad(layer.pad),
                               output_padding=layer.output_padding, groups=layer.groups,
                               bias=layer.bias is not None, dilation=layer.dilation)
        return copy_into(m, weight=layer.weight[:, :, ::-1, ::-1],
                         **({} if layer.bias is None else dict(bias=layer.bias)))

    def groupnorm(layer):
        m = nn.GroupNorm(layer.groups, layer.channels, eps=layer.eps, affine=layer.gamma is not None)
        return copy_into(m, **({} if layer.gamma is None else dict(weight=layer.gamma, bias=layer.beta)))

    def batchnorm(layer):
        m = nn.BatchNorm2d(layer.channels, eps=layer.eps, momentum=layer.momentum)
        return copy_into(m, weight=layer.gamma, bias=layer.beta, running_mean=layer.running_mean,
                         running_var=layer.running_var)

    def linear(layer):
        m = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        return copy_into(m, weight=layer.weight, **({} if layer.bias is None else dict(bias=layer.bias)))

    def layernorm(layer):
        return copy_into(nn.LayerNorm(layer.shape, eps=layer.eps), weight=layer.gamma, bias=layer.beta)

    def encoder_layer(layer):
        """``nn.TransformerEncoderLayer`` of a fluxpy ``TransformerEncoderLayer`` with gelu_erf and no dropout."""
        attn, biased = layer.self_attn, layer.linear1.bias is not None
        if not _same_op(layer.linear1.act, gelu_erf) or layer.dropout.p != 0:
            raise TypeError(f"torch_twin: no PyTorch twin for {layer!r} (gelu_erf and dropout 0 only)")
        m = nn.TransformerEncoderLayer(layer.linear1.in_features, attn.nheads, layer.linear1.out_features,
                                       dropout=0.0, activation="gelu", layer_norm_eps=layer.norm1.eps,
                                       batch_first=True, norm_first=layer.norm_first, bias=biased)
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        copy_into(m.self_attn, in_proj_weight=np.concatenate([p.weight for p in projections]),
                  **(dict(in_proj_bias=np.concatenate([p.bias for p in projections])) if biased else {}))
        for name in ("linear1", "linear2"):
            copy_into(getattr(m, name), weight=getattr(layer, name).weight,
                      **(dict(bias=getattr(layer, name).bias) if biased else {}))
        copy_into(m.self_attn.out_proj, weight=attn.out_proj.weight, **(dict(bias=attn.out_proj.bias) if biased
                                                                           else {}))
        for name in ("norm1", "norm2"):
            copy_into(getattr(m, name), weight=getattr(layer, name).gamma, bias=getattr(layer, name).beta)
        return m

    class Lambda(nn.Module):
        def __init__(self, f):
            super().__init__()
            self.f = f

        def forward(self, x):
            return self.f(x)

    class Patches(nn.Module):
        def __init__(self, embed):
            super().__init__()
            self.conv = conv(embed.conv)
            self.position = nn.Parameter(param(embed.position).clone())

        def forward(self, x):
            y = self.conv(x)
            n, c, h, w = y.shape
            return y.permute(0, 2, 3, 1).reshape(n, h * w, c) + self.position

    class Attention(nn.Module):
        def __init__(self, mha):
            super().__init__()
            self.q, self.k, self.v, self.out = (linear(d) for d in (mha.q_proj, mha.k_proj, mha.v_proj,
                                                                    mha.out_proj))
            self.heads = mha.nheads

        def forward(self, x):
            n, length, _ = x.shape

            def split(t):
                return t.view(n, length, self.heads, -1).transpose(1, 2)
            y = functional.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
            return self.out(y.transpose(1, 2).reshape(n, length, -1))

    class Encoder(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.norm1, self.attention = layernorm(block.norm1), Attention(block.attention)
            self.norm2, self.mlp = layernorm(block.norm2), convert(block.mlp)

        def forward(self, x):
            x = x + self.attention(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Decoder(nn.Module):
        """The GPT: the causal mask is PyTorch's own (``generate_square_subsequent_mask``); with ``is_causal=True``
        its attention drops the mask and runs SDPA's causal kernels."""

        def __init__(self, gpt):
            super().__init__()
            self.token = copy_into(nn.Embedding(*gpt.token.weight.shape), weight=gpt.token.weight)
            self.position = nn.Parameter(param(gpt.position).clone())
            self.blocks = nn.ModuleList(encoder_layer(b) for b in gpt.blocks)
            self.norm, self.head = layernorm(gpt.norm), linear(gpt.head)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(gpt.size.length),
                                 persistent=False)

        def forward(self, tokens):
            x = self.token(tokens) + self.position
            for block in self.blocks:
                x = block(x, src_mask=self.mask, is_causal=True)
            return self.head(self.norm(x))

    class Recurrent(nn.Module):
        def __init__(self, layer):
            super().__init__()
            cell = layer.cell
            hidden, n_in = cell.weight_hh.shape[1], cell.weight_ih.shape[1]
            kind = nn.GRU if isinstance(layer, GRU) else nn.LSTM
            self.rnn = kind(n_in, hidden, batch_first=True, bias=cell.bias is not None)
            copy_into(self.rnn, weight_ih_l0=cell.weight_ih, weight_hh_l0=cell.weight_hh)
            if cell.bias is not None:   # PyTorch's second bias zero (a GRU's n gate: Flux's has none)
                copy_into(self.rnn, bias_ih_l0=cell.bias, bias_hh_l0=np.zeros_like(cell.bias))

        def forward(self, x):
            return self.rnn(x)[0]

    def convert(layer):
        if isinstance(layer, Chain):
            return nn.Sequential(*(convert(f) for f in layer))
        if isinstance(layer, Conv):   # and CrossCor, DepthwiseConv
            return with_act(conv(layer), layer.act)
        if isinstance(layer, BatchNorm):
            return with_act(batchnorm(layer), layer.act)
        if isinstance(layer, Dense):
            return with_act(linear(layer), layer.act)
        if isinstance(layer, LayerNorm):
            return with_act(layernorm(layer), layer.act)
        if isinstance(layer, PatchEmbedding):
            return Patches(layer)
        if isinstance(layer, EncoderBlock):
            return Encoder(layer)
        if isinstance(layer, GPT):
            return Decoder(layer)
        if isinstance(layer, (LSTM, GRU)):
            return Recurrent(layer)
        if isinstance(layer, ConvTranspose):
            return with_act(conv_transpose(layer), layer.act)
        if isinstance(layer, GroupNorm):
            return with_act(groupnorm(layer), layer.act)
        if isinstance(layer, Upsample) and layer.mode == "nearest" and layer.size is None:
            return nn.Upsample(scale_factor=layer.scale, mode="nearest")
        if isinstance(layer, Dropout) and layer.dims is None:
            return nn.Dropout(layer.p)
        if layer is token_mean:
            return Lambda(lambda x: x.mean(dim=1))
        if layer is last_step:
            return Lambda(lambda x: x[:, -1])
        return resnet_twin(torch, layer)

    return convert(model)
