"""fluxpy.distributed above the launcher, without GPUs: the tape's gradient hooks, DataParallel's buckets and their
overlap with the backward pass (ranks as threads, :func:`local_groups`), SyncBatchNorm, the structure check, the
fault watchdog (processes, ``backend='none'``) and the NCCL glue's error messages."""
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import fluxpy
from fluxpy import autodiff
from fluxpy.autodiff import Primitive, gradient, pullback, register_gradient_hook, withgradient
from fluxpy.distributed import (DataParallel, DistributedError, SyncBatchNorm, all_reduce_sum, convert_sync_batchnorm,
                                free_port, init, local_groups, structure_digest)
from fluxpy.distributed.group import ProcessGroup
from fluxpy.distributed.env import DistributedEnv
from fluxpy.distributed.watchdog import Watchdog, format_exception
from fluxpy.kernels.nccl import NcclCallError, _status_of, nccl_available
from fluxpy.functors import arrays
from fluxpy.layers import BatchNorm, Chain, Dense
from fluxpy.losses import mse
from fluxpy.optimise import Adam, Descent, setup

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------------------
# The tape's hook

def test_hook_sees_the_final_gradient_once_and_may_replace_it():
    seen = []

    def f(x):
        register_gradient_hook(x, lambda g: seen.append(g.copy()))
        return (x * x).sum() + (3 * x).sum()        # two uses: the hook sees their sum
    assert np.allclose(gradient(f, np.array([1.0, 2.0]))[0], [5.0, 7.0])
    assert len(seen) == 1 and np.allclose(seen[0], [5.0, 7.0])
    g, = gradient(lambda x: (register_gradient_hook(x, lambda g: g * 0 + 9), x.sum())[1], np.ones(2))
    assert np.allclose(g, [9, 9])
    assert not autodiff._gradient_hooks


def test_hook_runs_as_soon_as_its_gradient_is_final_not_at_the_end():
    log = []
    mark = Primitive("mark", lambda x: (x, lambda dy: (log.append("first layer's pullback") or dy,)))

    def f(ws):
        register_gradient_hook(ws[1], lambda g: log.append("w1 final"))
        register_gradient_hook(ws[0], lambda g: log.append("w0 final"))
        return (mark(ws[0] * 2.0) * ws[1]).sum()
    gradient(f, [np.ones(3), np.ones(3)])
    assert log == ["w1 final", "first layer's pullback", "w0 final"]


def test_hook_on_an_unused_value_gets_none_at_the_end_and_can_give_a_gradient():
    calls = []

    def f(d):
        register_gradient_hook(d["unused"], lambda g: calls.append(g) or np.zeros(2))
        return d["w"].sum()
    g, = gradient(f, {"w": np.ones(2), "unused": np.ones(2)})
    assert calls == [None] and np.array_equal(g["unused"], np.zeros(2))
    g, = gradient(lambda d: (register_gradient_hook(d["u"], lambda g: None), d["w"].sum())[1],
                  {"w": np.ones(2), "u": np.ones(2)})
    assert g["u"] is None


def test_hook_on_a_computed_value_changes_the_cotangent_that_flows_on():
    def f(x):
        y = x * 2
        register_gradient_hook(y, lambda g: g * 10)
        return y.sum()
    assert np.allclose(gradient(f, np.ones(2))[0], [20, 20])


def test_hooks_belong_to_their_tape_run_at_each_pullback_and_are_dropped_when_f_raises():
    count = []
    y, back = pullback(lambda x: (register_gradient_hook(x, lambda g: count.append(1)), x * 2)[1], np.ones(2))
    back(np.ones(2))
    back(np.ones(2))
    assert len(count) == 2

    inner = []

    def outer(x):   # a hook of the inner tape does not run in the outer one
        g, = gradient(lambda z: (register_gradient_hook(z, lambda g: inner.append(1)), (z * z).sum())[1], x)
        return (g * x).sum()
    value, (g,) = withgradient(outer, np.array([1.0, 2.0]))
    assert np.allclose(g, [4, 8]) and inner == [1]

    with pytest.raises(ValueError, match="boom"):
        gradient(lambda x: (register_gradient_hook(x, print), (_ for _ in ()).throw(ValueError("boom"))), np.ones(1))
    assert not autodiff._gradient_hooks
    with pytest.raises(TypeError, match="must be a Tracked value"):
        register_gradient_hook(np.ones(2), print)
    with pytest.raises(TypeError, match="fn must be callable"):
        gradient(lambda x: (register_gradient_hook(x, 3), x.sum())[1], np.ones(1))


# ---------------------------------------------------------------------------------------------------------------
# DataParallel with ranks as threads

def _in_ranks(n, body, timeout=30.0):
    """Run ``body(rank, group)`` in ``n`` threads; their results, re-raising the first error."""
    groups = local_groups(n, timeout=timeout)
    out, errors = [None] * n, [None] * n

    def run(r):
        try:
            out[r] = body(r, groups[r])
        except BaseException as err:   # the other ranks find out through their collectives' timeout
            errors[r] = err
    threads = [threading.Thread(target=run, args=(r,), daemon=True, name=f"rank {r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out, errors


def _data(n=16):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 4)).astype(np.float32), rng.standard_normal((n, 3)).astype(np.float32)


def _net(bn=False):
    layers = [Dense(4, 8, fluxpy.relu, rng=1)] + ([BatchNorm(8)] if bn else []) + [Dense(8, 8, fluxpy.tanh, rng=3),
                                                                                   Dense(8, 3, rng=2)]
    return Chain(*layers)


def _loss(m, x, y):
    return mse(m(x), y)


@pytest.mark.parametrize("world, bn, rule", [(2, False, Adam(0.01)), (4, False, Descent(0.1)), (2, True, Adam(0.01)),
                                             (3, True, Descent(0.1))])
def test_n_ranks_with_batch_b_equal_one_process_with_batch_nb(world, bn, rule):
    x, y = _data(4 * world)
    ref = _net(bn)
    fluxpy.train(_loss, ref, [(x, y)] * 4, setup(rule, ref), progress=False)

    def body(r, group):
        m = _net(bn)
        if r:
            for w in fluxpy.trainables(m):
                w += r                             # broadcast at start puts rank 0's weights back
        dp = DataParallel(m, group, bucket_mb=1e-4, first_bucket_mb=5e-5, sync_batchnorm=bn)
        fluxpy.train(_loss, dp, [(x[r::world], y[r::world])] * 4, setup(rule, dp), progress=False)
        return dp
    dps, errors = _in_ranks(world, body)
    assert errors == [None] * world
    assert len(dps[0].buckets) > 2
    for dp in dps:
        for a, b in zip(arrays(ref), arrays(dp.module)):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


def test_a_train_step_of_a_data_parallel_model_matches_one_process():
    x, y = _data(8)
    ref = _net()
    step = fluxpy.TrainStep(_loss, ref, setup(Adam(0.01), ref))
    for _ in range(3):
        step(x, y)

    def body(r, group):
        dp = DataParallel(_net(), group, bucket_mb=1e-4)
        step = fluxpy.TrainStep(_loss, dp, setup(Adam(0.01), dp))
        for _ in range(3):
            step(x[r::2], y[r::2])
        return dp.module
    mods, errors = _in_ranks(2, body)
    assert errors == [None, None]
    for m in mods:
        for a, b in zip(arrays(ref), arrays(m)):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


def test_without_sync_batchnorm_the_statistics_are_per_rank():
    x, y = _data(8)

    def body(r, group):
        dp = DataParallel(_net(bn=True), group)
        fluxpy.gradient(lambda m: _loss(m, x[r::2] + r, y[r::2]), dp)
        return dp.module[1].running_mean.copy()
    means, errors = _in_ranks(2, body)
    assert errors == [None, None] and not np.allclose(means[0], means[1])


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_buffers_follow_rank_0_before_each_training_forward_pass(broadcast_buffers):
    x, y = _data(8)

    def body(r, group):
        m = _net(bn=True)
        dp = DataParallel(m, group, broadcast_buffers=broadcast_buffers)
        if r == 1:
            m[1].running_mean += 5.0                 # drifted (or loaded from elsewhere) after the start
        fluxpy.gradient(lambda m: _loss(m, x, y), dp)   # the same batch on both ranks
        return m[1].running_mean.copy()
    means, errors = _in_ranks(2, body)
    assert errors == [None, None]
    assert np.array_equal(means[0], means[1]) == broadcast_buffers


def test_buckets_start_during_the_backward_pass_in_plan_order():
    """The last layer's bucket starts before the first layer's pullback has run; the wait comes last."""
    log = []

    def note(dy):
        if threading.current_thread().name == "rank 0":
            log.append(("pullback", "first layer"))
        return (dy,)
    mark = Primitive("mark", lambda x: (x, note))

    class Marked:
        def __init__(self):
            self.net = _net()

        def __call__(self, x):
            return self.net.layers[2](self.net.layers[1](mark(self.net.layers[0](x))))
    x, y = _data(8)

    def body(r, group):
        dp = DataParallel(Marked(), group, bucket_mb=1e-4, first_bucket_mb=1e-4)
        if r == 0:
            dp._reducer.log = log
        fluxpy.gradient(lambda m: _loss(m, x[r::2], y[r::2]), dp)
        return dp.buckets
    (buckets, _), errors = _in_ranks(2, body)
    assert errors == [None, None]
    starts = [e for e in log if e[0] == "start"]
    assert starts == [("start", b) for b in range(len(buckets))]
    first_layer = log.index(("pullback", "first layer"))
    assert log.index(("start", 0)) < first_layer < log.index(("start", len(buckets) - 1))
    assert log[-1] == ("waited", len(buckets))


def test_buckets_start_in_plan_order_whatever_order_gradients_arrive():
    groups = local_groups(1)
    group = ProcessGroup(DistributedEnv(0, 2, 0), groups[0].comm)   # a "world of 2" whose collectives are local
    group.comm.meeting.world_size = 1
    dp = DataParallel({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32), "c": np.ones(4, np.float32)}, group,
                      bucket_mb=16 / 2**20, first_bucket_mb=16 / 2**20, broadcast=False)
    red = dp._reducer
    red.log = []
    assert dp.buckets == [(2,), (1,), (0,)]
    red.level = None
    for bucket in red.plan:
        bucket.missing = len(bucket.indices)
    red.next = 0
    red._arrive(0, np.full(4, 2.0, np.float32))      # bucket 2 ready first: must wait for buckets 0 and 1
    assert red.log == []
    red._arrive(2, np.full(4, 4.0, np.float32))
    assert red.log == [("start", 0)]
    view = red._arrive(1, np.full(4, 6.0, np.float32))
    assert red.log == [("start", 0), ("start", 1), ("start", 2), ("waited", 3)]
    assert np.allclose(view, 6.0)                     # the view holds the all-reduced gradient (one thread here)


def test_an_array_unused_on_one_rank_gets_the_same_update_everywhere():
    x, y = _data(8)

    class Branchy:
        def __init__(self):
            self.a, self.b = Dense(4, 3, rng=1), Dense(4, 3, rng=2)

        def __call__(self, x, use_b):
            return self.a(x) + (self.b(x) if use_b else 0)

    def body(r, group):
        dp = DataParallel(Branchy(), group)
        opt = setup(Descent(0.1), dp)
        for _ in range(3):
            g, = fluxpy.gradient(lambda m: mse(m(x[r::2], r == 0), y[r::2]), dp)
            fluxpy.update(opt, dp, g)
        return dp.module
    mods, errors = _in_ranks(2, body)
    assert errors == [None, None]
    for a, b in zip(arrays(mods[0]), arrays(mods[1])):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(mods[0].b.weight, Dense(4, 3, rng=2).weight)   # rank 0's gradient reached rank 1


def test_a_model_structure_mismatch_is_found_at_start_on_every_rank():
    def body(r, group):
        return DataParallel(Chain(Dense(4, 8, rng=1), Dense(8, 3 if r == 0 else 2, rng=2)), group)
    _, errors = _in_ranks(2, body)
    for err in errors:   # every rank names the array, whichever one a launcher hears from first
        assert isinstance(err, DistributedError)
        assert "rank(s) 1 differ from rank 0" in str(err)
        assert "array 2: rank 0 has layers.1.weight (3, 8) float32, rank 1 has layers.1.weight (2, 8)" in str(err)


def test_a_rank_that_does_not_join_a_collective_makes_the_others_fail_naming_it():
    def body(r, group):
        if r == 1:
            return None
        return group.all_reduce(np.ones(2))
    _, errors = _in_ranks(2, body, timeout=0.5)
    assert isinstance(errors[0], DistributedError) and "did not complete in 0.5 s" in str(errors[0])


def test_a_model_on_the_wrong_device_is_refused_naming_the_array():
    group = ProcessGroup(DistributedEnv(0, 2, 0), local_groups(1)[0].comm)

    class OnGpu:   # what a rank of an NCCL group reports
        device = 0
    group.comm = OnGpu()
    with pytest.raises(DistributedError, match=r"layers.0.weight is on the CPU; every array of the model must be on "
                                               r"rank 0's GPU 0 \(fluxpy.gpu\(model\) after init\(\)\)"):
        DataParallel(_net(), group)


def test_structure_digest_tells_shapes_dtypes_and_paths_apart():
    base = structure_digest({"w": np.ones((2, 3), np.float32)})[0]
    assert structure_digest({"w": np.zeros((2, 3), np.float32)})[0] == base
    for other in ({"w": np.ones((3, 2), np.float32)}, {"w": np.ones((2, 3))}, {"v": np.ones((2, 3), np.float32)}):
        assert structure_digest(other)[0] != base


def test_data_parallel_in_a_group_of_one_only_forwards():
    m = _net()
    dp = DataParallel(m)
    assert dp.module is m and dp.buckets == [] and dp.group.world_size == 1 and repr(dp).startswith("DataParallel(")
    x, y = _data(4)
    g1, = fluxpy.gradient(lambda m: _loss(m, x, y), m)
    g2, = fluxpy.gradient(lambda d: _loss(d, x, y), dp)
    for a, b in zip(fluxpy.trainables(g1), fluxpy.trainables(g2["module"])):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="bucket_mb must be a number > 0"):
        DataParallel(m, bucket_mb=0)


def test_sync_batchnorm_matches_batchnorm_in_one_process_and_its_all_reduce_is_differentiable():
    x = np.random.default_rng(1).standard_normal((6, 3, 2, 2)).astype(np.float32)
    a, b = BatchNorm(3, fluxpy.relu), SyncBatchNorm.from_batchnorm(BatchNorm(3, fluxpy.relu), local_groups(1)[0])
    ga, = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), a)
    gb, = fluxpy.gradient(lambda m: (m(x) ** 2).sum(), b)
    for k in ("gamma", "beta"):
        np.testing.assert_allclose(gb[k], ga[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.running_var, a.running_var, rtol=1e-6)
    model = convert_sync_batchnorm({"chain": Chain(Dense(2, 3), BatchNorm(3)), "list": [BatchNorm(3)]})
    assert [type(layer).__name__ for layer in (model["chain"][1], model["list"][0])] == ["SyncBatchNorm"] * 2

    def body(r, group):   # d/dx sum over ranks of (all_reduce_sum(x) * c_r) = sum of c over ranks, on each rank
        return fluxpy.gradient(lambda x: (all_reduce_sum(x, group) * (r + 1.0)).sum(), np.ones(2))[0]
    grads, errors = _in_ranks(3, body)
    assert errors == [None] * 3 and all(np.allclose(g, 6.0) for g in grads)


# ---------------------------------------------------------------------------------------------------------------
# The fault watchdog

class _Stuck:
    def done(self):
        return False


def test_watchdog_fails_a_collective_that_never_finishes_and_one_whose_peer_left():
    from fluxpy.distributed import rendezvous
    exits = []
    for left in (False, True):
        dog = Watchdog(rendezvous(0, 1), abort=lambda: exits.append("abort"), collective_timeout=0.3 if not left else 60,
                       left_grace=0.2, poll=0.05, exit=exits.append)
        if left:
            dog.left[1] = time.monotonic()
        dog.start()
        dog.track(_Stuck(), "gradient bucket 0 of 3 (25.0 MiB)")
        deadline = time.monotonic() + 5
        while len(exits) < (4 if left else 2) and time.monotonic() < deadline:   # failed, aborted, exited
            time.sleep(0.02)
        assert "gradient bucket 0 of 3" in dog.failure
        assert ("left the job" in dog.failure) == left and ("did not finish in 0.3 s" in dog.failure) != left
    assert exits == ["abort", 1, "abort", 1]
    assert format_exception(RuntimeError("a\nb")) == "RuntimeError: a b"


WATCHED = """
import os, sys, time
from fluxpy.distributed import init
g = init(backend="none", timeout=20)
print("joined", flush=True)
mode = sys.argv[1]
if g.rank == 1:
    time.sleep(0.3)
    if mode == "raise":
        raise RuntimeError("boom in the forward pass")
    if mode == "die":
        os._exit(7)
    sys.exit(0)
time.sleep(3 if mode == "clean" else 60)
print("rank 0 finished", flush=True)
"""


def _watched(mode, tmp_path):
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(script), mode], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**env, "RANK": str(r)}) for r in (1, 0)]
    start = time.monotonic()
    outs = [p.communicate(timeout=40)[0] for p in procs]
    return time.monotonic() - start, [p.returncode for p in procs][::-1], outs[::-1]


@pytest.mark.parametrize("mode, words", [("raise", "rank 1 raised RuntimeError: boom in the forward pass"),
                                         ("die", "rank 1 died (its connection closed without a clean exit)")])
def test_a_rank_that_raises_or_dies_makes_the_other_exit_naming_it(mode, words, tmp_path):
    took, codes, outs = _watched(mode, tmp_path)
    assert took < 20, outs                      # rank 0 would sleep 60 s otherwise
    assert codes[0] == 1 and f"fluxpy.distributed: {words}; rank 0 exits" in outs[0], outs
    assert codes[1] == (1 if mode == "raise" else 7)


def test_a_rank_that_exits_cleanly_does_not_stop_the_others(tmp_path):
    took, codes, outs = _watched("clean", tmp_path)
    assert codes == [0, 0] and "rank 0 finished" in outs[0], outs


def test_init_rejects_a_bad_backend_and_a_world_without_nccl(monkeypatch):
    import fluxpy.distributed.group as group_module
    monkeypatch.setattr(group_module, "_DEFAULT", None)
    with pytest.raises(ValueError, match="backend must be 'auto', 'nccl', 'tcp' or 'none'"):
        init(backend="gloo")
    if not nccl_available()[0]:
        env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
        with pytest.raises(DistributedError, match="rank 1 of 2 cannot use NCCL"):
            init(backend="nccl", environ=env)
    monkeypatch.setattr(group_module, "_DEFAULT", None)


# ---------------------------------------------------------------------------------------------------------------
# The NCCL glue's errors (no GPU needed)

def test_nccl_errors_name_the_call_the_status_and_the_rank():
    err = NcclCallError("ncclAllReduce", 6, rank=1, detail="NcclError")
    assert str(err).startswith("ncclAllReduce failed on rank 1 with ncclRemoteError (status 6: another rank failed")
    assert NcclCallError("ncclBroadcast", None).status_name == "an error"
    assert _status_of(KeyError(7)) == 7    # CuPy's table stops at 5: its KeyError still tells the status

    class Fake(RuntimeError):
        status = 5
    assert _status_of(Fake()) == 5


def test_the_launcher_runs_a_data_parallel_script_of_one_rank_unchanged(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, fluxpy
        from fluxpy.distributed import DataParallel, init
        g = init()
        m = DataParallel(fluxpy.Dense(2, 1, rng=0))
        print(g.rank, g.world_size, m(np.ones((1, 2), np.float32)).shape)
    """))
    run = subprocess.run([sys.executable, "-m", "fluxpy.distributed.run", "--nproc", "1", str(script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[rank 0] 0 1 (1, 1)"


# ---------------------------------------------------------------------------------------------------------------
# Real processes through the launcher, collectives over the tcp backend (the GPU tests' worker, with --cpu)

WORKER = ROOT / "tests" / "gpu" / "distributed_worker.py"


def _launch_worker(nproc, *args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fluxpy.distributed.run", "--nproc", str(nproc), "--grace", "5",
                           str(WORKER), "--cpu", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def _npz(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


@pytest.mark.parametrize("options", [[], ["--bn", "--rule", "adam"]], ids=["momentum", "sync_bn_adam"])
def test_two_processes_at_batch_b_equal_one_at_batch_2b(options, tmp_path):
    two = _launch_worker(2, "--steps", "3", "--batch", "4", "--out", str(tmp_path / "two"), *options)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-2000:]
    one = _launch_worker(1, "--steps", "3", "--batch", "8", "--out", str(tmp_path / "one"), *options)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-2000:]
    ref, r0, r1 = (_npz(tmp_path / n) for n in ("one.rank0.npz", "two.rank0.npz", "two.rank1.npz"))
    for a, b in zip(r0, r1):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(ref, r0):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert "[rank 0] rank 0 of 2:" in two.stdout and "buckets" in two.stdout


def test_processes_with_different_models_fail_at_start_naming_the_array():
    run = _launch_worker(2, "--mode", "mismatch")
    assert run.returncode != 0
    assert "the model's structure differs between ranks: rank(s) 1 differ from rank 0" in run.stdout, run.stdout
    assert "rank 1 has layers.6.weight (11, 32) float32" in run.stdout


def test_a_process_that_raises_mid_training_stops_the_job_naming_it():
    start = time.monotonic()
    run = _launch_worker(2, "--mode", "raise", "--steps", "8")
    assert time.monotonic() - start < 60
    assert run.returncode != 0
    assert "[rank 1] RuntimeError: boom on rank 1 in step 3" in run.stdout, run.stdout[-3000:]


def test_release_graphs_frees_only_the_graphs_that_hold_the_resource():
    """The bookkeeping behind NcclComm.destroy (no GPU: graphs stand in for CuPy's): a graph recorded while
    hold_in_capture(resource) was called holds it; release_graphs frees those graphs and their launch names why."""
    from fluxpy import backend
    comm, other = object(), object()
    assert backend.hold_in_capture(comm) is False   # no capture under way
    held = backend.CapturedGraph(graph=object(), stream=None, pool=None, holds=(comm,))
    free = backend.CapturedGraph(graph=object(), stream=None, pool=None, holds=(other,))
    for g in (held, free):
        backend._LIVE_GRAPHS.add(g)
    assert backend.release_graphs(comm, "the communicator was destroyed") == 1
    assert held.graph is None and free.graph is not None
    with pytest.raises(RuntimeError, match=r"released \(the communicator was destroyed\)"):
        held.launch()
    assert backend.release_graphs(comm, "again") == 0
