"""Layer norm on the GPU: one read and one write of ``x`` forward, one pass for ``dx`` backward, deterministic.

The rows of ``x`` (``(R, L)``: the normalised trailing axes flattened into ``L``, C-contiguous: a strided or offset
``x``, ``dy`` or residual is copied so first, :func:`_readable`) are normalised one row per group of ``TPR`` threads
(a warp for short rows, up to 1,024 threads for long ones), each thread holding its ``ITEMS`` 16-byte vectors of the
row in registers: the row is read from global memory once, the mean and then the variance are summed from the
registers (two exact passes, no ``E[x^2] - E[x]^2``), and ``y`` is written once, ``gamma`` and ``beta`` read as
vectors. ``TPR`` is the smallest power of two from 32 that keeps ``ITEMS`` at 5 vectors or fewer up to 256 threads a
row, at 8 or fewer past that, so a row of 768 float16 values takes 64 threads of 3 vectors; a block holds 128
threads' worth of rows, and the blocks of these short rows, under 4 KB, visit the rows grid-stride, loading the next
row before this row's sums (:data:`SHORT_ROW_PREFETCH`). Where an SM would hold fewer than 3 of the halves' longer
rows so, the plain forward takes the shape that lets it hold the most (:func:`_forward_shape`: 20,480 bfloat16
values take 512 threads of 10 vectors, 2 blocks an SM), for the barriers of a row's sums leave its block's loads
idle. Rows are summed by warp shuffles, then across warps in a fixed order. Where a row takes a whole block of 1,024
threads, the blocks visit the rows grid-stride and load the next row before this row's sums: into registers where
they fit beside the row (the halves, :func:`_forward_prefetches`), else into shared memory, each thread copying its
own vectors with ``cp.async`` (:func:`_forward_stages`). A forward that ptxas spilled is rebuilt in the next of its
forms (:func:`_forward_kernel`; :func:`kernel_attributes` reports the compiled kernels' local memory).

Backward (:func:`backward_shape` picks the kernel per (dtype, L)): ``ln_bwd1`` sweeps each row ONCE. A group of
``TPR`` threads loads its row's vectors of ``x`` and ``dy`` into registers (read once from global memory; with a
residual/bias, ``x``'s vector is summed as it is taken), computes ``xhat`` and ``g = dy gamma``, the two row sums
``sum g`` and ``sum g xhat`` together (one pair of barriers of the row's own warps, fixed order), and writes ``dx =
rstd (g - mean(g) - xhat mean(g xhat))`` from the registers; with ``PF`` it issues the loads of the next row it
visits before this row's sums, barriers and stores (a second buffer of raw vectors), so loads stay in flight. At
most 16 values a thread (8 for float64), as many rows a block as the registers of an SM take (one block an SM, sized
by a register estimate fitted to ptxas for sm_90 and kept under ptxas's cap, so no spills), and a grid of as many
blocks as the GPU holds at once, each visiting rows grid-stride. Where the row's values and column sums do not fit
in the registers of at most 1,024 threads, ``ln_bwds`` sweeps each row once all the same: the same kernel with the
column sums in dynamic shared memory (``2 L`` compute values a block, one row a block, each column's sums owned by
one thread, so no barrier guards them), the row in registers as ``ln_dx1`` holds it, and beside it the thread's
columns of gamma (and of the bias, fused), read once (``HOLD``: with the shared memory taken by the sums, L1 keeps
little, and reading them twice a row cost more than the row itself); it takes the halves and float32 where the sums
fit a block's shared memory (227 KB on sm_90: up to some 29,000 values) and the row the registers
(:func:`_shared_sweep_plan`: float16 to 16,384 and float32 to 12,288 values, for example). Rows whose sums or row do
not fit one block take ``ln_bwdc`` (measured: before the split backward, which rereads ``x`` and ``dy``): a cluster
of 2, 4 or 8 blocks a row (sm_90), each block ``ln_bwds`` over its share of the columns, the two row sums exchanged
through distributed shared memory with one cluster barrier a row (:func:`_cluster_split`; :data:`CLUSTER_COLUMNS`),
as many clusters as run at once (``cuOccupancyMaxActiveClusters``), each visiting a fixed set of rows and staging
its next row in the shared memory the sums leave free (``cp.async``, each thread its own vectors) while this row's
sums and barriers run. Rows that split into no cluster's whole vectors, whose copy of gamma does not fit beside the
row, take ``ln_bwdr``: ``ln_bwds`` reading gamma (and the bias) twice a row (16,388 halves, for example). Where none
of these fits (:data:`SHARED_COLUMNS`, or a GPU with less shared memory or no clusters), the halves' rows shorter
than 12,288 values (from 8,448) take ``ln_bwd``: two sweeps a row (the row sums, then ``dx``, rereading ``x`` and
``dy``, from L2 as a rule), a thread holding only its column sums.

Longer rows that none of these take (:data:`SPLIT_FROM`: measured, the split path is as fast or faster than
``ln_bwd`` there; rows that split into no cluster's whole vectors and do not fit ``ln_bwdr``, 20,484 halves for
example; float64 where no kernel that keeps the column sums fits, from about 8,200 to 16,384) take the split
backward: the same kernels compiled with ``PARAMS 0`` compute ``dx`` alone, with no column sums at all (``ln_dx1``:
one sweep, the row in registers, up to 32 values a thread, where the register estimate fits, not for float64; else
``ln_dx2``: two sweeps, a vector at a time), and then ``ln_cols`` sums the columns apart, rereading ``x`` and ``dy``
(5 N L s bytes in all instead of 3): a block owns a tile of 32 16-byte vectors of columns (a warp's loads side by
side along the row) and a chunk of ``rc`` rows, each of its 8 warps summing ``dy xhat`` and ``dy`` over every 8th
row of the chunk in order (``xhat`` recomputed from ``x`` [+ residual + bias], ``mean``, ``rstd``), the warps' sums
added in shared memory in order, one partial row a chunk. :func:`column_shape` sizes the chunks from the shape alone
(some 4,096 blocks, at least 64 rows a chunk), not from the device. Every row the forward takes has a backward
kernel (:func:`backward_fits`); the composite runs only for rows the forward turns down.

``dgamma``/``dbeta`` are deterministic: each thread keeps the column sums of ``dy xhat`` and ``dy`` over the rows
its group visits (a fixed set, in a fixed order), a block's groups add theirs in shared memory in a fixed order and
the block writes one row of partials (one a block: as few as the SMs, at most 132 on an H100), or ``ln_cols``
writes one a chunk of rows; ``ln_params`` adds the partial rows per column in a fixed order. Results depend on
the shape and, for ``ln_bwd1``/``ln_bwd``, the GPU's SM count, never on timing. A "last block finishes" single
launch was weighed and not taken: its one block would read all the partial rows alone (``P L`` pairs: some 0.8 MB
at L = 768, 21 MB at 20,480, microseconds to a hundred at one SM's bandwidth), where ``ln_params`` spreads them over
``L / 32`` blocks.

Statistics (``mean``, ``rstd``) are float32 (float64 for float64 data); ``gamma``/``beta`` are in the compute type
(float32 for the halves, as fluxpy's LayerNorm keeps them). Kernels are compiled per (dtype, L, fused, backward plan)
and cached.

>>> sorted(KERNELS)
['layernorm_backward', 'layernorm_forward']
"""
from __future__ import annotations

import numpy as np

from ..backend import cupy
from .cuda_arrays import c_contiguous
from .halfs import KERNEL_DTYPES, compute_dtype, prelude

__all__ = ["layernorm_forward", "layernorm_backward", "supports", "backward_supports", "launch_shape",
           "kernel_attributes", "KERNELS"]

MAX_VECTORS = 8        # vectors of a row a thread holds in the forward, at most (128 bytes in flight a thread)
# The forward of rows that take at most SHORT_ROW_THREADS threads holds at most SHORT_ROW_VECTORS vectors a thread, and
# a block holds FORWARD_BLOCK_THREADS threads' worth of rows (benchmarks/layernorm.py's lengths on an H200, 8192 rows,
# against a warp of up to 8 vectors a row and 256-thread blocks: float16 768 7.9 -> 7.3 us, 1,536 17.1 -> 15.9,
# 4,096 38.6 -> 38.2; float32 1,024 21.4 -> 20.2, 1,536 29.2 -> 28.5; longer rows unchanged). 5 vectors, not 4:
# fewer threads a row, with no idle ones, where 4 left a quarter of a row's threads idle (H200, float16 1,280: 128
# threads of 3 vectors, 13.5 us (74% of copy) -> 64 of 5, 11.4 us; 10.4 prefetching).
SHORT_ROW_VECTORS = 5
SHORT_ROW_THREADS = 256
FORWARD_BLOCK_THREADS = 128
# By item size: whether the forward of those short rows, where a row is smaller than SHORT_ROW_PREFETCH_BYTES, visits
# the rows grid-stride, loading the next row into registers before this row's sums (PF, as the longest rows do).
# H200, 8192 rows, without -> with: float16 1,024 8.79 -> 8.34 us, 1,280 11.36 -> 10.36, 1,536 15.57 -> 14.83, 1,792
# 19.66 -> 19.18; float32 512 8.88 -> 7.66, 640 10.87 -> 8.90, 768 14.44 -> 12.94. Rows of 4 KB and more gained
# nothing or lost (float16 2,048 21.11 -> 21.06, 2,304 23.41 -> 24.18; float32 1,024 20.02 -> 20.04, 1,280 24.11 ->
# 25.09, 2,048 36.36 -> 37.44), and so did float16 768 (7.16 -> 7.26). float64 not measured.
SHORT_ROW_PREFETCH = {2: True, 4: True, 8: False}
SHORT_ROW_PREFETCH_BYTES = 4096
# The plain forward of the halves' longer rows (those the rule above gives SHORT_ROW_THREADS threads or more, in
# 8-byte vectors: 2-half vectors spilled at 10,242-14,338 values as FORWARD_SPARE counts them), where an SM
# would hold fewer than FORWARD_MIN_ROWS of them at once, takes the shape that lets it hold the most: up to
# MAX_FORWARD_ITEMS vectors a thread, the threads a row a multiple of 32 (from FORWARD_BLOCK_THREADS), a row a block,
# ptxas held to that many blocks an SM (__launch_bounds__), the fewest vectors a thread among the shapes that tie. A
# thread needs its row values and FORWARD_SPARE registers besides (fitted to ptxas for sm_90; a kernel that spills
# anyway is rebuilt for a block fewer, _forward_kernel). The barriers of a row's two sums leave its block's loads
# idle, so the more rows an SM holds, the busier its loads. H200, 8192 rows, against the rule above: float16 12,288
# values, 512 threads of 6 vectors (2 blocks an SM) -> 384 threads of 8 (3 blocks): 115.4 -> 102.3 us (84% -> 94% of
# copy); 20,480, 1,024 threads of 5, prefetching -> 512 threads of 10 (2 blocks): 190.0 -> 181.0 us (84% -> 88%);
# 10,240 105.0 -> 87.0 (78% -> 94%), 18,432 175.6 -> 156.7 (82% -> 91%). Not the fused form (slower so: 12,288
# bfloat16 227 -> 290 us, 18,432 float16 314 -> 345), float32 (85-97% of copy by the rule above) nor float64.
MAX_FORWARD_ITEMS = 12
FORWARD_MIN_ROWS = 3
FORWARD_SPARE = {2: 24, 4: None, 8: None}
MAX_VALUES = 32        # row values a thread sums per column in the backward, at most (16 for float64)
MAX_THREADS = 1024     # threads per row, at most (longer rows are turned down)
# The forward of the halves prefetches the next row (PF) where a row takes a whole block of MAX_THREADS, if its row
# values and the raw vectors of the next row take at most this many registers' worth a thread (sm_90: 24 values and
# 12 packed words fit the 64 registers of a 1,024-thread block; 32 and 16 spilled, and so did 20 and 20 of the fused
# form, 8 bytes on the H200's NVRTC at 16,896 to 19,968).
FORWARD_PREFETCH_WORDS = 36
ONE_SWEEP_VALUES = {2: 16, 4: 16, 8: 8}   # row values a thread holds in the one-sweep backward, by item size
ONE_SWEEP_REGISTERS = {2: (5, 4), 4: (6, 4), 8: (13, 10)}   # a value a thread holds, (prefetching, not)
ONE_SWEEP_SPARE = 48   # registers of the one-sweep backward besides its values (indices, pointers, sums)
# ln_bwd1 of rows that take at most SHORT_ONE_SWEEP_THREADS threads puts ONE_SWEEP_BLOCK_THREADS threads' worth of
# rows in a block, as the registers allow, rather than up to 1,024 (H200, 8192 rows: float16 768 17.7 -> 15.9 us,
# 1,024 24.8 -> 23.7; float32 768 30.3 -> 28.8, 1,024 36.2 -> 35.3). Not longer rows: at float16 1,536 (96 threads)
# 2 rows a block were no faster than 5 (32.8 against 32.9 us), and at 4,096 1 row of 256 threads took 65.5 us
# against 61.8 for 2.
SHORT_ONE_SWEEP_THREADS = 64
ONE_SWEEP_BLOCK_THREADS = 256
# ln_bwd1 gives a row two warps where one would hold more than this many values a thread (H200, 8192 rows, a warp of
# 16 values, 8 rows a block -> 64 threads of 8, 4 rows: float16 512 15.9 -> 12.9 us, float32 512 23.5 -> 19.3).
ONE_SWEEP_WARP_VALUES = 8
# Row values a thread holds in the dx-only one sweep (ln_dx1), at most; none for float64 (ptxas spilled 8 to 32 bytes
# at every shape tried, 10 to 16 values a thread at 8,194 to 10,240 values a row): its long rows take ln_dx2.
DX_SWEEP_VALUES = {2: 32, 4: 32, 8: 0}
DX_SWEEP_REGISTERS = {2: (3.25, 1.5), 4: (4.5, 2), 8: (9, 5)}   # a value a thread of ln_dx1 holds, (prefetching, not)
# ln_dx1 takes several rows a block only while its estimate stays this many registers under ptxas's cap: the
# device's NVRTC spilled 8 bytes at 10,236 float32 values (320 threads x 2 rows, cap 96) where 13.5's fit.
DX_SWEEP_MARGIN = 8
DX_SWEEP_SPARE = 32    # registers of ln_dx1 besides its values (fitted as ONE_SWEEP_*: ptxas needed 2 V + 32 for
                       # float32 and 1.5 V + 32 for the halves without prefetch at V = 12 to 32 values a thread)

# By item size: rows of at least this many values take the split backward (dx alone, then ln_cols and ln_params)
# even where the two-sweep ln_bwd, which also keeps the column sums, fits; None: only where no kernel that keeps the
# column sums fits. ln_bwd1 runs wherever it fits, whatever this says. The split path moves 5 N L s bytes (ln_cols
# rereads x and dy), ln_bwd 3 N L s from memory plus a reread from L2. Measured on an H200, 8192 rows
# (benchmarks/layernorm.py --split), ln_bwd against the split: float16 8,448: 194 / 196 us, 10,240: 219 / 224,
# 12,288: 396 / 261, 16,384: 483 / 347; float32 8,448: 373 / 338, 10,240: 422 / 414, 12,288: 492 / 486, 16,384:
# 653 / 645. float64 not measured.
SPLIT_FROM = {2: 12288, 4: 0, 8: None}
# By item size: whether rows too long for ln_bwd1 take ln_bwds (one sweep, the row in registers as ln_dx1 holds it,
# the column sums in 2 L compute values of dynamic shared memory) where those fit the device's shared memory a
# block (227 KB on sm_90: rows of up to some 29,000 values). Not float64 (ln_dx1 does not take it).
SHARED_COLUMNS = {2: True, 4: True, 8: False}
SHARED_SPARE = 12      # registers ln_bwds needs beyond ln_dx1's estimate (the shared sums' addresses; NVRTC 13.5
                       # spilled 4 to 12 bytes at 4 and 8, sm_90: 16,388-17,920 float32, 16,388-21,504 halves)
FUSED_SHARED_SPARE = 8   # and its fused form beyond that (spilled 4 bytes at 16,388-19,456 halves, 544-608 threads)
# By item size: registers a row value a thread of ln_bwds or ln_bwdc needs for its copy of gamma's value of that
# column (and as many for the bias's, fused; fitted to ptxas for sm_90, NVRTC 13.5: the halves' copies cost less
# than a register each beside the prefetching row), those kernels holding them (HOLD in the source) rather than
# reading them twice a row, for their column sums take the shared memory and with it most of L1. H200, 8192 rows,
# held against read: float16 12,288 190.3 -> 165.0 us, 32,768 854.7 -> 514.5; float32 24,576 977.6 -> 629.2,
# 32,768 1,478.2 -> 861.1.
HELD_REGISTERS = {2: 0.5, 4: 1, 8: 2}
# By item size: whether the forward of rows that take a whole block, where the next row does not fit the registers,
# stages the next row in shared memory instead (cp.async; _forward_stages), one row ahead; where ptxas spills that
# form, two rows ahead (a ring of two slots, where they fit: it spilled at other lengths), else none (_forward_kernel).
# float32 too: H200, 8192 rows, against no staging: 18,432 values 329.5 -> 312.1 us (86% -> 91% of copy), 20,480
# 359.2 -> 344.8 (88% -> 92%), 32,768 599.1 -> 549.9 (84% -> 91%); two rows ahead 20,484 387.0 -> 365.0 (82% ->
# 87%), 24,576 425.0 -> 412.9 (89% -> 92%), but 28,672 524.9 -> 557.5 (84% -> 79%, not avoided). Two or three rows
# ahead where one fits was slower (float16 32,768: 310.8, 317.1, 325.3 us), and so were 16-byte copies of the
# halves, any thread any piece, with a barrier a row (404 us).
STAGED_FORWARD = {2: True, 4: True, 8: False}
# By item size: whether ln_bwd1, where its plan holds fewer than two rows an SM, runs the first form that holds two
# that ptxas compiles without spilling (_two_block_plan): more rows an SM hide the barriers of a row's sums, as in the
# forward (FORWARD_MIN_ROWS). H200, 8192 rows, share of copy: float16 4,608 71.6% -> 80.7% (256 threads of 5
# vectors), 5,140 73.4% -> 78.0% and 5,376 76.4% -> 80.9% (192 of 7), bfloat16 5,140 72.4% -> 78.5%; at float16 6,144
# every two-block form spilled. float32 4,096 lost (91.1% -> 83.1%: the one form that fit took 250 registers) and at
# 5,140 every form spilled, so not for float32.
BACKWARD_TWO_BLOCKS = {2: True, 4: False, 8: False}
# By item size: whether rows whose column sums do not fit one block's shared memory take ln_bwdc, a cluster of 2, 4 or
# 8 blocks a row (sm_90 and later), each block ln_bwds over its share of the columns (_cluster_split).
CLUSTER_COLUMNS = {2: True, 4: True, 8: False}
# By item size: the blocks of ln_bwdc an SM may hold, in order of preference; _cluster_split takes the split (blocks a
# cluster, blocks an SM) with the most threads an SM, ties to the earlier here, and compiles it held to that many
# blocks (__launch_bounds__), so ptxas keeps the registers to that share. H200, 8192 rows, against the fewest blocks a
# cluster, one an SM: float16 24,576 values 403.5 -> 385.0 us (4 blocks of 192 threads of 8 vectors, two an SM),
# 32,768 515.2 -> 489.8, fused 32,768 889.9 -> 693.2. Three and four an SM (fifteenth session), against two only:
# float16 18,432 322.5 -> 268.1 us and 20,480 336.7 -> 285.8, bfloat16 20,480 345.4 -> 289.8, fused 17,920 436.7 ->
# 366.9 (4 blocks of 160 threads held to three an SM: 128 registers where two an SM let ptxas take 142, and the
# driver then ran 62 clusters at once, not 92); fused 26,624 621.9 -> 548.2 (8 blocks of 128 held to four). Losses:
# 24,832 398.3 -> 402.1, fused 531.1 -> 542.3 (eight blocks a cluster, four an SM, against four and two), and 0.3-0.5%
# where three an SM left the clusters run at once as they were (fused 14,592 to 16,384, 28,928 to 32,768). Not
# float32 (24,576: 630 -> 642 us with two an SM, 20,480: 486 -> 495; four: 485 -> 545).
CLUSTER_BLOCKS = {2: (2, 3, 4, 1), 4: (1,), 8: (1,)}
SM90_SHARED_BYTES = 232448   # shared memory a block may opt into on sm_90; the plan's limit where no GPU is asked
COLUMN_WARPS = 8       # ln_cols: warps a block, each its own rows of the block's chunk
COLUMN_BLOCKS = 4096   # ln_cols: blocks aimed at (5 to 10 waves of an H100's 132 SMs at 3 to 6 blocks of 256 threads
                       # an SM, 40 to 74 registers); a constant, not the device's SM count, so that the order of the
                       # sums depends on the shape alone
COLUMN_MIN_ROWS = 64   # ln_cols: rows a block sums at least (so the partial rows stay few against the data)

_SOURCE = r"""
// T/C/LOAD/STORE: halfs.prelude; L: the row length; VW: elements per vector; VT: the vector type;
// TPR: threads per row; RPB: rows per block; ITEMS: vectors per thread; PF: the one sweep prefetches the next row;
// FUSED: the x + residual + bias code is compiled in; PARAMS: the dx kernel also keeps the column sums of dgamma/dbeta
// (1: ln_bwd1/ln_bwd, ln_params) or computes dx alone (0: ln_dx1/ln_dx2, then ln_cols and ln_params);
// KVW/KVT: the vector of ln_cols (16 bytes where L allows).
#define LV (L / VW)
#define NW (TPR / 32 > 0 ? TPR / 32 : 1)
// One block an SM is enough: without the 1, ptxas traded registers for a second block and spilled 8 bytes (ln_dx1 at
// 10,240 float32 values: 96 registers; with it, 115 and no spill). The grid is sized from the registers it used.
// BWD_BLOCKS is 2 for the two-block forms of ln_bwd1 (_two_block_plan), which are kept only where ptxas fits them,
// and for ln_bwdc where an SM is to hold two or four of its blocks (CLUSTER_BLOCKS).
#define ROW_BOUNDS __launch_bounds__(TPR * RPB, BWD_BLOCKS)
typedef VT vec_t;   // VT may be two words ("unsigned int")

// The sum of a over the TPR threads of this thread's row, in a fixed order (every thread of the block calls it).
__device__ __forceinline__ C row_sum(C a, C* sh) {
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffff, a, o);
#if TPR > 32
    const int grp = threadIdx.x / TPR, warp = (threadIdx.x % TPR) / 32;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[grp * NW + warp] = a;
    __syncthreads();
    a = 0;
    for (int w = 0; w < NW; ++w) a += sh[grp * NW + w];
#endif
    return a;
}

// Vector j of a row of p, plus the same of res and bias where given (the fused x + residual + bias).
__device__ __forceinline__ void load_vec(const T* p, const T* res, const C* bias, long long row, int j, C* v) {
    VT w = ((const VT*)(p + row * (long long)L))[j];
    const T* e = (const T*)&w;
    #pragma unroll
    for (int u = 0; u < VW; ++u) v[u] = LOAD(e[u]);
#if FUSED   // compiled in only for the fused form: the branches cost the plain forward's loads their overlap
    if (res) {
        VT q = ((const VT*)(res + row * (long long)L))[j];
        const T* f = (const T*)&q;
        #pragma unroll
        for (int u = 0; u < VW; ++u) v[u] += LOAD(f[u]);
    }
    if (bias) {
        #pragma unroll
        for (int u = 0; u < VW; ++u) v[u] += bias[j * VW + u];
    }
#endif
}

__device__ __forceinline__ void load_row(const T* p, const T* res, const C* bias, long long row, bool valid, int tid,
                                         C* v) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;   // vector index in the row
        if (valid && j < LV) {
            load_vec(p, res, bias, row, j, v + i * VW);
        } else {
            #pragma unroll
            for (int u = 0; u < VW; ++u) v[i * VW + u] = 0;
        }
    }
}

// The prefetching forward's loads: the raw vectors this thread holds of row `row` of x (and of the residual,
// fused), zeros past the rows or the row; unpack_x converts them once the previous row is written.
__device__ __forceinline__ void fetch_x(const T* x, const T* res, long long row, long long R, int tid, VT* bx,
                                        VT* br) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        const bool in = row < R && j < LV;
        bx[i] = in ? ((const VT*)(x + row * (long long)L))[j] : vec_t{};
#if FUSED
        br[i] = in && res ? ((const VT*)(res + row * (long long)L))[j] : vec_t{};
#endif
    }
}

// The row values those raw vectors hold, in the compute type: x [+ residual + bias] (as load_row gives them).
__device__ __forceinline__ void unpack_x(const VT* bx, const VT* br, const C* bias, int tid, C* v) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const T* e = (const T*)&bx[i];
        #pragma unroll
        for (int u = 0; u < VW; ++u) v[i * VW + u] = LOAD(e[u]);
#if FUSED
        const T* f = (const T*)&br[i];
        #pragma unroll
        for (int u = 0; u < VW; ++u) v[i * VW + u] += LOAD(f[u]);
        const int j = i * TPR + tid;
        if (bias && j < LV) {
            #pragma unroll
            for (int u = 0; u < VW; ++u) v[i * VW + u] += bias[j * VW + u];
        }
#endif
    }
}


// The barrier of the TPR threads of row group grp: a named barrier a group (ids 1 to RPB; 0 is __syncthreads'), so
// that a row's warps wait for each other and not for the block's other rows; the block's barrier where RPB is 1 or
// past the 15 ids there are (H200, ln_bwd1, 8192 rows: float16 1,536 in 128 threads of 3 vectors, 4 rows a block,
// 30.3 -> 29.4 us; float32 1,024 in 128 of 2, 33.5 -> 32.2).
__device__ __forceinline__ void row_barrier(int grp) {
#if RPB > 1 && RPB < 16
    asm volatile("bar.sync %0, %1;" :: "r"(grp + 1), "r"(TPR) : "memory");
#else
    __syncthreads();
#endif
}

// The sums of a and of b over the TPR threads of this thread's row, in a fixed order, with one pair of barriers of
// the row's threads (every thread of the block calls it).
__device__ __forceinline__ void row_sum2(C& a, C& b, C* sh) {
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffff, a, o);
        b += __shfl_xor_sync(0xffffffff, b, o);
    }
#if TPR > 32
    const int grp = threadIdx.x / TPR, warp = (threadIdx.x % TPR) / 32;
    row_barrier(grp);
    if ((threadIdx.x & 31) == 0) { sh[2 * (grp * NW + warp)] = a; sh[2 * (grp * NW + warp) + 1] = b; }
    row_barrier(grp);
    a = 0;
    b = 0;
    for (int w = 0; w < NW; ++w) { a += sh[2 * (grp * NW + w)]; b += sh[2 * (grp * NW + w) + 1]; }
#endif
}

// VW compute values (gamma, bias) of vector j, as one load where VW allows.
__device__ __forceinline__ void load_cvec(const C* p, int j, C* v) {
#ifdef CVT
    CVT w = ((const CVT*)p)[j];
    const C* e = (const C*)&w;
    #pragma unroll
    for (int u = 0; u < VW; ++u) v[u] = e[u];
#else
    #pragma unroll
    for (int u = 0; u < VW; ++u) v[u] = p[j * VW + u];
#endif
}

// The same, stored.
__device__ __forceinline__ void store_cvec(C* p, int j, const C* v) {
#ifdef CVT
    CVT w;
    C* e = (C*)&w;
    #pragma unroll
    for (int u = 0; u < VW; ++u) e[u] = v[u];
    ((CVT*)p)[j] = w;
#else
    #pragma unroll
    for (int u = 0; u < VW; ++u) p[j * VW + u] = v[u];
#endif
}

#if PARAMS
// The RPB groups of a block add their column sums (ag, ab) in a fixed order (group 0, 1, ...): the first RPB - 1 in
// shared memory, a round and a barrier each, the last adding its own as it writes the block's partial row blockIdx.x
// of pg, pb. A vector of VW columns is one access (scalar ones, VW apart, met in the same banks).
__device__ __forceinline__ void write_partials(const C* ag, const C* ab, C* pg, C* pb, int tid, int grp) {
    C* const rg = pg + (long long)blockIdx.x * L;
    C* const rb = pb + (long long)blockIdx.x * L;
#if RPB > 1
    __shared__ __align__(16) C colg[L];
    __shared__ __align__(16) C colb[L];
    for (int q = 0; q < RPB; ++q) {
        if (grp == q) {
            #pragma unroll
            for (int i = 0; i < ITEMS; ++i) {
                const int j = i * TPR + tid;
                if (j < LV) {
                    C g[VW], b[VW];
                    if (q == 0) {
                        #pragma unroll
                        for (int u = 0; u < VW; ++u) { g[u] = 0; b[u] = 0; }
                    } else {
                        load_cvec(colg, j, g);
                        load_cvec(colb, j, b);
                    }
                    #pragma unroll
                    for (int u = 0; u < VW; ++u) { g[u] += ag[i * VW + u]; b[u] += ab[i * VW + u]; }
                    store_cvec(q + 1 < RPB ? colg : rg, j, g);
                    store_cvec(q + 1 < RPB ? colb : rb, j, b);
                }
            }
        }
        if (q + 1 < RPB) __syncthreads();
    }
#else
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < LV) {
            store_cvec(rg, j, ag + i * VW);
            store_cvec(rb, j, ab + i * VW);
        }
    }
#endif
}
#endif   // PARAMS

// HOLD (ln_bwds, ln_bwdc: their column sums fill the shared memory, so L1 keeps little of gamma and bias): a thread
// reads its columns of gamma (and of the bias, fused) into registers once, not twice a row (H200, 8192 rows: float32
// 32,768 values, ln_bwdc, 1,478 us with gamma against 872 without). ln_bwdr is ln_bwds without them (HOLD 0), for rows
// whose copies do not fit beside the row.

// This thread's vectors j = i * TPR + tid below nv of p, held in h (zeros past the row or where p is null).
__device__ __forceinline__ void hold_cols(const C* p, int tid, int nv, C* h) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (p && j < nv) {
            load_cvec(p, j, h + i * VW);
        } else {
            #pragma unroll
            for (int u = 0; u < VW; ++u) h[i * VW + u] = 0;
        }
    }
}

// Vector j (this thread's i-th) of p: from the held copy h where HOLD, else read (p is not null).
__device__ __forceinline__ void cols_of(const C* p, const C* h, int i, int j, C* v) {
#if HOLD
    #pragma unroll
    for (int u = 0; u < VW; ++u) v[u] = h[i * VW + u];
#else
    load_cvec(p, j, v);
#endif
}

// The raw vectors of x and dy this thread holds of a row, and the row's statistics (zeros past the rows or the row).
__device__ __forceinline__ void fetch(const T* x, const T* dy, const C* mean, const C* rstd, long long row,
                                      long long R, int tid, VT* bx, VT* bd, C& mu, C& rs) {
    const bool valid = row < R;
    mu = valid ? mean[row] : (C)0;
    rs = valid ? rstd[row] : (C)0;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (valid && j < LV) {
            bx[i] = ((const VT*)(x + row * (long long)L))[j];
            bd[i] = ((const VT*)(dy + row * (long long)L))[j];
        } else {
            bx[i] = vec_t{};
            bd[i] = vec_t{};
        }
    }
}

// y of one row from its values v (every thread of the block calls it): the mean, then the variance from the
// registers, gamma and beta read as vectors (a scalar load a value cost the halves a quarter of their bandwidth).
__device__ __forceinline__ void normalise_row(const C* v, const C* gamma, const C* beta, T* y, C* mean_out,
                                              C* rstd_out, long long row, long long R, double eps, int tid, C* sh) {
    C s = 0;
    #pragma unroll
    for (int k = 0; k < ITEMS * VW; ++k) s += v[k];
    const C mu = row_sum(s, sh) / (C)L;
    C q = 0;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const bool in = (i * TPR + tid) < LV;
        #pragma unroll
        for (int u = 0; u < VW; ++u) { const C d = in ? v[i * VW + u] - mu : (C)0; q += d * d; }
    }
    const C rs = (C)1 / sqrt(row_sum(q, sh) / (C)L + (C)eps);
    if (row >= R) return;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < LV) {
            C g[VW], b[VW];
            if (gamma) load_cvec(gamma, j, g); else for (int u = 0; u < VW; ++u) g[u] = 1;
            if (beta) load_cvec(beta, j, b); else for (int u = 0; u < VW; ++u) b[u] = 0;
            VT w;
            T* e = (T*)&w;
            #pragma unroll
            for (int u = 0; u < VW; ++u) e[u] = STORE((v[i * VW + u] - mu) * rs * g[u] + b[u]);
            ((VT*)(y + row * (long long)L))[j] = w;
        }
    }
    if (tid == 0) { mean_out[row] = mu; rstd_out[row] = rs; }
}

#if SPF || CLUSTER > 1
__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (unsigned)a;
}

// The staged copies (the forward's SPF, ln_bwdc): each thread copies its own vectors of a row into shared memory with
// cp.async (sm_80 and later), holding no registers while they fly, and later reads back only what it copied itself,
// so no barrier orders them. Zeros past the rows (a copy of no bytes fills its slot with zeros).
__device__ __forceinline__ void copy_async(VT* dst, const VT* src, bool in) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" :: "r"(shared_address(dst)), "l"(src),
                 "n"((int)sizeof(VT)), "r"(in ? (int)sizeof(VT) : 0) : "memory");
}
#endif

#if SPF
// STAGES: the rows staged ahead, a ring of slots.
__device__ __forceinline__ void stage_row(const T* x, const T* res, long long row, long long R, int tid, VT* sx,
                                          VT* sr) {
    const bool valid = row < R;
    const long long r = valid ? row : 0;   // a copy of no bytes reads nothing, but keep its address in bounds
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < LV) {
            copy_async(sx + j, (const VT*)(x + r * (long long)L) + j, valid);
#if FUSED
            if (res) copy_async(sr + j, (const VT*)(res + r * (long long)L) + j, valid);
#endif
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// The raw vectors this thread holds of the row staged STAGES - 1 commits ago (zeros past the row), once it landed.
__device__ __forceinline__ void unstage(const VT* sx, const VT* sr, int tid, VT* bx, VT* br) {
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1) : "memory");
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        bx[i] = j < LV ? sx[j] : vec_t{};
#if FUSED
        br[i] = j < LV ? sr[j] : vec_t{};
#endif
    }
}
#endif

// One row a group of TPR threads. With PF (rows of a whole block: an SM holds one such block, and its barriers
// would leave the SM's loads idle between rows) the grid visits the rows grid-stride, each block issuing the loads
// of its next row before this row's sums; with SPF (such rows whose next row does not fit the registers) the same,
// the next row staged in shared memory instead (stage_row).
// FWD_BLOCKS: the blocks an SM is to hold at once (_forward_shape), so that ptxas keeps the registers to that share.
extern "C" __global__ void __launch_bounds__(TPR * RPB, FWD_BLOCKS) ln_fwd(const T* x, const C* gamma,
                                                                             const C* beta, T* y, C* mean_out,
                                                                             C* rstd_out, long long R, double eps,
                                                                             const T* res, const C* bias) {
    __shared__ C sh[RPB * NW];
    const int tid = threadIdx.x % TPR, grp = threadIdx.x / TPR;
    C v[ITEMS * VW];
#if PF
    VT bx[ITEMS], br[FUSED ? ITEMS : 1];
    fetch_x(x, res, (long long)blockIdx.x * RPB + grp, R, tid, bx, br);
    for (long long base = blockIdx.x; base * RPB < R; base += gridDim.x) {   // the same trip count block-wide
        const long long row = base * RPB + grp;
        unpack_x(bx, br, bias, tid, v);
        fetch_x(x, res, row + (long long)gridDim.x * RPB, R, tid, bx, br);
        normalise_row(v, gamma, beta, y, mean_out, rstd_out, row, R, eps, tid, sh);
    }
#elif SPF   // RPB is 1
    extern __shared__ __align__(16) unsigned char stage_bytes[];
    VT* const sx = (VT*)stage_bytes;       // STAGES slots of a row
    VT* const sr = sx + STAGES * LV;       // and of the residual's row (fused)
    for (int k = 0; k < STAGES; ++k)
        stage_row(x, res, blockIdx.x + (long long)k * gridDim.x, R, tid, sx + k * LV, sr + k * LV);
    int slot = 0;
    for (long long row = blockIdx.x; row < R; row += gridDim.x) {   // the same trip count block-wide
        VT bx[ITEMS], br[FUSED ? ITEMS : 1];
        unstage(sx + slot * LV, sr + slot * LV, tid, bx, br);
        unpack_x(bx, br, bias, tid, v);
        stage_row(x, res, row + (long long)STAGES * gridDim.x, R, tid, sx + slot * LV, sr + slot * LV);
        slot = slot + 1 == STAGES ? 0 : slot + 1;
        normalise_row(v, gamma, beta, y, mean_out, rstd_out, row, R, eps, tid, sh);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");   // the last (empty) copies land before the block's memory goes
#else
    const long long row = (long long)blockIdx.x * RPB + grp;
    load_row(x, res, bias, row, row < R, tid, v);
    normalise_row(v, gamma, beta, y, mean_out, rstd_out, row, R, eps, tid, sh);
#endif
}

// dx per row, in two sweeps over the row (the second rereads x and dy, from L2 as a rule) so that a thread holds
// only its column sums of dy * xhat (ag) and dy (ab) over the rows its group visits. The RPB groups of a block add
// theirs in shared memory in a fixed order; the block writes them as row blockIdx.x of the partials.
// Compiled with PARAMS 0 it is ln_dx2: dx alone, no column sums (a thread holds a vector's worth of values at a time).
// Of vector j of a row: xh = (x [+ res + bias] - mu) * rs, d = dy and g = dy * gamma.
__device__ __forceinline__ void xhat_and_g(const T* x, const T* res, const C* bias, const T* dy, const C* gamma,
                                           long long row, int j, C mu, C rs, C* xh, C* g, C* d) {
    load_vec(x, res, bias, row, j, xh);
    load_vec(dy, nullptr, nullptr, row, j, d);
    #pragma unroll
    for (int u = 0; u < VW; ++u) {
        xh[u] = (xh[u] - mu) * rs;
        g[u] = gamma ? d[u] * gamma[j * VW + u] : d[u];
    }
}

#if PARAMS && SCOLS && HOLD
#define LN_BWD ln_bwd
#define LN_BWD1 ln_bwds
#elif PARAMS && SCOLS
#define LN_BWD ln_bwd
#define LN_BWD1 ln_bwdr
#elif PARAMS
#define LN_BWD ln_bwd
#define LN_BWD1 ln_bwd1
#else
#define LN_BWD ln_dx2
#define LN_BWD1 ln_dx1
#endif
extern "C" __global__ void ROW_BOUNDS LN_BWD(const T* dy, const T* x, const C* gamma,
                                                               const C* mean, const C* rstd, T* dx, C* pg, C* pb,
                                                               long long R, int want_params, const T* res,
                                                               const C* bias) {
    __shared__ C sh[RPB * NW];
    const int tid = threadIdx.x % TPR, grp = threadIdx.x / TPR;
#if PARAMS
    C ag[ITEMS * VW], ab[ITEMS * VW];
    #pragma unroll
    for (int k = 0; k < ITEMS * VW; ++k) { ag[k] = 0; ab[k] = 0; }
#endif
    for (long long base = blockIdx.x; base * RPB < R; base += gridDim.x) {   // the same trip count block-wide
        const long long row = base * RPB + grp;
        const bool valid = row < R;
        const C mu = valid ? mean[row] : (C)0, rs = valid ? rstd[row] : (C)0;
        C s1 = 0, s2 = 0;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (valid && j < LV) {
                C xh[VW], g[VW], d[VW];
                xhat_and_g(x, res, bias, dy, gamma, row, j, mu, rs, xh, g, d);
                #pragma unroll
                for (int u = 0; u < VW; ++u) {
                    s1 += g[u]; s2 += g[u] * xh[u];
#if PARAMS
                    ag[i * VW + u] += d[u] * xh[u]; ab[i * VW + u] += d[u];
#endif
                }
            }
        }
        const C m1 = row_sum(s1, sh) / (C)L, m2 = row_sum(s2, sh) / (C)L;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (valid && j < LV) {
                C xh[VW], g[VW], d[VW];
                xhat_and_g(x, res, bias, dy, gamma, row, j, mu, rs, xh, g, d);
                VT w;
                T* e = (T*)&w;
                #pragma unroll
                for (int u = 0; u < VW; ++u) e[u] = STORE(rs * (g[u] - m1 - xh[u] * m2));
                ((VT*)(dx + row * (long long)L))[j] = w;
            }
        }
    }
#if PARAMS
    if (want_params) write_partials(ag, ab, pg, pb, tid, grp);
#endif
}

#if SCOLS || CLUSTER > 1
// ln_bwds keeps its column sums in dynamic shared memory (2 L compute values: dy xhat, then dy) instead of registers,
// so rows too long for ln_bwd1's registers still sweep once. Each column belongs to one thread (RPB is 1), so no
// barrier guards these sums; a vector of VW columns is one 16-byte access (scalar ones cost 4 wavefronts each).
__device__ __forceinline__ void add_cols(C* s, int j, const C* a) {
#ifdef CVT
    CVT w = ((CVT*)s)[j];
    C* e = (C*)&w;
    #pragma unroll
    for (int u = 0; u < VW; ++u) e[u] += a[u];
    ((CVT*)s)[j] = w;
#else
    #pragma unroll
    for (int u = 0; u < VW; ++u) s[j * VW + u] += a[u];
#endif
}

__device__ __forceinline__ void copy_cols(const C* s, C* p, int j) {
#ifdef CVT
    ((CVT*)p)[j] = ((const CVT*)s)[j];
#else
    #pragma unroll
    for (int u = 0; u < VW; ++u) p[j * VW + u] = s[j * VW + u];
#endif
}

// This thread's columns (vectors j = i * TPR + tid below nv) of the two column sums cg, cb: zeroed, or written as a
// partial row pg, pb (ln_bwds: the block's; ln_bwdc: the block's share of its cluster's).
__device__ __forceinline__ void zero_cols(C* cg, C* cb, int tid, int nv) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < nv) {
            #pragma unroll
            for (int u = 0; u < VW; ++u) { cg[j * VW + u] = 0; cb[j * VW + u] = 0; }
        }
    }
}

__device__ __forceinline__ void write_cols(const C* cg, const C* cb, C* pg, C* pb, int tid, int nv) {
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < nv) {
            copy_cols(cg, pg, j);
            copy_cols(cb, pb, j);
        }
    }
}
#endif

// One sweep a row: a group of TPR threads holds its row's vectors of x and dy in registers (read once), sums
// g = dy * gamma and g * xhat over the row (row_sum2), writes dx = rs (g - mean(g) - xhat mean(g xhat)) from the
// registers, and adds dy * xhat and dy to its columns' sums. With PF the loads of the group's next row are issued
// before this row's sums, barriers and stores (a second buffer of raw vectors). Rows are visited block by block,
// grid-stride (the same trip count block-wide); with a residual/bias, x's vector is summed as it is taken.
// Compiled with PARAMS 0 it is ln_dx1: dx alone, no column sums (the registers hold only the row); with SCOLS 1 it is
// ln_bwds: the column sums in shared memory (add_cols), one row a block.
extern "C" __global__ void ROW_BOUNDS LN_BWD1(const T* dy, const T* x, const C* gamma,
                                                                const C* mean, const C* rstd, T* dx, C* pg, C* pb,
                                                                long long R, int want_params, const T* res,
                                                                const C* bias) {
    __shared__ C sh[2 * RPB * NW];
    const int tid = threadIdx.x % TPR, grp = threadIdx.x / TPR;
    const long long stride = (long long)gridDim.x * RPB;
#if PARAMS && SCOLS
    extern __shared__ __align__(16) unsigned char cols_bytes[];
    C* const cg = (C*)cols_bytes;   // the column sums of dy xhat, then (cb) of dy
    C* const cb = cg + L;
    zero_cols(cg, cb, tid, LV);
#elif PARAMS
    C ag[ITEMS * VW], ab[ITEMS * VW];
    #pragma unroll
    for (int k = 0; k < ITEMS * VW; ++k) { ag[k] = 0; ab[k] = 0; }
#endif
    C gh[HOLD ? ITEMS * VW : 1], bh[HOLD && FUSED ? ITEMS * VW : 1];
#if HOLD
    hold_cols(gamma, tid, LV, gh);
#if FUSED
    hold_cols(bias, tid, LV, bh);
#endif
#endif
    VT bx[ITEMS], bd[ITEMS];
    C bmu, brs;
    long long row = (long long)blockIdx.x * RPB + grp;
    fetch(x, dy, mean, rstd, row, R, tid, bx, bd, bmu, brs);
    for (long long base = blockIdx.x; base * RPB < R; base += gridDim.x, row += stride) {
        const bool valid = row < R;
        const C mu = bmu, rs = brs;
        C xh[ITEMS * VW];
        VT dv[ITEMS];
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            const T* e = (const T*)&bx[i];
            #pragma unroll
            for (int u = 0; u < VW; ++u) xh[i * VW + u] = LOAD(e[u]);
#if FUSED
            if (valid && j < LV) {
                if (res) {
                    VT q = ((const VT*)(res + row * (long long)L))[j];
                    const T* f = (const T*)&q;
                    #pragma unroll
                    for (int u = 0; u < VW; ++u) xh[i * VW + u] += LOAD(f[u]);
                }
                if (bias) {
                    C c[VW];
                    cols_of(bias, bh, i, j, c);
                    #pragma unroll
                    for (int u = 0; u < VW; ++u) xh[i * VW + u] += c[u];
                }
            }
#endif
            #pragma unroll
            for (int u = 0; u < VW; ++u) xh[i * VW + u] = (xh[i * VW + u] - mu) * rs;
            dv[i] = bd[i];
        }
#if PF
        fetch(x, dy, mean, rstd, row + stride, R, tid, bx, bd, bmu, brs);
#endif
        C s1 = 0, s2 = 0;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (j < LV) {
                const T* e = (const T*)&dv[i];
                C gm[VW];
                if (gamma) cols_of(gamma, gh, i, j, gm);
#if PARAMS && SCOLS
                C th[VW], td[VW];
#endif
                #pragma unroll
                for (int u = 0; u < VW; ++u) {
                    const C d = LOAD(e[u]), h = xh[i * VW + u], g = gamma ? d * gm[u] : d;
                    s1 += g;
                    s2 += g * h;
#if PARAMS && SCOLS
                    th[u] = d * h;
                    td[u] = d;
#elif PARAMS
                    ag[i * VW + u] += d * h;
                    ab[i * VW + u] += d;
#endif
                }
#if PARAMS && SCOLS
                add_cols(cg, j, th);
                add_cols(cb, j, td);
#endif
            }
        }
        row_sum2(s1, s2, sh);
        const C m1 = s1 / (C)L, m2 = s2 / (C)L;
        if (valid) {
            #pragma unroll
            for (int i = 0; i < ITEMS; ++i) {
                const int j = i * TPR + tid;
                if (j < LV) {
                    const T* e = (const T*)&dv[i];
                    C gm[VW];
                    if (gamma) cols_of(gamma, gh, i, j, gm);
                    VT w;
                    T* o = (T*)&w;
                    #pragma unroll
                    for (int u = 0; u < VW; ++u) {
                        const C d = LOAD(e[u]), g = gamma ? d * gm[u] : d;
                        o[u] = STORE(rs * (g - m1 - xh[i * VW + u] * m2));
                    }
                    ((VT*)(dx + row * (long long)L))[j] = w;
                }
            }
        }
#if !PF
        fetch(x, dy, mean, rstd, row + stride, R, tid, bx, bd, bmu, brs);
#endif
    }
#if PARAMS && SCOLS
    if (want_params)   // each thread its own columns: the block's partial row blockIdx.x
        write_cols(cg, cb, pg + (long long)blockIdx.x * L, pb + (long long)blockIdx.x * L, tid, LV);
#elif PARAMS
    if (want_params) write_partials(ag, ab, pg, pb, tid, grp);
#endif
}

#if CLUSTER > 1
// ln_bwdc: ln_bwds for rows whose column sums or row values do not fit one block. A cluster of CLUSTER blocks
// (sm_90) takes a row, block `rank` its LC columns from rank * LC, holding its vectors of x and dy in registers and
// its columns' sums in shared memory; the row sums are the blocks' partial sums exchanged through distributed shared
// memory (each block writes its pair, one cluster barrier, every block adds the CLUSTER pairs in rank order, so all
// get the same bits). The pairs alternate between two slots by row, so a block rewrites a slot only after the next
// barrier, once every peer has read it. Clusters visit the rows cluster-stride, and each thread stages its vectors of
// the cluster's next row (x, dy, and the residual fused) in shared memory with cp.async as soon as it has taken this
// row's, so the next row's loads fly while this row's sums, barriers and stores run (the next row's statistics are
// read into registers likewise).
#define LC (L / CLUSTER)
#define LCV (LC / VW)
__device__ __forceinline__ unsigned cluster_reg(int which) {
    unsigned r;
    if (which == 0) asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    else if (which == 1) asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    else asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ float peer_load(const float* p, unsigned rank) {
    unsigned a;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(shared_address(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}

// This thread's vectors of the block's share of row `row` of x, dy (and the residual), staged; zeros past the rows.
__device__ __forceinline__ void stage_share(const T* x, const T* dy, const T* res, long long row, long long R,
                                            long long off, int tid, VT* sx, VT* sd, VT* sr) {
    const bool valid = row < R;
    const long long base = (valid ? row : 0) * (long long)L + off;   // in bounds even for a copy of no bytes
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int j = i * TPR + tid;
        if (j < LCV) {
            copy_async(sx + j, (const VT*)(x + base) + j, valid);
            copy_async(sd + j, (const VT*)(dy + base) + j, valid);
#if FUSED
            if (res) copy_async(sr + j, (const VT*)(res + base) + j, valid);
#endif
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(TPR, BWD_BLOCKS) ln_bwdc(
        const T* dy, const T* x, const C* gamma, const C* mean, const C* rstd, T* dx, C* pg, C* pb, long long R,
        int want_params, const T* res, const C* bias) {
    __shared__ C sh[2 * NW];
    __shared__ float pair[2][2];    // this block's (sum g, sum g xhat) of a row, by the row's parity
    extern __shared__ __align__(16) unsigned char cols_bytes[];
    C* const cg = (C*)cols_bytes;   // this block's columns' sums of dy xhat, then (cb) of dy
    C* const cb = cg + LC;
    VT* const sx = (VT*)(cb + LC);  // the next row's staged vectors of x, dy (and the residual)
    VT* const sd = sx + LCV;
    VT* const sr = sd + LCV;
    const int tid = threadIdx.x;
    const unsigned rank = cluster_reg(0);
    const long long off = (long long)rank * LC;   // this block's first column
    const long long stride = cluster_reg(2);
    const C* const gm_ = gamma ? gamma + off : nullptr;
    zero_cols(cg, cb, tid, LCV);
    C gh[ITEMS * VW], bh[FUSED ? ITEMS * VW : 1];
    hold_cols(gm_, tid, LCV, gh);
#if FUSED
    hold_cols(bias ? bias + off : nullptr, tid, LCV, bh);
#endif
    long long row = cluster_reg(1);
    stage_share(x, dy, res, row, R, off, tid, sx, sd, sr);
    C mu_next = row < R ? mean[row] : (C)0, rs_next = row < R ? rstd[row] : (C)0;
    int parity = 0;
    for (; row < R; row += stride, parity ^= 1) {
        const C mu = mu_next, rs = rs_next;
        const long long base = row * (long long)L + off;
        C xh[ITEMS * VW];
        VT dv[ITEMS];
        asm volatile("cp.async.wait_all;" ::: "memory");
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            const VT w = j < LCV ? sx[j] : vec_t{};
            dv[i] = j < LCV ? sd[j] : vec_t{};
            const T* e = (const T*)&w;
            #pragma unroll
            for (int u = 0; u < VW; ++u) xh[i * VW + u] = LOAD(e[u]);
#if FUSED
            if (res && j < LCV) {
                const VT q = sr[j];
                const T* f = (const T*)&q;
                #pragma unroll
                for (int u = 0; u < VW; ++u) xh[i * VW + u] += LOAD(f[u]);
            }
#endif
        }
        stage_share(x, dy, res, row + stride, R, off, tid, sx, sd, sr);   // this thread's slots are read: refill
        if (row + stride < R) { mu_next = mean[row + stride]; rs_next = rstd[row + stride]; }
        C s1 = 0, s2 = 0;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (j < LCV) {
#if FUSED
                if (bias) {
                    C c[VW];
                    cols_of(bias + off, bh, i, j, c);
                    #pragma unroll
                    for (int u = 0; u < VW; ++u) xh[i * VW + u] += c[u];
                }
#endif
                C gv[VW], th[VW], td[VW];
                if (gm_) cols_of(gm_, gh, i, j, gv);
                const T* ed = (const T*)&dv[i];
                #pragma unroll
                for (int u = 0; u < VW; ++u) {
                    const C h = (xh[i * VW + u] - mu) * rs, d = LOAD(ed[u]), g = gm_ ? d * gv[u] : d;
                    xh[i * VW + u] = h;
                    s1 += g;
                    s2 += g * h;
                    th[u] = d * h;
                    td[u] = d;
                }
                add_cols(cg, j, th);
                add_cols(cb, j, td);
            }
        }
        row_sum2(s1, s2, sh);
        if (tid == 0) { pair[parity][0] = s1; pair[parity][1] = s2; }
        cluster_barrier();
        s1 = 0;
        s2 = 0;
        for (unsigned q = 0; q < CLUSTER; ++q) {
            s1 += peer_load(&pair[parity][0], q);
            s2 += peer_load(&pair[parity][1], q);
        }
        const C m1 = s1 / (C)L, m2 = s2 / (C)L;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int j = i * TPR + tid;
            if (j < LCV) {
                C gv[VW];
                if (gm_) cols_of(gm_, gh, i, j, gv);
                const T* ed = (const T*)&dv[i];
                VT w;
                T* o = (T*)&w;
                #pragma unroll
                for (int u = 0; u < VW; ++u) {
                    const C d = LOAD(ed[u]), g = gm_ ? d * gv[u] : d;
                    o[u] = STORE(rs * (g - m1 - xh[i * VW + u] * m2));
                }
                ((VT*)(dx + base))[j] = w;
            }
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");   // the last (empty) copies land before the block's memory goes
    if (want_params) {   // each thread its own columns: the cluster's partial row
        const long long prow = (long long)cluster_reg(1) * L + off;
        write_cols(cg, cb, pg + prow, pb + prow, tid, LCV);
    }
    cluster_barrier();   // no block leaves while a peer may still read its pairs
}
#endif

// dgamma, dbeta: the P partial rows added per column in a fixed order; a block of 32 columns x PL row lanes, each
// lane summing every PL-th partial row from its own, then lane 0 the PL lanes' sums in order.
#define PL 16
extern "C" __global__ void __launch_bounds__(32 * PL) ln_params(const C* pg, const C* pb, long long P, C* dgamma,
                                                                C* dbeta) {
    __shared__ C s1[PL][33], s2[PL][33];
    const int cx = threadIdx.x % 32, ry = threadIdx.x / 32;
    const long long col = (long long)blockIdx.x * 32 + cx;
    C a = 0, b = 0;
    if (col < L) {
        #pragma unroll 4
        for (long long p = ry; p < P; p += PL) { a += pg[p * L + col]; b += pb[p * L + col]; }
    }
    s1[ry][cx] = a;
    s2[ry][cx] = b;
    __syncthreads();
    if (ry == 0 && col < L) {
        C ta = 0, tb = 0;
        for (int k = 0; k < PL; ++k) { ta += s1[k][cx]; tb += s2[k][cx]; }
        dgamma[col] = ta;
        dbeta[col] = tb;
    }
}

#if !PARAMS
// The split backward's column sums (the first level of dgamma, dbeta), apart from dx: block (bx, by) owns the 32
// vectors of columns from 32 bx (KVW columns each, a warp's 16-byte loads side by side along the row) and the rows
// [by rc, by rc + rc). Warp w of the block sums its lane's columns of dy * xhat and dy over the rows by rc + w,
// + CW, + 2 CW, ... in that order (xhat recomputed from x [+ res + bias], mean and rstd); the CW warps' sums are
// added in shared memory in a fixed order (warp 0, 1, ...) and written as partial row by; ln_params adds the partial
// rows. The order of every sum depends on (R, L, rc) alone.
#define KLV (L / KVW)
extern "C" __global__ void __launch_bounds__(32 * CW) ln_cols(const T* dy, const T* x, const C* mean, const C* rstd,
                                                             C* pg, C* pb, long long R, long long rc, const T* res,
                                                             const C* bias) {
    __shared__ C sg[CW][32 * KVW + 1], sb[CW][32 * KVW + 1];
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int j = blockIdx.x * 32 + lane;                     // vector index in the row
    const long long r0 = (long long)blockIdx.y * rc;
    const long long r1 = r0 + rc < R ? r0 + rc : R;
    C ag[KVW], ab[KVW];
    #pragma unroll
    for (int u = 0; u < KVW; ++u) { ag[u] = 0; ab[u] = 0; }
    if (j < KLV) {
#if FUSED
        C cb[KVW];
        #pragma unroll
        for (int u = 0; u < KVW; ++u) cb[u] = bias ? bias[j * KVW + u] : (C)0;
#endif
        #pragma unroll 4
        for (long long r = r0 + w; r < r1; r += CW) {
            const C mu = mean[r], rs = rstd[r];
            const KVT a = ((const KVT*)(x + r * (long long)L))[j];
            const KVT b = ((const KVT*)(dy + r * (long long)L))[j];
            const T* ea = (const T*)&a;
            const T* eb = (const T*)&b;
            C v[KVW];
            #pragma unroll
            for (int u = 0; u < KVW; ++u) v[u] = LOAD(ea[u]);
#if FUSED
            if (res) {
                const KVT q = ((const KVT*)(res + r * (long long)L))[j];
                const T* eq = (const T*)&q;
                #pragma unroll
                for (int u = 0; u < KVW; ++u) v[u] += LOAD(eq[u]);
            }
            #pragma unroll
            for (int u = 0; u < KVW; ++u) v[u] += cb[u];
#endif
            #pragma unroll
            for (int u = 0; u < KVW; ++u) {
                const C d = LOAD(eb[u]);
                ag[u] += d * ((v[u] - mu) * rs);
                ab[u] += d;
            }
        }
    }
    #pragma unroll
    for (int u = 0; u < KVW; ++u) { sg[w][lane * KVW + u] = ag[u]; sb[w][lane * KVW + u] = ab[u]; }
    __syncthreads();
    for (int c = threadIdx.x; c < 32 * KVW; c += 32 * CW) {
        const long long col = (long long)blockIdx.x * 32 * KVW + c;
        if (col < L) {
            C ta = 0, tb = 0;
            for (int q = 0; q < CW; ++q) { ta += sg[q][c]; tb += sb[q][c]; }
            pg[(long long)blockIdx.y * L + col] = ta;
            pb[(long long)blockIdx.y * L + col] = tb;
        }
    }
}
#endif   // !PARAMS
"""

# (vector type, elements), preferred first; a row takes the first its length divides. The halves load 8 bytes
# (4 values): with 16-byte uint4 loads, splitting the vector into 16-bit values cost the forward a third of its
# bandwidth on an H100 (56% of copy against 84%, measured).
_VECTORS = {"half": (("uint2", 4), ("unsigned int", 2)), np.dtype(np.float32): (("float4", 4), ("float2", 2)),
            np.dtype(np.float64): (("double2", 2),)}
# ln_cols' vectors: 16 bytes where the length allows (a warp reads 512 contiguous bytes of a row; no register
# pressure there, so the halves take 8 values a load).
_COLUMN_VECTORS = {"half": (("uint4", 8), ("uint2", 4), ("unsigned int", 2)),
                   np.dtype(np.float32): (("float4", 4), ("float2", 2)), np.dtype(np.float64): (("double2", 2),)}
_modules: dict = {}
_forward: dict = {}
_plans: dict = {}
_clusters: dict = {}
_launched: dict = {}
_occupancy: dict = {}
_sm: dict = {}


def _vector(dtype, length, table=_VECTORS):
    """``(vector type, elements)`` for rows of ``length`` values of ``dtype``, or ``("T", 1)``."""
    dtype = np.dtype(dtype)
    for vt, vw in table["half" if dtype.itemsize == 2 else dtype]:
        if length % vw == 0:
            return vt, vw
    return "T", 1


def _shape(length, dtype, max_items, min_tpr=32):
    """``(VW, TPR, ITEMS)``: the fewest threads a row (a multiple of 32, from ``min_tpr``) that hold its vectors in
    at most ``max_items`` vectors a thread, or None past :data:`MAX_THREADS`."""
    vw = _vector(dtype, length)[1]
    vectors = length // vw
    per_thread = -(-vectors // max_items)
    tpr = max(min_tpr, 32 * -(-per_thread // 32))
    if tpr > MAX_THREADS:
        return None
    return vw, tpr, -(-vectors // tpr)


def _blocks_an_sm(threads, regs, shared=0):
    """Blocks of ``threads`` threads, ``regs`` registers a thread and ``shared`` bytes of shared memory that an SM
    holds at once (sm_90: 64K registers allocated 256 a warp, 2,048 threads, 32 blocks, 228 KB of shared memory less
    1 KB a block), at least 1.

    >>> _blocks_an_sm(384, 56), _blocks_an_sm(512, 56), _blocks_an_sm(1024, 64, 64 * 1024)
    (3, 2, 1)
    """
    per_warp = -(-max(int(regs), 1) * 32 // 256) * 256
    return max(1, min(65536 // (per_warp * -(-threads // 32)), 2048 // threads, 32, (228 * 1024) // (shared + 1024)))


def _one_sweep_registers(dtype, vw, items, prefetch, params=True):
    """Registers a thread of ``ln_bwd1`` needs, by a conservative estimate: :data:`ONE_SWEEP_REGISTERS` a row
    value a thread holds (its two column sums, its xhat, its raw dy and, prefetching, the next row's raw x and dy)
    plus :data:`ONE_SWEEP_SPARE`; of ``ln_dx1`` (``params`` False: no column sums), :data:`DX_SWEEP_REGISTERS` a
    value plus :data:`DX_SWEEP_SPARE`. Fitted to ptxas's counts for sm_90 (NVRTC 13.5) at 2 to 32 values a thread;
    the GPU test reads the compiled kernels' local memory."""
    per, spare = (ONE_SWEEP_REGISTERS, ONE_SWEEP_SPARE) if params else (DX_SWEEP_REGISTERS, DX_SWEEP_SPARE)
    return int(np.ceil(per[np.dtype(dtype).itemsize][0 if prefetch else 1] * items * vw)) + spare


def _register_cap(threads):
    """The registers a thread may use in a block of ``threads`` (ptxas's cap under ``__launch_bounds__``: 64K an
    SM, warps allocated four at a time, a multiple of 8, at most 255)."""
    return min(255, 65536 // (128 * -(-threads // 128)) // 8 * 8)


def _one_sweep_plan(length, dtype, params, extra=0, held=0):
    """``(kernel, VW, TPR, RPB, ITEMS, PF)`` of the one sweep (``ln_bwd1``, or ``ln_dx1`` without ``params``) where
    a row's vectors of x and dy (and with ``params`` the column sums) fit in the registers of the threads that hold
    the row, else None: at most :data:`ONE_SWEEP_VALUES` (:data:`DX_SWEEP_VALUES`) values a thread (``ln_bwd1``: two
    warps a row where one would hold more than :data:`ONE_SWEEP_WARP_VALUES`), as many rows a block as the registers
    of an SM take, to at most 1,024 threads (``ln_bwd1`` of short rows: to :data:`ONE_SWEEP_BLOCK_THREADS`),
    prefetching the next row where that fits too;
    ``extra`` registers a thread on top of the estimate (``ln_bwds``' shared sums) and ``held`` a row value a thread
    (``ln_bwds``' and ``ln_bwdc``'s copies of gamma and the bias, :data:`HELD_REGISTERS`)."""
    c = 2 if dtype == np.float64 else 1
    values = (ONE_SWEEP_VALUES if params else DX_SWEEP_VALUES)[dtype.itemsize]
    if values == 0:
        return None
    vectors = values // _vector(dtype, length)[1]
    if not params:   # at most 8 vectors (ptxas spilled 8 bytes at 16 vectors of 2 halves, 13,090 fused)
        vectors = min(vectors, MAX_VECTORS)
    shape = _shape(length, dtype, max(1, vectors))
    if params and shape is not None and shape[1] == 32 and shape[0] * shape[2] > ONE_SWEEP_WARP_VALUES:
        shape = _shape(length, dtype, max(1, vectors), 64)
    while shape is not None:
        vw, tpr, items = shape
        for pf in (1, 0):
            regs = _one_sweep_registers(dtype, vw, items, pf, params) + extra + int(np.ceil(held * items * vw))
            if regs > _register_cap(tpr):
                continue
            rpb = max(1, MAX_THREADS // tpr)
            if params and tpr <= SHORT_ONE_SWEEP_THREADS:
                rpb = min(rpb, ONE_SWEEP_BLOCK_THREADS // tpr)
            margin = 0 if params else DX_SWEEP_MARGIN
            while rpb > 1 and (regs + margin > _register_cap(tpr * rpb) or (params and 8 * length * c > 40960)):
                rpb -= 1            # the registers of the block, its column sums in (static) shared memory
            return ("ln_bwd1" if params else "ln_dx1", vw, tpr, rpb, items, pf)
        shape = _shape(length, dtype, items - 1, tpr + 32) if items > 1 else None   # more threads, fewer values
    return None


def _shared_limit() -> int:
    """Bytes of shared memory a block of the current GPU may opt into (:data:`SM90_SHARED_BYTES` without one)."""
    if cupy is None:
        return SM90_SHARED_BYTES
    try:
        dev = cupy.cuda.Device().id
    except Exception:   # no GPU: plans are still asked for (doctests, the CPU's checks of shapes)
        return SM90_SHARED_BYTES
    limit = _sm.get(("shared", dev))
    if limit is None:
        limit = _sm[("shared", dev)] = int(cupy.cuda.Device(dev).attributes["MaxSharedMemoryPerBlockOptin"])
    return limit


def _shared_columns_bytes(length, dtype):
    """Dynamic shared memory of ``ln_bwds``: the two column sums, ``2 L`` values of the compute type."""
    return 2 * int(length) * compute_dtype(dtype).itemsize


def _shared_sweep_plan(length, dtype, limit, fused, hold=True):
    """``("ln_bwds", VW, TPR, 1, ITEMS, PF)`` where :data:`SHARED_COLUMNS` allows it, the column sums fit in
    ``limit`` bytes of shared memory (less 1 KB for the row sums' static array) and ``ln_dx1`` takes the row in
    registers with :data:`SHARED_SPARE` more a thread (and :data:`FUSED_SHARED_SPARE` more for the ``fused`` form),
    in the shape of :func:`_one_sweep_plan`, one row a block, with its copies of gamma's values of the thread's columns
    (and the bias's, fused) besides (:data:`HELD_REGISTERS`); without ``hold``, ``("ln_bwdr", ...)``, the same kernel
    reading gamma (and the bias) twice a row instead of holding them."""
    if not SHARED_COLUMNS[dtype.itemsize] or _shared_columns_bytes(length, dtype) > limit - 1024:
        return None
    extra, held = _shared_sweep_spares(dtype, fused)
    dx = _one_sweep_plan(length, dtype, False, extra, held if hold else 0)
    return None if dx is None else ("ln_bwds" if hold else "ln_bwdr",) + dx[1:3] + (1,) + dx[4:]


def _shared_sweep_spares(dtype, fused):
    """``(extra, held)`` of :func:`_one_sweep_plan` for ``ln_bwds`` and ``ln_bwdc``: registers a thread beyond
    ``ln_dx1``'s estimate (the shared sums' addresses), and a row value a thread (the copies of gamma and the bias)."""
    return (SHARED_SPARE + (FUSED_SHARED_SPARE if fused else 0),
            HELD_REGISTERS[dtype.itemsize] * (2 if fused else 1))


def _shared_sweep_registers(dtype, vw, items, fused):
    """Registers a thread of ``ln_bwdc`` (``ln_bwds`` without prefetching) of ``items`` vectors of ``vw`` values
    needs, as :func:`_shared_sweep_plan` estimates them.

    >>> _shared_sweep_registers(np.dtype(np.float16), 4, 8, False)
    108
    """
    extra, held = _shared_sweep_spares(dtype, fused)
    return _one_sweep_registers(dtype, vw, items, False, False) + extra + int(np.ceil(held * items * vw))


def _cluster_split(length, dtype, limit, fused):
    """``(CS, plan of a block's share, blocks an SM)`` of ``ln_bwdc``, or None, where :data:`CLUSTER_COLUMNS` allows
    it and the GPU has clusters. The candidates: each number of blocks a cluster, 2, 4 or 8, such that a block's
    share of the row, ``length / CS`` values, is whole vectors of the row's vector width and takes ``ln_bwds``
    (:func:`_shared_sweep_plan`), with each number of blocks an SM in :data:`CLUSTER_BLOCKS` that the SM holds
    (the shares' column sums and staged next rows in ``limit`` bytes, less 1 KB a block; threads; the registers
    :func:`_shared_sweep_registers` estimates, under ptxas's cap for that many). Of those, the most threads an SM
    (the more loads in flight while a row waits at its barriers), ties to the earlier blocks an SM in
    :data:`CLUSTER_BLOCKS`, then to fewer blocks a cluster; held to that many blocks an SM.

    >>> _cluster_split(32768, np.dtype(np.float16), SM90_SHARED_BYTES, False)[::2]
    (4, 2)
    >>> _cluster_split(20480, np.dtype(np.float16), SM90_SHARED_BYTES, False)[::2]
    (4, 3)
    >>> _cluster_split(26624, np.dtype(np.float16), SM90_SHARED_BYTES, True)[::2]
    (8, 4)
    >>> _cluster_split(32768, np.dtype(np.float32), SM90_SHARED_BYTES, False)[::2]
    (4, 1)
    """
    if not CLUSTER_COLUMNS[dtype.itemsize] or not _has_clusters():
        return None
    vw, order, best, best_key = _vector(dtype, length)[1], CLUSTER_BLOCKS[dtype.itemsize], None, None
    for cs in (2, 4, 8):
        share, nbytes = length // cs, _backward_shared_bytes(length, dtype, "ln_bwdc", cs, fused)
        if length % (cs * vw) or _vector(dtype, share)[1] != vw or nbytes > limit - 1024:
            continue
        sub = _shared_sweep_plan(share, dtype, limit, fused)
        if sub is None:
            continue
        threads, regs = sub[2], _shared_sweep_registers(dtype, sub[1], sub[4], fused)
        for rank, want in enumerate(order):
            # ptxas's cap under __launch_bounds__(threads, want), not the occupancy of _blocks_an_sm (warps counted
            # one at a time): the estimate must fit the cap the kernel is compiled to
            if want > 1 and (want * (nbytes + 1024) > limit + 1024 or want * threads > 2048
                             or regs > _register_cap(want * threads)):
                continue
            key = (want * threads, -rank, -cs)
            if best_key is None or key > best_key:
                best, best_key = (cs, sub, want), key
    return best


def _cluster_shape(length, dtype, fused):
    """``(CS, blocks an SM)`` of ``ln_bwdc`` for these rows (:func:`_cluster_split`), cached: each launch asks it."""
    key = (np.dtype(dtype), int(length), bool(fused), _shared_limit())
    shape = _clusters.get(key)
    if shape is None:
        shape = _clusters[key] = _cluster_split(length, dtype, _shared_limit(), fused)[::2]
    return shape


def _backward_shared_bytes(length, dtype, name, cs=1, fused=False):
    """Dynamic shared memory of the backward kernel ``name``: ``ln_bwds``' and ``ln_bwdr``'s column sums (``2 L``
    compute values); ``ln_bwdc``'s for its block's share of the row (``length / cs`` values) and that share of the
    next row, staged (x and dy, and the residual ``fused``); none for the others."""
    if name in ("ln_bwds", "ln_bwdr"):
        return _shared_columns_bytes(length, dtype)
    if name == "ln_bwdc":
        share = length // cs
        return _shared_columns_bytes(share, dtype) + share * np.dtype(dtype).itemsize * (3 if fused else 2)
    return 0


def _on_gpu() -> bool:
    """Whether a GPU is there to compile for (the compiled kernels decide :func:`_launch_plan`; without one, plans are
    still asked for: doctests, the CPU's checks of shapes). Asked once a process: each backward call needs it."""
    found = _sm.get("on_gpu")
    if found is None:
        try:
            found = cupy is not None and cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            found = False
        _sm["on_gpu"] = found
    return found


def _has_clusters() -> bool:
    """Whether the current GPU launches thread-block clusters (compute capability 9.0 or later; True where no GPU is
    asked, as :func:`_shared_limit` assumes sm_90)."""
    if cupy is None:
        return True
    try:
        dev = cupy.cuda.Device()
        return int(dev.compute_capability) >= 90
    except Exception:
        return True


def _plan(length: int, dtype, fused: bool = False):
    """``(kernel, VW, TPR, RPB, ITEMS, PF)`` of the backward for rows of ``length`` values of ``dtype`` (of the
    ``x + residual + bias`` form where ``fused``), or None.

    ``ln_bwd1`` (one sweep, dx and the column sums) wherever it fits (:func:`_one_sweep_plan`); else ``ln_bwds``
    (one sweep, the column sums in shared memory) where those fit (:func:`_shared_sweep_plan`); else ``ln_bwdc``
    (the same by a cluster of blocks a row, :func:`_cluster_split`; its TPR and ITEMS are a block's); else ``ln_bwdr``
    (``ln_bwds`` without its copy of gamma, read twice a row instead); else the two-sweep ``ln_bwd``
    (:data:`MAX_VALUES` column sums a thread) with ``PF`` 0 where its column sums fit in registers and
    the row is shorter than :data:`SPLIT_FROM`; else the split backward: dx alone, in one sweep (``ln_dx1``) where
    the row fits in registers, else in two (``ln_dx2``, the forward's shape), then ``ln_cols`` for the column sums.
    None only where the forward turns the rows down (more than 1,024 threads of 8 vectors).
    """
    dtype, length = np.dtype(dtype), int(length)
    split_from, limit = SPLIT_FROM[dtype.itemsize], _shared_limit()
    key = (dtype, length, split_from, SHARED_COLUMNS[dtype.itemsize], CLUSTER_COLUMNS[dtype.itemsize], limit,
           _has_clusters(), bool(fused))
    if key in _plans:
        return _plans[key]
    plan = _one_sweep_plan(length, dtype, True) or _shared_sweep_plan(length, dtype, limit, fused)
    # The composite runs where the forward's does not. ln_bwdc before the split backward, which moves 5 N L s bytes to
    # its 3: with gamma held (HELD_REGISTERS), on the H200, float16 24,576 403 us against ln_dx1's 493, float32 20,480
    # 486 against 803 (before, reading gamma twice a row, it lost to ln_dx1: 715 against 493 at 24,576 halves).
    if plan is None and launch_shape(length, dtype) is not None:
        split = _cluster_split(length, dtype, limit, fused)
        if split is not None:   # a block's share of the row: its vector width, threads and vectors a thread
            plan = ("ln_bwdc",) + split[1][1:3] + (1,) + split[1][4:5] + (0,)
    # ln_bwdr (ln_bwds reading gamma twice a row) where the copy of gamma does not fit and no cluster takes the row
    # (it splits into no cluster's whole vectors), before the split backward, which rereads x and dy. H200, 8192
    # rows, split -> ln_bwdr: float16 16,388 375.6 -> 298.0 us, 20,476 473.2 -> 383.4; float32 16,380 654.9 -> 427.5;
    # fused float16 16,388 715.4 -> 529.2, float32 12,292 860.8 -> 598.8. Not before ln_bwdc, which won at float16
    # 16,896 (257 against 283 us) and lost at 18,432 (322 against 301).
    if plan is None and launch_shape(length, dtype) is not None:
        plan = _shared_sweep_plan(length, dtype, limit, fused, hold=False)
    if plan is None:
        two = launch_shape(length, dtype, "backward")
        wide = _doubling_shape(length, dtype, True)
        if two is not None and _two_sweep_fits(length, dtype) and (split_from is None or length < split_from):
            plan = ("ln_bwd",) + two + (0,)
        elif wide is not None:
            plan = _one_sweep_plan(length, dtype, False) or ("ln_dx2",) + wide + (0,)
    _plans[key] = plan
    return plan


def launch_shape(length: int, dtype, direction: str = "forward", fused: bool = False
                 ) -> tuple[int, int, int, int] | None:
    """``(VW, TPR, RPB, ITEMS)`` for rows of ``length`` values of ``dtype``: elements per vector (16 bytes where
    the length allows, else 8 or 4 bytes, else 1), threads per row (the fewest, doubling from a warp, that hold the
    row in at most :data:`SHORT_ROW_VECTORS` vectors a thread up to :data:`SHORT_ROW_THREADS` threads and at most
    :data:`MAX_VECTORS` past that forward, :data:`MAX_VALUES` values in the two-sweep backward, where a thread also
    keeps its columns' sums), rows per block (:data:`FORWARD_BLOCK_THREADS` threads a block forward, 256 in the
    two-sweep backward, at least one row) and vectors per thread; None where a row needs more than ``MAX_THREADS``
    threads. The backward runs the shape of :func:`_plan`
    (``direction="backward"`` is the two-sweep kernel's shape; :func:`backward_shape` the one it runs).

    >>> launch_shape(768, np.float32), launch_shape(20480, np.float32), launch_shape(5140, np.float32)
    ((4, 64, 2, 3), (4, 1024, 1, 5), (4, 256, 1, 6))
    """
    shape = _forward_shape(length, dtype, fused) if direction == "forward" else _doubling_shape(length, dtype, False)
    return None if shape is None else shape[:4]


def _doubling_shape(length, dtype, forward):
    """``(VW, TPR, RPB, ITEMS)`` by doubling the threads a row from a warp (:func:`launch_shape`'s rule for short
    rows forward and for the two-sweep backward), or None past :data:`MAX_THREADS`."""
    dtype = np.dtype(dtype)
    vw = _vector(dtype, length)[1]
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
    return vw, tpr, max(1, block // tpr), -(-vectors // tpr)


def _forward_shape(length, dtype, fused=False):
    """``(VW, TPR, RPB, ITEMS, blocks an SM asked of ptxas)`` of ``ln_fwd``: the doubling rule's shape (and 1) where
    an SM holds :data:`FORWARD_MIN_ROWS` of its rows at once or no other shape holds more, and for short rows,
    the ``fused`` form, float32 and float64; else the shape that holds the most rows an SM at once
    (:data:`MAX_FORWARD_ITEMS`, :data:`FORWARD_SPARE`) and that many blocks. None where the rows are turned down.

    >>> _forward_shape(4096, np.float16), _forward_shape(12288, np.float16), _forward_shape(20480, np.float16)
    ((4, 256, 1, 4, 1), (4, 384, 1, 8, 3), (4, 512, 1, 10, 2))
    >>> _forward_shape(32768, np.float16), _forward_shape(12288, np.float32)
    ((4, 1024, 1, 8, 1), (4, 512, 1, 6, 1))
    """
    dtype = np.dtype(dtype)
    shape = _doubling_shape(length, dtype, True)
    spare = FORWARD_SPARE[dtype.itemsize]
    if (shape is None or shape[1] < SHORT_ROW_THREADS or spare is None or shape[0] * dtype.itemsize != 8
            or fused):
        return None if shape is None else shape + (1,)
    vw, vectors = shape[0], length // shape[0]
    held, best = _blocks_an_sm(shape[1], shape[3] * vw + spare), shape + (1,)
    if held >= FORWARD_MIN_ROWS:
        return best
    for most in range(-(-vectors // MAX_THREADS), MAX_FORWARD_ITEMS + 1):   # vectors a thread, at most
        threads = -(-vectors // most)
        tpr = max(FORWARD_BLOCK_THREADS, 32 * -(-threads // 32))
        items = -(-vectors // tpr)
        blocks = _blocks_an_sm(tpr, items * vw + spare)
        if blocks > held:   # a tie keeps the fewer vectors a thread
            held, best = blocks, (vw, tpr, 1, items, blocks)
    return best


def backward_shape(length: int, dtype, fused: bool = False):
    """``(kernel, VW, TPR, RPB, ITEMS, PF)``: what :func:`layernorm_backward` runs for rows of ``length`` values of
    ``dtype`` (of ``x + residual + bias`` where ``fused``): ``ln_bwd1``, one sweep, ``PF`` 1 when it prefetches the
    next row; ``ln_bwds``, one sweep with the column sums in shared memory (``ln_bwdr``: reading gamma twice a row
    where the copy ``ln_bwds`` holds does not fit); ``ln_bwdc``, the same by a cluster of blocks a row (TPR and
    ITEMS a block's); ``ln_bwd``, two sweeps; the split backward, dx alone then ``ln_cols``:
    ``ln_dx1`` in one sweep, ``ln_dx2`` in two; or None (the forward turns the rows down, and the composite runs).
    On a GPU the plan follows its shared memory and whether it has clusters (here, with none: sm_90's), and
    ``ln_bwd1`` of the halves may run in a two-block form where ptxas fits one (:data:`BACKWARD_TWO_BLOCKS`).

    >>> backward_shape(768, np.float16)[0], backward_shape(12288, np.float16)[0], backward_shape(32768, np.float32)[0]
    ('ln_bwd1', 'ln_bwds', 'ln_bwdc')
    >>> backward_shape(20480, np.float32), backward_shape(16388, np.float16)[0], backward_shape(20484, np.float32)[0]
    (('ln_bwdc', 4, 320, 1, 8, 0), 'ln_bwdr', 'ln_dx2')
    """
    return _launch_plan(length, dtype, fused)[0]


def _forward_prefetches(length: int, dtype, fused: bool = False) -> bool:
    """Whether ``ln_fwd`` visits the rows grid-stride, loading the next row before this row's sums: for the short
    rows (fewer than :data:`SHORT_ROW_THREADS` threads a row) of less than :data:`SHORT_ROW_PREFETCH_BYTES` where
    :data:`SHORT_ROW_PREFETCH` says so; for the
    halves where a row takes a whole block of :data:`MAX_THREADS` threads (H200, float16, 20,480 values: 264 -> 190
    us) and the next row's raw vectors (and the residual's, fused) fit beside the row's values
    (:data:`FORWARD_PREFETCH_WORDS`). Not float32's long rows (2% at 20,480; its unpacked raw vectors spilled at
    16,640).

    >>> [_forward_prefetches(n, np.float16) for n in (1024, 2048, 4096, 24576, 32768)]
    [True, False, False, True, False]
    >>> [_forward_prefetches(768, t) for t in (np.float32, np.float64)], _forward_prefetches(24576, np.float32)
    ([True, False], False)
    """
    shape = launch_shape(length, dtype, fused=fused)
    if shape is not None and shape[1] < SHORT_ROW_THREADS:
        size = np.dtype(dtype).itemsize
        return SHORT_ROW_PREFETCH[size] and length * size < SHORT_ROW_PREFETCH_BYTES
    if shape is None or shape[1] < MAX_THREADS or np.dtype(dtype).itemsize != 2:
        return False
    vw, _, _, items = shape
    return items * vw + items * vw // 2 * (2 if fused else 1) <= FORWARD_PREFETCH_WORDS


def _forward_stages(length: int, dtype, fused: bool = False) -> int:
    """The rows ``ln_fwd`` stages ahead in shared memory (``SPF``), 1 or 0: 1 where a row takes a whole block of
    :data:`MAX_THREADS` threads, :func:`_forward_prefetches` does not hold the next row in registers,
    :data:`STAGED_FORWARD` allows it, a vector is 4, 8 or 16 bytes (what ``cp.async`` copies) and the row (and the
    residual's, fused) fits a block's shared memory (:func:`_forward_kernel` may take 2 or 0).

    >>> [_forward_stages(n, np.float16) for n in (4096, 24576, 32768)], _forward_stages(32768, np.float16, True)
    ([0, 0, 1], 1)
    """
    dtype = np.dtype(dtype)
    shape = launch_shape(length, dtype, fused=fused)
    if (shape is None or shape[1] < MAX_THREADS or not STAGED_FORWARD[dtype.itemsize]
            or _forward_prefetches(length, dtype, fused) or shape[0] * dtype.itemsize not in (4, 8, 16)):
        return 0
    return int(_staged_bytes(length, dtype, fused) <= _shared_limit() - 1024)


def _staged_bytes(length, dtype, fused):
    """Shared memory of a row the forward stages: a row of x (and of the residual, fused)."""
    return int(length) * np.dtype(dtype).itemsize * (2 if fused else 1)


def _splits(plan) -> bool:
    """Whether ``plan`` is the split backward (dx alone, the column sums by ``ln_cols``)."""
    return plan is not None and plan[0].startswith("ln_dx")


def column_shape(length: int, dtype, rows: int) -> tuple[int, int, int, int]:
    """``(KVW, tiles, rc, chunks)`` of ``ln_cols`` for ``rows`` rows of ``length`` values of ``dtype``: values a
    vector (16 bytes where the length allows), tiles of 32 vectors of columns, rows a chunk (a multiple of
    :data:`COLUMN_WARPS`, at least :data:`COLUMN_MIN_ROWS`, so that tiles x chunks is near :data:`COLUMN_BLOCKS`)
    and chunks (the partial rows ``ln_params`` adds). A function of the shape alone, never of the device.

    >>> column_shape(20480, np.float32, 8192), column_shape(20480, np.float16, 8192)
    ((4, 160, 320, 26), (8, 80, 160, 52))
    """
    kvw = _vector(dtype, length, _COLUMN_VECTORS)[1]
    tiles = -(-(length // kvw) // 32)
    rc = max(COLUMN_MIN_ROWS, -(-rows * tiles // COLUMN_BLOCKS))
    rc = COLUMN_WARPS * -(-rc // COLUMN_WARPS)
    return kvw, tiles, rc, -(-rows // rc)


def _source(dtype, length, direction="forward", fused=False, stages=0, blocks=1, plan=None):
    """The CUDA source of the kernels for rows of ``length`` values of ``dtype``: ``forward`` (``ln_fwd``, staging
    ``stages`` rows ahead, ptxas held to ``blocks`` blocks an SM) or ``backward`` (the kernel of ``plan``, by
    default :func:`_plan`'s, held to ``blocks`` blocks an SM, ``ln_cols`` for the split backward, and
    ``ln_params``); ``fused``: with the code that adds a residual and a bias (kept out of the plain kernels)."""
    dtype = np.dtype(dtype)
    params, scols, spf, cluster, hold = 1, 0, 0, 1, 0
    if direction == "forward":
        vw, tpr, rpb, items = launch_shape(length, dtype, fused=fused)
        pf = int(_forward_prefetches(length, dtype, fused))
        spf = int(stages > 0)
    else:
        plan = plan or _plan(length, dtype, fused)
        _, vw, tpr, rpb, items, pf = plan
        params = 0 if _splits(plan) else 1
        scols = int(plan[0] in ("ln_bwds", "ln_bwdr"))
        hold = int(plan[0] in ("ln_bwds", "ln_bwdc"))
        if plan[0] == "ln_bwdc":
            cluster = _cluster_shape(length, dtype, fused)[0]
    vt = _vector(dtype, length)[0]
    kvt, kvw = _vector(dtype, length, _COLUMN_VECTORS)
    cvt = {(4, 4): "float4", (4, 2): "float2", (8, 2): "double2"}.get((compute_dtype(dtype).itemsize, vw))
    head = (prelude(dtype) + f"#define L {length}\n#define VW {vw}\n#define VT {vt}\n#define TPR {tpr}\n"
            f"#define RPB {rpb}\n#define ITEMS {items}\n#define PF {pf}\n#define SPF {spf}\n"
            f"#define FWD_BLOCKS {blocks}\n#define BWD_BLOCKS {blocks if direction == 'backward' else 1}\n"
            f"#define STAGES {max(stages, 1)}\n"
            f"#define FUSED {int(bool(fused))}\n"
            f"#define PARAMS {params}\n#define SCOLS {scols}\n#define CLUSTER {cluster}\n#define HOLD {hold}\n"
            f"#define KVW {kvw}\n#define KVT {kvt}\n"
            f"#define CW {COLUMN_WARPS}\n"
            + (f"#define CVT {cvt}\n" if cvt else ""))
    return head + _SOURCE


def _module(dtype, length, direction="forward", fused=False, stages=0, blocks=1, plan=None):
    """The compiled module of :func:`_source` (cached). The backward's ``plan`` and ``blocks`` are, by default, what
    :func:`_launch_plan` says runs."""
    if direction == "backward" and plan is None:
        plan, blocks = _launch_plan(length, dtype, fused)
    key = (np.dtype(dtype), int(length), direction, bool(fused), plan if direction == "backward" else stages, blocks)
    mod = _modules.get(key)
    if mod is None:
        mod = _modules[key] = cupy.RawModule(code=_source(dtype, length, direction, fused, stages, blocks, plan),
                                             options=("--std=c++14",))
    return mod


def _launch_plan(length, dtype, fused=False):
    """``(plan, blocks)``: the backward that runs, :func:`_plan`'s held to one block an SM (``ln_bwdc``: to the
    blocks an SM :func:`_cluster_split` chose), or on a GPU where :data:`BACKWARD_TWO_BLOCKS` allows it and ptxas fits
    one, a two-block form of ``ln_bwd1`` (:func:`_two_block_plan`; cached)."""
    dtype, length = np.dtype(dtype), int(length)
    plan = _plan(length, dtype, fused)
    if plan is not None and plan[0] == "ln_bwdc":
        return plan, _cluster_shape(length, dtype, fused)[1]
    if plan is None or plan[0] != "ln_bwd1" or not BACKWARD_TWO_BLOCKS[dtype.itemsize] or not _on_gpu():
        return plan, 1
    key = (dtype, length, bool(fused), cupy.cuda.Device().id, plan)
    got = _launched.get(key)
    if got is None:
        got = _launched[key] = _two_block_plan(dtype, length, fused, plan) or (plan, 1)
    return got


def _two_block_forms(plan, length):
    """The two-block forms of ``ln_bwd1`` that :func:`_two_block_plan` tries, in order: a row a block in fewer
    threads with more values each (the registers a thread needs beyond its values are then shared by more of them),
    from one more vector a thread than ``plan`` to :data:`MAX_VALUES` values, each thread count once.

    >>> _two_block_forms(("ln_bwd1", 4, 352, 1, 4, 1), 5140)[:3]
    [('ln_bwd1', 4, 288, 1, 5, 1), ('ln_bwd1', 4, 224, 1, 6, 1), ('ln_bwd1', 4, 192, 1, 7, 1)]
    """
    name, vw, _, _, items, pf = plan
    vectors, forms = -(-length // vw), []
    for more in range(items + 1, MAX_VALUES // vw + 1):
        threads = 32 * -(-vectors // (32 * more))   # whole warps
        if all(form[2] != threads for form in forms):
            forms.append((name, vw, threads, 1, more, pf))
    return forms


def _two_block_plan(dtype, length, fused, plan):
    """``(form, 2)``: ``ln_bwd1`` in the first of :func:`_two_block_forms` that ptxas compiles without spilling under
    ``__launch_bounds__(threads, 2)``, where the compiled ``plan`` holds fewer than two rows an SM; else None. The
    register estimate of :func:`_one_sweep_plan` is not asked (it turns these forms down): the compiled kernel is."""
    fn = _module(dtype, length, "backward", fused, plan=plan).get_function(plan[0])
    if plan[3] * _blocks_an_sm(plan[2] * plan[3], fn.num_regs, fn.shared_size_bytes) >= 2:
        return None
    for form in _two_block_forms(plan, length):
        fn = _module(dtype, length, "backward", fused, blocks=2, plan=form).get_function(form[0])
        if fn.local_size_bytes == 0 and _blocks_an_sm(form[2], fn.num_regs, fn.shared_size_bytes) >= 2:
            return form, 2
    return None


def _forward_kernel(dtype, length, fused=False):
    """``(ln_fwd, (VW, TPR, RPB, ITEMS), stages, prefetches)``: the forward compiled for rows of ``length`` values
    of ``dtype`` (cached with its shape, so that a launch asks no rule again), the first of its forms
    that ptxas compiles without spilling (local memory): staging the rows ahead that :func:`_forward_stages` says,
    held to the blocks an SM that :func:`_forward_shape` chose, then a block fewer at a time; staging two rows
    ahead where they fit, then none (:data:`STAGED_FORWARD`); the last form runs whatever ptxas did (the GPU tests
    read every kernel's local memory)."""
    key = (np.dtype(dtype), int(length), bool(fused), _shared_limit())
    got = _forward.get(key)
    if got is None:
        stages, blocks = _forward_stages(length, dtype, fused), _forward_shape(length, dtype, fused)[4]
        forms = [(stages, b) for b in range(blocks, 0, -1)]
        if stages:
            two = 2 * _staged_bytes(length, dtype, fused) <= _shared_limit() - 1024
            forms += [(2, 1)] * two + [(0, 1)]
        for stages, blocks in forms:
            fn = _module(dtype, length, "forward", fused, stages, blocks).get_function("ln_fwd")
            if fn.local_size_bytes == 0:
                break
        got = _forward[key] = (fn, launch_shape(length, dtype, fused=fused), stages,
                               _forward_prefetches(length, dtype, fused))
    return got


def kernel_attributes(dtype, length: int, fused: bool = False) -> dict:
    """``{kernel: (registers, local bytes)}`` of the compiled kernels that run for rows of ``length`` values of
    ``dtype``: ``ln_fwd``, and the backward's (``ln_bwd1``, ``ln_bwds``, ``ln_bwdr``, ``ln_bwdc`` or ``ln_bwd``; or
    ``ln_dx1`` or ``ln_dx2`` and ``ln_cols``; and ``ln_params``) where the backward kernels take the rows (local
    bytes above 0 would mean register spills); ``fused``: the kernels of the ``x + residual + bias`` form (none
    where :func:`_fused_fits` turns the rows down).

    >>> kernel_attributes.__name__
    'kernel_attributes'
    """
    out = {}
    dtype, length = np.dtype(dtype), int(length)
    if fused and not _fused_fits(length, dtype):
        return out
    kernels = []
    if launch_shape(length, dtype) is not None:
        kernels.append(("ln_fwd", _forward_kernel(dtype, length, fused)[0]))
    plan = backward_shape(length, dtype, fused)
    if plan is not None:
        names = [plan[0]] + (["ln_cols"] if _splits(plan) else []) + ["ln_params"]
        kernels += [(name, _module(dtype, length, "backward", fused).get_function(name)) for name in names]
    for name, f in kernels:
        out[name] = (f.num_regs, f.local_size_bytes)
    return out


def _blocks_per_sm(key, fn, threads, dynamic_shared=0):
    """Blocks of ``threads`` threads of ``fn`` (cached under ``key``) that an SM holds at once (registers, threads,
    shared memory, with ``dynamic_shared`` bytes a block)."""
    n = _occupancy.get(key)
    if n is None:
        shared = int(getattr(fn, "shared_size_bytes", 0) or 0) + dynamic_shared
        n = _occupancy[key] = _blocks_an_sm(threads, fn.num_regs, shared)
    return n


CLUSTER_QUERY: dict = {}
"""The last ``cuOccupancyMaxActiveClusters`` call's outcome (``"status"``: its CUresult, or the error that kept it
from being made): the GPU tests read it (on the H200 in the seventh session the query failed, so the launcher fell
back to half the SMs' worth of clusters)."""


def _active_clusters(fn, cs, threads, shared, key):
    """Clusters of ``cs`` blocks of ``fn`` the GPU runs at once (``cuOccupancyMaxActiveClusters``, cached under
    ``key``): ``ln_bwdc`` gives each cluster a fixed share of the rows, so a cluster left to a second wave would
    double the time; where the driver cannot say, half the SMs' worth (one wave whatever the GPCs' sizes)."""
    n = _occupancy.get(("clusters",) + key)
    if n is None:
        n = _driver_active_clusters(fn, cs, threads, shared)
        if n is None or n < 1:
            n = max(1, _sm_count(cupy.cuda.Device().id) // (2 * cs))
        _occupancy[("clusters",) + key] = n
    return n


def _driver_active_clusters(fn, cs, threads, shared):
    import ctypes

    class LaunchConfig(ctypes.Structure):   # CUlaunchConfig
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int(0)
        config = LaunchConfig((ctypes.c_uint * 3)(cs, 1, 1), (ctypes.c_uint * 3)(threads, 1, 1), shared, None, None,
                              0)
        function = ctypes.c_void_p(fn.kernel.ptr)   # RawKernel.kernel: its cupy.cuda.Function (the CUfunction)
        status = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), function, ctypes.byref(config))
    except (OSError, AttributeError) as e:
        CLUSTER_QUERY["status"] = repr(e)
        return None
    CLUSTER_QUERY["status"] = int(status)   # a CUresult: 0 is success
    return n.value if status == 0 else None


def _sm_count(dev):
    sm = _sm.get(dev)
    if sm is None:
        sm = _sm[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
    return sm


def _rows(x, k):
    length = int(np.prod(x.shape[x.ndim - k:], dtype=np.int64))
    return x.size // max(length, 1), length


def supports(x, gamma, beta, k, eps, residual=None, bias=None) -> bool:
    """CuPy float16/bfloat16/float32/float64 ``x`` normalised over its last ``k`` axes, ``gamma``/``beta``/``bias``
    None or arrays of those axes' shape in the compute type, ``residual`` None or like ``x``, rows short enough for
    :func:`launch_shape` (and for :func:`_fused_fits` with a residual or bias). Any strides: an array that is not
    C-contiguous and 16-byte aligned is copied so first (:func:`_readable`; a transposed view, as a ConvNeXt block's
    channels-last layer norm reads)."""
    if cupy is None or type(x) is not cupy.ndarray or x.dtype not in KERNEL_DTYPES:
        return False
    if not 1 <= k <= x.ndim or x.size == 0:
        return False
    if residual is not None and (type(residual) is not cupy.ndarray or residual.dtype != x.dtype
                                 or residual.shape != x.shape):
        return False
    shape, cdt = x.shape[x.ndim - k:], compute_dtype(x.dtype)
    for p in (gamma, beta, bias):
        if p is not None and (type(p) is not cupy.ndarray or p.shape != shape or p.dtype != cdt):
            return False
    rows, length = _rows(x, k)
    fused = residual is not None or bias is not None
    return (length >= 2 and rows < 2**31 and launch_shape(length, x.dtype) is not None
            and (not fused or _fused_fits(length, x.dtype)))


def _fused_fits(length: int, dtype) -> bool:
    """Whether the fused ``x + residual + bias`` kernels take rows of ``length`` values of ``dtype``: not float64
    rows of more than 6 vectors a thread at 1,024 threads (12,289 to 16,384 values), where the H200's NVRTC spilled
    16 bytes of the forward (64 registers a thread); the composite runs them.

    >>> _fused_fits(12288, np.float64), _fused_fits(12800, np.float64), _fused_fits(32768, np.float16)
    (True, False, True)
    """
    shape = launch_shape(length, dtype)
    return shape is not None and not (np.dtype(dtype) == np.float64 and shape[1] == MAX_THREADS and shape[3] > 6)


def backward_fits(length: int, dtype) -> bool:
    """Whether a backward kernel takes rows of ``length`` values of ``dtype`` (:func:`backward_shape`): every row
    the forward takes (the split backward has no per-thread column sums to fit); else the composite runs.

    >>> backward_fits(768, np.float32), backward_fits(20480, np.float32), backward_fits(32768, np.float16)
    (True, True, True)
    >>> backward_fits(16384, np.float64), backward_fits(20480, np.float64)
    (True, False)
    """
    return _plan(length, dtype) is not None


def _two_sweep_fits(length, dtype):
    """Whether the two-sweep kernel's per-thread column sums (two arrays of the row values a thread holds) fit in
    the registers a thread has at its block size (64K registers an SM, at most 255 a thread)."""
    shape = launch_shape(length, dtype, "backward")
    if shape is None:
        return False
    vw, tpr, rpb, items = shape
    words = 2 if np.dtype(dtype) == np.float64 else 1
    return 2 * items * vw * words + 40 <= min(255, 65536 // (tpr * rpb))


def backward_supports(dy, x, gamma, mean, rstd, k, need_params=True, residual=None, bias=None):
    """The calls :func:`layernorm_backward` takes: ``x``, ``gamma``, ``residual`` and ``bias`` as the forward takes
    them, ``dy`` like ``x`` (any strides: a transpose's pullback gives a transposed one), ``mean`` and ``rstd`` one
    value a row in the compute type (as the forward gives them), rows a backward kernel takes
    (:func:`backward_fits`: those the forward takes)."""
    if not (type(dy) is cupy.ndarray and dy.dtype == x.dtype and dy.shape == x.shape
            and supports(x, gamma, None, k, 0.0, residual, bias)):
        return False
    rows, length = _rows(x, k)
    return all(type(s) is cupy.ndarray and s.dtype == compute_dtype(x.dtype) and s.size == rows
               for s in (mean, rstd)) and backward_fits(length, x.dtype)


def layernorm_forward(x, gamma, beta, k: int, eps: float, residual=None, bias=None):
    """``(y, mean, rstd)``: ``y`` of ``x``'s shape and dtype; ``mean``, ``rstd`` one per row in the compute type.
    With ``residual`` (like ``x``) and/or ``bias`` (the normalised shape, compute type) the rows normalised are
    those of ``x + residual + bias``, summed on the fly (the sum is never stored)."""
    rows, length = _rows(x, k)
    fused = residual is not None or bias is not None
    x, gamma, beta, residual, bias = (_readable(a) for a in (x, gamma, beta, residual, bias))
    fn, (vw, tpr, rpb, items), stages, prefetches = _forward_kernel(x.dtype, length, fused)
    cdt = compute_dtype(x.dtype)
    y = cupy.empty_like(x)
    stats = cupy.empty((2, rows), cdt)
    blocks = -(-rows // rpb)
    shared = stages * _staged_bytes(length, x.dtype, fused)
    _allow_shared(fn, shared)
    if shared or prefetches:   # as many blocks as the GPU holds at once
        key = (x.dtype, length, x.device.id, fused, "forward", stages)
        blocks = min(blocks, _blocks_per_sm(key, fn, tpr * rpb, shared) * _sm_count(x.device.id))
    null = np.uint64(0)
    fn((blocks,), (tpr * rpb,), (x, null if gamma is None else gamma, null if beta is None else beta, y,
                                          stats[0], stats[1], np.int64(rows), np.float64(eps),
                                          null if residual is None else residual, null if bias is None else bias),
                                         shared_mem=shared)
    return y, stats[0], stats[1]


def _allow_shared(fn, nbytes):
    """Let ``fn`` take ``nbytes`` of dynamic shared memory a block (past the 48 KB a block gets without asking)."""
    if nbytes and fn.max_dynamic_shared_size_bytes < nbytes:
        fn.max_dynamic_shared_size_bytes = nbytes


def _readable(a):
    """``a`` as the kernels read it, C-contiguous and starting on 16 bytes (they load 16-byte vectors along a row):
    ``a`` itself, or a copy where it is a strided view or a view into a larger array (None stays None)."""
    if a is None or (a._c_contiguous and a.data.ptr % 16 == 0):
        return a
    if not a._c_contiguous:
        return c_contiguous(a)   # a new allocation, aligned as every allocation is
    bits = np.dtype(f"u{a.itemsize}")   # copied as unsigned words: the bits alike, for bfloat16 too
    return a.view(bits).copy().view(a.dtype)


def layernorm_backward(dy, x, gamma, mean, rstd, k: int, need_params: bool = True, residual=None, bias=None):
    """``(dx, dgamma, dbeta)`` (the last two None without ``need_params``), from the forward's ``mean``/``rstd``;
    with ``residual``/``bias``, ``dx`` is the cotangent of the sum ``x + residual + bias`` (recomputed, not read)."""
    rows, length = _rows(x, k)
    fused = residual is not None or bias is not None
    dy, x, gamma, residual, bias = (_readable(a) for a in (dy, x, gamma, residual, bias))
    mean, rstd = c_contiguous(mean), c_contiguous(rstd)   # read a value at a time: any start will do
    plan, bwd_blocks = _launch_plan(length, x.dtype, fused)
    name, vw, tpr, rpb, items, pf = plan
    split = _splits(plan)
    cdt = compute_dtype(x.dtype)
    mod = _module(x.dtype, length, "backward", fused, blocks=bwd_blocks, plan=plan)
    fn = mod.get_function(name)
    sms = _sm_count(x.device.id)
    cs = _cluster_shape(length, x.dtype, fused)[0] if name == "ln_bwdc" else 1
    shared = _backward_shared_bytes(length, x.dtype, name, cs, fused)
    _allow_shared(fn, shared)
    per_sm = (_blocks_per_sm((x.dtype, length, x.device.id, fused, plan), fn, tpr * rpb, shared)
              if name in ("ln_bwd1", "ln_dx1", "ln_bwds", "ln_bwdr") else 2)
    if name == "ln_bwdc":   # partial rows: one a cluster, as many clusters as the GPU holds at once (one wave)
        blocks = int(min(rows, _active_clusters(fn, cs, tpr, shared, (x.dtype, length, x.device.id, fused))))
        grid = blocks * cs
    else:
        blocks = grid = int(min(-(-rows // rpb), per_sm * sms))
    dx = cupy.empty_like(x)
    parts = cupy.empty((2, blocks, length), cdt) if need_params and not split else None
    null = np.uint64(0)
    res_arg, bias_arg = null if residual is None else residual, null if bias is None else bias
    fn((grid,), (tpr * rpb,), (dy, x, null if gamma is None else gamma, mean, rstd, dx,
                                 null if parts is None else parts[0], null if parts is None else parts[1],
                                 np.int64(rows), np.int32(parts is not None), res_arg, bias_arg), shared_mem=shared)
    if not need_params:
        return dx, None, None
    if split:   # the column sums apart: one partial row a chunk of rows
        _, tiles, rc, blocks = column_shape(length, x.dtype, rows)
        parts = cupy.empty((2, blocks, length), cdt)
        mod.get_function("ln_cols")((tiles, blocks), (32 * COLUMN_WARPS,),
                                    (dy, x, mean, rstd, parts[0], parts[1], np.int64(rows), np.int64(rc), res_arg,
                                     bias_arg))
    out = cupy.empty((2, length), cdt)
    mod.get_function("ln_params")((-(-length // 32),), (512,), (parts[0], parts[1], np.int64(blocks), out[0],
                                                                out[1]))
    shape = x.shape[x.ndim - k:]
    return dx, out[0].reshape(shape), out[1].reshape(shape)


KERNELS = {"layernorm_forward": (layernorm_forward, supports),
           "layernorm_backward": (layernorm_backward, backward_supports)}
