"""Fused elementwise CUDA kernels compiled from scalar Python functions.

:func:`fused_forward` and :func:`fused_pullback` (the ``broadcast`` and ``broadcast_backward`` kernels
for CuPy) take the C bodies :func:`fluxpy.kernels.trace.trace_source` writes for the scalar function
``f`` given to :func:`fluxpy.broadcast` and build

- one ``cupy.ElementwiseKernel`` for the forward pass ``y = f(x1, ..., xn)`` and
- one for the pullback: inputs ``dy, x1, ..., xn``, outputs the *unreduced* cotangents
  ``dy * df/dxi`` for the arguments that need one, summed afterwards to each operand's shape by
  :func:`fluxpy.unbroadcast` (the mapreducedim kernel).

CuPy's ``ElementwiseKernel`` broadcasts its inputs, so operands keep their own shapes and no
broadcast copy is made. Kernels are cached by (function, argument dtypes, needs mask); a
function is keyed by its code, defaults and closure values, so a lambda re-created on every
call (with the same captured numbers) still hits the cache.

Where ``f`` cannot be traced (:class:`Untraceable`: Python ``if`` on a value, ``float(x)``, an array
captured in a closure, an unknown ufunc) the kernel runs ``f`` (and its dual numbers) op by op on the
CuPy arrays instead (correct, slower); that is noted once per function with a
:class:`FusionFallbackWarning`. Dtypes other than float16, bfloat16, float32 and float64 take that
generic path too. Half arrays are passed to the kernel as their 16 bits (``uint16`` views) and
converted on load and store (:mod:`fluxpy.kernels.halfs`), so no CUDA half header is needed. The
bias-and-activation kernels and ``erf`` are built on the same machinery: ``bias_act`` (the traced ``act(x + b)``),
``bias_act_preactivation`` (``act(x + b)`` and ``x + b`` in one pass, for a pullback that reads the
pre-activation) and ``bias_act_backward`` (``dx = dy * D(saved)`` written while ``mapreduce`` sums ``db``, ``D``
the activation's derivative traced into the reduction's map by :func:`fluxpy.kernels.trace.activation_c`). The module
imports without CuPy; the tracer's names (:class:`Sym`, :class:`Untraceable`, :func:`trace_source`)
are importable from here too.

>>> sorted(KERNELS)[:3]
['bias_act', 'bias_act_backward', 'bias_act_preactivation']
"""
from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..backend import Array, cupy, reduced_axes
from ..layout import is_channels_last, keeping_layout
from ..dual import cotangents
from . import cuda_halves, halfs
from .answers import answered
from .trace import _COMPUTE, _HALF_IO, _NUMBER, Sym, Untraceable, activation_c, trace_source

__all__ = ["Sym", "Untraceable", "FusionFallbackWarning", "trace_source", "fused_forward", "fused_pullback",
           "stats", "clear_cache", "bias_act_forward", "bias_act_backward", "bias_act_preactivation", "fuses",
           "why_not_compiled", "derivative_map", "KERNELS"]

stats = {"traces": 0, "kernels": 0, "fallbacks": 0}
"""Counters: functions traced, ElementwiseKernels built, calls that fell back to the generic path."""


class FusionFallbackWarning(UserWarning):
    """Warns that ``broadcast(f, ...)`` on CuPy arrays could not fuse ``f`` and runs it op by op instead."""


# ---------------------------------------------------------------------------------------------
# Kernels and their cache


def _freeze(v, active=()):
    """A hashable stand-in for a closure value or default (raises TypeError for arrays etc.)."""
    if isinstance(v, (int, float, complex, str, bytes, bool, type(None), np.number)):
        return (type(v), v)
    if isinstance(v, tuple):
        return tuple(_freeze(e, active) for e in v)
    if callable(v):
        return _func_key(v, active)
    raise TypeError("unhashable closure value")


def _func_key(f, active=()):
    """A cache key for a function: its code and captured values, so re-created lambdas hit.

    ``active`` holds the functions whose keys are being built further up: a function that refers to itself through
    its closure (a wrapper that passes itself on, as the activations do) is keyed by its code there, not again."""
    if isinstance(f, functools.partial):
        return ("partial", _func_key(f.func, active), _freeze(tuple(f.args), active),
                tuple(sorted((k, _freeze(v, active)) for k, v in f.keywords.items())))
    code = getattr(f, "__code__", None)
    if code is None:
        hash(f)
        return f
    if any(f is g for g in active):
        return ("self", code)
    active = (*active, f)
    cells = tuple(_freeze(c.cell_contents, active) for c in (f.__closure__ or ()))
    return ("fn", code, _freeze(f.__defaults__ or (), active),
            tuple(sorted((k, _freeze(v, active)) for k, v in (f.__kwdefaults__ or {}).items())), cells,
            id(f.__globals__))


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
        stats["traces"] += 1
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
    if cuda_halves.supports_bias_act(x, b) and fuses(act, derivative=False):   # vectors, not CuPy's elementwise
        return cuda_halves.bias_act(x, b, _act_text(act, x.dtype))[0]
    fn = _act_fn(act, b is not None)
    return fused_forward(fn, x) if b is None else fused_forward(fn, x, b)


def _scalar_kernel(name: str, ins: Sequence[str], outs: Sequence[str], body: str, dtype: Any) -> Callable:
    """An ``ElementwiseKernel`` whose arrays (``ins``, ``outs``: names) all have ``dtype``, its ``body`` in the
    compute type: each input ``v`` read as ``v_c`` and each output ``o`` written from ``o_c``. Halves pass as their
    16 bits and come back as ``dtype``."""
    dtype = np.dtype(dtype)
    ctype = _COMPUTE[dtype]
    load, store = _HALF_IO.get(dtype, ("", ""))
    loads = " ".join(f"const {ctype} {v}_c = {load}({v});" for v in ins)
    stores = " ".join(f"{o} = {store}({o}_c);" for o in outs)
    ptype = _param_type(dtype)
    text = f"{loads} {ctype} {', '.join(o + '_c' for o in outs)}; {body} {stores}"
    k = cupy.ElementwiseKernel(", ".join(f"{ptype} {v}" for v in ins), ", ".join(f"{ptype} {o}" for o in outs),
                               text, name, preamble=halfs.CONVERSIONS if dtype in _HALF_IO else "")
    return _with_halves(k, dtype) if dtype in _HALF_IO else k


_preactivation_kernels: dict = {}
_act_texts: dict = {}


def _act_text(f: Callable, dtype: Any) -> str:
    """``f`` as a C expression of ``v`` in ``dtype``'s compute type (cached)."""
    return answered(_act_texts, (f, np.dtype(dtype)), lambda: activation_c(f, dtype, "v"), kept=None)


def bias_act_preactivation(x: Array, b: Array, act: Callable) -> tuple[Array, Array]:
    """``(act(x + b), x + b)`` in one kernel (``b`` broadcast, the sum computed once): the
    ``bias_act_preactivation`` kernel for CuPy, for an activation whose pullback reads its input."""
    def make():
        act_c = activation_c(act, x.dtype, "z_c")
        return _scalar_kernel("fluxpy_bias_act_preactivation", ("x", "b"), ("y", "z"),
                              f"z_c = x_c + b_c; y_c = {act_c};", x.dtype)
    if cuda_halves.supports_bias_act(x, b):   # vectors, not CuPy's items
        return cuda_halves.bias_act(x, b, _act_text(act, x.dtype), preactivation=True)
    k = answered(_preactivation_kernels, (act, x.dtype), make, kept=None)
    return keeping_layout(k, x, b)


def bias_act_preactivation_supports(x: Any, b: Any, act: Callable) -> bool:
    """CuPy ``x`` and ``b`` of one float16/bfloat16/float32/float64 dtype, ``b`` broadcasting to ``x``, and an
    ``act`` the tracer compiles."""
    if type(x) is not cupy.ndarray or type(b) is not cupy.ndarray or x.dtype != b.dtype or x.dtype not in _COMPUTE:
        return False
    return fuses(act)


def fuses(f: Callable, derivative: bool = True) -> bool:
    """Whether the scalar function ``f`` (and, with ``derivative``, its derivative) compiles into the fused kernels
    (float32 stands for every dtype: the halves compute in float32, and float64 traces the same operations).

    >>> import numpy as np
    >>> fuses(np.tanh), fuses(lambda v: v if v > 0 else 0.0)
    (True, False)
    """
    return why_not_compiled(f, derivative) is None


_reasons: dict = {}


def why_not_compiled(f: Callable, derivative: bool = True) -> str | None:
    """None where the scalar function ``f`` (and, with ``derivative``, its derivative) compiles into the fused
    kernels, else why not (the tracer's reason: a Python ``if`` on a value, an unknown ufunc, ...).

    >>> import numpy as np
    >>> why_not_compiled(np.exp) is None
    True
    """
    def make():
        try:
            activation_c(f, np.float32, "v")
            if derivative:
                activation_c(f, np.float32, "v", derivative=True)
        except Untraceable as err:
            return (str(err),)
        return (None,)
    return answered(_reasons, (f, derivative), make, kept=None)[0]


_maps: dict = {}
_dz_kernels: dict = {}


def derivative_map(derivative: Callable, dtype: Any) -> str:
    """``mapreduce``'s map for ``dz = dy * derivative(saved)``: ``x`` is ``dy`` and ``y`` the saved array (the
    output or the pre-activation), both in the accumulator type of ``dtype``.

    >>> import numpy as np
    >>> print(derivative_map(lambda y: 1 - y * y, np.float32))
    (x) * ([](const float x0) -> float { float t0 = x0 * x0; float t1 = ((float)1) - t0; return t1; }(y))
    """
    return answered(_maps, (derivative, np.dtype(dtype)), lambda: f"(x) * {activation_c(derivative, dtype, 'y')}",
                    kept=None)


def _dz_kernel(derivative, dtype):
    return answered(_dz_kernels, (derivative, dtype), lambda: _scalar_kernel(
        "fluxpy_bias_act_dz", ("dy", "s"), ("dz",), f"dz_c = dy_c * {activation_c(derivative, dtype, 's_c')};",
        dtype), kept=None)


def bias_act_backward_supports(derivative: Callable | None, saved: Any, dy: Any, *_: Any) -> bool:
    """The arrays :func:`bias_act_backward` handles: CuPy, one float16/bfloat16/float32/float64 dtype, one shape,
    and a ``derivative`` the tracer compiles (or None)."""
    return type(saved) is cupy.ndarray and type(dy) is cupy.ndarray and saved.dtype == dy.dtype \
        and saved.shape == dy.shape and saved.dtype in _COMPUTE and (derivative is None or fuses(derivative, False))


def bias_act_backward(derivative: Callable | None, saved: Array, dy: Array, bshape: tuple[int, ...] | None,
                      need_x: bool, need_b: bool, fused: bool = True) -> tuple[Array | None, Array | None]:
    """``(dx, db)`` of ``bias_act`` (the ``bias_act_backward`` kernel for CuPy): ``dx = dy * derivative(saved)``
    elementwise, ``saved`` the output or the pre-activation (whichever the op's ``derivative`` reads; None: the
    identity, ``dx = dy``), and ``db = unbroadcast(dx, bshape)``.

    Where both are needed and ``saved`` and ``dy`` share a layout the reduction reads in one pass, that pass writes
    ``dx`` while summing ``db``; otherwise (or with ``fused=False``, which tests and benchmarks use to reach that
    path) an elementwise kernel writes ``dx`` and a reduction sums it.
    """
    from .reduce import canonical_form, mapreduce
    need_b = need_b and bshape is not None
    axes = reduced_axes(saved.shape, bshape) if need_b else None
    if derivative is None:
        db = None
        if need_b:
            db = mapreduce(dy, axes).reshape(bshape) if axes else dy.reshape(bshape)
        return (dy if need_x else None), db
    if need_b and axes:
        mp = derivative_map(derivative, saved.dtype)
        same = (canonical_form(saved.shape, axes) is not None and dy._c_contiguous and saved._c_contiguous) or \
            (is_channels_last(dy) and is_channels_last(saved))
        if need_x and fused and same:
            dx = cupy.empty_like(dy)   # in dy's layout
            db = mapreduce(dy, axes, map=mp, y=saved, out_mapped=dx).reshape(bshape)
            return dx, db
        if not need_x:
            return None, mapreduce(dy, axes, map=mp, y=saved).reshape(bshape)
    if cuda_halves.supports_add(dy, saved):   # vectors, not CuPy's items
        dz = cuda_halves.act_grad(dy, saved, _act_text(derivative, saved.dtype))
    else:
        dz = keeping_layout(_dz_kernel(derivative, saved.dtype), dy, saved)
    db = None
    if need_b:
        db = mapreduce(dz, axes).reshape(bshape) if axes else dz.reshape(bshape)
    return (dz if need_x else None), db


def SOURCE_VARIANTS(derivatives=(), activations=()):
    """``(source, defines)`` of the ``cuda/`` kernels this module launches: the map+reduce of each activation
    derivative (``derivatives``: the functions ``fluxpy.ops.bias_act`` passes, which the kernel-source test gives)
    that :func:`bias_act_backward` passes to ``mapreduce``, in float32 and float64 (the halves compute in float32)
    and, for the first, every dtype; and the ``cuda/bias_act.cu`` kernels of :mod:`fluxpy.kernels.cuda_halves`
    for the first of ``activations`` and the first derivative (the halves and float32).

    >>> list(SOURCE_VARIANTS())
    []
    """
    for dtype in halfs.HALVES + (np.dtype(np.float32),):
        for act in activations[:1]:
            yield "bias_act.cu", cuda_halves.act_defines(_act_text(act, dtype), dtype, "FX_ACT")
        for d in derivatives[:1]:
            yield "bias_act.cu", cuda_halves.act_defines(_act_text(d, dtype), dtype, "FX_DERIV")
    from .reduce import variants
    for i, d in enumerate(derivatives):
        for dtype in halfs.KERNEL_DTYPES if i == 0 else (np.dtype(np.float32), np.dtype(np.float64)):
            code = halfs.dtype_defines(dtype)["FX_DTYPE"]
            for source, defines in variants(derivative_map(d, dtype), True):
                if defines["FX_DTYPE"] == code:
                    yield source, defines


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
    "bias_act_backward": (bias_act_backward, bias_act_backward_supports),
    "bias_act_preactivation": (bias_act_preactivation, bias_act_preactivation_supports),
}
