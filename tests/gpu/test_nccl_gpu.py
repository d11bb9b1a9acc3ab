"""The NCCL communicator on one GPU (a clique of one rank: every collective is a copy, but the calls, streams,
capture and teardown are NCCL's own). Needs a GPU with NCCL (``gpu`` marker)."""
import threading

import numpy as np
import pytest

from devices import cupy_module

pytestmark = pytest.mark.gpu


@pytest.fixture()
def comm():
    from fluxpy.kernels.nccl import NcclComm, nccl_available, unique_id
    ok, why = nccl_available()
    if not ok:
        pytest.skip(why)
    c = NcclComm(unique_id(), rank=0, world_size=1, device=cupy_module().cuda.Device().id)
    yield c
    c.destroy()


def _finishes(fn, seconds=60):
    done = threading.Event()

    def run():
        fn()
        done.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return done.is_set()


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_all_reduce_of_one_rank_keeps_the_values(comm, op):
    cp = cupy_module()
    x = cp.asarray(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    before = x.copy()
    comm.all_reduce(x, op).wait()
    cp.testing.assert_allclose(x, before, rtol=1e-7)


def test_destroy_frees_the_graphs_that_captured_its_collectives_instead_of_hanging(comm):
    """ncclCommDestroy waits for every CUDA graph holding a collective of the communicator: destroy() frees those
    graphs first (their launch then raises), and leaves other graphs alone."""
    cp = cupy_module()
    from fluxpy.backend import capture_graph
    x = cp.asarray(np.random.default_rng(1).standard_normal(4096).astype(np.float32))
    y = cp.ones(8, cp.float32)

    def step():
        x[...] = x * 2
        comm.all_reduce(x, "sum", wait=True)
    with_nccl, _ = capture_graph(step)
    without, _ = capture_graph(lambda: y.__imul__(3))
    assert with_nccl.holds == (comm,) and without.holds == ()
    start = x.copy()
    with_nccl.launch()
    with_nccl.launch()
    cp.testing.assert_allclose(x, start * 4, rtol=1e-6)
    assert _finishes(comm.destroy), "NcclComm.destroy hung with a live graph holding its collectives"
    with pytest.raises(RuntimeError, match="released .*rank 0's NCCL communicator was destroyed"):
        with_nccl.launch()
    without.launch()   # a graph without collectives still replays
    cp.testing.assert_allclose(y, 3.0)
