"""The optimiser kernels, generated from a rule's formula: one parameter per launch (``optimiser_step``, a
``cupy.ElementwiseKernel``, float32 and float64, any layout), a list of parameters per launch
(``optimiser_step_many``, ``cuda/optimise_many.cu``, dense parameters of any float dtype: a float16 or bfloat16
parameter computed in float32 with a float32 state and rounded once), the counters' advance
(``optimiser_advance``), and the checks a training step makes on the device (``finite_total``, ``vector_norm``,
``loss_scale_advance``).

A formula (:class:`fluxpy.optimise.formula.Formula`) is plain data: state array names, counters, scalars and
elementwise statements in Python syntax. This module knows no rule: it translates that text into C
(:func:`c_code`), each number of the step computed in ``double`` and rounded once to the arrays' type ``T`` where an
array meets it, as the NumPy path rounds a Python number against an array. Every step kernel takes an optional
guard ``ok`` (a device scalar, :func:`fluxpy.capturing.guarding`): where it is not finite nothing changes, the
counters included. The counters (``beta^t``, a step count) live in a float64 device array that the step reads
and :func:`optimiser_advance` then advances, so a replayed CUDA graph sees them move.

>>> import types
>>> f = types.SimpleNamespace(state=("v",), inputs=(), counters=(), scalars=(("c", "1 - rho"),),
...                           body=(("v", "v * rho + c * dx"), ("step", "eta * v")))
>>> print(c_code(f, ("eta", "rho")).body)
v = ((v * ((T)rho)) + (((T)c) * dx)); T step = (((T)eta) * v); x = (x - step);
"""
from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..backend import Array, cupy
from ..layout import is_channels_last, like_layout
from . import compiler, halfs

__all__ = ["c_code", "many_defines", "optimiser_step", "optimiser_step_supports", "optimiser_step_many",
           "optimiser_step_many_supports", "optimiser_advance", "finite_total", "finite_total_supports",
           "vector_norm", "vector_norm_supports", "loss_scale_advance", "KERNELS"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))   # what the per-parameter kernel takes
_C_FUNCTIONS = {"sqrt": "sqrt", "abs": "fabs", "sign": "fx_sign", "maximum": "fx_max", "minimum": "fx_min",
                "clip": "fx_clip", "where": "fx_where"}
_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Eq: "==", ast.NotEq: "!=",
              ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.And: "&&", ast.Or: "||"}


def _c(expr: str, numbers: frozenset, cast: str) -> str:
    """The C of one formula expression, every number (and literal) in it cast to ``cast``: the compute type in an
    element's statement, ``double`` elsewhere."""

    def go(n):
        if isinstance(n, ast.Constant):
            return f"(({cast}){int(n.value) if isinstance(n.value, bool) else repr(n.value)})"
        if isinstance(n, ast.Name):
            return f"(({cast}){n.id})" if cast != "double" and n.id in numbers else n.id
        if isinstance(n, ast.BinOp) and type(n.op) in _OPERATORS:
            return f"({go(n.left)} {_OPERATORS[type(n.op)]} {go(n.right)})"
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return f"(-{go(n.operand)})"
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            return f"(!{go(n.operand)})"
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and type(n.ops[0]) in _OPERATORS:
            return f"({go(n.left)} {_OPERATORS[type(n.ops[0])]} {go(n.comparators[0])})"
        if isinstance(n, ast.BoolOp):
            return "(" + f" {_OPERATORS[type(n.op)]} ".join(go(v) for v in n.values) + ")"
        if isinstance(n, ast.IfExp):
            return f"({go(n.test)} ? {go(n.body)} : {go(n.orelse)})"
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _C_FUNCTIONS and not n.keywords:
            return f"{_C_FUNCTIONS[n.func.id]}({', '.join(go(a) for a in n.args)})"
        raise ValueError(f"an optimiser formula cannot say {ast.unparse(n)!r} (in {expr!r})")
    return go(ast.parse(expr, mode="eval").body)


def _names(expr: str) -> set:
    return {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}


class Code(NamedTuple):
    """A formula in C: ``prologue`` (the step's numbers in double, from ``fx_h`` and ``fx_c``), ``body`` (one
    element's statements over ``x``, ``dx``, the state arrays and the inputs, ending in ``x = x - step``) and
    ``advance`` (the counters' next values, from the numbers of the prologue, written to ``fx_c``)."""
    prologue: str
    body: str
    advance: str


def c_code(formula: Any, hyper: Sequence[str], hyper_at: str = "fx_h.v[{i}]", compute: str = "T",
           store: str = "") -> Code:
    """``formula`` (its hyperparameters named ``hyper``, in the order a kernel receives them, each read from
    ``hyper_at``) as C computing in the type ``compute``; ``store`` is the statement that writes ``x`` back after
    the step (none where ``x`` is a reference to the parameter)."""
    counters = [name for name, _ in formula.counters]
    numbers = frozenset(hyper) | frozenset(counters) | {name for name, _ in formula.scalars}

    def numbers_for(exprs):
        """The loads and scalars that ``exprs`` read, in order (what a kernel would not use is left out)."""
        need = set().union(*(_names(e) for e in exprs))
        for name, e in reversed(formula.scalars):
            if name in need:
                need |= _names(e)
        loads = [f"const double {h} = {hyper_at.format(i=i)};" for i, h in enumerate(hyper) if h in need]
        loads += [f"const double {c} = fx_c[{i}];" for i, c in enumerate(counters) if c in need]
        return loads + [f"const double {n} = {_c(e, numbers, 'double')};" for n, e in formula.scalars if n in need]
    prologue = numbers_for([e for _, e in formula.body])
    arrays = {"x", "dx", *formula.state, *formula.inputs}
    body, declared, close = [], set(), 0
    for target, expr in formula.body:
        if target == "if":
            body.append(f"if ({_c(expr, numbers, compute)}) {{")
            close += 1
            continue
        text = _c(expr, numbers, compute)
        if target in arrays or target in declared:
            body.append(f"{target} = {text};")
        else:
            declared.add(target)
            body.append(f"{compute} {target} = {text};")
    body.append("x = (x - step);" + (f" {store}" if store else "") + "}" * close)
    advance = numbers_for([e for _, e in formula.counters])
    advance += [f"const double fx_next{i} = {_c(e, numbers, 'double')};"
                for i, (_, e) in enumerate(formula.counters)]
    advance += [f"fx_c[{i}] = fx_next{i};" for i in range(len(counters))]
    return Code(" ".join(prologue), " ".join(body), " ".join(advance))


def _numbers_table(values: Sequence[float]) -> np.ndarray:
    """The hyperparameters as the ``Numbers`` struct the kernels take by value."""
    table = np.zeros(1, np.dtype([("v", np.float64, (max(len(values), 1),))]))
    table["v"][0, :len(values)] = values
    return table


def _guard(ok):
    """The guard flag as a float64 CuPy array of one element (read through a pointer), or None."""
    if ok is None:
        return None
    if type(ok) is not cupy.ndarray or ok.size != 1:
        raise TypeError(f"an update kernel's ok must be a CuPy array of one element, got {type(ok).__name__}")
    return ok if ok.dtype == np.float64 else ok.astype(np.float64)


# -- one parameter per launch ---------------------------------------------------------------------------------

_elementwise: dict = {}


def _hyper_params(hyper):
    """The hyperparameters as ElementwiseKernel scalars (numbers in the call, never a host-to-device copy)."""
    return [f"float64 fx_h{i}" for i in range(len(hyper))]


def _step_kernel(formula, hyper, guarded):
    key = (formula, hyper, guarded)
    k = _elementwise.get(key)
    if k is None:
        code = c_code(formula, hyper, "fx_h{i}")
        ins = ["T dx"] + [f"raw T fx_in_{n}" for n in formula.inputs] + _hyper_params(hyper)
        ins += ["raw float64 fx_c"] if formula.counters else []
        ins += ["raw float64 fx_ok"] if guarded else []
        outs = ["T x"] + [f"T {n}" for n in formula.state]
        inputs = " ".join(f"const T {n} = fx_in_{n}[0];" for n in formula.inputs)
        body = f"{code.prologue} {inputs} {code.body}"
        body = f"if (isfinite(fx_ok[0])) {{ {body} }}" if guarded else f"{{ {body} }}"
        k = _elementwise[key] = cupy.ElementwiseKernel(", ".join(ins), ", ".join(outs), body,
                                                       "fluxpy_optimiser_step",
                                                       preamble=compiler.source("optimise.cuh"))
    return k


def optimiser_step(x: Array, formula: Any, dx: Array, states: Sequence[Array], inputs: Sequence[Array],
                   hyper: dict, counters: Array | None, ok: Array | None = None) -> None:
    """One step of ``formula`` for the parameter ``x`` in place, in one kernel: its ``states`` (the formula's state
    arrays) and ``inputs`` (0-d arrays), the hyperparameters ``hyper`` (name -> number) and the device
    ``counters`` (read, not advanced: :func:`optimiser_advance`); with ``ok`` only where it is finite.

    >>> optimiser_step.__name__
    'optimiser_step'
    """
    names = tuple(hyper)
    kernel = _step_kernel(formula, names, ok is not None)
    args = [dx, *inputs, *(np.float64(hyper[n]) for n in names)] + ([counters] if formula.counters else [])
    kernel(*args, *([_guard(ok)] if ok is not None else []), x, *states)


def optimiser_step_supports(x: Any, formula: Any, dx: Any, states: Sequence, inputs: Sequence, *_: Any) -> bool:
    """CuPy float32/float64 parameters whose gradient, state arrays and inputs share their dtype (any layout)."""
    nd = cupy.ndarray
    return type(x) is nd and type(dx) is nd and x.dtype in _FLOATS and dx.dtype == x.dtype and dx.shape == x.shape \
        and all(type(s) is nd and s.dtype == x.dtype and s.shape == x.shape for s in states) \
        and all(type(a) is nd and a.dtype == x.dtype and a.size == 1 for a in inputs)


_advance_kernels: dict = {}


def optimiser_advance(counters: Array, formula: Any, hyper: dict, ok: Array | None = None) -> None:
    """The counters of ``formula`` (a float64 device array) moved on by one step, in place, one thread; with
    ``ok`` only where it is finite (a skipped step leaves them).

    >>> optimiser_advance.__name__
    'optimiser_advance'
    """
    names = tuple(hyper)
    key = (formula, names, ok is not None)
    k = _advance_kernels.get(key)
    if k is None:
        code = c_code(formula, names, "fx_h{i}").advance
        ins = ", ".join(_hyper_params(names) + (["raw float64 fx_ok"] if ok is not None else []))
        body = f"if (isfinite(fx_ok[0])) {{ {code} }}" if ok is not None else f"{{ {code} }}"
        k = _advance_kernels[key] = cupy.ElementwiseKernel(ins, "raw float64 fx_c", body, "fluxpy_optimiser_advance")
    k(*(np.float64(hyper[n]) for n in names), *([_guard(ok)] if ok is not None else []), counters, size=1)


# -- a list of parameters per launch ---------------------------------------------------------------------------

CAP = 96            # tensors per launch at most (and per launch of finite_total)
_PARAMETER_BYTES = 4096 - 256   # CUDA's classic limit on a kernel's parameters, less the numbers and pointers
_THREADS = 256
_ITEMS = 4          # elements per thread in a block's chunk of the concatenated index space
_MAX_BLOCKS = 65535  # more elements than that many chunks: the blocks stride over them


def _cap(slots):
    """Tensors per launch for ``slots`` pointers each: the table (pointers and start offsets) stays inside CUDA's
    classic 4 KiB of kernel parameters."""
    return min(CAP, _PARAMETER_BYTES // (8 * (slots + 1)) - 1)


def many_defines(formula: Any, hyper: Sequence[str], dtype: Any) -> dict:
    """The defines that make ``cuda/optimise_many.cu`` the multi-tensor step of ``formula`` (hyperparameters named
    ``hyper``) for parameters of ``dtype`` (float16, bfloat16, float32 or float64): ``x`` and ``dx`` stored as
    ``T`` and computed in ``C`` (float32 for the halves), the state arrays and inputs stored in ``C``, ``x`` rounded
    once to ``T`` after the step (a half parameter's NumPy path: the step of its float32 copy, rounded once).

    >>> import types
    >>> f = types.SimpleNamespace(state=(), inputs=(), counters=(), scalars=(), body=(("step", "eta * dx"),))
    >>> many_defines(f, ("eta",), np.float32)["FX_BODY"]
    'C step = (((C)eta) * dx); x = (x - step); ((T*)fx_p[0])[j] = STORE(x);'
    """
    code = c_code(formula, hyper, compute="C", store="((T*)fx_p[0])[j] = STORE(x);")
    slots = 2 + len(formula.state) + len(formula.inputs)
    element = ["C x = LOAD(((const T*)fx_p[0])[j]);", "const C dx = LOAD(((const T*)fx_p[1])[j]);"]
    element += [f"C& {n} = ((C*)fx_p[{i}])[j];" for i, n in enumerate(formula.state, start=2)]
    element += [f"const C {n} = ((const C*)fx_p[{i}])[0];"
                for i, n in enumerate(formula.inputs, start=2 + len(formula.state))]
    return {"FX_SLOTS": slots, "FX_NUMBERS": len(hyper), "CAP": _cap(slots), "ITEMS": _ITEMS,
            "FX_PROLOGUE": code.prologue or ";", "FX_ELEMENT": " ".join(element), "FX_BODY": code.body,
            **halfs.dtype_defines(dtype)}


def SOURCE_VARIANTS(formulas: Sequence = ()):
    """``(source, defines)`` of the ``cuda/`` kernels this module launches: the finiteness check for every dtype,
    and for each ``(formula, hyperparameter names)`` in ``formulas`` (the rules live above the kernels, so the
    caller names them) the multi-tensor step for every dtype.

    >>> len(list(SOURCE_VARIANTS()))
    4
    """
    for dtype in halfs.KERNEL_DTYPES:
        yield "optimise_finite.cu", {"CAP": CAP, **halfs.dtype_defines(dtype)}
    for formula, hyper in formulas:
        for dtype in halfs.KERNEL_DTYPES:
            yield "optimise_many.cu", many_defines(formula, hyper, dtype)


_many_defines: dict = {}


def _many_kernel(formula, hyper, dtype):
    """``(kernel, slots)`` of :func:`many_defines`; the defines are kept per formula, so a step does not translate
    the formula to C again (the compiled kernel is the compiler's, per device). The key holds every value the
    defines are made of."""
    key = (formula, hyper, np.dtype(dtype), CAP, _ITEMS)
    defines = _many_defines.get(key)
    if defines is None:
        defines = _many_defines[key] = many_defines(formula, hyper, dtype)
    return compiler.function("optimise_many.cu", "fx_step_many", defines), defines["FX_SLOTS"]


def optimiser_step_many(x: Array, formula: Any, xs: Sequence[Array], dxs: Sequence[Array], states: Sequence,
                        inputs: Sequence, hyper: dict, counters: Array | None, ok: Array | None = None,
                        memo: dict | None = None) -> None:
    """One step of ``formula`` for every parameter ``xs[k]`` (gradient ``dxs[k]``, state arrays ``states[k]``,
    inputs ``inputs[k]``) in place, in few launches, with the arithmetic of :func:`optimiser_step`
    (which it replaces for parameters sharing the hyperparameters and the counters; the counters are read, not
    advanced; about 50 to 96 parameters a launch, as many as the table of pointers for the formula's arrays fits
    in 4 KiB). A gradient laid out unlike its parameter is copied first. The parameters must not share memory
    with one another. ``x`` is ``xs[0]`` (for :func:`fluxpy.kernels.find`). ``memo``: a dict the caller keeps with
    lists ``xs`` and ``states`` that stay the same from step to step (the same arrays), where the parameters' and
    state arrays' checks and addresses are kept (:class:`_Kept`), so a step writes only the gradients' (and
    inputs') addresses into its tables.

    >>> optimiser_step_many.__name__
    'optimiser_step_many'
    """
    names = tuple(hyper)
    kernel, slots = _many_kernel(formula, names, xs[0].dtype)
    cap = _cap(slots)
    kept = _kept(memo, xs, states)
    numbers = _numbers_table([hyper[n] for n in names])
    tail = (np.uint64(0) if counters is None else counters, np.uint64(0) if ok is None else _guard(ok))
    strided = []   # contiguous copies of strided gradients, alive until their launch is queued
    for lo in range(0, len(xs), cap):
        part = range(lo, min(lo + cap, len(xs)))
        count = len(part)
        table = kept.table(slots, cap, lo, count)
        for n, k in enumerate(part):
            a, d = xs[k], dxs[k]
            table[cap + n] = _address(d if _same_layout(d, a) else _copy_like(d, a, strided))
            if inputs[k]:
                table[(2 + len(states[k])) * cap + n:slots * cap:cap] = [_address(i) for i in inputs[k]]
        total = int(table[slots * cap + count])
        if total:
            blocks = min(-(-total // (_THREADS * _ITEMS)), _MAX_BLOCKS)
            view = table.view(np.dtype([("t", np.int64, (slots * cap + cap + 1,))]))
            compiler.launch(kernel, blocks, _THREADS, (view, np.int32(count), numbers) + tail)


class _Kept:
    """The parameters ``xs`` and state arrays ``states`` of :func:`optimiser_step_many` with what is known of them
    from one step to the next: whether they pass :func:`optimiser_step_many_supports`' checks (``ok``), their
    addresses and sizes, and, per launch shape, the tables of pointers with those filled in (a step copies one and
    writes the gradients' addresses into it)."""
    __slots__ = ("xs", "states", "ok", "dtype", "_tables")

    def __init__(self, xs, states):
        self.xs, self.states = tuple(xs), tuple(tuple(s) for s in states)
        self.ok = _static_checks(self.xs, self.states)
        self.dtype = self.xs[0].dtype if self.xs else None
        self._tables = {}

    def same(self, xs, states) -> bool:
        """Whether ``xs`` and ``states`` hold the same arrays (by identity) as when this was made."""
        if len(xs) != len(self.xs) or len(states) != len(self.states):
            return False
        for a, b in zip(xs, self.xs):
            if a is not b:
                return False
        for s, t in zip(states, self.states):
            if len(s) != len(t) or any(a is not b for a, b in zip(s, t)):
                return False
        return True

    def table(self, slots, cap, lo, count):
        """A new table of pointers for parameters ``lo .. lo + count - 1`` (a launch of ``cap`` slots each), the
        parameters' and state arrays' addresses and the running sizes filled in."""
        key = (slots, cap, lo, count)
        base = self._tables.get(key)
        if base is None:
            base = self._tables[key] = np.zeros(slots * cap + cap + 1, np.int64)
            for n in range(count):
                k = lo + n
                base[n] = _address(self.xs[k])
                if self.states[k]:
                    base[2 * cap + n:(2 + len(self.states[k])) * cap + n:cap] = [_address(b) for b in self.states[k]]
            np.cumsum([self.xs[lo + n].size for n in range(count)], out=base[slots * cap + 1:slots * cap + 1 + count])
        return base.copy()


def _kept(memo, xs, states) -> _Kept:
    """The :class:`_Kept` of ``xs`` and ``states``: the one in ``memo`` where it holds these arrays, else a new one
    (kept there)."""
    kept = None if memo is None else memo.get("kept")
    if kept is None or not kept.same(xs, states):
        kept = _Kept(xs, states)
        if memo is not None:
            memo["kept"] = kept
    return kept


def _address(a):
    """The device address of ``a``'s first element."""
    return a.data.ptr


def _same_layout(d, a):
    """Whether ``d`` lies in memory as the dense array ``a`` does, element for element (so one flat index reads
    both, whatever their item sizes)."""
    if a.flags.c_contiguous:
        return d.flags.c_contiguous
    return [s // d.itemsize for s in d.strides] == [s // a.itemsize for s in a.strides]


def _copy_like(d, a, keep):
    """``d`` copied into ``a``'s layout (C order or channels-last), kept alive in ``keep``."""
    d = like_layout(d, a)
    keep.append(d)
    return d


def _dense(a):
    """C-contiguous or channels-last: every element once, in a layout the flat kernels read as one run."""
    return a.flags.c_contiguous or is_channels_last(a)


def optimiser_step_many_supports(x: Any, formula: Any, xs: Sequence, dxs: Sequence, states: Sequence,
                                 inputs: Sequence, memo: dict | None = None, *_: Any) -> bool:
    """Lists of one length (at least one) of CuPy arrays: parameters and gradients of one float dtype (float16,
    bfloat16, float32 or float64), state arrays and inputs in its compute dtype (float32 for the halves), ``xs``
    and the state arrays dense (C order or channels-last) and laid out alike, every array of its parameter's
    shape, inputs of one element. The checks of ``xs`` and ``states`` are kept in ``memo`` where it is given (see
    :func:`optimiser_step_many`); the gradients and inputs are checked at every call."""
    n = len(xs)
    if n == 0 or len(dxs) != n or len(states) != n or len(inputs) != n:
        return False
    kept = _kept(memo, xs, states)
    if not kept.ok:
        return False
    nd, dt = cupy.ndarray, kept.dtype
    ct = halfs.compute_dtype(dt)
    for a, d, i in zip(xs, dxs, inputs):
        if type(d) is not nd or d.dtype != dt or d.shape != a.shape:
            return False
        if i and any(type(b) is not nd or b.dtype != ct or b.size != 1 for b in i):
            return False
    return True


def _static_checks(xs, states) -> bool:
    """:func:`optimiser_step_many_supports`' checks of the parameters and state arrays."""
    nd = cupy.ndarray
    if not xs or type(xs[0]) is not nd or xs[0].dtype not in halfs.KERNEL_DTYPES:
        return False
    dt = xs[0].dtype
    ct = halfs.compute_dtype(dt)   # the state's dtype: float32 for a half parameter
    for a, s in zip(xs, states):
        if type(a) is not nd or a.dtype != dt or not _dense(a):
            return False
        if any(type(b) is not nd or b.dtype != ct or b.shape != a.shape or not _same_layout(b, a) for b in s):
            return False
    return True


# -- the checks of a training step -----------------------------------------------------------------------------

_FINITE_TABLE = np.dtype([("p", np.int64, (CAP,)), ("n", np.int64, (CAP,))])


def finite_total_supports(x: Any, arrays: Sequence) -> bool:
    """The lists :func:`finite_total` takes: CuPy float16, bfloat16, float32 or float64 arrays (``x`` is the first,
    for the array module)."""
    return all(type(a) is cupy.ndarray and a.dtype in halfs.KERNEL_DTYPES for a in arrays)


def finite_total(x: Any, arrays: Sequence[Array]) -> Array:
    """A 0-d float64 CuPy array: 0 when every entry of ``arrays`` is finite, NaN otherwise; one launch per 96
    arrays of a dtype, no sync (the caller reads it once). Strided arrays are copied to C order first.

    >>> finite_total.__name__
    'finite_total'
    """
    out = cupy.zeros((), dtype=cupy.float64)
    by_dtype: dict = {}
    for a in arrays:
        if a.size:   # a strided gradient (a transposed matmul's) is read through a contiguous copy
            by_dtype.setdefault(a.dtype, []).append(a if _dense(a) else cupy.ascontiguousarray(a))   # flat reads
    for dtype, group in by_dtype.items():
        k = compiler.function("optimise_finite.cu", "fx_nonfinite", {"CAP": CAP, **halfs.dtype_defines(dtype)})
        for lo in range(0, len(group), CAP):
            part = group[lo:lo + CAP]
            table = np.zeros(1, _FINITE_TABLE)
            table["p"][0, :len(part)] = [a.data.ptr for a in part]
            table["n"][0, :len(part)] = [a.size for a in part]
            blocks = min(-(-max(a.size for a in part) // 1024), 64)
            compiler.launch(k, (blocks, len(part)), 256, (table, out))
    return out


def vector_norm(x: Array, p: float) -> Array:
    """The 2-norm of every entry of ``x`` as a 0-d array on the device, by reductions (``cupy.linalg.norm`` takes
    it through cuBLAS, which a CuPy graph capture refuses); ClipNorm's norm.

    >>> vector_norm.__name__
    'vector_norm'
    """
    return cupy.sqrt(cupy.square(x).sum())


def vector_norm_supports(x: Any, p: Any) -> bool:
    """CuPy float arrays and ``p == 2`` (the other norms are reductions in ``cupy.linalg.norm`` already)."""
    return type(x) is cupy.ndarray and x.dtype in halfs.KERNEL_DTYPES and p == 2


_loss_scale = []


def loss_scale_advance(scale: Array, good: Array, flag: Array, applied: Array, interval: int,
                       max_scale: float) -> None:
    """A dynamic loss scale's step on the device (fluxpy.DynamicLossScale): where ``flag`` is not finite (an
    overflow) the float32 ``scale`` halved and the int32 count ``good`` reset; else, where ``applied`` is finite
    (the update ran), one more good step, ``scale`` doubled (at most to ``max_scale``) after ``interval`` of them in
    a row. One thread, no sync (captured with a step).

    >>> loss_scale_advance.__name__
    'loss_scale_advance'
    """
    if not _loss_scale:
        _loss_scale.append(cupy.ElementwiseKernel(
            "raw float64 flag, raw float64 applied, int32 interval, float32 max_scale",
            "raw float32 scale, raw int32 good",
            "if (!isfinite(flag[0])) { scale[0] *= 0.5f; good[0] = 0; }"
            " else if (isfinite(applied[0])) {"
            "  good[0] += 1; if (good[0] >= interval) { scale[0] = fminf(scale[0] * 2.0f, max_scale); good[0] = 0; } }",
            "fluxpy_loss_scale_advance"))
    _loss_scale[0](_guard(flag), _guard(applied), np.int32(interval), np.float32(max_scale), scale, good, size=1)


KERNELS = {
    "optimiser_step": (optimiser_step, optimiser_step_supports),
    "optimiser_step_many": (optimiser_step_many, optimiser_step_many_supports),
    "optimiser_advance": (optimiser_advance, None),
    "finite_total": (finite_total, finite_total_supports),
    "vector_norm": (vector_norm, vector_norm_supports),
    "loss_scale_advance": (loss_scale_advance, None),
}
