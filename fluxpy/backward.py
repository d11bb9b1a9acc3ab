"""The backward walk of the tape (micrograd's ``backward``, tinygrad's ``compute_gradient``): from a result's node,
in reverse topological order, each node's pullback turns its cotangent into its parents', added up where a value
is used more than once, until the leaves (the boxed arguments) hold their gradients.

:mod:`fluxpy.autodiff` records the tape and calls :func:`backprop`; a node here is anything with ``parents`` (nodes
or ``None``) and ``pullback`` (``None`` for a leaf).

>>> import numpy as np
>>> from types import SimpleNamespace as Node
>>> x = Node(parents=(), pullback=None)
>>> y = Node(parents=(x, x), pullback=lambda dy: (2 * dy, 3 * dy))   # y = 2x + 3x
>>> backprop(y, np.ones(2))[id(x)]
array([5., 5.])
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from .backend import get_array_module
from .layout import keeping_layout

__all__ = ["backprop", "toposort", "SliceCotangent", "accumulate"]


def toposort(root: Any) -> list:
    """The nodes reachable from ``root`` through ``parents``, each after all nodes that use it (``root`` first).

    >>> from types import SimpleNamespace as Node
    >>> x = Node(parents=(), name="x"); y = Node(parents=(x,), name="y"); z = Node(parents=(y, x), name="z")
    >>> [n.name for n in toposort(z)]
    ['z', 'y', 'x']
    """
    order, visited, stack = [], set(), [(root, False)]
    push, seen, see = stack.append, visited.__contains__, visited.add
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if seen(id(node)):
            continue
        see(id(node))
        push((node, True))
        for p in node.parents:
            if p is not None and not seen(id(p)):
                push((p, False))
    order.reverse()
    return order


class SliceCotangent:
    """The cotangent of ``x[index]`` for a basic ``index`` (ints, slices, ``None``, ``...``, a boolean mask: each
    element of ``x`` at most once), kept as ``values`` until needed whole: zeros of ``shape`` with ``values`` at
    ``index``. A pullback may return one instead of the dense array (getitem's does); the backward walk adds
    several into one buffer that it owns, in place, so that a loop taking ``x[t]`` at every step pulls back in one
    buffer of ``x``'s size, not one per step.

    >>> import numpy as np
    >>> SliceCotangent(np.ones(2), (4,), (slice(1, 3),)).dense()
    array([0., 1., 1., 0.])
    """
    __slots__ = ("values", "shape", "index")

    def __init__(self, values: Any, shape: tuple, index: tuple) -> None:
        self.values, self.shape, self.index = values, shape, index

    def dense(self) -> Any:
        """The whole cotangent (a new array: the walk may add into it in place)."""
        out = get_array_module(self.values).zeros(self.shape, dtype=self.values.dtype)
        out[self.index] = self.values
        return out


_sum: list = [operator.add]   # how the walk adds two cotangents (fluxpy's GPU kernels set theirs)


def set_cotangent_sum(add: Callable | None) -> None:
    """Add two cotangents with ``add(a, b)`` in the backward walk (None: ``operator.add``, the default). fluxpy's GPU
    kernels (:mod:`fluxpy.kernels.gpu`) set one that sums half-precision CuPy arrays in one vectorised kernel.

    >>> set_cotangent_sum(None); _sum[0] is operator.add
    True
    """
    _sum[0] = operator.add if add is None else add


def accumulate(grads: dict, owned: set, k: int, gp: Any) -> None:
    """Add the cotangent ``gp`` to ``grads[k]``. ``owned`` holds the keys whose buffer the walk made itself (a
    slice cotangent may be added into it in place); any other array is copied before it is written.

    >>> import numpy as np
    >>> first = np.ones(3); grads, owned = {0: first}, set()
    >>> accumulate(grads, owned, 0, SliceCotangent(np.full(1, 2.0), (3,), (slice(0, 1),)))
    >>> grads[0], first   # the array that came first is copied, never written
    (array([3., 1., 1.]), array([1., 1., 1.]))
    """
    prev = grads.get(k)
    if prev is None:
        grads[k] = gp
        return
    if type(prev) is SliceCotangent:
        prev = grads[k] = prev.dense()
        owned.add(k)
    if type(gp) is SliceCotangent and gp.values.dtype == prev.dtype and tuple(prev.shape) == gp.shape:
        if k not in owned:
            prev = grads[k] = prev.copy()
            owned.add(k)
        prev[gp.index] += gp.values
        return
    grads[k] = keeping_layout(_sum[0], prev, _whole(gp))
    owned.add(k)             # a new array: later slices may go into it in place


def _whole(g):
    """``g`` as an array (a slice cotangent made dense)."""
    return g.dense() if type(g) is SliceCotangent else g


def backprop(root: Any, seed: Any, release: bool = True, hooks: dict | None = None,
             wrap: Callable | None = None) -> dict:
    """Cotangents of the leaves (nodes without a pullback) reached from the node ``root``, whose cotangent is
    ``seed``: ``{id(leaf): gradient}``.

    With ``release`` (a tape walked once, as by :func:`fluxpy.gradient`), each node lets go of its pullback and
    parents as soon as its pullback has run, so the arrays saved for the backward pass and the forward
    values are freed as the walk goes (as PyTorch frees saved tensors), not all at its end. ``hooks``
    (``{id(node): (node, [fn, ...])}``, see :func:`fluxpy.autodiff.register_gradient_hook`) run as each hooked
    node's gradient becomes final: when the last node that uses it has pulled back (counted before the walk).
    ``wrap(pullback)``, where given, is called in place of each pullback (:func:`fluxpy.profile` times them so).

    >>> import numpy as np
    >>> from types import SimpleNamespace as Node
    >>> x = Node(parents=(), pullback=None)
    >>> y = Node(parents=(x,), pullback=lambda dy: (3 * dy,))
    >>> backprop(y, np.ones(2), hooks={id(x): (x, [lambda g: g + 1])})[id(x)]
    array([4., 4.])
    """
    grads = {id(root): seed}
    owned = set()        # keys of grads whose buffer this walk made (slice cotangents add into it in place)
    leaves = {}
    order = toposort(root)
    users = _count_users(order, hooks) if hooks else None
    for i, node in enumerate(order):
        if release:
            order[i] = None
        key = id(node)
        if users is not None and key in users:   # nothing uses it (the root): final now
            _run_hooks(key, hooks, users, grads)
        g = grads.pop(key, None)
        if type(g) is SliceCotangent:
            g = g.dense()
        if owned:
            owned.discard(key)
        if g is None:
            if users is not None:
                _used(node.parents, hooks, users, grads)
            continue
        back = node.pullback
        if back is None:
            leaves[key] = g
            continue
        if wrap is not None:
            back = wrap(back)
        parents, cotangents = node.parents, back(g)
        if release:
            node.pullback, node.parents = _used_pullback, ()
        del back, g
        for p, gp in zip(parents, cotangents):
            if p is None or gp is None:
                continue
            k = id(p)
            if k in grads or type(gp) is SliceCotangent:
                accumulate(grads, owned, k, gp)
            else:
                grads[k] = gp        # the first cotangent of a parent, as it came (not owned)
        if users is not None:
            _used(parents, hooks, users, grads)
        del parents, cotangents
    if hooks:
        _run_unreached_hooks(hooks, leaves)
    return leaves


def _count_users(order, hooks):
    """For each hooked node on the tape: how many nodes use it (an edge per parent slot)."""
    users, present = {k: 0 for k in hooks}, set()
    for node in order:
        if id(node) in users:
            present.add(id(node))
        for p in node.parents:
            if p is not None and id(p) in users:
                users[id(p)] += 1
    # a hooked node that the result does not reach is not on this tape: fn(None) at the end of the walk
    return {k: n for k, n in users.items() if k in present}


def _used(parents, hooks, users, grads):
    """One use of each hooked parent has pulled back; a hook whose node has no use left runs now."""
    for p in parents:
        if p is not None:
            k = id(p)
            n = users.get(k)
            if n is not None:
                if n <= 1:
                    _run_hooks(k, hooks, users, grads)
                else:
                    users[k] = n - 1


def _run_hooks(k, hooks, users, grads):
    del users[k]
    node, fns = hooks.pop(k)
    g = _whole(grads.get(k))
    if g is None:
        hooks[k] = (node, fns)   # no gradient reached it: fn(None) at the end of the walk
        return
    for fn in fns:
        out = fn(g)
        if out is not None:
            g = out
    grads[k] = g


def _run_unreached_hooks(hooks, leaves):
    """``fn(None)`` for each hooked node that got no gradient; a returned array becomes a leaf's gradient."""
    for k, (node, fns) in list(hooks.items()):
        g = None
        for fn in fns:
            out = fn(g)
            if out is not None:
                g = out
        if g is not None and node.pullback is None:
            leaves[k] = g


def _used_pullback(dy):
    raise RuntimeError("this value's pullback has already run: the tape of gradient/withgradient is walked once "
                       "and freed as it goes; use fluxpy.pullback for a backward pass you call more than once")
