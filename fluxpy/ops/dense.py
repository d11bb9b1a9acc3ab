"""The Dense layer's op, ``dense(x, weight, bias, act) = act(x @ weight.T + bias)``, with the bias and activation
fused into the matrix product where a kernel can.

It means exactly ``bias_act(matmul(x, transpose(weight)), bias, act)`` (the composite), and runs as one tape node
where the kernel table's ``dense_forward`` takes the product (on the GPU cuBLASLt, :mod:`fluxpy.kernels.cublaslt`;
on the CPU NumPy, :mod:`fluxpy.kernels.cpu_dense`: one node instead of four):

- ``identity``, ``relu`` and ``gelu`` (the tanh approximation) are the kernel's epilogues: the product, the bias
  and the activation are one call, and for gelu in a gradient it also keeps the pre-activation, which the
  derivative reads;
- every other activation (``gelu_erf``, swish, tanh, ...) runs after the bare product as one ``bias_act`` pass
  (the bias added there), which keeps the output or the pre-activation as its derivative needs
  (:func:`~fluxpy.ops.bias_act.derivative_from_saved`).

The pullback is then ``dz = dy * act'(saved)`` (one elementwise pass,
:func:`~fluxpy.ops.bias_act.bias_act_backward`; nothing for the identity), ``dx = dz @ weight`` and
``(dweight, dbias) = dense_backward_weight(dz, x)``, one cuBLASLt call that sums the bias gradient as it forms the
weight gradient, in the weight's own layout (where ``bias_act`` added the bias, its backward pass sums the bias
gradient as it forms ``dz``, as the composite's does). The composite runs for what the kernels decline (the halves
on the CPU and float64 on the GPU, layouts or alignments, an activation that draws random numbers, a nested
gradient).
Leading axes of ``x`` are rows.

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
from .bias_act import _bias_act_impl, _split, bias_act, bias_act_backward, bias_act_preactivation, derivative_from_saved
from .fused import fused_op
from .linalg import matmul
from .reduce import sum as sum_
from .shape import reshape, transpose

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


def _forward_kernel(x, weight, bias, act, save):
    """``(kernel, epilogue, kernel's bias)`` for the product of a call, or None where no kernel takes it: ``act``
    itself as the epilogue where the kernel has it, else the bare product (``bias_act`` adds the bias and the
    activation after it)."""
    name = epilogue_name(act)
    if name is not None:
        kernel = find("dense_forward", x, weight, bias, name, save)
        return None if kernel is None else (kernel, name, bias)
    if getattr(_split(act)[0], "draws_random", False):   # rrelu: its derivative cannot be recomputed by a new draw
        return None
    kernel = find("dense_forward", x, weight, None, "identity", False)
    return None if kernel is None else (kernel, "identity", None)


def _dense_impl(x, weight, bias, act):
    found = _forward_kernel(x, weight, bias, act, False)
    if found is None:
        return _composite(x, weight, bias, act)
    kernel, name, kernel_bias = found
    y = kernel(x, weight, kernel_bias, name, False)[0]
    return y if epilogue_name(act) is not None else _bias_act_impl(y, bias, act)


def _forward_saving(x, weight, bias, act):
    """``(y, saved)``: the output and what the activation's derivative reads (the output or the
    pre-activation)."""
    derivative, from_output = derivative_from_saved(act)
    name = epilogue_name(act)
    found = _forward_kernel(x, weight, bias, act, name == "gelu")   # gelu's derivative reads the pre-activation
    if found is None:
        raise RuntimeError(f"dense: the fused kernel declined a call that dense() had planned for it ({act!r}, "
                           f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)})")
    kernel, kernel_name, kernel_bias = found
    y, aux = kernel(x, weight, kernel_bias, kernel_name, name == "gelu")
    if name is not None:
        return y, (y if from_output else aux)
    if from_output or bias is None:
        out = _bias_act_impl(y, bias, act)
        return out, (out if from_output else y)
    return bias_act_preactivation(y, bias, act)


def _dense_rule(needs, x, weight, bias, act):
    y, saved = _forward_saving(x, weight, bias, act)
    derivative, _ = derivative_from_saved(act)
    out, inp = weight.shape
    need_b = needs[2] and bias is not None
    # where bias_act added the bias, its pass sums the bias gradient too; else the weight's product does
    db_by_product = epilogue_name(act) is not None

    def dense_pullback(dy):
        db = None
        if derivative is None:
            dz = dy
        else:
            dz, db = bias_act_backward(derivative, saved, dy, (out,), True, need_b and not db_by_product)
        rows = reshape(dz, (-1, out))
        dx = reshape(matmul(rows, weight), x.shape) if needs[0] else None
        dw = None
        if needs[1] or (need_b and db_by_product):
            dw, db_product = dense_backward_weight(rows, reshape(x, (-1, inp)), need_b and db_by_product)
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


def _fused(x, weight, bias, act) -> bool:
    """Whether a kernel takes this call's product (gelu's pre-activation saved where a gradient is being taken)."""
    values, level = _plain((x, weight, bias))
    return values is not None and _forward_kernel(*values, act, level > 0 and epilogue_name(act) == "gelu") is not None


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
    if _fused(x, weight, bias, act):
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
