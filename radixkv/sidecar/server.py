"""The sidecar's loop: accept clients on a Unix socket and answer their messages.

One thread runs every message (a match, an alloc, a commit are tree operations of microseconds;
the L2 tier's reads are bounded by its timeout), holding ``Sidecar.lock`` so the metrics thread
sees consistent numbers. A client's socket closing frees what it held (``Sidecar.drop_client``).

No client can hold that thread for the others. Sockets are non-blocking: a reply the client's
socket does not take at once waits in the client's queue and goes out when the socket is
writable, so a client that sends and never reads stalls nobody. While more than
``MAX_UNSENT_BYTES`` of its replies wait, its next requests wait too (they are neither read nor
handled): what it makes the sidecar hold is bounded. A client whose replies wait
``SEND_TIMEOUT_S`` without a byte taken is dropped. And the loop takes turns: at most
``FRAMES_PER_TURN`` requests of one client, then every other client with requests waiting.
A frame that breaks the format, or any exception from one client's request, drops that client
(logged); the loop serves on.

The socket file is created with mode 0600 (``mode``): only the owner's processes may attach, and
any process that can attach reads every block (docs/sidecar.md, Security).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import itertools
import logging
import os
import selectors
import signal
import socket
import stat
import threading
import time

from radixkv.sidecar import messages as m
from radixkv.sidecar.protocol import FrameBuffer, ProtocolError, encode
from radixkv.sidecar.state import Sidecar
from radixkv.tree.node import PackedTokens

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0  # a client whose replies wait this long without a byte taken is dropped
MAX_UNSENT_BYTES = 1 << 20  # replies waiting for one client past which its requests wait too
FRAMES_PER_TURN = 16  # requests of one client handled before the others get their turn
RECV_BYTES = 1 << 20
ACCEPTS_PER_TURN = 64


class ServeError(RuntimeError):
    """Why the sidecar cannot serve on its path (taken by another sidecar or by a file, or not
    creatable), in one line naming the path and what to do."""


@dataclasses.dataclass(eq=False)
class _Client:
    """One client's socket, what it sent that is not handled yet, and its replies not sent yet."""

    cid: int
    sock: socket.socket
    frames: FrameBuffer = dataclasses.field(default_factory=lambda: FrameBuffer(PackedTokens))
    out: collections.deque = dataclasses.field(default_factory=collections.deque)  # [bytes view, fds]
    unsent: int = 0  # bytes in ``out``
    since: float = 0.0  # when ``out`` last had a byte taken (or began to wait)
    pending: bool = False  # may hold a complete request not handled yet
    events: int = 0  # what the selector watches for it
    closed: bool = False

    @property
    def held_back(self) -> bool:
        """Too many of its replies wait: its requests wait too."""
        return self.unsent > MAX_UNSENT_BYTES


class Server:
    """Serves ``state`` on ``path`` until ``stop()`` (from another thread or a signal)."""

    def __init__(self, state: Sidecar, path: str, *, mode: int = 0o600) -> None:
        self.state = state
        self.path = path
        self.mode = mode
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._clients: dict[int, _Client] = {}
        self._ready: dict[_Client, None] = {}  # clients with requests to handle now, in turn order
        self._writing: set[_Client] = set()  # clients with replies waiting
        self._ids = itertools.count(1)
        self._sel: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None

    def listen(self) -> socket.socket:
        """Take the path and listen on it (``serve`` does, if not done yet); ``ServeError`` with
        one line for the user when the path is taken or cannot be made."""
        # One sidecar per path, decided by a lock held for the server's life (released by the
        # kernel when the process dies), not by probing the socket: between another sidecar's
        # bind() and listen() a probe is refused, and the path of a live sidecar was unlinked.
        path, lock = self.path, self.path + ".lock"
        try:
            self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self.mode)
        except OSError as e:
            raise ServeError(
                f"cannot create {lock} ({e.strerror or e}): give the sidecar a --socket in a directory "
                "that exists and that this user may write"
            ) from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ServeError(
                f"a sidecar is already serving {path} (it holds {lock}): stop it first, or give this one "
                "another --socket"
            ) from None
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISSOCK(mode):
            os.close(self._lock_fd)
            kind = (
                "a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode) else "a file"
            )
            raise ServeError(
                f"{path} is not a socket ({kind}): remove it, or give the sidecar another --socket"
            )
        if mode is not None:
            os.unlink(path)  # a stale socket of a sidecar that died: we hold the lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~self.mode)  # the file is born with the mode: no window of 0755
        try:
            sock.bind(path)
            os.chmod(path, self.mode)
            sock.listen(128)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            os.close(self._lock_fd)
            raise ServeError(
                f"cannot create the socket {path} ({e.strerror or e}): give the sidecar another --socket"
            ) from None
        except BaseException:
            sock.close()
            os.close(self._lock_fd)
            raise
        finally:
            os.umask(old)
        self._listener = sock
        return sock

    def close(self) -> None:
        """Give the path up (``serve`` does when it ends): the socket file goes, the lock with it."""
        if self._listener is None:
            return
        self._listener.close()
        self._listener = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._lock_fd)  # the lock goes with it; the .lock file stays (harmless)

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def serve(self) -> None:
        listener = self._listener or self.listen()
        self._sel = sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        logger.info("radixkv sidecar serving %s (mode %o)", self.path, self.mode)
        try:
            while not self._stop.is_set():
                for key, mask in sel.select(timeout=self._timeout()):
                    if key.data == "wake":
                        continue
                    if key.data is None:
                        self._accept(listener)
                    elif not key.data.closed:
                        self._guarded(key.data, self._events, mask)
                for client in list(self._ready):  # one turn each, in order
                    if not client.closed:
                        self._guarded(client, self._turn)
                self._drop_unread(time.monotonic())
        finally:
            for client in list(self._clients.values()):
                self._drop(client)
            sel.close()
            self.close()

    def _timeout(self) -> float:
        if self._ready:
            return 0.0
        if not self._writing:
            return 1.0
        due = min(c.since for c in self._writing) + SEND_TIMEOUT_S - time.monotonic()
        return min(1.0, max(0.0, due))

    def _accept(self, listener: socket.socket) -> None:
        """Take the connections waiting, up to ``ACCEPTS_PER_TURN`` (one at a time, a burst of
        connects filled the listen backlog: connects then failed with EAGAIN)."""
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = listener.accept()
            except OSError:  # none waiting (EAGAIN), or out of descriptors: try again next turn
                return
            sock.setblocking(False)
            client = _Client(next(self._ids), sock)
            self._clients[client.cid] = client
            with self.state.lock:
                self.state.add_client(client.cid)
            self._watch(client)

    def _drop(self, client: _Client) -> None:
        client.closed = True
        self._clients.pop(client.cid, None)
        self._ready.pop(client, None)
        self._writing.discard(client)
        if client.events:
            with contextlib.suppress(Exception):
                self._sel.unregister(client.sock)
        client.sock.close()
        with self.state.lock:
            self.state.drop_client(client.cid)

    def _drop_unread(self, now: float) -> None:
        for client in [c for c in self._writing if now - c.since > SEND_TIMEOUT_S]:
            logger.info(
                "client %d dropped: %d bytes of its replies went unread for %g s",
                client.cid,
                client.unsent,
                SEND_TIMEOUT_S,
            )
            self._drop(client)

    def _guarded(self, client: _Client, step, *args) -> None:
        """``step(client, *args)``; what it raises drops ``client`` alone (logged)."""
        try:
            step(client, *args)
        except (OSError, ConnectionError, ProtocolError) as e:
            if not isinstance(e, ConnectionError):
                logger.info("client %d dropped: %s", client.cid, e)
            self._drop(client)
        except Exception:  # a bug on one client's request: that client goes, the others are served
            logger.exception("client %d dropped: its request raised", client.cid)
            self._drop(client)

    def _events(self, client: _Client, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(client)
        if mask & selectors.EVENT_READ and not client.pending and not client.held_back:
            try:
                data = client.sock.recv(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                data = None
            if data == b"":
                raise ConnectionError("closed")
            if data:
                client.frames.feed(data)
                client.pending = True
        self._watch(client)

    def _turn(self, client: _Client) -> None:
        """Handle up to ``FRAMES_PER_TURN`` of ``client``'s requests (fewer if its replies pile up)."""
        for _ in range(FRAMES_PER_TURN):
            if client.held_back:
                break
            frame = client.frames.next_frame()
            if frame is None:
                client.pending = False
                break
            self._handle(client, *frame)
            if client.closed:
                return
        self._watch(client)

    def _watch(self, client: _Client) -> None:
        """Put ``client`` where its state says: in the turn order if it has requests it may send
        now, read from if not, written to while replies wait."""
        runnable = client.pending and not client.held_back
        if runnable:
            self._ready.setdefault(client, None)
        else:
            self._ready.pop(client, None)
        if client.out:
            self._writing.add(client)
        else:
            self._writing.discard(client)
        want = (0 if client.pending or client.held_back else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if client.out else 0
        )
        if want == client.events:
            return
        if not client.events:
            self._sel.register(client.sock, want, client)
        elif not want:
            self._sel.unregister(client.sock)
        else:
            self._sel.modify(client.sock, want, client)
        client.events = want

    def _reply(self, client: _Client, header: dict, fds: list[int] | None = None) -> None:
        data = encode(header)
        if not client.out:
            client.since = time.monotonic()
        client.out.append([memoryview(data), fds])
        client.unsent += len(data)
        self._flush(client)

    def _flush(self, client: _Client) -> None:
        """Send what ``client``'s socket takes now, without waiting (the fds with the first byte)."""
        while client.out:
            item = client.out[0]
            data, fds = item
            try:
                sent = socket.send_fds(client.sock, [data], fds) if fds else client.sock.send(data)
            except (BlockingIOError, InterruptedError):
                return
            client.unsent -= sent
            client.since = time.monotonic()
            if sent < len(data):
                item[0], item[1] = data[sent:], None
                return
            client.out.popleft()

    def _handle(self, client: _Client, header: dict, body: bytes) -> None:
        cid = client.cid
        try:
            request = m.parse_request(header, body)
        except m.BadRequest as e:
            if e.replies:
                self._reply(client, {"error": str(e)})
            else:
                logger.info("client %d: %s", cid, e)
            return
        op = request.op_name
        try:
            with self.state.lock:
                reply = self._run(cid, request, body)
        except (ValueError, TypeError) as e:  # refused by the state (no hello yet, no such txn, ...)
            if not request.REPLIES:
                logger.info("client %d: %s refused: %s", cid, op, e)
                return
            reply = {"error": f"{op}: {e}"}
        if reply is not None:
            fd = reply.pop("fd", None)  # the hello's: its pool's memory file
            self._reply(client, reply, None if fd is None else [fd])

    def _run(self, cid: int, request: m.Request, body: bytes) -> dict | None:
        """Do one request (under the state's lock; ``body``: its tokens, for the ops that take
        them); its reply, None for ops that get none."""
        state = self.state
        match request:
            case m.Hello(layout=layout):
                pool = state.hello(cid, layout)
                reply = {
                    "num_blocks": pool.num_blocks,
                    "pool_bytes": pool.geometry.total_bytes,
                    "fd": pool.fd,
                }
                if pool.num_slots:
                    reply["num_slots"] = pool.num_slots
                return reply
            case m.Match():
                return state.match(cid, request.namespace, body, request.have, request.claim)
            case m.Release(lease=lease):
                state.release(cid, lease)
            case m.Alloc():
                return state.alloc(cid, request.namespace, body, request.snaps)
            case m.Commit(txn=txn):
                return state.commit_reply(cid, txn)
            case m.Abort(txn=txn):
                state.abort(cid, txn)
            case m.Stats():
                return {"stats": state.stats()}
            case _:
                raise AssertionError(f"no handler for {request!r}")  # a request type added without one
        return None


def install_signal_handlers(server: Server) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
