"""A small TCP rendezvous: rank 0 listens, every other rank connects, receives rank 0's payload, and barriers.

The payload is bytes (later, NCCL's unique id). Messages are length-prefixed frames: a 4-byte big-endian
length, then a 1-byte kind and the body. Nothing is unpickled: a hello is packed with ``struct``, an error is
UTF-8 text, and frames longer than :data:`MAX_FRAME` are refused. Every wait has a deadline; a rank that does
not arrive, or whose connection closes, makes the others raise :class:`RendezvousError` naming it.
"""
from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import time

MAGIC = b"FLXR"
VERSION = 1
MAX_FRAME = 1 << 20
DEFAULT_TIMEOUT = 300.0
_HELLO = struct.Struct(">4sBII")   # magic, version, rank, world_size
_LENGTH = struct.Struct(">I")
HELLO, PAYLOAD, BARRIER, ERROR = b"H", b"P", b"B", b"E"


class RendezvousError(RuntimeError):
    """The rendezvous or a barrier failed; ``missing`` lists the ranks that did not arrive (or died), if known.

    >>> RendezvousError("rank 2 did not arrive", missing=(2,)).missing
    (2,)
    """

    def __init__(self, message: str, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it; another process may take it after).

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous(rank: int, world_size: int, addr: str = "127.0.0.1", port: int = 29500, payload: bytes | None = None,
               timeout: float = DEFAULT_TIMEOUT) -> Group:
    """Meet the other ranks; returns a :class:`Group` whose ``payload`` is rank 0's ``payload`` on every rank.

    Rank 0 listens on ``addr:port`` and waits for ranks ``1 .. world_size - 1`` to connect (each says its rank
    and world size; a duplicate, out-of-range or mismatched one is refused); then it sends them ``payload``
    (bytes, ``b""`` for ``None``). Other ranks pass ``payload=None`` and retry connecting until ``timeout``
    seconds have passed (rank 0 may start later). After ``timeout`` rank 0 raises a :class:`RendezvousError`
    naming the ranks that did not arrive, and tells those that did; a rank that cannot reach rank 0 raises one
    naming rank 0. One rank alone returns at once.

    >>> import threading
    >>> port = free_port()
    >>> got = {}
    >>> t = threading.Thread(target=lambda: got.setdefault(1, rendezvous(1, 2, port=port, timeout=10)))
    >>> t.start()
    >>> with rendezvous(0, 2, port=port, payload=b"nccl-id", timeout=10) as group:
    ...     t.join()
    ...     with got[1]:
    ...         got[1].payload
    b'nccl-id'
    """
    _check_ranks(rank, world_size)
    if rank == 0:
        if payload is not None and not isinstance(payload, (bytes, bytearray)):
            raise TypeError(f"rendezvous: rank 0's payload must be bytes or None, got {type(payload).__name__}")
        return _serve(world_size, addr, port, bytes(payload or b""), timeout)
    if payload is not None:
        raise ValueError(f"rendezvous: only rank 0 publishes a payload; rank {rank} passed one")
    return _join(rank, world_size, addr, port, timeout)


def _check_ranks(rank, world_size):
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"rendezvous: {name} must be an int, got {type(value).__name__} {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rendezvous: expects world_size >= 1 and 0 <= rank < world_size, got rank {rank} of "
                         f"{world_size}")


class Group:
    """The ranks after a :func:`rendezvous`: ``rank``, ``world_size``, rank 0's ``payload``, :meth:`barrier`
    and :meth:`close` (also a context manager). Rank 0 holds one connection per other rank; the others one.

    >>> with rendezvous(0, 1, payload=b"x") as g:
    ...     g.barrier()
    ...     (g.rank, g.world_size, g.payload)
    (0, 1, b'x')
    """

    def __init__(self, rank: int, world_size: int, payload: bytes, peers: dict[int, socket.socket],
                 timeout: float) -> None:
        self.rank, self.world_size, self.payload = rank, world_size, payload
        self.peers = peers   # rank -> socket (rank 0: every other rank; else {0: rank 0})
        self.timeout = timeout

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every rank has called ``barrier``; a :class:`RendezvousError` naming the ranks that did
        not (or whose connection closed) after ``timeout`` seconds (the group's by default).

        >>> with rendezvous(0, 1) as g:
        ...     g.barrier(timeout=1.0)
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        if self.world_size == 1:
            return
        if self.rank == 0:
            arrived = _gather(self.peers, BARRIER, deadline, "the barrier")
            for sock in arrived.values():
                _send(sock, BARRIER)
        else:
            sock = self.peers[0]
            _send(sock, BARRIER)
            _expect(sock, BARRIER, deadline, f"rank {self.rank}", "the barrier")

    def close(self) -> None:
        """Close every connection (idempotent).

        >>> g = rendezvous(0, 1); g.close(); g.close()
        """
        for sock in self.peers.values():
            with contextlib.suppress(OSError):
                sock.close()
        self.peers = {}

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, world_size={self.world_size}, payload={len(self.payload)} bytes)"


# ------------------------------------------------------------------------------------------------
# Rank 0

def _serve(world_size, addr, port, payload, timeout):
    if world_size == 1:
        return Group(0, 1, payload, {}, timeout)
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((addr, port))
        except OSError as err:
            raise RendezvousError(f"rendezvous: rank 0 cannot listen on {addr}:{port} ({err}); is MASTER_PORT "
                                  "in use by another job?") from err
        server.listen(world_size)
        peers = _accept_all(server, world_size, deadline)
    for sock in peers.values():
        _send(sock, PAYLOAD + payload)
    return Group(0, world_size, payload, peers, timeout)


def _accept_all(server, world_size, deadline):
    """Connections from ranks 1 .. world_size - 1 by ``deadline``; on failure every arrived rank is told why."""
    peers = {}
    try:
        while len(peers) < world_size - 1:
            server.settimeout(max(deadline - time.monotonic(), 0.0) or 1e-3)
            try:
                sock, _ = server.accept()
            except TimeoutError:
                missing = tuple(r for r in range(1, world_size) if r not in peers)
                raise RendezvousError(f"rendezvous timed out at {_where(server)}: {_ranks(missing)} of world_size "
                                      f"{world_size} did not arrive", missing) from None
            rank = _hello(sock, world_size, peers, deadline)
            if rank is not None:
                peers[rank] = sock
    except RendezvousError as err:
        _abort(peers, str(err))
        raise
    return peers


def _hello(sock, world_size, peers, deadline):
    """The rank a new connection says it is; ``None`` (connection dropped) for a stranger or a bad hello."""
    try:
        body = _recv_kind(sock, HELLO, deadline)
        magic, version, rank, their_world = _HELLO.unpack(body)
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"not a fluxpy rendezvous hello (magic {magic!r}, version {version})")
    except (OSError, EOFError, ValueError, struct.error, RendezvousError):
        sock.close()
        return None
    problem = None
    if their_world != world_size:
        problem = f"rank {rank} says world_size {their_world}, rank 0 has {world_size}"
    elif not 1 <= rank < world_size:
        problem = f"rank {rank} is out of range for world_size {world_size}"
    elif rank in peers:
        problem = f"rank {rank} arrived twice (two processes with the same RANK?)"
    if problem is not None:
        _send_quiet(sock, ERROR + f"rendezvous refused: {problem}".encode())
        sock.close()
        raise RendezvousError(f"rendezvous: {problem}", ())
    return rank


def _gather(peers, kind, deadline, what):
    """Wait for one ``kind`` frame from every peer; a :class:`RendezvousError` naming those missing or dead."""
    pending, arrived, dead = dict(peers), {}, []
    with selectors.DefaultSelector() as sel:
        for rank, sock in pending.items():
            sel.register(sock, selectors.EVENT_READ, rank)
        while pending and not dead:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                rank = key.data
                sel.unregister(key.fileobj)
                try:
                    _recv_kind(key.fileobj, kind, deadline)
                    arrived[rank] = pending.pop(rank)
                except (OSError, EOFError, RendezvousError):
                    dead.append(rank)
                    pending.pop(rank)
    if dead or pending:
        message = _failure(sorted(dead), sorted(pending), what)
        _abort({r: s for r, s in peers.items() if r not in dead}, message)
        raise RendezvousError(message, tuple(sorted(dead + list(pending))))
    return arrived


def _failure(dead, late, what):
    parts = []
    if dead:
        parts.append(f"{_ranks(dead)} closed the connection (exited or crashed)")
    if late:
        parts.append(f"{_ranks(late)} did not reach {what} in time")
    return f"{what} failed: " + "; ".join(parts)


def _abort(peers, message):
    """Tell every connected rank why the rendezvous failed, then close."""
    for sock in peers.values():
        _send_quiet(sock, ERROR + message.encode("utf-8", "replace")[:MAX_FRAME - 1])
        with contextlib.suppress(OSError):
            sock.close()


# ------------------------------------------------------------------------------------------------
# Ranks 1 ..

def _join(rank, world_size, addr, port, timeout):
    deadline = time.monotonic() + timeout
    sock = _connect(rank, addr, port, deadline)
    try:
        _send(sock, HELLO + _HELLO.pack(MAGIC, VERSION, rank, world_size))
        payload = _expect(sock, PAYLOAD, deadline, f"rank {rank}", "the rendezvous")
    except BaseException:
        sock.close()
        raise
    return Group(rank, world_size, payload, {0: sock}, timeout)


def _connect(rank, addr, port, deadline):
    """A connection to rank 0, retried until ``deadline`` (rank 0 may not be listening yet)."""
    last = None
    while True:
        try:
            return socket.create_connection((addr, port), timeout=max(deadline - time.monotonic(), 0.05))
        except OSError as err:
            last = err
        if time.monotonic() >= deadline:
            raise RendezvousError(f"rendezvous: rank {rank} could not reach rank 0 at {addr}:{port} in time "
                                  f"({last}); rank 0 did not arrive", (0,))
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))


def _expect(sock, kind, deadline, me, what):
    """The body of the next frame from rank 0, which must be ``kind``; rank 0's error or silence raises."""
    try:
        return _recv_kind(sock, kind, deadline)
    except TimeoutError:
        raise RendezvousError(f"{me}: rank 0 did not complete {what} in time", (0,)) from None
    except (ConnectionError, EOFError, OSError) as err:
        raise RendezvousError(f"{me}: rank 0 closed the connection during {what} ({err or 'EOF'}); rank 0 exited "
                              "or crashed", (0,)) from None


# ------------------------------------------------------------------------------------------------
# Frames

def _send(sock, frame):
    sock.sendall(_LENGTH.pack(len(frame)) + frame)


def _send_quiet(sock, frame):
    with contextlib.suppress(OSError):
        _send(sock, frame)


def _recv_kind(sock, kind, deadline):
    """The body of one frame of ``kind``; an ``E`` frame raises :class:`RendezvousError` with its text."""
    frame = _recv_frame(sock, deadline)
    if frame[:1] == ERROR:
        raise RendezvousError(frame[1:].decode("utf-8", "replace"))
    if frame[:1] != kind:
        raise ConnectionError(f"expected a {kind!r} frame, got {frame[:1]!r}")
    return frame[1:]


def _recv_frame(sock, deadline):
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline))
    if not 1 <= length <= MAX_FRAME:
        raise ConnectionError(f"frame of {length} bytes (expected 1 .. {MAX_FRAME})")
    return _recv_exact(sock, length, deadline)


def _recv_exact(sock, n, deadline):
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(left)
        chunk = sock.recv(min(n - got, 1 << 16))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _ranks(ranks):
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _where(server):
    host, port = server.getsockname()[:2]
    return f"{host}:{port}"
