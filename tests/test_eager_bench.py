"""benchmarks/eager.py: a case runs in its own child processes on the CPU, each child's rounds of both sides are
positive times, the row's figures are the medians and ranges over the children (the ratio taken within each
child), ``--against`` alternates children between two trees and each imports its own, and an unknown network or
a folder without a fluxpy tree is refused by name."""
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import eager  # noqa: E402


def test_the_rows_figures_are_over_the_children():
    children = [{"fluxpy": [30.0, 10.0, 20.0], "torch": [10.0, 10.0, 10.0]},
                {"fluxpy": [40.0], "torch": [10.0]},
                {"fluxpy": [15.0], "torch": [30.0]}]
    row = eager.summarise(children)
    assert row["fluxpy"] == (20.0, 15.0, 40.0) and row["torch"] == (10.0, 10.0, 30.0)
    assert row["ratio"] == (2.0, 0.5, 4.0)   # each child's own ratio: 2, 4, 0.5; not 20 / 10 of the medians alone
    assert row["processes"] == 3
    text = eager.table([dict(model="mnist", batch=2, **row)])
    assert "| mnist | 2 | 3 | 20.0 (15.0-40.0) | 10.0 (10.0-30.0) | **2.00** (0.50-4.00) |" in text


def test_a_case_runs_in_its_children_on_the_cpu(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "eager.json"
    eager.main(["--device", "cpu", "--only", "mnist:2", "--processes", "2", "--steps", "1", "--rounds", "2",
                "--warmup", "1", "--json", str(out)])
    (row,) = json.loads(out.read_text())
    assert row["model"] == "mnist" and row["batch"] == 2 and row["processes"] == 2
    assert len(row["children"]) == 2
    for child in row["children"]:
        assert len(child["fluxpy"]) == len(child["torch"]) == 2
        assert all(t > 0 for t in child["fluxpy"] + child["torch"])
    low, high = row["ratio"][1], row["ratio"][2]
    assert 0 < low <= row["ratio"][0] <= high


def test_an_unknown_network_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        eager.main(["--only", "mnist:2,lenet:2", "--device", "cpu"])
    assert "no network 'lenet'" in capsys.readouterr().err


def test_against_alternates_between_two_trees_each_importing_its_own(tmp_path):
    pytest.importorskip("torch")
    import fluxpy
    other = tmp_path / "other"
    shutil.copytree(Path(fluxpy.__file__).parent, other / "fluxpy", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "eager.json"
    eager.main(["--device", "cpu", "--only", "mnist:2", "--processes", "1", "--steps", "1", "--rounds", "1",
                "--warmup", "0", "--against", str(other), "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["tree"] for r in rows] == ["this", str(other.resolve())]
    assert all(r["processes"] == 1 and r["ratio"][0] > 0 for r in rows)
    text = eager.table(rows)
    assert "| model | batch | fluxpy tree | processes |" in text and f"| mnist | 2 | {other.resolve()} | 1 |" in text


def test_against_refuses_a_folder_without_a_fluxpy_tree(tmp_path, capsys):
    with pytest.raises(SystemExit):
        eager.main(["--device", "cpu", "--only", "mnist:2", "--against", str(tmp_path)])
    assert "--against expects a folder holding a fluxpy tree" in capsys.readouterr().err
