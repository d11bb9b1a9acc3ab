"""Fused elementwise CUDA kernels compiled from scalar Python functions.

``fuse(f, *dtypes)`` traces the scalar function ``f`` (the one given to
:func:`fluxpy.broadcast`) with symbolic scalars (:class:`Sym`), each operation writing one
line of C, and builds

- one ``cupy.ElementwiseKernel`` for the forward pass ``y = f(x1, ..., xn)`` and
- one for the pullback: inputs ``dy, x1, ..., xn``, outputs the *unreduced* cotangents
  ``dy * df/dxi`` for the arguments that need one. The derivative expressions come from the
  same dual numbers the CPU path uses (:class:`fluxpy.dual.Dual` over ``Sym`` values), so
  the two paths compute the same function; the cotangents are then summed to each operand's
  shape by :func:`fluxpy.unbroadcast` (the mapreducedim kernel).

CuPy's ``ElementwiseKernel`` broadcasts its inputs, so operands keep their own shapes and no
broadcast copy is made. Kernels are cached by (function, argument dtypes, needs mask); a
function is keyed by its code, defaults and closure values, so a lambda re-created on every
call (with the same captured numbers) still hits the cache.

What is traced: ``+ - * / **`` (integer and float powers), unary ``-``, ``abs``, comparisons
(bool values), ``np.exp log sqrt tanh sin cos log1p expm1 square maximum minimum where sign
absolute negative reciprocal logical_and/or/not``, Python/NumPy numbers. Anything else (Python
``if`` on a value, ``float(x)``, an array captured in a closure, an unknown ufunc) stops the trace,
and the kernel runs ``f`` (and its dual numbers) op by op on the CuPy arrays instead (correct,
slower); that is noted once per function with a :class:`FusionFallbackWarning`.

All arithmetic runs in the result dtype's compute type: float32 for float16, bfloat16 and float32,
float64 for float64 (other dtypes take the generic path). Half arrays are passed to the kernel as
their 16 bits (``uint16`` views) and converted on load and store (:mod:`fluxpy.kernels.halfs`), so no
CUDA half header is needed. The module imports without CuPy.

>>> import numpy as np
>>> k = trace_source(lambda x, b: np.tanh(x * 1.5 + b), [np.float32, np.float32])
>>> print(k.forward)
float t0 = x0 * ((float)1.5);
float t1 = t0 + x1;
float t2 = tanhf(t1);
y = t2;
"""
from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..backend import Array, cupy, reduced_axes
from ..layout import is_channels_last, keeping_layout, like_layout
from ..dual import Dual, cotangents
from . import halfs
from . import compiler

__all__ = ["Sym", "Untraceable", "FusionFallbackWarning", "trace_source", "fused_forward", "fused_pullback",
           "stats", "clear_cache", "bias_act_forward", "bias_act_output_backward", "bias_act_generic_backward",
           "adam_update", "momentum_update", "descent_update", "adagrad_update", "adadelta_update", "adamax_update",
           "oadam_update", "nadam_update", "radam_update", "adabelief_update", "lion_update", "sign_decay_update",
           "sign_decay_gradient", "accum_grad_update", "update_supports", "KERNELS"]

stats = {"traces": 0, "kernels": 0, "fallbacks": 0}
"""Counters: functions traced, ElementwiseKernels built, calls that fell back to the generic path."""


class Untraceable(Exception):
    """Raised inside a trace when ``f`` uses something that cannot be compiled."""


class FusionFallbackWarning(UserWarning):
    """Warns that ``broadcast(f, ...)`` on CuPy arrays could not fuse ``f`` and runs it op by op instead."""


# ---------------------------------------------------------------------------------------------
# Symbolic scalars

_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}   # the non-half kernels' dtypes
# what the traced (broadcast) kernels compute each storage dtype in, and the halves' load/store functions
_COMPUTE = {**_CTYPE, np.dtype(np.float16): "float", halfs.BFLOAT16: "float"}
_HALF_IO = halfs.CONVERT   # half dtype -> (load, store) function names in halfs.CONVERSIONS
_FLOAT_FN = {  # ufunc -> (float name, double name)
    np.exp: ("expf", "exp"), np.log: ("logf", "log"), np.sqrt: ("sqrtf", "sqrt"), np.tanh: ("tanhf", "tanh"),
    np.sin: ("sinf", "sin"), np.cos: ("cosf", "cos"), np.log1p: ("log1pf", "log1p"),
    np.expm1: ("expm1f", "expm1"), np.absolute: ("fabsf", "fabs"),
}
_CMP = {np.greater: ">", np.greater_equal: ">=", np.less: "<", np.less_equal: "<=", np.equal: "==",
        np.not_equal: "!="}


class _Trace:
    """The lines of C a trace has written; each value is a fresh ``const`` local (common ones shared)."""

    def __init__(self, ctype):
        self.ctype = ctype
        self.lines = []
        self.memo = {}

    def emit(self, kind, expr):
        key = (kind, expr)
        s = self.memo.get(key)
        if s is None:
            name = f"t{len(self.lines)}"
            self.lines.append(f"{self.ctype if kind == 'f' else 'bool'} {name} = {expr};")
            s = self.memo[key] = Sym(self, name, kind)
        return s

    def const(self, c):
        """C text for a Python/NumPy number, in the compute type (or bool)."""
        if isinstance(c, (bool, np.bool_)):
            return "true" if c else "false"
        f = float(c)
        if math.isnan(f):
            if self.ctype == "float":
                return "__int_as_float(0x7fc00000)"
            return "__longlong_as_double(0x7ff8000000000000LL)"
        if math.isinf(f):
            if self.ctype == "float":
                return f"(({'-' if f < 0 else ''}__int_as_float(0x7f800000)))"
            return f"(({'-' if f < 0 else ''}__longlong_as_double(0x7ff0000000000000LL)))"
        if isinstance(c, (int, np.integer)):
            return f"(({self.ctype}){int(c)})"
        return f"(({self.ctype}){f!r})"

    def fn(self, ufunc):
        names = _FLOAT_FN[ufunc]
        return names[0] if self.ctype == "float" else names[1]


_NUMBER = (int, float, np.integer, np.floating, np.bool_)


class Sym:
    """A symbolic scalar in a trace: a C local ``name`` of kind ``'f'`` (compute type) or ``'b'`` (bool).

    Arithmetic, comparisons and the NumPy ufuncs listed in the module docstring return new
    ``Sym`` values and write one line of C each. Using a ``Sym`` as a Python bool or number
    raises :class:`Untraceable`.
    """
    __slots__ = ("tr", "name", "kind")
    __array_priority__ = 1500.0

    def __init__(self, tr: _Trace, name: str, kind: str = "f") -> None:
        self.tr = tr
        self.name = name
        self.kind = kind

    def __repr__(self):
        return f"Sym({self.name})"

    # values as C text in the compute type or as a condition
    def f(self) -> str:
        """This value as C text in the compute type."""
        return self.name if self.kind == "f" else f"(({self.tr.ctype}){self.name})"

    def b(self) -> str:
        """This value as C text of a condition (bool)."""
        return self.name if self.kind == "b" else f"({self.name} != 0)"

    def _text(self, o):
        """``o`` as C text in the compute type, or None if it cannot join a trace (NotImplemented handled by caller)."""
        if type(o) is Sym:
            if o.tr is not self.tr:
                raise Untraceable("values from two traces")
            return o.f()
        if isinstance(o, _NUMBER):
            return self.tr.const(o)
        if isinstance(o, np.ndarray) and o.ndim == 0:
            return self.tr.const(o[()])
        return None

    def _binary(self, o, fmt, reverse=False, simplify=None):
        if simplify is not None and isinstance(o, _NUMBER) and not isinstance(o, (bool, np.bool_)):
            r = simplify(o)
            if r is not None:
                return r
        t = self._text(o)
        if t is None:
            if _is_foreign(o):
                return NotImplemented
            raise Untraceable(f"cannot combine a traced scalar with {type(o).__name__}")
        a, b = (t, self.f()) if reverse else (self.f(), t)
        return self.tr.emit("f", fmt.format(a, b))

    # exact simplifications only: x + 0, x * 1, x - 0, x / 1 (0 * x is kept: inf * 0 is nan)
    def __add__(self, o):
        return self._binary(o, "{} + {}", simplify=lambda c: self._as_f() if c == 0 else None)

    def __radd__(self, o):
        return self._binary(o, "{} + {}", True, simplify=lambda c: self._as_f() if c == 0 else None)

    def __sub__(self, o):
        return self._binary(o, "{} - {}", simplify=lambda c: self._as_f() if c == 0 else None)

    def __rsub__(self, o):
        return self._binary(o, "{} - {}", True)

    def __mul__(self, o):
        return self._binary(o, "{} * {}", simplify=lambda c: self._as_f() if c == 1 else None)

    def __rmul__(self, o):
        return self._binary(o, "{} * {}", True, simplify=lambda c: self._as_f() if c == 1 else None)

    def __truediv__(self, o):
        return self._binary(o, "{} / {}", simplify=lambda c: self._as_f() if c == 1 else None)

    def __rtruediv__(self, o):
        return self._binary(o, "{} / {}", True)

    def __pow__(self, o):
        if isinstance(o, _NUMBER) and not isinstance(o, (bool, np.bool_)) and float(o).is_integer() \
                and abs(float(o)) <= 4:
            n = int(o)
            if n == 0:
                return self.tr.emit("f", self.tr.const(1))
            p = self._as_f()
            for _ in range(abs(n) - 1):
                p = self.tr.emit("f", f"{p.name} * {self.f()}")
            return self.tr.emit("f", f"{self.tr.const(1)} / {p.name}") if n < 0 else p
        if isinstance(o, _NUMBER) and float(o) == 0.5:
            return self.tr.emit("f", f"{self.tr.fn(np.sqrt)}({self.f()})")
        return self._pow(self.f(), o, reverse=False)

    def __rpow__(self, o):
        return self._pow(self.f(), o, reverse=True)

    def _pow(self, mine, o, reverse):
        t = self._text(o)
        if t is None:
            if _is_foreign(o):
                return NotImplemented
            raise Untraceable(f"cannot raise to the power of {type(o).__name__}")
        p = "powf" if self.tr.ctype == "float" else "pow"
        a, b = (t, mine) if reverse else (mine, t)
        return self.tr.emit("f", f"{p}({a}, {b})")

    def _as_f(self):
        return self if self.kind == "f" else self.tr.emit("f", self.f())

    def __neg__(self):
        return self.tr.emit("f", f"-{self.f()}")

    def __pos__(self):
        return self._as_f()

    def __abs__(self):
        return self.tr.emit("f", f"{self.tr.fn(np.absolute)}({self.f()})")

    def erf(self):
        """The error function of this value (CUDA's ``erff``/``erf``): :func:`fluxpy.ops.special.erf` of a ``Sym``."""
        return self.tr.emit("f", f"{'erff' if self.tr.ctype == 'float' else 'erf'}({self.f()})")

    def _compare(self, o, op, reverse=False):
        t = self._text(o)
        if t is None:
            if _is_foreign(o):
                return NotImplemented
            raise Untraceable(f"cannot compare a traced scalar with {type(o).__name__}")
        a, b = (t, self.f()) if reverse else (self.f(), t)
        return self.tr.emit("b", f"{a} {op} {b}")

    __gt__ = lambda s, o: s._compare(o, ">")
    __ge__ = lambda s, o: s._compare(o, ">=")
    __lt__ = lambda s, o: s._compare(o, "<")
    __le__ = lambda s, o: s._compare(o, "<=")
    __eq__ = lambda s, o: s._compare(o, "==")
    __ne__ = lambda s, o: s._compare(o, "!=")
    __hash__ = object.__hash__

    def __invert__(self):
        if self.kind != "b":
            raise Untraceable("~ on a float value")
        return self.tr.emit("b", f"!{self.name}")

    def _logic(self, o, op):
        if type(o) is Sym:
            ob = o.b()
        elif isinstance(o, (bool, np.bool_)):
            ob = "true" if o else "false"
        else:
            raise Untraceable("logical op on a non-bool")
        return self.tr.emit("b", f"{self.b()} {op} {ob}")

    __and__ = __rand__ = lambda s, o: s._logic(o, "&&")
    __or__ = __ror__ = lambda s, o: s._logic(o, "||")

    def __bool__(self):
        raise Untraceable("Python control flow on a traced value (if/and/or/while)")

    def __float__(self):
        raise Untraceable("float() of a traced value")

    __int__ = __index__ = __float__

    def __array__(self, dtype=None, copy=None):
        raise Untraceable("a traced value used as an array")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if any(_is_foreign(i) for i in inputs):
            return NotImplemented
        if method != "__call__" or kwargs:
            raise Untraceable(f"np.{ufunc.__name__}.{method} with {sorted(kwargs)}")
        return _ufunc(self.tr, ufunc, inputs)

    def __array_function__(self, func, types, args, kwargs):
        if any(_is_foreign(a) for a in args):
            return NotImplemented
        if func is np.where and len(args) == 3 and not kwargs:
            return _where(self.tr, *args)
        if func is np.clip and len(args) == 3 and not kwargs:
            return _ufunc(self.tr, np.minimum, (_ufunc(self.tr, np.maximum, (args[0], args[1])), args[2]))
        raise Untraceable(f"np.{func.__name__} is not supported in a fused kernel")


def _is_foreign(o):
    """Values another type handles (dual numbers over Syms): let their methods run."""
    return type(o).__name__ == "Dual"


def _ftext(tr, a):
    if type(a) is Sym:
        return a.f()
    if isinstance(a, _NUMBER):
        return tr.const(a)
    raise Untraceable(f"{type(a).__name__} in a fused kernel")


def _btext(tr, a):
    if type(a) is Sym:
        return a.b()
    if isinstance(a, (bool, np.bool_)):
        return "true" if a else "false"
    if isinstance(a, _NUMBER):
        return "true" if a else "false"
    raise Untraceable(f"{type(a).__name__} as a condition")


def _ufunc(tr, ufunc, inputs):
    if ufunc in _FLOAT_FN and len(inputs) == 1:
        return tr.emit("f", f"{tr.fn(ufunc)}({_ftext(tr, inputs[0])})")
    if ufunc in _CMP and len(inputs) == 2:
        return tr.emit("b", f"{_ftext(tr, inputs[0])} {_CMP[ufunc]} {_ftext(tr, inputs[1])}")
    a = inputs[0]
    if ufunc is np.add:
        return a + inputs[1] if type(a) is Sym else inputs[1].__radd__(a)
    if ufunc is np.subtract:
        return a - inputs[1] if type(a) is Sym else inputs[1].__rsub__(a)
    if ufunc is np.multiply:
        return a * inputs[1] if type(a) is Sym else inputs[1].__rmul__(a)
    if ufunc in (np.true_divide, np.divide):
        return a / inputs[1] if type(a) is Sym else inputs[1].__rtruediv__(a)
    if ufunc is np.power:
        return a ** inputs[1] if type(a) is Sym else inputs[1].__rpow__(a)
    if ufunc is np.negative:
        return -a
    if ufunc is np.positive:
        return +a
    if ufunc is np.square:
        x = _ftext(tr, a)
        return tr.emit("f", f"{x} * {x}")
    if ufunc is np.reciprocal:
        return tr.emit("f", f"{tr.const(1)} / {_ftext(tr, a)}")
    if ufunc is np.sign:
        x = _ftext(tr, a)
        return tr.emit("f", f"{x} > 0 ? {tr.const(1)} : ({x} < 0 ? {tr.const(-1)} : {x})")
    if ufunc in (np.maximum, np.minimum):
        x, y = _ftext(tr, a), _ftext(tr, inputs[1])
        op = ">" if ufunc is np.maximum else "<"
        return tr.emit("f", f"({x} != {x} || {x} {op} {y}) ? {x} : {y}")   # NaN wins, as NumPy
    if ufunc is np.logical_not:
        return tr.emit("b", f"!{_btext(tr, a)}")
    if ufunc in (np.logical_and, np.logical_or):
        op = "&&" if ufunc is np.logical_and else "||"
        return tr.emit("b", f"{_btext(tr, a)} {op} {_btext(tr, inputs[1])}")
    raise Untraceable(f"np.{ufunc.__name__} is not supported in a fused kernel")


def _where(tr, cond, a, b):
    if isinstance(cond, (bool, np.bool_)) and type(a) is not Sym and type(b) is not Sym:
        raise Untraceable("np.where on constants")
    return tr.emit("f", f"{_btext(tr, cond)} ? {_ftext(tr, a)} : {_ftext(tr, b)}")


# ---------------------------------------------------------------------------------------------
# Tracing a function into C


class _Source:
    """The C bodies for one (function, dtypes, needs) signature."""

    def __init__(self, forward, backward, grad_index, result_dtype):
        self.forward = forward          # body computing y from x0..xn
        self.backward = backward        # body computing g<i> from dy, x0..xn (None: no gradient needed)
        self.grad_index = grad_index    # argument indices that get an output g<i>
        self.result_dtype = result_dtype

    def __repr__(self):
        return f"_Source(result={self.result_dtype}, grads={self.grad_index})"


def trace_source(f: Callable, dtypes: Sequence, wanted: Sequence[int] = (), dy_dtype: Any = None) -> _Source:
    """C code for ``f`` on arguments of ``dtypes`` (a NumPy dtype per array argument, ``None`` for a
    Python scalar): a :class:`_Source` with the forward body and, when ``wanted`` (argument
    indices) is not empty, the pullback body. Raises :class:`Untraceable` when ``f`` cannot be
    compiled (unsupported construct or result dtype).

    >>> src = trace_source(lambda x: np.maximum(x, 0.0), [np.float64], wanted=(0,), dy_dtype=np.float64)
    >>> print(src.backward)
    bool t0 = x0 > ((double)0.0);
    double t1 = t0 ? x0 : ((double)0.0);
    double t2 = t0 ? ((double)1) : ((double)0);
    g0 = dy * (double)(t2);
    """
    dtypes = [None if d is None else np.dtype(d) for d in dtypes]
    rdt = _traced_dtype(f, dtypes)
    stats["traces"] += 1
    tr, out = _run_trace(f, dtypes, rdt, lambda tr, i: Sym(tr, _arg_name(dtypes, rdt, i)))
    if type(out) is not Sym:
        raise Untraceable("f does not return a traced value")
    forward = "\n".join(tr.lines + [f"y = {_store(rdt, out.f())};"])
    backward = None
    grad_index = ()
    if wanted:
        backward, grad_index = _backward_source(f, dtypes, rdt, wanted, dy_dtype)
    return _Source(forward, backward, grad_index, rdt)


def _traced_dtype(f, dtypes):
    """The dtype of ``f`` on ``dtypes``; :class:`Untraceable` where ``f`` fails or its dtype is not one that
    fused kernels compute in."""
    try:
        rdt = halfs.result_dtype(f, dtypes)
    except Exception as err:
        raise Untraceable(f"f fails on NumPy arrays of {dtypes}: {err!r}") from None
    if rdt not in _COMPUTE:
        raise Untraceable(f"result dtype {rdt} (fused kernels take float16, bfloat16, float32 or float64)")
    return rdt


def _arg_name(dtypes, rdt, i):
    """The C name of argument ``i``: ``a<i>`` (its converted copy) when its dtype is not ``rdt`` or is a half,
    else ``x<i>``."""
    return f"a{i}" if _converted(dtypes[i], rdt) else f"x{i}"


def _converted(d, rdt):
    """Whether an argument of dtype ``d`` (None: a Python number, passed in the compute type) is converted to the
    compute type first."""
    return d is not None and (d != rdt or d in _HALF_IO)


def _load(d, name):
    """C text of the storage value ``name`` of dtype ``d`` in its compute type."""
    return f"{_HALF_IO[d][0]}({name})" if d in _HALF_IO else name


def _store(d, text):
    """C text storing the compute-type value ``text`` as dtype ``d``."""
    return f"{_HALF_IO[d][1]}({text})" if d in _HALF_IO else text


def _run_trace(f, dtypes, rdt, make):
    """One trace of ``f`` on the arguments ``make(tr, i)``: ``(trace, output)``."""
    ctype = _COMPUTE[rdt]
    tr = _Trace(ctype)
    for i, d in enumerate(dtypes):   # inputs of another dtype (or a half) are converted once, up front
        if _converted(d, rdt):
            tr.lines.append(f"{ctype} a{i} = ({ctype}){_load(d, f'x{i}')};")
    args = [make(tr, i) for i in range(len(dtypes))]
    with np.errstate(all="ignore"):
        try:
            out = f(*args)
        except Untraceable:
            raise
        except Exception as err:
            raise Untraceable(f"{type(err).__name__}: {err}") from None
    return tr, out


def _backward_source(f, dtypes, rdt, wanted, dy_dtype):
    """The pullback body (``g<i> = dy * df/dx_i``, from dual numbers over ``Sym`` values) and the
    argument indices it writes."""
    k = len(wanted)
    pos = {i: j for j, i in enumerate(wanted)}

    def make(tr, i):
        s = Sym(tr, _arg_name(dtypes, rdt, i))
        if i in pos:
            return Dual(s, tuple(1 if m == pos[i] else 0 for m in range(k)))
        return s
    tr, out = _run_trace(f, dtypes, rdt, make)
    ddt = np.dtype(dy_dtype or rdt)
    dct = _COMPUTE.get(ddt)
    if dct is None:
        raise Untraceable(f"cotangent dtype {dy_dtype}")
    lines = list(tr.lines)
    if ddt in _HALF_IO:
        lines.insert(0, f"{dct} dyc = {_load(ddt, 'dy')};")
    gi = []
    if type(out) is Dual:
        for i, p in zip(wanted, out.d):
            if isinstance(p, int) and not isinstance(p, bool) and p == 0:
                continue   # f never used argument i
            if type(p) is Sym:
                text = p.f()
            elif isinstance(p, _NUMBER):
                text = tr.const(p)
            else:
                raise Untraceable(f"a partial derivative of type {type(p).__name__}")
            lines.append(f"g{i} = {_store(ddt, f'dyc * ({dct})({text})')};" if ddt in _HALF_IO
                         else f"g{i} = dy * ({dct})({text});")
            gi.append(i)
    elif type(out) is not Sym:
        raise Untraceable("f does not return a traced value")
    return "\n".join(lines), tuple(gi)


# ---------------------------------------------------------------------------------------------
# Kernels and their cache


def _freeze(v):
    """A hashable stand-in for a closure value or default (raises TypeError for arrays etc.)."""
    if isinstance(v, (int, float, complex, str, bytes, bool, type(None), np.number)):
        return (type(v), v)
    if isinstance(v, tuple):
        return tuple(_freeze(e) for e in v)
    if callable(v):
        return _func_key(v)
    raise TypeError("unhashable closure value")


def _func_key(f):
    """A cache key for a function: its code and captured values, so re-created lambdas hit."""
    if isinstance(f, functools.partial):
        return ("partial", _func_key(f.func), _freeze(tuple(f.args)),
                tuple(sorted((k, _freeze(v)) for k, v in f.keywords.items())))
    code = getattr(f, "__code__", None)
    if code is None:
        hash(f)
        return f
    cells = tuple(_freeze(c.cell_contents) for c in (f.__closure__ or ()))
    return ("fn", code, _freeze(f.__defaults__ or ()),
            tuple(sorted((k, _freeze(v)) for k, v in (f.__kwdefaults__ or {}).items())), cells, id(f.__globals__))


_kernels = {}
_failed = {}
_warned = set()


def clear_cache() -> None:
    """Forget every compiled kernel and failed trace (CuPy keeps its own binary cache)."""
    _kernels.clear()
    _failed.clear()


def _dtype_tag(x):
    return None if isinstance(x, _NUMBER) else np.dtype(x.dtype)


def _params(dtypes, rdt):
    """The kernel's input parameters: a half as its 16 bits, a Python number in the compute type."""
    out = []
    for i, d in enumerate(dtypes):
        out.append(f"{_param_type(halfs.compute_dtype(rdt) if d is None else d)} x{i}")
    return out


def _param_type(d):
    return "uint16" if d in _HALF_IO else np.dtype(d).name


def _bits(x):
    """A half array as the uint16 view the kernels take; anything else as it is."""
    return x.view(np.uint16) if type(x) is cupy.ndarray and x.dtype in _HALF_IO else x


def _with_halves(k, out_dtype):
    """``k`` called with half arrays as their bits, its half outputs viewed back as ``out_dtype``."""
    def call(*xs):
        outs = k(*[_bits(x) for x in xs])
        if isinstance(outs, tuple):
            return tuple(o.view(out_dtype) for o in outs)
        return outs.view(out_dtype)
    return call


def _kernel(f, xs, wanted, dy_dtype):
    """``(kernel, grad_index, result_dtype)`` for this signature, or None when ``f`` cannot be fused."""
    dtypes = tuple(_dtype_tag(x) for x in xs)
    try:
        fkey = _func_key(f)
        key = (fkey, dtypes, tuple(wanted), None if dy_dtype is None else np.dtype(dy_dtype))
        hash(key)
    except (TypeError, ValueError):   # unhashable closure values, empty cells
        key = None
    if key is not None:
        hit = _kernels.get(key)
        if hit is not None:
            return hit
        if key in _failed:
            return None
    try:
        src = trace_source(f, dtypes, wanted, dy_dtype)
    except Untraceable as err:
        if key is not None:
            _failed[key] = str(err)
        _note_fallback(f, str(err))
        return None
    rdt = src.result_dtype
    params = _params(dtypes, rdt)
    name = "fluxpy_" + "".join(ch if ch.isalnum() else "_" for ch in getattr(f, "__name__", "f"))[:40]
    halves = any(d in _HALF_IO for d in dtypes + (rdt, None if dy_dtype is None else np.dtype(dy_dtype)))
    preamble = halfs.CONVERSIONS if halves else ""
    if not wanted:
        k = cupy.ElementwiseKernel(", ".join(params), f"{_param_type(rdt)} y", src.forward, name + "_fwd",
                                   preamble=preamble)
        hit = (_with_halves(k, rdt) if halves else k, (), rdt)
    elif not src.grad_index:
        hit = (None, (), rdt)
    else:
        ddt = np.dtype(dy_dtype)
        dd = _param_type(ddt)
        k = cupy.ElementwiseKernel(", ".join([f"{dd} dy"] + params), ", ".join(f"{dd} g{i}" for i in src.grad_index),
                                   src.backward, name + "_bwd", preamble=preamble)
        hit = (_with_halves(k, ddt) if halves else k, src.grad_index, rdt)
    stats["kernels"] += hit[0] is not None
    if key is not None:
        _kernels[key] = hit
    return hit


def _note_fallback(f, why):
    stats["fallbacks"] += 1
    try:
        key = _func_key(f)
        hash(key)
    except (TypeError, ValueError):
        key = id(f)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"fluxpy.broadcast: {getattr(f, '__qualname__', f)!s} could not be compiled into one GPU kernel "
                  f"({why}); it runs op by op on the GPU instead (correct, but slower)",
                  FusionFallbackWarning, stacklevel=4)


def _plain(xs):
    """All values are CuPy arrays or Python/NumPy numbers (no Tracked values, no NumPy arrays)."""
    seen = False
    for x in xs:
        if type(x) is cupy.ndarray:
            seen = True
        elif not isinstance(x, _NUMBER):
            return False
    return seen


def fused_forward(f: Callable, *xs: Any) -> Array:
    """The elementwise ``f(*xs)`` with broadcasting, as one kernel (the ``broadcast`` kernel for CuPy).

    Where ``f`` cannot be compiled it runs ``f(*xs)`` op by op on the GPU (noted once per function
    with a :class:`FusionFallbackWarning`). ``xs`` are CuPy arrays and Python numbers.
    """
    hit = _kernel(f, xs, (), None) if _plain(xs) else None
    return f(*xs) if hit is None else keeping_layout(hit[0], *xs)


def fused_pullback(f: Callable, wanted: Sequence[int], dy: Array, *xs: Any) -> list:
    """The unreduced cotangents ``dy * df/dx_i`` for ``i`` in ``wanted``, in one kernel (the
    ``broadcast_backward`` kernel for CuPy): a list aligned with ``wanted``, ``None`` where ``f``
    ignores the argument, each of the broadcast shape and ``dy``'s dtype. Where ``f`` cannot be
    compiled, the dual numbers of :func:`fluxpy.dual.cotangents` compute them op by op.
    """
    wanted = tuple(wanted)
    if not wanted:
        return []
    hit = _kernel(f, xs, wanted, dy.dtype) if dy.dtype in _COMPUTE and _plain(xs) else None
    if hit is None:
        return cotangents(f, xs, wanted, dy)
    k, gi, _ = hit
    if k is None:
        return [None] * len(wanted)
    outs = keeping_layout(k, dy, *xs)
    if not isinstance(outs, tuple):
        outs = (outs,)
    by = dict(zip(gi, outs))
    return [by.get(i) for i in wanted]


# ---------------------------------------------------------------------------------------------
# bias_act on CuPy arrays


@functools.cache
def _act_with_bias(act):
    def bias_then_act(x, b):
        return act(x + b)
    return bias_then_act


@functools.cache
def _act_alone(act):
    def act_alone(x):
        return act(x)
    return act_alone


def _act_fn(act, has_bias):
    try:
        return _act_with_bias(act) if has_bias else _act_alone(act)
    except TypeError:   # unhashable act
        return lambda *xs: act(xs[0] + xs[1]) if has_bias else act(xs[0])


def bias_act_forward(x: Array, b: Array | None, act: Callable) -> Array:
    """The bias and activation ``act(x + b)`` in one kernel (``b`` broadcast): the ``bias_act`` kernel for CuPy."""
    fn = _act_fn(act, b is not None)
    return fused_forward(fn, x) if b is None else fused_forward(fn, x, b)


# derivative from the output: (elementwise C for dz from dy and y, mapreduce map over x=dy, y=y)
_OUTPUT_DERIVS = {
    "identity": ("dz = dy;", "x"),
    "relu": ("dz = y > 0 ? dy : (T)0;", "(y > 0 ? x : (ACC)0)"),
    "tanh": ("dz = dy * ((T)1 - y * y);", "x * ((ACC)1 - y * y)"),
    "sigmoid": ("dz = dy * (y * ((T)1 - y));", "x * (y * ((ACC)1 - y))"),
}
_dz_kernels = {}


# the same derivatives for float16/bfloat16 (as their bits), computed in float32 from yv = LOAD(y), dyv = LOAD(dy)
_HALF_OUTPUT_DERIVS = {"relu": "yv > 0.0f ? dyv : 0.0f", "tanh": "dyv * (1.0f - yv * yv)",
                       "sigmoid": "dyv * (yv * (1.0f - yv))"}


def _dz_kernel(kind, dtype):
    k = _dz_kernels.get((kind, dtype))
    if k is None:
        if dtype in _HALF_IO:
            load, store = _HALF_IO[dtype]
            body = (f"float yv = {load}(y); float dyv = {load}(dy); "
                    f"dz = {store}({_HALF_OUTPUT_DERIVS[kind]});")
            half = cupy.ElementwiseKernel("uint16 dy, uint16 y", "uint16 dz", body,
                                          f"fluxpy_bias_act_dz_{kind}_{dtype.name}", preamble=halfs.CONVERSIONS)
            k = _with_halves(half, dtype)
        else:
            k = cupy.ElementwiseKernel("T dy, T y", "T dz", _OUTPUT_DERIVS[kind][0], f"fluxpy_bias_act_dz_{kind}")
        _dz_kernels[kind, dtype] = k
    return k


def bias_act_output_backward_supports(kind: str, y: Any, dy: Any, *_: Any) -> bool:
    """The arrays :func:`bias_act_output_backward` handles: CuPy, one float16/bfloat16/float32/float64 dtype, one
    shape."""
    return type(y) is cupy.ndarray and type(dy) is cupy.ndarray and y.dtype == dy.dtype \
        and y.shape == dy.shape and y.dtype in _COMPUTE


def bias_act_output_backward(kind: str, y: Array, dy: Array, bshape: tuple[int, ...] | None, need_x: bool,
                             need_b: bool, fused: bool = True) -> tuple[Array | None, Array | None]:
    """``(dx, db)`` for an activation whose derivative comes from its output ``y`` (the
    ``bias_act_backward`` kernel for CuPy).

    ``dx = dy * act'(y)`` (elementwise), ``db = unbroadcast(dx, bshape)``. Where both are needed and ``y`` and
    ``dy`` share a layout the reduction reads in one pass, that pass writes ``dx`` while summing ``db``; otherwise
    (or with ``fused=False``, which tests and benchmarks use to reach that path) an elementwise kernel writes ``dx``
    and a reduction sums it.
    """
    from .reduce import canonical_form, mapreduce
    need_b = need_b and bshape is not None
    cm, mp = _OUTPUT_DERIVS[kind]
    axes = reduced_axes(y.shape, bshape) if need_b else None
    dx = db = None
    if kind == "identity":
        dx = dy if need_x else None
        if need_b:
            db = mapreduce(dy, axes).reshape(bshape) if axes else dy.reshape(bshape)
        return dx, db
    if need_b and axes:
        same = (canonical_form(y.shape, axes) is not None and dy._c_contiguous and y._c_contiguous) or \
            (is_channels_last(dy) and is_channels_last(y))
        if need_x and fused and same:
            dx = cupy.empty_like(dy)   # in dy's layout
            db = mapreduce(dy, axes, map=mp, y=y, out_mapped=dx).reshape(bshape)
            return dx, db
        if not need_x:
            return None, mapreduce(dy, axes, map=mp, y=y).reshape(bshape)
    dz = keeping_layout(_dz_kernel(kind, y.dtype), dy, y)
    if need_b:
        db = mapreduce(dz, axes).reshape(bshape) if axes else dz.reshape(bshape)
    return (dz if need_x else None), db


def bias_act_generic_backward(x: Array, b: Array | None, act: Callable, dy: Array) -> Array | None:
    """``dz = dy * act'(x + b)`` in one kernel for any traceable activation (the ``bias_act_derivative``
    kernel for CuPy); None where ``act`` ignores its input."""
    fn = _act_fn(act, b is not None)
    g, = fused_pullback(fn, (0,), dy, *((x,) if b is None else (x, b)))
    return g


# ---------------------------------------------------------------------------------------------
# Fused optimiser updates: one kernel per parameter, in place (x, and the state arrays)

_opt_kernels = {}


def _opt_kernel(name, ins, outs, body):
    k = _opt_kernels.get(name)
    if k is None:
        k = _opt_kernels[name] = cupy.ElementwiseKernel(ins, outs, body, f"fluxpy_{name}")
    return k


def descent_update(x: Array, dx: Array, eta: float, ok: Array | None = None) -> None:
    """``x -= eta * dx`` in place, one kernel; with ``ok`` (a device scalar, :func:`fluxpy.capturing.guarding`)
    only where it is finite.

    >>> descent_update.__name__
    'descent_update'
    """
    if ok is None:
        _opt_kernel("descent", "T dx, T eta", "T x", "x -= eta * dx;")(dx, x.dtype.type(eta), x)
    else:
        _opt_kernel("descent_guarded", "T dx, T eta, raw float64 ok", "T x",
                    "if (isfinite(ok[0])) x -= eta * dx;")(dx, x.dtype.type(eta), _float64_scalar(ok), x)


def momentum_update(x: Array, dx: Array, v: Array, eta: float, rho: float, ok: Array | None = None) -> None:
    """``v = rho v + eta dx; x -= v`` in place, one kernel (fluxpy.optimise.Momentum); with ``ok`` (a device
    scalar, :func:`fluxpy.capturing.guarding`) only where it is finite.

    >>> momentum_update.__name__
    'momentum_update'
    """
    t = x.dtype.type
    if ok is None:
        _opt_kernel("momentum", "T dx, T eta, T rho", "T x, T v",
                    "v = v * rho; v = v + eta * dx; x -= v;")(dx, t(eta), t(rho), x, v)
    else:
        _opt_kernel("momentum_guarded", "T dx, T eta, T rho, raw float64 ok", "T x, T v",
                    "if (isfinite(ok[0])) { v = v * rho; v = v + eta * dx; x -= v; }")(
            dx, t(eta), t(rho), _float64_scalar(ok), x, v)


def adam_update(x: Array, dx: Array, m: Array, v: Array, eta: float, beta: tuple[float, float], eps: float,
                b1t: float, b2t: float) -> tuple[float, float]:
    """One Adam step in place (fluxpy.optimise.Adam's formulas; ``b1t``, ``b2t`` = beta^t before this step).

    ``m = b1 m + (1-b1) dx``, ``v = b2 v + (1-b2) dx^2``,
    ``x -= eta * (m / (1-b1t)) / (sqrt(v / (1-b2t)) + eps)``; returns the next ``(b1t, b2t)``.
    """
    t = x.dtype.type
    b1, b2 = beta
    scalars = (t(b1), t(1 - b1), t(b2), t(1 - b2), t(1 / (1 - b1t)), t(1 / (1 - b2t)), t(eps), t(eta))
    if all(a.flags.c_contiguous for a in (x, dx, m, v)):
        # A RawKernel launch costs a few microseconds of host time; an ElementwiseKernel call ~20.
        n = x.size
        _adam_raw(x.dtype)((min((n + 255) // 256, 65535),), (256,), (x, dx, m, v, *scalars, np.int64(n)))
    else:
        _opt_kernel("adam", "T dx, T b1, T c1, T b2, T c2, T s1, T s2, T eps, T eta", "T x, T m, T v",
                    _ADAM_BODY.replace("[i]", ""))(dx, *scalars, x, m, v)
    return b1t * b1, b2t * b2


# One Adam step per element; the ElementwiseKernel above uses the same body without the [i].
_ADAM_BODY = ("m[i] = m[i] * b1; m[i] = m[i] + c1 * dx[i]; v[i] = v[i] * b2; v[i] = v[i] + c2 * (dx[i] * dx[i]);"
              "T d = sqrt(v[i] * s2) + eps; T s = (m[i] * s1) / d; x[i] -= s * eta;")
_adam_raw_kernels = {}


def _adam_raw(dtype):
    k = _adam_raw_kernels.get(dtype)
    if k is None:
        src = (f"#define T {_CTYPE[np.dtype(dtype)]}\n"
               "extern \"C\" __global__ void fluxpy_adam_raw(T* x, const T* dx, T* m, T* v, T b1, T c1, T b2,"
               " T c2, T s1, T s2, T eps, T eta, long long n) {\n"
               "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;"
               " i += (long long)gridDim.x * blockDim.x) {" + _ADAM_BODY + "}\n}\n")
        k = _adam_raw_kernels[dtype] = cupy.RawKernel(src, "fluxpy_adam_raw")
    return k


def update_supports(x: Any, dx: Any) -> bool:
    """The parameters the fused updates handle: CuPy arrays of one shape and float32/float64 dtype."""
    return type(x) is cupy.ndarray and type(dx) is cupy.ndarray and dx.dtype == x.dtype \
        and x.dtype in _CTYPE and dx.shape == x.shape


# The Optimisers.jl rules beyond Adam (fluxpy.optimise): one kernel per parameter and step, each body the rule's
# array ops in their order (a host scalar computed in float64 and rounded to T once, as NumPy and CuPy round a
# Python number against an array). Rules with host-side counters (beta^t, a step count) take them as such scalars
# and refuse a capture (fluxpy.optimise does); the others take a guard (``ok``), as descent_update does.

def _opt_step(name, ins, outs, body, args, ok):
    """Runs the update kernel ``name`` on ``args`` (its inputs, then its outputs); with ``ok`` (a device scalar,
    :func:`fluxpy.capturing.guarding`) its guarded twin, whose body runs only where ``ok[0]`` is finite."""
    if ok is None:
        _opt_kernel(name, ins, outs, body)(*args)
        return
    n_in = ins.count(",") + 1
    _opt_kernel(f"{name}_guarded", f"{ins}, raw float64 ok", outs, f"if (isfinite(ok[0])) {{ {body} }}")(
        *args[:n_in], _float64_scalar(ok), *args[n_in:])


def _sign(v):
    """C text of NumPy's ``sign(v)`` in the type ``T``: 1, -1, +0 for either zero, NaN for NaN."""
    return f"({v} > (T)0 ? (T)1 : ({v} < (T)0 ? (T)-1 : ({v} == (T)0 ? (T)0 : {v})))"


# Adam's moments, as fluxpy.optimise._moments updates them
_MOMENTS = "m = m * b1; m = m + c1 * dx; v = v * b2; v = v + c2 * (dx * dx); "


def adagrad_update(x: Array, dx: Array, acc: Array, eta: float, eps: float, ok: Array | None = None) -> None:
    """One AdaGrad step in place (fluxpy.optimise.AdaGrad): ``acc += dx^2``, ``x -= dx eta / (sqrt(acc) + eps)``;
    with ``ok`` (a device scalar, :func:`fluxpy.capturing.guarding`) only where it is finite.

    >>> adagrad_update.__name__
    'adagrad_update'
    """
    t = x.dtype.type
    _opt_step("adagrad", "T dx, T eta, T eps", "T x, T acc",
              "acc = acc + dx * dx; x -= dx * eta / (sqrt(acc) + eps);", (dx, t(eta), t(eps), x, acc), ok)


def adadelta_update(x: Array, dx: Array, acc: Array, dacc: Array, rho: float, eps: float,
                    ok: Array | None = None) -> None:
    """One AdaDelta step in place (fluxpy.optimise.AdaDelta): ``acc = rho acc + (1 - rho) dx^2``,
    ``s = dx sqrt(dacc + eps) / sqrt(acc + eps)``, ``dacc = rho dacc + (1 - rho) s^2``, ``x -= s``; with ``ok``
    (a device scalar) only where it is finite.

    >>> adadelta_update.__name__
    'adadelta_update'
    """
    t = x.dtype.type
    _opt_step("adadelta", "T dx, T rho, T c, T eps", "T x, T acc, T dacc",
              "acc = acc * rho; acc = acc + c * (dx * dx); T s = dx * sqrt(dacc + eps) / sqrt(acc + eps);"
              " dacc = dacc * rho; dacc = dacc + c * (s * s); x -= s;",
              (dx, t(rho), t(1 - rho), t(eps), x, acc, dacc), ok)


def adamax_update(x: Array, dx: Array, m: Array, u: Array, eta: float, beta: tuple[float, float], eps: float,
                  b1t: float, b2t: float) -> tuple[float, float]:
    """One AdaMax step in place (fluxpy.optimise.AdaMax; ``b1t``, ``b2t`` = beta^t before this step):
    ``m = b1 m + (1 - b1) dx``, ``u = max(b2 u, |dx|)``, ``x -= (eta / (1 - b1t)) m / (u + eps)``; returns the
    next ``(b1t, b2t)``.

    >>> adamax_update.__name__
    'adamax_update'
    """
    t = x.dtype.type
    b1, b2 = beta
    _opt_kernel("adamax", "T dx, T b1, T c1, T b2, T eps, T lr", "T x, T m, T u",
                "m = m * b1; m = m + c1 * dx; u = u * b2; T a = fabs(dx); u = (u > a || isnan(u)) ? u : a;"
                " T s = lr * m; x -= s / (u + eps);")(
        dx, t(b1), t(1 - b1), t(b2), t(eps), t(eta / (1 - b1t)), x, m, u)
    return b1t * b1, b2t * b2


def oadam_update(x: Array, dx: Array, m: Array, v: Array, term: Array, eta: float, beta: tuple[float, float],
                 eps: float, b1t: float, b2t: float) -> tuple[float, float]:
    """One OAdam step in place (fluxpy.optimise.OAdam; ``b1t``, ``b2t`` = beta^t before this step): Adam's
    moments, ``term = eta m / (1 - b1t) / (sqrt(v / (1 - b2t)) + eps)``, ``x -= 2 term - term_prev``; returns the
    next ``(b1t, b2t)``.

    >>> oadam_update.__name__
    'oadam_update'
    """
    t = x.dtype.type
    b1, b2 = beta
    _opt_kernel("oadam", "T dx, T b1, T c1, T b2, T c2, T e1, T e2, T eps, T eta", "T x, T m, T v, T term",
                _MOMENTS + "T p = term; term = eta * m / e1 / (sqrt(v / e2) + eps); x -= (T)2 * term - p;")(
        dx, t(b1), t(1 - b1), t(b2), t(1 - b2), t(1 - b1t), t(1 - b2t), t(eps), t(eta), x, m, v, term)
    return b1t * b1, b2t * b2


def nadam_update(x: Array, dx: Array, m: Array, v: Array, eta: float, beta: tuple[float, float], eps: float,
                 b1t: float, b2t: float) -> tuple[float, float]:
    """One NAdam step in place (fluxpy.optimise.NAdam; ``b1t``, ``b2t`` = beta^t before this step): Adam's moments,
    ``x -= eta (b1 m / (1 - b1 b1t) + (1 - b1) dx / (1 - b1t)) / (sqrt(v b2 / (1 - b2t)) + eps)``; returns the
    next ``(b1t, b2t)``.

    >>> nadam_update.__name__
    'nadam_update'
    """
    t = x.dtype.type
    b1, b2 = beta
    _opt_kernel("nadam", "T dx, T b1, T c1, T b2, T c2, T d1, T e1, T e2, T eps, T eta", "T x, T m, T v",
                _MOMENTS + "T a = b1 * m / d1 + c1 * dx / e1; T s = a / (sqrt(v * b2 / e2) + eps); x -= s * eta;")(
        dx, t(b1), t(1 - b1), t(b2), t(1 - b2), t(1 - b1 * b1t), t(1 - b1t), t(1 - b2t), t(eps), t(eta), x, m, v)
    return b1t * b1, b2t * b2


def radam_update(x: Array, dx: Array, m: Array, v: Array, eta: float, beta: tuple[float, float], eps: float,
                 b1t: float, b2t: float, r: float | None) -> tuple[float, float]:
    """One RAdam step in place (fluxpy.optimise.RAdam; ``b1t``, ``b2t`` = beta^t before this step, ``r`` the
    rectification the rule computed on the host, None during the warm-up): Adam's moments, then
    ``x -= m / (1 - b1t) / (sqrt(v / (1 - b2t)) + eps) * (eta r)``, or ``x -= m / (1 - b1t) * eta`` in the
    warm-up; returns the next ``(b1t, b2t)``.

    >>> radam_update.__name__
    'radam_update'
    """
    t = x.dtype.type
    b1, b2 = beta
    moments = (dx, t(b1), t(1 - b1), t(b2), t(1 - b2), t(1 - b1t))
    if r is None:
        _opt_kernel("radam_warmup", "T dx, T b1, T c1, T b2, T c2, T e1, T lr", "T x, T m, T v",
                    _MOMENTS + "x -= m / e1 * lr;")(*moments, t(eta), x, m, v)
    else:
        _opt_kernel("radam", "T dx, T b1, T c1, T b2, T c2, T e1, T e2, T eps, T lr", "T x, T m, T v",
                    _MOMENTS + "T s = m / e1 / (sqrt(v / e2) + eps) * lr; x -= s;")(
            *moments, t(1 - b2t), t(eps), t(eta * r), x, m, v)
    return b1t * b1, b2t * b2


def adabelief_update(x: Array, dx: Array, m: Array, s: Array, eta: float, beta: tuple[float, float], eps: float,
                     b1t: float, b2t: float) -> tuple[float, float]:
    """One AdaBelief step in place (fluxpy.optimise.AdaBelief; ``b1t``, ``b2t`` = beta^t before this step):
    ``m = b1 m + (1 - b1) dx``, ``s = b2 s + ((1 - b2) (dx - m)^2 + eps)``,
    ``x -= eta m / (1 - b1t) / (sqrt(s / (1 - b2t)) + eps)``; returns the next ``(b1t, b2t)``.

    >>> adabelief_update.__name__
    'adabelief_update'
    """
    t = x.dtype.type
    b1, b2 = beta
    _opt_kernel("adabelief", "T dx, T b1, T c1, T b2, T c2, T e1, T e2, T eps, T eta", "T x, T m, T s",
                "m = m * b1; m = m + c1 * dx; T d = dx - m; s = s * b2; s = s + (c2 * (d * d) + eps);"
                " x -= eta * m / e1 / (sqrt(s / e2) + eps);")(
        dx, t(b1), t(1 - b1), t(b2), t(1 - b2), t(1 - b1t), t(1 - b2t), t(eps), t(eta), x, m, s)
    return b1t * b1, b2t * b2


def lion_update(x: Array, dx: Array, m: Array, eta: float, beta: tuple[float, float],
                ok: Array | None = None) -> None:
    """One Lion step in place (fluxpy.optimise.Lion): ``m = (1 - b2) m + b2 dx``,
    ``x -= eta sign((b2 - b1) dx + b1 m)``; with ``ok`` (a device scalar) only where it is finite.

    >>> lion_update.__name__
    'lion_update'
    """
    t = x.dtype.type
    b1, b2 = beta
    _opt_step("lion", "T dx, T eta, T b1, T b2, T c2, T d21", "T x, T m",
              f"m = m * c2; m = m + b2 * dx; T a = d21 * dx + b1 * m; x -= eta * {_sign('a')};",
              (dx, t(eta), t(b1), t(b2), t(1 - b2), t(b2 - b1), x, m), ok)


def sign_decay_update(x: Array, dx: Array, lambd: float, ok: Array | None = None) -> None:
    """``x -= dx + lambd sign(x)`` in place (fluxpy.optimise.SignDecay stepping a parameter alone); with ``ok``
    (a device scalar) only where it is finite.

    >>> sign_decay_update.__name__
    'sign_decay_update'
    """
    _opt_step("sign_decay", "T dx, T lambd", "T x", f"T s = {_sign('x')}; x -= dx + lambd * s;",
              (dx, x.dtype.type(lambd), x), ok)


def sign_decay_gradient(x: Array, dx: Array, lambd: float) -> Array:
    """``dx + lambd sign(x)`` in one kernel, a new array laid out as ``dx`` (fluxpy.optimise.SignDecay in a chain).

    >>> sign_decay_gradient.__name__
    'sign_decay_gradient'
    """
    out = cupy.empty_like(dx)
    _opt_kernel("sign_decay_gradient", "T x, T dx, T lambd", "T y", f"y = dx + lambd * {_sign('x')};")(
        x, dx, x.dtype.type(lambd), out)
    return out


def accum_grad_update(acc: Array, dx: Array, n: int, first: bool) -> None:
    """AccumGrad's accumulation in place (fluxpy.optimise.AccumGrad): ``acc = dx / n`` for the ``first``
    gradient of a round, else ``acc += dx / n``.

    >>> accum_grad_update.__name__
    'accum_grad_update'
    """
    count = acc.dtype.type(n)
    if first:
        _opt_kernel("accum_grad_first", "T dx, T count", "T acc", "acc = dx / count;")(dx, count, acc)
    else:
        _opt_kernel("accum_grad", "T dx, T count", "T acc", "acc = acc + dx / count;")(dx, count, acc)


# ---------------------------------------------------------------------------------------------
# Multi-tensor updates: every parameter of a list in one launch (PyTorch's fused/foreach optimisers)
#
# The launch takes a table of device pointers BY VALUE, as a kernel parameter (as PyTorch's multi_tensor_apply
# does): no device-side table, no host-to-device copy, no cache to keep in step with the arrays. A table holds
# _MANY_CAP tensors (the x, dx and state-array pointers, and the start of each tensor in the concatenated index
# space), which keeps the kernel's parameters inside CUDA's classic 4 KiB; a longer list takes one launch per
# _MANY_CAP tensors.

_MANY_CAP = 96
_MANY_THREADS = 256
_MANY_ITEMS = 4           # elements per thread in a block's chunk of the concatenated index space
_MANY_MAX_BLOCKS = 65535  # more elements than that many chunks: the blocks stride over them
# C-contiguity of a CuPy array: its cdef attribute where there is one (a few times faster than .flags)
_c_contiguous = ((lambda a: a._c_contiguous) if cupy is not None and hasattr(cupy.ndarray, "_c_contiguous")
                 else (lambda a: a.flags.c_contiguous))


class _ManyRule:
    """One multi-tensor update: the state arrays each parameter has, the scalars the kernel takes (in order), and
    the per-element arithmetic, the per-parameter kernel's own (so both round alike). ``powers``: the body reads
    Adam's bias corrections ``s1``, ``s2`` made on the device from ``beta^t``."""

    def __init__(self, name, states, scalars, body, powers=False):
        self.name, self.states, self.scalars, self.body, self.powers = name, states, scalars, body, powers
        self.table = np.dtype([("t", np.int64, ((2 + len(states)) * _MANY_CAP + _MANY_CAP + 1,))])


_ADAMW_BODY = ("m[i] = m[i] * b1; m[i] = m[i] + c1 * dx[i]; v[i] = v[i] * b2; v[i] = v[i] + c2 * (dx[i] * dx[i]);"
               "T d = sqrt(v[i] * s2) + eps; T s = (m[i] * s1) / d; x[i] -= (s + lambd * x[i]) * eta;")
_MANY_RULES = {
    "descent": _ManyRule("descent", (), ("eta",), "x[i] -= eta * dx[i];"),
    "momentum": _ManyRule("momentum", ("v",), ("eta", "rho"),
                          "v[i] = v[i] * rho; v[i] = v[i] + eta * dx[i]; x[i] -= v[i];"),
    "adam": _ManyRule("adam", ("m", "v"), ("b1", "c1", "b2", "c2", "eps", "eta"), _ADAM_BODY, powers=True),
    "adamw": _ManyRule("adamw", ("m", "v"), ("b1", "c1", "b2", "c2", "eps", "eta", "lambd"), _ADAMW_BODY,
                       powers=True),
}


def many_source(rule: str, dtype: Any) -> str:
    """The CUDA source of the multi-tensor update ``rule`` (``"descent"``, ``"momentum"``, ``"adam"``, ``"adamw"``)
    for ``dtype`` (float32 or float64).

    Each block takes chunks of ``_MANY_THREADS * _MANY_ITEMS`` elements of the tensors laid end to end; it finds
    the tensor holding a chunk's first element by a binary search over the start offsets, and each thread then
    walks forward through the tensors as its index grows (skipping empty ones).

    >>> src = many_source("adam", np.float32)
    >>> "fluxpy_adam_many" in src and "#define T float" in src
    True
    """
    r = _MANY_RULES[rule]
    fields = "".join(f"  T* {name}[CAP];\n" for name in r.states)
    scalars = "".join(f"const T {name}, " for name in r.scalars)
    pick = "".join(f" {name} = t.{name}[k];" for name in r.states)
    declare = "".join(f"    T* {name} = t.{name}[k];\n" for name in r.states)
    corrections = ("  const T s1 = (T)(1.0 / (1.0 - bt[0]));\n  const T s2 = (T)(1.0 / (1.0 - bt[1]));\n"
                   if r.powers else "")
    body = r.body.replace("[i]", "[j]")
    return (f"#define T {_CTYPE[np.dtype(dtype)]}\n#define CAP {_MANY_CAP}\n#define ITEMS {_MANY_ITEMS}\n" + r"""
struct Tensors {  // CAP tensors; start[k] is where tensor k begins in the concatenated index space
  T* x[CAP];
  const T* dx[CAP];
""" + fields + r"""  long long start[CAP + 1];
};

extern "C" __global__ void fluxpy_""" + r.name + r"""_many(const Tensors t, const int count, """ + scalars + r"""
                                    const double* bt, const double* ok) {
  if (ok != nullptr && !isfinite(*ok)) return;   // a guarded step whose loss or gradients are not finite
  // Adam's bias corrections from the powers beta^t on the device (so that a replayed graph sees them advance),
  // rounded as the host rounds 1 / (1 - beta^t) for the per-parameter kernel
""" + corrections + r"""  const long long total = t.start[count];
  const long long chunk = (long long)blockDim.x * ITEMS;
  for (long long first = (long long)blockIdx.x * chunk; first < total; first += (long long)gridDim.x * chunk) {
    int lo = 0, hi = count - 1;  // the last tensor k with start[k] <= first: the (non-empty) one holding it
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (t.start[mid] <= first) lo = mid; else hi = mid - 1;
    }
    int k = lo;
    long long begin = t.start[k], end = t.start[k + 1];
    T* x = t.x[k];
    const T* dx = t.dx[k];
""" + declare + r"""    const long long last = first + chunk < total ? first + chunk : total;
    for (long long e = first + threadIdx.x; e < last; e += blockDim.x) {
      if (e >= end) {
        do { ++k; begin = end; end = t.start[k + 1]; } while (e >= end);
        x = t.x[k]; dx = t.dx[k];""" + pick + r"""
      }
      const long long j = e - begin;
      """ + body + r"""
    }
  }
}

extern "C" __global__ void fluxpy_powers(double* bt, const double b1, const double b2, const double* ok) {
  if (ok != nullptr && !isfinite(*ok)) return;
  bt[0] *= b1;   // beta^t -> beta^(t+1), after every launch of the step has read them
  bt[1] *= b2;
}
""")


_many_kernels = {}


def _many_raw(rule, dtype):
    k = _many_kernels.get((rule, dtype))
    if k is None:
        module = cupy.RawModule(code=many_source(rule, dtype))
        k = _many_kernels[rule, dtype] = (module.get_function(f"fluxpy_{rule}_many"),
                                          module.get_function("fluxpy_powers"))
    return k


def _launch_many(rule, xs, dxs, states, scalars, powers, ok):
    """One launch per ``_MANY_CAP`` parameters of ``rule``'s kernel; ``states`` one list per state array."""
    r = _MANY_RULES[rule]
    t = xs[0].dtype.type
    kernel, _ = _many_raw(rule, xs[0].dtype)
    args = tuple(t(v) for v in scalars) + (powers if powers is not None else np.uint64(0),
                                           np.uint64(0) if ok is None else ok)
    slots = 2 + len(states)
    cap = _MANY_CAP
    strided = []   # contiguous copies of strided gradients, alive until their launch is queued
    for lo in range(0, len(xs), cap):
        part = slice(lo, lo + cap)
        x = xs[part]
        count = len(x)
        table = np.zeros(slots * cap + cap + 1, np.int64)
        table[:count] = [a.data.ptr for a in x]
        table[cap:cap + count] = [d.data.ptr if _same_layout(d, a) else _copy_like(d, a, strided).data.ptr
                                  for d, a in zip(dxs[part], x)]
        for s, arrays in enumerate(states, start=2):
            table[s * cap:s * cap + count] = [a.data.ptr for a in arrays[part]]
        np.cumsum([a.size for a in x], out=table[slots * cap + 1:slots * cap + 1 + count])
        total = int(table[slots * cap + count])
        if total:
            blocks = min(-(-total // (_MANY_THREADS * _MANY_ITEMS)), _MANY_MAX_BLOCKS)
            kernel((blocks,), (_MANY_THREADS,), (table.view(r.table), np.int32(count), *args))


def sgd_update_many(xs: Sequence[Array], dxs: Sequence[Array], vs: Sequence[Array] | None, eta: float,
                    rho: float | None = None, ok: Array | None = None) -> None:
    """One step of plain descent (``vs`` None: ``x -= eta dx``) or of momentum (``v = rho v + eta dx; x -= v``,
    fluxpy.optimise.Momentum) for every parameter ``xs[k]`` in place, in one launch (one per 96 parameters), with
    the arithmetic of :func:`descent_update` / :func:`momentum_update`. With ``ok`` (a device scalar) nothing
    changes unless it is finite (:func:`fluxpy.capturing.guarding`). The calls it takes:
    :func:`sgd_update_many_supports`.

    >>> sgd_update_many.__name__
    'sgd_update_many'
    """
    if vs is None:
        _launch_many("descent", xs, dxs, (), (eta,), None, _guard_flag(ok))
    else:
        _launch_many("momentum", xs, dxs, (vs,), (eta, rho), None, _guard_flag(ok))


def adam_update_many(xs: Sequence[Array], dxs: Sequence[Array], ms: Sequence[Array], vs: Sequence[Array],
                     eta: float, beta: tuple[float, float], eps: float, b1t: float, b2t: float,
                     powers: Array | None = None, ok: Array | None = None, lambd: float | None = None
                     ) -> tuple[float, float]:
    """One Adam step (or, with ``lambd``, one AdamW step: ``x -= eta (direction + lambd x)``) for every parameter
    ``xs[k]`` (gradient ``dxs[k]``, moments ``ms[k]``, ``vs[k]``) in place, in one kernel launch (one per 96
    parameters); returns the next ``(b1t, b2t)``.

    The formulas and the rounding of :func:`adam_update`, which it replaces for a list of parameters sharing
    ``eta``, ``beta``, ``eps`` and the bias-correction state ``b1t``, ``b2t`` (``beta^t`` before this step).
    The kernel reads ``beta^t`` from ``powers``, a float64 CuPy array ``[b1t, b2t]`` that a second, one-thread
    launch then advances in place (``beta^t * beta``, the host's arithmetic): a captured step replayed from a
    CUDA graph so sees them advance. The caller keeps ``powers`` equal to ``(b1t, b2t)``; without one a
    temporary array is made from them. With ``ok`` (a device scalar) both launches change nothing unless it is
    finite (a step checked on the device, :func:`fluxpy.capturing.guarding`).
    The arrays are CuPy arrays of one float dtype, ``xs`` dense (C order or channels-last), ``ms`` and ``vs``
    laid out as their parameter, each ``dxs[k]`` of its parameter's shape (one laid out otherwise is copied
    first); :func:`adam_update_many_supports` says which calls it takes. The parameters must not share memory
    with one another (fluxpy.optimise groups only those that don't). Host cost: the table of pointers, read from
    the arrays on every call, and one launch.

    >>> adam_update_many.__name__
    'adam_update_many'
    """
    b1, b2 = beta
    if powers is None:
        powers = cupy.array([b1t, b2t], dtype=np.float64)
    flag = _guard_flag(ok)
    scalars = (b1, 1 - b1, b2, 1 - b2, eps, eta) + (() if lambd is None else (lambd,))
    _launch_many("adam" if lambd is None else "adamw", xs, dxs, (ms, vs), scalars, powers, flag)
    _, advance = _many_raw("adam", xs[0].dtype)
    advance((1,), (1,), (powers, np.float64(b1), np.float64(b2), np.uint64(0) if flag is None else flag))
    return b1t * b1, b2t * b2


def _guard_flag(ok):
    return None if ok is None else _float64_scalar(ok)


def _float64_scalar(a):
    """``a`` as a float64 CuPy array of one element (the guard flag a kernel reads through a pointer)."""
    if type(a) is not cupy.ndarray or a.size != 1:
        raise TypeError(f"an update kernel's ok must be a CuPy array of one element, got {type(a).__name__}")
    return a if a.dtype == np.float64 else a.astype(np.float64)


def _same_layout(d, a):
    """Whether ``d`` lies in memory as the dense array ``a`` does (so one flat index reads both)."""
    return d._c_contiguous if a._c_contiguous else d.strides == a.strides


def _copy_like(d, a, keep):
    """``d`` copied into ``a``'s layout (C order or channels-last), kept alive in ``keep``."""
    d = like_layout(d, a)
    keep.append(d)
    return d


def _dense(a):
    """C-contiguous or channels-last: every element once, in a layout the flat kernels read as one run."""
    return _c_contiguous(a) or is_channels_last(a)


def _many_supports(xs, dxs, states):
    """Lists of one length (at least one) of CuPy arrays of one float32/float64 dtype, ``xs`` and the state arrays
    dense (C order or channels-last) and laid out alike, every array of its parameter's shape."""
    nd = cupy.ndarray
    n = len(xs)
    if n == 0 or len(dxs) != n or any(len(s) != n for s in states) or type(xs[0]) is not nd:
        return False
    dt = xs[0].dtype
    if dt not in _CTYPE:
        return False
    for k, (a, d) in enumerate(zip(xs, dxs)):
        if type(a) is not nd or type(d) is not nd or a.dtype != dt or d.dtype != dt or not _dense(a) \
                or d.shape != a.shape:
            return False
        for s in states:
            b = s[k]
            if type(b) is not nd or b.dtype != dt or b.shape != a.shape or not _same_layout(b, a):
                return False
    return True


def sgd_update_many_supports(x: Any, xs: Sequence, dxs: Sequence, vs: Sequence | None) -> bool:
    """The calls :func:`sgd_update_many` takes (``x`` is ``xs[0]``, for :func:`fluxpy.kernels.find`):
    ``find("sgd_update_many", xs[0], xs, dxs, vs)``.

    >>> sgd_update_many_supports.__name__
    'sgd_update_many_supports'
    """
    return _many_supports(xs, dxs, () if vs is None else (vs,))


def adam_update_many_supports(x: Any, xs: Sequence, dxs: Sequence, ms: Sequence, vs: Sequence) -> bool:
    """The calls :func:`adam_update_many` takes: lists of one length (at least one) of CuPy arrays of one
    float32/float64 dtype, ``xs``, ``ms``, ``vs`` dense and laid out alike, every array of its parameter's shape.

    ``x`` is one of the parameters, passed first so that :func:`fluxpy.kernels.find` (which looks at array
    arguments, not into lists) picks the array module: ``find("adam_update_many", xs[0], xs, dxs, ms, vs)``.
    Every array is checked on every call (the gradients are new each step).

    >>> adam_update_many_supports.__name__
    'adam_update_many_supports'
    """
    return _many_supports(xs, dxs, (ms, vs))


# ---------------------------------------------------------------------------------------------
# Whether a list of arrays is all finite, in one launch (the divergence check of fluxpy.train)

_FINITE_TABLE = np.dtype([("p", np.int64, (_MANY_CAP,)), ("n", np.int64, (_MANY_CAP,))])


def _finite_defines(dtype):
    """``cuda/finite.cu``'s defines: the dtype's (halfs.cuh) and ``CAP``, the arrays a launch takes."""
    return {**halfs.dtype_defines(dtype), "CAP": _MANY_CAP}


def SOURCE_VARIANTS():
    """``(source, defines)`` of the ``cuda/`` kernels this module launches: :func:`finite_total`'s, one per dtype,
    and the map+reduce of each activation derivative that :func:`bias_act_output_backward` passes to ``mapreduce``.

    >>> len(list(SOURCE_VARIANTS()))
    28
    """
    from .reduce import variants
    for dtype in halfs.KERNEL_DTYPES:
        yield "finite.cu", _finite_defines(dtype)
    for _, map_expr in _OUTPUT_DERIVS.values():
        if map_expr != "x":   # identity sums dy itself: reduce's own variants
            yield from variants(map_expr, True)


def finite_total_supports(x: Any, arrays: Sequence) -> bool:
    """The lists :func:`finite_total` takes: CuPy float16, bfloat16, float32 or float64 arrays (``x`` is the first,
    for the array module)."""
    return all(type(a) is cupy.ndarray and a.dtype in _COMPUTE for a in arrays)


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
        k = compiler.function("finite.cu", "fluxpy_nonfinite", _finite_defines(dtype))
        for lo in range(0, len(group), _MANY_CAP):
            part = group[lo:lo + _MANY_CAP]
            table = np.zeros(1, _FINITE_TABLE)
            table["p"][0, :len(part)] = [a.data.ptr for a in part]
            table["n"][0, :len(part)] = [a.size for a in part]
            blocks = min(-(-max(a.size for a in part) // 1024), 64)
            k((blocks, len(part)), (256,), (table, out))
    return out


_advance = None


def loss_scale_advance(scale: Array, good: Array, flag: Array, applied: Array, interval: int) -> None:
    """A dynamic loss scale's step on the device (fluxpy.DynamicLossScale): where ``flag`` is not finite (an
    overflow) the float32 ``scale`` halved and the int32 count ``good`` reset; else, where ``applied`` is finite
    (the update ran), one more good step, ``scale`` doubled after ``interval`` of them in a row. One thread, no
    sync (captured with a step).

    >>> loss_scale_advance.__name__
    'loss_scale_advance'
    """
    global _advance
    if _advance is None:
        _advance = cupy.ElementwiseKernel(
            "raw float64 flag, raw float64 applied, int32 interval", "raw float32 scale, raw int32 good",
            "if (!isfinite(flag[0])) { scale[0] *= 0.5f; good[0] = 0; }"
            " else if (isfinite(applied[0])) {"
            "  good[0] += 1; if (good[0] >= interval) { scale[0] *= 2.0f; good[0] = 0; } }",
            "fluxpy_loss_scale_advance")
    _advance(_float64_scalar(flag), _float64_scalar(applied), np.int32(interval), scale, good, size=1)


# name -> (kernel, supports): what fluxpy.kernels.gpu registers for CuPy arrays
def erf(x: Array) -> Array:
    """``erf`` of a CuPy float array in one kernel (CUDA's ``erff``/``erf``; the halves computed in float32): the
    ``erf`` op's kernel, instead of its composite of about ninety elementwise passes."""
    return fused_forward(_erf_of, x)


def _erf_of(v):
    if type(v) is Sym:
        return v.erf()
    # the trace first runs f on small NumPy arrays for the result dtype: erf there, keeping the dtype
    return np.asarray(np.vectorize(math.erf, otypes=[np.float64])(v), dtype=v.dtype)


def erf_supports(x) -> bool:
    """CuPy arrays of a dtype the traced kernels compute (float16, bfloat16, float32, float64)."""
    return type(x) is cupy.ndarray and x.dtype in _COMPUTE


KERNELS = {
    "erf": (erf, erf_supports),
    "broadcast": (fused_forward, None),
    "broadcast_backward": (fused_pullback, None),
    "bias_act": (bias_act_forward, None),
    "bias_act_backward": (bias_act_output_backward, bias_act_output_backward_supports),
    "bias_act_derivative": (bias_act_generic_backward, None),
    "descent_update": (descent_update, update_supports),
    "momentum_update": (momentum_update, update_supports),
    "adam_update": (adam_update, update_supports),
    "adagrad_update": (adagrad_update, update_supports),
    "adadelta_update": (adadelta_update, update_supports),
    "adamax_update": (adamax_update, update_supports),
    "oadam_update": (oadam_update, update_supports),
    "nadam_update": (nadam_update, update_supports),
    "radam_update": (radam_update, update_supports),
    "adabelief_update": (adabelief_update, update_supports),
    "lion_update": (lion_update, update_supports),
    "sign_decay_update": (sign_decay_update, update_supports),
    "sign_decay_gradient": (sign_decay_gradient, update_supports),
    "accum_grad_update": (accum_grad_update, update_supports),
    "adam_update_many": (adam_update_many, adam_update_many_supports),
    "sgd_update_many": (sgd_update_many, sgd_update_many_supports),
    "loss_scale_advance": (loss_scale_advance, None),
    "finite_total": (finite_total, finite_total_supports),
}
