"""The ``dropout`` op's one-node path (what the GPU's one-kernel dropout runs through), on the CPU with a stand-in
kernel registered for NumPy arrays: the op is one node whose pullback is the cotangent times the kept mask
(against float64 finite differences, hypothesis drawing shapes and probabilities), a second derivative runs the
composite on the outer tape, a call without the tape asks for no mask, and what the kernel declines (``dims``, a
generator it does not take) runs the composite."""
import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import kernels
from fluxpy.ops.dropout import dropout
from gradcheck import check_grad


class FixedNumbers:
    """A generator that draws the same numbers every time (so that finite differences see one mask)."""

    def __init__(self, seed):
        self.seed = seed

    def random(self, shape, dtype=np.float64):
        return np.random.default_rng(self.seed).random(shape).astype(dtype)


def _kernel(calls):
    def stand_in(x, p, rng, mask=True):
        calls.append(mask)
        m = ((rng.random(x.shape) >= p) / (1 - p)).astype(x.dtype)
        return x * m, (m if mask else None)
    return stand_in


@contextlib.contextmanager
def _stand_in():
    """The stand-in registered as NumPy's ``dropout`` kernel (for ``FixedNumbers`` only); yields its calls' ``mask``
    flags."""
    table = kernels.snapshot()
    calls = []
    kernels.register("dropout", "numpy", _kernel(calls), lambda x, p, rng, *_: type(rng) is FixedNumbers)
    try:
        yield calls
    finally:
        kernels.restore(table)


@pytest.fixture
def registered():
    with _stand_in() as calls:
        yield calls


def _mask(rng, shape, p):
    return (rng.random(shape) >= p) / (1 - p)


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), p=st.floats(0.05, 0.95), seed=st.integers(0, 99))
def test_the_one_node_gradient_is_the_mask(shape, p, seed):
    with _stand_in() as calls:
        rng = FixedNumbers(seed)
        x = np.random.default_rng(seed + 1).standard_normal(shape)
        check_grad(lambda x: dropout(x, p, rng=rng), x)
        calls.clear()
        g, = fluxpy.gradient(lambda x: dropout(x, p, rng=rng).sum(), x)
        np.testing.assert_array_equal(g, _mask(rng, tuple(shape), p))
        assert calls == [True]   # one call of the kernel, which kept the mask for the pullback


def test_without_the_tape_no_mask_is_kept(registered):
    rng = FixedNumbers(3)
    x = np.random.default_rng(0).standard_normal((4, 6))
    y = dropout(x, 0.25, rng=rng)
    np.testing.assert_array_equal(y, x * _mask(rng, x.shape, 0.25))
    assert registered == [False]


def test_a_second_derivative_runs_the_composite_on_the_outer_tape(registered):
    rng = FixedNumbers(4)
    x = np.random.default_rng(1).standard_normal(30)
    mask = _mask(rng, x.shape, 0.5)

    def f(x):   # d/dx sum(dropout(x)^3) = 3 dropout(x)^2 mask; differentiated again: 6 x mask^3
        g, = fluxpy.gradient(lambda x: (dropout(x, 0.5, rng=rng) ** 3).sum(), x)
        return g.sum()
    h, = fluxpy.gradient(f, x)
    np.testing.assert_allclose(h, 6 * x * mask ** 3, rtol=1e-12)


def test_what_the_kernel_declines_runs_the_composite(registered):
    x = np.random.default_rng(2).standard_normal((3, 5))
    y = dropout(x, 0.5, rng=np.random.default_rng(0))   # a generator the stand-in does not take
    assert set(np.unique(np.round(y / x, 6)).tolist()) <= {0.0, 2.0}
    y = dropout(x, 0.5, rng=FixedNumbers(1), dims=0)    # a mask shared along axis 1: the composite
    assert all(len(set((row != 0).tolist())) == 1 for row in y)
    assert registered == []
