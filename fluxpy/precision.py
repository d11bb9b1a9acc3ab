"""Mixed precision: a float32 model run in bfloat16 or float16, with float32 master weights: :func:`mixed_precision`.

``mixed_precision(model, dtype)`` wraps a float32 model in a :class:`MixedPrecision` layer. Called on a batch, it
casts the batch and the model's weights to ``dtype`` (differentiable casts, so the gradients come back to the
float32 weights in float32), runs the model in ``dtype`` (convolutions and matmuls on tensor cores,
every fused kernel computing in float32 and storing the half type) and returns the output in float32, so the loss
is computed in float32. Several inputs (``Bilinear``'s ``x, z``, a recurrent cell's state) and outputs (tuples, as
attention's ``(y, scores)`` or a cell's ``(h, state)``) are cast alike, each float array among them. The weights
the optimiser sees, and its state, stay the float32 ones: ``setup``, ``train``, ``update``, ``TrainStep``, saving
and loading work on the wrapper as on the model, and the update lands on the float32 "master" weights.
Normalisation layers (BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm) keep their parameters and statistics
in float32 and take the half activations as they come. So do the whole-sequence recurrent layers (RNN, LSTM, GRU):
cuDNN computes each of their problems in the half type or in float32, whichever it measured faster
(:mod:`fluxpy.kernels.cuda_rnn`), and where float32 wins the float32 weights go in as they are (no cast there and
back each way). On the CPU (NumPy has no bfloat16 arithmetic of its own) the
casts round to the half type and come back to float32: the values are the half type's, the arithmetic float32's.

On the GPU the half copies of 4-d arrays (convolution weights, an image batch) are made in channels-last memory
(``memory="channels_last"``, the default; :mod:`fluxpy.layout`), so the convolutions, batch norms, pools and
elementwise ops run in NHWC with no transposes inside cuDNN, as PyTorch's autocast recipe with
``channels_last``; the float32 masters keep their own layout (their gradients come back in it). cuDNN's half
engines are NHWC, so C-order halves pay a transpose inside every convolution (``mixed_precision`` in BENCHMARKS.md);
``memory="contiguous"`` keeps C order (float32 training is faster in C order: cuDNN's float32 engines are NCHW).

Why a wrapper around the model and not an optimiser wrapper (as Optimisers.jl's ``MixedPrecision`` rule) or a
global switch (PyTorch's ``autocast``): the wrapper is a plain layer, so nothing else in fluxpy needs to know about
it: the optimiser is any rule, the model is saved as its float32 self, and which parts run in the half type is
visible in the model's printout. The cost is a cast of every weight per step and of every gradient back: on the
GPU all the weights in one launch and all the gradients in one (``cuda/cast_many.cu``, the float16 loss scale
divided out in the same launch; :func:`cast_reason` says why a call cast one array at a time instead), captured with
the rest of the step in a CUDA graph.

float16 has a narrow range: small gradients underflow to zero. The loss scale multiplies the gradient that
flows back into the half-precision model and divides the weights' gradients by it again in float32. For float16
the default is a :class:`DynamicLossScale` (PyTorch's ``GradScaler``): it lives on the device; a step whose scaled
gradients overflow is skipped (``update``, ``train`` and ``TrainStep`` see the wrapper's ``loss_scaler`` and apply
the update only where every gradient is finite: on the device, inside a captured step) and the scale halves;
after ``growth_interval`` good steps in a row it doubles. No host sync is needed for it in a captured step (the
eager ``update`` reads one flag, as PyTorch's ``GradScaler.step`` does). ``loss_scale=<number>`` is a static
scale (an overflow is then a ``TrainingDiverged`` in ``train``); bfloat16 has float32's range and needs none.
Dynamic scaling needs the ``MixedPrecision`` to be the model given to the optimiser (the outermost layer).

>>> import numpy as np
>>> from fluxpy.layers import Dense
>>> m = mixed_precision(Dense(3, 2), "bfloat16")
>>> m
MixedPrecision(Dense(3 => 2), bfloat16)
>>> y = m(np.ones((4, 3), np.float32))
>>> y.dtype, m.model.weight.dtype   # float32 out, float32 master weights
(dtype('float32'), dtype('float32'))
"""
from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from .autodiff import Primitive, gradient_depth, value_of
from .backend import Array, copy_into, get_array_module, gpu_device, is_float_dtype, to_cpu
from .capturing import capturing, refuse
from .kernels import find
from .functors import children, layer, rebuild, trainable_keys
from .kernels.halfs import BFLOAT16, HALVES
from .layers.normalise import BatchNorm, GroupNorm, InstanceNorm, LayerNorm, RMSNorm
from .layers.recurrent import GRU, LSTM, RNN
from .layout import MEMORY_FORMATS, is_channels_last
from .ops.shape import as_memory_format, astype
from .optimise import Plan

__all__ = ["MixedPrecision", "DynamicLossScale", "LossScaleUnderflow", "mixed_precision", "f16", "bf16",
           "cast_reason"]

# layers whose parameters and statistics stay float32 (they take half inputs), in f16/bf16 copies and under
# MixedPrecision; under MixedPrecision the whole-sequence recurrent layers' weights too (MIXED_KEEPS)
KEEP_FLOAT32 = (BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm)
MIXED_KEEPS = KEEP_FLOAT32 + (RNN, LSTM, GRU)


class LossScaleUnderflow(FloatingPointError):
    """A float16 run whose gradients overflowed at every loss scale: the :class:`DynamicLossScale` fell below its
    ``min_scale`` after ``skipped`` skipped steps in a row, so nothing was trained in them. A
    ``FloatingPointError``, as :class:`fluxpy.TrainingDiverged` is.

    >>> err = LossScaleUnderflow("the loss scale fell to 3e-05", 3.0e-5, 30)
    >>> isinstance(err, FloatingPointError), err.scale, err.skipped
    (True, 3e-05, 30)
    """

    def __init__(self, message: str, scale: float, skipped: int) -> None:
        super().__init__(message)
        self.scale, self.skipped = scale, skipped


class DynamicLossScale:
    """A loss scale kept on the device (a float32 ``scale`` and an int32 count of good steps), for float16
    :class:`MixedPrecision`: :meth:`advance` with a step's finite flag halves it after an overflow and doubles it
    after ``growth_interval`` good steps in a row, up to ``max_scale``, on the device (captured with a step).

    ``max_scale`` (default ``2**24``) caps the growth: a model whose gradients never overflow would otherwise
    double the scale every ``growth_interval`` steps until it is infinite, and every step after that would be
    skipped. ``min_scale`` (default ``2**-14``, float16's smallest normal number) is the floor: scaled gradients
    that still overflow float16 at that scale are above about 1e9 or NaN, so the run has diverged, and an eager
    step whose overflow takes the scale below it raises :class:`LossScaleUnderflow` naming the scale and the steps
    skipped in a row, instead of training nothing in silence. (Inside a captured step nothing is read on the host:
    :func:`fluxpy.train` counts its captured steps when it reads their flags; a loop of one's own around a captured
    :class:`fluxpy.TrainStep` calls :meth:`check` now and then.)

    >>> import numpy as np
    >>> s = DynamicLossScale(init=8.0, growth_interval=2)
    >>> scale = s.array(np)
    >>> for flag in (0.0, 0.0, np.nan):
    ...     s.advance(np.asarray(flag))
    >>> float(s.array(np))   # doubled after two good steps, halved after the overflow
    8.0
    >>> s = DynamicLossScale(init=1.0, min_scale=0.25); _ = s.array(np)
    >>> for _ in range(3):
    ...     s.advance(np.asarray(np.inf))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fluxpy.precision.LossScaleUnderflow: DynamicLossScale: the loss scale fell to 0.125, below min_scale=0.25, ...
    """

    def __init__(self, init: float = 2.0 ** 15, growth_interval: int = 2000, *, min_scale: float = 2.0 ** -14,
                 max_scale: float = 2.0 ** 24) -> None:
        for name, value in (("init", init), ("min_scale", min_scale), ("max_scale", max_scale)):
            _check_scale(f"DynamicLossScale: {name}", value)
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral):
            raise TypeError(f"DynamicLossScale: growth_interval must be an int >= 1, got {_short(growth_interval)}")
        if growth_interval < 1:
            raise ValueError(f"DynamicLossScale: growth_interval must be an int >= 1, got {growth_interval!r}")
        if not min_scale <= init <= max_scale:
            raise ValueError(f"DynamicLossScale: needs min_scale <= init <= max_scale, got {min_scale!r}, {init!r} "
                             f"and {max_scale!r}")
        self.init, self.growth_interval = float(init), int(growth_interval)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self._scale = self._good = None
        self._start = None     # (scale, good) that the device arrays are made from: a loaded checkpoint's
        self._skipped = 0      # eager steps in a row whose gradients overflowed (counted on the host)

    def array(self, xp: Any) -> Array:
        """The scale, a 0-d float32 array of ``xp`` (NumPy or CuPy; made on first use, outside any capture)."""
        if self._scale is None or get_array_module(self._scale) is not xp:
            refuse("MixedPrecision: its dynamic loss scale is made by the first (eager) call, not inside a capture")
            scale, good = self._start if self._start is not None else (self.init, 0)
            self._scale, self._good = xp.asarray(scale, dtype=np.float32), xp.asarray(good, dtype=np.int32)
        return self._scale

    def advance(self, flag: Array, applied: Array | None = None) -> None:
        """After a step whose gradients' finite flag is ``flag`` (finite: every gradient was), on the device: an
        overflow halves the scale; a good step counts where ``applied`` (default ``flag``) is finite too, i.e.
        where the update ran (a captured step skipped for another step's sake counts for nothing). Outside a
        capture the flag is read on the host (the caller has waited for it already) to count the overflows in a
        row and raise :class:`LossScaleUnderflow` below ``min_scale``."""
        if self._scale is None:
            return
        applied = flag if applied is None else applied
        kernel = find("loss_scale_advance", self._scale)
        if kernel is not None:
            kernel(self._scale, self._good, flag, applied, self.growth_interval, self.max_scale)
        elif not np.isfinite(flag):
            self._scale[...], self._good[...] = self._scale * np.float32(0.5), 0
        elif np.isfinite(applied):
            self._good[...] = self._good + 1
            if self._good >= self.growth_interval:
                self._scale[...], self._good[...] = np.minimum(self._scale * np.float32(2), self.max_scale), 0
        if not capturing():
            self.counted(Plan.is_finite(flag))

    def counted(self, finite: bool) -> None:
        """Count on the host a step whose gradients were finite or not (:meth:`advance` does, outside a capture;
        :func:`fluxpy.train` does for its captured steps when it reads their flags); an overflow that leaves the
        scale below ``min_scale`` raises :class:`LossScaleUnderflow`.

        >>> s = DynamicLossScale(); s.counted(False); s.get_state()["skipped"]
        1
        """
        self._skipped = 0 if finite else self._skipped + 1
        if not finite:
            self.check()

    def check(self) -> None:
        """Raise :class:`LossScaleUnderflow` if the scale is below ``min_scale`` (one read of it on the host).

        >>> DynamicLossScale().check()
        """
        scale = self.scale
        if scale < self.min_scale:
            raise LossScaleUnderflow(
                f"DynamicLossScale: the loss scale fell to {scale:g}, below min_scale={self.min_scale:g}, after "
                f"{self._skipped} steps in a row whose scaled float16 gradients were not finite and were skipped, so "
                "nothing was trained in them: the gradients are NaN or infinite at any scale (look for a log, sqrt "
                "or division at zero in the loss or the model, or lower the learning rate), or train in bfloat16 "
                "(mixed_precision(model, \"bfloat16\")), which needs no loss scale", scale, self._skipped)

    @property
    def scale(self) -> float:
        """The scale now, read on the host (a sync on the GPU)."""
        if self._scale is None:
            return self.init if self._start is None else float(self._start[0])
        return float(self._scale)

    def get_state(self) -> dict:
        """The scale's state on the host, for a checkpoint: ``{"scale": 0-d float32, "good": 0-d int32,
        "skipped": int}`` (:func:`fluxpy.save_training` stores it; :meth:`set_state` restores it).

        >>> DynamicLossScale(init=4.0).get_state()
        {'scale': array(4., dtype=float32), 'good': array(0, dtype=int32), 'skipped': 0}
        """
        if self._scale is None:
            scale, good = self._start if self._start is not None else (self.init, 0)
        else:
            scale, good = to_cpu(self._scale), to_cpu(self._good)
        return {"scale": np.array(scale, dtype=np.float32), "good": np.array(good, dtype=np.int32),
                "skipped": self._skipped}

    def set_state(self, state: dict) -> None:
        """Restore :meth:`get_state`'s values: into the device arrays in place where they exist (a captured step
        keeps reading them), else kept for the first call to make them from.

        >>> s = DynamicLossScale(); s.set_state(DynamicLossScale(init=8.0).get_state()); s.scale
        8.0
        """
        scale, good = np.array(state["scale"], np.float32), np.array(state["good"], np.int32)
        self._start, self._skipped = (scale, good), int(state["skipped"])
        if self._scale is not None:
            copy_into(self._scale, scale)
            copy_into(self._good, good)

    def __repr__(self) -> str:
        limits = "".join(f", {name}={value:g}" for name, value, default in (
            ("min_scale", self.min_scale, 2.0 ** -14), ("max_scale", self.max_scale, 2.0 ** 24)) if value != default)
        return f"DynamicLossScale(init={self.init:g}, growth_interval={self.growth_interval}{limits})"


def _check_scale(who, value):
    """A ``TypeError`` for a value that is not a real number, a ``ValueError`` for one that is not positive and
    finite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who} must be a positive finite number, got {_short(value)}")
    if not 0 < value < float("inf"):
        raise ValueError(f"{who} must be a positive finite number, got {value!r}")


def _short(x):
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


@layer(children=("model",))
class MixedPrecision:
    """``model`` (float32) run in ``dtype`` (float16 or bfloat16) with float32 master weights; see the module
    docstring. ``loss_scale``: for float16 a :class:`DynamicLossScale` (the default), a positive number (static)
    or None; bfloat16 takes none by default.

    >>> import numpy as np
    >>> from fluxpy.layers import Dense
    >>> MixedPrecision(Dense(2, 2), np.float16).loss_scale
    DynamicLossScale(init=32768, growth_interval=2000)
    """

    def __init__(self, model: Any, dtype: Any = BFLOAT16, loss_scale: float | None | str = "default",
                 memory: str = "channels_last") -> None:
        self.dtype = _half(dtype)
        if memory not in MEMORY_FORMATS:
            raise ValueError(f"MixedPrecision: memory must be one of {MEMORY_FORMATS}, got {memory!r}")
        self.memory = memory
        if isinstance(loss_scale, str) and loss_scale == "default":
            loss_scale = DynamicLossScale() if self.dtype == np.float16 else None
        if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
            _check_scale("MixedPrecision: loss_scale (a DynamicLossScale, a positive finite number or None)",
                         loss_scale)
        bad = [a.dtype for a in _float_leaves(model) if a.dtype != np.float32]
        if bad:
            raise TypeError(f"MixedPrecision: the model's master weights must be float32 (convert it with "
                            f"fluxpy.f32(model)), got an array of {bad[0]}")
        self.model = model
        self.loss_scale = loss_scale if loss_scale is None or isinstance(loss_scale, DynamicLossScale) \
            else float(loss_scale)

    @property
    def loss_scaler(self) -> DynamicLossScale | None:
        """The dynamic loss scale that ``update``/``train``/``TrainStep`` advance after each step, or None."""
        return self.loss_scale if isinstance(self.loss_scale, DynamicLossScale) else None

    def __call__(self, *xs: Any, **kw: Any) -> Any:
        if not xs:
            raise TypeError("MixedPrecision expects the model's inputs, got none")
        first = next((a for a in _leaves(xs) if hasattr(a, "shape")), None)
        if first is None:   # no array among the inputs (bags as lists): the weights say where the model runs
            first = next(iter(_float_leaves(self.model)), xs[0])
        scale = self.loss_scale
        if isinstance(scale, DynamicLossScale):
            scale = scale.array(get_array_module(value_of(first)))
        to_half = self._caster(first)
        half = self._half_model(first, to_half, scale)
        cast = (lambda a: to_half(a) if _floating(a) else a)   # every float input (tuples too), keywords included
        y = half(*_map_outputs(xs, cast), **{name: _map_outputs(v, cast) for name, v in kw.items()})

        def to_float32(a):   # (on the CPU: the cotangent rounded)
            out = astype(to_half(a), np.float32)
            return out if scale is None else _scaled_backward(out, scale)   # the cotangent into the model, scaled
        return _map_outputs(y, lambda a: to_float32(a) if _floating(a) else a)

    def _half_model(self, x, to_half, scale):
        """The model with its weights in the half type, their gradients coming back to the float32 weights
        (divided by ``scale`` where it is given): on the GPU all in one launch each way where the batched cast takes
        them (:func:`cast_reason` says why not), else one differentiable cast per weight."""
        weights, kept_weights = _split_leaves(self.model, with_kept=scale is not None)
        kept = None if scale is None else _kept_unscaler(kept_weights, scale)
        reason = _why_not_batched(x, weights, self.dtype, self.memory)
        _last_reason[0] = reason
        if reason:
            unscaled = None if scale is None else (lambda w: _unscaled_backward(w, scale))
            return _map_floats(self.model, lambda w: to_half(w if unscaled is None else unscaled(w)), kept,
                               MIXED_KEEPS)
        halves = _to_halves(*weights, dtype=self.dtype, memory=self.memory, scale=scale)
        index = iter(range(len(weights)))
        return _map_floats(self.model, lambda w: _pick(halves, next(index)), kept, MIXED_KEEPS)

    def _caster(self, x):
        """The differentiable cast to the half type: on the GPU to ``dtype``; on the CPU, where NumPy has no
        bfloat16 arithmetic of its own, to ``dtype`` and back to float32 (values rounded to the half type,
        computed in float32)."""
        dtype = self.dtype
        if gpu_device(value_of(x)) is None:
            return lambda w: astype(astype(w, dtype), np.float32)
        if self.memory == "channels_last":   # the half copies of 4-d arrays (conv weights, the batch) in NHWC
            return lambda w: as_memory_format(astype(w, dtype), "channels_last") if len(w.shape) == 4 else \
                astype(w, dtype)
        return lambda w: astype(w, dtype)

    def __repr__(self) -> str:
        default = self.loss_scale is None if self.dtype != np.float16 else (
            isinstance(self.loss_scale, DynamicLossScale) and self.loss_scale.init == 2.0 ** 15
            and self.loss_scale.growth_interval == 2000)
        scale = "" if default else f", loss_scale={self.loss_scale!r}"
        memory = "" if self.memory == "channels_last" else f", memory={self.memory!r}"
        return f"MixedPrecision({self.model!r}, {self.dtype.name}{scale}{memory})"


def mixed_precision(model: Any, dtype: Any = BFLOAT16, **kw: Any) -> MixedPrecision:
    """``MixedPrecision(model, dtype, **kw)``: the float32 ``model`` run in float16 or bfloat16 with float32
    master weights (see :mod:`fluxpy.precision`).

    >>> from fluxpy.layers import Dense
    >>> mixed_precision(Dense(2, 2)).dtype.name
    'bfloat16'
    """
    return MixedPrecision(model, dtype, **kw)


def f16(model: Any) -> Any:
    """A copy of ``model`` with every floating-point array converted to float16 (Flux's ``f16``), but the
    parameters and statistics of normalisation layers, which stay float32. For training prefer
    :func:`mixed_precision` (float32 master weights).

    >>> from fluxpy.layers import Dense
    >>> f16(Dense(2, 3)).weight.dtype
    dtype('float16')
    """
    return _map_floats(model, lambda a: a.astype(np.float16))


def bf16(model: Any) -> Any:
    """A copy of ``model`` with every floating-point array converted to bfloat16 (``ml_dtypes.bfloat16``), but
    the parameters and statistics of normalisation layers, which stay float32.

    >>> from fluxpy.layers import Dense
    >>> bf16(Dense(2, 3)).weight.dtype.name
    'bfloat16'
    """
    return _map_floats(model, lambda a: a.astype(BFLOAT16))


def _half(dtype):
    try:
        d = BFLOAT16 if str(dtype) in ("bfloat16", "bf16") else np.dtype(dtype)
    except TypeError:
        d = None
    if d not in HALVES:
        raise TypeError(f"MixedPrecision: dtype must be float16 or bfloat16 (ml_dtypes.bfloat16 or 'bfloat16'), "
                        f"got {dtype!r}")
    return d


def _floating(v):
    dtype = getattr(v, "dtype", None)
    return dtype is not None and is_float_dtype(dtype)


def _map_floats(model: Any, fn: Callable, kept: Callable | None = None, keep: tuple = KEEP_FLOAT32) -> Any:
    """``model`` rebuilt with ``fn`` applied to each float array (or tracked value) outside the layers of ``keep``
    (:data:`KEEP_FLOAT32`, or :data:`MIXED_KEEPS`). Those keep their float32 arrays, the model's own (so their
    running statistics update in place); ``kept``, where given, is applied to their trainable parameters (the loss
    scale's unscaling of their gradients), those of their sublayers too (a recurrent layer's cells)."""
    if isinstance(model, keep):
        return model if kept is None else _map_trainable(model, kept)
    kids = children(model)
    if kids is None:
        return fn(model) if _floating(model) and model.dtype not in HALVES else model
    return rebuild(model, [(k, _map_floats(v, fn, kept, keep)) for k, v in kids])


def _map_trainable(model: Any, fn: Callable) -> Any:
    """``model`` rebuilt with ``fn`` applied to each trainable float array in it, at any depth."""
    kids = children(model)
    if kids is None:
        return fn(model) if _floating(model) else model
    names = trainable_keys(model)
    return rebuild(model, [(k, v if _floating(v) and names is not None and k not in names else _map_trainable(v, fn))
                           for k, v in kids])


def _trainable_leaves(model):
    """The arrays :func:`_map_trainable` applies its ``fn`` to, in its order."""
    kids = children(model)
    if kids is None:
        return [model] if _floating(model) else []
    names = trainable_keys(model)
    return [a for k, v in kids if not (_floating(v) and names is not None and k not in names)
            for a in _trainable_leaves(v)]


def _leaves(v):
    """The values inside nested tuples and lists ``v`` (an input or output of a model), in order."""
    if isinstance(v, (tuple, list)):
        return [a for item in v for a in _leaves(item)]
    return [v]


def _map_outputs(v, fn):
    """``v`` with ``fn`` applied to each value inside its nested tuples and lists (a recurrent cell's ``(h, (h, c))``,
    attention's ``(y, scores)``)."""
    if isinstance(v, (tuple, list)):
        return type(v)(_map_outputs(item, fn) for item in v)
    return fn(v)


def _split_leaves(model, keep=MIXED_KEEPS, with_kept=True):
    """``(cast, kept)``: the arrays :func:`_map_floats` applies its ``fn`` to and (``with_kept``, else none) those it
    applies its ``kept`` to (with the same ``keep``), each in its order, in one walk of the model (an eager step pays
    for every walk)."""
    cast, kept = [], []

    def walk(m):
        if isinstance(m, keep):
            if with_kept:
                kept.extend(_trainable_leaves(m))
            return
        kids = children(m)
        if kids is None:
            if _floating(m) and m.dtype not in HALVES:
                cast.append(m)
            return
        for _, v in kids:
            walk(v)
    walk(model)
    return cast, kept


def _float_leaves(model):
    if isinstance(model, KEEP_FLOAT32):
        return []
    kids = children(model)
    if kids is None:
        return [model] if _floating(model) else []
    return [a for _, v in kids for a in _float_leaves(v)]


def _scale_rule(x, scale):
    def scaled_pullback(dy):   # scale: a number, or a 0-d float32 array on dy's device (a dynamic scale)
        return (dy * (dy.dtype.type(scale) if isinstance(scale, float) else scale.astype(dy.dtype, copy=False)),)
    return x, scaled_pullback


def _unscale_rule(x, scale):
    def unscaled_pullback(dy):
        return (_divided(dy, scale),)
    return x, unscaled_pullback


def _divided(dy, scale):
    """``dy`` divided by the loss scale (a number, or a 0-d float32 array on dy's device) in ``dy``'s dtype."""
    return dy / (dy.dtype.type(scale) if isinstance(scale, float) else scale.astype(dy.dtype, copy=False))


_scaled_backward = Primitive("scaled_backward", _scale_rule, impl=lambda x, scale: x)
_unscaled_backward = Primitive("unscaled_backward", _unscale_rule, impl=lambda x, scale: x)


# -- every weight to the half type in one launch, every gradient back in one -------------------------------------

_last_reason = [""]


def cast_reason() -> str:
    """Why the last :class:`MixedPrecision` call cast its weights one array at a time (a launch each way for each)
    instead of all of them in one launch each way ("" where it did the latter: CuPy float32 weights, as a model on
    the GPU has them).

    >>> import numpy as np
    >>> from fluxpy.layers import Dense
    >>> _ = mixed_precision(Dense(2, 2))(np.ones((1, 2), np.float32))
    >>> cast_reason()[:37]
    'on the CPU the casts round each array'
    """
    return _last_reason[0]


def _why_not_batched(x, weights, dtype, memory) -> str:
    """Why :func:`_to_halves` is not used for ``weights`` ("" where it is)."""
    if gpu_device(value_of(x)) is None:
        return "on the CPU the casts round each array to the half type and back to float32 (NumPy has no bfloat16 " \
               "arithmetic of its own)"
    if not weights:
        return "the model has no weight outside its float32 layers (normalisation, recurrent) to cast"
    if gradient_depth() > 1:
        return "a derivative of a derivative is being recorded: each weight's cast is recorded to be differentiated"
    values = [value_of(w) for w in weights]
    if find("astype_many", values[0], values, dtype, _half_layouts(values, memory)) is None:
        kinds = sorted({f"{type(v).__module__.split('.')[0]} {getattr(v, 'dtype', type(v).__name__)}" for v in values})
        return f"the batched cast takes float32 CuPy arrays on one device; the weights are {', '.join(kinds)}"
    return ""


def _half_layouts(weights, memory) -> list:
    """Which half copies are channels-last: 4-d weights under ``memory="channels_last"``, and channels-last ones."""
    return [(memory == "channels_last" and w.ndim == 4) or is_channels_last(w) for w in weights]


def _to_half(w, dtype, memory):
    """One weight's half copy as :meth:`MixedPrecision._caster` makes it on the GPU."""
    half = astype(w, dtype)
    return as_memory_format(half, "channels_last") if memory == "channels_last" and len(w.shape) == 4 else half


def _to_float32(dy, w, memory, scale):
    """The gradient of ``w`` from its half copy's cotangent ``dy``, as :func:`_to_half`'s pullbacks give it (and
    :func:`_unscale_rule`'s, where ``scale`` is given)."""
    if memory == "channels_last" and len(w.shape) == 4:
        dy = as_memory_format(dy, "channels_last" if is_channels_last(value_of(w)) else "contiguous")
    g = astype(dy, w.dtype)
    return g if scale is None else _divided(g, scale)


class _Pieces:
    """The cotangent of :func:`_to_halves`'s tuple: ``parts``, ``{index: cotangent}`` of the items picked (by
    :func:`_pick`) that got one. The backward walk adds two cotangents of one value with ``+``, this type's union
    (the cotangents of one index added), made in place in the left one: the walk owns both, each made new by a
    pullback.

    >>> import numpy as np
    >>> sorted((_Pieces({0: np.ones(1)}) + _Pieces({2: np.ones(1)}) + _Pieces({0: np.ones(1)})).parts.items())
    [(0, array([2.])), (2, array([1.]))]
    """
    __slots__ = ("parts",)

    def __init__(self, parts: dict) -> None:
        self.parts = parts

    def __add__(self, other: _Pieces) -> _Pieces:
        parts = self.parts
        for i, g in other.parts.items():
            parts[i] = g if i not in parts else parts[i] + g
        return self


def _to_halves_rule(needs, *weights, dtype, memory, scale):
    values = [value_of(w) for w in weights]
    layouts = _half_layouts(values, memory)
    kernel = find("astype_many", values[0], values, dtype, layouts)
    halves = tuple(kernel(values[0], values, dtype, layouts)) if kernel is not None else \
        tuple(_to_half(w, dtype, memory) for w in weights)

    def to_halves_pullback(pieces):
        return _float32_gradients(pieces, needs, values, dtype, scale,
                                  lambda i, dy: _to_float32(dy, weights[i], memory, scale))
    return halves, to_halves_pullback


def _float32_gradients(pieces, needs, values, dtype, scale, one):
    """The float32 gradients of the float32 ``values`` from their cotangents in ``pieces`` (of ``dtype``) divided by
    ``scale`` (None: not): in one launch in the values' own layouts where the ``astype_many`` kernel takes them, else
    ``one(i, cotangent)`` each; None for a value whose cotangent is missing or that ``needs`` no gradient."""
    grads = [None] * len(values)
    wanted = {i: dy for i, dy in pieces.parts.items() if needs[i]}
    batch = [i for i, dy in wanted.items() if type(dy) is type(values[i]) and dy.dtype == dtype
             and dy.shape == values[i].shape]
    if batch:
        dys, layouts = [wanted[i] for i in batch], [is_channels_last(values[i]) for i in batch]
        kernel = find("astype_many", dys[0], dys, np.float32, layouts, scale)
        if kernel is not None:
            for i, g in zip(batch, kernel(dys[0], dys, np.float32, layouts, scale)):
                grads[i] = g
    for i, dy in wanted.items():
        if grads[i] is None:
            grads[i] = one(i, dy)
    return tuple(grads)


def _to_halves_impl(*weights, dtype, memory, scale):
    return _to_halves_rule((False,) * len(weights), *weights, dtype=dtype, memory=memory, scale=scale)[0]


_to_halves = Primitive("to_halves", _to_halves_rule, impl=_to_halves_impl, needs_mask=True, doc="""\
``(*weights, dtype, memory, scale)`` -> a tuple of the weights' half copies (:func:`_pick` takes them apart): the
casts of :meth:`MixedPrecision._caster` on the GPU (4-d weights channels-last under ``memory="channels_last"``), all
in one launch where the ``astype_many`` kernel takes them; the pullback (of :class:`_Pieces`) turns the half
cotangents to float32 and divides them by ``scale`` (None: not), in one launch in the weights' own layouts where the
kernel takes them, else one array at a time as :func:`_to_float32`; a weight whose copy got no cotangent, or that
needs no gradient, gets none.""")


def _kept_unscaler(leaves, scale):
    """What :func:`_map_floats` applies to the float32 layers' parameters ``leaves`` (in its order) under a loss
    ``scale``: each returned as it is, its gradient divided by the scale; on the GPU all of them in one launch
    (:func:`_unscaled_many`), while a derivative of a derivative is recorded one differentiable division each."""
    if len(leaves) < 2 or gradient_depth() > 1:
        return lambda w: _unscaled_backward(w, scale)
    unscaled = _unscaled_many(*leaves, scale=scale)
    index = iter(range(len(leaves)))
    return lambda w: _pick(unscaled, next(index))


def _unscaled_many_rule(needs, *weights, scale):
    values = [value_of(w) for w in weights]

    def unscaled_many_pullback(pieces):
        return _float32_gradients(pieces, needs, values, np.float32, scale, lambda i, dy: _divided(dy, scale))
    return tuple(values), unscaled_many_pullback


_unscaled_many = Primitive("unscaled_many", _unscaled_many_rule, impl=lambda *weights, scale: tuple(weights),
                           needs_mask=True, doc="""\
``(*weights, scale)`` -> the weights as they are (a tuple, taken apart by :func:`_pick`); the pullback (of
:class:`_Pieces`) divides their cotangents by the loss ``scale``, all in one launch where the ``astype_many`` kernel
takes them (float32 to float32, divided), else one array at a time as :func:`_unscaled_backward`'s pullback. The
float32 layers' parameters (normalisation, recurrent) under a loss scale: one launch a step in place of a division
(and a copy of the scale) for each.""")


def _pick_rule(halves, i):
    def pick_pullback(dy):
        return _Pieces({i: dy}), None
    return halves[i], pick_pullback


_pick = Primitive("pick", _pick_rule, impl=lambda halves, i: halves[i])
