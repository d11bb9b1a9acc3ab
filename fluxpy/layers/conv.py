"""Convolution layers (Flux's ``src/layers/conv.jl``): Conv, CrossCor, ConvTranspose, DepthwiseConv.

Each works in 1, 2 or 3 spatial dimensions, as many as its kernel has sizes (``Conv((5,), ...)`` takes
``(N, C, L)``, ``Conv((3, 3, 3), ...)`` takes ``(N, C, D, H, W)``; an int kernel means 2-d). Each checks the
input's rank, channels and geometry against its weight before any kernel runs, then makes one fused call: the
convolution, the bias and the activation.
"""
from __future__ import annotations

from collections.abc import Callable

from ..backend import get_array_module, is_float_dtype
from ..functors import layer
from ..ops.activations import identity, relu  # noqa: F401  (relu: used by the docstring examples)
from ..ops.bias_act import bias_act
from ..ops.conv import conv_bias_act, conv_dims, conv_transpose
from ..ops.dims import ntuple, pad_widths, spatial_layout
from ..ops.padding import pad_circular, pad_reflect, pad_repeat
from ..ops.shape import reshape
from ._checks import (Array, _activation, _fail, _given_bias, _initialised, _positive_int, _renamed, _require_dtype,
                      _require_ndim)
from .init import RNG, glorot_uniform, ones32, zeros32  # noqa: F401  (ones32: used by the docstring examples)
from .show import _act_part, _options


@layer(children=("weight", "bias"))
class Conv:
    """A convolution in 1, 2 or 3 spatial dimensions, then the bias and ``act`` in one fused op:
    ``y = act(conv(x, weight) + bias)``.

    A true convolution (the kernel flipped, as Flux's ``Conv``; see :class:`CrossCor` for
    PyTorch's ``conv2d``). ``kernel`` is a tuple of one size per spatial axis (an int means a square 2-d kernel):
    ``x`` is ``(N, cin, L)``, ``(N, cin, H, W)`` or ``(N, cin, D, H, W)``; ``weight`` is ``(cout, cin/groups,
    *kernel)``, made by ``init``; ``bias`` is ``(cout,)``, as for :class:`Dense`. ``stride`` and ``dilation`` are
    ints or one per spatial axis; ``pad`` is an int, one per axis, a ``(before, after)`` pair per axis (``(top,
    bottom, left, right)`` in 2-d) or ``"same"``; ``groups`` must divide ``cin`` and ``cout``.
    The constructor checks all of these; ``x`` must have the weight's dtype (see :class:`Dense`).
    Flux writes ``Conv((3, 3), 1 => 16, relu; pad=1)``; here it is ``Conv((3, 3), 1, 16, relu,
    pad=1)``, and ``repr`` prints Flux's form.

    >>> import numpy as np
    >>> c = Conv((3, 3), 1, 16, relu, pad=1)
    >>> c, c.weight.shape, c(np.ones((2, 1, 28, 28), np.float32)).shape
    (Conv((3, 3), 1 => 16, relu, pad=1), (16, 1, 3, 3), (2, 16, 28, 28))
    >>> Conv((3, 3), 2, 3)(np.ones((5, 4, 9, 9), np.float32))
    Traceback (most recent call last):
    ...
    fluxpy.layers.DimensionMismatch: Conv((3, 3), 2 => 3) expects x.shape[1] == 2, got (5, 4, 9, 9) float32
    >>> Conv((5,), 2, 4, pad=2)(np.ones((3, 2, 10), np.float32)).shape
    (3, 4, 10)
    >>> Conv((3, 3, 3), 1, 8, stride=(1, 2, 2))(np.ones((2, 1, 5, 9, 9), np.float32)).shape
    (2, 8, 3, 4, 4)

    Flux's ``Conv(weight, bias=true, act)`` form (also for :class:`CrossCor`, :class:`ConvTranspose` with its
    ``(cin, cout/groups, *kernel)`` weight and :class:`DepthwiseConv` with a ``(cin, cout/cin, *kernel)`` one): a
    float ``weight`` first (a Flux weight array with its axes reversed), then the bias (True: zeros of the weight's
    dtype; False; an array, converted to it) and the activation; the keywords as above. A bias made here always has
    the weight's dtype (Flux issue 1421).

    >>> Conv(np.ones((3, 1, 2, 2), np.float32), False, relu, pad=1)
    Conv((2, 2), 1 => 3, relu, pad=1, bias=False)

    ``padding_mode`` (PyTorch's name; Flux has none) fills the ``pad`` border with ``"zeros"`` (the default),
    or by ``"reflect"``, ``"replicate"`` or ``"circular"`` (:func:`fluxpy.ops.padding.pad_reflect`, ``pad_repeat``,
    ``pad_circular``), which pad ``x`` before a convolution without padding.

    >>> c = Conv((3,), 1, 1, pad=1, padding_mode="circular", bias=False, init=ones32)
    >>> c, c(np.array([[[1.0, 2.0, 3.0]]], np.float32))
    (Conv((3,), 1 => 1, pad=1, padding_mode="circular", bias=False), array([[[6., 6., 6.]]], dtype=float32))
    """
    flipped = False

    def __init__(self, kernel: int | tuple[int, ...] | Array, cin: int | None = None, cout: int | None = None,
                 act: Callable = identity, *, stride: int | tuple[int, ...] = 1, pad: int | tuple[int, ...] | str = 0,
                 dilation: int | tuple[int, ...] = 1, groups: int = 1, bias: bool | Array = True,
                 init: Callable = glorot_uniform, rng: RNG = None, padding_mode: str = "zeros") -> None:
        name = type(self).__name__
        self.padding_mode = _padding_mode(name, padding_mode)
        if hasattr(kernel, "shape"):   # Flux's Conv(weight, bias, act): the second and third arguments
            weight = _weight_array(name, kernel)
            bias, act = (bias if cin is None else cin), (act if cout is None else cout)
            _check_geometry(name, stride, pad, dilation, weight.ndim - 2)
            groups = _positive_int(name, "groups", groups)
            self.act = _activation(name, act)
            self.weight = weight
            self.bias = _bias_like(name, bias, weight, weight.shape[0])
            self.stride, self.pad, self.dilation, self.groups = stride, pad, dilation, groups
            return
        if cin is None or cout is None:
            raise TypeError(f"{name} expects {name}(kernel, cin, cout, ...) or {name}(weight, bias, act)")
        kernel, cin, cout, groups = _conv_sizes(name, kernel, cin, cout, groups)
        _check_geometry(name, stride, pad, dilation, len(kernel))
        self.act = _activation(name, act)
        self.weight = _initialised(name, init, (cout, cin // groups, *kernel), rng)
        self.bias = _bias_like(name, bias, self.weight, cout)
        self.stride, self.pad, self.dilation, self.groups = stride, pad, dilation, groups

    @property
    def in_channels(self):
        return self.weight.shape[1] * self.groups

    @property
    def out_channels(self):
        return self.weight.shape[0]

    def _options(self):
        return dict(stride=self.stride, pad=self.pad, dilation=self.dilation, groups=self.groups,
                    flipped=self.flipped)

    def __call__(self, x: Array) -> Array:
        _require_input(self, x, self.weight, self.in_channels)
        _require_dtype(self, x, self.weight.dtype)
        try:
            cd = conv_dims(x, self.weight, **self._options())
        except ValueError as err:
            raise _renamed(self, err, "conv") from None
        options = self._options()
        if getattr(self, "padding_mode", "zeros") != "zeros" and any(cd.pad):
            x = _padded(self, x, cd.pad)
            options["pad"] = 0
        return conv_bias_act(x, self.weight, self.bias, self.act, **options)

    def __repr__(self):
        kernel = tuple(self.weight.shape[2:])
        return (f"{type(self).__name__}({kernel}, {self.in_channels} => {self.out_channels}{_act_part(self.act)}"
                + _options([("pad", self.pad, 0), ("stride", self.stride, 1), ("dilation", self.dilation, 1),
                            ("groups", self.groups, 1)]) + _mode_part(self)
                + ("" if self.bias is not None else ", bias=False") + ")")


@layer(children=("weight", "bias"))
class CrossCor(Conv):
    """As :class:`Conv`, with the same arguments, but cross-correlation: the kernel is not flipped.

    The same weights give the same output as PyTorch's ``Conv2d``.

    >>> import numpy as np
    >>> c = CrossCor((2, 2), 1, 1, bias=False, init=ones32)
    >>> c, c(np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3))[0, 0]
    (CrossCor((2, 2), 1 => 1, bias=False), array([[ 8., 12.],
           [20., 24.]], dtype=float32))
    """
    flipped = True


@layer(children=("weight", "bias"))
class ConvTranspose:
    """The transpose of :class:`Conv` (its gradient with respect to ``x``), then ``act(. + bias)``.

    It maps ``(N, cin, H, W)`` to ``(N, cout, H', W')`` with
    ``H' = (H - 1) * stride - top - bottom + dilation * (kernel - 1) + 1 + output_padding``; 1-d and 3-d
    likewise, as many spatial axes as ``kernel`` has sizes.
    ``weight`` is ``(cin, cout/groups, *kernel)``, as Flux; the other arguments are as for
    :class:`Conv`, and ``output_padding`` is an int or one per spatial axis.

    >>> import numpy as np
    >>> t = ConvTranspose((2, 2), 8, 4, relu, stride=2)
    >>> t, t.weight.shape, t(np.ones((1, 8, 7, 7), np.float32)).shape
    (ConvTranspose((2, 2), 8 => 4, relu, stride=2), (8, 4, 2, 2), (1, 4, 14, 14))
    >>> ConvTranspose((2, 2, 2), 4, 2, stride=2)(np.ones((1, 4, 3, 3, 3), np.float32)).shape
    (1, 2, 6, 6, 6)
    """
    flipped = False
    _weight_out_axis = 1   # the weight's output-channel axis, (cin, cout/groups, ...): SpectralNorm's rows

    def __init__(self, kernel: int | tuple[int, ...] | Array, cin: int | None = None, cout: int | None = None,
                 act: Callable = identity, *, stride: int | tuple[int, ...] = 1, pad: int | tuple[int, ...] | str = 0,
                 dilation: int | tuple[int, ...] = 1, groups: int = 1, output_padding: int | tuple[int, ...] = 0,
                 bias: bool | Array = True, init: Callable = glorot_uniform, rng: RNG = None) -> None:
        weight = None
        if hasattr(kernel, "shape"):   # Flux's ConvTranspose(weight, bias, act), weight (cin, cout/groups, ...)
            weight = _weight_array("ConvTranspose", kernel)
            bias, act = (bias if cin is None else cin), (act if cout is None else cout)
            groups = _positive_int("ConvTranspose", "groups", groups)
            kernel, cin, cout = tuple(weight.shape[2:]), weight.shape[0], weight.shape[1] * groups
        elif cin is None or cout is None:
            raise TypeError("ConvTranspose expects ConvTranspose(kernel, cin, cout, ...) or ConvTranspose(weight, "
                            "bias, act)")
        kernel, cin, cout, groups = _conv_sizes("ConvTranspose", kernel, cin, cout, groups)
        step = _check_geometry("ConvTranspose", stride, pad, dilation, len(kernel))
        out_pad = ntuple("ConvTranspose", "output_padding", output_padding, len(kernel), minimum=0, layer=True)
        if any(o >= s for o, s in zip(out_pad, step)):
            raise ValueError(f"ConvTranspose: output_padding must be smaller than stride {step}, got "
                             f"{output_padding!r}")
        if isinstance(pad, str) and any(out_pad):
            raise ValueError(f"ConvTranspose: output_padding must be 0 with pad=\"same\", got {output_padding!r}")
        self.act = _activation("ConvTranspose", act)
        self.weight = _initialised("ConvTranspose", init, (cin, cout // groups, *kernel), rng) if weight is None \
            else weight
        self.bias = _bias_like("ConvTranspose", bias, self.weight, cout)
        self.stride, self.pad, self.dilation, self.groups = stride, pad, dilation, groups
        self.output_padding = output_padding

    @property
    def in_channels(self):
        return self.weight.shape[0]

    @property
    def out_channels(self):
        return self.weight.shape[1] * self.groups

    def __call__(self, x: Array) -> Array:
        _require_input(self, x, self.weight, self.in_channels)
        _require_dtype(self, x, self.weight.dtype)
        try:  # conv_transpose validates the geometry before it runs any kernel
            y = conv_transpose(x, self.weight, stride=self.stride, pad=self.pad, dilation=self.dilation,
                               groups=self.groups, flipped=self.flipped, output_padding=self.output_padding)
        except ValueError as err:
            raise _renamed(self, err, "conv_transpose") from None
        bias = None if self.bias is None else reshape(self.bias, (1, -1) + (1,) * (self.weight.ndim - 2))
        return bias_act(y, bias, self.act)

    def __repr__(self):
        kernel = tuple(self.weight.shape[2:])
        return (f"ConvTranspose({kernel}, {self.in_channels} => {self.out_channels}{_act_part(self.act)}"
                + _options([("pad", self.pad, 0), ("stride", self.stride, 1), ("dilation", self.dilation, 1),
                            ("groups", self.groups, 1), ("output_padding", self.output_padding, 0)])
                + ("" if self.bias is not None else ", bias=False") + ")")


@layer(children=("weight", "bias"))
class DepthwiseConv(Conv):
    """A depthwise convolution (Flux's ``DepthwiseConv``): a :class:`Conv` with ``groups = cin``, each input channel
    convolved with its own ``cout / cin`` kernels. ``cout`` must be a multiple of ``cin``; the other arguments
    (``act``, ``stride``, ``pad``, ``dilation``, ``bias``, ``init``, ``rng``) are :class:`Conv`'s, in 1, 2 or 3
    spatial dimensions. ``weight`` is ``(cout, 1, *kernel)``.

    >>> import numpy as np
    >>> d = DepthwiseConv((3, 3), 4, 8, relu, pad=1)
    >>> d, d.weight.shape, d.groups, d(np.ones((2, 4, 6, 6), np.float32)).shape
    (DepthwiseConv((3, 3), 4 => 8, relu, pad=1), (8, 1, 3, 3), 4, (2, 8, 6, 6))
    >>> DepthwiseConv((3,), 2, 3)
    Traceback (most recent call last):
    ...
    ValueError: DepthwiseConv: cout == 3 must be a multiple of cin == 2
    """

    def __init__(self, kernel: int | tuple[int, ...] | Array, cin: int | None = None, cout: int | None = None,
                 act: Callable = identity, *, stride: int | tuple[int, ...] = 1, pad: int | tuple[int, ...] | str = 0,
                 dilation: int | tuple[int, ...] = 1, bias: bool | Array = True, init: Callable = glorot_uniform,
                 rng: RNG = None, padding_mode: str = "zeros") -> None:
        if hasattr(kernel, "shape"):   # Flux's DepthwiseConv(weight, bias, act): weight (cin, cout/cin, *kernel)
            w = _weight_array("DepthwiseConv", kernel)
            super().__init__(reshape(w, (w.shape[0] * w.shape[1], 1) + tuple(w.shape[2:])), cin, cout, act,
                             stride=stride, pad=pad, dilation=dilation, groups=w.shape[0], bias=bias,
                             padding_mode=padding_mode)
            return
        if cin is None or cout is None:
            raise TypeError("DepthwiseConv expects DepthwiseConv(kernel, cin, cout, ...) or DepthwiseConv(weight, "
                            "bias, act)")
        cin, cout = _positive_int("DepthwiseConv", "cin", cin), _positive_int("DepthwiseConv", "cout", cout)
        if cout % cin:
            raise ValueError(f"DepthwiseConv: cout == {cout} must be a multiple of cin == {cin}")
        super().__init__(kernel, cin, cout, act, stride=stride, pad=pad, dilation=dilation, groups=cin, bias=bias,
                         init=init, rng=rng, padding_mode=padding_mode)

    def __repr__(self):
        kernel = tuple(self.weight.shape[2:])
        return (f"DepthwiseConv({kernel}, {self.in_channels} => {self.out_channels}{_act_part(self.act)}"
                + _options([("pad", self.pad, 0), ("stride", self.stride, 1), ("dilation", self.dilation, 1)])
                + _mode_part(self) + ("" if self.bias is not None else ", bias=False") + ")")


_PADDERS = {"reflect": pad_reflect, "replicate": pad_repeat, "circular": pad_circular}


def _padding_mode(name, mode):
    if mode != "zeros" and mode not in _PADDERS:
        raise ValueError(f"{name}: padding_mode must be \"zeros\", \"reflect\", \"replicate\" or \"circular\", "
                         f"got {mode!r}")
    return mode


def _padded(layer, x, widths):
    """``x`` padded on its spatial axes by ``widths`` (``(before, after)`` per axis, flattened) in the layer's
    ``padding_mode``; a pad too large for the mode names the layer."""
    pad = _PADDERS[layer.padding_mode]
    try:
        return pad(x, widths, dims=tuple(range(2, len(x.shape))))
    except ValueError as err:
        raise _renamed(layer, err, pad.__name__) from None


def _mode_part(layer):
    mode = getattr(layer, "padding_mode", "zeros")
    return "" if mode == "zeros" else f", padding_mode=\"{mode}\""


def _weight_array(name, w):
    """A weight given to a constructor: a float array of 3 to 5 axes (1 to 3 spatial)."""
    if len(w.shape) not in (3, 4, 5) or not is_float_dtype(w.dtype):
        raise ValueError(f"{name}: a weight must be a float array of 3, 4 or 5 axes (1, 2 or 3 spatial), got "
                         f"{tuple(w.shape)} {w.dtype}")
    return w


def _bias_like(name, bias, weight, n):
    """The bias of ``n`` channels in the weight's dtype (Flux issue 1421): zeros for True, None for False, or the
    array given (of shape ``(n,)``, converted)."""
    if bias is True:
        return get_array_module(weight).zeros(n, dtype=weight.dtype)
    if hasattr(bias, "shape") and tuple(bias.shape) == (n,):
        return bias.astype(weight.dtype, copy=False)
    return _given_bias(bias, (n,), name)


def _conv_sizes(name, kernel, cin, cout, groups):
    """Checked ``(kernel tuple, cin, cout, groups)``: positive ints, ``groups`` dividing both channel counts; a
    kernel of 1, 2 or 3 sizes (an int: a square 2-d kernel)."""
    if isinstance(kernel, (tuple, list)) and len(kernel) not in (1, 2, 3):
        raise ValueError(f"{name}: kernel must be a positive int or a tuple of 1, 2 or 3 positive ints (one per "
                         f"spatial axis), got {kernel!r}")
    kernel = ntuple(name, "kernel", kernel, len(kernel) if isinstance(kernel, (tuple, list)) else 2, layer=True)
    cin, cout = _positive_int(name, "cin", cin), _positive_int(name, "cout", cout)
    groups = _positive_int(name, "groups", groups)
    if cin % groups or cout % groups:
        raise ValueError(f"{name}: groups == {groups} must divide cin == {cin} and cout == {cout}")
    return kernel, cin, cout, groups


def _check_geometry(name, stride, pad, dilation, n):
    """Check ``stride``, ``pad`` and ``dilation`` for ``n`` spatial axes when the layer is built (each call checks
    them against x again); returns the stride as a tuple."""
    if not (isinstance(pad, str) and pad == "same"):
        pad_widths(name, pad, n, layer=True)
    ntuple(name, "dilation", dilation, n, layer=True)
    return ntuple(name, "stride", stride, n, layer=True)


def _require_input(layer, x, weight, channels):
    """Raise :class:`DimensionMismatch` unless ``x`` has the weight's rank and ``channels`` channels."""
    n = weight.ndim - 2
    _require_ndim(layer, x, n + 2, spatial_layout(n))
    if x.shape[1] != channels:
        _fail(layer, f"x.shape[1] == {channels}", x)
