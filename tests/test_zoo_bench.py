"""``benchmarks/zoo.py`` without a GPU: picking cases, timing rounds that take turns (a failing mode recorded, not
fatal), each side's best mode and the ratios, the tables (its own and run.py's), the fluxpy sides on the CPU
(``--smoke``), and, where PyTorch is installed, the PyTorch twins' first losses and parameter counts against
fluxpy's (the GPT at tiny sizes, its causal mask checked on both sides)."""
import copy
import inspect
import json
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import run  # noqa: E402
import zoo  # noqa: E402
import zoo_nets  # noqa: E402

SMALL = zoo.nets(zoo.GPT_SMOKE, dropout=0.0)   # the GPT at tiny sizes: the CPU runs it in a moment; dropout
# off: the two sides draw different masks


def test_cases_by_network_or_network_and_batch():
    assert zoo.select_cases("") == list(zoo.CASES)
    assert ("resnet20", 128) in zoo.CASES and ("resnet20", 512) in zoo.CASES and ("vgg", 1024) in zoo.CASES
    assert zoo.select_cases("vgg,resnet20") == [("vgg", 1024), ("resnet20", 128), ("resnet20", 512)]
    assert zoo.select_cases("lstm:16, mnist") == [("lstm", 16), ("mnist", 128)]
    with pytest.raises(ValueError, match="no network 'resnet50'; the networks are mnist, resnet20"):
        zoo.select_cases("resnet50")
    with pytest.raises(ValueError, match="the batch of 'vit:0' must be a positive int"):
        zoo.select_cases("vit:0")


def test_every_network_builds_its_optimiser_rule():
    rules = {name: type(zoo.fluxpy_rule(net)).__name__ for name, net in zoo.NETS.items()}
    assert rules["vgg"] == "Nesterov" and rules["vit"] == "AdamW" and rules["lstm"] == "Adam"
    assert rules["gpt"] == "AdamW" and zoo.NETS["gpt"].tokens and zoo.NETS["gpt"].classes == 8192
    assert zoo.NETS["vgg"].label_smoothing == 0.2 and zoo.NETS["vgg"].half == "float16"


class FakeClock:
    """A clock that each step advances by its side's step time: a round of n steps takes n times it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _side(clock, seconds, calls, fail_at=None):
    def step():
        calls.append(1)
        if fail_at is not None and len(calls) == fail_at:
            raise RuntimeError("capture invalidated\nsecond line")
        clock.now += seconds
    return step, lambda: None


def test_rounds_take_turns_and_a_failing_mode_is_recorded_not_fatal():
    rng = random.Random(11)
    clock, calls = FakeClock(), {k: [] for k in "abc"}
    seconds = {k: rng.uniform(1e-4, 1e-2) for k in "abc"}
    sides = {k: _side(clock, seconds[k], calls[k], fail_at=7 if k == "b" else None) for k in "abc"}
    times, errors = zoo.timed_modes(sides, steps=3, rounds=4, warmup=2, clock=clock)
    assert errors == {"b": "RuntimeError: capture invalidated"}
    assert set(times) == {"a", "c"} and len(calls["b"]) == 7   # warm-up 2, one round of 3, then the failing step
    for k in "ac":
        assert len(times[k]) == 4 and len(calls[k]) == 2 + 4 * 3
        assert np.allclose(times[k], seconds[k])
    broken = {"d": (lambda: 1 / 0, lambda: None)}
    assert zoo.timed_modes(broken, 1, 3, 1, clock) == ({}, {"d": "ZeroDivisionError: division by zero"})


def test_a_compile_over_its_time_limit_raises_and_the_alarm_is_put_back():
    previous = signal.getsignal(signal.SIGALRM)
    with pytest.raises(TimeoutError, match=r"torch.compile\(mode='default'\) took more than 0.05 s"):
        with zoo.time_limit(0.05, "torch.compile(mode='default')"):
            time.sleep(2)
    assert signal.getsignal(signal.SIGALRM) is previous
    with zoo.time_limit(5, "quick"):
        total = sum(range(1000))
    assert total == 499500 and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_modes_left_out_on_purpose_are_skipped_not_failed():
    assert zoo.skipped_modes("fluxpy,torch", "gpu", "default") == {}
    cpu = zoo.skipped_modes("fluxpy,torch", "cpu", "default")
    assert set(cpu) == {"torch graph", "torch autocast graph", "torch compile"}
    assert all(v == dict(skipped="needs CUDA") for v in cpu.values())
    assert set(zoo.skipped_modes("torch", "gpu", "off")) == {*zoo.FLUXPY_MODES, "torch compile"}


def _row(modes, half="bfloat16"):
    return zoo.finish_row(dict(model="vit", batch=256, modes=modes, **{"torch half": half}))


def _stats(rng):
    rounds = [rng.uniform(100, 5000) for _ in range(3)]
    return zoo.mode_stats([r * 1e-6 for r in rounds])


def test_each_side_s_best_mode_and_the_ratios():
    rng = random.Random(5)
    modes = {m: _stats(rng) for m in (*zoo.FLUXPY_MODES, *zoo.TORCH_MODES)}
    modes["fluxpy bfloat16"] = dict(error="NotCaptured: not captured (CaptureUnsupported: cuBLAS)")
    modes["torch compile"] = dict(skipped="--compile off")
    row = _row(modes)
    measured = {m: s["median"] for m, s in modes.items() if "median" in s}
    fluxpy_best = min((m for m in measured if m.startswith("fluxpy")), key=measured.get)
    torch_best = min((m for m in measured if m.startswith("torch")), key=measured.get)
    assert row["fluxpy best"] == fluxpy_best
    assert row["torch best"] == zoo.mode_label(torch_best, "bfloat16")
    assert row["fluxpy_us"] == measured[fluxpy_best] and row["torch_us"] == measured[torch_best]
    assert row["fluxpy best us"] == {k: modes[fluxpy_best][k] for k in ("median", "min", "max")}
    assert row["best / best"] == pytest.approx(measured[fluxpy_best] / measured[torch_best])
    assert row["fluxpy half"] == "fluxpy float16"   # bfloat16 failed
    float32 = min(measured["fluxpy eager"], measured["fluxpy float32"])
    assert row["half / float32"] == pytest.approx(measured["fluxpy float16"] / float32)
    assert row["failed"] == "fluxpy bfloat16"


def test_a_side_with_nothing_measured_has_no_best():
    rng = random.Random(6)
    modes = {m: dict(error="TypeError: x") for m in zoo.FLUXPY_MODES}
    modes["torch eager"] = _stats(rng)
    row = _row(modes)
    assert row["fluxpy best"] is None and row["fluxpy_us"] is None and row["best / best"] is None
    assert row["half / float32"] is None and row["torch best"] == "torch eager"
    assert row["failed"] == ", ".join(zoo.FLUXPY_MODES)
    assert run.summary_rows({"zoo": [row]}) == []   # no pair to compare


def test_mode_stats_give_median_and_range_in_us():
    rng = random.Random(8)
    seconds = [rng.uniform(1e-4, 1e-3) for _ in range(5)]
    stats = zoo.mode_stats(seconds)
    us = sorted(s * 1e6 for s in seconds)
    assert stats["median"] == pytest.approx(us[2]) and stats["min"] == pytest.approx(us[0])
    assert stats["max"] == pytest.approx(us[-1]) and len(stats["rounds_us"]) == 5


def test_the_zoo_table_shows_every_mode_and_lists_the_failures():
    rng = random.Random(9)
    modes = {m: _stats(rng) for m in (*zoo.FLUXPY_MODES, *zoo.TORCH_MODES)}
    modes["torch autocast graph"] = dict(error="RuntimeError: CUDA error: operation not permitted when stream is "
                                               "capturing")
    modes["torch compile"] = dict(skipped="--compile off")
    row = _row(modes, half="float16")
    text = zoo.table([row])
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header, cells = [c.strip() for c in lines[0].strip("|").split("|")], lines[2].strip("|").split("|")
    cells = dict(zip(header, (c.strip() for c in cells)))
    s = modes["fluxpy float32"]
    assert cells["fluxpy float32 us"] == f"{zoo._us(s['median'])} ({zoo._us(s['min'])}-{zoo._us(s['max'])})"
    assert cells["torch autocast graph us"] == "failed" and cells["torch compile us"] == "skipped"
    assert cells["best / best"] == f"{row['best / best']:.2f}"
    assert ("- vit 256, torch autocast graph (float16): RuntimeError: CUDA error: operation not permitted when "
            "stream is capturing") in text


def test_run_py_runs_it_and_writes_its_table():
    assert "zoo" in run.BENCHMARKS and "zoo" in run.TABLES
    assert "--compile" in run.QUICK_FLAGS["zoo"] and "off" in run.QUICK_FLAGS["zoo"]
    rng = random.Random(10)
    modes = {m: _stats(rng) for m in (*zoo.FLUXPY_MODES, *zoo.TORCH_MODES)}
    modes["fluxpy float16"] = dict(error="DTypeMismatch: x")
    row = _row(modes)
    text = run.bench_table("zoo", [row], "NVIDIA Test", "2026-01-01", "run.py --only zoo")
    lines = [line for line in text.splitlines() if line.startswith("|")]
    cells = dict(zip(*([c.strip() for c in line.strip("|").split("|")] for line in (lines[0], lines[2]))))
    assert cells["model"] == "vit" and cells["fluxpy best"] == row["fluxpy best"]
    best = row["fluxpy best us"]
    assert cells["fluxpy best us"] == f"{run._number(best['median'], 'us')} ({run._number(best['min'], 'us')}-" \
                                      f"{run._number(best['max'], 'us')})"
    assert cells["best / best"] == f"{row['fluxpy_us'] / row['torch_us']:.2f}"
    assert cells["failed"] == "fluxpy float16"
    (summary,) = run.summary_rows({"zoo": [row]})
    assert summary["case"] == "vit, batch 256" and summary["ratio"] == pytest.approx(row["best / best"])


def test_smoke_runs_the_fluxpy_modes_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "rows.json"
    zoo.main(["--smoke", "--sides", "fluxpy", "--only", "mnist,lstm:3", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["model"], r["batch"]) for r in rows] == [("mnist", 2), ("lstm", 2)]
    for r in rows:
        assert all(len(r["modes"][m]["rounds_us"]) == 3 for m in zoo.FLUXPY_MODES)
        assert all(r["modes"][m] == dict(skipped="--sides has no torch") for m in zoo.TORCH_MODES)
        firsts = r["first_losses"]
        assert firsts["fluxpy eager"] == firsts["fluxpy float32"]   # captured steps run eagerly on the CPU
        assert abs(firsts["fluxpy bfloat16"] - firsts["fluxpy float32"]) < 0.05 * firsts["fluxpy float32"]
        assert r["fluxpy best"] in zoo.FLUXPY_MODES and r["torch best"] is None
    assert "| mnist | 2 |" in capsys.readouterr().out


def _apart_args(**kw):
    import argparse
    return argparse.Namespace(**dict(steps=1, rounds=3, warmup=1, compile="off", compile_timeout=60.0, device="cpu",
                                     modes=(), gpt_layers=2) | kw)


def test_a_mode_whose_own_process_fails_is_recorded_with_that_process_s_last_words():
    modes, firsts = zoo.skipped_modes("fluxpy,torch", "cpu", "off"), {}
    zoo.torch_modes_apart("mnist", 2, _apart_args(rounds=2), modes, firsts)   # the child refuses 2 rounds
    for mode in ("torch eager", "torch autocast"):
        assert modes[mode]["error"].startswith("its process exited with 2: ")
        assert "--rounds must be 3 or more" in modes[mode]["error"]
    assert modes["torch graph"] == dict(skipped="needs CUDA") and firsts == {}


def test_each_torch_mode_apart_gives_what_it_gives_in_this_process():
    torch = pytest.importorskip("torch")
    modes, firsts = zoo.skipped_modes("fluxpy,torch", "cpu", "off"), {}
    zoo.torch_modes_apart("mnist", 2, _apart_args(), modes, firsts)
    net, model, x, labels = zoo.make_case("mnist", 2)
    for mode in ("torch eager", "torch autocast"):
        assert len(modes[mode]["rounds_us"]) == 3
        _, first = zoo.torch_side(torch, net, model, x, labels, mode, "cpu")
        assert firsts[mode] == pytest.approx(first, rel=1e-6)


@pytest.mark.parametrize("name", list(SMALL))
def test_the_torch_twins_start_from_fluxpy_s_loss(name):
    torch = pytest.importorskip("torch")
    net, model, x, labels = zoo.make_case(name, 3, seed=4, nets=SMALL)
    y = labels if net.tokens else zoo.fluxpy.onehotbatch(labels, range(net.classes))
    expected, _ = zoo.fluxpy.withgradient(   # inside a gradient: BatchNorm on the batch's statistics, as train()
        lambda m: zoo.fluxpy.logitcrossentropy(m(x), y, label_smoothing=net.label_smoothing), copy.deepcopy(model))
    twin = zoo.torch_twin(torch, model).train()
    extra = model[0].cell.bias.size if name in ("lstm", "gru") else 0   # PyTorch's second recurrent bias
    assert sum(p.numel() for p in twin.parameters()) == zoo.parameter_count(model) + extra
    step, first = zoo.torch_side(torch, net, model, x, labels, "torch eager", "cpu")
    assert first == pytest.approx(float(expected), rel=1e-4)
    assert np.isfinite(float(step()))


def test_the_docstring_examples_run():
    import doctest
    failures, tried = doctest.testmod(zoo)
    assert failures == 0 and tried >= 8
    failures, tried = doctest.testmod(zoo_nets)
    assert failures == 0 and tried >= 4


def _tiny_gpt_size(rng):
    nheads = int(rng.integers(1, 4))
    return zoo_nets.GPTSize(vocab=int(rng.integers(20, 60)), length=int(rng.integers(5, 12)),
                       width=nheads * int(rng.integers(2, 6)), nheads=nheads, layers=int(rng.integers(1, 4)))


def test_the_gpt_is_one_model_on_both_sides_and_a_fluxpy_step_runs():
    torch = pytest.importorskip("torch")
    seed = int(np.random.default_rng().integers(1 << 16))
    size = _tiny_gpt_size(np.random.default_rng(seed))
    net, model, x, labels = zoo.make_case("gpt", 3, seed=seed, nets=zoo.nets(size))
    assert x.dtype == labels.dtype == np.int64 and x.shape == labels.shape == (3, size.length)
    assert np.array_equal(x[:, 1:], labels[:, :-1]) and len(np.unique(x)) > 1   # next tokens, drawn
    w, v = size.width, size.vocab
    block = 4 * (w * w + w) + 2 * 4 * w * w + 4 * w + w + 4 * w   # attention, feed-forward, two norms
    expected = v * w + size.length * w + size.layers * block + 2 * w + w * v
    assert zoo.parameter_counts(torch, model, "fluxpy,torch") == dict(fluxpy=expected, torch=expected)

    twin = zoo.torch_twin(torch, model)
    changed = x.copy()
    changed[:, -1] = (changed[:, -1] + 1) % v   # only the last position may see it: the mask, on both sides
    ours = [np.asarray(model(t)) for t in (x, changed)]
    with torch.no_grad():
        theirs = [twin(torch.from_numpy(t)).numpy() for t in (x, changed)]
    for a, b in (ours, theirs):
        np.testing.assert_array_equal(a[:, :-1], b[:, :-1])
        assert np.abs(a[:, -1] - b[:, -1]).max() > 0
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-4, atol=1e-4)   # float32 sums in two orders over random sizes

    step, first = zoo.fluxpy_side(net, model, x, labels, "fluxpy eager", "cpu")   # has run 1 + warm-up steps
    ours = [first] + [float(step()) for _ in range(2)]
    torch_step, torch_first = zoo.torch_side(torch, net, model, x, labels, "torch eager", "cpu")
    warmup = inspect.signature(zoo.fluxpy.TrainStep).parameters["warmup"].default   # fluxpy_side ran 1 + these
    theirs = [torch_first] + [float(torch_step()) for _ in range(2 + warmup)]
    theirs = [theirs[0]] + theirs[1 + warmup:]   # the losses after the same number of AdamW steps
    assert np.isfinite(ours).all() and ours[-1] != ours[0]   # the steps train
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)


def test_smoke_runs_the_gpt_at_the_layers_asked_and_writes_the_out_folder(tmp_path):
    zoo.main(["--smoke", "--sides", "fluxpy", "--only", "gpt", "--gpt-layers", "1", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "zoo.json").read_text())
    one_block = zoo_nets.GPT(zoo.dataclasses.replace(zoo.GPT_SMOKE, layers=1), rng=0)
    assert (row["model"], row["batch"]) == ("gpt", 2)
    assert row["parameters"] == dict(fluxpy=zoo.parameter_count(one_block))
    assert all(len(row["modes"][m]["rounds_us"]) == 3 for m in zoo.FLUXPY_MODES)
    assert "| gpt | 2 |" in (tmp_path / "zoo.md").read_text()
    with pytest.raises(SystemExit):
        zoo.main(["--smoke", "--gpt-layers", "0"])
