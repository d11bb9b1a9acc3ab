"""fluxpy's own depthwise convolution kernels for channels-last float16 and bfloat16 CuPy arrays.

A depthwise convolution (``groups`` = input channels = output channels, one filter a channel) is a few
multiply-adds per value: memory-bound. cuDNN has fast engines for it in float16 but none in bfloat16 (its
bfloat16 plans are several times slower than its float16 ones on the same problem: BENCHMARKS.md, depthwise), and
its float16 backward data at stride 2 is slow too. These kernels read 16-byte vectors of eight adjacent channels
of a pixel (``cuda/depthwise.cu``):

- ``dw_forward``: a thread per (segment of ``wb`` adjacent outputs of a row, eight channels); each input column
  of the segment's window is read once into registers and used for every output and tap that reads it, the weight
  row of the taps in registers (the block's weights in shared memory, flipped there for true convolution);
- ``dw_backward_data``: a thread per (input pixel, eight channels), gathering the outputs that read it;
- ``dw_backward_filter`` then ``dw_filter_total``: each block sums ``dy * x`` over its share of the segments for
  the taps of ``khb`` rows of the weight (float32 accumulators a thread, each window column read once), its pixel
  lanes added by a warp butterfly and then warp by warp, and the shares added in a fixed order by the second kernel
  (deterministic, float32 accumulation, rounded once).

The tile (:class:`Tile`: ``wb``, and for the weight's gradient ``khb`` and the blocks a SM) is a compile-time
setting; :func:`candidates` lists those the kernels take for a problem. :func:`conv_forward`,
:func:`conv_backward_data` and :func:`conv_backward_filter` (the kernel table's entries) pick by measurement: on a
problem's first call they time each tile of the shortlist and cuDNN's graph plan (:mod:`fluxpy.kernels.cudnn.graph`)
on the GPU alone and keep the fastest, where :func:`supports` holds; the best tile depends on the stride, the
image's width and the channels in ways no simple rule caught (``benchmarks/depthwise_conv.py --sweep`` times them
all). :func:`forward` and :func:`backward_filter` called directly take ``tile=``, or :func:`plan`'s rule.

>>> sorted(KERNEL_NAMES)
['dw_backward_data', 'dw_backward_filter', 'dw_filter_total', 'dw_forward']
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import cupy
from ..layout import is_channels_last
from . import compiler
from .cudnn import graph
from .answers import answered
from .halfs import HALVES, dtype_defines

__all__ = ["Tile", "supports", "candidates", "plan", "forward", "backward_data", "backward_filter",
           "conv_forward", "conv_backward_data", "conv_backward_filter", "SOURCE_VARIANTS", "KERNEL_NAMES"]

KERNEL_NAMES = ("dw_forward", "dw_backward_data", "dw_backward_filter", "dw_filter_total")
_THREADS = 256              # a block (cuda/depthwise.cu's THREADS)
_SHARED_LIMIT = 48 * 1024   # the weights of a block's channels, float32, for every tap
_WIDTHS = (1, 2, 4, 8)      # the segments' candidate widths, wb
_PER_SM = (2, 4)            # the weight's gradient: candidate blocks a SM of its first pass
_FORWARD_THREADS_PER_SM = 512   # the forward's rule: the widest segment that leaves this many threads a SM
_FORWARD_PER_SM = 8         # the forward's grid: at most this many blocks a SM, each thread looping over segments
_TOTAL_BLOCK = (32, 32)     # dw_filter_total: 32 columns of the partials, 32 rows of them adding in turn


@dataclass(frozen=True)
class Tile:
    """A launch setting of the row kernels: ``wb`` adjacent outputs of a row a thread computes (a compile-time
    define); for the weight's gradient also ``khb``, the rows of the weight a block sums (a define: its float32
    accumulators are ``khb * KW`` taps of eight channels), and ``per_sm``, the blocks a SM of its first pass (how
    many partial sums the second pass adds).

    >>> Tile(4), Tile(4, khb=3, per_sm=2)
    (Tile(wb=4, khb=0, per_sm=0), Tile(wb=4, khb=3, per_sm=2))
    """
    wb: int
    khb: int = 0
    per_sm: int = 0


def _vw(c: int) -> int:
    return 8 if c % 8 == 0 else 1


def _fits(direction: str, kw: int, tile: Tile) -> bool:
    """Whether ``tile``'s registers (float32 values a thread holds: accumulators, a weight or dy row, a column)
    stay under ``__launch_bounds__(256, 2)``'s 128 without spilling (``tests/test_kernel_sources.py`` checks the
    sizes networks use)."""
    if direction == "forward":
        return tile.wb + kw <= 11
    return tile.khb * kw + tile.wb <= 13 and tile.khb * kw + tile.wb + kw <= 17


def _tiles(direction: str, kernel: tuple, ow: int) -> list:
    """Every candidate tile of ``direction`` ("forward" or "filter") for a ``kernel`` ``(KH, KW)`` and ``ow``
    output columns: segments no wider than the row, registers within :func:`_fits`."""
    kh, kw = kernel
    widths = [wb for wb in _WIDTHS if wb == 1 or wb <= ow]
    if direction == "forward":
        tiles = [Tile(wb) for wb in widths]
    else:
        rows = sorted({1, min(kh, max(1, 9 // kw))})   # one row, or all rows of a kernel of 9 taps or fewer
        tiles = [Tile(wb, khb, per_sm) for khb in rows for wb in widths for per_sm in _PER_SM]
    return [t for t in tiles if t.wb == 1 and t.khb <= 1 or _fits(direction, kw, t)]


def candidates(direction: str, cdims) -> list:
    """The tiles :func:`forward` (``direction`` "forward") or :func:`backward_filter` ("filter") take for the
    problem ``cdims``.

    >>> from types import SimpleNamespace
    >>> cd = SimpleNamespace(w_shape=(32, 1, 3, 3), y_shape=(8, 32, 16, 16))
    >>> [t.wb for t in candidates("forward", cd)]
    [1, 2, 4, 8]
    """
    if direction not in ("forward", "filter"):
        raise ValueError(f"depthwise tiles: direction 'forward' or 'filter', got {direction!r}")
    return _tiles(direction, tuple(cdims.w_shape[2:]), cdims.y_shape[3])


def _processors() -> int:
    return compiler.device().processors


def plan(direction: str, cdims, processors: int | None = None) -> Tile:
    """The rule's tile for ``direction`` ("forward" or "filter") of ``cdims`` on a GPU of ``processors`` SMs
    (default: the current one's). Forward: the widest segment that still leaves 512 threads a SM. Filter: all of
    the weight's rows a thread where they fit, then the widest segment, two blocks a SM (one wave at the kernel's
    launch bounds).

    >>> from types import SimpleNamespace
    >>> cd = SimpleNamespace(x_shape=(256, 32, 32, 32), w_shape=(32, 1, 3, 3), y_shape=(256, 32, 32, 32))
    >>> plan("forward", cd, processors=132), plan("filter", cd, processors=132)
    (Tile(wb=8, khb=0, per_sm=0), Tile(wb=4, khb=3, per_sm=2))
    """
    tiles = candidates(direction, cdims)
    if direction == "filter":
        khb = max(t.khb for t in tiles)
        return max((t for t in tiles if t.khb == khb and t.per_sm == _PER_SM[0]), key=lambda t: t.wb)
    n, c, oh, ow = cdims.y_shape
    threads_per_segment = _block(c)[0] * _chunks(c)
    enough = _FORWARD_THREADS_PER_SM * (processors or _processors())
    return max((t for t in tiles if t.wb == 1 or n * oh * -(-ow // t.wb) * threads_per_segment >= enough),
               key=lambda t: t.wb)


def _checked(direction, cdims, tile):
    """``tile``, or the rule's where it is None; a ValueError naming the candidates where it is not one."""
    if tile is None:
        return plan(direction, cdims)
    allowed = candidates(direction, cdims)
    if tile not in allowed:
        raise ValueError(f"depthwise {direction}: tile {tile} is not a candidate for this problem; expected one of "
                         f"{allowed}")
    return tile


def _defines(dtype, kernel, vw, tile=None, sw=1, dlw=1):
    """The defines of ``depthwise.cu``: the backward data's without ``tile``; the forward's with a tile without
    ``khb``; the weight's gradient's with one."""
    defines = {**dtype_defines(dtype), "KH": kernel[0], "KW": kernel[1], "VW": vw}
    if tile is not None:
        defines.update(WB=tile.wb, SW=sw, DLW=dlw)
        if tile.khb:
            defines["KHB"] = tile.khb
    return defines


def SOURCE_VARIANTS():
    """``(source, defines)`` of representative variants: the backward data's in both halves, vectors and single
    channels; every candidate tile of 3x3 kernels at strides 1 and 2 (bfloat16, vectors), the rule's of 5x5 and 7x7
    and of float16 and single channels.

    >>> len(list(SOURCE_VARIANTS())) > 20
    True
    """
    for dtype in HALVES:
        for vw in (8, 1):
            yield "depthwise.cu", _defines(dtype, (3, 3), vw)
    bf16, f16 = HALVES[1], HALVES[0]
    for direction in ("forward", "filter"):
        for sw in (1, 2):
            for tile in _tiles(direction, (3, 3), 16):
                if tile.per_sm == _PER_SM[0] or direction == "forward":
                    yield "depthwise.cu", _defines(bf16, (3, 3), 8, tile, sw)
        for kernel in ((5, 5), (7, 7)):
            for tile in _tiles(direction, kernel, 16):
                if tile.per_sm == _PER_SM[0] or direction == "forward":
                    yield "depthwise.cu", _defines(bf16, kernel, 8, tile)
        tile = max(_tiles(direction, (3, 3), 16), key=lambda t: (t.khb, t.wb))
        yield "depthwise.cu", _defines(f16, (3, 3), 8, tile)
        yield "depthwise.cu", _defines(bf16, (3, 3), 1, tile)


def supports(a, w, cdims) -> bool:
    """Whether the kernels take the problem: a 2-d depthwise convolution (multiplier 1) of float16 or bfloat16 CuPy
    arrays, ``a`` (the input or the output's cotangent) channels-last, the weight (None in the filter's direction,
    where it is the result) of ``a``'s dtype and dense, the block's weights within shared memory and the pixels of
    an image batch countable in 32 bits."""
    if type(a) is not cupy.ndarray or a.dtype not in HALVES or not is_channels_last(a):
        return False
    if w is not None and (type(w) is not cupy.ndarray or w.dtype != a.dtype or
                          not (w._c_contiguous or is_channels_last(w))):
        return False
    x_shape, w_shape = cdims.x_shape, cdims.w_shape
    if len(x_shape) != 4 or not cdims.groups == x_shape[1] == w_shape[0] > 1 or w_shape[1] != 1:
        return False
    n, c, h, wd = x_shape
    if n * max(h * wd, cdims.y_shape[2] * cdims.y_shape[3]) >= 2 ** 31:
        return False
    return w_shape[2] * w_shape[3] * _block(c)[0] * _vw(c) * 4 <= _SHARED_LIMIT


def _block(c):
    """``(CT, PT)``: threads along channel vectors (a power of two, at most 32) and along pixels (256 in all)."""
    groups = -(-c // _vw(c))
    ct = min(32, 1 << (groups - 1).bit_length())
    return ct, _THREADS // ct


def _chunks(c):
    ct, _ = _block(c)
    return -(-c // (ct * _vw(c)))


def _geometry(cdims):
    """The backward data's geometry arguments (``dw_backward_data``'s ints)."""
    (_, c, h, w), (oh, ow) = cdims.x_shape, cdims.y_shape[2:]
    top, _, left, _ = cdims.pad
    return tuple(np.int32(v) for v in (h, w, c, oh, ow, *cdims.stride, top, left, *cdims.dilation,
                                       not cdims.flipped))


def _rows(cdims, segments):
    """The row kernels' arguments after the arrays (``ROWS`` and the segment count)."""
    (_, c, h, w), (oh, ow) = cdims.x_shape, cdims.y_shape[2:]
    top, _, left, _ = cdims.pad
    return tuple(np.int32(v) for v in (h, w, c, oh, ow, cdims.stride[0], top, left, cdims.dilation[0],
                                       not cdims.flipped, segments))


def _function(name, dtype, cdims, tile=None):
    c = cdims.x_shape[1]
    defines = _defines(dtype, tuple(cdims.w_shape[2:]), _vw(c), tile, cdims.stride[1], cdims.dilation[1])
    return compiler.function("depthwise.cu", name, defines)


def _segments(cdims, tile):
    n, _, oh, ow = cdims.y_shape
    return n * oh * -(-ow // tile.wb)


def _nhwc(shape, dtype):
    """An empty channels-last array of NCHW ``shape``."""
    n, c, h, w = shape
    return cupy.empty((n, h, w, c), dtype).transpose(0, 3, 1, 2)


def forward(x, w, cdims, tile: Tile | None = None):
    """``conv(x, w)`` of a depthwise problem (:func:`supports`), channels-last; ``tile`` one of
    :func:`candidates` ("forward"), the rule's (:func:`plan`) by default."""
    tile = _checked("forward", cdims, tile)
    c = cdims.x_shape[1]
    ct, pt = _block(c)
    segments = _segments(cdims, tile)
    chunks = _chunks(c)
    grid = (max(1, min(-(-segments // pt), -(-_FORWARD_PER_SM * _processors() // chunks))), chunks)
    y = _nhwc(cdims.y_shape, x.dtype)
    taps = cdims.w_shape[2] * cdims.w_shape[3]
    compiler.launch(_function("dw_forward", x.dtype, cdims, tile), grid, (ct, pt),
                    (x, w, y, *_rows(cdims, segments)), taps * ct * _vw(c) * 4)
    return y


def backward_data(dy, w, cdims):
    """The input's cotangent of :func:`forward`, channels-last: a thread per (input pixel, channel vector), eight
    blocks a SM in all, each thread looping over its pixels."""
    n, c, h, wd = cdims.x_shape
    ct, pt = _block(c)
    pixels = n * h * wd
    chunks = _chunks(c)
    grid = (max(1, min(-(-pixels // pt), -(-8 * _processors() // chunks))), chunks)
    dx = _nhwc(cdims.x_shape, dy.dtype)
    taps = cdims.w_shape[2] * cdims.w_shape[3]
    compiler.launch(_function("dw_backward_data", dy.dtype, cdims), grid, (ct, pt),
                    (dy, w, dx, *_geometry(cdims), np.int64(pixels)), taps * ct * _vw(c) * 4)
    return dx


def _shares(cdims, tile, segments):
    """The first pass's blocks along the segments: ``tile.per_sm`` blocks a SM in all (over the channel chunks and
    row groups), each pixel lane two segments at least, 1,024 at most."""
    c, kh = cdims.x_shape[1], cdims.w_shape[2]
    _, pt = _block(c)
    blocks = -(-tile.per_sm * _processors() // (_chunks(c) * -(-kh // tile.khb)))
    return max(1, min(blocks, -(-segments // (2 * pt)), 1024))


def backward_filter(x, dy, cdims, tile: Tile | None = None):
    """The weight's cotangent of :func:`forward`, ``(C, 1, KH, KW)``: per-block sums, then their total; ``tile``
    one of :func:`candidates` ("filter"), the rule's (:func:`plan`) by default."""
    tile = _checked("filter", cdims, tile)
    n, c, oh, ow = cdims.y_shape
    kh, kw = cdims.w_shape[2:]
    ct, pt = _block(c)
    segments = _segments(cdims, tile)
    shares = _shares(cdims, tile, segments)
    part = cupy.empty((shares, kh * kw, c), np.float32)
    warps = _THREADS // 32
    compiler.launch(_function("dw_backward_filter", x.dtype, cdims, tile), (shares, _chunks(c), -(-kh // tile.khb)),
                    (ct, pt), (x, dy, part, *_rows(cdims, segments)), 2 * warps * ct * _vw(c) * 4)
    dw = cupy.empty(cdims.w_shape, x.dtype)
    cols, rows = _TOTAL_BLOCK
    compiler.launch(_function("dw_filter_total", x.dtype, cdims, tile), -(-c * kh * kw // cols), _TOTAL_BLOCK,
                    (part, dw, np.int32(shares), np.int32(c), np.int32(not cdims.flipped)), cols * rows * 4)
    return dw


_choices: dict = {}   # (direction, cdims, dtype, device) -> a tile, OURS (backward data) or CUDNN
OURS, CUDNN = "ours", "cudnn"


def _shortlist(direction, cdims) -> list:
    """What is timed of fluxpy's kernels: every forward tile; the weight's gradient's at the first blocks-a-SM
    setting (the second measured no faster by more than 1% on any layer of the sweep); the backward data's one
    kernel (OURS)."""
    if direction == "data":
        return [OURS]
    tiles = candidates(direction, cdims)
    return tiles if direction == "forward" else [t for t in tiles if t.per_sm == _PER_SM[0]]


def _choice(direction, a, w, cdims, ours, theirs):
    """What runs this problem: CUDNN where the kernels do not take it; else, timed on its first call, one of
    :func:`_shortlist`'s entries (``ours(entry)`` runs one) and cuDNN's plan (``theirs()``): of those near the
    fastest GPU time, the fastest back to back (:func:`fluxpy.kernels.compiler.timed_choice`)."""
    if not supports(a, w, cdims):
        return CUDNN

    def timed():
        runs = {entry: (lambda entry=entry: ours(entry)) for entry in _shortlist(direction, cdims)}
        runs[CUDNN] = theirs
        return compiler.timed_choice(runs).kept
    return answered(_choices, (direction, cdims, a.dtype, a.device.id), timed, kept=None)


def conv_forward(x, w, cdims):
    """The kernel table's ``conv_forward`` for CuPy arrays: :func:`forward` at the tile kept, or cuDNN's plan."""
    tile = _choice("forward", x, w, cdims, lambda t: forward(x, w, cdims, t), lambda: graph.conv_forward(x, w, cdims))
    return graph.conv_forward(x, w, cdims) if tile == CUDNN else forward(x, w, cdims, tile)


def conv_backward_data(dy, w, cdims):
    """The kernel table's ``conv_backward_data``: :func:`backward_data` where it is kept, cuDNN's otherwise."""
    kept = _choice("data", dy, w, cdims, lambda _: backward_data(dy, w, cdims),
                   lambda: graph.conv_backward_data(dy, w, cdims))
    return graph.conv_backward_data(dy, w, cdims) if kept == CUDNN else backward_data(dy, w, cdims)


def conv_backward_filter(x, dy, cdims):
    """The kernel table's ``conv_backward_filter``: :func:`backward_filter` at the tile kept (both arrays
    channels-last, of one dtype), or cuDNN's plan."""
    tile = CUDNN
    if dy.dtype == x.dtype and supports(dy, None, cdims):
        tile = _choice("filter", x, None, cdims, lambda t: backward_filter(x, dy, cdims, t),
                       lambda: graph.conv_backward_filter(x, dy, cdims))
    return graph.conv_backward_filter(x, dy, cdims) if tile == CUDNN else backward_filter(x, dy, cdims, tile)
