"""Data parallelism on two GPUs through NCCL: every job starts its processes through the launcher
(``python -m fluxpy.distributed.run``) running ``distributed_worker.py``. Needs 2 GPUs (skips with fewer)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"


def _gpus():
    from fluxpy.kernels.nccl import device_count, nccl_available
    ok, why = nccl_available()
    return device_count() if ok else 0


needs_two = pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs with NCCL")


NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _launch(nproc, *args, timeout=300):
    """Run the worker under the launcher; ``(run, seconds)``. Past ``timeout`` the launcher gets SIGTERM (it stops
    the ranks), after each rank has dumped its Python stack (``--dump-after``), and the test fails showing them."""
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    cmd = [sys.executable, "-m", "fluxpy.distributed.run", "--nproc", str(nproc), "--grace", "10", str(WORKER), *args,
           "--dump-after", str(max(timeout - 20, timeout * 0.8))]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the job ({' '.join(args)}) did not finish in {timeout} s; its output:\n{out[-8000:]}\n"
                    f"{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - start


def _weights(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


@needs_two
@pytest.mark.parametrize("options", [[], ["--bn"], ["--capture"], ["--bn", "--capture"],
                                     ["--rule", "adam", "--float64"]],
                         ids=["plain", "sync_bn", "captured", "sync_bn_captured", "adam_float64"])
def test_two_gpus_at_batch_b_give_the_weights_of_one_gpu_at_batch_2b(options, tmp_path):
    two, _ = _launch(2, "--batch", "16", "--out", str(tmp_path / "two"), *options, timeout=150)
    assert two.returncode == 0, two.stdout[-4000:] + two.stderr[-2000:]
    one, _ = _launch(1, "--batch", "32", "--out", str(tmp_path / "one"), *options, timeout=150)
    assert one.returncode == 0, one.stdout[-4000:] + one.stderr[-2000:]
    ref, r0, r1 = (_weights(tmp_path / n) for n in ("one.rank0.npz", "two.rank0.npz", "two.rank1.npz"))
    assert len(ref) == len(r0) == len(r1) > 4
    for a, b in zip(r0, r1):
        np.testing.assert_array_equal(a, b)                      # the ranks stay identical
    # and equal one GPU at twice the batch. Adam divides by the gradient's running size, so a gradient at rounding
    # level (a summation order apart) can move a weight by a whole step: its case runs in float64
    tol = dict(rtol=1e-9, atol=1e-11) if "--float64" in options else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(ref, r0):
        assert a.dtype == (np.float64 if "--float64" in options else np.float32)
        np.testing.assert_allclose(b, a, **tol)
    assert "buckets" in two.stdout


@needs_two
def test_a_rank_that_raises_makes_the_job_stop_with_an_error_naming_it():
    run, took = _launch(2, "--mode", "raise", "--steps", "8", timeout=120)
    assert took < 90, run.stdout[-3000:]
    assert run.returncode != 0
    assert "[rank 1] RuntimeError: boom on rank 1 in step 3" in run.stdout, run.stdout[-3000:]
    # the launcher names the first rank it finds stopped; rank 0 may have exited (naming rank 1) by then too
    assert "fluxpy.distributed.run: rank 1 exited with status 1" in run.stderr or \
        "[rank 0] fluxpy.distributed: rank 1 raised RuntimeError: boom on rank 1 in step 3" in run.stdout, \
        run.stdout[-3000:] + run.stderr[-2000:]


@needs_two
def test_without_the_launcher_the_other_rank_exits_naming_the_one_that_raised():
    """The watchdog's own path (torchrun and Slurm do not stop the other ranks): rank 0 is blocked in NCCL."""
    from fluxpy.distributed import free_port
    port = free_port()
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--mode", "raise", "--steps", "8"], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:   # a rank still blocked after the time limit: stop it (the test then fails)
            if p.poll() is None:
                p.kill()
                p.wait()
    assert time.monotonic() - start < 120
    assert procs[0].returncode == 1 and procs[1].returncode == 1, outs
    assert "fluxpy.distributed: rank 1 raised RuntimeError: boom on rank 1 in step 3; rank 0 exits" in outs[0], outs


@needs_two
def test_a_model_mismatch_is_detected_at_start():
    run, took = _launch(2, "--mode", "mismatch", timeout=120)
    assert run.returncode != 0
    assert "DistributedError: DataParallel: the model's structure differs between ranks: rank(s) 1 differ" in \
        run.stdout, run.stdout[-3000:]
    assert "rank 1 has layers.6.weight (11, 32) float32" in run.stdout


def _mnist_dir():
    """``FLUXPY_MNIST_DIR`` (as tests/gpu/test_precision_gpu.py) or ../shared/data/mnist."""
    given = [Path(os.environ["FLUXPY_MNIST_DIR"])] if os.environ.get("FLUXPY_MNIST_DIR") else []
    for d in (*given, ROOT.parent / "shared" / "data" / "mnist", ROOT / "shared" / "data" / "mnist"):
        if (d / "t10k-images-idx3-ubyte.gz").exists():
            return d
    return None


@needs_two
@pytest.mark.skipif(_mnist_dir() is None, reason="needs the MNIST files of shared/data/mnist")
def test_the_mnist_example_runs_under_the_launcher_and_only_rank_0_reports_and_saves(tmp_path):
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "fluxpy.distributed.run", "--nproc", "2", "examples/mnist_conv.py",
                          "--data-dir", str(_mnist_dir()), "--epochs", "2", "--device", "gpu", "--no-progress",
                          "--save", str(tmp_path / "m.npz"), "--plot", str(tmp_path / "m.png")],
                         cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "[rank 0] epoch  2/2: train loss" in run.stdout and "2 ranks (batch 128 each)" in run.stdout
    assert "[rank 1] epoch" not in run.stdout and "[rank 1] saved" not in run.stdout
    assert "[rank 0] saved" in run.stdout and (tmp_path / "m.npz").exists()
