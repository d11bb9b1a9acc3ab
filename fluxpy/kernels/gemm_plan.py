"""How a matrix product ``a @ b`` runs as one cuBLAS call: plain Python over shapes and strides, no CuPy (the calls
are made by :mod:`fluxpy.kernels.cublas`; the tests check every plan by reading the operands' memory as cuBLAS does).

``a`` ``(*batch_a, m, k)`` and ``b`` ``(*batch_b, k, n)`` (NumPy's rules: batch axes broadcast) give ``c``
``(*batch, m, n)``, written C-contiguous. cuBLAS is column-major, and a row-major ``(r, c)`` matrix with row stride
``ld`` is, to cuBLAS, the column-major ``(c, r)`` matrix ``m.T`` with leading dimension ``ld``; so the row-major
``C = A B`` is computed as the column-major ``C^T = B^T A^T``: cuBLAS's first operand is ``b``, its second ``a``
(:meth:`GemmPlan.call`). Each operand is read where it lies when its matrices are row- or column-major (a transposed
view such as ``w.T`` costs nothing) and its batch axes are one stride apart once flattened (a broadcast batch axis
has stride 0, which cuBLAS's strided-batched calls allow); otherwise it is first copied (:attr:`Operand.copy`):
C-ordered in its own orientation, or, where its batch axes broadcast against the other operand's in a pattern no
single stride describes, broadcast to the whole batch. Where ``b`` is one matrix for the whole batch and ``a``'s
rows follow one another, the batch is one gemm over ``batch * m`` rows.

Sizes must fit cuBLAS's 32-bit ints (:data:`INT_MAX`): :func:`plan_matmul` gives None otherwise; strides are 64-bit.

>>> q = plan_matmul((8, 4, 16, 32), (2048, 512, 32, 1), (8, 4, 32, 16), (2048, 512, 1, 32))   # q @ k^T, heads apart
>>> q.kind, q.batch, q.a, q.b
('strided', 32, Operand(copy=None, transposed=False, ld=32, stride=512), Operand(copy=None, transposed=True, ld=32, \
stride=512))
>>> plan_matmul((8, 4, 16, 32), (2048, 32, 128, 1), (32, 16), (16, 1)).a   # heads split from (8, 16, 4 * 32): a copy
Operand(copy='contiguous', transposed=False, ld=32, stride=512)
>>> plan_matmul((5, 6, 7), (42, 7, 1), (7, 3), (1, 7)).kind   # one gemm over the 30 rows of a
'gemm'
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

__all__ = ["INT_MAX", "Operand", "GemmCall", "GemmPlan", "matmul_shape", "plan_matmul", "matrix_layout",
           "batch_stride"]

INT_MAX = 2**31 - 1   # cuBLAS's sizes and leading dimensions are 32-bit ints (its batch strides are 64-bit)
_OP_N, _OP_T = 0, 1   # cublasOperation_t


@dataclass(frozen=True)
class Operand:
    """How cuBLAS reads one operand, after ``copy``: None (the array as it lies), ``"contiguous"`` (a C-ordered copy
    of the array, its matrices kept column-major where ``transposed``: ``x.swapaxes(-1, -2)`` copied C-ordered and
    swapped back) or ``"broadcast"`` (the same of the array broadcast to the product's batch shape). ``transposed``:
    its matrices are column-major; ``ld``: the leading dimension cuBLAS reads them with; ``stride``: elements from
    one matrix of the batch to the next (0: one matrix serves the whole batch)."""
    copy: str | None
    transposed: bool
    ld: int
    stride: int


@dataclass(frozen=True)
class GemmCall:
    """The arguments of the cuBLAS call, in cuBLAS's order (its ``A`` is ``b``, its ``B`` is ``a``): a plain gemm
    reads ``m, n, k, lda, ldb, ldc``; a strided-batched one also the strides and ``batch``."""
    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    stride_a: int
    ldb: int
    stride_b: int
    ldc: int
    stride_c: int
    batch: int


@dataclass(frozen=True)
class GemmPlan:
    """``a @ b`` as cuBLAS runs it. ``shape``: the result's; ``batch_shape``: the broadcast batch axes; ``kind``:
    ``"empty"`` (no element: nothing to compute), ``"zeros"`` (``k == 0``: a result of zeros), ``"gemm"`` (one
    plain call over ``batch * m`` rows) or ``"strided"`` (one strided-batched call of ``batch`` products); ``m, n,
    k``: one product's ``(m, k) @ (k, n)``; ``a``, ``b``: :class:`Operand` (None for ``"empty"`` and ``"zeros"``)."""
    shape: tuple
    batch_shape: tuple
    kind: str
    m: int
    n: int
    k: int
    batch: int
    a: Operand | None
    b: Operand | None

    def call(self) -> GemmCall:
        """The cuBLAS arguments of a ``"gemm"`` or ``"strided"`` plan (see :class:`GemmCall`).

        >>> plan_matmul((2, 3), (3, 1), (3, 4), (1, 3)).call()
        GemmCall(transa=1, transb=0, m=4, n=2, k=3, lda=3, stride_a=0, ldb=3, stride_b=0, ldc=4, stride_c=8, batch=1)
        """
        rows = self.m * self.batch if self.kind == "gemm" else self.m
        return GemmCall(transa=_OP_T if self.b.transposed else _OP_N, transb=_OP_T if self.a.transposed else _OP_N,
                        m=self.n, n=rows, k=self.k, lda=self.b.ld, stride_a=self.b.stride, ldb=self.a.ld,
                        stride_b=self.a.stride, ldc=self.n, stride_c=self.m * self.n,
                        batch=1 if self.kind == "gemm" else self.batch)


def matmul_shape(a_shape: tuple, b_shape: tuple) -> tuple | None:
    """The shape of ``a @ b`` by NumPy's rules (1-d operands included), or None where the shapes do not fit.

    >>> matmul_shape((2, 1, 3, 4), (5, 4, 6)), matmul_shape((4,), (3, 4, 2)), matmul_shape((3,), (4,))
    ((2, 5, 3, 6), (3, 2), None)
    """
    if not a_shape or not b_shape:
        return None
    a2 = a_shape if len(a_shape) > 1 else (1,) + tuple(a_shape)
    b2 = b_shape if len(b_shape) > 1 else tuple(b_shape) + (1,)
    batch = _broadcast(a2[:-2], b2[:-2])
    if a2[-1] != b2[-2] or batch is None:
        return None
    return batch + a2[-2:-1] * (len(a_shape) > 1) + b2[-1:] * (len(b_shape) > 1)


def _broadcast(s, t):
    """NumPy's broadcast of two shapes, or None."""
    n = max(len(s), len(t))
    s, t = (1,) * (n - len(s)) + tuple(s), (1,) * (n - len(t)) + tuple(t)
    out = []
    for x, y in zip(s, t):
        if x != y and 1 not in (x, y):
            return None
        out.append(y if x == 1 else x)
    return tuple(out)


def matrix_layout(rows: int, cols: int, row_stride: int, col_stride: int) -> tuple[bool, int] | None:
    """``(transposed, ld)`` of a ``(rows, cols)`` matrix with these strides (in elements) as cuBLAS reads it:
    row-major ``(False, row stride)``, column-major ``(True, column stride)``, or None where it is neither (or the
    leading dimension would be below cuBLAS's minimum or above :data:`INT_MAX`). A stride along an axis of length 1
    is never read: such an axis fits either order.

    >>> matrix_layout(3, 4, 4, 1), matrix_layout(3, 4, 1, 3), matrix_layout(3, 4, 8, 2), matrix_layout(1, 4, 0, 1)
    ((False, 4), (True, 3), None, (False, 4))
    """
    if col_stride == 1 or cols == 1:
        ld = row_stride if rows > 1 else max(cols, 1)
        if max(cols, 1) <= ld <= INT_MAX:
            return False, ld
    if row_stride == 1 or rows == 1:
        ld = col_stride if cols > 1 else max(rows, 1)
        if max(rows, 1) <= ld <= INT_MAX:
            return True, ld
    return None


def batch_stride(batch: tuple, shape: tuple, strides: tuple) -> int | None:
    """The one stride (in elements) that steps through an operand's matrices in the order of the flattened
    ``batch`` axes, where the operand's own batch axes ``shape`` (broadcasting to ``batch``) with ``strides`` allow
    one, else None. An axis the operand broadcasts along has stride 0, so a fully broadcast operand has stride 0.

    >>> batch_stride((4, 3), (4, 3), (6, 2)), batch_stride((4, 3), (1,), (5,)), batch_stride((4, 3), (4, 1), (7, 7))
    (2, 0, None)
    """
    pad = len(batch) - len(shape)
    own = [(1, 0)] * pad + [(n, s) for n, s in zip(shape, strides)]
    axes = [(s if n > 1 else 0, math.prod(batch[i + 1:])) for i, (n, s) in enumerate(own) if batch[i] > 1]
    if not axes:
        return 0
    step = axes[-1][0]
    if step < 0 or any(s != step * w for s, w in axes):
        return None
    return step


def _contiguous_strides(shape):
    strides, size = [], 1
    for n in reversed(shape):
        strides.append(size)
        size *= max(n, 1)
    return tuple(reversed(strides))


def _operand(batch, shape, strides):
    """The :class:`Operand` of a ``(*own_batch, rows, cols)`` operand: as it lies where cuBLAS can read it so,
    else copied (see :class:`Operand`)."""
    rows, cols = shape[-2:]
    layout = matrix_layout(rows, cols, strides[-2], strides[-1])
    step = batch_stride(batch, shape[:-2], strides[:-2])
    if layout is not None and step is not None:
        return Operand(None, layout[0], layout[1], step)
    transposed = layout is not None and layout[0]   # a copy keeps the orientation of the matrices it copies
    order = shape[:-2] + ((cols, rows) if transposed else (rows, cols))
    step = batch_stride(batch, shape[:-2], _contiguous_strides(order)[:-2])
    ld = max(rows if transposed else cols, 1)
    if step is not None:
        return Operand("contiguous", transposed, ld, step)
    return Operand("broadcast", transposed, ld, rows * cols)


@functools.lru_cache(maxsize=4096)
def plan_matmul(a_shape: tuple, a_strides: tuple, b_shape: tuple, b_strides: tuple) -> GemmPlan | None:
    """The :class:`GemmPlan` of ``a @ b`` for operands of 2 or more axes with these shapes and strides (in
    elements, as tuples of ints), or None where the shapes do not fit or a size exceeds :data:`INT_MAX`.

    >>> p = plan_matmul((3, 2, 4), (8, 4, 1), (4, 5), (1, 4))   # x @ w.T: one gemm over 6 rows
    >>> p.kind, p.shape, p.a, p.b
    ('gemm', (3, 2, 5), Operand(copy=None, transposed=False, ld=4, stride=8), Operand(copy=None, transposed=True, \
ld=4, stride=0))
    """
    if len(a_shape) < 2 or len(b_shape) < 2:
        return None
    shape = matmul_shape(a_shape, b_shape)
    if shape is None:
        return None
    batch_shape, (m, k), n = shape[:-2], a_shape[-2:], b_shape[-1]
    batch = math.prod(batch_shape)
    if batch * m * n == 0 or k == 0:
        return GemmPlan(shape, batch_shape, "empty" if batch * m * n == 0 else "zeros", m, n, k, batch, None, None)
    if max(m, n, k) > INT_MAX:
        return None
    a, b = _operand(batch_shape, a_shape, a_strides), _operand(batch_shape, b_shape, b_strides)
    if m == 1 and batch > 1 and not a.transposed and a.ld < a.stride <= INT_MAX:
        a = replace(a, ld=a.stride)   # single rows one stride apart: one matrix with that row stride
    rows_follow = not a.transposed and a.stride == m * a.ld and batch * m <= INT_MAX
    if batch == 1 or (b.stride == 0 and rows_follow):
        return GemmPlan(shape, batch_shape, "gemm", m, n, k, batch, a, b)
    if batch > INT_MAX:
        return None
    return GemmPlan(shape, batch_shape, "strided", m, n, k, batch, a, b)
