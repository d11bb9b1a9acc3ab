"""DataLoader(device="gpu") prefetching (fluxpy.backend.HostToDevice): the same batches as without it, each its own
device memory, copied on a side stream that the current stream waits for, and the same training."""
import time

import numpy as np
import pytest
from devices import cupy_module

import fluxpy
from fluxpy.backend import HostToDevice, host_to_device
from fluxpy.data import DataLoader
from fluxpy.layers import Chain, Conv, Dense, MaxPool, flatten
from fluxpy.losses import logitcrossentropy
from fluxpy.ops.activations import relu
from fluxpy.optimise import Adam, setup
from fluxpy.train import train

pytestmark = pytest.mark.gpu

SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
'''


def spin(stream, seconds=0.2):
    """Keep ``stream`` busy for about ``seconds`` of GPU time (one thread spinning on the clock)."""
    cp = cupy_module()
    kernel = cp.RawKernel(SPIN, "spin")
    rate = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["clockRate"] * 1e3   # cycles per second
    with stream:
        kernel((1,), (1,), (np.int64(rate * seconds),))


def images_and_labels(n=50, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 1, 5, 5), dtype=np.uint8)
    y = rng.random((n, 10), dtype=np.float32)
    return x, y


def host(batch):
    return tuple(cupy_module().asnumpy(b) for b in batch) if isinstance(batch, tuple) else cupy_module().asnumpy(batch)


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        g, e = (g, e) if isinstance(e, tuple) else ((g,), (e,))
        assert len(g) == len(e)
        for a, b in zip(g, e):
            assert isinstance(a, cupy_module().ndarray), type(a)
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(cupy_module().asnumpy(a), b)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("partial", [True, False])
@pytest.mark.parametrize("single", [False, True])
def test_prefetched_batches_equal_the_unprefetched_ones(shuffle, partial, single):
    x, y = images_and_labels()
    data = x if single else (x, y)
    kw = dict(batchsize=8, shuffle=shuffle, partial=partial)
    loader = DataLoader(data, rng=3, device="gpu", **kw)
    assert isinstance(loader._prefetcher(), HostToDevice)
    got = list(loader)
    expected = list(DataLoader(data, rng=3, **kw))       # the same seed: the same order, on the host
    assert len(got) == (7 if partial else 6)
    assert_same_batches(got, expected)
    plain = [host(b) for b in DataLoader(data, rng=3, device="gpu", prefetch=False, **kw)]
    assert_same_batches(got, plain)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.float64, np.int64, np.bool_, np.float16])
def test_dtypes_and_shapes_are_kept(dtype):
    x = (np.arange(7 * 3 * 2) % 5).astype(dtype).reshape(7, 3, 2)
    got = list(DataLoader(x, batchsize=3, device="gpu"))
    assert_same_batches(got, [x[0:3], x[3:6], x[6:7]])


def test_a_batch_stays_correct_after_later_batches_are_made():
    """Every batch is its own device memory: holding all of them, none is overwritten by the ones after it."""
    x, y = images_and_labels(200)
    loader = DataLoader((x, y), batchsize=8, shuffle=True, rng=1, device="gpu")
    first = list(loader)                                  # 25 batches through 3 pinned slots, all held
    second = list(loader)                                 # a second epoch reuses the slots and the memory pool
    reference = DataLoader((x, y), batchsize=8, shuffle=True, rng=1)
    expected_first, expected_second = list(reference), list(reference)
    assert_same_batches(first, expected_first)
    assert_same_batches(second, expected_second)
    pointers = {b[i].data.ptr for b in first + second for i in (0, 1)}
    assert len(pointers) == 2 * (len(first) + len(second))


def test_the_copy_runs_on_a_side_stream_and_the_current_stream_waits_for_it():
    cp = cupy_module()
    x = np.random.default_rng(0).random((8, 1 << 20), dtype=np.float32)   # 16 MiB per batch
    copier = host_to_device([x], rows=4)
    assert copier.stream.ptr != cp.cuda.get_current_stream().ptr
    spin(copier.stream)                                   # the copy cannot start for ~0.2 s
    start = time.perf_counter()
    (batch,) = copier.ready(copier.stage(np.array([5, 1, 2, 7])))
    handed_out = time.perf_counter() - start
    total = float(batch.sum(dtype=np.float64))            # on the current stream, at once
    assert handed_out < 0.1, f"stage and ready took {handed_out:.3f} s: a host sync instead of an event wait"
    np.testing.assert_allclose(total, x[[5, 1, 2, 7]].sum(dtype=np.float64), rtol=1e-12)


def test_a_loader_hands_out_batches_without_waiting_for_the_gpu():
    """The compute stream is busy: the loader still hands out a batch at once, and it is right when used there."""
    cp = cupy_module()
    x = np.random.default_rng(1).random((12, 1 << 20), dtype=np.float32)
    it = iter(DataLoader(x, batchsize=4, device="gpu"))
    next(it)                                              # the copier is made and the pipeline started
    spin(cp.cuda.get_current_stream())
    start = time.perf_counter()
    batch = next(it)                                      # also stages batch 3, whose copy waits for the spin
    took = time.perf_counter() - start
    assert took < 0.1, f"next() took {took:.3f} s"
    np.testing.assert_allclose(float(batch.sum(dtype=np.float64)), x[4:8].sum(dtype=np.float64), rtol=1e-12)
    np.testing.assert_allclose(float(next(it).sum(dtype=np.float64)), x[8:].sum(dtype=np.float64), rtol=1e-12)


def test_staging_never_waits_on_the_host_for_the_current_stream():
    cp = cupy_module()
    x = np.ones((8, 1000), np.float32)
    copier = host_to_device([x], rows=4)
    spin(cp.cuda.get_current_stream())                   # earlier work still running on the compute stream
    start = time.perf_counter()
    staged = copier.stage(slice(0, 4))
    took = time.perf_counter() - start
    assert took < 0.1, f"stage took {took:.3f} s"
    assert not staged[1].done                             # the copy waits (on the GPU) for the earlier work
    (batch,) = copier.ready(staged)
    np.testing.assert_array_equal(cp.asnumpy(batch), x[:4])


def test_batches_are_ready_on_a_non_default_current_stream():
    cp = cupy_module()
    x, y = images_and_labels(64)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        sums = [float(bx.astype(np.float64).sum() + by.astype(np.float64).sum())
                for bx, by in DataLoader((x, y), batchsize=16, device="gpu")]
    expected = [float(x[i:i + 16].astype(np.float64).sum() + y[i:i + 16].astype(np.float64).sum())
                for i in range(0, 64, 16)]
    np.testing.assert_allclose(sums, expected, rtol=1e-12)


def test_stopping_early_then_iterating_again():
    x, y = images_and_labels(100)
    loader = DataLoader((x, y), batchsize=8, device="gpu")
    for i, _ in enumerate(loader):
        if i == 2:
            break                                         # batch 3 was staged and is never handed out
    assert_same_batches(list(loader), list(DataLoader((x, y), batchsize=8)))


def test_two_iterations_at_once():
    x, y = images_and_labels(100)
    loader = DataLoader((x, y), batchsize=8, device="gpu")
    pairs = list(zip(loader, loader))
    expected = list(DataLoader((x, y), batchsize=8))
    assert_same_batches([a for a, _ in pairs], expected)
    assert_same_batches([b for _, b in pairs], expected)


def test_data_that_cannot_be_pinned_takes_the_old_path():
    cp = cupy_module()
    strings = DataLoader((np.ones(4, np.float32), np.array(list("abcd"))), batchsize=2, device="gpu")
    assert strings._prefetcher() is None
    on_gpu = DataLoader(cp.arange(6), batchsize=4, device="gpu")
    assert on_gpu._prefetcher() is None
    assert [b.tolist() for b in on_gpu] == [[0, 1, 2, 3], [4, 5]]
    assert DataLoader(np.ones(4), device="gpu", prefetch=False)._prefetcher() is None
    assert DataLoader(np.ones(4), device=fluxpy.gpu)._prefetcher() is None


def test_stage_checks_its_index():
    copier = host_to_device([np.zeros((10, 2), np.float32)], rows=4)
    with pytest.raises(ValueError, match="at most rows=4 rows per batch, got 5"):
        copier.stage(slice(0, 5))
    with pytest.raises(IndexError, match=r"row indices in \[0, 10\), got values from 3 to 10"):
        copier.stage(np.array([3, 10]))
    with pytest.raises(TypeError, match="HostToDevice expects NumPy arrays of a native-order number or bool"):
        HostToDevice([np.array(["a"])], rows=1)


def small_net():
    rng = np.random.default_rng(0)
    return Chain(Conv((3, 3), 1, 4, relu, pad=1, rng=rng), MaxPool((2, 2)), flatten, Dense(4 * 4 * 4, 10, rng=rng))


def test_training_on_prefetched_batches_gives_the_same_weights():
    rng = np.random.default_rng(5)
    x = rng.random((100, 1, 8, 8), dtype=np.float32)
    y = fluxpy.onehotbatch(rng.integers(0, 10, 100), range(10))
    trained = []
    for prefetch in (True, False):
        model = fluxpy.gpu(small_net())
        loader = DataLoader((x, y), batchsize=16, shuffle=True, rng=7, device="gpu", prefetch=prefetch)
        losses = train(lambda m, x, y: logitcrossentropy(m(x), y), model, loader, setup(Adam(1e-2), model),
                       epochs=3, progress=False)
        trained.append((losses, fluxpy.cpu(fluxpy.state(model))))
    (l1, s1), (l2, s2) = trained
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    leaves1, leaves2 = _leaves(s1), _leaves(s2)
    assert len(leaves1) == len(leaves2) == 4
    for a, b in zip(leaves1, leaves2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _leaves(tree):
    if isinstance(tree, dict):
        return [v for k in tree for v in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [v for t in tree for v in _leaves(t)]
    return [] if tree is None else [tree]
