"""train's captured steps read one step late (fluxpy.train._Lagged), on a stand-in for the GPU's CheckedStep.

The stand-in keeps CheckedStep's contract: a replay whose loss is bad, or any replay after it until
``clear_trip``, skips its update "on the device" and returns a flag that is not finite. The log shows what ran
on the host and in which order; the real step is checked on the GPU in tests/gpu/test_trainstep_gpu.py.
"""
import math

import pytest

from fluxpy.backend import start_reading_scalars
from fluxpy.step import Flight
from fluxpy.train import _Lagged


class _StandIn:
    def __init__(self, bad=(), eager_only=(), loss_scaled=False):
        self.bad, self.eager_only, self.tripped, self.log = set(bad), set(eager_only), False, []
        self.loss_scaled = loss_scaled   # bad steps are then overflows: skipped, not errors

    def replay(self, n):
        if n in self.eager_only:
            return None
        skipped = n in self.bad or self.tripped
        self.tripped = skipped
        self.log.append(("skip" if skipped else "apply", n))
        return Flight(start_reading_scalars(float(n), math.nan if skipped else 0.0,
                                            math.nan if n in self.bad else 0.0),
                      lambda: self.log.append(("commit", n)), lambda: self.log.append(("undo", n)))

    def run(self, n):
        return None   # a warm-up: train steps it eagerly

    def clear_trip(self):
        self.log.append(("clear",))
        self.tripped = False


def _driver(stand_in, really_bad=()):
    def eager(args, batch_number):
        stand_in.log.append(("eager", args[0]))
        if args[0] in really_bad:
            raise FloatingPointError(f"batch {batch_number}")
        return float(args[0]) + 0.5
    return _Lagged(stand_in, eager)


def _train(lagged, batches):
    losses = []
    for n in batches:
        losses += lagged.step((n,), n)
    return losses + lagged.finish()


def test_each_loss_is_read_after_the_next_step_was_launched():
    s = _StandIn()
    assert _train(_driver(s), [1, 2, 3]) == [1.0, 2.0, 3.0]
    assert s.log == [("apply", 1), ("apply", 2), ("commit", 1), ("apply", 3), ("commit", 2), ("commit", 3)]


def test_a_bad_step_and_the_one_launched_after_it_are_undone_and_run_again_eagerly_where_train_raises():
    s = _StandIn(bad={3})
    with pytest.raises(FloatingPointError, match="batch 3"):
        _train(_driver(s, really_bad={3}), [1, 2, 3, 4, 5])
    assert s.log == [("apply", 1), ("apply", 2), ("commit", 1), ("skip", 3), ("commit", 2), ("skip", 4),
                     ("clear",), ("undo", 4), ("undo", 3), ("eager", 3)]


def test_a_step_skipped_by_a_bad_step_that_runs_well_eagerly_continues_the_epoch_in_order():
    s = _StandIn(bad={2})   # a flag the eager rerun does not see again: both steps are run eagerly, then replays
    assert _train(_driver(s), [1, 2, 3, 4]) == [1.0, 2.5, 3.5, 4.0]
    assert s.log == [("apply", 1), ("skip", 2), ("commit", 1), ("skip", 3), ("clear",), ("undo", 3), ("undo", 2),
                     ("eager", 2), ("eager", 3), ("apply", 4), ("commit", 4)]


def test_a_batch_that_is_not_replayed_waits_for_the_step_in_flight():
    s = _StandIn(eager_only={3})
    assert _train(_driver(s), [1, 2, 3, 4]) == [1.0, 2.0, 3.5, 4.0]
    assert s.log == [("apply", 1), ("apply", 2), ("commit", 1), ("commit", 2), ("eager", 3), ("apply", 4),
                     ("commit", 4)]


@pytest.mark.parametrize("bad, then", [((), [("commit", 2)]), ({2}, [("undo", 2), ("clear",)])])
def test_after_an_exception_the_step_in_flight_is_committed_or_undone_without_a_rerun(bad, then):
    s = _StandIn(bad=bad)
    lagged = _driver(s)
    lagged.step((1,), 1)
    lagged.step((2,), 2)   # step 1 read, step 2 in flight when the loop stops
    del s.log[:]
    lagged.abandon()
    assert s.log == then and lagged.flying is None


def test_a_loss_scaled_overflow_is_skipped_and_the_step_after_it_run_again_eagerly():
    s = _StandIn(bad={2}, loss_scaled=True)
    assert _train(_driver(s), [1, 2, 3, 4]) == [1.0, 2.0, 3.5, 4.0]   # 2's loss kept, no rerun; 3 rerun eagerly
    assert s.log == [("apply", 1), ("skip", 2), ("commit", 1), ("skip", 3), ("clear",), ("undo", 3), ("undo", 2),
                     ("eager", 3), ("apply", 4), ("commit", 4)]


def test_train_keeps_one_checked_step_per_model_while_nothing_it_captured_changed():
    import gc
    import weakref

    import numpy as np

    from fluxpy.layers import Dense
    from fluxpy.optimise import Adam, setup
    from fluxpy.train import _checked_step

    def loss(m, x):
        return (m(x) ** 2).sum()
    model = Dense(2, 2, rng=0)
    opt = setup(Adam(), model)
    first = _checked_step(loss, model, opt, True)
    assert _checked_step(loss, model, opt, True) is first                # the next train call reuses it
    assert _checked_step(loss, model, opt, False) is not first           # another check: another graph
    again = _checked_step(loss, model, opt, True)
    model.bias = np.zeros(2, np.float32)                                 # a new array: the old graph writes the old
    assert _checked_step(loss, model, opt, True) is not again
    assert _checked_step(lambda m, x: loss(m, x), model, opt, True) is not again   # another loss
    dict_model = {"w": np.ones(2, np.float32)}                           # no weak reference: a new step per call
    assert _checked_step(loss, dict_model, setup(Adam(), dict_model), True) is not \
        _checked_step(loss, dict_model, setup(Adam(), dict_model), True)
    step = _checked_step(loss, model, opt, True)
    assert step.model is model
    alive = weakref.ref(model)
    del model, step, first, again
    gc.collect()
    assert alive() is None                                               # the cache does not keep a model alive
