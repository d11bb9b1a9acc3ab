"""fluxpy's binding of cuDNN 9 (``libcudnn.so.9``) with ctypes, on CuPy pointers.

CuPy 14 has no cuDNN module, so fluxpy binds the library itself. The package, module by module:

- :mod:`~fluxpy.kernels.cudnn.library`: finding and loading the library (the ``nvidia-cudnn-cu13``
  wheel or the system), the bound functions, :func:`available`, :func:`version`;
- :mod:`~fluxpy.kernels.cudnn.errors`: :class:`CudnnError` (naming the call, the status and the
  problem) and the one status check;
- :mod:`~fluxpy.kernels.cudnn.handle`: one handle per device bound to CuPy's current stream, the workspace of a
  call, the options (:mod:`fluxpy.options`) that plans depend on;
- :mod:`~fluxpy.kernels.cudnn.descriptors`: the enums, the legacy descriptors and the backend
  API's descriptor calls;
- :mod:`~fluxpy.kernels.cudnn.geometry`: the asymmetric-padding split, padding the input, cropping
  ``dx``, contiguous and aligned arrays (for both paths);
- :mod:`~fluxpy.kernels.cudnn.legacy`: the ``cudnnConvolution*`` calls, the per-problem
  :class:`Plan`, algorithm search and its disk cache (:func:`cache_file`, :func:`stats`);
- :mod:`~fluxpy.kernels.cudnn.graph`: the backend (graph) API: execution plans per problem,
  autotuned, falling back per problem to the legacy calls;
- :mod:`~fluxpy.kernels.cudnn.choice`: choosing a problem's execution plan (the heuristics' candidates filtered by the
  options, timed, the search within its budget, the pick);
- :mod:`~fluxpy.kernels.cudnn.search`: the search past the heuristics (every engine, the knobs of the fastest);
- :mod:`~fluxpy.kernels.cudnn.diskcache`: the files of choices kept between runs (both paths);
- :mod:`~fluxpy.kernels.cudnn.rnn`: the RNN API (a whole stacked, bidirectional RNN, LSTM or GRU per call), its
  plans per problem.

Which of these the kernel table uses for CuPy arrays is decided by :mod:`fluxpy.kernels.cuda_conv`. The
settings are :mod:`fluxpy.options`'s: ``allow_tf32``, ``deterministic``, ``workspace_limit``, ``autotune``,
``search_budget_ms``, ``disk_cache``, ``cache_dir``, ``cudnn_library``. The package imports without CuPy or
cuDNN; :func:`available` says whether it can run and why not.

>>> ok, why = available()
>>> isinstance(ok, bool) and isinstance(why, str)
True
"""
from __future__ import annotations

from . import choice, descriptors, diskcache, errors, geometry, graph, handle, legacy, library, rnn, search
from .errors import STATUS_NAMES, CudnnError
from .legacy import Plan, cache_file, plan, stats
from .library import available, version

__all__ = ["CudnnError", "STATUS_NAMES", "available", "version", "clear_cache", "stats", "cache_file", "plan", "Plan",
           "library", "errors", "handle", "descriptors", "geometry", "legacy", "graph", "choice",
           "search", "diskcache", "rnn"]


def clear_cache(memory: bool = True, disk: bool = False) -> None:
    """Forget the legacy plans and algorithm choices, the graph path's execution plans and the RNN plans in
    memory; with ``disk=True`` also delete both files of choices (:func:`cache_file`, :func:`graph.cache_file`).

    >>> clear_cache()
    """
    legacy.clear_cache(memory=memory, disk=disk)
    graph.clear_cache(memory=memory, disk=disk)
    if memory:
        rnn.clear_cache()
