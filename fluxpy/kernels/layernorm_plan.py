"""Which layer-norm kernel runs, in what shape: plain Python, no CuPy (the kernels are ``cuda_layernorm``).

A row of ``L`` values is spread over ``tpr`` threads, each holding ``items`` vectors of ``vw`` values in registers;
a block holds ``rpb`` rows. The forward (:func:`forward_plan`) takes the fewest threads a row, doubling from a warp,
that keep a thread's vectors few, then, for the halves' long rows, the shape that lets an SM hold the most rows.
The backward (:func:`backward_plan`) takes the first kernel that fits, in this order:

- ``ln_bwd1``: one sweep a row, the row and the thread's column sums (for dgamma, dbeta) in registers;
- ``ln_bwds``: one sweep, the column sums in shared memory, one row a block (``ln_bwdr``: the same, reading gamma
  twice a row where a copy of it does not fit beside the row);
- ``ln_bwdc``: ``ln_bwds`` by a cluster of 2, 4 or 8 blocks a row, the row sums exchanged in distributed shared
  memory;
- ``ln_bwd``: two sweeps a row (the second rereads x and dy), the thread holding only its column sums;
- the split backward: dx alone (``ln_dx1`` one sweep, ``ln_dx2`` two), then ``ln_cols`` sums the columns apart.

Register counts are estimates fitted to ptxas for sm_90 and kept under its cap, so no variant spills; the kernel
module compiles the plan and, where ptxas decides (:func:`forward_forms`, :func:`two_block_forms`), tries the next
form. A device enters only through :class:`Limits` (its shared memory a block, whether it has clusters).

>>> p = backward_plan(768, np.float16)
>>> p.kernel, p.tpr, p.items
('ln_bwd1', 64, 3)
>>> forward_plan(20480, np.float16)
ForwardPlan(vw=4, tpr=512, rpb=1, items=10, blocks=2, prefetch=False, stages=0)
"""
from __future__ import annotations

import contextlib
import functools

from dataclasses import dataclass, replace

import numpy as np

from .halfs import compute_dtype

__all__ = ["Limits", "SM90", "RowShape", "ForwardPlan", "BackwardPlan", "ColumnPlan", "vector", "column_vector",
           "row_shape", "forward_plan", "forward_forms", "backward_plan", "two_block_forms", "column_plan",
           "fused_fits", "backward_fits", "backward_shared_bytes", "shared_columns_bytes", "staged_bytes",
           "blocks_an_sm", "register_cap", "tuning"]

# ---- tuning (each measured on sm_90; the measurements are in BENCHMARKS.md and the history archive) ----
MAX_VECTORS = 8        # vectors of a row a thread holds forward, at most: 128 bytes in flight a thread
MAX_THREADS = 1024     # threads a row, at most: longer rows are turned down (the composite runs)
MAX_VALUES = 32        # values a thread of the two-sweep backward sums per column (16 for float64): its registers
SHORT_ROW_VECTORS = 5  # short rows forward: few vectors a thread, so a row takes no idle threads
SHORT_ROW_THREADS = 256    # rows under this many threads a row count as short
FORWARD_BLOCK_THREADS = 128    # short rows forward: threads' worth of rows a block (small blocks fill the SMs)
SHORT_ROW_PREFETCH = {2: True, 4: True, 8: False}   # by item size: short rows forward load the next row early...
SHORT_ROW_PREFETCH_BYTES = 4096                     # ...where a row is smaller than this (longer ones lost)
MAX_FORWARD_ITEMS = 12     # the halves' long rows forward: vectors a thread, at most, in the most-rows-an-SM shape
FORWARD_MIN_ROWS = 3       # an SM holding fewer rows than this leaves its loads idle at a row's barriers
FORWARD_SPARE = {2: 24, 4: None, 8: None}   # registers a forward thread needs beside its row (None: keep the rule)
FORWARD_PREFETCH_WORDS = 36    # the halves' whole-block rows prefetch into registers where row + next row fit this
ONE_SWEEP_VALUES = {2: 16, 4: 16, 8: 8}     # row values a thread of ln_bwd1 holds, by item size
ONE_SWEEP_REGISTERS = {2: (5, 4), 4: (6, 4), 8: (13, 10)}   # ln_bwd1's registers a value (prefetching, not): fitted
ONE_SWEEP_SPARE = 48   # ln_bwd1's registers besides its values (indices, pointers, sums): fitted
SHORT_ONE_SWEEP_THREADS = 64   # ln_bwd1 of rows of at most this many threads...
ONE_SWEEP_BLOCK_THREADS = 256  # ...takes this many threads' worth of rows a block (small blocks fill the SMs)
ONE_SWEEP_WARP_VALUES = 8      # ln_bwd1 gives a row two warps where one would hold more values a thread than this
DX_SWEEP_VALUES = {2: 32, 4: 32, 8: 0}      # row values a thread of ln_dx1 holds (float64 spilled: ln_dx2)
DX_SWEEP_REGISTERS = {2: (3.25, 1.5), 4: (4.5, 2), 8: (9, 5)}   # ln_dx1's registers a value (prefetching, not)
DX_SWEEP_MARGIN = 8    # ln_dx1 takes several rows a block only this far under ptxas's cap (it spilled nearer)
DX_SWEEP_SPARE = 32    # ln_dx1's registers besides its values: fitted
SPLIT_FROM = {2: 12288, 4: 0, 8: None}   # rows this long take the split backward before ln_bwd (None: only last)
SHARED_COLUMNS = {2: True, 4: True, 8: False}   # ln_bwds (column sums in shared memory) by item size
SHARED_SPARE = 12      # ln_bwds' registers beyond ln_dx1's estimate (the shared sums' addresses)
FUSED_SHARED_SPARE = 8     # and its fused form's beyond that
HELD_REGISTERS = {2: 0.5, 4: 1, 8: 2}    # ln_bwds/ln_bwdc: registers a value for the held copy of gamma (and bias)
STAGED_FORWARD = {2: True, 4: True, 8: False}   # whole-block rows forward stage the next row in shared memory
BACKWARD_TWO_BLOCKS = {2: True, 4: False, 8: False}   # ln_bwd1 of one row an SM tries forms of two an SM
CLUSTER_COLUMNS = {2: True, 4: True, 8: False}   # rows too long for one block's shared memory take ln_bwdc
CLUSTER_BLOCKS = {2: (2, 3, 4, 1), 4: (1,), 8: (1,)}   # ln_bwdc's blocks an SM, preferred first on a tie
SM90_SHARED_BYTES = 232448   # shared memory a block may opt into on sm_90 (the limit where no GPU is asked)
COLUMN_WARPS = 8       # ln_cols: warps a block, each summing its own rows of the block's chunk
COLUMN_BLOCKS = 4096   # ln_cols: blocks aimed at (several waves); a constant, so sums' order is the shape's alone
COLUMN_MIN_ROWS = 64   # ln_cols: rows a chunk at least, so the partial rows stay few against the data

# (vector type, values), preferred first; a row takes the first its length divides. The halves load 8 bytes: split
# into 16-bit values, 16-byte loads cost the forward bandwidth. ln_cols has no register pressure: 16 bytes.
_VECTORS = {"half": (("uint2", 4), ("unsigned int", 2)), np.dtype(np.float32): (("float4", 4), ("float2", 2)),
            np.dtype(np.float64): (("double2", 2),)}
_COLUMN_VECTORS = {"half": (("uint4", 8), ("uint2", 4), ("unsigned int", 2)),
                   np.dtype(np.float32): (("float4", 4), ("float2", 2)), np.dtype(np.float64): (("double2", 2),)}


@dataclass(frozen=True)
class Limits:
    """What a plan asks of the GPU: the shared memory a block may opt into, and whether it launches clusters.

    >>> backward_plan(32768, np.float16, limits=Limits(clusters=False)).kernel
    'ln_dx2'
    """
    shared_per_block: int = SM90_SHARED_BYTES
    clusters: bool = True


SM90 = Limits()


@dataclass(frozen=True)
class RowShape:
    """A row spread over threads: ``vw`` values a vector, ``tpr`` threads a row, ``rpb`` rows a block, ``items``
    vectors a thread.

    >>> row_shape(1000, np.float32)
    RowShape(vw=4, tpr=64, rpb=2, items=4)
    """
    vw: int
    tpr: int
    rpb: int
    items: int


@dataclass(frozen=True)
class ForwardPlan:
    """``ln_fwd``'s shape (as :class:`RowShape`), ``blocks`` an SM ptxas is held to (``__launch_bounds__``),
    ``prefetch``: the grid visits rows grid-stride, loading the next row into registers early; ``stages``: rows
    staged ahead in shared memory (``cp.async``) instead.

    >>> ForwardPlan(vw=4, tpr=64, rpb=2, items=3).threads
    128
    """
    vw: int
    tpr: int
    rpb: int
    items: int
    blocks: int = 1
    prefetch: bool = False
    stages: int = 0

    @property
    def threads(self) -> int:
        return self.tpr * self.rpb


@dataclass(frozen=True)
class BackwardPlan:
    """The backward's ``kernel`` (``ln_bwd1``, ``ln_bwds``, ``ln_bwdr``, ``ln_bwdc``, ``ln_bwd``, ``ln_dx1``,
    ``ln_dx2``) in its shape (``ln_bwdc``: a block's share of the row), ``prefetch``: the next row's loads issued
    before this row's sums; ``cluster``: blocks a row (``ln_bwdc``), ``blocks``: blocks an SM ptxas is held to.

    >>> BackwardPlan("ln_dx1", vw=4, tpr=320, rpb=2, items=8).splits
    True
    """
    kernel: str
    vw: int
    tpr: int
    rpb: int
    items: int
    prefetch: bool = False
    cluster: int = 1
    blocks: int = 1

    @property
    def threads(self) -> int:
        return self.tpr * self.rpb

    @property
    def splits(self) -> bool:
        """Whether this is the split backward (dx alone, the column sums by ``ln_cols``)."""
        return self.kernel.startswith("ln_dx")


@dataclass(frozen=True)
class ColumnPlan:
    """``ln_cols``: ``kvw`` values a vector, ``tiles`` of 32 vectors of columns, ``chunk`` rows a block, ``chunks``
    (the partial rows ``ln_params`` adds).

    >>> column_plan(768, np.float16, 64)
    ColumnPlan(kvw=8, tiles=3, chunk=64, chunks=1)
    """
    kvw: int
    tiles: int
    chunk: int
    chunks: int


def _cdiv(a, b):
    return -(-a // b)


def vector(dtype, length, table=_VECTORS) -> tuple[str, int]:
    """``(vector type, values)`` for rows of ``length`` values of ``dtype``, or ``("T", 1)``.

    >>> vector(np.float32, 768), vector(np.float16, 770), vector(np.float16, 7)
    (('float4', 4), ('unsigned int', 2), ('T', 1))
    """
    dtype = np.dtype(dtype)
    for vt, vw in table["half" if dtype.itemsize == 2 else dtype]:
        if length % vw == 0:
            return vt, vw
    return "T", 1


def column_vector(dtype, length) -> tuple[str, int]:
    """``ln_cols``' ``(vector type, values)``: 16 bytes where the length allows.

    >>> column_vector(np.float16, 768), column_vector(np.float16, 20484)
    (('uint4', 8), ('uint2', 4))
    """
    return vector(dtype, length, _COLUMN_VECTORS)


def blocks_an_sm(threads, regs, shared=0) -> int:
    """Blocks of ``threads`` threads, ``regs`` registers a thread and ``shared`` bytes of shared memory that an SM
    holds at once (sm_90: 64K registers allocated 256 a warp, 2,048 threads, 32 blocks, 228 KB of shared memory less
    1 KB a block), at least 1.

    >>> blocks_an_sm(384, 56), blocks_an_sm(512, 56), blocks_an_sm(1024, 64, 64 * 1024)
    (3, 2, 1)
    """
    per_warp = -(-max(int(regs), 1) * 32 // 256) * 256
    return max(1, min(65536 // (per_warp * -(-threads // 32)), 2048 // threads, 32, (228 * 1024) // (shared + 1024)))


def register_cap(threads) -> int:
    """The registers a thread may use in a block of ``threads`` (ptxas's cap under ``__launch_bounds__``: 64K an
    SM, warps allocated four at a time, a multiple of 8, at most 255).

    >>> register_cap(1024), register_cap(256), register_cap(32)
    (64, 255, 255)
    """
    return min(255, 65536 // (128 * -(-threads // 128)) // 8 * 8)


def _doubling_shape(length, dtype, forward) -> RowShape | None:
    """Threads a row doubled from a warp until a thread holds few enough vectors (forward: up to
    :data:`SHORT_ROW_VECTORS` below :data:`SHORT_ROW_THREADS`, :data:`MAX_VECTORS` past; the two-sweep backward:
    :data:`MAX_VALUES` values), or None past :data:`MAX_THREADS`."""
    dtype = np.dtype(dtype)
    vw = vector(dtype, length)[1]
    vectors = length // vw

    def max_items(tpr):
        if forward:
            return SHORT_ROW_VECTORS if tpr < SHORT_ROW_THREADS else MAX_VECTORS
        return max(1, (16 if dtype == np.float64 else MAX_VALUES) // vw)
    tpr = 32
    while -(-vectors // tpr) > max_items(tpr):
        tpr *= 2
        if tpr > MAX_THREADS:
            return None
    block = FORWARD_BLOCK_THREADS if forward else 256
    return RowShape(vw, tpr, max(1, block // tpr), -(-vectors // tpr))


@functools.lru_cache(maxsize=4096)   # asked on every layer-norm call; a pure function of constants
def row_shape(length: int, dtype, direction: str = "forward") -> RowShape | None:
    """The doubling rule's shape of rows of ``length`` values of ``dtype``: ``forward`` (128 threads a block), or
    ``backward``, the two-sweep ``ln_bwd``'s (256 a block); None where the forward turns the rows down.

    >>> row_shape(768, np.float32), row_shape(20480, np.float32, "backward")
    (RowShape(vw=4, tpr=64, rpb=2, items=3), RowShape(vw=4, tpr=1024, rpb=1, items=5))
    """
    return _doubling_shape(int(length), dtype, direction == "forward")


def _forward_shape(length, dtype, fused) -> tuple[RowShape, int] | None:
    """``(shape, blocks an SM)`` of ``ln_fwd``: the doubling rule's, except the plain forward of the halves' long
    rows (8-byte vectors, :data:`SHORT_ROW_THREADS` or more), where an SM would hold fewer than
    :data:`FORWARD_MIN_ROWS`: the shape of at most :data:`MAX_FORWARD_ITEMS` vectors a thread that holds the most,
    ties to fewer vectors a thread."""
    dtype = np.dtype(dtype)
    shape = _doubling_shape(length, dtype, True)
    spare = FORWARD_SPARE[dtype.itemsize]
    if (shape is None or shape.tpr < SHORT_ROW_THREADS or spare is None or shape.vw * dtype.itemsize != 8
            or fused):
        return None if shape is None else (shape, 1)
    vw, vectors = shape.vw, length // shape.vw
    held, best = blocks_an_sm(shape.tpr, shape.items * vw + spare), (shape, 1)
    if held >= FORWARD_MIN_ROWS:
        return best
    for most in range(-(-vectors // MAX_THREADS), MAX_FORWARD_ITEMS + 1):   # vectors a thread, at most
        tpr = max(FORWARD_BLOCK_THREADS, 32 * _cdiv(_cdiv(vectors, most), 32))
        items = -(-vectors // tpr)
        blocks = blocks_an_sm(tpr, items * vw + spare)
        if blocks > held:
            held, best = blocks, (RowShape(vw, tpr, 1, items), blocks)
    return best


def _forward_prefetches(length, dtype, shape: RowShape, fused) -> bool:
    """Short rows under :data:`SHORT_ROW_PREFETCH_BYTES` where :data:`SHORT_ROW_PREFETCH` says so; the halves' rows
    of a whole block where the next row's raw vectors (and the residual's, fused) fit beside the row
    (:data:`FORWARD_PREFETCH_WORDS`); no others."""
    size = np.dtype(dtype).itemsize
    if shape.tpr < SHORT_ROW_THREADS:
        return SHORT_ROW_PREFETCH[size] and length * size < SHORT_ROW_PREFETCH_BYTES
    if shape.tpr < MAX_THREADS or size != 2:
        return False
    values = shape.items * shape.vw
    return values + values // 2 * (2 if fused else 1) <= FORWARD_PREFETCH_WORDS


def forward_plan(length: int, dtype, fused: bool = False, limits: Limits = SM90) -> ForwardPlan | None:
    """``ln_fwd``'s plan for rows of ``length`` values of ``dtype`` (``fused``: of ``x + residual + bias``), or
    None where the rows are turned down. Rows of a whole block of :data:`MAX_THREADS` visit the rows grid-stride:
    the halves prefetch the next row into registers where it fits (:data:`FORWARD_PREFETCH_WORDS`), else stage it in
    shared memory (:data:`STAGED_FORWARD`) where a row fits there.

    >>> [forward_plan(n, np.float16).tpr for n in (768, 4096, 12288, 32768)]
    [64, 256, 384, 1024]
    >>> [(p.prefetch, p.stages) for p in (forward_plan(24576, np.float16), forward_plan(32768, np.float16))]
    [(True, 0), (False, 1)]
    """
    dtype, length = np.dtype(dtype), int(length)
    found = _forward_shape(length, dtype, fused)
    if found is None:
        return None
    shape, blocks = found
    prefetch = _forward_prefetches(length, dtype, shape, fused)
    stages = 0
    if (shape.tpr >= MAX_THREADS and STAGED_FORWARD[dtype.itemsize] and not prefetch
            and shape.vw * dtype.itemsize in (4, 8, 16)):
        stages = int(staged_bytes(length, dtype, fused) <= limits.shared_per_block - 1024)
    return ForwardPlan(shape.vw, shape.tpr, shape.rpb, shape.items, blocks, bool(prefetch), stages)


def forward_forms(plan: ForwardPlan, length: int, dtype, fused: bool = False, limits: Limits = SM90) -> list:
    """The forms of ``plan`` the kernel module compiles in turn until ptxas spills none: held to ``blocks`` an SM,
    then a block fewer at a time; staging, then two rows ahead where they fit, then none.

    >>> [(f.stages, f.blocks) for f in forward_forms(forward_plan(20480, np.float16), 20480, np.float16)]
    [(0, 2), (0, 1)]
    >>> [(f.stages, f.blocks) for f in forward_forms(forward_plan(32768, np.float16), 32768, np.float16)]
    [(1, 1), (2, 1), (0, 1)]
    """
    forms = [replace(plan, blocks=b) for b in range(plan.blocks, 0, -1)]
    if plan.stages:
        two = 2 * staged_bytes(length, dtype, fused) <= limits.shared_per_block - 1024
        forms += [replace(plan, stages=2, blocks=1)] * two + [replace(plan, stages=0, blocks=1)]
    return forms


def staged_bytes(length, dtype, fused) -> int:
    """Shared memory of a row the forward stages: a row of x (and of the residual, fused).

    >>> staged_bytes(32768, np.float16, True)
    131072
    """
    return int(length) * np.dtype(dtype).itemsize * (2 if fused else 1)


def _shape(length, dtype, max_items, min_tpr=32):
    """``(vw, tpr, items)``: the fewest threads a row (a multiple of 32, from ``min_tpr``) that hold its vectors in
    at most ``max_items`` vectors a thread, or None past :data:`MAX_THREADS`."""
    vw = vector(dtype, length)[1]
    vectors = length // vw
    tpr = max(min_tpr, 32 * _cdiv(_cdiv(vectors, max_items), 32))
    if tpr > MAX_THREADS:
        return None
    return vw, tpr, -(-vectors // tpr)


def _one_sweep_registers(dtype, vw, items, prefetch, params=True):
    """Registers a thread of ``ln_bwd1`` (``ln_dx1`` without ``params``) needs: :data:`ONE_SWEEP_REGISTERS`
    (:data:`DX_SWEEP_REGISTERS`) a row value it holds, plus :data:`ONE_SWEEP_SPARE` (:data:`DX_SWEEP_SPARE`)."""
    per, spare = (ONE_SWEEP_REGISTERS, ONE_SWEEP_SPARE) if params else (DX_SWEEP_REGISTERS, DX_SWEEP_SPARE)
    return int(np.ceil(per[np.dtype(dtype).itemsize][0 if prefetch else 1] * items * vw)) + spare


def _one_sweep_plan(length, dtype, params, extra=0, held=0) -> BackwardPlan | None:
    """The one sweep (``ln_bwd1``, or ``ln_dx1`` without ``params``) where the row (and with ``params`` the column
    sums) fit the registers of the threads that hold it: at most :data:`ONE_SWEEP_VALUES` (:data:`DX_SWEEP_VALUES`)
    values a thread, then more threads with fewer values each until the estimate fits ptxas's cap, prefetching where
    that fits too; as many rows a block as the registers take. ``extra`` registers a thread and ``held`` a value
    on top (``ln_bwds``' shared sums and held gamma)."""
    c = 2 if dtype == np.float64 else 1
    values = (ONE_SWEEP_VALUES if params else DX_SWEEP_VALUES)[dtype.itemsize]
    if values == 0:
        return None
    vectors = values // vector(dtype, length)[1]
    if not params:   # at most 8 vectors: ptxas spilled at 16 vectors of 2 halves
        vectors = min(vectors, MAX_VECTORS)
    shape = _shape(length, dtype, max(1, vectors))
    if params and shape is not None and shape[1] == 32 and shape[0] * shape[2] > ONE_SWEEP_WARP_VALUES:
        shape = _shape(length, dtype, max(1, vectors), 64)
    while shape is not None:
        vw, tpr, items = shape
        for pf in (1, 0):
            regs = _one_sweep_registers(dtype, vw, items, pf, params) + extra + int(np.ceil(held * items * vw))
            if regs > register_cap(tpr):
                continue
            rpb = max(1, MAX_THREADS // tpr)
            if params and tpr <= SHORT_ONE_SWEEP_THREADS:
                rpb = min(rpb, ONE_SWEEP_BLOCK_THREADS // tpr)
            margin = 0 if params else DX_SWEEP_MARGIN
            while rpb > 1 and (regs + margin > register_cap(tpr * rpb) or (params and 8 * length * c > 40960)):
                rpb -= 1            # the block's registers; its column sums in (static) shared memory
            return BackwardPlan("ln_bwd1" if params else "ln_dx1", vw, tpr, rpb, items, bool(pf))
        shape = _shape(length, dtype, items - 1, tpr + 32) if items > 1 else None   # more threads, fewer values
    return None


def shared_columns_bytes(length, dtype) -> int:
    """Dynamic shared memory of ``ln_bwds``' column sums: ``2 L`` values of the compute type.

    >>> shared_columns_bytes(16384, np.float16)
    131072
    """
    return 2 * int(length) * compute_dtype(dtype).itemsize


def _shared_sweep_spares(dtype, fused):
    """``(extra registers, registers a value)`` of ``ln_bwds``/``ln_bwdc`` beyond ``ln_dx1``'s estimate."""
    return (SHARED_SPARE + (FUSED_SHARED_SPARE if fused else 0),
            HELD_REGISTERS[dtype.itemsize] * (2 if fused else 1))


def _shared_sweep_plan(length, dtype, limit, fused, hold=True) -> BackwardPlan | None:
    """``ln_bwds`` (``ln_bwdr`` without ``hold``) where :data:`SHARED_COLUMNS` allows it, the column sums fit in
    ``limit`` bytes less 1 KB and ``ln_dx1``'s shape takes the row with the shared sums' registers (and, held, the
    copies of gamma and the bias) beside it; one row a block."""
    if not SHARED_COLUMNS[dtype.itemsize] or shared_columns_bytes(length, dtype) > limit - 1024:
        return None
    extra, held = _shared_sweep_spares(dtype, fused)
    dx = _one_sweep_plan(length, dtype, False, extra, held if hold else 0)
    return None if dx is None else replace(dx, kernel="ln_bwds" if hold else "ln_bwdr", rpb=1)


def _shared_sweep_registers(dtype, vw, items, fused):
    """Registers a thread of ``ln_bwdc`` of ``items`` vectors of ``vw`` values needs, as ``ln_bwds`` estimates.

    >>> _shared_sweep_registers(np.dtype(np.float16), 4, 8, False)
    108
    """
    extra, held = _shared_sweep_spares(dtype, fused)
    return _one_sweep_registers(dtype, vw, items, False, False) + extra + int(np.ceil(held * items * vw))


def _cluster_plan(length, dtype, limits, fused) -> BackwardPlan | None:
    """``ln_bwdc`` where :data:`CLUSTER_COLUMNS` allows it and the GPU has clusters: over 2, 4 or 8 blocks a row
    whose share is whole vectors and takes ``ln_bwds``, and each number of blocks an SM in :data:`CLUSTER_BLOCKS`
    that fits (shared memory, threads, the register estimate under ptxas's cap for that many), the most threads an
    SM, ties to the earlier in :data:`CLUSTER_BLOCKS`, then to fewer blocks a cluster.

    >>> [(p.cluster, p.blocks) for p in (_cluster_plan(32768, np.dtype(np.float16), SM90, False),
    ...                                  _cluster_plan(20480, np.dtype(np.float16), SM90, False),
    ...                                  _cluster_plan(26624, np.dtype(np.float16), SM90, True),
    ...                                  _cluster_plan(32768, np.dtype(np.float32), SM90, False))]
    [(4, 2), (4, 3), (8, 4), (4, 1)]
    """
    if not CLUSTER_COLUMNS[dtype.itemsize] or not limits.clusters:
        return None
    limit = limits.shared_per_block
    vw, order, best, best_key = vector(dtype, length)[1], CLUSTER_BLOCKS[dtype.itemsize], None, None
    for cs in (2, 4, 8):
        share = length // cs
        nbytes = _cluster_shared_bytes(length, dtype, cs, fused)
        if length % (cs * vw) or vector(dtype, share)[1] != vw or nbytes > limit - 1024:
            continue
        sub = _shared_sweep_plan(share, dtype, limit, fused)
        if sub is None:
            continue
        regs = _shared_sweep_registers(dtype, sub.vw, sub.items, fused)
        for rank, want in enumerate(order):
            # ptxas's cap under __launch_bounds__(threads, want): the estimate must fit the cap it is compiled to
            if want > 1 and (want * (nbytes + 1024) > limit + 1024 or want * sub.tpr > 2048
                             or regs > register_cap(want * sub.tpr)):
                continue
            key = (want * sub.tpr, -rank, -cs)
            if best_key is None or key > best_key:
                best_key = key
                best = BackwardPlan("ln_bwdc", sub.vw, sub.tpr, 1, sub.items, False, cs, want)
    return best


def _cluster_shared_bytes(length, dtype, cs, fused):
    """``ln_bwdc``'s dynamic shared memory: its share's column sums and that share of the next row, staged."""
    share = length // cs
    return shared_columns_bytes(share, dtype) + share * np.dtype(dtype).itemsize * (3 if fused else 2)


def backward_shared_bytes(plan: BackwardPlan, length, dtype, fused=False) -> int:
    """Dynamic shared memory a block of ``plan``'s kernel takes (none but ``ln_bwds``, ``ln_bwdr``, ``ln_bwdc``)."""
    if plan.kernel in ("ln_bwds", "ln_bwdr"):
        return shared_columns_bytes(length, dtype)
    if plan.kernel == "ln_bwdc":
        return _cluster_shared_bytes(length, dtype, plan.cluster, fused)
    return 0


def _two_sweep_fits(length, dtype):
    """Whether ``ln_bwd``'s column sums (two arrays of a thread's row values) fit its registers at its block size."""
    shape = row_shape(length, dtype, "backward")
    if shape is None:
        return False
    words = 2 if np.dtype(dtype) == np.float64 else 1
    return 2 * shape.items * shape.vw * words + 40 <= min(255, 65536 // (shape.tpr * shape.rpb))


def backward_plan(length: int, dtype, fused: bool = False, limits: Limits = SM90) -> BackwardPlan | None:
    """The backward for rows of ``length`` values of ``dtype`` (``fused``: of ``x + residual + bias``): the first
    that fits of ``ln_bwd1``, ``ln_bwds``, ``ln_bwdc``, ``ln_bwdr``, ``ln_bwd`` (rows shorter than
    :data:`SPLIT_FROM`), ``ln_dx1``/``ln_dx2``; None where none takes the rows (float64's longest).

    >>> [backward_plan(n, np.float16).kernel for n in (768, 12288, 16388, 32768)]
    ['ln_bwd1', 'ln_bwds', 'ln_bwdr', 'ln_bwdc']
    >>> backward_plan(20480, np.float32)
    BackwardPlan(kernel='ln_bwdc', vw=4, tpr=320, rpb=1, items=8, prefetch=False, cluster=2, blocks=1)
    >>> backward_plan(20484, np.float32).kernel, backward_plan(20480, np.float64)
    ('ln_dx2', None)
    """
    dtype, length = np.dtype(dtype), int(length)
    limit = limits.shared_per_block
    plan = _one_sweep_plan(length, dtype, True) or _shared_sweep_plan(length, dtype, limit, fused)
    forward = _doubling_shape(length, dtype, True) is not None
    if plan is None and forward:   # ln_bwdc before the split backward, which moves 5 N L s bytes to its 3
        plan = _cluster_plan(length, dtype, limits, fused)
    if plan is None and forward:   # ln_bwdr (gamma read twice a row) where no cluster takes the row
        plan = _shared_sweep_plan(length, dtype, limit, fused, hold=False)
    if plan is None:
        two, wide = row_shape(length, dtype, "backward"), _doubling_shape(length, dtype, True)
        split_from = SPLIT_FROM[dtype.itemsize]
        if two is not None and _two_sweep_fits(length, dtype) and (split_from is None or length < split_from):
            plan = BackwardPlan("ln_bwd", two.vw, two.tpr, two.rpb, two.items)
        elif wide is not None:
            plan = (_one_sweep_plan(length, dtype, False)
                    or BackwardPlan("ln_dx2", wide.vw, wide.tpr, wide.rpb, wide.items))
    return plan


def two_block_forms(plan: BackwardPlan, length: int) -> list:
    """Forms of ``ln_bwd1`` held to two blocks an SM, tried in order where ``plan`` holds one row an SM: a row a
    block in fewer threads with more values each, one more vector a thread at a time up to :data:`MAX_VALUES`.

    >>> [(f.tpr, f.items) for f in two_block_forms(BackwardPlan("ln_bwd1", 4, 352, 1, 4, True), 5140)[:3]]
    [(288, 5), (224, 6), (192, 7)]
    """
    vectors, forms = -(-length // plan.vw), []
    for more in range(plan.items + 1, MAX_VALUES // plan.vw + 1):
        threads = 32 * -(-vectors // (32 * more))   # whole warps
        if all(form.tpr != threads for form in forms):
            forms.append(replace(plan, tpr=threads, rpb=1, items=more, blocks=2))
    return forms


def column_plan(length: int, dtype, rows: int) -> ColumnPlan:
    """``ln_cols``' plan for ``rows`` rows: chunks of a multiple of :data:`COLUMN_WARPS` rows, at least
    :data:`COLUMN_MIN_ROWS`, so that tiles x chunks is near :data:`COLUMN_BLOCKS`; the shape's alone, not the
    device's, so the order of the sums is too.

    >>> column_plan(20480, np.float32, 8192), column_plan(20480, np.float16, 8192).chunks
    (ColumnPlan(kvw=4, tiles=160, chunk=320, chunks=26), 52)
    """
    kvw = column_vector(dtype, length)[1]
    tiles = -(-(length // kvw) // 32)
    rc = max(COLUMN_MIN_ROWS, -(-rows * tiles // COLUMN_BLOCKS))
    rc = COLUMN_WARPS * -(-rc // COLUMN_WARPS)
    return ColumnPlan(kvw, tiles, rc, -(-rows // rc))


def fused_fits(length: int, dtype) -> bool:
    """Whether the fused ``x + residual + bias`` kernels take these rows: not float64 rows of more than 6 vectors a
    thread at 1,024 threads (its forward spilled there); the composite runs them.

    >>> fused_fits(12288, np.float64), fused_fits(12800, np.float64), fused_fits(32768, np.float16)
    (True, False, True)
    """
    shape = row_shape(length, dtype)
    return shape is not None and not (np.dtype(dtype) == np.float64 and shape.tpr == MAX_THREADS and shape.items > 6)


def backward_fits(length: int, dtype, limits: Limits = SM90) -> bool:
    """Whether a backward kernel takes these rows: every row the forward takes, but float64's longest.

    >>> backward_fits(20480, np.float32), backward_fits(16384, np.float64), backward_fits(20480, np.float64)
    (True, True, False)
    """
    return backward_plan(length, dtype, False, limits) is not None


_SWITCHES = {"split_from": "SPLIT_FROM", "shared_columns": "SHARED_COLUMNS", "cluster_columns": "CLUSTER_COLUMNS",
             "staged_forward": "STAGED_FORWARD", "backward_two_blocks": "BACKWARD_TWO_BLOCKS"}


@contextlib.contextmanager
def switched(dtype, **changes):
    """A block in which the planner's switches for ``dtype`` take other values (``split_from``,
    ``shared_columns``, ``cluster_columns``, ``staged_forward``, ``backward_two_blocks``), restored after: how a
    benchmark or test times the kernel another plan would pick. Plans are cached under :func:`tuning`, so the block's
    plans are its own.

    >>> with switched(np.float16, staged_forward=False):
    ...     STAGED_FORWARD[2]
    False
    >>> STAGED_FORWARD[2]
    True
    """
    unknown = sorted(set(changes) - set(_SWITCHES))
    if unknown:
        raise TypeError(f"switched: unknown switches {unknown}; expected some of {sorted(_SWITCHES)}")
    size = np.dtype(dtype).itemsize
    tables = {name: globals()[table] for name, table in _SWITCHES.items()}
    before = {name: tables[name][size] for name in changes}
    try:
        for name, value in changes.items():
            tables[name][size] = value
        yield
    finally:
        for name, value in before.items():
            tables[name][size] = value


def tuning(dtype) -> tuple:
    """The switches of :func:`backward_plan` and :func:`forward_plan` for ``dtype`` that tests and benchmarks turn
    (a cache key: a plan cached under other switches is not reused).

    >>> tuning(np.float16) == tuning(np.float16) != tuning(np.float32)
    True
    """
    size = np.dtype(dtype).itemsize
    return (SPLIT_FROM[size], SHARED_COLUMNS[size], CLUSTER_COLUMNS[size], STAGED_FORWARD[size],
            BACKWARD_TWO_BLOCKS[size], FORWARD_SPARE[size], FORWARD_MIN_ROWS)
