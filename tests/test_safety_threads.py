"""Training mode and no_grad are per thread (and per asyncio task): one thread training never switches another's
Dropout/BatchNorm to training, nor does one thread's no_grad turn off another's gradients."""
import asyncio
import threading

import numpy as np

import fluxpy
from fluxpy import gradient, in_gradient, no_grad
from fluxpy.layers import BatchNorm, Chain, Dense, Dropout
from fluxpy.layers.normalise import istraining

TIMEOUT = 20


def run_threads(*targets):
    errors = []

    def guard(f):
        def run():
            try:
                f()
            except BaseException as err:  # noqa: BLE001  (reported below)
                errors.append(err)
        return run
    threads = [threading.Thread(target=guard(f)) for f in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def test_inference_in_one_thread_while_another_is_inside_gradient():
    inside, done = threading.Barrier(2, timeout=TIMEOUT), threading.Barrier(2, timeout=TIMEOUT)
    model = Chain(Dense(4, 8), Dropout(0.5, rng=0), BatchNorm(8))
    x = np.ones((16, 4), np.float32)
    seen = {}

    def trainer():
        def loss(m):
            inside.wait()          # the other thread runs its inference now, while this gradient is open
            done.wait()
            seen["trainer in_gradient"] = in_gradient()
            return m(x).sum()
        seen["grad"], = gradient(loss, model)

    def inferer():
        inside.wait()
        seen["in_gradient"] = in_gradient()
        seen["istraining"] = istraining(x)
        running = model[2].running_mean.copy()
        y1, y2 = model(x), model(x)
        seen["deterministic"] = np.array_equal(y1, y2)                          # Dropout is the identity
        seen["no drops"] = np.array_equal(model[1](x), x)
        seen["stats kept"] = np.array_equal(model[2].running_mean, running)     # BatchNorm used its running stats
        done.wait()
    run_threads(trainer, inferer)
    assert seen["in_gradient"] is False and seen["istraining"] is False
    assert seen["deterministic"] and seen["no drops"] and seen["stats kept"]
    assert seen["trainer in_gradient"] is True
    assert seen["grad"]["layers"][0]["weight"] is not None


def test_no_grad_in_one_thread_does_not_turn_off_another_threads_gradients():
    inside, done = threading.Barrier(2, timeout=TIMEOUT), threading.Barrier(2, timeout=TIMEOUT)
    seen = {}

    def quiet():
        with no_grad():
            inside.wait()      # the other thread takes its gradient while this no_grad is open
            done.wait()
            seen["quiet"] = in_gradient()

    def learner():
        inside.wait()
        seen["g"], = gradient(lambda w: (w * w).sum(), np.array([1.0, 3.0]))
        done.wait()
    run_threads(quiet, learner)
    np.testing.assert_array_equal(seen["g"], [2.0, 6.0])
    assert seen["quiet"] is False


def test_no_grad_holds_in_its_own_thread_during_another_threads_gradient():
    inside, done = threading.Barrier(2, timeout=TIMEOUT), threading.Barrier(2, timeout=TIMEOUT)
    seen = {}

    def learner():
        def f(w):
            inside.wait()
            done.wait()
            return (w * w).sum()
        seen["g"], = gradient(f, np.ones(2))

    def quiet():
        inside.wait()

        def f(w):
            with no_grad():
                y = w * 2
            seen["plain"] = type(y) is np.ndarray
            return (w * y).sum()
        seen["q"], = gradient(f, np.ones(2))
        done.wait()
    run_threads(learner, quiet)
    assert seen["plain"]
    np.testing.assert_array_equal(seen["q"], [2.0, 2.0])
    np.testing.assert_array_equal(seen["g"], [2.0, 2.0])


def test_a_new_thread_starts_outside_gradient_and_no_grad():
    seen = {}

    def child():
        seen["in_gradient"] = in_gradient()
        seen["g"], = gradient(lambda w: (w * 3).sum(), np.ones(1))

    def f(w):
        with no_grad():
            t = threading.Thread(target=child)
            t.start()
            t.join(TIMEOUT)
        return w.sum()
    gradient(f, np.ones(1))
    assert seen["in_gradient"] is False
    np.testing.assert_array_equal(seen["g"], [3.0])


def test_asyncio_tasks_have_their_own_modes():
    async def quiet(started, finish):
        with no_grad():
            started.set()
            await finish.wait()
            return in_gradient()

    async def learner(started, finish):
        await started.wait()
        g, = gradient(lambda w: (w * w).sum(), np.array([2.0]))
        finish.set()
        return g

    async def main():
        started, finish = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(quiet(started, finish), learner(started, finish))
    was_training, g = asyncio.run(main())
    assert was_training is False
    np.testing.assert_array_equal(g, [4.0])


def test_the_modes_are_restored_after_an_error():
    def f(w):
        with no_grad():
            raise RuntimeError("boom")
    try:
        gradient(f, np.ones(1))
    except RuntimeError:
        pass
    assert not in_gradient()
    g, = gradient(lambda w: (w * 2).sum(), np.ones(1))
    np.testing.assert_array_equal(g, [2.0])
    assert fluxpy.autodiff._no_grad_depth.get() == 0 and fluxpy.autodiff._recording.get() == 0
