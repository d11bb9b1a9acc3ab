"""``python -m fluxpy.distributed.run --nproc N [--master-port P] script.py args...``: N local ranks.

Each rank runs ``python script.py args...`` with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
(127.0.0.1) and ``MASTER_PORT`` set (a free port unless ``--master-port`` is given). Their output (stdout and
stderr together) is streamed line by line, each line prefixed ``[rank k]``. If a rank exits with a non-zero
status the others are terminated (SIGTERM, then SIGKILL after ``--grace`` seconds) and the launcher exits with
an error naming that rank and its status; it exits 0 when every rank does. A SIGTERM or SIGHUP sent to the
launcher (a batch system's time limit, a benchmark's timeout) stops every rank the same way before it exits, so
that no rank is left running on a GPU.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from .rendezvous import free_port

MASTER_ADDR = "127.0.0.1"


def rank_env(base: Mapping[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """``base`` plus the launcher variables for ``rank`` of ``nproc`` on this machine.

    >>> env = rank_env({"PATH": "/bin"}, rank=1, nproc=2, port=29500)
    >>> [env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")]
    ['1', '1', '2', '127.0.0.1', '29500']
    """
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR=MASTER_ADDR,
               MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    return env


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's arguments: ``nproc``, ``master_port``, ``grace``, ``script`` and its ``args``.

    >>> a = parse_args(["--nproc", "2", "train.py", "--lr", "0.1"])
    >>> a.nproc, a.script, a.args
    (2, 'train.py', ['--lr', '0.1'])
    """
    p = argparse.ArgumentParser(prog="python -m fluxpy.distributed.run",
                                description="Start N local fluxpy ranks of one data-parallel job.")
    p.add_argument("--nproc", type=_positive_int, required=True, help="number of processes (ranks), >= 1")
    p.add_argument("--master-port", type=_port, default=None, help="rank 0's rendezvous port (default: a free one)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the other ranks (default 5)")
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p.parse_args(argv)


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return value


def _port(text):
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 1..65535, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job described by ``argv`` (``sys.argv[1:]`` by default); the exit status for the launcher.

    0 when every rank exits 0; otherwise the first failing rank's status (128 + signal number for a signal),
    after an error line on stderr naming it and the ranks stopped.

    >>> main(["--nproc", "1", "--master-port", "1", "/nonexistent/script.py"])
    Traceback (most recent call last):
    ...
    FileNotFoundError: fluxpy.distributed.run: no script /nonexistent/script.py
    """
    args = parse_args(argv)
    if not os.path.isfile(args.script):
        raise FileNotFoundError(f"fluxpy.distributed.run: no script {args.script}")
    port = args.master_port or free_port(MASTER_ADDR)
    procs = [_start(args, rank, port) for rank in range(args.nproc)]
    pumps = [threading.Thread(target=_pump, args=(p, rank), daemon=True) for rank, p in enumerate(procs)]
    for t in pumps:
        t.start()
    handled = (signal.SIGTERM, signal.SIGHUP) if threading.current_thread() is threading.main_thread() else ()
    previous = {sig: signal.signal(sig, _terminated) for sig in handled}
    try:
        status = _watch(procs, args.grace)
    except KeyboardInterrupt:
        _stop(procs, args.grace)
        status = 130
    except _Terminated as why:
        _stop(procs, args.grace)
        print(f"fluxpy.distributed.run: {why}; stopped every rank", file=sys.stderr, flush=True)
        status = 128 + why.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for t in pumps:
        t.join(timeout=1.0)
    return status


class _Terminated(Exception):
    """The launcher itself was asked to stop (SIGTERM or SIGHUP)."""

    def __init__(self, signum):
        super().__init__(f"the launcher received {signal.Signals(signum).name}")
        self.signum = signum


def _terminated(signum, frame):
    raise _Terminated(signum)


def _start(args, rank, port):
    return subprocess.Popen([sys.executable, "-u", args.script, *args.args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=rank_env(os.environ, rank, args.nproc, port),
                            start_new_session=True)


def _pump(proc, rank):
    """Copy ``proc``'s output to ours, a line at a time, each prefixed with its rank."""
    prefix = f"[rank {rank}] ".encode()
    out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
    for line in iter(proc.stdout.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with _OUTPUT_LOCK:
            if out is not None:
                out.write(prefix + line)
                out.flush()
            else:
                sys.stdout.write((prefix + line).decode("utf-8", "replace"))
    proc.stdout.close()


_OUTPUT_LOCK = threading.Lock()


def _watch(procs, grace):
    """Wait for every rank; at the first non-zero exit stop the others and return its status."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            running = [r for r, c in enumerate(codes) if c is None]
            _stop(procs, grace)
            stopped = f"; stopped {_names(running)}" if running else ""
            print(f"fluxpy.distributed.run: rank {rank} {_describe_exit(code)}{stopped}", file=sys.stderr,
                  flush=True)
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.02)


def _stop(procs, grace):
    """SIGTERM every running rank (its whole process group), then SIGKILL those still there after ``grace``."""
    for p in procs:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()


def _signal(proc, sig):
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)   # the rank and anything it started (its own session)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_exit(code):
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _names(ranks):
    return (f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks)))


if __name__ == "__main__":
    sys.exit(main())
