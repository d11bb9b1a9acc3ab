"""``einsum``: NumPy's Einstein summation, differentiable.

Any subscripts NumPy takes in its string form: explicit (``"ij,jk->ik"``) or implicit output (``"ij,jk"``: the
labels that occur once, in ASCII order), ``...`` for broadcast axes, a label repeated inside one operand (a
diagonal: ``"ii->i"``, ``"ii"`` the trace), and axes of size 1 broadcast against the same label elsewhere. The
subscripts are first made explicit (``...`` spelled out with unused letters, broadcast size-1 axes reshaped away),
then one primitive runs ``einsum`` of the array module (NumPy's, or CuPy's, which contracts through cuBLAS). The
pullback of each operand is another einsum of the cotangent with the other operands; labels that only that
operand holds are broadcast back, and repeated labels put back on their diagonal. So einsum differentiates again.
CuPy's einsum calls cuBLAS through CuPy, which a CUDA-graph capture does not take: a :class:`fluxpy.TrainStep`
whose step uses einsum on the GPU runs eagerly (``CaptureWarning``); ``matmul`` is captured.

>>> import numpy as np
>>> from fluxpy import gradient
>>> a, b = np.arange(6.0).reshape(2, 3), np.ones((3, 2))
>>> einsum("ij,jk->ik", a, b)
array([[ 3.,  3.],
       [12., 12.]])
>>> gradient(lambda a: einsum("ii", a), np.ones((2, 2)))[0]
array([[1., 0.],
       [0., 1.]])
"""
from __future__ import annotations

import string

import numpy as np

from ..autodiff import Primitive
from ..backend import Array, get_array_module, gpu_device
from ..capturing import refuse
from .constants import device_constant
from .shape import broadcast_to, reshape

__all__ = ["einsum"]

_LETTERS = string.ascii_letters


def _einsum_impl(spec, *operands):
    ins, out = spec
    if gpu_device(operands[0]) is not None:
        refuse(f"einsum {','.join(ins)}->{out}: CuPy's einsum contracts through CuPy's cuBLAS calls")
    xp = get_array_module(*operands)
    return xp.einsum(",".join(ins) + "->" + out, *operands, optimize=len(operands) > 2)


def _einsum_rule(needs, spec, *operands):
    ins, out = spec
    sizes = {c: n for labels, a in zip(ins, operands) for c, n in zip(labels, a.shape)}

    def einsum_pullback(dy):
        return (None,) + tuple(_operand_grad(i, ins, out, operands, dy, sizes) if needs[i + 1] else None
                               for i in range(len(ins)))
    return _einsum(spec, *operands), einsum_pullback


_einsum = Primitive("einsum", _einsum_rule, impl=_einsum_impl, needs_mask=True)


def _operand_grad(i, ins, out, operands, dy, sizes):
    """The cotangent of operand ``i``: ``dy`` contracted with the other operands onto operand ``i``'s labels."""
    labels = ins[i]
    unique = "".join(dict.fromkeys(labels))
    terms = (out,) + ins[:i] + ins[i + 1:]
    arrays = (dy,) + operands[:i] + operands[i + 1:]
    present = set("".join(terms))
    kept = "".join(c for c in unique if c in present)
    g = _contracted(terms, arrays, kept)
    if kept != unique:   # labels only this operand has were summed away: each of their entries gets the same
        g = broadcast_to(reshape(g, tuple(sizes[c] if c in present else 1 for c in unique)),
                         tuple(sizes[c] for c in unique))
    if unique != labels:   # a repeated label read a diagonal: put the gradient back on it, zeros elsewhere
        first = [labels.index(c) == k for k, c in enumerate(labels)]
        g = reshape(g, tuple(sizes[c] if f else 1 for c, f in zip(labels, first)))
        shape = tuple(sizes[c] for c in labels)
        g = g * device_constant(("einsum_diagonal", labels, shape), lambda: _diagonal_mask(labels, shape), dy)
    return g


def _contracted(terms, arrays, out):
    """``einsum`` of ``arrays`` onto ``out``, with 0-d arrays (empty terms) multiplied in afterwards and a lone
    operand already in ``out``'s order passed through: no einsum call for those."""
    pairs = [(t, a) for t, a in zip(terms, arrays) if t]
    g = None
    if len(pairs) == 1 and pairs[0][0] == out:
        g = pairs[0][1]
    elif pairs:
        g = _einsum((tuple(t for t, _ in pairs), out), *(a for _, a in pairs))
    for t, a in zip(terms, arrays):
        if not t:
            g = a if g is None else g * a
    return g


def _diagonal_mask(labels, shape):
    """Ones where every repeated label has one index, zeros elsewhere (a float array of ``shape``)."""
    grids = np.indices(shape, sparse=True)
    mask = np.ones(shape)
    for k, c in enumerate(labels):
        first = labels.index(c)
        if first != k:
            mask = mask * (grids[first] == grids[k])
    return mask


def einsum(subscripts: str, *operands: Array) -> Array:
    """The Einstein summation ``subscripts`` of ``operands``, as ``numpy.einsum`` (string subscripts only, not the
    interleaved ``einsum(a, [0, 1], b, [1, 2])`` form); differentiable in every float operand.

    >>> import numpy as np
    >>> x = np.arange(6.0).reshape(2, 3)
    >>> einsum("ij->ji", x).shape, einsum("...j,j", np.ones((4, 2, 3)), np.ones(3)).shape
    ((3, 2), (4, 2))
    >>> float(einsum("i,i", np.ones(3), np.arange(3.0)))
    3.0
    """
    if not isinstance(subscripts, str):
        raise TypeError(f"einsum expects the subscripts as a string first, got {type(subscripts).__name__}")
    if not operands or not all(hasattr(a, "shape") for a in operands):
        raise TypeError(f"einsum {subscripts!r} expects arrays after the subscripts, got "
                        f"{[type(a).__name__ for a in operands]}")
    ins, out = _explicit(subscripts, [tuple(a.shape) for a in operands])
    sizes = _label_sizes(subscripts, ins, operands)
    squeezed, operands = _drop_broadcast_axes(ins, operands, sizes)
    return _einsum((squeezed, out), *operands)


def _explicit(subscripts, shapes):
    """The input terms and the output term with ``...`` spelled out and the implicit output made explicit."""
    text = subscripts.replace(" ", "")
    lhs, arrow, rhs = text.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ValueError(f"einsum {subscripts!r} names {len(terms)} operands, got {len(shapes)}")
    used = set(text) - set(",.->")
    bad = sorted(used - set(_LETTERS))
    if bad or "->" in rhs or any(t.count("...") > 1 or "." in t.replace("...", "") for t in terms + [rhs]):
        raise ValueError(f"einsum expects subscripts of letters, commas, at most one '->' and one '...' per term, "
                         f"got {subscripts!r}")
    free = [c for c in _LETTERS if c not in used]
    ranks = [len(s) - len(t.replace("...", "")) for t, s in zip(terms, shapes)]
    for k, (t, s, r) in enumerate(zip(terms, shapes, ranks)):
        if r < 0 or (r > 0 and "..." not in t):
            raise ValueError(f"einsum {subscripts!r}: operand {k} has shape {s}, which does not fit its term {t!r}")
    extra = max([r for t, r in zip(terms, ranks) if "..." in t], default=0)
    if extra > len(free):
        raise ValueError(f"einsum {subscripts!r}: '...' stands for {extra} axes, more than the unused letters")
    ellipsis = "".join(free[:extra])
    ins = tuple(t.replace("...", ellipsis[extra - r:]) for t, r in zip(terms, ranks))
    if arrow:
        out = rhs.replace("...", ellipsis)
    else:
        counts = "".join(ins)
        out = ellipsis + "".join(sorted(c for c in set(counts) if counts.count(c) == 1 and c not in ellipsis))
    if len(set(out)) != len(out) or not set(out) <= set("".join(ins)):
        raise ValueError(f"einsum {subscripts!r}: each output label must occur once, and in an input")
    return ins, out


def _label_sizes(subscripts, ins, operands):
    """Each label's size: the same along every axis it names, or 1 where it broadcasts."""
    sizes = {}
    for k, (labels, a) in enumerate(zip(ins, operands)):
        for c, n in zip(labels, a.shape):
            if sizes.get(c, 1) != n and n != 1 and sizes.get(c, 1) != 1:
                raise ValueError(f"einsum {subscripts!r}: label {c!r} has size {sizes[c]} and size {n} (operand "
                                 f"{k}, shape {tuple(a.shape)}), which do not broadcast")
            sizes[c] = max(sizes.get(c, 1), n)
    for k, (labels, a) in enumerate(zip(ins, operands)):
        for c in set(labels):
            along = {n for d, n in zip(labels, a.shape) if d == c}
            if len(along) > 1:
                raise ValueError(f"einsum {subscripts!r}: label {c!r} is repeated in operand {k} over axes of "
                                 f"different sizes, shape {tuple(a.shape)}")
    return sizes


def _drop_broadcast_axes(ins, operands, sizes):
    """Axes of size 1 whose label is larger elsewhere, reshaped away (their label dropped from the term)."""
    new_ins, new_ops = [], []
    for labels, a in zip(ins, operands):
        drop = [n == 1 and sizes[c] > 1 and labels.count(c) == 1 for c, n in zip(labels, a.shape)]
        if any(drop):
            labels = "".join(c for c, d in zip(labels, drop) if not d)
            a = reshape(a, tuple(n for n, d in zip(a.shape, drop) if not d))
        new_ins.append(labels)
        new_ops.append(a)
    return tuple(new_ins), tuple(new_ops)
