"""fluxpy.distributed without GPUs: the launcher's environment, the TCP rendezvous, the launcher, the gradient
bucket plans and the DataLoader's shards."""
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluxpy import DataLoader
from fluxpy.distributed import (DEFAULT_CAP_BYTES, DistributedEnv, DistributedEnvError, RendezvousError,
                                bucket_plan, free_port, read_env, rendezvous)

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------------------
# Environment

FULL = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "29501"}


def test_env_defaults_to_one_process():
    assert read_env({"PATH": "/bin"}) == DistributedEnv(0, 1, 0, "127.0.0.1", 29500)


def test_env_reads_every_variable():
    env = read_env(FULL)
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (1, 4, 1, "node7", 29501)
    assert env.shard == (1, 4) and not env.is_main


def test_env_local_rank_defaults_to_rank_and_single_rank_needs_no_master():
    assert read_env({"RANK": "0", "WORLD_SIZE": "1"}) == DistributedEnv()
    env = read_env({k: v for k, v in FULL.items() if k != "LOCAL_RANK"})
    assert env.local_rank == 1


def test_env_reads_os_environ(monkeypatch):
    for k, v in FULL.items():
        monkeypatch.setenv(k, v)
    assert read_env().rank == 1


@pytest.mark.parametrize("change, words", [
    ({"RANK": "4"}, ["RANK", "0 <= RANK < WORLD_SIZE (4)", "'4'"]),
    ({"RANK": "-1"}, ["RANK", "'-1'"]),
    ({"RANK": "one"}, ["RANK", "'one'"]),
    ({"WORLD_SIZE": "0"}, ["WORLD_SIZE", "int >= 1", "'0'"]),
    ({"LOCAL_RANK": "9"}, ["LOCAL_RANK", "'9'"]),
    ({"MASTER_PORT": "70000"}, ["MASTER_PORT", "1..65535", "'70000'"]),
    ({"MASTER_PORT": "http"}, ["MASTER_PORT", "'http'"]),
    ({"MASTER_ADDR": ""}, ["MASTER_ADDR", "''"]),
    ({"MASTER_ADDR": "a b"}, ["MASTER_ADDR", "'a b'"]),
])
def test_env_errors_name_the_variable_the_form_and_the_value(change, words):
    with pytest.raises(DistributedEnvError) as info:
        read_env({**FULL, **change})
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_env_missing_variable_is_named(missing):
    with pytest.raises(DistributedEnvError, match=f"{missing} is not set"):
        read_env({k: v for k, v in FULL.items() if k != missing})


# ---------------------------------------------------------------------------------------------------------------
# Rendezvous (threads for the failure paths: fast; processes for the real thing)

def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as err:   # handed back to the test
            box["error"] = err
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_rendezvous_threads_share_the_payload_and_barrier():
    port, n = free_port(), 4
    joined = [_in_thread(lambda r=r: rendezvous(r, n, port=port, timeout=10)) for r in range(1, n)]
    with rendezvous(0, n, port=port, payload=b"\x00unique-id\xff", timeout=10) as g0:
        for t, _ in joined:
            t.join(10)
        groups = [box["value"] for _, box in joined]
        assert [g.payload for g in groups] == [b"\x00unique-id\xff"] * (n - 1)
        assert [g.rank for g in groups] == [1, 2, 3]
        barriers = [_in_thread(g.barrier) for g in groups]
        g0.barrier(timeout=10)
        for t, box in barriers:
            t.join(10)
            assert "error" not in box
    for g in groups:
        g.close()


def test_rendezvous_timeout_names_the_ranks_that_did_not_arrive():
    port = free_port()
    t, box = _in_thread(lambda: rendezvous(2, 4, port=port, timeout=5))
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"ranks 1, 3 of world_size 4 did not arrive") as info:
        rendezvous(0, 4, port=port, payload=b"id", timeout=0.5)
    assert info.value.missing == (1, 3)
    assert time.monotonic() - start < 3
    t.join(5)
    assert isinstance(box["error"], RendezvousError)   # rank 2 is told why, not left waiting
    assert "ranks 1, 3" in str(box["error"])


def test_a_rank_without_rank_0_times_out_naming_rank_0():
    start = time.monotonic()
    with pytest.raises(RendezvousError, match="rank 3 could not reach rank 0") as info:
        rendezvous(3, 4, port=free_port(), timeout=0.3)
    assert info.value.missing == (0,) and time.monotonic() - start < 2


def test_barrier_names_a_rank_that_died_and_one_that_is_late():
    port = free_port()
    joined = [_in_thread(lambda r=r: rendezvous(r, 4, port=port, timeout=10)) for r in (1, 2, 3)]
    g0 = rendezvous(0, 4, port=port, timeout=10)
    for t, _ in joined:
        t.join(10)
    g1, g2, g3 = (box["value"] for _, box in joined)
    g2.close()                                   # rank 2 "dies"
    t1, box1 = _in_thread(lambda: g1.barrier(timeout=5))   # rank 1 arrives; rank 3 never calls barrier
    with pytest.raises(RendezvousError) as info:
        g0.barrier(timeout=1.0)
    assert "rank 2 closed the connection" in str(info.value)
    assert set(info.value.missing) >= {2}
    t1.join(5)
    assert isinstance(box1["error"], RendezvousError) and "rank 2" in str(box1["error"])
    for g in (g0, g1, g3):
        g.close()


def test_barrier_on_a_rank_whose_rank_0_died():
    port = free_port()
    t, box = _in_thread(lambda: rendezvous(1, 2, port=port, timeout=10))
    g0 = rendezvous(0, 2, port=port, timeout=10)
    t.join(10)
    g0.close()
    with pytest.raises(RendezvousError, match="rank 0 closed the connection"):
        box["value"].barrier(timeout=2)
    box["value"].close()


def test_rendezvous_refuses_a_mismatched_world_size():
    port = free_port()
    t, box = _in_thread(lambda: rendezvous(1, 3, port=port, timeout=5))
    with pytest.raises(RendezvousError, match="rank 1 says world_size 3, rank 0 has 2"):
        rendezvous(0, 2, port=port, timeout=5)
    t.join(5)
    assert "world_size 3" in str(box["error"])


def test_rendezvous_ignores_a_stranger_and_refuses_bad_arguments():
    import socket
    port = free_port()
    t, box = _in_thread(lambda: rendezvous(0, 2, port=port, payload=b"ok", timeout=5))
    time.sleep(0.1)
    with socket.create_connection(("127.0.0.1", port)) as s:   # a frame that is not a hello
        s.sendall(b"\x00\x00\x00\x05HELLO")
    time.sleep(0.1)
    with rendezvous(1, 2, port=port, timeout=5) as g1:
        assert g1.payload == b"ok"
    t.join(5)
    box["value"].close()
    with pytest.raises(ValueError, match="only rank 0 publishes"):
        rendezvous(1, 2, payload=b"x")
    with pytest.raises(ValueError, match="rank 2 of 2"):
        rendezvous(2, 2)
    with pytest.raises(TypeError, match="payload must be bytes"):
        rendezvous(0, 1, payload="text")


RANK_SCRIPT = """
import sys
from fluxpy import DataLoader
from fluxpy.distributed import read_env, rendezvous
env = read_env()
with rendezvous(env.rank, env.world_size, env.master_addr, env.master_port,
                payload=b"id-from-0" if env.rank == 0 else None, timeout=20) as g:
    g.barrier()
    print(env.rank, g.payload.decode(), flush=True)
"""


def test_rendezvous_across_processes():
    port, n = free_port(), 3
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
             for r in reversed(range(n))]   # rank 0 last: the others wait for it
    outs = [p.communicate(timeout=30) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [e for _, e in outs]
    assert sorted(o.strip() for o, _ in outs) == [f"{r} id-from-0" for r in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# Launcher

def _launch(tmp_path, body, nproc, *args, timeout=30):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "fluxpy.distributed.run", "--nproc", str(nproc), "--grace", "1",
                           str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_launcher_runs_every_rank_with_its_environment(tmp_path):
    run = _launch(tmp_path, """
        import os, sys
        print(os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"],
              int(os.environ["MASTER_PORT"]) > 0, sys.argv[1:])
    """, 3, "--lr", "0.1")
    assert run.returncode == 0, run.stderr
    lines = sorted(run.stdout.splitlines())
    assert lines == [f"[rank {r}] {r} {r} 3 127.0.0.1 True ['--lr', '0.1']" for r in range(3)]


def test_launcher_stops_the_others_when_a_rank_fails_and_names_it(tmp_path):
    start = time.monotonic()
    run = _launch(tmp_path, """
        import os, sys, time
        rank = int(os.environ["RANK"])
        print("started", flush=True)
        if rank == 1:
            time.sleep(0.3)
            sys.exit(3)
        time.sleep(60)
    """, 3)
    assert time.monotonic() - start < 15
    assert run.returncode == 3
    assert "rank 1 exited with status 3; stopped ranks 0, 2" in run.stderr
    assert sorted(run.stdout.splitlines()) == [f"[rank {r}] started" for r in range(3)]


def test_launcher_names_a_rank_that_raises_and_a_rank_killed_by_a_signal(tmp_path):
    run = _launch(tmp_path, """
        import os, signal, time
        if os.environ["RANK"] == "0":
            raise RuntimeError("boom")
        time.sleep(60)
    """, 2)
    assert run.returncode == 1
    assert "rank 0 exited with status 1; stopped rank 1" in run.stderr
    assert "[rank 0] RuntimeError: boom" in run.stdout
    run = _launch(tmp_path, """
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    """, 1)
    assert run.returncode == 128 + 9 and "rank 0 was killed by signal SIGKILL" in run.stderr


def test_launcher_stops_a_rank_that_ignores_sigterm(tmp_path):
    start = time.monotonic()
    run = _launch(tmp_path, """
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            time.sleep(0.3)
            sys.exit(2)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    """, 2)
    assert run.returncode == 2 and "stopped rank 0" in run.stderr
    assert time.monotonic() - start < 15


def test_launcher_stopped_by_sigterm_stops_every_rank_first(tmp_path):
    """A batch system's time limit or a benchmark's timeout sends SIGTERM to the launcher: no rank outlives it."""
    import os
    import signal
    script = tmp_path / "job.py"
    pids = tmp_path / "pids"
    pids.mkdir()
    script.write_text(textwrap.dedent(f"""
        import os, pathlib, time
        part = pathlib.Path({str(pids)!r}, os.environ["RANK"] + ".part")
        part.write_text(str(os.getpid()))
        part.rename(part.with_suffix(""))   # whole, or not there: the test reads it as soon as it appears
        print("started", flush=True)
        time.sleep(60)
    """))
    launcher = subprocess.Popen([sys.executable, "-m", "fluxpy.distributed.run", "--nproc", "2", "--grace", "1",
                                 str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while len(list(pids.glob("[0-9]"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = [int(f.read_text()) for f in pids.glob("[0-9]")]
    assert len(ranks) == 2
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=20)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "the launcher received SIGTERM; stopped every rank" in err
    for pid in ranks:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launcher_argument_errors(tmp_path):
    run = subprocess.run([sys.executable, "-m", "fluxpy.distributed.run", "--nproc", "0", "x.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "must be an int >= 1, got 0" in run.stderr


# ---------------------------------------------------------------------------------------------------------------
# Bucket plans

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), max_size=40), st.integers(1, 1500), st.one_of(st.none(), st.integers(1, 1500)))
def test_bucket_plan_properties(sizes, cap, first_cap):
    buckets = bucket_plan(sizes, cap_bytes=cap, first_cap_bytes=first_cap)
    order = [i for b in buckets for i in b.indices]
    assert order == list(reversed(range(len(sizes))))          # each parameter once, in reverse order of use
    for k, b in enumerate(buckets):
        assert b.indices and b.nbytes == sum(sizes[i] for i in b.indices)
        limit = first_cap if (k == 0 and first_cap is not None) else cap
        assert b.nbytes <= limit or len(b.indices) == 1 or sum(sizes[i] for i in b.indices[1:]) == 0
    for prev, nxt in zip(buckets, buckets[1:]):                 # a bucket closes only when the next param won't fit
        limit = first_cap if (prev is buckets[0] and first_cap is not None) else cap
        assert prev.nbytes + sizes[nxt.indices[0]] > limit


def test_bucket_plan_defaults_and_errors():
    assert DEFAULT_CAP_BYTES == 25 * 2**20
    mb = 2**20
    assert [b.indices for b in bucket_plan([10 * mb, 10 * mb, 10 * mb, 30 * mb])] == [(3,), (2, 1), (0,)]
    assert bucket_plan([]) == []
    with pytest.raises(ValueError, match=r"sizes to be ints >= 0 \(bytes\), got -1 at index 1"):
        bucket_plan([1, -1])
    with pytest.raises(ValueError, match="cap_bytes to be an int >= 1"):
        bucket_plan([1], cap_bytes=0)
    with pytest.raises(ValueError, match="first_cap_bytes"):
        bucket_plan([1], first_cap_bytes=1.5)


# ---------------------------------------------------------------------------------------------------------------
# DataLoader shards

def _epochs(n, world, batchsize, shuffle, partial, seed, epochs=2):
    """Per rank, the observations of each epoch, one loader per rank as each process would make it."""
    loaders = [DataLoader(np.arange(n), batchsize=batchsize, shuffle=shuffle, partial=partial, rng=seed,
                          shard=(r, world)) for r in range(world)]
    return loaders, [[[b.tolist() for b in loader] for _ in range(epochs)] for loader in loaders]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 60), st.integers(1, 6), st.integers(1, 8), st.booleans(), st.booleans(), st.integers(0, 99))
def test_shards_are_disjoint_covering_equal_and_shuffled_alike(n, world, batchsize, shuffle, partial, seed):
    if not partial and n < world:
        return   # an error, tested below
    loaders, epochs = _epochs(n, world, batchsize, shuffle, partial, seed)
    per_rank = -(-n // world) if partial else n // world
    for e in range(2):
        batches = [epochs[r][e] for r in range(world)]
        assert len({len(b) for b in batches}) == 1                       # the same number of batches on every rank
        assert all(len(b) == len(loader) for b, loader in zip(batches, loaders))
        seen = [x for b in batches for batch in b for x in batch]
        if partial:
            assert len(seen) == per_rank * world                         # padded to a multiple of world_size
            assert set(seen) == set(range(n))                            # covering
            assert len(seen) - len(set(seen)) == per_rank * world - n    # disjoint but for the padding
        else:
            kept = per_rank - per_rank % batchsize
            assert len(seen) == len(set(seen)) == kept * world           # disjoint, tail and short batches dropped


def test_shards_follow_distributed_sampler_order():
    """Rank r takes positions r, r + world, ... of the (padded) epoch order, as torch's DistributedSampler."""
    order = np.random.default_rng(5).permutation(10)
    padded = np.concatenate([order, order[:2]])
    for r in range(4):
        got = np.concatenate(list(DataLoader(np.arange(10), batchsize=2, shuffle=True, rng=5, shard=(r, 4))))
        assert got.tolist() == padded[r::4].tolist()
        cut = np.concatenate(list(DataLoader(np.arange(10), batchsize=1, shuffle=True, rng=5, partial=False,
                                             shard=(r, 4))))
        assert cut.tolist() == order[:8][r::4].tolist()


def test_shard_keeps_pairs_and_a_different_seed_breaks_agreement():
    x, y = np.arange(12), np.arange(12) * 10
    for xb, yb in DataLoader((x, y), batchsize=4, shuffle=True, rng=1, shard=(1, 3)):
        assert (yb == xb * 10).all()
    a = np.concatenate(list(DataLoader(x, batchsize=4, shuffle=True, rng=1, shard=(0, 2))))
    b = np.concatenate(list(DataLoader(x, batchsize=4, shuffle=True, rng=1, shard=(1, 2))))
    assert not set(a) & set(b)
    c = np.concatenate(list(DataLoader(x, batchsize=4, shuffle=True, rng=2, shard=(1, 2))))
    assert set(a) & set(c)   # ranks seeded differently overlap: why every rank needs the same seed


def test_shard_one_of_one_is_the_plain_loader():
    plain = [b.tolist() for b in DataLoader(np.arange(9), batchsize=4, shuffle=True, rng=3)]
    assert [b.tolist() for b in DataLoader(np.arange(9), batchsize=4, shuffle=True, rng=3, shard=(0, 1))] == plain
    assert "shard=(1, 2)" in repr(DataLoader(np.arange(9), shard=(1, 2)))


@pytest.mark.parametrize("shard, error, words", [
    ((2, 2), ValueError, "0 <= rank < world_size, got (2, 2)"),
    ((-1, 2), ValueError, "got (-1, 2)"),
    ((0, 0), ValueError, "world_size >= 1"),
    ((0,), TypeError, "two ints, got tuple of length 1"),
    ((0, 2.0), TypeError, "two ints"),
    ((True, 2), TypeError, "two ints"),
    ("0,2", TypeError, "two ints, got str"),
])
def test_bad_shards(shard, error, words):
    with pytest.raises(error) as info:
        DataLoader(np.arange(4), shard=shard)
    assert words in str(info.value)


def test_shard_with_partial_false_needs_world_size_observations():
    with pytest.raises(ValueError, match="leaving none of the 3"):
        DataLoader(np.arange(3), partial=False, shard=(0, 4))
    assert [b.tolist() for b in DataLoader(np.arange(3), shard=(3, 4))] == [[0]]   # padded instead
