"""benchmarks/cpu_step.py: a tiny run of each network on both sides, and its profile by op (the busiest ops of each
side, ms per step)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cpu_step  # noqa: E402


@pytest.mark.parametrize("model", sorted(cpu_step.MODELS))
def test_a_tiny_run_times_fluxpy_and_profiles_it(model, capsys):
    rows = cpu_step.main(["--model", model, "--batch", "2", "--warmup", "0", "--repeat", "2", "--profile",
                          "--top", "3"])
    assert rows[0][0] == "fluxpy" and 0 < rows[0][2] <= rows[0][1]
    out = capsys.readouterr().out
    assert "| fluxpy |" in out and "Where a step goes" in out
    table = out.split("Where a step goes")[1]
    assert table.count("\n| ") == 1 + 3   # the header and the top 3 of fluxpy's ops


def test_the_profile_names_the_conv_nets_ops_on_both_sides():
    torch = pytest.importorskip("torch")
    import numpy as np
    from fluxpy.data import onehotbatch
    from fluxpy.optimise import Adam, setup
    rng = np.random.default_rng(0)
    model = cpu_step.MODELS["reference"][0](rng)
    x = rng.random((2, 1, 28, 28), dtype=np.float32)
    labels = rng.integers(0, 10, 2)
    state = setup(Adam(1e-3), model)
    ours, wall = cpu_step.fluxpy_profile(lambda: cpu_step.fluxpy_step(model, state, x, onehotbatch(labels, range(10))),
                                         2, 20)
    net, opt = cpu_step.torch_setup(torch, model)
    theirs = cpu_step.torch_profile(torch, lambda: cpu_step.torch_step(torch, net, opt, torch.from_numpy(x),
                                                                        torch.from_numpy(labels)), 2, 40)
    assert {"conv_bias_act", "conv_bias_act_pullback", "maxpool"} <= {name for name, _, _ in ours} and wall > 0
    assert any("conv" in name for name, _, _ in theirs)
    assert all(ms >= 0 and calls > 0 for _, ms, calls in ours + theirs)
