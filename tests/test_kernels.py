"""The kernel table (fluxpy.kernels): register, lookup, find with supports(), snapshot and restore."""
import numpy as np
import pytest

import fluxpy
from fluxpy import kernels
from fluxpy.ops.fused import fused_op


@pytest.fixture
def table():
    before = kernels.snapshot()
    yield
    kernels.restore(before)


def test_lookup_names_the_op_and_module_when_missing():
    with pytest.raises(NotImplementedError, match="no_such_op: no kernel is registered for numpy arrays"):
        kernels.lookup("no_such_op", np.ones(1))


def test_find_returns_none_where_nothing_is_registered():
    assert kernels.find("no_such_op", np.ones(1)) is None


def test_supports_turns_calls_down_and_the_composite_runs(table):
    calls = []

    def kernel(x):
        calls.append(x.dtype)
        return x * 10

    kernels.register("times_ten", "numpy", kernel, supports=lambda x: x.dtype == np.float64)
    op = fused_op("times_ten", lambda x: x * 2)
    np.testing.assert_array_equal(op(np.ones(2)), [10.0, 10.0])                      # the kernel
    np.testing.assert_array_equal(op(np.ones(2, np.float32)), [2.0, 2.0])            # turned down: composite
    assert calls == [np.dtype(np.float64)]


def test_a_fused_op_differentiates_through_its_composite(table):
    kernels.register("cube", "numpy", lambda x: np.full_like(x, -1.0))   # a wrong kernel the tape must not use
    cube = fused_op("cube", lambda x: x * x * x)
    g, = fluxpy.gradient(lambda x: cube(x).sum(), np.array([2.0, -1.0]))
    np.testing.assert_allclose(g, [12.0, 3.0])
    gg, = fluxpy.gradient(lambda x: fluxpy.gradient(lambda y: cube(y).sum(), x)[0].sum(), np.array([2.0]))
    np.testing.assert_allclose(gg, [12.0])


def test_restore_removes_added_entries_and_puts_back_replaced_ones():
    before = kernels.snapshot()
    original = kernels.lookup("conv_forward", np.ones(1))
    kernels.register("conv_forward", "numpy", abs)
    kernels.register("brand_new", "numpy", abs)
    kernels.restore(before)
    assert kernels.lookup("conv_forward", np.ones(1)) is original
    assert kernels.find("brand_new", np.ones(1)) is None
    assert kernels.snapshot() == before


def test_registered_lists_the_numpy_kernels():
    names = {name for name, _ in kernels.registered("numpy")}
    assert {"conv_forward", "conv_backward_data", "conv_backward_filter", "maxpool_forward"} <= names


def test_no_optional_kernel_is_registered_for_numpy():
    """On the CPU the ops run their composites: the fast kernels are the GPU's."""
    x = np.ones((2, 3))
    for name in ("broadcast", "broadcast_backward", "bias_act", "bias_act_backward", "sum", "adam_update",
                 "logit_crossentropy_rows"):
        assert kernels.find(name, x) is None, name
