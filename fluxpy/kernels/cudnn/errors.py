"""cuDNN's status codes, :class:`CudnnError` and :func:`check`, the one status check of every call.

>>> check(0, "cudnnConvolutionForward")
>>> try:
...     check(3000, "cudnnConvolutionForward", lambda: "x (1, 1, 4, 4) float32")
... except CudnnError as err:
...     print(err.status_name)
CUDNN_STATUS_NOT_SUPPORTED
"""
from __future__ import annotations

from collections.abc import Callable

from . import library

__all__ = ["CudnnError", "check", "status_name", "STATUS_NAMES", "NOT_SUPPORTED", "BAD_PARAM"]

STATUS_NAMES = {
    0: "CUDNN_STATUS_SUCCESS", 1001: "CUDNN_STATUS_NOT_INITIALIZED", 1002: "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH",
    1003: "CUDNN_STATUS_SERIALIZATION_VERSION_MISMATCH", 1004: "CUDNN_STATUS_DEPRECATED",
    1005: "CUDNN_STATUS_LICENSE_ERROR", 1006: "CUDNN_STATUS_RUNTIME_IN_PROGRESS",
    1007: "CUDNN_STATUS_RUNTIME_FP_OVERFLOW", 2000: "CUDNN_STATUS_BAD_PARAM",
    2002: "CUDNN_STATUS_BAD_PARAM_NULL_POINTER", 2003: "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER",
    2004: "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED", 2005: "CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND",
    2006: "CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT", 2007: "CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH",
    2008: "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH", 2009: "CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES",
    2010: "CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE", 3000: "CUDNN_STATUS_NOT_SUPPORTED",
    3001: "CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN", 3002: "CUDNN_STATUS_NOT_SUPPORTED_SHAPE",
    3003: "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE", 3004: "CUDNN_STATUS_NOT_SUPPORTED_LAYOUT",
    3005: "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER",
    3006: "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART", 3007: "CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH",
    3008: "CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING",
    3009: "CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE",
    3010: "CUDNN_STATUS_NOT_SUPPORTED_SHARED_MEMORY_INSUFFICIENT",
    3011: "CUDNN_STATUS_NOT_SUPPORTED_PADDING", 3012: "CUDNN_STATUS_NOT_SUPPORTED_BAD_LAUNCH_PARAM",
    3013: "CUDNN_STATUS_NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API", 4000: "CUDNN_STATUS_INTERNAL_ERROR",
    4001: "CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED", 4002: "CUDNN_STATUS_INTERNAL_ERROR_UNEXPECTED_VALUE",
    4003: "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    4004: "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED", 4005: "CUDNN_STATUS_INTERNAL_ERROR_BAD_LAUNCH_PARAM",
    4006: "CUDNN_STATUS_INTERNAL_ERROR_TEXTURE_CREATION_FAILED", 5000: "CUDNN_STATUS_EXECUTION_FAILED",
    5001: "CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER", 5002: "CUDNN_STATUS_EXECUTION_FAILED_CUBLAS",
    5003: "CUDNN_STATUS_EXECUTION_FAILED_CUDART", 5004: "CUDNN_STATUS_EXECUTION_FAILED_CURAND",
}

BAD_PARAM, NOT_SUPPORTED = 2000, 3000   # a status // 1000 == 3 is one of the NOT_SUPPORTED family


def status_name(status: int) -> str:
    """The name of a ``cudnnStatus_t`` (cuDNN's own string for codes this table lacks, where it is loaded).

    >>> status_name(2000)
    'CUDNN_STATUS_BAD_PARAM'
    """
    name = STATUS_NAMES.get(int(status))
    if name:
        return name
    if library.loaded():
        try:
            return library.fn.cudnnGetErrorString(int(status)).decode()
        except Exception:
            pass
    return f"CUDNN_STATUS_{status}"


class CudnnError(RuntimeError):
    """A cuDNN call failed: ``call``, ``status`` (int), ``status_name`` and ``shapes`` say which and why.

    >>> err = CudnnError("cudnnConvolutionForward", 2000, "x (1, 1, 4, 4) float32")
    >>> err.status_name
    'CUDNN_STATUS_BAD_PARAM'
    >>> str(err)
    'cudnnConvolutionForward failed with CUDNN_STATUS_BAD_PARAM (2000) for x (1, 1, 4, 4) float32'
    """

    def __init__(self, call: str, status: int, shapes: str = "", detail: str | None = None):
        self.call, self.status, self.shapes = call, int(status), shapes
        self.status_name = status_name(self.status)
        msg = f"{call} failed with {self.status_name} ({self.status})"
        if shapes:
            msg += f" for {shapes}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


def check(status: int, call: str, shapes: str | Callable[[], str] = "") -> None:
    """Raise :class:`CudnnError` for a non-zero ``status`` of ``call``; ``shapes`` (a string, or a function
    giving one, called only on failure) says which problem it was."""
    if status:
        raise CudnnError(call, status, shapes() if callable(shapes) else shapes)
