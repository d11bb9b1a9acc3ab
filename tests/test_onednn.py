"""fluxpy.kernels.onednn: oneDNN's float32 convolutions equal the NumPy im2col kernels (forward, backward data,
backward weights, the bias's gradient; groups, strides, dilation, asymmetric padding, 1-3 spatial axes, true
convolution and cross-correlation), the CPU kernels hand it exactly the float32 calls, a failing call names oneDNN's
status, and the problem cache evicts cleanly. Skipped where oneDNN is not installed (``pip install fluxpy[cpu]``)."""
import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluxpy.kernels import cpu, cpu_dense, onednn
from fluxpy.ops.conv import conv_dims
from test_conv import conv_problems

pytestmark = pytest.mark.skipif(onednn.library() is None, reason="oneDNN is not installed (pip install fluxpy[cpu])")


def _numpy_kernels(monkeypatch):
    monkeypatch.setattr(onednn, "takes", lambda *arrays: False)


def _case(problem, seed):
    xs, ws, opts = problem
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(xs).astype(np.float32)
    w = rng.standard_normal(ws).astype(np.float32)
    cdims = conv_dims(x, w, **opts)
    dy = rng.standard_normal(cdims.y_shape).astype(np.float32)
    y = rng.standard_normal(cdims.y_shape).astype(np.float32)
    return x, w, cdims, dy, y


def _all_ways(x, w, cdims, dy, y):
    return (cpu.conv_forward(x, w, cdims), cpu.conv_backward_data(dy, w, cdims), cpu.conv_backward_filter(x, dy, cdims),
            *cpu.conv_bias_act_grads(dy, y, x, w, "relu", cdims, True, True, True))


@settings(deadline=None, max_examples=60)
@given(conv_problems(max_batch=3), st.integers(0, 2**16))
def test_onednn_equals_the_numpy_kernels(problem, seed):
    case = _case(problem, seed)
    assert onednn.takes(case[0], case[1])
    ours = _all_ways(*case)
    with pytest.MonkeyPatch.context() as mp:
        _numpy_kernels(mp)
        want = _all_ways(*case)
    for got, ref in zip(ours, want):
        assert got.dtype == np.float32 and got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize("shape, kernel, opts", [((2, 3, 11), (4, 3, 3), dict(pad=2, stride=2)),
                                                 ((1, 2, 5, 6, 7), (4, 1, 2, 3, 2), dict(groups=2, pad=1))])
def test_one_and_three_spatial_axes(shape, kernel, opts, monkeypatch):
    case = _case((shape, kernel, opts), 3)
    ours = _all_ways(*case)
    _numpy_kernels(monkeypatch)
    for got, ref in zip(ours, _all_ways(*case)):
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)


def test_the_conv_layers_forward_with_bias_and_relu_is_one_onednn_call():
    x, w, cdims, _, _ = _case(((2, 3, 6, 6), (4, 3, 3, 3), dict(pad=1)), 5)
    b = np.linspace(-1, 1, 4).astype(np.float32)
    assert cpu._conv_bias_act_cpu_supports(x, w, b, "relu", cdims)
    got = cpu.conv_bias_act_cpu(x, w, b, "relu", cdims)
    want = np.maximum(cpu.conv_forward(x, w, cdims) + b.reshape(1, -1, 1, 1), 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not cpu._conv_bias_act_cpu_supports(x.astype(np.float64), w.astype(np.float64), None, "relu", cdims)


def test_only_float32_numpy_arrays_go_to_onednn():
    assert onednn.takes(np.ones(2, np.float32), np.ones(2, np.float32))
    assert not onednn.takes(np.ones(2, np.float32), np.ones(2, np.float64))
    assert not onednn.takes(np.ones(2, np.float16))
    assert not onednn.takes(np.ones((0, 3, 4, 4), np.float32), np.ones((2, 3, 3, 3), np.float32))


def test_an_empty_batch_gives_zero_weight_gradients():
    x, w = np.ones((0, 3, 5, 5), np.float32), np.full((2, 3, 3, 3), 7.0, np.float32)
    cdims = conv_dims(x, w, pad=1)
    dy = np.ones(cdims.y_shape, np.float32)
    dx, dw, db = cpu.conv_bias_act_grads(dy, None, x, w, "identity", cdims, True, True, True)
    assert dx.shape == x.shape and not dw.any() and not db.any()


def test_a_failing_call_names_the_status_and_the_function():
    lib = onednn.library()
    md = ctypes.c_void_p()
    with pytest.raises(RuntimeError, match=r"oneDNN: dnnl_memory_desc_create_with_tag failed with "
                                           r"dnnl_invalid_arguments"):
        lib.call("dnnl_memory_desc_create_with_tag", ctypes.byref(md), -1, onednn._Dims(), 3, 1)


def test_the_problem_cache_keeps_a_bounded_number_and_evicted_problems_rebuild(monkeypatch):
    monkeypatch.setattr(onednn, "_PROBLEMS_KEPT", 2)
    cases = [_case(((2, 3, 5 + k, 5 + k), (2, 3, 3, 3), dict(pad=1)), k) for k in range(4)]
    first = [cpu.conv_forward(x, w, cd) for x, w, cd, _, _ in cases]
    assert len(onednn.library().problems) <= 2
    again = [cpu.conv_forward(x, w, cd) for x, w, cd, _, _ in cases]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


@settings(deadline=None, max_examples=30)
@given(st.integers(82, 200), st.integers(82, 200), st.integers(82, 200), st.booleans(), st.booleans())
def test_large_float32_products_run_through_onednn_and_equal_numpys(m, k, n, a_transposed, b_transposed):
    rng = np.random.default_rng(m * k + n)
    a = rng.standard_normal((k, m) if a_transposed else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if b_transposed else (k, n)).astype(np.float32)
    a, b = (a.T if a_transposed else a), (b.T if b_transposed else b)   # views read in place
    assert onednn.takes_matmul(a, b)
    np.testing.assert_allclose(onednn.matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)
    from fluxpy.kernels import find
    assert find("matmul", a, b) is cpu_dense.matmul_cpu   # the op's product goes there too


def test_small_or_other_products_stay_with_numpy():
    small = np.ones((4, 4), np.float32)
    big = np.ones((256, 256), np.float32)
    assert not onednn.takes_matmul(small, small)
    assert not onednn.takes_matmul(big.astype(np.float64), big.astype(np.float64))
    assert not onednn.takes_matmul(big[:, ::2], big[::2])   # no unit stride: NumPy copies such operands itself
    assert not onednn.takes_matmul(np.ones((2, 256, 256), np.float32), big)


def _src_holds(monkeypatch):
    """The ``filled`` flag of every reordered operand's buffer from now on (True: the forward's copy of an input,
    read instead of a reorder)."""
    calls = []
    hold = onednn._Operand.hold
    monkeypatch.setattr(onednn._Operand, "hold", lambda self, buffer=None, filled=False: (
        calls.append(filled), hold(self, buffer, filled))[1])
    return calls


@settings(deadline=None, max_examples=30)
@given(conv_problems(max_batch=3), st.integers(0, 2**16))
def test_the_weights_gradient_reads_the_forwards_copy_of_its_input(problem, seed):
    """After a forward, the weights' gradient of the same input array reads the forward's reordered copy: the same
    gradient as from a fresh array of the same values (reordered again), and as NumPy's."""
    x, w, cdims, dy, _ = _case(problem, seed)
    with pytest.MonkeyPatch.context() as mp:
        calls = _src_holds(mp)
        cpu.conv_forward(x, w, cdims)
        reused = cpu.conv_backward_filter(x, dy, cdims)
        problems = onednn.library().problems
        copied = problems[("forward", cdims, False)].operands["src"].reorder is not None
        shared = problems[("backward_weights", cdims, False)].src_as_forward
        assert calls.count(True) == (copied and shared)
        again = cpu.conv_backward_filter(x.copy(), dy, cdims)
        assert calls.count(True) == (copied and shared)
    np.testing.assert_array_equal(reused, again)
    with pytest.MonkeyPatch.context() as mp:
        _numpy_kernels(mp)
        want = cpu.conv_backward_filter(x, dy, cdims)
    np.testing.assert_allclose(reused, want, rtol=2e-4, atol=2e-4 * max(1.0, float(np.abs(want).max())))


def test_the_forwards_copy_lives_as_long_as_its_input_and_only_for_its_dims(monkeypatch):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 32, 12, 12)).astype(np.float32)
    w = rng.standard_normal((32, 1, 3, 3)).astype(np.float32)
    cdims = conv_dims(x, w, pad=1, groups=32)   # depthwise: oneDNN's blocked layout
    other = conv_dims(x, w, pad=2, groups=32)
    calls = _src_holds(monkeypatch)
    onednn.conv_forward(x, w, cdims)
    assert onednn._BLOCKED_INPUTS.get(x, (cdims, False)) is not None
    assert onednn._BLOCKED_INPUTS.get(x, (other, False)) is None
    assert onednn._BLOCKED_INPUTS.get(x, (cdims, True)) is None   # a forward with a bias: another problem
    onednn.conv_backward_weights(x, np.ones(other.y_shape, np.float32), other)
    assert True not in calls
    onednn.conv_backward_weights(x, np.ones(cdims.y_shape, np.float32), cdims)
    assert calls.count(True) == 1
    for _ in range(3):   # kept again: still one entry
        onednn.conv_forward(x, w, cdims)
    keys = [k for k in onednn._BLOCKED_INPUTS.entries if k[0] == id(x)]
    assert len(keys) == 1
    del x
    assert keys[0] not in onednn._BLOCKED_INPUTS.entries


def test_values_kept_beside_an_array_are_found_for_it_alone_and_dropped_with_it():
    beside = onednn._Beside()
    a, b = np.ones(3), np.ones(3)
    beside.keep(a, "k", 1)
    beside.keep(a, "k", 2)
    beside.keep(a, "j", 3)
    assert (beside.get(a, "k"), beside.get(a, "j"), beside.get(b, "k"), beside.get(a, "x")) == (2, 3, None, None)
    del a
    assert beside.entries == {}
