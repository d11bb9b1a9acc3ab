"""A training run saved with save_training after N steps and resumed in a NEW PROCESS with load_training gives, after N
more steps, the weights of 2N steps without a stop, bit for bit: for every rule family (state arrays and Python
counters), a chain, AccumGrad (a counter mid-cycle), with Dropout in the model (the random generator's state), in
float32 and under float16 mixed precision (the dynamic loss scale's state), in both formats. The same through
train(checkpoint=..., resume=True), with the first process killed mid-run.

Run as a script (``python tests/test_checkpoint_resume.py MODE PATH...``) it is the new process of a test.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":   # the worker: the worktree's fluxpy, as the tests import it
    sys.path.insert(0, str(ROOT))

import fluxpy  # noqa: E402
from fluxpy.layers import Chain, Dense, Dropout  # noqa: E402
from fluxpy.losses import mse  # noqa: E402
from fluxpy.optimise import (AccumGrad, AdaBelief, Adam, AdamW, ClipNorm, Descent, Lion, Momentum, Nesterov,  # noqa
                             OAdam, OptimiserChain, RAdam, setup)

RULES = {
    "Descent": lambda: Descent(0.05),
    "Momentum": lambda: Momentum(0.05),
    "Nesterov": lambda: Nesterov(0.05),
    "Adam": lambda: Adam(0.01),
    "AdamW": lambda: AdamW(0.01, lambd=0.01),
    "RAdam": lambda: RAdam(0.01),
    "OAdam": lambda: OAdam(0.01),
    "AdaBelief": lambda: AdaBelief(0.01),
    "Lion": lambda: Lion(0.001),
    "Chain": lambda: OptimiserChain(ClipNorm(1.0, throw=False), Adam(0.01)),   # throw: a float16 overflow raises
    "AccumGrad": lambda: OptimiserChain(AccumGrad(3), Adam(0.01)),
}
PRECISIONS = ("float32", "float16")
FORMATS = ("npz", "safetensors")
N = 4   # steps before the stop and after it (AccumGrad(3): the stop falls mid-cycle)


def build(rule, precision):
    """The model (Dropout inside; float16: mixed precision with a dynamic loss scale) and its
    optimiser state, made the same way in every process."""
    fluxpy.seed(7)
    model = Chain(Dense(3, 16, fluxpy.tanh), Dropout(0.3), Dense(16, 2))
    if precision == "float16":
        # a scale that overflows the float16 gradients now and then (steps 3 and 6 are skipped): the resumed run
        # skips the same steps only if its scale and count of good steps are the saved ones
        model = fluxpy.mixed_precision(model, np.float16, loss_scale=fluxpy.DynamicLossScale(init=2.0 ** 16,
                                                                                             growth_interval=2))
    return model, setup(RULES[rule](), model)


def batches(n, start=0):
    rng = np.random.default_rng(11)
    data = [(rng.standard_normal((8, 3)).astype(np.float32), rng.standard_normal((8, 2)).astype(np.float32))
            for _ in range(2 * N + 8)]
    return data[start:start + n]


def steps(model, opt, data):
    for x, y in data:
        with np.errstate(over="ignore", invalid="ignore"):   # the float16 overflows the loss scale skips
            _step(model, opt, x, y)


def _step(model, opt, x, y):
    (g,) = fluxpy.gradient(lambda m: mse(m(x), y), model)
    fluxpy.update(opt, model, g)


def weights(model):
    return [np.asarray(a) for a in fluxpy.trainables(model)]


def cases():
    return [(r, p, f) for r in RULES for p in PRECISIONS for f in FORMATS]


def _case_path(folder, rule, precision, fmt):
    return os.path.join(folder, f"{rule}-{precision}.{fmt}")


def worker_save(folder):
    """N steps of every case, each saved."""
    for rule, precision, fmt in cases():
        model, opt = build(rule, precision)
        steps(model, opt, batches(N))
        fluxpy.save_training(_case_path(folder, rule, precision, fmt), model, opt, step=N)


def worker_resume(folder):
    """Every case loaded into a fresh model and state, N more steps, the weights written to a .npz per case."""
    for rule, precision, fmt in cases():
        model, opt = build(rule, precision)
        fluxpy.seed(12345)   # another generator state than the saved one: the load must restore it
        info = fluxpy.load_training(_case_path(folder, rule, precision, fmt), model, opt)
        assert info == {"step": N}, info
        steps(model, opt, batches(N, start=info["step"]))
        np.savez(os.path.join(folder, f"out-{rule}-{precision}-{fmt}.npz"), *weights(model))


def _run_worker(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The folder where one process saved every case after N steps and another resumed each for N more."""
    folder = tmp_path_factory.mktemp("resume")
    _run_worker("save", str(folder))
    _run_worker("resume", str(folder))
    return folder


@pytest.mark.parametrize("rule, precision, fmt", cases())
def test_resumed_in_a_new_process_is_bit_for_bit_the_run_without_a_stop(resumed, rule, precision, fmt):
    model, opt = build(rule, precision)
    from resume_checks import assert_resumed_weights
    steps(model, opt, batches(2 * N))
    assert_resumed_weights(resumed / f"out-{rule}-{precision}-{fmt}.npz", weights(model))


def test_a_resume_that_skips_the_load_differs(tmp_path):
    """The check above can fail: a fresh state with the saved model alone (moments, counters, masks lost)
    gives other weights."""
    model, opt = build("Adam", "float32")
    steps(model, opt, batches(2 * N))
    other, other_opt = build("Adam", "float32")
    steps(other, other_opt, batches(N))
    fluxpy.save(tmp_path / "m.npz", other)
    fresh, fresh_opt = build("Adam", "float32")
    fluxpy.load(tmp_path / "m.npz", fresh)
    steps(fresh, fresh_opt, batches(N, start=N))
    assert any(not np.array_equal(a, b) for a, b in zip(weights(fresh), weights(model)))


# ---------------------------------------------------------------------------------------------
# train(checkpoint=..., every=..., resume=True), the first process killed


def _loss(m, x, y):
    return mse(m(x), y)


def worker_train(path, kill_at):
    """train over 3 epochs of the batches, saving every 3 steps; the process dies (os._exit) in step kill_at."""
    model, opt = build("Adam", "float32")
    count = [0]

    def loss(m, x, y):
        count[0] += 1
        if count[0] == int(kill_at):
            os._exit(3)
        return _loss(m, x, y)
    losses = fluxpy.train(loss, model, batches(5), opt, epochs=3, progress=False, checkpoint=path, every=3,
                          resume=True, schedule=lambda t: 0.01 / t, schedule_per="step")
    np.savez(path + ".out.npz", *weights(model))
    Path(path + ".losses.json").write_text(json.dumps(losses))


@pytest.mark.parametrize("fmt", FORMATS)
def test_train_killed_mid_run_resumes_from_its_last_checkpoint(tmp_path, fmt):
    path = str(tmp_path / f"run.{fmt}")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    killed = subprocess.run([sys.executable, __file__, "train", path, "8"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode == 3, killed.stderr[-3000:]
    assert fluxpy.load_training(path, *build("Adam", "float32"))["step"] == 6   # saved at steps 3 and 6
    _run_worker("train", path, "0")   # the same script again: resumes at step 7
    model, opt = build("Adam", "float32")
    want = fluxpy.train(_loss, model, batches(5), opt, epochs=3, progress=False, schedule=lambda t: 0.01 / t,
                        schedule_per="step")
    got = json.loads(Path(path + ".losses.json").read_text())
    assert got == want[6:]
    with np.load(path + ".out.npz") as saved:
        for i, b in enumerate(weights(model)):
            np.testing.assert_array_equal(saved[f"arr_{i}"], b)
    assert fluxpy.load_training(path, *build("Adam", "float32")) == {"step": 15, "epoch": 3, "batch": 5}


def test_train_saves_at_each_epoch_end_by_default_and_resumes_a_finished_run_as_done(tmp_path):
    path = tmp_path / "run.npz"
    model, opt = build("Momentum", "float32")
    fluxpy.train(_loss, model, batches(4), opt, epochs=2, progress=False, checkpoint=path)
    assert fluxpy.load_training(path, *build("Momentum", "float32"))["step"] == 8
    again, again_opt = build("Momentum", "float32")
    assert fluxpy.train(_loss, again, batches(4), again_opt, epochs=2, progress=False, checkpoint=path,
                        resume=True) == []
    for a, b in zip(weights(again), weights(model)):
        np.testing.assert_array_equal(a, b)
    shorter, shorter_opt = build("Momentum", "float32")   # a call of fewer steps than the file's: nothing to do
    assert fluxpy.train(_loss, shorter, batches(4), shorter_opt, progress=False, checkpoint=path, resume=True) == []
    assert fluxpy.load_training(path, *build("Momentum", "float32"))["step"] == 8   # not overwritten


def test_train_checkpoint_arguments_are_checked_before_any_step(tmp_path):
    model, opt = build("Adam", "float32")
    before = weights(model)
    for kwargs, error, match in [({"every": 2}, ValueError, "need checkpoint=path"),
                                 ({"resume": True}, ValueError, "need checkpoint=path"),
                                 ({"checkpoint": 3}, TypeError, "checkpoint must be a file path"),
                                 ({"checkpoint": tmp_path / "c.npz", "every": 0}, ValueError, "every must be"),
                                 ({"checkpoint": tmp_path / "c.npz", "resume": 1}, TypeError, "resume must be")]:
        with pytest.raises(error, match=match):
            fluxpy.train(_loss, model, batches(2), opt, progress=False, **kwargs)
    for a, b in zip(weights(model), before):
        np.testing.assert_array_equal(a, b)
    assert not (tmp_path / "c.npz").exists()


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    {"save": worker_save, "resume": worker_resume, "train": worker_train}[mode](*rest)
