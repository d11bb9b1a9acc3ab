"""The default index checks (``index_checks="deferred"``) of device indices, through the CPU stand-in for CuPy
(``cupy_standin``): a checked gather (``Embedding`` included) returns without waiting; the bad index is raised,
naming the op and the entry, by ``check_indices()`` (which waits), by ``check_indices(wait=False)`` once the
kernels have run (which does not), or by the next checked call. The CUDA kernels run only on a GPU
(tests/gpu/test_scatter_gpu.py)."""
import types

import numpy as np
import pytest

import fluxpy
from cupy_standin import CPP, FakeArray, make_cupy
from fluxpy import backend, kernels
from fluxpy.kernels import compiler, cuda_scatter, scatter_checks
from fluxpy.layers import Embedding
from fluxpy.options import options

if CPP is None:
    pytest.skip("no C preprocessor (cpp) to read the kernels' parameter lists", allow_module_level=True)


@pytest.fixture
def cp(monkeypatch):
    """The stand-in as CuPy for fluxpy's scatter and gather, with empty caches (as tests/test_scatter_host.py's)."""
    fake = make_cupy()
    for module in (backend, cuda_scatter, scatter_checks, compiler):
        monkeypatch.setattr(module, "cupy", fake)
    monkeypatch.setattr(compiler, "_modules", {})
    monkeypatch.setattr(compiler, "_functions", {})
    monkeypatch.setattr(cuda_scatter, "c_contiguous", fake.ascontiguousarray)
    for cache in ("_problems", "_gathers", "_choices"):
        monkeypatch.setattr(cuda_scatter, cache, {})
    monkeypatch.setattr(scatter_checks, "_flags", {})
    monkeypatch.setattr(compiler, "time_ms", lambda run: (run(), 1.0)[1])   # every scatter implementation "as fast"
    monkeypatch.setattr(FakeArray, "device", types.SimpleNamespace(id=0), raising=False)   # device 0's arrays
    table = kernels.snapshot()
    for name, fn in cuda_scatter.KERNELS.items():
        kernels.register(name, "cupy", fn)
    before = options.get()
    yield fake
    options.set(**before)
    kernels.restore(table)


def _table(cp, n=6, dim=3, seed=0):
    layer = Embedding(n, dim, rng=seed)
    layer.weight = cp.asarray(layer.weight)
    return layer


def test_an_embedding_of_device_indices_never_waits_and_check_indices_names_the_entry(cp):
    assert options.index_checks == "deferred"
    layer = _table(cp)
    weight = layer.weight.a
    tokens = cp.asarray(np.array([[0, 5], [2, 9]]))
    y = layer(tokens)   # returns: the bad entry's row is zeros
    assert cp.stream.waits == {"stream": 0, "device": 0}
    np.testing.assert_array_equal(y.a, np.stack([weight[[0, 5]], np.stack([weight[2], np.zeros(3)])]))
    with pytest.raises(IndexError, match=r"^gather: index 9 in idx is out of range for src axis 0 of size 6 "
                                         r"\(reported late: an earlier gather call, at .*test_deferred_checks\.py:\d+"):
        fluxpy.check_indices()
    assert cp.stream.waits["device"] == 1
    np.testing.assert_array_equal(layer(cp.asarray(np.array([1, 3]))).a, weight[[1, 3]])
    fluxpy.check_indices()   # nothing pending


def test_host_indices_are_still_checked_by_the_layer_at_the_call(cp):
    layer = _table(cp)
    with pytest.raises(fluxpy.layers.DimensionMismatch, match=r"indices in \[0, 6\), found indices from 0 to 7"):
        layer(np.array([0, 7]))


def test_check_indices_without_waiting_reports_what_the_kernels_have_flagged(cp):
    layer = _table(cp, n=4)
    cp.stream.queue = []   # the GPU runs the queued kernels later
    tokens = cp.asarray(np.array([1, 4, 2]))   # held, as a batch is: the error names the entry
    layer(tokens)
    fluxpy.check_indices(wait=False)   # not run yet: nothing flagged, nothing waited for
    assert cp.stream.waits == {"stream": 0, "device": 0} and cp.stream.queue
    cp.stream.run_queued()   # what reading a loss computed after it waits for
    with pytest.raises(IndexError, match=r"^gather: index 4 in idx is out of range for src axis 0 of size 4"):
        fluxpy.check_indices(wait=False)
    assert cp.stream.waits == {"stream": 0, "device": 0}
    assert scatter_checks._flags[0].view[0] == 0
    fluxpy.check_indices(wait=False)


def test_the_next_checked_call_reports_an_earlier_embeddings_bad_index(cp):
    layer = _table(cp)
    tokens = cp.asarray(np.array([-2, 1]))
    layer(tokens)
    with pytest.raises(IndexError, match=r"^gather: expects non-negative \(0-based\) indices, got -2 in idx "
                                         r"\(reported late: an earlier gather call"):
        fluxpy.gather(cp.asarray(np.ones((2, 2))), cp.asarray(np.array([0])))


def test_the_wait_mode_stays_available_and_raises_at_the_call(cp):
    layer = _table(cp)
    with options(index_checks="wait"):
        with pytest.raises(IndexError, match=r"^gather: index 6 in idx is out of range for src axis 0 of size 6$"):
            layer(cp.asarray(np.array([6])))
        assert cp.stream.waits["stream"] == 1
    fluxpy.check_indices()   # reported already: nothing pending


def test_host_indices_for_device_arrays_refuse_a_capture(cp):
    from fluxpy.capturing import CaptureUnsupported, recording
    src = cp.asarray(np.arange(6.0).reshape(3, 2))
    with recording(), pytest.raises(CaptureUnsupported, match="indices given on the host"):
        fluxpy.gather(src, np.array([0, 2]))
    assert isinstance(fluxpy.gather(src, np.array([0, 2])), FakeArray)   # eagerly: copied, as before


def test_a_scatter_without_dstsize_refuses_a_capture_with_device_indices(cp):
    from fluxpy.capturing import CaptureUnsupported, recording
    src, idx = cp.asarray(np.ones(3)), cp.asarray(np.array([0, 2, 2]))
    with recording(), pytest.raises(CaptureUnsupported, match="give dstsize"):
        fluxpy.scatter("+", src, idx)
    with recording():
        np.testing.assert_array_equal(fluxpy.scatter("+", src, idx, dstsize=3).a, [1.0, 0.0, 2.0])
    np.testing.assert_array_equal(fluxpy.scatter("+", src, idx).a, [1.0, 0.0, 2.0])   # eagerly: read, as before


def test_ragged_bags_of_device_indices_refuse_a_capture(cp):
    from fluxpy.capturing import CaptureUnsupported, recording
    from fluxpy.layers import EmbeddingBag
    bag = EmbeddingBag(6, 3, rng=0)
    bag.weight = cp.asarray(bag.weight)
    data, offsets = cp.asarray(np.array([1, 2, 3, 4])), cp.asarray(np.array([0, 1]))
    for call in (lambda: bag(data, offsets), lambda: bag([data, data])):
        with recording(), pytest.raises(CaptureUnsupported, match=r"EmbeddingBag\(6 => 3\): ragged bags"):
            call()
