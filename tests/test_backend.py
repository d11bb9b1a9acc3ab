"""Backend selection and moving trees between devices."""
import numpy as np
import pytest

import fluxpy
from fluxpy import GPUUnavailableError, cpu, get_array_module, gpu, gpu_available


def test_numpy_is_the_default_module():
    assert get_array_module(np.ones(2), 1.0, None) is np
    assert get_array_module() is np


def test_gpu_raises_a_reason_without_a_gpu():
    ok, why = gpu_available()
    if ok:
        pytest.skip("a GPU is present")
    with pytest.raises(GPUUnavailableError, match="no usable GPU: .+"):
        gpu(np.ones(2))


def test_cpu_is_identity_for_numpy_trees():
    tree = {"w": np.ones(2), "n": 3}
    out = cpu(tree)
    assert out["n"] == 3 and isinstance(out["w"], np.ndarray)


@pytest.mark.gpu
def test_gpu_round_trip_and_mixing_error():
    import cupy
    tree = {"w": np.arange(3.0), "act": np.tanh}
    g = gpu(tree)
    assert isinstance(g["w"], cupy.ndarray) and g["act"] is np.tanh
    np.testing.assert_array_equal(cpu(g)["w"], tree["w"])
    with pytest.raises(TypeError, match="cannot mix CPU"):
        get_array_module(np.ones(2), cupy.ones(2))


@pytest.mark.gpu
def test_gradient_on_gpu_matches_cpu():
    x = np.random.default_rng(0).standard_normal((4, 3))
    b = np.random.default_rng(1).standard_normal(3)
    f = lambda x, b: (np.tanh(x * b + 1.0) ** 2).sum() + (x @ b).sum()  # noqa: E731
    gc = fluxpy.gradient(f, x, b)
    gg = fluxpy.gradient(f, *gpu((x, b)))
    for a, c in zip(gc, gg):
        np.testing.assert_allclose(cpu(c), a, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# HostToDevice's host side (the GPU side: tests/gpu/test_prefetch_gpu.py)


def test_host_to_device_declines_what_it_cannot_pin():
    from fluxpy.backend import host_to_device
    assert host_to_device([np.array(["a", "b"])], 2) is None
    assert host_to_device([np.ones(2, ">f4")], 2) is None                 # not native byte order
    assert host_to_device([np.array([None, 1], dtype=object)], 2) is None
    if not gpu_available()[0]:
        assert host_to_device([np.ones((4, 3), np.float32)], 2) is None   # no GPU: DataLoader moves as before


def test_layout_aligns_each_source():
    from fluxpy.backend import _ALIGN, _layout
    offsets, size = _layout([np.zeros((9, 1, 3, 3), np.uint8), np.zeros((9, 10), np.float32), np.zeros(9)], 4)
    assert offsets == [0, _ALIGN, 2 * _ALIGN] and size == 2 * _ALIGN + 4 * 8
    assert _layout([np.zeros((5, 0))], 4) == ([0], 1)


def test_check_index_counts_rows_and_refuses_bad_indices():
    from fluxpy.backend import _check_index
    assert _check_index(slice(4, 8), 10, 4) == 4
    assert _check_index(slice(8, 12), 10, 4) == 2                          # the partial last batch
    assert _check_index(np.array([9, 0, 3]), 10, 4) == 3
    with pytest.raises(ValueError, match="at most rows=4 rows per batch, got 5"):
        _check_index(np.arange(5), 10, 4)
    with pytest.raises(IndexError, match=r"row indices in \[0, 10\), got values from -1 to 2"):
        _check_index(np.array([2, -1]), 10, 4)
    with pytest.raises(TypeError, match="a slice or a 1-d integer array of rows, got ndarray float64"):
        _check_index(np.array([1.0]), 10, 4)


@pytest.mark.parametrize("index", [slice(2, 5), np.array([4, 0, 4])])
def test_gather_writes_rows_into_the_buffer(index):
    from fluxpy.backend import _gather
    src = np.arange(6 * 2 * 3, dtype=np.float32).reshape(6, 2, 3)
    out = np.full((3, 2, 3), -1, np.float32)
    _gather(src[:, ::-1], index, out)                                     # a non-contiguous source too
    np.testing.assert_array_equal(out, src[:, ::-1][index])


def test_read_scalars_on_the_cpu():
    from fluxpy.backend import read_scalars
    assert read_scalars() == []
    values = read_scalars(np.float32(0.5), np.array(np.nan), 2, True, np.array(-np.inf, np.float16))
    assert values[0] == 0.5 and np.isnan(values[1]) and values[2:] == [2.0, 1.0, -np.inf]
    assert all(type(v) is float for v in values)
    with pytest.raises(TypeError):
        read_scalars(np.ones(2))


@pytest.mark.gpu
def test_read_scalars_reads_gpu_scalars_after_the_work_that_makes_them():
    import cupy
    from fluxpy.backend import read_scalars
    big = cupy.ones(1 << 24, cupy.float32)
    total = big.sum(dtype=cupy.float64)                   # enqueued just now: the read must wait for it
    half = cupy.asarray(np.float16(0.25))
    values = read_scalars(total, cupy.asarray(np.float32(np.nan)), 3, total, half, cupy.asarray(True),
                          cupy.asarray(np.complex64(2)).real, np.float64(-1))
    assert values[0] == values[3] == float(1 << 24) and np.isnan(values[1])
    assert values[2:3] + values[4:] == [3.0, 0.25, 1.0, 2.0, -1.0]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        again = (big * 2).sum(dtype=cupy.float64)
        assert read_scalars(again) == [float(1 << 25)]


def test_host_to_device_checks_its_arguments_first():
    from fluxpy.backend import HostToDevice
    with pytest.raises(ValueError, match="HostToDevice expects rows to be an int >= 1, got 0"):
        HostToDevice([np.ones(3)], rows=0)
    with pytest.raises(ValueError, match="HostToDevice expects slots to be an int >= 1, got True"):
        HostToDevice([np.ones(3)], rows=2, slots=True)
    with pytest.raises(TypeError, match=r"native-order number or bool dtype, with an axis of rows, got "
                                        r"\['ndarray float64 \(3,\)', 'ndarray <U1 \(1,\)'\]"):
        HostToDevice([np.ones(3), np.array(["a"])], rows=2)
    with pytest.raises(TypeError, match=r"got \[\]"):
        HostToDevice([], rows=2)
