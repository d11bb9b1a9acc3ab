"""Data sets and augmentation: applications built on fluxpy's core (MLDatasets.jl and DataAugmentation.jl beside Flux).

- :mod:`fluxpy.datasets.mnist`: :func:`load_mnist` and the IDX format (:func:`read_idx`, :func:`write_idx`);
- :mod:`fluxpy.datasets.cifar`: :func:`load_cifar10` and its binary batches;
- :mod:`fluxpy.datasets.augment`: :func:`random_crop`, :func:`random_flip`, :func:`normalise` on either device.

Every loader gives NumPy arrays in fluxpy's layout (NCHW images, int64 labels), read from a folder or the cache
(the ``cache_dir`` option of :mod:`fluxpy.options`) and downloaded there when missing.

>>> import numpy as np, os, tempfile
>>> import fluxpy
>>> folder = tempfile.mkdtemp()
>>> fluxpy.datasets.write_cifar_batch(os.path.join(folder, "test_batch.bin"), np.zeros((2, 3, 32, 32), np.uint8),
...                                   [3, 8])
>>> x, y = fluxpy.datasets.load_cifar10("test", folder, dtype=np.uint8)
>>> fluxpy.datasets.random_flip(x, rng=0).shape, y
((2, 3, 32, 32), array([3, 8]))
"""
from __future__ import annotations

from . import augment, cifar, mnist
from .augment import normalise, random_crop, random_flip
from .cifar import (CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, CIFARUnavailableError, cifar_cache_dir, load_cifar10,
                    read_cifar_batch, write_cifar_batch)
from .mnist import MNISTUnavailableError, load_mnist, mnist_cache_dir, read_idx, write_idx

__all__ = ["mnist", "cifar", "augment", "load_mnist", "MNISTUnavailableError", "mnist_cache_dir", "read_idx",
           "write_idx", "load_cifar10", "CIFARUnavailableError", "cifar_cache_dir", "read_cifar_batch",
           "write_cifar_batch", "CIFAR10_CLASSES", "CIFAR10_MEAN", "CIFAR10_STD", "random_crop", "random_flip",
           "normalise"]
