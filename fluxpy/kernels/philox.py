"""A counter-based random generator for the GPU whose position lives on the device: Philox4x32-10.

CuPy's generator advances its position on the host, so a step captured as a CUDA graph would replay the
same Dropout mask every time. :class:`PhiloxGenerator` draws with a kernel that reads its position (a
counter) from device memory, and a second one-thread launch advances it: replays draw new numbers, and a
run with the same seed draws the same ones, captured or not.

Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
Random123 library) maps a 128-bit counter and a 64-bit key to four 32-bit words. Draw ``t`` of ``n``
values uses counters ``offset .. offset + ceil(n / per) - 1`` (``per`` = 4 float32 or 2 float64 values a
counter), then ``offset`` grows by that many. A float32 value is ``(word >> 8) * 2**-24``; a float64 value
takes two words, ``((w0 >> 5) * 2**26 + (w1 >> 6)) * 2**-53`` (NumPy's construction): both in [0, 1).
:func:`uniform_numpy` computes the same numbers on the host (the reference the GPU kernel is tested against).

>>> [hex(w) for w in philox4x32_10(np.zeros((4, 1), np.uint32), (0, 0))[:, 0]]   # Random123's first test vector
['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
>>> uniform_numpy((1, 2), 0, 3, np.float32).round(4)
array([0.0219, 0.597 , 0.1526], dtype=float32)
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import cupy
from ..layout import is_channels_last
from . import compiler
from .halfs import KERNEL_DTYPES, dtype_defines

__all__ = ["philox4x32_10", "uniform_numpy", "PhiloxGenerator", "PER_COUNTER", "SOURCE_VARIANTS", "dropout",
           "dropout_supports"]

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LOW = np.uint64(0xFFFFFFFF)
PER_COUNTER = {np.dtype(np.float32): 4, np.dtype(np.float64): 2}


def philox4x32_10(ctr: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 of the counters ``ctr`` (a ``(4, n)`` uint32 array, one counter per column) under ``key``
    (two 32-bit ints); a ``(4, n)`` uint32 array of the output words.

    >>> out = philox4x32_10(np.full((4, 1), 0xFFFFFFFF, np.uint32), (0xFFFFFFFF, 0xFFFFFFFF))
    >>> [hex(w) for w in out[:, 0]]   # Random123's second test vector
    ['0x408f276d', '0x41c83b0e', '0xa20bc7c6', '0x6d5451fd']
    """
    c = [np.asarray(ctr[i], np.uint64) for i in range(4)]
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for _ in range(10):
        p0, p1 = _M0 * c[0], _M1 * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & _LOW, (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1),
             p0 & _LOW]
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return np.stack(c).astype(np.uint32)


def uniform_numpy(key: tuple[int, int], offset: int, n: int, dtype: Any) -> np.ndarray:
    """The ``n`` values in [0, 1) that the GPU kernel draws from counter ``offset`` under ``key`` (see the module).

    >>> uniform_numpy((7, 0), 0, 5, np.float64).shape
    (5,)
    """
    dtype = np.dtype(dtype)
    per = PER_COUNTER[dtype]
    counters = -(-n // per)
    c = np.arange(offset, offset + counters, dtype=np.uint64)
    ctr = np.stack([c & _LOW, c >> np.uint64(32), np.zeros_like(c), np.zeros_like(c)]).astype(np.uint32)
    words = philox4x32_10(ctr, key).T.reshape(-1)   # counter by counter, four words each
    if dtype == np.float32:
        return ((words[:n] >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24))
    pairs = words.reshape(-1, 2)[:n].astype(np.uint64)
    a, b = pairs[:, 0] >> np.uint64(5), pairs[:, 1] >> np.uint64(6)
    return (a * np.uint64(67108864) + b).astype(np.float64) * (1.0 / 9007199254740992.0)


_CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_NULL = np.uint64(0)   # no mask wanted


def SOURCE_VARIANTS():
    """``(source, defines)`` of every variant the generator launches: ``cuda/philox.cu`` for float32 and float64,
    ``cuda/dropout.cu`` for each dtype the kernels store.

    >>> [source for source, _ in SOURCE_VARIANTS()]
    ['philox.cu', 'philox.cu', 'dropout.cu', 'dropout.cu', 'dropout.cu', 'dropout.cu']
    """
    for dtype in PER_COUNTER:
        yield "philox.cu", {"FX_REAL": _CTYPES[dtype]}
    for dtype in KERNEL_DTYPES:
        yield "dropout.cu", dtype_defines(dtype)


def _kernels(dtype):
    defines = {"FX_REAL": _CTYPES[dtype]}
    return (compiler.function("philox.cu", "fluxpy_philox_uniform", defines),
            compiler.function("philox.cu", "fluxpy_philox_advance", defines))


class PhiloxGenerator:
    """fluxpy's generator for CuPy arrays (what :func:`fluxpy.random.rng_for` gives): ``random(shape, dtype)``
    as ``numpy.random.Generator.random``, drawn on the device from a position kept on the device, so that a draw
    inside a captured CUDA graph draws new numbers at every replay (``capturable``).

    ``seed`` (an int) gives the key; each device has its own position, starting at 0. Values: see the module.

    >>> PhiloxGenerator.capturable
    True
    """
    capturable = True

    def __init__(self, seed: int) -> None:
        seed = int(seed)
        self.key = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
        self._offsets: dict = {}   # device id -> uint64 array of one element: the next counter
        self._seeds: dict = {}     # device id -> the key as an int64 array of one element (for reserve)

    def offset(self) -> Any:
        """The current device's position (a one-element uint64 CuPy array), made at 0 on first use."""
        dev = cupy.cuda.runtime.getDevice()
        offset = self._offsets.get(dev)
        if offset is None:
            offset = self._offsets[dev] = cupy.zeros(1, dtype=np.uint64)
        return offset

    def reserve(self, counters: int) -> tuple[Any, Any]:
        """``(seed, offset)`` for a kernel with a Philox generator of its own (cuDNN's attention dropout): one-element
        int64 CuPy arrays, the key and a copy of the current position; the position then moves past ``counters``
        counters, on the device (a captured step reserves new numbers at every replay).

        >>> PhiloxGenerator.reserve.__name__   # needs a GPU: tests/gpu/test_attention_gpu.py draws with it
        'reserve'
        """
        dev = cupy.cuda.runtime.getDevice()
        seed = self._seeds.get(dev)
        if seed is None:
            seed = self._seeds[dev] = cupy.asarray(np.array([self.key[0] | (self.key[1] << 32)], dtype=np.uint64)
                                             .view(np.int64))
        offset = self.offset()
        taken = offset.copy().view(np.int64)
        _kernels(np.dtype(np.float32))[1]((1,), (1,), (offset, np.uint64(max(int(counters), 1))))
        return seed, taken

    def dropout(self, x: Any, p: float, mask: bool = True) -> tuple[Any, Any]:
        """``(y, mask)``: inverted dropout of the CuPy array ``x`` (what :func:`dropout_supports` takes) in one launch
        and the position's advance: ``mask = (u >= p) / (1 - p)`` in ``x``'s dtype and ``y = x * mask``, equal item
        for item to that composite of :meth:`random`'s numbers (float32 ones for the halves), drawn in the order
        of ``x``'s memory (channels-last data keeps its layout); ``mask`` None unless asked for.

        >>> PhiloxGenerator.dropout.__name__   # needs a GPU: tests/gpu/test_dropout_gpu.py
        'dropout'
        """
        real = np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)
        n, per = x.size, PER_COUNTER[real]
        y = cupy.empty_like(x)
        kept = cupy.empty_like(x) if mask else None
        counters = -(-n // per)
        kernel = compiler.function("dropout.cu", "fluxpy_dropout", dtype_defines(x.dtype))
        offset = self.offset()
        compiler.launch(kernel, min(-(-counters // 256), 4096), 256,
                        (x, y, _NULL if kept is None else kept, np.int64(n), offset, np.uint32(self.key[0]),
                         np.uint32(self.key[1]), real.type(p), real.type(1 / (1 - p))))
        _kernels(real)[1]((1,), (1,), (offset, np.uint64(counters)))
        return y, kept

    def random(self, shape: Any = None, dtype: Any = np.float64) -> Any:
        """Uniform values in [0, 1) of ``shape`` (float32 or float64), two launches and no host sync."""
        dtype = np.dtype(dtype)
        if dtype not in PER_COUNTER:
            raise TypeError(f"PhiloxGenerator.random draws float32 or float64, got {dtype}")
        shape = () if shape is None else (tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),))
        n = int(np.prod(shape, dtype=np.int64))
        out = cupy.empty(n, dtype=dtype)
        counters = -(-n // PER_COUNTER[dtype])
        if counters:
            draw, advance = _kernels(dtype)
            offset = self.offset()
            blocks = int(min(-(-counters // 256), 4096))
            draw((blocks,), (256,), (out, np.int64(n), offset, np.uint32(self.key[0]), np.uint32(self.key[1])))
            advance((1,), (1,), (offset, np.uint64(counters)))
        return out.reshape(shape)


def dropout(x: Any, p: float, rng: PhiloxGenerator, mask: bool = True) -> tuple[Any, Any]:
    """``rng.dropout(x, p, mask)`` (:meth:`PhiloxGenerator.dropout`): the ``dropout`` op's kernel.

    >>> dropout.__name__   # needs a GPU: tests/gpu/test_dropout_gpu.py checks it against the host, bit for bit
    'dropout'
    """
    return rng.dropout(x, p, mask)


def dropout_supports(x: Any, p: float, rng: Any, mask: bool = True) -> bool:
    """Whether :func:`dropout` takes the call: ``rng`` a :class:`PhiloxGenerator`, ``x`` a non-empty CuPy array of a
    dtype the kernels store, C-contiguous or channels-last, and ``0 < p < 1``.

    >>> dropout_supports(np.ones(2), 0.5, np.random.default_rng(0))   # a host generator: the composite
    False
    """
    return (type(rng) is PhiloxGenerator and type(x) is cupy.ndarray and x.dtype in KERNEL_DTYPES and x.size > 0
            and (x._c_contiguous or is_channels_last(x)) and 0 < p < 1)


# name -> kernel: what fluxpy.kernels.gpu registers for CuPy arrays. fluxpy.random.rng_for makes the GPU's generator
# with it; CuPy's own generator (cupy.random) is left as it is.
KERNELS = {"default_rng": PhiloxGenerator, "dropout": (dropout, dropout_supports)}
