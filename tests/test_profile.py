"""fluxpy.profile: per-op exclusive times and the printed table."""
import numpy as np

import fluxpy


def test_profile_counts_each_op_and_pullback_once(capsys):
    x = np.random.default_rng(0).standard_normal((4, 3))
    with fluxpy.profile(gpu=False) as prof:
        fluxpy.gradient(lambda x: (np.tanh(x) * 2.0).sum(), x)
    rows = {r.name: r for r in prof.rows()}
    assert rows["tanh"].calls == 1 and rows["tanh_pullback"].calls == 1
    assert rows["multiply"].calls == 1 and rows["sum"].calls == 1
    assert all(r.host_s >= 0 for r in rows.values())
    assert sum(r.host_s for r in rows.values()) <= prof.wall_s
    out = capsys.readouterr().out
    assert "| tanh | 1 |" in out and "step: wall" in out


def test_profile_restores_the_fast_path():
    call = fluxpy.Primitive.__call__
    with fluxpy.profile(gpu=False, print_table=False):
        assert fluxpy.Primitive.__call__ is not call
    assert fluxpy.Primitive.__call__ is call
    assert fluxpy.autodiff._pullback_hook is None


def test_profile_of_a_model_step_names_conv_ops():
    m = fluxpy.Chain(fluxpy.Conv((3, 3), 1, 4, fluxpy.relu, pad=1), fluxpy.MaxPool((2, 2)), fluxpy.flatten,
                     fluxpy.Dense(4 * 4 * 4, 3))
    x = np.random.default_rng(1).random((2, 1, 8, 8)).astype(np.float32)
    y = fluxpy.onehotbatch([0, 2], range(3))
    with fluxpy.profile(gpu=False, print_table=False) as prof:
        fluxpy.gradient(lambda m: fluxpy.logitcrossentropy(m(x), y), m)
    names = {r.name for r in prof.rows()}
    # the CPU's conv gradients are one kernel, inside the conv's pullback (on the GPU: two more rows)
    assert {"conv_bias_act", "conv_bias_act_pullback", "maxpool", "maxpool_backward", "logit_crossentropy_rows"} <= names
    assert "| conv_bias_act_pullback |" in prof.table()


def test_profile_gpu_true_without_a_gpu_says_why(monkeypatch):
    import sys

    import pytest
    P = sys.modules["fluxpy.profile"]   # fluxpy.profile is the function of the same name
    monkeypatch.setattr(P, "gpu_available", lambda: (False, "CuPy could not be imported (no cupy here)"))
    with pytest.raises(fluxpy.GPUUnavailableError) as err:
        fluxpy.profile(gpu=True)
    assert str(err.value).startswith("profile(gpu=True) times the GPU with CUDA events, but no GPU is usable: "
                                     "CuPy could not be imported (no cupy here); use profile(gpu=False)")
    assert fluxpy.autodiff._pullback_hook is None   # nothing patched
    assert fluxpy.profile(print_table=False).use_gpu is False   # the default decides by itself
    with pytest.raises(ValueError, match="profile: gpu must be True, False or None"):
        fluxpy.profile(gpu="yes")
