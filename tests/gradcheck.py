"""``check_grad``: fluxpy gradients against float64 central finite differences.

Like ChainRulesTestUtils' ``test_rrule`` and JAX's ``check_grads``: the function's output is
contracted with a random cotangent, and the directional derivative along a random direction
from finite differences is compared with the one from fluxpy's gradient. The arguments may be
NumPy or CuPy float64 arrays (random directions are drawn on the host and moved to the device).
"""
from __future__ import annotations

import numpy as np

import fluxpy


def _scalarize(f, cotangent):
    def scalar(*args):
        y = f(*args)
        return (y * cotangent).sum()
    return scalar


def _host(a):
    return np.asarray(fluxpy.cpu(fluxpy.value_of(a)), dtype=np.float64)


def _numeric(y):
    return float(_host(y).sum())


def _is_f64(a):
    return hasattr(a, "dtype") and not fluxpy.is_tracked(a) and a.dtype == np.float64 and np.ndim(a) >= 0 \
        and hasattr(a, "shape")


def check_grad(f, *args, rng=None, eps=1e-6, rtol=1e-6, atol=1e-8, directions=2, wrt=None):
    """Assert that ``fluxpy.gradient`` of ``f`` agrees with central differences.

    ``args`` are float64 arrays (all differentiated, or those at indices ``wrt``); other
    positional values are passed through. Returns the gradients.
    """
    rng = np.random.default_rng(0) if rng is None else rng
    wrt = [i for i, a in enumerate(args) if _is_f64(a)] if wrt is None else list(wrt)
    xp = fluxpy.get_array_module(*args)
    y = fluxpy.value_of(f(*args))
    cot = xp.asarray(rng.standard_normal(np.shape(y)))
    loss = _scalarize(f, cot)
    grads = fluxpy.gradient(loss, *args)
    for _ in range(directions):
        dirs = {i: xp.asarray(rng.standard_normal(np.shape(args[i]))) for i in wrt}

        def shifted(sign):
            new = list(args)
            for i, d in dirs.items():
                new[i] = args[i] + sign * eps * d
            return _numeric(loss(*new))
        numeric = (shifted(1) - shifted(-1)) / (2 * eps)
        analytic = 0.0
        for i, d in dirs.items():
            g = grads[i]
            if g is not None:
                assert np.shape(g) == np.shape(args[i]), f"gradient {i} has shape {np.shape(g)}, " \
                                                         f"argument {np.shape(args[i])}"
                analytic += float(np.sum(_host(g) * _host(d)))
        scale = max(abs(numeric), abs(analytic), 1.0)
        assert abs(numeric - analytic) <= atol + rtol * scale, \
            f"directional derivative: finite differences {numeric!r}, fluxpy {analytic!r}"
    return grads


def check_second_order(f, *args, rng=None, **kw):
    """Check the gradient of ``x -> <gradient(f)(x), v>`` (a Hessian-vector product) by finite differences."""
    rng = np.random.default_rng(1) if rng is None else rng
    xp = fluxpy.get_array_module(*args)
    vs = [xp.asarray(rng.standard_normal(np.shape(a))) for a in args]

    def grad_dot_v(*xs):
        gs = fluxpy.gradient(lambda *z: f(*z).sum(), *xs)
        total = 0.0
        for g, v in zip(gs, vs):
            if g is not None:
                total = total + (g * v).sum()
        return total
    return check_grad(grad_dot_v, *args, rng=rng, **kw)
