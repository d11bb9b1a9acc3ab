"""``benchmarks/recurrent.py --device cpu``: the driver runs every column on NumPy and PyTorch's CPU kernels and
writes its rows (the GPU figures come from running it on a GPU machine)."""
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


def test_the_cpu_run_writes_every_row(tmp_path, capsys):
    pytest.importorskip("torch")
    import recurrent
    from fluxpy import kernels
    before = kernels.snapshot()
    out = tmp_path / "recurrent.json"
    recurrent.main(["--device", "cpu", "--cells", "lstm,gru", "--sizes", "2x3x4x5", "--reps", "1", "--rounds", "3",
                    "--json", str(out)])
    assert kernels.snapshot() == before          # the unfused column put the table back
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["op"]) for r in rows] == [(f"{c} N2 T3 in4 H5 float32", op) for c in ("lstm", "gru")
                                                    for op in ("fwd", "fwd+bwd")]
    for r in rows:
        for key in ("fluxpy_ms", "unfused_ms", "torch_ms", "torch_native_ms"):
            median, low, high = r[key]
            assert 0 < low <= median <= high
        assert r["captured_ms"] is None and r["fluxpy_us"] == pytest.approx(r["fluxpy_ms"][0] * 1e3)
    assert "fused gain" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        recurrent.main(["--device", "cpu", "--rounds", "2"])


def test_it_is_listed_in_run_py():
    import run as run_all
    assert run_all.BENCHMARKS["recurrent"] == ["--json", "{json}"]
