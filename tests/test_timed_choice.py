"""``compiler.timed_choice``: of the implementations within 10% of the fastest GPU time, the one fastest back to
back is kept (one choice for eager and captured steps alike); the others are not timed back to back. The clock is
a stand-in: each run says which implementation it is, the stand-in answers that one's time."""
import pytest

from fluxpy.kernels import compiler

GPU = {"a": 10.0, "b": 10.8, "c": 30.0}
WALL = {"a": 40.0, "b": 25.0, "c": 5.0}


@pytest.fixture()
def clock(monkeypatch):
    asked = []

    def time_ms(run, reps=5, failures=(), hide_host=False):
        name = run()
        asked.append((name, hide_host))
        return (GPU if hide_host else WALL)[name]
    monkeypatch.setattr(compiler, "time_ms", time_ms)
    return asked


def test_the_fastest_back_to_back_near_the_fastest_gpu_time_is_kept(clock):
    timed = compiler.timed_choice({name: (lambda name=name: name) for name in GPU})
    assert timed.kept == "b"   # c is fastest back to back but three times a's GPU time
    assert timed.gpu_ms == GPU and set(timed.wall_ms) == {"a", "b"}
    assert ("c", False) not in clock


def test_an_implementation_far_slower_on_the_gpu_is_never_kept(clock):
    GPU_ONLY = {"a": 10.0, "c": 30.0}
    timed = compiler.timed_choice({name: (lambda name=name: name) for name in GPU_ONLY})
    assert timed.kept == "a"
