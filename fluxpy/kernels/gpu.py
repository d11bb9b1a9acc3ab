"""The GPU backend: every CUDA kernel fluxpy has, put in the kernel table for CuPy arrays.

Each CUDA module lists its kernels in a ``KERNELS`` dict (op name -> kernel, or ``(kernel,
supports)`` for an optional one that takes only some calls); :func:`register` puts them all in the
table under ``"cupy"``, after taking a copy of it, and :func:`unregister` puts that copy back, so
the table is exactly what it was. The table calls :func:`register` the first time it is asked about
CuPy arrays; it does nothing and returns ``False`` where CuPy cannot be imported. After an explicit
:func:`unregister` the table stays without them until :func:`register`.

======================  =====================================================================
module                  kernels
======================  =====================================================================
``elementwise``         ``broadcast`` and ``broadcast_backward`` (compiled from ``f`` by ``trace``),
                        ``bias_act``, ``bias_act_backward``, ``bias_act_preactivation``, ``erf``
``cuda_optimise``       ``optimiser_step``, ``optimiser_step_many``, ``optimiser_advance`` (generated from
                        a rule's formula), ``finite_total``, ``vector_norm``, ``loss_scale_advance``
``reduce``              ``sum`` (the mapreducedim kernel behind ``unbroadcast`` and ``sum``)
``cuda_conv``           ``conv_forward``, ``conv_backward_data``, ``conv_backward_filter``,
                        ``conv_bias_act_forward``, ``conv_bias_act_backward`` (cuDNN)
``cuda_pool``           ``maxpool_*``, ``meanpool_*``
``cuda_softmax``        ``logit_crossentropy_rows``, ``logit_crossentropy_labels`` and their backwards
``cuda_norm``           ``batchnorm_forward``, ``batchnorm_backward`` (cuDNN)
``cublas``              ``matmul`` (our cuBLAS binding: capturable)
``cublaslt``            ``dense_forward``, ``dense_backward_weight`` (cuBLASLt with fused epilogues: capturable)
``cuda_scatter``        ``scatter``, ``gather`` (``cupyx.scatter_add``/``_max``/``_min``, indexing)
``cuda_layernorm``      ``layernorm_forward``, ``layernorm_backward`` (a row per warp or block, in registers)
``cuda_groupnorm``      ``groupnorm_forward``, ``groupnorm_backward`` (a block per (sample, group); activation fused)
``cuda_rmsnorm``        ``rmsnorm_forward``, ``rmsnorm_backward`` (a block a row; fixed-order column sums)
``cuda_upsample``       ``upsample_nearest`` and its backward (whole scales: a gather, a fixed-order block sum)
``cuda_recurrent``      ``lstm_gates_forward``/``_backward``, ``gru_gates_forward``/``_backward``
``cuda_rnn``            ``rnn_forward``, ``rnn_backward``: a whole RNN, LSTM or GRU (cuDNN's RNN calls)
``cuda_arrays``         ``stack``, ``concatenate`` while a CUDA-graph capture is under way (a copy per array)
``cuda_halves``         ``astype`` and ``add`` of halves (vectorised), and the backward walk's sum of two
                        half-precision cotangents (``set_cotangent_sum``)
``philox``              ``default_rng``: the generator of :func:`fluxpy.random.rng_for` for CuPy arrays
======================  =====================================================================

>>> isinstance(register(), bool)
True
"""
from __future__ import annotations

from . import _KERNELS, _backend_lock, _settle, restore
from . import register as register_kernel
from ..backend import cupy
from ..backward import set_cotangent_sum

__all__ = ["register", "unregister", "is_registered"]

_before: list = []   # the table as it was before register(), while registered


def _modules():
    from . import (cublas, cublaslt, cuda_arrays, cuda_conv, cuda_groupnorm, cuda_halves, cuda_layernorm, cuda_norm,
                   cuda_optimise, cuda_pool, cuda_recurrent, cuda_rmsnorm, cuda_rnn, cuda_scatter, cuda_softmax,
                   cuda_upsample, elementwise, philox, reduce)
    return (elementwise, cuda_optimise, reduce, cuda_conv, cuda_pool, cuda_softmax, cuda_norm, cublas, cublaslt,
            cuda_scatter, cuda_layernorm, cuda_groupnorm, cuda_rmsnorm, cuda_upsample, cuda_recurrent, cuda_rnn,
            cuda_arrays, cuda_halves, philox)


def register() -> bool:
    """Register every CuPy kernel; ``True`` if CuPy is present (and they are registered). Idempotent.

    >>> register() == (cupy is not None)
    True
    """
    if cupy is None:
        return False
    with _backend_lock:   # a lookup in another thread waits until the table is whole
        if not _before:
            table = dict(_KERNELS)   # not snapshot(), which registers these kernels first
            for module in _modules():
                for name, entry in module.KERNELS.items():
                    fn, supports = entry if isinstance(entry, tuple) else (entry, None)
                    register_kernel(name, "cupy", fn, supports)
            from .cuda_halves import plain_add
            set_cotangent_sum(plain_add)   # the backward walk's sums of halves, vectorised
            _before.append(table)
        _settle("cupy")
    return True


def unregister() -> None:
    """Put the kernel table back exactly as it was before :func:`register`; CuPy arrays then take the ops'
    composites (and CuPy's own generator) until :func:`register` is called again.

    >>> unregister(); is_registered()
    False
    >>> _ = register()
    """
    with _backend_lock:
        if _before:
            restore(_before.pop())
            set_cotangent_sum(None)
        _settle("cupy")


def is_registered() -> bool:
    """Whether the CuPy kernels are in the table now.

    >>> _ = register(); is_registered() == (cupy is not None)
    True
    """
    return bool(_before)
