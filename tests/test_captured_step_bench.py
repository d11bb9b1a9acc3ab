"""``benchmarks/captured_step.py --smoke``: the fluxpy sides run on the CPU (the eager step there), start from the
same weights, and the table comes out (the GPU figures come from the GPU machine)."""
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import captured_step  # noqa: E402


def test_smoke_mode_runs_both_fluxpy_sides_from_the_same_start(tmp_path, capsys):
    out = tmp_path / "rows.json"
    captured_step.main(["--smoke", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["model"], r["batch"]) for r in rows] == [("reference", 4), ("resnet20", 2)]
    for r in rows:
        firsts = r["first_losses"]
        assert firsts["fluxpy eager"] == firsts["fluxpy captured"]
        assert r["fluxpy captured us"] > 0 and r["fluxpy eager us"] > 0
    assert "| reference | 4 |" in capsys.readouterr().out
