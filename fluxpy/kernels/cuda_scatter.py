"""``scatter`` and ``gather`` on CuPy arrays: three scatter implementations, chosen per problem by measurement.

A scatter here is ``dst[row(k), c] = op(dst[row(k), c], src[k, c])`` for every source row ``k`` and column ``c``,
where ``row(k)`` is the linear destination row of the ``d`` index arrays' ``k``-th entries (``idx[j][k]`` indexes
``dst``'s axis ``j``) and ``c`` runs over the trailing (column) shape. The implementations (TVM PR #7233: a sorting
scatter was slow for tiny inputs, a badly threaded one for large ones):

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
(``fluxpy.kernels.cudnn.set_options(deterministic=True)``, one switch for every kernel) only deterministic
implementations are candidates. A capture with no choice yet uses ``sorted`` (deterministic) or ``atomic``, untimed.

float16 and bfloat16 are computed in float32 and rounded once; integers add modulo their width, as NumPy does.

**Index checks run inside the kernels.** An index outside its axis (or negative) is skipped by every kernel and
raises a flag in pinned host memory; a *checked* call (the public ``scatter``/``gather`` ops) waits for its kernel and
raises :class:`~fluxpy.kernels.BadIndex` naming the first bad entry. The result is a new array, so nothing the
caller holds has changed when the error comes. Inside a CUDA-graph capture there is no waiting: a flag raised by a
replay is reported after the step that raised it. Unchecked calls (gradients, whose indices were checked on the way
forward) never wait.

>>> sorted(KERNELS)
['gather', 'scatter']
>>> IMPLEMENTATIONS
('one_block', 'atomic', 'sorted')
"""
from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ..backend import cupy
from ..capturing import capturing, on_replay
from . import BadIndex
from .cpu import first_bad_index, scatter_empty
from .cudnn.graph import _events_ms   # the plans' timer: host time between launches counts, as in a step
from .cudnn.handle import OPTIONS
from .halfs import CONVERSIONS, CONVERT, is_half

__all__ = ["scatter", "gather", "scatter_with", "choices", "clear_choices", "KERNELS", "IMPLEMENTATIONS",
           "ONE_BLOCK_LIMIT"]

IMPLEMENTATIONS = ("one_block", "atomic", "sorted")

ONE_BLOCK_LIMIT = 1 << 16
"""``one_block`` is a candidate only while ``(source rows + destination rows) * columns`` is at most this: one block
of threads walks the whole problem, which beyond a few tens of thousands of steps only loses to the others (it is a
bound on what is worth timing, not the choice: the choice is measured)."""

_BLOCK = 256

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


def _type_lines(dtype):
    """``#define`` lines of ``T`` and ``C``, the storage and compute types of ``dtype``, and ``LOAD``/``STORE``."""
    dtype = np.dtype(dtype)
    if is_half(dtype):
        to_c, to_t = CONVERT[dtype]
        ctype = "float"
    else:
        ctype = {"f": _ctype(dtype), "i": "long long", "u": "unsigned long long"}[dtype.kind]
        to_c, to_t = f"({ctype})", f"({_ctype(dtype)})"
    return (f"#define T {_ctype(dtype)}\n#define C {ctype}\n#define LOAD(v) {to_c}(v)\n"
            f"#define STORE(v) {to_t}(v)\n")


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


def _combine(op, dtype):
    """``COMBINE(acc, v)``: ``op`` in the compute type; a NaN wins a max or a min, as NumPy's."""
    dtype = np.dtype(dtype)
    if op == "add":
        if dtype.kind in "iu":   # modular, without signed overflow
            return "#define COMBINE(a, v) ((C)((unsigned long long)(a) + (unsigned long long)(v)))\n"
        return "#define COMBINE(a, v) ((a) + (v))\n"
    cmp = ">" if op == "max" else "<"
    if dtype.kind in "iu":
        return f"#define COMBINE(a, v) (((v) {cmp} (a)) ? (v) : (a))\n"
    return f"#define COMBINE(a, v) ((((v) != (v)) || ((v) {cmp} (a))) ? (v) : (a))\n"


def _row_function(index_dtypes, strided, small):
    """``fx_row(k, IDX_ARGS, bad)``: the linear destination row of entry ``k`` of the index arrays, or -1 (and
    ``*bad = 1``) where an index is outside its axis. ``strided`` = 0: the arrays are C-contiguous (entry ``k`` is
    at ``k``); otherwise it is the index arrays' number of axes, and entry ``k`` is found through each array's
    element strides (broadcast views such as ``arange`` columns are read in place, not copied). ``K_T``, the type
    of ``k`` and of its unravelling, is 32-bit where the sizes allow (64-bit division is several times slower)."""
    d = len(index_dtypes)
    params = []
    for j, t in enumerate(index_dtypes):
        params += [f"const {_ctype(t)}* __restrict__ i{j}", f"long long n{j}"]
        params += [f"long long s{j}_{a}" for a in range(strided)]
    for a in range(1, strided):
        params += [f"K_T m{a}"] + ([f"unsigned int mg{a}", f"unsigned int sh{a}"] if small else [])
    names = [p.split()[-1] for p in params]
    if strided:
        walk = "  K_T q = k, c, quot;\n" + "".join(f"  long long o{j} = 0;\n" for j in range(d))
        for a in range(strided - 1, -1, -1):
            if not a:
                walk += "  c = q;\n"
            elif small:   # q / m as a multiply-high and a shift (the divisor's magic number, made on the host)
                walk += f"  quot = (__umulhi(q, mg{a}) + q) >> sh{a}; c = q - quot * m{a}; q = quot;\n"
            else:
                walk += f"  c = q % m{a}; q /= m{a};\n"
            walk += "".join(f"  o{j} += (long long)c * s{j}_{a};\n" for j in range(d))
    else:
        walk = "".join(f"  const K_T o{j} = k;\n" for j in range(d))
    body = "".join(f"  v = (long long)i{j}[o{j}];\n  if (v < 0 || v >= n{j}) {{ *bad = 1; return -1; }}\n"
                   f"  r = r * n{j} + v;\n" for j in range(d))
    return (f"#define IDX_PARAMS {', '.join(params)}\n#define IDX_ARGS {', '.join(names)}\n"
            "__device__ __forceinline__ long long fx_row(K_T k, IDX_PARAMS, volatile int* bad) {\n"
            + walk + "  long long r = 0, v;\n" + body + "  return r;\n}\n")


# ---------------------------------------------------------------------------------------------
# The kernels. Blocks of (columns x rows) threads: threadIdx.x runs along a row's F columns, threadIdx.y over rows,
# so a row's destination is computed once per thread row and no thread divides its element number by F.

_ROWS_LOOP = r"""
#define FOR_ROWS(k, K) \
  for (K_T k = blockIdx.x * (K_T)blockDim.y + threadIdx.y; k < (K); k += (K_T)gridDim.x * blockDim.y)
#define FOR_COLUMNS(c, F) for (K_T c = threadIdx.x; c < (F); c += blockDim.x)
"""

_ONE_BLOCK = r"""
extern "C" __global__ void __launch_bounds__(256) scatter_one_block(
    const T* __restrict__ src, T* __restrict__ dst, C* __restrict__ work, K_T K, K_T F, K_T R,
    IDX_PARAMS, volatile int* bad) {
  // thread t owns columns t, t + blockDim.x, ...: it walks the source rows in order (deterministic, no atomics)
  for (K_T c = threadIdx.x; c < F; c += blockDim.x) {
    for (K_T r = 0; r < R; ++r) work[r * F + c] = EMPTY;
    for (K_T k = 0; k < K; ++k) {
      long long r = fx_row(k, IDX_ARGS, bad);
      if (r >= 0) work[r * F + c] = COMBINE(work[r * F + c], LOAD(src[(long long)k * F + c]));
    }
    for (K_T r = 0; r < R; ++r) dst[(long long)r * F + c] = STORE(work[(long long)r * F + c]);
  }
}
"""

_ATOMIC = r"""
__device__ __forceinline__ void fx_update(float* a, float v) {
#if OP_ADD
  atomicAdd(a, v);
#else
  unsigned int* p = (unsigned int*)a; unsigned int old = *p, seen;
  do { seen = old; float cur = __uint_as_float(seen);
       if (!((v != v) || (v CMP cur))) return;
       old = atomicCAS(p, seen, __float_as_uint(v)); } while (old != seen);
#endif
}
__device__ __forceinline__ void fx_update(double* a, double v) {
#if OP_ADD
  atomicAdd(a, v);
#else
  unsigned long long* p = (unsigned long long*)a; unsigned long long old = *p, seen;
  do { seen = old; double cur = __longlong_as_double((long long)seen);
       if (!((v != v) || (v CMP cur))) return;
       old = atomicCAS(p, seen, (unsigned long long)__double_as_longlong(v)); } while (old != seen);
#endif
}
__device__ __forceinline__ void fx_update(int* a, long long v) { ATOMIC_INT(a, (int)v); }
__device__ __forceinline__ void fx_update(unsigned int* a, unsigned long long v) { ATOMIC_INT(a, (unsigned int)v); }
__device__ __forceinline__ void fx_update(long long* a, long long v) {
#if OP_ADD
  atomicAdd((unsigned long long*)a, (unsigned long long)v);
#else
  ATOMIC_INT(a, v);
#endif
}
__device__ __forceinline__ void fx_update(unsigned long long* a, unsigned long long v) { ATOMIC_INT(a, v); }

extern "C" __global__ void __launch_bounds__(256) scatter_atomic(
    const T* __restrict__ src, A* __restrict__ acc, K_T K, K_T F, IDX_PARAMS, volatile int* bad) {
  FOR_ROWS(k, K) {
    long long r = fx_row(k, IDX_ARGS, bad);
    if (r < 0) continue;
    const T* s = src + (long long)k * F;
    A* a = acc + r * F;
    FOR_COLUMNS(c, F) fx_update(a + c, LOAD(s[c]));
  }
}
"""

_SORTED = r"""
extern "C" __global__ void __launch_bounds__(256) scatter_rows(K_T K, IDX_PARAMS, KEY* __restrict__ rows,
                                                               long long R, volatile int* bad) {
  // each source row's destination row, R (sorted past every segment) where an index is bad
  for (K_T k = blockIdx.x * (K_T)blockDim.x + threadIdx.x; k < K; k += (K_T)gridDim.x * blockDim.x) {
    long long r = fx_row(k, IDX_ARGS, bad);
    rows[k] = (KEY)(r < 0 ? R : r);
  }
}

extern "C" __global__ void __launch_bounds__(256) scatter_segments(const KEY* __restrict__ sorted_rows, K_T K,
                                                                   long long R, K_T* __restrict__ starts) {
  // starts[r] = the first sorted position whose row is >= r (a lower bound by binary search), r = 0..R
  for (long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x; r <= R; r += (long long)gridDim.x * blockDim.x) {
    K_T lo = 0, hi = K;
    while (lo < hi) {
      K_T mid = (lo + hi) >> 1;
      if ((long long)sorted_rows[mid] < r) lo = mid + 1; else hi = mid;
    }
    starts[r] = lo;
  }
}

extern "C" __global__ void __launch_bounds__(256) scatter_sorted(const T* __restrict__ src, T* __restrict__ dst,
    const long long* __restrict__ order, const K_T* __restrict__ starts, K_T R, K_T F) {
  FOR_ROWS(r, R) {
    const K_T begin = starts[r], end = starts[r + 1];
    T* out = dst + (long long)r * F;
    FOR_COLUMNS(c, F) {
      C acc = EMPTY;
      for (K_T p = begin; p < end; ++p) acc = COMBINE(acc, LOAD(src[order[p] * F + c]));
      out[c] = STORE(acc);
    }
  }
}
"""

_GATHER = r"""
extern "C" __global__ void __launch_bounds__(256) gather_rows(const U* __restrict__ src, U* __restrict__ out,
    K_T K, K_T F, IDX_PARAMS, volatile int* bad) {
  // out[k, c] = src[row(k), c] in units U of F per row; a bad index gives zeros
  FOR_ROWS(k, K) {
    long long r = fx_row(k, IDX_ARGS, bad);
    U* o = out + (long long)k * F;
    if (r < 0) { FOR_COLUMNS(c, F) o[c] = ZERO; continue; }
    const U* s = src + r * F;
    FOR_COLUMNS(c, F) o[c] = s[c];
  }
}
"""

_ATOMIC_INT = {"add": "atomicAdd", "max": "atomicMax", "min": "atomicMin"}
_UNITS = {16: ("uint4", "make_uint4(0, 0, 0, 0)"), 8: ("uint2", "make_uint2(0, 0)"), 4: ("unsigned int", "0u"),
          2: ("unsigned short", "(unsigned short)0"), 1: ("unsigned char", "(unsigned char)0")}

_functions: dict = {}


def _function(kind, name, op, dtype, index_dtypes, strided, small):
    """The compiled kernel ``name`` of module ``kind`` (``"one_block"``, ``"atomic"``, ``"sorted"`` or
    ``"gather"`` with ``op`` the unit size in bytes) for one dtype, tuple of index dtypes, index layout and
    index width (``small``: every element count fits 32 bits) on the current device (cached)."""
    key = (kind, name, op, dtype, index_dtypes, strided, small, cupy.cuda.runtime.getDevice())
    found = _functions.get(key)
    if found is None:
        found = _functions[key] = cupy.RawModule(code=_source(kind, op, dtype, index_dtypes, strided, small),
                                                 options=("--std=c++11",)).get_function(name)
    return found


def _source(kind, op, dtype, index_dtypes, strided, small):
    """The CUDA source of module ``kind`` (see :func:`_function`)."""
    head = ("#define K_T " + ("unsigned int" if small else "long long") + "\n" + _ROWS_LOOP
            + _row_function(index_dtypes, strided, small))
    if kind == "gather":
        unit, zero = _UNITS[op]
        return f"#define U {unit}\n#define ZERO {zero}\n" + head + _GATHER
    dtype = np.dtype(dtype)
    halves = CONVERSIONS if is_half(dtype) else ""
    code = halves + _type_lines(dtype) + _combine(op, dtype) + f"#define EMPTY {_empty_literal(op, dtype)}\n" + head
    if kind == "atomic":
        return code + (f"#define A {_ctype(_accumulator(dtype))}\n#define OP_ADD {int(op == 'add')}\n"
                       f"#define CMP {'>' if op == 'max' else '<'}\n#define ATOMIC_INT {_ATOMIC_INT[op]}\n" + _ATOMIC)
    if kind == "sorted":
        return code + "#define KEY long long\n" + _SORTED
    return code + _ONE_BLOCK


def _block(columns):
    """A (columns, rows) block of 256 threads: a power of two of columns up to 256 covering ``columns``."""
    x = 1
    while x < min(columns, _BLOCK):
        x *= 2
    return (x, _BLOCK // x)


def _row_grid(rows, block):
    return (max(1, min(-(-rows // block[1]), 65536)),)


def _grid(n):
    return (max(1, min(-(-n // _BLOCK), 65536)),)


# ---------------------------------------------------------------------------------------------
# The bad-index flag: one int in pinned host memory per device, which the kernels write directly (unified
# addressing maps pinned memory into the device's address space), so a checked call reads it without a copy


@functools.cache
def _flag(device):
    memory = cupy.cuda.alloc_pinned_memory(4)
    view = np.frombuffer(memory, dtype=np.int32, count=1)
    view[0] = 0
    return memory, view


def _flag_pointer():
    return np.uint64(_flag(cupy.cuda.runtime.getDevice())[0].ptr)


def _raise_if_flagged(fname, index, sizes):
    """After a checked call: wait for the stream, and where a kernel flagged a bad index, reset the flag and raise
    :class:`BadIndex` for the first bad entry (found on the host: the error path may be slow)."""
    view = _flag(cupy.cuda.runtime.getDevice())[1]
    cupy.cuda.get_current_stream().synchronize()
    if view[0]:
        view[0] = 0
        raise first_bad_index([cupy.asnumpy(a) for a in index], sizes) or BadIndex(
            -1, -1, -1, f"{fname}: a kernel flagged an out-of-range index that the arrays no longer hold")


def _check_after(fname, index, sizes, checked):
    if not checked:
        return
    if capturing():   # no waiting inside a capture: report a flag raised by a replay after that step
        view = _flag(cupy.cuda.runtime.getDevice())[1]

        def report():
            if view[0]:
                view[0] = 0
                raise BadIndex(-1, -1, -1, f"{fname}: an index in the captured step was out of range (its entry "
                                           f"was skipped)")
        on_replay(report)
        return
    _raise_if_flagged(fname, index, sizes)


# ---------------------------------------------------------------------------------------------
# The problem and its arguments


def _is_leading_array_index(index, src):
    """Whether ``index`` is a tuple of CuPy integer arrays of one shape that ``src``'s shape starts with (the
    fast kernels' form); any other NumPy index takes CuPy's ``ufunc.at``."""
    if not index or not all(isinstance(a, cupy.ndarray) and a.dtype.kind in "iu" for a in index):
        return False
    shape = index[0].shape
    return all(a.shape == shape for a in index) and tuple(src.shape[:len(shape)]) == tuple(shape)


def _index_layout(index):
    """0 where every index array is C-contiguous, else their number of axes (the kernels then use strides)."""
    return 0 if all(a.flags.c_contiguous for a in index) else max(1, index[0].ndim)


def _index_scalars(index, sizes, strided, small):
    """The kernels' scalar index arguments: per array its axis size (and its element strides), then the index
    shape's trailing sizes (:func:`_bind_index` puts the arrays in front of each array's scalars)."""
    count = np.uint32 if small else np.int64
    per_array = []
    for a, n in zip(index, sizes):
        scalars = [np.int64(n)]
        if strided:
            scalars += [np.int64(step // a.itemsize) for step in (a.strides if a.ndim else (0,))]
        per_array.append(tuple(scalars))
    shape = index[0].shape or (1,)
    tail = []
    for m in shape[1:strided]:
        tail += [count(m)] + (list(_magic(m)) if small else [])
    return tuple(per_array), tuple(tail)


def _magic(m):
    """``(magic, shift)`` with ``q // m == (umulhi(q, magic) + q) >> shift`` for every ``0 <= q < 2**31`` (the
    division by a constant of Granlund and Montgomery, as PyTorch's ``IntDivider``).

    >>> magic, shift = _magic(7); all(((q * int(magic) >> 32) + q) >> int(shift) == q // 7 for q in range(10000))
    True
    """
    shift = max(0, (int(m) - 1).bit_length())
    magic = ((1 << 32) * ((1 << shift) - m)) // m + 1
    return np.uint32(magic), np.uint32(shift)


def _bind_index(index, scalars):
    per_array, tail = scalars
    args = []
    for a, own in zip(index, per_array):
        args.append(a)
        args.extend(own)
    args.extend(tail)
    return args


class _Problem:
    """One scatter problem in the kernels' terms (K source rows, F columns, R destination rows, the index layout),
    made once per call signature (:func:`_problem`); :meth:`bind` gives it a call's arrays."""

    def __init__(self, op, src, index, shape):
        self.op, self.dtype = op, np.dtype(src.dtype)
        d = len(index)
        self.sizes = tuple(int(n) for n in shape[:d])
        self.shape = tuple(shape)
        self.K = int(index[0].size)
        self.F = math.prod(shape[d:])
        self.R = math.prod(self.sizes)
        self.index_dtypes = tuple(a.dtype for a in index)
        self.strided = _index_layout(index)
        self.small = max(self.K * max(self.F, 1), self.R * max(self.F, 1), self.R + 1) < 2 ** 31
        self.count = np.uint32 if self.small else np.int64
        self.scalars = _index_scalars(index, self.sizes, self.strided, self.small)
        self.key = (op, self.dtype, self.index_dtypes, self.strided, self.K, self.F, self.R,
                    cupy.cuda.runtime.getDevice())
        self.src, self.index_args = None, None

    def bind(self, src, index):
        self.src = src if src.flags.c_contiguous else cupy.ascontiguousarray(src)
        self.index_args = _bind_index(index, self.scalars)
        return self

    def release(self):
        """Drop the call's arrays: a cached problem must not keep them alive."""
        self.src, self.index_args = None, None

    def function(self, kind, name):
        return _function(kind, name, self.op, self.dtype, self.index_dtypes, self.strided, self.small)


_problems: dict = {}


def _problem(op, src, index, shape):
    """The cached :class:`_Problem` of this call's signature, bound to its arrays."""
    signature = (op, src.dtype, src.shape, shape, tuple((a.dtype, a.strides) for a in index), index[0].shape,
                 cupy.cuda.runtime.getDevice())
    p = _problems.get(signature)
    if p is None:
        p = _problems[signature] = _Problem(op, src, index, shape)
    return p.bind(src, index)


def _one_block(p):
    dst = cupy.empty(p.shape, p.dtype)
    work = dst if not is_half(p.dtype) and p.dtype.kind == "f" else cupy.empty(p.shape, _work_dtype(p.dtype))
    threads = max(32, min(_BLOCK, -(-p.F // 32) * 32))
    p.function("one_block", "scatter_one_block")(
        (1,), (threads,), (p.src, dst, work, p.count(p.K), p.count(p.F), p.count(p.R), *p.index_args,
                           _flag_pointer()))
    return dst


def _work_dtype(dtype):
    """The compute dtype of the ``one_block`` work array: float32 for the halves, 64-bit for the integers."""
    if is_half(dtype):
        return np.dtype(np.float32)
    return np.dtype(np.int64 if np.dtype(dtype).kind == "i" else np.uint64)


def _atomic(p):
    wide = _accumulator(p.dtype)
    empty = scatter_empty(p.op, p.dtype)
    acc = cupy.zeros(p.shape, wide) if empty == 0 else cupy.full(p.shape, empty, dtype=wide)   # zeros: a memset
    if p.K * p.F:
        block = _block(p.F)
        p.function("atomic", "scatter_atomic")(
            _row_grid(p.K, block), block, (p.src, acc, p.count(p.K), p.count(p.F), *p.index_args, _flag_pointer()))
    return acc if wide == p.dtype else acc.astype(p.dtype)


def _sorted(p):
    dst = cupy.empty(p.shape, p.dtype)
    if p.R * p.F == 0:
        return dst
    rows = cupy.empty(p.K, np.int64)
    if p.K:
        p.function("sorted", "scatter_rows")(_grid(p.K), (_BLOCK,), (p.count(p.K), *p.index_args, rows,
                                                                      np.int64(p.R), _flag_pointer()))
    order = cupy.argsort(rows) if p.K else cupy.empty(0, np.int64)
    starts = cupy.empty(p.R + 1, np.uint32 if p.small else np.int64)
    p.function("sorted", "scatter_segments")(_grid(p.R + 1), (_BLOCK,), (rows[order], p.count(p.K), np.int64(p.R),
                                                                          starts))
    block = _block(p.F)
    p.function("sorted", "scatter_sorted")(_row_grid(p.R, block), block, (p.src, dst, order, starts, p.count(p.R),
                                                                          p.count(p.F)))
    return dst


_RUN = {"one_block": _one_block, "atomic": _atomic, "sorted": _sorted}


def _candidates(p):
    deterministic = OPTIONS["deterministic"]
    names = []
    if (p.K + p.R) * p.F <= ONE_BLOCK_LIMIT:
        names.append("one_block")
    if not deterministic or p.op != "add" or p.dtype.kind in "iu":
        names.append("atomic")
    names.append("sorted")
    return names


# ---------------------------------------------------------------------------------------------
# Choosing by measurement

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
    key = p.key + (bool(OPTIONS["deterministic"]),)
    kept = _choices.get(key)
    if kept is not None:
        return kept[0]
    return _measure(p, key)


def _measure(p, key):
    names = _candidates(p)
    if capturing():   # no timing inside a capture; not kept, so the next eager call measures
        return "sorted" if "atomic" not in names else "atomic"
    if len(names) == 1:
        _choices[key] = (names[0], {})
        return names[0]
    times = {name: _events_ms(lambda name=name: _RUN[name](p)) for name in names}
    best = min(names, key=times.get)
    _choices[key] = (best, {k: round(v, 4) for k, v in times.items()})
    return best


# ---------------------------------------------------------------------------------------------
# The registered kernels


def scatter(op: str, src: Any, index: tuple, shape: tuple, checked: bool = False) -> Any:
    """``op`` (``"add"``, ``"max"``, ``"min"``) of the CuPy array ``src`` scattered by ``index`` into a new array of
    ``shape``; entries no index hits hold ``scatter_empty(op, src.dtype)``. ``index``: integer arrays of one shape on
    the leading axes (the measured kernels), or any NumPy index (CuPy's ``ufunc.at``). ``checked``: raise
    :class:`~fluxpy.kernels.BadIndex` for an index outside ``shape`` (negative included).

    >>> scatter.__name__
    'scatter'
    """
    index = tuple(cupy.asarray(a) if isinstance(a, (np.ndarray, list)) else a for a in index)
    if not _is_leading_array_index(index, src):
        return _scatter_any_index(op, src, index, shape)
    p = _problem(op, src, index, tuple(shape))
    try:
        dst = _RUN[_choose(p)](p)
    finally:
        p.release()
    _check_after("scatter", index, p.sizes, checked)
    return dst


def scatter_with(name: str, op: str, src: Any, index: tuple, shape: tuple) -> Any:
    """:func:`scatter` by the implementation ``name`` (one of :data:`IMPLEMENTATIONS`), unchecked and unmeasured:
    for tests and benchmarks that compare them.

    >>> scatter_with.__name__
    'scatter_with'
    """
    if name not in _RUN:
        raise ValueError(f"scatter_with: name must be one of {IMPLEMENTATIONS}, got {name!r}")
    index = tuple(cupy.asarray(a) for a in index)
    if not _is_leading_array_index(index, src):
        raise ValueError("scatter_with: expects integer arrays of one shape that src's shape starts with")
    p = _problem(op, src, index, tuple(shape))
    try:
        return _RUN[name](p)
    finally:
        p.release()


def _scatter_any_index(op, src, index, shape):
    """The general form (slices, masks, arrays anywhere; the gradient of ``getitem``) by CuPy's ``ufunc.at``,
    computed in float32 for the halves. CuPy's ``maximum.at``/``minimum.at`` round float64 through float32
    (measured, CuPy 14.2), so a float64 max or min takes the exact :func:`_sorted_extremum`."""
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


def _gather_launch(src, index):
    """``(function, grid, block, scalar arguments, index scalars)`` of a gather, cached per call signature."""
    signature = (src.dtype, src.shape, src.data.ptr % 16, tuple((a.dtype, a.strides) for a in index),
                 index[0].shape, cupy.cuda.runtime.getDevice())
    found = _gathers.get(signature)
    if found is None:
        d = len(index)
        sizes = tuple(int(n) for n in src.shape[:d])
        row_bytes = math.prod(src.shape[d:]) * src.dtype.itemsize
        unit = _unit(row_bytes, src.data.ptr)
        F, K = row_bytes // unit, int(index[0].size)
        strided = _index_layout(index)
        small = max(K * F, src.size) < 2 ** 31
        count = np.uint32 if small else np.int64
        block = _block(F)
        found = _gathers[signature] = (
            _function("gather", "gather_rows", unit, None, tuple(a.dtype for a in index), strided, small),
            _row_grid(K, block), block, (count(K), count(F)), _index_scalars(index, sizes, strided, small))
    return found


def gather(src: Any, index: tuple, checked: bool = False) -> Any:
    """``src[index]`` for a CuPy array and integer arrays of one shape on its leading axes (one kernel, rows copied
    in 16-byte units where they allow it); ``checked``: raise :class:`~fluxpy.kernels.BadIndex` for an index outside
    ``src``'s axes (negative included).

    >>> gather.__name__
    'gather'
    """
    index = tuple(cupy.asarray(a) if isinstance(a, (np.ndarray, list)) else a for a in index)
    if not all(isinstance(a, cupy.ndarray) and a.dtype.kind in "iu" for a in index) or len(index) > src.ndim:
        return src[index]
    d = len(index)
    src = src if src.flags.c_contiguous else cupy.ascontiguousarray(src)
    out = cupy.empty(index[0].shape + src.shape[d:], src.dtype)
    if out.size:
        function, grid, block, counts, scalars = _gather_launch(src, index)
        function(grid, block, (src, out, *counts, *_bind_index(index, scalars), _flag_pointer()))
    if checked:
        _check_after("gather", index, src.shape[:d], checked)
    return out


KERNELS = {"scatter": scatter, "gather": gather}
