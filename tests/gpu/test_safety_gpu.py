"""The safety checks on CuPy arrays: update's checks add no device sync; train's NaN/Inf gradient check (one
reduction, read with the loss) names the parameter; device mismatches between gradient, state and model are errors
before any change; loadstate checks values on the device they are on. Needs a GPU (``gpu`` marker)."""
import warnings

import numpy as np
import pytest

import fluxpy
from fluxpy.layers import Chain, Dense
from fluxpy.losses import logitcrossentropy, mse
from fluxpy.ops.activations import relu
from fluxpy.optimise import Adam, ClipNorm, Momentum, OptimiserChain, _finite_total, _read_finite, setup, update
from fluxpy.train import TrainingDiverged, train
from devices import state_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def gpu_mlp():
    return fluxpy.gpu(Chain(Dense(4, 8, relu, rng=0), Dense(8, 3, rng=1)))


def test_update_checks_add_no_device_sync():
    import cupy as cp
    import cupyx
    model = gpu_mlp()
    state = setup(OptimiserChain(Momentum(0.01)), model)
    x = cp.ones((5, 4), cp.float32)
    y = cp.asarray(np.eye(3, dtype=np.float32)[[0, 1, 2, 0, 1]])
    g, = fluxpy.gradient(lambda m: logitcrossentropy(m(x), y), model)
    update(state, model, g)   # compiles kernels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # CuPy 14 notes that allow_synchronize is deprecated
        with cupyx.allow_synchronize(False):
            for _ in range(3):
                update(state, model, g)


@pytest.mark.parametrize("dtypes", [(np.float32,), (np.float32, np.float64), (np.float64, np.float16)])
def test_finite_total_on_the_device(dtypes):
    import cupy as cp
    rng = np.random.default_rng(0)
    arrays = [cp.asarray(rng.standard_normal(s).astype(d)) for s, d in zip([(3, 4), (5,), (2, 2, 2)], dtypes * 3)]
    assert _read_finite(_finite_total(arrays))
    huge = [cp.full((1000,), 3e38, cp.float32)] + arrays[1:]   # the float64 sum does not overflow
    assert _read_finite(_finite_total(huge))
    for bad in (np.nan, np.inf, -np.inf):
        spoiled = [a.copy() for a in arrays]
        spoiled[-1].ravel()[-1] = bad
        assert not _read_finite(_finite_total(spoiled))


def test_train_names_the_parameter_with_a_nan_gradient_on_the_gpu():
    import cupy as cp
    model = gpu_mlp()
    state = setup(Adam(0.01), model)
    x = cp.ones((5, 4), cp.float32)
    before = state_bytes(model, state)

    def loss(m, x):   # finite loss; the last bias gets an infinite/NaN gradient
        return mse(m(x), cp.zeros((5, 3), cp.float32)) + fluxpy.sqrt(m[1].bias - m[1].bias).sum()
    with pytest.raises(TrainingDiverged, match=r"the gradient for model\.layers\[1\]\.bias has 3 (NaN|infinite) "
                                               r"entries .* at epoch 1, batch 2") as err:
        train(lambda m, x, bad: loss(m, x) if bad else mse(m(x), cp.zeros((5, 3), cp.float32)), model,
              [(x, False), (x, True)], state, progress=False)
    assert err.value.path == "model.layers[1].bias"
    assert state_bytes(model, state) != before   # batch 1 was applied
    after_first = state_bytes(model, state)
    with pytest.raises(TrainingDiverged, match="loss is nan"):
        train(lambda m, x: mse(m(x), cp.full((5, 3), cp.nan, cp.float32)), model, [(x,)], state, progress=False)
    assert state_bytes(model, state) == after_first


def test_train_on_the_gpu_still_trains():
    import cupy as cp
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    model = fluxpy.gpu(Dense(3, 1, rng=0))
    losses = train(lambda m, x, y: mse(m(x), y), model, [(cp.asarray(x), cp.asarray(y))] * 100,
                   setup(Adam(0.05), model), progress=False, max_loss_ratio=1e3)
    assert losses[-1] < 0.05 * losses[0]


def test_device_mismatches_are_refused_before_any_change():
    import cupy as cp
    model = gpu_mlp()
    state = setup(Adam(), model)
    x = cp.ones((2, 4), cp.float32)
    g, = fluxpy.gradient(lambda m: m(x).sum(), model)
    before = state_bytes(model, state)
    cpu_grad = fluxpy.cpu(g)
    with pytest.raises(TypeError, match=r"update: the gradient for model\.layers\[0\]\.weight is a numpy array .* but "
                                        r"the parameter is a cupy array .*both must be on one device"):
        update(state, model, cpu_grad)
    cpu_state = setup(Adam(), fluxpy.cpu(model))
    with pytest.raises(ValueError, match=r"optimiser state at model\.layers\[0\]\.weight holds a numpy array .* but the "
                                         r"model has a cupy array .*moved or converted after setup"):
        update(cpu_state, model, g)
    assert state_bytes(model, state) == before


def test_clipnorm_on_the_gpu_refuses_before_any_change():
    import cupy as cp
    model = [cp.ones(2, cp.float32), cp.ones(2, cp.float32)]
    state = setup(OptimiserChain(ClipNorm(1.0), Adam(0.1)), model)
    before = state_bytes(model, state)
    with pytest.raises(ValueError, match=r"ClipNorm: the gradient has 2-norm nan.*at model\[1\]; nothing was updated"):
        update(state, model, [cp.ones(2, cp.float32), cp.asarray([np.nan, 0.0], cp.float32)])
    assert state_bytes(model, state) == before


def test_loadstate_checks_values_on_their_device():
    import cupy as cp
    model = fluxpy.gpu({"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)})
    fluxpy.loadstate(model, {"a": np.array([1.0, 2.0]), "b": cp.asarray([3.0, 4.0])})
    np.testing.assert_array_equal(cp.asnumpy(model["a"]), [1.0, 2.0])
    assert isinstance(model["a"], cp.ndarray) and model["a"].dtype == cp.float32
    before = state_bytes(model)
    with pytest.raises(ValueError, match=r"model\.b is float32, but the state holds float64 values such as 1e\+300"):
        fluxpy.loadstate(model, {"a": np.ones(2), "b": cp.asarray([1.0, 1e300])})
    host = {"a": np.zeros(2, np.float32)}
    with pytest.raises(ValueError, match=r"model\.a is float32, but the state holds int64 values such as 16777217"):
        fluxpy.loadstate(host, {"a": cp.asarray([1, 2**24 + 1], cp.int64)})
    assert state_bytes(model) == before and not host["a"].any()


def test_the_finite_check_is_one_kernel_and_finds_every_kind_of_non_finite():
    import cupy as cp
    from fluxpy import kernels
    from fluxpy.optimise import _finite_total, _read_finite
    rng = np.random.default_rng(9)
    arrays = [cp.asarray(rng.standard_normal(n).astype(dt)) for n, dt in
              [(1, np.float32), (1000, np.float32), (4097, np.float64), (0, np.float32), (70000, np.float32)]]
    assert kernels.find("finite_total", arrays[0], arrays) is not None
    assert _read_finite(_finite_total(arrays))
    for k in (0, 1, 2, 4):
        for bad in (np.nan, np.inf, -np.inf):
            a = arrays[k]
            saved = a[-1].copy()
            a[-1] = bad
            assert not _read_finite(_finite_total(arrays)), (k, bad)
            a[-1] = saved
    strided = cp.asarray(rng.standard_normal((40, 30)).astype(np.float32)).T   # a transposed matmul's gradient
    assert kernels.find("finite_total", strided, [strided]) is not None
    assert _read_finite(_finite_total([strided]))
    strided[3, 7] = np.inf
    assert not _read_finite(_finite_total([strided]))
    big = [cp.asarray(rng.standard_normal(3).astype(np.float32)) for _ in range(200)]   # three launches
    assert _read_finite(_finite_total(big))
    big[150][1] = np.nan
    assert not _read_finite(_finite_total(big))
