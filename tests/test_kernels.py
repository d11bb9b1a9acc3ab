"""The kernel table (fluxpy.kernels): register, lookup, find with supports(), snapshot and restore."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@given(ndim=st.integers(1, 5), data=st.data())
@settings(max_examples=80, deadline=None)
def test_merged_axes_walk_a_view_in_the_same_order(ndim, data):
    """cuda_arrays._merged (the GPU's tiled copy plans with it; plain shape arithmetic, checked here on NumPy views):
    the merged sizes and strides, taken as a view of the same memory, give the view's elements in the same order."""
    from fluxpy.kernels import cuda_arrays
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    base = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    perm = data.draw(st.permutations(list(range(ndim))))
    steps = data.draw(st.lists(st.sampled_from([1, 1, -1, 2]), min_size=ndim, max_size=ndim))
    view = base[tuple(slice(None, None, s) for s in steps)].transpose(perm)
    sizes, strides = cuda_arrays._merged(view)
    assert len(sizes) <= sum(n > 1 for n in view.shape)
    again = np.lib.stride_tricks.as_strided(view, sizes, [s * view.itemsize for s in strides])
    assert np.array_equal(again.ravel(), view.ravel())
    if view.ndim == 4 and min(view.shape) > 1 and steps == [1] * 4 and perm == [0, 2, 3, 1]:
        assert sizes[1] == view.shape[1] * view.shape[2]   # NHWC of NCHW memory: H and W are one axis
