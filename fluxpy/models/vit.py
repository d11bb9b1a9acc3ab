"""A small vision transformer (Dosovitskiy et al. 2021) for CIFAR-size images: :func:`vit_cifar`.

The image is cut into ``patch x patch`` patches embedded by one strided convolution with a learned position embedding
added (:class:`PatchEmbedding`, ``(N, C, H, W)`` -> ``(N, tokens, width)``), then ``depth`` pre-norm encoder blocks
(:class:`EncoderBlock`: ``x + attention(LayerNorm(x))``, then ``x + mlp(LayerNorm(x))``), a final ``LayerNorm``,
the mean over the tokens (:func:`token_mean`, in place of a class token) and ``Dense(width => classes)``. The
defaults (4x4 patches of a 32x32 image: 64 tokens; width 192, 3 heads of 64, 4 blocks, MLP 768 with ``gelu``) are
ViT-Tiny's width at a third of its depth.

>>> import numpy as np
>>> model = vit_cifar(rng=0)
>>> x = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)
>>> model[0](x).shape, model(x).shape
((2, 64, 192), (2, 10))
"""
from __future__ import annotations

import numbers

import numpy as np

from ..functors import layer
from ..layers import Chain, CrossCor, Dense, DimensionMismatch, LayerNorm, MultiHeadAttention
from ..ops.activations import gelu
from ..ops.reduce import mean
from ..ops.shape import as_memory_format, reshape, transpose
from ..random import RNG, as_rng

__all__ = ["vit_cifar", "PatchEmbedding", "EncoderBlock", "token_mean"]


@layer(children=("conv", "position"))
class PatchEmbedding:
    """``(N, cin, H, W)`` -> ``(N, tokens, width)``: ``CrossCor((patch, patch), cin => width, stride=patch)`` (one
    token a patch, in row-major order), plus a learned position embedding ``position`` ``(tokens, width)``
    (normal, standard deviation 0.02). ``image``: ``(H, W)``, each a multiple of ``patch``.

    >>> import numpy as np
    >>> embed = PatchEmbedding(4, 3, 8, image=(8, 12), rng=0)
    >>> embed, embed.position.shape, embed(np.ones((2, 3, 8, 12), np.float32)).shape
    (PatchEmbedding(4, 3 => 8, image=(8, 12)), (6, 8), (2, 6, 8))
    >>> embed(np.ones((2, 3, 8, 8), np.float32))
    Traceback (most recent call last):
    ...
    fluxpy.layers.DimensionMismatch: PatchEmbedding(4, 3 => 8, image=(8, 12)) expects x of shape (N, 3, 8, 12), \
got (2, 3, 8, 8) float32
    """

    def __init__(self, patch: int, cin: int, width: int, *, image: tuple[int, int] = (32, 32), rng: RNG = None):
        if isinstance(patch, bool) or not isinstance(patch, numbers.Integral) or patch < 1:
            raise ValueError(f"PatchEmbedding expects patch to be an int >= 1, got {patch!r}")
        image = tuple(image)
        if len(image) != 2 or any(not isinstance(s, numbers.Integral) or s < 1 or s % patch for s in image):
            raise ValueError(f"PatchEmbedding expects image (H, W), each a multiple of patch {patch}, got {image!r}")
        rng = as_rng(rng, "PatchEmbedding")
        self.conv = CrossCor((patch, patch), cin, width, stride=patch, rng=rng)
        tokens = (image[0] // patch) * (image[1] // patch)
        self.position = (0.02 * rng.standard_normal((tokens, width))).astype(np.float32)
        self.image = image

    def __call__(self, x):
        shape = tuple(getattr(x, "shape", ()))
        if shape[1:] != (self.conv.in_channels, *self.image):
            dtype = getattr(x, "dtype", "")
            raise DimensionMismatch(f"{self!r} expects x of shape (N, {self.conv.in_channels}, {self.image[0]}, "
                                    f"{self.image[1]}), got {shape} {dtype}")
        # (N, width, h, w) stored as (N, h, w, width): a copy only where the conv wrote C order (float32); the tokens
        # (N, h w, width) are then a C-order view, so the residual stream and every layer on it read whole rows (from
        # a strided view each layer norm would copy its input, forward and backward)
        y = as_memory_format(self.conv(x), "channels_last")
        n, width, h, w = y.shape
        tokens = reshape(transpose(y, (0, 2, 3, 1)), (n, h * w, width))
        return tokens + self.position

    def __repr__(self):
        patch = self.conv.weight.shape[2]
        return f"PatchEmbedding({patch}, {self.conv.in_channels} => {self.conv.out_channels}, image={self.image})"


@layer(children=("norm1", "attention", "norm2", "mlp"))
class EncoderBlock:
    """A pre-norm transformer encoder block on ``(N, L, width)``: ``x = x + attention(norm1(x))``, then
    ``x + mlp(norm2(x))``; ``attention`` is ``MultiHeadAttention(width, nheads)``, ``mlp`` is
    ``Chain(Dense(width => mlp_ratio * width, act), Dense(mlp_ratio * width => width))``, the norms ``LayerNorm``.

    >>> import numpy as np
    >>> block = EncoderBlock(8, 2, rng=0)
    >>> block, block.mlp[0], block(np.ones((3, 5, 8), np.float32)).shape
    (EncoderBlock(8, nheads=2), Dense(8 => 32, gelu), (3, 5, 8))
    """

    def __init__(self, width: int, nheads: int, *, mlp_ratio: int = 4, act=gelu, rng: RNG = None):
        rng = as_rng(rng, "EncoderBlock")
        self.norm1 = LayerNorm(width)
        self.attention = MultiHeadAttention(width, nheads, rng=rng)
        self.norm2 = LayerNorm(width)
        self.mlp = Chain(Dense(width, mlp_ratio * width, act, rng=rng), Dense(mlp_ratio * width, width, rng=rng))

    def __call__(self, x):
        shape = tuple(getattr(x, "shape", ()))
        width = self.norm1.shape[0]
        if len(shape) != 3 or shape[2] != width:
            raise DimensionMismatch(f"{self!r} expects x of shape (N, L, {width}), got {shape} "
                                    f"{getattr(x, 'dtype', '')}")
        y, _ = self.attention(self.norm1(x), need_scores=False)   # the fused kernels where they run
        x = x + y
        return x + self.mlp(self.norm2(x))

    def __repr__(self):
        ratio = self.mlp[0].out_features // self.mlp[0].in_features
        return f"EncoderBlock({self.norm1.shape[0]}, nheads={self.attention.nheads}" + \
            (f", mlp_ratio={ratio})" if ratio != 4 else ")")


def token_mean(x):
    """The mean over the tokens: ``(N, L, width)`` -> ``(N, width)``.

    >>> import numpy as np
    >>> token_mean(np.arange(12, dtype=np.float32).reshape(1, 3, 4))
    array([[4., 5., 6., 7.]], dtype=float32)
    """
    return mean(x, axis=1)


def vit_cifar(rng: RNG = None, classes: int = 10, *, width: int = 192, depth: int = 4, nheads: int = 3,
              patch: int = 4, image: tuple[int, int] = (32, 32), mlp_ratio: int = 4) -> Chain:
    """A small ViT for ``(N, 3, *image)`` inputs: ``Chain(PatchEmbedding(patch, 3 => width), depth x
    EncoderBlock(width, nheads), LayerNorm(width), token_mean, Dense(width => classes))`` (see the module
    docstring). ``rng``: a ``numpy.random.Generator``, an int seed, or ``None`` for fluxpy's global generator
    (:func:`fluxpy.seed`).

    >>> model = vit_cifar(rng=0, depth=2, width=64, nheads=2)
    >>> len(model), model[1], model[-1]
    (6, EncoderBlock(64, nheads=2), Dense(64 => 10))
    """
    who = "vit_cifar"
    if isinstance(classes, bool) or not isinstance(classes, numbers.Integral) or classes < 1:
        raise ValueError(f"{who} expects classes to be an int >= 1, got {classes!r}")
    rng = as_rng(rng, who)
    blocks = [EncoderBlock(width, nheads, mlp_ratio=mlp_ratio, rng=rng) for _ in range(depth)]
    return Chain(PatchEmbedding(patch, 3, width, image=image, rng=rng), *blocks, LayerNorm(width), token_mean,
                 Dense(width, int(classes), rng=rng))
