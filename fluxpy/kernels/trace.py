"""Tracing a scalar Python function into the C text of a CUDA elementwise kernel.

:func:`trace_source` calls ``f`` on symbolic scalars (:class:`Sym`), each operation writing one line
of C in the compute type, and returns the forward body ``y = f(x0, ..., xn)`` and, when asked, the
pullback body ``g<i> = dy * df/dx_i``. The derivatives come from the same dual numbers the CPU path
uses (:class:`fluxpy.dual.Dual` over ``Sym`` values), so the GPU and CPU paths compute the same
function. :mod:`fluxpy.kernels.elementwise` turns these bodies into ``cupy.ElementwiseKernel`` s;
this module needs neither CuPy nor a GPU.

What is traced: ``+ - * / **`` (integer and float powers), unary ``-``, ``abs``, comparisons
(bool values), ``np.exp log sqrt tanh sin cos log1p expm1 square maximum minimum where clip sign
absolute negative reciprocal logical_and/or/not``, Python/NumPy numbers. Anything else (Python
``if`` on a value, ``float(x)``, an array captured in a closure, an unknown ufunc) raises
:class:`Untraceable`.

All arithmetic runs in the result dtype's compute type: float32 for float16, bfloat16 and float32,
float64 for float64. A half argument arrives as its 16 bits and is converted on load, the result on
store (the functions of :mod:`fluxpy.kernels.halfs`).

>>> import numpy as np
>>> k = trace_source(lambda x, b: np.tanh(x * 1.5 + b), [np.float32, np.float32])
>>> print(k.forward)
float t0 = x0 * ((float)1.5);
float t1 = t0 + x1;
float t2 = tanhf(t1);
y = t2;
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..dual import Dual
from . import halfs

__all__ = ["Sym", "Untraceable", "trace_source", "activation_c"]


class Untraceable(Exception):
    """Raised inside a trace when ``f`` uses something that cannot be compiled.

    >>> try:
    ...     trace_source(lambda x: x if x > 0 else -x, [np.float32])
    ... except Untraceable as err:
    ...     print(err)
    Python control flow on a traced value (if/and/or/while)
    """


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

    >>> x = Sym(_Trace("float"), "x0")
    >>> y = np.exp(x) * 2
    >>> y, y.tr.lines
    (Sym(t1), ['float t0 = expf(x0);', 'float t1 = t0 * ((float)2);'])
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
# An activation as a C expression (what the batch-norm kernels and the reductions take as defines)


def activation_c(f: Callable, dtype: Any, arg: str, derivative: bool = False) -> str:
    """One C expression computing ``f(arg)`` (or, with ``derivative``, ``f'(arg)``) in the compute type of
    ``dtype`` (float for float16, bfloat16 and float32; double for float64), for a scalar elementwise ``f`` such
    as an activation of :mod:`fluxpy.ops.activations`. The traced statements sit in a lambda called on ``arg``,
    so ``arg`` is evaluated once and the text can be a macro's value (a ``-D`` define: ``MAP(x, y)``,
    ``ACT(v)``). The derivative comes from the dual numbers the CPU path uses. A bool result (a mask, as relu's
    derivative from its output) is a 0 or 1 in the compute type. Raises :class:`Untraceable` where ``f`` cannot be
    compiled.

    >>> print(activation_c(lambda v: np.maximum(v, 0.0), np.float32, "z"))
    ([](const float x0) -> float { float t0 = (x0 != x0 || x0 > ((float)0.0)) ? x0 : ((float)0.0); return t0; }(z))
    >>> print(activation_c(np.tanh, np.float64, "z", derivative=True))
    ([](const double x0) -> double { double t0 = tanh(x0); double t1 = t0 * t0; double t2 = ((double)1) - t1; \
return t2; }(z))
    """
    cdt = np.dtype(halfs.compute_dtype(dtype))
    if cdt not in _CTYPE:
        raise Untraceable(f"dtype {np.dtype(dtype)} (activations compile for float16, bfloat16, float32, float64)")
    ctype = _CTYPE[cdt]
    tr = _Trace(ctype)
    x = Sym(tr, "x0")
    with np.errstate(all="ignore"):
        try:
            out = f(Dual(x, (1,)) if derivative else x)
        except Untraceable:
            raise
        except Exception as err:
            raise Untraceable(f"{type(err).__name__}: {err}") from None
    if derivative:
        out = out.d[0] if type(out) is Dual else 0   # a Sym or a number: f ignored its argument
    if type(out) is Sym:
        result = out.f()
    elif derivative and isinstance(out, _NUMBER):
        result = tr.const(out)
    else:
        raise Untraceable(f"f returns {type(out).__name__}, not a traced value")
    body = " ".join(tr.lines + [f"return {result};"])
    return f"([](const {ctype} x0) -> {ctype} {{ {body} }}({arg}))"
