"""benchmarks/layer_overhead.py: every case runs both sides on the CPU, each per-call time is positive, the places
split fluxpy's time whole, and a case that does not exist is refused by name."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import layer_overhead  # noqa: E402


def test_every_case_runs_and_its_time_is_split_by_place():
    rows = layer_overhead.run("cpu", depth=2, rounds=1, functions=3)
    assert [r["case"] for r in rows] == list(layer_overhead.CASES) + ["adam"]
    for r in rows:
        median, low, high, issued = r["fluxpy_us"]
        assert 0 < low <= median <= high and 0 < issued <= high
        assert len(r["functions"]) == 3 and all(0 <= share <= 1 and calls > 0 for share, calls, _ in r["functions"])
        assert set(r["places"]) == {p for p, _ in layer_overhead.PLACES} | {"other"}
        assert sum(r["places"].values()) == pytest.approx(1.0)
    assert max(rows, key=lambda r: r["places"]["optimiser"])["case"] == "adam"
    text = layer_overhead.table(rows, "cpu")
    assert text.count("\n| ") == len(rows) + 1 and "| conv |" in text
    assert text.count("fluxpy's functions by own time") == len(rows)


def test_the_pytorch_side_is_measured_where_pytorch_is_installed():
    pytest.importorskip("torch")
    (row,) = layer_overhead.run("cpu", depth=2, rounds=1, only=["dense"])
    assert row["torch_us"][0] > 0
    assert "| dense |" in layer_overhead.table([row], "cpu")


def test_an_unknown_case_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        layer_overhead.main(["--only", "dense,lstm"])
    assert "no case 'lstm'" in capsys.readouterr().err
