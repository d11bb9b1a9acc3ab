"""oneDNN's pooling primitives on the CPU: max and mean pools (zero padding counted), forward and backward, of
float32 ``(N, C, H, W)`` arrays, each one pass over NumPy's plain layout (oneDNN's jit kernels read it as it is: no
reorders), for the NumPy kernels of :mod:`fluxpy.kernels.cpu`.

The max pool's forward also writes a workspace, the kernel offset of each window's first maximum, from which its
backward sends each gradient in one pass. :func:`maxpool_forward` keeps it beside the output it returns (for as
long as that array lives), and :func:`maxpool_backward` finds it there; where it is not there (the backward called
on its own), the forward is run again for it.

oneDNN's max skips a NaN, and starts each window from the lowest finite float rather than ``-inf``; so where the
input holds a NaN, or a window's maximum is not above the lowest finite float (``-inf`` and ``-3.4e38`` windows),
:func:`maxpool_forward` gives None and the NumPy kernel runs: fluxpy's semantics (a NaN is its window's maximum and
takes its gradient; a window of ``-inf`` gives ``-inf``) stay exactly NumPy's. Ties go to the first maximum in
row-major order, as NumPy's kernel sends them.

>>> import numpy as np
>>> from fluxpy.ops.dims import PoolDims
>>> x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
>>> pdims = PoolDims.from_array(x, 2)
>>> y = maxpool_forward(x, pdims) if takes(x, pdims) else x[:, :, 1::2, 1::2]
>>> y[0, 0].tolist()
[[5.0, 7.0], [13.0, 15.0]]
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Any

import numpy as np

from .onednn import _ARG, _FORWARD_TRAINING, _Beside, _cached, _Dims, _execute, _plain_md, library

__all__ = ["takes", "maxpool_forward", "maxpool_backward", "meanpool_forward", "meanpool_backward"]

_MAX, _MEAN = 0x1FF, 0x2FF   # dnnl_pooling_max, dnnl_pooling_avg_include_padding
_QUERY_WORKSPACE, _ARG_WORKSPACE = 135, 64
_LOWEST = np.float32(-np.finfo(np.float32).max)


def takes(x: np.ndarray, pdims: Any) -> bool:
    """Whether oneDNN may run a pool of ``x`` under ``pdims``: float32, not empty, 2-d regular windows (the dims the
    kernels take), no window of padding only, and oneDNN is there.

    >>> from fluxpy.ops.dims import PoolDims
    >>> x = np.ones((1, 1, 4, 4))
    >>> takes(x, PoolDims.from_array(x, 2))   # float64: NumPy's
    False
    """
    return (type(x) is np.ndarray and x.dtype == np.float32 and x.size > 0 and x.ndim == 4
            and not pdims.adaptive and len(pdims.kernel) == 2 and not pdims.has_empty_windows
            and library() is not None)


class _Pool:
    """One pool's problem (algorithm, dims): the forward and backward primitives and a memory per argument, whose
    data is set per call."""

    def __init__(self, lib, alg: int, pdims) -> None:
        self.lib = lib
        src, dst = _plain_md(lib, tuple(pdims.x_shape)), _plain_md(lib, tuple(pdims.y_shape))
        (top, bottom, left, right), (kh, kw), (sh, sw) = pdims.pad, pdims.kernel, pdims.stride
        geometry = (_Dims(sh, sw), _Dims(kh, kw), _Dims(0, 0), _Dims(top, left), _Dims(bottom, right))
        forward = lib.handle("dnnl_pooling_forward_primitive_desc_create", lib.engine, _FORWARD_TRAINING, alg, src,
                             dst, *geometry, None)
        backward = lib.handle("dnnl_pooling_backward_primitive_desc_create", lib.engine, alg, src, dst, *geometry,
                              forward, None)
        workspace = lib.dll.dnnl_primitive_desc_query_md(forward, _QUERY_WORKSPACE, 0)
        self.workspace_bytes = lib.dll.dnnl_memory_desc_get_size(ctypes.c_void_p(workspace)) if workspace else 0
        mds = {"src": src, "dst": dst, "diff_src": src, "diff_dst": dst}
        if self.workspace_bytes:
            mds["workspace"] = ctypes.c_void_p(workspace)
        self.memories = {role: lib.handle("dnnl_memory_create", md, lib.engine, ctypes.c_void_p(None))
                         for role, md in mds.items()}
        self.forward, self.backward = (lib.handle("dnnl_primitive_create", pd) for pd in (forward, backward))
        for pd in (backward, forward):
            lib.call("dnnl_primitive_desc_destroy", pd)
        for md in (src, dst):
            lib.call("dnnl_memory_desc_destroy", md)

    def run(self, primitive, arrays: dict) -> None:
        """Run ``primitive`` on ``arrays`` (role -> C-contiguous array)."""
        args = []
        for role, array in arrays.items():
            memory = self.memories[role]
            self.lib.call("dnnl_memory_set_data_handle", memory, ctypes.c_void_p(array.ctypes.data))
            args.append((_ARG_WORKSPACE if role == "workspace" else _ARG[role], memory))
        _execute(self.lib, primitive, args)
        self.lib.call("dnnl_stream_wait", self.lib.stream)

    def destroy(self) -> None:
        for memory in self.memories.values():
            self.lib.call("dnnl_memory_destroy", memory)
        for primitive in (self.forward, self.backward):
            self.lib.call("dnnl_primitive_destroy", primitive)


class _Refused:
    """A problem oneDNN turned down (its descriptor failed): remembered, so that the NumPy kernel runs at once."""

    def destroy(self) -> None:
        pass


def _check(name: str, role: str, a: np.ndarray, shape: tuple) -> None:
    """Refuse an array whose shape is not the dims' (oneDNN would read or write past its end)."""
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} expects {role} of shape {tuple(shape)} (from its PoolDims), got {role} of shape "
                         f"{tuple(a.shape)}")


def _problem(lib, alg, pdims):
    def make():
        try:
            return _Pool(lib, alg, pdims)
        except RuntimeError:   # geometry oneDNN does not take (a pad beyond its limits): NumPy's kernel runs
            return _Refused()
    problem = _cached(lib, ("pool", alg, pdims), make)
    return None if isinstance(problem, _Refused) else problem


def _c(a):
    return np.ascontiguousarray(a, dtype=np.float32)


_WORKSPACES = _Beside()   # a max pool's output -> (its input, weakly; the workspace), by PoolDims


def _keep(y, x, pdims, workspace):
    _WORKSPACES.keep(y, pdims, (weakref.ref(x), workspace))


def _kept(y, x, pdims):
    entry = _WORKSPACES.get(y, pdims)
    return entry[1] if entry is not None and entry[0]() is x else None


def _forward_with_workspace(x, pdims):
    """``(y, workspace)`` of the max pool of float32 ``x``, or None where NumPy's result would differ (see the
    module's text) or oneDNN refuses the geometry."""
    lib = library()
    _check("maxpool_forward", "x", x, pdims.x_shape)
    if np.isnan(x.max()):
        return None
    x = _c(x)
    y = np.empty(pdims.y_shape, np.float32)
    with lib.lock:
        problem = _problem(lib, _MAX, pdims)
        if problem is None:
            return None
        workspace = np.empty(problem.workspace_bytes, np.uint8)
        problem.run(problem.forward, {"src": x, "dst": y, "workspace": workspace})
    if not y.min() > _LOWEST:
        return None
    return y, workspace


def maxpool_forward(x: np.ndarray, pdims: Any) -> np.ndarray | None:
    """The max pool of float32 ``x`` (see :func:`fluxpy.kernels.cpu.maxpool_forward`), its workspace kept for
    :func:`maxpool_backward`; None where the NumPy kernel must run (a NaN in ``x``, a window whose maximum is not
    above the lowest finite float, a geometry oneDNN refuses)."""
    found = _forward_with_workspace(x, pdims)
    if found is None:
        return None
    y, workspace = found
    _keep(y, x, pdims, workspace)
    return y


def maxpool_backward(dy: np.ndarray, x: np.ndarray, y: np.ndarray, pdims: Any) -> np.ndarray | None:
    """The gradient of the max pool ``y`` of float32 ``x`` for the cotangent ``dy`` (shape ``pdims.y_shape``): each
    value sent to the first maximum of its window; None where the NumPy kernel must run (as
    :func:`maxpool_forward`, or ``y`` is not oneDNN's pool of ``x``)."""
    for role, a, shape in (("dy", dy, pdims.y_shape), ("x", x, pdims.x_shape), ("y", y, pdims.y_shape)):
        _check("maxpool_backward", role, a, shape)
    workspace = _kept(y, x, pdims)
    if workspace is None:
        found = _forward_with_workspace(x, pdims)
        if found is None or not np.array_equal(found[0], y):
            return None
        workspace = found[1]
    dx = np.empty(pdims.x_shape, np.float32)
    lib = library()
    with lib.lock:
        problem = _problem(lib, _MAX, pdims)
        problem.run(problem.backward, {"diff_dst": _c(dy), "diff_src": dx, "workspace": workspace})
    return dx


def meanpool_forward(x: np.ndarray, pdims: Any) -> np.ndarray | None:
    """The mean of each window of float32 ``x``, zero padding counted; None where oneDNN refuses the geometry."""
    _check("meanpool_forward", "x", x, pdims.x_shape)
    y = np.empty(pdims.y_shape, np.float32)
    lib = library()
    with lib.lock:
        problem = _problem(lib, _MEAN, pdims)
        if problem is None:
            return None
        problem.run(problem.forward, {"src": _c(x), "dst": y})
    return y


def meanpool_backward(dy: np.ndarray, pdims: Any) -> np.ndarray | None:
    """The gradient of :func:`meanpool_forward` for the float32 cotangent ``dy``; None where oneDNN refuses the
    geometry."""
    _check("meanpool_backward", "dy", dy, pdims.y_shape)
    dx = np.empty(pdims.x_shape, np.float32)
    lib = library()
    with lib.lock:
        problem = _problem(lib, _MEAN, pdims)
        if problem is None:
            return None
        problem.run(problem.backward, {"diff_dst": _c(dy), "diff_src": dx})
    return dx
