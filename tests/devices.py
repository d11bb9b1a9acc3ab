"""Helpers shared by the GPU tests: the CuPy module, moving test data to a device, and the one
comparison of a GPU result with the CPU path."""
from __future__ import annotations

import numpy as np


def cupy_module():
    """CuPy itself (the GPU tests are skipped where it is missing, see tests/conftest.py)."""
    import cupy
    return cupy


def to_device(x, xp, dtype=None):
    """A NumPy float array as an ``xp`` array (in ``dtype`` when given); other values as they are."""
    if isinstance(x, np.ndarray):
        if dtype is not None and x.dtype.kind == "f":
            x = x.astype(dtype)
        return xp.asarray(x)
    return x


def half_to_device(a, dtype):
    """A float64 NumPy array rounded to ``dtype`` (float64 kept as it is; bfloat16 through float32) on the GPU."""
    from test_half_conv_matmul import BF16
    cp = cupy_module()
    a = a.astype(np.float32).astype(dtype) if np.dtype(dtype) != np.float64 else a
    return cp.asarray(a.view(np.uint16)).view(BF16) if np.dtype(dtype) == BF16 else cp.asarray(a)


def to_host64(a):
    """A CuPy array (or a Tracked one) as a float64 NumPy array (bfloat16 through float32)."""
    import fluxpy
    from test_half_conv_matmul import BF16
    cp = cupy_module()
    a = fluxpy.value_of(a)
    return cp.asnumpy(a.astype(cp.float32) if a.dtype == BF16 else a).astype(np.float64)


def assert_matches_cpu(gpu, cpu, rtol=1e-6, atol=0.0):
    """``gpu`` is a CuPy array of ``cpu``'s shape whose values match ``cpu``'s (compared in float64)."""
    cp = cupy_module()
    assert isinstance(gpu, cp.ndarray), f"expected a CuPy array, got {type(gpu).__name__}"
    assert gpu.shape == np.shape(cpu), f"shape {gpu.shape}, CPU {np.shape(cpu)}"
    np.testing.assert_allclose(cp.asnumpy(gpu).astype(np.float64), np.asarray(cpu, np.float64), rtol=rtol, atol=atol)


def state_bytes(*trees):
    """The bytes of every array in ``trees`` (models, optimiser states; NumPy or CuPy), in a fixed order: two
    calls compare equal exactly when nothing was changed."""
    import fluxpy
    out = []

    def walk(x):
        if isinstance(x, fluxpy.optimise.Leaf):
            walk(x.state)
        elif fluxpy.backend.is_array(x):
            out.append(np.asarray(fluxpy.cpu(x)).tobytes())
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif hasattr(x, "__dict__") and not callable(x):
            walk(vars(x))
    for t in trees:
        walk(t)
    return out


def grad_leaves(tree):
    """The arrays of a gradient tree (dicts, lists, tuples), in a fixed order (dict keys sorted)."""
    if isinstance(tree, dict):
        return [a for k in sorted(tree, key=str) for a in grad_leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [a for v in tree for a in grad_leaves(v)]
    return [] if tree is None or not hasattr(tree, "shape") else [tree]
