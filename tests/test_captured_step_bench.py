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


def test_the_profile_sorts_kernels_by_what_they_do():
    import captured_profile as cp_
    names = {"void wgrad_alg0_engine<float, 128>": "conv backward filter",
             "sm80_xmma_dgrad_implicit_gemm_f32f32": "conv backward data",
             "sm80_xmma_fprop_implicit_gemm_f32f32": "conv forward",
             "void cudnn::bn_bw_1C11_kernel_new<float>": "batch norm", "bn_stats": "batch norm",
             "sm80_xmma_gemm_f32f32_f32f32_f32_nt_n": "matmul", "maxpool_bwd": "pooling",
             "fluxpy_adam_many": "optimiser update", "segments_v4": "reductions",
             "cupy_add__float32_float32_float32": "other elementwise"}
    for name, kind in names.items():
        assert cp_.kind_of(name) == kind, name
    kinds = cp_.by_kind({"maxpool_fwd": (10.0, 3.0), "maxpool_bwd": (20.0, 3.0), "fluxpy_adam_many": (9.5, 1.0)})
    assert kinds == {"pooling": (30.0, 6.0), "optimiser update": (9.5, 1.0)}
