"""``scatter`` and ``gather`` on CuPy arrays: three scatter implementations, chosen per problem by timing them.

A scatter here is ``dst[row(k), c] = op(dst[row(k), c], src[k, c])`` for every source row ``k`` and column ``c``,
where ``row(k)`` is the linear destination row of the ``d`` index arrays' ``k``-th entries (``idx[j][k]`` indexes
``dst``'s axis ``j``) and ``c`` runs over the trailing (column) shape. No one implementation suits every size (a
sorting scatter is slow for tiny inputs, a badly threaded one for large ones: TVM PR #7233), so there are three:

- ``one_block``: one block; its threads own the columns and walk the source rows in order. One launch, no atomics,
  deterministic; offered only while the whole problem is small (:data:`ONE_BLOCK_LIMIT` element steps).
- ``atomic``: a fill, then one thread per source element with an atomic update. Deterministic for ``max``/``min``
  and integer sums; float sums accumulate in no fixed order (the last bits may differ from run to run).
- ``sorted``: the destination rows sorted (CuPy's radix ``argsort``), each row's segment found by a binary search,
  then one thread per destination element reduces its segment in sorted order: deterministic, no atomics, and
  every destination element written once (the fill is free).

The first call of a problem (op, dtype, index dtypes, the row counts and column count, device) outside a CUDA-graph
capture times every implementation it may use on the call's own arrays (one warm run, then CUDA events) and keeps
the fastest for the process, as cuDNN plans are kept; :func:`choices` lists them. In deterministic mode
(the ``deterministic`` option of :mod:`fluxpy.options`, one switch for every kernel) only deterministic
implementations are candidates. A capture with no choice yet uses ``sorted`` (deterministic) or ``atomic``, untimed.

float16 and bfloat16 are computed in float32 and rounded once; integers add modulo their width, as NumPy does.

An index outside its axis (or negative) is skipped by every kernel; a *checked* call (``checked=True``) reports
it as the ``index_checks`` option (:mod:`fluxpy.options`) says: :mod:`~fluxpy.kernels.scatter_checks` keeps the
flag the kernels write and :func:`check_indices`.

>>> sorted(KERNELS)
['check_indices', 'gather', 'scatter']
>>> IMPLEMENTATIONS
('one_block', 'atomic', 'sorted')
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import cupy
from ..capturing import capturing
from ..options import options
from . import compiler
from .cpu import scatter_empty
from .cuda_arrays import c_contiguous
from .halfs import KERNEL_DTYPES, dtype_defines, is_half
from .scatter_checks import _UNCHECKED, _finish_checked, _flag, _start_checked, check_indices

__all__ = ["scatter", "gather", "check_indices", "scatter_with", "choices", "clear_choices", "KERNELS",
           "IMPLEMENTATIONS", "ONE_BLOCK_LIMIT", "MAX_INDEX_ARRAYS", "MAX_INDEX_AXES", "SOURCE_VARIANTS"]

IMPLEMENTATIONS = ("one_block", "atomic", "sorted")

ONE_BLOCK_LIMIT = 1 << 16
"""``one_block`` is a candidate only while ``(source rows + destination rows) * columns`` is at most this: one block
of threads walks the whole problem, which beyond a few tens of thousands of steps only loses to the others (it is a
bound on what is worth timing, not the choice: the choice is timed)."""

MAX_INDEX_ARRAYS = 8
MAX_INDEX_AXES = 8
"""The most index arrays, and axes of an index array, the kernels take (``cuda/scatter_index.cuh`` spells their
parameters out); an index past either takes CuPy's indexing (``ufunc.at``, ``src[index]``)."""

_BLOCK = 256
# Rows a thread row of the gather and the atomic scatter takes at a time (FX_UNROLL in their source): 2 where one
# index array gives a row, 4 where several do (_unroll): more index reads in flight pay where each row needs several,
# and cost registers and tail work where it needs one (BENCHMARKS.md has the measurements).
UNROLL_ONE_INDEX = 2
UNROLL_SEVERAL_INDICES = 4

# ---------------------------------------------------------------------------------------------
# Types: storage T, compute C (what LOAD gives and STORE takes), atomic accumulator A

_INT_TYPES = {np.dtype(np.int8): "signed char", np.dtype(np.int16): "short", np.dtype(np.int32): "int",
              np.dtype(np.int64): "long long", np.dtype(np.uint8): "unsigned char",
              np.dtype(np.uint16): "unsigned short", np.dtype(np.uint32): "unsigned int",
              np.dtype(np.uint64): "unsigned long long"}


def _accumulator(dtype):
    """The dtype an ``atomic`` scatter accumulates ``dtype`` in (CUDA has atomics for 32- and 64-bit words only)."""
    dtype = np.dtype(dtype)
    if is_half(dtype):
        return np.dtype(np.float32)
    if dtype.kind in "iu" and dtype.itemsize < 4:
        return np.dtype(np.int32 if dtype.kind == "i" else np.uint32)
    return dtype


def _ctype(dtype):
    dtype = np.dtype(dtype)
    if is_half(dtype):
        return "unsigned short"
    return {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}.get(dtype) or _INT_TYPES[dtype]


def _empty_literal(op, dtype):
    """``scatter_empty(op, dtype)`` as a CUDA expression of the compute type."""
    dtype = np.dtype(dtype)
    if op == "add":
        return "((C)0)"
    if dtype.kind == "f" or is_half(dtype):
        if dtype == np.float64:
            return "__longlong_as_double(0x%xLL)" % (0xfff0000000000000 if op == "max" else 0x7ff0000000000000)
        return "__int_as_float(0x%x)" % (0xff800000 if op == "max" else 0x7f800000)
    value = int(scatter_empty(op, dtype))
    return f"((C){value}LL)" if dtype.kind == "i" else f"((C){value}ULL)"


_OPS = {"add": 1, "max": 2, "min": 3}
_UNITS = (16, 8, 4, 2, 1)   # the gather's access widths in bytes (_unit)
_SOURCES = {"one_block": "scatter_one_block.cu", "atomic": "scatter_atomic.cu", "sorted": "scatter_sorted.cu",
            "gather": "gather.cu"}
SCATTER_DTYPES = KERNEL_DTYPES + tuple(_INT_TYPES)
"""The dtypes the scatter kernels store: the halves, float32, float64 and every integer type."""


def _value_defines(op, dtype):
    """``cuda/scatter_types.cuh``'s defines: the dtype's types (halfs.cuh's for the floats, ``FX_INT`` for an
    integer), the op and its empty value."""
    dtype = np.dtype(dtype)
    types = dtype_defines(dtype) if dtype.kind == "f" or is_half(dtype) else \
        {"FX_INT": _ctype(dtype), "FX_UNSIGNED": dtype.kind == "u"}
    return {**types, "FX_OP": _OPS[op], "FX_EMPTY": _empty_literal(op, dtype)}


def _index_defines(index_dtypes, strided, small, reads=None):
    """``cuda/scatter_index.cuh``'s defines for one tuple of index dtypes, index layout (``strided``: 0, the index
    arrays' number of axes, or ``"along"`` for the along-axis form; ``reads``: :func:`_reads`, by default every
    array read by every axis) and index width (``small``: every element count and index offset fits 32 bits)."""
    along = strided == "along"
    defines = {"FX_SMALL": bool(small), "FX_UNROLL": _unroll(len(index_dtypes)), "FX_D": len(index_dtypes),
               "FX_STRIDED": 0 if along else strided, "FX_ALONG": along}
    for j, t in enumerate(index_dtypes):
        defines[f"FX_I{j}"] = _ctype(t)
    if strided and not along:
        for j, axes in enumerate(reads or (tuple(range(strided)),) * len(index_dtypes)):
            defines[f"FX_R{j}"] = -1 if axes is None else sum(1 << a for a in axes)
    return defines


def _defines(kind, op, dtype, index_dtypes, strided, small, reads=None):
    """The defines of kind ``kind``'s source (``"one_block"``, ``"atomic"``, ``"sorted"``, or ``"gather"`` with
    ``op`` the unit size in bytes) for one dtype and index layout (:func:`_index_defines`)."""
    defines = _index_defines(index_dtypes, strided, small, reads)
    if kind == "gather":
        defines["FX_UNIT"] = op
        return defines
    defines.update(_value_defines(op, dtype))
    if kind == "atomic":
        defines["FX_ACC"] = _ctype(_accumulator(dtype))
    return defines


def _function(kind, name, op, dtype, index_dtypes, strided, small, reads=None):
    """The compiled kernel ``name`` of kind ``kind``'s source (:func:`_defines`) on the current device."""
    return compiler.function(_SOURCES[kind], name, _defines(kind, op, dtype, index_dtypes, strided, small, reads))


def _index_layouts():
    """``(index dtypes, strided, reads)`` that cover every define of ``cuda/scatter_index.cuh``: each number of
    index arrays (each integer dtype in some place), C-contiguous, strided by few and by the most axes (read by
    every axis, or some arrays by one axis and some C-contiguous), and the along-axis form of each index dtype."""
    ints = tuple(_INT_TYPES)
    for d in range(1, MAX_INDEX_ARRAYS + 1):
        dtypes = tuple(ints[(d + j) % len(ints)] for j in range(d))
        mixed = lambda strided, d=d: tuple((0,) if j % 3 == 0 else None if j % 3 == 1 else tuple(range(strided))
                                           for j in range(d))
        yield dtypes, 0, None
        yield dtypes, 1, None
        yield dtypes, 2, mixed(2)
        yield dtypes, 3, mixed(3)
        yield dtypes, MAX_INDEX_AXES, None
        yield dtypes, MAX_INDEX_AXES, mixed(MAX_INDEX_AXES)
    for t in ints:
        yield (t,), "along", None


def SOURCE_VARIANTS():
    """``(source, defines)`` of the variants the kernels launch: each implementation, op and dtype (one index array),
    each gather unit, and every index layout of :func:`_index_layouts` with a gather and a scatter (the kinds and
    dtypes in turn), in 32 and 64 bits.

    >>> variants = list(SOURCE_VARIANTS()); len({name for name, _ in variants})
    4
    """
    int64 = (np.dtype(np.int64),)
    for small in (True, False):
        for kind in IMPLEMENTATIONS:
            for op in _OPS:
                for dtype in SCATTER_DTYPES if small else ():   # the values' defines do not depend on small
                    yield _SOURCES[kind], _defines(kind, op, dtype, int64, 0, small)
        for unit in _UNITS:
            yield _SOURCES["gather"], _defines("gather", unit, None, int64, 0, small)
        for n, (dtypes, strided, reads) in enumerate(_index_layouts()):
            kind = IMPLEMENTATIONS[n % len(IMPLEMENTATIONS)]
            dtype = SCATTER_DTYPES[n % len(SCATTER_DTYPES)]
            yield _SOURCES["gather"], _defines("gather", 4, None, dtypes, strided, small, reads)
            yield _SOURCES[kind], _defines(kind, "add", dtype, dtypes, strided, small, reads)


def _block(columns):
    """A (columns, rows) block of 256 threads: a power of two of columns up to 256 covering ``columns``."""
    x = 1
    while x < min(columns, _BLOCK):
        x *= 2
    return (x, _BLOCK // x)


def _unroll(arrays: int) -> int:
    """Rows a thread row of the gather and the atomic scatter takes at a time, by the number of index arrays that
    give a row: their index reads, then their source reads, are issued together.

    >>> _unroll(1), _unroll(4)
    (2, 4)
    """
    return UNROLL_ONE_INDEX if arrays == 1 else UNROLL_SEVERAL_INDICES


def _row_grid(rows, block, unroll=1):
    """Blocks for ``rows`` rows, ``block[1]`` a block at a time times ``unroll`` (the kernels that take
    :func:`_unroll` rows a thread row), at most 65,536 (the kernels then stride)."""
    return (max(1, min(-(-rows // (block[1] * unroll)), 65536)),)


def _grid(n):
    return (max(1, min(-(-n // _BLOCK), 65536)),)


# ---------------------------------------------------------------------------------------------
# The problem and its arguments


def _index_key(index):
    """Each index array's dtype, shape and strides, or None where ``index`` is not a non-empty tuple of CuPy arrays:
    the part of a call's cache key (:func:`_signature`, :func:`_gather_signature`) that the index decides."""
    if type(index) is not tuple or not index:
        return None
    key = []
    for a in index:
        if not isinstance(a, cupy.ndarray):
            return None
        key += (a.dtype, a.shape, a.strides)
    return tuple(key)


def _signature(op, src, index, shape, device, axis):
    """The key of a scatter call's cached :class:`_Problem`, or None where ``index`` is not a tuple of CuPy arrays.
    It holds every shape, dtype and stride that :func:`_is_leading_array_index` and the problem depend on, so a call
    whose key is cached needs neither."""
    arrays = _index_key(index)
    return None if arrays is None else (op, src.dtype, src.shape, shape, device, axis) + arrays


def _on_device(index):
    """``index`` as a tuple with its NumPy arrays and lists on the device."""
    return tuple(cupy.asarray(a) if isinstance(a, (np.ndarray, list)) else a for a in index)


def _is_leading_array_index(index, src):
    """Whether ``index`` is a tuple of CuPy integer arrays of one shape that ``src``'s shape starts with (the
    fast kernels' form, at most :data:`MAX_INDEX_ARRAYS` of at most :data:`MAX_INDEX_AXES` axes); any other NumPy
    index takes CuPy's ``ufunc.at``."""
    if not index or not all(isinstance(a, cupy.ndarray) and a.dtype.kind in "iu" for a in index) \
            or len(index) > MAX_INDEX_ARRAYS or index[0].ndim > MAX_INDEX_AXES:
        return False
    shape = index[0].shape
    return all(a.shape == shape for a in index) and tuple(src.shape[:len(shape)]) == tuple(shape)


def _index_layout(index):
    """0 where every index array is C-contiguous, else their number of axes (the kernels then use strides)."""
    return 0 if all(a.flags.c_contiguous for a in index) else max(1, index[0].ndim)


def _reads(index):
    """Per index array of a strided layout, the axes whose strides it is read by (those of a stride other than 0),
    or None for a C-contiguous array: ``cuda/scatter_index.cuh`` multiplies only by those. None where every array
    is C-contiguous.

    >>> import numpy
    >>> column = numpy.broadcast_to(numpy.arange(3).reshape(3, 1), (3, 4))
    >>> _reads((column, numpy.zeros((3, 4), numpy.int64))), _reads((numpy.zeros((3, 4), numpy.int64),))
    (((0,), None), None)
    """
    if not _index_layout(index):
        return None
    return tuple(None if a.flags.c_contiguous else tuple(i for i, step in enumerate(a.strides) if step)
                 for a in index)


def _fits_32_bits(index, *counts):
    """Whether every count and every index array's element offset (its strides times its extents, either sign)
    is under 2**31: the kernels then count, unravel and address the index arrays in 32 bits."""
    spans = (sum(abs(step // a.itemsize) * (n - 1) for step, n in zip(a.strides, a.shape)) for a in index)
    return max(*counts, *spans) < 2 ** 31


def _index_scalars(index, sizes, strided, small):
    """The kernels' scalar index arguments, in ``IDX_PARAMS``'s order after the arrays: per array its axis size
    (and its element strides), then the index shape's trailing sizes (and their magic numbers)."""
    count = np.uint32 if small else np.int64
    stride = np.int32 if small else np.int64
    scalars = []
    for a, n in zip(index, sizes):
        scalars.append(np.int64(n))
        if strided:
            scalars += [stride(step // a.itemsize) for step in (a.strides if a.ndim else (0,))]
    shape = index[0].shape or (1,)
    for m in shape[1:strided]:
        scalars += [count(m)] + (list(_magic(m)) if small else [])
    return tuple(scalars)


def _along_scalars(index_shape, axis, n, small):
    """The along-axis form's scalar index arguments (``cuda/scatter_index.cuh``, ``FX_ALONG``): the destination's
    (or source's) axis length ``n``, the size of the axes after ``axis`` and the index array's length on it (with
    their magic numbers where ``small``)."""
    inner, length = max(math.prod(index_shape[axis + 1:]), 1), max(index_shape[axis], 1)   # 0: no entries to divide
    if not small:
        return np.int64(n), np.int64(inner), np.int64(length)
    return (np.int64(n), np.uint32(inner), *_magic(inner), np.uint32(length), *_magic(length))


def _magic(m):
    """``(magic, shift)`` with ``q // m == (umulhi(q, magic) + q) >> shift`` for every ``0 <= q < 2**31`` (the
    division by a constant of Granlund and Montgomery, as PyTorch's ``IntDivider``).

    >>> magic, shift = _magic(7); all(((q * int(magic) >> 32) + q) >> int(shift) == q // 7 for q in range(10000))
    True
    """
    shift = max(0, (int(m) - 1).bit_length())
    magic = ((1 << 32) * ((1 << shift) - m)) // m + 1
    return np.uint32(magic), np.uint32(shift)


class _Problem:
    """One scatter problem in the kernels' terms (K source rows, F columns, R destination rows, the index layout)
    and every argument of its launches that does not change from call to call, made once per call signature
    (:func:`_problem`); :meth:`bind` gives it a call's arrays and number, :meth:`release` takes them back."""

    def __init__(self, op, src, index, shape, device, axis=None):
        self.op, self.dtype, self.axis = op, np.dtype(src.dtype), axis
        d = len(index) if axis is None else len(shape)   # the along-axis form: every axis indexed, rows of one
        self.sizes = tuple(int(n) for n in shape[:d])
        self.shape = tuple(shape)
        self.K = int(index[0].size)
        self.F = math.prod(shape[d:])
        self.R = math.prod(self.sizes)
        self.index_dtypes = tuple(a.dtype for a in index)
        self.strided = _index_layout(index) if axis is None else "along"
        self.reads = _reads(index) if axis is None else None
        self.small = _fits_32_bits(index, self.K * max(self.F, 1), self.R * max(self.F, 1), self.R + 1)
        count = np.uint32 if self.small else np.int64
        self.K_arg, self.F_arg, self.R_arg, self.R_long = count(self.K), count(self.F), count(self.R), np.int64(self.R)
        self.index_scalars = (_index_scalars(index, self.sizes, self.strided, self.small) if axis is None else
                              _along_scalars(index[0].shape, axis, self.sizes[axis], self.small))
        self.flag = _flag(device)
        self.wide, self.empty = _accumulator(self.dtype), scatter_empty(op, self.dtype)   # atomic's
        self.block = _block(self.F)
        self.threads = max(32, min(_BLOCK, -(-self.F // 32) * 32))                          # one_block's
        self.work_dtype = None if self.dtype.kind == "f" and not is_half(self.dtype) else _work_dtype(self.dtype)
        layout = self.strided if axis is None else ("along", math.prod(shape[axis + 1:]))
        self.key = (op, self.dtype, self.index_dtypes, layout, self.K, self.F, self.R, device)
        self.chosen = {}   # deterministic -> the implementation kept in _choices
        self.kernels = {}  # kernel name -> its compiled function (the problem's device)
        self.src, self.index_args, self.flag_args = None, None, None

    def bind(self, src, index, call):
        self.src = c_contiguous(src)
        self.index_args = index + self.index_scalars
        self.flag_args = (self.flag.pointer, call)
        return self

    def release(self):
        """Drop the call's arrays: a cached problem must not keep them alive."""
        self.src, self.index_args, self.flag_args = None, None, None

    def function(self, kind, name):
        found = self.kernels.get(name)
        if found is None:
            found = self.kernels[name] = _function(kind, name, self.op, self.dtype, self.index_dtypes, self.strided,
                                                   self.small, self.reads)
        return found


_problems: dict = {}


def _problem(op, src, index, shape, device, axis):
    """The cached :class:`_Problem` of this call's signature (made on its first call)."""
    signature = _signature(op, src, index, shape, device, axis)
    p = _problems.get(signature)
    if p is None:
        p = _problems[signature] = _Problem(op, src, index, shape, device, axis)
    return p


def _one_block(p):
    dst = cupy.empty(p.shape, p.dtype)
    work = dst if p.work_dtype is None else cupy.empty(p.shape, p.work_dtype)
    p.function("one_block", "scatter_one_block")(
        (1,), (p.threads,), (p.src, dst, work, p.K_arg, p.F_arg, p.R_arg, *p.index_args, *p.flag_args))
    return dst


def _work_dtype(dtype):
    """The compute dtype of the ``one_block`` work array (None: the result itself): float32 for the halves, 64-bit
    for the integers."""
    if is_half(dtype):
        return np.dtype(np.float32)
    return np.dtype(np.int64 if np.dtype(dtype).kind == "i" else np.uint64)


def _atomic(p):
    acc = cupy.zeros(p.shape, p.wide) if p.empty == 0 else cupy.full(p.shape, p.empty, dtype=p.wide)   # a memset
    if p.K * p.F:
        p.function("atomic", "scatter_atomic")(
            _row_grid(p.K, p.block, _unroll(len(p.index_dtypes))), p.block,
            (p.src, acc, p.K_arg, p.F_arg, *p.index_args, *p.flag_args))
    return acc if p.wide == p.dtype else acc.astype(p.dtype)


def _sorted(p):
    dst = cupy.empty(p.shape, p.dtype)
    if p.R * p.F == 0:
        return dst
    rows = cupy.empty(p.K, np.uint32 if p.small else np.int64)   # 32-bit keys: half the radix sort's passes
    if p.K:
        p.function("sorted", "scatter_rows")(_grid(p.K), (_BLOCK,), (p.K_arg, *p.index_args, rows, p.R_long,
                                                                      *p.flag_args))
    order = cupy.argsort(rows) if p.K else cupy.empty(0, np.int64)
    starts = cupy.empty(p.R + 1, np.uint32 if p.small else np.int64)
    p.function("sorted", "scatter_segments")(_grid(p.R + 1), (_BLOCK,), (rows[order], p.K_arg, p.R_long, starts))
    p.function("sorted", "scatter_sorted")(_row_grid(p.R, p.block), p.block, (p.src, dst, order, starts, p.R_arg,
                                                                              p.F_arg))
    return dst


_RUN = {"one_block": _one_block, "atomic": _atomic, "sorted": _sorted}


def _candidates(p):
    deterministic = options.deterministic
    names = []
    if (p.K + p.R) * p.F <= ONE_BLOCK_LIMIT:
        names.append("one_block")
    if not deterministic or p.op != "add" or p.dtype.kind in "iu":
        names.append("atomic")
    names.append("sorted")
    return names


# ---------------------------------------------------------------------------------------------
# Choosing by timing

_choices: dict = {}


def choices() -> dict:
    """The implementation kept per problem so far: ``{(op, dtype, index dtypes, index layout, K, F, R, device,
    deterministic): (name, {name: milliseconds})}`` (K source rows of F columns into R destination rows).

    >>> isinstance(choices(), dict)
    True
    """
    return dict(_choices)


def clear_choices() -> None:
    """Forget every choice (the next call of each problem measures again).

    >>> clear_choices(); choices()
    {}
    """
    _choices.clear()
    _problems.clear()
    _gathers.clear()


def _choose(p):
    deterministic = options.deterministic
    name = p.chosen.get(deterministic)
    if name is None:
        key = p.key + (deterministic,)
        kept = _choices.get(key)
        name = kept[0] if kept is not None else _measure(p, key)
        if key in _choices:   # not inside a capture, which measures nothing
            p.chosen[deterministic] = name
    return name


def _measure(p, key):
    names = _candidates(p)
    if capturing():   # no timing inside a capture; not kept, so the next eager call measures
        return "sorted" if "atomic" not in names else "atomic"
    if len(names) == 1:
        _choices[key] = (names[0], {})
        return names[0]
    times = {name: compiler.time_ms(lambda name=name: _RUN[name](p)) for name in names}
    best = min(names, key=times.get)
    _choices[key] = (best, {k: round(v, 4) for k, v in times.items()})
    return best


# ---------------------------------------------------------------------------------------------
# The registered kernels


def scatter(op: str, src: Any, index: tuple, shape: tuple, checked: bool = False, axis: int | None = None) -> Any:
    """``op`` (``"add"``, ``"max"``, ``"min"``) of the CuPy array ``src`` scattered by ``index`` into a new array of
    ``shape``; entries no index hits hold ``scatter_empty(op, src.dtype)``. ``index``: integer arrays of one shape on
    the leading axes (the kernels chosen by timing), or any NumPy index (CuPy's ``ufunc.at``). ``checked``: report
    an index outside ``shape`` (negative included) as the ``index_checks`` option says: raise
    :class:`~fluxpy.kernels.BadIndex` later (``"deferred"``, the default), or before returning (``"wait"``). ``axis``:
    ``index`` is one integer array of ``src``'s shape whose entries index ``shape``'s ``axis`` (the along-axis form,
    the same kernels; ``fluxpy.kernels.cpu.along_axis_index``).

    >>> scatter.__name__
    'scatter'
    """
    shape = shape if type(shape) is tuple else tuple(shape)
    device = cupy.cuda.runtime.getDevice()
    p = _problems.get(_signature(op, src, index, shape, device, axis))
    if p is None:   # the call's first of this signature, or an index that is not (yet) CuPy arrays
        index = _on_device(index)
        if axis is not None:
            index = _along_index(index, shape, axis, src.shape)
        elif not _is_leading_array_index(index, src):
            return _scatter_any_index(op, src, index, shape)
        p = _problem(op, src, index, shape, device, axis)
    call = _start_checked(p.flag) if checked else _UNCHECKED
    p.bind(src, index, call)
    try:
        dst = _RUN[_choose(p)](p)
    finally:
        p.release()
    if checked:
        _finish_checked(p.flag, call, "scatter", index, p.sizes, axis)
    return dst


def _along_index(index, shape, axis, src_shape=None):
    """The along-axis form's index, checked (one integer array with ``shape``'s sizes on every axis but ``axis``:
    the destination's of a scatter, the source's of a gather; a scatter's also of ``src_shape``, one index a source
    entry) and C-contiguous, as its kernels read it."""
    idx = index[0] if len(index) == 1 else None
    if not (isinstance(idx, cupy.ndarray) and idx.dtype.kind in "iu" and idx.ndim == len(shape)
            and all(a == b for j, (a, b) in enumerate(zip(idx.shape, shape)) if j != axis)
            and (src_shape is None or idx.shape == tuple(src_shape))):
        raise ValueError(f"along axis {axis}: expects one integer index array of shape {tuple(shape)} but on axis "
                         f"{axis}" + ("" if src_shape is None else f", and of src's shape {tuple(src_shape)}")
                         + f"; got {len(index)} array(s)"
                         + (f" of shape {tuple(idx.shape)}" if isinstance(idx, cupy.ndarray) else ""))
    return (c_contiguous(idx),)


def scatter_with(name: str, op: str, src: Any, index: tuple, shape: tuple, axis: int | None = None) -> Any:
    """:func:`scatter` by the implementation ``name`` (one of :data:`IMPLEMENTATIONS`), unchecked and unmeasured:
    for tests and benchmarks that compare them.

    >>> scatter_with.__name__
    'scatter_with'
    """
    if name not in _RUN:
        raise ValueError(f"scatter_with: name must be one of {IMPLEMENTATIONS}, got {name!r}")
    index = _on_device(index)
    if axis is not None:
        index = _along_index(index, tuple(shape), axis, src.shape)
    elif not _is_leading_array_index(index, src):
        raise ValueError("scatter_with: expects integer arrays of one shape that src's shape starts with")
    p = _problem(op, src, index, tuple(shape), cupy.cuda.runtime.getDevice(), axis)
    try:
        return _RUN[name](p.bind(src, index, _UNCHECKED))
    finally:
        p.release()


def _scatter_any_index(op, src, index, shape):
    """The general form (slices, masks, arrays anywhere; the gradient of ``getitem``) by CuPy's ``ufunc.at``,
    computed in float32 for the halves. CuPy's ``maximum.at``/``minimum.at`` round float64 through float32,
    so a float64 max or min takes the exact :func:`_sorted_extremum`."""
    wide = src.astype(np.float32) if is_half(src.dtype) else src
    dst = cupy.full(shape, scatter_empty(op, wide.dtype), dtype=wide.dtype)
    if op != "add" and wide.dtype == np.float64:
        _sorted_extremum(op, dst, index, wide)
    else:
        {"add": cupy.add, "max": cupy.maximum, "min": cupy.minimum}[op].at(dst, index, wide)
    return dst.astype(src.dtype) if wide is not src else dst


def _sorted_extremum(op, dst, index, src):
    """``dst[index] = max/min(dst[index], src)`` with repeated indices, exactly, by a sort: values sorted by
    destination, then by value (NaN last, so it wins a max, as NumPy's), and each destination takes the last of its
    run; a min is the max of the negated values."""
    flat = dst.reshape(-1)
    dest = cupy.arange(flat.size).reshape(dst.shape)[index]
    values = cupy.broadcast_to(src, dest.shape).reshape(-1)
    dest = dest.reshape(-1)
    if op == "min":
        values = -values
    order = cupy.lexsort(cupy.stack([values, dest.astype(values.dtype)]))
    dest, values = dest[order], values[order]
    last = cupy.ones(dest.size, dtype=bool)
    last[:-1] = dest[1:] != dest[:-1]
    dest, values = dest[last], values[last]
    current = flat[dest] if op == "max" else -flat[dest]
    best = cupy.where(cupy.isnan(values) | (values > current), values, current)
    flat[dest] = best if op == "max" else -best


def _unit(nbytes, address):
    """The widest access (16, 8, 4, 2 or 1 bytes) that divides a row of ``nbytes`` and the source's address (the
    result is a new array: aligned for every unit)."""
    for size in (16, 8, 4, 2, 1):
        if nbytes % size == 0 and address % size == 0:
            return size
    return 1


_gathers: dict = {}


def _gather_signature(src, index, device, axis):
    """The key of a gather call's cached :class:`_Gather` (as :func:`_signature`), or None where ``index`` is not a
    tuple of CuPy arrays."""
    arrays = _index_key(index)
    return None if arrays is None else (src.dtype, src.shape, src.data.ptr % 16, device, axis) + arrays


def _is_gather_index(index, src):
    """Whether ``index`` is a tuple of CuPy integer arrays of one shape, at most one per axis of ``src`` (the
    kernel's form, at most :data:`MAX_INDEX_ARRAYS` of at most :data:`MAX_INDEX_AXES` axes); any other index takes
    CuPy's indexing."""
    if not index or not all(isinstance(a, cupy.ndarray) and a.dtype.kind in "iu" for a in index) \
            or len(index) > MAX_INDEX_ARRAYS or index[0].ndim > MAX_INDEX_AXES:
        return False
    return all(a.shape == index[0].shape for a in index) and len(index) <= src.ndim


class _Gather:
    """One gather problem's launch, made once per call signature: the kernel (None for an empty result), grid,
    block and scalar arguments, the result's shape and the indexed axes' sizes (all of them in the along-axis
    form, ``axis``: rows of one element)."""

    def __init__(self, src, index, device, axis=None):
        d = len(index) if axis is None else src.ndim
        self.sizes = tuple(int(n) for n in src.shape[:d])
        self.out_shape = tuple(index[0].shape) + tuple(src.shape[d:])
        row_bytes = math.prod(src.shape[d:]) * src.dtype.itemsize
        unit = _unit(row_bytes, src.data.ptr)
        F, K = row_bytes // unit, int(index[0].size)
        strided = _index_layout(index) if axis is None else "along"
        small = _fits_32_bits(index, K * F, src.size)
        count = np.uint32 if small else np.int64
        self.block = _block(F)
        self.grid = _row_grid(K, self.block, _unroll(len(index)))
        self.counts = (count(K), count(F))
        self.index_scalars = (_index_scalars(index, self.sizes, strided, small) if axis is None else
                              _along_scalars(index[0].shape, axis, self.sizes[axis], small))
        self.flag = _flag(device)
        reads = _reads(index) if axis is None else None
        self.function = _function("gather", "gather_rows", unit, None, tuple(a.dtype for a in index), strided,
                                  small, reads) if K * F else None


def _gather_of(src, index, device, axis):
    """The cached :class:`_Gather` of this call's signature (made on its first call)."""
    signature = _gather_signature(src, index, device, axis)
    g = _gathers.get(signature)
    if g is None:
        g = _gathers[signature] = _Gather(src, index, device, axis)
    return g


def gather(src: Any, index: tuple, checked: bool = False, axis: int | None = None) -> Any:
    """``src[index]`` for a CuPy array and integer arrays of one shape on its leading axes (one kernel, rows copied
    in 16-byte units where they allow it); ``checked``: report an index outside ``src``'s axes (negative included)
    as :func:`scatter` does; ``axis``: the along-axis form, ``take_along_axis(src, index[0], axis)`` (the same
    kernel, an element a row).

    >>> gather.__name__
    'gather'
    """
    device = cupy.cuda.runtime.getDevice()
    g = _gathers.get(_gather_signature(src, index, device, axis)) if src.flags.c_contiguous else None
    if g is None:   # the call's first of this signature, a strided src, or an index that is not (yet) CuPy arrays
        index = _on_device(index)
        if axis is not None:
            index = _along_index(index, src.shape, axis)
        elif not _is_gather_index(index, src):
            return src[index]
        src = c_contiguous(src)
        g = _gather_of(src, index, device, axis)
    out = cupy.empty(g.out_shape, src.dtype)
    call = _start_checked(g.flag) if checked else _UNCHECKED
    if g.function is not None:
        g.function(g.grid, g.block, (src, out, *g.counts, *index, *g.index_scalars, g.flag.pointer, call))
    if checked:
        _finish_checked(g.flag, call, "gather", index, g.sizes, axis)
    return out


KERNELS = {"scatter": scatter, "gather": gather, "check_indices": check_indices}
