"""The fault watchdog of a process group: a thread per rank that turns a peer's death, a peer's exception or a
collective that never finishes into an error naming the rank, and ends this process instead of letting it hang. It
watches the rendezvous connections (rank 0 holds one to every rank, the others one to rank 0), which stay open for
the whole job. Frames after the rendezvous: ``E`` + text (a rank failed; rank 0 forwards it to the others), ``Q`` (a
rank is leaving cleanly, at exit) and ``D`` (data of the tcp backend's collectives, queued for it). A connection
that closes without ``Q`` is a rank that died. A rank whose code raises sends ``E`` naming itself and its exception
before it exits (:meth:`Watchdog.install_excepthook`). Collectives the group queues are tracked
(:meth:`Watchdog.track`): one still unfinished after ``collective_timeout`` seconds, or ``left_grace`` seconds after
a peer left, fails the job too, and so does an asynchronous NCCL error (``async_error``, polled:
``ncclCommGetAsyncError``).

Failing means: say why on stderr (``fluxpy.distributed: rank 1 raised RuntimeError: boom; rank 0 exits``), tell the
peers, abort the communicator (``ncclCommAbort``, so nothing stays blocked on the GPU), and ``os._exit(1)``.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import os
import queue
import selectors
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .rendezvous import ERROR, Group, _recv_frame, _send_quiet

LEAVE = b"Q"
DATA = b"D"    # the tcp backend's collectives (fluxpy.distributed.tcp), handed to it through inbox(rank)
EXIT_STATUS = 1


class Watchdog:
    """Watches ``group``'s connections and the collectives given to :meth:`track`; ``abort`` (the communicator's
    abort, or None) runs before this process exits on a fault. ``exit`` is called with the status (``os._exit`` by
    default; tests pass their own). Start it with :meth:`start`; :meth:`close` says goodbye to the peers.

    >>> from fluxpy.distributed.rendezvous import rendezvous
    >>> dog = Watchdog(rendezvous(0, 1), abort=None)
    >>> dog.start(); dog.close(); dog.failure is None
    True
    """

    def __init__(self, group: Group, abort: Callable[[], None] | None, *, collective_timeout: float = 600.0,
                 left_grace: float = 30.0, poll: float = 0.2, remote_grace: float = 2.0, abort_timeout: float = 10.0,
                 async_error: Callable[[], str | None] | None = None, exit: Callable[[int], Any] | None = None) -> None:
        self.group, self.abort, self.async_error = group, abort, async_error
        self.rank = group.rank
        self.collective_timeout, self.left_grace, self.poll = float(collective_timeout), float(left_grace), poll
        self.remote_grace, self.abort_timeout = float(remote_grace), float(abort_timeout)
        self._exit = exit if exit is not None else os._exit
        self.pending: collections.deque = collections.deque()   # (work, what, started)
        self.left: dict[int, float] = {}                           # rank -> when it said it was leaving
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._inboxes: dict[int, queue.Queue] = {}
        self.send_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the main thread's side -------------------------------------------------------------------------

    def start(self) -> None:
        """Start watching (a daemon thread), and say goodbye to the peers at a normal interpreter exit."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"fluxpy-watchdog-{self.rank}", daemon=True)
            self._thread.start()
            atexit.register(self.close)

    def track(self, work: Any, what: str) -> None:
        """Watch a queued collective (anything with ``done() -> bool``) until it finishes."""
        with self._lock:
            self.pending.append((work, what, time.monotonic()))

    def inbox(self, rank: int) -> queue.Queue:
        """The ``D`` frames received from ``rank``, in order (for the tcp backend)."""
        with self._lock:
            box = self._inboxes.get(rank)
            if box is None:
                box = self._inboxes[rank] = queue.Queue()
            return box

    def install_excepthook(self) -> None:
        """An uncaught exception in this process (main thread or another) tells the peers which rank raised and
        what, before this process exits; the traceback is printed as usual."""
        previous, previous_thread = sys.excepthook, threading.excepthook

        def hook(kind, value, tb):
            previous(kind, value, tb)
            self._fail_local(f"rank {self.rank} raised {kind.__name__}: {value}")

        def thread_hook(args):
            previous_thread(args)
            if args.exc_type is not SystemExit:
                self._fail_local(f"rank {self.rank} raised {args.exc_type.__name__} in thread "
                                 f"{getattr(args.thread, 'name', '?')}: {args.exc_value}")
        sys.excepthook, threading.excepthook = hook, thread_hook

    def close(self) -> None:
        """Leave cleanly: tell the peers (``Q``), stop watching, close the connections (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.failure is None:
            for sock in list(self.group.peers.values()):
                _send_quiet(sock, LEAVE)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll + 1)
        self.group.close()

    # -- the watching thread ----------------------------------------------------------------------------

    def _run(self):
        with selectors.DefaultSelector() as sel:
            for rank, sock in self.group.peers.items():
                sel.register(sock, selectors.EVENT_READ, rank)
            while not self._stop.is_set():
                for key, _ in sel.select(self.poll) if sel.get_map() else []:
                    self._message(sel, key)
                    if self._stop.is_set():
                        return
                if not sel.get_map():
                    time.sleep(self.poll)
                self._check_collectives()

    def _message(self, sel, key):
        rank = key.data
        try:
            frame = _recv_frame(key.fileobj, time.monotonic() + 5.0)
        except (OSError, EOFError, ConnectionError, TimeoutError):
            sel.unregister(key.fileobj)
            if self._stop.is_set() or rank in self.left:
                return
            self._fail_remote(f"rank {rank} died (its connection closed without a clean exit)", origin=rank)
            return
        kind = frame[:1]
        if kind == DATA:
            self.inbox(rank).put(frame[1:])
        elif kind == LEAVE:
            self.left[rank] = time.monotonic()
        elif kind == ERROR:
            self._fail_remote(frame[1:].decode("utf-8", "replace"), origin=rank)

    def _check_collectives(self):
        if self.async_error is not None:
            try:
                error = self.async_error()
            except Exception as err:   # the query itself failed: say so rather than hide it
                error = f"{type(err).__name__}: {err}"
            if error and not self._stop.is_set():
                self._fail_local(f"rank {self.rank}: NCCL reports {error} (ncclCommGetAsyncError): a peer or the "
                                 "link to it failed")
                return
        now = time.monotonic()
        with self._lock:
            while self.pending and _finished(self.pending[0][0]):
                self.pending.popleft()
            oldest = self.pending[0] if self.pending else None
        if oldest is None:
            return
        _, what, started = oldest
        waited = now - started
        if waited > self.collective_timeout:
            self._fail_local(f"rank {self.rank}: the collective {what} did not finish in {self.collective_timeout:g} "
                             "s; another rank did not join it (stuck, or on another code path)")
        elif self.left:
            gone = min(self.left.values())
            if now - max(gone, started) > self.left_grace:
                ranks = ", ".join(str(r) for r in sorted(self.left))
                self._fail_local(f"rank {self.rank}: the collective {what} waits for rank(s) {ranks}, which left the "
                                 f"job (exited) {now - gone:.0f} s ago")

    # -- failing ----------------------------------------------------------------------------------------

    def _fail_local(self, why):
        """This rank failed: tell the peers (rank 0 tells everyone), then stop."""
        self._fail(why, tell=list(self.group.peers), grace=0.0)

    def _fail_remote(self, why, origin):
        """Another rank failed: rank 0 passes the word on to everyone but the origin; then stop, after
        ``remote_grace`` seconds in which this rank's own error (the same fault seen here, such as a model
        mismatch) may still be printed by its main thread."""
        tell = [r for r in self.group.peers if r != origin] if self.rank == 0 else []
        self._fail(why, tell=tell, grace=self.remote_grace)

    def _fail(self, why, tell, grace):
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = why
        self._stop.set()
        if first:
            for rank in tell:
                sock = self.group.peers.get(rank)
                if sock is not None:
                    _send_quiet(sock, ERROR + why.encode("utf-8", "replace")[:1 << 16])
            with contextlib.suppress(Exception):
                sys.stderr.write(f"fluxpy.distributed: {why}; rank {self.rank} exits\n")
                sys.stderr.flush()
                sys.stdout.flush()
        if grace > 0:
            time.sleep(grace)
        if self.abort is not None:   # in a thread of its own: an abort that blocks must not keep this process alive
            aborting = threading.Thread(target=_quietly, args=(self.abort,), name="fluxpy-abort", daemon=True)
            aborting.start()
            aborting.join(self.abort_timeout)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        self._exit(EXIT_STATUS)


def _quietly(fn):
    with contextlib.suppress(Exception):
        fn()


def _finished(work):
    try:
        return bool(work.done())
    except Exception:   # an aborted communicator's event: nothing left to wait for
        return True


def format_exception(err: BaseException) -> str:
    """``Type: message`` of an exception, on one line (what the peers are told).

    >>> format_exception(ValueError("bad\\nthing"))
    'ValueError: bad thing'
    """
    return " ".join(traceback.format_exception_only(type(err), err)[-1].split())
