"""Tape-based reverse-mode automatic differentiation.

``gradient(f, *args)`` boxes every floating-point array in ``args`` as a
:class:`Tracked` value, runs ``f``, and walks the recorded graph backwards. Each
op is a :class:`Primitive`: a forward ``impl`` on plain arrays and a *rule* that
returns the output together with a ``pullback`` closure (ChainRules' ``rrule``).

Pullbacks are written with fluxpy ops, so when ``gradient`` is nested the
backward pass of the inner call is itself recorded by the outer one (HIPS
autograd's trace levels): second derivatives come for free. The walk back along
the tape is :func:`fluxpy.backward.backprop`.

>>> import numpy as np
>>> gradient(lambda x: (x ** 3).sum(), np.array([1.0, 2.0]))
(array([ 3., 12.]),)
>>> gradient(lambda x: gradient(lambda y: (y ** 3).sum(), x)[0].sum(), np.array([1.0, 2.0]))
(array([ 6., 12.]),)
"""
from __future__ import annotations

import contextvars
import importlib
import itertools
import operator
import pickle
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .backend import Array, DeviceArray, get_array_module, is_array, is_float_array, is_float_dtype
from .backward import SliceCotangent, backprop
from .collector import paused_while_recording
from .functors import fmap, fmapstructure
from .mutation import start as _start_watch
from .mutation import stop as _stop_watch
from .mutation import watching as _watching

_WATCHED_TYPES = (np.ndarray, tuple, list)   # the constants the mutation check fingerprints (a device's: watch.devices)

__all__ = ["Tracked", "Node", "Primitive", "primitive", "gradient", "withgradient", "pullback",
           "no_grad",
           "stop_gradient", "value_of", "is_tracked", "in_gradient", "gradient_depth", "define_tracked_ops",
           "DetachedGradientWarning", "register_gradient_hook", "SliceCotangent",
           "withgradient_detailed"]

_levels = itertools.count(1)
# Gradient hooks (register_gradient_hook), per tape level: {level: {id(node): (node, [fn, ...])}}; a gradient or
# withgradient call takes its level's entry when its backward walk starts (and drops it if f raised).
_gradient_hooks: dict[int, dict[int, tuple]] = {}
_pullback_hook = None  # fluxpy.profile wraps each pullback while it records
# Per thread and per asyncio task (a new thread starts at the defaults): how many ``no_grad`` blocks are open, and
# how many gradient/pullback calls are running their function now. One thread training never switches another
# thread's Dropout/BatchNorm to training mode, and one thread's ``no_grad`` never turns off another's gradients.
_no_grad_depth: contextvars.ContextVar[int] = contextvars.ContextVar("fluxpy_no_grad_depth", default=0)
_recording: contextvars.ContextVar[int] = contextvars.ContextVar("fluxpy_recording", default=0)


class DetachedGradientWarning(UserWarning):
    """:func:`gradient` or :func:`withgradient` (or :func:`pullback`) of a function whose result does not
    depend on its arguments: every gradient is ``None``.

    A warning and not an error, because Zygote returns ``nothing`` there without complaint and a
    function that ignores some inputs is legal; :func:`fluxpy.train` turns it into an error. Make
    it one everywhere with ``warnings.simplefilter("error", DetachedGradientWarning)``.

    >>> import warnings, numpy as np
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     g = gradient(lambda x: np.float64(3.0), np.ones(2))
    >>> g, caught[0].category.__name__
    ((None,), 'DetachedGradientWarning')
    """


# The ops behind Tracked's operators and methods, by name: fluxpy.ops defines them with
# define_tracked_ops when it is imported (the ops are built on this module, so it cannot import them).
_TRACKED_OPS: dict[str, Callable] = {}


def define_tracked_ops(**ops: Callable) -> None:
    """Give Tracked values their arithmetic: ``add``, ``subtract``, ..., ``array_ufunc``, ``array_function``.

    :mod:`fluxpy.ops` calls it once, with its differentiable ops.

    >>> sorted(_TRACKED_OPS)[:3]
    ['abs', 'add', 'array_function']
    """
    _TRACKED_OPS.update(ops)


def _forward(name, reflected=False):
    """A Tracked method that calls the op ``name`` (with the operands swapped for ``__r*__``)."""
    if reflected:
        def method(a, b):
            return _TRACKED_OPS[name](b, a)
    else:
        def method(a, *args, **kw):
            return _TRACKED_OPS[name](a, *args, **kw)
    method.__name__ = name
    return method


def _compare(op):
    """Comparisons read the values: they give plain boolean arrays, not differentiable ones."""
    return lambda a, b: op(value_of(a), value_of(b))


class Node:
    """A step of the tape: the ``parents`` (the Nodes of the inputs it was computed from, ``None`` for
    constants) and the ``pullback`` that maps its cotangent to theirs (``None`` for an input).

    A Node holds no value: the forward value lives in its :class:`Tracked` for as long as the user's code
    (or a pullback that saved it) keeps it, so values that no pullback needs are freed during the forward
    pass, as PyTorch frees outputs that no backward function saved.

    >>> import numpy as np
    >>> def f(x):
    ...     y = x * 2
    ...     assert y.node.parents[0] is x.node and x.node.pullback is None   # x is an input: no pullback
    ...     return y.sum()
    >>> gradient(f, np.ones(2))
    (array([2., 2.]),)
    """
    __slots__ = ("parents", "pullback")

    def __init__(self, parents: tuple = (), pullback: Callable | None = None) -> None:
        self.parents = parents
        self.pullback = pullback


class Tracked:
    """An array recorded on a tape: ``value`` (an array, or a Tracked of an outer level) and the tape
    ``node`` (:class:`Node`) that says what it was computed from and how to pull cotangents back.

    Tracked values behave like arrays: arithmetic, indexing, ``.T``, ``.sum()``, and NumPy
    functions such as ``np.exp`` all dispatch to differentiable fluxpy ops. Comparisons give plain
    boolean arrays. Turning one into a Python number or a plain array (``float()``, ``int()``,
    ``bool()``, ``.item()``, ``.tolist()``, ``np.asarray``) is a ``TypeError``: the result would carry
    no gradient, silently. :func:`value_of` reads the value on purpose.

    >>> import numpy as np
    >>> g, = gradient(lambda x: np.exp(x)[1:].sum(), np.zeros(3))
    >>> g
    array([0., 1., 1.])
    """
    __slots__ = ("value", "level", "node", "__weakref__")
    __fluxpy_tracked__ = True
    __array_priority__ = 1000.0

    def __init__(self, value: Array, level: int, node: Node | None = None) -> None:
        self.value = value
        self.level = level
        self.node = Node() if node is None else node

    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.value.dtype)
    ndim = property(lambda self: self.value.ndim)
    size = property(lambda self: self.value.size)

    def __len__(self):
        return len(self.value)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self):
        return f"Tracked({self.value!r}, level={self.level})"

    def __format__(self, spec):
        # Formatting makes a string, which no computation can use by mistake: f"{loss:.4f}" prints the value.
        return format(value_of(self), spec)

    # Turning a Tracked value into a plain number or array would cut it off the tape: the function
    # would go on with a constant and every gradient would be None (or wrong), silently. All refuse.
    def __bool__(self):
        raise TypeError(_detached_message(
            "bool()", "an if, and, or, not or assert on it",
            "compare instead (x > 0 gives a plain boolean array, so `if (x > 0).any():` works)"))

    def __float__(self):
        raise TypeError(_detached_message("float()"))

    def __int__(self):
        raise TypeError(_detached_message("int()"))

    def __complex__(self):
        raise TypeError(_detached_message("complex()"))

    def __index__(self):
        raise TypeError(_detached_message("using it as an index or size (__index__)"))

    def __round__(self, ndigits=None):
        raise TypeError(_detached_message("round()"))

    def item(self, *args) -> Any:
        """Refused: the Python number would carry no gradient; use :func:`value_of` (``value_of(x).item()``)."""
        raise TypeError(_detached_message(".item()"))

    def tolist(self) -> Any:
        """Refused: the Python list would carry no gradient; use :func:`value_of` (``value_of(x).tolist()``)."""
        raise TypeError(_detached_message(".tolist()"))

    def __array__(self, dtype=None, copy=None):
        raise TypeError(_detached_message("np.asarray() (turning it into a plain array)"))

    __add__, __radd__ = _forward("add"), _forward("add", reflected=True)
    __sub__, __rsub__ = _forward("subtract"), _forward("subtract", reflected=True)
    __mul__, __rmul__ = _forward("multiply"), _forward("multiply", reflected=True)
    __truediv__, __rtruediv__ = _forward("divide"), _forward("divide", reflected=True)
    __pow__, __rpow__ = _forward("power"), _forward("power", reflected=True)
    __matmul__, __rmatmul__ = _forward("matmul"), _forward("matmul", reflected=True)
    __neg__ = _forward("negative")
    __abs__ = _forward("abs")
    __getitem__ = _forward("getitem")
    __lt__, __le__ = _compare(operator.lt), _compare(operator.le)
    __gt__, __ge__ = _compare(operator.gt), _compare(operator.ge)
    __eq__, __ne__ = _compare(operator.eq), _compare(operator.ne)
    __hash__ = object.__hash__
    __array_ufunc__ = _forward("array_ufunc")
    __array_function__ = _forward("array_function")
    T = property(_forward("transpose"))
    reshape = _forward("reshape_method")
    transpose = _forward("transpose_method")
    sum = _forward("sum")
    mean = _forward("mean")
    max = _forward("max")
    min = _forward("min")
    astype = _forward("astype")
    squeeze = _forward("squeeze")
    ravel = flatten = _forward("ravel")
    clip = _forward("clip")

    def __pos__(self):
        return self


def _detached_message(what, how="", instead=""):
    how = f" ({how})" if how else ""
    instead = f"; {instead}" if instead else ""
    return (f"{what} of a fluxpy Tracked value{how}: inside a function being differentiated this would "
            "detach the result from the tape, so the gradient would be lost silently (None or wrong)"
            f"{instead}; compute with fluxpy ops or NumPy functions on the value itself, or use "
            "fluxpy.value_of(x) to read its value on purpose, without a gradient")


def is_tracked(x: Any) -> bool:
    """True for a value recorded on a tape.

    >>> import numpy as np
    >>> is_tracked(np.ones(1))
    False
    """
    return type(x) is Tracked


def value_of(x: Any) -> Any:
    """The plain array behind a (possibly nested) Tracked value; ``x`` itself otherwise.

    >>> import numpy as np
    >>> value_of(np.ones(1))
    array([1.])
    """
    while type(x) is Tracked:
        x = x.value
    return x


def stop_gradient(x: Any) -> Any:
    """The value of ``x`` with no gradient flowing through it.

    >>> import numpy as np
    >>> gradient(lambda x: (x * stop_gradient(x)).sum(), np.array([3.0]))
    (array([3.]),)
    """
    return value_of(x)


def register_gradient_hook(x: Tracked, fn: Callable[[Any], Any]) -> None:
    """Call ``fn(grad)`` during the backward pass as soon as the gradient of the tracked value ``x`` is final.

    ``x`` must be a :class:`Tracked` value of a tape being recorded (an argument boxed by :func:`gradient`,
    :func:`withgradient` or :func:`pullback`, such as a model's weight seen inside the loss, or any value computed
    from one). During that tape's backward walk ``fn`` runs once, right after the last op that used ``x`` has
    pulled its cotangent back (every contribution added), before the walk goes on; it gets ``x``'s gradient and may
    return an array to use instead (the one the gradient call returns for an argument, or the cotangent that flows
    on for a computed value), or ``None`` to keep it. Where ``x`` gets no gradient at all, ``fn(None)`` runs when
    the walk ends (hooks in the order they were registered); a value it returns becomes ``x``'s gradient. PyTorch's
    ``Tensor.register_post_accumulate_grad_hook`` for arguments, ``Tensor.register_hook`` for computed values:
    :class:`fluxpy.distributed.DataParallel` starts a gradient bucket's all-reduce from such a hook, while the rest
    of the backward pass runs. Hooks belong to one tape: :func:`pullback`'s ``back`` runs them at each call.

    >>> import numpy as np
    >>> seen = []
    >>> def f(x):
    ...     register_gradient_hook(x, lambda g: seen.append(g.copy()) or g * 10)
    ...     return (x * x).sum()
    >>> gradient(f, np.array([1.0, 2.0])), seen
    ((array([20., 40.]),), [array([2., 4.])])
    """
    if type(x) is not Tracked:
        raise TypeError(f"register_gradient_hook: x must be a Tracked value (an argument of gradient/withgradient/"
                        f"pullback seen inside the function, or a value computed from one), got {_describe(x)}")
    if not callable(fn):
        raise TypeError(f"register_gradient_hook: fn must be callable as fn(grad), got {type(fn).__name__}")
    hooks = _gradient_hooks.setdefault(x.level, {})
    entry = hooks.get(id(x.node))
    if entry is None:
        hooks[id(x.node)] = (x.node, [fn])
    else:
        entry[1].append(fn)


class Primitive:
    """An op with a forward implementation and a differentiation rule.

    ``rule(*args, **kw) -> (y, pullback)`` where ``pullback(dy)`` returns one cotangent per
    positional argument (``None`` where there is none). If ``needs_mask`` is set, the rule is
    called as ``rule(needs, *args, **kw)`` with a tuple of booleans saying which positional
    arguments need a gradient, so it can skip the others. ``impl`` computes ``y`` alone and is
    used whenever no argument is tracked.

    Rules must compute with fluxpy ops (not raw NumPy) where a value may be tracked, so that
    they can be differentiated again.
    """
    def __init__(self, name: str, rule: Callable, impl: Callable | None = None, needs_mask: bool = False,
                 doc: str | None = None) -> None:
        self.name = name
        self.rule = rule
        self.needs_mask = needs_mask
        if impl is None:
            impl = (lambda *a, **k: rule((False,) * len(a), *a, **k)[0]) if needs_mask else \
                (lambda *a, **k: rule(*a, **k)[0])
        self.impl = impl
        self._read = f"an array `{name}` read"   # how the mutation check names an array this op read
        self.__doc__ = doc
        self.__wrapped__ = impl

    __fluxpy_leaf__ = True   # a leaf of model trees (fluxpy.functors), not a node with children

    def __reduce__(self):
        """Pickle as a reference to a module-level name holding this primitive (its rule's module first)."""
        homes = [getattr(self.rule, "__module__", None), getattr(self.impl, "__module__", None)]
        homes += sorted(m for m in list(sys.modules) if m == "fluxpy" or m.startswith("fluxpy."))
        for home in dict.fromkeys(h for h in homes if h):
            module = sys.modules.get(home)
            for name, value in list(vars(module).items()) if module is not None else ():
                if value is self and not name.startswith("__"):
                    return _primitive_named, (home, name)
        raise pickle.PicklingError(f"cannot pickle {self!r}: no module-level name holds it; define it at the top "
                                   "level of a module (as fluxpy's ops are) so that it pickles by name")

    def __repr__(self):
        return f"<fluxpy primitive {self.name}>"

    def __call__(self, *args: Any, **kw: Any) -> Any:
        top = 0
        for a in args:
            if type(a) is Tracked and a.level > top:
                top = a.level
        if not top:
            return self.impl(*args, **kw)
        if _no_grad_depth.get():
            return self.impl(*[value_of(a) for a in args], **kw)
        return self._record(top, args, kw)

    def _record(self, top, args, kw):
        vals = []
        parents = []
        watch = _watching.get(top)
        for a in args:
            if type(a) is Tracked and a.level == top:
                vals.append(a.value)
                parents.append(a.node)
            else:
                vals.append(a)
                parents.append(None)
                if watch is not None and (watch.devices or type(a) in _WATCHED_TYPES) and not _is_shape(a):
                    watch.add(a, self._read)
        if watch is not None and kw:
            for v in kw.values():
                if (watch.devices or type(v) in _WATCHED_TYPES) and not _is_shape(v):
                    watch.add(v, self._read)
        if self.needs_mask:
            y, back = self.rule(tuple([p is not None for p in parents]), *vals, **kw)
        else:
            y, back = self.rule(*vals, **kw)
        return Tracked(y, top, Node(tuple(parents), back))


def _is_shape(a):
    """Whether ``a`` is a tuple of Python ints (a shape, axes): nothing in it for the mutation check to watch."""
    return type(a) is tuple and all([type(i) is int for i in a])


def _primitive_named(module: str, name: str) -> Primitive:
    """The primitive stored as ``module.name`` (what unpickling a primitive calls).

    >>> _primitive_named("fluxpy.ops.activations", "relu").name
    'relu'
    """
    found = getattr(importlib.import_module(module), name, None)
    if not isinstance(found, Primitive):
        raise pickle.UnpicklingError(f"{module}.{name} is not a fluxpy primitive (got {found!r})")
    return found


def primitive(rule: Callable | None = None, *, name: str | None = None, impl: Callable | None = None,
              needs_mask: bool = False) -> Primitive | Callable[[Callable], Primitive]:
    """Define a differentiable op from its rule (usable as a decorator).

    The rule returns ``(y, pullback)``; ``pullback(dy)`` returns a tuple with one cotangent
    per positional argument. Write both with fluxpy ops so second derivatives work.

    >>> import numpy as np
    >>> @primitive
    ... def cube(x):
    ...     def cube_pullback(dy):
    ...         return (dy * 3 * x ** 2,)
    ...     return x ** 3, cube_pullback
    >>> cube(np.array([2.0]))
    array([8.])
    >>> gradient(lambda x: cube(x).sum(), np.array([2.0]))
    (array([12.]),)
    """
    def make(r):
        p = Primitive(name or r.__name__, r, impl=impl, needs_mask=needs_mask, doc=r.__doc__)
        return p
    return make(rule) if rule is not None else make


@contextmanager
def no_grad() -> Iterator[None]:
    """Inside ``with no_grad():`` ops record nothing: results are plain arrays.

    It holds for the current thread (and asyncio task) only: another thread's gradients go on.

    >>> import numpy as np
    >>> def f(x):
    ...     with no_grad():
    ...         y = x * 2
    ...     return (x * y).sum()
    >>> gradient(f, np.ones(2))   # y is a constant: d/dx (x * 2x held fixed) = 2x
    (array([2., 2.]),)
    """
    token = _no_grad_depth.set(_no_grad_depth.get() + 1)
    try:
        yield
    finally:
        _no_grad_depth.reset(token)


# ---------------------------------------------------------------------------------------------
# Boxing arguments and shaping gradients like them


class _Boxes:
    """Boxes the float arrays of an argument tree at one tape level.

    A Python float is boxed only as a whole argument (``gradient(f, 2.0)``): floats inside a
    model are hyperparameters, and boxing them as float64 arrays would change dtypes.
    """

    def __init__(self, level, who="gradient", watch=None):
        self.level, self.who, self.watch = level, who, watch
        self.by_leaf = {}  # id(original leaf) -> (original, box)
        self.cache = {}

    def box(self, x):
        kind = type(x)
        if kind is np.ndarray or kind is DeviceArray:   # the common leaves, without the general checks below
            return self._box(x, x) if is_float_dtype(x.dtype) else x
        if kind in _PLAIN_LEAVES:   # a model's numbers, names and functions: nothing to box, no foreign array
            return x
        v = value_of(x)
        if is_float_array(v):
            return self._box(x, x)
        if hasattr(v, "__dlpack__") and not is_array(v) and not isinstance(v, np.generic):
            kind = f"{type(v).__module__}.{type(v).__name__}"
            raise TypeError(f"{self.who}: an argument holds a {kind} {tuple(getattr(v, 'shape', ()))}, another "
                            f"library's array; fluxpy differentiates NumPy and CuPy arrays: take it without a copy "
                            f"with numpy.from_dlpack(x) (CPU) or cupy.from_dlpack(x) (GPU)")
        return x

    def box_argument(self, x):
        if isinstance(x, float):
            return self._box(x, np.asarray(x))
        return fmap(self.box, x, cache=self.cache)

    def _box(self, x, v):
        entry = self.by_leaf.get(id(x))
        if entry is None:
            entry = self.by_leaf[id(x)] = (x, Tracked(v, self.level))
            if self.watch is not None and (self.watch.devices or type(v) is np.ndarray):
                self.watch.add(v, "an array among the function's arguments")
        return entry[1]

    def grad_of(self, x, leaf_grads):
        entry = self.by_leaf.get(id(x))
        if entry is None:
            return None
        g = leaf_grads.get(id(entry[1].node))
        if g is None:
            return None
        if isinstance(x, float):
            return g if type(g) is Tracked else float(g)
        if g.dtype != x.dtype:  # float32 weights used with float64 data still get float32 gradients
            g = g.astype(x.dtype)
        if type(g) is Tracked:
            return g
        if not getattr(getattr(g, "flags", None), "writeable", True) or 0 in g.strides:
            g = g.copy()  # broadcast views are read-only; users expect to own their gradients
        return g


_PLAIN_LEAVES = frozenset({int, float, bool, str, type(None), types.FunctionType, types.BuiltinFunctionType,
                           Primitive})   # leaves a model holds that are never arrays (box returns them as they are)


def _box_args(args, level, who="gradient", watch=None):
    boxes = _Boxes(level, who, watch)
    return tuple(boxes.box_argument(a) for a in args), boxes


def _shape_grads(args, boxes, leaf_grads):
    return tuple(boxes.grad_of(a, leaf_grads) if isinstance(a, float) else
                 fmapstructure(lambda leaf: boxes.grad_of(leaf, leaf_grads), a) for a in args)


def _describe(y):
    v = value_of(y)
    if hasattr(v, "shape"):
        return f"an array of shape {tuple(v.shape)} and dtype {v.dtype}"
    return f"a {type(v).__name__}"


def _is_scalar(y):
    v = value_of(y)
    if isinstance(v, (int, float, np.number)):
        return True
    return hasattr(v, "shape") and v.shape == () and is_float_dtype(v.dtype)


def in_gradient() -> bool:
    """True while the function given to :func:`gradient`, :func:`withgradient` or :func:`pullback` runs
    in this thread (or asyncio task).

    Layers such as Dropout and BatchNorm train only then (Flux's ``istraining``). Another thread
    running inference meanwhile sees ``False``.

    >>> import numpy as np
    >>> in_gradient()
    False
    >>> gradient(lambda x: x.sum() * float(in_gradient()), np.ones(2))
    (array([1., 1.]),)
    """
    return _recording.get() > 0


def gradient_depth() -> int:
    """How many of :func:`gradient`, :func:`withgradient` and :func:`pullback` are running their function in this
    thread (or asyncio task): 2 or more while a derivative of a derivative is being recorded. An op with a fused
    pullback that cannot itself be differentiated runs its composite then.

    >>> import numpy as np
    >>> gradient_depth()
    0
    >>> gradient(lambda x: x.sum() * gradient_depth(), np.ones(2))
    (array([1., 1.]),)
    """
    return _recording.get()


def _call_recording(f, args):
    token = _recording.set(_recording.get() + 1)
    try:
        return f(*args)
    finally:
        _recording.reset(token)


def _detached_reason(who, y, boxes, tracked):
    """Why every gradient is None (for :class:`DetachedGradientWarning` and train's error)."""
    if not boxes.by_leaf:
        return (f"{who}: no argument holds a float array (or is a Python float), so there is nothing to "
                "differentiate and every gradient is None")
    if tracked:
        return (f"{who}: the result of the function reaches its arguments only through steps without a "
                "gradient, so every gradient is None")
    return (f"{who}: the result of the function ({_describe(y)}) does not depend on its arguments, so every "
            "gradient is None; was it computed from a global or a copy instead of the argument, or through "
            "value_of, stop_gradient or no_grad?")


def withgradient_detailed(f: Callable, args: tuple, who: str, fname: str = "f", aux: bool = False) -> tuple:
    """``(value, gradients, detached)`` of ``f(*args)``, for callers that report in their own name (``who``, and
    ``fname`` for ``f``): ``detached`` is None or the reason every gradient is None, which the caller raises or
    warns with. With ``aux``, a tuple ``f`` returns is ``(loss, *auxiliary)``: the gradient is the loss's and
    ``value`` the whole tuple.

    >>> import numpy as np
    >>> value, grads, detached = withgradient_detailed(lambda x: (x * x).sum(), (np.array([3.0]),), "example")
    >>> float(value), grads, detached
    (9.0, (array([6.]),), None)
    """
    with paused_while_recording:   # see fluxpy.collector: no collector scans while the tape is alive
        return _withgradient_now(f, args, who, fname, aux)


def _plain(tree):
    """``tree`` (tuples, lists, dicts) with every Tracked leaf replaced by its plain value."""
    if type(tree) is tuple or type(tree) is list:
        return type(tree)(_plain(v) for v in tree)
    if type(tree) is dict:
        return {k: _plain(v) for k, v in tree.items()}
    return value_of(tree)


def _withgradient_now(f, args, who, fname, aux=False):
    level = next(_levels)
    watch = _start_watch(level)
    boxed, boxes = _box_args(args, level, who, watch)
    try:
        y = _call_recording(f, boxed)
    finally:
        hooks = _gradient_hooks.pop(level, None)
        _stop_watch(level)
    if watch is not None:
        watch.check(who)
    extra = None
    if aux and type(y) is tuple:
        if not y:
            raise ValueError(f"{who}: {fname} returned an empty tuple; return the loss, or (loss, auxiliary...)")
        y, extra = y[0], _plain(y[1:])
    value, grads, detached = _withgradient_of(who, fname, y, args, boxes, level, hooks)
    return (value if extra is None else (value, *extra)), grads, detached


def _withgradient_of(who, fname, y, args, boxes, level, hooks=None):
    if not _is_scalar(y):
        raise ValueError(f"{who}: {fname} must return a scalar (a 0-d float array or a number), got {_describe(y)}; "
                         "reduce it first (e.g. .sum() or a loss), or use fluxpy.pullback for non-scalar outputs")
    if type(y) is not Tracked or y.level != level:
        return y, tuple(fmapstructure(lambda leaf: None, a) for a in args), _detached_reason(who, y, boxes, False)
    leaf_grads = backprop(y.node, _ones_like(y.value), hooks=hooks, wrap=_pullback_hook)
    detached = None if leaf_grads else _detached_reason(who, y, boxes, True)
    return y.value, _shape_grads(args, boxes, leaf_grads), detached


def withgradient(f: Callable, *args: Any) -> tuple[Any, tuple]:
    """The value of scalar ``f(*args)`` together with its gradients: ``(f(*args), gradients)``.

    ``gradients`` has one entry per argument, shaped like it (see :func:`gradient`), including the
    :class:`DetachedGradientWarning` when the result does not depend on any argument.

    Where ``f`` returns a tuple, its first element is the loss and the rest is auxiliary output (Zygote's rule):
    the gradients are the loss's, and the value is the whole tuple, every element a plain value (the loss and,
    say, the model's predictions or a metric computed on the way).

    >>> import numpy as np
    >>> val, (g,) = withgradient(lambda x: (x * x).sum(), np.array([1.0, 2.0]))
    >>> float(val), g
    (5.0, array([2., 4.]))
    >>> (loss, y), (g,) = withgradient(lambda x: ((x * x).sum(), x * 3), np.array([1.0, 2.0]))
    >>> float(loss), y, g
    (5.0, array([3., 6.]), array([2., 4.]))
    """
    value, grads, detached = withgradient_detailed(f, args, "withgradient", aux=True)
    if detached:
        warnings.warn(detached, DetachedGradientWarning, stacklevel=2)
    return value, grads


def gradient(f: Callable, *args: Any) -> tuple:
    """The gradient of scalar ``f`` with respect to each argument.

    Returns a tuple with one entry per argument. Each mirrors its argument: an array for an
    array, the same nesting for tuples, lists and dicts, a dict of field name to gradient for a
    model object, and ``None`` for leaves that are not differentiable or not used.

    When the result does not depend on any argument at all (it was computed from a global, or
    through :func:`value_of`, :func:`stop_gradient` or :func:`no_grad`), every gradient is ``None``
    and a :class:`DetachedGradientWarning` says so. Zygote returns ``nothing`` there silently; a
    warning rather than an error keeps such code legal while making the mistake visible. Turning
    a tracked value into a Python number (``float(loss)``, ``loss.item()``, ``if loss:``) inside
    ``f`` is a ``TypeError``, as is ``np.asarray`` of it.

    >>> import numpy as np
    >>> gradient(lambda d: (d["w"] * 2).sum(), {"w": np.ones(2), "n": 3})
    ({'w': array([2., 2.]), 'n': None},)
    """
    _, grads, detached = withgradient_detailed(f, args, "gradient")
    if detached:
        warnings.warn(detached, DetachedGradientWarning, stacklevel=2)
    return grads


def pullback(f: Callable, *args: Any) -> tuple[Any, Callable]:
    """The value ``y = f(*args)`` and the function ``back`` that maps a cotangent ``dy`` to the gradients:
    ``(y, back)``.

    ``f`` may return an array of any shape; ``dy`` must have that shape. A result that does not
    depend on any argument gives a :class:`DetachedGradientWarning` (and ``back`` gives ``None`` gradients).

    >>> import numpy as np
    >>> y, back = pullback(lambda x: x * 2, np.ones(2))
    >>> back(np.array([1.0, 3.0]))
    (array([2., 6.]),)
    """
    level = next(_levels)
    watch = _start_watch(level)
    boxed, boxes = _box_args(args, level, "pullback", watch)
    try:
        y = _call_recording(f, boxed)
    finally:
        hooks = _gradient_hooks.pop(level, None)
        _stop_watch(level)
    tracked = type(y) is Tracked and y.level == level
    value = y.value if tracked else y
    if not tracked:
        warnings.warn(_detached_reason("pullback", y, boxes, False), DetachedGradientWarning, stacklevel=2)

    def back(dy):
        shape = getattr(value_of(value), "shape", ())
        if tuple(getattr(dy, "shape", ())) != tuple(shape):
            raise ValueError(f"pullback: the cotangent must have the output's shape {tuple(shape)}, "
                             f"got {tuple(getattr(dy, 'shape', ()))}")
        if not tracked:
            return tuple(fmapstructure(lambda leaf: None, a) for a in args)
        if watch is not None:
            watch.check("pullback's back")
        fresh = {k: (node, list(fns)) for k, (node, fns) in hooks.items()} if hooks else None
        return _shape_grads(args, boxes, backprop(y.node, dy, release=False, hooks=fresh, wrap=_pullback_hook))
    return value, back


def _ones_like(v):
    inner = value_of(v)
    xp = get_array_module(inner)
    return xp.ones(inner.shape, dtype=inner.dtype)

