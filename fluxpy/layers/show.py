"""How layers print (Flux's ``src/layers/show.jl``): the constructor form, and a Chain one layer a line.

A layer's ``__repr__`` prints the call that would rebuild it, with Flux's spelling
(``Conv((3, 3), 1 => 16, relu, pad=1)``): functions by name, options only where they differ from
their defaults. A top-level Chain prints as a block with each layer's parameter count and a total.
"""
from __future__ import annotations

import functools
import operator
import types

from ..autodiff import Primitive
from ..functors import state, trainables
from ..ops.activations import identity

_OPERATOR_NAMES = {operator.add: "+", operator.mul: "*", operator.sub: "-", operator.matmul: "@"}


def _fname(f):
    """How a function prints inside a layer's repr: ``relu``, ``+``, ``partial(leakyrelu, a=0.2)``."""
    if getattr(f, "__hash__", None) is not None and f in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[f]
    if isinstance(f, functools.partial):
        args = [_fname(f.func)] + [repr(a) for a in f.args] + [f"{k}={v!r}" for k, v in f.keywords.items()]
        return f"partial({', '.join(args)})"
    return getattr(f, "__name__", None) or getattr(f, "name", None) or repr(f)


def _act_part(act):
    return "" if act is identity or act is None else f", {_fname(act)}"


def _compact(value):
    """``1`` for ``(1, 1)`` or ``(1, 1, 1, 1)``, as Flux prints pads and strides."""
    if isinstance(value, (tuple, list)) and len(set(value)) == 1:
        return value[0]
    return tuple(value) if isinstance(value, list) else value


def _options(pairs):
    """``", pad=1, stride=2"``: the keyword options that differ from their defaults."""
    out = "".join(f", {name}={_compact(v)!r}" for name, v, default in pairs if _compact(v) != default)
    return out.replace("'", '"')


# A Chain printed inside another layer's repr (SkipConnection, Parallel) takes one line.
_repr_depth = [0]


def _inside_repr():
    return _repr_depth[0] > 0


def _layer_repr(f):
    _repr_depth[0] += 1
    try:
        if isinstance(f, (types.FunctionType, types.BuiltinFunctionType, functools.partial, Primitive)):
            return _fname(f)
        return repr(f)
    finally:
        _repr_depth[0] -= 1


def _underscored(n):
    return f"{n:_}"


def _counts(model):
    """``(trainable arrays, trainable values, other arrays, other values, bytes)``."""
    train = trainables(model)
    ids = {id(a) for a in train}
    others, seen = [], set()

    def collect(st):
        if isinstance(st, dict):
            for v in st.values():
                collect(v)
        elif isinstance(st, list):
            for v in st:
                collect(v)
        elif st is not None and id(st) not in ids and id(st) not in seen:
            seen.add(id(st))
            others.append(st)
    collect(state(model))
    nbytes = sum(a.nbytes for a in train) + sum(a.nbytes for a in others)
    return len(train), sum(a.size for a in train), len(others), sum(a.size for a in others), nbytes


def _param_comment(model):
    ntrain, ptrain, nother, pother, _ = _counts(model)
    if ptrain == 0 and pother == 0:
        return ""
    text = f"# {_underscored(ptrain)} parameters"
    if pother:
        text += f", plus {_underscored(pother)} non-trainable"
    return text


def _block_lines(chain, indent, block_type):
    lines = []
    names = getattr(chain, "names", None) or (None,) * len(chain.layers)
    for f, name in zip(chain.layers, names):
        label = "" if name is None else f"{name} = "
        if isinstance(f, block_type) and len(f.layers) > 0:
            lines.append((indent + label + "Chain(", ""))
            lines.extend(_block_lines(f, indent + "  ", block_type))
            lines.append((indent + "),", ""))
        else:
            lines.append((indent + label + _layer_repr(f) + ",", _param_comment(f)))
    return lines


def _block_repr(chain, block_type):
    """The multi-line repr of ``chain``; its non-empty ``block_type`` layers (Chains) nest as indented blocks."""
    lines = _block_lines(chain, "  ", block_type)
    width = max([len(text) for text, _ in lines] + [0]) + 2
    body = [text.ljust(width) + comment if comment else text for text, comment in lines]
    ntrain, ptrain, nother, pother, nbytes = _counts(chain)
    total = f"# Total: {ntrain} {'trainable ' if nother else ''}arrays, {_underscored(ptrain)} parameters"
    if nother:
        total += f", plus {nother} non-trainable, {_underscored(pother)} parameters"
    total += f", {nbytes / 1024:.3f} KiB."
    return "\n".join(["Chain("] + body + [")".ljust(width) + total])
