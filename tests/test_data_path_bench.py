"""``benchmarks/data_path.py --smoke``: every case runs on the CPU and the report comes out (the GPU figures come from
running it on a GPU machine)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import data_path  # noqa: E402


def test_smoke_mode_measures_every_case_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "data_path.json"
    rows = data_path.main(["--smoke", "--json", str(out)])
    assert [r["case"] for r in rows] == list(data_path.CASES)
    for r in rows:
        assert r["device"] == "cpu" and r["batch"] == 8 and r["rounds"] == 3
        assert 0 < r["images_per_s_min"] <= r["images_per_s"] <= r["images_per_s_max"]
        assert r["us_per_step"] == pytest.approx(8 / r["images_per_s"] * 1e6)
    assert rows[0]["ratio_to_step"] == 1.0
    printed = capsys.readouterr().out
    assert "| case | images/s (median) | range over rounds | us/step | ratio to step |" in printed
    assert printed.count("\n| train ") == 3
    saved = json.loads(out.read_text())
    assert saved["settings"] == {"batch": 8, "steps": 3, "rounds": 3} and len(saved["rows"]) == 4


def test_the_loader_cases_and_a_bad_case_name():
    rows = data_path.run(batch=4, steps=2, rounds=1, device="cpu", names=("loader prefetch", "loader no prefetch"))
    assert [r["ratio_to_step"] for r in rows] == [None, None]     # no step case to compare with
    with pytest.raises(ValueError, match=r"data_path: unknown cases \['nope'\]"):
        data_path.run(batch=4, steps=2, rounds=1, device="cpu", names=("step", "nope"))


def test_it_runs_as_a_script():
    run = subprocess.run([sys.executable, str(BENCHMARKS / "data_path.py"), "--smoke", "--cases", "step"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| step |" in run.stdout and "device cpu" in run.stdout


def test_it_is_listed_in_run_py():
    import run as run_all
    assert run_all.BENCHMARKS["data_path"] == ["--json", "{json}"]
