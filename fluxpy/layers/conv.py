"""Convolution layers (Flux's ``src/layers/conv.jl``): Conv, CrossCor, ConvTranspose.

Each checks the input's channels and geometry against its weight before any kernel runs, then
makes one fused call: the convolution, the bias and the activation.
"""
from __future__ import annotations

from collections.abc import Callable

from ..functors import layer
from ..ops.activations import identity, relu  # noqa: F401  (relu: used by the docstring examples)
from ..ops.bias_act import bias_act
from ..ops.conv import conv_bias_act, conv_dims, conv_transpose
from ..ops.shape import reshape
from ._checks import (Array, _activation, _given_bias, _initialised, _pad_option, _pair, _positive_int, _renamed,
                      _require_channels, _require_dtype)
from .init import RNG, glorot_uniform, ones32, zeros32  # noqa: F401  (ones32: used by the docstring examples)
from .show import _act_part, _options


@layer(children=("weight", "bias"))
class Conv:
    """A 2-d convolution, then the bias and ``act`` in one fused op: ``y = act(conv(x, weight) + bias)``.

    A true convolution (the kernel flipped, as Flux's ``Conv``; see :class:`CrossCor` for
    PyTorch's ``conv2d``). ``x`` is ``(N, cin, H, W)``; ``weight`` is ``(cout, cin/groups,
    *kernel)``, made by ``init``; ``bias`` is ``(cout,)``, as for :class:`Dense`. ``kernel``,
    ``stride`` and ``dilation`` are ints or pairs; ``pad`` is an int, a pair, a 4-tuple
    ``(top, bottom, left, right)`` or ``"same"``; ``groups`` must divide ``cin`` and ``cout``.
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
    """
    flipped = False

    def __init__(self, kernel: int | tuple[int, int], cin: int, cout: int, act: Callable = identity, *,
                 stride: int | tuple[int, int] = 1, pad: int | tuple[int, ...] | str = 0,
                 dilation: int | tuple[int, int] = 1, groups: int = 1, bias: bool | Array = True,
                 init: Callable = glorot_uniform, rng: RNG = None) -> None:
        name = type(self).__name__
        kernel, cin, cout, groups = _conv_sizes(name, kernel, cin, cout, groups)
        _check_geometry(name, stride, pad, dilation)
        self.act = _activation(name, act)
        self.weight = _initialised(name, init, (cout, cin // groups, *kernel), rng)
        self.bias = zeros32(cout) if bias is True else _given_bias(bias, (cout,), name)
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
        _require_channels(self, x, self.in_channels)
        _require_dtype(self, x, self.weight.dtype)
        try:
            conv_dims(x, self.weight, **self._options())
        except ValueError as err:
            raise _renamed(self, err, "conv") from None
        return conv_bias_act(x, self.weight, self.bias, self.act, **self._options())

    def __repr__(self):
        kernel = tuple(self.weight.shape[2:])
        return (f"{type(self).__name__}({kernel}, {self.in_channels} => {self.out_channels}{_act_part(self.act)}"
                + _options([("pad", self.pad, 0), ("stride", self.stride, 1), ("dilation", self.dilation, 1),
                            ("groups", self.groups, 1)])
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
    ``H' = (H - 1) * stride - top - bottom + dilation * (kernel - 1) + 1 + output_padding``.
    ``weight`` is ``(cin, cout/groups, *kernel)``, as Flux; the other arguments are as for
    :class:`Conv`, and ``output_padding`` is an int or a pair.

    >>> import numpy as np
    >>> t = ConvTranspose((2, 2), 8, 4, relu, stride=2)
    >>> t, t.weight.shape, t(np.ones((1, 8, 7, 7), np.float32)).shape
    (ConvTranspose((2, 2), 8 => 4, relu, stride=2), (8, 4, 2, 2), (1, 4, 14, 14))
    """
    flipped = False

    def __init__(self, kernel: int | tuple[int, int], cin: int, cout: int, act: Callable = identity, *,
                 stride: int | tuple[int, int] = 1, pad: int | tuple[int, ...] | str = 0,
                 dilation: int | tuple[int, int] = 1, groups: int = 1, output_padding: int | tuple[int, int] = 0,
                 bias: bool | Array = True, init: Callable = glorot_uniform, rng: RNG = None) -> None:
        kernel, cin, cout, groups = _conv_sizes("ConvTranspose", kernel, cin, cout, groups)
        step = _check_geometry("ConvTranspose", stride, pad, dilation)
        out_pad = _pair("ConvTranspose: output_padding", output_padding, minimum=0)
        if out_pad[0] >= step[0] or out_pad[1] >= step[1]:
            raise ValueError(f"ConvTranspose: output_padding must be smaller than stride {step}, got "
                             f"{output_padding!r}")
        if isinstance(pad, str) and any(out_pad):
            raise ValueError(f"ConvTranspose: output_padding must be 0 with pad=\"same\", got {output_padding!r}")
        self.act = _activation("ConvTranspose", act)
        self.weight = _initialised("ConvTranspose", init, (cin, cout // groups, *kernel), rng)
        self.bias = zeros32(cout) if bias is True else _given_bias(bias, (cout,), "ConvTranspose")
        self.stride, self.pad, self.dilation, self.groups = stride, pad, dilation, groups
        self.output_padding = output_padding

    @property
    def in_channels(self):
        return self.weight.shape[0]

    @property
    def out_channels(self):
        return self.weight.shape[1] * self.groups

    def __call__(self, x: Array) -> Array:
        _require_channels(self, x, self.in_channels)
        _require_dtype(self, x, self.weight.dtype)
        try:  # conv_transpose validates the geometry before it runs any kernel
            y = conv_transpose(x, self.weight, stride=self.stride, pad=self.pad, dilation=self.dilation,
                               groups=self.groups, flipped=self.flipped, output_padding=self.output_padding)
        except ValueError as err:
            raise _renamed(self, err, "conv_transpose") from None
        bias = None if self.bias is None else reshape(self.bias, (1, -1, 1, 1))
        return bias_act(y, bias, self.act)

    def __repr__(self):
        kernel = tuple(self.weight.shape[2:])
        return (f"ConvTranspose({kernel}, {self.in_channels} => {self.out_channels}{_act_part(self.act)}"
                + _options([("pad", self.pad, 0), ("stride", self.stride, 1), ("dilation", self.dilation, 1),
                            ("groups", self.groups, 1), ("output_padding", self.output_padding, 0)])
                + ("" if self.bias is not None else ", bias=False") + ")")


def _conv_sizes(name, kernel, cin, cout, groups):
    """Checked ``(kernel pair, cin, cout, groups)``: positive ints, ``groups`` dividing both channel counts."""
    kernel = _pair(f"{name}: kernel", kernel)
    cin, cout = _positive_int(name, "cin", cin), _positive_int(name, "cout", cout)
    groups = _positive_int(name, "groups", groups)
    if cin % groups or cout % groups:
        raise ValueError(f"{name}: groups == {groups} must divide cin == {cin} and cout == {cout}")
    return kernel, cin, cout, groups


def _check_geometry(name, stride, pad, dilation):
    """Check ``stride``, ``pad`` and ``dilation`` when the layer is built (each call checks them against x again);
    returns the stride as a pair."""
    _pad_option(name, pad)
    _pair(f"{name}: dilation", dilation)
    return _pair(f"{name}: stride", stride)
