"""A stand-in for CuPy, on the CPU, for the host code of fluxpy's scatter and gather kernels
(``fluxpy.kernels.cuda_scatter``): arrays are NumPy arrays in a wrapper that CuPy's type checks take for device
arrays, pinned memory is host memory with an address, and a kernel is run in NumPy from exactly the arguments
the host passes it. Each launch is first checked against the kernel's parameter list in the CUDA source (after the
C preprocessor, ``cpp``, has applied the module's ``-D`` options and its ``#define``s): as many arguments as parameters, an array (of the element size the source names) or an address for
each pointer, and for each scalar a NumPy scalar of the parameter's width and signedness, as CuPy passes them.

Only the kernels of ``cuda_scatter`` are known (``scatter_one_block``, ``scatter_atomic``, ``scatter_rows``,
``scatter_segments``, ``scatter_sorted``, ``gather_rows``); their index reads follow the scalars passed (sizes,
element strides, the magic numbers of the divisions), and a bad index leaves the call's number in the flag as
``fx_flag`` does. The CUDA code itself runs only on a GPU.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import types

import numpy as np
from numpy.lib.array_utils import byte_bounds

from fluxpy.kernels.cpu import halves_in_float32
from fluxpy.kernels.cpu import scatter as cpu_scatter

_C_SIZES = {"float": 4, "double": 8, "signed char": 1, "short": 2, "int": 4, "long long": 8, "unsigned char": 1,
            "unsigned short": 2, "unsigned int": 4, "unsigned long long": 8, "uint2": 8, "uint4": 16}
_UFUNCS = {"add": np.add, "max": np.maximum, "min": np.minimum}


class FakeArray:
    """A "device" array: a NumPy array ``a`` behind the attributes the kernels' host code reads."""

    def __init__(self, a):
        self.a = a

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    strides = property(lambda self: self.a.strides)
    size = property(lambda self: self.a.size)
    ndim = property(lambda self: self.a.ndim)
    itemsize = property(lambda self: self.a.itemsize)
    flags = property(lambda self: self.a.flags)
    data = property(lambda self: types.SimpleNamespace(ptr=self.a.__array_interface__["data"][0]))

    def astype(self, dtype):
        return FakeArray(self.a.astype(dtype))

    def reshape(self, *shape):
        return FakeArray(self.a.reshape(*shape))

    def max(self):
        return self.a.max()

    def min(self):
        return self.a.min()

    def __getitem__(self, key):
        key = tuple(k.a if isinstance(k, FakeArray) else k for k in key) if isinstance(key, tuple) else key
        return FakeArray(self.a[key.a if isinstance(key, FakeArray) else key])


class PinnedMemory(bytearray):
    """Host memory with an address (``ptr``), as CuPy's pinned memory."""

    def __init__(self, nbytes):
        super().__init__(nbytes)
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self))


CPP = shutil.which("cpp")


def preprocess(code, options=()):
    """``code`` after the C preprocessor with the ``-D`` options among ``options``, its ``#define`` lines kept
    (``cpp -dD``: :func:`_defines` reads them)."""
    defines = [o for o in options if o.startswith("-D")]
    run = subprocess.run([CPP, "-P", "-dD", "-w", *defines], input=code, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _defines(code):
    """The object-like ``#define``s of ``code`` (name -> text) and its function-like ``COMBINE``'s body."""
    names = dict(re.findall(r"^#define (\w+) (.*)$", code, re.M))
    combine = re.search(r"^#define COMBINE\(a, ?v\) (.*)$", code, re.M)
    return names, combine.group(1) if combine else ""


def _expand(text, defines):
    for _ in range(10):
        text = re.sub(r"\b(\w+)\b", lambda m: defines.get(m.group(1), m.group(1)), text)
    return text


def kernel_parameters(code, name):
    """``[(type, is_pointer, name)]`` of kernel ``name`` in ``code``, its macros expanded."""
    defines, _ = _defines(code)
    start = re.search(r"void __launch_bounds__\([^)]*\) " + name + r"\(", code).end()
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(code[end], 0)
        end += 1
    params = []
    for p in _expand(" ".join(code[start:end - 1].split()), defines).split(","):
        words = p.replace("*", " * ").split()
        words = [w for w in words if w not in ("const", "volatile", "__restrict__")]
        params.append((" ".join(w for w in words[:-1] if w != "*"), "*" in words, words[-1]))
    return params


class Kernel:
    """One kernel of a module's source, run in NumPy (at once, or when ``queue`` is a list, when the test runs
    what it holds: as a GPU runs a stream's work after the host has queued it); ``launches`` counts its calls."""

    def __init__(self, code, name, stream):
        self.code, self.name, self.stream = code, name, stream
        self.params = kernel_parameters(code, name)
        defines, combine = _defines(code)
        self.op = "add" if "+" in combine else "max" if ">" in combine else "min"
        self.unit = _C_SIZES[_expand("U", defines)] if name == "gather_rows" else None
        self.launches = 0

    def __call__(self, grid, block, args, shared_mem=0):
        assert len(args) == len(self.params), f"{self.name}: {len(args)} arguments for {len(self.params)} parameters"
        named = {}
        for (ctype, pointer, pname), arg in zip(self.params, args):
            if pointer:
                assert isinstance(arg, (FakeArray, np.uint64)), f"{self.name}: {pname} is a pointer, got {type(arg)}"
                if isinstance(arg, FakeArray) and ctype in _C_SIZES and self.unit is None:
                    assert arg.itemsize == _C_SIZES[ctype], f"{self.name}: {pname} is {ctype}*, got {arg.dtype}"
            else:
                assert isinstance(arg, np.generic), f"{self.name}: {pname} is a {ctype}, got {type(arg)}"
                assert arg.itemsize == _C_SIZES[ctype], f"{self.name}: {pname} is a {ctype}, got {arg.dtype}"
                assert (arg.dtype.kind == "u") == ctype.startswith("unsigned"), f"{self.name}: {pname} {arg.dtype}"
            named[pname] = arg
        self.launches += 1
        run = getattr(self, "_" + self.name)
        if self.stream.queue is None:
            run(named)
        else:
            self.stream.queue.append(lambda: run(named))

    # the index walk (fx_row and fx_flag)

    def _rows(self, a, K):
        """The destination row of every entry ``k < K`` (-1 where bad), read as ``fx_row`` reads it."""
        if "inner" in a:
            return self._along_rows(a, K)
        d = sum(1 for _, pointer, n in self.params if pointer and re.fullmatch(r"i\d+", n))
        strided = sum(1 for _, _, n in self.params if n.startswith("s0_"))
        small = "mg1" in a   # 32-bit problems divide by magic numbers
        rows, bad = np.zeros(int(K), np.int64), np.zeros(int(K), bool)
        for k in range(int(K)):
            offsets = [k] * d
            if strided:
                offsets, q = [0] * d, k
                for ax in range(strided - 1, -1, -1):
                    if ax == 0:
                        c = q
                    elif small:
                        m, mg, sh = int(a[f"m{ax}"]), int(a[f"mg{ax}"]), int(a[f"sh{ax}"])
                        quot = (((q * mg) >> 32) + q) >> sh
                        c, q = q - quot * m, quot
                    else:
                        m = int(a[f"m{ax}"])
                        c, q = q % m, q // m
                    offsets = [o + c * int(a[f"s{j}_{ax}"]) for j, o in enumerate(offsets)]
            r = 0
            for j in range(d):
                v, n = _read(a[f"i{j}"], offsets[j]), int(a[f"n{j}"])
                if not 0 <= v < n:
                    bad[k] = True
                    break
                r = r * n + v
            rows[k] = -1 if bad[k] else r
        return self._flagged(a, rows)

    def _along_rows(self, a, K):
        """The along-axis form's ``fx_row``: ``k = (outer * na + j) * inner + i`` goes to row ``(outer * n0 +
        idx[k]) * inner + i``, divided as the kernel divides (magic numbers in 32-bit problems)."""
        inner, length, n = int(a["inner"]), int(a["na"]), int(a["n0"])
        rows = np.full(int(K), -1, np.int64)
        for k in range(int(K)):
            if "mgi" in a:
                q = (((k * int(a["mgi"])) >> 32) + k) >> int(a["shi"])
                outer = (((q * int(a["mga"])) >> 32) + q) >> int(a["sha"])
            else:
                q = k // inner
                outer = q // length
            v = _read(a["i0"], k)
            if 0 <= v < n:
                rows[k] = (outer * n + v) * inner + (k - q * inner)
        return self._flagged(a, rows)

    @staticmethod
    def _flagged(a, rows):
        """``rows``, after leaving a checked call's number in the flag where one is -1 (``fx_flag``)."""
        if (rows < 0).any() and int(a["call"]):
            flag = ctypes.c_int32.from_address(int(a["bad"]))
            if flag.value == 0:
                flag.value = int(a["call"])
        return rows

    # the kernels

    def _scatter_atomic(self, a):
        K, F = int(a["K"]), int(a["F"])
        rows = self._rows(a, K)
        acc = a["acc"].a.reshape(-1, F) if F else a["acc"].a
        src = a["src"].a.reshape(K, F)
        ok = rows >= 0
        _UFUNCS[self.op].at(acc, rows[ok], src[ok].astype(acc.dtype))

    def _scatter_one_block(self, a):
        K, F, R = int(a["K"]), int(a["F"]), int(a["R"])
        rows = self._rows(a, K)
        ok = rows >= 0
        dst = a["dst"].a.reshape(R, F)
        dst[...] = halves_in_float32(cpu_scatter)(self.op, a["src"].a.reshape(K, F)[ok], (rows[ok],), (R, F))

    def _scatter_rows(self, a):
        K, R = int(a["K"]), int(a["R"])
        rows = self._rows(a, K)
        a["rows"].a[...] = np.where(rows >= 0, rows, R)

    def _scatter_segments(self, a):
        R = int(a["R"])
        sorted_rows = a["sorted_rows"].a[:int(a["K"])]
        a["starts"].a[...] = np.searchsorted(sorted_rows, np.arange(R + 1), side="left")

    def _scatter_sorted(self, a):
        R, F = int(a["R"]), int(a["F"])
        starts, order = a["starts"].a, a["order"].a
        src = a["src"].a.reshape(-1, F)
        taken = order[:int(starts[R])]
        rows = np.repeat(np.arange(R), np.diff(starts.astype(np.int64)))
        a["dst"].a.reshape(R, F)[...] = halves_in_float32(cpu_scatter)(self.op, src[taken], (rows,), (R, F))

    def _gather_rows(self, a):
        K, F = int(a["K"]), int(a["F"])
        rows = self._rows(a, K)
        src, out = a["src"].a, a["out"].a
        assert src.flags.c_contiguous and out.flags.c_contiguous
        assert src.__array_interface__["data"][0] % self.unit == 0, "gather: unit wider than the source's alignment"
        src_rows = src.reshape(-1).view(np.uint8).reshape(-1, F * self.unit)
        out_rows = out.reshape(-1).view(np.uint8).reshape(K, F * self.unit)
        out_rows[...] = 0
        out_rows[rows >= 0] = src_rows[rows[rows >= 0]]


def _read(array, offset):
    """Element ``offset`` (in elements from the array's first) of a FakeArray, inside its memory."""
    a = array.a
    start = a.__array_interface__["data"][0]
    low, high = byte_bounds(a)
    address = start + offset * a.itemsize
    assert low <= address and address + a.itemsize <= high, f"index read at element {offset} is outside the array"
    return int(np.frombuffer((ctypes.c_char * a.itemsize).from_address(address), dtype=a.dtype)[0])


class Stream:
    """The one stream: ``queue`` is None (kernels run as they are launched) or the launches not yet run, which a
    wait runs; ``waits`` counts the waits by kind."""

    def __init__(self):
        self.queue, self.ptr = None, 0
        self.waits = {"stream": 0, "device": 0}

    def run_queued(self):
        while self.queue:
            self.queue.pop(0)()

    def wait(self, kind):
        self.waits[kind] += 1
        self.run_queued()

    def synchronize(self):
        self.wait("stream")


def make_cupy():
    """A module that stands in for ``cupy`` (named so: the kernel table keys it as ``"cupy"``); ``stream`` is its
    one stream."""
    cp = types.ModuleType("cupy")
    stream = Stream()

    class RawModule:
        def __init__(self, code, options=(), name_expressions=None):
            self.code = preprocess(code, options)

        def get_function(self, name):
            return Kernel(self.code, name, stream)

    def wrap(x, dtype=None):
        return x if isinstance(x, FakeArray) and dtype is None else FakeArray(np.array(x, dtype=dtype))

    def asnumpy(x):
        stream.run_queued()
        return np.array(x.a)

    cp.ndarray = FakeArray
    cp.asarray = wrap
    cp.asnumpy = asnumpy
    cp.ascontiguousarray = lambda x: FakeArray(np.ascontiguousarray(x.a))
    cp.empty = lambda shape, dtype=float: FakeArray(_garbage(shape, dtype))
    cp.zeros = lambda shape, dtype=float: FakeArray(np.zeros(shape, dtype))
    cp.ones = lambda shape, dtype=float: FakeArray(np.ones(shape, dtype))
    cp.full = lambda shape, value, dtype=None: FakeArray(np.full(shape, value, dtype))
    cp.arange = lambda *args, **kw: FakeArray(np.arange(*args, **kw))
    cp.argsort = lambda x: FakeArray(np.argsort(x.a, kind="stable"))
    cp.RawModule = RawModule
    cp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0, deviceSynchronize=lambda: stream.wait("device")),
        alloc_pinned_memory=PinnedMemory, get_current_stream=lambda: stream)
    cp.stream = stream
    return cp


def _garbage(shape, dtype):
    """An uninitialised array: bytes 0x5A (not zero, as fresh device memory need not be)."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    count = int(np.prod(shape, dtype=np.int64))
    return np.full(count * np.dtype(dtype).itemsize, 0x5A, np.uint8).view(dtype).reshape(shape)
