"""clip_grad_norm on CuPy against the CPU (float16, float32, float64; every p), and inside a CUDA-graph capture:
recorded once, replayed on new gradients written in place, matching the CPU each time (so no value was read on
the host while recording).

Needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere). Run:
``python -m pytest -q tests/gpu/test_clip_global_gpu.py -p no:cacheprovider``.
"""
import math

import numpy as np
import pytest

from devices import assert_matches_cpu, cupy_module
from fluxpy.backend import capture_graph
from fluxpy.capturing import recording
from fluxpy.optimise import clip_grad_norm

pytestmark = pytest.mark.gpu

TOL = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-3}


def _tree(xp, dtype, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s) * 3 for s in ((64, 33), (33,), (0, 4), (5, 3, 3, 3))]
    arrays = [xp.asarray(a.astype(dtype)) for a in arrays]
    return {"layers": [{"weight": arrays[0], "bias": arrays[1]}, None], "empty": arrays[2], "conv": (arrays[3],)}


def _leaves(tree):
    return [tree["layers"][0]["weight"], tree["layers"][0]["bias"], tree["empty"], tree["conv"][0]]


def _host(tree, cp):
    return {"layers": [{k: cp.asnumpy(v) for k, v in tree["layers"][0].items()}, None],
            "empty": cp.asnumpy(tree["empty"]), "conv": (cp.asnumpy(tree["conv"][0]),)}


@pytest.mark.parametrize("p", [1, 2, 3, math.inf])
@pytest.mark.parametrize("dtype", list(TOL), ids=lambda d: np.dtype(d).name)
def test_matches_the_cpu(dtype, p):
    cp = cupy_module()
    grad = _tree(cp, dtype, 0)
    clipped, total = clip_grad_norm(grad, 1.0, p)
    want, want_total = clip_grad_norm(_host(grad, cp), 1.0, p)
    assert isinstance(total, cp.ndarray) and total.shape == ()
    assert_matches_cpu(total, want_total, rtol=TOL[dtype])
    for g, w in zip(_leaves(clipped), _leaves(want)):
        assert g.dtype == w.dtype
        assert_matches_cpu(g, w, rtol=TOL[dtype], atol=TOL[dtype] * 1e-2)
    assert clipped["layers"][1] is None and isinstance(clipped["conv"], tuple)


def test_captured_and_replayed_on_new_gradients():
    cp = cupy_module()
    grad = _tree(cp, np.float32, 1)
    clip_grad_norm(grad, 1.0)   # the kernels compiled before recording
    with recording():
        graph, (clipped, total) = capture_graph(lambda: clip_grad_norm(grad, 1.0))
    rng = np.random.default_rng(2)
    for scale in (0.01, 1.0, 100.0):   # below, near and above max_norm
        for a in _leaves(grad):
            a[...] = cp.asarray((rng.standard_normal(a.shape) * scale).astype(np.float32))
        graph.launch()
        cp.cuda.get_current_stream().synchronize()
        want, want_total = clip_grad_norm(_host(grad, cp), 1.0)
        assert_matches_cpu(total, want_total, rtol=1e-5)
        for g, w in zip(_leaves(clipped), _leaves(want)):
            assert_matches_cpu(g, w, rtol=1e-5, atol=1e-7)
