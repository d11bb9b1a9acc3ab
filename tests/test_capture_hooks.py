"""A captured step's replay hooks (fluxpy.step): an index check's report raised by one hook does not skip the
optimiser's host bookkeeping in the hooks after it; the first error is raised once all have run."""
import pytest

from fluxpy.step import _run_hooks


def test_every_hook_runs_and_the_first_error_is_raised_after():
    ran = []

    def report():
        ran.append("report")
        raise IndexError("gather: an index in the captured step was out of range (its entry was skipped)")

    def later_report():
        ran.append("later")
        raise ValueError("a second error")
    with pytest.raises(IndexError, match="captured step was out of range"):
        _run_hooks([report, lambda: ran.append("counters"), later_report, lambda: ran.append("scale")])
    assert ran == ["report", "counters", "later", "scale"]


def test_without_an_error_every_hook_runs_in_order():
    ran = []
    _run_hooks([lambda i=i: ran.append(i) for i in range(4)])
    assert ran == [0, 1, 2, 3]
