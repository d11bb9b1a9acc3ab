"""The Dense layer's op, ``dense(x, weight, bias, act) = act(x @ weight.T + bias)``, one tape node with the bias and
activation fused into the matrix product where a kernel can.

It means exactly ``bias_act(matmul(x, transpose(weight)), bias, act)`` (the composite), and runs as one node (not
four) whatever computes the product:

- ``identity``, ``relu`` and ``gelu`` (the tanh approximation) are the epilogues of the kernel table's
  ``dense_forward`` (on the GPU cuBLASLt, :mod:`fluxpy.kernels.cublaslt`; on the CPU NumPy,
  :mod:`fluxpy.kernels.cpu_dense`): the product, the bias and the activation are one call, and for gelu in a
  gradient it also keeps the pre-activation, which the derivative reads;
- every other activation (``gelu_erf``, swish, tanh, ...), and a call whose epilogue the kernel declines (an
  alignment, a layout, float64 on the GPU, the halves on the CPU, float32 gelu saving its pre-activation on the
  GPU), runs the product with the bias added by that kernel (its bias epilogue), then the activation alone, the
  product kept as the pre-activation where the derivative reads it; where the kernel declines the bias too, the bare
  product (its, or ``matmul``'s) and one ``bias_act`` pass that adds the bias and keeps the output or the
  pre-activation as the derivative needs (:func:`~fluxpy.ops.bias_act.derivative_from_saved`).

The pullback is then ``dz = dy * act'(saved)`` (one elementwise pass,
:func:`~fluxpy.ops.bias_act.bias_act_backward`; nothing for the identity), ``dx = dz @ weight`` and
``(dweight, dbias) = dense_backward_weight(dz, x)``, one cuBLASLt call that sums the bias gradient as it forms the
weight gradient, in the weight's own layout (where ``bias_act`` added the bias and its backward pass runs, that
pass sums the bias gradient as it forms ``dz``, as the composite's does). The composite itself runs for a nested
gradient and for an activation that draws random numbers. Leading axes of ``x`` are rows.

>>> import numpy as np
>>> from fluxpy import gradient
>>> x, w, b = np.array([[1.0, -2.0]]), np.array([[1.0, 1.0], [2.0, 0.0]]), np.array([0.5, -1.0])
>>> dense(x, w, b, relu)
array([[0., 1.]])
>>> gradient(lambda w: dense(x, w, b, relu).sum(), w)
(array([[ 0.,  0.],
       [ 1., -2.]]),)
"""
from __future__ import annotations

from collections.abc import Callable

from ..autodiff import Primitive, Tracked
from ..backend import Array
from ..kernels import find
from .activations import gelu, identity, relu
from .bias_act import (_bias_act_impl, _draws_random, bias_act, bias_act_backward, bias_act_preactivation,
                       derivative_from_saved)
from .fused import fused_op
from .linalg import matmul
from .reduce import sum as sum_
from .shape import astype, reshape, transpose

__all__ = ["dense", "dense_backward_weight", "epilogue_name"]

_EPILOGUE_NAMES = {identity: "identity", relu: "relu", gelu: "gelu"}


def epilogue_name(act: Callable) -> str | None:
    """The name by which ``dense``'s kernels know ``act`` (``"identity"``, ``"relu"``, ``"gelu"``), or None where
    no kernel computes it (it then runs as ``bias_act``).

    >>> from fluxpy.ops.activations import gelu_erf, swish
    >>> epilogue_name(gelu), epilogue_name(gelu_erf), epilogue_name(swish)
    ('gelu', None, None)
    """
    try:
        return _EPILOGUE_NAMES.get(act)
    except TypeError:   # an unhashable callable
        return None


def _composite(x, weight, bias, act):
    return bias_act(matmul(x, transpose(weight)), bias, act)


def _weight_grads(dz, x, need_db):
    return matmul(transpose(dz), x), (sum_(dz, axis=0) if need_db else None)


dense_backward_weight = fused_op("dense_backward_weight", _weight_grads, doc="""
    ``(dz.T @ x, dz.sum(0))`` for ``dz`` ``(rows, out)`` and ``x`` ``(rows, in)``: a dense layer's weight and bias
    gradients (the sum None where ``need_db`` is false); one cuBLASLt call on the GPU where the kernel takes it.

    >>> import numpy as np
    >>> dense_backward_weight(np.ones((3, 2)), np.arange(6.0).reshape(3, 2), True)
    (array([[6., 9.],
           [6., 9.]]), array([3., 3.]))
    """)


def _product(x, weight, bias, act, save):
    """``(y, aux, biased, activated)``: the call's product by the first that takes it: the kernel table's
    ``dense_forward`` with ``act`` as its epilogue (the bias and the activation applied; ``aux`` gelu's pre-activation
    where ``save``), else that kernel with the bias alone (``biased``: the activation still to apply), else the bare
    product by that kernel or by ``matmul`` (the bias and the activation still to apply)."""
    name = epilogue_name(act)
    if name is not None:
        kernel = find("dense_forward", x, weight, bias, name, save)
        if kernel is not None:
            y, aux = kernel(x, weight, bias, name, save)
            return y, aux, True, True
    if bias is not None and name != "identity":
        kernel = find("dense_forward", x, weight, bias, "identity", False)
        if kernel is not None:
            return kernel(x, weight, bias, "identity", False)[0], None, True, False
    kernel = find("dense_forward", x, weight, None, "identity", False)
    z = kernel(x, weight, None, "identity", False)[0] if kernel is not None else matmul(x, transpose(weight))
    return z, None, False, False


def _dense_impl(x, weight, bias, act):
    y, _, biased, activated = _product(x, weight, bias, act, False)
    return y if activated else _bias_act_impl(y, None if biased else bias, act)


def _forward_saving(x, weight, bias, act, from_output):
    """``(y, saved, done)``: the output, what the activation's derivative reads (the output where ``from_output``,
    else the pre-activation), and whether the product's kernel applied the bias and the activation."""
    y, aux, biased, activated = _product(x, weight, bias, act, epilogue_name(act) == "gelu")   # gelu reads z
    if activated:
        return y, (y if from_output else aux), True
    b = None if biased else bias
    if from_output or b is None:
        out = _bias_act_impl(y, b, act)
        return out, (out if from_output else y), False
    out, z = bias_act_preactivation(y, b, act)
    return out, z, False


def _dense_rule(needs, x, weight, bias, act):
    derivative, from_output = derivative_from_saved(act)
    y, saved, done = _forward_saving(x, weight, bias, act, from_output)
    out, inp = weight.shape
    need_b = needs[2] and bias is not None
    # where bias_act added the bias and its backward pass runs, that pass sums the bias gradient; else the weight's
    # product does (cuBLASLt's epilogue, or the composite's sum)
    db_in_pass = not done and derivative is not None

    def dense_pullback(dy):
        if dy.dtype != y.dtype:   # a wider cotangent (a float32 loss of half logits): the product is in y's dtype
            dy = astype(dy, y.dtype)
        db = None
        if derivative is None:
            dz = dy
        else:
            dz, db = bias_act_backward(derivative, saved, dy, (out,), True, need_b and db_in_pass)
        rows = reshape(dz, (-1, out))
        dx = reshape(matmul(rows, weight), x.shape) if needs[0] else None
        dw = None
        if needs[1] or (need_b and not db_in_pass):
            dw, db_product = dense_backward_weight(rows, reshape(x, (-1, inp)), need_b and not db_in_pass)
            db = db if db is not None else db_product
        return dx, (dw if needs[1] else None), db, None
    return y, dense_pullback


_dense = Primitive("dense", _dense_rule, impl=_dense_impl, needs_mask=True)


def _plain(args):
    """``(values, level)``: the arrays the rule of a primitive called on ``args`` would get and the tape level it
    would record at; values None where one of them would still be tracked (a nested gradient)."""
    level = max((a.level for a in args if type(a) is Tracked), default=0)
    values = []
    for a in args:
        if type(a) is Tracked:
            if a.level != level or type(a.value) is Tracked:
                return None, level
            a = a.value
        values.append(a)
    return values, level


def _one_node(x, weight, bias, act) -> bool:
    """Whether the call runs as the one ``dense`` node: arrays at one tape level (not a nested gradient) and an
    activation that draws no random numbers (rrelu's derivative cannot be recomputed by a new draw)."""
    return _plain((x, weight, bias))[0] is not None and not _draws_random(act)


def dense(x: Array, weight: Array, bias: Array | bool | None = None, act: Callable | None = identity) -> Array:
    """``act(x @ weight.T + bias)``: ``x`` ``(..., in)``, ``weight`` ``(out, in)``, ``bias`` ``(out,)`` (None or
    False: none), ``act`` any elementwise activation; the result is ``(..., out)``. The same as
    ``bias_act(matmul(x, transpose(weight)), bias, act)``, fused into one cuBLASLt call on the GPU where it can be
    (see the module docstring).

    >>> import numpy as np
    >>> dense(np.ones((2, 3, 4)), np.ones((5, 4)), np.arange(5.0)).shape
    (2, 3, 5)
    >>> dense(np.ones((2, 4)), np.ones((5, 3)))
    Traceback (most recent call last):
    ...
    ValueError: dense expects x.shape[-1] == weight.shape[1] == 3, got x (2, 4) and weight (5, 3)
    """
    if bias is False:
        bias = None
    if act is None:
        act = identity
    _check(x, weight, bias)
    if _one_node(x, weight, bias, act):
        return _dense(x, weight, bias, act)
    return _composite(x, weight, bias, act)


def _check(x, weight, bias):
    for name, a in (("x", x), ("weight", weight)):
        if not hasattr(a, "shape"):
            raise TypeError(f"dense expects {name} to be an array, got {type(a).__name__}")
    if len(weight.shape) != 2:
        raise ValueError(f"dense expects a weight (out, in), got shape {tuple(weight.shape)}")
    if len(x.shape) < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"dense expects x.shape[-1] == weight.shape[1] == {weight.shape[1]}, got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    if bias is not None and tuple(getattr(bias, "shape", ())) != (weight.shape[0],):
        raise ValueError(f"dense expects a bias of shape ({weight.shape[0]},) (one per output), got "
                         f"{tuple(getattr(bias, 'shape', ())) if hasattr(bias, 'shape') else type(bias).__name__}")
