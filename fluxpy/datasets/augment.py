"""Data augmentation for image batches, on whichever device the batch is: :func:`random_crop`, :func:`random_flip`,
and per-channel :func:`normalise`.

Each function takes a NumPy or CuPy array of images in fluxpy's NCHW layout ``(N, C, H, W)``, of
any dtype (uint8 straight from the files, or float), and returns a new array of the same module:
augment a batch after moving it to the GPU and the work is done there. The random choices (a few
numbers per image) are drawn on the host from ``rng``: a ``numpy.random.Generator``, an int seed,
or ``None`` for fluxpy's global generator (reset by :func:`fluxpy.seed`). So the same seed gives
the same crops and flips on the CPU and on the GPU. Nothing loops over images in Python.

>>> import numpy as np
>>> x = np.arange(2 * 3 * 4 * 4, dtype=np.uint8).reshape(2, 3, 4, 4)
>>> y = random_flip(random_crop(x, 1, rng=0), rng=0)
>>> y.shape, y.dtype
((2, 3, 4, 4), dtype('uint8'))
>>> normalise(x, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)).dtype
dtype('float32')
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from ..backend import Array, get_array_module, is_array, is_float_dtype
from ..data import describe
from ..random import RNG, as_rng

__all__ = ["random_crop", "random_flip", "normalise"]


def random_crop(x: Array, padding: int = 4, *, rng: RNG = None) -> Array:
    """Each image shifted by its own random offset, with ``padding`` rows and columns of zeros let in.

    Pads every image with ``padding`` zeros on each side and crops a window of the original size at
    a random position, the offsets drawn independently per image, uniformly from
    ``0 .. 2 * padding`` in each direction. That is ``out[n, :, i, j] = x[n, :, i + dy - padding,
    j + dx - padding]``, zero where that falls outside the image (the CIFAR augmentation of He et
    al. 2016 with ``padding=4``). ``padding=0`` returns a copy.

    >>> import numpy as np
    >>> x = np.ones((1, 1, 3, 3), np.float32)
    >>> random_crop(x, 1, rng=3)[0, 0]
    array([[0., 1., 1.],
           [0., 1., 1.],
           [0., 0., 0.]], dtype=float32)
    >>> random_crop(x, -1)
    Traceback (most recent call last):
    ...
    ValueError: random_crop expects padding to be an int >= 0, got -1
    """
    xp = _check_images(x, "random_crop")
    padding = _check_count(padding, "random_crop", "padding")
    n, c, h, w = x.shape
    dy, dx = as_rng(rng, "random_crop").integers(0, 2 * padding + 1, size=(2, n))
    padded = xp.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    rows = xp.asarray(dy)[:, None] + xp.arange(h)  # (n, h): the padded rows each output row reads
    cols = xp.asarray(dx)[:, None] + xp.arange(w)
    return padded[xp.arange(n)[:, None, None, None], xp.arange(c)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]


def random_flip(x: Array, p: float = 0.5, *, rng: RNG = None) -> Array:
    """Each image mirrored left to right (along the last axis, W) with probability ``p``, independently.

    >>> import numpy as np
    >>> x = np.arange(3.0).reshape(1, 1, 1, 3)
    >>> random_flip(x, p=1.0)
    array([[[[2., 1., 0.]]]])
    >>> random_flip(x, p=0.0)
    array([[[[0., 1., 2.]]]])
    >>> random_flip(x, p=2)
    Traceback (most recent call last):
    ...
    ValueError: random_flip expects p to be a probability in [0, 1], got 2
    """
    xp = _check_images(x, "random_flip")
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p <= 1:
        raise ValueError(f"random_flip expects p to be a probability in [0, 1], got {_shown(p)}")
    flip = xp.asarray(as_rng(rng, "random_flip").random(x.shape[0]) < p)
    return xp.where(flip[:, None, None, None], x[..., ::-1], x)


def normalise(x: Array, mean: Sequence[float], std: Sequence[float]) -> Array:
    """``(x - mean) / std`` per channel (axis 1), as float: ``mean`` and ``std`` hold one value per channel.

    Integer images (uint8) are first converted to float32 and scaled to ``[0, 1]`` (divided by
    255), so ``mean`` and ``std`` are always in the units of ``[0, 1]`` pixels, as
    :data:`fluxpy.datasets.CIFAR10_MEAN` and :data:`fluxpy.datasets.CIFAR10_STD`. Float images keep their
    dtype and are not rescaled.

    >>> import numpy as np
    >>> x = np.array([0, 51, 255], np.uint8).reshape(1, 1, 1, 3)
    >>> normalise(x, mean=[0.2], std=[0.5]).round(4)
    array([[[[-0.4,  0. ,  1.6]]]], dtype=float32)
    >>> normalise(x, mean=[0.2, 0.1], std=[0.5, 0.5])
    Traceback (most recent call last):
    ...
    ValueError: normalise expects one mean and one std per channel (x.shape[1] == 1), got 2 means and 2 stds
    """
    xp = _check_images(x, "normalise")
    channels = x.shape[1]
    mean, std = np.asarray(mean, np.float64).reshape(-1), np.asarray(std, np.float64).reshape(-1)
    if mean.shape != (channels,) or std.shape != (channels,):
        raise ValueError(f"normalise expects one mean and one std per channel (x.shape[1] == {channels}), "
                         f"got {mean.size} means and {std.size} stds")
    if not np.all(std > 0):
        raise ValueError(f"normalise expects every std > 0, got {std.tolist()}")
    dtype = x.dtype if is_float_dtype(x.dtype) else np.dtype(np.float32)
    unit = 1.0 if is_float_dtype(x.dtype) else 1 / 255
    scale = xp.asarray((unit / std).reshape(1, channels, 1, 1), dtype)  # one multiply-add: x * unit / std - mean / std
    shift = xp.asarray((-mean / std).reshape(1, channels, 1, 1), dtype)
    return x.astype(dtype, copy=False) * scale + shift


def _check_images(x, who):
    """The array module of ``x``, a NumPy or CuPy array of images ``(N, C, H, W)``; a clear error otherwise."""
    if not is_array(x):
        raise TypeError(f"{who} expects a NumPy or CuPy array of images (N, C, H, W), got {describe(x)}"
                        + (" (augment the data before the model, outside gradient)"
                           if getattr(x, "__fluxpy_tracked__", False) else ""))
    if x.ndim != 4:
        raise ValueError(f"{who} expects images of shape (N, C, H, W), got {describe(x)}")
    if x.dtype.kind not in "uif":
        raise TypeError(f"{who} expects images of an integer or float dtype, got {describe(x)}")
    return get_array_module(x)


def _check_count(value, who, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{who} expects {name} to be an int >= 0, got {_shown(value)}")
    return int(value)


def _shown(value):
    """A number as it was written (``-1``, ``2.5``); anything else described by type."""
    return repr(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else describe(value)
