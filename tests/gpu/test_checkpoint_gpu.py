"""A training run on the GPU with a captured step, saved with save_training and resumed in a NEW PROCESS with
load_training, continues bit for bit as the run without a stop: a TrainStep (two eager warm-up steps, a capture,
then replays, on each side of the stop) with Dropout (masks drawn on the device: the Philox generator's position is
saved and restored), Adam-family rules (the multi-tensor groups' device counters made again from the loaded host
counters), and float16 mixed precision (the device loss scale, with overflows that skip steps). And
train(capture=True, checkpoint=..., every=...) killed mid-run resumes from its last checkpoint.

cuDNN runs with ``deterministic=True`` (as in test_trainstep_gpu.py), so that eager and replayed steps round alike.
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere). Run as a script
(``python tests/gpu/test_checkpoint_gpu.py MODE ...``) this file is the new process of a test.
"""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":   # the worker: the worktree's fluxpy, as the tests import it
    sys.path.insert(0, str(ROOT))

import fluxpy  # noqa: E402
from fluxpy import DynamicLossScale, TrainStep, mixed_precision  # noqa: E402
from fluxpy.layers import Chain, Dense, Dropout  # noqa: E402
from fluxpy.losses import mse  # noqa: E402
from fluxpy.optimise import AccumGrad, Adam, AdamW, ClipNorm, Momentum, OptimiserChain, RAdam, setup  # noqa: E402

pytestmark = pytest.mark.gpu

RULES = {
    "Adam": lambda: Adam(0.01),
    "AdamW": lambda: AdamW(0.01, lambd=0.01),
    "RAdam": lambda: RAdam(0.01),
    "Momentum": lambda: Momentum(0.05),
    "Chain": lambda: OptimiserChain(ClipNorm(1.0, throw=False), Adam(0.01)),
    "AccumGrad": lambda: OptimiserChain(AccumGrad(4), Adam(0.01)),
}
CASES = [("Adam", "float32", "npz"), ("AdamW", "float32", "safetensors"), ("RAdam", "float32", "npz"),
         ("Chain", "float32", "safetensors"), ("AccumGrad", "float32", "npz"), ("Adam", "float16", "safetensors"),
         ("Momentum", "float16", "npz")]
N = 6   # steps on each side of the stop: 2 eager, 1 captured, 3 replayed


def build(rule, precision):
    """The model on the GPU (Dropout inside; float16: mixed precision with a scale that overflows now and then)
    and its optimiser state, made the same way in every process."""
    fluxpy.seed(3)
    model = Chain(Dense(16, 32, fluxpy.tanh), Dropout(0.3), Dense(32, 4))
    if precision == "float16":
        model = mixed_precision(model, np.float16, loss_scale=DynamicLossScale(init=2.0 ** 16, growth_interval=2))
    model = fluxpy.gpu(model)
    return model, setup(RULES[rule](), model)


def batches(n, start=0):
    import cupy
    rng = np.random.default_rng(21)
    data = [(rng.standard_normal((32, 16)).astype(np.float32), rng.standard_normal((32, 4)).astype(np.float32))
            for _ in range(2 * N + 4)]
    return [(cupy.asarray(x), cupy.asarray(y)) for x, y in data[start:start + n]]


def _loss(m, x, y):
    return mse(m(x), y)


def run_steps(model, opt, data):
    """A captured TrainStep over ``data`` (made here, after any load: its graph holds the state's arrays)."""
    step = TrainStep(_loss, model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fluxpy.CaptureWarning)   # the step must really be captured
        for x, y in data:
            step(x, y)
    assert list(step.captured().values()) == ["captured"], step.captured()


def weights(model):
    return [np.asarray(fluxpy.cpu(a)) for a in fluxpy.io.flat_state(model).values()]


def _path(folder, rule, precision, fmt):
    return os.path.join(folder, f"{rule}-{precision}.{fmt}")


def worker_save(folder):
    for rule, precision, fmt in CASES:
        model, opt = build(rule, precision)
        run_steps(model, opt, batches(N))
        fluxpy.save_training(_path(folder, rule, precision, fmt), model, opt, step=N)


def worker_resume(folder):
    for rule, precision, fmt in CASES:
        model, opt = build(rule, precision)
        fluxpy.seed(999)   # another generator state than the saved one (the GPU's generator included)
        assert fluxpy.load_training(_path(folder, rule, precision, fmt), model, opt) == {"step": N}
        run_steps(model, opt, batches(N, start=N))
        np.savez(os.path.join(folder, f"out-{rule}-{precision}-{fmt}.npz"), *weights(model))


def _run_worker(*args, returncode=0):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == returncode, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume_gpu")
    _run_worker("save", str(folder))
    _run_worker("resume", str(folder))
    return folder


@pytest.fixture(autouse=True)
def _deterministic_cudnn():
    with fluxpy.options(deterministic=True):
        yield


@pytest.mark.parametrize("rule, precision, fmt", CASES)
def test_a_captured_run_resumed_in_a_new_process_is_bit_for_bit_the_run_without_a_stop(resumed, rule, precision,
                                                                                        fmt):
    model, opt = build(rule, precision)
    from resume_checks import assert_resumed_weights
    run_steps(model, opt, batches(2 * N))
    assert_resumed_weights(resumed / f"out-{rule}-{precision}-{fmt}.npz", weights(model))


def test_the_loaded_state_lands_on_the_device_and_the_counters_are_made_again(tmp_path):
    import cupy
    model, opt = build("Adam", "float16")
    run_steps(model, opt, batches(N))
    fluxpy.save_training(tmp_path / "a.safetensors", model, opt, step=N)
    fresh, fresh_opt = build("Adam", "float16")
    fluxpy.load_training(tmp_path / "a.safetensors", fresh, fresh_opt)
    for leaf, saved in zip(fluxpy.optimise.Plan.leaves(fresh_opt), fluxpy.optimise.Plan.leaves(opt)):
        assert isinstance(leaf.state[0], cupy.ndarray) and leaf._counters is None
        assert leaf.state[2] == saved.state[2] and all(type(c) is float for c in leaf.state[2])
        np.testing.assert_array_equal(cupy.asnumpy(leaf.state[0]), cupy.asnumpy(saved.state[0]))
    assert fresh.loss_scale.get_state()["scale"] == model.loss_scale.get_state()["scale"]
    assert fresh.loss_scale.get_state()["good"] == model.loss_scale.get_state()["good"]


@pytest.mark.parametrize("rule, precision", [("Adam", "float32"), ("Adam", "float16"), ("AccumGrad", "float32")])
def test_a_load_into_a_live_captured_step_rolls_it_back(tmp_path, rule, precision):
    """Saved after N steps, N other steps, then loaded into the same model and state under the same TrainStep
    (its graph holds the old device counters: the load makes it capture again): N more steps give the run of 2N."""
    model, opt = build(rule, precision)
    step = TrainStep(_loss, model, opt)
    for x, y in batches(N):
        step(x, y)
    fluxpy.save_training(tmp_path / "a.npz", model, opt, step=N)
    for x, y in batches(N, start=N + 2)[::-1]:   # other steps, to be undone
        step(x, y)
    fluxpy.load_training(tmp_path / "a.npz", model, opt)
    for x, y in batches(N, start=N):
        step(x, y)
    assert list(step.captured().values()) == ["captured"]
    want, want_opt = build(rule, precision)
    run_steps(want, want_opt, batches(2 * N))
    for a, b in zip(weights(model), weights(want)):
        np.testing.assert_array_equal(a, b)


class _Dying:
    """The batches, and the process ends (as if killed) when batch ``kill`` (from 1) is asked for."""

    def __init__(self, data, kill):
        self.data, self.kill = data, kill

    def __len__(self):
        return len(self.data)

    def __iter__(self):
        for i, batch in enumerate(self.data, start=1):
            if i == self.kill:
                os._exit(3)
            yield batch


def worker_train(path, kill):
    model, opt = build("Adam", "float32")
    losses = fluxpy.train(_loss, model, _Dying(batches(2 * N), int(kill)), opt, epochs=2, progress=False,
                          capture=True, checkpoint=path, every=4, resume=True)
    np.savez(path + ".out.npz", *weights(model))
    Path(path + ".losses.json").write_text(json.dumps(losses))


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_train_with_captured_steps_killed_mid_run_resumes_bit_for_bit(tmp_path, fmt):
    path = str(tmp_path / f"run.{fmt}")
    _run_worker("train", path, "10", returncode=3)   # dies asking for batch 10: steps 4 and 8 were saved
    _run_worker("train", path, "0")
    model, opt = build("Adam", "float32")
    want = fluxpy.train(_loss, model, batches(2 * N), opt, epochs=2, progress=False, capture=True)
    assert json.loads(Path(path + ".losses.json").read_text()) == want[8:]
    with np.load(path + ".out.npz") as saved:
        for i, b in enumerate(weights(model)):
            np.testing.assert_array_equal(saved[f"arr_{i}"], b)


if __name__ == "__main__":
    from fluxpy.kernels import gpu
    assert gpu.register(), "needs CuPy"
    mode, *rest = sys.argv[1:]
    with fluxpy.options(deterministic=True):
        {"save": worker_save, "resume": worker_resume, "train": worker_train}[mode](*rest)
