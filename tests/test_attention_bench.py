"""``benchmarks/attention.py`` without a GPU: the shapes, the two sides' calls (the same gradients from fluxpy and
PyTorch on the CPU, causal or not), the timing rounds, the rows and the table."""
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import attention  # noqa: E402


def test_the_shapes_are_the_issue_s_and_parse_from_the_command_line():
    assert [(s.n, s.heads, s.length, s.d, s.causal) for s in attention.SHAPES] == [
        (256, 3, 64, 64, False), (8, 12, 1024, 64, True), (32, 8, 512, 64, False)]
    assert attention.parse_shapes("4x2x16x8c, ,1x1x3x5") == [attention.Shape(4, 2, 16, 8, True),
                                                           attention.Shape(1, 1, 3, 5)]
    for bad in ("4x2x16", "4x2x0x8", "4x2xAx8"):
        with pytest.raises(ValueError, match="a shape is NxHEADSxLxD of positive ints"):
            attention.parse_shapes(bad)
    with pytest.raises(SystemExit):
        attention.main(["--shapes", "4x2"])
    with pytest.raises(SystemExit):
        attention.main(["--rounds", "2"])
    with pytest.raises(SystemExit):
        attention.main(["--dtypes", "float16"])


@pytest.mark.parametrize("causal", [False, True])
def test_both_sides_compute_the_same_gradients(causal):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 16)))
    heads = int(rng.integers(1, 4))
    shape = attention.Shape(int(rng.integers(1, 4)), heads, int(rng.integers(2, 9)), int(rng.integers(1, 6)),
                            causal)
    arrays = attention.inputs(shape, "float32", seed=int(rng.integers(1000)))
    assert all(a.shape == (shape.n, shape.length, shape.features) for a in arrays)
    ours = attention.fluxpy_call(shape, arrays)()
    theirs = attention.torch_call(torch, shape, attention.torch_tensors(torch, arrays, "float32", "cpu"))()
    assert len(ours) == len(theirs) == 3
    assert attention.max_rel_diff(ours, [t.numpy() for t in theirs]) < 1e-5
    first_dq = np.abs(ours[0][:, 0]).max()   # causal: the first query sees one key, so its softmax is constant
    assert first_dq == 0 if causal else first_dq > 0


def test_bfloat16_inputs_are_rounded_to_it():
    arrays = attention.inputs(attention.Shape(2, 1, 3, 4), "bfloat16")
    for a in arrays:
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, a.astype(attention.BFLOAT16).astype(np.float32))
    assert len({a.tobytes() for a in arrays}) == 4   # four draws, never one array


class FakeClock:
    """Events are the count of calls so far; a call takes ``us`` microseconds of GPU time."""

    def __init__(self, us):
        self.us, self.calls = us, 0

    def record(self):
        return self.calls

    def ms(self, start, end):
        return (end - start) * self.us / 1e3


def test_timing_rounds_give_gpu_time_per_call_and_host_time():
    us = random.Random(3).uniform(10, 500)
    clock = FakeClock(us)

    def run():
        clock.calls += 1
    stats = attention.timed(run, clock, calls=7, rounds=4, warmup=2)
    assert clock.calls == 2 + 4 * 7
    assert stats["median"] == pytest.approx(us) and stats["min"] == pytest.approx(us)
    assert len(stats["rounds_us"]) == 4 and len(stats["host"]["rounds_us"]) == 4 and stats["host"]["median"] > 0


def test_the_table_gives_the_ratio_and_lists_the_failures():
    rng = random.Random(4)
    times = [attention.stats([rng.uniform(50, 500) for _ in range(3)]) for _ in range(3)]
    rows = [attention.finish_row(dict(shape="(8, 12, 1024, 64) causal", causal=True, dtype="bfloat16", mode="eager",
                                      fluxpy=times[0], torch=times[1], max_rel_diff=2.5e-3)),
            attention.finish_row(dict(shape="(8, 12, 1024, 64) causal", causal=True, dtype="bfloat16",
                                      mode="captured", fluxpy=dict(error="CaptureUnsupported: cuBLAS"),
                                      torch=times[2], max_rel_diff=None))]
    assert rows[0]["ratio"] == pytest.approx(times[0]["median"] / times[1]["median"]) and rows[1]["ratio"] is None
    assert rows[0]["fluxpy_us"] == times[0]["median"] and rows[1]["torch_us"] == times[2]["median"]
    text = attention.table(rows)
    lines = text.splitlines()
    assert lines[:2] == attention.HEADER
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:3] == ["(8, 12, 1024, 64) causal", "bfloat16", "eager"]
    assert cells[5] == f"{rows[0]['ratio']:.2f}" and cells[6] == "2.5e-03"
    assert "| failed |" in lines[3] and "- (8, 12, 1024, 64) causal bfloat16 captured, fluxpy: CaptureUnsupported: " \
        "cuBLAS" in text
    assert attention.table(rows[:1], header=False) == lines[2]


def test_the_docstring_examples_run():
    import doctest
    failures, tried = doctest.testmod(attention)
    assert failures == 0 and tried >= 4
