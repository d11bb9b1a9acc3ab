"""Joins (stack, concatenate) of many arrays inside a CUDA-graph capture, where CuPy's own single kernel cannot run
(it copies the arrays' addresses from the host), and a recurrent layer's forward and backward captured whole."""
import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy.backend import capture_graph
from fluxpy.ops.shape import concatenate, stack

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [2, 7, 130])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_stack_and_concatenate_of_many_arrays_capture_and_replay(n, axis):
    cp = cupy_module()
    rng = np.random.default_rng(n + axis)
    xs = [cp.asarray(rng.standard_normal((3, 4)).astype(np.float32)) for _ in range(n)]
    graph, (s, c) = capture_graph(lambda: (stack(xs, axis=axis), concatenate(xs, axis=min(axis, 1))))
    for x in xs:   # new values after the capture: the replay must read them
        x[...] = cp.asarray(rng.standard_normal((3, 4)).astype(np.float32))
    graph.launch()
    cp.testing.assert_array_equal(s, cp.stack(xs, axis=axis))
    cp.testing.assert_array_equal(c, cp.concatenate(xs, axis=min(axis, 1)))


def test_capture_joins_name_bad_shapes():
    cp = cupy_module()
    xs = [cp.ones((2, 3), cp.float32), cp.ones((2, 4), cp.float32)]
    with pytest.raises(ValueError, match=r"stack: all shapes must be equal, got \[\(2, 3\), \(2, 4\)\]"):
        capture_graph(lambda: stack(xs))
    with pytest.raises(ValueError, match="concatenate: shapes"):
        capture_graph(lambda: concatenate(xs, axis=0))


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
def test_a_recurrent_layer_forward_and_backward_capture_and_match_eager(cell):
    cp = cupy_module()
    rng = np.random.default_rng(3)
    layer = fluxpy.gpu(getattr(fluxpy, cell)(5, 6, rng=0))
    x = cp.asarray(rng.standard_normal((4, 40, 5)).astype(np.float32))
    dy = cp.asarray(rng.standard_normal((4, 40, 6)).astype(np.float32))

    def run():
        return fluxpy.gradient(lambda m, x: (m(x) * dy).sum(), layer, x)
    eager = run()
    graph, captured = capture_graph(run)
    graph.launch()
    cp.cuda.Device().synchronize()
    cp.testing.assert_allclose(captured[1], eager[1], rtol=1e-5, atol=1e-6)
    cp.testing.assert_allclose(captured[0]["cell"]["weight_hh"], eager[0]["cell"]["weight_hh"], rtol=1e-5,
                               atol=1e-6)
