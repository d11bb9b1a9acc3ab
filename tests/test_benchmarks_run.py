"""``benchmarks/run.py``'s tables for BENCHMARKS.md, from made-up rows (no GPU: the run itself is the GPU
machine's). Each table comes out in the file's format, with medians, ranges and ratios, and lands between its
markers without touching the text around it."""
import random
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import run  # noqa: E402


def _table_lines(text):
    return [line for line in text.splitlines() if line.startswith("|")]


def _cells(line):
    return [c.strip() for c in line.strip("|").split("|")]


def test_every_benchmark_run_py_runs_has_a_table():
    assert set(run.BENCHMARKS) <= set(run.TABLES)


def test_a_row_with_rounds_gives_median_and_range_and_the_ratio_of_medians():
    rng = random.Random(3)
    ours, theirs = rng.uniform(100, 900), rng.uniform(100, 900)
    row = {"model": "reference", "batch": 128, "fluxpy captured us": ours, "fluxpy captured p10": ours * 0.9,
           "fluxpy captured p90": ours * 1.1, "torch graph us": theirs, "fluxpy eager us": 3 * ours,
           "torch eager us": 2 * theirs}
    text = run.bench_table("captured_step", [row], "NVIDIA Test GPU", "2026-01-02", "run.py --only captured_step")
    assert text.startswith("NVIDIA Test GPU, 2026-01-02, `run.py --only captured_step`")
    header, align, line = _table_lines(text)
    assert _cells(header)[:3] == ["model", "batch", "fluxpy captured us"]
    assert _cells(align)[:2] == ["---", "---"] and set(_cells(align)[2:]) == {"---:"}
    cells = dict(zip(_cells(header), _cells(line)))
    assert cells["fluxpy captured us"] == f"{ours:.1f} ({ours * 0.9:.1f}-{ours * 1.1:.1f})"
    assert cells["PyTorch graph us"] == f"{theirs:.1f}"
    assert cells["captured / PyTorch graph"] == f"{ours / theirs:.2f}"


def test_triples_dicts_pairs_and_nested_fields():
    rng = random.Random(5)
    lo, mid, hi = sorted(rng.uniform(1, 50) for _ in range(3))
    scatter = {"case": "one element", "op": "gather", "fluxpy_us": [mid, lo, hi], "fluxpy_deferred_us": [mid, lo, hi],
               "torch_us": [2 * mid, 2 * lo, 2 * hi], "ratio_deferred": 0.5, "fluxpy_gpu_us": 2.0, "torch_gpu_us": 4.0}
    cells = dict(zip(*map(_cells, _table_lines(run.bench_table("scatter", {"rows": [scatter]}, "g", "d", "c"))[::2])))
    assert cells["fluxpy us"] == f"{mid:.1f} ({lo:.1f}-{hi:.1f})"
    assert cells["GPU ratio"] == "0.50"
    elementwise = {"case": "bias_act relu fwd", "shape": "(128, 10) + (10,)", "fused": [mid, 99.0], "torch": [hi, 1.0]}
    cells = dict(zip(*map(_cells, _table_lines(run.bench_table("elementwise", {"rows": [elementwise]}, "g", "d",
                                                               "c"))[::2])))
    assert cells["fluxpy us"] == f"{mid:.1f}" and cells["fluxpy / PyTorch"] == f"{mid / hi:.2f}"
    layer = {"dtype": "float16", "length": 768, "bwd_kernel": "ln_bwd1 VW4 TPR64",
             "hbm": {"fluxpy_fwd_us": mid, "fwd_share": 0.912, "fluxpy_bwd_us": hi, "bwd_share": 0.8,
                     "both_ratio": 0.4}, "warm": {"fwd_share": 0.7, "bwd_share": 0.55}}
    cells = dict(zip(*map(_cells, _table_lines(run.bench_table("layernorm", [layer], "g", "d", "c"))[::2])))
    assert cells["backward"] == "ln_bwd1"
    assert cells["fwd % copy"] == "91%" and cells["bwd % copy, warm"] == "55%"


def test_the_conv_table_has_one_line_a_layer_and_columns_a_direction():
    rng = random.Random(7)
    rows = []
    for layer in ("mnist1", "r50 64>64 3x3 56 N8"):
        for kind in ("fwd", "bwd_data", "bwd_filter", "bias_mr"):
            ours, theirs = rng.uniform(10, 90), rng.uniform(10, 90)
            rows.append(dict(layer=layer, row=kind, fluxpy_us=ours, torch_us=theirs, ratio=ours / theirs,
                             dtype="float32"))
    lines = _table_lines(run.bench_table("conv", {"rows": rows}, "g", "d", "c"))
    header = _cells(lines[0])
    assert header == ["dtype", "layer", "fwd us", "fwd ratio", "bwd_data us", "bwd_data ratio", "bwd_filter us",
                      "bwd_filter ratio"]
    assert len(lines) == 2 + 2
    first = dict(zip(header, _cells(lines[2])))
    assert first["layer"] == "mnist1" and first["bwd_data ratio"] == f"{rows[1]['ratio']:.2f}"


def test_columns_no_row_has_are_left_out_and_a_missing_value_is_a_dash():
    rows = [{"model": "lenet5", "batch": 128, "fluxpy_us": 1500.0, "torch_us": 1600.0, "ratio": 1500 / 1600},
            {"model": "reference", "batch": 1024, "fluxpy_us": 1200.0, "ratio": None}]
    lines = _table_lines(run.bench_table("train_step", rows, "g", "d", "c"))
    assert _cells(lines[0]) == ["model", "batch", "fluxpy us", "PyTorch eager us", "fluxpy / PyTorch eager"]
    assert _cells(lines[2]) == ["lenet5", "128", "1,500", "1,600", "0.94"]
    assert _cells(lines[3]) == ["reference", "1024", "1,200", "-", "-"]
    assert run.bench_table("train_step", [], "g", "d", "c") is None


def test_a_benchmark_without_a_table_gives_its_fluxpy_pytorch_pairs():
    rows = [{"case": "a", "fluxpy_us": 2.0, "torch_us": 4.0}]
    lines = _table_lines(run.bench_table("not_in_tables", rows, "g", "d", "c"))
    assert _cells(lines[2]) == ["a", "2.0", "4.0", "0.50"]


def test_write_tables_replaces_only_the_marked_sections(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    head = "# Benchmarks\n\nText that stays.\n\n## reduce\n\nWhat it times.\n\n"
    between = "\n\n## conv\n\nMore text.\n\n"
    path.write_text(head + "<!-- table reduce -->\nold reduce\n<!-- /table reduce -->" + between
                    + "<!-- table conv -->\nold conv\n<!-- /table conv -->\n\n## Measured and not taken\n\n- x\n")
    replaced = run.write_tables(path, {"conv": "| new conv |", "recurrent": "| new recurrent |"})
    assert replaced == ["conv"]
    text = path.read_text()
    assert text.startswith(head + "<!-- table reduce -->\nold reduce\n<!-- /table reduce -->" + between)
    assert "<!-- table conv -->\n| new conv |\n<!-- /table conv -->\n\n## Measured and not taken" in text
    assert "old conv" not in text
    assert text.endswith("## recurrent\n\n<!-- table recurrent -->\n| new recurrent |\n<!-- /table recurrent -->\n")
    assert run.write_tables(path, {"recurrent": "| again |"}) == ["recurrent"]
    assert path.read_text().count("<!-- table recurrent -->") == 1


def test_write_run_names_the_gpu_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "gpu_name", lambda: "NVIDIA Fake")
    path = tmp_path / "B.md"
    path.write_text("<!-- table overhead -->\n<!-- /table overhead -->\n")
    row = {"op": "add", "numpy_us": 0.7, "record_us": 3.1, "tape_us": 2.4, "backward_us": 0.8, "torch_record_us": 2.0}
    run.write_run(path, {"overhead": [row], "conv": None}, quick=True)
    text = path.read_text()
    assert "NVIDIA Fake, " in text and "`PYTHONPATH=. python3 benchmarks/run.py --only overhead --quick`" in text
    assert "| add | 0.70 | 3.10 | 2.40 | 0.80 | 2.00 |" in text
    assert "table conv" not in text


def test_the_repository_benchmarks_file_has_markers_for_every_table():
    text = (BENCHMARKS.parent / "BENCHMARKS.md").read_text()
    for name in run.BENCHMARKS:
        begin, end = text.find(run.BEGIN.format(name)), text.find(run.END.format(name))
        assert 0 <= begin < end, name
