"""Weight reparametrisations that wrap a layer: WeightNorm (Flux's; PyTorch's ``weight_norm``) and SpectralNorm
(PyTorch's ``spectral_norm``; Flux has none).

Each holds the wrapped ``layer`` as a child and, at every call, hands a shallow copy of it the reparametrised
weight (:func:`fluxpy.functors.rebuild`), so any layer with a weight array works: Dense, the convolutions,
Bilinear, Embedding. The wrapped layer's weight array stays the trainable parameter (WeightNorm's direction ``v``;
SpectralNorm's unnormalised weight). These sit above ``normalise`` (they read its train/test mode).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..autodiff import value_of
from ..backend import Array, get_array_module, is_float_dtype
from ..functors import children, layer, rebuild
from ..journal import changing
from ..ops.basic import add, sqrt
from ..ops.linalg import matmul
from ..ops.reduce import sum as sum_
from ..ops.shape import reshape, transpose
from ._checks import _is_int
from .normalise import _dtype_eps, is_active

__all__ = ["WeightNorm", "SpectralNorm", "remove_weight_norms"]


def _weight_of(name, inner, which):
    w = getattr(inner, which, None) if isinstance(which, str) else None
    if w is None or not hasattr(w, "shape") or not is_float_dtype(w.dtype):
        raise ValueError(f"{name} expects a layer with a float array field {which!r}, got {type(inner).__name__} "
                         f"({'no such field' if w is None else type(w).__name__})")
    return w


def _axes(name, dims, ndim):
    axes = (dims,) if _is_int(dims) else tuple(dims) if isinstance(dims, (tuple, list)) else None
    if axes is None or not all(_is_int(a) and -ndim <= a < ndim for a in axes) or \
            len({a % ndim for a in axes}) != len(axes):
        raise ValueError(f"{name} expects dims, distinct axes of the weight ({ndim} axes), got {dims!r}")
    return tuple(sorted(int(a) % ndim for a in axes))


@layer(children=("layer", "g"))
class WeightNorm:
    """``layer`` with its ``which`` weight reparametrised as ``g * v / sqrt(sum(v**2, dims) + eps)`` (Salimans &
    Kingma 2016): ``v`` (the layer's own array) gives the direction, the trainable ``g`` the magnitude.

    ``dims`` are the axes the norm runs over, as Flux's ``WeightNorm(layer, which; dims)``; by default every axis
    but the first, the output channels of Dense ``(out, in)`` and the convolutions ``(cout, cin, *kernel)``, which is
    PyTorch's ``weight_norm(dim=0)`` (Flux's default ``dims=-1`` reduces Julia's last axis, the output channels of
    a Conv). ``g`` starts as the norm itself, so the wrapped layer computes what it did. ``eps`` (inside the square
    root) defaults to the machine epsilon of the weight's dtype, as Flux's (PyTorch's is 0).

    >>> import numpy as np
    >>> from fluxpy import Dense
    >>> d = Dense(3, 2, rng=0)
    >>> wn = WeightNorm(d)
    >>> wn, wn.g.shape, bool(np.allclose(wn(np.ones((4, 3), np.float32)), d(np.ones((4, 3), np.float32))))
    (WeightNorm(Dense(3 => 2)), (2, 1), True)
    """

    def __init__(self, layer: Any, which: str = "weight", *, dims: int | tuple[int, ...] | None = None,
                 eps: float | None = None) -> None:
        w = _weight_of("WeightNorm", layer, which)
        self.dims = tuple(range(1, w.ndim)) if dims is None else _axes("WeightNorm", dims, w.ndim)
        xp = get_array_module(w)
        if not bool(xp.any(w != 0)):
            raise ValueError(f"WeightNorm: the {which!r} field of {type(layer).__name__} is all zeros, whose "
                             f"direction is undefined")
        self.eps = _dtype_eps(w.dtype) if eps is None else float(eps)
        self.layer, self.which = layer, which
        self.g = xp.sqrt(xp.sum(w * w, axis=self.dims, keepdims=True) + self.eps).astype(w.dtype)

    def weight(self) -> Array:
        """The reparametrised weight, ``g * v / sqrt(sum(v**2, dims) + eps)``."""
        v = getattr(self.layer, self.which)
        # add, not +: on plain CuPy bfloat16 arrays + would give float32 (fluxpy.ops.basic keeps NumPy's type)
        return v * (self.g / sqrt(add(sum_(v * v, axis=self.dims, keepdims=True), self.eps)))

    def __call__(self, *args: Any) -> Any:
        return rebuild(self.layer, [(self.which, self.weight())])(*args)

    def __repr__(self):
        ndim = len(getattr(self.layer, self.which).shape)
        opts = ("" if self.which == "weight" else f", {self.which!r}") + \
            ("" if self.dims == tuple(range(1, ndim)) else f", dims={self.dims}")
        return f"WeightNorm({self.layer!r}{opts})"


def remove_weight_norms(model: Any) -> Any:
    """``model`` with every :class:`WeightNorm` replaced by its layer holding the weight it computes,
    ``g * v / sqrt(sum(v**2) + eps)`` (Flux's ``remove_weight_norms``): the same function, with one weight array
    to train or to export again. The rest of the model is shared, not copied.

    >>> import numpy as np
    >>> from fluxpy import Chain, Dense
    >>> m = Chain(WeightNorm(Dense(2, 3, rng=0)), Dense(3, 1, rng=1))
    >>> plain = remove_weight_norms(m)
    >>> plain[0], bool(np.allclose(plain(np.ones((1, 2), np.float32)), m(np.ones((1, 2), np.float32))))
    (Dense(2 => 3), True)
    """
    if isinstance(model, WeightNorm):
        return rebuild(remove_weight_norms(model.layer), [(model.which, value_of(model.weight()))])
    kids = children(model)
    if kids is None:
        return model
    new = [(k, remove_weight_norms(v)) for k, v in kids]
    if all(n is v for (_, n), (_, v) in zip(new, kids)):
        return model   # no WeightNorm below: shared as it is
    return rebuild(model, new)


def _normalised(a, eps):
    """``a / max(norm(a), eps)`` on plain arrays (PyTorch's ``F.normalize``)."""
    xp = get_array_module(a)
    return a / xp.maximum(xp.sqrt(xp.sum(a * a)), eps)


@layer(children=("layer", "u", "v"), trainable=("layer",))
class SpectralNorm:
    """``layer`` with its ``which`` weight divided by its largest singular value ``sigma``, estimated by power
    iteration (Miyato et al. 2018; PyTorch's ``spectral_norm``; Flux has none).

    The weight is seen as a matrix: axis ``dim`` (0, the output channels; 1 for a ConvTranspose's
    ``(cin, cout/groups, ...)`` weight) by the rest. ``u`` and ``v`` are its estimated singular vectors, kept as
    non-trainable children (saved and moved with the model, as BatchNorm's running statistics). In training
    (inside :func:`fluxpy.gradient`, or ``trainmode``), each call first runs ``n_power_iterations`` steps
    ``v = normalise(W^T u)``, ``u = normalise(W v)`` on the device, in place; then, in either mode,
    ``sigma = u . (W v)`` with ``u`` and ``v`` held constant, and the layer runs with ``W / sigma``. ``normalise``
    divides by ``max(norm, eps)``. ``u`` and ``v`` start from a seeded normal draw and 15 iterations, as
    PyTorch's parametrisation does. Under :func:`fluxpy.mixed_precision` the step casts ``u`` and ``v`` with the
    other float arrays, so the iterations do not carry over from step to step there (each step's ``sigma`` is then
    that of ``n_power_iterations`` steps from the stored vectors).

    >>> import numpy as np
    >>> from fluxpy import Dense
    >>> sn = SpectralNorm(Dense(4, 3, rng=0), rng=1)
    >>> w = sn.weight()
    >>> sn, bool(np.isclose(np.linalg.svd(w, compute_uv=False)[0], 1.0, atol=1e-3))
    (SpectralNorm(Dense(4 => 3)), True)
    """
    _has_mode = True   # trainmode / testmode set ``active``

    def __init__(self, layer: Any, which: str = "weight", *, n_power_iterations: int = 1, eps: float = 1e-12,
                 dim: int | None = None, active: bool | None = None, rng: int | None = 0) -> None:
        w = _weight_of("SpectralNorm", layer, which)
        if not _is_int(n_power_iterations) or n_power_iterations < 1:
            raise ValueError(f"SpectralNorm: n_power_iterations must be a positive int, got {n_power_iterations!r}")
        dim = getattr(type(layer), "_weight_out_axis", 0) if dim is None else dim
        if not _is_int(dim) or not -w.ndim <= dim < w.ndim or w.ndim < 2:
            raise ValueError(f"SpectralNorm: dim must be an axis of the weight of shape {tuple(w.shape)} (2 or more "
                             f"axes), got {dim!r}")
        self.layer, self.which, self.dim = layer, which, int(dim) % w.ndim
        self.n_power_iterations, self.eps, self.active = int(n_power_iterations), float(eps), active
        draw = np.random.default_rng(rng)
        u = _normalised(draw.standard_normal(w.shape[self.dim]), self.eps)
        v = _normalised(draw.standard_normal(int(np.prod(w.shape)) // w.shape[self.dim]), self.eps)
        xp = get_array_module(w)
        self.u, self.v = xp.asarray(u.astype(w.dtype)), xp.asarray(v.astype(w.dtype))
        self._power_iterations(w, 15)

    def _matrix(self, w):
        """The weight as the matrix ``(w.shape[dim], -1)`` (an op: differentiable where ``w`` is tracked)."""
        if self.dim:
            w = transpose(w, (self.dim,) + tuple(a for a in range(len(w.shape)) if a != self.dim))
        return reshape(w, (w.shape[0], -1))

    def _power_iterations(self, w, n):
        """``n`` power-iteration steps on the plain arrays, written into ``u`` and ``v`` in place."""
        u, v = value_of(self.u), value_of(self.v)
        mat = self._matrix(value_of(w))
        mat = mat if mat.dtype == u.dtype else mat.astype(u.dtype)   # a half weight under mixed precision
        with changing(u, v):
            for _ in range(n):   # 2-D products only: the GPU's capturable gemm takes them
                v[...] = _normalised(matmul(u.reshape(1, -1), mat).reshape(-1), self.eps)
                u[...] = _normalised(matmul(mat, v.reshape(-1, 1)).reshape(-1), self.eps)

    def weight(self) -> Array:
        """The weight divided by ``sigma = u . (W v)`` (``u`` and ``v`` as they are: no iteration)."""
        w = getattr(self.layer, self.which)
        # copies: a later call's power iteration writes u and v in place while this call's pullbacks still need
        # them (PyTorch's parametrisation clones them too)
        u, v = (a.astype(w.dtype, copy=True) for a in (value_of(self.u), value_of(self.v)))
        sigma = sum_(matmul(self._matrix(w), v.reshape(-1, 1)) * u.reshape(-1, 1))
        return w / sigma

    def __call__(self, *args: Any) -> Any:
        w = getattr(self.layer, self.which)
        if is_active(self, w, *args):
            self._power_iterations(w, self.n_power_iterations)
        return rebuild(self.layer, [(self.which, self.weight())])(*args)

    def __repr__(self):
        opts = ("" if self.which == "weight" else f", {self.which!r}") + \
            ("" if self.n_power_iterations == 1 else f", n_power_iterations={self.n_power_iterations}") + \
            ("" if self.dim == getattr(type(self.layer), "_weight_out_axis", 0) else f", dim={self.dim}") + \
            ("" if self.active is None else f", active={self.active}")
        return f"SpectralNorm({self.layer!r}{opts})"
