"""GPU registrations: route fluxpy's generic entry points to the CUDA kernels for CuPy arrays.

``register()`` routes conv to cuDNN's graph API with cached execution plans (:mod:`fluxpy.kernels.cudnn_graph`,
falling back per problem to the legacy calls of :mod:`fluxpy.kernels.cuda_conv`) and pooling to CuPy kernels,
makes :func:`fluxpy.unbroadcast` reduce CuPy gradients with the deterministic mapreducedim kernel :func:`fluxpy.kernels.reduce.mapreduce`, :func:`fluxpy.broadcast` run its
forward and pullback as fused kernels compiled from ``f`` (:mod:`fluxpy.kernels.elementwise`),
and :func:`fluxpy.ops.bias_act.bias_act` run as one forward kernel and one backward pass
(``dx`` and the bias gradient together). It does nothing and returns
``False`` where CuPy cannot be imported, so it is safe to call unconditionally, once, after
``fluxpy.broadcast`` is importable (e.g. at the end of ``fluxpy/__init__.py``)::

    from .kernels import gpu as _gpu
    _gpu.register()

``unregister()`` restores the defaults (``cupy.sum``, the generic rules on CuPy arrays).

>>> isinstance(register(), bool)
True
"""
from __future__ import annotations

from ..backend import cupy

__all__ = ["register", "unregister"]


def register() -> bool:
    """Register the CuPy implementations; ``True`` if CuPy is present (and they were registered).

    >>> register() == (cupy is not None)
    True
    """
    if cupy is None:
        return False
    from ..broadcast import register_fused, register_reducer
    from ..ops.bias_act import register_impl
    from . import elementwise
    from .reduce import unbroadcast_sum
    register_reducer(cupy.ndarray, unbroadcast_sum)
    register_fused(cupy.ndarray, elementwise.fused_forward, elementwise.fused_pullback)
    register_impl(cupy.ndarray, _BiasActCuPy())
    from ..optimise import register_fused_step
    register_fused_step(cupy.ndarray, elementwise.fused_step)
    from . import cuda_conv, cuda_softmax, cudnn_graph
    cuda_conv.register()     # cuDNN convolutions (legacy API) and CuPy pooling kernels
    cudnn_graph.register()   # ... then cuDNN's graph API with cached plans (legacy per problem where none finalizes)
    cuda_softmax.register()  # the classifier loss, one kernel each way
    return True


class _BiasActCuPy:
    """bias_act's CuPy kernels (see :mod:`fluxpy.kernels.elementwise`)."""

    @staticmethod
    def forward(x, b, act):
        from .elementwise import bias_act_forward
        return bias_act_forward(x, b, act)

    @staticmethod
    def output_backward(kind, y, dy, bshape, need_x, need_b):
        from .elementwise import bias_act_output_backward
        return bias_act_output_backward(kind, y, dy, bshape, need_x, need_b)

    @staticmethod
    def generic_backward(x, b, act, dy):
        from .elementwise import bias_act_generic_backward
        return bias_act_generic_backward(x, b, act, dy)


def unregister() -> None:
    """Undo :func:`register`: CuPy gradients go back to ``cupy.sum``, broadcast and bias_act to the generic rules.

    >>> unregister()
    """
    if cupy is None:
        return
    from ..broadcast import register_fused, register_reducer
    from ..ops.bias_act import register_impl
    register_reducer(cupy.ndarray, None)
    register_fused(cupy.ndarray, None, None)
    register_impl(cupy.ndarray, None)
    from ..optimise import register_fused_step
    register_fused_step(cupy.ndarray, None)
