"""Half-precision storage in fluxpy's own CUDA kernels: float16 and bfloat16 stored in 16 bits, computed in float32.

NumPy has no bfloat16: fluxpy uses ``ml_dtypes.bfloat16`` (:data:`BFLOAT16`), which CuPy 14 accepts as an array
dtype. A kernel source never includes ``cuda_fp16.h`` or ``cuda_bf16.h`` (NVRTC, as CuPy runs it, need not find
them): it holds a half as ``unsigned short`` and converts with PTX ``cvt`` (float16; bfloat16 stores on sm_80 and
later) and bit operations (bfloat16 loads, the top half of a float32, and its stores before sm_80); stores round to
nearest even and keep NaN a NaN. A kernel source writes ``#include "halfs.cuh"`` (``cuda/halfs.cuh``) and is compiled
with :func:`dtype_defines` of its dtype, which give it the names it writes against:

- ``T``: the storage type (``unsigned short``, ``float`` or ``double``);
- ``C``: the compute type (``float`` for the halves and float32, ``double`` for float64);
- ``LOAD(v)``: a ``T`` as a ``C``; ``STORE(v)``: a ``C`` rounded to a ``T``.

:data:`CONVERSIONS` alone is the four functions (``fx_load_f16``, ``fx_store_f16``, ``fx_load_bf16``,
``fx_store_bf16``), for a kernel that takes several dtypes (the traced broadcast kernels); :data:`CONVERT` names
a half dtype's load and store functions.

>>> import numpy as np
>>> dtype_defines(BFLOAT16), dtype_defines(np.float64)
({'FX_DTYPE': 2}, {'FX_DTYPE': 4})
>>> is_half(np.float16), is_half(BFLOAT16), is_half(np.float32)
(True, True, False)
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from . import compiler

__all__ = ["BFLOAT16", "HALVES", "KERNEL_DTYPES", "CONVERSIONS", "CONVERT", "is_half", "dtype_defines",
           "compute_dtype", "result_dtype"]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
HALVES = (np.dtype(np.float16), BFLOAT16)
KERNEL_DTYPES = HALVES + (np.dtype(np.float32), np.dtype(np.float64))   # what the hand-written kernels take

CONVERT = {np.dtype(np.float16): ("fx_load_f16", "fx_store_f16"), BFLOAT16: ("fx_load_bf16", "fx_store_bf16")}

CONVERSIONS = compiler.source("halfs.cuh")
"""The four conversion functions (``cuda/halfs.cuh`` without ``FX_DTYPE``), for a kernel of several dtypes."""

_DTYPE_CODE = {np.dtype(np.float16): 1, BFLOAT16: 2, np.dtype(np.float32): 3, np.dtype(np.float64): 4}


def is_half(dtype: Any) -> bool:
    """Whether ``dtype`` is float16 or bfloat16."""
    return np.dtype(dtype) in HALVES


def dtype_defines(dtype: Any) -> dict:
    """The define that makes ``cuda/halfs.cuh`` give ``T``, ``C``, ``LOAD`` and ``STORE`` for ``dtype``.

    >>> dtype_defines(BFLOAT16), dtype_defines(np.float32)
    ({'FX_DTYPE': 2}, {'FX_DTYPE': 3})
    """
    dtype = np.dtype(dtype)
    if dtype not in _DTYPE_CODE:
        raise TypeError(f"fluxpy's CUDA kernels store float16, bfloat16, float32 or float64, not {dtype}")
    return {"FX_DTYPE": _DTYPE_CODE[dtype]}


VECTORS = {np.dtype(np.float16): ("uint4", 8), BFLOAT16: ("uint4", 8), np.dtype(np.float32): ("float4", 4),
           np.dtype(np.float64): ("double2", 2)}
"""Each kernel dtype's 16-byte vector type, as a kernel source names it (``VT``), and its width in elements (``VW``)."""


def compute_dtype(dtype: Any) -> np.dtype:
    """The dtype a kernel computes ``dtype`` in: float32 for the halves and float32, float64 for float64."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def result_dtype(f: Callable, dtypes: Sequence) -> np.dtype:
    """The dtype of the elementwise ``f`` on arrays of ``dtypes`` (None: a Python number), NumPy's rule with one
    change: bfloat16 is probed as float16 and a float16 result read as bfloat16 (ml_dtypes' own promotion turns
    ``x * 1.5`` into float32), so that a half stays a half, as in Flux and JAX; float16 with bfloat16 gives float32.

    >>> result_dtype(lambda x: x * 1.5, [BFLOAT16]) == BFLOAT16, result_dtype(lambda x, y: x * y, [BFLOAT16, None])
    (True, dtype(bfloat16))
    """
    dtypes = [None if d is None else np.dtype(d) for d in dtypes]
    bf16, f16 = BFLOAT16 in dtypes, np.dtype(np.float16) in dtypes
    probe = [1.0 if d is None else np.full((1,), 0.5, dtype=np.float16 if d == BFLOAT16 else d) for d in dtypes]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = np.asarray(f(*probe)).dtype
    if bf16 and out == np.float16:
        return np.dtype(np.float32) if f16 else BFLOAT16
    return out
